"""Forward objects: how the decoding loop runs a model pass.

One protocol, two implementations:

    fwd(ids, start, kv_len, keep, drafter=None, prefix=None, rows=None, lens=None) -> logits [b, keep, V]
        one pass over ``ids`` [b, q], row b's tokens written at cache slots start[b] .. start[b]+q-1,
        attending to the first ``kv_len`` slots, LoRA on (each row its adapter) or the ``drafter``'s
        pass (drafters.py); ``rows``: the rows it runs: all (None), the first ones (a slice from 0)
        or some (an index tensor: a prefill); ``prefix``: the pass computes the first slots as
        standard decoding's one call over ``prefix`` slots did (a prompt's pass: P); ``lens`` [b]:
        row b's first lens[b] tokens are real, the rest padding (not written; the logits kept are
        each row's last ``keep`` real ones); None: all q
    fwd.set_rows(names)  each row's adapter, when rows change
    fwd.context  the pass context (context.py): set here, once per pass, from these arguments
    fwd.layout  the rows' slot tables (layout.py); fwd.cache  the shared KV cache (cache.py)
    fwd.builds  passes compiled or captured so far (their timings are not steady state)
    fwd.inference  eager passes in inference mode (the Session sets it per call: off while a user's
                hook may keep a pass's tensors); compiled passes are traced as they are
    fwd.direct  (eager) {drafter, None for LoRA on: the passes' model call as plain functions}
                (llama_pass.py; the Session sets it per call)

``EagerForward`` runs each pass as it comes. ``CompiledForward`` gives every pass fixed shapes and
compiles it once per bucket:

- rows padded to a bucket (1, 2, 4, ..., 64, then multiples of 64); padded rows decode pad tokens
  with no adapter and are dropped from the logits;
- the cache length padded to a bucket (powers of two from 64, then multiples of 1024), and every
  pass attends over all of it (the masks hide what a row may not see);
- adapter metadata of fixed size (``make_meta(static=True)``), masks and position ids in
  per-bucket buffers updated in place;
- on the torch path (the CPU), the active adapters' weights side by side (``AdapterBank.fix``), as
  the eager packed path has them, padded to what any set of as many adapters of as high a rank
  needs: LoRA passes are built per adapter bucket (1, 2, 4, ... distinct adapters, at most the
  bank's) and rank bucket (the largest active rank, rounded up to a power of two), as vLLM sizes
  its LoRA buffers by max_loras x max_lora_rank; a call uses the smallest buckets already built
  that cover its adapters (``warm_up`` builds them ahead).

A bucket's state (cache, buffers, compiled passes) lives on the model, so later calls with the
same bucket reuse it without compiling. Pass kinds: draft (LoRA off, 1 token per row), plain
(LoRA on, 1 token) and verify (LoRA on, 2..K+1 tokens), each compiled the first time it runs (a
draft pass per drafter key); the prefill (as many tokens as the prompt) and passes with per-row
lengths run eagerly on the same fixed shapes.
Backends: "inductor" (``torch.compile``, the CPU) or "cuda_graphs" (each pass captured with
``torch.cuda.CUDAGraph`` on its first run and replayed after: no compiler, no kernel launches).
"""

from __future__ import annotations

import functools
import logging
import time
import types

import torch

from ..kernels import torch_lora
from ..kernels.meta import BACKEND_ENV, get_backend, make_meta
from .cache import SharedCache
from .context import PassContext
from .layout import RowLayout
from .walk import BASE

logger = logging.getLogger("hf_invisiblelora")


def model_pass(model, cache: SharedCache, masks, position_ids, ids, keep: int, direct=None):
    """One model pass over ``ids`` [b, q] as the cache's pass context describes it; the logits of
    each row's last ``keep`` (real) tokens. ``direct``: the model's call as plain functions
    (llama_pass.py), or None."""
    p = cache.context
    p.prepare_writes(cache.capacity)

    def call(logits_to_keep):
        out = direct(ids, masks, position_ids, cache, logits_to_keep) if direct is not None else None
        if out is None:
            out = model(input_ids=ids, attention_mask=masks, position_ids=position_ids, cache=cache, use_cache=True,
                        logits_to_keep=logits_to_keep).logits
        return out

    if p.lens is None:
        return call(keep)
    # A ragged pass: each row's last ``keep`` real positions. The head runs at the positions some row
    # keeps (Transformers' logits_to_keep as indices), not at every row's every position.
    at = (p.lens[:, None] - keep + torch.arange(keep, device=ids.device)).clamp(min=0)
    kept = at.unique()
    logits = call(kept)
    index = torch.searchsorted(kept, at)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))


class EagerForward:
    """Passes as they come: the rows as they are, attending to the first ``kv_len`` cache slots.
    ``capacity`` rows of ``width`` slots; ``owner``: the model state's owner check (the context's)."""

    builds = 0
    inference = True

    def __init__(self, model, lora, capacity: int, width: int, device, owner):
        self.model, self.lora = model, lora
        self.direct = {}  # drafter (None: LoRA on) -> its passes as plain functions (llama_pass.py), per call
        self.context = PassContext(owner)
        self.layout = RowLayout(model, capacity, width, device, self.context)
        self.cache = SharedCache(model.config, capacity, width, self.context)

    def set_rows(self, names) -> None:
        pass

    def __call__(self, ids, start, kv_len: int, keep: int, drafter=None, prefix=None, rows=None, lens=None):
        self.cache.check_room(kv_len)
        adapters = self.lora.adapters(rows) if drafter is None else None
        with self.context.running(start, ids.shape[1], kv_len, rows=rows, lens=lens, prefix=prefix, drafter=drafter,
                                  adapters=adapters):
            # Inference mode, not only no_grad: no autograd or view tracking per op, about 4 ms of a
            # 25-100 ms pass on SmolLM2 on the CPU. What the pass makes stays inside (the cache is
            # allocated outside it: cache.py); the logits leave as a plain tensor, which processors
            # may change in place.
            with torch.inference_mode(self.inference):
                masks, position_ids = self.layout.inputs()
                direct = self.direct.get(drafter) if prefix is None else None  # a prompt's pass: the model's own
                logits = model_pass(self.model, self.cache, masks, position_ids, ids, keep, direct)
            return logits.clone() if self.inference else logits


def backend_for(option, device: torch.device, dtype: torch.dtype, lora_backend: str) -> str | None:
    """The compile backend for ``generate(compile=option)``: None (eager), "inductor" or "cuda_graphs".

    "auto" captures CUDA graphs on CUDA (cheap: a capture costs about one pass) and stays eager on
    the CPU, where compiling a pass of a real model takes a minute or more (see docs/benchmarks.md):
    pass ``compile=True`` to pay it once for a long-running server.
    """
    if option is False or (option == "auto" and device.type != "cuda"):
        return None
    if lora_backend != "bank":
        if option == "auto":
            return None
        raise ValueError("compile=True needs lora_backend='bank' (PEFT's per-adapter loop has no fixed shapes).")
    if device.type != "cuda":
        return "inductor"
    if get_backend(device, dtype) is torch_lora:  # its loop reads segment sizes on the host
        if option == "auto":
            return None
        raise ValueError(f"CUDA graphs need the Triton kernels (triton installed; fp32/fp16/bf16, not {dtype}) "
                         f"and {BACKEND_ENV} unset or 'triton'.")
    return "cuda_graphs"


def row_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def adapter_bucket(adapters: int, bank: int) -> int:
    """Distinct adapters a compiled LoRA pass is built for: powers of two, at most the bank's."""
    return min(power_of_two(adapters), bank)


def _active(row_slots: torch.Tensor) -> tuple:
    """The adapter slots the rows use, ascending; (0,) if none (any pack then, which no token selects)."""
    return tuple(sorted({s for s in row_slots.tolist() if s >= 0})) or (0,)


def pack_buckets(bucket, bank, active) -> tuple:
    """(adapter bucket, rank bucket) of LoRA passes for the ``active`` slots: the smallest pair
    whose passes ``bucket`` already has that covers them (as many adapters or more, of as high a
    rank or higher), else their own."""
    need = adapter_bucket(len(active), len(bank.adapter_names)), power_of_two(bank.max_rank(active))
    built = [key[2] for key in bucket.passes if key[2] and key[2][0] >= need[0] and key[2][1] >= need[1]]
    return min(built, key=lambda ar: ar[0] * ar[1], default=need)


def warmed(buckets: dict, bank, device, dtype, rows: int, width: int, names, widths: range, drafts: bool,
           drafters=("",)) -> int | None:
    """The cache length of the smallest bucket of ``rows`` rows and at least ``width`` slots that
    ``warm_up`` measured faster than eager passes (``Bucket.chosen``) and whose compiled passes include
    every pass a call with adapters ``names`` can run (LoRA-on passes of 1 to K + 1 tokens and the
    draft passes of the drafter keys ``drafters``; only the 1-token LoRA-on pass if it never
    ``drafts``); None if there is none. ``compile="auto"`` on the CPU takes such a bucket, and never
    compiles inside a call."""
    keys = sorted((k for k in buckets
                   if k[:3] == (device, dtype, row_bucket(rows)) and k[3] >= width and buckets[k].chosen),
                  key=lambda k: k[3])
    active = _active(bank.slots([a or BASE for a in names])) if keys else None
    for key in keys:
        packs = pack_buckets(buckets[key], bank, active)
        need = {(q, None, packs) for q in (widths if drafts else [1])} | ({(1, d, None) for d in drafters} if drafts else set())
        if need <= set(buckets[key].passes):
            return key[3]
    return None


def length_bucket(length: int) -> int:
    return max(64, 1 << (length - 1).bit_length()) if length <= 1024 else -(-length // 1024) * 1024


class Bucket:
    """What persists across calls for one (rows, cache length): pass context, cache, buffers,
    compiled passes (which hold the context and cache they were built with)."""

    def __init__(self, config, rows: int, length: int, device, owner):
        self.context = PassContext(owner)
        self.cache = SharedCache(config, rows, length, self.context)
        self.start = torch.zeros(rows, dtype=torch.long, device=device)
        self.ids = {}  # q -> [rows, q] input buffer
        self.inputs = {}  # q -> (masks, position_ids) buffers
        self.metas = {}  # q -> static LoraMeta whose tensors are updated in place
        self.passes = {}  # (q, drafter key or None, (adapter bucket, rank bucket) of the torch path's packs) -> callable
        self.bank_version = None  # CUDA graphs hold the bank's tensors by address: recapture on change
        self.pool = None  # one CUDA graph memory pool per bucket: passes run one at a time
        self.chosen = False  # compile="auto" takes its passes: warm_up timed them faster than eager ones


def _own_code(fn, tag: str):
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled graphs per code object, at
    most 8 (its recompile limit): one code object per pass gives each its own single entry."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _copy_into(buffer, value):
    if isinstance(buffer, dict):
        for k in buffer:
            buffer[k].copy_(value[k])
    else:
        buffer.copy_(value)


class CompiledForward:
    """Passes with fixed shapes (see the module docstring); same protocol as ``EagerForward``.

    ``lora``: the LoRA switch (its adapter bank); ``buckets``: the model's store of Bucket objects
    (kept across calls); ``capacity`` rows of at
    least ``width`` slots (in the bucket of ``length`` slots if given, else ``length_bucket(width)``);
    ``widths``: the tokens per row of the passes to compile (1 .. K + 1).
    """

    inference = False  # its graphs are traced once, in the grad mode of the call

    def __init__(self, model, buckets: dict, lora, capacity: int, width: int, device, backend: str, widths: range,
                 owner, length: int | None = None):
        self.model, self.lora, self.backend, self.widths = model, lora, backend, widths
        self.size, self.length = row_bucket(capacity), length or length_bucket(width)
        self.builds = 0
        key = (device, model.dtype, self.size, self.length)
        if key not in buckets:
            buckets[key] = Bucket(model.config, self.size, self.length, device, owner)
        self.bucket = bucket = buckets[key]
        if backend == "cuda_graphs" and bucket.bank_version != self.bank.version:
            bucket.passes, bucket.bank_version = {}, self.bank.version
        self.cache, self.context = bucket.cache, bucket.context
        self.layout = RowLayout(model, self.size, self.length, device, self.context)
        self.row_slots = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.fresh_metas = set()  # q whose metadata buffers hold the current rows
        self.adapters = None  # the rows' (adapter bucket, rank bucket) (torch path)

    @property
    def bank(self):
        return self.lora.bank

    def set_rows(self, names) -> None:
        self.row_slots = torch.full_like(self.row_slots, -1)
        self.row_slots[: len(names)] = self.bank.slots([a or BASE for a in names])
        self.fresh_metas = set()
        self.adapters = None
        if self.bank.ops is torch_lora:  # the packed path: the active adapters' weights at fixed widths
            active = _active(self.row_slots)
            self.adapters = pack_buckets(self.bucket, self.bank, active)
            self.bank.fix(active, *self.adapters)

    def __call__(self, ids, start, kv_len: int, keep: int, drafter=None, prefix=None, rows=None, lens=None):
        b, q = ids.shape
        bucket, p = self.bucket, self.context
        self.cache.check_room(kv_len)
        self.bank.begin_pass()
        if isinstance(rows, torch.Tensor) or prefix is not None or lens is not None or q not in self.widths:
            # A prefill of some rows, or a ragged pass: eager, on the bucket's cache.
            rows = torch.arange(b, device=ids.device) if rows is None else rows
            adapters = self.row_slots[rows] if drafter is None else None
            with p.running(start, q, kv_len, rows=rows, lens=lens, prefix=prefix, drafter=drafter, adapters=adapters):
                masks, position_ids = self.layout.inputs()
                return model_pass(self.model, self.cache, masks, position_ids, ids, keep)
        # Rows 0..b-1 (the others ride along on what their buffers hold) over the whole bucket.
        if q not in bucket.ids:
            bucket.ids[q] = ids.new_zeros(self.size, q)
        bucket.ids[q][:b] = ids
        bucket.start[:b] = start
        adapters = {self.size * q: self._meta(q)} if drafter is None else None
        with p.running(bucket.start, q, self.length, drafter=drafter, adapters=adapters):
            masks, position_ids = self.layout.inputs()
            if q not in bucket.inputs:
                bucket.inputs[q] = (masks, position_ids)
            else:
                _copy_into(bucket.inputs[q][0], masks)
                bucket.inputs[q][1].copy_(position_ids)
            key = (q, None if drafter is None else drafter.key, self.adapters if drafter is None else None)
            fn = bucket.passes.get(key)
            return (fn() if fn is not None else self._build(q, key))[:b, q - keep:]

    def _static_meta(self, q: int):
        return make_meta(self.bank.token_slots(self.row_slots, q), len(self.bank.adapter_names), static=True)

    def _meta(self, q: int):
        """This call's static metadata for q tokens per row, in the bucket's persistent buffers."""
        meta = self.bucket.metas.get(q)
        if q not in self.fresh_metas:
            new = self._static_meta(q)
            if meta is None or meta.sorted_tokens.shape != new.sorted_tokens.shape or meta.offsets.shape != new.offsets.shape:
                meta = self.bucket.metas[q] = new  # first use, or adapters were added / deleted
            else:
                for name in ("token_slots", "sorted_tokens", "slot_counts", "slot_starts", "offsets"):
                    getattr(meta, name).copy_(getattr(new, name))
            self.fresh_metas.add(q)
        return meta

    def _build(self, q: int, key):
        """Compile or capture the pass ``key`` (see Bucket.passes), run it once for this step; returns its logits."""
        bucket, (_, drafter, packs) = self.bucket, key
        kind = ("verify" if q > 1 else "plain") if drafter is None else f"draft{drafter.replace('/', '_')}"
        if packs:
            kind += "_a{}r{}".format(*packs)
        masks, position_ids = bucket.inputs[q]
        args = (self.model, self.cache, masks, position_ids, bucket.ids[q], q)
        t = time.perf_counter()
        if self.backend == "inductor":
            fn = torch.compile(_own_code(model_pass, f"{kind}_{self.size}x{q}"), fullgraph=True, dynamic=False)
            call = functools.partial(fn, *args)
            out = call()
        else:
            call, out = _capture(lambda: model_pass(*args), bucket)
        bucket.passes[key] = call
        self.builds += 1
        logger.info("hf_invisiblelora: %s %s pass (%d rows, %d cache slots, %d tokens/row) in %.1f s",
                    "compiled" if self.backend == "inductor" else "captured", kind, self.size, self.length, q,
                    time.perf_counter() - t)
        return out


def _capture(fn, bucket):
    """Run ``fn`` once (warm-up: Triton compiles, the allocator sees the shapes), then capture it
    into a CUDA graph. Returns (replay, the warm-up's output). Running the pass twice is harmless:
    it writes the same cache slots with the same values."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn().clone()
    torch.cuda.current_stream().wait_stream(stream)
    if bucket.pool is None:
        bucket.pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=bucket.pool):
        static_out = fn()

    def replay():
        graph.replay()
        return static_out.clone()  # the next replay overwrites static_out

    return replay, out
