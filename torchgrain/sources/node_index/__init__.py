"""Dataset indexes shared by every process of a machine: record offsets in one mapped file.

What every process needs per record (where each ArrayRecord chunk lies, how many records
it holds, its decoded size; where each TFRecord record starts) lives in one index file
per dataset (:mod:`torchgrain.formats.index_file`), mapped read-only by every DataLoader
worker of every rank: the page cache holds it once per machine, no process holds a
private copy, opening a dataset maps one file, and a pickled source carries the file's
name, not its arrays. Where the index comes from:

* **Beside the shards** (``torchgrain.tgindex``): torchgrain's writer and converter write
  it with the shards and record its size and checksum in ``torchgrain.json``. Its
  checksum is verified once per machine (a stamp in the index directory remembers the
  verified file, keyed by its inode, size and times), then it is mapped where it lies.
* **Built once per machine** into the index directory (``index_dir``, by default
  ``<torchgrain cache>/arrayrecord-index`` or ``tfrecord-index``), for files from other
  tools, TFRecord files, or a dataset whose own index is missing, stale or damaged:
  keyed by every shard's path, size and modification time (a rewritten shard gets a new
  index), built by one process under a lock while the others wait, and published with a
  rename, so a reader sees a whole index or none.
* **In memory** (``index_dir=None``, or an index directory that cannot be written):
  the same arrays in this process's heap.

An index file is untrusted input: its array table is checked against its size, its
arrays against each other (counts, per-shard sentinels, footer positions) when opened,
every offset against its shard's bounds before use, and each shard against the index
when a process first maps it (its size, modification time, and the 40-byte header of
its footer chunk, which holds a hash of the whole footer): a stale or damaged index
ends in a rebuild or a :class:`~torchgrain.CorruptDataError`, never in other bytes.

``COUNTERS`` counts, per process, the indexes built and verified (tests use them).
"""

from torchgrain.sources.node_index.arrayrecord import (
    ArrayRecordIndex,
    arrayrecord_index,
    build_arrayrecord_index,
    write_dataset_index,
)
from torchgrain.sources.node_index.store import (
    COUNTERS,
    INDEX_DIR_BYTES,
    INDEX_NAME,
    default_index_dir,
    open_index,
)
from torchgrain.sources.node_index.tfrecord import TFRecordIndex, tfrecord_index

__all__ = [
    "COUNTERS",
    "INDEX_DIR_BYTES",
    "INDEX_NAME",
    "ArrayRecordIndex",
    "TFRecordIndex",
    "arrayrecord_index",
    "build_arrayrecord_index",
    "default_index_dir",
    "open_index",
    "tfrecord_index",
    "write_dataset_index",
]
