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

``BaseModelDrafter``, the first implementation, is the shared base model itself (LoRA off),
optionally made cheaper. ``PromptLookupDrafter`` runs no pass at all: it proposes what followed an
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

- ``dtype``: the drafter's linear layers run with weights in a lower precision: bfloat16 or
  float16 (activations cast at each layer), or weight-only int8 (per output channel) or int4 (per
  group of 32 inputs, PyTorch's CPU kernels ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``,
  bfloat16 activations), which read 4x / 8x fewer weight bytes than float32. Which is faster
  depends on the CPU's kernels (benchmarks/bench_draft_kernels.py); a layer whose shape the int8
  or int4 kernel does not take runs in bfloat16. Layers of a quantized base model (quantized.py) draft as
  they are.

Installed for one call: its layers' routes (routing.py) act only in its own draft passes.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Protocol

import numpy as np
import torch
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from .. import tuning
from ..model.derived import DerivedCopies, SourceCheck
from ..model.prepack import available_bytes
from ..model.quantized import dense_weight, plain
from ..model.routing import draft
from ..model.walk import adapter_copies, linears

COUNTS = "token_counts"  # the model state's key: how often each token id was seen
DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.int4)  # draft_dtype's choices
INT4_GROUP = 32
# _weight_int8pack_mm takes in_features in multiples of this: torch 2.13 on the CPU segfaults for
# in_features 8, 24, 40 (or 4, 33) with more than one row (found by the architecture sweep:
# Gemma-3n's AltUp layers, 4 inputs); every multiple of 16 tried ran (16 to 576, 1 to 33 rows).
INT8_WIDTH = 16


# draft_dtype="auto" (the default) on the CPU: the full base model and those of its bfloat16, int8 and
# int4 copies whose matmuls are faster than full precision on this CPU (``auto_dtypes``: measured),
# the two fastest at most; the gate picks among them per cycle by measured cost and acceptance.
AUTO = (torch.bfloat16, torch.int8, torch.int4)
AUTO_KEEP = 2
SAMPLE = 4  # layers of a shape timed (their time scaled to the model's count of them)


def check_dtype(dtype, model, compiled: bool = False) -> tuple:
    """``draft_dtype`` checked: a draft dtype the model's device has kernels for (the weight-only ones
    are PyTorch's CPU kernels), or a tuple / list of them (None: full precision) for the gate to
    choose among, or "auto" (``auto_dtypes``; the model as it is for a call on ``compiled`` passes,
    which would compile a draft pass per drafter and which warm_up builds for that drafter).
    Returns the choices as a tuple."""
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ValueError(f"draft_dtype must be \"auto\", a dtype or a list of them, got {dtype!r}.")
        return (None,) if compiled else auto_dtypes(model)
    choices = tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype,)
    if not choices or len(set(choices)) != len(choices):
        raise ValueError(f"draft_dtype as a list needs distinct choices (None: full precision), got {dtype!r}.")
    for d in choices:
        if d is not None and d not in DTYPES:
            raise ValueError(f"draft_dtype must be one of {[str(d) for d in DTYPES]} (or a list of them and None), "
                             f"got {d!r}.")
        if d in (torch.int8, torch.int4) and model.device.type != "cpu":
            raise ValueError(f"draft_dtype={d} uses PyTorch's CPU kernels; on {model.device.type} use torch.bfloat16.")
    return choices


def auto_dtypes(model) -> tuple:
    """The base model as it is (None), and on the CPU, where the model has float linear layers to copy
    (a quantized base drafts as it is), the dtypes of ``AUTO`` whose copies of them run a one-token
    pass faster than the layers as they are (tuning.py: measured on the model's own layer shapes,
    once per machine), the ``AUTO_KEEP`` fastest, if their copies fit in half the memory available."""
    if model.device.type != "cpu":
        return (None,)
    modules = [m for m in linears(model) if plain(m.weight) and m.weight.dtype.is_floating_point]
    if not modules:
        return (None,)
    groups = {}
    for m in modules:
        groups.setdefault((m.out_features, m.in_features, m.weight.dtype), []).append(m)
    faster = tuning.tuned("draft_dtype", sorted(f"{o}x{i}:{d}" for o, i, d in groups),
                          lambda: _faster_dtypes(groups))["faster"]
    dtypes = tuple(getattr(torch, name) for name in faster)
    size = {torch.bfloat16: 2, torch.float16: 2, torch.int8: 1, torch.int4: 0.5}
    copies = sum(m.weight.numel() for m in modules) * sum(size[d] for d in dtypes)
    room = available_bytes()
    if room is not None and 2 * copies > room:
        return (None,)
    return (None, *dtypes)


def _faster_dtypes(groups: dict) -> dict:
    """{"faster": the dtypes of AUTO whose one-token pass over the layers (SAMPLE of each shape, timed
    together, scaled to the model's count) takes at most tuning.MARGIN of the layers' own, fastest
    first, AUTO_KEEP at most; "ms": each one's estimated pass}."""
    with torch.no_grad():
        sample = {shape: layers[:SAMPLE] for shape, layers in groups.items()}
        xs = {shape: torch.randn(1, shape[1], dtype=shape[2]) for shape in sample}
        ways = {"full": {shape: [(lambda x, m=m: nn.functional.linear(x, m.weight, m.bias)) for m in layers]
                         for shape, layers in sample.items()}}
        for d in AUTO:
            ways[str(d).removeprefix("torch.")] = {shape: [low_precision_linear(m.weight, m.bias, d) for m in layers]
                                                   for shape, layers in sample.items()}
        per_shape = {shape: tuning.fastest({name: (lambda fns=way[shape], x=xs[shape]: [f(x) for f in fns])
                                            for name, way in ways.items()}) for shape in sample}
    total = {name: sum(t[name] * len(groups[shape]) / len(sample[shape]) for shape, t in per_shape.items())
             for name in ways}
    faster = [n for n in total if n != "full" and tuning.pick({"full": total["full"], n: total[n]}, "full") == n]
    faster = sorted(faster, key=total.get)[:AUTO_KEEP]
    return {"faster": faster, "ms": {n: round(t * 1e3, 2) for n, t in total.items()}}


def low_precision_linear(weight: torch.Tensor, bias, dtype):
    """f(x) = x @ weight.T + bias with the weight in ``dtype`` (see the module docstring); the
    result in x's dtype. The derived weights are made here, once."""
    float_dtype = torch.bfloat16 if dtype in (torch.int8, torch.int4) else dtype  # of activations and bias
    bias = None if bias is None else bias.detach().to(float_dtype)
    out_features, in_features = weight.shape
    w = weight.detach().float()
    if dtype == torch.int4 and in_features % INT4_GROUP == 0 and out_features % 16 == 0:
        groups = w.reshape(out_features, -1, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = (hi - lo).clamp(min=1e-12) / 15
        q = ((groups - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32).reshape(w.shape)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel's dequantization: (q - 8) * scale + zero, so zero = lo + 8 * scale. [groups, out, 2]
        scale_zero = torch.stack([scales, lo + 8 * scales], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

        def int4(x):
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, in_features).to(torch.bfloat16), packed, INT4_GROUP,
                                                  scale_zero)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], out_features).to(x.dtype)
        return int4
    if dtype == torch.int8 and in_features % INT8_WIDTH == 0:
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
        scale = scale.to(torch.bfloat16)

        def int8(x):
            y = torch._weight_int8pack_mm(x.reshape(-1, in_features).to(torch.bfloat16), q, scale)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], out_features).to(x.dtype)
        return int8
    w = weight.detach().to(float_dtype)  # (a shape the int8 / int4 kernel does not take)
    return lambda x: nn.functional.linear(x.to(float_dtype), w, bias).to(x.dtype)


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


def check_vocabulary_option(value) -> None:
    """``draft_vocab`` is None, a number of tokens (> 0) or a list of token ids (checked by ``check_vocabulary``)."""
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0
                                  or isinstance(value, (list, tuple, torch.Tensor))):
        raise ValueError(f"draft_vocab must be a number of tokens (> 0) or a list of token ids, got {value!r}.")


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
    check_vocabulary_option(draft_vocab)
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
        self._mask = None
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
        routed = {}
        if self.dtype is not None:  # every linear layer, the head too (the restricted head below takes the dtype)
            copies = adapter_copies(self.model)  # adapters' modules_to_save: draft passes run the originals
            for m in linears(self.model):
                if plain(m.weight) and m not in copies:  # quantized layers draft as they are
                    routed[m] = (draft(self.key), _route(lambda m=m: self._low_precision(m)))
        if self.vocab is not None:
            routed[self.head] = (draft(self.key), _route(lambda: self._restricted(self.head)))
        with context.router.routing(routed):  # in this drafter's passes only (routing.py)
            yield self

    def _weights(self, m, kind, sources: tuple, make):
        """A derived copy of m's weights (derived.py), kept in the model state while its sources are
        unchanged: one per module, kind and draft dtype, so drafters of different kinds, or several
        installed together, do not evict each other."""
        copies = self.state.drafter.get("weights")
        if copies is None:
            copies = self.state.drafter["weights"] = DerivedCopies()
        return copies.get(m, (kind, self.dtype), sources, make, self.check)

    def _low_precision(self, m):
        return self._weights(m, "dtype", (m.weight, m.bias), lambda: low_precision_linear(m.weight, m.bias, self.dtype))

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


# Prompt lookup matches the row's last 3, then 2, then 1 tokens. On SmolLM2's greedy continuations
# of the zoo's held-out prompts (benchmarks/bench_lookup.py; docs/benchmarks.md, "Prompt lookup"),
# allowing 1-token matches gave more tokens per cycle and row than requiring 2 or 3 at every k.
LOOKUP_NGRAMS = (3, 1)


class Match(NamedTuple):
    """Where each row's continuation is read (``lookup``'s semantics): from ``start``, repeating with
    ``period``; ``ngram`` the length matched (0: none, the row's last token repeated)."""

    start: torch.Tensor
    period: torch.Tensor
    ngram: torch.Tensor


def match(tokens: torch.Tensor, ends: torch.Tensor, longest: int = LOOKUP_NGRAMS[0],
          shortest: int = LOOKUP_NGRAMS[1]) -> Match:
    """Semantics: per row b, with c = tokens[b, :ends[b]] (its committed tokens, ends[b] >= 1):
        for n = longest, ..., shortest: the latest i < len(c) - n with c[i : i + n] == c[-n:] (an
        earlier occurrence of the row's last n tokens); the first n that has one is taken:
        start = i + n, period = len(c) - n - i, ngram = n; a row with none: start = len(c) - 1,
        period = 1, ngram = 0.
    tokens [B, W], ends [B]. On the host, in NumPy (a few vectorized ops over the rows: a cycle's
    plan needs its labels there anyway; torch ops cost twice as much in dispatch at these sizes)."""
    device, e = tokens.device, ends.cpu().numpy()
    span = int(e.max())
    ctx = tokens[:, :span].cpu().numpy()
    rows, p = np.arange(ctx.shape[0]), np.arange(span)
    # ends[b, p]: c[p - n + 1 .. p] equals the row's last n tokens, for n = 1, 2, ...: one comparison more each
    ending = (ctx == ctx[rows, np.maximum(e - 1, 0)][:, None]) & (p <= (e - 2)[:, None])  # before the last token
    runs = [ending]
    for m in range(1, longest):
        same = np.zeros_like(ending)
        same[:, m:] = ctx[:, :-m] == ctx[rows, np.maximum(e - 1 - m, 0)][:, None]
        ending = ending & same & (e > m)[:, None]
        runs.append(ending)
    start, period, ngram = e - 1, np.ones_like(e), np.zeros_like(e)
    for n in range(longest, shortest - 1, -1):
        last = np.where(runs[n - 1], p, -1).max(1)  # the latest match of n tokens ends there
        take = (last >= 0) & (ngram == 0)
        start, period = np.where(take, last + 1, start), np.where(take, e - 1 - last, period)
        ngram = np.where(take, n, ngram)
    return Match(*(torch.from_numpy(v).to(device) for v in (start, period, ngram)))


def lookup(tokens: torch.Tensor, m: Match, k: int) -> torch.Tensor:
    """Semantics: proposal[b, j] = tokens[b, m.start[b] + j % m.period[b]] (what followed the match;
    past the row's end, continued with the repeat's period) -> [B, k]."""
    return tokens.gather(1, m.start[:, None] + torch.arange(k, device=tokens.device) % m.period[:, None])


class Plan(NamedTuple):
    """What a drafter can propose in one cycle, per row: ``labels[b]`` the class of row b's proposal
    (its acceptance is learned per class: the gate's key is the drafter's key + "/" + label), None
    where it has nothing to propose; ``detail``: what ``propose`` reads (the drafter's own)."""

    labels: list
    detail: object


class PromptLookupDrafter:
    """Drafts without a model pass: each row's proposals are what followed the latest earlier
    occurrence of its last tokens in its own context (``match``, ``lookup``), prompt and output. Its
    cost is a few tensor ops, so a verify pass of k + 1 tokens that costs little more than a plain
    step (small batches on a CPU, any batch on a GPU) pays from a low acceptance on: where text
    repeats its prompt or itself (code, quotes, lists, names, the loops of small models).

    How often a proposal is right depends on how long a match it continues: on SmolLM2's greedy
    continuations of the zoo's held-out prompts, a draft after a 3-token match was kept about 80%
    of the time, after 2 tokens about 65%, after 1 30-45% (docs/benchmarks.md, "Prompt lookup"). So each cycle's ``plan``
    labels every row with its match length, the gate learns acceptance per label and judges a row
    without a match as one that commits a single token, and drafts with it only where that pays.

    Its proposals are point masses: sampling keeps draft d with probability p(d) and otherwise
    samples the target's distribution without d (speculative sampling with q = one-hot;
    policies.GeneratePolicy.accept), so every committed token is an exact sample."""

    key = "/lookup"
    passes = False

    @contextlib.contextmanager
    def installed(self, context, check: SourceCheck | None = None):
        yield self  # nothing routed: it runs no pass

    def plan(self, batch, hi: int) -> Plan:
        m = match(batch.tokens[:hi], batch.ends(hi))
        return Plan([str(n) if n else None for n in m.ngram.tolist()], m)

    def propose(self, fwd, batch, hi: int, k: int, policy, plan: Plan | None = None):
        if not k:
            return batch.tokens.new_zeros(hi, 0), None
        end = batch.ends(hi)
        m = plan.detail if plan is not None else match(batch.tokens[:hi], end)
        drafts = lookup(batch.tokens[:hi], m, k)
        batch.tokens[:hi].scatter_(1, end[:, None] + torch.arange(k, device=end.device), drafts)  # the verify pass reads them
        return drafts, None

    def learn(self, batch, hi: int, accepted: list[int]) -> None:
        """Nothing to learn: its proposals are read from the rows' tokens."""


def make_drafters(model, state, dtypes: tuple, vocab=None, size: int | None = None, prompt_lookup: bool = True,
                  drafting: bool = True) -> list:
    """The drafters the gate chooses among: one ``BaseModelDrafter`` per draft dtype (``check_dtype``'s
    choices), all with the head on ``vocab`` (token ids, or None), and a ``PromptLookupDrafter``
    unless ``prompt_lookup`` is off. Not ``drafting`` (gate="never"): the base model as it is alone,
    whose passes never run, so that no draft copy is made for nothing."""
    if not drafting:
        return [BaseModelDrafter(model, state)]
    vocab = None if vocab is None else torch.as_tensor(vocab)
    drafters = [BaseModelDrafter(model, state, vocab, d, size=size) for d in dtypes]
    return drafters + [PromptLookupDrafter()] if prompt_lookup else drafters


def _route(make):
    """A draft pass's route to the layer ``make()`` gives, made (or its copy checked: derived.py) at
    the call's first draft pass: a call that never drafts neither makes nor reads the copies."""
    made = []

    def route(original, x, *args, **kwargs):
        if not made:
            made.append(make())
        return made[0](x)
    return route


def _base(m):
    """The plain Linear under a LoRA wrapper (LoRA on the output head), or the original under a
    modules_to_save wrapper (the head the base model drafts with; saved_modules.py)."""
    if isinstance(m, ModulesToSaveWrapper):
        return m.original_module
    return m.get_base_layer() if hasattr(m, "get_base_layer") else m
