"""Flags of upstream's MoE recipes: the GPU-only flags (accepted, one line each), YaRN,
--recompute-modules, --logging-level, the flex dispatcher, and their parse errors."""

import logging

import pytest

from megatron.training.arguments import parse_args
from megatron.training.megatron_compat import ANNOUNCED, MAPPED
from megatron.training.recipe_arguments import setup_logging

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128")
MOE = " --num-experts 4 --moe-router-topk 2"
VALUES = {"--moe-flex-dispatcher-backend": "deepep", "--cuda-graph-impl": "local", "--cuda-graph-modules": "attn mlp",
          "--cuda-graph-warmup-steps": "3", "--offload-modules": "moe_act core_attn", "--wgrad-deferral-limit": "2",
          "--moe-enable-deepep": "--moe-token-dispatcher-type flex"}


def parse(extra=""):
    return parse_args((BASE + " " + extra).split(), world_size=1, cuda_available=False)


@pytest.mark.parametrize("flag", sorted(ANNOUNCED))
def test_each_gpu_only_flag_is_accepted_with_one_line(flag, capsys):
    parse(MOE)
    assert flag not in capsys.readouterr().out
    parse(f"{MOE} {flag} {VALUES.get(flag, '')}")
    lines = [line for line in capsys.readouterr().out.splitlines() if flag in line]
    assert len(lines) == 1 and ANNOUNCED[flag][1] in lines[0]
    assert flag in MAPPED  # documented in the Mapped table


def test_flex_dispatcher_runs_the_all_to_all_one(capsys):
    args = parse(MOE + " --moe-token-dispatcher-type flex --moe-enable-deepep")
    out = capsys.readouterr().out
    assert "--moe-token-dispatcher-type flex" in out and "--moe-enable-deepep" in out
    from pretrain_gpt import core_transformer_config_from_args  # noqa: F401 (the config maps it)
    from megatron.training.moe_arguments import moe_config_kwargs

    assert moe_config_kwargs(args)["moe_token_dispatcher_type"] == "alltoall"
    with pytest.raises(ValueError, match="--moe-enable-deepep selects the flex dispatcher"):
        parse(MOE + " --moe-enable-deepep")


def test_yarn_flags_reach_the_config():
    from pretrain_gpt import core_transformer_config_from_args

    args = parse("--position-embedding-type yarn --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 1 "
                 "--yarn-original-max-position-embeddings 1024 --yarn-beta-fast 16 --yarn-beta-slow 2 "
                 "--no-yarn-correction-range-round-to-int")
    config = core_transformer_config_from_args(args)
    assert config.position_embedding_type == "yarn"
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings, config.yarn_beta_fast,
            config.yarn_beta_slow, config.yarn_mscale, config.yarn_mscale_all_dim,
            config.yarn_correction_range_round_to_int) == (40.0, 1024, 16.0, 2.0, 0.707, 1.0, False)
    defaults = core_transformer_config_from_args(parse("--position-embedding-type yarn")).yarn
    assert (defaults.scaling_factor, defaults.original_max_position_embeddings, defaults.beta_fast,
            defaults.beta_slow, defaults.mscale, defaults.mscale_all_dim) == (1.0, 4096, 32.0, 1.0, 1.0, 0.0)


@pytest.mark.parametrize("extra, message", [
    ("--yarn-beta-fast 16", "--yarn-beta-fast applies to --position-embedding-type yarn"),
    ("--position-embedding-type rope --no-yarn-correction-range-round-to-int", "--yarn-correction-range"),
    ("--position-embedding-type yarn --rotary-interleaved", "drop --rotary-interleaved"),
    ("--position-embedding-type yarn --rotary-percent 0.5", "drop --rotary-percent"),
    ("--position-embedding-type yarn --rotary-scaling-factor 0", "scaling factor must be positive"),
    ("--position-embedding-type yarn --yarn-beta-slow 0", "beta_fast and beta_slow"),
    ("--position-embedding-type yarn --yarn-original-max-position-embeddings 0", "original max position"),
    ("--recompute-modules mlp", "applies to --recompute-granularity selective"),
    ("--recompute-granularity selective --recompute-modules attention", "unknown attention"),
    ("--recompute-granularity selective --recompute-modules layernorm mla_up_proj",
     "mla_up_proj needs --multi-latent-attention"),
    ("--recompute-granularity selective --recompute-modules moe_act" + MOE, "--moe-grouped-gemm"),
    ("--mtp-num-layers 0", "--mtp-num-layers must be positive"),
    ("--logging-level -1", "--logging-level must be a logging level"),
])
def test_bad_recipe_flags_are_refused_with_the_fix(extra, message):
    with pytest.raises(ValueError, match=message):
        parse(extra)


def test_yarn_only_flags_without_yarn_get_a_note(capsys):
    parse("--position-embedding-type rope --rotary-scaling-factor 40")
    assert "--rotary-scaling-factor has no effect without --position-embedding-type yarn" in capsys.readouterr().out


def test_recompute_modules_default_and_list():
    assert parse("--recompute-granularity selective").recompute_modules == ["core_attn"]
    args = parse("--recompute-granularity selective --recompute-modules layernorm mlp moe_act --moe-grouped-gemm" + MOE)
    assert args.recompute_modules == ["layernorm", "mlp", "moe_act"]


def test_logging_level_sets_the_root_logger(monkeypatch):
    root = logging.getLogger()
    before = root.level
    try:
        setup_logging(parse("--logging-level 40"), {"MEGATRON_LOGGING_LEVEL": "10"})
        assert root.level == 40  # the flag wins over the environment
        setup_logging(parse(), {"MEGATRON_LOGGING_LEVEL": "10"})
        assert root.level == 10
        root.setLevel(30)
        setup_logging(parse(), {})
        assert root.level == 30  # neither: unchanged
    finally:
        root.setLevel(before)


def test_mtp_flags_reach_the_config_and_what_is_refused():
    from pretrain_gpt import core_transformer_config_from_args

    config = core_transformer_config_from_args(parse("--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3 "
                                                     "--calculate-per-token-loss"))
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor, config.calculate_per_token_loss) == (2, 0.3, True)
    pipelined = BASE + " --mtp-num-layers 1 --pipeline-model-parallel-size 2 --global-batch-size 2"
    args = parse_args((pipelined + " --position-embedding-type rope").split(), world_size=2, cuda_available=False)
    assert args.mtp_num_layers == 1
    with pytest.raises(ValueError, match="holds no copy of the learned position table"):
        parse_args(pipelined.split(), world_size=2, cuda_available=False)
    with pytest.raises(ValueError, match="with --use-mfsdp needs --untie-embeddings-and-output-weights"):
        parse_args((pipelined + " --position-embedding-type rope --use-mfsdp").split(), world_size=2,
                   cuda_available=False)
    with pytest.raises(ValueError, match="under context parallelism is not built yet"):
        parse_args((BASE + " --mtp-num-layers 1 --context-parallel-size 2").split(), world_size=2,
                   cuda_available=False)


def test_a_bad_logging_level_environment_variable_is_a_parse_error(monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "debug")
    with pytest.raises(ValueError, match="MEGATRON_LOGGING_LEVEL must be a logging level number"):
        parse()
