"""A checkpoint carries its tokenizer (megatron/training/tokenizer_record.py), for every
tokenizer type the trainer has.

For each type a tiny GPT is built and saved by the trainer's save_checkpoint in this
process; the tokenizer's original files are then moved away. tools/generate.py samples
it with no tokenizer flag; convert.py --to hf writes the tokenizer files that
``AutoTokenizer`` loads, and ``AutoTokenizer`` + ``AutoModelForCausalLM`` continue the
prompt greedily into the same text; convert.py --to mfsdp of that export keeps the
tokenizer, and generate.py on it (no flag again) gives Hugging Face's text once more.
"""

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import checkpoint_dir, load_common, save_checkpoint
from tools import generate as generate_tool
from tools.checkpoint import convert, inspect as inspect_tool

PROMPT = "ROMEO: to be"
NEW_TOKENS = 8
CORPUS = ("ROMEO: to be or not to be, that is the question.\nJULIET: the quick brown fox jumps over the lazy dog.\n"
          * 20)
TEXTS = ["  JULIET:\n\tthe  quick   fox ", "\ufb01ne \uff21 caf\u00e9 {x} 42", "", " ",
         "ROMEO: to be or not to be, that is the question.\r\n\n  JULIET's 12345"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _hf_tokenizer(directory):
    """A small byte-level BPE saved as Hugging Face saves one, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
                   "chat_template": CHAT_TEMPLATE}, f)
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]


def _sentencepiece(directory):
    import sentencepiece

    os.makedirs(directory)
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(CORPUS)
    sentencepiece.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(directory, "sp"), vocab_size=60,
                                             model_type="bpe", minloglevel=2)
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", os.path.join(directory, "sp.model")]


def _gpt2_bpe(directory):
    from megatron.core.tokenizer import default_gpt2_vocab_files

    os.makedirs(directory)
    vocab, merges = default_gpt2_vocab_files()
    shutil.copyfile(vocab, os.path.join(directory, "encoder.json"))
    shutil.copyfile(merges, os.path.join(directory, "vocab.bpe"))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(directory, "encoder.json"),
            "--merge-file", os.path.join(directory, "vocab.bpe")]


def _tiktoken(directory):
    """Upstream's tiktoken file of a byte-level BPE trained on the corpus (its merges as ranks)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode
    from megatron.core.tokenizer.tiktoken_tokenizer import write_ranks

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    merges = json.loads(bpe.to_str())["model"]["merges"]
    merged = [bytes(byte_of[c] for c in "".join(m if isinstance(m, list) else m.split(" "))) for m in merges]
    os.makedirs(directory)
    ranks = write_ranks(os.path.join(directory, "ranks.json"), merged)
    special = 16
    return ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", os.path.join(directory, "ranks.json"),
            "--vocab-size", str(special + ranks), "--tiktoken-num-special-tokens", str(special),
            "--tiktoken-pattern", "v1"]


TOKENIZERS = {"GPT2BPETokenizer": _gpt2_bpe, "HuggingFaceTokenizer": _hf_tokenizer,
              "GPTSentencePieceTokenizer": _sentencepiece, "TikTokenizer": _tiktoken}
# SentencePiece drops its control pieces (<s>, </s>) when decoding; the others print every token.
SKIP_SPECIAL = {"GPTSentencePieceTokenizer": True}


def _checkpoint(tmp_path, tokenizer_flags):
    """A tiny GPT saved by the trainer (iteration 1), its tokenizer's source files moved away."""
    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
            *tokenizer_flags]
    args = parse_args(argv, world_size=1, cuda_available=False)
    build_tokenizer_from_args(args)
    torch.manual_seed(1)  # a model whose 8 greedy tokens hold text (not only control pieces) for every type
    model = model_provider(args).eval()
    with torch.no_grad():  # larger weights than the initialization's: a less flat, more varied continuation
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_checkpoint(1, model, None, None, args)
    if os.path.isdir(tmp_path / "tok"):
        os.rename(tmp_path / "tok", tmp_path / "tok_moved")
    return str(tmp_path / "ckpt")


def _generate(load, capsys, *flags):
    capsys.readouterr()
    assert generate_tool.main(["--load", load, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), *flags]) == 0
    return capsys.readouterr().out.split("-" * 80 + "\n")[1].rstrip("\n")


def _hf_generate(export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    model.generation_config.eos_token_id = None  # generate.py runs on past the EOD (no --stop-at-eod)
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0].tolist()
    return tokenizer, prompt[0].tolist(), out


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_tokenizer_travels_from_training_to_hugging_face_and_back(kind, tmp_path, capsys):
    from megatron.core.tokenizer import build_tokenizer
    from megatron.training.tokenizer_record import tokenizer_args

    load = _checkpoint(tmp_path, TOKENIZERS[kind](str(tmp_path / "tok")))
    path, common = load_common(load)
    record = common["tokenizer"]
    assert record["type"] == kind and record["files"]
    for name, entry in record["files"].items():  # copies with their hashes, not paths
        assert os.path.getsize(os.path.join(path, "tokenizer", name)) == entry["bytes"] and len(entry["sha256"]) == 64
    ours = build_tokenizer(kind, **{k: v for k, v in tokenizer_args(path, record).items() if k != "tokenizer_type"})

    text = _generate(load, capsys)  # no tokenizer flag: the recorded one
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)

    export = str(tmp_path / "hf")
    assert convert.main(["--input", load, "--to", "hf", "--output", export, "--quiet"]) == 0
    assert f"> tokenizer ({kind}, EOD id {ours.eod} as eos_token)" in capsys.readouterr().err
    assert json.load(open(os.path.join(export, "config.json")))["eos_token_id"] == ours.eod
    hf_tokenizer, prompt_ids, hf_ids = _hf_generate(export)
    assert prompt_ids == ours.tokenize(PROMPT)
    for sample in TEXTS:  # the same ids and text beyond the prompt (whitespace runs, unknown and NFKC characters)
        ids = ours.tokenize(sample)
        assert hf_tokenizer(sample)["input_ids"] == ids, sample
        assert hf_tokenizer.decode(ids, skip_special_tokens=SKIP_SPECIAL.get(kind, False)) == ours.detokenize(ids)
    assert hf_tokenizer.eos_token_id == ours.eod
    assert hf_tokenizer.decode(hf_ids, skip_special_tokens=SKIP_SPECIAL.get(kind, False)) == text
    if kind == "HuggingFaceTokenizer":
        assert hf_tokenizer.chat_template == CHAT_TEMPLATE
    if kind == "TikTokenizer":  # its special tokens in text are their ids (upstream's allowed_special="all")
        assert hf_tokenizer("the</s><SPECIAL_9>")["input_ids"] == ours.tokenize("the</s><SPECIAL_9>")

    # Hugging Face -> MFSDP keeps the tokenizer: generate.py needs no flag on the import either.
    imported = str(tmp_path / "imported")
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert.main(["--input", export, "--to", "mfsdp", "--output", imported, "--quiet"]) == 0
    assert load_common(imported)[1]["tokenizer"]["type"] == "HuggingFaceTokenizer"
    # Its tokenizer is now the exported Hugging Face one, which prints special tokens.
    assert _generate(imported, capsys) == hf_tokenizer.decode(hf_ids, skip_special_tokens=False)


def test_null_tokenizer_export_says_no_tokenizer(tmp_path, capsys):
    load = _checkpoint(tmp_path, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    assert load_common(load)[1]["tokenizer"] == {"type": "NullTokenizer", "args": {}, "files": {}, "vocab_size": 100}
    assert convert.main(["--input", load, "--to", "hf", "--output", str(tmp_path / "hf"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "> no tokenizer exported: NullTokenizer has no text (its text is the ids); eos_token_id is its EOD id 99." \
        in err
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    assert json.load(open(tmp_path / "hf" / "config.json"))["eos_token_id"] == 99


def test_flags_override_and_a_corrupt_copy_is_refused(tmp_path, capsys):
    load = _checkpoint(tmp_path, _hf_tokenizer(str(tmp_path / "tok")))
    # An explicit tokenizer flag wins over the record: a 100-id NullTokenizer pads to 128
    # rows, not the checkpoint's 384, and generate.py says so.
    assert generate_tool.main(["--load", load, "--max-new-tokens", "1", "--tokenizer-type", "NullTokenizer"]) == 2
    assert "NullTokenizer needs --vocab-size" in capsys.readouterr().err
    assert inspect_tool.main([load, "--verify"]) == 0
    assert "all 4 files match their size and sha256" in capsys.readouterr().out  # 2 of the engine's, 2 copies
    with open(os.path.join(checkpoint_dir(load, 1), "tokenizer", "tokenizer.json"), "a") as f:
        f.write(" ")
    for main in (generate_tool.main, inspect_tool.main):
        assert main(["--load", load, "--max-new-tokens", "1"] if main is generate_tool.main
                    else [load, "--verify"]) == 2
        err = capsys.readouterr().err
        assert "the checkpoint's tokenizer: checkpoint file" in err and "tokenizer.json has" in err


def test_resuming_takes_the_recorded_tokenizer_and_checks_given_flags(tmp_path, capsys):
    """pretrain_gpt.py --load: no tokenizer flag -> the checkpoint's recorded tokenizer (its
    copy); flags naming the same tokenizer pass; flags naming another are one clear error,
    unless --no-use-tokenizer-model-from-checkpoint-args (upstream's: the command line wins)."""
    load = _checkpoint(tmp_path, _hf_tokenizer(str(tmp_path / "tok")))  # the original moved to tok_moved
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--load", load]

    def parse(*flags):
        return parse_args(model + list(flags), world_size=1, cuda_available=False)

    args = parse()
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.tokenizer_model == os.path.join(checkpoint_dir(load, 1), "tokenizer")
    assert "the checkpoint's tokenizer (HuggingFaceTokenizer" in capsys.readouterr().out
    same = parse("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok_moved"))
    assert same.tokenizer_model == str(tmp_path / "tok_moved")

    other = str(tmp_path / "other")
    shutil.copytree(tmp_path / "tok_moved", other)
    with open(os.path.join(other, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}, f)  # no chat template
    for flags, says in ((["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", other],
                         f"--tokenizer-model {other} is not the file the checkpoint was trained with"),
                        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
                         "--tokenizer-type NullTokenizer, the checkpoint's is HuggingFaceTokenizer")):
        with pytest.raises(ValueError, match="was trained with another tokenizer") as error:
            parse(*flags)
        assert says in str(error.value) and "--no-use-tokenizer-model-from-checkpoint-args" in str(error.value)
    assert parse("--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                 "--no-use-tokenizer-model-from-checkpoint-args").tokenizer_type == "NullTokenizer"
    # A fresh run (nothing at --load yet) keeps GPT-2's BPE as the default.
    assert parse_args(model[:-1] + [str(tmp_path / "empty")], world_size=1,
                      cuda_available=False).tokenizer_type == "GPT2BPETokenizer"
