"""Host work per decode iteration is behaviour, held to budgets (docs/design.md section 7).

On a GPU every host read of a device value (``.item()``, ``int(t)``, ``if t:``, a 0-d tensor as an
index, ``nonzero``, a boolean mask, ``.tolist()``) stalls the host until the device is done, and
every aten op dispatched outside a compiled graph costs ~6-8 us of host time. Both are counted
here by the tool's own counter (`measure.host_work`), which sees the same calls on the CPU:

* exactly one host read per iteration, the loop's read-back (`host_reads.READ_BACK`; the GPU
  test in ``test_phase_timer.py`` finds its CUDA sync at the same place), eager and compiled;
* compiled, aten ops outside graphs (the clones of CUDA-graph outputs a GPU host makes among
  them), the clones alone and graph calls per iteration within each decoder's budget, at B = 1
  and 8, and not growing with the model's layer count.
"""

from __future__ import annotations

import pytest

from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.engines.hf import counted_generation
from mtad_energy.measure.host_work import HostWorkSites, is_host_read
from tests.decoding.host_reads import site_at_read_back
from tests.tiny import skip_without_head

# dynamo's graphs run as aten calls (paused from the count): what the host dispatches outside
# them is the same as under inductor, in seconds instead of minutes
TRACE = CompileOptions(backend="eager")
PROMPT = [5, 6, 7, 8, 9]

# compiled, per iteration, at B = 1 and 8 (this tiny pair; experiments/host_work.py has every
# decoder at the 32 / 16 layers of the 8B / 1B pair: docs/findings/host-time.md): aten ops outside
# compiled graphs, the clones among them, and compiled calls. Every decoder keeps its warp,
# sampling and rule in kernels (`decoding.runtime.calls`) and its cache moves in one op for every
# layer; a forward and the kernel reading it are one call (`ModelRunner.then`, `tree_then`), and so
# are a draft chain (`chain`), a beam search with what reads its tree (`beam_search`), a draft tree
# level by level (`tree_levels`), EAGLE's catch-up with the tree it grows (`grow_tree`) and Medusa's
# heads with their candidates (`HeadRunner.then`); a verify rolls the target back inside its call
# (`verify`, `verify_tree`). A full iteration is 1 graph call for ar and pld, 2 for the others;
# BiLD reads after every draft token whether to go on (its algorithm): a call per draft forward.
# The last, shorter iterations (and pld's shorter drafts) are not fused, which 16 tokens show in
# the averages. On a GPU each tensor a CUDA-graph call returns is cloned on the host
# (`graph_call.graph_outputs`): counted here as the ops they are there. So a call returns only
# what the host needs: a verify its read-back packed with its counts and the rows' last tokens
# (`step.block_out`, `StepResult.from_read`; MTAD and MMTAD the beam to keep, the heads their next
# features), a beam search what its `finish` reads (MMTAD's tree, ancestors, parents and beams
# packed, log q), EAGLE's grown tree its tokens, ancestors and parents packed with its depth (a
# tree of every depth one call), ar's draw its token, typical's chain no q; a move of a runner's
# rows (keeping MTAD's beam, a beam search's reorder) is one graph call returning nothing, where
# it was six ops. What is left outside the graphs is mostly the uniforms, the write positions,
# the draft's holes at B > 1 and the read-back itself. The budgets are what each does now, a
# little over, so an op or a clone that comes back fails them (the targets, ar <= 10,
# chains <= 25, trees <= 50 ops at the 32 / 16 layers and 32 tokens of experiments/host_work.py,
# hold there for every decoder at B = 1 and 8; this 16-token run averages in more of a
# generation's last iterations); beam and mtjd (whole-output beam searches) are not in those
# targets: a step of theirs is a forward and its row move, two graph calls.
OPS_BUDGET = {"ar": 10, "spd": 34, "typical": 28, "pld": 15, "bild": 25, "mtad": 31,
              "beam": 215, "mtjd": 90, "mcss": 40, "spectr": 42, "specinfer": 38,
              "mmtad": 28, "eagle": 33, "medusa": 20}
# of those ops, the clones of CUDA-graph outputs (a GPU host's; at least one: every iteration
# runs a graph): one to three per graph call that returns any
CLONES_BUDGET = {"ar": 1, "spd": 4, "typical": 3, "pld": 2, "bild": 4, "mtad": 5,
                 "beam": 16, "mtjd": 4, "mcss": 4, "spectr": 4, "specinfer": 4, "mmtad": 6,
                 "eagle": 6, "medusa": 4}
GRAPHS_BUDGET = {"ar": 1, "spd": 4, "typical": 3, "pld": 2, "bild": 2, "mtad": 4,
                 "beam": 66, "mtjd": 18, "mcss": 3, "spectr": 4, "specinfer": 3, "mmtad": 4,
                 "eagle": 3, "medusa": 2}


def _count(pair, name: str, rows: int, compile, tokens: int = 16):
    decoder = get_decoder(name, top_k=0, top_p=1.0)
    prompts = [PROMPT + [1] * b for b in range(rows)]  # rows of different lengths
    if compile:  # compiles every shape first (a counted pass never compiles: nothing to pause)
        counted_generation(decoder, pair, prompts, tokens, compile=compile)
    counter = HostWorkSites()
    gens, work = counted_generation(decoder, pair, prompts, tokens, compile=compile,
                                    counter=counter)
    return gens, work, counter


def _report(counter: HostWorkSites, iterations: int, n: int = 12) -> str:
    return "\n".join(f"  {c / iterations:7.2f} x {site}" for site, c in
                     counter.sites.most_common(n))


def test_the_counter_classifies_host_reads():
    import torch

    ops = torch.ops.aten
    assert is_host_read(ops._local_scalar_dense.default, (torch.tensor(1),))
    assert is_host_read(ops.nonzero.default, (torch.tensor([1]),))
    mask = torch.tensor([True, False])
    assert is_host_read(ops.index.Tensor, (torch.arange(2), [mask]))
    assert not is_host_read(ops.index.Tensor, (torch.arange(2), [torch.tensor([0])]))
    assert not is_host_read(ops.add.Tensor, (torch.tensor(1), torch.tensor(2)))


def test_the_counter_counts_ops_reads_and_pauses_inside_graph_calls():
    import torch

    from mtad_energy.decoding.runtime.graph_call import GraphFunction
    from mtad_energy.measure.host_work import HostWorkCounter

    inner = GraphFunction(lambda x: (x + 1).mul(2).sum())  # three ops, not counted: one call
    counter = HostWorkCounter()
    x = torch.ones(3)
    with counter.counting():
        y = (x * 2).sum()
        inner(x)
        y.item()
        x.tolist()
    assert (counter.ops, counter.graph_calls) == (3, 1)  # mul, sum, _local_scalar_dense
    assert counter.reads == 2  # item, tolist
    assert counter.result(2).columns() == {"host_ops_per_iter": 1.5, "host_reads_per_iter": 1.0,
                                           "graph_calls_per_iter": 0.5}


@pytest.mark.parametrize("made", [False, True])
def test_the_counter_counts_a_cuda_graph_calls_clones(made):
    """A CUDA-graph call's host clones each tensor it returns (its next replay overwrites them):
    one op per tensor output, counted whether this host makes them (``made``: dispatched, so
    counted as the ops they are) or not (the CPU records no graphs: counted as a GPU's host
    makes them); a call that is no CUDA graph (a kernel) returns its outputs as they are."""
    import torch

    from mtad_energy.decoding.runtime.graph_call import GraphFunction
    from mtad_energy.measure.host_work import HostWorkCounter

    x = torch.ones(3)
    graph = GraphFunction(lambda x: (x + 1, x * 2, 7), graph=True, clone=made)
    kernel = GraphFunction(lambda x: (x + 1, x * 2))
    counter = HostWorkCounter()
    with counter.counting():
        a, b, c = graph(x)
        kernel(x)
    assert (counter.graph_calls, counter.clones, counter.ops) == (2, 2, 2)  # two tensors
    assert counter.result(2).clones_per_iter == 1.0
    assert c == 7 and a.tolist() == [2.0] * 3 and b.tolist() == [2.0] * 3
    assert (GraphFunction(lambda t: t, graph=True, clone=made)(x) is x) != made  # made: a copy


def test_a_read_only_the_cpu_path_makes_is_counted_apart():
    """A shortcut that reads CPU tensors where that is free (`rules.counted.cpu_only`) is not a
    read a GPU makes: counted in ``cpu_only_reads``, not in the reads per iteration."""
    import torch

    from mtad_energy.decoding.rules.counted import cpu_only
    from mtad_energy.measure.host_work import HostWorkCounter

    counter, x = HostWorkCounter(), torch.ones(3)
    assert cpu_only(lambda: int(x.sum())) == 3  # no counter: a plain call
    with counter.counting():
        assert cpu_only(lambda: bool((x > 0).all()))
        x.sum().item()
    assert (counter.reads, counter.cpu_only_reads) == (1, 1)
    assert counter.ops >= 4  # gt, all, sum and both reads' ops: still the host's ops


@pytest.mark.parametrize("name", ["ar", "specinfer", "spectr"])
def test_the_default_warp_reads_once_per_iteration(llama_pair, name):
    """With the default warp (top-k 10) on the CPU, the warp's and Spectr's CPU-only shortcuts
    read values (free here; a GPU takes the other path): those reads are counted apart, and the
    reads per iteration are the loop's read-back alone, as on a GPU."""
    decoder = get_decoder(name)  # temperature 1, top_k 10, top_p 0.9
    counter = HostWorkSites()
    gens, work = counted_generation(decoder, llama_pair, [PROMPT], 8, counter=counter)
    _check_reads(name, gens, work, counter)
    assert work.cpu_only_reads > 0  # the shortcut ran, and was set apart


def _check_reads(name: str, gens, work, counter: HostWorkSites) -> None:
    """Exactly one host read per iteration, at the loop's read-back (BiLD: plus its own)."""
    iterations = max(g.stats.iterations for g in gens)
    elsewhere = {s: n for s, n in counter.read_sites.items() if not site_at_read_back(s)}
    if name == "bild":  # BiLD decides after every draft token whether to go on drafting: one
        # read of max ~q per draft token is its algorithm, not bookkeeping (and nothing else)
        assert all("bild.py" in s for s in elsewhere), elsewhere
        assert sum(elsewhere.values()) <= max(g.stats.draft_forwards for g in gens)
    else:
        assert not elsewhere, f"{name}: host reads besides the read-back: {elsewhere}"
    assert work.reads - sum(elsewhere.values()) == iterations


@pytest.mark.parametrize("name", list(DECODERS))
def test_one_host_read_per_iteration_eager(llama_pair, name):
    # top_k=0: the eager warp's CPU-only shortcut (which reads the device where that is free)
    # and Spectr's rho shortcut stay out of the count
    skip_without_head(name, llama_pair)
    _check_reads(name, *_count(llama_pair, name, 1, False))


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("name", list(DECODERS))
def test_compiled_host_work_within_budget(llama_pair, name, rows):
    """Compiled: one host read per iteration too, and the op (clones counted), clone and
    graph-call budgets."""
    if rows > 1 and not DECODERS[name].batched:
        pytest.skip(f"{name} decodes one sequence")
    skip_without_head(name, llama_pair)
    gens, work, counter = _count(llama_pair, name, rows, TRACE)
    _check_reads(name, gens, work, counter)
    per = work.columns()
    print("COUNT", name, rows, per, work.clones_per_iter)
    assert per["host_ops_per_iter"] <= OPS_BUDGET[name], (
        f"{name} B={rows}: {per['host_ops_per_iter']:.1f} ops per iteration outside compiled "
        f"graphs, budget {OPS_BUDGET[name]}; by place:\n{_report(counter, work.iterations)}")
    assert per["graph_calls_per_iter"] <= GRAPHS_BUDGET[name]
    assert 0 < work.clones_per_iter <= CLONES_BUDGET[name], (
        f"{name} B={rows}: {work.clones_per_iter:.1f} clones of CUDA-graph outputs per "
        f"iteration, budget {CLONES_BUDGET[name]}")


def _deepened(model, extra: int):
    """``model`` with ``extra`` more decoder layers that add nothing to the residual stream (their
    output projections zero): the same logits, so the same tokens and iterations, more layers."""
    from transformers import LlamaForCausalLM

    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] += extra
    deep = LlamaForCausalLM(type(model.config).from_dict(cfg)).eval().requires_grad_(False)
    deep.load_state_dict(model.state_dict(), strict=False)
    for layer in deep.model.layers[-extra:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return deep


@pytest.mark.parametrize("name", ["ar", "spd", "mtad"])
def test_compiled_host_work_does_not_grow_with_layers(llama_pair, name):
    """Per-layer cache bookkeeping (a copy per layer per buffer) is what made mtad's host work
    grow with the model: the same decoder on a pair with 2 more layers in the target and in the
    draft (layers that change no logit: the same tokens, the same iterations) dispatches exactly
    the same ops."""
    from mtad_energy.models import ModelPair

    deep = ModelPair(_deepened(llama_pair.target, 2), _deepened(llama_pair.draft, 2),
                     llama_pair.tokenizer, name="deep")
    (shallow_gen, shallow, _), (deep_gen, deeper, _) = (_count(pair, name, 1, TRACE)
                                                         for pair in (llama_pair, deep))
    assert deep_gen[0].token_ids == shallow_gen[0].token_ids  # the layers change nothing ...
    assert (deeper.ops, deeper.graph_calls, deeper.iterations) == (
        shallow.ops, shallow.graph_calls, shallow.iterations)  # ... and cost the host nothing


def test_a_kernel_that_cannot_compile_runs_eagerly_with_a_warning():
    """A compiler bug (inductor in torch 2.11 on CUDA refused one of spd's kernels on an H200)
    must not stop a run: the kernel warns once, by name, and runs eagerly from then on, its
    ops counted outside graphs as they are."""
    import torch

    from mtad_energy.decoding.runtime.compiled import CompiledCalls
    from mtad_energy.measure.host_work import HostWorkCounter

    def reads_the_host(x: torch.Tensor) -> torch.Tensor:  # a graph break: fullgraph refuses
        y = x * 3
        torch._dynamo.graph_break()
        return y

    calls = CompiledCalls(TRACE)
    x = torch.ones(3)
    assert calls(reads_the_host, x).tolist() == [3.0] * 3  # first meeting: eager
    with pytest.warns(UserWarning, match="reads_the_host failed to compile.*runs eagerly"):
        calls.compile_pending()
    counter = HostWorkCounter()
    with counter.counting():
        assert calls(reads_the_host, x).tolist() == [3.0] * 3
    assert counter.graph_calls == 0 and counter.ops == 1  # eager: its one op counted


@pytest.mark.parametrize("name", ["ar", "spd"])
def test_a_fused_call_met_first_counts_as_the_call_it_will_be(model_dirs, name):
    """The runners count their warm-up generation (`engines.hf.counted_generation`), where each fused call
    (`ModelRunner.then` / `chain`) is met for the first time: it runs with its forwards compiled
    and the kernels between them eagerly, and compiles after the generation. The counter sees it
    as the one graph call it will be, so the warm-up counts what every later generation does."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft="self:layers=0-0", device="cpu")
    decoder = get_decoder(name, top_k=0, top_p=1.0)
    prompts = [PROMPT, PROMPT + [1]]
    first, second = (counted_generation(decoder, pair, prompts, 12, compile=TRACE)
                     for _ in range(2))
    assert first[0][0].stats.compile_s > 0
    assert second[0][0].stats.compile_s == 0  # the fused graphs compiled after the first
    assert first[1].columns() == second[1].columns()
    assert second[1].columns()["graph_calls_per_iter"] <= GRAPHS_BUDGET[name]
