#!/usr/bin/env bash
# The second fact-finding run of the REAL MPS control daemon on a lent GPU machine, for issue 41:
# what the first run (scripts/gpu_mps_probe.sh) left open. `start_server -uid` before any client,
# the pipe directory while a server runs and a client through a READ-ONLY bind mount of it,
# `terminate_client`, SIGKILL of a client and of the control daemon (do server and clients survive,
# does a new `-d` take over), and `-multiuser-server` with two users at once. The daemon's process
# facts (exe, environment, owner) for telling it apart from a process a sharer names.
# Results: docs/gpu-host-results.md, "MPS control daemon, second run".
#
# Changes no GPU setting (the compute mode stays as it is, Default on the lent machines); the daemon
# runs on private directories and is quit at the end; only MPS processes this run made are killed.
# Run as root:   timeout -k 10 280 bash scripts/gpu_mps_probe2.sh; sleep 2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-mps-probe2}
# shellcheck source=scripts/gpu_mps_common.sh
source scripts/gpu_mps_common.sh

export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD CUDA_VISIBLE_DEVICES=$UUID
start_daemon() {  # start_daemon [extra options]
    echo "\$ nvidia-cuda-mps-control -d $*"
    timeout -k 2 10 nvidia-cuda-mps-control -d "$@" </dev/null; echo "[exit $?]"
    sleep 0.5
}
daemon_facts() {
    local p
    p=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null); echo "pid file: [$p]"
    [ -n "$p" ] && [ -d "/proc/$p" ] || { echo "no such process"; return; }
    echo "exe: $(readlink "/proc/$p/exe")  owner: $(stat -c %u "/proc/$p")  ppid: $(awk '{print $4}' "/proc/$p/stat")  starttime: $(awk '{print $22}' "/proc/$p/stat")"
    echo "cmdline: $(tr '\0' ' ' <"/proc/$p/cmdline")"
    echo "environ CUDA_*: $(tr '\0' '\n' <"/proc/$p/environ" | grep '^CUDA_' | tr '\n' ' ')"
    echo "open sockets/fds: $(ls -l "/proc/$p/fd" 2>/dev/null | awk 'NR>1{print $NF}' | sort | uniq -c | tr '\n' ';')"
}

say "R1 start, defaults, then start_server -uid 0 BEFORE any client"
start_daemon
daemon_facts
mc set_default_active_thread_percentage 25
mc set_default_device_pinned_mem_limit 0 2G
mc start_server -uid 0
sleep 1
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
mps_procs
[ -n "$SP" ] && { mc get_server_status "$SP"; mc get_active_thread_percentage "$SP"; mc get_device_pinned_mem_limit "$SP" 0; }
echo "-- server process facts:"; [ -n "$SP" ] && echo "owner $(stat -c %u "/proc/$SP") exe $(readlink "/proc/$SP/exe") environ: $(tr '\0' '\n' <"/proc/$SP/environ" | grep '^CUDA_' | tr '\n' ' ')"
echo "-- compute apps (does the pre-started server hold a context?):"; apps
mc start_server -uid 0
mc start_server -uid 65534
mc get_server_list
echo "-- control.log tail:"; tail -n 12 "$LOGD/control.log"
client 40 $CL alloc 1 1.9
mc get_server_list

say "R2 the pipe directory while a server runs"
ls -la "$PIPE"; find "$PIPE" -maxdepth 2 -printf '%M %u %s %p\n' 2>/dev/null | head -40
ls -la /dev/shm | head -20

say "R3 a client through a READ-ONLY bind mount of the pipe directory (own mount namespace)"
mkdir -p "$BASE/ro"
client 40 unshare -m sh -c "mount --bind '$PIPE' '$BASE/ro' && mount -o remount,bind,ro '$BASE/ro' && grep ' $BASE/ro ' /proc/self/mounts && touch '$BASE/ro/probe' 2>&1; CUDA_MPS_PIPE_DIRECTORY='$BASE/ro' exec $CL alloc 1 3"
echo "-- same, mounted read-only ON the pipe directory's own path:"
client 40 unshare -m sh -c "mount --bind '$PIPE' '$PIPE' && mount -o remount,bind,ro '$PIPE' && echo x > '$PIPE/nvidia-cuda-mps-control.pid' 2>&1; exec $CL info"
echo "-- pid file intact: [$(cat "$PIPE/nvidia-cuda-mps-control.pid")]"
echo "-- control.log tail:"; tail -n 8 "$LOGD/control.log"

say "R4 terminate_client: two holders; the first one terminated by the control daemon"
bg_client victim 40 $CL hold 15
bg_client bystander 40 $CL hold 15
sleep 4
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
mc get_client_list "$SP"
mc get_device_client_list
mc get_device_client_list "$SP"
mc ps
VPID=$(grep -o 'client pid=[0-9]*' "$BASE/victim.out" | head -1 | cut -d= -f2); echo "victim client pid: [$VPID]"
T=$(date +%s.%N)
mc terminate_client "$SP" "$VPID"
for i in $(seq 40); do kill -0 "$VPID" 2>/dev/null || break; sleep 0.1; done
echo "victim process alive after terminate_client: $(kill -0 "$VPID" 2>/dev/null && echo yes || echo no) ($(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $T}") s)"
mc get_server_status "$SP"; mc get_client_list "$SP"
sleep 2
bg_show victim
mc get_server_status "$SP"
echo "-- server.log tail:"; tail -n 12 "$LOGD/server.log"

say "R5 SIGKILL of a client in the middle of its work"
bg_client killed 40 $CL hold 15
sleep 4
KPID=$(grep -o 'client pid=[0-9]*' "$BASE/killed.out" | head -1 | cut -d= -f2); echo "client pid: [$KPID]"
kill -9 "$KPID"; sleep 2
mc get_server_status "$SP"; mc get_client_list "$SP"
bg_show killed
bg_show bystander
echo "-- server.log tail:"; tail -n 12 "$LOGD/server.log"
client 30 $CL alloc 0.5

say "R6 SIGKILL of the CONTROL daemon while a client holds the server"
bg_client survivor 40 $CL hold 14
sleep 4
DP=$(cat "$PIPE/nvidia-cuda-mps-control.pid"); echo "control daemon pid: [$DP]"
kill -9 "$DP"; sleep 1
mps_procs
echo "-- pipe directory after:"; ls -la "$PIPE"
mc get_server_list
echo "-- a new client with the daemon dead:"
client 20 $CL info
echo "-- a new -d with the same directories while the old server (maybe) lives:"
start_daemon
daemon_facts
mc get_server_list
mc ps
client 30 $CL info
bg_show survivor
mps_procs
echo "-- control.log tail:"; tail -n 15 "$LOGD/control.log"

say "R7 quit; then -multiuser-server with a root client and a uid 65534 client at once"
mc quit
for i in $(seq 50); do [ -z "$(new_mps)" ] && break; sleep 0.2; done
echo "left: [$(new_mps | tr '\n' ' ')]"
for p in $(new_mps); do echo "killing leftover $p: $(tr '\0' ' ' <"/proc/$p/cmdline")"; kill -9 "$p"; done
sleep 0.5
start_daemon -multiuser-server
[ -s "$PIPE/nvidia-cuda-mps-control.pid" ] || start_daemon --multiuser-server
[ -s "$PIPE/nvidia-cuda-mps-control.pid" ] || start_daemon -M
daemon_facts
mc get_server_list
bg_client mroot 40 $CL hold 10
sleep 3
T=$(date +%s.%N)
bg_client mnobody 30 HOME=/tmp $CL --uid 65534 hold 4
sleep 3
mc get_server_list; mc ps; mps_procs
bg_show mnobody
echo "nobody client done $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $T}") s after it started"
bg_show mroot
echo "-- control.log tail:"; tail -n 15 "$LOGD/control.log"
say "R8 quit"
mc quit
