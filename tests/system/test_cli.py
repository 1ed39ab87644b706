"""The admin CLI against one real sidecar on a simulated DGX-1 (v1 cgroups, standalone mode).

One daemon serves the whole module; the containers every test reads are made once, and tests
that change state (release, drift) make their own containers. Most commands run in-process
through ``cli.main``; bad-input cases run as real subprocesses (another user, a closed pipe).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import paths
import pytest
from hostexpect import topology_json

from isolator import __version__
from isolator.cli import main as cli
from isolator.simhost.host import load_host
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id
from isolator.testing.sidecar import Sidecar, running_sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]

HOST = "dgx-1"
WORKTREE = paths.ROOT
SITE = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))


class World:
    def __init__(self, sidecar: Sidecar, iso: GrpcIsolator, c: Containerizer, sleeper: subprocess.Popen[bytes]):
        self.sidecar = sidecar
        self.iso = iso
        self.c = c
        self.sleeper = sleeper

    @property
    def socket(self) -> str:
        return self.sidecar.socket


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("world",)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with running_sidecar(HOST, "v1") as sc:
        iso = GrpcIsolator(sc.socket)
        c = Containerizer(iso, sc.work)
        sleeper = subprocess.Popen(["sleep", "600"])
        try:
            iso.prepare(container_id("train-a"), c.config(2))
            iso.prepare(container_id(["train-a", "debug-1"]), c.config(None))
            iso.prepare(container_id("train-b"), c.config(1, image=False))
            iso.isolate(container_id("train-b"), sleeper.pid)
            sc.sim.inject_xid(7, 79)  # GPU has fallen off the bus: GPU 7 is unhealthy from now on
            _wait_for(lambda: not _json(sc.socket, "gpus")["gpus"][7]["healthy"], "GPU 7 to turn unhealthy")
            yield World(sc, iso, c, sleeper)
        finally:
            sleeper.kill()
            sleeper.wait()
            iso.close()


def _wait_for(predicate: Any, what: str, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


def _cli(sock: str, *argv: str) -> tuple[int, str, str]:
    """``gpu-isolator ARGV --socket SOCK`` in this process, as (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([*argv, "--socket", sock])
    return rc, out.getvalue(), err.getvalue()


def _json(sock: str, *argv: str) -> Any:
    rc, out, err = _cli(sock, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def _table(text: str, first: str) -> list[dict[str, str]]:
    """Cut an aligned table at its header's column starts: misaligned rows come out garbled."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(first))
    header = lines[at]
    starts = [i for i, ch in enumerate(header) if ch != " " and (not header[:i].strip() or header[i - 2 : i] == "  ")]
    names = [header[s:e].strip() for s, e in zip(starts, [*starts[1:], None], strict=True)]
    rows = []
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        rows.append({n: line[s:e].strip() for n, s, e in zip(names, starts, [*starts[1:], None], strict=True)})
    return rows


def _subprocess(argv: list[str], user: int | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    """The CLI as its own process; as ``user`` it runs the system interpreter (root's is not readable)."""
    entry = "from isolator.cli.main import main"
    code = f"import sys; sys.path[:0] = [{WORKTREE!r}, {SITE!r}]; {entry}; sys.exit(main({argv!r}))"
    python = sys.executable if user is None else "/usr/bin/python3.11"
    prefix = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    return subprocess.run([*prefix, python, "-c", code], text=True, timeout=60, cwd="/", **kw)


def _one_line_error(result: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> str:
    err = result.stderr if isinstance(result, subprocess.CompletedProcess) else result[2]
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _minors_of(world: World, holder: str) -> list[int]:
    return [g["minor"] for g in _json(world.socket, "gpus")["gpus"] if g["holder"] == holder]


# ---- gpus -----------------------------------------------------------------------------------------


def test_gpus_json_names_each_gpus_holder_and_the_last_xid_with_its_time(world):
    data = _json(world.socket, "gpus")
    gpus = data["gpus"]
    assert data["driver_version"] == load_host(HOST).driver_version
    assert [g["index"] for g in gpus] == list(range(8))
    holders = {g["holder"] for g in gpus} - {""}
    assert holders == {"train-a", "train-b"}
    assert sum(g["holder"] == "train-a" for g in gpus) == 2 and sum(g["holder"] == "train-b" for g in gpus) == 1
    assert gpus[7]["healthy"] is False and gpus[7]["last_xid"] == "79" and gpus[7]["last_xid_time"].endswith("Z")
    assert set(gpus[0]) >= {"index", "minor", "uuid", "name", "memory_total_bytes", "numa_node", "holder"}


def test_gpus_table_is_aligned_with_holder_health_and_memory(world):
    rc, out, _ = _cli(world.socket, "gpus")
    assert rc == 0
    spec = load_host(HOST)
    cuda = f"{spec.cuda_driver_version // 1000}.{spec.cuda_driver_version % 1000 // 10}"
    assert out.splitlines()[0] == f"Driver {spec.driver_version}, CUDA {cuda}; gpu-isolator {__version__}"
    rows = _table(out, "INDEX")
    by_minor = {g["minor"]: g for g in _json(world.socket, "gpus")["gpus"]}
    assert [r["INDEX"] for r in rows] == [str(i) for i in range(8)]
    for row in rows:
        g = by_minor[int(row["MINOR"])]
        assert row["UUID"] == g["uuid"]
        assert row["HOLDER"] == (g["holder"] or "-")
        assert row["MEMORY"] == f"{int(g['memory_total_bytes']) // 2**20} MiB"
        assert row["NUMA"] == str(g["numa_node"])
    assert rows[7]["HEALTH"].startswith("UNHEALTHY: XID 79 at ")
    assert rows[0]["HEALTH"] == "healthy"


# ---- containers -----------------------------------------------------------------------------------


def test_containers_json_lists_nested_containers_right_after_their_parent(world):
    containers = [c for c in _json(world.socket, "containers")["containers"] if c["id"].startswith("train-")]
    assert [c["id"] for c in containers] == ["train-a", "train-a.debug-1", "train-b"]
    a, nested, b = containers
    assert nested["nested"] is True and nested["container_id"] == {"value": "debug-1", "parent": {"value": "train-a"}}
    assert nested["gpu_minors"] == a["gpu_minors"] == _minors_of(world, "train-a")
    assert a["state"] == "prepared" and b["state"] == "isolated"
    assert a["volume_version"] == nested["volume_version"] == load_host(HOST).driver_version
    assert b["volume_version"] == ""
    assert a["cgroup"] == os.path.join(world.sidecar.cgroup_parent, "train-a") and os.path.isdir(a["cgroup"])
    assert a["mode"] == "standalone" and a["created"] <= time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def test_containers_table_shows_a_nested_container_under_its_parent_with_the_parents_gpus(world):
    rc, out, _ = _cli(world.socket, "containers")
    assert rc == 0
    rows = [r for r in _table(out, "CONTAINER") if "train" in r["CONTAINER"] or "debug" in r["CONTAINER"]]
    assert [r["CONTAINER"].split()[-1].lstrip("`-") for r in rows] == ["train-a", "debug-1", "train-b"]
    assert rows[1]["CONTAINER"][:3] in ("└─ ", "`- ")
    minors = _minors_of(world, "train-a")
    gpus_a = f"{len(minors)} [{','.join(str(m) for m in minors)}]"  # minors equal indices on dgx-1
    assert rows[0]["GPUS"] == gpus_a and rows[1]["GPUS"] == f"({gpus_a})"
    assert [r["STATE"] for r in rows] == ["prepared", "prepared", "isolated"]
    assert rows[2]["VOLUME"] == "-" and rows[0]["VOLUME"] == load_host(HOST).driver_version
    assert all(r["AGE"].endswith(("s", "m")) for r in rows)


# ---- describe -------------------------------------------------------------------------------------


def test_describe_json_shows_recorded_and_kernel_rules_agreeing_and_the_processes(world):
    data = _json(world.socket, "describe", "train-b")
    minors = _minors_of(world, "train-b")
    assert data["container"]["id"] == "train-b"
    assert data["rules_agree"] is True and data["only_recorded"] == [] and data["only_kernel"] == []
    assert data["recorded_rules"] == data["kernel_rules"]
    assert f"c 195:{minors[0]} rwm" in data["kernel_rules"]
    assert data["kernel_gpu_minors"] == minors
    assert data["kernel_source"].startswith("devices.list of ")
    assert data["pids"] == [world.sleeper.pid]
    assert [g["minor"] for g in data["gpus"]] == minors


def test_describe_table_puts_recorded_and_kernel_side_by_side_and_lists_nested(world):
    rc, out, _ = _cli(world.socket, "describe", "train-a")
    assert rc == 0
    assert "Container: train-a" in out and "(they agree)" in out
    rules = _table(out, "RULE")
    assert rules and all(r["RECORDED"] == "yes" and r["KERNEL"] == "yes" for r in rules)
    assert {f"c 195:{m} rwm" for m in _minors_of(world, "train-a")} <= {r["RULE"] for r in rules}
    nested = _table(out, "CONTAINER")
    assert [r["CONTAINER"] for r in nested] == ["train-a.debug-1"]


@pytest.mark.parametrize("spelling", ["train-a.debug-1", '{"value": "debug-1", "parent": {"value": "train-a"}}'])
def test_describe_takes_a_nested_container_as_parent_dot_child_or_as_json(world, spelling):
    data = _json(world.socket, "describe", spelling)
    assert data["container"]["id"] == "train-a.debug-1" and data["container"]["nested"] is True
    assert data["kernel_gpu_minors"] == _minors_of(world, "train-a")


def test_describe_shows_which_rules_differ_when_the_kernel_lost_a_gpu_and_health_fails(world):
    cid = container_id("drift")
    world.iso.prepare(cid, world.c.config(1, image=False))
    try:
        (minor,) = _minors_of(world, "drift")
        cgroup = os.path.join(world.sidecar.cgroup_parent, "drift")
        with open(os.path.join(cgroup, "devices.deny"), "w") as fh:
            fh.write(f"c 195:{minor} rwm")  # someone else revoked the GPU behind our back
        data = _json(world.socket, "describe", "drift")
        rc, out, _ = _cli(world.socket, "describe", "drift")
        health_rc, health_out, _ = _cli(world.socket, "health", "--json")
    finally:
        world.iso.cleanup(cid)
    assert data["rules_agree"] is False
    assert data["only_recorded"] == [f"c 195:{minor} rwm"] and data["only_kernel"] == []
    assert data["kernel_gpu_minors"] == []
    assert rc == 0 and "(THEY DIFFER)" in out
    row = next(r for r in _table(out, "RULE") if r["RULE"] == f"c 195:{minor} rwm")
    assert (row["RECORDED"], row["KERNEL"].split()[0]) == ("yes", "no") and row["KERNEL"].endswith("<- differs")
    health = json.loads(health_out)
    assert health_rc == 1 and health["healthy"] is False
    consistency = next(c for c in health["checks"] if c["name"] == "consistency")
    assert consistency == {
        "name": "consistency",
        "ok": False,
        "detail": f"container drift: recorded GPUs [{minor}], kernel grants []",
    }


def test_audit_reapplies_the_rules_the_kernel_lost_and_says_so(world):
    cid = container_id("audited")
    world.iso.prepare(cid, world.c.config(1, image=False))
    try:
        (minor,) = _minors_of(world, "audited")
        with open(os.path.join(world.sidecar.cgroup_parent, "audited", "devices.deny"), "w") as fh:
            fh.write(f"c 195:{minor} rwm")  # a daemon-reload rewrote the device rules
        first_rc, first_out, _ = _cli(world.socket, "audit", "--json")
        rc, out, _ = _cli(world.socket, "audit")
        after = _json(world.socket, "describe", "audited")
    finally:
        world.iso.cleanup(cid)
    report = json.loads(first_out)
    assert report["checked"] >= 3 and report["repairs_total"] >= 1
    (line,) = report["repaired"]
    assert line.startswith(f"container audited: kernel grants GPUs [] (recorded [{minor}])")
    # As diff(1): 0 nothing differed, 1 drift was found (and repaired), 2 and above trouble.
    assert first_rc == cli.EXIT_DRIFT == 1, "drift found and repaired must not exit 0"
    assert rc == 0 and "kernel rules agree with the records" in out, "the first audit repaired it"
    assert after["rules_agree"] is True and after["kernel_gpu_minors"] == [minor]


def test_describe_of_an_unknown_container_is_one_line_and_exit_1(world):
    result = _cli(world.socket, "describe", "no-such-container")
    assert result[0] == cli.EXIT_ERROR
    assert _one_line_error(result) == "gpu-isolator: describe: unknown container no-such-container (NOT_FOUND)"
    result = _cli(world.socket, "describe", "train-a.no-such-child")
    assert result[0] == cli.EXIT_ERROR and "unknown container train-a.no-such-child" in _one_line_error(result)


@pytest.mark.parametrize(
    ("argument", "reason"),
    [
        ("a..b", "must not be empty"),
        ("a/b", "'/' is not allowed"),
        ('{"value": ', "invalid container ID JSON"),
    ],
)
def test_a_malformed_container_id_is_a_usage_error_before_anything_is_sent(argument, reason):
    result = _cli("/nonexistent/socket", "describe", argument)
    assert result[0] == cli.EXIT_USAGE
    assert reason in _one_line_error(result)


# ---- release --------------------------------------------------------------------------------------


def test_release_refuses_while_processes_remain_and_force_revokes_their_access(world):
    cid = container_id("stuck")
    world.iso.prepare(cid, world.c.config(1, image=False))
    proc = subprocess.Popen(["sleep", "600"])
    try:
        world.iso.isolate(cid, proc.pid)
        (minor,) = _minors_of(world, "stuck")
        cgroup = os.path.join(world.sidecar.cgroup_parent, "stuck")
        refused = _cli(world.socket, "release", "stuck")
        still_held = _minors_of(world, "stuck")
        forced = _cli(world.socket, "release", "stuck", "--force")
        with open(os.path.join(cgroup, "devices.list")) as fh:
            kernel = fh.read().split("\n")
        after = _minors_of(world, "stuck")
    finally:
        proc.kill()
        proc.wait()
        world.iso.cleanup(cid)
    assert refused[0] == cli.EXIT_ERROR
    line = _one_line_error(refused)
    assert f"still has processes [{proc.pid}]" in line and "--force" in line and cgroup in line
    assert still_held == [minor]
    assert forced[0] == cli.EXIT_OK
    assert forced[1].strip() == (
        f"released GPUs [{minor}] of container stuck: revoked their GPU access in '{cgroup}' "
        f"and kept the cgroup for its processes [{proc.pid}]"
    )
    assert f"c 195:{minor} rwm" not in kernel and after == []


def test_release_json_says_what_it_did_and_removes_the_cgroup_of_an_empty_container(world):
    cid = container_id("idle")
    world.iso.prepare(cid, world.c.config(2, image=False))
    minors = _minors_of(world, "idle")
    cgroup = os.path.join(world.sidecar.cgroup_parent, "idle")
    try:
        data = _json(world.socket, "release", "idle")
    finally:
        world.iso.cleanup(cid)
    assert data["container"] == "idle" and data["action"] == "removed-cgroup" and data["cgroup"] == cgroup
    assert data["released_gpu_minors"] == minors and len(data["released_gpu_uuids"]) == 2 and data["pids"] == []
    assert not os.path.exists(cgroup)
    assert _minors_of(world, "idle") == []
    result = _cli(world.socket, "release", "idle")
    assert result[0] == cli.EXIT_ERROR and "unknown container idle" in _one_line_error(result)


def test_release_of_a_nested_container_points_at_its_top_level_container(world):
    result = _cli(world.socket, "release", "train-a.debug-1")
    assert result[0] == cli.EXIT_ERROR
    assert "release its top-level container train-a" in _one_line_error(result)


# ---- topology, volume, health ---------------------------------------------------------------------


def test_topology_in_both_forms_matches_the_host(world):
    assert _json(world.socket, "topology") == topology_json(load_host(HOST))
    rc, out, _ = _cli(world.socket, "topology")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:8] == [f"GPU{i}" for i in range(8)]
    assert lines[1].split()[:9] == ["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]
    assert "Legend:" in out


def test_volume_json_is_the_manifest_with_users_and_the_table_describes_it(world):
    data = _json(world.socket, "volume")
    version = load_host(HOST).driver_version
    assert data["driver_version"] == version
    assert data["volume_root"] == os.path.join(world.sidecar.work, "volumes")
    (vol,) = data["volumes"]
    assert vol["name"] == f"nvidia_{version}" and vol["mode"] in ("link", "copy", "mixed")
    assert {"train-a", "train-a.debug-1"} <= set(vol["users"])
    assert vol["counts"]["compute"] > 0 and all("reason" in s for s in vol["skipped"])
    rc, out, _ = _cli(world.socket, "volume")
    assert rc == 0
    assert f"nvidia_{version} (running driver)" in out and f"volume:          {vol['path']}" in out
    assert "files per group: " in out and "skipped:" in out


def test_health_in_both_forms_checks_nvml_cgroups_state_consistency_and_socket(world):
    data = _json(world.socket, "health")
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == ["nvml", "cgroups", "state", "consistency", "handover", "maintenance", "mps", "socket"]
    assert data["healthy"] is True and all(c["ok"] for c in checks.values())
    assert "NVML sees 8" in checks["nvml"]["detail"] and "1 not usable" in checks["nvml"]["detail"]
    assert checks["cgroups"]["detail"] == "v1 devices, standalone mode"
    assert checks["socket"]["detail"] == f"'{world.socket}' answers; srw------- root:root"
    rc, out, _ = _cli(world.socket, "health")
    rows = _table(out, "CHECK")
    assert rc == 0 and out.startswith(f"Sidecar healthy (gpu-isolator {__version__} on {socket.gethostname()}, ")
    assert data["version"] == __version__ and data["mode"] == "standalone" and data["hostname"]
    assert [(r["CHECK"], r["STATE"]) for r in rows] == [(name, "ok") for name in checks]


# ---- the socket from the environment (as KUBECONFIG) ------------------------------------------------


def _cli_env(env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get(cli.SOCKET_ENV)
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    finally:
        if saved is None:
            os.environ.pop(cli.SOCKET_ENV, None)
        else:
            os.environ[cli.SOCKET_ENV] = saved
    return rc, out.getvalue(), err.getvalue()


def test_the_socket_comes_from_gpu_isolator_socket_when_no_flag_names_one(world):
    assert cli.SOCKET_ENV == "GPU_ISOLATOR_SOCKET"
    rc, out, err = _cli_env({cli.SOCKET_ENV: world.socket}, "gpus", "--json")
    assert rc == 0, err
    assert len(json.loads(out)["gpus"]) == 8


def test_the_socket_flag_wins_over_the_environment(world, short_tmp):
    absent = os.path.join(short_tmp, "absent.sock")
    rc, _, err = _cli_env({cli.SOCKET_ENV: absent}, "gpus", "--json", "--socket", world.socket)
    assert rc == 0, err
    rc, _, err = _cli_env({cli.SOCKET_ENV: absent}, "gpus")
    assert rc == cli.EXIT_UNREACHABLE and f"'{absent}'" in err and cli.SOCKET_ENV in err


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["gpus", "topology", "containers", "volume", "health"])
def test_every_command_with_no_socket_exits_3_naming_the_socket(short_tmp, command):
    sock = os.path.join(short_tmp, "absent.sock")
    result = _cli(sock, command)
    assert result[0] == cli.EXIT_UNREACHABLE
    assert _one_line_error(result) == (
        f"gpu-isolator: cannot reach the sidecar at '{sock}': no such socket "
        "(is the sidecar running? pick another with --socket)"
    )


def test_a_socket_left_behind_by_a_dead_sidecar_is_connection_refused_exit_3(short_tmp):
    sock = os.path.join(short_tmp, "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()  # bound, never listening: what a killed server leaves
    result = _cli(sock, "containers")
    assert result[0] == cli.EXIT_UNREACHABLE
    assert f"cannot reach the sidecar at '{sock}': connection refused" in _one_line_error(result)


def test_a_sidecar_that_never_answers_is_a_timeout_exit_3(short_tmp):
    sock = os.path.join(short_tmp, "mute.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.listen(8)  # accepts connections into the backlog, never speaks HTTP/2
    try:
        result = _cli(sock, "gpus", "--timeout", "1")
    finally:
        s.close()
    assert result[0] == cli.EXIT_UNREACHABLE
    line = _one_line_error(result)
    assert line == f"gpu-isolator: the sidecar at '{sock}' did not answer within 1 s (see --timeout)"


def test_an_unprivileged_user_is_told_permission_denied_with_the_socket_path(world):
    os.chmod(world.sidecar.work, 0o755)  # let the user reach the 0600 root socket itself
    result = _subprocess(["gpus", "--socket", world.socket], user=65534, capture_output=True)
    assert oct(os.stat(world.socket).st_mode & 0o777) == "0o600"
    assert result.returncode == cli.EXIT_UNREACHABLE, result.stderr
    line = _one_line_error(result)
    assert line.startswith(f"gpu-isolator: cannot reach the sidecar at '{world.socket}': permission denied")


@pytest.mark.parametrize("command", ["gpus", "containers", "describe train-a"])
def test_output_to_a_closed_reader_ends_quietly_with_exit_0(world, command):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as with `| head -0`
    try:
        result = _subprocess([*command.split(), "--socket", world.socket], stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    # As other CLIs under `| head`: the reader's choice, not an error (issue 33, item 12).
    assert (result.returncode, result.stderr) == (cli.EXIT_OK, "")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["gpus", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, expected):
    result = _subprocess(argv, capture_output=True)
    assert result.returncode == cli.EXIT_USAGE
    assert expected in _one_line_error(result)


# ---- cgroup v2 ------------------------------------------------------------------------------------


@pytest.mark.cgroup_v2
def test_on_cgroup_v2_describe_names_the_attached_device_program_and_health_agrees(short_tmp):
    with running_sidecar("workstation-4", "v2", work=short_tmp) as sc:
        iso = GrpcIsolator(sc.socket)
        try:
            iso.prepare(container_id("job"), Containerizer(iso, sc.work).config(2, image=False))
            data = _json(sc.socket, "describe", "job")
            rc, out, _ = _cli(sc.socket, "describe", "job")
            health = _json(sc.socket, "health")
            os.unlink(os.path.join(sc.work, "devices", "job", "device-rules.json"))  # the record of what was loaded
            without_checkpoint = _json(sc.socket, "describe", "job")
        finally:
            iso.close()
    cgroup = os.path.join(sc.cgroup_parent, "job")
    assert data["kernel_source"].startswith("device program ") and f"on '{cgroup}'" in data["kernel_source"]
    assert data["rules_agree"] is True and data["kernel_gpu_minors"] == data["container"]["gpu_minors"]
    assert len(data["kernel_gpu_minors"]) == 2
    assert rc == 0 and "(they agree)" in out
    assert next(c for c in health["checks"] if c["name"] == "cgroups")["detail"] == "v2 devices, standalone mode"
    assert health["healthy"] is True
    assert without_checkpoint["rules_agree"] is False and without_checkpoint["kernel_gpu_minors"] == []


def test_containers_table_says_how_many_gpus_and_which_and_why_none():
    from isolator.cli.main import render

    data = {
        "containers": [
            {"id": "etl", "container_id": {"value": "etl"}, "gpu_indices": [], "state": "prepared", "created": 0},
            {"id": "one", "container_id": {"value": "one"}, "gpu_indices": [0], "state": "prepared", "created": 0},
        ]
    }
    rows = _table(render("containers", data, now=1.0), "CONTAINER")
    assert [r["GPUS"] for r in rows] == ["0 (none asked)", "1 [0]"]


def test_containers_and_describe_show_what_its_processes_use_and_a_share_over_its_slice():
    from isolator.cli.main import render

    usage = [
        {"uuid": "GPU-4", "kind": "share", "memory_used_bytes": str(5 << 30), "memory_limit_bytes": str(4 << 30),
         "sm_utilization_percent": 30, "over": True, "pids": [1001, 1002], "error": ""},
        {"uuid": "MIG-1", "kind": "mig", "memory_used_bytes": str(1 << 30), "memory_limit_bytes": str(5 << 30),
         "over": False, "pids": [1003], "error": ""},
        {"uuid": "GPU-0", "kind": "gpu", "memory_used_bytes": "0", "memory_limit_bytes": str(16 << 30),
         "over": False, "pids": [], "error": "failed to list compute processes 'GPU 0': Unknown Error"},
    ]  # fmt: skip
    data = {"containers": [{"id": "a", "container_id": {"value": "a"}, "usage": usage, "created": 0}]}
    (row,) = _table(render("containers", data, now=1.0), "CONTAINER")
    assert row["GPU USE"] == "5120/4096 MiB 30% OVER, 1024/5120 MiB N/A, N/A"
    out = render("describe", {"container": data["containers"][0], "gpus": []}, now=1.0)
    rows = {r["DEVICE"]: r for r in _table(out, "DEVICE")}
    assert (rows["GPU-4"]["MEMORY"], rows["GPU-4"]["MAY USE"], rows["GPU-4"]["OVER"]) == (
        "5120 MiB",
        "4096 MiB",
        "OVER its slice",
    )
    assert rows["GPU-4"]["PIDS"] == "1001,1002" and rows["MIG-1"]["SM"] == "N/A"
    assert rows["GPU-0"]["MEMORY"] == "N/A" and "GPU-0: NVML could not say: failed to list" in out


# ---- offline commands: their own flags only, and JSON ------------------------------------------------

SERVE_ONLY = ("--socket-mode", "--metrics-address", "--allowed-uids", "--reap-interval", "--max-workers", "--mode")


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["resources", "--help"], ("--simulate", "--resources", "--nvidia-gpu-devices", "--config", "--json")),
        (["cdi", "generate", "--help"], ("--simulate", "--volume-root", "--cdi-kind", "--dev-root", "--output")),
    ],
)
def test_offline_commands_list_only_the_flags_they_use(argv, wanted):
    result = _subprocess(argv, capture_output=True)
    assert result.returncode == 0, result.stderr
    for flag in wanted:
        assert flag in result.stdout, flag
    for flag in SERVE_ONLY:
        assert f"{flag} " not in result.stdout, f"{flag} is serve's, not {argv[0]}'s"


def test_a_serve_only_flag_on_resources_is_a_usage_error():
    result = _subprocess(["resources", "--metrics-address", "9400"], capture_output=True)
    assert result.returncode == cli.EXIT_USAGE
    assert "unrecognized arguments: --metrics-address" in _one_line_error(result)


def test_resources_json_gives_the_string_and_each_entry(short_tmp, capsys):
    args = ["resources", "--simulate", "dgx-a100", "--work-dir", os.path.join(short_tmp, "w"), "--json"]
    assert cli.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["resources"] == "gpus:3;mig-1g.10gb:1;mig-1g.5gb:8;mig-2g.10gb:2;mig-3g.20gb:3;mig-4g.20gb:1"
    assert data["entries"] == {
        "gpus": 3,
        "mig-1g.10gb": 1,
        "mig-1g.5gb": 8,
        "mig-2g.10gb": 2,
        "mig-3g.20gb": 3,
        "mig-4g.20gb": 1,
    }
