"""`python -m raychat.export --to nanochat`: a raychat checkpoint in the layout nanochat's scripts load.

Written under --out (use it as nanochat's NANOCHAT_BASE_DIR), from karpathy/nanochat at commit
92d63d4e8bb4 (nanochat/checkpoint_manager.py, nanochat/gpt.py, nanochat/tokenizer.py):

    base_checkpoints/<model_tag>/model_<step:06d>.pt   torch.save of {parameter name: tensor}, nanochat's
                                                      GPT state-dict names (raychat's GPT uses the same
                                                      names: checked against NANOCHAT_KEYS); fp32, except
                                                      transformer.wte and value_embeds.* in bf16 as
                                                      nanochat stores them (--embedding-dtype fp32: exact)
    base_checkpoints/<model_tag>/meta_<step:06d>.json  step, val_bpb, model_config (nanochat's GPTConfig:
                                                      sequence_len, vocab_size, n_layer, n_head, n_kv_head,
                                                      n_embd, window_pattern), user_config, max_seq_len,
                                                      device_batch_size, total_batch_size
    tokenizer/tokenizer.pkl                           pickle of the tiktoken Encoding (what
                                                      RustBPETokenizer.from_directory unpickles)
    tokenizer/token_bytes.pt                          int32 [vocab_size] bytes per token, 0 for specials

Then nanochat runs on it unchanged, e.g. `NANOCHAT_BASE_DIR=OUT python -m scripts.base_eval --model-tag
d12`. Writing a pickle is safe; raychat itself never loads one.
"""

import argparse
import json
import pickle
from pathlib import Path

import torch

from raychat.checkpoint.format import read_meta
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.nanochat import MODEL_CONFIG_KEYS, NANOCHAT_COMMIT, nanochat_keys
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.resume import find_checkpoint
from raychat.common import RaychatError, check_name, default_tokenizer_dir, run_cli
from raychat.model.gpt import GPTConfig
from raychat.storage import Storage, run_directory
from raychat.tokenizer.core import Tokenizer, check_vocab


def nanochat_state(model_state: dict[str, torch.Tensor], config: GPTConfig,
                   embedding_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """raychat's model state as nanochat's GPT.state_dict(): same names, embeddings in `embedding_dtype`."""
    differ = sorted(set(model_state) ^ nanochat_keys(config))
    if differ:
        raise RaychatError(f"the checkpoint's parameters differ from nanochat's GPT ({', '.join(differ[:4])})"
                           ": this raychat's model is not the one the export was written for")

    def dtype(name: str) -> torch.dtype:
        embedding = name == "transformer.wte.weight" or name.startswith("value_embeds.")
        return embedding_dtype if embedding else torch.float32

    return {name: tensor.detach().cpu().to(dtype(name)).contiguous() for name, tensor in model_state.items()}


def nanochat_meta(meta: CheckpointMeta) -> dict:
    """meta_<step>.json: the fields nanochat's checkpoint_manager, base_eval and chat_sft read. A
    checkpoint from before raychat kept its flags or plan leaves those fields empty."""
    user, plan, model = meta.user_config, meta.plan, meta.model_config
    return {
        "step": meta.step, "val_bpb": meta.val_bpb,
        "model_config": {key: getattr(model, key) for key in MODEL_CONFIG_KEYS},
        "user_config": user.to_public_dict() if user is not None else {}, "max_seq_len": model.sequence_len,
        "device_batch_size": user.device_batch_size if user is not None else None,
        "total_batch_size": (plan.total_batch_size if plan is not None
                             else user.total_batch_size if user is not None else None),
        "exported_from": {"raychat_version": meta.raychat_version,
                          "nanochat_commit": NANOCHAT_COMMIT},
    }


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tokenizer.pkl", "wb") as f:
        pickle.dump(tokenizer.encoding, f)
    torch.save(tokenizer.token_bytes().to(torch.int32).clone(), out / "token_bytes.pt")


def export_nanochat(checkpoint: Storage, tokenizer: Tokenizer, out: Path, model_tag: str,
                    embedding_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the checkpoint and tokenizer in nanochat's layout under `out`; returns the model file."""
    model_state, _, meta = load_checkpoint(checkpoint, load_optimizer=False)
    check_vocab(tokenizer, meta.vocab_size, meta.tokenizer_fingerprint, str(checkpoint))
    state = nanochat_state(model_state, meta.model_config, embedding_dtype)
    directory = out / "base_checkpoints" / model_tag
    step = meta.step
    model_file = directory / f"model_{step:06d}.pt"
    if model_file.exists():
        raise RaychatError(f"{model_file} exists: choose another --out or --model-tag")
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, model_file)
    (directory / f"meta_{step:06d}.json").write_text(json.dumps(nanochat_meta(meta), indent=2))
    write_tokenizer(tokenizer, out / "tokenizer")
    return model_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.export",
        description="Write a raychat checkpoint in another project's layout. --to nanochat writes what "
                    "nanochat's checkpoint_manager loads for a base model (model_<step>.pt, "
                    "meta_<step>.json) and its tokenizer files under --out (nanochat's NANOCHAT_BASE_DIR).",
        epilog="Example: python -m raychat.export --run-name d12 --to nanochat --out ~/nanochat_base\n"
               "         NANOCHAT_BASE_DIR=~/nanochat_base python -m scripts.base_eval --model-tag d12",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-name", required=True, help="the run to export (its --run-name)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--to", required=True, choices=("nanochat",), help="target layout")
    parser.add_argument("--out", required=True, help="output directory (nanochat's NANOCHAT_BASE_DIR)")
    parser.add_argument("--storage-path", default="", help="where runs live: a directory or a URI such as "
                        "s3://bucket/runs (default $RAYCHAT_HOME/runs)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer (default $RAYCHAT_HOME/tokenizer)")
    parser.add_argument("--model-tag", default="", help="nanochat's model tag, the directory under "
                        "base_checkpoints/ (default: the run's --model-tag, else d<depth>)")
    parser.add_argument("--embedding-dtype", default="bf16", choices=("bf16", "fp32"),
                        help="dtype of wte and value_embeds: bf16 as nanochat stores them (default; the same "
                             "forward in bf16), or fp32 (bit-exact)")
    args = parser.parse_args(argv)
    run = run_directory(args.storage_path, args.run_name)
    out = Path(args.out).expanduser().resolve()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise RaychatError(f"--out {args.out}: {existing} is a file, not a directory: choose a directory")
    checkpoint = find_checkpoint(run, args.step)
    tokenizer = Tokenizer.load(args.tokenizer_dir or default_tokenizer_dir())
    meta = read_meta(checkpoint)
    flags = meta.user_config
    default_tag = (flags.model_tag if flags is not None else "") or f"d{meta.model_config.n_layer}"
    tag = check_name(args.model_tag or default_tag, "--model-tag")  # a directory under --out, not a path
    dtype = torch.bfloat16 if args.embedding_dtype == "bf16" else torch.float32
    model_file = export_nanochat(checkpoint, tokenizer, out, tag, dtype)
    print(f"Wrote {model_file} (step {meta.step}), its meta and the tokenizer under {args.out}: run "
          f"nanochat with NANOCHAT_BASE_DIR={args.out} and --model-tag {tag}")
    return 0


if __name__ == "__main__":
    run_cli(main)
