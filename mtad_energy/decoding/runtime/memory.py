"""What decoding B rows of the project's decoders needs beyond the weights (KV caches and
logits), estimated on the high side before anything is allocated: the batched sweep skips a size
that would not fit the free memory, with the reason, instead of crashing mid-sweep."""

from __future__ import annotations

from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import slots_needed
from mtad_energy.models import ModelPair
from mtad_energy.models.shapes import free_memory_bytes


def kv_bytes_per_token(model) -> int:
    """Bytes one cached token of one row takes in ``model``'s KV cache (all layers)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = next(p.element_size() for p in model.parameters() if p.is_floating_point())
    return cfg.num_hidden_layers * 2 * heads * head_dim * item


def memory_needed_bytes(pair: ModelPair, decoder: Decoder, rows: int, slots: int,
                        compile: bool, max_new_tokens: int | None = None) -> int:
    """An estimate (on the high side) of the memory B rows need beyond the weights: each model's
    KV cache (compiled: rows padded to their bucket, times the rows a sequence expands to, over
    the slot bucket; eager: twice, as a dynamic cache is copied when it grows) and the float32
    logits of the widest forward with their warps."""
    from mtad_energy.decoding.runtime.static_graphs import row_bucket, slot_bucket

    total = 0
    # a chain verifies its effective draft (`Decoder.lookahead_for`) plus one; a tree its nodes
    chain = (decoder.lookahead_for(max_new_tokens) + 1
             if max_new_tokens is not None and decoder.verify_width == decoder.lookahead + 1 else 0)
    draft = decoder.draft_model(pair)  # a draft model, a head with a cache (EAGLE), or none
    roles = [("target", pair.target)] + ([("draft", draft)] if draft is not None
                                         and not getattr(draft, "cacheless", False) else [])
    for role, model in roles:
        r = (row_bucket(rows) if compile else rows) * decoder.cache_rows(role)
        cache = kv_bytes_per_token(model) * r * (slot_bucket(slots) if compile else 2 * slots)
        width = max(decoder.verify_width if not chain else chain, 32)  # trees: wider than deep
        total += cache + 4 * r * width * model.config.vocab_size * 4
    return total


def rows_memory_bytes(pair: ModelPair, decoder: Decoder, rows: list[list[int]],
                      max_new_tokens: int, compile: bool) -> int:
    """`memory_needed_bytes` of decoding ``rows`` (token ids) for ``max_new_tokens``: compiled,
    over the static caches' slots; eager, over what the rows write, with the effective draft
    (`Decoder.lookahead_for`: ``gamma=100000`` with 4 new tokens drafts at most 3)."""
    slots = slots_needed(decoder, [len(r) for r in rows], max_new_tokens)
    if not compile:  # a dynamic cache grows with what the rows write
        slots += decoder.lookahead_for(max_new_tokens) - decoder.lookahead
    return memory_needed_bytes(pair, decoder, len(rows), slots, compile, max_new_tokens)


def does_not_fit(pair: ModelPair, decoder: Decoder, rows: list[list[int]], max_new_tokens: int,
                  compile: bool) -> str | None:
    need = rows_memory_bytes(pair, decoder, rows, max_new_tokens, compile)
    free = free_memory_bytes(pair.describe()["device"])
    if free is None or need <= 0.9 * free:
        return None
    return (f"needs about {need / 2**30:.1f} GiB for its caches and logits at batch size "
            f"{len(rows)}, {free / 2**30:.1f} GiB free")
