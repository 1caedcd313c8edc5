"""NVML meters against an autospec-mocked pynvml: exact joules, exact messages."""

from __future__ import annotations

import threading

import pynvml
import pytest

from mtad_energy.measure import (
    FLAG_COUNTER_RESET,
    FLAG_COUNTER_WRAP,
    FLAG_DEVICE_ORDER,
    FLAG_MISSING_DEVICE,
    FLAG_POWER_FALLBACK,
    FLAG_SHORT_WINDOW,
    FLAG_ZERO_ENERGY,
    MeterUnavailableError,
    MigNotSupportedError,
    NvmlCounterMeter,
    NvmlPowerMeter,
    no_sync,
    window,
)
from tests.measure.conftest import FakeNvml, StepClock, nvml_error

NO_ENV: dict[str, str] = {}


def counter(clock: StepClock, env: dict[str, str] | None = None, **kw) -> NvmlCounterMeter:
    return NvmlCounterMeter(env=NO_ENV if env is None else env, clock=clock, **kw)


class TestCounter:
    def test_exact_joules_per_gpu_and_total(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].energy_mj = [1_000_000, 1_000_000, 1_250_500]  # probe, begin, end
        fake_nvml.gpus[1].energy_mj = [7, 7, 100_007]
        clock = StepClock(10.0)
        with counter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 12.5
            m = meter.end_window("w")
        assert m.device_energy_j == {"gpu0": 250.5, "gpu1": 100.0}
        assert m.energy_j == 350.5
        assert m.time_s == 2.5
        assert m.power_w == 350.5 / 2.5
        assert m.flags == ()
        assert m.meter == "nvml-counter"
        assert m.reason is None

    def test_window_context_manager_syncs_at_both_ends(self, fake_nvml: FakeNvml) -> None:
        calls: list[str] = []
        fake_nvml.gpus[0].energy_mj = [0, 0, 5_000]
        fake_nvml.gpus[1].energy_mj = [0, 0, 1_000]
        clock = StepClock(0.0)
        with counter(clock) as meter:
            with window(
                meter, "gen", sync=lambda: calls.append(f"sync@{fake_nvml.energy_reads}")
            ) as w:
                calls.append("body")
                clock.now_s = 1.0
        assert calls == [
            "sync@2",
            "body",
            "sync@4",
        ]  # sync before the start read, and before the end read
        assert w.measurement is not None and w.measurement.energy_j == 6.0

    def test_wrap_is_corrected_and_flagged(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        fake_nvml.gpus[0].energy_mj = [2**64 - 1_000, 2**64 - 1_000, 500]
        clock = StepClock(0.0)
        with counter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 1.0
            m = meter.end_window("w")
        assert m.energy_j == 1.5
        assert m.flags[0].code == FLAG_COUNTER_WRAP
        assert m.flags[0].message == (
            "gpu0 (NVIDIA H100 80GB HBM3, NVML index 0): energy counter wrapped at 2**64 mJ; "
            "corrected."
        )

    def test_reset_drops_the_device(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].energy_mj = [9_000_000, 9_000_000, 10]
        fake_nvml.gpus[1].energy_mj = [0, 0, 1000]
        clock = StepClock(0.0)
        with counter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 1.0
            m = meter.end_window("w")
        assert m.device_energy_j == {"gpu0": None, "gpu1": 1.0}
        assert m.energy_j is None
        assert m.reason == "energy missing for device(s) gpu0; see flags"
        assert m.flag_codes == (FLAG_COUNTER_RESET,)

    def test_missing_device_is_flagged(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[1].energy_mj = [0, 0, nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)]
        fake_nvml.gpus[0].energy_mj = [0, 0, 2000]
        clock = StepClock(0.0)
        with counter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 1.0
            m = meter.end_window("w")
        assert m.energy_j is None
        assert m.device_energy_j == {"gpu0": 2.0, "gpu1": None}
        assert m.flags[0].code == FLAG_MISSING_DEVICE
        assert m.flags[0].message == (
            "gpu1 (NVIDIA H100 80GB HBM3, NVML index 1): reading the energy counter failed (GPU "
            "is lost)"
        )

    def test_short_window_and_zero_energy_flagged(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        fake_nvml.gpus[0].energy_mj = [42]
        clock = StepClock(0.0)
        with counter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 0.02
            m = meter.end_window("w")
        assert m.energy_j == 0.0
        assert m.flag_codes == (FLAG_ZERO_ENERGY, FLAG_SHORT_WINDOW)
        assert m.flags[1].message == (
            "window of 0.02 s is shorter than the nvml-counter sensor update period (0.1 s), so "
            "its "
            "energy is unreliable; measure a longer window or repeat the workload with "
            "measure.mitigation."
        )

    def test_pre_volta_is_refused_with_advice(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].name = "Tesla P100-PCIE-16GB"
        fake_nvml.gpus[0].energy_mj = [nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)]
        with pytest.raises(MeterUnavailableError) as err:
            counter(StepClock())
        assert str(err.value) == (
            "nvml-counter needs the total-energy counter (Volta or newer); gpu0 (Tesla "
            "P100-PCIE-16GB, "
            "NVML index 0) does not provide it (Not Supported). Use meter='nvml-power'."
        )

    def test_no_driver_message(self, no_nvml: None) -> None:
        with pytest.raises(MeterUnavailableError) as err:
            counter(StepClock())
        assert str(err.value) == (
            "NVML could not start (NVML Shared Library Not Found); this machine has no usable "
            "NVIDIA "
            "driver. Use a CPU meter ('rapl' or 'none') or run on a GPU machine."
        )

    def test_gpu_listing_failure_is_unavailable(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.count_error = pynvml.NVML_ERROR_NO_PERMISSION
        with pytest.raises(MeterUnavailableError) as caught:
            counter(StepClock())
        assert str(caught.value) == (
            "NVML started but could not list the GPUs (Insufficient Permissions); check the driver "
            "with `nvidia-smi`, or use meter='none'."
        )

    def test_duplicate_window_name_is_an_error(self, fake_nvml: FakeNvml) -> None:
        with counter(StepClock()) as meter:
            meter.begin_window("w")
            with pytest.raises(RuntimeError, match="measurement window 'w' is already open"):
                meter.begin_window("w")


class TestVisibleDevices:
    def test_integer_indices_map_to_nvml_indices(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[1].energy_mj = [0, 0, 3000]
        clock = StepClock()
        with counter(clock, env={"CUDA_VISIBLE_DEVICES": "1"}) as meter:
            assert meter.devices == ("gpu0",)
            assert meter.nvml_devices[0].nvml_index == 1
            meter.begin_window("w")
            clock.now_s = 1.0
            assert meter.end_window("w").device_energy_j == {"gpu0": 3.0}

    def test_uuid_and_uuid_prefix(self, fake_nvml: FakeNvml) -> None:
        env = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb2222-0000-0000-0000-000000000000,GPU-aaaa"}
        with counter(StepClock(), env=env) as meter:
            assert [d.nvml_index for d in meter.nvml_devices] == [1, 0]
            assert meter.devices == ("gpu0", "gpu1")

    def test_negative_index_hides_the_rest(self, fake_nvml: FakeNvml) -> None:
        with counter(StepClock(), env={"CUDA_VISIBLE_DEVICES": "1,-1,0"}) as meter:
            assert [d.nvml_index for d in meter.nvml_devices] == [1]

    def test_no_visible_gpu(self, fake_nvml: FakeNvml) -> None:
        with pytest.raises(MeterUnavailableError) as err:
            counter(StepClock(), env={"CUDA_VISIBLE_DEVICES": ""})
        assert str(err.value) == (
            "no GPU is visible to this process (CUDA_VISIBLE_DEVICES='' hides them); nothing for "
            "NVML to measure."
        )

    def test_out_of_range(self, fake_nvml: FakeNvml) -> None:
        with pytest.raises(MeterUnavailableError) as err:
            counter(StepClock(), env={"CUDA_VISIBLE_DEVICES": "5"})
        assert str(err.value) == (
            "CUDA_VISIBLE_DEVICES entry 5 is out of range: NVML sees 2 GPU(s). Fix "
            "CUDA_VISIBLE_DEVICES."
        )

    def test_mig_slice_in_env_is_refused(self, fake_nvml: FakeNvml) -> None:
        with pytest.raises(MigNotSupportedError) as err:
            counter(StepClock(), env={"CUDA_VISIBLE_DEVICES": "MIG-1234-5678"})
        assert str(err.value) == (
            "CUDA_VISIBLE_DEVICES names a MIG slice (MIG-1234-5678); NVML cannot measure the "
            "power or "
            "energy of a MIG slice. Set CUDA_VISIBLE_DEVICES to whole GPUs (indices or GPU-UUIDs) "
            "or use "
            "meter='none'."
        )

    def test_gpu_in_mig_mode_is_refused(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[1].mig = pynvml.NVML_DEVICE_MIG_ENABLE
        with pytest.raises(MigNotSupportedError) as err:
            counter(StepClock())
        assert str(err.value) == (
            "gpu1 (NVIDIA H100 80GB HBM3, NVML index 1) is in MIG mode; NVML reports power and "
            "energy only "
            "for the whole GPU, which would include other MIG tenants. Disable MIG "
            "(`nvidia-smi -i 1 -mig 0`) or use meter='none'."
        )

    def test_mig_capable_but_disabled_is_fine(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].mig = pynvml.NVML_DEVICE_MIG_DISABLE
        with counter(StepClock()) as meter:
            assert meter.devices == ("gpu0", "gpu1")

    def test_mixed_models_without_pci_order_are_flagged(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[1].name = "NVIDIA A100-SXM4-40GB"
        for gpu in fake_nvml.gpus:
            gpu.energy_mj = [0, 0, 1000, 1000, 1000, 2000]
        clock = StepClock()
        with counter(clock, env={"CUDA_VISIBLE_DEVICES": "0,1"}) as meter:
            meter.begin_window("w")
            clock.now_s = 1.0
            m = meter.end_window("w")
        assert m.flag_codes == (FLAG_DEVICE_ORDER,)
        with counter(
            clock, env={"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        ) as meter:
            meter.begin_window("w")
            clock.now_s = 2.0
            assert meter.end_window("w").flag_codes == ()


def power_meter(clock: StepClock, **kw) -> NvmlPowerMeter:
    return NvmlPowerMeter(env=NO_ENV, clock=clock, background=False, **kw)


class TestPower:
    def test_trapezoid_with_interpolated_ends_exact(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        gpu = fake_nvml.gpus[0]
        clock = StepClock(0.0)
        with power_meter(clock) as meter:
            gpu.instant_mw = 100_000
            meter.begin_window("w")  # sample (0 s, 100 W), window starts at 0 s
            clock.now_s, gpu.instant_mw = 1.0, 300_000
            meter.sample_now()  # (1 s, 300 W)
            clock.now_s, gpu.instant_mw = 2.0, 300_000
            m = meter.end_window("w")  # window ends at 2 s, sample (2 s, 300 W)
        # 0-1 s: (100 + 300) / 2 = 200 J; 1-2 s: 300 J
        assert m.energy_j == 500.0
        assert [(s.timestamp_s, s.power_w) for s in m.samples] == [
            (0.0, 100.0),
            (1.0, 300.0),
            (2.0, 300.0),
        ]
        assert m.flags == ()
        assert meter.power_fields == {"gpu0": "instant"}

    def test_window_ends_between_samples_are_interpolated(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        gpu = fake_nvml.gpus[0]
        clock = StepClock(0.0)
        with power_meter(clock) as meter:
            meter.begin_window("outer")  # sample at 0 s: 300 W
            clock.now_s, gpu.instant_mw = 1.0, 100_000
            meter.sample_now()  # 1 s: 100 W
            clock.now_s = 0.5
            # inner window from 0.5 s: its start power is interpolated (200 W), not the next sample
            meter._book.open("inner", 0.5)
            clock.now_s = 1.0
            inner = meter.end_window("inner")
            outer = meter.end_window("outer")
        assert inner.energy_j == pytest.approx(0.5 * (200 + 100) / 2, abs=1e-12)
        assert outer.energy_j == pytest.approx((300 + 100) / 2, abs=1e-12)

    def test_two_gpus_exact(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].instant_mw = 250_000
        fake_nvml.gpus[1].instant_mw = 125_500
        clock = StepClock(3.0)
        with power_meter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 5.0
            m = meter.end_window("w")
        assert m.device_energy_j == {"gpu0": 500.0, "gpu1": 251.0}
        assert m.energy_j == 751.0

    def test_fallback_to_power_usage_is_flagged(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        fake_nvml.gpus[0].instant_mw = None
        fake_nvml.gpus[0].usage_mw = 150_000
        clock = StepClock(0.0)
        with power_meter(clock) as meter:
            assert meter.power_fields == {"gpu0": "power.draw"}
            meter.begin_window("w")
            clock.now_s = 2.0
            m = meter.end_window("w")
        assert m.energy_j == 300.0
        assert m.flags[0].code == FLAG_POWER_FALLBACK
        assert m.flags[0].message == (
            "gpu0 (NVIDIA H100 80GB HBM3, NVML index 0): instant power "
            "(NVML_FI_DEV_POWER_INSTANT) is not "
            "supported (Not Supported); fell back to nvmlDeviceGetPowerUsage (power.draw, often a "
            "1 s "
            "average), which lags and smooths short phases."
        )

    def test_power_draw_on_request_reads_usage_without_a_fallback_flag(
        self, fake_nvml: FakeNvml
    ) -> None:
        fake_nvml.gpus = fake_nvml.gpus[:1]
        fake_nvml.gpus[0].instant_mw = 400_000  # available, but power.draw was asked for
        fake_nvml.gpus[0].usage_mw = 150_000
        clock = StepClock(0.0)
        with power_meter(clock, field="power.draw") as meter:
            assert meter.power_fields == {"gpu0": "power.draw"}
            meter.begin_window("w")
            clock.now_s = 2.0
            m = meter.end_window("w")
        assert m.energy_j == 300.0
        assert m.flags == ()

    def test_power_draw_unreadable_and_bad_field(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].usage_mw = None
        with pytest.raises(MeterUnavailableError) as err:
            power_meter(StepClock(), field="power.draw")
        assert str(err.value) == (
            "nvml-power cannot read power.draw on gpu0 (NVIDIA H100 80GB HBM3, NVML index 0) "
            "(nvmlDeviceGetPowerUsage failed: Not Supported). Use field='instant'."
        )
        with pytest.raises(ValueError, match="field must be 'instant' or 'power.draw', got 'avg'"):
            power_meter(StepClock(), field="avg")

    def test_no_power_at_all_is_unavailable(self, fake_nvml: FakeNvml) -> None:
        fake_nvml.gpus[0].instant_mw = None
        fake_nvml.gpus[0].usage_mw = None
        with pytest.raises(MeterUnavailableError) as err:
            power_meter(StepClock())
        assert str(err.value) == (
            "nvml-power cannot read power on gpu0 (NVIDIA H100 80GB HBM3, NVML index 0): instant "
            "power "
            "failed (Not Supported) and nvmlDeviceGetPowerUsage failed (Not Supported). Use "
            "meter='nvml-counter' or 'none'."
        )

    def test_short_window_flagged(self, fake_nvml: FakeNvml) -> None:
        clock = StepClock(0.0)
        with power_meter(clock) as meter:
            meter.begin_window("w")
            clock.now_s = 0.05
            m = meter.end_window("w")
        assert FLAG_SHORT_WINDOW in m.flag_codes
        assert m.energy_j == pytest.approx(0.05 * 600.0)

    def test_thread_polls_and_stops_even_when_the_block_raises(self, fake_nvml: FakeNvml) -> None:
        meter = NvmlPowerMeter(env=NO_ENV, poll_interval_s=0.001)
        polled = threading.Event()
        real_sample = meter.sample_now

        def sample_and_signal() -> None:
            real_sample()
            if meter.polling:
                polled.set()

        meter.sample_now = sample_and_signal  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyError), window(meter, "w", sync=no_sync) as w:
                assert meter.polling
                assert polled.wait(timeout=10)  # the thread really samples
                raise KeyError("workload failed")
            assert not meter.polling
            assert meter._thread is None
            assert w.measurement is not None and w.measurement.energy_j is not None
            assert len(w.measurement.samples) >= 3 * 2  # start + thread + end, two GPUs
        finally:
            meter.close()
        assert not any(t.name == "mtad-nvml-power" for t in threading.enumerate())


def test_closing_a_window_does_not_wait_out_a_long_poll_interval(fake_nvml: FakeNvml) -> None:
    """A 1 s+ poller must stop at once: it is measured beside other meters whose windows would
    otherwise stay open until its sleep ends."""
    import time

    meter = NvmlPowerMeter(env=NO_ENV, poll_interval_s=600.0)
    try:
        meter.begin_window("w")
        assert meter.polling
        t0 = time.perf_counter()
        meter.end_window("w")
        assert time.perf_counter() - t0 < 300  # stopped, not the 600 s sleep waited out
        assert not meter.polling
    finally:
        meter.close()
