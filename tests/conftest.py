"""Session fixtures: tiny random models of real architectures, saved and re-loaded through the
normal loading path (``load_pair(target=dir, draft=dir, device="cpu")``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests import tiny

VOCAB = 64


def pytest_configure(config):
    """Under ``pytest -n N`` (README's test command) each worker takes its share of the cores:
    N workers of all-core torch would contend for every op."""
    if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    # the slow tests first (a stable sort): under -n 2 the longest ones start while the other
    # worker works through the short ones, instead of one of them running alone at the end
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def calibration_records(tmp_path_factory, monkeypatch):
    """Calibration records (`mtad-energy calibrate`) of each test in a fresh directory, never the
    user's cache: a record makes later runs flag short windows."""
    path = tmp_path_factory.mktemp("calibration")
    monkeypatch.setenv("MTAD_ENERGY_CALIBRATION", str(path))
    return path


@pytest.fixture
def wide_console(monkeypatch):
    """The CLI's consoles 300 columns wide, for tests that read a whole line whose length
    depends on the temporary path (rich wraps at 80 off a terminal; a wrap at a space drops it)."""
    from mtad_energy.cli import output

    for console in (output.console, output.err_console):
        monkeypatch.setattr(console, "_width", 300)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    tok = tiny.word_tokenizer(VOCAB)
    llama, opt = tiny.llama(VOCAB, 0, layers=3), tiny.opt(VOCAB, 0, layers=2)
    dirs = {
        "llama": tiny.save(llama, tok, root / "llama"),
        "llama-draft": tiny.save(tiny.llama(VOCAB, 1, layers=1), tok, root / "llama-draft"),
        "opt": tiny.save(opt, tok, root / "opt"),
        "opt-draft": tiny.save(tiny.opt(VOCAB, 1, layers=1), tok, root / "opt-draft"),
        # same vocabulary size, different tokens: must be refused as a draft
        "other-vocab": tiny.save(tiny.llama(VOCAB, 2, layers=1),
                                 tiny.word_tokenizer(VOCAB, prefix="x"), root / "other-vocab"),
        # draft heads in their public layouts (EAGLE heads are for Llama-family targets)
        "llama-eagle": tiny.save_eagle(llama, root / "llama-eagle", version=3, draft_vocab=48),
        "llama-eagle1": tiny.save_eagle(llama, root / "llama-eagle1", version=1),
        "llama-medusa": tiny.save_medusa(llama, root / "llama-medusa"),
        "opt-medusa": tiny.save_medusa(opt, root / "opt-medusa", safetensors=False),
    }
    return dirs


def with_heads(dirs: dict[str, str], draft: str, arch: str) -> str:
    """A draft spec naming the draft model and the heads built for ``arch``'s target."""
    heads = [f"{kind}:{dirs[f'{arch}-{kind}']}" for kind in ("eagle", "medusa")
             if f"{arch}-{kind}" in dirs]
    return ",".join([draft, *heads])


# The fixture pairs are pinned to the CPU (fp32): tests build their inputs on the CPU and assert
# exact, seed-determined outputs, so CI means the same on a GPU machine. CUDA is covered by the
# `gpu`-marked tests in tests/test_cuda.py.
@pytest.fixture(scope="session")
def llama_pair(model_dirs):
    from mtad_energy.models import load_pair

    return load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, model_dirs["llama-draft"], "llama"), device="cpu")


@pytest.fixture(scope="session")
def opt_pair(model_dirs):
    from mtad_energy.models import load_pair

    return load_pair(target=model_dirs["opt"],
                     draft=with_heads(model_dirs, model_dirs["opt-draft"], "opt"), device="cpu")


@pytest.fixture(scope="session")
def lossless_pair():
    return tiny.lossless_pair()


@pytest.fixture(scope="session")
def int8_pair(tmp_path_factory):
    """A tiny Llama whose p is peaked enough that BiLD's rollback test sometimes passes and
    sometimes fails, with the CPU default's kind of draft: its own int8 copy (``self:int8``,
    loaded through the real path), and EAGLE-3 and Medusa heads built for it."""
    from mtad_energy.models import load_pair

    root = tmp_path_factory.mktemp("peaked")
    target = tiny.llama(64, 0, layers=3, init=0.2)
    path = tiny.save(target, tiny.word_tokenizer(64), root / "llama")
    heads = (f"eagle:{tiny.save_eagle(target, root / 'eagle', version=3, draft_vocab=48)},"
             f"medusa:{tiny.save_medusa(target, root / 'medusa')}")
    return load_pair(target=path, draft=f"self:int8,{heads}", device="cpu")
