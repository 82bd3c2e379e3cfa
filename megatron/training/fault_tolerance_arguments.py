"""The fault-tolerance flags: HSDP whose replica groups are separate jobs joined by torchft.

Semantics are torchtitan's fault tolerance (``--fault_tolerance.*``), with Megatron-style
names. One replica group is one torchrun job: its ranks form the group's own mesh
(``--use-mfsdp``, any sharding strategy inside), and the replica (outer) dimension of HSDP
is torchft's: a lighthouse keeps the quorum, a Manager reduces the gradients over the live
groups and moves state to a group that (re)joins (``fault_tolerance.py``).

Inside a group: MFSDP (any strategy) and tensor parallelism (with or without sequence
parallelism). Group rank r meets group rank r of the other groups on torchft's managed group,
so each TP coordinate's shards are reduced with the same coordinate's shards elsewhere: the
replica reduction is the plain HSDP one, unchanged by TP. PP, CP and EP are refused for now
(their meshes and schedules are not wired to the managed reduction and recovery).

``--global-batch-size`` is the batch of all G groups together (as if the G groups were one
HSDP job of G x group-size ranks): each group takes its 1/G of it.
"""

from __future__ import annotations

import argparse
import os
import socket
from urllib.parse import urlparse

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance (torchft replica groups)")
    g.add_argument("--ft-replica-group-id", type=int, default=None, metavar="R",
                   help="this job's replica group, 0..G-1 (turns fault tolerance on; needs --use-mfsdp and torchft: "
                        "pip install .[ft])")
    g.add_argument("--ft-num-replica-groups", type=int, default=None, metavar="G",
                   help="how many replica groups the job has (>= 2); each reads 1/G of every global batch")
    g.add_argument("--ft-min-replica-groups", type=int, default=1, metavar="K",
                   help="a step commits only with at least K live groups (default 1: a lone survivor trains on)")
    g.add_argument("--ft-lighthouse", default=None, metavar="URL",
                   help=f"the torchft lighthouse, e.g. http://host:29510 (default: ${LIGHTHOUSE_ENV})")


def fault_tolerance_enabled(args: argparse.Namespace) -> bool:
    return (getattr(args, "ft_replica_group_id", None) is not None
            or getattr(args, "ft_num_replica_groups", None) is not None)


def replica_groups(args: argparse.Namespace) -> int:
    """G with the fault-tolerance flags, else 1 (the batch arithmetic's factor)."""
    return args.ft_num_replica_groups if fault_tolerance_enabled(args) else 1


def validate_fault_tolerance_args(args: argparse.Namespace, note=print) -> None:
    """Parse-time checks (run before the batch arithmetic, which reads G). ``note`` prints
    one line (the parser's rank-0 note)."""
    if not fault_tolerance_enabled(args):
        if args.ft_lighthouse is not None or args.ft_min_replica_groups != 1:
            raise ValueError("--ft-lighthouse / --ft-min-replica-groups need --ft-replica-group-id and "
                             "--ft-num-replica-groups; add them or drop the ft flags.")
        return
    r, g, k = args.ft_replica_group_id, args.ft_num_replica_groups, args.ft_min_replica_groups
    if r is None or g is None:
        raise ValueError("fault tolerance needs both --ft-replica-group-id R and --ft-num-replica-groups G.")
    if g < 2:
        raise ValueError(f"--ft-num-replica-groups must be at least 2 (got {g}); one group is a plain job: "
                         "drop the ft flags.")
    if not 0 <= r < g:
        raise ValueError(f"--ft-replica-group-id must be in 0..{g - 1} for --ft-num-replica-groups {g} (got {r}).")
    if not 1 <= k <= g:
        raise ValueError(f"--ft-min-replica-groups must be in 1..{g} (got {k}).")
    if not args.use_mfsdp:
        raise ValueError("the ft flags run HSDP over replica groups on MFSDP; add --use-mfsdp.")
    refused = [(args.num_distributed_optimizer_instances != 1, "--num-distributed-optimizer-instances",
                "the replica groups are the outer HSDP dimension"),
               (args.pipeline_model_parallel_size != 1, "--pipeline-model-parallel-size", "not yet supported"),
               (args.context_parallel_size != 1, "--context-parallel-size", "not yet supported"),
               (bool(getattr(args, "num_experts", None)), "--num-experts", "not yet supported"),
               (getattr(args, "rampup_batch_size", None) is not None, "--rampup-batch-size", "not yet supported"),
               (getattr(args, "rerun_mode", "disabled") == "report_stats", "--rerun-mode", "not yet supported"),
               (bool(getattr(args, "fp16", False)), "--fp16", "not yet supported (use --bf16)")]
    for bad, flag, why in refused:
        if bad:
            raise ValueError(f"{flag} cannot be combined with the ft flags ({why}); run data parallel (MFSDP, "
                             "any --data-parallel-sharding-strategy) and tensor parallel inside each replica group.")
    if getattr(args, "rerun_mode", "disabled") == "validate_results":
        # The default: a re-run of a step is not built across replica groups (a NaN/Inf step is skipped).
        args.rerun_mode = "disabled"
        note("--rerun-mode validate_results is not built for the ft flags' replica groups: --rerun-mode disabled.")
    # Every group is its own job with the same command line: each keeps its checkpoints in a
    # directory of its own, or two groups would write the same files.
    for flag in ("save", "load"):
        path = getattr(args, flag, None)
        if path:
            setattr(args, flag, os.path.join(path, f"replica_group_{r}"))
            note(f"--{flag} {path}: replica group {r} uses {getattr(args, flag)} (one directory per group).")
    url = args.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not url:
        raise ValueError(f"no torchft lighthouse: pass --ft-lighthouse http://HOST:PORT or set ${LIGHTHOUSE_ENV} "
                         "(start one with: torchft_lighthouse --bind [::]:29510 --min_replicas 1).")
    args.ft_lighthouse = url
    _check_reachable(url)


def _check_reachable(url: str) -> None:
    """A lighthouse that is not listening fails here, in one line, not after a quorum timeout."""
    parsed = urlparse(url if "://" in url else "http://" + url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"--ft-lighthouse {url!r} is not http://HOST:PORT.")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=5).close()
    except OSError as error:
        raise ValueError(f"the torchft lighthouse {url} is not reachable ({error.strerror or error}); start it "
                         f"first (torchft_lighthouse --bind [::]:{parsed.port} --min_replicas 1) or fix the URL.") \
            from None
