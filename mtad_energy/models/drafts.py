"""A draft checked against its target without loading either model's weights: what a draft axis
(`mtad-energy sweep draft`) refuses before anything loads (`check_draft`).

A draft spec is what ``--draft`` takes: a draft model (hub id, local directory, ``self:...`` or
``random:SHAPE``) and/or heads (``eagle:SOURCE``, ``medusa:SOURCE``), comma-joined
(`models.heads.split_draft_spec`). The checks read configs and tokenizers only:

- ``self:...``: the layer list against the target's layer count, ``self:int8`` on CPU only;
- ``random:SHAPE``: a known shape whose vocabulary is the target's;
- any other model: its tokenizer against the target's (`pair.check_tokenizers`) and its output
  vocabulary size (``config.vocab_size``) against the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtad_energy.models.heads import split_draft_spec
from mtad_energy.models.pair import (
    TokenizerMismatchError,
    _from_pretrained,
    _random_shape,
    check_tokenizers,
    is_random,
    load_tokenizer,
)
from mtad_energy.models.self_drafts import _layer_ranges, _parse_layers


def _target_config(target_id: str) -> tuple[int, int]:
    """(layers, vocabulary size) of the target, from its config (no weights)."""
    if is_random(target_id):
        shape = _random_shape(target_id)
        return shape.layers, shape.vocab
    from transformers import AutoConfig

    config = _from_pretrained(AutoConfig, target_id)
    return int(config.num_hidden_layers), int(config.vocab_size)


def _check_self(draft: str, layers: int, device: torch.device) -> None:
    kind = draft.removeprefix("self").lstrip(":")
    if kind in ("", "int8"):
        if kind == "int8" and device.type != "cpu":
            raise ValueError(f"draft {draft!r} (torch dynamic quantisation) runs on CPU only; on "
                             f"{device.type} use a layer subset such as 'self:layers=0-11'")
        return
    for prefix in ("layers=", "skip="):
        if kind.startswith(prefix):
            kept = _parse_layers(kind.removeprefix(prefix), layers)
            if prefix == "skip=":
                kept = [i for i in range(layers) if i not in kept]
            if not kept:
                raise ValueError(f"it keeps no layer of the target's {layers}: keep "
                                 "at least one (skip fewer, e.g. 'self:skip=every2')")
            return
    raise ValueError(f"unknown self-draft {draft!r}: use 'self', 'self:int8', 'self:layers=0-11' "
                     "or 'self:skip=every4'")


def check_self_draft(target_id: str, draft: str | None, device: torch.device | str = "cpu") -> None:
    """Refuse a self-draft (``self:...`` in ``draft``) that cannot build a draft, before any
    model loads: a malformed layer list or ``every0`` always; a list keeping no layer or naming a
    layer the target lacks, and ``self:int8`` off the CPU, where the target's config is at hand
    without a download (a local directory or ``random:SHAPE``; otherwise loading says the same).
    Raises ValueError naming ``--draft`` and the fix."""
    model, _heads = split_draft_spec(draft)
    if model is None or not model.startswith("self"):
        return
    kind = model.removeprefix("self").lstrip(":")
    try:
        for prefix in ("layers=", "skip="):
            if kind.startswith(prefix):
                _layer_ranges(kind.removeprefix(prefix))  # the form alone: 'every0', 'x'
        if is_random(target_id) or Path(target_id).is_dir():
            _check_self(model, _target_config(target_id)[0], torch.device(str(device)))
    except ValueError as error:
        raise ValueError(f"--draft {draft!r}: {error}") from None


def check_draft(target_id: str, draft: str, device: torch.device | str = "cpu") -> None:
    """Raise ValueError (`TokenizerMismatchError` for another vocabulary) naming ``draft`` and
    the fix when it cannot draft for ``target_id`` on ``device``; reads configs and tokenizers,
    never weights."""
    model, _heads = split_draft_spec(draft)  # a malformed head list is refused here
    if model is None:
        return  # heads only: their shapes are checked against the target when they load
    layers, vocab = _target_config(target_id)
    if model.startswith("self"):
        try:
            _check_self(model, layers, torch.device(str(device)))
        except ValueError as error:
            raise ValueError(f"--draft {draft!r}: {error}") from None
        return
    if is_random(model):
        if _random_shape(model).vocab != vocab:
            raise TokenizerMismatchError(
                f"--draft {draft!r} predicts {_random_shape(model).vocab} token ids, the target "
                f"{target_id!r} {vocab}: a draft must share the target's vocabulary; pick a shape "
                "of the target's family")
        return
    from transformers import AutoConfig

    check_tokenizers(load_tokenizer(target_id), load_tokenizer(model), target_id, model)
    draft_vocab = int(_from_pretrained(AutoConfig, model).vocab_size)
    if draft_vocab != vocab:
        raise TokenizerMismatchError(
            f"--draft {draft!r} predicts {draft_vocab} token ids, the target {target_id!r} "
            f"{vocab}; their distributions cannot be compared token by token: use a draft with "
            "the target's vocabulary")
