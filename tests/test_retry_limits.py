"""A retry policy's numbers at their limits: any count of retries, and seconds past what a
blocking wait takes (threading.TIMEOUT_MAX, about 292 years)."""

from __future__ import annotations

import math
import threading

import fsspec
import pytest

from tests.servers import RangeHTTPServer
from torchgrain.io import inflight, retry
from torchgrain.io.remote import storage_options_with_deadlines
from torchgrain.io.retry import RetryPolicy, retry_call, using


@pytest.mark.parametrize("k", [63, 64, 1023, 1024, 10**6])
def test_a_late_retry_waits_max_delay(k: int) -> None:
    policy = RetryPolicy(attempts=2, base_delay=0.1, max_delay=3.0, jitter=0.0)
    assert policy.delay(k) == 3.0
    assert RetryPolicy(base_delay=0.0, max_delay=3.0).delay(k) == 0.0


@pytest.mark.parametrize("delays", [(math.nan, 1.0), (0.1, math.nan), (-1.0, 1.0)])
def test_a_delay_that_is_not_a_number_of_seconds_is_refused(delays) -> None:
    with pytest.raises(ValueError, match="delays must be >= 0"):
        RetryPolicy(base_delay=delays[0], max_delay=delays[1])


def test_wait_seconds_keeps_a_wait_within_what_waits_take() -> None:
    wait_seconds = retry.wait_seconds
    assert wait_seconds(-5.0) == 0.0
    assert wait_seconds(7.0) == 7.0
    assert wait_seconds(1e300) == threading.TIMEOUT_MAX
    threading.Event().wait(wait_seconds(-1e300))  # no OverflowError, no wait


def test_a_delay_longer_than_a_wait_takes_is_slept_as_the_longest_one(monkeypatch) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        # An unheld lock's acquire checks its timeout as every blocking wait does, and
        # returns at once.
        threading.Lock().acquire(timeout=seconds)
        slept.append(seconds)

    monkeypatch.setattr(retry.time, "sleep", sleep)
    policy = RetryPolicy(attempts=2, base_delay=2e10, max_delay=2e10, jitter=0.0, deadline=1e11)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert retry_call(flaky, url="s3://b/k", policy=policy) == "ok"
    assert slept == [threading.TIMEOUT_MAX]


def test_a_batch_under_a_policy_of_very_long_seconds_is_fetched(tmp_path) -> None:
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 16)
    policy = RetryPolicy(deadline=1e10, request_timeout=1e10)
    with RangeHTTPServer(tmp_path) as srv, using(policy):
        opts = storage_options_with_deadlines("http", {})
        opts["skip_instance_cache"] = True
        fs = fsspec.filesystem("http", **opts)
        url = f"{srv.url}/f.bin"
        got = inflight.cat_many(fs, [url, url], [0, 1000], [10, 1010])
    data = bytes(range(256)) * 16
    assert got == [data[0:10], data[1000:1010]]
