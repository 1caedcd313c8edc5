"""The tuning grid of every decoder (`mtad-energy tune`): the one place in code that says which
settings a decoder is tuned over; each decoder page shows its grid (``<!-- decoder-grid NAME -->``,
generated from `TUNING_GRIDS` at build time by docs/hooks/decoder_params.py).

MTAD's grid is the paper's (appendix "Hyper-parameter Details": beam width {4, 8}, draft tokens
{3, 4}, acceptance threshold {0.1, 0.3, 0.5, 0.7, 0.9}); MMTAD, the extended version's method,
takes the same. The other decoders' grids are this project's: the parameter each method's own
paper varies (draft length, tree shape, thresholds), a few values around the default (`GRID_SOURCES`
says which). ``ar`` has no grid: it is the baseline every ratio is taken over.
"""

from __future__ import annotations

import itertools
from typing import Any

MTAD_GRID = {"beam_width": (4, 8), "gamma": (3, 4), "tau": (0.1, 0.3, 0.5, 0.7, 0.9)}

# decoder -> {parameter: values}; the settings are the grid's product (`grid_settings`)
TUNING_GRIDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "ar": {},
    "beam": {"beam_width": (2, 4, 8)},
    "mtjd": {"k": (2, 3, 4), "beam_width": (4, 8)},
    "spd": {"gamma": (2, 3, 4, 5, 6)},
    "mtad": MTAD_GRID,
    "mmtad": MTAD_GRID,
    "specinfer": {"branching": ((2, 2, 2), (4, 2, 2), (4, 2, 2, 1), (8, 1, 1))},
    "mcss": {"branching": ((2, 2, 2), (4, 2, 2), (4, 2, 2, 1), (8, 1, 1))},
    "spectr": {"num_drafts": (2, 4, 8), "gamma": (3, 4)},
    "bild": {"fallback": (0.5, 0.7, 0.9), "rollback": (1.0, 2.0, 3.0)},
    "typical": {"gamma": (3, 4), "eps": (0.05, 0.09, 0.3)},
    "pld": {"gamma": (5, 10), "max_ngram": (2, 3, 4)},
    "medusa": {"eps": (0.05, 0.09, 0.3), "delta": (0.3, 0.6)},
    "eagle": {"depth": (4, 6), "total_tokens": (30, 60)},
}

GRID_SOURCES = {
    "mtad": "the paper's (appendix \"Hyper-parameter Details\")",
    "mmtad": "MTAD's grid from the paper",
}
PROJECT_SOURCE = ("this project's: the parameter(s) the method's own paper varies, a few values "
                  "around the default")


def grid_source(name: str) -> str:
    """Where ``name``'s grid comes from, in words."""
    return GRID_SOURCES.get(name, PROJECT_SOURCE)


def grid_settings(name: str, overrides: dict[str, tuple[Any, ...]] | None = None
                  ) -> list[dict[str, Any]]:
    """Every setting of ``name``'s grid, in grid order (the last parameter varies fastest):
    `TUNING_GRIDS`' axes with ``overrides`` replacing or adding axes. ``ar``: one empty setting."""
    axes = {**TUNING_GRIDS[name], **(overrides or {})}
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def grid_markdown(name: str) -> str:
    """``name``'s grid as a decoder page shows it (a table of parameters and values)."""
    axes = TUNING_GRIDS.get(name, {})
    if not axes:
        return "No grid: `mtad-energy tune` measures it once, as the baseline.\n"
    rows = ["| parameter | values |", "|---|---|"]
    for param, values in axes.items():
        shown = ", ".join(f"`{','.join(map(str, v))}`" if isinstance(v, tuple) else f"`{v}`"
                          for v in values)
        rows.append(f"| `{param}` | {shown} |")
    n = len(grid_settings(name))
    return (f"`mtad-energy tune` measures these {n} settings (grid: {grid_source(name)}):\n\n"
            + "\n".join(rows) + "\n")
