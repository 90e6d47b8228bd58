"""Bytes a process has read and written, as the kernel counts them: the checkpoint benches' measure
of what the code under test moved, independent of that code's own counters."""

from pathlib import Path

from raychat.common import RaychatError


def os_bytes(backend: str) -> tuple[int, int]:
    """(read, written) so far, as the kernel counts them for this backend."""
    if backend == "local":
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            received = int(counters.split()[0])  # on loopback every byte sent is also received once
            return received, received
    raise RaychatError("no loopback interface in /proc/net/dev; the S3 byte counts need one")
