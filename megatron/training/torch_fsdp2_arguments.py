"""``--use-torch-fsdp2``: the trainer on PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``).

Upstream's rules (megatron/training/arguments.py): no pipeline or expert parallelism, not
with the distributed optimizer (nor, here, with ``--use-mfsdp``: one engine per run), no
Muon. Where this trainer goes further than upstream: tied embeddings are allowed (the root
unit holds the one shared weight), fp16 runs (its MixedPrecisionPolicy computes in fp16, the
trainer's loss scaler scales) and every ``--ckpt-format`` writes the same DCP
checkpoint. Context parallelism and HSDP instances are refused until they are built for
FSDP2. Checked before the synonyms run (``--use-distributed-optimizer`` and EP would
otherwise turn MFSDP on).
"""

from __future__ import annotations

import argparse


def add_torch_fsdp2_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("PyTorch FSDP2")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard with torch.distributed.fsdp.fully_shard (each transformer layer, then the root)")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="keep each layer gathered from its forward to its backward (ZeRO-2-like)")


def validate_torch_fsdp2_args(args: argparse.Namespace) -> None:
    if getattr(args, "ckpt_format", None) == "torch_dcp" and not args.use_torch_fsdp2:
        # Upstream's FSDP2-only format; here every format is the same DCP checkpoint.
        raise ValueError("--ckpt-format torch_dcp goes with --use-torch-fsdp2 (as upstream); add it, or use "
                         "--ckpt-format torch_dist (the same checkpoint here).")
    if not args.use_torch_fsdp2:
        return
    refused = [
        (args.use_mfsdp, "--use-mfsdp", "pick one FSDP engine: drop --use-mfsdp or --use-torch-fsdp2"),
        (args.use_distributed_optimizer, "--use-distributed-optimizer",
         "FSDP2 shards the optimizer state itself; drop --use-distributed-optimizer (as upstream)"),
        (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1",
         "not supported with FSDP2 (as upstream); use --use-mfsdp for pipeline parallelism"),
        (getattr(args, "expert_model_parallel_size", 1) > 1, "--expert-model-parallel-size > 1",
         "not supported with FSDP2 (as upstream); use --use-mfsdp for expert parallelism"),
        (args.context_parallel_size > 1, "--context-parallel-size > 1",
         "not built for FSDP2 here yet; use --use-mfsdp for context parallelism"),
        (args.num_distributed_optimizer_instances != 1, "--num-distributed-optimizer-instances",
         "HSDP is not built for FSDP2 here yet; use --use-mfsdp for HSDP/HFSDP"),
        (args.data_parallel_sharding_strategy is not None or args.outer_dp_sharding_strategy is not None,
         "--data-parallel-sharding-strategy / --outer-dp-sharding-strategy",
         "FSDP2 always shards parameters, gradients and optimizer state; drop them "
         "(--torch-fsdp2-no-reshard-after-forward keeps layers gathered between forward and backward)"),
        (args.optimizer in ("muon", "dist_muon"), f"--optimizer {args.optimizer}",
         "Muon needs whole matrices, FSDP2 holds row shards (upstream refuses it too); use --use-mfsdp"),
    ]
    for given, flag, what_to_do in refused:
        if given:
            raise ValueError(f"--use-torch-fsdp2 with {flag}: {what_to_do}.")
