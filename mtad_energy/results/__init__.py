"""Results store (append-only Parquet part files) and what reads it: the tables (`schema`), the
summaries (`analysis`), the report (`report`) and its figures (`figures`), the energy model over
stored rows (`breakdown`, over `mtad_energy.energy`) and the speculation schedule (`schedule`)."""

from mtad_energy.results.schema import TABLES, params_json, stable_key
from mtad_energy.results.store import (
    CorruptFileError,
    ForeignFileError,
    ResultStore,
    StoreError,
    load_results,
)

__all__ = ["TABLES", "CorruptFileError", "ForeignFileError", "ResultStore", "StoreError",
           "load_results", "params_json", "stable_key"]
