"""Loss normalization of the no-pipelining schedule.

The gradient of a step must be that of sum(masked per-token loss) / (loss tokens of the
global batch), whatever the split into microbatches and data-parallel ranks.
"""

import contextlib
import datetime
import os
import sys
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.pipeline_parallel import forward_backward_no_pipelining, get_forward_backward_func

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH = 11, 8, 6, 8


class TinyLM(torch.nn.Module):
    """Per-token cross-entropy like GPTModel(labels=...), small enough to compare exactly."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        logits = self.proj(torch.tanh(self.embedding(tokens)))
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
        ).view(tokens.shape)


def make_global_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    # Very uneven masks: per-microbatch means would weight tokens differently.
    loss_mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) < torch.linspace(0.1, 1.0, GLOBAL_BATCH)[:, None]).float()
    loss_mask[0, 0] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def loss_func(loss_mask, output):
    loss_sum = (output.reshape(-1) * loss_mask.reshape(-1)).sum()
    n = loss_mask.sum()
    return loss_sum, n, {"lm loss": torch.stack([loss_sum.detach(), n])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["tokens"], batch["labels"]), partial(loss_func, batch["loss_mask"])


def split(batch, rank, dp_size, micro_batch_size):
    """This rank's microbatches, in Megatron's sampler order."""
    out = []
    chunk = micro_batch_size * dp_size
    for start in range(0, GLOBAL_BATCH, chunk):
        lo = start + rank * micro_batch_size
        out.append({k: v[lo : lo + micro_batch_size] for k, v in batch.items()})
    return out


def reference_grads(model, batch):
    model.zero_grad()
    loss = (model(batch["tokens"], batch["labels"]) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.item()


def schedule_grads(model, batch, micro_batch_size, rank=0, dp_size=1, context=None):
    model.zero_grad()
    mbs = split(batch, rank, dp_size, micro_batch_size)
    reports = forward_backward_no_pipelining(forward_step, iter(mbs), model, len(mbs), context=context)
    params = model.module.named_parameters() if hasattr(model, "module") else model.named_parameters()
    return {n: p.grad.clone() for n, p in params}, reports


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4, 8])
def test_microbatched_gradient_equals_full_batch_gradient(micro_batch_size):
    torch.manual_seed(0)
    model = TinyLM().double()
    batch = make_global_batch()
    batch["loss_mask"] = batch["loss_mask"].double()
    ref, ref_loss = reference_grads(model, batch)
    got, reports = schedule_grads(model, batch, micro_batch_size)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12, msg=name)
    total = sum(r["lm loss"] for r in reports)
    assert total[1].item() == batch["loss_mask"].sum().item()
    assert total[0].item() / total[1].item() == pytest.approx(ref_loss, rel=1e-12)


def test_four_microbatches_of_two_equal_one_of_eight():
    torch.manual_seed(0)
    model = TinyLM()
    batch = make_global_batch(seed=3)
    a, _ = schedule_grads(model, batch, micro_batch_size=2)
    b, _ = schedule_grads(model, batch, micro_batch_size=8)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7)


def test_mean_losses_are_averaged_over_microbatches():
    # (loss, report) form: a loss already averaged over its microbatch.
    torch.manual_seed(0)
    model = TinyLM().double()
    batch = make_global_batch()
    batch["loss_mask"] = torch.ones_like(batch["loss_mask"], dtype=torch.float64)
    ref, _ = reference_grads(model, batch)

    def mean_forward_step(it, m):
        b = next(it)
        return m(b["tokens"], b["labels"]), lambda out: (out.mean(), {"lm loss": out.mean().detach()})

    model.zero_grad()
    forward_backward_no_pipelining(mean_forward_step, iter(split(batch, 0, 1, 2)), model, 4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-12, atol=1e-12)


def test_forward_only_leaves_no_gradient():
    model = TinyLM()
    batch = make_global_batch()
    with torch.no_grad():
        reports = forward_backward_no_pipelining(forward_step, iter(split(batch, 0, 1, 4)), model, 2, forward_only=True)
    assert len(reports) == 2
    assert all(p.grad is None for p in model.parameters())


def test_batch_without_loss_tokens_gives_zero_gradient_not_nan():
    model = TinyLM()
    batch = make_global_batch()
    batch["loss_mask"].zero_()
    grads, _ = schedule_grads(model, batch, micro_batch_size=4)
    for g in grads.values():
        assert torch.all(g == 0)


def test_context_wraps_each_microbatch_and_marks_only_the_last(monkeypatch):
    import types
    import sys

    calls = []

    @contextlib.contextmanager
    def fake_microbatch(context, is_last):
        calls.append((context, is_last))
        yield

    # The schedule imports microbatch lazily from the engine package; stand in for it.
    fake = types.ModuleType("megatron.core.distributed.mfsdp_v2")
    fake.microbatch = fake_microbatch
    monkeypatch.setitem(sys.modules, "megatron.core.distributed.mfsdp_v2", fake)
    model = TinyLM()
    ctx = object()
    schedule_grads(model, make_global_batch(), micro_batch_size=2, context=ctx)
    assert calls == [(ctx, False), (ctx, False), (ctx, False), (ctx, True)]


def test_rejects_bad_inputs():
    model = TinyLM()
    with pytest.raises(ValueError, match="at least 1"):
        forward_backward_no_pipelining(forward_step, iter([]), model, 0)
    with pytest.raises(ValueError, match="exactly one"):
        forward_backward_no_pipelining(forward_step, iter([]), [model, model], 1)
    with pytest.raises(ValueError, match="loss_mask"):
        forward_backward_no_pipelining(forward_step, iter([{"tokens": None}]), model, 1)
    assert get_forward_backward_func() is forward_backward_no_pipelining


# --- two data-parallel ranks (DDP over gloo, spawned processes) ----------------------------

DDP_MICRO_BATCH_SIZES = (1, 2, 4)


def _ddp_worker(rank, world_size, store_path, out_dir):
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # a stuck peer fails, never hangs
    for micro_batch_size in DDP_MICRO_BATCH_SIZES:
        torch.manual_seed(0)
        model = TinyLM().double()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        batch = make_global_batch()
        batch["loss_mask"] = batch["loss_mask"].double()
        grads, _ = schedule_grads(ddp, batch, micro_batch_size, rank=rank, dp_size=world_size)
        torch.save(grads, os.path.join(out_dir, f"grads_{micro_batch_size}_{rank}.pt"))
    dist.barrier()
    # A finished worker leaves without tearing its gloo group down: the group's destructor
    # joins gloo's work thread while holding the GIL, and that thread can be waiting for the
    # GIL to release a finished work's Python objects (a deadlock seen in CI, once in a few
    # dozen runs). The results are on disk; a failure above still raises through mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_data_parallel_ranks_match_full_batch_gradient():
    """2 ranks x {8, 4, 2} microbatches of {1, 2, 4}: each equals 1 rank x 1 of 8."""
    torch.manual_seed(0)
    model = TinyLM().double()
    batch = make_global_batch()
    batch["loss_mask"] = batch["loss_mask"].double()
    ref, _ = reference_grads(model, batch)
    with tempfile.TemporaryDirectory() as tmp:
        # One spawn for all cases: starting processes dominates the cost of this test.
        mp.spawn(_ddp_worker, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        for micro_batch_size in DDP_MICRO_BATCH_SIZES:
            for rank in range(2):
                got = torch.load(os.path.join(tmp, f"grads_{micro_batch_size}_{rank}.pt"))
                for name in ref:
                    torch.testing.assert_close(
                        got[name], ref[name], rtol=1e-10, atol=1e-12,
                        msg=f"micro batch {micro_batch_size}, rank {rank}, {name}",
                    )
