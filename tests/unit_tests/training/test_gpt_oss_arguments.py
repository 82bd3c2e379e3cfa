"""GPT-OSS's flags (training/gpt_oss_arguments.py and the GPT-OSS launch line's other flags):
upstream's names reaching the model config and the built layers, parse-time rejections in
one line, and the notes of the flags that change nothing here."""

import argparse
import sys

import pytest

from megatron.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64 --normalization RMSNorm --position-embedding-type rope "
        "--disable-bias-linear")
GPT_OSS = ("--softmax-type learnable --window-size 3,0 --window-attn-skip-freq 2 --quick-geglu "
           "--glu-linear-offset 1.0 --activation-func-clamp-value 7.0")


def parse(extra, world_size=1):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_flags_reach_the_config_and_the_layers():
    sys.path.insert(0, ".")
    from pretrain_gpt import core_transformer_config_from_args, model_provider  # the trainer's script

    args = parse(GPT_OSS + " --recompute-activations")
    assert args.recompute_granularity == "selective"
    config = core_transformer_config_from_args(args)
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == ("learnable", (3, 0), 2)
    assert (config.gated_linear_unit, config.activation_func) == (True, "quick_gelu")
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    args.padded_vocab_size = 64
    model = model_provider(args)
    windows = [layer.self_attention.window_size for layer in model.decoder.layers]
    assert windows == [(3, 0), None, (3, 0), None]
    assert all(layer.self_attention.softmax_offset.shape == (4,) for layer in model.decoder.layers)
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape[0] == 2 * args.ffn_hidden_size


@pytest.mark.parametrize("extra, words", (
    ("--window-size 127,1", "R must be 0"),
    ("--window-size 4", "not two ints"),
    ("--window-attn-skip-freq 2", "needs --window-size"),
    ("--quick-geglu --swiglu", "pass one of them"),
    ("--glu-linear-offset 1", "gated unit"),
    ("--softmax-type learnable --context-parallel-size 2", "context-parallel-size 1"),
    ("--recompute-activations --recompute-granularity full", "pass one of them"),
    ("--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16 --bf16 --use-mfsdp", "pass one of them"),
))
def test_bad_combinations_are_refused_at_parse_time(extra, words, capsys):
    with pytest.raises((ValueError, argparse.ArgumentError, SystemExit)) as error:
        parse(extra, world_size=2)
    message = capsys.readouterr().err if error.type is SystemExit else str(error.value)
    assert words in message, message


def test_flags_without_effect_here_say_so(capsys):
    parse("--enable-gpt-oss --export-force-local-attention --disable-bf16-reduced-precision-matmul "
          "--rope-type yarn --accumulate-allreduce-grads-in-fp32 --moe-per-layer-logging")
    out = capsys.readouterr()
    text = out.out + out.err
    for flag in ("--enable-gpt-oss", "--export-force-local-attention", "--disable-bf16-reduced-precision-matmul",
                 "--rope-type yarn"):
        assert flag in text, text
