"""torch.compile's work kept with the run, so that a restart on a new node loads it instead of
compiling again.

Inductor caches what it compiles on the local disk of the machine that compiled it (its cache
directory: FX graphs, AOTAutograd graphs, the kernels built from them, autotuning results). A
restarted worker on a replacement node, or in a fresh container, finds that directory empty and
compiles the model from scratch before its first step: at depth 24 on a GPU, minutes of every
restart. So rank 0, after its first compiled step, packs the directory into one archive next to the
run's checkpoints, and every attempt unpacks it into its own before it builds the model: the
compile then finds every graph and kernel it needs in its cache.

The whole directory travels, not PyTorch's portable blob (`torch.compiler.save_cache_artifacts`):
the blob holds graphs and GPU kernels but not the CPU kernels' shared objects, which a C++ compiler
then rebuilds at every restart, as long as a cold compile on a CPU. Inductor names every entry by a
hash of what it was built from (torch's version, the compiler, the instruction set or GPU, the
graph), so an entry built for another machine is never used, only missed; the archive's own name is
a key over what the graphs depend on (`cache_key`), so one run on two kinds of node keeps two.
An archive that does not load is ignored in one line: the worker compiles as it would have without
one. Nothing here can fail a run.

The archive is code the workers run (kernels, and graphs inductor unpickles): whoever may write the
run's storage may run code on its workers through it. So it is read with limits (its size, each
member's, no links, nothing outside the cache), it is unpacked into a cache directory of this run's
own (`use_run_cache_dir`: one run's archive never reaches another run's compiles on a shared node),
and `--no-compile-cache` leaves it out for a run whose storage others may write.
"""

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import torch

from raychat.faults import retry_transient, short_reason
from raychat.model.gpt import GPTConfig
from raychat.storage import Storage

CACHE_DIR = "compile_cache"
COMPILE_OPTIONS = {"dynamic": False}  # what raychat passes to torch.compile (raychat.worker.setup)
MAX_ARCHIVE_BYTES = 2 << 30  # a cache this large is not worth a restart's download
MAX_UNPACKED_BYTES = 4 * MAX_ARCHIVE_BYTES  # what its members may add up to (a gzip bomb is refused)


def use_run_cache_dir(run: Storage) -> None:
    """Point inductor at a cache directory of this run's own (below its default one), unless the
    user chose another ($TORCHINDUCTOR_CACHE_DIR). Inductor writes its default into that variable
    at its first use, so the default found there (the driver's compile probe, inherited through a
    local Ray; an earlier compile in this process) is no user's choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # no public name for it

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == default:
        run_id = hashlib.sha256(str(run).encode()).hexdigest()[:16]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, f"raychat-{run_id}")


def local_cache_dir() -> Path:
    """Inductor's cache directory in this process ($TORCHINDUCTOR_CACHE_DIR, else its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # no public name for it

    return Path(cache_dir())


def device_kind(device: torch.device) -> str:
    """What inductor's generated code depends on about the device."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return device.type


def cache_key(model: GPTConfig, device: torch.device, precision: str) -> str:
    """A name for the compiled graphs of this model on this kind of device. The batch shapes are not
    in it: a group resized to another world size compiles its new micro-batch shapes, and still
    finds the ones it shares with the old group in the archive."""
    parts = {"torch": torch.__version__, "device": device_kind(device), "model": dataclasses.asdict(model),
             "precision": precision, "options": COMPILE_OPTIONS}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _cached_files(root: Path) -> set[str]:
    """The cache's entries (lock files aside: they belong to processes), relative to `root`."""
    return {str(path.relative_to(root)) for path in root.rglob("*")
            if path.is_file() and path.suffix != ".lock"}


def _pack(root: Path) -> bytes:
    """The cache directory as a gzip'd tar (its lock files left out: they belong to processes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name in sorted(_cached_files(root)):
            tar.add(root / name, arcname=name, recursive=False)
    return buffer.getvalue()


def _unpack(data: bytes, root: Path) -> set[str]:
    """The archive's files, those `root` lacks written into it. Only regular files below `root`
    (tarfile's "data" filter): the archive is read from storage that others can write."""
    names = set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        if sum(m.size for m in members) > MAX_UNPACKED_BYTES:
            raise ValueError(f"it unpacks to more than {MAX_UNPACKED_BYTES / 1e9:.0f} GB")
        for member in members:
            member = tarfile.data_filter(member, str(root))  # raises on links, absolute or ../ names
            target = root / member.name
            if not member.isfile():
                continue
            names.add(member.name)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_bytes(tar.extractfile(member).read())
            os.chmod(tmp, member.mode or 0o644)
            os.replace(tmp, target)  # a compile in another process sees the whole file or none
    return names


class CompileCache:
    """The run's compile cache for one key: `load()` before compiling, `save()` after."""

    def __init__(self, run: Storage, key: str, log: Callable[[str], None]):
        self.directory = run.child(CACHE_DIR)
        self.name = f"{key}.tar.gz"
        self.log = log
        self.archived: set[str] = set()  # what the run's archive held when this process loaded it
        self.saved = False

    def load(self) -> bool:
        """Fill this machine's compile cache from the run's archive; False (with one line when there
        was an archive) if there is none or it does not load."""
        where = self.directory.child(self.name)
        try:
            size = retry_transient(lambda: self.directory.info(self.name).size, f"reading {where}",
                                   budget_s=30)
            if size is None:
                return False  # no archive yet
            if size > MAX_ARCHIVE_BYTES:
                raise ValueError(f"{size / 1e9:.1f} GB, more than a restart's compile is worth")
            data = retry_transient(lambda: self.directory.read_bytes(self.name), f"reading {where}",
                                   budget_s=30)
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001 (a cache: any failure means compiling as without it)
            self.log(f"warning: compile cache {where} not read ({short_reason(e)}): compiling from scratch")
            return False
        try:
            self.archived = _unpack(data, local_cache_dir())
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            self.log(f"warning: compile cache {where} ignored ({type(e).__name__}: {short_reason(e)}): "
                     "compiling from scratch")
            return False
        self.log(f"Compile cache: loaded {where} ({len(data) / 1e6:.1f} MB)")
        return True

    def save(self) -> None:
        """Once, after this process's first compiled step, when its cache holds what the run's
        archive lacks (a first compile, or shapes a resized group compiled anew)."""
        if self.saved:
            return
        self.saved = True
        where = self.directory.child(self.name)
        try:
            root = local_cache_dir()
            if _cached_files(root) <= self.archived:
                return
            data = _pack(root)
            if len(data) > MAX_ARCHIVE_BYTES:
                self.log(f"Compile cache: not saved ({len(data) / 1e9:.1f} GB is more than a restart saves)")
                return
            retry_transient(lambda: self.directory.write_whole(self.name, lambda f: f.write(data)),
                            f"writing {where}", budget_s=30)
        except Exception as e:  # noqa: BLE001 (a restart compiles again: nothing lost but time)
            self.log(f"warning: compile cache not saved to {where} ({short_reason(e)})")
            return
        self.log(f"Compile cache: saved to {where} ({len(data) / 1e6:.1f} MB)")
