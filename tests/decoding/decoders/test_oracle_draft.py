"""Oracle drafts: every drafting decoder, given a draft that proposes the target's own greedy
continuation, accepts all of it (greedy), so each iteration emits its draft depth + 1 tokens.

Lossless and greedy-vs-``ar`` tests cannot see a drafter that drafts the wrong tokens (it only
costs speed); these can. The draft is an oracle by construction, loaded through the real path:
- chains and trees (spd, typical, bild, mtad, mmtad, specinfer, mcss, spectr): the draft model
  is the target itself (``draft='self'``), so at temperature 0 every proposal is its argmax;
- heads (medusa, eagle-1, eagle-3) and pld: a target whose greedy continuation is a known cycle
  of its vocabulary (`tiny.successor_llama`), with heads whose weights predict that cycle
  (`tiny.save_oracle_medusa`, `tiny.save_oracle_eagle`) and, for pld, a prompt holding one turn
  of the cycle, so the lookup's continuation is what the target emits next.
``max_new_tokens`` is a multiple of depth + 1, so no block is cut at the end: total acceptance
means accepted == draft_depth == the decoder's depth in every iteration and block efficiency
(tokens per target forward) == depth + 1.
"""

from __future__ import annotations

import math

import pytest
import torch

import mtad_energy as me
from mtad_energy.models import load_pair
from tests import tiny
from tests.conftest import VOCAB

BLOCKS = 3  # iterations per test: max_new_tokens = BLOCKS * (depth + 1)

# decoder, params, depth (draft tokens on one path per iteration)
CHAINS = [
    ("spd", {"gamma": 4}, 4),
    ("typical", {"gamma": 4}, 4),
    # the rollback test uses the untruncated T=1 p: the argmax has p >= 1/V, -log p <= log V
    ("bild", {"max_draft": 4, "rollback": math.log(VOCAB) + 0.5}, 4),
    ("mtad", {"gamma": 4, "beam_width": 3}, 4),
    ("mmtad", {"gamma": 3, "beam_width": 3}, 3),
    ("specinfer", {"branching": (3, 2, 2)}, 3),
    ("mcss", {"branching": (3, 2, 2)}, 3),
    ("spectr", {"gamma": 4, "num_drafts": 3}, 4),
]
# decoder, params, depth, EAGLE version (the pair: Medusa rides with EAGLE-1)
HEADS = [
    ("medusa", {"branching": (1, 1, 1)}, 3, 1),  # a chain: only the heads' top tokens
    ("medusa", {}, 3, 1),  # Medusa's 4,2,2 tree
    ("medusa", {"branching": (1, 1, 1), "acceptance": "speculative"}, 3, 1),
    *[(name, params, depth, version) for version in (1, 3) for name, params, depth in [
        ("eagle", {"tree": "static", "branching": (1, 1, 1, 1)}, 4),
        ("eagle", {"tree": "static"}, 4),
        ("eagle", {"tree": "dynamic", "depth": 4, "expand": 2, "total_tokens": 12}, 5)]],
]


@pytest.fixture(scope="module")
def self_draft_pair(model_dirs):
    """The tiny Llama drafting for itself: a chain or tree draft at temperature 0 is exactly
    the target's greedy continuation."""
    return load_pair(target=model_dirs["llama"], draft="self", device="cpu")


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    """The successor target, its cycle and its oracle heads' directories."""
    root = tmp_path_factory.mktemp("oracle")
    target, succ = tiny.successor_llama()
    return {"target": tiny.save(target, tiny.word_tokenizer(len(succ), eos=False), root / "t"),
            "succ": succ,
            "medusa": tiny.save_oracle_medusa(target, succ, root / "medusa"),
            "eagle1": tiny.save_oracle_eagle(target, succ, root / "eagle1", version=1),
            "eagle3": tiny.save_oracle_eagle(target, succ, root / "eagle3", version=3)}


@pytest.fixture(scope="module")
def oracle_pairs(successor):
    """(EAGLE-1 + Medusa pair, EAGLE-3 pair) over the successor target."""
    t = successor["target"]
    return (load_pair(target=t, draft=f"medusa:{successor['medusa']},"
                                      f"eagle:{successor['eagle1']}", device="cpu"),
            load_pair(target=t, draft=f"eagle:{successor['eagle3']}", device="cpu"))


def cycle_from(succ: list[int], start: int, n: int) -> list[int]:
    """``n`` tokens of the successor cycle starting at ``start``."""
    out = [start]
    while len(out) < n:
        out.append(succ[out[-1]])
    return out


def assert_total(gen, ref: list[int], depth: int) -> None:
    """Greedy tokens are ar's; every iteration accepted its whole draft of ``depth`` tokens."""
    assert gen.token_ids == ref
    steps = [(s.accepted, s.draft_depth, s.emitted) for s in gen.steps]
    assert steps == [(depth, depth, depth + 1)] * BLOCKS, steps
    assert gen.stats.block_efficiency == depth + 1
    assert gen.stats.acceptance_rate == 1.0


def test_the_successor_target_emits_its_cycle(successor, oracle_pairs):
    """The oracle heads' premise: the target's greedy continuation of any prompt is the cycle
    after its last token, through the whole vocabulary."""
    succ = successor["succ"]
    assert sorted(succ) == list(range(len(succ))) and len(set(cycle_from(succ, 0, 16))) == 16
    for prompt in ([3, 5], [7], [0, 1, 2, 9, 9]):
        gen = me.generate("ar", oracle_pairs[0], prompt, max_new_tokens=20, temperature=0)
        assert gen.token_ids == cycle_from(succ, prompt[-1], 21)[1:]


@pytest.mark.parametrize(("name", "params", "depth"), CHAINS, ids=[c[0] for c in CHAINS])
@pytest.mark.parametrize("prompt", [[5, 9, 11, 3], [17]])
def test_a_self_draft_is_accepted_whole(self_draft_pair, name, params, depth, prompt):
    n = BLOCKS * (depth + 1)
    ref = me.generate("ar", self_draft_pair, prompt, max_new_tokens=n, temperature=0,
                      compute_perplexity=False).token_ids
    gen = me.generate(name, self_draft_pair, prompt, max_new_tokens=n, temperature=0,
                      compute_perplexity=False, **params)
    assert_total(gen, ref, depth)


# q = p exactly: speculative sampling accepts with min(1, p/q) = 1, SpecTr's rho is 1, and MTAD's
# joint ratio along y* (MMTAD's along each node's own path) is 1 > tau
SAMPLED = [c for c in CHAINS if c[0] in ("spd", "specinfer", "mcss", "spectr", "mtad", "mmtad")]


@pytest.mark.parametrize(("name", "params", "depth"), SAMPLED, ids=[c[0] for c in SAMPLED])
def test_a_self_draft_is_accepted_whole_when_sampled(self_draft_pair, name, params, depth):
    """At temperature 1 (top-k 10, top-p 0.9 on both) a draft equal to the target is accepted
    whole by every rule that compares p with q, whatever tokens it samples: a tree's sampled
    branches are attended by the target as their own paths (MMTAD's beam tree included)."""
    n = BLOCKS * (depth + 1)
    whole_runs = 0
    for seed in range(4):
        gen = me.generate(name, self_draft_pair, [5, 9, 11, 3], max_new_tokens=n, seed=seed,
                          compute_perplexity=False, **params)
        steps = [(s.accepted, s.draft_depth, s.emitted) for s in gen.steps]
        *whole, (last_accepted, last_depth, last_emitted) = steps
        assert whole == [(depth, depth, depth + 1)] * len(whole), (seed, steps)
        # a sampled EOS may end the last block early: all of it that was draft was accepted
        assert (last_accepted, last_depth) == (min(depth, last_emitted), depth), (seed, steps)
        assert len(steps) == BLOCKS or gen.stats.stop_reason == "eos", (seed, steps)
        whole_runs += gen.stats.stop_reason == "max_new_tokens"
    assert whole_runs >= 2  # most runs drafted every block

@pytest.mark.parametrize(("name", "params", "depth", "version"), HEADS,
                         ids=[f"{n}{v if n == 'eagle' else ''}-{'-'.join(map(str, p.values()))}"
                              for n, p, _, v in HEADS])
def test_oracle_heads_are_accepted_whole(successor, oracle_pairs, name, params, depth, version):
    """The prompt follows the cycle (a head reads the target's features of the prompt: off
    the cycle its first proposal is rightly wrong)."""
    pair = oracle_pairs[0 if version == 1 else 1]
    n = BLOCKS * (depth + 1)
    prompt = cycle_from(successor["succ"], 6, 4)
    ref = cycle_from(successor["succ"], prompt[-1], n + 1)[1:]
    gen = me.generate(name, pair, prompt, max_new_tokens=n, temperature=0,
                      compute_perplexity=False, **params)
    assert_total(gen, ref, depth)


def test_pld_drafts_the_prompts_cycle_and_it_is_accepted_whole(successor, oracle_pairs):
    """A prompt holding one turn of the cycle and 3 tokens more: the last 3-gram's latest
    earlier occurrence is one turn back, and its continuation (gamma tokens) is what the
    target emits next; every iteration accepts all gamma tokens."""
    succ, gamma = successor["succ"], 6
    prompt = cycle_from(succ, 2, len(succ) + 3)
    n = BLOCKS * (gamma + 1)
    gen = me.generate("pld", oracle_pairs[0], prompt, max_new_tokens=n, temperature=0,
                      compute_perplexity=False, gamma=gamma)
    assert_total(gen, cycle_from(succ, prompt[-1], n + 1)[1:], gamma)
    assert gen.stats.draft_forwards == 0


@torch.inference_mode()
def test_the_oracle_heads_predict_the_next_tokens(successor, oracle_pairs):
    """The heads are oracles by their weights, not by luck: on the target's hidden state of
    token t, Medusa's head k proposes succ^(k+2)(t); EAGLE's pair (feature of t, next token)
    proposes succ^2(t)."""
    succ = successor["succ"]
    pair, pair3 = oracle_pairs
    ids = torch.tensor([cycle_from(succ, 4, 6)])
    out = pair.target(input_ids=ids, output_hidden_states=True)
    medusa = pair.heads["medusa"](out.hidden_states[-1][0])  # [6, K, V]
    for j, t in enumerate(ids[0].tolist()):
        assert medusa[j].argmax(-1).tolist() == [cycle_from(succ, t, k + 3)[-1] for k in range(3)]
    eagle1 = pair.heads["eagle"](ids[:, 1:], out.hidden_states[-1][:, :-1]).logits
    taps = pair3.heads["eagle"].target_hidden_states()
    e3 = pair3.heads["eagle"]
    eagle3 = e3(ids[:, 1:], torch.cat([out.hidden_states[i][:, :-1] for i in taps], -1)).logits
    want = [cycle_from(succ, t, 3)[-1] for t in ids[0, :-1].tolist()]
    assert eagle1.argmax(-1)[0].tolist() == want
    assert e3.to_target(eagle3.argmax(-1))[0].tolist() == want
