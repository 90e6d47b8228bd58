"""`python -m bench.chaos --short` in the suite: a seeded schedule of faults (a worker killed, a node
lost with a spare up, the driver killed and the run launched again, a rerun with a shorter horizon,
a second driver) on a multi-node `ray.cluster_utils.Cluster`, every one survived or refused in one
line; every epoch-1 document trained once, the checkpoints whole and the newest kept, the final
weights bit-identical to a run with no faults. The bench runs in its own process group on its own
Ray temp dir (tests/helpers.py BackgroundBench), so whatever it leaves running is found and stopped,
and counted as a failure."""

import json
import re

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(800)]

STEADY = {"kill_worker", "node_swap", "kill_driver", "short_horizon", "second_driver"}


def test_short_chaos_run_survives_every_fault(chaos_bench):
    # Started with the session (conftest's `chaos_bench`): it ran beside the unit tier.
    returncode, output, leftovers = chaos_bench.finish(timeout=700)
    assert returncode == 0, output[-5000:]
    assert not leftovers, leftovers

    out = chaos_bench.output.parent
    summary = json.loads((out / "chaos.json").read_text())
    (run,) = summary["runs"]
    assert {f["kind"] for f in run["faults"]} == STEADY
    assert run["injected"] == run["survived"] == 5, run["faults"]
    assert run["lost"] == 0 and run["repeated"] == 0 and run["documents"] > 0
    assert set(run["world_sizes"]) == {2} and len(run["world_sizes"]) >= 3  # a worker and a driver restart
    assert run["weights"] == "bit-identical" and not run["problems"]
    # Its time ledger (raychat.run.ledger): goodput below the whole, the worker's restart by cause.
    assert 0 < run["goodput"] < 1 and any(" at step " in line for line in run["ledger"]), run["ledger"]
    # The operator's mistakes were refused in one line each, saying why.
    notes = {f["kind"]: f["note"] for f in run["faults"]}
    assert "past this plan's horizon" in notes["short_horizon"]
    assert "being trained by another driver" in notes["second_driver"]
    # A node lost at full size (a spare up): the lost rank came back from the copy a peer node held in
    # memory, so the weights above are bit-identical after a restore from memory, with nothing read
    # from storage.
    assert re.search(r"continued on 2 from step \d+ \(peer memory\), 0 bytes read from storage$",
                     notes["node_swap"]), notes["node_swap"]
    # The relaunched driver freed what the killed driver's controller still had reserved with Ray's
    # autoscaling coordinator (else it waits for the reservation to expire, up to 180 s).
    assert notes["kill_driver"] == "lease taken over, the killed controller's reservation released"
    # The table went to the results file, under its section.
    results = (out / "RESULTS.md").read_text()
    assert "## Chaos: faults on a multi-node cluster (bench/chaos.py)" in results
    assert "| steady | 5/5 | 5 |" in results
