/* The request-scoped CPU-tier manager, as a CPython extension.
 *
 * A port of asyncoffload/manager/cpu.py (CPUOffloadingManager with request_scoped=True,
 * no admission filter, store_threshold < 2) together with the policies lru, arc, kv
 * (default options), s3fifo and sieve (asyncoffload/manager/policies/). The Python code
 * is the reference: every decision (slot ids, victims, admissions, events, lookups,
 * errors, counters, request folding, what kv learns) is the same, call for call
 * (tests/test_mgrcore.py drives both in lockstep). Compiled on first use by
 * asyncoffload._native.load_mgrcore. Everything runs under the GIL.
 *
 * State. Every key the manager knows (resident: being stored or ready; or a policy's
 * ghost; for kv also a key touched and never stored) has a node in one growable array;
 * an open-addressing table maps keys to node indices. A node is on exactly one intrusive
 * doubly linked list: lists below GHOST_BASE hold resident nodes, the others remembered
 * ones; what each list means is the policy's (a small vtable).
 *
 * Keys are exact bytes (vLLM's and asyncoffload's OffloadKey). Bytes cannot take part
 * in reference cycles, so the GC is shown only the containers the core holds.
 *
 * Failure. A call validates all its input and allocates what it may need before it
 * changes anything, so a rejected call (bad key, duplicate, unknown key, no memory)
 * changes nothing; only appending an event can still fail afterwards (MemoryError with
 * the state consistent and that event lost).
 *
 * Reentrancy. Python code can run inside a call (a context's req_id property, a
 * finalizer run by the collector, a mapping's get): a call that changes the manager is
 * refused (RuntimeError) while another is in progress, so node indices resolved at the
 * start of a call stay valid to its end. Lookups and reads are allowed.
 *
 * Beside the manager, module functions serve the engine's hot path: three check its
 * input (keys, block ids, repeated keys) in one pass for the common case, and leave the
 * rest to asyncoffload/_checks.py; one hands a small copy's block ids to the native copy
 * engine.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NIL (-1)
#define NO_LIST 255
#define MAX_NUM_BLOCKS (1 << 28)
#define S3FIFO_MAX_FREQ 3

/* lists: resident ones first (kv has a queue per class), then remembered ones */
#define KV_CLASSES 15
#define GHOST_BASE KV_CLASSES
#define NUM_LISTS (GHOST_BASE + 2)

/* request-log flags of a key */
#define F_INSERTED 1
#define F_REUSED 2
#define F_MISSED 4

/* --- the key table ------------------------------------------------------------------ */

typedef struct {
    Py_hash_t hash;
    PyObject *key; /* borrowed: the node or log entry it indexes owns it */
    int32_t idx;   /* NIL: empty */
} TabSlot;

typedef struct {
    TabSlot *slots;
    size_t mask;
    Py_ssize_t used;
} Tab;

static inline int keys_equal(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
}

static void tab_free(Tab *t) {
    PyMem_Free(t->slots);
    t->slots = NULL;
    t->mask = 0;
    t->used = 0;
}

static int tab_alloc(Tab *t, size_t size) {
    TabSlot *slots = PyMem_Malloc(size * sizeof(TabSlot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < size; i++) slots[i].idx = NIL;
    t->slots = slots;
    t->mask = size - 1;
    t->used = 0;
    return 0;
}

static int32_t tab_find(const Tab *t, PyObject *key, Py_hash_t h) {
    if (!t->slots) return NIL;
    size_t i = (size_t)h & t->mask;
    for (;;) {
        const TabSlot *s = &t->slots[i];
        if (s->idx == NIL) return NIL;
        if (s->hash == h && keys_equal(s->key, key)) return s->idx;
        i = (i + 1) & t->mask;
    }
}

/* insert a key known to be absent; the table must have room (tab_reserve) */
static void tab_put(Tab *t, PyObject *key, Py_hash_t h, int32_t idx) {
    size_t i = (size_t)h & t->mask;
    while (t->slots[i].idx != NIL) i = (i + 1) & t->mask;
    t->slots[i].hash = h;
    t->slots[i].key = key;
    t->slots[i].idx = idx;
    t->used++;
}

/* room for `total` keys at a load factor of at most one half */
static int tab_reserve(Tab *t, Py_ssize_t total) {
    size_t size = t->slots ? t->mask + 1 : 0;
    if (size && (size_t)total * 2 <= size) return 0;
    size_t want = 16;
    while (want < (size_t)total * 2) want <<= 1;
    Tab fresh = {NULL, 0, 0};
    if (tab_alloc(&fresh, want) < 0) return -1;
    for (size_t i = 0; i < size; i++)
        if (t->slots[i].idx != NIL) tab_put(&fresh, t->slots[i].key, t->slots[i].hash, t->slots[i].idx);
    PyMem_Free(t->slots);
    *t = fresh;
    return 0;
}

/* remove a present key, shifting the entries after it back (no tombstones) */
static void tab_del(Tab *t, PyObject *key, Py_hash_t h) {
    size_t mask = t->mask, i = (size_t)h & mask;
    while (!(t->slots[i].hash == h && keys_equal(t->slots[i].key, key))) i = (i + 1) & mask;
    for (;;) {
        size_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            if (t->slots[j].idx == NIL) {
                t->slots[i].idx = NIL;
                t->used--;
                return;
            }
            size_t k = (size_t)t->slots[j].hash & mask;
            /* the entry at j may fill i unless its home k lies cyclically in (i, j] */
            if (i <= j ? (k <= i || k > j) : (k <= i && k > j)) break;
        }
        t->slots[i] = t->slots[j];
        i = j;
    }
}

static void tab_clear(Tab *t) {
    if (!t->slots) return;
    for (size_t i = 0; i <= t->mask; i++) t->slots[i].idx = NIL;
    t->used = 0;
}

/* --- nodes, lists and the core ------------------------------------------------------ */

typedef struct {
    PyObject *key; /* owned while live; NULL when free */
    Py_hash_t hash;
    int32_t prev, next;
    int32_t slot;   /* the block id (resident nodes) */
    int32_t ref;    /* -1 being stored, 0 ready and idle, n > 0 pinned by n loads */
    uint32_t mark;  /* == Core.epoch: listed by the current call (and so protected) */
    int32_t count;  /* complete_load: times listed by the current call */
    uint8_t list;   /* the list holding it; NO_LIST for a free node or a dropped victim */
    uint8_t freq;   /* s3fifo: access count; sieve: visited bit; kv: uses (0: not yet known) */
    uint8_t cls;    /* kv: the class (its queue while resident) */
    uint8_t sampled; /* kv: the key feeds the reuse counts */
    int64_t tick;   /* kv: the last use */
} Node;

typedef struct {
    int32_t head, tail;
    Py_ssize_t len;
} List;

typedef struct Core Core;

/* A cache policy over the core's lists. Node arguments are live nodes or NIL. */
typedef struct {
    const char *name;
    /* touch a request's keys at its first store instead of folding it at its end */
    int touch_before_store;
    /* a touch gives unknown keys a node (the caller makes them, freq 0, on no list) */
    int remembers_touched;
    /* a new resident node (its store in flight); ghost: the ghost list it left, or -1 */
    void (*insert)(Core *, int32_t i, int ghost);
    /* instead of insert (may be NULL): one store's new nodes, in the order offered, each
     * on no list (a new node has freq 0) */
    void (*insert_many)(Core *, const int32_t *nodes, Py_ssize_t n);
    /* when storing would evict (may be NULL): 1 to decline an absent key (its node or NIL) */
    int (*declines)(Core *, int32_t i);
    /* a failed store: unlink the node (the caller frees it) */
    void (*remove)(Core *, int32_t i);
    void (*touch)(Core *, const int32_t *nodes, Py_ssize_t n);
    /* choose and unlink n idle unprotected resident nodes, or return -1 changing nothing;
     * a victim ends on a ghost list or with list NO_LIST (the caller frees it) */
    int (*evict)(Core *, Py_ssize_t n, int32_t *victims);
    /* after the caller took the victims' keys: forget ghosts over their budget */
    void (*trim)(Core *);
    /* keys offered to a store, new this request (may be NULL: no hook) */
    void (*store_miss)(Core *, const int32_t *nodes, Py_ssize_t n);
    /* a request ended: its keys head to tail with their log flags (fold policies) */
    void (*finish)(Core *, const int32_t *nodes, const uint8_t *flags, Py_ssize_t n);
    /* the resident lists in the policy's order (items()); returns how many */
    int (*order)(Core *, int *lists);
} Policy;

#define USE_BUCKETS 4
#define SIZE_BUCKETS 3
#define KV_TAIL (USE_BUCKETS * SIZE_BUCKETS)
#define AGE_BINS 64
#define KV_SAMPLE_MASK 3
/* the censoring correction's fade (kv.py's FADE, FADE_TICKS, CENSOR_SCALE) */
#define KV_FADE 12.0
#define KV_FADE_TICKS 160
#define KV_CENSOR_SCALE 16777216.0

/* kv's learning (asyncoffload/manager/policies/kv.py, default options) */
typedef struct {
    Py_ssize_t capacity, ghost_cap, rebuild_every;
    double decay;
    int64_t tick;
    Py_ssize_t inserts;
    double last_victim; /* the value of the last block evicted, when it went */
    double entered[KV_CLASSES];
    double reused[KV_CLASSES * AGE_BINS];
    double table[KV_CLASSES][AGE_BINS];
    int64_t rebuilds;                       /* rebuilds so far */
    int64_t rebuild_ticks[KV_FADE_TICKS];   /* the ticks of the first KV_FADE_TICKS */
    int n_rebuild_ticks;
    int64_t traffic; /* blocks touched: the fade's clock */
} KVState;

typedef struct {
    Py_hash_t hash;
    PyObject *key; /* borrowed */
    uint32_t stamp;
} SeenSlot;

struct Core {
    PyObject_HEAD
    const Policy *policy;
    Py_ssize_t num_blocks;
    /* nodes */
    Node *nodes;
    int32_t n_nodes, cap_nodes, free_node;
    Py_ssize_t n_free_nodes, live;
    Tab index;
    List lists[NUM_LISTS];
    /* slots */
    Py_ssize_t num_allocated;
    int32_t *free_slots;
    Py_ssize_t n_free_slots;
    PyObject **slot_ints; /* cached ints of the slot ids handed out */
    Py_ssize_t num_ready, num_idle, num_pending;
    Py_ssize_t last_store_size;
    long long stored, store_failed, loaded, evicted, store_skipped, lookups, hits;
    PyObject *events;   /* list of (keys, removed); NULL when events are off */
    PyObject *requests; /* dict: req_id -> capsule of a Request */
    PyObject *results;  /* (MISS, HIT, HIT_PENDING) as lookup returns them */
    uint32_t epoch;
    int busy; /* a call that changes the manager is in progress */
    int simulating; /* simulate(): a store completes as it is made */
    /* policy state */
    double target_t1;                          /* arc */
    Py_ssize_t small_capacity, ghost_capacity; /* s3fifo */
    int ahead;                                 /* sieve: lists[ahead] starts at the hand */
    KVState *kv;                               /* kv */
    /* scratch */
    int32_t *buf[4];
    Py_ssize_t buf_cap[4];
    uint8_t *bytes;
    Py_ssize_t bytes_cap;
    SeenSlot *seen;
    size_t seen_mask;
    uint32_t seen_stamp;
};

static PyObject *UnknownKeyError, *KeyNotReadyError, *DuplicateKeyError;
static PyObject *s_req_id, *s_get, *s_hex;
static PyObject *s_step, *s_one, *s_observe; /* "step", 1, "observe": one_step */

static inline int resident(const Node *nd) { return nd->list < GHOST_BASE; }

static inline void list_init(List *l) {
    l->head = l->tail = NIL;
    l->len = 0;
}

static inline void list_append(Core *c, int l, int32_t i) {
    Node *n = &c->nodes[i];
    List *L = &c->lists[l];
    n->list = (uint8_t)l;
    n->prev = L->tail;
    n->next = NIL;
    if (L->tail != NIL) c->nodes[L->tail].next = i;
    else L->head = i;
    L->tail = i;
    L->len++;
}

static inline void list_unlink(Core *c, int32_t i) {
    Node *n = &c->nodes[i];
    List *L = &c->lists[n->list];
    if (n->prev != NIL) c->nodes[n->prev].next = n->next;
    else L->head = n->next;
    if (n->next != NIL) c->nodes[n->next].prev = n->prev;
    else L->tail = n->prev;
    n->prev = n->next = NIL;
    n->list = NO_LIST;
    L->len--;
}

static inline void list_move_to_end(Core *c, int32_t i) {
    int l = c->nodes[i].list;
    if (c->lists[l].tail == i) return;
    list_unlink(c, i);
    list_append(c, l, i);
}

static inline int32_t list_pop_head(Core *c, int l) {
    int32_t i = c->lists[l].head;
    list_unlink(c, i);
    return i;
}

/* room for `extra` new nodes: neither node_new nor the index can fail afterwards */
static int nodes_reserve(Core *c, Py_ssize_t extra) {
    Py_ssize_t avail = c->n_free_nodes + (c->cap_nodes - c->n_nodes);
    if (avail < extra) {
        Py_ssize_t cap = c->cap_nodes ? c->cap_nodes : 64;
        while (c->n_free_nodes + (cap - c->n_nodes) < extra) cap *= 2;
        if (cap > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "too many keys for the native manager");
            return -1;
        }
        Node *nodes = PyMem_Realloc(c->nodes, (size_t)cap * sizeof(Node));
        if (!nodes) {
            PyErr_NoMemory();
            return -1;
        }
        c->nodes = nodes;
        c->cap_nodes = (int32_t)cap;
    }
    return tab_reserve(&c->index, c->live + extra);
}

static int32_t node_new(Core *c, PyObject *key, Py_hash_t h) {
    int32_t i;
    if (c->free_node != NIL) {
        i = c->free_node;
        c->free_node = c->nodes[i].next;
        c->n_free_nodes--;
    } else {
        i = c->n_nodes++;
    }
    Node *n = &c->nodes[i];
    Py_INCREF(key);
    n->key = key;
    n->hash = h;
    n->prev = n->next = NIL;
    n->slot = -1;
    n->ref = -1;
    n->mark = 0;
    n->count = 0;
    n->list = NO_LIST;
    n->freq = 0;
    if (c->kv) {
        /* kv.py samples by key[-5] (a key is a hash and 4 group bytes) */
        Py_ssize_t len = PyBytes_GET_SIZE(key);
        unsigned char byte = len >= 5 ? (unsigned char)PyBytes_AS_STRING(key)[len - 5] : 1;
        n->cls = 0;
        n->tick = 0;
        n->sampled = !(byte & KV_SAMPLE_MASK);
    }
    tab_put(&c->index, key, h, i);
    c->live++;
    return i;
}

/* forget a node that is on no list */
static void node_forget(Core *c, int32_t i) {
    Node *n = &c->nodes[i];
    tab_del(&c->index, n->key, n->hash);
    PyObject *key = n->key;
    n->key = NULL;
    n->list = NO_LIST;
    n->next = c->free_node;
    c->free_node = i;
    c->n_free_nodes++;
    c->live--;
    Py_DECREF(key);
}

static void forget_all(Core *c) {
    for (int32_t i = 0; i < c->n_nodes; i++) Py_CLEAR(c->nodes[i].key);
    c->n_nodes = 0;
    c->free_node = NIL;
    c->n_free_nodes = 0;
    c->live = 0;
    tab_clear(&c->index);
    for (int l = 0; l < NUM_LISTS; l++) list_init(&c->lists[l]);
}

/* the node of a key, made (freq 0, on no list) if it has none; room reserved */
static inline int32_t node_of(Core *c, PyObject *key, Py_hash_t h) {
    int32_t i = tab_find(&c->index, key, h);
    return i != NIL ? i : node_new(c, key, h);
}

static int32_t *scratch(Core *c, int k, Py_ssize_t n) {
    if (!c->buf[k] || n > c->buf_cap[k]) {
        Py_ssize_t cap = c->buf_cap[k] ? c->buf_cap[k] : 64;
        while (cap < n) cap *= 2;
        int32_t *b = PyMem_Realloc(c->buf[k], (size_t)cap * sizeof(int32_t));
        if (!b) {
            PyErr_NoMemory();
            return NULL;
        }
        c->buf[k] = b;
        c->buf_cap[k] = cap;
    }
    return c->buf[k];
}

static uint8_t *scratch_bytes(Core *c, Py_ssize_t n) {
    if (!c->bytes || n > c->bytes_cap) {
        Py_ssize_t cap = c->bytes_cap ? c->bytes_cap : 64;
        while (cap < n) cap *= 2;
        uint8_t *b = PyMem_Realloc(c->bytes, (size_t)cap);
        if (!b) {
            PyErr_NoMemory();
            return NULL;
        }
        c->bytes = b;
        c->bytes_cap = cap;
    }
    return c->bytes;
}

static uint32_t next_epoch(Core *c) {
    if (++c->epoch == 0) {
        for (int32_t i = 0; i < c->n_nodes; i++) c->nodes[i].mark = 0;
        c->epoch = 1;
    }
    return c->epoch;
}

/* a fresh duplicate check for up to n keys that have no node */
static int seen_begin(Core *c, Py_ssize_t n) {
    size_t want = 16;
    while (want < (size_t)n * 2) want <<= 1;
    if (!c->seen || want > c->seen_mask + 1) {
        SeenSlot *s = PyMem_Calloc(want, sizeof(SeenSlot));
        if (!s) {
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(c->seen);
        c->seen = s;
        c->seen_mask = want - 1;
        c->seen_stamp = 0;
    }
    if (++c->seen_stamp == 0) {
        memset(c->seen, 0, (c->seen_mask + 1) * sizeof(SeenSlot));
        c->seen_stamp = 1;
    }
    return 0;
}

/* 1 if the key is new to this check (now added), 0 if it was listed before */
static int seen_add(Core *c, PyObject *key, Py_hash_t h) {
    size_t i = (size_t)h & c->seen_mask;
    for (;;) {
        SeenSlot *s = &c->seen[i];
        if (s->stamp != c->seen_stamp) {
            s->stamp = c->seen_stamp;
            s->hash = h;
            s->key = key;
            return 1;
        }
        if (s->hash == h && keys_equal(s->key, key)) return 0;
        i = (i + 1) & c->seen_mask;
    }
}

static inline Py_hash_t key_hash(PyObject *key) {
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return PyObject_Hash(key);
}

/* the hash of a key key_hash accepted: exact bytes cache it, and it never fails */
static inline Py_hash_t bytes_hash(PyObject *key) { return PyObject_Hash(key); }

static inline int evictable(const Core *c, int32_t i) {
    return c->nodes[i].ref == 0 && c->nodes[i].mark != c->epoch;
}

/* --- lru ---------------------------------------------------------------------------- */
/* list 0: least recently used first */

static void lru_insert(Core *c, int32_t i, int ghost) {
    (void)ghost;
    list_append(c, 0, i);
}

static void any_remove(Core *c, int32_t i) { list_unlink(c, i); }

static void lru_touch(Core *c, const int32_t *nodes, Py_ssize_t n) {
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        int32_t i = nodes[j];
        if (i != NIL && resident(&c->nodes[i])) list_move_to_end(c, i);
    }
}

static int lru_evict(Core *c, Py_ssize_t n, int32_t *victims) {
    Py_ssize_t got = 0;
    for (int32_t i = c->lists[0].head; i != NIL && got < n; i = c->nodes[i].next)
        if (evictable(c, i)) victims[got++] = i;
    if (got < n) return -1;
    for (Py_ssize_t j = 0; j < n; j++) list_unlink(c, victims[j]);
    return 0;
}

static void no_trim(Core *c) { (void)c; }

static void lru_finish(Core *c, const int32_t *nodes, const uint8_t *flags, Py_ssize_t n) {
    (void)flags;
    lru_touch(c, nodes, n);
}

static int one_list(Core *c, int *lists) {
    (void)c;
    lists[0] = 0;
    return 1;
}

static int two_lists(Core *c, int *lists) {
    (void)c;
    lists[0] = 0;
    lists[1] = 1;
    return 2;
}

static const Policy LRU = {.name = "lru", .insert = lru_insert, .remove = any_remove,
                           .touch = lru_touch, .evict = lru_evict, .trim = no_trim,
                           .finish = lru_finish, .order = one_list};

/* --- arc ---------------------------------------------------------------------------- */

enum { T1 = 0, T2 = 1, B1 = GHOST_BASE, B2 = GHOST_BASE + 1 };

static void arc_insert(Core *c, int32_t i, int ghost) {
    (void)ghost;
    list_append(c, T1, i);
}

static void arc_ghost_hit(Core *c, int32_t i) {
    Py_ssize_t b1 = c->lists[B1].len, b2 = c->lists[B2].len;
    if (c->nodes[i].list == B1) {
        double step = (double)b2 / (double)b1;
        if (!(step > 1.0)) step = 1.0;
        double t = c->target_t1 + step, cap = (double)c->num_blocks;
        c->target_t1 = t > cap ? cap : t;
        list_move_to_end(c, i);
    } else if (c->nodes[i].list == B2) {
        double step = (double)b1 / (double)b2;
        if (!(step > 1.0)) step = 1.0;
        double t = c->target_t1 - step;
        c->target_t1 = t < 0.0 ? 0.0 : t;
        list_move_to_end(c, i);
    }
}

static void arc_touch(Core *c, const int32_t *nodes, Py_ssize_t n) {
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        int32_t i = nodes[j];
        if (i == NIL) continue;
        Node *nd = &c->nodes[i];
        if (nd->list == T1) {
            if (nd->ref >= 0) {
                list_unlink(c, i);
                list_append(c, T2, i);
            } else {
                list_move_to_end(c, i); /* offered again while being stored: no second use */
            }
        } else if (nd->list == T2) {
            list_move_to_end(c, i);
        } else {
            arc_ghost_hit(c, i);
        }
    }
}

static void arc_store_miss(Core *c, const int32_t *nodes, Py_ssize_t n) {
    if (!c->lists[B1].len && !c->lists[B2].len) return;
    for (Py_ssize_t j = n - 1; j >= 0; j--)
        if (nodes[j] != NIL) arc_ghost_hit(c, nodes[j]);
}

/* take up to `want` evictable nodes from *cur on; 1 if the list ran out first */
static int arc_take(Core *c, int32_t *cur, Py_ssize_t want, int32_t *victims, Py_ssize_t *got,
                    Py_ssize_t *taken) {
    *taken = 0;
    while (*cur != NIL) {
        int32_t i = *cur;
        *cur = c->nodes[i].next;
        if (evictable(c, i)) {
            victims[(*got)++] = i;
            if (++*taken == want) return 0;
        }
    }
    return 1;
}

static int arc_evict(Core *c, Py_ssize_t n, int32_t *victims) {
    /* choose first, commit after: runs from T1 while it is at or above its target (or
     * T2 has no idle block left), else from T2 */
    int32_t cur1 = c->lists[T1].head, cur2 = c->lists[T2].head;
    int ex1 = 0, ex2 = 0;
    Py_ssize_t got = 0, taken, virtual_t1 = c->lists[T1].len;
    Py_ssize_t target = (Py_ssize_t)c->target_t1;
    while (got < n) {
        Py_ssize_t want = n - got;
        if (!ex1 && (ex2 || virtual_t1 >= target)) {
            if (!ex2 && virtual_t1 - target + 1 < want) want = virtual_t1 - target + 1;
            ex1 = arc_take(c, &cur1, want, victims, &got, &taken);
            virtual_t1 -= taken;
        } else if (!ex2) {
            ex2 = arc_take(c, &cur2, want, victims, &got, &taken);
        } else {
            return -1;
        }
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = victims[j];
        int from_t1 = c->nodes[i].list == T1;
        list_unlink(c, i);
        list_append(c, from_t1 ? B1 : B2, i);
    }
    return 0;
}

static void arc_trim(Core *c) {
    for (int l = B1; l <= B2; l++)
        while (c->lists[l].len > c->num_blocks) node_forget(c, list_pop_head(c, l));
}

static void arc_finish(Core *c, const int32_t *nodes, const uint8_t *flags, Py_ssize_t n) {
    /* tail to head: a block only stored moves to the recent end of its list; a ready
     * block reused moves to T2's recent end */
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        int32_t i = nodes[j];
        if (i == NIL || !resident(&c->nodes[i])) continue;
        if ((flags[j] & (F_INSERTED | F_REUSED)) == F_INSERTED) {
            list_move_to_end(c, i);
        } else if (flags[j] & F_REUSED) {
            if (c->nodes[i].list == T1) {
                list_unlink(c, i);
                list_append(c, T2, i);
            } else {
                list_move_to_end(c, i);
            }
        }
    }
}

static const Policy ARC = {.name = "arc", .insert = arc_insert, .remove = any_remove,
                           .touch = arc_touch, .evict = arc_evict, .trim = arc_trim,
                           .store_miss = arc_store_miss, .finish = arc_finish,
                           .order = two_lists};

/* --- s3fifo ------------------------------------------------------------------------- */

enum { S = 0, M = 1, G = GHOST_BASE };

static void s3_insert(Core *c, int32_t i, int ghost) {
    c->nodes[i].freq = 0;
    list_append(c, ghost == G ? M : S, i);
}

static void s3_touch(Core *c, const int32_t *nodes, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i == NIL) continue;
        Node *nd = &c->nodes[i];
        if (!resident(nd)) continue;
        if (nd->freq == 0) {
            if (nd->ref < 0) continue; /* being stored: no use yet */
            nd->freq = 1;
        } else if (nd->freq < S3FIFO_MAX_FREQ) {
            nd->freq++;
        }
    }
}

/* victims from S until *found == need (to_target: only while |S| is at its target);
 * 0 when a pass over S finds none */
static int s3_from_small(Core *c, Py_ssize_t need, int32_t *victims, Py_ssize_t *found,
                         int to_target) {
    Py_ssize_t target = to_target ? c->small_capacity : 0;
    while (*found < need && c->lists[S].len >= target) {
        Py_ssize_t skipped = 0;
        for (;;) {
            if (skipped == c->lists[S].len) return 0;
            int32_t i = list_pop_head(c, S);
            Node *nd = &c->nodes[i];
            if (nd->ref || nd->mark == c->epoch) {
                list_append(c, S, i);
                skipped++;
            } else if (nd->freq) {
                list_append(c, M, i); /* accessed in S: to M, with its count */
            } else {
                list_append(c, G, i);
                victims[(*found)++] = i;
                break;
            }
        }
    }
    return 1;
}

/* victims from M's CLOCK until *found == need; 0 when M holds no evictable block */
static int s3_from_main(Core *c, Py_ssize_t need, int32_t *victims, Py_ssize_t *found) {
    Py_ssize_t skipped = 0;
    while (*found < need) {
        if (skipped == c->lists[M].len) return 0;
        int32_t i = list_pop_head(c, M);
        Node *nd = &c->nodes[i];
        if (nd->ref || nd->mark == c->epoch) {
            list_append(c, M, i);
            skipped++;
            continue;
        }
        skipped = 0;
        if (nd->freq) {
            nd->freq--;
            list_append(c, M, i);
        } else {
            victims[(*found)++] = i; /* no ghost: dropped */
        }
    }
    return 1;
}

static int s3_evict(Core *c, Py_ssize_t n, int32_t *victims) {
    /* all or nothing: n evictable blocks first; and if S stays at its target for all n
     * victims and its n oldest blocks are evictable and unaccessed, they are the victims */
    int simple = c->lists[S].len - n >= c->small_capacity - 1;
    Py_ssize_t idle = 0;
    for (int l = S; l <= M && idle < n; l++)
        for (int32_t i = c->lists[l].head; i != NIL; i = c->nodes[i].next) {
            if (!evictable(c, i)) {
                simple = 0;
            } else {
                if (simple && c->nodes[i].freq) simple = 0;
                if (++idle == n) break;
            }
        }
    if (idle < n) return -1;
    Py_ssize_t found = 0;
    if (simple) {
        while (found < n) {
            int32_t i = list_pop_head(c, S);
            list_append(c, G, i);
            victims[found++] = i;
        }
        return 0;
    }
    int small_dry = 0, main_dry = 0;
    while (found < n) {
        if (!small_dry && c->lists[S].len >= c->small_capacity) {
            if (s3_from_small(c, n, victims, &found, 1)) continue;
            small_dry = 1;
        }
        if (!main_dry) {
            if (s3_from_main(c, n, victims, &found)) continue;
            main_dry = 1;
        }
        if (!small_dry) {
            Py_ssize_t promoted_from = c->lists[M].len;
            int ok = s3_from_small(c, found + 1, victims, &found, 0);
            if (c->lists[M].len != promoted_from) main_dry = 0;
            if (ok) continue;
            small_dry = 1;
        }
        /* S had no victim but promoted its accessed blocks: M has one now */
        if (!s3_from_main(c, found + 1, victims, &found)) return -2;
    }
    return 0;
}

static void s3_trim(Core *c) {
    while (c->lists[G].len > c->ghost_capacity) node_forget(c, list_pop_head(c, G));
}

static const Policy S3FIFO = {.name = "s3fifo", .touch_before_store = 1, .insert = s3_insert,
                              .remove = any_remove, .touch = s3_touch, .evict = s3_evict,
                              .trim = s3_trim, .order = two_lists};

/* --- sieve -------------------------------------------------------------------------- */
/* lists[ahead]: from the hand's block to the newest; lists[!ahead]: passed this sweep */

static void sieve_insert(Core *c, int32_t i, int ghost) {
    (void)ghost;
    c->nodes[i].freq = 0;
    list_append(c, c->ahead, i);
}

static void sieve_remove(Core *c, int32_t i) {
    list_unlink(c, i);
    if (!c->lists[c->ahead].len) c->ahead = !c->ahead;
}

static void sieve_touch(Core *c, const int32_t *nodes, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i != NIL && resident(&c->nodes[i]) && c->nodes[i].ref >= 0) c->nodes[i].freq = 1;
    }
}

static int sieve_evict(Core *c, Py_ssize_t n, int32_t *victims) {
    Py_ssize_t idle = 0;
    int lists[2] = {c->ahead, !c->ahead};
    for (int k = 0; k < 2 && idle < n; k++)
        for (int32_t i = c->lists[lists[k]].head; i != NIL && idle < n; i = c->nodes[i].next)
            if (evictable(c, i)) idle++;
    if (idle < n) return -1;
    Py_ssize_t got = 0;
    for (;;) {
        int32_t i = list_pop_head(c, c->ahead);
        Node *nd = &c->nodes[i];
        if (nd->ref || nd->mark == c->epoch) {
            list_append(c, !c->ahead, i); /* passed over, bit kept */
        } else if (nd->freq) {
            nd->freq = 0;
            list_append(c, !c->ahead, i);
        } else {
            victims[got++] = i;
            if (got == n) break;
        }
        if (!c->lists[c->ahead].len) c->ahead = !c->ahead; /* past the head: wrap */
    }
    if (!c->lists[c->ahead].len) c->ahead = !c->ahead;
    return 0;
}

static int sieve_order(Core *c, int *lists) {
    lists[0] = !c->ahead;
    lists[1] = c->ahead;
    return 2;
}

static const Policy SIEVE = {.name = "sieve", .touch_before_store = 1, .insert = sieve_insert,
                             .remove = sieve_remove, .touch = sieve_touch,
                             .evict = sieve_evict, .trim = no_trim, .order = sieve_order};

/* --- kv ----------------------------------------------------------------------------- */
/* Lists 0 to 14: the resident blocks of each class, least recently used first; KV_FRESH:
 * keys first seen by the latest touch and not stored; KV_GHOST: keys remembered (evicted,
 * or touched and never stored), least recently used first. A node's freq is its uses
 * (1 to 4), cls its class and tick its last use, resident or not. */

enum { KV_FRESH = GHOST_BASE, KV_GHOST = GHOST_BASE + 1 };

/* eviction breaks value ties by rank: last-block classes first, then by uses */
static inline int kv_rank(int cls) { return cls < KV_TAIL ? SIZE_BUCKETS + cls : cls - KV_TAIL; }

static inline int kv_class_at_rank(int rank) {
    return rank < SIZE_BUCKETS ? KV_TAIL + rank : rank - SIZE_BUCKETS;
}

static inline int kv_size_bucket(Py_ssize_t n) { return n < 16 ? 0 : (n < 64 ? 1 : 2); }

/* Python's age.bit_length() (ages are never negative) */
static inline int kv_age_bin(int64_t age) {
    return age > 0 ? 64 - __builtin_clzll((unsigned long long)age) : 0;
}

static void kv_clear(KVState *kv) {
    kv->tick = 0;
    kv->inserts = 0;
    kv->last_victim = 0.0;
    memset(kv->entered, 0, sizeof kv->entered);
    memset(kv->reused, 0, sizeof kv->reused);
    for (int k = 0; k < KV_CLASSES; k++)
        for (int b = 0; b < AGE_BINS; b++) kv->table[k][b] = 1.0;
    kv->rebuilds = 0;
    kv->n_rebuild_ticks = 0;
    kv->traffic = 0;
}

/* kv.py's _censored(): per class and age bin, the sampled blocks kv knows that were not
 * reused since they entered their class, weighted decay ** (rebuilds since), summed as
 * exact integers */
static void kv_censored(Core *c, double *out) {
    KVState *kv = c->kv;
    int64_t sums[KV_CLASSES * AGE_BINS], weights[KV_FADE_TICKS + 1];
    int n = kv->n_rebuild_ticks;
    memset(sums, 0, sizeof sums);
    for (int k = 0; k <= n; k++)
        weights[k] = (int64_t)(pow(kv->decay, (double)k) * KV_CENSOR_SCALE);
    for (int32_t i = 0; i < c->n_nodes; i++) {
        const Node *nd = &c->nodes[i];
        if (!nd->key || !nd->freq || !nd->sampled) continue;
        int lo = 0, hi = n; /* bisect_left(ticks, nd->tick) */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (kv->rebuild_ticks[mid] < nd->tick) lo = mid + 1;
            else hi = mid;
        }
        sums[nd->cls * AGE_BINS + kv_age_bin(kv->tick - nd->tick)] += weights[n - lo];
    }
    for (int j = 0; j < KV_CLASSES * AGE_BINS; j++) out[j] = (double)sums[j] / KV_CENSOR_SCALE;
}

static void kv_rebuild(Core *c) {
    KVState *kv = c->kv;
    double decay = kv->decay;
    double cens[KV_CLASSES * AGE_BINS];
    double fade = 1.0 - (double)kv->traffic / (KV_FADE * (double)kv->capacity);
    if (fade > 0.0) {
        kv_censored(c, cens);
    } else {
        fade = 0.0;
        memset(cens, 0, sizeof cens);
    }
    if (kv->n_rebuild_ticks < KV_FADE_TICKS) kv->rebuild_ticks[kv->n_rebuild_ticks++] = kv->tick;
    kv->rebuilds++;
    for (int k = 0; k < KV_CLASSES; k++) {
        double *reused = &kv->reused[k * AGE_BINS];
        double alive = kv->entered[k], later = 0.0; /* summed in order, as kv.py does */
        for (int b = 0; b < AGE_BINS; b++) later += reused[b];
        double prev = 1.0;
        for (int b = 0; b < AGE_BINS; b++) {
            double p = alive > 1e-9 ? later / alive : 0.0;
            prev = p < prev ? p : prev;
            kv->table[k][b] = prev;
            alive -= reused[b] + fade * cens[k * AGE_BINS + b];
            later -= reused[b];
            reused[b] *= decay;
        }
        kv->entered[k] *= decay;
    }
    for (int k = SIZE_BUCKETS; k < KV_TAIL; k++)
        for (int b = 0; b < AGE_BINS; b++) {
            double a = kv->table[k][b], lower = kv->table[k - SIZE_BUCKETS][b];
            kv->table[k][b] = a > lower ? a : lower;
        }
    for (int k = KV_TAIL; k < KV_CLASSES; k++)
        for (int b = 0; b < AGE_BINS; b++) {
            double a = kv->table[k][b], parent = kv->table[k - KV_TAIL][b];
            kv->table[k][b] = a < parent ? a : parent;
        }
}

static void kv_trim(Core *c) {
    while (c->lists[KV_GHOST].len > c->kv->ghost_cap)
        node_forget(c, list_pop_head(c, KV_GHOST));
}

static void kv_touch(Core *c, const int32_t *nodes, Py_ssize_t n) {
    KVState *kv = c->kv;
    int64_t tick = ++kv->tick;
    kv->traffic += n;
    /* touched before and never stored: remembered like evicted blocks */
    while (c->lists[KV_FRESH].len) list_append(c, KV_GHOST, list_pop_head(c, KV_FRESH));
    int size = kv_size_bucket(n), top = KV_TAIL - SIZE_BUCKETS + size;
    int first = KV_TAIL + size; /* a first-seen last block */
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        int32_t i = nodes[j];
        Node *nd = &c->nodes[i];
        if (!nd->freq) {
            nd->freq = 1;
            nd->tick = tick;
            nd->cls = (uint8_t)first;
            list_append(c, KV_FRESH, i);
            if (nd->sampled) kv->entered[first] += 1;
            first = size;
            continue;
        }
        first = size;
        int64_t last = nd->tick;
        if (last == tick) continue; /* the same key twice in one touch counts once */
        int old = nd->cls, cls;
        if (nd->freq < USE_BUCKETS) cls = nd->freq++ * SIZE_BUCKETS + size;
        else cls = top;
        nd->tick = tick;
        if (nd->sampled) {
            kv->reused[old * AGE_BINS + kv_age_bin(tick - last)] += 1;
            kv->entered[cls] += 1;
        }
        nd->cls = (uint8_t)cls;
        if (resident(nd) && cls != old) {
            list_unlink(c, i);
            list_append(c, cls, i);
        } else {
            list_move_to_end(c, i); /* its queue, or the ghost list */
        }
    }
    kv_trim(c);
}

static void kv_insert_many(Core *c, const int32_t *nodes, Py_ssize_t n) {
    KVState *kv = c->kv;
    /* deepest first: a just-stored prefix is cut from its end */
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        int32_t i = nodes[j];
        Node *nd = &c->nodes[i];
        if (!nd->freq) {
            nd->freq = 1;
            nd->cls = 0;
            if (nd->sampled) kv->entered[0] += 1;
        }
        nd->tick = kv->tick; /* a store is a use: age counts from it */
        list_append(c, nd->cls, i);
    }
    kv->inserts += n;
    if (kv->inserts >= kv->rebuild_every) {
        kv->inserts = 0;
        kv_rebuild(c);
    }
}

static int kv_declines(Core *c, int32_t i) {
    if (i == NIL) return 0;
    const Node *nd = &c->nodes[i];
    return nd->freq <= 1 && c->kv->table[nd->cls][0] < c->kv->last_victim;
}

typedef struct {
    double v;
    int rank;
} KVHead;

static inline int kv_before(KVHead a, KVHead b) {
    return a.v < b.v || (a.v == b.v && a.rank < b.rank);
}

static void kv_push(KVHead *h, int *n, KVHead x) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!kv_before(x, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static KVHead kv_pop(KVHead *h, int *n) {
    KVHead top = h[0], x = h[--*n];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        KVHead best = x;
        if (l < *n && kv_before(h[l], best)) {
            m = l;
            best = h[l];
        }
        if (r < *n && kv_before(h[r], best)) {
            m = r;
            best = h[r];
        }
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = x;
    return top;
}

static inline double kv_value(const Core *c, int cls, int32_t i) {
    return c->kv->table[cls][kv_age_bin(c->kv->tick - c->nodes[i].tick)];
}

static int kv_evict(Core *c, Py_ssize_t n, int32_t *victims) {
    /* One cursor per class at its first evictable block (values rise along a queue), a
     * heap of them by value and rank; a class keeps giving victims while it stays the
     * cheapest. */
    KVHead heap[KV_CLASSES];
    int32_t pointed[KV_CLASSES];
    int nh = 0;
    for (int k = 0; k < KV_CLASSES; k++) {
        int32_t i = c->lists[k].head;
        while (i != NIL && !evictable(c, i)) i = c->nodes[i].next;
        pointed[k] = i;
        if (i != NIL) kv_push(heap, &nh, (KVHead){kv_value(c, k, i), kv_rank(k)});
    }
    Py_ssize_t got = 0;
    double value = 0.0;
    while (got < n) {
        if (!nh) return -1;
        KVHead h = kv_pop(heap, &nh);
        int rank = h.rank, k = kv_class_at_rank(rank);
        KVHead bar = nh ? heap[0] : (KVHead){3.0, KV_CLASSES};
        value = h.v;
        victims[got++] = pointed[k];
        for (int32_t i = c->nodes[pointed[k]].next; i != NIL; i = c->nodes[i].next) {
            if (!evictable(c, i)) continue;
            double v = kv_value(c, k, i);
            if (got < n && (v < bar.v || (v == bar.v && rank < bar.rank))) {
                victims[got++] = i;
                value = v;
                continue;
            }
            pointed[k] = i;
            kv_push(heap, &nh, (KVHead){v, rank});
            break;
        }
    }
    c->kv->last_victim = value;
    for (Py_ssize_t j = 0; j < n; j++) {
        list_unlink(c, victims[j]);
        list_append(c, KV_GHOST, victims[j]);
    }
    return 0;
}

static int kv_order(Core *c, int *lists) {
    (void)c;
    for (int k = 0; k < KV_CLASSES; k++) lists[k] = k;
    return KV_CLASSES;
}

static const Policy KV = {.name = "kv", .touch_before_store = 1, .remembers_touched = 1,
                          .insert_many = kv_insert_many, .declines = kv_declines,
                          .remove = any_remove, .touch = kv_touch, .evict = kv_evict,
                          .trim = kv_trim, .order = kv_order};

static const Policy *POLICIES[] = {&LRU, &ARC, &KV, &S3FIFO, &SIEVE, NULL};

/* --- request logs ------------------------------------------------------------------- */

/* What one request did. Fold policies (lru, arc): the keys it loaded or stored, in
 * first-use order, with flags (inserted by a store of its own, reused ready, reported as
 * a store miss) and a table over them. Touch-before-store policies: the keys it loaded
 * (each load's keys, repeats kept) until its first store touches them. */
typedef struct {
    PyObject *key; /* owned */
    Py_hash_t hash;
    uint8_t flags;
} Entry;

typedef struct {
    int touched;
    Entry *e;
    Py_ssize_t n, cap;
    Tab tab;
} Request;

static const char REQUEST_CAPSULE[] = "asyncoffload.mgrcore.request";

static void request_free(Request *r) {
    for (Py_ssize_t j = 0; j < r->n; j++) Py_DECREF(r->e[j].key);
    PyMem_Free(r->e);
    tab_free(&r->tab);
    PyMem_Free(r);
}

static void request_capsule_free(PyObject *capsule) {
    Request *r = PyCapsule_GetPointer(capsule, REQUEST_CAPSULE);
    if (r) request_free(r);
    else PyErr_Clear();
}

static void request_drop_entries(Request *r) {
    for (Py_ssize_t j = 0; j < r->n; j++) Py_DECREF(r->e[j].key);
    r->n = 0;
}

static int request_reserve(Request *r, Py_ssize_t extra, int with_tab) {
    if (r->n + extra > r->cap) {
        Py_ssize_t cap = r->cap ? r->cap : 16;
        while (cap < r->n + extra) cap *= 2;
        Entry *e = PyMem_Realloc(r->e, (size_t)cap * sizeof(Entry));
        if (!e) {
            PyErr_NoMemory();
            return -1;
        }
        r->e = e;
        r->cap = cap;
    }
    return with_tab ? tab_reserve(&r->tab, r->n + extra) : 0;
}

static inline void request_append(Request *r, PyObject *key, Py_hash_t h) {
    Entry *e = &r->e[r->n++];
    Py_INCREF(key);
    e->key = key;
    e->hash = h;
    e->flags = 0;
}

/* the entry of a key used by the request, added in first-use order (reserved room) */
static inline Entry *request_see(Request *r, PyObject *key, Py_hash_t h) {
    int32_t j = tab_find(&r->tab, key, h);
    if (j != NIL) return &r->e[j];
    tab_put(&r->tab, key, h, (int32_t)r->n);
    request_append(r, key, h);
    return &r->e[r->n - 1];
}

static PyObject *new_request_capsule(void) {
    Request *r = PyMem_Calloc(1, sizeof(Request));
    if (!r) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(r, REQUEST_CAPSULE, request_capsule_free);
    if (!capsule) PyMem_Free(r);
    return capsule;
}

/* the log of ctx's request, made if it has none; NULL with an exception on error */
static Request *request_of(Core *c, PyObject *ctx) {
    PyObject *req_id = PyObject_GetAttr(ctx, s_req_id);
    if (!req_id) return NULL;
    Request *r = NULL;
    PyObject *capsule = PyDict_GetItemWithError(c->requests, req_id);
    if (capsule) {
        r = PyCapsule_GetPointer(capsule, REQUEST_CAPSULE);
    } else if (!PyErr_Occurred() && (capsule = new_request_capsule())) {
        if (PyDict_SetItem(c->requests, req_id, capsule) == 0)
            r = PyCapsule_GetPointer(capsule, REQUEST_CAPSULE);
        Py_DECREF(capsule); /* the dict holds it */
    }
    Py_DECREF(req_id);
    return r;
}

/* --- argument parsing --------------------------------------------------------------- */

/* the index of keyword `name` in names[:nmax] (vLLM's "req_context" is "ctx"), or -1 */
static int arg_index(PyObject *name, const char *const *names, int nmax) {
    for (int k = 0; k < nmax; k++) {
        if (PyUnicode_CompareWithASCIIString(name, names[k]) == 0) return k;
        if (!strcmp(names[k], "ctx") && PyUnicode_CompareWithASCIIString(name, "req_context") == 0)
            return k;
    }
    return -1;
}

/* positional-or-keyword arguments of a fastcall method: out[k] is NULL when absent */
static int parse(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *fname,
                 const char *const *names, int nreq, int nmax, PyObject **out) {
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nmax,
                     nargs);
        return -1;
    }
    for (int k = 0; k < nmax; k++) out[k] = k < nargs ? args[k] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int k = arg_index(name, names, nmax);
        if (k < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname,
                         name);
            return -1;
        }
        if (out[k]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[k]);
            return -1;
        }
        out[k] = args[nargs + j];
    }
    for (int k = 0; k < nreq; k++)
        if (!out[k]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[k]);
            return -1;
        }
    return 0;
}

static const char *const KEYS_CTX[] = {"keys", "ctx", NULL};

/* keys as a fast sequence and its items */
static PyObject *keys_of(PyObject *arg, PyObject ***items, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(arg, "keys must be a sequence");
    if (!seq) return NULL;
    *items = PySequence_Fast_ITEMS(seq);
    *n = PySequence_Fast_GET_SIZE(seq);
    return seq;
}

static PyObject *key_error(PyObject *cls, const char *what, PyObject *key, const char *tail) {
    PyObject *hex = PyObject_CallMethodNoArgs(key, s_hex);
    if (!hex) return NULL;
    PyObject *msg = PyUnicode_FromFormat("%s: key %U %s", what, hex, tail);
    Py_DECREF(hex);
    if (!msg) return NULL;
    PyErr_SetObject(cls, msg);
    Py_DECREF(msg);
    return NULL;
}

/* Resolve keys to live nodes (NIL if none), marking those nodes with a new epoch: the
 * index of the first key listed twice, -1 if none, -2 on error. */
static Py_ssize_t resolve_unique(Core *c, PyObject **keys, Py_ssize_t n, int32_t *nodes) {
    uint32_t epoch = next_epoch(c);
    int checking = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_hash_t h = key_hash(keys[j]);
        if (h == -1) return -2;
        int32_t i = tab_find(&c->index, keys[j], h);
        nodes[j] = i;
        if (i != NIL) {
            if (c->nodes[i].mark == epoch) return j;
            c->nodes[i].mark = epoch;
        } else {
            if (!checking) {
                if (seen_begin(c, n) < 0) return -2;
                checking = 1;
            }
            if (!seen_add(c, keys[j], h)) return j;
        }
    }
    return -1;
}

/* resolve keys to live nodes, NIL where none; -1 on error */
static int resolve(Core *c, PyObject **keys, Py_ssize_t n, int32_t *nodes) {
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_hash_t h = key_hash(keys[j]);
        if (h == -1) return -1;
        nodes[j] = tab_find(&c->index, keys[j], h);
    }
    return 0;
}

static int emit(Core *c, PyObject *keys, int removed) {
    if (!c->events) return 0;
    PyObject *event = PyTuple_Pack(2, keys, removed ? Py_True : Py_False);
    if (!event) return -1;
    int rc = PyList_Append(c->events, event);
    Py_DECREF(event);
    return rc;
}

/* the cached int of a slot id handed out before */
static inline PyObject *slot_int(Core *c, int32_t slot) {
    Py_INCREF(c->slot_ints[slot]);
    return c->slot_ints[slot];
}

/* --- the manager's calls ------------------------------------------------------------ */

static PyObject *Core_lookup(Core *c, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    static const char *const names[] = {"key", "ctx", NULL};
    PyObject *a[2];
    if (kwnames || nargs < 1 || nargs > 2) {
        if (parse(args, nargs, kwnames, "lookup", names, 1, 2, a) < 0) return NULL;
    } else {
        a[0] = args[0];
    }
    if (!c->results) {
        PyErr_SetString(PyExc_RuntimeError, "lookup on a cleared manager");
        return NULL;
    }
    Py_hash_t h = key_hash(a[0]);
    if (h == -1) return NULL;
    c->lookups++;
    int32_t i = tab_find(&c->index, a[0], h);
    int r = 0;
    if (i != NIL && resident(&c->nodes[i])) {
        c->hits++;
        r = c->nodes[i].ref >= 0 ? 1 : 2;
    }
    PyObject *out = PyTuple_GET_ITEM(c->results, r);
    Py_INCREF(out);
    return out;
}

static PyObject *Core_lookup_prefix(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
    PyObject *a[2], **keys;
    Py_ssize_t n, count = 0;
    if (parse(args, nargs, kwnames, "lookup_prefix", KEYS_CTX, 1, 2, a) < 0) return NULL;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    for (; count < n; count++) {
        Py_hash_t h = key_hash(keys[count]);
        if (h == -1) {
            Py_DECREF(seq);
            return NULL;
        }
        int32_t i = tab_find(&c->index, keys[count], h);
        if (i == NIL || !resident(&c->nodes[i]) || c->nodes[i].ref < 0) break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(count);
}

static PyObject *prepare_load_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    PyObject *a[2], **keys, *out = NULL;
    Py_ssize_t n;
    if (parse(args, nargs, kwnames, "prepare_load", KEYS_CTX, 1, 2, a) < 0) return NULL;
    PyObject *ctx = a[1] ? a[1] : Py_None;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    int32_t *nodes = scratch(c, 0, n);
    if (!nodes) goto done;
    Py_ssize_t dup = resolve_unique(c, keys, n, nodes);
    if (dup == -2) goto done;
    if (dup >= 0) {
        key_error(DuplicateKeyError, "prepare_load", keys[dup], "appears more than once");
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i == NIL || !resident(&c->nodes[i])) {
            key_error(UnknownKeyError, "prepare_load", keys[j], "is not stored");
            goto done;
        }
        if (c->nodes[i].ref < 0) {
            key_error(KeyNotReadyError, "prepare_load", keys[j], "is still being stored");
            goto done;
        }
    }
    Request *r = NULL;
    int fold = !c->policy->touch_before_store;
    if (ctx != Py_None && n) {
        if (!(r = request_of(c, ctx))) goto done;
        if (fold || !r->touched) {
            if (request_reserve(r, n, fold) < 0) goto done;
        }
    }
    if (!(out = PyList_New(n))) goto done;
    /* nothing fails from here */
    Py_ssize_t idle = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Node *nd = &c->nodes[nodes[j]];
        if (!nd->ref) idle++;
        nd->ref++;
        PyList_SET_ITEM(out, j, slot_int(c, nd->slot));
    }
    c->num_idle -= idle;
    c->loaded += n;
    if (r) {
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_hash_t h = c->nodes[nodes[j]].hash;
            if (fold) {
                Entry *e = request_see(r, keys[j], h);
                if (!(e->flags & F_INSERTED)) e->flags |= F_REUSED;
            } else if (!r->touched) {
                request_append(r, keys[j], h);
            }
        }
    }
done:
    Py_DECREF(seq);
    return out;
}

static PyObject *complete_load_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
    PyObject *a[2], **keys, *out = NULL;
    Py_ssize_t n;
    if (parse(args, nargs, kwnames, "complete_load", KEYS_CTX, 1, 2, a) < 0) return NULL;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    int32_t *nodes = scratch(c, 0, n);
    if (!nodes || resolve(c, keys, n, nodes) < 0) goto done;
    uint32_t epoch = next_epoch(c);
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i == NIL || !resident(&c->nodes[i])) continue;
        Node *nd = &c->nodes[i];
        if (nd->mark != epoch) {
            nd->mark = epoch;
            nd->count = 0;
        }
        nd->count++;
    }
    /* the first key, in first-listed order, that is not pinned as often as listed */
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i == NIL || !resident(&c->nodes[i]) || c->nodes[i].ref < c->nodes[i].count) {
            key_error(PyExc_ValueError, "complete_load", keys[j], "is not being loaded");
            goto done;
        }
    }
    Py_ssize_t idle = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Node *nd = &c->nodes[nodes[j]];
        if (!nd->count) continue; /* listed before: done */
        nd->ref -= nd->count;
        nd->count = 0;
        if (!nd->ref) idle++;
    }
    c->num_idle += idle;
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    return out;
}

/* touch keys[0:n] as touch does (nodes: scratch for n, already their nodes when
 * found); -1 on error */
static int touch_keys(Core *c, PyObject **keys, Py_ssize_t n, int32_t *nodes, int found) {
    if (!found && resolve(c, keys, n, nodes) < 0) return -1;
    if (c->policy->remembers_touched) {
        if (nodes_reserve(c, n) < 0) return -1;
        for (Py_ssize_t j = 0; j < n; j++)
            if (nodes[j] == NIL) nodes[j] = node_of(c, keys[j], bytes_hash(keys[j]));
    }
    c->policy->touch(c, nodes, n);
    return 0;
}

static PyObject *touch_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    PyObject *a[2], **keys, *out = NULL;
    Py_ssize_t n;
    if (parse(args, nargs, kwnames, "touch", KEYS_CTX, 1, 2, a) < 0) return NULL;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    int32_t *nodes = scratch(c, 0, n);
    if (!nodes || touch_keys(c, keys, n, nodes, 0) < 0) goto done;
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    return out;
}

/* the tuple (keys_to_store, slot ids, evicted keys) of a store with nothing to store */
static PyObject *empty_store(void) {
    return Py_BuildValue("([][][])");
}

/* prepare_store of keys[0:n]; while simulating (no request), what it stores is ready at
 * once and nothing is built to return: Py_None, or NULL on error */
static PyObject *store_keys(Core *c, PyObject **keys, Py_ssize_t n, PyObject *ctx) {
    PyObject *result = NULL;
    PyObject *to_store = NULL, *ids = NULL, *evicted = NULL, *out = NULL;
    const int sim = c->simulating;
    const Policy *p = c->policy;
    int fold = !p->touch_before_store;
    int32_t *nodes = scratch(c, 0, n);
    uint8_t *absent = scratch_bytes(c, n);
    if (!nodes || !absent) goto done;
    Py_ssize_t dup = resolve_unique(c, keys, n, nodes);
    if (dup == -2) goto done;
    if (dup >= 0) {
        key_error(DuplicateKeyError, "prepare_store", keys[dup], "appears more than once");
        goto done;
    }
    /* the keys absent (offered): 1 to store, 2 declined by the policy (kv), which it
     * decides before the request's touch, when storing them all would evict */
    Py_ssize_t offered = 0, k = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        absent[j] = nodes[j] == NIL || !resident(&c->nodes[nodes[j]]);
        offered += absent[j];
    }
    Py_ssize_t num_free = c->num_blocks - c->num_allocated + c->n_free_slots;
    int full = offered > num_free && c->num_ready + c->num_pending > 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (absent[j] && full && p->declines && p->declines(c, nodes[j])) absent[j] = 2;
        k += absent[j] == 1;
    }
    Py_ssize_t shortfall = k - num_free;
    /* allocate everything first */
    Request *r = NULL;
    int32_t *entries = NULL, *work = NULL, *inserted = NULL;
    Py_ssize_t need = shortfall > 0 ? shortfall : 0; /* victims, store misses, touches */
    Py_ssize_t touching = 0;                         /* keys of the request's touch */
    if (ctx != Py_None) {
        if (!(r = request_of(c, ctx))) goto done;
        if (fold) {
            if (request_reserve(r, n, 1) < 0 || !(entries = scratch(c, 1, n))) goto done;
        } else if (!r->touched) {
            touching = r->n + n;
        }
        Py_ssize_t used = fold ? k : touching;
        if (used > need) need = used;
    }
    if (!(work = scratch(c, 2, need))) goto done;
    if ((p->insert_many || sim) && k && !(inserted = scratch(c, 3, k))) goto done;
    Py_ssize_t new_nodes = k + (p->remembers_touched ? touching : 0);
    if (new_nodes && nodes_reserve(c, new_nodes) < 0) goto done;
    if (!k && !(out = sim ? Py_NewRef(Py_None) : empty_store())) goto done;
    if (k && sim) {
        if (!(out = Py_NewRef(Py_None))) goto done;
    } else if (k) {
        if (!(to_store = PyList_New(k)) || !(ids = PyList_New(k))) goto done;
        if (!(evicted = PyList_New(shortfall > 0 ? shortfall : 0))) goto done;
        if (!(out = PyTuple_New(3))) goto done;
        Py_ssize_t fresh_end = c->num_allocated + k;
        if (fresh_end > c->num_blocks) fresh_end = c->num_blocks;
        for (Py_ssize_t s = c->num_allocated; s < fresh_end; s++)
            if (!c->slot_ints[s] && !(c->slot_ints[s] = PyLong_FromSsize_t(s))) goto done;
    }
    /* the request's log (changes even when the store is refused, as vLLM's does) */
    if (r && fold) {
        Py_ssize_t misses = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            int32_t i = nodes[j];
            if (!absent[j] && c->nodes[i].ref < 0) continue; /* being stored: not used */
            Entry *e = request_see(r, keys[j], bytes_hash(keys[j]));
            entries[j] = (int32_t)(e - r->e);
            if (absent[j]) {
                if (p->store_miss && !(e->flags & F_MISSED)) {
                    e->flags |= F_MISSED;
                    work[misses++] = i;
                }
            } else if (!(e->flags & F_INSERTED)) {
                e->flags |= F_REUSED;
            }
        }
        if (misses) p->store_miss(c, work, misses);
    } else if (r && !r->touched) {
        /* the request's first store: touch what it loaded, then what it offers */
        r->touched = 1;
        Py_ssize_t m = 0;
        int make = p->remembers_touched;
        for (Py_ssize_t j = 0; j < r->n; j++) {
            Entry *e = &r->e[j];
            work[m++] = make ? node_of(c, e->key, e->hash) : tab_find(&c->index, e->key, e->hash);
        }
        for (Py_ssize_t j = 0; j < n; j++)
            work[m++] = (nodes[j] != NIL || !make) ? nodes[j]
                                                   : node_of(c, keys[j], bytes_hash(keys[j]));
        p->touch(c, work, m);
        request_drop_entries(r);
    }
    c->last_store_size = k;
    if (!k) {
        c->store_skipped += offered;
        result = out;
        out = NULL;
        goto done;
    }
    if (shortfall > 0) {
        int32_t *victims = work;
        int rc = shortfall > c->num_idle ? -1 : p->evict(c, shortfall, victims);
        if (rc == -2) {
            PyErr_SetString(PyExc_SystemError, "s3fifo: fewer evictable blocks than counted");
            goto done;
        }
        if (rc < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        for (Py_ssize_t j = 0; j < shortfall; j++) {
            Node *nd = &c->nodes[victims[j]];
            if (evicted) PyList_SET_ITEM(evicted, j, Py_NewRef(nd->key));
            c->free_slots[c->n_free_slots++] = nd->slot;
        }
        for (Py_ssize_t j = 0; j < shortfall; j++)
            if (c->nodes[victims[j]].list == NO_LIST) node_forget(c, victims[j]);
        p->trim(c);
        c->num_idle -= shortfall;
        c->num_ready -= shortfall;
        c->evicted += shortfall;
    }
    c->store_skipped += offered - k;
    /* slots: fresh ones ascending, then the most recently freed first */
    Py_ssize_t s = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (absent[j] != 1) continue;
        int32_t i = nodes[j];
        int ghost = -1;
        if (i != NIL || p->remembers_touched) {
            /* known when offered or since touched; the touch or eviction may have
             * forgotten it (and reused its node) */
            i = tab_find(&c->index, keys[j], bytes_hash(keys[j]));
            if (i != NIL) {
                ghost = c->nodes[i].list;
                list_unlink(c, i);
            }
        }
        if (i == NIL) i = node_new(c, keys[j], bytes_hash(keys[j]));
        int32_t slot;
        if (c->num_allocated < c->num_blocks) slot = (int32_t)c->num_allocated++;
        else slot = c->free_slots[--c->n_free_slots];
        Node *nd = &c->nodes[i];
        nd->slot = slot;
        nd->ref = -1;
        if (inserted) inserted[s] = i;
        if (!p->insert_many) p->insert(c, i, ghost);
        if (to_store) {
            PyList_SET_ITEM(to_store, s, Py_NewRef(keys[j]));
            PyList_SET_ITEM(ids, s, slot_int(c, slot));
        }
        s++;
        if (r && fold) r->e[entries[j]].flags |= F_INSERTED;
    }
    if (p->insert_many) p->insert_many(c, inserted, k);
    if (sim) {
        /* complete_store(success=True) of what was just stored */
        for (Py_ssize_t j = 0; j < k; j++) c->nodes[inserted[j]].ref = 0;
        c->num_ready += k;
        c->num_idle += k;
        c->stored += k;
        result = out;
        out = NULL;
        goto done;
    }
    c->num_pending += k;
    PyTuple_SET_ITEM(out, 0, to_store);
    PyTuple_SET_ITEM(out, 1, ids);
    PyTuple_SET_ITEM(out, 2, evicted);
    to_store = ids = evicted = NULL;
    result = out;
    out = NULL;
    if (shortfall > 0 && emit(c, PyTuple_GET_ITEM(result, 2), 1) < 0) Py_CLEAR(result);
done:
    Py_XDECREF(to_store);
    Py_XDECREF(ids);
    Py_XDECREF(evicted);
    Py_XDECREF(out);
    return result;
}

static PyObject *prepare_store_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
    PyObject *a[2], **keys;
    Py_ssize_t n;
    if (parse(args, nargs, kwnames, "prepare_store", KEYS_CTX, 1, 2, a) < 0) return NULL;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    PyObject *result = store_keys(c, keys, n, a[1] ? a[1] : Py_None);
    Py_DECREF(seq);
    return result;
}

static PyObject *complete_store_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    static const char *const names[] = {"keys", "ctx", "success", NULL};
    PyObject *a[3], **keys, *out = NULL, *done_keys = NULL;
    Py_ssize_t n;
    if (parse(args, nargs, kwnames, "complete_store", names, 1, 3, a) < 0) return NULL;
    int success = 1;
    if (a[2] && (success = PyObject_IsTrue(a[2])) < 0) return NULL;
    PyObject *seq = keys_of(a[0], &keys, &n);
    if (!seq) return NULL;
    int32_t *nodes = scratch(c, 0, n);
    if (!nodes || resolve(c, keys, n, nodes) < 0) goto done;
    /* the keys still being stored, each once */
    uint32_t epoch = next_epoch(c);
    Py_ssize_t d = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = nodes[j];
        if (i == NIL) continue;
        Node *nd = &c->nodes[i];
        if (resident(nd) && nd->ref < 0 && nd->mark != epoch) {
            nd->mark = epoch;
            nodes[d++] = i;
        }
    }
    if (success && d && c->events) {
        if (!(done_keys = PyList_New(d))) goto done;
        for (Py_ssize_t j = 0; j < d; j++)
            PyList_SET_ITEM(done_keys, j, Py_NewRef(c->nodes[nodes[j]].key));
    }
    c->num_pending -= d;
    if (success) {
        for (Py_ssize_t j = 0; j < d; j++) c->nodes[nodes[j]].ref = 0;
        c->num_ready += d;
        c->num_idle += d;
        c->stored += d;
        if (done_keys && emit(c, done_keys, 0) < 0) goto done;
    } else {
        for (Py_ssize_t j = 0; j < d; j++) {
            int32_t i = nodes[j];
            c->policy->remove(c, i);
            c->free_slots[c->n_free_slots++] = c->nodes[i].slot;
            node_forget(c, i);
        }
        c->store_failed += d;
    }
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(done_keys);
    Py_DECREF(seq);
    return out;
}

static PyObject *on_new_request_impl(Core *c, PyObject *ctx) {
    PyObject *req_id = PyObject_GetAttr(ctx, s_req_id);
    if (!req_id) return NULL;
    PyObject *capsule = new_request_capsule();
    int rc = capsule ? PyDict_SetItem(c->requests, req_id, capsule) : -1;
    Py_XDECREF(capsule);
    Py_DECREF(req_id);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* the end token of a key: 1 and *pos, 0 when unknown, -1 on error */
static int position_of(PyObject *positions, PyObject *key, long long *pos) {
    PyObject *v;
    if (PyDict_CheckExact(positions)) {
        v = PyDict_GetItemWithError(positions, key);
        if (!v) return PyErr_Occurred() ? -1 : 0;
        Py_INCREF(v);
    } else {
        v = PyObject_CallMethodOneArg(positions, s_get, key);
        if (!v) return -1;
    }
    int rc = 0;
    if (v != Py_None) {
        if (!PyLong_Check(v)) {
            PyErr_Format(PyExc_TypeError, "positions: end tokens must be ints, got %.100s",
                         Py_TYPE(v)->tp_name);
            rc = -1;
        } else {
            *pos = PyLong_AsLongLong(v);
            rc = *pos == -1 && PyErr_Occurred() ? -1 : 1;
        }
    }
    Py_DECREF(v);
    return rc;
}

typedef struct {
    long long key;
    int32_t ord, val;
} SortItem;

static int sort_items_cmp(const void *pa, const void *pb) {
    const SortItem *a = pa, *b = pb;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return a->ord < b->ord ? -1 : a->ord > b->ord;
}

/* stable sort of order[lo:hi] (and pos alike) by pos */
static void sort_by_position(int32_t *order, long long *pos, SortItem *items, Py_ssize_t lo,
                             Py_ssize_t hi) {
    int sorted = 1;
    for (Py_ssize_t j = lo + 1; j < hi && sorted; j++) sorted = pos[j - 1] <= pos[j];
    if (sorted) return;
    for (Py_ssize_t j = lo; j < hi; j++) {
        items[j - lo].key = pos[j];
        items[j - lo].ord = (int32_t)j;
        items[j - lo].val = order[j];
    }
    qsort(items, (size_t)(hi - lo), sizeof(SortItem), sort_items_cmp);
    for (Py_ssize_t j = lo; j < hi; j++) {
        order[j] = items[j - lo].val;
        pos[j] = items[j - lo].key;
    }
}

static long long group_of(PyObject *key) {
    /* the last 4 bytes (fewer for a shorter key), ordered as bytes compare */
    Py_ssize_t len = PyBytes_GET_SIZE(key), t = len < 4 ? len : 4;
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(key) + len - t;
    long long code = 0;
    for (Py_ssize_t j = 0; j < 4; j++) code = code * 257 + (j < t ? b[j] + 1 : 0);
    return code;
}

/* A request's entries head to tail, as vLLM orders them: by KV-cache group (ascending
 * group index), each group in first-use order or, where positions know all of its
 * keys, by end token; then, where they know every key, all of them by end token. */
static int request_order(Request *r, PyObject *positions, int32_t *order) {
    Py_ssize_t m = r->n;
    int rc = -1;
    long long *group = PyMem_Malloc((size_t)m * sizeof(long long));
    long long *pos = PyMem_Malloc((size_t)m * sizeof(long long));
    uint8_t *known = PyMem_Malloc((size_t)m);
    SortItem *items = PyMem_Malloc((size_t)m * sizeof(SortItem));
    if (!group || !pos || !known || !items) {
        PyErr_NoMemory();
        goto done;
    }
    int one_group = 1;
    for (Py_ssize_t j = 0; j < m; j++) {
        order[j] = (int32_t)j;
        group[j] = group_of(r->e[j].key);
        if (group[j] != group[0]) one_group = 0;
    }
    if (!one_group) {
        for (Py_ssize_t j = 0; j < m; j++) {
            items[j].key = group[j];
            items[j].ord = (int32_t)j;
            items[j].val = (int32_t)j;
        }
        qsort(items, (size_t)m, sizeof(SortItem), sort_items_cmp);
        for (Py_ssize_t j = 0; j < m; j++) {
            order[j] = items[j].val;
            group[j] = items[j].key;
        }
    }
    if (positions != Py_None) {
        for (Py_ssize_t j = 0; j < m; j++) {
            int got = position_of(positions, r->e[order[j]].key, &pos[j]);
            if (got < 0) goto done;
            known[j] = (uint8_t)got;
        }
        int all_known = 1, groups = 0;
        for (Py_ssize_t lo = 0, hi; lo < m; lo = hi) {
            int group_known = 1;
            for (hi = lo; hi < m && group[hi] == group[lo]; hi++) group_known &= known[hi];
            groups++;
            if (group_known) sort_by_position(order, pos, items, lo, hi);
            else all_known = 0;
        }
        if (all_known && groups > 1) sort_by_position(order, pos, items, 0, m);
    }
    rc = 0;
done:
    PyMem_Free(group);
    PyMem_Free(pos);
    PyMem_Free(known);
    PyMem_Free(items);
    return rc;
}

static PyObject *on_request_finished_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames) {
    static const char *const names[] = {"ctx", "positions", NULL};
    PyObject *a[2], *out = NULL;
    if (parse(args, nargs, kwnames, "on_request_finished", names, 1, 2, a) < 0) return NULL;
    PyObject *positions = a[1] ? a[1] : Py_None;
    PyObject *req_id = PyObject_GetAttr(a[0], s_req_id);
    if (!req_id) return NULL;
    PyObject *capsule = PyDict_GetItemWithError(c->requests, req_id);
    if (!capsule) {
        Py_DECREF(req_id);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* unknown or already finished */
    }
    Py_INCREF(capsule);
    Request *r = PyCapsule_GetPointer(capsule, REQUEST_CAPSULE);
    Py_ssize_t m = r ? r->n : 0;
    int32_t *nodes = r ? scratch(c, 0, m) : NULL;
    const Policy *p = c->policy;
    int touching = r && p->touch_before_store && !r->touched && m; /* never stored: its loads */
    if (!nodes || (touching && p->remembers_touched && nodes_reserve(c, m) < 0) ||
        PyDict_DelItem(c->requests, req_id) < 0) {
        Py_DECREF(req_id);
        goto done;
    }
    Py_DECREF(req_id);
    if (p->touch_before_store) {
        if (touching) {
            for (Py_ssize_t j = 0; j < m; j++) {
                Entry *e = &r->e[j];
                nodes[j] = p->remembers_touched ? node_of(c, e->key, e->hash)
                                                : tab_find(&c->index, e->key, e->hash);
            }
            p->touch(c, nodes, m);
        }
    } else if (m) {
        int32_t *order = scratch(c, 1, m);
        uint8_t *flags = PyMem_Malloc((size_t)m);
        if (!order || !flags || request_order(r, positions, order) < 0) {
            if (order && !flags) PyErr_NoMemory();
            PyMem_Free(flags);
            goto done;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            Entry *e = &r->e[order[j]];
            nodes[j] = tab_find(&c->index, e->key, e->hash);
            flags[j] = e->flags;
        }
        p->finish(c, nodes, flags, m);
        PyMem_Free(flags);
    }
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(capsule);
    return out;
}

static PyObject *Core_take_events(Core *c, PyObject *unused) {
    (void)unused;
    if (!c->events || !PyList_GET_SIZE(c->events)) return PyList_New(0);
    PyObject *fresh = PyList_New(0);
    if (!fresh) return NULL;
    PyObject *taken = c->events;
    c->events = fresh;
    return taken;
}

/* ready keys in the policy's order */
static PyObject *ready_keys(Core *c) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int lists[NUM_LISTS];
    int nl = c->policy->order(c, lists);
    for (int k = 0; k < nl; k++)
        for (int32_t i = c->lists[lists[k]].head; i != NIL; i = c->nodes[i].next)
            if (c->nodes[i].ref >= 0 && PyList_Append(out, c->nodes[i].key) < 0) {
                Py_DECREF(out);
                return NULL;
            }
    return out;
}

static PyObject *Core_resident_keys(Core *c, PyObject *unused) {
    (void)unused;
    return ready_keys(c);
}

static PyObject *reset_cache_impl(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    static const char *const names[] = {"force", NULL};
    PyObject *a[1];
    if (parse(args, nargs, kwnames, "reset_cache", names, 0, 1, a) < 0) return NULL;
    int force = 0;
    if (a[0] && (force = PyObject_IsTrue(a[0])) < 0) return NULL;
    Py_ssize_t pinned = c->num_ready - c->num_idle;
    if ((c->num_pending || pinned) && !force) {
        PyErr_Format(PyExc_RuntimeError,
                     "reset_cache with transfers in flight (%zd blocks being stored, %zd being "
                     "loaded): wait for them first",
                     c->num_pending, pinned);
        return NULL;
    }
    PyObject *removed = ready_keys(c);
    if (!removed) return NULL;
    forget_all(c);
    c->target_t1 = 0.0;
    c->ahead = 0;
    if (c->kv) kv_clear(c->kv);
    PyDict_Clear(c->requests);
    c->num_allocated = 0;
    c->n_free_slots = 0;
    c->num_ready = c->num_idle = c->num_pending = 0;
    int rc = PyList_GET_SIZE(removed) ? emit(c, removed, 1) : 0;
    Py_DECREF(removed);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_stats(Core *c, PyObject *unused) {
    (void)unused;
    Py_ssize_t num_free = c->num_blocks - c->num_allocated + c->n_free_slots;
    return Py_BuildValue("nnnnnLLLLLLL", c->num_blocks, c->num_ready, c->num_pending,
                         c->num_ready - c->num_idle, num_free, c->stored, c->store_failed,
                         c->loaded, c->evicted, c->store_skipped, c->lookups, c->hits);
}

static PyObject *list_snapshot(Core *c, int l) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int32_t i = c->lists[l].head; i != NIL; i = c->nodes[i].next) {
        Node *nd = &c->nodes[i];
        PyObject *item = l < GHOST_BASE ? Py_BuildValue("(Oiii)", nd->key, (int)nd->slot,
                                                        (int)nd->ref, (int)nd->freq)
                                        : Py_NewRef(nd->key);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* rows (key, uses, tick, class) of a kv list, as KVPolicy.snapshot() gives them */
static PyObject *kv_rows(Core *c, int l) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int32_t i = c->lists[l].head; i != NIL; i = c->nodes[i].next) {
        Node *nd = &c->nodes[i];
        PyObject *row = Py_BuildValue("(OiLi)", nd->key, (int)nd->freq, (long long)nd->tick,
                                      (int)nd->cls);
        if (!row || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(row);
    }
    return out;
}

static PyObject *doubles(const double *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *f = PyFloat_FromDouble(v[j]);
        if (!f) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, f);
    }
    return out;
}

/* everything kv holds, in the layout of KVPolicy.snapshot(), and its parameters */
static PyObject *kv_snapshot(Core *c) {
    KVState *kv = c->kv;
    PyObject *queues = PyList_New(KV_CLASSES), *table = PyList_New(KV_CLASSES);
    if (!queues || !table) goto fail;
    for (int k = 0; k < KV_CLASSES; k++) {
        PyObject *q = kv_rows(c, k), *row = doubles(kv->table[k], AGE_BINS);
        if (q) PyList_SET_ITEM(queues, k, q);
        if (row) PyList_SET_ITEM(table, k, row);
        if (!q || !row) goto fail;
    }
    PyObject *ticks = PyList_New(kv->n_rebuild_ticks);
    if (!ticks) goto fail;
    for (int j = 0; j < kv->n_rebuild_ticks; j++) {
        PyObject *t = PyLong_FromLongLong(kv->rebuild_ticks[j]);
        if (!t) {
            Py_DECREF(ticks);
            goto fail;
        }
        PyList_SET_ITEM(ticks, j, t);
    }
    return Py_BuildValue("{s:N,s:N,s:N,s:L,s:n,s:d,s:N,s:N,s:N,s:L,s:N,s:L,s:n,s:n,s:d}", "queues",
                         queues, "fresh", kv_rows(c, KV_FRESH), "ghost", kv_rows(c, KV_GHOST),
                         "tick", (long long)kv->tick, "inserts", kv->inserts, "last_victim",
                         kv->last_victim, "entered", doubles(kv->entered, KV_CLASSES), "reused",
                         doubles(kv->reused, KV_CLASSES * AGE_BINS), "table", table, "rebuilds",
                         (long long)kv->rebuilds, "rebuild_ticks", ticks, "traffic",
                         (long long)kv->traffic, "ghost_cap",
                         kv->ghost_cap, "rebuild_every", kv->rebuild_every, "decay", kv->decay);
fail:
    Py_XDECREF(queues);
    Py_XDECREF(table);
    return NULL;
}

/* The policy's lists, for tests: resident ones as (key, slot, ref_cnt, freq), ghosts as
 * keys. lru: [blocks]; arc: [t1, t2, b1, b2]; s3fifo: [small, main, ghost]; sieve:
 * [behind, ahead] (freq: the visited bit); kv: [its 15 class queues (freq: uses), fresh,
 * ghost], and under "kv" what KVPolicy.snapshot() gives. */
static PyObject *Core_snapshot(Core *c, PyObject *unused) {
    (void)unused;
    const Policy *p = c->policy;
    int ids[NUM_LISTS] = {0, 1, GHOST_BASE, GHOST_BASE + 1}, nl = 2;
    if (p == &LRU) nl = 1;
    else if (p == &ARC) nl = 4;
    else if (p == &S3FIFO) nl = 3;
    else if (p == &SIEVE) sieve_order(c, ids);
    else if (p == &KV) {
        nl = kv_order(c, ids);
        ids[nl++] = KV_FRESH;
        ids[nl++] = KV_GHOST;
    }
    PyObject *lists = PyList_New(nl);
    if (!lists) return NULL;
    for (int k = 0; k < nl; k++) {
        PyObject *l = list_snapshot(c, ids[k]);
        if (!l) {
            Py_DECREF(lists);
            return NULL;
        }
        PyList_SET_ITEM(lists, k, l);
    }
    PyObject *kv = c->kv ? kv_snapshot(c) : Py_NewRef(Py_None);
    if (!kv) {
        Py_DECREF(lists);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:d,s:n,s:n,s:N}", "lists", lists, "target_t1", c->target_t1,
                         "requests", PyDict_GET_SIZE(c->requests), "known_keys", c->live, "kv",
                         kv);
}

static PyObject *Core_get_policy(Core *c, void *unused) {
    (void)unused;
    return PyUnicode_FromString(c->policy->name);
}

static PyObject *Core_get_target_t1(Core *c, void *unused) {
    (void)unused;
    return PyFloat_FromDouble(c->target_t1);
}

/* --- guarded entry points ----------------------------------------------------------- */

static int enter(Core *c) {
    if (c->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the manager was called from inside one of its own calls (a finalizer, "
                        "a req_id property, a hash?)");
        return -1;
    }
    c->busy = 1;
    return 0;
}

#define GUARDED(name)                                                                   \
    static PyObject *Core_##name(Core *c, PyObject *const *args, Py_ssize_t nargs,      \
                                 PyObject *kwnames) {                                   \
        if (enter(c) < 0) return NULL;                                                  \
        PyObject *out = name##_impl(c, args, nargs, kwnames);                           \
        c->busy = 0;                                                                    \
        return out;                                                                     \
    }

GUARDED(prepare_load)
GUARDED(complete_load)
GUARDED(touch)
GUARDED(prepare_store)
GUARDED(complete_store)
GUARDED(on_request_finished)
GUARDED(reset_cache)

/* One request as the engine runs it, with every store complete at once (a key-only
 * ghost of a tier: the adaptive policy's), deciding exactly as lookup_prefix, touch of
 * the hits, touch of the rest, prepare_store of the rest and complete_store of what it
 * stored would: keys hashed and found once for the lookup and the hits' touch, the
 * store completed in place. The prefix hits. */
static PyObject *simulate_impl(Core *c, PyObject *keys_arg) {
    PyObject **keys, *out = NULL;
    Py_ssize_t len, n = 0;
    PyObject *seq = keys_of(keys_arg, &keys, &len);
    if (!seq) return NULL;
    const Policy *p = c->policy;
    int32_t *nodes = scratch(c, 0, len);
    if (!nodes || resolve(c, keys, len, nodes) < 0) goto fail;
    for (; n < len; n++) {
        int32_t i = nodes[n];
        if (i == NIL || !resident(&c->nodes[i]) || c->nodes[i].ref < 0) break;
    }
    if (n) p->touch(c, nodes, n); /* every hit has its node */
    if (n < len) {
        Py_ssize_t m = len - n;
        /* found again after the hits' touch: it may have forgotten ghosts (and reused
         * their nodes); without hits, found above */
        if (n && !(nodes = scratch(c, 0, m))) goto fail;
        if (touch_keys(c, keys + n, m, nodes, n == 0) < 0) goto fail;
        c->simulating = 1;
        out = store_keys(c, keys + n, m, Py_None);
        c->simulating = 0;
        if (!out) goto fail;
        Py_DECREF(out);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Core_simulate(Core *c, PyObject *keys_arg) {
    if (enter(c) < 0) return NULL;
    PyObject *out = simulate_impl(c, keys_arg);
    c->busy = 0;
    return out;
}

static PyObject *Core_on_new_request(Core *c, PyObject *ctx) {
    if (enter(c) < 0) return NULL;
    PyObject *out = on_new_request_impl(c, ctx);
    c->busy = 0;
    return out;
}

/* --- kv_restore: a kv ghost started from another kv's state ---------------------------- */

static int kv_read_doubles(PyObject *arg, double *out, Py_ssize_t n, const char *what) {
    PyObject *seq = PySequence_Fast(arg, what);
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "kv_restore: %s must have %zd values", what, n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        out[j] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, j));
        if (out[j] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* rows (key, uses, tick, class): checked, keys unique across both lists (seen), before
 * anything changes */
static int kv_check_rows(PyObject *seq, PyObject *seen, int64_t now) {
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *key;
        int uses, cls;
        long long tick;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, j), "OiLi", &key, &uses, &tick, &cls))
            return -1;
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "kv_restore: keys must be bytes");
            return -1;
        }
        if (uses < 1 || uses > USE_BUCKETS || cls < 0 || cls >= KV_CLASSES || tick < 0 ||
            tick > now) {
            PyErr_SetString(PyExc_ValueError,
                            "kv_restore: a row's uses, tick or class is out of range");
            return -1;
        }
        int had = PySet_Contains(seen, key);
        if (had < 0 || (!had && PySet_Add(seen, key) < 0)) return -1;
        if (had) {
            PyErr_SetString(PyExc_ValueError, "kv_restore: a key is listed twice");
            return -1;
        }
    }
    return 0;
}

static void kv_place_rows(Core *c, PyObject *seq, int resident_rows) {
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, j);
        PyObject *key = PyTuple_GET_ITEM(row, 0);
        Py_hash_t h = bytes_hash(key);
        int32_t i = node_new(c, key, h);
        Node *nd = &c->nodes[i];
        nd->freq = (uint8_t)PyLong_AsLong(PyTuple_GET_ITEM(row, 1));
        nd->tick = (int64_t)PyLong_AsLongLong(PyTuple_GET_ITEM(row, 2));
        nd->cls = (uint8_t)PyLong_AsLong(PyTuple_GET_ITEM(row, 3));
        if (resident_rows) {
            nd->slot = (int32_t)c->num_allocated++; /* an empty manager: fresh slots */
            nd->ref = 0;
            list_append(c, nd->cls, i);
            c->num_ready++;
            c->num_idle++;
        } else {
            list_append(c, KV_GHOST, i);
        }
    }
}

/* rebuilds and their ticks (the first min(rebuilds, KV_FADE_TICKS), in order, each in
 * [0, tick]) into st; -1 on error */
static int kv_read_fade(KVState *st, long long rebuilds, PyObject *arg, int64_t tick) {
    PyObject *seq = PySequence_Fast(arg, "kv_restore: rebuild_ticks must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (rebuilds < 0 || n != (rebuilds < KV_FADE_TICKS ? rebuilds : KV_FADE_TICKS)) {
        PyErr_Format(PyExc_ValueError,
                     "kv_restore: rebuild_ticks must hold the first min(rebuilds, %d) "
                     "rebuilds' ticks, got %zd for %lld rebuilds",
                     KV_FADE_TICKS, n, rebuilds);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long t = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, j));
        if (t == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (t < 0 || t > tick || (j && t < st->rebuild_ticks[j - 1])) {
            PyErr_SetString(PyExc_ValueError,
                            "kv_restore: rebuild_ticks must be in order, each in [0, tick]");
            Py_DECREF(seq);
            return -1;
        }
        st->rebuild_ticks[j] = t;
    }
    Py_DECREF(seq);
    st->rebuilds = rebuilds;
    st->n_rebuild_ticks = (int)n;
    return 0;
}

/* kv_restore(tick, inserts, last_victim, entered, reused, table, resident, ghost,
 * rebuilds, rebuild_ticks, traffic): an empty kv manager takes another kv's learned state, its
 * resident rows (key, uses, tick, class) ready and idle, each class's in order of last
 * use, and its ghost rows */
static PyObject *Core_kv_restore(Core *c, PyObject *args) {
    long long tick, rebuilds, traffic;
    Py_ssize_t inserts;
    double last_victim;
    PyObject *entered, *reused, *table, *res_arg, *ghost_arg, *rticks;
    if (!PyArg_ParseTuple(args, "LndOOOOOLOL", &tick, &inserts, &last_victim, &entered, &reused,
                          &table, &res_arg, &ghost_arg, &rebuilds, &rticks, &traffic))
        return NULL;
    if (!c->kv || c->live || c->num_allocated) {
        PyErr_SetString(PyExc_ValueError, "kv_restore needs an empty kv manager");
        return NULL;
    }
    if (tick < 0 || inserts < 0 || traffic < 0) {
        PyErr_SetString(PyExc_ValueError, "kv_restore: tick, inserts and traffic must be >= 0");
        return NULL;
    }
    KVState st = *c->kv;
    PyObject *res = NULL, *ghost = NULL, *rows = NULL, *seen = NULL;
    if (kv_read_fade(&st, rebuilds, rticks, tick) < 0) goto fail;
    st.traffic = traffic;
    if (kv_read_doubles(entered, st.entered, KV_CLASSES, "entered") < 0) goto fail;
    if (kv_read_doubles(reused, st.reused, KV_CLASSES * AGE_BINS, "reused") < 0) goto fail;
    if (!(rows = PySequence_Fast(table, "kv_restore: table must be a sequence"))) goto fail;
    if (PySequence_Fast_GET_SIZE(rows) != KV_CLASSES) {
        PyErr_SetString(PyExc_ValueError, "kv_restore: table must have a row per class");
        goto fail;
    }
    for (int k = 0; k < KV_CLASSES; k++)
        if (kv_read_doubles(PySequence_Fast_GET_ITEM(rows, k), st.table[k], AGE_BINS,
                            "table row") < 0)
            goto fail;
    if (!(res = PySequence_Fast(res_arg, "kv_restore: resident rows must be a sequence")))
        goto fail;
    if (!(ghost = PySequence_Fast(ghost_arg, "kv_restore: ghost rows must be a sequence")))
        goto fail;
    if (PySequence_Fast_GET_SIZE(res) > c->num_blocks) {
        PyErr_SetString(PyExc_ValueError, "kv_restore: more resident rows than slots");
        goto fail;
    }
    if (!(seen = PySet_New(NULL))) goto fail;
    if (kv_check_rows(res, seen, tick) < 0 || kv_check_rows(ghost, seen, tick) < 0) goto fail;
    if (nodes_reserve(c, PySet_GET_SIZE(seen)) < 0) goto fail;
    /* nothing fails from here on */
    st.tick = tick;
    st.inserts = inserts;
    st.last_victim = last_victim;
    *c->kv = st;
    kv_place_rows(c, res, 1);
    kv_place_rows(c, ghost, 0);
    kv_trim(c);
    Py_DECREF(rows);
    Py_DECREF(res);
    Py_DECREF(ghost);
    Py_DECREF(seen);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(rows);
    Py_XDECREF(res);
    Py_XDECREF(ghost);
    Py_XDECREF(seen);
    return NULL;
}

static PyObject *Core_kv_restore_guarded(Core *c, PyObject *args) {
    if (enter(c) < 0) return NULL;
    PyObject *out = Core_kv_restore(c, args);
    c->busy = 0;
    return out;
}

/* --- the type ----------------------------------------------------------------------- */

static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->events);
    Py_VISIT(c->requests);
    Py_VISIT(c->results);
    return 0;
}

static int Core_clear(Core *c) {
    /* the request ids and the lookup results are the only way back to this object */
    if (c->requests && !c->busy) PyDict_Clear(c->requests);
    Py_CLEAR(c->results);
    return 0;
}

static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    if (c->nodes) forget_all(c);
    PyMem_Free(c->nodes);
    tab_free(&c->index);
    if (c->slot_ints) {
        for (Py_ssize_t s = 0; s < c->num_blocks; s++) Py_XDECREF(c->slot_ints[s]);
        PyMem_Free(c->slot_ints);
    }
    PyMem_Free(c->free_slots);
    Py_XDECREF(c->events);
    Py_XDECREF(c->requests);
    Py_XDECREF(c->results);
    for (int k = 0; k < 4; k++) PyMem_Free(c->buf[k]);
    PyMem_Free(c->kv);
    PyMem_Free(c->bytes);
    PyMem_Free(c->seen);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"num_blocks", "policy", "enable_events", "results", NULL};
    Py_ssize_t num_blocks;
    const char *name;
    int enable_events;
    PyObject *results;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nspO!", names, &num_blocks, &name,
                                     &enable_events, &PyTuple_Type, &results))
        return NULL;
    if (num_blocks <= 0 || num_blocks > MAX_NUM_BLOCKS) {
        PyErr_Format(PyExc_ValueError, "num_blocks must be in [1, %d], got %zd", MAX_NUM_BLOCKS,
                     num_blocks);
        return NULL;
    }
    if (PyTuple_GET_SIZE(results) != 3) {
        PyErr_SetString(PyExc_ValueError, "results must be (MISS, HIT, HIT_PENDING)");
        return NULL;
    }
    const Policy *policy = NULL;
    for (int k = 0; POLICIES[k]; k++)
        if (!strcmp(POLICIES[k]->name, name)) policy = POLICIES[k];
    if (!policy) {
        PyErr_Format(PyExc_ValueError, "the native manager has no policy %s", name);
        return NULL;
    }
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->policy = policy;
    c->num_blocks = num_blocks;
    c->free_node = NIL;
    for (int l = 0; l < NUM_LISTS; l++) list_init(&c->lists[l]);
    if (policy == &KV) {
        /* KVPolicy's defaults: ghost_factor 4, half_life 4 (as kv.py computes them) */
        if (!(c->kv = PyMem_Calloc(1, sizeof(KVState)))) {
            Py_DECREF(c);
            return PyErr_NoMemory();
        }
        c->kv->capacity = num_blocks;
        c->kv->ghost_cap = (Py_ssize_t)((double)num_blocks * 4.0);
        c->kv->rebuild_every = num_blocks / 8 > 64 ? num_blocks / 8 : 64;
        c->kv->decay = pow(0.5, (double)c->kv->rebuild_every / (4.0 * (double)num_blocks));
        kv_clear(c->kv);
    }
    c->small_capacity = num_blocks / 10 > 1 ? num_blocks / 10 : 1;
    c->ghost_capacity = num_blocks - c->small_capacity > 1 ? num_blocks - c->small_capacity : 1;
    c->results = Py_NewRef(results);
    c->free_slots = PyMem_Malloc((size_t)num_blocks * sizeof(int32_t));
    c->slot_ints = PyMem_Calloc((size_t)num_blocks, sizeof(PyObject *));
    if (!c->free_slots || !c->slot_ints) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    if (tab_reserve(&c->index, 8) < 0 || !(c->requests = PyDict_New()) ||
        (enable_events && !(c->events = PyList_New(0)))) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

#define FASTCALL(name) (PyCFunction)(void (*)(void))Core_##name, METH_FASTCALL | METH_KEYWORDS

static PyMethodDef Core_methods[] = {
    {"lookup", FASTCALL(lookup), "lookup(key, ctx=None): MISS, HIT or HIT_PENDING."},
    {"lookup_prefix", FASTCALL(lookup_prefix), "How many leading keys are ready."},
    {"prepare_load", FASTCALL(prepare_load), "Pin ready blocks; their slot ids."},
    {"complete_load", FASTCALL(complete_load), "Unpin blocks pinned by prepare_load."},
    {"touch", FASTCALL(touch), "Mark keys used, the first the most recently."},
    {"prepare_store", FASTCALL(prepare_store),
     "(keys_to_store, slot ids, evicted keys), or None when there is no room."},
    {"complete_store", FASTCALL(complete_store), "Finish stores (success=True) or drop them."},
    {"on_new_request", (PyCFunction)Core_on_new_request, METH_O, "A request starts."},
    {"simulate", (PyCFunction)Core_simulate, METH_O,
     "simulate(keys): one request run to its end at once (a key-only ghost); its hits."},
    {"on_request_finished", FASTCALL(on_request_finished), "A request ended."},
    {"take_events", (PyCFunction)Core_take_events, METH_NOARGS,
     "The (keys, removed) events since the last call."},
    {"reset_cache", FASTCALL(reset_cache), "Drop every block."},
    {"stats", (PyCFunction)Core_stats, METH_NOARGS, "ManagerStats' fields, in order."},
    {"resident_keys", (PyCFunction)Core_resident_keys, METH_NOARGS,
     "Ready keys in policy order."},
    {"snapshot", (PyCFunction)Core_snapshot, METH_NOARGS, "The policy's lists, for tests."},
    {"kv_restore", (PyCFunction)Core_kv_restore_guarded, METH_VARARGS,
     "An empty kv manager takes another kv's state (auto's ghosts)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"num_blocks", T_PYSSIZET, offsetof(Core, num_blocks), READONLY, "Slots in the tier."},
    {"last_store_size", T_PYSSIZET, offsetof(Core, last_store_size), READONLY,
     "Slots the last prepare_store asked for, whether it got them or not."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"policy", (getter)Core_get_policy, NULL, "The policy's name.", NULL},
    {"target_t1", (getter)Core_get_target_t1, NULL, "ARC's target size of T1.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mgrcore.Manager",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Manager(num_blocks, policy, enable_events, results): the request-scoped "
              "CPU-tier manager.",
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_getset = Core_getset,
};

static int mgrcore_exec(PyObject *m) {
    PyObject *errors = PyImport_ImportModule("asyncoffload.errors");
    if (!errors) return -1;
    UnknownKeyError = PyObject_GetAttrString(errors, "UnknownKeyError");
    KeyNotReadyError = PyObject_GetAttrString(errors, "KeyNotReadyError");
    DuplicateKeyError = PyObject_GetAttrString(errors, "DuplicateKeyError");
    Py_DECREF(errors);
    if (!UnknownKeyError || !KeyNotReadyError || !DuplicateKeyError) return -1;
    if (!(s_req_id = PyUnicode_InternFromString("req_id")) ||
        !(s_step = PyUnicode_InternFromString("step")) || !(s_one = PyLong_FromLong(1)) ||
        !(s_observe = PyUnicode_InternFromString("observe")) ||
        !(s_get = PyUnicode_InternFromString("get")) ||
        !(s_hex = PyUnicode_InternFromString("hex")))
        return -1;
    if (PyType_Ready(&CoreType) < 0) return -1;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Manager", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "MAX_NUM_BLOCKS", MAX_NUM_BLOCKS) < 0) return -1;
    Py_ssize_t count = 0;
    while (POLICIES[count]) count++;
    PyObject *names = PyTuple_New(count);
    if (!names) return -1;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *name = PyUnicode_FromString(POLICIES[k]->name);
        if (!name) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, k, name);
    }
    if (PyModule_AddObject(m, "POLICIES", names) < 0) {
        Py_DECREF(names);
        return -1;
    }
    return 0;
}

/* --- the engine's input checks, the common case in one pass ------------------------- */

/* checked_keys(keys, min_len): a new list of keys when keys is a list or tuple of exact
 * bytes objects, each longer than min_len; else None (the Python check finds and names
 * what is wrong). */
static PyObject *mod_checked_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "checked_keys(keys, min_len)");
        return NULL;
    }
    PyObject *keys = args[0];
    Py_ssize_t min_len = PyLong_AsSsize_t(args[1]);
    if (min_len == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) <= min_len)
            Py_RETURN_NONE;
    }
    return PySequence_List(keys);
}

/* distinct(keys): keys itself when it is a list of at most 32 exact bytes objects of
 * which none repeats; else None (the caller deduplicates). */
static PyObject *mod_distinct(PyObject *self, PyObject *keys) {
    if (!PyList_CheckExact(keys)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n > 32) Py_RETURN_NONE; /* pairwise below; a dict serves longer lists better */
    Py_hash_t hashes[32];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(k)) Py_RETURN_NONE;
        if ((hashes[i] = PyObject_Hash(k)) == -1) return NULL;
    }
    int repeats = 0;
    for (Py_ssize_t i = 1; i < n && !repeats; i++)
        for (Py_ssize_t j = 0; j < i; j++)
            if (hashes[i] == hashes[j] &&
                PyBytes_GET_SIZE(PyList_GET_ITEM(keys, i)) ==
                    PyBytes_GET_SIZE(PyList_GET_ITEM(keys, j)) &&
                memcmp(PyBytes_AS_STRING(PyList_GET_ITEM(keys, i)),
                       PyBytes_AS_STRING(PyList_GET_ITEM(keys, j)),
                       (size_t)PyBytes_GET_SIZE(PyList_GET_ITEM(keys, i))) == 0) {
                repeats = 1;
                break;
            }
    if (!repeats) {
        Py_INCREF(keys);
        return keys;
    }
    Py_RETURN_NONE;
}

static int cmp_int64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* ids_ok(ids, limit, unique): whether the list ids holds only exact ints in [0, limit),
 * none twice when unique. */
static PyObject *mod_ids_ok(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "ids_ok(ids: list, limit, unique)");
        return NULL;
    }
    PyObject *ids = args[0];
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    int unique = PyObject_IsTrue(args[2]);
    if (unique < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    int64_t small[64];
    int64_t *values = n <= 64 ? small : (int64_t *)PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (values == NULL) return PyErr_NoMemory();
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *b = PyList_GET_ITEM(ids, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(b) ? PyLong_AsLongLongAndOverflow(b, &overflow) : -1;
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            ok = 0;
        } else if (overflow || v < 0 || v >= limit) {
            ok = 0;
        } else {
            values[i] = (int64_t)v;
        }
    }
    if (ok && unique && n > 1) {
        if (n <= 16) {
            for (Py_ssize_t i = 0; i < n && ok; i++)
                for (Py_ssize_t j = i + 1; j < n; j++)
                    if (values[i] == values[j]) {
                        ok = 0;
                        break;
                    }
        } else {
            qsort(values, (size_t)n, sizeof(int64_t), cmp_int64);
            for (Py_ssize_t i = 1; i < n; i++)
                if (values[i] == values[i - 1]) {
                    ok = 0;
                    break;
                }
        }
    }
    if (values != small) PyMem_Free(values);
    return PyBool_FromLong(ok);
}

/* call_blocks(fn, tables, direction, kv_ids, host_ids): fn(tables, direction, n, ids),
 * fn the address of a C function int(const int64_t *, int, int64_t, const int64_t *)
 * (copy_engine.c's ao_copy_blocks) and ids the n ints of each list or tuple, as int64:
 * n KV block ids, then n host block ids. Returns fn's code, or None, calling nothing,
 * when they differ in length or hold anything but exact ints that fit (the caller then
 * converts them itself). A CPython entry costs a fraction of a ctypes call and of the
 * arrays it needs, on the hot path of a small copy. */
typedef int (*copy_fn)(const int64_t *, int, int64_t, const int64_t *);

static PyObject *mod_call_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !(PyList_CheckExact(args[3]) || PyTuple_CheckExact(args[3])) ||
        !(PyList_CheckExact(args[4]) || PyTuple_CheckExact(args[4]))) {
        PyErr_SetString(PyExc_TypeError,
                        "call_blocks(fn, tables, direction, kv_ids, host_ids): lists or tuples");
        return NULL;
    }
    copy_fn fn = (copy_fn)PyLong_AsVoidPtr(args[0]);
    const int64_t *tables = (const int64_t *)PyLong_AsVoidPtr(args[1]);
    int direction = (int)PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (fn == NULL || tables == NULL) {
        PyErr_SetString(PyExc_ValueError, "call_blocks: a null address");
        return NULL;
    }
    PyObject *kv = args[3], *host = args[4];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kv);
    if (PySequence_Fast_GET_SIZE(host) != n) Py_RETURN_NONE;
    PyObject **kv_items = PySequence_Fast_ITEMS(kv), **host_items = PySequence_Fast_ITEMS(host);
    int64_t small[128];
    int64_t *ids = n <= 64 ? small : (int64_t *)PyMem_Malloc(2 * (size_t)n * sizeof(int64_t));
    if (ids == NULL) return PyErr_NoMemory();
    int ok = 1;
    for (Py_ssize_t i = 0; i < 2 * n && ok; i++) {
        PyObject *b = i < n ? kv_items[i] : host_items[i - n];
        int overflow = 0;
        long long v = PyLong_CheckExact(b) ? PyLong_AsLongLongAndOverflow(b, &overflow) : 0;
        if (!PyLong_CheckExact(b) || overflow) ok = 0;
        ids[i] = (int64_t)v;
    }
    PyObject *out;
    if (ok)
        out = PyLong_FromLong(fn(tables, direction, (int64_t)n, ids));
    else {
        out = Py_None;
        Py_INCREF(out);
    }
    if (ids != small) PyMem_Free(ids);
    return out;
}

/* one_step(how, fn, tables, direction, kv_ids, host_ids, keys, ctx, future, ending,
 *          nbytes): the engine's one-step small copy (asyncoffload.copies.Copies.now) with
 * the glue between its Python calls in C. ``how`` is the tuple of what stays the same
 * for a direction: (manager, touch_name or None, complete_name, complete_kwnames or None,
 * publish or None, durations, rates, result_type, set_result, copies, count_name,
 * bytes_name), methods by name so that what an instance overrides is what runs. In order:
 *   copy the blocks with fn (see call_blocks): None, having copied and called nothing,
 *   when call_blocks cannot take the ids or raises; fn's code, calling nothing more,
 *   when it refuses them (ids out of bounds);
 *   manager.<touch_name>(keys, ctx) when given;
 *   copies.<count_name> += 1;
 *   ending.step = 1; manager.<complete_name>(keys, ctx[, success=True]); ending.step = 2;
 *   publish() when given; copies.<bytes_name> += nbytes;
 *   durations.observe(seconds); rates.observe(nbytes / seconds) when seconds > 0;
 *   set_result(future, result_type(len(kv_ids), nbytes, seconds)).
 * Returns True once the future is resolved. An exception from any of them propagates at
 * once, with ending.step saying how far it got: the caller finishes the transfer the way
 * the Python path would have (Copies._step_failed). */
static int add_to(PyObject *obj, PyObject *name, PyObject *amount) {
    PyObject *old = PyObject_GetAttr(obj, name);
    if (old == NULL) return -1;
    PyObject *sum = PyNumber_Add(old, amount);
    Py_DECREF(old);
    if (sum == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return rc;
}

static int set_step(PyObject *ending, long step) {
    PyObject *v = PyLong_FromLong(step);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(ending, s_step, v);
    Py_DECREF(v);
    return rc;
}

/* obj.<name>(*args[1:]) with args[0] = obj, its result dropped: 0, or -1 on error. */
static int call_method(PyObject *name, PyObject *const *args, size_t nargs, PyObject *kw) {
    PyObject *r = PyObject_VectorcallMethod(name, args, nargs, kw);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int observe(PyObject *histogram, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL) return -1;
    PyObject *args[2] = {histogram, v};
    int rc = call_method(s_observe, args, 2, NULL);
    Py_DECREF(v);
    return rc;
}

static double now_s(void) {
    struct timespec ts; /* CLOCK_MONOTONIC: time.perf_counter's clock on Linux */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *finish(PyObject *const *how, Py_ssize_t n, double seconds, PyObject *keys,
                        PyObject *ctx, PyObject *future, PyObject *ending, PyObject *nbytes) {
    PyObject *manager = how[0], *touch = how[1], *complete = how[2], *kwnames = how[3];
    PyObject *publish = how[4], *durations = how[5], *rates = how[6];
    PyTypeObject *result_type = (PyTypeObject *)how[7];
    PyObject *set_result = how[8], *copies = how[9], *count_name = how[10];
    PyObject *bytes_name = how[11];
    double nbytes_d = PyLong_AsDouble(nbytes);
    if (nbytes_d == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *call[4] = {manager, keys, ctx, Py_True};
    if (touch != Py_None && call_method(touch, call, 3, NULL) < 0) return NULL;
    if (add_to(copies, count_name, s_one) < 0 || set_step(ending, 1) < 0) return NULL;
    /* manager.complete(keys, ctx), or (..., success=True) with kwnames ("success",) */
    if (call_method(complete, call, 3, kwnames == Py_None ? NULL : kwnames) < 0) return NULL;
    if (set_step(ending, 2) < 0) return NULL;
    if (publish != Py_None) {
        PyObject *r = PyObject_CallNoArgs(publish);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    if (add_to(copies, bytes_name, nbytes) < 0 || observe(durations, seconds) < 0) return NULL;
    if (seconds > 0 && observe(rates, nbytes_d / seconds) < 0) return NULL;

    PyObject *result = NULL, *packed = NULL;
    PyObject *fields = Py_BuildValue("(nOd)", n, nbytes, seconds);
    if (fields != NULL) packed = PyTuple_Pack(1, fields);
    /* tuple.__new__(result_type, fields): a NamedTuple without its Python __new__ */
    if (packed != NULL) result = PyTuple_Type.tp_new(result_type, packed, NULL);
    Py_XDECREF(fields);
    Py_XDECREF(packed);
    if (result == NULL) return NULL;
    PyObject *pair[2] = {future, result};
    PyObject *r = PyObject_Vectorcall(set_result, pair, 2, NULL);
    Py_DECREF(result);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_TRUE;
}

static int how_ok(PyObject *how) {
    if (PyTuple_CheckExact(how) && PyTuple_GET_SIZE(how) == 12 &&
        PyType_Check(PyTuple_GET_ITEM(how, 7)) &&
        PyType_IsSubtype((PyTypeObject *)PyTuple_GET_ITEM(how, 7), &PyTuple_Type))
        return 1;
    PyErr_SetString(PyExc_TypeError, "how must be a 12-tuple whose result_type is a tuple type");
    return 0;
}

static PyObject *mod_one_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "one_step(how, fn, tables, direction, kv_ids, host_ids, keys, ctx, "
                        "future, ending, nbytes)");
        return NULL;
    }
    if (!how_ok(args[0])) return NULL;
    double started = now_s();
    PyObject *code = mod_call_blocks(self, args + 1, 5);
    if (code == NULL) { /* nothing was copied: the caller's Python path meets it again */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (code == Py_None || PyLong_AsLong(code) != 0) return code;
    Py_DECREF(code);
    double seconds = now_s() - started;
    return finish(&PyTuple_GET_ITEM(args[0], 0), PySequence_Fast_GET_SIZE(args[4]), seconds,
                  args[6], args[7], args[8], args[9], args[10]);
}

/* finish_step(how, num_blocks, seconds, keys, ctx, future, ending, nbytes): one_step
 * after its copy, for a job that a backend's copy_now has already ended. */
static PyObject *mod_finish_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "finish_step(how, num_blocks, seconds, keys, ctx, future, ending, nbytes)");
        return NULL;
    }
    if (!how_ok(args[0])) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    double seconds = PyFloat_AsDouble(args[2]);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    return finish(&PyTuple_GET_ITEM(args[0], 0), n, seconds, args[3], args[4], args[5], args[6],
                  args[7]);
}

static PyMethodDef mgrcore_functions[] = {
    {"distinct", (PyCFunction)mod_distinct, METH_O,
     "distinct(keys): the list itself when no key repeats, else None."},
    {"call_blocks", (PyCFunction)(void (*)(void))mod_call_blocks, METH_FASTCALL,
     "call_blocks(fn, tables, direction, kv_ids, host_ids): fn's code, or None when the "
     "ids are not two lists (or tuples) of as many ints."},
    {"checked_keys", (PyCFunction)(void (*)(void))mod_checked_keys, METH_FASTCALL,
     "checked_keys(keys, min_len): a list of the keys if all are exact bytes longer than "
     "min_len, else None."},
    {"one_step", (PyCFunction)(void (*)(void))mod_one_step, METH_FASTCALL,
     "one_step(how, fn, tables, direction, kv_ids, host_ids, keys, ctx, future, ending, "
     "nbytes): the engine's one-step small copy; see the source."},
    {"finish_step", (PyCFunction)(void (*)(void))mod_finish_step, METH_FASTCALL,
     "finish_step(how, num_blocks, seconds, keys, ctx, future, ending, nbytes): one_step "
     "for a job already copied."},
    {"ids_ok", (PyCFunction)(void (*)(void))mod_ids_ok, METH_FASTCALL,
     "ids_ok(ids, limit, unique): whether a list of block ids is all exact ints in "
     "[0, limit), distinct when unique."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mgrcore_module = {
    PyModuleDef_HEAD_INIT, "mgrcore", NULL, -1, mgrcore_functions, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_mgrcore(void) {
    PyObject *m = PyModule_Create(&mgrcore_module);
    if (m && mgrcore_exec(m) < 0) Py_CLEAR(m);
    return m;
}
