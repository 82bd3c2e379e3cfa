"""Tiny GPT-2- and Llama-style models at any TP size, and the parallel states of the tests.

A model at TP size T is built from the same seed as the single-process reference
(``initialize_parameters_``: each TP piece is cut from the same global tensor), so
comparing a rank's piece with ``global_slices[name].take(reference)`` needs no gather
over TP.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from megatron.core.global_slices import global_slices_of
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState, build_parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_

SEED = 11
VOCAB, UNPADDED_VOCAB, SEQ = 64, 60, 8

ARCHITECTURES = {
    # GPT-2: LayerNorm, GELU, biases, learned positions, tied embeddings, padded vocabulary.
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
    # Llama: RMSNorm, SwiGLU, GQA (8 heads in 4 groups), RoPE, no biases, untied output.
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                  normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                  position_embedding_type="rope"),
}

_STATES: Dict[Tuple[int, int], ParallelState] = {}


def parallel_state(tp: int, dp_outer: int = 1) -> ParallelState:
    """The mesh for (TP, outer DP) over the whole world (built once: meshes create groups)."""
    key = (tp, dp_outer)
    if key not in _STATES:
        _STATES[key] = build_parallel_state(tp, dp_outer, "cpu")
    return _STATES[key]


def build_gpt(arch: str, state: ParallelState = None, sequence_parallel: bool = False) -> GPTModel:
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**ARCHITECTURES[arch], tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel, tp_group=None if tp == 1 else state.tp_group)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                     share_embeddings_and_output_weights=arch == "gpt2")
    initialize_parameters_(model, SEED)
    return model


def token_batch(generator: torch.Generator, rows: int):
    ids = torch.randint(0, UNPADDED_VOCAB, (rows, SEQ), generator=generator)
    labels = torch.randint(0, UNPADDED_VOCAB, (rows, SEQ), generator=generator)
    return ids, labels


def named_pieces(model):
    """(name, module, attribute, parameter) of every parameter (tied ones once)."""
    seen = set()
    for module_name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{module_name}.{attr}" if module_name else attr), module, attr, param


def reference_piece(reference_tensor: torch.Tensor, module, attr: str) -> torch.Tensor:
    """This rank's piece of a reference (TP size 1) tensor."""
    piece = global_slices_of(module).get(attr)
    return reference_tensor if piece is None else piece.take(reference_tensor)


def tp_world_layouts():
    """(TP size, strategy) pairs that fit this world: TP > 1 whenever the world allows."""
    world = dist.get_world_size()
    layouts = []
    for tp in (2, 4):
        if world % tp == 0:
            layouts += [(tp, "zero3"), (tp, "zero1")]
            if world // tp >= 2:
                layouts.append((tp, "hsdp"))
    return layouts or [(1, "zero3"), (1, "zero1")]
