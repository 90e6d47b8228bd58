"""Drivers racing for one run: how many trials, how many ended with more than one writer (target 0).

    python -m bench.lease_race --trials 50                  # local disk, moto's S3, the GCS emulator
    python -m bench.lease_race --trials 20 --storage s3 --json

Each trial starts 2-4 drivers (seeded) on a fresh run at one moment. In a bucket every other driver
talks to it through the fault proxy (testkit.fault_proxy), its lease writes (S3: PUTs with
If-None-Match; GCS: uploads with ifGenerationMatch) delayed by a seeded 0-1.5 s: the old
write-sleep-reread lease let both drivers in once one PUT was 1.3 s slower. A trial
counts a double writer when more than one driver believes it holds the run, or when more than one
lease epoch was created.
"""

import argparse
import json
import random
import time

from raychat.checkpoint import fence
from raychat.common import run_cli
from raychat.storage import Storage
from testkit.lease_race import race

BUCKET = "raychat-lease-race"


def run_trials(kind: str, trials: int, seed: int) -> dict:
    rng = random.Random(seed)
    double = refused = 0
    started = time.perf_counter()
    if kind == "local":
        import tempfile

        root = tempfile.mkdtemp(prefix="raychat-lease-race-")
        for trial in range(trials):
            run = Storage(f"{root}/run{trial}")
            outcomes = race([run] * rng.randint(2, 4), rng)
            double += outcomes.count("won") != 1 or len(fence.epochs(run)) != 1
            refused += len(outcomes) - outcomes.count("won")
    else:
        from testkit.fault_proxy import FaultProxy
        from testkit.gcs_server import start_gcs
        from testkit.s3_server import start_moto

        server, endpoint = (start_moto if kind == "s3" else start_gcs)(BUCKET)
        # GCS's upload names its object in the body: the precondition marks the lease's creates.
        method, match = ("PUT", "/lease/") if kind == "s3" else ("POST", "ifGenerationMatch=0")
        query = "?endpoint_override={}&scheme=http" + ("&anonymous=true" if kind == "gcs" else "")
        scheme = "s3" if kind == "s3" else "gs"
        try:
            with FaultProxy(endpoint, seed=seed, api=kind) as proxy:
                for trial in range(trials):
                    direct = Storage(f"{scheme}://{BUCKET}/run{trial}" + query.format(endpoint))
                    slowed = Storage(f"{scheme}://{BUCKET}/run{trial}" + query.format(proxy.address))
                    delay = proxy.inject("delay", method=method, match=match, delay_s=rng.uniform(0, 1.5))
                    outcomes = race([direct if i % 2 == 0 else slowed for i in range(rng.randint(2, 4))], rng)
                    delay.ended.set()
                    double += outcomes.count("won") != 1 or len(fence.epochs(direct)) != 1
                    refused += len(outcomes) - outcomes.count("won")
        finally:
            server.terminate()
            server.wait()
    return {"storage": kind, "trials": trials, "double_writers": int(double), "drivers_refused": refused,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lease_race", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="races per storage kind (default 50)")
    parser.add_argument("--storage", choices=["local", "s3", "gcs", "all"], default="all",
                        help="local disk, moto's S3 or the GCS emulator (each bucket behind the fault "
                             "proxy), or all three (default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of driver counts, jitter and delays")
    parser.add_argument("--json", action="store_true", help="print one JSON object per storage kind")
    args = parser.parse_args(argv)
    kinds = ["local", "s3", "gcs"] if args.storage == "all" else [args.storage]
    for kind in kinds:
        result = run_trials(kind, args.trials, args.seed)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{kind:5s}: {result['trials']} trials, {result['double_writers']} with more than one "
                  f"writer, {result['drivers_refused']} drivers refused in one line ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
