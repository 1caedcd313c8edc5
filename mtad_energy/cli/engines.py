"""CLI glue for ``--engine hf|vllm|llamacpp`` (comma list: side by side in one command) on
profile, compare and sweep batch-size --decoder: the option, and one configuration per engine
with what it cannot honour refused before any model loads (`mtad_energy.engines`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated

import typer

from mtad_energy.config import RunConfig

# `mtad_energy.engines` loads the decoding core (torch): imported where used, so `import
# mtad_energy.cli` stays light and the CLI can set OpenMP's wait policy before torch loads

EngineOption = Annotated[str, typer.Option(
    "--engine", help="what generates: hf (the project's decoders over Hugging Face models), "
                     "llamacpp, vllm, or a running OpenAI-compatible server's "
                     "http://HOST:PORT; a comma list runs them side by side into one store (rows "
                     "never pooled: model '<model>+<engine>')")]

EngineOptions = Annotated[list[str] | None, typer.Option(
    "--engine-option", metavar="KEY=VALUE",
    help="an engine's own setting, KEY=VALUE (repeat it, or a comma list): vllm: dtype, "
         "enforce_eager, max_model_len, max_num_seqs, gpu_memory_utilization, "
         "kv_cache_space_gib; llamacpp: n_threads, n_threads_batch, n_ctx, n_batch, draft_path; "
         "a server (http://...): model, prompt, logprobs, timeout_s, server_pid. "
         "It goes to each engine of --engine that has it, and into its rows' engine "
         "configuration")]


def engine_options(items: list[str] | None, engines: str) -> dict[str, dict[str, str]]:
    """``--engine-option`` per engine of ``engines``: each KEY=VALUE goes to every engine that has
    the setting; one no engine has, a malformed item or a value of the wrong type is refused
    before anything loads (`EngineKind.options`)."""
    from mtad_energy.engines import HF, UnsupportedError, engine_kind, parse_engines

    pairs = [item.strip() for text in items or [] for item in text.split(",") if item.strip()]
    names = [n for n in parse_engines(engines) if n != HF]
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for item in pairs:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            examples = [f"{n}: {k}={v.default}" for n in names  # the engines given, not vLLM's
                        for k, v in list(engine_kind(n).settings.items())[:1]]
            raise UnsupportedError(f"--engine-option expects KEY=VALUE, got {item!r}"
                                   + (f" (e.g. {'; '.join(examples)})" if examples else ""))
        takers = [n for n in names if key in engine_kind(n).settings]
        if not takers:
            has = "; ".join(f"{n}: {', '.join(engine_kind(n).settings)}" for n in names)
            raise UnsupportedError(
                f"no engine of --engine {engines} has an option {key!r}"
                + (f" ({has})" if has else " (hf, the project's own decoders, takes none)"))
        for n in takers:
            out[n][key] = value.strip()
    for n, given in out.items():
        engine_kind(n).options(given)  # types checked now, not after a model loads
    return out


def lacking_decoders(decoders: Sequence[str], engines: str) -> dict[str, list[str]]:
    """Engine of ``engines`` -> the decoders of ``decoders`` it has no method for (hf runs every
    one; an engine lacking none is left out)."""
    from mtad_energy.engines import HF, engine_kind, parse_engines

    out = {}
    for name in parse_engines(engines):
        if name != HF and (ds := [d for d in dict.fromkeys(decoders)
                                  if d not in engine_kind(name).methods]):
            out[name] = ds
    return out


def refuse_lacking_decoders(decoders: Sequence[str], engines: str, command: str,
                            option: str) -> None:
    """The rule of the commands that measure one decoder list on every engine of ``engines``
    (`profile`, `sweep batch-size --decoder`; `compare` skips instead, `skipped_decoders`): a
    decoder an engine lacks is refused before anything loads, naming every such engine, what it
    runs and the fix (``command`` by name, ``option``: where the decoders were given). One
    engine: its own refusal
    (`EngineKind.method`)."""
    from mtad_energy.engines import UnsupportedError, engine_kind, parse_engines

    lacks = lacking_decoders(decoders, engines)
    if not lacks:
        return
    names = parse_engines(engines)
    if len(names) == 1:
        engine_kind(names[0]).method(lacks[names[0]][0])  # raises, naming what the engine runs
    which = "; ".join(f"engine {n!r} has no decoder {', '.join(map(repr, ds))} (it runs "
                      f"{', '.join(engine_kind(n).methods)})" for n, ds in lacks.items())
    missing = ", ".join(dict.fromkeys(d for ds in lacks.values() for d in ds))
    raise UnsupportedError(f"{which}: {command} runs every decoder on every engine of --engine "
                           f"{engines}; drop {missing} from {option}, or {', '.join(lacks)} from --engine "
                           "(compare runs each engine's own decoders and skips the others)")


def skipped_decoders(config: RunConfig, engines: str) -> dict[str, list[str]]:
    """compare's rule for engines side by side: each engine of ``engines`` runs the decoders of
    ``config`` it has and skips the others (`lacking_decoders`). Returns engine -> the decoders
    it skips (engines skipping none left out). A decoder no engine of the list has is refused by
    name, before any model loads (one engine: its own refusal, `EngineKind.method`)."""
    from mtad_energy.engines import UnsupportedError, engine_kind, parse_engines

    names = parse_engines(engines)
    lacks = lacking_decoders([d.name for d in config.decoders], engines)
    nobody = [d for d in dict.fromkeys(d.name for d in config.decoders)
              if all(d in lacks.get(n, ()) for n in names)]
    if nobody and len(names) == 1:
        engine_kind(names[0]).method(nobody[0])  # raises, naming what the engine runs
    if nobody:
        runs = "; ".join(f"{n} runs {', '.join(engine_kind(n).methods)}" for n in names)
        raise UnsupportedError(f"no engine of --engine {engines} has decoder "
                               f"{', '.join(nobody)} ({runs}); drop it from --decoders, or add "
                               "hf (the project's decoders) to --engine")
    return lacks


def skipped_notes(skipped: dict[str, list[str]] | None) -> list[str]:
    """One note per engine that skipped decoders of the list (`skipped_decoders`)."""
    from mtad_energy.engines import engine_kind

    return [f"engine {name} has no decoder {', '.join(ds)}: skipped for it (it runs "
            f"{', '.join(engine_kind(name).methods)})" for name, ds in (skipped or {}).items()]


def engine_configs(config: RunConfig, engines: str,
                   skipped: dict[str, list[str]] | None = None,
                   options: dict[str, dict[str, str]] | None = None) -> list[RunConfig]:
    """One configuration per engine of ``engines`` (``--engine``), each checked: a decoder,
    parameter, batch size, ``--compile`` or ``--ops`` an engine cannot honour is refused by name,
    and an engine not installed names its extra. ``skipped`` (compare: `skipped_decoders`): the
    decoders each engine leaves out; an engine left with none runs nothing."""
    from mtad_energy.engines import check_engine_options, parse_engines

    out = []
    for name in parse_engines(engines):
        decoders = tuple(d for d in config.decoders if d.name not in (skipped or {}).get(name, ()))
        if not decoders:
            continue  # it has none of them: said by its skip note
        check_engine_options(name, [d.name for d in decoders], config.batch_size, config.compile,
                             {d.name: d.param_dict for d in decoders}, ops=config.ops)
        given = tuple(sorted((options or {}).get(name, {}).items()))
        out.append(dataclasses.replace(config, decoders=decoders, engine=name,
                                       engine_options=given))
    return out


def check_workers(configs: list[RunConfig], workers: int) -> None:
    if workers > 1 and len(configs) > 1:
        raise ValueError(f"--workers {workers} runs one engine at a time; run one command per "
                         "engine (same --output) to put them side by side")


def sweep_engines(engines: str, specs, sizes: list[int], compile: bool) -> list[str]:
    """``sweep batch-size --decoder ... --engine``: the engines, each checked against the
    decoders, their parameters, the largest batch size and ``--compile``."""
    from mtad_energy.engines import check_engine_options, parse_engines

    names = parse_engines(engines)
    refuse_lacking_decoders([s.name for s in specs], engines, "sweep batch-size", "--decoder")
    for name in names:
        check_engine_options(name, [s.name for s in specs], max(sizes), compile,
                             {s.name: s.param_dict for s in specs}, batch_option="--sizes")
    return names


def each_engine(names: list[str], model, run, options: dict[str, dict[str, str]] | None = None,
                *, pair=None, meter=None, compile: object = False):
    """``run(engine)`` for each engine in turn, opened once (`engines.open_engine`: hf over
    ``pair`` with ``compile`` and ``meter``, another with its ``--engine-option`` settings) and
    closed after; the reports' rows joined (``rows``, ``ran``, ``skipped``)."""
    from mtad_energy.bench.decode_batch import DecodeBatchReport
    from mtad_energy.engines import open_engine

    total = DecodeBatchReport([], 0, 0)
    for name in names:
        engine = open_engine(name, model, (options or {}).get(name), pair=pair, compile=compile,
                             meter=meter)
        try:
            rep = run(engine)
        finally:
            engine.close()
        total = DecodeBatchReport(total.rows + rep.rows, total.ran + rep.ran,
                                  total.skipped + rep.skipped)
    return total
