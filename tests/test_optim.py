"""MuonAdamW in one process: every step against a plain float64 reference written here from the
algorithm's description (one matrix at a time, no stacking, no folded scalings), nanochat's groups
and learning rates on the real GPT, and the canonical state dict."""

import io
import math

import pytest
import torch
import torch.nn as nn

from raychat.common import RaychatError
from raychat.model.gpt import build_model, gpt_config
from raychat.optim.muon import POLAR_EXPRESS_COEFFS
from raychat.optim.muon_adamw import MuonAdamW, build_optimizer

pytestmark = pytest.mark.unit

# ---- the reference ---------------------------------------------------------------------------


def reference_adamw(p, g, state, *, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    state["t"] = state.get("t", 0) + 1
    m = state["m"] = beta1 * state.get("m", torch.zeros_like(p)) + (1 - beta1) * g
    v = state["v"] = beta2 * state.get("v", torch.zeros_like(p)) + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** state["t"])
    v_hat = v / (1 - beta2 ** state["t"])
    return p * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)


def orthogonalise(x, ns_steps):
    """The Polar Express polynomial, always written with X X^T (the optimizer forms the Gram
    matrix on the smaller side: the same polynomial, other rounding)."""
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        xxt = x @ x.T
        x = a * x + b * (xxt @ x) + c * (xxt @ xxt @ x)
    return x


def reference_muon(p, g, state, *, lr, momentum, weight_decay, beta2, ns_steps):
    rows, cols = p.shape
    buf = state["momentum"] = momentum * state.get("momentum", torch.zeros_like(p)) + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * buf  # Nesterov
    # MuonEq: each row rescaled to the root-mean-square row norm
    target = u.norm() / math.sqrt(rows)
    u = torch.stack([u[i] * target / u[i].norm().clamp_min(1e-6) for i in range(rows)])
    x = orthogonalise(u / (u.norm() * 1.01 + 1e-6), ns_steps)
    x = x * math.sqrt(min(rows, cols)) / x.norm().clamp_min(1e-6)  # Muon+
    # NorMuon: per row (per column if wide) inverse-root EMA of the mean square, norm kept
    per_row = rows >= cols
    lines = [x[i] for i in range(rows)] if per_row else [x[:, j] for j in range(cols)]
    mean_sq = torch.stack([line.square().mean() for line in lines])
    v = state["v"] = beta2 * state.get("v", torch.zeros_like(mean_sq)) + (1 - beta2) * mean_sq
    scale = v.clamp_min(1e-10).rsqrt()
    y = x * (scale[:, None] if per_row else scale[None, :])
    y = y * x.norm() / y.norm().clamp_min(1e-10)
    lr = lr * math.sqrt(max(1.0, rows / cols))
    decay = torch.where(y * p >= 0, p, torch.zeros_like(p))  # cautious: only where signs agree
    return p - lr * y - lr * weight_decay * decay


# ---- a small model of every shape kind ---------------------------------------------------------


def toy_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"emb": (40, 30), "head": (30, 40), "gain": (3,),   # AdamW: big, big, small
              "tall.0": (12, 5), "tall.1": (12, 5), "tall.2": (12, 5),  # Muon: 3 tall
              "wide.0": (5, 12), "wide.1": (5, 12), "square.0": (7, 7)}
    return {name: nn.Parameter(torch.randn(*shape, generator=gen, dtype=dtype))
            for name, shape in shapes.items()}


def toy_groups(params):
    def group(kind, names, **hyper):
        return {"kind": kind, "params": [params[n] for n in names], "names": names, **hyper}
    return [
        group("adamw", ["emb", "head"], lr=0.2, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.01),
        group("adamw", ["gain"], lr=0.5, betas=(0.96, 0.95), eps=1e-10, weight_decay=0.05),
        group("muon", ["tall.0", "tall.1", "tall.2"], lr=0.02, momentum=0.95, ns_steps=5, beta2=0.9,
              weight_decay=0.2),
        group("muon", ["wide.0", "wide.1"], lr=0.03, momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=0.2),
        group("muon", ["square.0"], lr=0.04, momentum=0.95, ns_steps=4, beta2=0.8, weight_decay=0.1),
    ]


def schedule(opt, step):
    """Per-step changes as the trainer makes them: lr multiplier, Muon momentum and weight decay."""
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * (1.0 - 0.2 * step)
        if group["kind"] == "muon":
            group["momentum"] = 0.85 + 0.04 * step
            group["weight_decay"] = 0.2 * (1.0 - 0.25 * step)


def random_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def reference_run(params, steps):
    values = {name: p.detach().clone().double() for name, p in params.items()}
    ref_groups = toy_groups(params)
    states = {name: {} for name in params}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        grads = {name: torch.randn(p.shape, generator=gen, dtype=p.dtype).double()
                 for name, p in params.items()}
        for group in ref_groups:
            lr = group["lr"] * (1.0 - 0.2 * step)
            for name in group["names"]:
                if group["kind"] == "adamw":
                    values[name] = reference_adamw(values[name], grads[name], states[name], lr=lr,
                                                   betas=group["betas"], eps=group["eps"],
                                                   weight_decay=group["weight_decay"])
                else:
                    values[name] = reference_muon(values[name], grads[name], states[name], lr=lr,
                                                  momentum=0.85 + 0.04 * step,
                                                  weight_decay=0.2 * (1.0 - 0.25 * step),
                                                  beta2=group["beta2"], ns_steps=group["ns_steps"])
    return values


def optimizer_run(params, steps):
    opt = MuonAdamW(toy_groups(params))
    for step in range(steps):
        random_grads(params, step)
        schedule(opt, step)
        opt.step()
    return opt


@pytest.mark.parametrize("steps", [1, 3])
def test_float64_matches_reference(steps):
    params = toy_params(torch.float64)
    expected = reference_run(params, steps)
    optimizer_run(params, steps)
    for name, p in params.items():
        # float64 throughout: only rounding separates the two (folded scalings, Gram side, fused kernel)
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-12, atol=1e-13, msg=name)


def test_float32_matches_float64_reference():
    params = toy_params(torch.float32)
    expected = reference_run(params, 3)
    optimizer_run(params, 3)
    for name, p in params.items():
        torch.testing.assert_close(p.detach().double(), expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_cautious_weight_decay_only_where_signs_agree():
    """Two runs that differ only in weight decay take the same update; their difference is the decay,
    which must be lr * wd * p exactly where the update and the weight agree in sign, 0 elsewhere."""
    gen = torch.Generator().manual_seed(3)
    p0, grad = (torch.randn(6, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    results = []
    for weight_decay in (0.0, 0.5):
        p = nn.Parameter(p0.clone())
        opt = MuonAdamW([{"kind": "muon", "params": [p], "names": ["p"], "lr": 0.1, "momentum": 0.9,
                          "ns_steps": 5, "beta2": 0.9, "weight_decay": weight_decay}])
        p.grad = grad.clone()
        opt.step()
        results.append(p.detach().clone())
    update = (p0 - results[0]) / 0.1  # square matrix: lr is not shape-scaled
    agree = (update * p0) >= 0
    assert agree.any() and not agree.all()
    torch.testing.assert_close(results[0] - results[1], 0.1 * 0.5 * p0 * agree, rtol=0, atol=1e-12)


def test_polar_express_coefficients_orthogonalise():
    """The five (a, b, c) triples take a Frobenius-normalised matrix whose singular values span two
    decades to one whose singular values are all near 1 (what Muon relies on)."""
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(64, 16), (16, 64), (32, 32)]:
        k = min(rows, cols)
        u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
        g = u @ torch.diag(torch.logspace(0, -2, k, dtype=torch.float64)) @ v.T
        singular_values = torch.linalg.svdvals(orthogonalise(g / (g.norm() * 1.01 + 1e-6), 5))
        assert singular_values.min() > 0.7 and singular_values.max() < 1.2, (rows, cols, singular_values)


def test_missing_gradient_counts_as_zero():
    a, b = toy_params(torch.float64), toy_params(torch.float64)
    opt_a, opt_b = MuonAdamW(toy_groups(a)), MuonAdamW(toy_groups(b))
    random_grads(a, 0)
    random_grads(b, 0)
    for params in (a, b):
        params["gain"].grad = None if params is a else torch.zeros_like(params["gain"])
        params["tall.1"].grad = None if params is a else torch.zeros_like(params["tall.1"])
    opt_a.step()
    opt_b.step()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- state dict ----------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_bitwise():
    params = toy_params(torch.float32)
    opt = optimizer_run(params, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # what a checkpoint holds must load without pickle

    state = saved["state"]
    assert set(state) == set(params)
    assert state["emb"]["step"] == 2 and state["emb"]["exp_avg"].shape == (40, 30)
    assert state["tall.0"]["momentum_buffer"].shape == (12, 5)
    assert state["tall.0"]["second_momentum_buffer"].shape == (12, 1)   # tall: per row
    assert state["wide.0"]["second_momentum_buffer"].shape == (1, 12)   # wide: per column
    assert [g["names"] for g in saved["param_groups"]] == [g["names"] for g in toy_groups(params)]
    assert all("initial_lr" in g and "params" not in g for g in saved["param_groups"])

    copies = {name: nn.Parameter(p.detach().clone()) for name, p in params.items()}
    reloaded = MuonAdamW(toy_groups(copies))
    reloaded.load_state_dict(saved)
    # The groups keep the hyperparameters they were built with (the resume contract); the schedule
    # sets the Muon momentum again before every step, so the runs stay bitwise equal.
    assert reloaded.param_groups[2]["momentum"] != opt.param_groups[2]["momentum"]
    for step in (2, 3):
        for live in (params, copies):
            random_grads(live, step)
        for o in (opt, reloaded):
            schedule(o, step)
            o.step()
    for name in params:
        assert torch.equal(params[name], copies[name]), name


def test_load_state_dict_refuses_other_groups():
    params = toy_params(torch.float32)
    saved = optimizer_run(params, 1).state_dict()
    saved["param_groups"][2]["names"] = ["tall.0", "tall.1"]
    with pytest.raises(RaychatError, match="other parameter groups"):
        MuonAdamW(toy_groups(toy_params(torch.float32))).load_state_dict(saved)
    saved = optimizer_run(toy_params(torch.float32), 1).state_dict()
    saved["state"]["emb"]["exp_avg"] = torch.zeros(4, 4)
    with pytest.raises(RaychatError, match=r"emb.exp_avg is \(4, 4\)"):
        MuonAdamW(toy_groups(toy_params(torch.float32))).load_state_dict(saved)


def test_constructor_rejects_bad_groups():
    params = toy_params(torch.float32)
    mixed = {"kind": "muon", "params": [params["tall.0"], params["wide.0"]], "names": ["a", "b"], "lr": 0.02,
             "momentum": 0.95, "ns_steps": 5, "beta2": 0.9, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="one shape"):
        MuonAdamW([mixed])
    with pytest.raises(ValueError, match="names"):
        MuonAdamW([{"kind": "adamw", "params": [params["emb"]], "lr": 0.1, "betas": (0.9, 0.9), "eps": 1e-8,
                    "weight_decay": 0.0}])


# ---- the real GPT ----------------------------------------------------------------------------------


def small_gpt(seed=0):
    torch.manual_seed(seed)
    config = gpt_config(depth=2, aspect_ratio=64, head_dim=64, max_seq_len=32, vocab_size=100,
                        window_pattern="L")
    return build_model(config, "cpu")


def test_build_optimizer_groups_like_nanochat():
    model = small_gpt()
    opt = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5,
                          weight_decay=0.28)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len(set(map(id, grouped))) == len(list(model.parameters()))
    names = dict(model.named_parameters())
    for group in opt.param_groups:
        assert [names[n] for n in group["names"]] == group["params"]
        assert group["initial_lr"] == group["lr"]

    # width 128: AdamW embedding/unembedding lrs scaled by (128 / 768) ** -0.5 = sqrt(6) = 2.449489742783178
    adamw = {g["names"][0]: g for g in opt.param_groups if g["kind"] == "adamw"}
    expected = {  # first parameter -> (lr, betas, weight decay), nanochat's GPT.setup_optimizer
        "lm_head.weight": (0.008 * 2.449489742783178, (0.8, 0.96), 0.01),
        "transformer.wte.weight": (0.3 * 2.449489742783178, (0.8, 0.995), 0.001),
        "value_embeds.1.weight": (0.15 * 2.449489742783178, (0.8, 0.995), 0.01),
        "resid_lambdas": (0.005, (0.8, 0.95), 0.05),
        "x0_lambdas": (0.5, (0.96, 0.95), 0.0),
        "smear_gate.weight": (0.2, (0.8, 0.95), 0.0),
    }
    assert set(adamw) == set(expected)
    for name, (lr, betas, weight_decay) in expected.items():
        assert adamw[name]["lr"] == pytest.approx(lr, rel=1e-12), name
        assert tuple(adamw[name]["betas"]) == betas and adamw[name]["weight_decay"] == weight_decay
        assert adamw[name]["eps"] == 1e-10
    assert adamw["smear_gate.weight"]["names"] == ["smear_gate.weight", "smear_lambda", "backout_lambda"]

    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    shapes = {tuple(g["params"][0].shape): len(g["params"]) for g in muon}
    # 2 layers of width 128: q, k, v, proj (128 x 128) x 2; fc (512 x 128); mlp proj (128 x 512);
    # ve_gate (2 heads x 12 channels) on the last layer only
    assert shapes == {(128, 128): 8, (512, 128): 2, (128, 512): 2, (2, 12): 1}
    for group in muon:
        assert (group["lr"], group["momentum"], group["beta2"], group["ns_steps"], group["weight_decay"]) == \
            (0.02, 0.95, 0.9, 5, 0.28)


def test_real_gpt_trains_and_resumes():
    model = small_gpt()
    opt = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5,
                          weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (4, 33), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(6):
        loss = model(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert losses[-1] < losses[0] - 0.5, losses  # memorising one batch: the loss must fall fast

    resumed = small_gpt(seed=1)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = build_optimizer(resumed, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02,
                                  scalar_lr=0.5, weight_decay=0.1)
    resumed_opt.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (resumed, resumed_opt)):
        m(x, y).backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_muon_iterates_in_the_models_compute_dtype():
    """--dtype decides Muon's orthogonalisation dtype too: bf16 only where the model computes in bf16."""
    from raychat.model.precision import Precision
    from raychat.optim.muon import muon_update

    config = gpt_config(depth=2, aspect_ratio=64, head_dim=64, max_seq_len=32, vocab_size=100,
                        window_pattern="L")
    lrs = dict(embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5, weight_decay=0.28)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(config, "cpu", Precision(dtype, None, False))
        assert build_optimizer(model, **lrs).bf16_iteration == (dtype == torch.bfloat16)

    torch.manual_seed(0)
    grads, params = torch.randn(2, 16, 8, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64)
    updated = {}
    for bf16 in (False, True):
        p = params.clone()
        muon_update(grads.clone(), p, torch.zeros_like(p), torch.zeros(2, 16, 1, dtype=torch.float64),
                    momentum=0.95, lr=0.02, weight_decay=0.0, beta2=0.9, ns_steps=5, bf16=bf16)
        updated[bf16] = p - params
    assert not torch.equal(updated[False], updated[True])  # the bf16 iteration really ran
    torch.testing.assert_close(updated[True], updated[False], rtol=0.1, atol=2e-3)
