"""One prepared command that measures tokenmill's GPU path and writes a JSON and a markdown report.

    tools/gpu_check/run [--out DIR] [--dry-run] [--only SECTION ...]     (or: python -m tools.gpu_check)

Sections, one module each, run in this order by `runner` (each failure is caught and reported, so
one broken part never loses the others):
  environment      versions, device name, SM count
  kernels          every kernel against its torch reference (fp32, fp16 and, on CUDA, bf16)
  fidelity         greedy tokens of the engine's GPU path (CUDA graphs + async scheduling) against
                   transformers `generate` and against the same engine with both off (fp32)
  copy_bandwidth   device-to-device copy: bytes read + written per second; the roofline's yardstick
  attention        paged-attention decode: KV bytes read per second, as a fraction of copy bandwidth
  decode_step      ~1B Llama (bf16, random weights) decode step at batch 64 and 256 vs its roofline
                   (weight + KV bytes read per step / copy bandwidth)
  mixed            the engine's `mixed` bench workload against transformers `generate` (both sides
                   from tools/bench.py)
  throughput       256 sequences, input and output lengths uniform in [100, 1024], ignore_eos, on a
                   Llama-3.2-1B-shaped model: output tokens/s and its fraction of the roofline ceiling
                   (sum over decode steps of bytes read / copy bandwidth)
  structured       the bench's `structured` workload on the same model: 256 rows constrained to 8 JSON
                   schemas against the same rows unconstrained with the same lengths (step overhead at
                   the peak batch, mask fill and compile percentiles, output validity; tools/bench_structured.py)

What the sections share: sizes (GPU and dry-run sizes, model shapes), context (the Context a
section gets, and run_section), timing, roofline (bytes a step reads, the ceiling), engine_path
(the engine's GPU path, forced on, and what it ran), checkpoints (seeded random-weight models).
report writes the markdown; runner holds the section list and main.

Runs with torch, triton, transformers and safetensors only (no Kafka, pydantic or boto3), plus
llguidance and jsonschema for the `structured` section: every heavy import is inside a function, so
importing this package loads none of them. The report goes
to --out, else $OUT, else ./gpu_check_out. --dry-run takes the same code path on the CPU at toy
sizes (Triton kernels under the interpreter) so the test suite keeps this command working.
"""

from tokenmill.tools.gpu_check.copy_bandwidth import section_copy_bandwidth
from tokenmill.tools.gpu_check.engine_path import gpu_path_options, gpu_path_report
from tokenmill.tools.gpu_check.environment import section_environment
from tokenmill.tools.gpu_check.report import headline, markdown_report
from tokenmill.tools.gpu_check.roofline import llama_param_count, roofline_ceiling
from tokenmill.tools.gpu_check.runner import SECTIONS, main
from tokenmill.tools.gpu_check.sizes import TOY_LLAMA, Sizes, dry_sizes, gpu_sizes

_headline = headline  # the name tests/test_gpu_path.py reads the report line by

__all__ = [
    "SECTIONS",
    "TOY_LLAMA",
    "Sizes",
    "dry_sizes",
    "gpu_path_options",
    "gpu_path_report",
    "gpu_sizes",
    "headline",
    "llama_param_count",
    "main",
    "markdown_report",
    "roofline_ceiling",
    "section_copy_bandwidth",
    "section_environment",
]
