"""InvisibleLoRA on a real model: one mixed batch of prompts across several LoRA adapters.

    python -m hf_invisiblelora.zoo.demo [--adapters NAME ...] [--quantize int8|int4] [--max-new-tokens 32]
                                        [--draft 4] [--repeats 3]

The first run prepares SmolLM2-135M-Instruct and trains the few zoo adapters it needs (minutes on
2 CPU cores); later runs reuse them. The batch is decoded greedily three ways, interleaved and
repeated: the standard way (``generate(adapter_names=...)``), ``invisible_lora=True`` with
``gate="never"`` (the batched LoRA kernels alone, no drafting) and with the default gate (kernels
and drafting where the gate expects it to pay). The texts must be the same; the speed ratios are
printed as medians with their spread, and say how often the gate drafted. Exit status 1 if any row
differs, 2 if an asset cannot be had.

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
    seconds, outs, texts = {w: [] for w in WAYS}, {}, {}
    for _ in range(args.repeats):  # interleaved: a machine that slows down or speeds up meanwhile hits all three
        for way in ways:
            texts[way], s, outs[way] = run(way, enc, gen)
            seconds[way].append(s)

    base = "SmolLM2-135M-Instruct" + (f" (torchao {args.quantize} weight-only)" if args.quantize else "")
    print(f"\n{base}, {len(rows)} rows, adapters {sorted(set(rows))}, greedy, "
          f"{args.max_new_tokens} new tokens, K={args.draft}; {threads}\n")
    std = texts["standard"]
    for i, (name, prompt) in enumerate(zip(rows, prompts)):
        differ = [w for w in ("kernels", "invisible") if texts[w][i] != std[i]]
        same = "same" if not differ else f"{' and '.join(differ)} DIFFER from standard: " + repr(tok.decode(std[i]))
        print(f"[{name}] ...{prompt[-60:]!r}\n    -> {tok.decode(texts['invisible'][i])!r}  ({same})")
    stats = outs["invisible"].stats
    print(f"\n{stats.summary()}")
    tokens = sum(map(len, std))
    standard = "stock, each row alone" if alone else "standard generate"
    for way, label in (("standard", standard), ("kernels", "invisible_lora, gate='never'"),
                       ("invisible", "invisible_lora (gate 'auto')")):
        median = statistics.median(seconds[way])
        print(f"{label:>30}: {tokens / median:6.1f} tokens/s (median of {args.repeats} runs, "
              f"{min(seconds[way]):.2f}-{max(seconds[way]):.2f} s)")
    matches = sum(all(texts[w][i] == std[i] for w in WAYS) for i in range(len(rows)))
    kernels = [s / k for s, k in zip(seconds["standard"], seconds["kernels"])]
    both = [s / f for s, f in zip(seconds["standard"], seconds["invisible"])]
    drafted = sum(1 for k in stats.k_per_cycle if k)
    print(f"same text: {matches}/{len(rows)} rows. Speed over {standard}: {spread(kernels)} from the batched "
          f"LoRA kernels alone (no drafting); {spread(both)} with the gate, which drafted in {drafted} of "
          f"{stats.cycles} cycles (the rest were plain LoRA-on steps on the same kernels).")
    return 0 if matches == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
