"""Secrets cannot be printed, names are names, and each bad input is one line.

A location's credentials (`s3://KEY:SECRET@bucket/...`) reach the filesystem and nothing else: no
line, error, file of the run, metrics log or Ray Train state holds them. `--run-name`,
`--model-tag` and a sweep's `--name` are names, refused in one line when they are paths. Every
input a user can get wrong is refused through the real command in one line naming it."""

import dataclasses
import json
import pickle
import subprocess
import sys
import time

import pytest
import torch
from conftest import TEST_BUCKET, s3_uri
from helpers import (
    STEP_LINE,
    all_files,
    copy_to_bucket,
    log_lines,
    one_error_line,
    recorded_requests,
    tiny_flags,
)

from raychat.common import RaychatError, check_name, run_cli
from raychat.config import TrainConfig
from raychat.locations import SafeLocation, join_uri, normalize_location, redact
from raychat.scaling import resolve_plan
from raychat.status import auth_token, train_runs
from raychat.storage import Storage

KEY, SECRET = "RaychatKeyId42", "Sup3rSecretV4lue+/xyz"  # distinctive: grepped for in every byte
QUOTED_SECRET = "Sup3rSecretV4lue%2B%2Fxyz"  # as it is written in a URI


def secret_uri(endpoint: str, prefix: str) -> str:
    return f"s3://{KEY}:{QUOTED_SECRET}@{TEST_BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http"


def assert_no_secret(text: str | bytes, what: str) -> None:
    data = text.encode() if isinstance(text, str) else text
    for secret in (SECRET, QUOTED_SECRET, KEY):
        assert secret.encode() not in data, f"{secret} in {what}"


@pytest.mark.unit
def test_a_safe_location_shows_no_secret_and_opens_with_it():
    uri = f"s3://{KEY}:{QUOTED_SECRET}@bucket/runs?endpoint_override=127.0.0.1:9&scheme=http"
    location = normalize_location(uri)
    shown = "s3://***@bucket/runs?endpoint_override=127.0.0.1:9&scheme=http"
    cfg = TrainConfig(storage_path=uri, data_dir=uri, tokenizer_dir=uri)
    for text in (str(location), repr(location), f"{location}", json.dumps([location]), location + "/x",
                 location.split("?")[0], str(Storage(uri).child("r")), repr(Storage(uri)),
                 json.dumps(cfg.to_public_dict()), json.dumps(cfg.to_dict()), repr(cfg)):
        assert_no_secret(text, text)
    assert str(location) == shown and str(cfg.data_dir) == shown
    assert location.scrub(f"denied for {KEY} with {SECRET} at {uri}") == f"denied for *** with *** at {shown}"
    # The credentials go where a filesystem is built: after pickling (to a worker), joining and
    # normalizing, the filesystem still signs with them.
    for kept in (pickle.loads(pickle.dumps(location)), join_uri(location, "a"), normalize_location(location),
                 TrainConfig.from_dict(pickle.loads(pickle.dumps(cfg.to_dict()))).storage_path,
                 SafeLocation(location)):
        assert kept.unredacted().startswith(f"s3://{KEY}:{QUOTED_SECRET}@"), kept
    settings = Storage(pickle.loads(pickle.dumps(location))).child("r").fs.__reduce__()[1][0]
    assert (settings["access_key"], settings["secret_key"]) == (KEY, SECRET)
    assert normalize_location("/data/runs") == "/data/runs"
    # Credentials written into the endpoint itself (no filesystem takes them; the S3 client's errors
    # print the user) and a raw '#' (the rest of a password lands in the fragment) are refused in a
    # line that shows none of them; shown anyway, they are hidden.
    at_in_password = QUOTED_SECRET.replace("%2B", "%40")  # an '@' in the password too
    for bad in (f"s3://bucket/runs?endpoint_override=http://{KEY}:{at_in_password}@127.0.0.1:9&scheme=http",
                f"s3://bucket/runs?endpoint_override={KEY}:{QUOTED_SECRET}@127.0.0.1:9",
                f"s3://bucket/runs?endpoint_override=http://{KEY}:{SECRET.replace('+', '#')}@127.0.0.1:9",
                # the URI's own password with a raw '/', '?' or '#' (SECRET holds a '/')
                f"s3://{KEY}:{SECRET}@bucket/runs?endpoint_override=127.0.0.1:9&scheme=http",
                f"s3://{KEY}:{SECRET.replace('/', '?')}@bucket/runs",
                f"s3://{KEY}:{SECRET.replace('/', '#')}@bucket/runs"):
        with pytest.raises(RaychatError) as refused:
            normalize_location(bad)
        assert_no_secret(str(refused.value), bad)
        assert_no_secret(redact(bad), bad)
        assert_no_secret(SafeLocation(bad).scrub(f"Could not resolve host: {KEY}, Cannot parse URI: '{bad}'"),
                         bad)
    assert "write them %2F, %3F and %23" in str(refused.value)
    # A value that merely holds an '@' is no credential: shown as it is.
    assert redact("s3://bucket/runs?prefix=team@v2") == "s3://bucket/runs?prefix=team@v2"


@pytest.mark.unit
@pytest.mark.parametrize("name", ["d12", "run-1.2_x", "A.b"])
def test_a_name_is_accepted(name):
    assert check_name(name, "--run-name") == name
    assert TrainConfig(run_name=name, model_tag=name).name == name


@pytest.mark.unit
@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "x..y", "a b", "/abs", "s3://b/x", "a\\b"])
def test_a_path_is_not_a_name(name):
    with pytest.raises(RaychatError, match=r"^--run-name must be a name of letters"):
        TrainConfig(run_name=name)
    with pytest.raises(RaychatError, match=r"^--model-tag must be a name of letters"):
        TrainConfig(model_tag=name)


def cli_line(main, argv: list[str], capsys) -> str:
    """The one `raychat: error:` line the command prints for `argv`, exiting 2 without a traceback."""
    with pytest.raises(SystemExit) as exited:
        run_cli(main, argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raychat: error: "), err
    return lines[0]


@pytest.mark.unit
def test_every_command_refuses_a_path_for_a_name_before_reading(tmp_path, capsys):
    from raychat import evaluate, export, sample, status, train
    from raychat.report import __main__ as report
    from tune import report as tune_report
    from tune import sweep

    escape = "../../escaped"
    storage = ["--storage-path", str(tmp_path / "runs")]
    commands = {
        "train --run-name": (train.main, ["--run-name", escape, *storage]),
        "train --model-tag": (train.main, ["--model-tag", escape, *storage]),
        "sweep --name": (sweep.main, ["--depths", "2", "--name", escape, "--dry-run", *storage]),
        "sweep --model-tag": (sweep.main, ["--depths", "2", "--model-tag", escape, "--dry-run", *storage]),
        "tune.report --name": (tune_report.main, ["--name", escape, *storage]),
        "sample": (sample.main, ["--run-name", escape, *storage]),
        "status": (status.main, ["--run-name", escape, "--storage-only", *storage]),
        "report": (report.main, ["--run-name", escape, *storage]),
        "export": (export.main, ["--run-name", escape, "--to", "nanochat", "--out", str(tmp_path), *storage]),
        "evaluate": (evaluate.main, ["core", "--run-name", escape, *storage]),
    }
    for what, (main, argv) in commands.items():
        line = cli_line(main, argv, capsys)
        flag = "--" + what.split(" --")[-1] if " --" in what else "--run-name"
        assert f"{flag} must be a name" in line and escape in line, (what, line)
    assert not any(tmp_path.parent.glob("escaped*")) and not (tmp_path / "runs").exists()


@pytest.mark.unit
def test_export_refuses_a_file_for_out_and_a_path_for_model_tag(tmp_path, capsys):
    from raychat import export

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for out in (blocker, blocker / "below"):
        line = cli_line(export.main, ["--run-name", "r", "--to", "nanochat", "--out", str(out)], capsys)
        assert f"--out {out}: {blocker} is a file" in line, line


@pytest.mark.unit
def test_import_nanochat_names_a_missing_or_corrupt_pickle(tmp_path, capsys):
    from raychat.tokenizer import cli

    missing = tmp_path / "nowhere" / "tokenizer.pkl"
    line = cli_line(cli.main, ["import-nanochat", "--from", str(missing)], capsys)
    assert f"--from {missing} does not exist" in line and "pickle" not in line.split("exist")[0], line
    corrupt = tmp_path / "tokenizer.pkl"
    argv = ["import-nanochat", "--from", str(corrupt), "--tokenizer-dir", str(tmp_path / "tok")]
    cut_short = pickle.dumps({"ranks": list(range(50))})[:-9]
    bad_call = pickle.dumps(BadReduce())  # loading it calls int("not a number")
    for content in (cut_short, bad_call):
        corrupt.write_bytes(content)
        assert "add --trust-pickle" in cli_line(cli.main, argv, capsys)
        line = cli_line(cli.main, [*argv, "--trust-pickle"], capsys)
        assert f"{corrupt} does not load" in line, line


class BadReduce:
    def __reduce__(self):
        return int, ("not a number",)


@pytest.mark.unit
def test_report_names_a_malformed_metrics_log(tmp_path, capsys):
    from raychat.report import __main__ as report

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "start", "step": 0}\n{"kind": "step", "step": 0}\n')
    line = cli_line(report.main, ["--run-name", "r", "--storage-path", str(tmp_path / "runs")], capsys)
    assert f"{run}/metrics.jsonl is not a metrics log" in line and "KeyError" in line, line


@pytest.mark.unit
def test_commands_that_read_a_run_name_an_unreachable_endpoint_in_one_line(capsys):
    from raychat import sample
    from raychat.report import __main__ as report

    dead = "s3://bucket/runs?endpoint_override=127.0.0.1:1&scheme=http"  # nothing listens there
    for main in (report.main, sample.main):
        line = cli_line(main, ["--run-name", "r", "--storage-path", dead], capsys)
        assert line == ("raychat: error: --storage-path "
                        "s3://bucket/runs/r?endpoint_override=127.0.0.1:1&scheme=http cannot "
                        "be read: the endpoint cannot be reached; check endpoint_override, the network and "
                        "the server"), line


@pytest.mark.unit
def test_init_from_nanochat_names_a_garbage_token_bytes_or_model_file(tiny_corpus, tmp_path, capsys):
    from raychat import train

    argv = tiny_flags(tiny_corpus, tmp_path / "runs", "seeded", "--num-iterations", "2")
    tiny = TrainConfig(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=64, window_pattern="L",
                       device_batch_size=4, num_iterations=2)  # the model TINY builds
    model = resolve_plan(tiny, 512, world_size=1).model
    seed = tmp_path / "base_checkpoints" / "d2"
    seed.mkdir(parents=True)
    (seed / "meta_000005.json").write_text(json.dumps({"model_config": dataclasses.asdict(model)}))
    torch.save([torch.zeros(2)], seed / "model_000005.pt")
    argv += ["--init-from-nanochat", str(seed)]
    line = cli_line(train.main, argv, capsys)
    assert f"{seed}/model_000005.pt holds a list, not a dict" in line, line
    (seed / "token_bytes.pt").write_bytes(b"not a torch file at all")
    line = cli_line(train.main, argv, capsys)
    assert f"{seed}/token_bytes.pt cannot be read as tensors only" in line, line


@pytest.mark.ray
def test_a_run_with_credentials_in_its_uris_prints_and_stores_none(ray_session, tiny_corpus, tmp_path,
                                                                   s3_endpoint, commands):
    prefix = f"secrets-{time.time_ns()}"
    for name, local in zip(("data", "tokenizer"), tiny_corpus, strict=True):
        copy_to_bucket(local, s3_uri(s3_endpoint, f"{prefix}/{name}"))
    data, tokenizer, runs, empty = (secret_uri(s3_endpoint, f"{prefix}/{name}")
                                    for name in ("data", "tokenizer", "runs", "empty"))
    flags = tiny_flags((data, tokenizer), runs, "secret", "--total-batch-size", "512",
                       "--num-iterations", "3", "--eval-every", "2", "--save-every", "2")
    with recorded_requests(s3_endpoint) as requests:
        # A process of its own: Ray records a driver's command line (its job's entrypoint), which the
        # reused drivers' interpreter would not show with the run's flags in it.
        result = subprocess.run([sys.executable, "-m", "raychat.train", *flags], capture_output=True,
                                text=True, timeout=400, env=ray_session.driver_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(log_lines(result.stdout, STEP_LINE)) == 3
    assert "Corpus: " in result.stdout and "s3://***@" in result.stdout
    assert_no_secret(result.stdout + result.stderr, "the run's output")
    # Every request the driver, the workers and Ray Data's read tasks sent was signed with the URI's
    # key: none lost it on the way (a location rebuilt from its printed form would sign as "***").
    signers = {r["headers"]["Authorization"].split("Credential=")[-1].split("/")[0] for r in requests
               if "Authorization" in r["headers"]}
    assert signers == {KEY}, signers
    files = all_files(Storage(runs).child("secret"))
    assert "metrics.jsonl" in " ".join(files) and any(name.endswith("meta.json") for name in files)
    for name, content in files.items():
        assert_no_secret(content, name)
    # Ray Train's run state, read back through the dashboard's state API: locations redacted, the
    # corpus index an object reference (where it is), not the index.
    mine = [run for run in train_runs(ray_session.dashboard_url, auth_token()) if run.get("name") == "secret"]
    state = json.dumps(mine)
    assert mine and "train_loop_config" in state and "s3://***@" in state, state[:2000]
    assert_no_secret(state, "Ray Train's state")
    config = mine[0]["run_settings"]["train_loop_config"]
    assert config["corpus_index"].startswith("ObjectRef(") and len(json.dumps(config)) < 4000
    # Refusals, and the commands that read the run, name its locations without the secret too.
    refusals = [tiny_flags((data, tokenizer), runs, "secret", "--depth", "3"),  # another model
                tiny_flags((empty, tokenizer), runs, "other")]  # no corpus there
    readers = [["raychat.report", "--run-name", "secret", "--storage-path", runs, "--out", str(tmp_path)],
               ["raychat.status", "--run-name", "secret", "--storage-path", runs, "--storage-only"]]
    for command in [["raychat.train", *flags] for flags in refusals] + readers:
        done = commands.run(*command, env=ray_session.driver_env(), timeout=300)
        assert_no_secret(done.stdout + done.stderr, command[0])
        if command[0] == "raychat.train":
            assert "s3://***@" in one_error_line(done)
        else:
            assert done.returncode == 0, done.stderr[-2000:]
    assert "s3://***@" in done.stdout  # status names the run's storage


@pytest.mark.unit
def test_a_uri_urlsplit_cannot_parse_is_refused_in_one_line_showing_no_secret(capsys):
    """A '[' outside an IPv6 host makes urlsplit raise: one line, no part of the credentials."""
    from raychat import train

    argv = ["--storage-path", "s3://AKIDX:s3cr3t@bucket[x/runs", "--run-name", "r"]
    line = cli_line(train.main, argv, capsys)
    assert "not a URI raychat can read" in line and "%5B" in line
    assert "s3cr3t" not in line and "AKIDX" not in line
