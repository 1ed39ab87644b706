"""--shared-gpus: the flag, the config file key, and `gpu-isolator resources` with shared GPUs
(docs/sharing.md)."""

from __future__ import annotations

import json
import os

import pytest

from isolator.cli import main as cli
from isolator.cli.main import build_parser
from isolator.daemon import config as configmod
from isolator.daemon import reload as reloadpolicy
from isolator.errors import ConfigError
from isolator.model import ShareMode
from isolator.policy.shares import ShareSpec


def resolve(*argv: str) -> configmod.Config:
    return configmod.resolve(build_parser().parse_args(["serve", *argv]))


def test_nothing_is_shared_by_default():
    assert resolve().shared_gpus == ()


def test_the_flag_reads_indices_shares_and_modes():
    assert resolve("--shared-gpus", "4-5:4:mps,7:2").shared_gpus == (
        ShareSpec(4, 4, ShareMode.MPS),
        ShareSpec(5, 4, ShareMode.MPS),
        ShareSpec(7, 2, ShareMode.TIME_SLICE),
    )


def test_the_config_file_takes_a_string_or_a_list_and_the_flag_wins(tmp_path):
    path = tmp_path / "sidecar.toml"
    path.write_text('shared-gpus = ["1:2", "2:3:mps"]\n')
    assert resolve("--config", str(path)).shared_gpus == (ShareSpec(1, 2), ShareSpec(2, 3, ShareMode.MPS))
    path.write_text('shared-gpus = "0:4"\n')
    assert resolve("--config", str(path)).shared_gpus == (ShareSpec(0, 4),)
    assert resolve("--config", str(path), "--shared-gpus", "3:2").shared_gpus == (ShareSpec(3, 2),)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("4:1", "invalid --shared-gpus value for shared-gpus: item '4:1': a GPU is shared 2 to 64 ways"),
        ("4:2:vgpu", "mode 'vgpu' is not one of time-slice, mps"),
        ("4:2,4:2", "names GPU 4 twice"),
    ],
)
def test_bad_values_are_config_errors_naming_the_source(value, says):
    with pytest.raises(ConfigError) as err:
        resolve("--shared-gpus", value)
    assert says in str(err.value)


def test_a_bad_file_value_names_the_file(tmp_path):
    path = tmp_path / "sidecar.toml"
    path.write_text("shared-gpus = 4\n")
    with pytest.raises(ConfigError, match=r"invalid config file '.*sidecar.toml'.* value for shared-gpus"):
        resolve("--config", str(path))


def test_shared_gpus_is_reloadable_and_described_as_its_flag():
    old, new = resolve(), resolve("--shared-gpus", "1:2:mps")
    changed, restart = reloadpolicy.difference(old, new)
    assert changed == {"shared_gpus": ((), (ShareSpec(1, 2, ShareMode.MPS),))}
    assert restart == []
    assert reloadpolicy.describe(new.shared_gpus) == "1:2:mps"
    assert reloadpolicy.describe(()) == "none"


def _resources(short_tmp, host, *extra):
    return ["resources", "--simulate", host, "--work-dir", os.path.join(short_tmp, "w"), *extra]


def test_resources_moves_shared_gpus_from_gpus_to_units_named_by_their_size(short_tmp, capsys):
    assert cli.main(_resources(short_tmp, "dgx-1", "--shared-gpus", "4-7:4:mps")) == 0
    assert capsys.readouterr().out.strip() == "gpus:4;gpu-share-4:16"
    assert cli.main(_resources(short_tmp, "dgx-1", "--shared-gpus", "0:2,1:3:mps,2:2", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["resources"], data["entries"]) == (
        "gpus:5;gpu-share-2:4;gpu-share-3:3",
        {"gpus": 5, "gpu-share-2": 4, "gpu-share-3": 3},
    )


def test_resources_without_sharing_is_unchanged(short_tmp, capsys):
    assert cli.main(_resources(short_tmp, "dgx-1")) == 0
    assert capsys.readouterr().out.strip() == "gpus:8"


def test_resources_keeps_mig_entries_after_the_shares(short_tmp, capsys):
    assert cli.main(_resources(short_tmp, "dgx-a100", "--shared-gpus", "6-7:2")) == 0
    out = capsys.readouterr().out.strip()
    assert out == "gpus:1;gpu-share-2:4;mig-1g.10gb:1;mig-1g.5gb:8;mig-2g.10gb:2;mig-3g.20gb:3;mig-4g.20gb:1"


def test_resources_refuses_a_mig_gpu_and_an_unmanaged_one(short_tmp, capsys):
    assert cli.main(_resources(short_tmp, "dgx-a100", "--shared-gpus", "0:2")) != 0
    assert "GPU 0, which is in MIG mode" in capsys.readouterr().err
    assert cli.main(_resources(short_tmp, "dgx-1", "--shared-gpus", "8:2")) != 0
    assert "GPU 8, which is not managed (managed indices: 0,1,2,3,4,5,6,7)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "value", "says"),
    [
        ("dgx-a100", "0:2", "GPU 0, which is in MIG mode"),
        ("dgx-1", "9:2", "GPU 9, which is not managed"),
        ("dgx-1", "3:1", "a GPU is shared 2 to 64 ways"),
    ],
)
def test_serve_stops_with_ex_config_naming_a_shared_gpu_it_cannot_share(short_tmp, host, value, says):
    import subprocess
    import sys

    from isolator.cli.main import EXIT_CONFIG
    from isolator.testing.cgroupfs import TEST_PARENT

    argv = [sys.executable, "-m", "isolator", "serve", "--socket", os.path.join(short_tmp, "s.sock")]
    argv += ["--work-dir", short_tmp, "--mode", "standalone", "--simulate", host, "--shared-gpus", value]
    argv += ["--cgroups-root", f"{TEST_PARENT}/shares-{os.getpid()}"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CONFIG, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("gpu-isolator:")]
    assert len(errors) == 1 and says in errors[0], result.stderr


def test_share_placement_is_spread_by_default_pack_by_flag_or_file_and_nothing_else(tmp_path):
    assert resolve().share_placement == "spread"
    assert resolve("--share-placement", "pack").share_placement == "pack"
    path = tmp_path / "sidecar.toml"
    path.write_text('share-placement = "pack"\n')
    assert resolve("--config", str(path)).share_placement == "pack"
    assert "share_placement" not in reloadpolicy.RELOADABLE  # the booking is built at start
    with pytest.raises((ConfigError, SystemExit)):
        resolve("--share-placement", "fill")
