"""An S3 412 to If-Match is a RangeAnswerError that carries no status of its own."""

from __future__ import annotations

import asyncio

import pytest

from torchgrain.io import responses
from torchgrain.io.retry import http_status, is_transient


class _PreconditionFailed(Exception):
    def __init__(self) -> None:
        super().__init__("An error occurred (PreconditionFailed) when calling GetObject")
        self.response = {
            "Error": {"Code": "PreconditionFailed"},
            "ResponseMetadata": {"HTTPStatusCode": 412},
        }


class _S3:
    def split_path(self, path: str) -> tuple[str, str, None]:
        return "b", path, None

    async def _call_s3(self, *args: object, **kwargs: object) -> None:
        assert kwargs["IfMatch"] == '"v1"'
        raise _PreconditionFailed()


def test_a_412_to_if_match_is_a_changed_file_retried_once_not_a_status():
    responses.check_file_answer("s3-412/k", 8, '"v1"', None)
    with pytest.raises(responses.RangeAnswerError) as info:
        asyncio.run(responses._s3_cat_file(_S3(), "s3-412/k", 0, 4, page_limit=1 << 20))
    err = info.value
    assert "412 to If-Match" in str(err)
    assert http_status(err) is None  # the 412 is no status to give up on
    assert is_transient(err)
