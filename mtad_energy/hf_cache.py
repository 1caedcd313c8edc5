"""The name transformers gives a model's KV cache, in a forward's keyword and in its output.

transformers 5.24 renamed ``past_key_values`` to ``cache`` in every model's ``forward`` and in
every output class at once (the old name warns "deprecated and will be removed in version
5.40.0" on every forward); 5.17, the oldest version the project admits, knows only
``past_key_values`` and would swallow ``cache=`` into its ``**kwargs`` unused. The rule: call
models and read outputs with the name the installed library declares, found once from its
output classes (not from a version number, so a backport or a release candidate is read as it
is). Imported by `decoding`, `measure` and `bench` alike: it imports neither.
"""

from __future__ import annotations

from typing import Any


def _library_name() -> str:
    """``"cache"`` where transformers' outputs have that field, else ``"past_key_values"``."""
    from dataclasses import fields

    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"


CACHE_KWARG: str = _library_name()


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a model forward: ``model(input_ids=ids, **cache_kwargs(cache))``."""
    return {CACHE_KWARG: cache}


def cache_of(output: Any) -> Any:
    """The KV cache a model forward returned (``output.cache`` or ``output.past_key_values``)."""
    return getattr(output, CACHE_KWARG)


def cache_from(kwargs: dict[str, Any]) -> Any:
    """The cache passed in a forward's keyword arguments, under either name (None if neither)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
