/* The AVX2 path (with FMA and F16C): the portable path's sums for the 32-wide types in the row layout
 * (four rows' block integers from one horizontal reduction, their float steps as one 4-lane vector;
 * direct for few x rows, decoded strips for many), the K types eight lanes at a time, and the
 * activations' quantization; the AVX-512 path, which reuses these helpers, is included at its end.
 * Part of _blocks.c (see the rules there). */
#include "_blocks.h"

/* ---- AVX2 path: the portable path's sums ---- */

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

/* Eight int32 partial sums: lane j = sum over elements 4j..4j+3 of u * q. Unsigned codes go straight
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

/* The K types' outputs: each row's eight lanes in lanes_sum's order. */
AVX2 static inline void finish_avx2(const __m256 *acc, const float *off, int rows, float *out, int accumulate) {
    for (int i = 0; i < rows; i++) {
        float lane[8];
        _mm256_storeu_ps(lane, acc[i]);
        float sum = lanes_sum(lane) + off[i];
        out[i] = accumulate ? out[i] + sum : sum; /* y = x + W h: the residual added once, as x + (W h) */
    }
}

/* Four rows' block sums from their eight-lane partial sums d0..d3: lane i of the result is row i's
 * whole integer (integers are exact in any order). */
AVX2 static inline __m128i rows4_sum(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The 32-wide types' outputs, `rows` lanes of them: acc + off, then the residual where accumulating. */
AVX2 static inline void finish4(__m128 acc, __m128 off, int rows, float *out, int accumulate) {
    float s[4];
    _mm_storeu_ps(s, _mm_add_ps(acc, off));
    for (int i = 0; i < rows; i++) out[i] = accumulate ? out[i] + s[i] : s[i]; /* x + (W h) */
}

/* Four rows at block b, t their exact integers (before the code offset): acc += (a * xd) * t and,
 * for a weight's own offsets, off += c * xs; rows past a short strip carry zero codes and scales. */
AVX2 static inline __attribute__((always_inline)) void
step_t4(const int qtype, __m128i t, __m128 a, __m128 c, const XBlock *x, __m128 *acc, __m128 *off) {
    if (code_bias(qtype)) t = _mm_sub_epi32(t, _mm_set1_epi32(code_bias(qtype) * x->sum));
    *acc = _mm_fmadd_ps(_mm_mul_ps(a, _mm_set1_ps(x->d)), _mm_cvtepi32_ps(t), *acc);
    if (own_offset(qtype)) *off = _mm_fmadd_ps(c, _mm_set1_ps(x->s), *off);
}

/* step_t4 from the four rows' eight-lane partial sums. */
AVX2 static inline __attribute__((always_inline)) void
step4(const int qtype, __m256i d0, __m256i d1, __m256i d2, __m256i d3, __m128 a, __m128 c, const XBlock *x,
      __m128 *acc, __m128 *off) {
    step_t4(qtype, rows4_sum(d0, d1, d2, d3), a, c, x, acc, off);
}

/* One x row against one strip of `rows` weight rows, each block decoded where it is met. Inlined
 * with constant qtype and rows, so the accumulators stay in registers and the type's branches fold
 * away. */
AVX2 static inline __attribute__((always_inline)) void
strip_direct(const int qtype, const int rows, const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1,
             const XBlock *xr, int64_t nb, float *out, int accumulate) {
    const int sgn = signed_codes(qtype);
    __m128 acc = _mm_setzero_ps(), off = _mm_setzero_ps();
    /* the next strips stream in while this one is summed (its rows are read side by side, too
     * short for the hardware prefetcher: 2.3x the bandwidth out of cache, measured) */
    const char *next = (const char *)(w + (c0 + 8 * STRIP) * row_bytes);
    int64_t ahead = c0 + 8 * STRIP < n1 ? STRIP * row_bytes : 0, per = (STRIP * row_bytes + nb - 1) / nb;
    for (int64_t b = 0; b < nb; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)xr[b].q);
        for (int64_t p = b * per; p < (b + 1) * per && p < ahead; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
        __m256i d[STRIP];
        float a[STRIP], c[STRIP];
        for (int i = 0; i < STRIP; i++) {
            if (i < rows) {
                const uint8_t *row = w + (c0 + i) * row_bytes;
                scales_f16c(qtype, row, b, &a[i], &c[i]);
                d[i] = dot_avx2(sgn, codes_avx2(qtype, row, b), q);
            } else {
                a[i] = c[i] = 0.0f;
                d[i] = _mm256_setzero_si256();
            }
        }
        step4(qtype, d[0], d[1], d[2], d[3], _mm_setr_ps(a[0], a[1], a[2], a[3]), _mm_setr_ps(c[0], c[1], c[2], c[3]),
              xr + b, &acc, &off);
    }
    finish4(acc, off, rows, out, accumulate);
}

#define STRIP_DIRECT(QT)                                                                                    \
    do {                                                                                                    \
        if (rows == STRIP) strip_direct(QT, STRIP, w, row_bytes, c0, n1, xr, nb, out, accumulate);          \
        else if (rows == 3) strip_direct(QT, 3, w, row_bytes, c0, n1, xr, nb, out, accumulate);             \
        else if (rows == 2) strip_direct(QT, 2, w, row_bytes, c0, n1, xr, nb, out, accumulate);             \
        else strip_direct(QT, 1, w, row_bytes, c0, n1, xr, nb, out, accumulate);                            \
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

/* Every x row against one decoded strip (a short strip's missing rows decoded as zeros, so every
 * strip is met as four rows and only its own are stored); qtype a constant where it is inlined. */
AVX2 static inline __attribute__((always_inline)) void
strips_meet(const int qtype, const __m256i *codes, const float *sa, const float *sb,
            int rows, const XBlock *xq, int64_t m, int64_t nb, float *y, int64_t n, int accumulate) {
    const int sgn = signed_codes(qtype);
    for (int64_t r = 0; r < m; r++) {
        const XBlock *xr = xq + r * nb;
        __m128 acc = _mm_setzero_ps(), off = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)xr[b].q);
            const __m256i *u = codes + b * STRIP;
            step4(qtype, dot_avx2(sgn, u[0], q), dot_avx2(sgn, u[1], q), dot_avx2(sgn, u[2], q), dot_avx2(sgn, u[3], q),
                  _mm_loadu_ps(sa + STRIP * b), _mm_loadu_ps(sb + STRIP * b), xr + b, &acc, &off);
        }
        finish4(acc, off, rows, y + r * n, accumulate);
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
    __m256i *codes = aligned_alloc(32, (size_t)STRIP * nb * sizeof(__m256i));
    float *sa = malloc((size_t)STRIP * nb * sizeof(float)), *sb = malloc((size_t)STRIP * nb * sizeof(float));
    if (!codes || !sa || !sb) { /* the same sums, each x row decoding for itself */
        free(codes);
        free(sa);
        free(sb);
        rows_avx2_direct(qtype, w, row_bytes, n0, n1, n, xq, m, nb, y, accumulate);
        return;
    }
    for (int64_t c0 = n0; c0 < n1; c0 += STRIP) {
        int rows = (int)(n1 - c0 < STRIP ? n1 - c0 : STRIP);
        prefetch_strip(w, row_bytes, c0 + AHEAD * STRIP, n1);
        for (int i = 0; i < STRIP; i++) {
            const uint8_t *wr = w + (c0 + i) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                int64_t at = b * STRIP + i;
                if (i >= rows) {
                    codes[at] = _mm256_setzero_si256();
                    sa[at] = sb[at] = 0.0f;
                    continue;
                }
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
        switch (qtype) { /* constant types, so the accumulators stay in registers and branches fold */
        case Q4_0: strips_meet(Q4_0, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate); break;
        case Q4_1: strips_meet(Q4_1, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate); break;
        case Q5_0: strips_meet(Q5_0, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate); break;
        case Q5_1: strips_meet(Q5_1, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate); break;
        default: strips_meet(Q8_0, codes, sa, sb, rows, xq, m, nb, y + c0, n, accumulate); break;
        }
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
            o->sum = lo + hi;
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
