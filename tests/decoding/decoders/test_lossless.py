"""spd is lossless through the shared chi-square harness, and the harness rejects a broken spd.

The prompt [1, 0] is where the lossless pair's warped p and q differ most (p/q overlap 0.45), so a
biased rule shows up with few samples: the broken variant below gives p-values near 1e-20 with
300 samples, while the threshold for "lossless" is 1e-3 (seeds are fixed: deterministic).
"""

from __future__ import annotations

from unittest import mock

import pytest

from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules import chain
from mtad_energy.decoding.rules.sampling import Warp
from tests.decoding.lossless import chi_square_pvalue, exact_joint, sample_counts

PROMPT = [1, 0]



@pytest.fixture(scope="module")
def exact2(lossless_pair):
    return exact_joint(lossless_pair, Warp(), PROMPT, n_tokens=2)


def test_spd_is_lossless(lossless_pair, exact2):
    counts = sample_counts(get_decoder("spd", gamma=3), lossless_pair, 600, PROMPT)
    assert chi_square_pvalue(counts, exact2) > 1e-3


def test_spd_with_residual_replaced_by_p_is_rejected(lossless_pair, exact2):
    with mock.patch.object(chain, "residual", lambda p, q: p):
        counts = sample_counts(get_decoder("spd", gamma=3), lossless_pair, 300, PROMPT)
    assert chi_square_pvalue(counts, exact2) < 1e-6
