"""``python -m mtad_energy``: the `mtad-energy` CLI where no console script is installed (a
checkout on ``PYTHONPATH``, as on the GPU kit's machine)."""

from mtad_energy.cli import app

app(prog_name="mtad-energy")
