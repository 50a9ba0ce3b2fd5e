"""A drafter that costs less than the base model: options for the LoRA-off passes only.

The drafter's tokens are proposals; the LoRA-on verify pass decides what is committed, so a
cheaper, less accurate drafter keeps the output exact and only changes how many drafts are
accepted (the gate measures both: its costs are kept per drafter variant).

- ``vocab``: the drafter's output head restricted to a subset of the vocabulary (the tokens seen
  most often in the model's prompts and outputs so far, plus those of the current prompts; or a
  given list). Its logits for other tokens are the dtype's minimum, so it never proposes them;
  with sampling the draft distribution lives on the subset and speculative sampling stays exact.
  On a model whose head is a large part of its weights (Gemma 3: a 262k vocabulary) a draft pass
  then reads far fewer bytes.
- ``dtype``: the drafter's linear layers run with weights in a lower precision (bfloat16), where
  the CPU has fast kernels for them (AMX / AVX-512 BF16); activations are cast at each layer.

Installed for one call; the forwards act only for the calling thread and only in draft passes.
"""

from __future__ import annotations

import torch
from torch import nn

from .state import forwards

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


class Drafter:
    """The draft-pass options of one call (see the module docstring). ``active`` is set by the
    forward object: True during LoRA-off passes. ``variant`` names the options for the gate, which
    learns costs and acceptance per drafter: ``size`` is the vocabulary size asked for (the
    vocabulary itself also holds the prompts' tokens, so its length changes from call to call)."""

    def __init__(self, inner, state, mine, vocab: torch.Tensor | None = None, dtype=None, size: int | None = None):
        self.inner, self.state, self.mine = inner, state, mine
        self.vocab, self.dtype = vocab, dtype
        self.active = False
        self.head = _base(inner.get_output_embeddings())
        size = size if size is not None else None if vocab is None else len(vocab)
        self.variant = "".join([f"/vocab{size}" if vocab is not None else "", f"/{dtype}" if dtype else ""])

    def installed(self):
        routed = {}
        if self.dtype is not None:  # every linear layer, the head too (the restricted head below takes the dtype)
            for m in self.inner.modules():
                if type(m) is nn.Linear:
                    routed[m] = self._routed(m, self._low_precision(m))
        if self.vocab is not None:
            routed[self.head] = self._routed(self.head, self._restricted(self.head))
        return forwards(routed)

    def _routed(self, m, draft_forward):
        original = m.forward
        return lambda x, *a, **k: draft_forward(x) if self.active and self.mine() else original(x, *a, **k)

    def _weights(self, m, kind: str, key, make):
        """A derived copy of m's weights, kept in the model state while they are unchanged: one per
        module and kind ("dtype", "vocab"), so drafters of different kinds do not evict each other."""
        cache = self.state.drafter.setdefault("weights", {})
        w = m.weight
        tag = (key, id(w), w._version, w.data_ptr())
        hit = cache.get((id(m), kind))
        if hit is None or hit[0] != tag:
            hit = cache[(id(m), kind)] = (tag, make())
        return hit[1]

    def _low_precision(self, m):
        def forward(x):
            w, b = self._weights(m, "dtype", self.dtype, lambda: (m.weight.to(self.dtype),
                                                         None if m.bias is None else m.bias.to(self.dtype)))
            return nn.functional.linear(x.to(self.dtype), w, b).to(x.dtype)
        return forward

    def _restricted(self, head):
        vocab, dtype = self.vocab.to(head.weight.device), self.dtype or head.weight.dtype
        key = (dtype, vocab.cpu().numpy().tobytes())  # the ids themselves: another vocabulary is another head

        def forward(x):
            w, b = self._weights(head, "vocab", key, lambda: (head.weight[vocab].to(dtype),
                                                     None if head.bias is None else head.bias[vocab].to(dtype)))
            out = x.new_full((*x.shape[:-1], head.weight.shape[0]), torch.finfo(x.dtype).min)
            out[..., vocab] = nn.functional.linear(x.to(dtype), w, b).to(x.dtype)
            return out
        return forward


def _base(m):
    """The plain Linear under a LoRA wrapper (LoRA on the output head)."""
    return m.get_base_layer() if hasattr(m, "get_base_layer") else m
