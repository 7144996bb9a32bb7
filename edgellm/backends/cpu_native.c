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
 * NULL also each block's float sum of x [m][k/32] (the 4-bit formats' offset term). */
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
            if (sums) {
                float acc = 0.0f;
                for (int i = 0; i < QK; i++)
                    acc += xs[i];
                sums[t * nb + b] = acc;
            }
            int8_t *qs = q + t * k + b * QK;
            for (int i = 0; i < QK; i++)
                qs[i] = (int8_t)lrintf(xs[i] * inv);
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
 * lies in the file; part p has rows[p] rows starting at w[p]) handed out to the threads in tasks
 * of ROWS_PER_TASK, each task's rows multiplied by `rows_of` from its own part. */
static void run_tasks(rows_fn rows_of, const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t nb,
                      int has_min, const int8_t *xq, const float *xd, const float *xs, int64_t m, float *y,
                      int nthreads) {
    int64_t n = 0;
    for (int64_t p = 0; p < parts; p++)
        n += rows[p];
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    /* dynamic: a thread that loses its core for a while (another process, the GPU runtime's
     * threads) takes fewer tasks instead of holding the whole product back */
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < n ? r0 + ROWS_PER_TASK : n;
        /* a task's rows may span two parts: each piece is multiplied from its own part */
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

/* rows [r0, r1) of a Q4_0 (has_min 0) or Q4_1 (has_min 1) matrix times every input row */
static void q4_rows(const uint8_t *w, int64_t nb, int has_min, int64_t r0, int64_t r1, const int8_t *xq,
                    const float *xd, const float *xs, int64_t m, float *y, int64_t ldy) {
    const int64_t bb = has_min ? Q4_1_BYTES : Q4_0_BYTES, head = has_min ? 4 : 2;
    for (int64_t t = 0; t < m; t++) {
        const int8_t *qx = xq + t * nb * QK;
        const float *dx = xd + t * nb, *sx = xs + t * nb;
        int64_t r = r0;
#if defined(__AVX2__)
        /* four rows at a time share each block's x load; the last rows go one at a time through
         * the same arithmetic (a row's result does not depend on the rows computed with it) */
        for (; r < r1;) {
            const int rows = r + 4 <= r1 ? 4 : 1;
            const uint8_t *wr[4];
            __m256 acc[4];
            float off[4];
            for (int j = 0; j < rows; j++) {
                wr[j] = w + (r + j) * nb * bb;
                acc[j] = _mm256_setzero_ps();
                off[j] = 0.0f;
            }
            for (int64_t b = 0; b < nb; b++) {
                const __m256i vx = _mm256_loadu_si256((const __m256i *)(qx + b * QK));
                const int64_t o = b * bb;
                for (int j = 0; j < rows; j++) {
                    const uint8_t *blk = wr[j] + o;
                    const float d = f16_to_f32(*(const uint16_t *)blk);
                    const __m256 p = _mm256_cvtepi32_ps(dot32(unpack_q4(blk + head), vx));
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[b]), p, acc[j]);
                    off[j] += (has_min ? f16_to_f32(*(const uint16_t *)(blk + 2)) : -8.0f * d) * sx[b];
                }
            }
            for (int j = 0; j < rows; j++)
                y[t * ldy + r + j] = hsum8(acc[j]) + off[j];
            r += rows;
        }
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

/* As edgellm_q8_0_matmul for Q4_0 (has_min 0) or Q4_1 (has_min 1) parts; xs [m][k/32] is scratch
 * for the input's block sums. */
void edgellm_q4_matmul(const uint8_t *const *w, const int64_t *rows, int64_t parts, int64_t k, int has_min,
                       const float *x, int64_t m, float *y, int8_t *xq, float *xd, float *xs, int nthreads) {
    edgellm_quantize_q8(x, m, k, xq, xd, xs);
    run_tasks(q4_rows, w, rows, parts, k / QK, has_min, xq, xd, xs, m, y, nthreads);
}
