"""One decoder-only transformer for Llama, Qwen2 and Qwen3 checkpoints.

The three differ only in flags of ModelConfig: Qwen2 has q/k/v biases, Qwen3 RMS-normalises q and k per
head before the rotary embedding (and states head_dim explicitly), Llama may tie lm_head to the input
embedding. Everything else (GQA, SwiGLU MLP, pre-norm residual blocks, neox rotary) is shared.

Speed notes: the step's tokens of all sequences are packed into one [T, hidden] tensor, so every
projection is one matmul over the whole step; q/k/v and gate/up are fused into single weights at load
time (two matmuls per layer fewer); the residual add is folded into the next norm's input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine.attention import AttentionBackend, AttentionMetadata, OutputRows
from tokenmill.engine.layers import RotaryEmbedding, rms_norm
from tokenmill.engine.model_config import CheckpointError, ModelConfig
from tokenmill.engine.models.ops import RopeInputs, TorchOps, TritonOps, make_ops
from tokenmill.kernels.cpu import gemm, invariant_gemm
from tokenmill.kernels.cpu.decode_layers import DecodeLayers
from tokenmill.kernels.cpu.greedy_screen import AllowedIds, GreedyScreen
from tokenmill.kernels.cpu.paths import CpuPaths, default_cpu_paths

if TYPE_CHECKING:
    from tokenmill.engine.sampler import LogitEdits


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten from the checkpoint, and the loader
    # checks that every parameter was.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        dt, h, d = cfg.dtype, cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.input_norm = _param(h, dtype=dt, device=device)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h, dtype=dt, device=device)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dt, device=device) if cfg.qkv_bias else None
        # Qwen3: one weight row per q head then per k head, so q and k are normalised in one call.
        self.qk_norm = _param(cfg.num_heads + cfg.num_kv_heads, d, dtype=dt, device=device) if cfg.qk_norm else None
        self.o_weight = _param(h, self.q_size, dtype=dt, device=device)
        self.o_bias = _param(h, dtype=dt, device=device) if cfg.o_bias else None
        self.post_attention_norm = _param(h, dtype=dt, device=device)
        self.gate_up_weight = _param(2 * cfg.intermediate_size, h, dtype=dt, device=device)
        self.down_weight = _param(h, cfg.intermediate_size, dtype=dt, device=device)
        # oneDNN copies of the projections, where pack_projections() chose them (kernels/cpu/gemm.py).
        self._packed: dict[str, gemm.PackedWeight] | None = None

    _PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def pack_projections(self, kind: str = "onednn", packed: Mapping[str, torch.Tensor] | None = None) -> None:
        """Run the four projections on oneDNN, the AMX kernel or the batch-invariant one ("onednn" / "amx" /
        "invariant", kernels/cpu/gemm.py) from now on, each weight packed now, not in a step (`packed`:
        oneDNN copies made before, by projection name, taken as they are)."""
        packed = packed or {}
        self._packed = {name: gemm.PackedWeight(getattr(self, name), kind, packed.get(name))
                        for name in self._PROJECTIONS}
        for weight in self._packed.values():
            weight.packed()

    def onednn_packed(self) -> dict[str, torch.Tensor]:
        """The projections' oneDNN copies by name (what pack_projections takes back), if on oneDNN."""
        if self._packed is None:
            return {}
        return {name: w.packed() for name, w in self._packed.items() if w.kind == "onednn" and w.packed() is not None}

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, getattr(self, name), bias)
        return self._packed[name].linear(x, bias)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        ops: TorchOps | TritonOps,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """output_rows: compute only these rows past the K/V write (the last layer; see OutputRows)."""
        x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        x = self._attention(x, rope, meta, kv_cache, backend, ops, output_rows)
        if output_rows is not None:
            if x.shape[0] == 0:  # no token samples: the K/V write was all this layer owed
                return x, x
            residual = residual.index_select(0, output_rows.index)
        x, residual = ops.add_rms_norm(x, residual, self.post_attention_norm, self.eps)
        return self._mlp(x, ops), residual

    def _mlp(self, x: torch.Tensor, ops: TorchOps | TritonOps) -> torch.Tensor:
        gate_up = self._linear(x, "gate_up_weight")
        if self._packed is not None and self._packed["down_weight"].folds_silu_mul:
            # SiLU x mul folded into the down projection (kernels/cpu/amx_gemm.py, invariant_gemm.py).
            return self._packed["down_weight"].packed().linear_silu_mul(gate_up)
        return self._linear(ops.silu_and_mul(gate_up), "down_weight")

    def _attention(self, x, rope, meta, kv_cache, backend, ops, output_rows=None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self._linear(x, "qkv_weight", self.qkv_bias)
        key_cache, value_cache = kv_cache
        q = None
        if self.qk_norm is None and getattr(backend, "kv_write_is_plain_copy", False):
            # The rotary and the K/V write in one pass over qkv where the ops have one (the CPU).
            q = ops.rotary_write_kv(rope, qkv, self.num_heads, self.num_kv_heads, key_cache, value_cache,
                                    meta.slot_mapping)
        if q is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.qk_norm is not None:
                qk = rms_norm(qk, self.qk_norm, self.eps)
            q, k = ops.rotary_qk(rope, qk[:, : self.num_heads], qk[:, self.num_heads :])
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if output_rows is not None:
            # Every token's K/V is in the cache now; only the output rows need the rest.
            q, meta = q.index_select(0, output_rows.index), output_rows.meta
            t = q.shape[0]
            if t == 0:
                return x.new_empty(0, x.shape[1])
        out = backend.attend(q, key_cache, value_cache, meta, self.scale)
        return self._linear(out.reshape(t, self.q_size), "o_weight", self.o_bias)


class DecoderForCausalLM(nn.Module):
    """model(input_ids[T], positions[T], meta, kv_caches) -> hidden [T, hidden_size]."""

    def __init__(self, cfg: ModelConfig, attention_backend: AttentionBackend, device: torch.device | str = "cpu",
                 layer_ops: str = "auto", cpu_paths: CpuPaths | None = None):
        """layer_ops: "auto" (fused Triton kernels on CUDA, torch elsewhere), "torch" or "triton".
        cpu_paths: the CPU kernels a float32 CPU model takes (default on the CPU: every one that runs
        here; elsewhere none)."""
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.attention_backend = attention_backend
        if cpu_paths is None:
            cpu_paths = default_cpu_paths() if device.type == "cpu" else CpuPaths()
        self.cpu_paths = cpu_paths
        dt = cfg.dtype
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dt, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dt, device=device)
        self.lm_head = (
            self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dt, device=device)
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_model_len, device)
        self.ops = make_ops(layer_ops, self.rotary, cfg.max_model_len, device, c_elementwise=cpu_paths.elementwise)
        # A pure decode step's layers in one C call, where pack_for_cpu() finds that they can be.
        self._decode_layers: DecodeLayers | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden], or [len(output_rows.index), hidden] for those rows only.

        With output_rows the last layer stops at its K/V write for every other token: in a prefill
        step that skips most of one layer's attention, output projection and MLP.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV cache pairs for {len(self.layers)} layers")
        hidden = F.embedding(input_ids, self.embed_tokens)
        rope = self.ops.rope_inputs(positions, self.config.dtype)
        driven = None
        if output_rows is None and self._decode_layers is not None:  # a pure decode step, maybe
            driven = self._decode_layers.run(hidden, rope.cos, rope.sin, meta, kv_caches, self.attention_backend)
        if driven is not None:
            hidden, residual = driven
        else:
            residual = None
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                rows = output_rows if i == last else None
                hidden, residual = layer(hidden, residual, rope, meta, kv_cache, self.attention_backend, self.ops, rows)
        if hidden.shape[0] == 0:
            return hidden
        return self.ops.add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)[0]

    def pack_for_cpu(self, packed: Mapping[str, torch.Tensor] | None = None) -> None:
        """On a float32 CPU model, take the CPU paths of self.cpu_paths now, not in the first step: the
        LM head packed for oneDNN (kernels/cpu/gemm.py), or for the fixed-order kernel of a batch-invariant
        engine (kernels/cpu/invariant_gemm.py), and its greedy screen built
        (kernels/cpu/greedy_screen.py); the layers' projections on the AMX kernel, the fixed-order one,
        oneDNN or MKL (CpuPaths.layer_gemm); with every projection on the AMX kernel, a pure decode step's layers in
        one C call (kernels/cpu/decode_layers.py). `packed`: oneDNN copies of the weights as they are
        now, made before (engine/prepared_weights.py), by the names onednn_packed() gives; the others
        are packed now."""
        if self.lm_head.device.type != "cpu" or self.lm_head.dtype != torch.float32:
            return
        packed = packed or {}
        self._lm_head_packed(packed.get("lm_head"))
        self._lm_head_invariant()
        self._greedy_screen()
        kind = self.cpu_paths.layer_gemm(self.config.hidden_size)
        if kind != "mkl":
            for i, layer in enumerate(self.layers):
                prefix = f"layers.{i}."
                layer.pack_projections(kind, {n[len(prefix):]: w for n, w in packed.items() if n.startswith(prefix)})
        if isinstance(self.ops, TorchOps) and self.cpu_paths.decode_layers_in_c:
            self._decode_layers = DecodeLayers.for_model(self.layers)

    @torch.inference_mode()
    def greedy_ids(self, hidden: torch.Tensor, allowed: AllowedIds | None = None,
                   edits_for: Callable[[int], LogitEdits | None] | None = None) -> torch.Tensor | None:
        """int64 [N]: the argmax of compute_logits(hidden) row by row (over the ids a constraint
        allows, `allowed`: see greedy_screen.AllowedIds, and after the penalties and min_tokens
        blocks that `edits_for(vocab)` gives, asked only where the screen runs), the same tokens,
        without the full float32 LM head (CPU float32 only); None where the screen does not apply,
        for the caller to compute the logits."""
        if hidden.device.type != "cpu" or self.lm_head.dtype != torch.float32:
            return None
        screen = self._greedy_screen()
        if screen is None:
            return None
        return screen.greedy_ids(hidden, allowed, None if edits_for is None else edits_for(screen.vocab))

    def _greedy_screen(self) -> GreedyScreen | None:
        if not self.cpu_paths.greedy_screen:
            return None
        invariant = self._lm_head_invariant()
        if invariant is not None:  # its candidates scored as the fixed-order head scores them
            return self._lm_head_copy("_lm_head_screen", lambda w: GreedyScreen.build(w, None, invariant.linear))
        packed = self._lm_head_packed()
        return self._lm_head_copy("_lm_head_screen", lambda w: GreedyScreen.build(w, packed))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, vocab_size] logits; pass only the rows that sample (the LM head dominates cost).

        out: optional float32 [N, vocab_size] contiguous buffer to write into (CPU fast path only; the
        result may still be a new tensor, so always use the return value).
        """
        if hidden.device.type == "cpu" and self.lm_head.dtype == torch.float32:
            invariant = self._lm_head_invariant()
            if invariant is not None:
                return invariant.linear(hidden, out=out)
            packed = self._lm_head_packed()
            if packed is not None:
                return gemm.linear(hidden, self.lm_head, None, packed)
            self._lm_head_transposed()  # built on the first call (e.g. a warm-up), not in a big step
        if self._use_transposed_lm_head(hidden):
            # Without oneDNN: on the CPU the LM head is about half of a decode step's FLOPs. A
            # [hidden, vocab] copy of the weight lets the GEMM stream it without a transpose, and
            # writing into a reused buffer avoids a fresh >32 MiB tensor every step: ~10% faster GEMM
            # plus the faults. From 4 rows up this gives the same bits as F.linear (below that BLAS
            # takes a GEMV path whose summation order differs).
            weight_t = self._lm_head_transposed()
            if out is not None and out.shape == (hidden.shape[0], weight_t.shape[1]) and out.dtype == hidden.dtype \
                    and out.is_contiguous():
                return torch.mm(hidden, weight_t, out=out)
            return torch.mm(hidden, weight_t)
        return F.linear(hidden, self.lm_head).float()

    # Fewer rows than this go through F.linear (see compute_logits). From 4 rows the transposed
    # GEMM is also faster: 1.4-1.8x at 4-15 rows (tiny-llama's LM head, one core), the tail of a batch.
    _TRANSPOSED_LM_HEAD_MIN_ROWS = 4

    def _use_transposed_lm_head(self, hidden: torch.Tensor) -> bool:
        return (
            hidden.device.type == "cpu" and hidden.dtype == torch.float32 and self.lm_head.dtype == torch.float32
            and hidden.dim() == 2 and hidden.shape[0] >= self._TRANSPOSED_LM_HEAD_MIN_ROWS
        )

    def _lm_head_copy(self, attr: str, build) -> torch.Tensor | None:
        """A copy of lm_head derived by `build`, cached and rebuilt if the weight was changed (reload)."""
        key = (self.lm_head.data_ptr(), self.lm_head._version)
        cached = getattr(self, attr, None)
        if cached is None or cached[0] != key:
            cached = (key, build(self.lm_head.detach()))
            setattr(self, attr, cached)
        return cached[1]

    def _lm_head_packed(self, made: torch.Tensor | None = None) -> torch.Tensor | None:
        """oneDNN's packed lm_head (None without oneDNN, or where the engine keeps it off oneDNN);
        `made`: that copy made before, for the weight as it is now."""
        if self.cpu_paths.lm_head_gemm() != "onednn":
            return None
        if made is not None:
            if tuple(made.shape) != tuple(self.lm_head.shape):
                raise ValueError(f"a packed LM head of shape {tuple(made.shape)} for one of {tuple(self.lm_head.shape)}")
            self._lm_head_oned = ((self.lm_head.data_ptr(), self.lm_head._version), made)
        return self._lm_head_copy("_lm_head_oned", gemm.pack)

    def onednn_packed(self) -> dict[str, torch.Tensor]:
        """Every oneDNN-packed weight the model computes with, by name (what pack_for_cpu takes back)."""
        found = {}
        head = self._lm_head_packed()
        if head is not None:
            found["lm_head"] = head
        for i, layer in enumerate(self.layers):
            found.update({f"layers.{i}.{name}": w for name, w in layer.onednn_packed().items()})
        return found

    def _lm_head_invariant(self) -> invariant_gemm.InvariantWeight | None:
        """The LM head on the fixed-order kernel, where the engine is batch invariant (CpuPaths.lm_head_gemm)."""
        if self.cpu_paths.lm_head_gemm() != "invariant":
            return None
        return self._lm_head_copy("_lm_head_inv", invariant_gemm.InvariantWeight)

    def _lm_head_transposed(self) -> torch.Tensor:
        """A contiguous [hidden, vocab] copy of lm_head."""
        return self._lm_head_copy("_lm_head_t", lambda w: w.t().contiguous())

    # -- loading ---------------------------------------------------------------------------------
    def checkpoint_tensor_names(self) -> list[str]:
        """Hugging Face tensor names this model needs from the checkpoint."""
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if cfg.qkv_bias:
                names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if cfg.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _destination(self, name: str) -> tuple[torch.Tensor, slice | None]:
        """Where a checkpoint tensor goes: (parameter, rows of it) — rows for fused weights."""
        cfg = self.config
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm, None
        if name == "lm_head.weight":
            return self.lm_head, None
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise KeyError(name)
        index = int(parts[2])
        if index >= len(self.layers):
            raise KeyError(name)
        layer = self.layers[index]
        assert isinstance(layer, DecoderLayer)
        rest = ".".join(parts[3:])
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        h, hk = cfg.num_heads, cfg.num_kv_heads
        table: dict[str, tuple[torch.Tensor | None, slice | None]] = {
            "input_layernorm.weight": (layer.input_norm, None),
            "post_attention_layernorm.weight": (layer.post_attention_norm, None),
            "self_attn.q_proj.weight": (layer.qkv_weight, slice(0, q)),
            "self_attn.k_proj.weight": (layer.qkv_weight, slice(q, q + kv)),
            "self_attn.v_proj.weight": (layer.qkv_weight, slice(q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": (layer.qkv_bias, slice(0, q)),
            "self_attn.k_proj.bias": (layer.qkv_bias, slice(q, q + kv)),
            "self_attn.v_proj.bias": (layer.qkv_bias, slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": (layer.o_weight, None),
            "self_attn.o_proj.bias": (layer.o_bias, None),
            "self_attn.q_norm.weight": (layer.qk_norm, slice(0, h)),
            "self_attn.k_norm.weight": (layer.qk_norm, slice(h, h + hk)),
            "mlp.gate_proj.weight": (layer.gate_up_weight, slice(0, inter)),
            "mlp.up_proj.weight": (layer.gate_up_weight, slice(inter, 2 * inter)),
            "mlp.down_proj.weight": (layer.down_weight, None),
        }
        target, rows = table.get(rest, (None, None))
        if target is None:
            raise KeyError(name)
        return target, rows

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into our fused parameters; returns names used.

        Raises CheckpointError for a tensor we have no place for or whose shape does not fit.
        """
        loaded: set[str] = set()
        for name, tensor in tensors:
            try:
                target, rows = self._destination(name)
            except KeyError:
                raise CheckpointError(f"checkpoint tensor {name!r} is not part of a {self.config.architecture} model") from None
            dest = target if rows is None else target[rows]
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # One per-head weight vector, repeated for every q (or k) head row.
                if tuple(tensor.shape) != (dest.shape[1],):
                    raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, expected ({dest.shape[1]},)")
                dest.copy_(tensor.to(dest.dtype).expand_as(dest))
            else:
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add(name)
        return loaded
