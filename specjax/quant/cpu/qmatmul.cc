// y[m, n] = sum_k x[m, k] * w[n, k] with w kept quantized: an XLA FFI custom call for the CPU.
//
// Weights are output-major [N, K] in groups of G consecutive k (specjax/quant/cpu_kernel.py has the format):
//   bits 8:  int8 values [N, K];
//   bits 4:  uint8 [N, K / 2]; the group starting at k0 is G / 2 bytes, byte j holding k0 + j in its low nibble and
//            k0 + j + G / 2 in its high nibble; v = nibble - offset;
//   bits 32: float32 weights [N, K] (no scales; group = K);
// w[n, k] = scales[n, k / G] * v[n, k] - mins[n, k / G] (mins optional).
//
// Numerics: y[m, n] depends on x[m] and w[n] alone, never on M, the other rows or the thread split. For each
// (m, n), L lanes (16 with AVX-512, 8 with AVX2, 1 otherwise) accumulate x * w by fused multiply-add over the
// chunks of each group in group order (for 4 bits: a chunk's low nibbles, then its high ones); the lanes are summed
// in a fixed tree at the end. Row and channel tiles only decide which registers hold an accumulator.
//
// Threads: channel blocks are shared out over XLA:CPU's own intra-op thread pool (the FFI ThreadPool context);
// the calling thread works too, so a pool that runs tasks late or inline still finishes.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECJAX_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECJAX_AVX2 1
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(SPECJAX_AVX512)
struct Vec {
  static constexpr int L = 16;
  static constexpr const char* kIsa = "avx512";
  using F = __m512;
  static __mmask16 Mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float a) { return _mm512_set1_ps(a); }
  static F Load(const float* p, int n) { return n == L ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(Mask(n), p); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Fms(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F Int8(const int8_t* p, int n) {
    __m128i b = n == L ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(Mask(n), p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static void Nibbles(const uint8_t* p, int n, int offset, F& lo, F& hi) {
    __m128i b = n == L ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(Mask(n), p);
    __m512i u = _mm512_cvtepu8_epi32(b), off = _mm512_set1_epi32(offset), low = _mm512_set1_epi32(15);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(u, low), off));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(u, 4), off));
  }
  static float Sum(F a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
};
#elif defined(SPECJAX_AVX2)
struct Vec {
  static constexpr int L = 8;
  static constexpr const char* kIsa = "avx2";
  using F = __m256;
  static __m256i Mask(int n) {
    alignas(32) static const int32_t kOnes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kOnes + 8 - n));
  }
  static __m128i Bytes(const void* p, int n) {
    if (n == L) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    int64_t b = 0;
    std::memcpy(&b, p, n);
    return _mm_cvtsi64_si128(b);
  }
  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float a) { return _mm256_set1_ps(a); }
  static F Load(const float* p, int n) { return n == L ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, Mask(n)); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Fms(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F Int8(const int8_t* p, int n) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(Bytes(p, n))); }
  static void Nibbles(const uint8_t* p, int n, int offset, F& lo, F& hi) {
    __m256i u = _mm256_cvtepu8_epi32(Bytes(p, n)), off = _mm256_set1_epi32(offset), low = _mm256_set1_epi32(15);
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(u, low), off));
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(u, 4), off));
  }
  static float Sum(F a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
};
#else
struct Vec {
  static constexpr int L = 1;
  static constexpr const char* kIsa = "scalar";
  using F = float;
  static F Zero() { return 0.0f; }
  static F Set1(float a) { return a; }
  static F Load(const float* p, int) { return *p; }
  static F Fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F Mul(F a, F b) { return a * b; }
  static F Fms(F a, F b, F c) { return std::fma(a, b, -c); }
  static F Int8(const int8_t* p, int) { return static_cast<float>(*p); }
  static void Nibbles(const uint8_t* p, int, int offset, F& lo, F& hi) {
    lo = static_cast<float>((*p & 15) - offset);
    hi = static_cast<float>((*p >> 4) - offset);
  }
  static float Sum(F a) { return a; }
};
#endif

using F = Vec::F;
constexpr int L = Vec::L;

struct Problem {
  const float* x;  // [M, K]
  const void* values;  // [N, K] int8 | [N, K / 2] uint8 | [N, K] float32
  const float* scales;  // [N, K / G]
  const float* mins;  // [N, K / G] or null
  float* y;  // [M, N]
  int64_t m, k, n, group;
  int offset;
};

// Channels per tile for MT rows: MT * NB accumulators + the decoded weights fit the 32 vector registers.
constexpr int ChannelsPerTile(int mt) { return mt == 1 ? 8 : mt == 2 ? 6 : mt <= 4 ? 4 : mt <= 6 ? 3 : 2; }

template <bool kMins>
F Dequant(F v, F s, F mn) {
  if constexpr (kMins) {
    return Vec::Fms(v, s, mn);
  } else {
    return Vec::Mul(v, s);
  }
}

// Rows [m0, m0 + MT) x channels [n0, n0 + NB) of y.
template <int kBits, bool kMins, int MT, int NB>
void Tile(const Problem& p, int64_t m0, int64_t n0) {
  const int64_t K = p.k, G = p.group, groups = K / G;
  const float* x = p.x + m0 * K;
  F acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = Vec::Zero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G;
    F s[NB], mn[NB];
    for (int j = 0; j < NB; ++j) {
      s[j] = Vec::Set1(kBits == 32 ? 1.0f : p.scales[(n0 + j) * groups + g]);
      mn[j] = Vec::Set1(kMins ? p.mins[(n0 + j) * groups + g] : 0.0f);
    }
    if constexpr (kBits == 4) {
      const int64_t half = G / 2;
      const uint8_t* v = static_cast<const uint8_t*>(p.values) + (n0 * K + k0) / 2;
      for (int64_t c = 0; c < half; c += L) {
        const int cnt = static_cast<int>(std::min<int64_t>(L, half - c));
        F lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          Vec::Nibbles(v + j * K / 2 + c, cnt, p.offset, lo[j], hi[j]);
          lo[j] = Dequant<kMins>(lo[j], s[j], mn[j]);
          hi[j] = Dequant<kMins>(hi[j], s[j], mn[j]);
        }
        for (int m = 0; m < MT; ++m) {
          F xl = Vec::Load(x + m * K + k0 + c, cnt);
          for (int j = 0; j < NB; ++j) acc[m][j] = Vec::Fma(xl, lo[j], acc[m][j]);
          F xh = Vec::Load(x + m * K + k0 + half + c, cnt);
          for (int j = 0; j < NB; ++j) acc[m][j] = Vec::Fma(xh, hi[j], acc[m][j]);
        }
      }
    } else {
      for (int64_t c = 0; c < G; c += L) {
        const int cnt = static_cast<int>(std::min<int64_t>(L, G - c));
        F w[NB];
        for (int j = 0; j < NB; ++j) {
          const int64_t at = (n0 + j) * K + k0 + c;
          if constexpr (kBits == 8) {
            w[j] = Dequant<kMins>(Vec::Int8(static_cast<const int8_t*>(p.values) + at, cnt), s[j], mn[j]);
          } else {
            w[j] = Vec::Load(static_cast<const float*>(p.values) + at, cnt);
          }
        }
        for (int m = 0; m < MT; ++m) {
          F xv = Vec::Load(x + m * K + k0 + c, cnt);
          for (int j = 0; j < NB; ++j) acc[m][j] = Vec::Fma(xv, w[j], acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) p.y[(m0 + m) * p.n + n0 + j] = Vec::Sum(acc[m][j]);
}

template <int kBits, bool kMins, int MT>
void Rows(const Problem& p, int64_t m0, int64_t na, int64_t nb) {
  constexpr int NB = ChannelsPerTile(MT);
  int64_t n = na;
  for (; n + NB <= nb; n += NB) Tile<kBits, kMins, MT, NB>(p, m0, n);
  for (; n < nb; ++n) Tile<kBits, kMins, MT, 1>(p, m0, n);
}

// All rows of y for channels [na, nb), in row tiles of up to 8.
template <int kBits, bool kMins>
void Channels(const Problem& p, int64_t na, int64_t nb) {
  for (int64_t m0 = 0; m0 < p.m; m0 += 8) {
    switch (std::min<int64_t>(8, p.m - m0)) {
      case 1: Rows<kBits, kMins, 1>(p, m0, na, nb); break;
      case 2: Rows<kBits, kMins, 2>(p, m0, na, nb); break;
      case 3: Rows<kBits, kMins, 3>(p, m0, na, nb); break;
      case 4: Rows<kBits, kMins, 4>(p, m0, na, nb); break;
      case 5: Rows<kBits, kMins, 5>(p, m0, na, nb); break;
      case 6: Rows<kBits, kMins, 6>(p, m0, na, nb); break;
      case 7: Rows<kBits, kMins, 7>(p, m0, na, nb); break;
      default: Rows<kBits, kMins, 8>(p, m0, na, nb); break;
    }
  }
}

using ChannelsFn = void (*)(const Problem&, int64_t, int64_t);

ChannelsFn Select(int64_t bits, bool mins) {
  if (bits == 8) return mins ? Channels<8, true> : Channels<8, false>;
  if (bits == 4) return mins ? Channels<4, true> : Channels<4, false>;
  return Channels<32, false>;
}

struct Job {
  std::atomic<int64_t> next{0}, done{0};
  int64_t tasks = 0;
  std::function<void(int64_t)> run;
  void Work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      run(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

int64_t Threads(ffi::ThreadPool& pool) {
  if (const char* env = std::getenv("SPECJAX_QMATMUL_THREADS")) return std::max(1, std::atoi(env));
  return std::max<int64_t>(1, pool.num_threads());
}

// Runs run(0 .. tasks - 1) on the calling thread and up to threads - 1 pool threads; returns when all are done.
// A helper that starts after the work is shared out only reads the job, which it co-owns.
void ParallelFor(ffi::ThreadPool& pool, int64_t threads, int64_t tasks, std::function<void(int64_t)> run) {
  auto job = std::make_shared<Job>();
  job->tasks = tasks;
  job->run = std::move(run);
  for (int64_t i = 1; i < std::min(threads, tasks); ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

ffi::Error Qmatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::Buffer<ffi::F32> scales,
                   ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group,
                   int64_t offset, bool has_mins) {
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("qmatmul: x, values, scales and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = vd[0];
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : bits == 4 ? ffi::DataType::U8 : ffi::DataType::F32;
  if (bits != 8 && bits != 4 && bits != 32) return ffi::Error::InvalidArgument("qmatmul: bits must be 4, 8 or 32");
  if (values.element_type() != want) return ffi::Error::InvalidArgument("qmatmul: values have the wrong dtype");
  if (bits == 32) group = K;
  if (group <= 0 || group % 2 || K % group) return ffi::Error::InvalidArgument("qmatmul: K must be a multiple of G");
  if (vd[1] != (bits == 4 ? K / 2 : K)) return ffi::Error::InvalidArgument("qmatmul: values do not match K");
  if (bits != 32 && (sd[0] != N || sd[1] != K / group))
    return ffi::Error::InvalidArgument("qmatmul: scales must be [N, K / G]");
  if (has_mins && (mins.dimensions().size() != 2 || mins.dimensions()[0] != N || mins.dimensions()[1] != K / group))
    return ffi::Error::InvalidArgument("qmatmul: mins must be [N, K / G]");
  if (yd[0] != M || yd[1] != N) return ffi::Error::InvalidArgument("qmatmul: y must be [M, N]");
  if (M == 0 || N == 0) return ffi::Error::Success();

  const Problem p{x.typed_data(), values.untyped_data(), scales.typed_data(), has_mins ? mins.typed_data() : nullptr,
                  y->typed_data(), M, K, N, group, static_cast<int>(offset)};
  const ChannelsFn fn = Select(bits, has_mins && bits != 32);
  // Blocks of 120 channels (a multiple of every tile width); one thread for small problems.
  constexpr int64_t kBlock = 120;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t threads = M * N * K < (1 << 18) ? 1 : Threads(pool);
  if (threads == 1) {
    fn(p, 0, N);
  } else {
    ParallelFor(pool, threads, blocks, [&p, fn, N](int64_t b) { fn(p, b * kBlock, std::min(N, (b + 1) * kBlock)); });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQmatmul, Qmatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // values
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N, K / G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins [N, K / G] (any shape when absent)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("offset")
                                  .Attr<bool>("has_mins"));

extern "C" const char* SpecjaxQmatmulIsa() { return Vec::kIsa; }
