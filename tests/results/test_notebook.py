"""notebooks/jpt_vs_speedup.ipynb runs top to bottom against the fixture stores and draws its figures.

The kernel is ipykernel's built-in ``python3`` spec, looked up with no kernel directories, so it is
this interpreter (the test's venv) whatever kernelspecs the machine has installed, and nothing has
to be installed with ``ipykernel install``. The two runs (energy / no energy) share one event loop
and run side by side: most of each is kernel start-up and imports, so this halves the wall time.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.limits import hang_limit_s

# the notebook stack is a dev extra: a machine without it (e.g. a GPU box) skips this module
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient
KernelSpecManager = pytest.importorskip("jupyter_client.kernelspec").KernelSpecManager
AsyncKernelManager = pytest.importorskip("jupyter_client.manager").AsyncKernelManager

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "jpt_vs_speedup.ipynb"
FIGURE_TAGS = {"figure:jpt_vs_speedup", "figure:ppl_vs_block_efficiency", "figure:batch_energy",
               "figure:batch_crossover"}


async def _execute(store: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(nb, km=km, timeout=int(hang_limit_s(120)), shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    # raises CellExecutionError (with the cell and traceback) if any cell fails
    await client.async_execute(env={**os.environ, "MTAD_ENERGY_RESULTS": str(store)})
    return nb


@pytest.fixture(scope="module")
def executed(store_dir, no_energy_store_dir, decode_only_store_dir) -> dict[str, nbformat.NotebookNode]:
    async def all_three():
        return await asyncio.gather(_execute(store_dir), _execute(no_energy_store_dir),
                                    _execute(decode_only_store_dir))

    energy, no_energy, decode_only = asyncio.run(all_three())
    return {"energy": energy, "no_energy": no_energy, "decode_only": decode_only}


def _figures_by_tag(nb) -> dict[str, int]:
    found = {}
    for cell in nb.cells:
        for tag in cell.metadata.get("tags", []):
            found[tag] = sum("image/png" in out.get("data", {}) for out in cell.outputs)
    return found


def _cell_output(nb, tag: str) -> str:
    """Everything the cell tagged ``tag`` printed or displayed, as text."""
    cell = next(c for c in nb.cells if tag in c.metadata.get("tags", []))
    return "".join(out.get("text", "") + out.get("data", {}).get("text/plain", "")
                   for out in cell.outputs)


def _text(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs)


def test_notebook_is_stored_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    tags = {t for c in code for t in c.get("metadata", {}).get("tags", [])}
    assert FIGURE_TAGS <= tags


@pytest.mark.slow
def test_notebook_runs_with_energy(executed):
    nb = executed["energy"]
    figures = _figures_by_tag(nb)
    assert all(figures[tag] >= 1 for tag in FIGURE_TAGS), figures
    assert not any(out.output_type == "error" for c in nb.cells for out in c.get("outputs", []))
    assert "No energy" not in _text(nb)
    phases = _cell_output(nb, "table:attribution")  # joules per phase from the fitted model
    assert "draft_j_per_token" in phases and "rejected_share" in phases and "n/a" not in phases


@pytest.mark.slow
def test_notebook_explains_missing_energy(executed):
    nb = executed["no_energy"]
    figures = _figures_by_tag(nb)
    assert all(figures[tag] >= 1 for tag in FIGURE_TAGS), figures
    text = _text(nb)
    assert "No energy readings in these runs" in text and "no GPU energy counter" in text
    assert "No energy in the batch sweep" in text
    assert "No energy in the decoding sweep" in text
    assert ("Per-phase joules n/a: no decode energy measured: " + "meter 'none'") in text


@pytest.mark.slow
def test_notebook_on_a_store_with_only_decoding_sweeps(executed):
    """No profile runs: the run cells say so and go on; the decoding sweeps of two settings (and a
    --set temperature=0 sweep beside the first) get a table and a figure each."""
    nb = executed["decode_only"]
    assert not any(out.output_type == "error" for c in nb.cells for out in c.get("outputs", []))
    text = _text(nb)
    assert "has no profile runs" in text and "No profile runs: no J/token vs speed-up figure" in text
    assert _figures_by_tag(nb)["figure:batch_crossover"] == 2
    markdown = "".join(out.get("data", {}).get("text/markdown", "") for c in nb.cells
                       for out in c.get("outputs", []))
    assert "| spd(temperature=0) | 1 | 120.0 | 2.00x |" in markdown
    assert "crossover_batch_size" not in markdown and "**" not in markdown.split("### ")[-1]
