"""Logs that are the run's: a tiny training run with Ray's deprecation warnings at raychat's own calls
turned into errors (RAYCHAT_STRICT_WARNINGS) finishes, and its output has raychat's lines without
Ray's per-report and per-dataset chatter; RAYCHAT_VERBOSE brings the chatter back."""

import logging
import re
import subprocess
import sys
import warnings

import pytest
from helpers import STEP_LINE, VAL_LINE, gone_cluster_recorded, log_lines, modules_loaded_by, tiny_flags
from run_output import foreign_lines

from raychat.ray_glue import quiet
from raychat.ray_glue.ray_internals import PROGRESS_NOTICE, TOKEN_AUTH_LOGGER, ray_data_console_handlers
from raychat.run.driver import ray_line
from raychat.telemetry.console import print_batch

CHATTER = ["Reporting training result", "registers for logging", "execution finished",
           "Starting execution of Dataset", "exclude_resources"]


@pytest.mark.ray
@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_tiny_run_calls_no_deprecated_ray_api_and_logs_no_chatter(ray_session, tiny_corpus, storage):
    """The README's first command: no cluster address (RAY_ADDRESS empty, as `ENV RAY_ADDRESS=` leaves
    it), so the driver starts a local Ray instance, on a machine whose last `ray start` recorded a
    cluster that is gone (/tmp/ray/ray_current_cluster, here under a private RAY_TMPDIR). Ray would join
    that address (and refuse num_cpus: a traceback), and Ray Train's actors would ask it whether their
    actors live (the cleaner's stop times out: a traceback and a 13-50 s stall at the end): the run
    starts its own instance, and its processes ask their own."""
    flags = ["--num-workers", "1", "--total-batch-size", "1024", "--num-iterations", "6", "--eval-every", "3"]
    with gone_cluster_recorded() as ray_tmp:
        env = ray_session.driver_env(RAYCHAT_STRICT_WARNINGS="1", RAY_TMPDIR=ray_tmp, RAY_ADDRESS="")
        command = [sys.executable, "-m", "raychat.train", *tiny_flags(tiny_corpus, storage, "quiet", *flags)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    local = r"^Ray: started a local instance; dashboard http://127\.0\.0\.1:\d+"
    assert re.search(local, result.stdout, re.M), result.stdout[-3000:]
    assert [int(m.group(1)) for m in log_lines(result.stdout, STEP_LINE)] == list(range(6))
    assert [int(m.group(1)) for m in log_lines(result.stdout, VAL_LINE)] == [0, 3, 6]
    # The default cadence (--save-every 0) checkpoints before the end: 5 steps in, a save that
    # measures what saves cost (raychat.elastic.cadence), then the end.
    assert "Checkpoints: auto (--save-every 0)" in result.stdout
    assert "Checkpoint checkpoint_000005 saved" in result.stdout
    assert [line for line in out.splitlines() if any(c in line for c in CHATTER)] == []
    assert "deprecat" not in out.lower(), [line for line in out.splitlines() if "deprecat" in line.lower()]
    # The log is the run's (tests/run_output.py): nothing of Ray's, no traceback from its actors.
    assert foreign_lines(result.stdout) == [], foreign_lines(result.stdout)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.integration  # a subprocess
def test_a_process_of_the_run_starts_without_loading_ray_train_ray_data_or_torch():
    """Every Ray worker process of a run runs the setup hook as it starts (raychat.ray_glue.runtime_env):
    the replica holders and the coordinator too, which never use Ray Train or Ray Data. Loading both
    there cost each process ~1 s of CPU at every run's start, on the CPUs its workers start on."""
    code = ("import ray\nfrom raychat.ray_glue.runtime_env import set_up_worker_process\n"
            "set_up_worker_process()")
    assert not modules_loaded_by(code, "ray.train", "ray.data", "torch")


@pytest.fixture
def restored_logging():
    """quiet_ray changes process-wide logging and warning filters: put them back after the test."""
    import ray.data  # noqa: F401  (its import configures the loggers this test looks at)

    chatty = [*quiet.chatty_loggers(), logging.getLogger(TOKEN_AUTH_LOGGER)]
    progress = logging.getLogger(PROGRESS_NOTICE[0])
    handlers = ray_data_console_handlers()
    levels = ([logger.level for logger in chatty], [h.level for h in handlers], list(progress.filters))
    with warnings.catch_warnings():
        yield chatty, handlers
    for logger, level in zip(chatty, levels[0], strict=True):
        logger.setLevel(level)
    for handler, level in zip(handlers, levels[1], strict=True):
        handler.setLevel(level)
    progress.filters[:] = levels[2]


@pytest.mark.unit
def test_verbose_keeps_rays_chatter(restored_logging, monkeypatch):
    chatty, console = restored_logging
    assert console, "Ray Data's console handler moved: update raychat.ray_glue.quiet"
    before = ([logger.level for logger in chatty], [h.level for h in console])
    assert all(level < logging.WARNING for level in before[0] + before[1])
    notice = logging.LogRecord(PROGRESS_NOTICE[0], logging.WARNING, __file__, 0,
                               "Progress bars disabled. To enable, set ...", None, None)
    progress = logging.getLogger(PROGRESS_NOTICE[0])
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    quiet.quiet_ray()
    assert ([logger.level for logger in chatty], [h.level for h in console]) == before
    assert progress.filter(notice)
    monkeypatch.delenv(quiet.VERBOSE_ENV)
    quiet.quiet_ray()
    assert all(logger.level >= logging.WARNING for logger in chatty)
    assert all(h.level == logging.WARNING for h in console)
    assert not progress.filter(notice)  # the notice of a choice raychat made; the logger's other lines pass
    other = logging.LogRecord(PROGRESS_NOTICE[0], logging.WARNING, __file__, 0, "something else", None, None)
    assert progress.filter(other)


@pytest.mark.unit
def test_driver_drops_rays_preemption_watcher_error_and_keeps_other_errors(capsys, monkeypatch):
    """The one ERROR line Ray's own PreemptionCallback causes at every worker-group start is dropped
    (raychat.ray_glue.ray_internals.PREEMPTION_WATCHER_ARGS); --verbose keeps it; other errors always show."""
    watcher = ("[2026-12-02 23:21:54,518 E 29379 29379] core_worker.cc:2465: Actor with class name: "
               "'PreemptionWatcher' and ID: '62f1' has constructor arguments in the object store and "
               "max_restarts > 0.")
    other = "[2026-12-02 23:21:54,600 E 29379 29379] core_worker.cc:100: something real"
    printed = []
    batch = {"pid": 1, "is_err": True, "actor_name": "TrainController", "lines": [watcher, other]}
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    print_batch(lambda data: printed.append(data["lines"]), batch)
    print_batch(lambda data: printed.append(data["lines"]), {**batch, "lines": [watcher]})
    assert printed == [[other]]
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    print_batch(lambda data: printed.append(data["lines"]), batch)
    assert printed[-1] == [watcher, other]


@pytest.mark.unit
def test_ray_line_says_where_the_dashboard_is_and_how_to_get_its_token(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert ray_line("127.0.0.1:6379", "127.0.0.1:8265", joined=False) == (
        "Ray: started a local instance; dashboard http://127.0.0.1:8265 (it asks for the cluster's token: "
        "`ray get-auth-token` prints it)")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_line("10.0.0.1:6379", "http://10.0.0.1:8265", joined=True) == (
        "Ray: joined the cluster at 10.0.0.1:6379; dashboard http://10.0.0.1:8265")
    assert ray_line("10.0.0.1:6379", None, joined=True) == "Ray: joined the cluster at 10.0.0.1:6379"
