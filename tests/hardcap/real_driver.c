/* Allocates 256 MiB blocks (at most 64) on GPU 0 of the real driver, reached by dlsym or cuGetProcAddress_v2
 * (argv[1]), and prints what it got: tests/hardcap/test_real_driver.py runs it with and without the shim. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef int (*gpa_t)(const char *, void **, int, unsigned long long, int *);
int main(int argc, char **argv) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("no libcuda\n"); return 2; }
    int (*init)(unsigned) = dlsym(h, "cuInit");
    int (*devget)(int *, int) = dlsym(h, "cuDeviceGet");
    int (*retain)(void **, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
    int (*setcur)(void *) = dlsym(h, "cuCtxSetCurrent");
    int (*alloc)(unsigned long long *, size_t) = NULL;
    int (*info)(size_t *, size_t *) = NULL;
    int (*fr)(unsigned long long) = NULL;
    if (!strcmp(argv[1], "procaddr")) {
        gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
        int st;
        gpa("cuMemAlloc", (void **)&alloc, 12000, 0, &st);
        gpa("cuMemGetInfo", (void **)&info, 12000, 0, &st);
        gpa("cuMemFree", (void **)&fr, 12000, 0, &st);
    } else {
        alloc = dlsym(h, "cuMemAlloc_v2"); info = dlsym(h, "cuMemGetInfo_v2"); fr = dlsym(h, "cuMemFree_v2");
    }
    int dev; void *ctx;
    int a = init(0), b = devget(&dev, 0), c = retain(&ctx, dev), d = setcur(ctx);
    printf("init %d devget %d retain %d setcur %d\n", a, b, c, d);
    long long total = 0; int r = 0;
    for (int i = 0; i < 64; i++) { unsigned long long p; r = alloc(&p, 256ull << 20); if (r) break; total += 256ull << 20; }
    size_t f = 0, t = 0;
    int ri = info(&f, &t);
    printf("%s allocated %lld MiB result %d free %zu MiB total %zu MiB info %d\n", argv[1], total >> 20, r, f >> 20, t >> 20, ri);
    return 0;
}
