"""The compiled path (`compile=`): a static KV cache written at the runner's own position and
``torch.compile`` per shape, under the same loop and decoders as the eager path.

Most tests trace with the ``aot_eager`` backend (dynamo + AOT autograd, as inductor sees the
graph, without C++ code generation: seconds, not minutes, on CI's 2 cores); the ``slow`` ones use
inductor, the backend ``--compile`` runs.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import GPT2Config, GPT2LMHeadModel

from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime import static, static_graphs
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.decoding.runtime.generate import generate_ids
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.static import ForwardShape, StaticRunner
from mtad_energy.decoding.runtime.static_graphs import check_static_support
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.decoding.runtime.tree import ancestors, keep_path, level_parents, tree_forward
from tests.tiny import compile_test_decoder, skip_without_head

TRACE = CompileOptions(backend="aot_eager")
INDUCTOR = CompileOptions(backend="inductor")
PROMPT = [5, 9, 11, 3, 7, 21, 2]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch", ["llama", "opt", "self"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_greedy_output_is_token_identical_with_and_without_compile(arch, name, request):
    pair = request.getfixturevalue(f"{arch}_pair")
    skip_without_head(name, pair)
    decoder = compile_test_decoder(name, temperature=0)
    eager = generate_ids(decoder, pair, PROMPT, 24, compute_perplexity=False)
    compiled = generate_ids(decoder, pair, PROMPT, 24, compute_perplexity=False, compile=TRACE)
    assert compiled.token_ids == eager.token_ids
    # the same iterations: the same blocks accepted, the same forwards run
    assert [s.accepted for s in compiled.steps] == [s.accepted for s in eager.steps]
    assert compiled.stats.target_forwards == eager.stats.target_forwards
    assert compiled.stats.draft_forwards == eager.stats.draft_forwards


@pytest.mark.parametrize("name", ["spd", "mtad"])
def test_the_greedy_comparison_exercises_rollback(self_pair, name):
    """The identity above means something only if drafts were partly rejected (the write
    position moved back) and fully accepted (the draft caught up two tokens)."""
    gen = generate_ids(get_decoder(name, temperature=0), self_pair, PROMPT, 24,
                       compute_perplexity=False, compile=TRACE)
    accepted = {s.accepted for s in gen.steps if s.draft_depth}
    assert accepted & {1, 2, 3} and 4 in accepted, accepted


def _static(pair, role: str, options: CompileOptions) -> StaticRunner:
    model = pair.target if role == "target" else pair.draft
    return StaticRunner(model, PhaseTimer("cpu"), role, slots=32, options=options,
                        shape=ForwardShape(rows_per_seq=3))


def _compare_runner_ops(pair, options: CompileOptions, atol: float) -> None:
    """Logits and cache contents of a StaticRunner follow an eager ModelRunner through every
    operation the decoders use: prefill, chain forwards, crop, beam rows, a tree and its path."""
    eager = ModelRunner(pair.target, PhaseTimer("cpu"), "target")
    comp = _static(pair, "target", options)
    ids = torch.tensor([PROMPT])

    def both(fn):
        a, b = fn(eager), fn(comp)
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
        assert comp.row_lengths == eager.row_lengths

    both(lambda r: r.prefill(ids[:, :5]))
    both(lambda r: r(ids[:, 5:7]))                      # verify-like forward of 2
    both(lambda r: (r.crop(6), r(torch.tensor([[4]])))[1])  # rollback, then one token
    both(lambda r: (r.repeat_rows(3), r(torch.tensor([[1], [2], [3]])))[1])  # beam rows
    both(lambda r: (r.select_rows(torch.tensor([2, 2, 0])), r(torch.tensor([[6], [7], [8]])))[1])
    both(lambda r: (r.select_rows(torch.tensor([1])), r(torch.tensor([[9]])))[1])
    anc = ancestors(level_parents((2, 2)))  # 6 nodes; root = the last token
    nodes = torch.tensor([10, 11, 12, 13, 14, 15])
    both(lambda r: tree_forward(r, nodes, anc, len(r)))
    prefix = len(eager) - 6
    both(lambda r: (keep_path(r, prefix, torch.tensor([1, 4])), r(torch.tensor([[16]])))[1])
    # the static cache holds the same keys in its valid columns (a kept path leaves holes)
    held = comp.cache.valid[0, :len(comp)].nonzero()[:, 0]
    assert held.numel() == len(eager)
    for a, b in zip(eager.cache.layers, comp.cache.layers, strict=True):
        torch.testing.assert_close(b.keys[:1, :, held], a.keys, atol=atol, rtol=0)


@torch.inference_mode()  # as in generate: engines outlive a generation, with their caches
def test_static_runner_matches_the_eager_runner_op_by_op(llama_pair, opt_pair):
    _compare_runner_ops(llama_pair, TRACE, atol=1e-5)
    _compare_runner_ops(opt_pair, TRACE, atol=1e-5)


def test_static_cache_grows_mid_generation_and_keeps_its_contents(llama_pair, monkeypatch):
    monkeypatch.setattr(static_graphs, "MIN_SLOTS", 4)
    decoder = get_decoder("spd", temperature=0)
    eager = generate_ids(decoder, llama_pair, PROMPT, 20, compute_perplexity=False)
    runner_cls = static.StaticRunner

    class Small(runner_cls):  # reserve too few slots: the cache must grow as it goes
        def __init__(self, model, timer, phase, slots, options=None, seqs=1, shape=None):
            super().__init__(model, timer, phase, 4, options, seqs, shape)

    monkeypatch.setattr(static, "StaticRunner", Small)
    slots = []
    real = Small._run
    monkeypatch.setattr(Small, "_run", lambda self, *a, **k: (slots.append(self.cache.slots),
                                                             real(self, *a, **k))[1])
    compiled = generate_ids(decoder, llama_pair, PROMPT, 20, compute_perplexity=False,
                            compile=TRACE)
    assert compiled.token_ids == eager.token_ids
    assert slots[0] == 4 and slots[-1] >= len(PROMPT) + 20


def test_an_int8_draft_stays_eager_with_a_warning_and_the_target_compiles(model_dirs):
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft="self:int8", device="cpu")
    decoder = get_decoder("spd", temperature=0)
    eager = generate_ids(decoder, pair, PROMPT, 16, compute_perplexity=False)
    with pytest.warns(UserWarning, match=r"compile \(draft\): .*int8.*runs eager"):
        compiled = generate_ids(decoder, pair, PROMPT, 16, compute_perplexity=False,
                                compile=TRACE)
    assert compiled.config["compiled"] == ["target"]
    assert compiled.token_ids == eager.token_ids
    with warnings.catch_warnings(record=True) as again:  # said once per model, not per run
        warnings.simplefilter("always")
        generate_ids(decoder, pair, PROMPT, 4, compute_perplexity=False, compile=TRACE)
    assert not [w for w in again if "runs eager" in str(w.message)]


def test_shorter_forwards_run_at_the_decoders_verify_width(llama_pair):
    """The last iterations draft fewer tokens: a chain forward of k > 2 tokens runs padded to
    the decoder's widest (its verify of gamma + 1: no new graph mid-measurement), and the
    padding changes no logit; one or two tokens (draft steps, catch-ups) run as they are."""
    with torch.inference_mode():
        eager = ModelRunner(llama_pair.target, PhaseTimer("cpu"), "target")
        comp = StaticRunner(llama_pair.target, PhaseTimer("cpu"), "pad-test", slots=32,
                            options=TRACE, shape=ForwardShape(max_chain=5))
        for r in (eager, comp):
            r.prefill(torch.tensor([PROMPT[:2]]))
        for ids in ([PROMPT[2:5], [4, 8], [6]]):  # 3 tokens (run at 5), then 2, then 1
            torch.testing.assert_close(comp(torch.tensor([ids])), eager(torch.tensor([ids])),
                                       atol=1e-5, rtol=0)
            assert comp.row_lengths == eager.row_lengths
    assert {w for _, w, _ in comp.cache.warmed} == {5, 2, 1}


def test_architectures_without_custom_masks_are_refused_by_name():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*gpt2.*without --compile"):
        check_static_support(gpt2)


@pytest.mark.slow
@torch.inference_mode()
def test_inductor_runner_logits_agree_with_eager(llama_pair):
    _compare_runner_ops(llama_pair, INDUCTOR, atol=1e-4)


@pytest.mark.slow
def test_inductor_spd_is_token_identical_and_compiles_a_bounded_number_of_graphs(llama_pair):
    """spd compiles one graph per shape it uses: the draft's catch-up of 1 or 2 tokens, the
    target's verify of gamma+1 and, where the last iterations draft fewer tokens, of 1..gamma;
    and its kernels per signature: the target step's sampling, the draft's (after 1 or 2 tokens
    fed) and the verify's rule for each draft length 1..gamma. So at most gamma + 3 forward
    graphs and gamma + 3 kernel graphs, however long the generation; the same generation again,
    or one after a prompt of another length in the same cache bucket, compiles none beyond."""
    decoder = get_decoder("spd", temperature=0)  # gamma 4
    static.reset_compiled()  # the count is this test's: no graph an earlier test compiled
    before = _graphs()
    for prompt in (PROMPT, PROMPT[:5], PROMPT):
        compiled = generate_ids(decoder, llama_pair, prompt, 64, compute_perplexity=False,
                                compile=INDUCTOR)
        eager = generate_ids(decoder, llama_pair, prompt, 64, compute_perplexity=False)
        assert compiled.token_ids == eager.token_ids
    assert 1 <= _graphs() - before <= 2 * (4 + 3), _graphs() - before


@torch.inference_mode()
def test_fused_calls_return_and_leave_what_the_separate_calls_do(llama_pair):
    """`StaticRunner.chain` (a draft's loop of forwards with the draw between them) and `then`
    (a forward and the function reading its logits) in one graph call each, once compiled
    (after the generation that met them, `compile_pending`): the same tokens, probabilities,
    cache columns, validity and KV as the separate calls, for 3 rows in a bucket of 4 with a
    ragged first input, after the call ran twice (its untimed warm-up)."""
    from mtad_energy.decoding.runtime.calls import EagerCalls
    from mtad_energy.decoding.runtime.decoder import draft_next, next_token

    g = torch.Generator().manual_seed(0)
    u, u_next = torch.rand(4, 3, 1, generator=g), torch.rand(3, 1, generator=g)
    warp = (1.0, 0, 1.0)
    pending = torch.tensor([[1, 2], [0, 3], [4, 5]])

    def run(fused_role: str):
        runners = [StaticRunner(llama_pair.draft, PhaseTimer("cpu"), role, slots=32,
                                options=TRACE, seqs=3, shape=ForwardShape(max_chain=5))
                   for role in ("separate", fused_role)]  # chains of 4 fuse
        separate, fused = runners
        for r in runners:
            r.prefill(torch.tensor([[5, 9, 11, 3], [0, 7, 21, 2], [0, 0, 4, 8]]), [4, 3, 2])
        a = ModelRunner.chain(separate, EagerCalls(), pending, [2, 1, 2], draft_next, u, *warp)
        b = fused.chain(EagerCalls(), pending, [2, 1, 2], draft_next, u, *warp)
        last = a[0][:, -1:]
        a += (ModelRunner.then(separate, EagerCalls(), last, next_token, u_next, *warp),)
        b += (fused.then(EagerCalls(), last, next_token, u_next, *warp),)
        return runners, a, b

    first, _, _ = run("fused")  # met first: run separately, compiled after the generation
    assert first[1].compile_pending() > 0
    assert {key[3] for key in first[1].cache.warmed if len(key) > 3} == {"forward_chain",
                                                                        "forward_then"}
    (separate, fused), a, b = run("fused")
    assert fused.compile_pending() == 0  # ran fused: nothing left to compile
    assert b[0].shape == (3, 4) and b[1].shape == (3, 4, llama_pair.draft.config.vocab_size)
    assert torch.equal(b[0], a[0]) and torch.equal(b[2], a[2])
    torch.testing.assert_close(b[1], a[1], atol=1e-6, rtol=0)
    assert fused.cols == separate.cols and len(fused) == len(separate) == 4 + 2 + 3 + 1
    assert fused.forwards == separate.forwards and fused.forward_shapes == separate.forward_shapes
    n = len(fused)
    assert torch.equal(fused.cache.valid[:, :n], separate.cache.valid[:, :n])
    valid = fused.cache.valid[:3, :n]  # [3, n]: the real rows' columns
    kv_a, kv_b = (r.cache.kv[:, :3, :, :n] for r in (separate, fused))  # [2 * layers, 3, H, n, D]
    torch.testing.assert_close(kv_b.transpose(2, 3)[:, valid], kv_a.transpose(2, 3)[:, valid],
                               atol=1e-6, rtol=0)
    assert int(fused.cache.start) == int(separate.cache.start)


@pytest.mark.parametrize("stochastic", [False, True])
def test_a_fused_beam_search_returns_and_leaves_what_its_steps_do(llama_pair, stochastic):
    """`StaticRunner.beam_search` of the full draft length in one graph call (`forward_beams`:
    the rows expanded to the beams and reordered inside the graph, and the finished tree read by
    `best_at`): for 3 rows in a bucket of 4 with a ragged first input, W = 3 beams of depth 4,
    the same tree, final beams, cache columns, validity and KV (every beam's row) as the search
    step by step. Beam search (no draws) compares with `ModelRunner.beam_search`; sampled, the
    fused graph draws its uniforms up front for the whole vocabulary, so it compares with its
    own first run (met first: its forwards compiled, its steps eager, the same uniforms)."""
    from mtad_energy.decoding.rules.beam import best_at
    from mtad_energy.decoding.runtime.calls import EagerCalls

    def whole(tokens, parents, log_q, seqs, paths, depth):  # the search's finish: all of it
        return (tokens, parents, log_q, seqs, paths, *best_at(tokens, parents, log_q, depth))

    pending, counts = torch.tensor([[1, 2], [0, 3], [4, 5]]), [2, 1, 2]
    depth = torch.tensor([4, 2, 3])
    warp = (1.0, 0, 1.0, stochastic)

    def run(role: str, fused: bool):
        runner = StaticRunner(llama_pair.draft, PhaseTimer("cpu"), role, slots=32, options=TRACE,
                              seqs=3, shape=ForwardShape(rows_per_seq=3, max_chain=5))
        runner.prefill(torch.tensor([[5, 9, 11, 3], [0, 7, 21, 2], [0, 0, 4, 8]]), [4, 3, 2])
        search = runner.beam_search if fused else partial(ModelRunner.beam_search, runner)
        out = search(EagerCalls(), pending, counts, 4, 3, warp, torch.Generator().manual_seed(0),
                     None, whole, depth)
        return runner, out

    assert run("fused", True)[0].compile_pending() > 0  # met first: compiled after it
    first, ref = run("steps", stochastic)  # sampled: met first (another engine), so unfused
    (fused, out), key = run("fused", True), "forward_beams"
    assert fused.compile_pending() == 0 and any(key in k for k in fused.cache.warmed)
    assert first.cache is not fused.cache
    assert len(out) == 7 and out[0].shape == (3, 4, 3) and out[3].shape == (3, 3, 4)
    for a, b in zip(ref, out, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert fused.cols == first.cols and len(fused) == len(first) == 4 + 2 + 3
    assert fused.width == first.width == 3 and fused.forwards == first.forwards
    assert fused.forward_shapes == first.forward_shapes
    n, rows = len(fused), 3 * 3  # the real sequences' beams
    assert torch.equal(fused.cache.valid[:rows, :n], first.cache.valid[:rows, :n])
    valid = fused.cache.valid[:rows, :n]
    kv_a, kv_b = (r.cache.kv[:, :rows, :, :n] for r in (first, fused))
    torch.testing.assert_close(kv_b.transpose(2, 3)[:, valid], kv_a.transpose(2, 3)[:, valid],
                               atol=1e-6, rtol=0)


def test_a_fused_tree_verify_returns_and_leaves_what_the_separate_calls_do(llama_pair):
    """`StaticRunner.tree_then` (a token tree's forward and the rule reading its logits) in one
    graph call, once compiled: the same result, cache columns, validity and KV as the tree
    forward and the kernel apart (`ModelRunner.tree_then`), for 3 rows in a bucket of 4."""
    from mtad_energy.decoding.runtime.calls import EagerCalls
    from mtad_energy.decoding.runtime.tree import ancestors, depths

    anc = ancestors(torch.tensor([-1, 0, 0, 1, 2]))  # [5, 5]: a root, two children, two more

    def rule(logits, scale):  # a verify's kernel: reads every node's logits
        return logits.softmax(-1).amax(-1) * scale, logits.argmax(-1)

    def run(role: str, fused: bool):
        runner = _three_rows(llama_pair.target, role, ForwardShape(key="tree"))
        call = runner.tree_then if fused else partial(ModelRunner.tree_then, runner)
        return runner, call(EagerCalls(), TREE_IDS, anc, depths(anc), rule, 2.0)

    out, ref = _fused_against_separate(run)
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=0)
    assert torch.equal(out[1], ref[1])


@torch.inference_mode()
@pytest.mark.parametrize("truncated", [False, True])
def test_a_fused_tree_verify_rolls_the_tree_back_on_the_device(llama_pair, truncated):
    """`StaticRunner.verify_tree`: the verify's rule returns the path to keep and the block's
    length, and the graph call moves the first length[b] path nodes of row b to the tree's first
    columns and keeps exactly those valid, as a chain verify leaves its block: the host mirror
    stays exact (the loop's crop cuts what no row holds; nothing is left to compact). Each row's
    valid columns hold, in order, the KV that the tree forward, the rule, `keep_tree` and the
    crop leave apart, for 3 rows in a bucket of 4, also when a row takes less than its block
    (EOS: the crop does the rest)."""
    from mtad_energy.decoding.runtime.calls import EagerCalls
    from mtad_energy.decoding.runtime.tree import ancestors, depths

    anc = ancestors(torch.tensor([-1, 0, 0, 1, 2]))  # [5, 5]: root -> 1 -> 3, root -> 2 -> 4
    paths = torch.tensor([[0, 1, 3], [0, 2, 4], [0, 1, 3]])
    length = torch.tensor([1, 3, 2])  # root only; the whole path; root and one node
    takes = [1, 2, 2] if truncated else [1, 3, 2]  # EOS: row 1 takes 2 of its 3

    def rule(logits, path, n):  # a verify's kernel: (block, accepted, length, path, *handed)
        return logits.argmax(-1)[:, :3], n - 1, n, path, logits.argmax(-1)[:, :3]

    def run(role: str, fused: bool):
        runner = _three_rows(llama_pair.target, role, ForwardShape(key="verify"))
        call = runner.verify_tree if fused else partial(ModelRunner.verify_tree, runner)
        out = call(EagerCalls(), TREE_IDS, anc, depths(anc), rule, paths, length)
        return _crop_taken(runner, takes, length), out

    first, _ = run("fused", True)
    assert first.compile_pending() > 0  # met first: compiled after it
    separate, ref = run("separate", False)
    fused, out = run("fused", True)
    assert fused.compile_pending() == 0
    assert any("forward_tree_verify" in k for k in fused.cache.warmed)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    assert len(out) == 1  # what the host needs only (a CUDA graph's host clones each output)
    prompts = [[0, 1, 2, 3], [1, 2, 3], [2, 3]]  # the prefill's columns, right-aligned
    assert fused.cols == [c + list(range(4, 4 + t)) for c, t in zip(prompts, takes, strict=True)]
    assert len(fused) == 4 + max(takes)  # the tree's other columns cut
    assert fused.row_lengths == separate.row_lengths == [4 + takes[0], 3 + takes[1], 2 + takes[2]]
    valid_a, valid_b = (r.cache.valid[:3, :len(r)] for r in (separate, fused))
    assert valid_b.sum(1).tolist() == fused.row_lengths  # exactly, on the device
    for row in range(3):  # the same KV, in the same order, in fewer columns
        kv_a, kv_b = (r.cache.kv[:, row, :, :len(r)][:, :, v[row]]
                      for r, v in ((separate, valid_a), (fused, valid_b)))
        torch.testing.assert_close(kv_b, kv_a, atol=1e-6, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("truncated", [False, True])
def test_a_fused_chain_verify_rolls_back_on_the_device(llama_pair, truncated):
    """`StaticRunner.verify`: the verify's rule returns the block's length, and the graph call
    keeps the first length[b] of row b's columns (the rest invalid, holes where other rows keep
    more); the loop's crop then has nothing left to do on the device. It leaves the columns,
    validity and KV of the verify and the crop apart, for 3 rows in a bucket of 4, also when a
    row takes less than its block (EOS: the crop does the rest)."""
    from mtad_energy.decoding.runtime.calls import EagerCalls

    length = torch.tensor([1, 4, 2])  # the last token only; every draft; one draft

    def rule(logits, n):  # a verify's kernel: (block, accepted, length, *handed)
        return logits.argmax(-1), n - 1, n, logits.argmax(-1)

    def run(role: str, fused: bool):
        runner = _three_rows(llama_pair.target, role, ForwardShape(max_chain=4))
        call = runner.verify if fused else partial(ModelRunner.verify, runner)
        out = call(EagerCalls(), TREE_IDS[:, :4], rule, length)
        return _crop_taken(runner, [1, 2, 2] if truncated else [1, 4, 2], length), out  # EOS

    _rolled_back(run, "forward_verify", [5, 5, 4] if truncated else [5, 7, 4])


def _crop_taken(runner: StaticRunner, takes: list[int], length: torch.Tensor) -> StaticRunner:
    """The loop's crop after a verify of `_three_rows`: row b took takes[b] tokens of its block
    of length[b] (fewer: EOS cut it)."""
    runner.crop_rows([n + t for n, t in zip([4, 3, 2], takes, strict=True)],
                     kept=length.tolist())
    return runner


def _rolled_back(run, call: str, lengths: list[int]) -> None:
    """A verify fused with its rollback (``call``) and the crop leave what the separate calls and
    the crop leave, return what they return, and the device holds exactly the rows' lengths."""
    out, ref = _fused_against_separate(run, call)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    assert len(out) == 1  # what the host needs only (a CUDA graph's host clones each output)
    fused, _ = run("fused", True)
    assert fused.row_lengths == lengths
    assert fused.cache.valid[:3, :len(fused)].sum(1).tolist() == lengths  # exactly, on the device


@torch.inference_mode()
@pytest.mark.parametrize("without_replacement", [False, True])
def test_a_fused_draft_tree_returns_and_leaves_what_its_levels_do(llama_pair,
                                                                  without_replacement):
    """`StaticRunner.tree_levels` (SpecInfer's draft tree: the first forward, then per level the
    draws and the children's tree forward) in one graph call, once compiled: the same tokens,
    q, cache columns, validity and KV as the levels one by one (`ModelRunner.tree_levels`), for
    3 rows in a bucket of 4 with a ragged first input, branching (2, 2, 2)."""
    from mtad_energy.decoding.decoders.specinfer import draw_level
    from mtad_energy.decoding.runtime.calls import EagerCalls
    from mtad_energy.decoding.runtime.tree import tree_structure

    branching = (2, 2, 2)
    anc = tree_structure(branching, torch.device("cpu"))[0]  # [14, 14]
    vocab = llama_pair.draft.config.vocab_size
    u = torch.rand(3, 1 + 2 + 4, vocab if without_replacement else 2,
                   generator=torch.Generator().manual_seed(0))
    pending, counts = torch.tensor([[1, 2], [0, 3], [4, 5]]), [2, 1, 2]

    def run(role: str, fused: bool):
        runner = _three_rows(llama_pair.draft, role, ForwardShape(max_chain=4))
        call = runner.tree_levels if fused else partial(ModelRunner.tree_levels, runner)
        return runner, call(EagerCalls(), pending, counts, branching, anc, draw_level, u,
                            without_replacement, 1.0, 0, 1.0)

    out, ref = _fused_against_separate(run, "forward_tree_levels")
    assert out[0].shape == (3, 14) and out[1].shape == (3, 7, vocab)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], atol=1e-6, rtol=0)
    runner, _ = run("fused", True)
    assert runner.forwards == 1 + 3  # the prefill, the input, two levels of internal nodes
    assert len(runner) == 4 + 2 + 2 + 4


@torch.inference_mode()
def test_a_fused_head_tree_returns_and_leaves_what_its_expansions_do(llama_pair):
    """`StaticRunner.grow_tree` (EAGLE-2's draft: the head's catch-up with its features, then
    per expansion the head's tree forward of the frontier and `eagle_expand`, the last choosing
    the verified tree) in one graph call, once compiled: the same tree (tokens, parents,
    ancestors, depth), cache columns, validity and KV as the catch-up and the expansions one by
    one (`ModelRunner.grow_tree`), for 3 rows in a bucket of 4 with a ragged catch-up."""
    from mtad_energy.decoding.decoders.eagle import _feature_width, eagle_dynamic
    from mtad_energy.decoding.runtime.calls import EagerCalls

    head = llama_pair.heads["eagle"]
    k, steps, n = 2, 2, 6  # expand 2, 2 expansions, 6 verified nodes
    caps = torch.tensor([3, 2, 3])  # each row's depth cap
    g = torch.Generator().manual_seed(0)
    width = _feature_width(head)
    prompt = torch.rand(3, 4, width, generator=g)  # the target's features of the prompt
    feats = torch.rand(3, 2, width, generator=g)  # ... and of the pairs caught up
    pending, counts = torch.tensor([[1, 2], [0, 3], [4, 5]]), [2, 1, 2]

    def run(role: str, fused: bool):
        runner = StaticRunner(head, PhaseTimer("cpu"), role, slots=32, options=TRACE, seqs=3,
                              shape=ForwardShape(key="grow", max_chain=steps + 2, hidden=(-1,)))
        runner.prefill(torch.tensor([[5, 9, 11, 3], [0, 7, 21, 2], [0, 0, 4, 8]]), [4, 3, 2],
                       features=prompt)
        call = runner.grow_tree if fused else partial(ModelRunner.grow_tree, runner)
        return runner, call(EagerCalls(), pending, counts, feats, (k,) * steps, eagle_dynamic,
                            head.d2t_map, k, steps, caps, n)

    out, ref = _fused_against_separate(run, "forward_grow")
    assert out[0].shape == (3, n) and out[1].shape == (3, 1 + n, 1 + n)  # tokens, ancestors
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    runner, _ = run("fused", True)
    assert runner.forwards == 1 + 1 + steps  # the prefill, the catch-up, the expansions
    assert len(runner) == 4 + 2 + steps * k


TREE_IDS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [3, 3, 2, 2, 1]])  # 3 rows' trees


def _three_rows(model, role: str, shape: ForwardShape) -> StaticRunner:
    """A compiled runner of 3 rows in a bucket of 4, prefilled with prompts of 4, 3 and 2."""
    runner = StaticRunner(model, PhaseTimer("cpu"), role, slots=32, options=TRACE, seqs=3,
                          shape=shape)
    runner.prefill(torch.tensor([[5, 9, 11, 3], [0, 7, 21, 2], [0, 0, 4, 8]]), [4, 3, 2])
    return runner


def _fused_against_separate(run, call: str = "forward_tree_then") -> tuple:
    """``run(role, fused) -> (runner, output)`` for 3 rows: met first, the fused ``call``
    compiles after it; once compiled, it leaves the columns, validity and KV the separate calls
    leave. Returns the fused call's output and the separate calls'."""
    first, _ = run("fused", True)
    assert first.compile_pending() > 0  # met first: compiled after it
    separate, ref = run("separate", False)
    fused, out = run("fused", True)
    assert fused.compile_pending() == 0
    assert any(call in k for k in fused.cache.warmed)
    assert fused.cols == separate.cols and fused.forward_shapes == separate.forward_shapes
    assert fused.forwards == separate.forwards
    n = len(fused)
    assert torch.equal(fused.cache.valid[:3, :n], separate.cache.valid[:3, :n])
    valid = fused.cache.valid[:3, :n]
    kv_a, kv_b = (r.cache.kv[:, :3, :, :n] for r in (separate, fused))
    torch.testing.assert_close(kv_b.transpose(2, 3)[:, valid], kv_a.transpose(2, 3)[:, valid],
                               atol=1e-6, rtol=0)
    return out, ref


def test_a_fused_tree_after_earlier_nodes_hands_the_kernel_the_hidden_states_it_would_get(
        llama_pair):
    """`StaticRunner.tree_then` for a head's expansion (EAGLE-2): K nodes after M earlier ones
    of the same trees, the forward's hidden states handed to the kernel after the logits, in one
    graph call once compiled: what the forward and the kernel apart return and leave (columns,
    validity, KV), for 3 rows in a bucket of 4."""
    from mtad_energy.decoding.runtime.calls import EagerCalls
    from mtad_energy.decoding.runtime.tree import ancestors, depths

    anc = ancestors(torch.tensor([-1, 0, 0, 1, 2]))  # [5, 5]: nodes 0-1 fed first, 2-4 after
    deep = depths(anc)

    def expand(logits, hidden, scale):  # an expansion's kernel: reads logits and features
        return logits.softmax(-1).amax(-1) * scale, hidden.sum(-1), logits.argmax(-1)

    def run(role: str, fused: bool):
        runner = StaticRunner(llama_pair.target, PhaseTimer("cpu"), role, slots=32,
                              options=TRACE, seqs=3,
                              shape=ForwardShape(key="tree-after", hidden=(-1,)))
        runner.prefill(torch.tensor([[5, 9, 11, 3], [0, 7, 21, 2], [0, 0, 4, 8]]), [4, 3, 2])
        ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [3, 3, 2, 2, 1]])
        runner.forward_tree(ids[:, :2], anc[:2, :2], deep[:2])
        call = runner.tree_then if fused else partial(ModelRunner.tree_then, runner)
        return runner, call(EagerCalls(), ids[:, 2:], anc[2:], deep[2:], expand, 2.0)

    out, ref = _fused_against_separate(run)
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-5)
    assert out[1].shape == (3, 3) and torch.equal(out[2], ref[2])
