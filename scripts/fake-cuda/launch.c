// The stand-in's modules, functions, launches and TMA descriptors. Nothing runs, but what the
// real driver refuses before a kernel runs is refused here too, with the driver's error code,
// and written to FAKE_CUDA_DIR/refused.txt (one line each, the first 1000): a grid or block
// outside the H200's limits, a zero-sized grid, more threads than the kernel's `.maxntid`, a
// `.reqntid` not met, a grid that is not a whole number of the kernel's clusters, more dynamic
// shared memory than the function was allowed or the multiprocessor has, a function not in its
// module, a TMA descriptor that breaks cuTensorMapEncode*'s rules (cuda.h). On a GPU each is a
// failed launch; on wgpu none exists, so without this they would be found in GPU time.
#include "fake_cuda.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// The H200's limits (compute capability 9.0), as cuDeviceGetAttribute answers them.
enum {
    MAX_BLOCK_THREADS = 1024,
    MAX_BLOCK_X = 1024,
    MAX_BLOCK_Y = 1024,
    MAX_BLOCK_Z = 64,
    MAX_GRID_Y = 65535,
    MAX_GRID_Z = 65535,
    SHARED_DEFAULT = 49152,  // without the function's opt-in
    SHARED_OPTIN = 232448,   // with it: 227 KiB per block
    MAX_CLUSTER_BLOCKS = 16, // non-portable limit; 8 without CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
};
#define MAX_GRID_X 2147483647u

// A kernel entry as its PTX declares it: the directives the driver checks a launch against.
struct entry {
    char *name;
    unsigned maxntid[3], reqntid[3], cluster[3]; // 0: not declared
};
struct module {
    char tag[48]; // the PTX file's name under FAKE_CUDA_DIR/ptx
    int count;
    struct entry *entries;
};
struct function {
    const struct module *module;
    const struct entry *entry;
    int max_dynamic_shared;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void refuse_line(const char *fmt, ...) {
    unsigned long long n = __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
    const char *dir = getenv("FAKE_CUDA_DIR");
    if (!dir || n > 1000) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/refused.txt", dir);
    pthread_mutex_lock(&lock);
    // Also on stderr, between what the process prints, to tell which case made it.
    FILE *files[2] = {fopen(path, "a"), stderr};
    for (int i = 0; i < 2; i++) {
        if (!files[i]) continue;
        va_list args;
        va_start(args, fmt);
        fprintf(files[i], "%sprocess %d: ", i ? "fake-cuda: " : "", (int)getpid());
        vfprintf(files[i], fmt, args);
        fputc('\n', files[i]);
        va_end(args);
    }
    if (files[0]) fclose(files[0]);
    pthread_mutex_unlock(&lock);
}

// `.maxntid 256, 1, 1` (one to three numbers) after an entry's parameters, before its body.
static void directive(const char *head, const char *end, const char *name, unsigned out[3]) {
    const char *at = head;
    size_t len = strlen(name);
    while ((at = strstr(at, name)) && at < end) {
        if (at[len] == ' ' || at[len] == '\t') {
            out[0] = out[1] = out[2] = 1;
            sscanf(at + len, " %u , %u , %u", &out[0], &out[1], &out[2]);
            return;
        }
        at += len;
    }
}

static void parse_entries(struct module *m, const char *ptx) {
    for (const char *at = ptx; (at = strstr(at, ".entry ")); at++) {
        const char *name = at + strlen(".entry ");
        const char *open = strchr(name, '(');
        const char *close = open ? strchr(open, ')') : NULL;
        const char *body = close ? strchr(close, '{') : NULL;
        if (!body) break;
        while (name < open && (*name == ' ' || *name == '\t')) name++;
        size_t len = (size_t)(open - name);
        while (len && (name[len - 1] == ' ' || name[len - 1] == '\t' || name[len - 1] == '\n')) len--;
        m->entries = realloc(m->entries, (size_t)(m->count + 1) * sizeof *m->entries);
        struct entry *e = &m->entries[m->count++];
        memset(e, 0, sizeof *e);
        e->name = strndup(name, len);
        directive(close, body, ".maxntid", e->maxntid);
        directive(close, body, ".reqntid", e->reqntid);
        directive(close, body, ".reqnctapercluster", e->cluster);
        at = body;
    }
}

// Modules: the PTX is kept (FAKE_CUDA_DIR/ptx/PID-N.ptx: one process's names do not overwrite
// another's) for ptxas to check; its entries' launch directives are read.
CUresult cuModuleLoadData(CUmodule *out, const void *image) {
    unsigned long long n = __atomic_fetch_add(&modules, 1, __ATOMIC_RELAXED);
    struct module *m = calloc(1, sizeof *m);
    snprintf(m->tag, sizeof m->tag, "%d-%05llu.ptx", (int)getpid(), n);
    const char *dir = getenv("FAKE_CUDA_DIR");
    if (dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/ptx/%s", dir, m->tag);
        FILE *f = fopen(path, "w");
        if (f) {
            fputs((const char *)image, f);
            fclose(f);
        }
    }
    parse_entries(m, (const char *)image);
    *out = (CUmodule)m;
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule handle) {
    // Functions keep pointing at their module's entries (a launch after an unload is the
    // caller's error, not checked here), so the module is kept.
    (void)handle;
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *out, CUmodule handle, const char *name) {
    const struct module *m = (const struct module *)handle;
    for (int i = 0; i < m->count; i++) {
        if (strcmp(m->entries[i].name, name) == 0) {
            struct function *f = calloc(1, sizeof *f);
            f->module = m;
            f->entry = &m->entries[i];
            f->max_dynamic_shared = SHARED_DEFAULT;
            *out = (CUfunction)f;
            return CUDA_SUCCESS;
        }
    }
    refuse_line("%s: cuModuleGetFunction: no entry '%s' in the module", m->tag, name);
    return CUDA_ERROR_NOT_FOUND;
}
CUresult cuFuncSetAttribute(CUfunction handle, CUfunction_attribute a, int v) {
    struct function *f = (struct function *)handle;
    if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        if (v < 0 || v > SHARED_OPTIN) {
            refuse_line("%s %s: cuFuncSetAttribute: %d bytes of dynamic shared memory, more than "
                        "the %d a block can have",
                        f->module->tag, f->entry->name, v, SHARED_OPTIN);
            return CUDA_ERROR_INVALID_VALUE;
        }
        f->max_dynamic_shared = v;
    }
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction handle) {
    const struct function *f = (const struct function *)handle;
    switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: {
        const unsigned *n = f->entry->maxntid;
        *v = n[0] ? (int)(n[0] * n[1] * n[2]) : MAX_BLOCK_THREADS;
        break;
    }
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = f->max_dynamic_shared; break;
    default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

// What the driver checks before it queues a kernel; the first reason to refuse, or NULL.
static const char *launch_refusal(const struct function *f, const unsigned grid[3],
                                  const unsigned block[3], unsigned shared, const unsigned cluster[3],
                                  char *why, size_t size) {
    const struct entry *e = f->entry;
    unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (!grid[0] || !grid[1] || !grid[2])
        snprintf(why, size, "a grid with a zero dimension");
    else if (grid[0] > MAX_GRID_X || grid[1] > MAX_GRID_Y || grid[2] > MAX_GRID_Z)
        snprintf(why, size, "a grid over the limits (%u, %d, %d)", MAX_GRID_X, MAX_GRID_Y, MAX_GRID_Z);
    else if (!block[0] || !block[1] || !block[2])
        snprintf(why, size, "a block with a zero dimension");
    else if (block[0] > MAX_BLOCK_X || block[1] > MAX_BLOCK_Y || block[2] > MAX_BLOCK_Z ||
             threads > MAX_BLOCK_THREADS)
        snprintf(why, size, "a block over the limits (%d, %d, %d; %d threads)", MAX_BLOCK_X,
                 MAX_BLOCK_Y, MAX_BLOCK_Z, MAX_BLOCK_THREADS);
    else if (e->maxntid[0] && threads > (unsigned long long)e->maxntid[0] * e->maxntid[1] * e->maxntid[2])
        snprintf(why, size, "%llu threads, more than the kernel's .maxntid %u, %u, %u", threads,
                 e->maxntid[0], e->maxntid[1], e->maxntid[2]);
    else if (e->reqntid[0] && (block[0] != e->reqntid[0] || block[1] != e->reqntid[1] ||
                               block[2] != e->reqntid[2]))
        snprintf(why, size, "a block other than the kernel's .reqntid %u, %u, %u", e->reqntid[0],
                 e->reqntid[1], e->reqntid[2]);
    else if (cluster[0] && (cluster[0] * cluster[1] * cluster[2] > MAX_CLUSTER_BLOCKS ||
                            grid[0] % cluster[0] || grid[1] % cluster[1] || grid[2] % cluster[2]))
        snprintf(why, size, "a grid that is not whole clusters of %u, %u, %u (at most %d blocks)",
                 cluster[0], cluster[1], cluster[2], MAX_CLUSTER_BLOCKS);
    else if (shared > (unsigned)f->max_dynamic_shared)
        snprintf(why, size, "%u bytes of dynamic shared memory, more than the function's %d "
                 "(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)", shared, f->max_dynamic_shared);
    else
        return NULL;
    return why;
}

static CUresult launch(const struct function *f, const unsigned grid[3], const unsigned block[3],
                       unsigned shared, const unsigned *cluster) {
    __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
    char why[256];
    const unsigned *c = cluster && cluster[0] ? cluster : f->entry->cluster;
    if (!launch_refusal(f, grid, block, shared, c, why, sizeof why)) return CUDA_SUCCESS;
    refuse_line("%s %s: launch refused: %s (grid %u, %u, %u; block %u, %u, %u; dynamic shared %u)",
                f->module->tag, f->entry->name, why, grid[0], grid[1], grid[2], block[0], block[1],
                block[2], shared);
    return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
    (void)s; (void)params; (void)extra;
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch((const struct function *)f, grid, block, shared, NULL);
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    (void)params; (void)extra;
    const unsigned grid[3] = {c->gridDimX, c->gridDimY, c->gridDimZ};
    const unsigned block[3] = {c->blockDimX, c->blockDimY, c->blockDimZ};
    unsigned cluster[3] = {0, 0, 0};
    for (unsigned i = 0; i < c->numAttrs; i++) {
        if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
            cluster[0] = c->attrs[i].value.clusterDim.x;
            cluster[1] = c->attrs[i].value.clusterDim.y;
            cluster[2] = c->attrs[i].value.clusterDim.z;
        }
    }
    return launch((const struct function *)f, grid, block, c->sharedMemBytes, cluster);
}

// Hopper's TMA descriptors (CubeCL's matmuls on sm_90): an opaque value the kernel would read,
// made only from what cuTensorMapEncodeTiled's and ...Im2col's rules in cuda.h allow.
static unsigned element_bytes(CUtensorMapDataType t) {
    switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    default: return 0; // the packed 4- and 6-bit types: not used by CubeCL 0.10, refused here
    }
}

// The rules common to both kinds of descriptor; `inner` is the bytes of the box's (or the
// im2col's channels') innermost dimension, which a swizzle's span bounds.
static const char *map_refusal(const CUtensorMap *map, CUtensorMapDataType t, cuuint32_t rank,
                               const void *address, const cuuint64_t *dim, const cuuint64_t *strides,
                               const cuuint32_t *elem, CUtensorMapInterleave il, CUtensorMapSwizzle sw,
                               unsigned long long inner, unsigned min_rank) {
    unsigned bytes = element_bytes(t);
    unsigned align = il == CU_TENSOR_MAP_INTERLEAVE_32B ? 32 : 16;
    if ((uintptr_t)map % 64) return "the descriptor's address is not 64-byte aligned";
    if (!bytes) return "a data type the stand-in does not know";
    if (rank < min_rank || rank > 5 || (il != CU_TENSOR_MAP_INTERLEAVE_NONE && rank < 3))
        return "a rank outside what the descriptor allows";
    if ((uintptr_t)address % align) return "a global address not 16-byte aligned (32 with 32B interleave)";
    for (cuuint32_t i = 0; i < rank; i++)
        if (!dim[i] || dim[i] > (1ull << 32)) return "a global dimension of 0 or over 2^32";
    for (cuuint32_t i = 0; i + 1 < rank; i++)
        if (strides[i] % align || strides[i] >= (1ull << 40))
            return "a global stride not a multiple of 16 bytes (32 with 32B interleave), or over 2^40";
    for (cuuint32_t i = 0; i < rank; i++)
        if (!elem[i] || elem[i] > 8) return "an element stride of 0 or over 8";
    if (il == CU_TENSOR_MAP_INTERLEAVE_32B && sw != CU_TENSOR_MAP_SWIZZLE_32B)
        return "32B interleave without 32B swizzle";
    if (il == CU_TENSOR_MAP_INTERLEAVE_NONE) {
        unsigned long long span = sw == CU_TENSOR_MAP_SWIZZLE_NONE ? 0
                                  : sw == CU_TENSOR_MAP_SWIZZLE_32B ? 32
                                  : sw == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : 128;
        if (span && inner > span) return "an inner box dimension wider than the swizzle's span";
    }
    return NULL;
}

// Dimensions as cuda.h orders them, innermost first: "[512, 64, 8]".
static void dims(char *out, size_t size, cuuint32_t rank, const cuuint64_t *d64, const cuuint32_t *d32) {
    size_t at = (size_t)snprintf(out, size, "[");
    for (cuuint32_t i = 0; i < rank && i < 5 && at < size; i++)
        at += (size_t)snprintf(out + at, size - at, "%s%llu", i ? ", " : "",
                               d64 ? (unsigned long long)d64[i] : (unsigned long long)d32[i]);
    if (at < size) snprintf(out + at, size - at, "]");
}

static CUresult encoded(CUtensorMap *map, const char *what, const char *why, CUtensorMapDataType t,
                        cuuint32_t rank, const cuuint64_t *dim, const cuuint32_t *box) {
    if (!why) {
        memset(map, 0, sizeof *map);
        return CUDA_SUCCESS;
    }
    char global[128], tile[128] = "-";
    dims(global, sizeof global, rank, dim, NULL);
    if (box) dims(tile, sizeof tile, rank, NULL, box);
    refuse_line("%s refused: %s (data type %d, global %s, box %s)", what, why, (int)t, global, tile);
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuTensorMapEncodeTiled(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t rank, void *p,
                                const cuuint64_t *dim, const cuuint64_t *strides, const cuuint32_t *box,
                                const cuuint32_t *elem, CUtensorMapInterleave il, CUtensorMapSwizzle sw,
                                CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
    (void)l2; (void)oob;
    const char *why = NULL;
    for (cuuint32_t i = 0; i < rank && i < 5; i++)
        if (!box[i] || box[i] > 256) why = "a box dimension of 0 or over 256";
    if (!why && rank && il == CU_TENSOR_MAP_INTERLEAVE_NONE && box[0] * element_bytes(t) % 16)
        why = "an inner box dimension not a multiple of 16 bytes";
    if (!why)
        why = map_refusal(m, t, rank, p, dim, strides, elem, il, sw,
                          rank ? (unsigned long long)box[0] * element_bytes(t) : 0, 1);
    return encoded(m, "cuTensorMapEncodeTiled", why, t, rank, dim, box);
}
static const char *im2col_refusal(const CUtensorMap *m, CUtensorMapDataType t, cuuint32_t rank,
                                  const void *p, const cuuint64_t *dim, const cuuint64_t *strides,
                                  cuuint32_t channels, cuuint32_t pixels, const cuuint32_t *elem,
                                  CUtensorMapInterleave il, CUtensorMapSwizzle sw) {
    if (!channels || channels > 256) return "channelsPerPixel of 0 or over 256";
    if (!pixels || pixels > 1024) return "pixelsPerColumn of 0 or over 1024";
    return map_refusal(m, t, rank, p, dim, strides, elem, il, sw,
                       (unsigned long long)channels * element_bytes(t), 3);
}
CUresult cuTensorMapEncodeIm2col(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t rank, void *p,
                                 const cuuint64_t *dim, const cuuint64_t *strides, const int *lower,
                                 const int *upper, cuuint32_t channels, cuuint32_t pixels,
                                 const cuuint32_t *elem, CUtensorMapInterleave il, CUtensorMapSwizzle sw,
                                 CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
    (void)lower; (void)upper; (void)l2; (void)oob;
    const char *why = im2col_refusal(m, t, rank, p, dim, strides, channels, pixels, elem, il, sw);
    return encoded(m, "cuTensorMapEncodeIm2col", why, t, rank, dim, NULL);
}
CUresult cuTensorMapEncodeIm2colWide(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t rank, void *p,
                                     const cuuint64_t *dim, const cuuint64_t *strides, int lower, int upper,
                                     cuuint32_t channels, cuuint32_t pixels, const cuuint32_t *elem,
                                     CUtensorMapInterleave il, CUtensorMapIm2ColWideMode mode,
                                     CUtensorMapSwizzle sw, CUtensorMapL2promotion l2,
                                     CUtensorMapFloatOOBfill oob) {
    (void)lower; (void)upper; (void)mode; (void)l2; (void)oob;
    const char *why = im2col_refusal(m, t, rank, p, dim, strides, channels, pixels, elem, il, sw);
    return encoded(m, "cuTensorMapEncodeIm2colWide", why, t, rank, dim, NULL);
}
