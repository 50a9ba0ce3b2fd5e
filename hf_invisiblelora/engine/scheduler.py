"""Which waiting requests of the serving engine (engine.py) join its rows, and how their prompts get into
the cache, as vLLM v1's scheduler decides them. On the engine's thread, between cycles.

    scheduler.admit(decoder)           # waiting requests take free rows; returns an evicted adapter to load first
    joining = scheduler.next_chunk(decoder, fold=...)  # a chunk of a long prompt, in the cycle's verify pass
    scheduler.cycled(decoder, joining, committed)      # after the cycle

Admission is first come, first served (``pick``): the first request that must wait for a slot (at
most ``max_loras`` adapters in a pass) or for its adapter to be loaded is not overtaken for one, and
the adapter in the batch that will be done first takes no new rows meanwhile, so it frees a slot
within that adapter's budgets. The joining requests are prefilled in groups whose prompts,
left-padded to the group's longest, leave every row room for its budget and the drafts
(``prefill_groups``). A prompt that starts with blocks the prefix cache keeps (prefix_cache.py) is
prefilled from where they end. A prompt of more than ``prefill_chunk`` tokens goes in chunks of at
most that many, one a cycle, so that rows that decode never wait for a whole long prompt; a short
prompt, or a chunk, rides in the cycle's verify pass (a ragged pass, as vLLM's and SGLang's chunked
prefill mixes prompt and decode tokens in a step) where that pass stays small enough for it to pay
(``FOLD_SLOTS``), else it takes a pass of its own. A failure ends only the requests it involves.
"""

from __future__ import annotations

import collections
import logging

import torch

from ..decode.batch import Phase
from ..model.layout import prompt_positions
from ..model.prepack import available_bytes
from ..model.walk import BASE
from .prefix_cache import BLOCK, PrefixCaching
from .request import Status
from .rows import Rows

logger = logging.getLogger("hf_invisiblelora")
# Engine(prefix_cache_bytes=) by default: 1 GiB, at most a quarter of the memory available at start.
PREFIX_CACHE_BYTES = 1 << 30
# The most query positions (rows of the pass x the chunk's width) of a verify pass that a joining
# prompt's chunk rides in: the pass is rectangular outside the linear layers (its norms, activations
# and attention run every row over the chunk's width), which costs more than the pass of its own it
# saves once the rectangle is large. Measured on SmolLM2 on a 2-core CPU (benchmarks/bench_fold.py;
# docs/benchmarks.md, "One pass per engine cycle"): 8 rows x 4-16 slots, 4 x 16 and 2 x 8-32 folded
# 1-29% cheaper than a cycle plus a prefill of its own, 8 x 48 40% dearer (an AMD EPYC; on an Intel
# Xeon with AMX 8 x 8 and 4 x 16 13-17% cheaper, 8 x 48 23% dearer). A larger chunk takes a pass of its own.
FOLD_SLOTS = 128


class Scheduler:
    """The engine's admission and prefills (see the module docstring). ``waiting``: the engine's queue
    of Handles, changed under ``lock`` (client threads append to it); ``pool``: its AdapterManager;
    ``policy``: its RequestPolicy; ``count(**added)``: adds to its metrics; ``stops(request)``: a
    request's stop token ids. ``rows``: the requests in the rows (rows.py)."""

    def __init__(self, limits, num_draft_tokens: int, pad_id: int, device, waiting, lock, pool, policy, count, stops):
        self.limits, self.pad_id, self.device = limits, pad_id, device
        self.room = limits.max_len - num_draft_tokens - 1  # a row's slots less the drafts'
        self.waiting, self.lock, self.pool, self.policy, self.stops = waiting, lock, pool, policy, stops
        self.rows = Rows(limits.max_batch, policy, pool, count, self.room, ended=self.ended)
        self.chunked = collections.deque()  # [group, slots done]: prompts being prefilled in chunks
        self.prefix = None  # PrefixCaching while the engine's thread runs (None: off)

    def start(self, session, model) -> None:
        """The engine's thread starts: prefix caching on, where the options and the model allow it."""
        self.prefix = None
        if not self.limits.prefix_caching:
            return
        if not session.decoder.chunkable:
            logger.warning("hf_invisiblelora engine: prefix caching is off: the model has windowed cache layers "
                           "(sliding-window attention), whose prompts are prefilled whole.")
            return
        size = self.limits.prefix_cache_bytes
        if size is None:
            room = available_bytes()
            size = PREFIX_CACHE_BYTES if room is None else min(PREFIX_CACHE_BYTES, room // 4)
        logger.info("hf_invisiblelora engine: prefix caching on, in at most %d MB", size >> 20)
        self.prefix = PrefixCaching(model, size, session.check)

    def admit(self, decoder) -> str | None:
        """Waiting requests take the free rows (``pick``), in prefill groups that fit; returns the
        evicted adapter to load before the first waiting request can join, or None."""
        free = self.rows.free()
        if not free:
            return None
        with self.lock:
            picked, needed = pick(self.waiting, self.rows.most_left(decoder), len(free), self.limits.max_loras,
                                  self.pool)
            for h in picked:
                self.waiting.remove(h)
                h.ref = self.pool.ref(h.request.adapter)  # the revision it decodes with, whatever comes after
        joining = list(zip(free, picked))
        if not joining:
            return needed
        try:
            cached, joining = ([], joining) if self.prefix is None else self.prefix.lookup(joining)
            groups = prefill_groups(joining, self.room)
        except Exception as e:  # noqa: BLE001 - the joining requests are involved
            self.rows.fail(decoder, joining, "admission", e)
            return needed
        for pair, blocks in cached:  # each alone: its prompt's slots start where its cached blocks do
            self._prefill(decoder, [pair], blocks)
        for group in groups:
            self._prefill(decoder, group)
        return needed

    def _prefill(self, decoder, group: list, blocks=()) -> None:
        """A group's prefill (Decoder.admit): in one pass, then delivery of their first tokens; or, when
        its prompt tokens are more than ``prefill_chunk`` or it folds, its rows loaded and queued for
        their chunks (``next_chunk``). ``blocks``: a group of one whose prompt starts with these cached
        blocks, written into its slots and not prefilled."""
        self.rows.take(group)
        cached = len(blocks) * BLOCK
        chunk = self.limits.prefill_chunk
        try:
            ids, mask = left_padded([h.request.prompt for _, h in group], self.pad_id, self.device)
            width = ids.shape[1] - cached
            for r, h in group:
                stops = self.stops(h.request)
                decoder.set_stops(r, stops)
                self.policy.set_request(r, h.request, stops)
                if self.prefix is not None:
                    self.prefix.admitted(r)
            folded = self._folds(decoder, group, width)
            chunked = decoder.chunkable and (folded or chunk is not None and len(group) * width > chunk)
            if blocks:
                decoder.fwd.cache.write(group[0][0], 0, blocks)
            # max_tokens 0 (the prompt's log-probabilities only): decoded as 1, nothing delivered (Rows.deliver)
            committed = decoder.admit([r for r, _ in group], ids, mask, prompt_positions(mask, ids),
                                      [max(h.request.max_tokens, 1) for _, h in group],
                                      [h.ref.key for _, h in group], upto=0 if chunked else None, cached=cached)
        except Exception as e:  # noqa: BLE001 - only the group is involved; the rows decoding go on
            self.rows.fail(decoder, group, "prefill", e)
            return
        if committed is None:
            self.chunked.append([group, cached])
            return
        self._prefilled(decoder, group, committed)

    def _folds(self, decoder, group: list, width: int) -> bool:
        """Whether a chunk of ``width`` prompt slots of ``group`` rides in the next cycle's verify pass:
        rows decode, the pass (rows 0 .. the last of the group's or the decoding ones) times the width
        is within FOLD_SLOTS, and the requests want no prompt log-probabilities (which a pass of their
        own computes)."""
        rows = [r for r, _ in group]
        span = max(decoder.batch.hi, max(rows) + 1)
        return bool(decoder.batch.active) and span * width <= FOLD_SLOTS and not self.policy.wants_prompt(rows)

    def next_chunk(self, decoder, fold: bool):
        """The next chunk of the oldest group being prefilled in chunks (its requests still in their
        rows: cancelled ones are gone): (group, start, end) for the cycle's verify pass if ``fold``
        and it fits there, else run in a pass of its own, None returned; its last chunk delivers the
        rows' first tokens. None when no prompt waits for chunks."""
        if not self.chunked:
            return None
        entry = self.chunked[0]
        group, done = entry
        group = entry[0] = [(r, h) for r, h in group if self.rows.handles[r] is h]
        if not group:
            self.chunked.popleft()
            return None
        width = decoder.rows[group[0][0]].plen
        budget = self.limits.prefill_chunk or width * len(group)
        end = min(done + max(budget // len(group), 1), width)
        if fold and self._folds(decoder, group, end - done):
            return group, done, end
        try:
            committed = decoder.prefill([r for r, _ in group], done, end)
        except Exception as e:  # noqa: BLE001 - only the group is involved
            self.chunked.popleft()
            self.rows.fail(decoder, group, "prefill", e)
            return None
        entry[1] = end
        if committed is not None:
            self.chunked.popleft()
            self._prefilled(decoder, group, committed)
        return None

    def cycled(self, decoder, joining, committed) -> None:
        """After a cycle (``committed``: Decoder.cycle's) that ran ``joining`` (``next_chunk``'s, or
        None): the chunk is done; its group's first tokens delivered once its prompts are in, and the
        cycle's tokens to the decoding rows."""
        if joining is not None:
            group, _, end = joining
            self.chunked[0][1] = end
            if decoder.rows[group[0][0]].phase is not Phase.PREFILLING:  # its prompts are in: their first tokens too
                self.chunked.popleft()
                self._prefilled(decoder, group, committed)
                return
        self.rows.deliver(decoder, committed)

    def failed(self, decoder, joining, error: Exception) -> None:
        """A cycle raised: its requests end with "error" (Rows.fail). Rows waiting for their prompt's
        chunks were not in it (but the joining group, whose chunk was): a cycle writes their slots only
        from their last prompt slot on, which their last chunk writes again."""
        group = joining[0] if joining is not None else []
        if joining is not None:
            self.chunked.popleft()
        self.rows.fail(decoder, [(r, h) for r, h in self.rows.taken() if decoder.rows[r].phase is not Phase.PREFILLING or (r, h) in group],
                       "decoding", error)

    def _prefilled(self, decoder, group: list, committed: list[int]) -> None:
        """A group's prompts are in the cache: their blocks are kept (prefix caching), their first
        tokens delivered."""
        for r, h in group:
            self._keep_blocks(decoder, r, h, 0)
        self.rows.prefilled(decoder, group, committed)

    def ended(self, decoder, r: int, h) -> None:
        """Row r's request ends (Rows.release, before its row is freed): the blocks of its prompt and
        output are kept (prefix caching) if it decoded."""
        if self.prefix is not None:
            if h.status == Status.DECODING and h.finish_reason is None:
                self._keep_blocks(decoder, r, h, decoder.rows[r].gen - 1)
            self.prefix.released(r)

    def _keep_blocks(self, decoder, r: int, h, output: int) -> None:
        """Keep the blocks of row r's prompt and its first ``output`` generated tokens (a failure here is
        logged and costs only the blocks)."""
        if self.prefix is None:
            return
        try:
            width = decoder.rows[r].plen  # the prompt's slots end where its group's (left-padded) width does
            tokens = h.request.prompt + (decoder.batch.tokens[r, width : width + output].tolist() if output > 0 else [])
            self.prefix.keep(decoder.fwd.cache, r, h.ref.key, tokens, width - len(h.request.prompt))
        except Exception:  # noqa: BLE001 - the blocks are an optimization; the requests go on
            logger.exception("hf_invisiblelora engine: keeping prompt blocks failed")


def pick(waiting, left: dict, free: int, max_loras: int | None, pool) -> tuple[list, str | None]:
    """The waiting requests (Handles, in arrival order) that take the ``free`` rows now, and the
    evicted adapter to load first (or None). ``left``: the batch's adapters -> the most tokens one
    of their rows has left (updated with the adapters picked); ``pool``: the adapter manager
    (adapters.py).

    A request whose adapter is not in the batch needs a slot and its adapter loaded. The first one
    that cannot have them yet blocks: no request after it gets a slot first, and the batch's
    adapter whose rows have the fewest tokens left at most (the ``target``) takes no new rows, so
    it is done within that many cycles and frees a slot (and, evicted, room to load); the requests
    that need neither and are not the target's still join. Its adapter is loaded at once if the
    pool has room for it."""
    picked, needed, target, blocked = [], None, None, False
    names = {h.request.adapter for h in waiting}
    for h in waiting:
        if len(picked) == free:
            break
        a = h.request.adapter
        if a == BASE or a in left:
            if a != target:
                picked.append(h)
            continue
        if blocked:
            continue
        slot = max_loras is None or len(left) < max_loras
        loaded = pool.loaded(a)
        if loaded and slot:
            picked.append(h)
            left[a] = h.request.max_tokens
            continue
        blocked = True
        room = loaded or pool.has_room() or bool(pool.evictable(a, left, names, idle=False))
        if not loaded and room:
            needed = a
        if not (slot and room):  # wait for an adapter of the batch to be done (one that can be evicted, for room)
            target = min((b for b in left if room or pool.restorable(b)), key=left.get, default=None)
    return picked, needed


def prefill_groups(joining: list, room: int) -> list[list]:
    """Split the joining (row, handle) pairs into prefill groups whose rows all fit in ``room``
    slots (a row's slots less the drafts' room).

    A group's prompts are left-padded to its longest one, P slots, so each of its rows needs
    P + max_tokens slots (validation checks a request's own prompt length: prompt + max_tokens <=
    max_request_tokens <= room; positions follow each row's own tokens, so padding costs slots,
    not positions). The fewest groups: take the longest prompt left, P; every request left whose
    max_tokens fits next to P joins it; repeat (every group must hold the longest prompt left, and
    this one holds all that could join it). Each request fits in a group of its own, so every
    validated request is admitted; groups go in the order of their first request, each in FIFO order."""
    left, groups = list(joining), []
    while left:
        longest = max(left, key=lambda rh: len(rh[1].request.prompt))
        width = len(longest[1].request.prompt)
        group = [rh for rh in left if rh is longest or width + rh[1].request.max_tokens <= room]
        groups.append(group)
        left = [rh for rh in left if all(rh is not g for g in group)]
    return sorted(groups, key=lambda g: joining.index(g[0]))  # FIFO: by each group's first request


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill group's prompts as generate() takes a batch: ids [n, longest], left-padded with
    ``pad_id`` (a row's slots follow its own positions), and their attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    return ids, mask
