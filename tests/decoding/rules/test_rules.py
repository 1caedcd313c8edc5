"""Tests that fail when one rule of docs/design.md section 3 is broken (issue 10, section B).

Each test below was checked against a one-line break of the library (see the issue's note):
- top-p boundary: exact masses, so ``>`` vs ``>=`` and "mass before" vs "mass including" differ;
- beam draft weighting: stochastic beam sampling with W >= 2 on hand-built q tables must pick
  (beam, token) pairs in proportion to the *joint* q of the extended beam (exact enumeration);
- SpD: the accepted count is a prefix (pure rule with hand-built p/q), and spd stays lossless with
  gamma >= 2 actually drafted and an active top-k;
- MMTAD: the bonus token comes from ~p at the chosen node, also when it is not node 0 of its depth;
- MTAD: the draft cache kept is the chosen beam's (equal to a fresh forward of the emitted prefix).
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from unittest import mock

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.decoders import mmtad as mmtad_mod
from mtad_energy.decoding.decoders import mtad as mtad_mod
from mtad_energy.decoding.decoders.mtad import Mtad, MtadParams
from mtad_energy.decoding.rules.chain import speculative_accept
from mtad_energy.decoding.rules.sampling import Warp, residual, warp_probs
from mtad_energy.decoding.runtime.beams import beam_sample
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.hf_cache import cache_of
from mtad_energy.models import ModelPair
from tests import tiny
from tests.decoding.lossless import chi_square_pvalue, exact_joint

# --- top-p boundary (rules/sampling.py) --------------------------------------------------------------
# Probabilities 8/16, 4/16, 3/16, 1/16 (no ties) are exact in float32 through softmax(log(.)), so
# the masses before each token (0, 1/2, 3/4, 15/16) are exact and p can sit exactly on them.
TABLE = torch.tensor([0.5, 0.25, 0.1875, 0.0625])


def _exact_logits() -> torch.Tensor:
    logits = TABLE.log()
    assert torch.softmax(logits, -1).tolist() == TABLE.tolist()  # premise of the exact tests
    return logits


def _keep_first(kept: int, table: torch.Tensor = TABLE) -> torch.Tensor:
    out = table.clone()
    out[kept:] = 0.0
    return out / out.sum()


@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.75, 3), (0.9375, 4)])
def test_top_p_keeps_a_token_whose_mass_before_equals_p(top_p, kept):
    out = warp_probs(_exact_logits(), temperature=1.0, top_k=0, top_p=top_p)
    assert torch.equal(out, _keep_first(kept))


@pytest.mark.parametrize("top_p, kept", [(0.4999, 1), (0.7499, 2), (0.9374, 3)])
def test_top_p_drops_a_token_once_the_mass_before_exceeds_p(top_p, kept):
    out = warp_probs(_exact_logits(), temperature=1.0, top_k=0, top_p=top_p)
    assert torch.equal(out, _keep_first(kept))


@pytest.mark.parametrize("top_p", [1e-6, 0.25, 0.4999])
def test_top_p_always_keeps_the_top_token(top_p):
    out = warp_probs(_exact_logits(), temperature=1.0, top_k=0, top_p=top_p)
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("top_p, kept", [(0.75, 3), (0.9, 3), (0.9375, 4)])
def test_top_p_boundary_is_on_the_top_k_renormalised_masses(top_p, kept):
    # two extra tokens cut by top_k = 4; the kept four renormalise to TABLE exactly, so the masses
    # before are 0, 1/2, 3/4, 15/16 (without the renormalisation the 4th would have 15/16.75)
    logits = torch.tensor([8, 4, 3, 1, 0.5, 0.25]).log()
    out = warp_probs(logits, temperature=1.0, top_k=4, top_p=top_p)
    assert torch.equal(out, torch.cat([_keep_first(kept), torch.zeros(2)]))


# --- stochastic beam sampling weights (runtime/beams.py) ---------------------------------------------

V = 3
Q1 = torch.tensor([0.6, 0.3, 0.1])  # first step after the prompt
# next-token tables after each last token: flat after 0, peaked after 1 and 2, so the conditional
# and the joint weights of the (beam, token) pairs disagree strongly
Q_NEXT = torch.tensor([[0.34, 0.33, 0.33], [0.9, 0.05, 0.05], [0.05, 0.05, 0.9]])
PROMPT_TOKEN = V  # an id outside the vocabulary: the fake model's "after the prompt" state
WARP_ALL = Warp(temperature=1.0, top_k=0, top_p=1.0)


class TableRunner:
    """A ModelRunner stand-in whose model is a Markov table: q(. | last token). Rows track what each
    cache row has seen, so select/repeat are checked like the real KV cache."""

    def __init__(self, prompt: list[int], next_table: torch.Tensor = Q_NEXT):
        self.rows = [list(prompt)]
        self.forwards = 0
        self.next_table = next_table

    def _probs(self, last: int) -> torch.Tensor:
        return Q1 if last == PROMPT_TOKEN else self.next_table[last]

    def __call__(self, input_ids: torch.Tensor, counts=None, **kwargs) -> torch.Tensor:
        assert input_ids.shape[0] == len(self.rows)
        self.forwards += 1
        for row, ids in zip(self.rows, input_ids.tolist(), strict=True):
            row.extend(ids)
        logits = torch.stack([self._probs(row[-1]).log() for row in self.rows])  # [B, V]
        return logits[:, None, :].expand(-1, input_ids.shape[1], -1).clone()

    def __len__(self) -> int:
        return len(self.rows[0])

    def repeat_rows(self, n: int) -> None:
        assert len(self.rows) == 1
        self.rows = [list(self.rows[0]) for _ in range(n)]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [list(self.rows[i]) for i in rows.tolist()]

    def crop(self, length: int) -> None:
        self.rows = [r[:length] for r in self.rows]

    beam_search = ModelRunner.beam_search  # the runner's search, over this table's forwards


def _draws_without_replacement(weights: dict, k: int):
    """Every ordered sequence of k distinct keys drawn without replacement proportionally to
    ``weights`` (positive entries only), with its probability."""
    keys = [x for x, w in weights.items() if w > 0]
    for order in itertools.permutations(keys, k):
        prob, left = 1.0, sum(weights[x] for x in keys)
        for x in order:
            prob *= weights[x] / left
            left -= weights[x]
        yield order, prob


def _exact_final_beams(width: int, joint: bool = True, warp: Warp = WARP_ALL,
                       next_table: torch.Tensor = Q_NEXT) -> dict[frozenset, float]:
    """P(set of final beams) of two steps of stochastic beam sampling; ``joint=False`` weights the
    second step by the conditional q instead (the broken rule, to show the test's power)."""
    q1 = warp.probs(Q1.log()).double()
    qn = warp.probs(next_table.log()).double()
    out: Counter = Counter()
    for first, p_first in _draws_without_replacement({a: float(q1[a]) for a in range(V)}, width):
        weights = {(a, t): float((q1[a] if joint else 1.0) * qn[a, t]) for a in first
                   for t in range(V)}
        for second, p_second in _draws_without_replacement(weights, width):
            out[frozenset(second)] += p_first * p_second
    return dict(out)


def test_joint_and_conditional_beam_weights_give_distant_distributions():
    """The chi-square test below has power: the conditional weighting is far from the joint."""
    joint, cond = _exact_final_beams(2), _exact_final_beams(2, joint=False)
    assert sum(joint.values()) == pytest.approx(1.0) and sum(cond.values()) == pytest.approx(1.0)
    tv = 0.5 * sum(abs(joint.get(k, 0.0) - cond.get(k, 0.0)) for k in set(joint) | set(cond))
    assert tv > 0.2


# top_k 2 of V 3 on tables without a tie at the cut: every step draws among the top-k candidates
# only (`beams.candidates`); Q_NEXT's rows tie at the cut and keep the vocabulary
WARP_TOP2 = Warp(temperature=1.0, top_k=2, top_p=1.0)
Q_NEXT_DISTINCT = torch.tensor([[0.40, 0.35, 0.25], [0.9, 0.07, 0.03], [0.04, 0.06, 0.9]])


@pytest.mark.parametrize("warp, table", [(WARP_ALL, Q_NEXT), (WARP_TOP2, Q_NEXT),
                                         (WARP_TOP2, Q_NEXT_DISTINCT)])
def test_beam_sampling_picks_pairs_in_proportion_to_the_joint_draft_probability(warp, table):
    width, n = 2, 3000
    exact = _exact_final_beams(width, warp=warp, next_table=table)
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    for _ in range(n):
        runner = TableRunner([7], table)
        d = beam_sample(runner, torch.tensor([[PROMPT_TOKEN]]), 2, width, warp, g)
        counts[frozenset(tuple(s) for s in d.seqs.tolist())] += 1
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("width, warp", [(2, WARP_ALL), (3, WARP_ALL), (2, WARP_TOP2)])
def test_beam_sampling_records_joint_log_probs_and_best_beam(width, warp):
    depth = 4
    table = Q_NEXT if warp is WARP_ALL else Q_NEXT_DISTINCT
    q1, qn = warp.probs(Q1.log()), warp.probs(table.log())
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        runner = TableRunner([], table)
        d = beam_sample(runner, torch.tensor([[PROMPT_TOKEN]]), depth, width, warp, g)
        for b, seq in enumerate(d.seqs.tolist()):
            probs = [q1[seq[0]]] + [qn[a, t] for a, t in zip(seq, seq[1:], strict=False)]
            joint = torch.stack(probs).log().cumsum(0)
            assert torch.allclose(d.path_log_q[b], joint, atol=1e-5)
            # the cache row of final beam b has seen the prompt and its first depth-1 tokens
            assert runner.rows[b] == [PROMPT_TOKEN] + seq[:-1]
        assert len({tuple(s) for s in d.seqs.tolist()}) == width  # distinct beams
        assert int(d.best) == int(d.path_log_q[:, -1].argmax())


# --- SpD: the accepted count is a prefix (rules/chain.py, spd.py) ------------------------------------

def test_speculative_accept_stops_at_the_first_rejection_even_if_a_later_token_passes():
    # position 1 always rejects (p(x1) = 0), position 2 always accepts (p(x2) >= q(x2))
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    draft = torch.tensor([0, 1])
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, nxt = speculative_accept(p, q, draft, g)
        assert int(n) == 0
        assert int(nxt) in (1, 2)  # residual at position 1, not at position 2 (token 1 only)


def test_speculative_accept_count_is_the_prefix_before_the_first_rejection():
    # accept w.p. 1/2, then always reject, then always accept: n is 0 or 1, never 2 or 3
    p = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([0, 0, 0])
    g = torch.Generator().manual_seed(0)
    ns, nexts = Counter(), Counter()
    for _ in range(400):
        n, nxt = speculative_accept(p, q, draft, g)
        ns[int(n)] += 1
        nexts[(int(n), int(nxt))] += 1
    assert set(ns) == {0, 1}
    assert 150 < ns[1] < 250  # min(1, p/q) = 1/2 at position 1
    # after n = 0 the residual of position 1 is token 1; after n = 1 that of position 2 is token 1/2
    assert {k for k in nexts if k[0] == 0} == {(0, 1)}
    assert {k[1] for k in nexts if k[0] == 1} <= {1, 2}
    assert torch.equal(residual(p[0], q[0]), torch.tensor([0.0, 1.0, 0.0]))


LOSSLESS_PROMPT = [1, 0]


@pytest.mark.slow
def test_spd_is_lossless_with_every_draft_position_used_and_top_k_active(lossless_pair):
    """gamma = 3 actually drafted (max_new_tokens leaves room for it) and top_k = 3 < vocab 5;
    the first three emitted tokens follow the warped target exactly."""
    warp = Warp(top_k=3)
    n_tokens, gamma = 3, 3
    exact = exact_joint(lossless_pair, warp, LOSSLESS_PROMPT, n_tokens=n_tokens)
    dec = me.get_decoder("spd", gamma=gamma, top_k=3)
    counts: Counter = Counter()
    for seed in range(700):
        g = me.generate(dec, lossless_pair, LOSSLESS_PROMPT, max_new_tokens=gamma + 1, seed=seed,
                        compute_perplexity=False)
        assert g.steps[0].draft_forwards == gamma  # no cap: every draft position is used
        counts[tuple(g.token_ids[:n_tokens])] += 1
    assert chi_square_pvalue(counts, exact) > 1e-3


# --- MMTAD: the bonus token is drawn at the chosen node (mmtad.py) --------------------------------

def _close_pair(vocab: int = 32, noise: float = 0.3) -> ModelPair:
    """No EOS; the draft is the target with noise on every weight, so that with a small top-k
    their supports overlap and MMTAD accepts a few tokens."""
    target = tiny.llama(vocab, 3, layers=1, hidden=16, init=0.3)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(noise * w.std() * torch.randn(w.shape, generator=gen))
    return ModelPair(target, draft, tiny.word_tokenizer(vocab, eos=False), name="close")


@torch.inference_mode()
def _target_after(pair: ModelPair, ids: list[int], top_k: int) -> tuple[torch.Tensor, set[int]]:
    """Warped target after ``ids`` (top-k, no nucleus), and its support with a margin against
    float ties between a fresh forward and the tree forward."""
    logits = pair.target(input_ids=torch.tensor([ids])).logits[0, -1].float()
    kth = logits.topk(top_k).values[-1]
    support = set(torch.nonzero(logits >= kth - 1e-4).flatten().tolist())
    return warp_probs(logits, 1.0, top_k, 1.0), support


def test_mmtad_bonus_token_comes_from_the_chosen_node_even_when_it_is_not_node_0():
    """With top_k = 2 each node's ~p has two tokens; the bonus token must be one of the two after
    the *emitted* path, and over many runs it must follow those ~p (a Poisson-binomial count of
    "bonus = the more likely token"). We also count the first iterations whose chosen node is not
    index 0 of its depth, where drawing at node (eta, 0) would be wrong."""
    pair = _close_pair()
    top_k, prompt = 2, [3, 5, 7]
    dec = me.get_decoder("mmtad", gamma=3, beam_width=4, tau=0.1, top_k=top_k, top_p=1.0)
    chosen: list[tuple[int, int]] = []
    real_select = mmtad_mod.tree_joint_accept_rows  # the step selects for every row at once

    def spy(*args, **kwargs):
        out = real_select(*args, **kwargs)
        chosen.append((int(out[0][0]), int(out[1][0])))  # row 0's (eta, b): B = 1 here
        return out

    not_first, hits, mean, var = 0, 0, 0.0, 0.0
    with mock.patch.object(mmtad_mod, "tree_joint_accept_rows", spy):
        for seed in range(120):
            chosen.clear()
            g = me.generate(dec, pair, prompt, max_new_tokens=4, seed=seed, compute_perplexity=False)
            first = g.steps[0]
            emitted = g.token_ids[:first.emitted]
            assert first.emitted == first.accepted + 1
            bonus, path = emitted[-1], emitted[:-1]
            p, support = _target_after(pair, prompt + path, top_k)
            assert bonus in support, (seed, chosen[0])
            top = float(p.max())
            hits += bonus == int(p.argmax())
            mean, var = mean + top, var + top * (1 - top)
            not_first += chosen[0][0] > 0 and chosen[0][1] != 0
    assert abs(hits - mean) < 4 * var ** 0.5
    assert not_first >= 30  # the case the rule is about is well represented


# --- MTAD: the draft cache kept is the chosen beam's (mtad.py) ------------------------------------

class CacheCheckedMtad(Mtad):
    """MTAD that, at the start of every iteration, compares the draft cache with a fresh forward of
    the tokens it claims to hold, and records (best beam index, accepted) of every drafted step."""

    def __init__(self, params):
        super().__init__(params)
        self.checked = 0
        self.bests: list[int] = []  # filled by the beam_sample spy
        self.drafted: list[tuple[int, int]] = []

    def step(self, s):
        n_cached = len(s.draft)
        assert s.draft.cache.layers[0].keys.shape[0] == 1  # one row between iterations
        fresh = cache_of(s.draft.model(input_ids=s.ids[:, :n_cached], use_cache=True))
        for mine, ref in zip(s.draft.cache.layers, fresh.layers, strict=True):
            assert torch.allclose(mine.keys[..., :n_cached, :], ref.keys, atol=1e-5)
            assert torch.allclose(mine.values[..., :n_cached, :], ref.values, atol=1e-5)
        self.checked += 1
        before = len(self.bests)
        result = super().step(s)
        if len(self.bests) > before:
            self.drafted.append((self.bests[-1], int(result.count("accepted"))))
        return result


def test_mtad_keeps_the_draft_cache_of_the_chosen_beam(lossless_pair):
    """W = 4: whenever the best beam is not beam 0 and tokens are accepted, keeping another beam's
    cache rows leaves keys/values of tokens that were never emitted."""
    dec = CacheCheckedMtad(MtadParams(gamma=3, beam_width=4, tau=0.1, top_k=0, top_p=1.0))
    real_beam_sample = mtad_mod.beam_sample_rows

    def spy(*args, **kwargs):
        finish = kwargs["finish"]  # the search hands back only what it reads: `best` read here

        def best(tokens, parents, log_q, *rest):
            dec.bests.append(int(log_q[0, -1].argmax()))  # batch of one sequence
            return finish(tokens, parents, log_q, *rest)

        return real_beam_sample(*args, **{**kwargs, "finish": best})

    with mock.patch.object(mtad_mod, "beam_sample_rows", spy):
        for seed in range(8):
            me.generate(dec, lossless_pair, [1, 2], max_new_tokens=16, seed=seed,
                        compute_perplexity=False)
    assert dec.checked > 20
    # iterations where keeping beam 0 would be wrong
    assert sum(best != 0 and acc > 0 for best, acc in dec.drafted) >= 5
