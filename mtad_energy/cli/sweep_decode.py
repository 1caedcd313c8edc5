"""`sweep batch-size --decoder`: real decoding of B prompts at once per decoder and batch size
(`bench.decode_batch`), the crossover with ar, its table, plot and JSON document.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

from pathlib import Path

from mtad_energy.cli.engines import each_engine, engine_options, sweep_engines
from mtad_energy.cli.options import (
    decoder_specs,
    ignored_draft_notes,
    pair_alias,
    parse_sets,
    parse_sizes,
    random_weight_notes,
    split_list,
)
from mtad_energy.cli.output import console, emit, esc, fail, integer_records, wrapping_table
from mtad_energy.cli.run import check_before_loading, progress_bar, warn_if_busy
from mtad_energy.cli.store import compact_after
from mtad_energy.cli.tables import SIMULATED_NOTE, short_reason
from mtad_energy.config import MeasureConfig, ModelSpec, compile_arg, compile_label


def spent(out: Path, meter: str, budget, as_json: bool, load: dict | None) -> None:
    """A sweep's output when the budget was spent before its first point (nothing loaded)."""
    if as_json:
        emit({"output": str(out), "meter": meter, "rows": [], "budget": budget.to_dict(),
              "notes": [budget.note()], "machine_load": load})
    else:
        console.print(f"[yellow]note:[/] {esc(budget.note())}")


def decode_batch_sweep_command(*, decoders, model, target, draft, sizes, dataset, n_prompts,
                               max_new_tokens, repeats, sets, meter, device, dtype, seed,
                               out: Path, require_energy, as_json, compile: bool = False,
                               engine: str = "hf", budget=None,
                               compile_backend: str | None = None, dynamic_shapes: bool = False,
                               engine_option: list[str] | None = None) -> None:
    """`sweep batch-size --decoder`: decode, store, and print or emit the crossover (every
    option by name)."""
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.bench.work_units import fewer_prompts_note
    from mtad_energy.decoding.registry import head_kinds
    from mtad_energy.decoding.runtime.generate import encode_prompt
    from mtad_energy.engines.hf import project_decoders
    from mtad_energy.measure import meter_for, snapshot
    from mtad_energy.models import load_pair
    from mtad_energy.results import ResultStore
    from mtad_energy.results.analysis import LAUNCH_BOUND_NOTE
    from mtad_energy.results.crossover import (
        batch_crossover,
        crossover_display,
        crossover_notes,
        crossover_settings,
        crossover_title,
    )
    from mtad_energy.results.figures import plot_batch_crossover
    from mtad_energy.results.store_files import beside_store

    try:
        names = split_list(decoders)
        if "ar" not in names:
            names = ["ar", *names]  # the baseline of every speed-up
        specs = decoder_specs(names, parse_sets(sets), engine, variants=True)  # gamma=1,2,3,5
        size_list = parse_sizes(sizes)
        compile_arg(compile, compile_backend, dynamic_shapes)  # refused without --compile
        m, why = meter_for(meter)
        MeasureConfig(meter, "off", require_energy=require_energy).mitigation_for(m)
        engines = sweep_engines(engine, specs, size_list, compile)  # refusals before loading
        settings = engine_options(engine_option, engine)
        # the plot: beside the store (it holds only tables), named by setting: an eager sweep
        # into the same store does not overwrite the compiled sweep's plot (an engine's sweep is
        # named by its engines: an hf sweep into the same store keeps its own)
        from mtad_energy.engines.registry import engine_kind  # a server's URL: its kind, http

        setting = "-".join([*(engine_kind(e).name for e in engines if e != "hf"), *(
            [compile_label(compile_backend, dynamic_shapes)[1:]] if compile else [])])
        png = beside_store(out, f"-crossover{'-' + setting if setting else ''}.png")
        # the project's decoders, built (their parameters checked) only where hf runs them: an
        # engine's parameter values (vLLM's gamma=0, per_batch_size) are the engine's to check
        built = project_decoders(engines, specs)
        model_spec = ModelSpec(pair_alias(model, target), target, draft, device, dtype)
        check_before_loading(model_spec, built)
        if budget.skip(len(specs) * len(size_list) * repeats * len(engines)):  # nothing loads
            return spent(out, m.name, budget, as_json, None)
        needs_draft = any(d.needs_draft for d in built)
        with console.status("loading the models"):
            pair = load_pair(pair_alias(model, target), target=target, draft=draft, device=device,
                             dtype=dtype, with_draft=needs_draft,
                             heads=head_kinds(built))
        loaded = load_prompts(dataset, n_prompts)
        fewer = fewer_prompts_note(dataset, n_prompts, len(loaded))  # said with the notes
        prompts = [encode_prompt(pair, p.text) for p in loaded]
        store = ResultStore(out)
        snap = snapshot()
        store.write_env(snap.snapshot_id, snap.to_dict())
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    load = warn_if_busy(as_json)
    total = len(specs) * len(size_list) * repeats * len(engines)
    not_run: list[dict] = []  # sizes skipped for memory, with the reason
    if not as_json:
        console.print("[bold]model[/] " + esc(f"{pair.name}: {pair.target_id} + "
                                               f"{pair.draft_id or 'no draft'} on "
                                               f"{pair.describe()['device']}"))
        console.print(f"[bold]meter[/] {esc(m.name)}: {esc(short_reason(why))}")
    done = {"ran": 0, "skipped": 0}
    try:
        with progress_bar() as bar:
            task = bar.add_task("decode batch sizes", total=total, note="")

            def step(row: dict, ran: bool) -> None:
                done["ran" if ran else "skipped"] += 1
                bar.update(task, advance=1, note=f"{row['label']} B={row['batch_size']}: " + (
                    f"{row['tokens_per_s']:.1f} tok/s" if ran else "(stored)"))

            def skip(label: str, b: int, reason: str) -> None:
                not_run.append({"decoder": label, "batch_size": b, "reason": reason})
                bar.update(task, advance=repeats, note=f"{label} B={b}: does not fit")

            rep = each_engine(engines, model_spec, lambda e: decode_batch_sweep(
                pair, specs, size_list, prompts, store, m, model=pair.name, dataset=dataset,
                max_new_tokens=max_new_tokens, repeats=repeats, seed=seed,
                env_id=snap.snapshot_id, progress=step, compile=compile, on_skip=skip, engine=e,
                budget=budget, compile_backend=compile_backend, compile_dynamic=dynamic_shapes),
                settings, pair=pair, meter=m,
                compile=compile_arg(compile, compile_backend, dynamic_shapes))
    except KeyboardInterrupt:
        fail(f"interrupted: {done['ran']} row(s) measured and stored in {out} ({done['skipped']} "
             f"were stored before), {total - done['ran'] - done['skipped']} left; re-run the same "
             "command to resume where it stopped", code=130, label="[yellow]")
    except (ValueError, RuntimeError) as error:
        fail(error)
    finally:
        m.close()
    compact_after(out)
    table = batch_crossover(rep.rows)
    notes = [fewer] if fewer else []
    notes += ignored_draft_notes(built, pair_alias(model, target), target,
                                 draft, device) + random_weight_notes(target, draft) + crossover_notes(table)
    notes += [budget.note()] if budget is not None and budget.note() else []
    if not compile and "hf" in engines and pair.describe()["device"].startswith("cuda"):
        notes.append(LAUNCH_BOUND_NOTE)  # eager on a GPU: launches, not the algorithm
    who = pair.name if engines == ["hf"] else f"{pair.name} ({', '.join(engines)})"
    plot_batch_crossover(table, f"{who}: decoders at batch sizes "
                                f"{', '.join(map(str, size_list))} ({max_new_tokens} tokens, "
                                f"{pair.describe()['device']})").savefig(png, dpi=150)
    if as_json:
        emit({"output": str(out), "meter": m.name, "plot": str(png), "ran": rep.ran,
              "skipped": rep.skipped, "not_run": not_run, "notes": notes, "machine_load": load,
              **({"budget": budget.to_dict()} if budget is not None and budget.seconds is not None
                 else {}),
              "rows": integer_records(table)})
        return
    shown = crossover_display(table)
    t = wrapping_table(list(shown.columns), [[esc(v) for v in r] for r in shown.to_numpy()],
                       left=("decoder",), title=esc(crossover_title(table) + "".join(
                           f"\n{name}" for name, _ in crossover_settings(table)[:1])))
    reasons = sorted({short_reason(r) for r in table["energy_reason"].dropna()})
    captions = [SIMULATED_NOTE] if m.name == "simulated" and len(reasons) == 0 else []
    if reasons:
        captions.append("J/tok n/a: " + "; ".join(reasons))
    if captions:
        t.caption = esc("\n".join(captions))
    console.print(t)
    for s in not_run:
        console.print(f"[yellow]not run:[/] {esc(s['decoder'])} at B={s['batch_size']}: "
                      f"{esc(s['reason'])}")
    for note in notes:
        console.print(f"[yellow]note:[/] {esc(note)}")
    console.print(f"[dim]{rep.ran} row(s) measured, {rep.skipped} already stored; results in "
                  f"{esc(out)}; plot {esc(png)}[/]")
