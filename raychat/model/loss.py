"""lm_head + logit soft-cap + cross-entropy, computed a chunk of rows at a time.

Why: run eagerly, the plain chain (lm_head -> /cap -> tanh -> *cap -> log_softmax, then their
gradients) materialises a dozen fp32 tensors of [rows, vocab], 537 MB each at d4 with B=8, T=512 and
vocab 32,768. glibc serves blocks over 32 MB with mmap and unmaps them on free, so every step page-
faults gigabytes back in, and an eager CPU step spent much of its time in the kernel doing so
(bench/RESULTS.md, "Step").

Here the rows pass in chunks (512 at vocab 32,768: 64 MB of fp32 logits) through two or three
buffers allocated once per call and overwritten in place, so a step faults in those buffers only.
When gradients are needed they are computed in the same pass, while the chunk's softmax is at hand:
dL/dx chunk by chunk, dL/dW summed in fp32 across chunks. Backward then only scales the two saved
gradients by grad_output: nothing of [rows, vocab] survives the forward, and nothing is recomputed.
Same loss and gradients as the plain chain to fp32 rounding (tests/test_model.py compares the two);
what it does to a step's speed and memory: bench/RESULTS.md, "Step".

torch.compile fuses the plain chain by itself, so compiled graphs keep it (raychat.model.gpt decides).
"""

import torch
from torch import Tensor

CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk: 512 rows at vocab 32,768
MAX_SOFTCAP = 40.0        # exp(+-cap) times the vocab size must stay within fp32's normal range


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk such that a chunk's fp32 logits take about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def _chunk(x: Tensor, weight: Tensor, targets: Tensor, softcap: float, want_grad: bool,
           logits_buf: Tensor, t_buf: Tensor, exp_buf: Tensor) -> tuple[Tensor, Tensor | None]:
    """One chunk of n rows: per-row losses [n] (fp32, 0 at ignored rows) and, when want_grad,
    dL/dz [n, V] in x's dtype (z: the uncapped logits), 0 on ignored rows. `weight` is the [V, C]
    lm_head slice in x's dtype; the three buffers are reused from chunk to chunk (fresh [n, V]
    tensors per chunk would bring the page faults back)."""
    n = x.size(0)
    logits = torch.mm(x, weight.t(), out=logits_buf[:n])
    t = logits if logits.dtype == torch.float32 else t_buf[:n].copy_(logits)
    t.div_(softcap).tanh_()  # capped logits = cap * t
    # The capped logits lie in [-cap, cap], so exp(capped) neither overflows nor underflows in fp32
    # (cap <= MAX_SOFTCAP): no running max as in logsumexp, and one exp pass serves both the loss
    # and the softmax.
    exp_capped = torch.mul(t, softcap, out=exp_buf[:n]).exp_()
    sum_exp = exp_capped.sum(dim=1)
    valid = targets != -1
    target_col = torch.where(valid, targets, 0)[:, None]
    target_logit = softcap * t.gather(1, target_col)[:, 0]
    losses = (sum_exp.log() - target_logit) * valid
    if not want_grad:
        return losses, None
    # dL/dcapped = softmax - onehot(target), zeroed on ignored rows by folding `valid` into the
    # softmax's per-row scale (no extra pass over [n, V]); dcapped/dz = 1 - t^2 (cap and 1/cap cancel).
    grad = exp_capped.mul_((valid / sum_exp)[:, None])
    grad.scatter_add_(1, target_col, -valid[:, None].to(grad.dtype))
    torch.ops.aten.tanh_backward.grad_input(grad, t, grad_input=grad)
    return losses, grad if grad.dtype == x.dtype else logits.copy_(grad)


def _losses_and_grads(x: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, softcap: float,
                      want_grad: bool, chunk_rows: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-row losses [N] and, when want_grad, dL/dx [N, C] (x's dtype) and dL/dW [Vpad, C] (fp32)
    of the summed loss."""
    assert softcap <= MAX_SOFTCAP, f"softcap {softcap} too large for the unshifted exp in _chunk"
    # Padded vocab rows are never used: slicing W (contiguous rows) also skips their matmul work.
    w = weight[:vocab_size].to(x.dtype)
    n = min(chunk_rows, x.size(0))
    t_buf = torch.empty(n, vocab_size, dtype=torch.float32, device=x.device)
    exp_buf = torch.empty_like(t_buf)
    logits_buf = t_buf if x.dtype == torch.float32 else torch.empty_like(t_buf, dtype=x.dtype)
    losses = torch.empty(x.size(0), dtype=torch.float32, device=x.device)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_grad else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_grad else None
    for start in range(0, x.size(0), chunk_rows):
        rows = slice(start, start + chunk_rows)
        x_chunk = x[rows]
        losses[rows], grad = _chunk(x_chunk, w, targets[rows], softcap, want_grad, logits_buf, t_buf, exp_buf)
        if grad is None:
            continue
        torch.mm(grad, w, out=grad_x[rows])
        if grad.dtype == torch.float32:
            grad_w[:vocab_size].addmm_(grad.t(), x_chunk)
        else:  # bf16/fp16 compute: the chunk's product in that dtype, the running sum in fp32
            grad_w[:vocab_size] += grad.t() @ x_chunk
    return losses, grad_x, grad_w


class _SummedLoss(torch.autograd.Function):
    """Summed loss whose gradients are computed in the forward and scaled in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, softcap: float,
                chunk_rows: int) -> Tensor:
        losses, grad_x, grad_w = _losses_and_grads(x, weight, targets, vocab_size, softcap, True, chunk_rows)
        ctx.save_for_backward(grad_x, grad_w)
        return losses.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable  # the saved gradients are constants: no double backward
    def backward(ctx, grad_output: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_output, grad_w * grad_output, None, None, None, None


def softcapped_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, softcap: float,
                             reduction: str = "mean", chunk_rows: int | None = None) -> Tensor:
    """F.cross_entropy(cap * tanh((x @ W.T)[:, :vocab_size].float() / cap), targets, ignore_index=-1,
    reduction=reduction), without materialising the [N, vocab_size] logits.

    x: [N, C] hidden states in the compute dtype; weight: [Vpad, C] lm_head master weight (fp32, cast
    to x's dtype for the matmuls); targets: [N] int64, -1 = ignore. "mean" averages over counted
    rows, "sum" adds them, "none" returns [N] fp32 with 0 at ignored rows. Gradients reach x and
    weight for "sum" and "mean"; "none" is for evaluation and refuses to run where a gradient is
    needed (per-row grad_outputs do not factor out of dL/dW)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    chunk_rows = chunk_rows or chunk_rows_for(vocab_size)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction == "none":
        if needs_grad:
            raise ValueError("reduction='none' has no fused backward: run it under torch.no_grad()")
        return _losses_and_grads(x, weight, targets, vocab_size, softcap, False, chunk_rows)[0]
    if needs_grad:
        total = _SummedLoss.apply(x, weight, targets, vocab_size, softcap, chunk_rows)
    else:
        total = _losses_and_grads(x, weight, targets, vocab_size, softcap, False, chunk_rows)[0].sum()
    return total if reduction == "sum" else total / (targets != -1).sum()
