"""Fused RMSNorm, optionally with the residual add folded in (one read, one write per row).

Matches Hugging Face Llama/Qwen numerics: the sum x + residual is rounded to the model dtype (the
residual stream is kept in that dtype), the mean square is taken in fp32, the normalised row is
rounded to the model dtype and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the hidden axis must be contiguous")
    return t.reshape(-1, t.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight, or with residual: (RMSNorm(x + residual) * weight, x + residual).

    Works on any leading shape; the last axis is normalised. The output dtype is the weight's
    dtype promoted with x's (as in the Hugging Face modules).
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    x2 = _rows(x, "x")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual, "residual")
        new_residual = torch.empty_like(x)
        nr2 = new_residual.view(-1, hidden)
    else:
        r2 = nr2 = x2  # unused
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, out2, nr2,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, new_residual)


def rms_norm_ref(x, weight, eps, residual=None):
    """Plain-torch reference with the same rounding points."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(torch.promote_types(x.dtype, weight.dtype))
    return out if residual is None else (out, x)
