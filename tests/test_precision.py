"""--dtype and --fp8: what runs where, and the one-line refusals the driver gives before any worker
starts (this machine's CPU and a CUDA device by name; no GPU needed). The commands run as a user runs
them, in one reused interpreter (conftest.py's `commands`)."""

from pathlib import Path

import pytest
import torch

from raychat.common import RaychatError
from raychat.model import precision
from raychat.model.precision import Precision, describe_precision, resolve_precision

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.mark.unit
def test_cpu_flag_is_read_from_cpuinfo():
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert precision.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


# Flags of two real CPUs: a Xeon with avx512_bf16 (this kind of machine, some hosts) and one without.
WITH_BF16 = {"fpu", "sse4_2", "avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
WITHOUT_BF16 = {"fpu", "sse4_2", "avx2", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.unit
def test_auto_picks_bf16_only_on_cpus_with_native_bf16(monkeypatch):
    dtype, why = precision.cpu_auto_dtype(WITH_BF16)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    assert precision.cpu_auto_dtype(WITHOUT_BF16 | {"amx_bf16", "amx_tile"})[0] == torch.bfloat16
    dtype, why = precision.cpu_auto_dtype(WITHOUT_BF16)
    assert dtype == torch.float32 and "no native bf16" in why
    assert precision.cpu_auto_dtype(set())[0] == torch.float32  # no /proc/cpuinfo: the safe choice
    for flags, expected in ((WITH_BF16, torch.bfloat16), (WITHOUT_BF16, torch.float32)):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert resolve_precision("auto", False, "tensorwise", CPU) == Precision(expected, None, False)
        assert resolve_precision("fp32", False, "tensorwise", CPU).dtype == torch.float32
        # The plan says which, and why.
        line = describe_precision("auto", False, "tensorwise", 0)
        assert line.startswith(f"{'bf16' if expected == torch.bfloat16 else 'fp32'} on CPU (auto: ")
        assert ("has native bf16 (avx512_bf16)" in line) == (expected == torch.bfloat16)
        assert ("has no native bf16" in line) == (expected == torch.float32)


@pytest.mark.unit
def test_bf16_on_cpu_needs_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("bf16", False, "tensorwise", CPU).name == "bf16"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(RaychatError, match=r"^--dtype bf16: .*use --dtype fp32"):
        resolve_precision("bf16", False, "tensorwise", CPU)


@pytest.mark.unit
def test_fp8_on_cpu_only_emulated(monkeypatch):
    monkeypatch.delenv("RAYCHAT_FP8_EMULATE", raising=False)
    with pytest.raises(RaychatError, match=r"^--fp8 needs a CUDA GPU of SM89.*the CPU.*drop --fp8"):
        resolve_precision("auto", True, "tensorwise", CPU)
    monkeypatch.setenv("RAYCHAT_FP8_EMULATE", "1")
    got = resolve_precision("fp32", True, "rowwise", CPU)
    assert got == Precision(torch.float32, "rowwise", True)
    assert got.name == "fp32 + fp8 rowwise (emulated)"
    with pytest.raises(RaychatError, match="--fp8-recipe"):
        resolve_precision("auto", True, "axiswise", CPU)


@pytest.mark.unit
def test_plan_line_says_what_runs_and_never_raises(monkeypatch):
    monkeypatch.delenv("RAYCHAT_FP8_EMULATE", raising=False)
    dtype, why = precision.run_auto_dtype(CPU)
    assert describe_precision("auto", False, "tensorwise", 0) == \
        f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} on CPU (auto: {why})"
    refused = describe_precision("auto", True, "tensorwise", 0)
    assert refused.startswith("refused on this machine (CPU): --fp8")


@pytest.mark.integration  # commands in a reused interpreter
def test_plan_json_has_the_precision(commands):
    out = commands.run("raychat.plan", "--preset", "cpu", "--dtype", "fp32", "--json", timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert '"precision": "fp32 on CPU"' in out.stdout


@pytest.mark.integration  # commands in a reused interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
@pytest.mark.parametrize("flags,message", [
    (["--fp8"], "raychat: error: --fp8 needs a CUDA GPU of SM89 or newer"),
    *([] if precision.cpu_has_native_bf16()
      else [(["--dtype", "bf16"], "raychat: error: --dtype bf16: this CPU")]),
])
def test_driver_refuses_before_any_worker(commands, tmp_path, flags, message):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYCHAT_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    out = commands.run("raychat.train", "--preset", "cpu", *flags, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(message)
    assert not (tmp_path / "home").exists()  # refused before preparing a corpus or starting Ray
