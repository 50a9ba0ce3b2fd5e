"""Decoding benchmark: when drafting pays, and by how much.

On the zoo (SmolLM2-135M-Instruct + its real LoRA adapters), prompts cut from each adapter's
held-out domain. Sections:
  1. throughput and per-token latency vs distinct adapters x batch size, for stock PEFT
     generate(adapter_names=), the optimized baseline (fast kernels, no drafting: gate="never"),
     InvisibleLoRA with fixed k (gate="always") and with the gate; greedy, plus sampling (T=0.7)
     at the largest adapter count. Configurations run interleaved (order rotated each repeat),
     medians of repeats, ratios to the baseline as medians of per-repeat ratios, one
     warm-up call each (which also lets the gate calibrate, as a server's first request would);
  2. acceptance per adapter (greedy and sampling, k = 4 fixed), median over adapters;
  3. the bound: (T_base + T_lora) / T_base per token, from timed plain steps LoRA off vs on;
  4. KV cache memory: the hybrid cache vs standard decoding's cache.
Prints tables, writes JSON and PNG plots.

    python benchmarks/bench_decoding.py                 # the default grid (~1 h on 2 CPU cores)
    python benchmarks/bench_decoding.py --quick         # a small grid (~10 min)
    python benchmarks/bench_decoding.py --smoke --out /tmp/x   # tiny random model, seconds (tests)
    python benchmarks/bench_decoding.py --configs stock_peft baseline baseline_compiled k2 k2_compiled \
        gate gate_compiled --batches 1 4 16 --adapter-counts 1 4 14 --no-extras --no-sampling
                                                        # eager vs compiled passes (compile=True)
    python benchmarks/bench_decoding.py --quantize int8 --configs stock_peft baseline gate --no-extras --no-sampling
                                                        # against stock on the same torchao int8 base
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BatchEncoding

import hf_invisiblelora  # noqa: F401  (generate(invisible_lora=True))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import busy, machine, sync
from tiny import synthetic_zoo

# The eager configurations pass compile=False: "auto" would capture CUDA graphs on CUDA.
CONFIGS = {
    "stock_peft": {},
    # Fixed choices run the full base model as the drafter (draft_dtype=None, no prompt lookup): what k does alone.
    "baseline": dict(invisible_lora=True, gate="never", compile=False, draft_dtype=None, prompt_lookup=False),
    "k1": dict(invisible_lora=True, gate="always", num_draft_tokens=1, compile=False, draft_dtype=None,
               prompt_lookup=False),
    "k2": dict(invisible_lora=True, gate="always", num_draft_tokens=2, compile=False, draft_dtype=None,
               prompt_lookup=False),
    "k4": dict(invisible_lora=True, gate="always", num_draft_tokens=4, compile=False, draft_dtype=None,
               prompt_lookup=False),
    # The defaults (draft_dtype="auto": the gate also picks among int8 / int4 draft copies on the CPU;
    # prompt_lookup=True: and prompt lookup).
    "gate": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False),
    # The defaults without prompt lookup (the default before it).
    "gate_no_lookup": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, prompt_lookup=False),
    # The gate with the full base model as its only drafter (the default before draft_dtype="auto").
    "gate_full": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_dtype=None,
                      prompt_lookup=False),
    # The baseline again, as a control: its ratio to the baseline is the run's noise (an A/A test).
    "control": dict(invisible_lora=True, gate="never", compile=False, draft_dtype=None, prompt_lookup=False),
    # The baseline with PyTorch's own linear kernels (no prepacked weights: hf_invisiblelora/model/prepack.py).
    "baseline_unpacked": dict(invisible_lora=True, gate="never", compile=False, prepack=False, draft_dtype=None,
                              prompt_lookup=False),
    # Cheaper drafters (hf_invisiblelora/decode/drafters.py): the head on a vocabulary from the zoo's training
    # text (--draft-vocab tokens), bfloat16 draft weights, both.
    "gate_vocab": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_vocab="corpus",
                       draft_dtype=None, prompt_lookup=False),
    "gate_bf16": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_dtype=torch.bfloat16,
                      prompt_lookup=False),
    "gate_vocab_bf16": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_vocab="corpus",
                            draft_dtype=torch.bfloat16, prompt_lookup=False),
    # Weight-only int8 / int4 draft layers (PyTorch's CPU kernels), with the corpus vocabulary's head;
    # at fixed k = 2 too, where the gate would not draft.
    "k2_int8": dict(invisible_lora=True, gate="always", num_draft_tokens=2, compile=False, draft_vocab="corpus",
                    draft_dtype=torch.int8, prompt_lookup=False),
    "k2_int4": dict(invisible_lora=True, gate="always", num_draft_tokens=2, compile=False, draft_vocab="corpus",
                    draft_dtype=torch.int4, prompt_lookup=False),
    "gate_int8": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_vocab="corpus",
                      draft_dtype=torch.int8, prompt_lookup=False),
    "gate_int4": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_vocab="corpus",
                      draft_dtype=torch.int4, prompt_lookup=False),
    # The int4 drafter alone (full head) at a fixed k: what the cheapest draft pass gives where the gate
    # would not draft.
    "int4_k1": dict(invisible_lora=True, gate="always", num_draft_tokens=1, compile=False, draft_dtype=torch.int4,
                    prompt_lookup=False),
    "int4_k2": dict(invisible_lora=True, gate="always", num_draft_tokens=2, compile=False, draft_dtype=torch.int4,
                    prompt_lookup=False),
    # The gate choosing the drafter per cycle among the corpus-vocabulary head in float32, int8 and int4.
    "gate_choice": dict(invisible_lora=True, gate="auto", num_draft_tokens=4, compile=False, draft_vocab="corpus",
                        draft_dtype=(None, torch.int8, torch.int4), prompt_lookup=False),
    # The bare base model, stock generate() with the adapters disabled: the speed a LoRA-serving
    # path is measured against (its tokens are the base model's, not the adapters').
    "base_model": dict(base_model=True),
}
# The same with compiled fixed-shape passes (torch.compile on the CPU, CUDA graphs on CUDA). The
# first call of each compiles; it is the warm-up, reported separately as first_call_s.
COMPILED = {f"{c}_compiled": dict(CONFIGS[c], compile=True) for c in ("baseline", "k1", "k2", "k4", "gate")}
CONFIGS.update(COMPILED)
SAMPLED = ("stock_peft", "baseline", "k2", "gate", "control")  # the configurations of the sampling row


def load(kind: str, device: str, dtype: torch.dtype, strength: float, zoo_name: str = "smollm2",
         quantize: str | None = None, adapters: list | None = None, prompt_tokens: int = 32):
    """(peft_model on device/dtype, encode(prompts) -> inputs on device, adapter names, prompts_for(name, count, seed));
    ``quantize``: the zoo's base quantized on loading (zoo.QUANTIZATIONS); ``adapters``: the zoo's
    adapters to load, in the order the workloads take them (default: all built); ``prompt_tokens``:
    the length of the held-out prompts."""
    tok = None
    if kind == "synthetic":  # prompts are token ids, all of one length
        model, names, prompts_for = synthetic_zoo(strength)
    elif kind == "smoke":
        from tiny import tiny_peft, tiny_tokenizer

        tok, model = tiny_tokenizer(), tiny_peft("llama", strength=0.5, dtype=torch.float32)
        texts = ["the quick brown fox", "once upon a time", "hello world", "over the lazy dog"]
        names = ["s", "b", "c", "d"]

        def prompts_for(name, n, seed):
            return [texts[(seed + i) % 4] for i in range(n)]
    else:
        from hf_invisiblelora import zoo

        model, tok, names = zoo.load_zoo(zoo_name, adapters, dtype=dtype, quantize=quantize)

        def prompts_for(name, n, seed):
            return zoo.adapter_prompts(zoo_name, tok, name, n, prompt_tokens, seed=seed)

    def encode(prompts):
        if tok is None:
            ids = torch.tensor(prompts)
            enc = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        else:
            tok.padding_side = "left"
            enc = tok(prompts, return_tensors="pt", padding=True)
        return enc.to(device)

    # (A quantized model is not cast: its weights keep their quantized type.)
    return model.to(device=device, **({} if quantize else dict(dtype=dtype))), encode, names, prompts_for, tok


def workload(encode, names, prompts_for, n_adapters, batch):
    rows = [names[i % n_adapters] for i in range(batch)]
    return rows, encode([prompts_for(name, 1, seed=i)[0] for i, name in enumerate(rows)])


def generated_tokens(sequences, prompt_len, eos):
    """Tokens each row generated, up to and including its first EOS."""
    new = sequences[:, prompt_len:]
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, new.shape[1])
    return first.tolist()


def measure(model, rows, enc, configs, new_tokens, repeats, sampling, checkpoint=lambda res: None):
    """Tokens/s of each configuration (greedy or sampling), interleaved over repeats. A configuration
    that raises is recorded with its error and left out of later repeats; ``checkpoint(res)`` gets the
    results so far after every repeat (a run cut short keeps what it measured)."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    kw = dict(adapter_names=rows, max_new_tokens=new_tokens, return_dict_in_generate=True)
    kw.update(dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0) if sampling else dict(do_sample=False))
    rates = {c: [] for c in configs}  # generated tokens/s of each counted call
    last, first, errors = {}, {}, {}
    res = {}
    for rep in range(repeats + 1):  # rep 0: warm-up, not counted
        for c in configs[rep % len(configs):] + configs[: rep % len(configs)]:  # rotated: no config always follows the same one
            if c in errors:
                continue
            torch.manual_seed(rep)
            options = dict(CONFIGS[c])
            bare = options.pop("base_model", False)
            call = dict(kw, adapter_names=None) if bare else kw
            t = time.perf_counter()
            try:
                with torch.no_grad(), model.disable_adapter() if bare else contextlib.nullcontext():
                    out = model.generate(**enc, **call, **options)
                sync()
            except Exception as e:  # noqa: BLE001 - recorded; the other configurations go on
                errors[c] = f"{type(e).__name__}: {e}"[:500]
                continue
            seconds = time.perf_counter() - t
            if rep:
                rates[c].append(sum(generated_tokens(out.sequences, enc.input_ids.shape[1], eos)) / seconds)
            else:
                first[c] = seconds
            last[c] = out
        res = summarize(configs, rates, first, last, errors, enc.input_ids.shape[1], eos)
        checkpoint(res)
    if not sampling and "stock_peft" in last:  # greedy: the same tokens as stock, or divergences at near ties
        check_tokens(model, rows, enc, new_tokens, last, res)
        checkpoint(res)
    return res


def gate_costs(model, rows: int, adapters: int) -> dict:
    """The eager pass costs the gate measured for ``rows`` rows (gate.py: the fastest of the last 8
    timings of a whole cycle's part), ms: "draft<drafter key>" per draft token, "verify q" for a
    verify pass of q tokens a row over ``adapters`` distinct adapters (accept and commit included)."""
    from hf_invisiblelora.model.state import state_of

    memory = state_of(model).gate
    out = {}
    for key, seconds in sorted((memory.costs if memory else {}).items(), key=str):
        if key[0] == "draft" and key[1][0] == rows and key[1][1].startswith("eager"):
            out["draft" + key[1][1][len("eager"):]] = 1000 * seconds
        elif key[0] == "verify" and key[1][:3] == (rows, adapters, "eager"):
            out[f"verify {key[2]}"] = 1000 * seconds
    return out


def summarize(configs, rates, first, last, errors, prompt_len, eos):
    res = {c: dict(error=errors[c]) for c in configs if c in errors}
    base = rates.get("baseline") or []
    for c in configs:
        if c in errors or not rates[c]:
            continue
        tokens = generated_tokens(last[c].sequences, prompt_len, eos)
        rate = statistics.median(rates[c])
        stats = getattr(last[c], "stats", None)
        res[c] = dict(
            tokens_per_s=rate, seconds=sum(tokens) / rate, first_call_s=first[c], tokens=sum(tokens), rates=rates[c],
            # Speed relative to the baseline: the median over repeats of the ratio within each repeat
            # (calls seconds apart), which a drift of the machine's speed over the run does not skew.
            ratio=statistics.median(r / b for r, b in zip(rates[c], base)) if base else None,
            ms_per_token=1000 * sum(tokens) / rate / max(1, max(tokens)),  # a row's latency per generated token
            acceptance=stats.acceptance_rate if stats else None,
            k_per_cycle=stats.k_per_cycle if stats else None,
            cache_bytes=stats.cache_bytes if stats else None,
        )
    return res


def check_tokens(model, rows, enc, new_tokens, last, res):
    """Per configuration: rows identical to stock, and whether every divergence is at a near tie of
    stock's logits (tools/tiny.py: divergences). In float32 / float64 the tokens are expected to be
    identical; in bfloat16 / float16 identity is informational (numerics differ) and the near-tie
    check is the criterion."""
    from tiny import all_near_ties, divergences

    dtype = model.dtype
    with torch.no_grad():
        ref = model.generate(**enc, adapter_names=rows, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    for c, out in last.items():
        if c in ("stock_peft", "base_model") or "error" in res.get(c, {"error": 1}):
            continue
        if dtype in (torch.bfloat16, torch.float16):
            diverged = divergences(model, rows, ref, out.sequences, enc.attention_mask, enc.input_ids.shape[1])
            res[c]["near_ties"] = all_near_ties(diverged)
            res[c]["divergences"] = [[s, round(g, 2), round(n, 2)] for s, g, n in diverged.values()]
        res[c]["identical_rows"] = int((out.sequences == ref.sequences).all(1).sum())
        res[c]["identical_to_stock"] = bool(torch.equal(out.sequences, ref.sequences))


def acceptance(model, encode, names, prompts_for, per_adapter, new_tokens, drafters):
    """Acceptance per adapter (k = 4 in every cycle), greedy and sampling, for each drafter
    {label: generate() options} (the full drafter and the cheaper ones)."""
    rows = [n for n in names for _ in range(per_adapter)]
    enc = encode([p for n in names for p in prompts_for(n, per_adapter, 100)])
    out = {}
    for label, options in drafters.items():
        for mode, kw in (("greedy", dict(do_sample=False)), ("sampling", dict(do_sample=True, temperature=0.7))):
            torch.manual_seed(0)
            with torch.no_grad():
                o = model.generate(**enc, adapter_names=rows, max_new_tokens=new_tokens, invisible_lora=True,
                                   gate="always", num_draft_tokens=4, return_dict_in_generate=True, **kw, **options)
            per = {n: dict(acceptance=v["acceptance"], tokens_per_cycle=v["tokens_per_cycle"])
                   for n, v in o.stats.per_adapter.items()}
            key = mode if label == "full" else f"{mode}, {label}"
            out[key] = dict(per_adapter=per, median=statistics.median(v["acceptance"] for v in per.values()))
    return out


def bound(model, encode, names, prompts_for, batch, repeats):
    """(T_base + T_lora) / T_base: one LoRA-on plain step over one LoRA-off step, bank kernels."""
    from hf_invisiblelora.decode.drafters import BaseModelDrafter
    from hf_invisiblelora.lora.bank import get_bank
    from hf_invisiblelora.model.context import PassContext
    from hf_invisiblelora.model.state import state_of

    rows, enc = workload(encode, names, prompts_for, len(names), batch)
    bank = get_bank(model)
    slots = bank.slots(rows)
    ids = enc.input_ids[:, -1:]
    context = PassContext(lambda: True)  # this script's thread owns the model
    at = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)  # marks a pass (no SharedCache here)
    draft = BaseModelDrafter(model, state_of(model))  # a LoRA-off pass: the base model's
    t = {"off": [], "on": []}
    with torch.no_grad(), bank.installed(context):
        for rep in range(repeats + 1):
            for mode in ("off", "on"):
                bank.begin_pass()
                with context.running(at, 1, 1, **(dict(adapters=slots) if mode == "on" else dict(drafter=draft))):
                    sync()
                    start = time.perf_counter()
                    model(input_ids=ids, logits_to_keep=1)
                    sync()
                if rep:
                    t[mode].append(time.perf_counter() - start)
    off, on = statistics.median(t["off"]), statistics.median(t["on"])
    return dict(batch=batch, adapters=len(names), base_step_ms=1000 * off, lora_step_ms=1000 * on, bound=on / off)


def stock_cache_bytes(model, enc, rows, new_tokens):
    with torch.no_grad():
        out = model.generate(**enc, adapter_names=rows, max_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True)
    cache = out.past_key_values
    return sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in results["throughput"] if not r["sampling"]]
    batches = sorted({r["batch"] for r in grid})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        pts = sorted((r for r in grid if r["batch"] == b), key=lambda r: r["adapters"])
        for c in CONFIGS:
            xy = [(r["adapters"], r["configs"][c]["ratio"]) for r in pts if r["configs"].get(c, {}).get("ratio")]
            if xy:
                ax.plot(*zip(*xy), marker="o", label=c)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("distinct adapters")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0][0].set_ylabel("throughput / optimized baseline")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cell(r) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    return f"{r['tokens_per_s']:.1f}" + (f" ({r['ratio']:.2f}x)" if r["ratio"] is not None else "")


def table(results) -> str:
    names = [c for c in CONFIGS if any(c in r["configs"] for r in results["throughput"])]
    lines = ["| mode | batch | adapters | " + " | ".join(names) + " | gate's k |", "|---" * (len(names) + 4) + "|"]
    for r in results["throughput"]:
        cfg = r["configs"]
        cells = [cell(cfg.get(c)) for c in names]
        ks = cfg.get("gate", {}).get("k_per_cycle") or []
        lines.append(f"| {'sample' if r['sampling'] else 'greedy'} | {r['batch']} | {r['adapters']} | "
                     + " | ".join(cells) + f" | {sum(ks) / max(1, len(ks)):.1f} |")
    return "\n".join(lines)


def main(argv=None):
    from hf_invisiblelora.zoo import QUANTIZATIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPUs while it runs")
    p.add_argument("--smoke", action="store_true", help="tiny random model, tiny grid (for tests)")
    p.add_argument("--out", default="benchmarks/results", help="folder for decoding.json and plots")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="a subset (baseline is always run)")
    p.add_argument("--no-extras", action="store_true", help="throughput grid only (no acceptance, bound, memory)")
    p.add_argument("--batches", nargs="+", type=int, help="override the grid's batch sizes")
    p.add_argument("--adapter-counts", nargs="+", type=int, help="override the grid's distinct-adapter counts")
    p.add_argument("--no-sampling", action="store_true", help="greedy only")
    p.add_argument("--device", default="cpu", help="e.g. cuda (the Triton kernels; compiled = CUDA graphs)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--synthetic", action="store_true",
                   help="SmolLM2-135M's shape with random weights and 16 random adapters instead of the zoo (no files needed)")
    p.add_argument("--stock-batches", nargs="+", type=int,
                   help="run stock_peft only at these batch sizes (its per-adapter loop is slow on a GPU)")
    p.add_argument("--adapters", nargs="+", help="the zoo's adapters, in the order the workloads take them "
                   "(another adapter set; default: all built)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="length of the zoo's held-out prompts")
    p.add_argument("--zoo", default="smollm2", choices=["smollm2", "gemma3"], help="the zoo's base model")
    p.add_argument("--quantize", choices=sorted(QUANTIZATIONS),
                   help="the zoo's base quantized by torchao on loading (weight-only; extra quant): every configuration "
                        "runs on the same quantized model")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="gate_vocab*: the draft vocabulary's size (most frequent tokens of the zoo's training text)")
    p.add_argument("--strength", type=float, default=0.3,
                   help="--synthetic: scale of the adapters' random B weights (0.3: ~88%% greedy acceptance, fp32 CPU)")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_invisiblelora").setLevel(logging.INFO)  # compile times of compiled passes
    if args.smoke:
        batches, adapter_counts, args.repeats, args.new_tokens = [1, 4], [1, 4], 1, 6
    elif args.quick:
        batches, adapter_counts = [1, 4, 16], [1, 4, 12]
    else:
        batches, adapter_counts = [1, 4, 16, 32], [1, 2, 4, 8, 12]
    batches, adapter_counts = args.batches or batches, args.adapter_counts or adapter_counts
    kind = "smoke" if args.smoke else "synthetic" if args.synthetic else "zoo"
    if args.quantize and kind != "zoo":
        p.error("--quantize applies to the zoo's base model")
    model, encode, names, prompts_for, tok = load(kind, args.device, getattr(torch, args.dtype), args.strength, args.zoo,
                                                  args.quantize, args.adapters, args.prompt_tokens)
    if not args.no_extras or any(CONFIGS[c].get("draft_vocab") == "corpus" for c in args.configs or CONFIGS):
        if kind == "zoo":
            from hf_invisiblelora import zoo

            vocab = zoo.corpus_vocabulary(args.zoo, tok, args.draft_vocab)
        else:  # no corpus: the lowest ids
            vocab = list(range(min(args.draft_vocab, model.get_base_model().config.get_text_config().vocab_size)))
        for c in CONFIGS.values():
            if c.get("draft_vocab") == "corpus":
                c["draft_vocab"] = vocab
    adapter_counts = [a for a in adapter_counts if a <= len(names)] or [len(names)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(command="python " + " ".join(sys.argv), machine=machine(), threads=torch.get_num_threads(),
                   device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", dtype=args.dtype,
                   model=args.zoo if kind == "zoo" else kind, quantize=args.quantize, draft_vocab=args.draft_vocab,
                   torch=torch.__version__, adapters=names, new_tokens=args.new_tokens, repeats=args.repeats,
                   busy=args.busy, throughput=[])
    with busy(args.busy):  # --busy: another user's work on the machine meanwhile
        for b in batches:
            for a in adapter_counts:
                if a > b:
                    continue
                rows, enc = workload(encode, names, prompts_for, a, b)
                for sampling in (False, True) if a == max(adapter_counts) and not args.no_sampling else (False,):
                    configs = [c for c in CONFIGS if c in args.configs or c == "baseline"] if args.configs else \
                        [c for c in CONFIGS if c not in COMPILED]
                    if sampling:
                        configs = [c for c in configs if c in SAMPLED]
                    if args.stock_batches and b not in args.stock_batches:
                        configs = [c for c in configs if c != "stock_peft"]
                    point = dict(batch=b, adapters=a, sampling=sampling, configs={})
                    results["throughput"].append(point)

                    def checkpoint(res, point=point):
                        point["configs"] = res
                        (out / "decoding.json").write_text(json.dumps(results, indent=1))

                    measure(model, rows, enc, configs, args.new_tokens, args.repeats, sampling, checkpoint)
                    point["gate_costs_ms"] = gate_costs(model, b, a)
                    checkpoint(point["configs"])
                    print(f"{'sampling' if sampling else 'greedy'}, batch {b}, {a} adapters: "
                          + ", ".join(f"{c} {cell(v)}" for c, v in point["configs"].items()), flush=True)
                    if point["gate_costs_ms"]:
                        print("  the gate's pass costs (ms; the fastest of the last 8): " + ", ".join(
                            f"{k} {v:.1f}" for k, v in point["gate_costs_ms"].items()), flush=True)
    if not args.no_extras:
        drafters = {"full": {}, "vocab": dict(draft_vocab=CONFIGS["gate_vocab"]["draft_vocab"]),
                    "bf16": dict(draft_dtype=torch.bfloat16), "int8": dict(draft_dtype=torch.int8),
                    "int4": dict(draft_dtype=torch.int4)}
        results["acceptance"] = acceptance(model, encode, names, prompts_for, 2 if args.smoke else 4, args.new_tokens,
                                           drafters)
        results["bound"] = [bound(model, encode, names, prompts_for, b, args.repeats) for b in batches]
        rows, enc = workload(encode, names, prompts_for, len(names), max(batches))
        results["memory"] = dict(
            batch=max(batches), stock_cache_bytes=stock_cache_bytes(model, enc, rows, args.new_tokens),
            hybrid_cache_bytes={c: v["cache_bytes"] for c, v in results["throughput"][-1]["configs"].items()
                                if v.get("cache_bytes")})
    (out / "decoding.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "decoding_throughput.png")
    print("\n" + table(results))
    for mode, acc in results.get("acceptance", {}).items():
        print(f"\nacceptance ({mode}, k=4): median {acc['median']:.1%}; "
              + ", ".join(f"{n} {v['acceptance']:.0%}" for n, v in acc["per_adapter"].items()))
    firsts = [(r["batch"], c, v["first_call_s"] - v["seconds"]) for r in results["throughput"]
              for c, v in r["configs"].items() if c in COMPILED and "error" not in v]
    errors = [(r["batch"], r["adapters"], c, v["error"]) for r in results["throughput"]
              for c, v in r["configs"].items() if "error" in v]
    for b, a, c, e in errors:
        print(f"error: batch {b}, {a} adapters, {c}: {e}")
    if firsts:
        print("\nfirst call of a compiled configuration (compiling its passes) minus a steady call: "
              + ", ".join(f"b{b} {c} {s:.0f} s" for b, c, s in firsts))
    for bd in results.get("bound", []):
        print(f"bound at batch {bd['batch']}: base step {bd['base_step_ms']:.1f} ms, LoRA-on step "
              f"{bd['lora_step_ms']:.1f} ms -> drafting can give at most {bd['bound']:.2f}x")
    if "memory" in results:
        m = results["memory"]
        print(f"KV cache at batch {m['batch']}: standard {m['stock_cache_bytes'] / 2**20:.1f} MiB; hybrid "
              + ", ".join(f"{c} {v / 2**20:.1f} MiB" for c, v in m["hybrid_cache_bytes"].items()))
    print(f"\nwrote {out / 'decoding.json'} and {out / 'decoding_throughput.png'}")
    return results


if __name__ == "__main__":
    main()
