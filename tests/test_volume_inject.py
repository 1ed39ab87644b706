"""Injection decisions, the environment built from the image's own values, and the CUDA refusal."""

from __future__ import annotations

import pytest

from volumes.errors import CudaVersionUnsupported, InvalidImageConfig
from volumes.inject import (
    DEFAULT_PATH,
    VOLUME_MOUNT_FLAGS,
    DriverFacts,
    Image,
    check_cuda,
    cuda_version_from_int,
    plan_injection,
    should_inject,
    volume_env,
)

FACTS = DriverFacts(driver_version="535.104.05", cuda_version="12.2")
VOL = "/var/run/mesos/isolators/gpu/nvidia_535.104.05"


@pytest.mark.parametrize(
    "env, labels, expected",
    [
        (("NVIDIA_VISIBLE_DEVICES=all",), None, True),
        (("NVIDIA_VISIBLE_DEVICES=0,1",), None, True),
        (("NVIDIA_VISIBLE_DEVICES=none",), None, True),  # Mesos: any value but "" and void
        (("NVIDIA_VISIBLE_DEVICES=",), None, False),
        (("NVIDIA_VISIBLE_DEVICES=void",), None, False),
        (("NVIDIA_VISIBLE_DEVICES=void",), {"com.nvidia.volumes.needed": "nvidia_driver"}, False),  # env decides first
        ((), {"com.nvidia.volumes.needed": "nvidia_driver"}, True),
        ((), {"com.nvidia.volumes.needed": ""}, True),  # the value is ignored
        (("PATH=/bin",), {"maintainer": "x"}, False),
        (("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"), None, True),  # first wins
    ],
)
def test_should_inject_follows_mesos(env, labels, expected):
    assert should_inject(Image(env, labels))[0] is expected


@pytest.mark.parametrize(
    "env, path, ld",
    [
        (
            (),
            DEFAULT_PATH + ":/usr/local/nvidia/bin",
            "/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
        ),
        (("PATH=/usr/bin:/bin",), "/usr/bin:/bin:/usr/local/nvidia/bin", None),
        (("PATH=/usr/local/nvidia/bin:/usr/bin",), "/usr/local/nvidia/bin:/usr/bin", None),
        (
            ("LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",),
            None,
            "/usr/local/nvidia/lib:/usr/local/nvidia/lib64:/usr/local/cuda/compat",
        ),
        (
            ("LD_LIBRARY_PATH=/opt/lib",),
            None,
            "/opt/lib:/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
        ),
        (("LD_LIBRARY_PATH=",), None, "/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"),
    ],
)
def test_env_appends_each_missing_path_in_order_to_the_images_own_value(env, path, ld):
    got = volume_env(Image(env))
    if path is not None:
        assert got["PATH"] == path
    if ld is not None:
        assert got["LD_LIBRARY_PATH"] == ld
    assert "::" not in got["LD_LIBRARY_PATH"] and not got["LD_LIBRARY_PATH"].startswith(":")


def test_injection_is_a_read_only_recursive_bind_mount_at_usr_local_nvidia():
    inj = plan_injection("/rootfs/", Image(("NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin")), VOL, FACTS)
    assert inj is not None
    (mount,) = inj.mounts
    assert (mount.source, mount.target, mount.flags) == (VOL, "/rootfs/usr/local/nvidia", 1 | 4096 | 16384)
    assert mount.flags == VOLUME_MOUNT_FLAGS and mount.mkdir
    assert inj.env["PATH"] == "/bin:/usr/local/nvidia/bin"


def test_containers_without_an_image_or_without_the_marker_get_no_volume():
    assert plan_injection(None, None, VOL, FACTS) is None
    assert plan_injection("/rootfs", Image(("PATH=/bin",)), VOL, FACTS) is None


@pytest.mark.parametrize(
    "env, labels, refused",
    [
        ((), {"com.nvidia.cuda.version": "12.2"}, False),
        ((), {"com.nvidia.cuda.version": "12.3"}, True),
        ((), {"com.nvidia.cuda.version": "9.0"}, False),
        (("NVIDIA_REQUIRE_CUDA=cuda>=12.4",), None, True),
        (("NVIDIA_REQUIRE_CUDA=cuda>=11.8",), None, False),
        # Forward compatibility: the alternative for this driver branch holds when the brand is known.
        (("NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,driver>=535,driver<536",), None, True),
        (("CUDA_VERSION=12.4.1",), None, True),
        (("CUDA_VERSION=12.2.0",), None, False),
        (("CUDA_VERSION=12.4.1", "NVIDIA_DISABLE_REQUIRE=1"), None, False),
        (("NVIDIA_REQUIRE_CUDA=cuda>=11.0", "CUDA_VERSION=12.9"), None, False),  # REQUIRE wins over CUDA_VERSION
    ],
)
def test_cuda_requirement_table(env, labels, refused):
    image = Image(env, labels)
    if refused:
        with pytest.raises(CudaVersionUnsupported):
            check_cuda(image, FACTS)
    else:
        check_cuda(image, FACTS)


def test_forward_compat_alternative_is_accepted_for_a_known_brand():
    image = Image(("NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,driver>=535,driver<536",))
    check_cuda(image, DriverFacts("535.104.05", "12.2", brand="Tesla"))


def test_refusal_names_both_versions():
    image = Image(("NVIDIA_VISIBLE_DEVICES=all",), {"com.nvidia.cuda.version": "12.4"})
    with pytest.raises(CudaVersionUnsupported) as err:
        plan_injection("/rootfs", image, VOL, FACTS)
    assert "CUDA 12.4" in err.value.message and "CUDA 12.2" in err.value.message
    assert "535.104.05" in err.value.message
    assert err.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("env", [("CUDA_VERSION=latest",), ("NVIDIA_REQUIRE_CUDA=cuda~12",)])
def test_unreadable_requirements_are_invalid_arguments(env):
    with pytest.raises(InvalidImageConfig):
        check_cuda(Image(env), FACTS)


def test_cuda_driver_version_integer_formats_like_v1():
    assert cuda_version_from_int(8000) == "8.0"
    assert cuda_version_from_int(12040) == "12.4"
