"""float32 linear layers on the CPU with the weight prepacked for oneDNN (PyTorch's mkldnn ops).

PyTorch's own fp32 ``F.linear`` on the CPU (MKL's sgemm) reads a decoder step's weights at
4-6 GB/s once a pass has more than one token per layer, about half its one-token speed: on
SmolLM2-135M's 210 linear layers and head, out of cache, 2 threads of an AVX2 EPYC, 60 ms at one
token, 95 at 4, 86 at 8, 118 at 24. oneDNN's matmul on a copy of the weight reordered once into
its blocked layout (what Inductor's weight prepacking uses) took 47, 47, 54 and 84 ms: the verify
passes, the batched decode steps and the draft passes all run at the one-token step's cost or
better (benchmarks/bench_roofline.py, docs/benchmarks.md).

    packed = pack(weight)              # once: an opaque mkldnn tensor, as large as the weight
    y = linear(x, packed, bias)        # each call

The copy does not follow the weight: whoever holds it checks the weight is unchanged (prepack.py).
"""

import torch

# The row count oneDNN picks its layout for. Measured on the layers above: packed for 8 rows,
# the matmul ran at least as fast as packed for 1 row at every row count from 1 to 1024.
ROWS_HINT = 8


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack`` / ``linear`` serve weights of this dtype on this device (float32, the CPU,
    a PyTorch built with oneDNN)."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and _WORKS


def _probe() -> bool:
    # Private ops of PyTorch's mkldnn integration: use them only if they work in this build.
    try:
        w = torch.ones(4, 8)
        return bool((linear(torch.ones(2, 8), pack(w), None) == 8).all())
    except (AttributeError, RuntimeError, TypeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Semantics: the [out, in] float32 ``weight`` in oneDNN's layout (an opaque copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, weight, bias) for the weight ``packed`` was made from, up to float32
    rounding (another kernel: another order of summation). x: [..., in] float32 -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_WORKS = _probe()
