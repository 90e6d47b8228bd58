"""Logs that are the run's: a tiny training run with Ray's deprecation warnings at raychat's own calls
turned into errors (RAYCHAT_STRICT_WARNINGS) finishes, and its output has raychat's lines without
Ray's per-report and per-dataset chatter; RAYCHAT_VERBOSE brings the chatter back."""

import logging
import warnings

import pytest
from test_train import STEP_LINE, VAL_LINE, log_lines, run_train, tiny_flags

from raychat.run import quiet

CHATTER = ["Reporting training result", "registers for logging", "execution finished",
           "Starting execution of Dataset", "exclude_resources"]


@pytest.mark.ray
@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_tiny_run_calls_no_deprecated_ray_api_and_logs_no_chatter(ray_session, tiny_corpus, storage):
    flags = ["--num-workers", "1", "--total-batch-size", "1024", "--num-iterations", "6", "--eval-every", "3"]
    result = run_train(ray_session, tiny_flags(tiny_corpus, storage, "quiet", *flags),
                       RAYCHAT_STRICT_WARNINGS="1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert [int(m.group(1)) for m in log_lines(result.stdout, STEP_LINE)] == list(range(6))
    assert [int(m.group(1)) for m in log_lines(result.stdout, VAL_LINE)] == [0, 3, 6]
    assert [line for line in out.splitlines() if any(c in line for c in CHATTER)] == []
    assert "deprecat" not in out.lower(), [line for line in out.splitlines() if "deprecat" in line.lower()]


@pytest.fixture
def restored_logging():
    """quiet_ray changes process-wide logging and warning filters: put them back after the test."""
    import ray.data  # noqa: F401  (its import configures the loggers this test looks at)

    report_logger = quiet._train_report_logger()
    handlers = [h for h in logging.getLogger("ray.data").handlers if isinstance(h, logging.StreamHandler)]
    levels = (report_logger.level, [h.level for h in handlers])
    with warnings.catch_warnings():
        yield report_logger, handlers
    report_logger.setLevel(levels[0])
    for handler, level in zip(handlers, levels[1], strict=True):
        handler.setLevel(level)


def test_verbose_keeps_rays_chatter(restored_logging, monkeypatch):
    report_logger, console = restored_logging
    assert console, "Ray Data's console handler moved: update raychat.run.quiet"
    before = (report_logger.level, [h.level for h in console])
    assert before[0] < logging.WARNING and all(level < logging.WARNING for level in before[1])
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    quiet.quiet_ray()
    assert (report_logger.level, [h.level for h in console]) == before
    monkeypatch.delenv(quiet.VERBOSE_ENV)
    quiet.quiet_ray()
    assert report_logger.level == logging.WARNING and all(h.level == logging.WARNING for h in console)
