"""Capacity dropping (--moe-expert-capacity-factor) under TP with sequence parallelism, as
upstream: each TP rank's router sees its own sequence chunk, so capacity is computed on the
chunk's tokens and each chunk drops its own overflow. Reference: the unparallel MoE layer
(TP=1, the same global weights) run on each chunk of the same input, i.e. with the same
data and the same drops. Compared: every chunk's output, the input's gradient, the router's
gradient (summed over TP, as finalize_grads does under SP), each expert piece's gradient,
and the logged count of dropped assignments (summed over the chunks). At 2 ranks TP=2, at
4 ranks TP=2 (x DP=2) and TP=4; drops by probability and by position."""

import pytest
import torch
import torch.distributed as dist

from _trainer_models import gpt_provider
from megatron.core.global_slices import global_slices_by_name
from megatron.core.transformer.initialization import initialize_parameters_
from test_moe_tensor_parallel import moe_args, reference_model, tensor_parallel

WORLD = dist.get_world_size()
CAPACITY = ["--moe-expert-capacity-factor", "0.5", "--num-query-groups", "4"]  # 4 groups: TP 4 divides them
LAYER = "decoder.layers.0.mlp."
# (TP, drop policy): both policies at TP=2; at 4 ranks TP=4 takes the second.
CASES = {1: [(1, "probs")], 2: [(2, "probs"), (2, "position")], 4: [(2, "probs"), (4, "position")]}[WORLD]


@pytest.mark.parametrize("tp,policy", CASES)
def test_capacity_dropping_with_sequence_parallelism_drops_per_chunk_as_the_reference(tp, policy):
    extra = CAPACITY + ["--moe-token-drop-policy", policy]
    reference = reference_model("llama", False, extra=extra).train()
    ref_layer = reference.decoder.layers[0].mlp
    x = torch.randn(2, 16, reference.config.hidden_size, generator=torch.Generator().manual_seed(5))
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    with tensor_parallel(tp) as state:
        args = moe_args("llama", tp, 1, tp > 1, False, extra=extra)
        model = gpt_provider(args).train()
        initialize_parameters_(model, args.seed)
        layer = model.decoder.layers[0].mlp
        chunk = slice(state.tp_rank * 16 // tp, (state.tp_rank + 1) * 16 // tp)
        mine = x[:, chunk].clone().requires_grad_()
        out = layer(mine)
        (out * weight[:, chunk]).sum().backward()
        dropped = int(layer.router.last_stats["dropped_tokens"])
        grads = {LAYER + n: p.grad for n, p in layer.named_parameters()}
        if tp > 1:
            dist.all_reduce(grads[LAYER + "router.weight"], group=state.tp_group)
        pieces = global_slices_by_name(model)

    whole = x.clone().requires_grad_()
    ref_dropped = 0
    for c in range(tp):  # the unparallel layer, chunk by chunk: the same drops
        part = slice(c * 16 // tp, (c + 1) * 16 // tp)
        ref_out = ref_layer(whole[:, part])
        (ref_out * weight[:, part]).sum().backward()
        ref_dropped += int(ref_layer.router.last_stats["dropped_tokens"])
        if c == (state.tp_rank if tp > 1 else 0):
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert dropped == ref_dropped > 0
    torch.testing.assert_close(mine.grad, whole.grad[:, chunk], rtol=1e-5, atol=1e-6)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in grads.items():
        ref = pieces[name].take(expected[name]) if name in pieces else expected[name]
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
