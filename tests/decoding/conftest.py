"""Every decoding test module runs on one intra-op thread (a module-scoped autouse fixture).

Tiny models gain nothing from intra-op parallelism; on 2 shared cores the extra threads only
contend, making the generate loop about 10x slower.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def self_pair(model_dirs):
    """The tiny Llama with its first two layers as the draft: greedy drafts are partly accepted
    (a random tiny draft never agrees with the target), so rollback paths run."""
    from mtad_energy.models import load_pair
    from tests.conftest import with_heads

    return load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, "self:layers=0-1", "llama"), device="cpu")

