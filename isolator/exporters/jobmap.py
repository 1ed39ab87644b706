"""dcgm-exporter's HPC job mapping: one file per GPU, named by its NVML index (a MIG device as
``<index>.<gpu instance>``), listing the IDs of the containers that hold it, one per line.

dcgm-exporter (``--hpc-job-mapping-dir``) reads these files at each scrape and adds each line as an
``hpc_job`` label value (NVIDIA/dcgm-exporter ``internal/pkg/transformation/hpc.go``):

* from 4.5.3-4.8.2 (PR #602) it keeps names ``<digits>`` or ``<digits>.<digits>`` (ASCII) and labels a
  MIG device's metrics from ``<gpu>.<gpu instance>`` only (the NVML GPU instance ID, its
  ``GPU_I_ID`` label), a GPU's own metrics from ``<gpu>``;
* before, it kept only names ``strconv.Atoi`` parses, so ``<gpu>.<gpu instance>`` files are skipped
  and a MIG device's metrics are labelled from its GPU's ``<gpu>`` file.

Hence the ``<gpu>`` file lists everyone with work on the GPU and each instance file its own holders
plus a whole-GPU holder: right for both. ``sync`` rewrites every file from the service's state (each
one atomically), so the directory is exact after any crash: the daemon calls it at start and after
every call that may change who holds what.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
from typing import Any

from isolator.errors import ConfigError

LOG = logging.getLogger(__name__)

# Names this module writes (dcgm-exporter's own pattern; ASCII digits, as Go's \d); other files in the
# directory are left alone.
OURS = re.compile(r"^[0-9]+(\.[0-9]+)?$")
# Its temporary files (written, then renamed over a name above); one is left only by a crash mid-write.
TMP_PREFIX = ".tmp-"
# Hooks after which holdings may have changed.
MUTATING = frozenset({"Recover", "Prepare", "Update", "Cleanup", "Release"})


class JobMapping:
    def __init__(self, directory: str, service: Any, inventory: Any) -> None:
        self.directory = directory
        self.service = service  # list_containers(): isolator.core.api.IsolatorApi
        self.inventory = inventory  # records: the managed GPUs and their MIG devices
        self._lock = threading.Lock()
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"failed to create --job-mapping-dir '{directory}': {exc.strerror}") from exc
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"--job-mapping-dir '{directory}' is not writable")

    def wanted(self) -> dict[str, list[str]]:
        """File name -> container IDs, from the service's records.

        A GPU held whole lists its holder in its own file and in every MIG device's; a MIG device
        held as a unit (docs/mig.md) lists its holder in its ``<index>.<gpu instance>`` file and in
        its GPU's file (every container with work on that GPU).
        """
        holders: dict[int, set[str]] = {}
        unit_holders: dict[str, set[str]] = {}
        for c in self.service.list_containers(usage=False):  # who holds what; not what they use
            if c.nested:
                continue  # nested containers share their top-level container's GPUs and ID prefix
            for index in c.gpu_indices:
                holders.setdefault(int(index), set()).add(str(c.container_id))
            if c.shares and c.share_gpu_index >= 0:  # every sharer has work on its GPU (docs/sharing.md)
                holders.setdefault(c.share_gpu_index, set()).add(str(c.container_id))
            for uuid in c.mig_uuids:
                unit_holders.setdefault(uuid, set()).add(str(c.container_id))
        out: dict[str, list[str]] = {}
        for record in self.inventory.records:
            index = record.gpu.index
            whole = holders.get(index, set())
            on_gpu = set(whole)
            if record.mig_enabled:
                per_gi: dict[int, set[str]] = {}
                for mig in record.mig_devices:
                    ids = unit_holders.get(mig.uuid, set())
                    per_gi.setdefault(mig.gpu_instance_id, set()).update(ids)
                    on_gpu |= ids
                for gi, ids in per_gi.items():
                    out[f"{index}.{gi}"] = sorted(whole | ids)
            out[str(index)] = sorted(on_gpu)
        return out

    def sync(self) -> None:
        with self._lock:
            wanted = self.wanted()
            for name, ids in wanted.items():
                self._write(name, "".join(f"{i}\n" for i in ids))
            for name in os.listdir(self.directory):
                if (OURS.match(name) and name not in wanted) or name.startswith(TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.directory, name))

    def _write(self, name: str, text: str) -> None:
        path = os.path.join(self.directory, name)
        try:
            with open(path) as fh:
                if fh.read() == text:
                    return
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def observe(self, hook: str, code: str, seconds: float, response: Any = None) -> None:
        """The server's observer: rewrite after any call that may have changed holdings."""
        if hook in MUTATING:
            try:
                self.sync()
            except Exception:
                LOG.exception("failed to update the job mapping in '%s'", self.directory)
