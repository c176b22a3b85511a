"""The request sets every engine bench draws from (`mixed`, `prefix`, the warm-up) and the model
names they run on. Below the benches: bench.py and each workload's own file import from here, never
the other way round.

- mixed:  256 requests, prompt 16-512 tokens, output 16-256 tokens (ignore_eos), fixed seed.
- prefix: 128 requests sharing a 512-token prefix plus 32 unique tokens, 32 output tokens each.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> Workload:
        return Workload(self.name, self.prompts[:n], self.max_tokens[:n])


def warm_up_workload() -> Workload:
    """Two short requests whose tokens share nothing with any workload: each side's warm-up
    (allocator, kernels, plans) before its timed run. New lists each call: engines may keep them."""
    return Workload("warm", [[1] * 40, [2] * 20], [4, 4])


def token_range(vocab_size: int, special: set[int]) -> list[int]:
    # Ordinary token ids only, so no request stops or changes meaning on a special token.
    lo = max(special) + 1 if special and max(special) < 1000 else 0
    return [lo, vocab_size - 1]


def mixed_workload(vocab_size: int, num_requests: int = 256, seed: int = 0, special: set[int] = frozenset()) -> Workload:
    rng = random.Random(seed)
    lo, hi = token_range(vocab_size, set(special))
    prompts, outs = [], []
    for _ in range(num_requests):
        prompts.append([rng.randint(lo, hi) for _ in range(rng.randint(16, 512))])
        outs.append(rng.randint(16, 256))
    return Workload("mixed", prompts, outs)


def prefix_workload(vocab_size: int, num_requests: int = 128, seed: int = 0, special: set[int] = frozenset()) -> Workload:
    rng = random.Random(seed + 1)
    lo, hi = token_range(vocab_size, set(special))
    shared = [rng.randint(lo, hi) for _ in range(512)]
    prompts = [shared + [rng.randint(lo, hi) for _ in range(32)] for _ in range(num_requests)]
    return Workload("prefix", prompts, [32] * num_requests)


def resolve_model(name: str) -> Path:
    """tiny-llama / smollm2 / a checkpoint directory -> a directory."""
    if name == "tiny-llama":
        from tokenmill.tools.tiny_models import cached_tiny_model

        return cached_tiny_model("tiny-llama")
    if name == "smollm2":
        from tokenmill.tools.smollm2 import cached_smollm2

        return Path(cached_smollm2())
    path = Path(name)
    if not (path / "config.json").exists():
        raise ValueError(f"--model {name!r}: not tiny-llama, smollm2 or a checkpoint directory with config.json")
    return path
