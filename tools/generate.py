#!/usr/bin/env python
"""Generate text from a checkpoint written by pretrain_gpt.py (--save).

    python tools/generate.py --load checkpoints/shakespeare --prompt "ROMEO:" --max-new-tokens 80
    python tools/generate.py --load ... --prompt "..." --top-k 40 --temperature 0.8 --seed 7
    python tools/generate.py --load checkpoints/imported/iter_0000000   # one iteration directory

The model shape comes from the checkpoint's saved arguments and the tokenizer from the
files the checkpoint carries (megatron/training/tokenizer_record.py: pretrain_gpt.py and
tools/checkpoint/convert.py --to mfsdp record them), so no tokenizer flag is needed; the
--tokenizer-* flags override it, or name one for a checkpoint older than the record. The model is
rebuilt as a plain module in this single process and the checkpoint is read through the
trainer's load_checkpoint, which reshards: a checkpoint written by any number of ranks,
with MFSDP or DDP, at any TP/PP layout, can be sampled here. Greedy decoding unless --top-k > 1.

Pipeline parallel: under torchrun with --pipeline-model-parallel-size N (= the number of
ranks), each rank builds and loads one stage of the model (layers split as the trainer
splits them, whatever layout the checkpoint was saved at) and every token runs through the
stages in turn (megatron/core/models/gpt/generation.py, PipelinedModel); the output is the
one process's (same tokens), printed by rank 0:

    torchrun --nproc-per-node 2 tools/generate.py --load ... --pipeline-model-parallel-size 2
"""

import argparse
import os
import sys
import time

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Sample text from a pretrain_gpt.py checkpoint.")
    p.add_argument("--load", required=True, help="the --save directory of a training run, or one iteration directory")
    p.add_argument("--iteration", type=int, default=None, help="default: latest_checkpointed_iteration.txt")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens; default greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stop-at-eod", action="store_true", help="stop at the end-of-document token")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="split the model over N pipeline stages, one per rank (run under torchrun with N ranks)")
    g = p.add_argument_group("tokenizer (default: the one the checkpoint records)")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    return p


_TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def _model_args(saved: dict, opts, path: str = "", record=None) -> argparse.Namespace:
    """The trainer's defaults overlaid with the saved arguments (a checkpoint written by
    convert.py records only the model's own facts), then the tokenizer: the flags given,
    else the one the checkpoint carries (``record``, its files in ``path``), else the saved
    arguments' (a checkpoint from before the record: paths of the machine that trained it)."""
    from megatron.training.arguments import build_parser
    from megatron.training.tokenizer_record import tokenizer_args  # imported here, with the trainer's modules

    args = build_parser().parse_args([])
    for key, value in saved.items():
        setattr(args, key, value)
    given = {k: getattr(opts, k) for k in _TOKENIZER_FLAGS if getattr(opts, k) is not None}
    if given:
        for key in _TOKENIZER_FLAGS:
            setattr(args, key, given.get(key))
    elif record:
        for key, value in tokenizer_args(path, record).items():
            setattr(args, key, value)
    elif not saved.get("tokenizer_type"):
        raise ValueError("the checkpoint does not record its tokenizer; pass --tokenizer-type and "
                         "--tokenizer-model (or --vocab-file/--merge-file).")
    return args


def _for_generation(args: argparse.Namespace, pp_size: int = 1) -> argparse.Namespace:
    # Rebuild for a world of ``pp_size`` pipeline stages, nothing else: one instance, no
    # outer axis, an even split of the layers; the loader reshards whatever was saved.
    args.world_size = pp_size
    args.data_parallel_size = 1
    args.dp_outer_size = 1
    args.dp_inner_size = 1
    args.tensor_model_parallel_size = 1  # checkpoints hold global tensors
    args.sequence_parallel = False
    args.context_parallel_size = 1  # CP holds no parameters: whole sequences in one process
    args.pipeline_model_parallel_size = pp_size
    args.virtual_pipeline_model_parallel_size = None
    args.num_layers_per_virtual_pipeline_stage = None
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    args.pipeline_model_parallel_layout = None
    args.account_for_embedding_in_pipeline_split = args.account_for_loss_in_pipeline_split = False
    args.expert_model_parallel_size = 1  # experts are saved globally: every stage holds all of its own
    args.expert_tensor_parallel_size = None
    args.outer_dp_sharding_strategy = "no_shard"
    args.load = None
    args.params_dtype = torch.float32
    args.use_mfsdp = False
    return args


def build_generation_model(args: argparse.Namespace, path: str, device: torch.device):
    """The model ``generate`` calls, loaded from the checkpoint directory ``path``: the whole
    model, or under pipeline parallelism (parallel_state's) this rank's stage in a
    PipelinedModel. Returns (what generate calls, the loaded iteration)."""
    from megatron.core import parallel_state  # the trainer's modules load on use (the parser stays light)
    from megatron.core.models.gpt import PipelinedModel  # idem
    from megatron.training.checkpointing import load_checkpoint  # idem
    from pretrain_gpt import model_provider  # idem

    state = parallel_state.get_parallel_state() if parallel_state.model_parallel_is_initialized() else None
    staged = state is not None and state.pp_size > 1
    if staged:
        module = model_provider(args, pre_process=state.is_first_stage, post_process=state.is_last_stage)
    else:
        module = model_provider(args)
    module = module.to(device)
    # --load may name an iteration directory itself: load exactly the one resolved.
    iteration, _ = load_checkpoint(module, None, None, argparse.Namespace(load=path), load_optim=False, load_rng=False)
    module.eval()
    if staged:
        return PipelinedModel(module, state.pp_group, args.hidden_size, args.padded_vocab_size), iteration
    return module, iteration


def main(argv=None) -> int:
    opts = get_parser().parse_args(argv)
    if opts.max_new_tokens < 0:
        print("generate.py: error: --max-new-tokens must be non-negative.", file=sys.stderr)
        return 2
    pp = opts.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pp < 1 or world != pp:
        print(f"generate.py: error: --pipeline-model-parallel-size {pp} needs exactly {pp} ranks (this run has "
              f"{world}); launch with torchrun --nproc-per-node {pp}, or drop the flag for one process.",
              file=sys.stderr)
        return 2

    from megatron.core.models.gpt import generate  # the trainer's modules load on use
    from megatron.training.checkpointing import COMMON_FILENAME, load_common, read_tracker  # idem
    from megatron.training.training import build_tokenizer_from_args  # idem

    iteration_dir = os.path.isfile(os.path.join(opts.load, COMMON_FILENAME))
    if opts.iteration is None and not iteration_dir and read_tracker(opts.load) is None:
        print(f"generate.py: error: no checkpoint in {opts.load!r} (no latest_checkpointed_iteration.txt "
              "or common.json); pass the --save directory of a finished run or one iteration directory.",
              file=sys.stderr)
        return 2
    path, common = load_common(opts.load, opts.iteration)
    saved = common["args"]
    try:
        args = _for_generation(_model_args(saved, opts, path, common.get("tokenizer")), pp)
        tokenizer = build_tokenizer_from_args(args)
        if pp > 1:
            from megatron.training.pipeline_arguments import pipeline_layout_from_args  # with the trainer's modules

            pipeline_layout_from_args(args)  # the layers split over pp stages, or a one-line error
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    rows = saved.get("padded_vocab_size")
    if rows is not None and rows != args.padded_vocab_size:
        print(f"generate.py: error: the tokenizer has {tokenizer.vocab_size} entries (padded to "
              f"{args.padded_vocab_size}), but the checkpoint's vocabulary has {rows} rows; pass the tokenizer "
              "the model was trained with.", file=sys.stderr)
        return 2

    if pp > 1:
        return _pipelined(opts, args, path, common, tokenizer, generate)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return _sample(opts, args, path, common, tokenizer, generate, device)


def _pipelined(opts, args, path, common, tokenizer, generate) -> int:
    """One pipeline stage per rank: the process groups around the sampling."""
    import torch.distributed as dist  # only a pipelined run needs process groups

    from megatron.core import parallel_state  # with the trainer's modules
    from megatron.training.initialize import initialize_distributed  # with the trainer's modules

    created = not dist.is_initialized()  # a caller's process group (tests) is left alone
    device = initialize_distributed("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(1, 1, device.type, pipeline_model_parallel_size=args.world_size)
    try:
        return _sample(opts, args, path, common, tokenizer, generate, device, show=dist.get_rank() == 0)
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _sample(opts, args, path, common, tokenizer, generate, device, show: bool = True) -> int:
    torch.manual_seed(opts.seed)
    # fp32 weights: bf16 gains nothing for sampling on a CPU.
    model, iteration = build_generation_model(args, path, device)
    iteration = iteration or common.get("iteration", 0)
    prompt_ids = tokenizer.tokenize(opts.prompt)
    if not prompt_ids:
        prompt_ids = [tokenizer.eod]
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    start = time.time()
    out = generate(
        model, input_ids, opts.max_new_tokens,
        top_k=opts.top_k, temperature=opts.temperature,
        eod=tokenizer.eod if opts.stop_at_eod else None,
        generator=torch.Generator(device=device).manual_seed(opts.seed),
    )
    if not show:
        return 0
    new_ids = out[0, len(prompt_ids):].tolist()
    mode = "greedy" if opts.top_k in (None, 1) else f"top-k {opts.top_k}, temperature {opts.temperature}"
    stages = f", {args.pipeline_model_parallel_size} pipeline stages" if args.pipeline_model_parallel_size > 1 else ""
    print(f"> sample from {path} (iteration {iteration}, {mode}{stages}, "
          f"{len(new_ids)} tokens in {time.time() - start:.1f} s):")
    print("-" * 80)
    # Detokenize prompt and continuation together: tokenizers own the spacing between ids.
    shown = out[0].tolist() if opts.prompt else new_ids
    print(tokenizer.detokenize(shown))
    print("-" * 80)
    return 0


if __name__ == "__main__":
    sys.exit(main())
