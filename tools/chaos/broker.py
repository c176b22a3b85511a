"""The broker a chaos scenario runs against: a local one it starts itself, or one it is given.

Only a broker the scenario started can be stopped and started again (`broker-restart`,
`outage`): it keeps its data directory and ports, so the workers' bootstrap address stays valid
and the topics, records and committed offsets survive the restart.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tokenmill.kafka.local_broker import LocalKafka, LocalKafkaError, free_port


class Broker:
    def __init__(self, bootstrap: str, local: LocalKafka | None = None, owned: bool = False) -> None:
        self.bootstrap = bootstrap
        self.local = local  # None: a broker given by address, which a scenario cannot stop
        self.owned = owned  # started here: stopped for good by close()

    @property
    def can_restart(self) -> bool:
        return self.local is not None

    @classmethod
    def given(cls, bootstrap: str) -> Broker:
        return cls(bootstrap)

    @classmethod
    async def start_local(cls, data_dir: Path, timeout_s: float = 180.0) -> Broker:
        """A single-node broker on free ports, stopped by itself if this process dies."""
        for attempt in range(3):
            port = free_port()
            controller_port = free_port()
            while controller_port == port:
                controller_port = free_port()
            local = LocalKafka(port=port, data_dir=data_dir / f"kafka-{attempt}", controller_port=controller_port)
            try:
                await asyncio.to_thread(local.start, timeout_s, os.getpid(), False)
                return cls(local.bootstrap, local, owned=True)
            except LocalKafkaError as exc:  # a free port taken by someone else before the JVM bound it
                if attempt == 2 or "already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    async def stop(self, timeout_s: float = 60.0) -> None:
        if self.local is None:
            raise RuntimeError("this broker was given by address; only a broker started here can be stopped")
        await asyncio.to_thread(self.local.stop, timeout_s)

    async def start(self, timeout_s: float = 180.0) -> None:
        if self.local is None:
            raise RuntimeError("this broker was given by address; only a broker started here can be started")
        await asyncio.to_thread(self.local.start, timeout_s, os.getpid(), False)

    async def close(self) -> None:
        if self.owned and self.local is not None:
            await asyncio.to_thread(self.local.stop, 30.0)
