"""The run's own lines (plan, steps, validation, samples, summary) on the driver's stdout exactly as
nanochat prints them, so `grep '^step'` and nanochat log parsers work on raychat logs.

Ray forwards every worker's stdout to the driver as "(RayTrainWorker pid=...) line", coloured even
in a file or `ray job logs`. Ray 2.60 has no per-line opt-out (RAY_DISABLE_WORKER_LOG_PREFIX drops
the prefix of every process, warnings included), so the worker marks its lines (log_line) and the
driver, which already receives every forwarded batch through Ray's log dispatcher, prints marked
lines bare and hands the rest to Ray's own printer: other processes' warnings and errors keep their
prefix. Colour codes only on a terminal: RAY_COLOR_PREFIX=0 (read by Ray at print time) for the
prefixes, and a filter on Ray's log handler for the colours in its own log lines (its warnings).
One ERROR line Ray's own code causes at every worker-group start is dropped here unless --verbose
(raychat.ray_glue.ray_internals.PREEMPTION_WATCHER_ARGS says which and why).
"""

import functools
import itertools
import logging
import os
import re
import sys
from collections.abc import Callable

from raychat.ray_glue.quiet import verbose
from raychat.ray_glue.ray_internals import PREEMPTION_WATCHER_ARGS
from raychat.ray_glue.ray_internals import STDSTREAM_DISPATCHER as dispatcher

# Ray's own magic tokens look the same (":actor_name:", ":info_message:"); a worker's raw log file
# shows this in front of each of the run's lines.
MARK = ":raychat:"
RAY_PRINTER = "ray_print_logs"  # the name ray.init(log_to_driver=True) registers its printer under
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class NoColour(logging.Filter):
    """Strips colour codes from a log record's text."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = ANSI_COLOUR.sub("", record.getMessage()), None
        return True


def log_line(message: str) -> None:
    """Print one of the run's lines from a Ray worker, instead of print(): the driver shows it
    without Ray's prefix. Ray forwards line by line, so every line of the message is marked."""
    print("\n".join(MARK + line for line in message.split("\n")), flush=True)


def print_batch(ray_print: Callable[[dict], None], data: dict) -> None:
    """Print one forwarded batch: marked lines bare, runs of other lines through Ray's printer."""
    for marked, group in itertools.groupby(data.get("lines", []), key=lambda line: line.startswith(MARK)):
        lines = list(group)
        if marked:
            sink = sys.stderr if data.get("is_err") else sys.stdout
            sink.write("".join(line[len(MARK):] + "\n" for line in lines))
            sink.flush()
        elif lines := [line for line in lines if not _rays_own_error(line)]:
            ray_print({**data, "lines": lines})


def _rays_own_error(line: str) -> bool:
    """A line Ray's own code causes and the user can do nothing about (kept with --verbose)."""
    return PREEMPTION_WATCHER_ARGS.search(line) is not None and not verbose()


def plain_when_redirected() -> None:
    """In the driver, before ray.init: no colour codes where the output is a file or a pipe."""
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if not sys.stderr.isatty():
        for handler in logging.getLogger("ray").handlers:
            if not any(isinstance(f, NoColour) for f in handler.filters):
                handler.addFilter(NoColour())


def install_driver_printer() -> None:
    """In the driver, after ray.init(log_to_driver=True): show the workers' marked lines bare."""
    printers = [h for name, h in dispatcher.handlers if name == RAY_PRINTER]
    if len(printers) != 1:
        return  # log_to_driver=False: nothing is forwarded to this process
    (ray_print,) = printers
    if isinstance(ray_print, functools.partial) and ray_print.func is print_batch:
        return  # already installed for this connection
    # Same name, so Ray's disconnect removes ours as it would its own.
    dispatcher.remove_handler(RAY_PRINTER)
    dispatcher.add_handler(RAY_PRINTER, functools.partial(print_batch, ray_print))
