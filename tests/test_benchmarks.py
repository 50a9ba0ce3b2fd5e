"""Smoke run of the decoding benchmark on a tiny random model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_decoding_benchmark_smoke(tmp_path):
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_decoding.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "decoding.json").read_text())
    assert (tmp_path / "decoding_throughput.png").stat().st_size > 1000
    greedy = [r for r in res["throughput"] if not r["sampling"]]
    assert {(r["batch"], r["adapters"]) for r in greedy} == {(1, 1), (4, 1), (4, 4)}
    for r in greedy:  # every configuration decoded the same tokens as stock PEFT
        assert all(c["identical_to_stock"] for name, c in r["configs"].items() if name not in ("stock_peft", "base_model"))
        assert all(c["tokens_per_s"] > 0 for c in r["configs"].values())
    assert set(res["acceptance"]) == {f"{mode}{drafter}" for mode in ("greedy", "sampling")
                                      for drafter in ("", ", vocab", ", bf16", ", int8", ", int4")}
    assert all(0 <= a["acceptance"] <= 1 for a in res["acceptance"]["greedy"]["per_adapter"].values())
    assert res["memory"]["stock_cache_bytes"] > 0 and res["memory"]["hybrid_cache_bytes"]
    assert all(b["bound"] > 0 for b in res["bound"])


def test_serving_benchmark_smoke(tmp_path):
    """Poisson arrivals served by stock static batches, our static generate() and the engine."""
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 1000
    assert res["command"].startswith("python ") and "--smoke" in res["command"]
    assert [r["rate"] for r in res["runs"]] == [20, 80]
    for run in res["runs"]:
        assert set(run["modes"]) == {"stock", "static", "engine"}
        for mode, s in run["modes"].items():
            assert s["completed"] == s["requests"] == 8 and s["dropped"] == 0
            assert s["tokens_per_s"] > 0 and 0 <= s["ttft_p50"] <= s["ttft_p99"] and 0 <= s["tpot_p50"] <= s["tpot_p99"]
            for job in run["requests"][mode]:
                assert 1 <= job["tokens"] <= job["max_tokens"] and job["arrival"] <= job["first"] <= job["done"]
        assert run["modes"]["engine"]["engine"]["cycles"] > 0
        prompts = sum(job["ids"] for job in run["requests"]["engine"])
        for mode, s in run["modes"].items():  # where the time went: every prompt slot prefilled, every token decoded
            split = s["split"]
            assert split["prefill_s"] > 0 and split["decode_s"] > 0 and split["prompt_slots"] >= prompts
            if mode == "engine":  # rows x cycles, the active ones among them
                assert split["row_steps"] >= split["active_row_steps"] > 0
            else:  # rows x new-token positions: every token but a row's first (the prefill's) fills one
                assert split["row_steps"] >= s["tokens"] - s["completed"]


def test_memory_benchmark_smoke(tmp_path):
    """RSS over load/use/unload cycles, many adapters loaded then unloaded, short requests, and
    requests over bounded adapters (tiny model)."""
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_memory.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "memory.json").read_text())
    assert res["command"].startswith("python ") and "--smoke" in res["command"] and res["machine"]
    assert set(res["phases"]) == {"cycles", "many", "requests", "bounded", "prefixes", "reloads"}
    prefixes, reloads = res["phases"]["prefixes"], res["phases"]["reloads"]
    assert prefixes["requests"] == 1000 and prefixes["failed"] == 0 and prefixes["blocks"] > 0
    assert 0 < prefixes["peak_cache_bytes"] <= prefixes["prefix_cache_bytes"]  # the bound held
    assert reloads["reloads"] == 200 and reloads["failed"] == 0 and reloads["revisions_left"] == []
    many = res["phases"]["many"]
    assert many["adapters"] == 6 and len(many["rss_mb"]) == 6 and many["rss_at_end_mb"] > 0
    assert res["phases"]["cycles"]["samples"] == 20
    assert res["phases"]["requests"]["requests"] == 200 and res["phases"]["bounded"]["requests"] == 40
    bounded = res["phases"]["bounded"]
    assert bounded["failed"] == 0 and bounded["loads"] > 0 and bounded["evictions"] > 0
    for r in (res["phases"][phase] for phase in ("cycles", "requests", "bounded", "prefixes", "reloads")):
        assert len(r["rss_mb"]) == r["samples"] and r["max_growth_mb"] >= 0 and r["rss_at_end_mb"] > 0


def test_roofline_parts(tmp_path):
    """bench_roofline.py's measurements on their own: a matmul's profiled time is mostly in the matmul op,
    an elementwise op's is not; the read bandwidth is a plausible number (1-1000 GB/s)."""
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    from bench_roofline import bandwidth, split

    x, w = torch.randn(64, 512), torch.randn(512, 512)
    assert split(lambda: x @ w, 3)["matmuls"] > 0.5
    assert split(lambda: (x * 2).exp(), 3)["matmuls"] == 0
    assert 1e9 < bandwidth(gib=0.125, repeats=2) < 1e12


def test_llama_cpp_scale_makes_its_lora_scaling_peft_s(tmp_path):
    """llama.cpp scales a LoRA by alpha / r; PEFT's rsLoRA by alpha / sqrt(r): the request scale sqrt(r) makes them one."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench_llama_cpp import peft_scale

    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(r=16, lora_alpha=32, use_rslora=True)))
    assert peft_scale(tmp_path) == 4.0
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(r=16, lora_alpha=32, use_rslora=False)))
    assert peft_scale(tmp_path) == 1.0
