"""Low precision: how often a bfloat16 / float16 model decodes exactly as stock PEFT does, with the
default LoRA path (the adapter bank) and with lora_backend="peft", and whether every divergence
is at a near tie of stock's own logits.

    python tools/low_precision_report.py [--dtype bfloat16] [--prompts-per-adapter 16] [--new-tokens 32]

SmolLM2-135M-Instruct loaded in the given dtype with the demo's four zoo adapters (PEFT keeps
them in float32), held-out prompts, mixed batches of 16 rows, greedy. A divergence is the first
position where a row differs from stock; its gap is stock's logit of stock's token minus stock's
logit of ours at that step (stock's logits as its own decoding computed them, output_logits=True),
in units of the dtype's spacing at that logit's magnitude. Stock's own noise at that point: the
same margin when stock computes that row's prefix alone (a batch of one, no padding) instead of
in its batch. A divergence is at a near tie if the gap is at most 4 units, or at most the amount
by which stock's own margin moves between those two computations (stock could flip there too;
tools/tiny.py: divergences).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora import zoo

sys.path.insert(0, str(Path(__file__).resolve().parent))  # machine.py, tiny.py, under python -P too
from hf_invisiblelora.zoo.demo import DEMO_ADAPTERS  # noqa: E402
from machine import machine  # noqa: E402
from tiny import all_near_ties, divergences  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--prompts-per-adapter", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="tools/results/low_precision.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    zoo.build("smollm2", only=DEMO_ADAPTERS)
    model, tok, names = zoo.load_zoo("smollm2", DEMO_ADAPTERS, dtype=dtype)
    tok.padding_side = "left"
    prompts, rows = zoo.mixed_prompts("smollm2", tok, names, args.prompts_per_adapter, args.prompt_tokens)
    order = torch.randperm(len(rows)).tolist()  # mixed batches
    prompts, rows = [prompts[i] for i in order], [rows[i] for i in order]
    results = {"default": [], "peft": []}
    for start in range(0, len(rows), args.batch):
        enc = tok(prompts[start : start + args.batch], return_tensors="pt", padding=True)
        names_b = rows[start : start + args.batch]
        kw = dict(adapter_names=names_b, max_new_tokens=args.new_tokens, do_sample=False)
        with torch.no_grad():
            ref = model.generate(**enc, **kw, output_logits=True, return_dict_in_generate=True)
            for backend in results:
                out = model.generate(**enc, **kw, invisible_lora=True, lora_backend="bank" if backend == "default" else "peft",
                                     gate="always", num_draft_tokens=4)
                diverged = divergences(model, names_b, ref, out, enc.attention_mask, enc.input_ids.shape[1])
                results[backend] += [diverged.get(row) for row in range(len(names_b))]
    summary = {}
    for backend, per_row in results.items():
        diverged = [d for d in per_row if d is not None]
        summary[backend] = dict(rows=len(per_row), identical=len(per_row) - len(diverged),
                                divergences=[dict(step=s, gap_units=round(g, 2), stock_noise_units=round(n, 2))
                                             for s, g, n in diverged],
                                all_near_ties=all_near_ties(dict(enumerate(diverged))))
        print(f"{backend:>8}: {summary[backend]['identical']}/{len(per_row)} rows identical to stock; divergences "
              f"(gap / stock's own noise, units of {args.dtype} spacing): "
              f"{[(round(g, 1), round(n, 1)) for _, g, n in diverged]}; all near ties: {summary[backend]['all_near_ties']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), cpu=machine(), summary=summary), indent=1))
    print("command: python tools/low_precision_report.py " + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
