"""What the benchmarks share: timing, the machine's name (tools/machine.py), common options, and
tools/ on the import path (tools/tiny.py: the tiny random models and SmolLM2's shape, shared with the
tests; not installed with the package)."""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from machine import machine  # noqa: E402,F401 (the benchmarks take it from here)


def timed(fn, repeats: int, inner: int = 1) -> tuple[float, float]:
    """Median seconds per call of ``fn``, wall clock and process CPU time, over ``repeats`` blocks
    of ``inner`` calls (benchmarks)."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        walls.append((time.perf_counter() - w) / inner)
        cpus.append((time.process_time() - c) / inner)
    return statistics.median(walls), statistics.median(cpus)


def interleaved(steps: dict, repeats: int, before=None) -> tuple[dict, dict]:
    """Median seconds per call of each step, the steps run in turn in each of ``repeats`` rounds
    after one warm-up round (so drifts of the machine reach all of them alike), and each step's
    warm-up seconds (a compilation shows there). A step is ``fn`` or ``(context, fn)``: the context
    (our decoder installed, PEFT's adapters disabled) and ``before`` (a cache flush) are not timed."""
    times = {name: [] for name in steps}
    for _ in range(repeats + 1):
        for name, step in steps.items():
            context, fn = step if isinstance(step, tuple) else (contextlib.nullcontext, step)
            if before:
                before()
            with context(), torch.no_grad():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v[1:]) for k, v in times.items()}, {k: v[0] for k, v in times.items()}


def _spin():
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int):
    """``processes`` other processes spinning on the CPUs for the block (another user's job on the
    machine: each keeps one CPU busy while it holds one)."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(processes)]
    for proc in spinners:
        proc.start()
    try:
        yield
    finally:
        for proc in spinners:
            proc.terminate()
            proc.join()


def sync() -> None:
    """Wait for queued GPU work before reading a clock (generate returns with work still queued)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def zoo_continuations_args(p, new_tokens: int) -> None:
    """The options of a benchmark over held-out continuations of a zoo's adapters (bench_lookup,
    bench_layer_skip): which zoo and adapters, how many prompts of how many tokens, tokens to generate."""
    p.add_argument("--zoo", default="smollm2", choices=["smollm2", "gemma3"])
    p.add_argument("--adapters", nargs="+", help="default: every built plain LoRA adapter")
    p.add_argument("--prompts", type=int, default=3, help="held-out prompts per adapter")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
