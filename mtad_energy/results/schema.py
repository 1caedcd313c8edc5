"""The tables of a results store and their columns (units in the names: _s, _j, _w).

Rows are plain dicts so a table can grow columns (e.g. one ``param_<name>`` column per decoder
parameter) without a schema migration; `TABLES` names the columns every row must have.

- ``runs``:  one row per (prompt, decoder, parameters, repeat) of a profile/compare/param sweep.
- ``steps``: one row per decoder iteration of a run (accepted-length histograms), keyed by run_key.
- ``batch``: one row per batch size of a batch-size sweep (fixed number of target forwards).
- ``ops``:   FLOP/byte accounting of one profiled generation (or one batch run) per configuration:
             the T_flop / T_mem fractions the energy decomposition needs.
- ``decode_batch``: one row per (decoder, parameters, batch size, repeat) of the decoding
             batch-size sweep (B sequences decoded together).

Rows of ``runs`` and ``decode_batch`` also carry ``engine`` (hf, llamacpp, vllm),
``engine_version`` and ``engine_config`` (JSON): what generated them (`mtad_energy.engines`);
optional, so stores written before them still load (their rows are hf's). And the host work per
decode iteration of their configuration, counted in its untimed warm-up (`measure.host_work`):
``host_ops_per_iter``, ``graph_calls_per_iter``, ``host_reads_per_iter`` (None for an engine's
rows; missing in rows stored before them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 2  # 2: a table may also hold compacted files (<table>/packs/); 1 had part files only
READABLE_SCHEMA_VERSIONS = (1, 2)  # a schema-1 store is read as is and upgraded by its first compaction


# what other processes took during a row's windows (`measure.contention`): CPU seconds, their mean
# core-equivalents, and whether the machine was busy (rows stored before these columns: missing)
CONTENTION = ("others_cpu_s", "others_cores", "contended")


@dataclass(frozen=True)
class TableSpec:
    name: str
    key: str  # the column that identifies a row (and names its part file)
    required: tuple[str, ...]
    doc: str


RUNS = TableSpec("runs", "run_key", (
    "run_key", "sweep", "created_unix_s", "env_id", "model", "target_id", "draft_id", "decoder",
    "params_json", "dataset", "prompt_id", "max_new_tokens", "seed", "repeat", "meter", "device",
    "dtype", "prompt_len", "tokens_emitted", "iterations", "draft_proposed", "draft_accepted",
    "draft_forwards", "target_forwards", "prefill_time_s", "decode_time_s", "time_draft_s",
    "time_target_s", "time_other_s", "tokens_per_s", "block_efficiency", "acceptance_rate",
    "perplexity", "stop_reason", "energy_j", "prefill_energy_j", "decode_energy_j",
    "energy_per_token_j", "energy_reason", "energy_flags", "mitigated", "text", *CONTENTION,
), "one row per (prompt, decoder, parameters, repeat)")

STEPS = TableSpec("steps", "run_key", (
    "run_key", "iteration", "emitted", "proposed", "accepted", "draft_forwards", "target_forwards",
), "one row per decoder iteration (the runner also stores time_draft_s, time_target_s and "
   "time_other_s; optional, so stores written before them still load); part files hold all "
   "iterations of one run")

BATCH = TableSpec("batch", "row_key", (
    "row_key", "sweep", "created_unix_s", "env_id", "model", "target_id", "batch_size", "runs",
    "forwards_per_run", "context_len", "meter", "device", "dtype", "time_s", "energy_j",
    "energy_per_run_j", "energy_per_input_j", "time_per_run_s", "time_per_input_s", "energy_reason",
    "energy_flags", "t_flop_s", "t_mem_s", "t_other_s",
), "one row per batch size of a batch-size sweep")

OPS = TableSpec("ops", "ops_key", (
    "ops_key", "created_unix_s", "env_id", "model", "target_id", "draft_id", "decoder", "params_json",
    "device", "dtype", "tokens", "flops", "bytes", "wall_time_s", "t_flop_s", "t_mem_s", "t_other_s",
    "ridge_flop_per_byte",
), "FLOP/byte accounting of one profiled generation per (model, decoder, parameters)")

DECODE_BATCH = TableSpec("decode_batch", "row_key", (
    "row_key", "created_unix_s", "env_id", "model", "target_id", "draft_id", "decoder",
    "params_json", "label", "batch_size", "dataset", "prompts", "max_new_tokens", "seed", "repeat",
    "meter", "device", "dtype", "tokens", "decode_time_s", "tokens_per_s", "iterations",
    "target_forwards", "draft_forwards", "block_efficiency", "acceptance_rate", "perplexity",
    "energy_j", "energy_per_token_j", "energy_reason", "energy_flags", *CONTENTION,
), "one row per (decoder, parameters, batch size, repeat) of a decoding batch-size sweep: B rows "
   "decoded together, tokens and energy of all of them")

TABLES: dict[str, TableSpec] = {t.name: t for t in (RUNS, STEPS, BATCH, OPS, DECODE_BATCH)}


def stable_key(identity: Mapping[str, Any]) -> str:
    """16 hex digits identifying a row by what was asked for (not by what was measured), so a
    re-run of the same command finds the rows it already has."""
    blob = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def params_json(params: Mapping[str, Any]) -> str:
    """Decoder parameters as canonical JSON (sorted keys), the form stored and compared."""
    return json.dumps(dict(params), sort_keys=True, default=str, separators=(",", ":"))


# -- rows whose joules measured nothing the models did ---------------------------------------------
FLAG_WORK_UNSEEN = "work-unseen"  # `measure.simulated.FLAG_WORK_UNSEEN` (results never imports measure)
WORK_UNSEEN_REASON = ("work-unseen: the simulated meter cannot see compiled forwards (--compile), "
                      "its joules would be static power x time alone: drop --compile for modelled "
                      "joules, or measure with a real meter")


def row_flags(value: Any) -> set[str]:
    """A row's ``energy_flags`` (a JSON list, or missing) as a set of flag codes."""
    if isinstance(value, list | tuple | set):
        return set(map(str, value))
    if not isinstance(value, str) or not value:
        return set()
    try:
        parsed = json.loads(value)
    except ValueError:
        return {value}
    return set(map(str, parsed)) if isinstance(parsed, list) else set()


def is_energy_column(name: str) -> bool:
    """A column that holds joules (``*_j``: energy_j, decode_energy_j, energy_per_token_j, ...)."""
    return name.endswith("_j")


def without_unseen_energy(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its joules n/a (None) and `WORK_UNSEEN_REASON` when its energy is flagged
    `FLAG_WORK_UNSEEN`: those joules are static power x time, not the models' work, so no table,
    fit, attribution, schedule or report may use them. Other rows are returned unchanged."""
    if FLAG_WORK_UNSEEN not in row_flags(row.get("energy_flags")):
        return row
    return {**{k: (None if is_energy_column(k) else v) for k, v in row.items()},
            "energy_reason": WORK_UNSEEN_REASON}


def frame_without_unseen_energy(frame: Any) -> Any:
    """`without_unseen_energy` for every row of a DataFrame (a copy where any row changes)."""
    if "energy_flags" not in getattr(frame, "columns", ()) or frame.empty:
        return frame
    unseen = frame["energy_flags"].map(lambda v: FLAG_WORK_UNSEEN in row_flags(v)).astype(bool)
    if not unseen.any():
        return frame
    out = frame.copy()
    for col in (c for c in out.columns if is_energy_column(str(c))):
        out[col] = out[col].astype(object).where(~unseen, None) if out[col].dtype == object \
            else out[col].where(~unseen)
    if "energy_reason" not in out:
        out["energy_reason"] = None
    out["energy_reason"] = out["energy_reason"].astype(object).where(~unseen, WORK_UNSEEN_REASON)
    return out
