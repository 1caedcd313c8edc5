"""The measuring commands: profile, compare, sweep batch-size, sweep param, decompose, report.

Registered on the app in `mtad_energy.cli`; heavy imports happen inside the commands so
`mtad-energy --help` stays fast.
"""

from __future__ import annotations

import json
import math
import re
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mtad_energy.cli_common import (
    console,
    emit,
    esc,
    fail,
    ignored_draft_notes,
    integer_records,
    json_command,
    pair_alias,
    parse_sets,
    quiet_libraries,
    wrapping_table,
)
from mtad_energy.cli_engines import EngineOption, each_engine, engine_configs, sweep_engines
from mtad_energy.cli_store import compact_after, store_app
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig

sweep_app = typer.Typer(help="Batch-size and parameter sweeps.", no_args_is_help=True)

ALL_DECODERS = ("ar", "beam", "mtjd", "spd", "mtad", "mmtad", "specinfer", "mcss", "spectr", "bild",
                "typical", "pld")


def pair_head_kinds(model: str, target: str | None, draft: str | None, device: str) -> list[str]:
    """The head decoders (``medusa``, ``eagle``) whose heads the pair names (``--draft
    KIND:DIR`` or the alias's): `compare`'s default runs them beside the others. Loads nothing."""
    from mtad_energy.models import resolve_device, resolve_pair_spec

    spec = resolve_pair_spec(pair_alias(model, target), resolve_device(device), target=target,
                             draft=draft)
    return [kind for kind in ("medusa", "eagle") if spec.head(kind)]


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


# -- parsing -----------------------------------------------------------------------------------
def split_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def decoder_specs(names: list[str], sets: dict[str, str]) -> tuple[DecoderSpec, ...]:
    """Decoders with their --set overrides. ``key=v`` goes to every listed decoder that has the
    parameter; ``decoder.key=v`` to that decoder only. A key no listed decoder has is an error."""
    from mtad_energy.decoding.registry import DECODERS

    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise UsageError(f"unknown decoder {', '.join(unknown)}; available: {', '.join(DECODERS)}")
    params: dict[str, dict[str, str]] = {n: {} for n in names}
    for key, value in sets.items():
        scope, dot, name = key.rpartition(".")
        targets = [scope] if dot else names
        if dot and scope not in params:
            raise UsageError(f"--set {key}: decoder {scope!r} is not among --decoder {','.join(names)}")
        hit = [n for n in targets if name in typing.get_type_hints(DECODERS[n].Params)]
        if not hit:
            raise UsageError(f"--set {key}: no selected decoder ({', '.join(targets)}) has a parameter "
                             f"{name!r}; `mtad-energy decoders` lists them")
        for n in hit:
            params[n][name] = value
    return tuple(DecoderSpec.of(n, **params[n]) for n in names)


MAX_SWEEP_VALUES = 1000  # values per --param range, and configurations per sweep grid


def parse_range(text: str) -> list[str]:
    """'3..10' -> 3,4,...,10; '3..10:2' -> 3,5,7,9; '0.1,0.3,0.5' -> as listed."""
    m = re.fullmatch(r"\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*(?::\s*(\d+))?\s*", text)
    if m:
        lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
        if hi < lo or step < 1:
            raise UsageError(f"range {text!r} is empty; write LOW..HIGH with LOW <= HIGH")
        count = (hi - lo) // step + 1
        if count > MAX_SWEEP_VALUES:
            raise UsageError(f"range {text!r} has {count} values, more than the {MAX_SWEEP_VALUES} a sweep "
                             "may run; narrow it or add a step (LOW..HIGH:STEP)")
        return [str(v) for v in range(lo, hi + 1, step)]
    values = split_list(text)
    if not values:
        raise UsageError(f"no values in {text!r}; write e.g. gamma=3..10 or tau=0.1,0.3,0.5")
    return values


def parse_sizes(text: str, option: str = "--sizes") -> list[int]:
    try:
        sizes = [int(s) for s in split_list(text)]
    except ValueError:
        raise UsageError(f"{option} expects integers like 1,2,4,8,16, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"{option} must be positive integers, got {text!r}")
    return sizes


# -- display -----------------------------------------------------------------------------------
def fmt(x: Any, spec: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return spec.format(x)


def short_reason(reason: Any) -> str:
    from mtad_energy.results.analysis import short_reason  # pandas: not at `--help` time

    return short_reason(reason)


def energy_text(value: Any, reason: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"n/a: {short_reason(reason)}"
    return f"{value:.4g}"


SIMULATED_NOTE = ("J/tok (simulated): meter 'simulated' models a GPU and its power sensor; these joules "
                  "were not measured")


def is_simulated(meter: Any) -> bool:
    """A summary's ``meter`` cell (meters joined by '; ') names the simulated meter."""
    return "simulated" in str(meter or "").split("; ")


COLUMN_SETS = ("speed", "energy")
ENERGY_COLUMNS = [("J/tok dec", "decode_energy_per_token_j"), ("draft", "draft_j_per_token"),
                  ("target", "target_j_per_token"), ("other", "other_j_per_token"),
                  ("J/acc. draft", "j_per_accepted_draft_token"), ("rejected", "rejected_share")]
ATTRIBUTED = {c for _, c in ENERGY_COLUMNS[1:]}  # from the energy model: n/a with its own reason
ENERGY_NOTE = ("draft / target / other: decode J/token of each phase (adding up to J/tok dec); J/acc. "
               "draft: draft joules per accepted draft token; rejected: share of the decode joules "
               "spent on rejected draft tokens")


def check_columns(columns: str) -> str:
    if columns not in COLUMN_SETS:
        raise UsageError(f"--columns {columns!r}: choose {' or '.join(COLUMN_SETS)}")
    return columns


def with_attribution(summary, runs, store_dir: Path):
    """``summary`` with each configuration's decode joules by phase, joules per accepted draft
    token, rejected share and scale factor, from the energy model fitted on the batch rows of
    ``store_dir`` (n/a with the reason in ``attribution_reason`` where there is none)."""
    from mtad_energy.results.breakdown import attribute, attribution_summary, roofline_fit, windows_from

    keys = ("model", "dataset", "decoder", "params_json")
    fit = roofline_fit([store_dir]) if (store_dir / "mtad-energy-store.json").exists() else \
        "no results store"
    att = attribution_summary(attribute(windows_from(runs), fit), keys=keys)
    if att.empty:
        return summary.assign(attribution_reason="no runs")
    att = att.drop(columns=["windows", "attributed"]).rename(columns={"reason": "attribution_reason"})
    merged = summary.copy()
    for k in keys:
        merged[k] = merged[k].astype(object).where(merged[k].notna(), "")
    return merged.merge(att, on=list(keys), how="left")


def summary_table(summary, title: str = "", columns: str = "speed") -> Table:
    """The decoders' summary: ``columns`` "speed" (speed, quality and J/token) or "energy"
    (decode joules by phase from the energy model, `with_attribution`)."""
    from mtad_energy.results.analysis import compile_note, contention_note  # pandas: not at `--help` time

    reasons: set[str] = set()
    simulated = implausible = False
    if columns == "energy":
        cols = [("decoder", "label"), ("dataset", "dataset"), *ENERGY_COLUMNS]
    else:
        cols = [("decoder", "label"), ("dataset", "dataset"), ("runs", "n_runs"),
                ("tok/s", "tokens_per_s"), ("speed-up", "speedup"), ("blk eff", "block_efficiency"),
                ("accepted/depth", "acceptance_rate"), ("ppl", "perplexity"),
                ("J/tok dec", "decode_energy_per_token_j"), ("J/tok", "energy_per_token_j")]
        extra = [c for c in ("rouge_l", "pass_at_1") if c in summary and summary[c].notna().any()]
        cols += [(c.replace("_", "-"), c) for c in extra]
    if "model" in summary and summary["model"].nunique() > 1:  # engines side by side, say
        cols.insert(0, ("model", "model"))
    rows = []
    for _, r in summary.iterrows():
        cells = []
        for _name, col in cols:
            v = r.get(col)
            if col in ("energy_per_token_j", "decode_energy_per_token_j"):
                cells.append(energy_text(v, None).split(":")[0])
                if cells[-1] == "n/a" and columns != "energy":  # energy: the attribution says why
                    reasons.add(energy_text(v, r.get("energy_reason")).removeprefix("n/a: "))
                elif cells[-1] != "n/a" and is_simulated(r.get("meter")):
                    simulated = True
                    if columns != "energy":  # energy: the caption says so (the columns are many)
                        cells[-1] += " (simulated)"
            elif col in ("label", "dataset", "model"):
                busy = col == "label" and columns == "energy" and r.get("n_contended")
                cells.append(esc(v) + ("*" if busy else ""))
            elif col == "n_runs":  # "*": some were measured on a busy machine (caption)
                cells.append(str(int(v)) + ("*" if r.get("n_contended") else ""))
            elif col in ATTRIBUTED:
                if v is None or v != v:
                    cells.append("n/a")
                    if isinstance(r.get("attribution_reason"), str):
                        reasons.add(r["attribution_reason"])
                else:
                    cells.append(f"{v:.1%}" if col == "rejected_share" else f"{v:.3g}")
            else:
                cells.append(fmt(v, "{:.1f}" if col == "tokens_per_s" else
                                 "{:.3f}" if col == "perplexity" else "{:.2f}"))
                if col == "speedup" and str(r.get("implausible")) == "True":
                    cells[-1] += " !"
                    implausible = True
        rows.append(cells)
    table = wrapping_table([name for name, _ in cols], rows, left=("decoder", "dataset"),
                           title=esc(title) or None)
    captions = [SIMULATED_NOTE] if simulated else []
    if implausible:
        from mtad_energy.results.analysis import IMPLAUSIBLE_NOTE

        captions.append(IMPLAUSIBLE_NOTE.format(baseline="ar"))
    if columns == "energy":
        scale = summary["scale"].dropna() if "scale" in summary else []
        captions.append(ENERGY_NOTE + (f"; measured / predicted by the energy model: "
                                       f"{min(scale):.3f} to {max(scale):.3f}" if len(scale) else ""))
    elif not reasons:
        captions.append("tok/s, speed-up and J/tok dec: decode phase; J/tok: prefill + decode")
    if reasons:
        captions.append(("n/a: " if columns == "energy" else "J/tok n/a: ") + "; ".join(sorted(reasons)))
    if compiling := compile_note(summary):
        captions.append(compiling)
    captions += [n for n in [contention_note(summary)] if n]
    if captions:
        table.caption = esc("\n".join(captions))
    return table


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[note]}", markup=False), TimeRemainingColumn(), console=console,
                    transient=False)


def _interrupted(out: Path) -> typing.NoReturn:
    from mtad_energy.results import load_results

    n = len(load_results(out)) if (out / "mtad-energy-store.json").exists() else 0
    fail(f"interrupted: {n} finished row(s) are stored in {out}; re-run the same command to resume "
         "where it stopped", code=130, label="[yellow]")


# -- running a configuration -------------------------------------------------------------------
def run_config(config: RunConfig | list[RunConfig], out: Path, as_json: bool, title: str,
               workers: int = 1, cluster: str = "local", columns: str = "speed",
               baseline: str = "ar"):
    """Run/resume ``config`` (or one per engine, side by side) into ``out`` with a progress bar
    (or as ``workers`` submitit jobs); print the summary (``columns``: `summary_table`, speed-ups
    over ``baseline``), return it."""
    from mtad_energy.bench.runner import check_batch_size, load_config_prompts, model_label
    from mtad_energy.cli_engines import check_workers
    from mtad_energy.measure.contention import machine_load

    configs = config if isinstance(config, list) else [config]
    config = configs[0]
    try:
        prompts = load_config_prompts(config)
        check_batch_size(config, prompts)  # before loading any model
        check_workers(configs, workers)
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    load = machine_load()  # a moment's look: is the machine already busy before a long sweep?
    if load["warning"] and not as_json:
        console.print(f"[yellow]warning:[/] {esc(load['warning'])}")
    if len(configs) > 1:
        title = f"{title} · {', '.join(model_label(c) for c in configs)}"
    else:
        title = f"{title} · {model_label(config)}" + (
            f" ({config.batch_size} prompts decoded together)" if config.batch_size > 1 else "")
    if workers > 1:
        return run_distributed(config, out, as_json, title, workers, cluster, columns, baseline)
    import pandas as pd

    from mtad_energy.bench.quality import pass_at_1_notes
    from mtad_energy.bench.runner import summary_baseline
    from mtad_energy.results.analysis import decoder_summary

    quiet_libraries()
    rows, ran, skipped = [], 0, 0
    for config in configs:  # one engine after the other, each loaded once, freed after
        runner, rep = _run_one(config, out, as_json, prompts)
        rows, ran, skipped = rows + rep.rows, ran + rep.ran, skipped + rep.skipped
    compact_after(out)
    runs = pd.DataFrame(rows)
    summary = decoder_summary(runs, summary_baseline(baseline))
    notes = config_draft_notes(config) + pass_at_1_notes(rows, config.allow_code_execution)
    if as_json:
        emit({"output": str(out), "ran": ran, "skipped": skipped, "meter": runner.meter.name,
              "pair": runner.pair.describe(), "config": config.to_dict(),
              **({"engines": [c.engine for c in configs]} if len(configs) > 1 else {}),
              "summary": integer_records(summary), "notes": notes,
              "machine_load": load})
    else:
        shown = with_attribution(summary, runs, out) if columns == "energy" else summary
        console.print(summary_table(shown, title, columns))
        console.print(f"[dim]{ran} run(s) measured, {skipped} already stored; results in {esc(out)}[/]")
        for note in notes:
            console.print(f"[yellow]note:[/] {esc(note)}")
    return summary


def _run_one(config: RunConfig, out: Path, as_json: bool, prompts):
    """Load one configuration's runner (its engine) and run it into ``out`` with a progress bar."""
    from mtad_energy.bench.runner import Runner, quality_scorer, run_profile, work_units
    from mtad_energy.results import ResultStore

    try:
        store = ResultStore(out)
        with console.status(f"loading models ({config.engine})"):
            runner = Runner(config, store, scorer=quality_scorer(config.allow_code_execution))
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if not as_json:
        pair = runner.pair
        console.print("[bold]model[/] " + esc(f"{pair.name}: {pair.target_id} + "
                                               f"{pair.draft_id or 'no draft'} on {runner.device} "
                                               f"({runner.dtype}), loaded in {pair.load_time_s:.1f} s"))
        console.print(runner.pair.draft_line(), markup=False, highlight=False)
        console.print(f"[bold]meter[/] {esc(runner.meter.name)}: {esc(short_reason(runner.meter_reason))}")
        if runner.engine is not None:
            console.print(f"[bold]engine[/] {esc(runner.engine.name)} {esc(runner.engine.version)}: "
                          f"{esc(runner.engine.config_json())}", highlight=False)
    try:
        with _progress() as bar:
            task = bar.add_task(esc(config.sweep), total=len(runner.unique(work_units(config, prompts))),
                                note="")

            def step(row: dict | None, unit) -> None:
                note = f"{unit.decoder.label} {unit.prompt.id}" + (
                    " (stored)" if row is None else f" {row['tokens_per_s']:.1f} tok/s")
                bar.update(task, advance=1, note=note)

            rep = run_profile(config, store, runner=runner, prompts=prompts, progress=step)
    except KeyboardInterrupt:
        _interrupted(out)
    except (ValueError, RuntimeError) as error:
        fail(error)
    finally:
        if runner.engine is not None:
            runner.engine.close()
    return runner, rep


def config_draft_notes(config: RunConfig) -> list[str]:
    """`ignored_draft_notes` for a configuration's decoders and pair."""
    m = config.model
    return ignored_draft_notes([d.build() for d in config.decoders], m.alias, m.target, m.draft,
                               m.device)


def run_distributed(config: RunConfig, out: Path, as_json: bool, title: str, workers: int, cluster: str,
                    columns: str = "speed", baseline: str = "ar"):
    """Run ``config`` as ``workers`` submitit jobs writing into ``out``, then summarise the store."""
    from mtad_energy.bench.quality import pass_at_1_notes
    from mtad_energy.bench.runner import summary_baseline
    from mtad_energy.bench.scaleout import SweepError, submit_sweep, wait
    from mtad_energy.results import load_results
    from mtad_energy.results.analysis import decoder_summary

    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            jobs = submit_sweep(config, out, workers=workers, cluster=cluster)
        for note in notes:  # e.g. fewer jobs than asked for, and why
            console.print(f"[yellow]note:[/] {esc(note.message)}")
        if not as_json:
            ids = ", ".join(str(j.job_id) for j in jobs)
            stop = "stops them" if cluster == "local" else "leaves them running"
            console.print(esc(f"submitted {len(jobs)} {cluster} job(s): {ids}; waiting (Ctrl-C {stop})"))
        results = wait(jobs)
    except KeyboardInterrupt:
        _interrupted(out)
    except (ValueError, RuntimeError, OSError, SweepError) as error:
        fail(error)
    compact_after(out)
    runs = load_results(out)
    runs = runs[runs["sweep"] == config.sweep] if len(runs) else runs
    summary = decoder_summary(runs, summary_baseline(baseline))
    ran, skipped = sum(r["ran"] for r in results), sum(r["skipped"] for r in results)
    notes = config_draft_notes(config) + pass_at_1_notes(runs.to_dict("records"),
                                                         config.allow_code_execution)
    if as_json:
        emit({"output": str(out), "ran": ran, "skipped": skipped, "jobs": results,
              "summary": integer_records(summary), "notes": notes})
    else:
        shown = with_attribution(summary, runs, out) if columns == "energy" else summary
        console.print(summary_table(shown, title, columns))
        console.print(f"[dim]{ran} run(s) measured by {len(results)} job(s), {skipped} already stored; "
                      f"results in {esc(out)}[/]")
        for note in notes:
            console.print(f"[yellow]note:[/] {esc(note)}")
    return summary


def _config(decoders: tuple[DecoderSpec, ...], model, target, draft, dataset, n_prompts, max_new_tokens,
            seed, repeats, meter, mitigate, device, dtype, chat, ops, allow_code_execution, sweep,
            require_energy=False, compile=False, batch_size=1):
    return RunConfig(
        decoders=decoders, model=ModelSpec(pair_alias(model, target), target, draft, device, dtype),
        datasets=tuple(split_list(dataset)), n_prompts=n_prompts, max_new_tokens=max_new_tokens,
        seed=seed, repeats=repeats, chat=chat, ops=ops,
        measure=MeasureConfig(meter, mitigate, require_energy=require_energy),
        allow_code_execution=allow_code_execution, sweep=sweep, compile=compile,
        batch_size=batch_size)


# shared options (typer reads the Annotated metadata)
Model = Annotated[str, typer.Option(help="pair alias (`mtad-energy models`)")]
Target = Annotated[str | None, typer.Option(help="target hub id or local dir (overrides the alias)")]
Draft = Annotated[str | None, typer.Option(help="draft hub id, local dir or self:... (overrides)")]
Dataset = Annotated[str, typer.Option(help="humaneval, mtbench, spider, cnn_dailymail, chatalpaca, "
                                           "chatgpt_prompts, NAME:PATH or FILE.jsonl (comma list)")]
NPrompts = Annotated[int, typer.Option(min=1, help="prompts per dataset")]
MaxNew = Annotated[int, typer.Option(min=1, help="tokens to generate per prompt")]
Sets = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                help="decoder param key=value or decoder.key=value")]
Meter = Annotated[str, typer.Option(help="auto, nvml-counter, nvml-power, zeus, rapl, none or simulated "
                                          "(simulated: a modelled GPU and sensor, not a measurement)")]
Mitigate = Annotated[str, typer.Option(help="Yang et al. repetitions: auto (GPU meters that measure "
                                            "energy here)|on|off")]
RequireEnergy = Annotated[bool, typer.Option("--require-energy", help="exit 2 before loading any model "
                                             "when the meter cannot measure energy here")]
Output = Annotated[Path | None, typer.Option(help="results directory (default results/<command>)")]
Json = Annotated[bool, typer.Option("--json", help="print JSON")]
Dtype = Annotated[str | None, typer.Option(metavar="DTYPE", help="fp32|bf16|fp16 [default: bf16 on "
                                                                 "a GPU, fp32 on the CPU]")]
Chat = Annotated[bool | None, typer.Option("--chat/--no-chat", help="chat template (default: if any)")]
Ops = Annotated[bool, typer.Option("--ops", help="also profile FLOPs/bytes per decoder (for decompose)")]
Workers = Annotated[int, typer.Option(min=1, help="split the work over N submitit jobs, one GPU each")]
Cluster = Annotated[str, typer.Option(help="where --workers jobs run: local, slurm or debug")]
Compile = Annotated[bool, typer.Option(
    "--compile", help="static KV cache + torch.compile forwards (CUDA graphs on CUDA); rows are "
                      "stored under model '<model>+compile'")]
BatchSize = Annotated[int, typer.Option(
    min=1, help="prompts decoded together per set of forwards (each keeps its own row; the "
                "batch's energy is split by tokens)")]
AllowExec = Annotated[bool, typer.Option("--allow-code-execution",
                                         help="run HumanEval tests on generated code (sandboxed)")]
Columns = Annotated[str, typer.Option(
    help="summary table: speed (tok/s, speed-up, quality, J/token) or energy (decode J/token by "
         "phase, J per accepted draft token, rejected share: the energy model fitted on the "
         "--output store's batch rows)")]


Baseline = Annotated[str, typer.Option(help="also run this decoder beside the others, for "
                                             "speed-ups ('none': run only the listed ones)")]


@json_command
def profile(
    decoder: Annotated[str, typer.Option(help="decoder name(s), comma separated")] = "mtad",
    baseline: Baseline = "ar",
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    dataset: Dataset = "mtbench", n_prompts: NPrompts = 3, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: int = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, allow_code_execution: AllowExec = False, output: Output = None,
    workers: Workers = 1, cluster: Cluster = "local", require_energy: RequireEnergy = False,
    compile: Compile = False, batch_size: BatchSize = 1, columns: Columns = "speed",
    engine: EngineOption = "hf", as_json: Json = False,
):
    """Measure decoders on a dataset: tokens/s, block efficiency, acceptance, perplexity, J/token.

    Re-running the same command resumes: rows already in --output are not measured again."""
    from mtad_energy.bench.runner import with_baseline

    try:
        specs = decoder_specs(with_baseline(split_list(decoder), baseline), parse_sets(set_))
        config = _config(specs, model, target, draft, dataset, n_prompts, max_new_tokens, seed, repeats,
                         meter, mitigate, device, dtype, chat, ops, allow_code_execution, "profile",
                         require_energy, compile, batch_size)
        check_columns(columns)
        configs = engine_configs(config, engine)
    except ValueError as error:
        fail(error)
    run_config(configs, output or Path("results/profile"), as_json, "profile", workers, cluster, columns,
               baseline)


@json_command
def compare(
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    decoders: Annotated[str, typer.Option(help="comma list (default: all; eagle and medusa where "
                                               "the pair has their heads)")] = ",".join(ALL_DECODERS),
    dataset: Dataset = "humaneval,mtbench", n_prompts: NPrompts = 2, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: int = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, allow_code_execution: AllowExec = False, output: Output = None,
    markdown: Annotated[Path | None, typer.Option(help="markdown table file "
                                                       "(default: <output>.md)")] = None,
    workers: Workers = 1, cluster: Cluster = "local", require_energy: RequireEnergy = False,
    compile: Compile = False, batch_size: BatchSize = 1, columns: Columns = "speed",
    engine: EngineOption = "hf", as_json: Json = False,
):
    """All decoders side by side in the paper's main-table layout.

    The markdown export marks the best value of each column in bold and the second underlined."""
    from mtad_energy.results.analysis import main_table, to_markdown

    try:
        names = split_list(decoders)
        if decoders == ",".join(ALL_DECODERS):  # the default: every decoder the pair can run
            names += pair_head_kinds(model, target, draft, device)
        specs = decoder_specs(names, parse_sets(set_))
        config = _config(specs, model, target, draft, dataset, n_prompts, max_new_tokens, seed, repeats,
                         meter, mitigate, device, dtype, chat, ops, allow_code_execution, "compare",
                         require_energy, compile, batch_size)
        check_columns(columns)
        configs = engine_configs(config, engine, all_decoders=decoders == ",".join(ALL_DECODERS))
    except ValueError as error:
        fail(error)
    out = output or Path("results/compare")
    summary = run_config(configs, out, as_json, "compare", workers, cluster, columns)
    table = main_table(summary)
    md = to_markdown(table)
    if "meter" in summary and summary["meter"].map(is_simulated).any():
        md += "\n\n" + SIMULATED_NOTE.replace("J/tok", "J/token") + "."
    path = markdown or out.with_suffix(".md")
    path.write_text(md + "\n")
    if not as_json:
        console.print(f"[dim]main table (markdown) written to {esc(path)}[/]")


@json_command
def sweep_param(
    decoder: Annotated[str, typer.Option(help="the decoder to sweep")] = "mmtad",
    param: Annotated[list[str] | None, typer.Option(metavar="NAME=VALUES",
                                                    help="NAME=3..10 or NAME=0.1,0.3 (repeatable: "
                                                          "the grid of all combinations)")] = None,
    baseline: Baseline = "ar",
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    dataset: Dataset = "mtbench", n_prompts: NPrompts = 2, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: int = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, output: Output = None, workers: Workers = 1, cluster: Cluster = "local",
    require_energy: RequireEnergy = False, compile: Compile = False,
    batch_size: BatchSize = 1, columns: Columns = "speed", as_json: Json = False,
):
    """Ablations: one decoder over a grid of parameter values (e.g. --param gamma=3..10)."""
    import itertools

    try:
        if not param:
            raise UsageError("give at least one --param NAME=VALUES, e.g. --param gamma=3..10")
        grid = parse_sets(param)
        fixed = parse_sets(set_)
        axes = {k: parse_range(v) for k, v in grid.items()}
        if math.prod(len(v) for v in axes.values()) > MAX_SWEEP_VALUES:
            sizes = " x ".join(str(len(v)) for v in axes.values())
            raise UsageError(f"the --param grid has {sizes} = {math.prod(len(v) for v in axes.values())} "
                             f"configurations, more than the {MAX_SWEEP_VALUES} a sweep may run; narrow "
                             "the ranges")
        specs = [decoder_specs([decoder], {**fixed, **dict(zip(axes, combo, strict=True))})[0]
                 for combo in itertools.product(*axes.values())]
        if baseline != "none":
            specs = list(decoder_specs([baseline], {})) + specs
        config = _config(tuple(specs), model, target, draft, dataset, n_prompts, max_new_tokens, seed,
                         repeats, meter, mitigate, device, dtype, chat, ops, False, f"param-{decoder}",
                         require_energy, compile, batch_size)
        check_columns(columns)
    except ValueError as error:
        fail(error)
    run_config(config, output or Path(f"results/sweep-{decoder}"), as_json, f"{decoder} sweep", workers,
               cluster, columns, baseline)


# options of one study that the other ignores (`sweep batch-size` with and without --decoder)
FORWARD_ONLY_OPTIONS = ("runs", "forwards_per_run", "context_len", "mitigate", "profile_ops")
DECODING_ONLY_OPTIONS = ("draft", "dataset", "n_prompts", "max_new_tokens", "repeats", "set_",
                         "compile")


def given_options(ctx: typer.Context, names: typing.Iterable[str]) -> list[str]:
    """The options among ``names`` typed on the command line (a default value typed out
    counts), as the user spelled them (``--context-len``)."""
    from typer._click.core import ParameterSource  # typer vendors click

    params = {p.name: p for p in ctx.command.params}
    return [params[n].opts[0] for n in names
            if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]


@json_command
def sweep_batch_size(
    ctx: typer.Context,
    model: Model = "smollm2", target: Target = None,
    sizes: Annotated[str, typer.Option(help="batch sizes, comma separated")] = "1,2,4,8,16",
    runs: Annotated[int, typer.Option(min=1, help="runs (target forward groups) per batch size")] = 10,
    forwards_per_run: Annotated[int, typer.Option(min=1, help="decode forwards per run")] = 8,
    context_len: Annotated[int, typer.Option(min=1, help="KV-cache length per row")] = 128,
    contexts: Annotated[str, typer.Option(help="also decode at batch size 1 over these cache lengths "
                                               "(e.g. 1024,4096,8192: KV bytes vary, for decompose)")] = "",
    chunks: Annotated[str, typer.Option(help="also run one forward of these many new tokens over "
                                             "--context-len (e.g. 128,1024,4096: FLOPs vary)")] = "",
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None,
    profile_ops: Annotated[bool, typer.Option("--ops/--no-ops", help="T_flop/T_mem per size")] = True,
    seed: int = 0, output: Output = None, require_energy: RequireEnergy = False, as_json: Json = False,
    decoder: Annotated[str | None, typer.Option(
        help="decode with these decoders (comma list, e.g. ar,spd) at each batch size: tokens/s, "
             "J/token and the crossover with ar; without it, the forward-only study")] = None,
    draft: Draft = None, dataset: Dataset = "mtbench",
    n_prompts: Annotated[int, typer.Option(min=1, help="prompts (cycled to fill a batch)")] = 4,
    max_new_tokens: MaxNew = 32, repeats: Annotated[int, typer.Option(min=1)] = 1,
    set_: Sets = None, compile: Compile = False, engine: EngineOption = "hf",
):
    """The paper's batch-size study: energy and time per run and per input.

    A fixed number of target runs at each batch size; prints and stores energy, energy/run,
    energy/input, time, time/run, time/input. --contexts and --chunks add the points that make
    the energy roofline identifiable (`mtad-energy decompose`). With --decoder: real decoding of
    B prompts at once per decoder and batch size (--set gamma=1,2,3,5 sweeps variants), and the
    batch size from which each decoder stops beating ar."""
    from mtad_energy.bench.batch_sweep import batch_sweep, batch_table, design_points
    from mtad_energy.measure import MitigationConfig, get_meter, select_meter, snapshot
    from mtad_energy.models import load_pair
    from mtad_energy.results import ResultStore

    quiet_libraries()
    unused = given_options(ctx, FORWARD_ONLY_OPTIONS if decoder is not None else
                           (*DECODING_ONLY_OPTIONS, "engine"))
    if unused:
        why = ("the decoding sweep (--decoder) decodes prompts: it has no fixed forward runs, "
               "context length or Yang et al. repetitions" if decoder is not None else
               "without --decoder, the forward-only study runs the target on a filled KV cache and "
               "decodes no prompts")
        fail(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used here: {why}; "
             f"drop {'it' if len(unused) == 1 else 'them'}"
             + ("" if decoder is not None else ", or add --decoder ar,spd,... to decode prompts"))
    if decoder is not None:
        _decode_batch_sweep(decoder, model, target, draft, sizes, dataset, n_prompts,
                            max_new_tokens, repeats, set_, meter, device, dtype, seed,
                            output or Path("results/batch-size-decode"), require_energy, as_json,
                            compile, engine)
        return
    out = output or Path("results/batch-size")
    try:
        size_list = parse_sizes(sizes)
        context_list = parse_sizes(contexts, "--contexts") if contexts else []
        chunk_list = parse_sizes(chunks, "--chunks") if chunks else []
        mcfg = MeasureConfig(meter, mitigate, require_energy=require_energy)
        if meter == "auto":
            choice = select_meter()
            m, why = choice.meter, choice.reason
        else:
            m, why = get_meter(meter), f"asked for {meter}"
        mitigates = mcfg.mitigation_for(m)  # before loading: --require-energy, --mitigate on
        store = ResultStore(out)
        with console.status("loading the target"):
            pair = load_pair(pair_alias(model, target), target=target, device=device, dtype=dtype,
                             with_draft=False)
        snap = snapshot()
        store.write_env(snap.snapshot_id, snap.to_dict())
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if not as_json:
        console.print(f"[bold]target[/] {esc(pair.target_id)} on {esc(pair.describe()['device'])}; "
                      f"[bold]meter[/] {esc(m.name)}: {esc(short_reason(why))}")
    mitigation = MitigationConfig() if mitigates else None
    try:
        with _progress() as bar:
            total = len(design_points(size_list, context_list, chunk_list, context_len, 1))
            task = bar.add_task("batch-size", total=total, note="")

            def step(batch_size: int, row: dict) -> None:
                bar.update(task, advance=1, note=f"B={batch_size} c={row['context_len']} "
                                                 f"n={row.get('new_tokens') or 1}: "
                                                 f"{row['time_per_run_s']:.3f} s/run")

            rows = batch_sweep(pair, size_list, runs, store, m, model=pair.name, context_len=context_len,
                               forwards_per_run=forwards_per_run, seed=seed, mitigation=mitigation,
                               profile=profile_ops, env_id=snap.snapshot_id, progress=step,
                               contexts=context_list, chunks=chunk_list)
    except KeyboardInterrupt:
        from mtad_energy.results import load_results

        n = len(load_results(out, "batch"))
        fail(f"interrupted: {n} batch size(s) stored in {out}; re-run to resume", code=130,
             label="[yellow]")
    except (ValueError, RuntimeError) as error:  # e.g. --context-len beyond the model, disk full
        fail(error)
    compact_after(out)
    table = batch_table(rows)
    if as_json:
        emit({"output": str(out), "meter": m.name, "rows": integer_records(table)})
        return
    t = wrapping_table([str(c) for c in table.columns],
                       [[str(int(v)) if c == table.columns[0] else
                         energy_text(v, None).split(":")[0] if "Energy" in c else fmt(v, "{:.4g}")
                         for c, v in r.items()] for _, r in table.iterrows()],
                       title="batch size vs energy")
    reasons = {energy_text(None, row.get("energy_reason")) for row in rows if row.get("energy_j") is None}
    captions = ["Energy " + "; ".join(sorted(reasons))] if reasons else []
    if m.name == "simulated" and len(reasons) < len(rows):
        t.title = "batch size vs energy (simulated)"
        captions.insert(0, SIMULATED_NOTE.replace("J/tok", "Energy"))
    if captions:
        t.caption = esc("\n".join(captions))
    console.print(t)
    extra = len(rows) - len(table)
    if extra:
        console.print(f"[dim]+ {extra} context-length / prefill-chunk point(s) for the fit: "
                      f"mtad-energy decompose {esc(out)}[/]")
    console.print(f"[dim]results in {esc(out)}[/]")


def _decode_batch_sweep(decoders, model, target, draft, sizes, dataset, n_prompts, max_new_tokens,
                        repeats, sets, meter, device, dtype, seed, out: Path, require_energy,
                        as_json, compile: bool = False, engine: str = "hf") -> None:
    from mtad_energy.bench.decode_batch import decode_batch_sweep, expand_variants
    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.decoding.generate import encode_prompt
    from mtad_energy.decoding.registry import head_kinds
    from mtad_energy.measure import get_meter, select_meter, snapshot
    from mtad_energy.measure.contention import machine_load
    from mtad_energy.models import load_pair
    from mtad_energy.results import ResultStore
    from mtad_energy.results.analysis import (
        batch_crossover,
        crossover_display,
        crossover_notes,
        crossover_settings,
        crossover_title,
    )
    from mtad_energy.results.report import plot_batch_crossover

    try:
        names = split_list(decoders)
        if "ar" not in names:
            names = ["ar", *names]  # the baseline of every speed-up
        specs = expand_variants(decoder_specs(names, parse_sets(sets)))  # --set gamma=1,2,3,5
        size_list = parse_sizes(sizes)
        if meter == "auto":
            choice = select_meter()
            m, why = choice.meter, choice.reason
        else:
            m, why = get_meter(meter), f"asked for {meter}"
        MeasureConfig(meter, "off", require_energy=require_energy).mitigation_for(m)
        engines = sweep_engines(engine, specs, size_list, compile)  # refusals before loading
        needs_draft = "hf" in engines and any(s.build().needs_draft for s in specs)
        with console.status("loading the models"):
            pair = load_pair(pair_alias(model, target), target=target, draft=draft, device=device,
                             dtype=dtype, with_draft=needs_draft,
                             heads=head_kinds(s.build() for s in specs))
        prompts = [encode_prompt(pair, p.text) for p in load_prompts(dataset, n_prompts)]
        model_spec = ModelSpec(pair_alias(model, target), target, draft, device, dtype)
        store = ResultStore(out)
        snap = snapshot()
        store.write_env(snap.snapshot_id, snap.to_dict())
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    load = machine_load()  # a moment's look: is the machine already busy before a long sweep?
    if load["warning"] and not as_json:
        console.print(f"[yellow]warning:[/] {esc(load['warning'])}")
    total = len(specs) * len(size_list) * repeats * len(engines)
    not_run: list[dict] = []  # sizes skipped for memory, with the reason
    if not as_json:
        console.print("[bold]model[/] " + esc(f"{pair.name}: {pair.target_id} + "
                                               f"{pair.draft_id or 'no draft'} on "
                                               f"{pair.describe()['device']}"))
        console.print(f"[bold]meter[/] {esc(m.name)}: {esc(short_reason(why))}")
    done = {"ran": 0, "skipped": 0}
    try:
        with _progress() as bar:
            task = bar.add_task("decode batch sizes", total=total, note="")

            def step(row: dict, ran: bool) -> None:
                done["ran" if ran else "skipped"] += 1
                bar.update(task, advance=1, note=f"{row['label']} B={row['batch_size']}: " + (
                    f"{row['tokens_per_s']:.1f} tok/s" if ran else "(stored)"))

            def skip(label: str, b: int, reason: str) -> None:
                not_run.append({"decoder": label, "batch_size": b, "reason": reason})
                bar.update(task, advance=repeats, note=f"{label} B={b}: does not fit")

            rep = each_engine(engines, model_spec, lambda e: decode_batch_sweep(
                pair, specs, size_list, prompts, store, m, model=pair.name, dataset=dataset,
                max_new_tokens=max_new_tokens, repeats=repeats, seed=seed,
                env_id=snap.snapshot_id, progress=step, compile=compile, on_skip=skip, engine=e))
    except KeyboardInterrupt:
        fail(f"interrupted: {done['ran']} row(s) measured and stored in {out} ({done['skipped']} "
             f"were stored before), {total - done['ran'] - done['skipped']} left; re-run the same "
             "command to resume where it stopped", code=130, label="[yellow]")
    except (ValueError, RuntimeError) as error:
        fail(error)
    finally:
        m.close()
    compact_after(out)
    table = batch_crossover(rep.rows)
    notes = ignored_draft_notes([s.build() for s in specs], pair_alias(model, target), target,
                                draft, device) + crossover_notes(table)
    out_dir = out.resolve()  # `--output .` has no name of its own
    # beside the store (it holds only tables), named by setting: an eager sweep into the same
    # store does not overwrite the compiled sweep's plot
    png = out_dir.parent / f"{out_dir.name}-crossover{'-compile' if compile else ''}.png"
    plot_batch_crossover(table, f"{pair.name}: decoders at batch sizes "
                                f"{', '.join(map(str, size_list))} ({max_new_tokens} tokens, "
                                f"{pair.describe()['device']})").savefig(png, dpi=150)
    if as_json:
        emit({"output": str(out), "meter": m.name, "plot": str(png), "ran": rep.ran,
              "skipped": rep.skipped, "not_run": not_run, "notes": notes, "machine_load": load,
              "rows": integer_records(table)})
        return
    shown = crossover_display(table)
    t = wrapping_table(list(shown.columns), [[esc(v) for v in r] for r in shown.to_numpy()],
                       left=("decoder",), title=esc(crossover_title(table) + "".join(
                           f"\n{name}" for name, _ in crossover_settings(table)[:1])))
    reasons = sorted({short_reason(r) for r in table["energy_reason"].dropna()})
    captions = [SIMULATED_NOTE] if m.name == "simulated" and len(reasons) == 0 else []
    if reasons:
        captions.append("J/tok n/a: " + "; ".join(reasons))
    if captions:
        t.caption = esc("\n".join(captions))
    console.print(t)
    for s in not_run:
        console.print(f"[yellow]not run:[/] {esc(s['decoder'])} at B={s['batch_size']}: "
                      f"{esc(s['reason'])}")
    for note in notes:
        console.print(f"[yellow]note:[/] {esc(note)}")
    console.print(f"[dim]{rep.ran} row(s) measured, {rep.skipped} already stored; results in "
                  f"{esc(out)}; plot {esc(png)}[/]")


@json_command
def decompose(
    results: Annotated[list[Path], typer.Argument(help="results dir(s): a batch sweep and decoding runs")],
    fit_from: Annotated[list[Path] | None, typer.Option(
        "--fit-from", metavar="DIR",
        help="fit on the batch rows of these stores only (default: every RESULTS dir)")
    ] = None,
    max_rows: Annotated[int, typer.Option(min=1, help="validation rows printed (--json: all)")] = 40,
    as_json: Json = False,
):
    """Fit the energy models, check them on held-out runs, and split every run's joules.

    Fits E = P_static*T + PW_flop*T_flop + PW_mem*T_mem (the paper's form) and
    E = pi0*T + eps_flop*FLOPs + eps_byte*bytes (the energy roofline) on the batch-sweep rows,
    with 95 % intervals and a verdict per coefficient; predicts the decode energy of
    every decoding run (runs and decode_batch rows, never in the fit) from its counted work and
    prints the error per run and its median; then splits each decoder's measured decode joules
    into draft / target / other and static / FLOP / memory, adding up to the measurement."""
    import pandas as pd

    from mtad_energy.results.breakdown import (
        attribute,
        attribution_summary,
        decode_windows,
        fit_stores,
        ops_fractions_breakdown,
        validate,
    )

    try:
        fits, n_rows = fit_stores(fit_from or results)
        if all(isinstance(f, str) for f in fits.values()):  # nothing to show: say why, once
            raise ValueError("; ".join(dict.fromkeys(f"{form}: {why}" if len(set(fits.values())) > 1
                                                     else why for form, why in fits.items())))
        windows = decode_windows(results)
        roofline = fits.get("roofline")
        valid = validate(roofline, windows) if not isinstance(roofline, str) else pd.DataFrame()
        attributed = attribute(windows, roofline)
        summary = attribution_summary(attributed)
        paper = fits.get("paper")
        paper_split = (ops_fractions_breakdown(results, paper) if not isinstance(paper, str)
                       else pd.DataFrame())
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    errors = valid["error"].abs() if not valid.empty else pd.Series(dtype=float)
    median = float(errors.median()) if len(errors) else None
    if as_json:
        emit({"rows": n_rows,
              "fits": {f: (v.to_dict() if not isinstance(v, str) else {"error": v})
                       for f, v in fits.items()},
              "validation": {"median_abs_error": median,
                             "runs": integer_records(valid)},
              "attribution": integer_records(summary),
              "windows": integer_records(attributed),  # every row's split
              "decoders": integer_records(paper_split)})
        return
    for form, fit in fits.items():
        if isinstance(fit, str):
            console.print(f"[bold]{FORM_NAMES[form]}[/]: not fitted: {esc(fit)}")
        else:
            console.print(fit_table(form, fit, n_rows))
    if isinstance(roofline, str):
        console.print("[dim]no validation or attribution without the roofline fit[/]")
        return
    if valid.empty:
        console.print("[dim]no held-out decoding run with a measured decode energy and counted work "
                      "(profile or sweep batch-size --decoder into one of the directories)[/]")
    else:
        console.print(validation_table(valid, max_rows))
    if median is not None:
        console.print(f"[bold]median |prediction error|[/] {median:.1%} over {len(valid)} decode "
                      "window(s) not used in the fit")
    if not summary.empty:
        for table in attribution_tables(summary):
            console.print(table)
    if not paper_split.empty:
        console.print(wrapping_table(
            [str(c) for c in paper_split.columns],
            [[fmt(v, "{:.4g}") if isinstance(v, float) else esc(v) for v in r.values]
             for _, r in paper_split.iterrows()], left=("decoder", "model"),
            title="paper form: J/token by term (T_flop/T_mem shares from the ops rows)"))


FORM_NAMES = {"paper": "paper form E = P_static*T + PW_flop*T_flop + PW_mem*T_mem",
              "roofline": "energy roofline E = pi0*T + eps_flop*FLOPs + eps_byte*bytes"}


def fit_table(form: str, fit, n_rows: int) -> Table:
    """One form's coefficients with their 95 % intervals and verdicts."""
    t = Table(title=esc(f"{FORM_NAMES[form]} ({n_rows} batch rows)"), title_justify="left",
              show_edge=False, caption_justify="left")
    for col in ("term", "value", "95 % interval", "verdict"):
        t.add_column(col, justify="left" if col in ("term", "verdict") else "right",
                     no_wrap=col != "verdict")
    for c in fit.coefficients:
        t.add_row(f"{c.symbol} ({c.unit})", f"{c.value:.4g}", f"{c.ci_low:.4g} - {c.ci_high:.4g}",
                  esc(c.verdict))
    t.caption = esc(f"R^2 {fit.r2:.4f}, RMSE {fit.rmse_j:.4g} J, max |rel. error| "
                    f"{fit.max_abs_rel_error:.1%}, condition number {fit.condition_number:.3g}")
    return t


def validation_table(valid, max_rows: int) -> Table:
    t = Table(title="held-out decode windows: roofline prediction vs measurement",
              title_justify="left", show_edge=False, caption_justify="left")
    for col in ("from", "decoder", "B", "measured J", "predicted J", "error"):
        t.add_column(col, justify="left" if col in ("from", "decoder") else "right",
                     overflow="fold")
    for _, r in valid.head(max_rows).iterrows():
        t.add_row(SOURCES.get(r.source, esc(r.source)), esc(r.label), str(int(r.batch_size)),
                  f"{r.decode_energy_j:.4g}",
                  f"{r.predicted_j:.4g}", f"{r.error:+.1%}")
    if len(valid) > max_rows:
        t.caption = f"... {len(valid) - max_rows} more (--max-rows, or --json for all)"
    return t


SOURCES = {"runs": "runs", "decode_batch": "B sweep"}  # the tables decode windows come from


def attribution_tables(summary) -> list[Table]:
    """Per table, decoder and batch size: decode joules per token by phase, then by term with
    the joules per accepted draft token and the rejected share; n/a with the reasons."""
    key = [("from", "source"), ("decoder", "label"), ("B", "batch_size")]
    parts = (
        ("decode J/token by phase (phases add up to the measured decode energy)",
         [("draft", "draft_j_per_token"), ("target", "target_j_per_token"),
          ("other", "other_j_per_token"), ("scale", "scale")],
         "scale: measured / predicted decode energy (1 = the model explains the window)"),
        ("decode J/token by term, and the price of drafting",
         [("static", "static_j_per_token"), ("FLOP", "flop_j_per_token"),
          ("memory", "mem_j_per_token"), ("J/acc. draft", "j_per_accepted_draft_token"),
          ("rejected", "rejected_share")],
         "J/acc. draft: draft joules per accepted draft token; rejected: share of the decode "
         "joules spent drafting and verifying draft tokens that were rejected"),
    )
    reasons = sorted({r for r in summary["reason"] if isinstance(r, str)})
    tables = []
    for title, cols, note in parts:
        t = Table(title=title, title_justify="left", show_edge=False, caption_justify="left")
        for name, _ in (*key, *cols):
            t.add_column(name, justify="left" if name in ("from", "decoder") else "right",
                         overflow="fold")
        for _, r in summary.iterrows():
            cells = [SOURCES.get(r.source, esc(r.source)), esc(r.label), str(int(r.batch_size))]
            for _name, col in cols:
                v = r[col]
                cells.append("n/a" if v != v else f"{v:.1%}" if col == "rejected_share"
                             else f"{v:.3g}")
            t.add_row(*cells)
        t.caption = esc(note + ("\nn/a: " + "; ".join(reasons) if reasons else ""))
        tables.append(t)
    return tables


@json_command
def schedule(
    results: Annotated[Path, typer.Argument(help="results dir with a decoding batch-size sweep")],
    objective: Annotated[str, typer.Option(help="speed (tokens/s) or energy (decode J/token)")] = "speed",
    decoder: Annotated[str, typer.Option(help="the chain decoder whose gamma the mapping sets")] = "spd",
    max_batch_size: Annotated[int | None, typer.Option(
        min=1, help="end of the last range (default: the largest batch size measured)")] = None,
    model: Annotated[str | None, typer.Option(
        help="the model label of the setting to schedule (e.g. smollm2+compile) when the store "
             "holds several")] = None,
    out: Annotated[Path | None, typer.Option(
        help="where to write the schedule (default: <results>-schedule-<objective>[-<model>].json)"
    )] = None,
    validate: Annotated[bool, typer.Option(
        "--validate", help="run vLLM with the schedule beside ar and each fixed gamma at the "
                           "sweep's batch sizes (a vLLM sweep; rows go into the same store)")] = False,
    as_json: Json = False,
):
    """The speculation schedule: per batch-size range, the best decoder and gamma, and vLLM's
    speculative_config (num_speculative_tokens_per_batch_size: [start, end, k] triples, k = 0
    where ar is not beaten), or the advice to leave speculation off where it never pays.

    Reads a `sweep batch-size --decoder ar,spd --set gamma=1,2,3,5` store; prints each range with
    the measured speed-up or energy saving behind it and writes the schedule as JSON (with its
    setting; another setting's file is never replaced)."""
    from mtad_energy.results import StoreError, load_results
    from mtad_energy.results.schedule import build_schedule, schedule_path, schedule_table, write_schedule

    try:
        rows = load_results(results, "decode_batch")
        plan = build_schedule(rows, objective, decoder, max_batch_size, model)
        path = out or schedule_path(results, objective, model)
        write_schedule(plan, path)
    except (ValueError, OSError, StoreError) as error:  # a missing or empty store: bad input, 2
        fail(error)
    check = None
    if validate:  # the schedule measured in vLLM beside the fixed gammas (engines.schedule_check)
        from mtad_energy.engines.schedule_check import run_validation, validation_table

        try:
            with console.status("measuring the schedule in vLLM beside ar and each fixed gamma"):
                check = validation_table(run_validation(results, rows, plan, model), plan)
        except (ValueError, RuntimeError, OSError) as error:
            fail(error, code=1 if isinstance(error, RuntimeError) else 2)
        compact_after(results)
    if as_json:
        emit({**plan.to_dict(), "output": str(path),
              **({"validation": integer_records(check)} if check is not None else {})})
        return
    table = schedule_table(plan)
    t = Table(title=f"speculation schedule ({objective}; {decoder}'s gamma, 0 where ar is not beaten)"
                    + (f"\n{plan.setting}" if plan.setting else ""),
              title_justify="left", show_edge=False, caption_justify="left")
    for col in table.columns:
        t.add_column(esc(col), justify="left" if col in ("batch sizes", "best") else "right",
                     overflow="fold", no_wrap=col in ("batch sizes", "best"))
    percent = objective == "energy"
    for _, r in table.iterrows():
        t.add_row(*["-" if v is None or v != v else
                    (f"{v:.1%}" if percent else f"{v:.2f}x") if isinstance(v, float) else
                    esc(v) if isinstance(v, str) else str(int(v)) for v in r.values])
    simulated = "meter" in rows and (rows["meter"] == "simulated").any()
    t.caption = esc(f"measured at batch size 'at B' (median of repeats); "
                    f"{'energy saving: 1 - J/token / ar' if percent else 'speed-up: tokens/s / ar'}"
                    + ("; joules from the simulated meter" if simulated and percent else ""))
    console.print(t)
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {esc(note)}")
    config = plan.vllm_config()
    if config is None:
        console.print(f"[bold]speculation: off[/] (written to {esc(path)})")
        return
    console.print(f"[bold]vLLM speculative_config[/] (written to {esc(path)}, key speculative_config;"
                  " add the drafting method):")
    console.print(json.dumps(config), markup=False, highlight=False)
    if check is not None:
        from mtad_energy.engines.schedule_check import validation_display

        columns, cells, caption = validation_display(check)
        shown = wrapping_table(columns, cells, title="the schedule measured in vLLM")
        shown.caption = esc(caption)
        console.print(shown)


@json_command
def report(
    results: Annotated[Path, typer.Argument(help="results directory")],
    out: Annotated[Path | None, typer.Option(help="where to write report.md and figures")] = None,
    as_json: Json = False,
):
    """Write report.md with the main table, the batch-size tables and PNG/SVG figures."""
    from mtad_energy.results.report import write_report

    try:
        path = write_report(results, out)
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if as_json:
        figures = sorted(str(p) for p in (path.parent / "figures").glob("*.png"))
        emit({"report": str(path), "figures": figures})
        return
    console.print(f"report written to {esc(path)}")


def register(app: typer.Typer) -> None:
    app.command()(profile)
    app.command()(compare)
    app.command()(decompose)
    app.command()(schedule)
    app.command()(report)
    sweep_app.command("param")(sweep_param)
    sweep_app.command("batch-size")(sweep_batch_size)
    app.add_typer(sweep_app, name="sweep")
    app.add_typer(store_app, name="store")

