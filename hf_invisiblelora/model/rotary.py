"""Rotary embeddings whose frequencies depend on the sequence length (dynamic NTK, LongRoPE),
computed for every token as standard decoding computes them.

Standard decoding moves all rows one slot per step and calls the rotary module once per step with
the whole batch's position ids at that slot; these variants choose their frequencies from
max(position_ids) of that call (LongRoPE: short or long factors; dynamic NTK: a base grown to the
longest length seen, kept in module state). A pass here mixes rows at different slots, so the
module is called once per distinct slot with the position ids standard decoding passed at that
slot's step, from the state it had after the prefill, and each token takes its row's cos/sin.
After the call the module is left in the state standard decoding leaves it in.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerationMixin

from .routing import ALL


def length_dependent(module) -> bool:
    """A rotary module whose frequencies depend on max(position_ids) (Transformers' dynamic_rope_update)."""
    if "original_inv_freq" not in module._buffers and "original_inv_freq" not in vars(module):
        return False  # most modules: decided without nn.Module's slow attribute lookup
    rope_type = getattr(module, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return hasattr(module, "original_inv_freq") and any(
        isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def _snapshot(module):
    buffers = {n: b.clone() for n, b in module._buffers.items() if b is not None}
    attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, (int, float, torch.Tensor))}
    return buffers, attrs


def _restore(module, state):
    buffers, attrs = state
    for name, saved in buffers.items():
        current = module._buffers.get(name)
        if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
            current.copy_(saved)  # in place: the buffer keeps its address
        else:
            module._buffers[name] = saved.clone()
    for k, v in attrs.items():
        setattr(module, k, v)


def _parts(out) -> tuple:
    """A rotary module's output as a tuple: (cos, sin) for most, one complex tensor for some (Llama 4)."""
    return out if isinstance(out, tuple) else (out,)


def _each(out, f):
    """``f`` applied to each tensor of a rotary output, in the output's own structure."""
    return tuple(f(t) for t in out) if isinstance(out, tuple) else f(out)


class StepRotary:
    """Per-slot rotary embeddings for the length-dependent rotary modules of one call (among ``modules``).

    ``layout``: the call's RowLayout (the position table; its pass context: the pass's rows, query
    slots and prefix, and whether the running thread is the call's: other threads get the module as is).
    """

    def __init__(self, modules, layout):
        self.modules = [m for m in modules if length_dependent(m)]
        self.layout, self.context = layout, layout.context
        self.originals = {}  # module -> its forward before installation
        self.after_prefill = {}  # module -> state after the prompt's step
        self.calls = {}  # module -> (x, extra args, kwargs) of its calls in a pass (e.g. one per layer type)

    @contextlib.contextmanager
    def installed(self):
        """Route the modules through ``_forward`` in this call's passes (routing.py); on a clean exit
        leave them as standard decoding would (see ``finish``), on an exception as they were."""
        start = {m: _snapshot(m) for m in self.modules}
        self.originals = {m: m.forward for m in self.modules}
        routed = {m: (ALL, lambda original, x, position_ids, *args, _m=m, **kw: self._forward(_m, x, position_ids, *args, **kw))
                  for m in self.modules}
        try:
            with self.context.router.routing(routed):
                yield self
        except BaseException:
            for m in self.modules:
                _restore(m, start[m])
            raise

    def _forward(self, module, x, position_ids, *args, **kwargs):
        layout, p, original = self.layout, self.context, self.originals[module]
        self.calls.setdefault(module, {})[(args, tuple(sorted(kwargs.items())))] = x
        rows = slice(None) if p.rows is None else p.rows
        if p.prefix is not None:  # standard decoding's one call over slots [0, prefix)
            if module in self.after_prefill:
                _restore(module, self.after_prefill[module])
            out = original(x, layout.positions[:, : p.prefix], *args, **kwargs)
            self.after_prefill.setdefault(module, _snapshot(module))  # the first such call is the prompt's
            return _each(out, lambda t: t[rows, : p.q])
        slots = p.query  # [b, q]
        result = None
        for j in slots.unique().tolist():
            _restore(module, self.after_prefill[module])
            out = _each(original(x, layout.positions[:, j : j + 1], *args, **kwargs), lambda t: t[rows])  # slot j's step
            if result is None:
                result = _each(out, lambda t: t.new_empty(*slots.shape, *t.shape[2:]))
            r, t = (slots == j).nonzero(as_tuple=True)
            for dst, src in zip(_parts(result), _parts(out)):
                dst[r, t] = src[r, 0]
        return result

    def finish(self, prompt_len: int, new_tokens: int) -> None:
        """Leave each module as standard decoding does after ``new_tokens`` tokens: its last step fed
        slot P + new_tokens - 2 (the last token is never fed)."""
        last = prompt_len + new_tokens - 2
        for m, calls in self.calls.items():
            _restore(m, self.after_prefill[m])
            if new_tokens >= 2:
                for (args, kwargs), x in calls.items():
                    self.originals[m](x, self.layout.positions[:, last : last + 1], *args, **dict(kwargs))


def recompute_slot(inner, prompt_len: int) -> int | None:
    """The slot R at which standard decoding recomputes the whole cache, or None.

    The Phi-3 family's ``prepare_inputs_for_generation`` drops the cache when the sequence first
    reaches ``original_max_position_embeddings + 1`` tokens, so that every key is recomputed with
    the frequencies of the longer sequence (LongRoPE's long factors). Found by asking the model's
    own ``prepare_inputs_for_generation`` about that step; only rotary embeddings that depend on
    the length make the recomputed keys differ.
    """
    r = getattr(inner.config.get_text_config(decoder=True), "original_max_position_embeddings", None)
    if (r is None or r < prompt_len or not any(length_dependent(m) for m in inner.modules())
            or type(inner).prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation):
        return None
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, r, 1), torch.zeros(1, 1, r, 1), 0)  # r tokens cached
    step = inner.prepare_inputs_for_generation(torch.zeros(1, r + 1, dtype=torch.long), cache=cache,
                                               next_sequence_length=1, use_cache=True)
    return r if step["input_ids"].shape[1] == r + 1 else None


class Recompute:
    """Standard decoding's one-time recompute of the whole cache at slot R (``recompute_slot``):
    queries at slots >= R see every earlier key as that recompute computed it, queries before R
    see the keys as first computed. Per row: no token is committed from a query at or past R
    until the row's keys are recomputed (``cap``), and when a row's verify pass starts at R, its
    slots [0, R) are first recomputed as standard decoding's recompute pass computed them
    (``before_verify``)."""

    def __init__(self, slot: int, rows: int):
        self.slot = slot
        self.done = [False] * rows

    def cap(self, batch, hi: int, n, next_token, drafts):
        """Accepted drafts ``n`` and next tokens of rows 0..hi-1, cut so that rows not yet recomputed
        commit only tokens predicted from queries before R (an accepted draft is itself the next token)."""
        start = batch.ends(hi) - 1
        pending = torch.tensor([not d for d in self.done[:hi]], device=n.device)
        limit = torch.where(pending, (self.slot - 1 - start).clamp(min=0), n).minimum(n)
        cut = limit < n
        if bool(cut.any()):
            next_token = torch.where(cut, drafts.gather(1, limit.clamp(max=drafts.shape[1] - 1)[:, None])[:, 0], next_token)
        return limit, next_token

    def before_verify(self, fwd, batch) -> None:
        at = [r for r in batch.active if not self.done[r] and batch.rows[r].end - 1 == self.slot]
        if not at:
            return
        idx = torch.tensor(at, device=batch.tokens.device)
        start = torch.zeros(len(at), dtype=torch.long, device=idx.device)
        fwd(batch.tokens[idx, : self.slot], start, self.slot, keep=1, prefix=self.slot + 1, rows=idx)
        for r in at:
            self.done[r] = True
