"""The acceptance rule: which drafts a row keeps, and the token it commits after them.

Greedy: keep drafts while they equal the target's argmax; then commit the target's argmax.
Sampling (speculative sampling, Leviathan et al. / Chen et al.): keep draft d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection j, sample from norm(max(0, p_j - q_j)); if all
k drafts are kept, sample the bonus token from p_k. The committed tokens are then distributed
exactly as sampling from the target p token by token. Vectorized over rows: no Python loop.
A position where the drafter proposed nothing (q_j = 0: its processed scores left no token
possible, ``sample``) is a rejection, and the token there is sampled from p_j itself.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: torch.Tensor, target_scores: torch.Tensor):
    """drafts [B, k], target_scores [B, k+1, V] -> (n_accepted [B], next_token [B])."""
    target = target_scores.argmax(-1)  # [B, k+1]
    n = (drafts == target[:, :-1]).long().cumprod(1).sum(1)
    return n, target.gather(1, n[:, None])[:, 0]


def accept_sampling(drafts, draft_probs, target_scores, generator=None):
    """drafts [B, k], draft_probs q [B, k, V], target_scores [B, k+1, V] -> (n_accepted [B], next_token [B])."""
    p = probs(target_scores)
    b, k = drafts.shape
    if k:
        p_d = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
        q_d = draft_probs.gather(-1, drafts[..., None])[..., 0]
        u = torch.rand(b, k, device=p.device, dtype=p.dtype, generator=generator)
        n = ((u * q_d < p_d) & (q_d > 0)).long().cumprod(1).sum(1)  # u < p/q without dividing by q
        q = torch.cat([draft_probs, p.new_zeros(b, 1, p.shape[-1])], 1)  # bonus position: q = 0
    else:
        n = torch.zeros(b, dtype=torch.long, device=p.device)
        q = torch.zeros_like(p)
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    residual = (p.gather(1, at) - q.gather(1, at)).clamp_(min=0)[:, 0]
    return n, torch.multinomial(residual, 1, generator=generator)[:, 0]


def probs(scores: torch.Tensor) -> torch.Tensor:
    """Softmax in at least float32 (half-precision probabilities are too coarse for the ratio test)."""
    return scores.softmax(-1) if scores.dtype in (torch.float32, torch.float64) else scores.float().softmax(-1)


def sample(scores: torch.Tensor, generator=None):
    """Sample one draft token per row from processed scores [B, V]; returns (token [B], probs [B, V]).
    A row whose scores leave no token possible (all -inf, or NaN: processors can empty a restricted
    draft vocabulary, or a draft context the target never sees) proposes nothing: token 0 with q = 0,
    which ``accept_sampling`` rejects."""
    q = probs(scores)
    empty = ~(torch.isfinite(q).all(-1) & (q.sum(-1) > 0))
    if empty.any():
        q = q.masked_fill(empty[:, None], 0)
        draw = q.clone()
        draw[empty, 0] = 1  # any token: it is rejected whatever it is
        return torch.multinomial(draw, 1, generator=generator)[:, 0], q
    return torch.multinomial(q, 1, generator=generator)[:, 0], q
