"""write_report: report.md with the tables, and every figure as non-empty PNG and SVG."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtad_energy.results import ResultStore
from mtad_energy.results.report import FIGURES, write_report
from tests.results.conftest import NO_ENERGY_REASON

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reports(store_dir, no_energy_store_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    return {"energy": write_report(store_dir, out / "energy"),
            "no_energy": write_report(no_energy_store_dir, out / "no-energy")}


@pytest.mark.parametrize("variant", ["energy", "no_energy"])
def test_every_figure_is_written_as_png_and_svg(reports, variant):
    report = reports[variant]
    assert report.name == "report.md" and report.is_file()
    for name in FIGURES:
        png, svg = report.parent / "figures" / f"{name}.png", report.parent / "figures" / f"{name}.svg"
        assert png.stat().st_size > 10_000, png
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert svg.stat().st_size > 10_000 and "<svg" in svg.read_text()[:2000], svg
        assert f"](figures/{name}.png)" in report.read_text()


def test_report_has_the_tables(reports):
    md = reports["energy"].read_text()
    assert "## Main table" in md
    assert "| label | humaneval: tokens/s ↑ | humaneval: speed-up ↑ | humaneval: J/token ↓" in md
    assert "| mmtad | **" in md and "<u>" in md
    assert "## Batch size" in md and "| batch size | runs | inputs | energy (J) |" in md
    assert "| 16 | 3,000 | 48,000 | 74,058 | 24.7 |" in md
    assert "## Accepted draft lengths" in md and "| mtad(tau=0.3) |" in md
    assert "Every run (24) has an energy reading." in md


def test_missing_energy_is_explained(reports):
    md = reports["no_energy"].read_text()
    assert "**No run has an energy reading**" in md
    assert NO_ENERGY_REASON in md
    assert "J/token" not in md.split("## Main table")[1].split("\n\n")[2].splitlines()[0]
    assert "speed-up vs block efficiency instead" in md
    assert "| 1 | 3,000 | 3,000 | n/a | n/a | n/a | 1,129 |" in md


def test_empty_store_and_default_location(tmp_path):
    store = tmp_path / "profile"
    ResultStore(store)
    report = write_report(store)
    assert report == tmp_path / "profile-report" / "report.md"
    assert "holds no rows yet" in report.read_text()
    ResultStore(store, create=False)  # the store is still a valid store: nothing was written inside


def test_report_refuses_to_write_inside_the_store(store_dir):
    with pytest.raises(ValueError, match="inside the results store"):
        write_report(store_dir, store_dir / "report")


def test_the_report_says_where_the_joules_go(reports):
    md = reports["energy"].read_text().split("## Where the joules go")[1].split("\n## ")[0]
    assert "**Paper form** (5 batch rows;" in md and "**Energy roofline** (5 batch rows;" in md
    assert "| pi0 (W) |" in md and "| eps_byte (J/byte) |" in md
    assert "window(s) it was not fitted on with a median |error| of" in md
    assert "| source | label | batch size | draft | target | other | static | FLOP | memory |" in md
    assert "| runs | mtad(tau=0.3) | 1 |" in md  # one row per configuration
    assert "| decode_batch | spd | 4 |" in md
    assert "n/a: " not in md  # every window has energy and counted work
    none = reports["no_energy"].read_text().split("## Where the joules go")[1].split("\n## ")[0]
    assert "No energy model" not in none and "not fitted: 5 of 5 rows lack energy" in none
    assert f"n/a: no decode energy measured: {NO_ENERGY_REASON}" in none
    assert "| 0.0 |" not in none  # n/a, never 0
