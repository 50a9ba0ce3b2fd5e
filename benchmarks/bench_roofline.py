"""The roofline of one decode step: bytes read, time, and where the time goes outside the matmuls.

For each pass of a cycle (the bare base step; our draft pass with each drafter; our LoRA-on step;
our verify pass of --verify tokens per row) at each batch size, on a real model with its zoo
adapters (rows round-robin over min(batch, --adapters) adapters) against a 64-token cache:

- **MB read**: the weights the pass reads (every linear layer and the head in the pass's format;
  the active adapters' A and B for LoRA-on passes) plus the KV cache it attends over;
- **ms**: wall time of one pass, median of --repeats, passes interleaved (bench_step.py's Setup);
- **matmuls / attention / rest**: from one torch.profiler run of the same pass, the self time of
  the weight matmul ops (mm, addmm, bmm and the weight-only int8 / int4 kernels) and of the attention
  kernel, scaled to the unprofiled time; **rest** is everything else (norms, rotary, activations,
  the cache's writes, the bank's routing, dispatch and Python);
- **bound**: MB read / the machine's read bandwidth (a large fp32 tensor's sum, measured in the run),
  and **x bound**, the pass's time over it.

Our float32 passes are also timed on prepacked linear layers (hf_invisiblelora/model/prepack.py, the
default where it applies; "prepacked" rows, interleaved with the others: the before and after of
one run); --no-prepack leaves them out.

    python -P benchmarks/bench_roofline.py --batches 1 4 8 16 --repeats 7
    python -P benchmarks/bench_roofline.py --smoke --out /tmp/roofline.json   # tiny random model, seconds (tests)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_step.py, common.py, under python -P too
from bench_step import CONTEXT, Setup, adapter_bytes

from common import interleaved, machine
from hf_invisiblelora import zoo
from hf_invisiblelora.model.state import state_of

MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm",
           "aten::_weight_int4pack_mm_for_cpu", "aten::mkldnn_linear", "mkldnn::_linear_pointwise"}
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 2 / 576, "int4": 0.5 + 4 / 32}  # + their scales


def bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second the CPU reads from memory: a large fp32 tensor's sum (out of cache)."""
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()
    best = min(_time(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def split(fn, calls: int) -> dict:
    """Seconds per call in weight matmuls, attention and the rest, from one profiled run."""
    with torch.no_grad():
        fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
    total = mm = attention = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        if e.key in MATMULS:
            mm += e.self_cpu_time_total
        elif "scaled_dot_product" in e.key or "flash_attention" in e.key:
            attention += e.self_cpu_time_total
    return dict(matmuls=mm / total, attention=attention / total)  # shares of the profiled time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=list(zoo.ZOOS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--verify", type=int, default=3, help="tokens per row of the verify pass")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--no-prepack", action="store_true",
                   help="leave out the passes on prepacked weights (prepack.py; each fp32 pass is also timed on them)")
    p.add_argument("--out", default="benchmarks/results/roofline.json")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random model (tools/tiny.py), batch 2, one repeat, a small bandwidth probe (for tests)")
    args = p.parse_args(argv)
    if args.smoke:
        from tiny import tiny_peft

        args.batches, args.repeats, args.threads = [2], 1, 1
        model, names = tiny_peft(dtype=torch.float32), ["s", "b", "c", "d"]
        draft_vocab = list(range(32))
    else:
        model, tok, names = zoo.load_zoo(args.model)
        draft_vocab = zoo.corpus_vocabulary(args.model, tok, args.draft_vocab)
    torch.set_num_threads(args.threads)
    inner = model.get_base_model()
    config = inner.config.get_text_config()
    head = inner.get_output_embeddings()
    head = head.get_base_layer() if hasattr(head, "get_base_layer") else head
    linears = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in inner.modules()
               if type(m) is nn.Linear or hasattr(m, "get_base_layer") and type(m.get_base_layer()) is nn.Linear]
    linear_w = sum(m.weight.numel() for m in set(linears) if m is not head)
    head_w = head.weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    bw = bandwidth(gib=0.125, repeats=2) if args.smoke else bandwidth()
    print(f"{'tiny (smoke)' if args.smoke else args.model}; CPU {machine()}, {torch.get_num_threads()} threads; "
          f"read bandwidth {bw / 1e9:.1f} GB/s; {CONTEXT}-token cache; ms per pass, medians of {args.repeats}")
    print("| batch | adapters | pass | MB read | ms | matmuls ms | attention ms | rest ms | bound ms | x bound |")
    print("|---" * 10 + "|")
    results = []
    for batch in args.batches:
        a = min(batch, args.adapters, len(names))
        with state_of(model).hold():
            s = Setup(model, names[:a], batch, config.vocab_size, draft_vocab,
                      draft_dtypes=(torch.bfloat16, torch.int8, torch.int4))
            lora_mb = sum(adapter_bytes(model, n) for n in set(s.rows))
            kv = kv_per_token * batch * (CONTEXT + 1)
            ours = s.installed()
            steps = {"base step": (model.disable_adapter, s.stock(False)),
                     "draft, full": (ours, s.ours(False, 1))}
            fmt = {"base step": "fp32", "draft, full": "fp32"}
            for name, f in (("vocab", "fp32"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int4")):
                steps[f"draft, {name}"] = s.drafted(f"draft_{name}" if name != "vocab" else "draft_vocab")
                fmt[f"draft, {name}"] = f
            steps["LoRA-on step"] = (ours, s.ours(True, 1))
            steps[f"verify {args.verify}"] = (ours, s.ours(True, args.verify))
            if not args.no_prepack:  # the same passes on prepacked linear layers, interleaved with the others
                sp = Setup(model, names[:a], batch, config.vocab_size, draft_vocab, prepack=True)
                packed = sp.installed()
                steps["draft, full, prepacked"] = (packed, sp.ours(False, 1))
                steps["draft, vocab 8k head, prepacked"] = sp.drafted("draft_vocab")
                steps["LoRA-on step, prepacked"] = (packed, sp.ours(True, 1))
                steps[f"verify {args.verify}, prepacked"] = (packed, sp.ours(True, args.verify))
            t, _ = interleaved(steps, args.repeats)
            for name, (context, fn) in steps.items():
                with context():
                    shares = split(fn, max(3, args.repeats // 2))
                per = BYTES_PER_WEIGHT[fmt.get(name, "fp32")]
                head_read = head_w * (len(draft_vocab) / config.vocab_size if name.startswith("draft, vocab") else 1)
                read = (linear_w + head_read) * per + kv + (lora_mb if name.startswith(("LoRA", "verify")) else 0)
                ms, bound = 1000 * t[name], 1000 * read / bw
                r = dict(batch=batch, adapters=a, name=name, mb=read / 1e6, ms=ms, bound_ms=bound,
                         matmuls_ms=ms * shares["matmuls"], attention_ms=ms * shares["attention"])
                r["rest_ms"] = ms - r["matmuls_ms"] - r["attention_ms"]
                results.append(r)
                print(f"| {batch} | {a} | {name} | {r['mb']:.0f} | {ms:.1f} | {r['matmuls_ms']:.1f} | "
                      f"{r['attention_ms']:.1f} | {r['rest_ms']:.1f} | {bound:.1f} | {ms / bound:.1f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python benchmarks/bench_roofline.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                   cpu=machine(), threads=torch.get_num_threads(), bandwidth=bw,
                                   results=results), indent=1))


if __name__ == "__main__":
    main()
