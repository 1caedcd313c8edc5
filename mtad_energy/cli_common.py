"""Pieces every command uses: the console, --set parsing, quiet library logs, error exits, --json."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from typer._click.exceptions import ClickException  # typer vendors click: not the click package's
from typer.core import TyperGroup

console = Console()

# set while a command runs with --json: stdout is reserved for the one JSON document
_json_stdout: list[TextIO] = []


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


def esc(value: Any) -> str:
    """User text (paths, prompt ids, labels, messages) made safe for rich markup: `[/x]` prints as is."""
    return escape(str(value))


@contextlib.contextmanager
def json_mode(on: bool) -> Iterator[None]:
    """With ``on`` (--json): the console, progress bars and any stray print go to stderr, and
    `emit` / `fail` write exactly one JSON document to the real stdout."""
    if not on:
        yield
        return
    real, was_stderr = sys.stdout, console.stderr
    _json_stdout.append(real)
    console.stderr = True
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        console.stderr = was_stderr
        _json_stdout.pop()


def json_command(command: Callable) -> Callable:
    """Run a command that takes ``as_json`` under `json_mode`; with --json an unexpected exception
    becomes ``{"error": ..., "exit_code": 1}`` on stdout instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        with json_mode(as_json):
            try:
                return command(*args, **kwargs)
            except (typer.Exit, typer.Abort, ClickException, KeyboardInterrupt):
                raise
            except Exception as error:
                if not as_json:
                    raise
                fail(f"{type(error).__name__}: {error}", code=1)

    return wrapper


def emit(document: Any) -> None:
    """Print the command's JSON document on stdout (the real one, also under `json_mode`)."""
    out = _json_stdout[-1] if _json_stdout else sys.stdout
    out.write(json.dumps(document, indent=2, default=str) + "\n")
    out.flush()


def fail(error: Exception | str, code: int = 2, label: str = "[bold red]error:[/]") -> NoReturn:
    """Exit with ``code``: under --json as ``{"error": ..., "exit_code": ...}`` on stdout,
    otherwise as a message on the console (the message is printed as text, never as markup)."""
    if _json_stdout:
        emit({"error": str(error), "exit_code": code})
    else:
        console.print(f"{label} {esc(error)}")
    raise typer.Exit(code)


class JsonErrorGroup(TyperGroup):
    """The app's group: with --json on the command line, a usage error (unknown option, value out
    of range) is also one JSON document on stdout, with click's exit code."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if "--json" not in argv or not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as error:
            emit({"error": error.format_message(), "exit_code": error.exit_code})
            sys.exit(error.exit_code)
        except typer.Abort:
            emit({"error": "aborted", "exit_code": 1})
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
