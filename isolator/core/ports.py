"""The edges the core reaches the machine through, one small ``typing.Protocol`` each.

The core (``isolator.core``) imports nothing that touches the machine: it is handed one object per
port. ``isolator.daemon.main`` wires the real ones (cgroup v1/v2 controllers, the SQLite store, the
volume manager, NVML, ``/proc``, the system clock); ``isolator.testing`` ships in-memory fakes that
pass the same contract tests (tests/contract/test_contracts.py).

    port            real                                            fake (isolator.testing)
    CgroupBackend   cgroups.v1.V1DeviceController, v2.V2...         FakeCgroups
    RecordStore     host.state.StateStore (SQLite)                  FakeStore
    DriverVolumes   volumes.manager.VolumeManager                   FakeVolumes
    GpuInventory    gpu.nvml.Inventory, host.system.EmptyInventory  FakeInventory
    DeviceNodes     host.devices.HostDevices                        FakeDeviceNodes
    Processes       host.system.ProcProcesses (/proc)               FakeProcesses
    Filesystem      host.system.LocalFilesystem                     FakeFilesystem
    Clock           host.system.SystemClock                         ManualClock
    Cpusets         cgroups.cpuset.CpusetController                 FakeCpusets
    CpuTopology     host.cpus.SysCpus                               FakeCpusets (the same object)

Each port's name is its own: no concrete class is called what a Protocol is called. Where the
machine has no volume root, CPU view or cpuset hierarchy, ``isolator.core.absent`` stands in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from isolator.model import (
    CgroupVersion,
    ContainerId,
    ContainerRecord,
    DrainRecord,
    EndedDrain,
    GpuRecord,
    GpuUsageSample,
    HealthEvent,
    Holding,
    MaintenanceMark,
    Mode,
    Occupancy,
    ProcessUsage,
    RecordState,
    ResetStep,
    Topology,
)
from isolator.policy.affinity import Affinity, Machine
from isolator.policy.devices import ControlDevices, DeviceRule, KernelRules


class CgroupBackend(Protocol):
    """A container's devices cgroup; v1 (whitelist) and v2 (eBPF program) offer exactly these methods.

    * ``prepare(c)``: mesos mode checks that Mesos's cgroup exists (``CgroupVanished`` if not);
      standalone mode creates the cgroup and denies every device. Idempotent.
    * ``apply(c, rules)``: make the container's allow-list exactly ``rules`` (the full set, Mesos's
      default whitelist included); on failure the previous rules stay in force.
    * ``apply_nested(c, rules)``: ``apply`` to a nested container's own cgroup after its top-level
      container's rules changed (v1: through the ``<parent>/mesos`` cgroup between, which the kernel
      filled with a copy of the parent's list and which a grant below may never exceed).
    * ``current(c)``: the rules in force (v1: read back from ``devices.list``; v2: the checkpoint).
    * ``recover(c)``: after a restart, bring the kernel in line with what was last applied and return
      it (v1: the list; v2: re-attach the checkpointed program). ``CgroupVanished`` without a cgroup.
    * ``in_force(c)``: what the kernel enforces and where that was read, for the admin views.
    * ``exists(c)``, ``nested_names(c)``: whether the cgroup exists; the names of the cgroups Mesos
      made for nested containers below it (``<c>/mesos/<name>``).
    * ``containers()``: every top-level container with a cgroup under our root, recorded or not.
    * ``apply_nested(c, rules)``: ``apply`` to a nested container's own cgroup; on v1 a grant first
      passes through the ``<parent>/mesos`` cgroup between them, which may never allow less.
    * ``add_pid(c, pid)`` / ``pids(c)``: place and list processes (``cgroup.procs``).
    * ``root_path()``, ``cgroup_of(pid)``: our root's path; the cgroup a process is in, in this
      hierarchy (None when it is gone).
    * ``cleanup(c)``: remove exactly what we added; a missing cgroup is success. Idempotent.
    """

    version: CgroupVersion
    mode: Mode

    def cgroup_path(self, container: ContainerId) -> str: ...

    def exists(self, container: ContainerId) -> bool: ...

    def nested_names(self, container: ContainerId) -> tuple[str, ...]: ...

    def containers(self) -> tuple[ContainerId, ...]: ...

    def prepare(self, container: ContainerId) -> None: ...

    def apply(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None: ...

    def apply_nested(self, container: ContainerId, rules: Iterable[DeviceRule]) -> None: ...

    def current(self, container: ContainerId) -> tuple[DeviceRule, ...]: ...

    def recover(self, container: ContainerId) -> tuple[DeviceRule, ...]: ...

    def in_force(self, container: ContainerId) -> KernelRules: ...

    def add_pid(self, container: ContainerId, pid: int) -> None: ...

    def root_path(self) -> str: ...

    def cgroup_of(self, pid: int) -> str | None: ...

    def pids(self, container: ContainerId) -> tuple[int, ...]: ...

    def cleanup(self, container: ContainerId) -> None: ...


class CpuTopology(Protocol):
    """What this machine really has (``/sys/devices/system``) and what a process may use (``/proc``)."""

    def machine(self) -> Machine: ...

    def allowed_of(self, pid: int) -> frozenset[int] | None: ...  # None: the process is gone


class Cpusets(Protocol):
    """A top-level container's cpuset cgroup (``--cpu-affinity enforce``, docs/affinity.md).

    * ``allowed(c)``: the CPUs a process in ``c``'s cpuset could use without us (its parent's;
      empty when nothing says).
    * ``apply(c, cpus, mems)``: create the cpuset if missing and make it exactly that, verified;
      an empty set is refused (``CgroupError``), never written.
    * ``current(c)``: what it is set to, None without a cgroup. ``exists``, ``containers()``,
      ``pids`` as for ``CgroupBackend``.
    * ``join(c, pid)``: place a process; ``CgroupVanished`` without a cgroup.
    * ``remove(c)``: a missing cgroup is success; one with processes is ``CgroupBusy``. Idempotent.
    """

    # The cgroup version of the cpuset hierarchy (a ``CgroupVersion``); "" when none is bound (absent.py).
    @property
    def version(self) -> str: ...

    def path(self, container: ContainerId) -> str: ...

    def exists(self, container: ContainerId) -> bool: ...

    def containers(self) -> tuple[ContainerId, ...]: ...

    def current(self, container: ContainerId) -> Affinity | None: ...

    def allowed(self, container: ContainerId) -> frozenset[int]: ...

    def pids(self, container: ContainerId) -> tuple[int, ...]: ...

    def apply(self, container: ContainerId, cpus: frozenset[int], mems: frozenset[int]) -> None: ...

    def join(self, container: ContainerId, pid: int) -> None: ...

    def remove(self, container: ContainerId) -> None: ...


class RecordStore(Protocol):
    """Container -> GPUs and metadata, durable once a call returns; each call one transaction.

    A GPU has at most one holder (``GpuAlreadyHeld``); unknown containers are ``ContainerNotRecorded``
    for the writers and None for ``get``. Failures are ``StateError`` and change nothing.
    """

    path: str

    def record(self, rec: ContainerRecord) -> None: ...

    def add_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord: ...

    def remove_gpus(self, cid: ContainerId, minors: Iterable[int]) -> ContainerRecord: ...

    # An update's change of shares or MIG units: what ``cid`` holds, replaced whole in one transaction.
    def set_holding(self, cid: ContainerId, holding: Holding) -> ContainerRecord: ...

    def update(
        self,
        cid: ContainerId,
        *,
        state: RecordState | None = None,
        volume_version: str | None = None,
        rules: tuple[DeviceRule, ...] | None = None,
        lazy: bool = False,
    ) -> ContainerRecord:
        """``lazy``: durable once the call returns against the sidecar's death (SIGKILL), not against
        the machine's (power loss, a kernel panic), for a mark no decision reads and that recovery
        rebuilds (Isolate's "isolated": no container outlives the machine anyway)."""
        ...

    def set_cpuset(self, cid: ContainerId, cpus: str, mems: str) -> ContainerRecord: ...

    def remove(self, cid: ContainerId) -> ContainerRecord: ...

    def get(self, cid: ContainerId) -> ContainerRecord | None: ...

    # Whether ``cid`` is recorded: ``get`` without building the record (prepare's first check).
    def has(self, cid: ContainerId) -> bool: ...

    def load(self) -> dict[ContainerId, ContainerRecord]: ...

    def holders(self) -> dict[int, ContainerId]: ...

    def mig_holders(self) -> dict[str, tuple[ContainerId, int]]: ...

    # Container -> (shared GPU minor, shares, mode) of every holder of gpu_shares (docs/sharing.md).
    def share_holders(self) -> dict[ContainerId, tuple[int, int, str]]: ...

    # Sharers ended because their GPU's MPS server or daemon was lost (container -> why; docs/sharing.md,
    # "Faults"): kept until the container's record goes, or its last share (``set_holding``). A
    # container not recorded is passed over; one already ended keeps its first reason.
    def end_mps_sharers(self, ends: dict[ContainerId, str]) -> None: ...

    def mps_ended(self) -> dict[ContainerId, str]: ...

    # GPUs kept out by the handover check (docs/handover.md), by minor; one row each.
    def drains(self) -> dict[int, DrainRecord]: ...

    def set_drain(self, rec: DrainRecord) -> None: ...

    def clear_drain(self, minor: int) -> None: ...  # no row is success

    # GPUs an operator drained for maintenance (gpu-isolator drain), by UUID; one row each.
    def maintenance(self) -> dict[str, MaintenanceMark]: ...

    def set_maintenance(self, mark: MaintenanceMark) -> None: ...

    def clear_maintenance(self, uuid: str) -> None: ...  # no row is success

    # End a drain and keep it in the history, in one write (the drain's row gone, its history row added).
    def end_maintenance(self, ended: EndedDrain) -> None: ...

    def maintenance_history(self) -> list[EndedDrain]: ...  # oldest first

    def check(self) -> str: ...

    def close(self) -> None: ...


class Volume(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def driver_version(self) -> str: ...


class DriverVolumes(Protocol):
    """The consolidated driver volume ``nvidia_<version>`` and who uses it (volumes.manager).
    ``core.absent.NoVolumes`` stands in where no volume root is configured (``volume_root`` "")."""

    volume_root: str

    def acquire(self, container_id: str, driver_version: str) -> Volume: ...

    def release(self, container_id: str, driver_version: str | None = None) -> tuple[str, ...]: ...

    def reconcile(self, live: Iterable[str]) -> tuple[str, ...]: ...

    def volumes(self) -> list[dict[str, Any]]: ...


class GpuInventory(Protocol):
    """The GPUs to manage, their topology, health and usage (NVML)."""

    driver_version: str
    cuda_driver_version: str

    @property
    def records(self) -> tuple[GpuRecord, ...]: ...

    def topology(self) -> Topology: ...

    def healthy(self) -> frozenset[int]: ...

    def usage(self, index: int) -> GpuUsageSample: ...

    def device_count(self) -> int: ...

    def on_health_change(self, callback: Callable[[HealthEvent], None]) -> None: ...

    # The handover (docs/handover.md): what runs on a GPU now (NvmlError when NVML cannot say), and
    # application clocks and compute mode set back to defaults, each step reporting its own failure.
    def occupancy(self, index: int) -> Occupancy: ...

    # What each process on a GPU uses (its MIG devices' processes, MPS clients once, utilisation
    # where the driver reports it); NvmlError when NVML cannot list them.
    def process_usage(self, index: int) -> tuple[ProcessUsage, ...]: ...

    def reset_settings(self, index: int, compute_mode: int) -> tuple[ResetStep, ...]: ...

    def close(self) -> None: ...


class MpsDaemons(Protocol):
    """MPS control daemons, one per shared GPU in mps mode, by GPU UUID (isolator/host/mps.py)."""

    def pipe_dir(self, uuid: str) -> str: ...

    def start(self, uuid: str, multiuser: bool = False) -> int: ...  # its pid; MpsError when it cannot start

    def command(self, uuid: str, text: str) -> str: ...  # one control command's answer

    def alive(self, uuid: str) -> bool: ...  # its process lives and it answers

    def pid(self, uuid: str) -> int | None: ...  # the running daemon's pid, None when none runs

    def multiuser(self, uuid: str) -> bool | None: ...  # started with -multiuser-server; None: none runs

    def stop(self, uuid: str) -> None: ...  # quit, then kill; none running: no-op


class UserDb(Protocol):
    """Unix users by name: the host's passwd database (host/system.py)."""

    def uid(self, name: str) -> int | None: ...  # None: no such user


class DeviceNodes(Protocol):
    """The NVIDIA device nodes under a dev root (their numbers are partly dynamic)."""

    dev_root: str

    def control_devices(self) -> ControlDevices: ...

    def caps_major(self) -> int | None: ...


class PinnedProcess(Protocol):
    """One process held by a pidfd: its pid cannot name another process while it is alive."""

    def alive(self) -> bool: ...

    def close(self) -> None: ...


class Processes(Protocol):
    """The process table (``/proc``, pidfds)."""

    def exists(self, pid: int) -> bool: ...

    def pin(self, pid: int) -> PinnedProcess | None: ...  # None: no such process

    def sidecar_pids(self) -> frozenset[int]: ...  # the sidecar and its ancestors

    def kernel_thread(self, pid: int) -> bool: ...  # kthreadd and its children (no cgroup of a container)

    def leader_of(self, pid: int) -> int | None: ...  # its thread group's leader (pid itself for a process)

    def exited(self, pid: int) -> bool: ...  # a zombie: exited, not yet reaped by its parent

    def same_pid_namespace(self, pid: int) -> bool | None: ...  # pid's pid namespace is ours; None: gone

    def descends_from(self, pid: int, ancestor: int) -> bool: ...  # ancestor in pid's parent chain; False when gone


class Filesystem(Protocol):
    """The few filesystem questions the core asks about a container's rootfs."""

    def is_dir(self, path: str) -> bool: ...

    def make_dirs(self, path: str) -> None: ...

    def make_dirs_in(self, rootfs: str, path: str) -> str:
        """Make directory ``path`` inside image ``rootfs`` resolved as if the rootfs were ``/``
        (isolator/host/rootfs.py); the host path it resolved to."""
        ...

    def mount_target(self, rootfs: str, path: str) -> str:
        """The host path to bind a file on at ``path`` inside ``rootfs``, resolved the same way."""
        ...


class Clock(Protocol):
    """Wall time for records and statistics; monotonic time and sleeping for waits."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...
