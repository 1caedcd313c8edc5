"""Fixtures shared by the command-line tests (test_bad_input.py, test_tune.py, test_sweep_draft.py)."""

from __future__ import annotations

import pytest


@pytest.fixture()
def no_loading(monkeypatch):
    """Fails the test if a command loads a model."""
    import mtad_energy.bench.runner as runner_mod
    import mtad_energy.models as models_mod

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(runner_mod, "load_pair", refuse)
    monkeypatch.setattr(models_mod, "load_pair", refuse)
