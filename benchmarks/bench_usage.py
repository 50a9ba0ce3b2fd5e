"""The README's Usage call on a machine busy with other work: with set_threads() and with torch's
default thread count.

The README's own call (SmolLM2-135M-Instruct, the zoo's shakespeare and python_code adapters and a
__base__ row, 32 new tokens, greedy), timed four times in a fresh process for each way while
``--busy`` other processes spin on the CPUs; tokens/s of the calls after the first.

    python -P benchmarks/bench_usage.py --busy 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import busy, machine  # noqa: E402

CHILD = r"""
import json, sys, time, torch
import hf_invisiblelora
from hf_invisiblelora import zoo
from hf_invisiblelora.threads import set_threads
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
line = set_threads() if sys.argv[1] == "set_threads" else f"torch's default: {torch.get_num_threads()} threads"
base_path = zoo.assets.prepare("smollm2")
poetry, python = zoo.adapter_path("smollm2", "shakespeare"), zoo.adapter_path("smollm2", "python_code")
tok = AutoTokenizer.from_pretrained(base_path, padding_side="left")
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), poetry, adapter_name="poetry")
model.load_adapter(python, adapter_name="python")
model.eval()
enc = tok(["Shall I compare thee", "def fibonacci(n):", "Hello"], return_tensors="pt", padding=True)
rates = []
for _ in range(4):
    t = time.perf_counter()
    out = model.generate(**enc, adapter_names=["poetry", "python", "__base__"], invisible_lora=True,
                         max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
    rates.append(sum(out.stats.committed) / (time.perf_counter() - t))
print(json.dumps(dict(threads=line, rates=rates)))
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--busy", type=int, default=1, help="processes spinning on the CPUs meanwhile")
    args = p.parse_args(argv)
    results = {}
    with busy(args.busy):
        for way in ("set_threads", "default"):
            out = subprocess.run([sys.executable, "-P", "-c", CHILD, way], capture_output=True, text=True, check=True)
            results[way] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"# {machine()}; {args.busy} other process(es) spinning; the README's Usage call, tokens/s")
    for way, r in results.items():
        print(f"{way:>12}: {statistics.median(r['rates'][1:]):.1f} tokens/s (first call {r['rates'][0]:.1f}; "
              f"{r['threads']})")


if __name__ == "__main__":
    main()
