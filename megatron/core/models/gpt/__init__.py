"""GPT model, its size/FLOP formulas and a simple generator."""

from .generation import PipelinedModel, generate
from .gpt_model import GPTModel, OutputLayer
from .model_stats import flops_per_token, num_parameters

__all__ = ["GPTModel", "OutputLayer", "flops_per_token", "PipelinedModel", "generate", "num_parameters"]
