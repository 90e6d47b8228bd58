"""The GPT that raychat trains: nanochat's architecture, written out in plain PyTorch.

What it is, as in nanochat's `nanochat/gpt.py`:
- rotary position embeddings (base 100000), no learned positions
- QK-norm (parameter-free RMSNorm on queries and keys), both then scaled by 1.2 to sharpen attention
- untied token embedding (wte) and lm_head; ReLU^2 MLP with 4x expansion; no biases anywhere
- parameter-free RMSNorm: after the embedding, before attention and MLP, before lm_head
- value embeddings (ResFormer) on alternating layers, the last layer always included, mixed into the
  values through an input-dependent gate per kv head (3 * sigmoid of the first 12 channels)
- the smear gate: each token's embedding gets a gated share of the previous token's (cheap bigram)
- per-layer resid_lambdas / x0_lambdas: x <- resid_lambda * x + x0_lambda * x0 before every block
- backout: the residual after layer n_layer // 2, times backout_lambda, is subtracted before the
  final norm
- logits soft-capped at 15 by tanh; vocab padded to a multiple of 64, logits sliced back
- sliding windows: the pattern (e.g. SSSL) tiled over layers, the last layer always L; L = T,
  S = T/4 rounded up to a multiple of 128
- GQA: n_kv_head may divide n_head

Why it is built on the meta device first: shapes and parameter counts cost nothing there (the
scaling rules need them for models that never get trained), and `materialize` + `init_weights` then
allocate once on the real device. All real values are set in `init_weights`.

Precision: master weights stay fp32 (the optimizer updates them); activations run in the compute
dtype (--dtype, raychat.model.precision: bf16 on CUDA SM80+, fp32 on CPU by default). As in
nanochat there is no autocast: the embedding output is cast to the compute dtype and every Linear
casts its weight to the dtype of its input. Logits and the loss are fp32. (nanochat also stores wte
and value_embeds in bf16 to save memory; raychat keeps them fp32 so every parameter has one dtype for
the optimizer and the checkpoints. The forward values are identical: the lookup is cast to bf16.)

The loss: given targets, an eager forward computes lm_head + soft-cap + cross-entropy in chunks of
rows (raychat.model.loss), never holding the [B*T, vocab] fp32 logits; same values as the plain
chain, which compiled graphs (inductor fuses it) and RAYCHAT_FUSED_CE=0 keep.
"""

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from raychat.common import RaychatError
from raychat.model.attention import AttentionMask, causal_attention, layer_masks
from raychat.model.loss import softcapped_cross_entropy
from raychat.model.precision import Precision, auto_dtype
from raychat.records import Record

ROTARY_BASE = 100_000
ROTARY_OVERCOMPUTE = 10      # rotary tables cover 10x sequence_len, as nanochat's
QK_SHARPEN = 1.2
LOGIT_SOFTCAP = 15.0
PAD_VOCAB_TO = 64
VE_GATE_CHANNELS = 12
SMEAR_GATE_CHANNELS = 24

@dataclass
class GPTConfig(Record):
    """The model's shape, as checkpoints record it (a typed record: raychat.records)."""

    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6          # query heads
    n_kv_head: int = 6       # key/value heads (GQA when fewer than n_head)
    n_embd: int = 768
    window_pattern: str = "SSSL"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // PAD_VOCAB_TO) * PAD_VOCAB_TO


def gpt_config(depth: int, aspect_ratio: int, head_dim: int, max_seq_len: int, vocab_size: int,
               window_pattern: str) -> GPTConfig:
    """nanochat's build_model_meta rule: width = depth * aspect_ratio rounded up to a multiple of
    head_dim, n_head = width // head_dim, full multi-head attention (n_kv_head = n_head)."""
    for flag, value in (("--depth", depth), ("--aspect-ratio", aspect_ratio), ("--max-seq-len", max_seq_len),
                        ("--vocab-size", vocab_size)):
        if value < 1:
            raise RaychatError(f"{flag} must be at least 1, got {value}")
    if head_dim < 2 or head_dim % 2:
        raise RaychatError(f"--head-dim must be a positive even number (rotary embeddings rotate channel "
                           f"pairs), got {head_dim}")
    model_dim = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = model_dim // head_dim
    config = GPTConfig(sequence_len=max_seq_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                       n_kv_head=n_head, n_embd=model_dim, window_pattern=window_pattern)
    validate_config(config)
    return config


def validate_config(config: GPTConfig) -> None:
    """Reject shapes the model cannot be built with, in one line naming the setting."""
    if config.n_layer < 1 or config.sequence_len < 1 or config.vocab_size < 1:
        raise RaychatError(f"model config needs n_layer, sequence_len and vocab_size >= 1, got {config}")
    if config.n_head < 1 or config.n_embd % config.n_head:
        raise RaychatError(f"model width {config.n_embd} is not a multiple of n_head {config.n_head}")
    if config.n_kv_head < 1 or config.n_head % config.n_kv_head:
        raise RaychatError(f"n_kv_head {config.n_kv_head} must divide n_head {config.n_head} (GQA)")
    if config.head_dim % 2:
        raise RaychatError(f"head dim {config.head_dim} must be even (rotary embeddings rotate pairs)")
    if config.n_embd < SMEAR_GATE_CHANNELS:
        raise RaychatError(f"model width {config.n_embd} is below {SMEAR_GATE_CHANNELS} (the smear gate "
                           f"reads that many channels): raise --aspect-ratio or --head-dim")
    pattern = config.window_pattern.upper()
    if not pattern or set(pattern) - {"S", "L"}:
        raise RaychatError(f"--window-pattern must be letters S and L (e.g. SSSL or L), "
                           f"got {config.window_pattern!r}")


def window_sizes(config: GPTConfig) -> list[int]:
    """Per-layer left window in tokens: the pattern tiled over layers, the last layer always L.
    L = sequence_len; S = sequence_len / 4 rounded up to a multiple of 128 (FA3's tile size)."""
    long_window = config.sequence_len
    short_window = -(-long_window // 4 // 128) * 128
    pattern = config.window_pattern.upper()
    sizes = [long_window if pattern[i % len(pattern)] == "L" else short_window for i in range(config.n_layer)]
    sizes[-1] = long_window
    return sizes


def has_value_embedding(layer: int, n_layer: int) -> bool:
    """Alternating layers carry a value embedding, counted back from the last one (always included)."""
    return layer % 2 == (n_layer - 1) % 2


RotaryTables = tuple[Tensor, Tensor]  # (cos, sin), each [1, T, 1, head_dim / 2]


def norm(x: Tensor) -> Tensor:
    """RMSNorm without learnable parameters."""
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) of [B, T, H, D] by position-dependent angles."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Linear(nn.Linear):
    """Bias-free nn.Linear whose fp32 master weight is cast to the input's dtype in forward: this is
    how activations stay in the compute dtype without autocast."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        kv_dim = self.n_kv_head * self.head_dim
        self.c_q = Linear(config.n_embd, config.n_embd)
        self.c_k = Linear(config.n_embd, kv_dim)
        self.c_v = Linear(config.n_embd, kv_dim)
        self.c_proj = Linear(config.n_embd, config.n_embd)
        has_ve = has_value_embedding(layer, config.n_layer)
        self.ve_gate = Linear(VE_GATE_CHANNELS, self.n_kv_head) if has_ve else None

    def forward(self, x: Tensor, ve: Tensor | None, cos_sin: RotaryTables, window: int,
                mask: AttentionMask) -> Tensor:
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            # value residual: the gate in (0, 3) per kv head is a function of the block's input
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = norm(q) * QK_SHARPEN, norm(k) * QK_SHARPEN
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window, mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, ve: Tensor | None, cos_sin: RotaryTables, window: int,
                mask: AttentionMask) -> Tensor:
        x = x + self.attn(norm(x), ve, cos_sin, window, mask)
        return x + self.mlp(norm(x))


def _on_meta() -> bool:
    """Whether modules are being built on the meta device (`with torch.device("meta")`)."""
    return torch.empty(0).device.type == "meta"


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table; on the meta device left empty for `init_weights`. nn.Embedding(num, dim)
    would fill it with N(0, 1) first, and normal_ on the meta device loads TorchDynamo, seconds of
    start-up, to compute nothing. Every driver and every `raychat.plan` builds a model on the meta
    device to count its parameters."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim)) if _on_meta() else nn.Embedding(num, dim)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        """Shapes only: this runs under `with torch.device("meta")`; `init_weights` sets every value."""
        super().__init__()
        validate_config(config)
        self.config = config
        self.window_sizes = window_sizes(config)
        vocab, width = config.padded_vocab_size, config.n_embd
        self.transformer = nn.ModuleDict({
            "wte": _embedding(vocab, width),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = Linear(width, vocab)
        self.resid_lambdas = nn.Parameter(torch.empty(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.empty(config.n_layer))
        self.smear_gate = Linear(SMEAR_GATE_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.empty(1))
        self.backout_lambda = nn.Parameter(torch.empty(1))
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleDict({str(i): _embedding(vocab, kv_dim) for i in range(config.n_layer)
                                           if has_value_embedding(i, config.n_layer)})
        self.rotary_seq_len = config.sequence_len * ROTARY_OVERCOMPUTE
        # Derived data, never in checkpoints: computed here on a real device (a model built there and
        # given a state dict needs them), left empty on meta for init_weights (arange on the meta
        # device would load TorchDynamo, as in _embedding).
        if _on_meta():
            table = (1, self.rotary_seq_len, 1, config.head_dim // 2)
            cos, sin = torch.empty(table), torch.empty(table)
        else:
            cos, sin = self._rotary_tables(torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.compute_dtype = torch.float32                    # set for the real device by init_weights

    def _rotary_tables(self, dtype: torch.dtype) -> RotaryTables:
        device = self.transformer.wte.weight.device
        head_dim = self.config.head_dim
        channels = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / ROTARY_BASE ** (channels / head_dim)
        angles = torch.outer(torch.arange(self.rotary_seq_len, dtype=torch.float32, device=device), inv_freq)
        return angles.cos().to(dtype)[None, :, None, :], angles.sin().to(dtype)[None, :, None, :]

    @torch.no_grad()
    def init_weights(self, dtype: torch.dtype | None = None) -> None:
        """nanochat's init, all in one place (s = sqrt(3 / n_embd): a uniform with std 1/sqrt(n_embd)):
        wte ~ N(0, 0.8); lm_head ~ N(0, 0.001); c_q, c_k, c_v ~ U(-s, s); c_fc ~ U(-0.4s, 0.4s);
        both output projections zero; value embeddings ~ U(-s, s); ve_gate and smear_gate ~ U(0, 0.02);
        resid_lambdas from 1.15 down to 1.05 and x0_lambdas from 0.20 down to 0.05 (linear over
        layers); smear_lambda 0; backout_lambda 0.2. Deterministic under torch.manual_seed.
        `dtype` is the compute dtype (default: --dtype auto's choice for the device)."""
        cfg = self.config
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=0.8)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        s = math.sqrt(3.0 / cfg.n_embd)
        for block in self.transformer.h:
            nn.init.uniform_(block.attn.c_q.weight, -s, s)
            nn.init.uniform_(block.attn.c_k.weight, -s, s)
            nn.init.uniform_(block.attn.c_v.weight, -s, s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.uniform_(block.mlp.c_fc.weight, -0.4 * s, 0.4 * s)
            nn.init.zeros_(block.mlp.c_proj.weight)
        depth_frac = torch.arange(cfg.n_layer, dtype=torch.float32) / max(cfg.n_layer - 1, 1)
        self.resid_lambdas.copy_(1.15 - 0.10 * depth_frac)
        self.x0_lambdas.copy_(0.20 - 0.15 * depth_frac)
        nn.init.zeros_(self.smear_lambda)
        nn.init.constant_(self.backout_lambda, 0.2)
        nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -s, s)
        for block in self.transformer.h:
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
        self.compute_dtype = dtype or auto_dtype(self.transformer.wte.weight.device)
        self.cos, self.sin = self._rotary_tables(self.compute_dtype)

    def forward(self, idx: Tensor, targets: Tensor | None = None, loss_reduction: str = "mean", *,
                fixed_length: bool = True) -> Tensor:
        """idx: int64 [B, T]. With targets ([B, T], -1 = ignore): the cross-entropy, reduced by
        "mean" (over counted positions), "sum", or "none" (a [B, T] tensor, 0 at ignored positions).
        Without targets: soft-capped fp32 logits [B, T, vocab_size]. fixed_length=False (T grows
        from call to call, as in generate) keeps sliding windows off compiled FlexAttention."""
        B, T = idx.size()
        if self.rotary_seq_len < T:
            raise RaychatError(f"a sequence of {T} tokens exceeds the rotary cache of {self.rotary_seq_len} "
                               f"positions ({ROTARY_OVERCOMPUTE} x sequence_len {self.config.sequence_len}): "
                               f"raise --max-seq-len")
        dtype = self.compute_dtype
        cos_sin = self.cos[:, :T], self.sin[:, :T]
        masks = layer_masks(T, self.window_sizes, idx.device, allow_flex=fixed_length)

        x = norm(self.transformer.wte(idx).to(dtype))
        if T > 1:  # smear: mix a gated share of the previous token's embedding into each position
            gate_logit = self.smear_gate(x[:, 1:, :SMEAR_GATE_CHANNELS])
            gate = self.smear_lambda.to(dtype) * torch.sigmoid(gate_logit)
            x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)

        x0 = x
        backout_layer = self.config.n_layer // 2  # always < n_layer, so x_backout is always set
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(dtype) if str(i) in self.value_embeds else None
            x = block(x, ve, cos_sin, self.window_sizes[i], masks[i])
            if i == backout_layer:
                x_backout = x
        # backout: remove part of the mid-network residual (low-level features) before the head
        x = norm(x - self.backout_lambda.to(dtype) * x_backout)

        if targets is not None and self._fused_loss_applies(x, loss_reduction):
            loss = softcapped_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight,
                                            targets.reshape(-1), self.config.vocab_size, LOGIT_SOFTCAP,
                                            loss_reduction)
            return loss.view(targets.shape) if loss_reduction == "none" else loss
        logits = self.lm_head(x)[..., :self.config.vocab_size].float()
        logits = LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=loss_reduction)
        return loss.view(targets.shape) if loss_reduction == "none" else loss

    def _fused_loss_applies(self, x: Tensor, loss_reduction: str) -> bool:
        """Whether the loss takes raychat.model.loss's chunked path (same values, no [B*T, vocab]
        logits). Eager only: under torch.compile the plain chain is what inductor fuses. Not for
        "none" with gradients (no fused backward; training uses "sum"/"mean", evaluation "none" under
        no_grad). RAYCHAT_FUSED_CE=0 forces the plain path (tests compare the two with it)."""
        if torch.compiler.is_compiling() or os.environ.get("RAYCHAT_FUSED_CE", "1") == "0":
            return False
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.lm_head.weight.requires_grad)
        return not (loss_reduction == "none" and needs_grad)

    def num_scaling_params(self) -> dict[str, int]:
        """Parameter counts by kind (nanochat's grouping; the scaling rules pick which to use)."""
        counts = {
            "wte": self.transformer.wte.weight.numel(),
            "value_embeds": sum(p.numel() for p in self.value_embeds.parameters()),
            "lm_head": self.lm_head.weight.numel(),
            "transformer_matrices": sum(p.numel() for p in self.transformer.h.parameters()),
            "scalars": sum(p.numel() for p in (self.resid_lambdas, self.x0_lambdas, self.smear_gate.weight,
                                               self.smear_lambda, self.backout_lambda)),
        }
        counts["total"] = sum(counts.values())
        assert counts["total"] == sum(p.numel() for p in self.parameters()), "a parameter is in no count"
        return counts

    def estimate_flops(self) -> int:
        """Training FLOPs per token, counted as nanochat's estimate_flops counts them: each weight of
        every Linear (blocks, ve gates, smear gate, lm_head with its vocab padding) costs 6 (2 forward,
        4 backward); embedding lookups and the scalars cost nothing; attention scores and their
        weighted sum add 12 * n_head * head_dim * min(window, T) per layer. Works on the meta device."""
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        cfg = self.config
        attention = sum(12 * cfg.n_head * cfg.head_dim * min(window, cfg.sequence_len)
                        for window in self.window_sizes)
        return 6 * matmul_weights + attention

    def optimizer_param_sets(self) -> dict[str, list[nn.Parameter]]:
        """Parameters grouped as nanochat's GPT.setup_optimizer groups them; every parameter is in
        exactly one set. nanochat's hyperparameters per set (s = (n_embd / 768) ** -0.5; eps 1e-10
        for every AdamW set; the lrs below are multiplied by the batch lr scale in base_train):
          lm_head       AdamW  lr = unembedding_lr * s        betas (0.8, 0.96)   wd 0.01
          embedding     AdamW  lr = embedding_lr * s          betas (0.8, 0.995)  wd 0.001   (wte)
          value_embeds  AdamW  lr = embedding_lr * s * 0.5    betas (0.8, 0.995)  wd 0.01
          resid         AdamW  lr = scalar_lr * 0.01          betas (0.8, 0.95)   wd 0.05    (resid_lambdas)
          x0            AdamW  lr = scalar_lr                 betas (0.96, 0.95)  wd 0.0     (x0_lambdas)
          smear         AdamW  lr = 0.2 (fixed)               betas (0.8, 0.95)   wd 0.0
                        (smear_gate.weight, smear_lambda, backout_lambda)
          matrix        Muon   lr = matrix_lr, momentum 0.95, ns_steps 5, beta2 0.9, wd = weight_decay;
                        every parameter of the blocks (attention, MLP, ve_gate), one Muon group per shape
        """
        return {
            "lm_head": [self.lm_head.weight],
            "embedding": [self.transformer.wte.weight],
            "value_embeds": list(self.value_embeds.parameters()),
            "resid": [self.resid_lambdas],
            "x0": [self.x0_lambdas],
            "smear": [self.smear_gate.weight, self.smear_lambda, self.backout_lambda],
            "matrix": list(self.transformer.h.parameters()),
        }


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)`, allocated with `torch.empty` instead of `empty_like`: on a
    meta tensor `empty_like` runs PyTorch's Python reference, whose first call imports sympy (torch
    2.13), a noticeable part of a worker's start on a small CPU. Same tensors, values unset."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build_model(config: GPTConfig, device: torch.device | str, precision: Precision | None = None) -> GPT:
    """Shapes on meta, storage on `device`, then nanochat's init (seed torch first for repeatability),
    in `precision` (default: --dtype auto's for the device, no fp8)."""
    with torch.device("meta"):
        model = GPT(config)
    materialize(model, torch.device(device))
    model.init_weights(precision.dtype if precision else None)
    if precision is not None and precision.fp8_recipe is not None:
        from raychat.model.fp8 import convert_to_fp8  # torchao is an optional extra: imported only for --fp8
        convert_to_fp8(model, precision.fp8_recipe, precision.fp8_emulate)
    return model
