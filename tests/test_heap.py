"""engine/heap.py: the start-up heap frozen out of the collector's full passes, garbage collected
first, and handed back by thaw()."""

from __future__ import annotations

import gc
import weakref

from tokenmill.engine.heap import freeze_startup_heap, thaw


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_collects_the_garbage_first_then_freezes_what_is_alive_and_thaw_gives_it_back():
    garbage, kept = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap()
        assert dead() is None, "cyclic garbage is collected, not frozen"
        assert frozen == gc.get_freeze_count() > 0
        alive = weakref.ref(kept)
        del kept
        gc.collect()
        assert alive() is not None, "a frozen cycle is out of the collector's reach"
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None, "after thaw() the collector frees it"


def test_the_worker_freezes_the_heap_once_its_own_model_is_loaded(tiny_llama_dir):
    """`tokenmill worker` loads its model, then freezes: its log says how many objects."""
    import asyncio

    from tokenmill.config import WorkerSettings
    from tokenmill.engine import EngineConfig
    from tokenmill.kafka.worker import KafkaWorker

    settings = WorkerSettings(bootstrap_servers="localhost:1",
                              engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    worker = KafkaWorker(settings)
    try:
        asyncio.run(worker._load_model())
        assert gc.get_freeze_count() > 10_000
    finally:
        thaw()
