"""TransformerConfig: the hyper-parameters of a decoder-only transformer.

Field names and defaults follow Megatron-LM's ``TransformerConfig`` so that code and
argument names carry over. Only the fields this project implements exist; anything a user
can get wrong is checked in ``__post_init__`` and reported as a ``ValueError`` that says
how to fix it.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .context_parallel import check_cp_comm_type, check_heads_divisible, check_hierarchical_groups
from .gpt_oss import SOFTMAX_TYPES, quick_gelu
from .moe.config import check_moe_config
from .recompute import check_recompute_modules
from .rope import YarnScaling

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_TRANSFORMER_IMPLS = ("local", "transformer_engine")
_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
ROTARY_TYPES = ("rope", "yarn")  # the position embeddings that rotate q and k (rope.py)
_RECOMPUTE_GRANULARITIES = (None, "full", "selective")
_RECOMPUTE_METHODS = (None, "uniform", "block")
_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's "gelu_new"; needed for logits that match a Hugging Face GPT-2 checkpoint.
    return F.gelu(x, approximate="tanh")


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# Activations selectable by name. Names (not callables) keep the config printable and
# serializable into checkpoints and argument files.
ACTIVATION_FUNCTIONS = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
    "relu": F.relu,
    "squared_relu": _squared_relu,
    "quick_gelu": quick_gelu,  # GPT-OSS's gate (gpt_oss.py), with a gated unit: --quick-geglu
}


def check_recompute(granularity: Optional[str], method: Optional[str], num_layers: Optional[int],
                    total_layers: int) -> None:
    """Reject an inconsistent recompute setting (the config's fields or the trainer's flags)."""
    if granularity not in _RECOMPUTE_GRANULARITIES:
        raise ValueError(
            f"recompute granularity {granularity!r} is not supported; use 'full' (recompute whole "
            "layers), 'selective' (the attention core only) or none."
        )
    if method not in _RECOMPUTE_METHODS:
        raise ValueError(f"recompute method must be 'uniform', 'block' or none, got {method!r}.")
    if granularity != "full" and (method is not None or num_layers is not None):
        raise ValueError(
            "a recompute method / number of layers (--recompute-method, --recompute-num-layers) only "
            "applies to full recompute; set the granularity to 'full' or leave them unset."
        )
    if num_layers is not None:
        if method is None:
            raise ValueError("a recompute number of layers (--recompute-num-layers) needs the method "
                             "'uniform' or 'block' (--recompute-method).")
        if not 1 <= num_layers <= total_layers:
            raise ValueError(
                f"the recompute number of layers must be between 1 and the number of layers "
                f"({total_layers}), got {num_layers}."
            )


@dataclass
class TransformerConfig:
    """Architecture and numerics of the transformer decoder.

    Derived defaults (filled in by ``__post_init__``):
      * ``ffn_hidden_size``: ``4 * hidden_size``.
      * ``num_query_groups``: ``num_attention_heads`` (plain multi-head attention);
        fewer groups means grouped-query attention (1 group = multi-query attention).
      * ``kv_channels``: ``hidden_size // num_attention_heads`` (the per-head dimension).
      * ``activation_func``: ``"silu"`` when ``gated_linear_unit`` (SwiGLU), else ``"gelu"``.

    Activation recompute (Megatron's flags): ``recompute_granularity="selective"``
    recomputes the attention core only; ``"full"`` recomputes whole layers, chosen by
    ``recompute_method``: ``"uniform"`` checkpoints chunks of ``recompute_num_layers``
    layers (only each chunk's input is kept), ``"block"`` checkpoints the first
    ``recompute_num_layers`` layers one by one and keeps the others' activations. Full
    recompute without a method checkpoints every layer on its own (uniform, 1 layer).
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    gated_linear_unit: bool = False
    activation_func: Optional[Union[str, Callable]] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on linear_qkv only (Qwen2); implied by add_bias_linear, as upstream
    init_method_std: float = 0.02
    params_dtype: torch.dtype = torch.float32
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_reentrant: bool = False
    transformer_impl: str = "local"
    use_apex_fused: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000
    # Megatron-LM numerics options (docs/megatron_flags.md).
    rotary_percent: float = 1.0  # fraction of each head's dimensions that RoPE rotates
    rotary_interleaved: bool = False  # RoPE pairs (2i, 2i + 1) instead of (i, i + d/2)
    apply_layernorm_1p: bool = False  # LayerNorm weight stored as gamma - 1 (zero-initialized)
    attention_softmax_in_fp32: bool = False  # attention in fp32 when the inputs are bf16/fp16
    attention_backend: str = "auto"  # SDPA kernels: auto, flash, fused, unfused/local (math)
    # Per-head norm (``normalization``'s kind, weights of size kv_channels shared by all
    # heads) on the queries and keys after the projection, before RoPE (Qwen3, OLMo 2).
    qk_layernorm: bool = False
    # Qwen3-Next's gated attention: linear_qkv also outputs a gate per query-head element
    # and the attention output is multiplied by its sigmoid before linear_proj
    # (attention.py documents the row layout).
    attention_output_gate: bool = False
    # Multi-latent attention (DeepSeek-V2/V3; multi_latent_attention.py), Megatron-LM's
    # MLATransformerConfig fields and the trainer's defaults. q_lora_rank None: no query
    # compression (linear_q_proj). num_query_groups and kv_channels do not apply to it.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Hybrid linear attention (gated_delta_net.py; Megatron-LM's fields and defaults):
    # experimental_attention_variant "gdn" (alias "gated_delta_net") puts a gated delta net
    # in place of softmax attention on the layers linear_attention_freq marks (an int N:
    # every N-th layer keeps softmax attention; or a 0/1 list, 1 = linear).
    experimental_attention_variant: Optional[str] = None
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Linear layers compute their weight gradient straight into the data-parallel wrapper's
    # reduction buffer where it offers one (tensor_parallel/grad_accumulation_fusion.py).
    gradient_accumulation_fusion: bool = True
    # Tensor parallelism (megatron/core/tensor_parallel): heads, query groups, FFN columns and
    # the vocabulary split over the ranks of ``tp_group``; ``sequence_parallel`` also splits
    # the activations between the TP layers along the sequence.
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    tp_group: Any = field(default=None, repr=False, compare=False)  # a ProcessGroup of that size
    # Context parallelism (context_parallel.py): each rank of ``cp_group`` holds 2 of the
    # 2 * context_parallel_size chunks of every sequence; attention exchanges keys/values by
    # ``cp_comm_type`` ("p2p", "all_gather", "a2a", "a2a+p2p"; or a list, one per layer).
    context_parallel_size: int = 1
    cp_group: Any = field(default=None, repr=False, compare=False)  # a ProcessGroup of that size
    cp_comm_type: Union[str, List[str]] = "p2p"
    # "a2a+p2p" only: (a2a group, p2p group), Megatron's --hierarchical-context-parallel-sizes
    # (low level first): a2a groups of consecutive CP ranks, their sizes multiplying to the CP size.
    hierarchical_cp_groups: Any = field(default=None, repr=False, compare=False)
    # Mixture of experts (megatron/core/transformer/moe/; Megatron-LM's fields and defaults,
    # checked by moe/config.py). num_moe_experts None: every layer has a dense MLP.
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None  # default ffn_hidden_size
    moe_layer_freq: Union[int, List[int]] = 1
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_dtype: Optional[str] = None
    moe_router_force_load_balancing: bool = False  # route by random logits (upstream's benchmark mode)
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"  # a list: one coefficient each
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_router_num_groups: Optional[int] = None  # group-limited routing (DeepSeek-V2/V3)
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (sigmoid scores)
    moe_router_bias_update_rate: float = 1e-3
    moe_z_loss_coeff: Optional[float] = None
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    # Qwen2-MoE: the shared expert's output scaled by sigmoid(x @ gate_weight^T), a [1, hidden] weight.
    moe_shared_expert_gate: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    expert_model_parallel_size: int = 1
    # Each expert's tensor-parallel split (Megatron's field); None: the TP size. Another size
    # splits the experts over the expert mesh's own "tp" axis (moe/expert_parallel.py).
    expert_tensor_parallel_size: Optional[int] = None
    # YaRN RoPE scaling (position_embedding_type "yarn", rope.py); Megatron-LM's yarn_* names
    # and YarnRotaryEmbedding's defaults.
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # Selective recompute's modules (recompute_granularity "selective"; recompute.py lists
    # Megatron's names and what each recomputes here). None: ["core_attn"], as upstream.
    recompute_modules: Optional[List[str]] = None
    # Multi-token prediction (multi_token_prediction.py): extra prediction depths after the
    # decoder sharing the embedding and output layer; their loss weight (upstream's default 0.1).
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # muP, the Maximal Update Parameterization (upstream's fields and rules, docs/design.md
    # "muP": hidden weights' init std and learning rate scale with the width, the embedding
    # and output layer keep the base ones). With use_mup, __post_init__ sets
    # mup_width_mult = hidden_size / mup_base_hidden_size (base default: hidden_size),
    # softmax_scale = sqrt(mup_base_head_dim or 1) / kv_channels ** mup_attn_scale_power and,
    # when left at 1.0, mup_output_mult = 1 / mup_width_mult.
    use_mup: bool = False
    mup_base_hidden_size: Optional[int] = None
    mup_width_mult: float = 1.0
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0
    # The attention's softmax scale; None: 1 / sqrt(kv_channels) (SDPA's default).
    softmax_scale: Optional[float] = None
    # Megatron's --calculate-per-token-loss: the losses are sums over tokens, normalized by
    # the global batch's token count (the schedule); read by multi-token prediction.
    calculate_per_token_loss: bool = False
    # GPT-OSS's blocks (gpt_oss.py; upstream's fields): attention sinks ("vanilla",
    # "off-by-one", "learnable"), the sliding window (L, R) and the layers that use it, and
    # the gated unit's linear-half offset and clamp.
    softmax_type: str = "vanilla"
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}; set it to 1 or more.")

        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}); choose a head count that divides the hidden size, "
                    "or set kv_channels explicitly."
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        elif self.kv_channels < 1:
            raise ValueError(f"kv_channels must be positive, got {self.kv_channels}; leave it unset to use hidden_size // num_attention_heads.")

        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be a positive divisor of "
                f"num_attention_heads ({self.num_attention_heads}); pick a group count such as "
                f"1 or {self.num_attention_heads}, or leave it unset for multi-head attention."
            )

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        elif self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size must be positive, got {self.ffn_hidden_size}; leave it unset for 4 * hidden_size.")

        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}; use 0.0 to disable dropout.")

        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}.")
        if not self.layernorm_epsilon > 0:
            raise ValueError(f"layernorm_epsilon must be positive, got {self.layernorm_epsilon}; 1e-5 is the usual value.")

        if self.activation_func is None:
            self.activation_func = "silu" if self.gated_linear_unit else "gelu"
        if isinstance(self.activation_func, str):
            if self.activation_func not in ACTIVATION_FUNCTIONS:
                raise ValueError(
                    f"activation_func {self.activation_func!r} is not known; use one of "
                    f"{sorted(ACTIVATION_FUNCTIONS)} (or pass a callable)."
                )
        elif not callable(self.activation_func):
            raise ValueError(f"activation_func must be a name or a callable, got {self.activation_func!r}.")

        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std}; 0.02 is the usual value.")
        if self.use_mup:
            if self.mup_base_hidden_size is None:
                self.mup_base_hidden_size = self.hidden_size
            if not self.mup_base_hidden_size > 0:
                raise ValueError(f"mup_base_hidden_size must be positive, got {self.mup_base_hidden_size}.")
            self.mup_width_mult = self.hidden_size / self.mup_base_hidden_size
            if self.softmax_scale is None:
                base = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim ** 0.5
                self.softmax_scale = base / self.kv_channels ** self.mup_attn_scale_power
            if self.mup_output_mult == 1.0 and self.mup_width_mult != 1.0:
                self.mup_output_mult = 1.0 / self.mup_width_mult

        if self.params_dtype not in _PARAMS_DTYPES:
            raise ValueError(
                f"params_dtype must be one of torch.float32, torch.bfloat16, torch.float16, got {self.params_dtype!r}."
            )

        check_recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers,
                        self.num_layers)

        if self.transformer_impl not in _TRANSFORMER_IMPLS:
            raise ValueError(
                f"transformer_impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}."
            )

        if self.position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {_POSITION_EMBEDDING_TYPES}, got "
                f"{self.position_embedding_type!r}."
            )
        if not self.rotary_base > 0:
            raise ValueError(f"rotary_base must be positive, got {self.rotary_base}; 10000 is the usual value.")
        if self.position_embedding_type in ROTARY_TYPES and self.kv_channels % 2 != 0:
            raise ValueError(
                f"rotary position embeddings need an even head dimension, but kv_channels is "
                f"{self.kv_channels}; change hidden_size/num_attention_heads or set an even kv_channels."
            )

        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}.")
        if self.position_embedding_type in ROTARY_TYPES and (self.rotary_dim < 2 or self.rotary_dim % 2 != 0):
            raise ValueError(
                f"rotary_percent {self.rotary_percent} rotates {self.rotary_dim} of {self.kv_channels} head "
                "dimensions; pick a fraction that gives an even number >= 2."
            )
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.moe_shared_expert_gate and (self.num_moe_experts is None
                                            or self.moe_shared_expert_intermediate_size is None):
            raise ValueError("moe_shared_expert_gate gates the shared expert; set num_moe_experts and "
                             "moe_shared_expert_intermediate_size, or drop it.")
        self._check_tensor_parallel()
        self._check_context_parallel()
        self._check_multi_latent_attention()
        self._check_linear_attention()
        self._check_gpt_oss()
        check_moe_config(self)

        check_recompute_modules(self.recompute_modules, self.recompute_granularity, self.moe_grouped_gemm,
                                gated_delta_net=self.experimental_attention_variant in ("gdn", "gated_delta_net"),
                                multi_latent_attention=self.multi_latent_attention)
        if self.mtp_num_layers is not None and (isinstance(self.mtp_num_layers, bool) or self.mtp_num_layers < 1):
            raise ValueError(f"mtp_num_layers must be a positive integer or None, got {self.mtp_num_layers!r}.")
        if self.mtp_num_layers and self.context_parallel_size > 1:
            raise ValueError("multi-token prediction under context parallelism is not built yet (its tokens are "
                             "rolled across the CP chunks); use context_parallel_size 1.")
        if self.position_embedding_type == "yarn":
            if self.rotary_interleaved:
                raise ValueError("YaRN rotates halves (as Megatron-LM and DeepSeek-V3); drop rotary_interleaved.")
            if self.rotary_percent != 1.0:
                raise ValueError("YaRN rotates every head dimension here; drop rotary_percent.")
            _ = self.yarn  # YarnScaling checks its parameters

    def _check_multi_latent_attention(self) -> None:
        if not self.multi_latent_attention:
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim") + \
                (("q_lora_rank",) if self.q_lora_rank is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer for multi-latent attention, "
                                 f"got {value!r}.")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim ({self.qk_pos_emb_head_dim}) must be even: RoPE rotates pairs "
                             "of dimensions.")
        if self.attention_output_gate:
            raise ValueError("--attention-output-gate is not supported with --multi-latent-attention; drop one.")
        if self.context_parallel_size > 1:
            raise ValueError("--multi-latent-attention with --context-parallel-size > 1 is not supported yet (its "
                             "values are narrower than its queries); use --context-parallel-size 1.")

    def _check_gpt_oss(self) -> None:
        """GPT-OSS's blocks (gpt_oss.py); ValueError with the fix."""
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"--softmax-type {self.softmax_type!r} is not known; use one of {', '.join(SOFTMAX_TYPES)}.")
        window, freq = self.window_size, self.window_attn_skip_freq
        if window is not None:
            window = self.window_size = tuple(window)  # a list when read back from saved arguments
            if len(window) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in window):
                raise ValueError(f"--window-size must be two ints L,R, got {window!r}.")
            if window[0] < -1 or window[1] != 0:
                raise ValueError(f"--window-size {window[0]},{window[1]}: GPT attention is causal, so R must be 0 "
                                 "and L >= 0 (or -1: no left limit); pass e.g. --window-size 127,0.")
        elif freq is not None:
            raise ValueError("--window-attn-skip-freq needs --window-size; add it or drop --window-attn-skip-freq.")
        if isinstance(freq, bool) or (freq is not None and not isinstance(freq, (int, list))):
            raise ValueError(f"--window-attn-skip-freq must be an int or a list of 0/1, got {freq!r}.")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--window-attn-skip-freq must be 1 or more, got {freq}.")
        if isinstance(freq, list) and (len(freq) != self.num_layers or any(x not in (0, 1) for x in freq)):
            raise ValueError(f"--window-attn-skip-freq's list needs one 0/1 per layer ({self.num_layers}), got {freq}.")
        if (window is not None or self.softmax_type != "vanilla") and self.context_parallel_size > 1:
            raise ValueError("--window-size and --softmax-type off-by-one/learnable are not built with "
                             "--context-parallel-size > 1; use --context-parallel-size 1.")
        if (window is not None or self.softmax_type != "vanilla") and self.multi_latent_attention:
            raise ValueError("--window-size and --softmax-type off-by-one/learnable are not built for "
                             "--multi-latent-attention; drop one.")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.gated_linear_unit:
            raise ValueError("--glu-linear-offset and --activation-func-clamp-value apply to a gated unit; add "
                             "--quick-geglu (or --swiglu) or drop them.")
        clamp = self.activation_func_clamp_value
        if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
            raise ValueError(f"--activation-func-clamp-value must be finite and above 0, got {clamp}.")

    def _check_linear_attention(self) -> None:
        """The gated delta-net checks (upstream's, plus what is not built here); ValueError with the fix."""
        variant = self.experimental_attention_variant
        if variant is None:
            if self.linear_attention_freq is not None:
                raise ValueError("--linear-attention-freq needs --experimental-attention-variant gdn (or "
                                 "gated_delta_net); add it or drop --linear-attention-freq.")
            return
        if variant not in ("gdn", "gated_delta_net"):
            raise ValueError(f"--experimental-attention-variant {variant} is not implemented here; only gdn "
                             "(alias gated_delta_net) is, drop it or use gdn.")
        freq = self.linear_attention_freq
        if freq is None:
            raise ValueError("--experimental-attention-variant gdn needs --linear-attention-freq (e.g. 4: every "
                             "4th layer softmax attention, or a 0/1 list per layer, 1 = linear).")
        if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
            raise ValueError(f"--linear-attention-freq must be an int or a list of 0/1, got {freq!r}.")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--linear-attention-freq must be a positive int, got {freq}; 1 means no linear layer.")
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers:
                raise ValueError(f"--linear-attention-freq has {len(freq)} entries but --num-layers is "
                                 f"{self.num_layers}; give one 0/1 per layer.")
            if any(v not in (0, 1) for v in freq):
                raise ValueError(f"--linear-attention-freq entries must be 0 (softmax) or 1 (linear), "
                                 f"got {list(freq)}.")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"--linear-num-value-heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"--linear-num-key-heads ({self.linear_num_key_heads}).")
        tp = self.tensor_model_parallel_size
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, name) % tp:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be a multiple of "
                                 f"--tensor-model-parallel-size ({tp}); change one of them.")
        activation = getattr(self, "activation_func", "silu")
        if activation not in ("silu", F.silu) or getattr(self, "squared_relu", False):
            # Upstream's conv and output gate use the model's activation and its kernels take
            # silu only; here both are silu.
            raise ValueError("the gated delta net needs the silu activation (--swiglu), as upstream's kernels; "
                             "add --swiglu.")
        if self.context_parallel_size > 1:
            raise ValueError("the gated delta net with --context-parallel-size > 1 is not supported here (its "
                             "recurrence runs over the whole sequence); use --context-parallel-size 1.")
        if self.multi_latent_attention:
            raise ValueError("--experimental-attention-variant gdn with --multi-latent-attention is not "
                             "supported; drop one.")

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_model_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_model_parallel_size must be a positive integer, got {tp!r}.")
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1; drop it or raise the TP size.")
        if tp == 1:
            return

        if self.tp_group is None or dist.get_world_size(self.tp_group) != tp:
            raise ValueError(
                f"tensor_model_parallel_size {tp} needs tp_group, a process group of {tp} ranks "
                "(megatron.core.parallel_state.get_tensor_model_parallel_group())."
            )
        if self.transformer_impl != "local":
            raise ValueError("tensor parallelism uses the local layers; set transformer_impl='local'.")
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by tensor_model_parallel_size "
                                 f"({tp}); pick a TP size that divides it.")

    def _check_context_parallel(self) -> None:
        cp = self.context_parallel_size
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise ValueError(f"context_parallel_size must be a positive integer, got {cp!r}.")
        comm_types = self.cp_comm_type if isinstance(self.cp_comm_type, (list, tuple)) else [self.cp_comm_type]
        if isinstance(self.cp_comm_type, (list, tuple)) and len(comm_types) != self.num_layers:
            raise ValueError(f"cp_comm_type lists {len(comm_types)} types for {self.num_layers} layers; "
                             "give one per layer or a single type for all.")
        for comm_type in comm_types:
            check_cp_comm_type(comm_type)
        if cp == 1:
            return

        if self.cp_group is None or dist.get_world_size(self.cp_group) != cp:
            raise ValueError(
                f"context_parallel_size {cp} needs cp_group, a process group of {cp} ranks "
                "(the ranks that hold the pieces of the same sequences)."
            )
        tp = self.tensor_model_parallel_size
        heads, groups = self.num_attention_heads // tp, self.num_query_groups // tp
        if "a2a" in comm_types:
            check_heads_divisible(heads, groups, cp, "a2a")
        if "a2a+p2p" in comm_types:
            check_hierarchical_groups(self.hierarchical_cp_groups, self.cp_group)
            check_heads_divisible(heads, groups, dist.get_world_size(self.hierarchical_cp_groups[0]), "a2a+p2p")

    def layer_cp_comm_type(self, layer_number: int) -> str:
        """The CP communication type of layer ``layer_number`` (1-based, as in Megatron)."""
        if isinstance(self.cp_comm_type, (list, tuple)):
            return self.cp_comm_type[layer_number - 1]
        return self.cp_comm_type

    @property
    def yarn(self):
        """YaRN's parameters (rope.YarnScaling; used with position_embedding_type "yarn")."""
        return YarnScaling(self.yarn_rotary_scaling_factor, self.yarn_original_max_position_embeddings,
                           self.yarn_beta_fast, self.yarn_beta_slow, self.yarn_mscale, self.yarn_mscale_all_dim,
                           self.yarn_correction_range_round_to_int)

    @property
    def hidden_init_std(self) -> float:
        """Std of the hidden (non-embedding, non-output-layer) weights: init_method_std, and
        under muP init_method_std / sqrt(mup_width_mult) (upstream's init_method)."""
        return self.init_method_std / math.sqrt(self.mup_width_mult) if self.use_mup else self.init_method_std

    @property
    def rotary_dim(self) -> int:
        """Head dimensions rotated by RoPE (the first ones; the rest pass through)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def activation(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The activation as a callable (resolves names through ACTIVATION_FUNCTIONS)."""
        if isinstance(self.activation_func, str):
            return ACTIVATION_FUNCTIONS[self.activation_func]
        return self.activation_func

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def gate_projection_size(self) -> int:
        """Rows of linear_qkv that hold the attention output gate (0 without it)."""
        return self.query_projection_size if self.attention_output_gate else 0
