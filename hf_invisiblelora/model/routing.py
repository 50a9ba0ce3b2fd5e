"""The one router of a call's passes: what each module computes in each pass, decided in one place.

    router = context.router                          # the pass context's (context.py)
    with router.routing({module: (kind, route), ...}):   # each part of the call says what it routes
        ...                                          # one forward per module, one guard; restored after

The parts that route modules for a call are the LoRA switch (the bank's or PEFT's LoRA layers:
switch.py, bank.py), the modules adapters train whole (saved_modules.py), the prepacked linear
layers (prepack.py), the drafters' layers (drafters.py) and length-dependent rotary embeddings
(rotary.py). Each gives the router routes, ``route(original, *args, **kwargs)`` (``original``:
the module's forward as it was), for a pass ``kind``: ``ALL`` (every pass of ours), ``LORA`` (a
LoRA-on pass: a prefill, a verify pass, a plain step) or ``draft(key)``, the draft passes of the
drafter of that key (drafters.Drafter.key: its options; by key, not by object, so that the
compiled passes of later calls, whose drafters are other objects with the same options, are reused).

Each module routed gets one forward while any route is on it. In a pass of ours (the context's
pass running on this thread, ``mine()``, or a compiled pass being traced) it calls the module's
route for the pass (``route_for``: the pass's drafter's own, else ``LORA`` in a LoRA-on pass, else
``ALL``); anywhere else (another thread, a user's processor between passes) the module as it is.
So what a layer computes does not depend on the order in which the parts were installed, and a
layer that two parts route (a base layer with a prepacked copy and a drafter's low-bit copy)
costs one call, not two nested ones.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

ALL, LORA = "all", "lora"


def draft(key: str) -> str:
    """The kind of the draft passes of the drafter whose key is ``key``."""
    return "draft:" + key


def _pick(routes: dict, drafter):
    if drafter is not None:
        return routes.get(draft(drafter.key), routes.get(ALL))
    return routes.get(LORA, routes.get(ALL))


class Router:
    """The routes of one pass context's passes (see the module docstring)."""

    def __init__(self, context):
        self.context = context
        self.routes = {}  # module -> {kind: route}
        self.originals = {}  # module -> its forward before the router's (None: the class's)

    def runs_as_is(self, module, drafter=None) -> bool:
        """Whether ``module`` computes in a pass of ``drafter`` what its class's forward computes: no
        forward on the instance, or the router's with no route for the pass and none before it (another
        library's, an accelerate hook's)."""
        if "forward" not in module.__dict__:
            return True
        return module in self.routes and self.originals[module] is None and self.route_for(module, drafter) is None

    def route_for(self, module, drafter=None):
        """The route ``module`` takes in a pass of ``drafter`` (None: LoRA on), or None: the module as it is."""
        return _pick(self.routes.get(module, {}), drafter)

    def direct(self, module, drafter=None):
        """x -> what ``module(x)`` computes in a pass of ``drafter`` (None: LoRA on), without the module
        call around it: for a module no hook is on (llama_pass.py calls its linear layers so). A route
        may have a form of its own for that (``route.direct(original, router, drafter)``: the adapter
        bank's, the prepacked layers')."""
        route = self.route_for(module, drafter)
        if route is None:
            return module.forward
        original = self.originals[module] or types.MethodType(type(module).forward, module)
        own = getattr(route, "direct", None)
        return functools.partial(route, original) if own is None else own(original, self, drafter)

    def _forward(self, module):
        original = module.forward  # the class's (or a forward another library set on the instance)
        routes, p = self.routes[module], self.context

        def forward(*args, **kwargs):
            if torch.compiler.is_compiling() or p.mine():
                route = _pick(routes, p.drafter)
                if route is not None:
                    return route(original, *args, **kwargs)
            return original(*args, **kwargs)
        return forward

    @contextlib.contextmanager
    def routing(self, table: dict):
        """Add ``table`` ({module: (kind, route)}) for the block; a module's forward is the router's
        while it has routes, and what it was before once they are all gone, also on errors."""
        added = []
        try:
            for module, (kind, route) in table.items():
                if kind in self.routes.get(module, {}):
                    raise RuntimeError(f"{type(module).__name__} is routed twice for {kind!r}")
                if module not in self.routes:
                    self.routes[module] = {}
                    self.originals[module] = module.__dict__.get("forward")
                    module.forward = self._forward(module)
                self.routes[module][kind] = route
                added.append((module, kind))
            yield self
        finally:
            for module, kind in added:
                routes = self.routes[module]
                del routes[kind]
                if not routes:
                    del self.routes[module]
                    previous = self.originals.pop(module)
                    if previous is None:
                        module.__dict__.pop("forward", None)
                    else:
                        module.forward = previous
