"""A hybrid gated delta-net model (Qwen3-Next's layout: linear layers, then gated softmax
attention) under TP=2 x MFSDP equals the single-process model (fp32), with and without
sequence parallelism: two SGD steps with active clipping give the reference's losses and
gradient norms, every rank's piece of every weight (in_proj's [q k v z b a] blocks, the
convolution's channels, A_log, dt_bias, the replicated gated norm) ends equal to its slice
of the reference, and the TP=2 checkpoint holds the reference's global tensors. A meta-device
build initializes to the same weights.
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
    parallel_state,
    reference_piece,
)

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.initialization import initialize_parameters_

HYBRID = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
              normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
              qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
              linear_attention_freq=3, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4)


def _build(state=None, sequence_parallel=False, device=None):
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**HYBRID, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                               tp_group=None if tp == 1 else state.tp_group)
    with torch.device(device or "cpu"):
        model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                         share_embeddings_and_output_weights=False)
    if device == "meta":
        model.to_empty(device="cpu")
    initialize_parameters_(model, SEED)
    return model


def _move_norms_off_one(reference):
    """The replicated gated-norm weights away from one (the same in both models), so that a
    missing TP sum of their gradients shows."""
    norms = {}
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if ".out_norm." in name:
                p.add_(torch.linspace(-0.5, 0.5, p.numel()))
                norms[name] = p.detach().clone()
    return norms


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_gated_delta_net_under_tensor_parallelism(sequence_parallel, tmp_path):
    state = parallel_state(2)
    reference = _build()
    kinds = [type(layer.self_attention).__name__ for layer in reference.decoder.layers]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "SelfAttention"], kinds
    norms = _move_norms_off_one(reference)
    model = _build(state, sequence_parallel)
    model.load_state_dict(norms, strict=False)
    check_training_and_checkpoint(model, reference, state, sequence_parallel, tmp_path)


@pytest.mark.skipif(dist.get_world_size() % 2 != 0, reason="needs an even world size for TP 2")
def test_tp_pieces_and_meta_build_are_the_reference_slices():
    """Initialization does not depend on the TP size or on building on meta: each rank's
    pieces are its slices of the TP=1 weights, and the per-rank heads are whole blocks."""
    state = parallel_state(2)
    reference = dict(_build().named_parameters())
    for model in (_build(state), _build(state, device="meta")):
        for module_name, module in model.named_modules():
            for attr, param in module._parameters.items():
                name = f"{module_name}.{attr}"
                assert torch.equal(param.detach(), reference_piece(reference[name].detach(), module, attr)), name
        gdn = model.decoder.layers[0].self_attention
        assert isinstance(gdn, GatedDeltaNet)
        assert gdn.in_proj.weight.shape[0] == (2 * 8 + 2 * 12 + 2 * 2) and gdn.A_log.shape == (2,)
        assert gdn.conv1d.weight.shape == (8 + 8 + 12, 1, 4)
