"""Padding the vocabulary (--make-vocab-size-divisible-by) changes neither the loss nor sampling.

The padded model holds the unpadded model's rows plus padding rows set far larger than any
real logit: were they in the softmax, the loss would jump and sampling would pick them.
"""

import pytest
import torch

from megatron.core.models.gpt import GPTModel, generate
from megatron.core.transformer import TransformerConfig

VOCAB, PADDED, SEQ = 61, 128, 16


def _pair(tied):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    torch.manual_seed(0)
    plain = GPTModel(config, VOCAB, SEQ, share_embeddings_and_output_weights=tied).eval()
    padded = GPTModel(config, PADDED, SEQ, share_embeddings_and_output_weights=tied,
                      unpadded_vocab_size=VOCAB).eval()
    state = plain.state_dict()
    with torch.no_grad():
        for name, tensor in padded.state_dict().items():
            source = state[name]
            if tensor.shape != source.shape:  # a vocabulary matrix: real rows, then loud padding
                tensor[:VOCAB] = source
                tensor[VOCAB:] = 50.0
            else:
                tensor.copy_(source)
    return plain, padded


@pytest.mark.parametrize("tied", [True, False])
def test_padded_loss_equals_unpadded_loss(tied):
    plain, padded = _pair(tied)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(padded(ids, labels=labels), plain(ids, labels=labels), rtol=1e-6, atol=1e-6)
        logits = padded(ids)
    assert logits.shape == (3, SEQ, PADDED)
    assert torch.isneginf(logits[..., VOCAB:]).all()
    torch.testing.assert_close(logits[..., :VOCAB], plain(ids), rtol=1e-6, atol=1e-6)


def test_padding_rows_get_no_gradient():
    _, padded = _pair(tied=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    padded(ids, labels=ids).sum().backward()
    grad = padded.embedding.word_embeddings.weight.grad
    assert grad[:VOCAB].abs().sum() > 0
    assert torch.count_nonzero(grad[VOCAB:]) == 0


def test_sampling_never_picks_a_padding_id():
    plain, padded = _pair(tied=True)
    prompt = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(4))
    greedy = generate(padded, prompt, max_new_tokens=8)
    assert torch.equal(greedy, generate(plain, prompt, max_new_tokens=8))
    # top-k wider than the real vocabulary: the padding ids are in the top k but have probability 0.
    sampled = generate(padded, prompt, max_new_tokens=12, top_k=PADDED, temperature=2.0,
                       generator=torch.Generator().manual_seed(5))
    assert int(sampled.max()) < VOCAB


def test_unpadded_size_is_checked():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)
    with pytest.raises(ValueError, match="unpadded_vocab_size"):
        GPTModel(config, 64, SEQ, unpadded_vocab_size=65)
