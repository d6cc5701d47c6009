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

/*
 * The native copy path: one call orders a copy stream after the caller's stream, records
 * the job's timing events, launches a gather/scatter kernel (PTX below, JIT-compiled by
 * the driver once per context) and queues the completion host function. The kernel is
 * handed the transfer's ids as kernel parameters, so nothing has to outlive the call: no
 * pinned id buffer, no host-to-device copy of ids, no Python-side stream juggling.
 *
 * The kernel moves, for each (block j, ref r) of a launch, nbytes[r] bytes between
 *   kv   = kv_base[r] + gpu_id[j] * kv_stride[r]
 *   host = rows[slot_id[(skip + j) / bpc]] + host_off[r] + ((skip + j) % bpc) * page[r]
 * (refs: a device int64 table [5, nref]; rows: a device int64 table of host slot
 * addresses). Every address and size must be 16-byte aligned (the caller checks it once
 * per layout): it moves 16-byte vectors, four in flight per thread. Work units are
 * (block, ref, part) triples, parts splitting a page so that small jobs spread over
 * enough multiprocessors.
 */
#define AO_PARAM_IDS 3840 /* bytes of int32 ids per launch */
#define AO_MAX_DEVICES 64

static const char ao_copy_ptx[] =
    ".version 7.4\n"
    ".target sm_80\n"
    ".address_size 64\n"
    ".visible .entry ao_copy_pages(\n"
    "  .param .u64 p_refs, .param .u64 p_rows, .param .u32 p_nref, .param .u32 p_nblocks,\n"
    "  .param .u32 p_skip, .param .u32 p_bpc, .param .u32 p_store, .param .u32 p_parts,\n"
    "  .param .align 8 .b8 p_ids[3840])\n"
    "{\n"
    "  .reg .pred %p<12>;\n"
    "  .reg .b32 %r<40>;\n"
    "  .reg .b64 %rd<64>;\n"
    "  .reg .b32 %v<16>;\n"
    "  ld.param.u64 %rd1, [p_refs];\n"
    "  ld.param.u64 %rd2, [p_rows];\n"
    "  ld.param.u32 %r1, [p_nref];\n"
    "  ld.param.u32 %r2, [p_nblocks];\n"
    "  ld.param.u32 %r3, [p_skip];\n"
    "  ld.param.u32 %r4, [p_bpc];\n"
    "  ld.param.u32 %r5, [p_store];\n"
    "  ld.param.u32 %r6, [p_parts];\n"
    "  mov.u64 %rd3, p_ids;\n"
    "  mul.lo.u32 %r7, %r2, %r1;\n"   /* items */
    "  mul.lo.u32 %r8, %r7, %r6;\n"   /* units */
    "  mov.u32 %r9, %ctaid.x;\n"
    "  mov.u32 %r10, %nctaid.x;\n"
    "  mov.u32 %r11, %tid.x;\n"
    "  mov.u32 %r12, %ntid.x;\n"
    "  setp.ne.u32 %p9, %r5, 0;\n"    /* store */
    "  mul.wide.u32 %rd40, %r12, 16;\n" /* bytes per thread-block pass of one vector */
    "  mul.wide.u32 %rd41, %r11, 16;\n" /* this thread's first byte */
    "  shl.b64 %rd42, %rd40, 2;\n"      /* step: four vectors per thread */
    "UNIT:\n"
    "  setp.ge.u32 %p1, %r9, %r8;\n"
    "  @%p1 bra DONE;\n"
    "  div.u32 %r13, %r9, %r6;\n"     /* item */
    "  rem.u32 %r14, %r9, %r6;\n"     /* part */
    "  div.u32 %r15, %r13, %r1;\n"    /* j */
    "  rem.u32 %r16, %r13, %r1;\n"    /* r */
    "  mul.wide.u32 %rd4, %r15, 4;\n"
    "  add.u64 %rd5, %rd3, %rd4;\n"
    "  ld.param.s32 %r17, [%rd5];\n"  /* gpu id */
    "  add.u32 %r18, %r3, %r15;\n"    /* p = skip + j */
    "  div.u32 %r19, %r18, %r4;\n"    /* pos */
    "  rem.u32 %r20, %r18, %r4;\n"    /* sub */
    "  add.u32 %r21, %r2, %r19;\n"
    "  mul.wide.u32 %rd6, %r21, 4;\n"
    "  add.u64 %rd7, %rd3, %rd6;\n"
    "  ld.param.s32 %r22, [%rd7];\n"  /* slot id */
    "  mul.wide.s32 %rd8, %r22, 8;\n"
    "  add.u64 %rd9, %rd2, %rd8;\n"
    "  ld.global.u64 %rd10, [%rd9];\n" /* row address */
    "  mul.wide.u32 %rd11, %r16, 8;\n"
    "  add.u64 %rd12, %rd1, %rd11;\n"
    "  mul.wide.u32 %rd13, %r1, 8;\n" /* table row stride */
    "  ld.global.u64 %rd14, [%rd12];\n" /* kv_base */
    "  add.u64 %rd15, %rd12, %rd13;\n"
    "  ld.global.u64 %rd16, [%rd15];\n" /* kv_stride */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd17, [%rd15];\n" /* host_off */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd18, [%rd15];\n" /* page */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd19, [%rd15];\n" /* nbytes */
    "  cvt.s64.s32 %rd20, %r17;\n"
    "  mad.lo.s64 %rd21, %rd20, %rd16, %rd14;\n" /* kv */
    "  cvt.u64.u32 %rd22, %r20;\n"
    "  mad.lo.s64 %rd23, %rd22, %rd18, %rd17;\n"
    "  add.u64 %rd24, %rd10, %rd23;\n" /* host */
    "  selp.b64 %rd25, %rd21, %rd24, %p9;\n" /* src */
    "  selp.b64 %rd26, %rd24, %rd21, %p9;\n" /* dst */
    /* part range: chunk = ceil(nbytes / (parts * 16)) * 16 */
    "  mul.wide.u32 %rd27, %r6, 16;\n"
    "  add.u64 %rd28, %rd19, %rd27;\n"
    "  sub.u64 %rd28, %rd28, 1;\n"
    "  div.u64 %rd28, %rd28, %rd27;\n"
    "  shl.b64 %rd28, %rd28, 4;\n"
    "  cvt.u64.u32 %rd29, %r14;\n"
    "  mul.lo.u64 %rd30, %rd29, %rd28;\n" /* beg */
    "  add.u64 %rd31, %rd30, %rd28;\n"
    "  min.u64 %rd31, %rd31, %rd19;\n"   /* end */
    "  add.u64 %rd32, %rd30, %rd41;\n"   /* off */
    "VEC:\n"
    "  setp.ge.u64 %p2, %rd32, %rd31;\n"
    "  @%p2 bra NEXT;\n"
    "  add.u64 %rd33, %rd32, %rd40;\n"
    "  add.u64 %rd34, %rd33, %rd40;\n"
    "  add.u64 %rd35, %rd34, %rd40;\n"
    "  setp.lt.u64 %p3, %rd33, %rd31;\n"
    "  setp.lt.u64 %p4, %rd34, %rd31;\n"
    "  setp.lt.u64 %p5, %rd35, %rd31;\n"
    "  add.u64 %rd43, %rd25, %rd32;\n"
    "  add.u64 %rd44, %rd25, %rd33;\n"
    "  add.u64 %rd45, %rd25, %rd34;\n"
    "  add.u64 %rd46, %rd25, %rd35;\n"
    "  ld.global.v4.u32 {%v0, %v1, %v2, %v3}, [%rd43];\n"
    "  @%p3 ld.global.v4.u32 {%v4, %v5, %v6, %v7}, [%rd44];\n"
    "  @%p4 ld.global.v4.u32 {%v8, %v9, %v10, %v11}, [%rd45];\n"
    "  @%p5 ld.global.v4.u32 {%v12, %v13, %v14, %v15}, [%rd46];\n"
    "  add.u64 %rd47, %rd26, %rd32;\n"
    "  add.u64 %rd48, %rd26, %rd33;\n"
    "  add.u64 %rd49, %rd26, %rd34;\n"
    "  add.u64 %rd50, %rd26, %rd35;\n"
    "  st.global.v4.u32 [%rd47], {%v0, %v1, %v2, %v3};\n"
    "  @%p3 st.global.v4.u32 [%rd48], {%v4, %v5, %v6, %v7};\n"
    "  @%p4 st.global.v4.u32 [%rd49], {%v8, %v9, %v10, %v11};\n"
    "  @%p5 st.global.v4.u32 [%rd50], {%v12, %v13, %v14, %v15};\n"
    "  add.u64 %rd32, %rd32, %rd42;\n"
    "  bra VEC;\n"
    "NEXT:\n"
    "  add.u32 %r9, %r9, %r10;\n"
    "  bra UNIT;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n"
    ".visible .entry ao_copy_pages_l2(\n"
    "  .param .u64 p_refs, .param .u64 p_rows, .param .u32 p_nref, .param .u32 p_nblocks,\n"
    "  .param .u32 p_skip, .param .u32 p_bpc, .param .u32 p_store, .param .u32 p_parts,\n"
    "  .param .align 8 .b8 p_ids[3840])\n"
    "{\n"
    "  .reg .pred %p<12>;\n"
    "  .reg .b32 %r<40>;\n"
    "  .reg .b64 %rd<64>;\n"
    "  .reg .b32 %v<16>;\n"
    "  ld.param.u64 %rd1, [p_refs];\n"
    "  ld.param.u64 %rd2, [p_rows];\n"
    "  ld.param.u32 %r1, [p_nref];\n"
    "  ld.param.u32 %r2, [p_nblocks];\n"
    "  ld.param.u32 %r3, [p_skip];\n"
    "  ld.param.u32 %r4, [p_bpc];\n"
    "  ld.param.u32 %r5, [p_store];\n"
    "  ld.param.u32 %r6, [p_parts];\n"
    "  mov.u64 %rd3, p_ids;\n"
    "  mul.lo.u32 %r7, %r2, %r1;\n"   /* items */
    "  mul.lo.u32 %r8, %r7, %r6;\n"   /* units */
    "  mov.u32 %r9, %ctaid.x;\n"
    "  mov.u32 %r10, %nctaid.x;\n"
    "  mov.u32 %r11, %tid.x;\n"
    "  mov.u32 %r12, %ntid.x;\n"
    "  setp.ne.u32 %p9, %r5, 0;\n"    /* store */
    "  mul.wide.u32 %rd40, %r12, 16;\n" /* bytes per thread-block pass of one vector */
    "  mul.wide.u32 %rd41, %r11, 16;\n" /* this thread's first byte */
    "  shl.b64 %rd42, %rd40, 2;\n"      /* step: four vectors per thread */
    "UNIT:\n"
    "  setp.ge.u32 %p1, %r9, %r8;\n"
    "  @%p1 bra DONE;\n"
    "  div.u32 %r13, %r9, %r6;\n"     /* item */
    "  rem.u32 %r14, %r9, %r6;\n"     /* part */
    "  div.u32 %r15, %r13, %r1;\n"    /* j */
    "  rem.u32 %r16, %r13, %r1;\n"    /* r */
    "  mul.wide.u32 %rd4, %r15, 4;\n"
    "  add.u64 %rd5, %rd3, %rd4;\n"
    "  ld.param.s32 %r17, [%rd5];\n"  /* gpu id */
    "  add.u32 %r18, %r3, %r15;\n"    /* p = skip + j */
    "  div.u32 %r19, %r18, %r4;\n"    /* pos */
    "  rem.u32 %r20, %r18, %r4;\n"    /* sub */
    "  add.u32 %r21, %r2, %r19;\n"
    "  mul.wide.u32 %rd6, %r21, 4;\n"
    "  add.u64 %rd7, %rd3, %rd6;\n"
    "  ld.param.s32 %r22, [%rd7];\n"  /* slot id */
    "  mul.wide.s32 %rd8, %r22, 8;\n"
    "  add.u64 %rd9, %rd2, %rd8;\n"
    "  ld.global.u64 %rd10, [%rd9];\n" /* row address */
    "  mul.wide.u32 %rd11, %r16, 8;\n"
    "  add.u64 %rd12, %rd1, %rd11;\n"
    "  mul.wide.u32 %rd13, %r1, 8;\n" /* table row stride */
    "  ld.global.u64 %rd14, [%rd12];\n" /* kv_base */
    "  add.u64 %rd15, %rd12, %rd13;\n"
    "  ld.global.u64 %rd16, [%rd15];\n" /* kv_stride */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd17, [%rd15];\n" /* host_off */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd18, [%rd15];\n" /* page */
    "  add.u64 %rd15, %rd15, %rd13;\n"
    "  ld.global.u64 %rd19, [%rd15];\n" /* nbytes */
    "  cvt.s64.s32 %rd20, %r17;\n"
    "  mad.lo.s64 %rd21, %rd20, %rd16, %rd14;\n" /* kv */
    "  cvt.u64.u32 %rd22, %r20;\n"
    "  mad.lo.s64 %rd23, %rd22, %rd18, %rd17;\n"
    "  add.u64 %rd24, %rd10, %rd23;\n" /* host */
    "  selp.b64 %rd25, %rd21, %rd24, %p9;\n" /* src */
    "  selp.b64 %rd26, %rd24, %rd21, %p9;\n" /* dst */
    /* part range: chunk = ceil(nbytes / (parts * 16)) * 16 */
    "  mul.wide.u32 %rd27, %r6, 16;\n"
    "  add.u64 %rd28, %rd19, %rd27;\n"
    "  sub.u64 %rd28, %rd28, 1;\n"
    "  div.u64 %rd28, %rd28, %rd27;\n"
    "  shl.b64 %rd28, %rd28, 4;\n"
    "  cvt.u64.u32 %rd29, %r14;\n"
    "  mul.lo.u64 %rd30, %rd29, %rd28;\n" /* beg */
    "  add.u64 %rd31, %rd30, %rd28;\n"
    "  min.u64 %rd31, %rd31, %rd19;\n"   /* end */
    "  add.u64 %rd32, %rd30, %rd41;\n"   /* off */
    "VEC:\n"
    "  setp.ge.u64 %p2, %rd32, %rd31;\n"
    "  @%p2 bra NEXT;\n"
    "  add.u64 %rd33, %rd32, %rd40;\n"
    "  add.u64 %rd34, %rd33, %rd40;\n"
    "  add.u64 %rd35, %rd34, %rd40;\n"
    "  setp.lt.u64 %p3, %rd33, %rd31;\n"
    "  setp.lt.u64 %p4, %rd34, %rd31;\n"
    "  setp.lt.u64 %p5, %rd35, %rd31;\n"
    "  add.u64 %rd43, %rd25, %rd32;\n"
    "  add.u64 %rd44, %rd25, %rd33;\n"
    "  add.u64 %rd45, %rd25, %rd34;\n"
    "  add.u64 %rd46, %rd25, %rd35;\n"
    "  ld.global.L2::256B.v4.u32 {%v0, %v1, %v2, %v3}, [%rd43];\n"
    "  @%p3 ld.global.L2::256B.v4.u32 {%v4, %v5, %v6, %v7}, [%rd44];\n"
    "  @%p4 ld.global.L2::256B.v4.u32 {%v8, %v9, %v10, %v11}, [%rd45];\n"
    "  @%p5 ld.global.L2::256B.v4.u32 {%v12, %v13, %v14, %v15}, [%rd46];\n"
    "  add.u64 %rd47, %rd26, %rd32;\n"
    "  add.u64 %rd48, %rd26, %rd33;\n"
    "  add.u64 %rd49, %rd26, %rd34;\n"
    "  add.u64 %rd50, %rd26, %rd35;\n"
    "  st.global.v4.u32 [%rd47], {%v0, %v1, %v2, %v3};\n"
    "  @%p3 st.global.v4.u32 [%rd48], {%v4, %v5, %v6, %v7};\n"
    "  @%p4 st.global.v4.u32 [%rd49], {%v8, %v9, %v10, %v11};\n"
    "  @%p5 st.global.v4.u32 [%rd50], {%v12, %v13, %v14, %v15};\n"
    "  add.u64 %rd32, %rd32, %rd42;\n"
    "  bra VEC;\n"
    "NEXT:\n"
    "  add.u32 %r9, %r9, %r10;\n"
    "  bra UNIT;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n";

typedef CUresult (*module_load_data_t)(void **, const void *);
typedef CUresult (*module_get_function_t)(void **, void *, const char *);
typedef CUresult (*launch_kernel_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*event_create_t)(void **, unsigned);
typedef CUresult (*event_record_t)(void *, CUstream);
typedef CUresult (*event_destroy_t)(void *);
typedef CUresult (*event_sync_t)(void *);
typedef CUresult (*event_elapsed_t)(float *, void *, void *);
typedef CUresult (*stream_wait_event_t)(CUstream, void *, unsigned);

static module_load_data_t p_module_load_data;
static module_get_function_t p_module_get_function;
static launch_kernel_t p_launch_kernel;
static event_create_t p_event_create;
static event_record_t p_event_record;
static event_destroy_t p_event_destroy;
static event_sync_t p_event_sync;
static event_elapsed_t p_event_elapsed;
static stream_wait_event_t p_stream_wait_event;
static void *copy_fn[AO_MAX_DEVICES];
static pthread_mutex_t copy_mutex = PTHREAD_MUTEX_INITIALIZER;

/* Resolve the entry points and load the copy kernel into the current context (that of
 * `device`, made current by the caller). 0 on success, else a CUresult or -1. */
int ao_cuda_copy_init(int device, int variant) {
    if (device < 0 || device >= AO_MAX_DEVICES) return -1;
    pthread_mutex_lock(&copy_mutex);
    int rc = 0;
    if (copy_fn[device] != NULL) goto out;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) { rc = -1; goto out; }
    p_module_load_data = (module_load_data_t)dlsym(lib, "cuModuleLoadData");
    p_module_get_function = (module_get_function_t)dlsym(lib, "cuModuleGetFunction");
    p_launch_kernel = (launch_kernel_t)dlsym(lib, "cuLaunchKernel");
    p_event_create = (event_create_t)dlsym(lib, "cuEventCreate");
    p_event_record = (event_record_t)dlsym(lib, "cuEventRecord");
    p_event_destroy = (event_destroy_t)dlsym(lib, "cuEventDestroy_v2");
    p_event_sync = (event_sync_t)dlsym(lib, "cuEventSynchronize");
    p_event_elapsed = (event_elapsed_t)dlsym(lib, "cuEventElapsedTime");
    p_stream_wait_event = (stream_wait_event_t)dlsym(lib, "cuStreamWaitEvent");
    if (!p_event_query) p_event_query = (event_query_t)dlsym(lib, "cuEventQuery");
    if (!p_module_load_data || !p_module_get_function || !p_launch_kernel || !p_event_create ||
        !p_event_record || !p_event_destroy || !p_event_sync || !p_event_elapsed ||
        !p_stream_wait_event || !p_event_query) {
        rc = -1;
        goto out;
    }
    void *module = NULL;
    rc = p_module_load_data(&module, ao_copy_ptx);
    if (rc != 0) goto out;
    void *fn = NULL;
    /* variant 1: the kernel with an L2 prefetch hint (settings' native_kernel "l2"). */
    rc = p_module_get_function(&fn, module, variant == 1 ? "ao_copy_pages_l2" : "ao_copy_pages");
    if (rc != 0) goto out;
    copy_fn[device] = fn;
out:
    pthread_mutex_unlock(&copy_mutex);
    return rc;
}

/* A job's timing events: out[0] start, out[1] end (timing enabled). */
int ao_cuda_event_pair(uint64_t *out) {
    void *a = NULL, *b = NULL;
    CUresult rc = p_event_create(&a, 0);
    if (rc != 0) return rc;
    rc = p_event_create(&b, 0);
    if (rc != 0) {
        p_event_destroy(a);
        return rc;
    }
    out[0] = (uint64_t)(uintptr_t)a;
    out[1] = (uint64_t)(uintptr_t)b;
    return 0;
}

/* An event without timing (the caller-stream fence). */
int ao_cuda_event_plain(uint64_t *out) {
    void *a = NULL;
    CUresult rc = p_event_create(&a, 2); /* CU_EVENT_DISABLE_TIMING */
    out[0] = (uint64_t)(uintptr_t)a;
    return rc;
}

int ao_cuda_event_query(void *event) { return p_event_query(event); }

/*
 * Poll `event` on the calling thread until it has completed (0) or failed (its CUresult),
 * or until `budget_ns` has passed without either (CUDA_ERROR_NOT_READY, 600): the wait
 * on a copy short enough that a wake-up round trip would cost more than the copy.
 */
static int ao_cuda_event_wait(void *event, int64_t budget_ns) {
    int64_t stop = ao_now_ns() + budget_ns;
    for (;;) {
        CUresult rc = p_event_query(event);
        if (rc != 600) return (int)rc;
        if (ao_now_ns() > stop) return 600;
    }
}

/*
 * After `event` (recorded on another stream), the completion host function of `slot` on
 * `stream`: the wake-up of a job that ran elsewhere, ordered on `stream` as if it had run
 * there (later work of `stream` waits for it too).
 */
int ao_cuda_wake_after(void *stream, void *event, void *slot) {
    CUresult rc = p_stream_wait_event((CUstream)stream, event, 0);
    if (rc != 0) return rc;
    return ao_cuda_launch_wake(stream, slot);
}
int ao_cuda_event_sync(void *event) { return p_event_sync(event); }
int ao_cuda_event_destroy(void *event) { return p_event_destroy(event); }
int ao_cuda_event_elapsed(void *start, void *end, float *ms) {
    return p_event_elapsed(ms, start, end);
}

/*
 * One transfer of one group on `stream`: wait for `caller` (through the event `fence`,
 * unless it is the same stream), record `start`, launch the kernel over blocks
 * gpu_ids[0 .. n) (slot ids slot_ids[0 ..)), as many launches as the parameter space
 * needs, record `end`; then, if `slot`, the completion host function (and the spinner
 * over [spin_start, spin_stop) when spin_stop > 0). `programs`: the most thread blocks a
 * launch uses. Returns 0 or the first failing CUresult (what was queued before it stays
 * queued).
 */
static int copy_launch(int device, void *caller, void *stream, void *fence, void *start,
                        void *end, uint64_t refs, uint64_t rows, int nref, int n,
                        const int64_t *gpu_ids, const int64_t *slot_ids, int skip, int bpc,
                        int store, int programs, int64_t page_bytes, void *slot,
                        int64_t spin_start, int64_t spin_stop) {
    CUresult rc = -1;
    if (device < 0 || device >= AO_MAX_DEVICES || copy_fn[device] == NULL) goto fail;
    if (caller != stream) {
        rc = p_event_record(fence, (CUstream)caller);
        if (rc != 0) goto fail;
        rc = p_stream_wait_event((CUstream)stream, fence, 0);
        if (rc != 0) goto fail;
    }
    if (start != NULL && (rc = p_event_record(start, (CUstream)stream)) != 0) goto fail;
    struct {
        uint64_t refs, rows;
        uint32_t nref, nblocks, skip, bpc, store, parts;
        int32_t ids[AO_PARAM_IDS / 4];
    } prm;
    void *args[9] = {&prm.refs, &prm.rows, &prm.nref, &prm.nblocks, &prm.skip,
                     &prm.bpc,  &prm.store, &prm.parts, prm.ids};
    prm.refs = refs;
    prm.rows = rows;
    prm.nref = (uint32_t)nref;
    prm.bpc = (uint32_t)bpc;
    prm.store = (uint32_t)(store != 0);
    /* Blocks per launch: ids of m blocks and of their at most m/bpc + 2 slots fit. */
    int cap = (AO_PARAM_IDS / 4 - 2) * bpc / (bpc + 1);
    if (cap < 1) cap = 1;
    int j0 = 0;
    while (j0 < n) {
        int m = n - j0 < cap ? n - j0 : cap;
        int p0 = (skip + j0) / bpc;
        int p1 = (skip + j0 + m - 1) / bpc;
        for (int j = 0; j < m; j++) prm.ids[j] = (int32_t)gpu_ids[j0 + j];
        for (int p = p0; p <= p1; p++) prm.ids[m + p - p0] = (int32_t)slot_ids[p];
        prm.nblocks = (uint32_t)m;
        prm.skip = (uint32_t)(skip + j0 - p0 * bpc);
        long items = (long)m * nref;
        /* Split pages so that a launch has at least `programs` units, 4 KiB a part at
         * least (one pass of 256 threads x 16 B). */
        long parts = (programs + items - 1) / items;
        long max_parts = page_bytes / 4096;
        if (parts > max_parts) parts = max_parts;
        if (parts < 1) parts = 1;
        prm.parts = (uint32_t)parts;
        long units = items * parts;
        unsigned grid = (unsigned)(units < programs ? units : programs);
        rc = p_launch_kernel(copy_fn[device], grid, 1, 1, 256, 1, 1, 0, (CUstream)stream, args,
                             NULL);
        if (rc != 0) goto fail;
        j0 += m;
    }
    if (end != NULL && (rc = p_event_record(end, (CUstream)stream)) != 0) goto fail;
    if (slot != NULL) {
        rc = ao_cuda_launch_wake(stream, slot);
        if (rc != 0) goto fail;
        if (spin_stop > 0 && end != NULL) {
            int64_t *s = (int64_t *)slot;
            s[4] = 0;
            if (ao_cuda_spin_watch(end, s, spin_start, spin_stop) != 0) s[4] = 1;
        }
    }
    return 0;
fail:
    /* No host function was queued with the slot: nothing native holds it. */
    if (slot != NULL) __atomic_store_n(&((int64_t *)slot)[3], 1, __ATOMIC_RELEASE);
    return rc;
}

/*
 * A copy the caller waits for at once: ao_cuda_copy_launch of one group on `stream`
 * itself (no fence, no timing events, no host function) with `end` recorded after it,
 * then the wait of ao_cuda_event_wait on `end` for up to `budget_ns`. times[0]: when the
 * launch began, times[1]: when the wait saw the end (0 if it did not), times[2]: 1 once
 * everything was queued (0: the launch failed, and the result is its CUresult). Returns
 * 0 (ended), CUDA_ERROR_NOT_READY (600: queued, still running) or a failing CUresult.
 */
static int copy_wait(int device, void *stream, void *end, uint64_t refs, uint64_t rows,
                      int nref, int n, const int64_t *gpu_ids, const int64_t *slot_ids,
                      int store, int programs, int64_t page_bytes, int64_t budget_ns,
                      int64_t *times) {
    times[0] = ao_now_ns();
    times[1] = 0;
    times[2] = 0;
    int rc = copy_launch(device, stream, stream, NULL, NULL, end, refs, rows, nref, n,
                                 gpu_ids, slot_ids, 0, 1, store, programs, page_bytes, NULL, 0,
                                 0);
    if (rc != 0) return rc;
    times[2] = 1;
    rc = ao_cuda_event_wait(end, budget_ns);
    if (rc == 0) times[1] = ao_now_ns();
    return rc;
}

/*
 * The staged copy of one group whose slots the job fills whole (dense slots, no partial
 * first or last slot), in one call: per chunk of `rows` slots, double-buffered across
 * the copy stream (DMAs between host slots and staging rows, consecutive slots of one
 * pinned chunk merged into one descriptor) and the kernel stream (the copy kernel between
 * the KV pages and staging rows, which it finds through the device table stage_rows[buf]
 * with slot ids 0 .. rows-1). Buffer b is refilled only after the work that last read it
 * (done[b], across jobs too: used[b] says whether done[b] was recorded). The job starts
 * after the caller's stream on both streams and ends on the copy stream (`join` carries
 * the kernel stream's last work there), where `end` and the host function go. `n`: the
 * blocks, bpc to a slot, so n / bpc slots. `state`:
 * [next buffer, used 0, used 1], updated. Returns 0 or the first failing CUresult.
 */
static int staged_launch(int device, void *caller, void *stream, void *kstream, void *fence,
                          void *join, void *start, void *end, uint64_t refs, int nref, int n,
                          const int64_t *gpu_ids, const int64_t *slot_ids, int store,
                          int bpc, int programs, int64_t page_bytes, const int64_t *host_rows,
                          int64_t rows_per_chunk, int64_t slot_bytes, int rows,
                          const uint64_t *stage_base, const uint64_t *stage_rows,
                          int64_t row_stride, int *state, void **ready, void **done,
                          int use_batch, void *slot, int64_t spin_start, int64_t spin_stop) {
    CUresult rc = -1;
    uint64_t *src = NULL, *dst = NULL, *size = NULL;
    int64_t *pos = NULL;
    if (device < 0 || device >= AO_MAX_DEVICES || copy_fn[device] == NULL) goto fail;
    src = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)rows);
    dst = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)rows);
    size = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)rows);
    pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)rows);
    if (!src || !dst || !size || !pos) goto fail;
    for (int i = 0; i < rows; i++) pos[i] = i;
    rc = p_event_record(fence, (CUstream)caller);
    if (rc != 0) goto fail;
    if ((rc = p_stream_wait_event((CUstream)stream, fence, 0)) != 0) goto fail;
    if ((rc = p_stream_wait_event((CUstream)kstream, fence, 0)) != 0) goto fail;
    if (start != NULL && (rc = p_event_record(start, (CUstream)stream)) != 0) goto fail;
    int nslots = n / bpc; /* whole slots: n is a multiple of bpc */
    for (int lo = 0; lo < nslots; lo += rows) {
        int m = nslots - lo < rows ? nslots - lo : rows;
        int buf = state[0];
        state[0] = buf ^ 1;
        /* DMA descriptors of this chunk, merged where host and staging are contiguous. */
        size_t count = 0;
        for (int i = 0; i < m; i++) {
            int64_t s = slot_ids[lo + i];
            uint64_t h = (uint64_t)host_rows[s];
            uint64_t d = stage_base[buf] + (uint64_t)(i * row_stride);
            if (count > 0 && row_stride == slot_bytes && s > 0 &&
                s / rows_per_chunk == slot_ids[lo + i - 1] / rows_per_chunk &&
                h == (uint64_t)host_rows[slot_ids[lo + i - 1]] + (uint64_t)slot_bytes &&
                (store ? dst[count - 1] : src[count - 1]) + size[count - 1] == h) {
                size[count - 1] += (uint64_t)slot_bytes;
                continue;
            }
            src[count] = store ? d : h;
            dst[count] = store ? h : d;
            size[count] = (uint64_t)slot_bytes;
            count++;
        }
        if (store) {
            if (state[1 + buf] && (rc = p_stream_wait_event((CUstream)kstream, done[buf], 0)) != 0)
                goto fail;
            rc = copy_launch(device, kstream, kstream, NULL, NULL, NULL, refs,
                                     stage_rows[buf], nref, m * bpc, gpu_ids + (int64_t)lo * bpc, pos, 0,
                                     bpc, 1,
                                     programs, page_bytes, NULL, 0, 0);
            if (rc != 0) goto fail;
            if ((rc = p_event_record(ready[buf], (CUstream)kstream)) != 0) goto fail;
            if ((rc = p_stream_wait_event((CUstream)stream, ready[buf], 0)) != 0) goto fail;
            rc = use_batch ? ao_cuda_memcpy_batch(stream, dst, src, size, count, 0, device, 1, 0)
                           : ao_cuda_memcpy_each(stream, dst, src, size, count);
            if (rc != 0) goto fail;
            if ((rc = p_event_record(done[buf], (CUstream)stream)) != 0) goto fail;
        } else {
            if (state[1 + buf] && (rc = p_stream_wait_event((CUstream)stream, done[buf], 0)) != 0)
                goto fail;
            rc = use_batch ? ao_cuda_memcpy_batch(stream, dst, src, size, count, 1, device, 3, 0)
                           : ao_cuda_memcpy_each(stream, dst, src, size, count);
            if (rc != 0) goto fail;
            if ((rc = p_event_record(ready[buf], (CUstream)stream)) != 0) goto fail;
            if ((rc = p_stream_wait_event((CUstream)kstream, ready[buf], 0)) != 0) goto fail;
            rc = copy_launch(device, kstream, kstream, NULL, NULL, NULL, refs,
                                     stage_rows[buf], nref, m * bpc, gpu_ids + (int64_t)lo * bpc, pos, 0,
                                     bpc, 0,
                                     programs, page_bytes, NULL, 0, 0);
            if (rc != 0) goto fail;
            if ((rc = p_event_record(done[buf], (CUstream)kstream)) != 0) goto fail;
        }
        state[1 + buf] = 1;
    }
    /* The job ends on the copy stream, after the kernel stream's last work. */
    if ((rc = p_event_record(join, (CUstream)kstream)) != 0) goto fail;
    if ((rc = p_stream_wait_event((CUstream)stream, join, 0)) != 0) goto fail;
    if (end != NULL && (rc = p_event_record(end, (CUstream)stream)) != 0) goto fail;
    if (slot != NULL) {
        if ((rc = ao_cuda_launch_wake(stream, slot)) != 0) goto fail;
        if (spin_stop > 0 && end != NULL) {
            int64_t *sl = (int64_t *)slot;
            sl[4] = 0;
            if (ao_cuda_spin_watch(end, sl, spin_start, spin_stop) != 0) sl[4] = 1;
        }
    }
    free(src);
    free(dst);
    free(size);
    free(pos);
    return 0;
fail:
    free(src);
    free(dst);
    free(size);
    free(pos);
    if (slot != NULL) __atomic_store_n(&((int64_t *)slot)[3], 1, __ATOMIC_RELEASE);
    return rc;
}

/*
 * The entry points Python calls: named structures (asyncoffload/_native/cuda_calls.py
 * mirrors them field by field; every field is 8 bytes wide, so no padding) instead of
 * long positional argument lists.
 */
typedef struct {
    uint64_t refs;          /* device address of the group's int64 [5, nref] ref table */
    int64_t nref;           /* refs in the table */
    int64_t n;              /* blocks */
    const int64_t *gpu_ids; /* n KV block ids (int64, read during the call) */
    const int64_t *slot_ids; /* their slot ids */
    int64_t skip;           /* sub-blocks the first slot skips */
    int64_t page;           /* the group's largest page, bytes */
} ao_copy_span;

typedef struct {
    int64_t device;
    void *caller;    /* the caller's current stream */
    void *stream;    /* the direction's copy stream */
    void *fence;     /* event: the copy stream waits for the caller through it */
    void *start;     /* timing events, or NULL */
    void *end;
    uint64_t rows;   /* device address of the table of host slot addresses */
    int64_t bpc;     /* blocks per slot */
    int64_t store;   /* 1: KV to host; 0: host to KV */
    int64_t programs; /* most thread blocks a launch uses */
    void *slot;      /* wake-up slot, or NULL */
    int64_t spin_start, spin_stop; /* the spinner's window (stop 0: no spinner) */
} ao_copy_call;

typedef struct {
    int64_t rows;                /* staging rows per buffer */
    const uint64_t *base;        /* [2] buffer base addresses */
    const uint64_t *row_tables;  /* [2] device tables of row addresses */
    int64_t row_stride;          /* bytes between rows */
    int *state;                  /* [next buffer, used 0, used 1], updated */
    void **ready;                /* [2] events */
    void **done;                 /* [2] events */
    void *join;                  /* event: the kernel stream's last work */
    void *kstream;               /* the direction's kernel stream */
    const int64_t *host_rows;    /* host slot addresses (CPU) */
    int64_t rows_per_chunk;      /* slots per pinned chunk */
    int64_t slot_bytes;
    int64_t use_batch;           /* 1: cuMemcpyBatchAsync, 0: cuMemcpyAsync each */
} ao_staging;

/* One transfer: copy_launch over `nspans` groups, the first after the caller's stream
 * (with the start event), the last with the end event and the wake-up. */
int ao_cuda_copy_run(const ao_copy_call *c, const ao_copy_span *spans, int64_t nspans) {
    for (int64_t i = 0; i < nspans; i++) {
        const ao_copy_span *s = &spans[i];
        int last = i == nspans - 1;
        int rc = copy_launch((int)c->device, i == 0 ? c->caller : c->stream, c->stream, c->fence,
                             i == 0 ? c->start : NULL, last ? c->end : NULL, s->refs, c->rows,
                             (int)s->nref, (int)s->n, s->gpu_ids, s->slot_ids, (int)s->skip,
                             (int)c->bpc, (int)c->store, (int)c->programs, s->page,
                             last ? c->slot : NULL, c->spin_start, c->spin_stop);
        if (rc != 0) {
            /* No host function was queued with the slot: nothing native holds it. */
            if (c->slot != NULL && !last) __atomic_store_n(&((int64_t *)c->slot)[3], 1, __ATOMIC_RELEASE);
            return rc;
        }
    }
    return 0;
}

/* copy_wait of one group on the caller's stream, `c->end` after it. */
int ao_cuda_copy_wait(const ao_copy_call *c, const ao_copy_span *s, int64_t budget_ns,
                      int64_t *times) {
    return copy_wait((int)c->device, c->caller, c->end, s->refs, c->rows, (int)s->nref,
                     (int)s->n, s->gpu_ids, s->slot_ids, (int)c->store, (int)c->programs,
                     s->page, budget_ns, times);
}

/* staged_launch of one group through `g`'s buffers. */
int ao_cuda_staged_run(const ao_copy_call *c, const ao_copy_span *s, const ao_staging *g) {
    return staged_launch((int)c->device, c->caller, c->stream, g->kstream, c->fence, g->join,
                         c->start, c->end, s->refs, (int)s->nref, (int)s->n, s->gpu_ids,
                         s->slot_ids, (int)c->store, (int)c->bpc, (int)c->programs, s->page,
                         g->host_rows, g->rows_per_chunk, g->slot_bytes, (int)g->rows, g->base,
                         g->row_tables, g->row_stride, g->state, g->ready, g->done,
                         (int)g->use_batch, c->slot, c->spin_start, c->spin_stop);
}

/*
 * Id checks for copy plans (host-side, no CUDA): -1 if every one of the n ids lies in
 * [0, limit) and, with `unique`, none repeats; else the index of the first id out of
 * range, or -2 - i for the first repeat at index i; -3 if it cannot tell (no memory
 * for the bitmap of `limit` bits).
 */
int64_t ao_ids_check(const int64_t *ids, int64_t n, int64_t limit, int unique) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= limit) return i;
    if (!unique || n < 2) return -1;
    uint64_t stack[512]; /* 32768 ids without an allocation */
    size_t words = (size_t)((limit + 63) / 64);
    uint64_t *seen = stack;
    if (words > sizeof stack / sizeof stack[0]) {
        seen = (uint64_t *)calloc(words, sizeof *seen);
        if (seen == NULL) return -3;
    } else {
        for (size_t w = 0; w < words; w++) stack[w] = 0;
    }
    int64_t out = -1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t bit = 1ULL << (ids[i] & 63);
        uint64_t *w = &seen[ids[i] >> 6];
        if (*w & bit) {
            out = -2 - i;
            break;
        }
        *w |= bit;
    }
    if (seen != stack) free(seen);
    return out;
}
