/* gpushare hard cap shim: caps a shared job's device memory at its share for every process of the job.
 *
 * Loaded with LD_PRELOAD by the TaskProlog into shared jobs. It catches the three ways a program reaches
 * the CUDA driver: the exported cu* symbols (preload order), dlsym on libcuda (wrapped dlsym), and
 * cuGetProcAddress/_v2 (wrapped). In each case the wrapper is handed back only when the driver's own
 * answer is exactly a function we wrap (pointer comparison), so versions and flags we do not know pass.
 *
 * The job comes from the kernel's record (/proc/self/cgroup, the job_<id> component slurmstepd creates),
 * never from SLURM_JOB_ID. The budget comes from a root-owned limits file written by the Prolog:
 *   <dir>/job_<id>/gpu<ordinal>        "limit_bytes context_bytes\n" (root-owned, not group/world-writable)
 * and the job's shared usage lives in <dir>/job_<id>/gpu<ordinal>.state (mmap'd, one atomic counter for
 * all processes, per-process slots so a dead process's charge is swept; registration and sweeps under
 * flock, which the kernel releases when a holder dies). Anything wrong: one line on stderr, shim passive.
 *
 * Charged: cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemAllocAsync (requested size), device-located
 * cuMemCreate, and the limits file's context charge (the Prolog's figure for the GPU's generation) once per
 * process. Not charged: managed, host and imported memory.
 * A size larger than the whole limit (or one whose pitch × height overflows) is refused before anything is
 * charged; charges and refunds are exact under any concurrency (compare-and-swap reservation before the
 * driver is called, refund when it fails; a free's entry taken before the driver frees).
 * cuMemGetInfo_v2 reports the slice (never an error of its own), and so does NVML's memory info for the
 * job's GPUs (matched by UUID). In a capped job, dlsym hands out none of these entry points from a second
 * copy of the driver (another object than libcuda.so.1, e.g. a copy with its SONAME changed, opened by
 * path). See docs/isolation.md for what escapes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_types.h"

#define MAX_DEV 16
#define SLOTS 256
#define MAGIC 0x67707368636170ULL /* "gpshcap" */

#ifndef HARDCAP_DIR
#define HARDCAP_DIR "/run/gpushare/hardcap"
#endif

struct slot { int32_t pid; int32_t pad; int64_t charged; };
struct state { uint64_t magic; int64_t used; struct slot slots[SLOTS]; };

struct dev {
    int tried, active;
    int64_t limit, ctx_charge;
    struct state *st;
    struct slot *mine;
    int fd;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct dev devs[MAX_DEV];
static int logged;
static char job[32];
static int job_tried;

/* ---- real functions ---- */
typedef void *(*dlsym_t)(void *, const char *);
static dlsym_t real_dlsym_fn;
static void *cuda_handle;

static dlsym_t real_dlsym(void) {
    if (!real_dlsym_fn) {
        real_dlsym_fn = (dlsym_t)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!real_dlsym_fn) real_dlsym_fn = (dlsym_t)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5"); /* x86_64 */
        if (!real_dlsym_fn) real_dlsym_fn = (dlsym_t)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");  /* aarch64 */
    }
    return real_dlsym_fn;
}

/* The driver's own entry point. `load`: open the driver if the process has not (a wrapper was called, so
 * the program wants it); without it (dlsym of some cu* name) only a driver already loaded is asked, so a
 * process that never uses the driver never loads it on our account. */
static void *real_from(const char *name, int load) {
    if (!cuda_handle) cuda_handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!cuda_handle && load) cuda_handle = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!cuda_handle) return NULL;
    return real_dlsym()(cuda_handle, name);
}

static void *real(const char *name) { return real_from(name, 1); }

/* NVML's own entry point, from the NVML library the process loaded (a wrapper was called: it has). */
static void *nvml_handle;
static void *real_nvml(const char *name, int load) {
    if (!nvml_handle) nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!nvml_handle && load) nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_LAZY);
    if (!nvml_handle) return NULL;
    return real_dlsym()(nvml_handle, name);
}

#define REAL(T, name) static __typeof__(T) r_##name; if (!r_##name) r_##name = (T)real(#name); if (!r_##name) return CUDA_ERROR_NOT_FOUND

static void say(const char *why) {
    if (__atomic_exchange_n(&logged, 1, __ATOMIC_SEQ_CST)) return;
    fprintf(stderr, "gpushare-hardcap: %s; not capping this process\n", why);
}

static const char *dir(void) {
#ifdef HARDCAP_TESTING
    const char *d = getenv("GPUSHARE_HARDCAP_DIR");
    if (d && *d) return d;
#endif
    return HARDCAP_DIR;
}

static const char *cgroup_file(void) {
#ifdef HARDCAP_TESTING
    const char *c = getenv("GPUSHARE_HARDCAP_CGROUP");
    if (c && *c) return c;
#endif
    return "/proc/self/cgroup";
}

/* job_<digits> from the cgroup path; empty when the process is in no Slurm job cgroup. */
static void find_job(void) {
    if (job_tried) return;
    job_tried = 1;
    char buf[8192];
    int fd = open(cgroup_file(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = 0;
    for (char *p = buf; (p = strstr(p, "/job_")); p++) {
        char *q = p + 5;
        size_t k = 0;
        while (q[k] >= '0' && q[k] <= '9' && k < sizeof job - 1) k++;
        if (k && (q[k] == '/' || q[k] == '\n' || q[k] == 0)) { memcpy(job, q, k); job[k] = 0; return; }
    }
}

static int alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

/* Under flock: give charges of dead processes back, then take a slot for this process. */
static struct slot *do_register(struct dev *d) {
    struct state *st = d->st;
    struct slot *free_slot = NULL;
    int32_t me = getpid();
    for (int i = 0; i < SLOTS; i++) {
        struct slot *s = &st->slots[i];
        int32_t pid = __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST);
        if (pid && pid != me && !alive(pid)) {
            int64_t c = __atomic_exchange_n(&s->charged, 0, __ATOMIC_SEQ_CST);
            __atomic_fetch_sub(&st->used, c, __ATOMIC_SEQ_CST);
            __atomic_store_n(&s->pid, 0, __ATOMIC_SEQ_CST);
            pid = 0;
        }
        if (pid == me) return s;
        if (!pid && !free_slot) free_slot = s;
    }
    if (free_slot) { free_slot->charged = 0; __atomic_store_n(&free_slot->pid, me, __ATOMIC_SEQ_CST); }
    return free_slot;
}

static int charge(struct dev *d, uint64_t n);

/* Set up the budget of device `ordinal` once per process; returns NULL when not capping. */
static struct dev *device(int ordinal) {
    if (ordinal < 0 || ordinal >= MAX_DEV) return NULL;
    struct dev *d = &devs[ordinal];
    /* `tried` is published last, with release order, and read with acquire order: a thread that sees it
     * also sees the finished setup. Set first, it once let threads racing the process's first allocation
     * read tried=1 with active=0 while another thread was still setting up, and allocate uncapped. */
    if (__atomic_load_n(&d->tried, __ATOMIC_ACQUIRE)) return d->active ? d : NULL;
    pthread_mutex_lock(&mu);
    if (d->tried) { pthread_mutex_unlock(&mu); return d->active ? d : NULL; }
    find_job();
    if (!job[0]) { pthread_mutex_unlock(&mu); return NULL; } /* not in a Slurm job: nothing to cap */
    char path[512], st_path[520];
    snprintf(path, sizeof path, "%s/job_%s/gpu%d", dir(), job, ordinal);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat sb;
    char buf[128];
    long long lim = 0, ctx = 0;
    ssize_t n;
    if (fd < 0) {
        if (errno != ENOENT) { snprintf(buf, sizeof buf, "cannot open limits file (%s)", strerror(errno)); say(buf); }
        goto out;
    }
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode) || sb.st_uid != 0 || (sb.st_mode & 022)) {
        close(fd); say("limits file not a root-owned regular file writable only by root"); goto out;
    }
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) { say("limits file empty"); goto out; }
    buf[n] = 0;
    if (sscanf(buf, "%lld %lld", &lim, &ctx) < 1 || lim <= 0 || ctx < 0) { say("limits file malformed (want: limit_bytes [context_bytes])"); goto out; }
    snprintf(st_path, sizeof st_path, "%s.state", path);
    fd = open(st_path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) { say("cannot open the job's usage file"); goto out; }
    if (flock(fd, LOCK_EX)) { close(fd); say("cannot lock the job's usage file"); goto out; }
    if (fstat(fd, &sb) || (sb.st_size < (off_t)sizeof(struct state) && ftruncate(fd, sizeof(struct state)))) {
        flock(fd, LOCK_UN); close(fd); say("cannot size the job's usage file"); goto out;
    }
    d->st = mmap(NULL, sizeof(struct state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (d->st == MAP_FAILED) { d->st = NULL; flock(fd, LOCK_UN); close(fd); say("cannot map the job's usage file"); goto out; }
    if (d->st->magic != MAGIC) { memset(d->st, 0, sizeof *d->st); d->st->magic = MAGIC; }
    d->mine = do_register(d);
    flock(fd, LOCK_UN);
    if (!d->mine) { munmap(d->st, sizeof *d->st); close(fd); say("more processes than usage slots"); goto out; }
    d->fd = fd;
    d->limit = lim;
    d->ctx_charge = ctx;
    d->active = 1;
    if (ctx && charge(d, (uint64_t)ctx)) { /* the context alone does not fit: allocations will fail, as they would */ }
out:
    __atomic_store_n(&d->tried, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    return d->active ? d : NULL;
}

/* Reserve n bytes of the job's budget; nonzero, with nothing charged, when they do not fit. n is the size as
 * the caller asked for it (unsigned): a size larger than the whole limit is refused before anything is
 * charged, so no other thread or process ever sees a negative or wrapped counter (a size of 2^63 and more,
 * taken as a signed number, once lowered the counter while the driver refused it and let others past the
 * limit), and the test is written so that nothing in it can overflow. */
static int charge(struct dev *d, uint64_t n) {
    if (n > (uint64_t)d->limit) return 1;
    int64_t want = (int64_t)n;
    int64_t cur = __atomic_load_n(&d->st->used, __ATOMIC_SEQ_CST);
    do {
        if (cur > d->limit - want) return 1;
    } while (!__atomic_compare_exchange_n(&d->st->used, &cur, cur + want, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    __atomic_fetch_add(&d->mine->charged, want, __ATOMIC_SEQ_CST);
    return 0;
}

static void uncharge(struct dev *d, int64_t n) {
    __atomic_fetch_sub(&d->mine->charged, n, __ATOMIC_SEQ_CST);
    __atomic_fetch_sub(&d->st->used, n, __ATOMIC_SEQ_CST);
}

/* ---- pointer -> (device, size) table for frees ---- */
#define TAB (1 << 14)
struct ent { unsigned long long key; int64_t size; int dev; };
static struct ent tab[TAB];
static pthread_mutex_t tabmu = PTHREAD_MUTEX_INITIALIZER;

static void remember(unsigned long long key, int64_t size, int dev) {
    pthread_mutex_lock(&tabmu);
    unsigned h = (unsigned)((key >> 9) * 2654435761u) & (TAB - 1);
    for (int i = 0; i < TAB; i++, h = (h + 1) & (TAB - 1))
        if (!tab[h].key || tab[h].key == ~0ULL) { tab[h].key = key; tab[h].size = size; tab[h].dev = dev; break; }
    pthread_mutex_unlock(&tabmu);
}

static int forget(unsigned long long key, int64_t *size, int *dev) {
    int found = 0;
    pthread_mutex_lock(&tabmu);
    unsigned h = (unsigned)((key >> 9) * 2654435761u) & (TAB - 1);
    for (int i = 0; i < TAB && tab[h].key; i++, h = (h + 1) & (TAB - 1))
        if (tab[h].key == key) { *size = tab[h].size; *dev = tab[h].dev; tab[h].key = ~0ULL; found = 1; break; }
    pthread_mutex_unlock(&tabmu);
    return found;
}

/* A free: the entry is taken out before the driver frees (the driver may hand the same address to another
 * thread's allocation at once, which must find no stale entry), given back when the free failed, and its
 * charge refunded only once the memory is free. */
static void settle(int had, unsigned long long key, int64_t size, int o, CUresult r) {
    if (!had) return;
    if (r != CUDA_SUCCESS) remember(key, size, o);
    else if (devs[o].active) uncharge(&devs[o], size);
}

static void after_fork_child(void) {
    /* A child is a new process of the job: its own slot, its own context charge, no inherited pointers. */
    for (int i = 0; i < MAX_DEV; i++) {
        if (devs[i].st) munmap(devs[i].st, sizeof(struct state));
        if (devs[i].active) close(devs[i].fd);
        memset(&devs[i], 0, sizeof devs[i]);
    }
    memset(tab, 0, sizeof tab);
    pthread_mutex_init(&mu, NULL);
    pthread_mutex_init(&tabmu, NULL);
}

__attribute__((constructor)) static void init(void) { pthread_atfork(NULL, NULL, after_fork_child); }

static struct dev *current(int *ordinal) {
    typedef CUresult (*f_t)(CUdevice *);
    static f_t f;
    if (!f) f = (f_t)real("cuCtxGetDevice");
    CUdevice dv = 0;
    if (!f || f(&dv) != CUDA_SUCCESS) dv = 0;
    *ordinal = dv;
    return device(dv);
}

/* ---- wrappers ---- */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    REAL(CUresult (*)(CUdeviceptr *, size_t), cuMemAlloc_v2);
    int o;
    struct dev *d = current(&o);
    if (!d) return r_cuMemAlloc_v2(dptr, bytes);
    if (charge(d, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = r_cuMemAlloc_v2(dptr, bytes);
    if (r != CUDA_SUCCESS) uncharge(d, (int64_t)bytes); /* bytes <= limit: charge() refused anything larger */
    else remember(*dptr, (int64_t)bytes, o);
    return r;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned elem) {
    REAL(CUresult (*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned), cuMemAllocPitch_v2);
    int o;
    struct dev *d = current(&o);
    if (!d) return r_cuMemAllocPitch_v2(dptr, pitch, w, h, elem);
    /* pitch is known only afterwards: charge the width rounded up to 512 bytes, then settle; a width or
     * product past the limit (or past 64 bits) is refused before anything is charged */
    uint64_t est;
    if (w > (uint64_t)d->limit || __builtin_mul_overflow((uint64_t)((w + 511) & ~(size_t)511), (uint64_t)h, &est) ||
        charge(d, est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = r_cuMemAllocPitch_v2(dptr, pitch, w, h, elem);
    if (r != CUDA_SUCCESS) { uncharge(d, (int64_t)est); return r; }
    uint64_t real_size;
    if (__builtin_mul_overflow((uint64_t)*pitch, (uint64_t)h, &real_size)) real_size = UINT64_MAX;
    if (real_size > est) {
        if (charge(d, real_size - est)) {
            typedef CUresult (*fr_t)(CUdeviceptr);
            fr_t fr = (fr_t)real("cuMemFree_v2");
            if (fr) fr(*dptr);
            uncharge(d, (int64_t)est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (real_size < est) uncharge(d, (int64_t)(est - real_size));
    remember(*dptr, (int64_t)real_size, o);
    return r;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    REAL(CUresult (*)(CUdeviceptr), cuMemFree_v2);
    int64_t sz = 0; int o = 0;
    int had = p && forget(p, &sz, &o);
    CUresult r = r_cuMemFree_v2(p);
    settle(had, p, sz, o, r);
    return r;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    REAL(CUresult (*)(CUdeviceptr *, size_t, CUstream), cuMemAllocAsync);
    int o;
    struct dev *d = current(&o);
    if (!d) return r_cuMemAllocAsync(dptr, bytes, s);
    if (charge(d, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = r_cuMemAllocAsync(dptr, bytes, s);
    if (r != CUDA_SUCCESS) uncharge(d, (int64_t)bytes); /* bytes <= limit: charge() refused anything larger */
    else remember(*dptr, (int64_t)bytes, o);
    return r;
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    REAL(CUresult (*)(CUdeviceptr, CUstream), cuMemFreeAsync);
    int64_t sz = 0; int o = 0;
    int had = p && forget(p, &sz, &o);
    CUresult r = r_cuMemFreeAsync(p, s);
    settle(had, p, sz, o, r);
    return r;
}

/* The per-thread-default-stream entry points (what cuGetProcAddress hands a program built with
 * --default-stream per-thread): charged the same way. */
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    REAL(CUresult (*)(CUdeviceptr *, size_t, CUstream), cuMemAllocAsync_ptsz);
    int o;
    struct dev *d = current(&o);
    if (!d) return r_cuMemAllocAsync_ptsz(dptr, bytes, s);
    if (charge(d, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = r_cuMemAllocAsync_ptsz(dptr, bytes, s);
    if (r != CUDA_SUCCESS) uncharge(d, (int64_t)bytes); /* bytes <= limit: charge() refused anything larger */
    else remember(*dptr, (int64_t)bytes, o);
    return r;
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    REAL(CUresult (*)(CUdeviceptr, CUstream), cuMemFreeAsync_ptsz);
    int64_t sz = 0; int o = 0;
    int had = p && forget(p, &sz, &o);
    CUresult r = r_cuMemFreeAsync_ptsz(p, s);
    settle(had, p, sz, o, r);
    return r;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const CUmemAllocationProp *prop, unsigned long long flags) {
    REAL(CUresult (*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long), cuMemCreate);
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return r_cuMemCreate(h, bytes, prop, flags);
    int o = prop->location.id;
    struct dev *d = device(o);
    if (!d) return r_cuMemCreate(h, bytes, prop, flags);
    if (charge(d, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = r_cuMemCreate(h, bytes, prop, flags);
    if (r != CUDA_SUCCESS) uncharge(d, (int64_t)bytes); /* bytes <= limit: charge() refused anything larger */
    else remember(*h, (int64_t)bytes, o);
    return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    REAL(CUresult (*)(CUmemGenericAllocationHandle), cuMemRelease);
    int64_t sz = 0; int o = 0;
    int had = forget(h, &sz, &o);
    CUresult r = r_cuMemRelease(h);
    settle(had, h, sz, o, r);
    return r;
}

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
    REAL(CUresult (*)(size_t *, size_t *), cuMemGetInfo_v2);
    CUresult r = r_cuMemGetInfo_v2(free_b, total_b);
    int o;
    struct dev *d;
    if (r != CUDA_SUCCESS || !(d = current(&o))) return r;
    int64_t used = __atomic_load_n(&d->st->used, __ATOMIC_SEQ_CST);
    int64_t left = d->limit - used;
    if (left < 0) left = 0;
    if (free_b && (int64_t)*free_b > left) *free_b = (size_t)left;
    if (total_b && (int64_t)*total_b > d->limit) *total_b = (size_t)d->limit;
    return r;
}

/* ---- NVML's memory info, as the job sees it ----
 * NVML numbers GPUs its own way, so the GPU is matched by UUID: the Prolog writes it as the limits file's
 * third field. Only read here (limits file with the same checks, the usage counter with pread): a tool
 * like nvidia-smi that asks NVML takes no slot and no context charge. total = min(total, limit),
 * used = the job's charged usage, free = min(free, limit - used), v2's reserved = 0; never an error of its own. */
static int peek(const char *uuid, int64_t *limit, int64_t *used) {
    for (int o = 0; o < MAX_DEV; o++) {
        char path[512], buf[192], id[96] = "";
        long long lim = 0, ctx = 0;
        struct stat sb;
        pthread_mutex_lock(&mu);
        find_job();
        pthread_mutex_unlock(&mu);
        if (!job[0]) return 0;
        snprintf(path, sizeof path, "%s/job_%s/gpu%d", dir(), job, o);
        int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return 0;
        ssize_t n = (fstat(fd, &sb) || !S_ISREG(sb.st_mode) || sb.st_uid != 0 || (sb.st_mode & 022)) ? -1
                    : read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) return 0;
        buf[n] = 0;
        if (sscanf(buf, "%lld %lld %95s", &lim, &ctx, id) < 3 || lim <= 0 || strcmp(id, uuid)) continue;
        struct state st;
        memset(&st, 0, sizeof st);
        snprintf(path + strlen(path), sizeof path - strlen(path), ".state");
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) { if (pread(fd, &st, 16, 0) != 16) st.used = 0; close(fd); }
        *limit = lim;
        *used = st.magic == MAGIC && st.used > 0 ? st.used : 0;
        return 1;
    }
    return 0;
}

static int nvml_slice(nvmlDevice_t dev, int64_t *limit, int64_t *used) {
    typedef nvmlReturn_t (*uuid_t_)(nvmlDevice_t, char *, unsigned);
    static uuid_t_ f;
    char uuid[96];
    if (!f) f = (uuid_t_)real_nvml("nvmlDeviceGetUUID", 1);
    if (!f || f(dev, uuid, sizeof uuid) != NVML_SUCCESS) return 0;
    return peek(uuid, limit, used);
}

static void clamp(unsigned long long *total, unsigned long long *free_b, unsigned long long *used_b, int64_t limit, int64_t used) {
    if (*total > (unsigned long long)limit) *total = (unsigned long long)limit;
    if (used > limit) used = limit;
    if (*free_b > (unsigned long long)(limit - used)) *free_b = (unsigned long long)(limit - used);
    *used_b = (unsigned long long)used;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m) {
    typedef nvmlReturn_t (*f_t)(nvmlDevice_t, nvmlMemory_t *);
    static f_t f;
    if (!f) f = (f_t)real_nvml("nvmlDeviceGetMemoryInfo", 1);
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = f(dev, m);
    int64_t limit, used;
    if (r == NVML_SUCCESS && m && nvml_slice(dev, &limit, &used)) clamp(&m->total, &m->free, &m->used, limit, used);
    return r;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m) {
    typedef nvmlReturn_t (*f_t)(nvmlDevice_t, nvmlMemory_v2_t *);
    static f_t f;
    if (!f) f = (f_t)real_nvml("nvmlDeviceGetMemoryInfo_v2", 1);
    if (!f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = f(dev, m);
    int64_t limit, used;
    if (r == NVML_SUCCESS && m && nvml_slice(dev, &limit, &used)) {
        clamp(&m->total, &m->free, &m->used, limit, used);
        m->reserved = 0; /* the driver's own reservation is outside every job's share: total = used + free */
    }
    return r;
}

/* ---- the two indirect ways in ---- */
struct wrap { const char *name; void *fn; void *real; };
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
static struct wrap wraps[] = {
    {"cuMemAlloc_v2", (void *)cuMemAlloc_v2, 0}, {"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2, 0},
    {"cuMemFree_v2", (void *)cuMemFree_v2, 0}, {"cuMemAllocAsync", (void *)cuMemAllocAsync, 0},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync, 0}, {"cuMemCreate", (void *)cuMemCreate, 0},
    {"cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz, 0}, {"cuMemFreeAsync_ptsz", (void *)cuMemFreeAsync_ptsz, 0},
    {"cuMemRelease", (void *)cuMemRelease, 0}, {"cuMemGetInfo_v2", (void *)cuMemGetInfo_v2, 0},
    {"cuGetProcAddress", (void *)cuGetProcAddress, 0}, {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2, 0},
    {"nvmlDeviceGetMemoryInfo", (void *)nvmlDeviceGetMemoryInfo, 0},
    {"nvmlDeviceGetMemoryInfo_v2", (void *)nvmlDeviceGetMemoryInfo_v2, 0},
};
#define NWRAPS (sizeof wraps / sizeof wraps[0])

/* The wrapper when p is exactly the driver's own entry point of a function we wrap, else p itself. */
static void *swap(void *p) {
    if (!p) return p;
    for (size_t i = 0; i < NWRAPS; i++) {
        if (!wraps[i].real)
            wraps[i].real = wraps[i].name[0] == 'n' ? real_nvml(wraps[i].name, 0) : real_from(wraps[i].name, 0);
        if (wraps[i].real == p) return wraps[i].fn;
    }
    return p;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    REAL(CUresult (*)(const char *, void **, int, unsigned long long), cuGetProcAddress);
    CUresult r = r_cuGetProcAddress(sym, pfn, ver, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = swap(*pfn);
    return r;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    REAL(CUresult (*)(const char *, void **, int, unsigned long long, int *), cuGetProcAddress_v2);
    CUresult r = r_cuGetProcAddress_v2(sym, pfn, ver, flags, status);
    if (r == CUDA_SUCCESS && pfn) *pfn = swap(*pfn);
    return r;
}

/* Whether this process is in a job the Prolog capped (its limits folder exists). */
static int capped_job(void) {
    char path[512];
    struct stat sb;
    pthread_mutex_lock(&mu);
    find_job();
    pthread_mutex_unlock(&mu);
    if (!job[0]) return 0;
    snprintf(path, sizeof path, "%s/job_%s", dir(), job);
    return stat(path, &sb) == 0;
}

/* A driver function the shim wraps, answered by an object other than the driver the shim wraps (the
 * libcuda.so.1 the process loaded) and other than the shim: a second copy of the driver, e.g. one whose
 * SONAME was changed so that it loads beside libcuda.so.1, opened by its path. */
static int second_driver(const char *name, void *p) {
    if (name[0] != 'c') return 0;
    for (size_t i = 0; i < NWRAPS; i++)
        if (!strcmp(wraps[i].name, name)) return wraps[i].fn != p;
    return 0;
}

void *dlsym(void *handle, const char *name) {
    dlsym_t rd = real_dlsym();
    if (!rd) return NULL;

    void *p = rd(handle, name);
    if (!p || ((name[0] != 'c' || name[1] != 'u') && strncmp(name, "nvmlDeviceGetMemoryInfo", 23))) return p;
    void *w = swap(p);
    if (w != p || handle == RTLD_DEFAULT || handle == RTLD_NEXT || !second_driver(name, p) || !capped_job()) return w;
    /* In a capped job the copy's allocation entry points are not handed out: NULL, with dlerror() naming why
     * (set by a lookup that cannot succeed), as for a symbol the object lacks. */
    static int told;
    if (!__atomic_exchange_n(&told, 1, __ATOMIC_SEQ_CST))
        fprintf(stderr, "gpushare-hardcap: %s asked of a second copy of the CUDA driver (not libcuda.so.1); refused\n", name);
    rd(handle, "(refused by gpushare-hardcap: a second copy of the CUDA driver in a capped job)");
    return NULL;
}
