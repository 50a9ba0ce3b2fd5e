"""Which adapters a PEFT model holds, whether InvisibleLoRA can serve them, and switching LoRA on/off.

The decoding loop only asks two things of the LoRA layers: "on" (every row with its own adapter)
and "off" (the shared base model, the drafter). ``BankSwitch`` does it through the adapter bank's
batched kernels (bank.py; the default); ``PeftSwitch`` through PEFT's own per-adapter loop.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

from .bank import get_bank

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


def lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def check_servable(model) -> None:
    """Raise a ValueError naming the problem (and the fix) if InvisibleLoRA cannot serve ``model``.

    Runs before anything is changed, so a refused call leaves the model as it was.
    """
    if not isinstance(model, PeftModel):
        raise ValueError(
            f"invisible_lora needs a PEFT model with LoRA adapters, got {type(model).__name__}. "
            "Wrap it with peft.get_peft_model(model, LoraConfig(...)) or PeftModel.from_pretrained(model, path)."
        )
    not_lora = {n: c.peft_type.value for n, c in model.peft_config.items() if c.peft_type.value != "LORA"}
    if not_lora:
        raise ValueError(f"invisible_lora serves LoRA adapters only; these are not LoRA: {not_lora}.")
    if model.training:
        raise ValueError("invisible_lora decodes in inference mode: call model.eval() first (dropout must be off).")
    for name, cfg in model.peft_config.items():
        if getattr(cfg, "modules_to_save", None) or getattr(cfg, "trainable_token_indices", None):
            raise ValueError(
                f"Adapter {name!r} trains whole modules (modules_to_save / trainable_token_indices), which "
                "invisible_lora cannot switch off for drafting yet. Serve it with plain generate()."
            )
    layers = lora_layers(model)
    if not layers:
        raise ValueError("The PEFT model has no LoRA layers: nothing for invisible_lora to speed up.")
    for m in layers:
        if m.merged:
            raise ValueError(
                "Some adapters are merged into the base weights, so the base model cannot draft. "
                "Call model.unmerge_adapter() first."
            )
        if not isinstance(m, LoraLinear):
            raise ValueError(
                f"invisible_lora supports LoRA on Linear layers only, found {type(m).__name__} "
                "(embedding / convolution LoRA). Retrain with target_modules on linear layers."
            )
        if m.lora_variant:
            variants = {a: type(v).__name__ for a, v in m.lora_variant.items()}
            raise ValueError(f"LoRA variants (DoRA, aLoRA, ...) are not supported yet: {variants}.")
        if any(m.lora_bias.values()):
            raise ValueError("LoRA adapters with lora_bias=True are not supported yet.")


def resolve_adapter_names(model: PeftModel, adapter_names: Sequence[str] | None, batch_size: int) -> list[str]:
    """Per-row adapter names, validated. ``None`` means the active adapter for every row."""
    loaded = list(model.peft_config)
    if adapter_names is None:
        active = model.active_adapters
        if len(active) != 1:
            raise ValueError(
                f"Several adapters are active at once ({active}); pass adapter_names=[...] to choose one per row."
            )
        return [active[0]] * batch_size
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise ValueError(f"adapter_names must be a list of adapter names, one per row, got {adapter_names!r}.")
    if len(adapter_names) != batch_size:
        raise ValueError(
            f"adapter_names has {len(adapter_names)} entries but the batch has {batch_size} rows: give one "
            "adapter name per prompt (with pipeline(), pass batch_size=len(prompts) so one call sees them all)."
        )
    unknown = sorted({a for a in adapter_names if a != BASE and a not in loaded})
    if unknown:
        raise ValueError(f"Unknown adapter(s) {unknown}; loaded adapters: {loaded} (or {BASE!r} for none).")
    return list(adapter_names)


class PeftSwitch:
    """LoRA on/off through PEFT's own layers: on = PEFT's per-adapter ``adapter_names`` loop.

    Toggles each layer's ``_disable_adapters`` flag directly: ``model.disable_adapter()`` walks every
    module (~100 ms) and flips ``requires_grad`` on exit.
    """

    def __init__(self, model: PeftModel, adapter_names: list[str]):
        self.layers = lora_layers(model)
        self.adapter_names = adapter_names

    @contextlib.contextmanager
    def installed(self):
        flags = [m._disable_adapters for m in self.layers]

        def inject(module, args, kwargs):
            kwargs["adapter_names"] = self.adapter_names
            return args, kwargs

        handles = [m.register_forward_pre_hook(inject, with_kwargs=True) for m in self.layers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            for m, f in zip(self.layers, flags):
                m._disable_adapters = f

    def on(self, tokens_per_row: int) -> None:
        for m in self.layers:
            m._disable_adapters = False

    def off(self) -> None:
        for m in self.layers:
            m._disable_adapters = True


class BankSwitch:
    """LoRA on/off through the adapter bank: on = one batched shrink/expand per layer for all adapters."""

    def __init__(self, model: PeftModel, adapter_names: list[str]):
        self.bank = get_bank(model)
        self.row_slots = self.bank.slots(adapter_names)

    def installed(self):
        return self.bank.installed()

    def on(self, tokens_per_row: int) -> None:
        self.bank.set_batch(self.row_slots, tokens_per_row)

    def off(self) -> None:
        self.bank.set_batch(None, 1)


SWITCHES = {"bank": BankSwitch, "peft": PeftSwitch}
