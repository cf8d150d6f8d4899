#!/usr/bin/env bash
# The learning-curve recipe (configs/rl_gpu.yaml) on a GPU box, started in the background.
#
#   bash scripts/rl_gpu.sh RUN_DIR [BUNDLE_DIR] [WHEEL_DIR]
#   python3 -m stages.cli status RUN_DIR          # progress: one row per iteration
#
# BUNDLE_DIR: the parts of `python scripts/libero_bundle.py build` (unpacked once to
# /root/lb); WHEEL_DIR: `scripts/gpu_wheels.sh`'s wheels (snakemake, zarr, ...), installed
# into /root/site without an index. Where both are installed already, give RUN_DIR alone.
# The task contexts come from data/contexts (the box needs no text encoder). On the H200
# with NVIDIA EGL, export __EGL_VENDOR_LIBRARY_FILENAMES (the device README says how).
# The code runs from a copy (RUN_DIR/.src), so editing the checkout cannot change a
# running job; `bash RUN_DIR/.src/scripts/rl_gpu.sh RUN_DIR` restarts on that copy. TARGETS
# (default: iteration 0's and the last iteration's eval) and EXTRA_CONFIG (YAML files,
# space-separated, merged over configs/rl_gpu.yaml in order) may be set; FOREGROUND=1 waits
# for Snakemake and returns its exit status (scripts/ablate_gpu.sh runs variants so).
set -euo pipefail
cd "$(dirname "$0")/.."
run=$(realpath -m "$1")
extras=()
for f in ${EXTRA_CONFIG:-}; do  # checked before anything is unpacked or started
  [[ -f $f ]] || { echo "rl_gpu.sh: EXTRA_CONFIG: no such file: $f" >&2; exit 2; }
  extras+=("$(realpath "$f")")
done
export PYTHONUNBUFFERED=1 MUJOCO_GL=egl COLUMNS=200
if [[ $# -ge 2 ]]; then
  [[ -d /root/lb/site ]] || python3 scripts/libero_bundle.py unpack "$2" /root/lb
  # shellcheck disable=SC1091
  source /root/lb/env.sh
fi
if [[ $# -ge 3 ]]; then
  [[ -d /root/site/snakemake ]] || python3 -m pip install -q --no-index --no-deps --target /root/site "$3"/*.whl
  export PYTHONPATH=/root/site:${PYTHONPATH:-}
fi
mkdir -p "$run"
# Started from RUN_DIR/.src itself (a restart on the code it ran), there is nothing to copy,
# and the tar fallback's rm would delete the very tree it copies from.
if [[ $(pwd -P) != "$(realpath -m "$run/.src")" ]]; then
  rsync -a --delete --exclude .git --exclude runs --exclude '.bundle' --exclude '.whl' --exclude '.gl' \
    --exclude .venv ./ "$run/.src/" 2>/dev/null || { rm -rf "$run/.src"; mkdir -p "$run/.src"; \
    tar --exclude=./.git --exclude=./runs --exclude=./.bundle --exclude=./.whl --exclude=./.gl \
    --exclude=./.venv -cf - . | tar -xf - -C "$run/.src"; }
fi
export PYTHONPATH=$run/.src:${PYTHONPATH:-}
# The Snakefile calls `wamrl`; where the package is not installed, a shim on PATH runs it.
if ! command -v wamrl >/dev/null; then
  mkdir -p "$run/.bin"
  printf '#!/bin/sh\nexec python3 -m stages.cli "$@"\n' >"$run/.bin/wamrl"
  chmod +x "$run/.bin/wamrl"
  export PATH=$run/.bin:$PATH
fi
iters=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['pipeline']['iterations'])" configs/rl_gpu.yaml)
targets=${TARGETS:-iter_000/eval.json $(printf 'iter_%03d/eval.json' "$iters")}
cd "$run"
# No --resources gpu: on one GPU, the tiny model's world-model job runs beside reward and
# actor (serialising them costs ~30 s per iteration). --rerun-incomplete: a restart resumes.
cmd=(python3 -m snakemake --snakefile .src/Snakefile --cores "$(nproc)" --rerun-incomplete
  --configfile .src/configs/rl_gpu.yaml "${extras[@]}" -- $targets)
if [[ ${FOREGROUND:-0} == 1 ]]; then
  exec "${cmd[@]}" >"$run/snakemake.log" 2>&1
fi
setsid nohup "${cmd[@]}" >"$run/snakemake.log" 2>&1 &
echo "started: $targets in $run (log: $run/snakemake.log)"
