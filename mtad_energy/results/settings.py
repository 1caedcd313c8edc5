"""What a row was measured under beyond its decoder configuration: the meter, the tokens asked
for, the device and dtype, the engine and the batch size. Rows that differ in any of them are two
measurements of two things, so no table row averages them: `setting_labels` names, per row, the
values that vary across a frame (nothing where every row shares them), and the summaries group
by that name and put it into the configuration's label (``spd [meter simulated, 64 tokens]``).

Pure pandas, like `analysis`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

# column -> how a row's value is named (None: a row stored before the column)
SETTING_COLUMNS: dict[str, Callable[[Any], str]] = {
    "meter": lambda v: f"meter {v}" if v is not None else "meter unrecorded",
    "max_new_tokens": lambda v: f"{_int(v)} tokens" if v is not None else "tokens unrecorded",
    "device": lambda v: str(v).split(":")[0] if v is not None else "device unrecorded",  # not its index
    "dtype": lambda v: str(v) if v is not None else "dtype unrecorded",
    "engine": lambda v: str(v) if v is not None else "hf",  # rows before engines were hf's
    "batch_size": lambda v: f"B={_int(v) if v is not None else 1}",  # runs rows name B above 1 only
}


def settings_except(*columns: str) -> dict[str, Callable[[Any], str]]:
    """`SETTING_COLUMNS` less ``columns`` (those a table keeps apart already, e.g. by batch size)."""
    return {k: v for k, v in SETTING_COLUMNS.items() if k not in columns}


def _int(value: Any) -> str:
    try:
        return str(int(float(value)))
    except (TypeError, ValueError):
        return str(value)


def setting_labels(frame: pd.DataFrame, columns: dict = SETTING_COLUMNS) -> pd.Series:
    """Per row of ``frame``: the values of the setting ``columns`` that vary within one model
    (rows of two models are apart already, and the stored model names a compiled, batched or
    other engine's setting), named and joined ("meter simulated, 64 tokens"); "" where every
    row of each model shares them (index: the frame's)."""
    parts = []
    model = frame["model"].astype(str) if "model" in frame else pd.Series("", index=frame.index)
    for column, name in columns.items():
        if column in frame:
            named = frame[column].astype(object).map(lambda v, f=name: f(None if v is None or v != v
                                                                       else v))
            if named.groupby(model).nunique().max() > 1:
                parts.append(named)
    if not parts:
        return pd.Series("", index=frame.index, dtype=object, name="setting")
    return parts[0].str.cat(parts[1:], sep=", ").astype(object).rename("setting")


def with_setting(labels: pd.Series, setting: pd.Series) -> pd.Series:
    """``labels`` with their row's setting appended in brackets where it has one."""
    return labels.where(setting == "", labels.astype(str) + " [" + setting.astype(str) + "]")
