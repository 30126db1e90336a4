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
 *   threads, the instruction set or the weight's layout (rows or tiles). 32-wide types (recipe v4):
 *   per output, each block in K order gives one exact integer t (the dot product of its codes and
 *   x's, the code offset of Q4_0 and Q5_0, 8 or 16 times x's sum of q, taken off in integers), and
 *   acc = fmaf(a * xd, (float)t, acc); Q4_1's and Q5_1's own offsets m go apart, off = fmaf(m, xs,
 *   off), in K order; the output is acc + off. K types: eight float lanes accumulate the super-blocks
 *   in K order (see "K types" in _blocks_portable.c), then one fixed horizontal sum. The AVX-512
 *   path (_blocks_avx512.c), the AVX2 path and the portable path compute the same bits (tested), so
 *   peers on different CPUs agree and a batch equals its rows alone. Integers are exact in any order,
 *   so each path sums a block's products as its instructions like (int16 pairs, VNNI, horizontal
 *   adds across rows); only the float steps above have an order.
 * - Activations: per row and block of 32 (K types: of 256), d = max|x| / 127, q = nearbyint(x * (1 / d))
 *   in [-127, 127], sum(q), and s = d * sum(q) (for the weight's own per-block offset; K types: the
 *   sums of q per 16). Part of the recipe: it changes the numbers.
 * - Threads split the output features: a job's parts (a share per thread) are claimed by whichever
 *   thread is free, the caller too; a pool of workers spins briefly between calls, then sleeps.
 * - The rest of a Llama layer lives here too, per row and in fixed orders (RMSNorm, RoPE into the
 *   bfloat16 KV cache, causal attention, silu(gate) * up), so a row's bits never depend on how many
 *   rows or positions share its call: a many-position pass equals its one-position steps.
 *
 * Parts, compiled as this one unit (so each path inlines the helpers it shares with another):
 * _blocks.h (block types, halves, scales), _blocks_portable.c (activations, plain C),
 * _blocks_avx2.c (with _blocks_avx512.c, which it includes), _blocks_tiles.c (Q4_0, Q4_1 and Q8_0
 * weights repacked eight rows a tile, every path), _blocks_pool.c (dispatch by CPU, the
 * thread pool), _blocks_layer.c (norms, attention, RoPE, SiLU); this file: the calls Python makes.
 */
#include "_blocks.h"
#include "_blocks_portable.c"
#include "_blocks_avx2.c"
#include "_blocks_tiles.c"
#include "_blocks_pool.c"
#include "_blocks_layer.c"

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
    int qtype, tiled;
    const uint8_t *w;
    int64_t row_bytes, n, k;
} WRef;

/* A weight's qtype as Python passes it (TILED or-ed in where the weight is in tiles) into w; 0 when
 * the sizes fit, else -1 with the error set. */
static int set_wref(WRef *w, long long qtype, const uint8_t *data, int64_t row_bytes, int64_t n, int64_t k,
                    const char *name) {
    *w = (WRef){(int)(qtype & ~TILED), (qtype & TILED) != 0, data, row_bytes, n, k};
    if (row_bytes_of(w->qtype, k) == 0 || row_bytes != row_bytes_of(w->qtype, k) || n < 0 ||
        (w->tiled && (!tiles_type(w->qtype) || n % TILE))) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported block type or inconsistent sizes", name);
        return -1;
    }
    return 0;
}

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
    MatJob mj = {wr->qtype, isa, accumulate, wr->tiled, wr->w, wr->row_bytes, wr->n, m, nb, xq, y};
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
    int threads = (int)v[8], portable = (int)v[9];
    int64_t m = v[6];
    WRef wr;
    if (set_wref(&wr, v[0], (const uint8_t *)(intptr_t)v[1], v[2], v[3], v[4], "matmul") < 0) return NULL;
    if (m < 0) {
        PyErr_SetString(PyExc_ValueError, "matmul: a negative row count");
        return NULL;
    }
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
    return set_wref(w, v[0], (const uint8_t *)(intptr_t)v[1], v[2], v[3], k, "layer");
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

/* layers(y, R, H, eps, L, weights, cos, ssin, nh, nkv, hd, segments, S, threads, portable): L Llama
 * layers in turn, in place on y, each exactly as `layer` runs it (one call instead of L: a decode
 * step of a small model spent a fifth of its time in Python between the layers). weights: int64
 * [L, 18] = (attn_norm, ffn_norm, then qkv, o, gate+up, down as (qtype, data, row bytes, out
 * features)); segments: int64 [L, S, 7], layer by layer. */
static PyObject *py_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "layers takes 15 arguments");
        return NULL;
    }
    long long a[3], b[11];
    double eps = PyFloat_AsDouble(args[3]);
    if ((eps == -1.0 && PyErr_Occurred()) || read_longs(args, 3, 3, a, "layers") < 0 ||
        read_longs(args + 4, 11, 11, b, "layers") < 0)
        return NULL;
    int64_t R = a[1], H = a[2], L = b[0], S = b[8];
    const int64_t *wt = (const int64_t *)(intptr_t)b[1], *seg = (const int64_t *)(intptr_t)b[7];
    int nh = (int)b[4], nkv = (int)b[5], hd = (int)b[6];
    if (L < 0 || S < 0 || R < 0 || nh <= 0 || nkv <= 0 || nh % nkv || hd % 8 || hd > 512) {
        PyErr_SetString(PyExc_ValueError, "layers: bad counts or head shapes");
        return NULL;
    }
    /* every layer's weights checked before any runs, as `layer` checks its own */
    WRef *refs = malloc(sizeof(WRef) * 4 * (L ? L : 1));
    if (!refs) return PyErr_NoMemory();
    for (int64_t l = 0; l < L; l++) {
        const int64_t *w = wt + 18 * l;
        WRef *r = refs + 4 * l;
        int64_t ks[4] = {H, (int64_t)nh * hd, H, 0};
        for (int i = 0; i < 3; i++)
            if (set_wref(r + i, w[2 + 4 * i], (const uint8_t *)(intptr_t)w[3 + 4 * i], w[4 + 4 * i], w[5 + 4 * i], ks[i],
                         "layers") < 0)
                goto bad;
        if (r[2].n % 2 || set_wref(r + 3, w[14], (const uint8_t *)(intptr_t)w[15], w[16], w[17], r[2].n / 2, "layers") < 0)
            goto bad;
        if (r[0].n != (int64_t)(nh + 2 * nkv) * hd || r[1].n != H || r[3].n != H) {
            PyErr_SetString(PyExc_ValueError, "layers: the weights' shapes do not make a Llama layer");
            goto bad;
        }
    }
    int rc = 0, threads = b[9] < 1 ? 1 : (int)b[9], isa = isa_for(b[10]);
    float *y = (float *)(intptr_t)a[0];
    Py_BEGIN_ALLOW_THREADS
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const int64_t *w = wt + 18 * l;
        WRef *r = refs + 4 * l;
        rc = layer_c(y, R, H, (float)eps, (const float *)(intptr_t)w[0], (const float *)(intptr_t)w[1], r, r + 1, r + 2,
                     r + 3, (const float *)(intptr_t)b[2], (const float *)(intptr_t)b[3], nh, nkv, hd, seg + 7 * S * l, S,
                     threads, isa);
    }
    Py_END_ALLOW_THREADS
    free(refs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
bad:
    free(refs);
    return NULL;
}

/* tile(qtype, src_ptr, dst_ptr, n, row_bytes): rows of GGUF blocks into tiles (_blocks_tiles.c) */
static PyObject *py_tile(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (read_longs(args, nargs, 5, v, "tile") < 0) return NULL;
    int qtype = (int)v[0];
    int64_t n = v[3], row_bytes = v[4];
    if (!tiles_type(qtype) || n < 0 || n % TILE || row_bytes <= 0 || row_bytes % block_bytes(qtype)) {
        PyErr_SetString(PyExc_ValueError, "tile: not a type tiles hold, or not whole tiles of whole blocks");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    tile_rows(qtype, (const uint8_t *)(intptr_t)v[1], (uint8_t *)(intptr_t)v[2], n, row_bytes);
    Py_END_ALLOW_THREADS
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
    {"tile", (PyCFunction)(void (*)(void))py_tile, METH_FASTCALL, "rows of GGUF blocks into tiles of eight rows"},
    {"isa", py_isa, METH_NOARGS, "the instruction set the kernels run on"},
    {"limit_isa", py_limit_isa, METH_O, "run on at most this instruction set from now on"},
    {"layer", (PyCFunction)(void (*)(void))py_layer, METH_FASTCALL, "a whole Llama decoder layer, in place"},
    {"layers", (PyCFunction)(void (*)(void))py_layers, METH_FASTCALL, "Llama decoder layers one after another, in place"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "RMSNorm of float32 rows"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL, "causal attention over bfloat16 KV"},
    {"rope_kv", (PyCFunction)(void (*)(void))py_rope_kv, METH_FASTCALL, "RoPE of q and k, k and v into the KV cache"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, "silu(gate) * up"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", "GGUF block matmuls", -1, methods};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
