"""Context-parallel layouts at 4 ranks (CPU, gloo): CP=2 x DP=2 vs CP=4 vs DP=4, long sequences.

One layout per torchrun launch (each has its processes, and their peak RSS, to itself)::

    for layout in dp4 cp2_dp2 cp4; do
        OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
            benchmarks/context_parallel.py --layout $layout --out /tmp/cp_bench
    done
    python benchmarks/context_parallel.py --report /tmp/cp_bench

The trainer's own model build (meta device, MFSDP ZeRO-3 over DP x CP ranks) and
schedule, on a 4-layer GPT (hidden 256, 8 heads, 4 query groups, RoPE) with sequences of
``--seq-length`` (2048) tokens, the same global batch of 4 sequences in every layout
(DP=4: one microbatch per rank; CP=2 x DP=2: two; CP=4: four, each rank holding S / CP
tokens of each), fp32, per-token loss. Per rank:

* step time (median of the measured steps, the slowest rank's);
* peak RSS (``ru_maxrss``, read after the training steps);
* activations: the bytes one microbatch's forward saves for backward (distinct storages,
  parameters excluded, on an unsharded copy of the model: the engine's gathered weights
  would count otherwise) next to the planner's estimate (``tools/estimate_memory.py``'s
  shapes, ``activation_bytes``) and the planner's transient CP buffers;
* bytes a rank sends per step by kind, for one extra step, counted by a
  ``TorchDispatchMode`` on the c10d operators (no wrapper on torch): on gloo the engine
  builds its all-gathers and reduce-scatters from point-to-point sends
  (``mfsdp_v2/gloo_wire.py``, told apart by their tags), CP's p2p ring sends its K/V
  blocks and dK/dV accumulators, all_gather and a2a run c10d collectives. Next to them the
  planner's ZeRO-3 bytes, turned from the inputs it counts into what a rank sends: an
  all-gather of an N-rank group sends (N - 1) x its shard, a reduce-scatter (N - 1) / N
  of its input, an all-to-all (N - 1) / N of it.

Two cores run four ranks here, so step times carry CPU contention.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LAYOUTS = {"dp4": 1, "cp2_dp2": 2, "cp4": 4}  # context-parallel size
MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-query-groups 4 --position-embedding-type rope "
         "--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 100 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 2048 --hidden-dropout 0 --attention-dropout 0 --use-mfsdp "
         "--calculate-per-token-loss")
WARMUP, STEPS = 1, 3
# c10d operator -> (kind, index of the tensor a rank contributes); sends are sorted by tag.
C10D_KINDS = {"_allgather_base_": ("cp_all_gather", 1), "_reduce_scatter_base_": ("cp_reduce_scatter", 1),
              "allreduce_": ("all_reduce", 0), "alltoall_base_": ("cp_all_to_all", 1), "send": ("send", 0)}


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def counting_mode(group_size: int):
    """A dispatch mode that adds up the bytes a rank sends in the c10d operators run under
    it, by kind. ``group_size``: the CP group's (the engine's sends are counted as they are)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core.distributed.mfsdp_v2.gloo_wire import ALL_GATHER_TAG, REDUCE_SCATTER_TAG

    engine_tags = {ALL_GATHER_TAG: "all_gather", REDUCE_SCATTER_TAG: "reduce_scatter"}

    class CountCollectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("c10d::"):
                entry = C10D_KINDS.get(name.split("::")[1].split(".")[0])
                if entry is not None:
                    kind, index = entry
                    nbytes = _nbytes(args[index])
                    if kind == "send":  # (tensors, group, dst, tag)
                        kind = engine_tags.get(args[3], "cp_send")
                    elif kind in ("cp_reduce_scatter", "cp_all_to_all"):
                        nbytes = nbytes * (group_size - 1) // group_size
                    elif kind == "cp_all_gather":
                        nbytes *= group_size - 1
                    self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
            return func(*args, **(kwargs or {}))

    return CountCollectives()


def saved_activation_bytes(model, batch) -> int:
    """Bytes one forward (loss included) saves for backward: distinct storages, parameters excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return sum(saved.values())


def run(layout: str, seq: int, comm_type: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core import parallel_state
    from tools.memory_planner.estimate import activation_bytes, context_parallel_buffer_bytes
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.arguments import parse_args
    from megatron.training.data import split_batch_for_context_parallel
    from megatron.training.model_builder import build_model, build_optimizer, finalize_model_grads
    from tools.estimate_memory import estimate, shapes_of

    dist.init_process_group("gloo")
    world, cp = dist.get_world_size(), LAYOUTS[layout]
    flags = MODEL + f" --seq-length {seq} --context-parallel-size {cp} --cp-comm-type {comm_type}"
    args = parse_args(flags.split(), world_size=world, cuda_available=False)
    args.padded_vocab_size = args.unpadded_vocab_size = 2048
    state = parallel_state.initialize_model_parallel(1, 1, "cpu", context_parallel_size=cp)
    torch.manual_seed(0)
    built = build_model(pretrain_gpt.model_provider, args, torch.device("cpu"))
    optimizer, _ = build_optimizer(args, built)
    generator = torch.Generator().manual_seed(1 + state.dp_rank)  # the CP ranks of a DP rank read the same samples

    def batch():
        tokens = torch.randint(0, 2048, (1, seq + 1), generator=generator)
        whole = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq),
                 "position_ids": torch.arange(seq).expand(1, seq)}
        return split_batch_for_context_parallel(whole, cp, state.cp_rank)

    schedule = get_forward_backward_func()
    microbatches = args.num_microbatches

    def step():
        data = iter([batch() for _ in range(microbatches)])
        optimizer.zero_grad(set_to_none=True)
        schedule(pretrain_gpt.forward_step, data, built.model, microbatches, built.context, seq_length=seq // cp,
                 micro_batch_size=1, dp_group=state.dp_cp_group)
        finalize_model_grads(args, built)
        optimizer.step()

    times = []
    for i in range(WARMUP + STEPS):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
        if i >= WARMUP:
            times.append(elapsed.item())
    with counting_mode(cp) as counter:
        step()
    counted = dict(counter.bytes)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the unsharded copy below
    # Activations of one microbatch on an unsharded copy of the model (same CP groups).
    torch.manual_seed(0)
    plain = pretrain_gpt.model_provider(args).train()
    measured = saved_activation_bytes(plain, batch())
    shape, moe = shapes_of(args, plain)
    _, plans = estimate(args, world, 2)
    zero3 = next(p for p in plans if p.strategy == "zero3")
    record = dict(layout=layout, cp=cp, dp=state.dp_size, comm_type=comm_type, seq=seq, rank=dist.get_rank(),
                  microbatches=microbatches, step_s=statistics.median(times),
                  peak_rss_mb=peak_rss_mb,
                  activations_measured=measured, activations_planned=activation_bytes(shape, moe=moe),
                  cp_buffers_planned=context_parallel_buffer_bytes(shape),
                  bytes_counted=counted, bytes_planned=sent_bytes(zero3.comm_bytes, world, cp),
                  persistent_planned=zero3.persistent_total)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{layout}_{comm_type}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def sent_bytes(planned: dict, fsdp_size: int, cp: int) -> dict:
    """The planner's input bytes per kind as bytes a rank sends (ring algorithms)."""
    out = {}
    for kind, nbytes in planned.items():
        size = cp if kind.startswith("cp_") else fsdp_size
        if kind in ("all_gather", "cp_all_gather"):
            nbytes *= size - 1
        elif kind in ("reduce_scatter", "cp_reduce_scatter", "cp_all_to_all"):
            nbytes = nbytes * (size - 1) // size
        out[kind] = nbytes
    return out


def report(out: str) -> None:
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
    groups = {}
    for r in rows:
        groups.setdefault((r["layout"], r["comm_type"]), []).append(r)
    mib = lambda n: n / 2**20  # noqa: E731
    print("| layout | comm type | microbatches per rank | step (s, slowest rank) | peak RSS per rank (MB, max) | "
          "activations per microbatch, measured (MiB) | planned (MiB) | planned CP buffers (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    order = sorted(groups.items(), key=lambda kv: (list(LAYOUTS).index(kv[0][0]), kv[0][1]))
    for (layout, comm_type), rs in order:
        r0 = rs[0]
        print(f"| {layout} | {comm_type if r0['cp'] > 1 else '-'} | {r0['microbatches']} | "
              f"{max(r['step_s'] for r in rs):.2f} | {max(r['peak_rss_mb'] for r in rs):.0f} | "
              f"{mib(max(r['activations_measured'] for r in rs)):.1f} | {mib(r0['activations_planned']):.1f} | "
              f"{mib(r0['cp_buffers_planned']):.1f} |")
    print()
    print("MiB a rank sends per step by kind, rank 0: counted (c10d operators) and planned (ZeRO-3; the FSDP "
          "kinds over the DP x CP = 4 ranks, CP's cp_* over the CP group; all_reduce: the loss-token count).")
    print()
    print("| layout | comm type | counted | planned |")
    print("|---|---|---|---|")
    for (layout, comm_type), rs in order:
        r0 = next(r for r in rs if r["rank"] == 0)
        fmt = lambda d: ", ".join(f"{k} {mib(v):.1f}" for k, v in sorted(d.items()))  # noqa: E731
        print(f"| {layout} | {comm_type if r0['cp'] > 1 else '-'} | {fmt(r0['bytes_counted'])} | "
              f"{fmt(r0['bytes_planned'])} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--cp-comm-type", default="p2p")
    parser.add_argument("--out", default="/tmp/cp_bench")
    parser.add_argument("--report", metavar="DIR")
    options = parser.parse_args()
    if options.report:
        report(options.report)
    else:
        run(options.layout, options.seq_length, options.cp_comm_type, options.out)
