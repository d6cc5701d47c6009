/*
 * asyncoffload native copy lanes: memcpy jobs run on a native thread per lane, never
 * touching the GIL. A finished job publishes its status with a release store and writes
 * 1 to the lane's wake fd (an eventfd or a pipe), which the event loop watches.
 *
 * A job copies n whole blocks between the KV tensors and the host pool: for block i and
 * fragment f, the KV side is kv_base[f] + kv_ids[i] * kv_stride[f] and the host side is
 * host_base + host_ids[i] * block_bytes + f * frag_bytes (block_bytes: the host slots'
 * stride, which may leave room between them). The block ids are copied into the job at
 * submission; the fragment tables belong to the backend and outlive its lanes.
 * Jobs of one lane run in submission order. A job's status is two int64 words: [state,
 * CLOCK_MONOTONIC nanoseconds at the end of the copy], kept alive by the Python side
 * until the state is set: 1 when copied, -ECANCELED when discarded unrun
 * (ao_lane_cancel).
 *
 * A second kind of job (ao_lane_submit_copies) is a plain list of n (src, dst, size)
 * descriptors, copied into the job at submission. Its status is three words: [state,
 * end ns, start ns], state 1 when done, a negative errno when the job was refused at run
 * time (a null address or a negative size: then nothing of it is copied). A thread may
 * block in ao_lane_wait until a job's state is set, on a condition variable, so a
 * caller that releases the GIL (ctypes does) neither spins nor holds up Python.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct ao_job {
    struct ao_job *next;
    int64_t *status;
    int kind;      /* 0: whole blocks (ao_lane_submit), 1: descriptors (ao_lane_submit_copies) */
    int direction; /* 0: KV -> host (store), 1: host -> KV (load) */
    int64_t n;
    int64_t nfrag;
    const int64_t *kv_base;
    const int64_t *kv_stride;
    int64_t host_base;
    int64_t block_bytes;
    int64_t frag_bytes;
    int64_t ids[]; /* kind 0: n KV block ids, then n host block ids; kind 1: n sources,
                      n destinations, n sizes */
} ao_job;

/* Kind 1: check every descriptor, then copy; returns 1 or -EINVAL (nothing copied). */
static int64_t ao_run_copies(const ao_job *job) {
    const int64_t *src = job->ids;
    const int64_t *dst = job->ids + job->n;
    const int64_t *size = job->ids + 2 * job->n;
    for (int64_t i = 0; i < job->n; i++) {
        if (size[i] < 0 || (size[i] > 0 && (src[i] == 0 || dst[i] == 0))) return -22;
    }
    for (int64_t i = 0; i < job->n; i++)
        memcpy((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], (size_t)size[i]);
    return 1;
}

/*
 * A backend's fragment tables, as eight int64 words: nfrag, host_base, block_bytes (the
 * host stride),
 * frag_bytes, the addresses of its kv_base[nfrag] and kv_stride[nfrag] arrays, then how
 * many KV blocks and host blocks there are (the bounds of the ids).
 */
enum {
    T_NFRAG,
    T_HOST_BASE,
    T_BLOCK_BYTES,
    T_FRAG_BYTES,
    T_KV_BASE,
    T_KV_STRIDE,
    T_KV_BLOCKS,
    T_HOST_BLOCKS
};

/* 0 when every id lies in its bounds; -3: a KV block id does not, -4: a host id. */
static int ao_check_ids(const int64_t *tables, int64_t n, const int64_t *ids) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tables[T_KV_BLOCKS]) return -3;
    for (int64_t i = n; i < 2 * n; i++)
        if (ids[i] < 0 || ids[i] >= tables[T_HOST_BLOCKS]) return -4;
    return 0;
}

static void ao_copy(int direction, int64_t n, const int64_t *kv_ids, const int64_t *host_ids,
                    int64_t nfrag, const int64_t *kv_base, const int64_t *kv_stride,
                    int64_t host_base, int64_t block_bytes, int64_t frag_bytes) {
    size_t frag = (size_t)frag_bytes;
    for (int64_t i = 0; i < n; i++) {
        char *host = (char *)(intptr_t)(host_base + host_ids[i] * block_bytes);
        for (int64_t f = 0; f < nfrag; f++) {
            char *kv = (char *)(intptr_t)(kv_base[f] + kv_ids[i] * kv_stride[f]);
            char *h = host + f * frag_bytes;
            if (direction == 0)
                memcpy(h, kv, frag);
            else
                memcpy(kv, h, frag);
        }
    }
}

static void ao_run(const ao_job *job) {
    ao_copy(job->direction, job->n, job->ids, job->ids + job->n, job->nfrag, job->kv_base,
            job->kv_stride, job->host_base, job->block_bytes, job->frag_bytes);
}

/*
 * The copy of an ao_lane_submit job, on the calling thread: a small job, where the hop
 * to a lane and back would cost more than the copy. ids: n KV block ids, then n host
 * block ids. Returns 0, or (nothing copied) -3 / -4 as ao_check_ids.
 */
int ao_copy_blocks(const int64_t *tables, int direction, int64_t n, const int64_t *ids) {
    int rc = ao_check_ids(tables, n, ids);
    if (rc != 0) return rc;
    ao_copy(direction, n, ids, ids + n, tables[T_NFRAG], (const int64_t *)(intptr_t)tables[T_KV_BASE],
            (const int64_t *)(intptr_t)tables[T_KV_STRIDE], tables[T_HOST_BASE],
            tables[T_BLOCK_BYTES], tables[T_FRAG_BYTES]);
    return 0;
}

typedef struct {
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    pthread_cond_t done; /* broadcast after every job: ao_lane_wait */
    ao_job *head;
    ao_job *tail;
    int stopping;
    int wake_fd;
} ao_lane;

static void ao_wake(int fd) {
    if (fd < 0) return;
    uint64_t one = 1;
    /* A full pipe or counter already wakes the reader: ignore EAGAIN. */
    ssize_t r = write(fd, &one, sizeof one);
    (void)r;
}

/* The clock of the lane's `done` condition variable (timed waits): monotonic where
 * pthread_condattr_setclock exists. */
#if defined(__APPLE__)
#define AO_WAIT_CLOCK CLOCK_REALTIME
#else
#define AO_WAIT_CLOCK CLOCK_MONOTONIC
#endif

static int64_t ao_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *ao_lane_main(void *arg) {
    ao_lane *lane = (ao_lane *)arg;
    for (;;) {
        pthread_mutex_lock(&lane->mutex);
        while (lane->head == NULL && !lane->stopping)
            pthread_cond_wait(&lane->cond, &lane->mutex);
        ao_job *job = lane->head;
        if (job == NULL) { /* stopping and drained */
            pthread_mutex_unlock(&lane->mutex);
            return NULL;
        }
        lane->head = job->next;
        if (lane->head == NULL) lane->tail = NULL;
        pthread_mutex_unlock(&lane->mutex);

        int64_t state = 1;
        if (job->kind == 1) {
            job->status[2] = ao_now();
            state = ao_run_copies(job);
        } else {
            ao_run(job);
        }
        job->status[1] = ao_now();
        __atomic_store_n(&job->status[0], state, __ATOMIC_RELEASE);
        free(job);
        /* Under the mutex: a waiter checks the state and sleeps while holding it, so
         * it cannot miss this broadcast; and once ao_lane_set_wake_fd has returned,
         * the fd it replaced is never written again (its owner may close it). */
        pthread_mutex_lock(&lane->mutex);
        pthread_cond_broadcast(&lane->done);
        ao_wake(lane->wake_fd);
        pthread_mutex_unlock(&lane->mutex);
    }
}

void *ao_lane_create(int wake_fd) {
    ao_lane *lane = (ao_lane *)calloc(1, sizeof *lane);
    if (lane == NULL) return NULL;
    lane->wake_fd = wake_fd;
    pthread_mutex_init(&lane->mutex, NULL);
    pthread_cond_init(&lane->cond, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
#if !defined(__APPLE__)
    pthread_condattr_setclock(&attr, AO_WAIT_CLOCK);
#endif
    pthread_cond_init(&lane->done, &attr);
    pthread_condattr_destroy(&attr);
    if (pthread_create(&lane->thread, NULL, ao_lane_main, lane) != 0) {
        pthread_mutex_destroy(&lane->mutex);
        pthread_cond_destroy(&lane->cond);
        pthread_cond_destroy(&lane->done);
        free(lane);
        return NULL;
    }
    return lane;
}

void ao_lane_set_wake_fd(void *handle, int wake_fd) {
    ao_lane *lane = (ao_lane *)handle;
    pthread_mutex_lock(&lane->mutex);
    lane->wake_fd = wake_fd;
    pthread_mutex_unlock(&lane->mutex);
}

static int ao_enqueue(ao_lane *lane, ao_job *job) {
    pthread_mutex_lock(&lane->mutex);
    if (lane->stopping) {
        pthread_mutex_unlock(&lane->mutex);
        free(job);
        return -2;
    }
    if (lane->tail) lane->tail->next = job; else lane->head = job;
    lane->tail = job;
    pthread_cond_signal(&lane->cond);
    pthread_mutex_unlock(&lane->mutex);
    return 0;
}

/*
 * Queue a job copying n whole blocks (ids: n KV block ids, then n host block ids; copied
 * now). Returns 0, -1 when out of memory, -2 when the lane is stopping, -3 / -4 (as
 * ao_check_ids) when an id is out of bounds.
 */
int ao_lane_submit(void *handle, const int64_t *tables, int direction, int64_t n,
                   const int64_t *ids, int64_t *status) {
    ao_lane *lane = (ao_lane *)handle;
    int rc = ao_check_ids(tables, n, ids);
    if (rc != 0) return rc;
    ao_job *job = (ao_job *)malloc(sizeof *job + 2 * (size_t)n * sizeof(int64_t));
    if (job == NULL) return -1;
    job->next = NULL;
    job->status = status;
    job->kind = 0;
    job->direction = direction;
    job->n = n;
    job->nfrag = tables[T_NFRAG];
    job->kv_base = (const int64_t *)(intptr_t)tables[T_KV_BASE];
    job->kv_stride = (const int64_t *)(intptr_t)tables[T_KV_STRIDE];
    job->host_base = tables[T_HOST_BASE];
    job->block_bytes = tables[T_BLOCK_BYTES];
    job->frag_bytes = tables[T_FRAG_BYTES];
    memcpy(job->ids, ids, 2 * (size_t)n * sizeof(int64_t));
    return ao_enqueue(lane, job);
}

/*
 * Queue a job copying size[i] bytes from src[i] to dst[i] for i < n (the arrays are
 * copied now; the memory they point to must stay valid until the job is done).
 * status: three int64 words (see the top of this file), zeroed by the caller.
 * Returns 0, -1 when out of memory, -2 when the lane is stopping.
 */
int ao_lane_submit_copies(void *handle, int64_t n, const int64_t *src, const int64_t *dst,
                          const int64_t *size, int64_t *status) {
    ao_lane *lane = (ao_lane *)handle;
    if (n < 0) return -3;
    ao_job *job = (ao_job *)malloc(sizeof *job + 3 * (size_t)n * sizeof(int64_t));
    if (job == NULL) return -1;
    memset(job, 0, sizeof *job);
    job->status = status;
    job->kind = 1;
    job->n = n;
    if (n > 0) {
        memcpy(job->ids, src, (size_t)n * sizeof(int64_t));
        memcpy(job->ids + n, dst, (size_t)n * sizeof(int64_t));
        memcpy(job->ids + 2 * n, size, (size_t)n * sizeof(int64_t));
    }
    return ao_enqueue(lane, job);
}

/*
 * Block until the job owning `status` has a state, or timeout_ns passes (< 0: no
 * limit). Returns the state: 0 if the time ran out first.
 */
int64_t ao_lane_wait(void *handle, const int64_t *status, int64_t timeout_ns) {
    ao_lane *lane = (ao_lane *)handle;
    int64_t state = __atomic_load_n(&status[0], __ATOMIC_ACQUIRE);
    if (state != 0) return state;
    struct timespec until = {0, 0};
    if (timeout_ns >= 0) {
        clock_gettime(AO_WAIT_CLOCK, &until);
        int64_t end = (int64_t)until.tv_sec * 1000000000LL + until.tv_nsec + timeout_ns;
        until.tv_sec = end / 1000000000LL;
        until.tv_nsec = end % 1000000000LL;
    }
    pthread_mutex_lock(&lane->mutex);
    while ((state = __atomic_load_n(&status[0], __ATOMIC_ACQUIRE)) == 0) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&lane->done, &lane->mutex);
        } else if (pthread_cond_timedwait(&lane->done, &lane->mutex, &until) != 0) {
            state = __atomic_load_n(&status[0], __ATOMIC_ACQUIRE);
            break;
        }
    }
    pthread_mutex_unlock(&lane->mutex);
    return state;
}

int64_t ao_status_load(const int64_t *status) {
    return __atomic_load_n(&status[0], __ATOMIC_ACQUIRE);
}

/*
 * Discard the jobs still queued (not the one running): each gets the state -ECANCELED
 * and copies nothing. For an owner that is going away and needs only the running job to
 * end before it frees the memory jobs touch. Returns how many were discarded.
 */
int64_t ao_lane_cancel(void *handle) {
    ao_lane *lane = (ao_lane *)handle;
    int64_t count = 0;
    pthread_mutex_lock(&lane->mutex);
    ao_job *job = lane->head;
    lane->head = lane->tail = NULL;
    while (job != NULL) {
        ao_job *next = job->next;
        job->status[1] = ao_now();
        __atomic_store_n(&job->status[0], -(int64_t)ECANCELED, __ATOMIC_RELEASE);
        free(job);
        job = next;
        count++;
    }
    if (count) {
        pthread_cond_broadcast(&lane->done);
        ao_wake(lane->wake_fd);
    }
    pthread_mutex_unlock(&lane->mutex);
    return count;
}

/* Finish queued jobs, stop the thread, free the lane. */
void ao_lane_destroy(void *handle) {
    ao_lane *lane = (ao_lane *)handle;
    pthread_mutex_lock(&lane->mutex);
    lane->stopping = 1;
    pthread_cond_signal(&lane->cond);
    pthread_mutex_unlock(&lane->mutex);
    pthread_join(lane->thread, NULL);
    pthread_mutex_destroy(&lane->mutex);
    pthread_cond_destroy(&lane->cond);
    pthread_cond_destroy(&lane->done);
    free(lane);
}
