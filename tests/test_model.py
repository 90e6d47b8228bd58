"""The GPT: shapes and parameter counts worked out by hand (seed 001's d12), nanochat's init,
the loss contract, the chunked loss against the plain chain, causality and sliding windows,
precision, generation, optimizer sets, FLOPs per token (nanochat's d12 figure and by hand)."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_training import adamw_losses

from raychat.common import RaychatError
from raychat.model.attention import layer_masks
from raychat.model.generate import generate
from raychat.model.gpt import (
    GPT,
    LOGIT_SOFTCAP,
    GPTConfig,
    build_model,
    gpt_config,
    has_value_embedding,
    window_sizes,
)
from raychat.model.loss import softcapped_cross_entropy
from raychat.model.precision import Precision


def tiny_config(**overrides) -> GPTConfig:
    values = dict(sequence_len=32, vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
                  window_pattern="SL")
    values.update(overrides)
    return GPTConfig(**values)


def tiny_model(seed=0, precision=None, **overrides) -> GPT:
    torch.manual_seed(seed)
    return build_model(tiny_config(**overrides), "cpu", precision)


# --- configuration -------------------------------------------------------------------------------

@pytest.mark.unit
def test_gpt_config_d12_seed001():
    cfg = gpt_config(depth=12, aspect_ratio=64, head_dim=128, max_seq_len=2048, vocab_size=32768,
                     window_pattern="L")
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd) == (12, 6, 6, 768)
    assert (cfg.sequence_len, cfg.vocab_size, cfg.head_dim) == (2048, 32768, 128)


@pytest.mark.unit
def test_gpt_config_rounds_width_up_to_head_dim():
    cfg = gpt_config(5, 64, 128, 512, 1000, "L")     # 5 * 64 = 320 -> 384 = 3 heads of 128
    assert (cfg.n_embd, cfg.n_head) == (384, 3)
    cfg = gpt_config(20, 64, 128, 2048, 32768, "SSSL")  # 1280 is already a multiple: 10 heads
    assert (cfg.n_embd, cfg.n_head) == (1280, 10)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,flag", [
    (dict(depth=0), "--depth"),
    (dict(aspect_ratio=0), "--aspect-ratio"),
    (dict(head_dim=0), "--head-dim"),
    (dict(head_dim=63), "--head-dim"),
    (dict(head_dim=-2), "--head-dim"),
    (dict(max_seq_len=0), "--max-seq-len"),
    (dict(vocab_size=0), "--vocab-size"),
    (dict(window_pattern="SXL"), "--window-pattern"),
    (dict(window_pattern=""), "--window-pattern"),
    (dict(depth=1, aspect_ratio=8, head_dim=16), "--aspect-ratio"),  # width 16 < the smear gate's 24
])
def test_gpt_config_rejects_bad_input(kwargs, flag):
    args = dict(depth=4, aspect_ratio=64, head_dim=64, max_seq_len=512, vocab_size=1000, window_pattern="L")
    args.update(kwargs)
    with pytest.raises(RaychatError, match=flag) as err:
        gpt_config(**args)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_bad_gqa_is_rejected():
    with pytest.raises(RaychatError, match="n_kv_head"):
        GPT(tiny_config(n_kv_head=3))


@pytest.mark.unit
def test_window_sizes():
    # T=2048: S = 2048/4 = 512 (already a multiple of 128); SSSL tiled over 12 layers, last forced L
    assert window_sizes(GPTConfig(sequence_len=2048, n_layer=12, window_pattern="SSSL")) == \
        [512, 512, 512, 2048] * 3
    # T=1000: 1000/4 = 250 rounds up to 256; pattern S everywhere but the last layer
    assert window_sizes(GPTConfig(sequence_len=1000, n_layer=5, window_pattern="S")) == [256] * 4 + [1000]
    # T=512: S = 128; lower-case pattern accepted; "LS" on 4 layers is L S L S -> last becomes L
    assert window_sizes(GPTConfig(sequence_len=512, n_layer=4, window_pattern="ls")) == [512, 128, 512, 512]


@pytest.mark.unit
def test_value_embedding_layers_alternate_from_the_last():
    assert [i for i in range(12) if has_value_embedding(i, 12)] == [1, 3, 5, 7, 9, 11]
    assert [i for i in range(5) if has_value_embedding(i, 5)] == [0, 2, 4]


# --- parameter counts ----------------------------------------------------------------------------

@pytest.mark.unit
def test_d12_parameter_count_by_hand():
    cfg = gpt_config(12, 64, 128, 2048, 32768, "L")
    with torch.device("meta"):
        model = GPT(cfg)
    V, C, L, H = 32768, 768, 12, 6          # vocab (already a multiple of 64), width, layers, heads
    kv = H * 128                             # n_kv_head * head_dim
    n_ve_layers = 6                          # layers 1, 3, 5, 7, 9, 11
    wte = V * C
    lm_head = C * V
    value_embeds = n_ve_layers * V * kv
    per_layer = C * C + 2 * C * kv + C * C + C * 4 * C + 4 * C * C   # q, k+v, proj, fc, mlp proj
    ve_gates = n_ve_layers * 12 * H          # 12 input channels -> one gate per kv head
    transformer_matrices = L * per_layer + ve_gates
    scalars = L + L + 24 + 1 + 1             # resid, x0, smear gate (24 -> 1), smear lambda, backout
    counts = model.num_scaling_params()
    assert counts == {"wte": wte, "value_embeds": value_embeds, "lm_head": lm_head,
                      "transformer_matrices": transformer_matrices, "scalars": scalars,
                      "total": wte + value_embeds + lm_head + transformer_matrices + scalars}
    assert counts["total"] == 286_261_730    # seed 001: 总参数量 286,261,730


@pytest.mark.unit
def test_vocab_is_padded_to_64_and_logits_sliced_back():
    model = tiny_model(vocab_size=100)
    assert model.transformer.wte.weight.shape[0] == 128 and model.lm_head.weight.shape[0] == 128
    assert model(torch.randint(0, 100, (2, 8))).shape == (2, 8, 100)


# --- construction and init -----------------------------------------------------------------------

@pytest.mark.unit
def test_meta_build_then_init_is_finite_fp32_and_on_device():
    model = tiny_model()
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    logits = model(torch.randint(0, 100, (2, 32)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert logits.abs().max() < 15  # soft cap


@pytest.mark.integration  # a subprocess
def test_building_a_model_imports_no_sympy():
    """Every worker builds its model at each start: `materialize` keeps PyTorch's meta-tensor path,
    which imports sympy (1-2 s of a start on 2 cores), out of it. A fresh process, as a worker is."""
    code = ("import sys, torch; from raychat.model.gpt import build_model, GPTConfig; "
            "build_model(GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=2, "
            "n_embd=32), 'cpu'); print('sympy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.unit
def test_init_is_deterministic_under_seed():
    a, b = tiny_model(seed=1).state_dict(), tiny_model(seed=1).state_dict()
    c = tiny_model(seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])


@pytest.mark.unit
def test_init_values_follow_nanochat():
    model = tiny_model(n_layer=3, n_embd=32)
    torch.testing.assert_close(model.resid_lambdas, torch.tensor([1.15, 1.10, 1.05]))
    torch.testing.assert_close(model.x0_lambdas, torch.tensor([0.20, 0.125, 0.05]))
    assert model.smear_lambda.item() == 0.0 and model.backout_lambda.item() == pytest.approx(0.2)
    s = math.sqrt(3 / 32)
    for block in model.transformer.h:
        assert block.attn.c_proj.weight.abs().max() == 0 and block.mlp.c_proj.weight.abs().max() == 0
        assert 0.9 * s < block.attn.c_q.weight.abs().max() <= s
        assert 0.9 * 0.4 * s < block.mlp.c_fc.weight.abs().max() <= 0.4 * s
    gate = model.transformer.h[2].attn.ve_gate.weight
    assert gate.min() >= 0 and gate.max() <= 0.02 and gate.shape == (2, 12)
    assert model.transformer.h[1].attn.ve_gate is None
    assert 0.5 < model.transformer.wte.weight.std() < 1.1


@pytest.mark.unit
def test_loss_at_init_is_ln_vocab():
    model = tiny_model(vocab_size=512)
    x = torch.randint(0, 512, (4, 32))
    assert model(x, x).item() == pytest.approx(math.log(512), abs=0.02)


# --- forward contract ----------------------------------------------------------------------------

@pytest.mark.unit
def test_loss_reductions_and_ignore_index():
    model = tiny_model()
    x = torch.randint(0, 100, (3, 16))
    y = torch.randint(0, 100, (3, 16))
    y[0, :5] = -1
    y[2, 10:] = -1
    per_position = model(x, y, loss_reduction="none")
    assert per_position.shape == y.shape
    assert (per_position[y == -1] == 0).all() and (per_position[y != -1] > 0).all()
    total = model(x, y, loss_reduction="sum")
    torch.testing.assert_close(total, per_position.sum())
    torch.testing.assert_close(model(x, y), total / (y != -1).sum())
    # the loss is the cross-entropy of the returned logits
    logits = model(x)
    manual = -torch.log_softmax(logits[1, 3], dim=-1)[y[1, 3]]
    torch.testing.assert_close(per_position[1, 3], manual)


@pytest.mark.unit
def test_causal_including_smear_and_value_embeddings():
    model = tiny_model(window_pattern="L")
    x = torch.randint(0, 100, (1, 20))
    changed = x.clone()
    changed[0, 12] = (x[0, 12] + 1) % 100
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 0


@pytest.mark.unit
def test_sliding_window_only_changes_positions_beyond_the_window():
    # T = 256: S windows are 256/4 = 64 -> rounded up to 128. Same weights, pattern S vs L.
    torch.manual_seed(0)
    windowed = build_model(tiny_config(sequence_len=256, n_layer=2, window_pattern="S"), "cpu")
    full = build_model(tiny_config(sequence_len=256, n_layer=2, window_pattern="L"), "cpu")
    full.load_state_dict(windowed.state_dict())
    assert windowed.window_sizes == [128, 256]
    # zero-init output projections would hide attention entirely; give them weights
    with torch.no_grad():
        for model in (windowed, full):
            for block in model.transformer.h:
                block.attn.c_proj.weight.copy_(windowed.transformer.h[0].attn.c_q.weight)
    x = torch.randint(0, 100, (2, 256))
    a, b = windowed(x), full(x)
    torch.testing.assert_close(a[:, :129], b[:, :129])       # query i <= 128 sees its whole prefix anyway
    assert (a[:, 129:] - b[:, 129:]).abs().max() > 1e-4


@pytest.mark.unit
def test_sequence_beyond_rotary_cache_fails_clearly():
    model = tiny_model(sequence_len=4)
    assert model(torch.zeros(1, 40, dtype=torch.long)).shape == (1, 40, 100)  # 10 x sequence_len is fine
    with pytest.raises(RaychatError, match="rotary cache of 40 positions.*--max-seq-len"):
        model(torch.zeros(1, 41, dtype=torch.long))


@pytest.mark.unit
def test_training_steps_lower_the_loss():
    model = tiny_model(vocab_size=64)
    batch = torch.randint(0, 64, (4, 33))
    losses = adamw_losses(model, batch[:, :-1], batch[:, 1:], steps=15, lr=1e-2)
    assert losses[0] == pytest.approx(math.log(64), abs=0.02)
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters())  # every parameter takes part


# --- the chunked loss (raychat.model.loss) against the plain chain --------------------------------
# Direct tests: 37 rows in chunks of 8 (the last chunk has 5 rows), vocab 100 padded to 128, every
# 5th row and all of rows 8-15 (a whole chunk) ignored; weights scaled so |logits| reach ~40 and the
# soft cap is really at work. Tolerances: fused and plain differ only in summation order and in
# exp(capped) / sum versus log_softmax, so both sit within a few fp32 ulps of the exact float64 math
# (measured: <= 3e-7 of the largest value); asserted: 5e-6 of the largest value, rtol 1e-5.

def fused_loss_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g).to(dtype)
    weight = torch.randn(128, 16, generator=g) * 2.0   # the fp32 master weight, padded rows included
    targets = torch.randint(0, 100, (37,), generator=g)
    targets[::5] = -1
    targets[8:16] = -1
    return x, weight, targets


def plain_loss(x, weight, targets, reduction):
    """GPT.forward's chain without the fused loss: matmul in x's dtype, fp32 from the logits on."""
    logits = F.linear(x, weight.to(x.dtype))[:, :100].float()
    logits = LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


def exact_loss(x, weight, targets, reduction):
    """The same math in float64 throughout."""
    logits = F.linear(x.double(), weight.double())[:, :100]
    logits = LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


def fused_loss(x, weight, targets, reduction):
    return softcapped_cross_entropy(x, weight, targets, 100, LOGIT_SOFTCAP, reduction, chunk_rows=8)


def loss_and_grads(loss_fn, x, weight, targets, reduction):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(x, weight, targets, reduction)
    loss.backward()
    return loss.detach(), x.grad, weight.grad


def assert_close_to(got, want, rtol=1e-5, scale=5e-6):
    torch.testing.assert_close(got.to(want.dtype), want, rtol=rtol, atol=scale * want.abs().max().item())


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_loss_and_grads_match_plain_chain_and_exact_math(reduction, dtype):
    x, weight, targets = fused_loss_inputs(dtype)
    loss, grad_x, grad_w = loss_and_grads(fused_loss, x, weight, targets, reduction)
    assert (loss.dtype, grad_x.dtype, grad_w.dtype) == (torch.float32, dtype, torch.float32)
    assert grad_w.shape == (128, 16) and (grad_w[100:] == 0).all()   # padded vocab rows get nothing
    assert (grad_x[targets == -1] == 0).all() and (grad_x[targets != -1] != 0).all()
    for want in (loss_and_grads(plain_loss, x, weight, targets, reduction),
                 loss_and_grads(exact_loss, x.double(), weight.double(), targets, reduction)):
        for got, expected in zip((loss, grad_x, grad_w), want, strict=True):
            assert_close_to(got, expected)
    # counted rows: 37 minus rows 0, 5, ..., 35 (8) minus rows 8-15 (8), rows 10 and 15 being in both
    assert (targets != -1).sum() == 37 - 8 - 8 + 2
    if reduction == "mean":   # the mean is over counted rows only
        assert loss.item() == pytest.approx(fused_loss(x, weight, targets, "sum").item() / 23, rel=1e-6)


@pytest.mark.unit
def test_fused_loss_none_is_per_row_and_evaluation_only():
    x, weight, targets = fused_loss_inputs(torch.float32)
    with torch.no_grad():
        per_row = fused_loss(x, weight, targets, "none")
        total = fused_loss(x, weight, targets, "sum")
    assert per_row.shape == (37,)
    assert (per_row[targets == -1] == 0).all() and (per_row[targets != -1] > 0).all()
    assert_close_to(per_row, plain_loss(x, weight, targets, "none"))
    assert_close_to(per_row, exact_loss(x, weight, targets, "none"))
    assert_close_to(total, per_row.sum())
    with pytest.raises(ValueError, match="no_grad"):     # per-row grad_outputs do not factor out of dL/dW
        fused_loss(x.requires_grad_(), weight, targets, "none")
    with pytest.raises(ValueError, match="reduction"):
        fused_loss(x, weight, targets, "max")


@pytest.mark.unit
def test_fused_loss_bf16_compute():
    # bf16 matmuls as on CUDA: dx in bf16, dW in fp32. The fused dW adds bf16 per-chunk products in
    # fp32, the plain one rounds one bf16 product: both within bf16 rounding (2^-8) of each other.
    x, weight, targets = fused_loss_inputs(torch.bfloat16)
    loss, grad_x, grad_w = loss_and_grads(fused_loss, x, weight, targets, "sum")
    assert (loss.dtype, grad_x.dtype, grad_w.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    want = loss_and_grads(plain_loss, x, weight, targets, "sum")
    for got, expected in zip((loss, grad_x, grad_w), want, strict=True):
        assert_close_to(got, expected, rtol=1e-2, scale=1e-2)


@pytest.mark.unit
def test_gpt_fused_and_plain_loss_give_the_same_parameter_grads(monkeypatch):
    """A tiny GPT's loss.backward() through the fused loss (the eager default) and through the plain
    chain (RAYCHAT_FUSED_CE=0): same loss, same gradient for every parameter."""
    calls = []

    def counting_loss(*args, **kwargs):
        calls.append(args[-1])
        return softcapped_cross_entropy(*args, **kwargs)

    monkeypatch.setattr("raychat.model.gpt.softcapped_cross_entropy", counting_loss)
    torch.manual_seed(0)
    x = torch.randint(0, 100, (3, 16))
    y = torch.randint(0, 100, (3, 16))
    y[0, :5] = -1
    y[2, 10:] = -1
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("RAYCHAT_FUSED_CE", fused)
        model = tiny_model(vocab_size=100)      # padded to 128
        # nanochat's init zeroes the output projections, which leaves most gradients exactly 0 (and
        # the lambdas' rounding noise): random weights make every gradient real; lm_head's reach the cap
        torch.manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn_like(param) * 0.5)
            model.lm_head.weight.mul_(2)
        loss = model(x, y)
        loss.backward()
        with torch.no_grad():
            per_position = model(x, y, loss_reduction="none")
        results[fused] = (loss.detach(), per_position, {n: p.grad for n, p in model.named_parameters()})
    assert calls == ["mean", "none"]            # the fused path ran only with RAYCHAT_FUSED_CE=1
    (loss, per_position, grads), (want_loss, want_per_position, want_grads) = results["1"], results["0"]
    assert_close_to(loss, want_loss)
    assert_close_to(per_position, want_per_position)
    assert per_position.shape == (3, 16) and (per_position[y == -1] == 0).all()
    assert grads.keys() == want_grads.keys()
    # 3 layers of random weights amplify fp32 rounding: measured up to 1.2e-5 of a tensor's largest
    # gradient (8 runs); a wrong gradient anywhere in the head would be off by O(1)
    for name, grad in grads.items():
        assert grad.abs().max() > 1e-4, name
        assert_close_to(grad, want_grads[name], rtol=1e-4, scale=1e-4)


# --- precision -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_bf16_compute_keeps_fp32_weights_and_logits():
    x = torch.randint(0, 100, (2, 16))
    reference = tiny_model()(x, x)
    assert reference.dtype == torch.float32 and tiny_model().compute_dtype == torch.float32  # auto on CPU
    model = tiny_model(precision=Precision(torch.bfloat16, None, False))
    assert model.compute_dtype == torch.bfloat16 and model.cos.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model(x).dtype == torch.float32
    loss = model(x, x)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert loss.item() == pytest.approx(reference.item(), abs=0.02)


# --- optimizer sets, flops, generation -----------------------------------------------------------

@pytest.mark.unit
def test_optimizer_param_sets_cover_every_parameter_once():
    model = tiny_model(n_layer=4)
    sets = model.optimizer_param_sets()
    assert list(sets) == ["lm_head", "embedding", "value_embeds", "resid", "x0", "smear", "matrix"]
    ids = [id(p) for params in sets.values() for p in params]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert set(ids) == {id(p) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in sets["smear"]] == ["smear_gate.weight", "smear_lambda", "backout_lambda"]
    assert all(names[id(p)].startswith("transformer.h.") for p in sets["matrix"])
    assert any(names[id(p)].endswith("ve_gate.weight") for p in sets["matrix"])
    assert [names[id(p)] for p in sets["value_embeds"]] == ["value_embeds.1.weight", "value_embeds.3.weight"]


def meta_model(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


@pytest.mark.unit
def test_estimate_flops_d12_is_nanochats_figure():
    # nanochat's GPT.estimate_flops for d12, window L, head_dim 128, vocab 32768, T 2048 (its base_train
    # prints "Estimated FLOPs per token: 8.870980e+08"): 887,098,032. By hand: the matmul weights are
    # 12 layers x 12 C^2 (q, k, v, proj = 4 C^2; MLP 8 C^2) = 84,934,656, six ve gates (12 x 6) = 432,
    # lm_head C x V = 25,165,824, the smear gate 24 x 1 = 24: 110,100,936 x 6 = 660,605,616; attention
    # 12 layers x 12 x H 6 x D 128 x T 2048 = 226,492,416.
    assert meta_model(gpt_config(12, 64, 128, 2048, 32768, "L")).estimate_flops() == 887_098_032
    # SSSL: layers 3, 7, 11 see T = 2048, the other nine a window of 512: attention 12 x 6 x 128 x
    # (9 x 512 + 3 x 2048) = 99,090,432
    assert meta_model(gpt_config(12, 64, 128, 2048, 32768, "SSSL")).estimate_flops() == 759_696_048


@pytest.mark.unit
def test_estimate_flops_tiny_config_by_hand():
    # 2 layers, width 32, 2 query heads of 16, 1 kv head (GQA), vocab 50 padded to 64, T 256, pattern S
    # -> windows [128 (256 / 4 rounded up to 128), 256 (the last layer is always L)].
    # per layer: c_q 32x32 = 1,024, c_k 32x16 = 512, c_v 512, c_proj 1,024, c_fc 32x128 = 4,096,
    #   mlp c_proj 4,096: 11,264; x 2 layers = 22,528
    # ve gate on layer 1 only: 12 x 1 = 12; lm_head 32 x 64 (padded) = 2,048; smear gate 24
    # matmul weights 24,612 x 6 = 147,672; attention 12 x 2 x 16 x (128 + 256) = 147,456
    config = GPTConfig(sequence_len=256, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                       window_pattern="S")
    assert meta_model(config).estimate_flops() == 295_128
    # T 100: the short window (128) is longer than the sequence and counts T: 12 x 2 x 16 x (100 + 100)
    config.sequence_len = 100
    assert meta_model(config).estimate_flops() == 147_672 + 76_800


@pytest.mark.unit
def test_generate_greedy_matches_argmax_and_sampling_is_seeded():
    model = tiny_model(sequence_len=8)
    prompt = [1, 2, 3]
    greedy = generate(model, prompt, 5)
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(model(torch.tensor([ids[-8:]]))[0, -1].argmax()))
    assert greedy == ids[3:]
    sampled = generate(model, prompt, 12, temperature=1.0, top_k=5, seed=7)
    assert sampled == generate(model, prompt, 12, temperature=1.0, top_k=5, seed=7)
    assert len(sampled) == 12 and all(0 <= t < 100 for t in sampled)
    # top_k=1 sampling is greedy whatever the temperature
    assert generate(model, prompt, 5, temperature=2.0, top_k=1) == greedy
    # a prompt longer than the context is cropped to the last sequence_len tokens
    assert generate(model, list(range(20)), 3) == generate(model, list(range(12, 20)), 3)


# --- compiled, with FlexAttention, on CPU ---------------------------------------------------------

@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
def test_compiled_flex_forward_matches_eager_sdpa(monkeypatch):
    """The GPU configuration (torch.compile, SSSL through FlexAttention block masks) on CPU against
    the eager masked-SDPA model, same weights and batch. FlexAttention has no CPU backward in torch
    2.13, so this compares losses under no_grad; tests/test_attention.py covers the masks' gradients.
    Tolerance 1e-4 of the loss: both are fp32 sums of the same products in different orders
    (measured differences ~1e-6); a wrong window or mask moves the loss by > 1e-2."""
    config = tiny_config(sequence_len=256, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SSSL")
    model = tiny_model(**{k: getattr(config, k) for k in ("sequence_len", "n_layer", "n_head", "n_kv_head",
                                                          "n_embd", "window_pattern")})
    assert model.window_sizes == [128, 256]  # S = T/4 rounded up to 128; the last layer L
    batch = torch.randint(0, 100, (2, 257), generator=torch.Generator().manual_seed(1))
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        eager = model(x, y).item()
        monkeypatch.setenv("RAYCHAT_ATTENTION", "flex")
        masks = layer_masks(256, model.window_sizes, x.device)
        assert type(masks[0]).__name__ == "BlockMask" and masks[1] is None
        compiled = torch.compile(model, dynamic=False)(x, y).item()
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert abs(eager - math.log(100)) < 0.5  # a real loss, not a constant


@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
def test_compiled_sssl_training_matches_eager():
    """`--compile on --window-pattern SSSL` on CPU, as the trainer runs it there (sliding windows as
    masked SDPA inside the compiled graph; the plain loss chain instead of the fused one): three
    AdamW steps from the same weights give the eager run's losses to 1e-4 relative (fp32, same
    products in another order: measured ~1e-6) and the weights stay close."""
    shape = dict(sequence_len=256, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SSSL")
    batch = torch.randint(0, 100, (2, 257), generator=torch.Generator().manual_seed(2))
    x, y = batch[:, :-1], batch[:, 1:]
    runs = []
    for compiled in (False, True):
        model = tiny_model(**shape)
        step_model = torch.compile(model, dynamic=False) if compiled else model
        losses = adamw_losses(model, x, y, steps=3, lr=3e-3, step_model=step_model)
        runs.append((losses, model.transformer.h[0].attn.c_q.weight.detach().clone()))
    (eager_losses, eager_w), (compiled_losses, compiled_w) = runs
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    assert eager_losses[-1] < eager_losses[0]
    torch.testing.assert_close(compiled_w, eager_w, rtol=0, atol=1e-4)


@pytest.mark.unit
def test_a_model_built_on_a_real_device_and_given_weights_computes_what_the_original_does():
    """build_model builds shapes on meta and init_weights fills every value, derived buffers too; a
    model built straight on the CPU (outside code, a notebook) and given a state dict has no
    init_weights call, so it must compute its rotary tables itself (they are never in a state dict)."""
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                       window_pattern="SL")
    copy = GPT(config)
    torch.manual_seed(0)
    original = build_model(config, "cpu", Precision(torch.float32, None, False))
    copy.load_state_dict(original.state_dict(), strict=True)
    x = torch.randint(0, 64, (2, 32))
    assert torch.equal(copy.cos, original.cos) and torch.equal(copy.sin, original.sin)
    assert torch.equal(copy(x), original(x))
