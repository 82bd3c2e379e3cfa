#!/usr/bin/env python
"""Pretrain a GPT model (Megatron-LM's entry point, with MFSDP v2 via --use-mfsdp).

    python -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 2 --seq-length 128 \
        --micro-batch-size 8 --global-batch-size 16 --lr 5e-3 --train-iters 200 --use-mfsdp

Without --data-path or --mock-data the Shakespeare corpus is used (built once per
tokenizer by tools/prepare_shakespeare.py into data/cache).
"""

import dataclasses
import os
import sys
from functools import partial

import torch

_REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.core.transformer.document_mask import DocumentMask  # noqa: E402
from megatron.training import pretrain, print_rank_0  # noqa: E402
from megatron.training.fim_arguments import fim_transform_from_args  # noqa: E402
from megatron.training.shutdown import leave  # noqa: E402


def core_transformer_config_from_args(args):
    from megatron.core.transformer import TransformerConfig
    from megatron.training.context_parallel_arguments import context_parallel_config_kwargs
    from megatron.training.model_builder import activation_from_args
    from megatron.training.gpt_oss_arguments import gpt_oss_config_kwargs
    from megatron.training.linear_attention_arguments import linear_attention_config_kwargs
    from megatron.training.mla_arguments import mla_config_kwargs
    from megatron.training.moe_arguments import moe_config_kwargs
    from megatron.training.mup_arguments import mup_config_kwargs
    from megatron.training.recipe_arguments import recipe_config_kwargs

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu or getattr(args, "quick_geglu", False),
        activation_func=activation_from_args(vars(args)),
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        init_method_std=args.init_method_std,
        params_dtype=args.params_dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        transformer_impl=args.transformer_impl,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        # getattr: argument sets saved before these flags existed (older or converted
        # checkpoints, read back by tools/generate.py) mean the defaults.
        kv_channels=getattr(args, "kv_channels", None),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_interleaved=getattr(args, "rotary_interleaved", False),
        apply_layernorm_1p=getattr(args, "apply_layernorm_1p", False),
        attention_softmax_in_fp32=getattr(args, "attention_softmax_in_fp32", False),
        attention_backend=getattr(args, "attention_backend", "auto"),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        attention_output_gate=getattr(args, "attention_output_gate", False),
        gradient_accumulation_fusion=getattr(args, "gradient_accumulation_fusion", True),
        **tensor_parallel_config_from_args(args),
        **context_parallel_config_kwargs(args),
        **moe_config_kwargs(args),
        **mla_config_kwargs(args),
        **linear_attention_config_kwargs(args),
        **gpt_oss_config_kwargs(args),
        **recipe_config_kwargs(args),
        **mup_config_kwargs(args),
    )
    if getattr(args, "squared_relu", False):
        config.activation_func = "squared_relu"
    return config


def tensor_parallel_config_from_args(args):
    """TP size, sequence parallelism and the TP group (from megatron.core.parallel_state)."""
    from megatron.core import parallel_state

    tp = getattr(args, "tensor_model_parallel_size", 1)
    if tp == 1:
        return {}
    return dict(tensor_model_parallel_size=tp, sequence_parallel=args.sequence_parallel,
                tp_group=parallel_state.get_tensor_model_parallel_group())


def model_provider(args, pre_process=True, post_process=True, vp_stage=None):
    """Build the (unwrapped) GPT model, or under pipeline parallelism this rank's chunk
    ``vp_stage`` (Megatron's ``pre_process``/``post_process``); the trainer shards or wraps it."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.expert_parallel import build_expert_parallel
    from megatron.training.pipeline_arguments import pipeline_layout_from_args

    print_rank_0("> building GPT model ...")
    config = core_transformer_config_from_args(args)
    expert_parallel = None
    if config.num_moe_experts:
        if not torch.distributed.is_initialized():
            # One process (tools reading a checkpoint with its saved flags): every expert is
            # local. Checkpoints store experts globally, so any saved EP size loads.
            config = dataclasses.replace(config, expert_model_parallel_size=1, expert_tensor_parallel_size=None)
        expert_parallel = build_expert_parallel(config.expert_model_parallel_size, getattr(args, "device_type", "cpu"),
                                                tp_size=config.tensor_model_parallel_size,
                                                dp_outer_size=getattr(args, "dp_outer_size", 1)
                                                if torch.distributed.is_initialized() else 1,
                                                expert_tp_size=config.expert_tensor_parallel_size)
    layer_numbers = None
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        layer_numbers = pipeline_layout_from_args(args).layers_of(parallel_state.get_pipeline_model_parallel_rank(),
                                                                  vp_stage or 0)
    return GPTModel(
        config,
        expert_parallel=expert_parallel,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        unpadded_vocab_size=getattr(args, "unpadded_vocab_size", None),
        pre_process=pre_process,
        post_process=post_process,
        layer_numbers=layer_numbers,
    )


def default_corpus_dir(args):
    return args.data_cache_path or os.path.join(_REPO_ROOT, "data", "cache")


def train_valid_test_datasets_provider(args, tokenizer, train_val_test_num_samples):
    """Mock data, --data-path, or (neither) the default Shakespeare corpus."""
    from megatron.core.datasets import MockGPTDataset, build_gpt_datasets

    # The EOD options (packed documents): loss mask, position ids, attention per document.
    documents = dict(eod_token=tokenizer.eod, eod_mask_loss=args.eod_mask_loss,
                     reset_position_ids=getattr(args, "reset_position_ids", False),
                     reset_attention_mask=getattr(args, "reset_attention_mask", False))
    if args.mock_data:
        print_rank_0("> using mock data")
        n_train, n_valid, n_test = train_val_test_num_samples
        vocab = tokenizer.vocab_size
        mock = partial(MockGPTDataset, seq_length=args.seq_length, vocab_size=vocab, **documents)
        return (
            mock(n_train, seed=args.seed),
            mock(n_valid, seed=args.seed + 1) if n_valid else None,
            mock(n_test, seed=args.seed + 2) if n_test else None,
        )
    data_path = args.data_path
    if not data_path:
        if args.tokenizer_type == "NullTokenizer":
            raise ValueError(
                "the default Shakespeare corpus is text; NullTokenizer has none. Use a text tokenizer, "
                "--mock-data, or pass --data-path."
            )
        from tools.prepare_shakespeare import prepare_shakespeare

        # Tokenized once per tokenizer (GPT-2 BPE, or any other under a name of its own).
        tokenizer_flags = {k: getattr(args, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
        data_path = [prepare_shakespeare(default_corpus_dir(args), tokenizer=tokenizer_flags)]
        print_rank_0(f"> using the Shakespeare corpus at {data_path[0]}")
    cache_dir = os.path.join(args.data_cache_path or os.path.join(_REPO_ROOT, "data", "cache"), "index")
    return build_gpt_datasets(
        data_path,
        args.split,
        train_val_test_num_samples,
        args.seq_length,
        args.seed,
        cache_dir,
        mmap_bin_files=args.mmap_bin_files,
        fim=fim_transform_from_args(args, tokenizer),
        **documents,
    )


def loss_func(loss_mask, output_tensor):
    """Sum of the masked per-token losses; the schedule normalizes over the global batch."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    # --reset-attention-mask: the batch carries each token's document start (every pipeline
    # stage reads the same batch, so nothing travels between stages for it).
    attention_mask = DocumentMask(batch["document_start"]) if "document_start" in batch else None
    output_tensor = model(batch["tokens"], batch["position_ids"], attention_mask, labels=batch["labels"],
                          loss_mask=batch["loss_mask"])  # read by multi-token prediction only
    return output_tensor, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step)
    leave(0)  # after the ordered shutdown; megatron/training/shutdown.py says why not a plain return
