"""Section `environment`: versions, device name, SM count."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.tools.gpu_check.context import Context


def section_environment(ctx: Context) -> dict:
    import torch
    import triton

    info = dict(
        python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
        device=str(ctx.device), dry_run=ctx.sizes.dry_run,
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return info
