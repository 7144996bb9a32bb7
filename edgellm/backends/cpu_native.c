/* edgellm's native CPU kernels: matrix products with few input rows (decode steps) read straight
 * from the file's quantized blocks of 32 weights:
 *   Q8_0: fp16 d, 32 int8 codes q (34 bytes)        w = d q
 *   Q4_0: fp16 d, 16 bytes of 4-bit codes (18 bytes)  w = d (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of codes (20 bytes) w = d q + m
 * (4-bit codes: byte j holds code j in its low nibble and code j + 16 in its high one.)
 *
 * y[t][r] = sum_b  d_w[r][b] * d_x[t][b] * sum_i q_w[r][b][i] * q_x[t][b][i]  (+ m[r][b] * sum_i x[t][b][i])
 *
 * The input rows are quantized once per call to int8 blocks of 32 with a float32 scale per block
 * (amax / 127, round to nearest), as llama.cpp's CPU path does, so each block's dot product is an
 * exact integer sum (AVX-512 VNNI / AVX-VNNI dpbusd, AVX2 maddubs, or plain C) scaled once.
 * Rows are split over OpenMP threads: the library is linked against the OpenMP runtime torch
 * itself loaded (edgellm/backends/cpu_native.py), so both share one pool of threads.
 *
 * Compiled at first use for the machine it runs on (-O3 -march=native); built without any of the
 * vector extensions below it is the plain C loop.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <sched.h>
#include <stdatomic.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define Q8_0_BYTES 34
#ifndef ROWS_PER_TASK
#define ROWS_PER_TASK 16
#endif
/* software prefetch of each row's bytes this far ahead (0: none; the hardware prefetchers stop at
 * 4 KiB page boundaries, which a memory-mapped file's rows cross every ~4 KiB) */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 0
#endif

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* x [m][k] float32 -> q [m][k] int8 and d [m][k/32] float32 (k a multiple of 32); with sums not
 * NULL also each block's sum [m][k/32] of its rounded values, d times the codes' sum (the 4-bit
 * formats' offset term). The rounded sum, not x's own: a product then takes the rounded x times the
 * whole weight w = d_w q + offset, whose values center near zero, where x's own sum would leave the
 * rounding errors on d_w q alone (codes 0..15, all of one sign): about twice the error, on the
 * default model's Q4_1 projections and in its logits (teacher-forced top-1 91% against 96%). */
void edgellm_quantize_q8(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *sums) {
    const int64_t nb = k / QK;
    for (int64_t t = 0; t < m; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xs = x + t * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                float a = fabsf(xs[i]);
                amax = a > amax ? a : amax;
            }
            const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[t * nb + b] = s;
            int8_t *qs = q + t * k + b * QK;
            int32_t codes = 0;
            for (int i = 0; i < QK; i++) {
                qs[i] = (int8_t)lrintf(xs[i] * inv);
                codes += qs[i];
            }
            if (sums)
                sums[t * nb + b] = s * (float)codes;
        }
    }
}

#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the 8 int32 partial sums of |qx| . (qw signed by qx) */
static inline __m256i dot32(__m256i ax, __m256i sw) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sw);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
}
#endif

/* rows [r0, r1) of one Q8_0 matrix times every input row (has_min and xs: the 4-bit formats') */
static void q8_0_rows(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                      const float *xd, const float *xs, int64_t m, float *y, int64_t ldy) {
    (void)has_min;
    (void)xs;
    for (int64_t t = 0; t < m; t++) {
        const int8_t *qx = xq + t * nb * QK;
        const float *dx = xd + t * nb;
        int64_t r = r0;
#if defined(__AVX2__)
        for (; r + 4 <= r1; r += 4) {  /* four rows share each block's x loads */
            const uint8_t *w0 = w + r * nb * Q8_0_BYTES, *w1 = w0 + nb * Q8_0_BYTES,
                          *w2 = w1 + nb * Q8_0_BYTES, *w3 = w2 + nb * Q8_0_BYTES;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + b * QK));
                const __m256i ax = _mm256_sign_epi8(vx, vx);
                const int64_t o = b * Q8_0_BYTES;
                const float s = dx[b];
#if PREFETCH_BYTES > 0
                if ((b & 1) == 0) {
                    _mm_prefetch((const char *)(w0 + o + PREFETCH_BYTES), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w1 + o + PREFETCH_BYTES), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w2 + o + PREFETCH_BYTES), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w3 + o + PREFETCH_BYTES), _MM_HINT_T0);
                }
#endif
#define EDGELLM_ROW(acc, wr)                                                                     \
    {                                                                                            \
        const __m256i q = _mm256_loadu_si256((const __m256i *)(wr + o + 2));                      \
        const __m256 p = _mm256_cvtepi32_ps(dot32(ax, _mm256_sign_epi8(q, vx)));                 \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(*(const uint16_t *)(wr + o)) * s), p, acc); \
    }
                EDGELLM_ROW(a0, w0) EDGELLM_ROW(a1, w1) EDGELLM_ROW(a2, w2) EDGELLM_ROW(a3, w3)
            }
            y[t * ldy + r] = hsum8(a0);
            y[t * ldy + r + 1] = hsum8(a1);
            y[t * ldy + r + 2] = hsum8(a2);
            y[t * ldy + r + 3] = hsum8(a3);
        }
        /* the last rows one at a time, with the same arithmetic: a row's result does not depend on
         * which rows it was computed with (a matrix split by rows gives the whole one's values) */
        for (; r < r1; r++) {
            const uint8_t *w0 = w + r * nb * Q8_0_BYTES;
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + b * QK));
                const __m256i ax = _mm256_sign_epi8(vx, vx);
                const int64_t o = b * Q8_0_BYTES;
                const float s = dx[b];
                EDGELLM_ROW(a0, w0)
            }
            y[t * ldy + r] = hsum8(a0);
        }
#undef EDGELLM_ROW
#endif
        for (; r < r1; r++) {
            const uint8_t *wr = w + r * nb * Q8_0_BYTES;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *qw = (const int8_t *)(wr + b * Q8_0_BYTES + 2);
                int32_t sum = 0;
                for (int i = 0; i < QK; i++)
                    sum += (int32_t)qw[i] * (int32_t)qx[b * QK + i];
                acc += f16_to_f32(*(const uint16_t *)(wr + b * Q8_0_BYTES)) * dx[b] * (float)sum;
            }
            y[t * ldy + r] = acc;
        }
    }
}

typedef void (*rows_fn)(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                        const float *xd, const float *xs, int64_t m, float *y, int64_t ldy);

/* The rows of parts stacked by rows (a fused q|k|v or gate|up product, each part read where it
 * lies in the file; part p has rows[p] rows starting at w[p]) handed out to the threads of the
 * enclosing parallel region in tasks of ROWS_PER_TASK, each task's rows multiplied by `rows_of`
 * from its own part. An orphaned worksharing loop: called outside a parallel region it runs on
 * the calling thread alone; it ends with the loop's barrier. */
/* task number `task` of the rows of `parts` stacked parts (n rows in all; see tasks_body): its
 * rows may span two parts, each piece multiplied from its own part */
static inline void task_rows(rows_fn rows_of, const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t nb,
                             int has_min, const int8_t *xq, const float *xd, const float *xs, int64_t m, float *y,
                             int64_t n, int64_t task) {
    int64_t r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < n ? r0 + ROWS_PER_TASK : n;
    int64_t base = 0;
    for (int64_t p = 0; p < parts && r0 < r1; p++) {
        const int64_t end = base + rows[p];
        if (r0 < end) {
            const int64_t stop = r1 < end ? r1 : end;
            rows_of(w[p], nb, has_min, r0 - base, stop - base, xq, xd, xs, m, y + base, n);
            r0 = stop;
        }
        base = end;
    }
}

static inline int64_t total_rows(const int64_t *rows, int64_t parts) {
    int64_t n = 0;
    for (int64_t p = 0; p < parts; p++)
        n += rows[p];
    return n;
}

/* The rows of parts stacked by rows (a fused q|k|v or gate|up product, each part read where it
 * lies in the file; part p has rows[p] rows starting at w[p]) handed out to the threads of the
 * enclosing parallel region in tasks of ROWS_PER_TASK, each task's rows multiplied by `rows_of`
 * from its own part. An orphaned worksharing loop: called outside a parallel region it runs on
 * the calling thread alone; it ends with the loop's barrier. */
static void tasks_body(rows_fn rows_of, const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t nb,
                       int has_min, const int8_t *xq, const float *xd, const float *xs, int64_t m, float *y) {
    const int64_t n = total_rows(rows, parts), tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* dynamic: a thread that loses its core for a while (another process, the GPU runtime's
     * threads) takes fewer tasks instead of holding the whole product back */
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < tasks; task++)
        task_rows(rows_of, w, rows, parts, nb, has_min, xq, xd, xs, m, y, n, task);
}

static void run_tasks(rows_fn rows_of, const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t nb,
                      int has_min, const int8_t *xq, const float *xd, const float *xs, int64_t m, float *y,
                      int nthreads) {
#pragma omp parallel num_threads(nthreads)
    tasks_body(rows_of, w, rows, parts, nb, has_min, xq, xd, xs, m, y);
}

/* Several Q8_0 matrices stacked by rows (see run_tasks). x [m][k] float32 -> y [m][sum of rows]
 * float32. xq [m][k] and xd [m][k/32] are the caller's scratch. */
void edgellm_q8_0_matmul(const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t k,
                         const float *x, int64_t m, float *y, int8_t *xq, float *xd, int nthreads) {
    edgellm_quantize_q8(x, m, k, xq, xd, NULL);
    run_tasks(q8_0_rows, w, rows, parts, k / QK, 0, xq, xd, NULL, m, y, nthreads);
}

/* ---- 4-bit formats ------------------------------------------------------------------------- */
#define Q4_0_BYTES 18
#define Q4_1_BYTES 20

#if defined(__AVX2__)
/* a block's 32 codes (0..15) in weight order: the low nibbles, then the high ones */
static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

/* rows [r0, r1) of a Q4_0 (has_min 0) or Q4_1 (has_min 1) matrix times every input row (inlined
 * into one function per format, has_min a constant in each) */
static inline __attribute__((always_inline)) void q4_rows(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                    const float *xd, const float *xs, int64_t m, float *y, int64_t ldy) {
    const int64_t bb = has_min ? Q4_1_BYTES : Q4_0_BYTES, head = has_min ? 4 : 2;
    /* the offset sum: Q4_1's in lane 1 of the head products, Q4_0's in lane 0 of its own */
#define OFFSET(f) _mm_cvtss_f32(has_min ? _mm_shuffle_ps(f, f, 1) : f)
    for (int64_t t = 0; t < m; t++) {
        const int8_t *qx = xq + t * nb * QK;
        const float *dx = xd + t * nb, *sx = xs + t * nb;
        int64_t r = r0;
#if defined(__AVX2__)
        /* a block's contribution to one row: the integer sum of codes times x's int8 values
         * (maddubs: unsigned codes times signed x), scaled by d_w d_x, and the offset (m, or -8 d
         * for Q4_0) times x's block sum. The block's fp16 head (d, or d and m) is converted in one
         * instruction and multiplied by (d_x, x's sum): lane 0 is the scale, lane 1 accumulates
         * the offset term (Q4_1; Q4_0's -8 d sum_x goes into lane 0 of a second product). */
#define EDGELLM_Q4(acc, off, wr)                                                                   \
    {                                                                                              \
        const uint8_t *blk = wr + o;                                                               \
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(has_min ? *(const int32_t *)blk           \
                                                                 : *(const uint16_t *)blk));       \
        const __m128 f = _mm_mul_ps(dm, sv);                                                       \
        const __m256 p = _mm256_cvtepi32_ps(dot32(unpack_q4(blk + head), vx));                    \
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), p, acc);                                   \
        off = has_min ? _mm_add_ps(off, f) : _mm_fmadd_ps(dm, ov, off);                            \
    }
        /* four rows at a time share each block's x load; the last rows go one at a time through
         * the same arithmetic (a row's result does not depend on the rows computed with it) */
        for (; r + 4 <= r1; r += 4) {
            const uint8_t *w0 = w + r * nb * bb, *w1 = w0 + nb * bb, *w2 = w1 + nb * bb, *w3 = w2 + nb * bb;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            __m128 f0 = _mm_setzero_ps(), f1 = _mm_setzero_ps(), f2 = _mm_setzero_ps(), f3 = _mm_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + b * QK));
                const int64_t o = b * bb;
                const __m128 sv = _mm_set_ps(0.0f, 0.0f, sx[b], dx[b]), ov = _mm_set_ss(-8.0f * sx[b]);
                EDGELLM_Q4(a0, f0, w0) EDGELLM_Q4(a1, f1, w1) EDGELLM_Q4(a2, f2, w2) EDGELLM_Q4(a3, f3, w3)
            }
            y[t * ldy + r] = hsum8(a0) + OFFSET(f0);
            y[t * ldy + r + 1] = hsum8(a1) + OFFSET(f1);
            y[t * ldy + r + 2] = hsum8(a2) + OFFSET(f2);
            y[t * ldy + r + 3] = hsum8(a3) + OFFSET(f3);
        }
        for (; r < r1; r++) {
            const uint8_t *w0 = w + r * nb * bb;
            __m256 a0 = _mm256_setzero_ps();
            __m128 f0 = _mm_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + b * QK));
                const int64_t o = b * bb;
                const __m128 sv = _mm_set_ps(0.0f, 0.0f, sx[b], dx[b]), ov = _mm_set_ss(-8.0f * sx[b]);
                EDGELLM_Q4(a0, f0, w0)
            }
            y[t * ldy + r] = hsum8(a0) + OFFSET(f0);
        }
#undef EDGELLM_Q4
#undef OFFSET
#endif
        for (; r < r1; r++) {
            const uint8_t *wr = w + r * nb * bb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = wr + b * bb, *qs = blk + head;
                const float d = f16_to_f32(*(const uint16_t *)blk);
                int32_t sum = 0;
                for (int i = 0; i < 16; i++)
                    sum += (int32_t)(qs[i] & 0x0F) * qx[b * QK + i] + (int32_t)(qs[i] >> 4) * qx[b * QK + i + 16];
                acc += d * dx[b] * (float)sum + (has_min ? f16_to_f32(*(const uint16_t *)(blk + 2)) : -8.0f * d) * sx[b];
            }
            y[t * ldy + r] = acc;
        }
    }
}

static void q4_0_rows(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                      const float *xd, const float *xs, int64_t m, float *y, int64_t ldy) {
    (void)has_min;
    q4_rows(w, nb, 0, r0, r1, xq, xd, xs, m, y, ldy);
}

static void q4_1_rows(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                      const float *xd, const float *xs, int64_t m, float *y, int64_t ldy) {
    (void)has_min;
    q4_rows(w, nb, 1, r0, r1, xq, xd, xs, m, y, ldy);
}

/* As edgellm_q8_0_matmul for Q4_0 (has_min 0) or Q4_1 (has_min 1) parts; xs [m][k/32] is scratch
 * for the input's block sums. */
void edgellm_q4_matmul(const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t k, int has_min,
                       const float *x, int64_t m, float *y, int8_t *xq, float *xd, float *xs, int nthreads) {
    edgellm_quantize_q8(x, m, k, xq, xd, xs);
    run_tasks(has_min ? q4_1_rows : q4_0_rows, w, rows, parts, k / QK, has_min, xq, xd, xs, m, y, nthreads);
}

/* ---- a whole decode step ------------------------------------------------------------------- */
/* A decode step's graph (one token) lowered to a list of ops (edgellm/backends/cpu_step.py) and
 * run in one call: one parallel region for the whole step, the threads meeting at a barrier after
 * each op, instead of an interpreter calling a library per op. Products split their rows over
 * the threads (tasks_body); attention splits its heads; the small vector ops run on one thread.
 * Weights are read from the file's blocks as by the products above; activations are float32. */
enum { EOP_EMBED = 1, EOP_RMS = 2, EOP_ADD_RMS = 3, EOP_LINEAR = 4, EOP_SWIGLU = 5, EOP_ROPE_STORE = 6,
       EOP_ATTN = 7 };
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2 };

typedef struct {
    int32_t kind, fmt, act, style;         /* act: 0 SiLU, 1 GELU (tanh); style: 0 pairs (2i, 2i+1), 1 (i, i + r/2) */
    int32_t n_heads, n_kv, head_dim, rope_dim;
    int64_t n, k, parts;                   /* a product's rows, row length, stacked parts */
    const uint8_t *const *w;               /* the parts' blocks (an embedding: the table's) */
    const int64_t *rows;                   /* rows per part */
    const float *a, *b, *wv, *bias, *res;  /* inputs: activations, a norm's weight, a bias, a residual */
    float *y, *y2;                         /* outputs */
    const float *cos, *sin;                /* RoPE tables [positions][rope_dim / 2] */
    float *kc, *vc;                        /* KV caches [positions][n_kv * head_dim] */
    const float *qn, *kn;                  /* per-head q and k RMSNorm weights [head_dim] (or NULL) */
    float eps, scale;
} edgellm_op;

static const int64_t FMT_BYTES[3] = {Q8_0_BYTES, Q4_0_BYTES, Q4_1_BYTES};

static void dequant_row(const uint8_t *row, int fmt, int64_t k, float *y) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * FMT_BYTES[fmt];
        const float d = f16_to_f32(*(const uint16_t *)blk);
        float *yb = y + b * QK;
        if (fmt == FMT_Q8_0) {
            for (int i = 0; i < QK; i++)
                yb[i] = d * (float)((const int8_t *)(blk + 2))[i];
        } else {
            const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                const int lo = qs[i] & 0x0F, hi = qs[i] >> 4;
                if (fmt == FMT_Q4_1) {
                    const float m = f16_to_f32(*(const uint16_t *)(blk + 2));
                    yb[i] = d * (float)lo + m;
                    yb[i + 16] = d * (float)hi + m;
                } else {
                    yb[i] = d * (float)(lo - 8);
                    yb[i + 16] = d * (float)(hi - 8);
                }
            }
        }
    }
}

static void rms_norm(const float *x, const float *w, float *y, int64_t k, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < k; i++)
        ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)k + eps);
    for (int64_t i = 0; i < k; i++)
        y[i] = x[i] * inv * w[i];
}

/* The threads of a decode step meet at this barrier after each op, spinning: an op lasts from a
 * few to a few hundred microseconds, and the OpenMP runtime's own barriers may put a waiting
 * thread to sleep (how soon depends on OMP_WAIT_POLICY, GOMP_SPINCOUNT and how many threads the
 * process has made), after which waking it costs about as much as a small op. A thread that has
 * spun for a while yields its core once, in case more threads than cores were asked for. */
typedef struct {
    _Atomic int64_t arrived, generation;
} step_barrier;

#ifndef SPINS_BEFORE_YIELD
#define SPINS_BEFORE_YIELD 4096
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void step_barrier_wait(step_barrier *b, int nthreads) {
    const int64_t g = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nthreads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->generation, g + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == g;) {
        cpu_relax();
        if (++spins == SPINS_BEFORE_YIELD) {
            sched_yield();
            spins = 0;
        }
    }
}

/* the product of one op's weights with its input a (quantized once by thread 0, before a barrier)
 * into y; the row tasks handed out through the op's own counter, 4 at a time (a thread that loses
 * its core for a while takes fewer). The caller's barrier ends it. */
static void step_product(const edgellm_op *op, float *y, int8_t *xq, float *xd, float *xs, int tid, int nthreads,
                         step_barrier *bar, _Atomic int64_t *next) {
    const int has_min = op->fmt == FMT_Q4_1;
    if (tid == 0)
        edgellm_quantize_q8(op->a, 1, op->k, xq, xd, op->fmt == FMT_Q8_0 ? NULL : xs);
    step_barrier_wait(bar, nthreads);
    const rows_fn rows_of = op->fmt == FMT_Q8_0 ? q8_0_rows : op->fmt == FMT_Q4_1 ? q4_1_rows : q4_0_rows;
    const int64_t n = total_rows(op->rows, op->parts), tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    for (int64_t t0; (t0 = atomic_fetch_add_explicit(next, 4, memory_order_relaxed)) < tasks;)
        for (int64_t task = t0; task < t0 + 4 && task < tasks; task++)
            task_rows(rows_of, op->w, op->rows, op->parts, op->k / QK, has_min, xq, xd, xs, 1, y, n, task);
}

#define MAX_HEAD_DIM 1024
/* heads of d features, each first normalised (RMSNorm with weight nw over the head, when nw is not
 * NULL), its first r features rotated by the position's angles (c, s: cos and sin [r/2]) */
static void rope_heads(const float *x, float *y, int heads, int d, int r, int style, const float *c, const float *s,
                       const float *nw, float eps) {
    float normed[MAX_HEAD_DIM];
    for (int h = 0; h < heads; h++) {
        const float *xh = x + (int64_t)h * d;
        float *yh = y + (int64_t)h * d;
        if (nw) {
            rms_norm(xh, nw, normed, d, eps);
            xh = normed;
        }
        for (int i = r; i < d; i++)
            yh[i] = xh[i];
        for (int i = 0; i < r / 2; i++) {
            const int i0 = style == 0 ? 2 * i : i, i1 = style == 0 ? 2 * i + 1 : i + r / 2;
            const float x0 = xh[i0], x1 = xh[i1];
            yh[i0] = x0 * c[i] - x1 * s[i];
            yh[i1] = x0 * s[i] + x1 * c[i];
        }
    }
}

static void attend_head(const edgellm_op *op, int h, int64_t n, float *p) {
    const int d = op->head_dim, kvh = h / (op->n_heads / op->n_kv);
    const int64_t stride = (int64_t)op->n_kv * d;
    const float *q = op->a + (int64_t)h * d;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const float *kt = op->kc + t * stride + (int64_t)kvh * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < d; i++)
            dot += q[i] * kt[i];
        p[t] = dot * op->scale;
        mx = p[t] > mx ? p[t] : mx;
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        p[t] = expf(p[t] - mx);
        sum += p[t];
    }
    const float inv = 1.0f / sum;
    float *out = op->y + (int64_t)h * d;
    for (int i = 0; i < d; i++)
        out[i] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const float *vt = op->vc + t * stride + (int64_t)kvh * d;
        const float pt = p[t] * inv;
#pragma omp simd
        for (int i = 0; i < d; i++)
            out[i] += pt * vt[i];
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ops[0..nops) for the token at position pos. Scratch: xq [kmax] and xd, xs [kmax / 32] (the
 * quantized input of a product), tmp [nmax] (a gated MLP's two halves), scores [heads][pos + 1].
 * op_ns (or NULL): each op's wall time is added to op_ns[i] (every op ends at a barrier; the
 * first starts when every thread has arrived, so the pool's wake-up is not counted). One
 * parallel region; the work of one thread: thread 0 alone, the rows of a product by tasks, the
 * heads of attention by a static split; a barrier after each op (step_barrier_wait). */
void edgellm_step(const edgellm_op *ops, int64_t nops, int64_t pos, int64_t token, int8_t *xq, float *xd, float *xs,
                  float *tmp, float *scores, int nthreads, int64_t *op_ns) {
    int64_t last = op_ns ? now_ns() : 0;
    step_barrier bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.generation, 0);
    _Atomic int64_t next[nops > 0 ? nops : 1];  /* each product's task counter */
    for (int64_t i = 0; i < nops; i++)
        atomic_init(&next[i], 0);
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();  /* the team may be smaller than asked */
        if (op_ns) {  /* the ops' times start once every thread is here: waking the pool is no op's */
            step_barrier_wait(&bar, nt);
            if (tid == 0)
                last = now_ns();
        }
        for (int64_t i = 0; i < nops; i++) {
            const edgellm_op *op = ops + i;
            _Atomic int64_t *counter = next + i;
            switch (op->kind) {
            case EOP_EMBED:
                if (tid == 0)
                    dequant_row(op->w[0] + token * (op->k / QK) * FMT_BYTES[op->fmt], op->fmt, op->k, op->y);
                break;
            case EOP_RMS:
                if (tid == 0)
                    rms_norm(op->a, op->wv, op->y, op->k, op->eps);
                break;
            case EOP_ADD_RMS:
                if (tid == 0) {
                    for (int64_t j = 0; j < op->k; j++)
                        op->y[j] = op->a[j] + op->b[j];
                    rms_norm(op->y, op->wv, op->y2, op->k, op->eps);
                }
                break;
            case EOP_LINEAR:
                step_product(op, op->y, xq, xd, xs, tid, nt, &bar, counter);
                if (op->bias || op->res) {
                    step_barrier_wait(&bar, nt);
                    if (tid == 0)
                        for (int64_t j = 0; j < op->n; j++) {
                            if (op->bias)
                                op->y[j] += op->bias[j];
                            if (op->res)
                                op->y[j] += op->res[j];
                        }
                }
                break;
            case EOP_SWIGLU: {
                step_product(op, tmp, xq, xd, xs, tid, nt, &bar, counter);
                step_barrier_wait(&bar, nt);
                const int64_t h = op->n / 2;
                if (tid == 0)
                    for (int64_t j = 0; j < h; j++) {
                        const float g = tmp[j];
                        const float a = op->act == 0 ? g / (1.0f + expf(-g))
                                                     : 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
                        op->y[j] = a * tmp[h + j];
                    }
                break;
            }
            case EOP_ROPE_STORE:
                if (tid == 0) {
                    const int d = op->head_dim, r = op->rope_dim;
                    const int64_t nq = (int64_t)op->n_heads * d, nkv = (int64_t)op->n_kv * d;
                    const float *c = op->cos + pos * (r / 2), *s = op->sin + pos * (r / 2);
                    rope_heads(op->a, op->y, op->n_heads, d, r, op->style, c, s, op->qn, op->eps);
                    rope_heads(op->a + nq, op->kc + pos * nkv, op->n_kv, d, r, op->style, c, s, op->kn, op->eps);
                    memcpy(op->vc + pos * nkv, op->a + nq + nkv, (size_t)nkv * sizeof(float));
                }
                break;
            case EOP_ATTN:
                for (int h = tid; h < op->n_heads; h += nt)
                    attend_head(op, h, pos + 1, scores + (int64_t)h * (pos + 1));
                break;
            }
            step_barrier_wait(&bar, nt);
            if (op_ns && tid == 0) {
                const int64_t t = now_ns();
                op_ns[i] += t - last;
                last = t;
            }
        }
    }
}
