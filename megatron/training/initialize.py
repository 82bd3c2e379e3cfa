"""Distributed initialization from torchrun's or SLURM's environment, and seeding.

Precedence: torchrun's variables (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT``) win, because ``srun torchrun ...`` sets both and torchrun's are the ones
that describe this process. Otherwise SLURM's (``SLURM_PROCID``/``SLURM_NTASKS``/
``SLURM_LOCALID``), so that ``srun python pretrain_gpt.py ...`` works without a launcher.
Under SLURM the rendezvous host is the first node of the job *step*
(``SLURM_STEP_NODELIST``, else the job's node list): a step may run on part of the
allocation. The port is derived from the job id and the step id, so that two steps of one
allocation (or two jobs sharing a node) do not collide. With neither, a world of one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import re
import socket
from typing import List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def _split_top_level(text: str, sep: str = ",") -> List[str]:
    """Split on ``sep`` outside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_ranges(spec: str, nodelist: str) -> List[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] keeping zero padding."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"cannot parse range {item!r} in SLURM node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        width = len(lo)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in SLURM node list {nodelist!r}")
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str, nodelist: str) -> List[str]:
    # Handles several bracket groups in one name, e.g. 'rack[1-2]-gpu[01-02]'.
    start = pattern.find("[")
    if start < 0:
        return [pattern]
    end = pattern.index("]", start)
    prefix, spec, rest = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    tails = _expand_host(rest, nodelist)
    return [prefix + n + t for n in _expand_ranges(spec, nodelist) for t in tails]


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand SLURM's compressed host list ('node[01-04],login1') into host names."""
    hosts: List[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(part, nodelist))
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _int_env(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; unset or fix it.") from None


def get_distributed_env(environ: Optional[Mapping[str, str]] = None) -> DistributedEnv:
    """Rank, world size and rendezvous address of this process, from its environment."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = DistributedEnv(
            rank=_int_env(environ, "RANK"),
            world_size=_int_env(environ, "WORLD_SIZE"),
            local_rank=_int_env(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_MASTER_PORT,
            launcher="torchrun",
        )
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                    or environ.get("SLURM_NODELIST"))
        if "MASTER_ADDR" in environ:
            master_addr = environ["MASTER_ADDR"]
        elif nodelist:
            master_addr = expand_slurm_nodelist(nodelist)[0]
        else:
            raise ValueError(
                "running under SLURM (SLURM_PROCID is set) but SLURM_JOB_NODELIST is not; "
                "launch with srun inside an allocation, or set MASTER_ADDR."
            )
        if "MASTER_PORT" in environ:
            master_port = _int_env(environ, "MASTER_PORT")
        elif "SLURM_JOB_ID" in environ:
            master_port = slurm_rendezvous_port(
                _int_env(environ, "SLURM_JOB_ID"),
                _int_env(environ, "SLURM_STEP_ID") if environ.get("SLURM_STEP_ID", "").isdigit() else 0,
            )
        else:
            master_port = DEFAULT_MASTER_PORT
        env = DistributedEnv(
            rank=_int_env(environ, "SLURM_PROCID"),
            world_size=_int_env(environ, "SLURM_NTASKS"),
            local_rank=_int_env(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
            master_addr=master_addr,
            master_port=master_port,
            launcher="slurm",
        )
    else:
        return DistributedEnv(0, 1, 0, "127.0.0.1", DEFAULT_MASTER_PORT, "single")

    if env.world_size < 1 or not 0 <= env.rank < env.world_size or env.local_rank < 0:
        raise ValueError(
            f"inconsistent {env.launcher} environment: rank {env.rank}, world size "
            f"{env.world_size}, local rank {env.local_rank}; launch through torchrun or srun."
        )
    return env


SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 20000  # ports 20000..39999: below the usual ephemeral range (32768+ is shared, but rarely full)


def slurm_rendezvous_port(job_id: int, step_id: int) -> int:
    """A port per (job, step): consecutive steps of one job get consecutive ports, and
    jobs are spread over the range by a multiplier coprime to it."""
    return SLURM_PORT_BASE + (job_id * 1009 + step_id) % SLURM_PORT_RANGE


def check_rendezvous_host(host: str) -> None:
    """Fail in seconds when the rendezvous host does not resolve (instead of a TCP store
    retrying until the distributed timeout)."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(
            f"the rendezvous host {host!r} (MASTER_ADDR, or the first node of the SLURM step) does not "
            f"resolve ({e}); set MASTER_ADDR to a reachable host name or address."
        ) from None


def set_deterministic_mode() -> None:
    """``--deterministic-mode``: deterministic torch algorithms (an op without a
    deterministic implementation raises) and cuBLAS's fixed workspace, set before CUDA
    starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def initialize_distributed(
    backend: str,
    timeout_minutes: float = 10.0,
    env: Optional[DistributedEnv] = None,
) -> torch.device:
    """Create the default process group (if none exists) and return this rank's device."""
    env = env or get_distributed_env()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; use --distributed-backend gloo on CPU.")
        device = torch.device("cuda", local_gpu_index(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise RuntimeError(
                f"a process group of {dist.get_world_size()} ranks already exists but the "
                f"environment says {env.world_size}; destroy it first."
            )
        return device

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if env.launcher == "single":
        # A world of one needs no rendezvous (and no free port).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        check_rendezvous_host(env.master_addr)
        # Keep the env in sync for libraries that read it (DCP, W&B, user code).
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend,
            init_method=f"tcp://{_format_host(env.master_addr)}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            **kwargs,
        )
    return device


def local_gpu_index(local_rank: int, visible_gpus: int) -> int:
    """The GPU of this process: its local rank, or the only visible one when the launcher
    binds one GPU per task (``srun --gpus-per-task=1`` sets CUDA_VISIBLE_DEVICES per task)."""
    if local_rank < visible_gpus:
        return local_rank
    if visible_gpus == 1:
        return 0
    raise RuntimeError(
        f"local rank {local_rank} has no GPU (this process sees {visible_gpus}); "
        "start one process per GPU (torchrun --nproc-per-node / srun --ntasks-per-node), "
        "or bind one GPU per task (srun --gpus-per-task=1)."
    )


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def set_random_seed(seed: int) -> None:
    """Same seed on every data-parallel rank (as in Megatron without TP/PP): dropout masks
    may coincide across ranks, the data does not."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
