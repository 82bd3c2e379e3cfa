"""GPTModel: embedding -> TransformerBlock decoder -> output layer (-> per-token loss).

Module and parameter names are Megatron-LM's (``embedding.word_embeddings``,
``embedding.position_embeddings``, ``decoder.layers.{i}....``, ``decoder.final_layernorm``,
``output_layer``), so Megatron checkpoint tooling and the converters in tools/ can rely on
them. Tensors are batch-first: input_ids [b, s], logits [b, s, vocab].

Pipeline parallelism (Megatron's ``pre_process`` / ``post_process``): a model chunk holds
the embedding only if it is the first chunk, the final norm, output layer and loss only if
it is the last, and the global layers it is given. A chunk that does not embed takes its
input from ``set_input_tensor`` (the previous stage's hidden states); one that does not
end returns hidden states. With tied embeddings the last stage keeps its own copy of the
word-embedding weight under the same name, ``embedding.word_embeddings.weight``, built as
the output projection: both copies start equal (they are initialized from the same name),
and the trainer sums their gradients over the first and last stage before each step.
Multi-token prediction runs on the last chunk, and its depths embed tokens: that chunk
then holds the whole embedding module (the same names as the first chunk's, tied to the
output layer as there or not), a copy kept equal in the same way.
"""

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.models.common.language_model_embedding import LanguageModelEmbedding
from megatron.core.step_phases import phase_range
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.grad_accumulation_fusion import linear
from megatron.core.transformer.layers import reset_parameters_of
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import _POSITION_EMBEDDING_TYPES, ROTARY_TYPES, TransformerConfig


class OutputLayer(nn.Module):
    """Projects hidden states to vocabulary logits (no bias, as in Megatron).

    With tied embeddings it owns no parameter: the caller passes the word-embedding weight
    to ``forward`` on every call. Reading the weight at call time (rather than storing a
    second reference) keeps exactly one Parameter in the model, and lets a sharding engine
    swap that parameter's storage without the output layer holding a stale alias.
    """
    def __init__(self, hidden_size: int, vocab_size: int, init_std: float, dtype: torch.dtype,
                 skip_weight_param_allocation: bool, gradient_accumulation_fusion: bool = True):
        super().__init__()
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.init_std = init_std
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        if weight is None:
            weight = self.weight
        if weight is None:
            raise RuntimeError(
                "output_layer was built without its own weight (tied embeddings); pass the "
                "word-embedding weight to forward(), as GPTModel does."
            )
        return linear(hidden_states, weight, fusion=self.gradient_accumulation_fusion)

    def extra_repr(self) -> str:
        tied = "tied to word embeddings" if self.weight is None else "own weight"
        return f"in={self.hidden_size}, vocab={self.vocab_size}, {tied}"


class GPTModel(nn.Module):
    """Decoder-only GPT language model.

    Args:
        config: the transformer architecture.
        vocab_size: rows of the embedding / logits width (pad it to a multiple of 128 on GPU).
        max_sequence_length: size of the learned position table (and, for generation, the
            longest context the model is fed).
        share_embeddings_and_output_weights: tie the output projection to the word
            embeddings (one Parameter, ``embedding.word_embeddings.weight``).
        position_embedding_type: "learned_absolute", "rope" or "yarn"; None uses the config's.
        unpadded_vocab_size: the tokenizer's vocabulary size when ``vocab_size`` is padded
            beyond it (``--make-vocab-size-divisible-by``). The padding rows are no tokens:
            their logits are -inf, so they take no part in the softmax, the loss or
            sampling, and the loss is that of the unpadded model. None: no padding.
        expert_parallel: the expert-parallel layout of the MoE layers
            (``megatron.core.transformer.moe.expert_parallel``); None: all experts local.
        pre_process: this chunk embeds the tokens (the first pipeline chunk).
        post_process: this chunk ends the model: final norm, output layer, loss (the last).
        layer_numbers: the global (0-based) transformer layers of this chunk; None: all.
    """
    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 share_embeddings_and_output_weights: bool = True,
                 position_embedding_type: Optional[str] = None,
                 unpadded_vocab_size: Optional[int] = None, expert_parallel=None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Optional[Sequence[int]] = None):
        super().__init__()
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}; take it from the tokenizer.")
        if unpadded_vocab_size is None:
            unpadded_vocab_size = vocab_size
        if isinstance(unpadded_vocab_size, bool) or not isinstance(unpadded_vocab_size, int) or not (
                1 <= unpadded_vocab_size <= vocab_size):
            raise ValueError(
                f"unpadded_vocab_size must be an integer in [1, vocab_size={vocab_size}], got "
                f"{unpadded_vocab_size!r}; pass the tokenizer's vocabulary size."
            )
        if not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(
                f"max_sequence_length must be a positive integer, got {max_sequence_length!r}; "
                "set it to at least the training sequence length."
            )
        if position_embedding_type is None:
            position_embedding_type = config.position_embedding_type
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {_POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}."
            )
        if position_embedding_type in ROTARY_TYPES and config.kv_channels % 2 != 0:
            raise ValueError(
                f"rotary position embeddings need an even head dimension, but kv_channels is {config.kv_channels}; "
                "use learned_absolute positions or an even kv_channels."
            )
        self.config = config
        self.vocab_size = vocab_size
        self.unpadded_vocab_size = unpadded_vocab_size
        self.max_sequence_length = max_sequence_length
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type

        self.pre_process = bool(pre_process)
        self.post_process = bool(post_process)
        self._input_tensor: Optional[torch.Tensor] = None
        # Multi-token prediction (multi_token_prediction.py): after the decoder, on the last chunk.
        has_mtp = bool(getattr(config, "mtp_num_layers", None)) and self.post_process
        if has_mtp and not self.pre_process and position_embedding_type == "learned_absolute":
            raise ValueError("multi-token prediction on a pipeline stage that does not embed needs rotary "
                             "positions (the learned position table would need a synchronized copy); use "
                             "position_embedding_type='rope' or pipeline size 1.")
        # The output projection of a last stage that does not also embed, with tied weights:
        # it owns the stage's copy of the word embedding (see the module docstring).
        self._tied_copy = share_embeddings_and_output_weights and self.post_process and not self.pre_process \
            and not has_mtp
        self.embedding = None
        if self.pre_process or has_mtp:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length, position_embedding_type)
        elif self._tied_copy:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = _output_projection(config, vocab_size, tied=False)
        if position_embedding_type in ROTARY_TYPES:
            # Sized to the rotated dimensions: with rotary_percent < 1 the rest pass through.
            self.rotary_pos_emb = RotaryEmbedding(config.rotary_dim, config.rotary_base, config.rotary_interleaved,
                                                  yarn=config.yarn if position_embedding_type == "yarn" else None)
        else:
            self.rotary_pos_emb = None
        self.decoder = TransformerBlock(config, expert_parallel=expert_parallel, layer_numbers=layer_numbers,
                                        post_layer_norm=self.post_process)
        if config.multi_latent_attention:
            # MLA rotates only its decoupled part (qk_pos_emb_head_dim), always, as upstream.
            self.rotary_pos_emb = RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_base)
        self.output_layer = None
        if self.post_process and not self._tied_copy:
            self.output_layer = _output_projection(config, vocab_size, tied=share_embeddings_and_output_weights)
        self.mtp = MultiTokenPredictionBlock(config, expert_parallel) if has_mtp else None

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The weight the output layer multiplies with (Megatron's name for it); under
        pipeline parallelism, this chunk's copy of it (None if the chunk has neither)."""
        if self.share_embeddings_and_output_weights:
            return self.embedding.word_embeddings.weight if self.embedding is not None else None
        return self.output_layer.weight if self.output_layer is not None else None

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The previous pipeline stage's hidden states, for the next forward of a chunk that
        does not embed (Megatron's API; the pipeline schedule calls it)."""
        self._input_tensor = input_tensor

    def reset_parameters(self) -> None:
        """Re-initialize every parameter as at construction (normal(0, init_method_std)
        weights, residual-output projections scaled by 1/sqrt(2 * num_layers), zero biases,
        unit norm weights). Use after ``to_empty()`` on a model built on the meta device."""
        reset_parameters_of(self)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, s, vocab] when ``labels`` is None, else the per-token cross-entropy
        loss [b, s] in fp32 (no reduction: the caller applies its loss mask). Logits of
        padding rows (ids >= ``unpadded_vocab_size``) are -inf. ``loss_mask`` [b, s] is
        read only by multi-token prediction (its losses are masked and averaged inside).

        attention_mask (optional) is Megatron's: bool, True where attention is NOT allowed,
        broadcastable to [b, heads, s, s]; it is combined with the causal mask. Or, for
        packed documents, a ``DocumentMask`` (transformer/document_mask.py; also under CP).
        """
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor of shape [batch, sequence], got shape "
                f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}."
            )
        batch, seq = input_ids.shape
        if position_ids is None:
            if self.position_embedding_type == "learned_absolute" and seq > self.max_sequence_length:
                raise ValueError(
                    f"sequence length {seq} exceeds max_sequence_length {self.max_sequence_length} of the "
                    "learned position embeddings; shorten the input or build the model with a larger "
                    "max_sequence_length."
                )
            position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}."
            )

        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            hidden_states, self._input_tensor = self._input_tensor, None
            if hidden_states is None:
                raise RuntimeError("this pipeline chunk does not embed tokens: call set_input_tensor(hidden_states) "
                                   "with the previous stage's output before each forward (the schedule does).")
        rotary_pos_emb = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        hidden_states = self.decoder(hidden_states, attention_mask, rotary_pos_emb)
        if not self.post_process:
            return hidden_states
        if self.mtp is not None and labels is not None and self.training and torch.is_grad_enabled():
            hidden_states = self.mtp.attach_losses(hidden_states, input_ids, position_ids, labels, loss_mask,
                                                   self.embedding, self._output, attention_mask, rotary_pos_emb)
        return self._output(hidden_states, labels)

    def _output(self, hidden_states: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """Hidden states [b, s, h] -> logits, or the per-token loss [b, s] given labels."""
        projection = self.embedding.word_embeddings if self._tied_copy else self.output_layer
        if self._tied_copy:
            logits = projection(hidden_states)
        else:
            output_weight = self.embedding.word_embeddings.weight if self.share_embeddings_and_output_weights else None
            logits = projection(hidden_states, weight=output_weight)
        if self.config.use_mup and self.config.mup_output_mult != 1.0:
            logits = logits * self.config.mup_output_mult  # muP's output multiplier (1 / width_mult)
        if self.config.tensor_model_parallel_size > 1:
            return self._vocab_parallel_output(logits, labels)
        padded = self.unpadded_vocab_size < self.vocab_size
        if labels is None:
            if padded:
                is_padding = torch.arange(self.vocab_size, device=logits.device) >= self.unpadded_vocab_size
                logits = logits.masked_fill(is_padding, float("-inf"))
            return logits
        if padded:
            logits = logits[..., :self.unpadded_vocab_size]
        # Softmax over a large vocabulary in bf16 loses too much; upcast for the loss.
        with phase_range("loss"):
            loss = F.cross_entropy(logits.float().reshape(-1, self.unpadded_vocab_size), labels.reshape(-1).long(),
                                   reduction="none")
        return loss.view(labels.shape)

    def _vocab_parallel_output(self, logits: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits [b, s, V/tp] of this rank's vocabulary ids -> the per-token loss (no rank
        gathers the logits), or without labels the gathered logits [b, s, V]."""
        group = self.config.tp_group
        projection = self.embedding.word_embeddings if self._tied_copy else self.output_layer
        vocab_start = projection.global_slices["weight"].ranges[0][0]
        if self.unpadded_vocab_size < self.vocab_size:
            ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
            logits = logits.masked_fill(ids >= self.unpadded_vocab_size, float("-inf"))
        if labels is None:
            return gather_from_tensor_model_parallel_region(logits, group)
        with phase_range("loss"):
            return vocab_parallel_cross_entropy(logits, labels, group, vocab_start)


def _output_projection(config: TransformerConfig, vocab_size: int, tied: bool) -> nn.Module:
    """Hidden states -> logits: its own weight, or (``tied``) none, the caller passing the
    word embedding's. Under TP the vocabulary is split: logits [b, s, V/tp]."""
    if config.tensor_model_parallel_size > 1:
        return _vocab_parallel_output_layer(config, vocab_size, tied)
    return OutputLayer(config.hidden_size, vocab_size, init_std=config.init_method_std, dtype=config.params_dtype,
                       skip_weight_param_allocation=tied,
                       gradient_accumulation_fusion=config.gradient_accumulation_fusion)


def _vocab_parallel_output_layer(config: TransformerConfig, vocab_size: int, tied: bool) -> nn.Module:
    """The output projection with the vocabulary split over TP (rows of the tied word
    embedding, or its own weight): logits [b, s, V/tp]."""
    return ColumnParallelLinear(config.hidden_size, vocab_size, bias=False, init_std=config.init_method_std,
                                tp_group=config.tp_group, sequence_parallel=config.sequence_parallel,
                                dtype=config.params_dtype, skip_weight_param_allocation=tied,
                                gradient_accumulation_fusion=config.gradient_accumulation_fusion)
