"""The fine-tune command that `convert.py --to mfsdp` prints runs as printed (2 CPU ranks).

A tiny Hugging Face GPT-2 (tanh GELU, dropout, its own BPE tokenizer in the directory) is
imported; the printed command is run by bash exactly as printed, with only the run length
and a small corpus appended (later flags win), so every model flag it carries is checked
by the trainer's own parser and by loading the checkpoint into the model it builds.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
TIMEOUT = 300
TEXT = ("From fairest creatures we desire increase,\nThat thereby beauty's rose might never die,\n"
        "But as the riper should by time decease,\nHis tender heir might bear his memory:\n")


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tools.prepare_shakespeare import train_bpe_tokenizer
    from tools.preprocess_data import main as preprocess_main

    tmp = tmp_path_factory.mktemp("finetune")
    hf_dir = tmp / "hf"
    train_bpe_tokenizer([TEXT] * 4, 300, str(hf_dir))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                               resid_pdrop=0.05, embd_pdrop=0.05, attn_pdrop=0.0)).save_pretrained(str(hf_dir))
    with open(tmp / "docs.jsonl", "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": TEXT * (1 + i % 3)}) + "\n")
    assert preprocess_main(["--input", str(tmp / "docs.jsonl"), "--output-prefix", str(tmp / "docs"),
                            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir),
                            "--append-eod"]) == 0
    proc = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--input", str(hf_dir), "--to", "mfsdp",
                           "--output", str(tmp / "imported"), "--quiet"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return tmp, proc.stdout


def test_printed_command_runs_as_printed(imported):
    tmp, printed = imported
    assert "--openai-gelu" in printed and "--hidden-dropout 0.05" in printed and "--attention-dropout 0" in printed
    assert f"--tokenizer-model {tmp / 'imported' / 'iter_0000000' / 'tokenizer'}" in printed
    body = [line for line in printed.splitlines() if not line.startswith("#")]
    overrides = (f" --data-path {tmp / 'docs_text_document'} --train-iters 3 --lr-warmup-iters 1 --log-interval 1"
                 f" --eval-interval 3 --eval-iters 1 --split 90,10,0 --num-workers 0 --log-dir {tmp / 'logs'}")
    script = "\n".join(body) + overrides + "\n" + "\n".join(l for l in printed.splitlines() if l.startswith("#"))
    proc = subprocess.run(["bash", "-c", script.replace("python -m", f"{sys.executable} -m", 1)], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"loaded model weights from {tmp / 'imported' / 'iter_0000000'} (--finetune)" in proc.stdout
    assert "vocab size 300 padded to 384" in proc.stdout
    assert "iteration        3/       3" in proc.stdout
    assert os.path.isdir(tmp / "imported-finetuned" / "iter_0000003")
    records = [json.loads(line) for line in open(tmp / "logs" / "metrics.jsonl")]
    valid = [r for r in records if r["kind"] == "validation"]
    assert valid and valid[-1]["bits_per_character"] > 0
    assert "bits per character: " in proc.stdout
