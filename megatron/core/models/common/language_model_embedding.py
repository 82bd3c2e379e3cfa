"""Token (and optionally learned absolute position) embeddings: Megatron-LM's
``LanguageModelEmbedding`` with submodules ``word_embeddings`` and ``position_embeddings``."""

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

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
        self.word_embeddings = Embedding(vocab_size, config.hidden_size, init_std=config.init_method_std,
                                         dtype=config.params_dtype)
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = Embedding(max_sequence_length, config.hidden_size,
                                                 init_std=config.init_method_std, dtype=config.params_dtype)
        else:
            self.position_embeddings = None

    def reset_parameters(self) -> None:
        reset_parameters_of(self)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """input_ids, position_ids [b, s] -> embeddings [b, s, hidden] (dropout applied)."""
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        return F.dropout(embeddings, p=self.config.hidden_dropout, training=self.training)
