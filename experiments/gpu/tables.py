"""The GPU kit's tables and figures, from what its runbook (`run.sh`) stored: reads only.

    python experiments/gpu/tables.py experiments/results/gpu/nvidia-h100-80gb-hbm3/round2

Writes, beside the stores and JSON documents of the `mtad-energy` commands (file names and
columns as round 1's kit wrote them, so rounds sit side by side):

    meters.csv, meters_sweep.csv, floor.csv   calibrate's meters side by side, the window-length
                                              sweep, the forward floor (calibration.json)
    batch.csv, batch_paper_l40.csv            the batch-size study per shape (*_vs_b1: ratio to
                                              batch 1) beside the paper's OPT-13B on an L40
    decoders.csv                              cost and joules per iteration by phase, eager and
                                              compiled (median of repeats); projected tokens/s and
                                              J/token with the CPU pair's block efficiencies
    validation.csv                            decompose's prediction of every decode window
    batched.csv, batched_mlenergy.csv         the same by batch size; ar's J/token beside ML.ENERGY
    real.csv                                  the real SmolLM2 pair (README's command timed)
    *.png                                     batch_energy, decoders, batched, floor

Random weights at real shapes (random:SHAPE): time and energy per forward are real; acceptance,
block efficiency and quality are not: a real pair's block efficiency (the CPU pair's, measured in
experiments/results/cpu) turns cost per iteration into tokens/s. Eagle and Medusa: no head exists
for the CPU pair, so their cost per iteration stands alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from mtad_energy.results import load_results  # noqa: E402
from mtad_energy.results.analysis import contended_mask  # noqa: E402

RANDOM_NOTE = ("random weights at real shapes: valid for time and energy per forward, not for "
               "acceptance, block efficiency or quality")
# ML.ENERGY leaderboard: Llama-3.1-8B-Instruct served by vLLM on one H100, J per output token at
# batch size 8 (the order of magnitude ar's batched J/token should land in)
MLENERGY_J_PER_TOKEN = {8: 0.455}
# The paper's table "effect of batch size" (OPT-13B, L40): energy/run and time/run at b = 1..16.
PAPER_L40 = pd.DataFrame({"batch_size": [1, 2, 4, 8, 16],
                          "energy_per_run_j": [14.1, 16.5, 17.7, 19.7, 24.7],
                          "time_per_run_s": [0.376, 0.397, 0.392, 0.403, 0.418]})
BATCH_COLUMNS = [
    "model", "axis", "batch_size", "context_len", "new_tokens", "runs", "forwards_per_run", "meter",
    "mitigated", "energy_j", "energy_per_run_j", "energy_per_run_ci_low_j",
    "energy_per_run_ci_high_j", "energy_per_input_j", "time_s", "time_per_run_s",
    "time_per_input_s", "mitigated_time_per_run_s", "power_w", "idle_power_w", "t_flop_s",
    "t_mem_s", "t_other_s", "flops_per_run", "bytes_per_run", "counted_flops", "counted_bytes",
    "counted_flops_per_run", "counted_bytes_per_run", "energy_flags", "energy_reason",
    "others_cores", "contended"]
REAL_COLUMNS = ("decoder", "n_runs", "total_tokens", "tokens_per_s", "speedup", "block_efficiency",
                "acceptance_rate", "perplexity", "n_energy_runs", "energy_per_token_j",
                "decode_energy_per_token_j", "energy_saving", "energy_reason")


class Out:
    def __init__(self, folder: Path):
        self.folder = folder

    def log(self, text: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"
        print(line, flush=True)
        with (self.folder / "run.log").open("a") as f:
            f.write(line + "\n")

    def table(self, name: str, df: pd.DataFrame, title: str, note: str = "") -> None:
        busy = int(df["n_contended"].sum()) if "n_contended" in df else int(contended_mask(df).sum())
        if busy:
            note = "; ".join(n for n in (note, f"{busy} row(s) measured on a busy machine "
                                               "(n_contended): not the decoders' cost alone") if n)
        df.to_csv(self.folder / f"{name}.csv", index=False)
        self.log(f"{title} -> {name}.csv" + (f" ({note})" if note else ""))
        with pd.option_context("display.width", 200, "display.max_columns", 40):
            print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"), flush=True)

    def json(self, name: str) -> dict | None:
        path = self.folder / name
        return json.loads(path.read_text()) if path.is_file() and path.stat().st_size else None

    def store(self, name: str, table: str) -> pd.DataFrame:
        path = self.folder / name
        return load_results(path, table) if (path / "mtad-energy-store.json").exists() \
            else pd.DataFrame()


def mode_of(model: str) -> str:
    """A stored model label's mode: ``eager``, ``compiled``, or ``compiled-<backend>[-dynamic]``."""
    _, sep, setting = str(model).partition("+compile")
    return "compiled" + setting if sep else "eager"


def cpu_block_efficiency() -> dict[str, float]:
    """Block efficiency per decoder on the real CPU pair (mean over its runs): the paper's decoders
    from compare_smollm2.csv, pld from its own run on the same pair (the pld_compare store)."""
    out: dict[str, float] = {}
    cpu = ROOT / "experiments" / "results" / "cpu"
    if (cpu / "pld_compare").is_dir():
        runs = load_results(cpu / "pld_compare")
        out.update(runs[runs.label == "pld"].groupby("label")["block_efficiency"].mean().to_dict())
    if (cpu / "compare_smollm2.csv").is_file():
        df = pd.read_csv(cpu / "compare_smollm2.csv")
        out.update(df.groupby("label")["block_efficiency"].mean().to_dict())
    return out


def _ordered(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    from mtad_energy.decoding.registry import DECODERS

    rank = {name: i for i, name in enumerate(DECODERS)}
    keys = df.assign(_mode=df["mode"] != "eager", _rank=df.decoder.map(rank))
    return keys.sort_values(["_mode", "mode", *by, "_rank"], kind="stable").drop(
        columns=["_mode", "_rank"]).reset_index(drop=True)


def per_iteration(rows: pd.DataFrame, energy: str) -> pd.DataFrame:
    """Each stored row's figures per decoder iteration (``energy``: its joules column)."""
    it = rows.iterations.clip(lower=1)
    out = pd.DataFrame({
        "decoder": rows.decoder, "mode": rows.model.map(mode_of), "iterations": rows.iterations,
        "cost_per_iter_ms": rows.decode_time_s / it * 1e3,
        "target_forwards_per_iter": rows.target_forwards / it,
        "draft_forwards_per_iter": rows.draft_forwards / it,
        "draft_ms_per_iter": rows.time_draft_s / it * 1e3,
        "target_ms_per_iter": rows.time_target_s / it * 1e3,
        "other_ms_per_iter": rows.time_other_s / it * 1e3,
        "forwards_ms_per_iter": (rows.time_draft_s + rows.time_target_s) / it * 1e3,
        "j_per_iter": pd.to_numeric(rows[energy]) / it,
        "compile_s": rows.get("compile_s", 0.0), "graphs_compiled": rows.get("graphs_compiled", 0),
        "random_weights_block_eff": rows.block_efficiency,
        # measured on a busy machine (the terminal's `*`): counted per cell, never dropped
        "contended": contended_mask(rows).astype(int)})
    for c in ("host_ops_per_iter", "graph_calls_per_iter", "host_reads_per_iter"):  # counted
        out[c] = pd.to_numeric(rows[c]) if c in rows else float("nan")  # (rows before: none)
    if "batch_size" in rows:
        out.insert(2, "batch_size", rows.batch_size)
        out["peak_memory_gb"] = pd.to_numeric(rows.get("peak_memory_bytes")) / 1e9
    return out


def summarise(raw: pd.DataFrame, block_eff: dict[str, float], cell: list[str]) -> pd.DataFrame:
    """Medians over repeats per cell; ``compile_s`` and ``graphs_compiled`` summed (the warm-up's
    go to the row measured after it); projected tokens/s = B x CPU-pair block efficiency x target
    forwards per iteration / cost per iteration; ratios to ar in the same mode (and B)."""
    groups = raw.groupby(cell, sort=False)
    agg = groups.median(numeric_only=True).reset_index()
    agg["compile_s"] = groups["compile_s"].sum(min_count=1).to_numpy()
    agg["graphs_compiled"] = groups["graphs_compiled"].sum(min_count=1).to_numpy()
    agg = agg.drop(columns="contended").assign(n_contended=groups["contended"].sum().to_numpy())
    agg["cpu_pair_block_eff"] = agg.decoder.map(block_eff)
    rows = agg.batch_size if "batch_size" in agg else 1
    tokens_per_iter = rows * agg.cpu_pair_block_eff * agg.target_forwards_per_iter
    agg["projected_tokens_per_s"] = tokens_per_iter / (agg.cost_per_iter_ms / 1e3)
    agg["projected_j_per_token"] = agg.j_per_iter / tokens_per_iter
    agg["host_overhead"] = agg.cost_per_iter_ms / agg.forwards_ms_per_iter
    by = [c for c in cell if c not in ("decoder", "mode")]
    for _, part in agg.groupby(["mode", *by], sort=False):
        ar = part[part.decoder == "ar"]
        if not ar.empty:
            agg.loc[part.index, "projected_speedup_vs_ar"] = (
                part.projected_tokens_per_s / ar.projected_tokens_per_s.iloc[0])
            agg.loc[part.index, "projected_energy_saving_vs_ar"] = (
                1.0 - part.projected_j_per_token / ar.projected_j_per_token.iloc[0])
    eager = agg[agg["mode"] == "eager"].set_index(["decoder", *by]).cost_per_iter_ms
    agg["compiled_speedup_per_iter"] = [
        eager.get(tuple(k) if by else k[0], float("nan")) / c if m != "eager" else float("nan")
        for k, m, c in zip(agg[["decoder", *by]].itertuples(index=False), agg["mode"],
                           agg.cost_per_iter_ms, strict=True)]
    return _ordered(agg, by)


def beside_mlenergy(summary: pd.DataFrame, sizes: tuple[int, ...] = (8, 64)) -> pd.DataFrame:
    """`ar`'s measured J/token (its block efficiency is 1: nothing projected) at ``sizes`` in each
    mode, beside ML.ENERGY's published figure where one exists, and their ratio."""
    ar = summary[(summary.decoder == "ar") & summary.batch_size.isin(sizes)
                 & summary.projected_j_per_token.notna()]
    out = ar[["mode", "batch_size", "cost_per_iter_ms", "projected_j_per_token"]].rename(
        columns={"projected_j_per_token": "j_per_token"}).reset_index(drop=True)
    out["mlenergy_j_per_token"] = out.batch_size.map(MLENERGY_J_PER_TOKEN)
    out["ratio_to_mlenergy"] = out.j_per_token / out.mlenergy_j_per_token
    return out


def calibration_tables(out: Out) -> None:
    doc = out.json("calibration.json")
    if doc is None:
        return
    cal = doc.get("meters") or {}
    if cal:
        out.table("meters", pd.DataFrame(cal["rows"]), "meters: energy per repetition (idle: W) "
                  "side by side; vs_counter = relative difference to the NVML energy counter")
        out.table("meters_sweep", pd.DataFrame(cal["sweep"]), "meters: plain windows of the bursty "
                  "workload by length, read by the trusted meter; error against the consensus")
    for line in cal.get("verdict", []):
        out.log(f"meters: verdict: {line}")
    if doc.get("floor"):
        out.table("floor", pd.DataFrame(doc["floor"]), "floor: decode forward (batch 1, 128 cached "
                  "tokens) vs the bytes it reads / copy bandwidth", RANDOM_NOTE)


def batch_tables(out: Out) -> None:
    from mtad_energy.results.crossover import batch_axis

    axes = {"batch": 0, "context": 1, "chunk": 2}
    stores = [out.store(name, "batch") for name in ("batch-opt", "batch-llama")]
    stores = [s.assign(_axis=s["axis"].map(axes)).sort_values(
        ["_axis", "batch_size", "context_len", "new_tokens"]) for s in stores if len(s)]
    if not stores:
        return
    rows = pd.concat(stores, ignore_index=True)
    df = rows.assign(model=rows.model.str.removeprefix("random:"))
    df = df[[c for c in BATCH_COLUMNS if c in df.columns]]
    for _, part in batch_axis(df).groupby("model", sort=False):
        base = part[part.batch_size == part.batch_size.min()].iloc[0]
        df.loc[part.index, "energy_per_run_vs_b1"] = pd.to_numeric(part.energy_per_run_j) / (
            base.energy_per_run_j if base.energy_per_run_j else float("nan"))
        df.loc[part.index, "time_per_run_vs_b1"] = part.time_per_run_s / base.time_per_run_s
    out.table("batch", df, "batch: paper columns per shape; *_vs_b1 = ratio to batch 1", RANDOM_NOTE)
    PAPER_L40.assign(energy_per_run_vs_b1=PAPER_L40.energy_per_run_j / 14.1,
                     time_per_run_vs_b1=PAPER_L40.time_per_run_s / 0.376).to_csv(
        out.folder / "batch_paper_l40.csv", index=False)


def decoder_tables(out: Out, block_eff: dict[str, float]) -> None:
    runs = out.store("decoders", "runs")
    if not runs.empty:
        summary = summarise(per_iteration(runs, "decode_energy_j"), block_eff, ["decoder", "mode"])
        out.table("decoders", summary, "decoders: cost per iteration by phase, eager and compiled "
                  "(median of repeats after a warm-up); projected tokens/s = CPU-pair block "
                  "efficiency x target forwards per iteration / cost per iteration", RANDOM_NOTE)
    doc = out.json("decompose.json")
    valid = pd.DataFrame(doc["validation"]["runs"]) if doc else pd.DataFrame()
    if len(valid):
        valid = _ordered(valid.assign(mode=valid.model.map(mode_of)), [])
        cols = ["decoder", "mode", "decode_time_s", "decode_energy_j", "predicted_j", "error"]
        out.table("validation", valid[[c for c in cols if c in valid]], "validation: the Llama "
                  "design's roofline fit predicts each decode window; error = predicted / measured "
                  "- 1", RANDOM_NOTE)
        out.log(f"validation: median |error| {valid.error.abs().median():.1%} over {len(valid)} "
                "decode windows (target: <= 10 %)")
    rows = out.store("batched", "decode_batch")
    if not rows.empty:
        summary = summarise(per_iteration(rows, "energy_j"), block_eff,
                            ["decoder", "mode", "batch_size"])
        out.table("batched", summary, "batched: decoders at B rows per forward, eager and compiled, "
                  "cost and J per iteration; host_overhead = cost / the forwards' own time",
                  RANDOM_NOTE)
        beside = beside_mlenergy(summary)
        if len(beside):
            out.table("batched_mlenergy", beside, "batched: ar's J/token beside ML.ENERGY's "
                      "Llama-3.1-8B on an H100 with vLLM (batch 8: 0.455 J/token); ours is the "
                      "decode phase alone, theirs whole requests")


def real_table(out: Out) -> None:
    rows = []
    for name in ("readme", "real"):
        doc = out.json(f"{name}.json")
        if doc is None:
            continue
        wall = out.folder / f"{name}.wall_s"
        wall_s = float(wall.read_text()) if wall.is_file() else float("nan")
        rows += [{"run": name, "wall_s": wall_s, "meter": doc["meter"],
                  "device": doc["pair"].get("device"), **{k: r.get(k) for k in REAL_COLUMNS}}
                 for r in doc["summary"]]
    if rows:
        out.table("real", pd.DataFrame(rows), "real: the SmolLM2 pair through the CLI (README's "
                  "first command, timed; ar, spd, mtad, mmtad compiled): real acceptance and joules")


def plots(out: Out) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="talk", font_scale=0.7)
    made: list[str] = []

    def save(fig, name: str, title: str = "") -> None:
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out.folder / name, dpi=120)
        plt.close(fig)
        made.append(name)

    def csv(name: str) -> pd.DataFrame | None:
        path = out.folder / name
        return pd.read_csv(path) if path.is_file() else None

    if (df := csv("batch.csv")) is not None:
        df = df[df["axis"].fillna("batch") == "batch"] if "axis" in df else df
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for model, part in df.groupby("model", sort=False):
            axes[0].plot(part.batch_size, part.energy_per_run_vs_b1, "o-", label=f"{model} (this GPU)")
            axes[1].plot(part.batch_size, part.energy_per_input_j, "o-", label=f"{model} (this GPU)")
        axes[0].plot(PAPER_L40.batch_size, PAPER_L40.energy_per_run_j / 14.1, "k--",
                     label="OPT-13B, L40 (paper)")
        axes[0].set(xscale="log", xlabel="batch size", ylabel="energy per run / batch 1",
                    title="Energy per run vs batch size")
        axes[1].set(xscale="log", yscale="log", xlabel="batch size", ylabel="J per input",
                    title="Energy per input")
        sizes = sorted(set(df.batch_size))
        for ax in axes:
            ax.set_xticks(sizes, labels=[str(b) for b in sizes])
            ax.legend(fontsize=8)
        axes[1].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[1].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        save(fig, "batch_energy.png", f"Batch-size study ({RANDOM_NOTE})")
    if (df := csv("decoders.csv")) is not None:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        eager = df[df["mode"] == "eager"].set_index("decoder")  # per target forward: beam too
        parts = eager[["draft_ms_per_iter", "target_ms_per_iter", "other_ms_per_iter"]]
        parts = parts.div(eager["target_forwards_per_iter"], axis=0)
        parts.columns = ["draft", "target", "other"]
        parts.plot.bar(stacked=True, ax=axes[0], color=["#8da0cb", "#fc8d62", "#b3b3b3"])
        axes[0].set(ylabel="ms per target forward", xlabel="",
                    title="Cost per target forward (eager), split by phase")
        metric = ("projected_j_per_token" if df["projected_j_per_token"].notna().any()
                  else "projected_tokens_per_s")
        sns.barplot(df, x="decoder", y=metric, hue="mode", ax=axes[1])
        axes[1].tick_params(axis="x", rotation=90)
        axes[1].set(ylabel=metric.replace("_", " "), xlabel="",
                    title="At the CPU pair's block efficiency, eager vs compiled")
        save(fig, "decoders.png", f"Decoders at Llama-3.1-8B / 3.2-1B shapes ({RANDOM_NOTE})")
    if (df := csv("batched.csv")) is not None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for col, ax, label in (("projected_speedup_vs_ar", axes[0], "speed-up over ar (projected)"),
                               ("projected_energy_saving_vs_ar", axes[1],
                                "energy saving vs ar (projected)")):
            if df[col].notna().any():
                sns.lineplot(df, x="batch_size", y=col, hue="decoder", marker="o", ax=ax,
                             style="mode")
            ax.set(xscale="log", xlabel="batch size", ylabel=label)
            ax.set_xticks(sorted(set(df.batch_size)), labels=[str(b) for b in sorted(set(df.batch_size))])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0].axhline(1.0, color="k", lw=1, ls="--")
        axes[1].axhline(0.0, color="k", lw=1, ls="--")
        save(fig, "batched.png", f"Decoders by batch size ({RANDOM_NOTE})")
    if (df := csv("floor.csv")) is not None and not (df := df.dropna(subset=["forward_ms"])).empty:
        fig, ax = plt.subplots(figsize=(7, 4))
        sns.barplot(df, x="model", y="forward_ms", hue="mode", ax=ax)
        for i, (_, fl) in enumerate(df.groupby("model", sort=False)["floor_ms"].first().items()):
            ax.hlines(fl, i - 0.4, i + 0.4, colors="k", linestyles="--",
                      label="bytes read / copy bandwidth" if i == 0 else None)
        ax.set(ylabel="ms per decode forward (batch 1)", xlabel="", title="Forward time vs floor")
        ax.legend(fontsize=8)
        save(fig, "floor.png")
    out.log(f"plots: {', '.join(made) or 'nothing to plot yet (run the other stages first)'}")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python experiments/gpu/tables.py RESULTS_DIR (the folder run.sh wrote)",
              file=sys.stderr)
        return 2
    out = Out(Path(argv[0]))
    block_eff = cpu_block_efficiency()
    calibration_tables(out)
    batch_tables(out)
    decoder_tables(out, block_eff)
    real_table(out)
    plots(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
