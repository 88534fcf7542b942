"""The last concat window reads every document after it (its lengths checked too)."""

import numpy as np

import torchgrain as tg


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
