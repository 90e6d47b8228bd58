"""Which Ray a command runs on: the cluster RAY_ADDRESS names (what `ray job submit` sets), checked
before Ray's own connect, else a local instance of the command's own.

Ray's connect waits minutes on a dead address or on a server that is not a Ray cluster, and retries a
missing token for ~13 s, printing as it goes, before a traceback; `check_cluster_answers` makes each
one line within seconds. With no RAY_ADDRESS, `ray.init()` would join the cluster the machine's last
`ray start` recorded (/tmp/ray/ray_current_cluster), which may be gone or refuse the command's
num_cpus: LOCAL asks for a new instance instead.
"""

import re

from raychat.common import RaychatError, unreachable
from raychat.run.ray_internals import gcs_refusal

HOST_PORT = re.compile(r"[^\s/:]+:\d+")
LOCAL = "local"  # ray.init's address for "a new instance, never the recorded cluster"


def check_cluster_answers(address: str) -> None:
    """A RAY_ADDRESS of host:port (what `ray start` prints and `ray job submit` sets) must be a Ray
    cluster that answers and takes this driver, or one RaychatError line says which it is not. Other
    forms ("auto", "ray://...", an IPv6 [host]:port) are left to Ray."""
    address = address.strip()
    if not HOST_PORT.fullmatch(address):
        return
    host, port = address.rsplit(":", 1)
    if (reason := unreachable(host, int(port))) is not None:
        raise RaychatError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({reason}): start one "
                           "(`ray start --head`), fix the address, or unset RAY_ADDRESS to run on a local "
                           "Ray instance")
    refusal = gcs_refusal(address)
    if refusal == "token":
        raise RaychatError(f"RAY_ADDRESS={address}: the cluster refuses this driver's token (none, or "
                           "another): set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or "
                           "~/.ray/auth_token; `ray get-auth-token` on the head prints it")
    if refusal == "not a GCS":
        raise RaychatError(f"RAY_ADDRESS={address}: something answers there, but not a Ray cluster: use the "
                           "address `ray start --head` printed (port 6379 by default), not the dashboard's "
                           "(8265)")
