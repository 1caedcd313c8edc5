"""Where the generate loop's one host read per iteration is, for the tests that hold decoders to
it: `test_host_syncs` (the CPU, counted by `measure.host_work`) and `test_phase_timer`'s GPU test
(CUDA's sync detection). Both classify a read by the code object of the loop's read-back, so
moving or renaming it cannot leave one of them looking in the wrong place."""

from __future__ import annotations

from mtad_energy.decoding.runtime.generate import _read_back

READ_BACK = _read_back.__code__


def at_read_back(filename: str, function: str) -> bool:
    """Whether a frame (its file and function name) is the loop's read-back."""
    return function == READ_BACK.co_name and filename == READ_BACK.co_filename


def site_at_read_back(site: str) -> bool:
    """Whether a `measure.host_work.HostWorkSites` site ("decoding/runtime/generate.py:LINE FUNCTION
    OP") is the loop's read-back."""
    where, function = site.split(" ")[:2]
    return (function == READ_BACK.co_name
            and READ_BACK.co_filename.endswith("/" + where.rsplit(":", 1)[0]))
