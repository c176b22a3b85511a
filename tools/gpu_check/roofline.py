"""What a decode step must read, and the fastest the throughput run could go (its ceiling)."""

from __future__ import annotations


def param_bytes(model) -> int:
    """Bytes of distinct parameters (a tied embedding counts once: the LM head reads it whole)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def llama_param_count(shape: dict) -> int:
    """Parameters of a Llama of this Hugging Face shape, without building it."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    emb = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return layers * per_layer + emb + h


def roofline_ceiling(prompt_lens: list[int], output_lens: list[int], weight_bytes: int, kv_bytes_per_token: int,
                     copy_bw: float, max_num_seqs: int) -> dict:
    """Fastest possible decode: every step reads the weights once plus the KV of every running sequence.

    Sequences run max_num_seqs at a time (a new one joins as soon as one finishes); each decode step
    reads the weights and the whole context of each running sequence; prefill is left out (it is
    compute-bound and tiny next to the decode steps here). Returns the ceiling time and tokens/s.
    """
    pending = list(zip(prompt_lens, output_lens, strict=True))[::-1]
    running: list[list[int]] = []  # [context, tokens left]
    total_bytes = 0
    steps = 0
    while pending or running:
        while pending and len(running) < max_num_seqs:
            p, o = pending.pop()
            running.append([p, o])
        total_bytes += weight_bytes + kv_bytes_per_token * sum(ctx_len for ctx_len, _ in running)
        steps += 1
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    seconds = total_bytes / copy_bw
    return dict(steps=steps, bytes=total_bytes, seconds=seconds, tokens_per_s=sum(output_lens) / seconds)
