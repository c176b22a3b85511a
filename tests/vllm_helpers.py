"""Helpers of the tests that run against real vLLM (marked `vllm`): the marks, and one vLLM engine shared by
every such test of a process (vLLM's import and start take half a minute on 2 cores).

The tests skip only where vLLM cannot be imported, which is the project's main environment: `make test`
runs them again in .venv-vllm (`make vllm-env`), where vLLM is installed and a failure to import it
fails the run instead of skipping.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vLLM is not installed here; make test runs the vllm-marked tests in .venv-vllm (make vllm-env)"
VLLM_MARKS = [pytest.mark.vllm, pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)]

# The shared engine: tiny-llama (vLLM's CPU attention needs a head size of 32 or more, the test-* models
# have 16), eager (no torch.compile at start), a small KV cache, and one vLLM engine argument passed
# through, so that the pass-through is exercised by every test that uses the engine.
SHARED_SETTINGS = {"cuda_graphs": "off", "max_num_seqs": 64, "max_num_batched_tokens": 1024, "kv_cache_gb": 0.25,
                   "vllm_args": ("max_logprobs=5",)}
SHARED_MAX_LOGPROBS = 5


def vllm_model_dir() -> str:
    """tiny-llama (head size 64): vLLM's CPU attention refuses the test-* models' head size of 16."""
    from tokenmill.tools.tiny_models import cached_tiny_model

    return str(cached_tiny_model("tiny-llama"))


@functools.cache
def shared_vllm_engine(model_dir: str):
    from tokenmill.engine.backends import create_engine
    from tokenmill.engine.config import EngineConfig

    return create_engine(EngineConfig(model=model_dir, backend="vllm", **SHARED_SETTINGS))


def idle(engine) -> bool:
    """Nothing held for requests, by the adapter or by vLLM."""
    return all(v == 0 for v in engine.held_state().values())
