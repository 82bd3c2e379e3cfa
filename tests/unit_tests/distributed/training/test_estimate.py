"""The planner's per-rank persistent bytes and per-step collective bytes equal what the
engine measures (FsdpContext.persistent_bytes(), FsdpContext.counter) on trainer-built
models at 2 and 4 ranks; its output also reaches tools/estimate_memory.py."""

import collections
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from _trainer_models import ARCHS, BASE, REPO, batches, gpt_provider, trainer_args
from tools.memory_planner.estimate import (
    ActivationShape,
    MoEShape,
    UnitShapes,
    activation_bytes,
    plan,
    units_of,
)
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.training.model_builder import build_model, build_optimizer
from tools.estimate_memory import planned_units, shapes_of

FLAGS = {
    "zero1": ["--data-parallel-sharding-strategy", "optim"],
    "zero2": ["--data-parallel-sharding-strategy", "optim_grads"],
    "zero3": [],
    "hsdp": ["--num-distributed-optimizer-instances", "2"],
    "hfsdp": ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"],
}
# Widths chosen so that rows do not split evenly over 4 ranks (padding is exercised).
SHAPE = "--num-layers 3 --hidden-size 48 --num-attention-heads 4 --ffn-hidden-size 80".split()
# TP=2-divisible heads, query groups and FFN; TP-local rows still split unevenly over DP.
TP_SHAPE = "--num-layers 2 --hidden-size 40 --num-attention-heads 4 --ffn-hidden-size 72".split()


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def one_step(built, args, dp_rank=None, dp_size=None, finalize=lambda: None):
    """One step on this data-parallel rank's rows (every TP rank of it reads the same)."""
    optimizer, _ = build_optimizer(args, built)
    dp_size = dist.get_world_size() if dp_size is None else dp_size
    dp_rank = dist.get_rank() if dp_rank is None else dp_rank
    (batch,) = batches(1, args.micro_batch_size, args.global_batch_size, args.seq_length, 96)
    per_rank = args.global_batch_size // dp_size
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    mbs = [{k: v[i:i + args.micro_batch_size] for k, v in mine.items()} for i in range(0, per_rank, args.micro_batch_size)]
    built.context.counter.reset()
    forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, len(mbs), context=built.context)
    finalize()
    optimizer.step()
    return optimizer, len(mbs)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", sorted(FLAGS))
def test_planner_matches_engine_measurements(strategy, arch):
    world = dist.get_world_size()
    if strategy in ("hsdp", "hfsdp") and world % 2:
        strategy = "zero3"  # an odd world has no two replicas
    args = trainer_args(arch, "--use-mfsdp", "--global-batch-size", str(4 * world), *SHAPE, *FLAGS[strategy])
    built = build_model(gpt_provider, args, torch.device("cpu"))
    units = units_of(built.unwrapped, list(built.unwrapped.decoder.layers) + [built.unwrapped])
    optimizer, microbatches = one_step(built, args)
    outer = args.dp_outer_size if strategy in ("hsdp", "hfsdp") else 1
    predicted = plan(units, strategy, world, outer_size=outer, microbatches=microbatches,
                     rank=dist.get_rank())

    check_persistent(predicted, built, optimizer)
    assert predicted.comm_bytes == built.context.counter.bytes_by_kind()



# ---------------------------------------------------------------------------------------
# Tensor and expert parallelism: persistent bytes against the engine, FSDP bytes against
# its counter, TP and all-to-all bytes against a tap on torch.distributed.
# ---------------------------------------------------------------------------------------

TAPPED = {"all_reduce": "tensor", "all_gather_single": "input_tensor", "reduce_scatter_single": "input",
          "all_to_all_single": "input"}


@contextlib.contextmanager
def collective_tap(groups):
    """(function name, bytes of the input this rank contributes) of every call of the
    TAPPED torch.distributed functions on one of ``groups`` (all groups if None); the real
    collective still runs. Taps nest."""
    records, saved = [], {name: getattr(dist, name) for name in TAPPED}

    def wrap(name, real):
        signature = inspect.signature(real)  # through an outer tap's wrapper (functools.wraps)

        @functools.wraps(real)
        def tapped(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            if groups is None or bound.arguments.get("group") in groups:
                tensor = bound.arguments[TAPPED[name]]
                records.append((name, tensor.numel() * tensor.element_size()))
            return real(*args, **kwargs)

        return tapped

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield records
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def summed(records, names) -> dict:
    out = collections.Counter()
    for name, nbytes in records:
        out[names[name]] += nbytes
    return dict(out)


@contextlib.contextmanager
def model_parallel(tp: int, args):
    from megatron.core import parallel_state

    state = parallel_state.initialize_model_parallel(tp, args.dp_outer_size)
    try:
        yield state
    finally:
        parallel_state.destroy_model_parallel()


def check_persistent(predicted, built, optimizer):
    measured = built.context.persistent_bytes()
    for key in ("main_weight", "model_weight", "main_grad"):
        assert predicted.persistent[key] == measured[key], (key, predicted.persistent, measured)
    adam = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for state in optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq"))
    assert predicted.persistent["optimizer_state"] == adam


def describe(units):
    return [[u.name, [list(shape) for shape in u.shapes], u.is_root, u.expert, list(u.tp_replicated)] for u in units]


TOOL_UNITS = """
import json, sys
from megatron.training.arguments import parse_args
from tools.estimate_memory import model_units
world = int(sys.argv[1])
out = []
for argv in json.loads(sys.argv[2]):
    units = model_units(parse_args(argv, world_size=world, cuda_available=False), world)[0]
    out.append([[u.name, [list(s) for s in u.shapes], u.is_root, u.expert, list(u.tp_replicated)] for u in units])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tool_units():
    """{flags: the units tools/estimate_memory.py plans for trainer_args("llama", *flags)}
    for every case below that compares them, at this world size: each model built as the
    tool builds it (one rank's model, with the fake backend's world), all in one process
    of its own started by rank 0 (one interpreter start instead of one per case)."""
    world = dist.get_world_size()
    cases = [tp_flags(*case, world) for case in TP_CASES if case[0] == "zero3"]
    cases += [ep_flags(*case, world) for case in EP_CASES if case[0] in ("zero3", "hsdp")]
    out = [None]
    if dist.get_rank() == 0:
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
        argvs = [[*BASE, *ARCHS["llama"], *flags] for flags in cases]
        run = subprocess.run([sys.executable, "-c", TOOL_UNITS, str(world), json.dumps(argvs)],
                             env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        out = [json.loads(run.stdout.strip().splitlines()[-1])]
    dist.broadcast_object_list(out, src=0)
    assert len(out[0]) == len(cases)
    return {tuple(flags): units for flags, units in zip(cases, out[0])}


TORCHRUN_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


TP_NAMES = {"all_reduce": "tp_all_reduce", "all_gather_single": "tp_all_gather",
            "reduce_scatter_single": "tp_reduce_scatter"}


RECOMPUTE = "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split()


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
# A MoE layer's extra TP traffic: a shared expert, the router losses (all-reduced under SP).
MOE_EXTRAS = ["--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "0.01",
              "--moe-z-loss-coeff", "0.001"]


# recompute: None, "full", or "full+dropout" (hidden dropout makes a recomputed chunk's
# last reduction run again). moe: None, "experts" (EP 2 where the data-parallel size
# allows), or "experts+extras" (also MOE_EXTRAS).
TP_CASES = [
    ("zero1", False, None, None), ("zero1", True, None, None), ("zero3", False, None, None),
    ("zero3", True, "full", None), ("zero1", False, "full+dropout", None),
    ("zero3", False, None, "experts"), ("zero2", True, None, "experts+extras")]


def tp_flags(strategy, sequence_parallel, recompute, moe, world):
    """The trainer flags of a TP_CASES case (TP 2) at ``world`` ranks."""
    ep = 2 if moe and world // 2 >= 2 else 1
    extra = (["--sequence-parallel"] if sequence_parallel else []) + (RECOMPUTE if recompute else [])
    extra += ["--hidden-dropout", "0.1"] if recompute == "full+dropout" else []
    extra += [*MOE, "--expert-model-parallel-size", str(ep)] if moe else []
    extra += MOE_EXTRAS if moe == "experts+extras" else []
    return ["--use-mfsdp", "--tensor-model-parallel-size", "2", "--global-batch-size", str(4 * world // 2),
            *TP_SHAPE, *FLAGS[strategy], *extra]


@pytest.mark.parametrize("strategy,sequence_parallel,recompute,moe", TP_CASES)
def test_planner_matches_engine_under_tensor_parallelism(strategy, sequence_parallel, recompute, moe, tool_units):
    from megatron.core.transformer.moe.model_queries import expert_parallel_of
    from megatron.training.model_builder import finalize_model_grads

    world = dist.get_world_size()
    flags = tp_flags(strategy, sequence_parallel, recompute, moe, world)
    args = trainer_args("llama", *flags)
    ep = args.expert_model_parallel_size
    with model_parallel(args.tensor_model_parallel_size, args) as state:
        built = build_model(gpt_provider, args, torch.device("cpu"))
        model = built.unwrapped
        units = planned_units(model)
        ep_groups = {expert_parallel_of(model).group} if ep > 1 else set()
        with collective_tap({state.tp_group}) as records, collective_tap(ep_groups) as ep_records:
            optimizer, microbatches = one_step(built, args, state.dp_rank, state.dp_size,
                                               finalize=lambda: finalize_model_grads(args, built))
        shape, moe_shape = shapes_of(args, model)
        predicted = plan(units, strategy, state.dp_size, microbatches=microbatches, rank=state.dp_rank,
                         activations=shape, moe=moe_shape)
    check_persistent(predicted, built, optimizer)
    fsdp = {k: v for k, v in predicted.comm_bytes.items() if not k.startswith("tp_") and k != "all_to_all"}
    assert fsdp == built.context.counter.bytes_by_kind()
    tp_bytes = {k: v for k, v in predicted.comm_bytes.items() if k.startswith("tp_")}
    assert tp_bytes == summed(records, TP_NAMES)
    assert set(tp_bytes) == ({"tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"} if sequence_parallel
                             else {"tp_all_reduce"})
    if moe:
        assert any(u.expert for u in units)
        check_all_to_all(predicted, ep_records, ep)
    if strategy == "zero3":
        assert tool_units[tuple(flags)] == describe(units)


def check_all_to_all(predicted, records, ep):
    """Dropless routing: what a rank receives depends on the routing; summed over an EP
    group, received equals sent, which the plan counts exactly (every group alike, so the
    world's sum is the plan times the world)."""
    if ep == 1:
        assert "all_to_all" not in predicted.comm_bytes and not records
        return
    measured = torch.tensor(sum(n for name, n in records if name == "all_to_all_single"))
    dist.all_reduce(measured)
    assert measured.item() == dist.get_world_size() * predicted.comm_bytes["all_to_all"]


EP_CASES = [("zero2", False), ("zero3", True), ("hsdp", False), ("hfsdp", False)]


def ep_flags(strategy, recompute, world):
    """The trainer flags of an EP_CASES case at ``world`` ranks."""
    hybrid = strategy in ("hsdp", "hfsdp")
    ep = 1 if hybrid and world < 4 else 2  # EP divides one instance's world / 2 ranks
    return ["--use-mfsdp", *MOE, "--expert-model-parallel-size", str(ep), "--global-batch-size", str(4 * world),
            *TP_SHAPE, *FLAGS[strategy], *(RECOMPUTE if recompute else [])]


@pytest.mark.parametrize("strategy,recompute", EP_CASES)
def test_planner_matches_engine_with_expert_parallelism(strategy, recompute, tool_units):
    from megatron.core.transformer.moe.model_queries import expert_parallel_of

    world = dist.get_world_size()
    hybrid = strategy in ("hsdp", "hfsdp")
    flags = ep_flags(strategy, recompute, world)
    args = trainer_args("llama", *flags)
    ep = args.expert_model_parallel_size
    built = build_model(gpt_provider, args, torch.device("cpu"))
    model = built.unwrapped
    units = planned_units(model)
    experts = [u for u in units if u.expert]
    assert len(experts) == args.num_layers  # every layer routes (--moe-layer-freq 1)
    ep_groups = {expert_parallel_of(model).group} if ep > 1 else set()
    with collective_tap(ep_groups) as records:
        optimizer, microbatches = one_step(built, args, dist.get_rank(), world)
    shape, moe = shapes_of(args, model)
    assert moe == MoEShape(args.num_layers, 4, 2, ep, recomputed_moe_layers=int(recompute), ffn_hidden_size=24,
                           gated=True)  # llama: SwiGLU experts without biases
    predicted = plan(units, strategy, world, outer_size=args.dp_outer_size if hybrid else 1,
                     microbatches=microbatches, rank=dist.get_rank(), activations=shape, moe=moe)
    check_persistent(predicted, built, optimizer)
    if strategy in ("zero3", "hsdp"):
        assert tool_units[tuple(flags)] == describe(units)
    fsdp = {k: v for k, v in predicted.comm_bytes.items() if k != "all_to_all"}
    assert fsdp == built.context.counter.bytes_by_kind()
    check_all_to_all(predicted, records, ep)


def test_ddp_plan_is_the_whole_model_on_every_rank():
    args = trainer_args("gpt2", *SHAPE)
    model = gpt_provider(args)
    units = units_of(model, list(model.decoder.layers) + [model])
    total = sum(p.numel() for p in model.parameters())
    assert sum(u.numel for u in units) == total
    ddp = plan(units, "ddp", 4)
    assert ddp.persistent == dict(main_weight=0, model_weight=4 * total, main_grad=4 * total, optimizer_state=8 * total)
    assert ddp.comm_bytes == {"all_reduce": 4 * total}
    zero3 = plan(units, "zero3", 4)
    assert zero3.persistent_total < ddp.persistent_total / 3.5  # 16 bytes/param over 4 ranks, plus padding


def test_recompute_shrinks_the_activation_estimate():
    shape = ActivationShape(micro_batch_size=2, seq_length=512, hidden_size=256, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=8, vocab_size=1000)
    none, selective, full = (activation_bytes(shape, r) for r in (None, "selective", "full"))
    assert full < selective < none
    logits = 2 * 2 * 512 * 1000 * 4
    # Korthikanti's 34 s b h + 5 a s^2 b per layer (16-bit units), doubled for fp32.
    assert none - logits == 8 * (34 * 512 * 2 * 256 + 5 * 8 * 512 * 512 * 2) * 2


def test_tensor_parallelism_splits_the_activation_estimate():
    shape = ActivationShape(micro_batch_size=2, seq_length=512, hidden_size=256, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=8, vocab_size=1000)
    tp = dataclasses.replace(shape, tp_size=2)
    sp = dataclasses.replace(tp, sequence_parallel=True)
    for recompute in (None, "selective", "full"):
        whole = activation_bytes(shape, recompute)
        # With SP every saved tensor is split; without, the layer inputs, norms and dropout
        # masks (Korthikanti's 10 of 34 s b h per layer) stay whole.
        assert activation_bytes(sp, recompute) == whole // 2
        assert whole // 2 < activation_bytes(tp, recompute) < whole
    s, b, h, L = 512, 2, 256, 8
    assert activation_bytes(tp) - activation_bytes(sp) == L * 10 * s * b * h * 2 // 2


def test_moe_layers_replace_the_mlp_share_of_the_activation_estimate():
    s, b, h, E, k, ffn = 512, 2, 256, 8, 2, 384
    shape = ActivationShape(micro_batch_size=b, seq_length=s, hidden_size=h, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=4, vocab_size=1000)
    moe = MoEShape(num_moe_layers=2, num_experts=E, topk=k, ffn_hidden_size=ffn)
    dense = activation_bytes(shape)
    # Two of the four layers: the dense MLP's 19 s b h (16-bit units, fp32 here) out, the
    # experts' 3h + 3E + 4kh + 6k ffn per token in.
    per_layer = (3 * h + 3 * E + 4 * k * h + 6 * k * ffn - 19 * h) * s * b * 2
    assert activation_bytes(shape, moe=moe) - dense == 2 * per_layer
    gated = dataclasses.replace(moe, gated=True)
    assert activation_bytes(shape, moe=gated) - activation_bytes(shape, moe=moe) == 2 * 4 * k * ffn * s * b * 2
    biased = dataclasses.replace(moe, biased=True)
    assert activation_bytes(shape, moe=biased) - activation_bytes(shape, moe=moe) == 2 * 2 * k * h * s * b * 2
    # Under TP the expert rows stay whole (gathered before the dispatch), their fc1 is split.
    tp = dataclasses.replace(shape, tp_size=2, sequence_parallel=True)
    assert (activation_bytes(tp, moe=moe) - activation_bytes(tp)
            == 2 * (3 * h / 2 + 3 * E + 4 * k * h + 6 * k * ffn / 2 - 19 * h / 2) * s * b * 2)
    # Full recompute rebuilds one layer in backward: the larger of the two kinds.
    assert activation_bytes(shape, "full", moe) - activation_bytes(shape, "full") == max(per_layer, 0)
    assert plan([], "zero3", 2, activations=shape, moe=moe).transient["activations"] == activation_bytes(shape, moe=moe)


def _saved_bytes(model, module, args) -> int:
    """Bytes ``module``'s forward saves for backward on a fresh input: each storage once,
    the model's parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(saved.values())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_moe_activation_estimate_is_near_the_saved_tensors(arch):
    """The MoE layer's share of the estimate against the bytes its forward saves for
    backward (each storage once, parameters excluded), one process."""
    flags = ["--seq-length", "256", "--hidden-size", "128", "--ffn-hidden-size", "256", *MOE]
    args = trainer_args(arch, *flags, world_size=1)
    model = gpt_provider(args).train()
    layer = model.decoder.layers[0].mlp
    saved = _saved_bytes(model, layer, args)
    shape, moe = shapes_of(args, model)
    one = dataclasses.replace(shape, num_layers=1, ffn_hidden_size=0)  # the attention's share alone
    predicted = activation_bytes(one, moe=dataclasses.replace(moe, num_moe_layers=1)) - activation_bytes(one)
    assert abs(predicted - saved) < 0.1 * saved, (predicted, saved)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dense_mlp_activation_estimate_is_near_the_saved_tensors(arch):
    """The dense MLP's share of the estimate (GELU, or SwiGLU for llama) against the bytes
    its forward saves for backward (each storage once, parameters excluded), one process."""
    args = trainer_args(arch, "--seq-length", "256", "--hidden-size", "128", world_size=1)
    model = gpt_provider(args).train()
    saved = _saved_bytes(model, model.decoder.layers[0].mlp, args)
    shape, _ = shapes_of(args, model)
    one = dataclasses.replace(shape, num_layers=1)
    share = activation_bytes(one) - activation_bytes(dataclasses.replace(one, ffn_hidden_size=0))
    # The share includes the dropout mask after fc2 (one byte per element, 1 of the 19),
    # which the layer's bias-dropout-add holds, not the MLP module.
    predicted = share - args.micro_batch_size * args.seq_length * args.hidden_size * shape.element_bytes // 2
    assert abs(predicted - saved) < 0.1 * saved, (predicted, saved)


def test_bad_strategy_and_outer_size_are_refused():
    units = []
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan(units, "zero4", 2)
    with pytest.raises(ValueError, match="outer size >= 2 that divides"):
        plan(units, "hsdp", 3, outer_size=2)
    experts = [UnitShapes("experts", (torch.Size((2, 8, 4)),), expert=True)]
    moe = MoEShape(num_moe_layers=1, num_experts=4, topk=2, ep_size=2)
    with pytest.raises(ValueError, match="divides the data-parallel size of one instance"):
        plan(experts, "hsdp", 2, outer_size=2, moe=moe)  # one rank per instance, EP 2
    with pytest.raises(ValueError, match="divides the data-parallel size of one instance"):
        plan(experts, "zero3", 3, moe=moe)
    shape = ActivationShape(micro_batch_size=1, seq_length=8, hidden_size=8, num_attention_heads=2,
                            ffn_hidden_size=16, num_layers=1, vocab_size=16, tp_size=2)
    recomputed = dataclasses.replace(moe, recomputed_moe_layers=1)
    with pytest.raises(ValueError, match="MoE layers under full recompute are not modelled"):
        plan(experts, "zero3", 4, activations=dataclasses.replace(shape, recomputed_layers=1), moe=recomputed)


def test_estimate_memory_tool_reuses_the_trainer_flags(capsys):
    import sys

    sys.path.insert(0, REPO)
    from tools.estimate_memory import main

    plans = main(["--world-size", "4", *SHAPE, "--seq-length", "16", "--micro-batch-size", "2",
                  "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
                  "--lr", "1e-3", "--train-iters", "1"])
    out = capsys.readouterr().out
    assert [p.strategy for p in plans] == ["ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp"]
    for name in ("ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp", "all_gather", "reduce_scatter"):
        assert name in out
    small = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
             "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--lr", "1e-3",
             "--train-iters", "1"]
    with pytest.raises(SystemExit, match="--num-attention-heads"):
        main(["--world-size", "2", *small, "--hidden-size", "30"])
    with pytest.raises(SystemExit, match="--optimizer muon are not supported yet"):
        main(["--world-size", "2", *small, "--optimizer", "muon"])
    # What the planner does not model (the trainer runs it), it refuses: which TP
    # collectives of a recomputed MoE layer run again.
    with pytest.raises(SystemExit, match="tensor-model-parallel-size > 1 and full recompute"):
        main(["--world-size", "4", *small, "--use-mfsdp", "--num-experts", "4", "--tensor-model-parallel-size", "2",
              *RECOMPUTE])
    with pytest.raises(SystemExit, match="plans with --experimental-attention-variant"):
        main(["--world-size", "2", *small, "--swiglu", "--experimental-attention-variant", "gdn",
              "--linear-attention-freq", "2",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "2", "--linear-key-head-dim", "8",
              "--linear-value-head-dim", "8"])
    with pytest.raises(SystemExit, match="pipeline plans of a mixture of experts or with full recompute"):
        main(["--world-size", "4", *small, "--pipeline-model-parallel-size", "2", *RECOMPUTE])
    # CP: the units over DP x CP ranks (the persistent bytes of CP=1 at the same world),
    # a CP rank's activations, the exchange's bytes.
    whole = {p.strategy: p for p in main(["--world-size", "4", *small, "--seq-length", "64"])}
    capsys.readouterr()
    for strategy, p in ((p.strategy, p) for p in main(["--world-size", "4", *small, "--seq-length", "64",
                                                       "--context-parallel-size", "2"])):
        assert p.persistent == whole[strategy].persistent, strategy
        assert p.transient["activations"] < whole[strategy].transient["activations"], strategy
        assert p.comm_bytes["cp_send"] > 0
    assert "x DP 2 x CP 2 (p2p)" in capsys.readouterr().out
    # TP/EP plans need a fake world of their own (tool_units runs them in a fresh process).
    with pytest.raises(SystemExit, match="not under torchrun"):
        main(["--world-size", "4", *small, "--tensor-model-parallel-size", "2"])


@pytest.mark.skipif(dist.get_world_size() < 2, reason="a pipeline needs two ranks or more")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # tied (a copy on both stages) and untied embeddings
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_planner_matches_engine_per_pipeline_stage(strategy, arch):
    """Each stage's plan (its chunks' units, the tied embedding's copy a unit of its own)
    has the persistent bytes the engine holds on that stage at PP=2."""
    from megatron.core import parallel_state
    from pretrain_gpt import model_provider

    args = trainer_args(arch, "--use-mfsdp", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                        "--hidden-size", "48", "--ffn-hidden-size", "80", *FLAGS[strategy])
    state = parallel_state.initialize_model_parallel(1, 1, pipeline_model_parallel_size=2)
    try:
        built = build_model(model_provider, args, torch.device("cpu"))
        units = [u for chunk in built.chunks for u in planned_units(chunk)]
        predicted = plan(units, strategy, state.dp_size, rank=state.dp_rank)
    finally:
        parallel_state.destroy_model_parallel()
    assert len(units) == len(built.context.units)
    measured = built.context.persistent_bytes()
    for key in ("main_weight", "model_weight", "main_grad"):
        assert predicted.persistent[key] == measured[key], (key, predicted.persistent, measured)


def test_pipeline_plans_per_stage_hold_the_schedules_microbatches():
    """tools/estimate_memory.py at PP=2 prints one table per stage; the first stage of 1F1B
    holds 2 microbatches' activations, the last one 1 (and its logits)."""
    from types import SimpleNamespace

    from tools.estimate_memory import activations_in_flight

    one_f_one_b = SimpleNamespace(pipeline_model_parallel_size=4, num_microbatches=8,
                                  virtual_pipeline_model_parallel_size=None,
                                  microbatch_group_size_per_virtual_pipeline_stage=None)
    assert [activations_in_flight(one_f_one_b, s) for s in range(4)] == [4, 3, 2, 1]
    interleaved = SimpleNamespace(pipeline_model_parallel_size=2, num_microbatches=4,
                                  virtual_pipeline_model_parallel_size=2,
                                  microbatch_group_size_per_virtual_pipeline_stage=None)
    # 2 (p - stage - 1) + (v - 1) p + 1 chunk-microbatches: 5 and 3
    assert [activations_in_flight(interleaved, s) for s in range(2)] == [5, 3]
    if dist.get_rank() == 0:
        flags = ["--world-size", "4", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--lr", "1e-3", "--train-iters", "1",
                 "--use-mfsdp", "--pipeline-model-parallel-size", "2"]
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
        run = subprocess.run([sys.executable, "tools/estimate_memory.py", *flags], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "stage 0: layers 0-1;" in run.stdout and "stage 1: layers 2-3;" in run.stdout, run.stdout
        assert "2 microbatch(es) of one chunk in flight" in run.stdout


MLA_FLAGS = ("--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
             "--v-head-dim 12 --qk-layernorm").split()


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_planner_counts_multi_latent_attention_weights(strategy):
    """The units the tool plans for an MLA model (its down/up projections and latent norms)
    give the engine's persistent bytes, and every weight is in one unit."""
    world = dist.get_world_size()
    args = trainer_args("llama", "--use-mfsdp", "--global-batch-size", str(4 * world), *SHAPE, *MLA_FLAGS,
                        *FLAGS[strategy])
    built = build_model(gpt_provider, args, torch.device("cpu"))
    units = planned_units(built.unwrapped)
    assert sum(u.numel for u in units) == sum(math.prod(p.shape) for p in built.unwrapped.parameters())
    optimizer, microbatches = one_step(built, args)
    predicted = plan(units, strategy, world, microbatches=microbatches, rank=dist.get_rank())
    check_persistent(predicted, built, optimizer)
    assert predicted.comm_bytes == built.context.counter.bytes_by_kind()
