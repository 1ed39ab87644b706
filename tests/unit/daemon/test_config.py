from __future__ import annotations

import re

import pytest

from isolator.cli.main import build_parser
from isolator.daemon import config as configmod
from isolator.errors import ConfigError


def resolve(*argv: str) -> configmod.Config:
    args = build_parser().parse_args(["serve", *argv])
    return configmod.resolve(args)


def test_defaults_mirror_mesos_agent_flags():
    cfg = resolve()
    assert cfg.socket == configmod.DEFAULT_SOCKET
    assert cfg.socket_mode == 0o600
    assert cfg.cgroups_hierarchy == "/sys/fs/cgroup"
    assert cfg.cgroups_root == "mesos"
    assert cfg.volume_root == "/var/run/mesos/isolators/gpu"
    assert cfg.mode == "mesos"
    assert cfg.allocation_policy == "topology"
    assert cfg.nvidia_gpu_devices is None


def test_flags_override_config_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "sidecar.toml"
    path.write_text('mode = "standalone"\nsocket = "/tmp/from-file.sock"\nnvidia-gpu-devices = [0, 2]\n')
    cfg = resolve("--config", str(path), "--socket", "/tmp/from-flag.sock")
    assert cfg.socket == "/tmp/from-flag.sock"
    assert cfg.mode == "standalone"
    assert cfg.nvidia_gpu_devices == (0, 2)
    assert cfg.config_file == str(path)


def test_relative_paths_are_made_absolute_once_at_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve("--socket", "s.sock", "--work-dir", "work")
    assert cfg.socket == str(tmp_path / "s.sock")
    assert cfg.state_dir == str(tmp_path / "work" / "state")


def test_nvidia_gpu_devices_flag_is_a_list_of_indices():
    assert resolve("--nvidia-gpu-devices", "0,1, 3").nvidia_gpu_devices == (0, 1, 3)
    with pytest.raises(ConfigError, match="'x' is not an integer"):
        resolve("--nvidia-gpu-devices", "0,x")
    with pytest.raises(ConfigError, match="-1 is not a valid NVML index"):
        resolve("--nvidia-gpu-devices", "-1")


@pytest.mark.parametrize("key", ["allowed_uids", "allowed_gids"])
def test_allowed_ids_are_user_or_group_ids_in_the_file_and_on_the_command_line(tmp_path, key):
    flag = "--" + key.replace("_", "-")
    assert getattr(resolve(flag, "0,65534,4294967294"), key) == (0, 65534, 4294967294)
    for bad in ("-5", "4294967295", "4294967296"):
        with pytest.raises(ConfigError, match=f"{bad} is not a user or group id"):
            resolve(flag, bad)
    path = tmp_path / "ids.toml"
    path.write_text(f"{key} = [0, -5]\n")
    with pytest.raises(ConfigError, match="-5 is not a user or group id"):
        resolve("--config", str(path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--socket-mode", "rw"), "is not an octal file mode"),
        (("--socket-mode", "0666"), "would let every local user steer the sidecar"),
        (("--socket-mode", "01600"), "has bits outside 0777"),
        (("--mode", "docker"), "'docker' is not one of mesos, standalone"),
        (("--cgroup-version", "v3"), "'v3' is not one of auto, v1, v2"),
        (("--allocation-policy", "random"), "is not one of topology, first-fit"),
        (("--max-workers", "0"), "must be positive"),
        (("--simulate", "dgx-1", "--nvml-library", "/x.so"), "--simulate and --nvml-library contradict"),
        (("--simulate", "dgx-1", "--dev-root", "/d"), "--simulate and --dev-root contradict"),
        (("--cgroups-root", "/abs"), "must be relative to the hierarchy"),
        (("--cgroups-root", "a/../../b"), "without '..'"),
        (("--socket", "/tmp/" + "s" * 120), "longer than a Unix socket path may be"),
    ],
)
def test_bad_flags_are_refused_with_a_message_naming_the_problem(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*argv)


def test_config_file_that_does_not_parse_is_refused_with_its_path(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("mode = \n")
    with pytest.raises(ConfigError, match=re.escape(f"failed to parse config file '{path}'")):
        resolve("--config", str(path))


def test_config_file_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('cgroup_root = "mesos"\n')
    with pytest.raises(ConfigError, match="unknown key 'cgroup_root'"):
        resolve("--config", str(path))


def test_config_file_value_of_the_wrong_type_names_the_file(tmp_path):
    path = tmp_path / "types.toml"
    path.write_text("socket = 5\n")
    with pytest.raises(ConfigError, match=r"config file .* value for socket: 5 is not a string"):
        resolve("--config", str(path))


def test_missing_config_file_is_refused():
    with pytest.raises(ConfigError, match=re.escape("failed to read config file '/nonexistent/x.toml'")):
        resolve("--config", "/nonexistent/x.toml")


def test_bridge_socket_defaults_to_the_socket_path_plus_bridge_and_follows_it():
    assert resolve().bridge_path == configmod.DEFAULT_SOCKET + ".bridge"
    assert resolve("--socket", "/tmp/a/s.sock").bridge_path == "/tmp/a/s.sock.bridge"


def test_bridge_socket_can_be_moved_or_disabled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve("--bridge-socket", "b.sock").bridge_path == str(tmp_path / "b.sock")
    assert resolve("--bridge-socket", "").bridge_path == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--socket", "/tmp/" + "s" * 100), "--bridge-socket '/tmp/s+.bridge' is longer than a Unix socket path"),
        (("--socket", "/tmp/s.sock", "--bridge-socket", "/tmp/s.sock"), "must differ from --socket"),
    ],
)
def test_bridge_socket_that_cannot_work_is_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*argv)


def test_simulate_without_volume_root_keeps_volumes_under_the_work_dir():
    config = resolve("--simulate", "dgx-1", "--work-dir", "/tmp/gi-work")
    assert config.volume_root == "/tmp/gi-work/volumes"
    assert resolve("--simulate", "dgx-1", "--work-dir", "/w", "--volume-root", "/v").volume_root == "/v"
    assert resolve("--work-dir", "/w").volume_root == "/var/run/mesos/isolators/gpu"


def test_mode_and_cgroup_version_parse_into_their_enums(tmp_path):
    from isolator.model import CgroupVersion, Mode

    cfg = resolve("--mode", "standalone", "--cgroup-version", "v2")
    assert cfg.mode is Mode.STANDALONE and cfg.cgroup_version is CgroupVersion.V2
    assert resolve().cgroup_version is None and resolve("--cgroup-version", "auto").cgroup_version is None
    path = tmp_path / "c.toml"
    path.write_text('mode = "mesos"\ncgroup_version = "v1"\n')
    from_file = configmod.resolve({"config_file": str(path)})
    assert from_file.mode is Mode.MESOS and from_file.cgroup_version is CgroupVersion.V1
    with pytest.raises(ConfigError, match="'v3' is not one of auto, v1, v2"):
        resolve("--cgroup-version", "v3")


def test_a_config_built_with_words_holds_the_enums():
    from isolator.model import CgroupVersion, Mode

    cfg = configmod.Config(mode="standalone", cgroup_version="v2")  # type: ignore[arg-type]
    assert cfg.mode is Mode.STANDALONE and cfg.cgroup_version is CgroupVersion.V2
    assert configmod.Config(cgroup_version="auto").cgroup_version is None  # type: ignore[arg-type]
