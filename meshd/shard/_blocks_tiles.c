/* Tiles: Q4_0, Q4_1 and Q8_0 weights repacked eight rows at a time, so that a register's eight
 * lanes are eight rows and one pass over a block computes all of them. Part of _blocks.c (see the
 * rules there), after the AVX2 path.
 *
 * The layout. Tile t holds rows 8t..8t+7; it is nb tile-blocks in K order, each 8 * block_bytes
 * bytes (the rows' bytes, reordered: a tiled tensor is exactly as large as the file's):
 *   the eight rows' halves d (16 bytes), for Q4_1 then their halves m (16 bytes), then the codes:
 *   group g holds, row after row, the four bytes of that row's codes that meet x's elements
 *   4g..4g+3: Q8_0 eight groups (its codes are bytes), Q4_0 / Q4_1 four (bytes 4g..4g+3 hold
 *   elements 4g..4g+3 in their low nibbles and 16+4g.. in their high ones).
 *
 * Why: lane r of a register is row r, so one pass over a tile-block sums eight rows: their exact
 * integers (Q4: eight maddubs added as int16, whose sum cannot leave the int16 range, then one madd;
 * VNNI: vpdpbusd chains), the eight scales one F16C conversion, one fused multiply-add, where
 * the row layout reduces each row's eight partial sums across lanes. The float steps are the row
 * layout's (the rule in _blocks.c), so a tiled tensor gives the row layout's bits on every path
 * (tested), and the tensor streams from memory as one run of bytes per thread. Several x rows meet
 * a tile-block's codes once they are decoded (TILE_X at a time): prefill decodes each block once per
 * TILE_X rows, not once a row.
 */
#include "_blocks.h"

enum { TILE = 8, TILED = 0x100 }; /* TILED: or-ed into a call's qtype where its weight is tiled */
/* How far ahead of the block being summed its thread asks for its run of tiles: none left a one-row
 * call waiting on memory (1.7x the time of the row layout's, whose strips fetch eight ahead); 8 and 16
 * KB were best, 1 KB little better than none (Q4_0 and Q8_0, 2048- and 8192-wide, one thread,
 * thread CPU time, CPU avx2 avx512f held to AVX2). */
static const int TILE_AHEAD = 8192;

static inline int tiles_type(int qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

/* Bytes before a tile-block's codes: the eight d halves, and Q4_1's eight m halves. */
static inline int tile_head(int qtype) { return qtype == Q4_1 ? 32 : 16; }

/* Row r (0..7) of tile-block `tb` back in the file's block layout, into `out` (block_bytes). */
static void untile_block(int qtype, const uint8_t *tb, int r, uint8_t *out) {
    int head = tile_head(qtype), groups = qtype == Q8_0 ? 8 : 4;
    memcpy(out, tb + 2 * r, 2);
    if (qtype == Q4_1) memcpy(out + 2, tb + 16 + 2 * r, 2);
    uint8_t *codes = out + (qtype == Q4_1 ? 4 : 2);
    for (int g = 0; g < groups; g++) memcpy(codes + 4 * g, tb + head + 32 * g + 4 * r, 4);
}

/* Rows [n, row_bytes] of GGUF blocks into tiles (the layout above; n a multiple of TILE): each tile's
 * blocks in K order, each block's halves, then its code groups, row after row. */
static void tile_rows(int qtype, const uint8_t *src, uint8_t *dst, int64_t n, int64_t row_bytes) {
    int bb = block_bytes(qtype), head = tile_head(qtype), groups = qtype == Q8_0 ? 8 : 4, halves = head / 16;
    int skip = 2 * halves; /* a block's bytes before its codes */
    int64_t nb = row_bytes / bb;
    for (int64_t t = 0; t < n / TILE; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tb = dst + t * TILE * row_bytes + b * TILE * bb;
            for (int r = 0; r < TILE; r++) {
                const uint8_t *blk = src + (t * TILE + r) * row_bytes + b * bb;
                for (int h = 0; h < halves; h++) memcpy(tb + 16 * h + 2 * r, blk + 2 * h, 2);
                for (int g = 0; g < groups; g++) memcpy(tb + head + 32 * g + 4 * r, blk + skip + 4 * g, 4);
            }
        }
}

/* The portable path over tiles: rows_portable's sums, each block put back in the file's layout as
 * it is met (a block's bytes on the stack). */
static void rows_tiled_portable(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    int bb8 = TILE * block_bytes(qtype);
    uint8_t blk[64];
    for (int64_t col = n0; col < n1; col++) {
        const uint8_t *tile = w + (col - col % TILE) * row_bytes;
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float acc = 0.0f, off = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                untile_block(qtype, tile + b * bb8, (int)(col % TILE), blk);
                block_step_portable(qtype, blk, 0, xr + b, &acc, &off);
            }
            float sum = acc + off;
            y[r * n + col] = accumulate ? y[r * n + col] + sum : sum;
        }
    }
}

#if HAVE_X86

enum { TILE_X = 4 }; /* x rows that meet a tile-block's decoded codes together */

/* Lane r: row r's exact integer for this block against x's (the code offset taken off). Code u[j]
 * meets x's four bytes 4j..4j+3 (Q4: 16 + 4(j - 4).. for the high nibbles). */
AVX2 static inline __attribute__((always_inline)) __m256i tile_sum_avx2(const int qtype, const __m256i *u, const XBlock *x) {
    int32_t x4[8];
    memcpy(x4, x->q, sizeof x4);
    if (qtype == Q8_0) { /* |u| against q with u's sign: pairs of products fit an int16, eight int16 do not */
        __m256i t = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(u[g], u[g]), _mm256_sign_epi8(_mm256_set1_epi32(x4[g]), u[g]));
            t = _mm256_add_epi32(t, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        }
        return t;
    }
    /* 4-bit codes: each int16 of a maddubs is at most 2 * 15 * 127, eight of them 30480 < 32768 */
    __m256i p0 = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(x4[0]));
    __m256i p1 = _mm256_maddubs_epi16(u[4], _mm256_set1_epi32(x4[4]));
    for (int g = 1; g < 4; g++) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(u[g], _mm256_set1_epi32(x4[g])));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(u[4 + g], _mm256_set1_epi32(x4[4 + g])));
    }
    __m256i t = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
    return code_bias(qtype) ? _mm256_sub_epi32(t, _mm256_set1_epi32(code_bias(qtype) * x->sum)) : t;
}

/* Where a VNNI sum of a block starts: minus its code offset (Q4_0's 8) times x's sum of q, or for
 * Q8_0, whose codes go in as u ^ 0x80 = u + 128, minus 128 times it. */
static inline int32_t vnni_start(int qtype, const XBlock *x) {
    return -(qtype == Q8_0 ? 128 : code_bias(qtype)) * x->sum;
}

#define VNNI __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The same integers with VNNI's vpdpbusd: two chains, each starting from the block's offset part. */
VNNI static inline __attribute__((always_inline)) __m256i tile_sum_vnni(const int qtype, const __m256i *u, const XBlock *x) {
    int32_t x4[8];
    memcpy(x4, x->q, sizeof x4);
    __m256i t0 = _mm256_set1_epi32(vnni_start(qtype, x));
    __m256i t1 = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        t0 = _mm256_dpbusd_epi32(t0, u[g], _mm256_set1_epi32(x4[g]));
        t1 = _mm256_dpbusd_epi32(t1, u[4 + g], _mm256_set1_epi32(x4[4 + g]));
    }
    return _mm256_add_epi32(t0, t1);
}

/* A tile-block's codes as the sums take them: Q4_0 / Q4_1 the low nibbles of groups 0-3 (elements
 * 4g..4g+3) then the high ones (16 + 4g..); Q8_0 its eight groups, for VNNI as u ^ 0x80 (unsigned,
 * the sum starting from -128 times x's). */
AVX2 static inline __m256i keep_codes(__m256i v) { return v; }
AVX2 static inline __m256i flip_codes(__m256i v) { return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); }

/* R x rows (x0, x0 + nb, ...) against one tile: every block once, decoded once for the R rows, the
 * eight weight rows in the lanes. Inlined with constant qtype, R and sums, so the branches fold
 * away and the accumulators stay in registers. */
#define TILE_BODY(SUM, FLIP)                                                                                \
    {                                                                                                       \
        const int bb8 = TILE * block_bytes(qtype), head = tile_head(qtype);                                 \
        __m256 acc[TILE_X], off[TILE_X];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            const uint8_t *tb = tile + b * bb8, *codes = tb + head;                                         \
            for (int p = 0; p < bb8; p += 64) _mm_prefetch((const char *)tb + TILE_AHEAD + p, _MM_HINT_T0); \
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tb));                               \
            __m256 c = qtype == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 16))) : a;    \
            __m256i u[8];                                                                                   \
            if (qtype == Q8_0) {                                                                            \
                for (int g = 0; g < 8; g++) u[g] = FLIP(_mm256_loadu_si256((const __m256i *)(codes + 32 * g))); \
            } else {                                                                                        \
                for (int g = 0; g < 4; g++) {                                                               \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));                      \
                    u[g] = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));                                     \
                    u[4 + g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));           \
                }                                                                                           \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                const XBlock *x = x0 + r * nb + b;                                                          \
                __m256i t = SUM(qtype, u, x);                                                               \
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(a, _mm256_set1_ps(x->d)), _mm256_cvtepi32_ps(t), acc[r]); \
                if (qtype == Q4_1) off[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(x->s), off[r]);               \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++) {                                                                       \
            float *o = out + r * n;                                                                         \
            __m256 s = _mm256_add_ps(acc[r], off[r]);                                                       \
            _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), s) : s); /* x + (W h) */     \
        }                                                                                                   \
    }

AVX2 static inline __attribute__((always_inline)) void
tile_avx2(const int qtype, const int R, const uint8_t *tile, const XBlock *x0, int64_t nb, float *out, int64_t n,
          int accumulate)
TILE_BODY(tile_sum_avx2, keep_codes)

VNNI static inline __attribute__((always_inline)) void
tile_vnni(const int qtype, const int R, const uint8_t *tile, const XBlock *x0, int64_t nb, float *out, int64_t n,
          int accumulate)
TILE_BODY(tile_sum_vnni, flip_codes)

/* AVX-512: two tiles side by side in a 512-bit register (sixteen rows), VNNI's integer sums; each
 * lane takes the steps of one row as above. */
#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

VNNI512 static inline __m512i pair_tiles(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

VNNI512 static inline __m512 pair_halves(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                                   _mm_loadu_si128((const __m128i *)p1), 1));
}

VNNI512 static inline __attribute__((always_inline)) void
tiles2_512(const int qtype, const int R, const uint8_t *t0, const uint8_t *t1, const XBlock *x0, int64_t nb,
           float *out, int64_t n, int accumulate) {
    const int bb8 = TILE * block_bytes(qtype), head = tile_head(qtype);
    __m512 acc[TILE_X], off[TILE_X];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb0 = t0 + b * bb8, *tb1 = t1 + b * bb8;
        for (int p = 0; p < bb8; p += 64) {
            _mm_prefetch((const char *)tb0 + TILE_AHEAD + p, _MM_HINT_T0);
            _mm_prefetch((const char *)tb1 + TILE_AHEAD + p, _MM_HINT_T0);
        }
        __m512 a = pair_halves(tb0, tb1), c = qtype == Q4_1 ? pair_halves(tb0 + 16, tb1 + 16) : a;
        __m512i u[8];
        if (qtype == Q8_0) {
            for (int g = 0; g < 8; g++)
                u[g] = _mm512_xor_si512(pair_tiles(tb0 + head + 32 * g, tb1 + head + 32 * g), _mm512_set1_epi8((char)0x80));
        } else {
            for (int g = 0; g < 4; g++) {
                __m512i v = pair_tiles(tb0 + head + 32 * g, tb1 + head + 32 * g);
                u[g] = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
                u[4 + g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
            }
        }
        for (int r = 0; r < R; r++) {
            const XBlock *x = x0 + r * nb + b;
            int32_t x4[8];
            memcpy(x4, x->q, sizeof x4);
            __m512i s0 = _mm512_set1_epi32(vnni_start(qtype, x));
            __m512i s1 = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                s0 = _mm512_dpbusd_epi32(s0, u[g], _mm512_set1_epi32(x4[g]));
                s1 = _mm512_dpbusd_epi32(s1, u[4 + g], _mm512_set1_epi32(x4[4 + g]));
            }
            __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(x->d)), t, acc[r]);
            if (qtype == Q4_1) off[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(x->s), off[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = out + r * n;
        __m512 s = _mm512_add_ps(acc[r], off[r]);
        _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), s) : s);
    }
}

/* Calls KERNEL(qtype, R, ...) for every TILE_X x rows, then for each one left, with constant
 * arguments so that each inlined copy folds its branches. */
#define EACH_X(KERNEL, ...)                                                                                 \
    do {                                                                                                    \
        int64_t r = 0;                                                                                      \
        for (; r + TILE_X <= m; r += TILE_X) {                                                              \
            const XBlock *x0 = xq + r * nb;                                                                 \
            float *out = y + r * n + c0;                                                                    \
            switch (qtype) {                                                                                \
            case Q4_0: KERNEL(Q4_0, TILE_X, __VA_ARGS__); break;                                            \
            case Q4_1: KERNEL(Q4_1, TILE_X, __VA_ARGS__); break;                                            \
            default: KERNEL(Q8_0, TILE_X, __VA_ARGS__); break;                                              \
            }                                                                                               \
        }                                                                                                   \
        for (; r < m; r++) {                                                                                \
            const XBlock *x0 = xq + r * nb;                                                                 \
            float *out = y + r * n + c0;                                                                    \
            switch (qtype) {                                                                                \
            case Q4_0: KERNEL(Q4_0, 1, __VA_ARGS__); break;                                                 \
            case Q4_1: KERNEL(Q4_1, 1, __VA_ARGS__); break;                                                 \
            default: KERNEL(Q8_0, 1, __VA_ARGS__); break;                                                   \
            }                                                                                               \
        }                                                                                                   \
    } while (0)

/* Every x row against each pair of tiles in turn; a part's odd last tile on its own (the same bits). */
VNNI512 static void rows_tiled_512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                   const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1; c0 += 2 * TILE) {
        const uint8_t *tile = w + c0 * row_bytes;
        if (c0 + 2 * TILE <= n1) EACH_X(tiles2_512, tile, tile + TILE * row_bytes, x0, nb, out, n, accumulate);
        else EACH_X(tile_vnni, tile, x0, nb, out, n, accumulate);
    }
}

/* Every x row against each tile in turn (a tile is 8 row_bytes: it stays in cache while the x rows
 * meet it). */
AVX2 static void rows_tiled_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                 const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1; c0 += TILE) EACH_X(tile_avx2, w + c0 * row_bytes, x0, nb, out, n, accumulate);
}

#endif
