#!/usr/bin/env bash
# Run here (with network to PyPI): download the wheels the GPU machine lacks into .whl/
# (git-ignored; carried to the device with carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 zstandard==0.25.0 \
  filelock==4.3.1 torchao==0.18.0 bitsandbytes==0.50.2 hjson==3.1.0
# deepspeed (benchmarks/offload_8b.py's baseline) is a source distribution only: its wheel is built here without
# its compiled ops (DS_BUILD_OPS=0), which DeepSpeed then JIT-compiles on the device (its CPU Adam needs g++ there)
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls .whl
