"""`python -m raychat.corpus`: create, check and inspect corpora (the command line on top of the
other modules of raychat.corpus; nothing imports this one). It also offers raychat.evaluation's
`download-eval-bundle`, defined there, beside the commands that fetch a corpus."""

import argparse
import contextlib
from pathlib import Path

from raychat.common import default_data_dir
from raychat.corpus import download, fixture, ingest, sample
from raychat.corpus.check import validate_corpus
from raychat.corpus.index import DEFAULT_DOCS_PER_SHARD, ROW_GROUP_SIZE
from raychat.evaluation import download as eval_bundle
from raychat.locations import is_uri
from raychat.storage import Storage

DESCRIPTION = """\
Create, check and inspect raychat corpora: directories of parquet shards in nanochat's layout
(shard_00000.parquet, ... with one string column `text`, row groups of 1024 documents; the last
shard is the validation split). DIR may also be a bucket URI (s3://bucket/corpus, gs://...,
"s3://b/c?endpoint_override=host:9000&scheme=http") for every command but download, which writes
to local disk. Pick one way to get a corpus, then check it:

  python -m raychat.corpus download --shards 8          # ClimbMix from Hugging Face (8 train + val)
  python -m raychat.corpus sample --out DIR             # offline: text already on this machine
  python -m raychat.corpus ingest my_texts/ --out DIR   # your .txt/.md/.jsonl/.parquet files
  python -m raychat.corpus synthetic --out DIR --docs 100000 --seed 0   # generated, for tests/benchmarks
  python -m raychat.corpus check DIR
  python -m raychat.corpus download-eval-bundle          # the CORE tasks (nanochat's eval bundle)
"""


def _add_writer_flags(parser: argparse.ArgumentParser, out_default: Path | None = None,
                      docs_per_shard: int = DEFAULT_DOCS_PER_SHARD) -> None:
    where = f" (default: {out_default})" if out_default else ""
    parser.add_argument("--out", required=out_default is None, default=out_default,
                        help=f"output corpus directory or bucket URI{where}; created if missing, must "
                             "hold no shards")
    parser.add_argument("--docs-per-shard", type=int, default=docs_per_shard,
                        help=f"documents per train shard (default: {docs_per_shard})")
    parser.add_argument("--val-docs", type=int, default=None,
                        help="documents in the validation shard (default: 10%% of the documents, at most "
                             f"{2 * ROW_GROUP_SIZE})")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards already in --out")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raychat.corpus", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "download", help="fetch ClimbMix shards from the Hugging Face Hub (parallel, resumable)",
        description=f"Fetch the first N train shards of {download.REPO_ID} plus its validation shard "
        f"(shard_{download.MAX_SHARD:05d}) with huggingface_hub, all from one commit, recorded in "
        "DATA_DIR/corpus.json. Complete files are kept and partial ones resumed, so re-running (also with a "
        "larger --shards) continues; each file is checked against the size and checksum the Hub publishes. "
        "DATA_DIR may be a bucket URI (s3://bucket/climbmix, gs://..., with ?endpoint_override=...): the "
        "shards then pass through $RAYCHAT_HOME/staging a batch of --workers at a time and are uploaded; "
        "shards already in the bucket are kept. HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE are honoured.")
    p.add_argument("--shards", type=int, required=True,
                   help=f"train shards to fetch (1..{download.MAX_SHARD})")
    p.add_argument("--data-dir", default=None, help=f"where to put them: a directory or a bucket URI "
                   f"(default: {default_data_dir()})")
    p.add_argument("--revision", default=None,
                   help="dataset branch, tag or commit (default: the commit DATA_DIR was started from, else "
                        f"{download.DEFAULT_REVISION!r} resolved to its current commit)")
    p.add_argument("--workers", type=int, default=8, help="parallel downloads (default: 8)")

    p = commands.add_parser("ingest", help="turn .txt/.md/.jsonl/.parquet files into a corpus",
                            description="Each .txt/.md file is one document; each .jsonl line and each "
                            "parquet row is one document (field/column `text`). Directories are read "
                            "recursively in name order. Empty and exact-duplicate documents are dropped; "
                            "invalid UTF-8 is replaced with U+FFFD and reported per file. The last "
                            "--val-docs documents become the validation shard.")
    p.add_argument("paths", nargs="+", help="files or directories to read")
    _add_writer_flags(p)

    p = commands.add_parser("sample", help="offline corpus of human-written text already on this machine",
                            description="Package descriptions of installed Python distributions, Python's "
                            "help topics and the docstrings of the standard library and installed packages; "
                            "the same installed packages give the same corpus. Needs no network.")
    _add_writer_flags(p, out_default=default_data_dir(), docs_per_shard=sample.SAMPLE_DOCS_PER_SHARD)
    p.add_argument("--max-mb", type=float, default=sample.SAMPLE_MAX_MB,
                   help=f"stop at this many MB of text (default: {sample.SAMPLE_MAX_MB})")

    p = commands.add_parser(
        "synthetic", help="seeded generated documents, for tests and benchmarks",
        description="A test fixture, not training data: generated documents with a realistic length "
        "distribution (short and very long ones), several scripts, numbers and punctuation. The same --seed "
        "and --docs give the same documents, whatever the shard size.")
    _add_writer_flags(p)
    p.add_argument("--docs", type=int, required=True, help="number of documents (train + val)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads generating and compressing (default: CPU count, at most 8)")

    eval_bundle.add_command(commands)  # raychat.evaluation's command, offered where data is fetched

    p = commands.add_parser("check", help="validate a corpus and print its summary",
                            description="Checks every shard's footer (opens as parquet, string column "
                            "`text`, row groups of 1..1024 documents, non-empty train and val splits); "
                            "--deep also reads every document. Exit code 2 with one line naming the file "
                            "on the first problem.")
    p.add_argument("data_dir", nargs="?", default=None,
                   help=f"corpus directory or bucket URI (default: {default_data_dir()})")
    p.add_argument("--deep", action="store_true", help="also read every document (slower)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        _check_endpoint(args.data_dir, "DIR")
        print(validate_corpus(args.data_dir or default_data_dir(), deep=args.deep).format())
        return 0
    if args.command == eval_bundle.COMMAND:
        return eval_bundle.run_command(args)
    if args.command == "download":
        _check_endpoint(args.data_dir, "--data-dir")
        download.download_shards(args.data_dir or default_data_dir(), args.shards, revision=args.revision,
                                 workers=args.workers)
        print(validate_corpus(args.data_dir or default_data_dir()).format())
        return 0
    writer_args = dict(docs_per_shard=args.docs_per_shard, val_docs=args.val_docs, overwrite=args.overwrite)
    out = Storage(args.out) if is_uri(str(args.out)) else None
    if out is not None:
        # A bucket that cannot be reached or written fails here, in one line, before any document
        # is made; and a fault while writing is one line too (a rerun with --overwrite redoes it).
        out.check_writable("--out", lease=False)
    with out.write_faults_as_errors("--out") if out is not None else contextlib.nullcontext():
        if args.command == "ingest":
            summary = ingest.ingest(args.paths, args.out, **writer_args)
        elif args.command == "sample":
            summary = sample.write_sample_corpus(args.out, max_mb=args.max_mb, **writer_args)
        else:
            summary = fixture.write_synthetic_corpus(args.out, args.docs, args.seed, workers=args.workers,
                                                     **writer_args)
    print(summary.format())
    return 0


def _check_endpoint(location: str | None, flag: str) -> None:
    """A bucket URI's endpoint must resolve and answer, or one line says so now (its reads would
    retry an unreachable endpoint for minutes)."""
    if location and is_uri(location):
        Storage(location).check_endpoint(flag)

