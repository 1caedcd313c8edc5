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
