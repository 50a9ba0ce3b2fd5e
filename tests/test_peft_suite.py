"""PEFT's own decoder tests with invisible_lora=True next to every generate() call
(tests/peft_suite.py). Opt-in: PEFT_SUITE=1 (it fetches the peft sdist from PyPI once, unless
PEFT_SUITE_TESTS points at PEFT's tests, and takes a few minutes per dtype).

    PEFT_SUITE=1 .venv/bin/python -P -m pytest -q tests/test_peft_suite.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent / "peft_suite.py"
FAILING = ("MISMATCH", "ERROR", "CHANGED")

pytestmark = pytest.mark.skipif(os.environ.get("PEFT_SUITE") != "1",
                                reason="opt-in: set PEFT_SUITE=1 to run PEFT's decoder tests with invisible_lora")


@pytest.mark.parametrize("dtype", os.environ.get("PEFT_SUITE_DTYPES", "float32,float64").split(","))
def test_peft_decoder_suite(tmp_path, dtype):
    out = tmp_path / "peft_suite.json"
    cmd = [sys.executable, "-P", str(RUNNER), "--dtype", dtype, "--json", str(out)]
    if os.environ.get("PEFT_SUITE_TESTS"):
        cmd += ["--peft-tests", os.environ["PEFT_SUITE_TESTS"]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert out.exists(), \
        f"the runner wrote no results (exit {res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    data = json.loads(out.read_text())
    bad = [f"{e['status']}: {e['test']} call {e['call']}: {e['detail']}" for e in data["entries"]
           if e["status"] in FAILING]
    assert not bad, "\n".join(bad) + "\n\n" + res.stdout[-6000:]
    totals = data["summary"]["totals"]
    assert totals.get("same", 0) > 0, f"no generate() call was compared: {totals}"
    # Calls invisible_lora cannot serve are refused up front, never half-run.
    assert all(e["detail"] for e in data["entries"] if e["status"] == "refused")
    assert res.returncode == 0, res.stdout[-6000:]
