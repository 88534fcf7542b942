"""Shared fixtures: small datasets generated into tmp dirs (nothing is downloaded)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci")

# Keep worker start-up cheap and reproducible on small CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# albumentations otherwise checks online for a newer version at every import
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


def make_records(n: int, *, seed: int = 0, image_shape=(4, 4, 3)) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 255, image_shape, dtype=np.uint8),
            "label": i % 7,
            "id": f"r{i}",
            "score": float(i) / 3,
        }
        for i in range(n)
    ]


@pytest.fixture
def small_dataset(tmp_path):
    """100 records in 3 shards, returns (directory, records)."""
    import torchgrain as tg

    recs = make_records(100)
    d = tmp_path / "ds"
    tg.write_array_record(recs, d, num_shards=3)
    return str(d), recs


@pytest.fixture(scope="session")
def moto_s3():
    """One moto S3 server for the session (it takes seconds to start): ``(client, endpoint)``.

    Tests create their own buckets in it.
    """
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from tests.servers import start_moto_s3

    server, endpoint = start_moto_s3()
    yield boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"), endpoint
    server.stop()
