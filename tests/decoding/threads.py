"""A module-scoped autouse fixture: run tiny-model tests on one intra-op thread.

Import it into a test module (``from tests.decoding.threads import one_thread  # noqa: F401``).
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
