"""Pieces every command uses: the console, --set parsing, quiet library logs, error exits."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

console = Console()


def parse_sets(sets: list[str] | None) -> dict[str, str]:
    """['tau=0.3', 'beam_width=8'] -> {'tau': '0.3', 'beam_width': '8'}."""
    out: dict[str, str] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def quiet_libraries() -> None:
    """Hide transformers' per-load progress bars and info logs on the command line."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def fail(error: Exception) -> NoReturn:
    console.print(f"[bold red]error:[/] {error}")
    raise typer.Exit(2)
