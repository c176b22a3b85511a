"""The worker's engine thread: which deltas cross to the event loop, and the new-token count."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.types import EngineRequest, SamplingParams
from tokenmill.runtime.engine_thread import EngineThread


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    return Engine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", kv_cache_gb=0.01, max_model_len=256))


def _request(rid: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[5, 7, 9, 11],
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_only_streaming_requests_get_token_deltas_and_every_new_token_is_counted(engine):
    async def run():
        loop = asyncio.get_running_loop()
        posted, tokens, done = [], [], asyncio.Event()

        def on_step(deltas, stats, new_tokens):
            posted.extend(deltas)
            tokens.append(new_tokens)
            if sum(d.finished for d in posted) == 2:
                done.set()

        thread = EngineThread(engine, loop, on_step, lambda exc, detail: done.set())
        thread.start()
        thread.submit(_request("streamed", 9), every_delta=True)
        thread.submit(_request("final", 7))
        await asyncio.wait_for(done.wait(), 60)
        thread.stop()
        return posted, sum(tokens)

    before = engine.stats().generated_tokens_total
    posted, new_tokens = asyncio.run(run())
    streamed = [d for d in posted if d.request_id == "streamed"]
    final = [d for d in posted if d.request_id == "final"]
    assert len(streamed) == 9 and streamed[-1].finished
    assert len(final) == 1 and final[0].finished and len(final[0].output_token_ids) == 7
    assert final[0].output_text == engine.tokenizer.decode(final[0].output_token_ids, skip_special_tokens=True)
    # Final-only tokens have no deltas, yet they are counted.
    assert new_tokens == 16 == engine.stats().generated_tokens_total - before
