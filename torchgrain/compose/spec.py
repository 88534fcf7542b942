"""A composition described in a small JSON (or YAML) file, for the command line.

``torchgrain inspect mixture.json`` and ``torchgrain bench mixture.json`` read a mixture
or a concatenation of datasets from such a file::

    {"mix": [{"path": "web/", "weight": 0.7, "format": "parquet",
              "filter": [["lang", "==", "en"]]},
             {"path": "books/", "weight": 0.3, "name": "books"}],
     "seed": 0, "stopping": "all_exhausted", "source_field": "source"}

    {"concat": [{"path": "a/"}, {"path": "b.tfrecord"}]}

An entry names a dataset by ``path`` (relative paths are relative to the file), with an
optional ``format`` (default: detected from the file names), ``columns``, ``name`` and a
``filter`` for a Parquet dataset: a list of ``[column, op, value]`` conditions that all
hold, or a list of such lists of which one holds (pyarrow's filter form), pushed down to
the files (:func:`torchgrain.compose.filter.filter_dataset`). A ``mix`` entry has a
``weight`` (all entries or none); the other keys of the file are :func:`torchgrain.mix`'s
(``seed``, ``length``, ``stopping``, ``temperature``, ``source_field``) or
:func:`torchgrain.concat`'s (``source_field``). Anything else is a :class:`SpecError`
naming the file and the entry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from torchgrain.errors import CorruptDataError, TorchgrainError
from torchgrain.io.changes import open_regular
from torchgrain.io.retry import RetryPolicy, current_policy, using

__all__ = ["SpecError", "is_spec", "load_spec"]

_SUFFIXES = (".json", ".yaml", ".yml")
_ENTRY_KEYS = {"path", "format", "columns", "name", "filter", "weight"}
_TOP_KEYS = {
    "mix": {"seed", "length", "stopping", "temperature", "source_field"},
    "concat": {"source_field"},
}
# A description is a few entries; a bigger file is not one.
_MAX_BYTES = 1 << 20
# YAML aliases repeat a value without copying it: a few hundred bytes load as 2**40
# values, which the checks (and the errors that show them) would walk for hours.
_MAX_VALUES = 100_000


class SpecError(TorchgrainError, ValueError):
    """A composition file that does not describe a composition."""


def is_spec(path: Any) -> bool:
    """Whether ``path`` names a composition file: a local ``.json``/``.yaml``/``.yml``
    path that exists and is not a directory (a FIFO so named too, which
    :func:`load_spec` then refuses by name).

    Example:
        >>> is_spec("mixture.json"), is_spec("train/")
        (False, False)
    """
    if not (isinstance(path, str) and "://" not in path and path.lower().endswith(_SUFFIXES)):
        return False
    return os.path.exists(path) and not os.path.isdir(path)


def _read(path: str) -> Any:
    try:
        fd = open_regular(path)  # (a FIFO's plain open would wait for a writer forever)
    except CorruptDataError:
        raise SpecError(f"{path}: not a regular file (a FIFO, socket or device)") from None
    with open(fd, "rb") as f:
        data = f.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        raise SpecError(f"{path}: larger than {_MAX_BYTES} bytes: not a composition file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e})") from None
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:  # (nesting deeper than Python's stack)
            raise SpecError(f"{path}: not valid JSON: {e}") from None
    try:
        import yaml
    except ImportError:
        raise SpecError(f"{path}: reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        spec = yaml.safe_load(text)  # safe_load: plain data, no objects built from tags
    except (yaml.YAMLError, RecursionError) as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    stack, count = [spec], 0  # (a list that holds itself counts forever too)
    while stack:
        value = stack.pop()
        count += 1
        if count > _MAX_VALUES:
            raise SpecError(f"{path}: more than {_MAX_VALUES} values (YAML aliases?)")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return spec


def _entry_source(
    path: str, k: int, entry: Any, kind: str, retry: RetryPolicy | None
) -> tuple[str | None, Any, Any]:
    """(name, dataset, weight) of entry ``k``."""
    from torchgrain.sources import registry

    where = f"{path}: {kind} entry {k}"
    if not isinstance(entry, Mapping):
        raise SpecError(f"{where}: must be an object with a 'path', got {entry!r}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise SpecError(f"{where}: unknown keys {unknown} (known: {sorted(_ENTRY_KEYS)})")
    target = entry.get("path")
    if not isinstance(target, str) or not target:
        raise SpecError(f"{where}: 'path' must be a non-empty string, got {target!r}")
    if "://" not in target and not os.path.isabs(target):
        target = os.path.join(os.path.dirname(os.path.abspath(path)), target)
    options: dict[str, Any] = {} if retry is None else {"retry": retry}
    columns = entry.get("columns")
    if columns is not None:
        if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
            raise SpecError(f"{where}: 'columns' must be a list of strings, got {columns!r}")
        options["columns"] = columns
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise SpecError(f"{where}: 'name' must be a string, got {name!r}")
    fmt = entry.get("format", "auto")
    try:
        if fmt == "auto":
            with using(retry or current_policy()):
                fmt = registry.detect_format(target)
        src = registry.open(target, format=fmt, **options)
    except (ValueError, TypeError, OSError) as e:
        raise SpecError(f"{where} ({entry['path']!r}): {e}") from e
    if entry.get("filter") is not None:
        src = _filtered(where, src, fmt, entry["filter"])
    return name, src, entry.get("weight")


def _filtered(where: str, src: Any, fmt: str, conditions: Any) -> Any:
    import pyarrow.parquet as pq

    from torchgrain.compose.filter import filter_dataset

    if fmt != "parquet":
        raise SpecError(f"{where}: 'filter' works on Parquet datasets only (this one is {fmt})")
    try:
        # JSON has no tuples: [[col, op, value], ...] (all hold) or a list of such
        # lists (one holds), as pyarrow.parquet reads them with tuples.
        flat = isinstance(conditions[0], list) and isinstance(conditions[0][0], str)
        groups = [conditions] if flat else conditions
        expression = pq.filters_to_expression([[tuple(c) for c in g] for g in groups])
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise SpecError(
            f"{where}: 'filter' must be [[column, op, value], ...] (or a list of such "
            f"lists), got {conditions!r}: {e}"
        ) from None
    try:
        return filter_dataset(src, expression, progress=False)
    except (TypeError, ValueError) as e:  # a column the dataset lacks, a value of another type
        raise SpecError(f"{where}: 'filter': {e}") from e


def load_spec(path: str, retry: RetryPolicy | None = None) -> Any:
    """The :class:`~torchgrain.Dataset` a composition file describes (see the module
    docstring); ``retry``: the policy of every dataset's remote reads (default: each
    source's, :class:`~torchgrain.io.retry.RetryPolicy()`).

    Example:
        >>> import json, os, tempfile, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> _ = tg.write_parquet([{"x": i} for i in range(6)], os.path.join(d, "a"))
        >>> _ = tg.write_array_record([{"x": -i} for i in range(2)], os.path.join(d, "b"))
        >>> spec = {"mix": [{"path": "a", "weight": 0.5}, {"path": "b", "weight": 0.5}],
        ...         "stopping": "all_exhausted", "seed": 1}
        >>> with open(os.path.join(d, "mixture.json"), "w") as f:
        ...     json.dump(spec, f)
        >>> ds = load_spec(os.path.join(d, "mixture.json"))
        >>> len(ds), ds.source.counts.tolist()
        (12, [6, 6])
    """
    import torchgrain as tg

    spec = _read(path)
    kinds = [k for k in _TOP_KEYS if isinstance(spec, Mapping) and k in spec]
    if len(kinds) != 1:
        raise SpecError(
            f"{path}: must be an object with one of 'mix' or 'concat' (a list of datasets)"
        )
    kind = kinds[0]
    unknown = sorted(set(spec) - {kind} - _TOP_KEYS[kind])
    if unknown:
        raise SpecError(f"{path}: unknown keys {unknown} for {kind!r}")
    entries = spec[kind]
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{path}: {kind!r} must be a non-empty list of datasets")
    given, children, weights = map(
        list, zip(*(_entry_source(path, k, e, kind, retry) for k, e in enumerate(entries)))
    )
    names = [n if n is not None else str(k) for k, n in enumerate(given)]
    if len(set(names)) != len(names):
        raise SpecError(f"{path}: two {kind} entries have the same name ({names})")
    named = any(n is not None for n in given)
    datasets: Any = dict(zip(names, children)) if named else children
    options = {k: spec[k] for k in _TOP_KEYS[kind] if k in spec}
    try:
        if kind == "concat":
            if any(w is not None for w in weights):
                raise SpecError(f"{path}: concat entries take no 'weight'")
            return tg.concat(datasets, **options)
        if all(w is None for w in weights):
            weights = None
        elif any(w is None for w in weights):
            k = weights.index(None)
            raise SpecError(
                f"{path}: mix entry {k} has no 'weight' (give every entry one, or none)"
            )
        return tg.mix(datasets, weights, **options)
    except SpecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:  # (a length or weight of 400 digits)
        raise SpecError(f"{path}: {e}") from e
