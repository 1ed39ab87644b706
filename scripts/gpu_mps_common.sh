# Sourced by the MPS probes (scripts/gpu_mps_probe.sh, scripts/gpu_mps_probe2.sh): the private daemon
# directories, the command and client helpers, the cleanup trap that quits only our daemon and kills
# only MPS processes this run made, the ctypes CUDA client (client.py) and the faulting kernel
# (bad.ptx), then the machine's facts before (Q0). Changes no GPU setting.
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

