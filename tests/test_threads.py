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
