"""Structured output: constraints (JSON Schema, regex, choice, grammar) compiled off the step and
applied as token bitmasks to the rows that sample.

- backend.py: the small interface a matcher library sits behind, and ConstraintError;
- llguidance_backend.py: the default (and only) backend;
- whitespace_bound.py: the bound on flexible JSON whitespace runs, a token mask of its own (a bound
  written in the grammar holds only from llguidance 1.8);
- compiler.py: compiles on a thread pool, cached by (kind, text, whitespace), with a time limit;
- constraints.py: the engine's side: requests waiting for their matcher, the bitmask of a step,
  the matcher advanced by each token taken in.
"""
