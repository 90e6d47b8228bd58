"""Muon's update, kept apart from the optimizer that shards and schedules it (`raychat.optim.muon_adamw`) so
the math reads on its own: Nesterov momentum, MuonEq row equilibration, Polar Express orthogonalisation,
Muon+ renormalisation, NorMuon variance reduction and cautious weight decay, on a stack of
same-shape matrices at once (the matrices of a group a rank owns).
"""

import torch
from torch import Tensor

# Polar Express coefficients (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X, for 5 iterations
# (safety factor 2e-2, cushion 2), from Amsel et al. 2025, https://arxiv.org/abs/2505.16932
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

def _at_least_fp32(t: Tensor) -> Tensor:
    """Norms and mean squares of a bf16 stack are taken in fp32 (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def muon_update(grads: Tensor, params: Tensor, momentum_buffer: Tensor, second_momentum_buffer: Tensor, *,
                momentum: float, lr: float, weight_decay: float, beta2: float, ns_steps: int,
                bf16: bool = False) -> None:
    """nanochat's Muon step on a stack [k, rows, cols] of same-shape matrices, in place.

    `grads` is overwritten. `lr` is the group's; the max(1, rows / cols) ** 0.5 shape scaling is
    applied here. Successive scalings of the whole stack are folded into one in-place multiply each
    (same arithmetic up to rounding): on CPU a pass over the stack costs more than the small
    per-row statistics that let it be skipped.
    """
    rows, cols = params.shape[-2:]
    # Nesterov momentum: update the buffer, then step along the gradient pulled towards it
    momentum_buffer.lerp_(grads, 1 - momentum)
    x = grads.lerp_(momentum_buffer, momentum)

    # bf16 (`bf16`: where the model computes in bf16) is fast, and the iteration only needs singular
    # values near 1; fp16's exponent range is too narrow, so any other compute dtype keeps the
    # parameter dtype.
    if bf16:
        x = x.bfloat16()
    # MuonEq (scale every row to the mean row norm, so the spectrum entering the iteration is better
    # conditioned), then normalise the Frobenius norm to just under 1 so every singular value is in range
    row_norm = _at_least_fp32(x).norm(dim=-1, keepdim=True)
    mean_row_norm = row_norm.square().sum(dim=-2, keepdim=True).sqrt() / rows**0.5
    row_scale = mean_row_norm / row_norm.clamp_min(1e-6)
    frobenius = (row_norm * row_scale).square().sum(dim=-2, keepdim=True).sqrt()
    x.mul_((row_scale / (frobenius * 1.01 + 1e-6)).to(x.dtype))
    # Polar Express: X <- a X + b (X X^T) X + c (X X^T)^2 X drives every singular value towards 1
    # (the orthogonal polar factor); the Gram matrix is formed on the smaller side
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        if rows > cols:
            gram = torch.bmm(x.mT, x)
            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), beta=a)
        else:
            gram = torch.bmm(x, x.mT)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    update = x.to(params.dtype)

    # Muon+: the Frobenius norm snaps to sqrt(min(rows, cols)), that of an exactly semi-orthogonal
    # matrix, correcting the iteration's under-convergence. NorMuon: then each row (column if wide) is
    # scaled by the inverse root of an EMA of its mean squared update, and the overall norm restored.
    reduce_dim = -1 if rows >= cols else -2
    reduce_size = update.size(reduce_dim)
    mean_sq = _at_least_fp32(update).norm(dim=reduce_dim, keepdim=True).square() / reduce_size
    frobenius = (mean_sq.sum(dim=(-2, -1), keepdim=True) * reduce_size).sqrt()
    renorm = min(rows, cols) ** 0.5 / frobenius.clamp_min(1e-6)
    mean_sq = mean_sq * renorm.square()  # statistics of the renormalised update
    norm_before = (mean_sq.sum(dim=(-2, -1), keepdim=True) * reduce_size).sqrt()
    second_momentum_buffer.lerp_(mean_sq.to(second_momentum_buffer.dtype), 1 - beta2)
    step_size = second_momentum_buffer.clamp_min(1e-10).rsqrt()
    scaled_sq = mean_sq * reduce_size * _at_least_fp32(step_size).square()
    norm_after = scaled_sq.sum(dim=(-2, -1), keepdim=True).sqrt()
    update.mul_((renorm * step_size * (norm_before / norm_after.clamp_min(1e-10))).to(update.dtype))

    # Cautious weight decay (only where update and weight agree in sign), then the step
    lr = lr * max(1.0, rows / cols) ** 0.5
    agree = (update * params) >= 0
    params.sub_(update.addcmul_(params, agree, value=weight_decay), alpha=lr)

