/* The block matmuls on AVX-512 (F, BW, VL, DQ and VNNI), included by _blocks.c after its AVX2 part,
 * whose helpers (codes_avx2, scales_f16c, step_t4, finish4, k4_scales_avx2, decode_k, finish_avx2)
 * it reuses.
 *
 * The bits are the AVX2 path's. 32-wide types in the row layout: a 512-bit register holds two weight
 * rows side by side, VNNI's vpdpbusd their eight partial integer sums each (the integer that maddubs
 * + madd give: no pair of products here reaches maddubs' int16 saturation, |u| <= 128, |q| <= 127:
 * 2 * 128 * 127 < 32768, and the int32 sums cannot overflow); unpacks and shuffles reduce eight (or
 * four) rows to one integer each, then one vector of float steps, each lane a row's. The K types
 * keep AVX2's maddubs + madd with their integer scales, two rows at a time, each half of a register
 * one row's eight lanes. A strip's rows that do not fill a pair go through the AVX2 code, which gives
 * the same bits. */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

/* Sixteen int32 lanes: each half is dot_avx2 of its row's codes u and the activations q. vpdpbusd
 * takes unsigned codes; signed ones (Q8_0) go as u + 128 (u ^ 0x80, see flip_signed), the sum
 * starting from -128 * (q's four elements), which `bias` holds (bias_vnni): the same integer. */
AVX512 static inline __m512i dot_vnni(const int signed8, __m512i u, __m512i q, __m512i bias) {
    return _mm512_dpbusd_epi32(signed8 ? bias : _mm512_setzero_si512(), u, q);
}

AVX512 static inline __m512i bias_vnni(const int signed8, __m512i q) {
    if (!signed8) return _mm512_setzero_si512();
    return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), q));
}

AVX512 static inline __m512i flip_signed(const int signed8, __m512i u) {
    return signed8 ? _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)) : u;
}

AVX512 static inline __m512i pair_si(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

AVX512 static inline __m512 pair_ps(float lo, float hi) {
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

/* Two rows' codes of block b. Q4_0 / Q4_1: each row's 16 bytes twice in its half, the upper
 * copy shifted by four, then masked: the low nibbles are elements 0..15, the high ones 16..31,
 * as nibbles16 orders them. */
AVX512 static inline __attribute__((always_inline)) __m512i codes_pair(const int qtype, const uint8_t *r0,
                                                                       const uint8_t *r1, int64_t b) {
    if (qtype == Q4_0 || qtype == Q4_1) {
        const int at = qtype == Q4_1 ? 20 : 18, skip = qtype == Q4_1 ? 4 : 2;
        __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(r0 + b * at + skip))),
                                       _mm_loadu_si128((const __m128i *)(r1 + b * at + skip)), 2);
        v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(2, 2, 0, 0));
        v = _mm512_mask_srli_epi16(v, 0xff00ff00u, v, 4);
        return _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
    }
    return pair_si(codes_avx2(qtype, r0, b), codes_avx2(qtype, r1, b));
}

/* Sum halves into two outputs each, as finish_avx2 does for a row. */
AVX512 static inline void finish_pairs(const __m512 *acc, const float *off, int pairs, float *out, int accumulate) {
    for (int p = 0; p < pairs; p++) {
        __m256 h[2] = {_mm512_castps512_ps256(acc[p]), _mm512_extractf32x8_ps(acc[p], 1)};
        finish_avx2(h, off + 2 * p, 2, out + 2 * p, accumulate);
    }
}

/* Eight rows' block-b scales at once: their first four bytes gathered (a half d, and Q4_1 / Q5_1's
 * half m after it), all sixteen halves converted as F16C converts one, then the d's put in lanes
 * 0-7 and the m's in 8-15 (junk for the types without one, which never read them). */
AVX512 static inline __attribute__((always_inline)) __m512 heads8(const uint8_t *blk, __m256i rows_at) {
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm512_permutexvar_ps(split, _mm512_cvtph_ps(_mm256_i32gather_epi32((const int *)blk, rows_at, 1)));
}

/* Eight rows' block sums from four pair registers (z_p: rows 2p and 2p + 1, eight partial sums
 * each): lane i of the result is row i's whole integer. */
AVX512 static inline __m256i rows8_sum(__m512i z0, __m512i z1, __m512i z2, __m512i z3) {
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(z2, z3), _mm512_unpackhi_epi32(z2, z3));
    __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    /* 128-bit lane 0 of c: rows 0, 2, 4, 6 over their partial sums 0-3, lane 1 over 4-7; lanes 2
     * and 3: rows 1, 3, 5, 7 */
    c = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, c));
}

/* Four rows' block sums from two pair registers (rows8_sum for two pairs). */
AVX512 static inline __m128i rows4_sum_512(__m512i z0, __m512i z1) {
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
    a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)));
    a = _mm512_add_epi32(a, _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(order, a));
}

/* One x row against eight weight rows, each block decoded where it is met (strip_direct's order and
 * prefetch), the eight rows' integers, scales and offsets as vectors (each lane the same rounding
 * as the scalar steps). */
AVX512 static inline __attribute__((always_inline)) void
strip8_direct_512(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1, const XBlock *xr,
                  int64_t nb, float *out, int accumulate) {
    const int sgn = signed_codes(qtype), bb = block_bytes(qtype);
    const uint8_t *base = w + c0 * row_bytes;
    const __m256i rows_at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)row_bytes));
    __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    const char *next = (const char *)(w + (c0 + 8 * STRIP) * row_bytes);
    int64_t ahead = c0 + 8 * STRIP < n1 ? 8 * row_bytes : 0, per = (8 * row_bytes + nb - 1) / nb;
    for (int64_t b = 0; b < nb; b++) {
        __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xr[b].q)), bias = bias_vnni(sgn, q);
        for (int64_t p = b * per; p < (b + 1) * per && p < ahead; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
        __m512 dm = heads8(base + b * bb, rows_at);
        __m512i z[4];
        for (int p = 0; p < 4; p++) {
            const uint8_t *r0 = base + 2 * p * row_bytes;
            z[p] = dot_vnni(sgn, flip_signed(sgn, codes_pair(qtype, r0, r0 + row_bytes, b)), q, bias);
        }
        __m256i t = rows8_sum(z[0], z[1], z[2], z[3]);
        if (code_bias(qtype)) t = _mm256_sub_epi32(t, _mm256_set1_epi32(code_bias(qtype) * xr[b].sum));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm512_castps512_ps256(dm), _mm256_set1_ps(xr[b].d)), _mm256_cvtepi32_ps(t), acc);
        if (own_offset(qtype)) off = _mm256_fmadd_ps(_mm512_extractf32x8_ps(dm, 1), _mm256_set1_ps(xr[b].s), off);
    }
    __m256 s = _mm256_add_ps(acc, off);
    _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), s) : s); /* x + (W h) */
}

#define DIRECT_512(QT)                                                                                      \
    do {                                                                                                    \
        if (rows == 2 * STRIP) strip8_direct_512(QT, w, row_bytes, c0, n1, xr, nb, out, accumulate);          \
        else STRIP_DIRECT(QT);                                                                              \
    } while (0)

/* Few x rows (decode): eight weight rows at a time where there are eight; a part's last four or fewer
 * on AVX2 (the same bits). */
AVX512 static void rows_avx512_direct(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1,
                                      int64_t n, const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1;) {
        int rows = (int)(n1 - c0 >= 2 * STRIP ? 2 * STRIP : (n1 - c0 >= STRIP ? STRIP : n1 - c0));
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float *out = y + r * n + c0;
            switch (qtype) {
            case Q4_0: DIRECT_512(Q4_0); break;
            case Q4_1: DIRECT_512(Q4_1); break;
            case Q5_0: DIRECT_512(Q5_0); break;
            case Q5_1: DIRECT_512(Q5_1); break;
            default: DIRECT_512(Q8_0); break;
            }
        }
        c0 += rows;
    }
}

/* Every x row against one decoded strip of STRIP rows (two pairs): a block's four integers are two
 * vpdpbusd and one reduction. */
AVX512 static inline __attribute__((always_inline)) void
strips_meet_512(const int qtype, const __m512i *codes, const float *sa, const float *sb, const XBlock *xq, int64_t m,
                int64_t nb, float *y, int64_t n, int accumulate) {
    const int sgn = signed_codes(qtype);
    for (int64_t r = 0; r < m; r++) {
        const XBlock *xr = xq + r * nb;
        __m128 acc = _mm_setzero_ps(), off = _mm_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xr[b].q)), bias = bias_vnni(sgn, q);
            __m128i t = rows4_sum_512(dot_vnni(sgn, codes[2 * b], q, bias), dot_vnni(sgn, codes[2 * b + 1], q, bias));
            step_t4(qtype, t, _mm_loadu_ps(sa + STRIP * b), _mm_loadu_ps(sb + STRIP * b), xr + b, &acc, &off);
        }
        finish4(acc, off, STRIP, y + r * n, accumulate);
    }
}

/* Many x rows (prefill, batches): rows_avx2_strips with the pairs above; a strip short of STRIP
 * rows goes through AVX2's. */
AVX512 static void rows_avx512_strips(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1,
                                      int64_t n, const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    __m512i *codes = aligned_alloc(64, (size_t)2 * nb * sizeof(__m512i));
    float *sa = malloc((size_t)STRIP * nb * sizeof(float)), *sb = malloc((size_t)STRIP * nb * sizeof(float));
    int64_t whole = n0 + (n1 - n0) / STRIP * STRIP;
    if (!codes || !sa || !sb) whole = n0; /* out of memory: all of it on AVX2, which allocates less */
    for (int64_t c0 = n0; c0 < whole; c0 += STRIP) {
        prefetch_strip(w, row_bytes, c0 + AHEAD * STRIP, n1);
        for (int p = 0; p < 2; p++) /* a pair's two rows read front to back, as the prefetchers like */
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *r0 = w + (c0 + 2 * p) * row_bytes, *r1 = r0 + row_bytes;
                switch (qtype) { /* constant types, so each decoder's branches fold away */
                case Q4_0: codes[2 * b + p] = codes_pair(Q4_0, r0, r1, b); break;
                case Q4_1: codes[2 * b + p] = codes_pair(Q4_1, r0, r1, b); break;
                case Q5_0: codes[2 * b + p] = codes_pair(Q5_0, r0, r1, b); break;
                case Q5_1: codes[2 * b + p] = codes_pair(Q5_1, r0, r1, b); break;
                default: codes[2 * b + p] = flip_signed(1, codes_pair(Q8_0, r0, r1, b)); break;
                }
                scales_f16c(qtype, r0, b, &sa[STRIP * b + 2 * p], &sb[STRIP * b + 2 * p]);
                scales_f16c(qtype, r1, b, &sa[STRIP * b + 2 * p + 1], &sb[STRIP * b + 2 * p + 1]);
            }
        switch (qtype) {
        case Q4_0: strips_meet_512(Q4_0, codes, sa, sb, xq, m, nb, y + c0, n, accumulate); break;
        case Q4_1: strips_meet_512(Q4_1, codes, sa, sb, xq, m, nb, y + c0, n, accumulate); break;
        case Q5_0: strips_meet_512(Q5_0, codes, sa, sb, xq, m, nb, y + c0, n, accumulate); break;
        case Q5_1: strips_meet_512(Q5_1, codes, sa, sb, xq, m, nb, y + c0, n, accumulate); break;
        default: strips_meet_512(Q8_0, codes, sa, sb, xq, m, nb, y + c0, n, accumulate); break;
        }
    }
    free(codes);
    free(sa);
    free(sb);
    if (whole < n1) rows_avx2_strips(qtype, w, row_bytes, whole, n1, n, xq, m, nb, y, accumulate);
}

/* ---- K types: superblock_k4, superblock_q6k and meet_k with a pair of rows a register ---- */

/* Int16 `i` of each 128-bit lane of v in all eight int16 of that lane (SPREAD16, four lanes). */
#define SPREAD16_512(v, i) _mm512_shuffle_epi8((v), _mm512_set1_epi16((short)(0x0100 + 0x0202 * (i))))

AVX512 static inline __m512i pair_bcast128(__m128i lo, __m128i hi) {
    return pair_si(_mm256_broadcastsi128_si256(lo), _mm256_broadcastsi128_si256(hi));
}

/* superblock_k4 for rows b0 and b1 (the same super-block of each), acc's halves theirs. */
AVX512 static inline __attribute__((always_inline)) __m512
superblock_k4_pair(const int qtype, const uint8_t *b0, const uint8_t *b1, const XKBlock *x, __m512i sums, __m512 acc) {
    __m128i sm0 = k4_scales_avx2(b0), sm1 = k4_scales_avx2(b1);
    const __m128i twice = _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512i scales = pair_bcast128(_mm_cvtepu8_epi16(sm0), _mm_cvtepu8_epi16(sm1));
    __m512i mins = pair_si(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm0, twice)), _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm1, twice)));
    __m512i low = _mm512_madd_epi16(mins, sums), dot = _mm512_setzero_si512(), m4 = _mm512_set1_epi8(0x0f);
    __m512i bit4 = _mm512_set1_epi8(0x10);
    __m512i hb = qtype == Q5_K ? pair_si(_mm256_loadu_si256((const __m256i *)(b0 + 16)), _mm256_loadu_si256((const __m256i *)(b1 + 16))) : m4;
    const int at = qtype == Q5_K ? 48 : 16;
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        __m512i v = pair_si(_mm256_loadu_si256((const __m256i *)(b0 + at + 32 * p)),
                            _mm256_loadu_si256((const __m256i *)(b1 + at + 32 * p)));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (qtype == Q5_K) {
            lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(hb, 4), bit4));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(hb, 3), bit4));
            hb = _mm512_srli_epi16(hb, 2);
        }
        __m512i plo = _mm512_maddubs_epi16(lo, _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->q + 64 * p))));
        __m512i phi = _mm512_maddubs_epi16(hi, _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->q + 64 * p + 32))));
        dot = _mm512_add_epi32(dot, _mm512_madd_epi16(plo, SPREAD16_512(scales, 2 * p)));
        dot = _mm512_add_epi32(dot, _mm512_madd_epi16(phi, SPREAD16_512(scales, 2 * p + 1)));
    }
    acc = _mm512_fmadd_ps(pair_ps(half_f16c(b0) * x->d, half_f16c(b1) * x->d), _mm512_cvtepi32_ps(dot), acc);
    return _mm512_fmadd_ps(pair_ps(-(half_f16c(b0 + 2) * x->d), -(half_f16c(b1 + 2) * x->d)), _mm512_cvtepi32_ps(low), acc);
}

/* Q6_K's scale of 32-block t of a half: each row's low 16 elements take int16 2t of their lane's
 * scales, the high 16 take 2t + 1 (superblock_q6k's pattern, per row). */
AVX512 static inline __m512i q6k_pick(int t) {
    return _mm512_broadcast_i64x4(_mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * t)),
                                                   _mm_set1_epi16((short)(0x0100 + 0x0404 * t))));
}

/* superblock_q6k for rows b0 and b1. */
AVX512 static inline __attribute__((always_inline)) __m512
superblock_q6k_pair(const uint8_t *b0, const uint8_t *b1, const XKBlock *x, __m512i sums, __m512 acc) {
    __m512i sc16 = pair_si(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b0 + 192))),
                           _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b1 + 192))));
    __m512i dot = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_madd_epi16(sc16, sums), 5));
    __m512i m4 = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i sv = pair_bcast128(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(b0 + 192 + 8 * h))),
                                   _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(b1 + 192 + 8 * h))));
        __m512i ql0 = pair_si(_mm256_loadu_si256((const __m256i *)(b0 + 64 * h)), _mm256_loadu_si256((const __m256i *)(b1 + 64 * h)));
        __m512i ql1 = pair_si(_mm256_loadu_si256((const __m256i *)(b0 + 64 * h + 32)),
                              _mm256_loadu_si256((const __m256i *)(b1 + 64 * h + 32)));
        __m512i qh = pair_si(_mm256_loadu_si256((const __m256i *)(b0 + 128 + 32 * h)),
                             _mm256_loadu_si256((const __m256i *)(b1 + 128 + 32 * h)));
        __m512i u[4] = {
            _mm512_or_si512(_mm512_and_si512(ql0, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), top)),
            _mm512_or_si512(_mm512_and_si512(ql1, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), top)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), m4), _mm512_and_si512(qh, top)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), top)),
        };
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512i p = _mm512_maddubs_epi16(u[t], _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->q + 128 * h + 32 * t))));
            __m512i pick = q6k_pick(t);
            dot = _mm512_add_epi32(dot, _mm512_madd_epi16(p, _mm512_shuffle_epi8(sv, pick)));
        }
    }
    return _mm512_fmadd_ps(pair_ps(half_f16c(b0 + 208) * x->d, half_f16c(b1 + 208) * x->d), _mm512_cvtepi32_ps(dot), acc);
}

/* One x row against a strip of STRIP weight rows (two pairs), a super-block at a time (strip_k's
 * order and prefetch). */
AVX512 static inline __attribute__((always_inline)) void
strip_k_512(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t c0, int64_t n1, const XKBlock *xr,
            int64_t nsb, float *out, int accumulate) {
    const int bb = block_bytes(qtype);
    const float off[STRIP] = {0};
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const char *next = (const char *)(w + (c0 + STRIP) * row_bytes);
    int64_t ahead = c0 + STRIP < n1 ? STRIP * row_bytes : 0, per = (STRIP * row_bytes + nsb - 1) / nsb;
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i sums = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xr[sb].sums));
        for (int64_t p = sb * per; p < (sb + 1) * per && p < ahead; p += 64) _mm_prefetch(next + p, _MM_HINT_T0);
        for (int p = 0; p < 2; p++) {
            const uint8_t *b0 = w + (c0 + 2 * p) * row_bytes + sb * bb, *b1 = b0 + row_bytes;
            acc[p] = qtype == Q6_K ? superblock_q6k_pair(b0, b1, xr + sb, sums, acc[p])
                                   : superblock_k4_pair(qtype, b0, b1, xr + sb, sums, acc[p]);
        }
    }
    finish_pairs(acc, off, 2, out, accumulate);
}

/* A decoded K super-block of two rows: decode_k's codes, scales and mins side by side. */
typedef struct {
    __m512i u[8], sa, sb, extra;
    float d[2], dmin[2];
} KDec2;

AVX512 static inline __attribute__((always_inline)) void decode_k_pair(const int qtype, const uint8_t *b0,
                                                                       const uint8_t *b1, KDec2 *k) {
    KDec r[2];
    decode_k(qtype, b0, &r[0]);
    decode_k(qtype, b1, &r[1]);
    for (int j = 0; j < 8; j++) k->u[j] = pair_si(r[0].u[j], r[1].u[j]);
    k->sa = pair_si(r[0].sa, r[1].sa);
    k->sb = pair_si(r[0].sb, r[1].sb);
    k->extra = pair_si(r[0].extra, r[1].extra);
    for (int i = 0; i < 2; i++) {
        k->d[i] = r[i].d;
        k->dmin[i] = r[i].dmin;
    }
}

/* meet_k for a pair. */
AVX512 static inline __attribute__((always_inline)) __m512
meet_k_pair(const int qtype, const KDec2 *k, const XKBlock *x, __m512i sums, __m512 acc) {
    __m512i dot;
    if (qtype == Q6_K) {
        dot = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_madd_epi16(k->extra, sums), 5));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i p = _mm512_maddubs_epi16(k->u[j], _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->q + 32 * j))));
            __m512i pick = q6k_pick(j & 3);
            dot = _mm512_add_epi32(dot, _mm512_madd_epi16(p, _mm512_shuffle_epi8(j < 4 ? k->sa : k->sb, pick)));
        }
        return _mm512_fmadd_ps(pair_ps(k->d[0] * x->d, k->d[1] * x->d), _mm512_cvtepi32_ps(dot), acc);
    }
    dot = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m512i p = _mm512_maddubs_epi16(k->u[j], _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->q + 32 * j))));
        dot = _mm512_add_epi32(dot, _mm512_madd_epi16(p, SPREAD16_512(k->sa, j)));
    }
    acc = _mm512_fmadd_ps(pair_ps(k->d[0] * x->d, k->d[1] * x->d), _mm512_cvtepi32_ps(dot), acc);
    return _mm512_fmadd_ps(pair_ps(-(k->dmin[0] * x->d), -(k->dmin[1] * x->d)),
                           _mm512_cvtepi32_ps(_mm512_madd_epi16(k->extra, sums)), acc);
}

AVX512 static inline __attribute__((always_inline)) void
strip_meet_k_512(const int qtype, const KDec2 *dec, const XKBlock *xk, int64_t m, int64_t nsb, float *y, int64_t n,
                 int accumulate) {
    const float off[STRIP] = {0};
    for (int64_t r = 0; r < m; r++) {
        const XKBlock *xr = xk + r * nsb;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t sb = 0; sb < nsb; sb++) {
            __m512i sums = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xr[sb].sums));
            for (int p = 0; p < 2; p++) acc[p] = meet_k_pair(qtype, dec + sb * 2 + p, xr + sb, sums, acc[p]);
        }
        finish_pairs(acc, off, 2, y + r * n, accumulate);
    }
}

#define K_512(QT)                                                                                           \
    do {                                                                                                    \
        if (strips) {                                                                                       \
            for (int p = 0; p < 2; p++)                                                                     \
                for (int64_t sb = 0; sb < nsb; sb++) {                                                      \
                    const uint8_t *b0 = w + (c0 + 2 * p) * row_bytes + sb * block_bytes(QT);                \
                    decode_k_pair(QT, b0, b0 + row_bytes, dec + sb * 2 + p);                                \
                }                                                                                           \
            strip_meet_k_512(QT, dec, xk, m, nsb, y + c0, n, accumulate);                                  \
        } else {                                                                                            \
            for (int64_t r = 0; r < m; r++)                                                                 \
                strip_k_512(QT, w, row_bytes, c0, n1, xk + r * nsb, nsb, y + r * n + c0, accumulate);       \
        }                                                                                                   \
    } while (0)

/* K types: whole strips in pairs (each x row alone below K_STRIPS_FROM rows, else decoded once and met
 * by every x row), a last strip short of STRIP on AVX2. */
AVX512 static void rows_avx512_k(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                 const XKBlock *xk, int64_t m, int64_t nsb, float *y, int accumulate) {
    int strips = m >= K_STRIPS_FROM;
    KDec2 *dec = strips ? aligned_alloc(64, (size_t)2 * nsb * sizeof(KDec2)) : NULL;
    int64_t whole = n0 + (n1 - n0) / STRIP * STRIP;
    if (strips && !dec) whole = n0;
    for (int64_t c0 = n0; c0 < whole; c0 += STRIP) {
        if (strips) prefetch_strip(w, row_bytes, c0 + STRIP, n1);
        if (qtype == Q4_K) K_512(Q4_K);
        else if (qtype == Q5_K) K_512(Q5_K);
        else K_512(Q6_K);
    }
    free(dec);
    if (whole < n1) {
        if (strips) rows_avx2_k_strips(qtype, w, row_bytes, whole, n1, n, xk, m, nsb, y, accumulate);
        else rows_avx2_k(qtype, w, row_bytes, whole, n1, n, xk, m, nsb, y, accumulate);
    }
}

static void rows_avx512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                        const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    if (m < STRIP) rows_avx512_direct(qtype, w, row_bytes, n0, n1, n, xq, m, nb, y, accumulate);
    else rows_avx512_strips(qtype, w, row_bytes, n0, n1, n, xq, m, nb, y, accumulate);
}

static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
}
