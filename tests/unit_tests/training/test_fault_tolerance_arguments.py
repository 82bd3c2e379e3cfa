"""The --ft-* flags (fault_tolerance_arguments.py): parse-time checks, each one line, and the
batch arithmetic over G replica groups. A real socket plays the lighthouse's port."""

import socket

import pytest

from megatron.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --use-mfsdp")


@pytest.fixture(scope="module")
def listening():
    """An address something listens on (the reachability check only connects)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def parse(extra, world_size=2, base=BASE):
    return parse_args((base + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_batch_spans_all_groups(listening):
    args = parse(f"--ft-replica-group-id 1 --ft-num-replica-groups 2 --ft-lighthouse {listening} "
                 "--global-batch-size 16")
    # 16 samples = 2 groups x 2 ranks x micro-batch 2 x 2 microbatches.
    assert args.num_microbatches == 2 and args.data_parallel_size == 2
    assert parse(f"--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-lighthouse {listening}"
                 ).global_batch_size == 8


def test_tensor_parallel_inside_a_group(listening):
    """TP composes: each group is TP=2 x DP, the batch still spans the G groups."""
    args = parse(f"--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-lighthouse {listening} "
                 "--tensor-model-parallel-size 2 --sequence-parallel", world_size=4)
    assert args.data_parallel_size == 2 and args.global_batch_size == 8


def test_lighthouse_from_environment(listening, monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", listening)
    assert parse("--ft-replica-group-id 0 --ft-num-replica-groups 3").ft_lighthouse == listening


BAD = {
    "group id >= G": ("--ft-replica-group-id 2 --ft-num-replica-groups 2", "must be in 0..1"),
    "G = 1": ("--ft-replica-group-id 0 --ft-num-replica-groups 1", "at least 2"),
    "K > G": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-min-replica-groups 3", "in 1..2"),
    "no group id": ("--ft-num-replica-groups 2", "needs both"),
    "lighthouse alone": ("--ft-min-replica-groups 2", "need --ft-replica-group-id"),
    "HSDP instances": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --num-distributed-optimizer-instances 2",
                       "the replica groups are the outer HSDP dimension"),
    "pipeline parallel": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --pipeline-model-parallel-size 2",
                          "--pipeline-model-parallel-size cannot be combined"),
    "context parallel": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --context-parallel-size 2",
                         "--context-parallel-size cannot be combined"),
    "report_stats": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --rerun-mode report_stats",
                     "--rerun-mode cannot be combined"),
    "batch": ("--ft-replica-group-id 0 --ft-num-replica-groups 2 --global-batch-size 6",
              "x --ft-num-replica-groups (2) = 8"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(case, listening):
    extra, message = BAD[case]
    with pytest.raises(ValueError) as error:
        parse(extra + f" --ft-lighthouse {listening}")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_default_rerun_mode_is_turned_off_with_a_note(listening, capsys):
    args = parse(f"--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-lighthouse {listening}")
    assert args.rerun_mode == "disabled"
    assert "--rerun-mode validate_results is not built for the ft flags' replica groups" in capsys.readouterr().out


def test_needs_mfsdp(listening):
    with pytest.raises(ValueError, match="add --use-mfsdp"):
        parse(f"--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-lighthouse {listening}",
              base=BASE.replace(" --use-mfsdp", ""))


def test_needs_a_lighthouse(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="no torchft lighthouse: pass --ft-lighthouse"):
        parse("--ft-replica-group-id 0 --ft-num-replica-groups 2")
    with pytest.raises(ValueError, match="is not reachable"):
        parse("--ft-replica-group-id 0 --ft-num-replica-groups 2 --ft-lighthouse http://127.0.0.1:9")


def test_each_group_checkpoints_in_its_own_directory(listening, tmp_path):
    args = parse(f"--ft-replica-group-id 1 --ft-num-replica-groups 2 --ft-lighthouse {listening} "
                 f"--save {tmp_path} --load {tmp_path}")
    assert args.save == args.load == str(tmp_path / "replica_group_1")
