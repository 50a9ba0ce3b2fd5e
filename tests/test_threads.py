"""Our commands' torch thread count (hf_invisiblelora.threads): asked, OMP_NUM_THREADS, else the free CPUs."""

import os

import torch

from hf_invisiblelora import threads


def test_asked_then_the_environment_then_the_free_cpus(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert "1 thread (as asked)" in threads.set_threads(1) and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert "OMP_NUM_THREADS" in threads.set_threads() and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(threads, "free_cpus", lambda: (1, 2, 1.3))
        line = threads.set_threads()
        assert torch.get_num_threads() == 1 and "of 2 CPUs, 1.3 busy" in line
    finally:
        torch.set_num_threads(before)


def test_free_cpus_leaves_what_other_work_holds(monkeypatch):
    jiffies = iter([(100, 1000), (100 + 150, 1000 + 200)])  # busy 150 of 200 ticks over the window
    monkeypatch.setattr(threads, "_busy_jiffies", lambda: next(jiffies))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    free, cpus, busy = threads.free_cpus()
    assert (free, cpus, busy) == (1, 2, 1.5)  # 1.5 of 2 CPUs busy: half a CPU left, and never fewer than one


def test_contention_follows_the_cpus_other_work_leaves(monkeypatch):
    """threads.Contention: between passes, torch's thread count is the CPUs other processes left free
    over the last window (the machine's busy time less this process's own), at most the caller's and at
    least one; restored at the end of the call."""
    clock = {"wall": 100.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(threads, "_busy_jiffies", lambda: (int(clock["busy"] * 100), 0))
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads.time, "process_time", lambda: clock["own"])
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        watch = threads.Contention()

        def second(others: float, own: float):  # one second of decoding: other processes use ``others`` CPUs
            clock["wall"] += 1
            clock["busy"] += others + own
            clock["own"] += own
            watch.follow()
            return torch.get_num_threads()
        assert second(0.0, 4.0) == 4
        assert second(1.0, 3.0) == 3  # one CPU busy with other work
        assert second(2.6, 1.4) == 1
        assert second(3.9, 0.1) == 1  # at least one
        assert second(0.2, 3.8) == 4  # free again: the caller's count, not more
        clock["wall"] += 0.1  # within the window: no look
        clock["busy"] += 4
        watch.follow()
        assert torch.get_num_threads() == 4
        second(3.0, 1.0)
        watch.restore()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
