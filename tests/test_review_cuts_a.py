"""Behaviour that the line cuts in torchgrain/io must keep: the requests a batch makes and
the cost of a retry_call made inside another operation."""

from __future__ import annotations

import random
import types

from fsspec.asyn import AsyncFileSystem

from torchgrain.io import ranges, retry
from torchgrain.io.retry import retry_call


class _HttpLike(AsyncFileSystem):
    """An async filesystem of ``http(s)://`` URLs that is not fsspec's HTTPFileSystem."""

    protocol = ("https", "http")


def test_an_http_async_filesystem_of_another_class_coalesces_with_the_gap_given():
    fs = _HttpLike()
    assert ranges.coalescing(fs, "https://h.example/x", 4096) == (4096, ranges.MAX_REQUEST)


def test_a_retry_call_inside_an_operation_seeds_no_generator_of_its_own(monkeypatch):
    made = []

    def counted(*args: object) -> random.Random:
        made.append(1)
        return random.Random(*args)

    shim = types.SimpleNamespace(Random=counted, random=random.random)
    monkeypatch.setattr(retry, "random", shim)
    assert retry_call(lambda: retry_call(int, "7", url="s3://b/inner"), url="s3://b/outer") == 7
    assert len(made) == 1  # the outer operation's only
