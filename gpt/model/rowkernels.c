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

/* Several rows where the build keeps one row's sums a pass (AVX2): each row's pass would widen the block's bf16
   weights again, three times float32's work a weight, so the block is widened once, CHUNK inputs at a time into
   a float32 copy that stays in L1, and every row's sums run over that (in the same order: the same numbers). */
#define CHUNK 64
static void bf16_block_rows(const uint16_t *x, long m, long in, const uint16_t *w, float *sums) {
    float wf[CHUNK * 64] __attribute__((aligned(64)));
    for (long i0 = 0; i0 < in; i0 += CHUNK) {
        long n = min_l(CHUNK, in - i0);
        for (long k = 0; k < n * 64; k += VL) { /* bf16 is float32's upper half */
            vi bits = __builtin_convertvector(*(const vh *)(w + i0 * 64 + k), vi) << 16;
            memcpy(wf + k, &bits, sizeof bits);
        }
        for (long r = 0; r < m; r++) {
            vf acc[NV], *s = (vf *)(sums + r * 64); /* (element-wise: registers, not memcpy's stack copies) */
#pragma GCC unroll 8
            for (int q = 0; q < NV; q++) acc[q] = i0 ? s[q] : (vf){0};
            for (long i = 0; i < n; i++) {
                float xv = from_bf16(x[r * in + i0 + i]);
#pragma GCC unroll 8
                for (int q = 0; q < NV; q++) acc[q] += xv * *(const vf *)(wf + i * 64 + q * VL);
            }
#pragma GCC unroll 8
            for (int q = 0; q < NV; q++) s[q] = acc[q];
        }
    }
}

/* The block's 64 sums for row r written to y as bf16, plus the bias, for the outputs that exist. */
static inline void put_bf16(uint16_t *y, const float *sums, const uint16_t *bias, long o0, long out) {
    long n = min_l(64, out - o0);
    for (long c = 0; c < n; c++) y[o0 + c] = to_bf16(sums[c] + (bias ? from_bf16(bias[o0 + c]) : 0.0f));
}

void bf16_rows(const uint16_t *x, long m, long in, const uint16_t *w, const uint16_t *bias, uint16_t *y, long out,
               int threads) {
    long blocks = (out + 63) / 64;
    float *widened = BF16_K == 1 && ROWS == 1 && m > 1 ? malloc(sizeof(float) * 64 * m * (size_t)blocks) : NULL;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks * in * m >= PARALLEL_WORK)
    for (long b = 0; b < blocks; b++) {
        const uint16_t *wb = w + b * in * 64;
        if (widened) { /* (without the memory: row by row below) */
            float *sums = widened + b * 64 * m;
            bf16_block_rows(x, m, in, wb, sums);
            for (long r = 0; r < m; r++) put_bf16(y + r * out, sums + r * 64, bias, b * 64, out);
            continue;
        }
        float sums[ROWS * 64];
        for (long r0 = 0; r0 < m; r0 += ROWS) {
            int R = (int)min_l(ROWS, m - r0);
            const uint16_t *xr = x + r0 * in;
            if (R == ROWS) bf16_block(xr, in, wb, ROWS, sums);
            else for (int r = 0; r < R; r++) bf16_block(xr + r * in, in, wb, 1, sums + r * 64);
            for (int r = 0; r < R; r++) put_bf16(y + (r0 + r) * out, sums + r * 64, bias, b * 64, out);
        }
    }
    free(widened);
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
        const float *xr = x + r * in;
        uint32_t top = 0; /* the largest |x| as bits: for floats >= 0 their order (a NaN above all, as amax) */
        for (long i = 0; i < in; i++) {
            uint32_t u;
            memcpy(&u, xr + i, 4);
            u &= 0x7fffffffu;
            top = u > top ? u : top;
        }
        float a;
        memcpy(&a, &top, 4);
        amax[r] = a > tiny ? a : tiny; /* an all-zero row quantises to zeros, not to NaN */
        float s = 127.0f / amax[r];
        for (long i = 0; i < in; i++) /* |x s| <= 127: the magic constant rounds half to even, as torch.round */
            q[r * in + i] = (uint8_t)((int)((xr[i] * s + 12582912.0f) - 12582912.0f) + 128);
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

/* ---- one decode step of a pre-norm block: the whole layer in one call (gpt/model/rowkernels.py, BlockStep) ----
   x + attn(ln_1(x)), then + mlp(ln_2(x)), for m rows of one new token each, whose keys and values go to slot
   `pos` of a float32 cache (m, n_head, max_len, head_dim); the query attends over slots 0 .. pos. The products
   are the functions above; the rest is what PyTorch's eager step computes, with its rounding: for BF16 every
   tensor the eager step holds in bf16 (the residual stream, each LayerNorm's, product's and activation's
   result, attention's output) is rounded to bf16 where it does, the rest is float32. */
enum { GELU = 0, GELU_TANH = 1, RELU2 = 2 };

typedef struct {
    int kind, act;           /* F32, BF16 or INT8; GELU, GELU_TANH or RELU2 */
    long n_embd, n_head, hidden;
    float eps;               /* the LayerNorms' */
    const float *ln_w[2], *ln_b[2]; /* ln_1, ln_2 in float32; a bias may be NULL */
    const void *w[4], *b[4]; /* c_attn, attn.c_proj, c_fc, mlp.c_proj: blocked weights, bias (the kind's dtype;
                                float32 for INT8) or NULL */
    const int32_t *wsum[4];  /* INT8: each output's weight sum and scale */
    const float *wscale[4];
} block_t;

static inline float bf16_round(float f) { return from_bf16(to_bf16(f)); }

/* exp(x) in float32 for x <= 88 (Cephes' polynomial, within 2 ulp): branch-free, so the loops calling it
   vectorise (the C library's expf does not). */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f, p = p * r + 8.3334519073e-3f, p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f, p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static void layer_norm(const float *x, long m, long n, const float *w, const float *b, float eps, int bf16,
                       void *out) {
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * n;
        float mean = 0.0f, var = 0.0f;
        for (long i = 0; i < n; i++) mean += xr[i];
        mean /= (float)n;
        for (long i = 0; i < n; i++) var += (xr[i] - mean) * (xr[i] - mean);
        float rstd = 1.0f / sqrtf(var / (float)n + eps);
        for (long i = 0; i < n; i++) {
            float y = (xr[i] - mean) * rstd * w[i] + (b ? b[i] : 0.0f);
            if (bf16) ((uint16_t *)out)[r * n + i] = to_bf16(y);
            else ((float *)out)[r * n + i] = y;
        }
    }
}

/* Product j of the block: rows `in` (the kind's input: bf16 for BF16, else float32) times its weight into `out`
   (bf16 for BF16, else float32). Returns int8_rows' failure. */
static int product(const block_t *L, int j, const void *in, long m, long n_in, void *out, long n_out, float tiny,
                   int threads) {
    if (L->kind == INT8)
        return int8_rows(in, m, n_in, L->w[j], L->wsum[j], L->wscale[j], L->b[j], out, n_out, tiny, threads);
    if (L->kind == BF16) bf16_rows(in, m, n_in, L->w[j], L->b[j], out, n_out, threads);
    else f32_rows(in, m, n_in, L->w[j], L->b[j], out, n_out, threads);
    return 0;
}

static inline float value(const void *t, long i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)t)[i]) : ((const float *)t)[i];
}

/* One query per row and head over the keys in slots 0 .. pos: softmax(q.k / sqrt(hs)) . v, in float32. */
static void attention(const void *qkv, long m, long nh, long hs, const float *kc, const float *vc, long max_len,
                      long pos, int bf16, float *att, int threads) {
    long C = nh * hs, L = pos + 1;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static) num_threads(threads) if (m * nh * L * hs >= 8 * PARALLEL_WORK)
    for (long bh = 0; bh < m * nh; bh++) {
        long b = bh / nh, h = bh % nh;
        const float *k = kc + bh * max_len * hs, *v = vc + bh * max_len * hs;
        float q[hs], *s = malloc(sizeof(float) * (size_t)L), *o = att + b * C + h * hs;
        for (long d = 0; d < hs; d++) q[d] = value(qkv, b * 3 * C + h * hs + d, bf16) * scale;
        float top = -INFINITY;
        for (long t = 0; t < L; t++) {
            float part[8] = {0};
            long d = 0;
            for (; d + 8 <= hs; d += 8)
                for (int j = 0; j < 8; j++) part[j] += q[d + j] * k[t * hs + d + j];
            for (; d < hs; d++) part[0] += q[d] * k[t * hs + d];
            s[t] = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
            top = s[t] > top ? s[t] : top;
        }
        float sum = 0.0f;
        for (long t = 0; t < L; t++) s[t] = exp_poly(s[t] - top);
        for (long t = 0; t < L; t++) sum += s[t];
        for (long d = 0; d < hs; d++) o[d] = 0.0f;
        for (long t = 0; t < L; t++) {
            float p = s[t] / sum;
            for (long d = 0; d < hs; d++) o[d] += p * v[t * hs + d];
        }
        free(s);
    }
}

static inline float gelu_tanh(float x) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    u = u < -9.0f ? -9.0f : u > 9.0f ? 9.0f : u;
    float e = exp_poly(2.0f * u); /* tanh(u) = (e - 1) / (e + 1) */
    return 0.5f * x * (1.0f + (e - 1.0f) / (e + 1.0f));
}

static inline float activation(float x, int act) {
    if (act == RELU2) return x > 0.0f ? x * x : 0.0f;
    if (act == GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    return gelu_tanh(x);
}

/* The MLP's activation in place over n values; one plain loop for each case, so each vectorises. */
static void activate(void *t, long n, int act, int bf16) {
    uint16_t *h = t;
    if (bf16 && act == GELU_TANH) {
        for (long i = 0; i < n; i++) h[i] = to_bf16(gelu_tanh(from_bf16(h[i])));
    } else if (bf16) {
        for (long i = 0; i < n; i++) h[i] = to_bf16(activation(from_bf16(h[i]), act));
    } else if (act == GELU_TANH) {
        float *f = t;
        for (long i = 0; i < n; i++) f[i] = gelu_tanh(f[i]);
    } else {
        float *f = t;
        for (long i = 0; i < n; i++) f[i] = activation(f[i], act);
    }
}

/* x (m, n_embd) in the kind's dtype (bf16 for BF16, else float32) through the block into `out` (the same shape
   and dtype), the new keys and values written to slot `pos`. Returns 1 when memory ran out (the cache may hold
   this step's keys, `out` is unwritten), else 0. */
int block_step(const block_t *L, const void *x, long m, void *out, float *kc, float *vc, long max_len, long pos,
               float tiny, int threads) {
    long C = L->n_embd, nh = L->n_head, hs = C / nh, H = L->hidden;
    int bf16 = L->kind == BF16;
    size_t el = bf16 ? 2 : 4;
    float *res = malloc(sizeof(float) * (size_t)(m * C)), *att = malloc(sizeof(float) * (size_t)(m * C));
    void *h = malloc(el * (size_t)(m * C)), *qkv = malloc(el * (size_t)(m * 3 * C));
    void *y = malloc(el * (size_t)(m * C)), *fc = malloc(el * (size_t)(m * H));
    int failed = !res || !att || !h || !qkv || !y || !fc;
    for (long i = 0; !failed && i < m * C; i++) res[i] = value(x, i, bf16);
    /* attention */
    if (!failed) layer_norm(res, m, C, L->ln_w[0], L->ln_b[0], L->eps, bf16, h);
    failed = failed || product(L, 0, h, m, C, qkv, 3 * C, tiny, threads);
    for (long b = 0; !failed && b < m; b++)
        for (long hd = 0; hd < nh; hd++)
            for (long d = 0; d < hs; d++) {
                long slot = ((b * nh + hd) * max_len + pos) * hs + d;
                kc[slot] = value(qkv, b * 3 * C + C + hd * hs + d, bf16);
                vc[slot] = value(qkv, b * 3 * C + 2 * C + hd * hs + d, bf16);
            }
    if (!failed) {
        attention(qkv, m, nh, hs, kc, vc, max_len, pos, bf16, att, threads);
        if (bf16)
            for (long i = 0; i < m * C; i++) ((uint16_t *)h)[i] = to_bf16(att[i]);
    }
    failed = failed || product(L, 1, bf16 ? h : (void *)att, m, C, y, C, tiny, threads);
    for (long i = 0; !failed && i < m * C; i++) {
        float r = res[i] + value(y, i, bf16);
        res[i] = bf16 ? bf16_round(r) : r;
    }
    /* MLP */
    if (!failed) layer_norm(res, m, C, L->ln_w[1], L->ln_b[1], L->eps, bf16, h);
    failed = failed || product(L, 2, h, m, C, fc, H, tiny, threads);
    if (!failed) activate(fc, m * H, L->act, bf16);
    failed = failed || product(L, 3, fc, m, H, y, C, tiny, threads);
    for (long i = 0; !failed && i < m * C; i++) {
        float r = res[i] + value(y, i, bf16);
        if (bf16) ((uint16_t *)out)[i] = to_bf16(r);
        else ((float *)out)[i] = r;
    }
    free(res), free(att), free(h), free(qkv), free(y), free(fc);
    return failed;
}

/* ---- a decoder-only model's whole one-token step (gpt/model/rowkernels.py, StackStep) ----
   The token's embedding plus its position's, every block (block_step, in place), and the final LayerNorm: the
   hidden state (m, n_embd) of m rows at position `pos`, in the blocks' dtype. */
typedef struct {
    long n_layer, vocab;
    const block_t *blocks;
    const void *wte, *wpe; /* (vocab, n_embd) and (positions, n_embd), the blocks' dtype */
    const float *ln_w, *ln_b;
    float eps;
} stack_t;

/* Returns 0, 1 when memory ran out, 2 for a token id outside the vocabulary (nothing written then). */
int stack_step(const stack_t *S, const int64_t *idx, long m, void *out, float *const *kc, float *const *vc,
               long max_len, long pos, float tiny, int threads) {
    const block_t *L = S->blocks;
    long C = L->n_embd;
    int bf16 = L->kind == BF16;
    for (long b = 0; b < m; b++)
        if (idx[b] < 0 || idx[b] >= S->vocab) return 2;
    for (long b = 0; b < m; b++)
        for (long i = 0; i < C; i++) {
            float e = value(S->wte, idx[b] * C + i, bf16) + value(S->wpe, pos * C + i, bf16);
            if (bf16) ((uint16_t *)out)[b * C + i] = to_bf16(e);
            else ((float *)out)[b * C + i] = e;
        }
    for (long l = 0; l < S->n_layer; l++)
        if (block_step(L + l, out, m, out, kc[l], vc[l], max_len, pos, tiny, threads)) return 1;
    float *x = malloc(sizeof(float) * (size_t)(m * C));
    if (!x) return 1;
    for (long i = 0; i < m * C; i++) x[i] = value(out, i, bf16);
    layer_norm(x, m, C, S->ln_w, S->ln_b, S->eps, bf16, out);
    free(x);
    return 0;
}
