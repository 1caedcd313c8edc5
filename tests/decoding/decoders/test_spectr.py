"""SpecTr: rho bisection, k-sequential selection rules, losslessness, greedy, cache rows."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.decoders import spectr
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules import chain
from mtad_energy.decoding.rules.chain import (
    spectr_accept,
    spectr_accept_u,
    spectr_beta,
    spectr_residual,
    spectr_rho,
    speculative_accept,
)
from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.hf_cache import cache_of
from mtad_energy.models import ModelPair
from tests.decoding.lossless import chi_square_pvalue, exact_joint, sample_counts

PROMPT = [5, 9, 12, 3]



def random_tables(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n pairs of distributions ``[n, V]`` with some zeros (as after top-k / top-p)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, vocab, generator=g) ** 3
    q = torch.rand(n, vocab, generator=g) ** 3
    p = p * (torch.rand(n, vocab, generator=g) > 0.3)
    q = q * (torch.rand(n, vocab, generator=g) > 0.3)
    p[:, 0] += 1e-3  # no empty rows
    q[:, 1] += 1e-3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_rho_solves_its_equation_within_one_and_k(k):
    p, q = random_tables(64, 12, seed=k)
    rho = spectr_rho(p, q, k)
    beta = spectr_beta(p, q, rho)
    assert ((rho >= 1) & (rho <= k)).all()
    torch.testing.assert_close(1 - (1 - beta) ** k, rho * beta, atol=2e-6, rtol=0)
    if k == 1:
        assert (rho == 1).all()


@pytest.mark.parametrize("k", [2, 4])
def test_k_sequential_selection_outputs_exactly_p(k):
    """Accepted mass min(q, p/rho)(1-(1-beta)^k)/beta plus (1-beta)^k times the residual is p."""
    p, q = random_tables(64, 12, seed=10 + k)
    rho = spectr_rho(p, q, k)
    beta = spectr_beta(p, q, rho)[:, None]
    accepted = torch.minimum(q, p / rho[:, None]) * (1 - (1 - beta) ** k) / beta
    torch.testing.assert_close(accepted + (1 - beta) ** k * spectr_residual(p, q, rho), p,
                               atol=1e-5, rtol=0)
    # and the normalised residual is docs/design.md section 3's formula
    design = (p - accepted) / (1 - beta) ** k
    torch.testing.assert_close(spectr_residual(p, q, rho), design, atol=1e-4, rtol=1e-3)


def test_rho_on_the_support_of_q_equals_rho_over_the_vocabulary():
    p, q = random_tables(32, 40, seed=3)
    q = Warp(1.0, 5, 1.0).probs(q.log())  # at most 5 nonzeros
    torch.testing.assert_close(spectr_rho(p, q, 4, support=10), spectr_rho(p, q, 4))


def test_k1_is_exactly_spds_rule():
    p, q = random_tables(40, 6, seed=5)
    for i in range(20):
        p_i, q_i = p[2 * i:2 * i + 2], q[2 * i:2 * i + 1]  # p [2, V], q [1, V]
        draft = torch.multinomial(q_i, 1, generator=torch.Generator().manual_seed(i))[:, 0]
        n_s, x_s = speculative_accept(p_i, q_i, draft, torch.Generator().manual_seed(i))
        n_k, x_k, row = spectr_accept(p_i[None], q_i[None], draft[None],
                                      torch.Generator().manual_seed(i))
        assert (int(n_s), int(x_s), int(row)) == (int(n_k), int(x_k), 0)


def test_spectr_with_one_draft_equals_spd_token_for_token(llama_pair):
    kw = dict(max_new_tokens=24, seed=2, top_k=0, top_p=1.0)
    ref = me.generate("spd", llama_pair, PROMPT, gamma=3, **kw).token_ids
    assert me.generate("spectr", llama_pair, PROMPT, num_drafts=1, gamma=3, **kw).token_ids == ref


def hand_built(p_pos1: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k=2 drafts [[1, 0], [1, 2]] over V=3: both take token 1 first (p, q one-hot there), then
    draft 0 proposes token 0 (p = 0 in the cases below) and draft 1 token 2."""
    drafts = torch.tensor([[1, 0], [1, 2]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]).expand(2, 2, 3)
    p = torch.stack([torch.tensor([0.0, 1.0, 0.0]), torch.tensor(p_pos1),
                     torch.tensor([1.0, 0.0, 0.0])]).expand(2, 3, 3)  # bonus: token 0
    return p, q, drafts


@pytest.mark.parametrize("seed", range(5))
def test_selection_walks_to_the_draft_that_stays_consistent(seed):
    """Draft 0 is rejected at position 2 (p = 0), draft 1 shares its prefix and is accepted
    (k'=2: rho=1.5, p/(rho q) = 1.33 >= 1), so row 1 is kept and the bonus comes from p."""
    p, q, drafts = hand_built([0.0, 0.0, 1.0])
    n, nxt, row = spectr_accept(p, q, drafts, torch.Generator().manual_seed(seed))
    assert (int(n), int(nxt), int(row)) == (2, 0, 1)
    # both rejected at position 2: residual max(0, p - rho q) is one-hot on token 1
    p, q, drafts = hand_built([0.0, 1.0, 0.0])
    n, nxt, row = spectr_accept(p, q, drafts, torch.Generator().manual_seed(seed))
    assert (int(n), int(nxt)) == (1, 1)


@pytest.mark.parametrize("seed", range(3))
def test_b_sequences_select_as_each_alone(seed):
    """One call for B sequences (spectr.py's batch) walks each row as alone: the two hand-built
    cases above, stacked with their drafts swapped in one row (so the accepted draft is row 0
    there), give each case's own outcome."""
    cases = [hand_built([0.0, 0.0, 1.0]), hand_built([0.0, 1.0, 0.0])]
    p3, q3, d3 = hand_built([0.0, 0.0, 1.0])
    cases.append((p3, q3.flip(0), d3.flip(0)))  # draft [1, 2] first: accepted as row 0
    p, q, drafts = (torch.stack(x) for x in zip(*cases, strict=True))
    n, nxt, row = spectr_accept(p, q, drafts, torch.Generator().manual_seed(seed))
    assert n.tolist() == [2, 1, 2] and nxt.tolist() == [0, 1, 0] and row.tolist()[::2] == [1, 0]


def test_spectr_is_lossless(lossless_pair):
    prompt = [1, 0]  # where p and q differ most (see test_lossless.py)
    exact = exact_joint(lossless_pair, Warp(), prompt, n_tokens=3)
    decoder = get_decoder("spectr")  # k=4, gamma=4 (2 drafted + bonus within 3 tokens)
    counts = sample_counts(decoder, lossless_pair, 600, prompt, n_tokens=3)
    assert chi_square_pvalue(counts, exact) > 1e-3
    # naive multi-draft (rho = 1: each draft accepted with min(1, p/q)) is biased towards q
    ones = lambda p, q, k, iters=24, support=0: torch.ones(p.shape[:-1])  # noqa: E731
    with mock.patch.object(chain, "spectr_rho", ones):
        counts = sample_counts(decoder, lossless_pair, 300, prompt, n_tokens=3)
    assert chi_square_pvalue(counts, exact) < 1e-6


@pytest.mark.parametrize("pair", ["llama_pair", "opt_pair", "self_draft_pair"])
def test_greedy_spectr_equals_greedy_ar(request, pair):
    pair = request.getfixturevalue(pair)
    ref = me.generate("ar", pair, PROMPT, max_new_tokens=24, temperature=0).token_ids
    out = me.generate("spectr", pair, PROMPT, max_new_tokens=24, temperature=0, seed=3)
    assert out.token_ids == ref
    if pair.target is pair.draft:  # every draft token passes: the multi-token path ran
        # every position of the path is kept: accepted / depth is 1, as for a chain decoder,
        # while the target scored all k=4 rows
        assert out.stats.acceptance_rate == 1.0
        assert out.stats.draft_proposed == 4 * out.stats.draft_depth


@pytest.fixture(scope="module")
def self_draft_pair(llama_pair):
    return ModelPair(llama_pair.target, llama_pair.target, llama_pair.tokenizer)


def test_caches_keep_the_row_of_the_emitted_prefix(lossless_pair):
    """After each step (and the loop's crop) both caches equal a fresh run of the emitted tokens,
    including steps where the accepted draft is not row 0."""
    rows = []

    def recording(*args, **kwargs):
        out = spectr_accept_u(*args, **kwargs)
        rows.append(int(out[2]))
        return out

    class Checked(spectr.Spectr):
        def step(self, s):
            result = super().step(s)
            tokens = result.block_view().reshape(-1)  # [m] (a target step gives [1, 1])
            emitted = (tokens if result.count("length") is None  # the loop's read-back, here
                       else tokens[:int(result.count("length"))])
            ids = torch.cat([s.ids[0, :s.n], emitted])
            for runner in (s.target, s.draft):
                length = min(len(runner), ids.shape[0] - 1)
                fresh = cache_of(runner.model(input_ids=ids[None, :length]))
                for mine, ref in zip(runner.cache.layers, fresh.layers, strict=True):
                    assert mine.keys.shape[0] == 1
                    torch.testing.assert_close(mine.keys[..., :length, :], ref.keys, atol=1e-5,
                                               rtol=1e-4)
            return result

    decoder = Checked(spectr.SpectrParams(top_k=0, top_p=1.0))
    with mock.patch.object(spectr, "spectr_accept_u", recording):
        g = me.generate(decoder, lossless_pair, [1, 0], max_new_tokens=40, seed=1)
    assert g.stats.draft_accepted > 0 and any(r > 0 for r in rows)


def test_stats_are_consistent(llama_pair):
    g = me.generate("spectr", llama_pair, PROMPT, max_new_tokens=20, seed=3, gamma=3)
    for st in g.steps:  # proposed counts all k=4 drafts; one of them is accepted from
        assert st.proposed % 4 == 0 and st.accepted <= st.proposed // 4
        assert st.emitted <= st.accepted + 1 and st.target_forwards == 1
    s = g.stats
    assert s.draft_proposed == sum(st.proposed for st in g.steps)
    assert s.block_efficiency == pytest.approx(s.tokens_emitted / s.target_forwards)


@pytest.mark.parametrize("params, word", [({"num_drafts": 0}, "num_drafts"),
                                          ({"gamma": 0}, "gamma"),
                                          ({"num_drafts": "x"}, "num_drafts"),
                                          ({"num_drafts": 100_000}, "num_drafts x gamma"),
                                          ({"num_drafts": 257, "gamma": 4}, "lower num_drafts")])
def test_bad_parameters_are_refused_by_name(params, word):
    with pytest.raises(ValueError, match=word):
        get_decoder("spectr", **params)


def test_string_parameters_are_coerced():
    assert get_decoder("spectr", num_drafts="3", gamma="2").params.num_drafts == 3


def test_rho_stays_exact_when_ties_at_the_top_k_cut_exceed_the_shortcut():
    """bf16-like logits: 30 tokens tied at the top-k cut give q 30 nonzeros, more than the
    2 * top_k shortcut keeps; rho must still be the one over the whole support."""
    logits = torch.zeros(2, 64)
    logits[:, :3] = torch.tensor([3.0, 2.0, 1.5])  # 3 clear leaders, then 61 tokens tied at 0
    q = Warp(1.0, top_k=5, top_p=1.0).probs(logits)
    assert int((q[0] > 0).sum()) == 64  # ties at the cut are kept
    p = torch.softmax(torch.randn(2, 64, generator=torch.Generator().manual_seed(0)), -1)
    full = spectr_rho(p, q, 4)
    torch.testing.assert_close(spectr_rho(p, q, 4, support=10), full)
    clipped = spectr_rho(p.gather(-1, q.topk(10, -1).indices), q.gather(-1, q.topk(10, -1).indices), 4)
    assert not torch.allclose(clipped, full)  # the old shortcut would have been wrong here
