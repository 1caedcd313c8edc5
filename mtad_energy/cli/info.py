"""Commands that describe rather than measure: `decoders`, `models`, `env`, and `generate` (decode
one prompt and print its text and statistics).

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

from typing import Annotated

import typer

from mtad_energy.cli.options import (
    CompileBackend,
    Draft,
    DynamicShapes,
    Eager,
    Seed,
    Target,
    ignored_draft_notes,
    pair_alias,
    parse_sets,
    random_weight_notes,
    resolve_compile,
)
from mtad_energy.cli.output import console, emit, esc, fail, json_command, quiet_libraries, wrapping_table
from mtad_energy.cli.tables import stats_table


@json_command
def decoders(as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False):
    """List every decoder with its parameters, defaults and one line of help."""
    from mtad_energy.decoding.registry import DECODERS, param_specs

    specs = {name: {"help": cls.help, "needs_draft": cls.needs_draft, "needs_head": cls.head,
                    "params": param_specs(cls)}
             for name, cls in DECODERS.items()}
    if as_json:
        emit(specs)
        return
    cols = ("parameter", "type", "default", "help")
    for name, spec in specs.items():
        table = wrapping_table(cols, [[esc(p[c if c != "parameter" else "name"]) for c in cols]
                                      for p in spec["params"]], left=cols,
                               title=f"[bold]{esc(name)}[/] - {esc(spec['help'])}"
                               + (" [dim](needs a draft)[/]" if spec["needs_draft"] else "")
                               + (f" [dim](needs a {spec['needs_head']} head: --draft "
                                  f"{spec['needs_head']}:DIR)[/]" if spec["needs_head"] else ""))
        console.print(table)
        console.print()


@json_command
def models(as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False):
    """List the model-pair aliases."""
    from mtad_energy.models import ALIASES

    pairs = {name: {"target": spec.target, "draft": spec.draft, "gpu_draft": spec.gpu_draft,
                    "eagle": spec.eagle, "medusa": spec.medusa, "note": spec.note}
             for name, spec in ALIASES.items()}
    if as_json:
        emit(pairs)
        return
    rows = []
    for name, spec in pairs.items():
        draft = spec["draft"] or "-"
        if spec["gpu_draft"] and spec["gpu_draft"] != spec["draft"]:
            draft += f" (CUDA: {spec['gpu_draft']})"
        draft += "".join(f"; {kind} head {spec[kind]}" for kind in ("eagle", "medusa")
                         if spec[kind])
        rows.append([esc(v) for v in (name, spec["target"], draft, spec["note"])])
    cols = ("alias", "target", "draft", "note")
    console.print(wrapping_table(cols, rows, left=cols, keys=("alias",)))  # ids never fold


@json_command
def env(as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False):
    """Environment snapshot and the meter `--meter auto` would pick.

    Shows GPUs, driver, power limits, clocks, libraries and git, and why the other meters were
    not picked."""
    from mtad_energy.measure import preflight_check, select_meter, snapshot

    snap, choice = snapshot(), select_meter()
    warnings = preflight_check(warn=False)
    if as_json:
        emit({**snap.to_dict(), "meter": choice.to_dict(), "preflight": warnings})
        return
    rows = [[esc(key), esc(value)] for key, value in snap.to_dict().items()
            if key not in ("gpus", "libraries")]
    rows += [[f"lib {esc(name)}", esc(version)] for name, version in snap.libraries.items()]
    rows += [[f"gpu {esc(gpu.get('index'))}", esc(", ".join(f"{k}={v}" for k, v in gpu.items()))]
             for gpu in snap.to_dict()["gpus"]]
    console.print(wrapping_table(("field", "value"), rows, left=("field", "value"), show_header=False))
    console.print(f"[bold]meter auto ->[/] {esc(choice.name)}: {esc(choice.reason)}")
    for name, why in choice.rejected:  # the full reasons, which errors and rows only summarise
        console.print(f"  not {esc(name)}: {esc(why)}")
    for w in warnings:
        console.print(f"[yellow]preflight:[/] {esc(w)}")


@json_command
def generate(
    decoder: Annotated[str, typer.Option(help="decoder name (see `mtad-energy decoders`)")] = "mtad",
    model: Annotated[str, typer.Option(help="pair alias (see `mtad-energy models`)")] = "smollm2",
    prompt: Annotated[str, typer.Option(help="prompt text")] = "Write a Python function that "
    "checks whether a number is prime.",
    target: Target = None,
    draft: Draft = None,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                   help="decoder param key=value")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    seed: Seed = 0,
    device: str = "auto",
    dtype: Annotated[str | None, typer.Option(metavar="DTYPE", help="fp32|bf16|fp16 [default: bf16 "
                                                                    "on a GPU, fp32 on the CPU]")] = None,
    chat: Annotated[bool | None, typer.Option(
        "--chat/--no-chat", help="apply the chat template (default: when the tokenizer has one)")] = None,
    compile: Annotated[bool, typer.Option(
        "--compile", help="static KV cache + torch.compile forwards (CUDA graphs on CUDA; the "
                          "default there)")] = False,
    eager: Eager = False,
    compile_backend: CompileBackend = None, dynamic_shapes: DynamicShapes = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
):
    """Decode one prompt and print the text and its statistics."""
    from mtad_energy.config import compile_arg
    from mtad_energy.decoding.registry import get_decoder, head_kinds
    from mtad_energy.decoding.runtime.generate import generate as run
    from mtad_energy.models import load_pair

    quiet_libraries()
    try:
        compiled = resolve_compile(compile, eager, device)  # refused before anything loads
        dec = get_decoder(decoder, **parse_sets(set_))
        compiling = compile_arg(compiled, compile_backend, dynamic_shapes)  # checked before loading
        pair = load_pair(pair_alias(model, target), target=target, draft=draft, device=device,
                         dtype=dtype, with_draft=dec.needs_draft, heads=head_kinds([dec]))
        gen = run(dec, pair, prompt, max_new_tokens=max_new_tokens, seed=seed, chat=chat,
                  compile=compiling)
    except (ValueError, RuntimeError, OSError) as error:
        fail(error)
    notes = ignored_draft_notes([dec], pair_alias(model, target), target, draft, device) + \
        random_weight_notes(target, draft)
    if as_json:
        emit({**gen.to_dict(), "pair": pair.describe(), "notes": notes})
        return
    console.rule(esc(f"{decoder} on {pair.name} ({pair.target_id} + "
                     f"{pair.draft_id_for(dec) or 'no draft'})"))
    if pair.draft_note and pair.draft_id:
        console.print(pair.draft_line(), markup=False, highlight=False)
    for note in notes:
        console.print(f"[yellow]note:[/] {esc(note)}")
    console.print(gen.text, markup=False, highlight=False)
    console.rule()
    console.print(stats_table([(decoder, gen.to_dict()["stats"])]))
