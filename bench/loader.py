"""Tokens/sec delivered to one rank by raychat's TrainLoader vs a nanochat-style reference loader.

The reference is written here, after nanochat's dataloader: one process reads row groups with
pyarrow, encodes 128 documents at a time with tiktoken on 4 threads, prepends BOS, and packs rows
with a linear scan of its 1000-document list per placement (best fit, else crop the shortest),
copying each document into the row through torch.tensor. One deliberate difference: its list is
topped up to exactly 1000 documents one at a time (nanochat appends the whole 128-document batch),
the rule raychat's packer uses. raychat's loader (rank 0 of 1) tokenizes with Ray Data tasks in
parallel and packs with the bucketed packer. Both see the same documents in the same order, so
their rows must be identical; the bench checks that before timing anything.

    python -m bench.loader                       # sample corpus (written to a temp dir if needed)
    python -m bench.loader --data-dir DIR --tokenizer-dir TOK --seconds 20
    python -m bench.loader --bucket --latency-ms 0,30    # the same loader from an S3 bucket

Prints, per (B, T): sustained tokens/sec of both, their ratio (target >= 3x) and the fraction of
consumed tokens each dropped by crops (should agree within 1 point).

With --bucket it instead compares raychat's loader on the same corpus read from local disk and from
an S3 bucket (moto on 127.0.0.1 in its own process, testkit/s3_server.py), once per first-byte delay
the server adds to every request (a real bucket: 20-50 ms): tokens/s from the bucket over tokens/s
from disk in the same run (target >= 0.9x), and the bytes the server sent over the bytes of the
documents delivered (range reads: ~1x plus each read's footer tail; read-ahead in flight counts).
"""

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from itertools import cycle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from raychat.common import RaychatError, default_data_dir, run_cli
from raychat.corpus.index import CorpusIndex, list_shards, read_unit_texts
from raychat.data.loader import TrainLoader
from raychat.data.packer import BestFitPacker
from raychat.storage import Storage
from raychat.tokenizer.core import Tokenizer, available_cores
from raychat.tokenizer.train import train_tokenizer
from testkit.s3_server import start_moto

CONFIGS = [(8, 2048), (32, 512)]


def reference_documents(index: CorpusIndex, tokenizer: Tokenizer, threads: int = 4, batch: int = 128):
    """nanochat's document stream: row groups in order, `batch` texts at a time through tiktoken's
    batch encoder on `threads` threads, BOS prepended; endless."""
    while True:
        for unit in index.train:
            texts = pq.ParquetFile(unit.path).read_row_group(unit.row_group).column("text").to_pylist()
            for i in range(0, len(texts), batch):
                for ids in tokenizer.encoding.encode_ordinary_batch(texts[i:i + batch], num_threads=threads):
                    ids.insert(0, tokenizer.bos_id)
                    yield ids


class ReferenceLoader:
    """nanochat's BOS-aligned best-fit packing: a Python list scanned in full for every placement."""

    def __init__(self, docs: Iterator[list[int]], B: int, T: int, buffer_size: int = 1000):
        self.docs = docs
        self.B, self.T, self.buffer_size = B, T, buffer_size
        self.buffer: list[list[int]] = []
        self.row_buffer = torch.empty((B, T + 1), dtype=torch.long)
        self.tokens_in = 0
        self.tokens_out = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = self.T + 1
        for r in range(self.B):
            pos = 0
            while pos < capacity:
                while len(self.buffer) < self.buffer_size:
                    self.buffer.append(next(self.docs))
                space = capacity - pos
                best, best_len = -1, 0
                for i, doc in enumerate(self.buffer):
                    n = len(doc)
                    if n <= space and n > best_len:
                        best, best_len = i, n
                if best >= 0:
                    doc = self.buffer.pop(best)
                    self.row_buffer[r, pos:pos + len(doc)] = torch.tensor(doc, dtype=torch.long)
                    pos += len(doc)
                else:
                    shortest = min(range(len(self.buffer)), key=lambda i: len(self.buffer[i]))
                    doc = self.buffer.pop(shortest)
                    self.row_buffer[r, pos:] = torch.tensor(doc[:space], dtype=torch.long)
                    pos = capacity
                self.tokens_in += len(doc)
        self.tokens_out += self.B * capacity
        return self.row_buffer[:, :-1].clone(), self.row_buffer[:, 1:].clone()

    def cropped_fraction(self) -> float:
        return 1 - self.tokens_out / self.tokens_in


class PackerOnly:
    """raychat's packer alone over already tokenized documents, rows split as TrainLoader does."""

    def __init__(self, docs: Iterator[np.ndarray], B: int, T: int):
        self.docs, self.B, self.T = docs, B, T
        self.packer = BestFitPacker(T + 1, 1000)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.empty((self.B, self.T + 1), dtype=np.int64)
        self.packer.fill(rows, lambda: (None, next(self.docs)))
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


def timed(next_batch, warmup: int, seconds: float | None = None, batches: int | None = None,
          with_descendants: bool = False, warmup_seconds: float = 0.0):
    """Run `warmup` batches, and more until `warmup_seconds` have passed (the first batch timed
    alone), then `batches` batches or as many as fit in `seconds`. Returns (seconds to the first
    batch, batches timed, seconds they took, CPU seconds they took, warm-up batches' inputs)."""
    start = time.perf_counter()
    inputs = [next_batch()[0]]
    first = time.perf_counter() - start
    while len(inputs) < warmup or time.perf_counter() - start < warmup_seconds:
        inputs.append(next_batch()[0])
    start, cpu, count = time.perf_counter(), cpu_seconds(with_descendants), 0
    while (count < batches) if batches is not None else (time.perf_counter() - start < seconds):
        next_batch()
        count += 1
    return first, count, time.perf_counter() - start, cpu_seconds(with_descendants) - cpu, inputs


def cpu_seconds(with_descendants: bool) -> float:
    """User + system CPU seconds of this process, plus every process it started (Ray's) if asked."""
    parent_and_ticks = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()   # after "pid (name) ": state, ppid, ...
            parent_and_ticks[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    pids, frontier = {os.getpid()}, {os.getpid()}
    while with_descendants and frontier:
        frontier = {pid for pid, (ppid, _) in parent_and_ticks.items() if ppid in frontier} - pids
        pids |= frontier
    return sum(parent_and_ticks[pid][1] for pid in pids if pid in parent_and_ticks) / os.sysconf("SC_CLK_TCK")


def corpus_and_tokenizer(args, workdir: Path) -> tuple[CorpusIndex, str, str]:
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    what = f"corpus {data_dir}"
    if not data_dir.is_dir() or not list_shards(data_dir):
        from raychat.corpus.fixture import write_synthetic_corpus
        from raychat.corpus.sample import write_sample_corpus

        data_dir = workdir / "data"
        try:
            write_sample_corpus(data_dir, log=lambda _: None)
            what = "sample corpus (python -m raychat.corpus sample)"
        except RaychatError:
            write_synthetic_corpus(data_dir, 20_000, seed=0)
            what = "synthetic corpus (20,000 documents)"
    index = CorpusIndex.load(data_dir)
    tokenizer_dir = args.tokenizer_dir
    if not tokenizer_dir:
        tokenizer_dir = str(workdir / "tokenizer")
        train_tokenizer(data_dir, tokenizer_dir, vocab_size=args.vocab_size, log=lambda _: None)
    return index, tokenizer_dir, what


def recorder(endpoint: str, action: str) -> str:
    """moto's request recorder: reset-recording, start-recording, stop-recording, download-recording."""
    import urllib.request

    method = "GET" if action == "download-recording" else "POST"
    request = urllib.request.Request(f"http://{endpoint}/moto-api/recorder/{action}", method=method)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def served_bytes(recording: str, sizes: dict[str, int]) -> int:
    """Bytes the recorded GETs asked for: their Range, or the whole object without one."""
    import json

    total = 0
    for line in filter(None, recording.splitlines()):
        request = json.loads(line)
        if request["method"] != "GET":
            continue
        if "Range" in request["headers"]:
            first, last = request["headers"]["Range"].split("=", 1)[1].split("-")
            total += int(last) - int(first) + 1
        else:
            total += sizes.get(request["url"].split("?")[0].rsplit("/", 1)[-1], 0)
    return total


def compare_bucket(index: CorpusIndex, tokenizer_dir: str, args) -> None:
    """raychat's loader from local disk, then from the bucket at each delay, for the same batches."""
    import pyarrow.fs as pafs

    B, T = CONFIGS[0]
    local_dir = Path(index.data_dir)
    sizes = {path.name: path.stat().st_size for _, path in list_shards(local_dir)}
    bytes_per_doc = sum(sizes.values()) / (index.num_train_docs + index.num_val_docs)
    with TrainLoader(index, tokenizer_dir, T, 0, 1, data_tasks=args.num_cpus) as loader:
        _, n, local_seconds, _, _ = timed(lambda: loader.next_rows(B), 5, seconds=args.seconds)
    local_rate = n * B * T / local_seconds
    print(f"B={B} T={T} local disk: {local_rate / 1e6:.3f} M tok/s over {n} batches", flush=True)
    for delay in [float(d) for d in args.latency_ms.split(",")]:
        server, endpoint = start_moto("raychat-bench", delay)
        try:
            uri = f"s3://raychat-bench/corpus?endpoint_override={endpoint}&scheme=http"
            bucket = Storage(uri)
            pafs.copy_files(str(local_dir), bucket.root, destination_filesystem=bucket.fs)
            remote = CorpusIndex.load(uri)
            recorder(endpoint, "reset-recording")
            recorder(endpoint, "start-recording")
            with TrainLoader(remote, tokenizer_dir, T, 0, 1, data_tasks=args.num_cpus,
                             record_consumed=True) as loader:
                _, _, seconds, _, _ = timed(lambda: loader.next_rows(B), 5, batches=n)
                documents = len(loader.consumed_doc_ids())
            recorder(endpoint, "stop-recording")
            read = served_bytes(recorder(endpoint, "download-recording"), sizes)
        finally:
            server.terminate()
            server.wait(timeout=30)
        rate = n * B * T / seconds
        print(f"B={B} T={T} bucket, {delay:g} ms per request: {rate / 1e6:.3f} M tok/s | ratio to local disk "
              f"{rate / local_rate:.2f}x | read {read / 1e6:.1f} MB for {documents:,} documents "
              f"({read / (documents * bytes_per_doc):.2f}x their bytes)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="", help="corpus (default: $RAYCHAT_HOME/data if it has "
                        "shards, else the sample corpus written to a temp dir)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer (default: train one on the corpus)")
    parser.add_argument("--vocab-size", type=int, default=32768, help="vocab of the tokenizer trained here")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per loader and shape")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="the reference runs this long "
                        "before the clock starts, raychat as many batches (past Ray Data's start-up)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs of the local Ray instance")
    parser.add_argument("--bucket", action="store_true", help="compare raychat's loader reading from an S3 "
                        "bucket (a local moto server) with local disk, instead of the reference loader")
    parser.add_argument("--latency-ms", default="0,30", help="with --bucket: delays the S3 server adds to "
                        "every request, comma-separated (default 0,30; a real bucket's first byte: 20-50)")
    args = parser.parse_args(argv)

    import ray

    with tempfile.TemporaryDirectory(prefix="raychat_bench_loader_") as tmp:
        index, tokenizer_dir, what = corpus_and_tokenizer(args, Path(tmp))
        tokenizer = Tokenizer.load(tokenizer_dir)
        cores = available_cores()
        print(f"{what}: {len(index.train)} train row groups, {index.num_train_docs:,} documents; "
              f"tokenizer vocab {tokenizer.vocab_size:,}; {cores} cores", flush=True)

        # The ceiling on this machine: tiktoken alone, every core, no packing.
        texts = read_unit_texts(index.train[0])
        start = time.perf_counter()
        encoded = tokenizer.encoding.encode_ordinary_batch(texts, num_threads=cores)
        seconds = time.perf_counter() - start
        docs = [[tokenizer.bos_id, *ids] for ids in encoded]
        rate = sum(map(len, docs)) / seconds
        print(f"tokenizing alone (tiktoken, {cores} threads): {rate / 1e6:.2f} M tok/s", flush=True)
        arrays = [np.array(doc, dtype=np.int32) for doc in docs]

        ray.init(num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False,
                 log_to_driver=False)
        try:
            if args.bucket:
                compare_bucket(index, tokenizer_dir, args)
                return 0
            for B, T in CONFIGS:
                # Packing alone, on the same already tokenized documents.
                ref_pack = ReferenceLoader(cycle(docs), B, T)
                _, n, ref_seconds, _, ref_inputs = timed(ref_pack.next_batch, 5, seconds=args.seconds / 2)
                _, _, seconds, _, inputs = timed(PackerOnly(cycle(arrays), B, T).next_batch, 5, batches=n)
                same = all(torch.equal(a, b) for a, b in zip(ref_inputs, inputs, strict=True))
                ref_rate, rate = n * B * T / ref_seconds, n * B * T / seconds
                print(f"B={B:>2} T={T:>4} packing alone: reference {ref_rate / 1e6:6.2f} M tok/s | raychat "
                      f"packer {rate / 1e6:6.2f} M tok/s | ratio {rate / ref_rate:.1f}x | same rows: "
                      f"{'yes' if same else 'NO'}", flush=True)

                # The whole loader. Same documents, same order, same algorithm: the same rows, batch
                # for batch; both run the same number of batches, so their cropped fractions agree.
                reference = ReferenceLoader(reference_documents(index, tokenizer), B, T)
                ref_first, n, ref_seconds, ref_cpu, ref_inputs = timed(
                    reference.next_batch, 1, seconds=args.seconds, warmup_seconds=args.warmup_seconds)
                with TrainLoader(index, tokenizer_dir, T, 0, 1, data_tasks=args.num_cpus) as ours:
                    first, _, seconds, cpu, inputs = timed(lambda b=B: ours.next_rows(b), len(ref_inputs),
                                                           batches=n, with_descendants=True)
                    cropped = ours.cropped_fraction()
                same = all(torch.equal(a, b) for a, b in zip(ref_inputs, inputs, strict=True))
                ref_rate, rate = n * B * T / ref_seconds, n * B * T / seconds
                # CPU seconds per million delivered tokens: the reference process alone; raychat's
                # process plus all of Ray's (workers, raylet, GCS). Steadier than wall time on a
                # shared machine.
                ref_cost, cost = ref_cpu / (n * B * T / 1e6), cpu / (n * B * T / 1e6)
                print(f"B={B:>2} T={T:>4} loader, {n} batches after {len(ref_inputs)}: "
                      f"reference {ref_rate / 1e6:5.2f} M tok/s "
                      f"(cropped {100 * reference.cropped_fraction():.1f}%, first batch {ref_first:.1f}s) | "
                      f"raychat {rate / 1e6:5.2f} M tok/s (cropped {100 * cropped:.1f}%, first batch "
                      f"{first:.1f}s) | ratio {rate / ref_rate:.2f}x | same rows: {'yes' if same else 'NO'}",
                      flush=True)
                print(f"B={B:>2} T={T:>4} CPU per M tokens: reference {ref_cost:.2f}s | raychat "
                      f"{cost:.2f}s | ratio {ref_cost / cost:.2f}x", flush=True)
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    run_cli(main)
