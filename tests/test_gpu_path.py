"""The GPU path run on the CPU: decode graphs wired into the runner (eager padded mode under the
Triton interpreter), pinned staging buffers, no host reads inside a step but the sampled ids, and
async scheduling (launch step N+1 before step N's tokens are on the host).

On the CPU nothing overlaps and nothing is captured, but every line of those paths runs, so their
results can be compared with the synchronous engine and with transformers.
"""

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.cli.engine_options import add_engine_options, engine_kwargs
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.cuda_graphs import capture_sizes
from tokenmill.engine.model_runner import ModelRunner, PinnedStaging
from tokenmill.engine.types import EngineRequest, FinishReason, SamplingParams
from tokenmill.tools.tiny_models import cached_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama_dir():
    # Untied 32000-token vocabulary: greedy output depends on attention (a tied random model
    # mostly repeats its last token, which would hide wrong inputs).
    return cached_tiny_model("tiny-llama")


def make_prompts(n=10, seed=0, vocab=32000):
    rng = random.Random(seed)
    lengths = [1, 3, 4, 5, 9, 17] + [rng.randint(2, 24) for _ in range(n - 6)]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths[:n]]


@pytest.fixture(scope="module")
def hf_greedy(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    cache = {}

    def generate(prompt, max_new):
        key = (tuple(prompt), max_new)
        if key not in cache:
            with torch.inference_mode():
                seq = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            cache[key] = seq[0, len(prompt):].tolist()
        return cache[key]

    return generate


def greedy_requests(prompts, max_new, prefix="r"):
    return [
        EngineRequest(request_id=f"{prefix}{i}", prompt_token_ids=p,
                      sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))
    ]


def kv_gb(model_dir, num_blocks, block_size):
    from tokenmill.engine.model_config import load_model_config

    mc = load_model_config(model_dir, "float32")
    return num_blocks * ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, block_size) / 1024**3


def engine_for(model_dir, **overrides):
    cfg = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4, max_num_seqs=4,
               kv_cache_gb=kv_gb(model_dir, 64, 4))
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def run_collecting(engine, requests):
    """Run to completion; per request: every delta in order."""
    for r in requests:
        engine.add(r)
    deltas = {}
    while engine.has_work():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def assert_deltas_consistent(per_request):
    """Deltas add up to the final output: no token (e.g. a discarded one) appears twice or extra."""
    for rid, ds in per_request.items():
        final = ds[-1]
        assert final.finished and all(not d.finished for d in ds[:-1]), rid
        assert sum((d.new_token_ids for d in ds), []) == final.output_token_ids, rid
        assert "".join(d.text_delta for d in ds) == final.output_text, rid
        assert final.usage.completion_tokens == len(final.output_token_ids), rid


# ---------------------------------------------------------------------------------------- flags


def test_config_validates_the_gpu_path_modes(llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig(model="m", cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="async_scheduling must be one of"):
        EngineConfig(model="m", async_scheduling="yes")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        engine_for(llama_dir, attention_backend="triton", cuda_graphs="on")
    with pytest.raises(ValueError, match="needs the triton attention backend"):
        engine_for(llama_dir, attention_backend="torch", cuda_graphs="eager")
    auto = engine_for(llama_dir)  # the CPU: no graphs, synchronous steps
    assert auto.graph_mode == "off" and auto.async_scheduling is False
    assert auto.runner.graph_runner is None


def test_cli_flags_reach_the_engine_config(monkeypatch):
    from tokenmill.cli import _apply_env_defaults

    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults["cuda_graphs"] == "auto" and defaults["async_scheduling"] == "auto"
    kwargs = engine_kwargs(parser.parse_args(["--cuda-graphs", "eager", "--async-scheduling", "on"]))
    assert kwargs["cuda_graphs"] == "eager" and kwargs["async_scheduling"] == "on"
    # The Kafka worker's settings embed the EngineConfig built from them.
    settings = EngineConfig(model="m", **kwargs)
    assert settings.cuda_graphs == "eager" and settings.async_scheduling == "on"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graphs", "maybe"])
    monkeypatch.setenv("TOKENMILL_CUDA_GRAPHS", "off")
    parser = argparse.ArgumentParser()
    add_engine_options(parser, model_required=False)
    _apply_env_defaults(parser)
    assert engine_kwargs(parser.parse_args([]))["cuda_graphs"] == "off"


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(256)[-1] == 256 and capture_sizes(300)[-2:] == [256, 300]


# ------------------------------------------------------------------------------ graphs (eager)


@pytest.mark.slow
def test_engine_decodes_through_the_graph_runner_and_matches_transformers(llama_dir, hf_greedy):
    prompts = make_prompts(6)
    max_new = [5, 3, 6, 4, 5, 2]
    # 4 sequences at most: decode batches of 1..4 rows, padded to the captured sizes 1, 2, 4; a
    # token budget of 8 makes the longer prompts prefill in chunks next to decodes (normal path).
    engine = engine_for(llama_dir, attention_backend="triton", cuda_graphs="eager", max_num_batched_tokens=8)
    assert engine.graph_mode == "eager" and engine.runner.graph_runner.batch_sizes == [1, 2, 4]
    results = engine.generate(greedy_requests(prompts, max_new))
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert results[f"r{i}"].output_token_ids == hf_greedy(p, n), i
    assert 0 < engine.runner.num_graph_steps < engine.stats().steps


# ----------------------------------------------------------------------------- pinned staging


def test_pinned_staging_alternates_two_sets_and_keeps_each_steps_inputs():
    staging = PinnedStaging({"ids": (6, torch.int64), "lens": (3, torch.int32)}, torch.device("cpu"), pin=False)
    staging.begin_step()
    a = staging.upload("ids", np.array([1, 2, 3], dtype=np.int64))
    lens = staging.upload("lens", np.array([[7, 8]], dtype=np.int64))  # cast to the buffer's dtype
    staging.end_step()
    staging.begin_step()
    b = staging.upload("ids", np.array([9, 9, 9, 9], dtype=np.int64))
    staging.end_step()
    # The second step wrote the other set: the first step's inputs are intact.
    assert a.tolist() == [1, 2, 3] and b.tolist() == [9, 9, 9, 9]
    assert lens.dtype == torch.int32 and lens.tolist() == [[7, 8]]
    staging.begin_step()
    assert staging.upload("ids", np.array([5], dtype=np.int64)).data_ptr() == a.data_ptr()
    big = staging.upload("ids", np.arange(10, dtype=np.int64))  # larger than the buffer
    assert big.tolist() == list(range(10)) and staging.num_unstaged == 1


# ------------------------------------------------------------------------------- sync points


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu")
OWN_CODE = (str(REPO / "worker"), str(REPO / "kernels"))


def count_host_reads(monkeypatch):
    """Record every tensor-to-host read made directly by the engine's or the kernels' code."""
    calls = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OWN_CODE):
                calls.append((_name, Path(caller).name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls


def use_accelerator_rotary_table(engine):
    """Build the rotary tables for every position up front, as on an accelerator: on the CPU they
    grow on demand, which reads the largest position of each step (a read a GPU never does)."""
    from tokenmill.engine.layers import RotaryEmbedding

    ropes = [m for m in engine.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes
    for rope in ropes:
        rope._grow(engine.max_model_len)
        rope._grow_on_demand = False


MIXED_SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=3), dict(temperature=1.0, min_p=0.05)]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("sampling", ["greedy", "mixed"])
def test_a_decode_step_reads_only_the_sampled_ids_from_the_device(llama_dir, monkeypatch, async_scheduling, sampling):
    """Greedy rows, and greedy next to temperature / top-k / min-p rows (top-p and penalties may
    wait for the GPU: see docs/engine.md)."""
    engine = engine_for(llama_dir, attention_backend="triton", cuda_graphs="eager", async_scheduling=async_scheduling)
    use_accelerator_rotary_table(engine)
    requests = greedy_requests(make_prompts(3), [8, 8, 8])
    if sampling == "mixed":
        for r, params in zip(requests, MIXED_SAMPLING, strict=True):
            r.sampling = SamplingParams(max_tokens=8, ignore_eos=True, **params)
    for r in requests:
        engine.add(r)
    engine.step()  # prefill
    engine.step()  # first decode (with async: takes in the prefill's tokens)
    graph_steps = engine.runner.num_graph_steps
    calls = count_host_reads(monkeypatch)
    deltas = engine.step()
    monkeypatch.undo()
    assert len(deltas) == 3 and engine.runner.num_graph_steps == graph_steps + 1
    assert calls == [("tolist", "overlap.py")]


# ------------------------------------------------------------------------------ async scheduling


def test_async_greedy_equals_sync_and_transformers(llama_dir, hf_greedy):
    prompts = make_prompts(8, seed=1)
    max_new = [6, 1, 4, 7, 2, 5, 3, 6]
    outs = {}
    for mode in ("off", "on"):
        engine = engine_for(llama_dir, async_scheduling=mode)
        per_request = run_collecting(engine, greedy_requests(prompts, max_new))
        assert_deltas_consistent(per_request)
        outs[mode] = {rid: ds[-1] for rid, ds in per_request.items()}
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.stats().generated_tokens_total == sum(max_new)  # discarded tokens not counted
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert outs["on"][f"r{i}"].output_token_ids == outs["off"][f"r{i}"].output_token_ids == hf_greedy(p, n)
        assert outs["on"][f"r{i}"].usage == outs["off"][f"r{i}"].usage


def test_async_greedy_under_preemption_and_chunked_prefill(llama_dir, hf_greedy):
    prompts = make_prompts(8, seed=2)
    max_new = [9, 8, 7, 9, 6, 8, 9, 5]
    # 12 blocks of 4 slots for 4 running sequences of up to 33 tokens: preemption is certain.
    preempting = engine_for(llama_dir, async_scheduling="on", kv_cache_gb=kv_gb(llama_dir, 12, 4))
    per_request = run_collecting(preempting, greedy_requests(prompts, max_new))
    assert preempting.metrics.num_preemptions > 0
    assert_deltas_consistent(per_request)
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert per_request[f"r{i}"][-1].output_token_ids == hf_greedy(p, n), i
    assert preempting.block_manager.num_free_blocks == preempting.block_manager.num_blocks

    chunked = engine_for(llama_dir, async_scheduling="on", max_num_batched_tokens=5, enable_prefix_caching=False)
    per_request = run_collecting(chunked, greedy_requests(prompts, max_new))
    assert_deltas_consistent(per_request)
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert per_request[f"r{i}"][-1].output_token_ids == hf_greedy(p, n), i


def test_async_request_preempted_with_its_last_token_in_flight_finishes_from_the_queue(llama_dir, hf_greedy, monkeypatch):
    """A request preempted while its last token is in flight, whose token then finishes it, leaves
    from the waiting queue (found by search: 10 blocks, these prompts and lengths)."""
    from tokenmill.engine.request import RequestStatus
    from tokenmill.engine.scheduler import Scheduler

    removed_while_waiting = []
    original = Scheduler.finish_many

    def finish_many(self, ended):
        removed_while_waiting.extend(request.status is RequestStatus.WAITING for request, _ in ended)
        return original(self, ended)

    monkeypatch.setattr(Scheduler, "finish_many", finish_many)
    prompts = make_prompts(8, seed=2)
    max_new = [5, 3, 8, 6, 4, 9, 7, 5]
    engine = engine_for(llama_dir, async_scheduling="on", kv_cache_gb=kv_gb(llama_dir, 10, 4))
    per_request = run_collecting(engine, greedy_requests(prompts, max_new))
    assert any(removed_while_waiting) and engine.metrics.num_preemptions > 0
    assert_deltas_consistent(per_request)
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert per_request[f"r{i}"][-1].output_token_ids == hf_greedy(p, n), i
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.waiting and not engine.scheduler.running


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_the_runner_frees_its_rows_from_the_finished_and_preempted_requests_of_each_step(llama_dir, async_scheduling):
    engine = engine_for(llama_dir, async_scheduling=async_scheduling, kv_cache_gb=kv_gb(llama_dir, 12, 4))
    per_request = run_collecting(engine, greedy_requests(make_prompts(8, seed=2), [9, 8, 7, 9, 6, 8, 9, 5]))
    assert len(per_request) == 8 and engine.metrics.num_preemptions > 0
    engine.step()  # the last requests to finish are named in the next step's output
    assert sorted(engine.runner._free_rows) == [0, 1, 2, 3]


@pytest.mark.slow
def test_async_with_graphs_matches_transformers(llama_dir, hf_greedy):
    """Both GPU-path features together, as they run on a GPU: pending decode tokens are filled on
    the device and then copied into the graph runner's static buffers."""
    prompts = make_prompts(5, seed=3)
    max_new = [4, 6, 2, 5, 3]
    engine = engine_for(llama_dir, attention_backend="triton", cuda_graphs="eager", async_scheduling="on")
    per_request = run_collecting(engine, greedy_requests(prompts, max_new))
    assert_deltas_consistent(per_request)
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        assert per_request[f"r{i}"][-1].output_token_ids == hf_greedy(p, n), i
    assert engine.runner.num_graph_steps > 0


def finish_rule_requests(probe):
    """Seeded sampling, stop strings, stop token ids, min_tokens and max_tokens, built from a probe
    run so that the stops are actually hit."""
    reqs = []
    for i, d in enumerate(probe):
        text, toks = d.output_text, d.output_token_ids
        kinds = [
            dict(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i),
            dict(temperature=0.0, stop=[text[3:6]] if len(text) > 6 else []),
            dict(temperature=0.0, stop_token_ids=[toks[4]]),
            dict(temperature=0.0, stop_token_ids=[toks[1]], min_tokens=3),
            dict(temperature=0.7, seed=7 + i, max_tokens=3),
        ]
        params = dict(max_tokens=10, ignore_eos=True)
        params.update(kinds[i % len(kinds)])
        reqs.append((probe[i].request_id, params))
    return reqs


def test_async_finish_rules_and_seeded_sampling_equal_sync(llama_dir):
    prompts = make_prompts(10, seed=4)
    probe_engine = engine_for(llama_dir)
    probe = probe_engine.generate(greedy_requests(prompts, [10] * len(prompts)))
    probe = [probe[f"r{i}"] for i in range(len(prompts))]
    specs = finish_rule_requests(probe)
    finals = {}
    for mode in ("off", "on"):
        engine = engine_for(llama_dir, async_scheduling=mode)
        reqs = [EngineRequest(request_id=rid, prompt_token_ids=p, sampling=SamplingParams(**params))
                for (rid, params), p in zip(specs, prompts, strict=True)]
        per_request = run_collecting(engine, reqs)
        assert_deltas_consistent(per_request)
        finals[mode] = {rid: ds[-1] for rid, ds in per_request.items()}
    stops = 0
    for rid, _ in specs:
        on, off = finals["on"][rid], finals["off"][rid]
        assert (on.output_token_ids, on.output_text, on.finish_reason, on.usage) == (
            off.output_token_ids, off.output_text, off.finish_reason, off.usage), rid
        stops += on.finish_reason is FinishReason.STOP
    assert stops >= 3  # the stop rules were exercised, not only max_tokens


def test_async_abort_of_a_request_with_a_token_in_flight(llama_dir):
    engine = engine_for(llama_dir, async_scheduling="on")
    reqs = greedy_requests(make_prompts(3, seed=5), [12, 12, 12])
    for r in reqs:
        engine.add(r)
    deltas = {}

    def collect(ds):
        for d in ds:
            deltas.setdefault(d.request_id, []).append(d)

    for _ in range(4):
        collect(engine.step())
    in_flight = engine.overlap.in_flight
    assert in_flight is not None and any(r.request_id == "r1" for r in in_flight.requests)
    engine.abort("r1")
    collect(engine.step())
    assert deltas["r1"][-1].finish_reason is FinishReason.ABORTED
    while engine.has_work():
        collect(engine.step())
    assert_deltas_consistent(deltas)
    assert len(deltas["r1"][-1].output_token_ids) < 12
    assert [d.finish_reason for d in (deltas["r0"][-1], deltas["r2"][-1])] == [FinishReason.LENGTH] * 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_requests_needing_host_history_make_steps_synchronous(llama_dir):
    """Penalties and logprobs read every token on the host: the engine drains and runs in step."""
    prompts = make_prompts(4, seed=6)
    finals = {}
    for mode in ("off", "on"):
        engine = engine_for(llama_dir, async_scheduling=mode)
        reqs = greedy_requests(prompts, [6] * 4)
        reqs[1].sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
        reqs[2].sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        per_request = run_collecting(engine, reqs)
        assert_deltas_consistent(per_request)
        finals[mode] = {rid: ds[-1] for rid, ds in per_request.items()}
        assert engine.overlap.in_flight is None and not engine.overlap.needs_host_history
    for rid in finals["off"]:
        assert finals["on"][rid].output_token_ids == finals["off"][rid].output_token_ids, rid
        assert finals["on"][rid].logprobs == finals["off"][rid].logprobs, rid


# ------------------------------------------------------------------------------- gpu_check report


def test_gpu_check_runs_the_gpu_path_and_reports_it(llama_dir):
    from tokenmill.tools import gpu_check

    assert gpu_check.gpu_path_options("cuda:0") == dict(cuda_graphs="on", async_scheduling="on")
    options = gpu_check.gpu_path_options("cpu")
    assert options == dict(cuda_graphs="eager", async_scheduling="on")
    engine = engine_for(llama_dir, attention_backend="triton", **options)
    engine.generate(greedy_requests(make_prompts(2), [3, 3]))
    report = gpu_check.gpu_path_report(engine)
    assert report["cuda_graphs"] == "eager" and report["async_scheduling"] is True
    assert 0 < report["graph_steps"] <= report["engine_steps"]
    res = dict(ok=True, output_tok_s=10.0, fraction_of_ceiling=0.5, ceiling_tok_s=20.0, **report)
    assert "cuda graphs eager, async scheduling on" in gpu_check._headline("throughput", res)


def test_a_failed_capture_falls_back_only_when_graphs_were_chosen_by_auto(llama_dir, monkeypatch):
    from tokenmill.engine import engine as engine_module
    from tokenmill.engine.cuda_graphs import DecodeGraphRunner

    def failing_capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphRunner, "capture", failing_capture)
    with pytest.raises(RuntimeError, match="capturing"):
        engine_for(llama_dir, attention_backend="triton", cuda_graphs="eager")
    # "auto" picks graphs only on CUDA; pretend this is such a case.
    monkeypatch.setattr(engine_module, "resolve_graph_mode", lambda mode, device, backend: "eager")
    engine = engine_for(llama_dir, attention_backend="triton")
    assert engine.graph_mode == "off" and engine.runner.graph_runner is None
    assert engine.generate(greedy_requests(make_prompts(1), [2]))["r0"].finish_reason is FinishReason.LENGTH
