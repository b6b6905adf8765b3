#!/usr/bin/env bash
# Downloads the wheels a CUDA machine without network needs beside its own Python 3.12 (jax, torch,
# triton and transformers are there) into the git-ignored .whl/ folder: outlines-core (JSON-schema
# constraints) and jsonschema with its dependencies (the structured-output tests' oracle), at the
# versions of requirements.lock, for CPython 3.12 on manylinux x86_64.
#
#   scripts/gpu_wheels.sh            # then carry .whl to the machine and, there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# benchmarks/gpu_check.py's docstring has the whole command line of a GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
pin() {  # the version requirements.lock pins
  local v
  v=$(grep -i -E "^$1==" requirements.lock | head -1 | cut -d= -f3)
  [ -n "$v" ] || { echo "error: $1 is not pinned in requirements.lock" >&2; exit 1; }
  echo "$1==$v"
}
packages=(outlines_core jsonschema jsonschema-specifications referencing rpds-py attrs)

rm -rf .whl
mkdir -p .whl
for p in "${packages[@]}"; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$(pin "$p")"
done
ls -l .whl
du -sh .whl
