"""Tensor-parallel pieces against plain torch, over the whole world as one TP group.

* the vocab-parallel cross-entropy equals ``F.cross_entropy`` on the gathered logits
  (loss and logits' gradient), padding columns included;
* each sequence-parallel mapping is the collective it names, forward and backward;
* a transformer layer issues exactly Megatron's TP collectives: two all-reduces forward
  and two backward without sequence parallelism, two all-gathers and two reduce-scatters
  each way with it.
"""

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_helpers import check

from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.core.transformer import TransformerConfig, TransformerLayer

WORLD = dist.get_world_size()
RANK = dist.get_rank()
GROUP = dist.group.WORLD


def _same_on_every_rank(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_vocab_parallel_cross_entropy_equals_full_cross_entropy():
    vocab = 8 * WORLD
    logits = _same_on_every_rank((3, 5, vocab), 0) * 4
    logits[..., -3:] = float("-inf")  # padding columns (on the last rank)
    target = torch.randint(0, vocab - 3, (3, 5), generator=torch.Generator().manual_seed(1))
    weights = _same_on_every_rank((3, 5), 2)

    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    (expected * weights).sum().backward()

    per_rank = vocab // WORLD
    local = logits[..., RANK * per_rank:(RANK + 1) * per_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, GROUP, RANK * per_rank)
    (loss * weights).sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(local.grad, full.grad[..., RANK * per_rank:(RANK + 1) * per_rank],
                               rtol=1e-6, atol=1e-7)


def _gathered(x, dim):
    pieces = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=dim)


def test_sequence_parallel_mappings_are_their_collectives():
    full = _same_on_every_rank((2, 4 * WORLD, 3), 3)
    chunk = full.chunk(WORLD, dim=1)[RANK]
    grad_chunk = _same_on_every_rank((2, 4, 3), 4 + RANK)  # differs per rank

    x = full.clone().requires_grad_()
    out = scatter_to_sequence_parallel_region(x, GROUP)
    torch.testing.assert_close(out, chunk)
    out.backward(grad_chunk)
    torch.testing.assert_close(x.grad, _gathered(grad_chunk, 1))

    x = chunk.clone().requires_grad_()
    out = gather_from_sequence_parallel_region(x, GROUP)
    torch.testing.assert_close(out, full)
    grad_full = _same_on_every_rank((2, 4 * WORLD, 3), 5 + RANK)
    out.backward(grad_full)
    total = grad_full.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(x.grad, total.chunk(WORLD, dim=1)[RANK])

    partial = _same_on_every_rank((2, 4 * WORLD, 3), 6 + RANK).requires_grad_()
    out = reduce_scatter_to_sequence_parallel_region(partial, GROUP)
    total = partial.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(out, total.chunk(WORLD, dim=1)[RANK])
    out.backward(grad_chunk)
    torch.testing.assert_close(partial.grad, _gathered(grad_chunk, 1))


@pytest.fixture
def collective_log(monkeypatch):
    """Counts of the collectives the TP mappings call (the real ones still run)."""
    counts = collections.Counter()
    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counting)
    return counts


@pytest.mark.parametrize("sequence_parallel", (False, True) if WORLD > 1 else (False,))
def test_transformer_layer_collectives(collective_log, sequence_parallel):
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4 if WORLD < 8 else WORLD,
                               ffn_hidden_size=8 * WORLD, tensor_model_parallel_size=WORLD,
                               sequence_parallel=sequence_parallel, tp_group=GROUP if WORLD > 1 else None)
    layer = TransformerLayer(config)
    seq = 4 * WORLD // (WORLD if sequence_parallel else 1)
    x = _same_on_every_rank((2, seq, 16), 7).requires_grad_()
    out = layer(x)
    forward = dict(collective_log)
    out.sum().backward()
    backward = {k: collective_log[k] - forward.get(k, 0) for k in collective_log}
    if WORLD == 1:
        expected_forward = expected_backward = {}
    elif sequence_parallel:
        # fwd: gather before linear_qkv/linear_fc1, reduce-scatter after linear_proj/linear_fc2;
        # bwd: the transposes.
        expected_forward = expected_backward = {"all_gather_single": 2, "reduce_scatter_single": 2}
    else:
        expected_forward = expected_backward = {"all_reduce": 2}
    check({k: v for k, v in forward.items() if v} == expected_forward, f"forward {forward}")
    check({k: v for k, v in backward.items() if v} == expected_backward, f"backward {backward}")
