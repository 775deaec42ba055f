/* The few CUDA driver and NVML types and codes the hard cap shim needs, declared here rather than taken from cuda.h
 * (which the build machine need not have). tests/hardcap/test_cuda_types.py checks them against cuda.h
 * from NVIDIA's nvidia-cuda-runtime-cu12 wheel where it is installed. */
#ifndef GPUSHARE_HARDCAP_CUDA_TYPES_H
#define GPUSHARE_HARDCAP_CUDA_TYPES_H
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type;              /* CUmemAllocationType */
    int requestedHandleTypes;
    struct { int type; int id; } location;  /* CUmemLocation: type 1 = device */
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define CU_MEM_LOCATION_TYPE_DEVICE 1

/* NVML (nvml.h): the memory-info calls the shim clamps */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#endif
