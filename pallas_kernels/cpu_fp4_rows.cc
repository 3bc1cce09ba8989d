// Rows times their own expert's matrix on a CPU, only the routed experts read. Two handlers:
//
// DflashMxfp4Rows: an MXFP4 matrix read as stored, one pass over each routed expert's codes.
//
//   y[r, o] = sum_i x[r, i] * E2M1(code[e_r, o, i]) * 2^(scale[e_r, o, i / 32] - 127),   e_r = expert[r]
//
// Operands: x f32 [R, K]; blocks u8 [E, N, K/32, 16] (two codes a byte, the even element in the low nibble);
// scales u8 [E, N, K/32] (E8M0: 255 is NaN); expert s32 [R] (rows of one expert adjacent, e.g. sorted); result f32
// [R, N]. Each weight is the float product E2M1(code) * 2^(s - 127), exactly as the dequantized table holds it
// (subnormal scales, overflow to inf and NaN included); rows are independent, so an expert without rows is never
// read. A run of rows with the same expert decodes each block once for all of them. Calls of about 2M multiply-adds
// or more are split over XLA's intra-op thread pool (`ParallelItems`: workers claim items, so a descheduled helper
// holds up only the item it claimed).
#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;
constexpr int kHalf = 16;
constexpr int kRowsAtOnce = 4;

inline float ScaleOf(uint8_t s) {
  uint32_t bits = s == 0 ? 0x00400000u : (s == 255 ? 0x7FC00000u : uint32_t(s) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Problem {
  const float* x;        // [R, K]
  const uint8_t* blocks; // [E, N, K/32, 16]
  const uint8_t* scales; // [E, N, K/32]
  const int32_t* expert; // [R]
  float* y;              // [R, N]
  int64_t rows, experts, n, k;
  std::vector<float> even, odd;  // x split by element parity: [R, K/2] each
  std::vector<int64_t> runs;     // starts of the runs of equal experts, then rows
};

constexpr float kE2m1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// Output rows [o0, o1) of one run of rows [r0, r1) sharing expert e.
void RunOutputs(const Problem& p, int64_t e, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  const int64_t groups = p.k / kBlock, half = p.k / 2;
#ifdef __AVX512F__
  const __m512 table = _mm512_loadu_ps(kE2m1);
  const __m512i nibble = _mm512_set1_epi32(15);
#elif defined(__AVX2__) && defined(__FMA__)
  // twice each E2M1 value, by code (0 and its negative both 0: a weight's zero sign changes no sum started at +0)
  const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low = _mm_set1_epi8(15);
#endif
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* codes = p.blocks + ((e * p.n + o) * groups) * kHalf;
    const uint8_t* sc = p.scales + (e * p.n + o) * groups;
    for (int64_t r = r0; r < r1; r += kRowsAtOnce) {
      const int64_t m = std::min<int64_t>(kRowsAtOnce, r1 - r);
#ifdef __AVX512F__
      __m512 acc_e[kRowsAtOnce], acc_o[kRowsAtOnce];
      for (int q = 0; q < kRowsAtOnce; ++q) acc_e[q] = acc_o[q] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        // the block's 16 weights values: E2M1 value x 2^(s - 127), one float product each
        const __m512 values = _mm512_mul_ps(table, _mm512_set1_ps(ScaleOf(sc[g])));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * kHalf)));
        const __m512 w_e = _mm512_permutexvar_ps(_mm512_and_si512(b, nibble), values);
        const __m512 w_o = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
        for (int64_t q = 0; q < m; ++q) {
          const float* xe = p.even.data() + (r + q) * half + g * kHalf;
          const float* xo = p.odd.data() + (r + q) * half + g * kHalf;
          acc_e[q] = _mm512_fmadd_ps(_mm512_loadu_ps(xe), w_e, acc_e[q]);
          acc_o[q] = _mm512_fmadd_ps(_mm512_loadu_ps(xo), w_o, acc_o[q]);
        }
      }
      for (int64_t q = 0; q < m; ++q) p.y[(r + q) * p.n + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc_e[q], acc_o[q]));
#elif defined(__AVX2__) && defined(__FMA__)
      // 8 lanes: the block's 32 codes looked up at once as twice their E2M1 values (small integers, one byte
      // shuffle per half of each code), widened to floats, halved and times the scale: the dequantized table's
      // weights, exactly; each row's even and odd products summed into one accumulator per half block
      __m256 acc[kRowsAtOnce][2];
      for (int q = 0; q < kRowsAtOnce; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 scale = _mm256_set1_ps(ScaleOf(sc[g])), halves = _mm256_set1_ps(0.5f);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * kHalf));
        const __m128i q_e = _mm_shuffle_epi8(twice, _mm_and_si128(b, low));
        const __m128i q_o = _mm_shuffle_epi8(twice, _mm_and_si128(_mm_srli_epi16(b, 4), low));
        // (twice the value) x 0.5 is the value exactly (no subnormal half-scale), then times the scale
        auto widen = [&](__m128i q8) {
          return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), halves), scale);
        };
        const __m256 w_e[2] = {widen(q_e), widen(_mm_srli_si128(q_e, 8))};
        const __m256 w_o[2] = {widen(q_o), widen(_mm_srli_si128(q_o, 8))};
        for (int64_t q = 0; q < m; ++q) {
          const float* xe = p.even.data() + (r + q) * half + g * kHalf;
          const float* xo = p.odd.data() + (r + q) * half + g * kHalf;
          for (int h = 0; h < 2; ++h)
            acc[q][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xo + 8 * h), w_o[h],
                                        _mm256_fmadd_ps(_mm256_loadu_ps(xe + 8 * h), w_e[h], acc[q][h]));
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        const __m256 t = _mm256_add_ps(acc[q][0], acc[q][1]);
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        p.y[(r + q) * p.n + o] = _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
      }
#else
      float acc_e[kRowsAtOnce][kHalf] = {};
      float acc_o[kRowsAtOnce][kHalf] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const float s = ScaleOf(sc[g]);
        float values[16], w_e[kHalf], w_o[kHalf];
        for (int j = 0; j < 16; ++j) values[j] = kE2m1[j] * s;
        const uint8_t* b = codes + g * kHalf;
        for (int j = 0; j < kHalf; ++j) {
          w_e[j] = values[b[j] & 15u];
          w_o[j] = values[b[j] >> 4];
        }
        for (int64_t q = 0; q < m; ++q) {
          const float* xe = p.even.data() + (r + q) * half + g * kHalf;
          const float* xo = p.odd.data() + (r + q) * half + g * kHalf;
          for (int j = 0; j < kHalf; ++j) {
            acc_e[q][j] += xe[j] * w_e[j];
            acc_o[q][j] += xo[j] * w_o[j];
          }
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        float total = 0.f;
        for (int j = 0; j < kHalf; ++j) total += acc_e[q][j] + acc_o[q][j];
        p.y[(r + q) * p.n + o] = total;
      }
#endif
    }
  }
}


// The same, two output rows at a time (two decode streams and four FMA chains in flight: 1.1 - 1.4x the one-row
// version's bytes per CPU second at Qwen3-30B-A3B's shapes), up to two rows of x at once.
void RunOutputPairs(const Problem& p, int64_t e, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
#ifndef __AVX512F__
  RunOutputs(p, e, r0, r1, o0, o1);
#else
  const int64_t groups = p.k / kBlock, half = p.k / 2;
  const __m512 table = _mm512_loadu_ps(kE2m1);
  const __m512i nibble = _mm512_set1_epi32(15);
  int64_t o = o0;
  for (; o + 1 < o1; o += 2) {
    const uint8_t* c0 = p.blocks + ((e * p.n + o) * groups) * kHalf;
    const uint8_t* c1 = c0 + groups * kHalf;
    const uint8_t* s0 = p.scales + (e * p.n + o) * groups;
    const uint8_t* s1 = s0 + groups;
    for (int64_t r = r0; r < r1; r += 2) {
      const int64_t m = std::min<int64_t>(2, r1 - r);
      __m512 a[2][2][2];
      for (int q = 0; q < 2; ++q) for (int u = 0; u < 2; ++u) a[q][u][0] = a[q][u][1] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const __m512 v0 = _mm512_mul_ps(table, _mm512_set1_ps(ScaleOf(s0[g])));
        const __m512 v1 = _mm512_mul_ps(table, _mm512_set1_ps(ScaleOf(s1[g])));
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0 + g * kHalf)));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1 + g * kHalf)));
        const __m512 we0 = _mm512_permutexvar_ps(_mm512_and_si512(b0, nibble), v0);
        const __m512 wo0 = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), v0);
        const __m512 we1 = _mm512_permutexvar_ps(_mm512_and_si512(b1, nibble), v1);
        const __m512 wo1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), v1);
        for (int64_t q = 0; q < m; ++q) {
          const __m512 xe = _mm512_loadu_ps(p.even.data() + (r + q) * half + g * kHalf);
          const __m512 xo = _mm512_loadu_ps(p.odd.data() + (r + q) * half + g * kHalf);
          a[q][0][0] = _mm512_fmadd_ps(xe, we0, a[q][0][0]);
          a[q][0][1] = _mm512_fmadd_ps(xo, wo0, a[q][0][1]);
          a[q][1][0] = _mm512_fmadd_ps(xe, we1, a[q][1][0]);
          a[q][1][1] = _mm512_fmadd_ps(xo, wo1, a[q][1][1]);
        }
      }
      for (int64_t q = 0; q < m; ++q) {
        p.y[(r + q) * p.n + o] = _mm512_reduce_add_ps(_mm512_add_ps(a[q][0][0], a[q][0][1]));
        p.y[(r + q) * p.n + o + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a[q][1][0], a[q][1][1]));
      }
    }
  }
  if (o < o1) RunOutputs(p, e, r0, r1, o, o1);
#endif
}

// Work item `item`: every run, output rows split into `chunks` equal parts.
void RunItem(const Problem& p, int64_t item, int64_t chunks) {
  const int64_t run = item / chunks, part = item % chunks;
  const int64_t r0 = p.runs[run], r1 = p.runs[run + 1];
  const int64_t e = p.expert[r0];
  const int64_t o0 = p.n * part / chunks, o1 = p.n * (part + 1) / chunks;
  if (e < 0 || e >= p.experts) {  // an out-of-range expert: NaN rows, never a stray read
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = o0; o < o1; ++o) p.y[r * p.n + o] = __builtin_nanf("");
    return;
  }
  RunOutputPairs(p, e, r0, r1, o0, o1);
}

// Runs run_item(i) for every i in [0, total) over `threads` workers of XLA's intra-op pool, the calling thread
// included. Each worker claims items from a shared counter, so the caller never waits on an item that no running
// thread holds, and a helper the pool starts after the items ran out touches nothing but the counter (which it
// shares by ownership: the call may have returned by then).
template <typename F>
void ParallelItems(ffi::ThreadPool& pool, int64_t threads, int64_t total, F run_item) {
  if (threads <= 1 || total <= 1) {
    for (int64_t i = 0; i < total; ++i) run_item(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, total, run_item]() {
    int64_t finished = 0;
    for (int64_t i = shared->next.fetch_add(1); i < total; i = shared->next.fetch_add(1)) {
      run_item(i);
      ++finished;
    }
    if (finished && shared->done.fetch_add(finished) + finished == total) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == total; });
}

// Calls from about this many multiply-adds are split over the pool.
constexpr int64_t kParallelMacs = int64_t(1) << 21;

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::U8> scales,
                ffi::Buffer<ffi::S32> expert, ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  auto xd = x.dimensions(), bd = blocks.dimensions(), sd = scales.dimensions(), ed = expert.dimensions();
  if (xd.size() != 2 || bd.size() != 4 || bd[3] != kHalf || xd[1] != bd[2] * kBlock || sd.size() != 3 ||
      sd[0] != bd[0] || sd[1] != bd[1] || sd[2] != bd[2] || ed.size() != 1 || ed[0] != xd[0])
    return ffi::Error::InvalidArgument("mxfp4_rows: x [R, K], blocks [E, N, K/32, 16], scales [E, N, K/32], expert [R]");
  Problem p;
  p.x = x.typed_data();
  p.blocks = blocks.typed_data();
  p.scales = scales.typed_data();
  p.expert = expert.typed_data();
  p.y = y->typed_data();
  p.rows = xd[0];
  p.k = xd[1];
  p.experts = bd[0];
  p.n = bd[1];
  const int64_t half = p.k / 2;
  p.even.resize(p.rows * half);
  p.odd.resize(p.rows * half);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t i = 0; i < half; ++i) {
      p.even[r * half + i] = p.x[r * p.k + 2 * i];
      p.odd[r * half + i] = p.x[r * p.k + 2 * i + 1];
    }
  for (int64_t r = 0; r < p.rows; ++r)
    if (r == 0 || p.expert[r] != p.expert[r - 1]) p.runs.push_back(r);
  const int64_t nruns = int64_t(p.runs.size());
  p.runs.push_back(p.rows);
  if (nruns == 0) return ffi::Error::Success();
  // each run's output rows split into `chunks` parts, one work item each (the same sums whatever the split)
  const int64_t threads = p.rows * p.n * p.k >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  const int64_t chunks = std::min<int64_t>(threads, std::max<int64_t>(1, p.n / 2));
  const Problem* problem = &p;
  ParallelItems(pool, threads, nruns * chunks, [problem, chunks](int64_t i) { RunItem(*problem, i, chunks); });
  return ffi::Error::Success();
}

// ---- DflashDenseRows / DflashDenseRowsBf16: y[r] = x[r] @ W[expert[r]] for a float32 or bfloat16 table W [E, K, N]
// (row-major [K, N] per expert) ----
//
// Every output element is summed over k in order, one fused multiply-add per term starting from zero, whatever the
// other rows of its run and whichever loop order below runs it: a row's result does not depend on its batch.
// Small matrices (the shipped pairs') run in register blocks of up to kDenseRows rows x DenseCols(M) columns, the
// k loop innermost: 128 columns for a single row (eight independent accumulators, enough to keep both FMA pipes
// busy: a verify's rows spread over the experts, most runs one row long), 64 for two to four rows.
// Large ones (real expert shapes, read from memory) stream the matrix once per block of rows in its storage order,
// k outermost, the rows' sums held in the output (in cache).

constexpr int kDenseRows = 4;
constexpr int64_t kDenseChunk = 128;              // the widest column block; the threads' column split is in these
constexpr int64_t kStreamBytes = int64_t(1) << 20;  // matrices from this size stream

constexpr int64_t DenseCols(int rows) { return rows == 1 ? 128 : 64; }

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DFLASH_DENSE_AVX512 1
inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 Mask(int64_t have) {
  return have >= 16 ? __mmask16(0xFFFF) : (have <= 0 ? __mmask16(0) : __mmask16((1u << have) - 1));
}
inline __mmask32 Mask32(int64_t have) {
  return have >= 32 ? __mmask32(0xFFFFFFFFu) : (have <= 0 ? __mmask32(0) : __mmask32((1u << have) - 1));
}

// float32 weights: M rows x V 16-column vectors, columns [o, min(o + 16 V, o1)).
template <int M, int V>
void DenseBlockF32(const float* x, int64_t k, const float* w, int64_t n, int64_t o, int64_t o1, float* y) {
  __mmask16 mask[V];
  for (int c = 0; c < V; ++c) mask[c] = Mask(o1 - o - 16 * c);
  __m512 acc[M][V];
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) acc[q][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* wr = w + i * n + o;
    __m512 wv[V];
    for (int c = 0; c < V; ++c) wv[c] = _mm512_maskz_loadu_ps(mask[c], wr + 16 * c);
    for (int q = 0; q < M; ++q) {
      const __m512 xb = _mm512_set1_ps(x[q * k + i]);
      for (int c = 0; c < V; ++c) acc[q][c] = _mm512_fmadd_ps(xb, wv[c], acc[q][c]);
    }
  }
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) _mm512_mask_storeu_ps(y + q * n + o + 16 * c, mask[c], acc[q][c]);
}

// bfloat16 weights: M rows x V 32-column chunks, columns [o, min(o + 32 V, o1)). A chunk is one load of 32 bf16
// values; its 32-bit lane j holds columns 2j (low half) and 2j + 1 (high half), widened exactly by a shift and a
// mask (no cross-lane widening), summed in "even" and "odd" accumulators and interleaved back once at the store.
template <int M, int V>
void DenseBlockBf16(const float* x, int64_t k, const uint16_t* w, int64_t n, int64_t o, int64_t o1, float* y) {
  __mmask32 load[V];
  for (int c = 0; c < V; ++c) load[c] = Mask32(o1 - o - 32 * c);
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 even[M][V], odd[M][V];
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) even[q][c] = odd[q][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const uint16_t* wr = w + i * n + o;
    __m512 we[V], wo[V];
    for (int c = 0; c < V; ++c) {
      const __m512i raw = _mm512_maskz_loadu_epi16(load[c], wr + 32 * c);
      we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      wo[c] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int q = 0; q < M; ++q) {
      const __m512 xb = _mm512_set1_ps(x[q * k + i]);
      for (int c = 0; c < V; ++c) {
        even[q][c] = _mm512_fmadd_ps(xb, we[c], even[q][c]);
        odd[q][c] = _mm512_fmadd_ps(xb, wo[c], odd[q][c]);
      }
    }
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) {
      float* yq = y + q * n + o + 32 * c;
      _mm512_mask_storeu_ps(yq, Mask(o1 - o - 32 * c), _mm512_permutex2var_ps(even[q][c], lo_idx, odd[q][c]));
      _mm512_mask_storeu_ps(yq + 16, Mask(o1 - o - 32 * c - 16),
                            _mm512_permutex2var_ps(even[q][c], hi_idx, odd[q][c]));
    }
}

template <typename T, int M>
void DenseBlock(const float* x, int64_t k, const T* w, int64_t n, int64_t o, int64_t o1, float* y) {
  if constexpr (std::is_same_v<T, uint16_t>)
    DenseBlockBf16<M, DenseCols(M) / 32>(x, k, w, n, o, o1, y);
  else
    DenseBlockF32<M, DenseCols(M) / 16>(x, k, w, n, o, o1, y);
}

template <typename T, int M>
void DenseStream(const float* x, int64_t k, const T* w, int64_t n, int64_t o0, int64_t o1, float* y) {
  for (int q = 0; q < M; ++q) std::fill(y + q * n + o0, y + q * n + o1, 0.f);
  for (int64_t i = 0; i < k; ++i) {
    const T* wr = w + i * n;
    __m512 xb[M];
    for (int q = 0; q < M; ++q) xb[q] = _mm512_set1_ps(x[q * k + i]);
    for (int64_t o = o0; o < o1; o += 16) {
      const __mmask16 m = Mask(o1 - o);
      const __m512 wv = Load16(wr + o, m);
      for (int q = 0; q < M; ++q) {
        float* yq = y + q * n + o;
        _mm512_mask_storeu_ps(yq, m, _mm512_fmadd_ps(xb[q], wv, _mm512_maskz_loadu_ps(m, yq)));
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 and FMA without AVX-512 (8-lane vectors, 16 registers): the same sums in register tiles of M rows x V vectors,
// V = 8 / M rounded to 8, 4, 2, 2 (eight independent accumulators where the rows allow), the k loop innermost; the
// columns of a block past its last whole vector by the scalar loop (the same fused sums). Before this path such a
// machine took the scalar loops, whose accumulators the compiler kept in memory.
inline __m256 Load8W(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8W(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T, int M>
void DenseTail(const float* x, int64_t k, const T* w, int64_t n, int64_t o, int64_t o1, float* y) {
  for (int q = 0; q < M; ++q)
    for (int64_t j = o; j < o1; ++j) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc = __builtin_fmaf(x[q * k + i], ToFloat(w[i * n + j]), acc);
      y[q * n + j] = acc;
    }
}

template <typename T, int M, int V>
void DenseTile8(const float* x, int64_t k, const T* w, int64_t n, int64_t o, float* y) {
  __m256 acc[M][V];
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) acc[q][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const T* wr = w + i * n + o;
    __m256 xb[M];
    for (int q = 0; q < M; ++q) xb[q] = _mm256_set1_ps(x[q * k + i]);
    for (int c = 0; c < V; ++c) {
      const __m256 wv = Load8W(wr + 8 * c);
      for (int q = 0; q < M; ++q) acc[q][c] = _mm256_fmadd_ps(xb[q], wv, acc[q][c]);
    }
  }
  for (int q = 0; q < M; ++q)
    for (int c = 0; c < V; ++c) _mm256_storeu_ps(y + q * n + o + 8 * c, acc[q][c]);
}

template <typename T, int M>
void DenseBlock(const float* x, int64_t k, const T* w, int64_t n, int64_t o, int64_t o1, float* y) {
  constexpr int V = M == 1 ? 8 : (M == 2 ? 4 : 2);
  const int64_t end = std::min<int64_t>(o + DenseCols(M), o1);
  int64_t c = o;
  for (; c + 8 * V <= end; c += 8 * V) DenseTile8<T, M, V>(x, k, w, n, c, y);
  for (; c + 8 <= end; c += 8) DenseTile8<T, M, 1>(x, k, w, n, c, y);
  if (c < end) DenseTail<T, M>(x, k, w, n, c, end, y);
}

template <typename T, int M>
void DenseStream(const float* x, int64_t k, const T* w, int64_t n, int64_t o0, int64_t o1, float* y) {
  for (int q = 0; q < M; ++q) std::fill(y + q * n + o0, y + q * n + o1, 0.f);
  const int64_t whole = o0 + (o1 - o0) / 8 * 8;
  for (int64_t i = 0; i < k; ++i) {
    const T* wr = w + i * n;
    __m256 xb[M];
    for (int q = 0; q < M; ++q) xb[q] = _mm256_set1_ps(x[q * k + i]);
    for (int64_t o = o0; o < whole; o += 8) {
      const __m256 wv = Load8W(wr + o);
      for (int q = 0; q < M; ++q) {
        float* yq = y + q * n + o;
        _mm256_storeu_ps(yq, _mm256_fmadd_ps(xb[q], wv, _mm256_loadu_ps(yq)));
      }
    }
    for (int q = 0; q < M; ++q)
      for (int64_t j = whole; j < o1; ++j) y[q * n + j] = __builtin_fmaf(x[q * k + i], ToFloat(wr[j]), y[q * n + j]);
  }
}
#else
template <typename T, int M>
void DenseBlock(const float* x, int64_t k, const T* w, int64_t n, int64_t o, int64_t o1, float* y) {
  const int64_t cols = std::min<int64_t>(DenseCols(M), o1 - o);
  float acc[M][DenseCols(M)] = {};
  for (int64_t i = 0; i < k; ++i) {
    const T* wr = w + i * n + o;
    for (int q = 0; q < M; ++q) {
      const float xv = x[q * k + i];
      for (int64_t j = 0; j < cols; ++j) acc[q][j] = __builtin_fmaf(xv, ToFloat(wr[j]), acc[q][j]);
    }
  }
  for (int q = 0; q < M; ++q)
    for (int64_t j = 0; j < cols; ++j) y[q * n + o + j] = acc[q][j];
}

template <typename T, int M>
void DenseStream(const float* x, int64_t k, const T* w, int64_t n, int64_t o0, int64_t o1, float* y) {
  for (int q = 0; q < M; ++q) std::fill(y + q * n + o0, y + q * n + o1, 0.f);
  for (int64_t i = 0; i < k; ++i) {
    const T* wr = w + i * n;
    for (int q = 0; q < M; ++q) {
      const float xv = x[q * k + i];
      float* yq = y + q * n;
      for (int64_t j = o0; j < o1; ++j) yq[j] = __builtin_fmaf(xv, ToFloat(wr[j]), yq[j]);
    }
  }
}
#endif

// call(M, r) for the blocks of up to kDenseRows rows of [r0, r1): M the block's rows (a compile-time constant), r its
// first row.
template <typename F>
void RowBlocks(int64_t r0, int64_t r1, F&& call) {
  for (int64_t r = r0; r < r1; r += kDenseRows) {
    switch (std::min<int64_t>(kDenseRows, r1 - r)) {
      case 4: call(std::integral_constant<int, 4>(), r); break;
      case 3: call(std::integral_constant<int, 3>(), r); break;
      case 2: call(std::integral_constant<int, 2>(), r); break;
      default: call(std::integral_constant<int, 1>(), r); break;
    }
  }
}

// Rows [r0, r1) (one expert's run) times columns [o0, o1) of that expert's matrix w [K, N].
template <typename T>
void DenseRun(const float* x, const T* w, float* y, int64_t r0, int64_t r1, int64_t k, int64_t n, int64_t o0,
              int64_t o1) {
  if (k * n * int64_t(sizeof(T)) >= kStreamBytes) {
    RowBlocks(r0, r1, [&](auto m, int64_t r) {
      DenseStream<T, decltype(m)::value>(x + r * k, k, w, n, o0, o1, y + r * n);
    });
    return;
  }
  for (int64_t o = o0; o < o1; o += kDenseChunk) {  // a column chunk stays in cache for every row block
    const int64_t end = std::min(o1, o + kDenseChunk);
    RowBlocks(r0, r1, [&](auto m, int64_t r) {
      constexpr int64_t cols = DenseCols(decltype(m)::value);
      for (int64_t c = o; c < end; c += cols)
        DenseBlock<T, decltype(m)::value>(x + r * k, k, w, n, c, end, y + r * n);
    });
  }
}

// A call's work in items: a run of rows of one expert times a range of output columns (a multiple of 128 wide),
// spread over XLA's intra-op thread pool when the call is large enough to pay for it (`ParallelItems`). Every output
// element is computed by exactly one item: the same sums whatever the split.
struct DenseItem {
  int64_t r0, r1, e, o0, o1;
};

template <typename T>
void DenseItemRun(const DenseItem& it, const float* xp, const T* wp, float* yp, int64_t k, int64_t experts,
                  int64_t n) {
  if (it.e < 0 || it.e >= experts) {  // an out-of-range expert: NaN rows, never a stray read
    for (int64_t r = it.r0; r < it.r1; ++r)
      for (int64_t o = it.o0; o < it.o1; ++o) yp[r * n + o] = __builtin_nanf("");
    return;
  }
  DenseRun<T>(xp, wp + it.e * k * n, yp, it.r0, it.r1, k, n, it.o0, it.o1);
}

template <typename T>
ffi::Error DenseRows(const float* xp, const T* wp, const int32_t* ep, float* yp, int64_t rows, int64_t k,
                     int64_t experts, int64_t n, ffi::ThreadPool& pool) {
  const int64_t threads = rows * k * n >= kParallelMacs ? std::max<int64_t>(1, pool.num_threads()) : 1;
  std::vector<int64_t> starts;  // the runs of rows of one expert
  for (int64_t r = 0; r < rows; ++r)
    if (r == 0 || ep[r] != ep[r - 1]) starts.push_back(r);
  const int64_t runs = int64_t(starts.size());
  starts.push_back(rows);
  // whole runs per item where there are enough of them (each worker streams whole matrices in storage order);
  // column ranges only for fewer runs than twice the workers
  const int64_t blocks = (n + kDenseChunk - 1) / kDenseChunk;
  const int64_t parts = runs >= 2 * threads ? 1 : std::min(threads, blocks);
  auto items = std::make_unique<std::vector<DenseItem>>();
  for (int64_t i = 0; i < runs; ++i)
    for (int64_t p = 0; p < parts; ++p)
      items->push_back({starts[i], starts[i + 1], ep[starts[i]], std::min(n, blocks * p / parts * kDenseChunk),
                        std::min(n, blocks * (p + 1) / parts * kDenseChunk)});
  const std::vector<DenseItem>* list = items.get();
  ParallelItems(pool, threads, int64_t(items->size()), [list, xp, wp, yp, k, experts, n](int64_t i) {
    DenseItemRun<T>((*list)[i], xp, wp, yp, k, experts, n);
  });
  return ffi::Error::Success();
}

template <ffi::DataType D>
ffi::Error DenseImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<D> w, ffi::Buffer<ffi::S32> expert,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  auto xd = x.dimensions(), wd = w.dimensions(), ed = expert.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || ed.size() != 1 || ed[0] != xd[0])
    return ffi::Error::InvalidArgument("dense_rows: x [R, K], w [E, K, N], expert [R]");
  return DenseRows(x.typed_data(), w.typed_data(), expert.typed_data(), y->typed_data(), xd[0], xd[1], wd[0], wd[2],
                   pool);
}


// ---- DflashKvAttention: softmax attention of queries over each row's live keys in a [B, Hkv, S, D] cache ----
//
// out[b, t, h] = sum_s p[s] v[b, h / G, s],  p = softmax_s(scale * q[b, t, h] . k[b, h / G, s]) over the slots
// s < kv_lengths[b] (and, causal, s <= q_positions[b, t]; a window W: q - s < W, and without causality s - q < W),
// then the keys beside the cache that mask[b, t] shows (the draft's block); a sink logit per head (gpt-oss) joins the
// softmax's sum and reads no value; a query with no visible key gets zeros. Each query reads
// only its own row's visible slots, in order, whatever the other rows and queries of the call: a row's result does
// not depend on its batch or on the block it is verified in. Scores and sums in float32.

// exp's range reduction and polynomial on [-ln2/2, ln2/2] (about 1 ulp), shared by the AVX-512 and AVX2 paths:
// n = round(x log2 e), r = x - n ln2 (ln2 in two parts), exp(r) = 1 + r + r^2 (c5 + r (c4 + ... r c0)).
constexpr float kExpLo = -104.f, kExpHi = 88.5f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpC[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

#ifdef DFLASH_DENSE_AVX512
// exp on float32 lanes (`kExpC`); 2^n applied by scalef, which underflows to zero as the true value does.
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLo));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#ifdef DFLASH_DENSE_AVX512
// The lane sums of 16 vectors in one: element 4k + c is the sum of part[4c + k], each vector's lanes added by the
// same tree (lanes 8 apart, then 4, 2, 1) whichever of the 16 it is.
inline __m512 Sum16(const __m512* part) {
  __m512 w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * j], part[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(part[2 * j], part[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// out = inv * sum_s p[s] * value(s) over D = 16 V (or fewer) columns, the sums held in registers.
template <int V, typename F>
void WeightedSum(const float* p, int64_t total, F&& value, int64_t d, float inv, float* out) {
  __m512 acc[V];
  __mmask16 mk[V];
  for (int c = 0; c < V; ++c) {
    acc[c] = _mm512_setzero_ps();
    mk[c] = Mask(d - 16 * c);
  }
  for (int64_t s = 0; s < total; ++s) {
    const __m512 w = _mm512_set1_ps(p[s]);
    const float* vr = value(s);
    for (int c = 0; c < V; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mk[c], vr + 16 * c), acc[c]);
  }
  const __m512 scale = _mm512_set1_ps(inv);
  for (int c = 0; c < V; ++c) _mm512_mask_storeu_ps(out + 16 * c, mk[c], _mm512_mul_ps(acc[c], scale));
}

// One query over its keys: the cache's slots [0, stop) of `kh` / `vh` ([S, d]), then the `seen` beside-keys listed in
// `beside` (rows of `kx` / `vx`, `xstride` floats apart): scores, softmax and the weighted value sum into `out`; d at
// most 16 V. Each key's score is summed by the same operations wherever it falls, so a query's result depends only
// on its own keys.
template <int V>
void AttendQuery(const float* qv, const float* kh, const float* vh, int64_t stop, const float* kx, const float* vx,
                 const int64_t* beside, int64_t seen, int64_t xstride, int64_t d, float scale, float sink,
                 float* scores, float* out) {
  const int64_t total = stop + seen;
  __mmask16 mk[V];
  __m512 q[V];
  for (int c = 0; c < V; ++c) {
    mk[c] = Mask(d - 16 * c);
    q[c] = _mm512_maskz_loadu_ps(mk[c], qv + 16 * c);
  }
  auto dot = [&](const float* kr) {
    __m512 sum = _mm512_mul_ps(q[0], _mm512_maskz_loadu_ps(mk[0], kr));
    for (int c = 1; c < V; ++c) sum = _mm512_fmadd_ps(q[c], _mm512_maskz_loadu_ps(mk[c], kr + 16 * c), sum);
    return sum;
  };
  __m512 mv = _mm512_set1_ps(-INFINITY);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < total; s0 += 16) {  // 16 keys' scores at a time (`Sum16`'s order)
    __m512 part[16];
    if (s0 + 16 <= stop) {
      for (int m = 0; m < 16; ++m) part[m] = dot(kh + (s0 + 4 * (m % 4) + m / 4) * d);
    } else {
      for (int m = 0; m < 16; ++m) {
        const int64_t s = s0 + 4 * (m % 4) + m / 4;
        part[m] = s >= total ? _mm512_setzero_ps() : dot(s < stop ? kh + s * d : kx + beside[s - stop] * xstride);
      }
    }
    const __mmask16 live = Mask(total - s0);
    const __m512 x = _mm512_mul_ps(Sum16(part), sv);
    _mm512_mask_storeu_ps(scores + s0, live, x);
    mv = _mm512_mask_max_ps(mv, live, mv, x);
  }
  mv = _mm512_set1_ps(std::max(_mm512_reduce_max_ps(mv), sink));
  // a sink's probability counts in the sum and reads no value
  __m512 lsum = _mm512_maskz_mov_ps(__mmask16(sink == -INFINITY ? 0 : 1),
                                    Exp16(_mm512_sub_ps(_mm512_set1_ps(sink), mv)));
  for (int64_t s = 0; s < total; s += 16) {
    const __mmask16 live = Mask(total - s);
    const __m512 e = _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + s), mv)));
    _mm512_mask_storeu_ps(scores + s, live, e);
    lsum = _mm512_add_ps(lsum, e);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(lsum);
  WeightedSum<V>(scores, total, [&](int64_t s) { return s < stop ? vh + s * d : vx + beside[s - stop] * xstride; },
                 d, inv, out);
}
#endif

#if !defined(DFLASH_DENSE_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define DFLASH_ATTENTION_AVX2 1
// The same attention on 8-lane vectors (AVX2 and FMA, no AVX-512): a machine without AVX-512 took the scalar loops
// below, which run each score's products as one serial chain and call libm's exp per key, 2x - 7x slower than XLA's
// own attention at the shipped target's shapes.

// Lanes [0, have) on: a mask for maskload / maskstore (masked lanes are neither read nor written).
inline __m256i Mask8(int64_t have) {
  const int32_t n = int32_t(std::min<int64_t>(std::max<int64_t>(have, 0), 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp on float32 lanes (`kExpC`, as `Exp16`); 2^n applied in two halves, each a normal power of two, so a result
// below the smallest normal float underflows as the true value does.
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLo));
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-151, 128]
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

// The lane sums of 8 vectors in one: lane j is the sum of part[j]'s lanes, every vector's lanes added by the same
// tree ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) whichever of the 8 it is.
inline __m256 Sum8(const __m256* part) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(part[0], part[1]), _mm256_hadd_ps(part[2], part[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(part[4], part[5]), _mm256_hadd_ps(part[6], part[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float MaxLanes8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float SumLanes8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// 8 floats at p, lanes of `mask` only (Full: every lane, d a multiple of 8: a plain load, which costs less than a
// masked one on some cores).
template <bool Full>
inline __m256 Load8(const float* p, __m256i mask) {
  if constexpr (Full) return _mm256_loadu_ps(p);
  else return _mm256_maskload_ps(p, mask);
}

// One query over its keys, as the AVX-512 `AttendQuery`, 8 keys' scores at a time; d at most 8 V (Full: d = 8 V).
template <int V, bool Full>
void AttendQuery8(const float* qv, const float* kh, const float* vh, int64_t stop, const float* kx, const float* vx,
                  const int64_t* beside, int64_t seen, int64_t xstride, int64_t d, float scale, float sink,
                  float* scores, float* out) {
  const int64_t total = stop + seen;
  __m256i mk[V];
  __m256 q[V];
  for (int c = 0; c < V; ++c) {
    mk[c] = Mask8(d - 8 * c);
    q[c] = Load8<Full>(qv + 8 * c, mk[c]);
  }
  auto dot = [&](const float* kr) {
    __m256 sum = _mm256_mul_ps(q[0], Load8<Full>(kr, mk[0]));
    for (int c = 1; c < V; ++c) sum = _mm256_fmadd_ps(q[c], Load8<Full>(kr + 8 * c, mk[c]), sum);
    return sum;
  };
  __m256 mv = _mm256_set1_ps(-INFINITY);
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t s0 = 0; s0 < total; s0 += 8) {
    __m256 part[8];
    if (s0 + 8 <= stop) {
      for (int m = 0; m < 8; ++m) part[m] = dot(kh + (s0 + m) * d);
    } else {
      for (int m = 0; m < 8; ++m) {
        const int64_t s = s0 + m;
        part[m] = s >= total ? _mm256_setzero_ps() : dot(s < stop ? kh + s * d : kx + beside[s - stop] * xstride);
      }
    }
    const __m256i live = Mask8(total - s0);
    const __m256 x = _mm256_mul_ps(Sum8(part), sv);
    _mm256_storeu_ps(scores + s0, x);  // `scores` has room for the tail's lanes, never read
    mv = _mm256_blendv_ps(mv, _mm256_max_ps(mv, x), _mm256_castsi256_ps(live));
  }
  const float mx = std::max(MaxLanes8(mv), sink);
  const __m256 mb = _mm256_set1_ps(mx);
  // a sink's probability counts in the sum and reads no value
  __m256 lsum = _mm256_blendv_ps(_mm256_setzero_ps(), Exp8(_mm256_sub_ps(_mm256_set1_ps(sink), mb)),
                                 _mm256_castsi256_ps(Mask8(sink == -INFINITY ? 0 : 1)));
  for (int64_t s = 0; s < total; s += 8) {
    const __m256i live = Mask8(total - s);
    const __m256 e = _mm256_and_ps(Exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), mb)), _mm256_castsi256_ps(live));
    _mm256_storeu_ps(scores + s, e);
    lsum = _mm256_add_ps(lsum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / SumLanes8(lsum));
  __m256 acc[V];
  for (int c = 0; c < V; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < total; ++s) {
    const __m256 w = _mm256_set1_ps(scores[s]);
    const float* vr = s < stop ? vh + s * d : vx + beside[s - stop] * xstride;
    for (int c = 0; c < V; ++c) acc[c] = _mm256_fmadd_ps(w, Load8<Full>(vr + 8 * c, mk[c]), acc[c]);
  }
  for (int c = 0; c < V; ++c) {
    if constexpr (Full) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
    else _mm256_maskstore_ps(out + 8 * c, mk[c], _mm256_mul_ps(acc[c], inv));
  }
}
#endif

struct Attention {
  const float *q, *k, *v;              // [B, T, Hq, D], [B, Hkv, S, D] x 2
  const int32_t *positions, *lengths;  // [B, T], [B]
  const float *kx, *vx;                // keys beside the cache: [B, X, Hkv, D] x 2
  const int32_t* mask;                 // [B, T, X]: may query t see beside-key x
  const float* sinks;                  // [Hq] logits, or null
  float* out;                          // [B, T, Hq, D]
  int64_t b, t, hq, hkv, s, d, x, window;  // window 0: none
  float scale;
  bool causal;
};

// One (row, kv head): every query of its group at every block position. `scores` holds S + X floats, `beside` X.
void AttendHead(const Attention& a, int64_t row, int64_t head, float* scores, int64_t* beside, float* acc) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  const int64_t live = std::min<int64_t>(std::max<int32_t>(a.lengths[row], 0), a.s);
  const float* kh = a.k + (row * a.hkv + head) * a.s * d;
  const float* vh = a.v + (row * a.hkv + head) * a.s * d;
  for (int64_t t = 0; t < a.t; ++t) {
    const int64_t pos = a.positions[row * a.t + t];
    int64_t stop = live, first = 0;  // the visible cache slots: [first, stop)
    if (a.causal) stop = std::min<int64_t>(stop, std::max<int64_t>(pos + 1, 0));
    if (a.window > 0) {  // q - k < W, and without causality k - q < W
      first = std::max<int64_t>(pos - a.window + 1, 0);
      if (!a.causal) stop = std::min<int64_t>(stop, std::max<int64_t>(pos + a.window, 0));
    }
    stop = std::max(stop - first, int64_t(0));
    const float* kw = kh + first * d;
    const float* vw = vh + first * d;
    int64_t seen = 0;  // the beside-keys this query sees, in order
    for (int64_t x = 0; x < a.x; ++x)
      if (a.mask[(row * a.t + t) * a.x + x]) beside[seen++] = x;
    const int64_t total = stop + seen;
    for (int64_t j = 0; j < g; ++j) {
      const int64_t offset = ((row * a.t + t) * a.hq + head * g + j) * d;
      const float* qv = a.q + offset;
      float* ov = a.out + offset;
      if (total <= 0) {
        std::fill(ov, ov + d, 0.f);
        continue;
      }
      const float sink = a.sinks == nullptr ? -INFINITY : a.sinks[head * g + j];
#ifdef DFLASH_DENSE_AVX512
      const float* kx = a.kx + (row * a.x * a.hkv + head) * d;
      const float* vx = a.vx + (row * a.x * a.hkv + head) * d;
      const int64_t xs = a.hkv * d;
      switch ((d + 15) / 16) {
        case 1: AttendQuery<1>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 2: AttendQuery<2>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 3: AttendQuery<3>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 4: AttendQuery<4>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 5: AttendQuery<5>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 6: AttendQuery<6>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 7: AttendQuery<7>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        case 8: AttendQuery<8>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); continue;
        default: break;  // heads wider than 128: the loops below
      }
#elif defined(DFLASH_ATTENTION_AVX2)
      {
        const float* kx = a.kx + (row * a.x * a.hkv + head) * d;
        const float* vx = a.vx + (row * a.x * a.hkv + head) * d;
        const int64_t xs = a.hkv * d;
        bool done = true;
        switch ((d + 7) / 8) {
#define DFLASH_ATTEND8(V)                                                                                \
  case V:                                                                                                \
    if (d == 8 * V) AttendQuery8<V, true>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov); \
    else AttendQuery8<V, false>(qv, kw, vw, stop, kx, vx, beside, seen, xs, d, a.scale, sink, scores, ov);         \
    break;
          DFLASH_ATTEND8(1) DFLASH_ATTEND8(2) DFLASH_ATTEND8(3) DFLASH_ATTEND8(4) DFLASH_ATTEND8(5) DFLASH_ATTEND8(6)
          DFLASH_ATTEND8(7) DFLASH_ATTEND8(8) DFLASH_ATTEND8(9) DFLASH_ATTEND8(10) DFLASH_ATTEND8(11)
          DFLASH_ATTEND8(12) DFLASH_ATTEND8(13) DFLASH_ATTEND8(14) DFLASH_ATTEND8(15) DFLASH_ATTEND8(16)
#undef DFLASH_ATTEND8
          default: done = false;  // heads wider than 128: the loops below
        }
        if (done) continue;
      }
#endif
      float m = -INFINITY;
      for (int64_t s = 0; s < total; ++s) {
        const float* kr = s < stop ? kw + s * d : a.kx + ((row * a.x + beside[s - stop]) * a.hkv + head) * d;
        float x = 0.f;
        for (int64_t c = 0; c < d; ++c) x = __builtin_fmaf(qv[c], kr[c], x);
        scores[s] = x * a.scale;
        m = std::max(m, scores[s]);
      }
      m = std::max(m, sink);
      float l = sink == -INFINITY ? 0.f : std::exp(sink - m);
      for (int64_t s = 0; s < total; ++s) {
        scores[s] = std::exp(scores[s] - m);
        l += scores[s];
      }
      std::fill(acc, acc + d, 0.f);
      for (int64_t s = 0; s < total; ++s) {
        const float* vr = s < stop ? vw + s * d : a.vx + ((row * a.x + beside[s - stop]) * a.hkv + head) * d;
        for (int64_t c = 0; c < d; ++c) acc[c] = __builtin_fmaf(scores[s], vr[c], acc[c]);
      }
      for (int64_t c = 0; c < d; ++c) ov[c] = acc[c] / l;
    }
  }
}

ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> kx,
                         ffi::Buffer<ffi::F32> vx, ffi::Buffer<ffi::S32> mask, ffi::Buffer<ffi::F32> sinks,
                         ffi::ResultBuffer<ffi::F32> out, float scale, bool causal, int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = positions.dimensions(),
       ld = lengths.dimensions(), xd = kx.dimensions(), yd = vx.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2 || ld.size() != 1 || kd[0] < qd[0] ||
      kd[3] != qd[3] || kd[1] == 0 || qd[2] % kd[1] != 0 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || pd[0] != qd[0] || pd[1] != qd[1] || ld[0] != qd[0] || xd.size() != 4 || yd.size() != 4 ||
      md.size() != 3 || xd[0] != qd[0] || xd[2] != kd[1] || xd[3] != qd[3] || yd[0] != xd[0] || yd[1] != xd[1] ||
      yd[2] != xd[2] || yd[3] != xd[3] || md[0] != qd[0] || md[1] != qd[1] || md[2] != xd[1] ||
      sinks.dimensions().size() != 1 || (sinks.element_count() != 0 && sinks.element_count() != qd[2]) || window < 0)
    return ffi::Error::InvalidArgument(
        "kv_attention: q [B, T, Hq, D], k and v [B' >= B, Hkv, S, D] (Hq a multiple of Hkv), positions [B, T], "
        "lengths [B], "
        "beside-keys and values [B, X, Hkv, D], mask [B, T, X], sinks [Hq] or [0], window >= 0");
  Attention a{q.typed_data(), k.typed_data(), v.typed_data(), positions.typed_data(), lengths.typed_data(),
              kx.typed_data(), vx.typed_data(), mask.typed_data(),
              sinks.element_count() ? sinks.typed_data() : nullptr, out->typed_data(), qd[0], qd[1], qd[2], kd[1],
              kd[2], kd[3], xd[1], window, scale, causal};
  std::vector<float> scores(a.s + a.x + 16), acc(a.d + 16);
  std::vector<int64_t> beside(a.x + 1);
  for (int64_t row = 0; row < a.b; ++row)
    for (int64_t head = 0; head < a.hkv; ++head) AttendHead(a, row, head, scores.data(), beside.data(), acc.data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashMxfp4Rows, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());

// one handler per table dtype: x f32 [R, K], w [E, K, N], expert s32 [R] -> y f32 [R, N]
#define DFLASH_DENSE_ROWS_HANDLER(name, dtype)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DenseImpl<dtype>,                                               \
                                ffi::Ffi::Bind()                                                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                     \
                                    .Arg<ffi::Buffer<dtype>>()                                        \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                     \
                                    .Ret<ffi::Buffer<ffi::F32>>()                                     \
                                    .Ctx<ffi::ThreadPool>());

DFLASH_DENSE_ROWS_HANDLER(DflashDenseRows, ffi::F32)
DFLASH_DENSE_ROWS_HANDLER(DflashDenseRowsBf16, ffi::BF16)

// q f32 [B, T, Hq, D], k and v f32 [B' >= B, Hkv, S, D] (rows past B unread), positions s32 [B, T], lengths s32 [B],
// beside-keys and values f32 [B, X, Hkv, D], mask s32 [B, T, X], sinks f32 [Hq] or [0]; scale, causal, window (0: none)
// -> f32 [B, T, Hq, D]
XLA_FFI_DEFINE_HANDLER_SYMBOL(DflashKvAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));
