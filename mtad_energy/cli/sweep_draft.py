"""`sweep draft`: drafts as a sweep axis. Every drafting decoder runs against every draft, into one
store; each row is keyed by its draft (``draft_id``), so the summary, `report` and its figures put
drafts side by side and never pool them. The decoders that draft without the pair's draft model
(``ar``, the baseline, ``pld``, ``beam``) run once: their rows name no draft.

One configuration per draft (`draft_configs`), run one after the other by `run.run_config` like
engines side by side; the per-draft view (`results.drafts`) is printed under the summary and is
the ``drafts`` list of ``--json``.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from mtad_energy.cli.options import (
    Baseline,
    BatchSize,
    BudgetS,
    Chat,
    Columns,
    Compile,
    Dataset,
    Dtype,
    Eager,
    Json,
    MaxNew,
    Meter,
    Mitigate,
    Model,
    NPrompts,
    Output,
    RequireEnergy,
    Seed,
    Sets,
    Target,
    UsageError,
    build_config,
    check_columns,
    decoder_specs,
    parse_sets,
    resolve_compile,
    split_list,
)
from mtad_energy.cli.output import fail, integer_records, json_command
from mtad_energy.config import DecoderSpec, RunConfig

DEFAULT_DECODERS = "spd,mtad,mmtad,specinfer"
DRAFT_AXIS_HELP = ("a draft on the axis (repeat the option: --draft self:int8 --draft "
                   "self:layers=0-11): hub id, local dir, self:..., random:SHAPE, or a head "
                   "eagle:DIR|random, medusa:DIR|random")


def _uses(cls, model: str | None, heads: dict[str, str]) -> bool:
    """Whether decoder class ``cls`` drafts with a draft spec's model or one of its heads."""
    return cls.head in heads if cls.head is not None else bool(cls.needs_draft and model)


def draft_configs(drafts: list[str], specs: tuple[DecoderSpec, ...], base: RunConfig
                  ) -> list[RunConfig]:
    """One configuration per draft: ``base`` with that draft and the decoders of ``specs`` that
    draft with it; the decoders that use no draft (the baseline among them) go with the first.
    Refuses (UsageError naming the draft or decoder and the fix) an empty axis, a draft given
    twice, a draft no listed decoder can use, and a decoder no draft serves. Loads nothing."""
    from mtad_energy.decoding.registry import DECODERS
    from mtad_energy.models.heads import _draft_parts, split_draft_spec

    if not drafts:
        raise UsageError("give the drafts to compare, one --draft each: e.g. --draft self:int8 "
                         "--draft self:layers=0-11")
    names = [",".join(_draft_parts(d)) for d in drafts]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UsageError(f"--draft {name!r} is given twice; give each draft once")
        seen.add(name)
    parsed = {}
    for name in names:
        try:
            parsed[name] = split_draft_spec(name)
        except ValueError as error:
            raise UsageError(str(error)) from None
    classes = {s: DECODERS[s.name] for s in specs}
    free = [s for s in specs if not classes[s].needs_draft and classes[s].head is None]
    per_draft = {n: [s for s in specs if _uses(classes[s], *parsed[n])] for n in names}
    for name, used in per_draft.items():
        if not used:
            model, heads = parsed[name]
            what = (f"a {' and '.join(heads)} head" if heads and not model else "a draft model")
            takers = (", ".join(heads) if heads and not model else
                      ", ".join(n for n, c in DECODERS.items() if c.needs_draft))
            raise UsageError(f"--draft {name!r} is {what}, which none of --decoders "
                             f"{','.join(s.name for s in specs)} drafts with: add one of {takers} "
                             "to --decoders, or drop the draft")
    for s in specs:
        if classes[s].head is not None and not any(s in used for used in per_draft.values()):
            raise UsageError(f"--decoders {s.name} drafts with a head of its kind, and no "
                             f"--draft names one: add --draft {classes[s].head}:DIR (or "
                             f"{classes[s].head}:random), or drop {s.name}")
    model = base.model
    return [replace(base, decoders=tuple([*free, *used] if i == 0 else used),
                    model=replace(model, draft=name))
            for i, (name, used) in enumerate(per_draft.items())]


def check_drafts(configs: list[RunConfig]) -> None:
    """Each draft checked against the target from configs and tokenizers
    (`models.drafts.check_draft`): a draft of another vocabulary, a layer list the target does
    not have or a CPU-only draft on a GPU is refused before any weight loads."""
    from mtad_energy.models import resolve_device, resolve_pair_spec
    from mtad_energy.models.drafts import check_draft

    for c in configs:
        m = c.model
        device = resolve_device(m.device)
        target = resolve_pair_spec(m.alias, device, target=m.target).target
        check_draft(target, m.draft, device)


def draft_view(baseline: str):
    """`run.View` of a draft sweep: `results.drafts.draft_rows` as JSON, `draft_table` printed."""

    def view(summary, runs):
        from mtad_energy.cli.tables import draft_sweep_table
        from mtad_energy.results.drafts import draft_rows

        rows = draft_rows(summary, runs, baseline)
        return "drafts", integer_records(rows), draft_sweep_table(rows)

    return view


@json_command
def sweep_draft(
    draft: Annotated[list[str] | None, typer.Option("--draft", metavar="DRAFT",
                                                    help=DRAFT_AXIS_HELP)] = None,
    decoders: Annotated[str, typer.Option("--decoders", "--decoder",
                                          help="the decoders to run against every draft (comma "
                                               "list)")] = DEFAULT_DECODERS,
    baseline: Baseline = "ar",
    model: Model = "smollm2", target: Target = None,
    dataset: Dataset = "mtbench", n_prompts: NPrompts = 2, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: Seed = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None, output: Output = None,
    require_energy: RequireEnergy = False, compile: Compile = False, eager: Eager = False,
    batch_size: BatchSize = 1, columns: Columns = "speed", budget_s: BudgetS = None,
    as_json: Json = False,
):
    """Drafts side by side: every decoder against every --draft (its cost, SpD's acceptance,
    block efficiency and speed-up per decoder), one store, one row per draft."""
    from mtad_energy.bench.work_units import with_baseline
    from mtad_energy.cli.run import run_config

    try:
        names = split_list(decoders)
        specs = decoder_specs(with_baseline(names, baseline), parse_sets(set_))
        base = build_config(
            specs, sweep="draft-sweep", model=model, target=target, draft=None, dataset=dataset,
            n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed, repeats=repeats,
            meter=meter, mitigate=mitigate, device=device, dtype=dtype, chat=chat,
            require_energy=require_energy, compile=resolve_compile(compile, eager, device),
            batch_size=batch_size)
        configs = draft_configs(list(draft or []), specs, base)
        check_columns(columns)
        check_drafts(configs)
    except (ValueError, OSError, RuntimeError) as error:
        fail(error)
    run_config(configs, output or Path("results/sweep-draft"), as_json, "draft sweep",
               columns=columns, baseline=baseline, budget_s=budget_s, view=draft_view(baseline))

