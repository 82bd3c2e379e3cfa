import pytest
import torch

from megatron.core.models.gpt import GPTModel, generate
from megatron.core.transformer import TransformerConfig

VOCAB = 40


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               hidden_dropout=0.3, attention_dropout=0.3)
    return GPTModel(config, VOCAB, 12)


class CallOnly:
    """Exposes nothing but __call__, like an opaque wrapper around the model."""

    def __init__(self, model):
        self._model = model
        self.calls = 0

    def __call__(self, input_ids):
        self.calls += 1
        return self._model(input_ids)


def test_greedy_is_deterministic_and_is_argmax_of_the_model(model):
    prompt = torch.randint(0, VOCAB, (2, 4))
    model.train()
    first = generate(model, prompt, max_new_tokens=5)
    second = generate(model, prompt, max_new_tokens=5, top_k=1)
    assert model.training  # restored
    assert first.shape == (2, 9)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert torch.equal(first[:, :4], prompt)
    model.eval()
    tokens = prompt
    with torch.no_grad():
        for _ in range(5):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(first, tokens)


def test_works_through_an_opaque_callable(model):
    model.eval()
    prompt = torch.randint(0, VOCAB, (1, 3))
    wrapper = CallOnly(model)
    assert torch.equal(generate(wrapper, prompt, 4), generate(model, prompt, 4))
    assert wrapper.calls == 4


class NextTokenModel:
    """Fake LM whose greedy choice after token t is t + 1 (mod VOCAB)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids):
        self.calls += 1
        return torch.nn.functional.one_hot((input_ids + 1) % VOCAB, VOCAB).float()


def test_eod_pads_finished_sequences_and_stops_early():
    prompt = torch.tensor([[1, 2, 3], [10, 11, 12]])
    fake = NextTokenModel()
    out = generate(fake, prompt, 6, eod=5)
    # Sequence 0 reaches eod=5 after two tokens and is padded with it; sequence 1 never does.
    assert out.tolist() == [[1, 2, 3, 4, 5, 5, 5, 5, 5], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    assert fake.calls == 6
    single = NextTokenModel()
    assert generate(single, prompt[:1], 6, eod=5).tolist() == [[1, 2, 3, 4, 5]]
    assert single.calls == 2


def test_context_longer_than_max_sequence_length_slides(model):
    model.eval()
    prompt = torch.randint(0, VOCAB, (1, 10))
    out = generate(model, prompt, 6)  # 16 tokens > max_sequence_length 12
    assert out.shape == (1, 16)
    with torch.no_grad():
        expected_last = model(out[:, -13:-1])[:, -1].argmax(-1)
    assert torch.equal(out[:, -1], expected_last)


def test_top_k_sampling_is_reproducible_and_stays_in_top_k(model):
    model.eval()
    prompt = torch.randint(0, VOCAB, (3, 4))
    a = generate(model, prompt, 6, top_k=3, temperature=0.7, generator=torch.Generator().manual_seed(5))
    b = generate(model, prompt, 6, top_k=3, temperature=0.7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with torch.no_grad():
        logits = model(a[:, :-1])
    for t in range(4, 10):
        top3 = logits[:, t - 1].topk(3).indices
        assert torch.all((top3 == a[:, t:t + 1]).any(dim=-1)), t
    # Different seeds with a flat distribution give different samples (the generator is used).
    c = generate(model, prompt, 6, top_k=VOCAB, temperature=10.0, generator=torch.Generator().manual_seed(1))
    d = generate(model, prompt, 6, top_k=VOCAB, temperature=10.0, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(c, d)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k"), (dict(temperature=0.0), "temperature"), (dict(max_new_tokens=-1), "max_new_tokens"),
])
def test_bad_arguments(model, kwargs, message):
    args = dict(max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 2, dtype=torch.long), **args)
