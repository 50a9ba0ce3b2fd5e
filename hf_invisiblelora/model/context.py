"""The pass context: what one model pass is about, set in one place for each pass (the forward
object, forward.py) and read by what the model calls during it, as vLLM's ``set_forward_context``:

    rows      the decoder rows the pass runs: None (all), slice(0, b) (the first b) or an index
              tensor (some: a prefill)
    start     [b] the slot each row's first token is written at
    q         tokens per row of the pass's input [b, q]
    lens      [b] how many of a row's q tokens are real (None: all: the rectangular pass, the
              fast case); a row's others are padding: not written to the cache, their logits dropped
    kv_len    the slots attended to (the first kv_len)
    prefix    L if the pass computes its slots as standard decoding's one call over slots [0, L)
              did (a prompt's pass: P), else None
    drafter   the drafter whose pass it is (drafters.py), or None: LoRA on, each row its adapter
    adapters  the rows' adapters as the LoRA switch gives them: the bank's slot tensor, or metadata
              of fixed shape (compiled passes) (switch.py)
    query     [b, q] the slot of every query token (derived)

Readers: the cache's writes (cache.py), the attention masks (layout.py), and ``router``
(routing.py): the one router of the context's passes, through which the rotary embeddings
(rotary.py), the LoRA layers (bank.py, switch.py), the modules adapters train whole
(saved_modules.py), the prepacked layers (prepack.py) and the drafters' layers (drafters.py) are
routed. One context per decoder; each reader holds it from the call's start. ``mine()``: a pass
of this context is running on this thread (the model state's owner thread, state.py: the one
owner check). The router acts only then: another thread running the model meanwhile, or the
call's own thread between passes (a user's processor running the model), gets every layer as it is.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .routing import Router

_THREAD = threading.local()  # the pass running on this thread, if any (SDPA's GQA switch reads it: layout.py)


class PassContext:
    def __init__(self, owner):
        self.owner = owner  # the model state's owner check (state.ModelState.mine)
        self.router = Router(self)  # what each module computes in these passes (routing.py)
        self.clear()

    def mine(self) -> bool:
        return self.start is not None and self.owner()

    def clear(self) -> None:
        self.rows = self.start = self.lens = self.prefix = self.drafter = self.adapters = self.query = None
        self.q = self.kv_len = 0
        self.write_rows = self.write_slots = self.real = None
        self.real_count = 0

    @contextlib.contextmanager
    def running(self, start: torch.Tensor, q: int, kv_len: int, *, rows=None, lens=None, prefix=None, drafter=None,
                adapters=None):
        """The block is one pass with these fields (the module docstring); cleared after it."""
        self.rows, self.start, self.q, self.lens, self.kv_len = rows, start, q, lens, kv_len
        self.prefix, self.drafter, self.adapters = prefix, drafter, adapters
        self.query = start[:, None] + torch.arange(q, device=start.device)
        before, _THREAD.context = getattr(_THREAD, "context", None), self
        try:
            yield self
        finally:
            _THREAD.context = before
            self.clear()

    def prepare_writes(self, capacity: int) -> None:
        """Where the pass's keys and values go (read by each cache layer's update): rows x slots
        start[b] .. start[b] + q - 1, or only each row's first lens[b] of them. Called inside the
        pass (a compiled one derives them from its own inputs: ``start`` is its bucket's buffer)."""
        rows, start = self.rows, self.start
        if rows is None or isinstance(rows, slice):  # the first rows (the cache's view, no copy)
            rows = torch.arange(start.shape[0], device=start.device)
        slots = start[:, None] + torch.arange(self.q, device=start.device)
        if self.lens is None:
            self.write_rows, self.write_slots, self.real = rows[:, None], slots, None
        else:
            self.real = torch.arange(self.q, device=start.device) < self.lens[:, None]  # [b, q]
            self.write_rows, self.write_slots = rows[:, None].expand_as(slots)[self.real], slots[self.real]
            self.real_count = self.write_slots.numel()  # the real tokens, without a sync of their own
        if isinstance(self.rows, slice) and self.rows == slice(0, capacity):
            self.rows = None


def real_tokens(context, x: torch.Tensor):
    """The [b, q] mask of the real tokens when ``x`` holds a ragged pass's tokens per row ([b, q, ...]:
    the pass context's ``real``), else None: in such a pass the linear layers compute the real
    tokens only (``on_real``), so a chunk of one row's prompt next to others' single tokens costs
    its tokens, not rows x the chunk's length."""
    real = context.real
    return real if real is not None and x.shape[: real.dim()] == real.shape else None


def on_real(x: torch.Tensor, real: torch.Tensor, fn) -> torch.Tensor:
    """Semantics: out[b, t] = fn(x[real])[i] for the i-th real token (b, t); 0 at padding."""
    y = fn(x[real])
    out = y.new_zeros(*real.shape, *y.shape[1:])
    out[real] = y
    return out


def in_pass() -> bool:
    """Whether this thread is running one of our passes now."""
    return getattr(_THREAD, "context", None) is not None


def selected(values: list, rows) -> list:
    """The entries of ``values`` (one per decoder row) of a pass's ``rows``."""
    if rows is None:
        return values
    return values[rows] if isinstance(rows, slice) else [values[r] for r in rows.tolist()]
