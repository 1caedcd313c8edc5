"""Results store (append-only Parquet part files) and the tables it holds."""

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
