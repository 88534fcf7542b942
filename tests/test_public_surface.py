"""The public surface: a short top level, topic namespaces, and every former name kept."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import torchgrain as tg

# torchgrain.__all__ before the namespaces: users wrote tg.NAME for each of these.
FORMER_TOP_LEVEL = [
    "Albumentations",
    "ArrayRecordSource",
    "BlockShuffleSampler",
    "CacheThrashWarning",
    "CorruptDataError",
    "CudaPrefetcher",
    "Dataset",
    "DatasetNotFoundError",
    "GlobalShuffleSampler",
    "LabelToIndex",
    "LoaderBinding",
    "MaskTokens",
    "ParquetSource",
    "RandomImageTransform",
    "ReadOptions",
    "RecordDecodeError",
    "RemoteIOError",
    "RenameKeys",
    "ResumableLoader",
    "SchemaMismatchError",
    "SelectKeys",
    "ShardIndex",
    "Source",
    "TFRecordSource",
    "ToTensor",
    "TorchgrainError",
    "UnsafePathError",
    "bind",
    "convert",
    "decode_image",
    "open",
    "record_rng",
    "register_codec",
    "stack_key",
    "stats",
    "timed",
    "unstack_key",
    "write_array_record",
    "write_parquet",
]

NAMESPACES = ["sources", "samplers", "transforms", "columns"]


def test_every_former_top_level_name_still_works_as_tg_name_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [n for n in FORMER_TOP_LEVEL if getattr(tg, n, None) is None]
    assert missing == []


def test_the_top_level_all_is_short_and_names_the_namespaces():
    assert len(tg.__all__) < len(FORMER_TOP_LEVEL)
    assert set(NAMESPACES) <= set(tg.__all__)
    for name in tg.__all__:
        assert getattr(tg, name) is not None, name
    # Helpers and per-topic names live in their namespaces now.
    assert "ToTensor" not in tg.__all__ and "ShardIndex" not in tg.__all__


@pytest.mark.parametrize("name", NAMESPACES)
def test_each_namespace_exports_its_all_and_shows_an_example(name):
    module = getattr(tg, name)
    assert module is importlib.import_module(f"torchgrain.{name}")
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)
    assert ">>>" in (module.__doc__ or "")


def test_the_namespaces_hold_the_extension_points():
    assert tg.sources.open is tg.open and tg.sources.ShardedSource.__name__ == "ShardedSource"
    assert {"register_format", "Format", "ReadOptions", "register_codec"} <= set(tg.sources.__all__)
    assert {"ResumableSampler", "Split", "KeyedPermutation", "GlobalShuffleSampler"} <= set(
        tg.samplers.__all__
    )
    assert tg.samplers.GlobalShuffleSampler is tg.GlobalShuffleSampler
    assert set(tg.columns.__all__) >= {"ColumnBatch", "Ragged"}
    assert tg.transforms.ToTensor is tg.ToTensor


def test_importing_torchgrain_and_its_sources_namespace_does_not_import_torch():
    code = "import sys, torchgrain as tg; tg.sources.open; tg.columns.ColumnBatch; "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_write_array_record_and_convert_record_a_key_first_seen_late(tmp_path):
    # Record 500 alone has "extra": both writers sample the schema by the same rule.
    records = [{"x": i} for i in range(1200)]
    records[500]["extra"] = "late"
    written = tmp_path / "written"
    tg.write_array_record(records, written, num_shards=2)
    converted = tg.convert(str(written), str(tmp_path / "converted"), num_shards=1)
    from torchgrain.formats.manifest import read_manifest
    from torchgrain.io.fs import get_filesystem

    manifest = read_manifest(*get_filesystem(str(written)))
    assert manifest is not None
    assert manifest.schema["extra"] == converted.schema["extra"] == "null|str"
