"""tokenmill tail: Results and reassembled token streams from the real local broker."""

import asyncio
import io
import json

import pytest
from aiokafka import AIOKafkaProducer

from tokenmill.cli import main
from tokenmill.tools.tail import TokenAssembler, format_result, tail

pytestmark = pytest.mark.kafka


def _result(job_id, text="hi", status="ok", attempt="w1-a"):
    r = {"job_id": job_id, "status": status, "model": "m", "worker": "w1", "attempt": attempt,
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_prompt_tokens": 0},
         "timing": {"queue_ms": 1.0, "ttft_ms": 5.0, "decode_ms": 2.0, "total_ms": 8.0}}
    if status == "ok":
        r.update(text=text, token_ids=[1, 2], finish_reason="stop")
    else:
        r["error"] = {"code": "invalid_job", "message": "bad"}
    return r


def _event(job_id, attempt, index, text, finished=False):
    return {"job_id": job_id, "attempt": attempt, "index": index, "token_ids": [index], "text": text,
            "finished": finished}


async def _send(bootstrap, topic, values):
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for v in values:
            await producer.send_and_wait(topic, json.dumps(v).encode(), key=v["job_id"].encode())
    finally:
        await producer.stop()


def test_token_assembler_restarts_on_a_new_attempt():
    asm = TokenAssembler()
    assert asm.add(_event("a", "w1-x", 0, "Bon")).text == "Bon"
    assert asm.add(_event("b", "w1-x", 0, "Hel")).text == "Hel"
    # The worker running "a" died; another one runs it again from the start.
    u = asm.add(_event("a", "w2-y", 0, "Bo"))
    assert u.restarted and u.text == "Bo"
    assert asm.add(_event("a", "w1-x", 1, "jour")) is None  # late event of the replaced attempt
    assert asm.add(_event("a", "w2-y", 1, "n", finished=True)).text == "Bon"
    asm2 = TokenAssembler()
    asm2.add(_event("a", "w1-x", 0, "Bon"))
    done = asm2.add(_event("a", "w1-x", 1, "jour", finished=True))
    assert done.finished and done.text == "Bonjour" and done.token_ids == [0, 1]
    assert asm2.add(_event("a", "w1-x", 1, "jour", finished=True)) is None  # duplicate after finish
    assert "a" not in asm2.streams  # finished streams hold no memory
    gap = asm2.add(_event("c", "w1-z", 0, "x"))
    assert not gap.gap and asm2.add(_event("c", "w1-z", 2, "y")).gap


def test_format_result_for_people():
    text = format_result(_result("j1", "Bonjour"))
    assert "[ok] j1 'Bonjour'" in text and "ttft 5 ms" in text
    assert "[error] j2 invalid_job: bad" in format_result(_result("j2", status="error"))


def test_tail_results_json_filter_and_unique(kafka_bootstrap, new_topic, capsys):
    topic = new_topic(partitions=2)
    values = [_result("j1", "one"), _result("j2", "two"), _result("j1", "one again", attempt="w2-b"),
              _result("j3", status="error")]
    asyncio.run(_send(kafka_bootstrap, topic, values))
    base = ["tail", "--bootstrap-servers", kafka_bootstrap, "--results-topic", topic, "--from-beginning",
            "--idle-timeout", "2"]
    assert main([*base, "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted(r["job_id"] for r in lines) == ["j1", "j1", "j2", "j3"]
    assert main([*base, "--json", "--unique"]) == 0
    assert sorted(json.loads(x)["job_id"] for x in capsys.readouterr().out.splitlines()) == ["j1", "j2", "j3"]
    assert main([*base, "--job-id", "j2", "--count", "1"]) == 0
    out = capsys.readouterr().out
    assert "[ok] j2 'two'" in out and "j1" not in out


def test_tail_follows_new_results_from_the_end(kafka_bootstrap, new_topic):
    topic = new_topic()
    asyncio.run(_send(kafka_bootstrap, topic, [_result("old")]))

    async def scenario():
        ready = asyncio.Event()
        out = io.StringIO()
        task = asyncio.create_task(tail(kafka_bootstrap, results_topic=topic, as_json=True, count=2,
                                        idle_timeout=20, out=out, on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 20)
        await _send(kafka_bootstrap, topic, [_result("new1"), _result("new2")])
        assert await asyncio.wait_for(task, 30) == 2
        return [json.loads(x)["job_id"] for x in out.getvalue().splitlines()]

    assert asyncio.run(scenario()) == ["new1", "new2"]


def test_tail_tokens_reassembles_and_restarts(kafka_bootstrap, new_topic, capsys):
    topic = new_topic()
    events = [
        _event("s1", "w1-a", 0, "Bon"),
        _event("s2", "w1-a", 0, "Hello", finished=True),
        _event("s1", "w2-b", 0, "Salut"),  # a new attempt of s1: its text starts again
        _event("s1", "w2-b", 1, " toi", finished=True),
    ]
    asyncio.run(_send(kafka_bootstrap, topic, events))
    base = ["tail", "--bootstrap-servers", kafka_bootstrap, "--tokens", "--tokens-topic", topic,
            "--from-beginning", "--count", "2", "--idle-timeout", "10"]
    assert main([*base, "--json"]) == 0
    streams = {d["job_id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert streams["s1"]["text"] == "Salut toi" and streams["s1"]["attempt"] == "w2-b"
    assert streams["s2"]["text"] == "Hello"
    assert main(base) == 0
    human = capsys.readouterr().out
    assert "[s1] new attempt w2-b: text restarts" in human
    assert "[s1] finished: 'Salut toi'" in human


def test_assembler_keeps_each_choice_of_an_n_job_apart():
    from tokenmill.engine.types import RequestDelta
    from tokenmill.kafka.answers import token_event

    deltas = [RequestDelta("j", [5], "a", choice=0), RequestDelta("j", [6], "x", choice=1),
              RequestDelta("j", [7], "b", choice=0), RequestDelta("j", [8], "y", choice=1, finished=True)]
    events = [json.loads(token_event("j", "w-1", i, d)) for i, d in enumerate(deltas)]
    assert [e["choice"] for e in events] == [0, 1, 0, 1]
    assert "choice" not in json.loads(token_event("k", "w-1", 0, RequestDelta("k", [1], "z")))  # n = 1: as before
    asm = TokenAssembler()
    updates = [asm.add(e) for e in events]
    assert [(u.choice, u.text) for u in updates] == [(0, "a"), (1, "x"), (0, "ab"), (1, "xy")]
    assert updates[-1].finished and updates[-1].choices == {0: ("ab", [5, 7]), 1: ("xy", [6, 8])}
