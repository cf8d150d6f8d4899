#!/usr/bin/env bash
# Issue #18's ablation table: the recipe (configs/rl_gpu.yaml) and each of its one-change
# variants (configs/ablations/NAME.yaml) for N iterations from the shipped base, each in
# OUT_DIR/NAME; then each policy N's eval (200 episodes).
#
#   setsid nohup bash scripts/ablate_gpu.sh OUT_DIR [N] [NAME ...] &    # default N 3, all
#   cat OUT_DIR/progress.log                                            # one line per step
#
# `recipe` is the unchanged recipe; its run also scores the base (iter_000/eval.json) unless
# BASE_EVAL=0 (the eval is deterministic: a base score of the same eval config may be copied
# in). EXTRA_CONFIG (YAML files) is merged under every variant, e.g. a seed. JOBS variants
# run at once (default 1). They share the cores rather than add to them: three rollouts at
# once (12 envs each) stepped ~520 env steps/s together on an H100 box, about what one alone
# does (v9: 160 episodes in 95-127 s); the gain is in one variant's reward, actor, merge and
# start-up running beside another's rollout (data/rl_ablation_object). Every env process
# holds ~1 GB: give each variant fewer envs (rollout.envs_per_worker, eval.envs) where JOBS
# x envs outgrows the memory. The environment is rl_gpu.sh's (LIBERO and wheels
# installed, EGL exported).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: ablate_gpu.sh OUT_DIR [N] [NAME ...]}")
n=${2:-3}
shift $(($# >= 2 ? 2 : 1))
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(recipe beta0 wm_live wm_frozen kl_half lr_half ref_kl0 adv_step kstar6 minibatch512 noise_a05 groups10 anneal_none beta1_05)
for name in "${names[@]}"; do  # every name checked before any GPU time is spent
  [[ $name == recipe || -f configs/ablations/$name.yaml ]] \
    || { echo "no such ablation: configs/ablations/$name.yaml" >&2; exit 2; }
done
common=()
for f in ${EXTRA_CONFIG:-}; do
  [[ -f $f ]] || { echo "ablate_gpu.sh: EXTRA_CONFIG: no such file: $f" >&2; exit 2; }
  common+=("$(realpath "$f")")
done
mkdir -p "$out"
if (( ${JOBS:-1} > 1 )); then
  # The GPU slot locks (jobs_per_gpu, wamrl/runtime.py) are the machine's, shared by every run
  # dir: at the recipe's 3, five variants side by side queued for the GPU (a rollout holds its
  # slot for ~5 min), and two waited ~5 min to start. Each variant runs at most two GPU jobs at
  # once (reward beside world model); three rollouts held 19 GB of an H100's 80. Merged
  # first, so an EXTRA_CONFIG that sets jobs_per_gpu wins.
  printf 'jobs_per_gpu: %d\n' $((2 * JOBS)) >"$out/side_by_side.yaml"
  common=("$out/side_by_side.yaml" "${common[@]}")
fi
log() { echo "$(date +%T) $*" | tee -a "$out/progress.log"; }
last=$(printf 'iter_%03d/eval.json' "$n")
variant() {
  local name=$1 extra=("${common[@]}") targets=$last
  if [[ $name == recipe ]]; then
    [[ ${BASE_EVAL:-1} == 0 ]] || targets="iter_000/eval.json $last"
  else
    extra+=("$(realpath "configs/ablations/$name.yaml")")
  fi
  log "$name: iterations 1..$n, then eval"
  if EXTRA_CONFIG="${extra[*]}" TARGETS=$targets FOREGROUND=1 bash scripts/rl_gpu.sh "$out/$name"; then
    log "$name: eval $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["average"])' "$out/$name/$last")"
  else
    log "$name: failed (log: $out/$name/snakemake.log)"
  fi
}
for name in "${names[@]}"; do
  while [[ $(jobs -rp | wc -l) -ge ${JOBS:-1} ]]; do wait -n || true; done
  variant "$name" &
done
wait
