"""FP8 training (--fp8): the transformer's large matmuls in float8 through torchao, as nanochat does.

nanochat's base_train converts every nn.Linear whose in and out features are multiples of 16 (a
float8 GEMM requirement) and at least 128 (smaller ones gain nothing and lose precision). Its
filter does not name lm_head, and lm_head (n_embd x padded vocab) passes it; raychat converts only
the Linears inside the transformer blocks, so lm_head stays in the run's dtype: the logits feed a
soft-capped cross-entropy that float8 rounding would coarsen, and the fused loss reads lm_head's
weight directly. Embeddings are not Linears, and the gates (12 -> kv heads, 24 -> 1) fail the size
rule, so they stay as they are too.

The converted layers keep the very same fp32 weight Parameters (torchao's from_float shares them),
so the optimizer, its parameter groups and the checkpoints see exactly the modules' plain keys and
fp32 tensors: a checkpoint saved with --fp8 loads without it and the other way round.

Evaluation and sampling run without float8, in the run's dtype (nanochat swaps the modules back for
them): a converted layer runs its float8 path only in training mode, and the worker switches the
model to eval mode for both.
"""

import dataclasses
import logging

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# torchao logs a warning for each of its CUDA kernel libraries a CPU build of torch cannot load;
# none of them is used here (float8 training runs on torch's own _scaled_mm or its emulation)
logging.getLogger("torchao").setLevel(logging.ERROR)
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

MIN_FEATURES = 128
FEATURE_MULTIPLE = 16


class TrainingFloat8Linear(Float8Linear):
    """torchao's Float8Linear in training mode; in eval mode the plain matmul in the input's dtype
    (the fp32 master weight cast to it), like raychat.model.gpt.Linear."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            return super().forward(x)
        return F.linear(x, self.weight.to(dtype=x.dtype))


def converts(module: nn.Module) -> bool:
    """nanochat's rule for a Linear worth running in float8."""
    return (isinstance(module, nn.Linear) and module.in_features % FEATURE_MULTIPLE == 0
            and module.out_features % FEATURE_MULTIPLE == 0
            and min(module.in_features, module.out_features) >= MIN_FEATURES)


def convert_to_fp8(model: nn.Module, recipe: str, emulate: bool) -> list[str]:
    """Swap the large Linears of model.transformer.h for float8 ones in place (before torch.compile
    and before building the optimizer); returns their qualified names."""
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    blocks = model.transformer.h
    converted = []
    for parent_name, parent in list(blocks.named_modules()):
        for name, child in list(parent.named_children()):
            if converts(child) and not isinstance(child, Float8Linear):
                setattr(parent, name, TrainingFloat8Linear.from_float(child, config=config))
                converted.append(f"transformer.h.{parent_name}.{name}")
    return converted
