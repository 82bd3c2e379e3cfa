import pytest
import torch

from megatron.core.transformer import TransformerConfig


def test_derived_defaults():
    config = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=6)
    assert config.ffn_hidden_size == 4 * 48
    assert config.num_query_groups == 6
    assert config.kv_channels == 8
    assert config.activation_func == "gelu"


def test_swiglu_defaults_to_silu_and_explicit_activation_is_kept():
    assert TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             gated_linear_unit=True).activation_func == "silu"
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, gated_linear_unit=True,
                               activation_func="gelu")
    assert config.activation_func == "gelu"
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(config.activation(x), torch.nn.functional.gelu(x))


def test_explicit_kv_channels_allows_non_dividing_heads():
    config = TransformerConfig(num_layers=1, hidden_size=30, num_attention_heads=4, kv_channels=8)
    assert config.query_projection_size == 32
    assert config.kv_projection_size == 32


BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=5), "divisible by num_attention_heads"),
        (dict(num_query_groups=3), "divisor of num_attention_heads"),
        (dict(num_query_groups=0), "divisor of num_attention_heads"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(hidden_size=-8), "hidden_size must be a positive integer"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size must be positive"),
        (dict(kv_channels=0), "kv_channels must be positive"),
        (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
        (dict(attention_dropout=-0.1), "attention_dropout must be in"),
        (dict(normalization="BatchNorm"), "normalization must be one of"),
        (dict(layernorm_epsilon=0.0), "layernorm_epsilon must be positive"),
        (dict(activation_func="swish42"), "is not known"),
        (dict(activation_func=3), "must be a name or a callable"),
        (dict(init_method_std=0.0), "init_method_std must be positive"),
        (dict(params_dtype=torch.int32), "params_dtype must be one of"),
        (dict(recompute_granularity="partial"), "use 'full'"),
        (dict(recompute_method="uniform"), "only applies to full recompute"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9), "between 1 and"),
        (dict(recompute_granularity="full", recompute_num_layers=1), "needs the method"),
        (dict(transformer_impl="apex"), "'local' or 'transformer_engine'"),
        (dict(position_embedding_type="alibi"), "position_embedding_type must be one of"),
        (dict(rotary_base=0), "rotary_base must be positive"),
        (dict(position_embedding_type="rope", kv_channels=7), "even head dimension"),
    ],
)
def test_invalid_configs_raise_value_error_with_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**BASE, **overrides})
