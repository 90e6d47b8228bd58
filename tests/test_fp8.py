"""FP8 training through torchao, in its emulation on CPU (the same conversion as on an H100): which
modules convert (nanochat's size rule, blocks only), a tiny model learns, evaluation runs without
float8, and checkpoints move freely between --fp8 and plain runs."""

import math

import pytest
import torch
from tiny_training import adamw_losses

from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.sharded import save_checkpoint
from raychat.model.gpt import GPTConfig, build_model
from raychat.model.precision import Precision

pytest.importorskip("torchao")  # the fp8 extra (in dev too)

from raychat.model.fp8 import TrainingFloat8Linear  # noqa: E402

pytestmark = pytest.mark.unit

# width 128: the attention and MLP matrices (128x128, 128x512) pass nanochat's rule (multiples of
# 16, both sides >= 128); c_k/c_v are 128 -> 64 with GQA (2 kv heads of 32) and stay plain, as do
# the gates (12 -> 2, 24 -> 1), the embeddings and lm_head.
CONFIG = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=128,
                   window_pattern="L")


def fp8_model(recipe="tensorwise", seed=0):
    torch.manual_seed(seed)
    return build_model(CONFIG, "cpu", Precision(torch.float32, recipe, fp8_emulate=True))


def test_converts_the_blocks_large_linears_only():
    model = fp8_model()
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, TrainingFloat8Linear))
    want = sorted(f"transformer.h.{i}.{name}" for i in range(2)
                  for name in ("attn.c_q", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert converted == want
    assert not isinstance(model.lm_head, TrainingFloat8Linear)
    assert not isinstance(model.transformer.h[1].attn.ve_gate, TrainingFloat8Linear)


def test_state_dict_is_the_plain_models(tmp_path):
    plain = build_model(CONFIG, "cpu")
    model = fp8_model()
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tiny_model_learns_in_fp8(recipe):
    model = fp8_model(recipe)
    batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = batch[:, :-1], batch[:, 1:]
    losses = adamw_losses(model, x, y, steps=12, lr=1e-2)
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)  # nanochat's init: uniform logits
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters())  # every parameter takes part


def test_training_mode_rounds_to_fp8_and_eval_mode_does_not():
    """Float8 rounding changes a matmul's result (e4m3 keeps 3 mantissa bits); eval mode (how the
    worker evaluates and samples) gives the plain model's logits exactly."""
    model, plain = fp8_model(), build_model(CONFIG, "cpu")
    plain.load_state_dict(model.state_dict())
    for block in model.transformer.h:  # non-zero output projections, so the blocks matter
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.1)
    plain.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = model(x)
        model.eval()
        plain.eval()
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert (trained - plain(x)).abs().amax() > 1e-4


META = CheckpointMeta(step=1, model_config=GPTConfig()).to_json()


def test_checkpoints_load_with_and_without_fp8(tmp_path):
    fp8 = fp8_model(seed=1)
    save_checkpoint(tmp_path / "from_fp8", fp8.state_dict(), None, META)
    plain = build_model(CONFIG, "cpu")
    plain.load_state_dict(load_checkpoint(tmp_path / "from_fp8", load_optimizer=False)[0], strict=True)
    for name, tensor in fp8.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name

    torch.manual_seed(2)
    source = build_model(CONFIG, "cpu")
    save_checkpoint(tmp_path / "from_plain", source.state_dict(), None, META)
    target = fp8_model(seed=3)
    target.load_state_dict(load_checkpoint(tmp_path / "from_plain", load_optimizer=False)[0], strict=True)
    assert torch.equal(target.transformer.h[0].mlp.c_fc.weight, source.transformer.h[0].mlp.c_fc.weight)
    assert isinstance(target.transformer.h[0].mlp.c_fc, TrainingFloat8Linear)
