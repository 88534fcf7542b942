"""Run a script in fresh interpreters under several string hash seeds."""

from __future__ import annotations

import os
import subprocess
import sys


def outputs_under_hash_seeds(script: str, *args: str, seeds: str = "123") -> set[str]:
    """The distinct (stripped) outputs of ``python -c script *args`` under each seed."""
    got = set()
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": seed, "NO_ALBUMENTATIONS_UPDATE": "1"}
        out = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        got.add(out.stdout.strip())
    return got
