"""Tiny GPT-2- and Llama-style models at any TP size, and the parallel states of the tests.

A model at TP size T is built from the same seed as the single-process reference
(``initialize_parameters_``: each TP piece is cut from the same global tensor), so
comparing a rank's piece with ``global_slices[name].take(reference)`` needs no gather
over TP.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from _dist_helpers import full_tensors, kept_groups, make_optimizer, module_cache, wrap

from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard_optimizer, microbatch
from megatron.core.global_slices import global_slices_of
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import clip_grad_norm
from megatron.core.parallel_state import ParallelState, build_parallel_state
from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads, tensor_parallel_parameters
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_

SEED = 11
VOCAB, UNPADDED_VOCAB, SEQ = 64, 60, 8
ROWS, MICROBATCHES = 4, 2  # global microbatch rows (a multiple of every DP size here), microbatches per step
MAX_NORM = 0.5  # below the gradient norms: clipping is active

ARCHITECTURES = {
    # GPT-2: LayerNorm, GELU, biases, learned positions, tied embeddings, padded vocabulary.
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
    # Llama: RMSNorm, SwiGLU, GQA (8 heads in 4 groups), RoPE, no biases, untied output.
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                  normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                  position_embedding_type="rope"),
}

PLACEMENTS = {"zero3": lambda: Placements.zero3("dp"), "zero2": lambda: Placements.zero2("dp"),
              "zero1": lambda: Placements.zero1("dp"), "no_shard": lambda: Placements.no_shard("dp"),
              "hsdp": lambda: Placements.hsdp("outer", "inner"), "hfsdp": lambda: Placements.hfsdp("outer", "inner")}
HYBRID = ("hsdp", "hfsdp")  # on the ("outer", "inner") DP axes

_STATES: Dict[Tuple[int, int], ParallelState] = module_cache()


def parallel_state(tp: int, dp_outer: int = 1) -> ParallelState:
    """The mesh for (TP, outer DP) over the whole world (built once per test module: meshes
    create groups)."""
    key = (tp, dp_outer)
    if key not in _STATES:
        with kept_groups():
            _STATES[key] = build_parallel_state(tp, dp_outer, "cpu")
    return _STATES[key]


def build_gpt(arch: str, state: ParallelState = None, sequence_parallel: bool = False) -> GPTModel:
    tp = 1 if state is None else state.tp_size
    config = TransformerConfig(**ARCHITECTURES[arch], tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel, tp_group=None if tp == 1 else state.tp_group)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, unpadded_vocab_size=UNPADDED_VOCAB,
                     share_embeddings_and_output_weights=arch == "gpt2")
    initialize_parameters_(model, SEED)
    return model


def token_batch(generator: torch.Generator, rows: int):
    ids = torch.randint(0, UNPADDED_VOCAB, (rows, SEQ), generator=generator)
    labels = torch.randint(0, UNPADDED_VOCAB, (rows, SEQ), generator=generator)
    return ids, labels


def wrap_tp(model, state: ParallelState, strategy: str):
    """Every layer and the root as units over the DP sub-mesh; (context, SGD optimizer)."""
    ctx = wrap(model, units=list(model.decoder.layers) + [model], mesh=state.dp_mesh,
               placements=PLACEMENTS[strategy]())
    return ctx, fully_shard_optimizer(make_optimizer("sgd", model.parameters()))


def assert_pieces_match(model, reference, rtol=1e-4, atol=2e-5):
    """Every rank's piece of every weight (unsharded over DP here) equals its slice of the
    reference's weight; every rank calls it."""
    pieces = list(named_pieces(model))
    fulls = full_tensors([param for _, _, _, param in pieces])
    ref = dict(reference.named_parameters())
    for (name, module, attr, _), full in zip(pieces, fulls):
        torch.testing.assert_close(full, reference_piece(ref[name].detach(), module, attr), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def global_batches(steps: int, seed: int = 5):
    """``steps`` lists of ``MICROBATCHES`` global (ids, labels) microbatches."""
    generator = torch.Generator().manual_seed(seed)
    return [[token_batch(generator, ROWS) for _ in range(MICROBATCHES)] for _ in range(steps)]


def train_reference(reference, optimizer, batches):
    """The single-process reference: each step on the whole global batch, torch's clipping."""
    losses, norms = [], []
    for step in batches:
        optimizer.zero_grad()
        loss = reference(torch.cat([b[0] for b in step]), labels=torch.cat([b[1] for b in step])).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
        optimizer.step()
        losses.append(loss.detach())
    return losses, norms


def train_parallel(model, ctx, optimizer, state: ParallelState, sequence_parallel: bool, batches):
    """The trainer's step: each DP rank its rows (the same on every TP rank), the SP
    gradients summed over TP, the TP-aware clipping. Returns (losses, norms)."""
    split = tensor_parallel_parameters(model)
    losses, norms = [], []
    for step in batches:
        optimizer.zero_grad()
        total = torch.zeros(())
        for i, (ids, labels) in enumerate(step):
            rows = ids.shape[0] // state.dp_size
            mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
            with microbatch(ctx, is_last=i == len(step) - 1):
                loss = model(ids[mine], labels=labels[mine]).mean() / len(step)
                loss.backward()
            total += loss.detach()
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp_group)
        norms.append(clip_grad_norm(list(model.parameters()), MAX_NORM, tensor_parallel_params=split,
                                    tp_group=state.tp_group))
        optimizer.step()
        dist.all_reduce(total, group=state.dp_group)
        losses.append(total / state.dp_size)
    return losses, norms


def check_training_and_checkpoint(model, reference, state: ParallelState, sequence_parallel: bool, tmp_path):
    """Two SGD steps of ``model`` (TP, ZeRO-3) and of the single-process ``reference`` on the
    same global batches: equal losses and clipped grad norms, each rank's pieces the
    reference's slices; then the saved checkpoint holds the reference's global tensors."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import MODEL_PREFIX, load_tensors, save_checkpoint
    from megatron.core.global_slices import global_slices_by_name

    batches = global_batches(2)
    ref_losses, ref_norms = train_reference(reference, make_optimizer("sgd", reference.parameters()), batches)
    ctx, opt = wrap_tp(model, state, "zero3")
    losses, norms = train_parallel(model, ctx, opt, state, sequence_parallel, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(ref_norms).float(), rtol=1e-4, atol=1e-6)
    assert all(float(n) > MAX_NORM for n in ref_norms), "clipping was not active; lower MAX_NORM"
    assert_pieces_match(model, reference)
    directory = [str(tmp_path)]
    dist.broadcast_object_list(directory, src=0)  # rank 0's directory on every rank
    save_checkpoint(model, opt, directory[0], process_group=dist.group.WORLD, pieces=global_slices_by_name(model))
    if dist.get_rank() == 0:
        names = [name for name, _ in reference.named_parameters()]
        loaded = load_tensors(directory[0], [MODEL_PREFIX + n for n in names])
        for name, param in reference.named_parameters():
            torch.testing.assert_close(loaded[MODEL_PREFIX + name], param.detach(), rtol=1e-5, atol=1e-6)


def named_pieces(model):
    """(name, module, attribute, parameter) of every parameter (tied ones once)."""
    seen = set()
    for module_name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{module_name}.{attr}" if module_name else attr), module, attr, param


def reference_piece(reference_tensor: torch.Tensor, module, attr: str) -> torch.Tensor:
    """This rank's piece of a reference (TP size 1) tensor."""
    piece = global_slices_of(module).get(attr)
    return reference_tensor if piece is None else piece.take(reference_tensor)


def tp_world_layouts():
    """(TP size, strategy) pairs that fit this world: TP > 1 whenever the world allows."""
    world = dist.get_world_size()
    layouts = []
    for tp in (2, 4):
        if world % tp == 0:
            layouts += [(tp, "zero3"), (tp, "zero1")]
            if world // tp >= 2:
                layouts.append((tp, "hsdp"))
    return layouts or [(1, "zero3"), (1, "zero1")]


def more_tp_layouts():
    """The other strategies with TP (fewer model variants)."""
    world = dist.get_world_size()
    if world == 1:
        return [(1, "zero2"), (1, "no_shard")]
    return [(2, "zero2"), (2, "no_shard")] + ([(2, "hfsdp")] if world // 2 >= 2 else [])
