"""What it costs to see adapter changes: the adapter bank's per-call sync.

Every ``generate(invisible_lora=True)`` call compares the weights and scaling of the adapters its
rows use with the bank's stacks, exactly (so edits through ``.data``, which no version counter
records, are seen too); an adapter no call uses is compared when one does.
Measured on SmolLM2-135M's shape with 16 random adapters (ranks 8-64; ``synthetic_zoo`` of tools/tiny.py) and on the zoo's four demo adapters, next to one generate call for scale.

    python benchmarks/bench_sync.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model.state import state_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine, timed
from tiny import synthetic_zoo


def measure(label, model, names, encode, repeats):
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    state_of(model).clear()
    start = time.perf_counter()
    bank = get_bank(model)
    build = time.perf_counter() - start
    rows = [names[i % len(names)] for i in range(8)]
    used = set(rows)
    every = timed(lambda: get_bank(model), repeats)[0]
    unchanged = timed(lambda: get_bank(model, used), repeats)[0]
    layer = next(iter(bank.layers))
    weight = layer.lora_B[names[0]].weight

    def edited():
        weight.data.mul_(1.0 + 1e-3)  # a .data edit: no version counter sees it
        get_bank(model, used)

    one_changed = timed(edited, repeats)[0]
    enc = encode(rows)
    with torch.no_grad():
        call = timed(lambda: model.generate(**enc, adapter_names=rows, max_new_tokens=32, do_sample=False,
                                            invisible_lora=True, gate="never"), max(1, repeats // 3))[0]
    print(f"| {label} | {len(names)} | {adapter_bytes / 2**20:.0f} MiB | {1000 * build:.0f} ms | {1000 * every:.1f} ms | "
          f"{len(used)}: {1000 * unchanged:.1f} ms | {1000 * one_changed:.1f} ms | {call:.2f} s ({100 * unchanged / call:.1f}%) |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    print(f"CPU: {machine()}, torch threads {torch.get_num_threads()}\n")
    print("| model | adapters | adapter weights | first build | sync of every adapter | a call's sync (its rows' "
          "adapters), nothing changed | the same, one layer's weight edited via .data | a generate call (8 rows, "
          "32 new tokens, gate never; its sync's share) |")
    print("|---|---|---|---|---|---|---|---|")
    model, names, prompts_for = synthetic_zoo(0.3)

    def encode_synthetic(rows):
        ids = torch.tensor([prompts_for(name, 1, seed=i)[0] for i, name in enumerate(rows)])
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    measure("SmolLM2-135M shape, random", model, names, encode_synthetic, args.repeats)
    from hf_invisiblelora import zoo
    from hf_invisiblelora.zoo.demo import DEMO_ADAPTERS

    model, tok, names = zoo.load_zoo("smollm2", DEMO_ADAPTERS)
    tok.padding_side = "left"

    def encode_zoo(rows):
        texts = [zoo.adapter_prompts("smollm2", tok, n, 1, 32, seed=i)[0] for i, n in enumerate(rows)]
        return tok(texts, return_tensors="pt", padding=True)

    measure("SmolLM2-135M-Instruct + zoo", model, names, encode_zoo, args.repeats)
    print("\ncommand: python benchmarks/bench_sync.py " + " ".join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
