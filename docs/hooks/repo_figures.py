"""mkdocs hook: the figures committed under ``experiments/results/`` are served at the same path.

A findings page shows ``../experiments/results/cpu/batch_decode-crossover.png``: the PNG the
study wrote, where it was committed, never a copy under ``docs/`` that could go stale. Every PNG
under ``experiments/results/`` is added to the site at its repository path; a page linking one
that does not exist fails ``mkdocs build --strict`` as any broken link does.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    root = Path(config.config_file_path).resolve().parent
    for png in sorted((root / "experiments" / "results").rglob("*.png")):
        uri = png.relative_to(root).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files
