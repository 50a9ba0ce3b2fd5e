"""Would a layer-skipping drafter pay? Acceptance of the base model with some decoder layers skipped.

Self-speculation (the base with layers skipped drafts; no extra weights) cuts a draft pass's
work in proportion to the layers skipped, per-layer fixed costs included, which low-bit copies do
not. It pays only if acceptance holds up. This measures the per-position greedy acceptance the
gate would see (gate.py: a per-draft Bernoulli): each adapter's greedy continuation of held-out
prompts (LoRA on), then one teacher-forced pass of the base model (LoRA off) with the skip set
over prompt + continuation; a position is accepted where its argmax is the adapter's token.
Skip sets: n layers spread evenly over the middle (the first quarter and last two layers kept),
and the last layers before the final one.

    python -P benchmarks/bench_layer_skip.py --adapters humaneval kjv python_code shakespeare
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, zoo_continuations_args


def skip_sets(n_layers: int, counts: list[int]) -> dict:
    middle = list(range(n_layers // 4, n_layers - 2))
    sets = {"none": []}
    for n in counts:
        step = len(middle) / n
        sets[f"{n} of the middle"] = sorted({middle[int(i * step)] for i in range(n)})
    sets["4 before the last"] = list(range(n_layers - 5, n_layers - 1))
    return sets


def main(argv=None):
    from hf_invisiblelora import zoo

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    zoo_continuations_args(p, new_tokens=40)
    p.add_argument("--skips", nargs="+", type=int, default=[2, 4, 6, 8])
    args = p.parse_args(argv)
    model, tok, names = zoo.load_zoo(args.zoo, args.adapters)
    inner = model.get_base_model()
    decoder = inner.get_decoder()
    layers = decoder.layers
    sets = skip_sets(len(layers), args.skips)
    acc = {label: [] for label in sets}
    for name in names:
        model.set_adapter(name)
        for prompt in zoo.adapter_prompts(args.zoo, tok, name, args.prompts, args.prompt_tokens, seed=7):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            start, target = ids.shape[1], out[0, ids.shape[1]:]
            for label, skip in sets.items():
                decoder.layers = torch.nn.ModuleList(m for i, m in enumerate(layers) if i not in skip)
                try:
                    with torch.no_grad(), model.disable_adapter():
                        logits = inner(out, use_cache=False).logits[0, start - 1:-1]
                finally:
                    decoder.layers = layers
                acc[label].append((logits.argmax(-1) == target).float().mean().item())
    print(f"python -P benchmarks/bench_layer_skip.py {' '.join(sys.argv[1:])}\n{machine()}; {args.zoo}, "
          f"{len(layers)} layers, adapters {', '.join(names)}; {args.prompts} prompts each\n")
    print("| layers skipped | which | per-draft acceptance (mean) | median over prompts |\n|---|---|---:|---:|")
    for label, skip in sets.items():
        print(f"| {label} | {skip} | {statistics.mean(acc[label]):.2f} | {statistics.median(acc[label]):.2f} |")


if __name__ == "__main__":
    main()
