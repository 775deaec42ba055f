/* A stand-in libnvidia-ml.so.1 for the hard cap tests: one GPU whose memory is the fake driver's shared
 * file (fake_cuda.c: FAKE_CUDA_MEM, FAKE_CUDA_TOTAL), so NVML reports what the fake driver's processes
 * allocated; its UUID is FAKE_NVML_UUID. Internal calls go to static functions, as in the real library. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct devmem { int64_t total, used; };
typedef struct { unsigned long long total, free, used; } mem_v1;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } mem_v2;
static struct devmem *mem;
static int the_gpu;

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

int nvmlInit_v2(void) { return device() ? 0 : 9; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { if (i) return 2; *h = &the_gpu; return 0; }

int nvmlDeviceGetUUID(void *h, char *buf, unsigned len) {
    if (h != &the_gpu) return 2;
    const char *u = getenv("FAKE_NVML_UUID");
    snprintf(buf, len, "%s", u ? u : "GPU-00000000-0000-0000-0000-000000000000");
    return 0;
}

static int info(void *h, unsigned long long *total, unsigned long long *free_b, unsigned long long *used) {
    struct devmem *m = device();
    if (!m || h != &the_gpu) return 2;
    *total = m->total;
    *used = __atomic_load_n(&m->used, __ATOMIC_SEQ_CST);
    *free_b = *total - *used;
    return 0;
}

int nvmlDeviceGetMemoryInfo(void *h, mem_v1 *m) { return info(h, &m->total, &m->free, &m->used); }

int nvmlDeviceGetMemoryInfo_v2(void *h, mem_v2 *m) {
    int r = info(h, &m->total, &m->free, &m->used);
    m->reserved = 1 << 20;  /* the driver's own reservation, outside used and free */
    if (!r) m->free -= m->reserved;
    return r;
}
