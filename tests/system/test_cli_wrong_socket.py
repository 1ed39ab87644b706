"""The admin CLI given a path that is not the sidecar's gRPC socket (issue 33, defect 6): the bridge
socket, the metrics socket, a directory, a regular file, a lock file. It says at once what the path
is and which one to use (exit 3), instead of waiting out its deadline on the bridge, printing HTTP/2
parse errors for the metrics socket or "connection refused" for a file. Real daemon, real CLI."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from isolator.cli import main as cli
from isolator.cli.main import EXIT_UNREACHABLE
from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.sidecar import Sidecar


def _cli(sock: str, *argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main([*argv, "--socket", sock])
    return rc, err.getvalue()


# One daemon for the module, on one xdist worker (tests/conftest.py).
SHARED_FIXTURES = ("sidecar",)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[Sidecar]:
    work = tempfile.mkdtemp(prefix="gi-ws-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    metrics = f"unix:{os.path.join(work, 'metrics.sock')}"
    running = Sidecar(
        work=work, host="single", cgroup_version="v1", cgroups_root=root, extra=("--metrics-address", metrics)
    )
    running.start()
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_bridge_socket_is_named_as_such_with_the_grpc_socket_to_use(sidecar):
    """Before issue 33: 10 s of waiting, then "did not answer within 10 s"."""
    rc, err = _cli(sidecar.bridge_socket, "gpus")
    assert rc == EXIT_UNREACHABLE, err
    assert f"'{sidecar.bridge_socket}' is the command-module bridge's socket" in err, err
    assert f"use --socket '{sidecar.socket}'" in err, err
    assert "did not answer" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_metrics_socket_is_named_as_such_with_how_to_read_it(sidecar):
    """Before issue 33: gRPC's raw HTTP/2 parse errors."""
    path = os.path.join(sidecar.work, "metrics.sock")
    rc, err = _cli(path, "gpus")
    assert rc == EXIT_UNREACHABLE, err
    assert f"'{path}' serves HTTP (Prometheus metrics)" in err and "curl --unix-socket" in err, err
    assert "HTTP/2" not in err and "Trying to connect an http1.x server" not in err, err


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_grpc_socket_still_answers_after_the_probe(sidecar):
    rc, err = _cli(sidecar.socket, "gpus")
    assert rc == 0, err


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_directory_holding_the_socket_names_the_socket_in_it(sidecar):
    rc, err = _cli(sidecar.work, "gpus")
    assert rc == EXIT_UNREACHABLE, err
    assert f"'{sidecar.work}' is a directory, not a socket" in err, err
    assert f"'{sidecar.socket}'" in err and "connection refused" not in err, err


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_lock_file_names_the_socket_it_locks(sidecar):
    rc, err = _cli(sidecar.socket + ".lock", "gpus")
    assert rc == EXIT_UNREACHABLE, err
    assert "is a regular file, not a socket" in err and f"use --socket '{sidecar.socket}'" in err, err


def test_a_regular_file_or_an_empty_directory_is_not_called_a_stopped_sidecar(tmp_path):
    """Before issue 33 both said "connection refused (the sidecar is not running)"."""
    plain = tmp_path / "notes.txt"
    plain.write_text("x")
    rc, err = _cli(str(plain), "gpus")
    assert rc == EXIT_UNREACHABLE and f"'{plain}' is a regular file, not a socket" in err, err
    assert "not running" not in err, err
    rc, err = _cli(str(tmp_path / "empty"), "gpus") if (tmp_path / "empty").mkdir() is None else (0, "")
    assert rc == EXIT_UNREACHABLE and "is a directory, not a socket" in err and "not running" not in err, err
