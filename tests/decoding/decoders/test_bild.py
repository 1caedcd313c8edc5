"""BiLD: the rollback and fallback rules on hand-built tables, and the decoder's behaviour."""

from __future__ import annotations

import math

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.decoders.bild import draft_until_unsure, rollback_log_probs
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules.chain import rollback_length
from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.decoding.runtime.calls import EagerCalls

PROMPT = [5, 9, 12, 3]
KERNELS = EagerCalls()  # the eager path: the kernels called as they are



@pytest.mark.parametrize("nll, kept", [([0.1, 1.9, 2.5, 0.1], 2),  # first above 2 at index 2
                                       ([0.1, 1.9, 2.0, 0.3], 4),  # == threshold is kept
                                       ([2.1, 0.1, 0.1], 0),
                                       ([0.5, 3.0, 0.1, 9.0], 1),  # later ones do not matter
                                       ([], 0)])
def test_rollback_position(nll, kept):
    assert int(rollback_length(torch.tensor(nll), 2.0)) == kept


class TableRunner:
    """Stands in for the draft ModelRunner: the i-th call returns the i-th row of q as logits."""

    def __init__(self, q_rows: list[list[float]]):
        self.logits = torch.tensor(q_rows).log()
        self.forwards = 0

    def __call__(self, input_ids: torch.Tensor, counts=None) -> torch.Tensor:
        out = self.logits[self.forwards].expand(1, input_ids.shape[1], -1)
        self.forwards += 1
        return out

    def then(self, calls, input_ids: torch.Tensor, fn, *args, counts=None):
        return calls(fn, self(input_ids, counts), *args)


SURE, UNSURE = [0.95, 0.05, 0.0], [0.5, 0.3, 0.2]


@pytest.mark.parametrize("rows, cap, fallback, drafted, forwards", [
    ([SURE, SURE, UNSURE, SURE], 10, 0.9, 2, 3),  # stops when max q = 0.5 < 0.9, before sampling
    ([UNSURE, SURE], 10, 0.9, 0, 1),  # unsure at once: the target takes over
    ([SURE] * 5, 3, 0.9, 3, 3),  # the length cap, no forward past it
    ([[0.5, 0.5, 0.0], [0.4, 0.3, 0.3]], 10, 0.5, 1, 2),  # max q == threshold: confident
])
def test_fallback_stop(rows, cap, fallback, drafted, forwards):
    runner = TableRunner(rows)
    warp = Warp(1.0, 0, 1.0)  # no truncation: ~q is the table
    draft, lengths = draft_until_unsure(runner, KERNELS, torch.tensor([[7]]), [cap], fallback,
                                        warp, torch.Generator().manual_seed(0))
    assert draft.shape == (1, drafted) and draft.dtype == torch.long and lengths == [drafted]
    assert runner.forwards == forwards


def test_fallback_uses_the_warped_draft():
    """max ~q after top-2 renormalisation is 0.8 / 0.95 = 0.84 >= 0.82; unwarped it is 0.8."""
    row = [[0.8, 0.15, 0.05]]
    gen = torch.Generator().manual_seed(0)
    for top_k, drafted in ((2, [1]), (0, [0])):
        assert draft_until_unsure(TableRunner(row), KERNELS, torch.tensor([[7]]), [1], 0.82,
                                  Warp(1.0, top_k, 1.0), gen)[1] == drafted


def test_rollback_test_distribution_is_temperature_scaled_and_untruncated():
    logits = torch.tensor([[2.0, 1.0, -1.0, -5.0]])
    torch.testing.assert_close(rollback_log_probs(logits, 0.5), torch.log_softmax(2 * logits, -1))
    torch.testing.assert_close(rollback_log_probs(logits, 0.0), torch.log_softmax(logits, -1))
    assert torch.isfinite(rollback_log_probs(logits, 1.0)).all()  # no top-k / top-p zeros


def test_never_roll_back_never_fall_back_emits_the_whole_draft_plus_a_bonus(llama_pair):
    g = me.generate("bild", llama_pair, PROMPT, max_new_tokens=30, seed=1, fallback=0.0,
                    rollback=math.inf, max_draft=5)
    for st in g.steps[:-1]:
        assert st.proposed == st.accepted == 5 and st.emitted == 6 and st.target_forwards == 1
    assert g.stats.block_efficiency > 5


def test_always_roll_back_keeps_no_draft_token(llama_pair):
    g = me.generate("bild", llama_pair, PROMPT, max_new_tokens=20, seed=1, fallback=0.0,
                    rollback=1e-6)
    assert g.stats.draft_accepted == 0 and g.stats.draft_proposed > 0
    assert all(st.emitted == 1 for st in g.steps)


def test_always_falling_back_is_sampling_from_the_target(llama_pair):
    """fallback = 1: max ~q < 1 at temperature 1, so no draft token; each iteration samples ~p
    with the same generator calls as ar."""
    kw = dict(max_new_tokens=20, seed=4)
    ref = me.generate("ar", llama_pair, PROMPT, **kw)
    g = me.generate("bild", llama_pair, PROMPT, fallback=1.0, **kw)
    assert g.token_ids == ref.token_ids and g.stats.draft_proposed == 0


def test_default_run_has_consistent_stats(llama_pair):
    g = me.generate("bild", llama_pair, PROMPT, max_new_tokens=24, seed=0, fallback=0.05)
    s = g.stats
    assert s.tokens_emitted == len(g.token_ids) and s.draft_accepted <= s.draft_proposed
    assert all(st.proposed <= 10 and st.emitted <= st.accepted + 1 for st in g.steps)
    assert get_decoder("bild").lookahead == 10


@pytest.mark.parametrize("params, word", [({"fallback": 1.5}, "fallback"),
                                          ({"fallback": -0.1}, "fallback"),
                                          ({"rollback": 0}, "rollback"),
                                          ({"max_draft": 0}, "max_draft"),
                                          ({"rollback": "high"}, "rollback")])
def test_bad_parameters_are_refused_by_name(params, word):
    with pytest.raises(ValueError, match=word):
        get_decoder("bild", **params)
