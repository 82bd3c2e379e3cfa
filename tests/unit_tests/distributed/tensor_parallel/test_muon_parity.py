"""Muon on MFSDP shards (ZeRO-1, ZeRO-3, HSDP, HFSDP) and TP pieces equals single-process Muon.

Muon orthogonalizes whole matrices, so a rank holding some rows of a weight (and, under
TP, a piece of it) must gather them before Newton-Schulz. Each case trains the tiny
Llama model (GQA: the QKV split; SwiGLU: fc1's gate and up blocks under TP) a few steps
with ``--optimizer muon`` (fp32 Newton-Schulz), and the same with a MoE layer (each
stacked expert its own matrix, its rows cut anywhere by the shards), and the same model at TP 1 in one process
on the whole global batch; losses, gradient norms and every rank's piece of every weight
must agree.
"""

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import check, full_tensor, wrap
from _tp_models import (
    ARCHITECTURES,
    HYBRID,
    SEED,
    SEQ,
    UNPADDED_VOCAB,
    VOCAB,
    MAX_NORM,
    assert_pieces_match,
    build_gpt,
    global_batches,
    parallel_state,
    train_parallel,
    train_reference,
    PLACEMENTS,
)

from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.muon import Muon
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_

# The Llama model with its second layer's MLP a MoE layer of 4 stacked SwiGLU experts.
MOE = dict(ARCHITECTURES["llama"], num_moe_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
           moe_router_topk=2)


def _build(arch, state=None, sequence_parallel=False):
    if arch != "moe":
        return build_gpt(arch, state, sequence_parallel)
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**MOE, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                               tp_group=None if tp == 1 else state.tp_group)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                     share_embeddings_and_output_weights=False)
    initialize_parameters_(model, SEED)
    return model


def _layouts():
    world = dist.get_world_size()
    layouts = [(1, "zero3", "llama"), (1, "zero1", "llama"), (1, "zero3", "gpt2"), (1, "zero3", "moe")]
    if world >= 4:
        layouts += [(1, "hsdp", "llama"), (1, "hfsdp", "llama"), (1, "hfsdp", "moe")]
    if world >= 2:
        layouts += [(2, "zero3", "llama"), (2, "zero1", "llama"), (2, "zero3", "moe")]
    return layouts


def _muon(model, tp_mode="duplicated"):
    config = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_nesterov=True,
                             muon_fp32_matmul_prec="high", muon_tp_mode=tp_mode, muon_extra_scale_factor=0.2)
    return get_megatron_optimizer(config, model)


@pytest.mark.parametrize("tp,strategy,arch", _layouts())
def test_sharded_muon_equals_single_process(tp, strategy, arch):
    state = parallel_state(tp, dp_outer=2 if strategy in HYBRID else 1)
    batches = global_batches(3)
    reference = _build(arch)
    ref_opt = _muon(reference)
    ref_losses, ref_norms = train_reference(reference, ref_opt, batches)

    model = _build(arch, state, sequence_parallel=tp > 1)
    ctx = wrap(model, units=list(model.decoder.layers) + [model], mesh=state.dp_mesh,
               placements=PLACEMENTS[strategy]())
    opt = fully_shard_optimizer(_muon(model))
    losses, norms = train_parallel(model, ctx, opt, state, tp > 1, batches)

    assert isinstance(opt, Muon) and any(g["use_muon"] for g in opt.param_groups)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(ref_norms).float(), rtol=1e-4, atol=1e-6)
    check(all(float(n) > MAX_NORM for n in ref_norms), "clipping was not active; lower MAX_NORM")
    assert_pieces_match(model, reference)


@pytest.mark.skipif(dist.get_world_size() < 2, reason="TP pieces need two ranks")
def test_blockwise_tp_mode_orthogonalizes_each_piece_apart():
    """--muon-tp-mode blockwise differs from the whole-matrix update (upstream: it depends
    on the TP size), and duplicated and distributed give the same weights."""
    state = parallel_state(2)
    batches = global_batches(1)
    finals = {}
    for mode in ("duplicated", "distributed", "blockwise"):
        model = build_gpt("llama", state)
        ctx = wrap(model, units=list(model.decoder.layers) + [model], mesh=state.dp_mesh,
                   placements=PLACEMENTS["zero3"]())
        train_parallel(model, ctx, fully_shard_optimizer(_muon(model, mode)), state, False, batches)
        weight = model.decoder.layers[0].self_attention.linear_proj.weight
        finals[mode] = full_tensor(weight.detach())
    torch.testing.assert_close(finals["distributed"], finals["duplicated"], rtol=0, atol=0)
    check(not torch.allclose(finals["blockwise"], finals["duplicated"], rtol=1e-4, atol=1e-6),
          "blockwise gave the whole-matrix update")
