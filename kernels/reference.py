"""Plain per-adapter reference for the batched LoRA ops. Slow on purpose; used only by tests."""

import torch


def lora_reference(x, A, B, token_slots, scale=1.0):
    """Semantics:
        for t in range(T):
            s = token_slots[t]
            delta[t] = 0                                   if s == -1
            delta[t] = scale * (x[t] @ A[s].T) @ B[s].T    otherwise
    x: [T, H]; A: [S, R, H]; B: [S, O, R]; token_slots: [T] long. Returns delta [T, O] in x's dtype,
    computed in float64 so that it can judge fp32/fp64 kernels.
    """
    delta = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float64, device=x.device)
    for s in token_slots.unique().tolist():
        if s == -1:
            continue
        rows = (token_slots == s).nonzero().squeeze(1)
        delta[rows] = scale * (x[rows].double() @ A[s].double().T) @ B[s].double().T
    return delta.to(x.dtype)
