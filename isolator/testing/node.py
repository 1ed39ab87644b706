"""A Debian 12 node booted with systemd as PID 1 (``systemd-nspawn -b``), for ``make test-node`` (tests/node/).

Owns the cached root filesystem (mmdebstrap, built once per package list under ``CACHE``), the
wheelhouse the node installs the project's dependencies from, and one booted machine: its cgroups
under the tests' parent, its temporary directory, its nspawn process. Installs nothing on the host
and never talks to the host's systemd (there may be none: the machine is started with
``--register=no --keep-unit``).

    with Node(mesos_home, wheel, module_so) as node:        # boots, installs, starts the units
        node.run("systemctl is-active gpu-isolator")         # a command inside, as root
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence

from isolator.testing.cgroupfs import TEST_PARENT, remove_cgroup_tree
from isolator.testing.mesoshome import free_port

__all__ = [
    "CACHE",
    "HOST_PACKAGES",
    "Node",
    "NodeError",
    "ensure_rootfs",
    "ensure_wheelhouse",
    "missing_host_packages",
]

CACHE = os.environ.get("GI_NODE_CACHE", "/var/cache/gpu-isolator-node")
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What the node holds beyond Debian's minbase: systemd as init, Python for the wheel (venv), gcc
# (the simulated host compiles its fake NVML at the sidecar's first start, isolator/simhost/sim.py),
# the runtime libraries of the shared Mesos build (../shared/mesos/setup.sh's list), procps for ps.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-venv",
    "gcc",
    "libc6-dev",
    "procps",
    "libapr1",
    "libarchive13",
    "libcurl4",
    "libev4",
    "libgoogle-glog0v6",
    "libgrpc++1.51",
    "libgrpc29",
    "libhttp-parser2.9",
    "libleveldb1d",
    "libprotobuf32",
    "libre2-9",
    "libsasl2-2",
    "libsvn1",
    "libunwind8",
    "libzookeeper-mt2",
    "zlib1g",
    "xz-utils",
)
# The host's tools, by the Debian package that ships them (``make test-node`` names what is missing).
HOST_PACKAGES = {"systemd-nspawn": "systemd-container", "mmdebstrap": "mmdebstrap", "nsenter": "util-linux"}
# The v1 controllers the node's cgroups take (a hybrid host: these under /sys/fs/cgroup, cgroup2 at
# unified, the name=systemd hierarchy for the node's systemd).
V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd")
MESOS_IN_NODE = "/opt/mesos"
SHARE_IN_NODE = "/node"
AGENT_WORK_IN_NODE = "/var/lib/mesos"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class NodeError(RuntimeError):
    pass


def missing_host_packages() -> list[str]:
    """The Debian packages whose tools the harness needs and this host lacks."""
    return sorted({pkg for tool, pkg in HOST_PACKAGES.items() if shutil.which(tool) is None})


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on ``path``: two runs never build the same cache entry at once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def rootfs_key(packages: Sequence[str] = PACKAGES) -> str:
    """What goes into the root filesystem, hashed: the suite, the mirror, the packages."""
    recipe = json.dumps({"suite": SUITE, "mirror": MIRROR, "variant": "minbase", "packages": sorted(packages)})
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def ensure_rootfs(cache: str = CACHE, packages: Sequence[str] = PACKAGES) -> str:
    """The cached root filesystem for ``packages`` (``<cache>/rootfs-<key>``), built by mmdebstrap
    from Debian's mirror when it is not there yet (a minute or two). Never modified once built: each
    boot writes to a volatile overlay above it."""
    path = os.path.join(cache, "rootfs-" + rootfs_key(packages))
    if os.path.exists(os.path.join(path, ".complete")):
        return path
    with _locked(path + ".lock"):
        if os.path.exists(os.path.join(path, ".complete")):
            return path
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        argv = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(packages), SUITE, tmp, MIRROR]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise NodeError(f"failed to build the node's root filesystem '{tmp}': {result.stderr[-3000:]}")
        with open(os.path.join(tmp, ".complete"), "w") as fh:
            fh.write(" ".join(argv) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    return path


def wheel_requirements(wheel: str) -> list[str]:
    """The wheel's Requires-Dist lines without extras (what ``pip install <wheel>`` pulls in)."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return sorted(
        line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:") and "extra ==" not in line
    )


def ensure_wheelhouse(wheel: str, python: str, cache: str = CACHE) -> str:
    """The project's dependencies as wheels (``<cache>/wheels-<key>``, keyed on the wheel's
    requirements), downloaded once from PyPI with ``python -m pip download``: the node installs the
    project offline from them, as an operator with a mirror would."""
    reqs = wheel_requirements(wheel)
    path = os.path.join(cache, "wheels-" + hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(path, ".complete")):
        return path
    with _locked(path + ".lock"):
        if not os.path.exists(os.path.join(path, ".complete")):
            shutil.rmtree(path, ignore_errors=True)
            argv = [python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:"]
            result = subprocess.run([*argv, "-d", path, *reqs], capture_output=True, text=True)
            if result.returncode != 0:
                raise NodeError(f"failed to download the node's wheels into '{path}': {result.stderr[-3000:]}")
            open(os.path.join(path, ".complete"), "w").close()
    return path


class Node:
    """One booted node. ``start()`` boots it and waits for systemd; ``stop()`` (also on ``__exit__``
    and when ``start()`` fails) powers it off, kills what is left in its cgroups, removes them and
    its temporary directory."""

    def __init__(
        self,
        rootfs: str,
        *,
        binds: Sequence[tuple[str, str]] = (),
        ro_binds: Sequence[tuple[str, str]] = (),
        scratch: Sequence[str] = (AGENT_WORK_IN_NODE,),
        cgroups: str = "v1",
    ):
        """``scratch``: directories of the node bound to fresh ones of the host's temporary directory
        (default the agent's work directory: its overlay backend cannot stack on the node's volatile
        overlay root, and the host's disk holds what tasks write).

        ``cgroups``: the layout the node boots with. ``"v1"``: the host's hybrid one (the v1
        controllers, the name=systemd hierarchy, cgroup2 at ``/sys/fs/cgroup/unified``). ``"v2"``:
        cgroup2 alone at ``/sys/fs/cgroup``, as on a host booted with ``systemd.unified_cgroup_hierarchy=1``
        (``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``: nspawn mounts the host's cgroup2 hierarchy there in a
        cgroup namespace rooted at the node's cgroup, and the node's systemd runs on it alone). The
        kernel's v1 controllers still exist beside it on this host: the node's processes stay in the
        node's v1 devices cgroup, which allows every device, so the device programs are the only gate."""
        if cgroups not in ("v1", "v2"):
            raise ValueError(f"cgroups must be 'v1' or 'v2', not {cgroups!r}")
        self.cgroups = cgroups
        self.rootfs = rootfs
        self.name = f"gi-node-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.cgroup = f"{TEST_PARENT}/{self.name}"
        self.binds = list(binds)
        self.ro_binds = list(ro_binds)
        self.scratch = list(scratch)
        self.tmp = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.console = ""

    def __enter__(self) -> Node:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def share(self) -> str:
        """The host's side of ``/node`` inside: files handed to the node (wheel, module, probe)."""
        return os.path.join(self.tmp, "share")

    def _make_cgroups(self) -> list[str]:
        """The node's own cgroup in every v1 hierarchy and in cgroup2, under the tests' parent."""
        made = []
        for ctrl in (*V1_CONTROLLERS, "unified"):
            root = f"/sys/fs/cgroup/{ctrl}"
            if not os.path.isdir(root):
                continue
            path = os.path.join(root, self.cgroup)
            if ctrl == "cpuset":
                # cpuset children start empty: copy cpus and mems down from the root.
                parent = os.path.dirname(path)
                os.makedirs(parent, exist_ok=True)
                for key in ("cpuset.cpus", "cpuset.mems"):
                    for d in (parent, path):
                        os.makedirs(d, exist_ok=True)
                        with open(os.path.join(root, key)) as src, open(os.path.join(d, key), "w") as dst:
                            dst.write(src.read())
            os.makedirs(path, exist_ok=True)
            made.append(path)
        return made

    def start(self, timeout: float = 120) -> Node:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.tmp = tempfile.mkdtemp(prefix=self.name + "-")
        os.makedirs(self.share)
        cgroups = self._make_cgroups()
        self.console = os.path.join(self.tmp, "console.log")
        argv = [
            "systemd-nspawn",
            "--quiet",
            "-D",
            self.rootfs,
            "-b",
            "-M",
            self.name,
            # No systemd on the host to register with or to make a scope: the node runs in the
            # cgroups made above (the wrapper below moves it there), never in the host's own.
            "--register=no",
            "--keep-unit",
            "--console=passive",
            # Every boot writes to a tmpfs overlay: the cached root filesystem stays as built.
            "--volatile=overlay",
            f"--bind={self.share}:{SHARE_IN_NODE}",
            # What root on a host may do and nspawn's defaults take away: bpf(2), which nspawn's own
            # system-call filter refuses with EPERM whatever the capabilities (the agent's and the
            # sidecar's device programs on v2: "Failed to load eBPF program: ... Operation not
            # permitted", tests/node/test_v2.py), and the capabilities around it (CAP_NET_ADMIN:
            # BPF_PROG_QUERY on kernels before 6.6).
            "--system-call-filter=bpf",
            "--capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN",
        ]
        for inside in self.scratch:
            outside = os.path.join(self.tmp, "scratch" + inside.replace("/", "-"))
            os.makedirs(outside)
            argv.append(f"--bind={outside}:{inside}")
        argv += [f"--bind={src}:{dst}" for src, dst in self.binds]
        argv += [f"--bind-ro={src}:{dst}" for src, dst in self.ro_binds]
        procs = " ".join(os.path.join(c, "cgroup.procs") for c in cgroups)
        wrapper = f'for f in {procs}; do echo $$ > "$f" || exit 1; done; exec "$@"'
        env = dict(os.environ)
        # nspawn's own choice on a hybrid host is the hybrid layout (its image's systemd is new enough).
        env.pop("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", None)
        if self.cgroups == "v2":
            env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
        log = open(self.console, "wb")  # noqa: SIM115 - closed right after the fork
        try:
            self.proc = subprocess.Popen(
                ["sh", "-c", wrapper, "node", *argv], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not self.leader:
            if self.proc.poll() is not None:
                raise NodeError(f"systemd-nspawn exited {self.proc.returncode}: {self.console_text()}")
            if time.monotonic() > deadline:
                raise NodeError(f"the node did not start within {timeout:g} s: {self.console_text()}")
            self.leader = self._find_leader()
            time.sleep(0.2)
        while True:
            state = self.run("systemctl is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise NodeError(f"the node's systemd is '{state}' after {timeout:g} s: {self.console_text()}")
            time.sleep(0.5)
        fstype = self.run("stat -f -c %T /sys/fs/cgroup").stdout.strip()
        if (fstype == "cgroup2fs") != (self.cgroups == "v2"):
            raise NodeError(f"the node booted for cgroup {self.cgroups} has '{fstype}' at /sys/fs/cgroup")

    def _find_leader(self) -> int:
        """The node's PID 1 as the host sees it: the child of systemd-nspawn running systemd."""
        assert self.proc is not None
        with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as fh:
            for pid in fh.read().split():
                with open(f"/proc/{pid}/comm") as comm:
                    if comm.read().strip() == "systemd":
                        return int(pid)
        return 0

    def console_text(self) -> str:
        with contextlib.suppress(OSError), open(self.console, errors="replace") as fh:
            return fh.read()[-3000:]
        return ""

    def run(
        self, script: str, *, check: bool = True, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``bash -c script`` inside the node (all its namespaces, root), with a clean environment."""
        argv = ["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i", f"PATH={PATH}", "HOME=/root"]
        argv += [f"{k}={v}" for k, v in (env or {}).items()]
        result = subprocess.run([*argv, "bash", "-c", script], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise NodeError(
                f"in the node, exit {result.returncode}: {script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def host_cgroup(self, path: str, controller: str = "") -> str:
        """The host's path of ``path``, a cgroup as the node's processes see it (their
        ``/proc/self/cgroup``: relative to the node's cgroup namespace) in the hierarchy of
        ``controller`` (``""``: cgroup2; ``"devices"``: the v1 devices hierarchy)."""

        def line(text: str) -> str:
            for entry in text.splitlines():
                _, ctrls, where = entry.split(":", 2)
                if ctrls == controller or controller in ctrls.split(","):
                    return where
            raise NodeError(f"no cgroup of the node's PID 1 in the hierarchy '{controller or 'cgroup2'}'")

        with open(f"/proc/{self.leader}/cgroup") as fh:
            outside = line(fh.read())
        inside = line(self.run("cat /proc/1/cgroup").stdout)
        if inside != "/" and not outside.endswith(inside):
            raise NodeError(f"the node's PID 1 is in '{inside}' inside and in '{outside}' outside")
        root = outside[: len(outside) - len(inside)] if inside != "/" else outside
        mount = "/sys/fs/cgroup/unified" if not controller else f"/sys/fs/cgroup/{controller}"
        return os.path.normpath(f"{mount}/{root}/{path}")

    def unit_pid(self, unit: str) -> int:
        """The unit's MainPID as the node sees it (0: not running)."""
        return int(self.run(f"systemctl show -P MainPID {unit}").stdout.strip() or 0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM: nspawn asks the node's systemd to power off (SIGRTMIN+3), then exits.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for ctrl in (*V1_CONTROLLERS, "unified"):
            path = os.path.join(f"/sys/fs/cgroup/{ctrl}", self.cgroup)
            if os.path.isdir(path):
                remove_cgroup_tree(path)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = ""


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback (the node shares the host's network)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
