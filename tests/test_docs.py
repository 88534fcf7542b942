"""The documentation site: it builds with warnings as errors, and every Python example in it runs.

A page's Python blocks run in order, as one program, in a new process and an empty folder
(each page makes its own small data). A page that needs a service names it in a
``<!-- docs-test: NAME -->`` comment: ``s3`` (a local S3 server holding ``s3://bucket/train``
and ``s3://bucket/train-parquet/``, its endpoint in ``AWS_ENDPOINT_URL``) or ``tfds`` (a
small TFDS-style dataset at ``~/tensorflow_datasets/mnist/3.0.1``). A block may instead be
one or more pymdownx.snippets includes (``--8<-- "PATH"``) of a file the suite runs: the
README's first example (tests/test_newcomer.py) or a program under docs/snippets/
(tests/test_docs_frameworks.py). Any other block is a failure here, so none goes unchecked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
FENCE = re.compile(r"^( *)```(\S*)[^\n]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
INCLUDE = re.compile(r'^\s*--8<-- "([^"]+)"\s*$')
NEEDS = re.compile(r"<!-- docs-test: ([\w, -]+) -->")
# Files whose examples other tests run, with the test that runs them.
RUN_ELSEWHERE = {
    "README.md:first-example": "tests/test_newcomer.py",
    "docs/snippets/fixed_format.py": "tests/test_format_contract.py",
    **{
        f"docs/snippets/frameworks/{p.name}" + suffix: "tests/test_docs_frameworks.py"
        for p in (DOCS / "snippets" / "frameworks").glob("train_*.py")
        for suffix in ("", ":recipe", ":fit")
    },
}
# Runs the blocks in __main__'s namespace, as a script would. The guard keeps processes
# that re-import the main module (spawn, forkserver: tg.convert's pool) from running them.
RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    import __main__

    def run(path):
        blocks = json.load(open(path))
        for where, code in blocks:
            try:
                exec(compile(code, where, "exec"), __main__.__dict__)
            except BaseException:
                traceback.print_exc()
                print(f"FAILED: the block at {where}", file=sys.stderr)
                sys.exit(1)
        print(f"ran {len(blocks)} blocks")

    if __name__ == "__main__":
        run(sys.argv[1])
    """
)


def python_blocks(page: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every Python block of ``docs/PAGE``, in order."""
    text = (DOCS / page).read_text()
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(2) in ("python", "py", "pycon"):
            line = text.count("\n", 0, m.start()) + 2
            blocks.append((line, textwrap.dedent(m.group(3))))
    return blocks


def is_include(code: str) -> bool:
    lines = [x for x in code.splitlines() if x.strip()]
    return bool(lines) and all(INCLUDE.match(x) for x in lines)


RUNNABLE = [p for p in PAGES if any(not is_include(c) for _, c in python_blocks(p))]


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-5000:]
    for page in PAGES:
        stem = page[: -len(".md")]
        built = site / (stem + ".html" if stem.split("/")[-1] == "index" else stem + "/index.html")
        assert built.is_file(), page
    bench = (site / "benchmarks" / "index.html").read_text()
    assert "<!-- bench:" not in bench and "From <code>benchmarks/results/end_to_end.json" in bench
    # An API page holds the docstrings and their doctests, rendered as code.
    api = (site / "api" / "samplers" / "index.html").read_text()
    assert "GlobalShuffleSampler" in api and "&gt;&gt;&gt;" in api
    # Sphinx roles in docstrings are links or inline code (docs/griffe_roles.py), never
    # shown as written (``:meth:<code>state_dict</code>``), on a page or in the search.
    raw = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj):(?:<code>|`)")
    shown = [
        f"{p.relative_to(site)}: ...{p.read_text()[m.start() : m.end() + 40]}"
        for p in [*site.rglob("*.html"), site / "search" / "search_index.json"]
        for m in raw.finditer(p.read_text())
    ]
    assert not shown, shown[:10]
    assert 'href="#torchgrain.samplers.BlockShuffleSampler"><code>BlockShuffleSampler</code>' in api
    # The first program on the getting-started page is the README's, included whole.
    start = (site / "getting-started" / "index.html").read_text()
    assert "make_records" in start and "--8&lt;--" not in start


def test_every_python_block_runs_here_or_is_included_from_a_file_the_suite_runs():
    assert RUNNABLE, "no page has an example"
    # Blocks that are not Python say what they are: shell commands (run by
    # tests/test_newcomer.py, tests/test_cli.py and scripts/newcomer.sh) or sample output.
    for page in PAGES:
        text = (DOCS / page).read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            assert m.group(2) in ("python", "bash", "text"), f"docs/{page}:{line}: {m.group(2)!r}"
    for page in PAGES:
        for line, code in python_blocks(page):
            if not is_include(code):
                continue
            for x in code.splitlines():
                if x.strip():
                    target = INCLUDE.match(x).group(1)
                    assert target in RUN_ELSEWHERE, (
                        f"docs/{page}:{line} includes {target}, which no test runs"
                    )
    # Each file named there exists and is run by its test.
    for target, test in RUN_ELSEWHERE.items():
        path = ROOT / target.split(":")[0]
        assert path.is_file(), target
        if test.endswith("test_docs_frameworks.py"):
            assert path.name in (ROOT / test).read_text(), f"{test} does not run {path.name}"
    newcomer = (ROOT / "tests" / "test_newcomer.py").read_text()
    assert "readme_first_example" in newcomer
    readme = (ROOT / "README.md").read_text()
    assert "<!-- --8<-- [start:first-example] -->\n```python\n" in readme


def _page_needs(page: str) -> set[str]:
    m = NEEDS.search((DOCS / page).read_text())
    return {n.strip() for n in m.group(1).split(",")} if m else set()


def _s3_env(moto_s3, tmp_path) -> dict[str, str]:
    """``s3://bucket/train`` (ArrayRecord) and ``s3://bucket/train-parquet/`` in moto."""
    import numpy as np

    import torchgrain as tg

    client, endpoint = moto_s3
    if "bucket" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket="bucket")
        records = [{"image": np.full((8, 8, 3), i, np.uint8), "label": i % 10} for i in range(64)]
        local = tmp_path / "s3-upload"
        tg.write_array_record(records, local / "train", num_shards=2)
        tg.write_parquet(records, local / "train-parquet", num_shards=2)
        for path in local.rglob("*"):
            if path.is_file():
                client.upload_file(str(path), "bucket", path.relative_to(local).as_posix())
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    return {"AWS_ENDPOINT_URL": endpoint, **{k: os.environ[k] for k in keys}}


def _tfds_env(tmp_path) -> dict[str, str]:
    """A TFDS-style dataset where TFDS puts MNIST, under a home folder of the test's own."""
    from tests.test_tfds import NAME, build_tfds_dir

    made, _ = build_tfds_dir(tmp_path / "tfds-build")
    home = tmp_path / "home"
    dest = home / "tensorflow_datasets" / "mnist" / "3.0.1"
    dest.mkdir(parents=True)
    for f in made.iterdir():
        shutil.copy(f, dest / f.name.replace(NAME, "mnist"))
    return {"HOME": str(home)}


@pytest.mark.parametrize("page", RUNNABLE)
def test_the_python_examples_of_the_page_run_as_written(page, tmp_path, request):
    blocks = [
        (f"docs/{page}:{line}", code) for line, code in python_blocks(page) if not is_include(code)
    ]
    env = {
        **os.environ,
        "NO_ALBUMENTATIONS_UPDATE": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    for need in _page_needs(page):
        if need == "s3":
            env.update(_s3_env(request.getfixturevalue("moto_s3"), tmp_path))
        elif need == "tfds":
            env.update(_tfds_env(tmp_path))
        else:
            pytest.fail(f"docs/{page}: unknown docs-test need {need!r}")
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "run_blocks.py").write_text(RUNNER)
    r = subprocess.run(
        [sys.executable, str(tmp_path / "run_blocks.py"), str(tmp_path / "blocks.json")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert f"ran {len(blocks)} blocks" in r.stdout


def test_the_readme_stays_short_and_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert links, "the README links to the documentation pages"
    for link in links:
        assert (ROOT / link).is_file(), link


# ------------------------------------------------------------ the benchmark tables
def _hooks():
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    return hooks


def test_the_benchmark_tables_are_rendered_from_the_result_files():
    hooks = _hooks()
    page = (DOCS / "benchmarks.md").read_text()
    names = set(hooks.MARKER.findall(page)) | set(
        hooks.MARKER.findall((DOCS / "samplers.md").read_text())
    )
    assert names == set(hooks.TABLES), "every table is on a page, and only those"
    with open(ROOT / "benchmarks" / "results" / "end_to_end.json") as f:
        e2e = json.load(f)
    table = hooks.render("<!-- bench: end_to_end -->")
    for r in e2e["results"]:
        assert f"{r['samples_per_s']:,.0f}" in table
    with open(ROOT / "benchmarks" / "results" / "remote.json") as f:
        remote = json.load(f)
    table = hooks.render("<!-- bench: remote -->")
    for r in remote["rows"]:
        assert f"| {hooks._escape(r['mode'])} | {r['records/s']:,.0f} |" in table


def test_a_table_with_no_result_file_or_field_stops_the_build(monkeypatch, tmp_path):
    hooks = _hooks()
    with pytest.raises(KeyError, match="no such table"):
        hooks.render("<!-- bench: nonsense -->")
    broken = tmp_path / "results"
    broken.mkdir()
    (broken / "remote.json").write_text(json.dumps({"rows": [{"mode": "x"}]}))
    monkeypatch.setattr(hooks, "RESULTS", str(broken))
    with pytest.raises(KeyError, match="records/s"):
        hooks.render("<!-- bench: remote -->")
    with pytest.raises(FileNotFoundError):
        hooks.render("<!-- bench: memory -->")
