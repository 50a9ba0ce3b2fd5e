"""How many threads torch's CPU ops use in our commands (demo, zoo training, notebook, server) and
in our decoding passes, and the OpenMP threads a thread keeps.

torch's default is one thread per CPU. On a machine where other work runs, that oversubscribes
it: OpenMP's threads wait for each other at every parallel region while the other work holds a
core, and a step takes several times longer (measured on 2 shared cores: adapter training 28-42 s
a step with 2 threads against 4.8 s with 1; docs/zoo.md). So the commands take the CPUs that are
free now (the CPUs this process may run on, less those other processes kept busy over a fifth of
a second; at least one), unless told (``--threads`` or ``OMP_NUM_THREADS``).

Work that starts later is followed while we decode (``Contention``): every quarter of a second of a
call, the CPUs other processes used since the last look (the machine's busy time from /proc/stat less
this process's own) decide torch's thread count for the next passes: at most what the caller set, at
least one. Measured on a 2-core Xeon with one core kept busy by another process: every decoding
loop, stock's included, ran about 10x slower with torch's 2 threads than with 1.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch


def _busy_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def free_cpus(window: float = 0.2) -> tuple[int, int, float]:
    """(free CPUs, CPUs this process may use, CPUs other work keeps busy). Busy CPUs are measured
    over ``window`` seconds while this process sleeps (the load average would still count work
    that ended a minute ago); where /proc/stat is missing, the 1-minute load average stands in."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    before = _busy_jiffies()
    if before is not None:
        time.sleep(window)
        after = _busy_jiffies()
        busy = (after[0] - before[0]) / max(1, after[1] - before[1]) * (os.cpu_count() or cpus)
    else:
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cpus, round(cpus - busy))), cpus, busy


def set_threads(requested: int | None = None) -> str:
    """Set torch's thread count (``requested``, else ``OMP_NUM_THREADS``, else the free CPUs) and
    say which, and why, in one line."""
    if requested:
        why = "as asked"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        requested, why = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        requested, cpus, busy = free_cpus()
        why = f"the free ones of {cpus} CPUs, {busy:.1f} busy with other work; OMP_NUM_THREADS or --threads choose"
    torch.set_num_threads(requested)
    return f"torch uses {requested} thread{'s' if requested > 1 else ''} ({why})"


def release_openmp_threads() -> None:
    """Free the calling thread's OpenMP worker threads (they come back when it next runs a parallel op).

    Every thread that runs torch ops has its own OpenMP team. Once the teams hold more threads than
    there are CPUs, libgomp stops spinning between parallel regions and each region waits for a
    futex wake-up: the serving engine's thread decoded about 45% slower (2 CPUs, SmolLM2) when the
    thread that loaded the model kept its team. Other threads running torch's parallel ops while the
    engine serves slow it down the same way. (The calling thread's team only: nothing global changes.)"""
    try:
        ctypes.CDLL(None).omp_pause_resource_all(1)  # omp_pause_soft; OpenMP 5.0 (libgomp, libomp)
    except (AttributeError, OSError, TypeError):  # no OpenMP runtime in the global namespace
        pass


class Contention:
    """Torch's intra-op threads in our passes following the CPUs other work leaves free (see the
    module docstring): ``follow()`` between passes, ``restore()`` at the end of the call. The caller's
    thread count (torch.get_num_threads() when made) is the most it sets."""

    WINDOW = 0.25  # seconds between two looks

    def __init__(self):
        self.wanted = torch.get_num_threads()
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # /proc/stat counts the whole machine: only where this process may use all of it does it say
        # what other work leaves this process.
        self.cpus = cpus if cpus == os.cpu_count() and self.wanted > 1 else None
        self._last = self._look() if self.cpus else None

    @staticmethod
    def _look():
        jiffies = _busy_jiffies()
        return None if jiffies is None else (time.monotonic(), jiffies[0] / os.sysconf("SC_CLK_TCK"),
                                             time.process_time())

    def follow(self) -> None:
        if self._last is None or time.monotonic() - self._last[0] < self.WINDOW:
            return
        now = self._look()
        if now is None:
            self._last = None
            return
        wall, busy, own = (a - b for a, b in zip(now, self._last))
        self._last = now
        others = max(0.0, busy - own) / wall  # CPUs other processes kept busy meanwhile
        threads = max(1, min(self.wanted, round(self.cpus - others)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def restore(self) -> None:
        if torch.get_num_threads() != self.wanted:
            torch.set_num_threads(self.wanted)
