"""Device rules as data, the container rule set, and reading NVIDIA device numbers from a dev root."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolator.errors import DeviceNodeError, InvalidArgument, RuleParseError, UvmLoadError
from isolator.host.devices import HostDevices
from isolator.model import MigDevice
from isolator.policy.devices import (
    MESOS_DEFAULT_WHITELIST,
    ControlDevices,
    DeviceNumber,
    DeviceRule,
    container_rules,
    is_owned,
    normalize,
    owned_majors,
    permits,
)
from isolator.simhost.devnodes import DeviceNumbers, make_device_nodes
from isolator.testing.rules import own_rules


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


# ---- Boundaries and the exact reasons, so a changed comparison or message is noticed ------------
# (make mutation, docs/mutation.md)


def _reason(**kw: object) -> str:
    args = {"type": "c", "major": 1, "minor": 3, "access": "rwm"} | kw
    with pytest.raises(RuleParseError) as info:
        DeviceRule(args["type"], args["major"], args["minor"], args["access"])  # type: ignore[arg-type]
    return str(info.value.fields["reason"])


@pytest.mark.parametrize(("major", "minor"), [(0, 0), (4095, 0), (0, 1048575), (4095, 1048575)])
def test_device_numbers_at_the_dev_t_limits_are_accepted(major: int, minor: int) -> None:
    assert DeviceRule("b", major, minor).selector == ("b", major, minor)


def test_each_field_problem_is_named_exactly() -> None:
    assert _reason(type="d") == "type 'd' is not one of a, b, c"
    assert _reason(major=4096) == "major 4096 is not an integer in 0..4095"
    assert _reason(major=-1) == "major -1 is not an integer in 0..4095"
    assert _reason(minor=1048576) == "minor 1048576 is not an integer in 0..1048575"
    assert _reason(minor=-1) == "minor -1 is not an integer in 0..1048575"
    assert _reason(major=True) == "major True is not an integer in 0..4095"
    assert _reason(minor="3") == "minor '3' is not an integer in 0..1048575"
    assert _reason(type="a", major=None, minor=3) == "type 'a' covers every device and takes '*:*'"
    assert _reason(type="a", major=1, minor=None) == "type 'a' covers every device and takes '*:*'"
    assert _reason(access="") == "access '' must be a non-empty subset of 'rwm'"
    assert _reason(access="rx") == "access 'rx' must be a non-empty subset of 'rwm'"
    assert _reason(access=None) == "access None must be a non-empty subset of 'rwm'"
    assert _reason(access="rwr") == "access 'rwr' repeats a letter"


def test_the_error_shows_the_rule_as_given() -> None:
    with pytest.raises(RuleParseError) as info:
        DeviceRule("c", 1, 4096 * 256, "rw")
    assert info.value.fields["value"] == "c 1:1048576 rw"
    assert info.value.message.startswith("invalid device rule 'c 1:1048576 rw': minor")


def test_parse_errors_name_the_text_cut_to_80_characters() -> None:
    with pytest.raises(RuleParseError) as info:
        DeviceRule.parse("c 1:3 " + "r" * 100)
    assert info.value.fields == {
        "value": ("c 1:3 " + "r" * 100)[:80],
        "reason": "expected '<a|b|c> <major|*>:<minor|*> <access of rwm>'",
    }
    with pytest.raises(RuleParseError) as info:
        DeviceRule.parse("c 1:3 rwr")
    assert info.value.fields == {"value": "c 1:3 rwr", "reason": "access 'rwr' repeats a letter"}
    with pytest.raises(RuleParseError) as info:
        DeviceRule.parse(None)  # type: ignore[arg-type]
    assert info.value.fields == {"value": "None", "reason": "must be a string"}


def test_parse_strips_surrounding_whitespace_and_reads_wildcards() -> None:
    assert DeviceRule.parse("  c 136:* rw \n") == DeviceRule("c", 136, None, "rw")
    assert DeviceRule.parse("b *:7 m") == DeviceRule("b", None, 7, "m")
    assert DeviceRule.parse(" a ") == DeviceRule("a", None, None, "rwm")
    assert DeviceRule.parse("c 0:0 w") == DeviceRule("c", 0, 0, "w")


def test_wildcard_and_sort_key() -> None:
    assert DeviceRule.parse("a *:* r").is_wildcard
    assert DeviceRule.parse("c *:3 r").is_wildcard
    assert DeviceRule.parse("c 3:* r").is_wildcard
    assert not DeviceRule.parse("c 3:3 r").is_wildcard
    assert DeviceRule.parse("c 3:4 rw").sort_key() == ("c", 3, 4, "rw")
    assert DeviceRule.parse("c *:* m").sort_key() == ("c", -1, -1, "m")
    assert DeviceRule.char(195, 2, "r") == DeviceRule("c", 195, 2, "r")
    assert DeviceRule.char(195, 2).access == "rwm"


@pytest.mark.parametrize(
    ("outer", "inner", "expected"),
    [
        ("c 195:* rwm", "c *:0 r", False),  # a wildcard request is not one the narrower rule covers
        ("c *:0 rwm", "c 195:0 r", True),
        ("c *:0 rwm", "c 195:1 r", False),
        ("b 8:0 rwm", "c 8:0 r", False),
        ("a *:* rw", "a *:* rwm", False),
        ("c 1:3 rwm", "a *:* r", False),
    ],
)
def test_encompasses_each_field(outer: str, inner: str, expected: bool) -> None:
    assert DeviceRule.parse(outer).encompasses(DeviceRule.parse(inner)) is expected


def test_parse_rules_skips_blank_lines() -> None:
    from isolator.policy.devices import parse_rules

    assert parse_rules(["c 1:3 r", "", "   ", "b 8:0 m"]) == (DeviceRule("c", 1, 3, "r"), DeviceRule("b", 8, 0, "m"))


def test_normalize_keeps_first_seen_order_and_drops_duplicates_and_covered_rules() -> None:
    rules = [DeviceRule.parse(t) for t in ("c 1:3 r", "c 5:1 rwm", "c 1:3 r", "c 1:* rw", "b 8:0 m")]
    assert [str(r) for r in normalize(rules)] == ["c 5:1 rwm", "c 1:* rw", "b 8:0 m"]


def test_permits_needs_one_rule_covering_the_whole_request() -> None:
    rules = [DeviceRule.parse("c 1:3 r"), DeviceRule.parse("c 1:3 w")]
    assert permits(rules, DeviceRule.parse("c 1:3 w"))
    assert not permits(rules, DeviceRule.parse("c 1:3 rw"))  # as the kernel: no union across rules
    assert not permits([], DeviceRule.parse("c 1:3 r"))


@pytest.mark.parametrize("minor", [0, 1048575])
def test_gpu_minors_at_the_limits_are_granted(minor: int) -> None:
    assert str(container_rules(CONTROL, [minor])[-1]) == f"c 195:{minor} rwm"


@pytest.mark.parametrize("minor", [1048576, True, "0"])
def test_gpu_minors_beyond_the_limit_or_not_integers_are_refused(minor: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        container_rules(CONTROL, [minor])  # type: ignore[list-item]
    assert info.value.message == f"invalid GPU minor {minor!r}"


def test_repeated_gpus_and_caps_appear_once_and_a_custom_base_is_used() -> None:
    mig_a = MigDevice("GPU-a", "MIG-a", gpu_instance_id=1, compute_instance_id=0, caps_minors=(13, 12))
    mig_b = MigDevice("GPU-a", "MIG-b", gpu_instance_id=2, compute_instance_id=0, caps_minors=(12, 14))
    base = (DeviceRule.parse("c 1:3 rwm"), DeviceRule.parse("c 195:255 rwm"))
    rules = container_rules(CONTROL, [2, 2, 0], [mig_a, mig_b], caps_major=508, base=base)
    assert [str(r) for r in rules] == [
        "c 1:3 rwm",
        "c 195:255 rwm",  # in base and a control device: once
        "c 511:0 rwm",
        "c 511:1 rwm",
        "c 195:0 rwm",
        "c 195:2 rwm",
        "c 508:12 rwm",
        "c 508:13 rwm",
        "c 508:14 rwm",
    ]


def test_mig_devices_without_caps_nodes_need_no_caps_major() -> None:
    mig = MigDevice("GPU-a", "MIG-b", gpu_instance_id=1, compute_instance_id=0, caps_minors=())
    assert container_rules(CONTROL, [0], [mig]) == container_rules(CONTROL, [0])


def test_missing_caps_major_message() -> None:
    mig = MigDevice("GPU-a", "MIG-b", gpu_instance_id=1, compute_instance_id=0, caps_minors=(12,))
    with pytest.raises(InvalidArgument) as info:
        container_rules(CONTROL, [0], [mig])
    assert info.value.message == "MIG devices need the nvidia-caps major, and none was given"


def test_device_number_rule_and_control_device_order() -> None:
    assert DeviceNumber(195, 0).rule("rw") == DeviceRule("c", 195, 0, "rw")
    assert DeviceNumber(195, 0).rule() == DeviceRule("c", 195, 0, "rwm")
    full = ControlDevices(DeviceNumber(195, 255), DeviceNumber(511, 0), DeviceNumber(511, 1), DeviceNumber(195, 254))
    assert [(d.major, d.minor) for d in full.numbers()] == [(195, 255), (511, 0), (511, 1), (195, 254)]


def test_host_devices_join_names_under_the_dev_root() -> None:
    host = HostDevices("/srv/dev")
    assert host.path("nvidiactl") == "/srv/dev/nvidiactl"
    assert host.uvm_load_command == ("nvidia-modprobe", "-u", "-c", "0")


def test_stat_of_a_missing_node_names_the_path_and_the_cause(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "nvidiactl")
    with pytest.raises(DeviceNodeError) as info:
        HostDevices(short_tmp).stat_char(path)
    assert info.value.fields == {"path": path, "cause": "No such file or directory"}


def test_caps_major_is_none_without_the_caps_directory_and_names_an_unreadable_one(short_tmp: str) -> None:
    assert HostDevices(short_tmp).caps_major() is None
    open(os.path.join(short_tmp, "nvidia-caps"), "w").close()  # a file where the directory should be
    with pytest.raises(DeviceNodeError) as info:
        HostDevices(short_tmp).caps_major()
    assert info.value.fields == {"path": os.path.join(short_tmp, "nvidia-caps"), "cause": "Not a directory"}


def test_caps_major_ignores_other_names_and_is_none_for_an_empty_directory(short_tmp: str) -> None:
    caps = os.path.join(short_tmp, "nvidia-caps")
    os.mkdir(caps)
    assert HostDevices(short_tmp).caps_major() is None
    open(os.path.join(caps, "README"), "w").close()  # not a node, and not a nvidia-cap name
    assert HostDevices(short_tmp).caps_major() is None


def test_load_uvm_errors_name_the_node_and_the_command(short_tmp: str) -> None:
    node = os.path.join(short_tmp, "nvidia-uvm")
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["sh", "-c", "echo out; exit 4"]).load_uvm()
    assert info.value.fields == {"path": node, "cause": "sh -c echo out; exit 4 exited with 4: out"}
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["true", "x"]).load_uvm()
    assert info.value.fields == {"path": node, "cause": "true x succeeded but the node is absent"}
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["no-such-modprobe", "-u"]).load_uvm()
    assert info.value.fields == {
        "path": node,
        "cause": "no-such-modprobe is not installed (it ships with the NVIDIA driver)",
    }
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, [short_tmp]).load_uvm()  # a directory: PermissionError, an OSError
    assert info.value.fields["cause"].startswith(f"{short_tmp}: [Errno 13]")


def test_load_uvm_does_nothing_when_the_node_exists_even_as_a_dangling_link(short_tmp: str) -> None:
    os.symlink("/nonexistent", os.path.join(short_tmp, "nvidia-uvm"))
    assert HostDevices(short_tmp, ["false"]).load_uvm() is False


def test_a_wildcard_major_does_not_skip_checking_the_minor() -> None:
    assert _reason(major=None, minor=1048576) == "minor 1048576 is not an integer in 0..1048575"


def test_parse_errors_name_at_most_80_characters_even_of_padding() -> None:
    text = " " * 79 + "c 1:3 rr"
    with pytest.raises(RuleParseError) as info:
        DeviceRule.parse(text)
    assert info.value.fields["value"] == " " * 79 + "c"
    with pytest.raises(RuleParseError) as info:
        DeviceRule.parse(5)  # type: ignore[arg-type]
    assert info.value.fields["value"] == "5"


def test_a_regular_file_is_refused_naming_the_path(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "nvidia0")
    open(path, "w").close()
    with pytest.raises(DeviceNodeError) as info:
        HostDevices(short_tmp).stat_char(path)
    assert info.value.fields == {"path": path, "cause": "not a character device"}


@pytest.mark.root
def test_caps_nodes_that_disagree_name_the_directory(short_tmp: str) -> None:
    caps = os.path.join(short_tmp, "nvidia-caps")
    os.mkdir(caps)
    os.mknod(os.path.join(caps, "nvidia-cap1"), 0o600 | stat.S_IFCHR, os.makedev(242, 1))
    os.mknod(os.path.join(caps, "nvidia-cap2"), 0o600 | stat.S_IFCHR, os.makedev(243, 2))
    with pytest.raises(DeviceNodeError) as info:
        HostDevices(short_tmp).caps_major()
    assert info.value.fields == {"path": caps, "cause": "nodes disagree on the major: [242, 243]"}


def test_load_uvm_logs_the_missing_node_and_the_command(short_tmp: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="isolator.host.devices")
    with pytest.raises(UvmLoadError):
        HostDevices(short_tmp, ["true", "-u"]).load_uvm()
    node = os.path.join(short_tmp, "nvidia-uvm")
    assert [r.getMessage() for r in caplog.records if r.name == "isolator.host.devices"] == [
        f"'{node}' is missing; running true -u"
    ]


def test_load_uvm_that_cannot_start_names_the_node_and_the_whole_command(short_tmp: str) -> None:
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, [short_tmp, "-u"]).load_uvm()  # a directory: PermissionError
    assert info.value.fields["path"] == os.path.join(short_tmp, "nvidia-uvm")
    assert info.value.fields["cause"].startswith(f"{short_tmp} -u: [Errno 13]")


def test_load_uvm_failure_keeps_the_last_400_characters_of_stderr(short_tmp: str) -> None:
    script = "import sys; sys.stderr.write('x' * 500 + 'E' * 400); sys.exit(1)"
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["python3", "-c", script]).load_uvm()
    assert info.value.fields["cause"].endswith(" exited with 1: " + "E" * 400)


def test_a_program_found_only_as_a_file_that_cannot_run_is_not_installed(short_tmp: str, monkeypatch) -> None:
    # A PATH entry holding a same-named file without execute permission (or one this user may not
    # search) makes exec fail with EACCES, not ENOENT; the error still says the program is absent.
    bin_dir = os.path.join(short_tmp, "bin")
    os.mkdir(bin_dir)
    with open(os.path.join(bin_dir, "nvidia-modprobe-stub"), "w") as fh:
        fh.write("#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("PATH", bin_dir)
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["nvidia-modprobe-stub", "-u"]).load_uvm()
    assert info.value.fields["cause"] == "nvidia-modprobe-stub is not installed (it ships with the NVIDIA driver)"


def test_a_uvm_load_command_given_by_a_path_that_does_not_exist_is_not_installed(short_tmp: str) -> None:
    with pytest.raises(UvmLoadError) as info:
        HostDevices(short_tmp, ["/nonexistent/nvidia-modprobe", "-u"]).load_uvm()
    assert info.value.fields == {
        "path": os.path.join(short_tmp, "nvidia-uvm"),
        "cause": "/nonexistent/nvidia-modprobe is not installed (it ships with the NVIDIA driver)",
    }


def test_mesos_mode_owns_nvidias_majors_and_the_majors_of_its_own_rules_only() -> None:
    base = [DeviceRule.parse("c 1:3 rwm"), DeviceRule.parse("c 136:* rwm")]
    rules = [
        *base,
        DeviceRule.parse("c 195:0 rwm"),
        DeviceRule.parse("c 240:1 rw"),  # ours: a GPU-related node with a dynamic major
        DeviceRule.parse("b 8:0 rw"),  # a block device is never ours
        DeviceRule.parse("c *:* m"),  # nor a wildcard major
    ]
    assert owned_majors(rules, base) == frozenset({195, 240})
    assert owned_majors(rules, base, known=(195, 508, 511)) == frozenset({195, 240, 508, 511})
    # 195 is always owned, even when ``known`` leaves it out.
    assert owned_majors([], [], known=(508,)) == frozenset({195, 508})
    # A rule that is also in the base set is the agent's, whatever its major.
    assert owned_majors([DeviceRule.parse("c 136:* rwm")], base) == frozenset({195})
    majors = frozenset({195, 240})
    assert is_owned(DeviceRule.parse("c 195:3 rwm"), majors)
    assert is_owned(DeviceRule.parse("c 240:0 r"), majors)
    assert not is_owned(DeviceRule.parse("c 136:0 rwm"), majors)
    assert not is_owned(DeviceRule.parse("b 195:0 rwm"), majors)
    assert not is_owned(DeviceRule.parse("c *:* m"), majors)
