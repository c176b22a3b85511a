"""What a chaos run sent and what came back: jobs produced, every Result read, the group's lag.

A job is *lost* when it has no Result at the end, *duplicated* once for every Result beyond its
first, and *not ok* when a Result of it has a status other than `ok`. Results are read by a
consumer of the results topic from its beginning (no group), for the whole run, with the time
each arrived, so recovery times can be read off afterwards.

A job answered `ok` more than once (a worker killed after its Result went out and before its offset
was committed, say) should get the same answer every time: the engine is batch invariant, so a
redelivered job computes the same bits on another worker among other jobs. The ledger keeps what
each `ok` Result says (token ids, text, logprobs, and prompt logprobs and choices where a job has
them) and `duplicate_answers` compares them; the jobs include seeded sampled ones with logprobs, so
an answer that moved with its batch would show.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tokenmill.kafka.admin import create_topic
from tokenmill.kafka.metadata_pacing import paced


@dataclass(frozen=True)
class ChaosTopics:
    jobs: str
    results: str
    tokens: str
    dlq: str
    group: str
    partitions: int

    @classmethod
    async def create(cls, bootstrap: str, partitions: int) -> ChaosTopics:
        tag = uuid.uuid4().hex[:8]
        t = cls(f"chaos-jobs-{tag}", f"chaos-results-{tag}", f"chaos-tokens-{tag}", f"chaos-dlq-{tag}",
                f"chaos-{tag}", partitions)
        for name, n in ((t.jobs, partitions), (t.results, 1), (t.tokens, 1), (t.dlq, partitions)):
            await create_topic(bootstrap, name, n)
        return t

    def flags(self) -> list[str]:
        return ["--jobs-topic", self.jobs, "--results-topic", self.results, "--tokens-topic", self.tokens,
                "--dlq-topic", self.dlq, "--group-id", self.group]


def make_jobs(n: int, max_tokens: int, run: str) -> list[dict]:
    """n small jobs; a tenth of them stream, so TokenEvents are in the mix. In turn: greedy with 2
    top logprobs, seeded top-p / top-k sampling with logprobs, seeded sampling with penalties, plain
    greedy."""
    samplings = (
        {"temperature": 0.0, "logprobs": 2},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "logprobs": 1},
        {"temperature": 1.0, "repetition_penalty": 1.1, "presence_penalty": 0.2, "logprobs": 0},
        {"temperature": 0.0},
    )
    jobs = []
    for i in range(n):
        sampling = {"max_tokens": max_tokens, "ignore_eos": True, **samplings[i % len(samplings)]}
        if sampling["temperature"] > 0:
            sampling["seed"] = i
        jobs.append({"job_id": f"{run}-{i:06d}", "prompt": f"Chaos job {i}: tell me about item {i % 97}",
                     "sampling": sampling, "stream": i % 10 == 0})
    return jobs


# The fields of an ok Result that come from the model: a duplicate must repeat them exactly.
ANSWER_FIELDS = ("token_ids", "text", "finish_reason", "logprobs", "prompt_logprobs", "prompt_logprob_sum",
                 "is_greedy", "choices")


def answer_of(result: dict) -> str:
    """The model's part of an ok Result, as canonical JSON (floats keep every bit: JSON writes the
    shortest text that reads back as the same double)."""
    return json.dumps({k: result.get(k) for k in ANSWER_FIELDS}, sort_keys=True)


@dataclass
class Ledger:
    bootstrap: str
    topics: ChaosTopics
    produced: list[str] = field(default_factory=list)
    results: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)  # job_id -> (status, worker, at)
    answers: dict[str, list[str]] = field(default_factory=dict)  # job_id -> answer_of each ok, untruncated Result
    _arrivals: list[float] = field(default_factory=list)

    async def produce(self, jobs: list[dict], over_s: float = 0.0) -> None:
        """Send the jobs (evenly over over_s seconds) and wait for every acknowledgement."""
        producer = paced(AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                          linger_ms=5))
        await producer.start()
        try:
            t0, batch = time.monotonic(), max(1, len(jobs) // max(1, int(over_s * 4)))
            for start in range(0, len(jobs), batch):
                if over_s:
                    await asyncio.sleep(max(0.0, t0 + over_s * start / len(jobs) - time.monotonic()))
                chunk = jobs[start:start + batch]
                futures = [await producer.send(self.topics.jobs, json.dumps(j).encode(), key=j["job_id"].encode())
                           for j in chunk]
                await asyncio.gather(*futures)
                self.produced.extend(j["job_id"] for j in chunk)
        finally:
            await producer.stop()

    async def follow(self) -> None:
        """Read Results until cancelled."""
        consumer = paced(AIOKafkaConsumer(self.topics.results, bootstrap_servers=self.bootstrap, group_id=None,
                                          auto_offset_reset="earliest", enable_auto_commit=False))
        await consumer.start()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=200)
                now = time.monotonic()
                for records in batches.values():
                    for rec in records:
                        res = json.loads(rec.value)
                        self.results.setdefault(res["job_id"], []).append((res["status"], res.get("worker", ""), now))
                        if res["status"] == "ok" and not res.get("truncated"):
                            self.answers.setdefault(res["job_id"], []).append(answer_of(res))
                        self._arrivals.append(now)
        finally:
            await consumer.stop()

    def answered(self) -> int:
        return sum(1 for j in self.produced if j in self.results)

    def lost(self) -> list[str]:
        return [j for j in self.produced if j not in self.results]

    def duplicated(self) -> int:
        return sum(len(v) - 1 for v in self.results.values())

    def duplicate_answers(self) -> tuple[int, list[str]]:
        """(jobs answered ok more than once, those of them whose ok Results are not all the same)."""
        repeated = [job for job, answers in self.answers.items() if len(answers) > 1]
        differing = [job for job in repeated if len(set(self.answers[job])) > 1]
        return len(repeated), differing

    def not_ok(self) -> int:
        return sum(1 for v in self.results.values() if any(status != "ok" for status, _, _ in v))

    def first_result_after(self, t: float) -> float | None:
        return next((a for a in self._arrivals if a >= t), None)

    def all_answered_at(self) -> float | None:
        """When the last job got its first Result (None while one has none)."""
        if not self.produced or self.lost():
            return None
        return max(self.results[j][0][2] for j in self.produced)

    async def commit_lag(self) -> int:
        """Records of the jobs topic past the group's committed offsets, all partitions."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.topics.group,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topics.jobs, p) for p in range(self.topics.partitions)]
            ends = await consumer.end_offsets(tps)
            lag = 0
            for tp in tps:
                committed = await consumer.committed(tp)
                lag += ends[tp] - (committed or 0)
            return lag
        finally:
            await consumer.stop()

    async def wait_drained(self, timeout_s: float) -> bool:
        """Until every job has a Result and the commit lag is 0 (True), or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.lost():
                try:
                    if await self.commit_lag() == 0:
                        return True
                except Exception:  # the broker not answering yet: try again
                    pass
            await asyncio.sleep(0.5)
        return False
