"""Sampling from a GPT without a KV cache: what the trainer's sample lines and `raychat.sample` need.

Every step re-reads the last sequence_len tokens, so it costs O(T) forwards of up to T tokens: fine
for the few short continuations printed during training, and it keeps the model free of cache code.
The growing length means the model runs with fixed_length=False (no compiled FlexAttention, which
would recompile for every new length).
"""

import torch
import torch.nn.functional as F

from raychat.common import RaychatError
from raychat.model.gpt import GPT

# nanochat's seven prompts: cheap, human-readable evidence that the model is learning.
SAMPLE_PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
    "My favorite color is",
    "If 5*x + 3 = 13, then x is",
]


@torch.no_grad()
def generate(model: GPT, tokens: list[int], max_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 42) -> list[int]:
    """Sample `max_tokens` continuation tokens of the prompt `tokens`: greedy when temperature is 0,
    else from softmax(logits / temperature), optionally restricted to the top_k logits."""
    if not tokens:
        raise RaychatError("generate needs a prompt of at least one token (e.g. the BOS token)")
    device = model.transformer.wte.weight.device
    rng = torch.Generator(device=device)
    rng.manual_seed(seed)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    new_tokens = []
    for _ in range(max_tokens):
        logits = model(ids[:, -model.config.sequence_len:], fixed_length=False)[:, -1, :]
        if top_k is not None and top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if temperature > 0:
            next_id = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=rng)
        else:
            next_id = logits.argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
        new_tokens.append(int(next_id.item()))
    return new_tokens
