/*
 * asyncoffload CUDA helpers, built with the system C compiler against no CUDA header:
 * the few driver entry points used are resolved from libcuda at run time.
 *
 * - ao_cuda_launch_wake: enqueue a host function on a stream that, once every earlier
 *   operation of the stream has finished, stamps a job's status words and writes 1 to an
 *   eventfd. It never touches Python or the GIL, so a busy event loop cannot delay it.
 * - ao_cuda_memcpy_batch: cuMemcpyBatchAsync (driver 12.8+) over arrays of descriptors,
 *   one call per transfer instead of one cudaMemcpyAsync per fragment.
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);

/* Layouts as in cuda.h (12.8+); stable ABI. */
typedef struct { int type; int id; } ao_CUmemLocation;
typedef struct {
    int srcAccessOrder;
    ao_CUmemLocation srcLocHint;
    ao_CUmemLocation dstLocHint;
    unsigned int flags;
} ao_CUmemcpyAttributes;

typedef CUresult (*launch_host_func_t)(CUstream, CUhostFn, void *);
typedef CUresult (*get_proc_address_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*memcpy_batch_t)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                   ao_CUmemcpyAttributes *, size_t *, size_t, size_t *,
                                   CUstream);

typedef CUresult (*host_register_t)(void *, size_t, unsigned int);
typedef CUresult (*host_unregister_t)(void *);
typedef CUresult (*host_get_device_pointer_t)(CUdeviceptr *, void *, unsigned int);

static launch_host_func_t p_launch_host_func;
static memcpy_batch_t p_memcpy_batch;
static host_register_t p_host_register;
static host_unregister_t p_host_unregister;
static host_get_device_pointer_t p_host_get_device_pointer;

/* Bit 0: host functions; bit 1: batched memcpy; bit 2: host registration through the
 * driver API (its errors, unlike the runtime's, do not linger). -1: no libcuda. */
int ao_cuda_init(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return -1;
    int features = 0;
    p_launch_host_func = (launch_host_func_t)dlsym(lib, "cuLaunchHostFunc");
    if (p_launch_host_func) features |= 1;
    p_host_register = (host_register_t)dlsym(lib, "cuMemHostRegister_v2");
    p_host_unregister = (host_unregister_t)dlsym(lib, "cuMemHostUnregister");
    p_host_get_device_pointer =
        (host_get_device_pointer_t)dlsym(lib, "cuMemHostGetDevicePointer_v2");
    if (p_host_register && p_host_unregister && p_host_get_device_pointer) features |= 4;
    get_proc_address_t gpa = (get_proc_address_t)dlsym(lib, "cuGetProcAddress_v2");
    if (gpa) {
        void *fn = NULL;
        int status = 0;
        /* Ask for the 12.8 ABI of cuMemcpyBatchAsync (the one with failIdx). */
        if (gpa("cuMemcpyBatchAsync", &fn, 12080, 0, &status) == 0 && fn != NULL) {
            p_memcpy_batch = (memcpy_batch_t)fn;
            features |= 2;
        }
    }
    return features;
}

typedef struct {
    int64_t done;        /* 0 until the host function ran, then 1 */
    int64_t finished_ns; /* CLOCK_MONOTONIC when it ran */
    int64_t fd;          /* eventfd to write, or -1 */
} ao_wake_slot;

static void ao_host_wake(void *arg) {
    ao_wake_slot *slot = (ao_wake_slot *)arg;
    int fd = (int)slot->fd; /* read before publishing: the slot may be freed after */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    slot->finished_ns = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    __atomic_store_n(&slot->done, 1, __ATOMIC_RELEASE);
    if (fd >= 0) {
        uint64_t one = 1;
        ssize_t r = write(fd, &one, sizeof one);
        (void)r;
    }
}

int ao_cuda_launch_wake(void *stream, void *slot) {
    if (p_launch_host_func == NULL) return -1;
    return p_launch_host_func((CUstream)stream, ao_host_wake, slot);
}

int64_t ao_cuda_slot_done(const void *slot) {
    return __atomic_load_n(&((const ao_wake_slot *)slot)->done, __ATOMIC_ACQUIRE);
}

/*
 * direction 0: device -> host (store), 1: host -> device (load). The descriptor arrays are
 * read during the call. src_access_order 1 reads the source in stream order, 3 in any
 * order (the caller guarantees nothing writes it meanwhile).
 */
int ao_cuda_memcpy_batch(void *stream, uint64_t *dsts, uint64_t *srcs, uint64_t *sizes,
                         size_t count, int direction, int device, int src_access_order,
                         unsigned int flags) {
    if (p_memcpy_batch == NULL) return -1;
    if (count == 0) return 0;
    ao_CUmemcpyAttributes attr;
    attr.srcAccessOrder = src_access_order; /* 1: STREAM, 3: ANY */
    ao_CUmemLocation dev = {1, device}; /* CU_MEM_LOCATION_TYPE_DEVICE */
    ao_CUmemLocation host = {2, 0};     /* CU_MEM_LOCATION_TYPE_HOST */
    attr.srcLocHint = direction == 0 ? dev : host;
    attr.dstLocHint = direction == 0 ? host : dev;
    attr.flags = flags; /* 1: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE */
    size_t attr_idx = 0;
    size_t fail_idx = 0;
    return p_memcpy_batch((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, (size_t *)sizes, count,
                          &attr, &attr_idx, 1, &fail_idx, (CUstream)stream);
}

/* Pin (portable, device-mapped) host memory; returns a CUresult. */
int ao_cuda_host_register(void *ptr, size_t size) {
    if (p_host_register == NULL) return -1;
    return p_host_register(ptr, size, 0x01 | 0x02); /* PORTABLE | DEVICEMAP */
}

int ao_cuda_host_unregister(void *ptr) {
    if (p_host_unregister == NULL) return -1;
    return p_host_unregister(ptr);
}

/* The device address of registered host memory (equal to ptr on most UVA systems). */
int ao_cuda_host_device_pointer(void *ptr, uint64_t *out) {
    if (p_host_get_device_pointer == NULL) return -1;
    CUdeviceptr d = 0;
    CUresult r = p_host_get_device_pointer(&d, ptr, 0);
    *out = (uint64_t)d;
    return r;
}
