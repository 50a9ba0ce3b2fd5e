"""The machine a measurement ran on, as the benchmark tables and the reports name it (benchmarks/,
tools/): the CPU changes between sessions, and with it every figure."""

from __future__ import annotations

import contextlib
import os
import platform


def machine() -> str:
    """The CPU: model name, cores, and the instruction sets that decide fp32/bf16 matmul speed."""
    name, flags = platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs" + (f", {' '.join(isa)}" if isa else "")
