"""Under torchrun a rank other than 0 that hits a user error waits for rank 0 to print the
line (a key in torchrun's store) and prints it itself only when rank 0 never does."""

import datetime
import socket

import torch.distributed as dist

from megatron.training import user_errors
from megatron.training.initialize import DistributedEnv


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_other_ranks_wait_for_rank_0_then_give_up(monkeypatch):
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(user_errors, "WAIT_FOR_RANK_0_S", 0.5)
    launch = DistributedEnv(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=port,
                            launcher="torchrun")
    assert user_errors._wait_for_rank_0(launch) is False  # rank 0 never printed: this rank prints
    user_errors._tell_other_ranks(launch)
    assert user_errors._wait_for_rank_0(launch) is True
    assert master.get(user_errors._store_key()) == b"1"
    # Not torchrun's store (srun): nothing to wait on, rank 0 is not killed and prints.
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert user_errors._wait_for_rank_0(launch) is True
