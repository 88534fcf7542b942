"""The ArrayRecord reader under its former name: see :mod:`torchgrain.formats.arrayrecord`.

Every name code imported from here still imports; new code imports from the package.

Example:
    >>> from torchgrain.formats import arrayrecord
    >>> ArrayRecordFile is arrayrecord.ArrayRecordFile
    True
"""

from torchgrain.formats.arrayrecord import (
    DEFAULT_MAX_CHUNK_BYTES,
    ArrayRecordFile,
    TransposedChunkError,
    read_many,
    read_mapped,
    read_num_records,
)

# Private names other modules imported from here (``X as X``: re-exported).
from torchgrain.formats.arrayrecord.batch import _read_many_singles as _read_many_singles
from torchgrain.formats.arrayrecord.footer import _fast_views as _fast_views
from torchgrain.formats.arrayrecord.footer import _Footer as _Footer
from torchgrain.formats.arrayrecord.riegeli import _CHUNK_HEADER as _CHUNK_HEADER

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ArrayRecordFile",
    "TransposedChunkError",
    "read_many",
    "read_mapped",
    "read_num_records",
]
