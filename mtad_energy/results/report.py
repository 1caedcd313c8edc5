"""A Markdown report with figures for one results store: ``write_report(store_dir)``.

The figures are drawn by `results.figures` (on their own Agg canvases, in seaborn's style for that
figure only, so a notebook's backend and rcParams are left alone). Each figure is saved as PNG (for
the report and quick looks) and SVG (for the paper).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from mtad_energy.results import analysis, breakdown, caveats, crossover
from mtad_energy.results.figures import (
    label_palette,
    plot_accepted_lengths,
    plot_batch_crossover,
    plot_batch_energy,
    plot_drafts,
    plot_jpt_vs_speedup,
    plot_ppl_vs_block_efficiency,
)
from mtad_energy.results.store import load_results
from mtad_energy.results.store_files import beside_store, check_output, outside_store

FIGURES = ("jpt_vs_speedup", "ppl_vs_block_efficiency", "batch_energy", "accepted_lengths")


# -- the report ------------------------------------------------------------------------------------
def _save(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.svg"]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths


def _simulated_note(rows: pd.DataFrame, what: str) -> list[str]:
    """A bold warning when some of ``rows`` were "measured" by the simulated meter."""
    n = breakdown.simulated_rows(rows)
    if not n:
        return []
    return [f"**Simulated energy**: {n} of {len(rows)} {what} used meter `simulated`, a modelled GPU "
            "and power sensor; their joules were not measured.", ""]


def _energy_notes(runs: pd.DataFrame, summary: pd.DataFrame, batch: pd.DataFrame,
                  decode_batch: pd.DataFrame) -> list[str]:
    notes = _simulated_note(runs, "runs") + _simulated_note(batch, "batch-sweep rows")
    if runs.empty and batch.empty and decode_batch.empty:
        return ["The store holds no rows."]
    if not runs.empty:
        notes += _run_energy_notes(runs, summary)
    for frame, what in ((runs, "runs"), (batch, "batch-sweep rows"),
                        (decode_batch, "decoding batch-size rows")):
        busy = analysis.contention_note(frame, what)  # measured on a busy machine: said, not pooled
        if busy:
            notes += ["**Contended:** " + busy.removeprefix("*: ") + ".", ""]
        eager = int(analysis.launch_bound_mask(frame).sum()) if not frame.empty else 0
        if eager:  # eager on a GPU: launches, not the algorithm
            notes += [f"**Launch-bound:** {eager} of the {len(frame)} {what}: "
                      + analysis.LAUNCH_BOUND_NOTE.removeprefix("launch-bound: ") + ".", ""]
    if not batch.empty and pd.to_numeric(batch["energy_j"], errors="coerce").isna().any():
        reasons = sorted({str(v) for v in batch["energy_reason"].dropna()}) or ["(no reason recorded)"]
        notes.append("Batch sweep rows without energy (the batch figure shows time instead when none "
                     f"has it): {'; '.join(reasons)}")
        notes.append("")
    if not decode_batch.empty:
        energy = pd.to_numeric(decode_batch["energy_j"], errors="coerce")
        missing = decode_batch[energy.isna()]
        if missing.empty:
            notes.append(f"Every decoding batch-size row ({len(decode_batch)}) has an energy reading.")
        else:
            notes += [f"{len(missing)} of {len(decode_batch)} decoding batch-size rows have no energy "
                      "reading (their J/token and energy saving are n/a). Recorded reasons:", ""]
            notes += _reason_lines(missing, "rows")
    return notes


def _reason_lines(missing: pd.DataFrame, what: str) -> list[str]:
    """One bullet per (meter, recorded reason) of the rows without energy, with their count."""
    reasons = (missing.assign(meter=missing["meter"].fillna("?"),
                              energy_reason=missing["energy_reason"].fillna("(no reason recorded)"))
               .groupby(["meter", "energy_reason"]).size())
    return [f"- meter `{meter}`: {reason} ({n} {what})" for (meter, reason), n in reasons.items()] + [""]


def _run_energy_notes(runs: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    energy = pd.to_numeric(runs["energy_j"], errors="coerce")
    missing = runs[energy.isna()]
    if missing.empty:
        return [f"Every run ({len(runs)}) has an energy reading.", ""]
    if len(missing) == len(runs):
        notes = [f"**No run has an energy reading** ({len(runs)} runs): J/token and energy "
                 "saving are n/a, and `jpt_vs_speedup` shows speed-up vs block efficiency "
                 "instead. Recorded reasons:"]
    else:
        notes = [f"{len(missing)} of {len(runs)} runs have no energy reading; a "
                 "configuration's J/token uses only its runs with energy "
                 "(`n_energy_runs` of `n_runs`). Recorded reasons:"]
    notes += ["", *_reason_lines(missing, "runs")]
    partial = summary[(summary["n_energy_runs"] > 0) & (summary["n_energy_runs"] < summary["n_runs"])]
    if not partial.empty:
        notes += ["Configurations whose J/token rests on part of their runs:", ""]
        notes += [f"- {r.label} ({r.model}, {r.dataset}): energy from {r.n_energy_runs} of {r.n_runs} "
                  "runs" for r in partial.itertuples()]
        notes.append("")
    return notes


def _store_line(store_dir: Path, runs: pd.DataFrame, summary: pd.DataFrame, batch: pd.DataFrame,
                decode_batch: pd.DataFrame) -> str:
    """What the store holds, table by table."""
    held = []
    if not runs.empty:
        held.append(f"{len(runs)} runs of {summary['label'].nunique()} decoder configurations; models "
                    f"{', '.join(sorted(map(str, runs['model'].unique())))}; datasets "
                    f"{', '.join(sorted(map(str, runs['dataset'].unique())))}; meters "
                    f"{', '.join(sorted(map(str, runs['meter'].dropna().unique())))}")
    if not batch.empty:
        held.append(f"{len(batch)} forward-only batch-size rows (`sweep batch-size`)")
    if not decode_batch.empty:
        held.append(f"{len(decode_batch)} decoding batch-size rows (`sweep batch-size --decoder`) of "
                    f"{decode_batch['decoder'].nunique()} decoders at batch sizes "
                    f"{', '.join(str(int(b)) for b in sorted(decode_batch['batch_size'].unique()))}")
    if not held:
        return f"Store `{store_dir}` holds no rows yet."
    return f"Store `{store_dir}`: " + "; ".join(held) + "."


def _crossover_section(decode_batch: pd.DataFrame, baseline: str, fig_dir: Path) -> list[str]:
    """One subsection per setting (model, dataset, tokens, device: never pooled): the table the
    CLI prints, its notes, and the figure."""
    cross = crossover.batch_crossover(decode_batch, baseline)
    settings = crossover.crossover_settings(cross)
    lines = ["## Decoders across batch sizes", "",
             f"B prompts decoded together per decoder and batch size (`sweep batch-size --decoder`): "
             f"tokens/s of all B rows and the speed-up and energy saving over `{baseline}` at the "
             f"same batch size (medians over the repeats; min-max: the speed-up's spread over "
             f"them). The last column is the crossover: "
             f"{crossover.CROSSOVER_RULE.format(baseline=baseline)}.", "",
             *_simulated_note(decode_batch, "decoding batch-size rows")]
    if len(settings) > 1:
        lines += [f"The store holds {len(settings)} settings (model, dataset, tokens, device); each "
                  "has its own table, never pooled with another.", ""]
    for i, (title, part) in enumerate(settings):
        name = "batch_crossover" if i == 0 else f"batch_crossover-{i + 1}"
        shown = crossover.crossover_display(part, baseline)
        notes = crossover.crossover_notes(part, baseline)[1:]  # the rule is stated above
        lines += [f"### {title}", "", f"{crossover.crossover_title(part).capitalize()}.", "",
                  analysis.to_markdown(shown.set_index(["decoder", "B"]), higher_is_better={}), ""]
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
        _save(plot_batch_crossover(part, f"{title}: decoders across batch sizes", baseline=baseline),
              fig_dir, name)
        lines += _figure_links([name]) + [""]
    return lines


def energy_model_section(store_dir: Path) -> list[str]:
    """"Where the joules go": both energy models fitted on the store's batch rows (coefficients,
    95 % intervals, verdicts), the roofline fit's error on the decode windows, and every decoder's
    decode joules by phase and by term (n/a with the reasons)."""
    from mtad_energy.energy.attribution import attribute, validate

    lines = ["## Where the joules go", "",
             "Two energy models fitted on this store's batch-sweep rows: the paper's E = P_static·T + "
             "PW_flop·T_flop + PW_mem·T_mem and the energy roofline E = pi0·T + eps_flop·FLOPs + "
             "eps_byte·bytes (counted work). A coefficient is *identified* when its column varies apart "
             "from the others and its 95 % interval is within ±25 %; otherwise the verdict "
             "names the measurement that would identify it.", ""]
    try:
        fits, n_rows = breakdown.fit_stores([store_dir])
    except ValueError as err:
        return [*lines, f"No energy model: {err}.", ""]
    for form, fit in fits.items():
        title = {"paper": "Paper form", "roofline": "Energy roofline"}[form]
        if isinstance(fit, str):
            lines += [f"**{title}**: not fitted: {fit}.", ""]
            continue
        lines += [f"**{title}** ({n_rows} batch rows; R² {fit.r2:.4f}, condition number "
                  f"{fit.condition_number:.3g}):", "",
                  "| term | value | 95 % interval | verdict |", "|:---|---:|---:|:---|"]
        lines += [f"| {c.symbol} ({c.unit}) | {c.value:.4g} | {c.ci_low:.4g} – {c.ci_high:.4g} | "
                  f"{c.verdict} |" for c in fit.coefficients]
        lines.append("")
    roofline = fits["roofline"]
    windows = breakdown.decode_windows([store_dir])
    if not isinstance(roofline, str) and not windows.empty:
        valid = validate(roofline, windows)
        if len(valid):
            lines += [f"The roofline fit predicts the decode energy of the {len(valid)} decoding "
                      f"window(s) it was not fitted on with a median |error| of "
                      f"{valid['error'].abs().median():.1%} (max {valid['error'].abs().max():.1%}).", ""]
    summary = breakdown.attribution_summary(attribute(windows, roofline))
    if summary.empty:
        return [*lines, "No decoding runs to attribute.", ""]
    cols = {"draft_j_per_token": "draft", "target_j_per_token": "target",
            "other_j_per_token": "other", "static_j_per_token": "static", "flop_j_per_token": "FLOP",
            "mem_j_per_token": "memory", "j_per_accepted_draft_token": "J/accepted draft token",
            "rejected_share": "rejected share", "scale": "scale"}
    table = summary.set_index(["source", "label", "batch_size"])[list(cols)].rename(columns=cols)
    lines += ["Decode joules per token by phase (draft / target / other) and by term (static / FLOP / "
              "memory), each set scaled to add up to the measured decode energy (`scale` = measured "
              "/ predicted); J per accepted draft token: the draft's joules per draft token kept; "
              "rejected share: the decode joules spent drafting and verifying rejected draft tokens.",
              "", analysis.to_markdown(table, higher_is_better={}), ""]
    reasons = sorted({r for r in summary["reason"] if isinstance(r, str)})
    if reasons:
        lines += ["n/a: " + "; ".join(reasons), ""]
    return lines


def schedule_section(decode_batch: pd.DataFrame, decoder: str = "spd") -> list[str]:
    """The speculation schedule of a decoding sweep, per objective (energy only where measured):
    the table of ranges and vLLM's mapping (`results.schedule`), or why there is none."""
    import json

    from mtad_energy.results.schedule import build_schedule, schedule_table

    lines = ["### Speculation schedule", "",
             f"Per batch-size range, the best configuration and `{decoder}`'s best gamma (0 where "
             "it does not beat `ar`), with the measured speed-up or energy saving behind it; the "
             "config is vLLM's `speculative_config` (`num_speculative_tokens_per_batch_size`: "
             "inclusive `[start, end, k]` ranges; `mtad-energy schedule` writes it).", ""]
    parts = crossover.crossover_settings(decode_batch) or [("", decode_batch)]
    for title, rows in parts:  # one schedule per setting: never pooled
        where = f" ({title})" if len(parts) > 1 else ""
        for objective in ("speed", "energy"):
            try:
                plan = build_schedule(rows, objective, decoder)
            except ValueError as err:
                lines += [f"**{objective}**{where}: no schedule: {err}.", ""]
                continue
            table = schedule_table(plan).set_index("batch sizes")
            config = plan.vllm_config()
            lines += [f"**{objective}**{where}:", "",
                      analysis.to_markdown(table, higher_is_better={}), "",
                      *[line for note in plan.notes for line in (f"Note: {note}.", "")],
                      *(["```json", json.dumps(config), "```", ""] if config is not None else [])]
    return lines


def drafts_section(summary: pd.DataFrame, runs: pd.DataFrame, baseline: str, fig_dir: Path
                   ) -> list[str]:
    """With more than one draft in the store (`mtad-energy sweep draft`): the drafts side by side
    (`drafts.draft_table`) and the draft-strength figure (`figures.plot_drafts`)."""
    from mtad_energy.results.drafts import draft_notes, draft_rows, draft_table

    rows = draft_rows(summary, runs, baseline) if not summary.empty else pd.DataFrame()
    if rows.empty or rows["draft_id"].nunique() < 2:
        return []
    _save(plot_drafts(rows), fig_dir, "drafts")
    table = draft_table(rows).set_index(["model", "dataset", "draft"])
    return ["## Drafts", "",
            "One row per draft, weakest first (SpD's accepted / drafted positions with it). "
            f"draft_cost: seconds per draft forward over `{baseline}`'s per target forward; BE: "
            f"block efficiency (tokens per target forward); x: speed-up over `{baseline}`. The "
            "figure puts each decoder's block efficiency over SpD's with the same draft (the "
            "paper's MTAD / SpD = 3.17 / 2.02 = 1.57 dashed) and its speed-up against SpD's "
            "acceptance.", "", analysis.to_markdown(table, higher_is_better={}), "",
            *[n.replace("*:", "\\*:", 1) + "." for n in draft_notes(rows)], "",
            *_figure_links(["drafts"]), ""]


def _figure_links(names: Sequence[str]) -> list[str]:
    return [f"![{n}](figures/{n}.png)  \n[SVG](figures/{n}.svg)" for n in names]


def write_report(store_dir: str | Path, out_dir: str | Path | None = None, baseline: str = "ar") -> Path:
    """Write ``report.md`` and ``figures/*.png|svg`` for the store in ``store_dir``; return the
    report's path. ``out_dir`` defaults to ``<store_dir>-report`` beside the store (a store holds
    only what mtad-energy wrote, so the report cannot go inside it)."""
    store_dir = Path(store_dir)
    out = outside_store(out_dir if out_dir is not None else beside_store(store_dir, "-report"),
                        store_dir, "the report directory (--out)")
    check_output(out, "--out", "the report directory", kind="folder")  # in no other store either
    runs = load_results(store_dir, "runs")  # before creating anything: is it a store at all?
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    steps = load_results(store_dir, "steps")
    batch = load_results(store_dir, "batch")
    summary = analysis.decoder_summary(runs, baseline=baseline)
    hist = analysis.accepted_length_histogram(steps, runs)
    curve = crossover.batch_curve(batch)
    palette = label_palette(summary) if not summary.empty else None

    decode_batch = load_results(store_dir, "decode_batch")
    lines = ["# mtad-energy report", "", _store_line(store_dir, runs, summary, batch, decode_batch), "",
             *[line for note in caveats.random_note(runs, batch, decode_batch)
               for line in (f"**Random weights**: {note}.", "")]]
    figures: list[str] = []
    if not summary.empty:
        has_energy = summary["energy_per_token_j"].notna().any()
        has_speedup = summary["speedup"].notna().any()
        metrics = ["tokens_per_s", *(["speedup"] if has_speedup else []),
                   *(["energy_per_token_j"] if has_energy else []), "perplexity",
                   *[m for m in ("pass_at_1", "rouge_l") if m in summary and summary[m].notna().any()]]
        lines += ["## Main table", "",
                  f"Decoders as rows, one column group per dataset. tokens/s is the mean of per-run "
                  f"tokens/s of the decode phase; speed-up is over `{baseline}` on the same model and "
                  "dataset, on that basis; J/token is total energy (prefill + decode) / total tokens; "
                  "the speed details give the decode-only J/token and the energy saving on the "
                  "decode basis (beside the speed-up) and on the total basis (beside the end-to-end "
                  "speed-up); PPL is perplexity under the target model. **Bold**: "
                  "best, <u>underlined</u>: second best (↑ higher is better, ↓ lower is better).", ""]
        if not has_speedup:
            lines += [f"No `{baseline}` runs, so there is no speed-up column.", ""]
        lines += _simulated_note(runs, "runs") if has_energy else []
        lines += [caveats.marked_main_table(summary, metrics, baseline), ""]
        detail = ["block_efficiency", "acceptance_rate", "tokens_per_s_pooled",
                  *(["decode_energy_per_token_j", "energy_saving", "speedup_total",
                     "energy_saving_total"] if has_energy and has_speedup else [])]
        lines += ["### Speed details", "",
                  "Block efficiency: tokens per target forward; accepted/depth: draft tokens kept / "
                  "draft positions on one path (comparable across chains, trees and multi-draft "
                  "decoders); pooled tokens/s: total tokens / total decode time; energy saving "
                  f"(decode): 1 - decode J/token / `{baseline}`'s, the basis of the speed-up; "
                  "energy saving (total) with the end-to-end speed-up, prefill included.", "",
                  caveats.marked_main_table(summary, detail, baseline), ""]
        for name, plot in (("jpt_vs_speedup", plot_jpt_vs_speedup),
                           ("ppl_vs_block_efficiency", plot_ppl_vs_block_efficiency)):
            _save(plot(summary, baseline, palette=palette), fig_dir, name)
            figures.append(name)
        lines += ["## Figures", "", *_figure_links(figures), ""]

    lines += drafts_section(summary, runs, baseline, fig_dir)
    lines += ["## Energy", "", *_energy_notes(runs, summary, batch, decode_batch), ""]
    lines += energy_model_section(store_dir)

    if not curve.empty:
        cols = [c for c in crossover.BATCH_COLUMNS if c != "batch_size"] + ["energy_per_run_rel"]
        index = ["model", "batch_size"] if curve["model"].nunique() > 1 else ["batch_size"]
        lines += ["## Batch size", "",
                  "A fixed number of target-model runs at each input batch size (the paper's batch-size "
                  "table); inputs = runs × batch size. If energy per run grows much more slowly than "
                  "the batch, memory traffic, not arithmetic, dominates the energy.", "",
                  *_simulated_note(batch, "batch-sweep rows"),
                  analysis.to_markdown(curve.set_index(index)[cols], higher_is_better={}), ""]
        _save(plot_batch_energy(curve), fig_dir, "batch_energy")
        figures.append("batch_energy")
        lines += _figure_links(["batch_energy"]) + [""]

    if not decode_batch.empty:
        lines += _crossover_section(decode_batch, baseline, fig_dir)
        lines += schedule_section(decode_batch)

    if not runs.empty:  # accepted lengths come from the profile runs' steps
        lines += ["## Accepted draft lengths", ""]
    if not runs.empty and hist.empty:
        lines += ["No drafting iterations recorded (no steps, or only decoders that do not draft).", ""]
    elif not runs.empty:
        stats = analysis.accepted_length_stats(hist).set_index("label").drop(columns="decoder")
        lines += ["Per decoder configuration, over iterations that proposed draft tokens: how many "
                  "were accepted.", "", analysis.to_markdown(stats, higher_is_better={}), ""]
        _save(plot_accepted_lengths(hist, palette=palette), fig_dir, "accepted_lengths")
        figures.append("accepted_lengths")
        lines += _figure_links(["accepted_lengths"]) + [""]

    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
