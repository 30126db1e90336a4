/* The rest of a Llama layer, per row and in fixed orders on every path: RMSNorm, causal attention,
 * RoPE into the bfloat16 KV cache, silu(gate) * up. Part of _blocks.c (see the rules there). */
#include "_blocks.h"

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

/* lanes_sum of eight accumulators at once: out[u] = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) of acc[u],
 * the same additions in the same order (halves folded, then (b0+b2)+(b1+b3) by two hadd rounds). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 lanes_sum8_avx2(const __m256 *acc) {
    __m256 z[4];
    for (int i = 0; i < 4; i++) {
        __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x31));
        z[i] = _mm256_permute_ps(b, _MM_SHUFFLE(3, 1, 2, 0));  /* (b0, b2, b1, b3) per accumulator */
    }
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(z[0], z[1]), _mm256_hadd_ps(z[2], z[3]));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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
        /* eight keys at a time: independent sums, each in its own d order, reduced together (a scalar
         * lanes_sum a key took as long as its dot product) */
        int64_t t = 0;
        __m256 vtop8 = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= total; t += 8) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) {
                __m256 qd = _mm256_loadu_ps(q + d);
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(qd, bf16x8_avx2(k + (t + u) * a->kv_pos + d), acc[u]);
            }
            __m256 s = _mm256_mul_ps(lanes_sum8_avx2(acc), _mm256_set1_ps(a->scale));
            _mm256_storeu_ps(scores + t, s);
            vtop8 = _mm256_max_ps(vtop8, s);
        }
        float tops[8];
        _mm256_storeu_ps(tops, vtop8);
        for (int u = 0; u < 8; u++) top = fmaxf(top, tops[u]);
        for (; t < total; t++) {  /* the last few keys one at a time */
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
