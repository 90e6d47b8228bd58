"""Logs that are the run's: raychat's lines and real warnings and errors, without Ray's chatter.

Silenced at the source, in each process that logs it: the driver (raychat.run.driver.connect_ray) and
every Ray worker process of the run as it starts (the Train controller, the Train workers, Ray Data's
tasks: the runtime env's worker_process_setup_hook, raychat.ray_glue.runtime_env):
  - Ray Train's "Reporting training result N: TrainingReport(...)" at every report (INFO, from
    ray/train/v2/_internal/execution/context.py, whose logger is named by its file path);
  - Ray Data's per-dataset lines on the console: "Starting execution of Dataset", "registers for
    logging while another dataset ... is also logging", "Dataset ... execution finished in ..."
    (INFO, logger "ray.data"; its file log, ray-data.log in the session's log directory, keeps them),
    and its notice that progress bars are off (raychat's loader turns them off);
  - the driver's "Connected to Ray cluster. View the dashboard at ..." and Ray's token-auth notice
    at ray.init (raychat.run.driver.ray_line says where the dashboard is and how to get its token;
    the loggers are named in raychat.ray_glue.ray_internals).
The Train controller's and workers' narration of each attempt (resource requests, state transitions,
the worker group and its list, the failure policy's retry) is silenced through
Ray Train's own LoggingConfig (raychat.run.driver.train_logging); raychat says each attempt in one
line of its own (raychat.worker.setup).
Warnings Ray raises about its own internals, which raychat cannot fix, are filtered one by one, each
naming the Ray code that raises it, so the filter can go when Ray fixes it.

RAYCHAT_VERBOSE=1 (or `--verbose`, which sets it for the workers too) keeps all of it.

RAYCHAT_STRICT_WARNINGS=1 turns every DeprecationWarning raised at a call in raychat's own code into
an error, in the driver and in every worker process: a Ray API that Ray has deprecated (and a later Ray
will remove) then fails the run at once, instead of warning in a log nobody reads (the test suite
runs a tiny training so).
"""

import logging
import os
import sys
import warnings

from raychat.ray_glue.ray_internals import (
    CHATTY_LOGGERS,
    PROGRESS_NOTICE,
    TOKEN_AUTH_LOGGER,
    TRAIN_REPORT_LOGGER,
    ray_data_console_handlers,
)

VERBOSE_ENV = "RAYCHAT_VERBOSE"
STRICT_ENV = "RAYCHAT_STRICT_WARNINGS"

# Messages of the Ray-internal warnings filtered here, each with the Ray code that raises it.
RAY_INTERNAL_WARNINGS = [
    # ray/train/_internal/data_config.py, DataConfig.default_ingest_options, passes
    # ExecutionOptions(exclude_resources=...), whose setter warns (ray/data/_internal/execution/
    # interfaces/execution_options.py): raised for every Ray Train trainer with a Ray Data dataset.
    r"`ExecutionOptions\.exclude_resources` is deprecated",
    # ray/data/context.py, DataContext.__setattr__, warns while DataContext.__init__ sets its own
    # deprecated defaults (use_push_based_shuffle): raised by the first use of Ray Data in a process.
    r"`use_push_based_shuffle` is deprecated",
]


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class DropNotice(logging.Filter):
    """Drops a logger's records whose message starts with `prefix`: one notice, not the logger."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def chatty_loggers() -> list[logging.Logger]:
    """The loggers quiet_ray raises to WARNING: Ray Train's per-report line and the driver's ray.init."""
    return [logging.getLogger(name) for name in (TRAIN_REPORT_LOGGER, *CHATTY_LOGGERS)]


def quiet_ray(main_is_raychat: bool = False) -> None:
    """Silence Ray's chatter in this process; RAYCHAT_VERBOSE=1 leaves everything as Ray has it.
    `main_is_raychat`: this process runs a raychat command as __main__ (the driver), whose calls count
    as raychat's own. Loggers and warning filters set here hold for modules imported later; Ray Data's
    console handler is made by Ray Data's import, so it is quieted only once ray.data is loaded: a
    process that loads it after this call (a Train worker, after the setup hook) calls it again.
    Nothing is imported for it: every process of the run calls this as it starts."""
    if os.environ.get(STRICT_ENV, "") not in ("", "0"):
        ours = r"raychat\.|__main__$" if main_is_raychat else r"raychat\."
        warnings.filterwarnings("error", category=DeprecationWarning, module=ours)
    if verbose():
        return

    for pattern in RAY_INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=DeprecationWarning)
    for logger in chatty_loggers():
        logger.setLevel(logging.WARNING)
    logging.getLogger(TOKEN_AUTH_LOGGER).setLevel(logging.ERROR)  # said by the driver's "Ray:" line
    name, prefix = PROGRESS_NOTICE
    progress = logging.getLogger(name)
    if not any(isinstance(f, DropNotice) for f in progress.filters):
        progress.addFilter(DropNotice(prefix))
    if "ray.data" in sys.modules:
        for handler in ray_data_console_handlers():
            handler.setLevel(logging.WARNING)  # the console; the session's ray-data.log keeps INFO
