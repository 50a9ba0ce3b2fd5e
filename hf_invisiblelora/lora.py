"""The model's LoRA layers as PEFT holds them, and the name of "no adapter".

Walking a model with many adapters costs tens of ms (thousands of modules), so the walk is kept
in the model's state and redone only when the adapters PEFT lists (peft_config: names and
configs) change, which is when LoRA layers come and go.
"""

from __future__ import annotations

from peft.tuners.lora import LoraLayer

from .state import state_of

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


def _walk(model) -> tuple:
    """(LoRA layers with their names, every module) of the model (see the module docstring)."""
    state = state_of(model)
    config = tuple((getattr(model, "peft_config", None) or {}).items())
    if state.layers is None or state.layers[0] != config:
        modules = list(model.named_modules())
        state.layers = (config, [(n, m) for n, m in modules if isinstance(m, LoraLayer)], [m for _, m in modules])
    return state.layers[1:]


def named_lora_layers(model) -> list:
    """(name, layer) of every PEFT LoRA layer (see _walk)."""
    return _walk(model)[0]


def all_modules(model) -> list:
    return _walk(model)[1]


def lora_layers(model) -> list:
    return [m for _, m in named_lora_layers(model)]


def layer_adapters(m) -> list:
    """The adapters with weights in LoRA layer ``m``, in PEFT's order (its Embedding keeps them in
    lora_embedding_A)."""
    return [*m.lora_A, *m.lora_embedding_A]
