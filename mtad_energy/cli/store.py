"""`mtad-energy store compact DIR`, and the compaction every storing command ends with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mtad_energy.cli.output import console, emit, esc, fail, json_command

store_app = typer.Typer(help="Maintain a results store.", no_args_is_help=True)


def compact_after(out: Path) -> None:
    """Compact the store a command has just written (quietly; a failure is a warning, since every
    row is stored either way and the next compaction tries again)."""
    from mtad_energy.results.store import compact_store

    try:
        done = compact_store(out)
    except (RuntimeError, OSError) as error:
        console.print(f"[yellow]warning:[/] {esc(out)} was not compacted: {esc(error)}")
        return
    if done.parts:
        console.print(f"[dim]compacted {done.parts} part file(s) of {esc(out)} in {done.time_s:.1f} s[/]")


@store_app.command("compact")
@json_command
def compact(
    results: Annotated[Path, typer.Argument(help="results directory")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
):
    """Fold finished part files into packs of up to 100,000 rows, so that the store loads in
    seconds at 10^5 rows. Safe while workers write into the store and against a crash at any
    point; every storing command also does it when it ends."""
    from mtad_energy.results.store import compact_store

    try:
        done = compact_store(results)
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if as_json:
        emit(done.to_dict())
        return
    if done.busy:
        console.print(f"another compaction of {esc(results)} is running; nothing done")
        return
    t = Table(title=f"compacted {esc(results)} in {done.time_s:.1f} s", title_justify="left",
              show_edge=False)
    for col in ("table", "part files", "packs merged", "packs written", "rows", "duplicates",
                "parts left"):
        t.add_column(col, justify="left" if col == "table" else "right")
    for r in done.tables:
        t.add_row(r.table, *(str(v) for v in (r.parts, r.packs_merged, r.packs_written, r.rows,
                                               r.duplicates, r.parts_left)))
    t.caption = ("parts left: steps of runs whose runs row is not compacted (an unfinished run, "
                 "redone by a re-run); duplicates: copies of a stored key dropped")
    console.print(t)
