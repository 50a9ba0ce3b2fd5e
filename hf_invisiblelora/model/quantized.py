"""LoRA on quantized base layers: which ones InvisibleLoRA serves, and what the rest of it needs
to know about them.

Served (checked against stock PEFT on the same quantized model, on the CPU: tests/test_quantized.py):

- torchao weight-only quantization (``torchao.quantize_`` or transformers' ``TorchAoConfig``):
  ``Int8WeightOnlyConfig`` (weights become ``Int8Tensor``) and ``IntxWeightOnlyConfig``, e.g. int4
  in groups of 32 (``IntxUnpackedToInt8Tensor``; torchao's ``Int4WeightOnlyConfig`` formats do not
  run on the CPU). PEFT wraps these layers as ``TorchaoLoraLinear``, whose forward is its ``Linear``'s.
- bitsandbytes (``BitsAndBytesConfig``): 4-bit (nf4, fp4) and 8-bit with ``llm_int8_threshold=0``.
  PEFT's bitsandbytes LoRA layers round each LoRA term to the output's dtype before adding it,
  with or without ``adapter_names`` (``rounds_delta``).

The base output is the quantized layer's own forward (the bank calls it, as PEFT does), and the
quantized base model is the drafter as it is: prepacked copies (prepack.py) and draft_dtype copies
(drafters.py) are made of plain float weights only; a restricted draft head (draft_vocab) reads
the rows of torchao's dequantized weights.
Refused, on any layer (``check_weights``; LoRA layer types: ``check_layer``): activation
quantization and LLM.int8()'s outlier threshold (scales or outlier columns computed over the pass:
a row's output can depend on the other rows), other quantized tensor types, other quantizers'
LoRA layers (GPTQ, AWQ, HQQ, ...), quantized LoRA weights.
"""

from __future__ import annotations

import sys

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.torchao import TorchaoLoraLinear
from torch import nn


def plain(w) -> bool:
    """A plain tensor (a Parameter or not), no quantized tensor subclass."""
    return type(w) in (torch.Tensor, nn.Parameter)


def _bnb_layers() -> tuple:
    # PEFT's bitsandbytes LoRA layers; the module is imported when PEFT wrapped a bitsandbytes layer.
    module = sys.modules.get("peft.tuners.lora.bnb")
    return tuple(getattr(module, n) for n in ("Linear8bitLt", "Linear4bit") if hasattr(module, n))


def rounds_delta(m) -> bool:
    """Whether ``m`` adds each LoRA term rounded to the output's dtype also without ``adapter_names``
    (PEFT's bitsandbytes layers; its Linear does only in a mixed batch)."""
    return isinstance(m, _bnb_layers())


def output_dtype(m, default: torch.dtype) -> torch.dtype:
    """The dtype of a LoRA layer's base output: its weight's, or ``default`` (the model's) for
    bitsandbytes weights, which are stored as integers and compute in the input's dtype."""
    weight = m.get_base_layer().weight
    return weight.dtype if weight.is_floating_point() else default


def _why_weight(m, w) -> str | None:
    """Why module ``m``'s weight ``w`` is not served (None: it is)."""
    if plain(w):
        return None
    kind = f"{type(w).__module__}.{type(w).__name__}"
    if kind.startswith("torchao."):
        from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

        if type(w) is Int8Tensor and w.act_quant_kwargs is None \
                or type(w) is IntxUnpackedToInt8Tensor and w.activation_quantization is None:
            return None
        if type(w) in (Int8Tensor, IntxUnpackedToInt8Tensor):
            return (f"its {type(w).__name__} weight quantizes the activations too, which is not served (scales "
                    "computed over a pass, per tensor, make a row's output depend on the other rows); use "
                    "weight-only quantization (Int8WeightOnlyConfig, IntxWeightOnlyConfig)")
    elif kind.startswith("bitsandbytes.") and type(w).__name__ in ("Params4bit", "Int8Params"):
        threshold = getattr(getattr(m, "state", None), "threshold", 0.0)
        return None if not threshold else (
            f"its LLM.int8() outlier threshold ({threshold}) computes the input columns where any token of the pass "
            "exceeds it apart, so a row's output depends on the others in the pass; load the model with "
            "BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0), or in 4-bit")
    return (f"its weight is a {kind}; served: plain tensors, torchao's Int8WeightOnlyConfig / IntxWeightOnlyConfig "
            "weights and bitsandbytes' 4-bit and 8-bit ones")


def check_layer(m) -> None:
    """A LoRA layer type InvisibleLoRA serves (see the module docstring) with plain LoRA weights, or
    a ValueError naming its type. Its base weight is checked with the others' (``check_weights``)."""
    kind = f"{type(m).__module__}.{type(m).__name__}"
    if type(m) not in (LoraLinear, TorchaoLoraLinear, *_bnb_layers()):
        raise ValueError(
            f"invisible_lora supports LoRA on Linear layers only: peft.tuners.lora.layer.Linear on plain, torchao "
            f"weight-only or bitsandbytes 4-bit / 8-bit weights; found {kind} (a convolution, or another "
            "quantizer's LoRA layer). Use target_modules on linear layers, or plain generate().")
    if not all(plain(lin.weight) for lins in (m.lora_A, m.lora_B) for lin in lins.values()):
        raise ValueError(f"invisible_lora cannot serve LoRA layers of type {kind} with quantized LoRA weights: "
                         "quantize the base model before adding the adapters.")


def check_weights(model) -> None:
    """Every module's weight, under LoRA or not (a quantized layer no adapter targets computes the
    rows of every pass too): plain, or a quantized kind served (see the module docstring)."""
    todo = [model]
    while todo:
        m = todo.pop()
        w = m._parameters.get("weight")
        why = None if w is None else _why_weight(m, w)
        if why is not None:
            raise ValueError(f"invisible_lora cannot serve a {type(m).__module__}.{type(m).__name__} layer: {why}.")
        # Not into PEFT's adapter modules (lora_A, lora_B, ...: check_layer), most of a model with many adapters.
        todo.extend(c for n, c in m._modules.items() if c is not None and not n.startswith("lora_"))


def dense_weight(m) -> torch.Tensor:
    """``m``'s weight as a plain float tensor: torchao's dequantized. bitsandbytes weights are read
    by their layer's forward only (on the CPU its first pass repacks 4-bit weights in place)."""
    w = m.weight
    if plain(w):
        return w
    if type(w).__module__.startswith("torchao."):
        return w.dequantize()
    raise ValueError(f"draft_vocab reads rows of the output head's weight, which is a {type(w).__module__}."
                     f"{type(w).__name__} that only its layer's forward reads; leave draft_vocab unset.")
