/* What every part of the block kernel shares: the GGUF block types and their sizes, the activation
 * blocks, halves converted exactly, a block's float scales and the lanes' fixed sum. Included by
 * each part; the parts compile as one unit through _blocks.c (see the rules there). */
#ifndef MESHD_BLOCKS_H
#define MESHD_BLOCKS_H

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
    float s;     /* d * sum(q): the term of a weight block's own offset (Q4_1, Q5_1) */
    int32_t sum; /* sum(q): Q4_0's and Q5_0's code offset, folded into the block's integer sum */
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

/* 32-wide block b of a row (not a K type: they go a super-block at a time) as w = a * (u - bias) + c:
 * Q4_0's and Q5_0's codes are offset by 8 and 16 (code_bias), taken off inside the block's integer sum;
 * Q4_1 and Q5_1 carry their own offset c (a half: own_offset), whose term goes apart; Q8_0's codes are
 * signed, with neither. */
static inline int code_bias(int qtype) { return qtype == Q4_0 ? 8 : (qtype == Q5_0 ? 16 : 0); }
static inline int own_offset(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }

#define BLOCK_SCALES_BODY(HALF) \
{ \
    const uint8_t *blk = row + b * block_bytes(qtype); \
    *a = HALF(blk); \
    *c = own_offset(qtype) ? HALF(blk + 2) : 0.0f; \
}

static inline void block_scales(int qtype, const uint8_t *row, int64_t b, float *a, float *c)
BLOCK_SCALES_BODY(half_at)

/* The fixed horizontal sum of eight lanes: the K types' outputs, and the norms' and attention's sums. */
static inline float lanes_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#endif
