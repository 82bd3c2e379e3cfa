"""The contenders of the benchmark: one GPT model, one reference initialization, and how
each data-parallel wrapper is built from it and runs one training step.

``mfsdp_zero3``, ``mfsdp_zero2``, ``mfsdp_hsdp``, ``mfsdp_no_shard``
    MFSDP v2 (this repository's engine), one unit per decoder layer plus the root.
    ``name@REV`` builds it on the engine of git revision REV (engine_snapshot.py),
    ``name+PROTO`` with a benchmark-only variant (prototypes.py).
``fsdp2``
    PyTorch's ``fully_shard``, the same units.
``ddp``
    PyTorch's ``DistributedDataParallel`` (autocast for bf16).
``plain`` (overlap mode)
    No wrapper, no communication: compute only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import resource
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from measurement import rank, storage_bytes, world  # noqa: E402

from megatron.core.distributed import mfsdp_v2  # noqa: E402
from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.model_stats import num_parameters  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

ALL_CONTENDERS = ("mfsdp_zero3", "mfsdp_zero2", "mfsdp_zero1", "mfsdp_no_shard", "mfsdp_hsdp", "mfsdp_hfsdp",
                  "fsdp2", "ddp")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# Default model configs. bf16 matmuls on a CPU without AVX512-BF16/AMX run through a scalar
# fallback (~50x slower than fp32 here, see README), so the bf16 default is smaller.
DEFAULT_CONFIGS = {
    "fp32": dict(layers=8, hidden=640, heads=10, vocab=16384, seq=128, micro_batch=2),  # 50.0M parameters
    "bf16": dict(layers=4, hidden=128, heads=4, vocab=2048, seq=64, micro_batch=2),
}


SMOKE_CONFIG = dict(layers=2, hidden=32, heads=2, vocab=128, seq=16, micro_batch=2)


@dataclasses.dataclass
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int

    def config(self) -> TransformerConfig:
        return TransformerConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads)

    def num_params(self) -> int:
        return num_parameters(self.config(), self.vocab, self.seq)

    def describe(self) -> str:
        return (f"GPT L={self.layers} h={self.hidden} heads={self.heads} ffn={4 * self.hidden} "
                f"vocab={self.vocab} seq={self.seq} micro_batch/rank={self.micro_batch} "
                f"params={self.num_params() / 1e6:.2f}M (tied embeddings, learned positions, LayerNorm, GELU)")


def build_reference(spec: ModelSpec, seed: int, dtype: torch.dtype) -> GPTModel:
    """The one initialization every contender copies. For bf16 the weights are rounded to
    bf16-representable values, so fp32 main weights (MFSDP) and fp32 params (FSDP2, DDP)
    start from exactly the values the bf16 compute copy holds."""
    torch.manual_seed(seed)
    model = GPTModel(spec.config(), spec.vocab, spec.seq)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    return model


def make_batches(spec: ModelSpec, count: int, seed: int):
    """A learnable synthetic language (so losses fall and a wrong gradient shows): each next
    token follows a fixed random permutation of the previous one with probability 0.8, else
    it is uniform. The global batch of step i is the same for every contender; each rank
    takes its rows."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(spec.vocab, generator=g)
    n_rows = world() * spec.micro_batch
    batches = []
    for _ in range(count):
        tokens = torch.empty(n_rows, spec.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, spec.vocab, (n_rows,), generator=g)
        noise = torch.randint(0, spec.vocab, (n_rows, spec.seq), generator=g)
        follow = torch.rand(n_rows, spec.seq, generator=g) < 0.8
        for t in range(spec.seq):
            tokens[:, t + 1] = torch.where(follow[:, t], perm[tokens[:, t]], noise[:, t])
        rows = tokens[rank() * spec.micro_batch:(rank() + 1) * spec.micro_batch]
        batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return batches


class Meshes:
    def __init__(self):
        self.flat = init_device_mesh("cpu", (world(),), mesh_dim_names=("dp",))
        self.hsdp = None
        if world() >= 4 and world() % 2 == 0:
            self.hsdp = init_device_mesh("cpu", (world() // 2, 2), mesh_dim_names=("outer", "inner"))


@dataclasses.dataclass
class Options:
    lr: float = 1e-3
    foreach: bool = True
    fsdp2_forward_prefetch: bool = False
    mfsdp_prefetch: int = 1  # 0 = none, 1 = engine default, 2 = prototype depth 2


class Contender:
    """One wrapped model, its optimizer and how to run a step."""

    def __init__(self, name: str, model: nn.Module, optimizer, dtype: torch.dtype, kind: str, ctx=None,
                 autocast: bool = False, shard_size: int = 1, engine=mfsdp_v2):
        self.name = name
        self.engine = engine  # the MFSDP package (the working tree's, or a snapshot at a revision)
        self.model = model
        self.optimizer = optimizer
        self.dtype = dtype
        self.kind = kind  # "mfsdp" | "fsdp2" | "ddp" | "plain"
        self.ctx = ctx
        self.autocast = autocast
        self.shard_size = shard_size
        self.times: List[dict] = []
        self.losses: List[float] = []
        self.persistent: Optional[dict] = None

    def _forward_scope(self):
        if self.kind == "mfsdp":
            return self.engine.microbatch(self.ctx, is_last=True)
        if self.autocast:
            return torch.autocast("cpu", dtype=self.dtype)
        return contextlib.nullcontext()

    def step(self, inputs, labels, measure_memory: bool = False) -> dict:
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with self._forward_scope():
            loss = self.model(inputs, labels=labels).mean()
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        if measure_memory:
            self.persistent = self.persistent_bytes()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        # Minor page faults of the whole process (gloo threads included) during the step:
        # first touches of freshly mapped memory, i.e. what the allocator did not reuse.
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        return {"loss": loss.item(), "step": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                "page_faults": float(faults)}

    # Memory -----------------------------------------------------------------------------
    def optimizer_state_tensors(self):
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value

    def persistent_bytes(self) -> dict:
        """Per-rank bytes of weights, gradients and optimizer state, measured after the
        backward (gradients alive) and before the optimizer step's zero_grad. Optimizer
        state is read after at least one step, so the caller measures from step 2 on."""
        opt = storage_bytes(self.optimizer_state_tensors())
        if self.kind == "mfsdp":
            engine = self.ctx.persistent_bytes()
            weights = engine.get("main_weight", 0) + engine.get("model_weight", 0)
            grads = engine.get("main_grad", 0)
            detail = dict(engine)
        else:
            params = list(self.model.parameters())
            weights = storage_bytes(params)
            grads = storage_bytes([p.grad for p in params])
            detail = {}
        return {"weights": weights, "grads": grads, "optimizer": opt, "total": weights + grads + opt, "detail": detail}


def _mfsdp_policy(dtype: torch.dtype, engine=mfsdp_v2) -> Optional[MixedPrecisionPolicy]:
    if dtype == torch.float32:
        return None
    # Same numerics as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over
    # fp32 parameters: bf16 compute and all-gather, bf16 reduce-scatter, fp32 gradients,
    # fp32 main weights.
    return engine.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                       grad_comm_dtype=dtype)


def _set_prefetch_depth(ctx, depth: int) -> None:
    """0: no prefetch; 1: the engine's own (default); 2: prototype of a deeper prefetch
    (issue the all-gathers of the next two units). Benchmark-only: the context's public
    ``prefetch_forward(state)`` / ``prefetch_backward(state)`` replaced on the instance."""
    if depth == 1:
        return
    if depth == 0:
        ctx.prefetch_forward = lambda state: None
        ctx.prefetch_backward = lambda state: None
        return
    if depth != 2:
        raise ValueError(f"prefetch depth must be 0, 1 or 2, got {depth}")
    stock_forward, stock_backward = ctx.prefetch_forward, ctx.prefetch_backward

    def deeper(stock, order, index_of):
        def prefetch(state) -> None:
            stock(state)  # the next unit
            index = index_of(state) + 1
            if index < len(order):
                stock(order[index].fsdp_state)  # and the one after it

        return prefetch

    ctx.prefetch_forward = deeper(stock_forward, ctx.forward_order, lambda s: s.forward_index)
    ctx.prefetch_backward = deeper(stock_backward, ctx.backward_order, lambda s: s.backward_index)


def build_mfsdp(name: str, ref: nn.Module, dtype: torch.dtype, placements: Callable, mesh, opts: Options,
                shard_size: int, engine=mfsdp_v2) -> Contender:
    """``placements(engine.Placements)`` gives the placements, so a snapshot engine gets its own."""
    model = copy.deepcopy(ref)
    if dtype != torch.float32:
        model = model.to(dtype)
    policy = _mfsdp_policy(dtype, engine)
    placements = placements(engine.Placements)
    with engine.fully_shard_context(device="cpu") as ctx:
        for layer in model.decoder.layers:
            engine.fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=policy)
        engine.fully_shard(model, mesh=mesh, placements=placements, mixed_precision_policy=policy)
    _set_prefetch_depth(ctx, opts.mfsdp_prefetch)
    optimizer = engine.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach))
    return Contender(name, model, optimizer, dtype, "mfsdp", ctx=ctx, shard_size=shard_size, engine=engine)


def build_fsdp2(name: str, ref: nn.Module, dtype: torch.dtype, mesh, opts: Options) -> Contender:
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    model = copy.deepcopy(ref)
    policy = Fsdp2Policy() if dtype == torch.float32 else Fsdp2Policy(param_dtype=dtype, reduce_dtype=dtype)
    layers = list(model.decoder.layers)
    for layer in layers:
        fsdp2_fully_shard(layer, mesh=mesh, mp_policy=policy)
    fsdp2_fully_shard(model, mesh=mesh, mp_policy=policy)
    if opts.fsdp2_forward_prefetch:
        for i, layer in enumerate(layers[:-1]):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender(name, model, optimizer, dtype, "fsdp2", shard_size=world())


def build_ddp(name: str, ref: nn.Module, dtype: torch.dtype, opts: Options) -> Contender:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(ref), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender(name, model, optimizer, dtype, "ddp", autocast=dtype != torch.float32, shard_size=1)


def build_plain(ref: nn.Module, dtype: torch.dtype, opts: Options) -> Contender:
    """No wrapper, no communication: each rank trains its own copy (compute-only time)."""
    model = copy.deepcopy(ref)
    if dtype != torch.float32:
        model = model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender("plain", model, optimizer, dtype, "plain")


def base_name(name: str) -> str:
    """The contender without its prototypes (``+name``) or engine revision (``@rev``)."""
    return name.split("+", 1)[0].split("@", 1)[0]


def build(name: str, ref: nn.Module, dtype: torch.dtype, meshes: Meshes, opts: Options, engine=mfsdp_v2) -> Contender:
    if "@" in name.split("+", 1)[0]:  # an MFSDP contender on the engine of an older revision
        import engine_snapshot

        head, _, rest = name.partition("@")
        rev, plus, protos = rest.partition("+")
        c = build(head + plus + protos, ref, dtype, meshes, opts, engine=engine_snapshot.load(rev))
        if c.kind != "mfsdp":
            raise ValueError(f"an engine revision applies to MFSDP contenders only, not {head!r}")
        c.name = name
        return c
    if "+" in name:  # an MFSDP contender with benchmark-only prototypes (prototypes.py)
        import prototypes

        base, *protos = name.split("+")
        c = build(base, ref, dtype, meshes, opts, engine)
        if c.kind != "mfsdp":
            raise ValueError(f"prototypes apply to MFSDP contenders only, not {base!r}")
        prototypes.apply_to_context(c.ctx, protos)
        c.name = name
        return c
    if name == "mfsdp_zero3":
        return build_mfsdp(name, ref, dtype, lambda P: P.zero3(), meshes.flat, opts, world(), engine)
    if name == "mfsdp_zero2":
        return build_mfsdp(name, ref, dtype, lambda P: P.zero2(), meshes.flat, opts, world(), engine)
    if name == "mfsdp_zero1":
        return build_mfsdp(name, ref, dtype, lambda P: P.zero1(), meshes.flat, opts, world(), engine)
    if name in ("mfsdp_hsdp", "mfsdp_hfsdp"):
        if meshes.hsdp is None:
            raise ValueError(f"{name} needs an even world size of at least 4 (a 2 x N/2 mesh).")
        if name == "mfsdp_hsdp":
            return build_mfsdp(name, ref, dtype, lambda P: P.hsdp("outer", "inner"), meshes.hsdp, opts, 2, engine)
        return build_mfsdp(name, ref, dtype, lambda P: P.hfsdp("outer", "inner"), meshes.hsdp, opts, world(), engine)
    if name == "fsdp2":
        return build_fsdp2(name, ref, dtype, meshes.flat, opts)
    if name == "ddp":
        return build_ddp(name, ref, dtype, opts)
    if name == "mfsdp_no_shard":
        return build_mfsdp(name, ref, dtype, lambda P: P.no_shard(), meshes.flat, opts, 1, engine)
    raise ValueError(f"unknown contender {name!r}; choose from {ALL_CONTENDERS}")


def default_contenders(n: int) -> List[str]:
    names = ["mfsdp_zero3", "mfsdp_zero2"]
    if n >= 4 and n % 2 == 0:
        names.append("mfsdp_hsdp")
    return names + ["fsdp2", "ddp"]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def resolve_spec(args, dtype: str) -> ModelSpec:
    base = dict(SMOKE_CONFIG if args.smoke else DEFAULT_CONFIGS[dtype])
    for key in base:
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    return ModelSpec(**base)
