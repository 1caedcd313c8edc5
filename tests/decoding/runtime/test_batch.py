"""Batched generation (`generate_rows`, `generate(..., batch_size=B)`): B rows of different
lengths in one set of forwards (`batch.RowsRunner`), row by row what batch 1 gives."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from unittest import mock

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.rules import chain
from mtad_energy.decoding.rules import tree as tree_rules
from mtad_energy.decoding.runtime.batch import RowsRunner
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import generate_ids, generate_rows
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.timer import PhaseTimer
from tests.decoding.lossless import batched_row_pvalues, two_sample_pvalue
from tests.tiny import skip_without_head

BATCHED = sorted(n for n, c in DECODERS.items() if c.batched)
PROMPTS = [[5, 9, 11, 3, 7, 21, 2], [4, 8], [30, 31, 32, 33, 34]]  # different lengths


@pytest.mark.parametrize("arch", ["llama", "opt", "self"])
@pytest.mark.parametrize("name", BATCHED)
def test_greedy_rows_are_exactly_their_batch_1_outputs(arch, name, request):
    pair = request.getfixturevalue(f"{arch}_pair")
    skip_without_head(name, pair)
    decoder = get_decoder(name, temperature=0)
    rows = generate_rows(decoder, pair, PROMPTS, 20)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        alone = generate_ids(decoder, pair, prompt, 20)
        assert row.token_ids == alone.token_ids
        assert row.stats.perplexity == pytest.approx(alone.stats.perplexity, rel=1e-5)
        assert row.prompt_len == len(prompt) and row.config["batch_size"] == 3


@pytest.mark.parametrize("name", BATCHED)
def test_greedy_rows_with_an_int8_draft_and_mixed_rollbacks_are_their_batch_1_runs(int8_pair,
                                                                                    name):
    """The CPU default's kind of draft (dynamic int8: one activation scale per input tensor)
    and a target whose BiLD rollback sometimes passes: every row is its batch-1 run, tokens and
    per-iteration statistics alike, to the last token (a row near its end drafts only what it
    can still emit, and finished rows take no part in drafting decisions)."""
    decoder = get_decoder(name, temperature=0)
    rows = generate_rows(decoder, int8_pair, PROMPTS, 20, compute_perplexity=False)
    assert rows[0].config.get("per_row") == (["draft"] if decoder.needs_draft else None)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        alone = generate_ids(decoder, int8_pair, prompt, 20, compute_perplexity=False)
        assert row.token_ids == alone.token_ids
        assert [(s.accepted, s.draft_depth, s.proposed) for s in row.steps] == \
            [(s.accepted, s.draft_depth, s.proposed) for s in alone.steps]
    if name == "bild":  # the pair is one where the rule has something to decide
        kept = {s.accepted / s.draft_depth for r in rows for s in r.steps if s.draft_depth}
        assert 0.0 in kept and any(0 < k < 1 for k in kept), kept


@pytest.mark.slow
def test_batched_mtad_rows_follow_the_batch_1_law_to_the_last_token(lossless_pair):
    """MTAD is lossy: its output law is the batch-1 run's, not p. Each row's full 3-token
    output, batched with rows of other lengths (so rows reach their end at different
    iterations), matches its batch-1 sample (two-sample chi-square, fixed seeds); drafting to
    the batch's longest row instead does not."""
    prompts = [[1, 0], [3, 1, 0, 2], [0]]
    decoder = get_decoder("mtad", gamma=3, beam_width=2)
    n = 600
    alone = [Counter(tuple(generate_ids(decoder, lossless_pair, p, 3, seed=s,
                                        compute_perplexity=False).token_ids) for s in range(n))
             for p in prompts]

    def batched() -> list[float]:
        counts = [Counter() for _ in prompts]
        for seed in range(n):
            for c, g in zip(counts, generate_rows(decoder, lossless_pair, prompts, 3,
                                                  seed=10**6 + seed, compute_perplexity=False),
                            strict=True):
                c[tuple(g.token_ids)] += 1
        return [two_sample_pvalue(a, c) for a, c in zip(alone, counts, strict=True)]

    assert min(batched()) > 1e-3

    def batch_lens(self, s):  # the old rule: every active row drafts to the longest row's end
        return [max(0, min(self.lookahead, s.remaining - 1)) if s.active[b] else 0
                for b in range(s.batch)]

    with mock.patch.object(Decoder, "draft_lens", batch_lens):
        assert min(batched()) < 1e-6


@torch.inference_mode()
def test_int8_draft_rows_compute_what_they_compute_alone(int8_pair):
    """A shared-cache batch of the int8 draft would not (the scale spans the rows and the
    padding): its rows run one forward each, so every row's logits are exactly batch 1's."""
    from mtad_energy.decoding.runtime.batch import PerRowRunner, rows_runner

    model = int8_pair.draft
    width = max(map(len, PROMPTS))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    counts = [len(p) for p in PROMPTS]
    runner = rows_runner(model, PhaseTimer("cpu"), "draft", 3)
    assert isinstance(runner, PerRowRunner)
    got = runner(padded, counts)
    shared = RowsRunner(model, PhaseTimer("cpu"), "draft", 3)(padded, counts)
    for b, prompt in enumerate(PROMPTS):
        alone = ModelRunner(model, PhaseTimer("cpu"), "draft")(torch.tensor([prompt]))[0]
        assert torch.equal(got[b, -len(prompt):], alone)
        assert not torch.allclose(shared[b, -len(prompt):], alone, atol=1e-3)


def test_rows_accept_different_numbers_of_tokens(self_pair):
    """The identity above is about ragged rows: rows kept different numbers of draft tokens in
    the same iteration (so the layout held holes), and every row's stats add up."""
    rows = generate_rows(get_decoder("spd", temperature=0), self_pair, PROMPTS, 20)
    per_iteration = list(zip(*[[s.accepted for s in r.steps] for r in rows], strict=False))
    assert any(len(set(accepted)) > 1 for accepted in per_iteration)
    for r in rows:
        s = r.stats
        assert s.tokens_emitted == len(r.token_ids) == sum(st.emitted for st in r.steps) == 20
        assert s.draft_accepted == sum(st.accepted for st in r.steps)
        assert s.decode_time_s == pytest.approx(s.time_draft_s + s.time_target_s + s.time_other_s)


def test_a_row_that_stops_at_eos_does_not_change_the_others(llama_pair):
    decoder = get_decoder("spd", temperature=0)
    first = generate_ids(decoder, llama_pair, PROMPTS[1], 20).token_ids
    eos = first[3]  # row 1 emits this token 4th: make it EOS
    tok = mock.Mock(wraps=llama_pair.tokenizer, eos_token_id=eos)
    pair = replace(llama_pair, tokenizer=tok)
    rows = generate_rows(decoder, pair, PROMPTS, 20)
    assert rows[1].stats.stop_reason == "eos" and rows[1].token_ids[-1] == eos
    assert len(rows[1].token_ids) <= 4
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.token_ids == generate_ids(decoder, pair, prompt, 20).token_ids
    assert max(len(r.token_ids) for r in rows) > len(rows[1].token_ids)


def test_max_new_tokens_and_batch_stats_per_row(llama_pair):
    rows = generate_rows(get_decoder("ar"), llama_pair, PROMPTS, 9, seed=3)
    for r in rows:
        assert len(r.token_ids) == 9 and r.stats.stop_reason == "max_new_tokens"
        assert r.stats.target_forwards == 9 and r.stats.iterations == 9


def test_the_api_and_its_errors(llama_pair):
    gens = me.generate("ar", llama_pair, ["w1 w2", "w3"], max_new_tokens=4, batch_size=2,
                       chat=False)
    assert [g.config["row"] for g in gens] == [0, 1]
    assert BATCHED == sorted(DECODERS)  # every decoder decodes batches

    class OneAtATime(type(get_decoder("ar"))):  # a decoder written for one sequence
        name, batched = "one-at-a-time", False

    with pytest.raises(ValueError, match="'one-at-a-time' does not decode batches yet.*ar, "):
        me.generate(OneAtATime(), llama_pair, ["w1", "w2"], max_new_tokens=4, batch_size=2)


@torch.inference_mode()
def test_rows_runner_logits_equal_each_row_alone(llama_pair):
    """Left-padded rows, a ragged catch-up and a per-row rollback: every row's logits are those
    of a batch-1 runner fed the same tokens."""
    model = llama_pair.target
    rows = RowsRunner(model, PhaseTimer("cpu"), "target", 3)
    alone = [ModelRunner(model, PhaseTimer("cpu"), "target") for _ in PROMPTS]
    width = max(map(len, PROMPTS))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])

    def check(batch_logits, per_row_ids, counts):
        for b, (r, ids) in enumerate(zip(alone, per_row_ids, strict=True)):
            ref = r(torch.tensor([ids]))[0]
            torch.testing.assert_close(batch_logits[b, -counts[b]:], ref, atol=1e-5, rtol=0)

    check(rows(padded, [len(p) for p in PROMPTS]), PROMPTS, [len(p) for p in PROMPTS])
    step = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    check(rows(step), step.tolist(), [3, 3, 3])
    keep = [rows.row_lengths[0] - 2, rows.row_lengths[1], rows.row_lengths[2] - 3]
    rows.crop_rows(keep)
    for r, n in zip(alone, keep, strict=True):
        r.crop(n)
    assert rows.row_lengths == keep
    ragged = torch.tensor([[10, 11], [0, 12], [13, 14]])  # row 1 feeds one token
    check(rows(ragged, [2, 1, 2]), [[10, 11], [12], [13, 14]], [2, 1, 2])


LOSSLESS = [("spd", {"gamma": 3}, chain),
            ("specinfer", {"branching": (2, 2)}, tree_rules),
            ("mcss", {"branching": (2, 2)}, tree_rules),
            ("spectr", {"num_drafts": 3, "gamma": 2}, chain)]


@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "residual-broken"])
@pytest.mark.parametrize(("name", "params", "module"), LOSSLESS, ids=[x[0] for x in LOSSLESS])
def test_batched_lossless_decoders_are_lossless_per_row(lossless_pair, name, params, module,
                                                        broken):
    """Three rows with prompts of different lengths: each row's 3-token continuations follow
    its own warped p (chi-square, fixed seeds); with the residual replaced by p they do not."""
    pvalues = batched_row_pvalues(lossless_pair, get_decoder(name, **params), module, broken)
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


@torch.inference_mode()
def test_rows_runner_beam_rows_follow_each_sequence_alone(llama_pair):
    """W beam rows per sequence (row b*W + w): expand, reorder within each sequence, keep one
    beam per sequence; every row's logits are those of its sequence's batch-1 runner doing the
    same to its own cache."""
    model, width = llama_pair.target, 2
    rows = RowsRunner(model, PhaseTimer("cpu"), "target", 2)
    prompts = PROMPTS[:2]
    alone = [ModelRunner(model, PhaseTimer("cpu"), "target") for _ in prompts]
    w = max(map(len, prompts))
    rows(torch.tensor([[0] * (w - len(p)) + p for p in prompts]), [len(p) for p in prompts])
    for r, p in zip(alone, prompts, strict=True):
        r(torch.tensor([p]))
    rows.repeat_rows(width)
    for r in alone:
        r.repeat_rows(width)
    step = torch.tensor([[3], [4], [5], [6]])  # [B*W, 1]
    got = rows(step)
    for b, r in enumerate(alone):
        torch.testing.assert_close(got[b * width:(b + 1) * width], r(step[b * width:(b + 1) * width]),
                                   atol=1e-5, rtol=0)
    parents = [torch.tensor([1, 1]), torch.tensor([1, 0])]  # per sequence
    rows.select_rows(torch.cat([b * width + p for b, p in enumerate(parents)]))
    for r, p in zip(alone, parents, strict=True):
        r.select_rows(p)
    got = rows(step)
    for b, r in enumerate(alone):
        torch.testing.assert_close(got[b * width:(b + 1) * width], r(step[b * width:(b + 1) * width]),
                                   atol=1e-5, rtol=0)
    best = [1, 0]
    rows.select_rows(torch.tensor([b * width + k for b, k in enumerate(best)]))
    for r, k in zip(alone, best, strict=True):
        r.select_rows(torch.tensor([k]))
    got = rows(torch.tensor([[7], [8]]))
    for b, r in enumerate(alone):
        torch.testing.assert_close(got[b:b + 1], r(torch.tensor([[7 + b]])), atol=1e-5, rtol=0)
    assert rows.width == 1 and rows.row_lengths == [len(r) for r in alone]


def test_beam_rows_stop_at_eos_independently(llama_pair):
    decoder = get_decoder("mtjd", temperature=0, k=3, beam_width=2)
    first = generate_ids(decoder, llama_pair, PROMPTS[0], 16).token_ids
    tok = mock.Mock(wraps=llama_pair.tokenizer, eos_token_id=first[4])
    pair = replace(llama_pair, tokenizer=tok)
    rows = generate_rows(decoder, pair, PROMPTS, 16)
    assert rows[0].stats.stop_reason == "eos"
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.token_ids == generate_ids(decoder, pair, prompt, 16).token_ids


@torch.inference_mode()
def test_batched_bild_rows_draft_different_lengths_and_keep_the_rollback_rule(lossless_pair):
    """BiLD's drafts stop where each row's draft turns unsure, so rows draft different lengths in
    one iteration; every draft token a row keeps passes the rollback test under its own prefix
    (a row never keeps tokens drafted past its own stop), and its steps add up."""
    prompts = [[1, 0], [3, 1, 0, 2], [0]]
    decoder = get_decoder("bild", fallback=0.4, max_draft=4, rollback=1.5)
    rows = generate_rows(decoder, lossless_pair, prompts, 12, seed=1, compute_perplexity=False)
    depths = list(zip(*[[st.draft_depth for st in r.steps] for r in rows], strict=False))
    assert any(len(set(d)) > 1 for d in depths)  # ragged iterations happened
    for prompt, row in zip(prompts, rows, strict=True):
        ids = prompt + row.token_ids
        logits = lossless_pair.target(input_ids=torch.tensor([ids])).logits[0].float()
        nll = -torch.log_softmax(logits, -1)
        at = len(prompt)
        for st in row.steps:
            assert st.accepted <= st.draft_depth and st.emitted == st.accepted + 1
            for j in range(st.accepted):  # kept draft tokens pass the rollback test
                assert nll[at + j - 1, ids[at + j]] <= 1.5 + 1e-4
            at += st.emitted
        assert len(row.token_ids) == 12


# decoders that show the target several drafts (or candidates) per iteration
MULTI_DRAFT = ["eagle", "mcss", "medusa", "mmtad", "specinfer", "spectr"]


@pytest.mark.parametrize("name", MULTI_DRAFT)
def test_identical_prompts_in_one_batch_decode_independently(llama_pair, name):
    """Four rows of one prompt, sampled: each row draws its own drafts and coins, so no two rows
    emit alike over their first 16 tokens (rows sharing a row's draws would, token for token:
    only a last target step, when one token is left, draws apart)."""
    decoder = get_decoder(name)
    rows = generate_rows(decoder, llama_pair, [PROMPTS[0]] * 4, 32, seed=3,
                         compute_perplexity=False)
    outputs = [tuple(r.token_ids[:16]) for r in rows]
    assert len(set(outputs)) == 4, outputs


def _per_row_uniforms(gens: list[torch.Generator]):
    """`DecodeState.uniform` / `uniforms` drawing row b's share of every draw (leading dim: the
    rows) from ``gens[b]``, in the order a batch of one draws it: a batched row then sees
    exactly the uniforms it sees alone with that generator."""
    def uniform(self, rows, *shape):
        assert rows == len(gens) == self.batch
        return torch.cat([torch.rand((1, *shape), generator=g) for g in gens])

    def uniforms(self, *shapes):
        assert all(s[0] == len(gens) == self.batch for s in shapes)
        per_row = [torch.rand(sum(math.prod(s[1:]) for s in shapes), generator=g).split(
            [math.prod(s[1:]) for s in shapes]) for g in gens]  # [row][draw]
        return torch.cat([part for draw in zip(*per_row, strict=True) for part in draw])

    return (mock.patch.object(DecodeState, "uniform", uniform),
            mock.patch.object(DecodeState, "uniforms", uniforms))


@pytest.mark.parametrize("name", ["spectr", "specinfer", "mcss"])
def test_a_batched_row_on_its_own_uniforms_decodes_as_alone(llama_pair, name):
    """Three rows of one prompt, each row's uniforms from its own generator: every row's output
    is its batch-1 output on that generator (up to where a row nears its end, and drafts less
    alone than the batch does), so nothing of one row's draws reaches another's drafts, coins
    or next token."""
    decoder = get_decoder(name)
    n_new, same = 20, 20 - decoder.lookahead

    def run(seeds: list[int]) -> list[list[int]]:
        patches = _per_row_uniforms([torch.Generator().manual_seed(s) for s in seeds])
        with patches[0], patches[1]:
            rows = generate_rows(decoder, llama_pair, [PROMPTS[0]] * len(seeds), n_new,
                                 compute_perplexity=False)
        return [r.token_ids[:same] for r in rows]

    batched = run([0, 1, 2])
    assert len({tuple(r) for r in batched}) == 3  # premise: the rows differ
    assert batched == [run([s])[0] for s in range(3)]
