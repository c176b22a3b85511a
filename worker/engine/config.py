"""EngineConfig: the one definition of every engine setting.

Each field carries its default, its bounds or choices and its help text (``setting(...)``).
The engine validates itself from that metadata, and the commands that start an engine
(``run-batch``, ``worker``, ``bench``, ``backfill``) derive their flags, defaults, choices, help
and ``TOKENMILL_*`` variables from it (``worker/cli/engine_options.py``). A new engine setting is
one ``setting(...)`` line here plus its use in the engine.

Torch-free on purpose: the worker's settings embed this dataclass, and the Kafka side and the CLI
import it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokenmill.engine.fields import problems_of, setting

# CPU has no "free accelerator memory" to take a fraction of: the KV cache gets this much.
CPU_DEFAULT_KV_GB = 2.0
# The choices of every CPU path setting (kernels/cpu/paths.py) and of the host memory ones.
CPU_PATH_CHOICES = ("auto", "on", "off")
BACKENDS = ("tokenmill", "vllm")


@dataclass
class EngineConfig:
    model: str = setting(help="checkpoint directory or s3://bucket/prefix/")
    # Which engine runs the requests: tokenmill's own, or vLLM's behind the same interface
    # (worker/engine/backends/; docs/vllm.md says which setting each backend reads).
    backend: str = setting(
        "tokenmill", choices=BACKENDS,
        help="the engine: tokenmill's own, or vLLM's (needs vLLM installed: make vllm-env; docs/vllm.md)",
    )
    vllm_args: tuple[str, ...] = setting(
        (), flag="--vllm-arg",
        help="backend vllm: one of vLLM's engine arguments as KEY=VALUE (repeatable; VALUE parsed as JSON where "
             "it parses, else a string), for what tokenmill has no setting of: tensor_parallel_size, "
             "pipeline_parallel_size, quantization, kv_cache_dtype, enable_lora, max_loras, ...; checked by "
             "vLLM's EngineArgs at start. The variable holds several, split like shell words",
    )
    dtype: str = setting("auto", help="weights and KV cache dtype",
                         choices=("auto", "float32", "bfloat16", "float16"))
    device: str = setting("auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    attention_backend: str = setting("auto", help="attention kernels", choices=("auto", "torch", "triton"))
    block_size: int = setting(16, help="KV cache block size in tokens", minimum=1)
    kv_cache_gb: float | None = setting(
        None, help=f"KV cache size (default: a fraction of free GPU memory; {CPU_DEFAULT_KV_GB:g} GiB on CPU)",
        above=0,
    )
    gpu_memory_fraction: float = setting(0.85, help="share of GPU memory the engine may use", above=0, maximum=1)
    max_num_batched_tokens: int = setting(2048, help="token budget per step", minimum=1)
    max_num_seqs: int = setting(256, help="sequences per step", minimum=1)
    max_model_len: int | None = setting(None, help="longest sequence (default: the model's)", minimum=1)
    enable_prefix_caching: bool = setting(True, help="turn the prefix cache off", flag="--no-prefix-caching",
                                          negated_flag=True)
    served_model_name: str | None = setting(None, help="model name in Results (default: directory name)")
    seed: int = setting(0, help="seed of unseeded sampling")
    # "eager" runs the same padded static-buffer path without capture (how the CPU tests it).
    cuda_graphs: str = setting(
        "auto", choices=("auto", "on", "off", "eager"),
        help="decode steps as CUDA graphs (auto: on for CUDA with the triton backend; "
             "eager: the same padded path without capture)",
    )
    # "on" forces it also on the CPU, where it runs the same code without any overlap.
    async_scheduling: str = setting("auto", choices=("auto", "on", "off"),
                                    help="prepare step N+1 while step N runs on the GPU (auto: on for CUDA)")

    cpu_threads: int | None = setting(
        None, minimum=1,
        help="torch threads of the CPU engine (default: torch's own, i.e. OMP_NUM_THREADS or the CPUs this "
             "process may use, capped at its cgroup CPU quota)",
    )

    cpu_step_parts: int | None = setting(
        None, minimum=1,
        help="parts a CPU step's model body is cut into, run side by side on threads of their own, each "
             "with its share of the torch threads (default: 2 from 2 threads under OMP_WAIT_POLICY=PASSIVE, "
             "else 1, which runs every step whole)",
    )

    # The CPU paths (kernels/cpu/paths.py), resolved once at engine start: "auto" takes a path where it
    # runs here, "on" refuses to start where it cannot, "off" keeps plain torch (or the next path down).
    amx_gemm: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: float32 layer projections on the AMX split-bfloat16 kernel, float32's accuracy (auto: where "
             "the CPU has AMX tiles; on: refuse to start without them)",
    )
    onednn_linear: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: the float32 LM head on oneDNN, its weight packed at load (auto: where torch has oneDNN; "
             "off: MKL's F.linear, also for the layers)",
    )
    onednn_layers: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU without the AMX kernel: the float32 layer projections on oneDNN (auto: from hidden size 512; "
             "on: at any size; off: MKL's F.linear, transformers' own bits)",
    )
    greedy_screen: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: greedy rows without logprobs (penalties, min_tokens and constraints included) skip the full "
             "float32 LM head, a bfloat16 screen then float32 for the few candidates, the same token (auto: where "
             "oneDNN has a bfloat16 GEMM)",
    )
    cpu_elementwise: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: add + RMSNorm, the rotary and the K/V write as one C pass each, torch's bits (auto: where a C "
             "compiler builds them)",
    )
    cpu_sampling: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: the sampler's logprobs (each row's normaliser and top-N) and its draws at a temperature with "
             "top_p in C, each row's own, the torch path's answers within float32 rounding (auto: where a C "
             "compiler builds them)",
    )
    cpu_attention_kernel: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: decode and short prefill rows attend in C, read in place from the paged KV cache (auto: where "
             "a C compiler builds it; off: torch's gather and GEMMs)",
    )
    decode_layers_in_c: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: a pure decode step's layers in one C call, the same bits (auto: where the AMX kernel, the C "
             "element-wise passes and the C attention all run)",
    )
    batch_invariant: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: a request's Result the same bits whatever it is batched with, chunked or cached, at any "
             "thread count: every token through fixed-order GEMMs and the C attention (auto: on a float32 CPU "
             "engine where a C compiler builds them; on: refuse to start where they cannot run; docs/engine.md, "
             "Batch invariance)",
    )
    huge_pages: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: tensors of 2 MiB or more on transparent huge pages, set before the model loads (auto: on Linux "
             "with them, unless THP_MEM_ALLOC_ENABLE is set)",
    )
    malloc_tuning: str = setting(
        "auto", choices=CPU_PATH_CHOICES,
        help="CPU: glibc malloc keeps freed memory mapped, so steps stop faulting their activations in again "
             "(auto: unless MALLOC_*_, GLIBC_TUNABLES or another allocator chose)",
    )

    structured_compile_timeout_s: float = setting(
        5.0, above=0, finite=True,
        help="a structured_outputs constraint not compiled within this many seconds fails its job (invalid_constraint)",
    )
    structured_compile_threads: int = setting(2, minimum=1, help="threads compiling structured_outputs constraints")

    def __post_init__(self) -> None:
        self.vllm_args = _as_items(self.vllm_args)
        problems = problems_of(self, fields(self))
        if self.backend == "vllm":
            from tokenmill.engine.backends.vllm.settings import config_problems

            problems += config_problems(self)
        elif self.vllm_args:
            problems.append("vllm_args (--vllm-arg) are read by the vllm backend only: add --backend vllm")
        if problems:
            raise ValueError("; ".join(problems))


def _as_items(value: object) -> tuple[str, ...]:
    """vllm_args as a tuple: a list from the flags, or one string (an environment variable) split like
    shell words, so that a quoted JSON value with spaces stays one item."""
    if isinstance(value, str):
        import shlex

        return tuple(shlex.split(value))
    return tuple(value)  # type: ignore[arg-type]
