"""The tokenizer files ``transformers.AutoTokenizer`` loads, written next to an exported model.

``export_tokenizer`` rebuilds the checkpoint's tokenizer (from the files the checkpoint
carries, megatron/training/tokenizer_record.py) and calls the writer of its type, one
function per type in ``HF_WRITERS``: ``writer(tokenizer, tokenizer_args, out_dir)`` writes
the files and returns the ``tokenizer_config.json`` entries that name its class and special
tokens. The EOD id is the EOS token (``config.json``'s ``eos_token_id`` too). A new
tokenizer type plugs in by adding its writer to ``HF_WRITERS``; a type without one (and
NullTokenizer, whose text is its ids) is exported as the model alone, said in one line.
Every type the trainer has (GPT-2 BPE, Hugging Face, SentencePiece, tiktoken) has a writer.
"""

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.training.tokenizer_record import HF_TOKENIZER_FILES, SETTINGS

TOKENIZER_CONFIG = "tokenizer_config.json"


def _gpt2_bpe(tokenizer, tokenizer_args, out_dir) -> Dict[str, Any]:
    """GPT-2's own files under Hugging Face's names: ``vocab.json`` (encoder.json) and
    ``merges.txt`` (vocab.bpe), loaded as ``GPT2Tokenizer``."""
    shutil.copyfile(tokenizer._vocab_file, os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(tokenizer._merge_file, os.path.join(out_dir, "merges.txt"))
    eod = tokenizer.inv_vocab[tokenizer.eod]
    return {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": eod, "unk_token": eod,
            "errors": "replace"}


def _huggingface(tokenizer, tokenizer_args, out_dir) -> Dict[str, Any]:
    """The saved tokenizer's own files as they are (a chat template in
    tokenizer_config.json or chat_template.jinja comes along)."""
    source = tokenizer_args["tokenizer_model"]
    for name in HF_TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    config_file = os.path.join(out_dir, TOKENIZER_CONFIG)
    if os.path.isfile(config_file):
        return {}
    return {"tokenizer_class": "PreTrainedTokenizerFast"}


def _sentencepiece(tokenizer, tokenizer_args, out_dir) -> Dict[str, Any]:
    """A ``tokenizer.json`` that tokenizes and decodes as the SentencePiece model does
    (its normalization, whitespace rules, pieces, unknown and byte-fallback pieces), and the
    ``.model`` file itself as ``tokenizer.model``. Control pieces (<s>, </s>) are special
    tokens: ``decode(..., skip_special_tokens=True)`` drops them, as SentencePiece does."""
    model_file = tokenizer_args["tokenizer_model"]
    sentencepiece_to_tokenizers(model_file).save(os.path.join(out_dir, "tokenizer.json"))
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    sp = tokenizer._sp
    # No unk_token: a declared one would be special, and decoding without special tokens
    # would drop it, where SentencePiece writes " \u2047 ".
    entries = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if sp.bos_id() >= 0:
        entries["bos_token"] = sp.id_to_piece(sp.bos_id())
    return entries


def sentencepiece_to_tokenizers(model_file: str):
    """A ``tokenizers.Tokenizer`` equivalent to the SentencePiece model in ``model_file``."""
    # Imported here: exporting needs transformers (the hf extra), the trainer does not.
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from transformers.convert_slow_tokenizer import import_protobuf
    from transformers.tokenization_utils_base import generate_merges

    proto = import_protobuf().ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = pieces[trainer.unk_id][0]
    if trainer.model_type == 1:  # unigram
        model = models.Unigram(pieces, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == 2:  # BPE: merges ordered by the merged piece's score
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        merges = generate_merges(vocab, dict(pieces))
        model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=trainer.byte_fallback)
    else:
        raise ValueError(f"the SentencePiece model {model_file} is of type {trainer.model_type} (not unigram or BPE); "
                         "it has no Hugging Face export yet: export with --to safetensors.")
    tokenizer = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    # SentencePiece decodes its unknown piece as " \u2047 " and drops the dummy prefix's space.
    steps = [decoders.Replace(unk, " \u2047 "), decoders.Replace("\u2581", " "), decoders.ByteFallback(),
             decoders.Fuse()]
    if norm.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    control, user = 3, 4  # ModelProto.SentencePiece.Type
    tokenizer.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                                  for p in proto.pieces if p.type == control])
    tokenizer.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                          for p in proto.pieces if p.type == user] + [AddedToken(unk, normalized=False)])
    return tokenizer


def _tiktoken(tokenizer, tokenizer_args, out_dir) -> Dict[str, Any]:
    """A ``tokenizer.json`` that encodes and decodes as the tiktoken BPE does (equal ids on
    the tests' strings): the same pre-tokenization regex, byte-level BPE whose merges are
    read off the ranks, and the special tokens (upstream's seven and the ``<SPECIAL_i>``
    fillers) at ids 0..num_special_tokens-1."""
    tiktoken_to_tokenizers(tokenizer).save(os.path.join(out_dir, "tokenizer.json"))
    special = tokenizer.special_tokens
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special[tokenizer.bos],
            "unk_token": "<unk>", "pad_token": "<pad>"}


def tiktoken_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's ``ranks``, in rank order: for each token of 2+
    bytes, every split into two tokens of lower rank (tiktoken merges any adjacent pair
    whose concatenation is a token, lowest rank first, so each such split is a merge)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if ranks.get(left, rank) < rank and ranks.get(right, rank) < rank:
                merges.append((left, right))
    return merges


def tiktoken_to_tokenizers(tokenizer):
    """A ``tokenizers.Tokenizer`` equivalent to ``tokenizer`` (our TikTokenizer)."""
    # Imported here: exporting needs the tokenizers package, the trainer's TikTokenizer does not.
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode

    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:  # the byte-level alphabet's spelling of ``token``
        return "".join(byte_char[b] for b in token)

    offset = tokenizer.num_special_tokens
    vocab = {text(token): offset + rank for token, rank in tokenizer.ranks.items()}
    vocab.update({token: i for i, token in enumerate(tokenizer.special_tokens)})  # their ids, not appended ones
    merges = [(text(a), text(b)) for a, b in tiktoken_merges(tokenizer.ranks)]
    result = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    result.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    result.decoder = decoders.ByteLevel()
    # Special tokens at their vocabulary ids 0..num_special_tokens-1, matched before BPE.
    result.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokenizer.special_tokens])
    return result


# One writer per tokenizer type: (tokenizer, tokenizer_args, out_dir) -> tokenizer_config entries.
HF_WRITERS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "GPT2BPETokenizer": _gpt2_bpe,
    "HuggingFaceTokenizer": _huggingface,
    "GPTSentencePieceTokenizer": _sentencepiece,
    "TikTokenizer": _tiktoken,
}


def export_tokenizer(tokenizer_args: Optional[Dict[str, Any]], out_dir: str) -> Tuple[Optional[int], str]:
    """Write the tokenizer that ``tokenizer_args`` (the trainer's tokenizer arguments) builds
    into ``out_dir``. Returns (its EOD id or None, one line saying what was written)."""
    from megatron.core.tokenizer import build_tokenizer  # imported here: as the other tools, on use

    kind = (tokenizer_args or {}).get("tokenizer_type")
    if not kind:
        return None, ("no tokenizer exported: the checkpoint records none (written before tokenizers were "
                      "recorded); copy the tokenizer files next to config.json yourself.")
    try:
        tokenizer = build_tokenizer(kind, vocab_file=tokenizer_args.get("vocab_file"),
                                    merge_file=tokenizer_args.get("merge_file"),
                                    tokenizer_model=tokenizer_args.get("tokenizer_model"),
                                    vocab_size=tokenizer_args.get("vocab_size"),
                                    **{k: tokenizer_args[k] for k in SETTINGS.get(kind, ()) if k in tokenizer_args})
    except (FileNotFoundError, ValueError) as e:  # a checkpoint from before the record, its files gone
        return None, f"no tokenizer exported: the checkpoint's {kind} cannot be rebuilt ({e})"
    eod = int(tokenizer.eod)
    if kind == "NullTokenizer":
        return eod, (f"no tokenizer exported: NullTokenizer has no text (its text is the ids); "
                     f"eos_token_id is its EOD id {eod}.")
    writer = HF_WRITERS.get(kind)
    if writer is None:
        return eod, (f"no tokenizer exported: {kind} has no Hugging Face writer yet (tools/checkpoint/"
                     f"hf_tokenizer.py HF_WRITERS); eos_token_id is its EOD id {eod}.")
    entries = writer(tokenizer, tokenizer_args, out_dir)
    config_file = os.path.join(out_dir, TOKENIZER_CONFIG)
    config = {}
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    config.update(entries)
    if "eos_token" not in config:
        config["eos_token"] = tokenizer.special_tokens[eod] if kind == "TikTokenizer" else tokenizer.inv_vocab[eod]
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    written = sorted(n for n in os.listdir(out_dir) if n in HF_TOKENIZER_FILES)
    return eod, f"tokenizer ({kind}, EOD id {eod} as eos_token): {', '.join(written)}"
