/* Allocates CHUNK-byte blocks until COUNT or the first failure, over the driver reached one of three ways
 * (argv[1]: linked | dlopen | procaddr, or a path: that file dlopened and its entry points taken by dlsym,
 * as a program would open a copy of the driver), then prints "allocated <bytes> result <code> free <f> total <t>"
 * and optionally sleeps (argv[4] seconds) holding the memory. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*alloc_t)(unsigned long long *, size_t);
typedef int (*info_t)(size_t *, size_t *);
typedef int (*gpa_t)(const char *, void **, int, unsigned long long, int *);
#ifdef LINKED
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuMemGetInfo_v2(size_t *, size_t *);
#endif

int main(int argc, char **argv) {
    if (argc < 4) return 64;
    size_t chunk = strtoull(argv[2], 0, 10);
    long count = atol(argv[3]);
    alloc_t alloc = NULL;
    info_t info = NULL;
#ifdef LINKED
    alloc = cuMemAlloc_v2;
    info = cuMemGetInfo_v2;
#endif
    if (!strncmp(argv[1], "async", 5)) {  /* async: cuMemAllocAsync; async_ptsz: its per-thread-stream entry */
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        gpa_t gpa = h ? (gpa_t)dlsym(h, "cuGetProcAddress_v2") : NULL;
        int st;
        int (*aa)(unsigned long long *, size_t, void *) = NULL;
        if (!gpa || gpa("cuMemAllocAsync", (void **)&aa, 12000, strcmp(argv[1], "async") ? 2 : 0, &st) ||
            gpa("cuMemGetInfo", (void **)&info, 12000, 0, &st))
            return 66;
        long long total = 0;
        int r = 0;
        for (long i = 0; i < count; i++) {
            unsigned long long p;
            if ((r = aa(&p, chunk, NULL))) break;
            total += chunk;
        }
        size_t f = 0, t = 0;
        int ri = info(&f, &t);
        printf("allocated %lld result %d free %zu total %zu info %d\n", total, r, f, t, ri);
        return 0;
    }
    if (!strcmp(argv[1], "dlopen") || !strcmp(argv[1], "procaddr") || argv[1][0] == '/') {
        void *h = dlopen(argv[1][0] == '/' ? argv[1] : "libcuda.so.1", RTLD_NOW);
        if (!h) { fprintf(stderr, "no driver\n"); return 65; }
        if (strcmp(argv[1], "procaddr")) {
            alloc = (alloc_t)dlsym(h, "cuMemAlloc_v2");
            info = (info_t)dlsym(h, "cuMemGetInfo_v2");
        } else {
            gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
            int st;
            gpa("cuMemAlloc", (void **)&alloc, 12000, 0, &st);
            gpa("cuMemGetInfo", (void **)&info, 12000, 0, &st);
        }
    }
    if (!alloc || !info) { fprintf(stderr, "no entry point: %s\n", dlerror()); return 66; }
    long long total = 0;
    int r = 0;
    for (long i = 0; i < count; i++) {
        unsigned long long p;
        r = alloc(&p, chunk);
        if (r) break;
        total += chunk;
    }
    size_t f = 0, t = 0;
    int ri = info(&f, &t);
    printf("allocated %lld result %d free %zu total %zu info %d\n", total, r, f, t, ri);
    fflush(stdout);
    if (argc > 4) sleep(atoi(argv[4]));
    return 0;
}
