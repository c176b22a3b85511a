"""Prompt scoring (sampling.prompt_logprobs): the logprob, rank and top-N of each prompt token.

Position p of a prompt (p >= score_from >= 1) is scored from the final hidden state of position
p - 1: log_softmax of its logits, read at the token actually at p. So a scoring request needs the
hidden states of positions score_from - 1 .. len(prompt) - 2, and those positions must be computed,
not served from the prefix cache (a cached block holds K/V, not logits). Request.prefix_cache_limit
stops the prefix-cache lookup there; everything before it may come from the cache, which is what
makes a shared few-shot context cheap: computed once, and each continuation only scores itself.

The rows to score are found per step by the model runner (`score_rows`): the positions of the
step's chunk that a scoring request still needs. They go through the model's last layer with the
sampling rows (OutputRows: a decode-shaped query per row, attending to its own prefix), and then
through `score_hidden`: the LM head and the logsumexp run `SCORE_CHUNK_ROWS` rows at a time, so
memory beyond the hidden states is one [chunk, vocab] float32 block whatever the prompt length;
no [tokens, vocab] log-softmax is ever materialised. Each scored position is recorded on its
request once (Request.next_score_pos only moves forward), so a prompt scored over several chunked
prefill steps, or recomputed after a preemption, gives each position exactly one record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.engine.types import PromptLogprob

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

SCORE_CHUNK_ROWS = 256  # rows of logits alive at once while scoring


@dataclass
class ScoreRows:
    """The prompt positions one step scores, in the order their rows follow the sampling rows."""

    requests: list[Request]  # one entry per scoring request of the step, in batch order
    counts: list[int]  # rows of each of those requests
    flat_index: np.ndarray  # int64 [rows]: row of the step's packed tokens (the hidden of position p - 1)
    seq_lens: np.ndarray  # int64 [rows]: p, the tokens that row attends to
    batch_index: np.ndarray  # int64 [rows]: the request's index in the step's batch
    targets: np.ndarray  # int64 [rows]: the prompt token at p

    def __len__(self) -> int:
        return len(self.targets)


def score_rows(
    requests: Sequence[Request], ctx: np.ndarray, n: np.ndarray, qsl: np.ndarray
) -> ScoreRows | None:
    """The positions to score in a step whose request i computes tokens ctx[i] .. ctx[i]+n[i]-1
    (packed from qsl[i]); None when no request of the step scores."""
    reqs: list[Request] = []
    counts: list[int] = []
    flat: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    batch: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    for i, r in enumerate(requests):
        if r.prompt_scores is None:
            continue
        c, k = int(ctx[i]), int(n[i])
        lo = max(c, r.next_score_pos - 1)  # hidden positions: p - 1 for each position p to score
        hi = min(c + k, r.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        if lo != r.next_score_pos - 1:
            raise RuntimeError(
                f"request {r.request_id!r}: prompt position {r.next_score_pos} is to be scored but "
                f"positions up to {c} were computed without it (served from the prefix cache?)"
            )
        h = np.arange(lo, hi, dtype=np.int64)
        reqs.append(r)
        counts.append(hi - lo)
        flat.append(int(qsl[i]) - c + h)
        lens.append(h + 1)
        batch.append(np.full(hi - lo, i, dtype=np.int64))
        targets.append(np.asarray(r.prompt_token_ids[lo + 1 : hi + 1], dtype=np.int64))
    if not reqs:
        return None
    return ScoreRows(reqs, counts, np.concatenate(flat), np.concatenate(lens), np.concatenate(batch),
                     np.concatenate(targets))


@torch.inference_mode()
def score_hidden(
    model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, top_n: int, chunk: int = SCORE_CHUNK_ROWS
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """(logprob, rank, top-N ids, top-N logprobs) of each target token under the logits of its
    hidden row; computed `chunk` rows at a time."""
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    # Two [chunk, vocab] float32 blocks serve every chunk: the logits (the first chunk's tensor,
    # written into again) and a work block for the exp and the rank comparison. With fresh blocks
    # per chunk (logits, logsumexp's exp, the comparison mask) the host heap, whose freed memory
    # stays mapped (cpu/host_memory.py), fragmented and grew: a 4,096-token prompt then peaked about
    # twice as far above the loaded engine, and by a different amount from run to run.
    logits_buf: torch.Tensor | None = None
    work: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        out = None if logits_buf is None else logits_buf[: h.shape[0]]
        logits = model.compute_logits(h, out=out).float()
        if logits_buf is None:
            logits_buf = logits
        if work is None or work.shape[0] < logits.shape[0]:
            work = torch.empty_like(logits)
        w = work[: logits.shape[0]]
        t = targets[start : start + chunk].to(logits.device)
        peak = logits.amax(dim=-1, keepdim=True)
        torch.sub(logits, peak, out=w).exp_()
        lse = w.sum(dim=-1).log_().add_(peak.squeeze(1))
        chosen = logits.gather(1, t[:, None]).squeeze(1)
        logprobs += (chosen - lse).tolist()
        torch.gt(logits, chosen[:, None], out=w)  # 1.0 where a token is more likely than the target
        ranks += w.sum(dim=-1).add_(1).long().tolist()
        if top_n:
            values, ids = logits.topk(top_n, dim=-1)
            top_ids += ids.tolist()
            top_lps += (values - lse[:, None]).tolist()
        else:
            top_ids += [[] for _ in range(len(t))]
            top_lps += [[] for _ in range(len(t))]
    return logprobs, ranks, top_ids, top_lps


def record_scores(rows: ScoreRows, hidden: torch.Tensor, model: torch.nn.Module) -> None:
    """Score `rows` from their final hidden states (in row order) and record them on their requests."""
    top_n = max(r.sampling.prompt_logprobs for r in rows.requests)
    targets = torch.from_numpy(rows.targets)
    logprobs, ranks, top_ids, top_lps = score_hidden(model, hidden, targets, top_n)
    start = 0
    for r, count in zip(rows.requests, rows.counts, strict=True):
        k = r.sampling.prompt_logprobs
        first = r.next_score_pos  # score_rows starts each request there
        records = [
            PromptLogprob(
                position=first + j,
                token_id=int(rows.targets[start + j]),
                logprob=logprobs[start + j],
                rank=ranks[start + j],
                top_logprobs=list(zip(top_ids[start + j][:k], top_lps[start + j][:k], strict=True)),
            )
            for j in range(count)
        ]
        r.add_prompt_scores(records)
        start += count
