"""Causal self-attention with a fused QKV projection (Megatron-LM layout).

Module names: ``linear_qkv`` (hidden -> q, k, v) and ``linear_proj`` (attention output
-> hidden).

QKV weight row layout (what checkpoint converters rely on)
-----------------------------------------------------------
Let ``d = kv_channels``, ``G = num_query_groups``, ``H = num_attention_heads`` and
``P = H // G`` (query heads per group). ``linear_qkv.weight`` has ``(H + 2G) * d`` rows,
interleaved per query group exactly like Megatron-LM::

    for g in range(G):
        P * d rows: query heads g*P, g*P + 1, ..., g*P + P - 1   (d rows each)
        d rows:     key head g
        d rows:     value head g

With ``attention_output_gate`` (Qwen3-Next's gated attention, Megatron-LM's layout) each
group also holds the gate rows of its query heads, right after their query rows::

    for g in range(G):
        P * d rows: query heads of group g
        P * d rows: the gate of each of those heads (one row per head element)
        d rows:     key head g
        d rows:     value head g

so a TP rank's contiguous block of rows still holds whole groups. The bias (when
``add_bias_linear``) follows the same order. Query head ``h`` attends with
key/value head ``h // P``. Converting to Hugging Face:

* Llama (``q_proj``, ``k_proj``, ``v_proj``): view the weight as ``[G, (P + 2) * d, hidden]``,
  split the middle dimension into ``[P * d, d, d]``; q_proj is the first part reshaped to
  ``[H * d, hidden]`` (head order is preserved), k_proj / v_proj the second / third
  reshaped to ``[G * d, hidden]``. No RoPE permutation is needed (see rope.py).
* GPT-2 (``c_attn``, a Conv1D whose weight is ``[hidden, 3 * hidden]``, columns q|k|v with
  heads contiguous): with ``G = H`` (P = 1), take q, k, v per head as above, concatenate all
  q heads, then all k, then all v, and transpose.

``qk_layernorm`` adds ``q_layernorm`` / ``k_layernorm``: one norm of size ``d`` each, shared
by all heads, applied to every head's query / key right after the split and before RoPE
(Megatron-LM's and Qwen3's order; Hugging Face Qwen3's ``q_norm`` / ``k_norm``).

``linear_proj`` takes the heads concatenated in head order (``[b, s, H * d]``), the same as
Hugging Face's ``o_proj`` / GPT-2's ``c_proj`` (transposed for Conv1D).

Tensors are batch-first ([b, s, ...]) throughout this package; attention itself runs in
``torch.nn.functional.scaled_dot_product_attention``, which picks flash / memory-efficient
/ math kernels per device.
"""

import contextlib
import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from megatron.core.global_slices import partition
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from .context_parallel import context_parallel_attention
from .document_mask import DocumentMask, per_document_attention, sdpa_mask_and_causal
from .gpt_oss import is_window_layer, sink_attention, window_allowed
from .layers import build_parallel_linear, output_init_std
from .norms import build_norm
from .recompute import recomputes
from .rope import apply_rotary_pos_emb
from .transformer_config import TransformerConfig


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        # This rank's heads: with tensor parallelism, whole query groups (their q, k, v rows
        # are one contiguous block of linear_qkv, the layout above) and their heads' columns
        # of linear_proj.
        tp = config.tensor_model_parallel_size
        self.num_heads = config.num_attention_heads // tp
        self.num_query_groups = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.kv_channels
        self.gated = config.attention_output_gate
        qkv_size = config.query_projection_size + config.gate_projection_size + 2 * config.kv_projection_size
        self.linear_qkv = build_parallel_linear(config, config.hidden_size, qkv_size,
                                                bias=config.add_bias_linear or config.add_qkv_bias,
                                                init_std=config.hidden_init_std, split="column")
        self.q_layernorm = self.k_layernorm = self.qk_norm_group = None
        if config.qk_layernorm:
            # Without sequence parallelism nothing else sums TP-replicated gradients (every
            # rank normally has the whole one), but a rank's q/k norm gradient covers only its
            # own heads: the norms take their weights through copy_to_tensor_model_parallel_region
            # (its backward sums them over TP). With sequence parallelism finalize_grads sums
            # every replicated gradient already, and these are no exception.
            if tp > 1 and not config.sequence_parallel:
                self.qk_norm_group = config.tp_group
            self.q_layernorm = build_norm(config, self.head_dim)
            self.k_layernorm = build_norm(config, self.head_dim)
        self.linear_proj = build_parallel_linear(config, config.query_projection_size, config.hidden_size,
                                                 bias=config.add_bias_linear, init_std=output_init_std(config),
                                                 split="row")
        # GPT-OSS (gpt_oss.py): this layer's sliding window (None: full causal attention) and
        # the attention sinks: "learnable" holds one logit per query head (this rank's heads,
        # split over TP with them), "off-by-one" a fixed 0.
        self.window_size = (config.window_size if is_window_layer(config.window_size, config.window_attn_skip_freq,
                                                                   layer_number) else None)
        self.softmax_type = config.softmax_type
        if self.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(self.num_heads, dtype=config.params_dtype))
            if tp > 1:
                rank = torch.distributed.get_rank(config.tp_group)
                self.global_slices = {"softmax_offset": partition((config.num_attention_heads,), 0, rank, tp)}
                self.tensor_parallel_split = ("softmax_offset",)  # finalize_grads: not summed over TP
            self.reset_parameters()

    def initialize_global_(self, attr: str, values: torch.Tensor, generator: torch.Generator) -> None:
        # Upstream initializes the sinks with init_method: normal(0, init_method_std).
        if attr != "softmax_offset":
            raise ValueError(f"SelfAttention has no initialization rule for {attr!r}.")
        values.normal_(0.0, self.config.hidden_init_std, generator=generator)

    def reset_parameters(self) -> None:
        """The learnable sinks (the children initialize themselves)."""
        with torch.no_grad():
            nn.init.normal_(self.softmax_offset, mean=0.0, std=self.config.hidden_init_std)

    def split_qkv(self, mixed: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """[b, s, (H + 2G) * d] -> q [b, s, H, d], k [b, s, G, d], v [b, s, G, d] (layout above);
        with the output gate ([b, s, (2H + 2G) * d]) also the gate [b, s, H, d], returned last."""
        b, s, _ = mixed.shape
        q_rows = self.heads_per_group * self.head_dim
        gate_rows = q_rows if self.gated else 0
        per_group = mixed.view(b, s, self.num_query_groups, q_rows + gate_rows + 2 * self.head_dim)
        q, gate, k, v = torch.split(per_group, [q_rows, gate_rows, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        if not self.gated:
            return q, k, v
        return q, k, v, gate.reshape(b, s, self.num_heads, self.head_dim)

    def _head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm`` on each head of ``x`` [b, s, heads, d]; its weight gradient summed over TP
        where nothing else would (see __init__)."""
        if self.qk_norm_group is None:
            return norm(x)
        params = {name: copy_to_tensor_model_parallel_region(p, self.qk_norm_group)
                  for name, p in norm.named_parameters(recurse=False)}
        return torch.func.functional_call(norm, params, (x,))

    def core_attention(self, q, k, v, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v on [b, heads, s, d]: what selective recompute recomputes."""
        if self.window_size is not None:
            attn_mask, is_causal = self._with_window(q.shape[-2], k.shape[-2], attn_mask, is_causal, q.device), False
        if self.softmax_type != "vanilla":
            # SDPA has no sink: explicit scores with the sink column, softmax in fp32.
            sink = self.softmax_offset if self.softmax_type == "learnable" else q.new_zeros(self.num_heads)
            if is_causal:
                attn_mask = window_allowed(q.shape[-2], k.shape[-2], (-1, 0), q.device)
            dropout_p = self.config.attention_dropout if self.training else 0.0
            return sink_attention(q, k, v, attn_mask, sink, dropout_p)
        out_dtype = v.dtype
        upcast = self.config.attention_softmax_in_fp32 and q.dtype != torch.float32
        if upcast:
            # --attention-softmax-in-fp32: scores, softmax and the weighted sum in fp32.
            q, k, v = q.float(), k.float(), v.float()
        with _sdpa_kernels(self.config.attention_backend, q.device.type, disable_autocast=upcast):
            context = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=attn_mask,
                dropout_p=self.config.attention_dropout if self.training else 0.0,
                is_causal=is_causal,
                # Query head h uses kv head h // P, which is SDPA's repeat_interleave rule.
                enable_gqa=self.num_query_groups != self.num_heads,
            )
        return context.to(out_dtype)

    def _with_window(self, q_len: int, k_len: int, attn_mask: Optional[torch.Tensor], is_causal: bool,
                     device) -> torch.Tensor:
        """This layer's sliding window as an explicit band mask (True: attend), combined with
        the caller's mask or causality (gpt_oss.py)."""
        band = window_allowed(q_len, k_len, self.window_size, device)
        return band if attn_mask is None or is_causal else attn_mask & band

    def context_parallel_core_attention(self, q, k, v, attn_mask, is_causal, document_start=None) -> torch.Tensor:
        """core_attention when the sequence is split over CP ranks: q, k, v hold this rank's
        tokens, attention covers the whole sequence (context_parallel.py; causal by global
        position, so attn_mask / is_causal are unused; ``document_start``, the local tokens'
        from a DocumentMask, keeps it inside documents). core_attention is the local kernel
        of 'all_gather' and 'a2a'; 'p2p' and 'a2a+p2p' have their own."""
        return context_parallel_attention(
            q, k, v, self.config.cp_group, self.config.layer_cp_comm_type(self.layer_number),
            dropout_p=self.config.attention_dropout if self.training else 0.0, local_attention=self.core_attention,
            hierarchical_groups=self.config.hierarchical_cp_groups, document_start=document_start,
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """hidden_states [b, s, h] -> [b, s, h].

        attention_mask (optional, Megatron convention): bool, True where attention is NOT
        allowed, broadcastable to [b, heads, s, s]. It is applied in addition to the causal
        mask. Or a ``DocumentMask`` (packed documents, document_mask.py), also under CP.
        rotary_pos_emb: (cos, sin) from ``RotaryEmbedding``; None for no RoPE.
        """
        mixed = self.linear_qkv(hidden_states)
        b, s, _ = mixed.shape  # the whole sequence (the input is a chunk of it under sequence parallelism)
        q, k, v, *gate = self.split_qkv(mixed)
        if self.q_layernorm is not None:
            q = self._head_norm(self.q_layernorm, q)
            k = self._head_norm(self.k_layernorm, k)
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        # SDPA wants [b, heads, s, d].
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.config.softmax_scale is not None:
            # Every kernel below scales q k^T by 1 / sqrt(d); another softmax scale (muP's
            # 1 / d) is that with q multiplied by softmax_scale * sqrt(d).
            q = q * (self.config.softmax_scale * math.sqrt(self.head_dim))

        context_parallel = self.config.context_parallel_size > 1
        if context_parallel:
            if attention_mask is not None and not isinstance(attention_mask, DocumentMask):
                raise ValueError("attention_mask is not supported with context parallelism (the causal mask comes "
                                 "from the tokens' global positions); pass None or a DocumentMask, or use "
                                 "context_parallel_size=1.")
            # The CP kernels build each block's mask from global positions (and documents).
            document_start = attention_mask.document_start if attention_mask is not None else None
            attend = functools.partial(self.context_parallel_core_attention, document_start=document_start)
            attn_mask, is_causal = None, True
        else:
            segments = attention_mask.segments(s) if isinstance(attention_mask, DocumentMask) else None
            if segments is not None:  # long documents: causal attention on each alone, no dense mask
                attend = functools.partial(per_document_attention, self.core_attention, segments=segments)
                attn_mask, is_causal = None, True
            else:
                attend = self.core_attention
                attn_mask, is_causal = sdpa_mask_and_causal(attention_mask, s, hidden_states.device)
        if recomputes(self.config, "core_attn") and self.training and torch.is_grad_enabled():
            # Keep q, k, v only; the attention probabilities ([b, heads, s, s] on kernels
            # that materialize them) are recomputed in backward. Dropout masks are replayed
            # from the saved RNG state.
            context = checkpoint(attend, q, k, v, attn_mask, is_causal, use_reentrant=False)
        else:
            context = attend(q, k, v, attn_mask, is_causal)
        context = context.transpose(1, 2)
        if gate:
            # Megatron's order: the sigmoid in fp32, the product cast back.
            context = (context * torch.sigmoid(gate[0].float())).to(context.dtype)
        return self.linear_proj(context.reshape(b, s, self.num_heads * self.head_dim))


# Megatron's --attention-backend names -> SDPA kernels. "auto" leaves the choice to torch.
_SDPA_BACKENDS = {
    "flash": ("FLASH_ATTENTION",),
    "fused": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"),
    "unfused": ("MATH",),
    "local": ("MATH",),
}


def cpu_fast_path_note(attention_dropout: float, attention_backend: str) -> Optional[str]:
    """One line saying why SDPA leaves its fast (flash) CPU kernel for the math one, which
    materializes every [s, s] score matrix, or None when it does not. Only these two reach
    the math kernel here: the layers never pass an explicit mask where ``is_causal`` would do
    (the trainer passes no mask; a caller's mask is folded into an explicit one, which the
    CPU flash kernel also takes)."""
    reasons, fixes = [], []
    if attention_dropout > 0:
        reasons.append(f"attention dropout {attention_dropout:g} (the CPU flash kernel has none)")
        fixes.append("--attention-dropout 0")
    if attention_backend in ("unfused", "local"):
        reasons.append(f"--attention-backend {attention_backend} (the math kernel itself)")
        fixes.append("--attention-backend auto")
    if not reasons:
        return None
    return ("NOTE: attention runs in SDPA's math kernel on CPU, not its flash kernel, because of "
            f"{' and '.join(reasons)}; it materializes every [seq, seq] score matrix: pass {' and '.join(fixes)} "
            "for the fast kernel.")


@contextlib.contextmanager
def _sdpa_kernels(backend: str, device_type: str, disable_autocast: bool):
    with contextlib.ExitStack() as stack:
        if backend != "auto":
            stack.enter_context(sdpa_kernel([getattr(SDPBackend, name) for name in _SDPA_BACKENDS[backend]]))
        if disable_autocast:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
