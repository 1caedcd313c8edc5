"""Tuned beside default on the same held-out prompts (`tuning.tuned_vs_default`, its markdown and
`figures.plot_tuned_vs_default`): per-run means, the setting named by its grid's axes, one row per
side, and a figure that draws a bar per decoder and side."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mtad_energy.results.figures import plot_tuned_vs_default
from mtad_energy.results.tuning import tuned_vs_default, tuned_vs_default_markdown

WARP = {"temperature": 1.0, "top_k": 10, "top_p": 0.9}


def _runs(settings: dict[str, dict], values: dict[str, list[tuple]], contended: bool = False
          ) -> pd.DataFrame:
    """Rows of one held-out store: per decoder its params and a (block eff., acceptance, ppl) per
    prompt."""
    rows = []
    for decoder, per_prompt in values.items():
        for i, (be, acc, ppl) in enumerate(per_prompt):
            rows.append({"dataset": "mtbench", "decoder": decoder, "prompt_id": f"mtbench/{i}",
                         "params_json": json.dumps({**settings[decoder], **WARP}, sort_keys=True),
                         "block_efficiency": be, "acceptance_rate": acc, "perplexity": ppl,
                         "contended": contended})
    return pd.DataFrame(rows)


@pytest.fixture()
def table():
    default = _runs({"ar": {}, "mtad": {"beam_width": 4, "gamma": 4, "tau": 0.5}, "spd": {"gamma": 4}},
                    {"ar": [(1.0, None, 5.0), (1.0, None, 4.0)],
                     "mtad": [(3.0, 0.5, 3.0), (2.0, 0.3, 4.0)], "spd": [(2.0, 0.4, 5.0), (2.5, 0.5, 5.0)]},
                    contended=True)
    tuned = _runs({"ar": {}, "mtad": {"beam_width": 4, "gamma": 4, "tau": 0.1}, "spd": {"gamma": 3}},
                  {"ar": [(1.0, None, 5.0), (1.0, None, 4.0)],
                   "mtad": [(4.0, 0.8, 3.5), (3.0, 0.6, 3.5)], "spd": [(2.0, 0.5, 3.0), (2.0, 0.4, 4.0)]})
    return tuned_vs_default(tuned, default)


def test_one_row_per_decoder_and_side_with_per_run_means_in_the_papers_order(table):
    assert list(zip(table["decoder"], table["side"], strict=True)) == [
        ("ar", "default"), ("ar", "tuned"), ("spd", "default"), ("spd", "tuned"),
        ("mtad", "default"), ("mtad", "tuned")]
    mtad = table[table.decoder == "mtad"].set_index("side")
    assert mtad.loc["default", "block_efficiency"] == pytest.approx(2.5)
    assert mtad.loc["tuned", "acceptance_rate"] == pytest.approx(0.7)
    assert mtad.loc["tuned", "perplexity"] == pytest.approx(3.5)
    # the setting by its grid's axes only (the warp every setting shares is left out)
    assert mtad.loc["default", "params"] == "beam_width=4, gamma=4, tau=0.5"
    assert mtad.loc["tuned", "params"] == "beam_width=4, gamma=4, tau=0.1"
    assert table.loc[table.decoder == "ar", "params"].tolist() == ["", ""]
    assert math.isnan(table.loc[table.decoder == "ar", "acceptance_rate"].iloc[0])
    assert table.set_index(["decoder", "side"])["contended_rows"].to_dict()[("spd", "default")] == 2
    assert set(table["n_prompts"]) == {2}


def test_the_markdown_sets_default_beside_tuned(table):
    text = tuned_vs_default_markdown(table)
    line = next(r for r in text.splitlines() if "| mtad |" in r)
    assert line == ("| mtbench | mtad | `beam_width=4, gamma=4, tau=0.5` | `beam_width=4, gamma=4, "
                    "tau=0.1` | 2.50 | 3.50 | 0.40 | 0.70 | 3.50 | 3.50 |")
    assert "| mtbench | ar | `-` | `-` | 1.00 | 1.00 | n/a | n/a | 4.50 | 4.50 |" in text


def test_a_decoder_with_two_settings_in_one_store_is_refused():
    two = _runs({"spd": {"gamma": 3}}, {"spd": [(2.0, 0.5, 3.0)]})
    two = pd.concat([two, two.assign(params_json=json.dumps({"gamma": 4}))], ignore_index=True)
    with pytest.raises(ValueError, match="spd has 2 settings"):
        tuned_vs_default(two, two)


def test_the_figure_draws_a_bar_per_decoder_and_side_and_the_baselines_perplexity(table):
    fig = plot_tuned_vs_default(table, subtitle="pair")
    be, ppl = fig.axes[:2]
    assert len(be.patches) == len(ppl.patches) == 4  # spd and mtad, default and tuned; ar no bar
    heights = sorted(round(p.get_height(), 6) for p in be.patches)
    assert heights == [2.0, 2.25, 2.5, 3.5]
    assert [t.get_text() for t in be.get_xticklabels()] == ["spd", "mtad"]
    assert any(line.get_ydata()[0] == pytest.approx(4.5) for line in ppl.get_lines())  # ar's PPL
    assert "pair" in fig._suptitle.get_text()
