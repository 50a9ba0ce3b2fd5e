"""One decoder over a model, assembled the same way for ``generate()`` (api.py) and the serving
engine (engine.py):

    session = Session(peft_model, policy, capacity=B, width=W, mixed=True, ...)
    with state_of(peft_model).hold(), session.installed() as decoder:
        committed = decoder.admit(rows, input_ids, mask, positions, budgets, adapters)
        while decoder.batch.active:
            committed = decoder.cycle()

It builds the LoRA switch (the adapter bank, or PEFT's own layers: ``lora_backend``), the forward
(eager, or the compiled passes of a bucket) with its pass context, the drafter, the gate, the
per-slot rotary embeddings of length-dependent RoPE, and the Decoder. ``installed()`` routes
them into the model's layers for the call's passes (on the CPU, with torch's threads following the
CPUs other work leaves free: threads.Contention) and puts everything back after, also on errors.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..lora.switch import SWITCHES, bank_inexact
from ..model.derived import SourceCheck
from ..model.forward import CompiledForward, EagerForward
from ..model.llama_pass import direct_pass
from ..model.prepack import PackedLinears
from ..model.rotary import StepRotary
from ..model.walk import BASE, foreign_hooks, submodules
from ..threads import Contention
from .decoder import Decoder
from .drafters import BaseModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .gate import Gate, GateMemory

logger = logging.getLogger("hf_invisiblelora")


def lora_backend(model, adapters, requested: str = "bank") -> str:
    """``requested``, unless it is the bank and the bank would not compute these adapters as PEFT
    does (adapters.bank_inexact): then PEFT's own layers (logged at INFO)."""
    why = requested == "bank" and bank_inexact(model, set(adapters) - {BASE})
    if why:
        logger.info("hf_invisiblelora: PEFT's own LoRA layers compute the passes (%s).", why)
        return "peft"
    return requested


def make_drafters(model, state, dtypes: tuple, vocab=None, size: int | None = None, prompt_lookup: bool = True,
                  drafting: bool = True) -> list:
    """The drafters the gate chooses among: one ``BaseModelDrafter`` per draft dtype (``draft_dtypes``'s
    choices), all with the head on ``vocab`` (token ids, or None), and a ``PromptLookupDrafter``
    unless ``prompt_lookup`` is off. Not ``drafting`` (gate="never"): the base model as it is alone,
    whose passes never run, so that no draft copy is made for nothing."""
    if not drafting:
        return [BaseModelDrafter(model, state)]
    vocab = None if vocab is None else torch.as_tensor(vocab)
    drafters = [BaseModelDrafter(model, state, vocab, d, size=size) for d in dtypes]
    return drafters + [PromptLookupDrafter()] if prompt_lookup else drafters


class Session:
    """See the module docstring. ``policy``: how tokens are chosen (policies.py); ``capacity`` rows
    of ``width`` slots; ``mixed``: rows name their adapters (PEFT's mixed-batch path, as
    ``adapter_names=`` takes it), else the model's active adapter; ``drafters``: default the base
    model as it is (several: the gate picks one per cycle); ``compile_backend``: None (eager), "inductor" or "cuda_graphs" (forward.py),
    in the bucket of ``length`` slots if given; ``prepack``: the eager passes' linear layers on
    prepacked weights ("auto", True, False: prepack.py); ``together``: the rows end together (a
    generate call; False: a serving engine's requests), which the gate weighs (gate.py); ``modules``:
    the call's walk of the base model (walk.submodules), if it made one; the other keywords go to
    the Decoder."""

    def __init__(self, model, state, policy, *, capacity: int, width: int, mixed: bool, lora_backend: str = "bank",
                 gate: str = "auto", num_draft_tokens: int = 4, drafters=None, compile_backend=None, length=None,
                 prepack="auto", together: bool = True, modules=None, **decoder_options):
        inner = model.get_base_model()
        self._modules = modules if modules is not None else submodules(inner)  # installed() walks again later
        self.inner, self.state, self.mixed = inner, state, mixed
        self.check = SourceCheck()  # every derived copy checked against its sources once (derived.py)
        lora = SWITCHES[lora_backend](model, mixed, self.check)
        self.drafters = drafters or [BaseModelDrafter(model, state)]
        if compile_backend is None:
            self.fwd = EagerForward(inner, lora, capacity, width, inner.device, state.mine)
        else:
            self.fwd = CompiledForward(inner, state.buckets, lora, capacity, width, inner.device, compile_backend,
                                       range(1, num_draft_tokens + 2), state.mine, length)
        if state.gate is None:
            state.gate = GateMemory()
        self.gate = Gate(gate, num_draft_tokens, state.gate, BASE, passes=compile_backend or "eager",
                         drafters=tuple(d.key for d in self.drafters), together=together)
        self.rotary = StepRotary(self._modules, self.fwd.layout)
        # Compiled passes trace the layers as they are: Inductor lays out weights its own way.
        self.packed = PackedLinears(model, state, prepack, self.check) if compile_backend is None else None
        self.decoder = Decoder(self.fwd, lora, policy, self.gate, self.drafters, capacity=capacity,
                               **decoder_options)

    @contextlib.contextmanager
    def installed(self):
        context = self.fwd.context
        # A user's hook may keep a pass's tensors (and use them with autograd, or change them in
        # place): then plain no_grad passes, as stock's; else inference mode where the forward has it.
        modules, self._modules = self._modules or submodules(self.inner), None
        hooked = foreign_hooks(modules)
        self.fwd.inference = type(self.fwd).inference and not hooked
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.decoder.lora.installed(context))
            stack.enter_context(self.rotary.installed())
            if self.packed is not None:  # the drafters' own layers take their place in their passes (routing.py)
                stack.enter_context(self.packed.installed(context))
            for drafter in self.drafters:
                stack.enter_context(drafter.installed(context, self.check))
            if isinstance(self.fwd, EagerForward) and not hooked:
                # With every route in place: the passes that can run as plain functions (llama_pass.py),
                # LoRA-on ones and each drafter's (by its own copies of the linear layers).
                direct = {d: direct_pass(self.inner, context.router, d, d.copy_of if d else None)
                          for d in [None, *(d for d in self.drafters if d.passes)]}
                self.fwd.direct = {d: run for d, run in direct.items() if run is not None}
                stack.callback(setattr, self.fwd, "direct", {})
            if self.inner.device.type == "cpu":  # torch's threads follow the CPUs other work leaves (threads.py)
                self.decoder.threads = Contention()
                stack.callback(self.decoder.threads.restore)
            yield self.decoder

    def renew_lora(self, model, lora_backend: str) -> None:
        """A new LoRA switch after the model's adapters changed (a new bank: its slots may move);
        the rows in flight go on. Call outside ``installed()``."""
        self.check = SourceCheck()  # the model may have changed: its sources are read again
        self.decoder.set_lora(SWITCHES[lora_backend](model, self.mixed, self.check))
        if self.packed is not None:  # the layers may have changed too: PEFT wraps the ones a new adapter targets
            self.packed = PackedLinears(model, self.state, self.packed.mode, self.check)
