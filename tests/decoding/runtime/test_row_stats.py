"""Per-row statistics of every batched drafting decoder (docs/concepts/statistics.md,
docs/design.md section 6): in a batch of B = 3 rows of different lengths, whose drafts
differ in length (a row's depth capped by what it can still emit; pld's lookups of their own
lengths; BiLD's own fallback points; EAGLE-2's chosen depths), each row's every iteration
emits its kept draft tokens plus the token from p: ``emitted == accepted + 1``, with
``accepted <= draft_depth``. The one exception is a row's last iteration, whose block
``max_new_tokens`` (or EOS; the vocabulary here has none) may cut: there
``accepted <= emitted <= accepted + 1``.

Sampled (temperature 1) on a 5-token target whose draft and heads are often right, so rows
accept different lengths in the same iteration and a batch's padded draft slots hold tokens
p gives real mass: a rule that let a row accept past its own draft (pld's padding, a tree
node below a row's cap) shows up as emitted > accepted + 1."""

from __future__ import annotations

import pytest

from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.models import load_pair
from tests import tiny

PROMPTS = [[1, 0, 2], [3], [4, 1, 0, 2, 2, 3, 1]]
SEEDS = 4  # seeded runs per decoder (pld, the cheapest, runs twice as many)
MAX_NEW = 14

CASES = [
    ("spd", {"gamma": 3}),
    ("typical", {"gamma": 3, "eps": 0.3, "delta": 0.5}),
    ("bild", {"max_draft": 4, "fallback": 0.3, "rollback": 1.5}),
    ("mtad", {"gamma": 3, "beam_width": 2}),
    ("mmtad", {"gamma": 3, "beam_width": 2}),
    ("specinfer", {"branching": (2, 2)}),
    ("mcss", {"branching": (2, 2)}),
    ("spectr", {"gamma": 3, "num_drafts": 2}),
    ("pld", {"gamma": 4, "max_ngram": 2}),
    ("medusa", {"branching": (2, 2), "acceptance": "typical"}),
    ("medusa", {"branching": (2, 2), "acceptance": "speculative"}),
    ("eagle", {"tree": "dynamic", "depth": 2, "expand": 2, "total_tokens": 5}),
    ("eagle", {"tree": "static", "branching": (2, 2)}),
]


@pytest.fixture(scope="module")
def small_drafting_pair(tmp_path_factory):
    """The 5-token lossless target with its draft model and Medusa-1 / EAGLE-1 heads, loaded
    through the real path."""
    root = tmp_path_factory.mktemp("rowstats")
    models = tiny.lossless_pair()
    tok = tiny.word_tokenizer(5, eos=False)
    target = tiny.save(models.target, tok, root / "target")
    draft = tiny.save(models.draft, tok, root / "draft")
    heads = (f"medusa:{tiny.save_medusa(models.target, root / 'medusa')},"
             f"eagle:{tiny.save_eagle(models.target, root / 'eagle', version=1)}")
    return load_pair(target=target, draft=f"{draft},{heads}", device="cpu")


def check_rows(rows) -> None:
    """The statistics contract per row per iteration (see the module docstring)."""
    for b, gen in enumerate(rows):
        for i, st in enumerate(gen.steps):
            where = f"row {b} iteration {i}: {st}"
            assert 0 <= st.accepted <= st.draft_depth, where
            if i < len(gen.steps) - 1:
                assert st.emitted == st.accepted + 1, where
            else:  # the block max_new_tokens may cut
                assert st.accepted <= st.emitted <= st.accepted + 1, where
        assert gen.stats.tokens_emitted == sum(st.emitted for st in gen.steps) == MAX_NEW
        assert gen.stats.draft_accepted == sum(st.accepted for st in gen.steps)


@pytest.mark.parametrize(("name", "params"), CASES,
                         ids=[f"{n}-{list(p.values())[-1]}" if n in ("medusa", "eagle") else n
                              for n, p in CASES])
def test_each_rows_iterations_emit_their_accepted_tokens_plus_one(small_drafting_pair, name,
                                                                   params):
    decoder = get_decoder(name, temperature=1.0, **params)
    ragged = kept = 0
    for seed in range(2 * SEEDS if name == "pld" else SEEDS):
        rows = generate_rows(decoder, small_drafting_pair, PROMPTS, MAX_NEW, seed=seed,
                             compute_perplexity=False)
        check_rows(rows)
        for steps in zip(*(gen.steps for gen in rows), strict=False):
            ragged += len({st.draft_depth for st in steps}) > 1
            kept += sum(st.accepted for st in steps)
    # the premise: rows drafted different lengths in one iteration, and drafts were kept
    assert ragged and kept, (ragged, kept)
