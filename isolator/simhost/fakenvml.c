/*
 * fakenvml.c: a stand-in libnvidia-ml.so.1 for the simulated GPU host.
 *
 * It exports the NVML entry points the sidecar calls, with the real signatures and struct layouts
 * (nvml.h as mirrored by nvidia-ml-py's pynvml.py), so the real pynvml code path runs unchanged.
 * It owns no policy: every value comes from a state file written by isolator/simhost/host.py.
 *
 * Where the state is: $FAKENVML_STATE if set, else "fakenvml.state" next to this library (found
 * with dladdr), so every copy of the library serves its own host. The state is read at nvmlInit.
 *
 * Runtime control (re-read on every call, so a test can change it while a daemon runs), in the
 * directory named by the state's "control" line:
 *   fail    lines "<index|*> <call|*> <nvml-return-code>": calls whose device (or index) is that
 *           GPU fail with that code. For a MIG handle the parent GPU's index counts.
 *   events  appended lines "<index> <xid> [<gi> <ci> [xid|sbe|dbe]]": XID critical-error (or
 *           single/double-bit ECC) events, delivered by nvmlEventSetWait_v2 to event sets created
 *           before the line was written.
 *   absent  lines "<index>": GPUs unbound from the driver. NVML no longer enumerates them (the
 *           others are renumbered, as NVML does) and calls on their old handles fail GPU_IS_LOST.
 *   usage   lines "<index> <memory-used-bytes> <gpu-util-%> <memory-util-%>".
 *   processes  lines "<index> <pid> <used-bytes> <kind> [<sm-%> <memory-%> [<gi> <ci>]]": processes
 *           running on a GPU; kind compute, graphics, mps-server or mps (an MPS client). Their memory
 *           adds to memory used (of the MIG device <gi>/<ci> too, when given; -1: none). The compute
 *           list (nvmlDeviceGetComputeRunningProcesses) holds compute and mps-server processes, each
 *           server charged its own memory plus its clients' (same GPU, same MIG device), as the real
 *           NVML charges MPS clients to the server; nvmlDeviceGetMPSComputeRunningProcesses lists the
 *           clients with their own memory. A process with <sm-%> (not -1) has a sample for
 *           nvmlDeviceGetProcessUtilization; none at all: NOT_FOUND, as NVML answers with no sample.
 *   settings   lines "<index> <compute-mode> <app-graphics-MHz> <app-memory-MHz>": what a
 *           container (or the sidecar, through the setters here) changed; absent: the defaults
 *           (compute mode DEFAULT, DEFAULT_APP_GRAPHICS_MHZ / DEFAULT_APP_MEMORY_MHZ). The setters
 *           rewrite this file (atomically), so the test that reads it sees what the sidecar did.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* nvmlReturn_t values (nvml.h). */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_MIG 7
#define MAX_LINKS 36
#define NVML_EVENT_XID 0x8ULL
#define NVML_EVENT_SBE 0x1ULL
#define NVML_EVENT_DBE 0x2ULL
#define NO_INSTANCE 0xFFFFFFFFu
#define MAX_PROCS 64
/* Application clocks a GPU boots with (V100-SXM2's defaults; nvidia-smi -q -d CLOCK "Default Applications Clocks"). */
#define DEFAULT_APP_GRAPHICS_MHZ 1312u
#define DEFAULT_APP_MEMORY_MHZ 877u
/* nvmlComputeMode_t, nvmlClockType_t (nvml.h). */
enum { COMPUTEMODE_DEFAULT = 0, COMPUTEMODE_EXCLUSIVE_THREAD = 1, COMPUTEMODE_PROHIBITED = 2, COMPUTEMODE_EXCLUSIVE_PROCESS = 3 };
enum { CLOCK_GRAPHICS = 0, CLOCK_SM = 1, CLOCK_MEM = 2, CLOCK_VIDEO = 3 };

/* Struct layouts exactly as nvml.h (and pynvml's ctypes mirrors). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* nvmlProcessInfo_v1_t: what the unversioned nvmlDevice*RunningProcesses fill. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvmlProcessInfo_v2_t, which nvml.h also names nvmlProcessInfo_t for the _v2 and _v3 calls
 * (pynvml's c_nvmlProcessInfo_v3_t is the same layout: 24 bytes, usedGpuMemory at offset 8). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

/* nvmlProcessUtilizationSample_t: what nvmlDeviceGetProcessUtilization fills (timeStamp in µs). */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

struct device;
typedef struct device *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct link {
    int present;
    int active;
    int remote_type; /* 0 GPU, 2 switch (nvmlIntNvLinkDeviceType_t) */
    char remote_bus[32];
};

struct device {
    int index;  /* for a MIG handle: the parent's index */
    int is_mig;
    int mig_slot;
    struct device *parent;
    unsigned int minor;
    int numa;
    unsigned long long memory_total;
    unsigned int pci_device_id;
    unsigned int mig_mode;
    unsigned int gi, ci;
    unsigned int gi_slices, ci_slices, gi_profile; /* MIG handle: nvmlDeviceGetAttributes, GI profile */
    unsigned int pstart, psize;                    /* MIG handle: its GPU instance's placement */
    char uuid[96];
    char bus_id[32];
    char name[96];
    unsigned long long affinity[64];
    int affinity_words;
    int nlinks;
    struct link links[MAX_LINKS];
    int nmig;
    struct device *mig[MAX_MIG];
};

struct state {
    char driver[80];
    char nvml[80];
    int cuda;
    char control[PATH_MAX];
    int ngpus;
    struct device gpus[MAX_GPUS];
    int topo[MAX_GPUS][MAX_GPUS];
};

struct event_set {
    long cursor; /* byte offset in the events file already consumed */
    unsigned long long mask[MAX_GPUS];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
/* Never freed: handles given out before a shutdown must stay valid memory if used by mistake. */
static struct state *st;

static void state_path(char *out, size_t size) {
    const char *env = getenv("FAKENVML_STATE");
    if (env && *env) {
        snprintf(out, size, "%s", env);
        return;
    }
    Dl_info info;
    if (dladdr((void *)&state_path, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            snprintf(out, size, "%.*s/fakenvml.state", (int)(slash - info.dli_fname), info.dli_fname);
            return;
        }
    }
    snprintf(out, size, "fakenvml.state");
}

static void chomp(char *s) {
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r')) s[--n] = 0;
}

static int parse_affinity(const char *csv, unsigned long long *words) {
    int n = 0;
    const char *p = csv;
    while (*p && n < 64) {
        char *end;
        words[n++] = strtoull(p, &end, 16);
        if (*end != ',') break;
        p = end + 1;
    }
    return n;
}

static int load_state(struct state *s) {
    char path[PATH_MAX];
    state_path(path, sizeof path);
    FILE *fh = fopen(path, "r");
    if (!fh) return NVML_ERROR_DRIVER_NOT_LOADED;
    char line[4096];
    int ok = 0;
    while (fgets(line, sizeof line, fh)) {
        chomp(line);
        int n = 0;
        if (strncmp(line, "fakenvml 1", 10) == 0) {
            ok = 1;
        } else if (sscanf(line, "driver %79s", s->driver) == 1) {
        } else if (sscanf(line, "nvml %79s", s->nvml) == 1) {
        } else if (sscanf(line, "cuda %d", &s->cuda) == 1) {
        } else if (strncmp(line, "control ", 8) == 0) {
            snprintf(s->control, sizeof s->control, "%s", line + 8);
        } else if (strncmp(line, "gpu ", 4) == 0) {
            int idx;
            unsigned int minor, devid, mig;
            int numa;
            unsigned long long mem;
            char uuid[96], bus[32], aff[1200];
            if (sscanf(line, "gpu %d %u %d %llu %x %u %95s %31s %1199s %n", &idx, &minor, &numa, &mem, &devid, &mig,
                       uuid, bus, aff, &n) < 9 || idx < 0 || idx >= MAX_GPUS) {
                fclose(fh);
                return NVML_ERROR_UNKNOWN;
            }
            struct device *d = &s->gpus[idx];
            d->index = idx;
            d->minor = minor;
            d->numa = numa;
            d->memory_total = mem;
            d->pci_device_id = devid;
            d->mig_mode = mig;
            snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
            snprintf(d->bus_id, sizeof d->bus_id, "%s", bus);
            snprintf(d->name, sizeof d->name, "%s", line + n);
            d->affinity_words = parse_affinity(aff, d->affinity);
            if (idx + 1 > s->ngpus) s->ngpus = idx + 1;
        } else if (strncmp(line, "topo ", 5) == 0) {
            int a, b, level;
            if (sscanf(line, "topo %d %d %d", &a, &b, &level) == 3 && a >= 0 && b >= 0 && a < MAX_GPUS &&
                b < MAX_GPUS) {
                s->topo[a][b] = level;
                s->topo[b][a] = level;
            }
        } else if (strncmp(line, "nvlink ", 7) == 0) {
            int idx, link, type, active;
            char bus[32];
            if (sscanf(line, "nvlink %d %d %d %d %31s", &idx, &link, &active, &type, bus) == 5 && idx >= 0 &&
                idx < MAX_GPUS && link >= 0 && link < MAX_LINKS) {
                struct link *l = &s->gpus[idx].links[link];
                l->present = 1;
                l->active = active;
                l->remote_type = type;
                snprintf(l->remote_bus, sizeof l->remote_bus, "%s", bus);
                if (link + 1 > s->gpus[idx].nlinks) s->gpus[idx].nlinks = link + 1;
            }
        } else if (strncmp(line, "mig ", 4) == 0) {
            int idx, slot;
            unsigned int gi, ci;
            unsigned long long mem;
            char uuid[96];
            unsigned int gis, cis, prof, pstart, psize;
            if (sscanf(line, "mig %d %d %u %u %llu %u %u %u %u %u %95s %n", &idx, &slot, &gi, &ci, &mem, &gis, &cis,
                       &prof, &pstart, &psize, uuid, &n) < 11 ||
                idx < 0 || idx >= MAX_GPUS || slot < 0 || slot >= MAX_MIG) {
                fclose(fh);
                return NVML_ERROR_UNKNOWN;
            }
            struct device *parent = &s->gpus[idx];
            struct device *m = calloc(1, sizeof *m);
            if (!m) {
                fclose(fh);
                return NVML_ERROR_UNKNOWN;
            }
            m->index = idx;
            m->is_mig = 1;
            m->mig_slot = slot;
            m->parent = parent;
            m->minor = parent->minor;
            m->numa = parent->numa;
            m->memory_total = mem;
            m->pci_device_id = parent->pci_device_id;
            m->gi = gi;
            m->ci = ci;
            m->gi_slices = gis;
            m->ci_slices = cis;
            m->gi_profile = prof;
            m->pstart = pstart;
            m->psize = psize;
            snprintf(m->uuid, sizeof m->uuid, "%s", uuid);
            snprintf(m->bus_id, sizeof m->bus_id, "%s", parent->bus_id);
            snprintf(m->name, sizeof m->name, "%s", line + n);
            parent->mig[slot] = m;
            if (slot + 1 > parent->nmig) parent->nmig = slot + 1;
        }
    }
    fclose(fh);
    return ok ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

/* ---- runtime control ------------------------------------------------------------------------ */

static FILE *control_file(const char *name) {
    char path[PATH_MAX + 16];
    if (!st || !st->control[0]) return NULL;
    snprintf(path, sizeof path, "%s/%s", st->control, name);
    return fopen(path, "r");
}

/* The injected failure for `call` on GPU `index` (-1: a call not about one GPU), or success. */
static int injected(int index, const char *call) {
    FILE *fh = control_file("fail");
    if (!fh) return NVML_SUCCESS;
    char line[256], who[32], what[128];
    int code, rc = NVML_SUCCESS;
    while (fgets(line, sizeof line, fh)) {
        if (sscanf(line, "%31s %127s %d", who, what, &code) != 3) continue;
        int any = strcmp(who, "*") == 0;
        if (!any && (index < 0 || atoi(who) != index)) continue;
        if (strcmp(what, "*") != 0 && strcmp(what, call) != 0) continue;
        rc = code;
        break;
    }
    fclose(fh);
    return rc;
}

static int usage_of(int index, unsigned long long *used, unsigned int *gpu, unsigned int *mem) {
    *used = 0;
    *gpu = 0;
    *mem = 0;
    FILE *fh = control_file("usage");
    if (!fh) return 0;
    char line[256];
    int idx;
    unsigned long long u;
    unsigned int g, m;
    while (fgets(line, sizeof line, fh)) {
        if (sscanf(line, "%d %llu %u %u", &idx, &u, &g, &m) == 4 && idx == index) {
            *used = u;
            *gpu = g;
            *mem = m;
        }
    }
    fclose(fh);
    return 1;
}

/* 1 when GPU `index` (the host file's index) is listed in control/absent. */
static int is_absent(int index) {
    FILE *fh = control_file("absent");
    if (!fh) return 0;
    char line[64];
    int found = 0;
    while (!found && fgets(line, sizeof line, fh)) {
        int idx;
        if (sscanf(line, "%d", &idx) == 1 && idx == index) found = 1;
    }
    fclose(fh);
    return found;
}

/* One line of control/processes. */
struct proc {
    unsigned int pid;
    unsigned long long used;
    char kind[16];
    int sm, mem; /* utilisation percentages; -1: no sample */
    int gi, ci;  /* the MIG device it runs on; -1: none (the whole GPU) */
};

/* The processes on GPU `index` (every MIG device's too): up to `max` of them into `out`; returns
 * how many were kept. Malformed lines are skipped. */
static int processes_of(int index, struct proc *out, int max) {
    FILE *fh = control_file("processes");
    if (!fh) return 0;
    char line[256];
    int idx, n = 0;
    while (n < max && fgets(line, sizeof line, fh)) {
        struct proc p = {0, 0, "", -1, -1, -1, -1};
        int got = sscanf(line, "%d %u %llu %15s %d %d %d %d", &idx, &p.pid, &p.used, p.kind, &p.sm, &p.mem, &p.gi,
                         &p.ci);
        if (got < 4 || idx != index) continue;
        if (got < 6) p.sm = p.mem = -1;
        if (got < 8) p.gi = p.ci = -1;
        out[n++] = p;
    }
    fclose(fh);
    return n;
}

/* The process `p` runs on `device`: any process of the GPU for a whole GPU's handle, only those of
 * its GPU instance and compute instance for a MIG handle. */
static int runs_on(nvmlDevice_t device, const struct proc *p) {
    if (!device->is_mig) return 1;
    return p->gi >= 0 && (unsigned int)p->gi == device->gi && (unsigned int)p->ci == device->ci;
}

/* The memory processes use on `device` (each byte once: a server's own, each client's own). */
static unsigned long long process_memory(nvmlDevice_t device) {
    struct proc procs[MAX_PROCS];
    unsigned long long total = 0;
    int n = processes_of(device->index, procs, MAX_PROCS);
    for (int i = 0; i < n; i++)
        if (runs_on(device, &procs[i])) total += procs[i].used;
    return total;
}

/* What GPU `index` runs with now: compute mode and application clocks (control/settings). */
struct settings {
    unsigned int compute_mode, graphics, memory;
};

static struct settings settings_of(int index) {
    struct settings out = {COMPUTEMODE_DEFAULT, DEFAULT_APP_GRAPHICS_MHZ, DEFAULT_APP_MEMORY_MHZ};
    FILE *fh = control_file("settings");
    if (!fh) return out;
    char line[256];
    int idx;
    unsigned int mode, g, m;
    while (fgets(line, sizeof line, fh)) {
        if (sscanf(line, "%d %u %u %u", &idx, &mode, &g, &m) == 4 && idx == index) {
            out.compute_mode = mode;
            out.graphics = g;
            out.memory = m;
        }
    }
    fclose(fh);
    return out;
}

/* Replace GPU `index`'s line in control/settings (tmp file + rename: a reader never sees half). */
static int store_settings(int index, struct settings value) {
    char path[PATH_MAX + 16], tmp[PATH_MAX + 32];
    if (!st || !st->control[0]) return NVML_ERROR_UNKNOWN;
    snprintf(path, sizeof path, "%s/settings", st->control);
    snprintf(tmp, sizeof tmp, "%s/.settings.%d", st->control, (int)getpid());
    pthread_mutex_lock(&lock);
    FILE *out = fopen(tmp, "w");
    if (!out) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNKNOWN;
    }
    FILE *in = fopen(path, "r");
    if (in) {
        char line[256];
        int idx;
        while (fgets(line, sizeof line, in)) {
            if (sscanf(line, "%d", &idx) == 1 && idx == index) continue;
            fputs(line, out);
        }
        fclose(in);
    }
    fprintf(out, "%d %u %u %u\n", index, value.compute_mode, value.graphics, value.memory);
    int rc = fclose(out) == 0 && rename(tmp, path) == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    pthread_mutex_unlock(&lock);
    return rc;
}

/* The host index of the `visible`-th GPU NVML enumerates, or -1. */
static int host_index(unsigned int visible) {
    unsigned int seen = 0;
    for (int i = 0; i < st->ngpus; i++) {
        if (is_absent(i)) continue;
        if (seen++ == visible) return i;
    }
    return -1;
}

/* ---- helpers -------------------------------------------------------------------------------- */

#define REQUIRE_INIT()                                  \
    do {                                                \
        if (!st || refcount == 0) return NVML_ERROR_UNINITIALIZED; \
    } while (0)

static int valid_device(nvmlDevice_t d) {
    if (!d || !st) return 0;
    for (int i = 0; i < st->ngpus; i++) {
        struct device *g = &st->gpus[i];
        if (d == g) return 1;
        for (int j = 0; j < g->nmig; j++)
            if (g->mig[j] == d) return 1;
    }
    return 0;
}

#define DEVICE_CALL(dev, call)                                   \
    do {                                                         \
        REQUIRE_INIT();                                          \
        if (!valid_device(dev)) return NVML_ERROR_INVALID_ARGUMENT; \
        if (is_absent((dev)->index)) return NVML_ERROR_GPU_IS_LOST; \
        int _rc = injected((dev)->index, call);                  \
        if (_rc != NVML_SUCCESS) return _rc;                     \
    } while (0)

static int copy_string(char *out, unsigned int size, const char *value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > size) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* ---- system ---------------------------------------------------------------------------------- */

EXPORT int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    int rc = NVML_SUCCESS;
    if (refcount == 0) {
        struct state *s = calloc(1, sizeof *s);
        if (!s) {
            rc = NVML_ERROR_UNKNOWN;
        } else if ((rc = load_state(s)) != NVML_SUCCESS) {
            free(s);
        } else {
            st = s;
        }
    }
    if (rc == NVML_SUCCESS) {
        rc = injected(-1, "nvmlInit");
        if (rc == NVML_SUCCESS) refcount++;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT int nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT int nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    int rc = refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount > 0) refcount--;
    pthread_mutex_unlock(&lock);
    return rc;
}

EXPORT const char *nvmlErrorString(int result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

EXPORT int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    REQUIRE_INIT();
    int rc = injected(-1, "nvmlSystemGetDriverVersion");
    return rc ? rc : copy_string(version, length, st->driver);
}

EXPORT int nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    REQUIRE_INIT();
    return copy_string(version, length, st->nvml);
}

EXPORT int nvmlSystemGetCudaDriverVersion(int *version) {
    REQUIRE_INIT();
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(-1, "nvmlSystemGetCudaDriverVersion");
    if (rc) return rc;
    *version = st->cuda;
    return NVML_SUCCESS;
}

EXPORT int nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

EXPORT int nvmlDeviceGetCount_v2(unsigned int *count) {
    REQUIRE_INIT();
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(-1, "nvmlDeviceGetCount");
    if (rc) return rc;
    unsigned int n = 0;
    for (int i = 0; i < st->ngpus; i++) n += !is_absent(i);
    *count = n;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    REQUIRE_INIT();
    int host = device ? host_index(index) : -1;
    if (host < 0) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(host, "nvmlDeviceGetHandleByIndex");
    if (rc) return rc;
    *device = &st->gpus[host];
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    REQUIRE_INIT();
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < st->ngpus; i++) {
        struct device *g = &st->gpus[i];
        if (is_absent(i)) continue;
        if (strcmp(g->uuid, uuid) == 0) {
            int rc = injected(i, "nvmlDeviceGetHandleByUUID");
            if (rc) return rc;
            *device = g;
            return NVML_SUCCESS;
        }
        for (int j = 0; j < g->nmig; j++) {
            if (g->mig[j] && strcmp(g->mig[j]->uuid, uuid) == 0) {
                *device = g->mig[j];
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* ---- device identity ------------------------------------------------------------------------- */

EXPORT int nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_CALL(device, "nvmlDeviceGetIndex");
    if (!index || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int visible = 0;
    for (int i = 0; i < device->index; i++) visible += !is_absent(i);
    *index = visible;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    DEVICE_CALL(device, "nvmlDeviceGetMinorNumber");
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *minor = device->minor;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(device, "nvmlDeviceGetUUID");
    return copy_string(uuid, length, device->uuid);
}

EXPORT int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(device, "nvmlDeviceGetName");
    return copy_string(name, length, device->name);
}

EXPORT int nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_CALL(device, "nvmlDeviceGetPciInfo");
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(device->bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = device->pci_device_id;
    pci->pciSubSystemId = 0x124910DE;
    snprintf(pci->busId, sizeof pci->busId, "%s", device->bus_id);
    /* The legacy field holds the short form: 4-digit domain (nvml.h NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT). */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, dev, fn);
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

/* ---- memory, utilisation --------------------------------------------------------------------- */

EXPORT int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_CALL(device, "nvmlDeviceGetMemoryInfo");
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long used;
    unsigned int gpu, mem;
    usage_of(device->is_mig ? -1 : device->index, &used, &gpu, &mem);
    used += process_memory(device);
    if (used > device->memory_total) used = device->memory_total;
    memory->total = device->memory_total;
    memory->used = used;
    memory->free = device->memory_total - used;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlMemory_t m;
    int rc = nvmlDeviceGetMemoryInfo(device, &m);
    if (rc) return rc;
    memory->total = m.total;
    memory->reserved = 0;
    memory->free = m.free;
    memory->used = m.used;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    DEVICE_CALL(device, "nvmlDeviceGetUtilizationRates");
    if (!util) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED; /* as on real MIG devices */
    unsigned long long used;
    usage_of(device->index, &used, &util->gpu, &util->memory);
    return NVML_SUCCESS;
}

/* ---- NUMA and topology ----------------------------------------------------------------------- */

EXPORT int nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    DEVICE_CALL(device, "nvmlDeviceGetNumaNodeId");
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->numa < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)device->numa;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet) {
    DEVICE_CALL(device, "nvmlDeviceGetCpuAffinity");
    if (!cpuSet || cpuSetSize == 0) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < cpuSetSize; i++)
        cpuSet[i] = i < (unsigned int)device->affinity_words ? (unsigned long)device->affinity[i] : 0;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *level) {
    DEVICE_CALL(a, "nvmlDeviceGetTopologyCommonAncestor");
    if (!valid_device(b) || !level || a->is_mig || b->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(b->index, "nvmlDeviceGetTopologyCommonAncestor");
    if (rc) return rc;
    *level = a == b ? 0 : st->topo[a->index][b->index];
    return NVML_SUCCESS;
}

static int nvlink_of(nvmlDevice_t device, unsigned int link, const char *call, struct link **out) {
    DEVICE_CALL(device, call);
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    if (device->nlinks == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= MAX_LINKS || !device->links[link].present) return NVML_ERROR_INVALID_ARGUMENT;
    *out = &device->links[link];
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *active) {
    struct link *l;
    int rc = nvlink_of(device, link, "nvmlDeviceGetNvLinkState", &l);
    if (rc) return rc;
    if (!active) return NVML_ERROR_INVALID_ARGUMENT;
    *active = (unsigned int)l->active;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    struct link *l;
    int rc = nvlink_of(device, link, "nvmlDeviceGetNvLinkRemotePciInfo", &l);
    if (rc) return rc;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(l->remote_bus, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    snprintf(pci->busId, sizeof pci->busId, "%s", l->remote_bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, dev, fn);
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, int *type) {
    struct link *l;
    int rc = nvlink_of(device, link, "nvmlDeviceGetNvLinkRemoteDeviceType", &l);
    if (rc) return rc;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    *type = l->remote_type;
    return NVML_SUCCESS;
}

/* ---- running processes, compute mode, application clocks ---------------------------------- */

/* The list `call` reports: "compute" (compute processes and MPS servers, each server charged its
 * clients' memory), "graphics" or "mps" (MPS clients, each its own memory).
 * nvml.h's contract: with too small a buffer (or none), *count is set to the number needed and
 * INSUFFICIENT_SIZE returned, unless there are none (SUCCESS, *count 0). */
static int running_processes(nvmlDevice_t device, const char *list, const char *call, unsigned int *count, void *infos,
                             int version) {
    DEVICE_CALL(device, call);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    struct proc procs[MAX_PROCS], found[MAX_PROCS];
    int all = processes_of(device->index, procs, MAX_PROCS), n = 0;
    for (int i = 0; i < all; i++) {
        struct proc p = procs[i];
        if (!runs_on(device, &p)) continue;
        if (strcmp(list, "compute") == 0 && strcmp(p.kind, "mps-server") == 0) {
            for (int j = 0; j < all; j++)
                if (strcmp(procs[j].kind, "mps") == 0 && procs[j].gi == p.gi && procs[j].ci == p.ci)
                    p.used += procs[j].used;
        } else if (strcmp(list, p.kind) != 0) {
            continue;
        }
        found[n++] = p;
    }
    if (!infos || *count < (unsigned int)n) {
        int need = n > 0;
        *count = (unsigned int)n;
        return need ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (int i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = found[i].pid;
            p->usedGpuMemory = found[i].used;
        } else {
            nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
            p->pid = found[i].pid;
            p->usedGpuMemory = found[i].used;
            p->gpuInstanceId = found[i].gi >= 0 ? (unsigned int)found[i].gi : NO_INSTANCE;
            p->computeInstanceId = found[i].ci >= 0 ? (unsigned int)found[i].ci : NO_INSTANCE;
        }
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "compute", "nvmlDeviceGetComputeRunningProcesses", count, infos, 3);
}

EXPORT int nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "compute", "nvmlDeviceGetComputeRunningProcesses", count, infos, 2);
}

EXPORT int nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, "compute", "nvmlDeviceGetComputeRunningProcesses", count, infos, 1);
}

EXPORT int nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "graphics", "nvmlDeviceGetGraphicsRunningProcesses", count, infos, 3);
}

EXPORT int nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "graphics", "nvmlDeviceGetGraphicsRunningProcesses", count, infos, 2);
}

EXPORT int nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, "graphics", "nvmlDeviceGetGraphicsRunningProcesses", count, infos, 1);
}

EXPORT int nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "mps", "nvmlDeviceGetMPSComputeRunningProcesses", count, infos, 3);
}

EXPORT int nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, "mps", "nvmlDeviceGetMPSComputeRunningProcesses", count, infos, 2);
}

EXPORT int nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, "mps", "nvmlDeviceGetMPSComputeRunningProcesses", count, infos, 1);
}

/* Per-process SM and memory utilisation since `lastSeen` (µs): one sample per process that has one.
 * Not on MIG devices nor on a GPU in MIG mode (NOT_SUPPORTED, as NVML); no sample: NOT_FOUND. */
EXPORT int nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                           unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp) {
    DEVICE_CALL(device, "nvmlDeviceGetProcessUtilization");
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->is_mig || device->mig_mode == 1) return NVML_ERROR_NOT_SUPPORTED;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long stamp = (unsigned long long)now.tv_sec * 1000000ULL + (unsigned long long)now.tv_nsec / 1000ULL;
    if (stamp <= lastSeenTimeStamp) return NVML_ERROR_NOT_FOUND;
    struct proc procs[MAX_PROCS];
    int all = processes_of(device->index, procs, MAX_PROCS);
    unsigned int n = 0;
    for (int i = 0; i < all; i++) {
        if (procs[i].sm < 0) continue;
        if (utilization && n < *processSamplesCount) {
            nvmlProcessUtilizationSample_t *u = utilization + n;
            u->pid = procs[i].pid;
            u->timeStamp = stamp;
            u->smUtil = (unsigned int)procs[i].sm;
            u->memUtil = (unsigned int)procs[i].mem;
            u->encUtil = 0;
            u->decUtil = 0;
        }
        n++;
    }
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (!utilization || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetComputeMode(nvmlDevice_t device, unsigned int *mode) {
    DEVICE_CALL(device, "nvmlDeviceGetComputeMode");
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *mode = settings_of(device->index).compute_mode;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceSetComputeMode(nvmlDevice_t device, unsigned int mode) {
    DEVICE_CALL(device, "nvmlDeviceSetComputeMode");
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    if (mode == COMPUTEMODE_EXCLUSIVE_THREAD) return NVML_ERROR_NOT_SUPPORTED; /* removed since CUDA 8 */
    if (mode != COMPUTEMODE_DEFAULT && mode != COMPUTEMODE_PROHIBITED && mode != COMPUTEMODE_EXCLUSIVE_PROCESS)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct settings now = settings_of(device->index);
    now.compute_mode = mode;
    return store_settings(device->index, now);
}

static int app_clock(nvmlDevice_t device, unsigned int type, unsigned int *mhz, int defaults, const char *call) {
    DEVICE_CALL(device, call);
    if (!mhz) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    struct settings now = settings_of(device->index);
    unsigned int graphics = defaults ? DEFAULT_APP_GRAPHICS_MHZ : now.graphics;
    unsigned int memory = defaults ? DEFAULT_APP_MEMORY_MHZ : now.memory;
    switch (type) {
    case CLOCK_GRAPHICS:
    case CLOCK_SM: *mhz = graphics; return NVML_SUCCESS;
    case CLOCK_MEM: *mhz = memory; return NVML_SUCCESS;
    case CLOCK_VIDEO: return NVML_ERROR_NOT_SUPPORTED;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
}

EXPORT int nvmlDeviceGetApplicationsClock(nvmlDevice_t device, unsigned int type, unsigned int *mhz) {
    return app_clock(device, type, mhz, 0, "nvmlDeviceGetApplicationsClock");
}

EXPORT int nvmlDeviceGetDefaultApplicationsClock(nvmlDevice_t device, unsigned int type, unsigned int *mhz) {
    return app_clock(device, type, mhz, 1, "nvmlDeviceGetDefaultApplicationsClock");
}

EXPORT int nvmlDeviceSetApplicationsClocks(nvmlDevice_t device, unsigned int memory, unsigned int graphics) {
    DEVICE_CALL(device, "nvmlDeviceSetApplicationsClocks");
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    if (memory == 0 || graphics == 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct settings now = settings_of(device->index);
    now.graphics = graphics;
    now.memory = memory;
    return store_settings(device->index, now);
}

EXPORT int nvmlDeviceResetApplicationsClocks(nvmlDevice_t device) {
    DEVICE_CALL(device, "nvmlDeviceResetApplicationsClocks");
    if (device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    struct settings now = settings_of(device->index);
    now.graphics = DEFAULT_APP_GRAPHICS_MHZ;
    now.memory = DEFAULT_APP_MEMORY_MHZ;
    return store_settings(device->index, now);
}

/* ---- MIG ------------------------------------------------------------------------------------- */

EXPORT int nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    DEVICE_CALL(device, "nvmlDeviceGetMigMode");
    if (!current || !pending || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig_mode == 2) return NVML_ERROR_NOT_SUPPORTED; /* 2 in the state: not MIG-capable */
    *current = *pending = device->mig_mode;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEVICE_CALL(device, "nvmlDeviceGetMaxMigDeviceCount");
    if (!count || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig_mode == 2) return NVML_ERROR_NOT_SUPPORTED;
    *count = device->mig_mode == 1 ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    DEVICE_CALL(device, "nvmlDeviceGetMigDeviceHandleByIndex");
    if (!mig || device->is_mig || index >= MAX_MIG) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig_mode != 1) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= (unsigned int)device->nmig || !device->mig[index]) return NVML_ERROR_NOT_FOUND;
    *mig = device->mig[index];
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device) {
    DEVICE_CALL(mig, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    if (!device || !mig->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *device = mig->parent;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig) {
    DEVICE_CALL(device, "nvmlDeviceIsMigDeviceHandle");
    if (!is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = (unsigned int)device->is_mig;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEVICE_CALL(device, "nvmlDeviceGetGpuInstanceId");
    if (!id || !device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->gi;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    DEVICE_CALL(device, "nvmlDeviceGetComputeInstanceId");
    if (!id || !device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *id = device->ci;
    return NVML_SUCCESS;
}

/* nvmlDeviceAttributes_t (nvml.h): what a MIG device is made of. */
typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* nvmlGpuInstanceInfo_t (nvml.h); the GPU instance handle is opaque: here, its first MIG device. */
typedef struct {
    struct device *device;
    unsigned int id;
    unsigned int profileId;
    unsigned int start;
    unsigned int size;
} nvmlGpuInstanceInfo_t;

EXPORT int nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attrs) {
    DEVICE_CALL(device, "nvmlDeviceGetAttributes");
    if (!attrs) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    memset(attrs, 0, sizeof *attrs);
    /* A100: 14 SMs per compute slice (1g: 14, 7g: 98). */
    attrs->multiprocessorCount = 14 * device->ci_slices;
    attrs->sharedCopyEngineCount = device->gi_slices;
    attrs->gpuInstanceSliceCount = device->gi_slices;
    attrs->computeInstanceSliceCount = device->ci_slices;
    attrs->memorySizeMB = device->memory_total >> 20;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attrs) {
    return nvmlDeviceGetAttributes_v2(device, attrs);
}

EXPORT int nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, struct device **gi) {
    DEVICE_CALL(device, "nvmlDeviceGetGpuInstanceById");
    if (!gi || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig_mode != 1) return NVML_ERROR_NOT_SUPPORTED;
    for (int j = 0; j < device->nmig; j++) {
        if (device->mig[j] && device->mig[j]->gi == id) {
            *gi = device->mig[j];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT int nvmlGpuInstanceGetInfo(struct device *gi, nvmlGpuInstanceInfo_t *info) {
    REQUIRE_INIT();
    if (!info || !valid_device(gi) || !gi->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(gi->index, "nvmlGpuInstanceGetInfo");
    if (rc) return rc;
    info->device = gi->parent;
    info->id = gi->gi;
    info->profileId = gi->gi_profile;
    info->start = gi->pstart;
    info->size = gi->psize;
    return NVML_SUCCESS;
}

/* ---- events ---------------------------------------------------------------------------------- */

static long events_size(void) {
    char path[PATH_MAX + 16];
    struct stat sb;
    if (!st || !st->control[0]) return 0;
    snprintf(path, sizeof path, "%s/events", st->control);
    return stat(path, &sb) == 0 ? (long)sb.st_size : 0;
}

EXPORT int nvmlEventSetCreate(struct event_set **set) {
    REQUIRE_INIT();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    int rc = injected(-1, "nvmlEventSetCreate");
    if (rc) return rc;
    struct event_set *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_UNKNOWN;
    s->cursor = events_size(); /* events written before the set existed are not delivered */
    *set = s;
    return NVML_SUCCESS;
}

EXPORT int nvmlEventSetFree(struct event_set *set) {
    REQUIRE_INIT();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    DEVICE_CALL(device, "nvmlDeviceGetSupportedEventTypes");
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = NVML_EVENT_XID | NVML_EVENT_SBE | NVML_EVENT_DBE;
    return NVML_SUCCESS;
}

EXPORT int nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, struct event_set *set) {
    DEVICE_CALL(device, "nvmlDeviceRegisterEvents");
    if (!set || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~(NVML_EVENT_XID | NVML_EVENT_SBE | NVML_EVENT_DBE)) return NVML_ERROR_NOT_SUPPORTED;
    set->mask[device->index] |= types;
    return NVML_SUCCESS;
}

/* Take the next complete line of the events file after the set's cursor; 1 when one was found. */
static int next_event(struct event_set *set, nvmlEventData_t *data) {
    FILE *fh = control_file("events");
    if (!fh) return 0;
    int found = 0;
    if (fseek(fh, set->cursor, SEEK_SET) == 0) {
        char line[256];
        while (!found && fgets(line, sizeof line, fh)) {
            size_t len = strlen(line);
            if (len == 0 || line[len - 1] != '\n') break; /* a line still being written */
            set->cursor += (long)len;
            int idx, gi = -1, ci = -1;
            unsigned long long xid;
            char kind[8] = "xid";
            int n = sscanf(line, "%d %llu %d %d %7s", &idx, &xid, &gi, &ci, kind);
            unsigned long long type = strcmp(kind, "dbe") == 0   ? NVML_EVENT_DBE
                                      : strcmp(kind, "sbe") == 0 ? NVML_EVENT_SBE
                                                                 : NVML_EVENT_XID;
            if (n < 2 || idx < 0 || idx >= st->ngpus || !(set->mask[idx] & type) || is_absent(idx)) continue;
            data->device = &st->gpus[idx];
            data->eventType = type;
            data->eventData = type == NVML_EVENT_XID ? xid : 0;
            data->gpuInstanceId = n >= 3 && gi >= 0 ? (unsigned int)gi : NO_INSTANCE;
            data->computeInstanceId = n >= 4 && ci >= 0 ? (unsigned int)ci : NO_INSTANCE;
            found = 1;
        }
    }
    fclose(fh);
    return found;
}

/* A watch on the control directory, made before the first look at its files: a write after that
 * look wakes the waiter at once. -1 where inotify is unavailable (then the waiter polls). */
static int watch_control(void) {
    if (!st || !st->control[0]) return -1;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) return -1;
    if (inotify_add_watch(fd, st->control, IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Until a control file changes (or `ms` pass): the idle sidecar's health thread spends its time
 * here, so it sleeps in the kernel instead of reading the control files 200 times a second. */
static void wait_for_control(int fd, long ms) {
    if (fd < 0 || ms > 100) ms = fd < 0 ? 5 : 100; /* polling where inotify failed; a re-check each 100 ms */
    if (fd < 0) {
        struct timespec nap = {0, ms * 1000 * 1000};
        nanosleep(&nap, NULL);
        return;
    }
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, (int)ms) > 0) {
        char buf[4096];
        while (read(fd, buf, sizeof buf) > 0) {
        }
    }
}

EXPORT int nvmlEventSetWait_v2(struct event_set *set, nvmlEventData_t *data, unsigned int timeoutms) {
    REQUIRE_INIT();
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int fd = watch_control();
    int rc;
    for (;;) {
        rc = injected(-1, "nvmlEventSetWait");
        if (rc) break;
        if (next_event(set, data)) {
            rc = NVML_SUCCESS;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (elapsed >= (long)timeoutms) {
            rc = NVML_ERROR_TIMEOUT;
            break;
        }
        wait_for_control(fd, (long)timeoutms - elapsed);
    }
    if (fd >= 0) close(fd);
    return rc;
}

EXPORT int nvmlEventSetWait(struct event_set *set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
