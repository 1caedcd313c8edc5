"""Pieces every command uses: the console, --set parsing, quiet library logs, error exits, --json."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer._click.exceptions import ClickException  # typer vendors click: not the click package's
from typer.core import TyperGroup

console = Console()
err_console = Console(stderr=True)  # errors: stdout keeps only what a command produces

# set while a command runs with --json: stdout is reserved for the one JSON document
_json_stdout: list[TextIO] = []


def quiet_libraries() -> None:
    """Hide transformers' per-load progress bars and info logs on the command line."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def esc(value: Any) -> str:
    """User text (paths, prompt ids, labels, messages) made safe for rich markup: `[/x]` prints as is."""
    return escape(str(value))


def _header_words(header: str) -> list[str]:
    """A header's words: where it must wrap, it wraps between them, never inside one."""
    return header.split()


def _least_widths(texts: Sequence[Sequence[str]]) -> list[int]:
    """Per column (its header, then its cells): the narrowest width that keeps its header's and
    its cells' words whole."""
    return [max([len(w) for w in _header_words(col[0])]
                + [len(w) for t in col[1:] for w in t.split()] + [1]) for col in texts]


def column_parts(texts: Sequence[Sequence[str]], keys: Sequence[int], width: int) -> list[list[int]]:
    """The columns of ``texts`` split into tables stacked one below the other, each holding the
    ``keys`` columns (the names that identify a row) and as many of the others, in order, as fit
    ``width`` with every header and number whole (3 characters between columns); one part when
    they all fit."""
    least = _least_widths(texts)
    rest = [i for i in range(len(texts)) if i not in keys]
    parts: list[list[int]] = []
    for i in rest:
        if parts:
            cols = [*keys, *parts[-1], i]
            if sum(least[c] for c in cols) + 3 * (len(cols) - 1) <= width:
                parts[-1].append(i)
                continue
        parts.append([i])
    return [[*keys, *p] for p in parts] or [list(keys)]


class WrappingTable(Table):
    """A `Table` that prints as several tables stacked (``parts``, each repeating the name
    columns) when its columns cannot fit the width with their headers and numbers whole: the
    title on the first, the caption under the last."""

    parts: list[Table] = []

    def __rich_console__(self, console_: Console, options: Any) -> Any:
        if len(self.parts) < 2:
            yield from super().__rich_console__(console_, options)
            return
        if self.title:  # at the full width, not the first part's
            yield console_.render_str(str(self.title), style="table.title")
        yield from self.parts
        if self.caption:
            yield console_.render_str(str(self.caption), style="table.caption")


def wrapping_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[str] = (),
                   width: int | None = None, keys: Sequence[str] | None = None,
                   **options: Any) -> Table:
    """A table for the console whose headers and cells wrap, never cut, when it is wider than the
    terminal (``width``, default the console's: 80 columns when piped to a file). Each column
    gets at least its longest word (a header wraps between its words, never inside one), and
    the rest of the room goes to the columns with the most text to wrap, so headers and
    sentences wrap at spaces and numbers stay whole; where even the longest words do not fit,
    the table prints as several stacked ones (`column_parts`), each repeating the ``keys``
    columns (default: the first two of the ``left`` columns: the names, left-aligned; the others
    are numbers). Cells are text (escape user text with `esc`)."""
    total = width or console.width
    texts = [[str(col), *(str(r[i]) for r in rows)] for i, col in enumerate(columns)]
    keys = [i for i, col in enumerate(columns)
            if (col in keys if keys is not None else col in left and i < 2)] or [0]
    split = column_parts(texts, keys, total) if options.get("show_header", True) else \
        [list(range(len(columns)))]

    def build(cols: Sequence[int], cls: type[Table] = Table, **more: Any) -> Table:
        table = cls(show_edge=False, pad_edge=False, title_justify="left", caption_justify="left",
                    **more)
        widths = column_widths([texts[i] for i in cols], total - 3 * max(0, len(cols) - 1))
        for i, w in zip(cols, widths, strict=True):
            table.add_column(esc(columns[i]), justify="left" if columns[i] in left else "right",
                             overflow="fold", width=w)
        for r in rows:
            table.add_row(*(str(r[i]) for i in cols))
        return table

    whole = build(range(len(columns)), WrappingTable, **options)
    part_options = {k: v for k, v in options.items() if k not in ("title", "caption")}
    whole.parts = [build(cols, **part_options) for cols in split] if len(split) > 1 else []
    return whole


def column_widths(texts: Sequence[Sequence[str]], room: int) -> list[int]:
    """Content widths for columns of ``texts`` (each column: its header, then its cells) within
    ``room`` characters: natural widths when they fit; else every column its longest word plus a
    share of what is left, by how much it would still wrap; where not even the longest words
    fit, the widest headers give up characters first, then the widest columns (their longest
    words fold), until the table fits."""
    natural = [max(len(line) for t in col for line in t.splitlines() or [""]) for col in texts]
    if sum(natural) <= room:
        return list(natural)
    cells = [max([len(w) for t in col[1:] for w in t.split()], default=1) for col in texts]
    least = _least_widths(texts)
    while sum(least) > room:  # fold headers before numbers and names: the widest first
        over = [i for i, (w, c) in enumerate(zip(least, cells, strict=True)) if w > c] or \
            [i for i, w in enumerate(least) if w > 1]
        if not over:
            break
        least[max(over, key=lambda i: least[i])] -= 1
    widths, spare = list(least), max(0, room - sum(least))
    want = [n - m for n, m in zip(natural, least, strict=True)]
    total = sum(want)
    for i, w in enumerate(want):  # in proportion to what each still lacks, rounded down
        widths[i] += min(w, spare * w // total) if total else 0
    left = room - sum(widths)
    for i in sorted(range(len(texts)), key=lambda i: natural[i] - widths[i], reverse=True):
        if left <= 0:
            break
        add = min(left, natural[i] - widths[i])
        widths[i] += add
        left -= add
    return widths


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


def _warning_line(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """A Python warning raised while a command runs, as one console line (never a raw
    ``UserWarning`` with its source line): "warning: MESSAGE"."""
    console.print(f"[yellow]warning:[/] {esc(message)}", highlight=False)


def json_command(command: Callable) -> Callable:
    """Run a command that takes ``as_json`` under `json_mode`; with --json an unexpected exception
    becomes ``{"error": ..., "exit_code": 1}`` on stdout instead of a traceback. A Python warning
    prints as one line (`_warning_line`)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        with json_mode(as_json), warnings.catch_warnings():  # restores showwarning after
            warnings.showwarning = _warning_line
            try:
                return command(*args, **kwargs)
            except (typer.Exit, typer.Abort, ClickException, KeyboardInterrupt):
                raise
            except Exception as error:
                if not as_json:
                    raise
                fail(f"{type(error).__name__}: {error}", code=1)

    return wrapper


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, an unbounded interval's inf) as None:
    strict JSON (RFC 8259; Node's and Go's parsers) has no NaN or Infinity. What a null means is
    said beside it (a fit's verdict, an energy reason, the budget's ``seconds_reason``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def emit(document: Any) -> None:
    """Print the command's JSON document on stdout (the real one, also under `json_mode`): strict
    JSON, non-finite numbers as null (`finite`)."""
    out = _json_stdout[-1] if _json_stdout else sys.stdout
    out.write(json.dumps(finite(document), indent=2, default=str, allow_nan=False) + "\n")
    out.flush()


# columns that count things (tokens, forwards, sizes, seeds): integers, though pandas stores them as
# floats as soon as one row lacks them (NaN); JSON output turns them back (`integer_records`)
INTEGER_COLUMNS = frozenset((
    "max_new_tokens", "seed", "repeat", "repeats", "prompt_len", "tokens_emitted", "iterations",
    "draft_proposed", "draft_accepted", "draft_forwards", "target_forwards", "batch_size", "runs",
    "forwards_per_run", "context_len", "tokens", "prompts", "iteration", "emitted", "proposed",
    "accepted", "flops", "bytes", "n", "n_runs", "n_prompts", "rows", "windows", "total_tokens",
    "graphs_compiled",
))


def integer_records(frame: Any) -> list[dict[str, Any]]:
    """A frame's rows as JSON-ready dicts (NaN -> None) where a count column (`INTEGER_COLUMNS`)
    holds ints: ``8`` not ``8.0``. A value that is not integral is left as it is (never rounded)."""
    records = json.loads(frame.to_json(orient="records"))
    for record in records:
        for name, value in record.items():
            column = name.lower().replace(" ", "_")  # a shown table's "Batch Size" too
            counts = column in INTEGER_COLUMNS or column.endswith("_batch_size")  # crossover_...
            if counts and isinstance(value, float) and value.is_integer():
                record[name] = int(value)
    return records


def fail(error: Exception | str, code: int = 2, label: str = "[bold red]error:[/]") -> NoReturn:
    """Exit with ``code`` (or the error's own ``exit_code``: an engine that died is a failure
    while running, 1, wherever it is caught): under --json as ``{"error": ..., "exit_code":
    ...}`` on stdout, otherwise as a message on stderr (printed as text, never as markup)."""
    code = getattr(error, "exit_code", code)
    if _json_stdout:
        emit({"error": str(error), "exit_code": code})
    else:
        err_console.print(f"{label} {esc(error)}")
    raise typer.Exit(code)


RICH_HELP_MIN_WIDTH = 100  # narrower, rich's option panels cut long option names with "…"


def plain_help_unless_wide(command: Any, console_: Console | None = None) -> None:
    """Typer's rich help panels cut what does not fit ("--allow-code-exec…"); click's plain help
    wraps and cuts nothing. Use the plain one for ``command`` and its subcommands unless the help
    goes to a terminal at least `RICH_HELP_MIN_WIDTH` columns wide (a pipe or file is 80)."""
    c = console_ or console
    if c.is_terminal and c.width >= RICH_HELP_MIN_WIDTH:
        return
    command.rich_markup_mode = None
    if not command.short_help and command.help:  # click cuts a derived one at 45 characters
        command.short_help = command.help.strip().split("\n\n")[0].replace("\n", " ")
    for sub in getattr(command, "commands", {}).values():
        plain_help_unless_wide(sub, c)


class JsonErrorGroup(TyperGroup):
    """The app's group: with --json on the command line, a usage error (unknown option, value out
    of range) is also one JSON document on stdout, with click's exit code. Help is plain text
    (wrapped, never cut) unless it goes to a wide terminal (`plain_help_unless_wide`)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        plain_help_unless_wide(self)
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


