/* A few rows times a weight matrix, the product of CPU decoding (gpt/model/rowkernels.py builds and loads this).

   Every weight matrix is stored in blocks of 64 output features: block b holds features 64b..64b+63 for every
   input feature in turn, so a block streams from memory in one run and each input value multiplies 64 outputs
   at once, in vectors of sums that never need adding across (4 of 16 with AVX-512, 8 of 8 with AVX2; the
   zero-padded last block included). Where the CPU multiplies pairs of bf16 (AVX512_BF16) or quads of int8
   (AVX512_VNNI; AVX2 in two steps, vpmaddubsw then vpmaddwd) at once, each output's pair or quad of weights
   sits together: (blocks, in / k, 64, k), k = layout(kind). The rows go through each block ROWS at a time
   (4 with AVX-512, 1 with AVX2), so a block is read from memory once for all of them; the blocks are
   shared among `threads` OpenMP threads (torch's own runtime: the library is linked against its libgomp).
   Each output is the same sum in the same order whatever the number of rows, so a row's result does not depend
   on the rows beside it. Built with -ffp-contract=off: int8 scales back as (dot x scale) + bias, as
   gpt.model.quantize.Int8Linear does in PyTorch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define VL 16  /* floats a vector */
#define ROWS 4 /* rows a pass: 4 x 4 sums in 32 vector registers */
#else
#define VL 8   /* AVX2 (or plain vectors): 8 floats */
#define ROWS 1 /* 8 sums a row in 16 vector registers */
#endif
#define NV (64 / VL) /* vectors a block */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_K 2
#else
#define BF16_K 1
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__)
#define INT8_K 4 /* VNNI's dot product of quads, or AVX2's pairs (vpmaddubsw) added to quads (vpmaddwd) */
#else
#define INT8_K 1
#endif

enum { F32 = 0, BF16 = 1, INT8 = 2 };
/* Fewer products than this (blocks x in x rows, 64 each) run on the calling thread: waking the others and
   waiting for them costs more than a small layer's whole product (the char model's). */
#define PARALLEL_WORK (1L << 12)
typedef float vf __attribute__((vector_size(VL * 4), aligned(4))); /* loads need no alignment */
typedef int32_t vi __attribute__((vector_size(VL * 4), aligned(4)));
typedef int8_t vb __attribute__((vector_size(VL), aligned(1)));
typedef uint16_t vh __attribute__((vector_size(VL * 2), aligned(2)));

/* 1 where this build has the vector paths that beat PyTorch's kernels (AVX2 or AVX-512), else 0. */
int fast(void) {
#if defined(__AVX2__) || defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

int layout(int kind) { return kind == BF16 ? BF16_K : kind == INT8 ? INT8_K : 1; }

static inline long min_l(long a, long b) { return a < b ? a : b; }

/* The block's 64 sums for row r (acc) written to y, plus the bias, for the outputs that exist. */
static inline void put(float *y, const float *sums, const float *bias, long o0, long out) {
    long n = min_l(64, out - o0);
    for (long c = 0; c < n; c++) y[o0 + c] = sums[c] + (bias ? bias[o0 + c] : 0.0f);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as PyTorch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- float32: (blocks, in, 64) ---- */
static inline __attribute__((always_inline)) void f32_block(const float *x, long in, const float *w, int R,
                                                            float *sums) {
    vf acc[ROWS][NV] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float xv = x[r * in + i];
#pragma GCC unroll 8
            for (int q = 0; q < NV; q++) acc[r][q] += xv * *(const vf *)(w + q * VL);
        }
    }
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

void f32_rows(const float *x, long m, long in, const float *w, const float *bias, float *y, long out, int threads) {
    long blocks = (out + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks * in * m >= PARALLEL_WORK)
    for (long b = 0; b < blocks; b++) {
        float sums[ROWS * 64];
        for (long r0 = 0; r0 < m; r0 += ROWS) {
            int R = (int)min_l(ROWS, m - r0);
            const float *xr = x + r0 * in, *wb = w + b * in * 64;
            if (R == ROWS) f32_block(xr, in, wb, ROWS, sums); /* constant R: the sums stay in registers */
            else for (int r = 0; r < R; r++) f32_block(xr + r * in, in, wb, 1, sums + r * 64);
            for (int r = 0; r < R; r++) put(y + (r0 + r) * out, sums + r * 64, bias, b * 64, out);
        }
    }
}

/* ---- bfloat16: (blocks, in / BF16_K, 64, BF16_K); rows and result in bf16, sums in float32 ---- */
static inline __attribute__((always_inline)) void bf16_block(const uint16_t *x, long in, const uint16_t *w, int R,
                                                             float *sums) {
#if BF16_K == 2
    __m512 acc[ROWS][4];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    for (long i = 0; i < in; i += 2, w += 128) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * in + i, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0), acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2), acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
        }
    }
#else
    vf acc[ROWS][NV] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
        vf wf[NV];
#pragma GCC unroll 8
        for (int q = 0; q < NV; q++) { /* bf16 is float32's upper half */
            vi bits = __builtin_convertvector(*(const vh *)(w + q * VL), vi) << 16;
            memcpy(&wf[q], &bits, sizeof bits);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float xv = from_bf16(x[r * in + i]);
#pragma GCC unroll 8
            for (int q = 0; q < NV; q++) acc[r][q] += xv * wf[q];
        }
    }
#endif
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

void bf16_rows(const uint16_t *x, long m, long in, const uint16_t *w, const uint16_t *bias, uint16_t *y, long out,
               int threads) {
    long blocks = (out + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks * in * m >= PARALLEL_WORK)
    for (long b = 0; b < blocks; b++) {
        float sums[ROWS * 64];
        for (long r0 = 0; r0 < m; r0 += ROWS) {
            int R = (int)min_l(ROWS, m - r0);
            const uint16_t *xr = x + r0 * in, *wb = w + b * in * 64;
            if (R == ROWS) bf16_block(xr, in, wb, ROWS, sums);
            else for (int r = 0; r < R; r++) bf16_block(xr + r * in, in, wb, 1, sums + r * 64);
            long n = min_l(64, out - b * 64);
            for (int r = 0; r < R; r++)
                for (long c = 0; c < n; c++)
                    y[(r0 + r) * out + b * 64 + c] =
                        to_bf16(sums[r * 64 + c] + (bias ? from_bf16(bias[b * 64 + c]) : 0.0f));
        }
    }
}

/* ---- int8: (blocks, in / INT8_K, 64, INT8_K); each row quantised to [-127, 127] by its largest magnitude ----
   VNNI multiplies unsigned by signed bytes: the row goes in as q + 128, and 128 x (the output's weight sum),
   `wsum`, comes off again. The sums are exact integers in int32. */
static inline __attribute__((always_inline)) void int8_block(const uint8_t *q, long in, const int8_t *w, int R,
                                                             int32_t *sums) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[ROWS][4];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
    for (long i = 0; i < in; i += 4, w += 256) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            uint32_t quad;
            memcpy(&quad, q + r * in + i, 4);
            __m512i xv = _mm512_set1_epi32((int)quad);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, w0), acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xv, w2), acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xv, w3);
        }
    }
#elif defined(__AVX2__) /* u8 x s8 pairs in int16 (at most 2 x 255 x 64: never saturates), then pairs of those */
    __m256i acc[ROWS][8], ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 8; q++) acc[r][q] = _mm256_setzero_si256();
    for (long i = 0; i < in; i += 4, w += 256) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            uint32_t quad;
            memcpy(&quad, q + r * in + i, 4);
            __m256i xv = _mm256_set1_epi32((int)quad);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m256i pairs = _mm256_maddubs_epi16(xv, _mm256_loadu_si256((const __m256i *)(w + 32 * k)));
                acc[r][k] = _mm256_add_epi32(acc[r][k], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
#else
    vi acc[ROWS][NV] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
        vi wi[NV];
        for (int k = 0; k < NV; k++) wi[k] = __builtin_convertvector(*(const vb *)(w + VL * k), vi);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t xv = (int32_t)q[r * in + i] - 128;
            for (int k = 0; k < NV; k++) acc[r][k] += xv * wi[k];
        }
    }
#endif
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

/* y = round(x x 127 / amax) . w, times amax x wscale, plus bias (amax at least `tiny`): the numbers of
   gpt.model.quantize.int8_product.
   Returns 1 when it cannot allocate the quantised rows (nothing written), else 0. */
int int8_rows(const float *x, long m, long in, const int8_t *w, const int32_t *wsum, const float *wscale,
              const float *bias, float *y, long out, float tiny, int threads) {
    uint8_t *q = malloc((size_t)(m * in));
    float *amax = malloc(sizeof(float) * (size_t)m);
    if (!q || !amax) {
        free(q), free(amax);
        return 1;
    }
    for (long r = 0; r < m; r++) {
        float a = 0.0f;
        for (long i = 0; i < in; i++) a = fmaxf(a, fabsf(x[r * in + i]));
        amax[r] = a > tiny ? a : tiny; /* an all-zero row quantises to zeros, not to NaN */
        float s = 127.0f / amax[r];
        for (long i = 0; i < in; i++) q[r * in + i] = (uint8_t)((int)nearbyintf(x[r * in + i] * s) + 128);
    }
    long blocks = (out + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks * in * m >= PARALLEL_WORK)
    for (long b = 0; b < blocks; b++) {
        int32_t sums[ROWS * 64];
        for (long r0 = 0; r0 < m; r0 += ROWS) {
            int R = (int)min_l(ROWS, m - r0);
            const uint8_t *qr = q + r0 * in;
            const int8_t *wb = w + b * in * 64;
            if (R == ROWS) int8_block(qr, in, wb, ROWS, sums);
            else for (int r = 0; r < R; r++) int8_block(qr + r * in, in, wb, 1, sums + r * 64);
            long n = min_l(64, out - b * 64);
            for (int r = 0; r < R; r++)
                for (long c = 0; c < n; c++) {
                    long o = b * 64 + c;
                    float dot = (float)(sums[r * 64 + c] - (INT8_K == 4 ? 128 * wsum[o] : 0)); /* q + 128 went in */
                    float v = dot * (amax[r0 + r] * wscale[o]);
                    y[(r0 + r) * out + o] = bias ? bias[o] + v : v;
                }
        }
    }
    free(q), free(amax);
    return 0;
}
