/* Threads racing for one job's budget while another thread keeps asking for sizes no budget can hold.
 *
 * race <threads> <chunk> <tries>: one hostile thread loops over every allocation entry point the shim wraps
 * (cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemAllocAsync and its per-thread-stream entry, device-located
 * cuMemCreate) with sizes of 2^63 + 4096 and more and a pitch whose product wraps 64 bits, all of which a
 * driver refuses; <threads> allocating threads each make <tries> attempts of <chunk> bytes, cycling over the
 * same entry points, and keep what they get. Then, with the hostile thread still running, every allocation
 * is freed. Prints "granted <bytes> hostile_granted <n> hostile_calls <n> freed_failures <n>". Linked against
 * libcuda.so.1; entry points the program is not linked to by name are reached with cuGetProcAddress_v2. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_types.h"

CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

typedef CUresult (*alloc_async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_t)(CUdeviceptr, CUstream);
static alloc_async_t alloc_ptsz;
static free_async_t free_ptsz;
#define WAYS 5
static size_t chunk;
static long tries;
static volatile int stop;
static long long granted, hostile_granted, hostile_calls, free_failures;

static CUresult take(int way, size_t bytes, unsigned long long *p) {
    CUmemAllocationProp prop = {0};
    size_t pitch;
    switch (way) {
    case 0: return cuMemAlloc_v2(p, bytes);
    case 1: return cuMemAllocPitch_v2(p, &pitch, bytes, 1, 4);
    case 2: return cuMemAllocAsync(p, bytes, NULL);
    case 3: return alloc_ptsz(p, bytes, NULL);
    default:
        prop.type = 1;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        return cuMemCreate(p, bytes, &prop, 0);
    }
}

static CUresult give(int way, unsigned long long p) {
    switch (way) {
    case 0: case 1: return cuMemFree_v2(p);
    case 2: return cuMemFreeAsync(p, NULL);
    case 3: return free_ptsz(p, NULL);
    default: return cuMemRelease(p);
    }
}

static void *hostile(void *arg) {
    (void)arg;
    const size_t huge = ((size_t)1 << 63) + 4096;
    for (long i = 0; !stop; i++) {
        unsigned long long p;
        size_t pitch;
        CUresult r;
        int way = (int)(i % (WAYS + 1));
        if (way == WAYS) r = cuMemAllocPitch_v2(&p, &pitch, (size_t)1 << 40, (size_t)1 << 25, 4); /* wraps 64 bits */
        else r = take(way, huge + (size_t)(i % 2) * ((size_t)1 << 62), &p); /* 2^63 + 4096, 3 * 2^62 + 4096 */
        if (r == CUDA_SUCCESS) __atomic_add_fetch(&hostile_granted, 1, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&hostile_calls, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

struct held { unsigned long long p; int way; };

static void *allocator(void *arg) {
    long me = (long)(intptr_t)arg;
    struct held *mine = calloc((size_t)tries, sizeof *mine);
    long n = 0;
    for (long i = 0; i < tries; i++) {
        int way = (int)((i + me) % WAYS);
        unsigned long long p;
        if (take(way, chunk, &p) == CUDA_SUCCESS) {
            mine[n].p = p;
            mine[n++].way = way;
            __atomic_add_fetch(&granted, (long long)chunk, __ATOMIC_SEQ_CST);
        }
    }
    (void)n;
    return mine;
}

int main(int argc, char **argv) {
    if (argc < 4) return 64;
    int threads = atoi(argv[1]);
    chunk = strtoull(argv[2], NULL, 10);
    tries = atol(argv[3]);
    int st;
    if (cuGetProcAddress_v2("cuMemAllocAsync", (void **)&alloc_ptsz, 12000, 2, &st) ||
        cuGetProcAddress_v2("cuMemFreeAsync", (void **)&free_ptsz, 12000, 2, &st))
        return 66;
    pthread_t bad, t[64];
    if (threads < 1 || threads > 64) return 64;
    pthread_create(&bad, NULL, hostile, NULL);
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, allocator, (void *)(intptr_t)i);
    struct held *got[64];
    for (int i = 0; i < threads; i++) pthread_join(t[i], (void **)&got[i]);
    long long peak = __atomic_load_n(&granted, __ATOMIC_SEQ_CST);
    for (int i = 0; i < threads; i++) {  /* free everything while the hostile thread still runs */
        for (long k = 0; k < tries && got[i][k].p; k++)
            if (give(got[i][k].way, got[i][k].p) != CUDA_SUCCESS) free_failures++;
        free(got[i]);
    }
    stop = 1;
    pthread_join(bad, NULL);
    printf("granted %lld hostile_granted %lld hostile_calls %lld freed_failures %lld\n", peak, hostile_granted,
           hostile_calls, free_failures);
    return 0;
}
