"""What a run shows its users: log lines that read like nanochat's (no Ray prefix, no colour codes
when redirected), and no secret in what Ray stores and shows (`ray job list`, the job's logs)."""

import functools
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import STEP_LINE, VAL_LINE, run_train, submit_job, tiny_flags
from ray._private.worker import print_to_stdstream

from raychat.ray_glue.runtime_env import SETUP_HOOK, worker_runtime_env
from raychat.telemetry.console import MARK, log_line, print_batch

CORE_LINE = re.compile(r"Step 00006 \| CORE metric: -?\d\.\d{4}")
RUN = ["--num-workers", "1", "--total-batch-size", "256", "--num-iterations", "6", "--eval-every", "3"]
ESCAPE = "\x1b["


def ray_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    return subprocess.run([ray_bin, *args], capture_output=True, text=True, timeout=timeout, check=True)


@pytest.mark.unit
def test_runtime_env_keeps_settings_and_drops_secrets():
    environ = {
        "WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e", "WANDB_MODE": "offline",
        "WANDB_DIR": "/w", "RAYCHAT_HOME": "/h", "RAYCHAT_HF_TOKEN": "t", "WANDB_PASSWORD": "x",
        "wandb_secret_thing": "s", "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "a",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1", "RAY_ADDRESS": "127.0.0.1:6379",
    }
    assert worker_runtime_env(environ) == {"env_vars": {
        "WANDB_PROJECT": "p", "WANDB_ENTITY": "e", "WANDB_MODE": "offline", "WANDB_DIR": "/w",
        "RAYCHAT_HOME": "/h", "RAY_DATA_DISABLE_PROGRESS_BARS": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"},
        "worker_process_setup_hook": SETUP_HOOK}


@pytest.mark.unit
def test_runtime_env_leaves_a_jobs_own_variables_to_the_job():
    """Under `ray job submit --runtime-env-json`, Ray refuses a driver runtime env that names a job
    variable again ("Failed to merge the Job's runtime env"): those reach the workers anyway."""
    job = json.dumps({"runtime_env": {"env_vars": {"RAYCHAT_TRACE_DIR": "/t", "RAYCHAT_HOME": "/h"}}})
    environ = {"RAYCHAT_TRACE_DIR": "/t", "RAYCHAT_HOME": "/h", "RAYCHAT_OFFLINE": "1",
               "RAY_JOB_CONFIG_JSON_ENV_VAR": job}
    assert worker_runtime_env(environ) == {"env_vars": {"RAYCHAT_OFFLINE": "1",
                                                        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"},
                                           "worker_process_setup_hook": SETUP_HOOK}


@pytest.mark.unit
def test_marked_lines_bare_others_keep_rays_prefix(capsys, monkeypatch):
    """A forwarded batch as Ray's log monitor publishes it, printed through Ray's own printer."""
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    log_line("step 00001/00002 (50.00%) | loss: 1.0\nsecond line of a sample")
    marked = capsys.readouterr().out.splitlines()
    assert marked == [MARK + "step 00001/00002 (50.00%) | loss: 1.0", MARK + "second line of a sample"]
    batch = {"ip": "10.0.0.1", "localhost": "10.0.0.1", "pid": 4242, "is_err": False,
             "actor_name": "RayTrainWorker", "task_name": None,
             "lines": [marked[0], "UserWarning: something", marked[1]]}
    print_batch(functools.partial(print_to_stdstream, ignore_prefix=False), batch)
    assert capsys.readouterr().out.splitlines() == [
        "step 00001/00002 (50.00%) | loss: 1.0",
        "(RayTrainWorker pid=4242) UserWarning: something",
        "second line of a sample",
    ]


@pytest.fixture(scope="module")
def secret_run(ray_session, tiny_corpus, tmp_path_factory):
    """One tiny run whose driver has a wandb key (and a non-secret wandb setting) in its env."""
    secret, project = f"secret-{uuid.uuid4().hex}", f"project-{uuid.uuid4().hex}"
    storage = tmp_path_factory.mktemp("job_output")
    result = run_train(ray_session, tiny_flags(tiny_corpus, storage, "out", *RUN),
                       WANDB_API_KEY=secret, WANDB_PROJECT=project)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, secret, project


@pytest.mark.ray
def test_redirected_run_reads_like_nanochat(secret_run):
    result, _, _ = secret_run
    out = result.stdout
    assert ESCAPE not in out and ESCAPE not in result.stderr
    assert MARK not in out
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("step")]  # grep '^step'
    assert len(steps) == 6 and all(STEP_LINE.fullmatch(line) for line in steps), steps
    vals = [line for line in lines if line.startswith("Step") and "Validation" in line]
    # nanochat evaluates at step 0 too
    assert [VAL_LINE.fullmatch(line).group(1) for line in vals] == ["00000", "00003", "00006"]
    # CORE, on by default, is scored at the last step only (every 2000 steps otherwise)
    cores = [line for line in lines if line.startswith("Step") and "Validation" not in line]
    assert len(cores) == 1 and CORE_LINE.fullmatch(cores[0]), cores
    assert not any("RayTrainWorker" in line for line in lines if "step " in line or "Validation" in line)
    assert any(line.startswith("Training done.") for line in lines)


@pytest.mark.ray
def test_secret_not_in_job_list_or_logs(ray_session, secret_run):
    result, secret, project = secret_run
    listed = ray_cli("job", "list", "--address", ray_session.dashboard_url).stdout
    assert project in listed  # the run's runtime env is there, with its non-secret wandb settings
    assert secret not in listed
    assert secret not in result.stdout + result.stderr
    logs = [p for p in Path(ray_session.temp_dir).rglob("*") if p.is_file() and "logs" in p.parts]
    assert logs
    leaks = [p for p in logs if secret.encode() in p.read_bytes()]
    assert leaks == []


@pytest.mark.ray
def test_ray_job_logs_read_like_nanochat(ray_session, tiny_corpus, tmp_path):
    """`ray job submit` to the running cluster: the job succeeds, checkpoints, and its log reads
    like nanochat's."""
    status, logs = submit_job(ray_session, tiny_flags(tiny_corpus, tmp_path, "submitted", *RUN))
    assert "SUCCEEDED" in status.upper(), status + logs[-3000:]
    assert (tmp_path / "submitted" / "checkpoint_000006" / "meta.json").exists()
    assert ESCAPE not in logs and MARK not in logs
    steps = [line for line in logs.splitlines() if line.startswith("step")]
    assert len(steps) == 6 and all(STEP_LINE.fullmatch(line) for line in steps), steps
