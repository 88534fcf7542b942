"""The native ArrayRecord reader, in the order the bytes flow through it.

* :mod:`.riegeli`: Riegeli blocks and chunks: headers, decompression, declared sizes
  and the ``max_chunk_bytes`` ceiling.
* :mod:`.footer`: the postscript and footer, parsed into the file's index.
* :mod:`.file`: :class:`ArrayRecordFile`, reading records of a local or remote file.
* :mod:`.batch`: batches of one-record chunks planned with numpy, of one file or of many
  files mapped together (:func:`read_mapped`); :func:`read_many` is deprecated.

Example:
    >>> import tempfile, os
    >>> from array_record.python.array_record_module import ArrayRecordWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "p.array_record")
    >>> w = ArrayRecordWriter(path, "group_size:1")
    >>> w.write(b"only")
    >>> w.close()
    >>> ArrayRecordFile(path).read([0]), read_num_records([path]).tolist()
    ([b'only'], [1])
"""

from torchgrain.formats.arrayrecord.batch import read_many, read_mapped
from torchgrain.formats.arrayrecord.file import ArrayRecordFile, read_num_records
from torchgrain.formats.arrayrecord.riegeli import DEFAULT_MAX_CHUNK_BYTES, TransposedChunkError

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ArrayRecordFile",
    "TransposedChunkError",
    "read_many",
    "read_mapped",
    "read_num_records",
]
