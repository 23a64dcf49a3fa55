// A stand-in for the NVIDIA driver's libcuda, for machines without a GPU. It answers as one
// H200 (compute capability 9.0) would, keeps "device" memory in host memory, and records every
// module CubeCL loads: the PTX that the real nvrtc made from CubeCL's CUDA C++. It runs no
// kernel (a launch is counted, not executed), so every value read back is meaningless; what a
// run under it proves is that every kernel the run needs compiles for sm_90a, and that the
// process gets through device start, allocation, launch and read-back without a panic.
// What the real driver refuses before a kernel runs, it refuses too (launch.c: grid
// and block limits, the kernel's .maxntid, dynamic shared memory, TMA descriptors), and writes
// why to FAKE_CUDA_DIR/refused.txt: those would fail on the GPU and nowhere else.
// scripts/cuda-compile-check.sh builds and uses it.
#include "fake_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

unsigned long long launches, modules, refused;
static unsigned long long allocated;

static void finish(void) {
    const char *dir = getenv("FAKE_CUDA_DIR");
    if (!dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/counts.txt", dir);
    // Appended: gpu-check.sh runs gpu_check twice (the numerics part apart).
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "process %d: modules %llu launches %llu refused %llu bytes_allocated %llu\n",
            (int)getpid(), modules, launches, refused, allocated);
    fclose(f);
}

static void *handle(void) { return calloc(1, 64); }

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    static int once;
    if (!once++) atexit(finish);
    return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    (void)d;
    snprintf(name, len, "fake H200 (scripts/fake-cuda: no kernel runs)");
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(size_t *bytes, CUdevice d) {
    (void)d;
    *bytes = 150754820096ull;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d) {
    (void)d;
    memset(uuid, 0, sizeof *uuid);
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
    (void)d;
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *v = 62914560; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *v = 3201000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *v = 6144; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: *v = 512; break;
    default: *v = 1; break; // boolean capabilities: present
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    (void)d;
    static void *ctx;
    if (!ctx) ctx = handle();
    *c = (CUcontext)ctx;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return CUDA_SUCCESS; }
static __thread CUcontext current;
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = current; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { return CUDA_SUCCESS; }
CUresult cuCtxPushCurrent(CUcontext c) { current = c; return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent(CUcontext *c) { if (c) *c = current; return CUDA_SUCCESS; }
CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) {
    *total = 150754820096ull;
    *free_bytes = *total - allocated;
    return CUDA_SUCCESS;
}

// Memory: host memory, zeroed, so that a read-back is at least deterministic; aligned to 256
// bytes as cuMemAlloc's is (TMA descriptors are refused below for a misaligned address).
static CUresult alloc(CUdeviceptr *p, size_t n) {
    void *m = NULL;
    if (posix_memalign(&m, 256, n ? n : 1)) return CUDA_ERROR_OUT_OF_MEMORY;
    memset(m, 0, n ? n : 1);
    allocated += n;
    *p = (CUdeviceptr)m;
    return CUDA_SUCCESS;
}
CUresult cuMemAlloc(CUdeviceptr *p, size_t n) { return alloc(p, n); }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { (void)s; return alloc(p, n); }
CUresult cuMemFree(CUdeviceptr p) { free((void *)p); return CUDA_SUCCESS; }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; free((void *)p); return CUDA_SUCCESS; }
CUresult cuMemAllocHost(void **p, size_t n) {
    *p = calloc(1, n ? n : 1);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) { free(p); return CUDA_SUCCESS; }
CUresult cuMemHostRegister(void *p, size_t n, unsigned int f) { (void)p; (void)n; (void)f; return CUDA_SUCCESS; }
CUresult cuMemHostUnregister(void *p) { (void)p; return CUDA_SUCCESS; }
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *h, size_t n, CUstream s) {
    (void)s;
    memcpy((void *)d, h, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync(void *h, CUdeviceptr d, size_t n, CUstream s) {
    (void)s;
    memcpy(h, (void *)d, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s) {
    (void)s;
    memmove((void *)d, (void *)src, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *h, size_t n) { return cuMemcpyHtoDAsync(d, h, n, 0); }
CUresult cuMemcpyDtoH(void *h, CUdeviceptr d, size_t n) { return cuMemcpyDtoHAsync(h, d, n, 0); }
CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D *c, CUstream s) {
    (void)s;
    const char *src = c->srcMemoryType == CU_MEMORYTYPE_HOST ? (const char *)c->srcHost : (const char *)c->srcDevice;
    char *dst = c->dstMemoryType == CU_MEMORYTYPE_HOST ? (char *)c->dstHost : (char *)c->dstDevice;
    src += c->srcY * c->srcPitch + c->srcXInBytes;
    dst += c->dstY * c->dstPitch + c->dstXInBytes;
    for (size_t row = 0; row < c->Height; row++)
        memmove(dst + row * c->dstPitch, src + row * c->srcPitch, c->WidthInBytes);
    return CUDA_SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    (void)s;
    memset((void *)d, v, n);
    return CUDA_SUCCESS;
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) {
    (void)s;
    for (size_t i = 0; i < n; i++) ((unsigned int *)d)[i] = v;
    return CUDA_SUCCESS;
}

// Streams and events: events carry the host time of their record.
CUresult cuStreamCreate(CUstream *s, unsigned int f) { (void)f; *s = (CUstream)handle(); return CUDA_SUCCESS; }
CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int f, int p) { (void)p; return cuStreamCreate(s, f); }
CUresult cuStreamDestroy(CUstream s) { free(s); return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return CUDA_SUCCESS; }
CUresult cuStreamQuery(CUstream s) { (void)s; return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) { (void)s; (void)e; (void)f; return CUDA_SUCCESS; }
CUresult cuEventCreate(CUevent *e, unsigned int f) { (void)f; *e = (CUevent)handle(); return CUDA_SUCCESS; }
CUresult cuEventDestroy(CUevent e) { free(e); return CUDA_SUCCESS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)s; *(double *)e = now_ms(); return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; return CUDA_SUCCESS; }
CUresult cuEventQuery(CUevent e) { (void)e; return CUDA_SUCCESS; }
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    *ms = (float)(*(double *)b - *(double *)a);
    return CUDA_SUCCESS;
}

// nvrtc dlopens libcuda.so.1 too, and asks for this private table: "none" makes it go on as it
// does on a machine without a driver.
CUresult cuGetExportTable(const void **table, const CUuuid *id) {
    (void)id;
    *table = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake-cuda error"; return CUDA_SUCCESS; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "FAKE_CUDA_ERROR"; return CUDA_SUCCESS; }
