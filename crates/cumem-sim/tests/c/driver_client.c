/*
 * A C client of the simulated driver, built and run by tests/c_program.rs.
 *
 * It includes no CUDA header: the prototypes below are written from cuda.h (12.8), the v1 ones
 * from its __CUDA_API_VERSION_INTERNAL section. It links against the simulator as libcuda.so,
 * allocates with plain and _v2 names, copies and memsets on the per-thread default stream,
 * looks functions up through cuGetProcAddress_v2 and checks every result code. Where §17 of the
 * driver reference records what an H100 answered, the expected code is that one. It exits 1 on
 * any mismatch and prints "all checks passed" otherwise.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_POINTER_ATTRIBUTE_SYNC_MEMOPS 6
#define CU_MEM_ATTACH_GLOBAL 1
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
/* _v2 names: 64-bit pointers and sizes. */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n);
/* Plain names: the v1 ABI (32-bit device pointers and sizes). */
CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
CUresult cuMemFree(CUdeviceptr_v1 dptr);
CUresult cuMemGetInfo(unsigned int *free, unsigned int *total);
CUresult cuMemAllocHost(void **pp, unsigned int bytesize);
CUresult cuMemFreeHost(void *p);
/* Per-thread default stream. */
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n);
CUresult cuMemsetD32Async_ptsz(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s);
CUresult cuStreamSynchronize_ptsz(CUstream s);
/* Lookup and pointer attributes. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags,
                             int *symbolStatus);
CUresult cuPointerSetAttribute(const void *value, int attribute, CUdeviceptr ptr);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);

typedef CUresult (*PFN_cuMemAlloc_v3020)(CUdeviceptr *, size_t);
typedef CUresult (*PFN_cuCtxCreate_v3020)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*PFN_cuCtxDestroy_v4000)(CUcontext);

static int failures = 0;

static void check(int line, const char *what, CUresult got, CUresult want) {
    if (got != want) {
        printf("MISMATCH line %d: %s returned %d, expected %d\n", line, what, got, want);
        failures++;
    }
}
#define CHECK(call, want) check(__LINE__, #call, (call), (want))
#define EXPECT(cond)                                                   \
    do {                                                               \
        if (!(cond)) {                                                 \
            printf("MISMATCH line %d: %s is false\n", __LINE__, #cond); \
            failures++;                                                \
        }                                                              \
    } while (0)

/* Creates its own context, allocates in it and destroys it with the allocation live (§17). */
static void own_context(CUdevice dev, CUcontext primary) {
    void *create_fn = NULL, *destroy_fn = NULL;
    int status = -1;
    /* cudaVersion 11000 asks for the 3.2 ABI of cuCtxCreate: (pctx, flags, dev). */
    CUresult r = cuGetProcAddress_v2("cuCtxCreate", &create_fn, 11000, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    CHECK(r, CUDA_SUCCESS);
    CHECK(cuGetProcAddress_v2("cuCtxDestroy", &destroy_fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status),
          CUDA_SUCCESS);
    if (create_fn == NULL || destroy_fn == NULL) {
        printf("MISMATCH: cuCtxCreate found but cuCtxDestroy not\n");
        failures++;
        return;
    }
    PFN_cuCtxCreate_v3020 create = (PFN_cuCtxCreate_v3020)create_fn;
    PFN_cuCtxDestroy_v4000 destroy = (PFN_cuCtxDestroy_v4000)destroy_fn;
    CUcontext ctx = NULL, current = NULL;
    CHECK(create(&ctx, 0, dev), CUDA_SUCCESS);
    CHECK(cuCtxGetCurrent(&current), CUDA_SUCCESS);
    EXPECT(ctx != NULL && current == ctx); /* the new context is current */
    CUdeviceptr p = 0;
    CHECK(cuMemAlloc_v2(&p, 1 << 16), CUDA_SUCCESS);
    CHECK(cuMemsetD8_v2(p, 0x11, 1 << 16), CUDA_SUCCESS);
    CHECK(destroy(ctx), CUDA_SUCCESS); /* with the allocation still live */
    CHECK(cuCtxSetCurrent(primary), CUDA_SUCCESS);
    CHECK(cuMemsetD8_v2(p, 0, 16), CUDA_ERROR_INVALID_VALUE); /* the allocation died with it */
    CHECK(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
    CHECK(destroy(ctx), CUDA_ERROR_CONTEXT_IS_DESTROYED);
    printf("own context: created, used, destroyed with a live allocation\n");
}

int main(void) {
    CUdevice dev = -1;
    CUcontext primary = NULL;
    CHECK(cuInit(0), CUDA_SUCCESS);
    CHECK(cuDeviceGet(&dev, 0), CUDA_SUCCESS);
    CHECK(cuDevicePrimaryCtxRetain(&primary, dev), CUDA_SUCCESS);
    CHECK(cuCtxSetCurrent(primary), CUDA_SUCCESS);

    /* _v2 and plain (v1) allocation. */
    enum { N = 4096 };
    CUdeviceptr d = 0;
    CHECK(cuMemAlloc_v2(&d, N), CUDA_SUCCESS);
    size_t free64 = 0, total64 = 0;
    CHECK(cuMemGetInfo_v2(&free64, &total64), CUDA_SUCCESS);
    unsigned int free32 = 0, total32 = 0;
    CHECK(cuMemGetInfo(&free32, &total32), CUDA_SUCCESS);
    EXPECT(total64 > 0xffffffffull ? total32 == 0xffffffffu : total32 == total64);
    CUdeviceptr_v1 d32 = 0x1234;
    /* A 32-bit pointer cannot name the simulator's device addresses (all above 4 GiB). */
    CHECK(cuMemAlloc(&d32, N), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(d32 == 0x1234);
    CHECK(cuMemAlloc(&d32, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree(0x1000), CUDA_ERROR_INVALID_VALUE);
    unsigned char *h = NULL;
    CHECK(cuMemAllocHost((void **)&h, N), CUDA_SUCCESS);

    /* Synchronous copies and memsets on the per-thread default stream. */
    unsigned char src[N], back[N];
    for (int i = 0; i < N; i++) src[i] = (unsigned char)(i * 13);
    CHECK(cuMemcpyHtoD_v2_ptds(d, src, N), CUDA_SUCCESS);
    CHECK(cuMemsetD8_v2_ptds(d + 100, 0xAB, 28), CUDA_SUCCESS);
    CHECK(cuMemcpyDtoH_v2_ptds(back, d, N), CUDA_SUCCESS);
    int same = 1;
    for (int i = 0; i < N; i++) same &= back[i] == ((i >= 100 && i < 128) ? 0xAB : src[i]);
    EXPECT(same);
    CHECK(cuMemsetD8_v2_ptds(d + N - 10, 0, 100), CUDA_ERROR_INVALID_VALUE); /* past the end */

    /* Asynchronous ones: NULL is the per-thread stream. */
    CHECK(cuMemsetD32Async_ptsz(d, 0xC0FFEE11u, N / 4, NULL), CUDA_SUCCESS);
    CHECK(cuMemcpyDtoHAsync_v2_ptsz(h, d, N, NULL), CUDA_SUCCESS);
    CHECK(cuStreamSynchronize_ptsz(NULL), CUDA_SUCCESS);
    unsigned int word = 0;
    memcpy(&word, h + 8, 4);
    EXPECT(word == 0xC0FFEE11u);
    CHECK(cuStreamSynchronize_ptsz(CU_STREAM_PER_THREAD), CUDA_SUCCESS);

    /* cuGetProcAddress_v2: the simulator's own functions, by version and stream mode. */
    void *fn = NULL;
    int status = -1;
    CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
    EXPECT(status == 0 && fn == (void *)&cuMemAlloc_v2);
    CUdeviceptr d2 = 0;
    CHECK(((PFN_cuMemAlloc_v3020)fn)(&d2, 512), CUDA_SUCCESS);
    CHECK(cuMemFree_v2(d2), CUDA_SUCCESS);
    CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 3000, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
    EXPECT(fn == (void *)&cuMemAlloc);
    CHECK(cuGetProcAddress_v2("cuMemcpyHtoD", &fn, 12080, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status),
          CUDA_SUCCESS);
    EXPECT(fn == (void *)&cuMemcpyHtoD_v2_ptds);
    CHECK(cuGetProcAddress_v2("cuMemAddressReserve", &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status),
          CUDA_SUCCESS);
    EXPECT(status == 0 && fn != NULL);
    CHECK(cuGetProcAddress_v2("cuCtxGetCacheConfig", &fn, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &status),
          CUDA_ERROR_NOT_FOUND);
    EXPECT(fn == NULL && status == 1);

    /* §17: cuPointerSetAttribute(SYNC_MEMOPS = 1) on managed memory succeeds and reads back 1. */
    CUdeviceptr m = 0;
    CHECK(cuMemAllocManaged(&m, N, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
    unsigned int one = 1, got = 0;
    CHECK(cuPointerSetAttribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, m), CUDA_SUCCESS);
    CHECK(cuPointerGetAttribute(&got, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, m), CUDA_SUCCESS);
    EXPECT(got == 1);

    own_context(dev, primary);

    CHECK(cuMemFree_v2(m), CUDA_SUCCESS);
    CHECK(cuMemFreeHost(h), CUDA_SUCCESS);
    CHECK(cuMemFree_v2(d), CUDA_SUCCESS);
    CHECK(cuDevicePrimaryCtxRelease_v2(dev), CUDA_SUCCESS);
    if (failures != 0) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
