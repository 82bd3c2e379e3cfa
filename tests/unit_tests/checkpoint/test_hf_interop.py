"""Hugging Face GPT-2 in and out without surprises (single process, no hub: models from configs).

A GPT-2 with GPT-2's 50257-entry vocabulary and its tanh GELU (gelu_new) is imported with
convert.py --to mfsdp (vocabulary padded to 50304). The model that the printed fine-tune
command builds gives Hugging Face's loss (fp32), generate.py continues a prompt as
Hugging Face's greedy search does, and inspect.py --compare matches the two directories.
"""

import argparse
import json
import os
import shlex

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tools import generate as generate_tool
from tools.checkpoint import convert, inspect as inspect_tool

GPT2_VOCAB, SEQ = 50257, 24


def _hf_gpt2(activation="gelu_new", seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                        activation_function=activation, resid_pdrop=0.05, embd_pdrop=0.05, attn_pdrop=0.02)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(tmp, hf model, hf dir, mfsdp dir, printed command)."""
    tmp = tmp_path_factory.mktemp("interop")
    hf = _hf_gpt2()
    hf.save_pretrained(str(tmp / "hf"))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert convert.main(["--input", str(tmp / "hf"), "--to", "mfsdp", "--output", str(tmp / "mfsdp"),
                             "--quiet"]) == 0
    return tmp, hf, tmp / "hf", tmp / "mfsdp", out.getvalue()


def _command_argv(printed):
    """The printed command as argv: continuation lines joined, comment lines dropped."""
    lines = [line for line in printed.splitlines() if not line.startswith("#")]
    argv = shlex.split(" ".join(line.rstrip("\\") for line in lines))
    assert argv[:6] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert argv[6] == "pretrain_gpt.py"
    return argv[7:]


def _model_from_command(printed):
    """What pretrain_gpt.py builds from the printed command, with the checkpoint loaded."""
    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    args = parse_args(_command_argv(printed), world_size=1, cuda_available=False)
    build_tokenizer_from_args(args)
    model = model_provider(args)
    assert load_checkpoint(model, None, None, args) == (0, 0)
    return args, model.eval()


def test_printed_command_is_complete_and_notes_are_comments(imported):
    _, _, _, mfsdp, printed = imported
    flags = " ".join(_command_argv(printed))
    for flag in ("--openai-gelu", "--hidden-dropout 0.05", "--attention-dropout 0.02", "--finetune",
                 "--tokenizer-type GPT2BPETokenizer", "--make-vocab-size-divisible-by 128", f"--load {mfsdp}"):
        assert flag in flags, flag
    body = [line for line in printed.splitlines() if not line.startswith("#")]
    assert all(line.endswith(" \\") for line in body[:-1]) and not body[-1].endswith("\\")
    assert any(line.startswith("# ") for line in printed.splitlines())


def test_converted_gpt2_gives_hugging_face_loss(imported):
    _, hf, _, _, printed = imported
    args, ours = _model_from_command(printed)
    assert (args.padded_vocab_size, args.unpadded_vocab_size) == (50304, GPT2_VOCAB)
    assert ours.decoder.layers[0].mlp.activation.__name__ == "_gelu_tanh"
    ids = torch.randint(0, GPT2_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids, labels=ids).loss  # mean over the shifted positions
        losses = ours(ids[:, :-1], labels=ids[:, 1:])
    torch.testing.assert_close(losses.mean(), expected, rtol=1e-6, atol=1e-6)


def test_finetune_without_the_activation_flag_is_refused(imported):
    _, _, _, _, printed = imported
    argv = [a for a in _command_argv(printed) if a != "--openai-gelu"]
    args = parse_args(argv, world_size=1, cuda_available=False)
    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    build_tokenizer_from_args(args)
    with pytest.raises(ValueError, match="pass --openai-gelu"):
        load_checkpoint(model_provider(args), None, None, args)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_activation_round_trips_through_convert(tmp_path, activation):
    hf = _hf_gpt2(activation)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert convert.main(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(tmp_path / "m"),
                         "--quiet"]) == 0
    assert convert.main(["--input", str(tmp_path / "m"), "--to", "hf", "--output", str(tmp_path / "back"),
                         "--quiet"]) == 0
    back = json.load(open(tmp_path / "back" / "config.json"))
    assert back["activation_function"] == activation and back["vocab_size"] == GPT2_VOCAB


def test_trainer_checkpoint_with_openai_gelu_exports_gelu_new(tmp_path):
    from transformers import GPT2LMHeadModel

    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--openai-gelu",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--save", str(tmp_path / "c")]
    args = parse_args(argv, world_size=1, cuda_available=False)
    build_tokenizer_from_args(args)
    model = model_provider(args).eval()
    save_checkpoint(1, model, None, None, args)
    assert convert.main(["--input", str(tmp_path / "c"), "--to", "hf", "--output", str(tmp_path / "hf"),
                         "--quiet"]) == 0
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["activation_function"] == "gelu_new" and config["vocab_size"] == 100  # padding dropped
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[..., :100], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("iteration_dir", [False, True])
def test_generate_on_an_imported_checkpoint_matches_hugging_face(imported, capsys, iteration_dir):
    from megatron.core.tokenizer import build_tokenizer

    _, hf, _, mfsdp, _ = imported
    load = str(mfsdp / "iter_0000000") if iteration_dir else str(mfsdp)
    capsys.readouterr()
    assert generate_tool.main(["--load", load, "--prompt", "ROMEO:", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    text = out.split("-" * 80 + "\n")[1].rstrip("\n")
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    prompt = torch.tensor([tokenizer.tokenize("ROMEO:")])
    expected = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert text == tokenizer.detokenize(expected[0].tolist())


def test_generate_names_the_missing_tokenizer(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, max_position_embeddings=16)).save_pretrained(str(tmp_path / "hf"))
    assert convert.main(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(tmp_path / "m"),
                         "--quiet"]) == 0
    assert "--tokenizer-model TOKENIZER_DIR" in capsys.readouterr().out
    assert generate_tool.main(["--load", str(tmp_path / "m"), "--max-new-tokens", "2"]) == 2
    assert "does not record its tokenizer; pass --tokenizer-type" in capsys.readouterr().err


def test_imported_tokenizer_files_travel_with_the_checkpoint(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = _hf_gpt2()
    hf.save_pretrained(str(tmp_path / "hf"))
    vocab = {"<eos>": 0, "a": 1, "b": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert convert.main(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(tmp_path / "m"),
                         "--quiet"]) == 0
    flags = " ".join(_command_argv(capsys.readouterr().out))
    copies = tmp_path / "m" / "iter_0000000" / "tokenizer"  # inside the checkpoint, recorded in common.json
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {copies}" in flags
    assert sorted(os.listdir(copies)) == ["tokenizer.json", "tokenizer_config.json"]
    # The padded size of a 3-entry tokenizer is not the checkpoint's 50304 rows: refused, with the reason.
    assert generate_tool.main(["--load", str(tmp_path / "m"), "--max-new-tokens", "2"]) == 2
    assert "the checkpoint's vocabulary has 50304 rows" in capsys.readouterr().err


def test_inspect_compares_with_a_hugging_face_directory(imported, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _, _, hf_dir, mfsdp, _ = imported
    capsys.readouterr()
    assert inspect_tool.main([str(mfsdp), "--compare", str(hf_dir)]) == 0
    out = capsys.readouterr().out
    assert "28 tensors compared, largest difference 0 (identical)" in out
    assert "vocabulary rows beyond its 50257 (padding) are not compared" in out

    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["transformer.h.1.mlp.c_fc.bias"][5] += 0.5
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert inspect_tool.main([str(changed), "--compare", str(mfsdp)]) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("decoder.layers.1.mlp.linear_fc1.bias"))
    assert float(line.split()[-1]) == pytest.approx(0.5)


def test_openai_gelu_and_swiglu_together_are_refused():
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--openai-gelu"]
    assert parse_args(argv, world_size=1, cuda_available=False).openai_gelu
    with pytest.raises(ValueError, match="--openai-gelu and --swiglu"):
        parse_args(argv + ["--swiglu"], world_size=1, cuda_available=False)


@pytest.mark.parametrize("option", [{"apply_layernorm_1p": True}, {"rotary_percent": 0.5}])
def test_options_hugging_face_cannot_express_are_refused(option):
    from tools.checkpoint.hf_conversion import ConversionError, config_from_tensors

    shapes = {"embedding.word_embeddings.weight": (16, 8)}
    with pytest.raises(ConversionError, match="cannot express"):
        config_from_tensors(shapes, dict(num_attention_heads=2, **option))
