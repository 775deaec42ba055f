/* Compiles only when gres/hardcap/cuda_types.h agrees with NVIDIA's nvml.h on the NVML types and codes the
 * shim relies on (the memory-info structs and the two return codes). */
#include <nvml.h>
#include <stddef.h>

typedef nvmlMemory_t r_mem1;
typedef nvmlMemory_v2_t r_mem2;
typedef nvmlReturn_t r_return;
enum { R_SUCCESS = NVML_SUCCESS, R_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND };
#define nvmlReturn_t hc_return
#define nvmlDevice_t hc_device
#define nvmlMemory_t hc_mem1
#define nvmlMemory_v2_t hc_mem2
#define nvmlDevice_st hc_device_st
#include "cuda_types.h"

_Static_assert(sizeof(hc_mem1) == sizeof(r_mem1) && sizeof(hc_mem2) == sizeof(r_mem2), "memory info size differs");
_Static_assert(offsetof(hc_mem1, free) == offsetof(r_mem1, free) && offsetof(hc_mem1, used) == offsetof(r_mem1, used),
               "nvmlMemory_t fields moved");
_Static_assert(offsetof(hc_mem2, total) == offsetof(r_mem2, total) && offsetof(hc_mem2, reserved) == offsetof(r_mem2, reserved)
               && offsetof(hc_mem2, free) == offsetof(r_mem2, free) && offsetof(hc_mem2, used) == offsetof(r_mem2, used),
               "nvmlMemory_v2_t fields moved");
_Static_assert(sizeof(hc_return) == sizeof(r_return), "nvmlReturn_t size differs");
_Static_assert(NVML_SUCCESS == R_SUCCESS && NVML_ERROR_FUNCTION_NOT_FOUND == R_NOT_FOUND, "NVML codes differ");
int main(void) { return 0; }
