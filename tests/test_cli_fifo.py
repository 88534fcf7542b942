"""Files the command line reads or writes by name, given as a FIFO: refused at once with
an error naming the option and the path, never waited on.

Each case runs in a child process with a hard timeout (a wait fails the test, it never
stalls the run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import torchgrain as tg
from torchgrain.cli import main
from torchgrain.compose.spec import is_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ROOT}
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still waiting after {timeout} s: {e.stderr!r}")


def run_cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return run_child(f"import sys; from torchgrain.cli import main; sys.exit(main({argv!r}))")


@pytest.mark.parametrize("name", ["mixture.json", "mixture.yaml"])
@pytest.mark.parametrize("command", ["inspect", "bench"])
def test_a_fifo_named_as_a_composition_file_is_refused_by_name(tmp_path, command, name):
    fifo = str(tmp_path / name)
    os.mkfifo(fifo)
    assert is_spec(fifo)  # a composition file refused as one, not a dataset of no format
    done = run_cli([command, fifo, "--seconds", "1"] if command == "bench" else [command, fifo])
    assert done.returncode == 2, done.stderr
    assert f"{fifo}: not a regular file" in done.stderr, done.stderr


def test_load_spec_refuses_a_fifo_with_a_spec_error(tmp_path):
    fifo = str(tmp_path / "mixture.json")
    os.mkfifo(fifo)
    done = run_child(
        f"""
        from torchgrain.compose.spec import SpecError, load_spec
        try:
            load_spec({fifo!r})
        except SpecError as e:
            print(e)
        """
    )
    assert done.stdout.strip() == f"{fifo}: not a regular file (a FIFO, socket or device)", (
        done.stdout + done.stderr
    )


def test_a_fifo_named_as_the_tokenizer_file_is_refused_by_option_and_path(tmp_path):
    src, fifo = str(tmp_path / "src"), str(tmp_path / "tokenizer.json")
    tg.write_parquet([{"text": "hello world"}], src)
    os.mkfifo(fifo)
    done = run_cli(["convert", src, str(tmp_path / "out"), "-q", "--tokenize", fifo])
    assert done.returncode == 2, done.stderr
    want = f"argument --tokenize: {fifo!r} is not a regular file (a FIFO, socket or device)"
    assert want in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "out")


def test_a_tokenizer_file_that_is_a_directory_or_missing_or_remote_is_said(tmp_path, capsys):
    src = str(tmp_path / "src")
    tg.write_parquet([{"text": "hello world"}], src)
    args = ["convert", src, str(tmp_path / "out"), "-q", "--tokenize"]
    for given, said in [
        (str(tmp_path), f"{str(tmp_path)!r} is a directory, not a file"),
        (str(tmp_path / "nothing.json"), f"{str(tmp_path / 'nothing.json')!r} does not exist"),
        ("s3://bucket/tokenizer.json", "'s3://bucket/tokenizer.json' must be a local file"),
    ]:
        assert main([*args, given]) == 2
        assert f"argument --tokenize: {said}" in capsys.readouterr().err


def test_a_fifo_in_place_of_the_demo_marker_is_an_error_not_a_wait(tmp_path):
    from torchgrain.demo import _MARKER

    data = tmp_path / "demo"
    data.mkdir()
    os.mkfifo(data / _MARKER)
    done = run_cli(["demo", "--data-dir", str(data), "--num-records", "8", "--max-steps", "1"])
    assert done.returncode == 2, done.stderr
    assert str(data / _MARKER) in done.stderr, done.stderr
