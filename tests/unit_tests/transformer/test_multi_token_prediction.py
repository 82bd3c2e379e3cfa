"""Multi-token prediction against a straightforward reference: depth k is the same model
run on the sequence's first s - k positions (causal attention never reads the rolled-in
tail), fed the tokens k ahead, predicting the labels k ahead; loss = main + factor/D * sum."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_token_prediction import (
    collect_mtp_metrics,
    mtp_token_scale_hook,
    set_mtp_loss_backward_scale,
)

S, V = 16, 64
ARCHS = {
    "llama": dict(normalization="RMSNorm", position_embedding_type="rope", gated_linear_unit=True,
                  add_bias_linear=False),
    "gpt2": dict(position_embedding_type="learned_absolute"),
    "moe": dict(normalization="RMSNorm", position_embedding_type="rope", gated_linear_unit=True,
                num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1]),
}


def _model(arch, depths=2, factor=0.3, tied=True):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=depths,
                               mtp_loss_scaling_factor=factor, **ARCHS[arch])
    model = GPTModel(config, vocab_size=V, max_sequence_length=S, share_embeddings_and_output_weights=tied)
    return model.train()


def _batch():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (3, S), generator=g)
    labels = torch.randint(0, V, (3, S), generator=g)
    mask = (torch.rand(3, S, generator=g) > 0.2).float()
    return tokens, torch.arange(S).expand(3, S), labels, mask


def masked_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()


def reference_sums(model, tokens, positions, labels, mask):
    """The objective's pieces written out: prefixes instead of rolled tensors, the model's
    modules. [(masked loss sum, loss tokens)] of the main head, then of each depth."""
    rotary = model.rotary_pos_emb(positions) if model.rotary_pos_emb is not None else None
    hidden = model.decoder(model.embedding(tokens, positions), None, rotary)
    sums = [((model._output(hidden, labels) * mask).sum(), mask.sum())]
    for k, layer in enumerate(model.mtp.layers, start=1):
        n = S - k
        table = None if rotary is None else tuple(t[:, :n] for t in rotary)
        hidden = layer(hidden[:, :n], model.embedding(tokens[:, k:], positions[:, k:]), None, table)
        sums.append(((model._output(hidden, labels[:, k:]) * mask[:, k:]).sum(), mask[:, k:].sum()))
    return sums


def reference_loss(model, tokens, positions, labels, mask):
    """Per micro-batch means: main + factor / D * sum of the depths' means."""
    (main, count), *depths = reference_sums(model, tokens, positions, labels, mask)
    losses = [total / n for total, n in depths]
    return main / count + model.config.mtp_loss_scaling_factor / len(depths) * sum(losses), \
        [float(x.detach()) for x in losses]


@pytest.mark.parametrize("arch, tied", [("llama", False), ("gpt2", True), ("moe", True)])
def test_mtp_loss_and_gradients_equal_the_reference(arch, tied):
    tokens, positions, labels, mask = _batch()
    model = _model(arch, tied=tied)
    if arch == "moe":
        for router in [m for m in model.modules() if hasattr(m, "aux_loss_backward_scale")]:
            assert router.config.moe_aux_loss_coeff == 0.0  # routing differs on prefixes only in the aux loss
    main = masked_mean(model(tokens, positions, None, labels=labels, loss_mask=mask), mask)
    main.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    metrics = collect_mtp_metrics(model)
    model.zero_grad()
    expected, depth_losses = reference_loss(model, tokens, positions, labels, mask)
    expected.backward()
    assert list(metrics) == ["mtp_1 loss", "mtp_2 loss"]
    assert [metrics["mtp_1 loss"], metrics["mtp_2 loss"]] == pytest.approx(depth_losses, rel=1e-5)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert grads[name] is None or not grads[name].any(), name
            continue
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The MTP weights get gradients, and the shared embedding gets the depths' share.
    assert grads["mtp.layers.1.eh_proj.weight"].abs().sum() > 0


def test_backward_scale_and_factor_weigh_the_mtp_losses():
    tokens, positions, labels, mask = _batch()
    grads = []
    for scale in (1.0, 0.0):
        model = _model("llama")
        set_mtp_loss_backward_scale(model, scale)
        masked_mean(model(tokens, positions, None, labels=labels, loss_mask=mask), mask).backward()
        grads.append(model.mtp.layers[0].eh_proj.weight.grad)
    assert grads[0].abs().sum() > 0 and not grads[1].any()  # scale 0: no MTP gradient at all


def test_eval_and_logits_are_the_main_heads():
    tokens, positions, labels, mask = _batch()
    model = _model("llama")
    logits = model(tokens, positions, None)
    assert logits.shape == (3, S, V)
    model.eval()
    with torch.no_grad():
        model(tokens, positions, None, labels=labels)
    assert collect_mtp_metrics(model) == {}  # evaluation records nothing


def test_mtp_names_are_upstreams():
    names = [n for n, _ in _model("moe", depths=1).named_parameters() if n.startswith("mtp.")]
    for expected in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                     "mtp.layers.0.mtp_model_layer.mlp.router.weight", "mtp.layers.0.final_layernorm.weight"):
        assert expected in names  # the MTP layer has the last decoder layer's kind (MoE here)


def test_bad_mtp_configs_are_refused():
    with pytest.raises(ValueError, match="mtp_num_layers must be a positive integer"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, mtp_num_layers=0)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, mtp_num_layers=1)
    with pytest.raises(ValueError, match="needs rotary positions"):  # a last pipeline stage, learned positions
        GPTModel(config, vocab_size=V, max_sequence_length=S, pre_process=False)
    assert GPTModel(config, vocab_size=V, max_sequence_length=S, post_process=False).mtp is None  # not the last stage


def test_per_token_loss_weighs_each_depth_like_the_main_loss():
    """--calculate-per-token-loss (upstream's semantics), through the schedule: the step's
    gradient is that of [sum over micro-batches of (main sum + factor / D * sum_k depth
    sum_k * N / N_k)] / (the step's loss tokens), N and N_k a micro-batch's tokens before
    and after k rolls; the logged depth losses stay the mean of the micro-batches' means."""
    import dataclasses  # only this test rebuilds a config

    from megatron.core.pipeline_parallel import forward_backward_no_pipelining  # only this test runs the schedule

    model = _model("llama", depths=2, factor=0.3)
    model.config = dataclasses.replace(model.config, calculate_per_token_loss=True)
    model.mtp.config = model.config
    tokens, positions, labels, mask = _batch()
    mask[0, :5] = 0  # micro-batches with different token counts
    micro = [dict(tokens=tokens[i:i + 1], position_ids=positions[i:i + 1], labels=labels[i:i + 1],
                  loss_mask=mask[i:i + 1]) for i in range(3)]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
        loss_sum = (out * batch["loss_mask"]).sum()
        return out, lambda _: (loss_sum, batch["loss_mask"].sum(), {"lm loss": torch.stack([loss_sum.detach()])})

    forward_backward_no_pipelining(forward_step, iter(micro), model, 3,
                                   token_scale_hook=mtp_token_scale_hook(model))  # the trainer's hook
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    metrics = collect_mtp_metrics(model)
    model.zero_grad()
    objective, means = 0.0, [[], []]
    for b in micro:
        (main, count), *depths = reference_sums(model, b["tokens"], b["position_ids"], b["labels"], b["loss_mask"])
        objective = objective + main + 0.3 / 2 * sum(total * count / n for total, n in depths)
        for k, (total, n) in enumerate(depths):
            means[k].append(float(total.detach() / n))
    (objective / mask.sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert grads["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    assert [metrics["mtp_1 loss"], metrics["mtp_2 loss"]] == pytest.approx([sum(m) / 3 for m in means], rel=1e-5)
