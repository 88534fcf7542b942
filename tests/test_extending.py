"""Extending torchgrain from another package: formats found through the
``torchgrain.formats`` entry-point group, and ``merge_schema`` for a source's schema.

A "package" here is a module and a dist-info folder (METADATA, entry_points.txt) in a
temporary directory put on the path: what pip would leave, without pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from torchgrain import errors
from torchgrain.sources import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JSONL_MODULE = """
import json
import os

import torchgrain as tg
from torchgrain.sources import Format, Source, merge_schema


class JsonLines(Source):
    def __init__(self, paths, **_):
        names = []
        for p in [paths] if isinstance(paths, str) else paths:
            names += sorted(os.path.join(p, n) for n in os.listdir(p)) if os.path.isdir(p) else [p]
        self.records, self._schema = [], {}
        for name in names:
            with open(name) as f:
                self.records += [json.loads(line) for line in f if line.strip()]
        for record in self.records:
            self._schema = merge_schema(self._schema, record)

    def __len__(self):
        return len(self.records)

    def __getitems__(self, indices):
        return [self.records[i] for i in tg.ShardIndex([len(self)]).check(indices).tolist()]

    keys = property(lambda self: list(self._schema))
    schema = property(lambda self: self._schema)


FORMAT = Format("jsonl", JsonLines, (".jsonl",), description="JSON lines", read_options=False)


def replace_parquet():
    return Format("parquet", JsonLines, (".parquet",))
"""


def install(where, dist: str, entry_points: dict[str, str]) -> None:
    """A distribution ``dist`` declaring ``entry_points`` in the torchgrain.formats group."""
    info = where / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[torchgrain.formats]\n{lines}")


@pytest.fixture
def plugins(tmp_path):
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "tg_jsonl.py").write_text(JSONL_MODULE)
    install(pkg, "tg_jsonl", {"jsonl": "tg_jsonl:FORMAT"})
    install(pkg, "tg_broken", {"broken": "tg_no_such_module:FORMAT"})
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.jsonl").write_text('{"id": 1, "text": "a"}\n{"id": 2}\n{"id": 3}\n')
    return pkg, data


def test_cli_reads_a_format_installed_as_a_plugin_and_skips_a_broken_one(plugins):
    pkg, data = plugins
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), ROOT]))
    env["NO_ALBUMENTATIONS_UPDATE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torchgrain", "inspect", str(data), "--format", "jsonl"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "jsonl" in proc.stdout and "3 in" in proc.stdout
    assert "null|str" in proc.stdout  # the schema merge_schema built
    # The broken plugin is named once, with its package and error; nothing crashed.
    assert proc.stderr.count("skipped format plugin 'broken'") == 1, proc.stderr
    assert "tg_broken" in proc.stderr and "tg_no_such_module" in proc.stderr


def test_a_plugin_is_loaded_once_and_cannot_replace_a_registered_format(plugins, monkeypatch):
    pkg, data = plugins
    install(pkg, "tg_override", {"override": "tg_jsonl:replace_parquet"})
    parquet = registry._FORMATS["parquet"]
    # As in a new process: nothing loaded, nothing warned; the formats restored after.
    monkeypatch.setattr(registry, "_PLUGINS", None)
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    monkeypatch.setattr(errors, "_WARNED", set())
    monkeypatch.syspath_prepend(str(pkg))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert registry.load_plugins() == {"jsonl": ["jsonl"]}
        assert registry.load_plugins() == {"jsonl": ["jsonl"]}  # once: no second warning
        assert registry.detect_format(str(data)) == "jsonl"
        assert registry.open(str(data))[1] == {"id": 2}
    assert registry.get_format("parquet") is parquet
    said = [str(w.message) for w in seen]
    assert len(said) == 2, said
    assert any("'override'" in s and "replace" in s and "parquet" in s for s in said), said
    assert any("'broken'" in s and "tg_no_such_module" in s for s in said), said


def test_merge_schema_is_public():
    from torchgrain.sources import merge_schema

    schema = merge_schema({}, {"id": 1, "text": "a"})
    assert merge_schema(schema, {"id": 2}) == {"id": "int", "text": "null|str"}
    assert (merge_schema.__doc__ or "").count(">>>") >= 2  # documented with examples
