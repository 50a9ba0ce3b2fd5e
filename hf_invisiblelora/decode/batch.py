"""The rows of one shared cache: each row's record (``Row``: its phase, its counts, its adapter, its
drafts) and the batch's tokens, and ``commit``, which appends a pass's accepted tokens to them.

The host records are what the loop decides by; the passes read the device copies of the counts
(``Batch.plen``, ``Batch.gen``), made again by ``Batch.sync`` after the host changed them (one copy
per cycle: ``commit`` ends with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .processors import expired, first_stop


class Phase(enum.Enum):
    FREE = "free"  # holds no work (a cycle may run it along, masked)
    PREFILLING = "prefilling"  # its prompt goes in in chunks (Decoder.prefill): cycles leave it out
    DECODING = "decoding"
    DONE = "done"  # finished (its budget, a stop) and not freed yet: generate()'s rows ride along


@dataclass
class Row:
    """One row: ``plen`` prompt slots (its group's left-padded width), ``gen`` tokens committed of its
    budget ``max_new``; ``stop_at``: the number of tokens at which a stopping criterion stopped it when
    stopped rows are not frozen (``generate()`` without an EOS token: standard decoding then keeps
    generating real tokens until every row has stopped); ``adapter``: the adapter key its passes use
    (None: free); drafts drafted and accepted, and cycles taken part in."""

    phase: Phase = Phase.FREE
    plen: int = 0
    gen: int = 0
    max_new: int = 0
    stop_at: int | None = None
    adapter: str | None = None
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0

    @property
    def decoding(self) -> bool:
        return self.phase is Phase.DECODING

    @property
    def end(self) -> int:
        """The slot after its last committed token."""
        return self.plen + self.gen

    @property
    def left(self) -> int:
        """Tokens it may still commit."""
        return self.max_new - self.gen


@dataclass
class Batch:
    """The rows of one cache: their tokens [C, W] and records, and the device copies of the counts."""

    tokens: torch.Tensor
    plen: torch.Tensor
    gen: torch.Tensor
    rows: list = field(default_factory=list)

    @classmethod
    def empty(cls, capacity: int, width: int, pad_id: int, device) -> "Batch":
        zeros = torch.zeros(capacity, dtype=torch.long, device=device)
        return cls(torch.full((capacity, width), pad_id, dtype=torch.long, device=device), zeros, zeros.clone(),
                   [Row() for _ in range(capacity)])

    def load(self, idx: list[int], input_ids: torch.Tensor, max_new: list[int]) -> None:
        """Rows ``idx`` start on ``input_ids`` [n, P] (left-padded) with budgets of ``max_new`` tokens."""
        p = input_ids.shape[1]
        self.tokens[idx, :p] = input_ids.to(self.tokens.dtype)
        for r, m in zip(idx, max_new):
            row = self.rows[r]
            row.phase, row.plen, row.gen, row.max_new, row.stop_at = Phase.DECODING, p, 0, m, None
        self.sync()

    def sync(self) -> None:
        """Device copies of the host counts (after the host changed them)."""
        self.plen = torch.tensor([row.plen for row in self.rows], device=self.tokens.device)
        self.gen = torch.tensor([row.gen for row in self.rows], device=self.tokens.device)

    @property
    def active(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row.decoding]

    @property
    def hi(self) -> int:
        """Rows 0..hi-1 hold every active row: the span a cycle runs."""
        active = self.active
        return active[-1] + 1 if active else 0

    def ends(self, hi: int) -> torch.Tensor:
        """[hi] slot after each row's last committed token."""
        return self.plen[:hi] + self.gen[:hi]

    def kv_end(self, hi: int, extra: int) -> int:
        """Slots a pass over rows 0..hi-1 attends to when each writes ``extra`` tokens past its end - 1."""
        return max(row.end for row in self.rows[:hi]) - 1 + extra


def commit(batch: Batch, hi: int, n, next_token, k: int, eos, criteria, freeze: bool, members=None,
           time_limits=(), scores=None):
    """Append each member row's accepted drafts + next token, cut at EOS / stopping criteria / the
    row's budget. ``n``, ``next_token``: [hi]; ``members``: the rows committing (default: the
    active rows among 0..hi-1); the others keep nothing.

    ``freeze``: a stopped row is finished (its later tokens are padding), as in standard decoding
    when a criterion has an ``eos_token_id``; otherwise it keeps generating until every row has
    stopped. ``time_limits``: generate()'s max_time criteria; once one has passed, every row ends at
    one length, as standard decoding's batch ends at the step the time ran out: the shortest length
    a row still generating has reached (rows ahead of it drop what they hold beyond it). ``scores``:
    what the criteria are handed as ``scores`` (None, or a processors.ScoreHistory).
    Returns the host lists (kept per row, accepted drafts per row): the cycle's one device sync
    (two when stopping criteria beyond EOS and the budget are set).
    """
    rows = batch.rows
    members = [r for r in range(hi) if rows[r].decoding] if members is None else members
    tokens, end = batch.tokens[:hi], batch.ends(hi)
    tokens.scatter_(1, (end + n)[:, None], next_token[:, None])
    member = torch.zeros(hi, dtype=torch.bool, device=tokens.device)
    member[members] = True
    budget = torch.tensor([row.max_new for row in rows[:hi]], device=tokens.device) - batch.gen[:hi]
    committed = torch.where(member, n + 1, 0).minimum(budget)
    stopped = torch.zeros_like(member)
    if eos is not None:
        offsets = torch.arange(k + 1, device=tokens.device)
        new = tokens.gather(1, end[:, None] + offsets)
        hit = torch.isin(new, eos) if eos.dim() == 1 else (new[:, :, None] == eos[:hi, None, :]).any(-1)
        is_eos = hit & (offsets < committed[:, None])
        stopped = is_eos.any(1)
        committed = torch.where(stopped, is_eos.long().argmax(1) + 1, committed)
    committed_h, stopped_h, n_h = torch.stack([committed, stopped.long(), n]).tolist()
    if criteria:
        plens, gens = [row.plen for row in rows[:hi]], [row.gen for row in rows[:hi]]
        for r, s in enumerate(first_stop(criteria, tokens, plens, gens, committed_h, scores)):
            if s is not None:
                committed_h[r], stopped_h[r] = s, 1
    for r in members:
        row = rows[r]
        row.gen += committed_h[r]
        if stopped_h[r] and row.stop_at is None:
            row.stop_at = row.gen
    if time_limits and expired(time_limits, tokens):
        _end_batch(batch, hi, committed_h, freeze)
    else:
        # Without freezing (generate(), whose rows 0..hi-1 are its batch), every row generates up to
        # the last row's stop once all have stopped.
        stops = [row.stop_at for row in rows[:hi]]
        limit = None if freeze or None in stops else max(stops)
        for r in members:
            row = rows[r]
            done = freeze and row.stop_at is not None or row.gen >= (row.max_new if limit is None else limit)
            row.phase = Phase.DONE if done else Phase.DECODING
    batch.gen = torch.tensor([row.gen for row in rows], device=tokens.device)
    return committed_h, n_h


def _end_batch(batch: Batch, hi: int, committed_h: list, freeze: bool) -> None:
    """Every row of 0..hi-1 ends at the shortest length of a row still generating real tokens (rows
    finished and padded do not count); nothing to cut if none is."""
    rows = batch.rows[:hi]
    going = [row.gen for row in rows if row.decoding and not (freeze and row.stop_at is not None)]
    if going:
        end = min(going)
        for r, row in enumerate(rows):
            committed_h[r] -= max(0, row.gen - end)
            row.gen = min(row.gen, end)
            if not freeze:  # the batch's output ends here
                row.stop_at = end
    for row in rows:
        if row.phase is not Phase.FREE:
            row.phase = Phase.DONE
