"""The compiled path for batches of rows: a static cache of B sequences padded to their bucket,
per-row validity, compaction, widths per decoder, and compilation kept out of every timing.

Traced with ``aot_eager`` (dynamo + AOT autograd, the graph inductor sees) to stay fast on CI;
`test_compile.py` has the inductor checks.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.rules import chain
from mtad_energy.decoding.rules import tree as tree_rules
from mtad_energy.decoding.runtime import batch, static, static_graphs
from mtad_energy.decoding.runtime.batch import RowsRunner
from mtad_energy.decoding.runtime.compiled import CompileOptions, graphs_compiled
from mtad_energy.decoding.runtime.generate import generate_ids, generate_rows
from mtad_energy.decoding.runtime.static import ForwardShape, StaticRunner, reset_compiled
from mtad_energy.decoding.runtime.timer import PhaseTimer
from tests.decoding.lossless import batched_row_pvalues
from tests.tiny import compile_test_decoder, skip_without_head

TRACE = CompileOptions(backend="aot_eager")
PROMPTS = [[5, 9, 11, 3, 7, 21, 2], [4, 8], [30, 31, 32, 33, 34]]  # B = 3: bucket 4, one padding


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_compiled_batched_greedy_rows_are_their_eager_batch_1_outputs(arch, name, request):
    pair = request.getfixturevalue(f"{arch}_pair")
    skip_without_head(name, pair)
    decoder = compile_test_decoder(name, temperature=0)
    rows = generate_rows(decoder, pair, PROMPTS, 20, compute_perplexity=False, compile=TRACE)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        alone = generate_ids(decoder, pair, prompt, 20, compute_perplexity=False)
        assert row.token_ids == alone.token_ids
        assert [s.accepted for s in row.steps] == [s.accepted for s in alone.steps]
    assert rows[0].config["compiled"] == (["target", "draft"] if decoder.draft_model(pair)
                                          is not None else ["target"])


@pytest.mark.parametrize("name", ["spd", "mtad", "specinfer", "mmtad", "spectr", "bild"])
def test_compiled_batched_rows_with_rollback(self_pair, name):
    """The self-draft pair rejects drafts partly: rows hold holes of different sizes."""
    decoder = get_decoder(name, temperature=0)
    rows = generate_rows(decoder, self_pair, PROMPTS, 24, compute_perplexity=False, compile=TRACE)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.token_ids == generate_ids(decoder, self_pair, prompt, 24,
                                             compute_perplexity=False).token_ids


LOSSLESS = [("spd", {"gamma": 3}, chain),
            ("specinfer", {"branching": (2, 2)}, tree_rules)]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "residual-broken"])
@pytest.mark.parametrize(("name", "params", "module"), LOSSLESS, ids=[x[0] for x in LOSSLESS])
def test_compiled_batched_lossless_decoders_are_lossless_per_row(lossless_pair, name, params,
                                                                 module, broken):
    """B = 3 compiled (bucket 4: a padding row rides along): each row's 3-token continuations
    follow its own warped p; with the residual replaced by p they do not."""
    pvalues = batched_row_pvalues(lossless_pair, get_decoder(name, **params), module, broken,
                                  compile=TRACE)
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


@pytest.mark.parametrize("name", ["ar", "beam", "spd", "mtad", "specinfer", "spectr",
                                  pytest.param("mmtad", marks=pytest.mark.slow)])
def test_a_second_identical_call_compiles_nothing(llama_pair, name):
    """Nor do prompts of other lengths in the same slot bucket, batched or not (the inputs are
    dense copies: a slice of the ids buffer would carry the buffer's strides into the guards;
    MTAD's and MMTAD's beam searches take no slice of it: the ids buffer's width is the prompt's
    length plus the new tokens, a new signature for every prompt length)."""
    decoder = get_decoder(name, temperature=0)
    first = generate_ids(decoder, llama_pair, PROMPTS[0], 12, compile=TRACE)
    before = graphs_compiled()
    for prompt in (PROMPTS[0], PROMPTS[1], list(range(2, 32)), PROMPTS[2]):
        again = generate_ids(decoder, llama_pair, prompt, 12, compile=TRACE)
        assert (again.stats.compile_s, again.stats.graphs_compiled) == (0.0, 0)
    assert graphs_compiled() == before
    assert again.stats.decode_time_s > 0 and first.config["compiled"]


@pytest.fixture
def fresh_dynamo():
    """Forget every graph compiled so far: parameters are graph inputs, so a freshly loaded
    model of a config an earlier test compiled would reuse that test's graphs."""
    reset_compiled()


def test_compile_time_is_reported_apart_and_left_out_of_the_timings(model_dirs, fresh_dynamo):
    """A fresh model compiles on its first generation: its seconds are `compile_s`, not decode
    time (iterations still tile the decode phase); the next generation compiles nothing."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft="self:layers=0-0", device="cpu")
    decoder = get_decoder("specinfer", temperature=0)  # its trees compile on first use
    first = generate_ids(decoder, pair, PROMPTS[0], 12, compute_perplexity=False, compile=TRACE)
    second = generate_ids(decoder, pair, PROMPTS[0], 12, compute_perplexity=False, compile=TRACE)
    assert first.stats.compile_s > 0 and second.stats.compile_s == 0.0
    assert first.stats.compile_s > 5 * second.stats.decode_time_s  # compiling dwarfs decoding
    assert first.stats.decode_time_s < first.stats.compile_s
    for gen in (first, second):
        s = gen.stats
        assert s.decode_time_s == pytest.approx(s.time_draft_s + s.time_target_s + s.time_other_s)
        assert sum(st.time_target_s for st in gen.steps) == pytest.approx(s.time_target_s)


@pytest.mark.parametrize("draft", ["self", "self:layers=0-1"])
def test_chain_shapes_that_depend_on_sampled_values_compile_before_the_windows(model_dirs,
                                                                                draft,
                                                                                fresh_dynamo):
    """A catch-up of 2 tokens (after a fully accepted draft), a verify of 2 or a target step of
    1 (the last iterations) happen only on some runs: a fresh pair's first spd generation has
    them compiled when its runners are made, before its windows, so nothing compiles inside,
    whether its drafts are all accepted (the target as its own draft) or partly. Its kernels
    (warp, sampling, the rule) met for the first time run eagerly and compile after the "end"
    hook, outside the windows too."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft=draft, device="cpu")
    before = graphs_compiled()
    windows: list[int] = []
    gen = generate_rows(get_decoder("spd", temperature=0), pair, PROMPTS, 13,
                        compute_perplexity=False, compile=TRACE,
                        on_phase=lambda phase: windows.append(graphs_compiled()))
    assert windows[0] > before  # compiled up front ...
    assert windows[-1] == windows[0] and gen[0].stats.compile_in_window_s == 0  # ... never inside
    # and the call says what compiling cost it: seconds outside its windows, and the graphs
    assert gen[0].stats.graphs_compiled == graphs_compiled() - before > windows[0] - before
    assert gen[0].stats.compile_s > 0
    accepted = {s.accepted for g in gen for s in g.steps if s.draft_depth}
    assert (4 in accepted) if draft == "self" else (accepted & {0, 1, 2, 3})


def test_a_sweep_of_batch_sizes_compiles_a_bounded_number_of_graphs(llama_pair):
    """Sizes 1, 2, 3, 4 and 7 fall into 4 row buckets (3 and 4 share one); per bucket spd
    compiles its target's verify, short verify and one-token step, and its draft's step and
    catch-up: at most 4 x 5 forward graphs; its kernels take each size's own rows (B, not the
    bucket): at most gamma + 3 per size (the target step's sampling, the draft's after 1 or 2
    tokens, the rule per draft length); then none."""
    decoder = get_decoder("spd", temperature=0)
    sizes = (1, 2, 3, 4, 7)
    prompts = [PROMPTS[i % 3] for i in range(max(sizes))]
    before = graphs_compiled()
    for size in sizes:
        generate_rows(decoder, llama_pair, prompts[:size], 10, compute_perplexity=False,
                      compile=TRACE)
    compiled = graphs_compiled() - before
    assert compiled <= 4 * 5 + len(sizes) * (4 + 3), compiled
    for size in sizes:
        generate_rows(decoder, llama_pair, prompts[:size], 10, compute_perplexity=False,
                      compile=TRACE)
    assert graphs_compiled() - before == compiled


def test_dynamic_shapes_reuse_one_graph_across_batch_sizes_and_change_no_token(model_dirs,
                                                                             fresh_dynamo):
    """``CompileOptions(dynamic=None)``: row buckets 1, 2 and 4 compile a few graphs once (a
    size seen twice turns symbolic), fewer than one set per bucket; every row is its eager
    batch-1 self."""
    from mtad_energy.models import load_pair

    decoder = get_decoder("spd", temperature=0)
    prompts = [PROMPTS[i % 3] for i in range(4)]
    counts = {}
    for dynamic in (False, None):
        reset_compiled()
        pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
        options = CompileOptions(backend="eager", dynamic=dynamic)  # symbolic sizes: dynamo's
        before = graphs_compiled()
        for size in (1, 2, 4):
            rows = generate_rows(decoder, pair, prompts[:size], 10, compute_perplexity=False,
                                 compile=options)
            if dynamic is None:
                for prompt, row in zip(prompts[:size], rows, strict=True):
                    alone = generate_ids(decoder, pair, prompt, 10, compute_perplexity=False)
                    assert row.token_ids == alone.token_ids, size
        counts[dynamic] = graphs_compiled() - before
    assert counts[None] < counts[False], counts


def test_each_decoder_pads_only_to_its_own_widths(llama_pair):
    """specinfer's 16-node tree verify runs first in the process; spd's verify afterwards still
    runs at gamma + 1 = 5, not padded to the tree's width."""
    generate_ids(get_decoder("specinfer", temperature=0), llama_pair, PROMPTS[0], 12,
                 compile=TRACE)
    seen: list[tuple[int, int]] = []
    real = static_graphs.StaticGraphs.forward

    def spy(self, cache, args, compiled=True, kwargs=None, call=static_graphs.slot_forward):
        if compiled:
            seen.append(tuple(args[0].shape))
        return real(self, cache, args, compiled, kwargs, call)

    with mock.patch.object(static_graphs.StaticGraphs, "forward", spy):
        generate_ids(get_decoder("spd", temperature=0), llama_pair, PROMPTS[0], 12,
                     compile=TRACE)
    assert {k for _, k in seen} <= {1, 2, 5}, seen
    assert (1, 5) in seen


def _track(monkeypatch, cls) -> list[tuple[int, int]]:
    """Record (cache columns, longest row) after every crop of a runner class."""
    seen: list[tuple[int, int]] = []
    real = cls.crop_rows

    def crop_rows(self, lengths, kept=None):
        real(self, lengths, kept)
        seen.append((len(self), max(self.row_lengths)))
    monkeypatch.setattr(cls, "crop_rows", crop_rows)
    return seen


@pytest.mark.parametrize("name", ["specinfer", "mcss", "mmtad", "spd", "spectr"])
def test_eager_batched_caches_stay_within_a_constant_of_the_longest_row(llama_pair, monkeypatch,
                                                                        name):
    """Tree holes and rejected drafts are reclaimed: the cache never holds more than
    `DEAD_COLUMNS` dead columns past the longest row, plus one iteration's forwards (the
    audit saw 865 columns for a longest row of 46 before compaction)."""
    seen = _track(monkeypatch, RowsRunner)
    decoder = get_decoder(name, temperature=0)
    rows = generate_rows(decoder, llama_pair, PROMPTS, 40, compute_perplexity=False)
    widest = 1 + 28  # specinfer's default tree: the most one iteration appends
    assert seen and all(cols <= longest + batch.DEAD_COLUMNS + widest for cols, longest in seen)
    for prompt, row in zip(PROMPTS, rows, strict=True):  # compaction changed no token
        assert row.token_ids == generate_ids(decoder, llama_pair, prompt, 40).token_ids


@pytest.mark.parametrize(("name", "widest", "compacts"), [("specinfer", 29, False),
                                                          ("mmtad", 17, True), ("spd", 5, True)])
def test_compiled_caches_compact_instead_of_growing(self_pair, monkeypatch, name, widest,
                                                    compacts):
    """A static cache sized for the prompt and the new tokens only (no headroom): the dead
    columns are compacted away before a forward would overflow it, so it never grows, and
    the tokens are the eager ones. SpecInfer's verify moves the kept path to the tree's first
    columns (`slot_forward.forward_tree_verify`): its tree leaves nothing to compact."""
    monkeypatch.setattr(static_graphs, "MIN_SLOTS", 1)

    class Tight(StaticRunner):
        def __init__(self, model, timer, phase, slots, options=None, seqs=1, shape=None):
            need = max(map(len, PROMPTS)) + 40 + widest  # prompt, new tokens, widest forward
            super().__init__(model, timer, phase, need, options, seqs, shape)

    monkeypatch.setattr(static, "StaticRunner", Tight)
    compacted = []
    monkeypatch.setattr(Tight, "compact", lambda self: (compacted.append(len(self)),
                                                        StaticRunner.compact(self)))
    grown = mock.patch.object(static_graphs.StaticGraphs, "grow", side_effect=AssertionError("grew"))
    decoder = get_decoder(name, temperature=0)
    with grown:
        rows = generate_rows(decoder, self_pair, PROMPTS, 40, compute_perplexity=False,
                             compile=TRACE)
    assert bool(compacted) == compacts  # it had to compact, or found its columns exact
    for prompt, row in zip(PROMPTS, rows, strict=True):
        assert row.token_ids == generate_ids(decoder, self_pair, prompt, 40).token_ids


@torch.inference_mode()
def test_static_rows_runner_follows_the_eager_rows_runner_op_by_op(llama_pair):
    """Left padding, a ragged catch-up, per-row rollback, beam rows, a tree with a kept path
    and a compaction: the bucketed static runner (3 sequences in a bucket of 4) gives the eager
    rows runner's logits at every step."""
    model = llama_pair.target
    eager = RowsRunner(model, PhaseTimer("cpu"), "target", 3)
    comp = StaticRunner(model, PhaseTimer("cpu"), "target", 64, TRACE, seqs=3,
                        shape=ForwardShape(rows_per_seq=2, max_chain=4))
    width = max(map(len, PROMPTS))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])

    def both(fn):
        a, b = fn(eager), fn(comp)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert comp.row_lengths == eager.row_lengths

    counts = [len(p) for p in PROMPTS]
    both(lambda r: r.prefill(padded, counts))
    both(lambda r: r(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])))  # padded to width 4
    keep = [n - d for n, d in zip(eager.row_lengths, (2, 0, 3), strict=True)]
    both(lambda r: (r.crop_rows(keep), r(torch.tensor([[10, 11], [0, 12], [13, 14]]),
                                         [2, 1, 2]))[1])
    both(lambda r: (r.repeat_rows(2), r(torch.tensor([[3], [4], [5], [6], [7], [8]])))[1])
    both(lambda r: (r.select_rows(torch.tensor([1, 1, 2, 3, 5, 4])),
                    r(torch.tensor([[3], [4], [5], [6], [7], [8]])))[1])
    both(lambda r: (r.select_rows(torch.tensor([0, 3, 4])), r(torch.tensor([[1], [2], [3]])))[1])
    from mtad_energy.decoding.runtime.tree import ancestors, level_parents, tree_forward

    anc = ancestors(torch.cat([torch.tensor([-1]), level_parents((2, 2)) + 1]))  # root + 6
    nodes = torch.arange(20, 27).repeat(3, 1)
    both(lambda r: tree_forward(r, nodes, anc))
    path = torch.tensor([[0, 1, 3], [0, 2, 5], [0, 1, 4]])
    both(lambda r: (r.keep_tree(7, path), r(torch.tensor([[1], [2], [3]])))[1])
    comp.compact()  # packs the holes away: the next logits are unchanged
    assert len(comp) == max(comp.row_lengths)
    both(lambda r: r(torch.tensor([[4], [5], [6]])))
