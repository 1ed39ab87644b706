#!/bin/sh
# mesos-agent-cgroup2.sh AGENT [FLAGS...]: run a Mesos agent on cgroup v2 alone (Mesos master of
# 2024-08 on, the first with the cgroups2 isolators; no release up to 1.11.0 has them). What
# `make test-mesos` runs for its v2 scenarios (isolator/testing/cluster.py, cgroups="v2").
#
# * The agent aborts at its first launch unless its --cgroups_root exists (`Check failed:
#   cgroups2::exists(flags.cgroups_root)`): created here first. The root is the agent's: its
#   --cgroups_root= argument, else MESOS_CGROUPS_ROOT (the agent reads every flag from MESOS_<NAME>
#   too: a unit's EnvironmentFile, docs/operations.md), else the agent's default, mesos. (Reading the
#   argument alone made `mesos` for an agent whose root was in its environment file, and that agent
#   aborted at its first launch: tests/node/test_v2.py.)
# * On a pure v2 host (cgroup2 at /sys/fs/cgroup) that is all: the agent is exec'ed as it is.
# * On a hybrid host (v1 controllers under /sys/fs/cgroup, cgroup2 at /sys/fs/cgroup/unified) the
#   agent would refuse the layout ("Found cgroups2 mount at an unexpected location"): it runs in a
#   mount namespace of its own (propagation slave: nothing done there reaches the host) where
#   /sys/fs/cgroup is unmounted recursively and cgroup2 mounted there. The host's mounts are
#   untouched; the sidecar, on the host, sees the same hierarchy at /sys/fs/cgroup/unified
#   (gpu-isolator serve --cgroup-version v2, docs/mesos-agent.md section 9).
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 /path/to/mesos-agent [FLAGS...]" >&2
    exit 2
fi
agent=$1
shift
root=${MESOS_CGROUPS_ROOT:-mesos}
for arg in "$@"; do
    case $arg in
    --cgroups_root=*) root=${arg#--cgroups_root=} ;;
    esac
done
fstype() { stat -f -c %T "$1" 2>/dev/null || true; }
if [ "$(fstype /sys/fs/cgroup)" = cgroup2fs ]; then
    mkdir -p "/sys/fs/cgroup/$root"
    exec "$agent" "$@"
fi
if [ "$(fstype /sys/fs/cgroup/unified)" != cgroup2fs ]; then
    echo "$0: no cgroup2 hierarchy at /sys/fs/cgroup nor at /sys/fs/cgroup/unified" >&2
    exit 1
fi
mkdir -p "/sys/fs/cgroup/unified/$root"
exec unshare --mount --propagation slave -- sh -c \
    'umount -R /sys/fs/cgroup && mount -t cgroup2 none /sys/fs/cgroup && exec "$@"' mesos-agent "$agent" "$@"
