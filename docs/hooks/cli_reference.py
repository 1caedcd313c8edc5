"""mkdocs hook: the CLI reference, generated at build time from the typer app.

`docs/reference/cli.md` holds the marker ``<!-- cli-reference -->``; this hook replaces it with
every command of ``mtad_energy.cli.app`` (walked as the click command tree typer builds), its
usage, help, arguments and options (names, default, help, from the help record ``--help``
prints). Typer ships its own copy of click (``typer._click``), so the tree is walked by duck
typing (``list_commands``, ``param_type_name``), not ``isinstance`` checks. Nothing generated is
committed, so the page cannot go stale; a command without help text is a build warning (a failure
under ``mkdocs build --strict``).
"""

from __future__ import annotations

import html
import logging
import re

log = logging.getLogger("mkdocs.hooks.cli_reference")
MARKER = "<!-- cli-reference -->"


def _stars(text: str) -> str:
    """Asterisks outside code spans escaped: help text is plain, so ``P_static*T + PW_flop*T_flop``
    is a product, never an emphasis that swallows the ``+`` between."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("*", "\\*") for p in parts)


def _cell(text: object) -> str:
    """A table cell: one line, pipes, angle brackets and asterisks escaped."""
    text = re.sub(r"\s+", " ", str(text)).strip()
    return _stars(html.escape(text, quote=False).replace("|", "\\|"))


def _row(param, ctx) -> str:
    """One table row from the help record ``--help`` prints: names and metavar, default, help."""
    names, help_text = param.get_help_record(ctx) or (param.name, "")
    default = ""
    m = re.search(r"\s*\[([^\[\]]*)\]\s*$", help_text or "")
    if m and re.match(r"(default: |required|x[<>]|\d)", m.group(1)):
        default, help_text = m.group(1).removeprefix("default: "), help_text[: m.start()]
    names = re.sub(r"\s+", " ", names).replace("|", "\\|")  # a code span: no HTML escapes
    return f"| `{names}` | {_cell(default)} | {_cell(help_text)} |"


def _command(path: list[str], cmd, ctx, out: list[str]) -> None:
    title = " ".join(path)
    depth = min(len(path) + 1, 4)
    out.append(f"{'#' * depth} `{title}`\n")
    help_text = (cmd.help or cmd.short_help or "").strip()
    if not help_text:
        log.warning("cli reference: command '%s' has no help text", title)
    else:
        # typer keeps docstrings as written: paragraphs stay, \b markers (click) go
        out.append(_stars(help_text.replace("\b\n", "").replace("\b", "")) + "\n")
    usage = " ".join(cmd.collect_usage_pieces(ctx))
    out.append(f"```text\n{title} {usage}\n```\n")
    params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
    args = [p for p in params if p.param_type_name == "argument"]
    opts = [p for p in params if p.param_type_name == "option"]
    if args:
        out.append("| argument | default | help |\n|---|---|---|")
        out.extend(_row(p, ctx) for p in args)
        out.append("")
    if opts:
        out.append("| option | default | help |\n|---|---|---|")
        out.extend(_row(p, ctx) for p in opts)
        out.append("")
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            with sub.context_class(sub, info_name=name, parent=ctx) as sub_ctx:
                _command(path + [name], sub, sub_ctx, out)


def cli_markdown() -> str:
    import typer

    from mtad_energy.cli import app

    root = typer.main.get_command(app)
    out: list[str] = []
    with root.context_class(root, info_name="mtad-energy") as ctx:
        names = [n for n in root.list_commands(ctx) if not root.get_command(ctx, n).hidden]
        out.append("Commands: " + ", ".join(f"`{n}`" for n in names) + ".\n")
        _command(["mtad-energy"], root, ctx, out)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_markdown())
