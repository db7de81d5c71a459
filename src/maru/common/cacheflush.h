/* cacheflush: the cache-line flushes of software coherence (docs/architecture.md,
 * "Coherence"), shared by `_memcopy.c` (the value copies) and `_shmindex.c` (the key index's
 * slots and header): which flush instructions this CPU has (cpuid, once: `coh_pick_flushes`)
 * and `coh_flush`, every line of a range flushed with one of them. Each extension compiles its
 * own copy of these static functions (as `int64_buffer.h`). x86-64 with GCC or clang only
 * (COH_X86): elsewhere there are no flushes and software coherence is refused. */
#ifndef MARU_CACHEFLUSH_H
#define MARU_CACHEFLUSH_H

#include <stddef.h>
#include <stdint.h>

#define COH_LINE 64
enum { FLUSH_NONE, FLUSH_CLFLUSH, FLUSH_CLFLUSHOPT, FLUSH_CLWB };
static int coh_write_back_kind = FLUSH_NONE; /* the best write-back the CPU has (cpuid, once) */
static int coh_invalidate_kind = FLUSH_NONE; /* the best that also evicts the line */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define COH_X86 1
#include <cpuid.h>
#include <immintrin.h>

static void coh_pick_flushes(void)
{
    unsigned a, b, c, d;
    int clflush = __get_cpuid(1, &a, &b, &c, &d) && (d & (1u << 19));
    int opt = 0, wb = 0;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        opt = (b >> 23) & 1;
        wb = (b >> 24) & 1;
    }
    coh_invalidate_kind = opt ? FLUSH_CLFLUSHOPT : clflush ? FLUSH_CLFLUSH : FLUSH_NONE;
    coh_write_back_kind = wb ? FLUSH_CLWB : coh_invalidate_kind;
}

__attribute__((target("clwb"))) static void coh_lines_clwb(char *p, char *end)
{
    for (; p < end; p += COH_LINE)
        _mm_clwb(p);
}

__attribute__((target("clflushopt"))) static void coh_lines_clflushopt(char *p, char *end)
{
    for (; p < end; p += COH_LINE)
        _mm_clflushopt(p);
}

static void coh_lines_clflush(char *p, char *end)
{
    for (; p < end; p += COH_LINE)
        _mm_clflush(p);
}

/* Every line of [p, p + n) flushed with `kind`; returns the lines. */
static size_t coh_flush(const char *p, size_t n, int kind)
{
    if (n == 0)
        return 0;
    char *first = (char *)((uintptr_t)p & ~(uintptr_t)(COH_LINE - 1));
    char *end = (char *)p + n;
    if (kind == FLUSH_CLWB)
        coh_lines_clwb(first, end);
    else if (kind == FLUSH_CLFLUSHOPT)
        coh_lines_clflushopt(first, end);
    else
        coh_lines_clflush(first, end);
    return (size_t)(end - first + COH_LINE - 1) / COH_LINE;
}
#else
#define COH_X86 0
static void coh_pick_flushes(void) {}
#endif

#endif
