"""The audit over a running server (issue 55, item 1): does a served engine's speculation follow
its target, and do its counters tell the truth about its output?

`audit_output.audit_served` on the requests an `HttpEngine` served (`HttpEngine.served_requests`):
their prompts and the server's token ids, the speculative counts the server reported (per request
from the response body where it gave them, else its ``/metrics`` counters diffed around each
batch) and the target's warped distribution teacher-forced along each output (the audit loads
the target: p~ is what it tests against). The server's drafting must be one whose steps can be
read off the output: n-gram prompt lookup (vLLM's ``ngram`` method, `audit.ngram_proposer`),
whose proposals the output and the prompt fix. A server that reports no counts has nothing to
audit but its output (`UnsupportedError` names it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mtad_energy.engines import audit
from mtad_energy.engines import audit_output as ao
from mtad_energy.engines.registry import UnsupportedError

if TYPE_CHECKING:  # types only
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.http import HttpEngine, ServedRequest


def counters_delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None,
                   k: int) -> audit.Measured | None:
    """One batch's counters from the /metrics readings around it (`server_protocol.
    spec_counters`' keys), None without them or without vLLM's count of drafting steps."""
    if before is None or after is None or not {"drafts", "proposed", "accepted"} <= set(after):
        return None
    d = {key: int(after[key] - before.get(key, 0.0)) for key in after}
    per_pos = tuple(d.get(f"accepted_pos_{j}", 0) for j in range(k)) \
        if any(key.startswith("accepted_pos_") for key in d) else ()
    return audit.Measured(d["drafts"], d["proposed"], d["accepted"], per_pos)


def body_counts(requests: Sequence[ServedRequest], k: int) -> audit.Measured | None:
    """The counters the requests' bodies add up to, None unless each reported its drafting
    steps (llama-server's ``timings`` do not count them)."""
    specs = [r.spec for r in requests]
    if not specs or any(s is None or s.drafts is None for s in specs):
        return None
    per_pos = [s.accepted_per_pos for s in specs]  # type: ignore[union-attr]
    pos = tuple(sum((p[j] if j < len(p) else 0) for p in per_pos) for j in range(k)) \
        if all(p is not None for p in per_pos) else ()  # type: ignore[index, arg-type]
    return audit.Measured(sum(s.drafts for s in specs), sum(s.proposed for s in specs),  # type: ignore[union-attr, misc]
                          sum(s.accepted for s in specs), pos)  # type: ignore[union-attr]


def server_counts(engine: HttpEngine, k: int) -> audit.Measured:
    """Every batch's counters summed: a batch's bodies where every request of it reported its
    counts (they win, as in the rows), else its /metrics counters; `UnsupportedError` where a
    batch has neither."""
    total = audit.Measured(0, 0, 0, (0,) * k)
    for b, (before, after) in enumerate(engine.batch_counters):
        batch = [r for r in engine.served_requests if r.batch == b]
        m = body_counts(batch, k) or counters_delta(before, after, k)
        if m is None:
            raise UnsupportedError(
                f"the server at {engine.base_url} reported no speculative counts for batch {b} "
                "(no per-request counts in its bodies, no spec_decode counters in its /metrics): "
                "its counters cannot be audited; run vLLM with --per-request-spec-decode-metrics "
                "or with its /metrics")
        pos = tuple(a + c for a, c in zip(total.accepted_per_pos, m.accepted_per_pos, strict=True)) \
            if m.accepted_per_pos and total.accepted_per_pos else ()
        total = audit.Measured(total.drafts + m.drafts, total.draft_tokens + m.draft_tokens,
                               total.accepted_tokens + m.accepted_tokens, pos)
    return total


def audit_server(engine: HttpEngine, target: Any, warp: Warp, k: int, min_n: int, max_n: int,
                 config: str = "server", level: float = 1e-3, tolerance: float = 0.0
                 ) -> ao.Verdict:
    """The audit of every request ``engine`` served, its server drafting by n-gram prompt lookup
    (``k`` tokens, suffixes of ``min_n``..``max_n``, as its ``--speculative-config``): each
    output's steps read off it (`audit_output.point_mass_served`), p~ the target's under
    ``warp`` (the server's sampling parameters), the counters of `server_counts`."""
    if not engine.served_requests:
        raise UnsupportedError("the engine served no request: generate before auditing it")
    if any(not r.output for r in engine.served_requests):
        raise UnsupportedError(f"the server at {engine.base_url} returned no token ids: the "
                               "audit reads the steps off them (serve with token ids: vLLM)")
    measured = server_counts(engine, k)
    served = []
    for r in engine.served_requests:
        s = ao.point_mass_served(r.output, audit.warped_along(target, r.prompt, r.output, warp),
                                 audit.ngram_proposer(r.prompt, r.output, min_n, max_n, k))
        own = r.spec.steps if r.spec is not None else None
        served.append(s if own is None else replace(s, reported=story(s.steps, own)))
    return ao.audit_served(config, served, measured, k, level, tolerance, always_drafts=False)


def story(read: Sequence[tuple[int, int]], drafting: Sequence[tuple[int, int]]
          ) -> tuple[tuple[int, int], ...]:
    """The server's own steps where it lists them (vLLM's ``detailed`` per-step arrays: its
    drafting steps only), set in the places of the drafting steps read off its output (the
    undrafted ones as read), for `audit_output.reported_contradictions`; a server listing
    another number of drafting steps than its output shows: its list as it is (the audit names
    the mismatch)."""
    slots = [i for i, (d, _) in enumerate(read) if d]
    if len(slots) != len(drafting):
        return tuple(drafting)
    out = list(read)
    for i, step in zip(slots, drafting, strict=True):
        out[i] = step
    return tuple(out)
