"""Tuned against default, on the same held-out prompts (issue 56, findings).

`mtad-energy tune` chose each decoder's setting on a validation split and `compare --tuned`
measured the chosen settings on the held-out prompts (experiments/results/tuned/, see
docs/getting-started/tune.md). This script measures the same decoders at their DEFAULT settings
on the same held-out prompts (same pair, tokens, seed, meter: the tune record's configuration,
`cli.tune.tuned_config(..., at_defaults=True)`), then puts tuned and default side by side:

    OMP_NUM_THREADS=1 python experiments/tuned_vs_default.py measure   # the default rows
    python experiments/tuned_vs_default.py figure                      # table + figure

``measure`` writes the store ``<tuned>-heldout-default/`` with its main table
``<tuned>-heldout-default.md`` (resumable: a re-run measures nothing stored). ``figure`` reads
the held-out stores (tuned and default), writes ``<tuned>-tuned-vs-default.csv`` (one row per
decoder and setting: block efficiency, acceptance, PPL), ``.md`` (the side-by-side table) and
``.png`` (`figures.plot_tuned_vs_default`), the rows from `tuning.tuned_vs_default`. Block
efficiency, acceptance and PPL do not depend on the machine's load; the speed columns of the
stores do, and are not used here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNED = ROOT / "experiments" / "results" / "tuned" / "mtbench"


def measure(args: argparse.Namespace) -> None:
    """Each decoder of the record at its default setting, ``ar`` beside, on the held-out prompts
    the tuned comparison used (the record's split), into ``<tuned>-heldout-default``."""
    from mtad_energy.cli.measure import write_main_table
    from mtad_energy.cli.run import run_config
    from mtad_energy.cli.tune import held_out_prompts, read_record, tuned_config
    from mtad_energy.config import MeasureConfig
    from mtad_energy.results.store_files import beside_store

    _, doc = read_record(args.tuned)
    config = tuned_config(doc, args.n_prompts, 1, MeasureConfig(args.meter, "auto"), False,
                          at_defaults=True)
    out = beside_store(args.tuned, "-heldout-default")
    table = beside_store(out, ".md")
    record = beside_store(args.tuned, ".tuned.json")
    shown = record.relative_to(ROOT) if record.is_relative_to(ROOT) else record
    note = ("every decoder at its default setting on the held-out prompts of the tune record "
            f"{shown} (the prompts `compare --tuned` measured)")
    run_config(config, out, False, "compare (defaults, held-out prompts)",
               prompts=held_out_prompts(doc, args.n_prompts),
               side_files=lambda summary, notes: write_main_table(summary, [*notes, note], table))


def figure(args: argparse.Namespace) -> None:
    """The side-by-side table (CSV, markdown) and the figure from the two held-out stores."""
    from mtad_energy.cli.tune import read_record
    from mtad_energy.results import load_results
    from mtad_energy.results.figures import plot_tuned_vs_default
    from mtad_energy.results.store_files import beside_store
    from mtad_energy.results.tuning import tuned_vs_default, tuned_vs_default_markdown

    tuned = load_results(beside_store(args.tuned, f"-heldout-{args.criterion}"))
    table = tuned_vs_default(tuned, load_results(beside_store(args.tuned, "-heldout-default")))
    stem = beside_store(args.tuned, "-tuned-vs-default")
    table.to_csv(beside_store(stem, ".csv"), index=False, float_format="%.4g")
    text = tuned_vs_default_markdown(table)
    beside_store(stem, ".md").write_text(text + "\n")
    _, doc = read_record(args.tuned)
    c = doc["config"]
    drafts = ", ".join(sorted(set(tuned["draft_id"].dropna())))
    subtitle = (f"{c['model']['alias']} + {drafts}, {', '.join(c['datasets'])}, "
                f"{c['max_new_tokens']} new tokens, seed {c['seed']}; settings chosen by "
                f"{doc['criterion']} on {len(doc['split']['validation'])} validation prompts")
    plot_tuned_vs_default(table, subtitle=subtitle).savefig(beside_store(stem, ".png"), dpi=110)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("measure", "figure"))
    parser.add_argument("--tuned", type=Path, default=TUNED, help="the tune's store")
    parser.add_argument("--n-prompts", type=int, default=3, help="held-out prompts (as the tuned run)")
    parser.add_argument("--meter", default="none")
    parser.add_argument("--criterion", default="ppl", help="which held-out tuned store: -heldout-<this>")
    args = parser.parse_args()
    {"measure": measure, "figure": figure}[args.step](args)


if __name__ == "__main__":
    main()
