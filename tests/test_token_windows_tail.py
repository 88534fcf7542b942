"""The last concat window reads every document after it (its lengths checked too)."""

import numpy as np
import pytest

import torchgrain as tg
from tests._forged import forge_window_offsets
from torchgrain.errors import CorruptDataError


def test_the_last_window_with_bos_reads_the_documents_after_its_tokens():
    # bos + 4 tokens + eos, then bos + eos: one window of 4, document 1 past its labels.
    ds = tg.Dataset([{"t": np.arange(1, 5)}, {"t": np.zeros(0, np.int64)}])
    w = ds.windows("t", 4, bos=0, eos=9, index_dir=None)
    assert len(w) == 1
    assert w.source.pass_plan(np.array([0]))[2].tolist() == [0, 1]
    (got,) = w.__getitems__([0])
    assert got["input_ids"].tolist() == [0, 1, 2, 3]
    assert got["labels"].tolist() == [1, 2, 3, 4]
    assert got["document_ids"].tolist() == [0, 0, 0, 0]
    assert got["cu_seqlens"].tolist() == [0, 4]


@pytest.mark.parametrize("mode", ["concat", "pack"])
def test_an_index_file_that_leaves_no_window_has_its_documents_checked(tmp_path, mode):
    docs = [np.arange(1, 5), np.arange(10, 13), np.arange(20, 30)]  # 4 + 3 + 10 tokens
    ds = tg.Dataset([{"t": t} for t in docs])
    # A well-formed file that says the documents hold 2 tokens in all: no concat window
    # (a pack window of documents 0 to 2).
    forge_window_offsets(ds, tmp_path, [0, 1, 2, 2], 2)
    with pytest.raises(CorruptDataError, match="document 0 "):
        w = ds.windows("t", 4, mode=mode, index_dir=tmp_path)
        w.__getitems__(list(range(len(w))))


def test_documents_too_short_for_a_window_are_read_and_give_none():
    w = tg.Dataset([{"t": np.arange(2)}, {"t": None}]).windows("t", 4, index_dir=None)
    assert len(w) == 0
