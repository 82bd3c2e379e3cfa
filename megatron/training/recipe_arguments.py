"""Flags of upstream's MoE recipes (DeepSeek-V3, Qwen-MoE, Mixtral command lines) that are
not MoE flags: YaRN RoPE scaling, ``--recompute-modules``, ``--logging-level``, and the
announcement of the accepted GPU-only flags (megatron_compat.ANNOUNCED).

Names, defaults and meanings are Megatron-LM's: ``--rotary-scaling-factor``, ``--mscale``
and ``--mscale-all-dim`` (its MLA group; for standard attention they apply with
``--position-embedding-type yarn``), ``--yarn-original-max-position-embeddings``,
``--yarn-beta-fast``, ``--yarn-beta-slow``, ``--[no-]yarn-correction-range-round-to-int``.
"""

from __future__ import annotations

import argparse
import logging
import os

from megatron.core.transformer.recompute import check_recompute_modules
from megatron.core.transformer.rope import YarnScaling
from megatron.training.megatron_compat import announced_flags_given

_YARN_DEFAULTS = dict(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
_YARN_ONLY = ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
              "yarn_correction_range_round_to_int")


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("YaRN RoPE scaling, selective recompute modules, logging level")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN: context extension factor s (with --position-embedding-type yarn)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: cos and sin are scaled by m(s, mscale) / m(s, mscale-all-dim), m(s, a) = 0.1 a ln s + 1")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: see --mscale")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the context length the frequencies were trained for (default 4096)")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN: pairs turning more often than this over that context keep their frequency (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN: pairs turning less often are interpolated by s (default 1)")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: round the ramp's ends to whole dimensions (the default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int", help="YaRN: keep the ramp's ends fractional")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="with --recompute-granularity selective: what to recompute in backward (default core_attn): "
                        "core_attn, layernorm, mlp, moe, moe_act (needs --moe-grouped-gemm), shared_experts")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction: extra depths predicting tokens i+2, i+3, ... (DeepSeek-V3), "
                        "sharing the embedding and output layer")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP losses (their mean over the depths)")
    g.add_argument("--logging-level", type=int, default=None,
                   help="Python logging level of the root logger (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR); "
                        "default: the MEGATRON_LOGGING_LEVEL environment variable, else unchanged")


def validate_recipe_args(args: argparse.Namespace, note) -> None:
    """Parse-time checks (ValueError with the fix); ``note`` prints one line from rank 0."""
    if args.position_embedding_type == "yarn":
        if args.rotary_interleaved:
            raise ValueError("--position-embedding-type yarn rotates halves (as Megatron-LM); drop --rotary-interleaved.")
        if args.rotary_percent != 1.0:
            raise ValueError("--position-embedding-type yarn rotates every head dimension here; drop --rotary-percent.")
        try:
            YarnScaling(**_yarn_fields(args))
        except ValueError as error:
            raise ValueError(f"--position-embedding-type yarn: {error} Fix the --yarn-* / --rotary-scaling-factor "
                             "flags.") from None
    else:
        given = [name for name in _YARN_ONLY if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} applies to --position-embedding-type yarn; add that or drop the flag.")
        changed = [name for name, default in _YARN_DEFAULTS.items() if getattr(args, name) != default]
        if changed:
            # Upstream's MLA group: with standard attention they matter only for yarn.
            note(f"--{changed[0].replace('_', '-')} has no effect without --position-embedding-type yarn "
                 "(multi-latent attention, which also reads it, is not implemented here).")
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        raise ValueError("--recompute-modules applies to --recompute-granularity selective; add that or drop it.")
    args.recompute_modules = check_recompute_modules(
        args.recompute_modules, args.recompute_granularity, getattr(args, "moe_grouped_gemm", False),
        gated_delta_net=getattr(args, "experimental_attention_variant", None) in ("gdn", "gated_delta_net"),
        multi_latent_attention=getattr(args, "multi_latent_attention", False))
    if args.mtp_num_layers is not None:
        if args.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers must be positive, got {args.mtp_num_layers}; drop it for no MTP.")
        if args.pipeline_model_parallel_size > 1 and args.position_embedding_type == "learned_absolute":
            raise ValueError("--mtp-num-layers under pipeline parallelism embeds on the last stage too, which holds "
                             "no copy of the learned position table here; use --position-embedding-type rope "
                             "(as DeepSeek-V3) or --pipeline-model-parallel-size 1.")
        if args.pipeline_model_parallel_size > 1 and getattr(args, "use_mfsdp", False) and \
                not getattr(args, "untie_embeddings_and_output_weights", False):
            # The last stage's output layer would read the embedding unit's weight outside its forward.
            raise ValueError("--mtp-num-layers under pipeline parallelism with --use-mfsdp needs "
                             "--untie-embeddings-and-output-weights (as DeepSeek-V3); tied weights run there "
                             "without --use-mfsdp.")
        if args.context_parallel_size > 1:
            raise ValueError("--mtp-num-layers under context parallelism is not built yet; use "
                             "--context-parallel-size 1 or drop --mtp-num-layers.")
    if args.logging_level is not None and args.logging_level < 0:
        raise ValueError(f"--logging-level must be a logging level (10 DEBUG ... 50 CRITICAL), got {args.logging_level}.")
    env_level = os.environ.get("MEGATRON_LOGGING_LEVEL", "")
    if env_level and not env_level.strip().isdigit():
        raise ValueError(f"MEGATRON_LOGGING_LEVEL must be a logging level number (10 DEBUG ... 50 CRITICAL), got "
                         f"{env_level!r}; fix or unset it.")
    lines = announced_flags_given(args)
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        lines.insert(0, "--moe-token-dispatcher-type flex: no DeepEP/HybridEP kernels here, the all-to-all "
                        "dispatcher runs instead (same results).")
    for line in lines:
        note(line)


def _yarn_fields(args) -> dict:
    fields = dict(scaling_factor=args.rotary_scaling_factor, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)
    for name, field in (("yarn_original_max_position_embeddings", "original_max_position_embeddings"),
                        ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_correction_range_round_to_int", "correction_range_round_to_int")):
        if getattr(args, name, None) is not None:
            fields[field] = getattr(args, name)
    return fields


def recipe_config_kwargs(args) -> dict:
    """The TransformerConfig fields (getattr: argument sets saved before these flags existed)."""
    kwargs = dict(recompute_modules=getattr(args, "recompute_modules", None),
                  mtp_num_layers=getattr(args, "mtp_num_layers", None),
                  mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1),
                  calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False))
    if getattr(args, "position_embedding_type", None) == "yarn":
        fields = _yarn_fields(args)
        kwargs.update({"yarn_rotary_scaling_factor" if k == "scaling_factor" else f"yarn_{k}": v
                       for k, v in fields.items()})
    return kwargs


def setup_logging(args, environ) -> None:
    """Upstream's precedence: --logging-level, else MEGATRON_LOGGING_LEVEL, else unchanged."""
    level = getattr(args, "logging_level", None)
    if level is None and environ.get("MEGATRON_LOGGING_LEVEL", "").strip().isdigit():
        level = int(environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)
