"""--compile on where torch.compile cannot work: one line before any worker starts, not a traceback
from inside one. The failure is real: inductor's CPU kernels need a C++ compiler, and CXX points at
none (with a fresh inductor cache, so nothing compiled earlier stands in)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raychat.common import RaychatError
from raychat.model.compile_check import probe_compile, uses_compile

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.mark.unit
def test_auto_compiles_on_cuda_only():
    assert uses_compile("auto", torch.device("cuda")) and not uses_compile("auto", CPU)
    assert uses_compile("on", CPU) and not uses_compile("off", torch.device("cuda"))


@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
def test_probe_passes_where_compile_works():
    probe_compile(CPU)


@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
def test_probe_names_the_flag_and_the_cause(monkeypatch, tmp_path):
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    refusal = r"^--compile: .*No working C\+\+ compiler.*run with --compile off$"
    # inductor's own patch restores the entry exactly; monkeypatch.setattr on this hidden config
    # entry deleted it when undone, and every later compile in the process then failed.
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}), \
            pytest.raises(RaychatError, match=refusal):
        probe_compile(CPU)
    torch._dynamo.reset()


REFUSAL = "raychat: error: --compile: torch.compile does not work on this machine's cpu"


@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
@pytest.mark.skipif(torch.cuda.is_available(), reason="the workers would run on CUDA")
def test_driver_refuses_compile_on_in_one_line_before_preparing_anything(monkeypatch, tmp_path, capfd):
    """`python -m raychat.train`'s main as its __main__ runs it (run_cli), in this process: the unit
    tier's check of the refusal the next test makes end to end in a fresh interpreter."""
    import torch._inductor.config as inductor_config

    from raychat.common import run_cli
    from raychat.train import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # joining a cluster, the workers would probe instead
    torch._dynamo.reset()
    capfd.readouterr()
    try:  # the C++ compiler patched as in test_probe_names_the_flag_and_the_cause, and restored
        with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}), \
                pytest.raises(SystemExit) as exited:
            run_cli(main, ["--preset", "cpu", "--compile", "on"])
    finally:
        torch._dynamo.reset()
    out, err = capfd.readouterr()
    assert exited.value.code == 2, err[-2000:]
    assert err.strip().splitlines() == [err.strip()], err[-2000:]
    assert err.startswith(REFUSAL) and err.strip().endswith("run with --compile off")
    assert out.strip().splitlines() == ["Checking that torch.compile works on cpu (--compile on)..."]
    assert not (tmp_path / "home").exists()  # refused before preparing a corpus or starting Ray


# A fresh interpreter importing torch, Ray and inductor, then compiling cold: ~10 s of a 2-core CPU, so
# in the full tier; the unit tier checks the same refusal in-process (above).
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the workers would run on CUDA")
def test_driver_refuses_compile_on_before_any_worker(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYCHAT_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT), "CXX": "/nonexistent/g++",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "raychat.train", "--preset", "cpu", "--compile", "on"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr[-2000:]
    assert out.stderr.startswith(REFUSAL)
    assert out.stderr.strip().endswith("run with --compile off")
    assert not (tmp_path / "home").exists()  # refused before preparing a corpus or starting Ray
