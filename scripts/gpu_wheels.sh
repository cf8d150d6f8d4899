#!/usr/bin/env bash
# Wheels a GPU box without a package index needs for the pipeline (Python 3.12, x86-64),
# beyond what its image has (torch, numpy, pyyaml, typer, rich, safetensors, psutil, jinja2,
# requests, ...): Snakemake and its dependencies, zarr and its codecs, jsonschema.
#
#   bash scripts/gpu_wheels.sh OUT_DIR      # here, with pip and an index; ~20 MB
#
# Then on the box: python3 -m pip install --no-index --no-deps --target /root/site OUT_DIR/*.whl
# (scripts/rl_gpu.sh does it when given OUT_DIR). pulp is left out: Snakemake falls back
# to its greedy scheduler, and the wheel is 16 MB.
set -euo pipefail
out=${1:?usage: gpu_wheels.sh OUT_DIR}
mkdir -p "$out"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$out" \
  snakemake==9.27.1 snakemake-interface-common==1.23.0 \
  snakemake-interface-executor-plugins==9.4.0 snakemake-interface-logger-plugins==2.1.0 \
  snakemake-interface-report-plugins==1.3.0 snakemake-interface-scheduler-plugins==2.0.2 \
  snakemake-interface-storage-plugins==4.4.1 annotated-types==0.8.0 argparse-dataclass==2.0.0 \
  conda-inject==1.3.2 configargparse==1.9.0 docutils==0.22.4 dpath==2.2.0 \
  fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1 greenlet==3.5.6 humanfriendly==10.0 \
  immutables==0.21 jupyter-core==5.9.1 nbformat==5.11.1 platformdirs==4.14.9 \
  pydantic==2.14.4 pydantic-core==2.50.5 smart-open==7.7.1 smmap==5.0.3 sqlalchemy==2.0.58 \
  sqlmodel==0.0.37 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1 \
  typing-inspection==0.4.5 yte==1.9.4 \
  zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 crc32c donfig==0.8.1.post1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
pip wheel -q --no-deps -w "$out" connection_pool==0.0.3  # published as a source archive only
echo "$(ls "$out" | wc -l) wheels in $out"
