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
OUT=${OUT:-/tmp/gpu-mps-probe}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1 PATH=/usr/local/nvidia/bin:$PATH
unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_MPS_PINNED_DEVICE_MEM_LIMIT CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
PY=$(command -v python3)
BASE=$(mktemp -d /tmp/mpsprobe.XXXXXX)
chmod 755 "$BASE"                     # another user's client must reach the pipe directory
PIPE=$BASE/pipe LOGD=$BASE/log
mkdir -m 755 "$PIPE" "$LOGD"          # as the sidecar makes them (0755, root)
BGPIDS=""

say() { printf '\n=== %s   [%s]\n' "$*" "$(date -u +%H:%M:%S.%N | cut -c1-12)"; }
mc() {  # one control command: the exact command, stdout, stderr and exit status
    local rc
    printf "\$ echo '%s' | nvidia-cuda-mps-control\n" "$*"
    printf '%s\n' "$*" | timeout -k 2 10 nvidia-cuda-mps-control >"$BASE/mc.out" 2>"$BASE/mc.err"
    rc=$?
    REPLY_OUT=$(cat "$BASE/mc.out")
    printf 'rc=%s stdout=[%s]' "$rc" "$REPLY_OUT"
    [ -s "$BASE/mc.err" ] && printf ' stderr=[%s]' "$(cat "$BASE/mc.err")"
    printf '\n'
}
client() {  # client TIMEOUT [env args] python client.py ARGS...
    local t=$1 rc; shift
    echo "\$ timeout $t env $*"
    timeout -k 2 "$t" env "$@"
    rc=$?
    echo "[client exit $rc$([ $rc = 124 ] && echo ': killed by timeout')]"
}
bg_client() {  # bg_client NAME TIMEOUT [env args] python ...: output in $BASE/NAME.out
    local name=$1 t=$2; shift 2
    echo "\$ timeout $t env $*   (in the background: $name)"
    (timeout -k 2 "$t" env "$@"; echo "[client exit $?]") >"$BASE/$name.out" 2>&1 &
    BGPIDS="$BGPIDS $!"
    eval "PID_$name=$!"
}
bg_show() { local p; eval "p=\$PID_$1"; wait "$p"; echo "--- output of $1:"; cat "$BASE/$1.out"; }
server_pid() { printf 'get_server_list\n' | timeout -k 2 10 nvidia-cuda-mps-control 2>/dev/null | grep -Eo '^[0-9]+' | head -1; }
mps_procs() { ps -eo pid,ppid,user,etimes,args | awk 'NR==1 || /nvidia-cuda-mps|client\.py/' | grep -v awk; }
new_mps() { local p; for p in $(pgrep -x nvidia-cuda-mps); do grep -qw "$p" <<<"$PRE_MPS" || echo "$p"; done; }
mode() { timeout 20 nvidia-smi --query-gpu=index,compute_mode,persistence_mode,mig.mode.current --format=csv; }
apps() { timeout 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; }

cleanup() {
    trap - EXIT INT TERM
    say "cleanup (trap): our background clients, quit, nothing of ours left"
    local p i
    for p in $BGPIDS; do kill -0 "$p" 2>/dev/null && { echo "ending our background client $p"; kill "$p"; }; done
    if [ -n "$(new_mps)" ]; then
        mc quit
        for i in $(seq 50); do [ -z "$(new_mps)" ] && break; sleep 0.2; done
    fi
    for p in $(new_mps); do
        echo "still there after quit: $p ($(tr '\0' ' ' <"/proc/$p/cmdline")): SIGKILL"
        kill -9 "$p"
    done
    sleep 0.5
    echo "MPS processes now (pgrep -x nvidia-cuda-mps): [$(pgrep -x nvidia-cuda-mps | tr '\n' ' ')]"
    echo "-- compute mode after:"; mode
    echo "-- compute apps after:"; apps
    cp "$LOGD"/* "$OUT"/ 2>/dev/null
    echo "== log directory $LOGD:"; ls -la "$LOGD"
    for f in "$LOGD"/*; do echo "----- $f (whole)"; cat "$f"; done
    say "end"
}
trap cleanup EXIT INT TERM

cat >"$BASE/client.py" <<'PYEOF'
"""MPS probe client: CUDA driver API through ctypes (no framework). Prints one line per fact."""
import ctypes as C, os, sys, time

def main(argv):
    t0 = time.time()
    if argv and argv[0] == "--uid":
        uid = int(argv[1]); argv = argv[2:]
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    mode = argv[0] if argv else "info"
    env = {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}
    print(f"client pid={os.getpid()} uid={os.getuid()} mode={' '.join(argv)} env={env}", flush=True)
    cu = C.CDLL("libcuda.so.1")
    for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuDeviceGetAttribute",
                 "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuGetErrorName", "cuCtxSynchronize",
                 "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel", "cuMemsetD8_v2",
                 "cuCtxGetExecAffinity", "cuDriverGetVersion"):
        getattr(cu, name).restype = C.c_int
    cu.cuDevicePrimaryCtxRetain.argtypes = [C.POINTER(C.c_void_p), C.c_int]
    cu.cuCtxSetCurrent.argtypes = [C.c_void_p]
    cu.cuMemAlloc_v2.argtypes = [C.POINTER(C.c_uint64), C.c_size_t]
    cu.cuMemFree_v2.argtypes = [C.c_uint64]
    cu.cuMemsetD8_v2.argtypes = [C.c_uint64, C.c_ubyte, C.c_size_t]
    cu.cuModuleGetFunction.argtypes = [C.POINTER(C.c_void_p), C.c_void_p, C.c_char_p]
    cu.cuLaunchKernel.argtypes = [C.c_void_p] + [C.c_uint] * 7 + [C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p]

    def err(rc):
        if rc == 0:
            return "CUDA_SUCCESS"
        s = C.c_char_p()
        cu.cuGetErrorName(rc, C.byref(s))
        return f"{(s.value or b'?').decode()} ({rc})"

    def step(what, rc):
        print(f"  {what}: {err(rc)}  [t+{time.time() - t0:.2f}s, {time.strftime('%H:%M:%S')}]", flush=True)
        return rc

    v = C.c_int()
    cu.cuDriverGetVersion(C.byref(v))
    if step("cuInit", cu.cuInit(0)):
        return 2
    dev = C.c_int()
    if step("cuDeviceGet(0)", cu.cuDeviceGet(C.byref(dev), 0)):
        return 2
    ctx = C.c_void_p()
    if step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)):
        return 2
    if step("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx)):
        return 2
    sm = C.c_int()
    cu.cuDeviceGetAttribute(C.byref(sm), 16, dev)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    class Aff(C.Structure):
        _fields_ = [("type", C.c_int), ("val", C.c_uint)]
    aff = Aff()
    arc = cu.cuCtxGetExecAffinity(C.byref(aff), 0)  # CU_EXEC_AFFINITY_TYPE_SM_COUNT
    free, total = C.c_size_t(), C.c_size_t()
    mrc = cu.cuMemGetInfo_v2(C.byref(free), C.byref(total))
    print(f"  RESULT sm_count_attribute={sm.value} ctx_exec_affinity_sm={aff.val if arc == 0 else err(arc)}"
          f" memgetinfo={'free=%.3fGiB total=%.3fGiB' % (free.value / 2**30, total.value / 2**30) if mrc == 0 else err(mrc)}"
          f" driver={v.value}", flush=True)

    if mode == "alloc":
        for g in argv[1:]:
            p = C.c_uint64()
            n = int(float(g) * 2**30)
            rc = cu.cuMemAlloc_v2(C.byref(p), n)
            print(f"  RESULT cuMemAlloc({g} GiB = {n} bytes): {err(rc)}", flush=True)
            if rc == 0:
                rc2 = cu.cuMemsetD8_v2(p, 1, n)
                print(f"    cuMemsetD8 over it: {err(rc2)}; sync: {err(cu.cuCtxSynchronize())}", flush=True)
                cu.cuMemFree_v2(p)
    elif mode == "hold":
        secs = float(argv[1])
        p = C.c_uint64()
        step("cuMemAlloc(64 MiB)", cu.cuMemAlloc_v2(C.byref(p), 64 << 20))
        errors = 0
        end = time.time() + secs
        while time.time() < end:
            rc = cu.cuMemsetD8_v2(p, 2, 64 << 20) or cu.cuCtxSynchronize()
            if rc:
                errors += 1
                if errors <= 3 or errors % 10 == 0:
                    print(f"  hold: work failed: {err(rc)} [t+{time.time() - t0:.2f}s, {time.strftime('%H:%M:%S')}] (errors so far {errors})", flush=True)
                if len(argv) > 2 and argv[2] == "exit-on-error":
                    print("  hold: exiting on the error", flush=True)
                    return 3
            time.sleep(0.5)
        print(f"  hold: done after {secs}s at {time.strftime('%H:%M:%S')}, {errors} failed work steps", flush=True)
    elif mode == "fault":
        ptx = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad.ptx"), "rb").read() + b"\0"
        mod, fn = C.c_void_p(), C.c_void_p()
        if step("cuModuleLoadData(bad.ptx)", cu.cuModuleLoadData(C.byref(mod), C.c_char_p(ptx))):
            return 2
        if step("cuModuleGetFunction(bad)", cu.cuModuleGetFunction(C.byref(fn), mod, b"bad")):
            return 2
        addr = C.c_uint64(0x10)  # an unmapped address: an MMU fault (Xid 31), an application error
        params = (C.c_void_p * 1)(C.cast(C.pointer(addr), C.c_void_p))
        step("cuLaunchKernel(bad, write to 0x10)", cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None))
        print(f"  RESULT fault client cuCtxSynchronize: {err(cu.cuCtxSynchronize())}", flush=True)
        print(f"  after: cuCtxSynchronize again: {err(cu.cuCtxSynchronize())}", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PYEOF
cat >"$BASE/bad.ptx" <<'PTXEOF'
.version 8.0
.target sm_90
.address_size 64

.visible .entry bad(.param .u64 p)
{
	.reg .b64 %rd<2>;
	.reg .b32 %r<2>;
	ld.param.u64 %rd1, [p];
	mov.u32 %r1, 42;
	st.global.u32 [%rd1], %r1;
	ret;
}
PTXEOF
chmod 644 "$BASE/client.py" "$BASE/bad.ptx"
CL="$PY $BASE/client.py"

say "Q0 the machine before"
date -u; id; uname -r
timeout 20 nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv
UUID=$(timeout 20 nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "-- compute mode before:"; mode
echo "-- compute apps before:"; apps
PRE_MPS=$(pgrep -x nvidia-cuda-mps | tr '\n' ' ')
echo "MPS processes before (pgrep -x nvidia-cuda-mps): [$PRE_MPS]"
echo "python3: $PY ($($PY --version 2>&1)); client: CUDA driver API via ctypes"
MPSC=$(command -v nvidia-cuda-mps-control); echo "nvidia-cuda-mps-control: $MPSC"; ls -l "$MPSC" "$(dirname "$MPSC")"/nvidia-cuda-mps-server 2>&1

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
