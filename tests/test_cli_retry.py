"""The command line's --retries, --deadline and --request-timeout: one retry policy for
every remote read a command makes, here against a server that never answers."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest

import torchgrain as tg
from torchgrain.bench import open_dataset_source
from torchgrain.cli import build_parser, main
from torchgrain.compose.spec import load_spec
from torchgrain.convert.inputs import open_input
from torchgrain.io.retry import RetryPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def silent_url():
    """An HTTP server on 127.0.0.1 that accepts every connection and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("command", ["inspect", "convert", "bench"])
def test_a_silent_server_fails_within_the_deadline_given(silent_url, tmp_path, command):
    # The default policy gives such a server 90 s; --deadline 1 gives it about 1.
    url = f"{silent_url}/data/train.parquet"
    out = [str(tmp_path / "out")] if command == "convert" else []
    args = [command, url, *out, "--deadline", "1", "--retries", "1", "--request-timeout", "5"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torchgrain", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    spent = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"torchgrain {command}: error: "), proc.stderr
    assert url in proc.stderr and "deadline" in proc.stderr, proc.stderr
    assert spent < 15, (spent, proc.stderr)
    assert not os.path.exists(tmp_path / "out")  # a conversion that never began leaves nothing


@pytest.mark.parametrize(
    "option, value",
    [
        ("--deadline", "0"),
        ("--deadline", "-1"),
        ("--deadline", "inf"),
        ("--deadline", "nan"),
        ("--deadline", "soon"),
        ("--request-timeout", "0"),
        ("--request-timeout", "inf"),
        ("--retries", "-1"),
        ("--retries", "1.5"),
    ],
)
def test_retry_options_refuse_what_is_not_a_positive_finite_number(option, value, capsys):
    for command in (["inspect", "d"], ["convert", "d", "out"], ["bench", "d"]):
        with pytest.raises(SystemExit) as e:
            main([*command, option, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"torchgrain {command[0]}: error: argument {option}" in err, err


def test_help_shows_the_retry_options_and_their_defaults(capsys):
    for command in ("inspect", "convert", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--retries N" in out and "(default: 5)" in out
        assert "--deadline S" in out and "(default: 90)" in out
        assert "--request-timeout S" in out and "(default: 60)" in out


def test_the_options_make_one_policy_and_none_without_them():
    parse = build_parser().parse_args
    from torchgrain.cli import _retry_policy

    assert _retry_policy(parse(["bench", "d"])) is None  # each source's own default
    p = _retry_policy(parse(["convert", "a", "b", "--retries", "2", "--deadline", "7.5"]))
    assert p == RetryPolicy(attempts=3, deadline=7.5)
    p = _retry_policy(parse(["inspect", "d", "--request-timeout", "3"]))
    assert p == RetryPolicy(request_timeout=3.0)


def test_the_policy_reaches_every_source_a_command_opens_and_their_worker_copies(tmp_path):
    # convert's and bench's sources are pickled into their worker processes.
    policy = RetryPolicy(attempts=2, deadline=3.0, request_timeout=2.0)
    pq_dir, ar_dir = tmp_path / "pq", tmp_path / "ar"
    tg.write_parquet([{"x": i} for i in range(4)], pq_dir)
    tg.write_array_record([{"x": -i} for i in range(2)], ar_dir)

    inp = open_input(str(pq_dir), "auto", "auto", None, retry=policy)
    assert pickle.loads(pickle.dumps(inp)).source.retry == policy

    src, fmt = open_dataset_source(str(ar_dir), retry=policy)
    assert fmt == "array_record" and pickle.loads(pickle.dumps(src)).retry == policy

    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"concat": [{"path": "pq"}, {"path": "ar"}]}))
    children = load_spec(str(spec), policy).source.children
    assert [c.retry for c in children] == [policy, policy]
    src, fmt = open_dataset_source(str(spec), retry=policy)
    assert fmt == "composition" and [c.retry for c in src.children] == [policy, policy]

    # Without a policy each keeps the default, as before.
    assert open_dataset_source(str(ar_dir))[0].retry == RetryPolicy()
