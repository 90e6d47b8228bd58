"""`python -m raychat.tokenizer`: train, evaluate or import a tokenizer (the command line on top of the
tokenizer modules; `raychat.tokenizer.core` runs this module's main, nothing else imports it).
"""

import argparse
from pathlib import Path

from raychat.common import RaychatError, default_data_dir, default_tokenizer_dir
from raychat.corpus.index import iter_split_texts
from raychat.locations import is_uri, normalize_location, redact
from raychat.tokenizer.core import Tokenizer
from raychat.tokenizer.nanochat import import_nanochat_tokenizer
from raychat.tokenizer.stats import tokenizer_stats
from raychat.tokenizer.train import MIN_VOCAB_SIZE, train_tokenizer

DESCRIPTION = """\
Train and evaluate raychat's tokenizer: nanochat's byte-level BPE (GPT-4 split pattern with digit
pairs, special tokens <|bos|> and the chat tokens), trained with HF tokenizers, encoded with tiktoken.

  python -m raychat.tokenizer train        # train on $RAYCHAT_HOME/data, save to $RAYCHAT_HOME/tokenizer
  python -m raychat.tokenizer eval         # bytes per token, vocabulary usage, speed on the val split
  python -m raychat.tokenizer import-nanochat --from ~/.cache/nanochat/tokenizer --trust-pickle
                                           # nanochat's tokenizer.pkl into raychat's format
"""
EPILOG = """\
No corpus yet? `python -m raychat.corpus sample --out DIR` writes one from text already on this
machine. `python -m raychat.train` trains a tokenizer by itself when --tokenizer-dir has none.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raychat.tokenizer", description=DESCRIPTION,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,eval,import-nanochat}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", default="", help="corpus directory of shard_*.parquet "
                        "(default $RAYCHAT_HOME/data)")
    common.add_argument("--tokenizer-dir", default="",
                        help="tokenizer directory (default $RAYCHAT_HOME/tokenizer); eval also reads "
                             "one in a bucket (s3://...)")
    train = commands.add_parser("train", parents=[common], help="train a tokenizer on the training split",
                                description="Train a tokenizer on the training split of a corpus and save it "
                                "to --tokenizer-dir (a tokenizer already there is replaced).")
    train.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens "
                       f"included (at least {MIN_VOCAB_SIZE}; default 32768)")
    train.add_argument("--max-chars", type=int, default=2_000_000_000,
                       help="train on at most this many characters (default 2,000,000,000)")
    train.add_argument("--doc-cap", type=int, default=10_000,
                       help="cut each document to this many characters (default 10,000)")
    evaluate = commands.add_parser("eval", parents=[common],
                                   help="evaluate a tokenizer on the validation split",
                                   description="Bytes per token, vocabulary usage and encode throughput of a "
                                   "tokenizer on the validation split of a corpus.")
    evaluate.add_argument("--max-chars", type=int, default=50_000_000,
                          help="evaluate on at most this many characters (default 50,000,000)")
    evaluate.add_argument("--threads", type=int, default=0, help="encode threads (default 0 = every core)")
    imported = commands.add_parser(
        "import-nanochat", help="nanochat's tokenizer (a pickle) into raychat's format",
        description="Write nanochat's tokenizer (NANOCHAT_BASE_DIR/tokenizer/tokenizer.pkl, a pickled "
        "tiktoken Encoding) to --tokenizer-dir in raychat's format: the same ids, for --init-from-nanochat "
        "or for training on nanochat's vocabulary. Loading a pickle runs code the file names: "
        "--trust-pickle says the file comes from a nanochat run you trust.")
    imported.add_argument("--from", dest="source", required=True,
                          help="nanochat's tokenizer.pkl, or the directory holding it")
    imported.add_argument("--tokenizer-dir", default="",
                          help="where to write (default $RAYCHAT_HOME/tokenizer; a tokenizer there is "
                          "replaced)")
    imported.add_argument("--trust-pickle", action="store_true",
                          help="load the pickle (it can run code): only for files from a run you trust")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "import-nanochat":
        out = Path(args.tokenizer_dir).expanduser() if args.tokenizer_dir else default_tokenizer_dir()
        tokenizer = import_nanochat_tokenizer(args.source, out, args.trust_pickle)
        print(f"Wrote nanochat's tokenizer to {out} (vocab {tokenizer.vocab_size:,}, fingerprint "
              f"{tokenizer.fingerprint})")
        return 0
    data_dir = normalize_location(args.data_dir or str(default_data_dir()))  # a path or a bucket URI
    if args.command == "train":
        if is_uri(args.tokenizer_dir):
            raise RaychatError(f"train writes a local directory, not {redact(args.tokenizer_dir)}: "
                               "train into a local --tokenizer-dir, then copy it into the bucket "
                               "(raychat.train reads it there)")
        out = Path(args.tokenizer_dir).expanduser() if args.tokenizer_dir else default_tokenizer_dir()
        train_tokenizer(data_dir, out, args.vocab_size, args.max_chars, args.doc_cap)
        return 0
    tokenizer_dir = args.tokenizer_dir or default_tokenizer_dir()
    if args.threads < 0:
        raise RaychatError(f"--threads must be 0 (every core) or more, got {args.threads}")
    tokenizer = Tokenizer.load(tokenizer_dir)
    texts = list(iter_split_texts(data_dir, "val", max_chars=args.max_chars))
    stats = tokenizer_stats(tokenizer, texts, args.threads)
    print(f"tokenizer {tokenizer.directory} (vocab {tokenizer.vocab_size:,}, fingerprint "
          f"{tokenizer.fingerprint}) on the validation split of {data_dir}:")
    print(stats.format())
    return 0
