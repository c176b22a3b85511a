"""Helpers of the lm-evaluation-harness tests: the shipped tasks' requests, lm-eval's HFLM on a
checkpoint (the reference), and TokenmillLM on a LocalJobRunner."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = ("tokenmill_mc", "tokenmill_ppl", "tokenmill_gen")


def task_manager() -> Any:
    from lm_eval.tasks import TaskManager

    from tokenmill.eval import TASKS_DIR

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # lm-eval's own tasks: not needed


def task_requests(name: str, limit: int | None = None) -> list[Any]:
    """Every lm-eval request (Instance) of task ``name``, zero-shot, in the task's order."""
    task = task_manager().load([name])["tasks"][name]
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return list(task.instances)


def hf_lm(model_dir: str | Path, max_length: int | None = None, dtype: str = "float32") -> Any:
    """lm-eval's own Hugging Face model (``--model hf``), float32 (or ``dtype``) on the CPU."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), dtype=dtype, device="cpu", batch_size=8, max_length=max_length)


def encoded_pairs(lm: Any, requests: list[Any]) -> list[tuple[list[int], list[int]]]:
    """The (context tokens, continuation tokens) of each loglikelihood request, as lm-eval's own
    ``loglikelihood`` on ``lm`` encodes them (an empty context, the whitespace rule) before it runs
    the model: taken from its hand-over to ``_loglikelihood_tokens``, which is not run."""
    handed: list[Any] = []
    lm._loglikelihood_tokens = lambda reqs, disable_tqdm=False: handed.extend(reqs) or []
    try:
        type(lm).loglikelihood(lm, requests, disable_tqdm=True)  # the class's: not a recording wrapper
    finally:
        del lm._loglikelihood_tokens  # the class's method again
    return [(list(context), list(continuation)) for _, context, continuation in handed]


def float64_loglikelihoods(model: Any, pairs: list[tuple[list[int], list[int]]], max_length: int) -> list[float]:
    """Each continuation's log-likelihood after its context from ``model`` (a Hugging Face causal LM
    with ``.model`` and ``.lm_head``, e.g. HFLM's Llama ``.model``) computed in float64 on a copy:
    HFLM's sum, for requests that fit its window (``max_length``; longer ones are refused, HFLM
    would cut them).

    Why not HFLM in float64: it loads the checkpoint again (about 7 CPU-s for SmolLM2) and runs each
    request whole, with the whole vocabulary at every position, in batches of 8, while on the CPU a
    float64 forward pass costs about 0.14 s before its first token (it reads all the weights). Here
    every distinct context runs once, all in one batch (right-padded: a causal model's real positions
    never see the padding after them), then the continuations after their context's cache, a batch
    per continuation length (the padding masked out, positions going on from the context's end); the
    LM head and its log-softmax only where a continuation token is predicted. On SmolLM2's 96
    multiple-choice requests, one core: 17.7 CPU-s against HFLM's 28.5, the sums within 3e-14 of
    HFLM's float64 ones."""
    import copy
    import inspect

    import torch

    too_long = [i for i, (c, x) in enumerate(pairs) if len(c) + len(x) > max_length + 1]
    if too_long:
        raise ValueError(f"requests {too_long} are longer than the window ({max_length} tokens)")
    model = copy.deepcopy(model).to(torch.float64).eval()
    # transformers renames the argument (past_key_values -> cache) within the range we allow.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    contexts = list(dict.fromkeys(tuple(c) for c, _ in pairs))
    row_of = {c: r for r, c in enumerate(contexts)}
    width = max(len(c) for c in contexts)
    with torch.inference_mode():
        ids = torch.tensor([list(c) + [0] * (width - len(c)) for c in contexts])
        body = model.model(ids, use_cache=True)
        last = body.last_hidden_state[torch.arange(len(contexts)), [len(c) - 1 for c in contexts]]
        first = torch.log_softmax(model.lm_head(last), dim=-1)  # predicts each continuation's first token
        # The later tokens, by how many there are: a batch of equal lengths pads nothing (one
        # batch for all would be 4 times the positions on SmolLM2's tasks, most choices being 1-2
        # tokens).
        later: dict[int, list[int]] = {}
        for i, (_, continuation) in enumerate(pairs):
            if len(continuation) > 1:
                later.setdefault(len(continuation) - 1, []).append(i)
        tables: dict[int, torch.Tensor] = {}  # request -> log-softmax at its later tokens' predictors
        for n, requests in later.items():
            cache = copy.deepcopy(body.past_key_values)
            cache.batch_select_indices(torch.tensor([row_of[tuple(pairs[i][0])] for i in requests]))
            predictors = torch.tensor([pairs[i][1][:-1] for i in requests])
            mask = torch.tensor([[1] * len(pairs[i][0]) + [0] * (width - len(pairs[i][0])) + [1] * n
                                 for i in requests])
            positions = torch.tensor([[len(pairs[i][0]) + j for j in range(n)] for i in requests])
            logits = model(predictors, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{cache_arg: cache}).logits
            tables.update(zip(requests, torch.log_softmax(logits, dim=-1), strict=True))
        sums = []
        for i, (context, continuation) in enumerate(pairs):
            logprobs = [first[row_of[tuple(context)], continuation[0]]]
            if i in tables:
                logprobs.extend(tables[i][range(len(continuation) - 1), continuation[1:]])
            sums.append(float(torch.stack(logprobs).sum()))
    return sums


def tokenmill_lm(model_dir: str | Path, **engine: Any) -> tuple[Any, Any]:
    """(TokenmillLM, its LocalJobRunner) on a float32 CPU engine with the given settings (a KV
    cache of 0.5 GiB unless given: SmolLM2's full window, and quicker to set up than the default)."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.eval.lm import TokenmillLM
    from tokenmill.eval.local_runner import LocalJobRunner

    engine.setdefault("kv_cache_gb", 0.5)
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **engine)
    runner = LocalJobRunner(model_dir, config)
    lm = TokenmillLM(runner.tokenizer, runner, model_name=runner.model_name, max_length=runner.max_length)
    return lm, runner


def kv_gb(model_dir: str | Path, num_blocks: int, block_size: int = 16) -> float:
    """The kv_cache_gb that gives the engine ``num_blocks`` KV blocks of this model."""
    from tokenmill.engine.model_config import load_model_config
    from tokenmill.engine.model_runner import ModelRunner

    mc = load_model_config(model_dir, "float32")
    bytes_per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype,
                                                     block_size)
    return num_blocks * bytes_per_block / 1024**3


REQUEST_KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def record_answers(lm: Any) -> dict[tuple[str, Any], Any]:
    """Wrap ``lm``'s three request methods (on the instance) so that every answer is recorded by
    (kind, the request's args); returns the record, filled as lm-eval calls them."""
    record: dict[tuple[str, Any], Any] = {}

    def wrap(kind: str) -> None:
        method = getattr(lm, kind)

        def recorded(requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
            answers = method(requests, disable_tqdm=disable_tqdm)
            for request, answer in zip(requests, answers, strict=True):
                record[(kind, _key(request.args))] = answer
            return answers

        setattr(lm, kind, recorded)

    for kind in REQUEST_KINDS:
        wrap(kind)
    return record


def _key(args: tuple) -> tuple:
    # generate_until's args hold a dict of gen_kwargs: keyed by its sorted items (as text).
    return tuple(repr(sorted(a.items())) if isinstance(a, dict) else a for a in args)


def evaluate(lm: Any, tasks: tuple[str, ...] = TASKS, limit: int | None = None) -> dict[str, Any]:
    """lm-eval's simple_evaluate on the shipped tasks, zero-shot, without bootstrap."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager(), limit=limit,
                           bootstrap_iters=0, log_samples=False)


def force_preemptions(engine: Any, every: int = 3, times: int = 8) -> dict[str, int]:
    """Preempt every running request (by recompute) after every ``every``-th step, ``times``
    times: scoring requests are then sent back half scored and recomputed. A request that scores
    only (max_tokens 0) never outgrows its admission, so a small KV pool alone does not preempt
    it; this is how the engine's fault isolation preempts. Returns counters, updated as it goes:
    preemption rounds and requests preempted part-way through their scored positions."""
    counts = {"steps": 0, "rounds": 0, "mid_scoring": 0}
    step = engine.step

    def stepping() -> list[Any]:
        out = step()
        counts["steps"] += 1
        running = engine.scheduler.running
        if running and counts["rounds"] < times and counts["steps"] % every == 0:
            counts["mid_scoring"] += sum(
                1 for r in running if r.sampling.score_from < r.next_score_pos < r.num_prompt_tokens
            )
            engine.scheduler.preempt_all()
            counts["rounds"] += 1
        return out

    engine.step = stepping
    return counts
