"""A job redelivered to a worker on another kind of CPU gets the same Result. The engine is run here
twice in child processes on the same jobs (the invariance bench's mix: greedy and seeded sampling
with top-k, top-p, min-p and penalties, logprobs, structured output, scoring, `n`): once as it
runs on this CPU, once as it would on a CPU with AVX2 and no AVX-512 (torch's kernels at their AVX2
level, oneDNN held to AVX2, so no bfloat16 screen for greedy rows, and the C kernels built for
x86-64-v3). Every field a Result carries from the model must be the same bits.

Runs where this CPU has AVX-512 (elsewhere both runs would be the same build)."""

import json
import os
import subprocess
import sys

import pytest

from tokenmill.kernels.cpu import build
from tokenmill.tools.bench_invariance import cpu_features

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_features()["avx512f"] or build.find_compiler() is None,
                       reason="needs a CPU with AVX-512 and a C compiler: the AVX2 run is the other build"),
]

CHILD = r"""
import json, sys
from tokenmill.kernels.cpu import build
model_dir, level, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
if level == "avx2":  # before any kernel is built: the cache keys them by their flags
    build.FLAGS = ["-march=x86-64-v3" if f == "-march=native" else f for f in build.FLAGS]
from dataclasses import asdict
from tokenmill.engine import EngineConfig
from tokenmill.engine.model_config import load_model_config
from tokenmill.tools.bench_invariance import _requests, fingerprint, invariance_jobs
from tokenmill.tools.bench_startup import new_engine

mc = load_model_config(model_dir)
jobs = invariance_jobs(mc.vocab_size, count, 7, set(mc.eos_token_ids))
# amx_gemm off: an AMX CPU's layers would run on the AMX GEMM, whose fixed order is its own (not
# covered: docs/engine.md, Across CPUs); off, it takes the fixed-order GEMM as any other CPU.
engine = new_engine(EngineConfig(model=model_dir, cpu_threads=1, kv_cache_gb=0.25, amx_gemm="off"))
results = engine.generate(_requests(jobs))
print(json.dumps({"paths": asdict(engine.cpu_paths), "kinds": [j.kind for j in jobs],
                  "results": {rid: fingerprint(d) for rid, d in results.items()}}))
"""


def _run(model_dir, level: str, count: int) -> dict:
    env = dict(os.environ)
    if level == "avx2":
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), level, str(count)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_results_are_the_same_bits_on_an_avx2_cpu_and_on_this_one(model, request):
    model_dir = request.getfixturevalue(model)
    native, avx2 = _run(model_dir, "native", 120), _run(model_dir, "avx2", 120)
    assert native["paths"]["batch_invariant"] and avx2["paths"]["batch_invariant"]
    # The AVX2 run has no bfloat16 GEMM: its greedy rows take the full float32 head and its argmax.
    assert not avx2["paths"]["greedy_screen"]
    assert set(native["kinds"]) == {"greedy", "sampled", "structured", "scoring", "n"}
    assert native["results"].keys() == avx2["results"].keys()
    differing = {rid: next(k for k in a if a[k] != avx2["results"][rid][k])
                 for rid, a in native["results"].items() if a != avx2["results"][rid]}
    assert not differing, f"{len(differing)} of {len(native['results'])} jobs differ, e.g. {list(differing.items())[:5]}"
    assert any(r["logprobs"] for r in native["results"].values())
