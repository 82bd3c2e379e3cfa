"""Transformer building blocks with Megatron-LM module names (local or Transformer Engine)."""

from .attention import SelfAttention
from .backends import import_transformer_engine
from .gated_delta_net import GatedDeltaNet
from .layers import Embedding, Linear, build_linear, output_init_std, reset_parameters_of
from .mlp import MLP
from .norms import LayerNorm, RMSNorm, build_norm
from .rope import RotaryEmbedding, apply_rotary_pos_emb
from .transformer_block import TransformerBlock
from .transformer_config import ACTIVATION_FUNCTIONS, TransformerConfig
from .transformer_layer import TransformerLayer

__all__ = [
    "ACTIVATION_FUNCTIONS",
    "Embedding",
    "GatedDeltaNet",
    "LayerNorm",
    "Linear",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
    "apply_rotary_pos_emb",
    "build_linear",
    "build_norm",
    "import_transformer_engine",
    "output_init_std",
    "reset_parameters_of",
]
