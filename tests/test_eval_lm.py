"""lm-evaluation-harness on tokenmill: TokenmillLM on a LocalJobRunner against lm-eval's own HFLM.

Every loglikelihood request of the shipped multiple-choice and perplexity tasks equals HFLM's
(float32, CPU) within 1e-4 with the same is_greedy, on the tiny Llama and Qwen2 models and on
SmolLM2, with the prefix cache on and off and with preemption forced; simple_evaluate gives the
same metrics with both models on SmolLM2 (and the same text for every generation); bad input is
refused with a clear error.

The tiny models run with an engine window of 128 tokens (HFLM's max_length 127, see
worker/eval/lm.py): several multiple-choice prompts are then left-truncated and the long
document spans several rolling windows, so both of HFLM's length rules are compared too.

A document's loglikelihood is a sum over up to a few hundred tokens: there the tolerance is
relative (1e-5). HFLM's float32 log-softmax carries a small same-signed error per token (against
float64: about 8e-6 a token on SmolLM2, 1.7e-3 over a 200-token document, while tokenmill's sum is
within 4e-5 of float64's), so an absolute 1e-4 would test HFLM's rounding, not tokenmill.

On SmolLM2 the same holds for a few continuations (one of the 112: HFLM's float32 sum 1.9e-4 from
float64's, tokenmill's 1.8e-5): there every loglikelihood is also held to the same model in float64
(HFLM's sums, computed with less work: eval_helpers.float64_loglikelihoods), within 1e-4, and to
HFLM in float32 within 1e-4 plus HFLM's own float32 error on that request.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.eval_helpers import (  # noqa: E402
    encoded_pairs,
    evaluate,
    float64_loglikelihoods,
    force_preemptions,
    hf_lm,
    kv_gb,
    record_answers,
    task_manager,
    task_requests,
    tokenmill_lm,
)
from tokenmill.schemas import Job, Result  # noqa: E402
from tokenmill.tools.tiny_models import cached_tiny_model  # noqa: E402

TOL = 1e-4
DOC_REL_TOL = 1e-5
TINY_LEN = 128

# Engine settings compared: the defaults (prefix cache on), the cache off, and preemption forced
# (chunked prefill in a small KV pool, every running request preempted now and then: see
# force_preemptions).
SETTINGS = {
    "prefix_cache": lambda d, window_blocks: {},
    "no_prefix_cache": lambda d, window_blocks: {"enable_prefix_caching": False},
    "preemption": lambda d, window_blocks: {"kv_cache_gb": kv_gb(d, window_blocks + 4),
                                            "max_num_batched_tokens": 32},
}


def engine_for(model_dir, setting, max_model_len):
    """TokenmillLM and its runner with ``setting``; with preemption, the counters of it."""
    lm, runner = tokenmill_lm(model_dir, max_model_len=max_model_len,
                              **SETTINGS[setting](model_dir, max_model_len // 16))
    counts = force_preemptions(runner.engine) if setting == "preemption" else None
    return lm, runner, counts


def check_loglikelihoods(ours, ref, exact=None):
    """ours against HFLM's float32 answers `ref` (value and is_greedy); with `exact` (HFLM's float64
    values), the values against those within TOL, and against `ref` within TOL plus ref's own error."""
    assert len(ours) == len(ref)
    slack = [0.0] * len(ref) if exact is None else [abs(b[0] - x) for b, x in zip(ref, exact, strict=True)]
    diffs = [abs(a[0] - b[0]) - s for a, b, s in zip(ours, ref, slack, strict=True)]
    assert max(diffs) <= TOL, f"largest difference {max(diffs):.3g} at request {diffs.index(max(diffs))}"
    if exact is not None:
        off = [abs(a[0] - x) for a, x in zip(ours, exact, strict=True)]
        assert max(off) <= TOL, f"{max(off):.3g} from float64 at request {off.index(max(off))}"
    flipped = [i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a[1] != b[1]]
    assert not flipped, f"is_greedy differs on requests {flipped}"


def check_documents(ours, ref):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert math.isfinite(a) and abs(a - b) <= max(TOL, DOC_REL_TOL * abs(b)), f"document {i}: {a} vs {b}"


def check_engine(runner, setting, counts=None):
    stats, metrics = runner.engine.stats(), runner.engine.metrics
    if setting == "preemption":
        assert metrics.num_preemptions > 0 and counts["mid_scoring"] > 0
    if setting == "no_prefix_cache":
        assert stats.cached_prompt_tokens_total == 0
    else:  # the context shared by a question's choices is served from the cache
        assert stats.cached_prompt_tokens_total > 0
    assert runner.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def task_reqs():
    return {"mc": task_requests("tokenmill_mc"), "ppl": task_requests("tokenmill_ppl")}


# ---------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module", params=["test-llama", "test-qwen2"])
def tiny_reference(request, task_reqs):
    model_dir = cached_tiny_model(request.param)
    hf = hf_lm(model_dir, max_length=TINY_LEN - 1)
    return model_dir, hf.loglikelihood(task_reqs["mc"], disable_tqdm=True), hf.loglikelihood_rolling(
        task_reqs["ppl"], disable_tqdm=True)


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_every_loglikelihood_equals_hflm_on_tiny_models(tiny_reference, task_reqs, setting):
    model_dir, ref_mc, ref_ppl = tiny_reference
    lm, runner, counts = engine_for(model_dir, setting, TINY_LEN)
    assert lm.window == TINY_LEN - 1
    check_loglikelihoods(lm.loglikelihood(task_reqs["mc"], disable_tqdm=True), ref_mc)
    check_documents(lm.loglikelihood_rolling(task_reqs["ppl"], disable_tqdm=True), ref_ppl)
    check_engine(runner, setting, counts)
    runner.close()


def test_the_tiny_window_truncates_prompts_and_rolls_documents(task_reqs):
    """What the tiny comparison covers: left truncation and documents of several windows."""
    from lm_eval.utils import get_rolling_token_windows

    lm, runner = tokenmill_lm(cached_tiny_model("test-llama"), max_model_len=TINY_LEN)
    pairs = [lm._encode_pair(*r.args) for r in task_reqs["mc"]]
    assert sum(len(c) + len(x) > lm.window + 1 for c, x in pairs) >= 4
    windows = [len(list(get_rolling_token_windows(lm.tok_encode(r.args[0]), lm.prefix_token_id, lm.window, 1)))
               for r in task_reqs["ppl"]]
    assert max(windows) >= 3 and min(windows) == 1
    runner.close()


def test_the_float64_reference_is_hflms_in_float64(task_reqs):
    """The SmolLM2 tests' float64 reference (one pass per distinct context, then the choices after
    its cache) gives HFLM's float64 sums, on every multiple-choice request and on empty contexts;
    a request longer than the window is refused, not cut."""
    model_dir = cached_tiny_model("test-llama")
    reqs = [*task_reqs["mc"], SimpleNamespace(args=("", " the end of it")), SimpleNamespace(args=("", "x"))]
    hf = hf_lm(model_dir)
    pairs = encoded_pairs(hf, reqs)
    assert len(pairs) == len(reqs) and len({tuple(c) for c, _ in pairs}) < len(pairs)  # shared contexts
    lengths = {len(x) for _, x in pairs}
    assert 1 in lengths and len(lengths - {1}) >= 2  # one-token choices, and batches of several lengths after
    ours = float64_loglikelihoods(hf.model, pairs, hf.max_length)
    ref = [value for value, _ in hf_lm(model_dir, dtype="float64").loglikelihood(reqs, disable_tqdm=True)]
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-10
    assert next(hf.model.parameters()).dtype == torch.float32  # it computed on a copy
    with pytest.raises(ValueError, match=r"requests \[0\] are longer than the window \(5 tokens\)"):
        float64_loglikelihoods(hf.model, pairs[:1], 5)


# ---------------------------------------------------------------------- SmolLM2
# SmolLM2 (135M parameters) on 2 CPU cores: about 100 s for the three tests below.
@pytest.fixture(scope="module")
def smollm2():
    from tokenmill.tools.smollm2 import cached_smollm2

    return cached_smollm2()


@pytest.fixture(scope="module")
def smollm2_evaluations(smollm2):
    """simple_evaluate on the three tasks with HFLM and with TokenmillLM (defaults), then the
    generated answers scored as continuations; every answer recorded by request."""
    hf = hf_lm(smollm2)
    hf_answers = record_answers(hf)
    hf_results = evaluate(hf)
    # The model's own greedy answers as continuations: requests whose is_greedy is true.
    greedy = [SimpleNamespace(args=(k[1][0], text)) for k, text in hf_answers.items()
              if k[0] == "generate_until" and text.strip()]
    hf.loglikelihood(greedy, disable_tqdm=True)
    # The same loglikelihood requests in float64: the reference the values are held to.
    ll = sorted((k for k in hf_answers if k[0] == "loglikelihood"), key=repr)
    exact = float64_loglikelihoods(hf.model, encoded_pairs(hf, [SimpleNamespace(args=k[1]) for k in ll]),
                                   hf.max_length)
    exact64 = dict(zip(ll, exact, strict=True))
    del hf
    lm, runner = tokenmill_lm(smollm2)
    answers = record_answers(lm)
    results = evaluate(lm)
    lm.loglikelihood(greedy, disable_tqdm=True)
    check_engine(runner, "prefix_cache")
    runner.close()
    return {"hf": (hf_results, hf_answers), "tokenmill": (results, answers), "float64": exact64}


@pytest.mark.slow
def test_simple_evaluate_gives_hflm_metrics_on_smollm2(smollm2_evaluations):
    ref, _ = smollm2_evaluations["hf"]
    ours, _ = smollm2_evaluations["tokenmill"]
    ref, ours = ref["results"], ours["results"]
    for task, metric in [("tokenmill_mc", "acc,none"), ("tokenmill_mc", "acc_norm,none"),
                         ("tokenmill_gen", "exact_match,none")]:
        assert ours[task][metric] == ref[task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["tokenmill_ppl"][metric] == pytest.approx(ref["tokenmill_ppl"][metric], rel=1e-4), metric
    assert 0 < ref["tokenmill_gen"]["exact_match,none"]  # the model answers some: the metric means something
    assert 0 < ref["tokenmill_mc"]["acc,none"]


@pytest.mark.slow
def test_every_request_of_simple_evaluate_equals_hflm_on_smollm2(smollm2_evaluations):
    _, ref = smollm2_evaluations["hf"]
    _, ours = smollm2_evaluations["tokenmill"]
    assert ours.keys() == ref.keys()
    counts = {kind: sum(1 for k in ref if k[0] == kind) for kind in ("loglikelihood", "loglikelihood_rolling",
                                                                     "generate_until")}
    assert counts["loglikelihood"] > 96 and (counts["loglikelihood_rolling"], counts["generate_until"]) == (8, 16)
    keys = sorted(ref, key=repr)
    ll = [k for k in keys if k[0] == "loglikelihood"]
    exact = smollm2_evaluations["float64"]
    check_loglikelihoods([ours[k] for k in ll], [ref[k] for k in ll], [exact[k] for k in ll])
    assert 0 < sum(ref[k][1] for k in ll) < len(ll)  # is_greedy is both true and false: its check means something
    roll = [k for k in keys if k[0] == "loglikelihood_rolling"]
    check_documents([ours[k] for k in roll], [ref[k] for k in roll])
    gen = [k for k in keys if k[0] == "generate_until"]
    assert [ours[k] for k in gen] == [ref[k] for k in gen]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["no_prefix_cache", "preemption"])
def test_every_loglikelihood_equals_hflm_on_smollm2(smollm2, smollm2_evaluations, setting):
    _, ref = smollm2_evaluations["hf"]
    mc = [k for k in sorted(ref, key=repr) if k[0] == "loglikelihood"]
    ppl = [k for k in sorted(ref, key=repr) if k[0] == "loglikelihood_rolling"]
    window_len = 256  # longer than every request, so the window changes nothing
    lm, runner, counts = engine_for(smollm2, setting, window_len)
    assert max(len(lm.tok_encode(k[1][0])) for k in ppl) < lm.window
    ours_mc = lm.loglikelihood([SimpleNamespace(args=k[1]) for k in mc], disable_tqdm=True)
    check_loglikelihoods(ours_mc, [ref[k] for k in mc], [smollm2_evaluations["float64"][k] for k in mc])
    ours_ppl = lm.loglikelihood_rolling([SimpleNamespace(args=k[1]) for k in ppl], disable_tqdm=True)
    check_documents(ours_ppl, [ref[k] for k in ppl])
    check_engine(runner, setting, counts)
    runner.close()


# ---------------------------------------------------------------------- jobs and bad input
@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.engine.tokenizer import load_tokenizer

    return load_tokenizer(cached_tiny_model("test-llama"))


class FakeRunner:
    """A JobRunner that records the jobs and answers each with ``answer(job)`` (None: no Result)."""

    def __init__(self, answer):
        self.answer = answer
        self.calls: list[list[Job]] = []

    def __call__(self, jobs):
        self.calls.append(jobs)
        out = {}
        for job in jobs:
            result = self.answer(job)
            if result is not None:
                out[job.job_id] = result
        return out


def scored(job: Job) -> Result:
    tokens = job.prompt_token_ids[job.sampling.score_from:]
    return Result.model_validate({
        "job_id": job.job_id, "status": "ok", "finish_reason": "length", "model": "m", "worker": "w",
        "attempt": "w-1", "prompt_logprobs": [{"token_id": t, "token": "", "logprob": -1.0, "rank": 1} for t in tokens],
        "prompt_logprob_sum": -float(len(tokens)), "is_greedy": True,
    })


def failed(job: Job, message="the prompt has 300 tokens") -> Result:
    return Result.model_validate({
        "job_id": job.job_id, "status": "error", "model": "m", "worker": "w", "attempt": "w-1",
        "error": {"code": "prompt_too_long", "message": message},
    })


def generated(tokenizer, text):
    def answer(job):
        return Result.model_validate({
            "job_id": job.job_id, "status": "ok", "finish_reason": "stop", "model": "m", "worker": "w",
            "attempt": "w-1", "text": text, "token_ids": tokenizer.encode(text, add_special_tokens=False),
        })
    return answer


def request(*args):
    return SimpleNamespace(args=args)


def make_lm(tokenizer, runner, **kw):
    from tokenmill.eval.lm import TokenmillLM

    return TokenmillLM(tokenizer, runner, model_name="m", max_length=kw.pop("max_length", 64), **kw)


def test_a_loglikelihood_request_is_one_scoring_job_with_a_deterministic_id(tokenizer):
    runs = [FakeRunner(scored), FakeRunner(scored)]
    reqs = [request("The sky is", " blue"), request("The sky is", " green"), request("", "Hello world")]
    answers = [make_lm(tokenizer, r, id_prefix="run7").loglikelihood(reqs, disable_tqdm=True) for r in runs]
    (jobs,) = runs[0].calls
    assert [j.job_id for j in jobs] == ["run7-ll-0000000", "run7-ll-0000001", "run7-ll-0000002"]
    assert [j.model_dump() for j in jobs] == [j.model_dump() for j in runs[1].calls[0]]  # a rerun asks the same
    context = tokenizer.encode("The sky is")
    whole = tokenizer.encode("The sky is blue")
    assert jobs[0].prompt_token_ids == whole and whole[:len(context)] == context
    s = jobs[0].sampling
    assert (s.max_tokens, s.prompt_logprobs, s.score_from) == (0, 0, len(context))
    # An empty context is the prefix token, as in HFLM: BOS, or EOS for a tokenizer without one (this).
    assert tokenizer.bos_token_id is None
    assert jobs[2].prompt_token_ids[0] == tokenizer.eos_token_id and jobs[2].sampling.score_from == 1
    assert answers[0][0] == (-float(len(whole) - len(context)), True)


def test_a_long_request_is_left_truncated_to_the_window(tokenizer):
    runner = FakeRunner(scored)
    lm = make_lm(tokenizer, runner, max_length=16)
    lm.loglikelihood([request("one two three " * 20, "four five")], disable_tqdm=True)
    (job,) = runner.calls[0]
    assert len(job.prompt_token_ids) == 16  # the window (15) plus the last predicted token
    full = tokenizer.encode("one two three " * 20 + "four five")
    assert job.prompt_token_ids == full[-16:]


def test_an_error_result_raises_naming_the_job_and_its_error(tokenizer):
    runner = FakeRunner(lambda job: failed(job) if job.job_id.endswith("1") else scored(job))
    with pytest.raises(RuntimeError, match=r"eval-ll-0000001: prompt_too_long: the prompt has 300 tokens"):
        make_lm(tokenizer, runner).loglikelihood([request("a", " b"), request("c", " d")], disable_tqdm=True)


def test_a_missing_result_raises_naming_the_job(tokenizer):
    runner = FakeRunner(lambda job: None if job.job_id.endswith("0") else scored(job))
    with pytest.raises(RuntimeError, match=r"got no Result: eval-roll-0000000"):
        make_lm(tokenizer, runner).loglikelihood_rolling([request("some text")], disable_tqdm=True)


def test_a_request_the_engine_refuses_raises_with_its_job_id(task_reqs):
    """The real path: a window the engine does not have makes its Results errors, and they raise."""
    from tokenmill.eval.lm import TokenmillLM

    _, runner = tokenmill_lm(cached_tiny_model("test-llama"), max_model_len=32)
    lm = TokenmillLM(runner.tokenizer, runner, model_name=runner.model_name, max_length=200)
    with pytest.raises(RuntimeError, match=r"eval-ll-0000000: prompt_too_long: the prompt has \d+ tokens"):
        lm.loglikelihood(task_reqs["mc"][:2], disable_tqdm=True)
    runner.close()


def test_generation_follows_gen_kwargs_and_cuts_the_text_at_until(tokenizer):
    runner = FakeRunner(generated(tokenizer, " Paris.\nQuestion: next"))
    lm = make_lm(tokenizer, runner, max_length=300, id_prefix="g")
    texts = lm.generate_until([
        request("Q: capital of France?\nA:", {"until": ["\n"], "do_sample": False, "max_gen_toks": 8}),
        request("Q: again", {"until": ["."], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 3}),
    ], disable_tqdm=True)
    assert texts == [" Paris.", " Paris"]
    greedy, sampled = runner.calls[0]
    assert greedy.job_id == "g-gen-0000000" and sampled.job_id == "g-gen-0000001"
    assert greedy.prompt_token_ids == tokenizer.encode("Q: capital of France?\nA:")
    assert (greedy.sampling.max_tokens, greedy.sampling.temperature, greedy.sampling.stop) == (8, 0.0, ["\n"])
    s = sampled.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (256, 0.7, 0.9, 3, ["."])


def test_a_generation_context_is_left_truncated_to_leave_room_for_the_output(tokenizer):
    runner = FakeRunner(generated(tokenizer, "x"))
    make_lm(tokenizer, runner, max_length=33).generate_until(
        [request("one two three " * 30, {"until": ["\n"], "max_gen_toks": 12})], disable_tqdm=True)
    (job,) = runner.calls[0]
    assert len(job.prompt_token_ids) == 32 - 12
    assert job.prompt_token_ids == tokenizer.encode("one two three " * 30)[-20:]


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"until": ["\n"], "num_beams": 4}, "cannot honour gen_kwargs num_beams"),
    ({"until": ["\n"], "max_gen_toks": 64}, r"max_gen_toks \(64\) must be less than the model's window"),
    ({"until": [3]}, "every `until` entry must be a string"),
])
def test_generation_settings_it_cannot_honour_are_refused(tokenizer, gen_kwargs, message):
    runner = FakeRunner(generated(tokenizer, "x"))
    with pytest.raises(ValueError, match=message):
        make_lm(tokenizer, runner, max_length=64).generate_until([request("Q:", gen_kwargs)], disable_tqdm=True)
    assert runner.calls == []  # nothing was sent


def test_the_chat_template_is_the_models(tokenizer):
    text = make_lm(tokenizer, FakeRunner(scored)).apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert "Hi there" in text and text.endswith("<|im_start|>assistant\n")


def test_bad_arguments_are_refused(tokenizer):
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        make_lm(tokenizer, FakeRunner(scored), max_length=1)
    with pytest.raises(ValueError, match="id_prefix must not be empty"):
        make_lm(tokenizer, FakeRunner(scored), id_prefix="")
    with pytest.raises(ValueError, match="continuation has no tokens"):
        make_lm(tokenizer, FakeRunner(scored)).loglikelihood([request("abc", "")], disable_tqdm=True)


# ---------------------------------------------------------------------- runner, tasks, registry
def test_the_local_runner_refuses_duplicate_job_ids():
    _, runner = tokenmill_lm(cached_tiny_model("test-llama"), max_model_len=32)
    job = Job(job_id="same", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 0, "prompt_logprobs": 0})
    with pytest.raises(ValueError, match="duplicate job ids in one call: same"):
        runner([job, job])
    (result,) = runner([job]).values()
    assert result.status == "ok" and len(result.prompt_logprobs) == 2
    runner.close()
    with pytest.raises(RuntimeError, match="the runner is closed"):
        runner([job])


def test_the_tasks_load_from_any_directory(tmp_path, monkeypatch):
    from tokenmill.eval import TASKS_DIR

    monkeypatch.chdir(tmp_path)
    assert TASKS_DIR.is_absolute()
    tasks = task_manager().load(["tokenmill_mc", "tokenmill_ppl", "tokenmill_gen"])["tasks"]
    sizes = {name: len(task.test_docs()) for name, task in tasks.items()}
    assert sizes == {"tokenmill_mc": 24, "tokenmill_ppl": 8, "tokenmill_gen": 16}
    mc = tasks["tokenmill_mc"]
    assert all(len(mc.doc_to_choice(doc)) == 4 for doc in mc.test_docs())
    assert tasks["tokenmill_gen"].config.generation_kwargs["until"] == ["\n"]


def test_the_task_files_ship_with_the_package():
    import fnmatch
    import tomllib
    from pathlib import Path

    from tokenmill.eval import TASKS_DIR

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["tokenmill.eval"]
    files = [p.relative_to(TASKS_DIR.parent).as_posix() for p in TASKS_DIR.iterdir() if p.is_file()]
    assert len(files) >= 7
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []


def test_tokenmill_is_an_lm_eval_model_name():
    from lm_eval.api.registry import get_model

    from tokenmill.eval.lm import TokenmillLM

    assert get_model("tokenmill") is TokenmillLM
    model_dir = cached_tiny_model("test-llama")
    lm = TokenmillLM.create_from_arg_string(f"pretrained={model_dir},max_model_len=48,dtype=float32,device=cpu",
                                            {"batch_size": 8, "device": None})
    assert (lm.max_length, lm.window, lm.model_name) == (48, 47, model_dir.name)
    (answer,) = lm.loglikelihood([request("The sky is", " blue")])  # with its progress bar
    assert answer[0] < 0
    with pytest.raises(ValueError, match="needs --model_args pretrained=DIR"):
        TokenmillLM.create_from_arg_string("max_model_len=48")
    with pytest.raises(ValueError, match="does not take max_modle_len, temperature"):
        TokenmillLM.create_from_arg_obj({"pretrained": str(model_dir), "max_modle_len": 48}, {"temperature": 1})
    lm.run_jobs.close()
