"""nanochat's base-checkpoint layout, and reading one to start a raychat run from its weights.

The layout (karpathy/nanochat at NANOCHAT_COMMIT: nanochat/checkpoint_manager.py, nanochat/gpt.py)
under nanochat's NANOCHAT_BASE_DIR:

    base_checkpoints/<model_tag>/model_<step:06d>.pt    torch.save of {parameter name: tensor}
    base_checkpoints/<model_tag>/meta_<step:06d>.json   step, val_bpb, model_config (GPTConfig), ...
    tokenizer/tokenizer.pkl, tokenizer/token_bytes.pt

raychat's GPT has nanochat's parameter names and shapes, so the weights load as they are. The model
file is read with `weights_only=True` (tensors only, never code). nanochat's tokenizer is a pickle,
which raychat never loads: the run's own --tokenizer-dir is checked against nanochat's
token_bytes.pt (a plain tensor), which differs for any other vocabulary.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from raychat.common import RaychatError
from raychat.model.gpt import GPTConfig, has_value_embedding
from raychat.tokenizer.core import Tokenizer

NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"
MODEL_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                     "window_pattern")


def nanochat_keys(config: GPTConfig) -> set[str]:
    """The state-dict names of nanochat's GPT for this config, as its gpt.py defines the modules."""
    keys = {"transformer.wte.weight", "lm_head.weight", "resid_lambdas", "x0_lambdas", "smear_gate.weight",
            "smear_lambda", "backout_lambda"}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        keys |= {f"{block}.attn.{m}.weight" for m in ("c_q", "c_k", "c_v", "c_proj")}
        keys |= {f"{block}.mlp.c_fc.weight", f"{block}.mlp.c_proj.weight"}
        if has_value_embedding(i, config.n_layer):
            keys |= {f"{block}.attn.ve_gate.weight", f"value_embeds.{i}.weight"}
    return keys


@dataclass
class NanochatCheckpoint:
    """A nanochat base checkpoint, read and checked: the weights as raychat's GPT loads them."""

    model_file: Path
    step: int
    config: GPTConfig
    state: dict[str, torch.Tensor]
    tokenizer_checked: bool  # nanochat's token_bytes.pt was found and equals the run's tokenizer's


def _model_file(directory: Path, step: int) -> Path:
    """model_<step>.pt in `directory` (base_checkpoints/<tag>), the newest when step < 0."""
    steps = sorted(int(m.group(1)) for f in directory.glob("model_*.pt")
                   if (m := re.fullmatch(r"model_(\d+)\.pt", f.name)))
    if not steps:
        raise RaychatError(f"--init-from-nanochat {directory}: no model_<step>.pt there; give nanochat's "
                           "checkpoint directory, NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>")
    if step >= 0 and step not in steps:
        raise RaychatError(f"--init-from-nanochat-step {step}: {directory} has steps "
                           f"{', '.join(map(str, steps))}")
    return directory / f"model_{(step if step >= 0 else steps[-1]):06d}.pt"


def _load_tensors(path: Path, holds: type) -> object:
    """torch.load of a file nanochat wrote, tensors only (never code), that must hold a `holds` (a
    tensor, or a dict of them); one line naming the file otherwise."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad or non-tensor file
        raise RaychatError(f"{path} cannot be read as tensors only ({type(e).__name__}: "
                           f"{(str(e).splitlines() or [''])[0][:200]}): raychat loads no pickled code; give "
                           "the file nanochat wrote") from None
    values = loaded.values() if isinstance(loaded, dict) else [loaded]
    if not isinstance(loaded, holds) or not all(isinstance(v, torch.Tensor) for v in values):
        want = "a tensor" if holds is torch.Tensor else "a dict of parameter name -> tensor"
        raise RaychatError(f"{path} holds a {type(loaded).__name__}, not {want}: give the file nanochat "
                           "wrote")
    return loaded


def _check_tokenizer(directory: Path, tokenizer: Tokenizer) -> bool:
    """nanochat's token_bytes.pt (NANOCHAT_BASE_DIR/tokenizer) against the run's tokenizer; False
    when nanochat's file is not there to compare."""
    candidates = [directory.parent.parent / "tokenizer" / "token_bytes.pt", directory / "token_bytes.pt"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        return False
    theirs = _load_tensors(found, torch.Tensor)
    ours = tokenizer.token_bytes()
    if theirs.shape != ours.shape or not torch.equal(theirs.to(ours.dtype), ours):
        raise RaychatError(f"--tokenizer-dir {tokenizer.location} is not the tokenizer of the nanochat model "
                           f"in {directory} (its {found} differs): train with the tokenizer nanochat trained "
                           "it with, exported to raychat's format")
    return True


def load_nanochat_checkpoint(directory: str | Path, step: int, expected: GPTConfig,
                             tokenizer: Tokenizer) -> NanochatCheckpoint:
    """Read and check nanochat's model_<step>.pt and meta_<step>.json for a run that builds
    `expected` with `tokenizer`; every mismatch is one line naming the file and the fix."""
    directory = Path(directory).expanduser().resolve()
    model_file = _model_file(directory, step)
    step = int(model_file.stem.split("_")[1])
    meta_file = directory / f"meta_{step:06d}.json"
    try:
        saved = json.loads(meta_file.read_text())["model_config"]
        config = GPTConfig(**{key: saved[key] for key in MODEL_CONFIG_KEYS})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RaychatError(f"{meta_file}: not a nanochat checkpoint's meta ({type(e).__name__}: {e}): "
                           "give the directory nanochat wrote") from None
    wanted = {key: getattr(expected, key) for key in MODEL_CONFIG_KEYS}
    changed = [f"{key} {getattr(config, key)} (flags: {wanted[key]})" for key in MODEL_CONFIG_KEYS
               if getattr(config, key) != wanted[key]]
    if changed:
        raise RaychatError(f"{model_file} holds another model than these flags build ({', '.join(changed)}): "
                           "give the model flags of the nanochat run (--depth, --aspect-ratio, --head-dim, "
                           "--max-seq-len, --window-pattern) and its tokenizer")
    tokenizer_checked = _check_tokenizer(directory, tokenizer)
    state = _load_tensors(model_file, dict)
    state = {name.removeprefix("_orig_mod."): tensor for name, tensor in state.items()}  # a compiled model's
    differ = sorted(set(state) ^ nanochat_keys(config))
    if differ:
        raise RaychatError(f"{model_file}: its parameters differ from nanochat's GPT at commit "
                           f"{NANOCHAT_COMMIT[:8]} ({', '.join(differ[:3])}): not a base model raychat loads")
    return NanochatCheckpoint(model_file, step, config, state, tokenizer_checked)
