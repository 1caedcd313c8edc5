"""A dataset split into a validation part (what `mtad-energy tune` chooses settings on) and a
held-out part (what `compare --tuned` measures the chosen settings on), disjoint by construction.

The rule: within each dataset, prompts are ordered by a hash of (split seed, dataset, prompt id,
prompt text); the first ``n_validation`` are the validation part, the rest the held-out part in
that order. The order depends on nothing but the prompts and the seed, so the validation part is
the same whichever number of held-out prompts a later comparison takes, and listing another
dataset beside one does not move that one's split (a dataset that changes does: `compare --tuned`
checks that the tune's validation prompts come out again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from mtad_energy.bench.prompts import Prompt, load_prompts

MIN_VALIDATION = 2  # one prompt gives no bootstrap: every resample is that prompt


@dataclass(frozen=True)
class Split:
    """The prompts of ``datasets`` in their two parts (each: dataset by dataset, in split order)."""

    validation: tuple[Prompt, ...]
    held_out: tuple[Prompt, ...]


def _rank(prompt: Prompt, seed: int) -> str:
    blob = f"{seed}\x00{prompt.dataset}\x00{prompt.id}\x00{prompt.text}".encode()
    return hashlib.sha256(blob).hexdigest()


def check_validation_size(n_validation: int) -> None:
    """Refuse a validation part the choice cannot be made on (ValueError naming the fix)."""
    if n_validation < MIN_VALIDATION:
        what = "an empty validation split" if n_validation < 1 else "a one-prompt validation split"
        raise ValueError(f"--val-prompts {n_validation} gives {what}: a setting's win cannot be "
                         f"resampled; give --val-prompts {MIN_VALIDATION} or more")


def split_prompts(prompts: Sequence[Prompt], n_validation: int, seed: int = 0) -> Split:
    """``prompts`` split per dataset: the first ``n_validation`` of each dataset's hash order are
    validation, the rest held out.

    Raises:
        ValueError: fewer than `MIN_VALIDATION` validation prompts, or a dataset with no prompt
            left over for the held-out part.
    """
    check_validation_size(n_validation)
    by_dataset: dict[str, list[Prompt]] = {}
    for p in dict.fromkeys(prompts):
        by_dataset.setdefault(p.dataset, []).append(p)
    validation: list[Prompt] = []
    held_out: list[Prompt] = []
    for name, group in by_dataset.items():
        if len(group) <= n_validation:
            raise ValueError(f"dataset {name} has {len(group)} prompt(s): --val-prompts "
                             f"{n_validation} would leave none held out for the comparison; give "
                             f"--val-prompts {max(len(group) - 1, 1)} or less, or a larger dataset")
        ordered = sorted(group, key=lambda p: _rank(p, seed))
        validation += ordered[:n_validation]
        held_out += ordered[n_validation:]
    return Split(tuple(validation), tuple(held_out))


def load_split(datasets: Sequence[str], n_validation: int, seed: int = 0) -> Split:
    """`split_prompts` over every prompt of ``datasets`` (names as ``--dataset`` takes them)."""
    check_validation_size(n_validation)  # before reading any file
    prompts: list[Prompt] = []
    for name in datasets:
        prompts += load_prompts(name)
    return split_prompts(prompts, n_validation, seed)


def first_per_dataset(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """The first ``n`` of each dataset's prompts, in order (held-out prompts for ``--n-prompts``)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if seen.get(p.dataset, 0) < n:
            out.append(p)
            seen[p.dataset] = seen.get(p.dataset, 0) + 1
    return out
