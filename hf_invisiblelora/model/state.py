"""What InvisibleLoRA keeps on a model between calls, in one place.

    state_of(peft_model).stats        # the last call's DecodingStats
    state_of(peft_model).clear()      # drop it all (the adapter bank, the gate's measurements, compiled passes)

One call at a time per model: ``state.hold()`` takes ``state.lock``, which serializes
InvisibleLoRA calls on the same model (the bank, the gate's memory and the compiled buckets are
per model; a generate() call or a running serving engine), and makes ``state.owner`` the thread
of the call in progress: the one owner check (``mine``) that every routed layer reads through
the pass context (context.py), so other threads running the model meanwhile get it as it is.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from .derived import DerivedCopies

_ATTR = "_invisiblelora_state"
_CREATE = threading.Lock()


@dataclass
class ModelState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: int | None = None  # thread id of the call in progress
    bank: object = None  # bank.AdapterBank, built on first use
    gate: object = None  # decode.gate.GateMemory, made by the first call's session
    buckets: dict = field(default_factory=dict)  # forward.Bucket per (device, dtype, rows, cache length)
    stats: object = None  # stats.DecodingStats of the last call
    drafter: dict = field(default_factory=dict)  # drafters.py: token counts, derived weight copies
    layers: tuple | None = None  # lora.Walk: the model's LoRA layers, modules and linear layers
    packed: DerivedCopies = field(default_factory=DerivedCopies)  # prepack.py: prepacked weight copies

    def clear(self) -> None:
        """Forget the bank, the gate's measurements, the compiled passes, the last stats, the drafter's data
        and the prepacked weights."""
        self.bank, self.gate, self.buckets, self.stats, self.drafter, self.layers = None, None, {}, None, {}, None
        self.packed = DerivedCopies()

    def mine(self) -> bool:
        return self.owner == threading.get_ident()

    @contextlib.contextmanager
    def hold(self):
        """The block runs one InvisibleLoRA call on the model (see the module docstring)."""
        if self.mine():
            raise RuntimeError("InvisibleLoRA was called from inside another InvisibleLoRA call on the same model "
                               "(a streamer, processor or criterion?): calls on one model run one at a time.")
        with self.lock:
            self.owner = threading.get_ident()
            try:
                yield self
            finally:
                self.owner = None


def state_of(model) -> ModelState:
    """The PEFT model's InvisibleLoRA state (created on first use)."""
    state = model.__dict__.get(_ATTR)
    if state is None:
        with _CREATE:
            state = model.__dict__.setdefault(_ATTR, ModelState())
    return state

