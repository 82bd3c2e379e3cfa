import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset, IndexedDatasetBuilder


@pytest.fixture
def write_dataset(tmp_path):
    """write_dataset(documents, dtype=np.int32, name="data") -> path prefix.

    ``documents`` is a list of token lists, one sequence per document (GPT layout).
    """

    def write(documents, dtype=np.int32, name="data"):
        prefix = str(tmp_path / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in documents:
            builder.add_item(np.asarray(doc))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        return prefix

    return write


@pytest.fixture
def labelled_documents():
    """Documents whose tokens say where they come from: doc d, position j -> d * 1000 + j.

    Lengths vary (including an empty document) so windows cross boundaries at many offsets.
    """
    lengths = [7, 1, 13, 0, 5, 22, 3, 9, 2, 17, 4, 11]
    return [[d * 1000 + j for j in range(n)] for d, n in enumerate(lengths)]


@pytest.fixture
def labelled_dataset(write_dataset, labelled_documents):
    return IndexedDataset(write_dataset(labelled_documents))
