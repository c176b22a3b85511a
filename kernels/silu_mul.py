"""SiLU-and-mul, the gated MLP activation of Llama/Qwen: silu(gate) * up, from one fused projection.

Input [..., 2 * I] holds gate then up (as a merged gate_up projection produces them); output [..., I].
Computed in fp32, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"last axis must hold gate and up halves; got odd size {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError("the last axis must be contiguous")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, num_warps=4
        )
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
