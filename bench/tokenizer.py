"""Tokenizer speed: training time against rustbpe (nanochat's trainer) on the same text and vocab, and
encode throughput on one thread and on every core.

    python bench/tokenizer.py                          # offline sample corpus (written to a temp dir)
    python bench/tokenizer.py --data-dir D --vocab-size 32768 --repeats 3

Targets (issue 2): training no slower than rustbpe (ratio <= 1.00); encode >= 10 MB/s per core.
Both trainers read the corpus through the same `iter_split_texts` (same documents, same doc cap),
and both end with a usable tiktoken encoding, so the times compare like for like. On a machine
shared with other work, wall times are noisy: the CPU-seconds columns show what each used.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rustbpe
import tiktoken

from raychat.corpus.index import iter_split_texts
from raychat.tokenizer.core import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer, available_cores
from raychat.tokenizer.train import train_tokenizer

ENCODE_TARGET_MB_PER_CORE = 10.0


def timed(fn):
    """(result, wall seconds, CPU seconds of this process)."""
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0, time.process_time() - c0


def make_corpus(out: Path) -> Path:
    """The offline sample corpus (real text), else a synthetic one."""
    for command in (["sample", "--out", str(out)],
                    ["synthetic", "--out", str(out), "--docs", "20000", "--seed", "0"]):
        done = subprocess.run([sys.executable, "-m", "raychat.corpus", *command],
                              capture_output=True, text=True)
        if done.returncode == 0:
            print(f"corpus: `raychat.corpus {command[0]}` -> {out}")
            return out
        print(f"corpus: `raychat.corpus {command[0]}` failed: {done.stderr.strip().splitlines()[-1:]}")
    raise SystemExit("no corpus: pass --data-dir")


def train_rustbpe(data_dir: Path, vocab_size: int, max_chars: int, doc_cap: int) -> tiktoken.Encoding:
    """nanochat's recipe: rustbpe learns the merges (specials excluded), tiktoken encodes."""
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter_split_texts(data_dir, "train", max_chars, doc_cap),
                                vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding("rustbpe", pat_str=trainer.get_pattern(), mergeable_ranks=ranks,
                             special_tokens=specials)


def bench_training(data_dir: Path, out_dir: Path, args) -> None:
    rows = []
    for _ in range(args.repeats):  # alternate, so drift in machine load hits both alike
        _, wall, cpu = timed(lambda: train_tokenizer(data_dir, out_dir, args.vocab_size, args.max_chars,
                                                     args.doc_cap, log=lambda _: None))
        rows.append(("raychat (HF tokenizers)", wall, cpu))
        _, wall, cpu = timed(lambda: train_rustbpe(data_dir, args.vocab_size, args.max_chars, args.doc_cap))
        rows.append(("rustbpe (nanochat)", wall, cpu))
    meta = Tokenizer.load(out_dir).meta["trained_on"]
    print(f"\ntraining: vocab {args.vocab_size:,}, {meta['docs']:,} docs, {meta['chars'] / 1e6:,.1f} M chars "
          f"(doc cap {args.doc_cap:,}), {args.repeats} run(s) each")
    best = {}
    for name, wall, cpu in rows:
        print(f"  {name:<24} wall {wall:6.2f} s   cpu {cpu:6.2f} s")
        best[name] = min(best.get(name, (1e9, 1e9)), (wall, cpu))
    (ours_wall, ours_cpu), (base_wall, base_cpu) = best.values()
    print(f"  ratio raychat/rustbpe (best of each): wall {ours_wall / base_wall:.2f}x, "
          f"cpu {ours_cpu / base_cpu:.2f}x (target: wall <= 1.00x)")


def bench_encode(data_dir: Path, tokenizer: Tokenizer, args) -> None:
    texts = list(iter_split_texts(data_dir, "train", max_chars=args.encode_chars))
    megabytes = sum(len(text.encode()) for text in texts) / 1e6
    cores = available_cores()
    print(f"\nencode: {len(texts):,} docs, {megabytes:,.1f} MB, best of {args.repeats}")
    for threads in sorted({1, cores}):
        runs = [timed(lambda threads=threads: tokenizer.encode_batch(texts, threads=threads))[1:]
                for _ in range(args.repeats)]
        wall, cpu = min(runs)
        per_core = megabytes / wall / threads
        print(f"  {threads} thread(s): {megabytes / wall:6.1f} MB/s wall = {per_core:5.1f} MB/s per core "
              f"({megabytes / cpu:5.1f} MB per CPU-second); per core / target "
              f"{ENCODE_TARGET_MB_PER_CORE:.0f}: {per_core / ENCODE_TARGET_MB_PER_CORE:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="",
                        help="corpus (default: write the sample corpus to a temp dir)")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--max-chars", type=int, default=2_000_000_000, help="training characters")
    parser.add_argument("--doc-cap", type=int, default=10_000)
    parser.add_argument("--encode-chars", type=int, default=20_000_000, help="characters to encode")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each measurement (best is kept)")
    args = parser.parse_args()
    print(f"machine: {available_cores()} cores, load average {os.getloadavg()[0]:.1f} (other work running "
          "shows up here and in wall times)")
    with tempfile.TemporaryDirectory(prefix="raychat-bench-tok-") as tmp:
        data_dir = Path(args.data_dir) if args.data_dir else make_corpus(Path(tmp) / "data")
        out_dir = Path(tmp) / "tokenizer"
        bench_training(data_dir, out_dir, args)
        bench_encode(data_dir, Tokenizer.load(out_dir), args)


if __name__ == "__main__":
    main()
