"""The ``mtad-energy`` command line (typer + rich): one module per command group.

- `info`: decoders, models, env, generate (describe; decode one prompt)
- `measure`: profile, compare (decoders over prompts, ar beside them)
- `sweep`: sweep param, sweep batch-size, sweep draft (`sweep_draft`)
- `analyse`: decompose, schedule, report (over a stored results directory)
- `store`: store compact
- `calibrate`: calibrate (which meter to trust on this GPU)
- `tune`: tune (each decoder's best setting on a validation split; `compare --tuned` after it)

Shared pieces: `options` (parsing what the user typed, the shared option types), `output` (the
console, tables that wrap, ``--json``, errors and exit codes), `tables` (what the commands print),
`run` (running a configuration into a store), `engines` (``--engine``).

No module here imports torch at import time: the CLI sets OpenMP's passive wait policy first.
"""

from __future__ import annotations

from typing import Annotated

import typer

from mtad_energy.measure.contention import passive_openmp_default

passive_openmp_default()  # none of the imports below loads torch (and OpenMP): see its docstring

from mtad_energy.cli import analyse, info, measure, sweep  # noqa: E402
from mtad_energy.cli.calibrate import calibrate  # noqa: E402
from mtad_energy.cli.output import JsonErrorGroup  # noqa: E402
from mtad_energy.cli.store import store_app  # noqa: E402
from mtad_energy.cli.tune import tune  # noqa: E402

app = typer.Typer(help="Decoding algorithms, their speed, quality and energy.",
                  no_args_is_help=True, add_completion=False, cls=JsonErrorGroup)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"mtad-energy {version('mtad-energy')}")
        raise typer.Exit()


@app.callback()
def _main(show_version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print mtad-energy's version and exit")] = False) -> None:
    """Decoding algorithms, their speed, quality and energy."""

for command in (info.decoders, info.models, info.env, info.generate, measure.profile, measure.compare,
                tune, analyse.decompose, analyse.schedule, analyse.report):
    app.command()(command)
app.add_typer(sweep.sweep_app, name="sweep")
app.add_typer(store_app, name="store")
app.command()(calibrate)  # listed last, as before the CLI became a package

if __name__ == "__main__":
    app()
