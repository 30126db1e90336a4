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
 * Why: in the row layout each row's block is summed on its own, its scale converted and broadcast
 * as a scalar, then reduced across lanes; here lane r of "group register" g is row r's exact integer
 * sum over elements 4g..4g+3 (one maddubs + madd against x's four bytes broadcast), and the scales of
 * eight rows are one F16C conversion. The float steps are the row layout's exactly: per row, lane g
 * accumulates fmaf(a * xd, sum_g) in K order, the offsets fmaf(c, xs) in K order, then the same fixed
 * horizontal sum (lanes_sum, here eight adds across registers) and the offset. So a tiled tensor
 * gives the row layout's bits on every path (tested), and the tensor streams from memory as one run
 * of bytes per thread.
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
            float lane[8] = {0}, off = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                untile_block(qtype, tile + b * bb8, (int)(col % TILE), blk);
                block_step_portable(qtype, blk, 0, xr + b, lane, &off);
            }
            float sum = lanes_sum(lane) + off;
            y[r * n + col] = accumulate ? y[r * n + col] + sum : sum;
        }
    }
}

#if HAVE_X86

/* Eight rows' sums from the eight group registers: lanes_sum's order, lane by lane, plus the offsets. */
AVX2 static inline void tile_finish(const __m256 *acc, __m256 off, float *out, int accumulate) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                             _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
    s = _mm256_add_ps(s, off);
    _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), s) : s);
}

/* Lane r: row r's exact integer sum of its four codes in u against x's four bytes q4 (broadcast). */
AVX2 static inline __m256i tile_dot_avx2(const int sgn, __m256i u, __m256i q4) {
    __m256i p = sgn ? _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q4, u)) : _mm256_maddubs_epi16(u, q4);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

#define VNNI __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The same integers with VNNI's vpdpbusd (no int16 step: |u| <= 128 and |q| <= 127 never saturate
 * maddubs either, so both give the exact sum). */
VNNI static inline __m256i tile_dot_vnni(const int sgn, __m256i u, __m256i q4) {
    if (sgn) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(u, u), _mm256_sign_epi8(q4, u));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q4);
}

/* One x row against one tile: every block once, the eight rows in the lanes. Inlined with constant
 * qtype and dot, so the branches fold away and the accumulators stay in registers. */
#define TILE_BODY(DOT)                                                                                      \
    {                                                                                                       \
        const int sgn = signed_codes(qtype), bb8 = TILE * block_bytes(qtype), head = tile_head(qtype);     \
        __m256 acc[8], off = _mm256_setzero_ps();                                                           \
        for (int g = 0; g < 8; g++) acc[g] = _mm256_setzero_ps();                                           \
        const __m256i m4 = _mm256_set1_epi8(0x0f);                                                          \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            const uint8_t *tb = tile + b * bb8;                                                             \
            for (int p = 0; p < bb8; p += 64) _mm_prefetch((const char *)tb + TILE_AHEAD + p, _MM_HINT_T0); \
            int32_t x4[8];                                                                                  \
            memcpy(x4, xr[b].q, sizeof x4);                                                                 \
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tb));                               \
            __m256 scale = _mm256_mul_ps(a, _mm256_set1_ps(xr[b].d));                                       \
            if (qtype == Q4_0)                                                                              \
                off = _mm256_fmadd_ps(_mm256_mul_ps(a, _mm256_set1_ps(-8.0f)), _mm256_set1_ps(xr[b].s), off); \
            else if (qtype == Q4_1)                                                                         \
                off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 16))),          \
                                      _mm256_set1_ps(xr[b].s), off);                                        \
            const uint8_t *codes = tb + head;                                                               \
            if (sgn) {                                                                                      \
                for (int g = 0; g < 8; g++) {                                                               \
                    __m256i u = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));                      \
                    __m256 s = _mm256_cvtepi32_ps(DOT(1, u, _mm256_set1_epi32(x4[g])));                     \
                    acc[g] = _mm256_fmadd_ps(scale, s, acc[g]);                                             \
                }                                                                                           \
            } else {                                                                                        \
                for (int g = 0; g < 4; g++) {                                                               \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));                      \
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4); \
                    __m256 sl = _mm256_cvtepi32_ps(DOT(0, lo, _mm256_set1_epi32(x4[g])));                   \
                    __m256 sh = _mm256_cvtepi32_ps(DOT(0, hi, _mm256_set1_epi32(x4[g + 4])));               \
                    acc[g] = _mm256_fmadd_ps(scale, sl, acc[g]);                                            \
                    acc[g + 4] = _mm256_fmadd_ps(scale, sh, acc[g + 4]);                                    \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        tile_finish(acc, off, out, accumulate);                                                             \
    }

AVX2 static inline __attribute__((always_inline)) void
tile_avx2(const int qtype, const uint8_t *tile, const XBlock *xr, int64_t nb, float *out, int accumulate)
TILE_BODY(tile_dot_avx2)

VNNI static inline __attribute__((always_inline)) void
tile_vnni(const int qtype, const uint8_t *tile, const XBlock *xr, int64_t nb, float *out, int accumulate)
TILE_BODY(tile_dot_vnni)

/* AVX-512: two tiles side by side in a 512-bit register (sixteen rows), VNNI's integer sums; each
 * lane takes the steps of one row as above. Q8_0's signed codes go as u ^ 0x80 (unsigned) with the
 * sum starting at -128 times x's four bytes: the same integer. */
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
tiles2_512(const int qtype, const uint8_t *t0, const uint8_t *t1, const XBlock *xr, int64_t nb, float *out,
           int accumulate) {
    const int sgn = signed_codes(qtype), bb8 = TILE * block_bytes(qtype), head = tile_head(qtype);
    __m512 acc[8], off = _mm512_setzero_ps();
    for (int g = 0; g < 8; g++) acc[g] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tb0 = t0 + b * bb8, *tb1 = t1 + b * bb8;
        for (int p = 0; p < bb8; p += 64) {
            _mm_prefetch((const char *)tb0 + TILE_AHEAD + p, _MM_HINT_T0);
            _mm_prefetch((const char *)tb1 + TILE_AHEAD + p, _MM_HINT_T0);
        }
        int32_t x4[8];
        memcpy(x4, xr[b].q, sizeof x4);
        __m512 a = pair_halves(tb0, tb1), scale = _mm512_mul_ps(a, _mm512_set1_ps(xr[b].d));
        if (qtype == Q4_0) off = _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(-8.0f)), _mm512_set1_ps(xr[b].s), off);
        else if (qtype == Q4_1) off = _mm512_fmadd_ps(pair_halves(tb0 + 16, tb1 + 16), _mm512_set1_ps(xr[b].s), off);
        if (sgn) {
            for (int g = 0; g < 8; g++) {
                const int8_t *q = xr[b].q + 4 * g;
                __m512i bias = _mm512_set1_epi32(-128 * (q[0] + q[1] + q[2] + q[3]));
                __m512i u = _mm512_xor_si512(pair_tiles(tb0 + head + 32 * g, tb1 + head + 32 * g), flip);
                __m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, u, _mm512_set1_epi32(x4[g])));
                acc[g] = _mm512_fmadd_ps(scale, s, acc[g]);
            }
        } else {
            for (int g = 0; g < 4; g++) {
                __m512i v = pair_tiles(tb0 + head + 32 * g, tb1 + head + 32 * g);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                __m512 sl = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi32(x4[g])));
                __m512 sh = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_set1_epi32(x4[g + 4])));
                acc[g] = _mm512_fmadd_ps(scale, sl, acc[g]);
                acc[g + 4] = _mm512_fmadd_ps(scale, sh, acc[g + 4]);
            }
        }
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
                             _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])));
    s = _mm512_add_ps(s, off);
    _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), s) : s);
}

/* Every x row against each pair of tiles in turn; a part's odd last tile on its own (the same bits). */
VNNI512 static void rows_tiled_512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                   const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t c0 = n0; c0 < n1; c0 += 2 * TILE) {
        const uint8_t *tile = w + c0 * row_bytes;
        int pair = c0 + 2 * TILE <= n1;
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float *out = y + r * n + c0;
            if (pair) {
                const uint8_t *next = tile + TILE * row_bytes;
                switch (qtype) {
                case Q4_0: tiles2_512(Q4_0, tile, next, xr, nb, out, accumulate); break;
                case Q4_1: tiles2_512(Q4_1, tile, next, xr, nb, out, accumulate); break;
                default: tiles2_512(Q8_0, tile, next, xr, nb, out, accumulate); break;
                }
            } else {
                switch (qtype) {
                case Q4_0: tile_vnni(Q4_0, tile, xr, nb, out, accumulate); break;
                case Q4_1: tile_vnni(Q4_1, tile, xr, nb, out, accumulate); break;
                default: tile_vnni(Q8_0, tile, xr, nb, out, accumulate); break;
                }
            }
        }
    }
}

/* Every x row against each tile in turn (a tile is 8 row_bytes: it stays in cache while the x rows
 * meet it). */
#define ROWS_TILED(KERNEL_FN)                                                                               \
    {                                                                                                       \
        for (int64_t c0 = n0; c0 < n1; c0 += TILE) {                                                        \
            const uint8_t *tile = w + c0 * row_bytes;                                                       \
            for (int64_t r = 0; r < m; r++) {                                                               \
                const XBlock *xr = xq + r * nb;                                                             \
                float *out = y + r * n + c0;                                                                \
                switch (qtype) {                                                                            \
                case Q4_0: KERNEL_FN(Q4_0, tile, xr, nb, out, accumulate); break;                           \
                case Q4_1: KERNEL_FN(Q4_1, tile, xr, nb, out, accumulate); break;                           \
                default: KERNEL_FN(Q8_0, tile, xr, nb, out, accumulate); break;                             \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

AVX2 static void rows_tiled_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                 const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate)
ROWS_TILED(tile_avx2)

VNNI static void rows_tiled_vnni(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                                 const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate)
ROWS_TILED(tile_vnni)

#endif
