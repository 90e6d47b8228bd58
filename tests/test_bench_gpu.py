"""`python -m bench.gpu --dry-run`: the GPU acceptance run runs every part on CPU, so it cannot rot
before a GPU is lent. Run as the user would, as a subprocess; its JSON must hold every measurement.
The acceptance row of a GPU node's report is testkit.gpu_report's, which bench.gpu writes with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.gpu_report import NANOCHAT_PUBLISHED, ROW_HEADER, markdown_row

ROOT = Path(__file__).resolve().parent.parent


# Every part of the GPU check on CPU (the process group through Ray's TorchConfig, raychat.train on 2
# workers and its resume on 1, compiled forward, the loader, a save and resume): a whole bench, not
# one module's logic, so not in the unit tier.
@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert report["dry_run"] is True
    parts = report["parts"]
    assert not [name for name, part in parts.items() if "error" in part or "skipped" in part], parts

    pg = parts["process_group"]  # formed by Ray's TorchConfig, with raychat's timeout flag's default
    assert (pg["backend"], pg["world_size"], pg["sum_ok"], pg["ok"]) == ("gloo", 2, True, True)
    assert pg["timeout_s"] == 1800
    assert [row["bytes"] for row in pg["allreduce"]] == [2**16, 2**20]
    for row in pg["allreduce"]:  # nccl-tests' all-reduce busbw: algbw * 2(n-1)/n, n = 2
        assert row["algbw_gbps"] > 0 and row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)

    train, resume = parts["train"], parts["resume"]  # raychat.train's own metrics log, 2 workers
    assert train["ok"] and (train["world_size"], train["first_step"], train["last_step"]) == (2, 0, 3)
    assert train["tok_per_sec"] > 0 and train["peak_memory_gib"] > 0 and train["mfu"] is None  # CPU
    assert train["nanochat_published"] is None  # nanochat publishes nothing for the dry run's d2
    # the same run name on 1 worker: resumed from the first run's last checkpoint, trained on
    assert resume["ok"] and (resume["from_world_size"], resume["world_size"]) == (2, 1)
    assert (resume["resumed_from"], resume["first_step"], resume["last_step"]) == ("checkpoint_000004", 4, 5)

    variants = {(r["config"]["window_pattern"], r["fp8"]) for r in parts["steps"]["variants"]}
    assert variants == {("SSSL", "off"), ("SSSL", "tensorwise"), ("L", "off"), ("L", "tensorwise")}
    for r in parts["steps"]["variants"]:
        assert r["tok_per_sec"] > 0 and r["peak_memory_gb"] > 0 and r["compile_s"] >= 0
        assert r["dtype"] == ("fp32" if r["fp8"] == "off" else "fp32 + fp8 tensorwise (emulated)")
        assert 6 < r["losses"][0] < 8  # ln(1024) = 6.93 at init: a real forward ran
    loader = parts["loader"]
    assert loader["raychat_tok_per_sec"] > 0 and loader["reference_tok_per_sec"] > 0
    saved = parts["save_resume"]  # a sharded save and resume: the next step is the same to the bit
    assert saved["bitwise_after_resume"] is True and saved["checkpoint_bytes"] > 0
    assert saved["predicted_device_bytes"] > 0 and saved["train_peak_bytes"] is None  # no GPU peak on CPU
    check = parts["correctness"]
    assert check["ok"] and check["fp32_eager"] != check["bf16_compiled"]  # two different computations

    # one file: the numbers and the row ready for bench/RESULTS.md, as printed
    row = report["markdown_row"]
    assert row.startswith(f"| {report['date']} | CPU | 0 | gloo, 2 rank(s) via TorchConfig | ")
    assert row.endswith("| 2 -> 1 workers from checkpoint_000004: ok |")
    assert ROW_HEADER in report["markdown"] and row in report["markdown"] and row in done.stdout
    assert "| tiny | SSSL |" in done.stdout and "For bench/RESULTS.md" in done.stdout


@pytest.mark.unit
def test_one_gpus_row_says_what_it_skipped_and_quotes_nanochat():
    """On one GPU there is no bus to measure and no other world size to resume at: the row says so, and
    quotes nanochat's published figure for the depth as a reference."""
    report = {"date": "2026-12-06", "device_name": "NVIDIA H100 80GB HBM3", "gpus": 1, "parts": {
        "process_group": {"backend": "nccl", "world_size": 1, "ok": True, "allreduce": []},
        "train": {"depth": 12, "precision": "bf16", "compiled": True, "world_size": 1, "timed_steps": 15,
                  "tok_per_sec": 500_000.0, "mfu": 40.04, "peak_memory_gib": 33.25,
                  "nanochat_published": NANOCHAT_PUBLISHED[12]},
        "resume": {"skipped": "one GPU: a resume at another world size needs 2+"}}}
    cells = [c.strip() for c in markdown_row(report).strip("|").split("|")]
    assert len(cells) == len(ROW_HEADER.splitlines()[0].strip("|").split("|"))
    assert cells[3:5] == ["nccl, 1 rank(s) via TorchConfig", "n/a (1 rank)"]
    assert cells[6:9] == ["500,000", "40.0%", "33.2 GiB"]
    assert "MFU 41%" in cells[9] and "GPU memory 34 GB" in cells[9]
    assert cells[10] == "one GPU: a resume at another world size needs 2+"
