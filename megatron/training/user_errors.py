"""How a user error ends a run: one line from rank 0 (``prog: error: message``) and a
non-zero exit on every rank, without a traceback per rank or torchrun's dump.
MEGATRON_DEBUG_TRACEBACK=1 brings the tracebacks back.

Under torchrun the first rank to exit makes torchrun kill the others, so a rank that
reaches the error before rank 0 must not exit first: it waits until rank 0 says, through
torchrun's store, that it has printed the line (then exits silently), or, if rank 0
never gets there (an error on this rank only), prints the line itself after
``WAIT_FOR_RANK_0_S``.

Imports only what parsing needs, so an error in the command line is reported before the
engine and its dependencies load.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import time
import traceback

import torch.distributed as dist

from megatron.training.initialize import get_distributed_env
from megatron.training.shutdown import leave


class UserError(Exception):
    """A problem with the command line or the files it names (not a bug): reported as one
    line from rank 0 and a non-zero exit, without a traceback."""


# What a bad data path, tokenizer, checkpoint or save path raises in the stages that read them.
_USER_ERROR_TYPES = (ValueError, OSError, RuntimeError, ImportError)
# How long a non-zero rank waits for rank 0's line before printing its own.
WAIT_FOR_RANK_0_S = 30.0


@contextlib.contextmanager
def user_errors(stage: str):
    """Turn what a stage raises on bad input into :class:`UserError`, naming the stage."""
    try:
        yield
    except UserError:
        raise
    except _USER_ERROR_TYPES as e:
        raise UserError(f"{stage}: {e}") from e


def report_user_error(message: str, exit_code: int, error: BaseException) -> None:
    """Rank 0 prints ``prog: error: message``; every rank exits with ``exit_code``
    (under torchrun the others only after rank 0 printed: see the module docstring).
    MEGATRON_DEBUG_TRACEBACK=1 adds the traceback on every rank."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain_gpt.py"
    launch = _launch_env()
    rank = dist.get_rank() if dist.is_initialized() else (launch.rank if launch else 0)
    debug = os.environ.get("MEGATRON_DEBUG_TRACEBACK", "0") not in ("", "0")
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    line = f"{prog}: error: {message}"
    if rank == 0 or debug:
        print(line, file=sys.stderr, flush=True)
        if rank == 0:
            _tell_other_ranks(launch)
    elif not _wait_for_rank_0(launch):
        print(f"{line} (rank {rank}; rank 0 did not report it)", file=sys.stderr, flush=True)
    _write_torchelastic_error_file(message)
    if dist.is_initialized():
        dist.destroy_process_group()
    # Not sys.exit in a multi-rank launch: at interpreter teardown a DDP reducer frees its
    # gloo group, which joins its worker threads holding the GIL while a worker releasing
    # a finished all-gather waits for the GIL; that rank then hangs forever (seen 1 run in
    # 5). shutdown.py has the other half of the story.
    leave(exit_code)


def _store_key() -> str:
    # One key per torchrun restart: the agent's store outlives the workers.
    return f"megatron/user_error_printed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _agent_store(launch, timeout_s: float):
    """A client of torchrun's own store (it outlives every worker), or None when this is
    not a multi-rank torchrun launch (srun does not kill the other tasks by default)."""
    if launch is None or launch.world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _tell_other_ranks(launch) -> None:
    """Rank 0, after printing: the waiting ranks may exit now."""
    try:
        store = _agent_store(launch, 5.0)
        if store is not None:
            store.set(_store_key(), "1")
    except Exception:  # noqa: BLE001 - the line is printed; the others print theirs after the wait
        pass


def _wait_for_rank_0(launch) -> bool:
    """True once rank 0 has printed (or when there is nothing to wait on); False after
    WAIT_FOR_RANK_0_S. torchrun's SIGTERM (sent when rank 0 exits) ends this process
    meanwhile, with the default handler even if --exit-signal-handler installed one."""
    start = time.monotonic()
    try:
        store = _agent_store(launch, WAIT_FOR_RANK_0_S)
        if store is None:
            return True  # srun: rank 0 is not killed when this rank exits, and prints
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        remaining = max(0.1, WAIT_FOR_RANK_0_S - (time.monotonic() - start))
        store.wait([_store_key()], datetime.timedelta(seconds=remaining))
        return True
    except Exception:  # noqa: BLE001 - timeout or store gone: print the line here
        return False


def _launch_env():
    """torchrun's or SLURM's rank and world size, or None when they are unreadable."""
    try:
        return get_distributed_env()
    except ValueError:
        return None


def _write_torchelastic_error_file(message: str) -> None:
    # torchrun names this worker's failure with the file's message instead of "<N/A>".
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return

    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass
