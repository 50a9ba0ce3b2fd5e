"""Prefix caching in the engine (engine/prefix_cache.py): time to first token behind a shared system
prompt, and multi-turn chats, with caching on and off.

On the zoo (SmolLM2-135M-Instruct and four of its adapters; held-out text), greedy, in process (no HTTP):
1. System prompt: --requests requests, one after the other, each a --system-tokens prompt shared by
   all plus its own question (--user-tokens), adapters taking turns, --max-tokens each. With caching
   on, an adapter's first request prefills the system prompt (its blocks are keyed per adapter) and
   the later ones take its blocks. TTFT (submission to the first committed tokens) p50 of the
   requests that hit, against the p50 of all requests with caching off.
2. Chat: --conversations conversations at once (adapters taking turns), --turns turns each; a turn's
   prompt is the conversation so far (the last prompt, its answer, a new user message of
   --user-tokens), as chat clients send it, after a system prompt of --chat-system-tokens shared by
   all (0: none). Throughput (generated tokens / wall time), and whether every answer is the same
   with caching on and off.
Each part runs each way --repeats times, alternately, on a fresh engine (one warm-up request first).

    python -P benchmarks/bench_prefix.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from hf_invisiblelora import zoo
from hf_invisiblelora.engine import Engine, Request

ADAPTERS = ["humaneval", "kjv", "python_code", "shakespeare"]


def texts(tok, names, n: int, tokens: int, seed: int) -> list[list[int]]:
    """``n`` held-out token sequences of ``tokens`` tokens, the adapters' domains taking turns."""
    out = []
    for i in range(n):
        text = zoo.adapter_prompts("smollm2", tok, names[i % len(names)], 1, tokens, seed=seed + i)[0]
        out.append(tok(text).input_ids[:tokens])
    return out


def timed_request(engine, prompt, adapter, max_tokens) -> tuple[list[int], float]:
    """(answer, seconds from submission to its first committed tokens)."""
    first = []
    start = time.perf_counter()
    h = engine.submit(Request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=0,
                              on_tokens=lambda t: first.append(time.perf_counter()) and False))
    return h.result(600), first[0] - start


def system_prompt(model, tok, names, args, caching: bool) -> dict:
    system = texts(tok, names, 1, args.system_tokens, seed=100)[0]
    users = texts(tok, names, args.requests, args.user_tokens, seed=200)
    engine = Engine(model, max_batch=8, max_len=args.max_len, prefix_caching=caching).start()
    try:
        timed_request(engine, users[0], names[0], 2)  # warm-up: no shared block
        ttft, hit = [], []
        for i, user in enumerate(users):
            before = engine.metrics_snapshot()["prefix_hits"]
            _, t = timed_request(engine, system + user, names[i % len(names)], args.max_tokens)
            ttft.append(t)
            hit.append(engine.metrics_snapshot()["prefix_hits"] > before)
    finally:
        engine.stop()
    return dict(ttft=ttft, hit=hit)


def chat(model, tok, names, args, caching: bool) -> dict:
    messages = texts(tok, names, args.conversations * args.turns, args.user_tokens, seed=300)
    system = texts(tok, names, 1, args.chat_system_tokens, seed=400)[0] if args.chat_system_tokens else []
    answers = [[None] * args.turns for _ in range(args.conversations)]
    engine = Engine(model, max_batch=8, max_len=args.max_len, prefix_caching=caching).start()

    def conversation(c):
        prompt = list(system)
        for t in range(args.turns):
            prompt = prompt + messages[c * args.turns + t]
            out = engine.submit(Request(prompt, adapter=names[c % len(names)], max_tokens=args.max_tokens,
                                        temperature=0)).result(600)
            answers[c][t] = out
            prompt = prompt + out

    try:
        timed_request(engine, messages[0], names[0], 2)  # warm-up
        start = time.perf_counter()
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - start
        hits, queries = (engine.metrics_snapshot()[k] for k in ("prefix_hits", "prefix_queries"))
    finally:
        engine.stop()
    tokens = sum(len(a) for conv in answers for a in conv)
    return dict(tokens_per_s=tokens / seconds, seconds=seconds, answers=answers, hits=hits, queries=queries)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--chat-system-tokens", type=int, default=0)
    p.add_argument("--parts", nargs="+", choices=("system", "chat"), default=["system", "chat"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/prefix.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, names = zoo.load_zoo("smollm2", ADAPTERS)
    results = dict(command="python -P benchmarks/bench_prefix.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   machine=machine(), system={"on": [], "off": []}, chat={"on": [], "off": []})
    for rep in range(args.repeats):
        for caching in ((True, False) if rep % 2 == 0 else (False, True)):
            way = "on" if caching else "off"
            if "system" in args.parts:
                results["system"][way].append(system_prompt(model, tok, names, args, caching))
            if "chat" in args.parts:
                results["chat"][way].append(chat(model, tok, names, args, caching))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"{results['command']}\n{machine()}, {torch.get_num_threads()} threads\n")
    if "system" in args.parts:
        print_system(results["system"], args)
    if "chat" in args.parts:
        print_chat(results["chat"], args)


def print_system(runs: dict, args) -> None:
    cached = [t for r in runs["on"] for t, h in zip(r["ttft"], r["hit"]) if h]
    missed = [t for r in runs["on"] for t, h in zip(r["ttft"], r["hit"]) if not h]
    off = [t for r in runs["off"] for t in r["ttft"]]
    print(f"System prompt of {args.system_tokens} tokens + {args.user_tokens}: TTFT p50 / p99 (s)")
    for name, values in (("caching on, blocks found", cached), ("caching on, first under its adapter", missed),
                         ("caching off", off)):
        if values:
            q = statistics.quantiles(values, n=100) if len(values) > 1 else [values[0]] * 99
            print(f"  {name}: {statistics.median(values):.3f} / {q[98]:.3f} ({len(values)} requests)")
    if cached and off:
        print(f"  cached p50 / uncached p50: {statistics.median(cached) / statistics.median(off):.3f}")


def print_chat(runs: dict, args) -> None:
    on_rate = [r["tokens_per_s"] for r in runs["on"]]
    off_rate = [r["tokens_per_s"] for r in runs["off"]]
    same = all(a["answers"] == b["answers"] for a in runs["on"] for b in runs["off"])
    print(f"\nChat: {args.conversations} conversations x {args.turns} turns, a system prompt of "
          f"{args.chat_system_tokens} tokens, {args.max_tokens} tokens an answer: "
          f"tokens/s on {statistics.median(on_rate):.1f} ({', '.join(f'{x:.1f}' for x in on_rate)}), off "
          f"{statistics.median(off_rate):.1f} ({', '.join(f'{x:.1f}' for x in off_rate)}): "
          f"{statistics.median(on_rate) / statistics.median(off_rate):.2f}x; prompt tokens found "
          f"{runs['on'][-1]['hits']} of {runs['on'][-1]['queries']}; "
          f"answers the same on and off: {same}")


if __name__ == "__main__":
    main()
