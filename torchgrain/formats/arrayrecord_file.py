"""The ArrayRecord reader under its former name: see :mod:`torchgrain.formats.arrayrecord`.

Every public name code imported from here still imports; new code imports from the
package.

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

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ArrayRecordFile",
    "TransposedChunkError",
    "read_many",
    "read_mapped",
    "read_num_records",
]
