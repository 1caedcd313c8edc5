"""Error of naive GPU energy measurement vs the mitigation protocol, on a simulated sensor.

For every sensor preset (A100/H100, Ampere/Ada consumer, V100) and synthetic workload (short
periodic kernels, long steady load, bursty decode-like load) it reports, against the true energy:

* naive-1s:   nvidia-smi power.draw polled once a second, readings summed (the paper's method),
              one run of the workload started from idle;
* naive-fast: power.draw polled every 5 ms and integrated (trapezoid), same single run;
* mitigated:  the Yang et al. protocol (measure.mitigation) on the fastest (instant) field.

Each cell is the signed error of the worst of several alignments of the sensor's update grid
with the workload (the alignment on a real GPU is unknown and uncontrolled).

Run: python experiments/sensor_error.py
"""

from __future__ import annotations

import argparse

from mtad_energy.measure.mitigation import MitigationConfig, measure_mitigated
from mtad_energy.measure.sensor import (
    PRESETS,
    PowerProfile,
    PowerTrace,
    SensorPreset,
    polled_energy_j,
)
from mtad_energy.measure.simulated import SimClock, SimulatedGPU, SimulatedMeter

IDLE_W = 60.0
NAIVE_RUN_S = 3.0  # a single measured run, as in the paper's per-configuration runs
IDLE_AROUND_S = 2.0

WORKLOADS: dict[str, PowerProfile] = {
    # 50 ms kernel cycle: 20 ms compute at 400 W, 30 ms memory-bound tail at 120 W.
    "periodic-kernels": PowerProfile.periodic(1, 0.020, 400.0, 0.030, 120.0),
    # 10 ms cycle, shorter than the A100/H100 window
    "short-kernels": PowerProfile.periodic(1, 0.004, 380.0, 0.006, 110.0),
    # a long steady load
    "steady": PowerProfile.constant(0.5, 300.0),
    # one decode request: prefill, 24 decode steps, host-side scoring
    "bursty-decode": PowerProfile.concat(
        PowerProfile.constant(0.040, 420.0),
        PowerProfile.periodic(24, 0.006, 330.0, 0.003, 140.0),
        PowerProfile.constant(0.030, 110.0),
    ),
}


def _error(estimate: float, truth: float) -> float:
    return (estimate - truth) / truth


def naive_errors(
    preset: SensorPreset, profile: PowerProfile, phase_frac: float
) -> tuple[float, float]:
    """(naive-1s, naive-fast) error of one run of about NAIVE_RUN_S seconds."""
    reps = max(1, round(NAIVE_RUN_S / profile.duration_s))
    run = PowerProfile.concat(*([profile] * reps))
    trace = PowerTrace.from_profile(run, start_s=IDLE_AROUND_S, before_w=IDLE_W, after_w=IDLE_W)
    start, end = IDLE_AROUND_S, IDLE_AROUND_S + run.duration_s
    truth = trace.energy_j(start, end)
    draw = preset.draw.with_phase(phase_frac * preset.draw.update_period_s)
    e_1s = polled_energy_j(draw, trace, start, end, 1.0, offset_s=phase_frac, method="sum")
    e_fast = polled_energy_j(draw, trace, start, end, 0.005, method="trapezoid")
    return _error(e_1s, truth), _error(e_fast, truth)


def mitigated_error(
    preset: SensorPreset, profile: PowerProfile, phase_frac: float, config: MitigationConfig
) -> float:
    sensor = preset.instant.with_phase(phase_frac * preset.instant.update_period_s)
    gpu = SimulatedGPU(idle_power_w=IDLE_W, clock=SimClock(0.0))
    meter = SimulatedMeter(gpu, sensor=sensor, keep_samples=False)
    result = measure_mitigated(
        lambda: gpu.run(profile), meter, config, sleep=gpu.idle, sync=lambda: None
    )
    assert result.energy_per_rep_j is not None
    return _error(result.energy_per_rep_j, profile.energy_j)


def worst(errors: list[float]) -> float:
    return max(errors, key=abs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--phases", type=int, default=8, help="sensor-grid alignments tried per cell"
    )
    args = parser.parse_args()
    config = MitigationConfig()
    phases = [i / args.phases for i in range(args.phases)]

    header = f"{'preset':<11} {'workload':<17} {'naive-1s':>9} {'naive-fast':>11} {'mitigated':>10}"
    print("Signed error vs true energy, worst of", args.phases, "sensor alignments")
    print(header)
    print("-" * len(header))
    overall = {"naive-1s": 0.0, "naive-fast": 0.0, "mitigated": 0.0}
    for preset in PRESETS.values():
        per_preset = {"naive-1s": 0.0, "naive-fast": 0.0, "mitigated": 0.0}
        for wname, profile in WORKLOADS.items():
            naive = [naive_errors(preset, profile, ph) for ph in phases]
            e1 = worst([a for a, _ in naive])
            ef = worst([b for _, b in naive])
            em = worst([mitigated_error(preset, profile, ph, config) for ph in phases])
            for key, val in (("naive-1s", e1), ("naive-fast", ef), ("mitigated", em)):
                per_preset[key] = max(per_preset[key], abs(val))
            print(f"{preset.name:<11} {wname:<17} {e1:>+9.1%} {ef:>+11.1%} {em:>+10.2%}")
        print(
            f"{preset.name:<11} {'max |error|':<17} {per_preset['naive-1s']:>9.1%} "
            f"{per_preset['naive-fast']:>11.1%} {per_preset['mitigated']:>10.2%}"
        )
        print("-" * len(header))
        for key, val in per_preset.items():
            overall[key] = max(overall[key], val)
    print(
        f"max |error|: naive-1s={overall['naive-1s'] * 100:.1f}% "
        f"naive-fast={overall['naive-fast'] * 100:.1f}% mitigated={overall['mitigated'] * 100:.2f}%"
    )


if __name__ == "__main__":
    main()
