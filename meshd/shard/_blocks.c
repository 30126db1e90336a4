/* GGUF block matmuls for the native lane: y[M, N] = x[M, K] @ W[N, K].T, W kept as the GGUF's own
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks and x quantized to 8 bits per 32-wide block
 * (the trick llama.cpp's ggml uses: integer dot products of a weight block with an activation block,
 * one float scale each). The 32-wide types are met as blocks w = a * u + c, codes unsigned with an
 * offset c (4- and 5-bit types) or signed without one (Q8_0). The K types (Q4_K, Q5_K, Q6_K) take x
 * quantized per 256-wide super-block instead and sum a super-block in integers: each sub-block's
 * product times its integer scale, the mins (Q6_K: its codes' offset of 32) through per-16 sums of
 * x's codes, then one float step per super-block (see "K types" below).
 *
 * Rules this file keeps:
 * - Every output is summed in one fixed order, whatever M, the rows' place in the batch, the number of
 *   threads or the instruction set: per output, eight float lanes accumulate the blocks in K order
 *   (lane j holds elements 4j..4j+3 of every block: exact integer sums, then one fused multiply-add
 *   each), then one fixed horizontal sum, then the offset term. The AVX-512 path (_blocks_avx512.c),
 *   the AVX2 path and the portable path compute the same bits (tested), so peers on different CPUs
 *   agree and a batch equals its rows alone.
 * - Activations: per row and block of 32 (K types: of 256), d = max|x| / 127, q = nearbyint(x * (1 / d))
 *   in [-127, 127], and s = d * sum(q) (for the weight's per-block offset; K types: the sums of q per
 *   16). Part of the recipe: it changes the numbers.
 * - Threads split the output features: a job's parts (a share per thread) are claimed by whichever
 *   thread is free, the caller too; a pool of workers spins briefly between calls, then sleeps.
 * - The rest of a Llama layer lives here too, per row and in fixed orders (RMSNorm, RoPE into the
 *   bfloat16 KV cache, causal attention, silu(gate) * up), so a row's bits never depend on how many
 *   rows or positions share its call: a many-position pass equals its one-position steps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

enum { QK = 32, QKK = 256, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       MAX_THREADS = 64, STRIP = 4, K_STRIPS_FROM = 4 };

typedef struct {
    float d;     /* scale */
    float s;     /* d * sum(q) */
    int8_t q[QK];
} XBlock;

/* K types' activations: one block per 256-wide super-block, d = max|x| / 127 as for 32-blocks, and
 * the sums of q per 16 elements, so a sub-block's min (Q4_K, Q5_K) or Q6_K's code offset of 32 is
 * one small integer dot product per super-block. */
typedef struct {
    float d;
    int16_t sums[16]; /* sum of q over elements 16i..16i+15 */
    int8_t q[QKK];
} XKBlock;

/* ---- halves, exactly ---- */

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; mant <<= 1; } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* A type's stored block: its bytes and how many elements it holds (32, or 256 for the K types). */
static inline int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline int block_elems(int qtype) { return qtype >= Q4_K ? QKK : QK; }

/* Bytes of a row of k elements, or 0 where the type is unknown or k does not fill whole blocks. */
static inline int64_t row_bytes_of(int qtype, int64_t k) {
    int bb = block_bytes(qtype), be = block_elems(qtype);
    return bb && k > 0 && k % be == 0 ? k / be * bb : 0;
}

/* Signed codes (Q8_0: w = a * u, no offset) or unsigned ones (w = a * u + c). */
static inline int signed_codes(int qtype) { return qtype == Q8_0; }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline void k4_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 32-wide block b of a row (not a K type: they go a super-block at a time) as w = a * u + c. The
 * offsets are exact in float32 (an 11-bit half times 8 or 16), so the AVX2 path shares this. */
#define BLOCK_SCALES_BODY(HALF) \
{ \
    const uint8_t *blk = row + b * block_bytes(qtype); \
    *a = HALF(blk); \
    *c = 0.0f; \
    if (qtype == Q4_1 || qtype == Q5_1) *c = HALF(blk + 2); \
    else if (qtype == Q4_0) *c = -8.0f * *a; \
    else if (qtype == Q5_0) *c = -16.0f * *a; \
}

static inline void block_scales(int qtype, const uint8_t *row, int64_t b, float *a, float *c)
BLOCK_SCALES_BODY(half_at)

/* ---- activations ---- */

static void quantize_rows(const float *x, int64_t m, int64_t k, XBlock *out) {
    int64_t nb = k / QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            XBlock *o = out + r * nb + b;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                int q = (int)nearbyintf(v[i] * id);
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
                o->q[i] = (int8_t)q;
                sum += q;
            }
            o->d = d;
            o->s = d * (float)sum;
        }
    }
}

static void quantize_rows_k(const float *x, int64_t m, int64_t k, XKBlock *out) {
    int64_t nb = k / QKK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QKK;
            XKBlock *o = out + r * nb + b;
            float amax = 0.0f;
            for (int i = 0; i < QKK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int s = 0; s < 16; s++) {
                int sum = 0;
                for (int i = 16 * s; i < 16 * s + 16; i++) {
                    int q = (int)nearbyintf(v[i] * id);
                    q = q > 127 ? 127 : (q < -127 ? -127 : q);
                    o->q[i] = (int8_t)q;
                    sum += q;
                }
                o->sums[s] = (int16_t)sum;
            }
            o->d = d;
        }
    }
}

/* The fixed horizontal sum of eight lanes, shared by both paths. */
static inline float lanes_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* ---- portable path ---- */

/* The 32 codes of block b of a row, in element order. */
static inline void unpack_codes(int qtype, const uint8_t *row, int64_t b, int8_t *u) {
    const uint8_t *blk, *qs;
    uint32_t qh;
    int j;
    switch (qtype) {
    case Q8_0:
        memcpy(u, row + b * 34 + 2, QK);
        return;
    case Q4_0: case Q4_1:
        qs = row + b * block_bytes(qtype) + (qtype == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            u[i] = (int8_t)(qs[i] & 0x0f);
            u[i + 16] = (int8_t)(qs[i] >> 4);
        }
        return;
    case Q5_0: case Q5_1:
        blk = row + b * block_bytes(qtype) + (qtype == Q5_1 ? 4 : 2);
        memcpy(&qh, blk, 4);
        for (int i = 0; i < 16; i++) {
            u[i] = (int8_t)((blk[4 + i] & 0x0f) | (((qh >> i) & 1) << 4));
            u[i + 16] = (int8_t)((blk[4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        return;
    case Q4_K: case Q5_K:
        /* 32-byte chunk b / 2 of the nibbles holds sub-block b in its low (b even) or high half */
        blk = row + (b >> 3) * block_bytes(qtype);
        j = (int)(b & 7);
        qs = blk + (qtype == Q5_K ? 48 : 16) + 32 * (j >> 1);
        for (int i = 0; i < QK; i++) {
            int v = (j & 1) ? qs[i] >> 4 : qs[i] & 0x0f;
            if (qtype == Q5_K) v |= ((blk[16 + i] >> j) & 1) << 4;
            u[i] = (int8_t)v;
        }
        return;
    default: /* Q6_K: block b = 32 t + 128 h of the super-block; codes minus 32 */
        blk = row + (b >> 3) * 210;
        j = (int)(b & 7);
        qs = blk + 64 * (j >> 2) + 32 * (j & 1);
        for (int i = 0; i < QK; i++) {
            int lo4 = (j & 2) ? qs[i] >> 4 : qs[i] & 0x0f;
            int hi2 = (blk[128 + 32 * (j >> 2) + i] >> (2 * (j & 3))) & 3;
            u[i] = (int8_t)((lo4 | (hi2 << 4)) - 32);
        }
    }
}

static void rows_portable(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                          const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    int8_t u[QK];
    int offsets = !signed_codes(qtype);
    for (int64_t col = n0; col < n1; col++) {
        const uint8_t *wr = w + col * row_bytes;
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float lane[8] = {0}, off = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float a, c;
                block_scales(qtype, wr, b, &a, &c);
                unpack_codes(qtype, wr, b, u);
                float scale = a * xr[b].d;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int t = 0; t < 4; t++) s += (int32_t)u[4 * j + t] * (int32_t)xr[b].q[4 * j + t];
                    lane[j] = fmaf(scale, (float)s, lane[j]);
                }
                if (offsets) off = fmaf(c, xr[b].s, off);
            }
            float sum = lanes_sum(lane) + off;
            y[r * n + col] = accumulate ? y[r * n + col] + sum : sum;
        }
    }
}

/* ---- K types, a super-block at a time ----
 * Per output, eight int32 lanes gather a super-block exactly: lane l holds, over its eight 32-blocks
 * j, the sub-block's integer scale times the dot product of elements 4l..4l+3 of block j (unsigned
 * codes: Q6_K's 0..63, its offset of 32 taken off once, as 32 times lane l's share of the scales
 * times the per-16 sums, 16-blocks 2l and 2l + 1), and for Q4_K and Q5_K eight more lanes the mins'
 * part, lane l = min of sub-block l times the sum of its 32 activations. Then per float lane: one
 * fused multiply-add of d * xd with the first, one of -(dmin * xd) with the second, in K order;
 * finally the fixed horizontal sum. Integers are exact, so only the float steps have an order, and
 * both paths take the same one. */

/* The 8 scales and 8 mins (6 bits each) of a Q4_K / Q5_K super-block. */
static inline void k4_unpack(const uint8_t *packed, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 8; j++) {
        int s, m;
        k4_scale_min(packed, j, &s, &m);
        sc[j] = (uint8_t)s;
        mn[j] = (uint8_t)m;
    }
}

/* Super-block sb of a row against its activation block: the float lanes take its two terms. */
static inline void superblock_portable(int qtype, const uint8_t *row, int64_t sb, const XKBlock *x, float *lane) {
    int32_t dot[8] = {0}, low[8] = {0};
    int8_t u[QK];
    float dx, mx = 0.0f;
    const uint8_t *blk = row + sb * block_bytes(qtype);
    if (qtype == Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int j = 0; j < 8; j++) {
            unpack_codes(qtype, row, sb * 8 + j, u);
            for (int l = 0; l < 8; l++) {
                int32_t s = 0;
                for (int t = 0; t < 4; t++) s += (int32_t)(u[4 * l + t] + 32) * (int32_t)x->q[32 * j + 4 * l + t];
                dot[l] += (int32_t)sc[2 * j + (l >> 2)] * s;
            }
        }
        for (int l = 0; l < 8; l++)
            dot[l] -= 32 * ((int32_t)sc[2 * l] * x->sums[2 * l] + (int32_t)sc[2 * l + 1] * x->sums[2 * l + 1]);
        dx = half_at(blk + 208) * x->d;
    } else {
        uint8_t sc[8], mn[8];
        k4_unpack(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            unpack_codes(qtype, row, sb * 8 + j, u);
            for (int l = 0; l < 8; l++) {
                int32_t s = 0;
                for (int t = 0; t < 4; t++) s += (int32_t)u[4 * l + t] * (int32_t)x->q[32 * j + 4 * l + t];
                dot[l] += (int32_t)sc[j] * s;
            }
        }
        for (int l = 0; l < 8; l++) low[l] = (int32_t)mn[l] * (x->sums[2 * l] + x->sums[2 * l + 1]);
        dx = half_at(blk) * x->d;
        mx = -(half_at(blk + 2) * x->d);
    }
    for (int l = 0; l < 8; l++) {
        lane[l] = fmaf(dx, (float)dot[l], lane[l]);
        if (qtype != Q6_K) lane[l] = fmaf(mx, (float)low[l], lane[l]);
    }
}

static void rows_portable_k(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                            const XKBlock *xk, int64_t m, int64_t nsb, float *y, int accumulate) {
    for (int64_t col = n0; col < n1; col++) {
        const uint8_t *wr = w + col * row_bytes;
        for (int64_t r = 0; r < m; r++) {
            float lane[8] = {0};
            for (int64_t sb = 0; sb < nsb; sb++) superblock_portable(qtype, wr, sb, xk + r * nsb + sb, lane);
            float sum = lanes_sum(lane);
            y[r * n + col] = accumulate ? y[r * n + col] + sum : sum;
        }
    }
}

/* ---- AVX2 path: the same sums, eight lanes at a time ---- */

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* Byte i of the result is 0xff where bit i of x is set. */
AVX2 static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    __m256i which = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), which), bit);
    return _mm256_cmpeq_epi8(v, bit);
}

AVX2 static inline __m256i nibbles16(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

/* The codes of 32-wide block b of a row, as unpack_codes gives them. */
AVX2 static inline __attribute__((always_inline)) __m256i codes_avx2(const int qtype, const uint8_t *row, int64_t b) {
    const uint8_t *blk;
    switch (qtype) {
    case Q4_0: return nibbles16(row + b * 18 + 2);
    case Q4_1: return nibbles16(row + b * 20 + 4);
    case Q5_0: case Q5_1:
        blk = row + b * block_bytes(qtype) + (qtype == Q5_1 ? 4 : 2);
        return _mm256_or_si256(nibbles16(blk + 4), _mm256_and_si256(bits_to_bytes(blk), _mm256_set1_epi8(0x10)));
    default: return _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)); /* Q8_0 */
    }
}

/* Eight int32 lanes: lane j = sum over elements 4j..4j+3 of u * q. Unsigned codes go straight
 * into maddubs; signed codes go as |u| with q carrying u's sign. */
AVX2 static inline __m256i dot_avx2(int signed8, __m256i u, __m256i q) {
    __m256i p;
    if (signed8) p = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
    else p = _mm256_maddubs_epi16(u, q);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

AVX2 static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* block_scales with the F16C conversion (exact too): the same body, another half-to-float. */
AVX2 static inline __attribute__((always_inline)) void scales_f16c(const int qtype, const uint8_t *row, int64_t b,
                                                                   float *a, float *c)
BLOCK_SCALES_BODY(half_f16c)

AVX2 static inline void finish_avx2(const __m256 *acc, const float *off, int rows, float *out, int accumulate) {
    for (int i = 0; i < rows; i++) {
        float lane[8];
        _mm256_storeu_ps(lane, acc[i]);
        float sum = lanes_sum(lane) + off[i];
        out[i] = accumulate ? out[i] + sum : sum; /* y = x + W h: the residual added once, as x + (W h) */
    }
}

/* One x row against one strip of `rows` weight rows, each block decoded where it is met. Inlined
 * with constant qtype and rows, so the accumulators stay in registers and the type's branches fold
 * away (a variable bound kept them on the stack: 0.103 -> see kernel_bench). */
AVX2 static inline __attribute__((always_inline)) void
strip_direct(const int qtype, const int rows, const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1,
             const XBlock *xr, int64_t nb, float *out, int accumulate) {
    const int sgn = signed_codes(qtype);
    __m256 acc[STRIP];
    float off[STRIP];
    for (int i = 0; i < STRIP; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0.0f; }
    /* the next strips stream in while this one is summed (its rows are read side by side, too
     * short for the hardware prefetcher: 2.3x the bandwidth out of cache, measured) */
    const char *next = (const char *)(w + (c0 + 8 * STRIP) * row_bytes);
    int64_t ahead = c0 + 8 * STRIP < n1 ? STRIP * row_bytes : 0, per = (STRIP * row_bytes + nb - 1) / nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)xr[b].q);
        float xd = xr[b].d, xs = xr[b].s;
        for (int64_t p = b * per; p < (b + 1) * per && p < ahead; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
        for (int i = 0; i < rows; i++) {
            const uint8_t *row = w + (c0 + i) * row_bytes;
            float a, c;
            scales_f16c(qtype, row, b, &a, &c);
            __m256 s = _mm256_cvtepi32_ps(dot_avx2(sgn, codes_avx2(qtype, row, b), q));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a * xd), s, acc[i]);
            if (!sgn) off[i] = fmaf(c, xs, off[i]);
        }
    }
    finish_avx2(acc, off, rows, out, accumulate);
}

#define STRIP_DIRECT(QT)                                                                                    \
    do {                                                                                                    \
        if (rows == STRIP) strip_direct(QT, STRIP, w, row_bytes, c0, n1, xr, nb, out, accumulate);          \
        else strip_direct(QT, rows, w, row_bytes, c0, n1, xr, nb, out, accumulate);                         \
    } while (0)

/* Few x rows (decode): STRIP weight rows side by side, each x row in turn. */
AVX2 static void rows_avx2_direct(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                  const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1; c0 += STRIP) {
        int rows = (int)(n1 - c0 < STRIP ? n1 - c0 : STRIP);
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float *out = y + r * n + c0;
            switch (qtype) {
            case Q4_0: STRIP_DIRECT(Q4_0); break;
            case Q4_1: STRIP_DIRECT(Q4_1); break;
            case Q5_0: STRIP_DIRECT(Q5_0); break;
            case Q5_1: STRIP_DIRECT(Q5_1); break;
            default: STRIP_DIRECT(Q8_0); break;
            }
        }
    }
}

/* Every x row against one decoded strip; `sgn` (no offsets) is a constant where it is inlined, so
 * the inner loop has no branch. */
AVX2 static inline __attribute__((always_inline)) void
strips_meet(const int sgn, const __m256i *codes, const float *sa, const float *sb,
            int rows, const XBlock *xq, int64_t m, int64_t nb, float *y, int64_t n, int accumulate) {
    for (int64_t r = 0; r < m; r++) {
        const XBlock *xr = xq + r * nb;
        __m256 acc[STRIP];
        float off[STRIP];
        for (int i = 0; i < STRIP; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0.0f; }
        for (int64_t b = 0; b < nb; b++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)xr[b].q);
            float xd = xr[b].d, xs = xr[b].s;
            for (int i = 0; i < rows; i++) {
                int64_t at = b * STRIP + i;
                __m256 s = _mm256_cvtepi32_ps(dot_avx2(sgn, codes[at], q));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(sa[at] * xd), s, acc[i]);
                if (!sgn) off[i] = fmaf(sb[at], xs, off[i]);
            }
        }
        finish_avx2(acc, off, rows, y + r * n, accumulate);
    }
}

/* The rows of the strip AHEAD strips on (contiguous bytes) on their way to the cache while this one
 * is decoded and met: without it the strips path waited on memory at every decode (the LM head's
 * 30 MB with 4 x rows took 8.4 ms against 1.1 ms for one row; 2, 4 and 8 ahead all cut it to about
 * 4.6 ms on AVX2, kernel_bench --single, CPU with AVX-512). */
static const int AHEAD = 8;
static inline void prefetch_strip(const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1) {
#if HAVE_X86
    if (c0 >= n1) return;
    int64_t rows = n1 - c0 < STRIP ? n1 - c0 : STRIP;
    const char *p = (const char *)(w + c0 * row_bytes);
    for (int64_t at = 0; at < rows * row_bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
#else
    (void)w; (void)row_bytes; (void)c0; (void)n1;
#endif
}

/* Many x rows (prefill, batches): a strip of STRIP weight rows is decoded once (codes and scales),
 * then met by every x row. */
AVX2 static void rows_avx2_strips(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                  const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    int sgn = signed_codes(qtype);
    __m256i *codes = aligned_alloc(32, (size_t)STRIP * nb * sizeof(__m256i));
    float *sa = malloc((size_t)STRIP * nb * sizeof(float)), *sb = malloc((size_t)STRIP * nb * sizeof(float));
    for (int64_t c0 = n0; c0 < n1; c0 += STRIP) {
        int rows = (int)(n1 - c0 < STRIP ? n1 - c0 : STRIP);
        prefetch_strip(w, row_bytes, c0 + AHEAD * STRIP, n1);
        for (int i = 0; i < rows; i++) {
            const uint8_t *wr = w + (c0 + i) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                int64_t at = b * STRIP + i;
                switch (qtype) { /* constant types, so each decoder's branches fold away */
                case Q4_0: codes[at] = codes_avx2(Q4_0, wr, b); break;
                case Q4_1: codes[at] = codes_avx2(Q4_1, wr, b); break;
                case Q5_0: codes[at] = codes_avx2(Q5_0, wr, b); break;
                case Q5_1: codes[at] = codes_avx2(Q5_1, wr, b); break;
                default: codes[at] = codes_avx2(Q8_0, wr, b); break;
                }
                scales_f16c(qtype, wr, b, &sa[at], &sb[at]);
            }
        }
        if (sgn) strips_meet(1, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate);
        else strips_meet(0, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate);
    }
    free(codes);
    free(sa);
    free(sb);
}

/* ---- K types on AVX2: the lanes superblock_portable sums, eight at a time ---- */

/* Int16 `i` of each 128-bit half of v, in all eight int16 of that half. */
#define SPREAD16(v, i) _mm256_shuffle_epi8((v), _mm256_set1_epi16((short)(0x0100 + 0x0202 * (i))))

/* The 12 packed bytes of a Q4_K / Q5_K super-block as bytes: scales 0-7, then mins 0-7 (k4_unpack's
 * values). With a0, a1, a2 its three words: scales 0-3 are a0's low 6 bits a byte, mins 0-3 a1's;
 * scales 4-7 are a2's low nibbles with a0's top 2 bits above them, mins 4-7 a2's high nibbles with
 * a1's. The bytes read past them are the block's own codes, masked away. */
AVX2 static inline __m128i k4_scales_avx2(const uint8_t *blk) {
    __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
    __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_set_epi32(4, 0, 0, 0));
    __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
    return _mm_or_si128(_mm_and_si128(low, _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f)),
                        _mm_and_si128(top, _mm_set_epi32(0x30303030, 0, 0x30303030, 0)));
}

AVX2 static inline __attribute__((always_inline)) __m256
superblock_k4(const int qtype, const uint8_t *blk, const XKBlock *x, __m256i sums, __m256 acc) {
    __m128i sm = k4_scales_avx2(blk);
    __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10,
                                                                          10, 9, 9, 8, 8)));
    __m256i low = _mm256_madd_epi16(mins, sums), dot = _mm256_setzero_si256(), m4 = _mm256_set1_epi8(0x0f);
    __m256i bit4 = _mm256_set1_epi8(0x10), hb = qtype == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : m4;
    const uint8_t *qs = blk + (qtype == Q5_K ? 48 : 16);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (qtype == Q5_K) { /* bit j of each byte of qh is the fifth bit of sub-block j */
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x->q + 64 * p)));
        __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x->q + 64 * p + 32)));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(plo, SPREAD16(scales, 2 * p)));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(phi, SPREAD16(scales, 2 * p + 1)));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_f16c(blk) * x->d), _mm256_cvtepi32_ps(dot), acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(-(half_f16c(blk + 2) * x->d)), _mm256_cvtepi32_ps(low), acc);
}

AVX2 static inline __attribute__((always_inline)) __m256
superblock_q6k(const uint8_t *blk, const XKBlock *x, __m256i sums, __m256 acc) {
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    /* the codes' offset of 32, taken off once: lane l loses 32 (sc[2l] sums[2l] + sc[2l+1] sums[2l+1]) */
    __m256i dot = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
    __m256i m4 = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        /* scales 8h..8h+7 as int16 in both halves; block 4h + t takes 2t (low lanes) and 2t + 1 */
        __m256i sv = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h))));
        __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)),
        };
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m256i p = _mm256_maddubs_epi16(u[t], _mm256_loadu_si256((const __m256i *)(x->q + 128 * h + 32 * t)));
            __m256i s = _mm256_shuffle_epi8(sv, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * t)),
                                                                 _mm_set1_epi16((short)(0x0100 + 0x0404 * t))));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, s));
        }
    }
    return _mm256_fmadd_ps(_mm256_set1_ps(half_f16c(blk + 208) * x->d), _mm256_cvtepi32_ps(dot), acc);
}

/* One x row against a strip of `rows` weight rows, a super-block at a time (constant qtype and
 * rows where inlined, as strip_direct). */
AVX2 static inline __attribute__((always_inline)) void
strip_k(const int qtype, const int rows, const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1,
        const XKBlock *xr, int64_t nsb, float *out, int accumulate) {
    const int bb = block_bytes(qtype);
    const float off[STRIP] = {0};
    __m256 acc[STRIP];
    for (int i = 0; i < STRIP; i++) acc[i] = _mm256_setzero_ps();
    /* the next strip streams in while this one is summed: a K type's strip is 4.6-6.7 KB at k = 2048,
     * and fetching eight strips ahead, as strip_direct does, took 25-45% more time than one ahead in a
     * cold one-row call (weights out of cache; one, two, four and eight ahead measured) */
    const char *next = (const char *)(w + (c0 + STRIP) * row_bytes);
    int64_t ahead = c0 + STRIP < n1 ? STRIP * row_bytes : 0, per = (STRIP * row_bytes + nsb - 1) / nsb;
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m256i sums = _mm256_loadu_si256((const __m256i *)xr[sb].sums);
        for (int64_t p = sb * per; p < (sb + 1) * per && p < ahead; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
        for (int i = 0; i < rows; i++) {
            const uint8_t *blk = w + (c0 + i) * row_bytes + sb * bb;
            acc[i] = qtype == Q6_K ? superblock_q6k(blk, xr + sb, sums, acc[i])
                                   : superblock_k4(qtype, blk, xr + sb, sums, acc[i]);
        }
    }
    finish_avx2(acc, off, rows, out, accumulate);
}

#define STRIP_K(QT)                                                                                         \
    do {                                                                                                    \
        if (rows == STRIP) strip_k(QT, STRIP, w, row_bytes, c0, n1, xr, nsb, out, accumulate);              \
        else strip_k(QT, rows, w, row_bytes, c0, n1, xr, nsb, out, accumulate);                             \
    } while (0)

AVX2 static void rows_avx2_k(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                             const XKBlock *xk, int64_t m, int64_t nsb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1; c0 += STRIP) {
        int rows = (int)(n1 - c0 < STRIP ? n1 - c0 : STRIP);
        for (int64_t r = 0; r < m; r++) {
            const XKBlock *xr = xk + r * nsb;
            float *out = y + r * n + c0;
            if (qtype == Q4_K) STRIP_K(Q4_K);
            else if (qtype == Q5_K) STRIP_K(Q5_K);
            else STRIP_K(Q6_K);
        }
    }
}

/* Many x rows: a super-block of a weight row decoded once (codes, scales, mins), then met by every
 * x row; the integers and the float steps are superblock_k4's and superblock_q6k's. */
typedef struct {
    __m256i u[8];    /* codes of the eight 32-blocks (Q6_K's unsigned, 0..63) */
    __m256i sa, sb;  /* Q4_K / Q5_K: the scales as int16 in both halves; Q6_K: scales 0-7 and 8-15 so */
    __m256i extra;   /* Q4_K / Q5_K: each min twice, as int16; Q6_K: the 16 scales as int16 */
    float d, dmin;
} KDec;

AVX2 static inline __attribute__((always_inline)) void decode_k(const int qtype, const uint8_t *blk, KDec *k) {
    __m256i m4 = _mm256_set1_epi8(0x0f);
    if (qtype == Q6_K) {
        __m256i top = _mm256_set1_epi8(0x30);
        k->extra = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        k->sa = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192))));
        k->sb = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 200))));
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            k->u[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
            k->u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
            k->u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, top));
            k->u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
        }
        k->d = half_f16c(blk + 208);
        return;
    }
    __m128i sm = k4_scales_avx2(blk);
    k->sa = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    k->extra = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10,
                                                                      9, 9, 8, 8)));
    __m256i bit4 = _mm256_set1_epi8(0x10), hb = qtype == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : m4;
    const uint8_t *qs = blk + (qtype == Q5_K ? 48 : 16);
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (qtype == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        k->u[2 * p] = lo;
        k->u[2 * p + 1] = hi;
    }
    k->d = half_f16c(blk);
    k->dmin = half_f16c(blk + 2);
}

AVX2 static inline __attribute__((always_inline)) __m256
meet_k(const int qtype, const KDec *k, const XKBlock *x, __m256i sums, __m256 acc) {
    __m256i dot;
    if (qtype == Q6_K) {
        dot = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(k->extra, sums), 5));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i p = _mm256_maddubs_epi16(k->u[j], _mm256_loadu_si256((const __m256i *)(x->q + 32 * j)));
            __m256i s = _mm256_shuffle_epi8(j < 4 ? k->sa : k->sb,
                                            _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * (j & 3))),
                                                             _mm_set1_epi16((short)(0x0100 + 0x0404 * (j & 3)))));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, s));
        }
        return _mm256_fmadd_ps(_mm256_set1_ps(k->d * x->d), _mm256_cvtepi32_ps(dot), acc);
    }
    dot = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i p = _mm256_maddubs_epi16(k->u[j], _mm256_loadu_si256((const __m256i *)(x->q + 32 * j)));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, SPREAD16(k->sa, j)));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(k->d * x->d), _mm256_cvtepi32_ps(dot), acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(-(k->dmin * x->d)), _mm256_cvtepi32_ps(_mm256_madd_epi16(k->extra, sums)), acc);
}

AVX2 static inline __attribute__((always_inline)) void
strip_meet_k(const int qtype, const int rows, const KDec *dec, const XKBlock *xk, int64_t m, int64_t nsb, float *y,
             int64_t n, int accumulate) {
    const float off[STRIP] = {0};
    for (int64_t r = 0; r < m; r++) {
        const XKBlock *xr = xk + r * nsb;
        __m256 acc[STRIP];
        for (int i = 0; i < STRIP; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            __m256i sums = _mm256_loadu_si256((const __m256i *)xr[sb].sums);
            for (int i = 0; i < rows; i++) acc[i] = meet_k(qtype, dec + sb * STRIP + i, xr + sb, sums, acc[i]);
        }
        finish_avx2(acc, off, rows, y + r * n, accumulate);
    }
}

#define STRIP_MEET_K(QT)                                                                                    \
    do {                                                                                                    \
        for (int i = 0; i < rows; i++)                                                                      \
            for (int64_t sb = 0; sb < nsb; sb++)                                                            \
                decode_k(QT, w + (c0 + i) * row_bytes + sb * block_bytes(QT), dec + sb * STRIP + i);        \
        if (rows == STRIP) strip_meet_k(QT, STRIP, dec, xk, m, nsb, y + c0, n, accumulate);                 \
        else strip_meet_k(QT, rows, dec, xk, m, nsb, y + c0, n, accumulate);                                \
    } while (0)

AVX2 static void rows_avx2_k_strips(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                    const XKBlock *xk, int64_t m, int64_t nsb, float *y, int accumulate) {
    KDec *dec = aligned_alloc(32, (size_t)STRIP * nsb * sizeof(KDec));
    if (!dec) { /* the same sums, each x row decoding for itself */
        rows_avx2_k(qtype, w, row_bytes, n0, n1, n, xk, m, nsb, y, accumulate);
        return;
    }
    for (int64_t c0 = n0; c0 < n1; c0 += STRIP) {
        int rows = (int)(n1 - c0 < STRIP ? n1 - c0 : STRIP);
        if (qtype == Q4_K) STRIP_MEET_K(Q4_K);
        else if (qtype == Q5_K) STRIP_MEET_K(Q5_K);
        else STRIP_MEET_K(Q6_K);
    }
    free(dec);
}

/* ---- activations on AVX2: quantize_rows' and quantize_rows_k's numbers, eight at a time ----
 * max|x| is exact in any order; x * (1 / d) is the same product; rounding to nearest even and the
 * conversion (NaN and overflow give INT_MIN, as the portable path's conversion does on x86) and the
 * integer clamp to +-127 follow the portable steps one for one. */

AVX2 static inline float amax_avx2(const float *v, int count) {
    __m256 m = _mm256_setzero_ps(), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < count; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), abs), m); /* NaN: kept m */
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

AVX2 static inline int hsum_epi32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* 32 values times id, rounded and clamped into q; the sums of elements 0..15 and 16..31. */
AVX2 static inline void quantize32_avx2(const float *v, float id, int8_t *q, int *sum_lo, int *sum_hi) {
    __m256 s = _mm256_set1_ps(id);
    __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), i[4];
    for (int t = 0; t < 4; t++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * t), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i[t] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), lo), hi);
    }
    *sum_lo = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
    *sum_hi = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
    /* the packs interleave 4-element groups across the halves; the permute puts them back */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

AVX2 static void quantize_rows_avx2(const float *x, int64_t m, int64_t k, XBlock *out) {
    int64_t nb = k / QK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            XBlock *o = out + r * nb + b;
            float d = amax_avx2(v, QK) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int lo, hi;
            quantize32_avx2(v, id, o->q, &lo, &hi);
            o->d = d;
            o->s = d * (float)(lo + hi);
        }
}

AVX2 static void quantize_rows_k_avx2(const float *x, int64_t m, int64_t k, XKBlock *out) {
    int64_t nb = k / QKK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QKK;
            XKBlock *o = out + r * nb + b;
            float d = amax_avx2(v, QKK) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int c = 0; c < 8; c++) {
                int lo, hi;
                quantize32_avx2(v + 32 * c, id, o->q + 32 * c, &lo, &hi);
                o->sums[2 * c] = (int16_t)lo;
                o->sums[2 * c + 1] = (int16_t)hi;
            }
            o->d = d;
        }
}

static void rows_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                      const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    if (m < STRIP) rows_avx2_direct(qtype, w, row_bytes, n0, n1, n, xq, m, nb, y, accumulate);
    else rows_avx2_strips(qtype, w, row_bytes, n0, n1, n, xq, m, nb, y, accumulate);
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#include "_blocks_avx512.c"
#else
static int cpu_has_avx2(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }
#endif

/* The instruction sets, each a superset of the one before; a call runs on the best this CPU has,
 * at most the one it asks for (tests compare them: they give the same bits), and at most the
 * process's cap (limit_isa: to measure one against another). */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avx512"};
static int cpu_best = -1, best_isa = -1;

static int cpu_isa(void) {
    if (cpu_best < 0) cpu_best = cpu_has_avx2() ? (cpu_has_avx512() ? ISA_AVX512 : ISA_AVX2) : ISA_PORTABLE;
    if (best_isa < 0) best_isa = cpu_best;
    return best_isa;
}

/* A call's instruction set: `cap` 0 asks for the best, 1 + i for ISA_NAMES[i] at most. */
static int isa_for(long long cap) {
    int best = cpu_isa();
    return cap > 0 && cap - 1 < best ? (int)cap - 1 : best;
}

/* ---- the pool ---- */

/* A matmul's share of work: output features [n0, n1) of every row. */
typedef struct {
    int qtype, isa, accumulate;
    const uint8_t *w;
    int64_t row_bytes, n, m, nb; /* nb: x's blocks a row (32-wide, or 256-wide for a K type) */
    const void *xq;              /* XBlock or, for a K type, XKBlock */
    float *y;
} MatJob;

/* What the pool runs: fn(ctx, part, parts) once for every part; parts never depend on each other. */
typedef struct {
    void (*fn)(const void *ctx, int part, int parts);
    const void *ctx;
    int parts;
} Job;

/* Threads claim a job's parts one at a time, the caller too, so a thread the OS has not scheduled
 * (several daemons sharing a box's cores) holds up nothing: the others take its parts, and the caller
 * waits only for parts that are being computed. job_state is the job's number (high 32 bits) and
 * the parts not yet claimed (low 32): a claim is a compare-and-swap that also checks the number, so
 * a late thread never takes a part of a job that is not the one it saw. Which thread computes a
 * part never changes its bits. */
static Job job;
static _Atomic uint64_t job_state;
static atomic_uint job_gen;        /* the job's number again, 32 bits for the futex */
static atomic_int job_done;        /* parts finished */
static atomic_int sleepers;
static int pool_size = 0;          /* workers started (the caller is one more) */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
/* how long an idle worker spins before it sleeps: between the matmuls of a layer (one kernel call) and
 * between layers a few microseconds pass; longer waits (the network, sampling) are not worth a core
 * spinning, least of all on a box that several daemons share */
static const double SPIN_S = 50e-6;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if HAVE_X86
    _mm_pause();
#endif
}

static void matmul_part(const void *ctx, int part, int parts) {
    const MatJob *j = ctx;
    /* split into whole strips so every thread's share starts on a strip boundary */
    int64_t strips = (j->n + STRIP - 1) / STRIP;
    int64_t s0 = strips * part / parts, s1 = strips * (part + 1) / parts;
    int64_t n0 = s0 * STRIP, n1 = s1 * STRIP < j->n ? s1 * STRIP : j->n;
    if (n0 >= n1) return;
    int k_type = block_elems(j->qtype) == QKK;
#if HAVE_X86
    if (j->isa == ISA_AVX512) {
        if (k_type) rows_avx512_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else rows_avx512(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        return;
    }
    if (j->isa) {
        if (k_type && j->m >= K_STRIPS_FROM) rows_avx2_k_strips(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else if (k_type) rows_avx2_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else rows_avx2(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        return;
    }
#endif
    if (k_type) rows_portable_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
    else rows_portable(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
}

/* Claim and compute job `gen`'s parts until none is left (or another job is posted). */
static void take_parts(unsigned gen) {
    uint64_t s = atomic_load_explicit(&job_state, memory_order_acquire);
    for (;;) {
        if ((unsigned)(s >> 32) != gen || (uint32_t)s == 0) return;
        if (!atomic_compare_exchange_weak_explicit(&job_state, &s, s - 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue; /* s now holds the new state */
        job.fn(job.ctx, (int)((uint32_t)s - 1), job.parts);
        atomic_fetch_add_explicit(&job_done, 1, memory_order_release);
        s = atomic_load_explicit(&job_state, memory_order_acquire);
    }
}

static void *worker(void *arg) {
    unsigned seen = *(unsigned *)arg; /* the job number when it was started: a later job is new to it */
    free(arg);
    for (;;) {
        unsigned gen;
        double until = now_s() + SPIN_S;
        int spins = 0;
        while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_s() > until) {
                atomic_fetch_add(&sleepers, 1);
                if (atomic_load(&job_gen) == seen) syscall(SYS_futex, &job_gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                until = now_s() + SPIN_S;
            }
        }
        seen = gen;
        take_parts(gen);
    }
    return NULL;
}

/* a forked child has none of its parent's workers */
static void forget_pool(void) {
    pool_size = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
}

static int ensure_pool(int threads) {
    static int hooked = 0;
    if (!hooked) {
        pthread_atfork(NULL, NULL, forget_pool);
        hooked = 1;
    }
    int want = threads - 1;
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    pthread_mutex_lock(&pool_lock);
    while (pool_size < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        unsigned *start = malloc(sizeof *start);
        if (!start) break;
        *start = atomic_load(&job_gen);
        int rc = pthread_create(&t, &attr, worker, start);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(start);
            break;
        }
        pool_size++;
    }
    pthread_mutex_unlock(&pool_lock);
    return (pool_size + 1 < threads ? pool_size + 1 : threads);
}

static void run_job(const Job *j, int threads) {
    pthread_mutex_lock(&call_lock); /* one job at a time: the pool has one job slot */
    threads = threads > 1 ? ensure_pool(threads) : 1;
    if (threads == 1) {
        j->fn(j->ctx, 0, 1);
        pthread_mutex_unlock(&call_lock);
        return;
    }
    /* one part a thread: finer parts would balance better, but each part's start costs its stream of
     * weights a prefetcher ramp (two a thread: 2-4% slower over 30 layers' cold matmuls; four: 12%) */
    int parts = threads;
    job = *j;
    job.parts = parts;
    atomic_store_explicit(&job_done, 0, memory_order_relaxed);
    unsigned gen = atomic_load_explicit(&job_gen, memory_order_relaxed) + 1; /* only callers write it */
    atomic_store_explicit(&job_state, ((uint64_t)gen << 32) | (uint32_t)parts, memory_order_release);
    atomic_store(&job_gen, gen);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &job_gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    take_parts(gen);
    /* the parts left are being computed; a thread preempted in one gets the core back sooner if we yield */
    for (int spins = 0; atomic_load_explicit(&job_done, memory_order_acquire) < parts; spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&call_lock);
}

/* ---- RMSNorm and attention, in the same fixed orders on both paths ---- */

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w per row; the squares summed in eight lanes (lane i % 8). */
static void rms_norm_portable(const float *x, const float *w, int64_t rows, int64_t cols, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float lane[8] = {0};
        for (int64_t i = 0; i < cols; i++) lane[i % 8] = fmaf(xr[i], xr[i], lane[i % 8]);
        float inv = 1.0f / sqrtf(lanes_sum(lane) / (float)cols + eps);
        for (int64_t i = 0; i < cols; i++) y[r * cols + i] = (xr[i] * inv) * w[i];
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* exp(x) for x <= 0 (softmax after its max is taken out), the same operations on both paths:
 * x = n ln2 + r with n = nearbyint(x log2 e), a degree-6 polynomial in r (Cephes' expf
 * coefficients), times 2^n built from its bits. Within 2 ulp of expf; glibc's expf would differ
 * between library versions and cannot be vectorised bit for bit. */
static const float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_fixed(float x) {
    x = fmaxf(x, -87.0f);
    float n = nearbyintf(x * 1.44269504089f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = EXP_C[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_C[i]);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* Causal attention of n query rows at positions pos.. over one session's cached keys and values
 * (bfloat16, [kv heads, positions, hd] with the given strides); every row is computed as a decode
 * step computes it: scores in K order (eight lanes, d % 8), softmax with exp_fixed, values summed in
 * position order. out is [n, heads, hd]. */
typedef struct {
    const float *q;
    int64_t q_row, q_head;           /* strides of q, in floats */
    const uint16_t *k, *v;
    int64_t kv_head, kv_pos;         /* strides of the caches, in elements */
    int heads, kv_heads, hd;
    int64_t pos, n;
    float scale;
    float *out;
    int isa_avx2;
} Attn;

static void attend_portable(const Attn *a, int64_t p0, int64_t p1, float *scores) {
    int group = a->heads / a->kv_heads;
    for (int64_t p = p0; p < p1; p++) {
        int64_t r = p / a->heads, total = a->pos + r + 1;
        int h = (int)(p % a->heads);
        const float *q = a->q + r * a->q_row + h * a->q_head;
        const uint16_t *k = a->k + (h / group) * a->kv_head, *v = a->v + (h / group) * a->kv_head;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < total; t++) {
            float lane[8] = {0};
            for (int d = 0; d < a->hd; d++) lane[d % 8] = fmaf(q[d], bf16_to_f32(k[t * a->kv_pos + d]), lane[d % 8]);
            scores[t] = lanes_sum(lane) * a->scale;
            top = fmaxf(top, scores[t]);
        }
        for (int64_t t = 0; t < total; t++) {
            scores[t] = exp_fixed(scores[t] - top);
            sum += scores[t];
        }
        float *o = a->out + p * a->hd;
        for (int d = 0; d < a->hd; d++) o[d] = 0.0f;
        for (int64_t t = 0; t < total; t++)
            for (int d = 0; d < a->hd; d++) o[d] = fmaf(scores[t], bf16_to_f32(v[t * a->kv_pos + d]), o[d]);
        for (int d = 0; d < a->hd; d++) o[d] = o[d] / sum;
    }
}

#if HAVE_X86
__attribute__((target("avx2,fma,f16c"))) static void rms_norm_avx2(const float *x, const float *w, int64_t rows,
                                                                     int64_t cols, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= cols; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lane[8];
        _mm256_storeu_ps(lane, acc);
        for (; i < cols; i++) lane[i % 8] = fmaf(xr[i], xr[i], lane[i % 8]);
        float inv = 1.0f / sqrtf(lanes_sum(lane) / (float)cols + eps);
        __m256 vinv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= cols; i += 8)
            _mm256_storeu_ps(y + r * cols + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv),
                                                             _mm256_loadu_ps(w + i)));
        for (; i < cols; i++) y[r * cols + i] = (xr[i] * inv) * w[i];
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline __m256 bf16x8_avx2(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma,f16c"))) static inline __m256 exp8_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma,f16c"))) static void attend_avx2(const Attn *a, int64_t p0, int64_t p1,
                                                                   float *scores) {
    int group = a->heads / a->kv_heads, hd = a->hd;
    for (int64_t p = p0; p < p1; p++) {
        int64_t r = p / a->heads, total = a->pos + r + 1;
        int h = (int)(p % a->heads);
        const float *q = a->q + r * a->q_row + h * a->q_head;
        const uint16_t *k = a->k + (h / group) * a->kv_head, *v = a->v + (h / group) * a->kv_head;
        float top = -INFINITY, sum = 0.0f;
        /* four keys at a time: independent sums, each in its own d order */
        int64_t t = 0;
        for (; t + 4 <= total; t += 4) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int d = 0; d < hd; d += 8) {
                __m256 qd = _mm256_loadu_ps(q + d);
                for (int u = 0; u < 4; u++)
                    acc[u] = _mm256_fmadd_ps(qd, bf16x8_avx2(k + (t + u) * a->kv_pos + d), acc[u]);
            }
            for (int u = 0; u < 4; u++) {
                float lane[8];
                _mm256_storeu_ps(lane, acc[u]);
                scores[t + u] = lanes_sum(lane) * a->scale;
                top = fmaxf(top, scores[t + u]);
            }
        }
        for (; t < total; t++) {
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), bf16x8_avx2(k + t * a->kv_pos + d), acc);
            float lane[8];
            _mm256_storeu_ps(lane, acc);
            scores[t] = lanes_sum(lane) * a->scale;
            top = fmaxf(top, scores[t]);
        }
        __m256 vtop = _mm256_set1_ps(top);
        for (t = 0; t + 8 <= total; t += 8)
            _mm256_storeu_ps(scores + t, exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vtop)));
        for (; t < total; t++) scores[t] = exp_fixed(scores[t] - top);
        for (t = 0; t < total; t++) sum += scores[t];
        /* up to eight 8-wide slices of the output at once, each summed in position order */
        float *o = a->out + p * hd;
        for (int d0 = 0; d0 < hd; d0 += 64) {
            int chunks = (hd - d0) / 8 < 8 ? (hd - d0) / 8 : 8;
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
            for (t = 0; t < total; t++) {
                __m256 st = _mm256_set1_ps(scores[t]);
                const uint16_t *vt = v + t * a->kv_pos + d0;
                for (int c = 0; c < chunks; c++) acc[c] = _mm256_fmadd_ps(st, bf16x8_avx2(vt + 8 * c), acc[c]);
            }
            __m256 vs = _mm256_set1_ps(sum);
            for (int c = 0; c < chunks; c++) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_div_ps(acc[c], vs));
        }
    }
}
#endif

/* RMSNorm on the path the caller picked (the same bits either way; silu_mul_on likewise). */
static void rms_norm_on(int isa, const float *x, const float *w, int64_t rows, int64_t cols, float eps, float *y) {
#if HAVE_X86
    if (isa) {
        rms_norm_avx2(x, w, rows, cols, eps, y);
        return;
    }
#endif
    (void)isa;
    rms_norm_portable(x, w, rows, cols, eps, y);
}

/* A thread's share of the (row, head) pairs; pairs never depend on each other. */
static void attend_part(const void *ctx, int part, int parts) {
    const Attn *a = ctx;
    int64_t pairs = a->n * a->heads, p0 = pairs * part / parts, p1 = pairs * (part + 1) / parts;
    if (p0 >= p1) return;
    float *scores = malloc((size_t)(a->pos + a->n + 1) * sizeof(float));
    if (!scores) abort(); /* a few KB per thread; nothing sane is left to do without it */
#if HAVE_X86
    if (a->isa_avx2) {
        attend_avx2(a, p0, p1, scores);
        free(scores);
        return;
    }
#endif
    attend_portable(a, p0, p1, scores);
    free(scores);
}

/* ---- RoPE into the KV cache, and SwiGLU's gate ---- */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);            /* round to nearest even */
}

/* Rows of a fused QKV output at positions pos..: q heads rotated into q_out [n, heads, hd] (float32);
 * k heads rotated and v heads as they are, written as bfloat16 into the layer's caches at their
 * positions. Rotation as the half-split rotary tables say: out[d] = x[d] cos[d] + x[(d + hd/2) % hd]
 * ssin[d] (two products and a sum, no fused multiply-add). */
typedef struct {
    const float *qkv;
    int64_t qkv_row, pos, n;
    const float *cos, *ssin;  /* [positions, hd] */
    int heads, kv_heads, hd;
    float *q_out;
    uint16_t *k, *v;
    int64_t kv_head, kv_pos;
} Rope;

static inline void rotate(const float *x, const float *c, const float *s, int hd, float *out) {
    int half = hd / 2;
    for (int d = 0; d < hd; d++) {
        float a = x[d] * c[d], b = x[d < half ? d + half : d - half] * s[d];
        out[d] = a + b;
    }
}

static void rope_kv_run(const Rope *a) {
    float tmp[512];
    for (int64_t r = 0; r < a->n; r++) {
        const float *row = a->qkv + r * a->qkv_row, *c = a->cos + (a->pos + r) * a->hd, *s = a->ssin + (a->pos + r) * a->hd;
        for (int h = 0; h < a->heads; h++) rotate(row + h * a->hd, c, s, a->hd, a->q_out + (r * a->heads + h) * a->hd);
        for (int g = 0; g < a->kv_heads; g++) {
            uint16_t *kd = a->k + g * a->kv_head + (a->pos + r) * a->kv_pos, *vd = a->v + g * a->kv_head + (a->pos + r) * a->kv_pos;
            const float *vs = row + (a->heads + a->kv_heads + g) * a->hd;
            rotate(row + (a->heads + g) * a->hd, c, s, a->hd, tmp);
            for (int d = 0; d < a->hd; d++) {
                kd[d] = f32_to_bf16(tmp[d]);
                vd[d] = f32_to_bf16(vs[d]);
            }
        }
    }
}

/* out[r, i] = silu(g) * u for g = x[r, i], u = x[r, f + i]; silu(g) = g / (1 + exp(-g)). */
static inline float exp_clamped(float x) { return exp_fixed(fminf(x, 88.0f)); }

static void silu_mul_portable(const float *x, int64_t rows, int64_t f, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i++) {
            float g = x[r * 2 * f + i];
            out[r * f + i] = (g / (1.0f + exp_clamped(-g))) * x[r * 2 * f + f + i];
        }
}

#if HAVE_X86
__attribute__((target("avx2,fma,f16c"))) static void silu_mul_avx2(const float *x, int64_t rows, int64_t f, float *out) {
    __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(88.0f), zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
        for (; i + 8 <= f; i += 8) {
            __m256 g = _mm256_loadu_ps(x + r * 2 * f + i), u = _mm256_loadu_ps(x + r * 2 * f + f + i);
            __m256 e = exp8_avx2(_mm256_min_ps(_mm256_sub_ps(zero, g), top));
            _mm256_storeu_ps(out + r * f + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
        }
        for (; i < f; i++) {
            float g = x[r * 2 * f + i];
            out[r * f + i] = (g / (1.0f + exp_clamped(-g))) * x[r * 2 * f + f + i];
        }
    }
}
#endif

static void silu_mul_on(int isa, const float *x, int64_t rows, int64_t f, float *out) {
#if HAVE_X86
    if (isa) {
        silu_mul_avx2(x, rows, f, out);
        return;
    }
#endif
    (void)isa;
    silu_mul_portable(x, rows, f, out);
}

static int read_longs(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *v, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* rope_kv(qkv, qkv_row, pos, n, cos, ssin, heads, kv_heads, hd, q_out, k, v, kv_head, kv_pos) */
static PyObject *py_rope_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[14];
    if (read_longs(args, nargs, 14, v, "rope_kv") < 0) return NULL;
    Rope a = {(const float *)(intptr_t)v[0], v[1], v[2], v[3], (const float *)(intptr_t)v[4],
              (const float *)(intptr_t)v[5], (int)v[6], (int)v[7], (int)v[8], (float *)(intptr_t)v[9],
              (uint16_t *)(intptr_t)v[10], (uint16_t *)(intptr_t)v[11], v[12], v[13]};
    if (a.hd <= 0 || a.hd % 2 || a.hd > 512 || a.n < 0 || a.pos < 0) {
        PyErr_SetString(PyExc_ValueError, "rope_kv: head dim must be even and at most 512");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_kv_run(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_mul(x, rows, f, out, portable) */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (read_longs(args, nargs, 5, v, "silu_mul") < 0) return NULL;
    const float *x = (const float *)(intptr_t)v[0];
    float *out = (float *)(intptr_t)v[3];
    Py_BEGIN_ALLOW_THREADS
    silu_mul_on(isa_for(v[4]), x, v[1], v[2], out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x_ptr, w_ptr, rows, cols, eps, y_ptr, portable) */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "rms_norm takes 7 arguments");
        return NULL;
    }
    double eps = PyFloat_AsDouble(args[4]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    long long v[6]; /* x, w, rows, cols, y, portable */
    PyObject *ints[6] = {args[0], args[1], args[2], args[3], args[5], args[6]};
    if (read_longs(ints, 6, 6, v, "rms_norm") < 0) return NULL;
    const float *x = (const float *)(intptr_t)v[0], *w = (const float *)(intptr_t)v[1];
    float *y = (float *)(intptr_t)v[4];
    Py_BEGIN_ALLOW_THREADS
    rms_norm_on(isa_for(v[5]), x, w, v[2], v[3], (float)eps, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attend(q, q_row, q_head, k, v, kv_head, kv_pos, heads, kv_heads, hd, pos, n, out, portable, threads);
 * the scale is 1 / sqrt(hd) in float32 */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[15];
    if (read_longs(args, nargs, 15, v, "attend") < 0) return NULL;
    Attn a = {(const float *)(intptr_t)v[0], v[1], v[2], (const uint16_t *)(intptr_t)v[3],
              (const uint16_t *)(intptr_t)v[4], v[5], v[6], (int)v[7], (int)v[8], (int)v[9], v[10], v[11],
              1.0f / sqrtf((float)v[9]), (float *)(intptr_t)v[12]};
    if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads || a.hd <= 0 || a.hd % 8 || a.pos < 0 || a.n < 0) {
        PyErr_SetString(PyExc_ValueError, "attend: heads must be a multiple of kv heads and hd of 8");
        return NULL;
    }
    a.isa_avx2 = isa_for(v[13]) >= ISA_AVX2;
    /* a decode step's few pairs are not worth waking the pool for */
    int threads = a.n * (a.pos + a.n) * a.heads >= 4096 ? (int)v[14] : 1;
    Job j = {attend_part, &a, 1};
    Py_BEGIN_ALLOW_THREADS
    run_job(&j, threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- Python ---- */

/* y = x @ W.T (or y += it), x quantized per row first; -1 when out of memory. */
typedef struct {
    int qtype;
    const uint8_t *w;
    int64_t row_bytes, n, k;
} WRef;

static int matmul_c(const WRef *wr, const float *x, int64_t m, float *y, int threads, int isa, int accumulate) {
    int k_type = block_elems(wr->qtype) == QKK;
    int64_t nb = wr->k / block_elems(wr->qtype);
    void *xq = malloc((size_t)(m * nb + 1) * (k_type ? sizeof(XKBlock) : sizeof(XBlock)));
    if (!xq) return -1;
#if HAVE_X86
    if (isa && k_type) quantize_rows_k_avx2(x, m, wr->k, xq);
    else if (isa) quantize_rows_avx2(x, m, wr->k, xq);
    else
#endif
    if (k_type) quantize_rows_k(x, m, wr->k, xq);
    else quantize_rows(x, m, wr->k, xq);
    MatJob mj = {wr->qtype, isa, accumulate, wr->w, wr->row_bytes, wr->n, m, nb, xq, y};
    Job j = {matmul_part, &mj, 1};
    run_job(&j, threads < 1 ? 1 : threads);
    free(xq);
    return 0;
}

/* matmul(qtype, w_ptr, row_bytes, n, k, x_ptr, m, y_ptr, threads, portable, accumulate) */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "matmul takes 11 arguments");
        return NULL;
    }
    long long v[11];
    for (int i = 0; i < 11; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    int qtype = (int)v[0], threads = (int)v[8], portable = (int)v[9];
    int64_t row_bytes = v[2], n = v[3], k = v[4], m = v[6];
    if (row_bytes_of(qtype, k) == 0 || row_bytes != row_bytes_of(qtype, k) || n < 0 || m < 0) {
        PyErr_SetString(PyExc_ValueError, "matmul: unsupported block type or inconsistent sizes");
        return NULL;
    }
    WRef wr = {qtype, (const uint8_t *)(intptr_t)v[1], row_bytes, n, k};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul_c(&wr, (const float *)(intptr_t)v[5], m, (float *)(intptr_t)v[7], threads, isa_for(portable),
                  (int)v[10]);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* A whole Llama decoder layer over R rows, in place on y [R, H] (float32, the residual stream):
 * y += o(attention(rope(qkv(norm(y))))), then y += down(silu(gate) * up)(norm(y)), each step the
 * kernel's own per-row function above, so the result is the bits the steps give one by one.
 * segments: int64 [S, 7] = (first row, rows, first position, k cache, v cache, kv head stride,
 * kv position stride) per session. */
static int layer_c(float *y, int64_t R, int64_t H, float eps, const float *attn_w, const float *ffn_w,
                   const WRef *wqkv, const WRef *wo, const WRef *wgu, const WRef *wdown, const float *cos,
                   const float *ssin, int nh, int nkv, int hd, const int64_t *seg, int64_t S, int threads,
                   int isa) {
    int64_t nq = wqkv->n, na = (int64_t)nh * hd, f = wdown->k;
    float *h = malloc(sizeof(float) * R * H), *qkv = malloc(sizeof(float) * R * nq);
    float *q = malloc(sizeof(float) * R * na), *att = malloc(sizeof(float) * R * na);
    float *gu = malloc(sizeof(float) * R * 2 * f), *act = malloc(sizeof(float) * R * f);
    int rc = -1;
    if (!h || !qkv || !q || !att || !gu || !act) goto done;
    rms_norm_on(isa, y, attn_w, R, H, eps, h);
    if (matmul_c(wqkv, h, R, qkv, threads, isa, 0) < 0) goto done;
    for (int64_t i = 0; i < S; i++) {
        const int64_t *g = seg + 7 * i;
        int64_t row = g[0], n = g[1], pos = g[2];
        Rope rp = {qkv + row * nq, nq, pos, n, cos, ssin, nh, nkv, hd, q + row * na, (uint16_t *)(intptr_t)g[3],
                   (uint16_t *)(intptr_t)g[4], g[5], g[6]};
        rope_kv_run(&rp);
        Attn a = {q + row * na, na, hd, (const uint16_t *)(intptr_t)g[3], (const uint16_t *)(intptr_t)g[4], g[5], g[6],
                  nh, nkv, hd, pos, n, 1.0f / sqrtf((float)hd), att + row * na, isa};
        Job j = {attend_part, &a, 1};
        run_job(&j, n * (pos + n) * nh >= 4096 ? threads : 1);
    }
    if (matmul_c(wo, att, R, y, threads, isa, 1) < 0) goto done;
    rms_norm_on(isa, y, ffn_w, R, H, eps, h);
    if (matmul_c(wgu, h, R, gu, threads, isa, 0) < 0) goto done;
    silu_mul_on(isa, gu, R, f, act);
    if (matmul_c(wdown, act, R, y, threads, isa, 1) < 0) goto done;
    rc = 0;
done:
    free(h);
    free(qkv);
    free(q);
    free(att);
    free(gu);
    free(act);
    return rc;
}

static int read_wref(PyObject *const *args, WRef *w, int64_t k) {
    long long v[4];
    if (read_longs(args, 4, 4, v, "layer") < 0) return -1;
    *w = (WRef){(int)v[0], (const uint8_t *)(intptr_t)v[1], v[2], v[3], k};
    if (row_bytes_of(w->qtype, k) == 0 || w->row_bytes != row_bytes_of(w->qtype, k)) {
        PyErr_SetString(PyExc_ValueError, "layer: a weight's block type or sizes do not fit");
        return -1;
    }
    return 0;
}

/* layer(y, R, H, eps, attn_norm, ffn_norm, wqkv x4, wo x4, wgu x4, wdown x4, cos, ssin, nh, nkv, hd,
 *       segments, S, threads, portable); each weight as (qtype, data, row bytes, out features) */
static PyObject *py_layer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 31) {
        PyErr_SetString(PyExc_TypeError, "layer takes 31 arguments");
        return NULL;
    }
    long long a[3], b[2], c[9];
    double eps = PyFloat_AsDouble(args[3]);
    if ((eps == -1.0 && PyErr_Occurred()) || read_longs(args, 3, 3, a, "layer") < 0 ||
        read_longs(args + 4, 2, 2, b, "layer") < 0 || read_longs(args + 22, 9, 9, c, "layer") < 0)
        return NULL;
    int64_t R = a[1], H = a[2];
    int nh = (int)c[2], nkv = (int)c[3], hd = (int)c[4];
    WRef wqkv, wo, wgu, wdown;
    if (read_wref(args + 6, &wqkv, H) < 0 || read_wref(args + 10, &wo, (int64_t)nh * hd) < 0 ||
        read_wref(args + 14, &wgu, H) < 0)
        return NULL;
    if (read_wref(args + 18, &wdown, wgu.n / 2) < 0) return NULL;
    if (nh <= 0 || nkv <= 0 || nh % nkv || hd % 8 || hd > 512 || wqkv.n != (int64_t)(nh + 2 * nkv) * hd ||
        wo.n != H || wdown.n != H || wgu.n % 2 || R < 0) {
        PyErr_SetString(PyExc_ValueError, "layer: the weights' shapes do not make a Llama layer");
        return NULL;
    }
    int rc, threads = c[7] < 1 ? 1 : (int)c[7];
    Py_BEGIN_ALLOW_THREADS
    rc = layer_c((float *)(intptr_t)a[0], R, H, (float)eps, (const float *)(intptr_t)b[0], (const float *)(intptr_t)b[1],
                 &wqkv, &wo, &wgu, &wdown, (const float *)(intptr_t)c[0], (const float *)(intptr_t)c[1], nh, nkv, hd,
                 (const int64_t *)(intptr_t)c[5], c[6], threads, isa_for(c[8]));
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* limit_isa(name): the process's kernels run on at most this instruction set (and the CPU's) from now on */
static PyObject *py_limit_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    cpu_isa();
    for (int i = 0; i <= ISA_AVX512; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            best_isa = i < cpu_best ? i : cpu_best;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "limit_isa: unknown instruction set %s", name);
    return NULL;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(ISA_NAMES[cpu_isa()]);
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "y = x @ W.T over GGUF blocks"},
    {"isa", py_isa, METH_NOARGS, "the instruction set the kernels run on"},
    {"limit_isa", py_limit_isa, METH_O, "run on at most this instruction set from now on"},
    {"layer", (PyCFunction)(void (*)(void))py_layer, METH_FASTCALL, "a whole Llama decoder layer, in place"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "RMSNorm of float32 rows"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL, "causal attention over bfloat16 KV"},
    {"rope_kv", (PyCFunction)(void (*)(void))py_rope_kv, METH_FASTCALL, "RoPE of q and k, k and v into the KV cache"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, "silu(gate) * up"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", "GGUF block matmuls", -1, methods};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
