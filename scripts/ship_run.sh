#!/usr/bin/env bash
# A run's small artifacts into a folder to ship under data/ (data/rl_object_v9 was made so):
# the resolved config, EXTRA_CONFIG if given, and per iteration actor/metrics.json,
# world_model/metrics.json, reward.done and eval.json; then `wamrl report` on that copy.
# Stores, checkpoints and logs stay behind (a copy of 4 iterations: ~0.5 MB with its report).
#
#   bash scripts/ship_run.sh RUN_DIR DEST [EXTRA_CONFIG]
#
# NO_REPORT=1 skips the report (a GPU box without matplotlib: report here afterwards).
set -euo pipefail
usage="usage: ship_run.sh RUN_DIR DEST [EXTRA_CONFIG]"
run=${1:?$usage} dest=$(realpath -m "${2:?$usage}") extra=${3:-}
# Everything checked before anything is written.
[[ -f $run/.wamrl/config.yaml ]] || { echo "ship_run: $run is not a run (no .wamrl/config.yaml)" >&2; exit 2; }
[[ -z $extra || -f $extra ]] || { echo "ship_run: no such extra config: $extra" >&2; exit 2; }
if [[ -e $dest && -n $(ls -A "$dest") ]]; then
  echo "ship_run: $dest is not empty; ship into a new folder" >&2; exit 2
fi
mkdir -p "$dest"
cp "$run/.wamrl/config.yaml" "$dest/config.yaml"
[[ -z $extra ]] || cp "$extra" "$dest/extra.yaml"
for it in "$run"/iter_[0-9][0-9][0-9]; do
  for f in actor/metrics.json world_model/metrics.json reward.done eval.json; do
    if [[ -f $it/$f ]]; then
      mkdir -p "$dest/$(basename "$it")/$(dirname "$f")"
      cp "$it/$f" "$dest/$(basename "$it")/$f"
    fi
  done
done
echo "ship_run: $(find "$dest" -type f | wc -l) files in $dest"
if [[ ${NO_REPORT:-0} != 1 ]]; then
  cd "$(dirname "$0")/.."
  "${PYTHON:-python3}" -m stages.cli report "$dest" --out "$dest/report"
fi
