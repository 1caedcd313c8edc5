"""`medusa` and `eagle`: heads on the target's hidden states, loaded through the real path from
checkpoints in their public layouts (tests/tiny.py). Greedy-exactness, losslessness (chi-square,
a broken variant rejected), the acceptance rules on hand-made trees, per-row batching and the
compiled path where drafts are kept, and the statistics contract.

The registry-wide tests (runtime/test_batch.py, test_compile*.py, test_host_syncs.py) run both on the
tiny Llama (64 tokens: the random heads' proposals are rarely kept); here a 5-token target makes
them kept often, so rollback, per-row acceptance and tree keeping are exercised."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules import tree as tree_rules
from mtad_energy.decoding.rules.tree import tree_candidates_accept, tree_typical_accept
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.decoding.runtime.generate import generate_ids, generate_rows
from mtad_energy.decoding.runtime.tree import ancestors
from mtad_energy.models import load_pair
from tests import tiny
from tests.decoding.lossless import batched_row_pvalues, chi_square_pvalue

TRACE = CompileOptions(backend="aot_eager")
PROMPTS = [[1, 0, 2], [3], [4, 1, 0, 2, 2]]
SMALL = {"medusa": {"branching": (2, 2), "acceptance": "speculative"},
         "eagle": {"depth": 2, "expand": 2, "total_tokens": 6}}


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """The 5-token lossless target (1 layer) with Medusa-1 and EAGLE-1 heads."""
    root = tmp_path_factory.mktemp("small")
    target = tiny.lossless_pair().target
    path = tiny.save(target, tiny.word_tokenizer(5, eos=False), root / "target")
    return load_pair(target=path, device="cpu",
                     draft=f"medusa:{tiny.save_medusa(target, root / 'medusa')},"
                           f"eagle:{tiny.save_eagle(target, root / 'eagle', version=1)}")


CASES = [("medusa", {"acceptance": "typical"}), ("medusa", {"acceptance": "speculative"}),
         ("eagle", {"tree": "dynamic"}), ("eagle", {"tree": "static"})]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{list(p.values())[0]}"
                                                         for n, p in CASES])
@pytest.mark.parametrize("pair", ["llama_pair", "small_pair", "small3_pair"])
def test_greedy_is_greedy_ar_token_for_token(request, pair, name, params):
    pair = request.getfixturevalue(pair)
    if name not in pair.heads:
        pytest.skip(f"no {name} head on this pair")
    small = pair.target.config.vocab_size == 5
    params = {**(SMALL[name] if small else {}), **params}
    if name == "eagle" and params["tree"] == "static" and small:  # dynamic's knobs: refused
        params = {"tree": "static", "branching": (2, 2, 1)}
    ref = me.generate("ar", pair, [1, 0, 2], max_new_tokens=24, temperature=0).token_ids
    gen = me.generate(name, pair, [1, 0, 2], max_new_tokens=24, temperature=0, **params)
    assert gen.token_ids == ref
    if small:  # the test means something: drafts were kept, and cut short
        kept = [(s.accepted, s.draft_depth) for s in gen.steps if s.draft_depth]
        assert any(a >= 1 for a, _ in kept) and any(a < d for a, d in kept), kept


@pytest.mark.slow
@pytest.mark.parametrize("name", ["medusa", "eagle"])
@pytest.mark.parametrize("pair", ["small_pair", "small3_pair"])
def test_greedy_rows_with_kept_drafts_are_their_batch_1_and_eager_runs(request, pair, name):
    """Rows of different lengths (one of one token: no feature yet) keep different numbers of
    draft tokens in one iteration: batched rows, compiled rows and batch 1 agree token for token
    and step for step."""
    pair = request.getfixturevalue(pair)
    if name not in pair.heads:
        pytest.skip(f"no {name} head on this pair")
    decoder = get_decoder(name, temperature=0, **SMALL[name])
    rows = generate_rows(decoder, pair, PROMPTS, 16, compute_perplexity=False)
    compiled = generate_rows(decoder, pair, PROMPTS, 16, compute_perplexity=False,
                             compile=TRACE)
    assert compiled[0].config["compiled"] == ["target", "draft"]
    steps = []
    for prompt, row, comp in zip(PROMPTS, rows, compiled, strict=True):
        alone = generate_ids(decoder, pair, prompt, 16, compute_perplexity=False)
        stats = [(s.accepted, s.draft_depth, s.proposed) for s in alone.steps]
        assert row.token_ids == comp.token_ids == alone.token_ids
        assert [(s.accepted, s.draft_depth, s.proposed) for s in row.steps] == stats
        assert [(s.accepted, s.draft_depth, s.proposed) for s in comp.steps] == stats
        steps.append([s.accepted for s in row.steps])
    assert any(len(set(a)) > 1 for a in zip(*steps, strict=False))  # ragged iterations


def test_the_statistics_contract(llama_pair):
    """proposed = the draft tree's nodes within the row's depth, draft_depth = the tree's depth
    (capped by what the row can still emit), accepted <= depth and emitted = accepted + 1; the
    head's forwards are draft forwards (Medusa one per drafting iteration; EAGLE one catch-up
    and one per expansion), with draft time."""
    from mtad_energy.decoding.runtime.tree import tree_nodes

    cases = [  # decoder, params, depth of the full tree, (nodes, head forwards) at depth d
        ("medusa", {}, 3, lambda d: (tree_nodes((4, 2, 2)[:d]), 1)),
        ("eagle", {"tree": "static", "branching": (3, 2)}, 2,
         lambda d: (tree_nodes((3, 2)[:d]), d))]
    for name, params, full, expect in cases:
        gen = me.generate(name, llama_pair, [5, 9, 11, 3], max_new_tokens=30, seed=2, **params)
        s = gen.stats
        assert s.time_draft_s > 0
        assert s.draft_forwards == sum(st.draft_forwards for st in gen.steps)
        assert s.target_forwards == s.iterations
        depths = [st.draft_depth for st in gen.steps]
        assert depths[0] == full and set(depths) <= set(range(full + 1))
        for st in gen.steps:
            assert st.accepted <= st.draft_depth and st.emitted == st.accepted + 1
            if st.draft_depth:
                assert (st.proposed, st.draft_forwards) == expect(st.draft_depth)
        assert s.acceptance_rate == pytest.approx(s.draft_accepted / s.draft_depth)


@pytest.mark.parametrize("pair", ["llama_pair", "small_pair"])
def test_a_dynamic_trees_depth_is_that_of_the_nodes_it_chose(request, pair):
    """EAGLE-2's tree keeps the total_tokens - 1 best nodes by cumulative draft log-prob: unsure
    drafts give a wide, shallow tree, and its draft_depth is the chosen tree's depth, not the
    expansion steps'; proposed = the nodes verified, head forwards = catch-up + expansions."""
    pair = request.getfixturevalue(pair)
    params = {"depth": 3, "expand": 2, "total_tokens": 4}  # 3 nodes: depth 1 to 3
    gen = me.generate("eagle", pair, [1, 0, 2], max_new_tokens=30, seed=2, **params)
    depths = [st.draft_depth for st in gen.steps if st.draft_depth]
    assert depths and set(depths) <= {1, 2, 3}, depths  # never the 4 = depth + 1 expansions
    for st in gen.steps:
        assert st.accepted <= st.draft_depth and st.emitted == st.accepted + 1
        if st.draft_depth:
            assert st.proposed <= 3 and 1 <= st.draft_forwards <= 4
    assert gen.stats.acceptance_rate == pytest.approx(
        gen.stats.draft_accepted / gen.stats.draft_depth)


def test_a_pair_without_the_head_is_refused_with_the_fix(model_dirs):
    pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
    for name in ("eagle", "medusa"):
        with pytest.raises(ValueError, match=f"drafts with a {name} head.*draft='{name}:DIR'"):
            me.generate(name, pair, [1, 2], max_new_tokens=4)
    heads = load_pair(target=model_dirs["llama"], draft=f"medusa:{model_dirs['llama-medusa']}",
                      device="cpu")
    with pytest.raises(ValueError, match=r"branching \(4, 2, 2, 2\) has 4 levels but the "
                                         r"checkpoint has 3 heads"):
        me.generate("medusa", heads, [1, 2], max_new_tokens=4, branching=(4, 2, 2, 2))


# -- the acceptance rules on hand-made trees --------------------------------------------------
# root 0; nodes 1, 2 its children (tokens 1, 2); node 3 child of 1 (token 3)
PARENTS = torch.tensor([-1, 0, 0, 1])
TOKENS = torch.tensor([0, 1, 2, 3])
P_ROOT = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
P_ONE = torch.tensor([0.25, 0.25, 0.0, 0.5, 0.0])  # at node 1


def _first_two(n: int, caps: int = 3) -> tuple[Counter, int]:
    """The emitted block's first two tokens (the one, when only the root's token is emitted)
    of n walks, and the deepest accepted depth among them."""
    p = torch.stack([P_ROOT, P_ONE, P_ROOT, P_ROOT])[None].expand(n, -1, -1)
    gen = torch.Generator().manual_seed(0)
    depth, path, nxt, node = tree_candidates_accept(
        p, TOKENS.expand(n, -1), PARENTS, ancestors(PARENTS), torch.full((n,), caps), 2, gen)
    out: Counter = Counter()
    for d, pa, x in zip(depth.tolist(), path.tolist(), nxt.tolist(), strict=True):
        block = [int(TOKENS[i]) for i in pa[:d]] + [x]
        out[tuple(block[:2])] += 1
    return out, int(depth.max())


def _exact_first_two() -> dict[tuple, float]:
    """The first token from p at the root; after 1 or 2 (nodes 1, 2) the second from p at that
    node (P_ONE, P_ROOT); after 0 or 3 (no node) the block ends."""
    exact: dict[tuple, float] = {}
    for x, px in enumerate(P_ROOT.tolist()):
        after = {1: P_ONE, 2: P_ROOT}.get(x)
        if px == 0:
            continue
        if after is None:
            exact[(x,)] = px
        for y, py in enumerate(after.tolist() if after is not None else []):
            if py:
                exact[(x, y)] = px * py
    return exact


def test_the_candidate_rule_emits_p_exactly():
    counts, deepest = _first_two(20000)
    assert deepest == 2  # node 3 was reached
    assert chi_square_pvalue(counts, _exact_first_two()) > 1e-3


def test_the_candidate_rule_with_the_residual_replaced_by_p_is_rejected(monkeypatch):
    monkeypatch.setattr(tree_rules, "residual", lambda p, q: p)  # a stop token may be a child
    assert chi_square_pvalue(_first_two(20000)[0], _exact_first_two()) < 1e-6


def test_the_candidate_rule_respects_a_rows_depth_cap():
    """caps 1: node 3 is not the row's draft (never accepted), and the output is still p's."""
    counts, deepest = _first_two(20000, caps=1)
    assert deepest == 1
    assert chi_square_pvalue(counts, _exact_first_two()) > 1e-3


def test_typical_acceptance_takes_the_deepest_passing_node_and_the_likelier_on_ties():
    # tree: root -> 1 (token 1), 2 (token 2); 1 -> 3 (token 3); 2 -> 4 (token 4)
    parents = torch.tensor([-1, 0, 0, 1, 2])
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    anc = ancestors(parents)
    flat = torch.full((5,), 0.2)  # H = log 5: threshold min(0.09, 0.3/5 = 0.06)
    p = torch.stack([flat, flat, flat, flat, flat])[None].clone()
    p[0, 0] = torch.tensor([0.0, 0.5, 0.4, 0.05, 0.05])  # root: tokens 1 and 2 pass
    p[0, 1] = torch.tensor([0.3, 0.3, 0.3, 0.05, 0.05])  # node 1: token 3 fails (0.05 < 0.09)
    p[0, 2] = torch.tensor([0.25, 0.25, 0.25, 0.0, 0.25])  # node 2: token 4 passes
    depth, path, node = tree_typical_accept(p, tokens, parents, anc, torch.tensor([2]), 2,
                                            0.09, 0.3)
    assert (int(depth), int(node), path.tolist()) == (2, 4, [[2, 4]])
    p[0, 1, 3] = 0.4  # now node 3 passes too: two depth-2 paths, 0.5 * 0.4 > 0.4 * 0.25
    depth, path, node = tree_typical_accept(p, tokens, parents, anc, torch.tensor([2]), 2,
                                            0.09, 0.3)
    assert (int(depth), int(node)) == (2, 3)
    depth, _, node = tree_typical_accept(p, tokens, parents, anc, torch.tensor([1]), 2, 0.09, 0.3)
    assert (int(depth), int(node)) == (1, 1)  # capped at depth 1: the likelier child


# -- lossless under sampling: chi-square per row, batched ----------------------------------------
LOSSLESS = [("medusa", SMALL["medusa"], "small_pair"),
            ("eagle", {**SMALL["eagle"], "tree": "dynamic"}, "small_pair"),
            ("eagle", {"tree": "static", "branching": (2, 2)}, "small3_pair")]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "residual-broken"])
@pytest.mark.parametrize(("name", "params", "pair"), LOSSLESS,
                         ids=["medusa-speculative", "eagle1-dynamic", "eagle3-static"])
def test_lossless_per_row(request, name, params, pair, broken):
    """Three rows of different lengths (one of one token) decoded together: each row's 3-token
    continuations follow its own warped p; with the residual replaced by p they do not."""
    pvalues = batched_row_pvalues(request.getfixturevalue(pair), get_decoder(name, **params),
                                  tree_rules, broken)
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("pair", ["small_pair", "small3_pair"])
def test_batched_eagle_heads_see_what_they_see_alone(request, pair, monkeypatch):
    """Every iteration, each row's first-level draft distribution (the head's output after its
    catch-up, which attends over all the pairs it was fed) is its batch-1 one: the rows' pairs
    are aligned and masked right in the shared head cache, not only the last one."""
    from mtad_energy.decoding.decoders import eagle

    pair = request.getfixturevalue(pair)
    seen: list[tuple[list[int], torch.Tensor]] = []
    real_catch_up, real_tree = eagle.Eagle._catch_up, eagle.eagle_dynamic

    def catch_up(self, s, counts):  # the pairs each row is fed
        seen.append((list(counts), None))
        return real_catch_up(self, s, counts)

    def tree(tree_then, call, logits, *args):  # the head's output at each row's last pair
        seen[-1] = (seen[-1][0], logits[:, -1].clone())
        return real_tree(tree_then, call, logits, *args)

    monkeypatch.setattr(eagle.Eagle, "_catch_up", catch_up)
    monkeypatch.setattr(eagle, "eagle_dynamic", tree)
    decoder = get_decoder("eagle", temperature=0, **SMALL["eagle"])
    generate_rows(decoder, pair, PROMPTS, 12, compute_perplexity=False)
    batched = list(seen)
    for b, prompt in enumerate(PROMPTS):
        seen.clear()
        generate_ids(decoder, pair, prompt, 12, compute_perplexity=False)
        alone = torch.cat([logits for _, logits in seen])  # [row b's drafting iterations, V']
        # the row's own drafting iterations (none while it has no pair: a one-token prompt)
        mine = torch.stack([logits[b] for counts, logits in batched if counts[b] > 0])
        torch.testing.assert_close(mine[:len(alone)], alone, atol=1e-4, rtol=0)
