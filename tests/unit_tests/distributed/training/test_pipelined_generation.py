"""Generation over pipeline stages (tools/generate.py's build_generation_model, which wraps a
stage in PipelinedModel) at PP = the world size (2 or 4 ranks; 4 layers): a checkpoint saved
by the pipeline stages, loaded at the same PP, gives the greedy tokens (and a seeded top-k
sample) of the whole model (PP=1) loaded from the same checkpoint, and of the model it was
saved from; and tools/generate.py's command at that PP prints the one-process sample."""

import copy

import torch
import torch.distributed as dist

from _trainer_models import gpt_provider, trainer_args

from megatron.core import parallel_state
from megatron.core.models.gpt import generate
from megatron.training.checkpointing import save_checkpoint
from pretrain_gpt import model_provider
from tools import generate as generate_tool
from tools.generate import _for_generation, build_generation_model

WORLD = dist.get_world_size()
PROMPT = torch.tensor([[5, 17, 3], [40, 2, 77]])
NEW_TOKENS = 8


def sample(model):
    """(greedy, seeded top-k) continuations."""
    greedy = generate(model, PROMPT, NEW_TOKENS)
    sampled = generate(model, PROMPT, NEW_TOKENS, top_k=5, temperature=2.0,
                       generator=torch.Generator().manual_seed(7))
    return greedy, sampled


def test_pipelined_generation_gives_the_tokens_of_the_whole_model(tmp_path):
    path = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # rank 0's directory on every rank
    args = trainer_args("gpt2", "--num-layers", "4", "--pipeline-model-parallel-size", str(WORLD))
    args.save = path[0]
    torch.manual_seed(3)
    whole = gpt_provider(_for_generation(copy.deepcopy(args), 1)).eval()  # the same weights on every rank
    expected = sample(whole)

    parallel_state.destroy_model_parallel()
    state = parallel_state.initialize_model_parallel(1, 1, "cpu", pipeline_model_parallel_size=WORLD)
    try:
        stage = model_provider(args, pre_process=state.is_first_stage, post_process=state.is_last_stage)
        weights = dict(whole.named_parameters())  # names are global: layer i is layer i on its stage
        with torch.no_grad():
            for name, param in stage.named_parameters():
                param.copy_(weights[name])
        save_checkpoint(1, stage, None, None, args)
        model, iteration = build_generation_model(_for_generation(copy.deepcopy(args), WORLD), f"{path[0]}/iter_0000001",
                                                  torch.device("cpu"))
        assert iteration == 1 and type(model).__name__ == ("PipelinedModel" if WORLD > 1 else "GPTModel")
        pipelined = sample(model)
    finally:
        parallel_state.destroy_model_parallel()
    one_stage, _ = build_generation_model(_for_generation(copy.deepcopy(args), 1), f"{path[0]}/iter_0000001",
                                          torch.device("cpu"))
    for got, one, want in zip(pipelined, sample(one_stage), expected):
        assert got.shape == (2, 3 + NEW_TOKENS)
        assert torch.equal(got, one) and torch.equal(got, want)


def test_generate_tool_at_pp_prints_the_one_process_sample(tmp_path, capsys, monkeypatch):
    """tools/generate.py itself (under torchrun: --pipeline-model-parallel-size = the world)
    prints rank 0's text, the same as the one-process command on the same checkpoint."""
    path = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    args = trainer_args("gpt2", "--num-layers", "4")
    args.save = path[0]
    torch.manual_seed(3)
    save_checkpoint(2, gpt_provider(args), None, None, args)  # the whole model, saved by every rank
    argv = ["--load", path[0], "--prompt", "1 2 3", "--max-new-tokens", "6"]
    assert generate_tool.main(argv + ["--pipeline-model-parallel-size", str(WORLD)]) == 0
    pipelined = capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "1")  # the one-process command (every rank runs it)
    assert generate_tool.main(argv) == 0
    one = capsys.readouterr().out
    if dist.get_rank() == 0:
        text = lambda out: out.split("-" * 80)[1]
        assert text(pipelined) == text(one) and len(text(one).split()) > 3, (pipelined, one)
        assert f"{WORLD} pipeline stages" in pipelined or WORLD == 1
    else:
        assert pipelined == ""
