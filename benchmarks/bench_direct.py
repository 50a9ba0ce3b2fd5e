"""Passes as plain functions (model/llama_pass.py) against the model's own modules, in one process.

On the zoo's SmolLM2 and its adapters (bench_step.py's Setup: generate()'s Session, a 64-token
context, rows over the first 4 adapters): a LoRA-on pass of --tokens tokens per row and an int4
draft pass, each timed with the Session's plain-function passes (``EagerForward.direct``, as
generate() installs them) and with them off (the modules), interleaved; medians of --repeats.

    python -P benchmarks/bench_direct.py --rows 1 8 --tokens 1 3 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from bench_step import Setup
from common import machine

from hf_invisiblelora import zoo
from hf_invisiblelora.model.state import state_of


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 3], help="tokens per row of the LoRA-on passes")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    print(machine())
    model, _, names = zoo.load_zoo("smollm2")
    vocab = model.get_base_model().config.get_text_config().vocab_size
    print("| pass | rows | modules (ms) | plain functions (ms) | speed-up |\n|---|---:|---:|---:|---:|")
    with state_of(model).hold():
        for rows in args.rows:
            s = Setup(model, names[:4], rows, vocab, list(range(8192)), draft_dtypes=(torch.int4,))
            passes = [(f"LoRA on, {q} token(s)", None, s.ours(True, q)) for q in args.tokens]
            passes.append(("int4 draft", "draft_int4", s.ours(False, 1, drafter="draft_int4")))
            for name, drafter, step in passes:
                session = s.sessions[False, drafter]
                with session.installed(), torch.no_grad():
                    direct = dict(session.fwd.direct)
                    if not direct:
                        print(f"| {name} | {rows} | (no plain-function pass on this model) | | |")
                        continue
                    for _ in range(3):
                        step()
                    times = {"modules": [], "direct": []}
                    for _ in range(args.repeats):
                        for mode in times:
                            session.fwd.direct = direct if mode == "direct" else {}
                            t = time.perf_counter()
                            step()
                            times[mode].append(time.perf_counter() - t)
                    session.fwd.direct = direct
                med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
                print(f"| {name} | {rows} | {med['modules']:.2f} | {med['direct']:.2f} | "
                      f"{med['modules'] / med['direct']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
