"""Faults of the machine around the sidecar: each gives a clear error and loses nothing.

The state store's disk fills up or is read-only (a tmpfs of our own), a container's cgroup is
removed behind the sidecar's back, NVML fails for one GPU (the simulated host's ``fail_gpu``), the
volume root cannot be written. In each case a resident container's record and kernel grants are
checked to be intact, and the sidecar to work again once the fault is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator

import grpc
import pytest
from invariants import CrashableSidecar, Observer, quick_sidecar, read_records

from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.testing.mesos import GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import TEST_PARENT

pytestmark = [pytest.mark.root]

VERSIONS = [pytest.param("v1", marks=pytest.mark.cgroup_v1), pytest.param("v2", marks=pytest.mark.cgroup_v2)]
GPUS = 8


def gpus(n: int) -> dict[str, object]:
    return {"resources": [{"name": "gpus", "type": "SCALAR", "scalar": {"value": n}, "role": "*"}]}


@contextlib.contextmanager
def tmpfs(path: str, options: str) -> Iterator[str]:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def remount(path: str, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", path], check=True)


@contextlib.contextmanager
def sidecar_with(mounts: dict[str, str], version: str = "v1") -> Iterator[CrashableSidecar]:
    """A sidecar whose work dir has tmpfs mounts (relative path -> options) made before it starts."""
    work = tempfile.mkdtemp(prefix="gi-", dir="/tmp")
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = CrashableSidecar(work=work, host="dgx-1", cgroup_version=version, cgroups_root=root)
    with contextlib.ExitStack() as stack:
        for rel, options in mounts.items():
            stack.enter_context(tmpfs(os.path.join(work, rel), options))
        try:
            yield sidecar
        finally:
            sidecar.stop()
    shutil.rmtree(work, ignore_errors=True)


def fill(directory: str) -> str:
    """Fill the file system of ``directory``; returns the filler's path."""
    path = os.path.join(directory, "filler")
    with contextlib.suppress(OSError), open(path, "wb", buffering=0) as fh:
        while True:
            fh.write(b"\0" * 65536)
    return path


def status_minors(sidecar: CrashableSidecar, name: str) -> list[int]:
    with grpc.insecure_channel(sidecar.address) as ch:
        by_uuid = {g.uuid: g.minor for g in pb_grpc.AdminStub(ch).ListGpus(pb.ListGpusRequest(), timeout=30).gpus}
        status = pb_grpc.IsolatorStub(ch).Status(pb.StatusRequest(container_id=pb.ContainerID(value=name)), timeout=30)
    return sorted(by_uuid[u] for u in status.gpu_uuids)


def test_state_disk_full_refuses_prepare_with_resource_exhausted_and_loses_nothing():
    with sidecar_with({"state": "size=4m"}) as sidecar:
        sidecar.start()
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("resident"), gpus(2))
        filler = fill(os.path.join(sidecar.work, "state"))
        with pytest.raises(HookFailed) as info:
            isolator.prepare(container_id("newcomer"), gpus(1))
        assert info.value.code == "RESOURCE_EXHAUSTED", info.value
        assert "allocations.sqlite3" in info.value.message and "full" in info.value.message
        # Nothing half-done: no record, no cgroup, no GPU booked for the newcomer; the resident intact.
        observer = Observer(sidecar, GPUS)
        assert set(read_records(sidecar.work)) == {"resident"}
        assert sorted(observer.cgroups()) == ["resident"]
        assert observer.problems() == []
        os.unlink(filler)
        isolator.prepare(container_id("newcomer"), gpus(6))  # every GPU the resident does not hold
        assert observer.problems() == []
        isolator.cleanup(container_id("newcomer"))
        isolator.cleanup(container_id("resident"))
        isolator.close()


def test_state_on_a_read_only_file_system_stops_the_start_with_a_clear_error_and_records_survive():
    # A mounted file system cannot turn read-only under an open writer (remount says busy), so the
    # read-only store meets the sidecar at start, as after a reboot onto a read-only disk.
    with sidecar_with({"state": "size=4m"}) as sidecar:
        sidecar.start()
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("resident"), gpus(2))
        held = status_minors(sidecar, "resident")
        isolator.close()
        assert sidecar.terminate() == 0
        state = os.path.join(sidecar.work, "state")
        remount(state, "ro")
        with pytest.raises(RuntimeError, match="exited 1") as info:
            sidecar.start(timeout=30)
        assert f"'{state}' is read-only" in str(info.value), info.value
        remount(state, "rw")
        sidecar.start()
        assert status_minors(sidecar, "resident") == held
        observer = Observer(sidecar, GPUS)
        assert observer.problems() == []
        isolator = GrpcIsolator(sidecar.socket)
        isolator.cleanup(container_id("resident"))
        isolator.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_cgroup_removed_behind_our_back_is_reported_kept_and_made_again_by_recover(version):
    with quick_sidecar("dgx-1", version) as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("victim"), gpus(1))
        observer = Observer(sidecar, GPUS)
        cgroup = observer.cgroups()["victim"]
        os.rmdir(cgroup)
        with pytest.raises(HookFailed) as info:
            isolator.update(container_id("victim"), 2)
        assert info.value.code == "NOT_FOUND", info.value
        assert cgroup in info.value.message
        # The record and its GPU are kept (never handed to someone else while the container may live).
        assert read_records(sidecar.work) == {"victim": frozenset(status_minors(sidecar, "victim"))}
        assert len(status_minors(sidecar, "victim")) == 1
        with grpc.insecure_channel(sidecar.address) as ch:
            checks = {c.name: c for c in pb_grpc.AdminStub(ch).Health(pb.HealthRequest(), timeout=30).checks}
        assert not checks["consistency"].ok and "does not exist" in checks["consistency"].detail
        # Standalone mode owns the cgroups: Recover makes it again with the recorded rules.
        isolator.recover([], [])
        assert sorted(observer.cgroups()) == ["victim"]
        assert observer.problems() == []
        isolator.cleanup(container_id("victim"))
        assert read_records(sidecar.work) == {}
        isolator.close()


def test_cleanup_of_a_container_whose_cgroup_vanished_releases_its_gpus():
    with quick_sidecar("dgx-1", "v1") as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("victim"), gpus(8))
        os.rmdir(Observer(sidecar, GPUS).cgroups()["victim"])
        isolator.cleanup(container_id("victim"))
        isolator.prepare(container_id("next"), gpus(8))  # all eight are free again
        isolator.cleanup(container_id("next"))
        isolator.close()


def test_nvml_failing_for_one_gpu_fails_only_the_usage_that_needs_it_and_loses_nothing():
    with quick_sidecar("dgx-1", "v1") as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        isolator.prepare(container_id("hit"), gpus(1))
        isolator.prepare(container_id("spared"), gpus(1))
        [minor] = status_minors(sidecar, "hit")
        with grpc.insecure_channel(sidecar.address) as ch:
            index = {g.minor: g.index for g in pb_grpc.AdminStub(ch).ListGpus(pb.ListGpusRequest(), timeout=30).gpus}
            sidecar.sim.fail_gpu(index[minor], "*")
            stub = pb_grpc.IsolatorStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.Usage(pb.UsageRequest(container_id=pb.ContainerID(value="hit")), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert f"'GPU {index[minor]}': GPU is lost" in (info.value.details() or ""), info.value.details()
            spared = stub.Usage(pb.UsageRequest(container_id=pb.ContainerID(value="spared")), timeout=30)
            assert len(spared.gpus) == 1
        records = read_records(sidecar.work)
        assert records == {"hit": frozenset({minor}), "spared": frozenset(status_minors(sidecar, "spared"))}
        assert Observer(sidecar, GPUS).problems() == []
        sidecar.sim.clear()
        isolator.cleanup(container_id("hit"))
        isolator.cleanup(container_id("spared"))
        isolator.close()


def test_unwritable_volume_root_refuses_an_image_that_needs_the_volume_and_books_nothing():
    with sidecar_with({"volumes": "size=4m,ro"}) as sidecar:
        sidecar.start()
        isolator = GrpcIsolator(sidecar.socket)
        rootfs = tempfile.mkdtemp(prefix="rootfs-", dir=sidecar.work)
        config = {
            **gpus(2),
            "rootfs": rootfs,
            "docker": {"manifest": {"config": {"Env": ["NVIDIA_VISIBLE_DEVICES=all"]}}},
        }
        with pytest.raises(HookFailed) as info:
            isolator.prepare(container_id("imaged"), config)
        assert "read-only" in info.value.message.lower(), info.value
        assert os.path.join(sidecar.work, "volumes") in info.value.message
        assert read_records(sidecar.work) == {}
        assert Observer(sidecar, GPUS).cgroups() == {}
        isolator.cleanup(container_id("imaged"))  # the agent's cleanup after a failed prepare
        # A container without an image needs no volume: all eight GPUs are still there for it.
        isolator.prepare(container_id("plain"), gpus(8))
        isolator.cleanup(container_id("plain"))
        isolator.close()
