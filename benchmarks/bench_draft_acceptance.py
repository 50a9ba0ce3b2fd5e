"""How often each low-precision drafter's drafts are accepted, with the output head at the drafter's
own dtype or at the floor drafters.HEAD_FLOOR gives it (int4 drafters: an int8 head).

On the zoo (SmolLM2-135M-Instruct + its adapters), greedy, each adapter alone on --rows rows of its
held-out prompts, one draft per cycle (gate="always", k = 1: every draft is judged on its own),
acceptance = accepted / drafted over all adapters; prompt lookup off.

    python -P benchmarks/bench_draft_acceptance.py [--adapters humaneval kjv ...] [--rows 2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from bench_decoding import load, workload
from common import machine

from hf_invisiblelora.decode import drafters
from hf_invisiblelora.model.state import state_of


def acceptance(model, encode, prompts_for, adapters, rows: int, new_tokens: int, dtype) -> tuple[int, int]:
    state_of(model).drafter.pop("weights", None)  # copies made again under the head's dtype of this run
    accepted = drafted = 0
    for name in adapters:
        names, enc = workload(encode, [name], prompts_for, 1, rows)
        with torch.no_grad():
            out = model.generate(**enc, adapter_names=names, max_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True, invisible_lora=True, gate="always",
                                 num_draft_tokens=1, draft_dtype=dtype, prompt_lookup=False)
        accepted, drafted = accepted + sum(out.stats.accepted), drafted + sum(out.stats.drafted)
    return accepted, drafted


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", nargs="+", default=["humaneval", "kjv", "python_code", "shakespeare",
                                                      "python_docs", "sotu", "poetry", "austen"])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    print(machine())
    model, encode, _, prompts_for, _ = load("zoo", "cpu", torch.float32, 0.3, adapters=args.adapters)
    floor = dict(drafters.HEAD_FLOOR)
    print("| draft dtype | head | acceptance | drafts judged |\n|---|---|---:|---:|")
    for dtype in (torch.bfloat16, torch.int8, torch.int4):
        heads = [dtype] + ([floor[dtype]] if dtype in floor else [])
        for head in heads:
            drafters.HEAD_FLOOR.clear()
            drafters.HEAD_FLOOR.update({} if head == dtype else {dtype: head})
            a, n = acceptance(model, encode, prompts_for, args.adapters, args.rows, args.new_tokens, dtype)
            print(f"| {str(dtype)[6:]} | {str(head)[6:]} | {a / n:.3f} | {n} |", flush=True)
    drafters.HEAD_FLOOR.clear()
    drafters.HEAD_FLOOR.update(floor)


if __name__ == "__main__":
    main()
