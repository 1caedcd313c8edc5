"""No decoder reads a device value back inside an iteration: the generate loop's one read-back
(tokens, accepted count and lengths together) is the only host synchronisation (DESIGN.md 7).

On a GPU every ``.item()`` / ``int(t)`` / ``float(t)`` / ``if t:``, 0-d tensor used as an index,
or data-dependent shape (``nonzero``, boolean masks) stalls the host until the device is done. The
same calls reach the dispatcher on the CPU as the ops counted here, so this CPU test catches
them; ``test_phase_timer.py::test_one_host_sync_per_iteration_on_gpu`` checks a real GPU.
"""

from __future__ import annotations

import collections
import traceback

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from mtad_energy.decoding.generate import generate_ids
from mtad_energy.decoding.registry import DECODERS, get_decoder

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal",
            "aten.masked_select", "aten.item")


class CountSyncs(TorchDispatchMode):
    """Counts host-reading ops, with the library line that issued each."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).rsplit(".", 1)[0] in SYNC_OPS:
            frames = [f for f in traceback.extract_stack() if "mtad_energy" in f.filename]
            where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
            self.sites[f"{func} at {where}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(DECODERS))
def test_no_host_sync_inside_an_iteration(llama_pair, name):
    # top_k=0: Spectr's rho shortcut, which counts q's nonzeros on the host on the CPU only
    # (never on a GPU, see spectr_rho), stays out of the count
    decoder = get_decoder(name, top_k=0, top_p=1.0)
    with CountSyncs() as counter:
        gen = generate_ids(decoder, llama_pair, [5, 6, 7, 8, 9], 16, seed=0,
                           compute_perplexity=False)
    syncs = counter.sites
    if name == "bild":  # BiLD decides after every draft token whether to go on drafting: one
        # read of max ~q per draft token is its algorithm, not bookkeeping (and nothing else)
        assert set(syncs) <= {s for s in syncs if "bild.py" in s}
        assert sum(syncs.values()) <= gen.stats.draft_forwards
    else:
        assert not syncs, f"{name}: {sum(syncs.values())} host reads in {gen.stats.iterations} " \
                          f"iterations: {dict(syncs)}"
