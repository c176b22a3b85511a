"""A scripted stand-in for the Engine (its public API only), for tests of what drives one."""

from types import SimpleNamespace

from tokenmill.engine.types import FinishReason, RequestDelta, TokenLogprob, Usage


class ScriptedEngine:
    """Finishes each request `steps` steps after it was added, with one token per step."""

    def __init__(self, max_num_seqs=2, steps=2, refuse=(), drop=False):
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.served_model_name = "scripted"
        self.steps, self.refuse, self.drop = steps, set(refuse), drop
        self.live: dict[str, list] = {}  # request id -> [request, steps left]
        self.peak = 0

    def add(self, request):
        if request.prompt in self.refuse:
            raise ValueError(f"refused {request.prompt!r}")
        self.live[request.request_id] = [request, self.steps]
        self.peak = max(self.peak, len(self.live))

    def has_work(self):
        return bool(self.live) and not self.drop

    def step(self):
        deltas = []
        for rid, entry in list(self.live.items()):
            entry[1] -= 1
            if entry[1]:
                deltas.append(RequestDelta(rid, [7], "x"))
                continue
            del self.live[rid]
            logprobs = [TokenLogprob(7, "x", -0.5, []) for _ in range(self.steps)]
            deltas.append(RequestDelta(
                rid, [7], "x", finished=True, finish_reason=FinishReason.LENGTH,
                usage=Usage(prompt_tokens=3, completion_tokens=self.steps),
                output_token_ids=[7] * self.steps, output_text="x" * self.steps,
                # a job that asked for logprobs but gets none: the contract cannot say that
                output_logprobs=None if entry[0].prompt == "no logprobs" else logprobs,
            ))
        return deltas
