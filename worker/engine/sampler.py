"""Batched token sampling: one call turns the logits of every sequence of a step into tokens.

Order of operations for each row (the vLLM v1 order):

0. a constraint's token mask (structured output), when the step has one: disallowed ids of the
   constrained rows become -inf, so every later operation sees only allowed tokens.
1. logprobs, when asked, are taken from the RAW model distribution (log_softmax of the logits the
   model produced), before any penalty, mask or temperature: vLLM's default ``raw_logprobs``. A
   constrained row's logprobs are of the unmasked distribution too (its top-N may name tokens
   the constraint did not allow).
2. min_tokens: while fewer than ``min_tokens`` tokens were generated, the stop token ids and (unless
   ``ignore_eos``) the EOS ids are masked to -inf, so the request cannot stop early. With
   ``ignore_eos`` the EOS token is an ordinary token and is never masked.
3. penalties: repetition_penalty (HF/vLLM: over prompt and output tokens, positive logits are divided
   and negative ones multiplied) then frequency/presence penalties (OpenAI: over output tokens,
   ``logit -= frequency * count + presence * (count > 0)``).
4. greedy rows (temperature below 1e-5, like vLLM) take the argmax; ties go to the lowest id.
5. other rows: times 1/temperature (the reciprocal rounded to float32, then one product: within a
   rounding of a division, and several times cheaper on the CPU), then min_p (drop tokens whose
   probability is below ``min_p * max probability``), then top_k (ties with the k-th logit are
   kept), then top_p (walking down the distribution, keep tokens while the mass before them is below
   top_p; ties with the last kept token are kept), then draw.

Drawing is inverse-CDF sampling in token-id order from one uniform number per row. A seeded row's
uniform is a hash of (seed, number of tokens generated so far) and nothing else, so the same request
gives the same tokens alone, in any batch, after preemption and recompute, and on any device that
produces the same probabilities. Unseeded rows take their uniforms from one engine generator.

Everything is a tensor operation over the [N, V] logits of the rows that need it; Python loops
only walk the N request descriptions to build small index tensors. An all-greedy batch without
penalties, masks or logprobs is a single argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tokenmill.engine.types import SamplingParams

# Below this temperature a row is greedy (dividing by it would overflow float32 logits); vLLM's rule.
GREEDY_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingInputs:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step index for seeding
    eos_token_ids: Sequence[int]
    # Tokens sampled in earlier steps that are not in output_token_ids yet (overlapped steps put a
    # step's tokens into the request while the next one runs; Request.add_pending and
    # resolve_pending keep this count): they count as generated.
    num_pending_tokens: int = 0
    # The prompt's distinct ids, built on first use by the repetition penalty (the prompt never changes).
    _prompt_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    # (the output list, an int64 buffer holding its ids, how many): kept by the penalties, which
    # convert only the ids appended since their last step (_output_ids_array).
    _output_ids: tuple | None = field(default=None, init=False, repr=False, compare=False)


class TokenMask(Protocol):
    """Masks the disallowed ids of some rows of a step's logits to -inf, in place (`apply`), or
    gives every row's argmax under the mask (`argmax`: greedy rows need nothing else, and on the
    CPU it costs a fraction of writing the mask; structured/constraints.py)."""

    def apply(self, logits: torch.Tensor) -> None: ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw-model logprob of token_id, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, raw logprob)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: a plain copy from pageable memory
    to CUDA blocks until the GPU has caught up, a copy from pinned memory does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), built on the host and uploaded without
    blocking (see _upload)."""
    return _upload(torch.tensor(values, dtype=dtype), torch.device(device))


def _splitmix64(x):
    """SplitMix64's output function of an int, or of each uint64 of an array (numpy's uint64
    arithmetic wraps modulo 2**64 as the masks do, so both give the same bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step): a seeded row's randomness."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 11) * (1.0 / (1 << 53))


def seeded_uniforms(seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """float64 [len(seeds)]: seeded_uniform of each (seed, step), the same bits, in one vectorised
    pass (a 256-row step's uniforms one at a time in Python took about 0.9 ms)."""
    s = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
    t = np.array([step & _MASK64 for step in steps], dtype=np.uint64)
    bits = _splitmix64(_splitmix64(s) ^ t) >> 11  # below 2**53: exact in float64
    return torch.from_numpy(bits.astype(np.float64) * (1.0 / (1 << 53)))


# Block width of greedy_argmax's first pass on CPU.
_ARGMAX_BLOCK = 256


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [N, V] -> [N], lowest id on ties, exactly like torch.argmax.

    On CPU torch.argmax is about 4x slower than a plain max over the same data, so the row is
    first reduced to one maximum per block of 256 logits (a fast amax), then argmax runs over the
    block maxima and inside the winning block only. The first block holding the row's maximum and
    the first position inside it give the lowest id, as argmax does. Elsewhere: torch.argmax.
    """
    n, vocab = x.shape
    if x.device.type != "cpu" or vocab < 2 * _ARGMAX_BLOCK:
        return x.argmax(dim=1)
    n_blocks = vocab // _ARGMAX_BLOCK
    head = x[:, : n_blocks * _ARGMAX_BLOCK].view(n, n_blocks, _ARGMAX_BLOCK)
    block_max = head.amax(dim=2)
    best_block = block_max.argmax(dim=1)
    inside = head[torch.arange(n), best_block].argmax(dim=1)
    idx = best_block * _ARGMAX_BLOCK + inside
    if n_blocks * _ARGMAX_BLOCK < vocab:
        tail_max, tail_idx = x[:, n_blocks * _ARGMAX_BLOCK :].max(dim=1)
        head_max = block_max.gather(1, best_block.unsqueeze(1)).squeeze(1)
        # Strictly greater: on a tie the head's (lower) id wins.
        idx = torch.where(tail_max > head_max, tail_idx + n_blocks * _ARGMAX_BLOCK, idx)
    return idx


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def num_generated(inp: SamplingInputs) -> int:
    """Tokens the row has generated before this step (the step index of seeded sampling)."""
    return len(inp.output_token_ids) + inp.num_pending_tokens


def _min_tokens_blocked_ids(inp: SamplingInputs) -> list[int]:
    """Token ids that must not be sampled yet because min_tokens is not reached."""
    if num_generated(inp) >= inp.params.min_tokens:
        return []
    blocked = list(inp.params.stop_token_ids)
    if not inp.params.ignore_eos:
        blocked.extend(inp.eos_token_ids)
    return blocked


class Sampler:
    """Turns float32 logits [N, V] plus one SamplingInputs per row into one SampledToken per row.

    Stateless across calls except for the generator that unseeded rows draw from.
    """

    def __init__(self, seed: int | None = None, cpu_kernels: bool = False) -> None:
        # cpu_kernels: the C row passes (kernels/cpu/row_logprobs.py) for logprobs on the CPU, where
        # the engine's cpu_sampling path is taken.
        self.cpu_kernels = cpu_kernels
        # Uniforms are drawn on the CPU (N numbers per step) so the stream of an unseeded engine
        # does not depend on the device.
        self._generator = torch.Generator(device="cpu")
        # One reusable [rows, V] float32 buffer. On CPU a fresh tensor above 32 MiB (e.g. 256 x
        # 32000 logits) is a new mmap whose page faults cost ~16 ms each time; reusing one buffer
        # for the temperature-scaled logits, weights and CDF avoids that every step.
        self._buffers: dict[str, torch.Tensor] = {}
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, inputs: Sequence[SamplingInputs], token_mask: TokenMask | None = None
    ) -> list[SampledToken]:
        logits = self._check(logits, inputs)
        if self.argmax_is_enough(inputs, logprobs_ok=True):
            # Plain greedy rows, some with logprobs: the argmax (under the mask, which the masked
            # argmax leaves unwritten) and the logprobs of the logits as they are, unmasked.
            if token_mask is None:
                fused = self._argmax_from_logprob_parts(logits, inputs)
                if fused is not None:
                    return fused
            ids = greedy_argmax(logits) if token_mask is None else token_mask.argmax(logits)
            return self._with_logprobs(logits, ids, inputs)
        raw = logits
        if token_mask is not None:
            if any(inp.params.logprobs is not None for inp in inputs):
                raw = logits.clone()  # logprobs are of the unmasked distribution
            token_mask.apply(logits)
        token_ids = self._token_ids(logits, inputs)
        return self._with_logprobs(raw, token_ids, inputs)

    def sample_ids(
        self, logits: torch.Tensor, inputs: Sequence[SamplingInputs], token_mask: TokenMask | None = None
    ) -> torch.Tensor:
        """The sampled token ids [N] as a tensor on the logits' device, for rows that want no
        logprobs: the same tokens as __call__, without waiting for them (on CUDA the caller decides
        when to bring them to the host). Logprobs need host work per row: use __call__ for them."""
        logits = self._check(logits, inputs)
        if any(inp.params.logprobs is not None for inp in inputs):
            raise ValueError("sample_ids does not compute logprobs; call the sampler itself for such rows")
        if token_mask is not None:
            if self.argmax_is_enough(inputs):
                return token_mask.argmax(logits)
            token_mask.apply(logits)
        if self.argmax_is_enough(inputs):
            return greedy_argmax(logits)
        return self._token_ids(logits, inputs)

    def _token_ids(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        processed = self._process(logits, inputs, draw_in_c=self.cpu_kernels and logits.is_cpu)
        return self._sample(processed, inputs, logits.shape[0], logits.device)

    # -- public helper (tests, debugging) --------------------------------------------------------

    def distribution(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        """The probabilities each row is drawn from [N, V]; a greedy row is one-hot on its choice."""
        logits = self._check(logits, inputs)
        processed = self._process(logits, inputs)
        probs = torch.zeros_like(logits)
        if processed.greedy_choice is not None:
            probs[processed.greedy_rows, processed.greedy_choice] = 1.0
        if processed.random_weights is not None:
            weights = processed.random_weights
            probs[processed.random_rows] = weights / weights.sum(dim=1, keepdim=True)
        return probs

    # -- steps ----------------------------------------------------------------------------------

    @staticmethod
    def _check(logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(inputs):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(inputs)} sampling inputs")
        # Contiguous float32, so masks and penalties can be written through a flat view.
        return logits.float().contiguous()

    @staticmethod
    def argmax_is_enough(inputs: Sequence[SamplingInputs], logprobs_ok: bool = False, edits_ok: bool = False) -> bool:
        """Every row is plain greedy (no logprobs unless `logprobs_ok`, no penalties or min_tokens
        blocking unless `edits_ok`): its token is the argmax of its logits (masked first where the
        step has a token mask; with `edits_ok`, after the step's logit_edits)."""
        for inp in inputs:
            p = inp.params
            if (
                not is_greedy(p)
                or (p.logprobs is not None and not logprobs_ok)
                or (not edits_ok and (has_penalties(p) or (p.min_tokens and _min_tokens_blocked_ids(inp))))
            ):
                return False
        return True

    def _process(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs], draw_in_c: bool = False) -> _Processed:
        """Masks, penalties and truncation; returns each greedy row's choice and the weights each
        random row is drawn from. With `draw_in_c` (CPU logits), random rows with a temperature and
        top_p alone (no top_k, no min_p) are drawn by the C kernel (kernels/cpu/row_sample.py: the
        same rule, without sorting the row) and come back drawn instead.

        min_tokens masks and penalties touch few (row, token) positions, so they are written into
        the logits in place and the original values put back afterwards: no [N, V] copy.
        """
        device = logits.device
        greedy: list[int] = []
        random: list[int] = []
        for i, inp in enumerate(inputs):  # one walk of the rows: each costs tens of us at 256 rows
            (greedy if is_greedy(inp.params) else random).append(i)
        greedy_rows = _on_device(greedy, torch.long, device)
        random_rows = _on_device(random, torch.long, device)
        greedy_choice = random_weights = drawn_ids = None
        drawn_rows: list[int] = []

        flat = logits.view(-1)
        step_edits = logit_edits(inputs, logits.shape[1], device)
        edits = [] if step_edits is None else step_edits.groups(flat)
        saved = [(positions, flat[positions]) for positions, _ in edits]
        try:
            # One write per group, in order: a position both penalised and masked ends at -inf.
            # (Within one index_put_, duplicate positions would race on a GPU.)
            for positions, values in edits:
                flat[positions] = values
            if greedy:
                rows = logits if len(greedy) == len(inputs) else logits[greedy_rows]
                greedy_choice = greedy_argmax(rows)
            if random and draw_in_c:
                drawn_rows, drawn_ids = self._draw_in_c(logits, inputs, random)
                if drawn_rows:
                    drawn = set(drawn_rows)
                    random = [i for i in random if i not in drawn]
                    random_rows = _on_device(random, torch.long, device)
            if random:
                params = [inputs[i].params for i in random]
                temps = _on_device([p.temperature for p in params], torch.float32, device)
                x = self._workspace(len(random), logits.shape[1], device)
                # The C draw (row_sample.c) scales the same way: both paths see the same bits.
                inverse = temps.reciprocal().unsqueeze(1)
                if len(random) == len(inputs):
                    torch.mul(logits, inverse, out=x)
                else:
                    torch.index_select(logits, 0, random_rows, out=x).mul_(inverse)

                def keep_buffer() -> torch.Tensor:  # only allocated when some row truncates
                    return self._workspace(len(random), logits.shape[1], device, "keep")

                random_weights = _truncated_weights(x, params, keep_buffer)
        finally:
            for positions, original in reversed(saved):
                flat[positions] = original
        return _Processed(greedy_rows, greedy_choice, random_rows, random, random_weights, drawn_rows, drawn_ids)

    def _draw_in_c(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs],
                   random: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The rows of `random` the C kernel draws (temperature and top_p only), and their tokens; a
        row it could not take (a NaN, no finite maximum) stays with the torch path."""
        from tokenmill.kernels.cpu import row_sample

        vocab = logits.shape[1]
        rows, temps, top_ps = [], [], []
        for i in random:
            p = inputs[i].params
            if p.min_p == 0 and not 0 < p.top_k < vocab:
                rows.append(i)
                temps.append(p.temperature)
                top_ps.append(p.top_p)
        if not rows:
            return [], None
        ids = row_sample.sample_rows(logits, torch.tensor(rows, dtype=torch.long),
                                     torch.tensor(temps, dtype=torch.float32),
                                     torch.tensor(top_ps, dtype=torch.float32),
                                     self._uniforms([inputs[i] for i in rows]))
        if ids is None:
            return [], None
        if bool((ids < 0).any()):
            ok = (ids >= 0).tolist()
            rows = [r for r, good in zip(rows, ok, strict=True) if good]
            ids = ids[ids >= 0]
        return rows, ids

    def _sample(
        self, processed: _Processed, inputs: Sequence[SamplingInputs], n: int, device
    ) -> torch.Tensor:
        """Token id per row [N] (on the logits' device)."""
        token_ids = torch.empty(n, dtype=torch.long, device=device)
        if processed.greedy_choice is not None:
            token_ids[processed.greedy_rows] = processed.greedy_choice
        if processed.random_weights is not None:
            uniforms = self._uniforms([inputs[i] for i in processed.random_row_list])
            token_ids[processed.random_rows] = _inverse_cdf(processed.random_weights, _upload(uniforms, device))
        if processed.drawn_rows:
            token_ids[_on_device(processed.drawn_rows, torch.long, device)] = processed.drawn_ids.to(device)
        return token_ids

    def _uniforms(self, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        unseeded: list[int] = []
        seeded: list[int] = []
        seeds: list[int] = []
        steps: list[int] = []
        for j, inp in enumerate(inputs):
            seed = inp.params.seed
            if seed is None:
                unseeded.append(j)
            else:
                seeded.append(j)
                seeds.append(seed)
                steps.append(num_generated(inp))
        if not unseeded:
            return seeded_uniforms(seeds, steps)
        u = torch.empty(len(inputs), dtype=torch.float64)
        u[unseeded] = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64)
        if seeded:
            u[seeded] = seeded_uniforms(seeds, steps)
        return u

    def _workspace(self, rows: int, vocab: int, device: torch.device, name: str = "main") -> torch.Tensor:
        need = rows * vocab
        buf = self._buffers.get(name)
        if buf is None or buf.device != device or buf.numel() < need:
            buf = self._buffers[name] = torch.empty(need, dtype=torch.float32, device=device)
        return buf[:need].view(rows, vocab)

    def _argmax_from_logprob_parts(
        self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]
    ) -> list[SampledToken] | None:
        """Plain greedy rows that all want logprobs, on the C kernel: each row's top-1 is its argmax
        (lowest id on ties, as greedy_argmax), so the pass the argmax would make over every logit is
        saved. None where the kernel does not apply or a row is not finite (the caller's path)."""
        if (not inputs or not (self.cpu_kernels and logits.is_cpu)
                or any(inp.params.logprobs is None for inp in inputs)):
            return None
        from tokenmill.kernels.cpu import row_logprobs

        top_n = max([1, *(inp.params.logprobs or 0 for inp in inputs)])
        parts = row_logprobs.logprob_parts(logits, top_n)
        if parts is None or bool(torch.isnan(parts[0]).any()):
            return None
        log_total, top_vals, top_idx = parts
        ids = top_idx[:, 0].contiguous()
        return self._with_logprobs(logits, ids, inputs, parts=(log_total, top_vals, top_idx))

    def _with_logprobs(
        self, raw_logits: torch.Tensor, token_ids: torch.Tensor, inputs: Sequence[SamplingInputs],
        parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> list[SampledToken]:
        """`parts`: the rows' (logsumexp, top-N logits, their ids) where the caller has them already,
        every row wanting logprobs and N at least each row's."""
        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        want = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
        if not want:
            return out
        n_top = [inputs[i].params.logprobs or 0 for i in want]  # top-N per row (0: chosen only)
        device = raw_logits.device
        # Raw logprob = logit - logsumexp(row), read from the logits as they are (all rows) or from
        # a copy of the rows that want them; nothing [N, V] is written (see raw_logprob_parts).
        if len(want) == raw_logits.shape[0]:
            x, chosen_ids = raw_logits, token_ids
        else:
            rows = _on_device(want, torch.long, device)
            x = torch.index_select(raw_logits, 0, rows, out=self._workspace(len(want), raw_logits.shape[1], device))
            chosen_ids = token_ids[rows]
        chosen = x.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
        top_n = max(n_top)
        if parts is not None:
            log_total, top_vals, top_idx = parts[0], parts[1][:, :top_n], parts[2][:, :top_n]
        else:
            log_total, top_vals, top_idx = raw_logprob_parts(x, top_n, self.cpu_kernels)
        chosen_list = (chosen - log_total).tolist()
        top_vals_list: list[list[float]] = [[] for _ in want]
        top_ids_list: list[list[int]] = [[] for _ in want]
        if top_n:
            top_vals_list = (top_vals - log_total.unsqueeze(1)).tolist()
            top_ids_list = top_idx.tolist()
        for j, i in enumerate(want):
            n = n_top[j]
            out[i].logprob = chosen_list[j]
            out[i].top_logprobs = list(zip(top_ids_list[j][:n], top_vals_list[j][:n], strict=True))
        return out


# Rows whose log-normaliser is computed at once on the CPU: exp's temporary stays in the L2 cache.
_LOGSUMEXP_ROWS = 8
# Width of the blocks whose maxima pick where a row's top-N logits can be (raw_logprob_parts).
_TOP_BLOCK = 256


def raw_logprob_parts(x: torch.Tensor, top_n: int,
                      c_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp of each row [R], its top_n logits [R, top_n] largest first, their ids) of logits
    x [R, V], without writing x.

    With `c_kernel` (the engine's cpu_sampling path) float32 CPU rows go through the C kernel
    (kernels/cpu/row_logprobs.py: both passes per row while it is in the cache, e^x a fixed
    polynomial, ~3x faster than the torch ops below); a row it cannot take (a NaN, no finite
    maximum) is computed below.

    Each row's maxima of blocks of 256 logits are taken first (one pass): the row's maximum is
    theirs, and its top_n logits lie in its top_n blocks by maximum (those hold top_n logits at
    least as large as the n-th block maximum, which bounds every logit outside them), so topk runs
    over top_n x 256 candidates instead of the vocabulary: on a 256 x 32,000 step torch's topk of
    5 was 40 ms on one core, more than the rest of the step's sampling. Then exp(x - max) is summed
    a few rows at a time through a small buffer, as the full [R, V] temporary it replaces (same
    arithmetic, same bits) cost a page-faulting allocation and a write of every logit.
    """
    if c_kernel and x.is_cpu:
        from tokenmill.kernels.cpu import row_logprobs

        parts = row_logprobs.logprob_parts(x, top_n)
        if parts is not None:
            log_total, top_vals, top_idx = parts
            odd = torch.isnan(log_total).nonzero().squeeze(1)
            if odd.numel():
                fixed = raw_logprob_parts(x[odd], top_n)
                log_total[odd], top_vals[odd], top_idx[odd] = fixed
            return log_total, top_vals, top_idx
    rows, vocab = x.shape
    blocks = vocab // _TOP_BLOCK
    empty = torch.empty(rows, 0, dtype=x.dtype, device=x.device)
    if blocks < 2 or top_n >= blocks:
        row_max = x.amax(dim=1)
        top_vals, top_idx = x.topk(min(top_n, vocab), dim=1) if top_n else (empty, empty.long())
    else:
        head = x[:, : blocks * _TOP_BLOCK].view(rows, blocks, _TOP_BLOCK)
        block_max = head.amax(dim=2)
        tail = x[:, blocks * _TOP_BLOCK :]
        row_max = block_max.amax(dim=1)
        if tail.shape[1]:
            row_max = torch.maximum(row_max, tail.amax(dim=1))
        top_vals, top_idx = empty, empty.long()
        if top_n:
            picked = block_max.topk(top_n, dim=1).indices.sort(dim=1).values  # in id order
            values = head.gather(1, picked.unsqueeze(2).expand(rows, top_n, _TOP_BLOCK)).view(rows, -1)
            ids = (picked.unsqueeze(2) * _TOP_BLOCK + torch.arange(_TOP_BLOCK, device=x.device)).view(rows, -1)
            if tail.shape[1]:
                values = torch.cat([values, tail], dim=1)
                tail_ids = torch.arange(blocks * _TOP_BLOCK, vocab, device=x.device).expand(rows, -1)
                ids = torch.cat([ids, tail_ids], dim=1)
            top_vals, at = values.topk(top_n, dim=1)
            top_idx = ids.gather(1, at)
    chunk = rows if x.device.type != "cpu" else _LOGSUMEXP_ROWS
    log_total = torch.empty(rows, dtype=x.dtype, device=x.device)
    buf = torch.empty(min(chunk, rows), vocab, dtype=x.dtype, device=x.device)
    for start in range(0, rows, chunk):
        part = x[start : start + chunk]
        m = row_max[start : start + chunk].unsqueeze(1)
        weights = torch.sub(part, m, out=buf[: part.shape[0]]).exp_()
        log_total[start : start + chunk] = (m + weights.sum(dim=1, keepdim=True).log_()).squeeze(1)
    return log_total, top_vals, top_idx


@dataclass
class _Processed:
    greedy_rows: torch.Tensor  # long [G]
    greedy_choice: torch.Tensor | None  # long [G]: argmax after masks and penalties
    random_rows: torch.Tensor  # long [R]
    random_row_list: list[int]  # the same rows, on the host
    # [R, V] unnormalised probabilities each random row is drawn from (in the sampler's buffer).
    random_weights: torch.Tensor | None
    # Rows drawn in C already (kernels/cpu/row_sample.py), and their tokens.
    drawn_rows: list[int] = field(default_factory=list)
    drawn_ids: torch.Tensor | None = None


@dataclass
class LogitEdits:
    """What penalties and min_tokens change in a step's logits, as flat positions row * vocab + id.

    Both touch few (row, token) positions, so they are computed on those alone, never densely over
    [N, V]: the sampler writes them into the full logits (`groups`), and the greedy screen
    (kernels/cpu/greedy_screen.py) takes the penalised positions' exact logits and leaves the rest
    of the row to its bfloat16 screen. The values are a function of each position's raw logit alone
    (`penalised_values`), so both get the same bits from the same raw logits."""

    vocab: int
    penalised: torch.Tensor | None = None  # long [P]: unique, sorted (tokens of a penalised row's prompt or output)
    counts: torch.Tensor | None = None  # float32 [P]: how often each occurs in its row's output (0: prompt only)
    rep: torch.Tensor | None = None  # float32 [P]: its row's repetition penalty (1 where the row has none)
    freq: torch.Tensor | None = None  # float32 [P]: its row's frequency penalty
    pres: torch.Tensor | None = None  # float32 [P]: its row's presence penalty
    blocked: torch.Tensor | None = None  # long [B]: unique positions min_tokens sets to -inf

    def penalised_values(self, raw: torch.Tensor) -> torch.Tensor:
        """The penalised positions' logits after the penalties, from their raw logits [P]. Increasing
        in the raw logit: the greedy screen bounds it so (csrc/greedy_screen.c, edited_may_win)."""
        # Repetition (HF/vLLM): every token seen in prompt or output; rows without it have rep == 1.
        x = torch.where(raw > 0, raw / self.rep, raw * self.rep)
        # Frequency and presence (OpenAI): output tokens only.
        return x - self.freq * self.counts - self.pres * (self.counts > 0).float()

    def subset(self, keep: torch.Tensor) -> LogitEdits:
        """The penalised positions `keep` (indices into penalised) alone, no blocked ones."""
        return LogitEdits(self.vocab, self.penalised[keep], self.counts[keep], self.rep[keep], self.freq[keep],
                          self.pres[keep])

    def groups(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(flat positions, new values) groups for the logits `flat` (the [N * V] view), in the order
        they must be written: a position both penalised and blocked ends at -inf."""
        groups = []
        if self.penalised is not None:
            groups.append((self.penalised, self.penalised_values(flat[self.penalised])))
        if self.blocked is not None:
            groups.append((self.blocked, torch.full((self.blocked.numel(),), float("-inf"), device=flat.device)))
        return groups


def logit_edits(inputs: Sequence[SamplingInputs], vocab: int, device: torch.device) -> LogitEdits | None:
    """The step's penalties and min_tokens masks (LogitEdits); None when no row has either."""
    edits = LogitEdits(vocab)
    penalised = [i for i, inp in enumerate(inputs) if has_penalties(inp.params)]
    if penalised:
        # Every penalised row's (row, token) positions at once, in numpy: its sort is many times
        # torch's on the CPU at these sizes (25,000 positions: 0.07 against 1 ms). Each row's output
        # ids and unique prompt ids are kept as arrays on its SamplingInputs, the outputs extended by
        # the tokens appended since the last step, so no step walks the whole history in Python.
        out_pos = _row_positions([_output_ids_array(inputs[i], vocab) for i in penalised], penalised, vocab)
        repeating = [i for i in penalised if inputs[i].params.repetition_penalty != 1.0]
        prompt_pos = _row_positions([_prompt_ids_array(inputs[i], vocab) for i in repeating], repeating, vocab)
        # The distinct output positions and how often each occurs; then their union with the prompt's
        # through one sort of keys position * scale + count (a prompt position's count 0), where a
        # position's largest key holds its output count (0 for prompt-only tokens).
        out_sorted = np.sort(out_pos)
        starts = _run_starts(out_sorted)
        out_counts = np.diff(np.r_[starts, out_sorted.size])
        shift = int(out_counts.max(initial=0)).bit_length()
        keys = np.sort(np.concatenate([(out_sorted[starts] << shift) + out_counts, prompt_pos << shift]))
        positions = keys >> shift
        runs = _run_starts(positions)
        unique_pos = positions[runs]
        last_of_run = np.r_[runs[1:], keys.size] - 1 if keys.size else runs  # (none: nothing is penalised yet)
        counts = (keys[last_of_run] & ((1 << shift) - 1)).astype(np.float32)

        n = len(inputs)
        rep_l, freq_l, pres_l = [1.0] * n, [0.0] * n, [0.0] * n
        for i in penalised:
            p = inputs[i].params
            rep_l[i], freq_l[i], pres_l[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        row = unique_pos // vocab
        edits.penalised = _upload(torch.from_numpy(unique_pos), device)
        edits.counts = _upload(torch.from_numpy(counts), device)
        edits.rep, edits.freq, edits.pres = (
            _upload(torch.from_numpy(np.asarray(v, dtype=np.float32)[row]), device) for v in (rep_l, freq_l, pres_l))

    rows: list[int] = []
    cols: list[int] = []
    for i, inp in enumerate(inputs):
        if not inp.params.min_tokens:
            continue
        # Ids outside the vocabulary can never be sampled, so there is nothing to mask for them.
        blocked = [t for t in _min_tokens_blocked_ids(inp) if 0 <= t < vocab]
        rows.extend([i] * len(blocked))
        cols.extend(blocked)
    if rows:
        edits.blocked = _upload(torch.unique(
            torch.tensor(rows, dtype=torch.long) * vocab + torch.tensor(cols, dtype=torch.long)
        ), device)
    return None if edits.penalised is None and edits.blocked is None else edits


def _row_positions(ids: Sequence[np.ndarray], rows: Sequence[int], vocab: int) -> np.ndarray:
    """int64: the flat positions row * vocab + id of each row's ids (checked arrays), all rows in one."""
    if not rows:
        return np.empty(0, dtype=np.int64)
    lengths = [a.size for a in ids]
    return np.concatenate(ids) + np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lengths)


def _run_starts(sorted_ids: np.ndarray) -> np.ndarray:
    """Where each run of equal values of a sorted array starts (np.unique's hash table, in numpy 2.3,
    costs some twenty times this sort-based way at 25,000 positions)."""
    if not sorted_ids.size:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])


def _ids_array(ids: Sequence[int], vocab: int, what: str) -> np.ndarray:
    a = np.fromiter(ids, dtype=np.int64, count=len(ids))
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab):
        raise ValueError(f"{what} token ids must be in [0, {vocab}); got min {int(a.min())}, max {int(a.max())}")
    return a


def _output_ids_array(inp: SamplingInputs, vocab: int) -> np.ndarray:
    """The row's output ids as a checked int64 array, kept on its SamplingInputs: a Request's output
    list only grows by appends, so a later step converts and checks only the ids appended since.
    Built again whole when the list is another object, is shorter, or its last kept id changed."""
    ids = inp.output_token_ids
    n = len(ids)
    cached = inp._output_ids
    if cached is not None:
        source, buf, length = cached
        if source is ids and length <= n and (length == 0 or buf[length - 1] == ids[length - 1]):
            if length + 1 == n and n <= buf.size:  # a decode step's one id: no slice, no list to copy
                t = ids[length]
                if not 0 <= t < vocab:
                    raise ValueError(f"output token ids must be in [0, {vocab}); got {t}")
                buf[length] = t
                inp._output_ids = (ids, buf, n)
            elif length < n:
                new = ids[length:n]  # a step appends a few ids: checked as Python ints
                lo, hi = min(new), max(new)
                if lo < 0 or hi >= vocab:
                    raise ValueError(f"output token ids must be in [0, {vocab}); got min {lo}, max {hi}")
                if n > buf.size:
                    buf = np.concatenate([buf[:length], np.empty(max(n, 2 * buf.size) - length, dtype=np.int64)])
                buf[length:n] = new
                inp._output_ids = (ids, buf, n)
            return buf[:n]
    first = _ids_array(ids, vocab, "output")
    buf = np.empty(max(16, 2 * n), dtype=np.int64)
    buf[:n] = first
    inp._output_ids = (ids, buf, n)
    return buf[:n]


def _prompt_ids_array(inp: SamplingInputs, vocab: int) -> np.ndarray:
    """The prompt's distinct ids, sorted, built once per SamplingInputs (the prompt never changes)."""
    cached = inp._prompt_ids
    if cached is None:
        ids = np.sort(_ids_array(inp.prompt_token_ids, vocab, "prompt"))
        cached = inp._prompt_ids = ids[_run_starts(ids)]
    return cached


# Candidates examined for top_p before falling back to a full sort of the row.
TOP_P_CANDIDATES = 256


def _truncated_weights(
    x: torch.Tensor, params: Sequence[SamplingParams], keep_buffer: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """min_p, top_k and top_p on temperature-scaled logits [R, V]; returns x, overwritten in place
    with unnormalised probabilities (exp(logit - row max); dropped tokens weigh 0).

    Each filter keeps every token whose logit reaches a per-row threshold, so tokens tied with the
    last kept one are all kept (HF/vLLM's top_k rule, applied to top_p too) and a row's result
    depends only on its own logits, never on the other rows of the batch or on sort order. The
    thresholds are found first (each filter measured on what the previous ones keep) and applied
    once at the end as a 0/1 float mask from `keep_buffer()`: masked_fill over [R, V] is several
    times slower on CPU than a comparison into a float buffer and a multiply.
    """
    device = x.device
    rows, vocab = x.shape
    neg_inf = float("-inf")
    row_max = x.amax(dim=1)
    threshold = torch.full((rows,), neg_inf, device=device)
    filtered = False

    if any(p.min_p > 0 for p in params):
        min_p = _on_device([p.min_p for p in params], torch.float32, device)
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); min_p == 0 gives -inf: keeps all.
        threshold = row_max + torch.log(min_p)
        filtered = True

    k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    top_kept = None  # the k-rows' largest logits that survive so far, sorted: top_p can reuse them
    if k_rows:
        idx = _on_device(k_rows, torch.long, device)
        ks = _on_device([params[j].top_k for j in k_rows], torch.long, device)
        max_k = max(params[j].top_k for j in k_rows)  # from the host: ks.max() would wait for the GPU
        top = (x if len(k_rows) == rows else x[idx]).topk(max_k, dim=1).values  # largest first
        kth = top.gather(1, (ks - 1).unsqueeze(1)).squeeze(1)
        threshold[idx] = torch.maximum(threshold[idx], kth)
        top_kept = top.masked_fill_(top < threshold[idx].unsqueeze(1), neg_inf)
        filtered = True

    p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = _on_device(p_rows, torch.long, device)
        top_p = _on_device([params[j].top_p for j in p_rows], torch.float32, device)
        known = None
        if top_kept is not None and set(p_rows) <= set(k_rows):
            where = {j: n for n, j in enumerate(k_rows)}
            known = top_kept[_on_device([where[j] for j in p_rows], torch.long, device)]
        sub = x if len(p_rows) == rows else x[idx]
        # Rows that min_p or top_k filter first measure top_p's mass over what those keep. Which
        # rows do is decided by their own params, so a row's arithmetic never depends on the batch.
        floored = [params[j].min_p > 0 or 0 < params[j].top_k < vocab for j in p_rows]
        earlier = threshold[idx]
        cutoff = _top_p_cutoff(sub, top_p, earlier, floored, min(TOP_P_CANDIDATES, vocab), known)
        threshold[idx] = torch.maximum(earlier, cutoff)
        filtered = True

    if filtered:
        keep = torch.ge(x, threshold.unsqueeze(1), out=keep_buffer())  # 1.0 where kept, else 0.0
    x.sub_(row_max.unsqueeze(1)).exp_()
    if filtered:
        x.mul_(keep)
    return x


def _top_p_cutoff(
    x: torch.Tensor,
    top_p: torch.Tensor,
    earlier: torch.Tensor,
    floored: list[bool],
    candidates: int,
    known: torch.Tensor | None = None,
    log_total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, the smallest logit top_p keeps: that of the last token (in descending order) whose
    preceding mass is still below top_p. In `floored` rows the mass counts only tokens with
    logit >= `earlier` (the threshold of the filters before top_p).

    Looks at the largest `candidates` logits first (or at `known`, the largest logits already at
    hand, sorted); rows whose cut may lie beyond them are redone over the whole sorted row. On the
    CPU a row whose `candidates` largest tokens cannot reach top_p even at the largest one's
    probability each (a flat distribution: a random model's, or a high temperature's) goes to the
    whole row at once: the candidates' topk (40 ms for 256 x 32,000 rows on one core) would only be
    thrown away. `log_total`: each row's logsumexp (over what its floor keeps), when known.
    """
    vocab = x.shape[1]
    if log_total is None:
        log_total = _row_logsumexp(x, earlier, floored)
    if known is None and candidates < vocab and x.device.type == "cpu":
        # The mass before the last candidate is at most (candidates - 1) times the largest
        # probability; the margin covers float32 rounding of the sums.
        deep = candidates * (x.amax(dim=1) - log_total).exp() * (1 + 1e-3) < top_p
        if bool(deep.any()):
            cutoff = torch.empty(x.shape[0], dtype=x.dtype)
            for rows, whole in ((deep.nonzero().squeeze(1), True), ((~deep).nonzero().squeeze(1), False)):
                if rows.numel():
                    sub = x if rows.numel() == x.shape[0] else x[rows]
                    cutoff[rows] = _top_p_cutoff(
                        sub, top_p[rows], earlier[rows], [floored[j] for j in rows.tolist()],
                        vocab if whole else candidates, log_total=log_total[rows],
                        known=None if whole else sub.topk(candidates, dim=1).values)
            return cutoff
    if known is not None:
        values = known
    elif candidates < vocab:
        values = x.topk(candidates, dim=1).values
    else:
        values = _sorted_descending(x)
    # `values` is always a fresh tensor here (topk, sort or an indexed copy): edit it in place.
    if any(floored):
        values.masked_fill_(values < earlier.unsqueeze(1), float("-inf"))
    cumulative = (values - log_total.unsqueeze(1)).exp_().cumsum_(dim=1)
    # The mass before position i is cumulative[i - 1] (0 before the first, which always stays): so
    # n_keep is 1 + the number of cumulative[:-1] below top_p, found by bisection, since the sums of
    # non-negative terms never decrease.
    below = torch.searchsorted(cumulative, top_p.unsqueeze(1).to(cumulative.dtype)).squeeze(1)
    n_keep = 1 + below.clamp(max=values.shape[1] - 1)
    cutoff = values.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
    if values.shape[1] < vocab:
        # Every candidate is needed and the mass is still below top_p: the cut may lie further
        # down (the candidates' own mass is what decides, so this cannot depend on other rows).
        unsure = (n_keep >= values.shape[1]).nonzero().squeeze(1)
        if unsure.numel():
            again = [floored[j] for j in unsure.tolist()]
            cutoff[unsure] = _top_p_cutoff(x[unsure], top_p[unsure], earlier[unsure], again, vocab,
                                           log_total=log_total[unsure])
    return cutoff


def _sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """Each row's values sorted, largest first. On CPU numpy's SIMD sort is ~10x faster than
    torch.sort (0.065 s against 0.7 s for 256 x 32000)."""
    if x.device.type != "cpu":
        return x.sort(dim=1, descending=True).values
    import numpy as np

    ascending = np.sort(x.detach().contiguous().numpy(), axis=1)
    return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))


def _row_logsumexp(x: torch.Tensor, floor: torch.Tensor, floored: list[bool]) -> torch.Tensor:
    """logsumexp over dim 1; in `floored` rows only over logits >= floor[row]."""
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    for use_floor in (False, True):
        rows = [j for j, f in enumerate(floored) if f == use_floor]
        if not rows:
            continue
        if len(rows) == x.shape[0]:
            out = _chunked_logsumexp(x, floor if use_floor else None)
        else:
            idx = _on_device(rows, torch.long, x.device)
            out[idx] = _chunked_logsumexp(x[idx], floor[idx] if use_floor else None)
    return out


def _chunked_logsumexp(
    x: torch.Tensor, at_least: torch.Tensor | None, rows_per_chunk: int = 16
) -> torch.Tensor:
    """logsumexp over dim 1, counting only logits >= at_least[row] when given.

    A few rows at a time, so temporaries stay small (on CPU a fresh [N, V] temporary above 32 MiB
    costs page faults on every call); the floor is a 0/1 float factor, not a masked_fill, which
    is several times slower on CPU.
    """
    out = []
    for start in range(0, x.shape[0], rows_per_chunk):
        chunk = x[start : start + rows_per_chunk]
        if at_least is None:
            out.append(torch.logsumexp(chunk, dim=1))
            continue
        floor = at_least[start : start + rows_per_chunk].unsqueeze(1)
        top = chunk.amax(dim=1, keepdim=True)
        weights = (chunk - top).exp_().mul_(torch.ge(chunk, floor).to(chunk.dtype))
        out.append((weights.sum(dim=1, keepdim=True).log_() + top).squeeze(1))
    return torch.cat(out)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: the first id whose cumulative weight exceeds u * total weight.

    Turns `weights` [R, V] into its cumulative sum in place.
    """
    cdf = weights.cumsum_(dim=1)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, uniforms.to(cdf.dtype).unsqueeze(1) * total, right=True)
    # u * total can round up to total itself: then take the last token with non-zero weight,
    # which is where the cumulative sum first reaches its total.
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, last_positive).squeeze(1)
