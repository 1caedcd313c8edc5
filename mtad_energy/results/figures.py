"""The report's figures (`plot_*`): J/token against speed-up, perplexity against block
efficiency, energy against batch size, accepted draft lengths, the decoders across batch sizes, and
block efficiency and speed-up against draft strength (`plot_drafts`), tuned against default
(`plot_tuned_vs_default`);
with the drawing helpers they share (one colour per decoder label, labels placed off the points and
each other, one panel per model and dataset).

Figures are drawn on Agg canvases attached to each `Figure` (no pyplot, no global backend
switch), so drawing them from a notebook leaves its inline backend alone, and seaborn's style
is applied in a context, so the caller's rcParams are untouched. `report.write_report` saves each
as PNG and SVG.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
from matplotlib.transforms import Bbox

from mtad_energy.results import analysis

_AXIS = {
    "speedup": "speed-up over {baseline} (×, tokens/s ratio)",
    "tokens_per_s": "decoding speed (tokens/s)",
    "energy_per_token_j": "energy per token (J/token)",
    "block_efficiency": "block efficiency (tokens / iteration)",
    "perplexity": "perplexity under the target model",
}


# -- drawing helpers -------------------------------------------------------------------------------
def _style():
    # a context manager pair: seaborn's look for this figure only
    return sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.85)


def _new_figure(nrows: int, ncols: int, width_in: float, height_in: float) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width_in * ncols, height_in * nrows))
    FigureCanvasAgg(fig)  # the non-interactive Agg backend, for this figure only
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _layout(fig: Figure) -> None:
    """Titles fitted (`_fit_title`: the figure's title to the figure's width, each panel's to its
    panel's), then the tight layout, so every title lies inside the figure."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if ax.get_visible():
            _fit_title(ax.title, ax.get_window_extent(renderer).width, renderer)
    if fig._suptitle is not None:
        _fit_title(fig._suptitle, 0.96 * fig.bbox.width, renderer)
    fig.tight_layout()


def _fit_title(text, room_px: float, renderer) -> None:
    """Wrap ``text`` (a title) between words until it is at most ``room_px`` wide."""
    for _ in range(6):  # each pass estimates the characters per line from the measured width
        width = text.get_window_extent(renderer).width
        if width <= room_px or not text.get_text():
            return
        lines = text.get_text().split("\n")
        chars = max(8, int(max(map(len, lines)) * room_px / width) - 1)
        text.set_text("\n".join(textwrap.fill(line, chars) or line for line in lines))


def label_palette(frame: pd.DataFrame) -> dict[str, tuple]:
    """One colour per decoder label (``frame`` has decoder and label columns), in the paper's
    decoder order; pass the same palette to every figure so a decoder keeps its colour."""
    return _palette(_ordered_labels(frame))


def _palette(labels: Sequence[str]) -> dict[str, tuple]:
    # tab10 then Dark2: distinct hues for up to 18 labels, evenly spaced ones beyond
    colours = (sns.color_palette("tab10") + sns.color_palette("Dark2"))[:len(labels)]
    if len(labels) > 18:
        colours = sns.color_palette("husl", len(labels))
    return dict(zip(labels, colours, strict=True))


def _ordered_labels(frame: pd.DataFrame) -> list[str]:
    pairs = frame[["decoder", "label"]].drop_duplicates()
    pairs = pairs.assign(rank=pairs["decoder"].map(analysis.decoder_rank)).sort_values(
        ["rank", "decoder", "label"])
    return pairs["label"].tolist()


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


_DIRECTIONS = ((1, 1, "left", "bottom"), (1, -1, "left", "top"), (-1, 1, "right", "bottom"),
               (-1, -1, "right", "top"), (0, 1, "center", "bottom"), (0, -1, "center", "top"),
               (1, 0, "left", "center"), (-1, 0, "right", "center"))


def annotate_points(ax: Axes, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str],
                    colours: Sequence | None = None, fontsize: float = 8.0) -> None:
    """Label points without overlapping each other, the markers or the axes' edge where one of a
    few candidate positions allows it (nearest first; further ones get a leader line). Call after
    the axes' limits and the figure layout are final: placement works in display coordinates."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    data = [(x, y, t, (colours[i] if colours is not None else "0.15"))
            for i, (x, y, t) in enumerate(zip(xs, ys, texts, strict=True))
            if np.isfinite(x) and np.isfinite(y)]
    marker_px = 5.0
    centres = ax.transData.transform([(x, y) for x, y, _, _ in data]) if data else []
    markers = [Bbox.from_bounds(px - marker_px, py - marker_px, 2 * marker_px, 2 * marker_px)
               for px, py in centres]
    placed: list[Bbox] = []
    # label crowded points (nearest neighbour closest) first, while most room is left
    def crowding(i: int) -> float:
        d = [math.dist(centres[i], c) for j, c in enumerate(centres) if j != i]
        return min(d, default=math.inf)

    for i in sorted(range(len(data)), key=crowding):
        x, y, text, colour = data[i]
        best = None
        for radius in (7.0, 16.0, 28.0):
            for dx, dy, ha, va in _DIRECTIONS:
                arrow = {"arrowstyle": "-", "color": "0.5", "lw": 0.6} if radius > 7 else None
                ann = ax.annotate(text, (x, y), xytext=(dx * radius, dy * radius),
                                  textcoords="offset points", ha=ha, va=va, fontsize=fontsize,
                                  color=colour, arrowprops=arrow)
                box = ann.get_window_extent(renderer).padded(2)
                cost = sum(_overlap(box, b) for b in placed)
                cost += sum(_overlap(box, m) for j, m in enumerate(markers) if j != i)
                inside = _overlap(box, frame)
                cost += 4 * (box.width * box.height - inside)  # leaving the axes is worst
                if best is None or cost < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (cost, ann, box)
                else:
                    ann.remove()
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        if best is not None:
            placed.append(best[2])


def _log2_axis(ax: Axes, values: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({float(v) for v in values if np.isfinite(v)})
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())


def _panels(summary: pd.DataFrame) -> list[tuple[str, str]]:
    return sorted(summary[["model", "dataset"]].drop_duplicates().itertuples(index=False, name=None))


def _panel_title(model: str, dataset: str, multi_model: bool) -> str:
    return f"{model} · {dataset}" if multi_model else f"dataset: {dataset}"


def _scatter_panels(summary: pd.DataFrame, x: str, y: str, title: str, baseline: str,
                    ref_x: float | None = None, ref_y_col: str | None = None,
                    yerr: tuple[str, str] | None = None, palette: dict | None = None,
                    note: str = "") -> Figure:
    """One panel per (model, dataset), one annotated point per decoder label."""
    panels = _panels(summary)
    multi_model = summary["model"].nunique() > 1
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    palette = palette or label_palette(summary)
    style, context = _style()
    with style, context:
        fig, axes = _new_figure(nrows, ncols, 5.6, 4.6)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (model, dataset) in zip(axes.flat, panels, strict=False):
            d = summary[(summary["model"] == model) & (summary["dataset"] == dataset)]
            d = d[d[x].notna() & d[y].notna()]
            if yerr is not None and d[list(yerr)].notna().all(axis=None):
                ax.errorbar(d[x], d[y], yerr=[d[y] - d[yerr[0]], d[yerr[1]] - d[y]], fmt="none",
                            ecolor="0.55", elinewidth=1, capsize=2, zorder=1)
            sns.scatterplot(data=d, x=x, y=y, hue="label", palette=palette, s=70, ax=ax, legend=False,
                            edgecolor="white", linewidth=0.6, zorder=2)
            if ref_x is not None:
                ax.axvline(ref_x, color="0.6", ls="--", lw=1, zorder=0)
            base = d[(d["label"] == baseline) | (d["decoder"] == baseline)]
            if ref_y_col is not None and not base.empty and np.isfinite(base[ref_y_col].iloc[0]):
                ax.axhline(base[ref_y_col].iloc[0], color="0.6", ls=":", lw=1, zorder=0)
            ax.set_xlabel(_AXIS.get(x, x).format(baseline=baseline))
            ax.set_ylabel(_AXIS.get(y, y).format(baseline=baseline))
            ax.set_title(_panel_title(model, dataset, multi_model))
            if d.empty:
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="0.4")
            ax.margins(x=0.18, y=0.18)
        has_base = ((summary["label"] == baseline) | (summary["decoder"] == baseline)).any()
        fig.suptitle(f"{title}\n{note}" if note and has_base else title)  # no line, no legend for it
        _layout(fig)
        for ax, (model, dataset) in zip(axes.flat, panels, strict=False):
            d = summary[(summary["model"] == model) & (summary["dataset"] == dataset)]
            annotate_points(ax, d[x].to_numpy(float), d[y].to_numpy(float), d["label"].tolist(),
                            [palette[label] for label in d["label"]])
    return fig


# -- the figures -----------------------------------------------------------------------------------
def plot_jpt_vs_speedup(summary: pd.DataFrame, baseline: str = "ar", palette: dict | None = None
                        ) -> Figure:
    """J/token against speed-up over ``baseline``; without any energy reading, speed-up against
    block efficiency instead (the title says so); without a baseline, tokens/s on the x axis."""
    has_speedup = summary["speedup"].notna().any()
    x = "speedup" if has_speedup else "tokens_per_s"
    if summary["energy_per_token_j"].notna().any():
        ci = ("energy_per_token_ci_low_j", "energy_per_token_ci_high_j")
        title = (f"Energy per token vs speed-up over {baseline} (lower right is better)" if has_speedup
                 else f"Energy per token vs speed (no {baseline} baseline for a speed-up)")
        return _scatter_panels(summary, x, "energy_per_token_j", title, baseline,
                               ref_x=1.0 if has_speedup else None, ref_y_col="energy_per_token_j",
                               yerr=ci if set(ci) <= set(summary.columns) else None, palette=palette,
                               note=f"dotted: {baseline}'s J/token; dashed: {baseline}'s speed (1×)"
                               if has_speedup else f"dotted: {baseline}'s J/token")
    title = (f"No energy measured (meter: {', '.join(sorted(set(summary['meter'].dropna())))}): "
             f"{'speed-up' if has_speedup else 'speed'} vs block efficiency instead of J/token")
    return _scatter_panels(summary, "block_efficiency", x, title, baseline, ref_x=None,
                           ref_y_col=x if has_speedup else None, palette=palette,
                           note=f"dotted: {baseline}'s speed (1×)" if has_speedup else "")


def plot_ppl_vs_block_efficiency(summary: pd.DataFrame, baseline: str = "ar",
                                 palette: dict | None = None) -> Figure:
    return _scatter_panels(summary, "block_efficiency", "perplexity",
                           "Perplexity vs block efficiency (lower right is better)", baseline,
                           ref_y_col="perplexity", palette=palette,
                           note=f"dotted: {baseline}'s perplexity")


def plot_batch_energy(curve: pd.DataFrame) -> Figure:
    """Energy per run and per input against batch size (log2 axis); time when no energy."""
    has_energy = curve["energy_per_run_j"].notna().any()
    if has_energy:
        cols = (("energy_per_run_j", "energy per run (J)"), ("energy_per_input_j", "energy per input (J)"))
        title = "Energy vs batch size (fixed number of target-model runs)"
    else:
        cols = (("time_per_run_s", "time per run (s)"), ("time_per_input_s", "time per input (s)"))
        title = "No energy measured: time vs batch size instead (fixed number of target-model runs)"
    multi_model = curve["model"].nunique() > 1
    style, context = _style()
    with style, context:
        fig, axes = _new_figure(1, 2, 5.2, 4.2)
        for ax, (col, ylabel) in zip(axes.flat, cols, strict=True):
            sns.lineplot(data=curve, x="batch_size", y=col, hue="model" if multi_model else None,
                         marker="o", ax=ax, legend=multi_model and ax is axes.flat[0])
            _log2_axis(ax, curve["batch_size"])
            sizes = curve["batch_size"].to_numpy(float)
            values = curve[col].to_numpy(float)
            if not multi_model:
                # the label goes on the side the line does not: upper left of a rising curve,
                # upper right of a falling one
                rising = np.nanmean(np.diff(values)) > 0 if len(values) > 1 else True
                for b, v in zip(sizes, values, strict=True):
                    if np.isfinite(v):
                        ax.annotate(analysis.format_value(v, analysis.column_decimals([v])), (b, v),
                                    xytext=(-5 if rising else 5, 6), textcoords="offset points",
                                    ha="right" if rising else "left", fontsize=8)
            ax.set_xlim(np.nanmin(sizes) / 1.5, np.nanmax(sizes) * 1.5)
            ax.set_xlabel("batch size (inputs per target run, log₂ scale)")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.12)
            name = ylabel.split(" (")[0].capitalize()
            finite = np.isfinite(values)
            if not multi_model and "per run" in ylabel and finite.sum() > 1:
                lo, hi = np.flatnonzero(finite)[[0, -1]]
                name += (f": ×{values[hi] / values[lo]:.2f} for a {sizes[hi] / sizes[lo]:g}× larger batch")
            ax.set_title(name)
        fig.suptitle(title)
        _layout(fig)
    return fig


def plot_accepted_lengths(histogram: pd.DataFrame, palette: dict | None = None) -> Figure:
    """Share of drafting iterations that accepted k draft tokens, one panel per decoder label."""
    labels = _ordered_labels(histogram)
    palette = palette or _palette(labels)
    stats = analysis.accepted_length_stats(histogram).set_index("label")
    ncols = min(len(labels), 3)
    nrows = math.ceil(len(labels) / ncols)
    longest = int(histogram["accepted"].max())
    style, context = _style()
    with style, context:
        fig, axes = _new_figure(nrows, ncols, 3.9, 3.0)
        for ax in axes.flat[len(labels):]:
            ax.set_visible(False)
        top = min(1.0, float(histogram["fraction"].max()) * 1.15)
        for i, (ax, label) in enumerate(zip(axes.flat, labels, strict=False)):
            d = histogram[histogram["label"] == label]
            ax.bar(d["accepted"], d["fraction"], color=palette[label], width=0.8)
            ax.set_xticks(range(longest + 1))
            ax.set_xlim(-0.6, longest + 0.6)
            ax.set_ylim(0, top)
            ax.set_title(f"{label} (mean {stats.loc[label, 'mean_accepted']:.2f})")
            # axis labels on the outer panels only: the panels share both axes
            last_row = i + ncols >= len(labels)
            ax.set_xlabel("accepted draft tokens per iteration" if last_row else "")
            ax.set_ylabel("share of iterations" if i % ncols == 0 else "")
        fig.suptitle("Accepted draft length per iteration (iterations that drafted)")
        _layout(fig)
    return fig


def plot_batch_crossover(table: pd.DataFrame, title: str = "", baseline: str = "ar") -> Figure:
    """Speed-up over ``baseline`` and energy saving against batch size (`crossover.batch_crossover`
    of one setting), one line per decoder configuration through the medians, bars from the
    smallest to the largest repeat; a ring marks the crossover. Without energy readings the
    right panel says why (the rows' recorded reason); with the baseline alone, the figure says
    there is nothing to compare."""
    import matplotlib.ticker

    others = table[table["label"] != table["baseline_label"]] if not table.empty else table
    fig, axes = _new_figure(1, 2, 6, 4.5)
    axes = axes.ravel()
    if title:
        fig.suptitle(title, fontsize=10)
    if others.empty or others["speedup"].isna().all():
        for ax in axes:
            ax.set_axis_off()
        what = (f"only {baseline} was measured: no decoder to compare with it" if not table.empty
                and table["decoder"].eq(baseline).all() else f"no {baseline} rows: no speed-up to plot")
        axes[0].text(1.1, 0.5, what, ha="center", va="center", transform=axes[0].transAxes)
        _layout(fig)
        return fig
    has_energy = others["energy_saving"].notna().any()
    for label, g in others.groupby("label", sort=False):
        spread = g["repeats"] > 1
        line, = axes[0].plot(g["batch_size"], g["speedup"], marker="o", label=label)
        if spread.any():
            axes[0].errorbar(g.loc[spread, "batch_size"], g.loc[spread, "speedup"],
                             yerr=[g.loc[spread, "speedup"] - g.loc[spread, "speedup_min"],
                                   g.loc[spread, "speedup_max"] - g.loc[spread, "speedup"]],
                             fmt="none", ecolor=line.get_color(), elinewidth=1, capsize=3)
        if has_energy:
            axes[1].plot(g["batch_size"], g["energy_saving"], marker="o", color=line.get_color(),
                         label=label)
        cross = g["crossover_batch_size"].iloc[0]
        if math.isfinite(cross):
            at = g[g["batch_size"] == cross]
            axes[0].scatter(at["batch_size"], at["speedup"], s=180, facecolors="none",
                            edgecolors=line.get_color(), linewidths=2)
    axes[0].axhline(1.0, color="k", lw=1, ls="--")
    n = sorted({int(r) for r in others["repeats"]})
    reps = ("one repeat" if n == [1] else f"median of {n[0]} repeats" if len(n) == 1
            else "medians over repeats")
    axes[0].set(xscale="log", xlabel="batch size", ylabel=f"speed-up over {baseline} (×)",
                title=f"Speed-up over {baseline} ({reps}; ring: crossover)")
    if has_energy:
        axes[1].axhline(0.0, color="k", lw=1, ls="--")
        axes[1].set(xscale="log", xlabel="batch size", ylabel=f"energy saving vs {baseline} (J/token)",
                    title=f"Energy saving over {baseline}")
        axes[1].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    else:
        reasons = sorted({analysis.short_reason(r) for r in table["energy_reason"].dropna()})
        axes[1].text(0.5, 0.12, "no energy measured: " + "; ".join(reasons), ha="center", va="center",
                     wrap=True, transform=axes[1].transAxes)
        axes[1].set_axis_off()
    sizes = sorted({int(b) for b in table["batch_size"]})
    for ax in axes[:1 + has_energy]:
        ax.set_xticks(sizes, labels=[str(b) for b in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
        if has_energy:
            ax.legend(fontsize=8)
    if not has_energy:  # the legend goes to the free right panel, off the lines
        axes[1].legend(*axes[0].get_legend_handles_labels(), loc="upper center", fontsize=9,
                       ncols=2, title="decoder")
    _layout(fig)
    return fig


def plot_drafts(rows: pd.DataFrame, paper_ratio: float = 3.17 / 2.02) -> Figure:
    """Block efficiency over SpD's with the same draft (left; the paper's MTAD / SpD = 1.57 a
    dashed line) and speed-up over the baseline (right) against SpD's acceptance with each draft,
    one line per decoder labelled at its right end, the drafts named under SpD's points; a row
    of panels per model and dataset. Rows: `drafts.draft_rows`."""
    data = rows.dropna(subset=["spd_acceptance"]).sort_values("spd_acceptance")
    order = [d for d in analysis.DECODER_ORDER if d in set(data["decoder"])]
    order += [d for d in dict.fromkeys(data["decoder"]) if d not in order]
    colours = _palette(order)
    panels = list(dict.fromkeys(zip(data["model"], data["dataset"], strict=True)))
    multi_model = len({m for m, _ in panels}) > 1
    style, context = _style()
    with style, context:
        fig, axes = _new_figure(max(1, len(panels)), 2, 5.8, 4.0)
        # the drafts' names at SpD's points and the decoders' at their lines' right ends,
        # placed once the layout is final (`annotate_points` keeps them apart)
        labels: dict[Axes, list[tuple]] = {}
        for row, (model, dataset) in enumerate(panels):
            here = data[(data["model"] == model) & (data["dataset"] == dataset)]
            for ax, column, ylabel in ((axes[row, 0], "be_vs_spd", "block efficiency / SpD's"),
                                       (axes[row, 1], "speedup", "speed-up over ar (×)")):
                for decoder in order:
                    line = here[here["decoder"] == decoder].dropna(subset=[column])
                    if line.empty or (column == "be_vs_spd" and decoder == "spd"):
                        continue  # spd / spd is 1: the black line
                    ax.plot(line["spd_acceptance"], line[column], marker="o", lw=1.6,
                            color=colours[decoder])
                    last = line.iloc[-1]
                    labels.setdefault(ax, []).append(
                        (last["spd_acceptance"], last[column], decoder, colours[decoder]))
                ax.axhline(1.0, color="black", lw=0.8)
                ax.set_ylabel(ylabel)
                ax.set_title(_panel_title(model, dataset, multi_model), fontsize=9)
                lo, hi = ax.get_xlim()
                ax.set_xlim(lo - (hi - lo) * 0.05, hi + (hi - lo) * 0.15)  # room for labels
            spd = here[here["decoder"] == "spd"].dropna(subset=["speedup"])
            labels.setdefault(axes[row, 1], []).extend(
                (x, y, str(d).removeprefix("self:"), "0.35")
                for x, y, d in zip(spd["spd_acceptance"], spd["speedup"], spd["draft_id"],
                                   strict=True))
            left = axes[row, 0]
            left.axhline(paper_ratio, color="grey", ls="--", lw=1)
            left.annotate(f"paper: MTAD / SpD = {paper_ratio:.2f}", (0.02, paper_ratio),
                          xytext=(0, 4), textcoords="offset points",
                          xycoords=("axes fraction", "data"), color="grey", fontsize=8)
            left.set_ylim(top=max(left.get_ylim()[1], paper_ratio * 1.1))
        for ax in axes[-1]:
            ax.set_xlabel("SpD acceptance with the draft (accepted / drafted)")
        from mtad_energy.results.drafts import draft_notes

        caveats = [n.split(" (")[0].split(";")[0] for n in draft_notes(data)] if len(data) else []
        fig.suptitle("\n".join(["Draft strength: block efficiency and speed-up per decoder",
                                 *caveats]), fontsize=11)
        _layout(fig)
        for ax, placed in labels.items():
            xs, ys, names, cs = zip(*placed, strict=True)
            annotate_points(ax, list(xs), list(ys), list(names), colours=list(cs))
    return fig


def plot_tuned_vs_default(table: pd.DataFrame, baseline: str = "ar", subtitle: str = "") -> Figure:
    """Each decoder's block efficiency (left) and perplexity (right) at its default setting
    (light bar) and its tuned one (dark bar), on the same held-out prompts, the value over each
    bar; the baseline's perplexity a dashed line (its block efficiency, 1, a solid one). One
    row of panels per dataset, ``subtitle`` (the pair, the criterion) under the title. Rows:
    `tuning.tuned_vs_default`."""
    panels = list(dict.fromkeys(table["dataset"]))
    style, context = _style()
    with style, context:
        fig, axes = _new_figure(len(panels), 2, 6.4, 4.2)
        for row, dataset in enumerate(panels):
            here = table[table["dataset"] == dataset]
            base = here[here["decoder"] == baseline]
            bars = here[here["decoder"] != baseline]
            decoders = list(dict.fromkeys(bars["decoder"]))
            colours = _palette(decoders)
            for ax, column, ylabel in (
                    (axes[row, 0], "block_efficiency",
                     "block efficiency (tokens / target step)"),
                    (axes[row, 1], "perplexity", "perplexity under the target")):
                for i, decoder in enumerate(decoders):
                    for offset, side, alpha in ((-0.2, "default", 0.35), (0.2, "tuned", 1.0)):
                        value = bars.loc[(bars["decoder"] == decoder) & (bars["side"] == side), column]
                        if value.empty or not math.isfinite(value.iloc[0]):
                            continue
                        ax.bar(i + offset, value.iloc[0], width=0.38, color=(*colours[decoder], alpha),
                               edgecolor="black", linewidth=0.6)  # light face, the same edge
                        ax.annotate(f"{value.iloc[0]:.2f}", (i + offset, value.iloc[0]),
                                    xytext=(0, 2), textcoords="offset points", ha="center",
                                    va="bottom", fontsize=7,  # readable over a reference line
                                    zorder=5, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
                ax.set_xticks(range(len(decoders)), decoders)
                ax.set_ylabel(ylabel)
                ax.set_title(f"{dataset}: {column.replace('_', ' ')}", fontsize=9)
                ax.margins(y=0.12)
            # the baselines, named in the titles (a label on the plot would lie under the bars)
            axes[row, 0].axhline(1.0, color="black", lw=0.8)
            axes[row, 0].set_title(f"{axes[row, 0].get_title()} (line: {baseline}'s, 1)", fontsize=9)
            ref = base["perplexity"].dropna()
            if len(ref):
                axes[row, 1].axhline(ref.iloc[0], color="black", ls="--", lw=1)
                axes[row, 1].set_title(f"{axes[row, 1].get_title()} (dashed: {baseline}'s, "
                                       f"{ref.iloc[0]:.2f})", fontsize=9)
        n = int(table["n_prompts"].max()) if len(table) else 0
        fig.suptitle("\n".join([f"Tuned (dark bars) against default (light bars), the same {n} "
                                 "held-out prompts per decoder", *([subtitle] if subtitle else [])]),
                     fontsize=11)
        _layout(fig)
    return fig
