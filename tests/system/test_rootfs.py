"""Issue 16 item 6: paths inside an image rootfs resolve as if the rootfs were '/'.

Hostile images are built on disk (``usr -> /X``, ``usr/local -> ../../../../tmp/x``, ``dev -> /dev``,
loops, a file where a directory is expected) and handed to the real sidecar and to isolator/host/rootfs.py
directly, through openat2 and through the fallback walk. Nothing outside the rootfs may be created,
and every mount target handed back must lie inside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest
from invariants import quick_sidecar

from isolator.errors import InvalidArgument
from isolator.host.rootfs import ImageRoot, make_dirs_in, mount_target_in
from isolator.testing.mesos import GrpcIsolator, HookFailed, container_id
from isolator.testing.mesos_json import container_config

WALKS = ["openat2", "walk"]


def _inside(path: str, root: str) -> bool:
    real = os.path.realpath(root)
    return path == real or path.startswith(real + "/")


@pytest.fixture
def outside():
    """A host directory the hostile links aim at; nothing may appear in it."""
    path = tempfile.mkdtemp(prefix="gi-outside-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rootfs(tmp_path):
    root = tmp_path / "rootfs"
    root.mkdir()
    return str(root)


def _walk(kind: str) -> bool:
    return kind == "openat2"


# ---- the edge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", WALKS)
def test_absolute_link_is_resolved_inside_the_rootfs_not_on_the_host(rootfs, outside, kind):
    os.makedirs(os.path.join(rootfs, outside.lstrip("/")))
    os.symlink(outside, os.path.join(rootfs, "usr"))  # usr -> /tmp/gi-outside-…: absolute
    target = make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))
    assert target == os.path.join(os.path.realpath(rootfs), outside.lstrip("/"), "local", "nvidia")
    assert os.path.isdir(target)
    assert os.listdir(outside) == []


@pytest.mark.parametrize("kind", WALKS)
def test_dotdot_link_cannot_climb_above_the_rootfs(rootfs, outside, kind):
    os.makedirs(os.path.join(rootfs, "usr"))
    os.makedirs(os.path.join(rootfs, outside.lstrip("/")))
    os.symlink("../../../../../../../../.." + outside, os.path.join(rootfs, "usr", "local"))
    target = make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))
    assert _inside(target, rootfs) and target.endswith(outside + "/nvidia")
    assert os.listdir(outside) == []


@pytest.mark.parametrize("kind", WALKS)
def test_dangling_absolute_link_is_refused_and_nothing_is_made_on_the_host(rootfs, outside, kind):
    missing = os.path.join(outside, "X")
    os.symlink(missing, os.path.join(rootfs, "usr"))
    with pytest.raises(InvalidArgument, match="usr/local/nvidia"):
        make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))
    assert not os.path.exists(missing)


@pytest.mark.parametrize("kind", WALKS)
def test_dev_link_to_the_hosts_dev_never_yields_a_host_dev_target(rootfs, kind):
    os.symlink("/dev", os.path.join(rootfs, "dev"))  # resolves to itself inside the root: a loop
    with pytest.raises(InvalidArgument, match=r"symbolic links|loop"):
        mount_target_in(rootfs, "dev/nvidia0", use_openat2=_walk(kind))


@pytest.mark.parametrize("kind", WALKS)
def test_dev_link_to_another_image_directory_gives_a_target_there(rootfs, kind):
    os.makedirs(os.path.join(rootfs, "devices"))
    os.symlink("/devices", os.path.join(rootfs, "dev"))
    target = mount_target_in(rootfs, "dev/nvidia0", use_openat2=_walk(kind))
    assert target == os.path.join(os.path.realpath(rootfs), "devices", "nvidia0")


@pytest.mark.parametrize("kind", WALKS)
def test_symlink_loops_are_refused(rootfs, kind):
    os.symlink("b", os.path.join(rootfs, "a"))
    os.symlink("a", os.path.join(rootfs, "b"))
    os.symlink("a", os.path.join(rootfs, "usr"))
    with pytest.raises(InvalidArgument, match="too many symbolic links"):
        make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))


@pytest.mark.parametrize("kind", WALKS)
def test_a_file_where_a_directory_is_expected_is_refused(rootfs, kind):
    os.makedirs(os.path.join(rootfs, "usr"))
    with open(os.path.join(rootfs, "usr", "local"), "w") as fh:
        fh.write("not a directory")
    with pytest.raises(InvalidArgument, match="not a directory"):
        make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))


@pytest.mark.parametrize("kind", WALKS)
def test_a_device_node_planted_as_a_link_is_refused_as_a_mount_target(rootfs, outside, kind):
    os.makedirs(os.path.join(rootfs, "dev"))
    os.symlink(os.path.join(outside, "victim"), os.path.join(rootfs, "dev", "nvidia0"))
    with pytest.raises(InvalidArgument, match="symbolic link"):
        mount_target_in(rootfs, "dev/nvidia0", use_openat2=_walk(kind))


@pytest.mark.parametrize("bad", ["relative/rootfs", "rootfs", "/a/../b", "/a/./b", "", "/"])
def test_a_relative_or_unnormalized_rootfs_is_invalid_argument(bad):
    with pytest.raises(InvalidArgument, match="rootfs"):
        ImageRoot(bad)


@pytest.mark.parametrize("kind", WALKS)
def test_plain_image_gets_its_directory_made_where_it_says(rootfs, kind):
    target = make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind))
    assert target == os.path.join(os.path.realpath(rootfs), "usr/local/nvidia")
    assert make_dirs_in(rootfs, "usr/local/nvidia", use_openat2=_walk(kind)) == target  # idempotent


# ---- through the sidecar -------------------------------------------------------------------------


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("sidecar",)


@pytest.fixture(scope="module")
def sidecar():
    with quick_sidecar("dgx-1", "v1") as s:
        yield s


def _config(rootfs: str) -> dict:
    return container_config(
        "task",
        directory="/tmp",
        gpu_count=1,
        check_command="true",
        rootfs=rootfs,
        env=["NVIDIA_VISIBLE_DEVICES=all", "PATH=/usr/bin:/bin"],
    )


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_prepare_with_usr_linked_to_a_host_path_creates_nothing_on_the_host(sidecar, rootfs, outside):
    host_target = os.path.join(outside, "X")
    os.symlink(host_target, os.path.join(rootfs, "usr"))  # usr -> /tmp/gi-outside-…/X
    os.makedirs(os.path.join(rootfs, host_target.lstrip("/")))  # the same path inside the image
    isolator = GrpcIsolator(sidecar.socket)
    cid = container_id(f"img-{uuid.uuid4().hex[:6]}")
    try:
        info = isolator.prepare(cid, _config(rootfs))
        assert not os.path.exists(host_target), "the sidecar created a directory on the host through the image"
        targets = [m["target"] for m in (info or {}).get("mounts", [])]
        assert targets, info
        for target in targets:
            assert _inside(target, rootfs), f"mount target {target} is outside the rootfs"
        volume = [m for m in info["mounts"] if m["target"].endswith("/local/nvidia")]
        assert volume and os.path.isdir(volume[0]["target"])
    finally:
        isolator.cleanup(cid)
        isolator.close()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_prepare_with_dev_linked_to_the_hosts_dev_is_refused_and_allocates_nothing(sidecar, rootfs):
    os.symlink("/dev", os.path.join(rootfs, "dev"))
    isolator = GrpcIsolator(sidecar.socket)
    cid = container_id(f"img-{uuid.uuid4().hex[:6]}")
    try:
        with pytest.raises(HookFailed) as info:
            isolator.prepare(cid, _config(rootfs))
        assert info.value.code == "INVALID_ARGUMENT", info.value
        # Nothing stayed allocated: all 8 GPUs can still be taken.
        whole = container_id(f"all-{uuid.uuid4().hex[:6]}")
        isolator.prepare(whole, container_config("task", directory="/tmp", gpu_count=8, check_command="true"))
        isolator.cleanup(whole)
    finally:
        isolator.cleanup(cid)
        isolator.close()


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_prepare_with_a_relative_rootfs_is_invalid_argument(sidecar):
    isolator = GrpcIsolator(sidecar.socket)
    try:
        with pytest.raises(HookFailed) as info:
            isolator.prepare(container_id("relative-rootfs"), _config("var/lib/mesos/rootfs"))
        assert info.value.code == "INVALID_ARGUMENT"
        assert "absolute" in info.value.message
    finally:
        isolator.close()
