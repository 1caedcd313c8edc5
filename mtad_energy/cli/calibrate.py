"""`mtad-energy calibrate`: which meter to trust on this GPU, and the shortest window worth
measuring (`bench.calibrate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from mtad_energy.cli.output import console, emit, esc, fail, json_command, quiet_libraries


def _pct(value: Any) -> str:
    return "-" if value is None or value != value else f"{round(value, 3) + 0.0:+.1%}"  # no -0.0%


def meters_table(rows: list[dict[str, Any]]) -> Table:
    """Each workload's consensus (J per repetition; idle: W) and every meter's difference to it:
    the basis the verdict uses too (`bench.calibrate._compare`)."""
    from mtad_energy.measure.probes import ROLES

    measured = [r for r in rows if r["protocol"] != "-"]
    names = [m for m in ROLES if any(r["meter"] == m for r in measured)]
    t = Table(title="meters side by side", title_justify="left", show_edge=False,
              caption_justify="left")
    t.add_column("workload")
    t.add_column("protocol")
    t.add_column("consensus", justify="right")
    for name in names:  # long names over two lines, at their hyphen: 80 columns fit every header
        t.add_column(name.replace("-", "-\n", 1) if len(name) > 10 else name, justify="right")
    for key in dict.fromkeys((r["workload"], r["protocol"]) for r in measured):
        cells = {r["meter"]: r for r in measured if (r["workload"], r["protocol"]) == key}
        unit = "W" if key[0] == "idle" else "J"
        ref = next(iter(cells.values())).get("consensus_value")
        t.add_row(*key, "-" if ref is None else f"{ref:.4g} {unit}",
                  *[_pct(cells.get(n, {}).get("vs_consensus")) for n in names])
    missing = [f"{r['meter']}: {r['error']}" for r in rows if r["protocol"] == "-"]
    t.caption = ("consensus: the median of the meters' protocol estimates, J per repetition (idle: "
                 "the median idle power, W); each meter: its difference to the consensus, the basis "
                 "of the verdict too" + "".join(f"\nnot measured: {m}" for m in missing))
    return t


def sweep_table(sweep: list[dict[str, Any]], tolerance: float) -> Table:
    t = Table(title="window length sweep (bursty workload)", title_justify="left", show_edge=False)
    for col in ("window", "readings", "max |error|", f"within ±{tolerance:.0%}"):
        t.add_column(col, justify="right")
    for length in sorted({r["length_s"] for r in sweep}):
        errs = [r["error"] for r in sweep if r["length_s"] == length]
        worst = max((abs(e) for e in errs if e is not None), default=None)
        t.add_row(f"{length:g} s", str(len(errs)), "-" if worst is None else f"{worst:.1%}",
                  "yes" if worst is not None and worst <= tolerance and None not in errs else "no")
    return t


@json_command
def calibrate(
    meter: Annotated[str, typer.Option(help="auto: this GPU's meters (NVML, Zeus); simulated: a "
                                            "simulated GPU on simulated time (a rehearsal)")] = "auto",
    preset: Annotated[str, typer.Option(help="sensor preset of --meter simulated "
                                             "(a100-h100, ampere-ada, v100)")] = "a100-h100",
    model: Annotated[str | None, typer.Option(help="model(s) whose batch-1 forward floor is "
                                                   "timed, comma separated: a shape (llama3.1-8b, "
                                                   "opt-13b, ...; random weights) or an alias, hub "
                                                   "id or directory [default: llama3.1-8b on a "
                                                   "GPU, tiny-llama on the CPU]")] = None,
    quick: Annotated[bool, typer.Option(help="about a minute: shorter windows, a lighter "
                                             "protocol")] = False,
    compile: Annotated[bool, typer.Option(help="also time the compiled forward")] = False,
    record_dir: Annotated[Path | None, typer.Option(help="where the record goes [default: "
                                                         "$MTAD_ENERGY_CALIBRATION, else "
                                                         "<cache>/calibration]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
):
    """Which meter to trust on this GPU, and the shortest window worth measuring.

    Measures the meters side by side (energy counter, 5 ms instant power, Zeus, naive 1 s
    polling; plain and under the Yang et al. protocol), idle power, the counter's update period,
    copy bandwidth and a model's batch-1 forward floor; stores a record that later runs on this
    GPU reference (shorter windows are flagged). About 3 minutes on a GPU (--quick: 1)."""
    from mtad_energy.bench.calibrate import CalibrateConfig, run_calibration

    quiet_libraries()
    try:
        cfg = CalibrateConfig(meter, preset, model, quick, compile, record_dir)
        with console.status("calibrating") as status:
            report = run_calibration(cfg, log=lambda text: status.update(f"calibrating: {esc(text)}"))
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if as_json:
        emit(report.to_dict())
        return
    cal = report.meters
    if cal is not None:
        console.print(meters_table(list(cal.rows)))
        if cal.sweep:
            console.print(sweep_table(list(cal.sweep), cal.tolerance))
    for what, why in report.cannot:
        console.print(f"[yellow]cannot measure[/] {esc(what)}: {esc(why)}")
    for line in report.verdict:
        console.print(f"[bold]verdict:[/] {esc(line)}")
    if report.record_path is not None:
        console.print(f"[dim]calibration record {esc(report.record.record_id)} stored in "
                      f"{esc(report.record_path)}; later runs on this device reference it[/]")
