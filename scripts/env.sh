#!/usr/bin/env bash
# Creates (or reuses) .venv with Python 3.12 and jaxspec installed from this checkout.
# Usage: scripts/env.sh            (then run .venv/bin/jaxspec ... or .venv/bin/python -m pytest)
# JAXSPEC_CUDA=1 installs the CUDA 13 build of jaxlib (the one the GPU measurements were taken with)
# instead of the CPU one; JAXSPEC_CUDA=12 the CUDA 12 build (drivers older than CUDA 13's).
# JAXSPEC_AOT=1 makes a second environment, .venv-aot, with jaxlib's CUDA plugin beside the CPU build:
# programs compiled for an H100 / H200 on a machine without a GPU (benchmarks/gpu_launches.py). It is
# kept apart because, without CUDA, the plugin's failed start is printed at every `import jax`.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  candidates+=(python3.12)
  for root in "${PYENV_ROOT:-}" "$HOME/.pyenv"; do
    [ -n "$root" ] && candidates+=("$root"/versions/3.12*/bin/python3.12)
  done
  candidates+=(/usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python/3.12*/bin/python3.12)
  for c in "${candidates[@]}"; do
    # `command -v` is not enough: a pyenv shim exists even when no 3.12 is selected.
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  return 1
}

venv=.venv
[ "${JAXSPEC_AOT:-0}" = 1 ] && venv=.venv-aot
stamp=$venv/.jaxspec-installed
if [ ! -x $venv/bin/python ] || ! $venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  if ! py=$(find_python); then
    echo "error: jaxspec needs Python 3.12 and none was found." >&2
    echo "  looked for python3.12 on PATH, in pyenv (\$PYENV_ROOT or ~/.pyenv: versions/3.12*), /usr/bin, /usr/local/bin." >&2
    echo "  install it (e.g. 'pyenv install 3.12' or your distribution's python3.12 package)," >&2
    echo "  or point PYTHON=/path/to/python3.12 at one." >&2
    exit 1
  fi
  echo "creating $venv with $py" >&2
  rm -rf $venv
  "$py" -m venv $venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.lock -nt "$stamp" ]; then
  $venv/bin/python -m pip install -q --upgrade pip >&2
  extras="test,serve"
  case "${JAXSPEC_CUDA:-0}" in
    0) ;;
    1|13) extras="test,serve,cuda13" ;;
    12) extras="test,serve,cuda12" ;;
    *) echo "error: JAXSPEC_CUDA must be 1 (CUDA 13), 13 or 12, got '${JAXSPEC_CUDA}'" >&2; exit 1 ;;
  esac
  [ "$venv" = .venv-aot ] && extras="aot"  # only what compiling the engine's programs needs
  $venv/bin/python -m pip install -q -c requirements.lock -e ".[$extras]" >&2
  touch "$stamp"
fi
