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
// Act int8 (attribute act_bits = 8; bits 4 or 8): each row x[m] is quantized once per call, in blocks of B inputs,
// B = 32 where 32 divides G, else 16 where 16 does, else G (so a block never straddles a group):
//   s_x[m, b] = max_{k in b} |x[m, k]| / 127 (float32);  q[m, k] = nearbyint(x[m, k] / s_x) (half to even; x / 1
//   where s_x = 0), clamped to [-127, 127];  qsum[m, b] = sum_{k in b} q[m, k];
//   idot[m, n, b] = sum_{k in b} q[m, k] * v[n, k], exact in int32 (v = the stored int8, or nibble - offset);
// then in float32, every step rounded on its own (no fused multiply-add: built with -ffp-contract=off):
//   xs[m, g] = 0; for b in g, in order: xs = xs + s_x[m, b] * float(qsum[m, b])     (the quantized bsums)
//   acc = 0; for g = 0 .. K / G - 1:
//     d = 0; for b in g, in order: d = d + s_x[m, b] * float(idot[m, n, b])
//     acc = acc + scales[n, g] * d;  with mins: acc = acc - mins[n, g] * xs[m, g]
//   y[m, n] = acc.
// The integer sums are exact however they are formed, so every build (AVX-512 VNNI, AVX2, scalar) and every tile
// gives the same bits, and specjax.quant.cpu_kernel.qmatmul_act8_reference reproduces them in numpy. The VNNI tiles
// (int8 with B = 16 or 32; int4 with G = 32 or a multiple of 64) take 16 channels at a time: their weight bytes are
// transposed 4 at a time so that lane j holds channel j, then vpdpbusd multiplies unsigned weight bytes (int8 v as
// v ^ 0x80 = v + 128; int4 nibbles u = v + offset) by q broadcast, and the block's idot is that sum minus 128 (or
// offset) times qsum[m, b]. Other channels and formats go one (m, n) at a time (AVX2: vpmaddubsw on |v| and
// q * sign(v); else scalar).
//
// SpecjaxQmatmulRows (routed experts): values, scales and mins carry a leading expert axis E and each row m names
// its matrix ids[m]; the rows of each expert are gathered into one problem of the kind above, so every y[m, n] has
// the bits a one-row product with that expert gives.
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
#include <vector>

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

// ------------------------------------------------------------------------------------------------ act int8
// Activations quantized per block of B inputs (B = ActBlock(G)); see the file comment for the arithmetic.

int64_t ActBlock(int64_t group) { return group % 32 == 0 ? 32 : group % 16 == 0 ? 16 : group; }

struct Act {
  int64_t block = 0, blocks = 0;  // B, K / B
  std::vector<int8_t> q;  // [M, K] (+ 64 bytes of slack)
  std::vector<float> sx;  // [M, K / B]
  std::vector<int32_t> qsum;  // [M, K / B]
  std::vector<int32_t> cq;  // [M, K / B]: qsum times the weight bytes' offset (128 for int8, else `offset`)
  std::vector<float> xs;  // [M, K / G]: sum_k s_x q over each group
};

// mutant 1 (tests only): one scale per block for all rows, the largest |x| among them (a row's bits depend on M).
void QuantizeRows(const Problem& p, int64_t bits, int mutant, Act& a) {
  const int64_t M = p.m, K = p.k, B = ActBlock(p.group), nb = K / B, G = p.group, groups = K / G;
  a.block = B;
  a.blocks = nb;
  a.q.assign(M * K + 64, 0);
  a.sx.assign(M * nb, 0.0f);
  a.qsum.assign(M * nb, 0);
  a.cq.assign(M * nb, 0);
  a.xs.assign(M * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = p.x + m * K + b * B;
      float amax = 0.0f;
      for (int64_t r = mutant == 1 ? 0 : m; r < (mutant == 1 ? M : m + 1); ++r)
        for (int64_t i = 0; i < B; ++i) amax = std::max(amax, std::fabs(p.x[r * K + b * B + i]));
      const float s = amax / 127.0f, div = s == 0.0f ? 1.0f : s;
      int32_t sum = 0;
      for (int64_t i = 0; i < B; ++i) {
        const float v = std::nearbyint(x[i] / div);
        const int32_t qi = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
        a.q[m * K + b * B + i] = static_cast<int8_t>(qi);
        sum += qi;
      }
      a.sx[m * nb + b] = s;
      a.qsum[m * nb + b] = sum;
      a.cq[m * nb + b] = sum * (bits == 8 ? 128 : p.offset);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float xs = 0.0f;
      for (int64_t b = g * (G / B); b < (g + 1) * (G / B); ++b)
        xs = xs + a.sx[m * nb + b] * static_cast<float>(a.qsum[m * nb + b]);
      a.xs[m * groups + g] = xs;
    }
  }
}

// sum over block b of q[m, k] * v[n, k], exactly (v signed: nibble - offset for 4 bits).
template <int kBits>
int32_t BlockDot(const Problem& p, const Act& a, int64_t m, int64_t n, int64_t b) {
  const int64_t K = p.k, G = p.group, B = a.block, k = b * B;
  const int8_t* q = a.q.data() + m * K + k;
  int32_t s = 0;
  if constexpr (kBits == 8) {
    const int8_t* v = static_cast<const int8_t*>(p.values) + n * K + k;
    int64_t i = 0;
#if defined(SPECJAX_AVX512) || defined(SPECJAX_AVX2)
    // maddubs (u8 x s8 pairs to int16): |v| <= 128 times q * sign(v), |q| <= 127, so a pair never saturates.
    __m256i acc = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (; i + 32 <= B; i += 32) {
      const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
      const __m256i qq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
      const __m256i pr = _mm256_maddubs_epi16(_mm256_abs_epi8(vv), _mm256_sign_epi8(qq, vv));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pr, ones));
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    for (int j = 0; j < 8; ++j) s += lanes[j];
#endif
    for (; i < B; ++i) s += static_cast<int32_t>(q[i]) * v[i];
  } else {
    const int64_t k0 = k / G * G, half = G / 2;
    const uint8_t* w = static_cast<const uint8_t*>(p.values) + (n * K + k0) / 2;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t j = k + i - k0;
      const int u = j < half ? (w[j] & 15) : (w[j - half] >> 4);
      s += static_cast<int32_t>(q[i]) * (u - p.offset);
    }
  }
  return s;
}

// Any build, any group: channels [na, nb) of every row, one (m, n) at a time, in the fixed float order.
template <int kBits, bool kMins>
void ActGeneric(const Problem& p, const Act& a, int64_t na, int64_t nb) {
  const int64_t G = p.group, groups = p.k / G, per = G / a.block;
  for (int64_t n = na; n < nb; ++n)
    for (int64_t m = 0; m < p.m; ++m) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float d = 0.0f;
        for (int64_t b = g * per; b < (g + 1) * per; ++b)
          d = d + a.sx[m * a.blocks + b] * static_cast<float>(BlockDot<kBits>(p, a, m, n, b));
        acc = acc + p.scales[n * groups + g] * d;
        if constexpr (kMins) acc = acc - p.mins[n * groups + g] * a.xs[m * groups + g];
      }
      p.y[m * p.n + n] = acc;
    }
}

#if defined(SPECJAX_AVX512) && defined(__AVX512VNNI__)
#define SPECJAX_VNNI 1

// t[l] lane j = the int32 at p + j * stride + 4 l, for 16 channels j (P = 8: 32 bytes each; P = 4: 16 bytes).
template <int P>
inline void Transpose(const uint8_t* p, int64_t stride, __m512i* t) {
  if constexpr (P == 8) {
    __m512i z[8], a[8], b[8];
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * stride))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (i + 8) * stride)), 1);
    for (int i = 0; i < 8; i += 2) {
      a[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
      a[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
      b[h] = _mm512_unpacklo_epi64(a[h], a[h + 2]);
      b[h + 1] = _mm512_unpackhi_epi64(a[h], a[h + 2]);
      b[h + 2] = _mm512_unpacklo_epi64(a[h + 1], a[h + 3]);
      b[h + 3] = _mm512_unpackhi_epi64(a[h + 1], a[h + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int l = 0; l < 4; ++l) {
      t[l] = _mm512_permutex2var_epi64(b[l], lo, b[l + 4]);
      t[l + 4] = _mm512_permutex2var_epi64(b[l], hi, b[l + 4]);
    }
  } else {
    static_assert(P == 4);
    __m512i z[4];
    auto row = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * stride)); };
    for (int i = 0; i < 4; ++i) {
      z[i] = _mm512_castsi128_si512(row(i));
      z[i] = _mm512_inserti32x4(z[i], row(i + 4), 1);
      z[i] = _mm512_inserti32x4(z[i], row(i + 8), 2);
      z[i] = _mm512_inserti32x4(z[i], row(i + 12), 3);
    }
    const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2);
    t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3);
    t[3] = _mm512_unpackhi_epi64(a1, a3);
  }
}

inline __m512i Q4(const Act& a, int64_t K, int64_t m, int64_t k) {  // q[m, k .. k + 3] in every lane
  int32_t v;
  std::memcpy(&v, a.q.data() + m * K + k, 4);
  return _mm512_set1_epi32(v);
}

// Whether the VNNI tiles take this format: int8 with B 16 or 32; int4 with G = 32, or G a multiple of 64.
bool VnniFits(int64_t bits, int64_t group) {
  const int64_t B = ActBlock(group);
  return bits == 8 ? (B == 16 || B == 32) : (group == 32 || group % 64 == 0) && group / 64 <= 16;
}

// 16 channels [n0, n0 + 16) x rows [m0, m0 + MT): lane j of each vector is channel n0 + j. The integer dot of a
// block is exact (vpdpbusd of unsigned weight bytes with q: int8 v as v + 128, then - 128 * qsum; int4 nibbles
// u, then - offset * qsum), and the float steps are ActGeneric's, lane by lane.
template <int kBits, bool kMins, int MT, int B>
void ActTile(const Problem& p, const Act& a, int64_t m0, int64_t n0) {
  const int64_t K = p.k, G = p.group, groups = K / G, nb = a.blocks;
  const int64_t stride = kBits == 8 ? K : K / 2;
  const uint8_t* w = static_cast<const uint8_t*>(p.values) + n0 * stride;
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int32_t>(groups)));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), low = _mm512_set1_epi8(15);
  // Software prefetch of the next tile's weight rows (16 contiguous rows), in step with this tile: a line per 64
  // bytes consumed (the head ran 17 / 23 / 18 ms at M = 1 with a prefetch, without, and two tiles ahead, on one
  // thread of a busy 2-core Xeon).
  const bool prefetch = n0 + 32 <= p.n;
  const char* pf = reinterpret_cast<const char*>(w + 16 * stride);
  auto ahead = [&](int64_t bytes) {  // bytes of this tile just consumed (a multiple of 64)
    if (prefetch)
      for (int64_t i = 0; i < bytes; i += 64, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
  };
  __m512 acc[MT];
  __m512i sc4[4], mn4[4];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  auto settle = [&](__m512 d[MT], const __m512i s[MT], int64_t b) {  // d += s_x[b] * (s - cq[b])
    for (int m = 0; m < MT; ++m) {
      const int64_t at_b = (m0 + m) * nb + b;
      const __m512i idot = _mm512_sub_epi32(s[m], _mm512_set1_epi32(a.cq[at_b]));
      d[m] = _mm512_add_ps(d[m], _mm512_mul_ps(_mm512_set1_ps(a.sx[at_b]), _mm512_cvtepi32_ps(idot)));
    }
  };
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G;
    __m512 d[MT];
    __m512i s[MT];
    for (int m = 0; m < MT; ++m) d[m] = _mm512_setzero_ps();
    if constexpr (kBits == 8) {
      for (int64_t b = k0 / B; b < (k0 + G) / B; ++b) {
        const int64_t k = b * B;
        ahead(16 * B);
        for (int m = 0; m < MT; ++m) s[m] = _mm512_setzero_si512();
        __m512i t[8];
        constexpr int P = B / 4;
        Transpose<P>(w + k, stride, t);
        for (int l = 0; l < P; ++l) {
          const __m512i u = _mm512_xor_si512(t[l], flip);
          for (int m = 0; m < MT; ++m) s[m] = _mm512_dpbusd_epi32(s[m], u, Q4(a, K, m0 + m, k + 4 * l));
        }
        settle(d, s, b);
      }
    } else if (G == 32) {  // one block: 16 bytes, low nibbles k0 .. k0 + 15, high ones k0 + 16 .. k0 + 31
      const int64_t off = k0 / 2;
      ahead(256);
      for (int m = 0; m < MT; ++m) s[m] = _mm512_setzero_si512();
      __m512i t[4];
      Transpose<4>(w + off, stride, t);
      for (int l = 0; l < 4; ++l) {
        const __m512i lo = _mm512_and_si512(t[l], low), hi = _mm512_and_si512(_mm512_srli_epi32(t[l], 4), low);
        for (int m = 0; m < MT; ++m) {
          s[m] = _mm512_dpbusd_epi32(s[m], lo, Q4(a, K, m0 + m, k0 + 4 * l));
          s[m] = _mm512_dpbusd_epi32(s[m], hi, Q4(a, K, m0 + m, k0 + 16 + 4 * l));
        }
      }
      settle(d, s, k0 / B);
    } else {  // G = 64 h: piece j (32 bytes) holds block j in its low nibbles, block h + j in its high ones
      const int64_t h = G / 64, b0 = k0 / B;
      __m512i high[MT][16];
      for (int64_t j = 0; j < h; ++j) {
        const int64_t off = k0 / 2 + 32 * j;
        ahead(512);
        __m512i t[8], sh[MT];
        for (int m = 0; m < MT; ++m) s[m] = sh[m] = _mm512_setzero_si512();
        Transpose<8>(w + off, stride, t);
        for (int l = 0; l < 8; ++l) {
          const __m512i lo = _mm512_and_si512(t[l], low), hi = _mm512_and_si512(_mm512_srli_epi32(t[l], 4), low);
          for (int m = 0; m < MT; ++m) {
            s[m] = _mm512_dpbusd_epi32(s[m], lo, Q4(a, K, m0 + m, k0 + 32 * j + 4 * l));
            sh[m] = _mm512_dpbusd_epi32(sh[m], hi, Q4(a, K, m0 + m, k0 + G / 2 + 32 * j + 4 * l));
          }
        }
        settle(d, s, b0 + j);
        for (int m = 0; m < MT; ++m) high[m][j] = sh[m];
      }
      for (int64_t j = 0; j < h; ++j) {
        for (int m = 0; m < MT; ++m) s[m] = high[m][j];
        settle(d, s, b0 + h + j);
      }
    }
    // The 16 channels' scales (and mins) of group g: 4 groups at a time transposed like the weights where groups
    // divide by 4 (cheaper than a gather each), else gathered.
    if (groups % 4 == 0 && g % 4 == 0) {
      Transpose<4>(reinterpret_cast<const uint8_t*>(p.scales + n0 * groups + g), 4 * groups, sc4);
      if constexpr (kMins) Transpose<4>(reinterpret_cast<const uint8_t*>(p.mins + n0 * groups + g), 4 * groups, mn4);
    }
    const __m512 sc = groups % 4 == 0 ? _mm512_castsi512_ps(sc4[g % 4])
                                      : _mm512_i32gather_ps(at, p.scales + n0 * groups + g, 4);
    __m512 mn = _mm512_setzero_ps();
    if constexpr (kMins)
      mn = groups % 4 == 0 ? _mm512_castsi512_ps(mn4[g % 4]) : _mm512_i32gather_ps(at, p.mins + n0 * groups + g, 4);
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(sc, d[m]));
      if constexpr (kMins)
        acc[m] = _mm512_sub_ps(acc[m], _mm512_mul_ps(mn, _mm512_set1_ps(a.xs[(m0 + m) * groups + g])));
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(p.y + (m0 + m) * p.n + n0, acc[m]);
}

template <int kBits, bool kMins, int MT>
void ActRows(const Problem& p, const Act& a, int64_t m0, int64_t na, int64_t nb) {
  for (int64_t n = na; n + 16 <= nb; n += 16) {
    if (kBits == 8 && a.block == 16) {
      ActTile<kBits, kMins, MT, 16>(p, a, m0, n);
    } else {
      ActTile<kBits, kMins, MT, 32>(p, a, m0, n);
    }
  }
}
#endif

// All rows for channels [na, nb): VNNI tiles of 16 channels where the build and format allow, the rest generic.
template <int kBits, bool kMins>
void ActChannels(const Problem& p, const Act& a, int64_t na, int64_t nb) {
  int64_t tail = na;
#if defined(SPECJAX_VNNI)
  if (VnniFits(kBits, p.group)) {
    tail = na + (nb - na) / 16 * 16;
    for (int64_t m0 = 0; m0 < p.m; m0 += 8) {  // row tiles of 8: 4 took twice as long at M = 8
      switch (std::min<int64_t>(8, p.m - m0)) {
        case 1: ActRows<kBits, kMins, 1>(p, a, m0, na, tail); break;
        case 2: ActRows<kBits, kMins, 2>(p, a, m0, na, tail); break;
        case 3: ActRows<kBits, kMins, 3>(p, a, m0, na, tail); break;
        case 4: ActRows<kBits, kMins, 4>(p, a, m0, na, tail); break;
        case 5: ActRows<kBits, kMins, 5>(p, a, m0, na, tail); break;
        case 6: ActRows<kBits, kMins, 6>(p, a, m0, na, tail); break;
        case 7: ActRows<kBits, kMins, 7>(p, a, m0, na, tail); break;
        default: ActRows<kBits, kMins, 8>(p, a, m0, na, tail); break;
      }
    }
  }
#endif
  ActGeneric<kBits, kMins>(p, a, tail, nb);
}

using ActFn = void (*)(const Problem&, const Act&, int64_t, int64_t);

ActFn SelectAct(int64_t bits, bool mins) {
  if (bits == 8) return mins ? ActChannels<8, true> : ActChannels<8, false>;
  return mins ? ActChannels<4, true> : ActChannels<4, false>;
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

// Multiplies p's rows by its weights (shapes already checked), sharing channel blocks over the pool's threads.
void Run(ffi::ThreadPool& pool, const Problem& p, int64_t bits, bool has_mins, int64_t act_bits, int64_t mutant) {
  const int64_t M = p.m, K = p.k, N = p.n;
  const int64_t threads = M * N * K < (1 << 18) ? 1 : Threads(pool);
  if (act_bits == 8) {  // rows quantized once, here; then blocks of whole VNNI tiles, at least 4 per thread
    Act a;
    QuantizeRows(p, bits, static_cast<int>(mutant), a);
    const ActFn fn = SelectAct(bits, has_mins);
    const int64_t kBlock = 16 * std::clamp<int64_t>((N + 16 * 4 * threads - 1) / (16 * 4 * threads), 1, 8);
    if (threads == 1) {
      fn(p, a, 0, N);
    } else {
      ParallelFor(pool, threads, (N + kBlock - 1) / kBlock,
                  [&p, &a, fn, N, kBlock](int64_t b) { fn(p, a, b * kBlock, std::min(N, (b + 1) * kBlock)); });
    }
    return;
  }
  const ChannelsFn fn = Select(bits, has_mins && bits != 32);
  // Blocks of 120 channels (a multiple of every tile width); one thread for small problems.
  constexpr int64_t kBlock = 120;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  if (threads == 1) {
    fn(p, 0, N);
  } else {
    ParallelFor(pool, threads, blocks, [&p, fn, N](int64_t b) { fn(p, b * kBlock, std::min(N, (b + 1) * kBlock)); });
  }
}

// Checks the attributes and the shapes of one matrix ([N, Kv] values, [N, K / G] scales and mins) against x's K.
ffi::Error Check(int64_t K, int64_t N, int64_t kv, ffi::DataType dtype, int64_t s0, int64_t s1, int64_t bits,
                 int64_t& group, bool has_mins, int64_t m0, int64_t m1, int64_t act_bits) {
  const ffi::DataType want = bits == 8 ? ffi::DataType::S8 : bits == 4 ? ffi::DataType::U8 : ffi::DataType::F32;
  if (bits != 8 && bits != 4 && bits != 32) return ffi::Error::InvalidArgument("qmatmul: bits must be 4, 8 or 32");
  if (dtype != want) return ffi::Error::InvalidArgument("qmatmul: values have the wrong dtype");
  if (bits == 32) group = K;
  if (group <= 0 || group % 2 || K % group) return ffi::Error::InvalidArgument("qmatmul: K must be a multiple of G");
  if (kv != (bits == 4 ? K / 2 : K)) return ffi::Error::InvalidArgument("qmatmul: values do not match K");
  if (bits != 32 && (s0 != N || s1 != K / group)) return ffi::Error::InvalidArgument("qmatmul: scales must be [N, K / G]");
  if (has_mins && (m0 != N || m1 != K / group)) return ffi::Error::InvalidArgument("qmatmul: mins must be [N, K / G]");
  if (act_bits != 32 && (act_bits != 8 || bits == 32))
    return ffi::Error::InvalidArgument("qmatmul: act_bits must be 32, or 8 with 4- or 8-bit weights");
  return ffi::Error::Success();
}

ffi::Error Qmatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::Buffer<ffi::F32> scales,
                   ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group,
                   int64_t offset, bool has_mins, int64_t act_bits, int64_t mutant) {
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  auto md = mins.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2 || yd.size() != 2 || (has_mins && md.size() != 2))
    return ffi::Error::InvalidArgument("qmatmul: x, values, scales, mins and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = vd[0];
  if (ffi::Error e = Check(K, N, vd[1], values.element_type(), sd[0], sd[1], bits, group, has_mins,
                           has_mins ? md[0] : 0, has_mins ? md[1] : 0, act_bits);
      e.failure())
    return e;
  if (yd[0] != M || yd[1] != N) return ffi::Error::InvalidArgument("qmatmul: y must be [M, N]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const Problem p{x.typed_data(), values.untyped_data(), scales.typed_data(), has_mins ? mins.typed_data() : nullptr,
                  y->typed_data(), M, K, N, group, static_cast<int>(offset)};
  Run(pool, p, bits, has_mins, act_bits, mutant);
  return ffi::Error::Success();
}

// y[m] = x[m] @ w[ids[m]] over a stack of E matrices (routed experts): values [E, N, Kv], scales and mins
// [E, N, K / G]. The rows of each expert are gathered and multiplied as one Qmatmul problem, so every y[m, n] has
// the bits that Qmatmul gives x[m] against that expert's matrix alone, whatever the other rows.
ffi::Error QmatmulRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                       ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> ids,
                       ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group, int64_t offset, bool has_mins,
                       int64_t act_bits) {
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  auto md = mins.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 3 || yd.size() != 2 || id.size() != 1 ||
      (has_mins && md.size() != 3))
    return ffi::Error::InvalidArgument("qmatmul_rows: x [M, K], values, scales, mins [E, N, .], ids [M], y [M, N]");
  const int64_t M = xd[0], K = xd[1], E = vd[0], N = vd[1];
  if (ffi::Error e = Check(K, N, vd[2], values.element_type(), sd[1], sd[2], bits, group, has_mins,
                           has_mins ? md[1] : 0, has_mins ? md[2] : 0, act_bits);
      e.failure())
    return e;
  if ((bits != 32 && sd[0] != E) || (has_mins && md[0] != E) || id[0] != M || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("qmatmul_rows: scales, mins, ids or y do not match values and x");
  const int32_t* expert = ids.typed_data();
  for (int64_t m = 0; m < M; ++m)
    if (expert[m] < 0 || expert[m] >= E) return ffi::Error::InvalidArgument("qmatmul_rows: an id is out of range");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t value_bytes = N * vd[2] * (bits == 32 ? 4 : 1), groups = N * (K / group);
  std::vector<int64_t> order(M);
  for (int64_t m = 0; m < M; ++m) order[m] = m;
  std::stable_sort(order.begin(), order.end(), [expert](int64_t a, int64_t b) { return expert[a] < expert[b]; });
  std::vector<float> xs, ys;
  for (int64_t i = 0; i < M;) {
    const int32_t e = expert[order[i]];
    int64_t j = i;
    while (j < M && expert[order[j]] == e) ++j;
    const int64_t rows = j - i;
    xs.resize(rows * K);
    ys.resize(rows * N);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(&xs[r * K], x.typed_data() + order[i + r] * K, K * sizeof(float));
    const Problem p{xs.data(),
                    static_cast<const char*>(values.untyped_data()) + e * value_bytes,
                    bits == 32 ? nullptr : scales.typed_data() + e * groups,
                    has_mins ? mins.typed_data() + e * groups : nullptr,
                    ys.data(),
                    rows,
                    K,
                    N,
                    group,
                    static_cast<int>(offset)};
    Run(pool, p, bits, has_mins, act_bits, 0);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y->typed_data() + order[i + r] * N, &ys[r * N], N * sizeof(float));
    i = j;
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
                                  .Attr<bool>("has_mins")
                                  .Attr<int64_t>("act_bits")
                                  .Attr<int64_t>("mutant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQmatmulRows, QmatmulRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // values [E, N, Kv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [E, N, K / G]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins [E, N, K / G] (any shape when absent)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [M]: each row's matrix
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("offset")
                                  .Attr<bool>("has_mins")
                                  .Attr<int64_t>("act_bits"));

#if defined(SPECJAX_VNNI)
extern "C" const char* SpecjaxQmatmulIsa() { return "avx512-vnni"; }
#else
extern "C" const char* SpecjaxQmatmulIsa() { return Vec::kIsa; }
#endif
