"""What every section gets (a Context), and run_section: one section run, its failure caught.

A section is a function ``Context -> dict`` of its numbers; ``ok`` defaults to True, and a
section may set it False to report failed checks without raising. run_section adds ``seconds``,
turns an exception into ``ok: False`` with its error and traceback, and frees what the section
left on the device, so the next section gets the GPU's memory.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.tools.gpu_check.checkpoints import build_checkpoint
from tokenmill.tools.gpu_check.copy_bandwidth import section_copy_bandwidth
from tokenmill.tools.gpu_check.sizes import Sizes


@dataclass
class Context:
    sizes: Sizes
    device: Any  # torch.device
    results: dict[str, Any] = field(default_factory=dict)  # section name -> its result, as they finish
    workdir: Path | None = None
    _model_dir: Path | None = None

    def model_dir(self) -> Path:
        """A random-weight checkpoint of the configured shape, built once per run."""
        if self._model_dir is None:
            self._model_dir = build_checkpoint(self.sizes.model_shape, self.sizes.model_dtype, self.device,
                                               self.workdir / "model")
        return self._model_dir

    def copy_bandwidth(self) -> float:
        """Bytes per second (read + written) of a device-to-device copy; measured on first use."""
        if "copy_bandwidth" not in self.results or not self.results["copy_bandwidth"].get("ok"):
            self.results["copy_bandwidth"] = run_section("copy_bandwidth", section_copy_bandwidth, self)
        return self.results["copy_bandwidth"]["bytes_per_s"]


def run_section(name: str, fn: Callable[[Context], dict], ctx: Context) -> dict:
    t0 = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        result = fn(ctx)
        result.setdefault("ok", True)
    except Exception as exc:  # report and go on: the other sections' numbers still count
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    release_memory(ctx.device)
    print(f"[gpu_check] {name}: {'ok' if result['ok'] else 'FAILED ' + result.get('error', 'failed checks')} "
          f"({result['seconds']} s)",
          flush=True)
    return result


def release_memory(device) -> None:
    """Drop what a finished section left behind, so the next one gets the GPU's memory."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
