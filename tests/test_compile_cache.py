"""The compile cache travels with the run: a process on a machine whose inductor cache is empty (a
replacement node) loads what the run's first compiled step left, and compiles nothing; an archive
that does not load, or that reaches outside the cache, is ignored in one line."""

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from raychat.model import compile_cache
from raychat.model.compile_cache import CACHE_DIR, CompileCache, use_run_cache_dir
from raychat.storage import Storage

# One compiled forward and backward of a tiny GPT, as a worker runs it: the run's cache loaded
# first, saved after. Prints inductor's and AOTAutograd's cache counters.
STEP = """
import json, sys, torch
from torch._dynamo.utils import counters
from raychat.model.compile_cache import CompileCache, cache_key
from raychat.model.compile_check import seconds_compiling
from raychat.model.gpt import GPTConfig, build_model
from raychat.storage import Storage
torch.manual_seed(0)
config = GPTConfig(sequence_len=32, vocab_size=128, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                   window_pattern="L")
cache = CompileCache(Storage(sys.argv[1]), cache_key(config, torch.device("cpu"), "fp32"), print)
cache.load()
model = torch.compile(build_model(config, "cpu"), dynamic=False)
x = torch.randint(0, 128, (2, 32))
model(x, x).backward()
cache.save()
print(json.dumps({**counters["inductor"], **counters["aot_autograd"], "compile_s": seconds_compiling()}))
"""


def _compiled_step(run: str, cache_dir: str) -> tuple[dict, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", STEP, run], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


@pytest.mark.slow
def test_a_fresh_machine_loads_the_runs_compile_cache_and_compiles_nothing(tmp_path):
    run = str(tmp_path / "run")
    cold, said = _compiled_step(run, str(tmp_path / "node-a"))
    assert cold.get("fxgraph_cache_miss", 0) > 0 and "Compile cache: saved to" in said
    assert cold["compile_s"] > 0  # what the time ledger's compile bucket reads (TorchDynamo's account)
    warm, said = _compiled_step(run, str(tmp_path / "node-b"))  # a replacement node: empty local cache
    assert "Compile cache: loaded" in said, said
    assert warm.get("fxgraph_cache_hit") == cold["fxgraph_cache_miss"] and "fxgraph_cache_miss" not in warm
    assert warm.get("autograd_cache_hit", 0) > 0 and "autograd_cache_miss" not in warm
    assert "Compile cache: saved" not in said  # it compiled nothing the archive lacked


def _archive(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.unit
@pytest.mark.parametrize("content", [b"not an archive", _archive({"../escaped.py": b"import os"})],
                         ids=["damaged", "path-traversal"])
def test_an_archive_that_does_not_load_is_ignored_in_one_line(tmp_path, monkeypatch, content):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "local"))
    run = Storage(str(tmp_path / "run"))
    run.child(CACHE_DIR).write_bytes("key.tar.gz", content)
    said: list[str] = []
    cache = CompileCache(run, "key", said.append)
    assert cache.load() is False
    assert len(said) == 1 and "ignored" in said[0] and "compiling from scratch" in said[0], said
    assert not (tmp_path / "escaped.py").exists()
    assert CompileCache(run, "other-key", said.append).load() is False and len(said) == 1  # none: quiet


@pytest.mark.unit
def test_an_archive_past_the_limits_is_not_unpacked(tmp_path, monkeypatch):
    """An archive larger than a restart's compile is worth is not even read, and one whose members
    unpack past the limit (a gzip bomb) writes nothing. (The limits, gigabytes, are lowered here.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "local"))
    run = Storage(str(tmp_path / "run"))
    bomb = _archive({"a.py": bytes(4096), "b.py": bytes(4096)})  # 8 KiB of zeros, compressed tiny
    run.child(CACHE_DIR).write_bytes("key.tar.gz", bomb)
    monkeypatch.setattr(compile_cache, "MAX_UNPACKED_BYTES", 6000)
    said: list[str] = []
    assert CompileCache(run, "key", said.append).load() is False
    assert "unpacks to more than" in said[-1] and not (tmp_path / "local" / "a.py").exists()
    monkeypatch.setattr(compile_cache, "MAX_ARCHIVE_BYTES", len(bomb) - 1)
    assert CompileCache(run, "key", said.append).load() is False
    assert "more than a restart's compile is worth" in said[-1] and len(said) == 2


@pytest.mark.unit
def test_each_run_compiles_into_a_cache_directory_of_its_own(tmp_path, monkeypatch):
    """Unset, or holding inductor's default (which the driver's compile probe writes there and a local
    Ray's workers inherit), the variable is pointed at the run's own directory: one run's archive
    never reaches another run's compiles. A directory the user chose is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    a, b = Storage(str(tmp_path / "a")), Storage(str(tmp_path / "b"))
    seen = []
    for before, run in ((None, a), (default, a), (None, b)):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        use_run_cache_dir(run)
        seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert seen[0] == seen[1] != seen[2] and all(s.startswith(default + os.sep + "raychat-") for s in seen)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_run_cache_dir(a)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
