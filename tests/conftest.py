"""Test-session set-up shared by every test module.

- 2 shared CPU cores: PyTorch's OpenMP threads spin-wait and stall when another process is busy,
  so pin one intra-op thread and make OpenMP wait passively.
- Triton's interpreter must be switched on before any @triton.jit function is defined, so it is
  set here, before test modules import kernels (the CPU has no other way to run them).
"""

import gc
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
if os.environ.get("TOKENMILL_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _thaw_the_heap():
    """A command or bench run inside a test freezes the heap as its own process would
    (worker/engine/heap.py); this process goes on to other tests, so the frozen objects go back to
    the garbage collector after each test."""
    yield
    gc.unfreeze()

# Fixture modules, one per concern (kept apart so they can grow independently). `shared` first: the
# others import it, and pytest rewrites a plugin's asserts only when it imports the module itself.
pytest_plugins = [
    "tests.fixtures.shared",
    "tests.fixtures.scheduling",
    "tests.fixtures.models",
    "tests.fixtures.kafka",
    "tests.fixtures.s3",
    "tests.fixtures.secure_kafka",
    "tests.fixtures.registry",
]
