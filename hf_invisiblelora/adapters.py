"""Switching LoRA on (every row with its own adapter) and off (the shared base model, the drafter).

The decoding loop asks only these two things of the LoRA layers. ``BankSwitch`` does it through
the adapter bank's batched kernels (bank.py; the default); ``PeftSwitch`` through PEFT's own
per-adapter loop (the reference). Both act only for the call's thread: another thread running the
model meanwhile gets its LoRA layers as they are.
"""

from __future__ import annotations

import contextlib

import torch

from .bank import get_bank
from .checks import BASE, lora_layers
from .state import forwards


def _key(rows):
    """A hashable key for a pass's rows: None (all), a slice, or a tensor of row indices."""
    if rows is None or isinstance(rows, slice):
        return None if rows is None else ("first", rows.stop)
    return ("some", *rows.tolist())


class PeftSwitch:
    """LoRA through PEFT's own layers: on = PEFT's forward (its ``adapter_names`` loop for a mixed
    batch; its active adapter otherwise), off = the base layer alone."""

    def __init__(self, model, mixed: bool, mine):
        self.layers = lora_layers(model)
        self.mixed, self.mine, self.lora, self.names = mixed, mine, True, None

    def installed(self):
        return forwards({m: (lambda x, *args, _m=m, _f=m.forward, **kw: (
            self._forward(_m, _f, x, *args, **kw) if self.mine() else _f(x, *args, **kw))) for m in self.layers})

    def _forward(self, m, original, x, *args, **kwargs):
        kwargs.pop("adapter_names", None)
        if not self.lora:
            return m.base_layer(x, *args, **kwargs)
        if self.names is not None:
            kwargs["adapter_names"] = self.names
        return original(x, *args, **kwargs)

    def set_rows(self, adapter_names: list) -> None:
        """Each row's adapter (None or "__base__": none)."""
        self.all_names = [a or BASE for a in adapter_names]

    def on(self, rows=None) -> None:
        self.lora = True
        if self.mixed:
            idx = range(len(self.all_names)) if rows is None else \
                range(*rows.indices(len(self.all_names))) if isinstance(rows, slice) else rows.tolist()
            self.names = [self.all_names[r] for r in idx]

    def off(self) -> None:
        self.lora = False


class BankSwitch:
    """LoRA through the adapter bank: on = one batched shrink/expand per layer for all adapters."""

    def __init__(self, model, mixed: bool, mine=None):
        self.bank = get_bank(model, adapters=())  # the structure now; weights as rows name adapters
        self.mixed = mixed
        self.row_slots, self._views = None, {}
        self._synced = set()

    @contextlib.contextmanager
    def installed(self):
        self.bank.round_delta = self.mixed  # PEFT's numerics: mixed batch, or one active adapter
        with self.bank.installed():
            yield self

    def set_rows(self, adapter_names: list) -> None:
        """Each row's adapter (None or "__base__": none)."""
        new = {a for a in adapter_names if a and a != BASE} - self._synced
        if new:  # compare these adapters' weights with the bank's copy once per switch (one per call)
            self.bank.sync(new)
            self._synced |= new
        self.row_slots = self.bank.slots([a or BASE for a in adapter_names])
        self._views = {}  # the bank memoizes metadata per row_slots object: one object per row set

    def on(self, rows=None) -> None:
        key = _key(rows)
        if key not in self._views:
            self._views[key] = self.row_slots if rows is None else self.row_slots[rows]
        self.bank.set_batch(self._views[key])

    def off(self) -> None:
        self.bank.set_batch(None)


SWITCHES = {"bank": BankSwitch, "peft": PeftSwitch}


def bank_inexact(model, adapters) -> str | None:
    """Why the bank would not compute these adapters' LoRA terms as PEFT does, or None.

    PEFT computes each adapter's term in that adapter's own dtype and adds it to the base layer's
    output. The bank computes every adapter in one dtype (the widest of the loaded adapters), with
    the scaling folded into B: the same arithmetic when the call's adapters all have that dtype and
    it is at least as precise as the base layers' (float32 adapters on a bfloat16 model, PEFT's
    default, included); otherwise its rounding would show (a bfloat16 adapter on a float64 model).
    """
    used, widest = set(), None
    for m in lora_layers(model):
        base = m.get_base_layer().weight.dtype
        for a, lin in m.lora_A.items():
            kinds = {lin.weight.dtype, m.lora_B[a].weight.dtype}
            for d in kinds:
                widest = d if widest is None else torch.promote_types(widest, d)
            if a in adapters:
                used |= {(d, base) for d in kinds}
    for d, base in sorted(used, key=str):
        if d != widest:
            return f"the adapters are in several dtypes ({widest} and {d}), which PEFT computes each in its own"
        if d != base and not (d.is_floating_point and torch.finfo(d).eps <= torch.finfo(base).eps):
            return f"adapters in {d} on {base} layers: PEFT computes their terms in {d}"
    return None
