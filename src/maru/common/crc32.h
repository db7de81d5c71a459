/* CRC-32 as zlib computes it (the reflected polynomial 0xEDB88320, `zlib.crc32(data, value)`),
 * for the journal's frames: the same values, so journals written with zlib's CRC replay
 * unchanged.
 *
 * Why not zlib's: a full instance's write puts about 50 KiB of journal records through the CRC
 * (a REGISTER_KV's keys and the keys its eviction drops); zlib's table loop spent 147k
 * instructions a write there, 9% of the server's (benchmarks/bench_server_write.py). With
 * PCLMULQDQ (every x86-64 CPU since 2010) the bulk is folded 64 bytes a step by carry-less
 * multiplication, a few instructions per 16 bytes; elsewhere a slicing-by-8 table loop.
 *
 * How the folding works. Read a message as a polynomial M(x) over GF(2); the CRC register after
 * it, from zero, is M(x) * x^32 mod P(x), so any shorter message with the same M mod P has the
 * same CRC. A 16-byte block X, loaded little-endian into a 128-bit lane (bit i the coefficient
 * of x^(127-i): the reflected order), is H * x^64 + L with H the low and L the high 64-bit half
 * (each reflected). Moving X forward by D bits, onto the block D bits later, is X * x^D ==
 * H * (x^(64+D) mod P) + L * (x^D mod P), two 64x32-bit carry-less products that fit in 128
 * bits; XORed into that later block, the message is 16 bytes shorter and has the same CRC.
 * A carry-less product of two reflected 64-bit values reads as x times the polynomial product in
 * the 128-bit lane, so the constants are x^(63+D) and x^(D-1) mod P (bit i of a constant the
 * coefficient of x^(63-i)): computed with the GF(2) arithmetic in tests/unit/test_crc32.py,
 * which checks every path against zlib. Four lanes fold 64 bytes a step (D = 512), then fold
 * into one (D = 128); the last lane and the tail go through the table loop. The register's
 * starting value is XORed into the first four bytes (the same thing, for a linear CRC). */

#ifndef MARU_CRC32_H
#define MARU_CRC32_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t maru_crc_table[8][256];

/* The tables, once at module init (before any thread can use them). */
static void maru_crc32_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        maru_crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) {
            uint32_t c = maru_crc_table[t - 1][n];
            maru_crc_table[t][n] = (c >> 8) ^ maru_crc_table[0][c & 0xff];
        }
}

/* The register after `n` bytes from register `c` (no pre- or post-inversion): slicing-by-8 on a
 * little-endian host, a byte at a time elsewhere and for the ends. */
static uint32_t maru_crc32_table_run(uint32_t c, const unsigned char *p, size_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const uint32_t(*t)[256] = (const uint32_t(*)[256])maru_crc_table;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
            t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        c = maru_crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MARU_CRC32_CLMUL 1

/* x^(63+D) and x^(D-1) mod P, reflected (see the top): D = 512 (four lanes), D = 128 (one). */
#define MARU_CRC_K512_LO 0x653d982200000000ull
#define MARU_CRC_K512_HI 0xcad38e8f00000000ull
#define MARU_CRC_K128_LO 0x65673b4600000000ull
#define MARU_CRC_K128_HI 0x9ba54c6f00000000ull

__attribute__((target("pclmul,sse2"))) static inline __m128i maru_crc_fold(__m128i x, __m128i k,
                                                                          __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00); /* H (low half) times x^(63+D) */
    __m128i hi = _mm_clmulepi64_si128(x, k, 0x11); /* L (high half) times x^(D-1) */
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The register after `n` >= 64 bytes from register `c`, folding with PCLMULQDQ. */
__attribute__((target("pclmul,sse2"))) static uint32_t maru_crc32_clmul_run(uint32_t c,
                                                                           const unsigned char *p,
                                                                           size_t n)
{
    const __m128i k512 = _mm_set_epi64x((long long)MARU_CRC_K512_HI, (long long)MARU_CRC_K512_LO);
    const __m128i k128 = _mm_set_epi64x((long long)MARU_CRC_K128_HI, (long long)MARU_CRC_K128_LO);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)c));
    p += 64;
    n -= 64;
    for (; n >= 64; p += 64, n -= 64) {
        x0 = maru_crc_fold(x0, k512, _mm_loadu_si128((const __m128i *)p));
        x1 = maru_crc_fold(x1, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = maru_crc_fold(x2, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = maru_crc_fold(x3, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x0 = maru_crc_fold(x0, k128, x1);
    x0 = maru_crc_fold(x0, k128, x2);
    x0 = maru_crc_fold(x0, k128, x3);
    for (; n >= 16; p += 16, n -= 16)
        x0 = maru_crc_fold(x0, k128, _mm_loadu_si128((const __m128i *)p));
    unsigned char lane[16];
    _mm_storeu_si128((__m128i *)lane, x0);
    return maru_crc32_table_run(maru_crc32_table_run(0, lane, 16), p, n);
}
#endif

/* Whether the folding path is used (tests run both). */
static int maru_crc32_use_clmul = -1; /* -1: not decided yet */

static int maru_crc32_clmul(void)
{
#ifdef MARU_CRC32_CLMUL
    if (maru_crc32_use_clmul < 0)
        maru_crc32_use_clmul = __builtin_cpu_supports("pclmul") ? 1 : 0;
    return maru_crc32_use_clmul;
#else
    return 0;
#endif
}

/* zlib.crc32(p[:n], crc). */
static uint32_t maru_crc32(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t c = ~crc;
#ifdef MARU_CRC32_CLMUL
    if (n >= 64 && maru_crc32_clmul())
        return ~maru_crc32_clmul_run(c, p, n);
#endif
    return ~maru_crc32_table_run(c, p, n);
}

#endif /* MARU_CRC32_H */
