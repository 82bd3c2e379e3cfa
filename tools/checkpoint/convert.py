#!/usr/bin/env python
"""Convert checkpoints, in one CPU process (no cluster, no GPU).

    # MFSDP (any world size / strategy) -> one consolidated safetensors file (our names)
    python tools/checkpoint/convert.py --input checkpoints/run --to safetensors --output model.safetensors

    # MFSDP -> Hugging Face (GPT-2 style -> GPT2LMHeadModel, RoPE/RMSNorm/SwiGLU -> LlamaForCausalLM,
    # + --qk-layernorm -> Qwen3ForCausalLM, + experts -> Mixtral, + gated shared expert -> Qwen2-MoE)
    python tools/checkpoint/convert.py --input checkpoints/run --to hf --output hf_model/

    # Hugging Face -> MFSDP, loadable by pretrain_gpt.py --load (weights only: fine-tuning)
    python tools/checkpoint/convert.py --input hf_model/ --to mfsdp --output checkpoints/imported

``--to mfsdp`` prints (on stdout) the complete pretrain_gpt.py command that fine-tunes the
result, with every model flag, dropout as in the source model, and the tokenizer: the
input's tokenizer files are copied into the checkpoint (``<output>/iter_0000000/tokenizer``,
recorded in its common.json), so tools/generate.py needs no tokenizer flag. ``--to hf``
writes the checkpoint's tokenizer files next to the model (tools/checkpoint/hf_tokenizer.py).

``--input`` is a --save directory (latest iteration unless --iteration), one iteration
directory, a Hugging Face directory or a safetensors file. An existing output is never
overwritten without --force; the output is written to a temporary sibling and renamed
into place when complete. A progress bar goes to stderr (--quiet hides it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run as a script, this file's directory comes first on sys.path, where tools/checkpoint/
# inspect.py would shadow the standard library's ``inspect`` (which torch imports).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
_REPO_ROOT = os.path.abspath(os.path.join(_HERE, os.pardir, os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Convert MFSDP checkpoints to/from safetensors and Hugging Face.",
                                allow_abbrev=False)
    p.add_argument("--input", required=True, help="checkpoint to read (MFSDP, Hugging Face dir, .safetensors)")
    p.add_argument("--output", required=True, help="file (--to safetensors) or directory to write")
    p.add_argument("--to", required=True, choices=("safetensors", "hf", "mfsdp"), help="output format")
    p.add_argument("--iteration", type=int, default=None, help="MFSDP input: this iteration instead of the latest")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="cast floating tensors (default: keep)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("model facts an engine-only checkpoint does not record (else read from it)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--norm-epsilon", type=float, default=None)
    g.add_argument("--rotary-base", type=float, default=None)
    g.add_argument("--activation", choices=("gelu", "gelu_tanh", "silu"), default=None)
    g = p.add_argument_group("vocabulary")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="--to hf: keep only the first N vocabulary rows (drop padding); default: the size "
                        "recorded when the model was imported, else all rows")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--to mfsdp: zero-pad the vocabulary to a multiple of N, as pretrain_gpt.py pads "
                        "its tokenizer's (default 128; 1 keeps it)")
    return p


def _progress(items, desc, quiet, total=None):
    if quiet:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit="tensor", file=sys.stderr, dynamic_ncols=True)


def _cast(tensors, dtype_flag):
    import torch

    if dtype_flag is None:
        return tensors
    dtype = getattr(torch, _DTYPES[dtype_flag])
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


def _read_all(checkpoint, keys, quiet, what="reading"):
    out = {}
    for key in _progress(keys, what, quiet):
        out.update(checkpoint.load([key]))
    return out


def _save_safetensors(tensors, path, metadata):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _recorded_tokenizer(source):
    """The trainer's tokenizer arguments of an MFSDP checkpoint: from the files it carries
    (tokenizer_record.py), else from its saved arguments (a checkpoint from before the
    record: paths of the machine that trained it); None when it names none."""
    from megatron.training.tokenizer_record import tokenizer_args  # imported here: only --to hf reads it

    common = getattr(source, "common", None) or {}
    if common.get("tokenizer"):
        return tokenizer_args(source.path, common["tokenizer"])
    args = getattr(source, "args", None) or {}
    return {k: args.get(k) for k in _TOKENIZER_ARGS} if args.get("tokenizer_type") else None


def convert(opts) -> str:
    import torch

    from tools.checkpoint import hf_conversion as hf
    from tools.checkpoint.checkpoint_io import (
        HuggingFaceCheckpoint,
        MfsdpCheckpoint,
        SafetensorsCheckpoint,
        commit_output,
        open_checkpoint,
        prepare_output,
    )

    from tools.checkpoint.hf_tokenizer import export_tokenizer  # imported here, as the modules above: startup cost

    source = open_checkpoint(opts.input, opts.iteration)
    tmp = prepare_output(opts.output, opts.force)
    tokenizer_note = None
    start = time.time()
    overrides = {"num_attention_heads": opts.num_attention_heads, "num_query_groups": opts.num_query_groups,
                 "norm_epsilon": opts.norm_epsilon, "rotary_base": opts.rotary_base,
                 "activation_func": opts.activation}

    if opts.to in ("safetensors", "hf"):
        if isinstance(source, HuggingFaceCheckpoint):
            raise hf.ConversionError("the input is already a Hugging Face model; convert it --to mfsdp.")
        if isinstance(source, MfsdpCheckpoint):
            if not opts.quiet:
                print(f"> verifying {source.path}", file=sys.stderr)
            source.verify()
            keys = source.model_keys()
            args = source.args
            extra = source.manifest.get("extra") or {}
        else:
            keys, args, extra = source.keys(), {}, {}
            if isinstance(source, SafetensorsCheckpoint) and "megatron_args" in source.metadata:
                args = json.loads(source.metadata["megatron_args"])
        tensors = _cast(_read_all(source, keys, opts.quiet), opts.dtype)
        try:
            if opts.to == "safetensors":
                metadata = {"format": "pt", "source": os.path.abspath(opts.input)}
                try:  # record the architecture when this is a GPTModel (convertible later on)
                    config = hf.config_from_tensors(tensors, args, overrides)
                    metadata["megatron_args"] = json.dumps(config.to_megatron_args())
                except (hf.ConversionError, KeyError):
                    pass
                if source.kind == "MFSDP" and source.common:
                    metadata["iteration"] = str(source.common.get("iteration"))
                _save_safetensors(tensors, tmp, metadata)
                summary = f"{len(tensors)} tensors"
            else:
                config = hf.config_from_tensors(tensors, args, overrides)
                base = extra.get("hf_config") or (args.get("hf_config") if isinstance(args.get("hf_config"), dict) else None)
                vocab = opts.vocab_size or (base or {}).get("vocab_size") or args.get("unpadded_vocab_size")
                if vocab is not None and vocab > config.vocab_size:
                    vocab = config.vocab_size
                dtype = next(iter(tensors.values())).dtype
                out = hf.to_hf(tensors, config, vocab)
                os.makedirs(tmp)
                eod, tokenizer_note = export_tokenizer(_recorded_tokenizer(source), tmp)
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump(hf.hf_config(config, vocab, base, dtype, eod), f, indent=2, sort_keys=True)
                    f.write("\n")
                ordered = dict(sorted(out.items()))
                _save_safetensors(ordered, os.path.join(tmp, "model.safetensors"), {"format": "pt"})
                summary = f"{config.style} model, {len(out)} tensors"
        except BaseException:
            _remove(tmp)
            raise
    else:  # --to mfsdp
        from megatron.core.distributed.mfsdp_v2 import checkpoint as engine
        from megatron.training import checkpointing

        if isinstance(source, MfsdpCheckpoint):
            raise hf.ConversionError("the input is already an MFSDP checkpoint (it reshards on load).")
        hf_config = getattr(source, "config", None)
        if hf_config is not None:
            config = hf.config_from_hf(hf_config)
        else:
            config = None
        theirs = _cast(_read_all(source, source.keys(), opts.quiet), opts.dtype)
        if config is None:  # a consolidated safetensors file of ours
            meta = getattr(source, "metadata", {}) or {}
            args = json.loads(meta["megatron_args"]) if "megatron_args" in meta else {}
            config = hf.config_from_tensors(theirs, args, overrides)
            ours = theirs
            unpadded = config.unpadded_vocab_size or config.vocab_size
            # Any multiple that pads the tokenizer's size to these rows rebuilds them.
            multiple = args.get("make_vocab_size_divisible_by") or (1 if unpadded == config.vocab_size
                                                                    else config.vocab_size)
            tokenizer = {k: args[k] for k in _TOKENIZER_ARGS if args.get(k) is not None}
        else:
            multiple = max(1, opts.make_vocab_size_divisible_by)
            padded = -(-config.vocab_size // multiple) * multiple
            ours = hf.from_hf(theirs, config, padded)
            config.unpadded_vocab_size = config.vocab_size
            config.vocab_size = padded
            tokenizer = {}
        iteration_dir = checkpointing.checkpoint_dir(tmp, 0)
        os.makedirs(iteration_dir)
        try:
            extra = {"hf_config": hf_config} if hf_config is not None else {}
            engine.save_tensors({engine.MODEL_PREFIX + k: v for k, v in ours.items()}, iteration_dir,
                                extra_metadata=extra)
            record = None
            if hf_config is not None:
                tokenizer, record = _import_tokenizer(source.path, hf_config, iteration_dir,
                                                      checkpointing.checkpoint_dir(os.path.abspath(opts.output), 0))
            model_args = dict(config.to_megatron_args(), make_vocab_size_divisible_by=multiple, **tokenizer)
            common = {
                "checkpoint_version": checkpointing.CHECKPOINT_VERSION, "iteration": 0,
                "consumed_train_samples": 0, "data": {"consumed_train_samples": 0},
                "num_floating_point_operations_so_far": 0.0, "opt_param_scheduler": None,
                "args": checkpointing.encode_args(model_args), "use_mfsdp": True, "world_size": 1,
                "has_optimizer": False, "model_only": True, "rng_files": {}, "tokenizer": record,
                "converted_from": os.path.abspath(opts.input),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            checkpointing.write_common(os.path.join(iteration_dir, checkpointing.COMMON_FILENAME), common)
            checkpointing.write_tracker(tmp, 0)
        except BaseException:
            _remove(tmp)
            raise
        summary = f"{config.style} model, {len(ours)} tensors"
        command = finetune_command(config, opts.output, tokenizer, multiple, hf_config)
    commit_output(tmp, opts.output)
    if tokenizer_note:
        print(f"> {tokenizer_note}", file=sys.stderr)
    print(f"> wrote {opts.output} ({summary}) in {time.time() - start:.1f} s", file=sys.stderr)
    if opts.to == "mfsdp":
        print(command)
    return opts.output


# Arguments that rebuild the tokenizer a model was trained with.
_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")
GPT2_VOCAB_SIZE = 50257


def _import_tokenizer(source_dir, hf_config, iteration_dir, final_iteration_dir):
    """(tokenizer arguments, tokenizer record) of an imported model. A Hugging Face
    directory's tokenizer files are copied into the checkpoint (``iteration_dir/tokenizer``,
    recorded in common.json: tokenizer_record.py); a GPT-2 without them has GPT-2's BPE
    (known by its 50257 entries); otherwise none is known ({}, None).
    ``final_iteration_dir`` is where the copies will be once the output is in place."""
    # Imported here: only --to mfsdp from Hugging Face needs it.
    from megatron.training.tokenizer_record import HF_TOKENIZER_FILES, record_tokenizer, recorded_paths

    files = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(source_dir, n))]
    if "tokenizer.json" in files or "tokenizer_config.json" in files:
        record = record_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": source_dir},
                                  iteration_dir)
        return {"tokenizer_type": "HuggingFaceTokenizer",
                "tokenizer_model": recorded_paths(final_iteration_dir, record)["tokenizer_model"]}, record
    if hf_config.get("model_type") == "gpt2" and hf_config.get("vocab_size") == GPT2_VOCAB_SIZE:
        tokenizer = {"tokenizer_type": "GPT2BPETokenizer"}
        return tokenizer, record_tokenizer(tokenizer, iteration_dir)
    return {}, None


def finetune_command(config, checkpoint, tokenizer, multiple, hf_config=None) -> str:
    """A complete pretrain_gpt.py command line that fine-tunes ``checkpoint`` (2 CPU ranks,
    the default corpus), one flag group per line, then notes as shell comments."""
    import shlex

    q = shlex.quote
    if tokenizer.get("tokenizer_type") == "HuggingFaceTokenizer":
        tokenizer_flags = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {q(tokenizer['tokenizer_model'])}"
    elif tokenizer.get("tokenizer_type") == "GPT2BPETokenizer":
        tokenizer_flags = "--tokenizer-type GPT2BPETokenizer"
        if tokenizer.get("vocab_file"):
            tokenizer_flags += f" --vocab-file {q(tokenizer['vocab_file'])} --merge-file {q(tokenizer['merge_file'])}"
    elif tokenizer.get("tokenizer_type") == "NullTokenizer":
        tokenizer_flags = f"--tokenizer-type NullTokenizer --vocab-size {tokenizer['vocab_size']}"
    else:
        tokenizer_flags = "--tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR"
    seq = min(config.max_position_embeddings, 1024)
    output = checkpoint.rstrip(os.sep) + "-finetuned"
    model_flags = config.command_line()
    lines = ["python -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py",
             f"--load {q(checkpoint)} --finetune --use-mfsdp",
             " ".join(model_flags[:5]), " ".join(model_flags[5:]),
             f"{tokenizer_flags} --make-vocab-size-divisible-by {multiple}",
             f"--seq-length {seq} --micro-batch-size 1 --global-batch-size 8",
             "--lr 3e-5 --min-lr 3e-6 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 200",
             "--log-interval 10 --eval-interval 50 --eval-iters 10",
             f"--save {q(output)}"]
    lines = [line for line in lines if line]
    command = " \\\n    ".join(lines)
    notes = ["# Fine-tunes on the Shakespeare corpus (tokenized once with this tokenizer into data/cache);",
             "# add --data-path PREFIX for your own data (tools/preprocess_data.py writes it).",
             "# Run it from the repository root."]
    if not tokenizer:
        notes.append("# The input has no tokenizer files: replace TOKENIZER_DIR with the model's tokenizer directory.")
    if hf_config and hf_config.get("model_type") == "gpt2":
        embd = float(hf_config.get("embd_pdrop", 0.1))
        if embd != config.hidden_dropout:
            notes.append(f"# GPT-2's embedding dropout ({embd:g}) differs from its residual dropout "
                         f"({config.hidden_dropout:g}); --hidden-dropout sets both here.")
    return "\n".join([command] + notes)



def _remove(path):
    import shutil

    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def main(argv=None) -> int:
    opts = get_parser().parse_args(argv)
    try:
        convert(opts)
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError, KeyError) as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional package: safetensors / transformers
        print(f"convert.py: error: {e}; install the conversion extras: pip install -e '.[hf]' "
              "(or MEGATRON_EXTRAS=hf source scripts/setup_env.sh).", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
