"""The local backend: an engine in this process, driven by tokenmill.offline.OfflineRunner (the
driver `run-batch` uses too). No Kafka; the same Jobs and the same Results as a worker's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.tools.backfill.backend import Backend
from tokenmill.tools.backfill.config import BackfillConfig
from tokenmill.tools.backfill.identity import fingerprint
from tokenmill.tools.backfill.rows import WORKER_NAME

if TYPE_CHECKING:
    from tokenmill.offline import OfflineRunner
    from tokenmill.schemas import Job
    from tokenmill.tools.backfill.store import ResultStore


def model_identity(local_dir: Path) -> str:
    """What makes a local checkpoint itself: its config and its weight files' names and sizes."""
    parts = {"config": (local_dir / "config.json").read_text() if (local_dir / "config.json").exists() else None}
    parts["files"] = sorted(
        (p.name, p.stat().st_size) for p in local_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".json")
    )
    return fingerprint(parts)


class LocalBackend(Backend):
    def __init__(self, cfg: BackfillConfig):
        super().__init__()
        if not cfg.model_path:
            raise ValueError("--engine local needs --model (a checkpoint folder or s3:// prefix)")
        self.cfg = cfg
        self.local_dir: Path | None = None
        self.runner: OfflineRunner[None] | None = None

    async def start(self, store: ResultStore) -> str:
        from tokenmill.storage import resolve_model_path

        self.local_dir = resolve_model_path(self.cfg.model_path)
        self.model_name = self.cfg.engine_options.get("served_model_name") or self.local_dir.name
        self.store = store
        return model_identity(self.local_dir)

    def _runner(self) -> OfflineRunner[None]:
        """The engine, loaded on first use: a rerun with nothing left to do never loads the model."""
        if self.runner is None:
            from tokenmill.engine import EngineConfig, create_engine
            from tokenmill.offline import OfflineRunner

            options = {**self.cfg.engine_options, "served_model_name": self.model_name}
            engine = create_engine(EngineConfig(model=str(self.local_dir), **options))
            self.runner = OfflineRunner(engine, worker=WORKER_NAME, max_in_flight=self.cfg.max_in_flight)
        return self.runner

    async def submit(self, jobs: list[Job]) -> None:
        runner = self._runner()
        for job in jobs:
            refused = runner.add(job, None)
            if refused is not None:  # the engine refuses the request: that row's result is an error
                self.record([refused.model_dump(mode="json", exclude_none=True)])
            while runner.full:
                self._step(runner)

    def _step(self, runner: OfflineRunner[None]) -> None:
        finished = [result.model_dump(mode="json", exclude_none=True) for _, result in runner.step()]
        if finished:
            self.record(finished)

    async def wait_done(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.runner is not None and self.runner.in_flight:
            if deadline is not None and time.monotonic() > deadline:
                return
            self._step(self.runner)

    async def close(self) -> None:
        self.runner = None
