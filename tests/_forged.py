"""A well-formed window index (sound checksum) that says what a test wants of a dataset."""

from __future__ import annotations

import os

import numpy as np

from torchgrain.sources.node_index.derived import derived_index


def forge_window_offsets(ds, index_dir, offsets, tokens):
    """Replace the window index of ``ds.windows("t", 4)`` under ``index_dir`` by one whose
    document offsets are ``offsets`` and token count ``tokens``."""
    path = ds.windows("t", 4, index_dir=index_dir).source.index_paths[0]
    key = os.path.basename(path).split(".")[0]
    os.remove(path)
    derived_index(
        "windows",
        key,
        {"offsets": ("<i8", ())},
        lambda sink: (sink.append("offsets", np.array(offsets)), {"tokens": tokens})[1],
        index_dir=index_dir,
    )
