"""`download` through huggingface_hub against a local server on 127.0.0.1 that speaks the Hub's protocol
(the dataset API, paths-info, `resolve` with HEAD/GET/Range), selected with HF_ENDPOINT: pinning to a
commit, resuming, rejecting corrupted and truncated files, the unreachable-endpoint error, the CLI."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import COMMIT, NUM_TRAIN, REPO, VAL_DOCS, HubServer

from raychat.common import RaychatError
from raychat.corpus.download import MAX_SHARD, REPO_ID, download_shards
from raychat.corpus.fixture import synthetic_texts
from raychat.corpus.index import CorpusIndex, list_shards, read_corpus_meta, read_unit_texts, shard_filename

pytestmark = pytest.mark.integration  # a local HTTP server, a subprocess, commands in a reused interpreter


def resumed_from(range_header: str | None) -> int:
    """Where a GET asked to start ("bytes=N-"); 0 for a GET of the whole file."""
    return int(range_header.removeprefix("bytes=").rstrip("-")) if range_header else 0


def fetch(server: HubServer, data_dir: Path, **kw) -> list[str]:
    lines: list[str] = []
    download_shards(data_dir, NUM_TRAIN, endpoint=server.url, workers=2, log=lines.append, **kw)
    return lines


def assert_complete(data_dir: Path, served: dict[str, bytes]) -> None:
    assert sorted(path.name for _, path in list_shards(data_dir)) == sorted(served)
    for name, data in served.items():
        assert (data_dir / name).read_bytes() == data


def cli_env(endpoint: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_ENDPOINT": endpoint,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def test_download_fetches_train_and_val_shards_from_one_commit(tmp_path, served_files, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    data_dir = tmp_path / "data"
    with HubServer(served_files) as server:
        fetch(server, data_dir)
        resolves = [path for method, path, _, _ in server.requests if "/resolve/" in path]
        assert resolves and all(f"/resolve/{COMMIT}/" in path for path in resolves)  # pinned, not `main`
        assert {auth for *_, auth in server.requests} == {"Bearer hf_test_token"}  # HF_TOKEN honoured
        before = len(server.requests)
        fetch(server, data_dir)  # complete files are kept: nothing is fetched again
        assert not [r for r in server.requests[before:] if r[0] == "GET" and "/resolve/" in r[1]]
    assert_complete(data_dir, served_files)
    assert read_corpus_meta(data_dir) == {"source": "hub", "repo": REPO_ID, "revision": COMMIT}
    # The local layout is a valid corpus: shard_06542 is the last, so it is the val split.
    index = CorpusIndex.load(data_dir)
    assert {u.shard for u in index.val} == {MAX_SHARD} and index.num_train_docs == 3 * 1100
    val_texts = [t for u in index.val for t in read_unit_texts(u)]
    assert val_texts == synthetic_texts(3300 + VAL_DOCS, seed=9)[3300:]


def test_another_revision_into_a_pinned_corpus_is_refused(tmp_path, served_files):
    with HubServer(served_files) as server:
        fetch(server, tmp_path / "data")
        with pytest.raises(RaychatError, match=f"at commit {COMMIT}, --revision {'f' * 40}"):
            fetch(server, tmp_path / "data", revision="f" * 40)


def test_dropped_connection_resumes_with_range(tmp_path, served_files):
    victim = shard_filename(MAX_SHARD)
    with HubServer(served_files, lambda name, n: "drop" if name == victim and n == 1 else None) as server:
        fetch(server, tmp_path / "data")
        first, resumed = server.gets(victim)
        assert first is None and resumed_from(resumed) > 0
    assert_complete(tmp_path / "data", served_files)


def test_a_killed_download_keeps_its_complete_files(tmp_path, served_files):
    # huggingface_hub (2.4) resumes a partial file within one process (above); a partial file of a killed
    # process goes to a uniquely named temp file that the next run does not pick up, so what a re-run
    # keeps is every complete file.
    victim = shard_filename(MAX_SHARD)
    data_dir = tmp_path / "data"
    with HubServer(served_files, lambda name, n: "stall" if name == victim else None) as server:
        process = subprocess.Popen(
            [sys.executable, "-m", "raychat.corpus", "download", "--shards", str(NUM_TRAIN), "--data-dir",
             str(data_dir), "--workers", "1"], env=cli_env(server.url),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert server.stalled.wait(60), "the download never reached the stalled file"
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    assert not (data_dir / victim).exists()
    with HubServer(served_files) as server:
        fetch(server, data_dir)
        fetched = [path.rsplit("/", 1)[-1] for method, path, *_ in server.requests
                   if method == "GET" and "/resolve/" in path]
        assert fetched == [victim]
    assert_complete(data_dir, served_files)


def test_corrupted_file_is_rejected_and_fetched_again(tmp_path, served_files):
    victim = shard_filename(2)
    with HubServer(served_files, lambda name, n: "corrupt" if name == victim and n == 1 else None) as server:
        lines = fetch(server, tmp_path / "data")
        assert len(server.gets(victim)) == 2
    assert any(line.startswith(f"download: {victim} rejected (sha256 ") for line in lines)
    assert_complete(tmp_path / "data", served_files)

    with HubServer(served_files, lambda name, n: "corrupt" if name == victim else None) as server, \
            pytest.raises(RaychatError, match=rf"{victim} from .* was rejected twice \(sha256 "):
        fetch(server, tmp_path / "bad")
    assert not (tmp_path / "bad" / victim).exists()


def test_truncated_file_is_never_kept_and_a_rerun_completes_it(tmp_path, served_files):
    victim = shard_filename(0)
    with HubServer(served_files, lambda name, n: "truncate" if name == victim else None) as server, \
            pytest.raises(RaychatError, match=r"could not fetch .*re-run the same command"):
        fetch(server, tmp_path / "data")
    assert not (tmp_path / "data" / victim).exists()
    with HubServer(served_files) as server:
        fetch(server, tmp_path / "data")
    assert_complete(tmp_path / "data", served_files)


def test_cli_downloads_and_fails_in_one_line_when_the_endpoint_is_unreachable(commands, tmp_path,
                                                                             served_files):
    """Both commands as a user runs them, in one reused interpreter (conftest.py's `commands`)."""
    with HubServer(served_files) as server:
        result = commands.run("raychat.corpus", "download", "--shards", "2", "--data-dir", tmp_path / "d",
                              "--workers", "3", env=cli_env(server.url), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "documents:  12,200 (train 2,200, val 10,000)" in result.stdout
    assert f"source:     {REPO_ID} @ {COMMIT}" in result.stdout

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    result = commands.run("raychat.corpus", "download", "--shards", "2", "--data-dir", tmp_path / "e",
                          env=cli_env(dead), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"raychat: error: could not fetch {REPO_ID} from {dead}")
    assert "HF_ENDPOINT" in lines[0]
    assert not list_shards(tmp_path / "e")
