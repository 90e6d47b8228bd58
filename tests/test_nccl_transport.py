"""raychat.ray_glue.nccl_transport: the inter-node link read from NCCL's own init lines (real lines, each
with the public thread it was copied from), and the start path that captures them: a multi-node GPU
group's rank 0 says which link NCCL chose and warns once when it is TCP sockets; CPU runs, one-node
groups and other ranks are untouched."""

import ast
import inspect
from pathlib import Path

import pytest

from raychat.ray_glue import nccl_transport
from raychat.ray_glue.nccl_transport import NcclReport, expand_debug_file, parse_nccl_net

pytestmark = pytest.mark.unit

# NCCL 2.2x with aws-ofi-nccl on EFA (two H200 nodes; "Using network Libfabric" is the plugin's name).
# https://github.com/NVIDIA/nccl/issues/1597
OFI_EFA = [
    "8h200-2:6831:6840 [0] NCCL INFO NET/OFI Creating one domain per process",
    "8h200-2:6831:6840 [0] NCCL INFO PROFILER/Plugin: Could not find: libnccl-profiler.so.",
    "8h200-2:6831:6840 [0] NCCL INFO Using network Libfabric",
    "8h200-3:6310:6318 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)",
    "8h200-3:6310:6318 [0] NCCL INFO NET/OFI NIC group 0 device #0 0000:56:00.0",
]
# NCCL 2.4 with an early aws-ofi-nccl: no "Using network" line yet; the plugin's provider line
# decides over the socket line NCCL printed first. https://github.com/NVIDIA/nccl/issues/229
OFI_EFA_OLD = [
    "ip-192-168-16-255:25655:25655 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.16.255<0>",
    "ip-192-168-16-255:25655:25655 [0] NCCL INFO NET/OFI Selected Provider is efa;ofi_rxr",
]
# NCCL's own socket transport chosen: https://github.com/NVIDIA/nccl/issues/676
SOCKET = [
    "gpu01:124172:124172 [0] NCCL INFO NCCL_SOCKET_IFNAME set to en",
    "gpu01:124172:124172 [0] NCCL INFO Bootstrap : Using enp225s0f1:10.10.10.2<0>",
    "gpu01:124172:124172 [0] NCCL INFO NET/Socket : Using [0]enp225s0f1:10.10.10.2<0>",
    "gpu01:124172:124172 [0] NCCL INFO Using network Socket",
]
# NCCL 2.4 on EC2 without EFA: no plugin, no IB device, sockets. https://github.com/NVIDIA/nccl/issues/226
SOCKET_OLD = [
    "ip-172-31-10-182:45407:45407 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.10.182<0>",
    "ip-172-31-10-182:45407:45407 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so).",
    "ip-172-31-10-182:45407:45407 [0] NCCL INFO NET/IB : No device found.",
]
# NCCL 2.19 over RoCE: https://github.com/NVIDIA/nccl-tests/issues/185
IB = [
    "dgxh100-4:460770:460770 [0] NCCL INFO NET/Plugin : dlerror=libnccl-net.so: cannot open shared object "
    "file: No such file or directory No plugin found (libnccl-net.so), using internal implementation",
    "dgxh100-4:460770:460842 [0] NCCL INFO NET/IB : Using [0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; "
    "OOB enp220s0np0:11.1.128.136<0>",
    "dgxh100-4:460770:460842 [0] NCCL INFO Using non-device net plugin version 0",
    "dgxh100-4:460770:460842 [0] NCCL INFO Using network IB",
]
# NCCL 2.4 on InfiniBand, both NET lines printed: https://github.com/NVIDIA/nccl-tests/issues/29
IB_OLD = [
    "server3:15223:15223 [7] NCCL INFO NET/Socket : Using [0]enp41s0f1:<0> [1]virbr0:<0>",
    "server3:15223:15223 [7] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so).",
    "server3:15223:15223 [7] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB enp41s0f1:<0>",
]
# HPC-X's SHARP plugin over InfiniBand: https://github.com/NVIDIA/nccl/issues/1357
IB_EXT = ["qh100-gpu19:49355:49414 [1] NCCL INFO Using network IBext"]


def test_efa_through_aws_ofi_nccl():
    choice = parse_nccl_net(OFI_EFA)
    assert (choice.kind, choice.network, choice.provider, choice.nics) == ("efa", "Libfabric", "efa", 16)
    assert not choice.over_sockets
    assert "provider efa, 16 NICs" in choice.describe()
    old = parse_nccl_net(OFI_EFA_OLD)
    assert (old.kind, old.provider, old.network) == ("efa", "efa;ofi_rxr", None)
    assert not old.over_sockets


def test_plain_sockets():
    choice = parse_nccl_net(SOCKET)
    assert (choice.kind, choice.sockets) == ("socket", ("enp225s0f1:10.10.10.2",))
    assert choice.over_sockets and "TCP sockets" in choice.describe()
    old = parse_nccl_net(SOCKET_OLD)
    assert (old.kind, old.ib, old.sockets) == ("socket", (), ("ens3:172.31.10.182",))


def test_infiniband():
    choice = parse_nccl_net(IB)
    assert (choice.kind, choice.ib) == ("ib", ("mlx5_10:1/RoCE", "mlx5_11:1/RoCE"))
    assert "mlx5_10:1/RoCE" in choice.describe() and not choice.over_sockets
    assert parse_nccl_net(IB_OLD).ib == ("mlx5_0:1/IB",) and parse_nccl_net(IB_OLD).kind == "ib"
    assert parse_nccl_net(IB_EXT).kind == "ib"


def test_libfabric_over_tcp_is_sockets_too():
    """aws-ofi-nccl on libfabric's tcp provider (EFA devices missing, FI_PROVIDER unset) is TCP."""
    lines = [OFI_EFA[2], OFI_EFA[3].replace("is efa (found 16 nics)", "is tcp (found 1 nics)")]
    assert parse_nccl_net(lines).over_sockets


def test_nothing_reported():
    choice = parse_nccl_net(["NCCL version 2.27.7+cuda12.9", "unrelated"])
    assert choice.kind is None and not choice.over_sockets
    assert "not named" in choice.describe()


def test_debug_file_name_as_nccl_makes_it():
    # NCCL's src/debug.cc: %h the host name up to its first dot, %p the pid, %% a percent sign
    assert expand_debug_file("/t/nccl.%h.%p.log", pid=42, hostname="ip-10-0-0-1.ec2.internal") == \
        "/t/nccl.ip-10-0-0-1.42.log"
    assert expand_debug_file("/t/a%%b%x", pid=1, hostname="h") == "/t/a%b%x"


@pytest.fixture(autouse=True)
def fresh_warning():
    nccl_transport._warned.clear()
    yield
    nccl_transport._warned.clear()


def start(tmp_path, lines, env=None, device="cuda", world=16, local=8, rank=0):
    """The worker's start path as raychat.worker.setup.setup runs it: watch before the first
    collective, NCCL writes its init report (here: pre-written lines), report after it."""
    env = {} if env is None else env
    report = NcclReport.watch(device, world, local, rank, env=env, directory=str(tmp_path))
    if report.path is not None and lines is not None:
        Path(report.path).write_text("\n".join(lines) + "\n")
    out: list[str] = []
    report.report(out.append)
    report.report(out.append)  # a second look (another group in this process) warns no more
    return env, out


def test_socket_run_warns_once_naming_the_fix(tmp_path):
    env, out = start(tmp_path, SOCKET)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl.%h.%p.log")
    infos = [line for line in out if line.startswith("NCCL's inter-node link")]
    warnings = [line for line in out if line.startswith("warning:")]
    assert len(infos) == 2 and "TCP sockets" in infos[0]
    assert len(warnings) == 1
    assert "EFA" in warnings[0] and "cluster/Dockerfile" in warnings[0] and "cluster/README.md" in warnings[0]


def test_efa_run_says_the_link_without_warning(tmp_path):
    _, out = start(tmp_path, OFI_EFA)
    assert out and all(line.startswith("NCCL's inter-node link: Libfabric (provider efa") for line in out)


def test_left_alone_off_gpu_on_one_node_and_off_rank_0(tmp_path):
    for kwargs in ({"device": "cpu"}, {"world": 8, "local": 8}, {"rank": 3}):
        env, out = start(tmp_path, SOCKET, **kwargs)
        assert env == {} and out == []


def test_the_users_nccl_debug_stands(tmp_path):
    env, out = start(tmp_path, SOCKET, env={"NCCL_DEBUG": "WARN"})
    assert env == {"NCCL_DEBUG": "WARN"} and out == []
    own = tmp_path / "mine.%p"
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(own)}
    report = NcclReport.watch("cuda", 16, 8, 0, env=env)
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(own)}
    Path(report.path).write_text("\n".join(SOCKET))
    out = []
    report.report(out.append)
    assert any(line.startswith("warning:") for line in out)


def test_a_missing_report_is_said_not_guessed(tmp_path):
    _, out = start(tmp_path, None)
    assert len(out) == 2 and "not named" in out[0] and not any(line.startswith("warning:") for line in out)


def test_worker_setup_watches_before_its_first_collective_and_reports_after():
    """The call site: watch() comes before setup's first gather (NCCL reads its variables once, at
    the first communicator), report() after it (the report is written by then)."""
    from raychat.worker import setup as worker_setup

    tree = ast.parse(inspect.getsource(worker_setup.setup))
    calls = [(n.lineno, ast.unparse(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    line_of = lambda suffix: min(ln for ln, f in calls if f.endswith(suffix))  # noqa: E731
    assert line_of("NcclReport.watch") < line_of("me.gather") < line_of(".report")
