"""The decoders, one file each (`pld.py` is the model of one): a `Params` dataclass and a
``step`` over `runtime.state.DecodeState`, built from the rules in ``rules/`` and the runtime's
runners. Registered by name in `decoding.registry`."""
