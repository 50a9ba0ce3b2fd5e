"""Memory over long runs: the process's resident memory (RSS) while the engine loads, uses and unloads
adapters over and over, and while it serves many short requests (in process, no HTTP).

On the zoo (SmolLM2-135M and its LoRA adapters, all loaded), float32, greedy. Three phases, each on
a fresh engine over the same model (four phases):
  cycles    --cycles times: load a zoo adapter under a new name (``engine.load_adapter``; the
            smallest one unless --adapter), one request with it and one with a zoo adapter beside it,
            then unload it (``engine.unload_adapter``). RSS after each cycle.
  many      --many adapters loaded one after the other (the zoo's, round robin, under new names),
            each used by one request, then all unloaded: RSS before, at the peak, after unloading.
  requests  --requests short requests (16-token held-out prompts of the adapters' domains,
            --max-tokens new tokens), the zoo adapters and the base model round robin, submitted
            --max-batch at a time. RSS every --every requests. Bounded by --max-seconds: the
            requests done by then are reported.
  bounded   --bounded-requests requests the same way over the zoo adapters (RSS every
            --bounded-every), the engine holding at most --max-cpu-loras of them (the others given
            by path: evicted, least recently used first, and loaded again when a request names one)
            and --max-loras adapters per pass.
  prefixes  --prefixes requests whose prompts all start differently (a distinct 32-token head, then
            a held-out prompt), the adapters round robin, with prefix caching in --prefix-cache-bytes
            (its blocks of every prompt and output are kept, the least recently used evicted): RSS
            every --every requests, and the cache's bytes against its bound.
  reloads   --reloads reloads in place (``load_adapter(inplace=True)``) of one adapter, its revisions
            taking the zoo adapters' folders in turn, while a request started on the previous revision
            decodes (so each reload keeps the old revision until that request ends); one request on
            the new revision after each. RSS after each, and the revisions left over at the end.
Each other phase's first --warm-up samples are its warm-up (the bank, packs and allocator pools reach their
working size); reported: RSS at the end of the warm-up, at the end, and the largest growth after
the warm-up (max RSS after it minus RSS at it). --no-trim skips the engine's malloc_trim after
adapter changes (to measure what it returns).

    python benchmarks/bench_memory.py                           # zoo: 200 cycles, 12 adapters, 5000 + 100 requests
    python benchmarks/bench_memory.py --phases cycles --cycles 50
    python benchmarks/bench_memory.py --smoke --out /tmp/x      # tiny random model, seconds (tests)

Prints the command, the machine and a table; writes memory.json to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import Engine, Request, engine as engine_module

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine

PHASES = ("cycles", "many", "requests", "bounded", "prefixes", "reloads")


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def load(smoke: bool, folder: str):
    """(peft model, {adapter: folder}, prompts: token id lists)."""
    if smoke:
        from tiny import tiny_peft

        model = tiny_peft("llama", strength=0.5, dtype=torch.float32)
        model.save_pretrained(folder)
        paths = {name: os.path.join(folder, name) for name in model.peft_config}
        return model, paths, [[3 + i % 50, 4 + i % 40, 5 + i % 30] for i in range(16)]
    from hf_invisiblelora import zoo

    model, tok, names = zoo.load_zoo("smollm2")
    paths = {name: str(zoo.zoo_dir("smollm2") / name) for name in names}
    prompts = [tok(p)["input_ids"] for name in names for p in zoo.adapter_prompts("smollm2", tok, name, 4, 16)]
    return model, paths, prompts


def folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def summarize(samples: list[float], warm_up: int) -> dict:
    warm = min(warm_up, len(samples)) - 1
    after = samples[warm:]
    return dict(samples=len(samples), warm_up=warm + 1, rss_at_warm_up_mb=round(after[0], 1),
                rss_at_end_mb=round(samples[-1], 1), max_growth_mb=round(max(after) - after[0], 1),
                rss_mb=[round(s, 1) for s in samples])


def started(model, args, **bounds) -> Engine:
    return Engine(model, max_batch=args.max_batch, max_len=args.max_len, num_draft_tokens=args.num_draft_tokens,
                  **bounds).start()


def rebuilt(engine, prompts, adapter) -> None:
    """Once a request is served after adapter changes, the engine has rebuilt its bank (a command
    returns before that)."""
    engine.submit(Request(prompts[0], adapter=adapter, max_tokens=1, temperature=0)).result(600)


def run_cycles(model, paths, prompts, args) -> dict:
    adapter = args.adapter or min(paths, key=lambda n: folder_bytes(paths[n]))
    names = list(paths)
    engine = started(model, args)
    samples, start = [], time.perf_counter()
    try:
        for i in range(args.cycles):
            name = f"cycle{i}"
            engine.load_adapter(name, paths[adapter])
            handles = [engine.submit(Request(prompts[i % len(prompts)], adapter=a, max_tokens=args.max_tokens,
                                             temperature=0)) for a in (name, names[i % len(names)])]
            for h in handles:
                h.result(600)
            engine.unload_adapter(name)
            rebuilt(engine, prompts, names[0])
            samples.append(rss_mb())
            if (i + 1) % args.every_cycles == 0:
                print(f"  cycle {i + 1}: RSS {samples[-1]:.0f} MB", flush=True)
    finally:
        engine.stop()
    return dict(adapter=adapter, adapter_bytes=folder_bytes(paths[adapter]),
                seconds=round(time.perf_counter() - start, 1), **summarize(samples, args.warm_up))


def run_many(model, paths, prompts, args) -> dict:
    names = list(paths)
    engine, start = started(model, args), time.perf_counter()
    try:
        rebuilt(engine, prompts, names[0])
        before, samples = rss_mb(), []
        for i in range(args.many):
            engine.load_adapter(f"many{i}", paths[names[i % len(names)]])
            engine.submit(Request(prompts[i % len(prompts)], adapter=f"many{i}", max_tokens=args.max_tokens,
                                  temperature=0)).result(600)
            samples.append(rss_mb())
        for i in range(args.many):
            engine.unload_adapter(f"many{i}")
        rebuilt(engine, prompts, names[0])
        after = rss_mb()
    finally:
        engine.stop()
    return dict(adapters=args.many, seconds=round(time.perf_counter() - start, 1), rss_at_warm_up_mb=round(before, 1),
                rss_at_end_mb=round(after, 1), max_growth_mb=round(max(samples) - before, 1),
                returned_mb=round(max(samples) - after, 1), rss_mb=[round(s, 1) for s in samples])


def run_requests(model, prompts, args, targets, limit, every, **bounds) -> dict:
    """``limit`` requests, ``targets`` (adapter names or the base model) round robin, max_batch in
    flight; RSS every ``every`` requests."""
    engine = started(model, args, **bounds)
    samples, done, start = [], 0, time.perf_counter()
    order = itertools.cycle(targets)
    try:
        flight = []
        for i in range(limit):
            if time.perf_counter() - start > args.max_seconds:
                break
            flight.append(engine.submit(Request(prompts[i % len(prompts)], adapter=next(order),
                                                max_tokens=args.max_tokens, temperature=0)))
            if len(flight) == args.max_batch:
                for h in flight:
                    h.result(600)
                done, flight = done + len(flight), []
            if (i + 1) % every == 0:
                samples.append(rss_mb())
        for h in flight:
            h.result(600)
        done += len(flight)
        metrics = engine.metrics_snapshot()
    finally:
        engine.stop()
    return dict(requests=done, asked=limit, seconds=round(time.perf_counter() - start, 1), every=every,
                failed=metrics["failed_requests"], loads=metrics["loads"], evictions=metrics["evictions"],
                **summarize(samples or [rss_mb()], args.warm_up))


def distinct(prompts, i: int, vocab: int, head: int = 32) -> list[int]:
    """Prompt i with a head of ``head`` tokens no other i has (its digits in base vocab - 3)."""
    digits, n = [], i
    for _ in range(head):
        digits.append(3 + n % (vocab - 3))
        n //= vocab - 3
    return digits + prompts[i % len(prompts)]


def run_prefixes(model, prompts, args, targets) -> dict:
    vocab = model.get_input_embeddings().weight.shape[0]
    engine = started(model, args, prefix_cache_bytes=args.prefix_cache_bytes)
    samples, peak, start, flight = [], 0, time.perf_counter(), []
    try:
        for i in range(args.prefixes):
            flight.append(engine.submit(Request(distinct(prompts, i, vocab), adapter=targets[i % len(targets)],
                                                max_tokens=args.max_tokens, temperature=0)))
            if len(flight) == args.max_batch:
                for h in flight:
                    h.result(600)
                flight = []
            peak = max(peak, engine.metrics_snapshot()["prefix_bytes"])
            if (i + 1) % args.every == 0:
                samples.append(rss_mb())
        for h in flight:
            h.result(600)
        m = engine.metrics_snapshot()
    finally:
        engine.stop()
    return dict(requests=args.prefixes, seconds=round(time.perf_counter() - start, 1), every=args.every,
                prefix_cache_bytes=args.prefix_cache_bytes, peak_cache_bytes=peak, blocks=m["prefix_blocks"],
                queries=m["prefix_queries"], hits=m["prefix_hits"], failed=m["failed_requests"],
                **summarize(samples, args.warm_up))


def run_reloads(model, paths, prompts, args) -> dict:
    names = list(paths)
    engine, samples, start = started(model, args), [], time.perf_counter()
    try:
        engine.load_adapter("policy", paths[names[0]])
        for i in range(args.reloads):
            long = engine.submit(Request(prompts[i % len(prompts)], adapter="policy", max_tokens=args.max_tokens * 4,
                                         temperature=0, ignore_eos=True))
            engine.load_adapter("policy", paths[names[(i + 1) % len(names)]], inplace=True)
            engine.submit(Request(prompts[(i + 1) % len(prompts)], adapter="policy", max_tokens=args.max_tokens,
                                  temperature=0)).result(600)
            long.result(600)
            samples.append(rss_mb())
        rebuilt(engine, prompts, "policy")  # the last retired revision deleted meanwhile
        left = [a for a in model.peft_config if "#" in a]
        m = engine.metrics_snapshot()
    finally:
        engine.stop()
    return dict(reloads=args.reloads, seconds=round(time.perf_counter() - start, 1), revisions_left=left,
                failed=m["failed_requests"], **summarize(samples, args.warm_up))


def table(results: dict) -> str:
    rows = ["| phase | steps | RSS at warm-up (MB) | RSS at end (MB) | max growth after warm-up (MB) | seconds |",
            "|---|---:|---:|---:|---:|---:|"]
    for phase, r in results["phases"].items():  # many: before loading, after unloading, peak - before
        steps = f"{r['requests']} requests" if "requests" in r else f"{r['adapters']} adapters" if "adapters" in r \
            else f"{r['reloads']} reloads" if "reloads" in r else f"{r['samples']} cycles"
        rows.append(f"| {phase} | {steps} | {r['rss_at_warm_up_mb']:.0f} | {r['rss_at_end_mb']:.0f} | "
                    f"{r['max_growth_mb']:.0f} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model: 20 cycles, 6 adapters, 200 + 40 requests, 1000 prefixes, 200 reloads")
    p.add_argument("--out", default="benchmarks/results", help="folder for memory.json")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--adapter", help="the zoo adapter loaded and unloaded (default: the smallest)")
    p.add_argument("--many", type=int, default=12, help="adapters loaded at once in the many phase")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--bounded-requests", type=int, default=100)
    p.add_argument("--max-cpu-loras", type=int, default=2, help="bounded phase: adapters kept loaded")
    p.add_argument("--max-loras", type=int, default=2, help="bounded phase: adapters per pass")
    p.add_argument("--max-seconds", type=float, default=600, help="per request phase: no request submitted after")
    p.add_argument("--warm-up", type=int, default=10, help="samples of each phase counted as warm-up")
    p.add_argument("--every", type=int, default=50, help="requests between RSS samples")
    p.add_argument("--bounded-every", type=int, default=4, help="bounded phase: requests between RSS samples")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--no-trim", action="store_true", help="skip the engine's malloc_trim after adapter changes")
    p.add_argument("--prefixes", type=int, default=1000, help="prefixes phase: requests, each prompt its own start")
    p.add_argument("--prefix-cache-bytes", type=int, default=64 << 20, help="prefixes phase: the prefix cache's bound")
    p.add_argument("--reloads", type=int, default=200, help="reloads phase: reloads in place")
    args = p.parse_args(argv)
    if args.smoke:
        args.cycles, args.requests, args.bounded_requests, args.every, args.bounded_every = 20, 200, 40, 5, 4
        args.warm_up, args.many, args.prefixes, args.reloads, args.prefix_cache_bytes = 4, 6, 1000, 200, 1 << 20
        args.max_len, args.num_draft_tokens, args.threads = 64, 2, args.threads or 1
    args.every_cycles = max(1, args.cycles // 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_trim:
        engine_module._return_freed_memory = lambda: None
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {command}\nmachine: {machine()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        model, paths, prompts = load(args.smoke, folder)
        names = list(paths)
        results = dict(command=command, machine=machine(), torch=torch.__version__, threads=torch.get_num_threads(),
                       model="tiny (smoke)" if args.smoke else "smollm2", adapters=names, max_batch=args.max_batch,
                       max_tokens=args.max_tokens, trim=not args.no_trim, rss_after_loading_mb=round(rss_mb(), 1),
                       phases={})
        for phase in args.phases:
            print(f"{phase}:", flush=True)
            if phase == "cycles":
                r = run_cycles(model, paths, prompts, args)
            elif phase == "many":
                r = run_many(model, paths, prompts, args)
            elif phase == "requests":
                r = run_requests(model, prompts, args, names + ["__base__"], args.requests, args.every)
            elif phase == "prefixes":
                r = run_prefixes(model, prompts, args, names + ["__base__"])
            elif phase == "reloads":
                r = run_reloads(model, paths, prompts, args)
            else:
                # The model keeps its first adapter (PEFT keeps one); the others are evicted now and
                # loaded on demand.
                for name in names[1:]:
                    model.delete_adapter(name)
                r = run_requests(model, prompts, args, names, args.bounded_requests, args.bounded_every,
                                 max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, adapter_paths=paths)
                r.update(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)
                for name in names:  # as it was, for the phases after (the first may have been evicted too)
                    if name not in model.peft_config:
                        model.load_adapter(paths[name], adapter_name=name)
            results["phases"][phase] = r
            print(f"  RSS at warm-up {r['rss_at_warm_up_mb']:.0f} MB, at end {r['rss_at_end_mb']:.0f} MB, "
                  f"max growth after warm-up {r['max_growth_mb']:.0f} MB ({r['seconds']:.0f} s)", flush=True)
            (out / "memory.json").write_text(json.dumps(results, indent=1))
    print("\n" + table(results))
    print(f"\nwrote {out / 'memory.json'}\ncommand: {command}\nmachine: {results['machine']}")
    return results


if __name__ == "__main__":
    main()
