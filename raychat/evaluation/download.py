"""Fetch nanochat's eval bundle (the CORE tasks) from its public URL, resumably, and check it.

The zip is streamed to `<out>.zip.part`; an interrupted download continues from the bytes already
there (an HTTP Range request; a server that ignores it sends the whole file again). Before use the
zip's size must match what the server announced, every member's CRC must check (zipfile.testzip),
and the unpacked bundle must load (raychat.evaluation.bundle); only then is it moved into place, so
`<out>` is either absent or a whole, valid bundle. Without a network the error says where to put it.
"""

import argparse
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.evaluation.bundle import CONFIG_FILE, Bundle, default_bundle_dir, load_bundle

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's
TIMEOUT_S = 30
CHUNK = 1 << 20


def offline_error(url: str, out: Path, why: str) -> RaychatError:
    return RaychatError(f"could not fetch the eval bundle from {url} ({why}): on a machine with a network, "
                        f"download that zip and unzip it so that {out / CONFIG_FILE} exists, then re-run "
                        "(or pass --eval-bundle DIR, or turn CORE off with --core-metric-every -1)")


def _fetch(url: str, part: Path, out: Path, log: Callable[[str], None]) -> None:
    """Complete `part` from `url`, resuming from its current size; checks the announced size."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to fetch: the part is whole (checked below)
            return
        raise offline_error(url, out, f"HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise offline_error(url, out, str(getattr(e, "reason", e))) from e
    with response:
        if response.status != 206:
            have = 0  # the server sent the whole file
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        log(f"eval bundle: fetching {url}" + (f" from byte {have:,}" if have else "")
            + (f" ({total / 1e6:.1f} MB)" if total else ""))
        next_report = have + max(CHUNK, (total or 0) // 10)
        try:
            with open(part, "ab" if have else "wb") as f:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    have += len(chunk)
                    if have >= next_report:
                        percent = f" ({100 * have / total:.0f}%)" if total else ""
                        log(f"eval bundle: {have / 1e6:.1f} MB{percent}")
                        next_report = have + max(CHUNK, (total or 0) // 10)
        except OSError as e:
            raise offline_error(url, out, f"the transfer broke off at byte {have:,}: re-run to resume") from e
    if total is not None and have != total:
        raise offline_error(url, out, f"got {have:,} of {total:,} bytes: re-run to resume")


def _unpack(zip_path: Path, out: Path) -> Bundle:
    """Check the zip, unpack it next to `out` and move its eval_bundle/ into place."""
    try:
        with zipfile.ZipFile(zip_path) as archive:
            if (bad := archive.testzip()) is not None:
                zip_path.unlink()
                raise RaychatError(f"{zip_path}: member {bad} fails its CRC check: deleted, re-run to "
                                   "fetch it again")
            staging = Path(tempfile.mkdtemp(prefix=".eval_bundle_", dir=out.parent))
            archive.extractall(staging)
    except zipfile.BadZipFile as e:
        zip_path.unlink()
        raise RaychatError(f"{zip_path} is not a zip archive ({e}): deleted, re-run to fetch it again") from e
    try:
        unpacked = staging / "eval_bundle"
        if not (unpacked / CONFIG_FILE).is_file():
            raise RaychatError(f"{zip_path} holds no eval_bundle/{CONFIG_FILE}: not nanochat's eval bundle")
        bundle = load_bundle(unpacked)  # refuses a malformed bundle before it is put in place
        unpacked.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return replace(bundle, directory=out)


def download_eval_bundle(out: str | Path, url: str = EVAL_BUNDLE_URL,
                         log: Callable[[str], None] = print) -> Bundle:
    """The bundle at `out`, fetched from `url` first if it is not there yet."""
    out = Path(out).expanduser().resolve()
    if (out / CONFIG_FILE).is_file():
        return load_bundle(out)
    if out.exists() and any(out.iterdir()):
        raise RaychatError(f"{out} exists but holds no {CONFIG_FILE}: empty it or choose another --out")
    if out.exists():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.parent / f"{out.name}.zip.part"
    _fetch(url, part, out, log)
    bundle = _unpack(part, out)
    part.unlink()
    log(f"eval bundle: {len(bundle.tasks)} tasks, {bundle.num_examples:,} examples in {out}")
    return bundle


COMMAND = "download-eval-bundle"


def add_command(commands: argparse._SubParsersAction) -> None:
    """The `download-eval-bundle` command (its flags and help), for the command line that offers it
    (`python -m raychat.corpus`, where users fetch their data): the command is this module's."""
    p = commands.add_parser(
        COMMAND, help="fetch nanochat's CORE eval bundle (resumable, checked)",
        description="Fetch nanochat's eval bundle (core.yaml, eval_data/, eval_meta_data.csv: the tasks of "
        "the CORE metric) and unpack it into --out. An interrupted download resumes; the zip's size and CRCs "
        "and the bundle's files are checked before it is put in place. Offline, it says where to put it.")
    p.add_argument("--out", default=None, help=f"bundle directory (default: {default_bundle_dir()})")
    p.add_argument("--url", default=EVAL_BUNDLE_URL,
                   help=f"where to fetch the zip (default: {EVAL_BUNDLE_URL})")


def run_command(args: argparse.Namespace) -> int:
    """Run `download-eval-bundle` with the flags `add_command` defined."""
    download_eval_bundle(args.out or default_bundle_dir(), url=args.url)
    return 0


def bundle_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.eval_bundle or default_bundle_dir()).expanduser().resolve()


def core_enabled(cfg: TrainConfig) -> bool:
    return cfg.core_metric_every > 0


def check_eval_bundle(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainConfig:
    """Driver side, before any worker starts: with CORE on, the bundle must be there and whole. A
    missing one is fetched (as nanochat does on first use, from $RAYCHAT_EVAL_BUNDLE_URL if set);
    offline (or with RAYCHAT_OFFLINE set) that fails in one line saying where to put it. Workers on
    other nodes read the same path, so it must exist there too. Returns cfg with that path made
    absolute (the workers' working directory is not the driver's)."""
    if not core_enabled(cfg):
        return cfg
    directory = bundle_dir(cfg)
    if not (directory / CONFIG_FILE).is_file():
        url = os.environ.get("RAYCHAT_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
        if os.environ.get("RAYCHAT_OFFLINE", "") not in ("", "0"):
            raise offline_error(url, directory, "RAYCHAT_OFFLINE is set")
        log(f"No eval bundle in {directory}: fetching it (CORE metric every {cfg.core_metric_every} steps)")
        download_eval_bundle(directory, url=url, log=log)
    bundle = load_bundle(directory)
    log(f"CORE: {len(bundle.tasks)} tasks from {directory}, every {cfg.core_metric_every} steps, "
        f"at most {cfg.core_metric_max_per_task} examples per task")
    return replace(cfg, eval_bundle=str(directory))
