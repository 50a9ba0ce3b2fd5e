"""Switching LoRA on (every row with its own adapter) and off (the shared base model, the drafter).

The decoding loop asks only this of the LoRA layers: a pass with LoRA on takes each row's adapter
from the pass context (context.py; what ``switch.adapters(rows)`` gave it), a draft pass none.
``BankSwitch`` does it through the adapter bank's batched kernels (bank.py; the default);
``PeftSwitch`` through PEFT's own per-adapter loop (the reference). Both route the modules
adapters train whole (``modules_to_save``) per row too (saved_modules.py), and act only in the
call's passes: another thread running the model meanwhile gets its layers as they are.
"""

from __future__ import annotations

import contextlib

import torch

from ..model.context import selected
from ..model.derived import SourceCheck
from ..model.quantized import output_dtype
from ..model.routing import ALL
from ..model.walk import BASE, lora_layers
from .bank import get_bank
from .saved_modules import SavedModules


def _key(rows):
    """A hashable key for a pass's rows: None (all), a slice, or a tensor of row indices."""
    if rows is None or isinstance(rows, slice):
        return None if rows is None else ("first", rows.stop)
    return ("some", *rows.tolist())


class PeftSwitch:
    """LoRA through PEFT's own layers: a LoRA-on pass runs PEFT's forward (its ``adapter_names``
    loop for a mixed batch; its active adapter otherwise), a draft pass the base layer alone.
    ``adapters(rows)`` is what a pass context carries: the rows' names (mixed), else None."""

    def __init__(self, model, mixed: bool, check=None):  # check: unused, PEFT's layers read their weights
        self.layers = lora_layers(model)
        self.mixed, self.names, self.context = mixed, [], None
        self.saved = SavedModules(model, mixed)

    @contextlib.contextmanager
    def installed(self, context):
        self.context = context
        routed = {m: (ALL, lambda original, x, *args, _m=m, **kw: self._forward(_m, original, x, *args, **kw))
                  for m in self.layers}
        with context.router.routing(routed), self.saved.installed(context):
            yield self

    def _forward(self, m, original, x, *args, **kwargs):
        p = self.context
        kwargs.pop("adapter_names", None)
        if p.drafter is not None:
            return m.base_layer(x, *args, **kwargs)
        if p.adapters is not None:
            if m.lora_variant and not m.disable_adapters:
                # DoRA (checks.check_model): PEFT's mixed batch computes its rows as each row alone does;
                # only its argument check refuses them.
                return m._mixed_batch_forward(x, *args, adapter_names=p.adapters, **kwargs)
            kwargs["adapter_names"] = p.adapters
        return original(x, *args, **kwargs)

    def set_rows(self, adapter_names: list) -> None:
        """Each row's adapter (None or "__base__": none)."""
        self.names = [a or BASE for a in adapter_names]
        self.saved.set_rows(self.names)

    def adapters(self, rows=None):
        return selected(self.names, rows) if self.mixed else None


class BankSwitch:
    """LoRA through the adapter bank: one batched shrink/expand per layer for all adapters.
    ``adapters(rows)`` is what a pass context carries: the rows' bank slots."""

    def __init__(self, model, mixed: bool, check: SourceCheck | None = None):
        self.check = check or SourceCheck()  # the call's (derived.py)
        self.bank = get_bank(model, adapters=(), check=self.check)  # the structure now; weights as rows name adapters
        self.mixed = mixed
        self.row_slots, self._views = None, {}
        self._synced = set()
        self.saved = SavedModules(model, mixed)

    @contextlib.contextmanager
    def installed(self, context):
        # PEFT's numerics: mixed batch, or one active adapter
        with self.bank.installed(context, round_delta=self.mixed), self.saved.installed(context):
            yield self

    def set_rows(self, adapter_names: list) -> None:
        """Each row's adapter (None or "__base__": none)."""
        new = {a for a in adapter_names if a and a != BASE} - self._synced
        if new:  # compare these adapters' weights with the bank's copy once per switch (one per call; the
            # bank's structure was followed when the switch was made: a change of adapters makes a new switch)
            self.bank.refresh(new, self.check)
            self.bank.check_finite(new)
            self._synced |= new
        names = [a or BASE for a in adapter_names]
        self.row_slots = self.bank.slots(names)
        self.saved.set_rows(names)
        self._views = {}  # the bank memoizes metadata per slot tensor: one tensor per row set

    def adapters(self, rows=None):
        self.bank.begin_pass()
        key = _key(rows)
        if key not in self._views:
            self._views[key] = self.row_slots if rows is None else self.row_slots[rows]
        return self._views[key]


SWITCHES = {"bank": BankSwitch, "peft": PeftSwitch}


def bank_inexact(model, adapters) -> str | None:
    """Why the bank would not compute these adapters' LoRA terms as PEFT does, or None.

    PEFT computes each adapter's term in that adapter's own dtype and adds it to the base layer's
    output. The bank computes every adapter in one dtype (the widest of the loaded adapters), with
    the scaling folded into B: the same arithmetic when the call's adapters all have that dtype and
    it is at least as precise as the base layers' (float32 adapters on a bfloat16 model, PEFT's
    default, included); otherwise its rounding would show (a bfloat16 adapter on a float64 model).
    """
    used, widest, dtype = set(), None, model.get_base_model().dtype
    for m in lora_layers(model):
        base = output_dtype(m, dtype)
        for a, lin in m.lora_A.items():
            kinds = {lin.weight.dtype, m.lora_B[a].weight.dtype}
            if a in m.lora_magnitude_vector:  # DoRA's scales are stacked in the bank's dtype too
                kinds.add(m.lora_magnitude_vector[a].weight.dtype)
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
