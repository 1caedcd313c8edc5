"""The FLOP / byte counting rule (`mtad_energy.energy.work`) against two independent counts: the
profiler's FLOPs per aten op (`profile_ops`) and the simulated device's tap, which reads the bytes
off the tensors a forward touches (parameters, KV cache before and after, logits). Every decoder's
per-iteration counts from the loop must add up to what the tap saw."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.runtime.cache import new_cache
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.energy.tap import WorkTap
from mtad_energy.energy.work import HeadDims, ModelDims, Work, dims_of, forward_work, shapes_work
from mtad_energy.hf_cache import cache_kwargs
from mtad_energy.measure import DevicePeaks, profile_ops
from tests import tiny

PEAKS = DevicePeaks("cpu:test", peak_flops_per_s=1e11, peak_bytes_per_s=1e10, dtype="float32")
MATRIX_OPS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "scaled_dot_product_attention",
              "_scaled_dot_product_flash_attention_for_cpu"}
VOCAB = 64


def _mistral() -> MistralForCausalLM:
    torch.manual_seed(3)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                        max_position_embeddings=256)
    return MistralForCausalLM(cfg).eval().requires_grad_(False)


def _qwen2() -> Qwen2ForCausalLM:  # q/k/v biases, tied embeddings
    torch.manual_seed(4)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


MODELS = {
    "llama": lambda: tiny.llama(VOCAB, 0, layers=3),  # grouped-query attention (4 heads, 2 KV)
    "opt": lambda: tiny.opt(VOCAB, 0, layers=2),  # biases, LayerNorms, learned positions
    "mistral": _mistral,
    "qwen2": _qwen2,
}
# (rows, new tokens) of consecutive forwards over one cache: prefill, decode steps, a 4-token
# verify (a chain, or a token tree under a 4-D mask)
FORWARDS = ((2, 5), (2, 1), (2, 4), (2, 1))


def _tree_mask(cached: int, new: int, dtype: torch.dtype) -> torch.Tensor:
    allowed = torch.ones(new, cached + new, dtype=torch.bool)
    allowed[:, cached:] = torch.eye(new, dtype=torch.bool)  # every node on the prefix alone
    allowed[:, cached] = True
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_equal_the_profilers_matrix_and_attention_flops(name):
    model = MODELS[name]()
    dims = ModelDims.from_model(model)
    cache = new_cache(model)
    cached = 0
    for i, (rows, new) in enumerate(FORWARDS):
        ids = torch.randint(0, VOCAB, (rows, new))
        kwargs = {}
        if i == 2:  # a token tree: 4-D additive mask and explicit positions
            kwargs = {"attention_mask": _tree_mask(cached, new, torch.float32).expand(rows, 1, -1, -1),
                      "position_ids": torch.full((rows, new), cached) + (torch.arange(new) > 0)}
        with torch.inference_mode():
            prof = profile_ops(lambda ids=ids, kw=kwargs: model(
                input_ids=ids, **cache_kwargs(cache), use_cache=True, **kw), peaks=PEAKS)
        counted = sum(op.flops for op in prof.ops if op.name in MATRIX_OPS)
        assert forward_work(dims, rows, new, cached + new).flops == counted, (name, i)
        cached += new


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bytes_equal_what_the_tensors_of_each_forward_hold(name):
    model = MODELS[name]()
    dims = ModelDims.from_model(model)
    seen: list[tuple[int, int]] = []
    tap = WorkTap(lambda flops, nbytes: seen.append((flops, nbytes)))
    cache = new_cache(model)
    expected, cached = [], 0
    with torch.inference_mode(), tap.attached(model):
        for rows, new in FORWARDS:
            model(input_ids=torch.randint(0, VOCAB, (rows, new)), **cache_kwargs(cache), use_cache=True)
            w = forward_work(dims, rows, new, cached + new)
            expected.append((w.flops, w.bytes))
            cached += new
    assert seen == expected


def test_a_static_cache_is_written_in_place_and_attended_whole():
    model = MODELS["llama"]()
    dims = ModelDims.from_model(model)
    seen: list[tuple[int, int]] = []
    slots = 32
    cache = StaticCache(config=model.config, max_cache_len=slots)
    with torch.inference_mode():  # the first update allocates the slots (not a forward's work)
        model(input_ids=torch.randint(0, VOCAB, (1, 6)), **cache_kwargs(cache), use_cache=True,
              cache_position=torch.arange(6))
        with WorkTap(lambda f, b: seen.append((f, b))).attached(model):
            for start, n in ((6, 4), (10, 1)):
                model(input_ids=torch.randint(0, VOCAB, (1, n)), **cache_kwargs(cache),
                      use_cache=True, cache_position=torch.arange(start, start + n))
    static = [forward_work(dims, 1, n, slots, concat_cache=False) for n in (4, 1)]
    assert [b for _, b in seen] == [w.bytes for w in static]
    # a DynamicCache copies itself per forward: the same forward moves more KV bytes
    dynamic = forward_work(dims, 1, 1, 11)
    assert dynamic.kv_write_bytes == 11 * dims.kv_bytes_per_column(1) > static[1].kv_write_bytes


def test_weights_are_read_once_per_forward_not_per_row():
    dims = ModelDims.from_model(MODELS["llama"]())
    one, many = forward_work(dims, 1, 1, 9), forward_work(dims, 64, 1, 9)
    gathered = 63 * dims.embed_dim * dims.elem_bytes  # one embedding row per extra token
    assert many.weight_bytes - one.weight_bytes == gathered
    assert many.kv_read_bytes == 64 * one.kv_read_bytes and many.flops > 60 * one.flops


def _head(kind: str):
    """A random head on the tiny Llama (hidden 32, 4 heads over 2 KV heads, 64 tokens)."""
    from mtad_energy.models.heads import random_eagle, random_medusa

    target = MODELS["llama"]()
    if kind == "medusa":
        return random_medusa(target, heads=3)
    return random_eagle(target, version=int(kind[-1]), draft_vocab=24 if kind == "eagle-3" else None)


@pytest.mark.parametrize("kind", ["eagle-1", "eagle-3", "medusa"])
def test_a_heads_forwards_count_what_the_tap_sees(kind):
    """EAGLE's forwards over its own cache (prefill pairs, a catch-up, a token tree fed its own
    features) and Medusa's calls, as a runner records them: FLOPs and bytes equal the tap's,
    EAGLE-3's fusion layer counted only on the forwards fed the target's 3H-wide features."""
    from mtad_energy.decoding.runtime.head_runner import HeadRunner
    from mtad_energy.decoding.runtime.runner import ModelRunner
    from mtad_energy.decoding.runtime.timer import PhaseTimer

    head = _head(kind)
    dims = dims_of(head)
    assert isinstance(dims, HeadDims) and dims.kind == kind
    seen: list[tuple[int, int]] = []
    hidden = 32
    torch.manual_seed(0)
    with torch.inference_mode(), WorkTap(lambda f, b: seen.append((f, b))).attached(head):
        if kind == "medusa":
            runner = HeadRunner(head, PhaseTimer("cpu"), "draft", rows=2)
            for _ in range(2):
                runner(torch.randn(2, hidden))
        else:
            runner = ModelRunner(head, PhaseTimer("cpu"), "draft", hidden=(-1,))
            target_width = 3 * hidden if kind == "eagle-3" else hidden
            runner.prefill(torch.randint(0, VOCAB, (2, 4)), features=torch.randn(2, 4, target_width))
            runner(torch.randint(0, VOCAB, (2, 2)), features=torch.randn(2, 2, target_width))
            anc = torch.ones(3, 3, dtype=torch.bool).tril()  # a chain of 3 nodes fed its own
            runner.forward_tree(torch.randint(0, VOCAB, (2, 3)), anc, torch.arange(1, 4),
                                torch.randn(2, 3, hidden))
    counted = [forward_work(dims, *f[:3], concat_cache=True, features=f[3])
               for f in runner.forward_shapes]
    assert [(w.flops, w.bytes) for w in counted] == seen
    assert shapes_work(dims, runner.forward_shapes) == sum(counted, Work())
    if kind == "eagle-3":  # a forward fed the head's own features neither runs nor reads fc
        rows, new, cols, width = runner.forward_shapes[1]
        own = forward_work(dims, rows, new, cols, features=hidden)
        fc = head.fc.weight.numel()
        assert counted[1].flops - own.flops == 2 * rows * new * fc
        assert counted[1].weight_bytes - own.weight_bytes == fc * head.fc.weight.element_size()


@pytest.mark.parametrize("decoder", ["ar", "spd", "mtad", "specinfer", "spectr", "beam",
                                     "eagle", "medusa"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_loop_counts_every_forward_it_runs(llama_pair, decoder, rows):
    """Per-iteration draft / target counts plus the prefill add up to the tapped work of the
    whole generation: tree verifies, beam rows, padded rows and catch-up drafts included."""
    seen = [0, 0]

    def add(flops: int, nbytes: int) -> None:
        seen[0] += flops
        seen[1] += nbytes

    prompts = [[5, 6, 7, 8, 9], [5, 6, 7], [10, 11, 12, 13]][:rows]
    with WorkTap(add).attached(llama_pair.target, llama_pair.draft, *llama_pair.heads.values()):
        gens = generate_rows(get_decoder(decoder), llama_pair, prompts, 10, seed=0,
                             compute_perplexity=False)
    last = max(gens, key=lambda g: g.stats.iterations)  # its iterations are the batch's
    s = last.stats
    assert (s.prefill_flops + s.draft_flops + s.target_flops,
            s.prefill_bytes + s.draft_bytes + s.target_bytes) == tuple(seen)
    assert sum(st.target_flops for st in last.steps) == s.target_flops
    assert sum(st.draft_bytes for st in last.steps) == s.draft_bytes
    if decoder in ("ar", "beam"):
        assert s.draft_flops == 0 and all(st.draft_flops == 0 for st in last.steps)
    else:
        assert all(st.draft_flops > 0 for st in last.steps if st.draft_depth)


def test_unsupported_model_types_are_refused_by_name():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="supports model types llama, mistral, qwen2, opt, not 'gpt2'"):
        ModelDims.from_config(GPT2Config())


def test_shapes_work_adds_forwards_and_bad_shapes_are_errors():
    dims = ModelDims.from_model(MODELS["opt"]())
    total = shapes_work(dims, [(1, 4, 4), (1, 1, 5)])
    assert total == forward_work(dims, 1, 4, 4) + forward_work(dims, 1, 1, 5)
    assert total.bytes == sum(getattr(total, f) for f in ("weight_bytes", "kv_read_bytes",
                                                         "kv_write_bytes", "logits_bytes"))
    assert shapes_work(dims, []) == Work()
    with pytest.raises(ValueError, match="kv_columns >= new"):
        forward_work(dims, 1, 4, 3)


def test_compiled_and_row_by_row_runs_count_their_work(llama_pair, int8_pair):
    """The compiled runner counts what it runs (3 rows padded to 4, attention over all of the
    static cache's slots: more than the eager batch, never None); the int8 draft's row-by-row
    forwards are counted one by one."""
    from mtad_energy.decoding.runtime.compiled import CompileOptions

    prompts = [[5, 6, 7, 8, 9], [5, 6, 7], [10, 11, 12, 13]]
    dec = get_decoder("spd", temperature=0)
    eager = generate_rows(dec, llama_pair, prompts, 10, compute_perplexity=False)
    compiled = generate_rows(dec, llama_pair, prompts, 10, compute_perplexity=False,
                             compile=CompileOptions(backend="aot_eager"))
    e, c = eager[0].stats, compiled[0].stats
    assert c.target_flops is not None and c.target_flops > e.target_flops
    assert c.draft_bytes > e.draft_bytes
    row_wise = generate_rows(dec, int8_pair, prompts, 10, compute_perplexity=False)
    alone = [generate_rows(dec, int8_pair, [p], 10, compute_perplexity=False)[0] for p in prompts]
    assert row_wise[0].config["per_row"] == ["draft"]
    # the batch's draft forwards are the three rows' own: their work adds up (prefill included)
    assert row_wise[0].stats.prefill_flops > max(a.stats.prefill_flops for a in alone)
    assert all(st.draft_flops > 0 for st in row_wise[0].steps if st.draft_depth)
