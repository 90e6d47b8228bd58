"""The corpus in a bucket (moto's S3 server on 127.0.0.1): the corpus commands write and check it,
reads fetch only their row group, a changed or missing shard is named in one line, and a 2-worker
training run from the bucket trains on exactly what the same run from local disk trains on."""

import json
import pickle
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import s3_uri
from helpers import (
    COMMIT,
    NUM_TRAIN,
    STEP_LINE,
    VAL_LINE,
    HubServer,
    copy_to_bucket,
    final_model_state,
    log_lines,
    one_error_line,
    recorded_requests,
    run_corpus_cli,
    run_train,
    tiny_flags,
)
from trace_audit import read_trace

from raychat.checkpoint.format import read_meta
from raychat.common import RaychatError
from raychat.corpus.cli import main as corpus_main
from raychat.corpus.download import REPO_ID, download_shards
from raychat.corpus.files import TAIL_BYTES
from raychat.corpus.fixture import synthetic_texts
from raychat.corpus.index import (
    CorpusIndex,
    confirm_identity,
    read_corpus_meta,
    read_unit_texts,
    shard_filename,
)
from raychat.storage import Storage
from raychat.tokenizer.cli import main as tokenizer_main
from raychat.tokenizer.core import Tokenizer
from raychat.tokenizer.remote import local_copy
from testkit.trace import trace_env

TEXT = "Ray Data reads the corpus; the tokenizer comes from the bucket too."


def range_bytes(request: dict) -> int:
    """Bytes a GET asked for by its Range header ('bytes=a-b'); a GET without one asked for everything."""
    first, last = request["headers"]["Range"].split("=", 1)[1].split("-")
    return int(last) - int(first) + 1


@pytest.mark.integration  # moto's S3 server, commands in a reused interpreter
def test_corpus_commands_range_reads_and_damage_on_a_bucket(commands, s3_endpoint):
    uri = s3_uri(s3_endpoint, f"synthetic-{time.time_ns()}")
    # One train shard of 3 row groups (1024 + 1024 + 452 documents) and a val shard of 500.
    made = run_corpus_cli(commands, "synthetic", "--out", uri, "--docs", "3000", "--docs-per-shard", "3072",
                          "--val-docs", "500")
    assert made.returncode == 0, made.stderr
    assert f"corpus {uri}: OK" in made.stdout and "documents:  3,000 (train 2,500, val 500)" in made.stdout
    checked = run_corpus_cli(commands, "check", uri, "--deep")
    assert checked.returncode == 0 and "MB of text" in checked.stdout, checked.stderr

    index = CorpusIndex.load(uri)
    shard = index.train[1]
    assert (shard.shard, shard.row_group) == (0, 1)
    with recorded_requests(s3_endpoint) as requests:
        texts = read_unit_texts(shard, location=uri)
    assert texts == synthetic_texts(3000)[1024:2048]
    gets = [r for r in requests if r["method"] == "GET" and "shard_00000.parquet" in r["url"]]
    assert gets and all("Range" in r["headers"] for r in gets), "a read fetched a whole shard"
    # Exactly the footer's tail (64 KiB) and the middle row group's column chunk, nothing else.
    bucket = Storage(uri)
    metadata = pq.read_metadata(bucket.path("shard_00000.parquet"), filesystem=bucket.fs)
    chunk = metadata.row_group(1).column(0).total_compressed_size
    assert sum(map(range_bytes, gets)) == TAIL_BYTES + chunk < 0.6 * shard.size, (chunk, shard.size)

    # A replaced shard: a rank's start-up check and every read name it, in one line.
    bucket.write_bytes("shard_00001.parquet", bucket.read_bytes("shard_00000.parquet"))
    with pytest.raises(RaychatError, match="shard_00001.parquet changed") as changed:
        confirm_identity(index, "rank 1")
    assert "rank 1 sees another corpus" in str(changed.value) and "\n" not in str(changed.value)
    with pytest.raises(RaychatError, match=r"shard_00001\.parquet changed since the corpus was indexed"):
        read_unit_texts(index.val[0], location=uri)
    # A shard deleted under a reader: no retry brings it back, so one line naming the object, at once.
    bucket.delete("shard_00000.parquet")
    started = time.monotonic()
    with pytest.raises(RaychatError) as missing:
        read_unit_texts(shard, location=uri)
    message = str(missing.value)
    assert "shard_00000.parquet is gone" in message and "\n" not in message
    assert time.monotonic() - started < 3


@pytest.mark.integration  # moto's S3 server, a local HTTP server
def test_download_streams_the_hub_into_a_bucket_and_resumes(s3_endpoint, served_files, tmp_path,
                                                             monkeypatch, capsys):
    uri = s3_uri(s3_endpoint, f"climbmix-{time.time_ns()}")
    monkeypatch.setenv("RAYCHAT_HOME", str(tmp_path / "home"))  # the staging directory lives here
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with HubServer(served_files) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert corpus_main(["download", "--shards", str(NUM_TRAIN), "--data-dir", uri, "--workers", "2"]) == 0
        out = capsys.readouterr().out
        assert "2 of 4 files uploaded" in out and "4 of 4 files uploaded" in out  # a batch of 2 at a time
        assert f"corpus {uri}: OK" in out  # the bucket checked as a corpus afterwards
        bucket = Storage(uri)
        assert {name: bucket.read_bytes(name) for name in served_files} == served_files
        assert read_corpus_meta(uri) == {"source": "hub", "repo": REPO_ID, "revision": COMMIT}
        staging = tmp_path / "home" / "staging"
        assert not staging.exists() or not any(staging.iterdir())  # local disk kept no copy

        # A shard missing from the bucket (lost, or its upload killed) is fetched again; the rest are kept.
        lost = shard_filename(1)
        bucket.delete(lost)
        before = len(server.requests)
        lines: list[str] = []
        download_shards(uri, NUM_TRAIN, endpoint=server.url, workers=2, log=lines.append,
                        staging=tmp_path / "staging")
        fetched = {path.rsplit("/", 1)[-1] for method, path, _, _ in server.requests[before:]
                   if method == "GET" and "/resolve/" in path}
        assert fetched == {lost}, fetched
        assert "download: 3 of 4 files already in the bucket" in lines
        assert bucket.read_bytes(lost) == served_files[lost]
    index = CorpusIndex.load(uri)
    assert index.num_train_docs == NUM_TRAIN * 1100


@pytest.mark.integration  # moto's S3 server
def test_a_tokenizer_in_a_bucket_is_copied_once_per_node(s3_endpoint, tiny_corpus, tmp_path, monkeypatch):
    tokenizer_dir = tiny_corpus[1]
    uri = s3_uri(s3_endpoint, f"tokenizer-{time.time_ns()}")
    copy_to_bucket(tokenizer_dir, uri)
    monkeypatch.setenv("RAYCHAT_HOME", str(tmp_path / "home"))
    local = Tokenizer.load(tokenizer_dir)
    try:
        with recorded_requests(s3_endpoint) as first:
            remote = Tokenizer.load(uri)
        assert remote.fingerprint == local.fingerprint and remote.encode(TEXT) == local.encode(TEXT)
        assert remote.directory.is_relative_to(tmp_path / "home" / "tokenizers")
        assert pickle.loads(pickle.dumps(remote)).location == uri  # a Ray task re-opens the bucket's
        local_copy.cache_clear()  # as another process on this node
        with recorded_requests(s3_endpoint) as second:
            assert Tokenizer.load(uri).fingerprint == local.fingerprint
        assert any(r["method"] == "GET" and "tokenizer.tiktoken" in r["url"] for r in first)
        gets = [r["url"] for r in second if r["method"] == "GET"]
        assert gets and all("meta.json" in url for url in gets), gets  # the cache is current: meta only
    finally:
        local_copy.cache_clear()
    with pytest.raises(RaychatError, match="train writes a local directory, not s3://"):
        tokenizer_main(["train", "--tokenizer-dir", uri])


@pytest.mark.ray
def test_training_from_a_bucket_trains_what_local_disk_does_and_refuses_a_changed_shard(
        ray_session, tiny_corpus, tmp_path, s3_endpoint):
    data_dir, tokenizer_dir = tiny_corpus
    uri = s3_uri(s3_endpoint, f"tiny-{time.time_ns()}")
    bucket = copy_to_bucket(data_dir, uri)
    tokenizer_uri = s3_uri(s3_endpoint, f"tiny-tokenizer-{time.time_ns()}")
    copy_to_bucket(tokenizer_dir, tokenizer_uri)  # the bucket run reads its tokenizer from there too
    storage = tmp_path / "runs"
    flags = ["--num-workers", "2", "--total-batch-size", "1024", "--num-iterations", "12",
             "--eval-every", "6", "--save-every", "6"]
    runs = {}
    for name, inputs in (("local", (data_dir, tokenizer_dir)), ("bucket", (uri, tokenizer_uri))):
        (tmp_path / name).mkdir()
        train_flags = tiny_flags(inputs, storage, name, *flags)
        runs[name] = subprocess.Popen(
            [sys.executable, "-m", "raychat.train", *train_flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=ray_session.driver_env(**trace_env(tmp_path / name)))
    outputs = {}
    try:
        for name, proc in runs.items():
            outputs[name], _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, outputs[name][-3000:]
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
    losses = {name: [m.group(4) for m in log_lines(out, STEP_LINE)] for name, out in outputs.items()}
    bpbs = {name: [float(m.group(2)) for m in log_lines(out, VAL_LINE)] for name, out in outputs.items()}
    assert len(losses["bucket"]) == 12 and losses["bucket"] == losses["local"]
    assert bpbs["bucket"] == bpbs["local"] and bpbs["bucket"] == sorted(bpbs["bucket"], reverse=True), bpbs
    assert len(set(bpbs["bucket"])) == 3  # it learns: validation bpb falls at steps 0, 6, 12
    # The same documents, step by step, and the same weights at the end.
    assert read_trace(tmp_path / "bucket") == read_trace(tmp_path / "local")
    local_state = final_model_state(Storage(str(storage)).child("local"))
    bucket_state = final_model_state(Storage(str(storage)).child("bucket"))
    assert all((local_state[k] == bucket_state[k]).all() for k in local_state)
    # The checkpoint names the corpus it was trained on; the URI's query (maybe credentials) is not kept.
    corpus = read_meta(Storage(str(storage)).child("bucket", "checkpoint_000012")).corpus
    assert corpus.identity == CorpusIndex.load(uri).identity() and corpus.location == uri.split("?")[0]
    assert corpus.source == "custom"

    # A shard replaced in the bucket since the checkpoint: the driver refuses to resume, in one line.
    bucket.write_bytes("shard_00003.parquet", (data_dir / "shard_00004.parquet").read_bytes())
    resumed = run_train(ray_session, tiny_flags((uri, tokenizer_dir), storage, "bucket", *flags[:4],
                                                "--num-iterations", "18"))
    line = one_error_line(resumed)
    assert "shard_00003.parquet changed" in line and "checkpoint_000012" in line, line
    assert not log_lines(resumed.stdout, STEP_LINE)


@pytest.mark.ray
def test_a_shard_deleted_mid_run_ends_the_run_in_one_line(ray_session, tiny_corpus, tmp_path, s3_endpoint):
    data_dir, tokenizer_dir = tiny_corpus
    uri = s3_uri(s3_endpoint, f"doomed-{time.time_ns()}")
    bucket = copy_to_bucket(data_dir, uri)
    index = CorpusIndex.load(uri)
    last_train = f"shard_{index.train[-1].shard:05d}.parquet"
    trace = tmp_path / "trace"
    trace.mkdir()
    flags = ["--num-workers", "2", "--total-batch-size", "1024", "--num-iterations", "200",
             "--eval-every", "-1", "--save-every", "-1", "--max-failures", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "raychat.train",
                             *tiny_flags((uri, tokenizer_dir), tmp_path / "runs", "doomed", *flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ray_session.driver_env(**trace_env(trace)))
    try:
        # Delete the epoch's last train shard once training runs: no rank has read that far yet.
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not any(
                json.loads(line)["step"] >= 1 for path in trace.glob("*.jsonl")
                for line in path.read_text().splitlines()):
            time.sleep(0.2)
        bucket.delete(last_train)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert f"{last_train} is gone" in line, line
    assert len(log_lines(out, STEP_LINE)) < 200


@pytest.mark.integration  # moto's S3 server, commands in a reused interpreter
def test_a_corpus_written_to_a_bucket_that_cannot_take_it_is_one_line(commands, s3_endpoint):
    """`synthetic --out` (as every command that writes a corpus) to a bucket that does not exist or an
    endpoint whose host does not resolve: one line naming --out, the bucket and the fix, no traceback."""
    cases = {s3_uri(s3_endpoint, "corpus", bucket="no-such-bucket"): "the bucket does not exist",
             "s3://bucket/corpus?endpoint_override=minio.no-such-host.invalid:9000&scheme=http":
                 "the endpoint's host minio.no-such-host.invalid cannot be resolved"}
    for uri, reason in cases.items():
        line = one_error_line(run_corpus_cli(commands, "synthetic", "--out", uri, "--docs", "10"))
        assert line.startswith(f"raychat: error: --out {uri}") and reason in line, line
