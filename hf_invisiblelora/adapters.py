"""Switching LoRA on (every row with its own adapter) and off (the shared base model, the drafter).

The decoding loop asks only these two things of the LoRA layers. ``BankSwitch`` does it through
the adapter bank's batched kernels (bank.py; the default); ``PeftSwitch`` through PEFT's own
per-adapter loop (the reference). Both act only for the call's thread: another thread running the
model meanwhile gets its LoRA layers as they are.
"""

from __future__ import annotations

import contextlib

from .bank import get_bank
from .checks import lora_layers
from .state import forwards


class PeftSwitch:
    """LoRA through PEFT's own layers: on = PEFT's forward (its ``adapter_names`` loop for a mixed
    batch; its active adapter otherwise), off = the base layer alone."""

    def __init__(self, model, adapter_names: list[str], mixed: bool, mine):
        self.layers = lora_layers(model)
        self.adapter_names = adapter_names if mixed else None
        self.mine, self.lora, self.rows = mine, True, None

    def installed(self):
        return forwards({m: (lambda x, *args, _m=m, _f=m.forward, **kw: (
            self._forward(_m, _f, x, *args, **kw) if self.mine() else _f(x, *args, **kw))) for m in self.layers})

    def _forward(self, m, original, x, *args, **kwargs):
        kwargs.pop("adapter_names", None)
        if not self.lora:
            return m.base_layer(x, *args, **kwargs)
        if self.adapter_names is not None:
            kwargs["adapter_names"] = self.adapter_names if self.rows is None else [self.adapter_names[r] for r in self.rows.tolist()]
        return original(x, *args, **kwargs)

    def on(self, rows=None) -> None:
        self.lora = True
        self.rows = rows

    def off(self) -> None:
        self.lora = False


class BankSwitch:
    """LoRA through the adapter bank: on = one batched shrink/expand per layer for all adapters."""

    def __init__(self, model, adapter_names: list[str], mixed: bool, mine=None):
        self.bank = get_bank(model)
        self.row_slots = self.bank.slots(adapter_names)
        self.mixed = mixed

    @contextlib.contextmanager
    def installed(self):
        self.bank.round_delta = self.mixed  # PEFT's numerics: mixed batch, or one active adapter
        with self.bank.installed():
            yield self

    def on(self, rows=None) -> None:
        self.bank.set_batch(self.row_slots if rows is None else self.row_slots[rows])

    def off(self) -> None:
        self.bank.set_batch(None)


SWITCHES = {"bank": BankSwitch, "peft": PeftSwitch}
