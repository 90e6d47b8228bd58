"""Storage faults sorted by what they are (raychat.faults), provoked for real: pyarrow's S3 client
talking to moto's server through the fault-injecting proxy (testkit.fault_proxy). Transient faults
are ridden out with one line per incident, past the budget they fail the attempt as a plain
exception, and only what the user must fix is a RaychatError."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TEST_BUCKET, gcs_uri, s3_uri
from helpers import copy_to_bucket, one_error_line

from raychat import faults
from raychat import storage as storage_module
from raychat.checkpoint import fence
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.saver import AsyncCheckpointWriter
from raychat.checkpoint.sharded import Piece, save_checkpoint
from raychat.common import RaychatError
from raychat.corpus import files
from raychat.corpus.index import CorpusIndex, read_unit_texts
from raychat.corpus.writer import CorpusWriter
from raychat.data.loader import _raise_read_failure
from raychat.faults import StorageUnavailable, is_missing, is_transient, retry_transient
from raychat.model.gpt import GPTConfig
from raychat.storage import Storage
from raychat.tokenizer import remote
from raychat.tokenizer.core import Tokenizer
from raychat.tokenizer.remote import local_copy
from testkit.fault_proxy import FaultProxy

DOCS = [f"document {i}: " + "words " * (i % 7) for i in range(120)]


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        yield proxy


@pytest.fixture
def direct_client(proxy):
    """pyarrow's S3 client through the proxy with its own retries off, so each fault reaches us."""
    return pafs.S3FileSystem(endpoint_override=proxy.address, scheme="http",
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """Retries 10x sooner than in production: what is tested is which faults are retried, not how long
    the first backoff step is."""
    monkeypatch.setattr(faults, "FIRST_DELAY_S", 0.05)


@pytest.fixture
def direct_corpus_client(monkeypatch, direct_client):
    """The corpus reader's client without pyarrow's own retries (~6 s of them per failing call)."""
    def storage(location: str) -> Storage:
        return Storage(location, direct_client, Storage(location).root)

    monkeypatch.setattr(files, "corpus_storage", storage)


@pytest.fixture
def corpus(s3_endpoint, proxy):
    """A corpus of 3 train shards (one row group of 30 each) and a val shard in the bucket; its URI through
    the proxy (the URI straight to moto is for writing it)."""
    prefix = f"faults-{time.time_ns()}"
    with CorpusWriter(s3_uri(s3_endpoint, prefix), docs_per_shard=30) as writer:
        writer.add_train(DOCS[:90])
        writer.add_val(DOCS[90:])
    return s3_uri(proxy.address, prefix)


def error_of(fn) -> Exception:
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("no error")


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_real_storage_errors_are_sorted_by_what_they_are(proxy, direct_client, tmp_path):
    key = f"{TEST_BUCKET}/sort-{time.time_ns()}"
    with direct_client.open_output_stream(key) as f:
        f.write(b"x" * 50_000)

    def read() -> bytes:
        return direct_client.open_input_file(key).read_at(1000, 20_000)

    def put() -> None:
        with direct_client.open_output_stream(key + ".new") as f:
            f.write(b"y")

    for kind in ("slowdown", "error500", "reset", "cut"):
        proxy.clear()
        proxy.inject(kind, method="GET")
        got = error_of(read)
        assert isinstance(got, OSError) and is_transient(got), (kind, got)
    for kind in ("slowdown", "error500", "reset"):
        proxy.clear()
        proxy.inject(kind, method="POST")   # the upload's start (CreateMultipartUpload)
        got = error_of(put)
        assert is_transient(got), (kind, got)
    proxy.clear()
    refused = pafs.S3FileSystem(endpoint_override="127.0.0.1:1", scheme="http",
                                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    assert is_transient(error_of(lambda: refused.get_file_info(key)))

    # What no retry heals: a missing object or bucket, access refused, bytes that do not parse.
    assert not is_transient(error_of(lambda: direct_client.open_input_file(key + ".missing")))
    no_bucket = error_of(lambda: direct_client.open_output_stream("no-such-bucket-here/x").close())
    assert "NO_SUCH_BUCKET" in str(no_bucket) and not is_transient(no_bucket)
    assert not is_transient(OSError("When reading information for key 'x' in bucket 'b': AWS Error "
                                    "ACCESS_DENIED during HeadObject operation: Access Denied"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 100 + b"PAR1")
    assert not is_transient(error_of(lambda: pq.read_table(tmp_path / "bad.parquet")))
    assert not is_transient(RaychatError("fix the flag")) and not is_transient(StorageUnavailable("x"))

    # Ray's own: a lost actor or node is transient; a task's error is what its cause is.
    import ray.exceptions

    assert is_transient(ray.exceptions.ActorDiedError()) and is_transient(ray.exceptions.NodeDiedError("n"))
    assert is_transient(ray.exceptions.RayTaskError("read", "tb", ConnectionResetError("reset")))
    assert not is_transient(ray.exceptions.RayTaskError("read", "tb", FileNotFoundError("gone")))


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_the_proxy_schedule_is_seeded(s3_endpoint, direct_client):
    """Intermittent faults (`probability`) hit the same requests for the same seed: a chaos run replays."""
    key = f"{TEST_BUCKET}/seeded-{time.time_ns()}"
    with direct_client.open_output_stream(key) as f:
        f.write(b"s" * 100)

    def pattern(seed: int) -> list[bool]:
        with FaultProxy(s3_endpoint, seed=seed) as proxy:
            client = pafs.S3FileSystem(endpoint_override=proxy.address, scheme="http",
                                       retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
            proxy.inject("error500", method="GET", probability=0.5)
            proxy.inject("delay", method="HEAD", delay_s=0.2, count=1)

            def fails() -> bool:
                try:
                    client.open_input_file(key).read_at(10, 0)
                    return False
                except OSError:
                    return True

            started = time.monotonic()
            assert client.get_file_info(key).size == 100   # the delayed request
            assert time.monotonic() - started > 0.2 and proxy.injected["delay"] == 1
            return [fails() for _ in range(12)]

    first = pattern(7)
    assert first == pattern(7) and first != pattern(8) and 2 <= sum(first) <= 10


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_retry_rides_out_a_stall_and_a_burst_of_503s_in_one_incident(proxy, direct_client):
    key = f"{TEST_BUCKET}/ride-{time.time_ns()}"
    with direct_client.open_output_stream(key) as f:
        f.write(bytes(range(256)) * 100)
    proxy.inject("stall", seconds=1.0)
    proxy.inject("slowdown", method="GET", count=3)
    lines: list[str] = []
    started = time.monotonic()
    data = retry_transient(lambda: direct_client.open_input_file(key).read_at(256, 512), "reading the key",
                           log=lines.append, budget_s=60)
    assert data == bytes(range(256))
    assert proxy.injected["slowdown"] == 3 and proxy.injected["stall"] >= 1
    assert len(lines) == 2, lines   # one when it started, one when it ended: not one per try
    assert lines[0].startswith("storage fault while reading the key: ")
    assert "retrying for up to 60 s" in lines[0]
    assert lines[1].startswith("storage recovered while reading the key after ")
    assert 1.0 < time.monotonic() - started < 20

    # Many readers meeting one fault (the driver's 32 footer threads, say): still one incident.
    lines.clear()
    proxy.inject("slowdown", method="GET", count=12)

    def read_four(_) -> bytes:
        return retry_transient(lambda: direct_client.open_input_file(key).read_at(4, 0), "reading the key",
                               log=lines.append)

    with ThreadPoolExecutor(4) as pool:
        reads = list(pool.map(read_four, range(4)))
    assert reads == [bytes(range(4))] * 4 and proxy.injected["slowdown"] == 15
    assert len(lines) == 2 and "recovered" in lines[1], lines


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_past_its_budget_a_fault_fails_the_attempt_not_the_run(proxy, direct_client, corpus, monkeypatch,
                                                                direct_corpus_client):
    key = f"{TEST_BUCKET}/budget-{time.time_ns()}"
    with direct_client.open_output_stream(key) as f:
        f.write(b"z" * 1000)
    proxy.inject("slowdown", method="GET")   # a throttled bucket that does not recover
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="reading the key: .*still failing after 1 s") as raised:
        retry_transient(lambda: direct_client.open_input_file(key).read_at(10, 0), "reading the key",
                        log=lines.append, budget_s=1.0)
    assert not isinstance(raised.value, RaychatError) and is_transient(raised.value.__cause__)
    assert 1.0 <= time.monotonic() - started < 5 and len(lines) == 2 and "outlasted" in lines[1]

    # The same in the corpus reader (the budget from the environment), whose row group reads used to
    # end the run as a RaychatError.
    proxy.clear()
    index = CorpusIndex.load(corpus)
    monkeypatch.setenv("RAYCHAT_RETRY_BUDGET_S", "1")
    proxy.inject("error500", method="GET", match="shard_00001")
    with pytest.raises(StorageUnavailable, match="shard_00001.parquet row group"):
        read_unit_texts(index.train[1], location=corpus)
    # A non-transient error is not retried: at once, one line naming the object.
    proxy.clear()
    Storage(corpus).delete("shard_00002.parquet")
    with pytest.raises(RaychatError, match="shard_00002.parquet is gone"):
        read_unit_texts(index.train[2], location=corpus)


def storage_warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "raychat: warning: storage" in line]


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_footer_reads_ride_out_resets_with_one_line_per_incident(proxy, corpus, capsys, direct_corpus_client):
    """raychat's own retry of footer reads, each fault reaching it (pyarrow's retries off): the unit
    tier's check of what the next test checks through the driver's real client."""
    undisturbed = CorpusIndex.load(corpus)
    capsys.readouterr()
    proxy.inject("reset", method="GET", match="shard_00002", count=3)
    index = CorpusIndex.load(corpus)
    assert index == undisturbed and proxy.injected["reset"] == 3
    warnings = storage_warnings(capsys)
    assert len(warnings) == 2 and "reading the footer of" in warnings[0], warnings
    assert "shard_00002" in warnings[0] and "storage recovered" in warnings[1], warnings


@pytest.mark.slow  # pyarrow's own ~6 s of retries, waited out: the unit tier has the check above
def test_indexing_a_bucket_rides_out_faults_on_footer_reads(proxy, corpus, capsys):
    """With the client the driver really uses: pyarrow retries a failed request every 200 ms for 6 s
    (~31 tries) before raychat sees it fail; 35 resets of one shard's reads outlast that once."""
    undisturbed = CorpusIndex.load(corpus)
    capsys.readouterr()
    proxy.inject("slowdown", method="GET", count=3)   # absorbed by pyarrow
    proxy.inject("reset", method="GET", match="shard_00002", count=35)
    index = CorpusIndex.load(corpus)
    assert index == undisturbed and proxy.injected["reset"] == 35
    warnings = storage_warnings(capsys)
    assert len(warnings) == 2 and "reading the footer of" in warnings[0], warnings
    assert "storage recovered" in warnings[1], warnings


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_a_row_group_read_survives_a_stall_cuts_and_resets(proxy, corpus, capsys, direct_corpus_client):
    index = CorpusIndex.load(corpus)
    capsys.readouterr()
    unit = index.train[1]   # shard_00001: documents 30..59
    proxy.inject("stall", seconds=1.0)
    proxy.inject("cut", method="GET", match="shard_00001", count=2)
    proxy.inject("reset", method="GET", match="shard_00001", count=2)
    started = time.monotonic()
    assert read_unit_texts(unit, [3, 0], location=corpus) == [DOCS[33], DOCS[30]]
    assert proxy.injected["cut"] == 2 and proxy.injected["reset"] == 2 and time.monotonic() - started > 1
    warnings = storage_warnings(capsys)
    assert len(warnings) == 2 and "shard_00001.parquet row group 0" in warnings[0], warnings


@pytest.mark.unit
def test_a_read_task_failure_is_raised_as_what_it_is():
    """The loader gets a Ray Data task's error as text: user-fixable, transient, or a bug."""
    from ray.exceptions import RayTaskError

    def task_error(last_line: str, cause: Exception) -> RayTaskError:
        return RayTaskError("MapBatches(_read_and_tokenize)", f"Traceback ...\n{last_line}\n", cause)

    with pytest.raises(RaychatError, match=r"^s3://b/shard_00003.parquet is gone: restore it$"):
        _raise_read_failure(task_error("raychat.common.RaychatError: s3://b/shard_00003.parquet is gone: "
                                       "restore it", RuntimeError()))
    with pytest.raises(StorageUnavailable, match="reading the corpus: reading s3://b/shard_0 row group 1"):
        _raise_read_failure(task_error("raychat.faults.StorageUnavailable: reading s3://b/shard_0 row group "
                                       "1 (still failing after 300 s)", RuntimeError()))
    with pytest.raises(StorageUnavailable):
        _raise_read_failure(task_error("OSError: reset", ConnectionResetError("reset")))
    with pytest.raises(ZeroDivisionError):   # a bug keeps its traceback
        _raise_read_failure(ZeroDivisionError("bug"))


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_checkpoint_reads_and_writes_sort_their_faults(proxy, direct_client, s3_endpoint, tmp_path):
    run = f"ckpt-{time.time_ns()}"
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    meta = CheckpointMeta(step=3, model_config=GPTConfig(n_layer=1))
    save_checkpoint(Storage(s3_uri(s3_endpoint, run)), state, None, meta.to_json())
    # A rank file's reads meet 503s and resets: retried, never taken for damage (which would
    # resume an older checkpoint).
    checkpoint = Storage(s3_uri(proxy.address, run), direct_client, f"{TEST_BUCKET}/{run}")
    proxy.inject("slowdown", method="GET", match="rank_", count=2)
    proxy.inject("reset", method="GET", match="rank_", count=1)
    model, _, loaded = load_checkpoint(checkpoint)
    assert torch.equal(model["w"], state["w"]) and loaded.step == 3
    assert proxy.injected["slowdown"] == 2 and proxy.injected["reset"] == 1

    # A write that failed: a storage fault fails the attempt; a refusal is the user's, in one line.
    def failed_write(error: Exception) -> Exception:
        writer = AsyncCheckpointWriter()
        writer.submit(Storage(str(tmp_path)), [Piece("w", (1,), 0, torch.ones(1))],
                      lambda snapshot: (_ for _ in ()).throw(error))
        return error_of(writer.wait)

    proxy.inject("reset", method="POST")   # the upload's start
    reset = error_of(lambda: direct_client.open_output_stream(f"{TEST_BUCKET}/{run}/x").close())
    assert type(failed_write(reset)) is StorageUnavailable
    refused = failed_write(PermissionError(13, "Permission denied"))
    assert isinstance(refused, RaychatError) and "check free space and permissions" in str(refused)


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_a_lease_records_whole_get_rides_out_faults_past_the_clients_retries(proxy, s3_endpoint):
    """A lease record is read with one GET of boto3's (Storage.read_replaceable), not pyarrow's: its
    faults are sorted by `raychat.stores.s3.fault`. A body cut short (which boto3 does not retry) and
    503s past boto3's own 5 tries are transient, ridden out by the caller's retry in one incident; none
    is ever taken for a damaged record (which would stop a healthy run) or for a free lease (a missing
    one)."""
    run = f"lease-get-{time.time_ns()}"
    record = fence.LeaseRecord(epoch=3, holder="h" * 40, host="vm", pid=7, started="now", floor=5, beat=9)
    Storage(s3_uri(s3_endpoint, run)).child(fence.LEASE_DIR).replace_atomically(fence.epoch_file(3),
                                                                                record.to_json())
    through_proxy = Storage(s3_uri(proxy.address, run))
    proxy.inject("cut", method="GET", match="lease", count=1)
    got = error_of(lambda: through_proxy.child(fence.LEASE_DIR).read_replaceable(fence.epoch_file(3)))
    assert isinstance(got, ConnectionError) and is_transient(got) and "ResponseStreamingError" in str(got)
    proxy.inject("cut", method="GET", match="lease", count=1)
    proxy.inject("slowdown", method="GET", match="lease", count=6)
    lines: list[str] = []
    assert fence.read_record(through_proxy, 3, log=lines.append) == record
    assert proxy.injected["cut"] == 2 and proxy.injected["slowdown"] == 6
    assert len(lines) == 2 and "recovered" in lines[1], lines
    missing = error_of(lambda: through_proxy.child(fence.LEASE_DIR).read_replaceable(fence.epoch_file(4)))
    assert isinstance(missing, FileNotFoundError) and is_missing(missing) and not is_transient(missing)


@pytest.mark.unit
def test_words_in_keys_do_not_classify_and_an_expired_token_is_ridden_out():
    """The reviewer's cases: a permanent 400 on a key named like a fault is not retried for minutes;
    GCS's PERMISSION_DENIED is the user's; a lapsed temporary credential is transient."""
    assert not is_transient(OSError("When reading information for key 'runs/throttle-test/x' in bucket 'b': "
                                    "AWS Error UNKNOWN (HTTP status 400) during HeadObject operation"))
    assert not is_transient(OSError("When reading 'runs/stalled/x': (HTTP status 400)"))
    assert not is_transient(OSError("PERMISSION_DENIED: bucket unavailable to caller"))
    assert is_transient(OSError("AWS Error EXPIRED_TOKEN during GetObject operation: The provided token has "
                                "expired."))


@pytest.mark.unit
def test_an_object_gone_between_open_and_read_is_missing_not_transient():
    """What pyarrow raises when a shard is deleted after it was opened: GetObject's RESOURCE_NOT_FOUND or
    NO_SUCH_KEY."""
    gone = OSError("When reading 's3://b/c/shard_00005.parquet': AWS Error RESOURCE_NOT_FOUND during "
                   "GetObject operation:")
    assert is_missing(gone) and not is_transient(gone)
    # the same deletion met by the row group's own GetObject (once seen in the suite, a shard
    # deleted mid-run then read as damaged)
    gone_at_read = OSError("AWS Error NO_SUCH_KEY during GetObject operation: The specified key does not "
                           "exist. (Request ID: 2QfMWti2zlUDobLSee4egMiwr37SI2JeGh1pHCOU24JByiFzfkZS)")
    assert is_missing(gone_at_read) and not is_transient(gone_at_read)
    assert not is_missing(OSError("When reading 'runs/no_such_key_here/x': AWS Error SLOW_DOWN"))


def refused_at_start(commands, tmp_path, *flags: str, **env: str) -> str:
    """The one error line of `python -m raychat.train FLAGS` with no cluster to join, in the module's
    reused interpreter. Any check that passes leads to the missing eval bundle's refusal (offline,
    before the corpus or Ray), so a check that should have refused shows as that line, never a run."""
    environment = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environment.update(RAYCHAT_OFFLINE="1", **env)
    return one_error_line(commands.run("raychat.train", "--run-name", "r", "--eval-bundle",
                                       str(tmp_path / "no-bundle"), *flags, env=environment, timeout=120))


BACKSTOP = "eval bundle"  # in the line of the refusal that comes after every start-up check here


@pytest.mark.integration  # moto's S3 server or the GCS emulator behind the fault proxy, a reused interpreter
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_store_that_ignores_the_create_precondition_cannot_hold_a_run(store, request, commands, tmp_path):
    """The lease's atomic create, proved by the driver before any worker starts: through a store that
    drops the precondition (S3's If-None-Match, GCS's ifGenerationMatch: the proxy takes it out), the
    same file is "created" twice, and the run is refused in one line; the honest store passes."""
    endpoint = request.getfixturevalue(f"{store}_endpoint")
    uri = s3_uri if store == "s3" else gcs_uri
    with FaultProxy(endpoint, seed=0, api=store) as proxy:
        honest = uri(proxy.address, f"honest-{time.time_ns()}")
        assert BACKSTOP in refused_at_start(commands, tmp_path, "--storage-path", honest)
        proxy.inject("drop_conditions")
        liar = uri(proxy.address, f"liar-{time.time_ns()}")
        line = refused_at_start(commands, tmp_path, "--storage-path", liar)
        assert f"--storage-path {liar} cannot give the run its lease (one writer per run)" in line, line
        assert "precondition" in line and proxy.injected["drop_conditions"] >= 2
        proxy.clear()
        assert not Storage(liar).files()  # the scratch file deleted


@pytest.mark.integration  # commands in a reused interpreter
def test_a_store_without_an_atomic_create_is_refused_before_any_request(commands, tmp_path):
    uri = "abfs://container@account.dfs.core.windows.net/runs"
    line = refused_at_start(commands, tmp_path, "--storage-path", uri)
    assert "--storage-path" in line and "cannot give a run its lease (one writer per run)" in line, line


@pytest.mark.integration  # moto's S3 server behind the fault proxy, commands in a reused interpreter
def test_a_store_that_does_not_implement_a_request_is_the_users_at_once(proxy, direct_client, commands,
                                                                       tmp_path):
    """501 NotImplemented is no passing fault: not retried, and a run's start refuses it in one line at
    once (not after the probe's retries as "storage unavailable")."""
    key = f"{TEST_BUCKET}/not-implemented-{time.time_ns()}"
    proxy.inject("notimplemented", method="PUT", count=1)
    got = error_of(lambda: direct_client.open_output_stream(key).close())
    assert "501" in str(got) and not is_transient(got), got
    proxy.clear()
    # The conditional PUT of the lease's probe, through boto3 (raychat.stores.s3.fault).
    proxy.inject("notimplemented", method="PUT", match="lease_test")
    started = time.monotonic()
    uri = s3_uri(proxy.address, f"not-implemented-{time.time_ns()}")
    line = refused_at_start(commands, tmp_path, "--storage-path", uri)
    assert "501 NotImplemented" in line and time.monotonic() - started < storage_module.PROBE_BUDGET_S, line


@pytest.mark.integration  # commands in a reused interpreter
def test_a_typo_in_an_endpoint_host_is_refused_at_start_in_one_line(commands, tmp_path):
    """A host that does not resolve is a typo at start (mid-run a resolver's hiccup is transient, and
    its retries would take minutes): each location's flag, host and fix, before anything runs."""
    typo = "s3://bucket/x?endpoint_override=minio.no-such-host.invalid:9000&scheme=http"
    for flag in ("--storage-path", "--data-dir", "--tokenizer-dir"):
        line = refused_at_start(commands, tmp_path, flag, typo)
        assert line.startswith(f"raychat: error: {flag} {typo}: the endpoint's host "
                               "minio.no-such-host.invalid cannot be resolved"), line
        assert "fix the host in endpoint_override" in line


@pytest.mark.integration  # commands in a reused interpreter
@pytest.mark.parametrize("value", ["5m", "-1", "inf", "nan"])
def test_a_malformed_retry_budget_is_refused_at_start(commands, tmp_path, value):
    """Read at the first storage fault, hours in, it would end the run there: it is read at start."""
    line = refused_at_start(commands, tmp_path, RAYCHAT_RETRY_BUDGET_S=value)
    assert f"RAYCHAT_RETRY_BUDGET_S={value!r} is not a number of seconds >= 0" in line, line


@pytest.mark.integration  # moto's S3 server behind the fault proxy
def test_a_tokenizer_in_a_bucket_rides_out_throttling_and_names_a_missing_one(proxy, s3_endpoint, tiny_corpus,
                                                                             tmp_path, monkeypatch, capsys,
                                                                             direct_client):
    """Every worker reads the bucket's tokenizer at its start: a SlowDown past the client's own retries
    (off here, as `direct_corpus_client` does for the corpus) is ridden out, one line when it starts and
    one when it ends, never a run-ending error; a tokenizer that is not there is the user's, in one line."""
    prefix = f"tokenizer-{time.time_ns()}"
    copy_to_bucket(tiny_corpus[1], s3_uri(s3_endpoint, prefix))
    monkeypatch.setenv("RAYCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(remote, "Storage", lambda location: Storage(location, direct_client,
                                                                    Storage(location).root))
    local_copy.cache_clear()
    try:
        proxy.inject("slowdown", method="GET", match=f"{prefix}/meta.json", count=3)
        tokenizer = Tokenizer.load(s3_uri(proxy.address, prefix))
        assert tokenizer.fingerprint == Tokenizer.load(tiny_corpus[1]).fingerprint
        assert proxy.injected["slowdown"] == 3
        err = capsys.readouterr().err
        assert "storage fault while reading the tokenizer's meta.json" in err, err
        assert "storage recovered while reading the tokenizer's meta.json" in err, err
        missing = s3_uri(proxy.address, f"no-tokenizer-{time.time_ns()}")
        with pytest.raises(RaychatError, match=r"no tokenizer at .* \(meta.json not found\): train one"):
            Tokenizer.load(missing)
    finally:
        local_copy.cache_clear()
