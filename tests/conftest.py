"""Session fixtures: tiny random models of real architectures, saved and re-loaded through the
normal loading path (``load_pair(target=dir, draft=dir, device="cpu")``)."""

from __future__ import annotations

import pytest
import torch

from tests import tiny

VOCAB = 64


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    tok = tiny.word_tokenizer(VOCAB)
    dirs = {
        "llama": tiny.save(tiny.llama(VOCAB, 0, layers=3), tok, root / "llama"),
        "llama-draft": tiny.save(tiny.llama(VOCAB, 1, layers=1), tok, root / "llama-draft"),
        "opt": tiny.save(tiny.opt(VOCAB, 0, layers=2), tok, root / "opt"),
        "opt-draft": tiny.save(tiny.opt(VOCAB, 1, layers=1), tok, root / "opt-draft"),
        # same vocabulary size, different tokens: must be refused as a draft
        "other-vocab": tiny.save(tiny.llama(VOCAB, 2, layers=1),
                                 tiny.word_tokenizer(VOCAB, prefix="x"), root / "other-vocab"),
    }
    return dirs


# The fixture pairs are pinned to the CPU (fp32): tests build their inputs on the CPU and assert
# exact, seed-determined outputs, so CI means the same on a GPU machine. CUDA is covered by the
# `gpu`-marked tests in tests/test_cuda.py.
@pytest.fixture(scope="session")
def llama_pair(model_dirs):
    from mtad_energy.models import load_pair

    return load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")


@pytest.fixture(scope="session")
def opt_pair(model_dirs):
    from mtad_energy.models import load_pair

    return load_pair(target=model_dirs["opt"], draft=model_dirs["opt-draft"], device="cpu")


@pytest.fixture(scope="session")
def lossless_pair():
    return tiny.lossless_pair()


@pytest.fixture(scope="session")
def int8_pair(tmp_path_factory):
    """A tiny Llama whose p is peaked enough that BiLD's rollback test sometimes passes and
    sometimes fails, with the CPU default's kind of draft: its own int8 copy (``self:int8``,
    loaded through the real path)."""
    from mtad_energy.models import load_pair

    path = tiny.save(tiny.llama(64, 0, layers=3, init=0.2), tiny.word_tokenizer(64),
                     tmp_path_factory.mktemp("peaked") / "llama")
    return load_pair(target=path, draft="self:int8", device="cpu")
