"""Parsing what the user typed, in one place: option values (lists, ranges, sizes, ``--set``),
decoder specs, the pair, and the typer option types the measuring commands share.

Heavy imports (torch, pandas) happen inside the functions so that `mtad-energy --help` stays fast
and `import mtad_energy.cli` loads no torch.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from mtad_energy.config import RANDOM_NOTE, DecoderSpec, MeasureConfig, ModelSpec, RunConfig, random_weights


def parse_sets(sets: list[str] | None, option: str = "--set") -> dict[str, str]:
    """['tau=0.3', 'beam_width=8'] -> {'tau': '0.3', 'beam_width': '8'}. A key given twice is
    refused (the later value would silently replace the earlier)."""
    out: dict[str, str] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{option} expects key=value, got {item!r}")
        if "," in value and not all(v.strip() for v in value.split(",")):  # 1,,2 is not 1,2
            raise typer.BadParameter(f"{item!r} has an empty value between commas; write e.g. "
                                     f"{key.strip()}=1,2,3")
        if key.strip() in out:
            raise UsageError(f"{option} {key.strip()} is given twice ({key.strip()}="
                             f"{out[key.strip()]} and {key.strip()}={value.strip()}): the second "
                             f"would replace the first; give it once, every value in one list "
                             f"(e.g. {key.strip()}=1,2,3 or {key.strip()}=1..8)")
        out[key.strip()] = value.strip()
    return out


def pair_alias(model: str, target: str | None) -> str | None:
    """The alias to load: a --target of one's own replaces the default pair, whose name it must
    not carry (its rows and output say "custom"); an alias asked for by name keeps its name."""
    return None if target and model == "smollm2" else model


def ignored_draft_notes(decoders: Sequence[Any], alias: str | None, target: str | None,
                        draft: str | None, device: str = "auto") -> list[str]:
    """Notes naming the decoders that draft without a draft model (``needs_draft`` False with a
    draft of their own, such as ``pld``'s prompt lookup) when the pair has a draft (``--draft``
    or the alias's): they ignore it, and it is not loaded when no other decoder uses it."""
    from mtad_energy.models import resolve_device, resolve_pair_spec

    own = [d.name for d in decoders if getattr(d, "drafts_without_model", False)]
    if not own:
        return []
    try:
        name = resolve_pair_spec(alias, resolve_device(device), target=target, draft=draft).draft
    except ValueError:
        return []
    if not name:
        return []
    loaded = any(d.needs_draft for d in decoders)
    return [f"{', '.join(own)} draft{'s' if len(own) == 1 else ''} without a draft model: the "
            f"pair's draft ({name}) is ignored"
            + (" by it" if loaded and len(own) == 1 else " by them" if loaded else
               " and not loaded")]


def random_weight_notes(target: str | None, draft: str | None = None) -> list[str]:
    """`RANDOM_NOTE` when the target or the draft (a model or heads) has random weights."""
    return [RANDOM_NOTE] if any(random_weights(m) for m in (target, draft)) else []


def all_decoders() -> tuple[str, ...]:
    """`compare`'s default decoders, read from the registry (`decoding.registry.DECODERS`, in its
    order): every registered decoder that drafts with no head; the head decoders join where the
    pair has their heads (`pair_head_kinds`)."""
    from mtad_energy.decoding.registry import DECODERS

    return tuple(name for name, cls in DECODERS.items() if cls.head is None)


def __getattr__(name: str) -> Any:
    """``ALL_DECODERS`` (`all_decoders`), read from the registry when first asked for: importing
    this module loads no decoder (nor torch)."""
    if name == "ALL_DECODERS":
        return all_decoders()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


# -- parsing -----------------------------------------------------------------------------------
def split_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def decoder_specs(names: list[str], sets: dict[str, str], engines: str = "hf",
                  variants: bool = False) -> tuple[DecoderSpec, ...]:
    """The one parse of ``--set`` into validated decoder specs, which the commands pass down.
    ``key=v`` goes to every listed decoder that has the parameter; ``decoder.key=v`` to that
    decoder only. A key no listed decoder has is an error. A parameter only an engine of
    ``engines`` (``--engine``) has for the decoder (vLLM's ``per_batch_size``) is taken here; an
    engine without it refuses it by name (`mtad_energy.engines.check_engine_options`).
    ``variants`` (`sweep batch-size`): a comma list given to a scalar parameter is one decoder
    per value (`registry.expand_variants`). Where hf runs them (``engines`` holds hf), each
    spec's own parameters are checked against the decoder's types and rules now
    (`registry.build_decoder`), before anything loads; another engine's values (vLLM's
    gamma=0) are that engine's to check."""
    from mtad_energy.decoding.registry import DECODERS, build_decoder, expand_variants, param_types

    def has(decoder: str, name: str) -> bool:
        return name in param_types(decoder) or name in engine_params(engines, decoder)

    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise UsageError(f"unknown decoder {', '.join(unknown)}; available: {', '.join(DECODERS)}")
    params: dict[str, dict[str, str]] = {n: {} for n in names}
    for key, value in sets.items():
        scope, dot, name = key.rpartition(".")
        targets = [scope] if dot else names
        if dot and scope not in params:
            raise UsageError(f"--set {key}: decoder {scope!r} is not among --decoder {','.join(names)}")
        hit = [n for n in targets if has(n, name)]
        if not hit:
            owners = engine_owners(name, targets)
            if owners:  # vLLM's per_batch_size without --engine vllm
                whose = " and ".join(f"{e}'s {', '.join(ds)}" for e, ds in owners.items())
                raise UsageError(f"--set {key}: {name!r} is a parameter of {whose}, not of the "
                                 f"project's decoders (--engine hf): add --engine {next(iter(owners))} "
                                 f"(or drop --set {key})")
            raise UsageError(f"--set {key}: no selected decoder ({', '.join(targets)}) has a parameter "
                             f"{name!r}; `mtad-energy decoders` lists them")
        for n in hit:
            params[n][name] = value
    specs = tuple(DecoderSpec.of(n, **params[n]) for n in names)
    specs = tuple(expand_variants(specs)) if variants else specs
    if "hf" in split_list(engines) or not engines.strip():
        for spec in specs:  # the parameters hf's decoders have; an engine's own: `engines`'s
            own = param_types(spec.name)
            build_decoder(DecoderSpec.of(spec.name, **{k: v for k, v in spec.params if k in own}))
    return specs


def engine_params(engines: str, decoder: str) -> frozenset[str]:
    """The parameters any engine of ``engines`` other than hf honours for ``decoder``."""
    if engines.strip() in ("", "hf"):
        return frozenset()
    from mtad_energy.engines.registry import HF, engine_kind, parse_engines

    return frozenset().union(*(engine_kind(e).param_names(decoder) for e in parse_engines(engines)
                               if e != HF))


def engine_owners(name: str, decoders: Sequence[str]) -> dict[str, list[str]]:
    """engine -> its decoders among ``decoders`` that take parameter ``name`` (hf left out)."""
    from mtad_energy.engines.registry import ENGINES, HF

    return {e: ds for e, kind in ENGINES.items() if e != HF
            if (ds := [d for d in decoders if name in kind.param_names(d)])}


MAX_SWEEP_VALUES = 1000  # values per --param range, and configurations per sweep grid


def parse_range(text: str) -> list[str]:
    """'3..10' -> 3,4,...,10; '3..10:2' -> 3,5,7,9; '0.1,0.3,0.5' -> as listed."""
    m = re.fullmatch(r"\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*(?::\s*(\d+))?\s*", text)
    if m:
        lo, hi, step = int(m[1]), int(m[2]), int(m[3] or 1)
        if hi < lo or step < 1:
            raise UsageError(f"range {text!r} is empty; write LOW..HIGH with LOW <= HIGH")
        count = (hi - lo) // step + 1
        if count > MAX_SWEEP_VALUES:
            raise UsageError(f"range {text!r} has {count} values, more than the {MAX_SWEEP_VALUES} a sweep "
                             "may run; narrow it or add a step (LOW..HIGH:STEP)")
        return [str(v) for v in range(lo, hi + 1, step)]
    values = split_list(text)
    if not values:
        raise UsageError(f"no values in {text!r}; write e.g. gamma=3..10 or tau=0.1,0.3,0.5")
    return values


def parse_sizes(text: str, option: str = "--sizes") -> list[int]:
    try:
        sizes = [int(s) for s in split_list(text)]
    except ValueError:
        raise UsageError(f"{option} expects integers like 1,2,4,8,16, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"{option} must be positive integers, got {text!r}")
    return list(dict.fromkeys(sizes))  # a size listed twice runs once (and counts once)


COLUMN_SETS = ("speed", "energy")


def check_columns(columns: str) -> str:
    if columns not in COLUMN_SETS:
        raise UsageError(f"--columns {columns!r}: choose {' or '.join(COLUMN_SETS)}")
    return columns


def build_config(decoders: tuple[DecoderSpec, ...], *, sweep: str, model, target, draft, dataset,
                 n_prompts, max_new_tokens, seed, repeats, meter, mitigate, device, dtype, chat,
                 ops=False, allow_code_execution=False, require_energy=False, compile=False,
                 batch_size=1, compile_backend=None, dynamic_shapes=False):
    """The `RunConfig` of a measuring command's options (validated by its constructor); every
    option by name (a command passes twenty: none by position)."""
    return RunConfig(
        decoders=decoders, model=ModelSpec(pair_alias(model, target), target, draft, device, dtype),
        datasets=tuple(split_list(dataset)), n_prompts=n_prompts, max_new_tokens=max_new_tokens,
        seed=seed, repeats=repeats, chat=chat, ops=ops,
        measure=MeasureConfig(meter, mitigate, require_energy=require_energy),
        allow_code_execution=allow_code_execution, sweep=sweep, compile=compile,
        batch_size=batch_size, compile_backend=compile_backend, compile_dynamic=dynamic_shapes)


# shared options (typer reads the Annotated metadata)
Model = Annotated[str, typer.Option(help="pair alias (`mtad-energy models`)")]


TARGET_HELP = ("target hub id, local dir or random:SHAPE (random weights at a real shape, e.g. "
               "random:llama3.1-8b; overrides the alias)")
DRAFT_HELP = ("draft hub id, local dir, self:... (int8, layers=0-11, skip=every4) or random:SHAPE, "
              "and/or heads eagle:DIR|random|random-v1, medusa:DIR|random, comma-joined "
              "(overrides the alias)")


Target = Annotated[str | None, typer.Option(help=TARGET_HELP)]


Draft = Annotated[str | None, typer.Option(help=DRAFT_HELP)]


Dataset = Annotated[str, typer.Option(help="humaneval, mtbench, spider, cnn_dailymail, chatalpaca, "
                                           "chatgpt_prompts, NAME:PATH or FILE.jsonl (comma list)")]


NPrompts = Annotated[int, typer.Option(min=1, help="prompts per dataset")]


MAX_SEED = 2**63 - 1  # a row stores its seed as a 64-bit signed integer; torch takes < 2**64


def _seed(value: int) -> int:
    if not 0 <= value <= MAX_SEED:  # torch overflows past 2**64, a row's int64 past 2**63 - 1
        raise typer.BadParameter(f"give a seed in 0..{MAX_SEED} (2^63 - 1: a row stores it as a "
                                 f"64-bit integer), not {value}")
    return value


Seed = Annotated[int, typer.Option(callback=_seed,
                                   help="random seed (repeat r uses seed + r), 0..2^63-1")]


MaxNew = Annotated[int, typer.Option(min=1, help="tokens to generate per prompt")]


Sets = Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                help="decoder param key=value or decoder.key=value")]


Meter = Annotated[str, typer.Option(help="auto, nvml-counter, nvml-power, zeus, rapl, none or simulated "
                                          "(simulated: a modelled GPU and sensor, not a measurement)")]


Mitigate = Annotated[str, typer.Option(help="Yang et al. repetitions: auto (GPU meters that measure "
                                            "energy here)|on|off")]


RequireEnergy = Annotated[bool, typer.Option("--require-energy", help="exit 2 before loading any model "
                                             "when the meter cannot measure energy here")]


def _output(value: Path | None) -> Path | None:
    """--output checked as it is parsed, before anything loads (`store_files.check_output`)."""
    from mtad_energy.results.store_files import check_output

    try:
        return value if value is None else check_output(value, "--output")
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


Output = Annotated[Path | None, typer.Option(callback=_output,
                                             help="results directory (default results/<command>)")]


Json = Annotated[bool, typer.Option("--json", help="print JSON")]


Dtype = Annotated[str | None, typer.Option(metavar="DTYPE", help="fp32|bf16|fp16 [default: bf16 on "
                                                                 "a GPU, fp32 on the CPU]")]


Chat = Annotated[bool | None, typer.Option("--chat/--no-chat", help="chat template (default: if any)")]


Ops = Annotated[bool, typer.Option("--ops", help="also profile FLOPs/bytes per decoder (for decompose)")]


Workers = Annotated[int, typer.Option(min=1, help="split the work over N submitit jobs, one GPU each")]


Cluster = Annotated[str, typer.Option(help="where --workers jobs run: local, slurm or debug")]


Compile = Annotated[bool, typer.Option(
    "--compile", help="static KV cache + torch.compile forwards (CUDA graphs on CUDA); rows are "
                      "stored under model '<model>+compile'")]


Eager = Annotated[bool, typer.Option(
    "--eager", help="eager forwards on a dynamic cache (the default on the CPU; on CUDA the "
                    "default is --compile: eager rows there measure kernel launches, not the "
                    "algorithm, and are labelled launch-bound)")]


def resolve_compile(compile: bool, eager: bool, device: str, engine: str = "hf") -> bool:
    """Whether a measuring command runs the compiled path: ``--compile`` or ``--eager`` as given
    (both: refused), else compiled where the project's decoders (engine hf) run on CUDA, eager
    elsewhere (the CPU; an engine runs its own forwards)."""
    if compile and eager:
        raise UsageError("--compile and --eager contradict each other: keep one (without either, "
                         "the project's decoders run compiled on CUDA and eager on the CPU)")
    if compile or eager:
        return compile
    if engine != "hf":
        return False
    from mtad_energy.models.pair import resolve_device

    return resolve_device(device).type == "cuda"


CompileBackend = Annotated[str | None, typer.Option(
    "--compile-backend", metavar="NAME",
    help="torch.compile backend of --compile (default inductor: CUDA graphs on CUDA; e.g. eager, "
         "aot_eager, cudagraphs); rows are stored under '<model>+compile-NAME', never pooled")]


DynamicShapes = Annotated[bool, typer.Option(
    "--dynamic-shapes", help="--compile with dynamo's automatic dynamic shapes: one symbolic graph "
                             "reused across batch sizes and widths (far fewer compiles, kernels of "
                             "symbolic sizes); rows stored under '<model>+compile[-NAME]-dynamic'")]


BatchSize = Annotated[int, typer.Option(
    min=1, help="prompts decoded together per set of forwards (each keeps its own row; the "
                "batch's energy is split by tokens)")]


AllowExec = Annotated[bool, typer.Option("--allow-code-execution",
                                         help="run HumanEval tests on generated code (sandboxed)")]


Columns = Annotated[str, typer.Option(
    help="summary table: speed (tok/s, speed-up, quality, J/token) or energy (decode J/token by "
         "phase, J per accepted draft token, rejected share: the energy model fitted on the "
         "--output store's batch rows)")]


def _budget_seconds(value: float | None) -> float | None:
    if value is not None and not value >= 0:  # NaN fails every comparison: refused here too
        raise typer.BadParameter(f"give a number of seconds >= 0 (inf: no limit), not {value:g}")
    return value


BudgetS = Annotated[float | None, typer.Option(
    "--budget-s", callback=_budget_seconds,
    help="start no new measurement after this many seconds (model loading included; 0: load "
         "nothing, measure nothing): every row measured is stored, and re-running the same "
         "command goes on from there (for time-limited GPU leases)")]


Baseline = Annotated[str, typer.Option(help="also run this decoder beside the others, for "
                                             "speed-ups ('none': run only the listed ones)")]


# options of one study that the other ignores (`sweep batch-size` with and without --decoder)
FORWARD_ONLY_OPTIONS = ("runs", "forwards_per_run", "context_len", "mitigate", "profile_ops")


DECODING_ONLY_OPTIONS = ("draft", "dataset", "n_prompts", "max_new_tokens", "repeats", "set_",
                         "compile", "eager", "compile_backend", "dynamic_shapes")


def given_options(ctx: typer.Context, names: typing.Iterable[str]) -> list[str]:
    """The options among ``names`` typed on the command line (a default value typed out
    counts), as the user spelled them (``--context-len``)."""
    from typer._click.core import ParameterSource  # typer vendors click

    params = {p.name: p for p in ctx.command.params}
    return [params[n].opts[0] for n in names
            if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
