/*
 * asyncoffload CUDA helpers, built with the system C compiler against no CUDA header:
 * the few driver entry points used are resolved from libcuda at run time.
 *
 * - ao_cuda_launch_wake: enqueue a host function on a stream that, once every earlier
 *   operation of the stream has finished, stamps a job's status words and writes 1 to an
 *   eventfd. It never touches Python or the GIL, so a busy event loop cannot delay it.
 * - ao_cuda_memcpy_batch: cuMemcpyBatchAsync (driver 12.8+) over arrays of descriptors,
 *   one call per transfer instead of one cudaMemcpyAsync per fragment.
 * - ao_cuda_memcpy_each: the same descriptors, one cuMemcpyAsync each (any driver): the
 *   slower path a failed batch is retried on.
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

typedef CUresult (*memcpy_async_t)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*host_register_t)(void *, size_t, unsigned int);
typedef CUresult (*host_unregister_t)(void *);
typedef CUresult (*host_get_device_pointer_t)(CUdeviceptr *, void *, unsigned int);

static launch_host_func_t p_launch_host_func;
static memcpy_batch_t p_memcpy_batch;
static memcpy_async_t p_memcpy_async;
static host_register_t p_host_register;
static host_unregister_t p_host_unregister;
static host_get_device_pointer_t p_host_get_device_pointer;

/* Bit 0: host functions; bit 1: batched memcpy; bit 2: host registration through the
 * driver API (its errors, unlike the runtime's, do not linger); bit 4: one cuMemcpyAsync
 * per descriptor (bit 3 is the spinner's, set by ao_cuda_spinner_init). -1: no libcuda. */
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
    /* The unsuffixed name is the legacy-default-stream ABI, the one for explicit streams. */
    p_memcpy_async = (memcpy_async_t)dlsym(lib, "cuMemcpyAsync");
    if (p_memcpy_async) features |= 16;
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

static void ao_host_wake(void *arg) {
    /* slot: [0] state, [1] end ns, [2] fd, [3] host function ran (see the spinner). */
    int64_t *slot = (int64_t *)arg;
    int64_t fd = slot[2];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    int64_t expected = 0;
    int won = __atomic_compare_exchange_n(&slot[0], &expected, 2, 0, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE);
    if (won) {
        slot[1] = now;
        __atomic_store_n(&slot[0], 1, __ATOMIC_RELEASE);
    }
    /* Last touch of the slot: after this the owner may free it. */
    __atomic_store_n(&slot[3], 1, __ATOMIC_RELEASE);
    if (won && fd >= 0) {
        uint64_t one = 1;
        ssize_t r = write((int)fd, &one, sizeof one);
        (void)r;
    }
}

int ao_cuda_launch_wake(void *stream, void *slot) {
    if (p_launch_host_func == NULL) return -1;
    return p_launch_host_func((CUstream)stream, ao_host_wake, slot);
}

/* 1 once the end is published (by the host function or the spinner). */
int64_t ao_cuda_slot_done(const void *slot) {
    return __atomic_load_n(&((const int64_t *)slot)[0], __ATOMIC_ACQUIRE) == 1;
}

/* 1 once neither the host function nor the spinner will touch the slot again. */
int64_t ao_cuda_slot_released(const void *slot) {
    const int64_t *s = (const int64_t *)slot;
    return __atomic_load_n(&s[3], __ATOMIC_ACQUIRE) && __atomic_load_n(&s[4], __ATOMIC_ACQUIRE);
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

/*
 * One cuMemcpyAsync of sizes[i] bytes from srcs[i] to dsts[i] per descriptor, on `stream`
 * (unified addressing tells host from device memory). Stops at the first failure and
 * returns its CUresult; the copies queued before it stay queued.
 */
int ao_cuda_memcpy_each(void *stream, uint64_t *dsts, uint64_t *srcs, uint64_t *sizes,
                        size_t count) {
    if (p_memcpy_async == NULL) return -1;
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] == 0) continue;
        CUresult r = p_memcpy_async((CUdeviceptr)dsts[i], (CUdeviceptr)srcs[i],
                                    (size_t)sizes[i], (CUstream)stream);
        if (r != 0) return r;
    }
    return 0;
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

/*
 * The spinner: a native thread that, for jobs with an expected end time, sleeps until
 * just before it and then polls the job's CUDA event (cuEventQuery costs about a
 * microsecond) for a bounded time. A host function takes an interrupt and a driver
 * thread wake-up, tens of microseconds in a VM; the spinner sees the event within a few
 * microseconds, at a CPU cost bounded by its window. The host function stays queued as
 * the backstop: whichever sees the end first claims the slot, the other does nothing.
 *
 * Slot words: [0] state (0 pending, 2 being claimed, 1 done), [1] end time (ns),
 * [2] eventfd, [3] set to 1 by the host function when it has run, [4] set to 1 by the
 * spinner when it is done with the slot (1 from the start for jobs it never sees). The
 * slot may be freed only once [3] and [4] are both 1.
 */
#include <pthread.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

typedef CUresult (*event_query_t)(void *);
typedef CUresult (*ctx_set_current_t)(void *);
typedef CUresult (*ctx_get_current_t)(void **);

static event_query_t p_event_query;
static ctx_set_current_t p_ctx_set_current;
static ctx_get_current_t p_ctx_get_current;

typedef struct ao_spin_job {
    struct ao_spin_job *next;
    void *event;
    int64_t *slot;
    int64_t start_ns; /* begin polling */
    int64_t stop_ns;  /* give up (the host function will report it) */
} ao_spin_job;

static pthread_mutex_t spin_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t spin_cond = PTHREAD_COND_INITIALIZER;
static ao_spin_job *spin_head;
static int spin_started;
static void *spin_ctx;

static int64_t ao_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Claim the slot and publish the end: returns 1 if this caller won. */
static int ao_claim(int64_t *slot, int64_t now) {
    int64_t expected = 0;
    if (!__atomic_compare_exchange_n(&slot[0], &expected, 2, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return 0;
    slot[1] = now;
    __atomic_store_n(&slot[0], 1, __ATOMIC_RELEASE);
    return 1;
}

static void ao_signal(int64_t fd) {
    if (fd < 0) return;
    uint64_t one = 1;
    ssize_t r = write((int)fd, &one, sizeof one);
    (void)r;
}

static void *ao_spin_main(void *arg) {
    (void)arg;
    int ctx_set = 0;
#ifdef __linux__
    /* Wake at the asked time, not up to 50 us later (the default timer slack). */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
    pthread_mutex_lock(&spin_mutex);
    for (;;) {
        while (spin_head == NULL) pthread_cond_wait(&spin_cond, &spin_mutex);
        if (!ctx_set && spin_ctx != NULL && p_ctx_set_current) {
            p_ctx_set_current(spin_ctx);
            ctx_set = 1;
        }
        ao_spin_job *job = spin_head; /* jobs are queued in start order */
        int64_t now = ao_now_ns();
        if (job->start_ns > now) {
            struct timespec until;
            until.tv_sec = job->start_ns / 1000000000LL;
            until.tv_nsec = job->start_ns % 1000000000LL;
            pthread_mutex_unlock(&spin_mutex);
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL);
            pthread_mutex_lock(&spin_mutex);
            continue; /* the queue may have changed */
        }
        spin_head = job->next;
        pthread_mutex_unlock(&spin_mutex);
        for (;;) {
            if (__atomic_load_n(&job->slot[0], __ATOMIC_ACQUIRE) != 0) break;
            if (p_event_query(job->event) == 0) {
                int64_t fd = job->slot[2];
                if (ao_claim(job->slot, ao_now_ns())) ao_signal(fd);
                break;
            }
            if (ao_now_ns() > job->stop_ns) break;
        }
        __atomic_store_n(&job->slot[4], 1, __ATOMIC_RELEASE); /* last touch */
        free(job);
        pthread_mutex_lock(&spin_mutex);
    }
    return NULL;
}

/* Bit 3 of the features: the spinner is available. */
int ao_cuda_spinner_init(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return -1;
    p_event_query = (event_query_t)dlsym(lib, "cuEventQuery");
    p_ctx_set_current = (ctx_set_current_t)dlsym(lib, "cuCtxSetCurrent");
    p_ctx_get_current = (ctx_get_current_t)dlsym(lib, "cuCtxGetCurrent");
    if (!p_event_query || !p_ctx_set_current || !p_ctx_get_current) return -1;
    return 0;
}

/*
 * Poll `event` from start_ns to stop_ns (CLOCK_MONOTONIC) on the spinner thread. Call
 * from a thread whose current CUDA context owns the event. Jobs must be submitted in
 * start order (one stream's jobs are).
 */
int ao_cuda_spin_watch(void *event, int64_t *slot, int64_t start_ns, int64_t stop_ns) {
    if (p_event_query == NULL) return -1;
    ao_spin_job *job = (ao_spin_job *)malloc(sizeof *job);
    if (job == NULL) return -1;
    job->next = NULL;
    job->event = event;
    job->slot = slot;
    job->start_ns = start_ns;
    job->stop_ns = stop_ns;
    pthread_mutex_lock(&spin_mutex);
    if (spin_ctx == NULL) p_ctx_get_current(&spin_ctx);
    if (!spin_started) {
        pthread_t t;
        if (pthread_create(&t, NULL, ao_spin_main, NULL) != 0) {
            pthread_mutex_unlock(&spin_mutex);
            free(job);
            return -1;
        }
        pthread_detach(t);
        spin_started = 1;
    }
    ao_spin_job **p = &spin_head;
    while (*p != NULL && (*p)->start_ns <= start_ns) p = &(*p)->next;
    job->next = *p;
    *p = job;
    pthread_cond_signal(&spin_cond);
    pthread_mutex_unlock(&spin_mutex);
    return 0;
}
