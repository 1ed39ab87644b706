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


# ---- Each comparison and branch of the requirement check, at its boundary ----------------------
# A changed operator, a swapped branch or a dropped default must fail one of these (make mutation,
# docs/mutation.md). The driver is FACTS: 535.104.05, CUDA 12.2.


def _holds(require: str, facts: DriverFacts = FACTS) -> bool:
    try:
        check_cuda(Image((f"NVIDIA_REQUIRE_CUDA={require}",)), facts)
    except CudaVersionUnsupported:
        return False
    return True


@pytest.mark.parametrize(
    "cond, holds",
    [
        ("cuda>=12.1", True),
        ("cuda>=12.2", True),
        ("cuda>=12.3", False),
        ("cuda<=12.1", False),
        ("cuda<=12.2", True),
        ("cuda<=12.3", True),
        ("cuda>12.1", True),
        ("cuda>12.2", False),
        ("cuda>12.3", False),
        ("cuda<12.1", False),
        ("cuda<12.2", False),
        ("cuda<12.3", True),
        ("cuda=12.1", False),
        ("cuda=12.2", True),
        ("cuda=12.3", False),
        ("cuda==12.1", False),
        ("cuda==12.2", True),
        ("cuda==12.3", False),
        ("cuda=12.2.0", True),  # missing components are zeros
        ("cuda==12", False),
        ("cuda>=12", True),
        ("cuda<13", True),
        ("driver>=535", True),
        ("driver>535.104.05", False),
        ("driver>=535.104.06", False),
        ("driver=535.104.05", True),
        ("driver<536", True),
        ("driver<535.104.05", False),
        ("driver<=535.104.04", False),
    ],
)
def test_each_requirement_operator_at_its_boundary(cond, holds):
    assert _holds(cond) is holds


@pytest.mark.parametrize(
    "cond, facts, holds",
    [
        ("arch>=8.0", DriverFacts("535.104.05", "12.2", arch="8.0"), True),
        ("arch>=8.6", DriverFacts("535.104.05", "12.2", arch="8.0"), False),
        ("arch<8.6", DriverFacts("535.104.05", "12.2", arch="8.0"), True),
        ("arch=8.0", FACTS, False),  # arch unknown: the term does not hold
        ("arch<9.0", FACTS, False),
        ("brand=tesla", DriverFacts("535.104.05", "12.2", brand="Tesla"), True),
        ("brand=Tesla", DriverFacts("535.104.05", "12.2", brand="tesla"), True),
        ("brand=geforce", DriverFacts("535.104.05", "12.2", brand="tesla"), False),
        ("brand=tesla", FACTS, False),  # brand unknown
    ],
)
def test_arch_and_brand_terms_hold_only_when_the_driver_facts_know_them(cond, facts, holds):
    assert _holds(cond, facts) is holds


@pytest.mark.parametrize(
    "require, holds",
    [
        ("cuda>=12.4 cuda>=12.0", True),  # any alternative
        ("cuda>=12.0 cuda>=12.4", True),
        ("cuda>=12.4 cuda>=12.3", False),
        ("cuda>=12.0,driver>=535", True),  # all conditions of one alternative
        ("cuda>=12.0,driver>=536", False),
        ("driver>=536,cuda>=12.0", False),
        ("cuda>=12.0,,driver>=535,", True),  # empty conditions are ignored
        ("  cuda>=12.4  ", False),
    ],
)
def test_alternatives_need_one_and_each_alternative_needs_all_its_conditions(require, holds):
    assert _holds(require) is holds


def test_a_condition_in_no_known_form_is_refused_as_invalid_naming_it():
    with pytest.raises(InvalidImageConfig) as err:
        _holds("cuda>=12.0,vram>=16")
    assert err.value.fields == {
        "field": "NVIDIA_REQUIRE_CUDA",
        "value": "vram>=16",
        "cause": "expected cuda|driver|arch|brand<op><value>",
    }


def test_an_unreadable_version_names_where_it_came_from():
    with pytest.raises(InvalidImageConfig) as err:
        _holds("cuda>=12.x")
    assert err.value.fields == {
        "field": "NVIDIA_REQUIRE_CUDA",
        "value": "12.x",
        "cause": "expected a version like 12.4",
    }
    with pytest.raises(InvalidImageConfig) as err:
        _holds("driver>=535", DriverFacts("535.x", "12.2"))
    assert err.value.fields["field"] == "driver" and err.value.fields["value"] == "535.x"
    with pytest.raises(InvalidImageConfig) as err:
        _holds("arch>=8.0", DriverFacts("535.104.05", "12.2", arch="sm80"))
    assert err.value.fields["field"] == "arch"
    with pytest.raises(InvalidImageConfig) as err:
        check_cuda(Image(), DriverFacts("535.104.05", "twelve"))
    assert err.value.fields["field"] == "driver CUDA version"
    check_cuda(Image((), {"com.nvidia.cuda.version": "12"}), FACTS)  # a bare major is a version
    with pytest.raises(InvalidImageConfig) as err:
        check_cuda(Image((), {"com.nvidia.cuda.version": "v12"}), FACTS)
    assert err.value.fields["field"] == "com.nvidia.cuda.version"
    with pytest.raises(InvalidImageConfig) as err:
        check_cuda(Image(("CUDA_VERSION=12.",)), FACTS)
    assert err.value.fields["field"] == "CUDA_VERSION"


def test_versions_may_carry_surrounding_spaces():
    check_cuda(Image(("CUDA_VERSION= 12.2.1 ",)), DriverFacts("535.104.05", " 12.2 "))


@pytest.mark.parametrize(
    "require, asked",
    [
        ("cuda>=12.4 brand=tesla,driver>=535,driver<536", "12.4"),
        ("cuda>12.4", "12.4"),
        ("driver>=999", "driver>=999"),  # no cuda term: the expression itself
    ],
)
def test_refusal_names_the_cuda_version_the_requirement_asks_for(require, asked):
    with pytest.raises(CudaVersionUnsupported) as err:
        check_cuda(Image((f"NVIDIA_REQUIRE_CUDA={require}",)), FACTS, "/rootfs")
    assert err.value.fields == {
        "rootfs": "/rootfs",
        "required": asked,
        "source": f"NVIDIA_REQUIRE_CUDA={require}",
        "driver_version": "535.104.05",
        "driver_cuda": "12.2",
    }


def test_label_compares_major_minor_only_and_names_itself():
    check_cuda(Image((), {"com.nvidia.cuda.version": "12.2.9"}), FACTS)
    check_cuda(Image((), {"com.nvidia.cuda.version": "11.9"}), FACTS)
    with pytest.raises(CudaVersionUnsupported) as err:
        check_cuda(Image((), {"com.nvidia.cuda.version": "13.0"}), FACTS, "/r")
    assert err.value.fields == {
        "rootfs": "/r",
        "required": "13.0",
        "source": "label com.nvidia.cuda.version",
        "driver_version": "535.104.05",
        "driver_cuda": "12.2",
    }


def test_the_label_is_checked_even_when_the_env_checks_are_disabled():
    image = Image(("NVIDIA_DISABLE_REQUIRE=1",), {"com.nvidia.cuda.version": "12.3"})
    with pytest.raises(CudaVersionUnsupported):
        check_cuda(image, FACTS)


def test_cuda_version_env_compares_major_minor_only_and_names_itself():
    check_cuda(Image(("CUDA_VERSION=12.2.9",)), FACTS)
    check_cuda(Image(("CUDA_VERSION=11.8.0",)), FACTS)
    with pytest.raises(CudaVersionUnsupported) as err:
        check_cuda(Image(("CUDA_VERSION=12.3.0",)), FACTS, "/r")
    assert err.value.fields["required"] == "12.3"
    assert err.value.fields["source"] == "CUDA_VERSION=12.3.0"
    assert err.value.fields["rootfs"] == "/r"
    assert err.value.fields["driver_version"] == "535.104.05"
    assert err.value.fields["driver_cuda"] == "12.2"


@pytest.mark.parametrize(
    "value, checked",
    [("", True), ("0", True), ("false", True), ("FALSE", True), ("1", False), ("true", False), ("yes", False)],
)
def test_nvidia_disable_require_turns_the_env_checks_off_unless_false(value, checked):
    image = Image((f"NVIDIA_DISABLE_REQUIRE={value}", "NVIDIA_REQUIRE_CUDA=cuda>=12.4"))
    if checked:
        with pytest.raises(CudaVersionUnsupported):
            check_cuda(image, FACTS)
    else:
        check_cuda(image, FACTS)


def test_a_blank_requirement_falls_back_to_cuda_version():
    with pytest.raises(CudaVersionUnsupported) as err:
        check_cuda(Image(("NVIDIA_REQUIRE_CUDA=  ", "CUDA_VERSION=12.4")), FACTS)
    assert err.value.fields["source"] == "CUDA_VERSION=12.4"


def test_cuda_version_integer_drops_the_patch_digit():
    assert cuda_version_from_int(11080) == "11.8"
    assert cuda_version_from_int(12345) == "12.4"
    assert cuda_version_from_int(9020) == "9.2"


def test_image_env_keeps_values_with_equals_and_skips_entries_without():
    from volumes.inject import image_env

    assert image_env(Image(("NOEQUALS", "A=b=c", "A=d", "E="))) == {"A": "b=c", "E": ""}


def test_should_inject_says_why():
    assert should_inject(Image(("NVIDIA_VISIBLE_DEVICES=0,1",))) == (True, "image sets NVIDIA_VISIBLE_DEVICES=0,1")
    assert should_inject(Image(("NVIDIA_VISIBLE_DEVICES=void",))) == (
        False,
        "image sets NVIDIA_VISIBLE_DEVICES='void'",
    )
    assert should_inject(Image((), {"com.nvidia.volumes.needed": "x"})) == (
        True,
        "image has label com.nvidia.volumes.needed",
    )
    assert should_inject(Image()) == (
        False,
        "image neither sets NVIDIA_VISIBLE_DEVICES nor has label com.nvidia.volumes.needed",
    )


def test_env_drops_empty_components_and_does_not_repeat_what_the_image_has():
    got = volume_env(Image(("PATH=:/bin::/usr/local/nvidia/bin:", "LD_LIBRARY_PATH=/usr/local/cuda/compat")))
    assert got["PATH"] == "/bin:/usr/local/nvidia/bin"
    assert got["LD_LIBRARY_PATH"] == "/usr/local/cuda/compat:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    assert volume_env(Image(("PATH=",)))["PATH"] == "/usr/local/nvidia/bin"


def test_injection_carries_the_reason_the_env_and_a_target_under_a_root_rootfs():
    inj = plan_injection("/", Image(("NVIDIA_VISIBLE_DEVICES=all",)), VOL, FACTS)
    assert inj is not None
    assert inj.reason == "image sets NVIDIA_VISIBLE_DEVICES=all"
    assert inj.mounts[0].target == "/usr/local/nvidia"
    assert inj.env == volume_env(Image(("NVIDIA_VISIBLE_DEVICES=all",)))
    assert plan_injection("/rootfs", None, VOL, FACTS) is None
    assert plan_injection(None, Image(("NVIDIA_VISIBLE_DEVICES=all",)), VOL, FACTS) is None


def test_injection_refusal_names_the_rootfs():
    image = Image(("NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=13.0"))
    with pytest.raises(CudaVersionUnsupported) as err:
        plan_injection("/rootfs", image, VOL, FACTS)
    assert err.value.fields["rootfs"] == "/rootfs"


def test_a_shorter_requirement_is_padded_with_zeros():
    facts = DriverFacts("535.104.05", "12.0")
    assert _holds("cuda=12", facts)
    assert _holds("cuda<=12", facts)
    assert not _holds("cuda>12", facts)


def test_an_unreadable_arch_requirement_names_the_variable():
    with pytest.raises(InvalidImageConfig) as err:
        _holds("arch>=8.x", DriverFacts("535.104.05", "12.2", arch="8.0"))
    assert err.value.fields["field"] == "NVIDIA_REQUIRE_CUDA" and err.value.fields["value"] == "8.x"


def test_refusal_without_a_rootfs_names_an_empty_one():
    with pytest.raises(CudaVersionUnsupported) as err:
        check_cuda(Image(("CUDA_VERSION=13.0",)), FACTS)
    assert err.value.fields["rootfs"] == ""


def test_only_trailing_slashes_are_dropped_from_the_rootfs():
    inj = plan_injection("/rootfs/ID-X//", Image(("NVIDIA_VISIBLE_DEVICES=all",)), VOL, FACTS)
    assert inj is not None and inj.mounts[0].target == "/rootfs/ID-X/usr/local/nvidia"
