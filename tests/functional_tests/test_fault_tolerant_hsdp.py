"""Fault-tolerant HSDP on torchft, end to end: a lighthouse (torchft's, in this process) and
replica groups, each its own torchrun of pretrain_gpt.py (--ft-* flags, gloo, CPU).

* No failure, launched by examples/sbatch_fault_tolerant_hsdp.sh under a local srun
  stand-in (a lighthouse step, one step per group): 2 groups x 2 ranks with TP=2 inside each
  train like one MFSDP job of 2 ranks (the session's shared run of MODEL_ARGS; losses within
  rel 1e-5) and print the same weight hash at every step. Beside them a lone group with
  --ft-min-replica-groups 2 waits, then stops with one line.
* A rank of group 1 is SIGKILLed mid-run: group 0 trains on alone (quorum 1 of 2, no
  restart). The restarted group 1 is killed while group 0 is inside the state transfer to it
  (the MEGATRON_FT_TEST_HOLD_SEND hook holds the sender there); group 0 trains on alone
  again. A third group 1 recovers group 0's live state, RNG included (dropout on), and both
  print the same weight and RNG hashes from then on.
(No lighthouse listening, group id >= G, G = 1, ...: parse-time one-liners, in
tests/unit_tests/training/test_fault_tolerance_arguments.py.)

Every process is started in its own session and killed in ``finally``.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side (the lighthouse in this process): no per-quorum lines
from torchft.coordination import LighthouseServer  # noqa: E402

from forked_launch import free_port  # noqa: E402
from test_pretrain_gpt import MODEL_ARGS, REPO, _env, read_metrics  # noqa: E402

HASH = re.compile(r"^ft: step (\d+), quorum (\d+) of (\d+), weights sha256 ([0-9a-f]{64})$", re.M)
RNG = re.compile(r"^ft: step (\d+), rng sha256 ([0-9a-f]{64})$", re.M)
WAITING = "ft: group 0: quorum 1 of 2, below --ft-min-replica-groups 2: waiting for more groups"
# torchft's collectives, should_commit and quorum: bounded well inside the test's waits.
FT_ENV = {"TORCHFT_TIMEOUT_SEC": "30", "TORCHFT_QUORUM_TIMEOUT_SEC": "60", "RUST_LOG": "warn"}


def _ft_flags(group, lighthouse, groups=2, min_groups=1):
    return ["--ft-replica-group-id", str(group), "--ft-num-replica-groups", str(groups),
            "--ft-min-replica-groups", str(min_groups), "--ft-lighthouse", lighthouse]


class _Jobs:
    """torchrun jobs started in their own sessions, output to files; killed on close()."""

    def __init__(self, tmp_path):
        self.tmp_path, self.procs = tmp_path, []

    def start(self, name, args, nproc, env=None):
        log = open(self.tmp_path / f"{name}.log", "w")
        # One rank: no launcher (pretrain_gpt.py runs a world of one), one interpreter less to start.
        launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                          str(nproc)]
        cmd = [sys.executable, *launcher, "pretrain_gpt.py", *args]
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env({**FT_ENV, **(env or {})}), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = self.tmp_path / f"{name}.log"
        self.procs.append(proc)
        return proc

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                # torchrun's workers run in sessions of their own: its process group is not enough.
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        with contextlib.suppress(psutil.NoSuchProcess):
                            child.kill()
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _text(proc):
    return proc.log_path.read_text()


def _wait_for(what, predicate, timeout, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        for proc in procs:  # a job that died on its own: no point waiting
            if proc.poll() is not None:
                raise AssertionError(f"{proc.log_path.name} exited ({proc.returncode}) while waiting for {what}:\n"
                                     + _text(proc)[-4000:])
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                         + "\n".join(f"--- {p.log_path.name}\n{_text(p)[-3000:]}" for p in procs))


def _hashes(proc):
    """{step: (quorum, sha256)} from the job's ``ft: step ...`` lines."""
    return {int(m[1]): (int(m[2]), m[4]) for m in HASH.finditer(_text(proc))}


def _rng_hashes(proc):
    """{step: sha256 of the group's RNG states} from the job's ``ft: step S, rng ...`` lines."""
    return {int(m[1]): m[2] for m in RNG.finditer(_text(proc))}


@pytest.fixture
def lighthouse():
    servers = []

    def start(min_replicas):
        server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000,
                                  heartbeat_timeout_ms=1500)
        servers.append(server)
        return server.address()

    yield start
    for server in servers:
        server.shutdown()


# Dropout on: the recovered group must draw its peer's masks (the RNG state moves with the
# weights; the "rng sha256" lines compare it).
LONG_RUN = MODEL_ARGS[:MODEL_ARGS.index("--train-iters")] + [
    "--train-iters", "5000", "--log-interval", "2", "--eval-iters", "0", "--hidden-dropout", "0.1",
] + MODEL_ARGS[MODEL_ARGS.index("--hidden-dropout") + 2:]


# Ranks per group in the kill test: 1 keeps its four launches affordable on 2 cores; the
# same scenario at 2 x 2 ranks (torchrun tearing down the killed rank's partner) passes
# too, in about twice the time (docs/design.md, "Fault tolerance on torchft").
KILL_TEST_RANKS = int(os.environ.get("FT_TEST_RANKS_PER_GROUP", "1"))


def _kill_worker(job):
    """SIGKILL one pretrain_gpt.py rank of a job (a torchrun tears the rest down)."""
    workers = [p for p in [psutil.Process(job.pid)] + psutil.Process(job.pid).children(recursive=True)
               if "pretrain_gpt.py" in " ".join(p.cmdline()[:3])]
    assert len(workers) == KILL_TEST_RANKS, workers
    workers[-1].send_signal(signal.SIGKILL)
    job.wait(timeout=90)


def test_killed_group_rejoins_with_live_weights(tmp_path, lighthouse):
    """SIGKILL a rank of group 1: group 0 goes on alone. The restarted group 1 is killed
    again while group 0 is inside the state transfer to it (held there by the
    MEGATRON_FT_TEST_HOLD_SEND hook): group 0 goes on alone again, its weights untouched by
    the broken transfer. A third start of group 1 receives group 0's state (weights,
    optimizer, counters, RNG) and trains in lockstep: same weight and RNG hashes, dropout on."""
    address = lighthouse(min_replicas=1)
    release = tmp_path / "release-transfer"
    jobs = _Jobs(tmp_path)
    flags = lambda g, name: (LONG_RUN + ["--use-mfsdp", "--log-dir", str(tmp_path / name)]  # noqa: E731
                             + _ft_flags(g, address))
    try:
        group0 = jobs.start("group0", flags(0, "g0"), nproc=KILL_TEST_RANKS,
                            env={"MEGATRON_FT_TEST_HOLD_SEND": str(release)})
        group1 = jobs.start("group1", flags(1, "g1"), nproc=KILL_TEST_RANKS)
        both = lambda: any(q == 2 for q, _ in _hashes(group1).values())  # noqa: E731
        _wait_for("both groups training together", both, 180, [group0, group1])

        # 1. Group 1 dies mid-run.
        killed_after, mark = max(_hashes(group0)), len(_text(group0))
        _kill_worker(group1)
        # Restarted at once: its start-up takes far longer than group 0 needs to notice.
        group1b = jobs.start("group1-restarted", flags(1, "g1b"), nproc=KILL_TEST_RANKS)
        alone = lambda: "quorum 1 of 2" in _text(group0)[mark:]  # noqa: E731
        _wait_for("group 0 to go on alone", alone, 90, [group0])
        alone_steps = lambda after: [s for s, (q, _) in _hashes(group0).items()  # noqa: E731
                                     if q == 1 and s > after]
        _wait_for("group 0 to train alone", lambda: len(alone_steps(killed_after)) >= 2, 60, [group0])

        # 2. The restarted group 1 dies while group 0 is inside the transfer to it.
        holding = lambda: "holding the state transfer" in _text(group0)  # noqa: E731
        _wait_for("group 0 to hold inside the state transfer", holding, 180, [group0, group1b])
        held_at = int(re.search(r"sending state of step (\d+)", _text(group0))[1])
        _kill_worker(group1b)
        mark = len(_text(group0))
        release.touch()  # group 0 finishes its send to a dead peer
        again_alone = lambda: "quorum 1 of 2" in _text(group0)[mark:]  # noqa: E731
        _wait_for("group 0 to go on alone after the broken transfer", again_alone, 90, [group0])
        _wait_for("group 0 to train alone again", lambda: len(alone_steps(held_at)) >= 2, 60, [group0])
        assert "recovered weights" not in _text(group1b)

        # 3. A third start of group 1 recovers (the hook holds no more).
        group1c = jobs.start("group1-third", flags(1, "g1c"), nproc=KILL_TEST_RANKS)
        _wait_for("the third group 1 to recover", lambda: "recovered weights" in _text(group1c), 180,
                  [group0, group1c])
        common = lambda: sorted(set(_rng_hashes(group0)) & set(_rng_hashes(group1c)))  # noqa: E731
        _wait_for("3 common steps after the recovery", lambda: len(common()) >= 3, 120, [group0, group1c])
        assert group0.poll() is None  # group 0 was never restarted
    finally:
        jobs.close()

    log0, log1c = _text(group0), _text(group1c)
    h0, h1c, r0, r1c = _hashes(group0), _hashes(group1c), _rng_hashes(group0), _rng_hashes(group1c)
    steps = common()
    assert all(h0[s] == h1c[s] for s in steps), {s: (h0[s], h1c[s]) for s in steps}
    assert all(h0[s][0] == 2 for s in steps)
    # Dropout masks: both groups' RNG states equal after the recovery.
    assert all(r0[s] == r1c[s] for s in steps), {s: (r0[s], r1c[s]) for s in steps}
    # The step in flight when the transfer broke was not applied (its reduction lost the peer).
    assert f"step {held_at + 1} not committed" in log0
    recovered_at = int(re.search(r"recovered .* continuing at step (\d+)", log1c)[1])
    assert recovered_at > held_at and min(h1c) > recovered_at  # it continued from group 0's step
    # Group 0 trained on through both failures: every step it logged has one hash (a step
    # not committed is run again and logged once), and its steps only go up.
    logged = [int(m[1]) for m in HASH.finditer(log0)]
    assert logged == sorted(set(logged)), logged
    print(f"\ngroup 1 killed after step {killed_after}; group 0 alone at steps {alone_steps(killed_after)[:3]}...; "
          f"group 1 restarted, killed in the transfer of step {held_at}; group 0 alone at "
          f"{alone_steps(held_at)[:3]}...; group 1 recovered at step {recovered_at}; common steps {steps}: "
          f"weight hashes equal ({h0[steps[-1]][1][:16]}...), rng hashes equal ({r0[steps[-1]][:16]}...)")
    for line in re.findall(r"^ft: group 0: .*$", log0, re.M):
        print("  group 0 |", line[:200])
    for name, job in (("group 1 (2nd)", group1b), ("group 1 (3rd)", group1c)):
        for line in re.findall(r"^ft: group 1: .*$", _text(job), re.M):
            print(f"  {name} |", line[:200])


# A stand-in for SLURM's srun on one machine (CI has no slurmd): it runs a step's tasks here,
# each with the variables srun gives it (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the step's
# id and node list), records the step's options and command line, and ends the step when a
# task fails (--kill-on-bad-exit). scontrol only has to expand the node list.
LOCAL_SRUN = r'''#!PYTHON
import fcntl, json, os, signal, subprocess, sys
args, options, procs = sys.argv[1:], {}, []
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])  # srun passes it on to the tasks
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if "=" in flag:
        flag, value = flag.split("=", 1)
    elif flag in ("--overlap",):
        value = True
    else:
        value = args.pop(0)
    options[flag] = value
with open(os.environ["LOCAL_SLURM_DIR"] + "/step_id", "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)  # steps start side by side: each its own id (and rendezvous port)
    f.seek(0)
    step = len(f.read())
    f.write(".")
with open(os.environ["LOCAL_SLURM_DIR"] + "/steps.jsonl", "a") as f:
    f.write(json.dumps({"step": step, "options": options, "command": args}) + "\n")
n = int(options.get("--ntasks", 1))
procs += [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_NTASKS": str(n),
                                     "SLURM_LOCALID": str(i), "SLURM_STEP_ID": str(step),
                                     "SLURM_STEP_NODELIST": "localhost"}) for i in range(n)]
codes = [p.wait() for p in procs]
sys.exit(max(codes, key=abs))
'''


def test_sbatch_tp_groups_train_like_one_job_and_a_lone_group_waits(tmp_path, lighthouse, mfsdp_run):
    """examples/sbatch_fault_tolerant_hsdp.sh under the local srun stand-in: a lighthouse
    step and one step per group, 2 groups x 2 tasks with TP=2 inside each (torchft's managed
    all-reduce between them), against one MFSDP job of 2 ranks (ZeRO-3, no TP), the same
    global batch: the same losses, equal weights on both groups at every step. Beside them,
    on a lighthouse of its own, a lone group with --ft-min-replica-groups 2 waits (bounded by
    the quorum timeout) instead of training alone, then stops with one line."""
    jobs = _Jobs(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(LOCAL_SRUN.replace("PYTHON", sys.executable))
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")  # show hostnames NODELIST
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    port = free_port()
    model = MODEL_ARGS[:MODEL_ARGS.index("--micro-batch-size")] + MODEL_ARGS[MODEL_ARGS.index("--lr"):]
    model = model[:model.index("--train-iters")] + model[model.index("--train-iters") + 2:]
    model += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    env = _env({**FT_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
                + os.environ["PATH"], "VIRTUAL_ENV": sys.prefix, "LOCAL_SLURM_DIR": str(tmp_path),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "localhost", "LIGHTHOUSE_PORT": str(port), "OUT": str(tmp_path / "out"),
                "MODEL_ARGS": " ".join(model), "MICRO_BATCH": "2", "GLOBAL_BATCH": "8", "TRAIN_ITERS": "10",
                "MIN_GROUPS": "2"})  # both groups from step 1 on
    try:
        alone = jobs.start("alone", MODEL_ARGS + ["--use-mfsdp"] + _ft_flags(0, lighthouse(min_replicas=1),
                                                                              min_groups=2),
                           nproc=1, env={"TORCHFT_QUORUM_TIMEOUT_SEC": "3"})  # how long it waits for a second group
        proc = subprocess.run(["bash", "examples/sbatch_fault_tolerant_hsdp.sh"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        alone.wait(timeout=120)
    finally:
        jobs.close()
    out = tmp_path / "out"
    logs = {g: (out / f"group{g}.log").read_text() for g in (0, 1) if (out / f"group{g}.log").exists()}
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n".join(v[-3000:] for v in logs.values())

    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    lighthouse_step, *groups = steps
    assert lighthouse_step["command"][0] == "torchft_lighthouse" and lighthouse_step["options"]["--nodes"] == "1"
    assert f"[::]:{port}" in lighthouse_step["command"] and "--overlap" in lighthouse_step["options"]
    group_of = lambda step: int(step["command"][step["command"].index("--ft-replica-group-id") + 1])  # noqa: E731
    groups = sorted(groups, key=group_of)  # their steps start side by side, in either order
    assert [group_of(step) for step in groups] == [0, 1]
    for g, step in enumerate(groups):
        command = step["command"]
        assert command[:2] == ["python", "pretrain_gpt.py"]
        assert command[command.index("--ft-lighthouse") + 1] == f"http://localhost:{port}"
        assert step["options"]["--relative"] == str(g) and step["options"]["--kill-on-bad-exit"] == "1"
        assert step["options"]["--ntasks"] == "2"

    reference, _ = read_metrics(str(mfsdp_run[0] / "logs"))
    curves = [read_metrics(str(out / "logs" / f"group{g}"))[0] for g in (0, 1)]
    worst = 0.0
    for it in sorted(reference):
        # Each group logs the mean loss of its half of the global batch.
        mean = (curves[0][it]["lm_loss"] + curves[1][it]["lm_loss"]) / 2
        assert mean == pytest.approx(reference[it]["lm_loss"], rel=1e-5), it
        worst = max(worst, abs(mean - reference[it]["lm_loss"]) / reference[it]["lm_loss"])
        assert curves[0][it]["learning_rate"] == reference[it]["learning_rate"]
    hashes = [{int(m[1]): (int(m[2]), m[4]) for m in HASH.finditer(logs[g])} for g in (0, 1)]
    assert sorted(hashes[0]) == list(range(1, 11))
    assert hashes[0] == hashes[1]  # quorum 2 of 2 and bitwise equal weights at every step
    assert all(q == 2 for q, _ in hashes[0].values())
    print(f"\nsbatch script: lighthouse step {' '.join(lighthouse_step['command'][:3])}..., group steps "
          f"--relative 0 and 1 (2 tasks, TP=2 each); loss parity with one 2-rank job over {len(reference)} "
          f"iterations: max rel {worst:.2e}; step 10 hash {hashes[0][10][1][:16]}... on both groups")

    text = _text(alone)
    assert alone.returncode != 0
    assert WAITING in text
    errors = [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "only 1 of the 2 replica groups" in errors[0], text[-3000:]
    assert "iteration        1/" not in text  # no step was trained alone
    print("lone group with K=2:\n  " + WAITING + "\n  " + errors[0])
