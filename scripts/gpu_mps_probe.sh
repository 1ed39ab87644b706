#!/usr/bin/env bash
# One fact-finding run of the REAL MPS control daemon (nvidia-cuda-mps-control) on a lent GPU machine,
# for issue 41 ("Shares that hold"): the exact replies of its control commands, which limits hold
# against a client, per-server values, a client of another Unix user, the FAULT state, quit.
# Results: docs/gpu-host-results.md, "MPS control daemon on driver 580".
#
# Changes no GPU setting: MPS runs in the compute mode the GPU has (Default here; no nvidia-smi -c,
# no clocks, power, persistence, MIG or reset). The daemon gets a private CUDA_MPS_PIPE_DIRECTORY
# and CUDA_MPS_LOG_DIRECTORY under /tmp and is always quit at the end (trap, also on failure); only
# MPS processes that were not there before the run are ever killed. Every command is bounded by
# timeout; everything goes to stdout and $OUT/log. Clients use the CUDA driver API through ctypes
# (no framework; one torch client for the SM count as a framework reads it). The FAULT question
# launches one kernel that writes to an unmapped address (an MMU fault, Xid 31: an application
# error the driver recovers from, as in any buggy CUDA program). Run as root:
#     timeout -k 10 270 bash scripts/gpu_mps_probe.sh; sleep 2
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_mps_common.sh
source scripts/gpu_mps_common.sh

say "Q1a help: nvidia-cuda-mps-control -h / --help / man"
echo '$ nvidia-cuda-mps-control -h'; timeout -k 2 10 nvidia-cuda-mps-control -h </dev/null; echo "[exit $?]"
echo '$ nvidia-cuda-mps-control --help'; timeout -k 2 10 nvidia-cuda-mps-control --help </dev/null; echo "[exit $?]"
echo '$ man nvidia-cuda-mps-control'; MANPAGER=cat timeout 10 man nvidia-cuda-mps-control 2>&1 | head -150; echo "[exit ${PIPESTATUS[0]}]"
echo '$ strings nvidia-cuda-mps-control | grep command words (the commands the binary knows)'
timeout 10 strings -n 6 "$MPSC" | grep -E '^(get|set|start|shutdown|terminate|quit|lookup|ps|level|unset)[_ a-z]*' | sort -u | head -80
timeout 10 strings -n 6 "$MPSC" | grep -iE 'usage|fault|not ready|multiuser|user id|uid' | sort -u | head -60

say "Q1b start: nvidia-cuda-mps-control -d (private pipe and log directories; CUDA_VISIBLE_DEVICES=the GPU's UUID, as the sidecar starts it)"
export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD CUDA_VISIBLE_DEVICES=$UUID
echo "\$ CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD CUDA_VISIBLE_DEVICES=$UUID nvidia-cuda-mps-control -d"
timeout -k 2 10 nvidia-cuda-mps-control -d </dev/null; echo "[exit $?]"
sleep 1
echo "-- new MPS processes: [$(new_mps | tr '\n' ' ')]"; mps_procs
echo "-- pipe directory:"; ls -la "$PIPE"; for f in "$PIPE"/*.pid; do [ -f "$f" ] && echo "$f: $(cat "$f")"; done
echo "-- log directory:"; ls -la "$LOGD"
echo '-- a second -d with the same directories:'
echo '$ nvidia-cuda-mps-control -d'; timeout -k 2 10 nvidia-cuda-mps-control -d </dev/null; echo "[exit $?]"
sleep 0.5; echo "-- new MPS processes: [$(new_mps | tr '\n' ' ')]"

say "Q1c control commands before any client (no server yet)"
mc get_server_list
mc get_default_active_thread_percentage
mc set_default_active_thread_percentage 25
mc get_default_active_thread_percentage
mc get_default_device_pinned_mem_limit 0
mc set_default_device_pinned_mem_limit 0 2G
mc get_default_device_pinned_mem_limit 0
mc get_default_device_pinned_mem_limit "$UUID"
mc get_device_client_list
mc get_default_client_priority
mc ps
echo "-- malformed and unknown commands:"
mc set_default_active_thread_percentage abc
mc set_default_active_thread_percentage 0
mc set_default_active_thread_percentage 150
mc get_default_active_thread_percentage
mc set_default_device_pinned_mem_limit 0 2
mc set_default_device_pinned_mem_limit 7 1G
mc get_default_device_pinned_mem_limit 0
mc get_server_status
mc no_such_command
echo "-- the defaults set again (in case a malformed value above was taken):"
mc set_default_active_thread_percentage 25
mc set_default_device_pinned_mem_limit 0 2G
mc get_default_active_thread_percentage
mc get_default_device_pinned_mem_limit 0
echo '-- two commands in one stdin:'
echo "\$ printf 'get_default_active_thread_percentage\nget_server_list\n' | nvidia-cuda-mps-control"
printf 'get_default_active_thread_percentage\nget_server_list\n' | timeout -k 2 10 nvidia-cuda-mps-control; echo "[exit $?]"
echo "-- control.log so far:"; cat "$LOGD/control.log" 2>&1

say "Q2a first client (limits unset in its environment): it starts the server; SM count and memory it sees"
client 40 -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT $CL info
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
mps_procs
mc get_server_status "$SP"
mc get_active_thread_percentage "$SP"
mc get_device_pinned_mem_limit "$SP" 0
mc get_client_list "$SP"
mc get_device_client_list
mc get_device_client_list "$SP"
mc ps
echo "-- server log so far:"; ls -la "$LOGD"; tail -n 30 "$LOGD/server.log" 2>&1

say "Q2b daemon default pinned limit 2G: a client with the variable unset allocates 1 then 4 GiB"
client 40 -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CL alloc 1 1.9 4
say "Q2c the variable set HIGHER than the daemon's: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G, allocates 4 GiB"
client 40 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G $CL alloc 4 1
say "Q2d the variable set LOWER: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G, allocates 0.5 then 1.5 GiB"
client 40 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G $CL alloc 0.5 1.5
say "Q2e thread percentage: daemon default 25; client CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100, then =10"
client 40 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 $CL info
client 40 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10 $CL info
say "Q2f the SM count as torch reads it (variable unset)"
client 60 -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $PY -c "import torch; p = torch.cuda.get_device_properties(0); print('RESULT torch multi_processor_count', p.multi_processor_count, 'total_memory GiB %.3f' % (p.total_memory / 2**30)); print('RESULT torch mem_get_info GiB', [round(x / 2**30, 3) for x in torch.cuda.mem_get_info()])"
say "Q2g a client WITHOUT CUDA_MPS_PIPE_DIRECTORY (compute mode Default; no daemon at /tmp/nvidia-mps): does it bypass MPS?"
ls -la /tmp/nvidia-mps 2>&1
bg_client bypass 30 -u CUDA_MPS_PIPE_DIRECTORY $CL hold 3
sleep 2; echo "-- compute apps while it holds:"; apps; mps_procs
bg_show bypass
client 40 -u CUDA_MPS_PIPE_DIRECTORY $CL alloc 4
mc get_server_list

say "Q3 per-server values (a client holds the server meanwhile)"
bg_client holder3 40 $CL hold 14
sleep 3
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
mc get_client_list "$SP"
echo "-- compute apps while a client holds (what NVML sees under MPS):"; apps
echo "-- a new DEFAULT while the server runs: does it reach the running server?"
mc set_default_active_thread_percentage 40
mc get_active_thread_percentage "$SP"
client 40 $CL info
echo "-- per-server thread percentage:"
mc set_active_thread_percentage "$SP" 50
mc get_active_thread_percentage "$SP"
mc get_default_active_thread_percentage
client 40 $CL info
client 40 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 $CL info
echo "-- per-server pinned memory:"
mc set_device_pinned_mem_limit "$SP" 0 3G
mc get_device_pinned_mem_limit "$SP" 0
mc get_default_device_pinned_mem_limit 0
client 40 $CL alloc 2.5 3.5
bg_show holder3
echo "-- the holder (started before the per-server changes) saw:"; grep RESULT "$BASE/holder3.out"
mc get_server_list

say "Q4 users: a root client holds the server, a client of uid 65534 (nobody) starts meanwhile"
ls -la "$PIPE"
mc get_server_list; SP=$(server_pid)
bg_client rootholder 30 $CL hold 8
sleep 3
T4=$(date +%s.%N)
bg_client nobody 20 HOME=/tmp $CL --uid 65534 alloc 0.25
sleep 3
echo "-- 3 s after the nobody client started:"
mc get_server_list; mc ps; mps_procs; apps
echo "-- control.log tail:"; tail -n 15 "$LOGD/control.log"
bg_show rootholder
bg_show nobody
echo "nobody client ended $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $T4}") s after it started"
mc get_server_list; mc ps; mps_procs
echo "-- control.log tail:"; tail -n 20 "$LOGD/control.log"
if ! grep -q 'cuCtxSetCurrent: CUDA_SUCCESS' "$BASE/nobody.out"; then
    echo "-- the nobody client did not get a context; again with the pipe directory's entries opened to all (chmod a+rwX):"
    chmod -R a+rwX "$PIPE"; ls -la "$PIPE"
    client 20 HOME=/tmp $CL --uid 65534 alloc 0.25
    mc get_server_list; tail -n 10 "$LOGD/control.log"
fi

say "Q5 FAULT: a bystander client works in a loop; another client writes to an unmapped address"
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
bg_client bystander 30 $CL hold 14
sleep 3
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"; mc get_server_status "$SP"
client 25 $CL fault
echo "-- right after the fault:"
mc get_server_list; SPF=$(server_pid); echo "server pid: [$SPF]"
mc get_server_status "$SPF"
mc get_client_list "$SPF"
mc ps
mps_procs
echo "-- server.log tail:"; tail -n 25 "$LOGD/server.log"
echo "-- a NEW client while the bystander still runs:"
client 10 $CL info
mc get_server_status "$SPF"
bg_show bystander
sleep 1
echo "-- after every client has exited:"
mc get_server_list; SP=$(server_pid); echo "server pid: [$SP]"
mc get_server_status "$SP"
client 30 $CL alloc 0.5
mc get_server_list; SP=$(server_pid); mc get_server_status "$SP"
echo "-- server.log tail:"; tail -n 25 "$LOGD/server.log"
echo "-- control.log tail:"; tail -n 25 "$LOGD/control.log"
echo "-- kernel log (Xid):"; timeout 5 dmesg 2>&1 | grep -iE 'xid|nvrm' | tail -n 15

say "Q6 quit"
mc get_server_list
mc quit
for i in $(seq 50); do [ -z "$(new_mps)" ] && break; sleep 0.2; done
echo "-- MPS processes of this run left after quit (pgrep -x nvidia-cuda-mps, minus those before): [$(new_mps | tr '\n' ' ')]"
mps_procs
ls -la "$PIPE"
echo '-- a command with no daemon running:'
mc get_server_list
