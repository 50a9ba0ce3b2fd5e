"""Batched multi-LoRA on the CPU: stock PEFT mixed batch vs the adapter bank + torch path.

SmolLM2-135M shape (random weights from a LlamaConfig), LoRA on all 7 linear modules, fp32.
For each rank, batch and number of distinct adapters (rows assigned round-robin) it measures
  - per-layer delta: one LoRA layer's forward minus its base layer's, for down_proj (1536 -> 576),
    which shares no shrink with a sibling, so every timed call pays a full shrink + expand;
  - a decode step: model(input_ids [batch, 1], logits_to_keep=1), for the base model (PEFT with
    adapters disabled), the bank with no LoRA (a draft pass), stock PEFT (adapter_names=...) and
    the bank + torch path, run interleaved so that the ratios share the machine's conditions.
Medians of repeats, wall clock and this process's CPU time. Prints a table, writes JSON.

    python benchmarks/bench_kernels.py --quick          # ~2 min: rank 16, batch 8 and 32
    python benchmarks/bench_kernels.py                  # full grid, ~15-20 min
"""

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model.context import PassContext

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine, timed
from tiny import LINEAR, SMOLLM2_135M, smollm2_shaped

MAX_LORA_GB = 6.0  # PEFT's copy + the bank's; configs above it are skipped (RAM is shared)
DRAFT = types.SimpleNamespace(key="")  # a pass context's drafter (drafters.Drafter.key): a LoRA-off pass


def build(rank, n_adapters):
    return smollm2_shaped({f"ad{i}": dict(r=rank, lora_alpha=2 * rank, target_modules=LINEAR) for i in range(n_adapters)})


def passes(bank, batch):
    """(context, one_pass): the pass context the bank is installed with, and ``one_pass(slots)``
    (the rows' bank slots: LoRA on; None: a LoRA-off pass), a context manager making its block
    one pass of ``batch`` rows of 1 token (the start slots only mark it as a pass: the model
    builds its own masks and positions here, with no SharedCache)."""
    context = PassContext(lambda: True)  # this script's thread owns the model
    start = torch.zeros(batch, dtype=torch.long)

    def one_pass(slots):
        bank.begin_pass()
        if slots is None:
            return context.running(start, 1, 1, drafter=DRAFT)
        return context.running(start, 1, 1, adapters=slots)
    return context, one_pass


def bench_config(pm, layer, n_adapters, batch, repeats):
    names = [f"ad{i % n_adapters}" for i in range(batch)]
    bank = get_bank(pm)
    context, one_pass = passes(bank, batch)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (batch, 1))
    x = torch.randn(batch, 1, SMOLLM2_135M["intermediate_size"])
    with torch.no_grad(), bank.installed(context), one_pass(bank.slots(names)):
        got = pm(ids, logits_to_keep=1).logits
    with torch.no_grad():
        ref = pm(ids, adapter_names=names, logits_to_keep=1).logits
    err = (got - ref).abs().max().item()
    assert err < 1e-3 * ref.abs().max().item(), f"bank logits differ from PEFT by {err}"

    def peft_layer():
        layer(x, adapter_names=names)

    def step(kind):
        if kind == "peft":
            return lambda: pm(ids, adapter_names=names, logits_to_keep=1)
        return lambda: pm(ids, logits_to_keep=1)

    res = {}
    with torch.no_grad():
        base_layer = timed(lambda: layer.base_layer(x), repeats, 200)
        res["layer_delta_peft_us"] = (timed(peft_layer, repeats, 200)[0] - base_layer[0]) * 1e6
        with bank.installed(context), one_pass(bank.slots(names)):  # every call one pass's layer (down_proj: no group)
            res["layer_delta_torch_us"] = (timed(lambda: layer(x), repeats, 200)[0] - base_layer[0]) * 1e6
        # Decode steps, interleaved: each repeat runs every variant once (the pass context untimed).
        samples = {k: [] for k in ("base", "bank_no_lora", "peft", "torch")}
        for _ in range(repeats):
            with pm.disable_adapter():
                samples["base"].append(timed(step("base"), 1))
            samples["peft"].append(timed(step("peft"), 1))
            with bank.installed(context):
                with one_pass(None):
                    samples["bank_no_lora"].append(timed(step("bank"), 1))
                with one_pass(bank.slots(names)):
                    samples["torch"].append(timed(step("bank"), 1))
    for k, v in samples.items():
        res[f"step_{k}_ms"] = statistics.median(s[0] for s in v) * 1e3
        res[f"step_{k}_cpu_ms"] = statistics.median(s[1] for s in v) * 1e3
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="rank 16, batch 8 and 32, adapters 1/4/16/64")
    p.add_argument("--repeats", type=int, default=None, help="decode steps per variant (default 7, quick 5)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kernels.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ranks, batches, adapters = ([16], [8, 32], [1, 4, 16, 64]) if args.quick else ([8, 16, 64], [1, 8, 32], [1, 4, 16, 64])
    repeats = args.repeats or (5 if args.quick else 7)

    rows = []
    header = (f"{'rank':>4} {'adapt':>5} {'batch':>5} | {'layer delta us':>16} | {'step ms: base':>13} {'no-LoRA':>8}"
              f" {'PEFT':>8} {'torch':>8} | {'torch/base':>10} {'PEFT/torch':>10}")
    print(f"threads={args.threads}, repeats={repeats}; layer delta: PEFT / torch path (down_proj 1536->576)")
    print(header)
    for rank in ranks:
        per_adapter_gb = rank * 10176 * 30 * 4 / 1e9  # 7 modules' (in + out) per layer, 30 layers, fp32
        fitting = [n for n in adapters if 2 * n * per_adapter_gb <= MAX_LORA_GB]
        for n in adapters:
            if n not in fitting:
                print(f"{rank:>4} {n:>5}     - | skipped: {2 * n * per_adapter_gb:.1f} GB of LoRA weights (> {MAX_LORA_GB})")
        if not fitting:
            continue
        pm = build(rank, max(fitting))
        layer = pm.base_model.model.model.layers[0].mlp.down_proj
        for n in fitting:
            for batch in batches:
                r = dict(rank=rank, adapters=n, batch=batch, **bench_config(pm, layer, n, batch, repeats))
                rows.append(r)
                print(f"{rank:>4} {n:>5} {batch:>5} | {r['layer_delta_peft_us']:7.0f} / {r['layer_delta_torch_us']:6.0f} |"
                      f" {r['step_base_ms']:13.1f} {r['step_bank_no_lora_ms']:8.1f} {r['step_peft_ms']:8.1f}"
                      f" {r['step_torch_ms']:8.1f} | {r['step_torch_ms'] / r['step_base_ms']:9.2f}x"
                      f" {r['step_peft_ms'] / r['step_torch_ms']:9.2f}x", flush=True)
        del pm
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = dict(torch=torch.__version__, threads=args.threads, repeats=repeats, machine=machine(),
                cpus=os.cpu_count(), load_avg=os.getloadavg(), time=time.strftime("%Y-%m-%d %H:%M:%S"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
