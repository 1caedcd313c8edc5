"""--budget-s: once spent no new row starts; every row measured is stored, and the same call
again goes on from there (a GPU lease of 10 minutes splits a sweep over several commands)."""

from __future__ import annotations

import pytest

from mtad_energy.bench.budget import Budget
from mtad_energy.bench.runner import run_profile
from mtad_energy.config import DecoderSpec
from mtad_energy.measure import NoneMeter
from mtad_energy.results import ResultStore
from tests.bench.test_runner import PROMPTS, config


class Clock:
    """A budget spent after ``allowed`` checks: deterministic, not wall-clock time."""

    def __init__(self, allowed: int):
        self.allowed = allowed

    def __call__(self, budget: Budget) -> bool:
        self.allowed -= 1
        return self.allowed < 0


def stepped(allowed: int) -> Budget:
    budget = Budget(1.0)
    clock = Clock(allowed)
    budget.spent = lambda: clock(budget)  # type: ignore[method-assign]
    return budget


def test_profile_stops_starting_rows_and_a_rerun_goes_on(tmp_path, llama_pair):
    store = ResultStore(tmp_path)
    budget = stepped(2)  # two rows start, then the budget is spent
    rep = run_profile(config(), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS,
                      budget=budget)
    assert (rep.ran, len(rep.rows), budget.left) == (2, 2, 4)  # 3 prompts x (ar, spd)
    assert len(store.load("runs")) == 2 and "re-run the same command" in budget.note()
    again = run_profile(config(), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS,
                        budget=Budget(None))
    assert (again.ran, again.skipped, len(store.load("runs"))) == (4, 2, 6)


def test_decoding_batch_sweep_stops_and_resumes(tmp_path, llama_pair):
    from mtad_energy.bench.decode_batch import decode_batch_sweep

    store = ResultStore(tmp_path)

    def sweep(budget):
        return decode_batch_sweep(llama_pair, [DecoderSpec("ar"), DecoderSpec("spd")], [1, 2],
                                  [[5, 9, 4], [7, 3, 11, 12]], store, NoneMeter(),
                                  max_new_tokens=4, budget=budget)

    budget = stepped(3)
    first = sweep(budget)
    assert (first.ran, budget.left) == (3, 1) and len(store.load("decode_batch")) == 3
    rest = sweep(Budget(0.0))  # spent at once: the stored rows come back, nothing new runs
    assert (rest.ran, rest.skipped) == (0, 3)
    done = sweep(None)
    assert (done.ran, done.skipped) == (1, 3)


def test_forward_batch_sweep_stops_and_resumes(tmp_path, llama_pair):
    from mtad_energy.bench.batch_sweep import batch_sweep

    store = ResultStore(tmp_path)

    def sweep(budget):
        return batch_sweep(llama_pair, [1, 2, 4], 1, store, NoneMeter(), context_len=4,
                           forwards_per_run=2, profile=False, budget=budget)

    budget = stepped(1)
    assert [r["batch_size"] for r in sweep(budget)] == [1] and budget.left == 2
    assert [r["batch_size"] for r in sweep(None)] == [1, 2, 4]
    assert len(store.load("batch")) == 3


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="--budget-s must be >= 0"):
        Budget(-1.0)


def test_budget_with_workers_is_refused_before_loading(tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    result = CliRunner().invoke(app, ["profile", "--decoder", "ar", "--workers", "2", "--budget-s",
                                      "60", "--output", str(tmp_path / "s")])
    assert result.exit_code == 2 and "--budget-s stops one process" in result.output


def test_a_spent_budget_hashes_no_more_row_keys_and_counts_every_row_left(tmp_path, llama_pair,
                                                                          monkeypatch):
    """--repeats 300 (issue 57): every row's key hashes its prompt, four times over before; the
    budget went past its limit by seconds while the loops between rows hashed and looked up keys
    for rows that would never run. Once spent (here: as soon as one key is hashed) those loops
    stop within one check (64 keys), and every row not run is counted in ``left``."""
    from mtad_energy.bench.runner import Runner

    hashed = []
    real = Runner._run_key

    def counted(self, unit):
        hashed.append(unit)
        return real(self, unit)

    monkeypatch.setattr(Runner, "_run_key", counted)
    budget = Budget(1.0)
    budget.expired = lambda: len(hashed) > 0  # type: ignore[method-assign]
    store = ResultStore(tmp_path)
    rep = run_profile(config(decoders=(DecoderSpec("ar"),), repeats=300, n_prompts=1), store,
                      pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS[:1], budget=budget)
    assert (rep.ran, budget.left, len(hashed)) == (0, 300, 64)
    assert "300 row(s) not measured" in budget.note()
