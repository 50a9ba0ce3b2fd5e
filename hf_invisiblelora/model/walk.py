"""The model's LoRA layers as PEFT holds them, its linear layers, and the name of "no adapter".

Walking a model with many adapters costs tens of ms (thousands of modules), so the walk is kept
in the model's state and redone only when the adapters PEFT lists (peft_config: names and
configs) change, which is when LoRA layers come and go. A module a user puts in place of another
between such changes is not routed by our passes: it computes as it is (exact, not faster).
"""

from __future__ import annotations

from typing import NamedTuple

import peft.tuners.lora.model as peft_lora_model
from peft.tuners.lora import LoraLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from torch.nn.modules import module as torch_module

from .state import state_of

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


class Walk(NamedTuple):
    config: tuple  # peft_config items when walked
    lora: list  # (name, LoRA layer)
    modules: list  # every module
    linears: list  # every nn.Linear but the adapters' lora_A / lora_B (base layers, heads, saved copies)
    saved: set  # every module inside the adapters' modules_to_save copies (the base model never runs them)


def _walk(model) -> Walk:
    """The model's modules as the module docstring says, walked again when its adapters change."""
    state = state_of(model)
    config = tuple((getattr(model, "peft_config", None) or {}).items())
    if state.layers is None or state.layers.config != config:
        named = list(model.named_modules())
        modules = [m for _, m in named]
        lora = [(n, m) for n, m in named if isinstance(m, LoraLayer)]
        inside = {sub for _, m in lora for d in (m.lora_A, m.lora_B) for sub in d.values()}
        saved = {c for m in modules if isinstance(m, ModulesToSaveWrapper)
                 for copy in m.modules_to_save.values() for c in copy.modules()}
        state.layers = Walk(config, lora, modules, [m for m in modules if type(m) is nn.Linear and m not in inside],
                            saved)
    return state.layers


def named_lora_layers(model) -> list:
    """(name, layer) of every PEFT LoRA layer (see _walk)."""
    return _walk(model).lora


def all_modules(model) -> list:
    return _walk(model).modules


def linears(model) -> list:
    """Every ``nn.Linear`` of the model but the adapters' own lora_A / lora_B (see Walk)."""
    return _walk(model).linears


def adapter_copies(model) -> set:
    """Every module inside the adapters' modules_to_save copies (see Walk)."""
    return _walk(model).saved


def submodules(root) -> list:
    """Every module under ``root``, itself included, each once, as it is now (not the kept walk):
    what a call checks for what a user may have put in since the adapters last changed (hooks,
    rotary modules). One walk per call, by hand (not modules(): no names made), which the call's
    checks share: a walk costs milliseconds with many adapters (thousands of modules)."""
    out, stack, seen = [], [root], set()
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            stack.extend(c for c in m._modules.values() if c is not None)
    return out


def foreign_hooks(modules) -> bool:
    """Whether code other than ours, PEFT's and Transformers' sees the tensors of a pass through
    ``modules`` (``submodules``'s walk): a forward hook or pre-hook on one of them, or one of torch's
    global module hooks; such code may keep them for later use. Not counted: PEFT's injection of
    adapter_names, and Transformers' output-capturing hooks, which record nothing unless the
    model's own call asks for hidden states or attentions (ours never do)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    peft_hook = getattr(peft_lora_model, "_adapter_names_pre_forward_hook", None)
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            for hook in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]:
                inert = getattr(hook, "func", None) is peft_hook is not None \
                    or getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
                if not inert:
                    return True
    return False


def lora_layers(model) -> list:
    return [m for _, m in named_lora_layers(model)]


def layer_adapters(m) -> list:
    """The adapters with weights in LoRA layer ``m``, in PEFT's order (its Embedding keeps them in
    lora_embedding_A)."""
    return [*m.lora_A, *m.lora_embedding_A]
