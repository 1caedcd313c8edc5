"""The energy model: how a decoder's joules are counted, fitted and split.

E = pi0 * T + eps_flop * W + eps_byte * Q (the energy roofline, Choi et al. 2013) beside the
paper's E = P_static * T + PW_flop * T_flop + PW_mem * T_mem (docs/design.md section 8):

- `work`: the work W (FLOPs) and Q (bytes) of one forward, counted from the model's dimensions
  and the forward's shape (`Forward` is what a runner records per forward; `forward_work`).
- `tap`: the same work observed from the tensors a forward touches (`WorkTap`), the independent
  check of `work`, and the simulated device that charges it (`RooflineDevice`).
- `fit`: both forms fitted by non-negative least squares with HC3 intervals and a verdict per
  coefficient (`fit_form`, `EnergyFit`).
- `attribution`: a decode window's measured joules split into draft / target / other phases and
  static / FLOP / memory terms, and the fit validated on windows it never saw (`attribute`,
  `validate`).

Reading rows from a results store and summarising them is `mtad_energy.results.breakdown`; the
meters that measure E are `mtad_energy.measure`. Nothing here imports either (nor torch at import
time: `work` and `tap` import it where they need it).
"""
