"""Megatron-LM's multi-latent attention flags (DeepSeek-V2/V3): parsing and parse-time checks.

Names, defaults and meanings are upstream's (``--multi-latent-attention``, ``--q-lora-rank``,
``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``); the
model is ``megatron/core/transformer/multi_latent_attention.py``. ``validate_mla_args`` runs
the config's own checks on the parsed flags, so that a bad combination fails before any
process group exists, with the same message.
"""

from __future__ import annotations

import argparse
import types

from megatron.core.transformer.transformer_config import TransformerConfig


def add_mla_args(group) -> None:
    group.add_argument("--multi-latent-attention", action="store_true",
                       help="DeepSeek-V2/V3 multi-latent attention: low-rank compressed queries and keys/values, "
                            "a decoupled RoPE part shared by the heads")
    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="rank of the queries' low-rank representation (default: no query compression)")
    group.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the keys' and values' latent")
    group.add_argument("--qk-head-dim", type=int, default=128,
                       help="each head's query/key dimension without position (q head dim = this + the next)")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                       help="the decoupled RoPE part of each query/key head")
    group.add_argument("--v-head-dim", type=int, default=128, help="each head's value dimension")


def mla_config_kwargs(args) -> dict:
    """The ``TransformerConfig`` MLA fields (getattr: argument sets saved before these flags
    existed mean standard attention)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(multi_latent_attention=get("multi_latent_attention", False), q_lora_rank=get("q_lora_rank"),
                kv_lora_rank=get("kv_lora_rank", 32), qk_head_dim=get("qk_head_dim", 128),
                qk_pos_emb_head_dim=get("qk_pos_emb_head_dim", 64), v_head_dim=get("v_head_dim", 128))


def validate_mla_args(args: argparse.Namespace) -> None:
    """The MLA checks of ``TransformerConfig`` (ValueError with the fix), at parse time."""
    if not getattr(args, "multi_latent_attention", False):
        return

    if getattr(args, "position_embedding_type", None) == "yarn":  # MLA's rotary part is plain RoPE here
        raise ValueError("--multi-latent-attention with --position-embedding-type yarn is not supported yet (MLA's "
                         "rotary part uses plain RoPE); use --position-embedding-type rope.")
    fields = mla_config_kwargs(args)
    fields.update(attention_output_gate=getattr(args, "attention_output_gate", False),
                  context_parallel_size=getattr(args, "context_parallel_size", 1))
    TransformerConfig._check_multi_latent_attention(types.SimpleNamespace(**fields))
