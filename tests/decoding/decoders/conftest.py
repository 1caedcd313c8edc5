"""Fixtures shared by the decoder tests: the head decoders' small target (test_head_decoders.py,
test_tree_shapes.py)."""

from __future__ import annotations

import pytest

from tests import tiny


@pytest.fixture(scope="module")
def small3_pair(tmp_path_factory):
    """A 5-token, 3-layer target with an EAGLE-3 head over a 4-token draft vocabulary."""
    root = tmp_path_factory.mktemp("small3")
    target = tiny.llama(5, 0, layers=3, hidden=16, init=0.25)
    path = tiny.save(target, tiny.word_tokenizer(5, eos=False), root / "target")
    head = tiny.save_eagle(target, root / "eagle", version=3, draft_vocab=4, safetensors=True)
    from mtad_energy.models import load_pair

    return load_pair(target=path, draft=f"eagle:{head}", device="cpu")
