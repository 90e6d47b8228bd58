"""Fetch ClimbMix shards (karpathy/climbmix-400b-shuffle, the corpus nanochat trains on) from the Hub.

`_hub().snapshot_download` does the transfer: parallel streams, resume of partial files
(kept under `data_dir/.cache/huggingface/`), retries of dropped connections, a progress bar, the
size check, `HF_TOKEN`/`hf auth login`, `HF_ENDPOINT` (a mirror), `HF_HUB_OFFLINE` and
`HF_HUB_DISABLE_PROGRESS_BARS`. The shards land in `data_dir` itself (its `local_dir` mode), not in
the shared `HF_HOME` cache, so a corpus is one self-contained directory the trainer can be pointed at.
A bucket URI as `data_dir` streams the shards through a local staging directory into the bucket a
batch at a time: one copy of the corpus for every node, and no node downloads it at set-up.

What raychat adds: the revision is resolved to one commit before anything is fetched, every file
comes from that commit, and the commit is recorded in `corpus.json`, so the data cannot change
under a run, and adding shards later fetches them from the same commit. After the transfer each
file is checked against what the Hub publishes for it (size, and the sha256 of LFS files or the git
blob id of small ones) and must open as a shard, else it is deleted and fetched again once.
"""

import functools
import hashlib
import importlib.util
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from raychat.common import RaychatError, raychat_home, require_extra
from raychat.corpus.files import corpus_storage
from raychat.corpus.index import open_shard, read_corpus_meta, shard_filename, write_corpus_meta
from raychat.locations import is_uri, join_uri, normalize_location, redact
from raychat.storage import Storage

if TYPE_CHECKING:
    from huggingface_hub import RepoFile

REPO_ID = "karpathy/climbmix-400b-shuffle"
REPO_TYPE = "dataset"
# A branch until a commit of the dataset is verified here (this machine cannot reach the Hub): the
# first download pins it to the commit it resolves to, and corpus.json keeps that commit.
DEFAULT_REVISION = "main"
MAX_SHARD = 6542          # shard_06542.parquet is the last file, the validation split
DEFAULT_SHARDS = 8        # what the trainer's embedded default fetches (~800 MB)
COMMIT = re.compile(r"^[0-9a-f]{40}$")


DEFAULT_ENDPOINT = "https://huggingface.co"  # huggingface_hub's own default, where it is not installed


def hub_installed() -> bool:
    """Whether huggingface_hub (the `hub` extra) is installed: training needs it only to download."""
    return importlib.util.find_spec("huggingface_hub") is not None


def _hub() -> ModuleType:
    """huggingface_hub, imported when a download needs it: a node that trains from a corpus on disk or
    in a bucket never does, so the library is an extra (`raychat[hub]`)."""
    require_extra("huggingface_hub", "hub", f"downloading {REPO_ID}")
    import huggingface_hub
    import huggingface_hub.constants  # submodules: the package's lazy attributes do not include them
    import huggingface_hub.errors

    return huggingface_hub


def hub_endpoint() -> str:
    """$HF_ENDPOINT (a mirror, or a test server) read now, else the library's default."""
    default = _hub().constants.ENDPOINT if hub_installed() else DEFAULT_ENDPOINT
    return (os.environ.get("HF_ENDPOINT") or default).rstrip("/")


def _hub_error(e: Exception, endpoint: str) -> RaychatError:
    detail = " ".join(str(e).split())[:300] or type(e).__name__
    return RaychatError(f"could not fetch {REPO_ID} from {endpoint} ({detail}): check the network, "
                        "HF_ENDPOINT and HF_TOKEN, then re-run the same command (complete files are kept, "
                        "partial ones resumed), or set RAYCHAT_OFFLINE=1 for the offline sample corpus")


def _hub_call(where: str, call: Callable, /, *args, **kwargs):
    """Run a huggingface_hub call on endpoint `where`; a network or Hub failure becomes one RaychatError."""
    errors = _hub().errors
    try:
        return call(*args, **kwargs)
    except (OSError, errors.OfflineModeIsEnabled, errors.HfHubHTTPError) as e:
        raise _hub_error(e, where) from e
    except Exception as e:
        # huggingface_hub lets its HTTP client's connection errors through unwrapped; they share no
        # base class with the above, so they are recognised by the module that raised them.
        if type(e).__module__.split(".")[0].startswith("httpx"):
            raise _hub_error(e, where) from e
        raise


def resolve_revision(revision: str, endpoint: str | None = None) -> str:
    """The commit a branch, tag or commit of the dataset names now."""
    if COMMIT.match(revision):
        return revision
    endpoint = endpoint or hub_endpoint()
    api = _hub().HfApi(endpoint=endpoint)
    return _hub_call(endpoint, api.dataset_info, REPO_ID, revision=revision).sha


def reachable(endpoint: str | None = None, timeout_s: float = 5.0) -> bool:
    """Whether the Hub answers for the dataset within timeout_s."""
    endpoint = endpoint or hub_endpoint()
    url = _hub().hf_hub_url(REPO_ID, shard_filename(MAX_SHARD), repo_type=REPO_TYPE,
                                     revision=DEFAULT_REVISION, endpoint=endpoint)
    try:
        _hub_call(endpoint, _hub().get_hf_file_metadata, url, timeout=timeout_s)
    except RaychatError:
        return False
    return True


def _digest(path: Path, algorithm: str, prefix: bytes = b"") -> str:
    digest = hashlib.new(algorithm, prefix)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _problem(path: Path, published: "RepoFile") -> str | None:
    """What is wrong with a downloaded file, compared with what the Hub publishes for it (None: nothing)."""
    if not path.is_file():
        return "missing after the download"
    size = path.stat().st_size
    if size != published.size:
        return f"{size:,} bytes, the Hub publishes {published.size:,}"
    if published.lfs is not None:
        expected, actual, kind = published.lfs.sha256, _digest(path, "sha256"), "sha256"
    else:  # a small file kept in git: its id is the sha1 of a header and the content
        expected, actual, kind = published.blob_id, _digest(path, "sha1", b"blob %d\0" % size), "git blob id"
    if actual != expected:
        return f"{kind} {actual}, the Hub publishes {expected}"
    try:
        open_shard(path)
    except RaychatError:
        return "not a parquet shard with a `text` column"
    return None


def _pinned_revision(data_dir: str, revision: str | None, endpoint: str) -> str:
    """The commit to fetch: --revision resolved, else the one this corpus was started from, else the
    default resolved. A corpus never mixes commits."""
    recorded = read_corpus_meta(data_dir)
    if recorded and recorded.get("source") != "hub":
        raise RaychatError(f"{redact(data_dir)} holds a {recorded.get('source')} corpus, not a Hub download: "
                           "choose another --data-dir")
    recorded_commit = recorded.get("revision")
    if revision is None and recorded_commit:
        return recorded_commit
    commit = resolve_revision(revision or DEFAULT_REVISION, endpoint)
    if recorded_commit and commit != recorded_commit:
        raise RaychatError(f"{redact(data_dir)} holds shards of {REPO_ID} at commit {recorded_commit}, "
                           f"--revision {revision} is commit {commit}: choose another --data-dir, or drop "
                           "--revision")
    return commit


def download_shards(data_dir: str | Path, num_shards: int, revision: str | None = None, workers: int = 8,
                    endpoint: str | None = None, log: Callable[[str], None] = print,
                    staging: Path | None = None) -> list[str]:
    """Fetch train shards 0..num_shards-1 and the validation shard into data_dir (a directory or a
    bucket URI), all from one commit (see _pinned_revision); returns their locations. Complete files
    are kept, partial ones resumed."""
    if not 1 <= num_shards <= MAX_SHARD:
        raise RaychatError(f"--shards must be between 1 and {MAX_SHARD} (the train shards of ClimbMix), "
                           f"got {num_shards}")
    if workers < 1:
        raise RaychatError(f"--workers must be at least 1, got {workers}")
    endpoint = endpoint or hub_endpoint()
    in_bucket = is_uri(str(data_dir))
    location = normalize_location(data_dir)
    storage = corpus_storage(location)
    storage.make_dir()
    commit = _pinned_revision(location, revision, endpoint)
    names = [shard_filename(shard) for shard in range(num_shards)] + [shard_filename(MAX_SHARD)]
    api = _hub().HfApi(endpoint=endpoint)
    published = {f.path: f for f in _hub_call(endpoint, api.get_paths_info, REPO_ID, names, revision=commit,
                                                repo_type=REPO_TYPE)}
    if missing := [name for name in names if name not in published]:
        raise RaychatError(f"{REPO_ID} at commit {commit} has no {', '.join(missing)}: "
                           "ask for fewer --shards")
    write_corpus_meta(location, {"source": "hub", "repo": REPO_ID, "revision": commit})
    where = redact(location)
    log(f"download: {len(names)} files of {REPO_ID} at commit {commit} into {where} "
        f"({sum(published[n].size for n in names) / 1e6:,.0f} MB, {workers} parallel streams)")
    fetch = functools.partial(_fetch_checked, commit=commit, published=published, workers=workers,
                              endpoint=endpoint, log=log)
    if not in_bucket:
        fetch(Path(location), names)
    else:
        _fetch_into_bucket(storage, names, published, fetch, workers, staging or _staging_dir(location), log)
    return [join_uri(location, name) for name in names]


def _fetch_checked(local_dir: Path, names: list[str], commit: str, published: dict[str, "RepoFile"],
                   workers: int, endpoint: str, log: Callable[[str], None]) -> None:
    """snapshot_download `names` into local_dir, then check each against the Hub; a rejected file is
    deleted and fetched once more."""
    todo = names
    for attempt in (1, 2):
        _hub_call(endpoint, _hub().snapshot_download, REPO_ID, repo_type=REPO_TYPE, revision=commit,
                  allow_patterns=todo, local_dir=local_dir, max_workers=workers, endpoint=endpoint)
        with ThreadPoolExecutor(max_workers=workers) as pool:  # hashing releases the GIL
            problems = dict(zip(todo, pool.map(lambda n: _problem(local_dir / n, published[n]), todo),
                                strict=True))
        todo = [name for name, problem in problems.items() if problem]
        for name in todo:
            (local_dir / name).unlink(missing_ok=True)  # so the next snapshot fetches it again
            log(f"download: {name} rejected ({problems[name]})")
        if not todo:
            return
        if attempt == 1:
            log(f"download: fetching {len(todo)} rejected files again")
    raise RaychatError(f"{local_dir / todo[0]} from {endpoint} was rejected twice ({problems[todo[0]]}): the "
                       "download is corrupted on the way or the mirror serves other data; check HF_ENDPOINT "
                       "and re-run the same command")


def _staging_dir(location: str) -> Path:
    """Local room for the files on their way into one bucket (HF's partial files live here, so an
    interrupted download resumes); one per bucket location."""
    key = hashlib.sha256(location.encode()).hexdigest()[:16]
    return raychat_home() / "staging" / key


def _fetch_into_bucket(bucket: Storage, names: list[str], published: dict[str, "RepoFile"],
                       fetch: Callable[[Path, list[str]], None], workers: int, staging: Path,
                       log: Callable[[str], None]) -> None:
    """Stream the shards through local staging into the bucket, `workers` at a time, so local disk
    holds one batch (~90 MB a shard), never the corpus. A shard counts as present when the bucket
    holds an object of the published size: an object store publishes an upload whole when it closes,
    so a killed upload leaves nothing and the re-run sends the shard again."""
    sizes = {info.base_name: info.size for info in bucket.files()}
    todo = [name for name in names if sizes.get(name) != published[name].size]
    if len(todo) < len(names):
        log(f"download: {len(names) - len(todo)} of {len(names)} files already in the bucket")
    staging.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(todo), workers):
        batch = todo[start:start + workers]
        fetch(staging, batch)
        for name in batch:
            with open(staging / name, "rb") as source, bucket.open_output(name) as target:
                shutil.copyfileobj(source, target, 1 << 22)
            (staging / name).unlink()
            uploaded = bucket.info(name).size
            if uploaded != published[name].size:
                raise RaychatError(f"{join_uri(redact(bucket.location), name)} holds {uploaded:,} bytes "
                                   f"after the upload, not {published[name].size:,}: re-run the same command")
        log(f"download: {start + len(batch)} of {len(todo)} files uploaded")
    shutil.rmtree(staging, ignore_errors=True)
