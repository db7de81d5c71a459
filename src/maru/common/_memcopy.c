/* maru.common._memcopy: many memcpy calls for one Python call.
 *
 * A batch of KV pages is hundreds of separate page parts (the K and V halves of every page
 * live apart in SGLang's host pool). Copying them with one ctypes.memmove each costs about a
 * microsecond of interpreter overhead per part on a small VM, which at 64 KiB pages is a
 * fifth of the batch. `copy_many` takes the addresses as int64 arrays and runs the loop in C,
 * without the GIL. maru.common.memcopy is its Python face.
 *
 * Streaming: a page part copied into the pool is read next by another process (from memory),
 * and one copied into SGLang's host pool goes next to the GPU by DMA (from memory): neither
 * needs the destination in this core's cache. Ordinary stores first read every destination
 * line into the cache and then push out whatever was there (the server's and the client's
 * own working set, here); non-temporal stores write whole lines straight to memory
 * (benchmarks/results/history.md, session 3). The stores are weakly ordered, so the loop ends with
 * a store fence: whatever the caller does next (the REGISTER_KV that publishes the pages) comes
 * after them.
 *
 * Checksums (`maru_checksums`): `copy_many_hashed` copies like `copy_many` and hashes each
 * value on the way, so the hash costs no second trip to memory (hashing after the copy, as
 * before, read every page from memory again: 18-41% of the data path's throughput). Where the
 * destination is 64-byte aligned (pool chunks and host pages are) each 64-byte stripe is
 * loaded once, streamed out and hashed from the same registers; elsewhere a 4 KiB block is
 * copied, then hashed while it is still in L1. The hash, maru64, is below; its reference in
 * numpy is tests/unit/maru64.py (the tests check they agree).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <errno.h>
#include <unistd.h>

#include "int64_buffer.h"
#include "cacheflush.h"
#include "faultguard.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING 1
#else
#define HAVE_STREAMING 0
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86_DISPATCH 1
#else
#define HAVE_X86_DISPATCH 0
#endif

/* Below this a part is copied with memmove: small copies gain nothing from streaming. */
#define STREAMING_MIN_BYTES 4096

/* ---- coherence: hosts whose caches do not snoop each other ---------------------------------
 *
 * Hosts of a CXL pod that share memory without hardware coherence (CXL 2.0 sharing) see each
 * other's writes only where the writer's lines reached memory and the reader's cache holds no
 * copy from before (docs/architecture.md, "Coherence"). `coherence("software")` (set once per
 * process at HANDSHAKE, maru.client.coherence) turns on, in every copy loop here:
 *  - a writer's copy into the pool writes back what it wrote with cached stores (heads and
 *    tails, small parts, memmove copies: streamed lines go to memory anyway) with clwb, else
 *    clflushopt, else clflush, and ends with an sfence: all of it is in memory before the
 *    call returns, so before the REGISTER_KV that publishes the values;
 *  - a reader invalidates every line of a value (clflushopt, else clflush) and fences (mfence)
 *    before it copies the value: nothing it reads comes from a line cached before.
 * Where a loop cannot tell which side is the pool (copy_many, copy_many_hashed) it does both.
 * The flushes run inside each value's fault guard: a fault in one is a fault of that value.
 * Hardware (the default): none of it, the loops as before. x86-64 only (elsewhere "software"
 * is refused). `coherence_counts()`: the lines written back and invalidated (tests). The flush
 * primitives (cpuid's pick, `coh_flush`) are `../common/cacheflush.h`, shared with the key
 * index's `_shmindex.c`, which flushes its slots and header the same way. */

static volatile int coh_software = 0;
static uint64_t coh_lines_written_back = 0; /* (atomic, relaxed: a test's counter) */
static uint64_t coh_lines_invalidated = 0;

#if HAVE_X86_DISPATCH
/* Write back `n` bytes at `p` written with cached stores (their sfence comes at the end of
 * the loop). The loops read `coh_software` once per call and call these only in software. */
static inline void coh_write_back(const char *p, size_t n)
{
    if (n)
        __atomic_fetch_add(&coh_lines_written_back, coh_flush(p, n, coh_write_back_kind),
                           __ATOMIC_RELAXED);
}

/* `n` bytes at `p` invalidated, then a full fence, before they are read. */
static inline void coh_invalidate(const char *p, size_t n)
{
    if (!n)
        return;
    __atomic_fetch_add(&coh_lines_invalidated, coh_flush(p, n, coh_invalidate_kind),
                       __ATOMIC_RELAXED);
    _mm_mfence();
}

/* The end of a copy loop (`coh`: its snapshot of coh_software): its streaming stores and
 * write-backs ordered before what the caller does next (the registration that publishes the
 * values). */
static inline void coh_fence(int streaming, int coh)
{
    if (streaming || coh)
        _mm_sfence();
}
#else
static inline void coh_write_back(const char *p, size_t n) { (void)p, (void)n; }
static inline void coh_invalidate(const char *p, size_t n) { (void)p, (void)n; }
static inline void coh_fence(int streaming, int coh)
{
    (void)coh;
#if HAVE_STREAMING
    if (streaming)
        _mm_sfence();
#else
    (void)streaming;
#endif
}
#endif

#if HAVE_STREAMING
/* The streaming body: `n` (a multiple of 64) bytes to `d`. SSE2 (16-byte stores, `d` 16-byte
 * aligned) everywhere x86-64 runs; AVX-512 (64-byte stores, `d` 64-byte aligned) where the
 * CPU has it (picked once): measured 5-25% faster than SSE2 on this VM's EPYC, most into a
 * /dev/shm mapping. */
static void stream_sse2(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

#if HAVE_X86_DISPATCH
__attribute__((target("avx512f"))) static void stream_avx512(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 64)
        _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
}
#endif

static void (*stream_wide)(char *d, const char *s, size_t n) = stream_sse2;

/* memmove for non-overlapping ranges: non-temporal stores in 64-byte steps from the first
 * 64-byte aligned destination address, memcpy for the edges before and after: every line is
 * written whole by one kind of store (no line half streamed, half cached; the cached ones are
 * one line at each edge, whatever the store width). `wide`: the widest
 * stores the CPU has (`copy_many`); else SSE2's, which `copy_many_hashed`'s 4 KiB blocks run
 * faster with (measured: 12% over a plain copy against 16-25% with AVX-512 stores, for a
 * destination off the 64-byte grid; the one-pass loop covers the aligned case). Returns 0
 * where it copied nothing (a small or overlapping copy: memmove's). `wb`: see copy_bytes. */
static int copy_streaming(char *d, const char *s, size_t n, int wide, int wb)
{
    if (n < STREAMING_MIN_BYTES || (d < s + n && s < d + n))
        return 0;
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    memcpy(d, s, head);
    if (wb)
        coh_write_back(d, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    (wide ? stream_wide : stream_sse2)(d, s, body);
    memcpy(d + body, s + body, n - body);
    if (wb)
        coh_write_back(d + body, n - body);
    return 1;
}
#endif

/* One buffer copied: streaming stores where `streaming` (copy_streaming), else memmove. `wb`:
 * software coherence, and the destination is, or may be, the pool: the lines written with
 * cached stores are written back (see "coherence"; the loop's sfence comes at its end). */
static inline void copy_bytes(char *d, const char *s, size_t n, int streaming, int wide,
                              int wb)
{
#if HAVE_STREAMING
    if (streaming && n >= STREAMING_MIN_BYTES && copy_streaming(d, s, n, wide, wb))
        return;
#else
    (void)streaming, (void)wide;
#endif
    memmove(d, s, n);
    if (wb)
        coh_write_back(d, n);
}

/* ---- maru64: the page checksum ------------------------------------------------------------
 *
 * Written for Maru (not taken from a library). It detects accidental corruption (a stray
 * write, a reused or zeroed page, a flipped bit, a torn or truncated copy, swapped blocks); it
 * is not a MAC and not collision resistant against an adversary who chooses the bytes.
 *
 * The bytes are read as little-endian 64-bit words, 8 lanes to a 64-byte stripe, 16 stripes to
 * a 1 KiB block. Stripe s at position j = s mod 16 of its block adds to lane i:
 *
 *     x = w ^ KEY[j][i];   acc[i] += w + lo32(x) * hi32(x)
 *
 * The 32x32 -> 64-bit product (one SIMD instruction for 4 or 8 lanes) spreads each word over
 * all 64 bits, and the keys differ per lane and stripe position, so moved words change the
 * sum; adding w itself keeps changes the product cannot see (a zero half). After each 16th
 * stripe every lane is rotated left by 29 bits, so the order of blocks counts. A last partial
 * stripe is zero-padded (the length is folded in at the end). The result: h = len * FOLD;
 * then h = fmix(h ^ acc[i]) for i = 0..7; 0 becomes 1 (0 means "no checksum" on the wire).
 * KEY[j][i] = fmix(STEP * (8j + i + 1)); acc[i] starts at fmix(STEP * (129 + i)).
 *
 * Speed: 6 SIMD operations per 32 bytes (AVX2) or 64 (AVX-512), no loop-carried dependency
 * but the accumulating add, so it runs well above memory bandwidth on one core
 * (benchmarks/bench_checksum.py). The AVX2, AVX-512 and scalar loops compute the same value;
 * which runs is picked once, from the CPU (`HASH_IMPL`). */

#define M64_STEP 0xb6d4941343db3fa5ULL
#define M64_FOLD 0xdfaf8ff3b0fe03b7ULL
#define M64_MUL1 0xd677df578f37cdbfULL
#define M64_MUL2 0xfdbe8440d3408a49ULL
#define M64_ROT 29
#define M64_STRIPE 64
#define M64_BLOCK_STRIPES 16

static uint64_t m64_key[M64_BLOCK_STRIPES][8] __attribute__((aligned(64)));
static uint64_t m64_init[8];

static inline uint64_t m64_fmix(uint64_t h)
{
    h ^= h >> 31;
    h *= M64_MUL1;
    h ^= h >> 29;
    h *= M64_MUL2;
    h ^= h >> 32;
    return h;
}

static void m64_make_keys(void)
{
    for (int j = 0; j < M64_BLOCK_STRIPES; j++)
        for (int i = 0; i < 8; i++)
            m64_key[j][i] = m64_fmix(M64_STEP * (uint64_t)(8 * j + i + 1));
    for (int i = 0; i < 8; i++)
        m64_init[i] = m64_fmix(M64_STEP * (uint64_t)(129 + i));
}

static inline uint64_t m64_load(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline uint64_t m64_rotl(uint64_t v) { return (v << M64_ROT) | (v >> (64 - M64_ROT)); }

/* `n` stripes at `p` into `acc`, the first at block position `pos`; returns the position
 * after them. Each loop keeps the lanes in registers across blocks (rotating them at each
 * block's end): a round trip through memory per block costs more than the block. */
typedef unsigned (*m64_stripes_fn)(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos);

static unsigned m64_stripes_scalar(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos)
{
    for (size_t s = 0; s < n; s++, p += M64_STRIPE) {
        const uint64_t *key = m64_key[pos];
        for (int i = 0; i < 8; i++) {
            uint64_t w = m64_load(p + 8 * i), x = w ^ key[i];
            acc[i] += w + (x & 0xffffffffULL) * (x >> 32);
        }
        if (++pos == M64_BLOCK_STRIPES) {
            for (int i = 0; i < 8; i++)
                acc[i] = m64_rotl(acc[i]);
            pos = 0;
        }
    }
    return pos;
}

#if HAVE_X86_DISPATCH
/* The SIMD loops: a whole block (16 stripes, pos 0) at a time where they can, its terms
 * summed in two registers (a block's terms are a plain sum mod 2^64: any grouping gives the
 * same value) so that the adds do not wait on each other; stripe by stripe otherwise.
 *
 * `m64_copy_*` is the same loop that also writes each stripe, from the registers it was
 * loaded into, to `to` (64-byte aligned) with streaming stores: the copy and the hash in one
 * pass, each byte loaded once (`copy_many_hashed`). One body serves both (`to`: NULL or
 * not; the compiler makes a loop of each). */
__attribute__((target("avx2"))) static inline __m256i m64_term_avx2(const uint8_t *p,
                                                                     const uint64_t *key,
                                                                     char *to)
{
    __m256i w = _mm256_loadu_si256((const __m256i *)p);
    if (to != NULL)
        _mm256_stream_si256((__m256i *)to, w);
    __m256i x = _mm256_xor_si256(w, _mm256_load_si256((const __m256i *)key));
    return _mm256_add_epi64(w, _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)));
}

__attribute__((target("avx2"))) static inline __m256i m64_rotl_avx2(__m256i a)
{
    return _mm256_or_si256(_mm256_slli_epi64(a, M64_ROT), _mm256_srli_epi64(a, 64 - M64_ROT));
}

/* `to + i` where `to` may be NULL (stays NULL: nothing is written). */
static inline char *m64_dst(char *to, size_t i) { return to != NULL ? to + i : NULL; }

__attribute__((target("avx2"))) static inline unsigned
m64_run_avx2(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos, char *to)
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    for (; pos == 0 && n >= M64_BLOCK_STRIPES; n -= M64_BLOCK_STRIPES) {
        __m256i b0 = _mm256_setzero_si256(), b1 = b0, c0 = b0, c1 = b0;
        /* (unrolled no further: GCC then hoists the whole key table and spills it) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 2
#endif
        for (int j = 0; j < M64_BLOCK_STRIPES; j += 2) {
            b0 = _mm256_add_epi64(b0, m64_term_avx2(p, m64_key[j], m64_dst(to, 0)));
            b1 = _mm256_add_epi64(b1, m64_term_avx2(p + 32, m64_key[j] + 4, m64_dst(to, 32)));
            c0 = _mm256_add_epi64(c0, m64_term_avx2(p + 64, m64_key[j + 1], m64_dst(to, 64)));
            c1 = _mm256_add_epi64(c1,
                                  m64_term_avx2(p + 96, m64_key[j + 1] + 4, m64_dst(to, 96)));
            p += 2 * M64_STRIPE;
            to = m64_dst(to, 2 * M64_STRIPE);
        }
        a0 = m64_rotl_avx2(_mm256_add_epi64(a0, _mm256_add_epi64(b0, c0)));
        a1 = m64_rotl_avx2(_mm256_add_epi64(a1, _mm256_add_epi64(b1, c1)));
    }
    for (size_t s = 0; s < n; s++) {
        a0 = _mm256_add_epi64(a0, m64_term_avx2(p, m64_key[pos], m64_dst(to, 0)));
        a1 = _mm256_add_epi64(a1, m64_term_avx2(p + 32, m64_key[pos] + 4, m64_dst(to, 32)));
        p += M64_STRIPE;
        to = m64_dst(to, M64_STRIPE);
        if (++pos == M64_BLOCK_STRIPES) {
            a0 = m64_rotl_avx2(a0);
            a1 = m64_rotl_avx2(a1);
            pos = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    return pos;
}

__attribute__((target("avx2"))) static unsigned
m64_stripes_avx2(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos)
{
    return m64_run_avx2(acc, p, n, pos, NULL);
}

__attribute__((target("avx2"))) static unsigned
m64_copy_avx2(uint64_t *acc, char *to, const uint8_t *p, size_t n, unsigned pos)
{
    return m64_run_avx2(acc, p, n, pos, to);
}

__attribute__((target("avx512f"))) static inline __m512i m64_term_avx512(const uint8_t *p,
                                                                          const uint64_t *key,
                                                                          char *to)
{
    __m512i w = _mm512_loadu_si512((const void *)p);
    if (to != NULL)
        _mm512_stream_si512((void *)to, w);
    __m512i x = _mm512_xor_si512(w, _mm512_load_si512((const void *)key));
    return _mm512_add_epi64(w, _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)));
}

__attribute__((target("avx512f"))) static inline unsigned
m64_run_avx512(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos, char *to)
{
    __m512i a = _mm512_loadu_si512((const void *)acc);
    for (; pos == 0 && n >= M64_BLOCK_STRIPES; n -= M64_BLOCK_STRIPES) {
        __m512i b = _mm512_setzero_si512(), c = b;
        for (int j = 0; j < M64_BLOCK_STRIPES; j += 2) {
            b = _mm512_add_epi64(b, m64_term_avx512(p, m64_key[j], m64_dst(to, 0)));
            c = _mm512_add_epi64(c, m64_term_avx512(p + 64, m64_key[j + 1], m64_dst(to, 64)));
            p += 2 * M64_STRIPE;
            to = m64_dst(to, 2 * M64_STRIPE);
        }
        a = _mm512_rol_epi64(_mm512_add_epi64(a, _mm512_add_epi64(b, c)), M64_ROT);
    }
    for (size_t s = 0; s < n; s++) {
        a = _mm512_add_epi64(a, m64_term_avx512(p, m64_key[pos], m64_dst(to, 0)));
        p += M64_STRIPE;
        to = m64_dst(to, M64_STRIPE);
        if (++pos == M64_BLOCK_STRIPES) {
            a = _mm512_rol_epi64(a, M64_ROT);
            pos = 0;
        }
    }
    _mm512_storeu_si512((void *)acc, a);
    return pos;
}

__attribute__((target("avx512f"))) static unsigned
m64_stripes_avx512(uint64_t *acc, const uint8_t *p, size_t n, unsigned pos)
{
    return m64_run_avx512(acc, p, n, pos, NULL);
}

__attribute__((target("avx512f"))) static unsigned
m64_copy_avx512(uint64_t *acc, char *to, const uint8_t *p, size_t n, unsigned pos)
{
    return m64_run_avx512(acc, p, n, pos, to);
}
#endif

/* Copy `n` stripes to `to` (64-byte aligned; streaming stores) and hash them: NULL where the
 * loop in use has no such form (scalar), and the copy and the hash go block by block. */
typedef unsigned (*m64_copy_fn)(uint64_t *acc, char *to, const uint8_t *p, size_t n,
                                unsigned pos);
static m64_copy_fn m64_copy = NULL;

static m64_stripes_fn m64_stripes = m64_stripes_scalar;
static const char *m64_impl = "scalar";

/* A hash in progress over bytes given in pieces of any size (a value's parts, in order). */
typedef struct {
    uint64_t acc[8];
    uint64_t len;
    unsigned pos;   /* stripes done in the current block */
    unsigned held;  /* bytes in `buf`: the start of a stripe that a piece ended in */
    uint8_t buf[M64_STRIPE];
} m64_state;

static void m64_begin(m64_state *st)
{
    memcpy(st->acc, m64_init, sizeof st->acc);
    st->len = 0;
    st->pos = st->held = 0;
}

static inline void m64_consume(m64_state *st, const uint8_t *p, size_t stripes)
{
    st->pos = m64_stripes(st->acc, p, stripes, st->pos);
}

static void m64_update(m64_state *st, const uint8_t *p, size_t n)
{
    st->len += n;
    if (st->held) {
        size_t fill = M64_STRIPE - st->held;
        if (fill > n)
            fill = n;
        memcpy(st->buf + st->held, p, fill);
        st->held += (unsigned)fill;
        p += fill;
        n -= fill;
        if (st->held < M64_STRIPE)
            return;
        m64_consume(st, st->buf, 1);
        st->held = 0;
    }
    size_t whole = n / M64_STRIPE;
    m64_consume(st, p, whole);
    p += whole * M64_STRIPE;
    n -= whole * M64_STRIPE;
    memcpy(st->buf, p, n);
    st->held = (unsigned)n;
}

static int64_t m64_finish(m64_state *st)
{
    if (st->held) {
        memset(st->buf + st->held, 0, M64_STRIPE - st->held);
        m64_consume(st, st->buf, 1);
        st->held = 0;
    }
    uint64_t h = st->len * M64_FOLD;
    for (int i = 0; i < 8; i++)
        h = m64_fmix(h ^ st->acc[i]);
    return (int64_t)(h ? h : 1);
}

static void m64_pick_impl(void)
{
    m64_stripes = m64_stripes_scalar;
    m64_copy = NULL;
    m64_impl = "scalar";
#if HAVE_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        m64_stripes = m64_stripes_avx512;
        m64_copy = m64_copy_avx512;
        m64_impl = "avx512";
    } else if (__builtin_cpu_supports("avx2")) {
        m64_stripes = m64_stripes_avx2;
        m64_copy = m64_copy_avx2;
        m64_impl = "avx2";
    }
#endif
}

/* ---- faults during a copy -----------------------------------------------------------------
 *
 * The pool is a file other processes can change under a copy: truncated (SIGBUS on the pages
 * past its end), or on a tmpfs that someone else filled (SIGBUS on a page not allocated yet),
 * or unmapped by a close() that did not wait (SIGSEGV). Any of them used to kill the inference
 * process. Every copy loop here runs each value (or buffer) inside a guard: `fault_handler`,
 * installed process-wide for SIGBUS and SIGSEGV, jumps back to the guard of the thread that
 * faulted, and the copy goes on with the next value, reporting the ones that faulted (a failed
 * store, a miss). A fault outside a guard goes to the handler that was there before (Python's
 * faulthandler, say), or, with none, kills the process as it always did: the default action is
 * put back and the faulting instruction runs again.
 *
 * The guard is a thread-local pointer to a sigjmp_buf (initial-exec TLS: no allocation in the
 * handler); sigsetjmp does not save the signal mask (no system call per value) and the handler
 * runs with SA_NODEFER, so the mask after the jump is the one before the fault. It is the one
 * guard of the process: the key index's reader (`_shmindex.c`, whose table may lie in the
 * pool) runs its reads under it too, through the FAULT_GUARD capsule (`faultguard.h`). */

static __thread sigjmp_buf *volatile fault_jump __attribute__((tls_model("initial-exec")));
static struct sigaction fault_before[2]; /* SIGBUS's and SIGSEGV's handlers before ours */
static const int fault_signals[2] = {SIGBUS, SIGSEGV};
static volatile sig_atomic_t fault_chained; /* a fault outside a guard went to the one before */

static void fault_handler(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = fault_jump;
    if (jump != NULL) {
        fault_jump = NULL;
        siglongjmp(*jump, 1);
    }
    const struct sigaction *before = &fault_before[sig == SIGSEGV];
    if (fault_chained) { /* back here from the one before (it re-raised): die of it */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    if (before->sa_flags & SA_SIGINFO) {
        fault_chained = 1;
        before->sa_sigaction(sig, info, context);
        fault_chained = 0; /* (it handled the fault: the next one goes to it too) */
        return;
    }
    if (before->sa_handler != SIG_DFL && before->sa_handler != SIG_IGN) {
        fault_chained = 1;
        before->sa_handler(sig);
        fault_chained = 0;
        return;
    }
    /* No handler before ours: die of it as without us. A fault runs its instruction again
     * and meets the default action; a signal someone sent is raised once more. */
    signal(sig, SIG_DFL);
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

/* Put `fault_handler` in place for SIGBUS and SIGSEGV unless it is there already (a handler
 * installed after ours, e.g. `faulthandler.enable()`, becomes the one we chain to): 0, or -1
 * with errno set. */
static int fault_guard_install(void)
{
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = fault_handler;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    for (int i = 0; i < 2; i++) {
        struct sigaction now;
        if (sigaction(fault_signals[i], NULL, &now) < 0)
            return -1;
        if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == fault_handler)
            continue;
        if (sigaction(fault_signals[i], &ours, &fault_before[i]) < 0)
            return -1;
    }
    return 0;
}

/* Around the copy of one value: the guard on before, off after (the signal fences keep the
 * copy's loads and stores between them). */
static inline void fault_guard_on(sigjmp_buf *jump)
{
    fault_jump = jump;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void fault_guard_off(void)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    fault_jump = NULL;
}

/* The guard as other extensions reach it (`../common/faultguard.h`: FAULT_GUARD's capsule). */
static void fault_guard_on_call(sigjmp_buf *jump) { fault_guard_on(jump); }
static void fault_guard_off_call(void) { fault_guard_off(); }
static const MaruFaultGuard fault_guard_export = {fault_guard_on_call, fault_guard_off_call};

/* A synchronous fault in a thread that blocks the signal is not delivered but kills the
 * process: a thread that copies (a copier) must not block SIGBUS or SIGSEGV. */
static void fault_signals_unblock(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGBUS);
    sigaddset(&set, SIGSEGV);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
}

static PyObject *CopyFaultError; /* maru.common._memcopy.CopyFaultError (an OSError) */

/* Raise CopyFaultError for a copy (`what`: its name) in which `faults` of `n` values (or
 * buffers) faulted, `faulted[i]` 1 for those (NULL: all): its `faulted` attribute, as
 * bytes. NULL. */
static PyObject *copy_fault_raise(const char *what, const uint8_t *faulted, Py_ssize_t n,
                                  Py_ssize_t faults)
{
    PyObject *flags = PyBytes_FromStringAndSize((const char *)faulted, faulted ? n : 0);
    if (flags != NULL && faulted == NULL) /* (no memory for the flags: all of them) */
        memset(PyBytes_AS_STRING(flags), 1, (size_t)n);
    PyObject *message = PyUnicode_FromFormat(
        "%s: %zd of %zd faulted (the pool's file truncated, out of room, or unmapped): "
        "not copied", what, faults, n);
    PyObject *exc = flags != NULL && message != NULL
                        ? PyObject_CallFunction(CopyFaultError, "iO", EFAULT, message)
                        : NULL;
    if (exc != NULL && PyObject_SetAttrString(exc, "faulted", flags) == 0)
        PyErr_SetObject(CopyFaultError, exc);
    Py_XDECREF(exc);
    Py_XDECREF(message);
    Py_XDECREF(flags);
    return NULL;
}

/* One buffer of copy_many, guarded (see "faults during a copy"): 0, or -1 if it faulted.
 * Either side may be the pool: in software coherence (`coh`) its source is invalidated
 * first and its destination's cached stores written back. */
static int copy_one_guarded(char *d, const char *s, size_t n, int streaming, int coh)
{
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0))
        return -1;
    fault_guard_on(&jump);
    if (coh)
        coh_invalidate(s, n);
    copy_bytes(d, s, n, streaming, 1, coh);
    fault_guard_off();
    return 0;
}

/* Value (or buffer) `i` of `n` faulted: flagged in `*faulted` (made, zeroed, on the first
 * fault; no GIL needed; without memory every value counts as faulted), counted in `*faults`. */
static void fault_mark(uint8_t **faulted, Py_ssize_t n, Py_ssize_t i, Py_ssize_t *faults)
{
    if (*faulted == NULL)
        *faulted = PyMem_RawCalloc((size_t)(n ? n : 1), 1);
    if (*faulted != NULL)
        (*faulted)[i] = 1;
    (*faults)++;
}

/* `size`: one size for every buffer, or an int64 array of one per buffer (a page's parts of
 * unlike sizes, copied page by page: sources read in address order run up to 18% faster at
 * 64 KiB pages than part by part, docs/performance.md). */
static PyObject *copy_many(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *size_obj;
    int streaming = 1;
    if (!PyArg_ParseTuple(args, "OOO|p:copy_many", &dst_obj, &src_obj, &size_obj, &streaming))
        return NULL;
    Py_ssize_t size = 0;
    Py_buffer sizes = {0};
    int per_buffer = !PyLong_Check(size_obj);
    if (!per_buffer && (size = PyLong_AsSsize_t(size_obj)) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy_many: size must not be negative");
        return NULL;
    }
    if (per_buffer && int64_buffer(size_obj, &sizes, "sizes") < 0)
        return NULL;
    Py_buffer dst = {0}, src = {0};
    PyObject *out = NULL;
    if (int64_buffer(dst_obj, &dst, "dst") < 0 || int64_buffer(src_obj, &src, "src") < 0)
        goto done;
    Py_ssize_t n = dst.len / 8;
    if (src.len / 8 != n || (per_buffer && sizes.len / 8 != n)) {
        PyErr_Format(PyExc_ValueError, "copy_many: %zd destinations for %zd sources and %zd sizes",
                     n, src.len / 8, per_buffer ? sizes.len / 8 : n);
        goto done;
    }
    const int64_t *d = (const int64_t *)dst.buf, *s = (const int64_t *)src.buf;
    const int64_t *z = per_buffer ? (const int64_t *)sizes.buf : NULL;
    for (Py_ssize_t i = 0; z != NULL && i < n; i++)
        if (z[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_many: sizes must not be negative");
            goto done;
        }
    Py_ssize_t faults = 0;
    uint8_t *faulted = NULL;
    int coh = coh_software;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (copy_one_guarded((char *)(intptr_t)d[i], (const char *)(intptr_t)s[i],
                             (size_t)(z != NULL ? z[i] : size), streaming, coh) < 0)
            fault_mark(&faulted, n, i, &faults);
    coh_fence(streaming, coh);
    Py_END_ALLOW_THREADS
    out = faults ? copy_fault_raise("copy_many: buffers", faulted, n, faults) : Py_NewRef(Py_None);
    PyMem_RawFree(faulted);
done:
    if (dst.obj != NULL)
        PyBuffer_Release(&dst);
    if (src.obj != NULL)
        PyBuffer_Release(&src);
    if (sizes.obj != NULL)
        PyBuffer_Release(&sizes);
    return out;
}


/* Where the one-pass loop cannot run: bytes copied, then hashed, at a time (still in L1). Measured
 * (1 MiB pages, streaming): 4 KiB costs 0-6% over a plain copy, 8 KiB 10-20%, 32 KiB 25-30%;
 * and 4 KiB is the least that still streams (STREAMING_MIN_BYTES). */
#define HASH_BLOCK_BYTES 4096

/* One part of a value: copied from `from` to `to` and added to the value's hash `st`
 * (`wb`: see copy_bytes; the one-pass loop's stores all stream). */
static void copy_part_hashed(m64_state *st, char *to, const uint8_t *from, size_t size,
                             int streaming, int wb)
{
    size_t off = 0, step;
#if HAVE_STREAMING
    /* One pass where it can: whole stripes loaded once, streamed out and hashed from the same
     * registers; the last partial stripe (and anything else) below. */
    if (streaming && m64_copy != NULL && st->held == 0 && ((uintptr_t)to & 63) == 0 &&
        size >= STREAMING_MIN_BYTES &&
        !(to < (const char *)from + size && (const char *)from < to + size)) {
        off = size & ~(size_t)(M64_STRIPE - 1);
        st->pos = m64_copy(st->acc, to, from, off / M64_STRIPE, st->pos);
        st->len += off;
    }
#endif
    for (; off < size; off += step) {
        /* (a last piece under a block joins the one before: every piece streams) */
        step = size - off < 2 * HASH_BLOCK_BYTES ? size - off : HASH_BLOCK_BYTES;
        copy_bytes(to + off, (const char *)from + off, step, streaming, 0, wb);
        m64_update(st, from + off, step);
    }
}

/* Value `v` of copy_many_hashed (its `parts` buffers from `first`; `d` NULL: only hashed),
 * guarded: 0 and its maru64 in `*hash`, or -1 if it faulted (`*hash` 0). Either side may be
 * the pool (software coherence: as copy_one_guarded). */
static int copy_hashed_guarded(const int64_t *d, const int64_t *s, const int64_t *z,
                               Py_ssize_t first, Py_ssize_t parts, int streaming, int coh,
                               int64_t *hash)
{
    sigjmp_buf jump;
    m64_state st;
    if (sigsetjmp(jump, 0)) {
        *hash = 0;
        return -1;
    }
    fault_guard_on(&jump);
    m64_begin(&st);
    for (Py_ssize_t b = first; b < first + parts; b++) {
        const uint8_t *from = (const uint8_t *)(intptr_t)s[b];
        if (coh)
            coh_invalidate((const char *)from, (size_t)z[b]);
        if (d == NULL)
            m64_update(&st, from, (size_t)z[b]);
        else
            copy_part_hashed(&st, (char *)(intptr_t)d[b], from, (size_t)z[b], streaming, coh);
    }
    *hash = m64_finish(&st);
    fault_guard_off();
    return 0;
}

static PyObject *copy_many_hashed(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *sizes_obj;
    Py_ssize_t parts;
    int streaming = 1;
    if (!PyArg_ParseTuple(args, "OOOn|p:copy_many_hashed", &dst_obj, &src_obj, &sizes_obj,
                          &parts, &streaming))
        return NULL;
    if (parts < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_many_hashed: parts must be at least 1");
        return NULL;
    }
    Py_buffer dst = {0}, src, sizes;
    int have_dst = dst_obj != Py_None;
    PyObject *out = NULL;
    if (int64_buffer(src_obj, &src, "src") < 0)
        return NULL;
    if (int64_buffer(sizes_obj, &sizes, "sizes") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (have_dst && int64_buffer(dst_obj, &dst, "dst") < 0)
        goto done;
    Py_ssize_t n = src.len / 8;
    if (sizes.len / 8 != n || (have_dst && dst.len / 8 != n) || n % parts) {
        PyErr_Format(PyExc_ValueError,
                     "copy_many_hashed: %zd sources, %zd sizes and %zd destinations do not "
                     "make values of %zd parts",
                     n, sizes.len / 8, have_dst ? dst.len / 8 : n, parts);
        goto done;
    }
    const int64_t *d = have_dst ? (const int64_t *)dst.buf : NULL;
    const int64_t *s = (const int64_t *)src.buf, *z = (const int64_t *)sizes.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (z[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_many_hashed: sizes must not be negative");
            goto done;
        }
    Py_ssize_t values = n / parts;
    out = PyBytes_FromStringAndSize(NULL, values * 8);
    if (out == NULL)
        goto done;
    int64_t *hashes = (int64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t faults = 0;
    uint8_t *faulted = NULL;
    int coh = coh_software;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t v = 0; v < values; v++)
        if (copy_hashed_guarded(d, s, z, v * parts, parts, streaming, coh, hashes + v) < 0)
            fault_mark(&faulted, values, v, &faults);
    if (d != NULL)
        coh_fence(streaming, coh);
    Py_END_ALLOW_THREADS
    if (faults)
        Py_SETREF(out, copy_fault_raise("copy_many_hashed: values", faulted, values, faults));
    PyMem_RawFree(faulted);
done:
    if (have_dst && dst.obj != NULL)
        PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&sizes);
    return out;
}

/* Values stored as their parts back to back (a KV page in the pool) and their parts' buffers
 * elsewhere (a host pool's or device pool's pages): value v starts at `starts[v]` (0: skip it,
 * a miss), its part j is `sizes[j]` bytes at `starts[v] + sizes[0] + ... + sizes[j-1]`, and
 * `buffers[v * parts + j]` is that part's other side. `to_values`: buffers -> values (a store),
 * else values -> buffers (a load). Value by value, each value's parts in address order. With
 * `hashed`, returns each value's maru64 as copied (0 for a skipped value). One call does what
 * the (values, parts) address arrays of `copy_many` took three numpy steps to set up. */
/* The data path's copy (no GIL, no Python): value v is its parts of sizes[j] back to back from
 * starts[v] (0: skipped), each part's other side at buffers[v * parts + j]; to_values copies
 * buffers -> values, else values -> buffers. With `hashes` (not NULL), hashes[v] is the maru64
 * of value v's bytes (0 where skipped). The local index's fused read (`_shmindex.c`,
 * `Reader.read`) calls it through `copy_values_threads` and the capsule `COPY_VALUES`: one
 * loop for both. */
/* Value `v`'s parts (see copy_values_run) from `value`, guarded: 0, or -1 if it faulted. The
 * value is the pool's side: in software coherence a read invalidates its lines first, a
 * store writes back its cached stores. */
static int copy_value_guarded(char *value, const int64_t *buffers, const int64_t *sizes,
                              Py_ssize_t parts, int to_values, int streaming, int coh,
                              int64_t *hash)
{
    sigjmp_buf jump;
    m64_state st;
    if (sigsetjmp(jump, 0)) {
        if (hash != NULL)
            *hash = 0;
        return -1;
    }
    fault_guard_on(&jump);
    if (coh && !to_values) {
        size_t bytes = 0;
        for (Py_ssize_t j = 0; j < parts; j++)
            bytes += (size_t)sizes[j];
        coh_invalidate(value, bytes);
    }
    if (hash != NULL)
        m64_begin(&st);
    for (Py_ssize_t j = 0; j < parts; j++) {
        char *buffer = (char *)(intptr_t)buffers[j];
        char *to = to_values ? value : buffer;
        const char *from = to_values ? buffer : value;
        size_t size = (size_t)sizes[j];
        if (hash != NULL)
            copy_part_hashed(&st, to, (const uint8_t *)from, size, streaming, coh && to_values);
        else
            copy_bytes(to, from, size, streaming, 1, coh && to_values);
        value += size;
    }
    if (hash != NULL)
        *hash = m64_finish(&st);
    fault_guard_off();
    return 0;
}

/* Returns how many values faulted (see "faults during a copy"), each flagged 1 in `faulted`
 * (one byte per value, left as it is for the others); those are not copied whole (a store of
 * them fails, a read of them is a miss) and their hashes are 0. */
static Py_ssize_t copy_values_run(const int64_t *starts, const int64_t *buffers,
                                  const int64_t *sizes, Py_ssize_t values, Py_ssize_t parts,
                                  int to_values, int streaming, int64_t *hashes,
                                  uint8_t *faulted)
{
    Py_ssize_t faults = 0;
    int coh = coh_software; /* (once per call: see "coherence") */
    for (Py_ssize_t v = 0; v < values; v++) {
        char *value = (char *)(intptr_t)starts[v];
        if (value == NULL) {
            if (hashes != NULL)
                hashes[v] = 0;
            continue;
        }
        if (copy_value_guarded(value, buffers + v * parts, sizes, parts, to_values, streaming,
                               coh, hashes != NULL ? hashes + v : NULL) < 0) {
            faulted[v] = 1;
            faults++;
        }
    }
    coh_fence(streaming, coh);
    return faults;
}

/* ---- copy_values on several threads -------------------------------------------------------
 *
 * One core's copy loop moves less than the memory can take (a core has only so many misses in
 * flight, and memory with CXL's latency needs more of them): `copy_values_threads` shares a
 * copy of at least 2 * SPLIT_MIN_BYTES between the calling thread and copier threads. The
 * values are not split in fixed shares: every thread takes the next BLOCK_BYTES of values from
 * one cursor until none are left. A copier that wakes late (a wake-up costs ~20-60 us on a
 * VM) or shares its core with another process (the server, on a small machine) then copies
 * less, and the caller never waits for more than the block a copier is in; a copier that has
 * not woken by the time the caller took the last block is called off. Copier i is a native
 * thread of this process, started on first use; it never touches Python objects (no GIL).
 * The call returns when every block is copied: each thread's sfence and the lock that
 * publishes "done" order the bytes before anything the caller does next (a write registers
 * its keys, a read checks its entries). A copier busy with another thread's copy, or one that
 * cannot be started, is not asked. After a fork the child starts copiers of its own (only the
 * forking thread lives on there: no copy of the parent's is waited for in the child).
 *
 * A copier is a helper, never the caller's rival: it runs under SCHED_BATCH, so that its wake-up
 * does not preempt the thread that woke it. On a small VM whose scheduler places a woken
 * thread on the waker's CPU, a copier of normal policy took the caller's CPU at once, and the
 * caller's Python between its copies (the write's registration, the reply it sends) waited
 * for the copier's time slice: a 64 KiB batch_set_v1 moved 59% of the one-thread limit, 72%
 * with the copier under SCHED_BATCH (benchmarks/results/history.md, session 25). Where a CPU is
 * idle, it runs there as before; where none is, the caller copies the blocks it would have.
 * (Copiers of a process at a real-time policy inherit it and keep it.) */

#define MAX_COPIERS 15
#define SPLIT_MIN_BYTES (1 << 20)
#define BLOCK_BYTES (256 << 10)

typedef struct {
    const int64_t *starts, *buffers, *sizes;
    Py_ssize_t values, parts, block; /* block: values a thread takes at a time */
    int to_values, streaming;
    int64_t *hashes;
    uint8_t *faulted; /* a byte per value: 1 where it faulted (copy_values_run) */
    Py_ssize_t next;  /* the first value no thread has taken (atomic) */
    int helpers;      /* copiers asked and not finished, under copier_lock */
    Py_ssize_t faults; /* values that faulted (atomic) */
} CopyJob;

typedef struct {
    pthread_cond_t posted; /* a job was put in `job` */
    CopyJob *job;          /* the job this copier runs or was asked to (NULL: idle) */
    int running;           /* it has taken `job` (cannot be called off any more) */
    pid_t pid;             /* the process in which this copier runs (0: not started) */
} Copier;

static pthread_mutex_t copier_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t copier_done = PTHREAD_COND_INITIALIZER;
static Copier copiers[MAX_COPIERS];
static uint64_t copier_tasks = 0;  /* times a copier was asked to share a copy (tests) */
static uint64_t copiers_called_off = 0; /* of those, called off before they woke */

/* Copy blocks of `job` until every value is taken. */
static void copy_job_work(CopyJob *job)
{
    for (;;) {
        Py_ssize_t a = __atomic_fetch_add(&job->next, job->block, __ATOMIC_RELAXED);
        if (a >= job->values)
            return;
        Py_ssize_t n = job->values - a < job->block ? job->values - a : job->block;
        Py_ssize_t faults = copy_values_run(
            job->starts + a, job->buffers + a * job->parts, job->sizes, n, job->parts,
            job->to_values, job->streaming, job->hashes != NULL ? job->hashes + a : NULL,
            job->faulted + a);
        if (faults)
            __atomic_fetch_add(&job->faults, faults, __ATOMIC_RELAXED);
    }
}

static void *copier_main(void *arg)
{
    Copier *c = (Copier *)arg;
#if defined(__linux__)
    int policy;
    struct sched_param param;
    if (pthread_getschedparam(pthread_self(), &policy, &param) == 0 && policy == SCHED_OTHER) {
        param.sched_priority = 0; /* (see above; best effort; a real-time process keeps its policy) */
        (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
    }
    pthread_setname_np(pthread_self(), "maru-copier"); /* (top -H, /proc/<pid>/task) */
#endif
    fault_signals_unblock(); /* (started with every signal blocked: copier_ready) */
    pthread_mutex_lock(&copier_lock);
    for (;;) {
        while (c->job == NULL) /* (also after a job was called off before we woke) */
            pthread_cond_wait(&c->posted, &copier_lock);
        CopyJob *job = c->job;
        c->running = 1;
        pthread_mutex_unlock(&copier_lock);
        copy_job_work(job);
        pthread_mutex_lock(&copier_lock);
        c->running = 0;
        c->job = NULL;
        job->helpers--;
        pthread_cond_broadcast(&copier_done);
    }
    return NULL;
}

static void copiers_init(void)
{
    for (int i = 0; i < MAX_COPIERS; i++) {
        pthread_cond_init(&copiers[i].posted, NULL);
        copiers[i].job = NULL;
        copiers[i].running = 0;
        copiers[i].pid = 0;
    }
}

static void copiers_after_fork(void)
{
    pthread_mutex_init(&copier_lock, NULL);
    pthread_cond_init(&copier_done, NULL);
    copiers_init();
}

/* With copier_lock held: whether copier `c` runs in this process (started now if not). */
static int copier_ready(Copier *c)
{
    pid_t pid = getpid();
    if (c->pid == pid)
        return 1;
    pthread_t thread;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Asynchronous signals (SIGINT, SIGTERM...) go to the process's own threads, whose waits
     * they must interrupt: the copier starts with them all blocked. */
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    int ok = pthread_create(&thread, &attr, copier_main, c) == 0;
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    pthread_attr_destroy(&attr);
    if (ok)
        c->pid = pid;
    return ok;
}

/* How many copiers a copy of `values` values (parts of `sizes`) asks to share it, at most one
 * thread per SPLIT_MIN_BYTES (0: the calling thread alone), and the values in a block. */
static int copy_plan(const int64_t *sizes, Py_ssize_t values, Py_ssize_t parts, int streaming,
                     int threads, Py_ssize_t *block)
{
    int64_t value_bytes = 0;
    for (Py_ssize_t j = 0; j < parts; j++)
        value_bytes += sizes[j];
    int64_t by_size = value_bytes > 0 ? (int64_t)values * value_bytes / SPLIT_MIN_BYTES : 0;
    int64_t helpers = threads - 1;
    if (helpers > MAX_COPIERS)
        helpers = MAX_COPIERS;
    if (helpers > values - 1)
        helpers = values - 1;
    if (helpers > by_size - 1)
        helpers = by_size - 1;
    if (helpers <= 0 || !streaming)
        return 0;
    *block = value_bytes >= BLOCK_BYTES ? 1 : (Py_ssize_t)(BLOCK_BYTES / value_bytes);
    return (int)helpers;
}

/* Ask up to `helpers` idle copiers to share `job` (asked[i]: copier i was). */
static void copy_job_post(CopyJob *job, int helpers, int *asked)
{
    if (helpers == 0) /* (a small copy: no lock taken) */
        return;
    pthread_mutex_lock(&copier_lock);
    for (int i = 0; i < helpers; i++) {
        Copier *c = &copiers[i];
        asked[i] = c->job == NULL && copier_ready(c);
        if (asked[i]) {
            c->job = job;
            job->helpers++;
            copier_tasks++;
            pthread_cond_signal(&c->posted);
        }
    }
    pthread_mutex_unlock(&copier_lock);
}

/* The caller's part: blocks until none are left, then the copiers asked are called off (not
 * woken yet) or waited for (one block at most). */
static void copy_job_finish(CopyJob *job, int helpers, const int *asked)
{
    copy_job_work(job);
    if (helpers == 0)
        return;
    pthread_mutex_lock(&copier_lock);
    for (int i = 0; i < helpers; i++)
        if (asked[i] && copiers[i].job == job && !copiers[i].running) {
            copiers[i].job = NULL;
            job->helpers--;
            copiers_called_off++;
        }
    while (job->helpers > 0)
        pthread_cond_wait(&copier_done, &copier_lock);
    pthread_mutex_unlock(&copier_lock);
}

/* copy_values_run shared by up to `threads` threads (see above). Needs no GIL. Returns how
 * many values faulted, flagged in `faulted` (a byte per value, zeroed by the caller). */
static Py_ssize_t copy_values_threads(const int64_t *starts, const int64_t *buffers,
                                      const int64_t *sizes, Py_ssize_t values, Py_ssize_t parts,
                                      int to_values, int streaming, int64_t *hashes, int threads,
                                      uint8_t *faulted)
{
    Py_ssize_t block = 1;
    int helpers = copy_plan(sizes, values, parts, streaming, threads, &block);
    if (helpers == 0)
        return copy_values_run(starts, buffers, sizes, values, parts, to_values, streaming,
                               hashes, faulted);
    CopyJob job = {starts, buffers, sizes, values, parts, block, to_values, streaming, hashes,
                   faulted, 0, 0, 0};
    int asked[MAX_COPIERS] = {0};
    copy_job_post(&job, helpers, asked);
    copy_job_finish(&job, helpers, asked);
    return job.faults;
}

static PyObject *copier_counts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    pthread_mutex_lock(&copier_lock);
    uint64_t asked = copier_tasks, called_off = copiers_called_off;
    pthread_mutex_unlock(&copier_lock);
    return Py_BuildValue("KK", (unsigned long long)asked, (unsigned long long)called_off);
}

/* ---- copy_values and copy_values_start ------------------------------------------------------
 *
 * One copy from Python's side: the arrays it reads held (buffer views) until it is finished,
 * its checksums' bytes, its job. `copy_values` runs one to the end; `copy_values_start` asks
 * the copiers at once and returns a CopyInFlight, whose `finish()` is the caller's part: the
 * caller does other work (a write builds its registration, reads earlier replies) while the
 * copiers copy, then takes what is left. Bytes are in place only once `finish()` returns. */

typedef struct {
    Py_buffer starts, buffers, sizes;
    PyObject *hashes; /* bytes: the values' maru64s (hashed), else NULL */
    uint8_t *faulted; /* a byte per value: 1 where it faulted */
    CopyJob job;
    int helpers;      /* copiers to ask (0: the caller alone, in finish) */
    int asked[MAX_COPIERS];
    pid_t pid;        /* the process that started it */
    int finished;
} Copy;

static void copy_release(Copy *c)
{
    if (c->starts.obj != NULL)
        PyBuffer_Release(&c->starts);
    if (c->buffers.obj != NULL)
        PyBuffer_Release(&c->buffers);
    if (c->sizes.obj != NULL)
        PyBuffer_Release(&c->sizes);
    Py_CLEAR(c->hashes);
    PyMem_RawFree(c->faulted);
    c->faulted = NULL;
}

/* Parse and check copy_values' arguments into `c` (zeroed by the caller): 0, or -1 with an
 * exception set (the caller releases `c`). */
static int copy_open(Copy *c, PyObject *args, const char *format)
{
    PyObject *starts_obj, *buffers_obj, *sizes_obj;
    int to_values, streaming = 1, hashed = 0, threads = 1;
    if (!PyArg_ParseTuple(args, format, &starts_obj, &buffers_obj, &sizes_obj, &to_values,
                          &streaming, &hashed, &threads))
        return -1;
    if (int64_buffer(starts_obj, &c->starts, "starts") < 0 ||
        int64_buffer(buffers_obj, &c->buffers, "buffers") < 0 ||
        int64_buffer(sizes_obj, &c->sizes, "sizes") < 0)
        return -1;
    Py_ssize_t values = c->starts.len / 8, parts = c->sizes.len / 8;
    if (c->buffers.len / 8 != values * parts) {
        PyErr_Format(PyExc_ValueError, "copy_values: %zd buffers for %zd values of %zd parts",
                     c->buffers.len / 8, values, parts);
        return -1;
    }
    const int64_t *z = (const int64_t *)c->sizes.buf;
    for (Py_ssize_t j = 0; j < parts; j++)
        if (z[j] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_values: sizes must not be negative");
            return -1;
        }
    int64_t *hashes = NULL;
    if (hashed) {
        if ((c->hashes = PyBytes_FromStringAndSize(NULL, values * 8)) == NULL)
            return -1;
        hashes = (int64_t *)PyBytes_AS_STRING(c->hashes);
    }
    if ((c->faulted = PyMem_RawCalloc((size_t)(values ? values : 1), 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t block = values > 0 ? values : 1;
    c->helpers = copy_plan(z, values, parts, streaming, threads, &block);
    c->job = (CopyJob){(const int64_t *)c->starts.buf, (const int64_t *)c->buffers.buf, z,
                       values, parts, block, to_values, streaming, hashes, c->faulted, 0, 0,
                       0};
    c->pid = getpid();
    return 0;
}

/* The caller's part of `c` (see copy_job_finish). Needs no GIL. In a child forked while it was
 * in flight the parent's copiers are not there: the child copies all of it itself. */
static void copy_finish(Copy *c)
{
    if (c->finished)
        return;
    if (c->pid != getpid()) {
        c->job.next = 0;
        c->job.helpers = 0;
        c->helpers = 0;
    }
    copy_job_finish(&c->job, c->helpers, c->asked);
    c->finished = 1;
}

/* What a finished copy returns: its hashes (or None), or CopyFaultError where values
 * faulted. */
static PyObject *copy_result(const Copy *c)
{
    if (c->job.faults)
        return copy_fault_raise("copy_values: values", c->faulted, c->job.values, c->job.faults);
    return c->hashes != NULL ? Py_NewRef(c->hashes) : Py_NewRef(Py_None);
}

static PyObject *copy_values(PyObject *self, PyObject *args)
{
    (void)self;
    Copy c = {0};
    PyObject *out = NULL;
    if (copy_open(&c, args, "OOOp|ppi:copy_values") == 0) {
        Py_BEGIN_ALLOW_THREADS
        copy_job_post(&c.job, c.helpers, c.asked);
        copy_finish(&c);
        Py_END_ALLOW_THREADS
        out = copy_result(&c);
    }
    copy_release(&c);
    return out;
}

typedef struct {
    PyObject_HEAD
    Copy copy;
} CopyInFlight;

static PyObject *CopyInFlight_finish(CopyInFlight *self, PyObject *unused)
{
    (void)unused;
    if (!self->copy.finished) {
        Py_BEGIN_ALLOW_THREADS
        copy_finish(&self->copy);
        Py_END_ALLOW_THREADS
    }
    return copy_result(&self->copy);
}

static void CopyInFlight_dealloc(CopyInFlight *self)
{
    if (!self->copy.finished) { /* (the copiers must be done with the arrays first) */
        Py_BEGIN_ALLOW_THREADS
        copy_finish(&self->copy);
        Py_END_ALLOW_THREADS
    }
    copy_release(&self->copy);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef CopyInFlight_methods[] = {
    {"finish", (PyCFunction)CopyInFlight_finish, METH_NOARGS,
     "finish() -> bytes or None: take the blocks no copier took, wait for the copiers, then\n"
     "what copy_values returns. The bytes are in place only once it returns."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyInFlightType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.common._memcopy.CopyInFlight",
    .tp_basicsize = sizeof(CopyInFlight),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy_values_start copy: finish() completes it.",
    .tp_dealloc = (destructor)CopyInFlight_dealloc,
    .tp_methods = CopyInFlight_methods,
};

/* ---- CopyGate: RegionMapper.copying()'s block ------------------------------------------------
 * Every copy of the data path runs inside the block, from before it takes addresses in mapped
 * regions to its end; a region is unmapped only while no block is open (maru.client.mapping).
 * The count is changed under the GIL, so entering and leaving is two C calls and no lock: the
 * mapper's Python callback `on_idle` runs only when the last block closes while the mapper asked
 * for it (`wanted`: a region waits to be closed, or close() waits for the copies). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t active; /* blocks open */
    int wanted;        /* call on_idle when active drops to 0 */
    PyObject *on_idle;
} CopyGate;

static int CopyGate_init(CopyGate *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"on_idle", NULL};
    PyObject *on_idle;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:CopyGate", kwlist, &on_idle))
        return -1;
    if (!PyCallable_Check(on_idle)) {
        PyErr_SetString(PyExc_TypeError, "CopyGate: on_idle must be callable");
        return -1;
    }
    Py_INCREF(on_idle);
    Py_XSETREF(self->on_idle, on_idle);
    return 0;
}

static int CopyGate_traverse(CopyGate *self, visitproc visit, void *arg)
{
    Py_VISIT(self->on_idle); /* (a mapper's method: the mapper holds the gate) */
    return 0;
}

static int CopyGate_clear(CopyGate *self)
{
    Py_CLEAR(self->on_idle);
    return 0;
}

static void CopyGate_dealloc(CopyGate *self)
{
    PyObject_GC_UnTrack(self);
    CopyGate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *CopyGate_enter(CopyGate *self, PyObject *unused)
{
    (void)unused;
    self->active++;
    Py_RETURN_NONE;
}

static PyObject *CopyGate_exit(CopyGate *self, PyObject *args)
{
    (void)args;
    if (self->active > 0)
        self->active--;
    if (self->active == 0 && self->wanted && self->on_idle != NULL) {
        PyObject *out = PyObject_CallNoArgs(self->on_idle);
        if (out == NULL)
            return NULL;
        Py_DECREF(out);
    }
    Py_RETURN_FALSE; /* (an exception in the block goes on) */
}

static PyObject *CopyGate_get_active(CopyGate *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->active);
}

static PyObject *CopyGate_get_wanted(CopyGate *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->wanted);
}

static int CopyGate_set_wanted(CopyGate *self, PyObject *value, void *closure)
{
    (void)closure;
    int wanted = value == NULL ? 0 : PyObject_IsTrue(value);
    if (wanted < 0)
        return -1;
    self->wanted = wanted;
    return 0;
}

static PyMethodDef CopyGate_methods[] = {
    {"__enter__", (PyCFunction)CopyGate_enter, METH_NOARGS, "Open a block."},
    {"__exit__", (PyCFunction)CopyGate_exit, METH_VARARGS,
     "Close a block; the last one calls on_idle() if wanted."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CopyGate_getset[] = {
    {"active", (getter)CopyGate_get_active, NULL, "Blocks open now.", NULL},
    {"wanted", (getter)CopyGate_get_wanted, (setter)CopyGate_set_wanted,
     "Whether the last block to close calls on_idle().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyGateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "maru.common._memcopy.CopyGate",
    .tp_basicsize = sizeof(CopyGate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)CopyGate_traverse,
    .tp_clear = (inquiry)CopyGate_clear,
    .tp_doc = "CopyGate(on_idle): RegionMapper.copying()'s block; reentrant, shared by threads.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CopyGate_init,
    .tp_dealloc = (destructor)CopyGate_dealloc,
    .tp_methods = CopyGate_methods,
    .tp_getset = CopyGate_getset,
};

static PyObject *copy_values_start(PyObject *self, PyObject *args)
{
    (void)self;
    CopyInFlight *flight = PyObject_New(CopyInFlight, &CopyInFlightType);
    if (flight == NULL)
        return NULL;
    memset(&flight->copy, 0, sizeof(Copy));
    if (copy_open(&flight->copy, args, "OOOp|ppi:copy_values_start") < 0) {
        flight->copy.finished = 1; /* (nothing asked) */
        Py_DECREF(flight);
        return NULL;
    }
    copy_job_post(&flight->copy.job, flight->copy.helpers, flight->copy.asked);
    return (PyObject *)flight;
}

/* page_pointers(address, count, page, affine) -> bytes: the host pool's side of a batch of KV
 * pages, for a pool whose parts lie at affine addresses: `count` int64 token indices at
 * `address` (memory the caller keeps alive: an SGLang host-indices tensor's data, read in
 * place), page p starts at token indices[p * page], and its part j at
 * affine[j][0] + indices[p * page] * affine[j][1]; (pages, parts) native int64s. One call
 * instead of the numpy steps (a slice, a cast, a broadcast multiply and add), each of which
 * costs ~5-10 us from caches a page copy has just flushed; taking an address rather than a
 * buffer lets the caller pass a tensor's data without making an array of it. */
static int cmp_int64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Why the count indices at `first` are not whole pages of a pool of `slots` indices (each page
 * `page` consecutive indices from a multiple of `page`, below `slots`; with `distinct`, no page
 * twice), set as ValueError; 0 if they are. An index outside would address memory that is not
 * the page's, or not the pool's: a get writing over it, a set storing it under a key. */
static int page_misfit(const int64_t *first, Py_ssize_t count, Py_ssize_t page, int64_t slots,
                       int distinct)
{
    Py_ssize_t pages = count / page;
    for (Py_ssize_t p = 0; p < pages; p++) {
        const int64_t *run = first + p * page, f = run[0];
        if (f < 0 || f >= slots) {
            PyErr_Format(PyExc_ValueError, "a page outside the host pool (index %lld of %lld)",
                         (long long)f, (long long)slots);
            return -1;
        }
        int aligned = f % page == 0;
        for (Py_ssize_t j = 1; aligned && j < page; j++)
            aligned = run[j] == f + j;
        if (!aligned) {
            PyErr_Format(PyExc_ValueError, "a page that is not one run of %zd slots from a page "
                         "boundary (first index %lld)", page, (long long)f);
            return -1;
        }
    }
    if (!distinct || pages < 2)
        return 0;
    int64_t *sorted = PyMem_Malloc(sizeof(int64_t) * (size_t)pages);
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t p = 0; p < pages; p++)
        sorted[p] = first[p * page];
    qsort(sorted, (size_t)pages, sizeof(int64_t), cmp_int64);
    int twice = 0;
    for (Py_ssize_t p = 1; p < pages && !twice; p++)
        twice = sorted[p] == sorted[p - 1];
    PyMem_Free(sorted);
    if (twice) {
        PyErr_SetString(PyExc_ValueError, "one host page given for two keys");
        return -1;
    }
    return 0;
}

static PyObject *page_pointers(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"address", "count", "page", "affine", "slots", "distinct", NULL};
    PyObject *affine_obj;
    unsigned long long address;
    Py_ssize_t count, page;
    long long slots = -1;
    int distinct = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KnnO|$Lp:page_pointers", names, &address,
                                     &count, &page, &affine_obj, &slots, &distinct))
        return NULL;
    Py_buffer affine = {0};
    PyObject *out = NULL;
    if (int64_buffer(affine_obj, &affine, "affine") < 0)
        return NULL;
    Py_ssize_t parts = affine.len / 16;
    if (page <= 0 || count < 0 || count % page || affine.len % 16 ||
        (count > 0 && (address == 0 || address % 8))) {
        PyErr_SetString(PyExc_ValueError, "page_pointers: whole pages of aligned int64 indices, "
                                          "affine rows of (base, stride)");
        goto done;
    }
    Py_ssize_t pages = count / page;
    const int64_t *first = (const int64_t *)(uintptr_t)address, *a = (const int64_t *)affine.buf;
    if (slots >= 0 && page_misfit(first, count, page, slots, distinct) < 0)
        goto done;
    if ((out = PyBytes_FromStringAndSize(NULL, pages * parts * 8)) == NULL)
        goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t p = 0; p < pages; p++)
        for (Py_ssize_t j = 0; j < parts; j++)
            o[p * parts + j] = a[2 * j] + first[p * page] * a[2 * j + 1];
done:
    PyBuffer_Release(&affine);
    return out;
}

static PyObject *guard_faults(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (fault_guard_install() < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static const char *const flush_names[] = {"", "clflush", "clflushopt", "clwb"};

/* One range of flush_ranges, guarded: 0, or -1 if it faulted. */
static int flush_one_guarded(const char *p, size_t n, int invalidate)
{
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0))
        return -1;
    fault_guard_on(&jump);
    if (invalidate)
        coh_invalidate(p, n);
    else
        coh_write_back(p, n);
    fault_guard_off();
    return 0;
}

/* flush_ranges(addresses, lengths, invalidate): software coherence for bytes the copy loops
 * did not move (a value written in place through `alloc`, or DMA'd; one read in place through
 * a view): see maru.client.coherence. Nothing in hardware mode. */
static PyObject *flush_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *addresses_obj, *lengths_obj;
    int invalidate;
    if (!PyArg_ParseTuple(args, "OOp:flush_ranges", &addresses_obj, &lengths_obj, &invalidate))
        return NULL;
    Py_buffer addresses = {0}, lengths = {0};
    PyObject *out = NULL;
    if (int64_buffer(addresses_obj, &addresses, "addresses") < 0 ||
        int64_buffer(lengths_obj, &lengths, "lengths") < 0)
        goto done;
    Py_ssize_t n = addresses.len / 8;
    if (lengths.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "flush_ranges: %zd addresses for %zd lengths", n,
                     lengths.len / 8);
        goto done;
    }
    const int64_t *a = (const int64_t *)addresses.buf, *z = (const int64_t *)lengths.buf;
    Py_ssize_t faults = 0;
    uint8_t *faulted = NULL;
    if (coh_software) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            if (a[i] != 0 && z[i] > 0 &&
                flush_one_guarded((const char *)(intptr_t)a[i], (size_t)z[i], invalidate) < 0)
                fault_mark(&faulted, n, i, &faults);
        coh_fence(0, 1);
        Py_END_ALLOW_THREADS
    }
    out = faults ? copy_fault_raise("flush_ranges: ranges", faulted, n, faults)
                 : Py_NewRef(Py_None);
    PyMem_RawFree(faulted);
done:
    if (addresses.obj != NULL)
        PyBuffer_Release(&addresses);
    if (lengths.obj != NULL)
        PyBuffer_Release(&lengths);
    return out;
}

/* coherence([mode]): see "coherence" above. */
static PyObject *coherence(PyObject *self, PyObject *args)
{
    (void)self;
    const char *mode = NULL;
    if (!PyArg_ParseTuple(args, "|s:coherence", &mode))
        return NULL;
    PyObject *before = PyUnicode_FromString(coh_software ? "software" : "hardware");
    if (mode == NULL || before == NULL)
        return before;
    if (strcmp(mode, "hardware") == 0)
        coh_software = 0;
    else if (strcmp(mode, "software") == 0 && coh_invalidate_kind != FLUSH_NONE)
        coh_software = 1;
    else {
        Py_DECREF(before);
        if (strcmp(mode, "software") == 0)
            return PyErr_Format(PyExc_OSError,
                                "coherence: software coherence needs x86-64's cache-line "
                                "flushes (clflush), which this CPU or build does not have");
        return PyErr_Format(PyExc_ValueError,
                            "coherence: expected 'hardware' or 'software', got '%s'", mode);
    }
    return before;
}

static PyObject *coherence_counts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "KK", (unsigned long long)__atomic_load_n(&coh_lines_written_back, __ATOMIC_RELAXED),
        (unsigned long long)__atomic_load_n(&coh_lines_invalidated, __ATOMIC_RELAXED));
}

static PyObject *hash_impl(PyObject *self, PyObject *args)
{
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s:hash_impl", &name))
        return NULL;
    PyObject *before = PyUnicode_FromString(m64_impl);
    if (name == NULL || before == NULL)
        return before;
    int ok = 1;
    if (strcmp(name, "scalar") == 0) {
        m64_stripes = m64_stripes_scalar;
        m64_copy = NULL;
        m64_impl = "scalar";
    }
#if HAVE_X86_DISPATCH
    else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        m64_stripes = m64_stripes_avx2;
        m64_copy = m64_copy_avx2;
        m64_impl = "avx2";
    } else if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        m64_stripes = m64_stripes_avx512;
        m64_copy = m64_copy_avx512;
        m64_impl = "avx512";
    }
#endif
    else if (strcmp(name, "auto") == 0)
        m64_pick_impl();
    else
        ok = 0;
    if (!ok) {
        Py_DECREF(before);
        return PyErr_Format(PyExc_ValueError, "hash_impl: %s is not available here", name);
    }
    return before;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dst, src, size, streaming=True): memmove(dst[i], src[i], size) for the int64\n"
     "addresses of dst and src (size: one for all, or an int64 array of one per buffer),\n"
     "without the GIL; see maru.common.memcopy."},
    {"copy_many_hashed", copy_many_hashed, METH_VARARGS,
     "copy_many_hashed(dst, src, sizes, parts, streaming=True) -> bytes: buffer b (int64\n"
     "addresses and sizes) copied from src[b] to dst[b] (dst None: only hashed); every `parts`\n"
     "buffers make a value; the maru64 of each value's bytes, in order, as native int64s."},
    {"copy_values", copy_values, METH_VARARGS,
     "copy_values(starts, buffers, sizes, to_values, streaming=True, hashed=False, threads=1)\n"
     "-> bytes or None: value v (parts of `sizes` back to back from starts[v]; 0: skipped)\n"
     "copied to (to_values False) or from its parts' buffers[v * parts + j]; with hashed, each\n"
     "value's maru64 as native int64s (0 where skipped); shared by up to `threads` threads\n"
     "(streaming only). See maru.common.memcopy.copy_values."},
    {"copy_values_start", copy_values_start, METH_VARARGS,
     "copy_values_start(...) -> CopyInFlight: copy_values' arguments; the copiers start now,\n"
     "the caller's part and the result come with finish()."},
    {"copier_counts", copier_counts, METH_NOARGS,
     "copier_counts() -> (asked, called_off): times this process asked a copier thread to\n"
     "share a copy, and of those the times it was called off before it woke."},
    {"page_pointers", (PyCFunction)(void (*)(void))page_pointers, METH_VARARGS | METH_KEYWORDS,
     "page_pointers(address, count, page, affine, *, slots=-1, distinct=False) -> bytes: of\n"
     "the count int64 indices at address, per page (every page-th index) each part's pointer\n"
     "affine[j][0] + index * affine[j][1], as (pages, parts) int64s. With slots >= 0, first\n"
     "ValueError (saying why) unless every page is page consecutive indices from a multiple\n"
     "of page, below slots; with distinct too, unless no page comes twice."},
    {"hash_impl", hash_impl, METH_VARARGS,
     "hash_impl([name]) -> str: the maru64 loop in use (scalar, avx2, avx512); with a name\n"
     "(or 'auto'), switch to it and return the one before (tests and benchmarks)."},
    {"coherence", coherence, METH_VARARGS,
     "coherence([mode]) -> str: the copies' coherence mode in this process ('hardware' or\n"
     "'software': writers write back the pool lines they wrote with cached stores, readers\n"
     "invalidate a value's lines before they read it); with a mode, switch to it and return\n"
     "the one before. OSError for 'software' where there are no cache-line flushes."},
    {"flush_ranges", flush_ranges, METH_VARARGS,
     "flush_ranges(addresses, lengths, invalidate): in software coherence, each range's cache\n"
     "lines written back (invalidate False: bytes written in place, before they are sealed)\n"
     "or invalidated (True: before bytes are read in place), then fenced; address 0 skipped;\n"
     "CopyFaultError naming the ranges that faulted. Nothing in hardware mode."},
    {"coherence_counts", coherence_counts, METH_NOARGS,
     "coherence_counts() -> (written_back, invalidated): cache lines this process has written\n"
     "back and invalidated in software coherence (tests)."},
    {"guard_faults", guard_faults, METH_NOARGS,
     "guard_faults(): put the SIGBUS/SIGSEGV handler of the copies back in place if another\n"
     "was installed after it (e.g. faulthandler.enable()), chaining to that one outside copies."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "maru.common._memcopy", "Many memcpy calls for one Python call.", -1, methods,
};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    m64_make_keys();
    m64_pick_impl();
#if HAVE_STREAMING && HAVE_X86_DISPATCH
    if (__builtin_cpu_supports("avx512f"))
        stream_wide = stream_avx512;
#endif
    coh_pick_flushes();
    copiers_init();
    if (pthread_atfork(NULL, NULL, copiers_after_fork) != 0)
        return PyErr_NoMemory();
    if (fault_guard_install() < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (CopyFaultError == NULL) {
        CopyFaultError = PyErr_NewExceptionWithDoc(
            "maru.common._memcopy.CopyFaultError",
            "Pool memory faulted during a copy (SIGBUS: its file truncated or its filesystem\n"
            "out of room; SIGSEGV: unmapped). `faulted`: bytes, 1 per value (or buffer) that\n"
            "was not copied; the others were.",
            PyExc_OSError, NULL);
        if (CopyFaultError == NULL)
            return NULL;
    }
    if (PyType_Ready(&CopyInFlightType) < 0 || PyType_Ready(&CopyGateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* COPY_VALUES: copy_values_threads for other extensions (the capsule's name checks the
     * type) */
    PyObject *capsule =
        PyCapsule_New((void *)copy_values_threads, "maru.copy_values_threads.2", NULL);
    /* FAULT_GUARD: the fault guard for other extensions (`../common/faultguard.h`) */
    PyObject *guard = PyCapsule_New((void *)&fault_guard_export, MARU_FAULT_GUARD, NULL);
    int rc = capsule == NULL || guard == NULL ||
             PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAMING) < 0 ||
             PyModule_AddObjectRef(m, "COPY_VALUES", capsule) < 0 ||
             PyModule_AddObjectRef(m, "FAULT_GUARD", guard) < 0 ||
             PyModule_AddStringConstant(m, "FLUSH_WRITE_BACK", flush_names[coh_write_back_kind]) < 0 ||
             PyModule_AddStringConstant(m, "FLUSH_INVALIDATE", flush_names[coh_invalidate_kind]) < 0 ||
             PyModule_AddObjectRef(m, "CopyFaultError", CopyFaultError) < 0 ||
             PyModule_AddObjectRef(m, "CopyGate", (PyObject *)&CopyGateType) < 0;
    Py_XDECREF(capsule);
    Py_XDECREF(guard);
    if (rc) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
