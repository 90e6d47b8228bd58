"""Processes the unit tier starts once and reuses, since starting Python and importing torch costs more
than most of what the tests run in them (conftest.py has the fixtures):

- `Commands`: `python -m MODULE ARGS` as a user runs it (its exit code, stdout and stderr, the latter two
  captured at the file descriptors, so output from C code counts too), many commands in one interpreter.
  As in tests/test_cli.py's --help check, our modules (raychat, tune, bench, testkit) are forgotten
  before each command, so a command that works only after another's imports fails here as it would
  alone; each command gets its own environment, working directory, sys.path, argv, and warnings shown
  afresh.
  Other libraries stay imported, and read what they read of the environment at import once (e.g.
  torch inductor's CXX): a test's commands may differ in what raychat reads when it runs, not in that.
  After each command, what a fresh process's exit would have done or shown is done here: Ray left
  connected is shut down as Ray's exit hook does, a non-daemon thread still running fails the command
  (it would hang a process at exit), and the signal handlers, and the loggers of preloaded modules,
  are put back as they were. The session's drivers run here too (conftest's RayCluster.drivers); a
  test that signals, pauses or races drivers, or reads a driver's own command line (Ray records it),
  starts real processes.
- `Ranks`: spawned processes that run a function as the ranks of a gloo group, as mp.spawn would
  (fn(rank, *args) in each), kept for the next group; every rank's process group is ended and its torch
  thread count restored after each run, and a failed rank ends them all.
"""

import json
import multiprocessing
import multiprocessing.connection
import os
import select
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The interpreter behind Commands: one request per line on stdin (module, argv, environment, working
# directory, stdout and stderr files), one reply per line (the exit code) on what was its stdout.
SERVER = r'''
import ctypes, importlib, json, logging, os, runpy, signal, sys, threading, traceback, warnings

replies = os.fdopen(os.dup(1), "w")
requests = os.fdopen(os.dup(0), "r")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a command reads no requests
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a late write between commands never reaches the replies
libc = ctypes.CDLL(None)
for name in json.loads(sys.argv[1]):  # preloaded: their loggers exist before the snapshot below
    importlib.import_module(name)
THREAD_GRACE_S = float(sys.argv[2])
START_ENV, START_CWD, START_FILTERS = dict(os.environ), os.getcwd(), list(warnings.filters)
BASE_PATH = sys.path[1:]  # without -c's '' (and started without PYTHONPATH)
OURS = ("raychat", "tune", "bench", "testkit")
# Ctrl-C as a shell's `python -m` has it, even where the process that started this one ignored it (an
# ignored signal is inherited); the handlers every command starts with.
signal.signal(signal.SIGINT, signal.default_int_handler)
HANDLERS = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}


def loggers():
    return [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                   if isinstance(lg, logging.Logger))]


def logging_state():
    return {lg: (lg.level, list(lg.filters), lg.propagate, lg.disabled,
                 [(h, h.level, list(h.filters)) for h in lg.handlers]) for lg in loggers()}


def restore_logging(state):
    # What a command set on a logger that existed before it (raychat.ray_glue.quiet's levels and filters)
    # is undone: the next command finds the preloaded modules' loggers as their imports left them (a
    # logger first made by a command keeps what the commands after it set).
    for lg, (level, filters, propagate, disabled, handlers) in state.items():
        lg.level, lg.filters[:], lg.propagate, lg.disabled = level, filters, propagate, disabled
        lg.handlers[:] = [h for h, _, _ in handlers]
        for h, h_level, h_filters in handlers:
            h.level, h.filters[:] = h_level, h_filters
    logging.Logger.manager._clear_cache()


def run(module):
    """What `python -m module` exits with: SystemExit's code, 1 and a traceback for anything else."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def left_running(before, grace_s=THREAD_GRACE_S):
    """Threads the command started that would keep a fresh process from exiting: non-daemon ones still
    alive `grace_s` after it returned (an idle pool's workers aside: the interpreter's exit ends them)."""
    import concurrent.futures.thread as pool

    def holds_exit(t):
        return (t not in before and not t.daemon and t.is_alive() and t is not threading.main_thread()
                and getattr(t, "_target", None) is not pool._worker)

    for thread in [t for t in threading.enumerate() if holds_exit(t)]:
        thread.join(grace_s)
    return [t.name for t in threading.enumerate() if holds_exit(t)]


for line in requests:
    module, argv, env, cwd, out_path, err_path = json.loads(line)
    for name in [m for m in sys.modules if m.split(".")[0] in OURS]:
        del sys.modules[name]
    warnings.filters[:] = START_FILTERS
    warnings._filters_mutated()  # forgets which warnings were shown: shown again, as in a fresh process
    warnings.onceregistry.clear()
    if "ray.util.debug" in sys.modules:  # Ray's log_once: said again, once per command
        sys.modules["ray.util.debug"]._logged.clear()
    logs = logging_state()
    threads_before = set(threading.enumerate())
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = [cwd, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *BASE_PATH]
    sys.argv = [module, *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, out_path), (2, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    try:
        code = run(module)
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # what the interpreter's exit does for a driver
            ray.shutdown(_exiting_interpreter=True)  # whose command returned connected (an error's)
        stuck = left_running(threads_before)
        if stuck:  # a fresh process would hang at its exit
            print(f"reused interpreter: threads {stuck} still running after the command", file=sys.stderr)
            code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        libc.fflush(None)
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.environ.clear()
        os.environ.update(START_ENV)
        os.chdir(START_CWD)
        if threads is not None:
            torch.set_num_threads(threads)
        for sig, handler in HANDLERS.items():  # else Ray Train's and Tune's Ctrl-C handlers stay
            signal.signal(sig, handler)
        restore_logging(logs)
    replies.write(json.dumps(code) + "\n")
    replies.flush()
'''


class Commands:
    """`run(module, *args)` is `subprocess.run([python, "-m", module, *args], capture_output=True,
    text=True, env=env, cwd=cwd, timeout=timeout)`, in one reused interpreter (see the module's
    docstring). An interpreter that dies (os._exit, a crash) answers with its exit code, as the
    subprocess would have, and the next command starts a new one."""

    def __init__(self, tmp: Path, preload: tuple[str, ...] = (), thread_grace_s: float = 10.0):
        """`preload`: modules the interpreter imports before its first command, so that what a command
        changes of their loggers is undone after it (the loggers a module makes at import).
        `thread_grace_s`: how long a non-daemon thread a command started may outlive it."""
        self.tmp, self.preload, self.proc, self.count = Path(tmp), preload, None, 0
        self.thread_grace_s = thread_grace_s

    def run(self, module: str, *args: object, env: dict[str, str] | None = None,
            cwd: str | Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        if self.proc is not None and self.proc.poll() is not None:  # it died between commands
            self.proc = None
        if self.proc is None:
            start_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(self.preload),
                                          str(self.thread_grace_s)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                         env=start_env)
        self.count += 1
        out, err = self.tmp / f"command{self.count}.out", self.tmp / f"command{self.count}.err"
        argv = [str(a) for a in args]
        where = str(Path(cwd or os.getcwd()).resolve())
        request = [module, argv, dict(os.environ if env is None else env), where, str(out), str(err)]
        command = [sys.executable, "-m", module, *argv]
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(command, timeout)
            reply = self.proc.stdout.readline()
        except BaseException:  # a timeout, the test's own (pytest-timeout), Ctrl-C: as subprocess.run
            self.close()  # kills its child, the command ends here, and the next one starts afresh
            raise
        if reply:
            code = json.loads(reply)
        else:  # the interpreter ended with the command
            code = self.proc.wait()
            self.proc = None
        read = [path.read_text() if path.exists() else "" for path in (out, err)]  # none: it died first
        return subprocess.CompletedProcess(command, code, *read)

    def close(self) -> None:
        if self.proc is not None:  # idle between commands: nothing of a command is lost
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """A Ranks process: runs fn(rank, *args) for each request; None, or the traceback, in reply."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        fn, rank, args = task
        try:
            fn(rank, *args)
            reply = None
        except BaseException:
            reply = traceback.format_exc()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(threads)
        conn.send(reply)


class Ranks:
    """`run(fn, world, *args)` is `torch.multiprocessing.spawn(fn, args, nprocs=world, join=True)` on
    reused processes: fn(rank, *args) for every rank at once, each in its own process; it returns once
    all returned, and raises with the traceback of a rank that raised (and ends every process)."""

    def __init__(self):
        self.workers: list[tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = []

    def start(self, world: int) -> None:
        """At least `world` processes, started now and left to import torch meanwhile (run waits for
        them as for any rank)."""
        context = multiprocessing.get_context("spawn")
        while len(self.workers) < world:
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self.workers.append((process, ours))

    def run(self, fn: Callable[..., None], world: int, *args: object, timeout: float = 600) -> None:
        self.start(world)
        conns = {}
        try:
            for rank, (_, conn) in enumerate(self.workers[:world]):
                conn.send((fn, rank, args))
                conns[conn] = rank
            while conns:
                ready = multiprocessing.connection.wait(list(conns), timeout)
                if not ready:
                    raise TimeoutError(f"ranks {sorted(conns.values())} still running after {timeout} s")
                for conn in ready:
                    rank = conns.pop(conn)
                    try:
                        failure = conn.recv()
                    except EOFError:
                        self.workers[rank][0].join(timeout=10)
                        failure = f"the process exited with code {self.workers[rank][0].exitcode}"
                    if failure is not None:
                        raise RuntimeError(f"rank {rank} of {world} failed:\n{failure}")
        except BaseException:
            self.close(kill=True)  # the other ranks may wait for the failed one forever
            raise

    def close(self, kill: bool = False) -> None:
        for process, conn in self.workers:
            conn.close()  # an idle process returns
            if kill:
                process.kill()
        for process, _ in self.workers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.workers = []
