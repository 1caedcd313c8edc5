"""End-to-end decoder behaviour on tiny models loaded through the normal path."""

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.decoding.runtime.beams import beam_sample
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import PhaseTimer
from tests.decoding.lossless import chi_square_pvalue, exact_joint, sample_counts

PROMPT = [5, 9, 12, 3]
CORE = ["ar", "beam", "mtjd", "spd", "mtad"]


@pytest.mark.parametrize("name", CORE)
def test_every_core_decoder_runs_with_consistent_stats(llama_pair, name):
    g = me.generate(name, llama_pair, PROMPT, max_new_tokens=20, seed=3)
    s = g.stats
    assert 1 <= len(g.token_ids) <= 20
    assert s.tokens_emitted == len(g.token_ids) == sum(step.emitted for step in g.steps)
    assert s.target_forwards == sum(step.target_forwards for step in g.steps) >= 1
    assert s.block_efficiency == pytest.approx(s.tokens_emitted / s.target_forwards)
    assert s.perplexity is not None and s.perplexity > 1
    assert s.time_draft_s + s.time_target_s <= s.decode_time_s + 1e-6
    if me.DECODERS[name].needs_draft:
        assert s.draft_forwards > 0 and 0 <= s.acceptance_rate <= 1
        assert s.draft_accepted <= s.draft_proposed
    else:
        assert s.draft_forwards == 0 and s.acceptance_rate is None


@pytest.mark.parametrize("name", ["spd", "mtad", "mtjd", "beam"])
@pytest.mark.parametrize("pair", ["llama_pair", "opt_pair"])
def test_greedy_equals_greedy_ar_token_for_token(request, pair, name):
    pair = request.getfixturevalue(pair)
    ref = me.generate("ar", pair, PROMPT, max_new_tokens=24, temperature=0).token_ids
    out = me.generate(name, pair, PROMPT, max_new_tokens=24, temperature=0, seed=11).token_ids
    assert out == ref


def test_same_seed_same_output_different_seed_differs(llama_pair):
    a = me.generate("mtad", llama_pair, PROMPT, max_new_tokens=16, seed=4, top_k=0, top_p=1.0)
    b = me.generate("mtad", llama_pair, PROMPT, max_new_tokens=16, seed=4, top_k=0, top_p=1.0)
    c = me.generate("mtad", llama_pair, PROMPT, max_new_tokens=16, seed=5, top_k=0, top_p=1.0)
    assert a.token_ids == b.token_ids != c.token_ids


def test_generation_stops_at_eos_and_reports_it(llama_pair):
    first = me.generate("ar", llama_pair, PROMPT, max_new_tokens=3, temperature=0).token_ids[0]
    pair = me.ModelPair(llama_pair.target, llama_pair.draft, llama_pair.tokenizer)
    tok = type(pair.tokenizer).from_pretrained(pair.tokenizer.name_or_path)
    tok.eos_token = tok.convert_ids_to_tokens(first)
    pair.tokenizer = tok
    for name in ["ar", "spd", "mtad"]:
        g = me.generate(name, pair, PROMPT, max_new_tokens=10, temperature=0)
        assert g.token_ids == [first] and g.stats.stop_reason == "eos"


def test_list_of_prompts_gives_one_generation_each(llama_pair):
    outs = me.generate("spd", llama_pair, ["w1 w2 w3", "w4 w5"], max_new_tokens=5)
    assert len(outs) == 2 and all(len(g.token_ids) == 5 for g in outs)
    assert outs[0].prompt_len == 3 and outs[1].prompt_len == 2


def test_perplexity_is_that_of_the_unwarped_target(llama_pair):
    g = me.generate("spd", llama_pair, PROMPT, max_new_tokens=8, seed=2)
    ids = torch.tensor([PROMPT + g.token_ids])
    with torch.no_grad():
        logits = llama_pair.target(input_ids=ids).logits[0, len(PROMPT) - 1:-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, len(PROMPT):])
    assert g.stats.perplexity == pytest.approx(torch.exp(nll).item(), rel=1e-5)


def test_mtjd_with_k1_matches_ar_in_distribution(lossless_pair):
    exact = exact_joint(lossless_pair, Warp())
    for name, kw in [("ar", {}), ("mtjd", {"k": 1, "beam_width": 4})]:
        counts = sample_counts(me.get_decoder(name, **kw), lossless_pair, 2000)
        assert chi_square_pvalue(counts, exact) > 1e-3, name


@pytest.mark.parametrize("warp", [Warp(), Warp(top_k=3, top_p=1.0)], ids=["vocab", "top-k"])
def test_beam_draft_of_width_one_samples_the_joint_draft_distribution(lossless_pair, warp):
    """With W=1 each step samples (beam, token) in proportion to the joint ~q: the final beam is
    an exact sample of the joint draft distribution. top_k 3 < V: each step draws among the
    top-k candidates only (`beams.candidates`), the same law."""
    pair = me.ModelPair(lossless_pair.draft, None, lossless_pair.tokenizer)
    if warp.top_k == 3:  # premise: the candidate path is taken (no tie at the cut)
        logits = pair.target(input_ids=torch.tensor([[1, 2]])).logits[:, -1]
        assert warp.support(logits)[0] is not None
    exact = exact_joint(pair, warp)
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(2000):
        runner = ModelRunner(pair.target, PhaseTimer(torch.device("cpu")), "draft")
        draft = beam_sample(runner, torch.tensor([[1, 2]]), 2, 1, warp, g)
        key = tuple(draft.best_seq.tolist())
        counts[key] = counts.get(key, 0) + 1
        assert draft.best_path_log_q[-1].exp().item() == pytest.approx(exact[key], rel=1e-4)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_beam_draft_records_the_tree_and_joint_log_probs(llama_pair):
    runner = ModelRunner(llama_pair.draft, PhaseTimer(torch.device("cpu")), "draft")
    warp = Warp(top_k=0, top_p=1.0)
    d = beam_sample(runner, torch.tensor([PROMPT]), 3, 4, warp, torch.Generator().manual_seed(1))
    assert d.tokens.shape == d.parents.shape == d.log_q.shape == (3, 4)
    assert len(runner) == len(PROMPT) + 2 and runner.cache.layers[0].keys.shape[0] == 4
    for b in range(4):  # the final beams' paths agree with the tree and with a fresh forward
        node, path = b, []
        for depth in range(2, -1, -1):
            path.append(d.tokens[depth, node].item())
            node = d.parents[depth, node].item()
        assert path[::-1] == d.seqs[b].tolist()
        ids = torch.tensor([PROMPT + d.seqs[b].tolist()])
        with torch.no_grad():
            logp = warp.probs(llama_pair.draft(input_ids=ids).logits[0, len(PROMPT) - 1:-1]).log()
        joint = logp[torch.arange(3), d.seqs[b]].cumsum(0)
        assert torch.allclose(joint, d.path_log_q[b], atol=1e-5)
    assert d.best.item() == d.log_q[-1].argmax().item()


def test_a_batched_prompt_tensor_is_refused_and_a_single_row_is_one_prompt(llama_pair):
    one = me.generate("ar", llama_pair, torch.tensor([[5, 6, 7]]), max_new_tokens=3, seed=0)
    flat = me.generate("ar", llama_pair, torch.tensor([5, 6, 7]), max_new_tokens=3, seed=0)
    assert one.prompt_len == 3 and one.token_ids == flat.token_ids
    with pytest.raises(ValueError, match=r"shape \[2, 3\] holds 2 prompts"):
        me.generate("ar", llama_pair, torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3)


DRAFTING = ["spd", "mtad", "mmtad", "specinfer", "mcss", "spectr", "typical", "bild"]


@pytest.mark.parametrize("name", DRAFTING)
def test_acceptance_means_the_same_for_every_decoder(llama_pair, name):
    """Draft = target, greedy: every draft token on the emitted path is right, so accepted /
    draft_depth is 1 for chains, trees and multi-draft decoders alike; the tokens the target
    scored (tree nodes, k rows) are counted apart, never in the rate."""
    from mtad_energy.models import ModelPair

    same = ModelPair(llama_pair.target, llama_pair.target, llama_pair.tokenizer)
    params = {"rollback": 100.0} if name == "bild" else {}
    g = me.generate(name, same, "w1 w2 w3", max_new_tokens=16, temperature=0, seed=0, **params)
    s = g.stats
    if s.stop_reason == "eos":
        pytest.skip("greedy output hit EOS at once")
    assert s.draft_depth > 0 and s.acceptance_rate == 1.0
    assert s.draft_proposed >= s.draft_depth
    assert s.mean_accepted_length == s.draft_accepted / sum(1 for st in g.steps if st.draft_depth)
    assert all(st.accepted == st.draft_depth for st in g.steps)


def test_a_block_cut_by_eos_counts_only_the_kept_draft_tokens(llama_pair):
    """spd-shaped block whose first draft token is EOS: 1 token emitted, 1 draft token kept."""
    from mtad_energy.decoding.runtime.decoder import Decoder
    from mtad_energy.decoding.runtime.generate import generate_ids
    from mtad_energy.decoding.runtime.step import StepResult

    eos = llama_pair.eos_token_id

    class EosFirst(Decoder):
        name, help, needs_draft = "eos-first", "test", False

        @property
        def lookahead(self):
            return 4

        def step(self, s):
            draft = torch.tensor([eos, 5, 6, 7], device=s.ids.device)
            n = torch.tensor(4, device=s.ids.device)
            return StepResult.block(draft, n, torch.tensor(8, device=s.ids.device), proposed=4)

    g = generate_ids(EosFirst(), llama_pair, [5, 6, 7], 10, compute_perplexity=False)
    st = g.steps[0]
    assert g.stats.stop_reason == "eos" and g.token_ids == [eos]
    assert (st.emitted, st.proposed, st.accepted, st.draft_depth) == (1, 4, 1, 4)
