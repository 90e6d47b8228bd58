"""`python -m bench.gpu --dry-run`: the GPU check runs every part on CPU, so it cannot rot before a
GPU is lent. Run as the user would, as a subprocess; its JSON must hold every measurement."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Every part of the GPU check on CPU (compiled steps, the loader, a save and resume): a whole bench,
# not one module's logic, so not in the unit tier.
@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert report["dry_run"] is True
    variants = {(r["config"]["window_pattern"], r["fp8"]) for r in report["steps"]}
    assert variants == {("SSSL", "off"), ("SSSL", "tensorwise"), ("L", "off"), ("L", "tensorwise")}
    for r in report["steps"]:
        assert r["tok_per_sec"] > 0 and r["peak_memory_gb"] > 0 and r["compile_s"] >= 0
        assert r["dtype"] == ("fp32" if r["fp8"] == "off" else "fp32 + fp8 tensorwise (emulated)")
        assert 6 < r["losses"][0] < 8  # ln(1024) = 6.93 at init: a real forward ran
    loader = report["loader"]
    assert loader["raychat_tok_per_sec"] > 0 and loader["reference_tok_per_sec"] > 0
    saved = report["save_resume"]  # a sharded save and resume: the next step is the same to the bit
    assert saved["bitwise_after_resume"] is True and saved["checkpoint_bytes"] > 0
    assert saved["predicted_device_bytes"] > 0 and saved["train_peak_bytes"] is None  # no GPU peak on CPU
    check = report["correctness"]
    assert check["ok"] and check["fp32_eager"] != check["bf16_compiled"]  # two different computations
    assert "| tiny | SSSL |" in done.stdout and "For bench/RESULTS.md" in done.stdout
