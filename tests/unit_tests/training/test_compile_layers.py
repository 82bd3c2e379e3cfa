"""--compile-layers in one process: the layers' forwards are really compiled (and only
them), compile once, match eager; what cannot compile is refused at parse time. Also the
startup note on CPU when SDPA leaves its flash kernel."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.transformer.attention import cpu_fast_path_note
from megatron.training.arguments import parse_args
from megatron.training.model_builder import build_model

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 "
        "--hidden-dropout 0 --attention-dropout 0 --seed 3 --normalization RMSNorm "
        "--position-embedding-type rope --swiglu --disable-bias-linear")


def parse(extra=""):
    args = parse_args((BASE + " " + extra).split(), world_size=1, cuda_available=False)
    args.padded_vocab_size = 128
    return args


def build(extra=""):
    from pretrain_gpt import model_provider  # the trainer's own provider; a root script, imported on use

    model = build_model(model_provider, parse(extra), torch.device("cpu")).model
    model.train()
    return model


def loss_and_grads(model, tokens):
    logits = model(tokens[:, :-1], torch.arange(16).expand(2, 16), None)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_flag_defaults_to_inductor_and_names_its_backend():
    assert parse().compile_layers is None
    assert parse("--compile-layers").compile_layers == "inductor"
    assert parse("--compile-layers aot_eager").compile_layers == "aot_eager"


@pytest.mark.parametrize("extra, message", [
    ("--num-experts 2", "does not support MoE layers"),
    ("--recompute-granularity selective --recompute-modules layernorm core_attn",
     "cannot compile --recompute-modules layernorm"),
])
def test_what_does_not_compile_is_refused_at_parse_time(extra, message):
    with pytest.raises(ValueError, match=message):
        parse(f"--compile-layers {extra}")
    parse(extra)  # accepted without the flag


def test_context_parallelism_is_refused():
    with pytest.raises(ValueError, match="does not support --context-parallel-size > 1"):
        parse_args((BASE + " --compile-layers --context-parallel-size 2").split(), world_size=2, cuda_available=False)


def test_layer_forwards_compile_once_and_match_eager():
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.compiler.reset()
    compiled = build("--compile-layers aot_eager")
    # Compiling is refused under this stance: the layers' forwards are torch.compile'd.
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="Detected recompile"):
        compiled(tokens[:, :-1], torch.arange(16).expand(2, 16), None)
    got = [loss_and_grads(compiled, tokens)]
    compiled.zero_grad()
    with torch.compiler.set_stance("fail_on_recompile"):  # both layers, the second step: no new graph
        got.append(loss_and_grads(compiled, tokens))
    expected_loss, expected_grads = loss_and_grads(build(), tokens)
    for loss, grads in got:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # Only the layers: the root (embedding, output layer) runs eagerly.
    assert "forward" not in vars(compiled) and all("forward" in vars(layer) for layer in compiled.decoder.layers)


@pytest.mark.filterwarnings("ignore:.*(kernel|dropout)")  # torch says why the flash kernel declined
def test_cpu_note_when_sdpa_leaves_its_flash_kernel():
    assert cpu_fast_path_note(0.0, "auto") is None and cpu_fast_path_note(0.0, "flash") is None
    assert "pass --attention-dropout 0 for the fast kernel" in cpu_fast_path_note(0.1, "auto")
    assert "pass --attention-backend auto" in cpu_fast_path_note(0.0, "unfused")
    # The fact behind the note: on CPU the flash kernel takes no dropout (a mask it does take).
    q = k = v = torch.randn(1, 2, 8, 4)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril())
        with pytest.raises(RuntimeError, match="No available kernel"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
