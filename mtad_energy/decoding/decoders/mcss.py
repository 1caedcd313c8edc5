"""Multi-candidate speculative sampling (MCSS, Yang et al. 2024), without-replacement variant.

The same static draft tree as SpecInfer, but the children of a node are drawn from ~q *without
replacement* (Gumbel-top-k), and on rejection of child x the walk also sets q[x] <- 0 and
renormalises q before trying the next child. When warping leaves fewer tokens with q > 0 than a
node has children (e.g. top_k = 2 with 4 children), the extra slots are not draws at all: they
are shown to the target but never tested. Lossless w.r.t. ~p.

Stats as in SpecInfer: ``proposed`` = draft tree nodes shown to the target.
"""

from __future__ import annotations

from mtad_energy.decoding.decoders.specinfer import SpecInfer


class Mcss(SpecInfer):
    name = "mcss"
    help = "MCSS: draft token tree drawn without replacement, q updated on each rejection"
    without_replacement = True
