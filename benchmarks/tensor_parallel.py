"""TP=2 x DP=2 MFSDP vs DP=4 MFSDP vs PyTorch FSDP2 + DTensor TP, at 4 ranks (CPU, gloo).

One contender per torchrun launch (so each has the process, and its peak RSS, to itself)::

    for c in mfsdp_dp4 mfsdp_tp2 mfsdp_tp2_sp fsdp2_tp2; do
        python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/tensor_parallel.py \\
            --contender $c --out /tmp/tp_bench
    done
    python benchmarks/tensor_parallel.py --report /tmp/tp_bench

The same GPT (LayerNorm, GELU, tied embeddings), the same global batch and AdamW.
``fsdp2_tp2`` is torchtitan's recipe: ``parallelize_module`` splits the attention and MLP
linears exactly as our TP layers do (column-parallel QKV / fc1, row-parallel proj / fc2;
the group-major QKV rows make the even split one set of heads), the embeddings and the
output layer stay replicated over TP, then ``fully_shard`` over the DP axis. Reported per
contender: step time (median of the measured steps, slowest rank), peak RSS (max over
ranks, from after the warm-up), and bytes per rank per step by collective kind, TP's
included (a tap on ``torch.distributed`` plus a dispatch mode for DTensor's functional
collectives).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CONTENDERS = ("mfsdp_dp4", "mfsdp_tp2", "mfsdp_tp2_sp", "fsdp2_tp2")
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
VOCAB, SEQ, GLOBAL_ROWS, WARMUP, STEPS = 4096, 256, 8, 2, 5


def _functional_collective_tap(records):
    """Records DTensor's functional collectives (they bypass the torch.distributed functions)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter"}

    class Tap(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace == "_c10d_functional" and name in kinds:
                tensor = args[0]
                size = dist.get_world_size(_resolve_process_group(args[-1]))
                records.append((kinds[name], tensor.numel() * tensor.element_size(), size))
            return func(*args, **(kwargs or {}))

    return Tap()


def build(name: str):
    """(model, DP rank, DP size) of a contender, initialized from the same global weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard, fully_shard_context
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import build_parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.initialization import initialize_parameters_

    if name.startswith("mfsdp"):
        tp = 1 if name == "mfsdp_dp4" else 2
        state = build_parallel_state(tp, 1, "cpu")
        config = TransformerConfig(**MODEL, tensor_model_parallel_size=tp, sequence_parallel=name.endswith("_sp"),
                                   tp_group=state.tp_group)
        model = GPTModel(config, VOCAB, SEQ)
        initialize_parameters_(model, 1)
        with fully_shard_context(device="cpu"):
            for unit in list(model.decoder.layers) + [model]:
                fully_shard(unit, state.dp_mesh, Placements.zero3("dp"))
        return model, state.dp_rank, state.dp_size
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model = GPTModel(TransformerConfig(**MODEL), VOCAB, SEQ)
    initialize_parameters_(model, 1)
    plan = {"self_attention.linear_qkv": ColwiseParallel(), "self_attention.linear_proj": RowwiseParallel(),
            "mlp.linear_fc1": ColwiseParallel(), "mlp.linear_fc2": RowwiseParallel()}
    for layer in model.decoder.layers:
        parallelize_module(layer, mesh["tp"], plan)
        layer.self_attention.num_heads //= 2  # the local heads, as torchtitan adjusts them
        layer.self_attention.num_query_groups //= 2
        fsdp2_fully_shard(layer, mesh=mesh["dp"])
    fsdp2_fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


def run(name: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from measurement import CollectiveTap, summarize_records

    from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads
    from rss import hwm_bytes, reset_hwm

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, dp_rank, dp_size = build(name)
    sequence_parallel = name.endswith("_sp")
    tp_group = model.config.tp_group
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name.startswith("mfsdp"):
        from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    generator = torch.Generator().manual_seed(2)
    rows = GLOBAL_ROWS // dp_size

    def step():
        ids = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=generator)[dp_rank * rows:(dp_rank + 1) * rows]
        optimizer.zero_grad()
        start = time.perf_counter()
        loss = model(ids, labels=torch.roll(ids, -1, 1)).mean()
        loss.backward()
        if sequence_parallel:  # the trainer's finalize_model_grads
            all_reduce_sequence_parallel_grads(model, tp_group)
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(WARMUP):
        step()
    reset_hwm()
    times = [step() for _ in range(STEPS)]
    peak = hwm_bytes()
    records = []
    with CollectiveTap() as tap, _functional_collective_tap(records):
        step()
    counted = summarize_records(tap.records + records)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (statistics.median(times), peak))
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"contender": name, "step_s": max(t for t, _ in gathered),
                       "peak_rss_mib": max(p for _, p in gathered) / 2**20, "collectives": counted}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def report(out_dir: str) -> str:
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out_dir, "*.json")))]
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    lines = ["| contender | step (s) | peak RSS (MiB) | " + " | ".join(f"{k} MiB (calls)" for k in kinds) + " |",
             "|---|---|---|" + "---|" * len(kinds)]
    for r in sorted(rows, key=lambda r: CONTENDERS.index(r["contender"])):
        by = r["collectives"]["by_kind"]
        cells = [f"{by[k]['wire_bytes'] / 2**20:.1f} ({by[k]['calls']})" if k in by else "0" for k in kinds]
        lines.append(f"| {r['contender']} | {r['step_s']:.3f} | {r['peak_rss_mib']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contender", choices=CONTENDERS)
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel")
    parser.add_argument("--report", metavar="DIR")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
    elif args.contender:
        run(args.contender, args.out)
    else:
        parser.error("pass --contender NAME (under torchrun, 4 ranks) or --report DIR")


if __name__ == "__main__":
    main()
