"""Choices made by measurement on the machine at hand, as cuDNN's benchmark mode and Triton's autotuner
make them: every "auto" of the fast path goes through ``tuned``.

    verdict = tuned("prepack_format", key, measure)    # measure() once per machine and key; cached on disk

What is fast depends on the CPU (its ISA: AVX2, AVX-512, AVX-512 BF16, AMX; its caches), on torch's
kernels and on the thread count: a prepacked oneDNN matmul is up to 2x faster than ``F.linear`` at
one token on one CPU and 2-3x slower on another. So a decision's candidates are timed on the model's
own layers and shapes, and the verdict is kept in a file per machine (the CPU's model name and
flags, torch's version, the thread count), keyed by what the decision depends on (the layer shapes,
the row counts), so that a second process starts tuned. Each new verdict is logged at INFO with the
timings it came from.

Timing (``fastest``): the candidates run interleaved, each its fastest of several repeats. Other work
on the machine only adds time, and interleaving spreads it over every candidate, so a verdict
measured while the machine was busy still ranks the work itself; a verdict measured while fewer CPUs
were free than torch's threads is kept for this process only, and measured again by the next one.
A candidate replaces the reference (stock's own kernel, which every choice is measured against) only
where it is faster by ``MARGIN``: a noisy tie keeps stock's.

``HF_INVISIBLELORA_HOME`` (default ``~/.cache/hf_invisiblelora``) holds the files (``tuning/``);
``HF_INVISIBLELORA_TUNING=off`` keeps verdicts in memory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("hf_invisiblelora")

MARGIN = 0.9  # a candidate must take at most 90% of the reference's time to replace it
REPEATS = 5
# The CPU flags that pick torch's CPU kernels (oneDNN's, MKL's, the weight-only int8 / int4 ones).
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile",
         "asimd", "sve", "bf16", "i8mm")

_lock = threading.RLock()  # reentrant: a measurement may run calls that look up verdicts of their own
_memory: dict = {}  # (kind, key) -> verdict, this process's
_files: dict = {}  # path -> its verdicts, read once
_looked_up = [0]  # verdicts read from a file or measured (``lookups``)


def cpu() -> tuple[str, tuple]:
    """(the CPU's model name, the FLAGS it has), from /proc/cpuinfo where there is one."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and name in ("", platform.machine(),
                                                                          platform.processor()):
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags |= set(value.split())
                elif not line.strip() and flags:
                    break
    except OSError:
        pass
    return name, tuple(f for f in FLAGS if f in flags)


def machine() -> dict:
    """What a verdict depends on besides its key."""
    name, flags = cpu()
    return {"cpu": name, "flags": list(flags), "torch": torch.__version__, "threads": torch.get_num_threads()}


def _path() -> Path | None:
    if os.environ.get("HF_INVISIBLELORA_TUNING", "").lower() == "off":
        return None
    home = Path(os.environ.get("HF_INVISIBLELORA_HOME", Path.home() / ".cache" / "hf_invisiblelora"))
    digest = hashlib.sha256(json.dumps(machine(), sort_keys=True).encode()).hexdigest()[:16]
    return home / "tuning" / f"{digest}.json"


def _read(path: Path) -> dict:
    if path not in _files:
        try:
            data = json.loads(path.read_text())
            _files[path] = data.get("verdicts", {}) if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _files[path] = {}
    return _files[path]


def _write(path: Path, verdicts: dict) -> None:
    """Atomically (a process reading it never sees half a file); a failure only costs the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"machine": machine(), "verdicts": verdicts}, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:
        logger.info("hf_invisiblelora: tuning verdicts not saved (%s)", e)


def busy_cpus() -> float:
    """CPUs other work keeps busy now (threads.free_cpus over a short window)."""
    from .threads import free_cpus

    return free_cpus(window=0.05)[2]


def lookups() -> int:
    """How many verdicts this process has read from the machine's file or measured so far: a pass
    during which the count grew did work besides its own (the gate does not take its time)."""
    return _looked_up[0]


def tuned(kind: str, key, measure) -> dict:
    """The verdict of decision ``kind`` for ``key`` (JSON-able: shapes, row counts): from this process,
    else from the machine's file, else ``measure()`` (a JSON-able dict; logged, and saved unless the
    machine was busy while it ran)."""
    name = f"{kind}:{json.dumps(key, sort_keys=True)}"
    with _lock:
        if name in _memory:
            return _memory[name]
        _looked_up[0] += 1
        path = _path()
        saved = _read(path).get(name) if path is not None else None
        if saved is not None:
            _memory[name] = saved
            return saved
        busy = busy_cpus()
        start = time.perf_counter()
        verdict = measure()
        quiet = max(busy, busy_cpus()) < 0.5  # other work kept less than half a CPU busy, before and after
        _memory[name] = verdict
        logger.info("hf_invisiblelora: tuned %s in %.2f s%s: %s", name, time.perf_counter() - start,
                    "" if quiet else " (machine busy: measured again by the next process)", verdict)
        if path is not None and quiet:
            verdicts = _read(path)
            verdicts[name] = verdict
            _write(path, verdicts)
        return verdict


def fastest(candidates: dict, repeats: int = REPEATS) -> dict:
    """{name: seconds}: each candidate's fastest run of ``repeats``, run interleaved (each called
    once first, untimed: lazy initialization is not its cost)."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for i in range(repeats):
        names = list(candidates)
        names = names[i % len(names):] + names[: i % len(names)]  # the order rotated: no candidate always first
        for name in names:
            start = time.perf_counter()
            candidates[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def sample_input(rows: int, features: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A random [rows, features] input for timing, from a generator of its own: a measurement made
    inside a seeded call leaves the caller's random stream (torch.manual_seed's) as it was."""
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(rows, features, generator=g, device=device).to(dtype)


def pick(times: dict, reference: str) -> str:
    """The fastest of ``times`` if it beats ``reference``'s time by MARGIN, else ``reference``."""
    best = min(times, key=times.get)
    return best if times[best] <= MARGIN * times[reference] else reference


def clear() -> None:
    """Forget this process's verdicts and the files read (tests)."""
    with _lock:
        _memory.clear()
        _files.clear()
