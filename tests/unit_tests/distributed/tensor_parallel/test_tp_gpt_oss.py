"""A GPT-OSS-style model (learnable attention sinks, a sliding-window layer and a full one,
clamped quick-GEGLU with the linear offset, GQA) under TP=2 x MFSDP equals the
single-process model (fp32), with and without sequence parallelism: two SGD steps with
active clipping give the reference's losses and gradient norms, every rank's piece of every
weight (the sinks split over TP with their heads included) ends equal to its slice of the
reference, and the TP=2 checkpoint holds the reference's global tensors.
"""

import pytest
import torch
import torch.distributed as dist
from _tp_models import SEED, SEQ, UNPADDED_VOCAB, VOCAB, check_training_and_checkpoint, parallel_state

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_

GPT_OSS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
               normalization="RMSNorm", gated_linear_unit=True, activation_func="quick_gelu", add_bias_linear=False,
               position_embedding_type="rope", softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=2,
               glu_linear_offset=1.0, activation_func_clamp_value=0.05)


def _build(state=None, sequence_parallel=False):
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**GPT_OSS, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                               tp_group=None if tp == 1 else state.tp_group)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                     share_embeddings_and_output_weights=False)
    initialize_parameters_(model, SEED)
    return model


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_gpt_oss_under_tensor_parallelism(sequence_parallel, tmp_path):
    state = parallel_state(2)
    reference = _build()
    windows = [layer.self_attention.window_size for layer in reference.decoder.layers]
    assert windows == [(3, 0), None], windows
    model = _build(state, sequence_parallel)
    sinks = model.decoder.layers[0].self_attention.softmax_offset
    assert sinks.shape == (2,) and dict(model.named_parameters())["decoder.layers.0.self_attention.softmax_offset"] \
        is sinks
    check_training_and_checkpoint(model, reference, state, sequence_parallel, tmp_path)
