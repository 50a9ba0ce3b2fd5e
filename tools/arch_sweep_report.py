"""The support table: the architecture sweep (tests/test_architectures.py) as a Markdown table.

For every causal LM in Transformers' auto mapping: a tiny random model with two LoRA adapters
decodes a mixed, left-padded batch with invisible_lora=True (K = 1 and 3) and is compared with stock
PEFT (tools/arch_sweep.py: sweep_verdict), once as derived from its default config and
once with dynamic NTK RoPE crossing its switch point. Writes docs/support.md (or --out).

    .venv/bin/python tools/arch_sweep_report.py [--only llama mistral] [--out docs/support.md]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # arch_sweep.py, machine.py, under python -P too
from arch_sweep import causal_lm_architectures, classify, dynamic_rope, sweep_verdict  # noqa: E402
from machine import machine  # noqa: E402

HEADER = """# What is supported

What InvisibleLoRA serves is served exactly (greedy: stock's tokens; sampling: stock's
distribution). What it cannot serve exactly is refused with a ValueError naming the reason before
anything changes (the server: at start, or a 400 `adapter_unsupported` from `/v1/load_lora_adapter`);
such models and adapters run with plain `generate()`.

## Adapters and base layers

| adapter / base layer | | checked by (against) / why refused |
|---|---|---|
| plain LoRA on Linear layers (`lm_head` too), rank, alpha and rsLoRA per adapter, mixed batches with `__base__` rows | served | `tests/test_greedy.py`, `tests/test_configurations.py` (stock PEFT `generate(adapter_names=...)`, float64; `lm_head`: `test_lora_on_lm_head`); the server: `tests/test_serve.py` (standalone `generate()`) |
| DoRA (`use_dora=True`) on Linear layers | served | `tests/test_dora_embedding.py` (each row alone under `set_adapter`, float64: PEFT's mixed batch refuses DoRA); server: `tests/test_serve_adapters.py`; real SmolLM2: `tests/test_smollm2.py` |
| DoRA on a Linear layer whose weight was quantized after the adapter was added (`torchao.quantize_` on the PEFT model: PEFT keeps its plain `Linear` wrapper and dequantizes the weight for DoRA's norm) | served | `tests/test_derived.py` (`test_quantized_after_a_warm_call`: each row alone under `set_adapter`, first-step logits within 2e-5 in float32, and the tokens) |
| DoRA on other layers (embedding, convolution, and PEFT's quantized LoRA layers: a base quantized before the adapter was added) | refused | the bank computes DoRA's column scale for PEFT's plain `Linear` wrapper only (`tests/test_errors.py`, `tests/test_bank.py`) |
| embedding LoRA (`embed_tokens` in `target_modules`) | served | `tests/test_dora_embedding.py` (stock PEFT's mixed batch); server: `tests/test_serve_adapters.py`; real SmolLM2: `tests/test_smollm2.py` |
| `modules_to_save` (a whole `lm_head`, norm or `embed_tokens`, tested; a classifier head alike) | served, eager passes only | `tests/test_modules_to_save.py` (each row alone under `set_adapter`, and stock's mixed batch where PEFT runs one); server: `tests/test_serve_adapters.py`; real SmolLM2 (its final norm): `tests/test_smollm2.py`. `compile=True` refused: each pass picks every row's copy on the host |
| `trainable_token_indices` | refused | single trained token embeddings are not routed per row; train the whole module (`modules_to_save`) instead (`tests/test_modules_to_save.py`) |
| other LoRA variants (aLoRA, ...), `lora_bias=True`, PEFT methods other than LoRA | refused | not implemented by the bank (aLoRA: `tests/test_errors.py`; `lora_bias`: `tests/test_bank.py`, `tests/test_serve_security.py`; other methods: `checks.check_model`) |
| LoRA on convolution layers | refused | LoRA is served on Linear and Embedding layers only (`checks.check_layer`) |
| merged adapters | refused | the base model drafts, so its weights must be unmerged: call `model.unmerge_adapter()` (`tests/test_errors.py`) |
| adapters in another dtype than the model | served | float32 adapters on a bfloat16 model (PEFT's default) in the bank (`tests/test_dora_embedding.py`, `tests/test_compiled.py` on CUDA); other mixes by PEFT's own layers, as PEFT computes them (`tests/test_routes.py`); `compile=True` refuses those |
| torchao weight-only: `Int8WeightOnlyConfig`, `IntxWeightOnlyConfig` (e.g. int4 in groups of 32) | served | `tests/test_quantized.py` (stock PEFT on the same quantized model, CPU); int8 and int4 SmolLM2 (`TorchAoConfig` on loading): `tests/test_smollm2.py` |
| torchao activation quantization (`Int8DynamicActivationInt8WeightConfig`, ...), other torchao tensors (`Float8Tensor`, ...) | refused | scales computed over a pass make a row's output depend on the other rows (`tests/test_quantized.py`) |
| bitsandbytes 4-bit (nf4, fp4) and 8-bit with `llm_int8_threshold=0.0` | served | `tests/test_quantized.py` (stock PEFT on the same quantized model) |
| bitsandbytes 8-bit with `llm_int8_threshold` > 0 (LLM.int8(), transformers' default 6.0) | refused | outlier columns are chosen over the whole pass, so rows depend on each other (`tests/test_quantized.py`) |
| GPTQ, AWQ, HQQ and other quantizers' LoRA layers; quantized LoRA weights | refused | layer types the bank does not compute (`checks.check_layer`; quantized LoRA weights: `tests/test_quantized.py`) |
| continuing from a `DynamicCache` an earlier call returned (a chat's next turn) | served | `tests/test_continue_cache.py` (stock continuing the same cache; the cache extended as stock extends it); a chat's second turn on SmolLM2: `tests/test_smollm2.py` |
| caches it cannot continue exactly: `StaticCache`, `QuantizedCache`, offloaded, another model's, sliding-window or chunked layers, length-dependent RoPE, other rows or dtype, input_ids that are not the whole sequence | refused | `tests/test_continue_cache.py` |

## Architectures

Every causal LM in Transformers' auto mapping (transformers {version}), as a tiny random model derived
from its default config (`tools/arch_sweep.py`) with two PEFT LoRA adapters ("s":
all linear layers PEFT can run in a mixed batch, r=4; "b": r=2 on the attention projections). A
batch of three left-padded prompts with adapters `["s", "__base__", "b"]` decodes 12 tokens greedily
with `invisible_lora=True` at K = 1 and K = 3, in float64; sliding windows are 4 tokens, attention
chunks 8. Verdicts:

- **identical**: the same tokens as stock PEFT `generate(adapter_names=...)` at both K;
- **refused**: a ValueError before decoding, naming the reason (the model is left unchanged);
- **skipped**: no comparison possible (the reason says why: no stock generate, a missing optional
  dependency, ...).

The last column repeats the sweep with dynamic NTK RoPE (`rope_type="dynamic"`, switch point 8
positions, crossed by the output) where the architecture's rotary embedding takes it.
`tests/test_architectures.py` runs the same sweep in CI. Generated by
`.venv/bin/python tools/arch_sweep_report.py` ({seconds:.0f} s on one thread of an
{machine}).

Counts: {counts}; with dynamic RoPE: {dynamic_counts}.

| architecture | class | verdict | reason / notes | dynamic RoPE |
|---|---|---|---|---|
"""


def outcome(arch, edit=None):
    try:
        return sweep_verdict(arch, edit)
    except AssertionError as e:  # a difference from stock: the test fails on it
        return "DIFFERENT", str(e).splitlines()[0][:200]
    except Exception as e:  # noqa: BLE001 - an error the test would report
        return "ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", help="model types (default: all)")
    parser.add_argument("--out", default="docs/support.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows, counts, dynamic_counts = [], collections.Counter(), collections.Counter()
    for arch in args.only or causal_lm_architectures():
        verdict, reason = outcome(arch)
        dynamic, dynamic_reason = outcome(arch, dynamic_rope)
        counts[verdict] += 1
        dynamic_counts[dynamic] += 1
        dyn = dynamic if dynamic != "skipped" or verdict == "skipped" else "n/a"
        if dynamic in ("refused", "DIFFERENT", "ERROR") and dynamic_reason != reason:
            dyn += f": {dynamic_reason}"
        rows.append(f"| {arch} | {classify(arch)} | {verdict} | {cell(reason)} | {cell(dyn)} |")
        print(rows[-1], flush=True)
    fmt = lambda c: ", ".join(f"{v} {k}" for k, v in sorted(c.items()))  # noqa: E731
    text = HEADER.format(version=transformers.__version__, seconds=time.perf_counter() - start, machine=machine(),
                         counts=fmt(counts), dynamic_counts=fmt(dynamic_counts)) + "\n".join(rows) + "\n"
    Path(args.out).write_text(text)
    print(f"wrote {args.out}; command: .venv/bin/python tools/arch_sweep_report.py "
          + " ".join(sys.argv[1:] if argv is None else argv))
    return 0 if not (counts["DIFFERENT"] + counts["ERROR"] + dynamic_counts["DIFFERENT"] + dynamic_counts["ERROR"]) else 1


if __name__ == "__main__":
    sys.exit(main())
