"""What a configuration asks the runner for, settled before any model loads: its prompts
(`load_config_prompts`), its work units (one per prompt, repeat and decoder, in a fixed order:
`WorkUnit`, `work_units`) and a worker's share of them (`shard`), the decoders run beside the
baseline and the one speed-ups are taken over (`with_baseline`, `summary_baseline`), the model
label its rows are stored under (`model_label`), and the refusal of a batch larger than its
prompts (`check_batch_size`).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass

from mtad_energy.bench.prompts import Prompt, load_prompts
from mtad_energy.config import DecoderSpec, RunConfig
from mtad_energy.engines import model_suffix


@dataclass(frozen=True)
class WorkUnit:
    prompt: Prompt
    decoder: DecoderSpec
    repeat: int


def work_units(config: RunConfig, prompts: Sequence[Prompt]) -> list[WorkUnit]:
    """Every row a configuration asks for, in a fixed order (decoders interleaved per prompt so an
    interrupted sweep has covered every decoder on the first prompts). A unit asked for twice (a
    decoder or a dataset listed twice) is listed once."""
    units = [WorkUnit(p, d, r) for p in prompts for r in range(config.repeats) for d in config.decoders]
    return list(dict.fromkeys(units))


def with_baseline(names: Sequence[str], baseline: str) -> list[str]:
    """The decoders to run: ``names`` with ``baseline`` first when it is not among them, so every
    speed-up has its denominator measured beside it in the same store ("none": ``names`` as
    given). The baseline's rows are ordinary rows (interleaved per prompt like the others)."""
    from mtad_energy.decoding.registry import DECODERS

    if baseline == "none":
        return list(names)
    if baseline not in DECODERS:
        raise ValueError(f"--baseline {baseline!r} is not a decoder; give one of "
                         f"{', '.join(DECODERS)}, or none to run only --decoder")
    return list(names) if baseline in names or not names else [baseline, *names]


def summary_baseline(baseline: str) -> str:
    """The decoder speed-ups are taken over: ``baseline``, or ``ar`` with ``--baseline none`` (an
    ``ar`` listed in --decoder still gives them)."""
    return "ar" if baseline == "none" else baseline


def shard(units: Sequence[WorkUnit], index: int, count: int) -> list[WorkUnit]:
    """The units worker ``index`` of ``count`` owns (round-robin, so shards are balanced)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1}")
    return list(units[index::count])


def model_label(config: RunConfig) -> str:
    """The stored ``model``: compiled or batched runs are another system (other times, other
    joules), so reports, baselines and plots keep them apart as ``<model>+compile`` /
    ``<model>+batch<B>``; every row stored under ``+batch<B>`` was decoded with B rows."""
    return (config.model.label + model_suffix(config.engine)
            + config.compile_label
            + (f"+batch{config.batch_size}" if config.batch_size > 1 else ""))


def check_batch_size(config: RunConfig, prompts: Sequence[Prompt]) -> None:
    """Refuse a batch larger than the prompts of a decoder and repeat: its rows could never all
    be this configuration's own prompts (they would be stored as ``+batch<B>`` while fewer rows
    were decoded together)."""
    n = len(dict.fromkeys(prompts))
    if config.batch_size > n:
        raise ValueError(f"--batch-size {config.batch_size} is more than the {n} prompt(s) per "
                         f"decoder and repeat; nothing was run. Give at least {config.batch_size} "
                         f"prompts (--n-prompts, or more datasets) or --batch-size {n} or less")


def load_config_prompts(config: RunConfig) -> list[Prompt]:
    prompts: list[Prompt] = []
    for name in config.datasets:
        prompts += load_prompts(name, config.n_prompts)
    return prompts


def fewer_prompts_notes(config: RunConfig, prompts: Sequence[Prompt]) -> list[str]:
    """A `fewer_prompts_note` per dataset of ``prompts`` (`load_config_prompts`' for ``config``)
    holding fewer than ``config.n_prompts``."""
    counts: dict[str, int] = {}
    for prompt in prompts:
        counts[prompt.dataset] = counts.get(prompt.dataset, 0) + 1
    return [note for name, got in counts.items()
            if (note := fewer_prompts_note(name, config.n_prompts, got))]


def fewer_prompts_note(dataset: str, asked: int, got: int) -> str | None:
    """What to tell the user when ``dataset`` holds fewer prompts than ``--n-prompts`` asked for
    (it runs them all), else None."""
    if got >= asked:
        return None
    used = "it is used" if got == 1 else f"all {got} are used"
    return f"--n-prompts {asked}: {dataset} has {got} prompt{'s' if got != 1 else ''}; {used}"


def check_pair_drafts(config: RunConfig) -> None:
    """Refuse, before any model loads, a configuration whose decoders (the project's: engine hf)
    draft with a model or head its pair will not have (`missing_drafts`): every such decoder
    named at once, so no row is measured before a later decoder stops the run."""
    from mtad_energy.engines.hf import project_decoders
    from mtad_energy.models import resolve_device, resolve_pair_spec

    built = project_decoders(config.engine, config.decoders)
    if not any(d.needs_draft or d.head is not None for d in built):
        return  # nothing to draft with (another engine drafts with its own model)

    m = config.model
    spec = resolve_pair_spec(m.alias, resolve_device(m.device), target=m.target, draft=m.draft)
    if missing := missing_drafts(built, spec):
        raise ValueError(missing)


def missing_drafts(decoders: Sequence[typing.Any], spec: typing.Any) -> str | None:
    """Why ``decoders`` cannot all run with the pair ``spec`` (`models.PairSpec`) names: those
    needing a draft model when it has none, those drafting with a head it lacks; None if all can."""
    from mtad_energy.decoding.registry import DECODERS

    def has(d) -> bool:
        return (spec.draft is not None or not d.needs_draft) and (d.head is None or
                                                                   spec.head(d.head) is not None)

    problems = []
    decoders = list({d.name: d for d in decoders}.values())  # variants of one decoder: once
    if no_model := [d.name for d in decoders if d.needs_draft and spec.draft is None]:
        problems.append(f"{', '.join(no_model)} need{'s' if len(no_model) == 1 else ''} a draft "
                        "model and the pair has none: add --draft (e.g. --draft self:int8)")
    for kind in dict.fromkeys(d.head for d in decoders if d.head is not None):
        if spec.head(kind) is None:
            names = ", ".join(d.name for d in decoders if d.head == kind)
            article = "an" if kind[0] in "aeiou" else "a"
            problems.append(f"{names} draft{'s' if ',' not in names else ''} with {article} {kind} "
                            f"head the pair lacks: add --draft {kind}:DIR")
    if not problems:
        return None
    runs = [n for n, cls in DECODERS.items() if has(cls)]
    return (f"{'; '.join(problems)}; or run only decoders this pair runs ({', '.join(runs)}); "
            "nothing was measured")
