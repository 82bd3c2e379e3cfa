"""How a user error ends a run: one line from rank 0 (``prog: error: message``) and a
non-zero exit on every rank, without a traceback per rank or torchrun's dump.
MEGATRON_DEBUG_TRACEBACK=1 brings the tracebacks back.

Imports only what parsing needs, so an error in the command line is reported before the
engine and its dependencies load.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch.distributed as dist


class UserError(Exception):
    """A problem with the command line or the files it names (not a bug): reported as one
    line from rank 0 and a non-zero exit, without a traceback."""


# What a bad data path, tokenizer, checkpoint or save path raises in the stages that read them.
_USER_ERROR_TYPES = (ValueError, OSError, RuntimeError, ImportError)


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
    """Rank 0 prints ``prog: error: message``; every rank exits with ``exit_code``.
    MEGATRON_DEBUG_TRACEBACK=1 adds the traceback on every rank."""
    import traceback

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain_gpt.py"
    launch = _launch_env()
    rank = dist.get_rank() if dist.is_initialized() else (launch.rank if launch else 0)
    debug = os.environ.get("MEGATRON_DEBUG_TRACEBACK", "0") not in ("", "0")
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    if rank == 0 or debug:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    _write_torchelastic_error_file(message)
    if dist.is_initialized():
        dist.destroy_process_group()
    if launch is not None and launch.world_size > 1:
        # Not sys.exit: at interpreter teardown a DDP reducer frees its gloo group, which
        # joins its worker threads holding the GIL while a worker releasing a finished
        # all-gather waits for the GIL; that rank then hangs forever (seen 1 run in 5).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)


def _launch_env():
    """torchrun's or SLURM's rank and world size, or None when they are unreadable."""
    from megatron.training.initialize import get_distributed_env

    try:
        return get_distributed_env()
    except ValueError:
        return None


def _write_torchelastic_error_file(message: str) -> None:
    # torchrun names this worker's failure with the file's message instead of "<N/A>".
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass
