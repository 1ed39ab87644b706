"""MPS limits a sharer cannot lift, and MPS users, in the core over the shipped fakes (docs/sharing.md,
"Limits a task cannot lift" and "Users"; issue 41 items 2 and 3): the daemon's defaults and its
server are set and read back before a sharer's client can start, a daemon that does not take them
refuses the sharer and leaves the GPU as it was, every MPS sharer holds one share, and single-user MPS
GPUs keep their sharers to one uid, across restarts; multi-user is the operator's choice per GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hook_helpers import minor_of, uuid_of

from isolator.core.mps import Mps, ServerPlan, limit_bytes
from isolator.errors import FailedPrecondition, InvalidArgument
from isolator.model import ContainerConfig, ContainerId, Resource
from isolator.policy.shares import MpsShareCount, SharesExhausted, parse_shared_gpus
from isolator.testing import Rig, fake_service

ONE_GPU = parse_shared_gpus("4:4:mps")  # dgx-1: GPU 4 cut four ways under MPS, the rest whole
EXCLUSIVE_PROCESS, DEFAULT = 3, 0


def cid(text: str) -> ContainerId:
    return ContainerId.from_chain(text.split("."))


def sharer(user: str = "", n: float = 1.0) -> ContainerConfig:
    return ContainerConfig(resources=(Resource("gpu_shares", n),), user=user)


def quarter_mib(rig: Rig) -> int:
    return rig.service.core.gpus[minor_of(rig, 4)].memory_total // (1 << 20) // 4


@pytest.fixture
def rig() -> Rig:
    rig = fake_service("dgx-1")
    rig.settings = replace(rig.settings, shared_gpus=ONE_GPU)
    rig.users.names.update(alice=1000, bob=1001)
    rig.restart()
    return rig


# ---- limits on the daemon ---------------------------------------------------------------------------


def test_the_daemon_holds_one_shares_limits_and_the_sharers_server_before_its_client_starts(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    uuid, mib = uuid_of(rig, 4), quarter_mib(rig)
    assert rig.mps.commands[uuid][:6] == [
        "set_default_active_thread_percentage 25",
        "get_default_active_thread_percentage",
        f"set_default_device_pinned_mem_limit 0 {mib}M",
        "get_default_device_pinned_mem_limit 0",
        "get_server_list",  # none running yet
        "start_server -uid 1000",
    ]
    daemon = rig.mps.daemon(uuid)
    (server,) = daemon.servers.values()
    assert (server.uid, server.threads, limit_bytes(server.pinned["0"])) == (1000, "25.0", mib << 20)


def test_a_client_that_unsets_or_raises_its_variables_is_still_held_to_its_share(rig: Rig) -> None:
    info = rig.service.prepare(cid("a"), sharer("alice"))
    assert info is not None
    uuid, mib = uuid_of(rig, 4), quarter_mib(rig)
    unset = rig.mps.connect(uuid, pid=4100, uid=1000, env={})
    raised = rig.mps.connect(
        uuid,
        pid=4101,
        uid=1000,
        env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000000M"},
    )
    as_told = rig.mps.connect(uuid, pid=4102, uid=1000, env=dict(info.environment))
    for client in (unset, raised, as_told):
        assert (client.threads, client.pinned) == (25.0, mib << 20), client.pid


def test_a_daemon_that_echoes_the_old_percentage_refuses_the_sharer_and_leaves_the_gpu_as_it_was(rig: Rig) -> None:
    rig.mps.ignored.add("set_default_active_thread_percentage")  # answers 100.0, exit 0, as the real one does
    with pytest.raises(FailedPrecondition, match=r"did not take set_default_active_thread_percentage: asked 25%"):
        rig.service.prepare(cid("a"), sharer("alice"))
    assert rig.store.get(cid("a")) is None and rig.mps.running() == frozenset()
    assert rig.inventory.settings(4)[0] == DEFAULT, "the compute mode set back"
    assert rig.service.core.mps.state(minor_of(rig, 4)).startswith("failed: ")
    rig.mps.ignored.clear()
    rig.service.prepare(cid("a"), sharer("alice"))
    assert rig.inventory.settings(4)[0] == EXCLUSIVE_PROCESS


def test_a_daemon_that_does_not_take_the_pinned_limit_refuses_the_sharer(rig: Rig) -> None:
    rig.mps.ignored.add("set_default_device_pinned_mem_limit")
    with pytest.raises(FailedPrecondition, match=r"get_default_device_pinned_mem_limit 0: asked \d+M, it answers ''"):
        rig.service.prepare(cid("a"), sharer("alice"))
    assert rig.mps.running() == frozenset() and rig.inventory.settings(4)[0] == DEFAULT


def test_a_daemon_that_cannot_start_does_not_leave_the_gpu_in_exclusive_process(rig: Rig) -> None:
    rig.mps.faults.fail_at("start")
    with pytest.raises(FailedPrecondition, match="injected fault"):
        rig.service.prepare(cid("a"), sharer())
    assert rig.inventory.settings(4)[0] == DEFAULT


def test_a_restarted_daemon_gets_its_limits_and_its_users_server_again(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    uuid = uuid_of(rig, 4)
    rig.mps.kill(uuid)
    rig.service.supervise_mps()
    daemon = rig.mps.daemon(uuid)
    assert daemon.threads == "25.0" and [s.uid for s in daemon.servers.values()] == [1000]
    assert rig.service.core.mps.restarts[minor_of(rig, 4)] == 1


def test_a_running_server_with_other_values_is_set_per_server(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    uuid = uuid_of(rig, 4)
    (server,) = rig.mps.daemon(uuid).servers
    rig.mps.command(uuid, f"set_active_thread_percentage {server} 100")  # someone root raised it
    rig.restart()  # adopted: nothing assumed of a daemon this sidecar did not set up
    rig.service.supervise_mps()
    assert rig.mps.command(uuid, f"get_active_thread_percentage {server}") == "25.0"


def test_every_mps_sharer_holds_one_share_and_a_pooled_count_elsewhere_is_refused_clearly(rig: Rig) -> None:
    with pytest.raises(MpsShareCount, match="Requested 2 gpu_shares but every GPU here that could hold them is shared"):
        rig.service.prepare(cid("a"), sharer(n=2))
    assert rig.store.get(cid("a")) is None
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps,5:4"))
    rig.restart()
    rig.service.prepare(cid("a"), sharer(n=2))
    rec = rig.store.get(cid("a"))
    assert rec is not None and rec.holding.share.gpu == minor_of(rig, 5), "the time-sliced GPU takes it"
    rig.service.prepare(cid("b"), sharer())
    with pytest.raises(InvalidArgument, match="shared in mps mode, where each sharer holds exactly one share"):
        rig.service.update(cid("b"), [Resource("gpu_shares", 2.0)])


def test_the_keep_compute_mode_switch_never_touches_the_gpu(rig: Rig) -> None:
    core = rig.service.core
    mps = Mps(rig.mps, rig.inventory, DEFAULT, keep_compute_mode=True)
    gpu = core.gpus[minor_of(rig, 5)]
    assert mps.ensure(gpu, ServerPlan(50, 1024, 0))
    assert rig.inventory.settings(5)[0] == DEFAULT
    assert rig.mps.command(gpu.uuid, "get_default_active_thread_percentage") == "50.0"
    assert not mps.ensure(gpu, ServerPlan(50, 1024, 0)), "running, set up: nothing to do"


def test_pinned_limits_are_compared_in_bytes() -> None:
    assert limit_bytes("2G") == limit_bytes("2048M") == limit_bytes("2048") == 2 << 30
    assert limit_bytes("") is None and limit_bytes("2 G") is None and limit_bytes("Server not found") is None


# ---- users ------------------------------------------------------------------------------------------


def test_a_sharer_of_another_user_is_refused_a_single_user_mps_gpu_saying_why(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    rig.service.prepare(cid("b"), sharer("alice"))
    with pytest.raises(SharesExhausted, match=r"GPU \d+: 2 \(its sharers run as uid 1000; an MPS server serves one"):
        rig.service.prepare(cid("c"), sharer("bob"))
    assert rig.store.get(cid("c")) is None
    rig.restart()  # the users are booked durably
    assert rig.service.core.mps_plan(minor_of(rig, 4)).uid == 1000
    with pytest.raises(SharesExhausted, match="for uid 1001"):
        rig.service.prepare(cid("c"), sharer("bob"))
    rig.service.cleanup(cid("a"))
    rig.service.cleanup(cid("b"))
    rig.service.core.handover.recheck()
    rig.service.prepare(cid("c"), sharer("bob"))  # an empty GPU takes any user
    assert [s.uid for s in rig.mps.daemon(uuid_of(rig, 4)).servers.values()] == [1001]


def test_sharers_of_two_users_go_to_two_mps_gpus(rig: Rig) -> None:
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4-5:4:mps"), share_placement="pack")
    rig.restart()
    rig.service.prepare(cid("a"), sharer("alice"))
    rig.service.prepare(cid("b"), sharer("bob"))  # pack would put it beside a: users come first
    placed = {c: rig.store.get(cid(c)).holding.share for c in "ab"}  # type: ignore[union-attr]
    assert placed["a"].gpu != placed["b"].gpu and (placed["a"].uid, placed["b"].uid) == (1000, 1001)


def test_no_user_means_the_agents_own_root_and_an_unknown_user_is_kept_off_single_user_mps(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer(""))
    assert rig.store.get(cid("a")).holding.share.uid == 0  # type: ignore[union-attr]
    with pytest.raises(SharesExhausted, match="takes no sharer whose user this host does not know"):
        rig.service.prepare(cid("b"), sharer("mallory"))
    assert rig.service.core.sharer_uid(cid("b"), "mallory") is None
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4"))  # time-sliced: users do not matter
    rig.service.cleanup(cid("a"))
    rig.restart()
    rig.service.prepare(cid("b"), sharer("mallory"))
    rig.service.prepare(cid("c"), sharer("alice"))


def test_a_multiuser_gpu_takes_every_users_sharers_on_one_server(rig: Rig) -> None:
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps:multiuser"))
    rig.restart()
    rig.service.prepare(cid("a"), sharer("alice"))
    rig.service.prepare(cid("b"), sharer("bob"))
    uuid = uuid_of(rig, 4)
    assert rig.mps.multiuser(uuid) is True
    alice = rig.mps.connect(uuid, pid=4200, uid=1000)
    bob = rig.mps.connect(uuid, pid=4201, uid=1001)
    assert alice.server == bob.server != 0 and (alice.threads, bob.threads) == (25.0, 25.0)


def test_a_reload_may_not_switch_a_held_gpu_between_single_and_multi_user(rig: Rig) -> None:
    from isolator.policy.shares import RoleChangeRefused

    rig.service.prepare(cid("a"), sharer("alice"))
    with pytest.raises(RoleChangeRefused, match=r"cannot switch from mps to mps \(multiuser\)"):
        rig.service.share_gpus(parse_shared_gpus("4:4:mps:multiuser"))


def test_a_daemon_started_again_behind_the_sidecars_back_is_set_up_before_the_next_sharer(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    uuid = uuid_of(rig, 4)
    rig.mps.kill(uuid)
    rig.mps.start(uuid)  # someone else's: defaults 100 %, no server
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "100.0"
    rig.service.prepare(cid("b"), sharer("alice"))
    assert rig.mps.command(uuid, "get_default_active_thread_percentage") == "25.0"
    assert [s.uid for s in rig.mps.daemon(uuid).servers.values()] == [1000]


def test_a_restart_that_switched_multi_user_under_sharers_takes_no_new_sharer_on_that_daemon(rig: Rig) -> None:
    rig.service.prepare(cid("a"), sharer("alice"))
    rig.settings = replace(rig.settings, shared_gpus=parse_shared_gpus("4:4:mps:multiuser"))
    rig.restart()  # the records keep no mode of users: not refused, the daemon adopted as it runs
    with pytest.raises(FailedPrecondition, match="runs without -multiuser-server, which --shared-gpus no longer asks"):
        rig.service.prepare(cid("b"), sharer("bob"))
    assert rig.store.get(cid("b")) is None and rig.store.get(cid("a")) is not None
    rig.service.cleanup(cid("a"))  # the last sharer: the daemon stops; the next one starts multi-user
    rig.service.core.handover.recheck()
    rig.service.prepare(cid("b"), sharer("bob"))
    assert rig.mps.multiuser(uuid_of(rig, 4)) is True
