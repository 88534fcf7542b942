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


def _every_kind(docs):
    """One of each composition over ``docs`` (documents with a token list "t")."""
    return {
        "concat": tg.concat([docs, docs]),
        "select": docs.select([3, 0, 2]),
        "split": tg.split(docs, {"a": 0.5, "b": 0.5})["a"],
        "windows": docs.windows("t", 4, index_dir=None, progress=False),
        "pack": docs.windows("t", 4, mode="pack", index_dir=None, progress=False),
        "filter": tg.Dataset(docs.source).filter(lambda r: True, index_dir=None, progress=False),
        "mix": tg.mix([docs, docs]),
    }


def test_every_kind_of_composition_states_its_children_and_is_walked_through_them(tmp_path):
    from torchgrain.compose.filter import identified
    from torchgrain.compose.view import Composed

    def kinds(cls):
        return {cls, *(k for sub in cls.__subclasses__() for k in kinds(sub))}

    built = _every_kind(tg.Dataset([{"t": np.arange(1, n + 1)} for n in (5, 7, 6, 9)]))
    found = {type(ds.source) for ds in built.values()}
    package = {k for k in kinds(Composed) if k.__module__.startswith("torchgrain.")}
    assert package - {k for k in package if k.__abstractmethods__} <= found
    for what, ds in built.items():
        assert isinstance(ds.source.children, tuple) and ds.source.children, what
        assert not identified(ds), what  # records held in memory, under every kind
    tg.write_parquet(({"t": list(range(n))} for n in (5, 7, 6, 9)), str(tmp_path / "d"))
    files = tg.Dataset(tg.ParquetSource(str(tmp_path / "d")))
    assert all(identified(ds) for ds in _every_kind(files).values())
    for what, ds in _every_kind(_noisy_documents()).items():
        if what in ("filter", "mix"):
            continue  # (refused when built)
        with pytest.raises(TypeError, match="random_map"):
            ds.filter(lambda r: True, index_dir=None, progress=False, num_workers=0)
