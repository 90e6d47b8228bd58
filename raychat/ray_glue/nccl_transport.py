"""Which link NCCL uses between nodes, said once at the start of a multi-node GPU run.

A p5.48xlarge moves 3200 Gbps between nodes over EFA, and NCCL only reaches it through the
aws-ofi-nccl plugin (libfabric's `efa` provider). When the plugin is missing from the image, or the
EFA devices are not in the container, NCCL falls back, without an error, to InfiniBand verbs (none
on EC2) and then to TCP sockets on the node's ENA interface: the run trains, its steps just wait on
the network. The only record of that choice is NCCL's own init report (NCCL_DEBUG=INFO), which
is off by default. So rank 0 of a group that spans nodes on GPUs asks NCCL for the report,
reads it after the group's first collective made the communicator, prints one line naming the
link, and warns once, naming the fix, when it is plain sockets.

How the report is captured (NCCL's src/debug.cc, https://github.com/NVIDIA/nccl/blob/master/src/debug.cc):
NCCL reads NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE once, at its first log call, which
comes with the process's first communicator; torch makes that communicator lazily, at the first
collective (Ray Train's TorchConfig passes no device_id to init_process_group). Setting the three
variables at the start of the worker's set-up, before its first collective, is therefore in time.
NCCL_DEBUG_FILE sends the report to a file of this process instead of stderr (`%p`: NCCL puts the
pid there), line-buffered, so it is complete when the collective returns; the INIT and NET
subsystems are the part that names the network (a few dozen lines per communicator). NCCL's
default level is NONE, so nothing NCCL would have printed goes missing: WARN lines, which would
have gone unprinted, land in the file too, whose path the line gives.

A user who set NCCL_DEBUG themselves keeps their setting: with NCCL_DEBUG_FILE and INFO (or TRACE)
the report is read from their file; otherwise (their lines go to stderr, or they asked for less)
raychat says nothing about the link. CPU runs (gloo), one-node groups and ranks other than 0 are
left alone.
"""

import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field

FIX = ("run the GPU nodes with EFA: the raychat image (cluster/Dockerfile: the EFA installer with "
       "aws-ofi-nccl) on nodes with their EFA interfaces and /dev/infiniband devices "
       "(cluster/h100.yaml, cluster/kuberay/raycluster.yaml); cluster/README.md, section "
       "\"EFA: the inter-node fabric\"")
VERBOSE_LEVELS = ("INFO", "TRACE")  # levels at which NCCL writes the lines that name the network

_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([^\s,(]+)(?:.*?found (\d+) nics)?")
_IB_USING = re.compile(r"NET/IB ?: Using (.*?)(?:\s*;\s*OOB.*)?$")
_SOCKET_USING = re.compile(r"NET/Socket ?: Using (.*?)\s*$")
_DEVICE = re.compile(r"\[\d+\]([^\s\[]+)")  # "[0]mlx5_0:1/IB", "[1]eth0:10.0.0.1<0>"
# libfabric providers that are TCP or UDP sockets underneath: NCCL over them is no faster than its own
SOCKET_PROVIDERS = ("tcp", "sockets", "udp")

_warned: set[str] = set()  # one warning per process, whatever calls report() (tests reset it)


@dataclass(frozen=True)
class NetChoice:
    """What NCCL's init report says about the inter-node network. `network`: NCCL's "Using network
    X" (its plugin's name, "IB" or "Socket"); `provider`, `nics`: aws-ofi-nccl's libfabric provider
    and NIC count; `ib`, `sockets`: the devices NET/IB and NET/Socket said they use."""

    network: str | None = None
    provider: str | None = None
    nics: int | None = None
    ib: tuple[str, ...] = field(default=())
    sockets: tuple[str, ...] = field(default=())

    @property
    def kind(self) -> str | None:
        """"efa", "ofi" (libfabric, another provider), "ib", "socket", "other" or None (no report).
        NCCL tries its net plugin first, then IB, then sockets; its "Using network" line says which
        won (NCCL 2.19 and later); older reports are read in that order."""
        network = (self.network or "").lower()
        if "libfabric" in network or "ofi" in network or (not network and self.provider):
            base = (self.provider or "").split(";")[0].lower()
            if base.startswith(SOCKET_PROVIDERS):
                return "socket"
            return "efa" if base == "efa" else "ofi"
        if network.startswith("ib") or (not network and self.ib):
            return "ib"
        if network == "socket" or (not network and self.sockets):
            return "socket"
        return "other" if network else None

    @property
    def over_sockets(self) -> bool:
        return self.kind == "socket"

    def describe(self) -> str:
        kind = self.kind
        if kind in ("efa", "ofi"):
            nics = f", {self.nics} NICs" if self.nics else ""
            return f"NCCL's inter-node link: {self.network or 'libfabric'} (provider {self.provider}{nics})"
        if kind == "ib":
            return f"NCCL's inter-node link: InfiniBand/RoCE verbs ({', '.join(self.ib) or self.network})"
        if kind == "socket":
            via = f"libfabric provider {self.provider}" if self.provider else "NCCL's socket transport"
            where = ", ".join(self.sockets) or "interface not reported"
            return f"NCCL's inter-node link: TCP sockets ({via}; {where})"
        if kind == "other":
            return f"NCCL's inter-node link: {self.network}"
        return "NCCL's inter-node link: not named in NCCL's init report"


def parse_nccl_net(lines: Iterable[str]) -> NetChoice:
    """The network in NCCL's NCCL_DEBUG=INFO init lines (any order, other lines ignored; the first
    of each kind counts: a process's later communicators repeat them)."""
    network = provider = None
    nics = None
    ib: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        if network is None and (m := _USING_NETWORK.search(line)):
            network = m.group(1)
        elif provider is None and (m := _OFI_PROVIDER.search(line)):
            provider, nics = m.group(1).rstrip(";"), int(m.group(2)) if m.group(2) else None
        elif not ib and (m := _IB_USING.search(line)):
            ib = tuple(_DEVICE.findall(m.group(1)))
        elif not sockets and (m := _SOCKET_USING.search(line)):
            sockets = tuple(d.split("<")[0] for d in _DEVICE.findall(m.group(1)))
    return NetChoice(network, provider, nics, ib, sockets)


def expand_debug_file(pattern: str, pid: int | None = None, hostname: str | None = None) -> str:
    """NCCL_DEBUG_FILE's name as NCCL makes it: %h the host name up to its first dot (with % and /
    made dashes), %p the pid, %% a percent sign; other % sequences kept."""
    host = (hostname if hostname is not None else socket.gethostname()).split(".")[0]
    host = host.replace("%", "-").replace("/", "-")
    pid = os.getpid() if pid is None else pid
    return re.sub(r"%(.)", lambda m: {"h": host, "p": str(pid), "%": "%"}.get(m.group(1), m.group(0)),
                  pattern)


@dataclass
class NcclReport:
    """Where this process's NCCL init report will be (None: nothing to say)."""

    path: str | None = None

    @classmethod
    def watch(cls, device_type: str, world_size: int, local_world_size: int, rank: int,
              env: MutableMapping[str, str] | None = None, directory: str | None = None) -> "NcclReport":
        """Before the group's first collective: on rank 0 of a GPU group spanning nodes (the world
        is larger than this node's share of it), have NCCL write its init report to a file."""
        env = os.environ if env is None else env
        if device_type != "cuda" or world_size <= local_world_size or rank != 0:
            return cls()
        level = env.get("NCCL_DEBUG", "").upper()
        if level or env.get("NCCL_DEBUG_FILE"):  # the user's choice stands
            if level in VERBOSE_LEVELS and env.get("NCCL_DEBUG_FILE"):
                return cls(expand_debug_file(env["NCCL_DEBUG_FILE"]))
            return cls()
        directory = directory or tempfile.mkdtemp(prefix="raychat-nccl-")
        env["NCCL_DEBUG"] = "INFO"
        env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
        env["NCCL_DEBUG_FILE"] = os.path.join(directory, "nccl.%h.%p.log")
        return cls(expand_debug_file(env["NCCL_DEBUG_FILE"]))

    def report(self, log: Callable[[str], None]) -> NetChoice | None:
        """After the first collective: one line naming the link, and a warning (once per process)
        when it is TCP sockets. None when not watching."""
        if self.path is None:
            return None
        try:
            with open(self.path, errors="replace") as f:
                choice = parse_nccl_net(f)
        except OSError:
            choice = NetChoice()
        log(f"{choice.describe()} (NCCL's init report: {self.path})")
        if choice.over_sockets and "sockets" not in _warned:
            _warned.add("sockets")
            log("warning: this run's GPU workers talk between nodes over TCP sockets, not EFA or "
                f"InfiniBand: every step waits on a fraction of the network the nodes have. Fix: {FIX}")
        return choice
