"""Standalone Isolate moves only the caller's processes (issue 26): the caller itself, one of its
descendants, a process in the caller's cgroup, or one already in the container's cgroup. Real
daemon, real processes, real cgroups; the caller's pid comes from the gate's SO_PEERCRED."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from isolator.testing.cgroupfs import TEST_PARENT, scratch_cgroups_root
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar, cgroup_mount

VERSIONS = [
    pytest.param("v1", marks=[pytest.mark.root, pytest.mark.cgroup_v1]),
    pytest.param("v2", marks=[pytest.mark.root, pytest.mark.cgroup_v2]),
]


def _stranger() -> int:
    """A process that is not ours: started by a shell that exits at once, so it is re-parented to
    init (or the nearest subreaper), never a descendant of this test."""
    out = subprocess.run(
        ["sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=30
    )
    return int(out.stdout.strip())


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _procs(cgroup: str) -> list[int]:
    with open(os.path.join(cgroup, "cgroup.procs")) as fh:
        return [int(line) for line in fh if line.strip()]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_pid_from_an_unrelated_cgroup_is_refused_and_stays_where_it_is(short_tmp, version):
    """Before issue 26 a process placed in a cgroup of its own outside the sidecar's root was moved
    into the container."""
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = Sidecar(work=short_tmp, host="single", cgroup_version=version, cgroups_root=root).start()
    mount = cgroup_mount(version)
    stranger = _stranger()
    try:
        with scratch_cgroups_root(mount, "foreign") as foreign_rel:
            foreign = os.path.join(mount, foreign_rel)
            with open(os.path.join(foreign, "cgroup.procs"), "w") as fh:
                fh.write(str(stranger))
            assert _ppid(stranger) != os.getpid()
            isolator = GrpcIsolator(sidecar.socket)
            try:
                config = Containerizer(isolator, short_tmp).config(gpus=0, image=False)
                isolator.prepare(container_id("c"), config)
                with pytest.raises(HookFailed) as refused:
                    isolator.isolate(container_id("c"), stranger)
                assert refused.value.code == "PERMISSION_DENIED", refused.value
                assert f"pid {stranger} (cgroup '{foreign}') is not the caller's" in refused.value.message
                assert f"(pid {os.getpid()}," in refused.value.message
                assert stranger in _procs(foreign)  # not moved

                # The caller's own child is moved, as before.
                child = subprocess.Popen(["sleep", "600"])
                try:
                    isolator.isolate(container_id("c"), child.pid)
                    assert child.pid in _procs(os.path.join(sidecar.cgroup_parent, "c"))
                finally:
                    child.kill()
                    child.wait()

                # A process already in the container's cgroup is isolated whoever started it.
                own = os.path.join(sidecar.cgroup_parent, "c")
                with open(os.path.join(own, "cgroup.procs"), "w") as fh:
                    fh.write(str(stranger))
                isolator.isolate(container_id("c"), stranger)
                assert stranger in _procs(own)
            finally:
                isolator.close()
    finally:
        try:
            os.kill(stranger, 9)
        except ProcessLookupError:
            pass
        sidecar.stop()
