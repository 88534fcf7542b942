"""Where an ArrayRecord dataset's files are: its manifest, its shards, its index file.

A dataset directory with a ``torchgrain.json`` manifest names its shards (and the
dataset index beside them); other inputs are expanded by file name. Every name a
manifest gives is resolved inside the dataset's directory unless the user allows more
(:mod:`torchgrain.io.paths`): an untrusted dataset cannot pull other files into a batch.

Example:
    >>> import tempfile, torchgrain as tg
    >>> d = tempfile.mkdtemp()
    >>> _ = tg.write_array_record([{"x": 1}], d, num_shards=1)
    >>> manifest, fs, files, index = resolve_dataset(d, None, None, False)
    >>> manifest.shards[0].num_records, [f.rsplit("/", 1)[1] for f in files]
    (1, ['data-00000-of-00001.array_record'])
"""

from __future__ import annotations

import functools
import os
from typing import Any

import fsspec

from torchgrain.errors import DatasetNotFoundError
from torchgrain.formats.manifest import Manifest, read_manifest
from torchgrain.io import remote
from torchgrain.io.fs import expand_paths, get_filesystem, has_glob
from torchgrain.io.paths import resolve_all

__all__ = ["ARRAY_RECORD_SUFFIXES", "resolve_dataset"]

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")


def resolve_dataset(
    paths: Any,
    storage_options: dict[str, Any] | None,
    filesystem: fsspec.AbstractFileSystem | None,
    allow_external_paths: bool,
) -> tuple[
    Manifest | None, fsspec.AbstractFileSystem, list[str], tuple[str, dict[str, Any]] | None
]:
    """The manifest (for a dataset directory that has one), the filesystem, the files,
    and the dataset's own index file with its manifest entry (when it names one)."""
    if isinstance(paths, (str, os.PathLike)):
        if filesystem is not None:
            fs, root = filesystem, filesystem._strip_protocol(os.fspath(paths))
        else:
            fs, root = get_filesystem(paths, storage_options, allow_redirects=allow_external_paths)
        where = os.fspath(paths)
        if not has_glob(root, fs) and remote.isdir(fs, root, url=where):
            manifest = read_manifest(fs, root)
            if manifest is not None:
                # A shard name is a relative path below the dataset directory, checked in
                # every reading (percent-decoded, normalised): ``..`` segments, an absolute
                # path or a URL would let an untrusted dataset read any file the process
                # can. A symlink inside the directory is the user's own doing: followed.
                resolve = functools.partial(
                    resolve_all, fs, root, where=f"the manifest of {where!r}"
                )
                files = resolve(
                    [s.path for s in manifest.shards],
                    what=lambda k: f"shard {k}",
                    allow_external=allow_external_paths,
                )
                ends = sorted({0, len(files) - 1}) if files else []
                missing = [k for k in ends if not remote.exists(fs, files[k])]
                if missing:
                    raise DatasetNotFoundError(
                        f"shard {missing[0]} {files[missing[0]]!r} listed in the manifest of "
                        f"{where!r} does not exist"
                    )
                entry = manifest.extra.get("index")
                index = None
                if isinstance(entry, dict) and isinstance(entry.get("path"), str):
                    # The index file is named like a shard: inside the dataset, always.
                    index = (resolve([entry["path"]], what=lambda k: "its index file")[0], entry)
                return manifest, fs, files, index
    fs, files = expand_paths(
        paths,
        suffixes=ARRAY_RECORD_SUFFIXES,
        storage_options=storage_options,
        filesystem=filesystem,
        kind="ArrayRecord",
        allow_external=allow_external_paths,
    )
    return None, fs, files, None
