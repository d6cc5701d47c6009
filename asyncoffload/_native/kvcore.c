/* The KV-aware cache policy's state and hot paths, as a CPython extension.
 *
 * A line-for-line port of asyncoffload/manager/policies/kv.py (the reference: same
 * classes, learning, ghost memory, eviction order and admission). Compiled on first use
 * by asyncoffload._native.load_extension; KVPolicy falls back to its pure-Python path
 * when this cannot be built. Everything runs on the event loop's thread, under the GIL.
 *
 * Blocks live in a node array. A dict maps each known key to its node index. A node is
 * on exactly one doubly linked list: its class queue (resident), the fresh list (first
 * seen by the latest touch, not inserted) or the ghost list (known, not resident).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define USE_BUCKETS 4
#define SIZE_BUCKETS 3
#define TAIL (USE_BUCKETS * SIZE_BUCKETS)
#define NUM_CLASSES (TAIL + SIZE_BUCKETS)
#define AGE_BINS 64
#define SAMPLE_MASK 3
/* the censoring correction's fade (kv.py's FADE, FADE_TICKS, CENSOR_SCALE) */
#define FADE 12.0
#define FADE_TICKS 160
#define CENSOR_SCALE 16777216.0
#define NIL (-1)

/* eviction ties: last-block classes first, then the others by index (fewer uses first) */
static int CLASS_RANK[NUM_CLASSES], RANK_CLASS[NUM_CLASSES];

static void init_ranks(void) {
    for (int k = 0; k < NUM_CLASSES; k++) {
        CLASS_RANK[k] = k < TAIL ? SIZE_BUCKETS + k : k - TAIL;
        RANK_CLASS[CLASS_RANK[k]] = k;
    }
}

enum { ST_FREE = 0, ST_RESIDENT = 1, ST_FRESH = 2, ST_GHOST = 3 };

typedef struct {
    PyObject *key;   /* owned while the node is in use */
    PyObject *block; /* owned while resident */
    int64_t tick;
    int32_t uses;
    int32_t prev, next;
    int16_t cls;
    int8_t state;
    int8_t sampled;
} Node;

typedef struct {
    int32_t head, tail;
    Py_ssize_t len;
} List;

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    Py_ssize_t ghost_cap;
    Py_ssize_t rebuild_every;
    double decay;
    int size_classes, tail_classes, admission;
    Node *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t free_head;
    PyObject *index; /* dict: key -> int node index */
    List queues[NUM_CLASSES];
    List fresh, ghost;
    Py_ssize_t resident;
    int64_t tick;
    Py_ssize_t inserts;
    double last_victim;
    double entered[NUM_CLASSES];
    double reused[NUM_CLASSES * AGE_BINS];
    double table[NUM_CLASSES][AGE_BINS];
    int64_t rebuilds;                 /* rebuilds so far */
    int64_t rebuild_ticks[FADE_TICKS]; /* the ticks of the first FADE_TICKS */
    int n_rebuild_ticks;
    int64_t traffic; /* blocks touched: the fade's clock */
} Core;

static PyObject *s_ref_cnt; /* interned "ref_cnt" */

/* --- lists ------------------------------------------------------------------------ */

static void list_init(List *l) { l->head = l->tail = NIL; l->len = 0; }

static void list_append(Core *c, List *l, int32_t i) {
    Node *n = &c->nodes[i];
    n->prev = l->tail;
    n->next = NIL;
    if (l->tail != NIL) c->nodes[l->tail].next = i; else l->head = i;
    l->tail = i;
    l->len++;
}

static void list_unlink(Core *c, List *l, int32_t i) {
    Node *n = &c->nodes[i];
    if (n->prev != NIL) c->nodes[n->prev].next = n->next; else l->head = n->next;
    if (n->next != NIL) c->nodes[n->next].prev = n->prev; else l->tail = n->prev;
    n->prev = n->next = NIL;
    l->len--;
}

/* --- nodes ------------------------------------------------------------------------ */

static int32_t node_alloc(Core *c) {
    if (c->free_head != NIL) {
        int32_t i = c->free_head;
        c->free_head = c->nodes[i].next;
        return i;
    }
    if (c->n_nodes == c->cap_nodes) {
        int32_t cap = c->cap_nodes ? c->cap_nodes * 2 : 1024;
        Node *nn = PyMem_Realloc(c->nodes, (size_t)cap * sizeof(Node));
        if (!nn) { PyErr_NoMemory(); return NIL; }
        c->nodes = nn;
        c->cap_nodes = cap;
    }
    return c->n_nodes++;
}

static void node_free(Core *c, int32_t i) {
    Node *n = &c->nodes[i];
    Py_CLEAR(n->key);
    Py_CLEAR(n->block);
    n->state = ST_FREE;
    n->next = c->free_head;
    c->free_head = i;
}

/* index lookup: node index or NIL; -2 on error */
static int32_t find(Core *c, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(c->index, key);
    if (v == NULL) return PyErr_Occurred() ? -2 : NIL;
    return (int32_t)PyLong_AsLong(v);
}

/* a new node for key, registered in the index; NIL on error */
static int32_t node_new(Core *c, PyObject *key, int32_t uses, int16_t cls) {
    int32_t i = node_alloc(c);
    if (i == NIL) return NIL;
    PyObject *v = PyLong_FromLong(i);
    if (!v || PyDict_SetItem(c->index, key, v) < 0) {
        Py_XDECREF(v);
        c->nodes[i].key = NULL;
        c->nodes[i].block = NULL;
        c->nodes[i].next = c->free_head;
        c->free_head = i;
        return NIL;
    }
    Py_DECREF(v);
    Node *n = &c->nodes[i];
    Py_INCREF(key);
    n->key = key;
    n->block = NULL;
    n->tick = c->tick;
    n->uses = uses;
    n->cls = cls;
    n->prev = n->next = NIL;
    n->state = ST_FREE;
    Py_ssize_t len = PyBytes_GET_SIZE(key);
    n->sampled = len >= 5 && !(((unsigned char)PyBytes_AS_STRING(key)[len - 5]) & SAMPLE_MASK);
    return i;
}

/* forget a node entirely (remove from the index and free it); -1 on error */
static int node_forget(Core *c, int32_t i) {
    if (PyDict_DelItem(c->index, c->nodes[i].key) < 0) return -1;
    node_free(c, i);
    return 0;
}

static int forget_ghosts(Core *c) {
    while (c->ghost.len > c->ghost_cap) {
        int32_t i = c->ghost.head;
        list_unlink(c, &c->ghost, i);
        if (node_forget(c, i) < 0) return -1;
    }
    return 0;
}

static inline int age_bin(int64_t age) {
    /* Python's age.bit_length() (ages are never negative) */
    return age > 0 ? 64 - __builtin_clzll((unsigned long long)age) : 0;
}

static int size_bucket(Py_ssize_t n) { return n < 16 ? 0 : (n < 64 ? 1 : 2); }

static int check_bytes(PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return 0;
}

/* --- learning --------------------------------------------------------------------- */

/* kv.py's _censored(): per class and age bin, the sampled blocks not reused since they
 * entered their class, weighted decay ** (rebuilds since), summed as exact integers */
static void censored(Core *c, double *out) {
    int64_t sums[NUM_CLASSES * AGE_BINS], weights[FADE_TICKS + 1];
    int n = c->n_rebuild_ticks;
    memset(sums, 0, sizeof sums);
    for (int k = 0; k <= n; k++) weights[k] = (int64_t)(pow(c->decay, (double)k) * CENSOR_SCALE);
    for (int32_t i = 0; i < c->n_nodes; i++) {
        const Node *nd = &c->nodes[i];
        if (nd->state == ST_FREE || !nd->sampled) continue;
        int lo = 0, hi = n; /* bisect_left(ticks, nd->tick) */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (c->rebuild_ticks[mid] < nd->tick) lo = mid + 1; else hi = mid;
        }
        sums[nd->cls * AGE_BINS + age_bin(c->tick - nd->tick)] += weights[n - lo];
    }
    for (int j = 0; j < NUM_CLASSES * AGE_BINS; j++) out[j] = (double)sums[j] / CENSOR_SCALE;
}

static void rebuild(Core *c) {
    double decay = c->decay;
    double cens[NUM_CLASSES * AGE_BINS];
    double fade = 1.0 - (double)c->traffic / (FADE * (double)c->capacity);
    if (fade > 0.0) {
        censored(c, cens);
    } else {
        fade = 0.0;
        memset(cens, 0, sizeof cens);
    }
    if (c->n_rebuild_ticks < FADE_TICKS) c->rebuild_ticks[c->n_rebuild_ticks++] = c->tick;
    c->rebuilds++;
    for (int k = 0; k < NUM_CLASSES; k++) {
        double *reused = &c->reused[k * AGE_BINS];
        double alive = c->entered[k];
        /* Python's sum() adds left to right; keep the same order for equal results */
        double later = 0.0;
        for (int b = 0; b < AGE_BINS; b++) later += reused[b];
        double prev = 1.0;
        for (int b = 0; b < AGE_BINS; b++) {
            double p = alive > 1e-9 ? later / alive : 0.0;
            prev = p < prev ? p : prev;
            c->table[k][b] = prev;
            alive -= reused[b] + fade * cens[k * AGE_BINS + b];
            later -= reused[b];
            reused[b] *= decay;
        }
        c->entered[k] *= decay;
    }
    for (int k = SIZE_BUCKETS; k < TAIL; k++)
        for (int b = 0; b < AGE_BINS; b++) {
            double a = c->table[k][b], lo = c->table[k - SIZE_BUCKETS][b];
            c->table[k][b] = a > lo ? a : lo;
        }
    for (int k = TAIL; k < NUM_CLASSES; k++)
        for (int b = 0; b < AGE_BINS; b++) {
            double a = c->table[k][b], par = c->table[k - TAIL][b];
            c->table[k][b] = a < par ? a : par;
        }
}

/* --- the type --------------------------------------------------------------------- */

static void core_reset(Core *c) {
    for (int32_t i = 0; i < c->n_nodes; i++) {
        Py_CLEAR(c->nodes[i].key);
        Py_CLEAR(c->nodes[i].block);
    }
    c->n_nodes = 0;
    c->free_head = NIL;
    PyDict_Clear(c->index);
    for (int k = 0; k < NUM_CLASSES; k++) list_init(&c->queues[k]);
    list_init(&c->fresh);
    list_init(&c->ghost);
    c->resident = 0;
    c->tick = 0;
    c->inserts = 0;
    c->last_victim = 0.0;
    memset(c->entered, 0, sizeof c->entered);
    memset(c->reused, 0, sizeof c->reused);
    for (int k = 0; k < NUM_CLASSES; k++)
        for (int b = 0; b < AGE_BINS; b++) c->table[k][b] = 1.0;
    c->rebuilds = 0;
    c->n_rebuild_ticks = 0;
    c->traffic = 0;
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", "ghost_cap", "rebuild_every", "decay",
                            "size_classes", "tail_classes", "admission", NULL};
    Py_ssize_t capacity, ghost_cap, rebuild_every;
    double decay;
    int sc, tc, ad;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nnndppp", names, &capacity, &ghost_cap,
                                     &rebuild_every, &decay, &sc, &tc, &ad))
        return -1;
    c->capacity = capacity;
    c->ghost_cap = ghost_cap;
    c->rebuild_every = rebuild_every;
    c->decay = decay;
    c->size_classes = sc;
    c->tail_classes = tc;
    c->admission = ad;
    if (!c->index && !(c->index = PyDict_New())) return -1;
    core_reset(c);
    return 0;
}

static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    if (c->index) core_reset(c);
    Py_CLEAR(c->index);
    PyMem_Free(c->nodes);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->index);
    for (int32_t i = 0; i < c->n_nodes; i++) {
        Py_VISIT(c->nodes[i].key);
        Py_VISIT(c->nodes[i].block);
    }
    return 0;
}

static int Core_clear_gc(Core *c) {
    if (c->index) core_reset(c);
    Py_CLEAR(c->index);
    return 0;
}

static PyObject *Core_clear(Core *c, PyObject *unused) {
    core_reset(c);
    Py_RETURN_NONE;
}

static PyObject *Core_get(Core *c, PyObject *key) {
    int32_t i = find(c, key);
    if (i == -2) return NULL;
    if (i == NIL || c->nodes[i].state != ST_RESIDENT) Py_RETURN_NONE;
    PyObject *b = c->nodes[i].block;
    Py_INCREF(b);
    return b;
}

static PyObject *Core_touch(Core *c, PyObject *keys_arg) {
    PyObject *seq = PySequence_Fast(keys_arg, "touch: keys must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < n; j++)
        if (check_bytes(keys[j]) < 0) goto fail; /* before anything changes */
    c->tick++;
    c->traffic += n;
    int64_t tick = c->tick;
    /* keys first seen by the last touch and never stored become ghosts */
    while (c->fresh.len) {
        int32_t i = c->fresh.head;
        list_unlink(c, &c->fresh, i);
        c->nodes[i].state = ST_GHOST;
        list_append(c, &c->ghost, i);
    }
    int size = c->size_classes ? size_bucket(n) : 0;
    int top = TAIL - SIZE_BUCKETS + size;
    int first = c->tail_classes ? TAIL + size : size;
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        PyObject *key = keys[j];
        int32_t i = find(c, key);
        if (i == -2) goto fail;
        if (i == NIL) {
            i = node_new(c, key, 1, (int16_t)first);
            if (i == NIL) goto fail;
            Node *nd = &c->nodes[i];
            nd->tick = tick;
            nd->state = ST_FRESH;
            list_append(c, &c->fresh, i);
            if (nd->sampled) c->entered[first] += 1;
            first = size;
            continue;
        }
        first = size;
        Node *nd = &c->nodes[i];
        int64_t last = nd->tick;
        if (last == tick) continue;
        int old = nd->cls, cls;
        if (nd->uses < USE_BUCKETS) {
            cls = nd->uses * SIZE_BUCKETS + size;
            nd->uses++;
        } else {
            cls = top;
        }
        nd->tick = tick;
        if (nd->sampled) {
            c->reused[old * AGE_BINS + age_bin(tick - last)] += 1;
            c->entered[cls] += 1;
        }
        if (nd->state == ST_RESIDENT) {
            list_unlink(c, &c->queues[old], i);
            nd->cls = (int16_t)cls;
            list_append(c, &c->queues[cls], i);
        } else if (nd->state == ST_GHOST) {
            nd->cls = (int16_t)cls;
            list_unlink(c, &c->ghost, i);
            list_append(c, &c->ghost, i);
        } else { /* fresh (seen twice in one touch cannot happen: same tick) */
            nd->cls = (int16_t)cls;
        }
    }
    Py_DECREF(seq);
    if (forget_ghosts(c) < 0) return NULL;
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Core_insert_many(Core *c, PyObject *items_arg) {
    PyObject *seq = PySequence_Fast(items_arg, "insert_many: items must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < n; j++) { /* check everything before changing anything */
        PyObject *item = items[j];
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "insert_many: items are (key, block) pairs");
            goto fail;
        }
        if (check_bytes(PyTuple_GET_ITEM(item, 0)) < 0) goto fail;
        int32_t i = find(c, PyTuple_GET_ITEM(item, 0));
        if (i == -2) goto fail;
        if (i != NIL && c->nodes[i].state == ST_RESIDENT) {
            PyErr_SetString(PyExc_ValueError, "insert_many: key is already resident");
            goto fail;
        }
    }
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        PyObject *item = items[j];
        PyObject *key = PyTuple_GET_ITEM(item, 0), *block = PyTuple_GET_ITEM(item, 1);
        int32_t i = find(c, key);
        if (i == -2) goto fail;
        if (i == NIL) {
            i = node_new(c, key, 1, 0);
            if (i == NIL) goto fail;
            if (c->nodes[i].sampled) c->entered[0] += 1;
        } else {
            Node *nd = &c->nodes[i];
            if (nd->state == ST_FRESH) list_unlink(c, &c->fresh, i);
            else list_unlink(c, &c->ghost, i);
        }
        Node *nd = &c->nodes[i];
        Py_INCREF(block);
        nd->block = block;
        nd->tick = c->tick; /* a store is a use: age counts from it */
        nd->state = ST_RESIDENT;
        list_append(c, &c->queues[nd->cls], i);
        c->resident++;
    }
    Py_DECREF(seq);
    c->inserts += n;
    if (c->inserts >= c->rebuild_every) {
        c->inserts = 0;
        rebuild(c);
    }
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Core_remove(Core *c, PyObject *key) {
    int32_t i = find(c, key);
    if (i == -2) return NULL;
    if (i == NIL || c->nodes[i].state != ST_RESIDENT) Py_RETURN_NONE;
    list_unlink(c, &c->queues[c->nodes[i].cls], i);
    c->resident--;
    if (node_forget(c, i) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_admissible(Core *c, PyObject *args) {
    PyObject *keys_arg;
    int full;
    if (!PyArg_ParseTuple(args, "Op", &keys_arg, &full)) return NULL;
    if (!full || c->resident == 0 || !c->admission) {
        Py_INCREF(keys_arg);
        return keys_arg;
    }
    PyObject *seq = PySequence_Fast(keys_arg, "admissible: keys must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (!out) goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t i = find(c, keys[j]);
        if (i == -2) goto fail;
        int keep = i == NIL || c->nodes[i].uses > 1 ||
                   c->table[c->nodes[i].cls][0] >= c->last_victim;
        if (keep && PyList_Append(out, keys[j]) < 0) goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* 1 evictable, 0 not, -1 error */
static int evictable(Core *c, int32_t i, PyObject *protected_, int is_set) {
    PyObject *rc = PyObject_GetAttr(c->nodes[i].block, s_ref_cnt);
    if (!rc) return -1;
    long r = PyLong_AsLong(rc);
    Py_DECREF(rc);
    if (r == -1 && PyErr_Occurred()) return -1;
    if (r != 0) return 0;
    int in = is_set ? PySet_Contains(protected_, c->nodes[i].key)
                    : PySequence_Contains(protected_, c->nodes[i].key);
    if (in < 0) return -1;
    return !in;
}

/* the next evictable node of a class queue at or after i, NIL if none; -2 on error */
static int32_t next_evictable(Core *c, int32_t i, PyObject *protected_, int is_set) {
    while (i != NIL) {
        int e = evictable(c, i, protected_, is_set);
        if (e < 0) return -2;
        if (e) return i;
        i = c->nodes[i].next;
    }
    return NIL;
}

typedef struct { double v; int c; } Head; /* c: the class's rank */

static void heap_push(Head *h, int *n, Head x) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (h[p].v < x.v || (h[p].v == x.v && h[p].c < x.c)) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static Head heap_pop(Head *h, int *n) {
    Head top = h[0], x = h[--(*n)];
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        Head best = x;
        if (l < *n && (h[l].v < best.v || (h[l].v == best.v && h[l].c < best.c))) { m = l; best = h[l]; }
        if (r < *n && (h[r].v < best.v || (h[r].v == best.v && h[r].c < best.c))) { m = r; best = h[r]; }
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = x;
    return top;
}

static PyObject *Core_evict(Core *c, PyObject *args) {
    Py_ssize_t want;
    PyObject *protected_;
    if (!PyArg_ParseTuple(args, "nO", &want, &protected_)) return NULL;
    if (want <= 0) return PyList_New(0);
    if (want > c->resident) Py_RETURN_NONE;
    int is_set = PyAnySet_Check(protected_);
    int64_t tick = c->tick;
    Head heap[NUM_CLASSES];
    int nh = 0;
    int32_t pointed[NUM_CLASSES];
    for (int k = 0; k < NUM_CLASSES; k++) {
        pointed[k] = NIL;
        int32_t i = next_evictable(c, c->queues[k].head, protected_, is_set);
        if (i == -2) return NULL;
        if (i != NIL) {
            pointed[k] = i;
            Head h = {c->table[k][age_bin(tick - c->nodes[i].tick)], CLASS_RANK[k]};
            heap_push(heap, &nh, h);
        }
    }
    int32_t *victims = PyMem_Malloc((size_t)want * sizeof(int32_t));
    if (!victims) return PyErr_NoMemory();
    Py_ssize_t got = 0;
    double value = 0.0;
    while (got < want) {
        if (!nh) {
            PyMem_Free(victims);
            Py_RETURN_NONE;
        }
        Head h = heap_pop(heap, &nh);
        int rank = h.c, k = RANK_CLASS[rank];
        value = h.v;
        double bar = nh ? heap[0].v : 3.0;
        int bar_rank = nh ? heap[0].c : NUM_CLASSES;
        victims[got++] = pointed[k];
        int32_t i = c->nodes[pointed[k]].next;
        pointed[k] = NIL;
        for (;;) {
            i = next_evictable(c, i, protected_, is_set);
            if (i == -2) { PyMem_Free(victims); return NULL; }
            if (i == NIL) break;
            double v = c->table[k][age_bin(tick - c->nodes[i].tick)];
            if (got < want && (v < bar || (v == bar && rank < bar_rank))) {
                victims[got++] = i;
                value = v;
                i = c->nodes[i].next;
                continue;
            }
            pointed[k] = i;
            Head nhd = {v, rank};
            heap_push(heap, &nh, nhd);
            break;
        }
    }
    c->last_victim = value;
    PyObject *out = PyList_New(want);
    if (!out) { PyMem_Free(victims); return NULL; }
    for (Py_ssize_t j = 0; j < want; j++) {
        int32_t i = victims[j];
        Node *nd = &c->nodes[i];
        PyObject *pair = PyTuple_Pack(2, nd->key, nd->block);
        if (!pair) { PyMem_Free(victims); Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, j, pair);
    }
    for (Py_ssize_t j = 0; j < want; j++) {
        int32_t i = victims[j];
        Node *nd = &c->nodes[i];
        list_unlink(c, &c->queues[nd->cls], i);
        Py_CLEAR(nd->block);
        nd->state = ST_GHOST;
        list_append(c, &c->ghost, i);
    }
    c->resident -= want;
    PyMem_Free(victims);
    if (forget_ghosts(c) < 0) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *Core_items(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int k = 0; k < NUM_CLASSES; k++)
        for (int32_t i = c->queues[k].head; i != NIL; i = c->nodes[i].next) {
            PyObject *pair = PyTuple_Pack(2, c->nodes[i].key, c->nodes[i].block);
            if (!pair || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); Py_DECREF(out); return NULL; }
            Py_DECREF(pair);
        }
    return out;
}

/* (uses, tick, class, state) of a known key, or None */
static PyObject *Core_meta(Core *c, PyObject *key) {
    int32_t i = find(c, key);
    if (i == -2) return NULL;
    if (i == NIL) Py_RETURN_NONE;
    Node *nd = &c->nodes[i];
    return Py_BuildValue("iLii", (int)nd->uses, (long long)nd->tick, (int)nd->cls, (int)nd->state);
}

static PyObject *Core_table(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(NUM_CLASSES);
    if (!out) return NULL;
    for (int k = 0; k < NUM_CLASSES; k++) {
        PyObject *row = PyList_New(AGE_BINS);
        if (!row) { Py_DECREF(out); return NULL; }
        for (int b = 0; b < AGE_BINS; b++) {
            PyObject *f = PyFloat_FromDouble(c->table[k][b]);
            if (!f) { Py_DECREF(row); Py_DECREF(out); return NULL; }
            PyList_SET_ITEM(row, b, f);
        }
        PyList_SET_ITEM(out, k, row);
    }
    return out;
}

static PyObject *Core_state(Core *c, PyObject *unused) {
    /* counters for inspection: (tick, inserts, last_victim, resident, ghosts, fresh) */
    return Py_BuildValue("LndnnN", (long long)c->tick, c->inserts, c->last_victim, c->resident,
                         c->ghost.len, PyLong_FromSsize_t(c->fresh.len));
}

static PyObject *list_snapshot(Core *c, List *l) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int32_t i = l->head; i != NIL; i = c->nodes[i].next) {
        Node *nd = &c->nodes[i];
        PyObject *t = Py_BuildValue("(OiLi)", nd->key, (int)nd->uses, (long long)nd->tick,
                                    (int)nd->cls);
        if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); Py_DECREF(out); return NULL; }
        Py_DECREF(t);
    }
    return out;
}

static PyObject *doubles(const double *v, int n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *f = PyFloat_FromDouble(v[i]);
        if (!f) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, f);
    }
    return out;
}

/* everything the policy holds, in the layout of KVPolicy.snapshot() */
static PyObject *Core_snapshot(Core *c, PyObject *unused) {
    PyObject *queues = PyList_New(NUM_CLASSES);
    if (!queues) return NULL;
    for (int k = 0; k < NUM_CLASSES; k++) {
        PyObject *q = list_snapshot(c, &c->queues[k]);
        if (!q) { Py_DECREF(queues); return NULL; }
        PyList_SET_ITEM(queues, k, q);
    }
    PyObject *ticks = PyList_New(c->n_rebuild_ticks);
    if (!ticks) { Py_DECREF(queues); return NULL; }
    for (int j = 0; j < c->n_rebuild_ticks; j++) {
        PyObject *t = PyLong_FromLongLong(c->rebuild_ticks[j]);
        if (!t) { Py_DECREF(queues); Py_DECREF(ticks); return NULL; }
        PyList_SET_ITEM(ticks, j, t);
    }
    return Py_BuildValue("{s:N,s:N,s:N,s:L,s:n,s:d,s:N,s:N,s:N,s:L,s:N,s:L}",
                         "queues", queues,
                         "fresh", list_snapshot(c, &c->fresh),
                         "ghost", list_snapshot(c, &c->ghost),
                         "tick", (long long)c->tick,
                         "inserts", c->inserts,
                         "last_victim", c->last_victim,
                         "entered", doubles(c->entered, NUM_CLASSES),
                         "reused", doubles(c->reused, NUM_CLASSES * AGE_BINS),
                         "table", Core_table(c, NULL),
                         "rebuilds", (long long)c->rebuilds,
                         "rebuild_ticks", ticks,
                         "traffic", (long long)c->traffic);
}

/* rebuilds and their ticks (the first min(rebuilds, FADE_TICKS), in order, each in
 * [0, tick]) into c; -1 on error, c unchanged */
static int read_fade(Core *c, long long rebuilds, PyObject *arg, int64_t tick) {
    PyObject *seq = PySequence_Fast(arg, "restore: rebuild_ticks must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t ticks[FADE_TICKS];
    if (rebuilds < 0 || n != (rebuilds < FADE_TICKS ? rebuilds : FADE_TICKS)) {
        PyErr_Format(PyExc_ValueError,
                     "restore: rebuild_ticks must hold the first min(rebuilds, %d) rebuilds' "
                     "ticks, got %zd for %lld rebuilds", FADE_TICKS, n, rebuilds);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long t = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, j));
        if (t == -1 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        if (t < 0 || t > tick || (j && t < ticks[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "restore: rebuild_ticks must be in order, each in [0, tick]");
            Py_DECREF(seq);
            return -1;
        }
        ticks[j] = t;
    }
    Py_DECREF(seq);
    c->rebuilds = rebuilds;
    c->n_rebuild_ticks = (int)n;
    memcpy(c->rebuild_ticks, ticks, (size_t)n * sizeof ticks[0]);
    return 0;
}

/* n doubles from a sequence of numbers into out; -1 on error */
static int read_doubles(PyObject *arg, double *out, Py_ssize_t n, const char *what) {
    PyObject *seq = PySequence_Fast(arg, what);
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "restore: %s must have %zd values", what, n);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        out[j] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, j));
        if (out[j] == -1.0 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
    }
    Py_DECREF(seq);
    return 0;
}

/* append the rows of one list: (key, block, uses, tick, class) resident, (key, uses, tick,
 * class) ghost; -1 on error */
static int restore_rows(Core *c, PyObject *arg, int resident) {
    PyObject *seq = PySequence_Fast(arg, "restore: rows must be a sequence");
    if (!seq) return -1;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq); j++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, j), *key, *block = NULL;
        int uses, cls;
        long long tick;
        int ok = resident ? PyArg_ParseTuple(row, "OOiLi", &key, &block, &uses, &tick, &cls)
                          : PyArg_ParseTuple(row, "OiLi", &key, &uses, &tick, &cls);
        if (!ok || check_bytes(key) < 0) goto fail;
        if (uses < 1 || cls < 0 || cls >= NUM_CLASSES || tick < 0 || tick > c->tick) {
            PyErr_SetString(PyExc_ValueError, "restore: a row's uses, tick or class is out of range");
            goto fail;
        }
        int32_t i = find(c, key);
        if (i == -2) goto fail;
        if (i != NIL) {
            PyErr_SetString(PyExc_ValueError, "restore: a key is listed twice");
            goto fail;
        }
        i = node_new(c, key, uses, (int16_t)cls);
        if (i == NIL) goto fail;
        Node *nd = &c->nodes[i];
        nd->tick = tick;
        if (resident) {
            Py_INCREF(block);
            nd->block = block;
            nd->state = ST_RESIDENT;
            list_append(c, &c->queues[cls], i);
            c->resident++;
        } else {
            nd->state = ST_GHOST;
            list_append(c, &c->ghost, i);
        }
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* restore(tick, inserts, last_victim, entered, reused, table, resident, ghost, rebuilds,
 * rebuild_ticks, traffic): start again from what another kv learned (KVPolicy.adopt builds the
 * rows, each list in order of last use) */
static PyObject *Core_restore(Core *c, PyObject *args) {
    long long tick, rebuilds, traffic;
    Py_ssize_t inserts;
    double last_victim;
    PyObject *entered, *reused, *table, *resident, *ghost, *rticks;
    if (!PyArg_ParseTuple(args, "LndOOOOOLOL", &tick, &inserts, &last_victim, &entered, &reused,
                          &table, &resident, &ghost, &rebuilds, &rticks, &traffic))
        return NULL;
    if (tick < 0 || inserts < 0 || traffic < 0) {
        PyErr_SetString(PyExc_ValueError, "restore: tick, inserts and traffic must be >= 0");
        return NULL;
    }
    core_reset(c);
    c->tick = tick;
    c->inserts = inserts;
    c->last_victim = last_victim;
    if (read_fade(c, rebuilds, rticks, tick) < 0) goto fail;
    c->traffic = traffic;
    if (read_doubles(entered, c->entered, NUM_CLASSES, "entered") < 0) goto fail;
    if (read_doubles(reused, c->reused, NUM_CLASSES * AGE_BINS, "reused") < 0) goto fail;
    PyObject *rows = PySequence_Fast(table, "restore: table must be a sequence");
    if (!rows) goto fail;
    if (PySequence_Fast_GET_SIZE(rows) != NUM_CLASSES) {
        PyErr_SetString(PyExc_ValueError, "restore: table must have a row per class");
        Py_DECREF(rows);
        goto fail;
    }
    for (int k = 0; k < NUM_CLASSES; k++)
        if (read_doubles(PySequence_Fast_GET_ITEM(rows, k), c->table[k], AGE_BINS, "table row") < 0) {
            Py_DECREF(rows);
            goto fail;
        }
    Py_DECREF(rows);
    if (restore_rows(c, resident, 1) < 0 || restore_rows(c, ghost, 0) < 0) goto fail;
    if (forget_ghosts(c) < 0) goto fail;
    Py_RETURN_NONE;
fail:
    core_reset(c);
    return NULL;
}

static Py_ssize_t Core_len(Core *c) { return c->resident; }

static PyMethodDef Core_methods[] = {
    {"clear", (PyCFunction)Core_clear, METH_NOARGS, NULL},
    {"get", (PyCFunction)Core_get, METH_O, NULL},
    {"touch", (PyCFunction)Core_touch, METH_O, NULL},
    {"insert_many", (PyCFunction)Core_insert_many, METH_O, NULL},
    {"remove", (PyCFunction)Core_remove, METH_O, NULL},
    {"admissible", (PyCFunction)Core_admissible, METH_VARARGS, NULL},
    {"evict", (PyCFunction)Core_evict, METH_VARARGS, NULL},
    {"items", (PyCFunction)Core_items, METH_NOARGS, NULL},
    {"meta", (PyCFunction)Core_meta, METH_O, NULL},
    {"table", (PyCFunction)Core_table, METH_NOARGS, NULL},
    {"state", (PyCFunction)Core_state, METH_NOARGS, NULL},
    {"snapshot", (PyCFunction)Core_snapshot, METH_NOARGS, NULL},
    {"restore", (PyCFunction)Core_restore, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Core_as_sequence = {.sq_length = (lenfunc)Core_len};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear_gc,
    .tp_methods = Core_methods,
    .tp_as_sequence = &Core_as_sequence,
};

static struct PyModuleDef kvcore_module = {PyModuleDef_HEAD_INIT, "kvcore", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_kvcore(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    init_ranks();
    s_ref_cnt = PyUnicode_InternFromString("ref_cnt");
    if (!s_ref_cnt) return NULL;
    PyObject *m = PyModule_Create(&kvcore_module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "NUM_CLASSES", NUM_CLASSES);
    PyModule_AddIntConstant(m, "AGE_BINS", AGE_BINS);
    return m;
}
