"""Filesystem access (fsspec) and path expansion shared by every source."""

from torchgrain.io.fs import expand_paths, get_filesystem, is_local

__all__ = ["expand_paths", "get_filesystem", "is_local"]
