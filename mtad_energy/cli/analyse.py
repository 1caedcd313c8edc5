"""Commands over a stored results directory: `decompose` (the energy model), `schedule` (vLLM's
speculation per batch size), `report` (report.md with figures).

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from mtad_energy.cli.options import Json
from mtad_energy.cli.output import console, emit, esc, fail, integer_records, json_command, wrapping_table
from mtad_energy.cli.store import compact_after
from mtad_energy.cli.tables import FORM_NAMES, attribution_tables, fit_table, fmt, validation_table


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

    from mtad_energy.energy.attribution import attribute, validate
    from mtad_energy.results.breakdown import (
        attribution_summary,
        decode_windows,
        fit_stores,
        ops_fractions_breakdown,
        simulated_energy,
    )

    try:
        fits, n_rows = fit_stores(fit_from or results)
        if all(isinstance(f, str) for f in fits.values()):  # nothing to show: say why, once
            raise ValueError("; ".join(dict.fromkeys(f"{form}: {why}" if len(set(fits.values())) > 1
                                                     else why for form, why in fits.items())))
        windows = decode_windows(results)
        simulated = simulated_energy(fit_from or results, windows)
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
        emit({"rows": n_rows, "simulated": simulated,
              "fits": {f: (v.to_dict() if not isinstance(v, str) else {"error": v})
                       for f, v in fits.items()},
              "validation": {"median_abs_error": median,
                             "runs": integer_records(valid)},
              "attribution": integer_records(summary),
              "windows": integer_records(attributed),  # every row's split
              "decoders": integer_records(paper_split)})
        return
    if simulated["note"]:
        console.print(f"[bold yellow]{esc(simulated['note'])}[/]")
    for form, fit in fits.items():
        if isinstance(fit, str):
            console.print(f"[bold]{FORM_NAMES[form]}[/]: not fitted: {esc(fit)}")
        else:
            console.print(fit_table(form, fit, n_rows))
    if isinstance(roofline, str):
        console.print("[dim]no validation or attribution without the roofline fit[/]")
        return
    if valid.empty:
        console.print(f"[dim]{esc(no_validation(windows))}[/]")
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


def no_validation(windows) -> str:
    """Why no decode window checks the fit: no decoding rows, or rows whose energy is n/a."""
    from mtad_energy.results.analysis import short_reason

    energy = windows["decode_energy_j"] if "decode_energy_j" in windows else None
    if energy is None or windows.empty or energy.notna().any():
        return ("no held-out decoding run with a measured decode energy and counted work (profile "
                "or sweep batch-size --decoder into one of the directories)")
    reasons = sorted({short_reason(r) for r in windows["energy_reason"].dropna()}) or [
        "no reason recorded"]
    return (f"the {len(windows)} decoding run(s) here have no measured decode energy (n/a: "
            f"{'; '.join(reasons)}), so none checks the fit: measure them with a meter that reads "
            "energy (`mtad-energy env` says which)")


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
    from mtad_energy.results.store_files import check_output, outside_store

    try:
        rows = load_results(results, "decode_batch")
        plan = build_schedule(rows, objective, decoder, max_batch_size, model)
        path = outside_store(out or schedule_path(results, objective, model), results, "--out")
        check_output(path, "--out", "the schedule file", kind="file")
        path.parent.mkdir(parents=True, exist_ok=True)  # missing folders: created, as for --output
        write_schedule(plan, path)
    except (ValueError, OSError, StoreError) as error:  # a missing or empty store: bad input, 2
        fail(error)
    check = None
    if validate:  # the schedule measured in vLLM beside the fixed gammas (bench.schedule_check)
        from mtad_energy.bench.schedule_check import run_validation, validation_table

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
    measured = any(r.zero_gain is not None for r in plan.ranges)
    percent = objective == "energy"
    # headers wrap between words, never inside one: stacked tables where they cannot all fit
    t = wrapping_table([str(c) for c in table.columns], [
        ["-" if v is None or v != v else (f"{v:.1%}" if percent else f"{v:.2f}x")
         if isinstance(v, float) else esc(v) if isinstance(v, str) else str(int(v)) for v in r.values]
        for _, r in table.iterrows()], left=("batch sizes", "best"),
        title=f"speculation schedule ({objective}; {decoder}'s gamma, 0 where ar is not beaten"
              + (", or the best k where k = 0 was measured" if measured else "") + ")"
              + (f"\n{plan.setting}" if plan.setting else ""))
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
    console.print(readable_json(config), markup=False, highlight=False)
    if check is not None:
        from mtad_energy.bench.schedule_check import validation_display

        columns, cells, caption = validation_display(check)
        shown = wrapping_table(columns, cells, title="the schedule measured in vLLM")
        shown.caption = esc(caption)
        console.print(shown)


def readable_json(document) -> str:
    """``document`` as JSON for the terminal: indented, each list of numbers (a schedule's
    ``[start, end, k]``) on one line, so nothing wraps inside one at 80 columns."""
    text = json.dumps(document, indent=2)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m[1].split(",")) + "]", text)


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
