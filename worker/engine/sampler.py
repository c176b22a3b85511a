"""Batched token sampling: one call turns the logits of every sequence of a step into tokens.

Order of operations for each row (the vLLM v1 order):

1. logprobs, when asked, are taken from the RAW model distribution (log_softmax of the logits the
   model produced), before any penalty, mask or temperature: vLLM's default ``raw_logprobs``.
2. min_tokens: while fewer than ``min_tokens`` tokens were generated, the stop token ids and (unless
   ``ignore_eos``) the EOS ids are masked to -inf, so the request cannot stop early. With
   ``ignore_eos`` the EOS token is an ordinary token and is never masked.
3. penalties: repetition_penalty (HF/vLLM: over prompt and output tokens, positive logits are divided
   and negative ones multiplied) then frequency/presence penalties (OpenAI: over output tokens,
   ``logit -= frequency * count + presence * (count > 0)``).
4. greedy rows (temperature below 1e-5, like vLLM) take the argmax; ties go to the lowest id.
5. other rows: divide by temperature, then min_p (drop tokens whose probability is below
   ``min_p * max probability``), then top_k (ties with the k-th logit are kept), then top_p (keep the
   smallest prefix of the descending, stably sorted distribution whose mass reaches top_p), then draw.

Drawing is inverse-CDF sampling in token-id order from one uniform number per row. A seeded row's
uniform is a hash of (seed, number of tokens generated so far) and nothing else, so the same request
gives the same tokens alone, in any batch, after preemption and recompute, and on any device that
produces the same probabilities. Unseeded rows take their uniforms from one engine generator.

Everything is a tensor operation over the [N, V] logits of the rows that need it; Python loops
only walk the N request descriptions to build small index tensors. An all-greedy batch without
penalties, masks or logprobs is a single argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.types import SamplingParams

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


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw-model logprob of token_id, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, raw logprob)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, step): a seeded row's randomness."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 11) * (1.0 / (1 << 53))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _min_tokens_blocked_ids(inp: SamplingInputs) -> list[int]:
    """Token ids that must not be sampled yet because min_tokens is not reached."""
    if len(inp.output_token_ids) >= inp.params.min_tokens:
        return []
    blocked = list(inp.params.stop_token_ids)
    if not inp.params.ignore_eos:
        blocked.extend(inp.eos_token_ids)
    return blocked


class Sampler:
    """Turns float32 logits [N, V] plus one SamplingInputs per row into one SampledToken per row.

    Stateless across calls except for the generator that unseeded rows draw from.
    """

    def __init__(self, seed: int | None = None) -> None:
        # Uniforms are drawn on the CPU (N numbers per step) so the stream of an unseeded engine
        # does not depend on the device.
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> list[SampledToken]:
        logits = self._check(logits, inputs)
        if self._fast_path_ok(inputs):
            return [SampledToken(t) for t in logits.argmax(dim=1).tolist()]

        token_ids = self._sample(self._process(logits, inputs), inputs)
        return self._with_logprobs(logits, token_ids, inputs)

    # -- public helper (tests, debugging) --------------------------------------------------------

    def distribution(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        """The probabilities each row is drawn from [N, V]; a greedy row is one-hot on its argmax."""
        logits = self._check(logits, inputs)
        processed = self._process(logits, inputs)
        probs = torch.zeros_like(processed.logits)
        if processed.greedy_rows.numel():
            choice = processed.logits[processed.greedy_rows].argmax(dim=1, keepdim=True)
            probs[processed.greedy_rows] = torch.zeros_like(processed.logits[processed.greedy_rows]).scatter_(
                1, choice, 1.0
            )
        if processed.random_rows.numel():
            probs[processed.random_rows] = processed.random_probs
        return probs

    # -- steps ----------------------------------------------------------------------------------

    @staticmethod
    def _check(logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(inputs):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(inputs)} sampling inputs")
        return logits if logits.dtype == torch.float32 else logits.float()

    @staticmethod
    def _fast_path_ok(inputs: Sequence[SamplingInputs]) -> bool:
        for inp in inputs:
            p = inp.params
            if (
                not is_greedy(p)
                or p.logprobs is not None
                or _has_penalties(p)
                or (p.min_tokens and _min_tokens_blocked_ids(inp))
            ):
                return False
        return True

    def _process(self, logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> _Processed:
        """Masks, penalties and truncation; returns what greedy and random rows choose from."""
        logits = logits.clone()  # the raw logits stay intact for logprobs
        device = logits.device
        vocab = logits.shape[1]

        self._mask_min_tokens(logits, inputs)
        self._apply_penalties(logits, inputs)

        greedy = [i for i, inp in enumerate(inputs) if is_greedy(inp.params)]
        random = [i for i, inp in enumerate(inputs) if not is_greedy(inp.params)]
        greedy_rows = torch.tensor(greedy, dtype=torch.long, device=device)
        random_rows = torch.tensor(random, dtype=torch.long, device=device)
        random_probs = None
        if random:
            params = [inputs[i].params for i in random]
            x = logits[random_rows]
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
            x.div_(temps.unsqueeze(1))
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
                probs = torch.softmax(x, dim=1)
                threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
                x.masked_fill_(probs < threshold, float("-inf"))
            if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
                _apply_top_k_top_p(x, params)
            random_probs = torch.softmax(x, dim=1)
        return _Processed(logits, greedy_rows, random_rows, random_probs)

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> None:
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, inp in enumerate(inputs):
            # Ids outside the vocabulary can never be sampled, so there is nothing to mask for them.
            blocked = [t for t in _min_tokens_blocked_ids(inp) if 0 <= t < vocab]
            rows.extend([i] * len(blocked))
            cols.extend(blocked)
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, inputs: Sequence[SamplingInputs]) -> None:
        rows = [i for i, inp in enumerate(inputs) if _has_penalties(inp.params)]
        if not rows:
            return
        device = logits.device
        vocab = logits.shape[1]
        sub = [inputs[i] for i in rows]
        m = len(rows)
        row_index = torch.tensor(rows, dtype=torch.long, device=device)
        x = logits[row_index]

        # Output token counts [m, V], built with one scatter_add over the flattened output ids.
        out_lens = torch.tensor([len(s.output_token_ids) for s in sub], dtype=torch.long)
        out_ids = torch.tensor(list(itertools.chain.from_iterable(s.output_token_ids for s in sub)), dtype=torch.long)
        _check_ids(out_ids, vocab, "output")
        counts = torch.zeros(m, vocab, dtype=torch.float32, device=device)
        if out_ids.numel():
            flat = torch.repeat_interleave(torch.arange(m), out_lens) * vocab + out_ids
            counts.view(-1).scatter_add_(0, flat.to(device), torch.ones(flat.numel(), device=device))

        rep = torch.tensor([s.params.repetition_penalty for s in sub], dtype=torch.float32, device=device)
        if bool((rep != 1.0).any()):
            # Seen = in the prompt or the output, only for rows that use the repetition penalty.
            rep_subrows = [j for j, s in enumerate(sub) if s.params.repetition_penalty != 1.0]
            prompt_lens = torch.tensor([len(sub[j].prompt_token_ids) for j in rep_subrows], dtype=torch.long)
            prompt_ids = torch.tensor(
                list(itertools.chain.from_iterable(sub[j].prompt_token_ids for j in rep_subrows)), dtype=torch.long
            )
            _check_ids(prompt_ids, vocab, "prompt")
            seen = counts > 0
            if prompt_ids.numel():
                flat = torch.repeat_interleave(torch.tensor(rep_subrows), prompt_lens) * vocab + prompt_ids
                seen.view(-1)[flat.to(device)] = True
            r = rep.unsqueeze(1)
            penalized = torch.where(x > 0, x / r, x * r)
            x = torch.where(seen, penalized, x)

        freq = torch.tensor([s.params.frequency_penalty for s in sub], dtype=torch.float32, device=device)
        pres = torch.tensor([s.params.presence_penalty for s in sub], dtype=torch.float32, device=device)
        x = x - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).float()
        logits[row_index] = x

    def _sample(self, processed: _Processed, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        """Token id per row [N] (on the logits' device)."""
        n = processed.logits.shape[0]
        device = processed.logits.device
        token_ids = torch.empty(n, dtype=torch.long, device=device)
        if processed.greedy_rows.numel():
            token_ids[processed.greedy_rows] = processed.logits[processed.greedy_rows].argmax(dim=1)
        if processed.random_rows.numel():
            uniforms = self._uniforms([inputs[i] for i in processed.random_rows.tolist()])
            token_ids[processed.random_rows] = _inverse_cdf(processed.random_probs, uniforms.to(device))
        return token_ids

    def _uniforms(self, inputs: Sequence[SamplingInputs]) -> torch.Tensor:
        unseeded = [j for j, inp in enumerate(inputs) if inp.params.seed is None]
        u = torch.empty(len(inputs), dtype=torch.float64)
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64)
        for j, inp in enumerate(inputs):
            if inp.params.seed is not None:
                u[j] = seeded_uniform(inp.params.seed, len(inp.output_token_ids))
        return u

    @staticmethod
    def _with_logprobs(
        raw_logits: torch.Tensor, token_ids: torch.Tensor, inputs: Sequence[SamplingInputs]
    ) -> list[SampledToken]:
        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        want = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
        if not want:
            return out
        device = raw_logits.device
        rows = torch.tensor(want, dtype=torch.long, device=device)
        logprobs = torch.log_softmax(raw_logits[rows], dim=1)
        chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
        top_n = max(inputs[i].params.logprobs for i in want)
        top_vals: list[list[float]] = [[] for _ in want]
        top_ids: list[list[int]] = [[] for _ in want]
        if top_n:
            vals, idx = logprobs.topk(min(top_n, logprobs.shape[1]), dim=1)
            top_vals, top_ids = vals.tolist(), idx.tolist()
        for j, i in enumerate(want):
            n = inputs[i].params.logprobs
            out[i].logprob = chosen[j]
            out[i].top_logprobs = list(zip(top_ids[j][:n], top_vals[j][:n]))
        return out


@dataclass
class _Processed:
    logits: torch.Tensor  # [N, V] after min_tokens masks and penalties (greedy rows take the argmax)
    greedy_rows: torch.Tensor  # long [G]
    random_rows: torch.Tensor  # long [R]
    random_probs: torch.Tensor | None  # [R, V] final distribution of the random rows


def _check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{what} token ids must be in [0, {vocab}); got min {int(ids.min())}, max {int(ids.max())}")


def _apply_top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask (in place) what top_k and top_p drop, for rows [R, V] already divided by temperature.

    Rows without top_k (0) or top_p (1.0) lose nothing, so each row's result does not depend on
    which other rows share the batch.
    """
    device = x.device
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=1, descending=True, stable=True)
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    kth = sorted_x.gather(1, (ks - 1).unsqueeze(1))
    # Ties with the k-th largest logit stay (HF/vLLM), so compare values, not positions.
    sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(sorted_x, dim=1)
        mass_before = probs.cumsum(dim=1) - probs
        # A token stays while the mass of the tokens before it is below top_p; the first always stays.
        # top_p == 1 rows are left alone (float rounding could otherwise drop their far tail).
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_x.masked_fill_(drop, float("-inf"))
    x.scatter_(1, order, sorted_x)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: the first id whose cumulative probability exceeds u * total."""
    cdf = probs.cumsum(dim=1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total itself: then take the last token with non-zero probability.
    past_end = idx >= probs.shape[1]
    if bool(past_end.any()):
        positive = probs > 0
        last_positive = probs.shape[1] - 1 - positive.flip(1).to(torch.int8).argmax(dim=1)
        idx = torch.where(past_end, last_positive, idx)
    return idx
