"""QK-norm and the attention output gate under TP x MFSDP equal the single-process model
(fp32), with and without sequence parallelism.

A rank's q/k norm gradient covers only its own heads: without sequence parallelism the
model sums it over TP itself, with it the trainer's ``all_reduce_sequence_parallel_grads``
does. Two SGD steps with active clipping: losses, gradient norms and every rank's piece of
every weight (the q/k norms included) must agree with the reference, and so must the
global tensors of the TP=2 checkpoint (the gate rows at their offsets in linear_qkv).
"""

import pytest
import torch
import torch.distributed as dist
from _tp_models import (
    SEED,
    SEQ,
    UNPADDED_VOCAB,
    VOCAB,
    check_training_and_checkpoint,
    global_batches,
    parallel_state,
)

from megatron.core.global_slices import global_slices_by_name
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_

QWEN3_NEXT_ATTENTION = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                            ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                            add_bias_linear=False, position_embedding_type="rope", qk_layernorm=True,
                            attention_output_gate=True)


def _build(state=None, sequence_parallel=False):
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**QWEN3_NEXT_ATTENTION, tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel, tp_group=None if tp == 1 else state.tp_group)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                     share_embeddings_and_output_weights=False)
    initialize_parameters_(model, SEED)
    return model


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_qk_norm_and_output_gate_under_tensor_parallelism(sequence_parallel, tmp_path):
    state = parallel_state(2)
    reference = _build()
    # Norm weights away from one (the same in both models, they are replicated over TP), so
    # that their gradients shape the outputs.
    qk_norms = {}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if ".q_layernorm." in name or ".k_layernorm." in name:
                p.add_(torch.linspace(-0.5, 0.5, p.numel()))
                qk_norms[name] = p.detach().clone()
    model = _build(state, sequence_parallel)
    model.load_state_dict(qk_norms, strict=False)
    check_training_and_checkpoint(model, reference, state, sequence_parallel, tmp_path)


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_qk_norm_gradients_cover_every_head(sequence_parallel):
    """The q/k norm gradients, summed over TP by the model (no SP) or by
    all_reduce_sequence_parallel_grads (SP), are the reference's (their share of the total
    gradient is too small for the training test above to see a missing sum)."""
    state = parallel_state(2)
    reference, model = _build(), _build(state, sequence_parallel)
    ids, labels = global_batches(1)[0][0]
    reference(ids, labels=labels).mean().backward()
    model(ids, labels=labels).mean().backward()
    if sequence_parallel:
        all_reduce_sequence_parallel_grads(model, state.tp_group)
    expected = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters() if ".q_layernorm." in n or ".k_layernorm." in n]
    assert len(names) == 4
    for name, p in model.named_parameters():
        if name in names:
            torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
           gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", qk_layernorm=True,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=12)


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_multi_latent_attention_gradients_under_tensor_parallelism(sequence_parallel):
    """Every gradient of a TP=2 MLA model (down projections and latent norms replicated, up
    projections split by heads, the shared rope key summed over TP) is its piece of the
    TP=1 model's, after the trainer's SP reduction; so are the logits."""
    state = parallel_state(2)

    def build(tp):
        config = TransformerConfig(**MLA, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
                                   tp_group=state.tp_group if tp > 1 else None)
        model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                         share_embeddings_and_output_weights=False)
        initialize_parameters_(model, SEED)
        return model

    reference, model = build(1), build(2)
    ids, labels = global_batches(1)[0][0]
    reference(ids, labels=labels).mean().backward()
    model(ids, labels=labels).mean().backward()
    if sequence_parallel:
        all_reduce_sequence_parallel_grads(model, state.tp_group)
    pieces, expected = global_slices_by_name(model), dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in names
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    for name, p in model.named_parameters():
        ref = expected[name].grad
        ref = pieces[name].take(ref) if name in pieces else ref
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
