/* A stand-in libcuda.so.1 for the hard cap tests: its device memory is a shared file of FAKE_CUDA_TOTAL
 * bytes (FAKE_CUDA_MEM), so every process of a test sees the same device and the fake itself runs out.
 *
 * FAKE_CUDA_SIM_MIRROR (a command, run by /bin/sh): what each process holds is also shown on the simulated
 * GPUs the node agent samples, as a real driver shows it to NVML. On its first allocation a process starts
 * that command once with two arguments, its pid and a file "<FAKE_CUDA_MEM>.<pid>" holding its usage (one
 * int64, mapped shared and updated on every allocation and free); the command's standard input is a pipe
 * from the process, so it sees end-of-file when the process ends, killed or not (tests/hardcap/sim_mirror.py).
 * The allocation path never waits on it. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
struct devmem { int64_t total, used; };
static struct devmem *mem;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct { unsigned long long p; long long n; } live[4096];
static unsigned long long next_ptr;
static int64_t *mine;      /* this process's usage, in its mirror file */
static pid_t mirror_owner; /* the process that started the mirror (a forked child starts its own) */

static void mirror(int64_t delta) {
    const char *cmd = getenv("FAKE_CUDA_SIM_MIRROR");
    if (!cmd || !*cmd) return;
    pid_t me = getpid();
    if (mirror_owner != me) {
        int64_t held = mine ? *mine : 0;
        const char *base = getenv("FAKE_CUDA_MEM");
        char path[4096], pid[24];
        snprintf(path, sizeof path, "%s.%d", base ? base : "/tmp/fake-cuda", (int)me);
        snprintf(pid, sizeof pid, "%d", (int)me);
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), p[2];
        if (fd < 0 || ftruncate(fd, sizeof *mine)) { if (fd >= 0) close(fd); return; }
        int64_t *m = mmap(NULL, sizeof *mine, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (m == MAP_FAILED || pipe2(p, O_CLOEXEC)) return;
        *m = held;
        pid_t child = fork();
        if (child == 0) {
            dup2(p[0], 0);
            execl("/bin/sh", "sh", "-c", "eval exec \"$FAKE_CUDA_SIM_MIRROR\" '\"$0\"' '\"$1\"'", pid, path, (char *)NULL);
            _exit(127);
        }
        close(p[0]);
        if (child < 0) { close(p[1]); munmap(m, sizeof *mine); return; }
        mine = m;  /* p[1] stays open, unused, until this process ends: then the mirror sees end-of-file */
        mirror_owner = me;
    }
    __atomic_fetch_add(mine, delta, __ATOMIC_SEQ_CST);
}

static struct devmem *device(void) {
    if (mem) return mem;
    const char *path = getenv("FAKE_CUDA_MEM");
    int fd = open(path ? path : "/dev/null", O_RDWR | O_CREAT, 0666);
    if (fd < 0 || ftruncate(fd, sizeof *mem)) return NULL;
    mem = mmap(NULL, sizeof *mem, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mem == MAP_FAILED) { mem = NULL; return NULL; }
    if (!mem->total) mem->total = atoll(getenv("FAKE_CUDA_TOTAL") ? getenv("FAKE_CUDA_TOTAL") : "1073741824");
    return mem;
}

/* What a plain driver-API program calls before it allocates (the CUDA samples' order: cuInit,
 * cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceTotalMem, cuCtxCreate, ... cuCtxDestroy), on one
 * device: 0 until cuInit, CUDA_ERROR_INVALID_DEVICE (101) for another ordinal, a context handle per
 * created context, the current one per thread. Allocations need no context here (the shim's own tests
 * allocate without one), and cuCtxGetDevice answers device 0 without one too. */
static int initialized;
static __thread void *current_ctx;
static int ctx_count;
#define ERR_NOT_INITIALIZED 3
#define ERR_INVALID_VALUE 1
#define ERR_INVALID_DEVICE 101
#define ERR_INVALID_CONTEXT 201

CUresult cuInit(unsigned flags) {
    if (flags) return ERR_INVALID_VALUE;
    if (!device()) return 100;
    __atomic_store_n(&initialized, 1, __ATOMIC_SEQ_CST);
    return 0;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return ERR_INVALID_VALUE; *v = 12090; return 0; }
CUresult cuDeviceGetCount(int *n) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (!n) return ERR_INVALID_VALUE;
    *n = 1;
    return 0;
}
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (!dev) return ERR_INVALID_VALUE;
    if (ordinal != 0) return ERR_INVALID_DEVICE;
    *dev = 0;
    return 0;
}
CUresult cuDeviceGetName(char *name, int len, int dev) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (dev != 0) return ERR_INVALID_DEVICE;
    if (!name || len <= 0) return ERR_INVALID_VALUE;
    snprintf(name, (size_t)len, "Fake CUDA device");
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (dev != 0) return ERR_INVALID_DEVICE;
    if (!bytes) return ERR_INVALID_VALUE;
    *bytes = (size_t)device()->total;
    return 0;
}
CUresult cuCtxCreate_v2(void **ctx, unsigned flags, int dev) {
    (void)flags;
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (dev != 0) return ERR_INVALID_DEVICE;
    if (!ctx) return ERR_INVALID_VALUE;
    *ctx = (void *)(uintptr_t)(0x1000 + __atomic_add_fetch(&ctx_count, 1, __ATOMIC_SEQ_CST));
    current_ctx = *ctx;
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (!initialized) return ERR_NOT_INITIALIZED;
    if (dev != 0) return ERR_INVALID_DEVICE;
    if (!ctx) return ERR_INVALID_VALUE;
    *ctx = (void *)(uintptr_t)0x1000;
    return 0;
}
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { if (!ctx) return ERR_INVALID_VALUE; *ctx = current_ctx; return 0; }
CUresult cuCtxSynchronize(void) { return current_ctx ? 0 : ERR_INVALID_CONTEXT; }
CUresult cuCtxDestroy_v2(void *ctx) {
    if (!ctx) return ERR_INVALID_CONTEXT;
    if (current_ctx == ctx) current_ctx = NULL;
    return 0;
}
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }

/* Internal calls go to these static functions, never to an exported name a preloaded shim interposes
 * (the real driver binds its internal calls the same way). */
static CUresult fake_alloc(unsigned long long *dptr, size_t n) {
    struct devmem *m = device();
    if (!m) return 3;
    /* like the driver, any size past what is free is refused, 2^63 and more included; FAKE_CUDA_REFUSE_SLEEP_US:
     * how long a refusal takes (a real one is not instant either) */
    int64_t cur = __atomic_load_n(&m->used, __ATOMIC_SEQ_CST);
    do {
        if (n > (uint64_t)m->total || cur > m->total - (int64_t)n) {
            const char *rs = getenv("FAKE_CUDA_REFUSE_SLEEP_US");
            if (rs) usleep(atoi(rs));
            return 2;
        }
    } while (!__atomic_compare_exchange_n(&m->used, &cur, cur + (int64_t)n, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    const char *slp = getenv("FAKE_CUDA_ALLOC_SLEEP_MS");
    if (slp) usleep(atoi(slp) * 1000);
    pthread_mutex_lock(&mu);
    if (!next_ptr) next_ptr = ((unsigned long long)getpid() << 32) | 0x1000;
    *dptr = next_ptr;
    next_ptr += (n + 0xfff) & ~0xfffULL;
    if (next_ptr == *dptr) next_ptr += 0x1000;
    for (int i = 0; i < 4096; i++) if (!live[i].p) { live[i].p = *dptr; live[i].n = n; break; }
    mirror((int64_t)n);
    pthread_mutex_unlock(&mu);
    return 0;
}

CUresult cuMemAlloc_v2(unsigned long long *dptr, size_t n) { return fake_alloc(dptr, n); }

CUresult cuMemAllocPitch_v2(unsigned long long *dptr, size_t *pitch, size_t w, size_t h, unsigned e) {
    (void)e;
    size_t bytes;
    if (w > ((size_t)1 << 48) || __builtin_mul_overflow((w + 511) & ~(size_t)511, h, &bytes)) return 2;
    *pitch = (w + 511) & ~(size_t)511;
    return fake_alloc(dptr, bytes);
}

static CUresult fake_free(unsigned long long p) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 4096; i++) if (live[i].p == p) {
        __atomic_fetch_sub(&mem->used, live[i].n, __ATOMIC_SEQ_CST);
        mirror(-live[i].n);
        live[i].p = 0; pthread_mutex_unlock(&mu); return 0;
    }
    pthread_mutex_unlock(&mu);
    return 1;
}

CUresult cuMemFree_v2(unsigned long long p) { return fake_free(p); }
CUresult cuMemAllocAsync(unsigned long long *dptr, size_t n, void *stream) { (void)stream; return fake_alloc(dptr, n); }
CUresult cuMemAllocAsync_ptsz(unsigned long long *dptr, size_t n, void *stream) { (void)stream; return fake_alloc(dptr, n); }
CUresult cuMemFreeAsync(unsigned long long p, void *stream) { (void)stream; return fake_free(p); }
CUresult cuMemFreeAsync_ptsz(unsigned long long p, void *stream) { (void)stream; return fake_free(p); }

/* Virtual memory management: a device-located handle takes device memory (its handle is its address),
 * a host-located one does not (handles from a separate range). */
struct alloc_prop { int type, handle_types; struct { int type, id; } location; };
static unsigned long long next_host_handle = 1ULL << 62;

CUresult cuMemCreate(unsigned long long *h, size_t n, const struct alloc_prop *prop, unsigned long long flags) {
    (void)flags;
    if (!h || !prop || !n) return ERR_INVALID_VALUE;
    if (prop->location.type == 1) return fake_alloc(h, n);
    *h = __atomic_fetch_add(&next_host_handle, 1, __ATOMIC_SEQ_CST);
    return 0;
}

CUresult cuMemRelease(unsigned long long h) { return h >= 1ULL << 62 ? 0 : fake_free(h); }

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    struct devmem *m = device();
    if (!m) return 3;
    *total_b = m->total;
    *free_b = m->total - __atomic_load_n(&m->used, __ATOMIC_SEQ_CST);
    return 0;
}

static const struct { const char *name; void *fn; } table[] = {
    {"cuMemAlloc", (void *)cuMemAlloc_v2}, {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2},
    {"cuMemFree", (void *)cuMemFree_v2}, {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuInit", (void *)cuInit}, {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync}, {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion}, {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGet", (void *)cuDeviceGet}, {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2}, {"cuCtxCreate", (void *)cuCtxCreate_v2},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain}, {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent}, {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuCtxDestroy", (void *)cuCtxDestroy_v2}, {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
};

/* Like the driver: base names, the _v2 entry point for a new enough cudaVersion. */
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    (void)ver;
    if (flags & 2) { /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
        if (!strcmp(sym, "cuMemAllocAsync")) { *pfn = (void *)cuMemAllocAsync_ptsz; return 0; }
        if (!strcmp(sym, "cuMemFreeAsync")) { *pfn = (void *)cuMemFreeAsync_ptsz; return 0; }
    }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(sym, table[i].name)) { *pfn = table[i].fn; if (status) *status = 0; return 0; }
    *pfn = NULL;
    if (status) *status = 1;
    return 500;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
