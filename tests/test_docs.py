"""The documentation says what the code and the committed results say.

The site's generated tables (docs/hooks/) render help text literally: a formula's ``*`` is a
product, never Markdown emphasis, and a head has its article ("an EAGLE head"). The figures the
home page, README and findings quote are read back from the result files they cite, so a page
and its store cannot drift apart: where a decoder beats ``ar`` and where none does, and which of
the CPU pair's block efficiencies each page uses. The paper is cited by title, authors, venue and
code, never by a folder users do not have, and no page quotes a test count that goes stale.
Nothing here loads a model: the stores are read as tables.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest

from mtad_energy import load_results

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "experiments" / "results"
TITLE = "Optimized Multi-Token Joint Decoding with Auxiliary Model for LLM Inference"
CODE_URL = "https://github.com/ZongyueQin/MTAD"


def _hook(name: str):
    """A docs/hooks/ module, imported from its file (the hooks are not a package)."""
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loose_stars(markdown: str) -> list[str]:
    """Lines holding an unescaped ``*`` outside code spans (Markdown would read emphasis)."""
    return [line for line in markdown.splitlines()
            if re.search(r"(?<!\\)\*", re.sub(r"`[^`]*`", "", line))]


def _text(path: Path) -> str:
    """A page's text with its line wrapping undone (one space between words)."""
    return " ".join(path.read_text(encoding="utf-8").split())


def _rows(path: Path) -> dict[str, list[str]]:
    """A page's Markdown table rows: first cell (code marks dropped) -> the other cells."""
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].replace("`", "")] = cells[1:]
    return rows


def _row(rows: dict[str, list[str]], prefix: str) -> list[str]:
    [key] = [k for k in rows if k.startswith(prefix)]
    return rows[key]


# ------------------------------------------------------------------ generated tables


def test_decoder_tables_keep_formulas_literal_and_name_heads():
    from mtad_energy.decoding.registry import DECODERS

    hook = _hook("decoder_params")
    for name in DECODERS:
        line, table = hook._table(name).split("\n\n", 1)
        # the help line is one italic span: its two delimiters are its only loose asterisks
        m = re.match(r"`mtad-energy decoders` says: \*(.*?)(?<!\\)\*[;.]", line)
        assert m, f"{name}: help line not one italic span: {line}"
        assert not _loose_stars(m.group(1) + line[m.end():]), f"{name}: {line}"
        assert not _loose_stars(table), f"{name}: {_loose_stars(table)}"
    typical = hook._table("typical")
    assert typical.count(r"min(eps, delta\*exp(-H(p)))") == 2  # the help line and eps's row
    assert "needs an EAGLE head (`--draft eagle:DIR`)" in hook._table("eagle")
    assert "needs a Medusa head (`--draft medusa:DIR`)" in hook._table("medusa")


def test_cli_reference_keeps_formulas_literal():
    markdown = _hook("cli_reference").cli_markdown()
    assert not _loose_stars(markdown), _loose_stars(markdown)[:3]
    assert r"P_static\*T + PW_flop\*T_flop" in markdown  # decompose's help, a product


# ------------------------------------------------------------------ citations and counts


def _prose_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md")),
            *sorted((ROOT / "mtad_energy").rglob("*.py"))]


def test_nothing_points_at_a_folder_users_do_not_have():
    lacking = ("mtad_paper.tex", "shared folder", "shared/reference", "../shared")
    hits = [f"{path.relative_to(ROOT)}:{i}" for path in _prose_files()
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if any(s in line for s in lacking)]
    assert not hits, f"cite the paper (title, authors, venue, code), not the folder: {hits}"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/design.md",
                                  "docs/decoders/mtad.md"])
def test_the_paper_is_cited_by_title_authors_venue_and_code(page: str):
    text = _text(ROOT / page)
    for part in (TITLE, "Zongyue Qin", "Yizhou Sun", "ICLR 2025", CODE_URL):
        assert part in text, f"{page} cites the paper without {part!r}"


def test_the_code_cites_the_design_notes_by_their_path():
    """A docstring or comment cites the design notes as "docs/design.md section N" (the file a
    reader can open; the site links it to the section), never by an old name ("DESIGN.md",
    "DESIGN section N"), and every cited section exists."""
    sections = set(re.findall(r"^## (\d+)\. ", (DOCS / "design.md").read_text(encoding="utf-8"), re.M))
    code = [*sorted((ROOT / "mtad_energy").rglob("*.py")), *sorted((ROOT / "experiments").rglob("*.py"))]
    old, missing = [], []
    for path in code:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{i}"
            old += [where] if re.search(r"\bDESIGN\b", line) else []
            missing += [f"{where} section {n}" for n in
                        re.findall(r"docs/design\.md,? (?:section |§ ?)(\d+)", line) if n not in sections]
    assert not old, f'cite the design notes by their path, "docs/design.md section N": {old}'
    assert not missing, f"docs/design.md has no such section: {missing}"


def test_no_page_quotes_a_test_count():
    count = re.compile(r"\b\d[\d,]* (?:passed|failed)\b")
    hits = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in _prose_files()
            if path.suffix == ".md" for m in count.finditer(_text(path))]
    assert not hits, f"a test count goes stale: generate it or leave it out: {hits}"


# ------------------------------------------------------------------ figures against their stores


@pytest.fixture(scope="module")
def sweep() -> pd.DataFrame:
    """The CPU pair's eager batch sweep (docs/findings/cpu-pair.md) with each row's speed-up."""
    df = load_results(RESULTS / "cpu" / "batch_decode", table="decode_batch")
    eager = df[df.model == "smollm2"]
    ar = eager[eager.decoder == "ar"].set_index("batch_size").tokens_per_s
    return eager.assign(speedup=eager.tokens_per_s / eager.batch_size.map(ar))


@pytest.fixture(scope="module")
def drafts() -> pd.DataFrame:
    return pd.read_csv(RESULTS / "drafts" / "drafts.csv")


@pytest.fixture(scope="module")
def compare() -> pd.DataFrame:
    return pd.read_csv(RESULTS / "cpu" / "compare_smollm2.csv").set_index(["dataset", "label"])


def test_home_page_and_readme_say_where_a_decoder_beats_ar(sweep, drafts):
    others = sweep[sweep.decoder != "ar"]
    assert others.speedup.max() < 1  # the sweep: no decoder beats ar on MT-Bench at any B
    int8 = drafts[drafts.draft_id == "self:int8"].set_index(["dataset", "decoder"]).speedup
    subsets = drafts[drafts.draft_id != "self:int8"].speedup
    assert int8["humaneval"].min() > 1 and int8["mtbench"].max() < 1 and subsets.max() < 1
    names = {"mmtad": "MMTAD", "spd": "SpD", "mtad": "MTAD", "specinfer": "SpecInfer"}
    for page in ("docs/index.md", "README.md"):
        text = _text(ROOT / page)
        for decoder, label in names.items():
            assert f"{label} {int8['humaneval', decoder]:.2f}x" in text, (page, decoder)
        assert f"({int8['mtbench'].min():.2f}-{int8['mtbench'].max():.2f}x)" in text, page
    home = _text(DOCS / "index.md")
    assert f"({others.speedup.min():.2f}-{others.speedup.max():.2f}x)" in home
    assert f"({subsets.min():.2f}-{subsets.max():.2f}x)" in home


def test_cpu_pair_block_efficiencies_match_their_result_files(sweep, drafts, compare):
    page = DOCS / "findings" / "cpu-pair.md"
    rows, medians = _rows(page), sweep.groupby("decoder").block_efficiency.median()
    for decoder, median in medians.items():  # the crossover table's "block eff." column
        assert float(rows["ar tok/s" if decoder == "ar" else decoder][-1]) == round(median, 2)
    assert _row(rows, "this sweep")[-2:] == [f"{medians['spd']:.2f}", f"{medians['mtad']:.2f}"]
    int8 = drafts[drafts.draft_id == "self:int8"].set_index(["dataset", "decoder"]).block_efficiency
    for prefix, be in (("[draft strength]", int8), ("an earlier", compare.block_efficiency)):
        want = [f"{be['humaneval', d]:.2f} / {be['mtbench', d]:.2f}" for d in ("spd", "mtad")]
        assert _row(rows, prefix)[-2:] == want, prefix


def test_h200_projection_names_the_block_efficiencies_it_borrowed(sweep, compare):
    """The projection used the compare run's mean over both datasets (what batched.csv stored);
    the page says so, quotes the sweep's lower medians and what the projection reads at them."""
    text = _text(DOCS / "findings" / "h200-round3.md")
    mean = compare.block_efficiency.groupby("label").mean()
    round3 = RESULTS / "gpu" / "nvidia-h200" / "round3"
    runs = pd.concat(pd.read_csv(f) for f in sorted(round3.glob("*/batched.csv")))
    for decoder in ("spd", "mtad"):
        assert runs[runs.decoder == decoder].cpu_pair_block_eff.eq(mean[decoder]).all()
    assert f"spd {mean['spd']:.2f}, mtad {mean['mtad']:.2f} tokens per target forward" in text
    medians = sweep.groupby("decoder").block_efficiency.median()
    assert f"spd {medians['spd']:.2f}, mtad {medians['mtad']:.2f}: MT-Bench alone" in text
    compiled = runs[(runs["mode"] == "compiled") & (runs.decoder != "ar")]
    rescaled = {(r.decoder, r.batch_size): r.projected_speedup_vs_ar * medians[r.decoder]
                / r.cpu_pair_block_eff for r in compiled.itertuples()}
    assert (f"compiled spd would read {rescaled['spd', 1]:.2f}x `ar` at B = 1 and "
            f"{rescaled['spd', 8]:.2f}x at B = 8, mtad {rescaled['mtad', 1]:.2f}x") in text
