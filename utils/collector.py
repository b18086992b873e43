"""Python's garbage collector kept off the inner steps.

A training step makes thousands of short-lived Python objects (autograd nodes, tensor wrappers, transformers'
output dataclasses); each 700 allocations CPython runs a generation-0 collection, and every so often a full one
that walks every object alive: the models, the tokenizer, the datasets' tables. nanochat and modded-nanogpt keep the
collector out of their loops for the same reason. Here: once the run is built, `freeze_setup` moves every object
alive into the permanent generation (never walked again: a full collection then walks only what training made), and
`paused` disables automatic collection for a round's node work; collection runs again between rounds, where
reference cycles made during the round are freed. What it gains on this CPU: docs/running.md (Performance).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_setup() -> None:
    """Everything built so far (models, data, tokenizer) out of the collector's walks for the rest of the run. No
    collection first: in a long-lived process (a test session, a notebook) a full one walks every object of every
    earlier run; cyclic garbage frozen with the rest waits for `thaw`."""
    gc.freeze()


def thaw() -> None:
    """The training loop is over: the frozen objects become collectable again (a process that trains again, such
    as a test session, would otherwise keep every run's cycles)."""
    gc.unfreeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside (a round's node work); as it was after. Memory is not at risk: tensors are
    freed by reference counting, which the collector does not drive; only cycles wait until the round ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
