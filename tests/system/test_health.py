"""Health that follows the hardware both ways: XID and ECC events, kernel device events (bind/unbind,
driver reload) that make the inventory re-read NVML, MIG mode changes, and recovery from a failed
event wait — in-process against the simulated host, through the real netlink socket, and end to end
through a running daemon whose containers get the Watch limitation."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from isolator.gpu import uevents
from isolator.gpu.nvml import HEALTH_ABSENT, HEALTH_ECC, HEALTH_NVML, HealthEvent, Inventory
from isolator.rpc import isolator_pb2 as pb
from isolator.rpc import isolator_pb2_grpc as pb_grpc
from isolator.simhost.sim import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN, SimulatedHost
from isolator.testing.mesos import Containerizer, GrpcIsolator, container_id
from isolator.testing.sidecar import running_sidecar


def _until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def watched(short_tmp):
    """An inventory over a simulated host with its health thread and its uevent watch running."""
    opened: list[Inventory] = []

    def make(name: str, **kwargs) -> tuple[SimulatedHost, Inventory, queue.Queue[HealthEvent]]:
        host = SimulatedHost(name, os.path.join(short_tmp, name)).setup(make_devices=False)
        inv = Inventory(library=host.library_path, proc_root=host.proc_root, poll_ms=50, retry_s=0.1, **kwargs)
        inv.open()
        opened.append(inv)
        inv.read()
        events: queue.Queue[HealthEvent] = queue.Queue()
        inv.on_health_change(events.put)
        inv.start_health_watch()
        source = uevents.FileSource(host.uevents_path)
        watch = uevents.UeventWatch(lambda: source, inv.bus_ids, inv.device_changed).start()
        inv.on_close(watch.stop)
        return host, inv, events

    yield make
    for inv in opened:
        inv.close()


# ---- events ------------------------------------------------------------------------------------


def test_double_bit_ecc_marks_the_gpu_unhealthy_and_single_bit_does_not(watched):
    host, inv, events = watched("dgx-1")
    host.inject_ecc(4, double_bit=False)
    host.inject_ecc(2, double_bit=True)
    event = events.get(timeout=10)
    assert (event.index, event.healthy, event.reason) == (2, False, "double-bit ECC error")
    assert inv.record(2).health.source == HEALTH_ECC
    assert inv.healthy() == frozenset(range(8)) - {2}


def test_a_failed_event_wait_marks_every_gpu_unknown_then_healthy_again_once_nvml_answers(watched):
    host, inv, events = watched("workstation-4")
    host.fail_gpu(None, "nvmlEventSetWait", NVML_ERROR_UNKNOWN)
    down = [events.get(timeout=10) for _ in range(4)]
    assert {e.index for e in down} == {0, 1, 2, 3} and not any(e.healthy for e in down)
    assert all(inv.record(i).health.source == HEALTH_NVML for i in range(4))
    assert "NVML event wait failed" in inv.record(0).status
    # While the wait keeps failing, re-initialising NVML (it answers nvmlInit) must not make the
    # GPUs look healthy between two failures: no flapping, nothing handed out blind.
    before = inv.rescans
    _until(lambda: inv.rescans >= before + 3)
    assert events.empty() and inv.healthy() == frozenset()
    host.clear()
    up = [events.get(timeout=10) for _ in range(4)]
    assert {e.index for e in up} == {0, 1, 2, 3} and all(e.healthy for e in up)
    assert inv.healthy() == frozenset(range(4))
    # ...and it still sees XIDs with its new event set.
    host.inject_xid(1, 79)
    assert events.get(timeout=10).index == 1


# ---- kernel device events ------------------------------------------------------------------------


def test_unbind_marks_the_gpu_unhealthy_and_bind_brings_it_back(watched):
    host, inv, events = watched("dgx-1")
    host.set_usage(5, 7 * 2**30, 55, 20)
    host.unbind(2)
    event = events.get(timeout=10)
    assert (event.index, event.healthy) == (2, False)
    assert inv.record(2).health.source == HEALTH_ABSENT and "not visible to NVML" in event.reason
    assert inv.healthy() == frozenset(range(8)) - {2}
    # NVML renumbered the GPUs after 2; ours keep their identity (UUID) and their index.
    assert inv.usage(5).memory_used == 7 * 2**30
    host.bind(2)
    event = events.get(timeout=10)
    assert (event.index, event.healthy) == (2, True)
    assert inv.healthy() == frozenset(range(8))


def test_an_xid_is_cleared_by_a_reset_of_the_gpu_and_only_by_one(watched):
    host, inv, events = watched("dgx-1")
    host.inject_xid(3, 79)
    assert events.get(timeout=10).healthy is False
    before = inv.rescans
    host.emit_uevent({"ACTION": "change", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": host.spec.gpus[3].pci_bus_id})
    _until(lambda: inv.rescans > before)
    assert 3 not in inv.healthy(), "a rescan without a reset must not forgive an XID"
    host.unbind(3)
    host.bind(3)
    event = events.get(timeout=10)
    assert (event.index, event.healthy) == (3, True)
    assert inv.record(3).health.last_xid == 79  # history kept


def test_a_driver_reload_marks_everything_unknown_then_healthy_and_reinitialises_nvml(watched):
    host, inv, events = watched("workstation-4")
    host.inject_xid(0, 79)
    assert events.get(timeout=10).index == 0
    host.unload_driver()
    down = [events.get(timeout=10) for _ in range(3)]
    assert {e.index for e in down} == {1, 2, 3}
    assert inv.record(1).status.startswith("health unknown") and "Driver Not Loaded" in inv.record(1).status
    host.load_driver()
    up = [events.get(timeout=10) for _ in range(4)]
    assert {e.index for e in up} == {0, 1, 2, 3} and all(e.healthy for e in up)
    host.inject_xid(2, 79)  # the new NVML session watches events again
    assert events.get(timeout=10).index == 2


def test_a_mig_mode_change_is_picked_up(watched):
    host, inv, _ = watched("hgx-h100")
    assert not inv.record(4).mig_enabled
    before = inv.rescans
    host.set_mig_mode(4, True)
    _until(lambda: inv.rescans > before)
    assert inv.record(4).mig_enabled and inv.record(4).mig_capable
    assert inv.healthy() == frozenset(range(8))


def test_the_probe_notices_a_lost_gpu_without_any_event(short_tmp):
    host = SimulatedHost("single", os.path.join(short_tmp, "h")).setup(make_devices=False)
    with Inventory(library=host.library_path, proc_root=host.proc_root, poll_ms=50, probe_s=0.1).open() as inv:
        inv.read()
        events: queue.Queue[HealthEvent] = queue.Queue()
        inv.on_health_change(events.put)
        inv.start_health_watch()
        host.fail_gpu(0, "nvmlDeviceGetUUID", NVML_ERROR_GPU_IS_LOST)
        event = events.get(timeout=10)
        assert (event.index, event.healthy) == (0, False)


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "0000:06:00.0"}, "PCI device 0000:06:00.0 unbind"),
        ({"ACTION": "bind", "SUBSYSTEM": "pci", "PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:99:00.0"}, "bind"),
        ({"ACTION": "add", "SUBSYSTEM": "module", "DEVPATH": "/module/nvidia"}, "kernel module nvidia loaded"),
        ({"ACTION": "remove", "SUBSYSTEM": "module", "DEVPATH": "/module/nvidia_uvm"}, "nvidia_uvm unloaded"),
        ({"ACTION": "bind", "SUBSYSTEM": "pci", "PCI_ID": "8086:1572", "PCI_SLOT_NAME": "0000:3b:00.0"}, None),
        ({"ACTION": "add", "SUBSYSTEM": "module", "DEVPATH": "/module/loop"}, None),
        ({"ACTION": "add", "SUBSYSTEM": "net", "DEVPATH": "/devices/virtual/net/veth0"}, None),
    ],
)
def test_which_uevents_call_for_a_rescan(event, expected):
    """Only the managed GPUs' PCI functions (or any NVIDIA one) and the nvidia modules count."""
    change = uevents.relevant(event, {"0000:06:00.0"})
    assert change is None if expected is None else change is not None and expected in change.reason


def test_the_kernel_wire_format_round_trips():
    props = {"ACTION": "unbind", "DEVPATH": "/devices/pci0000:00/0000:06:00.0", "SUBSYSTEM": "pci"}
    assert uevents.parse(uevents.format_message(props)) == props
    assert uevents.parse(b"remove@/module/nvidia\0SUBSYSTEM=module")["ACTION"] == "remove"


@pytest.mark.root
def test_the_real_netlink_socket_delivers_kernel_uevents():
    """In a network namespace of its own, a veth pair is created (iproute2's ``ip``): the kernel
    sends its ``add`` uevents to that namespace's NETLINK_KOBJECT_UEVENT listeners, where
    NetlinkSource reads them. Nothing outside the namespace is touched."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip(8) is not installed")
    script = textwrap.dedent(
        """
        import subprocess, threading
        from isolator.gpu.uevents import NetlinkSource
        stop = threading.Event()
        source = NetlinkSource(poll_s=0.1).open()
        subprocess.run(["ip", "link", "add", "gi-test0", "type", "veth", "peer", "name", "gi-test1"], check=True)
        for event in source.events(stop):
            if event.get("INTERFACE") == "gi-test1":
                print(event["ACTION"], event["SUBSYSTEM"], event["DEVPATH"])
                break
        source.close()
        """
    )
    try:
        result = subprocess.run(
            ["unshare", "--net", sys.executable, "-c", script], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        pytest.skip("unshare(1) is not installed")
    if result.returncode != 0 and "Operation not permitted" in result.stderr:
        pytest.skip(f"cannot create a network namespace here: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["add", "net", "/devices/virtual/net/gi-test1"]


def test_the_uevent_watch_survives_a_failing_source():
    """A source that cannot open (no netlink, no pyroute2) is retried, never fatal."""
    calls: list[int] = []
    reasons: list[uevents.Change] = []
    delivered = threading.Event()

    class Flaky:
        def events(self, stop):
            yield {"ACTION": "add", "SUBSYSTEM": "module", "DEVPATH": "/module/nvidia"}
            delivered.set()
            stop.wait(10)

        def close(self):
            pass

    def factory():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("netlink unavailable")
        return Flaky()

    watch = uevents.UeventWatch(factory, lambda: set(), reasons.append, retry_s=0.05).start()
    try:
        assert delivered.wait(10)
        assert reasons == [uevents.Change("kernel module nvidia loaded", reset_all=True)]
    finally:
        watch.stop()


# ---- through a running daemon ----------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_a_container_whose_gpu_is_unbound_gets_the_watch_limitation_and_the_gpu_comes_back():
    with running_sidecar("dgx-1", "v1") as sidecar:
        isolator = GrpcIsolator(sidecar.socket)
        containerizer = Containerizer(isolator, sidecar.work)
        channel = grpc.insecure_channel(sidecar.address)
        stub, admin = pb_grpc.IsolatorStub(channel), pb_grpc.AdminStub(channel)
        try:
            isolator.prepare(container_id("held"), containerizer.config(gpus=1, image=False))
            held = next(c for c in admin.ListContainers(pb.ListContainersRequest(), timeout=10).containers)
            minor = held.gpu_minors[0]
            gpu = next(g for g in admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus if g.minor == minor)
            future = stub.Watch.future(pb.WatchRequest(container_id=pb.ContainerID(value="held")), timeout=30)
            sidecar.sim.unbind(gpu.index)
            reply = future.result()
            assert f"GPU {minor}" in reply.limitation.message
            assert "not visible to NVML" in reply.limitation.message

            def health() -> bool:
                gpus = admin.ListGpus(pb.ListGpusRequest(), timeout=10).gpus
                return next(g for g in gpus if g.index == gpu.index).healthy

            assert not health()
            sidecar.sim.bind(gpu.index)
            _until(health)
        finally:
            isolator.cleanup(container_id("held"))
            isolator.close()
            channel.close()


def test_a_bind_or_unbind_is_a_reset_and_a_change_is_not():
    bus = "0000:06:00.0"
    assert uevents.relevant({"ACTION": "unbind", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": bus}, {bus}).reset_bus == bus
    assert uevents.relevant({"ACTION": "change", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": bus}, {bus}).reset_bus == ""
    assert uevents.relevant({"ACTION": "remove", "SUBSYSTEM": "module", "DEVPATH": "/module/nvidia"}, {bus}).reset_all


@pytest.mark.root
@pytest.mark.cgroup_v1
def test_the_grpc_health_service_is_not_serving_while_nvml_is_gone_and_serving_again_after():
    """With the driver unloaded no GPU can be handed out and `gpu-isolator health` says UNHEALTHY;
    grpc_health_probe (the README's readiness check) must not keep saying SERVING. The Admin service
    stays SERVING: it is how an operator finds out why."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with running_sidecar("single", "v1") as sidecar, grpc.insecure_channel(sidecar.address) as channel:
        probe = health_pb2_grpc.HealthStub(channel)

        def status(service: str) -> int:
            return probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

        assert status("") == serving and status("gpuisolator.v1.Isolator") == serving
        sidecar.sim.unload_driver()
        _until(lambda: status("") == not_serving)
        assert status("gpuisolator.v1.Isolator") == not_serving
        assert status("gpuisolator.v1.Admin") == serving
        sidecar.sim.load_driver()
        _until(lambda: status("") == serving)
        assert status("gpuisolator.v1.Isolator") == serving
