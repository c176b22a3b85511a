"""LocalJobRunner: a JobRunner (see worker/eval/lm.py) on an Engine in this process (tokenmill's own, or
vLLM's with ``backend="vllm"`` in the EngineConfig: ``create_engine`` picks it).

The evaluation model hands it all the Jobs of one lm-eval call at once; it feeds them to the
engine through ``tokenmill.offline.OfflineRunner`` (the driver of ``run-batch`` and local backfill,
so a job runs exactly as it would there: ``job_mapping`` builds the engine request and the
Result) and returns every job's Result by job_id. The engine keeps the prefix cache on unless
the given EngineConfig turns it off, so the shared context of a question's choices is computed
once and the choices only score their own tokens.

``max_length`` is the engine's ``max_model_len``: the longest prompt a job may have. A scoring
job holds the model's input window plus the last token it predicts, so the evaluation model
scores with a window one token shorter (see ``TokenmillLM``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from tokenmill.engine.config import EngineConfig
from tokenmill.schemas import Job, Result

WORKER_NAME = "eval-local"


class LocalJobRunner:
    """Jobs in, their Results by job_id out, on an in-process Engine (loaded once, in ``__init__``).

    ``engine_config``: the engine's settings (its ``model`` field is replaced by ``model_dir``'s
    local folder; a different model there is refused). Default: the engine's defaults.
    ``progress``: a progress bar per call.
    """

    def __init__(self, model_dir: str | Path, engine_config: EngineConfig | None = None, progress: bool = False) -> None:
        from tokenmill.engine import create_engine
        from tokenmill.offline import OfflineRunner
        from tokenmill.storage import resolve_model_path

        local_dir = resolve_model_path(str(model_dir))
        if engine_config is None:
            config = EngineConfig(model=str(local_dir))
        else:
            if engine_config.model not in ("", str(model_dir), str(local_dir)):
                raise ValueError(
                    f"engine_config.model is {engine_config.model!r} but the runner was asked for {str(model_dir)!r}"
                )
            config = dataclasses.replace(engine_config, model=str(local_dir))
        self.engine = create_engine(config)
        self.offline: OfflineRunner[str] = OfflineRunner(self.engine, worker=WORKER_NAME)
        self.model_name: str = self.engine.served_model_name
        self.tokenizer = self.engine.tokenizer
        self.max_length: int = self.engine.max_model_len
        self.progress = progress

    def __call__(self, jobs: list[Job]) -> dict[str, Result]:
        """Run ``jobs`` to completion; every job gets exactly one Result (an error Result when the
        engine refuses or fails it). Job ids must be distinct within a call."""
        counts = Counter(j.job_id for j in jobs)
        dups = sorted(job_id for job_id, n in counts.items() if n > 1)
        if dups:
            raise ValueError(f"duplicate job ids in one call: {', '.join(dups[:5])}")
        if self.offline is None:
            raise RuntimeError("the runner is closed")
        while self.offline.in_flight:  # a call interrupted half-way left requests behind: finish them
            self.offline.step()
        results: dict[str, Result] = {}
        bar = None
        if self.progress and jobs:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), unit="job", desc="tokenmill")

        def take(done: list[tuple[str, Result]]) -> None:
            for job_id, result in done:
                results[job_id] = result
            if bar is not None and done:
                bar.update(len(done))

        try:
            for job in jobs:
                refused = self.offline.add(job, job.job_id)
                if refused is not None:
                    take([(job.job_id, refused)])
                while self.offline.full:
                    take(self.offline.step())
            while self.offline.in_flight:
                take(self.offline.step())
        finally:
            if bar is not None:
                bar.close()
        return results

    def close(self) -> None:
        """Let go of the engine (its weights and KV cache); the runner cannot be called after."""
        self.engine = None  # type: ignore[assignment]
        self.offline = None  # type: ignore[assignment]
