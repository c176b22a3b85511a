# The two commands a newcomer needs: `make demo` runs tokenmill, `make test` runs the whole suite.
# Each does its own set-up (virtual environment, packages, Kafka jars) and is safe to repeat.
PY := .venv/bin/python
export OMP_WAIT_POLICY := PASSIVE
# The environments keep the bytecode Python compiles: uv installs no .pyc files, and where the shell
# sets PYTHONDONTWRITEBYTECODE every process would compile every module it imports again (torch alone
# about 3 CPU-seconds, in each of the suite's hundreds of processes and in every worker's start).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-quick test-vllm lint lock kafka-jars registry vllm-env

setup:
	@./scripts/bootstrap.sh

kafka-jars: setup
	@./deploy/kafka/kafka.sh fetch

# The schema registry the tests start (Apicurio, about 160 MB from Maven Central, fetched once), and
# a Java new enough to run it: here, not inside a test fixture's timeout.
registry:
	@./deploy/registry/registry.sh fetch
	@./deploy/registry/registry.sh java >/dev/null

demo: setup kafka-jars
	@.venv/bin/tokenmill demo

# `make test` runs the suite in two phases at once (scripts/run-tests.sh): the vLLM backend's tests in
# .venv-vllm in the background (they mostly wait on vLLM's processes and on Kafka), and every other test
# in TEST_WORKERS pytest-xdist workers (one broker for all of them; tests sharing a module's fixture stay
# on one worker, the longest start first: tests/fixtures/scheduling.py). TEST_WORKERS: more than the 2
# cores, since many tests wait on the broker or on worker processes (with 3 the cores stood a third idle
# for a minute and a half mid-run; one fresh clone's run took 715 s, against 631 with 4). PYTEST_ARGS
# go to the main suite, VLLM_PYTEST_ARGS to the vLLM phase.
TEST_WORKERS ?= 4
export TEST_WORKERS VLLM_PYTEST_ARGS
test: setup kafka-jars registry vllm-env
	@./scripts/run-tests.sh $(PYTEST_ARGS)

# The inner loop: the tests that are neither slow nor need Kafka, in parallel (under 2 minutes on 2 cores).
QUICK_WORKERS ?= 2
test-quick: setup registry
	$(PY) -m pytest -q -n $(QUICK_WORKERS) --dist loadgroup \
		-m "not slow and not kafka" $(PYTEST_ARGS)

# The vllm backend's tests against real vLLM (marked vllm, in tests/test_vllm_*.py), in .venv-vllm: in
# .venv they skip, vLLM is not there. Here nothing skips: vLLM that does not import fails the step.
VLLM_PY := .venv-vllm/bin/python
test-vllm: vllm-env kafka-jars
	@$(VLLM_PY) -c "import vllm" || { echo "make test-vllm: vLLM does not import in .venv-vllm" >&2; exit 1; }
	$(VLLM_PY) -m pytest -q -m vllm $(VLLM_PYTEST_ARGS) tests/test_vllm_*.py

lint: setup
	.venv/bin/ruff check .

# Regenerate requirements.lock from pyproject.toml's ranges (the newest versions each allows).
lock: setup
	.venv/bin/uv pip compile pyproject.toml --extra dev --extra eval --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --no-header -o requirements.lock

# A second environment, .venv-vllm, holding tokenmill and vLLM's CPU build together (the vLLM backend's
# ground); pinned by scripts/vllm-requirements.lock, which `scripts/vllm-env.sh lock` regenerates.
vllm-env: setup
	@./scripts/vllm-env.sh
