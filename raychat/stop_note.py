"""A note the workers leave in the run's storage when they stop a run early on purpose.

Ray Train only hands the driver the metrics attached to the latest checkpoint, and every worker
exception is retried as a failure. A NaN loss is neither: retrying would hit it again and there is no
new checkpoint to carry the news. So rank 0 writes this small JSON next to the checkpoints (local
disk or a URI, through pyarrow's filesystem like Ray itself), and the driver reads it after `fit()`.
"""

import json

import pyarrow.fs as pafs

NOTE_NAME = "raychat_stopped.json"


def _fs_and_path(storage_path: str, run_name: str) -> tuple[pafs.FileSystem, str]:
    if "://" in storage_path:
        fs, root = pafs.FileSystem.from_uri(storage_path)
    else:
        fs, root = pafs.LocalFileSystem(), storage_path
    return fs, f"{root.rstrip('/')}/{run_name}/{NOTE_NAME}"


def write_stop_note(storage_path: str, run_name: str, note: dict) -> None:
    fs, path = _fs_and_path(storage_path, run_name)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(note).encode())


def read_stop_note(storage_path: str, run_name: str) -> dict | None:
    fs, path = _fs_and_path(storage_path, run_name)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read().decode())


def clear_stop_note(storage_path: str, run_name: str) -> None:
    fs, path = _fs_and_path(storage_path, run_name)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_file(path)
