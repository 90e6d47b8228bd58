"""The reused processes the unit tier runs commands and gloo ranks in (tests/reused_processes.py) give
what a fresh `python -m` and mp.spawn give."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from reused_processes import Ranks

pytestmark = pytest.mark.integration  # subprocesses, reused interpreters, gloo ranks

# A command that writes through Python and around it (C code's writes to the file descriptors), warns,
# reads its environment and argv, and exits in each way a command can.
COMMAND = r'''
import os, sys, warnings
warnings.warn("shown in every run", UserWarning)
print("out", os.environ.get("WHICH"), sys.argv[1:], os.getcwd() == sys.path[0])
print("err", file=sys.stderr)
os.write(1, b"fd 1\n")
os.write(2, b"fd 2\n")
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("a bug")
if how == "os_exit":
    sys.stdout.flush()
    os._exit(7)
'''


@pytest.fixture
def module_dir(tmp_path) -> Path:
    (tmp_path / "reused_command_probe.py").write_text(COMMAND)
    return tmp_path


@pytest.mark.parametrize("how", ["return", "code", "message", "raise", "os_exit"])
def test_a_command_gives_what_a_fresh_interpreter_gives(commands, module_dir, how):
    """Each case after the ones before it in the module's interpreter (and after one that ended it)."""
    env = {**os.environ, "WHICH": how, "PYTHONPATH": str(module_dir)}
    fresh = subprocess.run([sys.executable, "-m", "reused_command_probe", how], capture_output=True,
                           text=True, env=env, cwd=module_dir, timeout=60)
    reused = commands.run("reused_command_probe", how, env=env, cwd=module_dir, timeout=60)
    assert reused.returncode == fresh.returncode
    assert reused.stdout == fresh.stdout
    if how == "raise":  # the traceback's frames differ (runpy's), not its end
        assert reused.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: a bug"
        assert reused.stderr.startswith(fresh.stderr.split("Traceback")[0])
    else:
        assert reused.stderr == fresh.stderr
    assert "UserWarning: shown in every run" in reused.stderr and f"out {how}" in reused.stdout


# A command that leaves what a process's exit would end (a signal handler, a logger changed, a thread
# that never ends), and one that reports what it finds of them, its pid and Ray's once-only log.
LEAVES = r'''
import logging, signal, sys, threading
logging.getLogger("asyncio").setLevel(logging.CRITICAL)
logging.getLogger("asyncio").addFilter(lambda record: False)
signal.signal(signal.SIGINT, lambda *_: None)
if sys.argv[1:] == ["thread"]:
    threading.Thread(target=threading.Event().wait, daemon=False).start()
if sys.argv[1:] == ["sleep"]:
    threading.Event().wait(60)
'''
FINDS = r'''
import logging, os, signal
asyncio = logging.getLogger("asyncio")
default_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(asyncio.level, len(asyncio.filters), default_sigint, os.getpid())
'''


def test_what_a_command_leaves_is_ended_as_a_fresh_process_would(tmp_path):
    """A command's signal handlers and its changes to a preloaded module's loggers are undone; a thread
    that would keep a process from exiting fails it; a command past its timeout ends the interpreter
    (as subprocess.run kills its child), and the next command starts in a new one."""
    from reused_processes import Commands

    (tmp_path / "leaves_probe.py").write_text(LEAVES)
    (tmp_path / "finds_probe.py").write_text(FINDS)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    commands = Commands(tmp_path, preload=("asyncio",), thread_grace_s=0.2)
    try:
        pristine = commands.run("finds_probe", env=env, cwd=tmp_path).stdout.split()
        assert pristine[:3] == ["0", "0", "True"]
        assert commands.run("leaves_probe", env=env, cwd=tmp_path).returncode == 0
        assert commands.run("finds_probe", env=env, cwd=tmp_path).stdout.split() == pristine
        stuck = commands.run("leaves_probe", "thread", env=env, cwd=tmp_path)
        assert stuck.returncode == 1 and "still running after the command" in stuck.stderr
        with pytest.raises(subprocess.TimeoutExpired):
            commands.run("leaves_probe", "sleep", env=env, cwd=tmp_path, timeout=2)
        after = commands.run("finds_probe", env=env, cwd=tmp_path).stdout.split()
        assert after[:3] == pristine[:3] and after[3] != pristine[3]  # a new interpreter
    finally:
        commands.close()


def _rank(rank: int, out: str, fail: bool) -> None:
    store = dist.FileStore(str(Path(out) / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.set_num_threads(1)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    Path(out, f"rank{rank}").write_text(f"{total.item()} {os.getpid()}")
    if fail and rank == 1:
        raise ValueError("rank 1 failed")
    # the group is left for the pool to end, as a rank that raised leaves it


def test_ranks_run_groups_on_the_same_processes(ranks, tmp_path):
    pids = []
    for attempt in range(2):
        out = tmp_path / str(attempt)
        out.mkdir()
        ranks.run(_rank, 2, str(out), False)
        results = [(out / f"rank{r}").read_text().split() for r in range(2)]
        assert [total for total, _ in results] == ["3.0", "3.0"]
        pids.append([pid for _, pid in results])
    assert pids[0] == pids[1]  # the same processes, their groups ended in between


def _fail(rank: int) -> None:
    raise ValueError(f"rank {rank} failed")


def test_a_failed_rank_fails_the_run_and_ends_the_processes():
    pool = Ranks()  # not the session's: its processes end here
    try:
        with pytest.raises(RuntimeError, match=r"(?s)rank 0 of 1 failed:.*ValueError: rank 0 failed"):
            pool.run(_fail, 1)
        assert pool.workers == []
    finally:
        pool.close()
