/* A plain CUDA driver-API program, written the way the CUDA samples (vectorAddDrv) start, with nothing in it
 * for the shim: cuInit, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceTotalMem, cuCtxCreate, then
 * blocks of argv[1] bytes (at most argv[2]) until the first refusal, cuMemGetInfo, every block freed,
 * cuMemGetInfo again, cuCtxDestroy. The _v2 names are those cuda.h maps the plain ones to; linked with
 * -lcuda. Prints one line of "<what> <value>" pairs. */
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
/* as cuda.h declares them */
CUresult cuInit(unsigned int Flags);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
#define cuDeviceTotalMem cuDeviceTotalMem_v2
#define cuCtxCreate cuCtxCreate_v2
#define cuCtxDestroy cuCtxDestroy_v2
#define cuMemAlloc cuMemAlloc_v2
#define cuMemFree cuMemFree_v2
#define cuMemGetInfo cuMemGetInfo_v2

#define CHECK(call) do { CUresult e_ = (call); if (e_) { printf("failed %s error %d\n", #call, e_); return 1; } } while (0)

int main(int argc, char **argv) {
    size_t chunk = argc > 1 ? strtoull(argv[1], NULL, 10) : 1 << 20;
    long most = argc > 2 ? atol(argv[2]) : 1000;
    int count = 0;
    CUdevice dev;
    CUcontext ctx;
    char name[128];
    size_t total_mem = 0, free_b = 0, total_b = 0, free_after = 0, total_after = 0;
    CHECK(cuInit(0));
    CHECK(cuDeviceGetCount(&count));
    if (count == 0) { printf("no device\n"); return 1; }
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(cuDeviceTotalMem(&total_mem, dev));
    CHECK(cuCtxCreate(&ctx, 0, dev));
    CUdeviceptr *blocks = calloc((size_t)most, sizeof *blocks);
    long n = 0;
    CUresult r = 0;
    while (n < most && (r = cuMemAlloc(&blocks[n], chunk)) == 0) n++;
    CHECK(cuMemGetInfo(&free_b, &total_b));
    for (long i = 0; i < n; i++) CHECK(cuMemFree(blocks[i]));
    CHECK(cuMemGetInfo(&free_after, &total_after));
    CHECK(cuCtxDestroy(ctx));
    printf("devices %d total_mem %zu allocated %zu result %d free %zu total %zu free_after %zu total_after %zu\n",
           count, total_mem, (size_t)n * chunk, r, free_b, total_b, free_after, total_after);
    return 0;
}
