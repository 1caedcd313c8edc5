"""Where a decoder's pure tensor functions run: eagerly, or compiled into one graph each.

A decoder's step is forwards (the runners') and, between them, pure tensor functions: warping and
sampling, an acceptance rule, a beam step. Eagerly each of those is tens of aten ops the host
dispatches one by one (~6-8 us each on a GPU: docs/design.md section 7); compiled, one graph
call. ``s.calls(fn, *args)`` (`DecodeState.calls`) calls ``fn(*args)`` through the
generation's `EagerCalls`: this class calls it as it is (the eager path),
`compiled.CompiledCalls` compiles it (one graph per input signature). The functions are the same
on both paths, so are the rules.

What such a function may take: tensors and plain numbers (a warp's `Warp.args`), no generator (a
compiled graph cannot draw from one): a function that samples takes its uniforms, drawn before
the call from the generation's generator (`DecodeState.uniform`), so the two paths draw the same
numbers. It reads nothing back to the host (the one read-back per iteration is the loop's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtad_energy.decoding.runtime.graph_call import CompilesAfter


class EagerCalls(CompilesAfter):
    """Runs pure tensor functions eagerly. ``compile_s``: seconds this generation spent compiling
    them (none here), which the loop's clock leaves out, like a runner's."""

    compile_s = 0.0
    prewarm_s = 0.0
    eager_calls = 0

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)
