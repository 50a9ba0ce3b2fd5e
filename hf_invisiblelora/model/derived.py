"""Derived copies of the model's tensors, and the one check that a copy is still true to its sources.

    check = SourceCheck()                                   # one per call: each source digested once
    packed = copies.get(layer, "packed", (w,), lambda: pack(w), check)   # made again when w changed

What we keep beside the model is derived from its tensors: prepacked weights (prepack.py), the
adapter bank's stacks and DoRA column scales (bank.py), low-bit draft weights and a restricted
draft head (drafters.py). A copy records the digests of everything it was made from; before each
use the sources are digested again and the copy is made again if any digest differs.

A digest is a tensor's type, dtype, shape and device and a hash of its bytes: xxh3-128 on the CPU
(the memory's read speed), elsewhere a position-weighted sum of its bits computed where it lies.
So every route that changes a value is seen, whichever it is: in-place ops, writes through
``.data`` (which bump no version counter), ``load_state_dict``, permutations (which keep every
row's sum), ``merge`` / ``unmerge``, ``quantize_`` (another tensor type: its inner tensors and
metadata are digested), ``model.to``. A new tensor with the same values keeps the copy.

When: the sources are digested once per ``generate()`` call and when a serving engine's adapters
change (session.py), a full read of the weights that have copies (docs/design.md gives the cost
on SmolLM2). Not seen: a change made while a call runs (by a processor, a streamer or another
thread), which takes effect at the next call; standard decoding under such a change would read
half-old, half-new weights in one step, an output no one can specify.
"""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash


def _digest_bits(t: torch.Tensor) -> int:
    """A hash of a plain tensor's bytes: xxh3-128 on the CPU; on other devices (no copy to the host)
    the bits as int32 summed with odd position weights per row (any change of one element changes
    its row's sum: odd weights are invertible mod 2^32), the rows' sums then weighted into one int64."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return 0
    if t.device.type == "cpu":
        return xxhash.xxh3_128_intdigest(t.view(-1).view(torch.uint8).numpy())
    return _weighted_sum(t)


_WEIGHTS: dict = {}


def _position_weights(n: int, device, dtype) -> torch.Tensor:
    key = (n, str(device), dtype)
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(n)
        w = torch.randint(-(2**30), 2**30, (n,), generator=g, dtype=torch.int64) * 2 + 1
        w = _WEIGHTS[key] = w.to(dtype).to(device)
    return w


def _weighted_sum(t: torch.Tensor) -> int:
    """See _digest_bits: the device-side hash (exercised on the CPU by the tests)."""
    nbytes = t.numel() * t.element_size()
    row_bytes = t.shape[-1] * t.element_size() if t.dim() else nbytes
    flat = t.view(-1).view(torch.uint8)
    if row_bytes % 4 == 0:
        bits = flat.view(torch.int32).view(-1, row_bytes // 4)
    else:
        bits = flat.to(torch.int32).view(-1, row_bytes)
    rows = (bits * _position_weights(bits.shape[1], t.device, torch.int32)).sum(1, dtype=torch.int32)
    return int((rows.to(torch.int64) * _position_weights(rows.shape[0], t.device, torch.int64)).sum())


def digest(value):
    """What a copy made from ``value`` depends on: a tensor's type, dtype, shape, device and bytes (a
    tensor subclass: its metadata and inner tensors, as torch.compile flattens it); numbers and
    strings as they are (floats by their bits: NaN equals NaN); tuples and lists element-wise."""
    if isinstance(value, torch.Tensor):
        plain = type(value) in (torch.Tensor, torch.nn.Parameter)
        head = ("Tensor" if plain else type(value).__qualname__, str(value.dtype), tuple(value.shape), str(value.device))
        if hasattr(value, "__tensor_flatten__"):  # torchao's quantized weights and other wrapper subclasses
            names, ctx = value.__tensor_flatten__()
            return head + (repr(ctx),) + tuple(digest(getattr(value, n)) for n in names)
        extra = ()
        if not plain:  # a Parameter subclass (bitsandbytes): its state too
            extra = tuple((k, digest(v)) for k, v in sorted(vars(value).items()) if k != "_backward_hooks"
                          and isinstance(v, (torch.Tensor, int, float, str, bool, type(None))))
            value = value.as_subclass(torch.Tensor)
        return head + extra + (_digest_bits(value),)
    if isinstance(value, float):
        return ("f", value.hex())
    if isinstance(value, (tuple, list)):
        return tuple(digest(v) for v in value)
    return value


class SourceCheck:
    """One check of the sources: each tensor digested at most once (a tensor several copies derive
    from, such as a layer's weight with a prepacked and a low-bit copy, is read once). Make one per
    call (session.py); a check kept longer would not see changes made after it."""

    def __init__(self):
        self._memo = {}  # id(tensor) -> (weak reference to it, digest): a reused id is not mistaken for it

    def __call__(self, sources: tuple) -> tuple:
        out = []
        for s in sources:
            if isinstance(s, torch.Tensor):
                d = self._memo_of(s)
                if d is None:
                    d = self._keep(s, digest(s))
                out.append(d)
            else:
                out.append(digest(s))
        return tuple(out)

    def _memo_of(self, t: torch.Tensor):
        hit = self._memo.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _keep(self, t: torch.Tensor, d):
        self._memo[id(t)] = (weakref.ref(t), d)
        return d

    def prefetch(self, tensors) -> None:
        """Digest the CPU tensors among ``tensors`` now, on torch's CPU threads at once, for the
        copies checked one by one after: xxh3 lets go of the GIL and reading the weights is bound by
        memory, which one thread does not saturate (SmolLM2's 540 MB: 47 ms on one thread of a Xeon,
        25 ms on two)."""
        todo = list({id(t): t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                     and self._memo_of(t) is None}.values())
        n = min(torch.get_num_threads(), len(todo))
        if n < 2:
            return
        chunks = [todo[i::n] for i in range(n)]  # interleaved: the layers' sizes repeat
        with ThreadPoolExecutor(n) as pool:
            for chunk in pool.map(lambda ts: [(t, digest(t)) for t in ts], chunks):
                for t, d in chunk:
                    self._keep(t, d)


class DerivedCopies:
    """Copies of a module's tensors, per (module, kind): ``get`` returns the kept copy while its
    sources' digests are those it was made from, else ``make()``'s, kept."""

    def __init__(self):
        self._items = {}  # (id(module), kind) -> (weakref to the module, digests, copy)

    def get(self, module, kind, sources: tuple, make, check: SourceCheck):
        key, digests = (id(module), kind), check(sources)
        hit = self._items.get(key)
        if hit is None or hit[0]() is not module or hit[1] != digests:
            hit = self._items[key] = (weakref.ref(module), digests, make())
        return hit[2]

    def kept(self, module, kind):
        """The copy kept for (module, kind), or None (not checked against its sources)."""
        hit = self._items.get((id(module), kind))
        return hit[2] if hit is not None and hit[0]() is module else None

    def keep_only(self, kinds: dict) -> None:
        """Keep only the copies of ``kinds``' {module: kind} (drop those of modules gone from the
        model, and those of another kind)."""
        wanted = {(id(m), kind) for m, kind in kinds.items()}
        self._items = {k: v for k, v in self._items.items() if k in wanted and v[0]() is not None}

    def modules(self) -> list:
        """The modules with copies kept (those still alive)."""
        return [m for ref, _, _ in self._items.values() if (m := ref()) is not None]

    def __len__(self) -> int:
        return len(self._items)
