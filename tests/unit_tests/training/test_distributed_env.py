"""Distributed environment detection: torchrun, SLURM (srun without a launcher), or none."""

import pytest

from megatron.training.initialize import (
    check_rendezvous_host,
    expand_slurm_nodelist,
    get_distributed_env,
    local_gpu_index,
    slurm_rendezvous_port,
)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("gpu[098-101],login1", ["gpu098", "gpu099", "gpu100", "gpu101", "login1"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1],b[08-09],c", ["a1", "b08", "b09", "c"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node]01[", "node[a-b]", "node[4-1]", ""])
def test_bad_nodelists_raise(bad):
    with pytest.raises(ValueError):
        expand_slurm_nodelist(bad)


def test_slurm_environment():
    env = get_distributed_env({
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu-[07-10]", "SLURM_JOB_ID": "123456",
    })
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "slurm")
    assert env.master_addr == "gpu-07"
    assert env.master_port == slurm_rendezvous_port(123456, 0)


def test_slurm_step_nodelist_and_port_per_step():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "777",
            "SLURM_JOB_NODELIST": "node[01-03,07]"}
    # A step on part of the allocation rendezvouses on its own first node.
    step = get_distributed_env({**base, "SLURM_STEP_NODELIST": "node[03,07]", "SLURM_STEP_ID": "1"})
    assert step.master_addr == "node03"
    assert get_distributed_env(base).master_addr == "node01"
    assert get_distributed_env({**base, "SLURM_STEP_NODELIST": "rack2-n[7-8]"}).master_addr == "rack2-n7"
    # Every step of a job, and neighbouring jobs' steps, get distinct ports in range.
    ports = {get_distributed_env({**base, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(sid)}).master_port
             for job in range(777, 787) for sid in range(50)}
    assert len(ports) == 500 and all(20000 <= p < 40000 for p in ports)
    assert step.master_port != get_distributed_env({**base, "SLURM_STEP_ID": "0"}).master_port
    # The batch step's huge id still maps into the range.
    assert 20000 <= slurm_rendezvous_port(777, 4294967294) < 40000


def test_unresolvable_rendezvous_host_fails_fast():
    import time

    start = time.time()
    with pytest.raises(ValueError, match="does not resolve .*set MASTER_ADDR"):
        check_rendezvous_host("no-such-host.invalid")
    assert time.time() - start < 10
    check_rendezvous_host("127.0.0.1")


def test_slurm_respects_explicit_master_and_old_nodelist_name():
    env = get_distributed_env({
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "x[1-2]",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
    })
    assert (env.master_addr, env.master_port, env.local_rank) == ("10.0.0.1", 1234, 0)


def test_torchrun_wins_over_slurm():
    env = get_distributed_env({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "29400",
        "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1",
    })
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 4, 3, "torchrun")
    assert (env.master_addr, env.master_port) == ("h", 29400)


def test_no_launcher_is_a_world_of_one():
    env = get_distributed_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}, "SLURM_PROCID"),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}, "inconsistent"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "inconsistent"),
    ],
)
def test_bad_environments_raise(environ, match):
    with pytest.raises(ValueError, match=match):
        get_distributed_env(environ)


def test_gpu_binding_per_task_or_per_node():
    assert local_gpu_index(3, 8) == 3  # all GPUs of the node visible: pick by local rank
    assert local_gpu_index(3, 1) == 0  # srun --gpus-per-task=1: the task's one GPU
    with pytest.raises(RuntimeError, match="gpus-per-task"):
        local_gpu_index(3, 2)
