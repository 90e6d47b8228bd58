"""`python -m raychat.sample`: generate text from a run's checkpoint, no Ray needed.

The model shape comes from the checkpoint's metadata, so only the run name is required. A tokenizer
whose vocabulary differs from the one the model was trained with is refused rather than producing
confident garbage.
"""

import argparse

import torch

from raychat.checkpoint.format import read_meta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.resume import find_checkpoint
from raychat.common import default_tokenizer_dir, run_cli
from raychat.model.generate import SAMPLE_PROMPTS, generate
from raychat.model.gpt import build_model
from raychat.storage import run_directory
from raychat.tokenizer.core import Tokenizer, check_vocab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.sample",
        description="Generate text from a trained raychat checkpoint (runs on CPU or one GPU).",
        epilog='Example: python -m raychat.sample --run-name d4 --prompt "The capital of France is"',
    )
    parser.add_argument("--run-name", required=True, help="the run to sample from (its --run-name)")
    parser.add_argument("--storage-path", default="",
                        help="where runs live: a directory or a URI such as s3://bucket/runs "
                             "(default $RAYCHAT_HOME/runs)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer (default $RAYCHAT_HOME/tokenizer)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text; repeat for several (default: nanochat's seven prompts)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample only among the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=42, help="sampling seed")
    args = parser.parse_args(argv)

    run = run_directory(args.storage_path, args.run_name)
    ckpt = find_checkpoint(run, args.step)
    tokenizer = Tokenizer.load(args.tokenizer_dir or default_tokenizer_dir())
    meta = read_meta(ckpt)
    check_vocab(tokenizer, meta.vocab_size, meta.tokenizer_fingerprint, str(ckpt))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_state, _, meta = load_checkpoint(ckpt, load_optimizer=False)
    model = build_model(meta.model_config, device)
    model.load_state_dict(model_state, strict=True)
    model.eval()
    print(f"# {ckpt} (step {meta.step}, val bpb {meta.val_bpb})", flush=True)
    for prompt in args.prompt or SAMPLE_PROMPTS:
        tokens = [tokenizer.bos_id] + tokenizer.encode(prompt)
        new = generate(model, tokens, max_tokens=args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed)
        print(prompt + tokenizer.decode(new), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
