"""A log written off the caller's thread, and a log an object store can grow without rewriting it.

`BackgroundWriter`: the caller hands lines over and goes on; a thread of the writer's own writes them,
in order, when a flush is asked for, taking every line held by then (one write however many flushes
were asked for meanwhile). A line stays held until a write of it succeeded, so what the caller reads
back as held (a memory replica carries it) is never less than what storage lacks. The lines held are
bounded: past `max_lines` the oldest are dropped, said in one line, so a storage outage longer than
the bound costs the oldest records, never the process its memory.

`PartedFile`: an object store cannot append, and rewriting a log whole at every flush uploads it again
and again (the run's metrics log grew to tens of MB). So each write there is a new object,
`<name>.parts/part_<attempt>_<seq>.jsonl`: `attempt` one above the highest the directory held when the
file was opened (a later writer's parts sort after an earlier one's), `seq` the write's number in
that attempt. An object is created only where none is (`Storage.create_exclusive`): no part is ever
rewritten, not even by two writers that picked the same attempt number. `read_whole` gives the file
(as an older writer left it whole, if it did) then the parts in order, as one text.
"""

import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

from raychat.faults import is_missing
from raychat.storage import Storage

PART = re.compile(r"part_(\d+)_(\d+)\.jsonl")
READERS = 16  # parts read at once: a log of a long run is many small objects


def _say(line: str) -> None:
    # A closed or broken stderr (a detached job, a pipe whose reader left) must not end the thread.
    with suppress(OSError, ValueError):
        print(f"raychat: {line}", file=sys.stderr, flush=True)


class BackgroundWriter:
    """Writes the lines handed to `add` with `write(lines)` from a daemon thread of its own. `write`
    raises when it wrote nothing (the lines are kept for the next flush) and returns when the lines
    are done with (written, or deliberately dropped: a superseded writer's)."""

    def __init__(self, write: Callable[[list[str]], None], where: str, max_lines: int):
        self._write, self._where, self._max_lines = write, where, max_lines
        self._cond = threading.Condition()
        self._lines: list[str] = []
        self._front = 0  # the number of the first line held (lines written or dropped come before)
        self._asked = 0  # flushes asked for
        self._tried = 0  # the last flush asked for that the thread has tried
        self._failed = False  # whether that try failed
        self._failing = False  # a failure said, and no write has succeeded since
        self._dropping = False  # dropped lines said, and no write has succeeded since
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"raychat-writer {where}", daemon=True)
        self._thread.start()

    def add(self, line: str, flush: bool) -> None:
        """Hold `line` (and ask for a flush if `flush`): never waits on storage."""
        with self._cond:
            self._lines.append(line)
            over = len(self._lines) - self._max_lines
            if over > 0:
                del self._lines[:over]
                self._front += over
                if not self._dropping:  # the caller's thread says it: a print, not storage
                    _say(f"{self._where} is {self._max_lines} records behind: dropping the oldest until a "
                         "write succeeds")
                    self._dropping = True
            if flush:
                self._asked += 1
                self._cond.notify_all()

    def flush(self, wait_s: float = 0.0) -> bool:
        """Ask for a write of every line held now; wait up to `wait_s` seconds for it. True when all of
        them are written (or dropped), False while some are still held (a write failed or is slow)."""
        with self._cond:
            target = self._front + len(self._lines)
            if not self._lines:
                return True
            self._asked += 1
            asked = self._asked
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._front >= target or (self._tried >= asked and self._failed),
                                timeout=wait_s)
            return self._front >= target

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the flushes asked for so far to be tried; True if they were
        and the last one succeeded."""
        with self._cond:
            asked = self._asked
            return self._cond.wait_for(lambda: self._tried >= asked, timeout=timeout) and not self._failed

    def held(self) -> list[str]:
        """The lines not written yet (those being written included), oldest first."""
        with self._cond:
            return list(self._lines)

    def stop(self) -> None:
        """End the thread after the write in progress, writing nothing more (what the caller still
        holds is the caller's: a memory replica carries it)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._tried or self._stopped)
                if self._stopped:
                    return
                asked, front, batch = self._asked, self._front, list(self._lines)
            error = None
            if batch:
                try:
                    self._write(batch)
                except Exception as e:  # noqa: BLE001 (any failure: the thread must live on, the lines kept)
                    error = e
            with self._cond:
                if error is None:
                    # Lines the bound dropped meanwhile were the oldest, so the batch's written lines
                    # still held are the first ones held.
                    end = front + len(batch)
                    if end > self._front:
                        del self._lines[:end - self._front]
                        self._front = end
                    self._failing = self._dropping = False
                held = len(self._lines)
                say = error is not None and not self._failing
                self._failing = self._failing or error is not None
            if say:  # one line per outage: the records are kept and the next flush tries again
                # Said before the waiters hear of the failure: one that reads the process's output
                # then finds the line there.
                _say(f"cannot write {self._where} ({error}); will retry ({held} records kept for the next "
                     "flush)")
            with self._cond:
                self._tried, self._failed = asked, error is not None
                self._cond.notify_all()


class PartedFile:
    """The file `name` below `storage`, grown by one new part object per `append` (see the module)."""

    def __init__(self, storage: Storage, name: str, parts: list[str] | None = None):
        self._storage, self._name = storage, name
        self._dir = storage.child(parts_dir(name))
        self._attempt = next_attempt(parts if parts is not None else part_names(storage, name))
        self._seq = 0
        # create_exclusive is the store's atomic create (S3 If-None-Match, GCS ifGenerationMatch, a hard
        # link on disk); on another store a part's name is only this writer's by the attempt number
        self._exclusive = storage.creates_exclusively

    def append(self, data: bytes) -> None:
        while True:
            part = f"part_{self._attempt:06d}_{self._seq:06d}.jsonl"
            if self._exclusive:
                created = self._dir.create_exclusive(part, data)
            else:
                self._dir.write_whole(part, lambda f: f.write(data))
                created = True
            if created:
                self._seq += 1
                return
            # Taken: another writer picked this attempt's number (or a retry of this very write
            # succeeded before its answer was lost: its lines, written twice, are read once).
            self._attempt, self._seq = next_attempt(part_names(self._storage, self._name)), 0


def parts_dir(name: str) -> str:
    return f"{name}.parts"


def _key(part: str) -> tuple[int, int]:
    match = PART.fullmatch(part)
    return (int(match[1]), int(match[2])) if match else (-1, -1)


def part_names(storage: Storage, name: str) -> list[str]:
    """The parts of `name`, in order (other files there, a temporary one, are no parts)."""
    found = [info.base_name for info in storage.child(parts_dir(name)).files()]
    return sorted((part for part in found if PART.fullmatch(part)), key=_key)


def next_attempt(parts: list[str]) -> int:
    return max((_key(part)[0] for part in parts), default=0) + 1


def read_whole(storage: Storage, name: str, parts: list[str] | None = None) -> str | None:
    """The file `name` (as a writer of the whole file left it) then its parts in order, as one text,
    each piece ending on a line of its own (a torn last line stays a line apart); None when there is
    neither."""
    parts = part_names(storage, name) if parts is None else parts
    pieces = [storage.read_bytes(name)] if storage.exists(name) else None
    if pieces is None and not parts:
        return None
    directory = storage.child(parts_dir(name))

    def read(part: str) -> bytes:
        try:
            return directory.read_bytes(part)
        except OSError as e:
            if is_missing(e):  # deleted since the listing (the run deleted): nothing of it to read
                return b""
            raise

    if len(parts) > 1:
        with ThreadPoolExecutor(min(READERS, len(parts))) as pool:
            pieces = [*(pieces or []), *pool.map(read, parts)]
    else:
        pieces = [*(pieces or []), *map(read, parts)]
    return "".join(text if not text or text.endswith("\n") else text + "\n"
                   for text in (piece.decode(errors="replace") for piece in pieces))
