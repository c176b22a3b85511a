"""The interface between the engine and a constrained-decoding library.

A backend compiles a StructuredOutputsParams into a grammar (raising ConstraintError with the
library's reason when it cannot), makes a fresh matcher of a grammar for each request, and works
on matchers in batches: fill the bitmask rows of a step, advance each by its sampled token.
Matchers are the backend's own objects; the engine only hands them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tokenmill.engine.types import StructuredOutputsParams


class ConstraintError(Exception):
    """A constraint that cannot be used: a syntax error, an unsupported feature, a compile past
    the time limit. The message is the reason given to the user."""


class ConstraintBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (reusable by any number of requests); raises ConstraintError."""

    def new_matcher(self, grammar: Any) -> Any:
        """A matcher at the grammar's start, for one request."""

    def copy_matcher(self, matcher: Any) -> Any:
        """An independent matcher in the same state (a forked choice of an n > 1 request)."""

    def fill_bitmask(self, matchers: Sequence[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        """Write each matcher's allowed tokens into row `index` of the int32 CPU bitmask [K, W]."""

    def accept(self, matcher: Any, token_id: int) -> bool:
        """Advance the matcher by a sampled token; False when the grammar did not allow it."""

    def is_finished(self, matcher: Any) -> bool:
        """The grammar is complete and nothing more may follow."""

    def error(self, matcher: Any) -> str:
        """Why the matcher failed (after accept returned False)."""
