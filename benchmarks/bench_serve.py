"""Serving benchmark: requests arriving over time (Poisson), adapters mixed, served three ways.

On the zoo (SmolLM2-135M-Instruct and its real LoRA adapters; prompts cut from each adapter's
held-out domain), greedy, each request with its own max_tokens. For each request rate, the same
arrival schedule is served by:
  stock   stock PEFT with static batches: the requests that have arrived (up to --max-batch) form a
          batch, decoded by ``model.generate(adapter_names=...)`` until its longest request is done;
          requests arriving meanwhile wait for the next batch;
  static  the same batches through our ``generate(..., invisible_lora=True)``;
  engine  the continuous-batching engine (engine.py, in process, no HTTP): each request is
          submitted at its arrival time, joins a free row at the next cycle and leaves when done;
  engine_whole  (not by default) the engine with every prompt prefilled in one pass: the A/B of
          its chunked prefill (--prefill-chunk).
Measured per request: time to first token (arrival -> first token committed), time per output token
after the first ((last token - first token) / (tokens - 1)) and end-to-end latency; for the engine,
the gaps between two deliveries of a request's tokens (what a long prefill makes rows decoding wait); per run the
throughput (tokens of all requests / (last token - first arrival)). A token's time is when the
decoder committed it: the engine, the request's on_tokens callback; static batches, a stopping
criterion that records when each length is reached (stock generate() calls it after every step,
so the times are exact; invisible_lora=True calls it in each cycle for every length some row of
the batch reached, and a request's last token is taken at the last such call for its length, when
the slowest row got there: late by at most the cycles the request was ahead, an upper bound; its
first token comes from the prefill, the same for every row). Tokens count up to EOS or the
request's max_tokens: a static batch decoding past them is waste. Runs are bounded: --requests per rate, and requests not started --max-seconds
after the first arrival are dropped (counted).

    python benchmarks/bench_serve.py                       # zoo, rates 0.25 0.5 1 2 req/s, 32 requests each
    python benchmarks/bench_serve.py --rates 1 4 --requests 64 --device cuda
    python benchmarks/bench_serve.py --smoke --out /tmp/x  # tiny random model, seconds (tests)

Prints tables, writes serve.json and serve.png to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_invisiblelora  # noqa: F401  (generate(invisible_lora=True))
from hf_invisiblelora.engine import PREFILL_CHUNK, Engine, Request

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import busy, machine, sync

MODES = ("stock", "static", "engine", "engine_whole")  # engine_whole: the engine without chunked prefill


@dataclass
class Job:
    """One request of the schedule and what happened to it (times in seconds from the run's start)."""

    index: int
    arrival: float
    adapter: str
    ids: list
    max_tokens: int
    first: float | None = None
    done: float | None = None
    tokens: list = field(default_factory=list)
    dropped: bool = False
    gaps: list = field(default_factory=list)  # the engine: seconds between two deliveries of tokens

    def fresh(self) -> "Job":
        return Job(self.index, self.arrival, self.adapter, self.ids, self.max_tokens)


def load(smoke: bool, adapters, device: str, dtype):
    """(peft model, tokenizer, adapter names, prompts_for(name, count, seed) -> list of token id lists)."""
    if smoke:
        from tiny import tiny_peft, tiny_tokenizer

        tok, model = tiny_tokenizer(), tiny_peft("llama", strength=0.5, dtype=torch.float32)
        names = ["s", "b", "c", "d"]
        texts = ["the quick brown fox", "once upon a time", "hello world", "over the lazy dog"]

        def prompts_for(name, n, seed):
            return [tok(texts[(seed + i) % 4])["input_ids"] for i in range(n)]
    else:
        from hf_invisiblelora import zoo

        model, tok, names = zoo.load_zoo("smollm2", adapters, dtype=dtype)

        def prompts_for(name, n, seed):
            return [tok(p)["input_ids"] for p in zoo.adapter_prompts("smollm2", tok, name, n, PROMPT_TOKENS, seed=seed)]
    return model.to(device=device, dtype=dtype).eval(), tok, names, prompts_for


PROMPT_TOKENS = 32  # set from --prompt-tokens


def schedule(names, prompts_for, n: int, rate: float, max_tokens: int, seed: int, min_tokens: int | None = None,
             min_prompt: int | None = None) -> list[Job]:
    """``n`` requests with exponential gaps of mean 1/rate, adapters drawn uniformly, max_tokens
    uniform in [min_tokens (default max_tokens/2), max_tokens]; with ``min_prompt``, each prompt cut
    to a length uniform in [min_prompt, its length]."""
    rng = random.Random(seed)
    pool = {name: [p for p in prompts_for(name, max(2, math.ceil(2 * n / len(names))), seed) if p] for name in names}
    low = max(1, max_tokens // 2) if min_tokens is None else min_tokens
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate) if i else 0.0
        name = rng.choice(names)
        ids = rng.choice(pool[name])
        if min_prompt is not None:
            ids = ids[: rng.randint(min(min_prompt, len(ids)), len(ids))]
        jobs.append(Job(i, t, name, ids, rng.randint(low, max_tokens)))
    return jobs


class StepClock(StoppingCriteria):
    """Records when each length was first and last reached (never stops anything)."""

    def __init__(self, start: float):
        self.start, self.first, self.last = start, {}, {}

    def __call__(self, input_ids, scores, **kwargs):
        sync()
        now, length = time.perf_counter() - self.start, input_ids.shape[-1]
        self.first.setdefault(length, now)
        self.last[length] = now
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def useful(tokens: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """A request's tokens: up to its first EOS (included) or its max_tokens."""
    tokens = tokens[:max_tokens]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def run_static(model, tok, jobs: list[Job], args, invisible: bool, eos: set[int]) -> dict:
    """Static batches: whoever has arrived (up to max_batch) is decoded together to the end. Returns
    where the time went (``split``)."""
    device = model.device
    split = dict(prefill_s=0.0, decode_s=0.0, prompt_slots=0, row_steps=0)
    extra = dict(invisible_lora=True, num_draft_tokens=args.num_draft_tokens, gate=args.gate) if invisible else {}
    pending = list(jobs)
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if now > args.max_seconds:
            for job in pending:
                job.dropped = True
            return split
        if pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            continue
        batch = [j for j in pending if j.arrival <= now][: args.max_batch]
        pending = [j for j in pending if j not in batch]
        width = max(len(j.ids) for j in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, j in enumerate(batch):
            ids[i, width - len(j.ids):] = torch.tensor(j.ids)
            mask[i, width - len(j.ids):] = 1
        clock = StepClock(start)
        began = time.perf_counter() - start
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 adapter_names=[j.adapter for j in batch], max_new_tokens=max(j.max_tokens for j in batch),
                                 do_sample=False, pad_token_id=tok.pad_token_id,
                                 stopping_criteria=StoppingCriteriaList([clock]), **extra)
        sync()
        end = time.perf_counter() - start
        first = clock.first.get(width + 1, end)
        split["prefill_s"] += first - began
        split["decode_s"] += end - first
        split["prompt_slots"] += len(batch) * width
        split["row_steps"] += len(batch) * (out.shape[1] - width - 1)
        for i, j in enumerate(batch):
            j.tokens = useful(out[i, width:].tolist(), j.max_tokens, eos)
            n = len(j.tokens)
            j.first = first
            j.done = clock.last.get(width + n, end) if n else end
    return split


class TimedEngine(Engine):
    """The engine with where its thread's time went: prefill passes of their own (whole or chunks) and
    cycles (with the prompt slots that rode in their verify passes: ``folded_cycles``), the rows each
    cycle's passes ran (rows 0..last active) and how many of them were active."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.split = dict(prefill_s=0.0, decode_s=0.0, prompt_slots=0, row_steps=0, active_row_steps=0, folded_cycles=0)
        scheduler = self._scheduler  # its prefills (groups, cached prefixes, chunks) timed where they run
        prefill, next_chunk = scheduler._prefill, scheduler.next_chunk

        def timed_prefill(decoder, group, blocks=()):
            self.split["prompt_slots"] += len(group) * max(len(h.request.prompt) for _, h in group)
            return self._timed("prefill_s", prefill, decoder, group, blocks)
        scheduler._prefill = timed_prefill
        scheduler.next_chunk = lambda decoder, fold: self._timed("prefill_s", next_chunk, decoder, fold)

    def _timed(self, key, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            sync()
            self.split[key] += time.perf_counter() - t

    def _cycle(self, decoder, joining=None):
        self.split["row_steps"] += decoder.batch.hi
        self.split["active_row_steps"] += len(decoder.batch.active)
        self.split["folded_cycles"] += joining is not None  # cycles whose verify pass also ran prompt slots
        return self._timed("decode_s", super()._cycle, decoder, joining)


def run_engine(model, jobs: list[Job], args, chunked: bool = True) -> dict:
    """Each request submitted at its arrival time; token times from its on_tokens callback. ``chunked``:
    long prompts prefilled in chunks of --prefill-chunk tokens (else each in one pass)."""
    max_len = max(len(j.ids) + j.max_tokens for j in jobs) + args.num_draft_tokens + 1
    engine = TimedEngine(model, max_batch=args.max_batch, max_len=max_len, num_draft_tokens=args.num_draft_tokens,
                    gate=args.gate, prefill_chunk=args.prefill_chunk if chunked else None).start()
    start = time.perf_counter()
    handles = []
    try:
        for j in jobs:
            wait = j.arrival - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            if time.perf_counter() - start > args.max_seconds:
                j.dropped = True
                continue

            def on_tokens(tokens, j=j):
                now = time.perf_counter() - start
                if j.first is None:
                    j.first = now
                else:
                    j.gaps.append(now - j.done)
                j.done = now
                return False

            handles.append((j, engine.submit(Request(j.ids, adapter=j.adapter, max_tokens=j.max_tokens, temperature=0,
                                                     on_tokens=on_tokens))))
        # Requests still waiting for a row when the time is up are dropped, as static batches not started.
        deadline = start + args.max_seconds
        for j, h in handles:
            if not h.done.wait(max(0.0, deadline - time.perf_counter())):
                if j.first is None:
                    h.cancel()
                h.done.wait()
            j.tokens = list(h.tokens)
            if h.finish_reason == "cancelled":
                j.dropped, j.first, j.done, j.tokens = True, None, None, []
            elif h.finish_reason == "error":
                raise RuntimeError(f"engine error: {h.error}")
        metrics = engine.metrics
        return dict(cycles=metrics["cycles"], k_hist={int(k): v for k, v in sorted(metrics["k_hist"].items())},
                    drafted=sum(metrics["drafted"].values()), accepted=sum(metrics["accepted"].values()),
                    split=engine.split)
    finally:
        engine.stop()


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(jobs: list[Job]) -> dict:
    served = [j for j in jobs if not j.dropped and j.tokens]
    ttft = [j.first - j.arrival for j in served]
    tpot = [(j.done - j.first) / (len(j.tokens) - 1) for j in served if len(j.tokens) > 1]
    e2e = [j.done - j.arrival for j in served]
    tokens = sum(len(j.tokens) for j in served)
    span = max((j.done for j in served), default=0) - min((j.arrival for j in jobs), default=0)
    out = dict(requests=len(jobs), completed=len(served), dropped=sum(j.dropped for j in jobs), tokens=tokens,
               seconds=round(span, 3), tokens_per_s=tokens / span if span > 0 else None)
    gaps = [g for j in served for g in j.gaps]  # how long a decoding request waited for its next tokens
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e), ("gap", gaps)):
        out[f"{name}_p50"], out[f"{name}_p99"] = percentile(values, 50), percentile(values, 99)
    out["gap_max"] = max(gaps, default=None)
    return out


def warm_up(model, tok, names, prompts_for, args, eos) -> None:
    """One short run of each mode: allocations, the gate's first timings, the bank."""
    jobs = [Job(i, 0.0, names[i % len(names)], prompts_for(names[i % len(names)], 1, 99)[0], 4) for i in range(2)]
    for mode in args.modes:
        fresh = [j.fresh() for j in jobs]
        if mode.startswith("engine"):
            run_engine(model, fresh, args, chunked=mode == "engine")
        else:
            run_static(model, tok, fresh, args, invisible=mode == "static", eos=eos)


def fmt(v, scale=1.0, digits=2):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(results) -> str:
    lines = ["| req/s | mode | done / dropped | tokens/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) "
             "| gap between deliveries p99 / max (s) |", "|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        for mode, s in run["modes"].items():
            lines.append(f"| {run['rate']:g} | {mode} | {s['completed']} / {s['dropped']} | {fmt(s['tokens_per_s'], digits=1)} | "
                         f"{fmt(s['ttft_p50'])} / {fmt(s['ttft_p99'])} | {fmt(s['tpot_p50'], 1000, 1)} / "
                         f"{fmt(s['tpot_p99'], 1000, 1)} | {fmt(s['e2e_p50'])} / {fmt(s['e2e_p99'])} | "
                         f"{fmt(s['gap_p99'])} / {fmt(s['gap_max'])} |")
    return "\n".join(lines)


def split_table(results) -> str:
    """Where each run's time went: prefill passes and decoding, the prompt slots prefilled (rows x
    padded width, summed over passes) and the rows decoded: a static batch's rows x its new-token
    positions (a row past its EOS or max_tokens still fills them), the engine's rows each cycle's
    passes ran (0..last active) x cycles, with the active ones among them and the cycles whose verify
    pass also ran prompt slots (a join's prefill, in "decode s" then); against the useful tokens."""
    lines = ["| req/s | mode | prefill s | decode s | prompt slots prefilled | static: rows x positions; engine: "
             "rows x cycles (active) | useful tokens |",
             "|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        for mode, s in run["modes"].items():
            p = s["split"]
            active = f" ({p['active_row_steps']}; {p['folded_cycles']} cycles with prompt slots)" \
                if "active_row_steps" in p else ""
            lines.append(f"| {run['rate']:g} | {mode} | {p['prefill_s']:.1f} | {p['decode_s']:.1f} | {p['prompt_slots']} | "
                         f"{p['row_steps']}{active} | {s['tokens']} |")
    return "\n".join(lines)


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in results["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("tokens_per_s", None, "throughput (tokens/s)", 1), ("ttft_p50", "ttft_p99", "time to first token (s)", 1),
              ("tpot_p50", "tpot_p99", "time per output token (ms)", 1000)]
    for ax, (p50, p99, label, scale) in zip(axes, panels):
        for i, mode in enumerate(results["modes"]):
            color = f"C{i}"
            ys = [r["modes"][mode][p50] for r in results["runs"]]
            ax.plot(rates, [None if y is None else y * scale for y in ys], marker="o", color=color,
                    label=f"{mode} p50" if p99 else mode)
            if p99:
                ys = [r["modes"][mode][p99] for r in results["runs"]]
                ax.plot(rates, [None if y is None else y * scale for y in ys], marker="x", ls="--", color=color,
                        label=f"{mode} p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        if p99:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(f"{results['model']}: {results['requests_per_rate']} requests per rate, max batch {results['max_batch']}, "
                 f"K={results['num_draft_tokens']}, gate {results['gate']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    global PROMPT_TOKENS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model, two rates, 8 requests (for tests)")
    p.add_argument("--out", default="benchmarks/results", help="folder for serve.json and serve.png")
    p.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.5, 1, 2], help="request rates (req/s)")
    p.add_argument("--requests", type=int, default=32, help="requests per rate")
    p.add_argument("--max-seconds", type=float, default=300, help="per run: requests not started by then are dropped")
    p.add_argument("--max-tokens", type=int, default=64, help="a request's max_tokens: uniform in [half, this]")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--min-prompt-tokens", type=int, help="prompts cut to lengths uniform in [this, --prompt-tokens]")
    p.add_argument("--min-max-tokens", type=int, help="max_tokens uniform in [this, --max-tokens] (default: half)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="the engine's prompt tokens per prefill pass")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--gate", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--adapters", nargs="+", help="zoo adapters to mix (default: every built one)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:3]))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPUs while it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.rates, args.requests, args.max_tokens, args.max_batch, args.num_draft_tokens = [20, 80], 8, 8, 4, 2
        args.max_seconds = min(args.max_seconds, 120)
        args.threads = args.threads or 1  # tiny passes: intra-op threads only spin (and starve on a busy machine)
    if args.threads:
        torch.set_num_threads(args.threads)
    PROMPT_TOKENS = args.prompt_tokens
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {command}", flush=True)
    model, tok, names, prompts_for = load(args.smoke, args.adapters, args.device, getattr(torch, args.dtype))
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(command=command, machine=machine(), device=args.device, dtype=args.dtype,
                   threads=torch.get_num_threads(), torch=torch.__version__, model="tiny (smoke)" if args.smoke else "smollm2",
                   adapters=names, modes=args.modes, requests_per_rate=args.requests, max_tokens=args.max_tokens,
                   prompt_tokens=args.prompt_tokens, min_prompt_tokens=args.min_prompt_tokens,
                   min_max_tokens=args.min_max_tokens, prefill_chunk=args.prefill_chunk, max_batch=args.max_batch, num_draft_tokens=args.num_draft_tokens,
                   gate=args.gate, max_seconds=args.max_seconds, seed=args.seed, runs=[])
    results["busy"] = args.busy
    with busy(args.busy):  # --busy: another user's work on the machine meanwhile
        warm_up(model, tok, names, prompts_for, args, eos)
        for rate in args.rates:
            jobs = schedule(names, prompts_for, args.requests, rate, args.max_tokens, args.seed, args.min_max_tokens,
                            args.min_prompt_tokens)
            run = dict(rate=rate, modes={}, requests=[])
            served = {}
            for mode in args.modes:
                mine = [j.fresh() for j in jobs]
                if mode.startswith("engine"):
                    engine_stats = run_engine(model, mine, args, chunked=mode == "engine")
                    split = engine_stats.pop("split")
                else:
                    split, engine_stats = run_static(model, tok, mine, args, invisible=mode == "static", eos=eos), None
                run["modes"][mode] = summarize(mine) | {"split": split} | ({"engine": engine_stats} if engine_stats else {})
                served[mode] = mine
                s = run["modes"][mode]
                print(f"rate {rate:g} req/s, {mode}: {s['completed']} done, {s['dropped']} dropped, "
                      f"{fmt(s['tokens_per_s'], digits=1)} tokens/s, TTFT p50 {fmt(s['ttft_p50'])} s, "
                      f"TPOT p50 {fmt(s['tpot_p50'], 1000, 1)} ms", flush=True)
            # Greedy outputs of the same request in the different modes (equal up to float32 near-ties).
            first = args.modes[0]
            run["same_tokens_as_" + first] = {
                mode: sum(a.tokens == b.tokens for a, b in zip(served[first], served[mode]) if not a.dropped and not b.dropped)
                for mode in args.modes[1:]}
            run["requests"] = {mode: [dict(asdict(j), ids=len(j.ids), tokens=len(j.tokens)) for j in served[mode]]
                               for mode in args.modes}
            results["runs"].append(run)
            (out / "serve.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "serve.png")
    print("\n" + table(results) + "\n\n" + split_table(results))
    for run in results["runs"]:
        same = run["same_tokens_as_" + args.modes[0]]
        if same:
            print(f"rate {run['rate']:g}: requests with the same tokens as {args.modes[0]}: "
                  + ", ".join(f"{m} {n}/{run['modes'][m]['completed']}" for m, n in same.items()))
    print(f"\nwrote {out / 'serve.json'} and {out / 'serve.png'}\ncommand: {command}")
    return results


if __name__ == "__main__":
    main()
