"""Modules adapters train whole (PEFT's ``modules_to_save``: an lm_head, a norm, embed_tokens, a
classifier), each row through its own adapter's copy.

PEFT wraps each such module in a ModulesToSaveWrapper (peft/utils/other.py) holding
``original_module`` and a copy per adapter that trains it (``modules_to_save[name]``). Its mixed
batch (``adapter_names=``) needs every row's adapter to have a copy and a Linear, Embedding or
Conv inside. Installed for one call next to the LoRA switch (switch.py), as the bank routes the
LoRA layers, each wrapper's forward reads the pass context (context.py) instead:

- a draft pass (the base model drafting) or PEFT's adapters disabled (``disable_adapter()``):
  the original module for every row;
- a LoRA-on pass of a mixed batch: each row (the input's dim 0) through its adapter's copy, or
  the original where the row is ``__base__`` or its adapter has no copy of this module, as the
  row alone gives with ``set_adapter(name)``; rows on the same module go through it together;
- a LoRA-on pass without ``adapter_names`` (every row the model's active adapter): PEFT's forward.

Compiled passes are not built for such models (checks.check_compile): the rows' modules are
chosen on the host in every pass.
"""

from __future__ import annotations

import contextlib

import torch
from peft.utils.other import ModulesToSaveWrapper

from ..model.context import selected
from ..model.routing import ALL
from ..model.walk import all_modules


def saves_modules(modules) -> bool:
    """Whether some adapter trains a whole module (a modules_to_save wrapper among ``modules``)."""
    return any(isinstance(m, ModulesToSaveWrapper) for m in modules)


class SavedModules:
    """See the module docstring. ``mixed``: rows name their adapters (else the model's active one)."""

    def __init__(self, model, mixed: bool):
        self.wrappers = [m for m in all_modules(model) if isinstance(m, ModulesToSaveWrapper)]
        self.mixed, self.names = mixed, []

    def set_rows(self, names: list) -> None:
        """Each decoder row's adapter ("__base__": none)."""
        self.names = names

    @contextlib.contextmanager
    def installed(self, context):
        """Route every wrapper as the module docstring says in ``context``'s passes (routing.py); restore on exit."""
        with context.router.routing({w: (ALL, self._route(w, context)) for w in self.wrappers}):
            yield self

    def _route(self, w, p):
        def route(original, *args, **kwargs):
            kwargs.pop("adapter_names", None)  # PEFT's generate() hooks inject it; the rows come from the context
            if p.drafter is not None or w.disable_adapters:
                return w.original_module(*args, **kwargs)
            if not self.mixed:
                return original(*args, **kwargs)
            return self._per_row(w, selected(self.names, p.rows), args, kwargs)
        return route

    @staticmethod
    def _per_row(w, names: list, args, kwargs):
        x = args[0] if args else None
        # Checked also when every row takes one module: a model serves or fails whatever its rows' adapters.
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != len(names):
            got = f"an input of {x.shape[0]} rows" if isinstance(x, torch.Tensor) and x.dim() else "no batched input"
            raise ValueError(f"A modules_to_save module ({type(w.original_module).__name__}) got {got} in a pass of "
                             f"{len(names)} rows: its input's dim 0 is not the batch, so rows cannot each take "
                             "their adapter's copy. Serve such adapters with plain generate().")
        groups = {}  # module -> the rows it computes
        for row, a in enumerate(names):
            groups.setdefault(w.modules_to_save[a] if a in w.modules_to_save else w.original_module, []).append(row)
        if len(groups) == 1:
            return next(iter(groups))(*args, **kwargs)
        if len(args) > 1 or kwargs:
            raise ValueError(f"A modules_to_save module ({type(w.original_module).__name__}) takes inputs besides "
                             "its batch, which rows on different adapters cannot split. Serve such adapters with "
                             "plain generate().")
        out = None
        for module, rows in groups.items():
            index = torch.tensor(rows, device=x.device)
            y = module(x[index])
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            elif y.dtype != out.dtype:  # out[index] = y would round it silently
                raise ValueError(f"The adapters' copies of a modules_to_save module compute {out.dtype} and "
                                 f"{y.dtype}: rows in both cannot share a batch. Cast the copies to one dtype.")
            out[index] = y
        return out
