/*
 * asyncoffload native disk I/O lanes: a pool of native threads that write blocks to and
 * read blocks from disk (pread/pwrite), with a CRC32C of every block, never touching
 * the GIL. A finished job publishes its status with a release store and writes 1 to the
 * pool's wake fd (an eventfd or a pipe), which the event loop watches, like copy_engine.c.
 *
 * On-disk block: a 4096-byte header, then the payload, zero-padded to a multiple of 4096
 * (slot bytes = 4096 + round_up(payload_len, 4096)). Header, little-endian:
 *   [0:8)       magic "AOKVBLK\0"
 *   [8:12)      format version (1)
 *   [12:16)     header length (4096)
 *   [16:32)     identity (16 bytes, the pool's)
 *   [32:40)     payload_len
 *   [40:44)     CRC32C of the payload (payload_len bytes, not the padding)
 *   [44:48)     key_len (1..256)
 *   [48:304)    key, zero-padded
 *   [304:308)   MAC type: 0 none, 1 keyed BLAKE2b-256 (an authenticated block)
 *   [308:312)   zeros
 *   [312:344)   with MAC type 1: the MAC, keyed BLAKE2b-256 of the payload then [0:312)
 *   [344:4092)  zeros
 *   [4092:4096) CRC32C of bytes [0:4092)
 *
 * Two places a block lives: a slab (an open fd, the block at a file offset) or a file of
 * its own (files mode: a path relative to a directory fd the owner holds open, so that
 * nothing done to the directories above it after it was opened changes which file is
 * used; every open is O_NOFOLLOW, and the path's directories are the owner's). Files are written to a temporary name and renamed into
 * place. There is no fsync: a crash may leave a torn or empty file behind (or a lost
 * rename), and a torn file fails its header or payload CRC when read (-EBADMSG / -ENODATA),
 * so it is never served; durability across power loss is not promised.
 *
 * A job is n ops of one direction. Reads go first: a worker takes the next op of the
 * oldest read job that has ops left before any write op. With AO_FLAG_WRITE_IDLE the pool
 * has two sets of workers (nthreads each): read lanes take reads (and checks of values
 * read: unpack), write lanes writes, unlinks and packs, at SCHED_IDLE: they use the CPU
 * time the rest of the machine leaves, so that a write never delays a read for CPU (issue
 * 41: on a 2-vCPU VM a read's p50 went from 0.33 to 0.6 ms while the lanes wrote 1 GB/s).
 * So that writes still progress on a machine whose CPUs are all busy, a read lane with no
 * read to do takes a write op whose job has waited AO_WRITE_HELP_NS for a write lane while
 * the write lanes starve: one of them was runnable at two samples AO_WRITE_HELP_NS apart
 * and on a CPU for less than half the time between (/proc/self/task/TID/stat and
 * schedstat; where they cannot be read, a wait of AO_WRITE_HELP_NS is enough). A write
 * lane asleep in a slow disk's I/O is not starving: its writes are not taken from it. At
 * most nthreads - 1 read lanes help at once (one at least): a read lane is left for
 * reads. Ops of one job may run on several workers at once; the job ends when its last
 * op ends. Files-mode writes and
 * unlinks of one file run in the order they were taken (ao_claim): a block evicted and
 * written again at once is written after its old file was removed, never removed after. A job's status is three
 * int64 words: [state, end ns, start ns] (CLOCK_MONOTONIC), the state stored last with a
 * release store: 1 once every op has ended (each op's outcome in results[i]: payload_len
 * or -errno), -ECANCELED when it was discarded unrun (ao_io_cancel).
 *
 * CRC32C: the SSE4.2 / ARMv8 CRC instructions where the CPU has them (three streams
 * interleaved, combined with precomputed shift tables), else a slicing-by-8 table.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define AO_CRC_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define AO_CRC_ARM 1
#endif

#ifndef O_DIRECT
#define O_DIRECT 0
#endif
#ifndef EKEYREJECTED
#define EKEYREJECTED 129
#endif
#ifndef EBADMSG
#define EBADMSG 74
#endif
#ifndef ENODATA
#define ENODATA 61
#endif
#ifndef ENOKEY
#define ENOKEY 126
#endif

#define AO_HEADER 4096
#define AO_ALIGN 4096
#define AO_KEY_MAX 256
#define AO_VERSION 1u
/* An authenticated block (a pool or value given a MAC key): its MAC type, and the MAC
 * over the payload, then the header's first AO_MAC_AT bytes (fields, key, MAC type). */
#define AO_MAC_TYPE_AT 304
#define AO_MAC_AT 312
#define AO_MAC_LEN 32
#define AO_MAC_BLAKE2B 1u
/* What a job's ops do (ao_io_submit's write argument): read or write blocks of files,
 * pack / check values of a key-value store in memory (the shared tier), or remove block
 * files (files mode: unlinkat(fd, path), a file already gone counts as removed). Writes,
 * packs and unlinks queue behind reads and unpacks. */
#define AO_KIND_READ 0
#define AO_KIND_WRITE 1
#define AO_KIND_PACK 2
#define AO_KIND_UNPACK 3
#define AO_KIND_UNLINK 4
/* ao_io_create's flags: files opened O_DIRECT; write lanes at SCHED_IDLE. */
#define AO_FLAG_DIRECT 1
#define AO_FLAG_WRITE_IDLE 2
static const uint8_t AO_MAGIC[8] = {'A', 'O', 'K', 'V', 'B', 'L', 'K', 0};

/* --- CRC32C ---------------------------------------------------------------------------- */

#define AO_POLY 0x82F63B78u
#define AO_LONG 8192
#define AO_SHORT 256

static uint32_t ao_crc_table[8][256];  /* slicing-by-8 */
static uint32_t ao_crc_long[4][256];   /* shift a raw register by AO_LONG zero bytes */
static uint32_t ao_crc_short[4][256];  /* ... by AO_SHORT zero bytes */
static pthread_once_t ao_crc_once = PTHREAD_ONCE_INIT;
static int ao_crc_hw;

/* a * b modulo the polynomial (reflected bit order: bit 31 is x^0). */
static uint32_t ao_multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ AO_POLY : b >> 1;
    }
    return p;
}

/* x^(8 * nbytes) modulo the polynomial: the operator that feeds nbytes zero bytes. */
static uint32_t ao_x8nmodp(size_t nbytes) {
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    uint32_t sq = (uint32_t)1 << 27; /* x^4 */
    sq = ao_multmodp(sq, sq);       /* x^8: one byte */
    while (nbytes) {
        if (nbytes & 1) p = ao_multmodp(sq, p);
        sq = ao_multmodp(sq, sq);
        nbytes >>= 1;
    }
    return p;
}

static void ao_shift_table(uint32_t table[4][256], size_t nbytes) {
    uint32_t op = ao_x8nmodp(nbytes);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) table[k][b] = ao_multmodp(op, b << (8 * k));
}

static inline uint32_t ao_shift(uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
           table[3][crc >> 24];
}

static void ao_crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ AO_POLY : c >> 1;
        ao_crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = ao_crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = ao_crc_table[0][c & 0xff] ^ (c >> 8);
            ao_crc_table[k][n] = c;
        }
    }
    ao_shift_table(ao_crc_long, AO_LONG);
    ao_shift_table(ao_crc_short, AO_SHORT);
#if defined(AO_CRC_X86)
    __builtin_cpu_init();
    ao_crc_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#elif defined(AO_CRC_ARM)
    ao_crc_hw = 1;
#endif
}

/* The raw register (no pre/post inversion), by table. */
static uint32_t ao_crc_soft(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = ao_crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= crc;
        crc = ao_crc_table[7][w & 0xff] ^ ao_crc_table[6][(w >> 8) & 0xff] ^
              ao_crc_table[5][(w >> 16) & 0xff] ^ ao_crc_table[4][(w >> 24) & 0xff] ^
              ao_crc_table[3][(w >> 32) & 0xff] ^ ao_crc_table[2][(w >> 40) & 0xff] ^
              ao_crc_table[1][(w >> 48) & 0xff] ^ ao_crc_table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = ao_crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(AO_CRC_X86) || defined(AO_CRC_ARM)
#if defined(AO_CRC_X86)
#define AO_HW_ATTR __attribute__((target("sse4.2")))
#define AO_CRC64(c, w) ((uint32_t)_mm_crc32_u64((c), (w)))
#define AO_CRC8(c, b) _mm_crc32_u8((c), (b))
#else
#define AO_HW_ATTR
#define AO_CRC64(c, w) __crc32cd((c), (w))
#define AO_CRC8(c, b) __crc32cb((c), (b))
#endif

static inline uint64_t ao_load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three independent streams of `block` bytes each hide the instruction's latency; the
 * three registers are then combined by shifting (crc0 over block bytes) and xoring. */
#define AO_HW_BLOCKS(block, table)                                                          \
    while (len >= 3 * (size_t)(block)) {                                                     \
        uint64_t c0 = crc, c1 = 0, c2 = 0;                                                   \
        const unsigned char *end = p + (block);                                              \
        do {                                                                                 \
            c0 = AO_CRC64((uint32_t)c0, ao_load64(p));                                       \
            c1 = AO_CRC64((uint32_t)c1, ao_load64(p + (block)));                             \
            c2 = AO_CRC64((uint32_t)c2, ao_load64(p + 2 * (block)));                         \
            p += 8;                                                                          \
        } while (p < end);                                                                   \
        crc = ao_shift(table, (uint32_t)c0) ^ (uint32_t)c1;                                  \
        crc = ao_shift(table, crc) ^ (uint32_t)c2;                                           \
        p += 2 * (block);                                                                    \
        len -= 3 * (size_t)(block);                                                          \
    }

AO_HW_ATTR static uint32_t ao_crc_hard(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = AO_CRC8(crc, *p++);
        len--;
    }
    AO_HW_BLOCKS(AO_LONG, ao_crc_long)
    AO_HW_BLOCKS(AO_SHORT, ao_crc_short)
    uint64_t c = crc;
    while (len >= 8) {
        c = AO_CRC64((uint32_t)c, ao_load64(p));
        p += 8;
        len -= 8;
    }
    crc = (uint32_t)c;
    while (len--) crc = AO_CRC8(crc, *p++);
    return crc;
}
#endif

/* CRC32C (Castagnoli) of buf, continuing from crc (0 to start): chainable,
 * ao_crc32c(ao_crc32c(0, a, n), b, m) == CRC32C of a followed by b. */
uint32_t ao_crc32c(uint32_t crc, const void *buf, size_t len) {
    pthread_once(&ao_crc_once, ao_crc_init);
    crc = ~crc;
#if defined(AO_CRC_X86) || defined(AO_CRC_ARM)
    if (ao_crc_hw) return ~ao_crc_hard(crc, (const unsigned char *)buf, len);
#endif
    return ~ao_crc_soft(crc, (const unsigned char *)buf, len);
}

/* The table path only (tests compare it with the hardware path). */
uint32_t ao_crc32c_soft(uint32_t crc, const void *buf, size_t len) {
    pthread_once(&ao_crc_once, ao_crc_init);
    return ~ao_crc_soft(~crc, (const unsigned char *)buf, len);
}

/* 1 when ao_crc32c uses the CPU's CRC instructions. */
int ao_crc32c_hardware(void) {
    pthread_once(&ao_crc_once, ao_crc_init);
    return ao_crc_hw;
}

/* Little-endian 64-bit load, any alignment. */
static inline uint64_t ao_load64le(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* Zeroes n bytes where the compiler may not drop it (key material). */
static void ao_wipe(void *p, size_t n) {
    volatile uint8_t *q = (volatile uint8_t *)p;
    while (n--) *q++ = 0;
}

/* --- keyed BLAKE2b (RFC 7693), the blocks' MAC ------------------------------------------ */

/* BLAKE2b with a key: the MAC of an authenticated block (see ao_fill_header). Written from
 * RFC 7693: 12 rounds of the G mixing function over a 16-word state, 128-byte blocks,
 * a 128-bit byte counter, the key (1..64 bytes) hashed as a first block of its own. */
typedef struct {
    uint64_t h[8];
    uint64_t t[2];     /* bytes compressed so far */
    uint8_t b[128];    /* the block being filled */
    size_t c;          /* bytes in b */
    size_t outlen;
} ao_b2b;

#define AO_B2B_MAX_KEY 64

static const uint64_t ao_b2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

/* Message word order of each round (rounds 10 and 11 repeat rows 0 and 1). */
static const uint8_t ao_b2b_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t ao_rotr64(uint64_t x, int n) {
    return (x >> n) | (x << (64 - n));
}

#define AO_B2B_G(a, b, c, d, x, y)            \
    do {                                      \
        v[a] = v[a] + v[b] + (x);             \
        v[d] = ao_rotr64(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];                   \
        v[b] = ao_rotr64(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);             \
        v[d] = ao_rotr64(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];                   \
        v[b] = ao_rotr64(v[b] ^ v[c], 63);    \
    } while (0)

/* The compression function F over one 128-byte block; last: the final block. */
static void ao_b2b_compress(ao_b2b *s, const uint8_t *block, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = ao_load64le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = ao_b2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    /* The rounds written out: every message index is then a constant, and the state
     * stays in registers (a loop over the rounds ran at less than half the speed). */
#define AO_B2B_ROUND(r)                                                          \
    do {                                                                         \
        const uint8_t *z = ao_b2b_sigma[r];                                      \
        AO_B2B_G(0, 4, 8, 12, m[z[0]], m[z[1]]);                                 \
        AO_B2B_G(1, 5, 9, 13, m[z[2]], m[z[3]]);                                 \
        AO_B2B_G(2, 6, 10, 14, m[z[4]], m[z[5]]);                                \
        AO_B2B_G(3, 7, 11, 15, m[z[6]], m[z[7]]);                                \
        AO_B2B_G(0, 5, 10, 15, m[z[8]], m[z[9]]);                                \
        AO_B2B_G(1, 6, 11, 12, m[z[10]], m[z[11]]);                              \
        AO_B2B_G(2, 7, 8, 13, m[z[12]], m[z[13]]);                               \
        AO_B2B_G(3, 4, 9, 14, m[z[14]], m[z[15]]);                               \
    } while (0)
    AO_B2B_ROUND(0);
    AO_B2B_ROUND(1);
    AO_B2B_ROUND(2);
    AO_B2B_ROUND(3);
    AO_B2B_ROUND(4);
    AO_B2B_ROUND(5);
    AO_B2B_ROUND(6);
    AO_B2B_ROUND(7);
    AO_B2B_ROUND(8);
    AO_B2B_ROUND(9);
    AO_B2B_ROUND(0);
    AO_B2B_ROUND(1);
#undef AO_B2B_ROUND
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void ao_b2b_count(ao_b2b *s, size_t n) {
    s->t[0] += n;
    if (s->t[0] < n) s->t[1]++;
}

static void ao_b2b_update(ao_b2b *s, const void *data, size_t n) {
    const uint8_t *in = (const uint8_t *)data;
    if (n == 0) return;
    /* The last block is compressed by ao_b2b_final (with the last flag): a full buffer
     * waits until more input comes. */
    if (s->c + n > 128) {
        size_t fill = 128 - s->c;
        memcpy(s->b + s->c, in, fill);
        in += fill;
        n -= fill;
        ao_b2b_count(s, 128);
        ao_b2b_compress(s, s->b, 0);
        s->c = 0;
        while (n > 128) {
            ao_b2b_count(s, 128);
            ao_b2b_compress(s, in, 0);
            in += 128;
            n -= 128;
        }
    }
    memcpy(s->b + s->c, in, n);
    s->c += n;
}

/* outlen 1..64 bytes of digest, key 0..64 bytes (0: unkeyed): 0, or -1. */
static int ao_b2b_init(ao_b2b *s, size_t outlen, const uint8_t *key, size_t keylen) {
    if (outlen < 1 || outlen > 64 || keylen > AO_B2B_MAX_KEY) return -1;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 8; i++) s->h[i] = ao_b2b_iv[i];
    /* The parameter block's first word: digest length, key length, fanout 1, depth 1. */
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    s->outlen = outlen;
    if (keylen > 0) {
        uint8_t block[128] = {0};
        memcpy(block, key, keylen);
        ao_b2b_update(s, block, 128);
        ao_wipe(block, sizeof block);
    }
    return 0;
}

static void ao_b2b_final(ao_b2b *s, uint8_t *out) {
    ao_b2b_count(s, s->c);
    memset(s->b + s->c, 0, 128 - s->c);
    ao_b2b_compress(s, s->b, 1);
    for (size_t i = 0; i < s->outlen; i++) out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
    ao_wipe(s, sizeof *s);
}

/* BLAKE2b of in (outlen 1..64 bytes; key 0..64 bytes, none when keylen is 0), as
 * Python's hashlib.blake2b(in, digest_size=outlen, key=key): 0, or -1 for bad lengths. */
int ao_blake2b(uint8_t *out, size_t outlen, const uint8_t *key, size_t keylen, const void *in,
               size_t inlen) {
    ao_b2b s;
    if (ao_b2b_init(&s, outlen, key, keylen) != 0) return -1;
    ao_b2b_update(&s, in, inlen);
    ao_b2b_final(&s, out);
    return 0;
}

/* Equal in time independent of where they differ (a MAC check). */
static int ao_equal(const uint8_t *a, const uint8_t *b, size_t n) {
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++) d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

/* --- the pool ---------------------------------------------------------------------------- */

typedef struct {
    int64_t host;
    int64_t offset;
    const char *path;
    const uint8_t *key;
    int32_t key_len;
    int32_t fd;
} ao_io_op;

typedef struct {
    int64_t host;
    int64_t offset;
    const char *path; /* into the job's blob, or NULL; relative to fd if fd >= 0 */
    const uint8_t *key; /* into the job's blob */
    int32_t key_len;
    int32_t fd;
} ao_op;

/* Where a block's payload lives in host memory. One segment (the default): payload_len
 * bytes at op->host. nseg > 1: the payload is nseg slices of seg_len bytes, slice r at
 * op->host + deltas[r] (deltas[0] == 0), e.g. the same slot of each tensor-parallel
 * rank's host pool. */
#define AO_MAX_SEGS 64
typedef struct {
    int32_t nseg;
    int64_t seg_len;
    int64_t deltas[AO_MAX_SEGS];
} ao_segs;

typedef struct ao_iojob {
    struct ao_iojob *next;
    int64_t *status;
    int64_t *results;
    int64_t n;
    int64_t taken;     /* ops handed to workers (under the pool mutex) */
    int64_t remaining; /* ops not ended yet (atomic) */
    int64_t deadline;
    int64_t queued;    /* when it was submitted (ns, CLOCK_MONOTONIC) */
    int write;
    ao_segs segs;      /* the pool's when the job was submitted */
    ao_op ops[];       /* then the keys and paths */
} ao_iojob;

typedef struct {
    ao_iojob *head;
    ao_iojob *tail;
} ao_queue;

/* A files-mode write or unlink running (or waiting for an earlier one of its file). */
typedef struct {
    const char *path; /* into its job's blob; NULL: the entry is free */
    int dir;
    uint64_t seq;     /* the order it was taken in */
} ao_busy;

typedef struct {
    pthread_mutex_t mutex;
    pthread_cond_t cond;      /* a write lane's: a write was queued, or stopping */
    pthread_cond_t rcond;     /* a read lane's: a read was queued, or stopping */
    pthread_cond_t busy_cond; /* a busy entry was freed */
    ao_queue reads;
    ao_queue writes;
    ao_busy *busy;            /* busy_n entries (the threads asked for), under the mutex */
    int busy_n;
    uint64_t busy_seq;
    int stopping;
    int wake_fd;
    int flags;
    int nthreads;           /* threads started: read lanes [0, lanes), then write lanes */
    int lanes;              /* per direction */
    int writers_paused;     /* tests: write lanes take nothing (ao_io_pause_writers) */
    int64_t helped;         /* write ops a read lane took (under the mutex) */
    int helping;            /* read lanes running a write op now (under the mutex) */
    int64_t sampled_at;     /* when the write lanes' run-queue waits were read (ns) */
    int starving;           /* what they said (under the mutex) */
    int64_t *write_tids;    /* the write lanes' thread ids (0: not started yet) */
    int64_t *write_runs;    /* their time on a CPU (ns) when sampled */
    int *write_runnable;    /* whether they were runnable then */
    int64_t idle_failed;    /* write lanes that could not take SCHED_IDLE (atomic) */
    int64_t payload_len;
    int64_t slot_bytes;
    uint8_t identity[16];
    uint8_t mac_key[AO_B2B_MAX_KEY]; /* set before the first job (ao_io_set_mac) */
    int32_t mac_key_len;             /* 0: blocks carry no MAC */
    int64_t fault_every[2]; /* [read, write] */
    int fault_err[2];
    int64_t fault_count[2]; /* atomic */
    int64_t delay_ns;       /* atomic */
    int gate_fd;            /* atomic; tests: -1, or ops wait until it polls readable */
    ao_segs segs;           /* under the mutex; copied into each job */
    pthread_t threads[];
} ao_pool;

static uint64_t ao_tmp_counter; /* atomic */

static void ao_wake(int fd) {
    if (fd < 0) return;
    uint64_t one = 1;
    /* A full pipe or counter already wakes the reader: ignore EAGAIN. */
    ssize_t r = write(fd, &one, sizeof one);
    (void)r;
}

static int64_t ao_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void ao_sleep_ns(int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void ao_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void ao_put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t ao_get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t ao_get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* A MAC over the payload starts here: NULL without a key (an unauthenticated block). */
static ao_b2b *ao_mac_begin(ao_b2b *s, const uint8_t *mac_key, int32_t mac_key_len) {
    if (mac_key_len <= 0) return NULL;
    ao_b2b_init(s, AO_MAC_LEN, mac_key, (size_t)mac_key_len);
    return s;
}

/* The CRC32C of a payload (continuing from crc) and, with mac, the payload absorbed into
 * it: 64 KiB at a time, so the second pass reads from cache. */
static uint32_t ao_digest(uint32_t crc, const uint8_t *p, size_t len, ao_b2b *mac) {
    if (mac == NULL) return ao_crc32c(crc, p, len);
    for (size_t done = 0; done < len; done += 64 * 1024) {
        size_t n = len - done < 64 * 1024 ? len - done : 64 * 1024;
        crc = ao_crc32c(crc, p + done, n);
        ao_b2b_update(mac, p + done, n);
    }
    return crc;
}

/* mac: NULL, or the MAC with the payload absorbed (ao_mac_begin, ao_digest): the header
 * then says MAC type 1 and carries the MAC of the payload and header bytes [0:312). */
static void ao_fill_header(uint8_t *h, const uint8_t *identity, int64_t payload_len,
                           uint32_t crc, const uint8_t *key, int32_t key_len, ao_b2b *mac) {
    memset(h, 0, AO_HEADER);
    memcpy(h, AO_MAGIC, 8);
    ao_put32(h + 8, AO_VERSION);
    ao_put32(h + 12, AO_HEADER);
    memcpy(h + 16, identity, 16);
    ao_put64(h + 32, (uint64_t)payload_len);
    ao_put32(h + 40, crc);
    ao_put32(h + 44, (uint32_t)key_len);
    memcpy(h + 48, key, (size_t)key_len);
    if (mac != NULL) {
        ao_put32(h + AO_MAC_TYPE_AT, AO_MAC_BLAKE2B);
        ao_b2b_update(mac, h, AO_MAC_AT);
        ao_b2b_final(mac, h + AO_MAC_AT);
    }
    ao_put32(h + 4092, ao_crc32c(0, h, 4092));
}

/* 0, or the -errno of a header that is not this block's: -EBADMSG (damaged, or another
 * payload size), -ESTALE (another namespace), -EKEYREJECTED (another key), -ENOKEY
 * (keyed: a block without a MAC; unkeyed: one with a MAC, which it cannot check). */
static int64_t ao_match_header(const uint8_t *h, const uint8_t *identity, int64_t payload_len,
                               const uint8_t *key, int32_t key_len, int keyed) {
    if (memcmp(h, AO_MAGIC, 8) != 0 || ao_get32(h + 8) != AO_VERSION ||
        ao_get32(h + 12) != AO_HEADER || ao_get32(h + 4092) != ao_crc32c(0, h, 4092))
        return -EBADMSG;
    if (ao_get64(h + 32) != (uint64_t)payload_len) return -EBADMSG;
    if (memcmp(h + 16, identity, 16) != 0) return -ESTALE;
    uint32_t stored_len = ao_get32(h + 44);
    if (stored_len != (uint32_t)key_len || memcmp(h + 48, key, stored_len) != 0)
        return -EKEYREJECTED;
    if (ao_get32(h + AO_MAC_TYPE_AT) != (keyed ? AO_MAC_BLAKE2B : 0u)) return -ENOKEY;
    return 0;
}

/* Checks the payload of a block whose header h matched: its CRC32C, then with mac (begun
 * with the key: ao_mac_begin) its MAC, copying it to dst (contiguous, unless NULL) 64 KiB
 * at a time on the way, from cache. 0, -EBADMSG (CRC) or -ENOKEY (MAC: another key, or
 * forged); on a failure dst holds part of it, not to be used. */
static int64_t ao_verify(const uint8_t *h, const uint8_t *payload, int64_t payload_len,
                         ao_b2b *mac, uint8_t *dst) {
    uint32_t crc = 0;
    for (int64_t done = 0; done < payload_len; done += 64 * 1024) {
        size_t n = (size_t)(payload_len - done < 64 * 1024 ? payload_len - done : 64 * 1024);
        crc = ao_crc32c(crc, payload + done, n);
        if (mac != NULL) ao_b2b_update(mac, payload + done, n);
        if (dst != NULL) memcpy(dst + done, payload + done, n);
    }
    if (crc != ao_get32(h + 40)) {
        if (mac != NULL) ao_wipe(mac, sizeof *mac);
        return -EBADMSG;
    }
    if (mac != NULL) {
        uint8_t want[AO_MAC_LEN];
        ao_b2b_update(mac, h, AO_MAC_AT);
        ao_b2b_final(mac, want);
        if (!ao_equal(want, h + AO_MAC_AT, AO_MAC_LEN)) return -ENOKEY;
    }
    return 0;
}

static void ao_build_header(const ao_pool *pool, const ao_op *op, uint8_t *h, uint32_t crc,
                            ao_b2b *mac) {
    ao_fill_header(h, pool->identity, pool->payload_len, crc, op->key, op->key_len, mac);
}

/* Checks a block's header against the pool and the op: 0, or the -errno of the read. */
static int64_t ao_check_header(const ao_pool *pool, const ao_op *op, const uint8_t *h) {
    return ao_match_header(h, pool->identity, pool->payload_len, op->key, op->key_len,
                           pool->mac_key_len > 0);
}

/* --- values of a key-value store (the shared tier) ------------------------------------ */

#define AO_CHUNK (64 * 1024)

static const ao_segs ao_one_seg = {1, 0, {0}};

static int ao_segmented(const ao_segs *s) {
    return s->nseg > 1;
}

/* Copies the payload of the block at host (its segments) to dst, contiguous, taking its
 * CRC32C 64 KiB at a time just after each piece is copied (while it is in cache), so the
 * payload is read from memory once. Returns the CRC. */
static uint32_t ao_gather(uint8_t *dst, const uint8_t *host, int64_t payload_len,
                          const ao_segs *s, ao_b2b *mac) {
    uint32_t crc = 0;
    int nseg = ao_segmented(s) ? s->nseg : 1;
    int64_t len = nseg > 1 ? s->seg_len : payload_len;
    for (int r = 0; r < nseg; r++) {
        const uint8_t *from = host + (nseg > 1 ? s->deltas[r] : 0);
        uint8_t *to = dst + (int64_t)r * len;
        for (int64_t done = 0; done < len; done += AO_CHUNK) {
            size_t n = (size_t)(len - done < AO_CHUNK ? len - done : AO_CHUNK);
            memcpy(to + done, from + done, n);
            crc = ao_crc32c(crc, to + done, n);
            if (mac != NULL) ao_b2b_update(mac, to + done, n);
        }
    }
    return crc;
}

/* Copies a checked contiguous payload at src into the block's segments at host. */
static void ao_scatter(uint8_t *host, const uint8_t *src, int64_t payload_len,
                       const ao_segs *s) {
    if (!ao_segmented(s)) {
        memcpy(host, src, (size_t)payload_len);
        return;
    }
    for (int r = 0; r < s->nseg; r++)
        memcpy(host + s->deltas[r], src + (int64_t)r * s->seg_len, (size_t)s->seg_len);
}

static void ao_pack_segs(uint8_t *value, const void *src, int64_t payload_len,
                         const uint8_t *identity, const uint8_t *key, int32_t key_len,
                         const ao_segs *s, const uint8_t *mac_key, int32_t mac_key_len) {
    ao_b2b state;
    ao_b2b *mac = ao_mac_begin(&state, mac_key, mac_key_len);
    uint32_t crc = ao_gather(value + AO_HEADER, (const uint8_t *)src, payload_len, s, mac);
    ao_fill_header(value, identity, payload_len, crc, key, key_len, mac);
}

static int64_t ao_unpack_segs(const uint8_t *value, int64_t value_len, void *dst,
                              int64_t payload_len, const uint8_t *identity, const uint8_t *key,
                              int32_t key_len, const ao_segs *s, const uint8_t *mac_key,
                              int32_t mac_key_len) {
    if (value_len < AO_HEADER + payload_len) return -ENODATA;
    int64_t bad = ao_match_header(value, identity, payload_len, key, key_len, mac_key_len > 0);
    if (bad != 0) return bad;
    ao_b2b state;
    ao_b2b *mac = ao_mac_begin(&state, mac_key, mac_key_len);
    const uint8_t *from = value + AO_HEADER;
    if (ao_segmented(s)) {
        /* Checked whole first: no slice of a damaged value reaches any rank's slot. */
        bad = ao_verify(value, from, payload_len, mac, NULL);
        if (bad != 0) return bad;
        ao_scatter((uint8_t *)dst, from, payload_len, s);
        return 0;
    }
    /* Each 64 KiB piece is checked, then copied from cache. */
    return ao_verify(value, from, payload_len, mac, (uint8_t *)dst);
}

/* Fills a segment description from (nseg, deltas): 0, or -3 for bad arguments (nseg
 * outside 1..AO_MAX_SEGS, deltas[0] != 0, a payload that does not split into nseg
 * slices). */
static int ao_segs_fill(ao_segs *s, int64_t payload_len, int nseg, const int64_t *deltas) {
    if (nseg < 1 || nseg > AO_MAX_SEGS) return -3;
    if (nseg > 1 && (deltas == NULL || deltas[0] != 0)) return -3;
    if (payload_len % nseg != 0) return -3;
    memset(s, 0, sizeof *s);
    s->nseg = nseg;
    s->seg_len = payload_len / nseg;
    for (int r = 0; r < nseg && nseg > 1; r++) s->deltas[r] = deltas[r];
    return 0;
}

/* Builds one stored value in place: the header, then the payload copied from src, its
 * CRC32C taken 64 KiB at a time just after each piece is copied (while it is in cache),
 * so the payload is read from memory once. value holds AO_HEADER + payload_len bytes. */
void ao_pack_value(uint8_t *value, const void *src, int64_t payload_len, const uint8_t *identity,
                   const uint8_t *key, int32_t key_len) {
    ao_pack_segs(value, src, payload_len, identity, key, key_len, &ao_one_seg, NULL, 0);
}

/* Checks one value read back for key and copies its payload to dst: 0, or -ENODATA (too
 * short), -EBADMSG, -ESTALE, -EKEYREJECTED (see ao_match_header), -EBADMSG for a payload
 * whose CRC32C does not match. Each 64 KiB piece is checksummed, then copied from cache;
 * on a mismatch dst holds part of the value and must not be used. */
int64_t ao_unpack_value(const uint8_t *value, int64_t value_len, void *dst, int64_t payload_len,
                        const uint8_t *identity, const uint8_t *key, int32_t key_len) {
    return ao_unpack_segs(value, value_len, dst, payload_len, identity, key, key_len,
                          &ao_one_seg, NULL, 0);
}

/* As ao_pack_value / ao_unpack_value for a payload in nseg equal slices (see ao_segs):
 * slice r at src + deltas[r]. A segmented value is checked whole before any slice is
 * copied out. -3 for bad segment arguments (nothing touched). */
int64_t ao_pack_value_segs(uint8_t *value, const void *src, int64_t payload_len,
                           const uint8_t *identity, const uint8_t *key, int32_t key_len,
                           int nseg, const int64_t *deltas) {
    ao_segs s;
    if (ao_segs_fill(&s, payload_len, nseg, deltas) != 0) return -3;
    ao_pack_segs(value, src, payload_len, identity, key, key_len, &s, NULL, 0);
    return 0;
}

int64_t ao_unpack_value_segs(const uint8_t *value, int64_t value_len, void *dst,
                             int64_t payload_len, const uint8_t *identity, const uint8_t *key,
                             int32_t key_len, int nseg, const int64_t *deltas) {
    ao_segs s;
    if (ao_segs_fill(&s, payload_len, nseg, deltas) != 0) return -3;
    return ao_unpack_segs(value, value_len, dst, payload_len, identity, key, key_len, &s,
                          NULL, 0);
}

/* As ao_pack_value_segs (nseg 1, deltas NULL: one run) for a block authenticated with
 * mac_key (1..64 bytes; mac_key_len 0: none): the header carries the keyed BLAKE2b-256
 * MAC of the payload and the header's fields. -3 for bad arguments (nothing touched). */
int64_t ao_pack_block(uint8_t *value, const void *src, int64_t payload_len,
                      const uint8_t *identity, const uint8_t *key, int32_t key_len, int nseg,
                      const int64_t *deltas, const uint8_t *mac_key, int32_t mac_key_len) {
    ao_segs s;
    if (ao_segs_fill(&s, payload_len, nseg, deltas) != 0) return -3;
    if (mac_key_len < 0 || mac_key_len > AO_B2B_MAX_KEY || (mac_key_len && mac_key == NULL))
        return -3;
    ao_pack_segs(value, src, payload_len, identity, key, key_len, &s, mac_key, mac_key_len);
    return 0;
}

/* As ao_unpack_value_segs, checking with mac_key (mac_key_len 0: an unauthenticated
 * block is wanted): -ENOKEY for a block without a MAC, with another key's, or (unkeyed)
 * with one. -3 for bad arguments. */
int64_t ao_unpack_block(const uint8_t *value, int64_t value_len, void *dst, int64_t payload_len,
                        const uint8_t *identity, const uint8_t *key, int32_t key_len, int nseg,
                        const int64_t *deltas, const uint8_t *mac_key, int32_t mac_key_len) {
    ao_segs s;
    if (ao_segs_fill(&s, payload_len, nseg, deltas) != 0) return -3;
    if (mac_key_len < 0 || mac_key_len > AO_B2B_MAX_KEY || (mac_key_len && mac_key == NULL))
        return -3;
    return ao_unpack_segs(value, value_len, dst, payload_len, identity, key, key_len, &s,
                          mac_key, mac_key_len);
}

/* --- blocks whose payload stays where it is (the Mooncake tier) ----------------------- */

/* The pieces of block i: [first[i], first[i + 1]) of (ptrs, lens), their lengths adding up
 * to payload_len; its key at keys + key_at[i], key_lens[i] bytes. The payload is read in
 * place, never copied: a store's value is the header and these pieces, sent as one object. */
static int ao_pieces_ok(int64_t i, const int64_t *lens, const int64_t *first,
                        int64_t payload_len, const int32_t *key_lens) {
    int64_t total = 0;
    if (first[i + 1] < first[i]) return 0;
    for (int64_t p = first[i]; p < first[i + 1]; p++) {
        if (lens[p] < 0) return 0;
        total += lens[p];
    }
    return total == payload_len && key_lens[i] > 0 && key_lens[i] <= 256;
}

/* A batch of blocks for ao_seal_blocks / ao_check_blocks, shared by the threads that run it. */
typedef struct {
    const uint64_t *headers;
    int64_t n;
    const uint64_t *ptrs;
    const int64_t *lens;
    const int64_t *first;
    const uint8_t *keys;
    const int64_t *key_at;
    const int32_t *key_lens;
    const uint8_t *identity;
    int64_t payload_len;
    const uint8_t *mac_key;
    int32_t mac_key_len;
    int64_t *results; /* NULL: seal; else check */
    int threads;
} ao_blocks;

typedef struct {
    const ao_blocks *b;
    int index;
} ao_blocks_part;

/* The CRC32C of block i's pieces, absorbed into mac too (unless NULL). */
static uint32_t ao_pieces_digest(const ao_blocks *b, int64_t i, ao_b2b *mac) {
    uint32_t crc = 0;
    for (int64_t p = b->first[i]; p < b->first[i + 1]; p++)
        crc = ao_digest(crc, (const uint8_t *)(uintptr_t)b->ptrs[p], (size_t)b->lens[p], mac);
    return crc;
}

static void ao_seal_one(const ao_blocks *b, int64_t i) {
    ao_b2b state;
    ao_b2b *mac = ao_mac_begin(&state, b->mac_key, b->mac_key_len);
    uint32_t crc = ao_pieces_digest(b, i, mac);
    ao_fill_header((uint8_t *)(uintptr_t)b->headers[i], b->identity, b->payload_len, crc,
                   b->keys + b->key_at[i], b->key_lens[i], mac);
}

static void ao_check_one(const ao_blocks *b, int64_t i) {
    int64_t *results = b->results;
    if (results[i] < 0) return;
    if (results[i] != AO_HEADER + b->payload_len) {
        results[i] = -ENODATA;
        return;
    }
    const uint8_t *h = (const uint8_t *)(uintptr_t)b->headers[i];
    int64_t bad = ao_match_header(h, b->identity, b->payload_len, b->keys + b->key_at[i],
                                  b->key_lens[i], b->mac_key_len > 0);
    if (bad == 0) {
        ao_b2b state;
        ao_b2b *mac = ao_mac_begin(&state, b->mac_key, b->mac_key_len);
        uint32_t crc = ao_pieces_digest(b, i, mac);
        if (crc != ao_get32(h + 40)) {
            if (mac != NULL) ao_wipe(mac, sizeof *mac);
            bad = -EBADMSG;
        } else if (mac != NULL) {
            uint8_t want[AO_MAC_LEN];
            ao_b2b_update(mac, h, AO_MAC_AT);
            ao_b2b_final(mac, want);
            if (!ao_equal(want, h + AO_MAC_AT, AO_MAC_LEN)) bad = -ENOKEY;
        }
    }
    results[i] = bad == 0 ? b->payload_len : bad;
}

/* Blocks index, index + threads, ... of a batch. */
static void *ao_blocks_part_run(void *arg) {
    const ao_blocks_part *part = (const ao_blocks_part *)arg;
    const ao_blocks *b = part->b;
    for (int64_t i = part->index; i < b->n; i += b->threads) {
        if (b->results == NULL)
            ao_seal_one(b, i);
        else
            ao_check_one(b, i);
    }
    return NULL;
}

/* Checks the arguments, then runs every block on b->threads threads (this one and the
 * others it starts and joins; one where a thread cannot be started). 0, or -3. */
static int64_t ao_blocks_run(ao_blocks *b) {
    if (b->n < 0 || b->mac_key_len < 0 || b->mac_key_len > AO_B2B_MAX_KEY ||
        (b->mac_key_len && !b->mac_key))
        return -3;
    for (int64_t i = 0; i < b->n; i++)
        if (!ao_pieces_ok(i, b->lens, b->first, b->payload_len, b->key_lens)) return -3;
    enum { AO_MAX_BLOCK_THREADS = 16 };
    int threads = b->threads < 1 ? 1 : b->threads;
    if (threads > AO_MAX_BLOCK_THREADS) threads = AO_MAX_BLOCK_THREADS;
    if (threads > b->n) threads = b->n > 0 ? (int)b->n : 1;
    pthread_t tids[AO_MAX_BLOCK_THREADS];
    ao_blocks_part parts[AO_MAX_BLOCK_THREADS];
    int started = 0;
    b->threads = threads;
    for (int t = 1; t < threads; t++) {
        parts[t].b = b;
        parts[t].index = t;
        if (pthread_create(&tids[t], NULL, ao_blocks_part_run, &parts[t]) != 0) break;
        started = t;
    }
    if (started + 1 < threads) {
        /* A thread could not be started: this one runs the parts of those missing. */
        for (int t = started + 1; t < threads; t++) {
            parts[t].b = b;
            parts[t].index = t;
            ao_blocks_part_run(&parts[t]);
        }
    }
    parts[0].b = b;
    parts[0].index = 0;
    ao_blocks_part_run(&parts[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    return 0;
}

/* Writes the header of each of n blocks at headers[i] (AO_HEADER bytes): the CRC32C (and
 * with mac_key, the keyed BLAKE2b MAC) of its pieces taken in place, the blocks spread
 * over threads threads. 0, or -3 for arguments that do not describe n blocks of
 * payload_len bytes (nothing written). */
int64_t ao_seal_blocks(const uint64_t *headers, int64_t n, const uint64_t *ptrs,
                       const int64_t *lens, const int64_t *first, const uint8_t *keys,
                       const int64_t *key_at, const int32_t *key_lens,
                       const uint8_t *identity, int64_t payload_len, const uint8_t *mac_key,
                       int32_t mac_key_len, int32_t threads) {
    ao_blocks b = {headers, n,           ptrs,    lens,        first, keys,  key_at, key_lens,
                   identity, payload_len, mac_key, mac_key_len, NULL,  threads};
    return ao_blocks_run(&b);
}

/* Checks each of n blocks read back (header at headers[i], payload in its pieces, as for
 * ao_seal_blocks, on threads threads). results[i] holds what the read gave (the bytes of
 * the object, or a negative code, left as it is) and becomes payload_len or the -errno of
 * the check: -ENODATA (not a block's size), then as ao_match_header and ao_verify. A block
 * that fails is not to be used: its pieces hold what came, unchecked. -3: bad arguments. */
int64_t ao_check_blocks(const uint64_t *headers, int64_t n, const uint64_t *ptrs,
                        const int64_t *lens, const int64_t *first, const uint8_t *keys,
                        const int64_t *key_at, const int32_t *key_lens,
                        const uint8_t *identity, int64_t payload_len, const uint8_t *mac_key,
                        int32_t mac_key_len, int64_t *results, int32_t threads) {
    ao_blocks b = {headers, n,           ptrs,    lens,        first,   keys,   key_at, key_lens,
                   identity, payload_len, mac_key, mac_key_len, results, threads};
    return ao_blocks_run(&b);
}

/* All of iov (count cnt) at offset, looping on short transfers and EINTR. Returns the
 * bytes moved (short only at end of file, for reads) or -errno. The iovecs are consumed. */
static int64_t ao_full_io(int fd, int write, struct iovec *iov, int cnt, int64_t offset) {
    int64_t done = 0;
    while (cnt > 0) {
        ssize_t r = write ? pwritev(fd, iov, cnt, (off_t)(offset + done))
                          : preadv(fd, iov, cnt, (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            /* O_DIRECT: after a short read at the end of the file, the next read starts
             * at an unaligned offset and fails with EINVAL: that is the end of the file. */
            if (!write && done > 0 && errno == EINVAL) break;
            return -(int64_t)errno;
        }
        if (r == 0) {
            if (write) return -EIO; /* no progress: never loop forever */
            break;                  /* end of file */
        }
        done += r;
        size_t left = (size_t)r;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return done;
}

typedef struct {
    ao_pool *pool;
    uint8_t *stage; /* slot_bytes, 4096-aligned: header, payload, padding */
} ao_worker;

/* Whether the payload can move straight between host memory and the file. */
static int ao_direct_ok(const ao_pool *pool, const ao_iojob *job, const ao_op *op) {
    return !ao_segmented(&job->segs) && (op->host % AO_ALIGN) == 0 &&
           (pool->payload_len % AO_ALIGN) == 0;
}

/* The directory a files-mode op's path is relative to: op->fd, a directory the pool's
 * owner opened once and holds (so a rename of any directory above it, or a directory
 * planted at its old path, changes nothing here); -1: the current directory (an
 * absolute path, tests of the pool alone). */
static int ao_dir_of(const ao_op *op) { return op->fd >= 0 ? op->fd : AT_FDCWD; }

/* Opens a block file, or -1 with errno set. Only a regular file is one: a symlink
 * fails (ELOOP: never followed out of the tier's directory), and a FIFO, device, socket or
 * directory fails with EINVAL. O_NONBLOCK keeps open() itself from blocking on a FIFO
 * with no writer (or a device); it is cleared again once the file is known to be regular. */
static int ao_open(int dir, const char *path, int flags, int direct) {
    int fd = -1;
    flags |= O_NOFOLLOW | O_NONBLOCK;
    if (direct && O_DIRECT) {
        do fd = openat(dir, path, flags | O_DIRECT, 0600);
        while (fd < 0 && errno == EINTR);
        if (fd < 0 && errno != EINVAL) return -1;
        /* EINVAL: the file system refuses O_DIRECT (tmpfs of old kernels ...): buffered. */
    }
    if (fd < 0) {
        do fd = openat(dir, path, flags, 0600);
        while (fd < 0 && errno == EINTR);
        if (fd < 0) return -1;
    }
    struct stat st;
    int e = 0;
    int fl = -1;
    if (fstat(fd, &st) != 0) e = errno;
    else if (!S_ISREG(st.st_mode)) e = EINVAL;
    else if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        e = errno;
    if (e) {
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int64_t ao_do_write(ao_worker *w, const ao_iojob *job, const ao_op *op) {
    ao_pool *pool = w->pool;
    size_t plen = (size_t)pool->payload_len;
    size_t slot = (size_t)pool->slot_bytes;
    const uint8_t *host = (const uint8_t *)(intptr_t)op->host;
    uint8_t *stage = w->stage;
    struct iovec iov[2];
    int cnt;
    ao_b2b state;
    ao_b2b *mac = ao_mac_begin(&state, pool->mac_key, pool->mac_key_len);
    if (ao_direct_ok(pool, job, op)) {
        ao_build_header(pool, op, stage, ao_digest(0, host, plen, mac), mac);
        iov[0].iov_base = stage;
        iov[0].iov_len = AO_HEADER;
        iov[1].iov_base = (void *)host;
        iov[1].iov_len = plen;
        cnt = plen ? 2 : 1;
    } else {
        uint32_t crc = ao_gather(stage + AO_HEADER, host, (int64_t)plen, &job->segs, mac);
        memset(stage + AO_HEADER + plen, 0, slot - AO_HEADER - plen);
        ao_build_header(pool, op, stage, crc, mac);
        iov[0].iov_base = stage;
        iov[0].iov_len = slot;
        cnt = 1;
    }
    if (op->path == NULL) {
        int64_t r = ao_full_io(op->fd, 1, iov, cnt, op->offset);
        return r < 0 ? r : pool->payload_len;
    }
    /* Files mode: a temporary name of this thread's, renamed into place when whole. */
    size_t plen_path = strlen(op->path);
    char *tmp = (char *)malloc(plen_path + 80);
    if (tmp == NULL) return -ENOMEM;
    snprintf(tmp, plen_path + 80, "%s.tmp.%ld.%ld.%llu", op->path, (long)getpid(),
             (long)syscall(SYS_gettid),
             (unsigned long long)__atomic_fetch_add(&ao_tmp_counter, 1, __ATOMIC_RELAXED));
    int dir = ao_dir_of(op);
    int direct = pool->flags & AO_FLAG_DIRECT;
    int fd = ao_open(dir, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, direct);
    if (fd < 0) {
        int64_t e = -(int64_t)errno;
        free(tmp);
        return e;
    }
    int64_t r = ao_full_io(fd, 1, iov, cnt, 0);
    if (close(fd) != 0 && r >= 0 && errno != EINTR) r = -(int64_t)errno;
    if (r >= 0 && renameat(dir, tmp, dir, op->path) != 0) r = -(int64_t)errno;
    if (r < 0) unlinkat(dir, tmp, 0);
    free(tmp);
    return r < 0 ? r : pool->payload_len;
}

static int64_t ao_do_read(ao_worker *w, const ao_iojob *job, const ao_op *op) {
    ao_pool *pool = w->pool;
    size_t plen = (size_t)pool->payload_len;
    size_t slot = (size_t)pool->slot_bytes;
    uint8_t *host = (uint8_t *)(intptr_t)op->host;
    uint8_t *stage = w->stage;
    int direct = ao_direct_ok(pool, job, op);
    struct iovec iov[2];
    int cnt;
    if (direct) {
        /* payload_len % 4096 == 0: the host slot takes the whole padded payload. */
        iov[0].iov_base = stage;
        iov[0].iov_len = AO_HEADER;
        iov[1].iov_base = host;
        iov[1].iov_len = plen;
        cnt = plen ? 2 : 1;
    } else {
        iov[0].iov_base = stage;
        iov[0].iov_len = slot;
        cnt = 1;
    }
    int fd = op->fd;
    if (op->path != NULL) {
        int direct = pool->flags & AO_FLAG_DIRECT;
        fd = ao_open(ao_dir_of(op), op->path, O_RDONLY | O_CLOEXEC, direct);
        if (fd < 0) return -(int64_t)errno;
    }
    int64_t r = ao_full_io(fd, 0, iov, cnt, op->path ? 0 : op->offset);
    if (op->path != NULL) close(fd);
    if (r < 0) return r;
    if ((uint64_t)r < (uint64_t)AO_HEADER + plen) return -ENODATA;
    int64_t bad = ao_check_header(pool, op, stage);
    if (bad) return bad;
    const uint8_t *payload = direct ? host : stage + AO_HEADER;
    ao_b2b state;
    bad = ao_verify(stage, payload, (int64_t)plen,
                    ao_mac_begin(&state, pool->mac_key, pool->mac_key_len), NULL);
    if (bad) return bad;
    if (!direct) ao_scatter(host, payload, (int64_t)plen, &job->segs);
    return pool->payload_len;
}

static int64_t ao_run_op(ao_worker *w, const ao_iojob *job, const ao_op *op) {
    ao_pool *pool = w->pool;
    if (job->deadline > 0 && ao_now() > job->deadline) return -ETIMEDOUT;
    int gate = __atomic_load_n(&pool->gate_fd, __ATOMIC_ACQUIRE);
    if (gate >= 0) {
        /* Tests: held here, as in a system call that hangs, until the gate opens. */
        struct pollfd p = {gate, POLLIN, 0};
        while (poll(&p, 1, -1) < 0 && errno == EINTR) {
        }
    }
    int64_t delay = __atomic_load_n(&pool->delay_ns, __ATOMIC_RELAXED);
    if (delay > 0) ao_sleep_ns(delay);
    if (job->write == AO_KIND_UNLINK) {
        /* No injected faults here: they count reads and writes. */
        if (unlinkat(ao_dir_of(op), op->path, 0) != 0 && errno != ENOENT) return -(int64_t)errno;
        return 0;
    }
    int dir = (job->write == AO_KIND_WRITE || job->write == AO_KIND_PACK) ? 1 : 0;
    int64_t every = __atomic_load_n(&pool->fault_every[dir], __ATOMIC_RELAXED);
    if (every > 0) {
        int64_t k = __atomic_add_fetch(&pool->fault_count[dir], 1, __ATOMIC_RELAXED);
        if (k % every == 0) return -(int64_t)__atomic_load_n(&pool->fault_err[dir], __ATOMIC_RELAXED);
    }
    if (job->write == AO_KIND_PACK) {
        /* op->offset: the value buffer (AO_HEADER + payload_len bytes); op->host: the payload */
        ao_pack_segs((uint8_t *)(intptr_t)op->offset, (const void *)(intptr_t)op->host,
                     pool->payload_len, pool->identity, op->key, op->key_len, &job->segs,
                     pool->mac_key, pool->mac_key_len);
        return pool->payload_len;
    }
    if (job->write == AO_KIND_UNPACK) {
        /* op->offset: a value of at least AO_HEADER + payload_len bytes; op->host: where
         * its payload goes */
        int64_t r = ao_unpack_segs((const uint8_t *)(intptr_t)op->offset,
                                   AO_HEADER + pool->payload_len, (void *)(intptr_t)op->host,
                                   pool->payload_len, pool->identity, op->key, op->key_len,
                                   &job->segs, pool->mac_key, pool->mac_key_len);
        return r == 0 ? pool->payload_len : r;
    }
    if (w->stage == NULL) {
        void *mem = NULL;
        if (posix_memalign(&mem, AO_ALIGN, (size_t)pool->slot_bytes) != 0) return -ENOMEM;
        w->stage = (uint8_t *)mem;
    }
    return job->write == AO_KIND_WRITE ? ao_do_write(w, job, op) : ao_do_read(w, job, op);
}

/* Under the pool mutex: the job is over (every op ended or discarded). */
static void ao_job_end_locked(ao_pool *pool, ao_iojob *job, int64_t state) {
    job->status[1] = ao_now();
    __atomic_store_n(&job->status[0], state, __ATOMIC_RELEASE);
    free(job);
    /* Under the mutex: once ao_io_set_wake_fd has returned, the fd it replaced is never
     * written again (its owner may close it). */
    ao_wake(pool->wake_fd);
}

static void ao_op_ended(ao_pool *pool, ao_iojob *job, int64_t n) {
    if (__atomic_sub_fetch(&job->remaining, n, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_lock(&pool->mutex);
        ao_job_end_locked(pool, job, 1);
        pthread_mutex_unlock(&pool->mutex);
    }
}

/* Whether the op is a files-mode write or unlink: ordered with the others of its file. */
static int ao_keyed(const ao_iojob *job, const ao_op *op) {
    return (job->write == AO_KIND_WRITE || job->write == AO_KIND_UNLINK) && op->path != NULL;
}

/* Under the mutex: whether an op of the same file taken before busy[slot] still runs. */
static int ao_behind(const ao_pool *pool, int slot) {
    const ao_busy *me = &pool->busy[slot];
    for (int j = 0; j < pool->busy_n; j++) {
        const ao_busy *b = &pool->busy[j];
        if (j != slot && b->path != NULL && b->seq < me->seq && b->dir == me->dir &&
            strcmp(b->path, me->path) == 0)
            return 1;
    }
    return 0;
}

/* Under the mutex: file the keyed op just taken as busy and wait until every op of its
 * file taken before it ended; its busy entry (a worker holds at most one). */
static int ao_claim(ao_pool *pool, const ao_op *op) {
    int slot = 0;
    while (pool->busy[slot].path != NULL) slot++;
    ao_busy *b = &pool->busy[slot];
    b->path = op->path;
    b->dir = ao_dir_of(op);
    b->seq = ++pool->busy_seq;
    while (ao_behind(pool, slot)) pthread_cond_wait(&pool->busy_cond, &pool->mutex);
    return slot;
}

static ao_iojob *ao_take_from(ao_queue *q, int64_t *index);
static int ao_writers_starve(ao_pool *pool, int64_t now);
/* What a worker takes: reads first, then writes (one set of lanes); reads (and help with
 * writes); writes. */
#define AO_LANE_BOTH 0
#define AO_LANE_READ 1
#define AO_LANE_WRITE 2
/* A write job waits this long for a write lane before an idle read lane may take it (and
 * the write lanes' starvation is sampled at most this often). */
#define AO_WRITE_HELP_NS 20000000LL

/* Under the mutex: the next op for a lane of kind `lane`, or NULL; a read lane with no
 * read takes a write op whose job has waited AO_WRITE_HELP_NS while the write lanes
 * starve (*helps: 1; *help_at: when to look again, 0: when woken). */
static ao_iojob *ao_take(ao_pool *pool, int64_t *index, int lane, int64_t *help_at,
                         int *helps) {
    *help_at = 0;
    *helps = 0;
    if (lane == AO_LANE_BOTH)
        return ao_take_from(pool->reads.head ? &pool->reads : &pool->writes, index);
    if (lane == AO_LANE_WRITE) {
        if (pool->writers_paused && !pool->stopping) return NULL;
        return ao_take_from(&pool->writes, index);
    }
    if (pool->reads.head != NULL || pool->writes.head == NULL)
        return ao_take_from(&pool->reads, index);
    if (pool->stopping) return ao_take_from(&pool->writes, index); /* drain */
    int cap = pool->lanes > 1 ? pool->lanes - 1 : 1;
    if (pool->helping >= cap) return NULL;
    int64_t now = ao_now();
    int64_t at = pool->writes.head->queued + AO_WRITE_HELP_NS;
    if (now < at) {
        *help_at = at;
        return NULL;
    }
    if (!ao_writers_starve(pool, now)) {
        *help_at = pool->sampled_at + AO_WRITE_HELP_NS;
        return NULL;
    }
    pool->helped++;
    pool->helping++;
    *helps = 1;
    return ao_take_from(&pool->writes, index);
}

/* Read a small /proc file into buf (NUL-terminated); its length, or -1. */
static ssize_t ao_read_proc(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    return n;
}

/* A thread's time on a CPU so far (ns; schedstat's first field) and whether it is
 * runnable (stat's state 'R': on a CPU or waiting for one); 0, or -1 if unreadable. */
static int ao_lane_sample(int64_t tid, int64_t *run, int *runnable) {
    char path[64], buf[512];
    unsigned long long ran = 0;
    snprintf(path, sizeof path, "/proc/self/task/%lld/schedstat", (long long)tid);
    if (ao_read_proc(path, buf, sizeof buf) < 0 || sscanf(buf, "%llu", &ran) != 1) return -1;
    snprintf(path, sizeof path, "/proc/self/task/%lld/stat", (long long)tid);
    if (ao_read_proc(path, buf, sizeof buf) < 0) return -1;
    const char *end = strrchr(buf, ')'); /* the name may hold anything but this */
    if (end == NULL || end[1] != ' ') return -1;
    *run = (int64_t)ran;
    *runnable = end[2] == 'R';
    return 0;
}

/* Under the mutex: whether the write lanes starve for CPU (see the top of this file): a
 * lane runnable at two samples AO_WRITE_HELP_NS or more apart that was on a CPU for less
 * than half the time between (run-queue waits are counted only once a thread runs again,
 * so its state and time on CPU tell instead); paused lanes (tests) starve. */
static int ao_writers_starve(ao_pool *pool, int64_t now) {
    if (pool->writers_paused) return 1;
    int64_t span = now - pool->sampled_at;
    if (span < AO_WRITE_HELP_NS) return pool->starving;
    int starving = 0, unknown = 0;
    for (int k = 0; k < pool->lanes; k++) {
        int64_t tid = __atomic_load_n(&pool->write_tids[k], __ATOMIC_ACQUIRE);
        int64_t run = 0;
        int runnable = 0;
        if (tid == 0 || ao_lane_sample(tid, &run, &runnable) != 0) {
            unknown = 1;
            continue;
        }
        if (pool->sampled_at && runnable && pool->write_runnable[k] &&
            2 * (run - pool->write_runs[k]) < span)
            starving = 1;
        pool->write_runs[k] = run;
        pool->write_runnable[k] = runnable;
    }
    /* The first sample has nothing to compare (the next, AO_WRITE_HELP_NS later, will);
     * an unreadable one: help, as on time alone. */
    pool->starving = starving || unknown;
    pool->sampled_at = now;
    return pool->starving;
}

static ao_iojob *ao_take_from(ao_queue *q, int64_t *index) {
    ao_iojob *job = q->head;
    if (job == NULL) return NULL;
    *index = job->taken++;
    if (job->taken == job->n) {
        q->head = job->next;
        if (q->head == NULL) q->tail = NULL;
    }
    return job;
}

typedef struct {
    ao_pool *pool;
    int kind;  /* AO_LANE_* */
    int index; /* among the write lanes */
} ao_lane;

/* A write lane, first thing: SCHED_IDLE where the system has it (counted where not).
 * (glibc's pthread_attr_setschedpolicy takes no SCHED_IDLE: a lane cannot start in it.) */
static void ao_lower_priority(ao_pool *pool) {
#ifdef SCHED_IDLE
    struct sched_param param;
    memset(&param, 0, sizeof param);
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &param) == 0) return;
#endif
    __atomic_add_fetch(&pool->idle_failed, 1, __ATOMIC_RELAXED);
}

/* Until help_at (ns, CLOCK_MONOTONIC), on a condition variable that uses CLOCK_MONOTONIC. */
static void ao_wait_until(pthread_cond_t *cond, pthread_mutex_t *mutex, int64_t help_at) {
    struct timespec ts = {(time_t)(help_at / 1000000000LL), (long)(help_at % 1000000000LL)};
    pthread_cond_timedwait(cond, mutex, &ts);
}

static void *ao_worker_main(void *arg) {
    ao_lane lane = *(ao_lane *)arg;
    free(arg);
    ao_worker w = {lane.pool, NULL};
    ao_pool *pool = w.pool;
    if (lane.kind == AO_LANE_WRITE) {
        ao_lower_priority(pool);
        __atomic_store_n(&pool->write_tids[lane.index], (int64_t)syscall(SYS_gettid),
                         __ATOMIC_RELEASE);
    }
    pthread_cond_t *cond = lane.kind == AO_LANE_READ ? &pool->rcond : &pool->cond;
    for (;;) {
        pthread_mutex_lock(&pool->mutex);
        int64_t i = 0, help_at = 0;
        int helps = 0;
        ao_iojob *job;
        while ((job = ao_take(pool, &i, lane.kind, &help_at, &helps)) == NULL &&
               !pool->stopping) {
            if (help_at) ao_wait_until(cond, &pool->mutex, help_at);
            else pthread_cond_wait(cond, &pool->mutex);
        }
        int slot = job != NULL && ao_keyed(job, &job->ops[i]) ? ao_claim(pool, &job->ops[i]) : -1;
        pthread_mutex_unlock(&pool->mutex);
        if (job == NULL) break; /* stopping and drained */
        if (i == 0) job->status[2] = ao_now();
        job->results[i] = ao_run_op(&w, job, &job->ops[i]);
        if (slot >= 0) { /* before the job may be freed: the entry points into it */
            pthread_mutex_lock(&pool->mutex);
            pool->busy[slot].path = NULL;
            pthread_cond_broadcast(&pool->busy_cond);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (helps) {
            pthread_mutex_lock(&pool->mutex);
            pool->helping--;
            pthread_mutex_unlock(&pool->mutex);
        }
        ao_op_ended(pool, job, 1);
    }
    free(w.stage);
    return NULL;
}

/* The pool's memory (its threads joined, its locks destroyed, or never made). */
static void ao_pool_free(ao_pool *pool) {
    free(pool->busy);
    free(pool->write_tids);
    free(pool->write_runs);
    free(pool->write_runnable);
    free(pool);
}

void ao_io_destroy(void *handle);

void *ao_io_create(int nthreads, int wake_fd, int64_t payload_len, const uint8_t *identity16,
                   int flags) {
    if (nthreads < 1 || nthreads > 256 || payload_len < 0 || identity16 == NULL) return NULL;
    pthread_once(&ao_crc_once, ao_crc_init);
    int lanes = nthreads;
    if (flags & AO_FLAG_WRITE_IDLE) nthreads *= 2; /* read lanes, then write lanes */
    ao_pool *pool = (ao_pool *)calloc(1, sizeof *pool + (size_t)nthreads * sizeof(pthread_t));
    if (pool == NULL) return NULL;
    pool->busy = (ao_busy *)calloc((size_t)nthreads, sizeof(ao_busy));
    pool->write_tids = (int64_t *)calloc((size_t)lanes, sizeof(int64_t));
    pool->write_runs = (int64_t *)calloc((size_t)lanes, sizeof(int64_t));
    pool->write_runnable = (int *)calloc((size_t)lanes, sizeof(int));
    if (pool->busy == NULL || pool->write_tids == NULL || pool->write_runs == NULL ||
        pool->write_runnable == NULL) {
        ao_pool_free(pool);
        return NULL;
    }
    pool->busy_n = nthreads;
    pool->lanes = lanes;
    pool->wake_fd = wake_fd;
    pool->gate_fd = -1;
    pool->flags = flags;
    pool->payload_len = payload_len;
    pool->slot_bytes = AO_HEADER + (payload_len + AO_ALIGN - 1) / AO_ALIGN * AO_ALIGN;
    memcpy(pool->identity, identity16, 16);
    ao_segs_fill(&pool->segs, payload_len, 1, NULL);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_condattr_t monotonic; /* the read lanes' timed waits: CLOCK_MONOTONIC, as ao_now */
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&pool->cond, NULL);
    pthread_cond_init(&pool->rcond, &monotonic);
    pthread_condattr_destroy(&monotonic);
    pthread_cond_init(&pool->busy_cond, NULL);
    for (int t = 0; t < nthreads; t++) {
        ao_lane *lane = (ao_lane *)malloc(sizeof *lane);
        if (lane != NULL) {
            lane->pool = pool;
            lane->kind = nthreads == lanes ? AO_LANE_BOTH
                         : t < lanes        ? AO_LANE_READ
                                            : AO_LANE_WRITE;
            lane->index = t - lanes;
        }
        if (lane == NULL || pthread_create(&pool->threads[t], NULL, ao_worker_main, lane) != 0) {
            free(lane);
            ao_io_destroy(pool); /* stops and joins the pool->nthreads (t) started */
            return NULL;
        }
        pool->nthreads = t + 1;
    }
    return pool;
}

void ao_io_set_wake_fd(void *handle, int fd) {
    ao_pool *pool = (ao_pool *)handle;
    pthread_mutex_lock(&pool->mutex);
    pool->wake_fd = fd;
    pthread_mutex_unlock(&pool->mutex);
}

/*
 * Queue a job of n ops (write: an AO_KIND_*: 1 writes, 0 reads, 2 packs, 3 unpacks, 4
 * unlinks: each op's path relative to its fd, no host memory; result 0 once the file is
 * gone). The ops, keys and paths are copied now; the host memory (and a pack's or unpack's value,
 * at op->offset), the fds, status (3 words, zeroed) and results (n words) must stay
 * valid until the job's state is set. Returns 0, -1 out of memory, -2 when the
 * pool is stopping, -3 for bad arguments.
 */
int ao_io_submit(void *handle, int write, int64_t n, const ao_io_op *ops, int64_t deadline_ns,
                 int64_t *status, int64_t *results) {
    ao_pool *pool = (ao_pool *)handle;
    if (n < 0 || status == NULL || (n > 0 && (ops == NULL || results == NULL))) return -3;
    if (write < AO_KIND_READ || write > AO_KIND_UNLINK) return -3;
    size_t extra = 0;
    for (int64_t i = 0; i < n; i++) {
        const ao_io_op *op = &ops[i];
        if (op->key_len < 1 || op->key_len > AO_KEY_MAX || op->key == NULL) return -3;
        if (write == AO_KIND_UNLINK ? op->path == NULL : op->host == 0 && pool->payload_len > 0)
            return -3;
        extra += (size_t)op->key_len;
        if (op->path) extra += strlen(op->path) + 1;
    }
    ao_iojob *job = (ao_iojob *)malloc(sizeof *job + (size_t)n * sizeof(ao_op) + extra);
    if (job == NULL) return -1;
    job->next = NULL;
    job->status = status;
    job->results = results;
    job->n = n;
    job->taken = 0;
    job->remaining = n;
    job->deadline = deadline_ns;
    job->write = write;
    char *blob = (char *)&job->ops[n];
    for (int64_t i = 0; i < n; i++) {
        const ao_io_op *src = &ops[i];
        ao_op *dst = &job->ops[i];
        dst->host = src->host;
        dst->offset = src->offset;
        dst->fd = src->fd;
        dst->key_len = src->key_len;
        memcpy(blob, src->key, (size_t)src->key_len);
        dst->key = (const uint8_t *)blob;
        blob += src->key_len;
        dst->path = NULL;
        if (src->path) {
            size_t len = strlen(src->path) + 1;
            memcpy(blob, src->path, len);
            dst->path = blob;
            blob += len;
        }
        results[i] = 0;
    }
    pthread_mutex_lock(&pool->mutex);
    job->segs = pool->segs;
    if (pool->stopping) {
        pthread_mutex_unlock(&pool->mutex);
        free(job);
        return -2;
    }
    if (n == 0) {
        status[2] = ao_now();
        ao_job_end_locked(pool, job, 1);
        pthread_mutex_unlock(&pool->mutex);
        return 0;
    }
    int read = write == AO_KIND_READ || write == AO_KIND_UNPACK;
    ao_queue *q = read ? &pool->reads : &pool->writes;
    job->queued = ao_now();
    int first = q->head == NULL;
    if (q->tail) q->tail->next = job; else q->head = job;
    q->tail = job;
    int split = pool->flags & AO_FLAG_WRITE_IDLE;
    pthread_cond_t *cond = read && split ? &pool->rcond : &pool->cond;
    if (n == 1) pthread_cond_signal(cond); else pthread_cond_broadcast(cond);
    /* A read lane waiting for nothing learns when this write may need its help. */
    if (split && !read && first) pthread_cond_signal(&pool->rcond);
    pthread_mutex_unlock(&pool->mutex);
    return 0;
}

int64_t ao_io_status_load(const int64_t *status) {
    return __atomic_load_n(&status[0], __ATOMIC_ACQUIRE);
}

/*
 * Discard the ops still queued (not those running): each gets -ECANCELED. A job none of
 * whose ops had started ends with the state -ECANCELED; one partly started ends (state
 * 1) when its running ops end. Returns how many jobs lost ops.
 */
int64_t ao_io_cancel(void *handle) {
    ao_pool *pool = (ao_pool *)handle;
    int64_t count = 0;
    pthread_mutex_lock(&pool->mutex);
    ao_queue *queues[2] = {&pool->reads, &pool->writes};
    for (int qi = 0; qi < 2; qi++) {
        ao_iojob *job = queues[qi]->head;
        queues[qi]->head = queues[qi]->tail = NULL;
        while (job != NULL) {
            ao_iojob *next = job->next;
            int64_t untaken = job->n - job->taken;
            for (int64_t i = job->taken; i < job->n; i++) job->results[i] = -ECANCELED;
            int unrun = job->taken == 0;
            job->taken = job->n;
            if (__atomic_sub_fetch(&job->remaining, untaken, __ATOMIC_ACQ_REL) == 0) {
                if (unrun) job->status[2] = ao_now();
                ao_job_end_locked(pool, job, unrun ? -(int64_t)ECANCELED : 1);
            }
            count++;
            job = next;
        }
    }
    pthread_mutex_unlock(&pool->mutex);
    return count;
}

/* Finish the queued jobs, stop and join the threads, free the pool. */
void ao_io_destroy(void *handle) {
    ao_pool *pool = (ao_pool *)handle;
    pthread_mutex_lock(&pool->mutex);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->cond);
    pthread_cond_broadcast(&pool->rcond);
    pthread_mutex_unlock(&pool->mutex);
    for (int t = 0; t < pool->nthreads; t++) pthread_join(pool->threads[t], NULL);
    if (pool->gate_fd >= 0) close(pool->gate_fd);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->cond);
    pthread_cond_destroy(&pool->rcond);
    pthread_cond_destroy(&pool->busy_cond);
    ao_wipe(pool->mac_key, sizeof pool->mac_key);
    ao_pool_free(pool);
}

/* Tests: from now on every every_nth-th op of that direction (1: each, 0: none) ends
 * with -err without touching the file. */
void ao_io_set_fault(void *handle, int write, int64_t every_nth, int err) {
    ao_pool *pool = (ao_pool *)handle;
    int dir = write ? 1 : 0;
    pthread_mutex_lock(&pool->mutex);
    __atomic_store_n(&pool->fault_err[dir], err, __ATOMIC_RELAXED);
    __atomic_store_n(&pool->fault_count[dir], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool->fault_every[dir], every_nth > 0 ? every_nth : 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool->mutex);
}

/* Authenticate blocks with key (1..64 bytes; len 0: no MAC, the default): writes and packs
 * carry its keyed BLAKE2b-256 MAC, reads and unpacks require it (-ENOKEY). To be set
 * before the first job is submitted. 0, or -3 for a bad length. */
int ao_io_set_mac(void *handle, const uint8_t *key, int32_t len) {
    ao_pool *pool = (ao_pool *)handle;
    if (len < 0 || len > AO_B2B_MAX_KEY || (len > 0 && key == NULL)) return -3;
    pthread_mutex_lock(&pool->mutex);
    ao_wipe(pool->mac_key, sizeof pool->mac_key);
    if (len > 0) memcpy(pool->mac_key, key, (size_t)len);
    pool->mac_key_len = len;
    pthread_mutex_unlock(&pool->mutex);
    return 0;
}

/* Jobs submitted from now on find each block's payload in nseg slices (see ao_segs):
 * 0, or -3 for bad arguments (the pool unchanged). */
int ao_io_set_segments(void *handle, int nseg, const int64_t *deltas) {
    ao_pool *pool = (ao_pool *)handle;
    ao_segs s;
    if (ao_segs_fill(&s, pool->payload_len, nseg, deltas) != 0) return -3;
    pthread_mutex_lock(&pool->mutex);
    pool->segs = s;
    pthread_mutex_unlock(&pool->mutex);
    return 0;
}

/* Tests: from now on each op, once past its deadline check, waits until fd polls
 * readable or hung up (a pipe whose write end is closed opens the gate for good); -1
 * removes the gate. The pool keeps a duplicate of fd (closed when replaced or at
 * ao_io_destroy), so the caller may close its own. Not to be replaced while an op waits
 * at it. 0, or -1 with errno set when fd cannot be duplicated. */
int ao_io_set_gate(void *handle, int fd) {
    ao_pool *pool = (ao_pool *)handle;
    int dup_fd = -1;
    if (fd >= 0 && (dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0) return -1;
    int old = __atomic_exchange_n(&pool->gate_fd, dup_fd, __ATOMIC_ACQ_REL);
    if (old >= 0) close(old);
    return 0;
}

/* Tests: sleep delay_ns before each op (a slow disk). */
void ao_io_set_delay(void *handle, int64_t delay_ns) {
    ao_pool *pool = (ao_pool *)handle;
    __atomic_store_n(&pool->delay_ns, delay_ns > 0 ? delay_ns : 0, __ATOMIC_RELAXED);
}

/* Tests: write lanes take nothing while on (a machine whose CPUs are all busy: read lanes
 * take the writes that waited AO_WRITE_HELP_NS). */
void ao_io_pause_writers(void *handle, int on) {
    ao_pool *pool = (ao_pool *)handle;
    pthread_mutex_lock(&pool->mutex);
    pool->writers_paused = on != 0;
    pthread_cond_broadcast(&pool->cond);
    pthread_mutex_unlock(&pool->mutex);
}

/* [write ops a read lane took, write lanes that could not take SCHED_IDLE]. */
void ao_io_lanes_info(void *handle, int64_t *out2) {
    ao_pool *pool = (ao_pool *)handle;
    pthread_mutex_lock(&pool->mutex);
    out2[0] = pool->helped;
    pthread_mutex_unlock(&pool->mutex);
    out2[1] = __atomic_load_n(&pool->idle_failed, __ATOMIC_RELAXED);
}
