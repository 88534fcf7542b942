"""A selection's key differs for predicates that select differently, and is the same in
every process for one predicate: a predicate closing over a value that does not pickle,
and one closing over a dict built from a set."""

from __future__ import annotations

import textwrap
import threading

import numpy as np

import torchgrain as tg
from tests._seeds import outputs_under_hash_seeds

_LOCK = threading.Lock()


def _keep_ids(ids):
    cfg = {"ids": ids, "lock": _LOCK}  # the lock does not pickle: the key falls to repr()
    return lambda r: r["x"] in cfg["ids"]


def test_closures_over_arrays_differing_in_the_middle_get_their_own_selections(tmp_path):
    data, index_dir = str(tmp_path / "data"), str(tmp_path / "indexes")
    tg.write_array_record([{"x": k} for k in range(10)], data)
    ds = tg.Dataset(tg.ArrayRecordSource(data))
    a = np.arange(5000)
    b = a.copy()
    b[5] = -1  # elided by repr(): "[0, 1, 2, ..., 4997, 4998, 4999]" for both
    first = ds.filter(_keep_ids(a), index_dir=index_dir, num_workers=0, progress=False)
    second = ds.filter(_keep_ids(b), index_dir=index_dir, num_workers=0, progress=False)
    assert len(first) == 10
    assert sorted(r["x"] for r in second) == [0, 1, 2, 3, 4, 6, 7, 8, 9]


_DICT_FROM_SET = textwrap.dedent(
    """
    import sys
    import torchgrain as tg
    def make():
        langs = {"en", "de", "fr", "es", "it", "pt", "nl"}
        table = dict.fromkeys(langs, True)  # insertion order follows the hash seed
        return lambda r: table.get(r["lang"], False)
    ds = tg.Dataset(tg.ArrayRecordSource(sys.argv[1]))
    kept = ds.filter(make(), index_dir=sys.argv[2], num_workers=0, progress=False, name="langs")
    print(kept.source.index.path)
    """
)


def test_processes_share_the_selection_of_a_named_closure_over_a_dict_built_from_a_set(tmp_path):
    data, index_dir = str(tmp_path / "data"), str(tmp_path / "indexes")
    tg.write_array_record([{"lang": g} for g in ["en", "xx", "de", "fr"] * 4], data)
    paths = outputs_under_hash_seeds(_DICT_FROM_SET, data, index_dir)
    assert len(paths) == 1, paths
