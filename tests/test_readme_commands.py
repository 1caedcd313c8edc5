"""README's commands parse against the CLI: the two commands and every line of the cheat sheet.

README is the front page: a command it shows that the CLI no longer takes (a renamed option, a
dropped command) is the first thing a new user meets. Each `mtad-energy ...` command README shows
is resolved to its command path, `--help` of that path must succeed (typer's CliRunner), every
option README gives must be one of that command's options and appear in its help, and the whole
line must parse (click's own parser: option names, value types, argument count) without running
anything. No model loads: this runs in a second.

The test command (the second of "The two commands") must also be what CI runs, verbatim.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mtad_energy.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _section(text: str, title: str) -> str:
    """The text of README's `## title` section, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def _bash_blocks(section: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", section, flags=re.M | re.S)


def _lines(block: str) -> list[str]:
    """Shell lines of a block, continuations (trailing backslash) joined, comments kept."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def two_commands() -> list[str]:
    blocks = _bash_blocks(_section(README.read_text(), "The two commands"))
    assert len(blocks) == 2, "README's 'The two commands' must hold exactly two bash blocks"
    commands = [_lines(b) for b in blocks]
    assert all(len(c) == 1 for c in commands), "each of the two commands is one line"
    return [c[0] for c in commands]


def cheat_sheet() -> list[str]:
    blocks = _bash_blocks(_section(README.read_text(), "Cheat sheet"))
    assert len(blocks) == 1, "README's 'Cheat sheet' holds one bash block"
    return _lines(blocks[0])


def mtad_commands() -> list[str]:
    """Every `mtad-energy ...` invocation README shows: the parts of the two commands joined by
    `&&`, and each cheat-sheet line (its trailing comment dropped)."""
    found = []
    for line in two_commands() + cheat_sheet():
        for part in line.split("&&"):
            tokens = shlex.split(part, comments=True)
            if tokens and tokens[0] == "mtad-energy":
                found.append(shlex.join(tokens))
    return found


def resolve(tokens: list[str]):
    """(command path, click command, its parent context, the remaining tokens)."""
    root = typer.main.get_command(app)
    ctx = root.make_context("mtad-energy", ["--help"], resilient_parsing=True)
    cmd, path = root, []
    while hasattr(cmd, "list_commands") and tokens and tokens[0] in cmd.list_commands(ctx):
        name = tokens.pop(0)
        cmd = cmd.get_command(ctx, name)
        path.append(name)
        ctx = cmd.context_class(cmd, info_name=name, parent=ctx)
    return path, cmd, ctx.parent, tokens


def test_readme_shows_two_commands_and_a_short_cheat_sheet():
    main, tests = two_commands()
    assert main.endswith("mtad-energy profile --decoder mtad")
    assert tests.endswith("python -m pytest -n 2")
    assert 5 <= len(cheat_sheet()) <= 10, "the cheat sheet is about ten lines"
    assert all(line.startswith("mtad-energy ") for line in cheat_sheet())


def test_ci_runs_readmes_test_command_verbatim():
    assert two_commands()[1] in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("command", mtad_commands())
def test_readme_command_parses(command: str):
    tokens = shlex.split(command)[1:]
    path, cmd, parent, rest = resolve(list(tokens))
    assert path, f"{command!r}: no such command"
    assert not hasattr(cmd, "list_commands"), f"{command!r} names a group, not a command"

    result = CliRunner().invoke(app, path + ["--help"], terminal_width=200)
    assert result.exit_code == 0, f"mtad-energy {' '.join(path)} --help failed: {result.output}"
    help_text = re.sub(r"\s+", " ", result.output)

    known = {opt for p in cmd.get_params(parent) for opt in (*p.opts, *(p.secondary_opts or ()))
             if opt.startswith("-")}
    for token in rest:
        if token.startswith("-"):
            option = token.split("=", 1)[0]
            assert option in known, (
                f"README's {command!r}: 'mtad-energy {' '.join(path)}' has no option {option} "
                f"(it has {', '.join(sorted(known))})")
            assert option in help_text, f"{option} is missing from {' '.join(path)} --help"

    # the whole line through click's parser (names, value types, argument count); nothing runs
    cmd.make_context(cmd.name, list(rest), parent=parent)
