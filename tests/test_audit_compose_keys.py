"""A selection index is keyed by what the predicate computes, the same in every process:
another process, rank or run maps the file one of them built, with no pass of its own."""

from __future__ import annotations

import os
import textwrap

import torchgrain as tg
from tests._seeds import outputs_under_hash_seeds

_FILTER = textwrap.dedent(
    """
    import sys
    import torchgrain as tg
    ds = tg.Dataset(tg.ArrayRecordSource(sys.argv[1]))
    kept = ds.filter(lambda r: r["lang"] in {"en", "de", "fr", "es", "it", "pt"},
                     index_dir=sys.argv[2], num_workers=0, progress=False)
    print(kept.source.index.path)
    """
)


def test_processes_with_other_hash_seeds_share_one_selection(tmp_path):
    data, index_dir = str(tmp_path / "data"), str(tmp_path / "indexes")
    langs = ["en", "de", "xx", "fr", "es", "it", "pt", "zz"] * 4
    tg.write_array_record([{"lang": lang} for lang in langs], data)
    paths = outputs_under_hash_seeds(_FILTER, data, index_dir)
    assert len(paths) == 1, paths


_PUSHDOWN = textwrap.dedent(
    """
    import sys
    import pyarrow as pa, pyarrow.compute as pc
    import torchgrain as tg
    ds = tg.Dataset(tg.ParquetSource(sys.argv[1]))
    expr = pc.field("lang").isin(["en", "de", "fr"]) & (pc.field("x") < pa.scalar(0.5, pa.float32()))
    kept = ds.filter(expr, index_dir=sys.argv[2], progress=False)
    print(kept.source.index.path, len(kept))
    """
)


def test_processes_with_other_hash_seeds_share_one_pushed_down_selection(tmp_path):
    data, index_dir = str(tmp_path / "data"), str(tmp_path / "indexes")
    langs = ["en", "de", "xx", "fr"] * 4
    tg.write_parquet(({"lang": lang, "x": k / 16} for k, lang in enumerate(langs)), data)
    got = outputs_under_hash_seeds(_PUSHDOWN, data, index_dir)
    assert len(got) == 1 and got.pop().endswith(" 6"), got
    assert len([f for f in os.listdir(index_dir) if f.endswith(".tgindex")]) == 1


_FINGERPRINTS = textwrap.dedent(
    """
    import functools
    from torchgrain.sources.node_index.derived import callable_fingerprint

    def allowed(r, langs=frozenset()):
        return r["lang"] in langs

    def closure(langs):
        return lambda r: r["lang"] in langs

    class Keeps:
        def __init__(self):
            self.langs = {"tags": [{"en", "de", "fr"}, frozenset({("es", 1), ("it", 2)})]}

        def __call__(self, r):
            return r["lang"] in self.langs["tags"][0]

    print(
        callable_fingerprint(closure({"en", "de", "fr", "es", "it", "pt"})),
        callable_fingerprint(functools.partial(allowed, langs={"en", "de", "fr", "es"})),
        callable_fingerprint(Keeps()),
    )
    """
)


def test_sets_in_closures_partials_and_objects_fingerprint_alike_in_every_process():
    got = outputs_under_hash_seeds(_FINGERPRINTS, seeds="1234")
    assert len(got) == 1, got
