"""What the commands print: the decoders' summary table, the energy model's fit, validation and
attribution tables, a generation's statistics. Cells are plain text that wraps between words
(`output.wrapping_table`); n/a always comes with its reason.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from mtad_energy.cli.output import esc, wrapping_table


# -- display -----------------------------------------------------------------------------------
def fmt(x: Any, spec: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return spec.format(x)


def short_reason(reason: Any) -> str:
    from mtad_energy.results.analysis import short_reason

    return short_reason(reason)


def energy_text(value: Any, reason: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"n/a: {short_reason(reason)}"
    return f"{value:.4g}"


SIMULATED_NOTE = ("J/tok (simulated): meter 'simulated' models a GPU and its power sensor; these joules "
                  "were not measured")


def is_simulated(meter: Any) -> bool:
    """A summary's ``meter`` cell (meters joined by '; ') names the simulated meter."""
    return "simulated" in str(meter or "").split("; ")


ENERGY_COLUMNS = [("J/tok dec", "decode_energy_per_token_j"), ("draft", "draft_j_per_token"),
                  ("target", "target_j_per_token"), ("other", "other_j_per_token"),
                  ("J/acc. draft", "j_per_accepted_draft_token"), ("rejected", "rejected_share")]


# beside speed: what an iteration cost over its forwards, and the host work that explains it
HOST_TABLE_COLUMNS = [("cost/fwd", "host_overhead"), ("host ops/it", "host_ops_per_iter"),
                      ("graphs/it", "graph_calls_per_iter"), ("reads/it", "host_reads_per_iter")]

HOST_NOTE = ("cost/fwd: decode time over the forwards' own time; host ops/it: aten ops the host "
             "dispatched outside compiled graphs per iteration, graphs/it: compiled calls, reads/it: "
             "host reads of device values (counted in the warm-up; on a GPU each op costs ~6-8 us "
             "of host time; eager on the CPU, the warp's top-k shortcut reads too, which is free "
             "there and never taken on a GPU)")


ATTRIBUTED = {c for _, c in ENERGY_COLUMNS[1:]}  # from the energy model: n/a with its own reason


ENERGY_NOTE = ("draft / target / other: decode J/token of each phase (adding up to J/tok dec); J/acc. "
               "draft: draft joules per accepted draft token; rejected: share of the decode joules "
               "spent on rejected draft tokens")


def with_attribution(summary, runs, store_dir: Path):
    """``summary`` with each configuration's decode joules by phase, joules per accepted draft
    token, rejected share and scale factor, from the energy model fitted on the batch rows of
    ``store_dir`` (n/a with the reason in ``attribution_reason`` where there is none)."""
    from mtad_energy.energy.attribution import attribute
    from mtad_energy.results.analysis import GROUP_KEYS as keys
    from mtad_energy.results.breakdown import attribution_summary, roofline_fit, windows_from

    fit = roofline_fit([store_dir], f"give it this command's --output ({store_dir}) as DIR, "
                                    "then run this command again (its rows are kept)") \
        if (store_dir / "mtad-energy-store.json").exists() else \
        "no results store"
    att = attribution_summary(attribute(windows_from(runs), fit), keys=keys)
    if att.empty:
        return summary.assign(attribution_reason="no runs")
    att = att.drop(columns=["windows", "attributed"]).rename(columns={"reason": "attribution_reason"})
    merged = summary.copy()
    for k in keys:
        merged[k] = merged[k].astype(object).where(merged[k].notna(), "")
    return merged.merge(att, on=list(keys), how="left")


def summary_table(summary, title: str = "", columns: str = "speed") -> Table:
    """The decoders' summary: ``columns`` "speed" (speed, quality and J/token) or "energy"
    (decode joules by phase from the energy model, `with_attribution`)."""
    from mtad_energy.results.analysis import compile_note, contention_note

    reasons: set[str] = set()
    simulated = implausible = launch_bound = False
    if columns == "energy":
        cols = [("decoder", "label"), ("dataset", "dataset"), *ENERGY_COLUMNS]
    else:
        cols = [("decoder", "label"), ("dataset", "dataset"), ("runs", "n_runs"),
                ("tok/s", "tokens_per_s"), ("speed-up", "speedup"), ("blk eff", "block_efficiency"),
                ("accepted/depth", "acceptance_rate"), ("ppl", "perplexity"),
                ("J/tok dec", "decode_energy_per_token_j"), ("J/tok", "energy_per_token_j")]
        extra = [c for c in ("rouge_l", "pass_at_1") if c in summary and summary[c].notna().any()]
        cols += [(c.replace("_", "-"), c) for c in extra]
        cols += [(name, c) for name, c in HOST_TABLE_COLUMNS
                 if c in summary and summary[c].notna().any()]
    if "model" in summary and summary["model"].nunique() > 1:  # engines side by side, say
        cols.insert(0, ("model", "model"))
    rows = []
    for _, r in summary.iterrows():
        cells = []
        for _name, col in cols:
            v = r.get(col)
            if col in ("energy_per_token_j", "decode_energy_per_token_j"):
                cells.append(energy_text(v, None).split(":")[0])
                if cells[-1] == "n/a" and columns != "energy":  # energy: the attribution says why
                    reasons.add(energy_text(v, r.get("energy_reason")).removeprefix("n/a: "))
                elif cells[-1] != "n/a" and is_simulated(r.get("meter")):
                    simulated = True
                    if columns != "energy":  # energy: the caption says so (the columns are many)
                        cells[-1] += " (simulated)"
            elif col in ("label", "dataset", "model"):
                busy = col == "label" and columns == "energy" and r.get("n_contended")
                eager = col == "label" and bool(r.get("launch_bound"))
                launch_bound |= eager
                cells.append(esc(v) + ("*" if busy else "") + (" (launch-bound)" if eager else ""))
            elif col == "n_runs":  # "*": some were measured on a busy machine (caption)
                cells.append(str(int(v)) + ("*" if r.get("n_contended") else ""))
            elif col in ATTRIBUTED:
                if v is None or v != v:
                    cells.append("n/a")
                    if isinstance(r.get("attribution_reason"), str):
                        reasons.add(r["attribution_reason"])
                else:
                    cells.append(f"{v:.1%}" if col == "rejected_share" else f"{v:.3g}")
            else:
                cells.append(fmt(v, "{:.1f}" if col in ("tokens_per_s", "host_ops_per_iter",
                                                        "graph_calls_per_iter") else
                                 "{:.3f}" if col == "perplexity" else "{:.2f}"))
                if col == "speedup" and str(r.get("implausible")) == "True":
                    cells[-1] += " !"
                    implausible = True
        rows.append(cells)
    table = wrapping_table([name for name, _ in cols], rows, left=("decoder", "dataset"),
                           title=esc(title) or None)
    captions = [SIMULATED_NOTE] if simulated else []
    if implausible:
        from mtad_energy.results.analysis import IMPLAUSIBLE_NOTE

        captions.append(IMPLAUSIBLE_NOTE.format(baseline="ar"))
    if columns == "energy":
        scale = summary["scale"].dropna() if "scale" in summary else []
        captions.append(ENERGY_NOTE + (f"; measured / predicted by the energy model: "
                                       f"{min(scale):.3f} to {max(scale):.3f}" if len(scale) else ""))
    elif not reasons:
        captions.append("tok/s, speed-up and J/tok dec: decode phase; J/tok: prefill + decode")
    if columns != "energy" and any(c in summary and summary[c].notna().any()
                                   for _, c in HOST_TABLE_COLUMNS):
        captions.append(HOST_NOTE)
    if reasons:
        captions.append(("n/a: " if columns == "energy" else "J/tok n/a: ") + "; ".join(sorted(reasons)))
    if compiling := compile_note(summary):
        captions.append(compiling)
    if launch_bound:
        from mtad_energy.results.analysis import LAUNCH_BOUND_NOTE

        captions.append(LAUNCH_BOUND_NOTE)
    captions += [n for n in [contention_note(summary)] if n]
    if captions:
        table.caption = esc("\n".join(captions))
    return table


def batch_sweep_table(table, rows: list[dict], busy: set[int], simulated: bool,
                      contended: str | None) -> Table:
    """The forward-only batch-size study's table (`bench.batch_sweep.batch_table` of ``rows``):
    ``*`` after a batch size measured on a busy machine (``busy``; ``contended``: the caption's
    line), energy n/a with the reasons."""
    t = wrapping_table([str(c) for c in table.columns],
                       [[str(int(v)) + ("*" if int(v) in busy else "") if c == table.columns[0] else
                         energy_text(v, None).split(":")[0] if "Energy" in c else fmt(v, "{:.4g}")
                         for c, v in r.items()] for _, r in table.iterrows()],
                       title="batch size vs energy")
    reasons = {energy_text(None, row.get("energy_reason")) for row in rows if row.get("energy_j") is None}
    captions = ["Energy " + "; ".join(sorted(reasons))] if reasons else []
    if simulated and len(reasons) < len(rows):
        t.title = "batch size vs energy (simulated)"
        captions.insert(0, SIMULATED_NOTE.replace("J/tok", "Energy"))
    captions += [contended] if contended else []
    if captions:
        t.caption = esc("\n".join(captions))
    return t


def draft_sweep_table(rows) -> Table:
    """`sweep draft`'s view (`results.drafts.draft_table` of ``rows``): a row per draft, weakest
    (lowest SpD acceptance) first; its cost relative to the target, SpD's acceptance, each
    decoder's block efficiency (BE) and speed-up over the baseline (x)."""
    from mtad_energy.results.drafts import draft_notes, draft_table

    table = draft_table(rows)
    keys = [c for c in ("model", "dataset") if c in table and table[c].nunique() > 1]
    names = {"draft_cost": "cost q/p", "spd_acceptance": "SpD acc."}
    text = (*keys, "draft", "flags")
    columns = [*keys, "draft", *[c for c in table.columns if c not in ("model", "dataset", "draft")]]
    t = wrapping_table([names.get(c, c) for c in columns],
                       [[esc(str(r[c])) if c in text else fmt(r[c]) for c in columns]
                        for _, r in table.iterrows()],
                       left=[*keys, "draft"], keys=[*keys, "draft"], title="drafts side by side")
    t.caption = esc("\n".join(["cost q/p: seconds per draft forward over the target's (the "
                                "baseline's); SpD acc.: spd's accepted/drafted positions; BE: "
                                "tokens per target forward; x: speed-up", *draft_notes(rows)]))
    return t


FORM_NAMES = {"paper": "paper form E = P_static*T + PW_flop*T_flop + PW_mem*T_mem",
              "roofline": "energy roofline E = pi0*T + eps_flop*FLOPs + eps_byte*bytes"}


def fit_table(form: str, fit, n_rows: int) -> Table:
    """One form's coefficients with their 95 % intervals and verdicts."""
    t = Table(title=esc(f"{FORM_NAMES[form]} ({n_rows} batch rows)"), title_justify="left",
              show_edge=False, caption_justify="left")
    for col in ("term", "value", "95 % interval", "verdict"):
        t.add_column(col, justify="left" if col in ("term", "verdict") else "right",
                     no_wrap=col != "verdict")
    for c in fit.coefficients:
        t.add_row(f"{c.symbol} ({c.unit})", f"{c.value:.4g}", f"{c.ci_low:.4g} - {c.ci_high:.4g}",
                  esc(c.verdict))
    t.caption = esc(f"R^2 {fit.r2:.4f}, RMSE {fit.rmse_j:.4g} J, max |rel. error| "
                    f"{fit.max_abs_rel_error:.1%}, condition number {fit.condition_number:.3g}")
    return t


def validation_table(valid, max_rows: int) -> Table:
    t = Table(title="held-out decode windows: roofline prediction vs measurement",
              title_justify="left", show_edge=False, caption_justify="left")
    for col in ("from", "decoder", "B", "measured J", "predicted J", "error"):
        t.add_column(col, justify="left" if col in ("from", "decoder") else "right",
                     overflow="fold")
    for _, r in valid.head(max_rows).iterrows():
        t.add_row(SOURCES.get(r.source, esc(r.source)), esc(r.label), str(int(r.batch_size)),
                  f"{r.decode_energy_j:.4g}",
                  f"{r.predicted_j:.4g}", f"{r.error:+.1%}")
    if len(valid) > max_rows:
        t.caption = f"... {len(valid) - max_rows} more (--max-rows, or --json for all)"
    return t


SOURCES = {"runs": "runs", "decode_batch": "B sweep"}  # the tables decode windows come from


def attribution_tables(summary) -> list[Table]:
    """Per table, decoder and batch size: decode joules per token by phase, then by term with
    the joules per accepted draft token and the rejected share; n/a with the reasons."""
    key = [("from", "source"), ("decoder", "label"), ("B", "batch_size")]
    parts = (
        ("decode J/token by phase (phases add up to the measured decode energy)",
         [("draft", "draft_j_per_token"), ("target", "target_j_per_token"),
          ("other", "other_j_per_token"), ("scale", "scale")],
         "scale: measured / predicted decode energy (1 = the model explains the window)"),
        ("decode J/token by term, and the price of drafting",
         [("static", "static_j_per_token"), ("FLOP", "flop_j_per_token"),
          ("memory", "mem_j_per_token"), ("J/acc. draft", "j_per_accepted_draft_token"),
          ("rejected", "rejected_share")],
         "J/acc. draft: draft joules per accepted draft token; rejected: share of the decode "
         "joules spent drafting and verifying draft tokens that were rejected"),
    )
    reasons = sorted({r for r in summary["reason"] if isinstance(r, str)})
    tables = []
    for title, cols, note in parts:
        rows = []
        for _, r in summary.iterrows():
            cells = [SOURCES.get(r.source, esc(r.source)), esc(r.label), str(int(r.batch_size))]
            for _name, col in cols:
                v = r[col]
                cells.append("n/a" if v != v else f"{v:.1%}" if col == "rejected_share"
                             else f"{v:.3g}")
            rows.append(cells)
        tables.append(wrapping_table([name for name, _ in (*key, *cols)], rows,
                                     left=("from", "decoder"), title=title,
                                     caption=esc(note + ("\nn/a: " + "; ".join(reasons)
                                                         if reasons else ""))))
    return tables


def stats_table(rows: list[tuple[str, dict]]) -> Table:
    """One row per (label, stats dict)."""

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    cells = [[esc(label), str(s["tokens_emitted"]), f(s["tokens_per_s"], "{:.1f}"),
              f(s["block_efficiency"]), f(s["acceptance_rate"]), f(s["perplexity"], "{:.3f}"),
              f(s["time_draft_s"]), f(s["time_target_s"]), f(s["time_other_s"])] for label, s in rows]
    return wrapping_table(("decoder", "tokens", "tokens/s", "block eff.", "accepted/depth", "perplexity",
                           "draft s", "target s", "other s"), cells, left=("decoder",))
