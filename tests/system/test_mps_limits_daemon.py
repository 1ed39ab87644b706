"""MPS limits a sharer cannot lift and MPS users, through a real sidecar on a simulated dgx-1 with its
stand-in nvidia-cuda-mps-control and stand-in MPS clients run as real processes of the sharer's uid
(docs/sharing.md, "Limits a task cannot lift", "Users"; issue 41 items 2 and 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import paths
import pytest

from isolator.testing.cgroupfs import TEST_PARENT
from isolator.testing.mesos import Containerizer, GrpcIsolator, HookFailed, container_id
from isolator.testing.sidecar import Sidecar

pytestmark = [pytest.mark.root, pytest.mark.cgroup_v1]

NOBODY = 65534
LIMITS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def _sharer(containerizer: Containerizer, user: str) -> dict:
    config = containerizer.config(gpus=None, image=False)
    config["resources"] = [
        *config.get("resources", []),
        {"name": "gpu-share-4", "type": "SCALAR", "scalar": {"value": 1}},
    ]
    config["user"] = user
    return config


def _client(env: dict[str, str], uid: int) -> dict:
    """What the stand-in MPS client, run as ``uid`` with ``env``, got from the daemon (its first line)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    prefix = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    out = subprocess.run(
        [*prefix, sys.executable, "-m", "isolator.simhost.mpsclient", "--seconds", "0.2"],
        env={**base, **env},
        cwd=paths.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[0])


def test_a_sharer_that_unsets_or_raises_its_mps_variables_is_held_to_its_share_and_users_stay_apart(short_tmp):
    os.chmod(short_tmp, 0o755)  # the sharer's uid reaches the pipe directory, as under the agent's work dir
    root = f"{TEST_PARENT}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sidecar = Sidecar(
        work=short_tmp, host="dgx-1", cgroup_version="v1", cgroups_root=root, extra=("--shared-gpus", "4:4:mps")
    )
    sidecar.start()
    try:
        isolator = GrpcIsolator(sidecar.socket)
        c = Containerizer(isolator, short_tmp)
        try:
            info = isolator.prepare(container_id("a"), _sharer(c, "nobody"))
            assert info is not None
            env = {e["name"]: e.get("value", "") for e in info["environment"]["variables"]}
            mib = int(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].removeprefix("0=").removesuffix("M"))
            pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
            with open(os.path.join(os.path.dirname(pipe), "log", "control.log")) as fh:
                log = fh.read()
            assert "Starting new server" in log and f"for user {NOBODY}" in log, "its server before any client"

            unset = {k: v for k, v in env.items() if k not in LIMITS}
            raised = {**unset, LIMITS[0]: "100", LIMITS[1]: "0=100G"}
            for told in (env, unset, raised):
                got = _client(told, NOBODY)
                assert (got["mps"], got["active_thread_percentage"], got["pinned_mem_limit_mib"]) == (True, 25.0, mib)
                assert got["uid"] == NOBODY

            # Another user's sharer is not placed on the single-user MPS GPU: it would wait, silently.
            with pytest.raises(HookFailed) as err:
                isolator.prepare(container_id("b"), _sharer(c, "root"))
            assert err.value.code == "RESOURCE_EXHAUSTED"
            assert f"its sharers run as uid {NOBODY}; an MPS server serves one user at a time" in str(err.value)
            isolator.prepare(container_id("c"), _sharer(c, "nobody"))  # the same user shares it

            isolator.cleanup(container_id("a"))
            isolator.cleanup(container_id("c"))
        finally:
            isolator.close()
        assert sidecar.terminate() == 0
    finally:
        sidecar.stop()
