"""The CPU kernels (`tokenmill.kernels.cpu`): the paths a float32 CPU step takes instead of plain torch.

- paths.py: which path each part of a step takes (CpuPaths), resolved once from the engine's
  settings and this machine; the one interface the engine asks.
- build.py: each C source of csrc/ compiled with the system compiler on first use, cached per CPU.
- csrc/: the C sources, and the header the AMX kernels share.
- One wrapper per kernel, each with the torch path it replaces as its reference in the tests:
  amx_gemm.py (float32 GEMMs on AMX tiles), gemm.py (oneDNN GEMMs on packed weights, the layers'
  GEMM choice), elementwise.py (add + RMSNorm, rotary, K/V write), decode_attention.py (decode
  attention read from the paged cache), amx_prefill_attention.py (prefill attention on AMX tiles),
  decode_layers.py (a decode step's layers in one C call), greedy_screen.py (greedy rows without the
  full float32 LM head).

Nothing is imported here: a module that needs one kernel loads only that one.
"""
