"""A note the workers leave in the run's storage when they stop a run early on purpose.

Ray Train only hands the driver the metrics attached to the latest checkpoint, and every worker
exception is retried as a failure. A NaN loss is neither: retrying would hit it again and there is no
new checkpoint to carry the news. So rank 0 writes this small JSON next to the checkpoints (local
disk or a URI, through pyarrow's filesystem like Ray itself), and the driver reads it after `fit()`.
"""

import json
from dataclasses import dataclass

from raychat.common import RaychatError
from raychat.records import Record
from raychat.storage import Storage

NOTE_NAME = "raychat_stopped.json"


@dataclass
class StopNote(Record):
    """Why the workers of the driver run `session` stopped: a non-finite loss or weights at `step`
    ("nan"), or a user error whose one line is `message` ("error")."""

    reason: str  # "nan" | "error"
    session: str
    step: int | None = None
    message: str | None = None

    def of(self, session: str, reason: str) -> bool:
        """This driver run's note, for this reason (a note another run left is not ours to act on)."""
        return self.session == session and self.reason == reason


def _run(storage_path: str, run_name: str) -> Storage:
    return Storage(storage_path).child(run_name)


def write_stop_note(storage_path: str, run_name: str, note: StopNote) -> None:
    _run(storage_path, run_name).replace_atomically(NOTE_NAME, json.dumps(note.to_dict()).encode())


def read_stop_note(storage_path: str, run_name: str) -> StopNote | None:
    run = _run(storage_path, run_name)
    if not run.exists(NOTE_NAME):
        return None
    where = f"{run}/{NOTE_NAME}"
    try:
        raw = json.loads(run.read_replaceable(NOTE_NAME))
    except ValueError:
        raise RaychatError(f"{where} is not JSON: delete it and rerun") from None
    return StopNote.from_dict(raw, where=where)


def clear_stop_note(storage_path: str, run_name: str) -> None:
    _run(storage_path, run_name).delete(NOTE_NAME)
