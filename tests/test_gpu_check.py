"""benchmarks/gpu_check.sh, rehearsed on the CPU (--dry-run): the one prepared device call must work
the first time. Checks its plumbing: the project installed from a copy into a folder of its own,
the tests run against that installed package, the benchmark's results written per configuration."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    versions = (tmp_path / "versions.txt").read_text()
    site = versions.split("hf_invisiblelora from ")[1].split("/hf_invisiblelora/")[0]
    assert not Path(site).resolve().is_relative_to(ROOT), "the tests must run against the installed copy"
    # The tests were collected from the installed package: they ran (here: skipped, no GPU), no import error.
    graphs, kernels = (tmp_path / "tests_cuda_graphs.log").read_text(), (tmp_path / "tests_kernels.log").read_text()
    assert "skipped" in graphs and "error" not in graphs.lower()
    assert "passed" in kernels and "failed" not in kernels and "error" not in kernels.lower()
    res = json.loads((tmp_path / "decoding.json").read_text())
    points = res["throughput"]
    assert {(p["batch"], p["adapters"]) for p in points} == {(1, 1), (4, 1), (4, 4)}
    for p in points:  # stock PEFT only where asked (--stock-batches), every configuration measured
        assert ("stock_peft" in p["configs"]) == (p["batch"] == 1)
        assert all(c["tokens_per_s"] > 0 for c in p["configs"].values())
        assert all(c["identical_to_stock"] for n, c in p["configs"].items()
                   if n not in ("stock_peft", "base_model") and p["batch"] == 1)


def test_a_failing_configuration_is_recorded_and_the_rest_go_on(tmp_path):
    """Forcing the Triton kernels on the CPU (no interpreter) makes every invisible_lora configuration
    fail; stock PEFT is still measured and the errors are in the JSON, written as it went."""
    env = {**os.environ, "HF_INVISIBLELORA_BACKEND": "triton"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "benchmarks/bench_decoding.py", "--smoke", "--no-extras", "--no-sampling",
                          "--batches", "1", "--adapter-counts", "1", "--configs", "stock_peft", "k1",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    configs = json.loads((tmp_path / "decoding.json").read_text())["throughput"][0]["configs"]
    assert configs["stock_peft"]["tokens_per_s"] > 0
    assert "error" in configs["baseline"] and "error" in configs["k1"]
