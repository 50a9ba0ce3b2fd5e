"""The benchmarks' --smoke runs on tiny random models (seconds each), as a user runs them: a subprocess
each, its JSON checked; no benchmark module is imported here."""

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


def test_roofline_benchmark_smoke(tmp_path):
    """Every pass of a cycle timed and split by one profiled run into weight matmuls, attention and the
    rest; the bytes each reads (fewer for the cheaper drafters); the machine's read bandwidth (tiny model)."""
    out = tmp_path / "roofline.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_roofline.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert res["command"].startswith("python ") and "--smoke" in res["command"] and res["cpu"]
    assert 1e9 < res["bandwidth"] < 1e12
    passes = {r["name"]: r for r in res["results"]}
    assert {"base step", "draft, full", "draft, vocab", "draft, bf16", "draft, int8", "draft, int4", "LoRA-on step",
            "verify 3", "LoRA-on step, prepacked"} <= set(passes)
    for r in passes.values():
        assert r["ms"] > 0 and r["bound_ms"] > 0 and r["matmuls_ms"] > 0 and r["attention_ms"] > 0 and r["rest_ms"] >= 0
    mb = {name: passes[f"draft, {name}"]["mb"] for name in ("full", "vocab", "bf16", "int8", "int4")}
    assert mb["full"] > mb["vocab"] and mb["full"] > mb["bf16"] > mb["int8"] > mb["int4"]
    assert passes["LoRA-on step"]["mb"] > passes["base step"]["mb"]  # the adapters' weights too
