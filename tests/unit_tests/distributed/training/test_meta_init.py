"""Meta-device build and world-size-invariant initialization through the trainer's builder.

Run at 1, 2 and 4 gloo ranks. The reference is always a single-process model built
plainly and initialized with the same seed, so weights equal to it bitwise at every
world size are the same weights whatever the world size.
"""

import ctypes
import gc

import pytest
import torch
import torch.distributed as dist

from _trainer_models import ARCHS, batches, full_weights, gpt_provider, provider_with_buffers, trainer_args
from megatron.core.distributed.mfsdp_v2 import FsdpModule
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.core.transformer.initialization import initialize_parameters_, parameter_seed
from megatron.training.model_builder import build_model, build_optimizer, parameters_on_meta

CPU = torch.device("cpu")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def reference_model(provider, args):
    model = provider(args)
    initialize_parameters_(model, args.seed)
    return model


def assert_weights_equal(model, reference):
    expected = dict(reference.named_parameters())
    got = full_weights(model)
    assert got.keys() == expected.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=name)


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def train_losses(built, args, steps=3):
    """Global-batch losses of ``steps`` optimizer steps (the same on every rank)."""
    optimizer, _ = build_optimizer(args, built)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = args.global_batch_size // world
    losses = []
    for batch in batches(steps, args.micro_batch_size, args.global_batch_size, args.seq_length, 96):
        mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
        mbs = [{k: v[i:i + args.micro_batch_size] for k, v in mine.items()}
               for i in range(0, per_rank, args.micro_batch_size)]
        optimizer.zero_grad()
        reports = forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, len(mbs), context=built.context)
        report = torch.stack([r["lm loss"] for r in reports]).sum(0)
        dist.all_reduce(report)
        losses.append((report[0] / report[1]).item())
        optimizer.step()
    return losses


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_meta_build_equals_cpu_build_bitwise(arch):
    """Weights, non-parameter buffers and the first 3 losses: a meta build is a CPU build."""
    args_meta = trainer_args(arch, "--use-mfsdp")
    args_cpu = trainer_args(arch, "--use-mfsdp", "--no-init-model-with-meta-device")
    assert args_meta.init_model_with_meta_device and not args_cpu.init_model_with_meta_device
    meta = build_model(provider_with_buffers, args_meta, CPU)
    cpu = build_model(provider_with_buffers, args_cpu, CPU)
    reference = reference_model(provider_with_buffers, args_cpu)

    assert_weights_equal(meta.model, reference)
    assert_weights_equal(cpu.model, reference)
    for built in (meta, cpu):
        buffers = dict(built.model.named_buffers())
        assert sorted(buffers) == ["causal_mask", "decoder.layers.0.self_attention.inv_freq"]
        for name, expected in reference.named_buffers():
            assert not buffers[name].is_meta
            torch.testing.assert_close(buffers[name], expected, rtol=0, atol=0, msg=name)

    losses_meta = train_losses(meta, args_meta)
    losses_cpu = train_losses(cpu, args_cpu)
    assert losses_meta == losses_cpu  # bitwise
    assert losses_meta[2] < losses_meta[0]  # it trains


STRATEGIES = [
    ("ddp", []),
    ("zero1", ["--use-mfsdp", "--data-parallel-sharding-strategy", "optim"]),
    ("zero2", ["--use-mfsdp", "--data-parallel-sharding-strategy", "optim_grads"]),
    ("zero3", ["--use-mfsdp"]),
    ("zero3-cpu-build", ["--use-mfsdp", "--no-init-model-with-meta-device"]),
    ("hsdp", ["--use-mfsdp", "--num-distributed-optimizer-instances", "2"]),
    ("hfsdp", ["--use-mfsdp", "--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]),
]


@pytest.mark.parametrize("name, flags", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_initial_weights_do_not_depend_on_world_size_or_strategy(name, flags):
    if name in ("hsdp", "hfsdp") and dist.get_world_size() % 2:
        flags = ["--use-mfsdp"]  # a world of one has no 2 instances; plain ZeRO-3 stands in
    args = trainer_args("llama", *flags)
    built = build_model(gpt_provider, args, CPU)
    assert built.use_mfsdp == ("--use-mfsdp" in flags)
    assert_weights_equal(built.unwrapped, reference_model(gpt_provider, args))


def test_init_follows_megatron_distributions():
    args = trainer_args("gpt2", "--num-layers", "8", "--hidden-size", "128", world_size=1)
    model = reference_model(gpt_provider, args)
    std = args.init_method_std
    layer = model.decoder.layers[3]
    for weight, expected in ((layer.self_attention.linear_qkv.weight, std), (layer.mlp.linear_fc1.weight, std),
                             (layer.self_attention.linear_proj.weight, std / 4), (layer.mlp.linear_fc2.weight, std / 4),
                             (model.embedding.word_embeddings.weight, std)):
        assert abs(weight.std().item() / expected - 1) < 0.05 and abs(weight.mean().item()) < expected / 20
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.input_layernorm.bias == 0)
    assert torch.all(layer.self_attention.linear_qkv.bias == 0)
    # Each parameter has its own stream: equal shapes, different values; another seed, other values.
    assert not torch.equal(model.decoder.layers[0].mlp.linear_fc1.weight, layer.mlp.linear_fc1.weight)
    assert parameter_seed(args.seed, "a.weight") != parameter_seed(args.seed + 1, "a.weight")


def test_provider_that_reads_parameters_names_the_flag():
    def reads_a_parameter(args):
        model = gpt_provider(args)
        print(model.decoder.final_layernorm.weight[0].item())
        return model

    args = trainer_args("gpt2", "--use-mfsdp")
    with pytest.raises(RuntimeError, match="--no-init-model-with-meta-device"):
        build_model(reads_a_parameter, args, CPU)
    args_off = trainer_args("gpt2", "--use-mfsdp", "--no-init-model-with-meta-device")
    assert isinstance(build_model(reads_a_parameter, args_off, CPU).model, FsdpModule)


def test_meta_buffer_is_refused_before_wrapping():
    def meta_buffer(args):
        model = gpt_provider(args)
        model.register_buffer("causal_mask", torch.empty(4, 4, device="meta"))
        return model

    with pytest.raises(ValueError, match="buffer 'causal_mask' was created on the meta device"):
        build_model(meta_buffer, trainer_args("gpt2", "--use-mfsdp"), CPU)


def test_parameters_on_meta_keeps_buffers_and_restores_registration():
    with parameters_on_meta():
        layer = torch.nn.Linear(4, 4)
        layer.register_buffer("table", torch.arange(3.0))
    assert layer.weight.is_meta and layer.bias.is_meta and layer.weight.requires_grad
    assert torch.equal(layer.table, torch.arange(3.0))
    assert not torch.nn.Linear(2, 2).weight.is_meta


def _peak_rss_delta(fn):
    """(result, peak resident bytes above the start) of fn() in this process."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    start = status("VmRSS")
    result = fn()
    return result, status("VmHWM") - start


def test_meta_build_holds_only_shards_plus_one_unit():
    """A rank's peak during a meta build is its persistent shards (ZeRO-3: main weights
    and main grads, 2/N of the model) plus about one unit; a CPU build first holds the
    whole model."""
    # Freed blocks go back to the OS at once, so the resident high-water mark is the
    # peak of live memory rather than of what glibc kept for reuse.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    flags = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048").split()
    build_model(gpt_provider, trainer_args("gpt2", "--use-mfsdp"), CPU)  # one-time lazy setup off the books
    args = trainer_args("gpt2", "--use-mfsdp", *flags)
    layer_bytes = 4 * (12 * 512 * 512 + 9 * 512 + 2048)
    full_bytes = 8 * layer_bytes
    built, peak = _peak_rss_delta(lambda: build_model(gpt_provider, args, CPU))
    persistent = sum(built.context.persistent_bytes().values())
    assert peak <= persistent + 2 * layer_bytes + (8 << 20), (peak, persistent, layer_bytes)
    del built
    gc.collect()  # the first model is garbage now: freed here, not in the middle of the next measurement
    args_cpu = trainer_args("gpt2", "--use-mfsdp", "--no-init-model-with-meta-device", *flags)
    _, peak_cpu = _peak_rss_delta(lambda: build_model(gpt_provider, args_cpu, CPU))
    assert peak_cpu >= full_bytes
    if dist.get_world_size() >= 4:
        assert peak < 0.75 * full_bytes and peak < 0.6 * peak_cpu, (peak, peak_cpu, full_bytes)
