/* maru.common._shmindex: the shared-memory key index a server publishes for readers on its node
 * (issue 17, part 1; docs/architecture.md "The local index").
 *
 * The server alone writes the table (`Writer`); clients on its node map it read-only and find
 * a key's location without a request (`Reader`). Every field is little-endian u64/i64, 8-byte
 * aligned. This comment is the one description of the layout (LAYOUT_VERSION below):
 *
 *   header, HEADER_BYTES (one 4 KiB page), at these byte offsets:
 *     0    magic           "MARUIDX1"
 *     8    layout version  LAYOUT_VERSION
 *     16   capacity        slots, a power of two
 *     24   slot size       SLOT_BYTES
 *     32   max key bytes   MAX_KEY (longer keys are never published: the request path has them)
 *     40   pool generation the pool's generation string hashed (`hash_bytes`, seed 0)
 *     48   retired         0 while current; set (release) when the table is replaced or the
 *                          server stops: a reader's copy that ends after it is not proven
 *     56   key count       live slots
 *     64   index id        random; also the seed of the key hash
 *     72   header bytes    HEADER_BYTES
 *     80   incomplete      0 while every publishable key registered is in the table; 1 once
 *                          a key found no room (a table of fixed capacity, in the pool: a
 *                          reader then asks the server for its misses, never takes them as
 *                          final)
 *     88   regions         the id the server's next region gets (ids only grow): a reader
 *                          whose instance maps every region (`maru_eager_map`) maps the new
 *                          ones when it sees this pass what it has seen, not a heartbeat later
 *     128  successor       NUL-terminated path (at most SUCCESSOR_MAX - 1 bytes) of the table
 *                          that replaced this one (a grown table), "" if unknown
 *   magic, layout version and retired keep these offsets in every layout version: a server
 *   of another version retires a table by them alone (maru.server.localindex._retire_header).
 *   slots from HEADER_BYTES on, SLOT_BYTES each:
 *     0    seq             even: stable; odd: being written (a seqlock per slot). Only grows.
 *     8    hash            hash_bytes(key, seed = index id) with the key's kind mixed in
 *     16   meta            state (bits 0-7: 0 empty, 1 live), kind (bits 8-15: 1 str as
 *                          UTF-8, 2 bytes), key length in bytes (bits 16-31)
 *     24   region id, 32 offset, 40 length, 48 checksum (the writer's, 0: none),
 *     56   region tag      the first 8 bytes of the region's token (which signs its pool path,
 *                          offset, length and the pool's generation): a reader uses a location
 *                          only through a mapping whose handle has the same tag
 *     64   key bytes, MAX_KEY of them
 *   the hash column after the slots (at HEADER_BYTES + capacity * SLOT_BYTES), HASH_BYTES per
 *   slot: slot i's hash while it is live, 0 while it is empty (no key hashes to 0). Written
 *   after the slot (a column entry never names a slot not yet written). `contains` reads this
 *   column alone, 8 bytes per slot where a slot is 192 (at 10^6 keys 16 MiB, the slots 384).
 *   use bits: a separate file, one byte per slot, that readers map read-write: a hit sets its
 *   slot's byte (CLOCK "referenced"); the server's eviction takes and clears them (`harvest`).
 *   Scribbling there changes eviction order only, never what a hit returns.
 *
 * Linear probing without tombstones: a deletion shifts later entries of its probe chain back
 * (each move is a seqlocked write of the new slot, then of the old one), so a reader that
 * races it can miss a key for a moment but never read a torn or foreign entry: it compares
 * the full key and re-reads `seq` after reading the slot. A hit stays proven only while the
 * slot's seq and the header's `retired` are unchanged: readers check both again after their
 * copy (`Reader.changed`). The server removes a key's slot before the key's pages can be
 * reused, so an unchanged slot proves the copy read the key's bytes. A table formatted again
 * in place (the in-pool table at a server's next start) gets a new index id, and a reader's
 * validation checks the header's retired word, pool generation and index id (`table_current`):
 * a copy that straddles a format is never proven, whatever seq its slot has now.
 *
 * Software coherence (`software=True` on either side; hosts of a CXL pod whose caches do not
 * snoop each other, docs/architecture.md "Coherence"): the writer writes a slot's odd seq back
 * to memory (and fences) before it changes anything else of the slot, the slot's lines after
 * its fields, the even seq and the hash-column entry last, and the header's lines after each
 * change; a reader invalidates a slot's lines before it reads them, its seq line again before
 * it re-reads seq, the hash-column entry's line before `contains` reads it, and the header's
 * lines before every validation: what it takes as proven was read from memory. The use bytes
 * are neither written back nor invalidated: they order eviction only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "int64_buffer.h"
#include "cacheflush.h"
#include "faultguard.h"

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((const void *)(p))
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1)
#else
#define PREFETCH(p) ((void)(p))
#define PREFETCH_W(p) ((void)(p))
#endif

#define PUBLISH_WINDOW 16 /* keys of a publish whose cache misses overlap */
#define LAYOUT_VERSION 3
#define HEADER_BYTES 4096
#define SLOT_BYTES 192
#define HASH_BYTES 8 /* one hash-column entry */
#define MAX_KEY 128
#define SUCCESSOR_OFFSET 128
#define SUCCESSOR_MAX 1024
#define STATE_EMPTY 0
#define STATE_LIVE 1
#define KIND_STR 1
#define KIND_BYTES 2
#define SEQ_RETRIES 64 /* a slot seen mid-write this many times in a row: a miss */
#define GIL_FREE_FROM 256 /* batches at least this long probe without the GIL */
/* `call` without the GIL for a batch of at least GIL_FREE_FROM keys (a shorter one would pay
 * more for releasing and taking it back than it takes). */
#define GIL_FREE_FOR(n, call)                                                                     \
    do {                                                                                          \
        if ((n) >= GIL_FREE_FROM) {                                                               \
            Py_BEGIN_ALLOW_THREADS call;                                                          \
            Py_END_ALLOW_THREADS                                                                  \
        }                                                                                         \
        else {                                                                                    \
            call;                                                                                 \
        }                                                                                         \
    } while (0)
#define AHEAD 16        /* a batch is probed in groups of this many keys (see probe_all) */
#define HASH_GROUP 32  /* contains_all hashes this many keys, then probes them */
#define CHAIN_SLOTS 3   /* slots prefetched from a key's home: the table is at most half full */

static const char MAGIC_BYTES[8] = {'M', 'A', 'R', 'U', 'I', 'D', 'X', '1'};

typedef struct {
    uint64_t magic, version, capacity, slot_bytes, max_key, pool_generation, retired, count,
        index_id, header_bytes, incomplete, regions;
} Header;

typedef struct {
    uint64_t seq, hash, meta;
    int64_t region_id, offset, length, checksum, tag;
    unsigned char key[MAX_KEY];
} Slot;

_Static_assert(sizeof(Slot) == SLOT_BYTES, "slot layout");
_Static_assert(sizeof(Header) <= SUCCESSOR_OFFSET, "header layout");

/* -- the fault guard ------------------------------------------------------------------------
 * A reader's table may lie in the pool (`--index-slots`), a file another process can truncate
 * under it: every read of it (the header at open and at validation, probes, `contains`, the
 * use-byte marks, the validation after a copy) runs under `_memcopy.c`'s fault guard, reached
 * through its capsule (`faultguard.h`; taken when the first Reader is made). A fault is a
 * fault of that call: the batch asks the server (probe, read, contains, leading), its hits are
 * not proven (changed, read), the table counts as retired or incomplete (the getters); never
 * a hit, never a dead process. One sigsetjmp per call, not per key.
 *
 * The server's side is no safer by itself: with `--pool-group` the use bits are a 0660 file
 * and the in-pool table lies in a pool file the group maps read-write, so any member can
 * truncate either under it. Every access of a Writer (and `format_table`) to mapped memory
 * runs under the same guard, taken when the first Writer is made: a fault is
 * IndexFaultError, raised by the call that met it, whose batch may be half done (the server
 * then turns its index off: `maru.server.localindex`). The Python work of a batch (its keys'
 * bytes, its columns) is done before the guard goes on: nothing inside allocates or calls
 * Python. */

#define FAULTED (-1000) /* `guarded`'s answer when `fn` faulted */
static const MaruFaultGuard *fault_guard; /* NULL until a Reader, Writer or format is made */
static PyObject *IndexFaultError;         /* maru.common._shmindex.IndexFaultError (an OSError) */

/* `fn(arg)` under the fault guard (directly where none was taken): its answer, or FAULTED.
 * `fn` reads and writes the table only: it allocates nothing and calls no Python. */
static int guarded(int (*fn)(void *), void *arg)
{
    const MaruFaultGuard *guard = fault_guard;
    if (guard == NULL)
        return fn(arg);
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0))
        return FAULTED;
    guard->on(&jump);
    int rc = fn(arg);
    guard->off();
    return rc;
}

/* The guard from `maru.common._memcopy` (once): 0, or -1 with the import's error. The module
 * is imported first: PyCapsule_Import only looks up the attributes after the top package,
 * and maru-server loads nothing else of the copy engine (`maru.common.memcopy` needs numpy). */
static int fault_guard_take(void)
{
    if (fault_guard == NULL) {
        PyObject *module = PyImport_ImportModule("maru.common._memcopy");
        if (module == NULL)
            return -1;
        Py_DECREF(module);
        fault_guard = PyCapsule_Import(MARU_FAULT_GUARD, 0);
    }
    return fault_guard != NULL ? 0 : -1;
}

/* Raise IndexFaultError (errno EFAULT) for the writer's `what`, which faulted. NULL. */
static PyObject *writer_fault(const char *what)
{
    PyObject *args = Py_BuildValue("(is)", EFAULT, what);
    if (args != NULL)
        PyErr_SetObject(IndexFaultError, args);
    Py_XDECREF(args);
    return NULL;
}

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* The u64 at `p` (the header's: `count`, a reader's pool generation), read guarded:
 * `guarded` answers 0, or FAULTED. */
typedef struct {
    const uint64_t *p;
    uint64_t value;
} Load;

static int load_run(void *arg)
{
    Load *l = arg;
    l->value = LOAD_ACQ(l->p);
    return 0;
}

/* -- the key hash (any process, any build: a pure function of the bytes and the seed) ---- */

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t fmix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* The last 1-7 bytes of a key as the low bytes of a word (the value `memcpy(&w, p, t)` gives a
 * zeroed little-endian w), read in fixed-size loads: a memcpy of a variable length is a libc
 * call whose byte stores the next load cannot take straight from the store buffer, which made
 * a 128-key batch of 81-byte keys (SGLang's namespaced page hashes) half as slow to hash
 * (12.2 ns a key against 8.4 in a group of 32; 17-byte keys 10.6 against 3.8). */
static inline uint64_t tail_word(const unsigned char *p, size_t t)
{
    uint64_t w = 0;
    size_t at = 0;
    if (t >= 4) {
        uint32_t x;
        memcpy(&x, p, 4);
        w = x;
        at = 4;
    }
    if (t - at >= 2) {
        uint16_t x;
        memcpy(&x, p + at, 2);
        w |= (uint64_t)x << (8 * at);
        at += 2;
    }
    if (t > at)
        w |= (uint64_t)p[at] << (8 * at);
    return w;
}

#define HASH_M1 0x9e3779b97f4a7c15ULL
#define HASH_M2 0xbf58476d1ce4e5b9ULL

static inline uint64_t hash_step(uint64_t h, uint64_t w)
{
    return rotl(h ^ (w * HASH_M2), 29) * HASH_M1;
}

/* The hash of the bytes a[0:na] followed by b[0:nb], as if they were one string (the layout's
 * hash of a key is of its whole bytes: a reader's prefix and key are hashed where they lie,
 * never joined), in two steps: the state after a's whole words (`hash_words`: a batch's keys
 * with one prefix and one length share it, see key_hash), then the rest (`hash_rest`): the
 * word across the two (a's last na % 8 bytes, then b's first), b's words, and its last 1-7
 * bytes as a zero-extended word. */
static inline uint64_t hash_words(const unsigned char *a, size_t na, size_t total, uint64_t seed)
{
    uint64_t h = seed ^ (total * HASH_M1), w;
    for (size_t i = 0; i + 8 <= na; i += 8) {
        memcpy(&w, a + i, 8);
        h = hash_step(h, w);
    }
    return h;
}

static inline uint64_t hash_rest(uint64_t h, const unsigned char *a, size_t na,
                                 const unsigned char *b, size_t nb)
{
    size_t i = na & ~(size_t)7, j = 0;
    uint64_t w;
    if (i < na) {
        size_t t = na - i, take = nb < 8 - t ? nb : 8 - t;
        w = tail_word(a + i, t);
        if (take > 0)
            w |= tail_word(b, take) << (8 * t);
        h = hash_step(h, w);
        j = take;
    }
    for (; j + 8 <= nb; j += 8) {
        memcpy(&w, b + j, 8);
        h = hash_step(h, w);
    }
    if (j < nb)
        h = hash_step(h, tail_word(b + j, nb - j));
    return fmix(h);
}

static uint64_t hash_bytes(const unsigned char *p, size_t n, uint64_t seed)
{
    return hash_rest(hash_words(NULL, 0, n, seed), NULL, 0, p, n);
}

static inline uint64_t make_meta(int state, int kind, size_t len)
{
    return (uint64_t)state | ((uint64_t)kind << 8) | ((uint64_t)len << 16);
}

/* A key's bytes: str as UTF-8, bytes as they are, after a prefix of `pn` bytes at `pre` (a
 * reader's `prefix=`; none on the writer's side): the key is pre[0:pn] + p[0:n], never made
 * as one string. kind 0: not a key (another type). */
typedef struct {
    const unsigned char *pre, *p;
    Py_ssize_t pn, n;
    int kind;
} KeyBytes;

static inline size_t key_len(const KeyBytes *k)
{
    return (size_t)(k->pn + k->n);
}

/* The hash state after a prefix's whole words, for keys of one length and kind: the keys of a
 * batch share it (SGLang's: one namespace, 64-hex page hashes), so each key hashes only what
 * follows (`pre` NULL: nothing kept yet). */
typedef struct {
    const unsigned char *pre;
    Py_ssize_t pn;
    size_t len;
    uint64_t seed, h;
} PrefixState;

/* Never 0: the hash column's 0 means an empty slot. `kept` (may be NULL): the prefix state
 * of the keys before, reused when this key has the same prefix, length and kind. */
static inline uint64_t key_hash(const KeyBytes *k, uint64_t seed, PrefixState *kept)
{
    size_t len = key_len(k);
    uint64_t mid, kind_seed = seed + (uint64_t)k->kind;
    if (kept != NULL && kept->pre == k->pre && kept->pre != NULL && kept->pn == k->pn &&
        kept->len == len && kept->seed == kind_seed)
        mid = kept->h;
    else {
        mid = hash_words(k->pre, (size_t)k->pn, len, kind_seed);
        if (kept != NULL)
            *kept = (PrefixState){k->pre, k->pn, len, kind_seed, mid};
    }
    uint64_t h = hash_rest(mid, k->pre, (size_t)k->pn, k->p, (size_t)k->n);
    return h ? h : 1;
}

/* Whether a slot's key bytes (`key_len(k)` of them) are k's. */
static inline int key_equals(const unsigned char *stored, const KeyBytes *k)
{
    return (k->pn == 0 || memcmp(stored, k->pre, (size_t)k->pn) == 0) &&
           memcmp(stored + k->pn, k->p, (size_t)k->n) == 0;
}

/* Needs the GIL (a str's UTF-8 form may be made and cached on it). -1 with an error set only
 * on a failed encoding (a lone surrogate: not a key a client can store either). */
static int key_bytes(PyObject *key, KeyBytes *out)
{
    out->pre = NULL;
    out->pn = 0;
    if (PyUnicode_CheckExact(key)) {
        const char *s = PyUnicode_AsUTF8AndSize(key, &out->n);
        if (s == NULL)
            return -1;
        out->p = (const unsigned char *)s;
        out->kind = KIND_STR;
    }
    else if (PyBytes_CheckExact(key)) {
        out->p = (const unsigned char *)PyBytes_AS_STRING(key);
        out->n = PyBytes_GET_SIZE(key);
        out->kind = KIND_BYTES;
    }
    else {
        out->p = NULL;
        out->n = 0;
        out->kind = 0;
    }
    return 0;
}

/* -- a mapped table (both sides) ------------------------------------------------------------ */

typedef struct {
    Py_buffer table, use;
    Header *h;
    Slot *slots;
    uint64_t *hashes; /* the hash column */
    unsigned char *use_bits;
    uint64_t mask, seed;
    uint64_t gen;  /* the header's pool generation when opened */
    int software;  /* software coherence: flush as the layout comment says */
} Table;

/* Software coherence's flushes of a table's lines (no-ops unless `t->software`, which
 * `table_open` allows only where the CPU has the flushes). `tbl_write_back`: lines written
 * here go to memory (ordered by `tbl_sfence`); `tbl_drop`: lines about to be read are
 * invalidated (then `tbl_mfence` before the reads). */
static inline void tbl_write_back(const Table *t, const void *p, size_t n)
{
#if COH_X86
    if (t->software)
        coh_flush((const char *)p, n, coh_write_back_kind);
#else
    (void)t, (void)p, (void)n;
#endif
}

static inline void tbl_drop(const Table *t, const void *p, size_t n)
{
#if COH_X86
    if (t->software)
        coh_flush((const char *)p, n, coh_invalidate_kind);
#else
    (void)t, (void)p, (void)n;
#endif
}

static inline void tbl_sfence(const Table *t)
{
#if COH_X86
    if (t->software)
        _mm_sfence();
#else
    (void)t;
#endif
}

static inline void tbl_mfence(const Table *t)
{
#if COH_X86
    if (t->software)
        _mm_mfence();
#else
    (void)t;
#endif
}

/* Whether the table is still the one opened (not retired, not formatted again in place, of
 * the same pool generation): read from memory in software coherence. */
static inline int table_current(const Table *t)
{
    tbl_drop(t, t->h, 128);
    tbl_mfence(t);
    return LOAD_ACQ(&t->h->retired) == 0 && LOAD(&t->h->index_id) == t->seed &&
           LOAD(&t->h->pool_generation) == t->gen;
}

/* table_open's checks of a mapped table's header (`arg`: a TableOpen): `why` says what is
 * wrong, else the table's fields are set from the header. Run guarded: pool memory. */
typedef struct {
    Table *t;
    const char *why;
} TableOpen;

static int table_header(void *arg)
{
    TableOpen *o = arg;
    Table *t = o->t;
    uint64_t capacity = 0;
    if (t->table.len < HEADER_BYTES) {
        o->why = "shorter than its header";
        return 0;
    }
    /* software: the header as memory holds it, not as this CPU cached it before (a stale
     * capacity would place every probe wrong) */
    tbl_drop(t, t->h, 128);
    tbl_mfence(t);
    if (memcmp(t->table.buf, MAGIC_BYTES, 8) != 0)
        o->why = "not a Maru index (bad magic)";
    else if (LOAD(&t->h->version) != LAYOUT_VERSION)
        o->why = "of another layout version";
    else if (LOAD(&t->h->slot_bytes) != SLOT_BYTES || LOAD(&t->h->max_key) != MAX_KEY ||
             LOAD(&t->h->header_bytes) != HEADER_BYTES)
        o->why = "of another slot layout";
    else {
        capacity = LOAD(&t->h->capacity);
        if (capacity == 0 || (capacity & (capacity - 1)) != 0 ||
            (uint64_t)(t->table.len - HEADER_BYTES) / (SLOT_BYTES + HASH_BYTES) < capacity)
            o->why = "of a bad capacity";
        else if ((uint64_t)t->use.len < capacity)
            o->why = "with a use-bits file shorter than its capacity";
    }
    if (o->why != NULL)
        return 0;
    t->slots = (Slot *)((char *)t->table.buf + HEADER_BYTES);
    t->hashes = (uint64_t *)((char *)t->slots + capacity * SLOT_BYTES);
    t->use_bits = (unsigned char *)t->use.buf;
    t->mask = capacity - 1;
    t->seed = LOAD(&t->h->index_id);
    t->gen = LOAD(&t->h->pool_generation);
    return 0;
}

static int table_open(Table *t, PyObject *table_obj, PyObject *use_obj, int writable,
                      int software)
{
    if (software && coh_invalidate_kind == FLUSH_NONE) {
        PyErr_SetString(PyExc_ValueError, "software coherence needs cache-line flushes (clflush), "
                                          "which this CPU or build does not have");
        return -1;
    }
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(table_obj, &t->table, flags) < 0)
        return -1;
    if (PyObject_GetBuffer(use_obj, &t->use, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&t->table);
        return -1;
    }
    t->h = (Header *)t->table.buf;
    t->software = software;
    TableOpen o = {t, NULL};
    int faulted = guarded(table_header, &o) == FAULTED;
    if (faulted)
        o.why = "faulted (its file truncated, or out of room)";
    if (o.why != NULL) {
        PyBuffer_Release(&t->table);
        PyBuffer_Release(&t->use);
        t->h = NULL;
        /* (a writer's fault is IndexFaultError, as in its calls; a reader's, what it was) */
        PyErr_Format(faulted && writable ? IndexFaultError : PyExc_ValueError, "index table %s",
                     o.why);
        return -1;
    }
    return 0;
}

static void table_close(Table *t)
{
    if (t->h != NULL) {
        PyBuffer_Release(&t->table);
        PyBuffer_Release(&t->use);
        t->h = NULL;
    }
}

/* -- Writer: the server's side (one thread) -------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Table t;
} Writer;

/* format_table's writes (`arg`: a Format), guarded: the table may lie in the pool. */
typedef struct {
    Py_buffer *buf, *use; /* (use: NULL, or its bytes zeroed too) */
    uint64_t capacity, generation, index_id;
    int software;
} Format;

static int format_run(void *arg)
{
    const Format *f = arg;
    Header *h = (Header *)f->buf->buf;
    Table t = {.h = h, .software = f->software};
    size_t body = (size_t)f->capacity * (SLOT_BYTES + HASH_BYTES);
    STORE_REL(&h->retired, 1);
    tbl_write_back(&t, h, 128);
    tbl_sfence(&t);
    memset((char *)f->buf->buf + HEADER_BYTES, 0, body);
    if (f->use != NULL)
        memset(f->use->buf, 0, (size_t)f->use->len);
    memcpy(&h->magic, MAGIC_BYTES, 8);
    h->version = LAYOUT_VERSION;
    h->capacity = f->capacity;
    h->slot_bytes = SLOT_BYTES;
    h->max_key = MAX_KEY;
    h->pool_generation = f->generation;
    h->count = 0;
    h->index_id = f->index_id;
    h->header_bytes = HEADER_BYTES;
    h->incomplete = 0;
    h->regions = 0;
    memset((char *)h + SUCCESSOR_OFFSET, 0, SUCCESSOR_MAX);
    tbl_write_back(&t, f->buf->buf, HEADER_BYTES + body);
    tbl_sfence(&t);
    STORE_REL(&h->retired, 0);
    tbl_write_back(&t, h, 128);
    tbl_sfence(&t);
    return 0;
}

static PyObject *format_table(PyObject *module, PyObject *args)
{
    /* format_table(buffer, capacity, pool_generation: bytes, index_id, software=False,
     * use=None): an empty table: a table there before is retired first, its slots and hash
     * column zeroed (and `use`, its use bytes, if given), the header written, `retired`
     * cleared last (a reader of the earlier table finds it retired, then of another index
     * id: `table_current`); with `software` all of it written back to memory before
     * `retired` is cleared, and that after. Guarded: IndexFaultError if the memory faulted. */
    Py_buffer buf, use = {0};
    unsigned long long capacity, index_id;
    const char *gen;
    Py_ssize_t gen_len;
    int software = 0;
    PyObject *use_obj = Py_None;
    if (fault_guard_take() < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "w*Ky#K|pO:format_table", &buf, &capacity, &gen, &gen_len,
                          &index_id, &software, &use_obj))
        return NULL;
    if (use_obj != Py_None && PyObject_GetBuffer(use_obj, &use, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *out = NULL;
    if (software && coh_invalidate_kind == FLUSH_NONE) {
        PyErr_SetString(PyExc_ValueError, "format_table: no cache-line flushes for software");
        goto done;
    }
    if (capacity == 0 || (capacity & (capacity - 1)) ||
        (uint64_t)buf.len < HEADER_BYTES + capacity * (SLOT_BYTES + HASH_BYTES)) {
        PyErr_SetString(PyExc_ValueError, "format_table: capacity must be a power of two that fits");
        goto done;
    }
    Format f = {&buf, use_obj != Py_None ? &use : NULL, capacity,
                hash_bytes((const unsigned char *)gen, (size_t)gen_len, 0), index_id, software};
    if (guarded(format_run, &f) == FAULTED)
        writer_fault("index table faulted while formatted (its file truncated, or out of room)");
    else
        out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    if (use.obj != NULL)
        PyBuffer_Release(&use);
    return out;
}

/* Writer and Reader are both a Table behind an object head: one constructor and one
 * destructor serve both (`writable`: the server's side). */
static PyObject *table_object_new(PyTypeObject *type, PyObject *args, int writable)
{
    PyObject *table_obj, *use_obj;
    int software = 0;
    if (!PyArg_ParseTuple(args, "OO|p", &table_obj, &use_obj, &software))
        return NULL;
    Writer *self = (Writer *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (table_open(&self->t, table_obj, use_obj, writable, software) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void table_object_dealloc(Writer *self)
{
    table_close(&self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (fault_guard_take() < 0) /* (before the first access to the table: its header) */
        return NULL;
    return table_object_new(type, args, 1);
}

static int writer_ready(Writer *self)
{
    if (self->t.h == NULL) {
        PyErr_SetString(PyExc_ValueError, "index writer is closed");
        return 0;
    }
    return 1;
}

/* Write slot i's fields under its seqlock (odd while changing: readers retry or skip), then
 * its hash-column entry (`src`'s hash, 0 when emptied). */
static void slot_write(Table *t, uint64_t i, const Slot *src, uint64_t meta)
{
    Slot *s = &t->slots[i];
    uint64_t seq = s->seq; /* only this thread writes it */
    STORE(&s->seq, seq + 1);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    tbl_write_back(t, &s->seq, 8); /* (software: odd in memory before any field changes) */
    tbl_sfence(t);
    if (src != NULL) {
        STORE(&s->hash, src->hash);
        STORE(&s->region_id, src->region_id);
        STORE(&s->offset, src->offset);
        STORE(&s->length, src->length);
        STORE(&s->checksum, src->checksum);
        STORE(&s->tag, src->tag);
        size_t len = (size_t)(meta >> 16) & 0xffff;
        if (len > MAX_KEY) /* (a length read back from shared memory: at most a slot's) */
            len = MAX_KEY;
        memcpy(s->key, src->key, len);
    }
    STORE(&s->meta, meta);
    tbl_write_back(t, s, SLOT_BYTES);
    tbl_sfence(t);
    STORE_REL(&s->seq, seq + 2);
    STORE_REL(&t->hashes[i], src != NULL ? src->hash : 0);
    tbl_write_back(t, &s->seq, 8);
    tbl_write_back(t, &t->hashes[i], HASH_BYTES);
    tbl_sfence(t);
}

static inline int slot_matches(const Slot *s, uint64_t hash, uint64_t meta, const KeyBytes *k)
{
    return s->hash == hash && s->meta == meta && key_equals(s->key, k);
}

/* The slot holding the key (found = 1) or the empty slot ending its chain (found = 0). */
#define NO_SLOT UINT64_MAX /* writer_find: the key is not there and no slot is empty */
#define NO_EMPTY_SLOT (-1001) /* a guarded run's answer: a table with no empty slot */

static uint64_t writer_find(Table *t, const KeyBytes *k, uint64_t hash, int *found)
{
    uint64_t meta = make_meta(STATE_LIVE, k->kind, key_len(k));
    uint64_t i = hash & t->mask;
    /* At most one lap: the writer keeps the table half empty, but the in-pool table lies in
     * pool memory the group may write, and a table whose every slot was made live must not
     * hold the server in this loop. */
    for (uint64_t steps = 0; steps <= t->mask; steps++) {
        const Slot *s = &t->slots[i];
        if ((s->meta & 0xff) == STATE_EMPTY) {
            *found = 0;
            return i;
        }
        if (slot_matches(s, hash, meta, k)) {
            *found = 1;
            return i;
        }
        i = (i + 1) & t->mask;
    }
    *found = 0;
    return NO_SLOT;
}

static int64_t item_int64(PyObject *seq, Py_ssize_t i, int *err)
{
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred())
        *err = 1;
    return (int64_t)v;
}

/* Whether a key can be in the table (longer ones are never published: the request path
 * has them). */
static inline int publishable(const KeyBytes *k)
{
    return k->kind != 0 && key_len(k) > 0 && key_len(k) <= MAX_KEY;
}

/* The writer's first stage for keys[0:m] (m <= PUBLISH_WINDOW) of a gathered batch: each
 * key's hash, and its first slot, hash entry and use byte prefetched for writing, so that the
 * cache misses of the window's writes overlap. */
static void stage_window(const Table *t, const KeyBytes *ks, Py_ssize_t m, uint64_t *hashes)
{
    for (Py_ssize_t i = 0; i < m; i++) {
        if (!publishable(&ks[i]))
            continue;
        hashes[i] = key_hash(&ks[i], t->seed, NULL);
        uint64_t first = hashes[i] & t->mask;
        const char *slot = (const char *)&t->slots[first];
        PREFETCH_W(slot);
        PREFETCH_W(slot + 64);
        PREFETCH_W(slot + 128);
        PREFETCH_W(&t->hashes[first]);
        PREFETCH_W(&t->use_bits[first]);
    }
}

#define WRITE_CHUNK 4096 /* keys a writer gathers for one guarded call (a batch: mostly all) */
enum { F_REGION, F_OFFSET, F_LENGTH, F_CHECKSUM, F_TAG, NFIELDS };

/* A chunk of a publish or remove, gathered with the GIL (keys' bytes; publish: per key its
 * NFIELDS fields) for one guarded call (`publish_run`, `remove_run`). */
typedef struct {
    Table *t;
    const KeyBytes *keys;
    const int64_t *fields; /* (publish) */
    Py_ssize_t n;
    Py_ssize_t done; /* publish: keys not published; remove: keys removed */
} WriteRun;

/* keys[start:start + m] of `seq` into `ks` (GIL held). -1 with an error set. */
static int writer_gather(PyObject *seq, Py_ssize_t start, Py_ssize_t m, KeyBytes *ks)
{
    for (Py_ssize_t i = 0; i < m; i++)
        if (key_bytes(PySequence_Fast_GET_ITEM(seq, start + i), &ks[i]) < 0)
            return -1;
    return 0;
}

/* publish's writes of a gathered chunk, guarded (`arg`: a WriteRun). */
static int publish_run(void *arg)
{
    WriteRun *r = arg;
    Table *t = r->t;
    Slot src;
    uint64_t hashes[PUBLISH_WINDOW];
    for (Py_ssize_t start = 0; start < r->n; start += PUBLISH_WINDOW) {
        Py_ssize_t m = r->n - start < PUBLISH_WINDOW ? r->n - start : PUBLISH_WINDOW;
        stage_window(t, r->keys + start, m, hashes);
        for (Py_ssize_t w = 0; w < m; w++) {
            const KeyBytes *k = &r->keys[start + w];
            if (!publishable(k)) {
                r->done++;
                continue;
            }
            const int64_t *f = r->fields + NFIELDS * (start + w);
            src.region_id = f[F_REGION];
            src.offset = f[F_OFFSET];
            src.length = f[F_LENGTH];
            src.checksum = f[F_CHECKSUM];
            src.tag = f[F_TAG];
            src.hash = hashes[w];
            if (k->pn > 0)
                memcpy(src.key, k->pre, (size_t)k->pn);
            memcpy(src.key + k->pn, k->p, (size_t)k->n);
            int found;
            uint64_t slot = writer_find(t, k, src.hash, &found);
            if (slot == NO_SLOT)
                return NO_EMPTY_SLOT;
            slot_write(t, slot, &src, make_meta(STATE_LIVE, k->kind, key_len(k)));
            if (!found)
                STORE(&t->h->count, LOAD(&t->h->count) + 1);
            t->use_bits[slot] = 0;
        }
    }
    tbl_write_back(t, t->h, 128);
    tbl_sfence(t);
    return 0;
}

/* publish(keys, region_ids, offsets, lengths, checksums or None, tags: {region id: tag}) ->
 * how many keys were not published (too long, or not str/bytes). The caller keeps the table
 * at most half full (`count` + len(keys) <= capacity / 2, else it grows first).
 * IndexFaultError: the table faulted (the keys before the fault published, the rest not). */
static PyObject *Writer_publish(Writer *self, PyObject *args)
{
    PyObject *keys_o, *rids_o, *offs_o, *lens_o, *sums_o, *tags;
    if (!PyArg_ParseTuple(args, "OOOOOO!:publish", &keys_o, &rids_o, &offs_o, &lens_o, &sums_o,
                          &PyDict_Type, &tags))
        return NULL;
    if (!writer_ready(self))
        return NULL;
    PyObject *cols[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *objs[5] = {keys_o, rids_o, offs_o, lens_o, sums_o};
    PyObject *out = NULL;
    KeyBytes *ks = NULL;
    int64_t *fields = NULL;
    int ncols = sums_o == Py_None ? 4 : 5;
    for (int c = 0; c < ncols; c++)
        if ((cols[c] = PySequence_Fast(objs[c], "publish: columns must be sequences")) == NULL)
            goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(cols[0]);
    for (int c = 1; c < ncols; c++)
        if (PySequence_Fast_GET_SIZE(cols[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "publish: columns differ in length");
            goto done;
        }
    Table *t = &self->t;
    Load count = {&t->h->count, 0};
    if (guarded(load_run, &count) == FAULTED) {
        writer_fault("index table faulted in publish (its file truncated, or out of room)");
        goto done;
    }
    if (count.value + (uint64_t)n > (t->mask + 1) / 2) {
        PyErr_SetString(PyExc_OverflowError, "publish: the table would be over half full");
        goto done;
    }
    Py_ssize_t chunk = n < WRITE_CHUNK ? (n ? n : 1) : WRITE_CHUNK, skipped = 0;
    ks = PyMem_Malloc(sizeof(KeyBytes) * (size_t)chunk);
    fields = PyMem_Malloc(sizeof(int64_t) * NFIELDS * (size_t)chunk);
    if (ks == NULL || fields == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t start = 0; start < n; start += chunk) {
        Py_ssize_t m = n - start < chunk ? n - start : chunk;
        if (writer_gather(cols[0], start, m, ks) < 0)
            goto done;
        for (Py_ssize_t w = 0; w < m; w++) {
            Py_ssize_t i = start + w;
            if (!publishable(&ks[w]))
                continue;
            int64_t *f = fields + NFIELDS * w;
            int err = 0;
            f[F_REGION] = item_int64(cols[1], i, &err);
            f[F_OFFSET] = item_int64(cols[2], i, &err);
            f[F_LENGTH] = item_int64(cols[3], i, &err);
            f[F_CHECKSUM] = ncols == 5 ? item_int64(cols[4], i, &err) : 0;
            PyObject *tag = PyDict_GetItemWithError(tags, PySequence_Fast_GET_ITEM(cols[1], i));
            if (tag == NULL && !PyErr_Occurred())
                PyErr_SetString(PyExc_KeyError, "publish: no tag for a region");
            f[F_TAG] = tag == NULL ? 0 : (int64_t)PyLong_AsUnsignedLongLongMask(tag);
            if (err || PyErr_Occurred())
                goto done;
        }
        WriteRun r = {t, ks, fields, m, 0};
        int rc = guarded(publish_run, &r);
        if (rc == FAULTED || rc == NO_EMPTY_SLOT) {
            writer_fault(rc == FAULTED
                             ? "index table faulted in publish (its file truncated, or out of room)"
                             : "index table has no empty slot: its slots were overwritten");
            goto done;
        }
        skipped += r.done;
    }
    out = PyLong_FromSsize_t(skipped);
done:
    PyMem_Free(ks);
    PyMem_Free(fields);
    for (int c = 0; c < 5; c++)
        Py_XDECREF(cols[c]);
    return out;
}

/* Empty slot i, then move back the entries after it that may live there (backward-shift
 * deletion: no tombstones, so chains stay short under churn). */
static void writer_delete_at(Table *t, uint64_t i)
{
    uint64_t mask = t->mask;
    slot_write(t, i, NULL, make_meta(STATE_EMPTY, 0, 0));
    t->use_bits[i] = 0;
    uint64_t hole = i, j = i;
    for (uint64_t steps = 0; steps < mask; steps++) { /* (one lap at most: see writer_find) */
        j = (j + 1) & mask;
        Slot *s = &t->slots[j];
        if ((s->meta & 0xff) == STATE_EMPTY)
            return;
        uint64_t home = s->hash & mask;
        /* the entry at j may move to the hole unless its home lies in (hole, j] */
        if (((j - home) & mask) < ((j - hole) & mask))
            continue;
        Slot copy = *s;
        slot_write(t, hole, &copy, copy.meta);
        t->use_bits[hole] = t->use_bits[j];
        slot_write(t, j, NULL, make_meta(STATE_EMPTY, 0, 0));
        t->use_bits[j] = 0;
        hole = j;
    }
}

/* remove's writes of a gathered chunk, guarded (`arg`: a WriteRun). */
static int remove_run(void *arg)
{
    WriteRun *r = arg;
    Table *t = r->t;
    uint64_t hashes[PUBLISH_WINDOW];
    for (Py_ssize_t start = 0; start < r->n; start += PUBLISH_WINDOW) {
        Py_ssize_t m = r->n - start < PUBLISH_WINDOW ? r->n - start : PUBLISH_WINDOW;
        stage_window(t, r->keys + start, m, hashes);
        for (Py_ssize_t w = 0; w < m; w++) {
            const KeyBytes *k = &r->keys[start + w];
            if (!publishable(k))
                continue;
            int found;
            uint64_t slot = writer_find(t, k, hashes[w], &found);
            if (!found)
                continue;
            writer_delete_at(t, slot);
            STORE(&t->h->count, LOAD(&t->h->count) - 1);
            r->done++;
        }
    }
    tbl_write_back(t, t->h, 128);
    tbl_sfence(t);
    return 0;
}

/* remove(keys) -> how many were in the table. IndexFaultError: the table faulted (a key may
 * still be there: the caller must make the table unprovable before its pages are reused). */
static PyObject *Writer_remove(Writer *self, PyObject *arg)
{
    if (!writer_ready(self))
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "remove: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), removed = 0;
    Py_ssize_t chunk = n < WRITE_CHUNK ? (n ? n : 1) : WRITE_CHUNK;
    KeyBytes *ks = PyMem_Malloc(sizeof(KeyBytes) * (size_t)chunk);
    if (ks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t start = 0; start < n; start += chunk) {
        Py_ssize_t m = n - start < chunk ? n - start : chunk;
        if (writer_gather(seq, start, m, ks) < 0)
            goto done;
        WriteRun r = {&self->t, ks, NULL, m, 0};
        if (guarded(remove_run, &r) == FAULTED) {
            writer_fault("index table faulted in remove (its file truncated, or out of room)");
            goto done;
        }
        removed += r.done;
    }
    out = PyLong_FromSsize_t(removed);
done:
    PyMem_Free(ks);
    Py_DECREF(seq);
    return out;
}

/* A key as a slot holds it (`meta`: its kind and length). */
static PyObject *slot_key(uint64_t meta, const unsigned char *bytes)
{
    size_t len = (size_t)(meta >> 16) & 0xffff;
    int kind = (int)(meta >> 8) & 0xff;
    if (kind == KIND_STR)
        return PyUnicode_DecodeUTF8((const char *)bytes, (Py_ssize_t)len, "strict");
    return PyBytes_FromStringAndSize((const char *)bytes, (Py_ssize_t)len);
}

#define HARVEST_BATCH 256 /* keys a harvest copies out of the table per guarded call */

/* A harvest's walk over the use bytes from `next` on (`arg`): each marked byte cleared, its
 * live slot's key copied into `keys` (no Python under the guard), until the end or
 * HARVEST_BATCH keys: 1 if it stopped for room (`next`: where to go on), else 0. */
typedef struct {
    const Table *t;
    uint64_t next;
    int n;
    struct {
        uint64_t meta;
        unsigned char key[MAX_KEY];
    } keys[HARVEST_BATCH];
} Harvest;

static int harvest_run(void *arg)
{
    Harvest *hv = arg;
    const Table *t = hv->t;
    uint64_t capacity = t->mask + 1;
    volatile unsigned char *use = t->use_bits;
    hv->n = 0;
    for (uint64_t i = hv->next; i < capacity; i += 8) {
        uint64_t word;
        /* Mostly no mark at all: 64 bytes a step past the unmarked stretches (capacity is a
         * power of two >= 8, so a 64-byte step that fits is whole). */
        if ((i & 63) == 0 && i + 64 <= capacity) {
            uint64_t w[8], any = 0;
            memcpy(w, (const void *)(use + i), 64);
            for (int k = 0; k < 8; k++)
                any |= w[k];
            if (any == 0) {
                i += 56;
                continue;
            }
        }
        memcpy(&word, (const void *)(use + i), 8);
        if (word == 0)
            continue;
        for (uint64_t j = i; j < i + 8; j++) {
            if (!use[j])
                continue;
            if (hv->n == HARVEST_BATCH) { /* (this word again next time: its taken bytes are 0) */
                hv->next = i;
                return 1;
            }
            use[j] = 0;
            const Slot *s = &t->slots[j];
            uint64_t meta = s->meta, len = (meta >> 16) & 0xffff;
            if ((meta & 0xff) != STATE_LIVE)
                continue;
            if (len > MAX_KEY) /* (not a key of ours: at most what a slot holds) */
                len = MAX_KEY;
            hv->keys[hv->n].meta = (meta & 0xffff) | (len << 16);
            memcpy(hv->keys[hv->n].key, s->key, (size_t)len);
            hv->n++;
        }
    }
    hv->next = capacity;
    return 0;
}

/* harvest() -> the keys whose use byte readers set since the last harvest (bytes cleared).
 * IndexFaultError: the table faulted (the marks taken so far are lost: eviction order only). */
static PyObject *Writer_harvest(Writer *self, PyObject *unused)
{
    if (!writer_ready(self))
        return NULL;
    Harvest *hv = PyMem_Malloc(sizeof(Harvest));
    PyObject *out = PyList_New(0);
    if (hv == NULL || out == NULL) {
        PyMem_Free(hv);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    hv->t = &self->t;
    hv->next = 0;
    int more;
    do {
        more = guarded(harvest_run, hv);
        if (more == FAULTED) {
            writer_fault("index use bytes faulted in harvest (the file truncated, or out of room)");
            goto fail;
        }
        for (int k = 0; k < hv->n; k++) {
            PyObject *key = slot_key(hv->keys[k].meta, hv->keys[k].key);
            if (key == NULL || PyList_Append(out, key) < 0) {
                Py_XDECREF(key);
                goto fail;
            }
            Py_DECREF(key);
        }
    } while (more);
    PyMem_Free(hv);
    return out;
fail:
    PyMem_Free(hv);
    Py_DECREF(out);
    return NULL;
}

/* copy_into's walk (`arg`: the two tables), guarded: 0, or 1 if `b` is too small. */
typedef struct {
    Table *a, *b;
} CopyInto;

static int copy_into_run(void *arg)
{
    Table *a = ((CopyInto *)arg)->a, *b = ((CopyInto *)arg)->b;
    if (LOAD(&b->h->count) + LOAD(&a->h->count) > (b->mask + 1) / 2)
        return 1;
    for (uint64_t i = 0; i <= a->mask; i++) {
        const Slot *s = &a->slots[i];
        if ((s->meta & 0xff) != STATE_LIVE)
            continue;
        Slot src = *s;
        if (((src.meta >> 16) & 0xffff) > MAX_KEY) /* (not a key of ours: left behind) */
            continue;
        KeyBytes k = {.p = src.key, .n = (Py_ssize_t)((src.meta >> 16) & 0xffff),
                      .kind = (int)(src.meta >> 8) & 0xff};
        src.hash = key_hash(&k, b->seed, NULL);
        int found;
        uint64_t slot = writer_find(b, &k, src.hash, &found);
        if (slot == NO_SLOT)
            return 1;
        slot_write(b, slot, &src, src.meta);
        b->use_bits[slot] = a->use_bits[i];
        if (!found)
            STORE(&b->h->count, LOAD(&b->h->count) + 1);
    }
    return 0;
}

/* copy_into(other): every live entry into `other` (a bigger, empty table), use bits too.
 * IndexFaultError: either table faulted (`other` then half filled). */
static PyObject *Writer_copy_into(Writer *self, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, Py_TYPE(self))) {
        PyErr_SetString(PyExc_TypeError, "copy_into: expected a Writer");
        return NULL;
    }
    Writer *other = (Writer *)arg;
    if (!writer_ready(self) || !writer_ready(other))
        return NULL;
    CopyInto c = {&self->t, &other->t};
    int rc = guarded(copy_into_run, &c);
    if (rc == FAULTED)
        return writer_fault("index table faulted in copy_into (a file truncated, or out of room)");
    if (rc == 1) {
        PyErr_SetString(PyExc_OverflowError, "copy_into: the other table is too small");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* retire's writes (`arg`: a Retire), guarded. */
typedef struct {
    const Table *t;
    const char *path;
    Py_ssize_t n;
} Retire;

static int retire_run(void *arg)
{
    const Retire *r = arg;
    const Table *t = r->t;
    char *field = (char *)t->h + SUCCESSOR_OFFSET;
    memcpy(field, r->path, (size_t)r->n);
    field[r->n] = 0;
    tbl_write_back(t, field, (size_t)r->n + 1);
    tbl_sfence(t);
    STORE_REL(&t->h->retired, 1);
    tbl_write_back(t, t->h, 128);
    tbl_sfence(t);
    return 0;
}

/* retire(successor: str): the table is replaced (`successor`: the new table's path, "" if
 * none): written before `retired`, which readers check after every copy. IndexFaultError:
 * the header faulted (not retired: readers of it fault too, or read another index id). */
static PyObject *Writer_retire(Writer *self, PyObject *arg)
{
    if (!writer_ready(self))
        return NULL;
    Py_ssize_t n;
    const char *path = PyUnicode_AsUTF8AndSize(arg, &n);
    if (path == NULL)
        return NULL;
    if (n >= SUCCESSOR_MAX) {
        PyErr_SetString(PyExc_ValueError, "retire: successor path too long");
        return NULL;
    }
    Retire r = {&self->t, path, n};
    if (guarded(retire_run, &r) == FAULTED)
        return writer_fault("index table faulted in retire (its file truncated, or out of room)");
    Py_RETURN_NONE;
}

/* A header word set (`arg`: a HeaderStore), guarded: `incomplete`, `regions`. */
typedef struct {
    const Table *t;
    uint64_t *p;
    uint64_t value;
} HeaderStore;

static int header_store_run(void *arg)
{
    const HeaderStore *w = arg;
    STORE_REL(w->p, w->value);
    tbl_write_back(w->t, w->t->h, 128);
    tbl_sfence(w->t);
    return 0;
}

/* mark_incomplete(): a key found no room (a table of fixed capacity): from now on a reader's
 * miss is not final, it asks the server (see the layout). */
static PyObject *Writer_mark_incomplete(Writer *self, PyObject *unused)
{
    if (!writer_ready(self))
        return NULL;
    HeaderStore w = {&self->t, &self->t.h->incomplete, 1};
    if (guarded(header_store_run, &w) == FAULTED)
        return writer_fault("index table faulted in mark_incomplete (its file truncated?)");
    Py_RETURN_NONE;
}

/* note_regions(next_id): the id the next region gets (see the layout's `regions`). */
static PyObject *Writer_note_regions(Writer *self, PyObject *arg)
{
    unsigned long long next_id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !writer_ready(self))
        return NULL;
    HeaderStore w = {&self->t, &self->t.h->regions, (uint64_t)next_id};
    if (guarded(header_store_run, &w) == FAULTED)
        return writer_fault("index table faulted in note_regions (its file truncated?)");
    Py_RETURN_NONE;
}

static PyObject *Writer_close(Writer *self, PyObject *unused)
{
    table_close(&self->t);
    Py_RETURN_NONE;
}

/* `count` and `capacity` of either side (0 once a writer is closed). */
static PyObject *table_get_count(Writer *self, void *c)
{
    Load l = {self->t.h ? &self->t.h->count : NULL, 0};
    if (l.p != NULL && guarded(load_run, &l) == FAULTED)
        l.value = 0; /* (a reader's table truncated under it) */
    return PyLong_FromUnsignedLongLong(l.value);
}

static PyObject *table_get_capacity(Writer *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->t.h ? self->t.mask + 1 : 0);
}

static PyMethodDef Writer_methods[] = {
    {"publish", (PyCFunction)Writer_publish, METH_VARARGS,
     "publish(keys, region_ids, offsets, lengths, checksums|None, tags) -> keys not published"},
    {"remove", (PyCFunction)Writer_remove, METH_O, "remove(keys) -> how many were there"},
    {"harvest", (PyCFunction)Writer_harvest, METH_NOARGS,
     "harvest() -> keys readers marked used since the last harvest (marks cleared)"},
    {"copy_into", (PyCFunction)Writer_copy_into, METH_O, "copy_into(writer): grow into it"},
    {"retire", (PyCFunction)Writer_retire, METH_O, "retire(successor_path)"},
    {"mark_incomplete", (PyCFunction)Writer_mark_incomplete, METH_NOARGS,
     "a key found no room: readers ask the server for their misses from now on"},
    {"note_regions", (PyCFunction)Writer_note_regions, METH_O,
     "note_regions(next_id): the id the server's next region gets"},
    {"close", (PyCFunction)Writer_close, METH_NOARGS, "release the buffers"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Writer_getset[] = {
    {"count", (getter)table_get_count, NULL, "keys in the table", NULL},
    {"capacity", (getter)table_get_capacity, NULL, "slots", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.common._shmindex.Writer",
    .tp_doc = "Writer(table_buffer, use_buffer, software=False): the server's side of a table.",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Writer_new,
    .tp_dealloc = (destructor)table_object_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

/* -- Reader: a client's side ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Table t;
} Reader;

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (fault_guard_take() < 0) /* (before the first read of the table) */
        return NULL;
    return table_object_new(type, args, 0);
}

enum { COL_ADDRESS, COL_LENGTH, COL_CHECKSUM, COL_REGION, COL_OFFSET, COL_SLOT, COL_SEQ, NCOLS };
enum { ROW_ID, ROW_BASE, ROW_LENGTH, ROW_TAG, ROW_FIELDS };

/* A live slot's fields as one probe read them. */
typedef struct {
    int64_t region, offset, length, checksum, tag;
    uint64_t slot, seq;
} Entry;

/* Start loading what probing a key whose home is `hash`'s slot reads: the first CHAIN_SLOTS
 * slots of its chain (three cache lines each; at most half full, linear probing finds nearly
 * every key there) and its use byte. */
static inline void prefetch_chain(const Table *t, uint64_t hash)
{
    uint64_t home = hash & t->mask;
    for (uint64_t k = 0; k < CHAIN_SLOTS; k++) {
        const char *s = (const char *)&t->slots[(home + k) & t->mask];
        PREFETCH(s);
        PREFETCH(s + 64);
        PREFETCH(s + 128);
    }
    PREFETCH(t->use_bits + home);
}

/* Probe one key: 1 hit (its entry in *e), 0 miss. Never a torn entry: a slot is used only if
 * its seq was even and unchanged across the reads of its fields and key. */
static int probe_one(const Table *t, const KeyBytes *k, uint64_t hash, Entry *e)
{
    uint64_t want = make_meta(STATE_LIVE, k->kind, key_len(k));
    uint64_t i = hash & t->mask;
    for (uint64_t steps = 0; steps <= t->mask; steps++, i = (i + 1) & t->mask) {
        const Slot *s = &t->slots[i];
        for (int tries = 0;; tries++) {
            if (tries == SEQ_RETRIES)
                return 0;
            tbl_drop(t, s, SLOT_BYTES); /* (software: the slot's lines from memory) */
            tbl_mfence(t);
            uint64_t seq = LOAD_ACQ(&s->seq);
            if (seq & 1)
                continue;
            uint64_t meta = LOAD(&s->meta);
            if ((meta & 0xff) == STATE_EMPTY) {
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                tbl_drop(t, &s->seq, 8);
                tbl_mfence(t);
                if (LOAD(&s->seq) != seq)
                    continue;
                return 0; /* the end of the chain */
            }
            if (meta != want || LOAD(&s->hash) != hash)
                break; /* another key: next slot */
            e->region = LOAD(&s->region_id);
            e->offset = LOAD(&s->offset);
            e->length = LOAD(&s->length);
            e->checksum = LOAD(&s->checksum);
            e->tag = LOAD(&s->tag);
            int same = key_equals((const unsigned char *)s->key, k);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            tbl_drop(t, &s->seq, 8);
            tbl_mfence(t);
            if (LOAD(&s->seq) != seq)
                continue; /* changed while read: again */
            if (!same)
                break;
            e->slot = i;
            e->seq = seq;
            return 1;
        }
    }
    return 0;
}

/* CLOCK: the slot was referenced (written only when clear: no line ping-pong). */
static inline void mark_used(const Table *t, uint64_t slot)
{
    volatile unsigned char *use = t->use_bits + slot;
    if (!*use)
        *use = 1;
}

/* The regions mapped in the reader's process: rows of ROW_FIELDS int64 (region id, base
 * address, length, tag), sorted by region id. */
typedef struct {
    const int64_t *rows;
    Py_ssize_t n;
} Regions;

static const int64_t *region_row(const Regions *r, int64_t id)
{
    Py_ssize_t lo = 0, hi = r->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        const int64_t *row = r->rows + mid * ROW_FIELDS;
        if (row[ROW_ID] == id)
            return row;
        if (row[ROW_ID] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Whether a key may be registered and not in the table (the header's `incomplete`). */
static inline int table_incomplete(const Table *t)
{
    tbl_drop(t, &t->h->incomplete, 8);
    tbl_mfence(t);
    return LOAD_ACQ(&t->h->incomplete) != 0;
}

/* Probe keys[0:n] (a read's probe: the full key compared). `cols` (stride n): per key its
 * address in this process and the columns of the entry (misses: 0, slot -1): each hit's
 * location goes through `regions`; one outside its region is a miss (never a read past
 * a mapping), and one in a region not mapped here or mapped from another pool life (its tag
 * differs) ends the probe: 1, the batch must go the request way (which maps the region).
 * Else 0 (-1: no memory). Each hit's use byte is set. A fault reading the table: 1.
 * At 10^6 keys nearly every probe misses the caches (and the TLB), and half the keys are not
 * in their home slot: the keys are hashed first, then probed in groups of AHEAD, the chains of
 * the next group prefetched (in a short loop, so that many misses are in flight at once)
 * before this group is probed. Measured here: 57 ns per key instead of 85 with the home slot
 * alone prefetched a key at a time; 10^3 keys: 22-23 ns either way. */
typedef struct {
    const Table *t;
    const KeyBytes *keys;
    Py_ssize_t n;
    const Regions *regions;
    int64_t *cols;
    uint64_t *hashes; /* n of them, filled here */
} Probe;

static int probe_run(void *arg);

static int probe_all(const Table *t, const KeyBytes *keys, Py_ssize_t n, const Regions *regions,
                     int64_t *cols)
{
    Probe p = {t, keys, n, regions, cols, PyMem_RawMalloc(sizeof(uint64_t) * (size_t)(n ? n : 1))};
    if (p.hashes == NULL)
        return -1;
    int rc = guarded(probe_run, &p);
    PyMem_RawFree(p.hashes);
    return rc == FAULTED ? 1 : rc; /* (a fault: the server answers the batch) */
}

/* probe_all's work, guarded (`arg`: a Probe). */
static int probe_run(void *arg)
{
    const Probe *p = arg;
    const Table *t = p->t;
    const KeyBytes *keys = p->keys;
    Py_ssize_t n = p->n;
    const Regions *regions = p->regions;
    int64_t *cols = p->cols;
    uint64_t *hashes = p->hashes;
    PrefixState kept = {0};
    for (Py_ssize_t i = 0; i < n; i++)
        hashes[i] = key_hash(&keys[i], t->seed, &kept);
    for (Py_ssize_t j = 0; j < n && j < AHEAD; j++)
        prefetch_chain(t, hashes[j]);
    const int64_t *row = NULL; /* the last hit's region: a batch's keys share few */
    int rc = 0, missed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % AHEAD == 0) /* the next group's chains, while this one is probed */
            for (Py_ssize_t j = i + AHEAD; j < n && j < i + 2 * AHEAD; j++)
                prefetch_chain(t, hashes[j]);
        Entry e;
        int hit = probe_one(t, &keys[i], hashes[i], &e);
        if (hit) {
            if (row == NULL || row[ROW_ID] != e.region)
                row = region_row(regions, e.region);
            if (row == NULL || row[ROW_TAG] != e.tag) {
                rc = 1;
                break;
            }
            hit = e.offset >= 0 && e.length > 0 && e.offset <= row[ROW_LENGTH] - e.length;
        }
        if (hit)
            mark_used(t, e.slot);
        missed |= !hit;
        cols[COL_ADDRESS * n + i] = hit ? row[ROW_BASE] + e.offset : 0;
        cols[COL_LENGTH * n + i] = hit ? e.length : 0;
        cols[COL_CHECKSUM * n + i] = hit ? e.checksum : 0;
        cols[COL_REGION * n + i] = hit ? e.region : 0;
        cols[COL_OFFSET * n + i] = hit ? e.offset : 0;
        cols[COL_SLOT * n + i] = hit ? (int64_t)e.slot : -1;
        cols[COL_SEQ * n + i] = hit ? (int64_t)e.seq : 0;
    }
    if (rc == 0 && missed && table_incomplete(t))
        rc = 1; /* a miss may be a key that found no room: the server has it */
    return rc;
}

/* Whether each of keys[0:n] is in the table (hits[i] 1 or 0; each hit's use byte set), from
 * the hash column alone: a key is there when its chain holds its hash before an empty entry.
 * Only the column is read (8 bytes a slot: one cache line per key where a slot takes
 * three), so an answer rests on the 64-bit seeded hash, not on comparing the key: two keys of
 * one hash (odds about 2^-64 a probe) make a key that is not there look there. That is safe
 * for an existence answer: every read (`probe_all`) compares the full key, so such a key is
 * then a miss, never another key's bytes. No seqlock is needed: an aligned 8-byte entry is
 * read whole; a chain being shifted back by a deletion can hide a key for a moment (a miss).
 * No software prefetch: between two calls SGLang copies megabytes, so the column's lines and
 * their page-table entries come from memory, and there prefetching the lines of the keys
 * ahead (4 to 128) made 128-key batches 5-40% slower than the out-of-order core overlapping
 * this short loop's independent loads by itself (with warm caches it gained ~15%). The keys
 * are hashed in a pass of their own first: with the hashing in the lookup loop, each key's
 * branch on its loaded entry held back the next key's loads, 4x slower (0.45 vs 0.115 us per
 * key at 10^6 keys, caches flushed); they are hashed HASH_GROUP at a time, so that no memory
 * is allocated and a `leading` count (SGLang's batch_exists: the hits from the start) stops
 * hashing and probing at its first miss, setting the use bytes of the keys it counted only.
 * Returns n, or with `leading` the number of hits from the start. */
static Py_ssize_t contains_all(const Table *t, const KeyBytes *keys, Py_ssize_t n, char *hits,
                               int leading)
{
    uint64_t hashes[HASH_GROUP];
    PrefixState kept = {0};
    for (Py_ssize_t start = 0; start < n; start += HASH_GROUP) {
        Py_ssize_t m = n - start < HASH_GROUP ? n - start : HASH_GROUP;
        for (Py_ssize_t i = 0; i < m; i++)
            hashes[i] = key_hash(&keys[start + i], t->seed, &kept);
        for (Py_ssize_t i = 0; i < m; i++) {
            uint64_t want = hashes[i], j = want & t->mask;
            char hit = 0;
            for (uint64_t steps = 0; steps <= t->mask; steps++, j = (j + 1) & t->mask) {
                tbl_drop(t, &t->hashes[j], HASH_BYTES);
                tbl_mfence(t);
                uint64_t h = LOAD_ACQ(&t->hashes[j]);
                if (h == 0)
                    break;
                if (h == want) {
                    hit = 1;
                    mark_used(t, j);
                    break;
                }
            }
            if (leading && !hit)
                return start + i;
            if (hits != NULL)
                hits[start + i] = hit;
        }
    }
    return n;
}

/* contains_all and, where it missed, the header's `incomplete`, guarded (`arg`: a Contains):
 * 1 if a miss may be a key that found no room (ask the server), else 0. */
typedef struct {
    const Table *t;
    const KeyBytes *keys;
    Py_ssize_t n;
    char *hits; /* NULL with leading */
    int leading;
    Py_ssize_t counted; /* out: contains_all's answer */
} Contains;

static int contains_run(void *arg)
{
    Contains *c = arg;
    c->counted = contains_all(c->t, c->keys, c->n, c->hits, c->leading);
    int missed = c->leading ? c->counted < c->n : memchr(c->hits, 0, (size_t)c->n) != NULL;
    return missed && table_incomplete(c->t);
}

/* A batch's keys as the table holds them (see `gather`). */
typedef struct {
    PyObject *seq, *prefixes; /* the keys; the per-key prefixes (NULL: one or none) */
    KeyBytes *keys;           /* n keys, each with its prefix's bytes */
    Py_ssize_t n;
} Batch;

static void batch_free(Batch *b)
{
    PyMem_Free(b->keys);
    Py_XDECREF(b->prefixes);
    Py_XDECREF(b->seq);
}

/* A prefix's bytes in out->p, out->n (GIL held; str as UTF-8, subclasses too; kind 0:
 * neither). */
static int prefix_bytes(PyObject *prefix, KeyBytes *out)
{
    *out = (KeyBytes){0};
    if (PyUnicode_Check(prefix)) {
        const char *s = PyUnicode_AsUTF8AndSize(prefix, &out->n);
        if (s == NULL)
            return -1;
        out->p = (const unsigned char *)s;
        out->kind = KIND_STR;
    }
    else if (PyBytes_Check(prefix)) {
        out->p = (const unsigned char *)PyBytes_AS_STRING(prefix);
        out->n = PyBytes_GET_SIZE(prefix);
        out->kind = KIND_BYTES;
    }
    return 0;
}

/* `fast`, PySequence_Fast's view of `seq`, as a batch holds it while it is probed: a probe
 * without the GIL (`gil_free`) holds a tuple of a caller's list's items instead, since another
 * thread may change that list meanwhile and free keys whose bytes are being read. (With the GIL
 * held no other thread runs; a sequence PySequence_Fast copied, or a tuple, is not changed.) */
static PyObject *held_items(PyObject *seq, PyObject *fast, int gil_free)
{
    if (fast == NULL || !gil_free || fast != seq || !PyList_Check(fast))
        return fast;
    PyObject *items = PyList_AsTuple(fast);
    Py_DECREF(fast);
    return items;
}

/* Gather the keys' bytes (GIL held), each after its prefix: `prefix` is None, one str or bytes
 * for every key ("" and b"": none), or a sequence of them, one per key. The table is probed
 * for `prefix + key` with neither Python nor C making those strings (`KeyBytes.pre`: the key
 * is hashed and compared in its two parts); a prefix not of its key's type is a TypeError, as
 * Python's `prefix + key` (what the request path sends). The bytes stay those of the objects
 * `b` and the caller hold. Returns 1 if every key can be in the table, 0 if one cannot (too
 * long with its prefix, empty, or not str/bytes), -1 on error. `always_gil_free`: the batch
 * is probed without the GIL whatever its length (a read). */
static int gather(Batch *b, PyObject *keys_o, PyObject *prefix, int always_gil_free)
{
    memset(b, 0, sizeof(*b));
    if ((b->seq = PySequence_Fast(keys_o, "keys must be a sequence")) == NULL)
        return -1;
    Py_ssize_t n = b->n = PySequence_Fast_GET_SIZE(b->seq);
    int gil_free = always_gil_free || n >= GIL_FREE_FROM;
    if ((b->seq = held_items(keys_o, b->seq, gil_free)) == NULL)
        return -1;
    KeyBytes one = {0};
    if (prefix != Py_None) {
        if (prefix_bytes(prefix, &one) < 0)
            return -1;
        if (one.kind != 0 && one.n == 0)
            prefix = Py_None; /* "" or b"": none (the handler's default, whatever the keys) */
    }
    if (prefix != Py_None && one.kind == 0) {
        b->prefixes = held_items(
            prefix, PySequence_Fast(prefix, "prefix must be str, bytes or one per key"), gil_free);
        if (b->prefixes == NULL)
            return -1;
        if (PySequence_Fast_GET_SIZE(b->prefixes) != n) {
            PyErr_SetString(PyExc_ValueError, "prefix: one per key");
            return -1;
        }
    }
    if ((b->keys = PyMem_Malloc(sizeof(KeyBytes) * (size_t)(n ? n : 1))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        KeyBytes *k = &b->keys[i];
        if (key_bytes(PySequence_Fast_GET_ITEM(b->seq, i), k) < 0)
            return -1;
        if (k->kind == 0)
            return 0;
        if (prefix != Py_None) {
            KeyBytes pre = one;
            if (b->prefixes != NULL &&
                prefix_bytes(PySequence_Fast_GET_ITEM(b->prefixes, i), &pre) < 0)
                return -1;
            if (pre.kind != k->kind) {
                PyErr_SetString(PyExc_TypeError, "a key's prefix must be of its type (str "
                                                 "keys: str, bytes keys: bytes)");
                return -1;
            }
            k->pre = pre.p;
            k->pn = pre.n;
        }
        if (key_len(k) == 0 || key_len(k) > MAX_KEY)
            return 0;
    }
    return 1;
}

/* probe_all over a gathered batch, without the GIL from GIL_FREE_FROM keys. */
static int probe_batch(Reader *self, const Batch *b, const Regions *regions, int64_t *cols)
{
    int rc;
    GIL_FREE_FOR(b->n, rc = probe_all(&self->t, b->keys, b->n, regions, cols));
    if (rc < 0)
        PyErr_NoMemory();
    return rc;
}

/* The keyword-only `prefix` of a vectorcall: Py_None unless given. */
static int kw_prefix(const char *fname, PyObject *kwnames, PyObject *const *values,
                     PyObject **prefix)
{
    *prefix = Py_None;
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(name, "prefix") != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         name);
            return -1;
        }
        *prefix = values[i];
    }
    return 0;
}

/* `obj` (a buffer) as the regions mapped here: int64 rows of ROW_FIELDS sorted by region id
 * (`view` is held: release it); -1 with ValueError if it is not that. */
static int regions_get(PyObject *obj, Py_buffer *view, Regions *r)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    r->rows = (const int64_t *)view->buf;
    r->n = view->len / (Py_ssize_t)(8 * ROW_FIELDS);
    int sorted = view->len % (8 * ROW_FIELDS) == 0 && (uintptr_t)view->buf % 8 == 0;
    for (Py_ssize_t i = 1; sorted && i < r->n; i++)
        sorted = r->rows[i * ROW_FIELDS] > r->rows[(i - 1) * ROW_FIELDS];
    if (!sorted) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "regions must be int64 rows of 4, sorted by id");
        return -1;
    }
    return 0;
}

/* probe(keys, regions, *, prefix=None) -> bytes of NCOLS int64 columns of len(keys) each:
 * address (in this process), length, checksum, region id, offset, slot, seq; a miss has 0s
 * and slot -1. `regions`: a buffer of int64 rows (region id, base address, length, tag) of
 * the regions mapped here, sorted by region id. None: ask the server for this batch (a key
 * cannot be in the table, or a hit is in a region not in `regions` or of another tag). */
static PyObject *Reader_probe(Reader *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    PyObject *prefix, *out = NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "probe() takes keys and regions");
        return NULL;
    }
    Py_buffer reg;
    Regions regions;
    if (kw_prefix("probe", kwnames, args + nargs, &prefix) < 0 ||
        regions_get(args[1], &reg, &regions) < 0)
        return NULL;
    Batch b;
    int all = gather(&b, args[0], prefix, 0);
    if (all <= 0) {
        out = all < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * NCOLS * b.n);
    if (out == NULL)
        goto done;
    int rc = probe_batch(self, &b, &regions, (int64_t *)PyBytes_AS_STRING(out));
    if (rc != 0) {
        Py_DECREF(out);
        out = rc < 0 ? NULL : Py_NewRef(Py_None);
    }
done:
    batch_free(&b);
    PyBuffer_Release(&reg);
    return out;
}

/* contains(keys, *, prefix=None) -> [bool] (each hit's use byte set); leading(keys, *,
 * prefix=None) -> int, how many keys from the start are in the table (the use bytes of those
 * set; nothing after the first miss is probed). Either None if a key cannot be in the table. */
static PyObject *contains_or_leading(Reader *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames, const char *name, int leading)
{
    PyObject *prefix, *out = NULL;
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes keys", name);
        return NULL;
    }
    if (kw_prefix(name, kwnames, args + nargs, &prefix) < 0)
        return NULL;
    char *hits = NULL;
    Batch b;
    int all = gather(&b, args[0], prefix, 0);
    if (all <= 0) {
        out = all < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    if (!leading && (hits = PyMem_Malloc((size_t)(b.n ? b.n : 1))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Contains c = {&self->t, b.keys, b.n, hits, leading, 0};
    int rc;
    GIL_FREE_FOR(b.n, rc = guarded(contains_run, &c));
    if (rc != 0) { /* a miss may be a key that found no room, or the table faulted */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (leading) {
        out = PyLong_FromSsize_t(c.counted);
        goto done;
    }
    if ((out = PyList_New(b.n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++)
        PyList_SET_ITEM(out, i, Py_NewRef(hits[i] ? Py_True : Py_False));
done:
    PyMem_Free(hits);
    batch_free(&b);
    return out;
}

static PyObject *Reader_contains(Reader *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    return contains_or_leading(self, args, nargs, kwnames, "contains", 0);
}

static PyObject *Reader_leading(Reader *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    return contains_or_leading(self, args, nargs, kwnames, "leading", 1);
}

typedef struct {
    const Table *t;
    const int64_t *sl, *sq;
    Py_ssize_t n;
    char *flags;
} Unproven;

static int unproven_run(void *arg);

/* Of n probed keys (slot >= 0: a hit), flag (1) each hit that is not proven now: its slot's
 * seq is not the one it was probed with, or the table was retired; returns how many. Call it
 * after the copy: the acquire fence keeps the copy's reads before these. A fault reading the
 * table (guarded) proves none: every hit flagged, and `*faulted` set (else cleared). */
static Py_ssize_t unproven(const Table *t, const int64_t *sl, const int64_t *sq, Py_ssize_t n,
                           char *flags, int *faulted)
{
    Unproven u = {t, sl, sq, n, flags};
    int bad = guarded(unproven_run, &u);
    *faulted = bad == FAULTED;
    if (!*faulted)
        return bad;
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        hits += flags[i] = (char)(sl[i] >= 0);
    return hits;
}

/* unproven's work, guarded (`arg`: an Unproven): how many hits are not proven. */
static int unproven_run(void *arg)
{
    const Unproven *u = arg;
    const Table *t = u->t;
    const int64_t *sl = u->sl, *sq = u->sq;
    Py_ssize_t n = u->n;
    char *flags = u->flags;
    int bad = 0;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int live = table_current(t);
    for (Py_ssize_t i = 0; i < n; i++) /* (software: every hit's seq from memory) */
        if (sl[i] >= 0 && (uint64_t)sl[i] <= t->mask)
            tbl_drop(t, &t->slots[sl[i]].seq, 8);
    tbl_mfence(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = sl[i];
        flags[i] = (char)(s >= 0 && !(live && (uint64_t)s <= t->mask &&
                                      LOAD(&t->slots[s].seq) == (uint64_t)sq[i]));
        bad += flags[i];
    }
    if (live && !table_current(t)) { /* a retire (or format) raced the loop: none is proven */
        bad = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            bad += flags[i] = (char)(sl[i] >= 0);
    }
    return bad;
}

/* changed(slots, seqs) -> None if every hit (slot >= 0) still has the seq it was read with
 * and the table is not retired, else bytes, 1 per hit that is not proven (misses 0): call it
 * after the copy (an acquire fence first, so that the copy's reads come before these). */
static PyObject *Reader_changed(Reader *self, PyObject *args)
{
    Py_buffer slots, seqs;
    if (!PyArg_ParseTuple(args, "y*y*:changed", &slots, &seqs))
        return NULL;
    PyObject *out = NULL;
    if (slots.len != seqs.len || slots.len % 8) {
        PyErr_SetString(PyExc_ValueError, "changed: slots and seqs must be int64 columns");
        goto done;
    }
    Py_ssize_t n = slots.len / 8, bad = 0;
    if ((out = PyBytes_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    int faulted;
    bad = unproven(&self->t, slots.buf, seqs.buf, n, PyBytes_AS_STRING(out), &faulted);
    if (bad == 0)
        Py_SETREF(out, Py_NewRef(Py_None));
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&seqs);
    return out;
}

/* -- the fused read: probe, copy, check in one call ---------------------------------------
 * A copying reader's whole protocol (probe; copy each hit; then check that every copied hit's
 * slot is unchanged) with no Python between the steps: on the data path's small pages the
 * interpreter's work around three calls, run from caches the copy has just flushed, cost
 * more than the probe and the check themselves. The copy is `_memcopy.c`'s loop, reached
 * through its capsule (maru.common._memcopy.COPY_VALUES: `copy_values_threads`, shared by
 * `threads` threads), so both paths copy alike. */

typedef Py_ssize_t (*copy_values_fn)(const int64_t *starts, const int64_t *buffers,
                                     const int64_t *sizes, Py_ssize_t values, Py_ssize_t parts,
                                     int to_values, int streaming, int64_t *hashes, int threads,
                                     uint8_t *faulted);

enum { COL_COMPUTED = NCOLS, COL_STATUS, READ_COLS };
enum { READ_MISS, READ_PROVEN, READ_OTHER_LENGTH, READ_CHANGED, READ_CORRUPT, READ_FAULTED };

/* probe_all, then the copy of each hit of `length` bytes (parts of sizes[0:parts] into its
 * row of `buffers`), then the check (no GIL needed). `cols`: READ_COLS columns of n. Returns
 * probe_all's 1 (ask the server: nothing was copied), -1 (no memory) or 0. */
static int read_all(const Table *t, const Batch *b, const Regions *regions, int64_t *cols,
                    const int64_t *buffers, const int64_t *sizes, Py_ssize_t parts,
                    int64_t length, copy_values_fn copy, int hashed, int threads)
{
    Py_ssize_t n = b->n;
    int rc = probe_all(t, b->keys, n, regions, cols);
    if (rc != 0)
        return rc;
    int64_t *starts = PyMem_RawMalloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    char *flags = PyMem_RawMalloc((size_t)(n ? n : 1));
    uint8_t *faulted = PyMem_RawCalloc((size_t)(n ? n : 1), 1);
    if (starts == NULL || flags == NULL || faulted == NULL) {
        PyMem_RawFree(starts);
        PyMem_RawFree(flags);
        PyMem_RawFree(faulted);
        return -1;
    }
    int64_t *status = cols + COL_STATUS * n, *computed = cols + COL_COMPUTED * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t len = cols[COL_LENGTH * n + i];
        status[i] = len == 0 ? READ_MISS : len == length ? READ_PROVEN : READ_OTHER_LENGTH;
        starts[i] = status[i] == READ_PROVEN ? cols[COL_ADDRESS * n + i] : 0;
    }
    int any_faulted =
        copy(starts, buffers, sizes, n, parts, 0, 1, hashed ? computed : NULL, threads,
             faulted) != 0;
    if (!hashed)
        memset(computed, 0, sizeof(int64_t) * (size_t)n);
    int checks_faulted;
    int any = unproven(t, cols + COL_SLOT * n, cols + COL_SEQ * n, n, flags, &checks_faulted);
    for (Py_ssize_t i = 0; i < n && (any || hashed || any_faulted); i++) {
        if (status[i] != READ_PROVEN)
            continue;
        if (faulted[i] || checks_faulted) /* (its copy, or the check after it) */
            status[i] = READ_FAULTED; /* (the pool's file truncated under the copy, say) */
        else if (flags[i])
            status[i] = READ_CHANGED;
        else if (hashed && cols[COL_CHECKSUM * n + i] != 0 &&
                 computed[i] != cols[COL_CHECKSUM * n + i])
            status[i] = READ_CORRUPT; /* (a value stored without a checksum: 0, not checked) */
    }
    PyMem_RawFree(starts);
    PyMem_RawFree(flags);
    PyMem_RawFree(faulted);
    return 0;
}

/* read(keys, regions, buffers, sizes, length, copier, hashed[, threads], *, prefix=None) ->
 * (proven, columns), or None: ask the server (nothing was copied). `proven`: a bool per key,
 * True where its value was copied and proven (status 1); `columns`: bytes of 9 int64 columns of
 * len(keys): probe's 7, then the maru64 of each copied value (with hashed, else 0) and a
 * status: 0 miss, 1 copied and proven, 2 stored with another length (not copied), 3 copied
 * but its entry changed since the probe, 4 copied but its bytes do not match its writer's
 * checksum (with hashed; a value stored without one is not checked), 5 its copy faulted (the
 * pool's file truncated or out of room under it: `_memcopy.c`, "faults during a copy"). `buffers`: int64
 * (keys, parts) part pointers, `sizes`: the parts' int64 sizes, summing to `length`;
 * `copier`: maru.common._memcopy.COPY_VALUES; `threads`: the copy shared by up to that many
 * threads (1 unless given). */
static PyObject *Reader_read(Reader *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    PyObject *prefix, *out = NULL;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "read() takes keys, regions, buffers, sizes, length, "
                                         "copier, hashed and optionally threads");
        return NULL;
    }
    copy_values_fn copy =
        (copy_values_fn)PyCapsule_GetPointer(args[5], "maru.copy_values_threads.2");
    if (copy == NULL)
        return NULL;
    long threads = nargs == 8 ? PyLong_AsLong(args[7]) : 1;
    if (threads == -1 && PyErr_Occurred())
        return NULL;
    if (threads < 1 || threads > 64) {
        PyErr_SetString(PyExc_ValueError, "read: threads must be 1..64");
        return NULL;
    }
    long long length = PyLong_AsLongLong(args[4]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    int hashed = PyObject_IsTrue(args[6]);
    Py_buffer reg, bufs = {0}, sizes = {0};
    Regions regions;
    if (hashed < 0 || kw_prefix("read", kwnames, args + nargs, &prefix) < 0 ||
        regions_get(args[1], &reg, &regions) < 0)
        return NULL;
    Batch b;
    memset(&b, 0, sizeof(b));
    if (int64_buffer(args[2], &bufs, "buffers") < 0 || int64_buffer(args[3], &sizes, "sizes") < 0)
        goto done;
    Py_ssize_t parts = sizes.len / 8;
    const int64_t *z = (const int64_t *)sizes.buf;
    int64_t total = 0;
    int ok = (uintptr_t)sizes.buf % 8 == 0 && (uintptr_t)bufs.buf % 8 == 0;
    for (Py_ssize_t j = 0; ok && j < parts; j++) {
        ok = z[j] >= 0;
        total += z[j];
    }
    if (!ok || parts == 0 || total != length) {
        PyErr_SetString(PyExc_ValueError, "read: sizes must be int64 parts summing to length");
        goto done;
    }
    int all = gather(&b, args[0], prefix, 1);
    if (all <= 0) {
        out = all < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    if (bufs.len != (Py_ssize_t)sizeof(int64_t) * b.n * parts) {
        PyErr_Format(PyExc_ValueError, "read: %zd buffers for %zd keys of %zd parts",
                     bufs.len / 8, b.n, parts);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * READ_COLS * b.n);
    if (out == NULL)
        goto done;
    int rc;
    int64_t *cols = (int64_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    rc = read_all(&self->t, &b, &regions, cols, bufs.buf, z, parts, length, copy, hashed,
                  (int)threads);
    Py_END_ALLOW_THREADS
    PyObject *proven = rc == 0 ? PyList_New(b.n) : NULL;
    if (proven != NULL) {
        for (Py_ssize_t i = 0; i < b.n; i++)
            PyList_SET_ITEM(proven, i,
                            Py_NewRef(cols[COL_STATUS * b.n + i] == READ_PROVEN ? Py_True : Py_False));
        Py_SETREF(out, PyTuple_Pack(2, proven, out));
        Py_DECREF(proven);
    }
    else {
        Py_CLEAR(out);
        if (rc < 0)
            PyErr_NoMemory();
        else if (rc > 0)
            out = Py_NewRef(Py_None);
    }
done:
    batch_free(&b);
    PyBuffer_Release(&reg);
    if (bufs.obj != NULL)
        PyBuffer_Release(&bufs);
    if (sizes.obj != NULL)
        PyBuffer_Release(&sizes);
    return out;
}

/* The getters' reads of the header, guarded: a table that faults is retired, incomplete,
 * of no successor, count 0; its pool generation an OSError. */
static int current_run(void *t) { return table_current(t); }
static int incomplete_run(void *t) { return table_incomplete(t); }

static PyObject *Reader_get_retired(Reader *self, void *c)
{
    return PyBool_FromLong(guarded(current_run, &self->t) != 1);
}

static PyObject *Reader_get_index_id(Reader *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->t.seed);
}

static PyObject *Reader_get_incomplete(Reader *self, void *c)
{
    return PyBool_FromLong(guarded(incomplete_run, &self->t) != 0);
}

/* The header's `regions`, read from memory (a software-coherent reader drops its line):
 * `guarded` answers 0, or FAULTED. */
typedef struct {
    const Table *t;
    uint64_t value;
} RegionsLoad;

static int regions_run(void *arg)
{
    RegionsLoad *r = arg;
    tbl_drop(r->t, &r->t->h->regions, 8);
    tbl_mfence(r->t);
    r->value = LOAD_ACQ(&r->t->h->regions);
    return 0;
}

static PyObject *Reader_get_regions(Reader *self, void *c)
{
    RegionsLoad r = {&self->t, 0};
    if (guarded(regions_run, &r) == FAULTED)
        r.value = 0;
    return PyLong_FromUnsignedLongLong(r.value);
}

/* The successor field, copied out once `retired` is set (`arg`: a Successor): guarded. */
typedef struct {
    const Header *h;
    char path[SUCCESSOR_MAX];
} Successor;

static int successor_run(void *arg)
{
    Successor *s = arg;
    if (LOAD_ACQ(&s->h->retired))
        memcpy(s->path, (const char *)s->h + SUCCESSOR_OFFSET, SUCCESSOR_MAX - 1);
    return 0;
}

static PyObject *Reader_get_successor(Reader *self, void *c)
{
    Successor s = {self->t.h, {0}};
    if (guarded(successor_run, &s) == FAULTED)
        s.path[0] = 0;
    return PyUnicode_DecodeUTF8(s.path, (Py_ssize_t)strnlen(s.path, SUCCESSOR_MAX - 1), "replace");
}

static PyObject *Reader_get_pool_generation(Reader *self, void *c)
{
    Load l = {&self->t.h->pool_generation, 0};
    if (guarded(load_run, &l) == FAULTED)
        return PyErr_Format(PyExc_OSError, "index table faulted (its file truncated?)");
    return PyLong_FromUnsignedLongLong(l.value);
}

static PyMethodDef Reader_methods[] = {
    {"probe", (PyCFunction)(void (*)(void))Reader_probe, METH_FASTCALL | METH_KEYWORDS,
     "probe(keys, regions, *, prefix=None) -> bytes of 7 int64 columns (address, length,\n"
     "checksum, region, offset, slot, seq), or None: ask the server"},
    {"contains", (PyCFunction)(void (*)(void))Reader_contains, METH_FASTCALL | METH_KEYWORDS,
     "contains(keys, *, prefix=None) -> [bool], or None if a key cannot be in the table"},
    {"leading", (PyCFunction)(void (*)(void))Reader_leading, METH_FASTCALL | METH_KEYWORDS,
     "leading(keys, *, prefix=None) -> the number of keys from the start in the table (probed\n"
     "up to the first miss), or None if a key cannot be in the table"},
    {"read", (PyCFunction)(void (*)(void))Reader_read, METH_FASTCALL | METH_KEYWORDS,
     "read(keys, regions, buffers, sizes, length, copier, hashed[, threads], *, prefix=None)\n"
     "-> (proven, columns) or None: ask the server. Probes, copies each hit of `length` bytes\n"
     "into its buffers (on up to `threads` threads) and checks it after: proven, a bool per\n"
     "key; columns: probe's 7, maru64, status."},
    {"changed", (PyCFunction)Reader_changed, METH_VARARGS,
     "changed(slots, seqs) -> None if every hit is unchanged and the table current, else\n"
     "bytes: 1 per hit that is not proven"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"retired", (getter)Reader_get_retired, NULL,
     "the table was replaced, its server stopped, or it was formatted again", NULL},
    {"index_id", (getter)Reader_get_index_id, NULL, "the table's id when opened", NULL},
    {"incomplete", (getter)Reader_get_incomplete, NULL,
     "a key found no room: misses are not final", NULL},
    {"successor", (getter)Reader_get_successor, NULL, "the replacing table's path, or ''", NULL},
    {"regions", (getter)Reader_get_regions, NULL,
     "the id the server's next region gets (0: not said, or the table faulted)", NULL},
    {"pool_generation", (getter)Reader_get_pool_generation, NULL, "hash of the generation", NULL},
    {"count", (getter)table_get_count, NULL, "keys in the table", NULL},
    {"capacity", (getter)table_get_capacity, NULL, "slots", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.common._shmindex.Reader",
    .tp_doc = "Reader(table_buffer, use_buffer, software=False): a client's view of a table.",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Reader_new,
    .tp_dealloc = (destructor)table_object_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
};

static PyObject *py_hash_generation(PyObject *module, PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h = hash_bytes(b.buf, (size_t)b.len, 0);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* flush_lines(buffer, invalidate=False) -> lines: every cache line of `buffer` written back
 * to memory (`clwb`, then `sfence`) or, with `invalidate`, evicted (`clflushopt`, then
 * `mfence`: later loads read memory). For the few bytes of pool memory that no copy loop or
 * table writer moves and other hosts read: the pool's mark. Done in either coherence mode
 * (one line, once per start or handshake); nothing where the CPU has no flushes. */
static PyObject *py_flush_lines(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b;
    int invalidate = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &b, &invalidate))
        return NULL;
    size_t lines = 0;
#if COH_X86
    int kind = invalidate ? coh_invalidate_kind : coh_write_back_kind;
    if (kind != FLUSH_NONE) {
        lines = coh_flush((const char *)b.buf, (size_t)b.len, kind);
        if (invalidate)
            _mm_mfence();
        else
            _mm_sfence();
    }
#endif
    PyBuffer_Release(&b);
    return PyLong_FromSize_t(lines);
}

static PyMethodDef module_methods[] = {
    {"format_table", format_table, METH_VARARGS,
     "format_table(buffer, capacity, pool_generation: bytes, index_id, software=False,\n"
     "use=None): an empty table (one there before is retired, then zeroed; `use` too)"},
    {"flush_lines", py_flush_lines, METH_VARARGS,
     "flush_lines(buffer, invalidate=False) -> lines written back (or evicted) to memory"},
    {"hash_generation", py_hash_generation, METH_O,
     "hash_generation(bytes) -> the u64 a header keeps for a pool generation"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef shmindex_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "maru.common._shmindex",
    .m_doc = "The local index's shared table: the server's Writer, the clients' Reader.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__shmindex(void)
{
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    if (IndexFaultError == NULL) {
        IndexFaultError = PyErr_NewExceptionWithDoc(
            "maru.common._shmindex.IndexFaultError",
            "The table's memory faulted under a Writer (SIGBUS: its file, or the pool file it\n"
            "lies in, truncated, or its filesystem out of room). The call that met it may be\n"
            "half done; the table is no longer to be trusted (errno EFAULT).",
            PyExc_OSError, NULL);
        if (IndexFaultError == NULL)
            return NULL;
    }
    coh_pick_flushes();
    PyObject *m = PyModule_Create(&shmindex_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddType(m, &WriterType) < 0 || PyModule_AddType(m, &ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "LAYOUT_VERSION", LAYOUT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_BYTES", HEADER_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_BYTES", SLOT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "HASH_BYTES", HASH_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_KEY", MAX_KEY) < 0 ||
        PyModule_AddIntConstant(m, "NCOLS", NCOLS) < 0 ||
        PyModule_AddObjectRef(m, "IndexFaultError", IndexFaultError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
