/* Compiles only when gres/hardcap/cuda_types.h agrees with NVIDIA's cuda.h on what the shim relies on:
 * sizes and offsets of the types, the values of the codes. */
#include <cuda.h>
#include <stddef.h>

enum { R_SUCCESS = CUDA_SUCCESS, R_OOM = CUDA_ERROR_OUT_OF_MEMORY, R_NOT_FOUND = CUDA_ERROR_NOT_FOUND,
       R_LOC_DEVICE = CU_MEM_LOCATION_TYPE_DEVICE };
typedef CUresult r_result;
typedef CUdevice r_device;
typedef CUdeviceptr r_ptr;
typedef CUstream r_stream;
typedef CUmemGenericAllocationHandle r_handle;
typedef CUmemAllocationProp r_prop;

#define CUresult hc_result
#define CUdevice hc_device
#define CUdeviceptr hc_ptr
#define CUstream hc_stream
#define CUmemGenericAllocationHandle hc_handle
#define CUmemAllocationProp hc_prop
#include "cuda_types.h"

#define SAME_SIZE(a, b) _Static_assert(sizeof(a) == sizeof(b), #a " differs from cuda.h")
SAME_SIZE(hc_result, r_result);
SAME_SIZE(hc_device, r_device);
SAME_SIZE(hc_ptr, r_ptr);
SAME_SIZE(hc_stream, r_stream);
SAME_SIZE(hc_handle, r_handle);
SAME_SIZE(hc_prop, r_prop);
_Static_assert(offsetof(hc_prop, location) == offsetof(r_prop, location), "CUmemAllocationProp.location moved");
_Static_assert(offsetof(hc_prop, location.type) == offsetof(r_prop, location.type), "CUmemLocation.type moved");
_Static_assert(offsetof(hc_prop, location.id) == offsetof(r_prop, location.id), "CUmemLocation.id moved");
_Static_assert(CUDA_SUCCESS == R_SUCCESS && CUDA_ERROR_OUT_OF_MEMORY == R_OOM && CUDA_ERROR_NOT_FOUND == R_NOT_FOUND,
               "result codes differ from cuda.h");
_Static_assert(CU_MEM_LOCATION_TYPE_DEVICE == R_LOC_DEVICE, "CU_MEM_LOCATION_TYPE_DEVICE differs from cuda.h");
int main(void) { return 0; }
