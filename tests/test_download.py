"""`download` against a real HTTP server on 127.0.0.1 serving generated shards: flaky, truncating and
connection-dropping servers, resuming, and the CLI."""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raychat.common import RaychatError
from raychat.corpus import CorpusIndex, list_shards, read_unit_texts, shard_filename
from raychat.corpus_sources import synthetic_texts, write_synthetic_corpus
from raychat.download import MAX_SHARD, download_shards, reachable

REPO = Path(__file__).resolve().parents[1]
NUM_TRAIN = 3


@pytest.fixture(scope="module")
def served_files(tmp_path_factory) -> dict[str, bytes]:
    """ClimbMix-named files: train shards 0..2 and the val shard 6542, from a synthetic corpus."""
    made = tmp_path_factory.mktemp("served")
    write_synthetic_corpus(made, num_docs=4 * 1100, seed=9, docs_per_shard=1100, val_docs=1100)
    paths = [path for _, path in list_shards(made)]
    names = [shard_filename(i) for i in range(NUM_TRAIN)] + [shard_filename(MAX_SHARD)]
    return {name: path.read_bytes() for name, path in zip(names, paths, strict=True)}


class ShardServer:
    """Serves `files` with HEAD, GET and Range; `misbehave(name, request_number)` may return "fail"
    (HTTP 503), "truncate" (a short file with a matching Content-Length) or "drop" (the full
    Content-Length, half the body, then the connection closes). Records every request."""

    def __init__(self, files: dict[str, bytes], misbehave=lambda name, n: None):
        self.files, self.misbehave = files, misbehave
        self.requests: list[tuple[str, str, str | None]] = []  # (method, name, Range header)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_HEAD(self):
                self.respond(body=False)

            def do_GET(self):
                self.respond(body=True)

            def respond(self, body: bool):
                name = self.path.rsplit("/", 1)[-1]
                with server.lock:
                    server.requests.append((self.command, name, self.headers.get("Range")))
                    number = sum(1 for _, n, _ in server.requests if n == name)
                data = server.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                action = server.misbehave(name, number) if body else None
                if action == "fail":
                    self.send_error(503, "try again later")
                    return
                start = 0
                if self.headers.get("Range") and action is None:
                    start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                payload = data[start:]
                if action == "truncate":
                    payload = payload[:len(payload) // 2]
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    if action == "drop":
                        self.wfile.write(payload[:len(payload) // 2])
                        self.close_connection = True
                    else:
                        self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/datasets/climbmix/resolve/main"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ShardServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def gets(self, name: str) -> list[str | None]:
        return [rng for method, n, rng in self.requests if method == "GET" and n == name]


def fetch(server: ShardServer, data_dir: Path, **kw) -> list[str]:
    lines: list[str] = []
    kw = {"workers": 2, "retries": 3, "backoff_s": 0.01, "timeout_s": 10, "progress_interval_s": 0, **kw}
    download_shards(data_dir, NUM_TRAIN, base_url=server.url, log=lines.append, **kw)
    return lines


def assert_complete(data_dir: Path, served: dict[str, bytes]) -> None:
    assert sorted(p.name for p in data_dir.iterdir()) == sorted(served)  # no .tmp left behind
    for name, data in served.items():
        assert (data_dir / name).read_bytes() == data


def test_download_fetches_train_and_val_shards(tmp_path, served_files):
    with ShardServer(served_files) as server:
        assert reachable(server.url)
        lines = fetch(server, tmp_path / "data")
    assert_complete(tmp_path / "data", served_files)
    # The local layout is a valid corpus: shard_06542 is the last, so it is the val split.
    index = CorpusIndex.load(tmp_path / "data")
    assert {u.shard for u in index.val} == {MAX_SHARD} and index.num_train_docs == 3 * 1100
    assert [t for u in index.val for t in read_unit_texts(u)] == synthetic_texts(4400, seed=9)[3300:]
    assert any("4/4 files" in line and "MB/s" in line and "ETA" in line for line in lines)
    assert not reachable(server.url)  # server gone


def test_flaky_server_is_retried_with_backoff(tmp_path, served_files):
    def fail_first_two(name, number):
        return "fail" if number <= 2 else None

    with ShardServer(served_files, fail_first_two) as server:
        lines = fetch(server, tmp_path / "data", retries=3)
        assert all(len(server.gets(name)) == 3 for name in served_files)
    assert_complete(tmp_path / "data", served_files)
    retries = [line for line in lines if "retrying in" in line]
    assert len(retries) == 2 * len(served_files)
    assert sum("attempt 1/3" in line and "in 0.01s" in line for line in retries) == len(served_files)
    assert sum("attempt 2/3" in line and "in 0.02s" in line for line in retries) == len(served_files)

    with ShardServer(served_files, fail_first_two) as server, \
            pytest.raises(RaychatError, match=r"after 2 attempts .*503.*re-run the same command"):
        fetch(server, tmp_path / "not_enough", retries=2)
    assert not list_shards(tmp_path / "not_enough")


def test_truncated_file_is_refetched_never_kept(tmp_path, served_files):
    victim = shard_filename(1)

    def truncate_first(name, number):
        return "truncate" if name == victim and number == 1 else None

    with ShardServer(served_files, truncate_first) as server:
        fetch(server, tmp_path / "data")
        assert server.gets(victim) == [None, None]  # fetched again from the start, not resumed
    assert_complete(tmp_path / "data", served_files)

    # A server that always truncates: the download fails and nothing of that file stays on disk.
    with ShardServer(served_files, lambda name, n: "truncate" if name == victim else None) as server, \
            pytest.raises(RaychatError, match=rf"{victim} after 3 attempts \(received file is not a"):
        fetch(server, tmp_path / "bad")
    assert not (tmp_path / "bad" / victim).exists() and not (tmp_path / "bad" / (victim + ".tmp")).exists()


def test_dropped_connection_resumes_with_range(tmp_path, served_files):
    victim = shard_filename(MAX_SHARD)
    with ShardServer(served_files, lambda name, n: "drop" if name == victim and n == 1 else None) as server:
        fetch(server, tmp_path / "data")
        half = len(served_files[victim]) // 2
        assert server.gets(victim) == [None, f"bytes={half}-"]
    assert_complete(tmp_path / "data", served_files)


def test_rerun_skips_complete_files_and_replaces_damaged_ones(tmp_path, served_files):
    data_dir = tmp_path / "data"
    with ShardServer(served_files) as server:
        fetch(server, data_dir)
        requests_before = len(server.requests)
        lines = fetch(server, data_dir)
        assert len(server.requests) == requests_before  # nothing fetched again
        assert "4 of 4 files already present" in lines[0]
        damaged = data_dir / shard_filename(2)
        damaged.write_bytes(served_files[shard_filename(2)][:1000])
        lines = fetch(server, data_dir)
        assert [name for _, name, _ in server.requests[requests_before:]] == [shard_filename(2)]
    assert f"download: {shard_filename(2)} is damaged, fetching it again" in lines
    assert_complete(data_dir, served_files)


def test_download_cli(tmp_path, served_files):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with ShardServer(served_files) as server:
        result = subprocess.run(
            [sys.executable, "-m", "raychat.corpus", "download", "--shards", "2", "--base-url", server.url,
             "--data-dir", str(tmp_path / "d"), "--workers", "3"],
            capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "documents:  3,300 (train 2,200, val 1,100)" in result.stdout
        bad = subprocess.run([sys.executable, "-m", "raychat.corpus", "download", "--shards", "0",
                              "--base-url", server.url, "--data-dir", str(tmp_path / "e")],
                             capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"raychat: error: --shards must be between 1 and {MAX_SHARD} (the train shards of ClimbMix), got 0")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        shard_filename(0), shard_filename(1), shard_filename(MAX_SHARD)]
