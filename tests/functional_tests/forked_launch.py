"""Launch a script's ranks as forks of one process that imported torch and the trainer once.

A tiny functional run trains in about a second, but ``torchrun --nproc-per-node N`` first
starts a launcher and N fresh interpreters, each importing torch and megatron (about 3 s of
CPU apiece): on the 2-core CI box that start-up was most of the functional stage's time.
Here one server process imports them once and forks a child per rank for each launch, so a
launch costs what the script does, not the imports.

What a rank gets is what torchrun gives it: the script runs as ``__main__`` with ``sys.argv``
and the working directory set, stdin closed, stdout and stderr in the caller's files, and
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, a free ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, restart
count 0); with ``nproc=None`` none of it (``python script.py``), and with ``rank_envs`` one
process per entry with that entry added (``srun python script.py``: SLURM's variables). It ends as the
interpreter would: ``SystemExit`` gives its code, an exception its traceback and 1, the end
of the script 0, with atexit handlers run. As torchrun does, the first rank to fail stops the
others (SIGTERM, then SIGKILL after 5 s; srun-style launches don't, as srun by default), and
a launch past its timeout is killed.

Two things differ, so tests *of the launch* keep the real one: torchrun's own behaviour
(its error file, restarts, rendezvous, its exit code, which is 1 for any failure; here it is
the lowest failing rank's own code, or the signal that ended it) and the interpreter's start (``PYTHONPATH`` is read once,
when the server starts, and ``PYTHONHASHSEED`` is the server's in every rank).

The protocol is one JSON line per launch on the server's stdin, one JSON line back.
"""

import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pretrain_gpt")  # what every rank imports
STOP_GRACE_S = 5.0


@dataclass
class Launch:
    """The result of one launch, shaped like ``subprocess.CompletedProcess``."""

    returncode: int
    returncodes: list
    stdout: str
    stderr: str


class ForkServer:
    """The client: starts the server on first use (with the environment of that launch) and
    sends it launches, one at a time."""

    def __init__(self):
        self._proc = None
        self._pythonpath = None
        self._logs = tempfile.mkdtemp(prefix="forked-launches-")

    def launch(self, script, argv, *, nproc, env, rank_envs=None, cwd=REPO, timeout=300, merge_stderr=True):
        """Run ``script`` (a path relative to REPO or absolute) with ``argv`` at ``nproc`` ranks
        (None: one plain process; ``rank_envs``: one plain process per entry) under ``env``
        (the whole environment)."""
        if self._proc is None or self._proc.poll() is not None:
            self._start(env)
        if env.get("PYTHONPATH") != self._pythonpath:
            raise ValueError("forked_launch: PYTHONPATH differs from the server's (it is read once, at its start); "
                             "launch this one with subprocess")
        name = uuid.uuid4().hex[:8]
        out = os.path.join(self._logs, f"launch-{name}.out")
        err = out if merge_stderr else os.path.join(self._logs, f"launch-{name}.err")
        request = {"script": os.path.join(REPO, script), "argv": [str(a) for a in argv], "nproc": nproc,
                   "env": env, "rank_envs": rank_envs, "cwd": str(cwd), "stdout": out, "stderr": err, "timeout": timeout}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"forked_launch: the server died (exit code {self._proc.wait()})")
        codes = json.loads(reply)["returncodes"]
        # A rank's own failure before the signals the fast-fail sent the others (negative codes).
        failed = [c for c in codes if c > 0] + [c for c in codes if c < 0]
        read = lambda path: open(path).read() if os.path.exists(path) else ""  # noqa: E731
        return Launch(failed[0] if failed else 0, codes, read(out), "" if merge_stderr else read(err))

    def _start(self, env):
        self._pythonpath = env.get("PYTHONPATH")
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=REPO, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def close(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)


_SERVER = None


def server():
    """The test session's one server (started on its first launch, stopped at exit)."""
    global _SERVER
    if _SERVER is None:
        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT), below the kernel's ephemeral range.
    gloo's pair listeners bind port 0, so they take ephemeral ports: a store port from that
    range, once released here, can be handed to another run's gloo listener before this
    launch's rank 0 binds it, and the launch's other ranks then connect into that listener
    (seen as an abort or a segfault in a distributed test beside the functional stage)."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # never the tests' seeded sequence (two servers run side by side)
    for _ in range(200):
        port = draw.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free TCP port below the ephemeral range after 200 tries")


def _rank_env(request, rank, port, run_id):
    env = dict(request["env"])
    nproc = request["nproc"]
    if request["rank_envs"] is not None:
        env.update(request["rank_envs"][rank])
    elif nproc is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0")
    return env


def _become_rank(request, rank, port, run_id):
    """In the child: take the rank's environment, files and argv (the caller then runs the script)."""
    os.environ.clear()
    os.environ.update(_rank_env(request, rank, port, run_id))
    os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out = os.open(request["stdout"], flags, 0o644)
    os.dup2(out, 1)
    os.dup2(out if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags, 0o644), 2)
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(request["script"])  # as `python script.py` sets it


def _wait(pids, timeout, stop_on_failure):
    """Each child's exit code (negative: the signal); with ``stop_on_failure`` (torchrun's
    behaviour, not srun's default) the first failure stops the others."""
    codes = {}
    deadline = time.monotonic() + timeout
    stop_at = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        failed = stop_on_failure and any(code != 0 for code in codes.values())
        if (failed or now > deadline) and stop_at is None and len(codes) < len(pids):
            stop_at = now + STOP_GRACE_S
            _signal([p for p in pids if p not in codes], signal.SIGTERM)
        if stop_at is not None and now > stop_at:
            _signal([p for p in pids if p not in codes], signal.SIGKILL)
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def serve():
    """Returns in a child (which then runs its script); in the server, serves until stdin closes."""
    import importlib

    sys.path.insert(0, REPO)
    for module in PRELOAD:
        importlib.import_module(module)
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        port, run_id = free_port(), uuid.uuid4().hex
        pids = []
        processes = len(request["rank_envs"]) if request["rank_envs"] is not None else request["nproc"] or 1
        for rank in range(processes):
            replies.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_rank(request, rank, port, run_id)
                return request["script"]
            pids.append(pid)
        replies.write(json.dumps({"returncodes": _wait(pids, request["timeout"], request["rank_envs"] is None)}) + "\n")
        replies.flush()
    return None


if __name__ == "__main__":
    script = serve()
    if script is not None:
        import runpy

        runpy.run_path(script, run_name="__main__")
