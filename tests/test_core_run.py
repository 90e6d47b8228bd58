"""CORE in a real tiny run and on its checkpoint: the in-loop line, the metric in the run's report and
checkpoint, `python -m raychat.evaluate core` agreeing with the loop at 1 and 2 workers, and the
driver refusing a malformed or unobtainable bundle before any worker starts."""

import re
import subprocess
import sys

import pytest
from core_bundle import write_word_bundle
from helpers import gone_cluster_recorded, log_lines, one_error_line, run_train, tiny_flags

from raychat.checkpoint.format import read_meta
from raychat.storage import Storage

pytestmark = pytest.mark.ray

CORE_LINE = re.compile(r"Step (\d{5}) \| CORE metric: (-?\d+\.\d{4})$")


@pytest.fixture(scope="module")
def core_run(ray_session, tiny_corpus, tmp_path_factory):
    """A 2-worker run of 4 steps scoring CORE at steps 2 and 4: (storage, bundle dir, driver output)."""
    root = tmp_path_factory.mktemp("core_run")
    bundle = write_word_bundle(root / "bundle")
    flags = ["--num-workers", "2", "--total-batch-size", "1024", "--num-iterations", "4",
             "--eval-every", "-1", "--core-metric-every", "2", "--eval-bundle", str(bundle)]
    result = run_train(ray_session, tiny_flags(tiny_corpus, root / "runs", "core", *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "runs", bundle, result.stdout


def run_evaluate(cluster, storage, bundle, tokenizer_dir, *extra: str,
                 **env: str) -> subprocess.CompletedProcess:
    """`python -m raychat.evaluate core ...` on the session's cluster, in its reused driver interpreter;
    in a process of its own where the test points RAY_ADDRESS elsewhere (a local instance, nothing)."""
    command = ["core", "--run-name", "core", "--storage-path", str(storage),
               "--tokenizer-dir", str(tokenizer_dir), "--eval-bundle", str(bundle), *extra]
    if "RAY_ADDRESS" not in env:
        return cluster.drivers.run("raychat.evaluate", *command, env=cluster.driver_env(**env), timeout=300)
    return subprocess.run([sys.executable, "-m", "raychat.evaluate", *command], capture_output=True,
                          text=True, timeout=300, env=cluster.driver_env(**env))


def test_the_loop_logs_reports_and_saves_core(core_run):
    storage, _, out = core_run
    lines = log_lines(out, CORE_LINE)
    assert [m.group(1) for m in lines] == ["00002", "00004"]
    final = float(lines[-1].group(2))
    assert f"CORE metric     : {final:.4f}" in out  # the last step's report reached the driver
    meta = read_meta(Storage(str(storage)).child("core", "checkpoint_000004"))
    assert round(meta.loop_state.core_metric, 4) == final


def test_evaluate_core_agrees_with_the_loop_at_any_worker_count(ray_session, core_run, tiny_corpus):
    storage, bundle, out = core_run
    in_loop = log_lines(out, CORE_LINE)[-1].group(2)
    # 2 workers with no RAY_ADDRESS: a local Ray instance of its own, never the cluster the machine's
    # last `ray start` recorded (here one that is gone).
    with gone_cluster_recorded() as ray_tmp:
        results = [run_evaluate(ray_session, storage, bundle, tiny_corpus[1], "--num-workers", "1"),
                   run_evaluate(ray_session, storage, bundle, tiny_corpus[1], "--num-workers", "2",
                                RAY_ADDRESS="", RAY_TMPDIR=ray_tmp)]
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
        assert "step 4" in result.stdout
        assert re.search(r"^capitals +1-shot multiple_choice +accuracy: \d\.\d{4} \| centered: -?\d\.\d{4}$",
                         result.stdout, re.M)
        assert f"CORE metric: {in_loop} (12 examples" in result.stdout
        assert "Ray" not in result.stderr, result.stderr[-2000:]  # nor its start-up or token notices
    broken = bundle.parent / "broken"
    write_word_bundle(broken)
    (broken / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n")
    line = one_error_line(run_evaluate(ray_session, storage, broken, tiny_corpus[1]))
    assert "eval_meta_data.csv is malformed" in line
    # A RAY_ADDRESS where nothing answers is one line, not minutes in Ray's connect.
    line = one_error_line(run_evaluate(ray_session, storage, bundle, tiny_corpus[1], "--num-workers", "2",
                                       RAY_ADDRESS="127.0.0.1:1"))
    assert line.startswith("raychat: error: RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there"), line


def test_driver_refuses_a_bad_bundle_before_any_worker(ray_session, tiny_corpus, tmp_path):
    bundle = write_word_bundle(tmp_path / "bundle")
    (bundle / "eval_data" / "capitals.jsonl").write_text('{"query": "q"}\n')
    flags = tiny_flags(tiny_corpus, tmp_path / "runs", "bad", "--num-iterations", "2",
                       "--eval-bundle", str(bundle))
    result = run_train(ray_session, flags)
    assert "capitals.jsonl is malformed (line 1: field `choices` missing" in one_error_line(result)
    assert "Training" not in result.stdout and not (tmp_path / "runs" / "bad").exists()
    missing = tiny_flags(tiny_corpus, tmp_path / "runs", "bad", "--num-iterations", "2",
                         "--eval-bundle", str(tmp_path / "nowhere"))
    line = one_error_line(run_train(ray_session, missing))
    assert "RAYCHAT_OFFLINE is set" in line and f"{tmp_path / 'nowhere' / 'core.yaml'} exists" in line
