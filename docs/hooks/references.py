"""mkdocs hook: the code's citations of the design notes resolve, or the build fails.

Docstrings (rendered on the API reference pages) and pages cite the design notes by their path,
"docs/design.md section N". Each citation becomes a link to ``design.md#section-N``; a section the
design page does not have is a build warning, so ``mkdocs build --strict`` fails on a citation
that does not resolve. Citations of any other docs page as ``docs/PATH.md`` (the design notes
without a section included) link to that page the same way, and fail the same way when it is
missing.
"""

from __future__ import annotations

import logging
import posixpath
import re

log = logging.getLogger("mkdocs.hooks.references")
CITE = re.compile(r"\bdocs/design\.md,? (?:section |§ ?)(\d+)\b")
# a page cited by its path, unless CITE already links it to a section
DOCS = re.compile(r"\bdocs/([\w/.-]+\.md)\b(?!,? (?:section |§ ?)\d)")
SECTION = re.compile(r"^## (\d+)\. .*\{#section-\1\}\s*$", re.M)
_sections: set[str] = set()


def on_files(files, config):
    _sections.clear()
    design = files.get_file_from_path("design.md")
    if design is None:
        log.warning("docs/design.md is missing: its citations cannot resolve")
        return files
    with open(design.abs_src_path, encoding="utf-8") as f:
        _sections.update(SECTION.findall(f.read()))
    return files


def _link(match: re.Match, page, files) -> str:
    section = match.group(1)
    if section not in _sections:
        log.warning("%s cites docs/design.md section %s, which it does not have",
                    page.file.src_uri, section)
        return match.group(0)
    design = files.get_file_from_path("design.md")
    return f'<a href="{_rel(page, design.url)}#section-{section}">{match.group(0)}</a>'


def _rel(page, dest_url: str) -> str:
    url = page.url
    base = "." if not url else (url.rstrip("/") if url.endswith("/") else posixpath.dirname(url) or ".")
    rel = posixpath.relpath(dest_url.rstrip("/") or ".", base)
    return rel + "/" if dest_url.endswith("/") else rel


def _doc_link(match: re.Match, page, files) -> str:
    dest = files.get_file_from_path(match.group(1))
    if dest is None or not dest.page:
        log.warning("%s cites docs/%s, which is not a page", page.file.src_uri, match.group(1))
        return match.group(0)
    return f'<a href="{_rel(page, dest.url)}">{match.group(0)}</a>'


def on_page_content(html: str, page, config, files) -> str:
    if page.file.src_uri == "design.md":
        return html
    # outside tags only: split on tags, rewrite the text between them, skip text inside <a>
    parts = re.split(r"(<[^>]+>)", html)
    in_link = 0
    for i, part in enumerate(parts):
        if part.startswith("<"):
            if re.match(r"<a[\s>]", part):
                in_link += 1
            elif part.startswith("</a"):
                in_link = max(0, in_link - 1)
            continue
        if not in_link and "docs/design.md" in part:
            parts[i] = part = CITE.sub(lambda m: _link(m, page, files), part)
        if not in_link and "docs/" in part:
            parts[i] = DOCS.sub(lambda m: _doc_link(m, page, files), part)
    return "".join(parts)
