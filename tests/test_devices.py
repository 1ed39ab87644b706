"""Device rules as data, the container rule set, and reading NVIDIA device numbers from a dev root."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolator.devices import (
    MESOS_DEFAULT_WHITELIST,
    ControlDevices,
    DeviceNumber,
    DeviceRule,
    HostDevices,
    container_rules,
    normalize,
    own_rules,
    permits,
)
from isolator.errors import DeviceNodeError, InvalidArgument, RuleParseError, UvmLoadError
from isolator.model import MigDevice
from isolator.simhost.devnodes import DeviceNumbers, make_device_nodes


@pytest.mark.parametrize(
    "text",
    ["c 195:0 rwm", "a *:* rwm", "b *:* m", "c 136:* rwm", "c *:* m", "c 1:3 r", "b 8:0 rw", "c 4095:1048575 w"],
)
def test_kernel_form_round_trips(text: str) -> None:
    assert str(DeviceRule.parse(text)) == text


def test_access_is_kept_in_canonical_order() -> None:
    assert DeviceRule.parse("c 1:3 mwr") == DeviceRule.parse("c 1:3 rwm")
    assert str(DeviceRule("c", 1, 3, "wr")) == "c 1:3 rw"


def test_a_alone_is_the_kernels_shorthand_for_everything() -> None:
    assert DeviceRule.parse("a") == DeviceRule("a", None, None, "rwm")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected"),
        ("x 1:3 rwm", "expected"),
        ("c 1:3", "expected"),
        ("c 1:3 rwx", "expected"),
        ("c 1:3 rr", "repeats"),
        ("c -1:3 rwm", "expected"),
        ("c 4096:0 rwm", "major 4096"),
        ("c 1:1048576 rwm", "minor 1048576"),
        ("a 1:3 rwm", "type 'a'"),
        ("c 1:3 rwm extra", "expected"),
        ("c  1:3 rwm", "expected"),
        ("c 1:3\nrwm", "expected"),
    ],
)
def test_bad_rule_strings_are_a_typed_error_naming_the_problem(text: str, reason: str) -> None:
    with pytest.raises(RuleParseError, match=reason) as info:
        DeviceRule.parse(text)
    assert info.value.code == "INVALID_ARGUMENT"


def test_constructing_an_invalid_rule_directly_is_refused_too() -> None:
    with pytest.raises(RuleParseError):
        DeviceRule("c", 1, 3, "")
    with pytest.raises(RuleParseError):
        DeviceRule("z", 1, 3, "r")


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        ("a *:* rwm", "c 195:0 rwm", True),
        ("a *:* m", "b 8:0 m", True),
        ("a *:* m", "c 195:0 r", False),
        ("c *:* m", "c 195:0 m", True),
        ("c *:* m", "b 8:0 m", False),
        ("c 136:* rwm", "c 136:4 rw", True),
        ("c 136:* rwm", "c 137:4 r", False),
        ("c 195:0 rw", "c 195:0 rwm", False),
        ("c 195:0 rwm", "c 195:* r", False),
        ("c 195:0 rwm", "c 195:0 rwm", True),
        ("c 195:0 r", "c 195:1 r", False),
    ],
)
def test_encompasses(outer: str, inner: str, expected: bool) -> None:
    assert DeviceRule.parse(outer).encompasses(DeviceRule.parse(inner)) is expected


rules_strategy = st.builds(
    DeviceRule,
    st.sampled_from("bc"),
    st.one_of(st.none(), st.integers(0, 4)),
    st.one_of(st.none(), st.integers(0, 4)),
    st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]),
)


@given(st.lists(rules_strategy, max_size=8), rules_strategy)
def test_normalize_never_changes_what_is_permitted(rules: list[DeviceRule], request: DeviceRule) -> None:
    assert permits(normalize(rules), request) == permits(rules, request)


def test_mesos_default_whitelist_has_the_fourteen_entries_of_the_reference() -> None:
    assert len(MESOS_DEFAULT_WHITELIST) == 14
    text = {str(r) for r in MESOS_DEFAULT_WHITELIST}
    assert {"c *:* m", "b *:* m", "c 136:* rwm", "c 10:200 rwm", "c 1:3 rwm", "c 1:9 rwm", "c 5:2 rwm"} <= text


CONTROL = ControlDevices(nvidiactl=DeviceNumber(195, 255), uvm=DeviceNumber(511, 0), uvm_tools=DeviceNumber(511, 1))


def test_rule_set_is_whitelist_then_control_devices_then_gpus() -> None:
    rules = container_rules(CONTROL, [3, 1])
    assert rules[:14] == MESOS_DEFAULT_WHITELIST
    assert [str(r) for r in rules[14:]] == [
        "c 195:255 rwm",
        "c 511:0 rwm",
        "c 511:1 rwm",
        "c 195:1 rwm",
        "c 195:3 rwm",
    ]


def test_zero_gpus_still_get_the_control_devices_so_nvidia_smi_works() -> None:
    assert [str(r) for r in own_rules(container_rules(CONTROL, []), MESOS_DEFAULT_WHITELIST)] == [
        "c 195:255 rwm",
        "c 511:0 rwm",
        "c 511:1 rwm",
    ]


def test_uvm_tools_and_modeset_appear_only_when_present_or_configured() -> None:
    bare = ControlDevices(nvidiactl=DeviceNumber(195, 255), uvm=DeviceNumber(511, 0))
    assert "c 511:1 rwm" not in {str(r) for r in container_rules(bare, [])}
    with_modeset = ControlDevices(DeviceNumber(195, 255), DeviceNumber(511, 0), None, DeviceNumber(195, 254))
    assert "c 195:254 rwm" in {str(r) for r in container_rules(with_modeset, [])}


def test_mig_devices_add_their_caps_nodes() -> None:
    mig = MigDevice("GPU-a", "MIG-b", gpu_instance_id=1, compute_instance_id=0, caps_minors=(12, 13))
    own = own_rules(container_rules(CONTROL, [0], [mig], caps_major=508), MESOS_DEFAULT_WHITELIST)
    assert [str(r) for r in own][-2:] == ["c 508:12 rwm", "c 508:13 rwm"]


def test_mig_devices_without_a_caps_major_are_refused() -> None:
    mig = MigDevice("GPU-a", "MIG-b", gpu_instance_id=1, compute_instance_id=0, caps_minors=(12,))
    with pytest.raises(InvalidArgument, match="nvidia-caps major"):
        container_rules(CONTROL, [0], [mig])


def test_invalid_gpu_minor_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="GPU minor"):
        container_rules(CONTROL, [-1])


# ---- HostDevices on a simulated dev root (mknod needs root) ------------------------------------

NUMBERS = DeviceNumbers(uvm_major=241, caps_major=242)


@pytest.mark.root
def test_control_device_numbers_are_read_with_stat(short_tmp: str) -> None:
    make_device_nodes(short_tmp, [0], NUMBERS, caps_minors=(1, 2))
    host = HostDevices(short_tmp)
    control = host.control_devices()
    assert (control.nvidiactl.major, control.nvidiactl.minor) == (195, 255)
    assert (control.uvm.major, control.uvm.minor) == (241, 0)
    assert control.uvm_tools is not None and control.uvm_tools.minor == 1
    assert control.modeset is None
    assert host.control_devices(modeset=True).modeset == DeviceNumber(195, 254, host.path("nvidia-modeset"))
    assert host.caps_major() == 242


@pytest.mark.root
def test_missing_uvm_tools_is_optional_but_missing_nvidiactl_is_an_error(short_tmp: str) -> None:
    make_device_nodes(short_tmp, [0], NUMBERS, uvm_tools=False)
    host = HostDevices(short_tmp)
    assert host.control_devices().uvm_tools is None
    assert host.caps_major() is None
    os.unlink(host.path("nvidiactl"))
    with pytest.raises(DeviceNodeError, match="nvidiactl"):
        host.control_devices()


def test_a_regular_file_where_a_node_should_be_is_refused(short_tmp: str) -> None:
    open(os.path.join(short_tmp, "nvidiactl"), "w").close()
    with pytest.raises(DeviceNodeError, match="not a character device"):
        HostDevices(short_tmp).stat_char(os.path.join(short_tmp, "nvidiactl"))


@pytest.mark.root
def test_load_uvm_runs_the_command_only_when_the_node_is_missing(short_tmp: str) -> None:
    node = os.path.join(short_tmp, "nvidia-uvm")
    # Stands in for nvidia-modprobe -u -c 0: creates the node as the driver would.
    script = f"import os, stat; os.mknod({node!r}, 0o666 | stat.S_IFCHR, os.makedev(241, 0))"
    host = HostDevices(short_tmp, ["python3", "-c", script])
    assert host.load_uvm() is True
    assert stat.S_ISCHR(os.stat(node).st_mode)
    assert host.load_uvm() is False


def test_load_uvm_failure_is_a_clear_error(short_tmp: str) -> None:
    with pytest.raises(UvmLoadError, match=r"nvidia-uvm'.*exited with 3: no module"):
        HostDevices(short_tmp, ["sh", "-c", "echo no module >&2; exit 3"]).load_uvm()
    with pytest.raises(UvmLoadError, match="succeeded but the node is absent"):
        HostDevices(short_tmp, ["true"]).load_uvm()
    with pytest.raises(UvmLoadError, match="not installed"):
        HostDevices(short_tmp, ["nvidia-modprobe-does-not-exist", "-u"]).load_uvm()
