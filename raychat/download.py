"""Fetch ClimbMix shards (karpathy/climbmix-400b-shuffle on Hugging Face), the corpus nanochat trains on.

A shard is ~100 MB, so files are streamed to disk in 1 MB chunks (never held in memory), several at a
time to fill the link. Each goes to `<name>.tmp` and is renamed only after it opens as parquet with a
`text` column, so a file with the final name is always complete: re-running skips those and resumes
partial `.tmp` files with an HTTP Range request. Failed attempts are retried with exponential backoff.
"""

import http.client
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from raychat.common import RaychatError
from raychat.corpus import open_shard, shard_filename

DEFAULT_BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
MAX_SHARD = 6542          # shard_06542.parquet is the last file, the validation split
DEFAULT_SHARDS = 8        # what the trainer's embedded default fetches (~800 MB)
CHUNK_BYTES = 1 << 20
USER_AGENT = "raychat-corpus-download"


def shard_url(base_url: str, shard: int) -> str:
    return f"{base_url.rstrip('/')}/{shard_filename(shard)}"


def reachable(base_url: str = DEFAULT_BASE_URL, timeout_s: float = 5.0) -> bool:
    """Whether the validation shard answers a HEAD request within timeout_s."""
    request = urllib.request.Request(shard_url(base_url, MAX_SHARD), method="HEAD",
                                     headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status < 400
    except (OSError, http.client.HTTPException, ValueError):
        return False


class _Progress:
    """Bytes and files done, rate and ETA, shared by the download threads; one line at most every interval."""

    def __init__(self, num_files: int, log: Callable[[str], None], interval_s: float):
        self.num_files, self.log, self.interval_s = num_files, log, interval_s
        self.lock = threading.Lock()
        self.files_done = 0
        self.bytes_done = 0
        self.sizes: dict[str, int] = {}  # expected size of files whose size is known
        self.start = self.last_print = time.monotonic()
        self.tty = sys.stdout.isatty() and log is print

    def expect(self, name: str, size: int) -> None:
        with self.lock:
            self.sizes[name] = size

    def add(self, num_bytes: int) -> None:
        with self.lock:
            self.bytes_done += num_bytes
            if time.monotonic() - self.last_print >= self.interval_s:
                self._print()

    def file_done(self) -> None:
        with self.lock:
            self.files_done += 1
            self._print()

    def _print(self) -> None:
        self.last_print = now = time.monotonic()
        rate = self.bytes_done / max(now - self.start, 1e-9)
        known = sum(self.sizes.values())
        # Files not started yet are assumed to be as large as the average known one.
        average = known / len(self.sizes) if self.sizes else 0
        total = known + average * (self.num_files - len(self.sizes))
        eta = f"{max(total - self.bytes_done, 0) / rate:,.0f}s" if rate > 0 and total else "?"
        line = (f"download: {self.files_done}/{self.num_files} files, {self.bytes_done / 1e6:,.1f}/"
                f"{total / 1e6:,.1f} MB, {rate / 1e6:,.1f} MB/s, ETA {eta}")
        if self.tty:
            print("\r" + line, end="\n" if self.files_done == self.num_files else "", flush=True)
        else:
            self.log(line)


class _Incomplete(Exception):
    """The transfer ended early; the .tmp file is kept and the next attempt resumes it."""


def _stream(url: str, tmp: Path, timeout_s: float, progress: _Progress) -> None:
    """Append the rest of `url` to `tmp` (all of it if tmp is absent or the server ignores Range)."""
    have = tmp.stat().st_size if tmp.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the .tmp holds the whole file already
            return
        raise
    with response:
        resumed = response.status == 206
        if not resumed:
            have = 0
        length = response.headers.get("Content-Length")
        expected = int(length) if length is not None else None
        if expected is not None:
            progress.expect(tmp.name, have + expected)
        received = 0
        with open(tmp, "ab" if resumed else "wb") as f:
            while chunk := response.read(CHUNK_BYTES):
                f.write(chunk)
                received += len(chunk)
                progress.add(len(chunk))
    if expected is not None and received != expected:
        raise _Incomplete(f"got {received} of {expected} bytes")


def _fetch(url: str, final: Path, retries: int, backoff_s: float, timeout_s: float, progress: _Progress,
           log: Callable[[str], None]) -> None:
    tmp = final.with_name(final.name + ".tmp")
    problem = ""
    for attempt in range(1, retries + 1):
        try:
            _stream(url, tmp, timeout_s, progress)
            open_shard(tmp)  # complete parquet with a `text` column, or RaychatError
            os.replace(tmp, final)
            progress.file_done()
            return
        except (OSError, http.client.HTTPException, _Incomplete) as e:
            problem = " ".join(str(e).split()) or type(e).__name__
        except RaychatError:
            # The whole body arrived but is not a usable shard: never keep it, start over next time.
            problem = "received file is not a complete parquet shard with a `text` column"
            tmp.unlink(missing_ok=True)
        if attempt < retries:
            delay = backoff_s * 2 ** (attempt - 1)
            log(f"download: {final.name} attempt {attempt}/{retries} failed ({problem}); "
                f"retrying in {delay:g}s")
            time.sleep(delay)
    raise RaychatError(f"could not download {url} after {retries} attempts ({problem}): check the network "
                       "and --base-url, then re-run the same command (complete files are kept, partial "
                       "ones resumed)")


def download_shards(data_dir: str | Path, num_shards: int, base_url: str = DEFAULT_BASE_URL, workers: int = 8,
                    retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 30.0,
                    log: Callable[[str], None] = print, progress_interval_s: float = 5.0) -> list[Path]:
    """Fetch train shards 0..num_shards-1 and the validation shard into data_dir; returns their paths.
    Files already there and valid are kept; damaged ones are fetched again."""
    if not 1 <= num_shards <= MAX_SHARD:
        raise RaychatError(f"--shards must be between 1 and {MAX_SHARD} (the train shards of ClimbMix), "
                           f"got {num_shards}")
    if workers < 1 or retries < 1:
        raise RaychatError(f"--workers and --retries must be at least 1, got {workers} and {retries}")
    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    shards = list(range(num_shards)) + [MAX_SHARD]
    finals = [data_dir / shard_filename(shard) for shard in shards]
    todo = []
    for shard, final in zip(shards, finals, strict=True):
        if final.exists():
            try:
                open_shard(final)
                continue
            except RaychatError:
                log(f"download: {final.name} is damaged, fetching it again")
                final.unlink()
        todo.append((shard, final))
    log(f"download: {len(finals) - len(todo)} of {len(finals)} files already present in {data_dir}, "
        f"fetching {len(todo)} with {min(workers, max(len(todo), 1))} parallel streams")
    progress = _Progress(len(todo), log, progress_interval_s)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_fetch, shard_url(base_url, shard), final, retries, backoff_s, timeout_s,
                               progress, log) for shard, final in todo]
        for future in as_completed(futures):
            if future.exception() is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise future.exception()
    return finals
