#!/usr/bin/env bash
# Issue #18's ablation table: the recipe (configs/rl_gpu.yaml) and each of its one-change
# variants (configs/ablations/NAME.yaml) for N iterations from the shipped base, one after
# another on this box, each in OUT_DIR/NAME; then each policy N's eval (200 episodes).
#
#   setsid nohup bash scripts/ablate_gpu.sh OUT_DIR [N] [NAME ...] &    # default N 3, all
#   cat OUT_DIR/progress.log                                            # one line per step
#
# `recipe` is the unchanged recipe; its run also scores the base (iter_000/eval.json). The
# environment is rl_gpu.sh's (LIBERO and wheels installed, EGL exported).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: ablate_gpu.sh OUT_DIR [N] [NAME ...]}")
n=${2:-3}
shift $(($# >= 2 ? 2 : 1))
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(recipe beta0 wm_live wm_frozen lr_half ref_kl0 adv_step kstar6 minibatch512 noise_a05 groups10 anneal_none beta1_05)
for name in "${names[@]}"; do  # every name checked before any GPU time is spent
  [[ $name == recipe || -f configs/ablations/$name.yaml ]] \
    || { echo "no such ablation: configs/ablations/$name.yaml" >&2; exit 2; }
done
mkdir -p "$out"
log() { echo "$(date +%T) $*" | tee -a "$out/progress.log"; }
last=$(printf 'iter_%03d/eval.json' "$n")
for name in "${names[@]}"; do
  extra="" targets=$last
  if [[ $name == recipe ]]; then targets="iter_000/eval.json $last"; else extra=configs/ablations/$name.yaml; fi
  log "$name: iterations 1..$n, then eval"
  if EXTRA_CONFIG=$extra TARGETS=$targets FOREGROUND=1 bash scripts/rl_gpu.sh "$out/$name"; then
    log "$name: eval $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["average"])' "$out/$name/$last")"
  else
    log "$name: failed (log: $out/$name/snakemake.log)"
  fi
done
