"""torchtitan 0.3.0 on CPU/gloo, for the peer benchmark (``benchmarks/torchtitan_peer.py``).

Runs under ``torch.distributed.run`` with the interpreter of torchtitan's own virtual
environment (``.venv-titan``; ``torchtitan_peer.py --setup-venv`` creates it), never the
project's. Nothing here is imported by the project: every adjustment that torchtitan needs
on a CPU-only box is made at run time in this file, through torchtitan's own config objects
where they allow it:

* device: ``torchtitan.tools.utils`` picks ``device_type = "cuda"`` when no accelerator
  exists; its ``device_type`` / ``device_module`` are set to CPU before any other torchtitan
  module reads them (they are imported by name elsewhere, hence first).
* attention: the Llama config's inner attention is FlexAttention, which has no CPU backward;
  each layer's ``inner_attention`` config is replaced by ``ScaledDotProductAttention.Config()``
  (causal, the same attention as the project's trainer, which does not mask per document).
* gradient reduction: torchtitan sets FSDP2's gradient divide factor to 1.0 (it divides by
  the global token count itself), which makes FSDP2 reduce with ``PREMUL_SUM``; gloo has
  none. FSDP2's public ``set_force_sum_reduction_for_comms(True)`` on every FSDP module makes
  it a plain sum followed by a multiply by 1.0: exact.
* SPMD backend: ``parallelism.spmd_backend = "partial_dtensor"`` (torch 2.13).
* timeouts: after the first step torchtitan calls ``torch.distributed.set_timeout``, which
  torch 2.13 lacks; torchtitan's ``set_pg_timeouts`` is replaced by a barrier (the timeout
  only matters for hung collectives, which a benchmark of a few steps does not wait out).
* data: a token file (``.npy``, ``[samples, seq + 1]`` int32, written by the peer benchmark
  from the project's own Shakespeare dataset in the order the project's trainer reads it);
  rank ``r`` of ``n`` takes samples ``step * b * n + r * b ... + b - 1`` of every step,
  which is Megatron's pretraining sampler. Positions are ``0 .. seq - 1`` (no per-document
  reset: the project's default).

Initial weights: ``--save-initial-hf DIR`` writes torchtitan's initial weights (its seeded
init) as a Hugging Face Llama directory through torchtitan's own ``Llama3StateDictAdapter``
(which turns its complex-RoPE row order into Hugging Face's) and exits; ``--load-initial-hf
DIR`` starts from such a directory instead (torchtitan's adapter back, its own merge of
``wq``/``wk``/``wv`` into the fused ``wqkv``, each rank keeping its shard). The peer
benchmark's ``--init torchtitan`` starts both trainers from the one directory.

Per step the launcher records the wall time of ``train_step`` (barrier before it, as the
project's benchmarks do) and torchtitan's logged global loss; at the end each rank's peak
RSS (``ru_maxrss``). Rank 0 writes them to ``--out`` (JSON).

With ``--profile-dir`` (``benchmarks/profile_vs_torchtitan.py``) rank 0 records steps
``--profile-step-start`` .. ``--profile-step-end - 1`` (0-based, as the project's
``--profile-step-start/-end``) with the PyTorch profiler, each step one ``iteration <n>``
range, its phases in the ranges the project's trainer opens (``step/data``,
``step/forward``, ``step/loss``, ``step/backward``, ``step/optimizer``, ``step/logging``).
torchtitan opens no profiler ranges of its own, so :class:`PhaseRanges` opens them from
outside, at the calls between its phases: the batches read from the data iterator, a forward
pre-hook on the model, the loss function (the trainer's ``loss_fn`` attribute; the backward
starts when it returns), ``clip_grad_norm_`` (the optimizer phase starts there), and the loss
all-reduce or the metrics log (the logging phase).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time

import torch

import torchtitan.tools.utils as titan_utils


class CpuDeviceModule:
    """What torchtitan calls on its ``device_module`` (``torch.cuda`` by default), for the CPU:
    one device, no caching allocator (memory stats empty: torchtitan then logs -1), the
    machine's RAM as the device's capacity."""

    class Properties:
        name = "cpu"
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    set_device = staticmethod(torch.cpu.set_device)
    current_device = staticmethod(torch.cpu.current_device)
    synchronize = staticmethod(torch.cpu.synchronize)

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @classmethod
    def get_device_properties(cls, device=None):
        return cls.Properties()

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass


# CPU before torchtitan's other modules import device_type / device_module by name.
titan_utils.device_type = "cpu"
titan_utils.device_module = CpuDeviceModule

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

import torchtitan.distributed.utils as titan_dist_utils  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.common.attention import FusedQKVLinear, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402


class TokenFileDataset(IterableDataset):
    """This rank's samples of a ``[samples, seq + 1]`` token file, in Megatron's sampler order."""

    def __init__(self, path: str, dp_rank: int, dp_size: int, batch: int, seq_len: int):
        self.tokens = np.load(path, mmap_mode="r")
        if self.tokens.shape[1] != seq_len + 1:
            raise ValueError(f"{path} holds sequences of {self.tokens.shape[1] - 1} tokens, the run needs {seq_len}.")
        self.dp_rank, self.dp_size, self.batch, self.seq_len = dp_rank, dp_size, batch, seq_len

    def __iter__(self):
        chunk = self.batch * self.dp_size
        positions = torch.arange(self.seq_len)
        for start in range(0, len(self.tokens) - chunk + 1, chunk):
            for i in range(start + self.dp_rank * self.batch, start + (self.dp_rank + 1) * self.batch):
                sample = torch.from_numpy(np.asarray(self.tokens[i], dtype=np.int64))
                yield {"input": sample[:-1], "positions": positions}, sample[1:]


class TokenFileDataLoader(ParallelAwareDataloader):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, **kwargs):
        dataset = TokenFileDataset(config.dataset_path, dp_rank, dp_world_size, local_batch_size, seq_len)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)


def model_config(dim: int, layers: int, heads: int, vocab: int):
    """torchtitan's Llama-3 config (as its "debugmodel" flavor builds it) at another size,
    with SDPA attention and plain RoPE (base 500000, no Llama-3.1 frequency scaling: the
    project's trainer has none)."""
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="none"),
            attn_backend="flex"),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def hf_config(opts) -> dict:
    """The Hugging Face ``LlamaForCausalLM`` config of the launcher's model (what the
    project's converter reads to import the weights)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": opts.dim,
            "intermediate_size": compute_ffn_hidden_dim(opts.dim, multiple_of=256),
            "num_hidden_layers": opts.layers, "num_attention_heads": opts.heads,
            "num_key_value_heads": opts.heads, "head_dim": opts.dim // opts.heads, "vocab_size": opts.vocab,
            "max_position_embeddings": opts.seq_len, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32"}


def save_initial_hf(trainer, opts) -> None:
    """Write torchtitan's initial weights as a Hugging Face Llama directory (rank 0), through
    torchtitan's own state-dict adapter (which undoes its complex-RoPE row order)."""
    from safetensors.torch import save_file

    state = {}
    for part in trainer.model_parts:
        for name, tensor in part.state_dict().items():  # the fused wqkv comes out as wq / wk / wv
            state[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    if dist.get_rank() == 0:
        adapter = Llama3StateDictAdapter(trainer.model_config, None)
        hf = {k: v.detach().contiguous().clone() for k, v in adapter.to_hf(state).items()}
        os.makedirs(opts.save_initial_hf, exist_ok=True)
        save_file(hf, os.path.join(opts.save_initial_hf, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(opts.save_initial_hf, "config.json"), "w") as f:
            json.dump(hf_config(opts), f, indent=1)
    dist.barrier()


def load_initial_hf(trainer, directory: str) -> None:
    """Replace torchtitan's initial weights by a Hugging Face Llama directory's (every rank
    reads the file and keeps its own shard of each parameter)."""
    from safetensors.torch import load_file

    adapter = Llama3StateDictAdapter(trainer.model_config, None)
    state = adapter.from_hf(load_file(os.path.join(directory, "model.safetensors")))
    for part in trainer.model_parts:
        for prefix, module in part.named_modules():
            if isinstance(module, FusedQKVLinear):  # wq / wk / wv -> wqkv, torchtitan's own merge
                FusedQKVLinear._merge_qkv_on_load(module, state, f"{prefix}.")
        names = dict(part.named_parameters())
        missing = sorted(set(names) - set(state))
        if missing:
            raise RuntimeError(f"{directory} lacks {missing[:3]}...: not this launcher's model")
        with torch.no_grad():
            for name, param in names.items():
                full = state[name].to(param.dtype)
                if tuple(full.shape) != tuple(param.shape):
                    raise RuntimeError(f"{name}: {tuple(full.shape)} in {directory}, {tuple(param.shape)} here")
                if isinstance(param, DTensor):
                    param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
                else:
                    param.copy_(full)


class CpuTrainer(Trainer):
    """torchtitan's Trainer, each train_step timed (after a barrier) and its loss kept; with a
    profile window, those steps recorded by the PyTorch profiler."""

    step_seconds: list
    losses: list
    phases: PhaseRanges
    profile_window: tuple = None  # (first, end) 0-based step indices, end excluded; rank 0 only
    profile_dir: str = None
    _profiler = None

    def train_step(self, data_iterator):
        dist.barrier()
        index = self.step - 1  # torchtitan counts steps from 1
        if self.profile_window is not None and index == self.profile_window[0]:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    record_shapes=True)  # as the project's --profile
            self._profiler.start()
        start = time.perf_counter()
        if self._profiler is not None:
            self.phases.enabled = True
            with torch.profiler.record_function(f"iteration {self.step}"):
                super().train_step(self.phases.ranged_batches(data_iterator))
                self.phases.close()
        else:
            super().train_step(data_iterator)
        self.step_seconds.append(time.perf_counter() - start)
        if self._profiler is not None and index == self.profile_window[1] - 1:
            self.phases.enabled = False
            self._profiler.stop()
            os.makedirs(self.profile_dir, exist_ok=True)
            self._profiler.export_chrome_trace(os.path.join(self.profile_dir, f"rank{dist.get_rank()}.trace.json"))
            self._profiler = None


def _barrier_only(timeout, parallel_dims):
    dist.barrier()


class PhaseRanges:
    """One open profiler range at a time, ``step/<phase>``: ``switch(phase)`` closes the open
    one and opens the next; ``close()`` ends the last. A no-op unless ``enabled``."""

    def __init__(self):
        self.enabled = False
        self._open = None

    def switch(self, phase: str) -> None:
        self.close()
        if self.enabled:
            self._open = torch.profiler.record_function(f"step/{phase}")
            self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def ranged_batches(self, data_iterator):
        """The same batches, each read inside a ``step/data`` range (nested in the open one)."""
        while True:
            with torch.profiler.record_function("step/data"):
                batch = next(data_iterator)
            yield batch

    def switching_to(self, phase: str, fn, then: str = None):
        """``fn``, switching to ``phase`` when it is called (and to ``then`` when it returns)."""
        def wrapped(*args, **kwargs):
            self.switch(phase)
            result = fn(*args, **kwargs)
            if then is not None:
                self.switch(then)
            return result
        return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", required=True, help=".npy token file [samples, seq + 1]")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory (tokenizer.json)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--local-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--compile", action="store_true", help="torchtitan's --compile.enable (model and loss)")
    parser.add_argument("--full-recompute", action="store_true",
                        help="torchtitan's full activation checkpointing (every block recomputed in backward)")
    parser.add_argument("--save-initial-hf", default=None,
                        help="write the initial weights as a Hugging Face Llama directory, then exit (no step)")
    parser.add_argument("--load-initial-hf", default=None,
                        help="start from a Hugging Face Llama directory's weights instead of torchtitan's init")
    parser.add_argument("--dump-folder", default="/tmp/titan_peer_outputs")
    parser.add_argument("--out", required=True, help="JSON result (rank 0)")
    parser.add_argument("--profile-dir", default=None, help="write rank 0's profiler trace of the window here")
    parser.add_argument("--profile-step-start", type=int, default=3, help="first profiled step (0-based)")
    parser.add_argument("--profile-step-end", type=int, default=5, help="the step after the last profiled one")
    opts = parser.parse_args()

    config = ConfigManager().parse_args([
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--parallelism.spmd-backend", "partial_dtensor",
    ])
    config.model_spec = dataclasses.replace(config.model_spec, model=model_config(opts.dim, opts.layers, opts.heads,
                                                                                     opts.vocab))
    config.hf_assets_path = opts.tokenizer
    config.dump_folder = opts.dump_folder
    config.dataloader = TokenFileDataLoader.Config(dataset_path=opts.tokens)
    config.training.local_batch_size = opts.local_batch_size
    config.training.seq_len = opts.seq_len
    config.training.steps = opts.steps
    config.training.dtype = "float32"
    config.training.mixed_precision_param = "float32"
    config.training.max_norm = 1.0
    config.optimizer = default_adamw(lr=opts.lr)  # betas (0.9, 0.95), eps 1e-8, weight decay 0.1
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0)  # constant LR
    config.activation_checkpoint = FullAC.Config() if opts.full_recompute else None
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.compile.enable = opts.compile
    config.debug.seed = 1234  # the same initial weights in every run (torchtitan draws a seed otherwise)

    titan_dist_utils.set_pg_timeouts = _barrier_only
    phases = PhaseRanges()
    if opts.profile_dir is not None:
        # torchtitan's calls between its phases (looked up on these modules at call time).
        titan_dist_utils.clip_grad_norm_ = phases.switching_to("optimizer", titan_dist_utils.clip_grad_norm_)
        titan_dist_utils.dist_sum = phases.switching_to("logging", titan_dist_utils.dist_sum)
    trainer = CpuTrainer(config)
    if opts.save_initial_hf is not None:
        save_initial_hf(trainer, opts)
        shut_down(trainer)
        return
    if opts.load_initial_hf is not None:
        load_initial_hf(trainer, opts.load_initial_hf)
    trainer.step_seconds = []
    trainer.phases = phases
    if opts.profile_dir is not None and dist.get_rank() == 0:
        trainer.profile_window = (opts.profile_step_start, opts.profile_step_end)
        trainer.profile_dir = opts.profile_dir
    if opts.profile_dir is not None:
        trainer.loss_fn = phases.switching_to("loss", trainer.loss_fn, then="backward")
        trainer.model_parts[0].register_forward_pre_hook(lambda module, args: phases.switch("forward"))
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    params = sum(p.numel() for part in trainer.model_parts for p in part.parameters())  # DTensors: global numel
    losses = []
    log = trainer.metrics_processor.log

    def keep_loss(step, global_avg_loss, *args, **kwargs):
        phases.switch("logging")  # already there after the loss all-reduce (dist_sum), unless one rank
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = keep_loss
    trainer.train()

    seconds = torch.tensor(trainer.step_seconds, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step's time is the slowest rank's
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rss)
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump({"params": params, "step_s": seconds.tolist(), "losses": losses,
                       "peak_rss_mb_per_rank": [float(x) for x in gathered]}, f, indent=1)
    shut_down(trainer)


def shut_down(trainer) -> None:
    """torchtitan's close, then the process group's, every rank in step: a rank that tore down
    while the other was still closing aborted in C++ at exit ("terminate called without an
    active exception", after its results were written) on the idle box."""
    dist.barrier()
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
