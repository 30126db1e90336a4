/* The portable path: activations quantized per block (the numbers every path reproduces) and the
 * block matmuls in plain C, 32-wide types and K types. Part of _blocks.c (see the rules there). */
#include "_blocks.h"

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
            o->sum = sum;
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

/* Block b of a row met by x's block: its exact integer sum (the codes' offset taken off in integers),
 * into the output's accumulator with one fused multiply-add by a * xd, and a weight's own offset into
 * the offset term. */
static inline void block_step_portable(int qtype, const uint8_t *row, int64_t b, const XBlock *x, float *acc,
                                       float *off) {
    int8_t u[QK];
    float a, c;
    block_scales(qtype, row, b, &a, &c);
    unpack_codes(qtype, row, b, u);
    int32_t t = 0;
    for (int i = 0; i < QK; i++) t += (int32_t)u[i] * (int32_t)x->q[i];
    t -= code_bias(qtype) * x->sum;
    *acc = fmaf(a * x->d, (float)t, *acc);
    if (own_offset(qtype)) *off = fmaf(c, x->s, *off);
}

static void rows_portable(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n,
                          const XBlock *xq, int64_t m, int64_t nb, float *y, int accumulate) {
    for (int64_t col = n0; col < n1; col++) {
        const uint8_t *wr = w + col * row_bytes;
        for (int64_t r = 0; r < m; r++) {
            const XBlock *xr = xq + r * nb;
            float acc = 0.0f, off = 0.0f;
            for (int64_t b = 0; b < nb; b++) block_step_portable(qtype, wr, b, xr + b, &acc, &off);
            float sum = acc + off;
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
