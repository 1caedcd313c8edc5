"""`sweep param` and `sweep batch-size`: ablations of a decoder's parameters, and the batch-size
study (forward-only, the identifying design, or real decoding of B prompts at once); `sweep draft`
(drafts side by side) is `sweep_draft`'s.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from mtad_energy.cli.engines import (
    EngineOption,
    EngineOptions,
)
from mtad_energy.cli.options import (
    DECODING_ONLY_OPTIONS,
    FORWARD_ONLY_OPTIONS,
    MAX_SWEEP_VALUES,
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
    UsageError,
    Workers,
    build_config,
    check_columns,
    decoder_specs,
    given_options,
    pair_alias,
    parse_range,
    parse_sets,
    parse_sizes,
    resolve_compile,
)
from mtad_energy.cli.output import (
    console,
    emit,
    esc,
    fail,
    integer_records,
    json_command,
    quiet_libraries,
)
from mtad_energy.cli.run import check_before_loading, progress_bar, run_config, warn_if_busy
from mtad_energy.cli.store import compact_after
from mtad_energy.cli.sweep_decode import decode_batch_sweep_command, spent
from mtad_energy.cli.sweep_draft import sweep_draft
from mtad_energy.cli.tables import batch_sweep_table, short_reason
from mtad_energy.config import MeasureConfig, ModelSpec

sweep_app = typer.Typer(help="Batch-size, parameter and draft sweeps.", no_args_is_help=True)


@json_command
def sweep_param(
    decoder: Annotated[str, typer.Option(help="the decoder to sweep")] = "mmtad",
    param: Annotated[list[str] | None, typer.Option(metavar="NAME=VALUES",
                                                    help="NAME=3..10 or NAME=0.1,0.3 (repeatable: "
                                                          "the grid of all combinations)")] = None,
    baseline: Baseline = "ar",
    model: Model = "smollm2", target: Target = None, draft: Draft = None,
    dataset: Dataset = "mtbench", n_prompts: NPrompts = 2, max_new_tokens: MaxNew = 32,
    set_: Sets = None, seed: Seed = 0, repeats: Annotated[int, typer.Option(min=1)] = 1,
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None, chat: Chat = None,
    ops: Ops = False, output: Output = None, workers: Workers = 1, cluster: Cluster = "local",
    require_energy: RequireEnergy = False, compile: Compile = False, eager: Eager = False,
    compile_backend: CompileBackend = None, dynamic_shapes: DynamicShapes = False,
    batch_size: BatchSize = 1, columns: Columns = "speed", budget_s: BudgetS = None,
    as_json: Json = False,
):
    """Ablations: one decoder over a grid of parameter values (e.g. --param gamma=3..10)."""
    import itertools

    try:
        if not param:
            raise UsageError("give at least one --param NAME=VALUES, e.g. --param gamma=3..10")
        grid = parse_sets(param, "--param")
        fixed = parse_sets(set_)
        if both := [k for k in grid if k in fixed]:  # the grid would replace the fixed value
            raise UsageError(f"{', '.join(both)} is given by both --param and --set; keep one "
                             "(--param sweeps it, --set fixes it)")
        axes = {k: parse_range(v) for k, v in grid.items()}
        if math.prod(len(v) for v in axes.values()) > MAX_SWEEP_VALUES:
            sizes = " x ".join(str(len(v)) for v in axes.values())
            raise UsageError(f"the --param grid has {sizes} = {math.prod(len(v) for v in axes.values())} "
                             f"configurations, more than the {MAX_SWEEP_VALUES} a sweep may run; narrow "
                             "the ranges")
        specs = [decoder_specs([decoder], {**fixed, **dict(zip(axes, combo, strict=True))})[0]
                 for combo in itertools.product(*axes.values())]
        if baseline != "none":
            specs = list(decoder_specs([baseline], {})) + specs
        config = build_config(
            tuple(specs), sweep=f"param-{decoder}", model=model, target=target, draft=draft,
            dataset=dataset, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed,
            repeats=repeats, meter=meter, mitigate=mitigate, device=device, dtype=dtype,
            chat=chat, ops=ops, require_energy=require_energy,
            compile=resolve_compile(compile, eager, device), batch_size=batch_size,
            compile_backend=compile_backend, dynamic_shapes=dynamic_shapes)
        check_columns(columns)
    except ValueError as error:
        fail(error)
    run_config(config, output or Path(f"results/sweep-{decoder}"), as_json, f"{decoder} sweep",
               workers=workers, cluster=cluster, columns=columns, baseline=baseline,
               budget_s=budget_s)


@json_command
def sweep_batch_size(
    ctx: typer.Context,
    model: Model = "smollm2", target: Target = None,
    sizes: Annotated[str, typer.Option(help="batch sizes, comma separated")] = "1,2,4,8,16",
    runs: Annotated[int, typer.Option(min=1, help="runs (target forward groups) per batch size")] = 10,
    forwards_per_run: Annotated[int, typer.Option(min=1, help="decode forwards per run")] = 8,
    context_len: Annotated[int, typer.Option(min=1, help="KV-cache length per row")] = 128,
    contexts: Annotated[str, typer.Option(help="also decode at batch size 1 over these cache lengths "
                                               "(e.g. 1024,4096,8192: KV bytes vary, for decompose)")] = "",
    chunks: Annotated[str, typer.Option(help="also run one forward of these many new tokens over "
                                             "--context-len (e.g. 128,1024,4096: FLOPs vary)")] = "",
    meter: Meter = "auto", mitigate: Mitigate = "auto", device: str = "auto",
    dtype: Dtype = None,
    profile_ops: Annotated[bool, typer.Option("--ops/--no-ops", help="T_flop/T_mem per size")] = True,
    seed: Seed = 0, output: Output = None, require_energy: RequireEnergy = False, as_json: Json = False,
    decoder: Annotated[str | None, typer.Option(
        "--decoder", "--decoders",
        help="decode with these decoders (comma list, e.g. ar,spd) at each batch size: tokens/s, "
             "J/token and the crossover with ar; without it, the forward-only study")] = None,
    draft: Draft = None, dataset: Dataset = "mtbench",
    n_prompts: Annotated[int, typer.Option(min=1, help="prompts (cycled to fill a batch)")] = 4,
    max_new_tokens: MaxNew = 32, repeats: Annotated[int, typer.Option(min=1)] = 1,
    set_: Sets = None, compile: Compile = False, eager: Eager = False,
    compile_backend: CompileBackend = None, dynamic_shapes: DynamicShapes = False,
    engine: EngineOption = "hf",
    engine_option: EngineOptions = None, budget_s: BudgetS = None,
):
    """The paper's batch-size study: energy and time per run and per input.

    A fixed number of target runs at each batch size; prints and stores energy, energy/run,
    energy/input, time, time/run, time/input. --contexts and --chunks add the points that make
    the energy roofline identifiable (`mtad-energy decompose`). With --decoder: real decoding of
    B prompts at once per decoder and batch size (--set gamma=1,2,3,5 sweeps variants), and the
    batch size from which each decoder stops beating ar."""
    import pandas as pd

    from mtad_energy.bench.batch_sweep import batch_sweep, batch_table, design_points
    from mtad_energy.bench.budget import Budget
    from mtad_energy.measure import MitigationConfig, meter_for, snapshot
    from mtad_energy.models import load_pair
    from mtad_energy.results import ResultStore
    from mtad_energy.results.analysis import contention_note
    from mtad_energy.results.crossover import batch_axis

    budget = Budget(budget_s)  # from the command's start: loading is part of the lease
    quiet_libraries()
    unused = given_options(ctx, FORWARD_ONLY_OPTIONS if decoder is not None else
                           (*DECODING_ONLY_OPTIONS, "engine", "engine_option"))
    if unused:
        why = ("the decoding sweep (--decoder) decodes prompts: it has no fixed forward runs, "
               "context length or Yang et al. repetitions" if decoder is not None else
               "without --decoder, the forward-only study runs the target on a filled KV cache and "
               "decodes no prompts")
        fail(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used here: {why}; "
             f"drop {'it' if len(unused) == 1 else 'them'}"
             + ("" if decoder is not None else ", or add --decoder ar,spd,... to decode prompts"))
    if decoder is not None:
        try:
            compile = resolve_compile(compile, eager, device, engine)
        except ValueError as error:
            fail(error)
        decode_batch_sweep_command(
            decoders=decoder, model=model, target=target, draft=draft, sizes=sizes,
            dataset=dataset, n_prompts=n_prompts, max_new_tokens=max_new_tokens, repeats=repeats,
            sets=set_, meter=meter, device=device, dtype=dtype, seed=seed,
            out=output or Path("results/batch-size-decode"), require_energy=require_energy,
            as_json=as_json, compile=compile, engine=engine, budget=budget,
            compile_backend=compile_backend, dynamic_shapes=dynamic_shapes,
            engine_option=engine_option)
        return
    out = output or Path("results/batch-size")
    try:
        size_list = parse_sizes(sizes)
        context_list = parse_sizes(contexts, "--contexts") if contexts else []
        chunk_list = parse_sizes(chunks, "--chunks") if chunks else []
        mcfg = MeasureConfig(meter, mitigate, require_energy=require_energy)
        m, why = meter_for(meter)
        mitigates = mcfg.mitigation_for(m)  # before loading: --require-energy, --mitigate on
        check_before_loading(ModelSpec(pair_alias(model, target), target, None, device, dtype))
        if budget.skip(len(design_points(size_list, context_list, chunk_list, context_len, 1))):
            return spent(out, m.name, budget, as_json, None)  # spent: the target never loads
        store = ResultStore(out)
        with console.status("loading the target"):
            pair = load_pair(pair_alias(model, target), target=target, device=device, dtype=dtype,
                             with_draft=False)
        snap = snapshot()
        store.write_env(snap.snapshot_id, snap.to_dict())
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    if not as_json:
        console.print(f"[bold]target[/] {esc(pair.target_id)} on {esc(pair.describe()['device'])}; "
                      f"[bold]meter[/] {esc(m.name)}: {esc(short_reason(why))}")
    load = warn_if_busy(as_json)
    mitigation = MitigationConfig() if mitigates else None
    try:
        with progress_bar() as bar:
            total = len(design_points(size_list, context_list, chunk_list, context_len, 1))
            task = bar.add_task("batch-size", total=total, note="")

            def step(batch_size: int, row: dict) -> None:
                bar.update(task, advance=1, note=f"B={batch_size} c={row['context_len']} "
                                                 f"n={row.get('new_tokens') or 1}: "
                                                 f"{row['time_per_run_s']:.3f} s/run")

            rows = batch_sweep(pair, size_list, runs, store, m, model=pair.name, context_len=context_len,
                               forwards_per_run=forwards_per_run, seed=seed, mitigation=mitigation,
                               profile=profile_ops, env_id=snap.snapshot_id, progress=step,
                               contexts=context_list, chunks=chunk_list, budget=budget)
    except KeyboardInterrupt:
        from mtad_energy.results import load_results

        n = len(load_results(out, "batch"))
        fail(f"interrupted: {n} batch size(s) stored in {out}; re-run to resume", code=130,
             label="[yellow]")
    except (ValueError, RuntimeError) as error:  # e.g. --context-len beyond the model, disk full
        fail(error)
    compact_after(out)
    if not rows:  # the budget was spent before the first point
        return spent(out, m.name, budget, as_json, load)
    table = batch_table(rows)
    busy = {int(r["batch_size"]) for r in batch_axis(pd.DataFrame(rows)).to_dict("records")
            if r.get("contended")}
    contended = contention_note(pd.DataFrame(rows), "batch-sweep points")
    if as_json:
        emit({"output": str(out), "meter": m.name,
              "rows": [{**r, "contended": r["Batch Size"] in busy} for r in integer_records(table)],
              "notes": [contended] if contended else [], "machine_load": load,
              **({"budget": budget.to_dict()} if budget_s is not None else {})})
        return
    t = batch_sweep_table(table, rows, busy, m.name == "simulated", contended)
    console.print(t)
    extra = len(rows) - len(table)
    if extra:
        console.print(f"[dim]+ {extra} context-length / prefill-chunk point(s) for the fit: "
                      f"\n  mtad-energy decompose {esc(out)}[/]", soft_wrap=True)
    if budget.note():
        console.print(f"[yellow]note:[/] {esc(budget.note())}")
    console.print(f"[dim]results in {esc(out)}[/]")


sweep_app.command("param")(sweep_param)
sweep_app.command("batch-size")(sweep_batch_size)
sweep_app.command("draft")(sweep_draft)
