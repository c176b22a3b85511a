#!/usr/bin/env bash
# `make test`'s two phases, after set-up, at the same time:
#   1. the vLLM backend's tests (in .venv-vllm), in the background: they wait most of their time on
#      vLLM processes starting and on Kafka (about 40% of a 2-core machine alone), so the main suite
#      fills the rest of the CPU instead of the two running in turn;
#   2. every other test, in TEST_WORKERS pytest-xdist workers (one broker for all).
# The vLLM phase's output is kept in a log and printed when it ends. The run fails when either phase
# fails; an interrupted run stops the background phase too.
#
#   scripts/run-tests.sh PYTEST_ARGS...     (the arguments go to phase 2)
# Environment: TEST_WORKERS (default 4), VLLM_PYTEST_ARGS (arguments of phase 1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VLLM_PY=.venv-vllm/bin/python
WORKERS=${TEST_WORKERS:-4}
VLLM_LOG=$(mktemp -t tokenmill-test-vllm.XXXXXX)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
unset PYTHONDONTWRITEBYTECODE  # keep compiled bytecode (the Makefile says why)

vllm_pid=
stop_vllm() {
    if [ -n "$vllm_pid" ] && kill -0 "$vllm_pid" 2>/dev/null; then
        kill -TERM -- "-$vllm_pid" 2>/dev/null || kill -TERM "$vllm_pid" 2>/dev/null
        wait "$vllm_pid" 2>/dev/null
    fi
}
trap 'stop_vllm; rm -f "$VLLM_LOG"; exit 130' INT TERM
trap 'rm -f "$VLLM_LOG"' EXIT

started=$SECONDS
"$VLLM_PY" -c "import vllm" &
vllm_check=$!
# On a fresh clone the environments hold no bytecode yet (uv installs none), and the parallel phase's
# workers, starting together, would each compile every module they import (4 cold collections: 63
# CPU-s, against 27 warm). So one collection writes it first, beside the vLLM import check, which does
# the same for .venv-vllm.
if ! compgen -G ".venv/lib/python3*/site-packages/torch/__pycache__/__init__.cpython-*.pyc" >/dev/null; then
    "$PY" -m pytest -q --collect-only -p no:cacheprovider >/dev/null 2>&1
fi
wait "$vllm_check" || { echo "make test: vLLM does not import in .venv-vllm" >&2; exit 1; }
# A process group of its own (set -m), so an interrupted run can stop it with everything it started.
set -m
# shellcheck disable=SC2086
"$VLLM_PY" -m pytest -q -m vllm --durations=5 ${VLLM_PYTEST_ARGS:-} tests/test_vllm_*.py >"$VLLM_LOG" 2>&1 &
vllm_pid=$!
set +m
echo "[test] vLLM backend tests started in the background (pid $vllm_pid)"

"$PY" -m pytest -q -n "$WORKERS" --dist loadgroup --durations=10 "$@"
main_rc=$?
echo "[test] parallel phase: exit $main_rc after $((SECONDS - started)) s"

wait "$vllm_pid"
vllm_rc=$?
vllm_pid=
echo "[test] vLLM backend tests (exit $vllm_rc, done $((SECONDS - started)) s after the start):"
cat "$VLLM_LOG"
echo "[test] the whole suite took $((SECONDS - started)) s"

for rc in $main_rc $vllm_rc; do
    [ "$rc" -eq 0 ] || exit "$rc"
done
