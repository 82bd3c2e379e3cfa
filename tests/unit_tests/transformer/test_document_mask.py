"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss).

A GPT fed several EOD-separated documents in one sequence, with the reset position ids
and the DocumentMask, gives every document the logits, per-token losses and gradients it
gets on its own; the per-sample fields follow upstream's _get_ltor_masks_and_position_ids
(re-stated here as its loop, with its dense mask).
"""

import numpy as np
import pytest
import torch

from megatron.core.datasets import MockGPTDataset
from megatron.core.datasets.gpt_dataset import packed_document_fields
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.document_mask import DocumentMask, sdpa_mask_and_causal

VOCAB, EOD = 64, 63
ARCHITECTURES = {
    "rope_gqa": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                     normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                     position_embedding_type="rope"),
    "learned": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
}
# Two samples of 24 tokens: documents ended by EOD; the last one is cut by the window.
DOCUMENT_LENGTHS = [[5, 1, 9, 6, 3], [24], ]


def upstream_fields(tokens, eod):
    """Upstream's loop: (dense attention mask, True = hidden), loss mask, position ids."""
    s = len(tokens)
    mask = torch.tril(torch.ones(s, s))
    loss_mask = torch.ones(s)
    loss_mask[tokens == eod] = 0.0
    positions = torch.arange(s)
    prev = 0
    for i in positions[tokens == eod].tolist():
        mask[i + 1:, :i + 1] = 0
        positions[i + 1:] -= i + 1 - prev
        prev = i + 1
    return mask < 0.5, loss_mask, positions


def packed_sample(lengths, generator):
    """Tokens of the documents (random ids below EOD, each ended by EOD), and the ranges."""
    pieces, ranges, start = [], [], 0
    for n in lengths:
        doc = torch.randint(0, EOD, (n,), generator=generator)
        doc[-1] = EOD
        pieces.append(doc)
        ranges.append((start, start + n))
        start += n
    return torch.cat(pieces), ranges


def build(arch):
    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**ARCHITECTURES[arch]), VOCAB, max_sequence_length=32)


def test_fields_follow_upstream():
    g = torch.Generator().manual_seed(1)
    for lengths in ([5, 1, 9, 6, 3], [1, 1, 22], [24]):
        tokens, _ = packed_sample(lengths, g)
        tokens[-1] = 7  # the window cuts the last document
        fields = packed_document_fields(tokens.numpy(), EOD, eod_mask_loss=True, reset_position_ids=True,
                                        reset_attention_mask=True)
        hidden, loss_mask, positions = upstream_fields(tokens, EOD)
        assert torch.equal(torch.from_numpy(fields["position_ids"]), positions)
        assert torch.equal(torch.from_numpy(fields["loss_mask"]), loss_mask)
        allowed = DocumentMask(torch.from_numpy(fields["document_start"])[None]).sdpa_mask(len(tokens))
        assert torch.equal(allowed[0, 0], ~hidden)
    plain = packed_document_fields(tokens.numpy(), EOD)
    assert set(plain) == {"loss_mask", "position_ids"} and (plain["loss_mask"] == 1).all()
    assert np.array_equal(plain["position_ids"], np.arange(len(tokens)))


def test_no_dense_mask_without_reset():
    assert sdpa_mask_and_causal(None, 8, "cpu") == (None, True)


def test_bad_document_starts_are_refused():
    starts = torch.tensor([[0, 0, 2, 2]])
    for call in (lambda m: m.segments(6), lambda m: m.sdpa_mask(6)):
        with pytest.raises(ValueError, match="the document mask covers 4 tokens but attention sees 6"):
            call(DocumentMask(starts))
    with pytest.raises(ValueError, match="the first token starts a document"):
        DocumentMask(starts + 1).segments(4)  # e.g. a CP split's starts
    with pytest.raises(ValueError, match="document_start must be an integer tensor"):
        DocumentMask(starts.float())


@pytest.mark.parametrize("per_document", (False, True), ids=("dense_mask", "per_document"))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_forward_equals_documents_on_their_own(arch, per_document):
    g = torch.Generator().manual_seed(2)
    samples = [packed_sample(lengths, g) for lengths in DOCUMENT_LENGTHS]
    tokens = torch.stack([t for t, _ in samples])
    labels = torch.randint(0, VOCAB, tokens.shape, generator=g)
    fields = [packed_document_fields(t.numpy(), EOD, eod_mask_loss=True, reset_position_ids=True,
                                     reset_attention_mask=True) for t in tokens]
    positions, starts, loss_mask = (torch.from_numpy(np.stack([f[key] for f in fields]))
                                    for key in ("position_ids", "document_start", "loss_mask"))

    packed = build(arch)
    # 6 documents in 48 tokens: the threshold picks either way of attending (8 is the mean).
    mask = DocumentMask(starts, min_mean_length=8 if per_document else 9)
    assert (mask.segments(tokens.shape[1]) is not None) == per_document
    if per_document:
        assert mask.segments(tokens.shape[1]) == [[(0, 5), (5, 6), (6, 15), (15, 21), (21, 24)], [(0, 24)]]
    logits = packed(tokens, positions, mask)
    loss = packed(tokens, positions, mask, labels=labels)
    (loss * loss_mask).sum().backward()

    alone = build(arch)
    total = 0.0
    for row, (_, ranges) in enumerate(samples):
        for a, b in ranges:
            doc_tokens, doc_labels = tokens[row:row + 1, a:b], labels[row:row + 1, a:b]
            assert torch.allclose(alone(doc_tokens), logits[row:row + 1, a:b], rtol=1e-5, atol=1e-5)
            doc_loss = alone(doc_tokens, labels=doc_labels)
            assert torch.allclose(doc_loss, loss[row:row + 1, a:b], rtol=1e-5, atol=1e-6)
            total = total + (doc_loss * loss_mask[row:row + 1, a:b]).sum()
    total.backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    # And the mask matters: plain causal attention over the packed sequence differs.
    assert not torch.allclose(packed(tokens, positions), logits, atol=1e-3)


def test_mock_dataset_honours_the_eod_options():
    """Mock tokens hit NullTokenizer's EOD (the last id) now and then: --eod-mask-loss and
    the resets apply to them as to real data."""
    dataset = MockGPTDataset(64, 32, 8, seed=3, eod_token=7, eod_mask_loss=True, reset_position_ids=True,
                             reset_attention_mask=True)
    samples = [dataset[i] for i in range(len(dataset))]
    assert any((s["tokens"] == 7).any() for s in samples)
    for s in samples:
        expected = packed_document_fields(s["tokens"], 7, eod_mask_loss=True, reset_position_ids=True,
                                          reset_attention_mask=True)
        for key, value in expected.items():
            assert np.array_equal(s[key], value), key
    assert (samples[0]["loss_mask"] == (samples[0]["tokens"] != 7)).all()
    plain = MockGPTDataset(4, 32, 8, seed=3)[0]
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    with pytest.raises(ValueError, match="need eod_token"):
        MockGPTDataset(4, 32, 8, seed=3, eod_mask_loss=True)


def test_ring_skips_key_chunks_before_every_document():
    """The CP ring's block list: with packed documents a key chunk that ends before the
    earliest document start of a query chunk is not computed (it would add nothing)."""
    from megatron.core.transformer.context_parallel import _chunk_pairs  # the ring's private planner

    assert _chunk_pairs((0, 3), (0, 3)) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert _chunk_pairs((0, 3), (0, 3), earliest=[0, 5], c=2) == [(0, 0, True), (1, 1, True)]
    assert _chunk_pairs((0, 3), (0, 3), earliest=[0, 1], c=2) == [(0, 0, True), (1, 0, False), (1, 1, True)]


def test_pretrain_forward_step_passes_the_document_mask():
    """pretrain_gpt.forward_step turns the batch's document_start into the DocumentMask."""
    from pretrain_gpt import forward_step  # the entry point's module, at the repository root

    g = torch.Generator().manual_seed(4)
    tokens = torch.stack([packed_sample(lengths, g)[0] for lengths in DOCUMENT_LENGTHS])
    fields = [packed_document_fields(t.numpy(), EOD, reset_position_ids=True, reset_attention_mask=True)
              for t in tokens]
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1),
             "loss_mask": torch.ones(tokens.shape), **{key: torch.from_numpy(np.stack([f[key] for f in fields]))
                                                        for key in ("position_ids", "document_start")}}
    model = build("rope_gqa")
    loss, _ = forward_step(iter([batch]), model)
    expected = model(tokens, batch["position_ids"], DocumentMask(batch["document_start"]), labels=batch["labels"])
    assert torch.equal(loss, expected)
    del batch["document_start"]
    assert not torch.allclose(forward_step(iter([batch]), model)[0], expected)
