"""--reset-position-ids, --reset-attention-mask (and --eod-mask-loss): parsed, and refused
with one line where they cannot hold (the gated delta net's recurrence crosses documents)."""

import pytest

from megatron.training.arguments import parse_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128"
)


def parse(extra="", world_size=1):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_flags_parse_under_every_cp_type():
    args = parse()
    assert not (args.reset_position_ids or args.reset_attention_mask or args.eod_mask_loss)
    for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        hierarchy = " --hierarchical-context-parallel-sizes 2 1" if comm_type == "a2a+p2p" else ""
        args = parse(f"--reset-position-ids --reset-attention-mask --eod-mask-loss --context-parallel-size 2 "
                     f"--cp-comm-type {comm_type}{hierarchy}", world_size=2)
        assert args.reset_position_ids and args.reset_attention_mask and args.eod_mask_loss


def test_gated_delta_net_is_refused():
    with pytest.raises(ValueError, match=r"--reset-attention-mask is not supported with "
                                         r"--experimental-attention-variant gdn"):
        parse("--reset-attention-mask --experimental-attention-variant gdn --linear-attention-freq 2 --swiglu "
              "--linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 2 "
              "--linear-num-value-heads 4")
    # Position ids alone are fine: the recurrence does not read them.
    parse("--reset-position-ids --experimental-attention-variant gdn --linear-attention-freq 2 --swiglu "
          "--linear-key-head-dim 16 --linear-value-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4")
