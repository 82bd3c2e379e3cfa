"""Leaving a distributed run in order, every time.

At the end of training, in this order: wait for the work still in flight (the
asynchronous checkpoint write, and join the thread that runs it), pass one barrier on
every rank, forget the process groups the trainer holds, destroy the process groups.
Then the script leaves with :func:`leave` once its output is flushed.

Why the last step skips the interpreter's teardown in a multi-rank launch:
``destroy_process_group`` unregisters a gloo group but joins its worker threads only when
the last Python reference to the group goes, and whatever still holds the model at exit
(the caller's frames, reference cycles the garbage collector has not reached yet) holds
its mesh's groups. Those worker threads can live into interpreter finalization. One that releases a
finished collective late (descheduled on a loaded machine) drops a tensor whose Python
object it owns, which needs the GIL; a thread that asks for the GIL while the interpreter
finalizes is ended with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor
calls ``std::terminate``: "terminate called without an active exception", SIGABRT, after
the run had trained and saved. Nothing is left to tear down by then, so ``os._exit``
after flushing loses nothing and leaves no thread racing the teardown.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.initialize import get_distributed_env


def shutdown_distributed(barrier: bool) -> None:
    """Wait for the asynchronous save and its thread, then (``barrier``: only when every
    rank got here, i.e. not while an error unwinds) pass a barrier on every rank, release
    the trainer's groups and destroy the process groups."""
    # Import cost: checkpointing loads torch.distributed.checkpoint; only a run that got this far needs it.
    from megatron.training.checkpointing import finalize_async_save, release_async_save_group

    try:
        finalize_async_save()
    except BaseException:
        barrier = False  # the other ranks may not get to it
        raise
    finally:
        # After the write: its commit talks on the group.
        release_async_save_group()
        if barrier and dist.is_initialized():
            # No rank destroys its groups while another still talks on them.
            dist.barrier()
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_ranks() -> int:
    """The number of ranks of this launch (torchrun's or SLURM's environment), 1 if unreadable."""
    try:
        return get_distributed_env().world_size
    except ValueError:
        return 1


def leave(exit_code: int) -> None:
    """End the process with ``exit_code``: flush, then in a multi-rank launch ``os._exit``
    (see the module docstring), else ``sys.exit``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if launched_ranks() > 1:
        os._exit(exit_code)
    sys.exit(exit_code)
