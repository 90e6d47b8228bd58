"""A few plain AdamW steps on one batch: how the model tests check that something learns."""

import torch


def adamw_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
                 step_model: torch.nn.Module | None = None) -> list[float]:
    """The loss before each of `steps` AdamW updates of `model` (run through `step_model`, e.g. its
    compiled version, when given)."""
    forward = step_model if step_model is not None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)  # before, so the last step's gradients stay to inspect
        loss = forward(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
