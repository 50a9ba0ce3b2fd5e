"""Which waiting requests of the serving engine (engine.py) take its free rows, and in which
prefill groups. Plain functions of the engine's queue and batch; called on the engine's thread.

Admission is first come, first served: the first request that must wait for a slot (at most
``max_loras`` adapters in a pass) or for its adapter to be loaded is not overtaken for one, and
the adapter in the batch that will be done first takes no new rows meanwhile, so it frees a slot
within that adapter's budgets.
"""

from __future__ import annotations

import torch

from ..model.walk import BASE


def pick(waiting, left: dict, free: int, max_loras: int | None, pool) -> tuple[list, str | None]:
    """The waiting requests (Handles, in arrival order) that take the ``free`` rows now, and the
    evicted adapter to load first (or None). ``left``: the batch's adapters -> the most tokens one
    of their rows has left (updated with the adapters picked); ``pool``: the adapter pool
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
