"""The router's cross-rank statistics, and EP layouts of the new balancing features against EP=1.

* ``global_aux_loss`` and the expert-bias counts are summed over the data-parallel ranks
  (the expert-parallel mesh's dimensions other than TP, here ``expert_dp`` x ``ep``): each
  rank routes its chunk of a global batch and the result is the reference's on the whole
  batch, written here from the equations.
* End to end, as in ``test_moe_expert_parallel.py``: the trainer's model at the largest EP
  size with ``seq_aux_loss``, sigmoid scores, group-limited routing and the expert bias
  (updated after every optimizer step) trains like a single-process EP=1 reference that runs
  each rank's rows as one micro-batch; ``global_aux_loss`` with a dense first layer
  (``--moe-layer-freq``) trains the same at the largest EP size as at EP=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _trainer_models import gpt_provider
from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, microbatch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe.expert_parallel import build_expert_parallel
from megatron.core.transformer.moe.expert_bias import update_expert_biases
from megatron.core.transformer.moe.router import TopKRouter, set_aux_loss_backward_scale
from megatron.training.model_builder import build_model, get_grad_norm_and_clip
from test_moe_expert_parallel import EP_SIZES, WORLD, compare_weights, global_batch, moe_args, train

E, H, K, TOKENS = 8, 16, 2, 12  # TOKENS per rank


def router_on_every_rank(ep: int, **overrides) -> TopKRouter:
    fields = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
                  moe_ffn_hidden_size=8, add_bias_linear=False, expert_model_parallel_size=ep)
    fields.update(overrides)
    torch.manual_seed(0)  # the same weight on every rank
    router = TopKRouter(TransformerConfig(**fields), build_expert_parallel(ep, "cpu"))
    torch.nn.init.normal_(router.weight, std=1.0)
    return router


def global_tokens(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS * WORLD, H, generator=torch.Generator().manual_seed(seed))


def mine(x: torch.Tensor) -> torch.Tensor:
    return x[dist.get_rank() * TOKENS:(dist.get_rank() + 1) * TOKENS]


def top_k_counts(logits: torch.Tensor) -> torch.Tensor:
    """How many tokens chose each expert: top-k of the softmax (reference)."""
    chosen = torch.softmax(logits, 1).argsort(dim=1, descending=True)[:, :K]
    return torch.stack([(chosen == e).sum() for e in range(E)]).double()


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("ep", EP_SIZES)
def test_global_aux_loss_counts_every_data_parallel_rank(ep):
    """Micro-batch 1: the Switch loss of the world's batch, each rank holding its tokens'
    share (gradients add up to the whole's); micro-batch 2: the counts are the mean of both."""
    router = router_on_every_rank(ep, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1.0)
    batches = [global_tokens(1), global_tokens(2)]
    set_aux_loss_backward_scale(router, 1.0)
    probs, _ = router(mine(batches[0]))
    (probs * 0).sum().backward()  # only the loss's gradient
    w = router.weight.detach().clone().requires_grad_(True)
    logits = [F.linear(x, w) for x in batches]
    counts = [top_k_counts(l.detach()) for l in logits]
    total = TOKENS * WORLD

    def switch(l, n):  # coeff * E / (k T^2) * sum_e n_e * sum_t p_te over the world's T tokens
        return E / (K * total ** 2) * torch.sum(torch.softmax(l, 1).sum(0) * n.float())

    switch(logits[0], counts[0]).backward()
    torch.testing.assert_close(summed(router.weight.grad), w.grad, rtol=1e-4, atol=1e-6)
    # Logged: the share times the DP size, so that the metrics' mean over DP is the whole loss.
    logged = lambda: float(summed(router.last_stats["global_load_balancing_loss"])) / WORLD  # noqa: E731
    assert logged() == pytest.approx(float(switch(logits[0], counts[0]).detach()), rel=1e-5)
    router(mine(batches[1]))
    assert logged() == pytest.approx(float(switch(logits[1], (counts[0] + counts[1]) / 2).detach()), rel=1e-5)


@pytest.mark.parametrize("ep", EP_SIZES)
def test_expert_bias_update_counts_every_data_parallel_rank(ep):
    router = router_on_every_rank(ep, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                  moe_router_bias_update_rate=0.5, moe_aux_loss_coeff=0.0)
    x = global_tokens(3)
    router(mine(x))
    update_expert_biases(router)
    scores = torch.sigmoid(F.linear(x, router.weight.detach()))
    chosen = scores.argsort(dim=1, descending=True)[:, :K]
    counts = torch.tensor([float((chosen == e).sum()) for e in range(E)])
    torch.testing.assert_close(router.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert float(router.expert_bias.abs().sum()) > 0


def test_expert_bias_counts_survive_ddp_buffer_broadcasts():
    """Under DDP, which broadcasts rank 0's buffers before a forward that follows a
    synchronised backward, two forwards per update still count every rank's own tokens."""
    router = router_on_every_rank(1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                  moe_router_bias_update_rate=0.5, moe_aux_loss_coeff=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(router)
    batches = [global_tokens(4), global_tokens(5)]
    for batch in batches:
        ddp(mine(batch))[0].sum().backward()
    update_expert_biases(router)
    scores = torch.sigmoid(F.linear(torch.cat(batches), router.weight.detach()))
    chosen = scores.argsort(dim=1, descending=True)[:, :K]
    counts = torch.tensor([float((chosen == e).sum()) for e in range(E)])
    torch.testing.assert_close(router.expert_bias, 0.5 * torch.sign(counts.mean() - counts))


def reference_with(ref_args):
    """The single-process EP=1 model: all experts local, statistics of its own tokens only."""
    model = gpt_provider(ref_args)
    initialize_parameters_(model, ref_args.seed)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.data_parallel_groups = ()
    return model


def biases(model):
    return [m.expert_bias.clone() for m in model.modules() if isinstance(m, TopKRouter)]


ROUTER_FLAGS = ("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function", "sigmoid",
                "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01")


def test_seq_aux_loss_groups_and_expert_bias_at_the_largest_ep_match_the_ep1_reference():
    ep = EP_SIZES[-1]
    args = moe_args(ep, "optim_grads_params", 0.1, *ROUTER_FLAGS)
    built = build_model(gpt_provider, args, torch.device("cpu"))
    reference = reference_with(moe_args(1, None, 0.1, *ROUTER_FLAGS, world_size=1, mfsdp=False))
    losses, ref_losses, norms, ref_norms = train(args, built, reference, 0.1)
    if dist.get_rank() == 0:
        print(f"\nEP={ep} seq_aux_loss + expert bias: losses {losses} reference {ref_losses}")
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)
    got, expected = biases(built.unwrapped), biases(reference)
    assert any(float(b.abs().sum()) > 0 for b in expected)  # the steps moved the biases
    for b, ref in zip(got, expected):
        torch.testing.assert_close(b, ref, rtol=0, atol=1e-7)


def train_alone(args, steps=3):
    """Losses of ``steps`` SGD steps of the trainer's model on this rank's rows."""
    built = build_model(gpt_provider, args, torch.device("cpu"))
    optimizer = fully_shard_optimizer(torch.optim.SGD(built.model.parameters(), lr=0.5), context=built.context)
    tokens, labels = global_batch()
    rows = tokens.shape[0] // WORLD
    mine_ = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    losses, norms = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        set_aux_loss_backward_scale(built.unwrapped, 1.0)
        with microbatch(built.context, is_last=True):
            loss = built.model(tokens[mine_], labels=labels[mine_]).mean()
            loss.backward()
        norms.append(float(get_grad_norm_and_clip(args, built)))
        optimizer.step()
        update_expert_biases(built.unwrapped)  # the trainer's call after each step
        losses.append(float(summed(loss.detach())) / WORLD)
    return losses, norms


@pytest.mark.skipif(EP_SIZES[-1] == 1, reason="needs two ranks or more")
def test_global_aux_loss_with_a_dense_first_layer_trains_the_same_at_every_ep_size():
    flags = ("--moe-router-load-balancing-type", "global_aux_loss", "--moe-layer-freq", "([0]*1+[1]*1)")
    ep1 = train_alone(moe_args(1, "optim_grads_params", 0.1, *flags))
    epn = train_alone(moe_args(EP_SIZES[-1], "optim_grads_params", 0.1, *flags))
    if dist.get_rank() == 0:
        print(f"\nglobal_aux_loss EP=1 {ep1[0]} EP={EP_SIZES[-1]} {epn[0]}")
    assert epn[0] == pytest.approx(ep1[0], rel=2e-5)
    assert epn[1] == pytest.approx(ep1[1], rel=2e-5)
    assert ep1[0][-1] < ep1[0][0]


@pytest.mark.skipif(WORLD < 2, reason="needs two ranks or more")
def test_sequence_parallel_router_statistics_match_the_reference():
    """TP=2 with sequence parallelism (EP = the data-parallel size): each TP rank routes its
    sequence chunk, and the per-sequence counts of seq_aux_loss, the global counts of
    global_aux_loss (at DP=1, where one micro-batch per rank is the reference's) and the
    expert-bias counts are those of the whole sequences."""
    from _trainer_models import trainer_args
    from test_moe_tensor_parallel import tensor_parallel
    from test_moe_tensor_parallel import train as train_tp

    dp = WORLD // 2
    types = ["seq_aux_loss", "global_aux_loss"] if dp == 1 else ["seq_aux_loss"]
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--clip-grad", "0",
             "--moe-router-load-balancing-type", *types, "--moe-aux-loss-coeff", *["0.1"] * len(types),
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0.01"]
    with tensor_parallel(2) as state:
        args = trainer_args("gpt2", *flags, "--use-mfsdp", "--expert-model-parallel-size", str(dp),
                            "--tensor-model-parallel-size", "2", "--sequence-parallel")
        built = build_model(gpt_provider, args, torch.device("cpu"))
        reference = reference_with(trainer_args("gpt2", *flags, world_size=1))
        mine_, ref, norms, ref_norms = train_tp(args, built, reference, state, True)
    if dist.get_rank() == 0:
        print(f"\nTP=2 SP EP={dp} {types} + expert bias: losses {mine_} reference {ref}")
    assert mine_ == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    got, expected = biases(built.unwrapped), biases(reference)
    assert any(float(b.abs().sum()) > 0 for b in expected)
    for b, r in zip(got, expected):
        torch.testing.assert_close(b, r, rtol=0, atol=1e-7)


def test_sinkhorn_over_sequence_chunks_is_the_whole_sequences_sinkhorn():
    """Each rank holds one chunk of the tokens (as a CP or SP rank does): with the world as
    the split group, every rank's rows of the plan, and so its top-k, are those of the
    single-process Sinkhorn over all the tokens."""
    from megatron.core.transformer.moe.router import sinkhorn

    tokens, experts = 6 * WORLD, 4
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(5)) * 2
    whole = sinkhorn(logits)
    rows = slice(dist.get_rank() * 6, (dist.get_rank() + 1) * 6)
    chunk = sinkhorn(logits[rows], groups=(dist.group.WORLD,) if WORLD > 1 else ())
    torch.testing.assert_close(chunk, whole[rows], rtol=1e-5, atol=1e-9)
    assert torch.equal(chunk.topk(2, dim=1).indices.sort(1).values, whole[rows].topk(2, dim=1).indices.sort(1).values)
    if WORLD > 1:  # without the split group a chunk's own plan differs
        assert not torch.allclose(sinkhorn(logits[rows]), whole[rows], rtol=1e-3)


@pytest.mark.skipif(WORLD < 2, reason="needs two ranks or more")
def test_sinkhorn_under_sequence_parallelism_trains_as_the_reference():
    """TP=2 with sequence parallelism: each TP rank routes its sequence chunk with the
    Sinkhorn plan of the whole sequences; the losses and grad norms are the reference's."""
    from _trainer_models import trainer_args
    from test_moe_tensor_parallel import tensor_parallel
    from test_moe_tensor_parallel import train as train_tp

    dp = WORLD // 2
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--clip-grad", "0",
             "--moe-router-load-balancing-type", "sinkhorn"]
    with tensor_parallel(2) as state:
        args = trainer_args("gpt2", *flags, "--use-mfsdp", "--expert-model-parallel-size", str(dp),
                            "--tensor-model-parallel-size", "2", "--sequence-parallel")
        built = build_model(gpt_provider, args, torch.device("cpu"))
        reference = reference_with(trainer_args("gpt2", *flags, world_size=1))
        mine_, ref, norms, ref_norms = train_tp(args, built, reference, state, True)
    assert mine_ == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
