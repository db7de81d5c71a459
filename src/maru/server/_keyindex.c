/* maru.server._keyindex: the server's key index, key -> KeyEntry in insertion order.
 *
 * Why not an OrderedDict: at 10^6 registered keys a 128-key lookup misses the cache about
 * four times per key (the dict's index, its entry, the stored key, the value), and a Python
 * loop of dict probes waits for each miss before starting the next. The batch calls
 * (`get_many`, `add_entries`, `lookup_columns`) probe a batch in stages instead and
 * prefetch what the next stage reads for every key of a window, so the misses of different
 * keys overlap.
 *
 * The layout is that of CPython's compact dict: `entries` in insertion order (a deleted entry
 * keeps its place with key NULL until the next rebuild) and `slots`, an open-addressing table
 * (linear probing, at most half full) of indexes into `entries`. `move_to_end` appends the
 * entry again, so the index order is the order of eviction (oldest first). Keys are exact str
 * or bytes only: comparing them runs no Python code, so nothing can change the table during a
 * probe. Values are KeyEntry only, which reference nothing: the index cannot be part of a
 * reference cycle, so the cyclic GC neither tracks nor scans it. Keys are added only by
 * `add_entries` (the first writer wins). Iterators raise RuntimeError if a key is added,
 * removed or moved under them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "../common/crc32.h"

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p))
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PREFETCH(p) ((void)(p))
#define ALWAYS_INLINE inline
#endif

#define EMPTY (-1)
#define DUMMY (-2)
#define WINDOW 32            /* keys whose misses overlap in one batch stage */
#define MAX_CAPACITY ((Py_ssize_t)1 << 29) /* slots are int32 and at least 2x capacity */

typedef struct {
    Py_hash_t hash;
    PyObject *key; /* NULL: deleted (or moved to the end) */
    PyObject *value;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    Py_ssize_t used;     /* entries[0:used] were filled, deleted ones included */
    Py_ssize_t capacity; /* entries allocated */
    Py_ssize_t live;     /* keys present */
    Py_ssize_t head;     /* no live entry before this one: iteration and eviction start here */
    int32_t *slots;      /* index into entries, EMPTY or DUMMY; mask + 1 of them */
    size_t mask;
    uint64_t version; /* bumped by every insertion, deletion and move */
} KeyIndex;

static PyTypeObject KeyIndexType;
static PyTypeObject KeyIndexIterType;

/* -- KeyEntry: what the registry knows of one key -------------------------------------------
 * A C struct rather than a Python object with __slots__: no attribute dictionary, no GC header
 * (it references nothing, so the cyclic GC never scans the 10^6 of them), and the batch calls
 * below read and update it without a Python attribute access per key. */
typedef struct {
    PyObject_HEAD
    long long region_id; /* where the bytes are: fixed once registered */
    long long offset;
    long long length;
    long long checksum; /* the writer's checksum of the bytes (0: stored without one) */
    Py_ssize_t pins;   /* pinned keys are neither deleted nor evicted */
    Py_ssize_t leases; /* readers copying these bytes right now: likewise */
    char referenced;   /* CLOCK bit: set by a lookup or exists hit, cleared by eviction */
} KeyEntry;

static PyTypeObject KeyEntryType;

static PyObject *KeyEntry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"region_id", "offset", "length", "checksum", NULL};
    long long region_id, offset, length, checksum = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLL|L:KeyEntry", kwlist, &region_id, &offset,
                                     &length, &checksum))
        return NULL;
    KeyEntry *self = (KeyEntry *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->region_id = region_id;
    self->offset = offset;
    self->length = length;
    self->checksum = checksum;
    return (PyObject *)self;
}

static PyObject *KeyEntry_busy(KeyEntry *self, void *closure)
{
    return PyBool_FromLong(self->pins > 0 || self->leases > 0);
}

static PyObject *KeyEntry_repr(KeyEntry *self)
{
    return PyUnicode_FromFormat("KeyEntry(region_id=%lld, offset=%lld, length=%lld, pins=%zd, "
                                "leases=%zd, referenced=%s)",
                                self->region_id, self->offset, self->length, self->pins,
                                self->leases, self->referenced ? "True" : "False");
}

static PyMemberDef KeyEntry_members[] = {
    {"region_id", T_LONGLONG, offsetof(KeyEntry, region_id), READONLY, NULL},
    {"offset", T_LONGLONG, offsetof(KeyEntry, offset), READONLY, NULL},
    {"length", T_LONGLONG, offsetof(KeyEntry, length), READONLY, NULL},
    {"checksum", T_LONGLONG, offsetof(KeyEntry, checksum), READONLY, NULL},
    {"pins", T_PYSSIZET, offsetof(KeyEntry, pins), 0, NULL},
    {"leases", T_PYSSIZET, offsetof(KeyEntry, leases), 0, NULL},
    {"referenced", T_BOOL, offsetof(KeyEntry, referenced), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef KeyEntry_getset[] = {
    {"busy", (getter)KeyEntry_busy, NULL, "pinned or leased: not deletable or evictable", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject KeyEntryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.server._keyindex.KeyEntry",
    .tp_doc = "KeyEntry(region_id, offset, length, checksum=0): a registered key's location,\n"
              "its writer's checksum (0: none) and its state.",
    .tp_basicsize = sizeof(KeyEntry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyEntry_new,
    .tp_repr = (reprfunc)KeyEntry_repr,
    .tp_members = KeyEntry_members,
    .tp_getset = KeyEntry_getset,
};

static inline int keys_equal(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    if (Py_TYPE(a) != Py_TYPE(b))
        return 0;
    if (PyUnicode_CheckExact(a)) {
        /* CPython stores a str in the narrowest kind that holds it: equal strings have equal
         * kinds and identical bytes. */
        Py_ssize_t n = PyUnicode_GET_LENGTH(a);
        int kind = PyUnicode_KIND(a);
        return n == PyUnicode_GET_LENGTH(b) && kind == (int)PyUnicode_KIND(b) &&
               memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * kind) == 0;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

/* The entry holding `key` (or -1), and in *slot_out the slot that points at it, or (absent)
 * the slot an insertion should use: the first DUMMY on the probe path, else its EMPTY end. */
static Py_ssize_t find(const KeyIndex *self, PyObject *key, Py_hash_t hash, size_t *slot_out)
{
    size_t mask = self->mask, i = (size_t)hash & mask, free_slot = (size_t)-1;
    for (;;) {
        int32_t ix = self->slots[i];
        if (ix == EMPTY) {
            *slot_out = free_slot != (size_t)-1 ? free_slot : i;
            return -1;
        }
        if (ix == DUMMY) {
            if (free_slot == (size_t)-1)
                free_slot = i;
        }
        else {
            const Entry *e = &self->entries[ix];
            if (e->hash == hash && keys_equal(e->key, key)) {
                *slot_out = i;
                return ix;
            }
        }
        i = (i + 1) & mask;
    }
}

/* The two tables are allocated here: at 10^6 keys they span ~64 MiB, which in 4 KiB pages
 * costs a TLB miss (a page walk, nested under a VM) on most probes. From 2 MiB up they are
 * mapped on their own and offered transparent huge pages (MADV_HUGEPAGE: THP is often
 * "madvise" only); the kernel falls back to small pages when it has no huge ones. */
#define HUGE_BYTES ((size_t)2 << 20)

static void *table_alloc(size_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        (void)madvise(p, bytes, MADV_HUGEPAGE); /* a hint: fine if refused */
        return p;
    }
#endif
    return PyMem_Malloc(bytes);
}

static void table_free(void *p, size_t bytes)
{
    if (p == NULL)
        return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES) {
        munmap(p, bytes);
        return;
    }
#endif
    PyMem_Free(p);
}

/* Reallocate for `live` keys plus room to grow: copy the live entries in order to the front
 * of a new array and index them afresh (dropping DUMMY slots). */
static int rebuild(KeyIndex *self)
{
    Py_ssize_t capacity = self->live * 2 > 8 ? self->live * 2 : 8;
    if (capacity > MAX_CAPACITY) {
        PyErr_SetString(PyExc_OverflowError, "KeyIndex: too many keys");
        return -1;
    }
    size_t nslots = 16;
    while (nslots < (size_t)capacity * 2)
        nslots <<= 1;
    Entry *entries = table_alloc(sizeof(Entry) * (size_t)capacity);
    int32_t *slots = table_alloc(sizeof(int32_t) * nslots);
    if (entries == NULL || slots == NULL) {
        table_free(entries, sizeof(Entry) * (size_t)capacity);
        table_free(slots, sizeof(int32_t) * nslots);
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xff, sizeof(int32_t) * nslots); /* all EMPTY (-1) */
    size_t mask = nslots - 1;
    Py_ssize_t n = 0;
    for (Py_ssize_t j = self->head; j < self->used; j++) {
        if (self->entries[j].key == NULL)
            continue;
        entries[n] = self->entries[j];
        size_t i = (size_t)entries[n].hash & mask;
        while (slots[i] != EMPTY)
            i = (i + 1) & mask;
        slots[i] = (int32_t)n;
        n++;
    }
    table_free(self->entries, sizeof(Entry) * (size_t)self->capacity);
    table_free(self->slots, self->slots ? sizeof(int32_t) * (self->mask + 1) : 0);
    self->entries = entries;
    self->slots = slots;
    self->mask = mask;
    self->capacity = capacity;
    self->used = n;
    self->head = 0;
    self->version++;
    return 0;
}

/* Append (key, value) at a free slot found by `find`; steals nothing (new references). */
static int insert_new(KeyIndex *self, PyObject *key, Py_hash_t hash, PyObject *value, size_t slot)
{
    if (self->used == self->capacity) {
        if (rebuild(self) < 0)
            return -1;
        (void)find(self, key, hash, &slot);
    }
    Entry *e = &self->entries[self->used];
    e->hash = hash;
    Py_INCREF(key);
    e->key = key;
    Py_INCREF(value);
    e->value = value;
    self->slots[slot] = (int32_t)self->used;
    self->used++;
    self->live++;
    self->version++;
    return 0;
}

static void skip_deleted_head(KeyIndex *self)
{
    while (self->head < self->used && self->entries[self->head].key == NULL)
        self->head++;
}

/* The hash of a key the index can hold; -1 without an error set for any other object. */
static inline Py_hash_t key_hash(PyObject *key)
{
    if (!PyUnicode_CheckExact(key) && !PyBytes_CheckExact(key))
        return -1;
    return PyObject_Hash(key); /* str and bytes: cannot fail, never -1 */
}

/* The entry of `key` (and its slot), or -1: also for an object that cannot be a key. */
static Py_ssize_t find_any(const KeyIndex *self, PyObject *key, size_t *slot)
{
    Py_hash_t hash = key_hash(key);
    return hash == -1 ? -1 : find(self, key, hash, slot);
}

/* `find_any`, with KeyError set when the key is absent. */
static Py_ssize_t find_or_raise(const KeyIndex *self, PyObject *key, size_t *slot)
{
    Py_ssize_t ix = find_any(self, key, slot);
    if (ix < 0)
        PyErr_SetObject(PyExc_KeyError, key);
    return ix;
}

/* Stage the probes of keys[0:n] (n <= WINDOW): prefetch every key's first slot, then the
 * entries those slots name, then the stored keys and values whose hashes match, so that the
 * probes that follow find their lines in the cache. A hint only: `find` decides. */
static void prefetch_window(const KeyIndex *self, PyObject *const *keys, Py_hash_t *hashes,
                            Py_ssize_t n)
{
    int32_t first[WINDOW];
    size_t mask = self->mask;
    for (Py_ssize_t i = 0; i < n; i++) {
        hashes[i] = key_hash(keys[i]);
        if (hashes[i] != -1)
            PREFETCH(&self->slots[(size_t)hashes[i] & mask]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        first[i] = hashes[i] != -1 ? self->slots[(size_t)hashes[i] & mask] : EMPTY;
        if (first[i] >= 0)
            PREFETCH(&self->entries[first[i]]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (first[i] < 0)
            continue;
        const Entry *e = &self->entries[first[i]];
        if (e->hash == hashes[i] && e->key != NULL) {
            PREFETCH(e->key); /* a str's header, then its first 80-odd bytes */
            PREFETCH((const char *)e->key + 64);
            PREFETCH((const char *)e->key + 128);
            PREFETCH(e->value);
            PREFETCH((const char *)e->value + 48);
        }
    }
}

/* The entries of keys[0:m] (m <= WINDOW) in ix[0:m], -1 for a miss (or an object that cannot
 * be a key), probed with `prefetch_window`. */
static void probe_window(const KeyIndex *self, PyObject *const *keys, Py_ssize_t m,
                         Py_ssize_t *ix)
{
    Py_hash_t hashes[WINDOW];
    size_t slot;
    prefetch_window(self, keys, hashes, m);
    for (Py_ssize_t i = 0; i < m; i++)
        ix[i] = hashes[i] == -1 ? -1 : find(self, keys[i], hashes[i], &slot);
}

/* -- the type ------------------------------------------------------------------------------ */

static PyObject *KeyIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyIndex() takes no arguments");
        return NULL;
    }
    KeyIndex *self = (KeyIndex *)type->tp_alloc(type, 0);
    if (self != NULL && rebuild(self) < 0)
        Py_CLEAR(self);
    return (PyObject *)self;
}

static void KeyIndex_dealloc(KeyIndex *self)
{
    for (Py_ssize_t j = 0; j < self->used; j++) {
        Py_XDECREF(self->entries[j].key);
        Py_XDECREF(self->entries[j].value);
    }
    table_free(self->entries, sizeof(Entry) * (size_t)self->capacity);
    table_free(self->slots, self->slots ? sizeof(int32_t) * (self->mask + 1) : 0);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t KeyIndex_len(KeyIndex *self)
{
    return self->live;
}

static int KeyIndex_contains(KeyIndex *self, PyObject *key)
{
    size_t slot;
    return find_any(self, key, &slot) >= 0;
}

static PyObject *KeyIndex_subscript(KeyIndex *self, PyObject *key)
{
    size_t slot;
    Py_ssize_t ix = find_or_raise(self, key, &slot);
    if (ix < 0)
        return NULL;
    return Py_NewRef(self->entries[ix].value);
}

/* Take out entry `ix`, found at `slot`. */
static void delete_at(KeyIndex *self, Py_ssize_t ix, size_t slot)
{
    Entry *e = &self->entries[ix];
    PyObject *old_key = e->key, *old_value = e->value;
    e->key = e->value = NULL;
    self->slots[slot] = DUMMY;
    self->live--;
    self->version++;
    if (ix == self->head)
        skip_deleted_head(self);
    if (self->live == 0) { /* start over at the front */
        self->used = self->head = 0;
        memset(self->slots, 0xff, sizeof(int32_t) * (self->mask + 1));
    }
    Py_DECREF(old_key);
    Py_DECREF(old_value);
}

/* `del index[key]`; `index[key] = value` is refused: keys are added by add_entries. */
static int KeyIndex_ass_subscript(KeyIndex *self, PyObject *key, PyObject *value)
{
    if (value != NULL) {
        PyErr_SetString(PyExc_TypeError, "KeyIndex: keys are added with add_entries");
        return -1;
    }
    size_t slot;
    Py_ssize_t ix = find_or_raise(self, key, &slot);
    if (ix < 0)
        return -1;
    delete_at(self, ix, slot);
    return 0;
}

/* `for key in keys: del index[key]` in one call, each window's probes prefetched (an eviction
 * drops a write's worth of keys: 256 Python steps were a tenth of the index's work there). A
 * key absent (or named twice) raises KeyError there, the keys before it taken out, as the loop
 * would. */
static PyObject *KeyIndex_remove_many(KeyIndex *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "remove_many: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *keys = PySequence_Fast_ITEMS(seq);
    Py_hash_t hashes[WINDOW];
    for (Py_ssize_t start = 0; start < n; start += WINDOW) {
        Py_ssize_t m = n - start < WINDOW ? n - start : WINDOW;
        prefetch_window(self, keys + start, hashes, m);
        for (Py_ssize_t i = 0; i < m; i++) {
            size_t slot;
            PyObject *key = keys[start + i];
            Py_ssize_t ix = hashes[i] == -1 ? -1 : find(self, key, hashes[i], &slot);
            if (ix < 0) {
                PyErr_SetObject(PyExc_KeyError, key);
                Py_DECREF(seq);
                return NULL;
            }
            delete_at(self, ix, slot);
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *KeyIndex_get(KeyIndex *self, PyObject *key)
{
    size_t slot;
    Py_ssize_t ix = find_any(self, key, &slot);
    return Py_NewRef(ix >= 0 ? self->entries[ix].value : Py_None);
}

/* Make `key` the newest; -1 with KeyError (absent) or MemoryError set. */
static int move_to_end(KeyIndex *self, PyObject *key)
{
    size_t slot;
    Py_ssize_t ix = find_or_raise(self, key, &slot);
    if (ix < 0)
        return -1;
    if (ix == self->used - 1)
        return 0;
    if (self->used == self->capacity) {
        if (rebuild(self) < 0)
            return -1;
        ix = find_any(self, key, &slot);
        if (ix == self->used - 1)
            return 0;
    }
    self->entries[self->used] = self->entries[ix];
    self->entries[ix].key = NULL;
    self->entries[ix].value = NULL;
    self->slots[slot] = (int32_t)self->used;
    self->used++;
    self->version++;
    if (ix == self->head)
        skip_deleted_head(self);
    return 0;
}

static PyObject *KeyIndex_move_to_end(KeyIndex *self, PyObject *key)
{
    if (move_to_end(self, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *KeyIndex_get_many(KeyIndex *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "get_many: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *keys = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    Py_ssize_t ix[WINDOW];
    for (Py_ssize_t start = 0; out != NULL && start < n; start += WINDOW) {
        Py_ssize_t m = n - start < WINDOW ? n - start : WINDOW;
        probe_window(self, keys + start, m, ix);
        for (Py_ssize_t i = 0; i < m; i++)
            PyList_SET_ITEM(out, start + i,
                            Py_NewRef(ix[i] >= 0 ? self->entries[ix[i]].value : Py_None));
    }
    Py_DECREF(seq);
    return out;
}

/* The int64 items of sequence `seq` (from PySequence_Fast) in out[0:n]; -1 with an error set if
 * one is not an int in range. */
static int int64_items(PyObject *seq, Py_ssize_t n, long long *out, const char *name)
{
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "%s must be ints, not %.100s", name,
                         Py_TYPE(items[i])->tp_name);
            return -1;
        }
        out[i] = PyLong_AsLongLong(items[i]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* -- keys per region and length (the registry's region counters) ----------------------------
 * {region id: {length: keys}} of rows[0:n] (those with keep[i] set; keep NULL: all), regions in
 * the order of their last row: the order in which adding or dropping the rows one by one
 * would finish with each region (`Registry._drop_keys` frees a returned region there). A
 * batch is runs of one region and one length: a dict is touched once per run. */

/* groups[rid][length] += count; -1 with an error set. */
static int group_add(PyObject *groups, long long rid, long long length, Py_ssize_t count)
{
    int rc = -1;
    PyObject *rkey = PyLong_FromLongLong(rid), *lkey = PyLong_FromLongLong(length), *sum = NULL;
    if (rkey == NULL || lkey == NULL)
        goto done;
    PyObject *inner = PyDict_GetItemWithError(groups, rkey); /* borrowed */
    if (inner == NULL) {
        if (PyErr_Occurred() || (inner = PyDict_New()) == NULL)
            goto done;
        int err = PyDict_SetItem(groups, rkey, inner);
        Py_DECREF(inner); /* (the dict holds it) */
        if (err < 0)
            goto done;
    }
    PyObject *old = PyDict_GetItemWithError(inner, lkey);
    if (old == NULL && PyErr_Occurred())
        goto done;
    Py_ssize_t before = old != NULL ? PyLong_AsSsize_t(old) : 0;
    if ((sum = PyLong_FromSsize_t(before + count)) != NULL)
        rc = PyDict_SetItem(inner, lkey, sum);
done:
    Py_XDECREF(rkey);
    Py_XDECREF(lkey);
    Py_XDECREF(sum);
    return rc;
}

static PyObject *groups_of(const long long *rids, const long long *lengths, Py_ssize_t n,
                           const char *keep)
{
    PyObject *latest_first = PyDict_New(), *out = NULL, *order = NULL;
    if (latest_first == NULL)
        return NULL;
    long long rid = 0, length = 0;
    Py_ssize_t run = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* from the end: a region's first run is its last */
        if (keep != NULL && !keep[i])
            continue;
        if (run > 0 && rids[i] == rid && lengths[i] == length) {
            run++;
            continue;
        }
        if (run > 0 && group_add(latest_first, rid, length, run) < 0)
            goto done;
        rid = rids[i], length = lengths[i], run = 1;
    }
    if (run > 0 && group_add(latest_first, rid, length, run) < 0)
        goto done;
    if ((order = PyDict_Keys(latest_first)) == NULL || (out = PyDict_New()) == NULL)
        goto done;
    for (Py_ssize_t j = PyList_GET_SIZE(order) - 1; j >= 0; j--) {
        PyObject *key = PyList_GET_ITEM(order, j);
        if (PyDict_SetItem(out, key, PyDict_GetItem(latest_first, key)) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    Py_DECREF(latest_first);
    Py_XDECREF(order);
    return out;
}

/* length_groups(region_ids, lengths) -> {region id: {length: keys}}: see `groups_of`. */
static PyObject *length_groups(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "length_groups(region_ids, lengths)");
        return NULL;
    }
    PyObject *cols[2] = {NULL, NULL}, *out = NULL;
    long long *ints = NULL;
    for (int c = 0; c < 2; c++)
        if ((cols[c] = PySequence_Fast(args[c], "length_groups: columns must be sequences")) ==
            NULL)
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cols[0]);
    if (PySequence_Fast_GET_SIZE(cols[1]) != n) {
        PyErr_SetString(PyExc_ValueError, "length_groups: columns differ in length");
        goto done;
    }
    if ((ints = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(long long))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (int64_items(cols[0], n, ints, "length_groups: region_ids") < 0 ||
        int64_items(cols[1], n, ints + n, "length_groups: lengths") < 0)
        goto done;
    out = groups_of(ints, ints + n, n, NULL);
done:
    PyMem_Free(ints);
    Py_XDECREF(cols[0]);
    Py_XDECREF(cols[1]);
    return out;
}

static PyObject *KeyIndex_add_entries(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "add_entries(keys, region_ids, offsets, lengths, "
                                         "checksums or None, grouped=False)");
        return NULL;
    }
    int grouped = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (grouped < 0)
        return NULL;
    static const char *names[5] = {"add_entries: keys", "add_entries: region_ids",
                                   "add_entries: offsets", "add_entries: lengths",
                                   "add_entries: checksums"};
    int ncols = args[4] == Py_None ? 4 : 5;
    PyObject *cols[5] = {NULL, NULL, NULL, NULL, NULL};
    long long *ints = NULL;
    PyObject *out = NULL;
    for (int c = 0; c < ncols; c++)
        if ((cols[c] = PySequence_Fast(args[c], "add_entries: columns must be sequences")) ==
            NULL)
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cols[0]);
    PyObject *const *keys = PySequence_Fast_ITEMS(cols[0]);
    /* all or nothing: every key and number checked, the numbers read, before any change */
    if ((ints = PyMem_Calloc((size_t)(n ? n : 1) * 4, sizeof(long long))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int c = 1; c < ncols; c++) {
        if (PySequence_Fast_GET_SIZE(cols[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "add_entries: columns differ in length");
            goto done;
        }
        if (int64_items(cols[c], n, ints + (c - 1) * n, names[c]) < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (key_hash(keys[i]) == -1) {
            PyErr_Format(PyExc_TypeError, "KeyIndex keys are str or bytes, not %.100s",
                         Py_TYPE(keys[i])->tp_name);
            goto done;
        }
    const long long *region_ids = ints, *offsets = ints + n, *lengths = ints + 2 * n,
                    *checksums = ints + 3 * n; /* (zeros without the column) */
    PyObject *flags = NULL;                    /* per key, whether it was new: made at the first
                                                * key that was not */
    Py_hash_t hashes[WINDOW];
    for (Py_ssize_t start = 0; start < n; start += WINDOW) {
        Py_ssize_t m = n - start < WINDOW ? n - start : WINDOW;
        prefetch_window(self, keys + start, hashes, m);
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t k = start + i;
            size_t slot;
            int added = 0;
            if (find(self, keys[k], hashes[i], &slot) < 0) {
                KeyEntry *e = (KeyEntry *)KeyEntryType.tp_alloc(&KeyEntryType, 0);
                if (e == NULL)
                    goto failed;
                e->region_id = region_ids[k];
                e->offset = offsets[k];
                e->length = lengths[k];
                e->checksum = checksums[k];
                int err = insert_new(self, keys[k], hashes[i], (PyObject *)e, slot);
                Py_DECREF(e);
                if (err < 0)
                    goto failed;
                added = 1;
            }
            if (!added && flags == NULL) {
                if ((flags = PyList_New(n)) == NULL)
                    goto failed;
                for (Py_ssize_t j = 0; j < k; j++)
                    PyList_SET_ITEM(flags, j, Py_NewRef(Py_True));
            }
            if (flags != NULL)
                PyList_SET_ITEM(flags, k, Py_NewRef(added ? Py_True : Py_False));
        }
    }
    out = flags != NULL ? flags : Py_NewRef(Py_None);
    if (grouped) { /* the new keys' counts, or (out of memory) none of the keys added */
        char *keep = NULL;
        PyObject *groups = NULL;
        if (flags != NULL && (keep = PyMem_Malloc((size_t)n)) == NULL)
            PyErr_NoMemory();
        else {
            for (Py_ssize_t k = 0; flags != NULL && k < n; k++)
                keep[k] = PyList_GET_ITEM(flags, k) == Py_True;
            groups = groups_of(region_ids, lengths, n, keep);
        }
        PyObject *pair = groups != NULL ? PyTuple_Pack(2, out, groups) : NULL;
        if (pair == NULL) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            for (Py_ssize_t k = 0; k < n; k++)
                if ((flags == NULL || PyList_GET_ITEM(flags, k) == Py_True) &&
                    KeyIndex_ass_subscript(self, keys[k], NULL) < 0)
                    PyErr_Clear(); /* (cannot fail: each was just added, once) */
            PyErr_Restore(type, value, tb);
        }
        Py_SETREF(out, pair);
        Py_XDECREF(groups);
        PyMem_Free(keep);
    }
    goto done;
failed: /* out of memory part way: the keys added so far stay */
    Py_XDECREF(flags);
done:
    PyMem_Free(ints);
    for (int c = 0; c < 5; c++)
        Py_XDECREF(cols[c]);
    return out;
}

/* batch_fits(keys, max_chars, region_ids, offsets, lengths, limits): the registry's check of a
 * REGISTER_KV batch in one pass (its docstring says what it decides; the tests' model of it is
 * `py_batch_fits` in tests/unit/keyindex_model.py). */
static PyObject *batch_fits(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyDict_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "batch_fits(keys, max_chars, region_ids, offsets, lengths, limits: dict)");
        return NULL;
    }
    Py_ssize_t max_chars = PyLong_AsSsize_t(args[1]);
    if (max_chars == -1 && PyErr_Occurred())
        return NULL;
    PyObject *cols[4] = {NULL, NULL, NULL, NULL};
    PyObject *limits = args[5];
    int fits = 0;
    for (int c = 0; c < 4; c++)
        if ((cols[c] = PySequence_Fast(args[c == 0 ? 0 : c + 1],
                                       "batch_fits: columns must be sequences")) == NULL)
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cols[0]);
    for (int c = 1; c < 4; c++)
        if (PySequence_Fast_GET_SIZE(cols[c]) != n)
            goto done; /* (not a batch that fits) */
    PyObject *const *keys = PySequence_Fast_ITEMS(cols[0]);
    PyObject *const *rids = PySequence_Fast_ITEMS(cols[1]);
    PyObject *const *offs = PySequence_Fast_ITEMS(cols[2]);
    PyObject *const *lens = PySequence_Fast_ITEMS(cols[3]);
    PyObject *last_rid = NULL;
    long long limit = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t chars = PyUnicode_CheckExact(keys[i])  ? PyUnicode_GET_LENGTH(keys[i])
                           : PyBytes_CheckExact(keys[i]) ? PyBytes_GET_SIZE(keys[i])
                                                         : 0;
        if (chars <= 0 || chars > max_chars)
            goto done;
        if (!PyLong_CheckExact(rids[i]) || !PyLong_CheckExact(offs[i]) ||
            !PyLong_CheckExact(lens[i]))
            goto done;
        if (rids[i] != last_rid) { /* (a batch's ids are mostly one object) */
            PyObject *got = PyDict_GetItemWithError(limits, rids[i]);
            if (got == NULL) /* not one of the caller's writable regions (or an error) */
                goto done;
            limit = PyLong_AsLongLong(got);
            if (limit == -1 && PyErr_Occurred())
                goto done;
            last_rid = rids[i];
        }
        int overflow = 0;
        long long offset = PyLong_AsLongLongAndOverflow(offs[i], &overflow);
        if (overflow)
            goto done;
        long long length = PyLong_AsLongLongAndOverflow(lens[i], &overflow);
        if (overflow)
            goto done;
        /* 0 < length, 0 <= offset, offset + length <= limit, without overflowing */
        if (length <= 0 || offset < 0 || length > limit || offset > limit - length)
            goto done;
    }
    fits = n > 0;
done:
    for (int c = 0; c < 4; c++)
        Py_XDECREF(cols[c]);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(fits);
}

static PyObject *KeyIndex_lookup_columns(KeyIndex *self, PyObject *const *args,
                                         Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lookup_columns(keys, lease)");
        return NULL;
    }
    int lease = PyObject_IsTrue(args[1]);
    if (lease < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "lookup_columns: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *keys = PySequence_Fast_ITEMS(seq);
    PyObject *held = PyList_New(0);
    PyObject *cols[4] = {NULL, NULL, NULL, NULL};
    PyObject *out = NULL;
    if (held == NULL)
        goto done;
    for (int c = 0; c < 4; c++)
        if ((cols[c] = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(long long))) == NULL)
            goto done;
    long long *region_ids = (long long *)PyBytes_AS_STRING(cols[0]);
    long long *offsets = (long long *)PyBytes_AS_STRING(cols[1]);
    long long *lengths = (long long *)PyBytes_AS_STRING(cols[2]);
    long long *checksums = (long long *)PyBytes_AS_STRING(cols[3]);
    Py_ssize_t ix[WINDOW];
    for (Py_ssize_t start = 0; start < n; start += WINDOW) {
        Py_ssize_t m = n - start < WINDOW ? n - start : WINDOW;
        probe_window(self, keys + start, m, ix);
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t k = start + i;
            if (ix[i] < 0) {
                region_ids[k] = offsets[k] = lengths[k] = checksums[k] = 0;
                continue;
            }
            KeyEntry *e = (KeyEntry *)self->entries[ix[i]].value;
            if (PyList_Append(held, (PyObject *)e) < 0) {
                if (lease) /* no lease half taken */
                    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(held); j++)
                        ((KeyEntry *)PyList_GET_ITEM(held, j))->leases--;
                goto done;
            }
            e->referenced = 1;
            e->leases += lease;
            region_ids[k] = e->region_id;
            offsets[k] = e->offset;
            lengths[k] = e->length;
            checksums[k] = e->checksum;
        }
    }
    out = PyTuple_Pack(5, held, cols[0], cols[1], cols[2], cols[3]);
done:
    Py_XDECREF(held);
    for (int c = 0; c < 4; c++)
        Py_XDECREF(cols[c]);
    Py_DECREF(seq);
    return out;
}

/* -- CLOCK victims (the policy is maru.server.eviction's; this is its walk) ------------------ */

#define VICTIM 2 /* a bit of `referenced` while the walk has taken its entry (no Python code
                  * sees it: cleared before the call returns) */

/* The region filter of a walk: its ids sorted, searched per key. A walk that keeps an
 * instance's keys (a watermark round over the instances above their share, a writer's room in
 * its own regions) passes over every other key before it, 10^5 or more of them; a Python int
 * made and hashed per key cost 20 ns, the search a few. */
typedef struct {
    long long *ids; /* NULL: any region */
    Py_ssize_t n;
} RegionFilter;

static int compare_ids(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* `regions` (a set of int ids, or None) as a filter; -1 with an error set (not ints). */
static int region_filter(PyObject *regions, RegionFilter *out)
{
    out->ids = NULL;
    out->n = 0;
    if (regions == Py_None)
        return 0;
    Py_ssize_t n = PySet_GET_SIZE(regions), k = 0;
    PyObject *iter = PyObject_GetIter(regions), *item;
    out->ids = PyMem_Malloc(sizeof(long long) * (size_t)(n > 0 ? n : 1));
    if (iter == NULL || out->ids == NULL) {
        Py_XDECREF(iter);
        PyMem_Free(out->ids);
        out->ids = NULL;
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    while (k < n && (item = PyIter_Next(iter)) != NULL) {
        long long id = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (id == -1 && PyErr_Occurred())
            break;
        out->ids[k++] = id;
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) {
        PyMem_Free(out->ids);
        out->ids = NULL;
        return -1;
    }
    out->n = k;
    qsort(out->ids, (size_t)k, sizeof(long long), compare_ids);
    return 0;
}

/* Where `id` is among the filter's ids, -1 if not there. */
static Py_ssize_t filter_index(const RegionFilter *filter, long long id)
{
    Py_ssize_t lo = 0, hi = filter->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (filter->ids[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < filter->n && filter->ids[lo] == id ? lo : -1;
}

static int in_filter(const RegionFilter *filter, long long id)
{
    return filter->ids == NULL || filter_index(filter, id) >= 0;
}

/* Whether the walk passes over entry e of `key`: busy, taken already, in no region of
 * `regions` (the filter; no ids: any), or in `protect` (a set of keys; None: none). -1 with
 * an error set. */
static int passed_over(KeyEntry *e, PyObject *key, const RegionFilter *regions, PyObject *protect)
{
    if (e->pins > 0 || e->leases > 0 || (e->referenced & VICTIM))
        return 1;
    if (!in_filter(regions, e->region_id))
        return 1;
    if (protect != Py_None) {
        int in = PySet_Contains(protect, key);
        if (in != 0)
            return in;
    }
    return 0;
}

static PyObject *KeyIndex_clock_victims(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || (args[2] != Py_None && !PyAnySet_Check(args[2])) ||
        (args[3] != Py_None && !PyAnySet_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "clock_victims(want_bytes, second_chance, "
                                         "protect: set or None, regions: set or None)");
        return NULL;
    }
    long long want = PyLong_AsLongLong(args[0]);
    if (want == -1 && PyErr_Occurred())
        return NULL;
    int second_chance = PyObject_IsTrue(args[1]);
    if (second_chance < 0)
        return NULL;
    PyObject *protect = args[2], *out = NULL;
    RegionFilter regions;
    if (region_filter(args[3], &regions) < 0)
        return NULL;
    PyObject *keys = PyList_New(0), *entries = PyList_New(0), *spared = PyList_New(0);
    long long freed = 0;
    if (keys == NULL || entries == NULL || spared == NULL)
        goto done;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t version = self->version;
        for (Py_ssize_t j = self->head; j < self->used && freed < want; j++) {
            Entry *en = &self->entries[j];
            if (en->key == NULL)
                continue;
            KeyEntry *e = (KeyEntry *)en->value;
            PyObject *key = en->key;
            int skip = passed_over(e, key, &regions, protect);
            if (skip < 0)
                goto done;
            if (self->version != version) { /* (a set member's __eq__ changed the index) */
                PyErr_SetString(PyExc_RuntimeError, "KeyIndex changed during clock_victims");
                goto done;
            }
            if (skip)
                continue;
            if (e->referenced && second_chance) { /* a second chance: moved to the end below */
                e->referenced = 0;
                if (PyList_Append(spared, key) < 0)
                    goto done;
                continue;
            }
            if (PyList_Append(keys, key) < 0 || PyList_Append(entries, (PyObject *)e) < 0)
                goto done;
            e->referenced |= VICTIM;
            freed += e->length;
        }
        Py_ssize_t nspared = PyList_GET_SIZE(spared);
        for (Py_ssize_t i = 0; i < nspared; i++) /* after the walk, as its order requires */
            if (move_to_end(self, PyList_GET_ITEM(spared, i)) < 0)
                goto done;
        if (freed >= want || nspared == 0)
            break;
        if (PyList_SetSlice(spared, 0, nspared, NULL) < 0)
            goto done;
    }
    out = Py_BuildValue("(OOL)", keys, entries, freed);
done:
    if (entries != NULL) /* the marks go (on an error too: nothing was taken then) */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++)
            ((KeyEntry *)PyList_GET_ITEM(entries, i))->referenced &= ~VICTIM;
    PyMem_Free(regions.ids);
    Py_XDECREF(keys);
    Py_XDECREF(entries);
    Py_XDECREF(spared);
    return out;
}

/* A candidate region of `reclaim_order`: where its first key without and with the CLOCK bit
 * lie in the walk (-1: none), and whether a key of it is busy. */
typedef struct {
    long long region_id;
    Py_ssize_t first_idle, first_used;
    int busy;
} ReclaimCandidate;

static int compare_first_idle(const void *a, const void *b)
{
    Py_ssize_t x = ((const ReclaimCandidate *)a)->first_idle;
    Py_ssize_t y = ((const ReclaimCandidate *)b)->first_idle;
    return (x > y) - (x < y);
}

static int compare_first_used(const void *a, const void *b)
{
    Py_ssize_t x = ((const ReclaimCandidate *)a)->first_used;
    Py_ssize_t y = ((const ReclaimCandidate *)b)->first_used;
    return (x > y) - (x < y);
}

static PyObject *KeyIndex_reclaim_order(KeyIndex *self, PyObject *arg)
{
    if (!PyAnySet_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "reclaim_order(regions: set)");
        return NULL;
    }
    RegionFilter filter;
    if (region_filter(arg, &filter) < 0)
        return NULL;
    Py_ssize_t n = filter.n, k;
    ReclaimCandidate *c = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(ReclaimCandidate));
    PyObject *out = NULL;
    if (c == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (k = 0; k < n; k++) {
        c[k].region_id = filter.ids[k];
        c[k].first_idle = c[k].first_used = -1;
    }
    for (Py_ssize_t j = self->head; j < self->used && n > 0; j++) {
        Entry *en = &self->entries[j];
        if (en->key == NULL)
            continue;
        KeyEntry *e = (KeyEntry *)en->value;
        Py_ssize_t at = filter_index(&filter, e->region_id); /* (`c` is in the ids' order) */
        if (at < 0)
            continue;
        ReclaimCandidate *r = &c[at];
        if (e->referenced) {
            if (r->first_used < 0)
                r->first_used = j;
        } else if (r->first_idle < 0) {
            r->first_idle = j;
        }
        if (e->pins > 0 || e->leases > 0)
            r->busy = 1;
    }
    /* those with an idle key by its place, then those whose keys were all used by the first */
    Py_ssize_t idle = 0, used = 0;
    ReclaimCandidate *order = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(ReclaimCandidate));
    if (order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (k = 0; k < n; k++)
        if (!c[k].busy && c[k].first_idle >= 0)
            order[idle++] = c[k];
    for (k = 0; k < n; k++)
        if (!c[k].busy && c[k].first_idle < 0 && c[k].first_used >= 0)
            order[idle + used++] = c[k];
    qsort(order, (size_t)idle, sizeof(ReclaimCandidate), compare_first_idle);
    qsort(order + idle, (size_t)used, sizeof(ReclaimCandidate), compare_first_used);
    out = PyList_New(idle + used);
    for (k = 0; out != NULL && k < idle + used; k++) {
        PyObject *rid = PyLong_FromLongLong(order[k].region_id);
        if (rid == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, rid);
    }
    PyMem_Free(order);
done:
    PyMem_Free(c);
    PyMem_Free(filter.ids);
    return out;
}

/* `arg` as a PySequence_Fast of KeyEntry only (a new reference), or NULL with a TypeError
 * naming `name`: a batch call checks every item before it reads or changes any. */
static PyObject *key_entries(PyObject *arg, const char *name)
{
    PyObject *seq = PySequence_Fast(arg, "expected a sequence of KeyEntry");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyObject_TypeCheck(items[i], &KeyEntryType)) {
            PyErr_Format(PyExc_TypeError, "%s: expected KeyEntry objects, not %.100s", name,
                         Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    return seq;
}

/* entry_locations(entries) -> (region_ids, lengths, notices): the registry's view of keys it
 * drops (`Registry._drop_keys`): two columns, and the owners' notices as one packed buffer of
 * native int64 (region_id, offset, length) triples, the wire form of a reply's `freed`. */
static PyObject *entry_locations(PyObject *module, PyObject *arg)
{
    PyObject *seq = key_entries(arg, "entry_locations");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL, *rids = PyList_New(n), *lens = PyList_New(n);
    PyObject *notices = PyBytes_FromStringAndSize(NULL, n * 3 * (Py_ssize_t)sizeof(int64_t));
    if (rids == NULL || lens == NULL || notices == NULL)
        goto done;
    int64_t *triple = (int64_t *)PyBytes_AS_STRING(notices);
    for (Py_ssize_t i = 0; i < n; i++, triple += 3) {
        KeyEntry *e = (KeyEntry *)items[i];
        PyObject *rid = PyLong_FromLongLong(e->region_id);
        PyObject *len = rid ? PyLong_FromLongLong(e->length) : NULL;
        if (len == NULL) {
            Py_XDECREF(rid);
            goto done;
        }
        PyList_SET_ITEM(rids, i, rid);
        PyList_SET_ITEM(lens, i, len);
        triple[0] = e->region_id;
        triple[1] = e->offset;
        triple[2] = e->length;
    }
    out = PyTuple_Pack(3, rids, lens, notices);
done:
    Py_XDECREF(rids);
    Py_XDECREF(lens);
    Py_XDECREF(notices);
    Py_DECREF(seq);
    return out;
}

static PyObject *release_entries(PyObject *module, PyObject *arg)
{
    PyObject *seq = key_entries(arg, "release_entries");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        KeyEntry *e = (KeyEntry *)items[i];
        if (e->leases > 0)
            e->leases--;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* -- iteration ----------------------------------------------------------------------------- */

enum { ITER_KEYS, ITER_VALUES, ITER_ITEMS };

typedef struct {
    PyObject_HEAD
    KeyIndex *index; /* NULL once exhausted */
    Py_ssize_t pos;  /* next entry to look at */
    uint64_t version;
    int kind;
    int reverse;
} KeyIndexIter;

static PyObject *make_iter(KeyIndex *self, int kind, int reverse)
{
    KeyIndexIter *it = PyObject_New(KeyIndexIter, &KeyIndexIterType);
    if (it == NULL)
        return NULL;
    it->index = (KeyIndex *)Py_NewRef(self);
    it->pos = reverse ? self->used - 1 : self->head;
    it->version = self->version;
    it->kind = kind;
    it->reverse = reverse;
    return (PyObject *)it;
}

static PyObject *KeyIndexIter_next(KeyIndexIter *it)
{
    KeyIndex *index = it->index;
    if (index == NULL)
        return NULL;
    if (index->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex changed during iteration");
        return NULL;
    }
    int step = it->reverse ? -1 : 1;
    for (; it->reverse ? it->pos >= index->head : it->pos < index->used; it->pos += step) {
        Entry *e = &index->entries[it->pos];
        if (e->key == NULL)
            continue;
        it->pos += step;
        if (it->kind == ITER_KEYS)
            return Py_NewRef(e->key);
        if (it->kind == ITER_VALUES)
            return Py_NewRef(e->value);
        /* Own both before allocating: an allocation can run the GC, and a finalizer could
         * change the index under us. */
        PyObject *key = Py_NewRef(e->key), *value = Py_NewRef(e->value);
        PyObject *item = PyTuple_Pack(2, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        return item;
    }
    Py_CLEAR(it->index);
    return NULL;
}

static void KeyIndexIter_dealloc(KeyIndexIter *it)
{
    Py_XDECREF(it->index);
    PyObject_Free(it);
}

static PyObject *KeyIndex_iter(KeyIndex *self)
{
    return make_iter(self, ITER_KEYS, 0);
}

static PyObject *KeyIndex_values(KeyIndex *self, PyObject *unused)
{
    return make_iter(self, ITER_VALUES, 0);
}

static PyObject *KeyIndex_items(KeyIndex *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"reverse", NULL};
    int reverse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$p:items", kwlist, &reverse))
        return NULL;
    return make_iter(self, ITER_ITEMS, reverse);
}

static PyObject *KeyIndex_sizeof(KeyIndex *self, PyObject *unused)
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(KeyIndex) + self->capacity * sizeof(Entry) +
                              (Py_ssize_t)((self->mask + 1) * sizeof(int32_t)));
}

static PyObject *KeyIndex_pack_rows(KeyIndex *self, PyObject *unused);
static PyObject *KeyIndex_pinned(KeyIndex *self, PyObject *unused);

static PyMethodDef KeyIndex_methods[] = {
    {"get", (PyCFunction)KeyIndex_get, METH_O, "get(key): the entry of key, or None."},
    {"move_to_end", (PyCFunction)KeyIndex_move_to_end, METH_O,
     "move_to_end(key): make key the newest (KeyError if absent)."},
    {"remove_many", (PyCFunction)KeyIndex_remove_many, METH_O,
     "remove_many(keys): del index[k] for each k in order, probes prefetched; KeyError at the\n"
     "first absent key (those before it removed)."},
    {"get_many", (PyCFunction)KeyIndex_get_many, METH_O,
     "get_many(keys): [get(k) for k in keys], with the probes of a batch prefetched so their\n"
     "cache misses overlap."},
    {"add_entries", (PyCFunction)(void (*)(void))KeyIndex_add_entries, METH_FASTCALL,
     "add_entries(keys, region_ids, offsets, lengths, checksums or None) -> None | [bool]:\n"
     "a new KeyEntry for each absent key (the first of a batch wins), probes prefetched.\n"
     "None when every key was new, else whether each was. TypeError or ValueError before\n"
     "any change for a key not str or bytes, a number not an int64, columns unequal.\n"
     "grouped=True: (that, length_groups of the new keys' region ids and lengths)."},
    {"lookup_columns", (PyCFunction)(void (*)(void))KeyIndex_lookup_columns, METH_FASTCALL,
     "lookup_columns(keys, lease) -> (hits, region_ids, offsets, lengths, checksums): a batch\n"
     "lookup, prefetched. Each hit gets its CLOCK bit set (and, with lease, one more lease);\n"
     "`hits` lists their entries in key order, and the columns are bytes of native int64s,\n"
     "0 0 0 0 for a miss."},
    {"clock_victims", (PyCFunction)(void (*)(void))KeyIndex_clock_victims, METH_FASTCALL,
     "clock_victims(want_bytes, second_chance, protect, regions) -> (keys, entries, freed):\n"
     "eviction's walk (CLOCK): idle keys oldest first until want_bytes of them. Passed over:\n"
     "busy keys (pinned or leased), keys in protect, keys outside regions (None: any region).\n"
     "A key whose CLOCK bit is set is spared instead (bit cleared, moved to the newest end\n"
     "after the walk); when a walk takes too little and spared some, a second walk goes on.\n"
     "second_chance=False: the bits are not looked at. Takes nothing out of the index."},
    {"reclaim_order", (PyCFunction)KeyIndex_reclaim_order, METH_O,
     "reclaim_order(regions: set) -> [region id, ...]: the regions a reclaim may empty, in\n"
     "the order eviction would reach them: those with a key without its CLOCK bit by the\n"
     "first such key, then those whose keys all have it by their first. Regions holding a\n"
     "busy key (pinned or leased) or no key are left out."},
    {"values", (PyCFunction)KeyIndex_values, METH_NOARGS,
     "values(): an iterator over the entries, oldest first."},
    {"items", (PyCFunction)(void (*)(void))KeyIndex_items, METH_VARARGS | METH_KEYWORDS,
     "items(*, reverse=False): an iterator over (key, entry), oldest first."},
    {"pack_rows", (PyCFunction)KeyIndex_pack_rows, METH_NOARGS,
     "pack_rows() -> bytes: the snapshot's \"keys\" array in msgpack, oldest first: rows\n"
     "[key, region_id, offset, length(, checksum when nonzero)], byte for byte what\n"
     "pack_record packs of persistence.snapshot's list of them."},
    {"pinned", (PyCFunction)KeyIndex_pinned, METH_NOARGS,
     "pinned() -> [(key, pins), ...]: the keys with pins, oldest first."},
    {"__sizeof__", (PyCFunction)KeyIndex_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyIndex_as_sequence = {
    .sq_contains = (objobjproc)KeyIndex_contains,
};

static PyMappingMethods KeyIndex_as_mapping = {
    .mp_length = (lenfunc)KeyIndex_len,
    .mp_subscript = (binaryfunc)KeyIndex_subscript,
    .mp_ass_subscript = (objobjargproc)KeyIndex_ass_subscript,
};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.server._keyindex.KeyIndex",
    .tp_doc = "An insertion-ordered map from str/bytes keys to KeyEntry, with batched lookups.",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyIndex_new,
    .tp_dealloc = (destructor)KeyIndex_dealloc,
    .tp_iter = (getiterfunc)KeyIndex_iter,
    .tp_methods = KeyIndex_methods,
    .tp_as_sequence = &KeyIndex_as_sequence,
    .tp_as_mapping = &KeyIndex_as_mapping,
};

static PyTypeObject KeyIndexIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.server._keyindex.KeyIndexIterator",
    .tp_basicsize = sizeof(KeyIndexIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)KeyIndexIter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)KeyIndexIter_next,
};

/* -- the journal's records in msgpack (maru.server.journal) ----------------------------------
 * pack_record(obj) -> bytes: what `msgpack.packb(obj, use_bin_type=True)` returns, for the
 * types a journal record or snapshot holds (None, bool, int, float, str, bytes, list, tuple,
 * dict), written in one C pass. A REGISTER_KV's "K" record is 256 keys and 768 ints: the
 * generic packer's per-object dispatch was most of the journal's share of the request. Ints
 * outside int64 / uint64: OverflowError; any other type: TypeError (as msgpack). */

#define PACK_MAX_DEPTH 512 /* nesting a record may have (msgpack's default limit is 511) */

typedef struct {
    PyObject *bytes; /* the output, resized as it grows */
    char *p;         /* PyBytes_AS_STRING(bytes) */
    Py_ssize_t len, cap;
} PackBuf;

/* Room for `more` bytes at p + len; -1 with MemoryError set. */
static int pack_reserve(PackBuf *b, Py_ssize_t more)
{
    if (b->len + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap * 2;
    while (cap < b->len + more)
        cap *= 2;
    if (_PyBytes_Resize(&b->bytes, cap) < 0)
        return -1;
    b->p = PyBytes_AS_STRING(b->bytes);
    b->cap = cap;
    return 0;
}

/* A type byte and `n` bytes of big-endian `v` (n in 0, 1, 2, 4, 8). */
static int pack_head(PackBuf *b, unsigned char type, uint64_t v, int n)
{
    if (pack_reserve(b, 1 + n) < 0)
        return -1;
    char *q = b->p + b->len;
    *q++ = (char)type;
    for (int i = n - 1; i >= 0; i--)
        *q++ = (char)(v >> (8 * i));
    b->len += 1 + n;
    return 0;
}

/* A length-prefixed header: fixed form (`fix` | n) below `fixmax`, else the 8/16/32-bit form
 * (`t8` 0 when there is none: arrays and maps). */
static int pack_len(PackBuf *b, Py_ssize_t n, unsigned char fix, Py_ssize_t fixmax,
                    unsigned char t8, unsigned char t16, unsigned char t32)
{
    if (n < fixmax)
        return pack_head(b, (unsigned char)(fix | n), 0, 0);
    if (t8 && n < 256)
        return pack_head(b, t8, (uint64_t)n, 1);
    if (n < 65536)
        return pack_head(b, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffu)
        return pack_head(b, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "pack_record: an object too large for msgpack");
    return -1;
}

static int pack_raw(PackBuf *b, const char *data, Py_ssize_t n)
{
    if (pack_reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, data, (size_t)n);
    b->len += n;
    return 0;
}

/* An int64 in msgpack's smallest form (as msgpack writes it). Inlined: a "K" record packs 768
 * ints through `pack_int`, where a call each was 3% of the key index's share of a request. */
static ALWAYS_INLINE int pack_ll(PackBuf *b, long long v)
{
    if (v >= 0) {
        uint64_t u = (uint64_t)v;
        if (u < 128)
            return pack_head(b, (unsigned char)u, 0, 0);
        if (u < 256)
            return pack_head(b, 0xcc, u, 1);
        if (u < 65536)
            return pack_head(b, 0xcd, u, 2);
        if (u <= 0xffffffffu)
            return pack_head(b, 0xce, u, 4);
        return pack_head(b, 0xcf, u, 8);
    }
    if (v >= -32)
        return pack_head(b, (unsigned char)(v & 0xff), 0, 0);
    if (v >= -128)
        return pack_head(b, 0xd0, (uint64_t)v, 1);
    if (v >= -32768)
        return pack_head(b, 0xd1, (uint64_t)v, 2);
    if (v >= -2147483648LL)
        return pack_head(b, 0xd2, (uint64_t)v, 4);
    return pack_head(b, 0xd3, (uint64_t)v, 8);
}

static int pack_int(PackBuf *b, PyObject *o)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0) { /* uint64 range */
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_SetString(PyExc_OverflowError, "Integer value out of range");
            return -1;
        }
        return pack_head(b, 0xcf, u, 8);
    }
    if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "Integer value out of range");
        return -1;
    }
    return pack_ll(b, v);
}

static int pack_obj(PackBuf *b, PyObject *o, int depth)
{
    if (PyUnicode_Check(o)) { /* first: nearly every object of a record is a key */
        Py_ssize_t n;
        const char *s;
        if (PyUnicode_IS_COMPACT_ASCII(o)) { /* (its UTF-8 is its data) */
            s = (const char *)PyUnicode_DATA(o);
            n = PyUnicode_GET_LENGTH(o);
        }
        else if ((s = PyUnicode_AsUTF8AndSize(o, &n)) == NULL)
            return -1;
        if (pack_len(b, n, 0xa0, 32, 0xd9, 0xda, 0xdb) < 0)
            return -1;
        return pack_raw(b, s, n);
    }
    if (o == Py_None)
        return pack_head(b, 0xc0, 0, 0);
    if (o == Py_True || o == Py_False)
        return pack_head(b, o == Py_True ? 0xc3 : 0xc2, 0, 0);
    if (PyLong_Check(o))
        return pack_int(b, o);
    if (depth > PACK_MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "pack_record: nested too deeply");
        return -1;
    }
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        if (pack_len(b, n, 0x90, 16, 0, 0xdc, 0xdd) < 0)
            return -1;
        /* (no Python code runs while a record is packed: nothing can change it meanwhile) */
        PyObject *const *items = PySequence_Fast_ITEMS(o);
        for (Py_ssize_t i = 0; i < n; i++)
            if (pack_obj(b, items[i], depth + 1) < 0)
                return -1;
        return 0;
    }
    if (PyBytes_Check(o)) {
        Py_ssize_t n = PyBytes_GET_SIZE(o);
        if (pack_len(b, n, 0, 0, 0xc4, 0xc5, 0xc6) < 0)
            return -1;
        return pack_raw(b, PyBytes_AS_STRING(o), n);
    }
    if (PyFloat_Check(o)) {
        double d = PyFloat_AS_DOUBLE(o);
        uint64_t u;
        memcpy(&u, &d, sizeof u);
        return pack_head(b, 0xcb, u, 8);
    }
    if (PyDict_Check(o)) {
        Py_ssize_t n = PyDict_GET_SIZE(o), pos = 0;
        PyObject *k, *v;
        if (pack_len(b, n, 0x80, 16, 0, 0xde, 0xdf) < 0)
            return -1;
        while (PyDict_Next(o, &pos, &k, &v))
            if (pack_obj(b, k, depth + 1) < 0 || pack_obj(b, v, depth + 1) < 0)
                return -1;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "can not serialize %.100R object", (PyObject *)Py_TYPE(o));
    return -1;
}

/* A record's size, about and mostly over, so that its buffer is not grown (each growth copies
 * what was packed): a list's lists of keys or ints, by their first item. Only a hint. */
static Py_ssize_t pack_estimate(PyObject *o)
{
    Py_ssize_t size = 4096;
    if (!PyList_Check(o) && !PyTuple_Check(o))
        return size;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject *const *items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = items[i];
        if (!PyList_Check(c) || PyList_GET_SIZE(c) == 0)
            continue;
        PyObject *first = PyList_GET_ITEM(c, 0);
        Py_ssize_t each = PyUnicode_Check(first) ? PyUnicode_GET_LENGTH(first) + 5 : 9;
        if (PyList_GET_SIZE(c) > (PY_SSIZE_T_MAX / 4 - size) / each)
            return 4096; /* (absurd: left to growth) */
        size += PyList_GET_SIZE(c) * each;
    }
    return size;
}

static PyObject *pack_record(PyObject *module, PyObject *arg)
{
    PackBuf b = {NULL, NULL, 0, pack_estimate(arg)};
    if ((b.bytes = PyBytes_FromStringAndSize(NULL, b.cap)) == NULL)
        return NULL;
    b.p = PyBytes_AS_STRING(b.bytes);
    if (pack_obj(&b, arg, 0) < 0 || _PyBytes_Resize(&b.bytes, b.len) < 0) {
        Py_XDECREF(b.bytes);
        return NULL;
    }
    return b.bytes;
}

/* KeyIndex.pack_rows() -> bytes: the snapshot's "keys" array, as `pack_record` packs the list
 * `persistence.snapshot` builds of it: [key, region_id, offset, length, checksum] for a key with
 * a checksum, [key, region_id, offset, length] for one without, oldest first (the order of
 * `items()`). At 10^6 keys the list of lists was a second on the server's loop; this is one
 * pass over `entries` that makes no Python object but the bytes. No Python code runs meanwhile
 * (the buffer's growth allocates no GC object), so the index cannot change under the pass. */
static PyObject *KeyIndex_pack_rows(KeyIndex *self, PyObject *unused)
{
    /* a row's size, about and mostly over (each growth copies what was packed): the oldest
     * key's length, its header, three ints and a checksum. Only a hint. */
    Py_ssize_t each = 32;
    if (self->head < self->used && self->entries[self->head].key != NULL) {
        PyObject *first = self->entries[self->head].key;
        each += PyUnicode_Check(first) ? PyUnicode_GET_LENGTH(first) : PyBytes_GET_SIZE(first);
    }
    if (self->live > (PY_SSIZE_T_MAX / 2 - 16) / each)
        each = 1;
    PackBuf b = {NULL, NULL, 0, 16 + self->live * each};
    if ((b.bytes = PyBytes_FromStringAndSize(NULL, b.cap)) == NULL)
        return NULL;
    b.p = PyBytes_AS_STRING(b.bytes);
    if (pack_len(&b, self->live, 0x90, 16, 0, 0xdc, 0xdd) < 0)
        goto fail;
    Py_ssize_t rows = 0;
    for (Py_ssize_t i = self->head; i < self->used; i++) {
        if (i + 8 < self->used) { /* the key and entry of a later row: scattered in the heap */
            PREFETCH(self->entries[i + 8].key);
            PREFETCH(self->entries[i + 8].value);
        }
        Entry *slot = &self->entries[i];
        if (slot->key == NULL)
            continue;
        KeyEntry *e = (KeyEntry *)slot->value;
        if (pack_head(&b, e->checksum ? 0x95 : 0x94, 0, 0) < 0 || pack_obj(&b, slot->key, 1) < 0 ||
            pack_ll(&b, e->region_id) < 0 || pack_ll(&b, e->offset) < 0 ||
            pack_ll(&b, e->length) < 0 || (e->checksum && pack_ll(&b, e->checksum) < 0))
            goto fail;
        rows++;
    }
    if (rows != self->live) { /* (cannot happen: `live` counts the entries with a key) */
        PyErr_SetString(PyExc_RuntimeError, "KeyIndex.pack_rows: live count mismatch");
        goto fail;
    }
    if (_PyBytes_Resize(&b.bytes, b.len) < 0)
        return NULL;
    return b.bytes;
fail:
    Py_XDECREF(b.bytes);
    return NULL;
}

/* KeyIndex.pinned() -> [(key, pins), ...]: the keys with pins, oldest first. A snapshot's pins
 * held by no instance are found among them (`Pins.records`): a Python pass over
 * `items()` to find them was a fifth of a second at 10^6 keys. */
static PyObject *KeyIndex_pinned(KeyIndex *self, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    uint64_t version = self->version;
    for (Py_ssize_t i = self->head; i < self->used; i++) {
        if (i + 8 < self->used)
            PREFETCH(self->entries[i + 8].value);
        Entry *slot = &self->entries[i];
        if (slot->key == NULL || ((KeyEntry *)slot->value)->pins <= 0)
            continue;
        PyObject *pair = Py_BuildValue("(On)", slot->key, ((KeyEntry *)slot->value)->pins);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
        if (self->version != version) { /* (an allocation ran code that changed the index) */
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "KeyIndex changed during pinned()");
            return NULL;
        }
    }
    return out;
}

/* crc32(data, value=0) -> int: zlib.crc32(data, value) (maru/common/crc32.h), for the journal's
 * frames. `data`: any C-contiguous buffer; the GIL is kept (a record is tens of KiB). */
static PyObject *crc32_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long value = 0;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32(data, value=0)");
        return NULL;
    }
    if (nargs == 2) {
        value = PyLong_AsUnsignedLongMask(args[1]);
        if (value == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint32_t crc = maru_crc32((uint32_t)value, (const unsigned char *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* _crc32_path(clmul) -> the path crc32 takes from now on (tests: both are checked against zlib;
 * clmul=True where the CPU lacks PCLMULQDQ keeps the table). */
static PyObject *crc32_path(PyObject *module, PyObject *arg)
{
    int want = PyObject_IsTrue(arg);
    if (want < 0)
        return NULL;
#ifdef MARU_CRC32_CLMUL
    maru_crc32_use_clmul = want && __builtin_cpu_supports("pclmul");
#endif
    return PyBool_FromLong(maru_crc32_clmul());
}

static PyMethodDef module_methods[] = {
    {"crc32", (PyCFunction)(void (*)(void))crc32_of, METH_FASTCALL,
     "crc32(data, value=0) -> int: zlib.crc32(data, value), folded with PCLMULQDQ where the\n"
     "CPU has it (the journal's frames)."},
    {"_crc32_path", crc32_path, METH_O,
     "_crc32_path(clmul) -> bool: use the folding path (if the CPU has it) or the table path;\n"
     "returns whether folding is used. For tests."},
    {"entry_locations", entry_locations, METH_O,
     "entry_locations(entries) -> (region_ids, lengths, notices): see Registry._drop_keys."},
    {"batch_fits", (PyCFunction)(void (*)(void))batch_fits, METH_FASTCALL,
     "batch_fits(keys, max_chars, region_ids, offsets, lengths, limits) -> bool: whether a\n"
     "REGISTER_KV batch takes the registry's bulk path: at least one key, every key exactly\n"
     "str or bytes of 1..max_chars characters, every number an int, every value non-empty\n"
     "and inside its region (0 <= offset, offset + length <= limits[region id]). False only\n"
     "means: decide key by key."},
    {"length_groups", (PyCFunction)(void (*)(void))length_groups, METH_FASTCALL,
     "length_groups(region_ids, lengths) -> {region id: {length: keys}}, regions in the order\n"
     "of their last key (that in which dropping the keys one by one finishes with each)."},
    {"pack_record", pack_record, METH_O,
     "pack_record(obj) -> bytes: msgpack.packb(obj, use_bin_type=True), for the types of a\n"
     "journal record or snapshot (None, bool, int, float, str, bytes, list, tuple, dict);\n"
     "OverflowError for an int outside int64/uint64, TypeError for any other type."},
    {"release_entries", release_entries, METH_O,
     "release_entries(entries): end one lease on each KeyEntry (never below zero)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef keyindex_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "maru.server._keyindex",
    .m_doc = "The registry's key index (see KeyIndex) and its entries (KeyEntry).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__keyindex(void)
{
    if (PyType_Ready(&KeyIndexIterType) < 0)
        return NULL;
    maru_crc32_init();
    PyObject *m = PyModule_Create(&keyindex_module);
    if (m != NULL && (PyModule_AddType(m, &KeyIndexType) < 0 ||
                      PyModule_AddType(m, &KeyEntryType) < 0))
        Py_CLEAR(m);
    return m;
}
