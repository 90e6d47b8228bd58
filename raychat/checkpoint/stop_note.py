"""A note the workers leave in the run's storage when they stop a run early on purpose.

Ray Train only hands the driver the metrics attached to the latest checkpoint, and every worker
exception is retried as a failure. A NaN loss is neither: retrying would hit it again and there is no
new checkpoint to carry the news. So rank 0 writes this small JSON next to the checkpoints (local
disk or a URI, through pyarrow's filesystem like Ray itself), and the driver reads it after `fit()`.
"""

import json

from raychat.storage import Storage

NOTE_NAME = "raychat_stopped.json"


def _run(storage_path: str, run_name: str) -> Storage:
    return Storage(storage_path).child(run_name)


def write_stop_note(storage_path: str, run_name: str, note: dict) -> None:
    _run(storage_path, run_name).write_bytes(NOTE_NAME, json.dumps(note).encode())


def read_stop_note(storage_path: str, run_name: str) -> dict | None:
    run = _run(storage_path, run_name)
    return json.loads(run.read_bytes(NOTE_NAME)) if run.exists(NOTE_NAME) else None


def clear_stop_note(storage_path: str, run_name: str) -> None:
    _run(storage_path, run_name).delete(NOTE_NAME)
