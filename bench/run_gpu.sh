#!/usr/bin/env bash
# Every GPU benchmark of issue #7 in one run, on a machine like the H200 box (16 cores).
#
#   bash bench/run_gpu.sh [BUNDLE_DIR] [WHEEL_DIR]
#
# BUNDLE_DIR: the parts of `python scripts/libero_bundle.py build` (unpacked once to
# /root/lb); WHEEL_DIR: wheels for what the box lacks (zarr, numcodecs, jsonschema, ...),
# installed into /root/site without an index. Where LIBERO and the wheels are installed
# already, run it with no arguments. Figures go to stdout; COLUMNS keeps rich tables whole.
set -euo pipefail
cd "$(dirname "$0")/.."
export COLUMNS=${COLUMNS:-200} PYTHONUNBUFFERED=1 MUJOCO_GL=egl
if [[ $# -ge 1 ]]; then
  [[ -d /root/lb/site ]] || python3 scripts/libero_bundle.py unpack "$1" /root/lb
  # shellcheck disable=SC1091
  source /root/lb/env.sh
fi
if [[ $# -ge 2 ]]; then
  python3 -m pip install -q --no-index --no-deps --target /root/site "$2"/*.whl
  export PYTHONPATH=/root/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
cores=$(nproc)
# ONLY="policy rollout eval learner iteration" (a subset) splits the run over several shorter calls.
ONLY=${ONLY:-policy rollout eval learner iteration}
want() { [[ " $ONLY " == *" $1 "* ]]; }
run() { echo; echo "== $* ($(date +%T))"; "$@"; }

# Query latency, eager vs CUDA graph (prefill + K = 8), fp32 and bf16.
# --compile: a column with torch.compile'd layers (sampler.compile), compile time printed.
want policy && run python3 bench/bench_policy.py --device cuda --batch 1 8 16 32 --compile
want policy && run python3 bench/bench_policy.py --device cuda --batch 1 4 8 16 32 --config configs/fullsize.yaml --repeats 10 --compile
# Rollout vs the env-only limit: one env per core, and 1.5 per core (an env waiting for its
# query frees its core for another); the limit is the best env-only rate of the two.
over=$((cores * 3 / 2))
want rollout && run python3 bench/bench_rollout.py --device cuda --envs "$cores" "$over" \
  --episodes $((3 * cores)) --macro-steps 10 --skip-eager
want rollout && run python3 bench/bench_rollout.py --device cuda --envs "$cores" "$over" --episodes $((3 * cores)) \
  --macro-steps 10 --config configs/fullsize.yaml --skip-eager --amp bf16 --compile
# Eval of all 40 tasks: batched over one env per core, vs the stage on one env and vs the
# loop of Fast-WAM's own eval script. CONTEXT_CACHE: task contexts encoded elsewhere, where
# the box lacks the text encoder.
want eval && run python3 bench/bench_eval.py --device cuda --envs "$cores" --policy data/base_policy \
  --max-macro-steps 10 --fastwam-style ${CONTEXT_CACHE:+--context-cache "$CONTEXT_CACHE"}
# Learner: PPO macro-steps/s, fp32 and bf16, tiny and full-size (with MFU).
want learner && run python3 bench/bench_learner.py --device cuda --steps 2048 --minibatch 256
# Full size: one minibatch. With random 5 B weights, one Adam step moves log pi so far that
# the next minibatch's ratio overflows (PPO's NonFiniteError guard stops it; seen on the H200).
want learner && run python3 bench/bench_learner.py --device cuda --config configs/fullsize.yaml --steps 64 --minibatch 64 --epochs 1
# The same minibatch in parts of 16 (actor.micro_batch): peak memory against speed.
want learner && run python3 bench/bench_learner.py --device cuda --config configs/fullsize.yaml --steps 64 --minibatch 64 --micro-batch 16 --epochs 1
# One whole iteration of the RL recipe (every stage a process, as the Snakefile runs them)
# against the env-only physics of the same episodes; figures also in bench_iteration.json.
want iteration && run python3 bench/bench_iteration.py --config configs/rl_gpu.yaml --json bench_iteration.json
true  # a final skipped step is no failure
