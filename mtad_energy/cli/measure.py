"""`profile` and `compare`: decoders measured over prompts (ar beside them for the speed-up).

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtad_energy.cli.engines import (
    EngineOption,
    EngineOptions,
    engine_configs,
    engine_options,
    refuse_lacking_decoders,
    skipped_decoders,
)
from mtad_energy.cli.options import (
    AllowExec,
    Baseline,
    BatchSize,
    BudgetS,
    Chat,
    Cluster,
    Columns,
    Compile,
    CompileBackend,
    Dataset,
    Draft,
    Dtype,
    DynamicShapes,
    Eager,
    Json,
    MaxNew,
    Meter,
    Mitigate,
    Model,
    NPrompts,
    Ops,
    Output,
    RequireEnergy,
    Seed,
    Sets,
    Target,
    Workers,
    all_decoders,
    build_config,
    check_columns,
    decoder_specs,
    pair_alias,
    parse_sets,
    resolve_compile,
    split_list,
)
from mtad_energy.cli.output import fail, json_command
from mtad_energy.cli.run import run_config
from mtad_energy.cli.tables import SIMULATED_NOTE, is_simulated


@json_command
def profile(
    decoder: Annotated[str, typer.Option("--decoder", "--decoders",
                                         help="decoder name(s), comma separated")] = "mtad",
    baseline: Baseline = "ar",
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    dataset: Dataset = "mtbench", n_prompts: NPrompts = 3, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: Seed = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, allow_code_execution: AllowExec = False, output: Output = None,
    workers: Workers = 1, cluster: Cluster = "local", require_energy: RequireEnergy = False,
    compile: Compile = False, eager: Eager = False, compile_backend: CompileBackend = None,
    dynamic_shapes: DynamicShapes = False, batch_size: BatchSize = 1, columns: Columns = "speed",
    engine: EngineOption = "hf", engine_option: EngineOptions = None, budget_s: BudgetS = None,
    as_json: Json = False,
):
    """Measure decoders on a dataset: tokens/s, block efficiency, acceptance, perplexity, J/token.

    Re-running the same command resumes: rows already in --output are not measured again."""
    from mtad_energy.bench.work_units import with_baseline

    try:
        specs = decoder_specs(with_baseline(split_list(decoder), baseline), parse_sets(set_), engine)
        config = build_config(
            specs, sweep="profile", model=model, target=target, draft=draft, dataset=dataset,
            n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed, repeats=repeats,
            meter=meter, mitigate=mitigate, device=device, dtype=dtype, chat=chat, ops=ops,
            allow_code_execution=allow_code_execution, require_energy=require_energy,
            compile=resolve_compile(compile, eager, device, engine), batch_size=batch_size,
            compile_backend=compile_backend, dynamic_shapes=dynamic_shapes)
        check_columns(columns)
        options = engine_options(engine_option, engine)
        refuse_lacking_decoders([s.name for s in specs], engine, "profile",
                                "--decoder (or --baseline)")
        configs = engine_configs(config, engine, options=options)
    except ValueError as error:
        fail(error)
    run_config(configs, output or Path("results/profile"), as_json, "profile", workers=workers,
               cluster=cluster, columns=columns, baseline=baseline, budget_s=budget_s)


@json_command
def compare(
    ctx: typer.Context,
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    decoders: Annotated[str | None, typer.Option(
        "--decoders", "--decoder", show_default=False,
        help="comma list [default: every registered decoder (`mtad-energy decoders`); eagle and "
             "medusa where the pair has their heads]")] = None,
    dataset: Dataset = "humaneval,mtbench", n_prompts: NPrompts = 2, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: Seed = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, allow_code_execution: AllowExec = False, output: Output = None,
    markdown: Annotated[Path | None, typer.Option(help="markdown table file (default: <output>.md "
                                                       "beside the store)")] = None,
    workers: Workers = 1, cluster: Cluster = "local", require_energy: RequireEnergy = False,
    compile: Compile = False, eager: Eager = False, compile_backend: CompileBackend = None,
    dynamic_shapes: DynamicShapes = False, batch_size: BatchSize = 1, columns: Columns = "speed",
    engine: EngineOption = "hf", engine_option: EngineOptions = None, budget_s: BudgetS = None,
    tuned: Annotated[Path | None, typer.Option(
        metavar="STORE", help="each decoder at the setting `mtad-energy tune --output STORE` "
                              "chose, on held-out prompts (model, decoders, dataset: the tune's)")] = None,
    as_json: Json = False,
):
    """All decoders side by side in the paper's main-table layout.

    The markdown export marks the best value of each column in bold and the second underlined.
    With --tuned STORE: the settings a tune chose, on prompts its validation split left out."""
    if tuned is not None:
        from mtad_energy.cli.tune import held_out_store, tuned_compare
        from mtad_energy.config import MeasureConfig

        out = output or held_out_store(tuned)
        try:
            path = markdown_path(markdown, out)
        except ValueError as error:
            fail(error)
        return tuned_compare(ctx, tuned, out, lambda summary, notes: write_main_table(
            summary, notes, path), n_prompts=n_prompts, repeats=repeats,
            measure=MeasureConfig(meter, mitigate, require_energy=require_energy),
            allow_exec=allow_code_execution, columns=columns, budget_s=budget_s, as_json=as_json)
    out = output or Path("results/compare")
    try:
        names = compare_decoders(decoders, model, target, draft, device)
        specs = decoder_specs(names, parse_sets(set_), engine)
        config = build_config(
            specs, model=model, target=target, draft=draft, dataset=dataset, n_prompts=n_prompts,
            max_new_tokens=max_new_tokens, seed=seed, repeats=repeats, sweep="compare",
            meter=meter, mitigate=mitigate, device=device, dtype=dtype, chat=chat, ops=ops,
            allow_code_execution=allow_code_execution, require_energy=require_energy,
            compile=resolve_compile(compile, eager, device, engine), batch_size=batch_size,
            compile_backend=compile_backend, dynamic_shapes=dynamic_shapes)
        check_columns(columns)
        skipped = skipped_decoders(config, engine)  # each engine runs the decoders it has
        configs = engine_configs(config, engine, skipped,
                                 options=engine_options(engine_option, engine))
        path = markdown_path(markdown, out)  # before measuring: a name that cannot be written
    except ValueError as error:
        fail(error)
    run_config(configs, out, as_json, "compare", workers=workers, cluster=cluster,
               columns=columns, budget_s=budget_s,
               side_files=lambda summary, notes: write_main_table(summary, notes, path),
               decoders_skipped=skipped)


def pair_head_kinds(model: str, target: str | None, draft: str | None, device: str) -> list[str]:
    """The registered head decoders (``medusa``, ``eagle``) whose heads the pair names (``--draft
    KIND:DIR`` or the alias's): `compare`'s default runs them beside the others. Loads nothing."""
    from mtad_energy.decoding.registry import DECODERS
    from mtad_energy.models import resolve_device, resolve_pair_spec

    spec = resolve_pair_spec(pair_alias(model, target), resolve_device(device), target=target,
                             draft=draft)
    return [name for name, cls in DECODERS.items() if cls.head is not None and spec.head(cls.head)]


def compare_decoders(decoders: str | None, model: str, target: str | None, draft: str | None,
                     device: str) -> list[str]:
    """The decoders `compare` runs: ``--decoders`` as listed, else (the default) every registered
    decoder the pair can run (`all_decoders` and `pair_head_kinds`)."""
    if decoders is not None:
        return split_list(decoders)
    return [*all_decoders(), *pair_head_kinds(model, target, draft, device)]


def markdown_path(markdown: Path | None, out: Path) -> Path:
    """Where compare writes its markdown table: ``--markdown``, or ``<output>.md`` beside the
    store (`beside_store`: ``--output st/v.1`` and ``st/v.2`` get files of their own).

    Raises:
        ValueError: the file would be the store or inside it, or is a directory.
    """
    from mtad_energy.results.store_files import beside_store, outside_store

    path = outside_store(markdown or beside_store(out, ".md"), out, "--markdown")
    if path.is_dir():
        raise ValueError(f"--markdown {path} is a directory; give it a file name (default: "
                         "<output>.md beside the store)")
    return path


def write_main_table(summary, notes: list[str], path: Path) -> dict[str, Path]:
    """Write the main table in markdown to ``path`` (best **bold**, second <u>underlined</u>),
    with the terminal table's marks and notes (`results.caveats`): contended, implausible,
    random weights, simulated joules, and the run's notes."""
    from mtad_energy.config import RANDOM_NOTE
    from mtad_energy.results.caveats import marked_main_table

    md = marked_main_table(summary)
    if "meter" in summary and summary["meter"].map(is_simulated).any():
        md += "\n" + SIMULATED_NOTE.replace("J/tok", "J/token") + ".\n"
    md += "".join(f"\nNote: {note}.\n" for note in notes if note != RANDOM_NOTE)  # marked: †
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md + "\n")
    return {"markdown": path}
