"""--context-parallel-size, --cp-comm-type and --hierarchical-context-parallel-sizes: what
they set, and a one-line ValueError that says what to change for each bad combination."""

import pytest

from megatron.training.arguments import parse_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128"
)


def parse(extra="", world_size=1):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_defaults_and_data_parallel_size():
    args = parse()
    assert args.context_parallel_size == 1 and args.cp_comm_type == ["p2p"]
    assert args.hierarchical_context_parallel_sizes is None
    args = parse("--context-parallel-size 2 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                 world_size=16)
    assert args.data_parallel_size == 2  # 16 / (tp 2 x pp 2 x cp 2)
    assert args.global_batch_size == 4  # micro-batch 2 x DP 2: CP ranks share samples
    args = parse("--context-parallel-size 4 --cp-comm-type a2a+p2p all_gather "
                 "--hierarchical-context-parallel-sizes 2 2", world_size=4)
    assert args.cp_comm_type == ["a2a+p2p", "all_gather"] and args.hierarchical_context_parallel_sizes == [2, 2]
    assert parse("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes [2 2]",
                 world_size=4).hierarchical_context_parallel_sizes == [2, 2]  # a spelling of upstream's configs
    # Upstream command lines name a type at CP size 1: accepted (nothing to exchange).
    assert parse("--cp-comm-type a2a").cp_comm_type == ["a2a"]


ERRORS = {
    "size below 1": ("--context-parallel-size 0", 1, r"--context-parallel-size must be at least 1, got 0\."),
    "world": ("--context-parallel-size 2 --tensor-model-parallel-size 2", 2,
              r"--tensor-model-parallel-size \(2\) x --pipeline-model-parallel-size \(1\) x --context-parallel-size "
              r"\(2\) must divide the world size \(2\); launch a multiple of 4 ranks"),
    "seq length": ("--context-parallel-size 4 --seq-length 36 --max-position-embeddings 64", 4,
                   r"--seq-length \(36\) must be divisible by 2 x --context-parallel-size = 8; use --seq-length 40\."),
    "seq length under sp": ("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
                            "--seq-length 36 --max-position-embeddings 64", 4,
                            r"--seq-length \(36\) must be divisible by 2 x --context-parallel-size x "
                            r"--tensor-model-parallel-size \(sequence parallel\) = 8; use --seq-length 40\."),
    "unknown type": ("--context-parallel-size 2 --cp-comm-type ring", 2,
                     r"--cp-comm-type 'ring' is not supported; use one of p2p, all_gather, a2a, a2a\+p2p\."),
    "types per layer": ("--context-parallel-size 2 --cp-comm-type p2p a2a all_gather", 2,
                        r"--cp-comm-type lists 3 types for 2 layers; give one type for all layers or one per layer\."),
    "a2a heads": ("--context-parallel-size 4 --num-query-groups 2 --cp-comm-type a2a", 4,
                  r"--cp-comm-type a2a scatters heads over 4 ranks: attention heads \(4\) and query groups \(2\) per "
                  r"TP rank must be divisible by 4; use p2p or all_gather\."),
    "a2a+p2p heads": ("--context-parallel-size 4 --num-query-groups 1 --cp-comm-type a2a+p2p "
                      "--hierarchical-context-parallel-sizes 2 2", 4,
                      r"--cp-comm-type a2a\+p2p scatters heads over 2 ranks: attention heads \(4\) and query groups "
                      r"\(1\)"),
    "a2a+p2p without sizes": ("--context-parallel-size 2 --cp-comm-type a2a+p2p", 2,
                              r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A P"),
    "hierarchical product": ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
                             "2 1", 4,
                             r"--hierarchical-context-parallel-sizes 2 1 must be two sizes \(a2a, p2p\) whose "
                             r"product is --context-parallel-size \(4\), e\.g\. --hierarchical-context-parallel-sizes 4 1\."),
    "hierarchical levels": ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 4", 4,
                            r"--hierarchical-context-parallel-sizes 4 must be two sizes"),
    "moe capacity": ("--context-parallel-size 2 --num-experts 4 --moe-expert-capacity-factor 1", 2,
                     r"--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported: each CP rank "
                     r"routes its own chunks, so capacity would be per chunk; drop the capacity factor"),
    "moe ep": ("--context-parallel-size 2 --num-experts 4 --expert-model-parallel-size 4 --use-mfsdp", 2,
               r"--expert-model-parallel-size \(4\) must divide the data-parallel size \(2 = data-parallel size 1 x "
               r"--context-parallel-size 2\); use a divisor of 2\."),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_context_parallel_parse_errors(case):
    extra, world_size, message = ERRORS[case]
    with pytest.raises(ValueError, match=message) as info:
        parse(extra, world_size=world_size)
    assert "\n" not in str(info.value)  # one line


def test_moe_with_context_parallel_is_accepted():
    # EP spans the DP x CP ranks: EP=4 at CP=2 x DP=2.
    args = parse("--context-parallel-size 2 --num-experts 4 --expert-model-parallel-size 4 --use-mfsdp", world_size=4)
    assert (args.context_parallel_size, args.data_parallel_size, args.expert_model_parallel_size) == (2, 2, 4)


def test_flags_are_no_longer_rejected():
    from megatron.training.megatron_compat import REJECTED

    for flag in ("--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes"):
        assert flag not in REJECTED
