"""Packed documents under TP (+SP), CP (every communication type) and PP equal the
single-process packed model.

The reference is one process's GPT on the whole batch of EOD-separated documents, with
reset position ids, the DocumentMask and the EOD loss mask (tests/unit_tests/transformer/
test_document_mask.py shows that equals every document on its own). Each layout gets the
same tokens, position ids and document starts (CP: its split of each), and must give the
reference's per-token losses and, summed over its ranks as the trainer does, gradients.
Documents are laid out so that they cross the CP chunk boundaries. Run with ``-s`` to
see the parity lines (layout, loss sum, the reference's, their relative difference, the
largest per-token difference).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cp_helpers import CP_SIZES, WORLD, cp_config, cp_group
from _dist_helpers import check, kept_groups, module_cache

from megatron.core.datasets.gpt_dataset import packed_document_fields
from megatron.core.global_slices import global_slices_of
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.context_parallel import (
    SUPPORTED_CP_COMM_TYPES,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.initialization import initialize_parameters_

S, VOCAB, EOD = 16, 64, 63
DOCUMENT_LENGTHS = [[3, 5, 1, 4, 3], [7, 9]]  # per sample, summing to S; boundaries cross CP chunks
ARCHITECTURES = {
    # 8 heads in 4 groups: 'a2a' scatters whole groups at cp=4.
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                  normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                  position_embedding_type="rope"),
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
}


def packed_batch():
    """tokens, labels, position ids, document starts, loss mask [2, S] (the dataset's fields)."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for lengths in DOCUMENT_LENGTHS:
        docs = [torch.randint(0, EOD, (n,), generator=g) for n in lengths]
        for doc in docs:
            doc[-1] = EOD
        rows.append(torch.cat(docs))
    tokens = torch.stack(rows)
    fields = [packed_document_fields(t.numpy(), EOD, eod_mask_loss=True, reset_position_ids=True,
                                     reset_attention_mask=True) for t in tokens]
    positions, starts, loss_mask = (torch.from_numpy(np.stack([f[k] for f in fields]))
                                    for k in ("position_ids", "document_start", "loss_mask"))
    labels = torch.randint(0, VOCAB, tokens.shape, generator=g)
    return tokens, labels, positions, starts, loss_mask


def build(arch, **config_kwargs):
    config = TransformerConfig(**ARCHITECTURES[arch], **config_kwargs)
    model = GPTModel(config, VOCAB, max_sequence_length=S, share_embeddings_and_output_weights=arch == "gpt2")
    initialize_parameters_(model, 13)  # the same global weights at every layout
    return model


def reference(arch):
    tokens, labels, positions, starts, loss_mask = packed_batch()
    model = build(arch)
    loss = model(tokens, positions, DocumentMask(starts), labels=labels)
    (loss * loss_mask).sum().backward()
    return model, loss.detach()


def report(layout, loss, ref_loss, loss_mask, printer=None):
    total, ref_total = (loss.double() * loss_mask).sum().item(), (ref_loss.double() * loss_mask).sum().item()
    rel = abs(total - ref_total) / abs(ref_total)
    if printer or (printer is None and dist.get_rank() == 0):
        worst = ((loss - ref_loss).abs() * loss_mask).max().item()
        print(f"\npacked parity | {layout} | {total:.7f} | {ref_total:.7f} | {rel:.1e} | {worst:.1e}")
    return rel


def compare_grads(model, ref_model, reduce_group=None):
    """Every parameter's gradient (summed over ``reduce_group``) against its piece of the
    reference's (TP-split parameters by their global slices)."""
    ref = dict(ref_model.named_parameters())
    errors = []
    for module_name, module in model.named_modules():
        slices = global_slices_of(module)
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            grad = param.grad.clone()
            if reduce_group is not None:
                dist.all_reduce(grad, group=reduce_group)
            expected = ref[name].grad
            if attr in slices:
                expected = slices[attr].take(expected)
            if not torch.allclose(grad, expected, rtol=1e-4, atol=1e-6):
                errors.append(f"{name} (max diff {(grad - expected).abs().max():.2g})")
    check(not errors, f"gradients differ: {errors}")


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("comm_type", SUPPORTED_CP_COMM_TYPES)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_context_parallel(arch, comm_type, cp):
    if cp == 1 and comm_type != "p2p":
        pytest.skip("a world of one rank runs no CP code: one type is enough")
    ref_model, ref_loss = reference(arch)
    tokens, labels, positions, starts, loss_mask = packed_batch()
    group = cp_group(cp)
    rank = dist.get_rank(group)
    local = [split_for_context_parallel(t, cp, rank) for t in (tokens, labels, positions, starts)]
    model = build(arch, **cp_config(cp, comm_type))
    loss = model(local[0], local[2], DocumentMask(local[3]), labels=local[1])
    (loss * split_for_context_parallel(loss_mask, cp, rank)).sum().backward()
    whole = gather_from_context_parallel(loss.detach(), group)
    check(torch.allclose(whole, ref_loss, rtol=1e-5, atol=1e-5), f"losses differ by {(whole - ref_loss).abs().max():.3g}")
    report(f"{arch} CP={cp} {comm_type}", whole, ref_loss, loss_mask)
    compare_grads(model, ref_model, group)


def test_context_parallel_attention_dropout_keeps_documents():
    """With attention dropout the ring still never lets a query see another document: a
    change to the first document leaves every later document's output unchanged."""
    cp = max(CP_SIZES)
    group = cp_group(cp)
    rank = dist.get_rank(group)
    tokens, _, positions, starts, _ = packed_batch()
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % EOD
    outputs = []
    for t in (tokens, changed):
        model = build("llama", attention_dropout=0.5, **cp_config(cp, "p2p"))
        torch.manual_seed(9)
        local = [split_for_context_parallel(x, cp, rank) for x in (t, positions, starts)]
        outputs.append(gather_from_context_parallel(model(local[0], local[1], DocumentMask(local[2])), group))
    first_end = [lengths[0] for lengths in DOCUMENT_LENGTHS]
    for row, end in enumerate(first_end):
        check(torch.equal(outputs[0][row, end:], outputs[1][row, end:]), "a document saw another one")
        check(not torch.equal(outputs[0][row, :end], outputs[1][row, :end]), "the change did nothing")


_GROUPS = module_cache()


def pair_group(kind):
    """Groups of 2 ranks: 'pair' {0, 1}, {2, 3}; 'across' {0, 2}, {1, 3} (4 ranks)."""
    if kind not in _GROUPS:
        members = {"pair": [[r, r + 1] for r in range(0, WORLD, 2)],
                   "across": [[0, 2], [1, 3]] if WORLD == 4 else []}[kind]
        with kept_groups():
            for ranks in members:
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    _GROUPS[kind] = group
    return _GROUPS[kind]


@pytest.mark.skipif(WORLD % 2, reason="TP=2 needs an even world")
@pytest.mark.parametrize("per_document", (False, True), ids=("dense_mask", "per_document"))
@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_tensor_parallel(sequence_parallel, per_document):
    ref_model, ref_loss = reference("llama")
    tokens, labels, positions, starts, loss_mask = packed_batch()
    tp_group = pair_group("pair")
    model = build("llama", tensor_model_parallel_size=2, tp_group=tp_group, sequence_parallel=sequence_parallel)
    mask = DocumentMask(starts, min_mean_length=0 if per_document else 64)
    check((mask.segments(tokens.shape[1]) is not None) == per_document, "the attention path")
    loss = model(tokens, positions, mask, labels=labels)
    (loss * loss_mask).sum().backward()
    if sequence_parallel:
        all_reduce_sequence_parallel_grads(model, tp_group)
    check(torch.allclose(loss.detach(), ref_loss, rtol=1e-5, atol=1e-5), "losses differ")
    report(f"TP=2{' +SP' if sequence_parallel else ''}{' per document' if per_document else ''}", loss.detach(),
           ref_loss, loss_mask)
    compare_grads(model, ref_model)


@pytest.mark.skipif(WORLD != 4, reason="TP=2 x CP=2 needs 4 ranks")
@pytest.mark.parametrize("comm_type", ("p2p", "all_gather"))
def test_tensor_times_context_parallel(comm_type):
    ref_model, ref_loss = reference("llama")
    tokens, labels, positions, starts, loss_mask = packed_batch()
    tp_group, group = pair_group("pair"), pair_group("across")
    rank = dist.get_rank(group)
    model = build("llama", tensor_model_parallel_size=2, tp_group=tp_group, sequence_parallel=True,
                  context_parallel_size=2, cp_group=group, cp_comm_type=comm_type)
    local = [split_for_context_parallel(t, 2, rank) for t in (tokens, labels, positions, starts, loss_mask)]
    loss = model(local[0], local[2], DocumentMask(local[3]), labels=local[1])
    (loss * local[4]).sum().backward()
    all_reduce_sequence_parallel_grads(model, tp_group)
    whole = gather_from_context_parallel(loss.detach(), group)
    check(torch.allclose(whole, ref_loss, rtol=1e-5, atol=1e-5), "losses differ")
    report(f"TP=2 +SP x CP=2 {comm_type}", whole, ref_loss, loss_mask)
    compare_grads(model, ref_model, group)


@pytest.mark.skipif(WORLD % 2, reason="PP=2 needs an even world")
def test_pipeline_parallel():
    """Two stages (layer 0 | layer 1 + output): each builds the DocumentMask from the batch
    itself; only the hidden states and their gradient travel between the stages."""
    ref_model, ref_loss = reference("llama")
    tokens, labels, positions, starts, loss_mask = packed_batch()
    rank = dist.get_rank()
    stage, peer = rank % 2, rank + 1 - 2 * (rank % 2)
    config = TransformerConfig(**ARCHITECTURES["llama"])
    model = GPTModel(config, VOCAB, max_sequence_length=S, share_embeddings_and_output_weights=False,
                     pre_process=stage == 0, post_process=stage == 1, layer_numbers=[stage])
    initialize_parameters_(model, 13)
    mask = DocumentMask(starts)
    hidden_shape = (tokens.shape[0], S, config.hidden_size)
    if stage == 0:
        hidden = model(tokens, positions, mask)
        dist.send(hidden.detach().contiguous(), peer)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, peer)
        hidden.backward(grad)
    else:
        hidden = torch.empty(hidden_shape)
        dist.recv(hidden, peer)
        hidden.requires_grad_()
        model.set_input_tensor(hidden)
        loss = model(tokens, positions, mask, labels=labels)
        (loss * loss_mask).sum().backward()
        dist.send(hidden.grad.contiguous(), peer)
    # Every rank joins each check (its all-reduce); the losses are the last stage's.
    check(stage == 0 or torch.allclose(loss.detach(), ref_loss, rtol=1e-5, atol=1e-5), "losses differ")
    if rank == 1:
        report("PP=2", loss.detach(), ref_loss, loss_mask, printer=True)
    compare_grads(model, ref_model)
