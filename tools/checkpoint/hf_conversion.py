"""Mapping between this project's GPTModel tensors and Hugging Face GPT-2 / Llama.

Two model styles convert:

* GPT-2 style -- learned absolute positions, LayerNorm, GELU MLP, multi-head attention
  -> ``GPT2LMHeadModel`` (``c_attn`` / ``c_proj`` / ``c_fc`` are Conv1D: weights stored
  transposed, ``[in, out]``). Models without linear biases get zero biases (exact).
* Llama style -- RoPE, RMSNorm, SwiGLU MLP, any number of query groups
  -> ``LlamaForCausalLM``.
* Qwen3 style -- Llama style with ``--qk-layernorm`` and no linear biases
  -> ``Qwen3ForCausalLM`` (our ``self_attention.q_layernorm`` / ``k_layernorm`` are its
  ``self_attn.q_norm`` / ``k_norm``: RMSNorm over each head, before RoPE, in both).
* Mixtral style -- Llama style with a mixture of SwiGLU experts in every layer (top-k
  softmax routing, no biases) -> ``MixtralForCausalLM``, in the file format Hugging Face
  writes (``block_sparse_moe.gate.weight`` = our ``mlp.router.weight``; expert j's rows of
  our stacked ``experts.linear_fc1.weight`` [E * 2F, H] are ``experts.{j}.w1`` (gate) then
  ``w3`` (up), its rows of ``experts.linear_fc2.weight`` [E * H, F] are ``w2``). The 3-D
  in-memory names of transformers 5 (``mlp.experts.gate_up_proj`` [E, 2F, H],
  ``mlp.experts.down_proj`` [E, H, F]; our tensors reshaped) are read too.
* Qwen2-MoE style -- the Mixtral style plus a shared expert gated by
  ``--moe-shared-expert-gate`` -> ``Qwen2MoeForCausalLM``. Its router's ``norm_topk_prob``
  false is our ``--moe-router-pre-softmax`` (the top-k of the softmax over all experts),
  true our default (the softmax of the top-k logits, the same numbers). Per-expert file
  tensors ``mlp.experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj``, ``mlp.shared_expert.*``
  (our ``mlp.shared_experts.linear_fc1`` = [gate_proj; up_proj], ``linear_fc2`` = down_proj)
  and ``mlp.shared_expert_gate.weight`` = our ``mlp.shared_experts.gate_weight`` ([1, H]).
  ``qkv_bias`` true is our ``--add-qkv-bias`` (a bias on linear_qkv only, split like its rows).

* DeepSeek-V3 style -- multi-latent attention (``--multi-latent-attention`` with the latent
  norms of ``--qk-layernorm``, multi_latent_attention.py) in a Llama-style model with dense
  SwiGLU MLPs -> ``DeepseekV3ForCausalLM`` with ``first_k_dense_replace`` = every layer and
  ``rope_interleave`` (Megatron's MLA RoPE pairs). The layouts are the same, so every
  tensor maps whole: ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (or
  ``linear_q_proj``) are ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (``q_proj``),
  ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` are
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``linear_proj`` is ``o_proj``.
  Hugging Face's latent norms have eps 1e-6 whatever ``rms_norm_eps`` says, ours the one
  ``--norm-epsilon``: only 1e-6 converts. MoE layers after the first ``first_k_dense_replace``
  dense ones (our ``--moe-layer-freq`` pattern) convert too: sigmoid scores
  (``--moe-router-score-function sigmoid``, renormalised: ``norm_topk_prob``), times
  ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``), chosen with
  ``e_score_correction_bias`` (our ``mlp.router.expert_bias``, ``--moe-router-enable-expert-bias``)
  in ``n_group`` groups (``--moe-router-num-groups``; a group's score is the sum of its top
  k / topk_group experts here and of its top 2 there, so with groups only k = 2 x
  topk_group converts), and an ungated shared expert of ``n_shared_experts x
  moe_intermediate_size`` (``mlp.shared_experts``, gate_proj/up_proj/down_proj). YaRN RoPE
  scaling does not convert yet.

The QKV projection is interleaved per query group in our layout (attention.py): for each
group g, ``P = heads / groups`` query heads, then one key head, then one value head, each
``d = kv_channels`` rows. ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]``. Every mapping
below is a permutation / transpose / concatenation of whole rows, so conversions in both
directions are bit-exact.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Optional, Tuple

import torch

Tensors = Dict[str, torch.Tensor]


class ConversionError(ValueError):
    """The checkpoint cannot be converted as asked (the message says why and what to do)."""


@dataclasses.dataclass
class ModelConfig:
    """Everything the conversion needs to know about one of our GPT models."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    normalization: str  # "LayerNorm" | "RMSNorm"
    position_embedding_type: str  # "learned_absolute" | "rope"
    gated_linear_unit: bool
    activation: str  # "gelu" | "gelu_tanh" | "silu" | ...
    add_bias_linear: bool
    tied_embeddings: bool
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    unpadded_vocab_size: Optional[int] = None  # the tokenizer's size when vocab_size is padded
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    num_experts: Optional[int] = None  # a mixture of experts in every layer (Mixtral style)
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    qk_layernorm: bool = False  # q/k norms (Qwen3 style)
    moe_router_pre_softmax: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None  # a gated shared expert (Qwen2-MoE style)
    rotary_interleaved: bool = False  # RoPE pairs (2i, 2i + 1): no Hugging Face style here has them
    add_qkv_bias: bool = False  # a bias on linear_qkv only (--add-qkv-bias; Qwen2-MoE's qkv_bias)
    # DeepSeek-V3 routing (sigmoid scores, correction bias, groups) and its first dense layers.
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_first_dense_layers: int = 0
    # Multi-latent attention (DeepSeek-V3 style); num_query_groups / kv_channels do not apply.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # Qwen3-Next (hybrid gated delta net): its Hugging Face config; imported only (--to mfsdp).
    qwen3_next: Optional[Dict[str, Any]] = None

    @property
    def style(self) -> str:
        if self.qwen3_next is not None:
            return "qwen3_next"
        if self.rotary_interleaved:
            raise ConversionError("this model was trained with --rotary-interleaved (RoPE pairs 2i, 2i+1); Hugging "
                                  "Face Llama/Mixtral rotate halves (i, i + d/2) and would compute something else. "
                                  "Convert it to a consolidated safetensors file instead (--to safetensors).")
        gpt2 = (self.position_embedding_type == "learned_absolute" and self.normalization == "LayerNorm"
                and not self.gated_linear_unit and self.activation in ("gelu", "gelu_tanh"))
        llama = (self.position_embedding_type == "rope" and self.normalization == "RMSNorm"
                 and self.gated_linear_unit and self.activation == "silu")
        if self.multi_latent_attention:
            if not llama or self.add_bias_linear or not self.qk_layernorm:
                raise ConversionError(
                    "multi-latent attention converts only as DeepSeek-V3 (RoPE, RMSNorm, SwiGLU, no linear biases, "
                    "the latent norms of --qk-layernorm); convert this model --to safetensors instead.")
            if self.num_experts and (self.moe_router_score_function != "sigmoid"
                                     or not self.moe_shared_expert_intermediate_size):
                raise ConversionError("DeepSeek-V3's MoE layers route by sigmoid scores and have a shared expert; "
                                      "this model's do not (convert it --to safetensors instead).")
            if self.moe_router_num_groups and self.moe_router_topk != 2 * self.moe_router_group_topk:
                raise ConversionError("DeepSeek-V3 scores a group by its top 2 experts, this model by its top "
                                      f"{self.moe_router_topk // self.moe_router_group_topk}: only --moe-router-topk = 2 "
                                      "x --moe-router-group-topk converts.")
            if self.norm_epsilon != 1e-6:
                raise ConversionError(f"DeepSeek-V3's latent norms use eps 1e-6, this model {self.norm_epsilon:g} "
                                      "for every norm; only --norm-epsilon 1e-6 converts (or --to safetensors).")
            return "deepseek_v3"
        if self.add_qkv_bias and not self.add_bias_linear and not (llama and self.num_experts
                                                                    and self.moe_shared_expert_intermediate_size):
            raise ConversionError("q/k/v biases alone (--add-qkv-bias) convert only in a Qwen2-MoE style model; "
                                  "convert this model --to safetensors instead.")
        if gpt2 and not self.num_experts and not self.qk_layernorm:
            return "gpt2"
        if llama and self.qk_layernorm and not self.num_experts:
            if self.add_bias_linear:
                raise ConversionError("Qwen3 has no MLP biases; this model with --qk-layernorm has linear biases "
                                      "(convert it --to safetensors instead).")
            return "qwen3"
        if self.qk_layernorm:
            raise ConversionError("q/k norms (--qk-layernorm) convert only in a Llama-style dense model (Qwen3); "
                                  "convert this model --to safetensors instead.")
        if llama and self.num_experts:
            if self.add_bias_linear:
                raise ConversionError("Mixtral and Qwen2-MoE have no linear biases here; this MoE model has them "
                                      "(convert it --to safetensors instead).")
            return "qwen2_moe" if self.moe_shared_expert_intermediate_size else "mixtral"
        if llama:
            return "llama"
        raise ConversionError(
            "this model is neither GPT-2 style (learned positions + LayerNorm + GELU) nor Llama style "
            f"(RoPE + RMSNorm + SwiGLU): it has {self.position_embedding_type} positions, {self.normalization}, "
            f"{'SwiGLU' if self.gated_linear_unit else 'a plain'} MLP with {self.activation}. Convert it to a "
            "consolidated safetensors file instead (--to safetensors)."
        )

    def to_megatron_args(self) -> Dict[str, Any]:
        """The arguments pretrain_gpt.py needs to build this model (Megatron flag names)."""
        args = self._megatron_args()
        if self.qwen3_next is not None:
            fields = qwen3_next_config_kwargs(self.qwen3_next)
            args.update({name: fields[name] for name in _QWEN3_NEXT_FIELDS if name in fields})
        return args

    def _megatron_args(self) -> Dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.kv_channels,
            "ffn_hidden_size": self.ffn_hidden_size,
            "padded_vocab_size": self.vocab_size,
            "unpadded_vocab_size": self.unpadded_vocab_size or self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "normalization": self.normalization,
            "position_embedding_type": self.position_embedding_type,
            "swiglu": self.gated_linear_unit,
            "activation_func": self.activation,
            "openai_gelu": self.activation == "gelu_tanh",
            "hidden_dropout": self.hidden_dropout,
            "attention_dropout": self.attention_dropout,
            "add_bias_linear": self.add_bias_linear,
            "untie_embeddings_and_output_weights": not self.tied_embeddings,
            "norm_epsilon": self.norm_epsilon,
            "rotary_base": self.rotary_base,
            **({"rotary_interleaved": True} if self.rotary_interleaved else {}),
            **({"num_experts": self.num_experts, "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
                "moe_router_topk": self.moe_router_topk, "moe_router_pre_softmax": self.moe_router_pre_softmax}
               if self.num_experts else {}),
            **({"moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
                "moe_shared_expert_gate": True} if self.moe_shared_expert_intermediate_size else {}),
            **({"qk_layernorm": True} if self.qk_layernorm else {}),
            **({"add_qkv_bias": True} if self.add_qkv_bias else {}),
            **({"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor":
                self.moe_router_topk_scaling_factor, "moe_router_enable_expert_bias": True,
                "moe_router_num_groups": self.moe_router_num_groups, "moe_router_group_topk": self.moe_router_group_topk,
                "moe_layer_freq": [0] * self.moe_first_dense_layers + [1] * (self.num_layers - self.moe_first_dense_layers),
                "moe_shared_expert_gate": False} if self.num_experts and self.multi_latent_attention else {}),
            **({"multi_latent_attention": True, "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_head_dim": self.qk_head_dim, "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim,
                "v_head_dim": self.v_head_dim} if self.multi_latent_attention else {}),
        }

    def command_line(self) -> list:
        """pretrain_gpt.py flags that build this model (one string per flag and value)."""
        flags = [f"--num-layers {self.num_layers}", f"--hidden-size {self.hidden_size}",
                 f"--num-attention-heads {self.num_attention_heads}", f"--ffn-hidden-size {self.ffn_hidden_size}",
                 f"--max-position-embeddings {self.max_position_embeddings}", f"--norm-epsilon {self.norm_epsilon:g}",
                 f"--hidden-dropout {self.hidden_dropout:g}", f"--attention-dropout {self.attention_dropout:g}"]
        if self.kv_channels * self.num_attention_heads != self.hidden_size and not self.multi_latent_attention:
            flags.append(f"--kv-channels {self.kv_channels}")
        if self.num_query_groups != self.num_attention_heads:
            flags.append(f"--group-query-attention --num-query-groups {self.num_query_groups}")
        if self.position_embedding_type == "rope":
            flags.append(f"--position-embedding-type rope --rotary-base {self.rotary_base:g}")
            if self.rotary_interleaved:
                flags.append("--rotary-interleaved")
        if self.normalization == "RMSNorm":
            flags.append("--normalization RMSNorm")
        if self.gated_linear_unit:
            flags.append("--swiglu")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.multi_latent_attention:
            flags.append("--multi-latent-attention" + (f" --q-lora-rank {self.q_lora_rank}" if self.q_lora_rank else "")
                         + f" --kv-lora-rank {self.kv_lora_rank} --qk-head-dim {self.qk_head_dim} "
                         f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} --v-head-dim {self.v_head_dim}")
        if self.activation == "gelu_tanh":
            flags.append("--openai-gelu")
        if not self.add_bias_linear:
            flags.append("--disable-bias-linear")
        if self.add_qkv_bias:
            flags.append("--add-qkv-bias")
        if not self.tied_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
        if self.num_experts:
            flags.append(f"--num-experts {self.num_experts} --moe-ffn-hidden-size {self.moe_ffn_hidden_size} "
                         f"--moe-router-topk {self.moe_router_topk}")
            if self.moe_router_pre_softmax:
                flags.append("--moe-router-pre-softmax")
        if self.moe_shared_expert_intermediate_size:
            flags.append(f"--moe-shared-expert-intermediate-size {self.moe_shared_expert_intermediate_size}"
                         + ("" if self.multi_latent_attention else " --moe-shared-expert-gate"))
        if self.num_experts and self.multi_latent_attention:
            freq = f"([0]*{self.moe_first_dense_layers}+[1]*{self.num_layers - self.moe_first_dense_layers})"
            flags.append(f"--moe-layer-freq {freq} --moe-router-score-function sigmoid --moe-router-enable-expert-bias"
                         + (f" --moe-router-topk-scaling-factor {self.moe_router_topk_scaling_factor:g}"
                            if self.moe_router_topk_scaling_factor else "")
                         + (f" --moe-router-num-groups {self.moe_router_num_groups} --moe-router-group-topk "
                            f"{self.moe_router_group_topk}" if self.moe_router_num_groups else ""))
        if self.qwen3_next is not None:
            f = qwen3_next_config_kwargs(self.qwen3_next)
            pattern = lambda values: "'[" + ",".join(str(v) for v in values) + "]'"  # noqa: E731
            flags.append(f"--attention-output-gate --rotary-percent {f['rotary_percent']:g}")
            flags.append(f"--experimental-attention-variant gdn --linear-attention-freq "
                         f"{pattern(f['linear_attention_freq'])} "
                         f"--linear-conv-kernel-dim {f['linear_conv_kernel_dim']} "
                         f"--linear-key-head-dim {f['linear_key_head_dim']} --linear-value-head-dim "
                         f"{f['linear_value_head_dim']} --linear-num-key-heads {f['linear_num_key_heads']} "
                         f"--linear-num-value-heads {f['linear_num_value_heads']}")
            if "moe_layer_freq" in f:
                flags.append(f"--moe-layer-freq {pattern(f['moe_layer_freq'])}")
        return flags


# ----------------------------------------------------------------------------------------
# Our config from saved arguments and tensor shapes
# ----------------------------------------------------------------------------------------


def config_from_tensors(tensors_or_shapes: Dict[str, Any], args: Optional[Dict[str, Any]] = None,
                        overrides: Optional[Dict[str, Any]] = None) -> ModelConfig:
    """Derive the model configuration from tensor shapes; what shapes cannot tell (head
    counts, epsilon, RoPE base, activation) comes from the saved ``args`` or ``overrides``."""
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in tensors_or_shapes.items()}
    args = dict(args or {})
    args.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if "embedding.word_embeddings.weight" not in shapes:
        raise ConversionError("no 'embedding.word_embeddings.weight': this is not a GPTModel checkpoint.")
    # Trainer options that the Hugging Face GPT-2 / Llama formats cannot express: refuse
    # rather than write a model that computes something else.
    if args.get("apply_layernorm_1p"):
        raise ConversionError("this checkpoint was trained with --apply-layernorm-1p (norm weights stored "
                              "as gamma - 1), which Hugging Face GPT-2/Llama cannot express; convert a model "
                              "trained without it.")
    if args.get("experimental_attention_variant") or any(".self_attention.in_proj." in k for k in shapes):
        raise ConversionError("this checkpoint has gated delta-net layers (--experimental-attention-variant, "
                              "Qwen3-Next's hybrid), which the Hugging Face converter does not write yet (only "
                              "qwen3_next_gdn_to_hf, one layer); convert it --to safetensors instead.")
    if args.get("attention_output_gate"):
        raise ConversionError("this checkpoint was trained with --attention-output-gate (gated attention), which "
                              "Hugging Face GPT-2/Llama/Qwen3 cannot express; convert it --to safetensors instead.")
    gpt_oss = [flag for flag, on in (
        ("--softmax-type", args.get("softmax_type") not in (None, "vanilla")
         or any(k.endswith(".softmax_offset") for k in shapes)),
        ("--window-size", args.get("window_size")), ("--quick-geglu", args.get("quick_geglu")),
        ("--glu-linear-offset", args.get("glu_linear_offset")),
        ("--activation-func-clamp-value", args.get("activation_func_clamp_value") is not None)) if on]
    if gpt_oss:
        raise ConversionError(f"this checkpoint uses GPT-OSS's blocks ({', '.join(gpt_oss)}), which the Hugging Face "
                              "converter does not write (no gpt_oss export yet); convert it --to safetensors instead.")
    if float(args.get("rotary_percent", 1.0) or 1.0) != 1.0:
        raise ConversionError(f"this checkpoint uses --rotary-percent {args['rotary_percent']} (partial RoPE), "
                              "which Hugging Face Llama cannot express; convert a model trained with 1.0.")
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    layers = sorted({int(m.group(1)) for k in shapes for m in [re.match(r"decoder\.layers\.(\d+)\.", k)] if m})
    if not layers or layers != list(range(len(layers))):
        raise ConversionError("the checkpoint's decoder layers are not numbered 0..N-1.")
    heads = args.get("num_attention_heads")
    if heads is None:
        raise ConversionError("the number of attention heads is not recorded in this checkpoint; pass "
                              "--num-attention-heads (and --num-query-groups for grouped-query attention).")
    groups = args.get("num_query_groups") or heads
    mla = _mla_from_tensors(shapes, args, heads)
    if mla:
        groups, kv_channels = heads, mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
    else:
        qkv_rows = shapes["decoder.layers.0.self_attention.linear_qkv.weight"][0]
        if qkv_rows % (heads + 2 * groups):
            raise ConversionError(f"linear_qkv has {qkv_rows} rows, not a multiple of heads + 2 * groups = "
                                  f"{heads + 2 * groups}; check --num-attention-heads / --num-query-groups.")
        kv_channels = qkv_rows // (heads + 2 * groups)
    moe = _deepseek_moe_from_tensors(shapes, args, len(layers)) if mla else _moe_from_tensors(shapes, args, len(layers))
    first_moe = moe.get("moe_first_dense_layers", 0)
    mlp = f"decoder.layers.{first_moe}.mlp.experts." if moe else "decoder.layers.0.mlp."
    ffn = shapes[mlp + "linear_fc2.weight"][1]
    fc1_rows = shapes[mlp + "linear_fc1.weight"][0] // (moe["num_experts"] if moe else 1)
    gated = fc1_rows == 2 * ffn
    if moe:
        moe["moe_ffn_hidden_size"] = ffn
        dense = "decoder.layers.0.mlp.linear_fc2.weight"
        ffn = int(args.get("ffn_hidden_size") or (shapes[dense][1] if dense in shapes else ffn))
    learned = "embedding.position_embeddings.weight" in shapes
    max_positions = shapes["embedding.position_embeddings.weight"][0] if learned else int(
        args.get("max_position_embeddings") or args.get("seq_length") or 2048)
    rms = "decoder.final_layernorm.bias" not in shapes
    from megatron.training.model_builder import activation_from_args

    activation = activation_from_args(dict(args, swiglu=gated))
    return ModelConfig(
        num_layers=len(layers), hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=kv_channels, ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_positions,
        normalization="RMSNorm" if rms else "LayerNorm",
        position_embedding_type="learned_absolute" if learned else "rope",
        gated_linear_unit=gated, activation=activation,
        # linear_proj's bias tells add_bias_linear; a linear_qkv bias without it is --add-qkv-bias.
        add_bias_linear="decoder.layers.0.self_attention.linear_proj.bias" in shapes,
        add_qkv_bias=("decoder.layers.0.self_attention.linear_qkv.bias" in shapes
                      and "decoder.layers.0.self_attention.linear_proj.bias" not in shapes),
        tied_embeddings="output_layer.weight" not in shapes,
        norm_epsilon=float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))),
        rotary_base=float(args.get("rotary_base", 10000.0)),
        rotary_interleaved=bool(args.get("rotary_interleaved", False)) and not learned,
        unpadded_vocab_size=args.get("unpadded_vocab_size"),
        hidden_dropout=float(args.get("hidden_dropout", 0.0)),
        attention_dropout=float(args.get("attention_dropout", 0.0)),
        qk_layernorm=("decoder.layers.0.self_attention.kv_layernorm.weight" if mla else
                      "decoder.layers.0.self_attention.q_layernorm.weight") in shapes,
        **moe, **mla,
    )


def _deepseek_moe_from_tensors(shapes, args, num_layers) -> Dict[str, Any]:
    """DeepSeek-V3's MoE fields ({} without MoE layers): dense layers first, then MoE layers."""
    routers = [i for i in range(num_layers) if f"decoder.layers.{i}.mlp.router.weight" in shapes]
    if not routers:
        return {}
    first = routers[0]
    if routers != list(range(first, num_layers)):
        raise ConversionError(f"MoE layers {routers} of {num_layers}: DeepSeek-V3 has dense layers first, then only "
                              "MoE layers (convert --to safetensors instead).")
    m = f"decoder.layers.{first}.mlp."
    fields = {"num_experts": shapes[m + "router.weight"][0], "moe_router_topk": int(args.get("moe_router_topk") or 2),
              "moe_first_dense_layers": first,
              "moe_router_score_function": args.get("moe_router_score_function") or "softmax",
              "moe_router_topk_scaling_factor": args.get("moe_router_topk_scaling_factor"),
              "moe_router_enable_expert_bias": m + "router.expert_bias" in shapes,
              "moe_router_num_groups": args.get("moe_router_num_groups"),
              "moe_router_group_topk": args.get("moe_router_group_topk")}
    if m + "shared_experts.gate_weight" in shapes:
        raise ConversionError("DeepSeek-V3's shared expert has no gate; this model gates it (--moe-shared-expert-gate).")
    if m + "shared_experts.linear_fc2.weight" in shapes:
        fields["moe_shared_expert_intermediate_size"] = shapes[m + "shared_experts.linear_fc2.weight"][1]
    return fields


def _mla_from_tensors(shapes, args, heads) -> Dict[str, Any]:
    """The MLA fields ({} for standard attention): the head dimensions from the saved
    arguments (the shapes fix only their sums), checked against the shapes."""
    attention = "decoder.layers.0.self_attention."
    if attention + "linear_kv_down_proj.weight" not in shapes:
        return {}
    fields = {"multi_latent_attention": True, "q_lora_rank": None}
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if args.get(name) is None:
            raise ConversionError(f"this multi-latent attention checkpoint does not record {name}; pass "
                                  f"--{name.replace('_', '-')}.")
        fields[name] = int(args[name])
    if attention + "linear_q_down_proj.weight" in shapes:
        fields["q_lora_rank"] = shapes[attention + "linear_q_down_proj.weight"][0]
    q_up = attention + ("linear_q_up_proj.weight" if fields["q_lora_rank"] else "linear_q_proj.weight")
    expected = {attention + "linear_kv_down_proj.weight": fields["kv_lora_rank"] + fields["qk_pos_emb_head_dim"],
                attention + "linear_kv_up_proj.weight": heads * (fields["qk_head_dim"] + fields["v_head_dim"]),
                q_up: heads * (fields["qk_head_dim"] + fields["qk_pos_emb_head_dim"])}
    for name, rows in expected.items():
        if shapes[name][0] != rows:
            raise ConversionError(f"{name} has {shapes[name][0]} rows, the recorded MLA sizes give {rows}; check "
                                  "--num-attention-heads and the MLA head dimensions.")
    return fields


def _moe_from_tensors(shapes, args, num_layers) -> Dict[str, Any]:
    """The MoE fields ({} for a dense model); refuses what Mixtral / Qwen2-MoE cannot express."""
    routers = [i for i in range(num_layers) if f"decoder.layers.{i}.mlp.router.weight" in shapes]
    if not routers:
        return {}
    if len(routers) != num_layers:
        raise ConversionError(f"only layers {routers} of {num_layers} are MoE layers; Mixtral and Qwen2-MoE "
                              "(as converted here) have experts in every layer (convert --to safetensors instead).")
    fields = {"num_experts": shapes["decoder.layers.0.mlp.router.weight"][0],
              "moe_router_topk": int(args.get("moe_router_topk") or 2)}
    shared = "decoder.layers.0.mlp.shared_experts."
    if shared + "linear_fc2.weight" in shapes:
        if shared + "gate_weight" not in shapes:
            raise ConversionError("this MoE model has an ungated shared expert; Qwen2-MoE gates it "
                                  "(--moe-shared-expert-gate) and Mixtral has none (convert --to safetensors).")
        fields["moe_shared_expert_intermediate_size"] = shapes[shared + "linear_fc2.weight"][1]
        # Qwen2-MoE's norm_topk_prob chooses between the two softmax routings.
        fields["moe_router_pre_softmax"] = bool(args.get("moe_router_pre_softmax", False))
    routing = {"moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None}
    if "moe_shared_expert_intermediate_size" not in fields:
        routing["moe_router_pre_softmax"] = False
    for key, expected in routing.items():
        if args.get(key, expected) not in (expected, None if expected is False else expected):
            raise ConversionError(f"this model routes with {key} = {args[key]!r}; Mixtral routes by the softmax of "
                                  "the top-k logits, Qwen2-MoE by softmax scores (convert --to safetensors instead).")
    return fields


# ----------------------------------------------------------------------------------------
# QKV layout
# ----------------------------------------------------------------------------------------


def split_qkv(t: torch.Tensor, cfg: ModelConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our interleaved rows -> q [H*d, ...], k [G*d, ...], v [G*d, ...] in head order."""
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = heads // groups
    rest = tuple(t.shape[1:])
    view = t.reshape((groups, (per + 2) * d) + rest)
    q, k, v = torch.split(view, [per * d, d, d], dim=1)
    return (q.reshape((heads * d,) + rest).contiguous(), k.reshape((groups * d,) + rest).contiguous(),
            v.reshape((groups * d,) + rest).contiguous())


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = heads // groups
    rest = tuple(q.shape[1:])
    merged = torch.cat([q.reshape((groups, per * d) + rest), k.reshape((groups, d) + rest),
                        v.reshape((groups, d) + rest)], dim=1)
    return merged.reshape((groups * (per + 2) * d,) + rest).contiguous()


# ----------------------------------------------------------------------------------------
# Ours -> Hugging Face
# ----------------------------------------------------------------------------------------


def _bias(ours: Tensors, key: str, rows: int, like: torch.Tensor) -> torch.Tensor:
    return ours[key] if key in ours else torch.zeros(rows, dtype=like.dtype)


def to_hf(ours: Tensors, cfg: ModelConfig, vocab_size: Optional[int] = None) -> Tensors:
    """Our tensors (names without the ``model.`` prefix) -> Hugging Face state dict.
    ``vocab_size`` trims padded vocabulary rows."""
    style = cfg.style
    vocab = vocab_size or cfg.vocab_size
    if vocab > cfg.vocab_size:
        raise ConversionError(f"--vocab-size {vocab} exceeds the model's {cfg.vocab_size} rows.")
    out: Tensors = {}
    emb = ours["embedding.word_embeddings.weight"][:vocab].contiguous()
    if style == "gpt2":
        if cfg.num_query_groups != cfg.num_attention_heads:
            raise ConversionError("GPT-2 has no grouped-query attention; this model has "
                                  f"{cfg.num_query_groups} query groups for {cfg.num_attention_heads} heads.")
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConversionError("GPT-2 needs kv_channels * heads == hidden size.")
        out["transformer.wte.weight"] = emb
        out["transformer.wpe.weight"] = ours["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = ours["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = ours["decoder.final_layernorm.bias"]
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = ours["output_layer.weight"][:vocab].contiguous()
        h = cfg.hidden_size
        for i in range(cfg.num_layers):
            m, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
            w = ours[m + "self_attention.linear_qkv.weight"]
            out[o + "attn.c_attn.weight"] = torch.cat(split_qkv(w, cfg)).t().contiguous()
            b = _bias(ours, m + "self_attention.linear_qkv.bias", 3 * h, w)
            out[o + "attn.c_attn.bias"] = torch.cat(split_qkv(b, cfg)).contiguous()
            proj = ours[m + "self_attention.linear_proj.weight"]
            out[o + "attn.c_proj.weight"] = proj.t().contiguous()
            out[o + "attn.c_proj.bias"] = _bias(ours, m + "self_attention.linear_proj.bias", h, proj)
            fc1 = ours[m + "mlp.linear_fc1.weight"]
            out[o + "mlp.c_fc.weight"] = fc1.t().contiguous()
            out[o + "mlp.c_fc.bias"] = _bias(ours, m + "mlp.linear_fc1.bias", fc1.shape[0], fc1)
            fc2 = ours[m + "mlp.linear_fc2.weight"]
            out[o + "mlp.c_proj.weight"] = fc2.t().contiguous()
            out[o + "mlp.c_proj.bias"] = _bias(ours, m + "mlp.linear_fc2.bias", h, fc2)
            for mine, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[o + theirs + ".weight"] = ours[m + mine + ".weight"]
                out[o + theirs + ".bias"] = ours[m + mine + ".bias"]
        return out
    out["model.embed_tokens.weight"] = emb
    out["model.norm.weight"] = ours["decoder.final_layernorm.weight"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = ours["output_layer.weight"][:vocab].contiguous()
    for i in range(cfg.num_layers):
        m, o = f"decoder.layers.{i}.", f"model.layers.{i}."
        kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
        for kind in kinds:
            if style == "deepseek_v3":
                out.update({o + "self_attn." + hf: ours[m + "self_attention." + mine]
                            for mine, hf in _mla_names(cfg)})
            else:
                q, k, v = split_qkv(ours[m + "self_attention.linear_qkv." + kind], cfg)
                out[o + "self_attn.q_proj." + kind], out[o + "self_attn.k_proj." + kind] = q, k
                out[o + "self_attn.v_proj." + kind] = v
            out[o + "self_attn.o_proj." + kind] = ours[m + "self_attention.linear_proj." + kind]
            if style == "qwen2_moe":
                out.update(_qwen2_moe_to_hf(ours, cfg, m, o))
                continue
            if style == "deepseek_v3" and cfg.num_experts and i >= cfg.moe_first_dense_layers:
                out.update(_deepseek_moe_to_hf(ours, cfg, m, o))
                continue
            if style == "mixtral":
                experts, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
                moe = o + "block_sparse_moe."
                out[moe + "gate.weight"] = ours[m + "mlp.router.weight"]
                fc1 = ours[m + "mlp.experts.linear_fc1.weight"].reshape(experts, 2 * f, h)
                fc2 = ours[m + "mlp.experts.linear_fc2.weight"].reshape(experts, h, f)
                for j in range(experts):
                    out[f"{moe}experts.{j}.w1.weight"] = fc1[j, :f].contiguous()
                    out[f"{moe}experts.{j}.w3.weight"] = fc1[j, f:].contiguous()
                    out[f"{moe}experts.{j}.w2.weight"] = fc2[j].contiguous()
                continue
            gate, up = ours[m + "mlp.linear_fc1." + kind].chunk(2, dim=0)
            out[o + "mlp.gate_proj." + kind], out[o + "mlp.up_proj." + kind] = gate.contiguous(), up.contiguous()
            out[o + "mlp.down_proj." + kind] = ours[m + "mlp.linear_fc2." + kind]
        if cfg.add_qkv_bias:
            q, k, v = split_qkv(ours[m + "self_attention.linear_qkv.bias"], cfg)
            out[o + "self_attn.q_proj.bias"], out[o + "self_attn.k_proj.bias"], out[o + "self_attn.v_proj.bias"] = q, k, v
        out[o + "input_layernorm.weight"] = ours[m + "input_layernorm.weight"]
        out[o + "post_attention_layernorm.weight"] = ours[m + "pre_mlp_layernorm.weight"]
        if style == "qwen3":
            out[o + "self_attn.q_norm.weight"] = ours[m + "self_attention.q_layernorm.weight"]
            out[o + "self_attn.k_norm.weight"] = ours[m + "self_attention.k_layernorm.weight"]
    return out


def _deepseek_moe_to_hf(ours: Tensors, cfg: ModelConfig, m: str, o: str) -> Tensors:
    """One MoE layer in DeepSeek-V3's file format: Qwen2-MoE's experts, an ungated shared
    expert, and the router's correction bias (zeros where ours has no expert bias)."""
    out = _qwen2_moe_to_hf(ours, cfg, m, o, gated=False)
    out = {k.replace(o + "mlp.shared_expert.", o + "mlp.shared_experts."): v for k, v in out.items()}
    bias = ours.get(m + "mlp.router.expert_bias")
    out[o + "mlp.gate.e_score_correction_bias"] = (bias if bias is not None else
                                                   torch.zeros(cfg.num_experts, dtype=torch.float32))
    return out


def _mla_names(cfg: ModelConfig):
    """(our name, DeepSeek-V3's) of one layer's MLA tensors, without the linear_proj/o_proj."""
    q = ([("linear_q_down_proj.weight", "q_a_proj.weight"), ("q_layernorm.weight", "q_a_layernorm.weight"),
          ("linear_q_up_proj.weight", "q_b_proj.weight")] if cfg.q_lora_rank else
         [("linear_q_proj.weight", "q_proj.weight")])
    return q + [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
                ("kv_layernorm.weight", "kv_a_layernorm.weight"), ("linear_kv_up_proj.weight", "kv_b_proj.weight")]


def _qwen2_moe_to_hf(ours: Tensors, cfg: ModelConfig, m: str, o: str, gated: bool = True) -> Tensors:
    """One layer's router, per-expert and shared-expert tensors, in Qwen2-MoE's file format."""
    experts, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
    out = {o + "mlp.gate.weight": ours[m + "mlp.router.weight"]}
    fc1 = ours[m + "mlp.experts.linear_fc1.weight"].reshape(experts, 2 * f, h)
    fc2 = ours[m + "mlp.experts.linear_fc2.weight"].reshape(experts, h, f)
    for j in range(experts):
        out[f"{o}mlp.experts.{j}.gate_proj.weight"] = fc1[j, :f].contiguous()
        out[f"{o}mlp.experts.{j}.up_proj.weight"] = fc1[j, f:].contiguous()
        out[f"{o}mlp.experts.{j}.down_proj.weight"] = fc2[j].contiguous()
    gate, up = ours[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
    out[o + "mlp.shared_expert.gate_proj.weight"], out[o + "mlp.shared_expert.up_proj.weight"] = (
        gate.contiguous(), up.contiguous())
    out[o + "mlp.shared_expert.down_proj.weight"] = ours[m + "mlp.shared_experts.linear_fc2.weight"]
    if gated:
        out[o + "mlp.shared_expert_gate.weight"] = ours[m + "mlp.shared_experts.gate_weight"]
    return out


def hf_config(cfg: ModelConfig, vocab_size: Optional[int] = None, base: Optional[Dict[str, Any]] = None,
              dtype: Optional[torch.dtype] = None, eod: Optional[int] = None) -> Dict[str, Any]:
    """config.json for the converted model. ``base`` (e.g. the config a model was imported
    from) keeps its other fields; the architecture fields always come from ``cfg``."""
    vocab = vocab_size or cfg.vocab_size
    config: Dict[str, Any] = dict(base or {})
    dtype_name = str(dtype or torch.float32).replace("torch.", "")
    token = eod if eod is not None and eod < vocab else None
    if cfg.style == "gpt2":
        activation = {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.activation]
        config.setdefault("resid_pdrop", cfg.hidden_dropout)
        config.setdefault("embd_pdrop", cfg.hidden_dropout)
        config.setdefault("attn_pdrop", cfg.attention_dropout)
        config.setdefault("bos_token_id", token)
        config.setdefault("eos_token_id", token)
        config.update({
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": cfg.max_position_embeddings, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size, "activation_function": activation,
            "layer_norm_epsilon": cfg.norm_epsilon, "tie_word_embeddings": cfg.tied_embeddings,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "torch_dtype": dtype_name,
        })
        return config
    config.setdefault("attention_dropout", cfg.attention_dropout)
    config.setdefault("bos_token_id", token)
    config.setdefault("eos_token_id", token)
    config.setdefault("initializer_range", 0.02)
    config.pop("rope_scaling", None)
    if cfg.style == "mixtral":
        config.setdefault("router_aux_loss_coef", 0.0)
        config.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                       "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
                       "intermediate_size": cfg.moe_ffn_hidden_size, "sliding_window": None,
                       "router_jitter_noise": 0.0, "output_router_logits": False})
        config.update(_attention_fields(cfg, vocab, dtype_name))
        return config
    if cfg.style == "qwen2_moe":
        config.setdefault("router_aux_loss_coef", 0.0)
        config.update({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                       "intermediate_size": cfg.ffn_hidden_size, "num_experts": cfg.num_experts,
                       "num_experts_per_tok": cfg.moe_router_topk, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
                       "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                       "norm_topk_prob": not cfg.moe_router_pre_softmax, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "qkv_bias": cfg.add_qkv_bias, "use_sliding_window": False,
                       "max_window_layers": cfg.num_layers, "layer_types": ["full_attention"] * cfg.num_layers,
                       "output_router_logits": False})
        config.update(_attention_fields(cfg, vocab, dtype_name))
        return config
    if cfg.style == "deepseek_v3":
        config.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                       "intermediate_size": cfg.ffn_hidden_size, "first_k_dense_replace": cfg.num_layers,
                       "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
                       "qk_nope_head_dim": cfg.qk_head_dim, "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
                       "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_pos_emb_head_dim, "rope_interleave": True,
                       "attention_bias": False})
        if cfg.num_experts:
            shared = cfg.moe_shared_expert_intermediate_size
            if shared % cfg.moe_ffn_hidden_size:
                raise ConversionError(f"DeepSeek-V3's shared expert is n_shared_experts x moe_intermediate_size wide; "
                                      f"{shared} is not a multiple of {cfg.moe_ffn_hidden_size}.")
            config.update({"first_k_dense_replace": cfg.moe_first_dense_layers, "n_routed_experts": cfg.num_experts,
                           "num_experts_per_tok": cfg.moe_router_topk, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
                           "n_shared_experts": shared // cfg.moe_ffn_hidden_size, "norm_topk_prob": True,
                           "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
                           "n_group": cfg.moe_router_num_groups or 1, "topk_group": cfg.moe_router_group_topk or 1})
        config.update(_attention_fields(cfg, vocab, dtype_name))
        config["head_dim"] = cfg.qk_pos_emb_head_dim  # Hugging Face's RoPE table size
        return config
    if cfg.style == "qwen3":
        config.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                       "intermediate_size": cfg.ffn_hidden_size, "attention_bias": False,
                       "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
                       "layer_types": ["full_attention"] * cfg.num_layers})
        config.update(_attention_fields(cfg, vocab, dtype_name))
        return config
    config.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
        "tie_word_embeddings": cfg.tied_embeddings, "pretraining_tp": 1, "torch_dtype": dtype_name,
    })
    return config


def _attention_fields(cfg: ModelConfig, vocab: int, dtype_name: str) -> Dict[str, Any]:
    """Mixtral's config.json fields shared with Llama (attention, norms, RoPE, embeddings)."""
    return {"vocab_size": vocab, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
            "tie_word_embeddings": cfg.tied_embeddings, "torch_dtype": dtype_name}


# ----------------------------------------------------------------------------------------
# Hugging Face -> ours
# ----------------------------------------------------------------------------------------


def config_from_hf(config: Dict[str, Any]) -> ModelConfig:
    kind = config.get("model_type")
    if kind == "gpt2":
        activation = config.get("activation_function", "gelu_new")
        mapped = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(activation)
        if mapped is None:
            raise ConversionError(f"GPT-2 activation {activation!r} has no equivalent here (gelu, gelu_new).")
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
            raise ConversionError("GPT-2 variants with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                                  "compute attention differently; they cannot be converted.")
        if config.get("scale_attn_weights") is False:
            raise ConversionError("GPT-2 with scale_attn_weights=false is not supported.")
        hidden, heads = config["n_embd"], config["n_head"]
        return ModelConfig(
            num_layers=config["n_layer"], hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
            kv_channels=hidden // heads, ffn_hidden_size=config.get("n_inner") or 4 * hidden,
            vocab_size=config["vocab_size"], max_position_embeddings=config["n_positions"],
            normalization="LayerNorm", position_embedding_type="learned_absolute", gated_linear_unit=False,
            activation=mapped, add_bias_linear=True, tied_embeddings=config.get("tie_word_embeddings", True),
            norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
            # Megatron has one hidden dropout (embeddings and residuals); GPT-2 has two.
            hidden_dropout=float(config.get("resid_pdrop", 0.1)),
            attention_dropout=float(config.get("attn_pdrop", 0.1)),
        )
    if kind == "mixtral":
        dense = config_from_hf(dict(config, model_type="llama", attention_bias=False, mlp_bias=False))
        if config.get("sliding_window"):
            raise ConversionError("Mixtral with sliding-window attention is not supported (full causal attention only).")
        return dataclasses.replace(dense, num_experts=config["num_local_experts"],
                                   moe_ffn_hidden_size=config["intermediate_size"],
                                   moe_router_topk=config.get("num_experts_per_tok", 2))
    if kind == "qwen2_moe":
        if config.get("use_sliding_window"):
            raise ConversionError("Qwen2-MoE with sliding-window attention is not supported (full causal attention "
                                  "only).")
        if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
            raise ConversionError("Qwen2-MoE with dense layers (decoder_sparse_step > 1 or mlp_only_layers) is not "
                                  "supported; every layer must be a MoE layer.")
        if not config.get("shared_expert_intermediate_size"):
            raise ConversionError("Qwen2-MoE without a shared expert: convert it as Mixtral-style instead.")
        dense = config_from_hf(dict(config, model_type="llama", attention_bias=False, mlp_bias=False))
        return dataclasses.replace(dense, num_experts=config["num_experts"],
                                   moe_ffn_hidden_size=config["moe_intermediate_size"],
                                   moe_router_topk=config.get("num_experts_per_tok", 2),
                                   moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                                   moe_shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
                                   add_qkv_bias=bool(config.get("qkv_bias", True)))
    if kind == "deepseek_v3":
        layers = config["num_hidden_layers"]
        first_moe = min(int(config.get("first_k_dense_replace", 3)), layers)
        topk, groups, group_topk = (config.get("num_experts_per_tok", 8), config.get("n_group", 1) or 1,
                                    config.get("topk_group", 1) or 1)
        if first_moe < layers and topk > 1 and not config.get("norm_topk_prob", True):
            raise ConversionError("DeepSeek-V3 with norm_topk_prob false does not convert: sigmoid routing "
                                  "renormalises the top-k weights here.")
        if first_moe < layers and groups > 1 and topk != 2 * group_topk:
            raise ConversionError("DeepSeek-V3 scores a group by its top 2 experts, Megatron by its top "
                                  "num_experts_per_tok / topk_group: with n_group > 1 only num_experts_per_tok = 2 x "
                                  "topk_group converts.")
        if not config.get("rope_interleave", True):
            raise ConversionError("DeepSeek-V3 with rope_interleave false rotates halves of its rope part; "
                                  "Megatron's multi-latent attention rotates interleaved pairs: not convertible.")
        if config.get("attention_bias"):
            raise ConversionError("DeepSeek-V3 with attention_bias is not supported (no linear biases here).")
        if float(config.get("rms_norm_eps", 1e-6)) != 1e-6:
            raise ConversionError("DeepSeek-V3 with rms_norm_eps other than 1e-6 (its latent norms' fixed eps) "
                                  "does not convert: this model has one --norm-epsilon for every norm.")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConversionError(f"DeepSeek-V3 with RoPE scaling {rope.get('rope_type')!r} (YaRN) does not convert "
                                  "yet; only default RoPE does.")
        dense = config_from_hf(dict(config, model_type="llama", attention_bias=False, mlp_bias=False,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": rope.get("rope_theta", config.get("rope_theta",
                                                                                                     10000.0))}))
        heads = config["num_attention_heads"]
        return dataclasses.replace(
            dense, num_query_groups=heads, kv_channels=config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
            qk_layernorm=True, multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"], qk_head_dim=config["qk_nope_head_dim"],
            qk_pos_emb_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
            **({} if first_moe >= layers else dict(
                num_experts=config["n_routed_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
                moe_router_topk=topk, moe_first_dense_layers=first_moe, moe_router_score_function="sigmoid",
                moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                moe_router_enable_expert_bias=True, moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                moe_shared_expert_intermediate_size=config["moe_intermediate_size"] * config.get("n_shared_experts", 1))))
    if kind == "qwen3_next":
        fields = qwen3_next_config_kwargs(config)  # refuses what it cannot express
        if config.get("attention_bias"):
            raise ConversionError("Qwen3-Next with attention_bias is not supported (no linear biases).")
        rope = dict(config.get("rope_parameters") or {}, rope_type="default")
        dense = config_from_hf(dict(config, model_type="llama", attention_bias=False, mlp_bias=False,
                                    rope_parameters=rope))
        moe = {} if "num_moe_experts" not in fields else dict(
            num_experts=fields["num_moe_experts"], moe_ffn_hidden_size=fields["moe_ffn_hidden_size"],
            moe_router_topk=fields["moe_router_topk"],
            moe_router_pre_softmax=fields.get("moe_router_pre_softmax", False),
            moe_shared_expert_intermediate_size=fields["moe_shared_expert_intermediate_size"])
        return dataclasses.replace(dense, qk_layernorm=True, qwen3_next=dict(config), **moe)
    if kind == "qwen3":
        if config.get("attention_bias"):
            raise ConversionError("Qwen3 with attention_bias has biases in attention but not in the MLP; this model "
                                  "has one switch for all linear biases (add_bias_linear).")
        if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or ()):
            raise ConversionError("Qwen3 with sliding-window attention is not supported (full causal attention only).")
        dense = config_from_hf(dict(config, model_type="llama", attention_bias=False, mlp_bias=False))
        return dataclasses.replace(dense, qk_layernorm=True)
    if kind == "llama":
        if config.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"Llama with hidden_act {config['hidden_act']!r} is not supported (silu only).")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConversionError(f"RoPE scaling {rope.get('rope_type')!r} is not supported (default RoPE only).")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", False)):
            raise ConversionError("attention_bias and mlp_bias differ; this model has one switch for all "
                                  "linear biases (add_bias_linear).")
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return ModelConfig(
            num_layers=config["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            kv_channels=config.get("head_dim") or hidden // heads, ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], max_position_embeddings=config.get("max_position_embeddings", 2048),
            normalization="RMSNorm", position_embedding_type="rope", gated_linear_unit=True, activation="silu",
            add_bias_linear=bool(config.get("attention_bias", False)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_epsilon=config.get("rms_norm_eps", 1e-6), rotary_base=float(theta),
            attention_dropout=float(config.get("attention_dropout", 0.0)),
        )
    raise ConversionError(f"Hugging Face model_type {kind!r} is not supported; GPT-2 ('gpt2'), Llama "
                          "('llama'), Qwen3 ('qwen3'), Mixtral ('mixtral'), Qwen2-MoE ('qwen2_moe'), DeepSeek-V3 "
                          "('deepseek_v3', dense MLPs) and, to this trainer only, Qwen3-Next ('qwen3_next') models "
                          "convert.")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == t.shape[0]:
        return t
    return torch.cat([t, torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)])


def _need(theirs: Tensors, key: str) -> torch.Tensor:
    if key not in theirs:
        raise ConversionError(f"the Hugging Face checkpoint has no tensor {key!r}; it does not match its config.json.")
    return theirs[key]


def from_hf(theirs: Tensors, cfg: ModelConfig, padded_vocab: Optional[int] = None) -> Tensors:
    """Hugging Face state dict -> our tensors (names without ``model.``); the vocabulary is
    zero-padded to ``padded_vocab`` rows."""
    vocab = padded_vocab or cfg.vocab_size
    out: Tensors = {}
    if cfg.style == "qwen3_next":
        out = qwen3_next_from_hf(theirs, cfg.qwen3_next)
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[name] = _pad_rows(out[name], vocab)
        if cfg.tied_embeddings:
            del out["output_layer.weight"]
        return out
    if cfg.style == "gpt2":
        wte = _need(theirs, "transformer.wte.weight")
        out["embedding.word_embeddings.weight"] = _pad_rows(wte, vocab)
        out["embedding.position_embeddings.weight"] = _need(theirs, "transformer.wpe.weight")
        out["decoder.final_layernorm.weight"] = _need(theirs, "transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = _need(theirs, "transformer.ln_f.bias")
        if not cfg.tied_embeddings:
            out["output_layer.weight"] = _pad_rows(_need(theirs, "lm_head.weight"), vocab)
        h = cfg.hidden_size
        for i in range(cfg.num_layers):
            m, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
            w = _need(theirs, o + "attn.c_attn.weight").t()
            out[m + "self_attention.linear_qkv.weight"] = merge_qkv(w[:h], w[h:2 * h], w[2 * h:], cfg)
            b = _need(theirs, o + "attn.c_attn.bias")
            out[m + "self_attention.linear_qkv.bias"] = merge_qkv(b[:h], b[h:2 * h], b[2 * h:], cfg)
            out[m + "self_attention.linear_proj.weight"] = _need(theirs, o + "attn.c_proj.weight").t().contiguous()
            out[m + "self_attention.linear_proj.bias"] = _need(theirs, o + "attn.c_proj.bias")
            out[m + "mlp.linear_fc1.weight"] = _need(theirs, o + "mlp.c_fc.weight").t().contiguous()
            out[m + "mlp.linear_fc1.bias"] = _need(theirs, o + "mlp.c_fc.bias")
            out[m + "mlp.linear_fc2.weight"] = _need(theirs, o + "mlp.c_proj.weight").t().contiguous()
            out[m + "mlp.linear_fc2.bias"] = _need(theirs, o + "mlp.c_proj.bias")
            for mine, hf in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[m + mine + ".weight"] = _need(theirs, o + hf + ".weight")
                out[m + mine + ".bias"] = _need(theirs, o + hf + ".bias")
        return out
    out["embedding.word_embeddings.weight"] = _pad_rows(_need(theirs, "model.embed_tokens.weight"), vocab)
    out["decoder.final_layernorm.weight"] = _need(theirs, "model.norm.weight")
    if not cfg.tied_embeddings:
        out["output_layer.weight"] = _pad_rows(_need(theirs, "lm_head.weight"), vocab)
    for i in range(cfg.num_layers):
        m, o = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in (("weight", "bias") if cfg.add_bias_linear else ("weight",)):
            if cfg.style == "deepseek_v3":
                out.update({m + "self_attention." + mine: _need(theirs, o + "self_attn." + hf)
                            for mine, hf in _mla_names(cfg)})
            else:
                out[m + "self_attention.linear_qkv." + kind] = merge_qkv(
                    _need(theirs, o + "self_attn.q_proj." + kind), _need(theirs, o + "self_attn.k_proj." + kind),
                    _need(theirs, o + "self_attn.v_proj." + kind), cfg)
            out[m + "self_attention.linear_proj." + kind] = _need(theirs, o + "self_attn.o_proj." + kind)
            if cfg.style == "mixtral":
                out.update(_mixtral_moe_from_hf(theirs, cfg, m, o))
                continue
            if cfg.style == "qwen2_moe":
                out.update(_qwen2_moe_from_hf(theirs, cfg, m, o))
                continue
            if cfg.style == "deepseek_v3" and cfg.num_experts and i >= cfg.moe_first_dense_layers:
                out.update(_qwen2_moe_from_hf(theirs, cfg, m, o, shared=o + "mlp.shared_experts."))
                out[m + "mlp.router.expert_bias"] = _need(theirs, o + "mlp.gate.e_score_correction_bias").float()
                continue
            out[m + "mlp.linear_fc1." + kind] = torch.cat(
                [_need(theirs, o + "mlp.gate_proj." + kind), _need(theirs, o + "mlp.up_proj." + kind)])
            out[m + "mlp.linear_fc2." + kind] = _need(theirs, o + "mlp.down_proj." + kind)
        if cfg.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = merge_qkv(
                _need(theirs, o + "self_attn.q_proj.bias"), _need(theirs, o + "self_attn.k_proj.bias"),
                _need(theirs, o + "self_attn.v_proj.bias"), cfg)
        out[m + "input_layernorm.weight"] = _need(theirs, o + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = _need(theirs, o + "post_attention_layernorm.weight")
        if cfg.style == "qwen3":
            out[m + "self_attention.q_layernorm.weight"] = _need(theirs, o + "self_attn.q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = _need(theirs, o + "self_attn.k_norm.weight")
    return out


def _mixtral_moe_from_hf(theirs: Tensors, cfg: ModelConfig, m: str, o: str) -> Tensors:
    """One layer's router and stacked experts, from Mixtral's per-expert file tensors
    ``block_sparse_moe.experts.{j}.w1`` (gate) / ``w3`` (up) / ``w2`` (down), or from the 3-D
    in-memory ones."""
    experts, h = cfg.num_experts, cfg.hidden_size
    if o + "mlp.experts.gate_up_proj" in theirs or o + "block_sparse_moe.gate.weight" not in theirs:
        router = _need(theirs, o + "mlp.gate.weight")
        fc1 = _need(theirs, o + "mlp.experts.gate_up_proj").reshape(-1, h)
        fc2 = _need(theirs, o + "mlp.experts.down_proj").reshape(experts * h, -1)
    else:
        legacy = o + "block_sparse_moe."
        router = _need(theirs, legacy + "gate.weight")
        fc1 = torch.cat([torch.cat([_need(theirs, f"{legacy}experts.{j}.w1.weight"),
                                    _need(theirs, f"{legacy}experts.{j}.w3.weight")]) for j in range(experts)])
        fc2 = torch.cat([_need(theirs, f"{legacy}experts.{j}.w2.weight") for j in range(experts)])
    return {m + "mlp.router.weight": router, m + "mlp.experts.linear_fc1.weight": fc1.contiguous(),
            m + "mlp.experts.linear_fc2.weight": fc2.contiguous()}


def _qwen2_moe_from_hf(theirs: Tensors, cfg: ModelConfig, m: str, o: str, shared: Optional[str] = None) -> Tensors:
    """One layer's router, stacked experts and gated shared expert, from Qwen2-MoE's per-expert
    file tensors or the 3-D in-memory ``mlp.experts.gate_up_proj`` / ``down_proj``."""
    experts, h = cfg.num_experts, cfg.hidden_size
    if o + "mlp.experts.gate_up_proj" in theirs:
        fc1 = theirs[o + "mlp.experts.gate_up_proj"].reshape(-1, h)
        fc2 = _need(theirs, o + "mlp.experts.down_proj").reshape(experts * h, -1)
    else:
        fc1 = torch.cat([torch.cat([_need(theirs, f"{o}mlp.experts.{j}.gate_proj.weight"),
                                    _need(theirs, f"{o}mlp.experts.{j}.up_proj.weight")]) for j in range(experts)])
        fc2 = torch.cat([_need(theirs, f"{o}mlp.experts.{j}.down_proj.weight") for j in range(experts)])
    gated = shared is None  # Qwen2-MoE's; DeepSeek-V3 passes its ungated shared_experts prefix
    shared = shared or o + "mlp.shared_expert."
    out = {m + "mlp.router.weight": _need(theirs, o + "mlp.gate.weight"),
            m + "mlp.experts.linear_fc1.weight": fc1.contiguous(), m + "mlp.experts.linear_fc2.weight": fc2.contiguous(),
            m + "mlp.shared_experts.linear_fc1.weight": torch.cat(
                [_need(theirs, shared + "gate_proj.weight"), _need(theirs, shared + "up_proj.weight")]),
            m + "mlp.shared_experts.linear_fc2.weight": _need(theirs, shared + "down_proj.weight")}
    if gated:
        out[m + "mlp.shared_experts.gate_weight"] = _need(theirs, o + "mlp.shared_expert_gate.weight")
    return out


# --------------------------------------------------------------------------------------
# Qwen3-Next's gated delta net, one layer (megatron/core/transformer/gated_delta_net.py).
# Hugging Face groups in_proj_qkvz / in_proj_ba per key head ([q_h, k_h, v_group, z_group],
# [b_group, a_group]); ours stacks whole blocks [q; k; v; z; b; a]. The convolution, A_log,
# dt_bias, the gated norm ("norm" there, "out_norm" here) and out_proj are the same tensors.
# The whole model: qwen3_next_from_hf / qwen3_next_to_hf below.
# --------------------------------------------------------------------------------------

def _gdn_dims(cfg) -> Tuple[int, int, int, int, int]:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return nk, nv, nv // nk, cfg.linear_key_head_dim, cfg.linear_value_head_dim


def qwen3_next_gdn_from_hf(theirs: Tensors, cfg) -> Tensors:
    """Hugging Face ``Qwen3NextGatedDeltaNet`` tensors (names relative to the module) -> ours."""
    nk, nv, r, dk, dv = _gdn_dims(cfg)
    qkvz = theirs["in_proj_qkvz.weight"]
    hidden = qkvz.shape[-1]
    q, k, v, z = qkvz.view(nk, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = theirs["in_proj_ba.weight"].view(nk, 2 * r, hidden).split([r, r], dim=1)
    in_proj = torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)], dim=0)
    return {"in_proj.weight": in_proj, "conv1d.weight": theirs["conv1d.weight"], "A_log": theirs["A_log"],
            "dt_bias": theirs["dt_bias"], "out_norm.weight": theirs["norm.weight"],
            "out_proj.weight": theirs["out_proj.weight"]}


def qwen3_next_gdn_to_hf(ours: Tensors, cfg) -> Tensors:
    """The inverse of ``qwen3_next_gdn_from_hf``."""
    nk, nv, r, dk, dv = _gdn_dims(cfg)
    w = ours["in_proj.weight"]
    hidden = w.shape[-1]
    q, k, v, z, b, a = w.split([nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], dim=0)
    group = lambda t: t.reshape(nk, -1, hidden)  # noqa: E731  (per key head)
    qkvz = torch.cat([group(q), group(k), group(v), group(z)], dim=1).reshape(-1, hidden)
    ba = torch.cat([group(b), group(a)], dim=1).reshape(-1, hidden)
    return {"in_proj_qkvz.weight": qkvz.contiguous(), "in_proj_ba.weight": ba.contiguous(),
            "conv1d.weight": ours["conv1d.weight"], "A_log": ours["A_log"], "dt_bias": ours["dt_bias"],
            "norm.weight": ours["out_norm.weight"], "out_proj.weight": ours["out_proj.weight"]}


# --------------------------------------------------------------------------------------
# Qwen3-Next, the whole model: Hugging Face ``Qwen3NextForCausalLM`` tensors <-> ours, and
# the TransformerConfig fields of the same model. convert.py imports it (config_from_hf ->
# style "qwen3_next" -> from_hf); exporting one of our hybrid checkpoints with --to hf is
# not wired (config_from_tensors refuses it), qwen3_next_to_hf is the in-memory inverse.
# Its norms store gamma - 1 (output * (1 + w)), ours gamma (the gated delta net's gated
# norm stores gamma in both); its gated attention's q_proj holds per head [q_h; gate_h],
# our linear_qkv per query group [q heads; their gates; k; v] (attention.py); its MoE is
# Qwen2-MoE's (gated shared expert).
# --------------------------------------------------------------------------------------

# What a Qwen3-Next config adds to the Llama-style arguments (Megatron flag names = field names).
_QWEN3_NEXT_FIELDS = ("rotary_percent", "attention_output_gate", "experimental_attention_variant",
                      "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_layer_freq")


def qwen3_next_config_kwargs(hf: Dict[str, Any]) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields of the Hugging Face Qwen3-Next config ``hf`` (a dict)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                      for i in range(layers)]
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    moe = [int(hf.get("num_experts", 0) > 0 and i not in dense and (i + 1) % step == 0) for i in range(layers)]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"Qwen3-Next with rope_type {rope.get('rope_type')!r} is not supported (default only).")
    out = dict(num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
               num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"],
               ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
               gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
               rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
               rotary_percent=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
               qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gdn",
               linear_attention_freq=[int(t == "linear_attention") for t in types],
               linear_conv_kernel_dim=hf["linear_conv_kernel_dim"], linear_key_head_dim=hf["linear_key_head_dim"],
               linear_value_head_dim=hf["linear_value_head_dim"], linear_num_key_heads=hf["linear_num_key_heads"],
               linear_num_value_heads=hf["linear_num_value_heads"])
    if any(moe):
        out.update(num_moe_experts=hf["num_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                   moe_router_topk=hf["num_experts_per_tok"], moe_layer_freq=moe,
                   moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                   moe_shared_expert_gate=True)
        if not hf.get("norm_topk_prob", True):
            out["moe_router_pre_softmax"] = True  # softmax over all experts, top-k not renormalized
    return out


def _qwen3_next_shape(hf: Dict[str, Any]):
    import types as _types

    fields = qwen3_next_config_kwargs(hf)
    fields.setdefault("moe_ffn_hidden_size", None)
    return _types.SimpleNamespace(num_experts=fields.get("num_moe_experts"), **fields)


def qwen3_next_from_hf(theirs: Tensors, hf: Dict[str, Any]) -> Tensors:
    """``Qwen3NextForCausalLM`` tensors (its state_dict names) -> our GPTModel's."""
    cfg = _qwen3_next_shape(hf)
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = heads // groups
    ours = {"embedding.word_embeddings.weight": _need(theirs, "model.embed_tokens.weight"),
            "decoder.final_layernorm.weight": _need(theirs, "model.norm.weight") + 1,
            "output_layer.weight": theirs.get("lm_head.weight", theirs["model.embed_tokens.weight"])}
    for i in range(cfg.num_layers):
        o, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        ours[m + "input_layernorm.weight"] = _need(theirs, o + "input_layernorm.weight") + 1
        ours[m + "pre_mlp_layernorm.weight"] = _need(theirs, o + "post_attention_layernorm.weight") + 1
        if cfg.linear_attention_freq[i]:
            prefix = o + "linear_attn."
            layer = {k[len(prefix):]: v for k, v in theirs.items() if k.startswith(prefix)}
            ours.update({m + "self_attention." + k: v for k, v in qwen3_next_gdn_from_hf(layer, cfg).items()})
        else:
            a = o + "self_attn."
            h = _need(theirs, a + "q_proj.weight").shape[-1]
            q, gate = _need(theirs, a + "q_proj.weight").view(heads, 2, d, h).unbind(1)
            k = _need(theirs, a + "k_proj.weight").view(groups, d, h)
            v = _need(theirs, a + "v_proj.weight").view(groups, d, h)
            qkv = torch.cat([q.reshape(groups, per * d, h), gate.reshape(groups, per * d, h), k, v], dim=1)
            ours[m + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, h)
            ours[m + "self_attention.q_layernorm.weight"] = _need(theirs, a + "q_norm.weight") + 1
            ours[m + "self_attention.k_layernorm.weight"] = _need(theirs, a + "k_norm.weight") + 1
            ours[m + "self_attention.linear_proj.weight"] = _need(theirs, a + "o_proj.weight")
        if cfg.num_experts and cfg.moe_layer_freq[i]:
            ours.update(_qwen2_moe_from_hf(theirs, cfg, m, o))
        else:
            ours[m + "mlp.linear_fc1.weight"] = torch.cat([_need(theirs, o + "mlp.gate_proj.weight"),
                                                           _need(theirs, o + "mlp.up_proj.weight")])
            ours[m + "mlp.linear_fc2.weight"] = _need(theirs, o + "mlp.down_proj.weight")
    return ours


def qwen3_next_to_hf(ours: Tensors, hf: Dict[str, Any]) -> Tensors:
    """The inverse of ``qwen3_next_from_hf`` (experts as the in-memory 3-D ``gate_up_proj`` /
    ``down_proj`` of transformers 5)."""
    cfg = _qwen3_next_shape(hf)
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = heads // groups
    theirs = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
              "model.norm.weight": ours["decoder.final_layernorm.weight"] - 1,
              "lm_head.weight": ours["output_layer.weight"]}
    for i in range(cfg.num_layers):
        o, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        theirs[o + "input_layernorm.weight"] = ours[m + "input_layernorm.weight"] - 1
        theirs[o + "post_attention_layernorm.weight"] = ours[m + "pre_mlp_layernorm.weight"] - 1
        if cfg.linear_attention_freq[i]:
            prefix = m + "self_attention."
            layer = {k[len(prefix):]: v for k, v in ours.items() if k.startswith(prefix)}
            theirs.update({o + "linear_attn." + k: v for k, v in qwen3_next_gdn_to_hf(layer, cfg).items()})
        else:
            a, s = o + "self_attn.", m + "self_attention."
            w = ours[s + "linear_qkv.weight"]
            h = w.shape[-1]
            q, gate, k, v = w.view(groups, 2 * per * d + 2 * d, h).split([per * d, per * d, d, d], dim=1)
            theirs[a + "q_proj.weight"] = torch.stack([q.reshape(heads, d, h), gate.reshape(heads, d, h)],
                                                      dim=1).reshape(-1, h)
            theirs[a + "k_proj.weight"] = k.reshape(-1, h).contiguous()
            theirs[a + "v_proj.weight"] = v.reshape(-1, h).contiguous()
            theirs[a + "q_norm.weight"] = ours[s + "q_layernorm.weight"] - 1
            theirs[a + "k_norm.weight"] = ours[s + "k_layernorm.weight"] - 1
            theirs[a + "o_proj.weight"] = ours[s + "linear_proj.weight"]
        if cfg.num_experts and cfg.moe_layer_freq[i]:
            per_expert = _qwen2_moe_to_hf(ours, cfg, m, o)
            e = cfg.num_experts
            theirs[o + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([per_expert.pop(f"{o}mlp.experts.{j}.gate_proj.weight"),
                            per_expert.pop(f"{o}mlp.experts.{j}.up_proj.weight")]) for j in range(e)])
            theirs[o + "mlp.experts.down_proj"] = torch.stack(
                [per_expert.pop(f"{o}mlp.experts.{j}.down_proj.weight") for j in range(e)])
            theirs.update(per_expert)
        else:
            gate_up = ours[m + "mlp.linear_fc1.weight"]
            theirs[o + "mlp.gate_proj.weight"], theirs[o + "mlp.up_proj.weight"] = (
                t.contiguous() for t in gate_up.chunk(2, dim=0))
            theirs[o + "mlp.down_proj.weight"] = ours[m + "mlp.linear_fc2.weight"]
    return theirs
