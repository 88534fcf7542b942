"""A retry_call made inside another operation does not retry on its own."""

from __future__ import annotations

import pytest

from torchgrain.errors import DatasetNotFoundError, RemoteIOError
from torchgrain.io.retry import RetryPolicy, retry_call


def test_attempts_never_multiply_and_a_missing_file_is_named_from_inside():
    calls = []

    def flaky() -> None:
        calls.append(1)
        raise ConnectionResetError("reset")

    def outer() -> None:
        retry_call(flaky, url="s3://b/inner", policy=RetryPolicy(attempts=9, base_delay=0.0))

    with pytest.raises(RemoteIOError, match="s3://b/outer failed after 3 attempts"):
        retry_call(outer, url="s3://b/outer", policy=RetryPolicy(attempts=3, base_delay=0.0))
    assert len(calls) == 3

    def missing() -> None:
        raise FileNotFoundError("gone")

    with pytest.raises(DatasetNotFoundError, match="s3://b/inner does not exist"):
        retry_call(lambda: retry_call(missing, url="s3://b/inner"), url="s3://b/outer")
