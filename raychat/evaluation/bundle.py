"""The eval bundle: nanochat's layout of the CORE tasks, loaded and checked before anything runs.

    <bundle>/core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot, icl_task_type,
                                  continuation_delimiter (default " ")}; num_fewshot is a list (the
                                  first entry is used, as nanochat does) or a number
    <bundle>/eval_data/<uri>      one JSON object per line; by icl_task_type:
                                    multiple_choice    {query, choices: [str], gold: int}
                                    schema             {context_options: [str], continuation, gold: int}
                                    language_modeling  {context, continuation}
    <bundle>/eval_meta_data.csv   columns `Eval Task` (= label) and `Random baseline` (percent)

Everything is read and checked at load time (a few MB for the real bundle), so a malformed bundle
is refused in one line naming the file before a worker starts, not at step 2000.
"""

import csv
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from raychat.common import RaychatError, raychat_home

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
# Fields every example of a task type must have, and their types.
FIELDS: dict[str, dict[str, type]] = {
    "multiple_choice": {"query": str, "choices": list, "gold": int},
    "schema": {"context_options": list, "continuation": str, "gold": int},
    "language_modeling": {"context": str, "continuation": str},
}
CONFIG_FILE, DATA_DIR, META_FILE = "core.yaml", "eval_data", "eval_meta_data.csv"


def default_bundle_dir() -> Path:
    """Where the bundle lives unless --eval-bundle says otherwise: $RAYCHAT_HOME/eval_bundle."""
    return raychat_home() / "eval_bundle"


@dataclass(frozen=True)
class Task:
    label: str
    task_type: str
    num_fewshot: int
    delimiter: str
    baseline: float          # random-guess accuracy in percent, from eval_meta_data.csv
    data: tuple[dict, ...]   # the examples in file order


@dataclass(frozen=True)
class Bundle:
    directory: Path
    tasks: tuple[Task, ...]

    @property
    def num_examples(self) -> int:
        return sum(len(task.data) for task in self.tasks)


def _fetch_hint(directory: Path) -> str:
    return (f"get it with `python -m raychat.corpus download-eval-bundle --out {directory}` or pass "
            "--eval-bundle with a directory holding core.yaml, eval_data/ and eval_meta_data.csv")


def _bad(path: Path, why: str) -> RaychatError:
    return RaychatError(f"eval bundle file {path} is malformed ({why}): fix or re-download the bundle "
                        "(python -m raychat.corpus download-eval-bundle)")


def _task_entries(directory: Path) -> list[dict]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        what = "does not exist" if not directory.exists() else f"has no {CONFIG_FILE}"
        raise RaychatError(f"no eval bundle at {directory} (it {what}): {_fetch_hint(directory)}")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise _bad(path, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
    entries = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise _bad(path, "no non-empty `icl_tasks` list")
    return entries


def _baselines(directory: Path) -> dict[str, float]:
    path = directory / META_FILE
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise _bad(path, f"{type(e).__name__}: {e}") from e
    baselines = {}
    for n, row in enumerate(rows, start=2):
        try:
            baselines[row["Eval Task"]] = float(row["Random baseline"])
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"line {n} lacks a label in `Eval Task` or a number in `Random baseline`") from e
    return baselines


def _check_example(item: Any, task_type: str) -> str | None:
    """What is wrong with one example (None: nothing)."""
    if not isinstance(item, dict):
        return "not a JSON object"
    for name, kind in FIELDS[task_type].items():
        value = item.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"field `{name}` missing or not a {kind.__name__}"
    options = item.get("choices", item.get("context_options"))
    if options is not None:
        if not options or not all(isinstance(o, str) for o in options):
            return "the options must be a non-empty list of strings"
        if not 0 <= item["gold"] < len(options):
            return f"gold {item['gold']} is not an index of its {len(options)} options"
    return None


def _examples(path: Path, task_type: str) -> tuple[dict, ...]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(path, f"{type(e).__name__}: {e}") from e
    data = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, f"line {n} is not JSON: {e.msg}") from e
        if problem := _check_example(item, task_type):
            raise _bad(path, f"line {n}: {problem} (a {task_type} example)")
        data.append(item)
    if not data:
        raise _bad(path, "no examples")
    return tuple(data)


def _task(entry: Any, n: int, directory: Path, baselines: dict[str, float]) -> Task:
    where = directory / CONFIG_FILE
    if not isinstance(entry, dict):
        raise _bad(where, f"icl_tasks entry {n} is not a mapping")
    label, uri, task_type = entry.get("label"), entry.get("dataset_uri"), entry.get("icl_task_type")
    if not isinstance(label, str) or not isinstance(uri, str):
        raise _bad(where, f"icl_tasks entry {n} needs a `label` and a `dataset_uri`")
    if task_type not in TASK_TYPES:
        raise _bad(where, f"task {label}: icl_task_type {task_type!r} is not one of {', '.join(TASK_TYPES)}")
    shots = entry.get("num_fewshot", [0])
    shots = shots[0] if isinstance(shots, list) and shots else shots
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise _bad(where, f"task {label}: num_fewshot must be a number >= 0 or a list of them")
    delimiter = entry.get("continuation_delimiter", " ")
    if not isinstance(delimiter, str):
        raise _bad(where, f"task {label}: continuation_delimiter must be a string")
    if label not in baselines:
        raise _bad(directory / META_FILE, f"no `Random baseline` for task {label}")
    data_path = directory / DATA_DIR / uri
    if not data_path.is_file():
        raise _bad(where, f"task {label}: its dataset {data_path} does not exist")
    data = _examples(data_path, task_type)
    if shots >= len(data):
        raise _bad(data_path, f"{len(data)} examples cannot give {shots}-shot prompts")
    return Task(label, task_type, shots, delimiter, baselines[label], data)


def load_bundle(directory: str | Path) -> Bundle:
    """Every task of the bundle at `directory`, checked; one RaychatError naming the file if not."""
    directory = Path(directory).expanduser().resolve()
    entries = _task_entries(directory)
    baselines = _baselines(directory)
    tasks = tuple(_task(entry, n, directory, baselines) for n, entry in enumerate(entries, start=1))
    labels = [task.label for task in tasks]
    if len(set(labels)) != len(labels):
        raise _bad(directory / CONFIG_FILE, "two tasks share a label")
    return Bundle(directory, tasks)


@lru_cache(maxsize=2)
def cached_bundle(directory: str) -> Bundle:
    """load_bundle once per process (a training worker scores the bundle at every CORE step)."""
    return load_bundle(directory)
