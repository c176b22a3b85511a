"""Which CPU path each part of a float32 CPU step takes: decided once, from the engine's settings and
this machine, and handed to the model and the attention backend.

Every kernel of this package is a path that a step may take instead of plain torch, where it can run
here (a C compiler, the CPU's instructions, a self-check at first use) and where the engine's settings
let it. Those settings are EngineConfig fields (tokenmill.engine.config), one per path, each "auto"
(take it where it can run; for `onednn_layers`, by the model's width), "on" (take it, and refuse to
start where it cannot run) or "off" (plain torch, or the next path down). `resolve_cpu_paths` turns
them into one frozen CpuPaths at engine start: the model and the backend read its booleans, so a
step never asks a setting, the environment or a library again.

The paths and what they need:
- amx_gemm: the layers' float32 projections on the AMX split-bfloat16 kernel (amx_gemm.py): a CPU
  with AMX tiles whose kernel grants them, a compiler that knows them, the kernel's self-check.
- onednn_linear: the LM head (and the layers' projections where oneDNN takes them) on oneDNN with
  the weight packed once (gemm.py): torch built with oneDNN.
- onednn_layers: the layers' projections on oneDNN (gemm.py) where the AMX kernel does not take them;
  "auto" from LAYERS_MIN_HIDDEN on, "on" at any width, "off" on MKL's F.linear.
- greedy_screen: plain greedy rows through a bfloat16 screen of the LM head (greedy_screen.py):
  oneDNN's bfloat16 GEMM (avx512_bf16), the LM head on oneDNN, a C compiler.
- cpu_elementwise: add + RMSNorm, the rotary and the K/V write as one C pass each (elementwise.py).
- cpu_sampling: the sampler's logprob parts and its draws at a temperature with top_p in C
  (row_logprobs.py, row_sample.py): a C compiler.
- cpu_attention_kernel: decode rows and short prefill rows through the C decode attention read in
  place from the paged cache (decode_attention.py). With amx_gemm too, long prefill rows attend on
  the AMX tiles (amx_prefill_attention.py; it has no setting of its own).
- decode_layers_in_c: a pure decode step's layers in one C call (decode_layers.py): the AMX GEMM,
  the C element-wise kernels and the C decode attention all taken.
- batch_invariant: every token's arithmetic independent of the batch (docs/engine.md, "Batch
  invariance"): the projections on the AMX kernel or else the fixed-order GEMM (invariant_gemm.py),
  the LM head on the fixed-order GEMM, every token's attention through the C decode kernel
  (prefill tokens too, at any length: no SDPA, no AMX prefill), SiLU x mul with the GEMM's fixed
  exp. Needs a C compiler (the GEMM's self-check passing) and the C attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

from tokenmill.kernels.cpu import (
    amx_gemm,
    amx_prefill_attention,
    decode_attention,
    decode_layers,
    elementwise,
    gemm,
    greedy_screen,
    invariant_gemm,
    row_logprobs,
    row_sample,
)

# The EngineConfig fields that choose a path, and their choices (a test holds the two equal).
SETTINGS = ("amx_gemm", "onednn_linear", "onednn_layers", "greedy_screen", "cpu_elementwise", "cpu_sampling",
            "cpu_attention_kernel", "decode_layers_in_c", "batch_invariant")
CHOICES = ("auto", "on", "off")

# The smallest hidden size whose layer projections run on oneDNN by default. At tiny-llama's shapes
# (hidden 256, intermediate 688) oneDNN gained nothing once padded to a few row counts, and MKL's
# F.linear is transformers' own bits; from SmolLM2's (hidden 576) it is 1.06-1.32x MKL (gemm.py).
LAYERS_MIN_HIDDEN = 512


class PathSettings(Protocol):
    """The settings resolve_cpu_paths reads: EngineConfig has them as fields."""

    amx_gemm: str
    onednn_linear: str
    onednn_layers: str
    greedy_screen: str
    cpu_elementwise: str
    cpu_sampling: str
    cpu_attention_kernel: str
    decode_layers_in_c: str
    batch_invariant: str


@dataclass(frozen=True)
class CpuPaths:
    """The resolved choices: True where that path runs. The default, every path off, is plain torch
    (what a CUDA engine hands its model: none of these kernels takes a device tensor)."""

    amx_gemm: bool = False  # the layers' projections on the AMX split kernel
    onednn_linear: bool = False  # the LM head on oneDNN's packed weight (the layers where layer_gemm says)
    onednn_layers: bool | None = None  # the layers on oneDNN without AMX: None by width, else forced
    greedy_screen: bool = False  # plain greedy rows through the bfloat16 screen
    elementwise: bool = False  # add + RMSNorm, rotary, K/V write as one C pass each
    sampling: bool = False  # the sampler's logprobs and temperature / top_p draws in C
    decode_attention: bool = False  # decode and short prefill rows through the C kernel
    amx_prefill_attention: bool = False  # long prefill rows on the AMX tiles
    decode_layers_in_c: bool = False  # a pure decode step's layers in one C call
    batch_invariant: bool = False  # every token's bits independent of the batch (the paths below follow)

    def layer_gemm(self, hidden_size: int) -> str:
        """Which GEMM a float32 CPU model's layer projections use: "amx", "onednn" or "mkl".

        With the AMX kernel every size takes it: it is faster than both others at every shape
        measured, and its logits are closer to float64's than MKL's, with the same bits at any batch
        size (MKL's change with the row count). tiny-llama's `mixed` set has a step whose top two
        logits are 3.8e-7 apart in float64: MKL inside a batch picked the other one, the AMX kernel
        the right one, as transformers and vLLM do. Without it, a batch-invariant engine takes the
        fixed-order kernel ("invariant", invariant_gemm.py); otherwise the width rule (or
        `onednn_layers`) picks oneDNN or MKL."""
        if self.amx_gemm:
            return "amx"
        if self.batch_invariant:
            return "invariant"
        wanted = hidden_size >= LAYERS_MIN_HIDDEN if self.onednn_layers is None else self.onednn_layers
        return "onednn" if wanted and self.onednn_linear else "mkl"

    def lm_head_gemm(self) -> str:
        """Which GEMM a float32 CPU model's LM head uses: "invariant" (a batch-invariant engine), "onednn"
        or "mkl" (F.linear, or its transposed copy from 4 rows)."""
        if self.batch_invariant:
            return "invariant"
        return "onednn" if self.onednn_linear else "mkl"


def _take(name: str, value: str, runs_here: bool, needs: str) -> bool:
    """One setting's answer: off never, auto where the path runs here, on there or an error."""
    if value not in CHOICES:
        raise ValueError(f"{name} must be one of {', '.join(CHOICES)}, got {value!r}")
    if value == "off":
        return False
    if value == "on" and not runs_here:
        raise ValueError(f"{name}=on, but this machine cannot take that path: it needs {needs}")
    return runs_here


def resolve_cpu_paths(settings: PathSettings) -> CpuPaths:
    """The paths a float32 CPU engine takes under these settings on this machine (the libraries are
    built now where they are not cached). Raises ValueError for a path set "on" that cannot run here,
    naming what it needs."""

    def take(name: str, runs_here, needs: str) -> bool:
        value = getattr(settings, name)
        # Nothing is built or probed for a path set off.
        return _take(name, value, value != "off" and runs_here(), needs)

    amx = take("amx_gemm", amx_gemm.available,
               "a CPU with AMX tiles (amx_bf16, amx_tile, avx512_bf16) granted by its kernel, a C compiler "
               "that knows them, and the kernel's self-check")
    onednn = take("onednn_linear", gemm.available, "torch built with oneDNN")
    layers = settings.onednn_layers
    _take("onednn_layers", layers, onednn, "oneDNN (onednn_linear not off, torch built with oneDNN)")
    c_elementwise = take("cpu_elementwise", elementwise.available, "a C compiler")
    c_sampling = take("cpu_sampling", lambda: row_logprobs.available() and row_sample.available(), "a C compiler")
    attention = take("cpu_attention_kernel", decode_attention.available, "a C compiler")
    screen = take("greedy_screen", lambda: onednn and greedy_screen.available(),
                  "oneDNN with a bfloat16 GEMM on this CPU (avx512_bf16), onednn_linear not off, "
                  "and a C compiler")
    # Attention in a fixed order: the torch backend (the CPU default) through the C kernel, or the Triton
    # backend (on a CPU, under the interpreter: tests), whose batch-invariant launches cut keys at fixed
    # multiples (kernels/paged_attention.py).
    triton_attention = getattr(settings, "attention_backend", "auto") == "triton"
    invariant = take("batch_invariant", lambda: (attention or triton_attention) and invariant_gemm.available(),
                     "a C compiler (the fixed-order GEMM, with its self-check passing) and the C attention "
                     "kernel (cpu_attention_kernel not off) or the Triton attention backend")
    in_c = take("decode_layers_in_c",
                lambda: amx and c_elementwise and attention and decode_layers.available(),
                "amx_gemm, cpu_elementwise and cpu_attention_kernel all taken, and a C compiler")
    return CpuPaths(
        amx_gemm=amx,
        onednn_linear=onednn,
        onednn_layers=None if layers == "auto" else layers == "on",
        greedy_screen=screen,
        elementwise=c_elementwise,
        sampling=c_sampling,
        decode_attention=attention,
        # Prefill rows on the tiles would attend in another order than the same tokens decoded.
        amx_prefill_attention=amx and attention and not invariant and amx_prefill_attention.available(),
        decode_layers_in_c=in_c,
        batch_invariant=invariant,
    )


@functools.cache
def default_cpu_paths() -> CpuPaths:
    """Every path where it can run here (each setting's default, "auto"), resolved once per process:
    for a model or an attention backend built without an engine (tests, tools)."""
    return resolve_cpu_paths(SimpleNamespace(**dict.fromkeys(SETTINGS, "auto")))
