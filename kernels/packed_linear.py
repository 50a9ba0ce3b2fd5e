"""float32 linear layers on the CPU with the weight prepacked once, in one of two formats.

PyTorch's own fp32 ``F.linear`` on the CPU (MKL's sgemm) packs the weight into its kernel's layout
on every call: once a pass has more than a token or two per layer it reads a decoder step's weights
at about half its one-token speed. A copy packed once avoids that. Two libraries torch ships do it:

- "onednn": oneDNN's matmul on the weight reordered into its blocked layout (what Inductor's weight
  prepacking uses; ``torch.ops.mkldnn``). On an AVX2 EPYC, SmolLM2-135M's 210 layers and head took
  47 / 47 / 54 / 84 ms at 1 / 4 / 8 / 24 tokens against ``F.linear``'s 60 / 95 / 86 / 118.
- "mkl": MKL's own packed sgemm (``sgemm_pack`` / ``sgemm_compute``, what ``torch.ops.mkl._mkl_linear``
  runs, but for any row count: torch's op runs the copy only at the row count it was packed for). On
  a Xeon with AMX, where oneDNN's copy was slower than ``F.linear`` at 1-3 tokens and about even
  from 4, it took 0.77-0.85x ``F.linear``'s time from 4 to 64 tokens.

Which is faster, and from how many tokens, depends on the CPU: prepack.py measures them.

    packed = pack(weight, "mkl")       # once: a copy in the format's layout, as large as the weight
    y = linear(x, packed, bias)        # each call (the format is the copy's)

The copy does not follow the weight: whoever holds it checks the weight is unchanged (prepack.py).
"""

import ctypes
import os

import torch

# The row count oneDNN picks its layout for. Measured on the layers above: packed for 8 rows,
# the matmul ran at least as fast as packed for 1 row at every row count from 1 to 1024.
ROWS_HINT = 8
# The row count MKL's packing is told of (its layout does not depend on it; its speed did: packed
# for 1 row, 2-32 rows ran 1.1-1.5x F.linear's time on the Xeon; packed for 32, 0.77-0.83x).
MKL_ROWS_HINT = 32


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack`` / ``linear`` serve weights of this dtype on this device in some format
    (float32, the CPU)."""
    return bool(formats(dtype, device))


def formats(dtype: torch.dtype, device: torch.device) -> tuple:
    """The formats that serve weights of this dtype on this device, in this build of PyTorch."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        return ()
    return _WORKING


class MklPacked:
    """A [out, in] float32 weight in MKL's packed layout: the buffer MKL wrote (which must not move:
    a tensor's storage never does), the weight's shape, and the addresses of the call's fixed
    arguments."""

    __slots__ = ("buffer", "out_features", "in_features", "_out", "_in")

    def __init__(self, buffer: torch.Tensor, out_features: int, in_features: int):
        self.buffer, self.out_features, self.in_features = buffer, out_features, in_features
        self._out, self._in = ctypes.c_int64(out_features), ctypes.c_int64(in_features)


def pack(weight: torch.Tensor, fmt: str = "onednn"):
    """Semantics: the [out, in] float32 ``weight`` in format ``fmt``'s layout (an opaque copy)."""
    weight = weight.detach().contiguous()
    if fmt == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
    if fmt == "mkl":
        return _mkl_pack(weight)
    raise ValueError(f"unknown format {fmt!r}")


def linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, weight, bias) for the weight ``packed`` was made from, up to float32
    rounding (another kernel: another order of summation). x: [..., in] float32 -> [..., out]."""
    if isinstance(packed, MklPacked):
        return _mkl_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# MKL's packed GEMM through its ILP64 Fortran entry points, which the CPU builds of libtorch export
# (64-bit integers whatever MKL_INT is; column-major: y^T [out, M] = W [out, in] times x^T [in, M]).
# Every argument is an address (ctypes makes the C call from Python ints: a few microseconds).
def _mkl_library():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    size, pack_, compute = lib.SGEMM_PACK_GET_SIZE_64, lib.SGEMM_PACK_64, lib.SGEMM_COMPUTE_64
    size.restype, pack_.restype, compute.restype = ctypes.c_size_t, None, None
    size.argtypes = [ctypes.c_void_p] * 4
    pack_.argtypes = [ctypes.c_void_p] * 9
    compute.argtypes = [ctypes.c_void_p] * 12
    return size, pack_, compute


_CHARS = {c: ctypes.create_string_buffer(c) for c in (b"A", b"T", b"P", b"N")}
_FLOATS = {v: ctypes.c_float(v) for v in (0.0, 1.0)}


def _at(value) -> int:
    return ctypes.addressof(value)


def _mkl_pack(weight: torch.Tensor) -> MklPacked:
    size, pack_, _ = _MKL
    out_f, in_f = weight.shape
    n, hint, k = ctypes.c_int64(out_f), ctypes.c_int64(MKL_ROWS_HINT), ctypes.c_int64(in_f)
    # MKL's size is an upper bound (pages it never writes are never resident).
    buffer = torch.empty(size(_at(_CHARS[b"A"]), _at(n), _at(hint), _at(k)), dtype=torch.uint8)
    pack_(_at(_CHARS[b"A"]), _at(_CHARS[b"T"]), _at(n), _at(hint), _at(k), _at(_FLOATS[1.0]), weight.data_ptr(),
          _at(k), buffer.data_ptr())
    return MklPacked(buffer, out_f, in_f)


def _mkl_linear(x: torch.Tensor, packed: MklPacked, bias: torch.Tensor | None) -> torch.Tensor:
    out_f, in_f = packed.out_features, packed.in_features
    if x.dtype != torch.float32 or x.shape[-1] != in_f:
        raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a float32 [{out_f}, {in_f}] weight")
    x2 = x.reshape(-1, in_f).contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, out_f)
    if bias is not None:  # the starting value of the output (beta 1), as PyTorch's addmm adds it
        y.copy_(bias.expand(rows, out_f))  # a copy: MKL writes into it
    if rows:
        n, k, m = _at(packed._out), _at(packed._in), ctypes.c_int64(rows)
        _MKL[2](_at(_CHARS[b"P"]), _at(_CHARS[b"N"]), n, _at(m), k, packed.buffer.data_ptr(), k,
                x2.data_ptr(), k, _at(_FLOATS[0.0 if bias is None else 1.0]), y.data_ptr(), n)
    return y.view(*x.shape[:-1], out_f)


def _probe() -> tuple:
    # Private ops and entry points of PyTorch's build: use a format only if it computes right here.
    working = []
    w, x, b = torch.arange(24.0).reshape(4, 6) / 8, torch.arange(18.0).reshape(3, 6) / 4, torch.arange(4.0)
    for fmt in ("onednn", "mkl"):
        try:
            if torch.equal(linear(x, pack(w, fmt), b), torch.nn.functional.linear(x, w, b)):
                working.append(fmt)
        except (AttributeError, OSError, RuntimeError, TypeError, ValueError):
            pass
    return tuple(working)


try:
    _MKL = _mkl_library()
except (AttributeError, OSError):
    _MKL = None
_WORKING = _probe()
