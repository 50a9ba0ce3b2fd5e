"""Fixed-shape passes, compiled once per bucket and kept on the model.

Per decode step the model runs ~210 LoRA layers of small ops: on a CPU their dispatch dominates,
on a GPU their launches. Compiling removes both, but only if a pass's shapes never change while
decoding. So in compiled mode every pass has fixed shapes:

- rows padded to a bucket (1, 2, 4, ..., 64, then multiples of 64); padded rows decode pad tokens
  with no adapter and are dropped from the logits;
- the cache length padded to a bucket (powers of two from 64, then multiples of 1024), and every
  pass attends over all of it (the mask hides what a row may not see);
- adapter metadata of fixed size (``kernels.make_meta(static=True)``), in buffers updated in place.

A bucket's state (cache, input buffers, metadata, compiled passes) lives on the model, so later
generate calls with the same bucket reuse it without compiling. The kinds of pass are draft (LoRA
off, 1 token per row), plain (LoRA on, 1 token) and verify (LoRA on, 2..K+1 tokens); each is
compiled the first time it runs. The prefill (as many tokens as the prompt) runs eagerly.

Backends: "inductor" (``torch.compile``, the CPU) or "cuda_graphs" (each pass captured with
``torch.cuda.CUDAGraph`` on its first run and replayed after: no compiler, no kernel launches).
"""

from __future__ import annotations

import functools
import logging
import time
import types

import torch

from . import kernels
from .cache import HybridCache, model_pass

logger = logging.getLogger("hf_invisiblelora")
_ATTR = "_invisiblelora_compiled"
COMPILE_OPTIONS = ("auto", True, False)


def backend_for(option, device: torch.device, dtype: torch.dtype, lora_backend: str) -> str | None:
    """The compile backend for ``generate(compile=option)``: None (eager), "inductor" or "cuda_graphs".

    "auto" captures CUDA graphs on CUDA (cheap: a capture costs about one pass) and stays eager on
    the CPU, where compiling a pass of a real model takes a minute or more (see docs/benchmarks.md):
    pass ``compile=True`` to pay it once for a long-running server.
    """
    if option not in COMPILE_OPTIONS:
        raise ValueError(f"compile must be one of {COMPILE_OPTIONS}, got {option!r}.")
    if option is False or (option == "auto" and device.type != "cuda"):
        return None
    if lora_backend != "bank":
        if option == "auto":
            return None
        raise ValueError("compile=True needs lora_backend='bank' (PEFT's per-adapter loop has no fixed shapes).")
    if device.type != "cuda":
        return "inductor"
    if kernels.get_backend(device, dtype) is kernels.torch_lora:  # its loop reads segment sizes on the host
        if option == "auto":
            return None
        raise ValueError(f"CUDA graphs need the Triton kernels (triton installed; fp32/fp16/bf16, not {dtype}) "
                         f"and {kernels.BACKEND_ENV} unset or 'triton'.")
    return "cuda_graphs"


def row_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def length_bucket(length: int) -> int:
    return max(64, 1 << (length - 1).bit_length()) if length <= 1024 else -(-length // 1024) * 1024


def clear(model) -> None:
    """Drop the compiled passes and persistent buffers kept on ``model`` (the PEFT model)."""
    model.__dict__.pop(_ATTR, None)


class _Bucket:
    """What persists across calls for one (rows, cache length): cache, buffers, compiled passes."""

    def __init__(self, config, rows: int, length: int, device):
        self.cache = HybridCache(config, torch.zeros(rows, dtype=torch.long, device=device), length)
        self.start = torch.zeros(rows, dtype=torch.long, device=device)
        self.ids = {}  # q -> [rows, q] input buffer
        self.metas = {}  # q -> static LoraMeta whose tensors are updated in place
        self.passes = {}  # (q, lora_on) -> callable
        self.bank_version = None  # CUDA graphs hold the bank's tensors by address: recapture on change
        self.pool = None  # one CUDA graph memory pool per bucket: passes run one at a time


def _own_code(fn, tag: str):
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled graphs per code object, at
    most 8 (its recompile limit): one code object per pass gives each its own single entry."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledForward:
    """Passes with fixed shapes (see the module docstring); same call as ``decoding.EagerForward``."""

    def __init__(self, model, peft_model, lora, pad, max_len: int, backend: str, widths: range):
        b = pad.shape[0]
        self.model, self.bank, self.backend, self.widths = model, lora.bank, backend, widths
        self.rows, self.length = row_bucket(b), length_bucket(max_len)
        self.builds = 0  # passes compiled or captured during this call (their timings are not steady state)
        store = peft_model.__dict__.setdefault(_ATTR, {})
        key = (pad.device, model.dtype, self.rows, self.length)
        if key not in store:
            store[key] = _Bucket(model.config, self.rows, self.length, pad.device)
        self.state = state = store[key]
        if backend == "cuda_graphs" and state.bank_version != self.bank.version:
            state.passes, state.bank_version = {}, self.bank.version
        self.cache = state.cache
        self.cache.pad.zero_()[:b] = pad
        self.row_slots = torch.full((self.rows,), -1, dtype=torch.long, device=pad.device)
        self.row_slots[:b] = lora.row_slots
        self.fresh_metas = set()  # q whose metadata buffers hold this call's rows

    def __call__(self, ids, start, kv_len: int, keep: int, lora_on: bool = True):
        b, q = ids.shape
        state = self.state
        if q not in self.widths:  # the prefill: eager, on the same fixed-shape path
            padded = ids.new_zeros(self.rows, q)
            padded[:b] = ids
            self.bank.set_meta(self._static_meta(q) if lora_on else None)
            return model_pass(self.model, self.cache, padded, state.start.zero_(), self.length, keep)[:b]
        if q not in state.ids:
            state.ids[q] = ids.new_zeros(self.rows, q)
        state.ids[q][:b] = ids
        state.start[:b] = start
        self.bank.set_meta(self._meta(q) if lora_on else None)
        fn = state.passes.get((q, lora_on))
        if fn is None:
            return self._build(q, lora_on)[:b, q - keep:]
        return fn()[:b, q - keep:]

    def _static_meta(self, q: int):
        return kernels.make_meta(self.bank.token_slots(self.row_slots, q), len(self.bank.adapter_names), static=True)

    def _meta(self, q: int):
        """This call's static metadata for q tokens per row, in the bucket's persistent buffers."""
        meta = self.state.metas.get(q)
        if q not in self.fresh_metas:
            new = self._static_meta(q)
            if meta is None or meta.sorted_tokens.shape != new.sorted_tokens.shape or meta.offsets.shape != new.offsets.shape:
                meta = self.state.metas[q] = new  # first use, or adapters were added / deleted
            else:
                for name in ("token_slots", "sorted_tokens", "slot_counts", "slot_starts", "offsets"):
                    getattr(meta, name).copy_(getattr(new, name))
            self.fresh_metas.add(q)
        return meta

    def _build(self, q: int, lora_on: bool):
        """Compile or capture the (q, lora_on) pass, run it once for this step; returns its logits."""
        state, kind = self.state, ("verify" if q > 1 else "plain") if lora_on else "draft"
        args = (self.model, self.cache, state.ids[q], state.start, self.length, q)
        t = time.perf_counter()
        if self.backend == "inductor":
            fn = torch.compile(_own_code(model_pass, f"{kind}_{self.rows}x{q}"), fullgraph=True, dynamic=False)
            call = functools.partial(fn, *args)
            out = call()
        else:
            call, out = _capture(lambda: model_pass(*args), state)
        state.passes[(q, lora_on)] = call
        self.builds += 1
        logger.info("hf_invisiblelora: %s %s pass (%d rows, %d cache slots, %d tokens/row) in %.1f s",
                    "compiled" if self.backend == "inductor" else "captured", kind, self.rows, self.length, q,
                    time.perf_counter() - t)
        return out


def _capture(fn, state):
    """Run ``fn`` once (warm-up: Triton compiles, the allocator sees the shapes), then capture it
    into a CUDA graph. Returns (replay, the warm-up's output). Running the pass twice is harmless:
    it writes the same cache slots with the same values."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn().clone()
    torch.cuda.current_stream().wait_stream(stream)
    if state.pool is None:
        state.pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=state.pool):
        static_out = fn()

    def replay():
        graph.replay()
        return static_out.clone()  # the next replay overwrites static_out

    return replay, out
