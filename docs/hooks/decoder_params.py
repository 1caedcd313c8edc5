"""mkdocs hook: each decoder page's parameter table, generated at build time from the registry.

A page holds ``<!-- decoder-params NAME -->``; the hook replaces it with NAME's parameters, types,
defaults and help as ``mtad-energy decoders`` prints them (``param_specs`` of the registered
class), so the docs cannot drift from the code; and ``<!-- decoder-grid NAME -->`` with the grid
`mtad-energy tune` measures it over (`decoding.grids.grid_markdown`). An unknown NAME is a build
warning (a failure under ``mkdocs build --strict``), and so is a registered decoder no page
documents.
"""

from __future__ import annotations

import html
import logging
import re

log = logging.getLogger("mkdocs.hooks.decoder_params")
MARKER = re.compile(r"<!-- decoder-params (\w+) -->")
GRID_MARKER = re.compile(r"<!-- decoder-grid (\w+) -->")
_seen: set[str] = set()
HEAD_NAMES = {"eagle": "EAGLE", "medusa": "Medusa"}


def _cell(text: object, code: bool = False) -> str:
    """Help text as literal Markdown: one line; pipes, angle brackets and (outside a code span,
    ``code=False``) asterisks escaped, so a formula's ``delta*exp(-H)`` stays a product, never the
    start of an emphasis."""
    text = html.escape(re.sub(r"\s+", " ", str(text)).strip(), quote=False).replace("|", "\\|")
    return text if code else text.replace("*", "\\*")


def head_phrase(head: str) -> str:
    """'an EAGLE head', 'a Medusa head': the head's proper name with its article."""
    name = HEAD_NAMES.get(head, head)
    return f"{'an' if name[:1].upper() in 'AEIOU' else 'a'} {name} head"


def _table(name: str) -> str:
    from mtad_energy.decoding.registry import DECODERS, param_specs

    if name not in DECODERS:
        log.warning("decoder page names '%s', which is not a registered decoder", name)
        return f"*(no decoder named {name})*"
    _seen.add(name)
    cls = DECODERS[name]
    rows = ["| parameter | type | default | help |", "|---|---|---|---|"]
    for p in param_specs(cls):
        default = _cell(p["default"], code=True)
        rows.append(f"| `{p['name']}` | {_cell(p['type'])} | `{default}` | {_cell(p['help'])} |")
    needs = []
    if cls.needs_draft:
        needs.append("needs a draft model (`--draft`, or the alias's)")
    if cls.head:
        needs.append(f"needs {head_phrase(cls.head)} (`--draft {cls.head}:DIR`)")
    line = f"`mtad-energy decoders` says: *{_cell(cls.help)}*" + (f"; {'; '.join(needs)}." if needs else ".")
    return line + "\n\n" + "\n".join(rows) + "\n"


def on_pre_build(config) -> None:
    _seen.clear()


def _grid(name: str) -> str:
    from mtad_energy.decoding.grids import TUNING_GRIDS, grid_markdown

    if name not in TUNING_GRIDS:
        log.warning("decoder page names the grid of '%s', which has none", name)
        return f"*(no grid for {name})*"
    return grid_markdown(name)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = GRID_MARKER.sub(lambda m: _grid(m.group(1)), markdown)
    return MARKER.sub(lambda m: _table(m.group(1)), markdown)


def on_post_build(config) -> None:
    from mtad_energy.decoding.registry import DECODERS

    missing = sorted(set(DECODERS) - _seen)
    if missing:
        log.warning("decoders without a page (docs/decoders/NAME.md): %s", ", ".join(missing))
