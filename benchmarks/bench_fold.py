"""One pass per engine cycle: a joining prompt's chunk in the cycle's verify pass, or a pass of its own.

1. Passes: on the engine's assembly (bench_step.py's Setup: generate()'s Session, prepacked layers,
   4 adapters, a 64-token context), rows decoding one token each and the last row joining with a
   chunk of prompt slots (--shapes: rows x slots), timed interleaved: the folded pass (a ragged pass: each row its
   own tokens, the linear layers on the real ones only; rectangular elsewhere) against a plain
   1-token step of the rows plus a prefill pass of the joining row alone.
2. The engine at saturation: --requests requests at once (prompts of 10-50 tokens, max_tokens 8-64,
   greedy, the zoo's adapters mixed) on one engine, with ``FOLD_SLOTS`` (engine/scheduler.py: the largest
   rows x slots a folded pass may have) at each of --fold-slots, interleaved repeats; tokens/s.

    python -P benchmarks/bench_fold.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import CONTEXT, Setup
from common import interleaved, machine

from hf_invisiblelora import zoo
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.engine import scheduler
from hf_invisiblelora.model.state import state_of

ADAPTERS = ["humaneval", "kjv", "python_code", "shakespeare"]


def passes(model, names, vocab, rows: int, slots: int, repeats: int) -> dict:
    """ms of the folded pass, the plain step of the rows decoding and the joining row's prefill
    (medians, interleaved). Rows 0..rows-2 decode their token at the end of a CONTEXT-token context;
    the last row's prompt starts at slot 0."""
    with state_of(model).hold():
        s = Setup(model, names, rows, vocab, list(range(8192)), prepack=True)
        fwd = s.sessions[False, None].fwd
        start = torch.full((rows,), CONTEXT - 1, dtype=torch.long)
        start[-1] = 0
        kv = max(CONTEXT, slots)
        ids = torch.randint(3, 1000, (rows, slots), generator=torch.Generator().manual_seed(rows * slots))
        lens = torch.ones(rows, dtype=torch.long)
        lens[-1] = slots
        last, decoding = torch.tensor([rows - 1]), slice(0, rows - 1)
        steps = {"folded": (s.installed(), lambda: fwd(ids, start, kv, keep=1, rows=slice(0, rows), lens=lens)),
                 "step": (s.installed(), lambda: fwd(ids[decoding, :1], start[decoding], CONTEXT, keep=1, rows=decoding)),
                 "prefill": (s.installed(), lambda: fwd(ids[-1:], start[-1:], slots, keep=1, rows=last))}
        t, _ = interleaved(steps, repeats)
    return {k: 1000 * v for k, v in t.items()}


def saturation(model, tok, names, fold_slots: list[int], requests: int, repeats: int) -> dict:
    """tokens/s of the engine per FOLD_SLOTS value: one engine, interleaved repeats."""
    rng = random.Random(0)
    jobs = []
    for i in range(requests):
        name = names[i % len(names)]
        ids = tok(zoo.adapter_prompts("smollm2", tok, name, 1, 50, seed=i)[0]).input_ids[: rng.randint(10, 50)]
        jobs.append((ids, name, rng.randint(8, 64)))
    rates = {f: [] for f in fold_slots}
    saved = scheduler.FOLD_SLOTS
    engine = Engine(model, max_batch=8).start()
    try:
        engine.submit(Request(jobs[0][0], adapter=names[0], max_tokens=8)).result(600)  # warm-up
        for rep in range(repeats):
            for f in fold_slots[rep % len(fold_slots):] + fold_slots[: rep % len(fold_slots)]:
                scheduler.FOLD_SLOTS = f
                t = time.perf_counter()
                handles = [engine.submit(Request(ids, adapter=a, max_tokens=m)) for ids, a, m in jobs]
                n = sum(len(h.result(600)) for h in handles)
                rates[f].append(n / (time.perf_counter() - t))
    finally:
        engine.stop()
        scheduler.FOLD_SLOTS = saved
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x4", "8x8", "8x16", "8x48", "4x16", "2x8", "2x32"],
                   help="rows x slots of the folded passes")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--fold-slots", nargs="+", type=int, default=[0, 128, 512])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--engine-repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok, names = zoo.load_zoo("smollm2", ADAPTERS)
    vocab = model.get_base_model().config.get_text_config().vocab_size
    print(f"python -P benchmarks/bench_fold.py {' '.join(sys.argv[1:] if argv is None else argv)}\n{machine()}, "
          f"{torch.get_num_threads()} threads\n")
    print("| rows x chunk slots | folded ms | step + own prefill ms | folded / separate |\n|---|---:|---:|---:|")
    for shape in args.shapes:
        rows, slots = map(int, shape.split("x"))
        t = passes(model, names, vocab, rows, slots, args.repeats)
        separate = t["step"] + t["prefill"]
        print(f"| {rows} x {slots} | {t['folded']:.1f} | {separate:.1f} | {t['folded'] / separate:.2f} |", flush=True)
    if args.fold_slots:
        rates = saturation(model, tok, names, args.fold_slots, args.requests, args.engine_repeats)
        print(f"\nThe engine, {args.requests} requests at once: tokens/s per FOLD_SLOTS (median; runs)")
        for f, r in rates.items():
            print(f"FOLD_SLOTS {f}: {statistics.median(r):.1f} ({', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
