"""Self-drafts: a draft built from the target itself, as ``draft="self..."`` names it
(`self_draft`): the target as it is (``self``), a dynamically int8-quantised copy of its Linear
layers (``self:int8``, CPU only: `int8_draft`), or a model running only some of its layers and
sharing their weight tensors (``self:layers=0-11``, ``self:skip=every4``: `layer_subset`).
`pair.load_pair` builds them; which one the default pair uses on which device is `pair`'s.
"""

from __future__ import annotations

import copy
import re
import warnings

import torch


def _layer_ranges(text: str) -> list[tuple[int, int]] | int:
    """The form of a layer list, before the target is known: '0-3,7' -> [(0, 3), (7, 7)];
    'every4' -> 4; '' -> [] (``self:skip=``: skip none). Raises ValueError naming what is wrong:
    not a list, a range written backwards, or 'every0' (which divides by zero)."""
    if m := re.fullmatch(r"every(\d+)", text):
        k = int(m.group(1))
        if k < 1:
            raise ValueError(f"{text!r} names every 0th layer, which divides by zero: use every K "
                             "with K >= 1 (every4: layers 3, 7, 11, ...)")
        return k
    ranges: list[tuple[int, int]] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(f"bad layer list {text!r}: use e.g. '0-11,20' or 'every4'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"layer range {part.strip()!r} runs backwards: write LOW-HIGH, e.g. "
                             f"'{hi}-{lo}'")
        ranges.append((lo, hi))
    return ranges


def _parse_layers(text: str, n_layers: int) -> list[int]:
    """'0-3,7,9' -> [0, 1, 2, 3, 7, 9]; 'every4' -> 3, 7, 11, ... (for skip lists)."""
    form = _layer_ranges(text)
    if isinstance(form, int):
        return [i for i in range(n_layers) if (i + 1) % form == 0]
    out: list[int] = []
    for lo, hi in form:
        out.extend(range(lo, hi + 1))
    bad = [i for i in out if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the target has layers 0..{n_layers - 1}")
    return sorted(set(out))


def layer_subset(target, keep: list[int]):
    """A draft that runs only the target layers in ``keep``, sharing the target's weight tensors
    (no copy): the model is built on the meta device and the target's tensors are assigned."""
    from transformers import AutoModelForCausalLM

    if not keep:
        raise ValueError("a layer-subset self-draft must keep at least one layer")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    new_index = {old: new for new, old in enumerate(keep)}

    def renamed(items):
        for name, tensor in items:
            m = re.search(r"\.layers\.(\d+)\.", name)
            if m is None:
                yield name, tensor
            elif int(m.group(1)) in new_index:
                j = new_index[int(m.group(1))]
                yield name[:m.start()] + f".layers.{j}." + name[m.end():], tensor

    draft.load_state_dict(dict(renamed(target.state_dict(keep_vars=True).items())), strict=False,
                          assign=True)
    # non-persistent buffers (e.g. rotary inv_freq) are not in the state dict: share them too
    buffers = dict(renamed(target.named_buffers()))
    for name, buf in list(draft.named_buffers()):
        if buf.is_meta and name in buffers:
            owner, _, attr = name.rpartition(".")
            setattr(draft.get_submodule(owner), attr, buffers[name])
    draft.tie_weights()
    missing = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if missing:
        raise RuntimeError(f"layer-subset draft: no target tensors for {missing[:3]}")
    return draft.eval().requires_grad_(False)


def int8_draft(target):
    """Dynamically int8-quantised copy of the target's Linear layers (CPU only)."""
    if next(target.parameters()).device.type != "cpu":
        raise ValueError("draft 'self:int8' uses torch dynamic quantisation, which runs on CPU "
                         "only; on a GPU use a layer-subset self-draft such as 'self:layers=0-11' "
                         "or a real draft model")
    from torch.ao.quantization import quantize_dynamic

    clone = copy.deepcopy(target).float()
    with warnings.catch_warnings():  # torch deprecates torch.ao in favour of torchao
        warnings.simplefilter("ignore")
        return quantize_dynamic(clone, {torch.nn.Linear}, dtype=torch.qint8).eval()


def self_draft(target, spec: str):
    """Build a self-draft from ``self``, ``self:int8``, ``self:layers=LIST`` or ``self:skip=LIST``."""
    n_layers = target.config.num_hidden_layers
    kind = spec.removeprefix("self").lstrip(":")
    if kind == "":
        return target
    if kind == "int8":
        return int8_draft(target)
    if kind.startswith("layers="):
        return layer_subset(target, _parse_layers(kind.removeprefix("layers="), n_layers))
    if kind.startswith("skip="):
        skip = set(_parse_layers(kind.removeprefix("skip="), n_layers))
        return layer_subset(target, [i for i in range(n_layers) if i not in skip])
    raise ValueError(f"unknown self-draft {spec!r}: use 'self', 'self:int8', 'self:layers=0-11' "
                     "or 'self:skip=every4'")
