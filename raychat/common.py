"""Things every raychat module needs: where files live, how a user-facing error looks, and whether an
address a user gave answers.

A `RaychatError` is a mistake the user can fix (bad flag, bad corpus, bad checkpoint). Entry points
print it as one line naming the file or flag and the fix, and exit non-zero; anything else is a bug
and keeps its traceback.
"""

import atexit
import gc
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path


class RaychatError(Exception):
    """An error the user can fix; its message is one line that says what and how."""


class StorageUnavailable(Exception):
    """A transient fault that outlasted its retry budget (raychat.faults). Deliberately not a
    RaychatError: in a worker, Ray Train fails the attempt and restarts it under --max-failures
    instead of ending the run; in a command, it is one line and exit code 75 (try again later)."""


NAME = re.compile(r"[A-Za-z0-9._-]+")


def require_extra(module: str, extra: str, needed_for: str) -> None:
    """Refuse, in one line naming the extra to install, a command whose library is an extra of raychat's
    (a training node needs neither the report's plotting nor the Hub's client)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise RaychatError(f"{needed_for} needs {module}, which is not installed: "
                           f"pip install 'raychat[{extra}]'")


def check_name(value: str, flag: str) -> str:
    """`value`, if it is a name (of a run, a model, a sweep): letters, digits, `.`, `_`, `-`, never a
    path (no `/`, no `..`), so what it names stays inside the directory it is named in."""
    if not NAME.fullmatch(value) or ".." in value or value == ".":
        raise RaychatError(f"{flag} must be a name of letters, digits, '.', '_' and '-' (no '/' and no "
                           f"'..'), got {value!r}: choose such a name")
    return value


def unreachable(host: str, port: int, budget_s: float = 5.0) -> str | None:
    """Why a TCP connection to host:port fails ("connection refused", "no answer", a name that does not
    resolve) on every attempt, a second apart, for `budget_s`; None once one connects. A pre-flight
    for an address a user typed: the client behind it (Ray's, pyarrow's S3) retries for seconds to
    minutes before it says anything, while a server restarting (a GCS, a MinIO) is ridden out."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            wait = max(0.5, min(3.0, deadline - time.monotonic()))
            socket.create_connection((host, port), timeout=wait).close()
            return None
        except socket.gaierror as e:  # a name that does not resolve is a typo, not a restart
            return (e.strerror or str(e)).lower()
        except OSError as e:
            reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        if time.monotonic() + 1.0 >= deadline:
            return reason
        time.sleep(1.0)


def raychat_home() -> Path:
    """Root for data, tokenizer and runs: $RAYCHAT_HOME, else ~/.cache/raychat."""
    home = os.environ.get("RAYCHAT_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "raychat"


def default_data_dir() -> Path:
    return raychat_home() / "data"


def default_tokenizer_dir() -> Path:
    return raychat_home() / "tokenizer"


def default_storage_path() -> Path:
    return raychat_home() / "runs"


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a command's main(); turn RaychatError into one stderr line and exit code 2."""
    # The interpreter's last collections at exit walk every object torch and Ray created, only to
    # free memory that exiting returns anyway: on a small node a noticeable part of a short command.
    # The heap is frozen at exit, not now, so a process that runs commands in-process keeps
    # collecting until then.
    atexit.register(gc.freeze)
    try:
        code = main(argv)
    except RaychatError as e:
        message = " ".join(str(e).split())  # one line, whatever the message was built from
        print(f"raychat: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except StorageUnavailable as e:
        message = " ".join(str(e).split())
        print(f"raychat: error: storage unavailable: {message}; nothing was lost: run the same command "
              "again once the storage answers", file=sys.stderr, flush=True)
        sys.exit(75)  # EX_TEMPFAIL: a job scheduler may retry it
    except KeyboardInterrupt:
        print("raychat: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(code or 0)
