import shutil

import pytest

from megatron.core.tokenizer import GPT2BPETokenizer, default_gpt2_vocab_files


@pytest.fixture(scope="session")
def gpt2_files():
    return default_gpt2_vocab_files()


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files):
    return GPT2BPETokenizer(*gpt2_files)


@pytest.fixture(scope="session")
def hf_gpt2_reference(tmp_path_factory, gpt2_files):
    """HuggingFace's (Rust) GPT-2 tokenizer built from the same real local files: an
    implementation independent of ours, and no hub access."""
    import transformers
    source = tmp_path_factory.mktemp("gpt2_files")
    shutil.copy(gpt2_files[0], source / "vocab.json")
    shutil.copy(gpt2_files[1], source / "merges.txt")
    return transformers.GPT2TokenizerFast.from_pretrained(str(source), local_files_only=True)


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory, hf_gpt2_reference):
    """A local directory holding a saved HuggingFace GPT-2 tokenizer."""
    saved = tmp_path_factory.mktemp("hf_gpt2")
    hf_gpt2_reference.save_pretrained(str(saved))
    return saved
