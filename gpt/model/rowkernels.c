/* A few rows times a weight matrix, the product of CPU decoding (gpt/model/rowkernels.py builds and loads this).

   Every weight matrix is stored in blocks of 64 output features: block b holds features 64b..64b+63 for every
   input feature in turn, so a block streams from memory in one run and each input value multiplies 64 outputs
   at once, in 4 vectors of 16 sums that never need adding across (the zero-padded last block included). Where
   the CPU multiplies pairs of bf16 (AVX512_BF16) or quads of int8 (AVX512_VNNI) in one instruction, each
   output's pair or quad of weights sits together: (blocks, in / k, 64, k), k = layout(kind). The rows go
   through each block ROWS at a time, so a block is read from memory once for all of them; the blocks are
   shared among `threads` OpenMP threads (torch's own runtime: the library is linked against its libgomp).
   Each output is the same sum in the same order whatever the number of rows, so a row's result does not depend
   on the rows beside it. Built with -ffp-contract=off: int8 scales back as (dot x scale) + bias, as
   gpt.model.quantize.Int8Linear does in PyTorch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define ROWS 4
#else
#define ROWS 2 /* 16 vector registers (AVX2): two rows' 8 sums, the weights and the inputs */
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_K 2
#else
#define BF16_K 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_K 4
#else
#define INT8_K 1
#endif

enum { F32 = 0, BF16 = 1, INT8 = 2 };
typedef float vf __attribute__((vector_size(64), aligned(4)));   /* 16 floats, loads need no alignment */
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef int8_t vb __attribute__((vector_size(16), aligned(1)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));

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
    vf acc[ROWS][4] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
        vf w0 = *(const vf *)w, w1 = *(const vf *)(w + 16), w2 = *(const vf *)(w + 32), w3 = *(const vf *)(w + 48);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float xv = x[r * in + i];
            acc[r][0] += xv * w0, acc[r][1] += xv * w1, acc[r][2] += xv * w2, acc[r][3] += xv * w3;
        }
    }
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

void f32_rows(const float *x, long m, long in, const float *w, const float *bias, float *y, long out, int threads) {
    long blocks = (out + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads)
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
    vf acc[ROWS][4] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
        vf wf[4];
        for (int q = 0; q < 4; q++) {
            vi bits = __builtin_convertvector(*(const vh *)(w + 16 * q), vi) << 16;
            memcpy(&wf[q], &bits, 64);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float xv = from_bf16(x[r * in + i]);
            acc[r][0] += xv * wf[0], acc[r][1] += xv * wf[1], acc[r][2] += xv * wf[2], acc[r][3] += xv * wf[3];
        }
    }
#endif
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

void bf16_rows(const uint16_t *x, long m, long in, const uint16_t *w, const uint16_t *bias, uint16_t *y, long out,
               int threads) {
    long blocks = (out + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads)
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
#if INT8_K == 4
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
#else
    vi acc[ROWS][4] = {{{0}}};
    for (long i = 0; i < in; i++, w += 64) {
        vi wi[4];
        for (int k = 0; k < 4; k++) wi[k] = __builtin_convertvector(*(const vb *)(w + 16 * k), vi);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t xv = (int32_t)q[r * in + i] - 128;
            acc[r][0] += xv * wi[0], acc[r][1] += xv * wi[1], acc[r][2] += xv * wi[2], acc[r][3] += xv * wi[3];
        }
    }
#endif
    for (int r = 0; r < R; r++) memcpy(sums + r * 64, acc[r], sizeof acc[r]);
}

/* y = round(x x 127 / amax) . w, times amax x wscale, plus bias (amax at least `tiny`); the same numbers as Int8Linear._product.
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
#pragma omp parallel for schedule(static) num_threads(threads)
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
                    float dot = (float)(sums[r * 64 + c] - (INT8_K == 4 ? 128 * wsum[o] : 0));
                    float v = dot * (amax[r0 + r] * wscale[o]);
                    y[(r0 + r) * out + o] = bias ? bias[o] + v : v;
                }
        }
    }
    free(q), free(amax);
    return 0;
}
