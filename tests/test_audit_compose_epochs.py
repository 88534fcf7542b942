"""What is found once (a filter's selection) is refused over records that change with
the epoch, wherever the change sits under the dataset: token windows included."""

from __future__ import annotations

import numpy as np
import pytest

import torchgrain as tg


def _noisy_documents():
    # Each epoch doubles some documents' tokens (their lengths stay: the windows' index
    # holds at every epoch), so a window's tokens change with the epoch.
    return tg.Dataset([{"t": np.arange(1, n + 1)} for n in (5, 7, 6, 9)]).random_map(
        lambda r, rng: {"t": r["t"] * int(rng.integers(1, 3))}, seed=0
    )


def test_a_filter_of_the_documents_themselves_is_refused():
    with pytest.raises(TypeError, match="random_map"):
        _noisy_documents().filter(lambda r: True, index_dir=None, progress=False)


def test_a_filter_of_windows_of_documents_that_change_with_the_epoch_is_refused():
    windows = _noisy_documents().windows("t", 4, index_dir=None, progress=False)
    with pytest.raises(TypeError, match="random_map"):
        kept = windows.filter(
            lambda r: r["input_ids"].max() > 7, index_dir=None, progress=False, num_workers=0
        )
        # What goes wrong otherwise: at another epoch the kept windows fail the predicate.
        for epoch in range(4):
            kept.set_epoch(epoch)
            assert all(r["input_ids"].max() > 7 for r in kept)


def test_a_filter_of_windows_of_records_in_memory_is_not_shared_through_the_cache(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    has_nine = lambda w: bool((w["input_ids"] == 9).any())  # noqa: E731
    # Two lists of one length, one token count per document: other tokens.
    for first in (9, 1):
        docs = tg.Dataset([{"t": np.array([first, 2, 3, 4])}, {"t": np.array([5, 6, 7, 8])}])
        windows = docs.windows("t", 2, progress=False)
        kept = windows.filter(has_nine, progress=False, num_workers=0)
        assert [has_nine(w) for w in kept] == [True] * len(kept)
