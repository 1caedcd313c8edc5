"""Running a configuration into a results store: progress bar, one engine after the other (or
submitit workers), resume on re-run, the summary printed or emitted as one JSON document.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mtad_energy.cli.engines import check_workers, skipped_notes
from mtad_energy.cli.options import ignored_draft_notes, random_weight_notes
from mtad_energy.cli.output import console, emit, esc, fail, integer_records, quiet_libraries
from mtad_energy.cli.store import compact_after
from mtad_energy.cli.tables import short_reason, summary_table, with_attribution
from mtad_energy.config import ModelSpec, RunConfig


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[note]}", markup=False), TimeRemainingColumn(), console=console,
                    transient=False)


def _interrupted(out: Path) -> typing.NoReturn:
    from mtad_energy.results import load_results

    n = len(load_results(out)) if (out / "mtad-energy-store.json").exists() else 0
    fail(f"interrupted: {n} finished row(s) are stored in {out}; re-run the same command to resume "
         "where it stopped", code=130, label="[yellow]")


def warn_if_busy(as_json: bool) -> dict:
    """A moment's look before a long sweep: is the machine already busy? Warns on the console
    (``--json`` carries it as ``machine_load``); returns what it saw."""
    from mtad_energy.measure.contention import machine_load

    load = machine_load()
    if load["warning"] and not as_json:
        console.print(f"[yellow]warning:[/] {esc(load['warning'])}")
    return load


def check_before_loading(model: ModelSpec, decoders: Sequence[typing.Any] = ()) -> None:
    """What a measuring command refuses before any model loads, beside its options' own checks
    (a ValueError naming the setting and the fix): ``$MTAD_ENERGY_CACHE`` or
    ``$MTAD_ENERGY_CALIBRATION`` naming a file (`paths.env_folder`), a ``--draft self:...`` that
    cannot build a draft (`models.drafts.check_self_draft`), and every one of ``decoders`` (the
    project's, built) that drafts with a model or head the pair will not have
    (`bench.work_units.missing_drafts`; the runner checks its configuration's itself)."""
    from mtad_energy.bench.work_units import missing_drafts
    from mtad_energy.measure.calibration import calibration_dir
    from mtad_energy.models import check_self_draft, resolve_device, resolve_pair_spec
    from mtad_energy.paths import cache_dir

    cache_dir(), calibration_dir()
    device = resolve_device(model.device)
    spec = resolve_pair_spec(model.alias, device, target=model.target, draft=model.draft)
    check_self_draft(spec.target, model.draft, device)
    if missing := missing_drafts(decoders, spec):
        raise ValueError(missing)


# -- running a configuration -------------------------------------------------------------------
# writes a command's files derived from the summary (compare's markdown table) given the summary
# and its notes; returns {what: path} for the JSON document and the console
SideFiles = Callable[[typing.Any, list[str]], dict[str, Path]]
# a command's own view of the summary and the rows beside the summary table (sweep draft's
# drafts side by side, tune's choice): its JSON key, its records, and what the console prints
# under the table
View = Callable[[typing.Any, typing.Any], tuple[str, list[dict] | dict, typing.Any]]


def run_config(config: RunConfig | list[RunConfig], out: Path, as_json: bool, title: str, *,
               workers: int = 1, cluster: str = "local", columns: str = "speed",
               baseline: str = "ar", budget_s: float | None = None,
               side_files: SideFiles | None = None, view: View | None = None,
               prompts: Sequence[typing.Any] | None = None,
               relabel: Callable[[typing.Any], typing.Any] | None = None,
               decoders_skipped: dict[str, list[str]] | None = None):
    """Run/resume ``config`` (or a list: one per engine or per draft, side by side) into ``out``
    with a progress bar (or as ``workers`` submitit jobs); print the summary (``columns``:
    `summary_table`, speed-ups over ``baseline``) and ``view`` of it, return the summary.
    ``budget_s``: no new row starts after it (`bench.budget`). ``side_files`` writes the files
    derived from the summary before the output is printed, so that a failure to write them is
    the command's one error (and its one JSON document). ``prompts``: the prompts to run in
    place of the configuration's datasets' first ``n_prompts`` (a split's part, `bench.splits`;
    one process only); ``relabel`` rewrites the summary's labels (tuned settings named).
    ``decoders_skipped``: the decoders each engine left out (`cli.engines.skipped_decoders`),
    said in a note each and as ``decoders_skipped`` in the JSON document."""
    from mtad_energy.bench.budget import Budget
    from mtad_energy.bench.runner import check_batch_size, load_config_prompts, model_label
    from mtad_energy.bench.work_units import check_pair_drafts, fewer_prompts_notes

    budget = Budget(budget_s)  # counts from here: loading the models is part of the lease
    configs = config if isinstance(config, list) else [config]
    config = configs[0]
    try:
        if prompts is not None and workers > 1:
            raise ValueError("--workers runs each job on the configuration's own prompts, not a "
                             "split's: drop --workers")
        if budget_s is not None and workers > 1:
            raise ValueError("--budget-s stops one process; with --workers each job runs its share "
                             "to the end: drop one of them")
        for each in configs:
            check_before_loading(each.model)
            if workers > 1:  # each job's runner would refuse it after the others started
                check_pair_drafts(each)
        prompts = list(prompts) if prompts is not None else load_config_prompts(config)
        prompt_notes = fewer_prompts_notes(config, prompts)  # datasets short of --n-prompts
        check_batch_size(config, prompts)  # before loading any model
        check_workers(configs, workers)
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    load = warn_if_busy(as_json)
    if len(configs) > 1:
        title = f"{title} · {', '.join(dict.fromkeys(model_label(c) for c in configs))}"
    else:
        title = f"{title} · {model_label(config)}" + (
            f" ({config.batch_size} prompts decoded together)" if config.batch_size > 1 else "")
    if workers > 1:
        return run_distributed(config, out, as_json, title, workers=workers, cluster=cluster,
                               columns=columns, baseline=baseline, side_files=side_files,
                               decoders_skipped=decoders_skipped)
    import pandas as pd

    from mtad_energy.bench.quality import pass_at_1_notes
    from mtad_energy.bench.work_units import summary_baseline, work_units
    from mtad_energy.results.analysis import decoder_summary

    quiet_libraries()
    rows, ran, skipped, runner = [], 0, 0, None
    for config in configs:  # one engine after the other, each loaded once, freed after
        if budget.skip(len(work_units(config, prompts))):  # spent: not even loaded
            continue
        runner, rep = _run_one(config, out, as_json, prompts, budget)
        rows, ran, skipped = rows + rep.rows, ran + rep.ran, skipped + rep.skipped
    if runner is not None:
        compact_after(out)
    runs = pd.DataFrame(rows)
    summary = decoder_summary(runs, summary_baseline(baseline))
    summary = relabel(summary) if relabel is not None and len(summary) else summary
    notes = skipped_notes(decoders_skipped) + prompt_notes + config_draft_notes(config)
    notes += pass_at_1_notes(rows, config.allow_code_execution)
    notes += [budget.note()] if budget.note() else []
    written = _write_side_files(side_files, summary, notes) if len(summary) else {}
    shown_view = view(summary, runs) if view is not None and len(summary) else None
    if as_json:
        emit({"output": str(out), "ran": ran, "skipped": skipped,
              "meter": runner.meter.name if runner else None,
              **({"budget": budget.to_dict()} if budget_s is not None else {}),
              "pair": runner.pair.describe() if runner else None, "config": config.to_dict(),
              **({"engines": [c.engine for c in configs]}
                 if len({c.engine for c in configs}) > 1 else {}),
              **({"decoders_skipped": decoders_skipped} if decoders_skipped else {}),
              "summary": integer_records(summary),
              **({shown_view[0]: shown_view[1]} if shown_view else {}), "notes": notes,
              "machine_load": load, **{k: str(v) for k, v in written.items()}})
    else:
        if len(summary):
            shown = with_attribution(summary, runs, out) if columns == "energy" else summary
            console.print(summary_table(shown, title, columns))
        if shown_view:
            console.print(shown_view[2])
        console.print(f"[dim]{ran} run(s) measured, {skipped} already stored"
                      + (f"; results in {esc(out)}[/]" if runner else "; no model loaded[/]"))
        _print_notes(notes, written)
    return summary


def _write_side_files(side_files: SideFiles | None, summary, notes: list[str]) -> dict[str, Path]:
    try:
        return side_files(summary, notes) if side_files is not None else {}
    except OSError as error:  # every row is stored: only the derived file is missing
        fail(f"{error}; every row is stored: re-run the same command to write it", code=1)


def _print_notes(notes: list[str], written: dict[str, Path]) -> None:
    for note in notes:
        console.print(f"[yellow]note:[/] {esc(note)}")
    for what, path in written.items():
        console.print(f"[dim]{esc(what)} written to {esc(path)}[/]")


def _run_one(config: RunConfig, out: Path, as_json: bool, prompts, budget=None):
    """Load one configuration's runner (its engine) and run it into ``out`` with a progress bar."""
    from mtad_energy.bench.runner import Runner, quality_scorer, run_profile, work_units
    from mtad_energy.results import ResultStore

    try:
        store = ResultStore(out)
        with console.status(f"loading models ({config.engine})"):
            runner = Runner(config, store, scorer=quality_scorer(config.allow_code_execution))
            runner.budget = budget  # the progress bar's count of rows stops hashing once spent
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if not as_json:
        pair = runner.pair
        console.print("[bold]model[/] " + esc(f"{pair.name}: {pair.target_id} + "
                                               f"{pair.draft_id or 'no draft'} on {runner.device} "
                                               f"({runner.dtype}), loaded in {pair.load_time_s:.1f} s"))
        console.print(runner.pair.draft_line(), markup=False, highlight=False)
        console.print(f"[bold]meter[/] {esc(runner.meter.name)}: {esc(short_reason(runner.meter_reason))}")
        version = runner.engine.version or "(no version stated)"
        console.print(f"[bold]engine[/] {esc(runner.engine.name)} {esc(version)}: "
                      f"{esc(runner.engine.config_json())}", highlight=False)
    try:
        with progress_bar() as bar:
            task = bar.add_task(esc(config.sweep), total=len(runner.unique(work_units(config, prompts))),
                                note="")

            def step(row: dict | None, unit) -> None:
                note = f"{unit.decoder.label} {unit.prompt.id}" + (
                    " (stored)" if row is None else f" {row['tokens_per_s']:.1f} tok/s")
                bar.update(task, advance=1, note=note)

            rep = run_profile(config, store, runner=runner, prompts=prompts, progress=step,
                              budget=budget)
    except KeyboardInterrupt:
        _interrupted(out)
    except (ValueError, RuntimeError) as error:
        fail(error)
    finally:
        runner.engine.close()
    return runner, rep


def config_draft_notes(config: RunConfig) -> list[str]:
    """`ignored_draft_notes` for a configuration's decoders and pair (the project's decoders
    only: an engine's parameter values, such as vLLM's gamma=0, are not theirs to check)."""
    from mtad_energy.engines.hf import project_decoders

    m = config.model
    built = project_decoders(config.engine, config.decoders)
    return ignored_draft_notes(built, m.alias, m.target, m.draft, m.device) + random_weight_notes(
        m.target, m.draft)


def run_distributed(config: RunConfig, out: Path, as_json: bool, title: str, *, workers: int,
                    cluster: str, columns: str = "speed", baseline: str = "ar",
                    side_files: SideFiles | None = None,
                    decoders_skipped: dict[str, list[str]] | None = None):
    """Run ``config`` as ``workers`` submitit jobs writing into ``out``, then summarise the store
    (``decoders_skipped``: as `run_config`'s)."""
    from mtad_energy.bench.quality import pass_at_1_notes
    from mtad_energy.bench.scaleout import SweepError, submit_sweep, wait
    from mtad_energy.bench.work_units import summary_baseline
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
    notes = skipped_notes(decoders_skipped) + config_draft_notes(config) + pass_at_1_notes(
        runs.to_dict("records"), config.allow_code_execution)
    written = _write_side_files(side_files, summary, notes)
    if as_json:
        emit({"output": str(out), "ran": ran, "skipped": skipped, "jobs": results,
              **({"decoders_skipped": decoders_skipped} if decoders_skipped else {}),
              "summary": integer_records(summary), "notes": notes,
              **{k: str(v) for k, v in written.items()}})
    else:
        shown = with_attribution(summary, runs, out) if columns == "energy" else summary
        console.print(summary_table(shown, title, columns))
        console.print(f"[dim]{ran} run(s) measured by {len(results)} job(s), {skipped} already stored; "
                      f"results in {esc(out)}[/]")
        _print_notes(notes, written)
    return summary
