"""Token (and optionally learned absolute position) embeddings: Megatron-LM's
``LanguageModelEmbedding`` with submodules ``word_embeddings`` and ``position_embeddings``."""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer.layers import Embedding, reset_parameters_of
from megatron.core.transformer.transformer_config import TransformerConfig


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: str = "learned_absolute"):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.word_embeddings = _word_embeddings(config, vocab_size)
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = Embedding(max_sequence_length, config.hidden_size,
                                                 init_std=config.init_method_std, dtype=config.params_dtype,
                                                 gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        else:
            self.position_embeddings = None

    def reset_parameters(self) -> None:
        reset_parameters_of(self)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """input_ids, position_ids [b, s] -> embeddings [b, s, hidden] (dropout applied).

        With sequence parallelism: [b, s / tp, hidden], this rank's chunk of the sequence
        (the vocab-parallel lookup reduce-scatters; the positions are this chunk's)."""
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if self.config.sequence_parallel:
                position_ids = _sequence_chunk(position_ids, self.config.tp_group)
            embeddings = embeddings + self.position_embeddings(position_ids)
        if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
            embeddings = embeddings * self.config.mup_embedding_mult  # muP's input multiplier
        return F.dropout(embeddings, p=self.config.hidden_dropout, training=self.training)


def _word_embeddings(config: TransformerConfig, vocab_size: int) -> torch.nn.Module:
    if config.tensor_model_parallel_size == 1:
        return Embedding(vocab_size, config.hidden_size, init_std=config.init_method_std, dtype=config.params_dtype,
                         gradient_accumulation_fusion=config.gradient_accumulation_fusion)

    return VocabParallelEmbedding(vocab_size, config.hidden_size, init_std=config.init_method_std,
                                  tp_group=config.tp_group, sequence_parallel=config.sequence_parallel,
                                  dtype=config.params_dtype,
                                  gradient_accumulation_fusion=config.gradient_accumulation_fusion)


def _sequence_chunk(position_ids: torch.Tensor, tp_group) -> torch.Tensor:
    return position_ids.chunk(dist.get_world_size(tp_group), dim=1)[dist.get_rank(tp_group)]
