"""The bound on whitespace runs of "flexible" JSON, kept as a token mask beside the grammar's.

Why not in the grammar: llguidance compiles JSON whitespace as a skip lexeme between JSON tokens.
Before llguidance 1.8 a skip lexeme may follow itself, so a bounded `whitespace_pattern` such as
`[\\x20\\x0A\\x0D\\x09]{0,16}` still allows any run (16 + 16 + ...); 1.8 matches it once per gap.
vLLM's CPU build pins llguidance below 1.8, and one environment holds both, so the bound lives here
and reads the same on every version: the grammar allows any whitespace between JSON tokens, this
mask cuts every run outside strings at `max_run`.

The scan: a JSON text the grammar accepts is, after each byte, outside a string (with the length of
the whitespace run it ends in), inside one, or inside one right after a backslash (an escape takes
exactly one byte: \\uXXXX's hex digits are neither quote nor backslash). A state is one int:
0..max_run the run outside strings, then IN_STRING and ESCAPE. From each state a token's bytes lead
to one state, or break the bound; the table keeps, per state, the bitmask words of the tokens that
do not break it, in llguidance's layout (bit j of word w: token 32 * w + j).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

JSON_WHITESPACE = b" \n\r\t"  # JSON's whitespace, the bytes the grammar's skip lexeme takes
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
# Bytes that change the scan; a token without any resets the run outside strings and stays inside one.
_SCAN_BYTES = re.compile(rb'[ \n\r\t"\\]')
BROKEN = -1  # the token makes a run longer than max_run


class WhitespaceBound:
    """Per-token transitions and allowed-token masks of the scan, for one vocabulary."""

    def __init__(self, token_bytes: Sequence[bytes], max_run: int) -> None:
        self.max_run = max_run
        self.in_string = max_run + 1
        self.escape = max_run + 2
        n = len(token_bytes)
        # From outside a string with a run of r: the token's leading whitespace adds to r; after its
        # first other byte the outcome no longer depends on r (held in after_lead).
        self._lead = np.zeros(n, dtype=np.int64)
        self._all_whitespace = np.zeros(n, dtype=bool)
        self._after_lead = np.zeros(n, dtype=np.int64)  # end state from run 0 (BROKEN if broken)
        self._from_string = np.full(n, self.in_string, dtype=np.int64)
        self._from_escape = np.full(n, self.in_string, dtype=np.int64)
        for t, data in enumerate(token_bytes):
            if not data:
                self._from_escape[t] = self.escape  # takes nothing: the escape is still pending
                self._all_whitespace[t] = True
                continue
            if _SCAN_BYTES.search(data) is None:
                continue  # the defaults: run reset outside, still inside a string
            lead = len(data) - len(data.lstrip(JSON_WHITESPACE))
            self._lead[t] = lead
            self._all_whitespace[t] = lead == len(data)
            self._after_lead[t] = self.scan(0, data)
            self._from_string[t] = self.scan(self.in_string, data)
            self._from_escape[t] = self.scan(self.escape, data)
        self.allowed = self._allowed_words(n)

    def scan(self, state: int, data: bytes) -> int:
        """The state after `data` from `state`, or BROKEN when a run outside strings passes max_run."""
        for byte in data:
            if state == self.escape:
                state = self.in_string
            elif state == self.in_string:
                if byte == _QUOTE:
                    state = 0
                elif byte == _BACKSLASH:
                    state = self.escape
            elif byte in JSON_WHITESPACE:
                state += 1
                if state > self.max_run:
                    return BROKEN
            else:
                state = self.in_string if byte == _QUOTE else 0
        return state

    def next_state(self, state: int, token_id: int) -> int:
        """The state after the token, or BROKEN."""
        if state == self.in_string:
            return int(self._from_string[token_id])
        if state == self.escape:
            return int(self._from_escape[token_id])
        if state + self._lead[token_id] > self.max_run:
            return BROKEN
        if self._all_whitespace[token_id]:
            return state + int(self._lead[token_id])
        return int(self._after_lead[token_id])

    def _allowed_words(self, n: int) -> torch.Tensor:
        """int32 [max_run + 3, ceil(n / 32)]: row s has the bits of the tokens allowed in state s."""
        ok = np.empty((self.max_run + 3, n), dtype=bool)
        for run in range(self.max_run + 1):
            fits = run + self._lead <= self.max_run
            ok[run] = fits & (self._all_whitespace | (self._after_lead != BROKEN))
        ok[self.in_string] = self._from_string != BROKEN
        ok[self.escape] = self._from_escape != BROKEN
        words = (n + 31) // 32
        padded = np.zeros((ok.shape[0], words * 32), dtype=bool)
        padded[:, :n] = ok
        packed = np.packbits(padded, axis=1, bitorder="little")  # byte k, bit j: token 8 * k + j
        return torch.from_numpy(packed.view("<i4").copy())

    def restrict(self, bitmask: torch.Tensor, rows: Sequence[int], states: Sequence[int]) -> None:
        """Clear, in each of `rows` of the int32 bitmask, the tokens its state does not allow."""
        index = torch.tensor(rows, dtype=torch.long)
        bitmask[index] &= self.allowed[torch.tensor(states, dtype=torch.long)]


class BoundedMatcher:
    """A matcher of a flexible-whitespace JSON grammar and the scan state of the text it took in.
    Built at the grammar's start by the compile, and copied for each request like a matcher."""

    __slots__ = ("matcher", "state", "broken")

    def __init__(self, matcher, state: int = 0) -> None:
        self.matcher = matcher
        self.state = state
        self.broken = False  # a token took a run past the bound (the mask forbids it: a bug)

    def deep_copy(self) -> BoundedMatcher:
        return BoundedMatcher(self.matcher.deep_copy(), self.state)
