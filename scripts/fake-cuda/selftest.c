// The stand-in's refusals, checked (scripts/cuda-compile-check.sh --stand-in-only, in CI): each
// case is a launch or descriptor the real driver takes or refuses, by cuda.h's rules.
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *PTX =
    ".version 9.0\n.target sm_90a\n.address_size 64\n"
    ".visible .entry bounded(\n\t.param .u64 bounded_param_0\n)\n.maxntid 256, 1, 1\n{\n\tret;\n}\n"
    ".visible .entry exact(\n\t.param .u64 exact_param_0\n)\n.reqntid 32, 4, 1\n{\n\tret;\n}\n"
    ".visible .entry clustered(\n)\n.reqnctapercluster 2, 1, 1\n{\n\tret;\n}\n";

static int failures, refusals;
extern unsigned long long refused; // the stand-in's count of what it refused

static void expect(const char *what, CUresult got, CUresult want) {
    refusals += want != CUDA_SUCCESS;
    if (got != want) {
        printf("FAIL %s: %d, expected %d\n", what, (int)got, (int)want);
        failures++;
    }
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, unsigned shared) {
    return cuLaunchKernel(f, gx, gy, 1, bx, by, 1, shared, NULL, NULL, NULL);
}

int main(void) {
    CUmodule m;
    CUfunction bounded, exact, clustered, missing;
    expect("init", cuInit(0), CUDA_SUCCESS);
    expect("load", cuModuleLoadData(&m, PTX), CUDA_SUCCESS);
    expect("bounded", cuModuleGetFunction(&bounded, m, "bounded"), CUDA_SUCCESS);
    expect("exact", cuModuleGetFunction(&exact, m, "exact"), CUDA_SUCCESS);
    expect("clustered", cuModuleGetFunction(&clustered, m, "clustered"), CUDA_SUCCESS);
    expect("no such entry", cuModuleGetFunction(&missing, m, "bound"), CUDA_ERROR_NOT_FOUND);

    int threads = 0;
    cuFuncGetAttribute(&threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, bounded);
    expect(".maxntid read", threads == 256 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN, CUDA_SUCCESS);

    expect("within limits", launch(bounded, 65536, 65535, 256, 1, 0), CUDA_SUCCESS);
    expect("zero grid", launch(bounded, 0, 1, 64, 1, 0), CUDA_ERROR_INVALID_VALUE);
    expect("grid y over 65535", launch(bounded, 1, 65536, 64, 1, 0), CUDA_ERROR_INVALID_VALUE);
    expect("over .maxntid", launch(bounded, 1, 1, 16, 32, 0), CUDA_ERROR_INVALID_VALUE);
    expect("block over 1024", cuLaunchKernel(exact, 1, 1, 1, 2048, 1, 1, 0, NULL, NULL, NULL),
           CUDA_ERROR_INVALID_VALUE);
    expect("block z over 64", cuLaunchKernel(clustered, 2, 1, 1, 1, 1, 128, 0, NULL, NULL, NULL),
           CUDA_ERROR_INVALID_VALUE);
    expect(".reqntid met", launch(exact, 1, 1, 32, 4, 0), CUDA_SUCCESS);
    expect(".reqntid not met", launch(exact, 1, 1, 128, 1, 0), CUDA_ERROR_INVALID_VALUE);
    expect("whole clusters", launch(clustered, 4, 1, 32, 1, 0), CUDA_SUCCESS);
    expect("half a cluster", launch(clustered, 3, 1, 32, 1, 0), CUDA_ERROR_INVALID_VALUE);

    expect("48 KiB of shared memory, no opt-in", launch(bounded, 1, 1, 32, 1, 49152), CUDA_SUCCESS);
    expect("over 48 KiB, no opt-in", launch(bounded, 1, 1, 32, 1, 49153), CUDA_ERROR_INVALID_VALUE);
    expect("opt-in to 227 KiB",
           cuFuncSetAttribute(bounded, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 232448), CUDA_SUCCESS);
    expect("227 KiB after the opt-in", launch(bounded, 1, 1, 32, 1, 232448), CUDA_SUCCESS);
    expect("opt-in past 227 KiB",
           cuFuncSetAttribute(bounded, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 232449),
           CUDA_ERROR_INVALID_VALUE);

    // TMA: a 2-D f16 tile of 64 x 64 over a 1024 x 512 row-major tensor, then one rule broken.
    static CUtensorMap map __attribute__((aligned(64)));
    CUdeviceptr base;
    cuMemAlloc(&base, 1 << 20);
    cuuint64_t dim[2] = {512, 1024}, strides[1] = {512 * 2};
    cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
#define TILED(address, d, s, b, swizzle)                                                          \
    cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, (void *)(address), d, s, b, elem, \
                           CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE, \
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    expect("tile", TILED(base, dim, strides, box, CU_TENSOR_MAP_SWIZZLE_128B), CUDA_SUCCESS);
    expect("misaligned address", TILED(base + 8, dim, strides, box, CU_TENSOR_MAP_SWIZZLE_128B),
           CUDA_ERROR_INVALID_VALUE);
    cuuint64_t odd[1] = {1000};
    expect("stride not 16 bytes", TILED(base, dim, odd, box, CU_TENSOR_MAP_SWIZZLE_128B),
           CUDA_ERROR_INVALID_VALUE);
    cuuint32_t wide[2] = {128, 64}, narrow[2] = {4, 64};
    expect("inner box past the swizzle", TILED(base, dim, strides, wide, CU_TENSOR_MAP_SWIZZLE_128B),
           CUDA_ERROR_INVALID_VALUE);
    expect("inner box of 8 bytes", TILED(base, dim, strides, narrow, CU_TENSOR_MAP_SWIZZLE_NONE),
           CUDA_ERROR_INVALID_VALUE);
    cuuint64_t empty[2] = {0, 1024};
    expect("empty dimension", TILED(base, empty, strides, box, CU_TENSOR_MAP_SWIZZLE_128B),
           CUDA_ERROR_INVALID_VALUE);

    if (refused != (unsigned long long)refusals) {
        printf("FAIL: the stand-in counted %llu refusals, the cases %d\n", refused, refusals);
        failures++;
    }
    printf("stand-in selftest: %s (%d failed; %d refusals)\n", failures ? "FAIL" : "ok", failures, refusals);
    return failures ? 1 : 0;
}
