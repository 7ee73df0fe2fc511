// Ragged paged attention for CPU, as an XLA FFI custom call.
//
// Same contract as pallas_kernels/ragged_paged_attention_reference.py: q [T, Hq, D], the
// stacked caches [L, Hkv, NB, BS, D], kv_lens [R], block_tables [R, W],
// query_start_loc [R + 1], num_seqs [], layer [], and optionally window []; out [T, Hq, D] with
// padding tokens 0. With a window (a sliding window, as Hugging Face's Mistral or Qwen2) the token
// at position p sees key j iff j <= p and p - j < window; blocks before the window of a tile's
// first token are never read. Without the operand: no window. With the attribute softcap (a float
// c > 0; Gemma 2's logit soft-capping) each score q.k * sm_scale becomes c * tanh(score / c)
// before the masks and the softmax (vector_tanh.h, in every vector path). Without it: no capping,
// and the call is the one it was before the attribute existed. An int8 cache is read as its
// integer values, converted to f32 as each block is loaded: the caller has folded the K scale into
// q and applies the V scale to the output (jaxcb/kernels/attention/quantization.py).
//
// Why C++: on CPU the XLA path spends most of its time gathering K/V blocks into fresh
// buffers and in many small ops. Here each (sequence, KV head, tile of query tokens) reads
// its blocks in place from the cache, one block at a time, with an online softmax, and never
// lets a key past its sequence's kv_len reach the output (stale slots, even NaN, are masked
// out of the scores and never read for the values). Work items are spread over XLA's intra-op
// thread pool. With AVX2 a row scores 8 keys per pass and its softmax exponentials are
// vectorised, and the next block's keys and values are prefetched while this one is used:
// decode steps read blocks scattered over the cache, which the hardware prefetcher cannot
// follow.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "parallel_for.h"
#include "vector_exp.h"
#include "vector_tanh.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokensPerTile = 16;  // query tokens of one sequence per work item
constexpr int64_t kMaxBlockSize = 64;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kNoWindow = std::numeric_limits<int64_t>::max() / 2;  // no window operand: keys from 0

using jaxcb::Bf16ToFloat;
using jaxcb::FloatToBf16;

template <typename T>
inline void LoadRow(const T* src, float* dst, int64_t n);

template <>
inline void LoadRow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void LoadRow<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {  // a bf16 is the top half of its f32: widen and shift, 16 at a time
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {  // the same, 8 at a time
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

template <>
inline void LoadRow<int8_t>(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {  // sign-extend 16 bytes to i32, then convert: exact (|x| <= 128)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {  // the same, 8 at a time
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A cache block's rows as floats: f32 blocks are read in place, bf16 and int8 ones converted into
// `buf` (an int8 block's values unscaled: the K scale is in q, the V scale applied to the output).
inline const float* BlockAsFloat(const float* src, float*, int64_t) { return src; }

inline const float* BlockAsFloat(const int8_t* src, float* buf, int64_t n) {
  LoadRow<int8_t>(src, buf, n);
  return buf;
}

inline const float* BlockAsFloat(const uint16_t* src, float* buf, int64_t n) {
  LoadRow<uint16_t>(src, buf, n);
  return buf;
}

template <typename T>
inline void StoreRow(const float* src, T* dst, int64_t n);

template <>
inline void StoreRow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void StoreRow<uint16_t>(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

struct Shapes {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t num_layers, num_kv_heads, num_blocks, block_size;
  int64_t num_seqs_max, width;
};

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t first_token;  // offset of the tile's first query token within the sequence's new tokens
};

// Gemma 2's logit soft-cap: a score s becomes cap * tanh(s / cap), on one score or a vector of them.
// cap 0 is none (on() is false, and no caller applies it).
struct SoftCap {
  float cap = 0.0f, inv = 0.0f;

  bool on() const { return cap > 0.0f; }
  float operator()(float s) const { return cap * jaxcb::Tanh(s * inv); }
#if defined(__AVX2__) && defined(__FMA__)
  __m256 operator()(__m256 s) const {
    return _mm256_mul_ps(_mm256_set1_ps(cap), jaxcb::Tanh8(_mm256_mul_ps(s, _mm256_set1_ps(inv))));
  }
#endif
#if defined(__AVX512F__)
  __m512 operator()(__m512 s) const {
    return _mm512_mul_ps(_mm512_set1_ps(cap), jaxcb::Tanh16(_mm512_mul_ps(s, _mm512_set1_ps(inv))));
  }
#endif
};

inline float Dot(const float* q, const float* k, int64_t D) {
  float dot = 0.0f;
  for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
  return dot;
}

// One query row (already scaled) against keys [first, visible) of a block (first < visible; a sliding
// window starts at first): the online softmax update of its running max m, sum l and output acc. k and
// v hold the block's rows (D floats each); rows before first are never read. sc is scratch for
// kMaxBlockSize scores. Every path caps a score (cap) before it masks any.
inline void AttendRowScalar(const float* q, const float* k, const float* v, int64_t first, int64_t visible, int64_t D,
                            const SoftCap& cap, float& m, float& l, float* acc, float* sc) {
  float block_max = -1e30f;
  for (int64_t j = first; j < visible; ++j) {
    sc[j] = Dot(q, k + j * D, D);
    if (cap.on()) sc[j] = cap(sc[j]);
    block_max = std::max(block_max, sc[j]);
  }
  const float m_new = std::max(m, block_max);
  const float correction = std::exp(m - m_new);
  float sum = l * correction;
  for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  for (int64_t j = first; j < visible; ++j) {
    const float p = std::exp(sc[j] - m_new);
    sum += p;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * v[j * D + d];
  }
  l = sum;
  m = m_new;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float HorizontalSum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float HorizontalMax(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// q . k[j] for the 8 keys j < 8 (rows of D floats, D % 8 == 0), as one vector.
inline __m256 Dot8(const float* q, const float* k, int64_t D) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), a[j]);
  }
  // Pairwise sums, then the two 128-bit halves: lane j of the result is key j's dot.
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// acc[0, 8C) = acc * correction + sum_{j < visible} p[j] v[j][0, 8C), in registers.
template <int C>
inline void AccumulateValues(const float* p, const float* v, int64_t visible, int64_t D, float correction,
                             float* acc) {
  __m256 o[C];
  const __m256 corr = _mm256_set1_ps(correction);
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), corr);
  for (int64_t j = 0; j < visible; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + 8 * c), o[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, o[c]);
}

using AccumulateFn = void (*)(const float*, const float*, int64_t, int64_t, float, float*);
constexpr AccumulateFn kAccumulate[9] = {nullptr,
                                         AccumulateValues<1>,
                                         AccumulateValues<2>,
                                         AccumulateValues<3>,
                                         AccumulateValues<4>,
                                         AccumulateValues<5>,
                                         AccumulateValues<6>,
                                         AccumulateValues<7>,
                                         AccumulateValues<8>};

#if defined(__AVX512F__)

// Sums within each 4-lane group of a and of b, interleaved: [a0+a2, b0+b2, a1+a3, b1+b3] per group.
inline __m512 PairSum(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }

// q . k[j] for the 16 keys j < 16 (rows of D floats, D % 16 == 0), as one vector.
inline __m512 Dot16(const float* q, const float* k, int64_t D) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + j * D + d), a[j]);
  }
  // 16 vectors -> 4, each 4-lane group g of u[i] holding group g's sums of keys 4i..4i+3.
  __m512 u[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512 t0 = PairSum(a[4 * i], a[4 * i + 1]), t1 = PairSum(a[4 * i + 2], a[4 * i + 3]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  }
  // Then the four groups summed, key j landing in lane j.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// AccumulateValues with 16 lanes: acc[0, 16C) = acc * correction + sum_{j < visible} p[j] v[j][0, 16C).
template <int C>
inline void AccumulateValues16(const float* p, const float* v, int64_t visible, int64_t D, float correction,
                               float* acc) {
  __m512 o[C];
  const __m512 corr = _mm512_set1_ps(correction);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), corr);
  for (int64_t j = 0; j < visible; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * D + 16 * c), o[c]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

using Accumulate16Fn = void (*)(const float*, const float*, int64_t, int64_t, float, float*);
constexpr Accumulate16Fn kAccumulate16[5] = {nullptr, AccumulateValues16<1>, AccumulateValues16<2>,
                                             AccumulateValues16<3>, AccumulateValues16<4>};

// AttendRow for blocks of 16 rows and D % 16 == 0: the block's keys scored as one vector.
// Scores outside [first, visible) (NaN or not) are masked to -inf before use; values there are not read.
inline void AttendRow16(const float* q, const float* k, const float* v, int64_t first, int64_t visible, int64_t D,
                        const SoftCap& cap, float& m, float& l, float* acc, float* sc) {
  const __mmask16 seen = static_cast<__mmask16>(((1u << visible) - 1) & ~((1u << first) - 1));
  __m512 dots = Dot16(q, k, D);
  if (cap.on()) dots = cap(dots);
  const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, dots);
  const float m_new = std::max(m, _mm512_reduce_max_ps(scores));
  const float correction = std::exp(m - m_new);
  const __m512 p = jaxcb::Exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new)));
  _mm512_storeu_ps(sc, p);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t chunk = std::min<int64_t>(64, D - d0);
    kAccumulate16[chunk / 16](sc + first, v + first * D + d0, visible - first, D, correction, acc + d0);
  }
  l = l * correction + _mm512_reduce_add_ps(p);
  m = m_new;
}
#endif

// AttendRowScalar for D % 8 == 0. Keys are scored 8 at a time while 8 rows of the block remain,
// from the group that holds `first` (a group may run outside [first, visible): those scores, NaN or
// not, are replaced by -inf before use).
inline void AttendRow(const float* q, const float* k, const float* v, int64_t block_rows, int64_t first,
                      int64_t visible, int64_t D, const SoftCap& cap, float& m, float& l, float* acc, float* sc) {
  if (D % 8) return AttendRowScalar(q, k, v, first, visible, D, cap, m, l, acc, sc);
#if defined(__AVX512F__)
  if (block_rows % 16 == 0 && D % 16 == 0) {  // larger blocks: one online-softmax update per 16 keys
    for (int64_t j = first / 16 * 16; j < visible; j += 16)
      AttendRow16(q, k + j * D, v + j * D, std::max<int64_t>(first - j, 0), std::min<int64_t>(16, visible - j), D, cap,
                  m, l, acc, sc);
    return;
  }
#endif
  const int64_t lo = first / 8 * 8;  // the first group of 8 scored
  int64_t j = lo;
  for (; j < visible && j + 8 <= block_rows; j += 8) {
    const __m256 dots = Dot8(q, k + j * D, D);
    _mm256_storeu_ps(sc + j, cap.on() ? cap(dots) : dots);
  }
  for (; j < visible; ++j) sc[j] = cap.on() ? cap(Dot(q, k + j * D, D)) : Dot(q, k + j * D, D);
  const int64_t padded = (visible + 7) / 8 * 8;  // <= kMaxBlockSize: block sizes are multiples of 8 or scored above
  for (int64_t t = lo; t < first; ++t) sc[t] = -INFINITY;
  for (int64_t t = visible; t < padded; ++t) sc[t] = -INFINITY;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = lo; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
  const float m_new = std::max(m, HorizontalMax(mx));
  const float correction = std::exp(m - m_new);
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(m_new);
  for (int64_t t = lo; t < padded; t += 8) {
    const __m256 p = jaxcb::Exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), shift));
    sum = _mm256_add_ps(sum, p);
    _mm256_storeu_ps(sc + t, p);
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t chunk = std::min<int64_t>(64, D - d0);
    kAccumulate[chunk / 8](sc + first, v + first * D + d0, visible - first, D, correction, acc + d0);
  }
  l = l * correction + HorizontalSum(sum);
  m = m_new;
}
#else
inline void AttendRow(const float* q, const float* k, const float* v, int64_t, int64_t first, int64_t visible,
                      int64_t D, const SoftCap& cap, float& m, float& l, float* acc, float* sc) {
  AttendRowScalar(q, k, v, first, visible, D, cap, m, l, acc, sc);
}
#endif

// Fetches a cache block's rows into L1 ahead of use.
inline void PrefetchBlock(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// The lines of one cache block's keys and values to fetch ahead (none when bytes is 0).
struct BlockFetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;
};

// The keys a work item's tile sees in its sequence: up to its last query token's position.
inline int64_t KeysSeen(int32_t kv_len, int32_t q_len, int32_t first_token) {
  const int64_t tile_tokens = std::min<int64_t>(kTokensPerTile, q_len - first_token);
  return static_cast<int64_t>(kv_len) - q_len + first_token + tile_tokens;
}

// The first key a work item's tile sees: the start of its first query token's window (the earliest).
inline int64_t FirstKeySeen(int32_t kv_len, int32_t q_len, int32_t first_token, int64_t window) {
  return std::max<int64_t>(0, static_cast<int64_t>(kv_len) - q_len + first_token - window + 1);
}

// One (sequence, KV head, query tile): rows are (token, head-in-group) pairs. Blocks before the
// window of the tile's first token are skipped; a row's keys before its own window are masked.
// Q: the element type of q and out; C: the cache's (float, or uint16_t holding bf16).
// first_block_of_next() says what the last block fetches ahead: the first block of the item
// this thread runs next (claimed then), so that no item starts on a block still in memory.
template <typename Q, typename C, typename NextFetch>
void AttendTile(const Shapes& s, const Q* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                int32_t kv_len, int32_t q_begin, int32_t q_len, int32_t layer, int64_t window, const WorkItem& item,
                float sm_scale, const SoftCap& cap, Q* out, NextFetch&& first_block_of_next) {
  const int64_t D = s.head_dim, BS = s.block_size, group = s.num_q_heads / s.num_kv_heads;
  const int64_t tile_tokens = std::min<int64_t>(kTokensPerTile, q_len - item.first_token);
  const int64_t rows = tile_tokens * group;
  // Token i of the q_len new tokens sits at position kv_len - q_len + i.
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + item.first_token;
  const int64_t last_pos = KeysSeen(kv_len, q_len, item.first_token) - 1;

  // Per-thread scratch, grown once: no allocation per work item.
  thread_local std::vector<float> qf, acc, m, l, kbuf, vbuf;
  qf.resize(rows * D);
  acc.assign(rows * D, 0.0f);
  m.assign(rows, -1e30f);
  l.assign(rows, 0.0f);
  if (!std::is_same_v<C, float>) {  // bf16 and int8 blocks are converted to floats here
    kbuf.resize(BS * D);
    vbuf.resize(BS * D);
  }
  alignas(32) float sc[kMaxBlockSize];
  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const Q* src = q + ((q_begin + item.first_token + t) * s.num_q_heads + item.kv_head * group + g) * D;
      LoadRow<Q>(src, &qf[row * D], D);
      for (int64_t d = 0; d < D; ++d) qf[row * D + d] *= sm_scale;
    }
  }

  const int64_t head_base = (static_cast<int64_t>(layer) * s.num_kv_heads + item.kv_head) * s.num_blocks;
  const int64_t num_blocks_seen = last_pos / BS + 1;  // causal: the tile's last token sees up to last_pos
  const int64_t first_block = FirstKeySeen(kv_len, q_len, item.first_token, window) / BS;
  for (int64_t b = first_block; b < num_blocks_seen; ++b) {
    const int64_t block_start = b * BS;
    const int64_t keys = std::min<int64_t>(BS, last_pos + 1 - block_start);  // <= kv_len - block_start
    // The next block's lines, fetched a share per row so that no one burst fills the miss queue.
    // After the last block: the first block of the item this thread runs next.
    BlockFetch ahead;
    if (b + 1 < num_blocks_seen) {
      const int64_t next = (head_base + block_table[b + 1]) * BS * D;
      ahead = {reinterpret_cast<const char*>(k_cache + next), reinterpret_cast<const char*>(v_cache + next),
               std::min<int64_t>(BS, last_pos + 1 - block_start - BS) * D * static_cast<int64_t>(sizeof(C))};
    } else {
      ahead = first_block_of_next();
    }
    const char *next_k = ahead.k, *next_v = ahead.v;
    const int64_t next_bytes = ahead.bytes;
    // Over the first half of the rows: the last lines must still land before the next block starts.
    const int64_t spread_rows = rows <= 4 ? rows : (rows + 1) / 2;
    const int64_t share = (next_bytes / 64 + spread_rows - 1) / spread_rows * 64;
    const int64_t offset = (head_base + block_table[b]) * BS * D;
    const float* kb = BlockAsFloat(k_cache + offset, kbuf.data(), keys * D);
    const float* vb = BlockAsFloat(v_cache + offset, vbuf.data(), keys * D);
    for (int64_t row = 0; row < rows; ++row) {
      if (next_bytes > 0) {
        const int64_t lo = std::min(next_bytes, row * share), n = std::min(next_bytes, lo + share) - lo;
        PrefetchBlock(next_k + lo, n);
        PrefetchBlock(next_v + lo, n);
      }
      const int64_t row_pos = pos0 + row / group;
      const int64_t visible = std::min<int64_t>(keys, row_pos + 1 - block_start);
      const int64_t first = std::max<int64_t>(0, row_pos - window + 1 - block_start);  // the row's window
      if (visible <= first) continue;
      AttendRow(&qf[row * D], kb, vb, BS, first, visible, D, cap, m[row], l[row], &acc[row * D], sc);
    }
  }

  float normed[kMaxHeadDim];
  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
      for (int64_t d = 0; d < D; ++d) normed[d] = acc[row * D + d] * inv;
      Q* dst = out + ((q_begin + item.first_token + t) * s.num_q_heads + item.kv_head * group + g) * D;
      StoreRow<Q>(normed, dst, D);
    }
  }
}

template <typename Q, typename C>
ffi::Error Attend(ffi::ThreadPool pool, const Shapes& s, const Q* q, const C* k_cache, const C* v_cache,
                  const int32_t* kv_lens, const int32_t* block_tables, const int32_t* qsl, int32_t num_seqs,
                  int32_t layer, int64_t window, float sm_scale, const SoftCap& cap, Q* out) {
  std::memset(out, 0, s.num_tokens * s.num_q_heads * s.head_dim * sizeof(Q));
  if (num_seqs < 0 || num_seqs > s.num_seqs_max)
    return ffi::Error::InvalidArgument("num_seqs=" + std::to_string(num_seqs) + " is outside [0, " +
                                       std::to_string(s.num_seqs_max) + "]");
  if (layer < 0 || layer >= s.num_layers)
    return ffi::Error::InvalidArgument("layer=" + std::to_string(layer) + " is outside [0, " +
                                       std::to_string(s.num_layers) + ")");
  if (window < 1)
    return ffi::Error::InvalidArgument("window=" + std::to_string(window) + " must be >= 1 (a token sees itself)");
  std::vector<WorkItem> items;
  for (int32_t r = 0; r < num_seqs; ++r) {
    const int32_t q_begin = qsl[r], q_len = qsl[r + 1] - qsl[r], kv_len = kv_lens[r];
    if (q_begin < 0 || q_len < 0 || qsl[r + 1] > s.num_tokens)
      return ffi::Error::InvalidArgument("query_start_loc must start >= 0, never decrease and end <= num_tokens "
                                         "(sequence " + std::to_string(r) + ")");
    if (q_len > kv_len || kv_len > s.width * s.block_size)
      return ffi::Error::InvalidArgument("sequence " + std::to_string(r) + ": kv_len=" + std::to_string(kv_len) +
                                         " must be >= its new tokens and fit its block table");
    const int32_t* table = block_tables + r * s.width;
    for (int64_t b = 0; b * s.block_size < kv_len; ++b) {
      if (table[b] < 0 || table[b] >= s.num_blocks)
        return ffi::Error::InvalidArgument("sequence " + std::to_string(r) + ": block id " +
                                           std::to_string(table[b]) + " is outside the cache");
    }
    for (int32_t first = 0; first < q_len; first += kTokensPerTile)
      for (int32_t h = 0; h < s.num_kv_heads; ++h) items.push_back(WorkItem{r, h, first});
  }
  const int64_t n = static_cast<int64_t>(items.size());
  jaxcb::ParallelFor(pool, n, [&](int64_t i, jaxcb::NextItem& next) {
    const WorkItem& item = items[i];
    auto first_block_of_next = [&]() -> BlockFetch {
      const int64_t j = next.Claim();
      if (j >= n) return {};
      const WorkItem& other = items[j];
      const int32_t q_len = qsl[other.seq + 1] - qsl[other.seq];
      const int64_t first = FirstKeySeen(kv_lens[other.seq], q_len, other.first_token, window) / s.block_size;
      const int64_t keys = std::min<int64_t>(
          s.block_size, KeysSeen(kv_lens[other.seq], q_len, other.first_token) - first * s.block_size);
      const int64_t at = ((static_cast<int64_t>(layer) * s.num_kv_heads + other.kv_head) * s.num_blocks +
                          block_tables[other.seq * s.width + first]) * s.block_size * s.head_dim;
      return {reinterpret_cast<const char*>(k_cache + at), reinterpret_cast<const char*>(v_cache + at),
              keys * s.head_dim * static_cast<int64_t>(sizeof(C))};
    };
    AttendTile<Q, C>(s, q, k_cache, v_cache, block_tables + item.seq * s.width, kv_lens[item.seq], qsl[item.seq],
                     qsl[item.seq + 1] - qsl[item.seq], layer, window, item, sm_scale, cap, out, first_block_of_next);
  });
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                    ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> query_start_loc,
                                    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                                    std::optional<ffi::Buffer<ffi::S32>> window, ffi::Dictionary attrs,
                                    ffi::Result<ffi::AnyBuffer> out) {
  // Attributes: sm_scale, and softcap where there is one (a dictionary: an attribute that may be absent).
  for (std::string_view name : attrs)
    if (name != "sm_scale" && name != "softcap")
      return ffi::Error::InvalidArgument("unknown attribute " + std::string(name) + " (takes sm_scale, softcap)");
  const ffi::ErrorOr<float> sm_scale = attrs.get<float>("sm_scale");
  if (!sm_scale.has_value()) return sm_scale.error();
  SoftCap cap;
  if (attrs.contains("softcap")) {
    const ffi::ErrorOr<float> softcap = attrs.get<float>("softcap");
    if (!softcap.has_value()) return softcap.error();
    if (!(*softcap > 0.0f) || !std::isfinite(*softcap))
      return ffi::Error::InvalidArgument("softcap=" + std::to_string(*softcap) + " must be a positive float");
    cap = SoftCap{*softcap, 1.0f / *softcap};
  }
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T, Hq, D], caches [L, Hkv, NB, BS, D], tables [R, W]");
  Shapes s{qd[0], qd[1], qd[2], cd[0], cd[1], cd[2], cd[3], td[0], td[1]};
  if (s.block_size > kMaxBlockSize || s.head_dim > kMaxHeadDim || s.num_q_heads % s.num_kv_heads)
    return ffi::Error::InvalidArgument("block_size <= 64, head_dim <= 256 and num_q_heads % num_kv_heads == 0");
  const int32_t n = num_seqs.typed_data()[0], lyr = layer.typed_data()[0];
  const int64_t win = window.has_value() ? window->typed_data()[0] : kNoWindow;
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("k_cache and v_cache must have the same dtype");
  const bool q_f32 = q.element_type() == ffi::F32, cache_f32 = k_cache.element_type() == ffi::F32;
  const bool cache_s8 = k_cache.element_type() == ffi::S8;
  if ((!q_f32 && q.element_type() != ffi::BF16) || (!cache_f32 && !cache_s8 && k_cache.element_type() != ffi::BF16))
    return ffi::Error::InvalidArgument(
        "ragged paged attention on CPU takes float32 or bfloat16 q and a float32, bfloat16 or int8 cache");
  auto run = [&](auto* q_data, auto* cache_type) {
    using Q = std::remove_const_t<std::remove_pointer_t<decltype(q_data)>>;
    using C = std::remove_pointer_t<decltype(cache_type)>;
    return Attend<Q, C>(pool, s, q_data, reinterpret_cast<const C*>(k_cache.untyped_data()),
                        reinterpret_cast<const C*>(v_cache.untyped_data()), kv_lens.typed_data(),
                        block_tables.typed_data(), query_start_loc.typed_data(), n, lyr, win, *sm_scale, cap,
                        reinterpret_cast<Q*>(out->untyped_data()));
  };
  const auto* q_float = reinterpret_cast<const float*>(q.untyped_data());
  const auto* q_bf16 = reinterpret_cast<const uint16_t*>(q.untyped_data());
  if (cache_s8) return q_f32 ? run(q_float, static_cast<int8_t*>(nullptr)) : run(q_bf16, static_cast<int8_t*>(nullptr));
  if (q_f32) return cache_f32 ? run(q_float, static_cast<float*>(nullptr)) : run(q_float, static_cast<uint16_t*>(nullptr));
  return cache_f32 ? run(q_bf16, static_cast<float*>(nullptr)) : run(q_bf16, static_cast<uint16_t*>(nullptr));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // window: absent, no window
                                  .Attrs()  // sm_scale, and softcap (absent: no capping)
                                  .Ret<ffi::AnyBuffer>());
