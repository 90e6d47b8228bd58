"""The run's gauges as a real Prometheus sees them: Debian's `prometheus` scrapes Ray's metrics export
(through the service-discovery file Ray writes in its session directory, as the README says to set it
up) while a tiny run trains; every `ray_raychat_*` series is there with values that make sense, and
every query of cluster/grafana/raychat_dashboard.json returns data.

`.ci/run` installs the package with apt-get where it is missing; where apt is unavailable this test
is skipped with that reason."""

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from helpers import tiny_flags

from raychat.telemetry.sinks import GAUGES

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
RUN = "prom"
STEPS = 80
# mfu is not set on CPU (no bf16 peak to divide by): its series and panel stay empty here.
CPU_EMPTY = {"mfu"}


@pytest.fixture
def prometheus(ray_session, tmp_path):
    """A Prometheus on 127.0.0.1 scraping every second what Ray's service-discovery file lists."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (.ci/run installs it with apt-get where apt works)")
    targets = Path(ray_session.temp_dir) / "prom_metrics_service_discovery.json"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(targets)],
                                                                     "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "prometheus did not start"
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def query(url: str, expr: str) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=30).read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_a_real_prometheus_sees_every_gauge_and_every_dashboard_query(ray_session, tiny_corpus, tmp_path,
                                                                      prometheus):
    flags = tiny_flags(tiny_corpus, tmp_path / "runs", RUN, "--num-workers", "1", "--total-batch-size", "512",
                       "--num-iterations", str(STEPS), "--eval-every", "40", "--core-metric-every", "40",
                       "--core-metric-max-per-task", "4")
    done = subprocess.run([sys.executable, "-m", "raychat.train", *flags], capture_output=True, text=True,
                          timeout=600, env=ray_session.driver_env())
    assert done.returncode == 0, done.stderr[-3000:]
    time.sleep(12)  # Ray's metrics agent reports every few seconds: let the last values be scraped

    def latest(name: str) -> float | None:
        found = query(prometheus, f'last_over_time(ray_raychat_{name}{{run="{RUN}"}}[15m])')
        return max(float(r["value"][1]) for r in found) if found else None

    values = {name: latest(name) for name in GAUGES}
    missing = [name for name, value in values.items() if value is None and name not in CPU_EMPTY]
    assert not missing, (missing, values)
    assert 0 < values["loss"] < 15 and values["tokens_per_sec"] > 0
    assert 0 < values["val_bpb"] < 10 and -1 <= values["core_metric"] <= 1
    assert values["step"] == STEPS - 1 and values["world_size"] == 1 and values["data_wait_seconds"] >= 0

    dashboard = json.loads((ROOT / "cluster" / "grafana" / "raychat_dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$SessionName", ".*").replace("$run", RUN)
            if any(f"ray_raychat_{name}" in expr for name in CPU_EMPTY):
                continue
            assert query(prometheus, f"max_over_time(({expr})[15m:1s])"), (panel["title"], expr)
