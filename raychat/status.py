"""`python -m raychat.status --run-name R`: where a run stands, from Ray Train's state API (the run,
its attempts and their world sizes, which Ray 2.60's dashboard keeps but shows on no page) and from
the run's own storage (the latest complete checkpoint, the last step and eval of its metrics log).

The state API is the dashboard's `/api/train/v2/runs/v1` (Ray Train's state tracking is on for
raychat runs); it holds the runs of the cluster's current session, so a run of an earlier session is
shown from its storage alone.
"""

import argparse
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.common import RaychatError, run_cli
from raychat.locations import SafeLocation, redact
from raychat.storage import Storage, run_directory
from raychat.telemetry.metrics_log import read_timeline

TRAIN_RUNS_API = "/api/train/v2/runs/v1"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def auth_token() -> str | None:
    """The cluster's token as the Ray CLI finds it: $RAY_AUTH_TOKEN, else ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = Path("~/.ray/auth_token").expanduser()
    return path.read_text().strip() if path.exists() else None


class _Redirected(Exception):
    """A redirect to another origin than the dashboard's address: where to."""


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the address's own scheme, host and port: urllib copies the request's
    headers, the cluster's token among them, to wherever a redirect points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl))
        old = urllib.parse.urlsplit(req.full_url)
        if (new.scheme, new.hostname, new.port) != (old.scheme, old.hostname, old.port):
            raise _Redirected(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def train_runs(address: str, token: str | None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Every Ray Train run the dashboard at `address` knows, or a RaychatError saying why not. The
    token goes to that address only; a user:password in it is never printed (nor sent: Ray's
    dashboard takes its token, and urllib would read the user:password as part of the host)."""
    if "://" not in address:  # host:port, as `ray dashboard` and RAY_ADDRESS write it
        address = f"http://{address}"
    shown, safe = redact(address), SafeLocation(address)
    try:
        parts = urllib.parse.urlsplit(address)
    except ValueError:
        raise RaychatError(f"--address {shown} is not a URL (a '[' or ']' outside an IPv6 host)") from None
    if "@" in address and "@" not in parts.netloc:
        # A '/', '?' or '#' in the password ended the host early: urllib would connect to a host
        # named after the user, on a port taken from the password, and send it the token.
        raise RaychatError(f"--address {shown}: its user:password holds a raw '/', '?' or '#'; drop the "
                           "user:password (the dashboard takes the cluster's token) or write them %2F, %3F, "
                           "%23")
    if "@" in parts.netloc:
        address = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    request = urllib.request.Request(address.rstrip("/") + TRAIN_RUNS_API)
    if token:
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_SameOriginRedirects)
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return json.loads(response.read())["train_runs"]
    except _Redirected as e:
        raise RaychatError(f"the dashboard at {shown} redirected to another address ({redact(str(e))}), "
                           "which is not sent the cluster's token: pass that address as --address if it is "
                           "the dashboard") from None
    except urllib.error.HTTPError as e:
        denied = e.code in (401, 403)
        hint = ("run `ray get-auth-token` where the cluster runs and set RAY_AUTH_TOKEN" if denied
                else " ".join(e.read().decode(errors="replace").split())[:200])
        raise RaychatError(f"the dashboard at {shown} refused the state API ({e.code}): {hint}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # a bad port, say
        reason = safe.scrub(str(getattr(e, "reason", e)).replace(address, shown))
        raise RaychatError(f"no Ray dashboard at {shown} ({reason}); pass --address (through `ray dashboard` "
                           "for a cluster) or use --storage-only") from None


def _time(ns: int | None) -> str:
    return "-" if not ns else datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def ray_lines(runs: list[dict[str, Any]], name: str) -> list[str]:
    """The Ray Train runs named `name` (one per driver: a rerun of the name is a new Ray run)."""
    mine = [r for r in runs if r.get("name") == name]
    if not mine:
        return [f"Ray Train: no run named {name!r} in this cluster's session"]
    lines = []
    for run in mine:
        lines.append(f"Ray Train run {run['id']}: {run['status']} since {_time(run.get('start_time_ns'))}"
                     + (f" ({run['status_detail']})" if run.get("status_detail") else ""))
        for i, attempt in enumerate(run.get("attempts", []), 1):
            lines.append(f"  attempt {i}: {attempt['status']}, {len(attempt.get('workers', []))} worker(s), "
                         f"{_time(attempt.get('start_time_ns'))} - {_time(attempt.get('end_time_ns'))}")
    return lines


def storage_lines(run: Storage) -> list[str]:
    checkpoint = latest_valid_checkpoint(run, deep=False)
    lines = [f"Storage {run.location}: latest checkpoint {checkpoint.name if checkpoint else '(none yet)'}"]
    timeline = read_timeline(run)
    if timeline is None or not timeline.steps:
        return lines + ["  no steps in the metrics log yet"]
    last = timeline.steps[-1]
    lines.append(f"  last step {last['step']}/{last['num_iterations']}: loss {last['loss']:.4f}, "
                 f"{last['tokens_per_sec']:,.0f} tok/s, {last['world_size']} worker(s)")
    if timeline.evals:
        last_eval = timeline.evals[-1]
        lines.append(f"  last eval at step {last_eval['step']}: val bpb {last_eval['val_bpb']:.4f}")
    return lines + ["  " + line.removeprefix("- ") for line in timeline.ledger.lines()[:2]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.status",
        description="Where a run stands: Ray Train's record of it (status, attempts, world sizes; from the "
                    "dashboard's state API, which no dashboard page shows) and its storage (the latest "
                    "checkpoint, the last step and eval). For the full picture: python -m raychat.report.",
        epilog="example:\n  python -m raychat.status --run-name d4\n"
               "On a cluster, keep `ray dashboard cluster/h100.yaml` open and export RAY_AUTH_TOKEN.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-name", required=True, help="the run's --run-name")
    parser.add_argument("--storage-path", default="", help="the run's --storage-path (default: "
                        "$RAYCHAT_HOME/runs)")
    parser.add_argument("--address", default=DEFAULT_DASHBOARD,
                        help=f"the Ray dashboard's URL (default {DEFAULT_DASHBOARD})")
    parser.add_argument("--storage-only", action="store_true", help="skip Ray: no cluster is running")
    args = parser.parse_args(argv)
    run = run_directory(args.storage_path, args.run_name)
    lines = [] if args.storage_only else ray_lines(train_runs(args.address, auth_token()), args.run_name)
    print("\n".join(lines + storage_lines(run)))
    return 0


if __name__ == "__main__":
    run_cli(main)
