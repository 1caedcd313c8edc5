"""The acceptance and verification rules, pure tensor functions (no models, no caches), named
``*_accept*``, one module per family: `chain` (drafted chains), `tree` (token trees), `joint`
(MTAD's joint likelihood ratio), `beam` (the steps of stochastic beam sampling), and `sampling`
(the warp and the draws they share)."""
