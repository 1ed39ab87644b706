"""Building nvidia_<version> from the simulated driver root: contents, skips, links, link vs copy,
crash safety, racing builders, noexec, and driver upgrades with reference-counted old volumes."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import paths
import pytest

from isolator.simhost.driver import build_driver_root
from volumes.build import VolumeBuilder
from volumes.discover import Discoverer, resolve_under
from volumes.errors import InvalidUser
from volumes.manager import VolumeManager
from volumes.manifest import MANIFEST_NAME, describe
from volumes.plan import plan_volume

REPO = paths.ROOT


# Module-scoped: under xdist, their users share one worker, so each is set up once (conftest.py).
SHARED_FIXTURES = ("sim", "plan")


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    return build_driver_root(str(tmp_path_factory.mktemp("driver")))


@pytest.fixture(scope="module")
def plan(sim):
    return plan_volume(Discoverer(sim.root, path=sim.path).discover(), sim.version)


def contents(path):
    out = {}
    for d in ("bin", "lib", "lib64"):
        out[d] = sorted(os.listdir(os.path.join(path, d)))
    return out


def test_volume_holds_the_drivers_files_in_bin_lib_and_lib64(sim, plan, tmp_path):
    result = VolumeBuilder(str(tmp_path / "volumes")).build(plan)
    assert result.built and result.path == str(tmp_path / "volumes" / f"nvidia_{sim.version}")
    got = contents(result.path)
    assert set(sim.binaries) <= set(got["bin"])
    assert set(sim.libraries64) <= set(got["lib64"])
    assert set(sim.libraries32) <= set(got["lib"])
    # Mesos's VolumeCreation test: these two must be there.
    assert os.access(os.path.join(result.path, "bin/nvidia-smi"), os.X_OK)
    assert os.path.isfile(os.path.join(result.path, "lib64/libnvidia-ml.so.1"))
    out = subprocess.run([os.path.join(result.path, "bin/nvidia-smi")], capture_output=True, text=True, check=True)
    assert sim.version in out.stdout


def test_foreign_gl_old_tls_and_stale_version_files_are_skipped_with_reasons(sim, plan, tmp_path):
    manifest = VolumeBuilder(str(tmp_path)).build(plan).manifest
    reasons = {s["path"]: s["reason"] for s in manifest["skipped"]}
    assert reasons[sim.foreign[0]] == "foreign-gl"
    assert reasons[sim.stale[0]] == "version-mismatch"
    assert reasons[sim.classic_tls[0]] == "old-tls-abi"
    names = {f["name"] for f in manifest["files"]}
    assert "libGL.so.1.2.0" not in names and not any("440.33.01" in n for n in names)


def test_symlinks_are_relative_and_resolve_inside_the_volume(sim, plan, tmp_path):
    path = VolumeBuilder(str(tmp_path)).build(plan).path
    v = sim.version
    for d, name, target in [
        ("lib64", "libcuda.so.1", f"libcuda.so.{v}"),
        ("lib64", "libcuda.so", "libcuda.so.1"),
        ("lib64", "libGLX_indirect.so.0", f"libGLX_nvidia.so.{v}"),
        ("lib", "libnvidia-ml.so.1", f"libnvidia-ml.so.{v}"),
    ]:
        link = os.path.join(path, d, name)
        assert os.readlink(link) == target
        assert os.path.realpath(link).startswith(path + "/")
        assert os.path.isfile(link)
    for d in ("lib", "lib64"):
        for name in os.listdir(os.path.join(path, d)):
            assert os.path.exists(os.path.join(path, d, name)), f"dangling {d}/{name}"


def test_same_filesystem_build_hard_links_and_reports_it(sim, plan, tmp_path):
    result = VolumeBuilder(str(tmp_path)).build(plan)
    assert result.manifest["mode"] == "link"
    src = os.stat(f"{sim.root}{sim.lib64_dir}/libcuda.so.{sim.version}")
    assert os.stat(os.path.join(result.path, f"lib64/libcuda.so.{sim.version}")).st_ino == src.st_ino


def test_manifest_records_version_groups_methods_and_skips(sim, plan, tmp_path):
    result = VolumeBuilder(str(tmp_path)).build(plan)
    with open(os.path.join(result.path, MANIFEST_NAME)) as fh:
        manifest = json.load(fh)
    assert manifest == result.manifest
    assert manifest["driver_version"] == sim.version and manifest["path"] == result.path
    assert all(manifest["counts"][g] > 0 for g in ("utility", "compute", "video", "graphics", "display"))
    assert sum(manifest["counts"].values()) == len(manifest["files"])
    text = describe(manifest)
    assert "foreign-gl" in text and sim.version in text


def test_a_second_build_reuses_the_complete_volume(plan, tmp_path):
    builder = VolumeBuilder(str(tmp_path))
    first = builder.build(plan)
    second = builder.ensure(plan.driver_version, lambda: pytest.fail("a complete volume must not be re-planned"))
    assert (first.built, second.built) == (True, False)
    assert second.manifest == first.manifest


def test_a_damaged_volume_is_moved_aside_and_rebuilt(plan, tmp_path):
    builder = VolumeBuilder(str(tmp_path))
    path = builder.build(plan).path
    os.unlink(os.path.join(path, "bin/nvidia-smi"))
    result = builder.build(plan)
    assert result.built and os.path.isfile(os.path.join(path, "bin/nvidia-smi"))
    assert result.manifest["replaced"] and os.path.isdir(result.manifest["replaced"])


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from volumes.build import VolumeBuilder
    from volumes.discover import Discoverer
    from volumes.plan import plan_volume
    root, volumes, path, version, at = sys.argv[1:6]
    plan = plan_volume(Discoverer(root, path=tuple(path.split(":"))).discover(), version)
    def progress(i, f):
        if i == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
    VolumeBuilder(volumes, progress=progress).build(plan)
    """
)


def test_a_builder_killed_half_way_leaves_no_volume_and_the_next_build_cleans_up(sim, plan, tmp_path):
    volumes = str(tmp_path / "volumes")
    args = [sys.executable, "-c", KILLER, sim.root, volumes, ":".join(sim.path), sim.version, "10"]
    proc = subprocess.run(args, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not os.path.exists(os.path.join(volumes, f"nvidia_{sim.version}"))
    leftovers = [n for n in os.listdir(volumes) if ".tmp-" in n]
    assert leftovers, "the kill should have interrupted a build in its temporary directory"
    result = VolumeBuilder(volumes).build(plan)
    assert result.built
    assert not [n for n in os.listdir(volumes) if ".tmp-" in n]


def test_an_injected_failure_half_way_leaves_no_volume(plan, tmp_path):
    def progress(i, f):
        if i == 5:
            raise OSError(28, "No space left on device", f.source)

    with pytest.raises(Exception, match="No space left"):
        VolumeBuilder(str(tmp_path), progress=progress).build(plan)
    assert os.listdir(tmp_path) == [f".nvidia_{plan.driver_version}.lock"]


def _race(volumes, plan, started, other_waiting, out):
    def progress(i, f):
        if i == 0:
            started.set()
            other_waiting.wait(10)

    try:
        out.put(VolumeBuilder(volumes, progress=progress).build(plan).built)
    except BaseException as exc:
        out.put(repr(exc))


def test_two_racing_builders_produce_one_correct_volume(plan, tmp_path):
    ctx = multiprocessing.get_context("fork")
    volumes = str(tmp_path / "volumes")
    started, second_started, out = ctx.Event(), ctx.Event(), ctx.Queue()
    a = ctx.Process(target=_race, args=(volumes, plan, started, second_started, out))
    a.start()
    assert started.wait(30)
    b = ctx.Process(target=_race, args=(volumes, plan, ctx.Event(), ctx.Event(), out))
    b.start()
    second_started.set()  # b is now on its way to the lock that a holds
    a.join(60)
    b.join(60)
    results = sorted([out.get(timeout=5), out.get(timeout=5)], key=str)
    assert results == [False, True]
    entries = sorted(n for n in os.listdir(volumes) if not n.endswith(".lock"))
    assert entries == [f"nvidia_{plan.driver_version}"]
    assert VolumeBuilder(volumes).existing(plan.driver_version) is not None


def test_a_driver_root_whose_32_bit_objects_were_written_without_gcc_gives_the_same_lib_dir(sim, plan, tmp_path):
    written = build_driver_root(str(tmp_path / "driver"), sim.version, elf32="writer")
    assert written.elf32_maker == "writer"
    other = plan_volume(Discoverer(written.root, path=written.path).discover(), sim.version)
    assert sorted(f.name for f in other.files if f.dir == "lib") == sorted(f.name for f in plan.files if f.dir == "lib")


def test_resolution_under_the_driver_root_never_leaves_it(tmp_path):
    root = tmp_path / "root"
    (root / "lib").mkdir(parents=True)
    (root / "lib/real.so").write_text("x")
    os.symlink("/lib/real.so", root / "lib/abs.so")
    os.symlink("../../../../../../lib/real.so", root / "lib/up.so")
    assert resolve_under(str(root), "/lib/abs.so") == "/lib/real.so"
    assert resolve_under(str(root), "/lib/up.so") == "/lib/real.so"
    os.symlink("loop", root / "lib/loop")
    with pytest.raises(OSError):
        resolve_under(str(root), "/lib/loop")


def _mount_tmpfs(path, opts="mode=755"):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


def _umount_all(path):
    while subprocess.run(["umount", path], capture_output=True).returncode == 0:
        pass


@pytest.mark.root
def test_a_volume_root_on_another_filesystem_gets_copies_and_says_so(sim, plan, tmp_path):
    volumes = str(tmp_path / "tmpfs")
    _mount_tmpfs(volumes)
    try:
        result = VolumeBuilder(volumes).build(plan)
        assert result.manifest["mode"] == "copy"
        assert {f["method"] for f in result.manifest["files"]} == {"copy"}
        src = os.stat(f"{sim.root}{sim.lib64_dir}/libcuda.so.{sim.version}")
        dst = os.stat(os.path.join(result.path, f"lib64/libcuda.so.{sim.version}"))
        assert dst.st_dev != src.st_dev and dst.st_size == src.st_size
        assert os.access(os.path.join(result.path, "bin/nvidia-smi"), os.X_OK)
    finally:
        _umount_all(volumes)


@pytest.mark.root
def test_a_noexec_volume_root_gets_a_tmpfs_so_binaries_run(sim, plan, tmp_path):
    volumes = str(tmp_path / "noexec")
    _mount_tmpfs(volumes, "mode=755,noexec")
    try:
        result = VolumeBuilder(volumes).build(plan)
        assert result.manifest["tmpfs"] is True
        subprocess.run([os.path.join(result.path, "bin/nvidia-smi")], check=True, capture_output=True)
    finally:
        _umount_all(volumes)


def test_driver_upgrade_builds_a_second_volume_and_the_first_lives_until_its_last_user_goes(tmp_path):
    root, volumes = str(tmp_path / "driver"), str(tmp_path / "volumes")
    old = build_driver_root(root, "550.54.15")
    manager = VolumeManager(volumes, root, path=old.path)
    first = manager.acquire("c1", "550.54.15")
    manager.acquire("c2", "550.54.15")
    new = build_driver_root(root, "555.42.02")  # upgraded in place: the 550 files stay behind
    second = manager.acquire("c3", new.version)
    assert second.path != first.path and second.built
    assert os.path.isdir(first.path) and os.path.isdir(second.path)
    skipped = {s["path"]: s["reason"] for s in second.manifest["skipped"]}
    assert skipped[f"{new.lib64_dir}/libnvidia-gpucomp.so.550.54.15"] == "version-mismatch"
    assert os.path.basename(os.path.realpath(os.path.join(second.path, "lib64/libcuda.so.1"))) == "libcuda.so.555.42.02"

    assert manager.release("c1", new.version) == ()
    assert os.path.isdir(first.path)  # c2 still uses it
    # A restarted sidecar sees the same users: the count lives on disk.
    manager = VolumeManager(volumes, root, path=old.path)
    assert manager.users() == {"550.54.15": ("c2",), "555.42.02": ("c3",)}
    assert manager.release("c2", new.version) == (first.path,)
    assert not os.path.exists(first.path)
    assert manager.release("c3", new.version) == ()
    assert os.path.isdir(second.path)  # the running driver's volume stays without users
    assert [m["driver_version"] for m in manager.volumes()] == [new.version]


def test_reconcile_drops_users_that_no_longer_exist(sim, tmp_path):
    manager = VolumeManager(str(tmp_path), sim.root, path=sim.path)
    manager.acquire("alive", sim.version)
    manager.acquire("gone.nested", sim.version)
    assert manager.reconcile({"alive"}) == ("gone.nested",)
    assert manager.users() == {sim.version: ("alive",)}


@pytest.mark.parametrize("bad", ["", "x" * 300])
def test_unrecordable_container_ids_are_refused(sim, tmp_path, bad):
    with pytest.raises(InvalidUser):
        VolumeManager(str(tmp_path), sim.root).acquire(bad, sim.version)


@pytest.mark.gpu
def test_volume_from_the_real_driver_has_nvidia_smi_and_nvml(tmp_path):
    version = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    result = VolumeManager(str(tmp_path)).ensure(version)
    assert os.path.isfile(os.path.join(result.path, "bin/nvidia-smi"))
    assert os.path.isfile(os.path.join(result.path, "lib64/libnvidia-ml.so.1"))
