"""TokenmillLM: lm-evaluation-harness's model interface on tokenmill Jobs.

Every lm-eval request becomes one wire Job (``schemas.Job`` with ``prompt_token_ids``); a
``JobRunner`` (jobs in, their Results by job_id out) runs them: ``LocalJobRunner`` on an engine in
this process, or a runner that sends them through Kafka to a worker fleet. All the requests of one
lm-eval call go to the runner in one batch, so the engine batches them and its prefix cache serves
the context shared by a question's choices.

Tokenization is that of lm-eval's ``HFLM`` (``--model hf``), so the metrics are the same:

- loglikelihood (context, continuation): ``TemplateLM._encode_pair`` (trailing spaces of the
  context move to the continuation; the pair is encoded whole and split at the context's length),
  an empty context becomes the prefix token (BOS, else EOS). The sequence is
  ``(context + continuation)[-(window + 1):]`` (left truncation, as HFLM does it); the Job is
  ``prompt_token_ids = sequence``, ``sampling = {max_tokens: 0, prompt_logprobs: 0,
  score_from: len(sequence) - len(continuation)}``, and the answer is the Result's
  ``(prompt_logprob_sum, is_greedy)``.
- loglikelihood_rolling (a document): HFLM's disjoint rolling windows
  (``get_rolling_token_windows`` with context_len 1, then ``make_disjoint_window``), one Job per
  window scored from the window's first continuation token; the document's loglikelihood is the
  sum over its windows.
- generate_until (context, gen_kwargs): the context left-truncated to ``window - max_gen_toks``
  tokens, ``max_tokens = max_gen_toks``, the ``until`` strings as stop strings, greedy unless the
  task samples; the text is the generated tokens decoded without special tokens and cut at the
  first ``until`` string (or the EOS text), as HFLM cuts it. A generation setting that cannot be
  honoured is refused with a ValueError naming it.

The window: a scoring Job holds the model's input window plus the last token it predicts, so with
``max_length`` the longest prompt the runner accepts (the engine's ``max_model_len``), the window
is ``max_length - 1``; this equals ``HFLM(max_length=max_length - 1)`` token for token. Documents
and prompts shorter than the window (every request of the shipped tasks) are unaffected.

Job ids are deterministic, ``f"{id_prefix}-{kind}-{index:07d}"`` (kind ``ll``, ``roll`` or
``gen``; index = the request's order in the call), so a resumed run asks for the same ids. A Result
that is not ``ok`` is never ignored: the call raises a RuntimeError naming the job ids and errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from tokenmill.schemas import STATUS_OK, Job, Result, Sampling

JobRunner = Callable[[list[Job]], dict[str, Result]]

# Stop strings a Job may carry (the contract's limit); further `until` strings are still cut from
# the text afterwards, so passing the first ones only ends some generations later, never wrongly.
MAX_STOP_STRINGS = 16

# gen_kwargs honoured beyond until / max_gen_toks (and its aliases) / do_sample / temperature, each
# to the Sampling field of the same meaning.
GEN_KWARGS_TO_SAMPLING = {
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}

# Errors quoted in the message of a failed call (all ids are counted).
ERRORS_QUOTED = 5


@register_model("tokenmill")
class TokenmillLM(TemplateLM):
    """lm-eval's ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` as tokenmill Jobs.

    ``tokenizer``: the model's Hugging Face tokenizer (the one the runner's engine uses);
    ``run_jobs``: a JobRunner; ``model_name``: the served model name (recorded by lm-eval);
    ``max_length``: the longest prompt a Job may have (the engine's max_model_len);
    ``id_prefix``: the first part of every job id; ``max_gen_toks``: the default generation length.
    """

    def __init__(self, tokenizer: Any, run_jobs: JobRunner, *, model_name: str, max_length: int,
                 id_prefix: str = "eval", max_gen_toks: int = 256) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 (a context token and a scored one), got {max_length}")
        if max_gen_toks < 1:
            raise ValueError(f"max_gen_toks must be at least 1, got {max_gen_toks}")
        if not id_prefix:
            raise ValueError("id_prefix must not be empty")
        self.tokenizer = tokenizer
        self.run_jobs = run_jobs
        self.model_name = model_name
        self.max_length = max_length
        self.window = max_length - 1
        self.id_prefix = id_prefix
        self.max_gen_toks = max_gen_toks

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TokenmillLM:
        """``--model tokenmill --model_args pretrained=DIR[,max_gen_toks=N,<EngineConfig field>=...]``:
        a local engine (LocalJobRunner); see ``create_from_arg_obj``."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> TokenmillLM:
        """A TokenmillLM on a local engine: ``pretrained`` (checkpoint folder or s3:// prefix),
        ``max_gen_toks``, ``id_prefix``, and any EngineConfig field (``enable_prefix_caching``,
        ``max_model_len``, ``dtype``, ...). lm-eval's ``batch_size`` and ``max_batch_size`` are
        ignored (the engine batches by itself); its ``device`` is the engine's device."""
        from tokenmill.engine.config import EngineConfig
        from tokenmill.eval.local_runner import LocalJobRunner

        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        pretrained = args.pop("pretrained", None)
        if not pretrained:
            raise ValueError("--model tokenmill needs --model_args pretrained=DIR (a checkpoint folder or s3://)")
        own = {name: args.pop(name) for name in ("max_gen_toks", "id_prefix") if name in args}
        for ignored in ("batch_size", "max_batch_size"):
            extra.pop(ignored, None)
        if "device" in extra:
            args.setdefault("device", extra.pop("device"))
        settings = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(args) - settings) + sorted(extra)
        if unknown:
            raise ValueError(f"--model tokenmill does not take {', '.join(unknown)} (it takes pretrained, "
                             f"max_gen_toks, id_prefix and the engine settings {', '.join(sorted(settings))})")
        runner = LocalJobRunner(pretrained, EngineConfig(model=str(pretrained), **args), progress=True)
        return cls(runner.tokenizer, runner, model_name=runner.model_name, max_length=runner.max_length, **own)

    # ------------------------------------------------------------------ tokenization (as HFLM)
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        options: dict[str, bool] = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False  # the string already starts with BOS
        ids = self.tokenizer.encode(string, **options)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _generation_context(self, context: str, max_ctx_len: int) -> list[int]:
        """HFLM's tok_batch_encode of one context: no special tokens when it starts with BOS."""
        bos = getattr(self.tokenizer, "bos_token", None)
        options = {"add_special_tokens": False} if has_bos_prefix(context, bos) else {}
        ids = self.tokenizer(context, **options)["input_ids"]
        return ids[-max_ctx_len:]

    # ------------------------------------------------------------------ running jobs
    def _job_id(self, kind: str, index: int) -> str:
        return f"{self.id_prefix}-{kind}-{index:07d}"

    def _score_job(self, job_id: str, context: list[int], continuation: list[int]) -> Job:
        """The Job scoring ``continuation`` after ``context`` (left-truncated to the window + 1)."""
        if not continuation:
            raise ValueError(f"{job_id}: the continuation has no tokens; nothing to score")
        if len(continuation) > self.window:
            raise ValueError(f"{job_id}: the continuation has {len(continuation)} tokens, more than the "
                             f"model's window of {self.window}")
        if not context:
            raise ValueError(f"{job_id}: the context has no tokens")
        sequence = (context + continuation)[-(self.window + 1):]
        return Job(
            job_id=job_id,
            prompt_token_ids=sequence,
            sampling=Sampling(max_tokens=0, prompt_logprobs=0, score_from=len(sequence) - len(continuation)),
        )

    def _run(self, jobs: list[Job]) -> list[Result]:
        """The Results of ``jobs`` in their order; RuntimeError when any is missing or not ok."""
        if not jobs:
            return []
        results = self.run_jobs(jobs)
        missing = [j.job_id for j in jobs if j.job_id not in results]
        failed = [results[j.job_id] for j in jobs if j.job_id in results and results[j.job_id].status != STATUS_OK]
        if missing or failed:
            parts = []
            if failed:
                quoted = "; ".join(
                    f"{r.job_id}: {r.error.code + ': ' + r.error.message if r.error else r.status}"
                    for r in failed[:ERRORS_QUOTED]
                )
                more = f" (and {len(failed) - ERRORS_QUOTED} more)" if len(failed) > ERRORS_QUOTED else ""
                parts.append(f"{len(failed)} job(s) failed: {quoted}{more}")
            if missing:
                more = f" (and {len(missing) - ERRORS_QUOTED} more)" if len(missing) > ERRORS_QUOTED else ""
                parts.append(f"{len(missing)} job(s) got no Result: {', '.join(missing[:ERRORS_QUOTED])}{more}")
            raise RuntimeError("evaluation requests failed: " + "; ".join(parts))
        return [results[j.job_id] for j in jobs]

    def _scores(self, jobs: list[Job]) -> list[tuple[float, bool]]:
        """(loglikelihood, is_greedy) of each scoring Job."""
        answers = []
        for job, result in zip(jobs, self._run(jobs), strict=True):
            scored = job.prompt_token_ids[job.sampling.score_from:]  # type: ignore[index]
            records = result.prompt_logprobs
            if records is None or [r.token_id for r in records] != scored or result.is_greedy is None:
                raise RuntimeError(
                    f"{job.job_id}: the Result does not score the {len(scored)} continuation tokens it was asked to "
                    f"(got {'no' if records is None else len(records)} prompt_logprobs)"
                )
            # The contract leaves the sum out when a scored token has probability 0.
            total = result.prompt_logprob_sum if result.prompt_logprob_sum is not None else -math.inf
            answers.append((float(total), bool(result.is_greedy)))
        return answers

    # ------------------------------------------------------------------ lm-eval's requests
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        jobs = [self._score_job(self._job_id("ll", i), ctx, cont) for i, (_, ctx, cont) in enumerate(requests)]
        answers = self._scores(jobs)
        for (request_str, _, _), answer in zip(requests, answers, strict=True):
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[int, list[int], list[int]]] = []  # (request index, context, continuation)
        for i, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm, desc="Windows")):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.window, context_len=1,
                ),
            ):
                windows.append((i, context, continuation))
        jobs = [self._score_job(self._job_id("roll", k), ctx, cont) for k, (_, ctx, cont) in enumerate(windows)]
        totals = [0.0] * len(requests)
        for (i, _, _), (logprob, _) in zip(windows, self._scores(jobs), strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _generation_sampling(self, gen_kwargs: dict[str, Any]) -> tuple[Sampling, list[str]]:
        """The Sampling of a generate_until request and its `until` strings (with the EOS text)."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generate_until: gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        bad_until = [u for u in until if not isinstance(u, str)]
        if bad_until:
            raise ValueError(f"generate_until: every `until` entry must be a string, got {bad_until!r}")
        max_gen_toks = kwargs.pop("max_gen_toks")
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        unknown = sorted(k for k in kwargs if k not in GEN_KWARGS_TO_SAMPLING)
        if unknown:
            raise ValueError(
                f"generate_until: tokenmill cannot honour gen_kwargs {', '.join(unknown)} (it honours until, "
                f"max_gen_toks and its aliases, do_sample, temperature, {', '.join(GEN_KWARGS_TO_SAMPLING)})"
            )
        if max_gen_toks < 1:
            raise ValueError(f"generate_until: max_gen_toks must be at least 1, got {max_gen_toks}")
        if max_gen_toks >= self.window:
            raise ValueError(f"generate_until: max_gen_toks ({max_gen_toks}) must be less than the model's window "
                             f"({self.window} tokens)")
        fields = {GEN_KWARGS_TO_SAMPLING[k]: v for k, v in kwargs.items()}
        stops = [u for u in until if u and u != eos][:MAX_STOP_STRINGS]  # EOS ends generation by itself
        sampling = Sampling(max_tokens=max_gen_toks, temperature=temperature if do_sample else 0.0, stop=stops,
                            **fields)
        return sampling, until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        jobs, untils = [], []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            sampling, until = self._generation_sampling(gen_kwargs)
            prompt = self._generation_context(context, self.window - sampling.max_tokens)
            if not prompt:
                raise ValueError(f"{self._job_id('gen', i)}: the context has no tokens")
            jobs.append(Job(job_id=self._job_id("gen", i), prompt_token_ids=prompt, sampling=sampling))
            untils.append(until)
        texts = []
        for request, result, until in zip(requests, self._run(jobs), untils, strict=True):
            text = postprocess_generated_text(
                self.tokenizer.decode(result.token_ids, skip_special_tokens=True), stop=until, think_end_token=None
            )
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template on lm-eval's chat history (``--apply_chat_template``), as HFLM
        applies it: the text then goes through the requests above like any other."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_length": self.max_length}
