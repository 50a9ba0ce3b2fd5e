"""Drafters: what proposes the tokens the LoRA-on verify pass checks.

A drafter's tokens are proposals; the verify pass decides what is committed, so any drafter
keeps the output exact and only changes how many drafts are accepted (the gate measures both:
costs and acceptance are kept per drafter ``key``). The protocol (``Drafter``):

    drafter.key                                  the gate's key for its costs and acceptance
    with drafter.installed(context, check): ...  whatever it routes in the model, for one call
                                                 (``check``: the call's source check, derived.py)
    plan = drafter.plan(batch, hi)               before the gate chooses: None (every row alike), or
                                                 a Plan: per row the class of what it can propose
                                                 (the gate learns acceptance per class), None: nothing
    drafts, probs = drafter.propose(fwd, batch, hi, k, policy, plan)
                                                 up to k tokens for rows 0..hi-1 (written into
                                                 batch.tokens) and the policy's draft
                                                 probabilities (speculative sampling) or None
                                                 (point masses, or greedy)
    drafter.learn(batch, hi, accepted)           after each commit: accepted drafts per row
    drafter.copy_of(module)                      (a drafter with passes) its own x -> y for a linear
                                                 layer in its passes, or None: the module as it is

``BaseModelDrafter``, the first implementation, is the shared base model itself (LoRA off),
optionally made cheaper. ``PromptLookupDrafter`` (prompt_lookup.py) runs no pass at all: it proposes what followed an
earlier occurrence of the row's last tokens in its own context (prompt lookup: Transformers'
``prompt_lookup_num_tokens``, vLLM's "ngram" method). A small separate model or an EAGLE-style
head (which reads the verify pass's hidden states) would each be another class. (Layer skipping
was measured and does not pay on the zoo's models: docs/benchmarks.md.)

The base model's options, for its passes only:

- ``vocab``: the drafter's output head restricted to a subset of the vocabulary (the tokens seen
  most often in the model's prompts and outputs so far, plus those of the current prompts; or a
  given list). Its logits for other tokens are the dtype's minimum, and after the processors
  they are -inf, so it never proposes them: with sampling the draft distribution lives on the
  subset and speculative sampling stays exact. Where the processors leave the subset no mass
  (bad words covering it, an n-gram ban), the row proposes nothing (acceptance.sample).
  On a model whose head is a large part of its weights (Gemma 3: a 262k vocabulary) a draft pass
  then reads far fewer bytes.
Given several dtypes (``draft_dtype=(None, torch.int4)``), one drafter per dtype is installed and
the gate picks one per cycle by its measured draft cost and acceptance (gate.py).

- ``dtype``: the drafter's linear layers run with weights in a lower precision (low_precision.py:
  bfloat16, float16, weight-only int8 or int4, and which of them pay on this CPU). Layers of a
  quantized base model (quantized.py) draft as they are.

Installed for one call: its layers' routes (routing.py) act only in its own draft passes.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Protocol

import torch
from peft.tuners.lora import LoraLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from ..model.derived import DerivedCopies, SourceCheck
from ..model.quantized import dense_weight, plain
from ..model.routing import draft
from ..model.walk import adapter_copies, linears, lora_layers
from . import low_precision

HEAD_FLOOR = {torch.int4: torch.int8}  # the output head's dtype under a lower draft dtype (_low_precision)
COUNTS = "token_counts"  # the model state's key: how often each token id was seen
def observe(state, ids: torch.Tensor, vocab_size: int) -> None:
    """Count the token ids of prompts and outputs (the draft vocabulary follows them)."""
    counts = state.drafter.get(COUNTS)
    if counts is None:
        counts = state.drafter[COUNTS] = torch.zeros(vocab_size, dtype=torch.long)
    ids = ids.reshape(-1).cpu()
    counts += torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)


def vocabulary(state, size: int, prompt_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens seen so far, and every token of the prompts (sorted ids)."""
    counts = state.drafter.get(COUNTS)
    ids = prompt_ids.reshape(-1).cpu()
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    if counts is not None:
        seen = counts.nonzero().squeeze(1)
        top = seen[counts[seen].argsort(descending=True)[:size]]
        ids = torch.cat([ids, top])
    return ids.unique()


def check_vocabulary(ids, inner) -> torch.Tensor:
    """A draft vocabulary given as token ids, validated against the model's output head: sorted unique ids."""
    vocab_size = _base(inner.get_output_embeddings()).weight.shape[0]
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"draft_vocab must be a list of integer token ids, got {type(ids).__name__}.") from None
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"draft_vocab must be a non-empty 1-D list of integer token ids, got {t.numel()} values "
                         f"of {t.dtype} in {t.dim()} dimension(s).")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise ValueError(f"draft_vocab holds token ids outside the model's vocabulary [0, {vocab_size}): "
                         f"from {int(t.min())} to {int(t.max())}.")
    return t.long().cpu().unique()


def fixed_vocabulary(draft_vocab, state, inner, vocab_size: int) -> tuple[torch.Tensor | None, int | None]:
    """A draft vocabulary fixed for a serving engine's life, and the size asked for (the drafter's
    ``size``): token ids as given (checked), or the ``draft_vocab`` most frequent tokens earlier
    generate(invisible_lora=True) calls on the model have seen; (None, None) for none."""
    if draft_vocab is None or isinstance(draft_vocab, (list, tuple, torch.Tensor)):
        return (None if draft_vocab is None else check_vocabulary(draft_vocab, inner)), None
    ids = vocabulary(state, draft_vocab, torch.zeros(0, dtype=torch.long), vocab_size)
    if not len(ids):
        raise ValueError(f"draft_vocab={draft_vocab} takes the tokens earlier generate(invisible_lora=True) calls on "
                         "this model have seen, and there were none; pass a list of token ids.")
    return ids, draft_vocab


class Drafter(Protocol):
    key: str
    passes: bool  # whether its proposals run draft passes of the model (compiled passes are built for them)

    def installed(self, context, check=None): ...

    def plan(self, batch, hi: int): ...

    def propose(self, fwd, batch, hi: int, k: int, policy, plan=None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def learn(self, batch, hi: int, accepted: list[int]) -> None: ...

    def ready(self) -> None: ...  # a drafter with passes: its copies made now, outside the timed (or compiled) pass


class BaseModelDrafter:
    """The base model with LoRA off drafts one token per row per pass, k passes a cycle, into the
    decoder's cache (the hybrid KV cache: the verify pass overwrites those slots). ``vocab``,
    ``dtype``: the cheaper head and linear layers of the module docstring (None: the model as it
    is). ``key`` names the options for the gate: ``size`` is the vocabulary size asked for (the
    vocabulary itself also holds the prompts' tokens, so its length changes from call to call)."""

    passes = True

    def __init__(self, model, state, vocab: torch.Tensor | None = None, dtype=None, size: int | None = None):
        inner = model.get_base_model()
        self.model, self.state = model, state
        self.vocab, self.dtype = vocab, dtype
        self._mask, self._routed, self._sources = None, {}, None
        self.head = _base(inner.get_output_embeddings())
        size = size if size is not None else None if vocab is None else len(vocab)
        self.key = "".join([f"/vocab{size}" if vocab is not None else "", f"/{dtype}" if dtype else ""])

    def plan(self, batch, hi: int) -> None:
        return None  # every row alike: its acceptance is its adapter's

    def propose(self, fwd, batch, hi: int, k: int, policy, plan=None):
        last = batch.ends(hi) - 1
        x = batch.tokens[:hi].gather(1, last[:, None])
        drafts, probs, rows = [], [], slice(0, hi)
        for j in range(k):
            logits = fwd(x, last + j, batch.kv_end(hi, 1) + j, keep=1, drafter=self, rows=rows)
            scores = policy.scores(batch, rows, logits, offset=j)[:, 0]
            if self.vocab is not None:  # its support: what processors made of the other tokens' floor is not drawn
                scores = scores.masked_fill(self._outside(scores), -torch.inf)
            d, q = policy.pick(scores, batch, rows, offset=j)
            if q is not None:
                probs.append(q)
            batch.tokens[:hi].scatter_(1, (last + 1 + j)[:, None], d[:, None])  # the next step and the processors read it
            drafts.append(d)
            x = d[:, None]
        if not drafts:  # k = 0: a plain step follows
            return batch.tokens.new_zeros(hi, 0), None
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)

    def _outside(self, scores) -> torch.Tensor:
        """[V] True for the tokens outside the draft vocabulary."""
        if self._mask is None or self._mask.shape[0] != scores.shape[-1] or self._mask.device != scores.device:
            self._mask = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
            self._mask[self.vocab.to(scores.device)] = False
        return self._mask

    def learn(self, batch, hi: int, accepted: list[int]) -> None:
        """Nothing to learn within a call: its proposals are the base model's. (The draft vocabulary
        follows the tokens of whole calls: ``observe``.)"""

    @contextlib.contextmanager
    def installed(self, context, check: SourceCheck | None = None):
        self.check = check or SourceCheck()
        routed = self._routed = {}
        if self.dtype is not None:  # every linear layer, the head too (the restricted head below takes the dtype)
            copies = adapter_copies(self.model)  # adapters' modules_to_save: draft passes run the originals
            for m in linears(self.model):
                if plain(m.weight) and m not in copies:  # quantized layers draft as they are
                    routed[m] = (draft(self.key), _route(lambda m=m: self._low_precision(m)))
            for layer in lora_layers(self.model):  # LoRA is off in a draft pass: straight to the base layer's route
                routed[layer] = (draft(self.key), _lora_off(layer.base_layer, routed.get(layer.base_layer)))
        if self.vocab is not None:
            routed[self.head] = (draft(self.key), _route(lambda: self._restricted(self.head)))
        self._sources = [t for m in routed for t in (getattr(m, "weight", None), getattr(m, "bias", None))]
        with context.router.routing(routed):  # in this drafter's passes only (routing.py)
            yield self

    def copy_of(self, m):
        """x -> what linear layer ``m`` (a LoRA layer or a plain Linear) gives in this drafter's passes,
        by its low-precision copy (one call: llama_pass.py); None if it has none."""
        entry = self._routed.get(m.get_base_layer() if isinstance(m, LoraLayer) else m)
        if entry is None or not isinstance(m, (nn.Linear, LoraLayer)):
            return None
        route = entry[1]
        return lambda x: route(None, x)

    def ready(self) -> None:
        """Make (or check) the copies now (Decoder.cycle, before a draft pass): not inside the pass the
        gate times, nor inside a compiled pass, which cannot hash them while it traces."""
        if self._sources:  # the weights read at once (derived.py), at the call's first draft pass
            self.check.prefetch(self._sources)
            self._sources = None
        for _, route in self._routed.values():
            route.ready()

    def _weights(self, m, kind, sources: tuple, make, dtype=None):
        """A derived copy of m's weights (derived.py), kept in the model state while its sources are
        unchanged: one per module, kind and draft dtype (``dtype``, default the drafter's), so drafters
        of different kinds, or several installed together, do not evict each other."""
        copies = self.state.drafter.get("weights")
        if copies is None:
            copies = self.state.drafter["weights"] = DerivedCopies()
        return copies.get(m, (kind, dtype or self.dtype), sources, make, self.check)

    def _low_precision(self, m):
        # The output head no lower than int8: the drafts are its argmax, and an int4 head costs more in
        # acceptance than it saves (docs/benchmarks.md: 0.79 against 0.915 with an int8 head).
        dtype = HEAD_FLOOR.get(self.dtype, self.dtype) if m is self.head else self.dtype
        return self._weights(m, "dtype", (m.weight, m.bias), lambda: low_precision.low_precision_linear(m.weight, m.bias, dtype),
                             dtype)

    def _restricted(self, head):
        vocab = self.vocab.to(head.weight.device)
        dtype = torch.bfloat16 if self.dtype in (torch.int8, torch.int4) else self.dtype or head.weight.dtype
        # The ids themselves are a source: another vocabulary is another head.
        w, b = self._weights(head, "vocab", (head.weight, head.bias, vocab, str(dtype)),
                             lambda: (dense_weight(head)[vocab].to(dtype),
                                      None if head.bias is None else head.bias[vocab].to(dtype)))

        def forward(x):
            out = x.new_full((*x.shape[:-1], head.weight.shape[0]), torch.finfo(x.dtype).min)
            out[..., vocab] = nn.functional.linear(x.to(dtype), w, b).to(x.dtype)
            return out
        return forward


class Plan(NamedTuple):
    """What a drafter can propose in one cycle, per row: ``labels[b]`` the class of row b's proposal
    (its acceptance is learned per class: the gate's key is the drafter's key + "/" + label), None
    where it has nothing to propose; ``detail``: what ``propose`` reads (the drafter's own)."""

    labels: list
    detail: object


def _route(make):
    """A draft pass's route to the layer ``make()`` gives, made (or its copy checked: derived.py) at
    the call's first draft pass: a call that never drafts neither makes nor reads the copies."""
    made = []

    def ready():
        if not made:
            made.append(make())

    def route(original, x, *args, **kwargs):
        ready()
        return made[0](x)
    route.ready = ready
    return route


def _lora_off(base, route):
    """A LoRA layer's route in draft passes: its base layer's output, from the base layer's own
    draft ``route`` (a low-precision copy) where it has one and nothing else runs around it: one
    Python call per layer, not the LoRA layer's forward and the base layer's module call."""
    def forward(original, x, *args, **kwargs):
        kwargs.pop("adapter_names", None)  # PEFT's generate() hooks pass it to every LoRA layer
        if route is None or args or kwargs or base._forward_hooks or base._forward_pre_hooks:
            return base(x, *args, **kwargs)
        return route[1](None, x)
    forward.ready = route[1].ready if route is not None else lambda: None
    return forward


def _base(m):
    """The plain Linear under a LoRA wrapper (LoRA on the output head), or the original under a
    modules_to_save wrapper (the head the base model drafts with; saved_modules.py)."""
    if isinstance(m, ModulesToSaveWrapper):
        return m.original_module
    return m.get_base_layer() if hasattr(m, "get_base_layer") else m
