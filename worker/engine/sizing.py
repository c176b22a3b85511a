"""Where the engine runs and how big its KV cache is, decided once from EngineConfig.

- the device ("auto": CUDA when there is one);
- the decode graph mode: "on" (captured CUDA graphs), "eager" (the same padded decode path without
  capture, for tests on a CPU) or "off"; "auto" means graphs on CUDA with the triton backend;
- whether steps overlap (async scheduling; "auto": on CUDA);
- the number of KV blocks: kv_cache_gb when given; on CUDA the free memory within
  gpu_memory_fraction, less a reserve for activations and the graphs' own memory; on the CPU a fixed
  default. Without kv_cache_gb no more blocks than every sequence at full length could use;
- the engine's max_model_len: the model's, or a lower one asked for, and never more than the pool
  holds (a single sequence must always fit, or it could never finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.config import CPU_DEFAULT_KV_GB, EngineConfig
from tokenmill.engine.cuda_graphs import graph_memory_bytes
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.model_runner import ModelRunner

# Head-room kept free on CUDA for activations of the largest step, on top of the memory fraction.
CUDA_ACTIVATION_RESERVE_BYTES = 512 * 1024**2


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return dev


def resolve_graph_mode(mode: str, device: torch.device, backend_name: str) -> str:
    """EngineConfig.cuda_graphs -> the model runner's graph mode ("on", "off" or "eager")."""
    if mode == "auto":
        return "on" if device.type == "cuda" and backend_name == "triton" else "off"
    if mode == "on" and device.type != "cuda":
        raise ValueError(
            f"cuda_graphs='on' needs a CUDA device (the engine runs on {device}); "
            "'eager' runs the same padded decode path without capture"
        )
    if mode in ("on", "eager") and backend_name != "triton":
        raise ValueError(
            f"cuda_graphs={mode!r} needs the triton attention backend (it reads only device tensors), "
            f"not {backend_name!r}"
        )
    return mode


def resolve_async_scheduling(mode: str, device: torch.device) -> bool:
    return device.type == "cuda" if mode == "auto" else mode == "on"


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    bytes_per_block: int
    max_model_len: int  # the engine's: within the model's limit and what the pool holds


def size_kv_cache(config: EngineConfig, mc: ModelConfig, device: torch.device, graph_mode: str) -> KVCacheSize:
    max_len = mc.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > mc.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {mc.max_model_len}")
        max_len = config.max_model_len
    bs = config.block_size
    per_block = ModelRunner.kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, bs)
    num_blocks = _num_kv_blocks(config, device, per_block, max_len, _graph_reserve_bytes(config, mc, graph_mode))
    return KVCacheSize(num_blocks, per_block, min(max_len, num_blocks * bs))


def _graph_reserve_bytes(config: EngineConfig, mc: ModelConfig, graph_mode: str) -> int:
    """GPU memory the decode graphs will hold (0 without captured graphs)."""
    if graph_mode != "on":
        return 0
    return graph_memory_bytes(
        config.max_num_seqs, mc.vocab_size, mc.hidden_size, mc.intermediate_size or 4 * mc.hidden_size,
        torch.empty((), dtype=mc.dtype).element_size(),
    )


def _num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, max_len: int,
                   graph_reserve: int) -> int:
    if config.kv_cache_gb is not None:
        budget = config.kv_cache_gb * 1024**3
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_fraction) * total - CUDA_ACTIVATION_RESERVE_BYTES - graph_reserve
    else:
        budget = CPU_DEFAULT_KV_GB * 1024**3
    num_blocks = int(budget // bytes_per_block)
    # More than every sequence at full length could use is wasted memory.
    useful = config.max_num_seqs * -(-max_len // config.block_size) + 1
    if config.kv_cache_gb is None:
        num_blocks = min(num_blocks, useful)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 1024**3:.3f} GiB) holds no block of "
            f"{bytes_per_block} bytes; raise kv_cache_gb or gpu_memory_fraction"
        )
    return num_blocks
