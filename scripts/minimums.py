"""Write pip constraints pinning every direct runtime dependency to its stated minimum.

Reads ``[project].dependencies`` from pyproject.toml and prints one ``name==version`` line
per ``name>=version`` bound, so that ``pip install -c FILE -e .`` installs the lowest
versions pyproject.toml allows (``make test-minimums``, scripts/test_minimums.sh). A
dependency without a ``>=`` bound is an error: its minimum could not be tested.

    python scripts/minimums.py                    # the constraints, on stdout
    python scripts/minimums.py --skip torch -o F  # all but torch, into F

Example:
    >>> minimums(['torch>=2.4', 'pyarrow >= 14 ; python_version >= "3.10"'])
    {'torch': '2.4', 'pyarrow': '14'}
    >>> minimums(["numpy"])
    Traceback (most recent call last):
    ...
    ValueError: 'numpy' states no minimum (name>=version)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# name (extras dropped), then its lower bound; other clauses and markers are ignored.
_BOUND = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")
_MIN = re.compile(r">=\s*([0-9][A-Za-z0-9.!+*-]*)")


def minimums(requirements: list[str]) -> dict[str, str]:
    """Each requirement's name and the version of its ``>=`` bound, in order."""
    found: dict[str, str] = {}
    for req in requirements:
        spec = req.split(";", 1)[0]
        name, rest = _BOUND.match(spec).groups()  # type: ignore[union-attr]
        bound = _MIN.search(rest)
        if bound is None:
            raise ValueError(f"{req!r} states no minimum (name>=version)")
        found[name] = bound.group(1)
    return found


def stated(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """The direct runtime dependencies' minimums stated in ``pyproject``."""
    with open(pyproject, "rb") as f:
        return minimums(tomllib.load(f)["project"]["dependencies"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    parser.add_argument("--skip", action="append", default=[], help="leave NAME unpinned")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    lines = [
        f"{name}=={version}\n"
        for name, version in stated(args.pyproject).items()
        if name not in args.skip
    ]
    if args.output is None:
        sys.stdout.writelines(lines)
    else:
        args.output.write_text("".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
