/*
 * asyncoffload native copy lanes: memcpy jobs run on a native thread per lane, never
 * touching the GIL. A finished job publishes its status with a release store and writes
 * 1 to the lane's wake fd (an eventfd or a pipe), which the event loop watches.
 *
 * A job copies n whole blocks between the KV tensors and the host pool: for block i and
 * fragment f, the KV side is kv_base[f] + kv_ids[i] * kv_stride[f] and the host side is
 * host_base + host_ids[i] * block_bytes + f * frag_bytes. The block ids are copied into the
 * job at submission; the fragment tables belong to the backend and outlive its lanes.
 * Jobs of one lane run in submission order. A job's status is two int64 words: [done
 * flag, CLOCK_MONOTONIC nanoseconds at the end of the copy], kept alive by the Python
 * side until it has seen the done flag.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct ao_job {
    struct ao_job *next;
    int64_t *status;
    int direction; /* 0: KV -> host (store), 1: host -> KV (load) */
    int64_t n;
    int64_t nfrag;
    const int64_t *kv_base;
    const int64_t *kv_stride;
    int64_t host_base;
    int64_t block_bytes;
    int64_t frag_bytes;
    int64_t ids[]; /* n KV block ids, then n host block ids */
} ao_job;

static void ao_run(const ao_job *job) {
    const int64_t *kv_ids = job->ids;
    const int64_t *host_ids = job->ids + job->n;
    size_t frag = (size_t)job->frag_bytes;
    for (int64_t i = 0; i < job->n; i++) {
        char *host = (char *)(intptr_t)(job->host_base + host_ids[i] * job->block_bytes);
        for (int64_t f = 0; f < job->nfrag; f++) {
            char *kv = (char *)(intptr_t)(job->kv_base[f] + kv_ids[i] * job->kv_stride[f]);
            char *h = host + f * job->frag_bytes;
            if (job->direction == 0)
                memcpy(h, kv, frag);
            else
                memcpy(kv, h, frag);
        }
    }
}

typedef struct {
    pthread_t thread;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
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
        int fd = lane->wake_fd;
        pthread_mutex_unlock(&lane->mutex);

        ao_run(job);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        job->status[1] = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        __atomic_store_n(&job->status[0], 1, __ATOMIC_RELEASE);
        free(job);
        ao_wake(fd);
    }
}

void *ao_lane_create(int wake_fd) {
    ao_lane *lane = (ao_lane *)calloc(1, sizeof *lane);
    if (lane == NULL) return NULL;
    lane->wake_fd = wake_fd;
    pthread_mutex_init(&lane->mutex, NULL);
    pthread_cond_init(&lane->cond, NULL);
    if (pthread_create(&lane->thread, NULL, ao_lane_main, lane) != 0) {
        pthread_mutex_destroy(&lane->mutex);
        pthread_cond_destroy(&lane->cond);
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

int ao_lane_submit(void *handle, int direction, int64_t n, const int64_t *kv_ids,
                   const int64_t *host_ids, int64_t nfrag, const int64_t *kv_base,
                   const int64_t *kv_stride, int64_t host_base, int64_t block_bytes,
                   int64_t frag_bytes, int64_t *status) {
    ao_lane *lane = (ao_lane *)handle;
    ao_job *job = (ao_job *)malloc(sizeof *job + 2 * (size_t)n * sizeof(int64_t));
    if (job == NULL) return -1;
    job->next = NULL;
    job->status = status;
    job->direction = direction;
    job->n = n;
    job->nfrag = nfrag;
    job->kv_base = kv_base;
    job->kv_stride = kv_stride;
    job->host_base = host_base;
    job->block_bytes = block_bytes;
    job->frag_bytes = frag_bytes;
    memcpy(job->ids, kv_ids, (size_t)n * sizeof(int64_t));
    memcpy(job->ids + n, host_ids, (size_t)n * sizeof(int64_t));
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

int64_t ao_status_load(const int64_t *status) {
    return __atomic_load_n(&status[0], __ATOMIC_ACQUIRE);
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
    free(lane);
}
