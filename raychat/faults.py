"""Faults sorted once, by what they are: transient ones are ridden out, the rest go where they belong.

A multi-day run on a bucket meets throttling (503 SlowDown), a stalled endpoint, reset connections,
a read task lost with its node. None of these is the user's to fix, so none may end the run as a
`RaychatError` (which stops it at once, even with `--max-failures -1`). They are retried here with
capped exponential backoff and jitter within a budget of minutes; past the budget the attempt fails
with `StorageUnavailable`, a plain exception, and Ray Train restarts it under `--max-failures`.
Everything else (a missing file, access denied, a missing bucket, a corrupt parquet, a
`RaychatError`) is not retried: it propagates at once, unchanged, for its caller to name.
"""

import math
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa

from raychat.common import RaychatError, StorageUnavailable

T = TypeVar("T")
__all__ = ["StorageUnavailable", "check_settings", "is_missing", "is_transient", "retry_transient",
           "retry_budget_s", "short_reason"]

DEFAULT_BUDGET_S = 300.0       # minutes, not seconds: a throttled bucket or a restarting endpoint
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0


# What pyarrow's S3/GCS clients put in the OSError they raise for faults that heal by themselves:
# AWS SDK error names ("AWS Error SLOW_DOWN during GetObject operation"), HTTP 5xx statuses, curl's
# transport errors (6 resolve, 7 connect, 18 body cut short, 28 timeout, 52 empty reply, 55/56
# send/recv), GCS's UNAVAILABLE / DEADLINE_EXCEEDED, and the plain socket words. A 501 is no fault
# of the moment: the store does not implement the request, and will not on the next try. A host
# that does not resolve stays transient here (a DNS hiccup mid-run heals); a typo'd one is caught
# by the pre-flight at start (raychat.storage.Storage.check_endpoint).
_TRANSIENT_TEXT = re.compile(
    r"aws error (network_connection|slow_down|throttling|service_unavailable|internal_failure"
    r"|request_timeout|request_limit_exceeded|too_many_requests)"
    r"|http (status|response code):? 5(?!01)\d\d|http (status|response code):? 429"
    r"|curlcode: (6|7|18|28|52|55|56)\b"
    r"|\b(unavailable|deadline_exceeded|resource_exhausted)\b"
    r"|slowdown|slow down|reduce your request rate|throttl"
    r"|connection (reset|refused|aborted|closed)|broken pipe|timed out|timeout was reached|stalled"
    # A temporary credential that lapsed while its refresh lags: the next try signs with the new one.
    r"|expired_?token|token.{0,20}expired|request_?expired",
    re.IGNORECASE)

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")

# Words that mark a fault no retry heals, even when its message also says something transient-looking.
_PERMANENT_TEXT = re.compile(
    r"access ?denied|access_denied|permission_denied|forbidden|http (status|response code):? 40[34]"
    r"|no_?such_?bucket|no such bucket|invalidaccesskeyid|signaturedoesnotmatch|no space left|quota exceeded"
    r"|not_?implemented|http (status|response code):? 501",
    re.IGNORECASE)


def _ray_transient(error: BaseException) -> bool | None:
    """True/False for Ray's own errors, None for anything else. Ray is only looked at once imported:
    an error from Ray cannot exist in a process that never imported it."""
    exceptions = sys.modules.get("ray.exceptions")
    if exceptions is None:
        return None
    if isinstance(error, exceptions.RayTaskError):
        # A task's own exception, re-raised by the caller: its cause decides (a task that hit a 503
        # is transient, one that found a corrupt shard is not). Ray Data's UserCodeException keeps
        # only the traceback's text: raychat's reads retry inside the task and say StorageUnavailable
        # there, which the loader finds in that text.
        return is_transient(error.cause)
    # Lost workers, actors, nodes and objects: the cluster changed under the call, not the data.
    lost = (exceptions.RayActorError, exceptions.NodeDiedError, exceptions.ObjectLostError,
            exceptions.WorkerCrashedError, exceptions.LocalRayletDiedError, exceptions.GetTimeoutError,
            exceptions.ObjectFetchTimedOutError, exceptions.RaySystemError)
    if isinstance(error, lost):
        return True
    return None


def is_transient(error: BaseException) -> bool:
    """Whether `error` is a fault that heals by itself (connection reset or refused, timeout, HTTP
    5xx, throttling, a stalled read, a lost Ray task/actor/node/object), so retrying is right."""
    if isinstance(error, (RaychatError, StorageUnavailable, FileNotFoundError, PermissionError)):
        return False
    ray_verdict = _ray_transient(error)
    if ray_verdict is not None:
        return ray_verdict
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, pa.ArrowInvalid):   # bytes that arrived whole but do not parse: damage
        return False
    if isinstance(error, (OSError, pa.ArrowException)):
        # Quoted names (keys, buckets, paths) are the user's words, not the error's: a key named
        # 'runs/throttle-test' must not make a 400 look like throttling.
        text = _QUOTED.sub("''", str(error))
        return not _PERMANENT_TEXT.search(text) and bool(_TRANSIENT_TEXT.search(text))
    return False


_MISSING_TEXT = re.compile(r"resource_not_found|no[ _]?such[ _]?key|http (status|response code):? 404",
                           re.IGNORECASE)


def is_missing(error: BaseException) -> bool:
    """Whether `error` says the file is not there: FileNotFoundError, or what an S3 client raises
    when an object disappears between opening it and reading it (GetObject's RESOURCE_NOT_FOUND, or
    NO_SUCH_KEY when the read's own request finds it gone)."""
    return isinstance(error, FileNotFoundError) or (
        isinstance(error, OSError) and bool(_MISSING_TEXT.search(_QUOTED.sub("''", str(error)))))


def short_reason(error: BaseException) -> str:
    """The first line of an error, squeezed to one short line for a log."""
    text = (str(error).strip().splitlines() or [""])[0] or type(error).__name__
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


def retry_budget_s() -> float:
    """Seconds a transient incident is ridden out: $RAYCHAT_RETRY_BUDGET_S, else 5 minutes."""
    return _seconds_setting("RAYCHAT_RETRY_BUDGET_S", DEFAULT_BUDGET_S, "e.g. 300")


def _seconds_setting(name: str, default: float, example: str) -> float:
    """$`name` as a finite number of seconds >= 0 (`default` when unset), or one RaychatError line."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise RaychatError(f"{name}={value!r} is not a number of seconds >= 0: set it to {example}, "
                           "or unset it")
    return seconds


def check_settings() -> None:
    """Every RAYCHAT_* setting read here, parsed now: called at a run's start, so a malformed one is
    refused in one line before anything runs, not at the first storage fault hours in (where the
    same error would end the run)."""
    retry_budget_s()


def _warn(line: str) -> None:
    print(f"raychat: warning: {line}", file=sys.stderr, flush=True)


# retry_transient calls of this process now riding out a fault: the first to start logs the incident,
# the last to end logs its outcome, so 32 footer reads hitting one throttled bucket make two lines.
_open_incidents = 0
_incidents_lock = threading.Lock()


def retry_transient(fn: Callable[[], T], what: str, log: Callable[[str], None] = _warn,
                    budget_s: float | None = None) -> T:
    """`fn()`, with transient faults retried for up to `budget_s` seconds (default
    $RAYCHAT_RETRY_BUDGET_S, else 5 minutes) from the first failure, then `StorageUnavailable`.
    Non-transient errors propagate at once, unchanged.

    `what` completes "storage fault while ..." (e.g. "reading shard_00003.parquet row group 7").
    One line is logged when an incident starts and one when it ends, never one per try.
    """
    try:
        return fn()
    except Exception as e:
        if not is_transient(e):
            raise
        return _ride_out(fn, what, log, retry_budget_s() if budget_s is None else budget_s, e)


def _ride_out(fn: Callable[[], T], what: str, log: Callable[[str], None], budget: float,
              error: Exception) -> T:
    """retry_transient after its first transient `error`: backoff, retries, the incident's lines."""
    global _open_incidents
    started, tries = time.monotonic(), 1
    with _incidents_lock:
        _open_incidents += 1
        if _open_incidents == 1:
            log(f"storage fault while {what}: {short_reason(error)}; retrying for up to {budget:.0f} s")
    outcome = f"storage fault while {what}: retrying interrupted"
    try:
        while True:
            left = started + budget - time.monotonic()
            if left <= 0:
                outcome = (f"storage fault while {what} outlasted the {budget:.0f} s retry budget ({tries} "
                           "tries); giving up (in a worker, the attempt fails and Ray restarts it)")
                raise StorageUnavailable(f"{what}: {short_reason(error)} (still failing after {budget:.0f} s "
                                         f"and {tries} tries; RAYCHAT_RETRY_BUDGET_S sets the budget)"
                                         ) from error
            # Capped exponential backoff with "equal jitter": many ranks hitting one throttled bucket
            # spread out instead of retrying in lockstep, yet each waits at least half its step.
            delay = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** min(tries - 1, 16))
            time.sleep(min(left, random.uniform(delay / 2, delay)))
            try:
                result = fn()
            except Exception as e:
                if not is_transient(e):
                    outcome = f"storage fault while {what} ended in another error: {short_reason(e)}"
                    raise
                error, tries = e, tries + 1
                continue
            outcome = (f"storage recovered while {what} after {time.monotonic() - started:.1f} s "
                       f"({tries} failed tries)")
            return result
    finally:
        with _incidents_lock:
            _open_incidents -= 1
            if _open_incidents == 0:
                log(outcome)
