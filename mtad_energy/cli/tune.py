"""`tune`: every decoder over its grid (`decoding.grids`) on a validation split of the dataset
(`bench.splits`), the best setting chosen by a criterion with its bootstrap uncertainty
(`results.tuning`), written beside the store as ``<store>.tuned.json``; and `compare --tuned
STORE` (`tuned_compare`): each decoder at its chosen setting on the held-out prompts, ``ar``
beside them, the chosen settings named in every row, table and file.

Both run on the path every measuring command takes (`run.run_config`): one store, resumable
(rows already stored are not measured again), ``--budget-s``, ``--json``.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from mtad_energy.cli import options as opt  # the option types every measuring command shares
from mtad_energy.cli.options import (
    UsageError,
    build_config,
    check_columns,
    decoder_specs,
    parse_range,
    parse_sets,
    resolve_compile,
    split_list,
)
from mtad_energy.cli.output import esc, fail, json_command, wrapping_table
from mtad_energy.config import DecoderSpec, RunConfig

FORMAT = "mtad-energy-tuned"
RECORD_TAIL = ".tuned.json"  # beside the store: <store>.tuned.json (`store_files.beside_store`)
DEFAULT_PPL_RATIO = 1.05
BASELINE = "ar"


def _typed(value: Any) -> Any:
    """A parameter read back from JSON: lists (tree shapes) as the tuples decoders take."""
    return tuple(value) if isinstance(value, list) else value


def grid_overrides(grid: list[str] | None, names: list[str]) -> dict[str, dict[str, tuple]]:
    """``--grid [DECODER.]NAME=VALUES`` per decoder of ``names`` (comma-separated values; a tree
    shape's values separated by ``/``: ``branching=4,2,2/2,2,2``). A name no listed decoder has
    is a UsageError."""
    import typing

    from mtad_energy.decoding.registry import DECODERS

    out: dict[str, dict[str, tuple]] = {n: {} for n in names}
    for key, text in parse_sets(grid, "--grid").items():
        scope, dot, name = key.rpartition(".")
        if dot and scope not in out:
            raise UsageError(f"--grid {key}: decoder {scope!r} is not among --decoders {','.join(names)}")
        hit = [n for n in ([scope] if dot else names)
               if name in typing.get_type_hints(DECODERS[n].Params)]
        if not hit:
            raise UsageError(f"--grid {key}: no tuned decoder ({', '.join(names)}) has a parameter "
                             f"{name!r}; `mtad-energy decoders` lists them")
        for n in hit:
            tuple_valued = typing.get_origin(typing.get_type_hints(DECODERS[n].Params)[name]) is tuple
            values = [v for v in text.split("/") if v.strip()] if tuple_valued else parse_range(text)
            out[n][name] = tuple(values)
    return out


def grid_specs(names: list[str], fixed: dict[str, str], overrides: dict[str, dict[str, tuple]]
               ) -> dict[str, list[DecoderSpec]]:
    """Every setting of each decoder's grid as a spec (the ``--set`` values fixed), ``ar`` (the
    baseline) first with one; each built once, so a grid value a decoder refuses is a UsageError
    naming the decoder, the setting and the fix before any model loads."""
    from mtad_energy.decoding.grids import TUNING_GRIDS, grid_settings
    from mtad_energy.decoding.registry import build_decoder

    bases = dict(zip([BASELINE, *names], decoder_specs([BASELINE, *names], fixed), strict=True))
    out: dict[str, list[DecoderSpec]] = {BASELINE: [bases[BASELINE]]}
    for name in names:
        axes = {**TUNING_GRIDS[name], **overrides[name]}
        if both := [k for k in axes if k in bases[name].param_dict]:
            raise UsageError(f"{', '.join(both)} is tuned by {name}'s grid and fixed by --set; keep "
                             f"one (--grid {name}.{both[0]}=VALUE tunes over one value)")
        specs = []
        for setting in grid_settings(name, overrides[name]):
            spec = DecoderSpec.of(name, **{**bases[name].param_dict, **setting})
            try:
                build_decoder(spec)
            except ValueError as error:
                raise UsageError(f"{name} refuses the grid setting {spec.label}: {error}; give "
                                 f"--grid values it takes (`mtad-energy decoders`)") from None
            specs.append(spec)
        out[name] = specs
    return out


def check_criterion(criterion: str, max_ppl_ratio: float | None, meter: str) -> float | None:
    """The perplexity budget of ``criterion`` (None for ppl), refused before loading: an unknown
    criterion, a budget with ``ppl``, a budget that is not a positive number, and ``energy`` with
    a meter that measures no joules here."""
    from mtad_energy.results.tuning import CRITERIA

    if criterion not in CRITERIA:
        raise UsageError(f"--criterion {criterion!r}: choose one of {', '.join(CRITERIA)}")
    if criterion == "ppl":
        if max_ppl_ratio is not None:
            raise UsageError("--max-ppl-ratio bounds perplexity while tuning by speed or energy; "
                             "--criterion ppl picks the lowest perplexity: drop one of them")
        return None
    ratio = DEFAULT_PPL_RATIO if max_ppl_ratio is None else max_ppl_ratio
    if not (ratio > 0 and math.isfinite(ratio)):
        raise UsageError(f"--max-ppl-ratio {ratio:g}: give a positive ratio to {BASELINE}'s "
                         f"perplexity (e.g. {DEFAULT_PPL_RATIO})")
    if criterion == "energy":
        from mtad_energy.measure import meter_for
        from mtad_energy.measure.select import energy_unavailable

        m, _ = meter_for(meter)
        if (why := energy_unavailable(m)) is not None:
            raise UsageError(f"--criterion energy needs joules, but {why}; give a meter that "
                             "measures them (--meter simulated on a CPU), or --criterion speed")
    return ratio


def tune_view(specs: dict[str, list[DecoderSpec]], axes: dict[str, list[str]], criterion: str,
              ratio: float | None, resamples: int, record: dict[str, Any], path: Path):
    """`run.View` of a tune: each decoder's choice (`results.tuning.choose`) on its validation
    rows, written to ``path`` (with ``record``), as JSON and as a table. A perplexity budget no
    setting meets fails (exit 2; every row stays stored); a decoder short of rows (a spent
    --budget-s) gets no choice, with its reason."""

    def view(summary, runs):
        from mtad_energy.results.tuning import IncompleteError, NoSettingError, choose

        choices, unmet = {}, []
        for name, name_specs in specs.items():
            if name == BASELINE:
                continue
            order = [stored_params_json(spec) for spec in name_specs]
            try:
                choices[name] = choose(runs, name, criterion, ratio, BASELINE, resamples,
                                       order=order, axes=axes[name])
            except IncompleteError as error:
                choices[name] = {"decoder": name, "params": None, "label": None, "reason": str(error)}
            except NoSettingError as error:
                unmet.append(str(error))
        if unmet:
            fail("; ".join(unmet) + " (every row is stored: re-running with another criterion "
                                    "measures nothing again)")
        base = runs[runs["decoder"] == BASELINE]
        doc = {**record, "baseline": {"decoder": BASELINE, "params": _params(base)},
               "decoders": choices}
        _write_record(path, doc)
        return "tuned", {"file": str(path), **doc}, choice_table(choices, criterion)

    return view


def _params(rows) -> dict[str, Any] | None:
    from mtad_energy.results.analysis import parse_params

    return parse_params(rows["params_json"].iloc[0]) if len(rows) else None


def stored_params_json(spec: DecoderSpec) -> str:
    """The ``params_json`` the hf engine stores for ``spec``'s rows (`engines.hf`: every
    parameter, defaults included), known without loading a model."""
    from mtad_energy.decoding.registry import build_decoder
    from mtad_energy.results.schema import params_json

    return params_json({k: v for k, v in build_decoder(spec).config().items() if k != "decoder"})


def _write_record(path: Path, doc: dict[str, Any]) -> None:
    from mtad_energy.cli.output import finite
    from mtad_energy.results.store_files import write_atomic

    text = json.dumps(finite(doc), indent=1, sort_keys=True, default=str, allow_nan=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: tmp.write_text(text + "\n"))
    except OSError as error:
        fail(f"{error}; every row is stored: re-run the same command to write {path}", code=1)


def choice_table(choices: dict[str, dict], criterion: str):
    """The chosen setting per decoder with its criterion value, perplexity ratio and how often it
    wins over bootstrap resamples."""
    rows = []
    for name, c in choices.items():
        if c.get("params") is None:
            rows.append([esc(name), "n/a", "n/a", "n/a", esc(c.get("reason", ""))])
            continue
        flags = "".join(f", {c[key]} of {c['rows']} rows {what}" for key, what in (
            ("contended_rows", "contended"), ("random_weight_rows", "random weights")) if c.get(key))
        rows.append([esc(c["label"]), f"{c['value']:.4g}", f"{c['ppl_ratio']:.3f}",
                     f"{c['bootstrap_fraction']:.0%} of {c['resamples']}",
                     f"{len(c['settings'])} settings, {c['n_prompts']} prompts{flags}"])
    return wrapping_table(["chosen setting", criterion, "PPL / ar", "same winner", "over"], rows,
                          left=("chosen setting", "over"), title=f"tuned by {criterion} (validation split)")


@json_command
def tune(
    decoders: Annotated[str, typer.Option("--decoders", "--decoder",
                                          help="decoders to tune, comma list (ar is the baseline, "
                                               "measured once)")] = "mtad,spd",
    criterion: Annotated[str, typer.Option(help="ppl (the paper's: lowest perplexity), speed "
                                                "(tokens/s) or energy (J/token) within "
                                                "--max-ppl-ratio")] = "ppl",
    max_ppl_ratio: Annotated[float | None, typer.Option(
        help=f"speed/energy: perplexity at most this times ar's [default: {DEFAULT_PPL_RATIO}]")] = None,
    grid: Annotated[list[str] | None, typer.Option(
        metavar="[DECODER.]NAME=VALUES", help="replace a grid axis (tau=0.1,0.5; tree shapes "
                                              "branching=4,2,2/2,2,2); default grids: each "
                                              "decoder's page")] = None,
    val_prompts: Annotated[int, typer.Option(help="validation prompts per dataset (>= 2)")] = 4,
    split_seed: Annotated[int, typer.Option(min=0, help="seed of the validation/held-out split")] = 0,
    resamples: Annotated[int, typer.Option(min=1, help="bootstrap resamples of the validation "
                                                       "prompts")] = 1000,
    model: opt.Model = "smollm2", target: opt.Target = None, draft: opt.Draft = None,
    dataset: opt.Dataset = "mtbench", max_new_tokens: opt.MaxNew = 32, set_: opt.Sets = None,
    seed: opt.Seed = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: opt.Meter = "auto", mitigate: opt.Mitigate = "auto", device: str = "auto",
    dtype: opt.Dtype = None, chat: opt.Chat = None, output: opt.Output = None,
    require_energy: opt.RequireEnergy = False, compile: opt.Compile = False,
    eager: opt.Eager = False, batch_size: opt.BatchSize = 1, columns: opt.Columns = "speed",
    budget_s: opt.BudgetS = None, as_json: opt.Json = False,
):
    """Each decoder's best setting on a validation split: its grid measured, chosen by
    perplexity (the paper's), speed or energy within a perplexity budget, with how often the
    same setting wins over bootstrap resamples; `compare --tuned STORE` then measures the
    chosen settings on held-out prompts."""
    from mtad_energy.bench.splits import load_split
    from mtad_energy.cli.run import run_config
    from mtad_energy.decoding.grids import TUNING_GRIDS
    from mtad_energy.results.store_files import beside_store

    out = output or Path("results/tune")
    try:
        ratio = check_criterion(criterion, max_ppl_ratio, meter)
        names = [n for n in split_list(decoders) if n != BASELINE]
        if not names:
            raise UsageError(f"--decoders {decoders!r} names nothing to tune ({BASELINE} is the "
                             "baseline, measured beside them); give e.g. --decoders mtad,spd")
        overrides = grid_overrides(grid, names)
        specs = grid_specs(names, parse_sets(set_), overrides)
        axes = {n: list({**TUNING_GRIDS[n], **overrides[n]}) for n in names}
        datasets = split_list(dataset)
        split = load_split(datasets, val_prompts, split_seed)
        config = build_config(
            tuple(s for ss in specs.values() for s in ss), sweep="tune", model=model,
            target=target, draft=draft, dataset=dataset, n_prompts=val_prompts,
            max_new_tokens=max_new_tokens, seed=seed, repeats=repeats, meter=meter,
            mitigate=mitigate, device=device, dtype=dtype, chat=chat,
            require_energy=require_energy, compile=resolve_compile(compile, eager, device),
            batch_size=batch_size)
        check_columns(columns)
        path = beside_store(out, RECORD_TAIL)
    except (ValueError, OSError, RuntimeError) as error:
        fail(error)
    record = {"format": FORMAT, "version": 1, "store": str(out), "criterion": criterion,
              "max_ppl_ratio": ratio, "resamples": resamples, "config": config.to_dict(),
              "split": {"datasets": datasets, "val_prompts": val_prompts, "seed": split_seed,
                        "validation": [[p.dataset, p.id] for p in split.validation]}}
    run_config(config, out, as_json, f"tune by {criterion}", columns=columns, budget_s=budget_s,
               view=tune_view(specs, axes, criterion, ratio, resamples, record, path),
               prompts=split.validation)


# -- compare --tuned STORE: the chosen settings on held-out prompts ------------------------------
# compare's options that say what is measured: --tuned takes them from the tune record
FROM_RECORD = ("model", "target", "draft", "decoders", "dataset", "set_", "max_new_tokens", "seed",
               "dtype", "chat", "device", "compile", "eager", "compile_backend", "dynamic_shapes",
               "batch_size", "engine", "engine_option", "workers", "cluster", "ops")


def read_record(store: Path) -> tuple[Path, dict[str, Any]]:
    """The tune record beside ``store`` (``<store>.tuned.json``); a ValueError naming the fix
    where there is none, it does not parse, or a decoder in it has no chosen setting."""
    from mtad_energy.results.store_files import beside_store

    path = beside_store(store, RECORD_TAIL)
    if not path.is_file():
        raise ValueError(f"--tuned {store}: no tune record {path}; run `mtad-energy tune --output "
                         f"{store}` first (it writes the record beside its store)")
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT or not isinstance(doc.get("decoders"), dict):
            raise ValueError("not a tune record")
    except ValueError as error:
        raise ValueError(f"--tuned {store}: {path} is not a readable tune record ({error}); re-run "
                         f"`mtad-energy tune --output {store}` to write it again") from None
    if missing := [d for d, c in doc["decoders"].items() if c.get("params") is None]:
        raise ValueError(f"--tuned {store}: {', '.join(missing)} has no chosen setting in {path} "
                         f"({doc['decoders'][missing[0]].get('reason')}); re-run the tune to finish it")
    return path, doc


def held_out_prompts(doc: dict[str, Any], n_prompts: int):
    """The first ``n_prompts`` held-out prompts per dataset of the record's split, after checking
    that the split gives the record's validation prompts again (a dataset that changed since the
    tune could put a validation prompt among them) and that no held-out prompt is one of them."""
    from mtad_energy.bench.splits import first_per_dataset, load_split

    s = doc["split"]
    split = load_split(s["datasets"], s["val_prompts"], s["seed"])
    validation = {(p.dataset, p.id) for p in split.validation}
    if validation != {tuple(v) for v in s["validation"]}:
        raise ValueError(f"the datasets {', '.join(s['datasets'])} changed since the tune: its "
                         "validation prompts are no longer the split's; tune again")
    held = first_per_dataset(split.held_out, n_prompts)
    if overlap := [p.id for p in held if (p.dataset, p.id) in validation]:
        raise ValueError(f"held-out prompts {', '.join(overlap)} are validation prompts")
    return held


def tuned_config(doc: dict[str, Any], n_prompts: int, repeats: int, measure, allow_exec: bool,
                 *, at_defaults: bool = False) -> RunConfig:
    """The record's configuration with ``ar`` and each decoder at its chosen setting, or with
    ``at_defaults`` at its default (`tuning.default_params`), to set tuned beside default."""
    from mtad_energy.results.tuning import default_params

    config = RunConfig.from_dict(doc["config"])
    specs = [DecoderSpec.of(BASELINE, **{k: _typed(v) for k, v in (doc["baseline"]["params"] or {}).items()})]
    chosen = {d: default_params(doc, d) if at_defaults else c["params"] for d, c in doc["decoders"].items()}
    specs += [DecoderSpec.of(d, **{k: _typed(v) for k, v in p.items()}) for d, p in chosen.items()]
    return replace(config, decoders=tuple(specs), n_prompts=n_prompts, repeats=repeats,
                   measure=measure, sweep="compare-defaults" if at_defaults else "compare-tuned",
                   allow_code_execution=allow_exec)


def tuned_note(doc: dict[str, Any], path: Path) -> str:
    """One line naming every chosen setting, the criterion and how often it won."""
    chosen = ", ".join(f"{c['label']} ({c['bootstrap_fraction']:.0%})" for c in doc["decoders"].values())
    budget = f" within {doc['max_ppl_ratio']:g}x ar's perplexity" if doc.get("max_ppl_ratio") else ""
    return (f"settings tuned by {doc['criterion']}{budget} on {len(doc['split']['validation'])} "
            f"validation prompts ({path}), measured here on held-out prompts only: {chosen} "
            "(the share of bootstrap resamples in which the same setting won)")


def held_out_store(tuned: Path) -> Path:
    """Where `compare --tuned STORE` measures by default: ``<STORE>-heldout`` beside it."""
    from mtad_energy.results.store_files import beside_store

    return beside_store(tuned, "-heldout")


def tuned_compare(ctx: typer.Context, tuned: Path, out: Path, write_table, *, n_prompts: int,
                  repeats: int, measure, allow_exec: bool, columns: str, budget_s: float | None,
                  as_json: bool) -> None:
    """`compare --tuned STORE`: the record's decoders at their chosen settings and ``ar`` on the
    held-out prompts, into ``out``; ``write_table(summary, notes)`` writes compare's markdown
    table (`run.SideFiles`). Labels name the chosen settings."""
    from mtad_energy.cli.options import given_options
    from mtad_energy.cli.run import run_config

    try:
        if given := given_options(ctx, FROM_RECORD):
            raise UsageError(f"{', '.join(given)}: --tuned measures what the tune record names "
                             "(model, draft, decoders, dataset, settings); drop them")
        path, doc = read_record(tuned)
        config = tuned_config(doc, n_prompts, repeats, measure, allow_exec)
        prompts = held_out_prompts(doc, n_prompts)
        check_columns(columns)
    except (ValueError, OSError, RuntimeError) as error:
        fail(error)
    labels = {d: c["label"] for d, c in doc["decoders"].items()}
    note = tuned_note(doc, path)

    def relabel(summary):
        summary = summary.copy()
        summary["label"] = [labels.get(d, lab) for d, lab in zip(summary["decoder"], summary["label"],
                                                                 strict=True)]
        return summary

    def view(summary, runs):
        chosen = {d: {k: c[k] for k in ("label", "params", "bootstrap_fraction", "criterion")}
                  for d, c in doc["decoders"].items()}
        return "tuned", {"file": str(path), "decoders": chosen}, note

    run_config(config, out, as_json, "compare (tuned, held-out prompts)", columns=columns,
               budget_s=budget_s, prompts=prompts, relabel=relabel, view=view,
               side_files=lambda summary, notes: write_table(summary, [*notes, note]))
