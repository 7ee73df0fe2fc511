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
//
// With a bf16 cache on a CPU with AMX (once the Python side has probed that it runs here:
// jaxcb.kernels.cpu.attention_path), tiles of 8 or more query rows (prefill, and decode tiles of
// 8 or more query heads a KV head) take AttendTileAmx instead: S = Q K^T and O += P V on AMX
// tiles in bf16 with float32 sums, the online softmax in float32 AVX-512 between them, 64 keys a
// step, 32 query tokens a work item; a float32 q keeps float32 precision (q and P in two bf16
// terms each). Row by row, a prefill tile's float32 FMAs are the bound; on tiles SmolLM2's
// prefill ran 3.5x faster (benchmarks/bench_kernels.py --kernels cache-dtype; docs/benchmarks.md,
// bf16 on CPU). Tiles of fewer rows, float32 and int8 caches, and builds or machines without AMX
// keep the rows path.
//
// On every path, decoding sequences whose block tables start with the same blocks (prefix
// caching's shared prompts) are attended over those blocks together -- all their rows in AMX
// tiles where the AMX path has them, else row by row with each block read once -- then each over
// its own blocks on the rows path (cascade items: FindCascades).

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
#include <utility>
#include <vector>

#include "amx.h"
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

#if defined(JAXCB_AMX)
using jaxcb::EnsureAmxConfig;
#endif

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
  int32_t tokens;  // the tile's query tokens: up to kTokensPerTile (kAmxTokensPerTile on the AMX path)
};

// A cascade item's sequences (FindCascades).
struct Cascade {
  std::vector<int32_t> members;  // decoding sequences
  int64_t blocks;  // the leading blocks all of them hold

  // Where row `row` of the item's KV head kv_head reads its q: member row / group's one new token,
  // query head row % group of the KV head's group.
  int64_t QueryOffset(const Shapes& s, const int32_t* qsl, int64_t kv_head, int64_t row) const {
    const int64_t group = s.num_q_heads / s.num_kv_heads;
    return (static_cast<int64_t>(qsl[members[row / group]]) * s.num_q_heads + kv_head * group + row % group) *
           s.head_dim;
  }
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
inline int64_t KeysSeen(int32_t kv_len, int32_t q_len, const WorkItem& item) {
  return static_cast<int64_t>(kv_len) - q_len + item.first_token + item.tokens;
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
// `from`, when given, holds each row's state after the blocks before from->block (a cascade's
// shared blocks, attended for several sequences at once): the tile goes on from there.
struct RowsState {
  const float* m;    // [rows]: running max of the scaled scores
  const float* l;    // [rows]: running sum
  const float* acc;  // [rows, D]: unnormalised output
  int64_t block;     // the first block still to attend
};

template <typename Q, typename C, typename NextFetch>
void AttendTile(const Shapes& s, const Q* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                int32_t kv_len, int32_t q_begin, int32_t q_len, int32_t layer, int64_t window, const WorkItem& item,
                float sm_scale, const SoftCap& cap, Q* out, NextFetch&& first_block_of_next,
                const RowsState* from = nullptr) {
  const int64_t D = s.head_dim, BS = s.block_size, group = s.num_q_heads / s.num_kv_heads;
  const int64_t tile_tokens = item.tokens;
  const int64_t rows = tile_tokens * group;
  // Token i of the q_len new tokens sits at position kv_len - q_len + i.
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + item.first_token;
  const int64_t last_pos = KeysSeen(kv_len, q_len, item) - 1;

  // Per-thread scratch, grown once: no allocation per work item.
  thread_local std::vector<float> qf, acc, m, l, kbuf, vbuf;
  qf.resize(rows * D);
  if (from != nullptr) {
    acc.assign(from->acc, from->acc + rows * D);
    m.assign(from->m, from->m + rows);
    l.assign(from->l, from->l + rows);
  } else {
    acc.assign(rows * D, 0.0f);
    m.assign(rows, -1e30f);
    l.assign(rows, 0.0f);
  }
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
  const int64_t first_block = std::max<int64_t>(FirstKeySeen(kv_len, q_len, item.first_token, window) / BS,
                                                from != nullptr ? from->block : 0);
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

#if defined(JAXCB_AMX)
// Prefill tiles on AMX (bf16 caches). A tile of many query rows multiplies whole steps of keys at
// once instead of one row at a time: per step of up to 64 consecutive keys (any block size: the
// keys are gathered through the block table row by row), S = Q K^T on tiles (tdpbf16ps, fp32
// sums), the online softmax of S in fp32 AVX-512, P in bf16, then O += P V on tiles. The row
// path's fp32 FMAs run no faster on bf16 operands than on floats (vdpbf16ps did not pay in the
// matmul either); AMX's tile multiply does, once a tile has kAmxMinRows rows. Rows are taken 16
// at a time (an A tile's rows; the last chunk padded with zero rows).
//
// Layouts (AMX's B operand holds 16 "pair-rows", each 16 columns of two bf16 along the depth):
// - Q: bf16 rows as they are, [padded rows][D] (an A tile reads 32 d of 16 rows);
// - K^T for S: B[d / 2][key][2] = K[key][d], i.e. each key's row read as 32-bit pairs and
//   transposed, 16 keys x 16 pairs a tile (16x16 32-bit transposes in registers);
// - P: bf16 [16 rows][64 keys] (an A tile reads 32 keys of 16 rows);
// - V for O: B[key / 2][d][2] = V[key][d], the step's keys two by two, interleaved.
// Keys past the tile's last position (past kv_len: maybe stale, even NaN) and before its first
// window are never read: their K and V rows are zeros in the buffers, and their scores, like
// every score a row may not see (causal, sliding window), are -inf before the max and the exp,
// so their P is 0. Soft-capping applies to the scaled score before the masks, as elsewhere.
constexpr int64_t kAmxStepKeys = 64;  // keys per online-softmax step: S is four 16-key C tiles
// Query tokens per work item on the AMX path: packing a step's keys for the tiles (a quarter of
// the time at 16 tokens) is shared by all the item's rows. 32 ran 5% faster than 16 on SmolLM2's
// prefill, 64 no faster again (the diagonal's masked keys grow with the tile).
constexpr int32_t kAmxTokensPerTile = 32;
// Tiles of fewer rows (decode tiles of small groups) take the rows path: a tile multiply is then
// mostly padding and packing the step's keys costs more than it saves. Measured on SmolLM2's
// heads over 400 keys, AMX against rows: 3 rows 0.68x, 6 rows 1.02x, 8 rows (a decode tile of 8
// query heads a KV head) 1.19x, 9 rows 1.17x, 12 rows 1.39x, 48 rows 2.8x (before the last two
// improvements below: the 16-lane sums and unmasked rows).
constexpr int64_t kAmxMinRows = 8;

// Tiles 0-3: C, 16 rows x 16 floats (S's four 16-key columns, or four 16-wide d columns of P V);
// tiles 4 and 6: A, 16 rows x 32 bf16 (32 d of Q and of its remainder, or 32 keys of P); tile 5:
// B, 16 pair-rows x 16 columns.
const jaxcb::AmxConfig kAttentionAmxConfig = [] {
  jaxcb::AmxConfig config;
  for (int t = 0; t < 7; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  return config;
}();

// The AMX path is taken only once selected (JaxcbSelectAttention), after the Python side has
// run JaxcbProbeAttentionAmx in a child process: until then, and where it fails, the rows path.
std::atomic<bool> g_attention_amx{false};

template <typename T>
T* AlignedScratch(std::vector<char>& buffer, size_t count) {
  const size_t bytes = count * sizeof(T) + 64;
  if (buffer.size() < bytes) buffer.resize(bytes);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<T*>(buffer.data() + (64 - at % 64) % 64);
}

// 16 floats rounded to bf16 (to nearest even, as FloatToBf16; the values here are finite).
inline __m256i ToBf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline __m512 FromBf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Lanes [lo, hi) of 16 (clipped to [0, 16)), as a mask.
inline __mmask16 LaneRange(int64_t lo, int64_t hi) {
  lo = std::clamp<int64_t>(lo, 0, 16);
  hi = std::clamp<int64_t>(hi, 0, 16);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit lanes.
inline void Transpose16x16(__m512i (&r)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Now r[4i + k] holds, in each 128-bit lane L, rows 4i..4i+3's column 4L + k: the 4x4 blocks.
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

// The step's keys as B tiles of S = Q K^T: tile (c, n) (at kt + (4c + n) * 256 words) holds
// d [32c, 32c + 32) of keys [16n, 16n + 16) as B[pair][key]. A null row is a zero key.
inline void PackKeysTransposed(const uint16_t* const* krow, int64_t key_tiles, int64_t D, uint32_t* kt) {
  for (int64_t n = 0; n < key_tiles; ++n)
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const uint16_t* row = krow[16 * n + j];
        r[j] = row ? _mm512_loadu_si512(row + 32 * c) : _mm512_setzero_si512();
      }
      Transpose16x16(r);
      uint32_t* tile = kt + (4 * c + n) * 256;
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) _mm512_store_si512(tile + 16 * p, r[p]);
    }
}

// The step's values as B tiles of O = P V: tile (c, t) (at vv + (c * D / 16 + t) * 256 words)
// holds keys [32c, 32c + 32) two by two, d [16t, 16t + 16): B[pair][d] = (V[2 pair][d], V[2 pair + 1][d]).
// C tiles 0..n-1 (n <= 4) += A x the n B tiles at b, 256 words apart: A is tile 4, plus tile 6 (the
// operand's second bf16 term) when two_terms. Tile numbers are immediates, hence the unrolled cases.
template <bool two_terms>
inline void MultiplyIntoC(const uint32_t* b, int64_t n) {
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (two_terms) _tile_dpbf16ps(0, 6, 5);
  if (n > 1) {
    _tile_loadd(5, b + 256, 64);
    _tile_dpbf16ps(1, 4, 5);
    if constexpr (two_terms) _tile_dpbf16ps(1, 6, 5);
  }
  if (n > 2) {
    _tile_loadd(5, b + 512, 64);
    _tile_dpbf16ps(2, 4, 5);
    if constexpr (two_terms) _tile_dpbf16ps(2, 6, 5);
  }
  if (n > 3) {
    _tile_loadd(5, b + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
    if constexpr (two_terms) _tile_dpbf16ps(3, 6, 5);
  }
}

// C tiles 0..n-1 to dst, tile i at dst + 16 i (16 rows of `ld` bytes each).
inline void StoreC(float* dst, int64_t n, int64_t ld) {
  _tile_stored(0, dst, ld);
  if (n > 1) _tile_stored(1, dst + 16, ld);
  if (n > 2) _tile_stored(2, dst + 32, ld);
  if (n > 3) _tile_stored(3, dst + 48, ld);
}

inline void PackValuePairs(const uint16_t* const* vrow, int64_t key_chunks, int64_t D, uint32_t* vv) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_index = _mm512_load_si512(kLo), hi_index = _mm512_load_si512(kHi);
  const int64_t d_tiles = D / 16;
  for (int64_t c = 0; c < key_chunks; ++c)
    for (int64_t p = 0; p < 16; ++p) {
      const uint16_t *a = vrow[32 * c + 2 * p], *b = vrow[32 * c + 2 * p + 1];
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
        const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
        uint32_t* tile = vv + (c * d_tiles + d / 16) * 256 + 16 * p;
        _mm512_store_si512(tile, _mm512_permutex2var_epi16(x, lo_index, y));
        _mm512_store_si512(tile + 256, _mm512_permutex2var_epi16(x, hi_index, y));
      }
    }
}

// Attention of `rows` query rows of one KV head over keys [first_key, key_end) of one block table
// (a bf16 cache) on AMX tiles (D % 32 == 0): the rows of one sequence's query tile (AttendTileAmx),
// or of several decoding sequences over the blocks they share (a cascade: AttendSharedAmx).
// row_q(row): the row's q (D elements); row_keys(row): the absolute keys [lo, hi) it may see;
// finish(row, m, l, acc): its running max, sum and unnormalised output once every step is done.
template <typename Q, typename RowQ, typename RowKeys, typename Finish>
void AttendRowsAmx(const Shapes& s, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_table,
                   int32_t layer, int64_t kv_head, int64_t rows, int64_t first_key, int64_t key_end, float sm_scale,
                   const SoftCap& cap, RowQ&& row_q, RowKeys&& row_keys, Finish&& finish) {
  const int64_t D = s.head_dim, BS = s.block_size;
  const int64_t chunks = (rows + 15) / 16, padded = 16 * chunks;
  const int64_t d_tiles = D / 16, d_chunks = D / 32;

  // Per-thread scratch, grown once.
  thread_local std::vector<char> qb_buf, qlo_buf, kt_buf, vv_buf, acc_buf, pv_buf, ml_buf;
  uint16_t* qb = AlignedScratch<uint16_t>(qb_buf, padded * D);
  // A float32 q (a float32 model's, or a bf16 model's: its activations are float32) keeps float32
  // precision: q and P are each split in two bf16 terms, hi + lo (to ~2^-16), both multiplied, so
  // the result matches the rows path to ~1e-5 as a float32 computation over the bf16 cache must.
  // Rounding q alone to bf16 moved a score of 10 by ~0.02 (the softmax weights by 2%), rounding P
  // the output by ~7e-4 of its scale. A bf16 q is exact in hi, and its output is rounded to bf16
  // anyway: one term each. The second terms cost tile multiplies, which are not the bound.
  constexpr bool split_q = !std::is_same_v<Q, uint16_t>;
  uint16_t* qlo = split_q ? AlignedScratch<uint16_t>(qlo_buf, padded * D) : nullptr;
  uint32_t* kt = AlignedScratch<uint32_t>(kt_buf, d_chunks * 4 * 256);
  uint32_t* vv = AlignedScratch<uint32_t>(vv_buf, 2 * d_tiles * 256);
  float* acc = AlignedScratch<float>(acc_buf, padded * D);
  float* pv = AlignedScratch<float>(pv_buf, 16 * D);
  // A chunk's scores, its P (and P's second term), each row's correction of its output.
  alignas(64) float sbuf[16 * kAmxStepKeys];
  alignas(64) uint16_t pbuf[16 * kAmxStepKeys], plo[16 * kAmxStepKeys];
  alignas(64) float corr[16];
  // Each row's running max, then its running sum as 16 lanes (summed across once, at the end).
  float* l = AlignedScratch<float>(ml_buf, 17 * padded);
  float* m = l + 16 * padded;
  std::fill(m, m + padded, -1e30f);
  std::fill(l, l + 16 * padded, 0.0f);
  std::fill(acc, acc + padded * D, 0.0f);

  // Q as bf16 rows, unscaled (sm_scale is applied to the fp32 scores: a bf16 q stays exact).
  for (int64_t row = 0; row < padded; ++row) {
    uint16_t* dst = qb + row * D;
    if (row >= rows) {
      std::fill(dst, dst + D, uint16_t{0});
      if constexpr (split_q) std::fill(qlo + row * D, qlo + row * D + D, uint16_t{0});
      continue;
    }
    const Q* src = row_q(row);
    if constexpr (std::is_same_v<Q, uint16_t>) {
      std::memcpy(dst, src, D * sizeof(uint16_t));
    } else {
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = _mm512_loadu_ps(src + d);
        const __m256i hi = ToBf16(x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qlo + row * D + d), ToBf16(_mm512_sub_ps(x, FromBf16(hi))));
      }
    }
  }

  EnsureAmxConfig(kAttentionAmxConfig);
  const int64_t head_base = (static_cast<int64_t>(layer) * s.num_kv_heads + kv_head) * s.num_blocks;
  const __m512 scale = _mm512_set1_ps(sm_scale), minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t k0 = first_key / BS * BS; k0 < key_end; k0 += kAmxStepKeys) {
    const int64_t nk = std::min<int64_t>(kAmxStepKeys, key_end - k0);
    const int64_t key_tiles = (nk + 15) / 16, key_chunks = (nk + 31) / 32;
    // The step's key and value rows in the cache; null (zeros) where no row of the tile looks.
    const uint16_t* krow[kAmxStepKeys];
    const uint16_t* vrow[kAmxStepKeys];
    for (int64_t j = 0; j < 32 * key_chunks; ++j) {
      const int64_t key = k0 + j;
      if (j >= nk || key < first_key) {
        krow[j] = vrow[j] = nullptr;
        continue;
      }
      const int64_t at = ((head_base + block_table[key / BS]) * BS + key % BS) * D;
      krow[j] = k_cache + at;
      vrow[j] = v_cache + at;
    }
    PackKeysTransposed(krow, key_tiles, D, kt);
    PackValuePairs(vrow, key_chunks, D, vv);

    // S = Q K^T for chunk ch's 16 rows x the step's keys, into sb ([16][kAmxStepKeys] floats).
    auto scores = [&](int64_t ch, float* sb) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < d_chunks; ++c) {
        _tile_loadd(4, qb + 16 * ch * D + 32 * c, D * sizeof(uint16_t));
        if constexpr (split_q) _tile_loadd(6, qlo + 16 * ch * D + 32 * c, D * sizeof(uint16_t));
        MultiplyIntoC<split_q>(kt + 4 * c * 256, key_tiles);
      }
      StoreC(sb, key_tiles, kAmxStepKeys * sizeof(float));
    };

    // The online softmax of chunk ch, row by row in float32: its P (bf16, and P's second term for
    // a float32 q) into pb and pl, each row's running max and sum, and its output's correction.
    auto softmax = [&](int64_t ch, const float* sb, uint16_t* pb, uint16_t* pl) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = 16 * ch + r;
        uint16_t *p_row = pb + r * kAmxStepKeys, *lo_row = pl + r * kAmxStepKeys;
        const auto [row_lo, row_hi] = row < rows ? row_keys(row) : std::pair<int64_t, int64_t>{0, 0};
        const int64_t lo = std::max<int64_t>(row_lo, 0) - k0, hi = std::min<int64_t>(row_hi, key_end) - k0;
        if (row >= rows || hi <= lo || hi <= 0) {  // nothing to see in this step: P 0, output as it is
          std::memset(p_row, 0, 32 * key_chunks * sizeof(uint16_t));
          if constexpr (split_q) std::memset(lo_row, 0, 32 * key_chunks * sizeof(uint16_t));
          corr[r] = 1.0f;
          continue;
        }
        __m512 sv[4];
        __m512 mx = minus_inf;
        const bool masked = lo > 0 || hi < 16 * key_tiles;  // most rows see every key of most steps
        for (int64_t v = 0; v < key_tiles; ++v) {
          __m512 x = _mm512_mul_ps(_mm512_load_ps(sb + r * kAmxStepKeys + 16 * v), scale);
          if (cap.on()) x = cap(x);
          sv[v] = masked ? _mm512_mask_mov_ps(minus_inf, LaneRange(lo - 16 * v, hi - 16 * v), x) : x;
          mx = _mm512_max_ps(mx, sv[v]);
        }
        const float m_new = std::max(m[row], _mm512_reduce_max_ps(mx));
        const float correction = m_new == m[row] ? 1.0f : std::exp(m[row] - m_new);  // the max holds: most steps
        const __m512 shift = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t v = 0; v < key_tiles; ++v) {
          const __m512 p = jaxcb::Exp16(_mm512_sub_ps(sv[v], shift));
          const __m256i p_hi = ToBf16(p);
          _mm256_store_si256(reinterpret_cast<__m256i*>(p_row + 16 * v), p_hi);
          if constexpr (split_q) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(lo_row + 16 * v), ToBf16(_mm512_sub_ps(p, FromBf16(p_hi))));
            sum = _mm512_add_ps(sum, p);
          } else {
            sum = _mm512_add_ps(sum, FromBf16(p_hi));  // the sum of the P that multiplies V, as rounded
          }
        }
        if (key_tiles & 1) {  // P's last 32-key column: its second half zero
          _mm256_store_si256(reinterpret_cast<__m256i*>(p_row + 16 * key_tiles), _mm256_setzero_si256());
          if constexpr (split_q)
            _mm256_store_si256(reinterpret_cast<__m256i*>(lo_row + 16 * key_tiles), _mm256_setzero_si256());
        }
        float* l_row = l + 16 * row;
        _mm512_store_ps(l_row, _mm512_fmadd_ps(_mm512_load_ps(l_row), _mm512_set1_ps(correction), sum));
        m[row] = m_new;
        corr[r] = correction;
      }
    };

    // PV = P V for chunk ch (P in pb and pl), four 16-wide d columns at a time, then its rows'
    // outputs O = O * correction + PV.
    auto values = [&](int64_t ch, const uint16_t* pb, const uint16_t* pl) {
      for (int64_t t0 = 0; t0 < d_tiles; t0 += 4) {
        const int64_t nt = std::min<int64_t>(4, d_tiles - t0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < key_chunks; ++c) {
          _tile_loadd(4, pb + 32 * c, kAmxStepKeys * sizeof(uint16_t));
          if constexpr (split_q) _tile_loadd(6, pl + 32 * c, kAmxStepKeys * sizeof(uint16_t));
          MultiplyIntoC<split_q>(vv + (c * d_tiles + t0) * 256, nt);
        }
        StoreC(pv + 16 * t0, nt, D * sizeof(float));
      }
      const int64_t live = std::min<int64_t>(16, rows - 16 * ch);
      for (int64_t r = 0; r < live; ++r) {
        float* o = acc + (16 * ch + r) * D;
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(o + d, _mm512_fmadd_ps(_mm512_load_ps(o + d), c, _mm512_load_ps(pv + r * D + d)));
      }
    };

    // (Multiplying chunk ch + 1's scores between chunk ch's softmax and its P V ran 5% slower.)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      scores(ch, sbuf);
      softmax(ch, sbuf, pbuf, plo);
      values(ch, pbuf, plo);
    }
  }

  for (int64_t row = 0; row < rows; ++row) finish(row, m[row], _mm512_reduce_add_ps(_mm512_load_ps(l + 16 * row)), acc + row * D);
}

// AttendTile for a bf16 cache on AMX tiles (D % 32 == 0). Same arguments and result.
template <typename Q>
void AttendTileAmx(const Shapes& s, const Q* q, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* block_table, int32_t kv_len, int32_t q_begin, int32_t q_len, int32_t layer,
                   int64_t window, const WorkItem& item, float sm_scale, const SoftCap& cap, Q* out) {
  const int64_t D = s.head_dim, group = s.num_q_heads / s.num_kv_heads;
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + item.first_token;
  // Row `row` is query token row / group's head row % group of the KV head's group.
  auto at = [&](int64_t row) {
    return ((q_begin + item.first_token + row / group) * s.num_q_heads + item.kv_head * group + row % group) * D;
  };
  auto row_keys = [&](int64_t row) {
    const int64_t pos = pos0 + row / group;
    return std::pair<int64_t, int64_t>{pos - window + 1, pos + 1};
  };
  AttendRowsAmx<Q>(s, k_cache, v_cache, block_table, layer, item.kv_head, item.tokens * group,
                   FirstKeySeen(kv_len, q_len, item.first_token, window), KeysSeen(kv_len, q_len, item), sm_scale,
                   cap, [&](int64_t row) { return q + at(row); }, row_keys,
                   [&](int64_t row, float, float l, const float* acc) {
                     float normed[kMaxHeadDim];
                     const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                     for (int64_t d = 0; d < D; ++d) normed[d] = acc[d] * inv;
                     StoreRow<Q>(normed, out + at(row), D);
                   });
}

// A cascade's shared blocks for all the members' rows of KV head kv_head on AMX: each row's state
// (running max, sum, unnormalised output) into m, l and acc.
template <typename Q>
void AttendSharedAmx(const Shapes& s, const Q* q, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int32_t* block_tables, const int32_t* qsl, int32_t layer, const Cascade& c, int64_t kv_head,
                     float sm_scale, const SoftCap& cap, float* m, float* l, float* acc) {
  const int64_t D = s.head_dim, group = s.num_q_heads / s.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(c.members.size()) * group, keys = c.blocks * s.block_size;
  AttendRowsAmx<Q>(s, k_cache, v_cache, block_tables + c.members[0] * s.width, layer, kv_head, rows, 0, keys,
                   sm_scale, cap, [&](int64_t row) { return q + c.QueryOffset(s, qsl, kv_head, row); }, [&](int64_t) { return std::pair<int64_t, int64_t>{0, keys}; },
                   [&](int64_t row, float row_m, float row_l, const float* row_acc) {
                     m[row] = row_m;
                     l[row] = row_l;
                     std::memcpy(&acc[row * D], row_acc, D * sizeof(float));
                   });
}
#endif

// Cascade attention for decoding sequences that share leading blocks (prefix caching hands one
// prompt's full blocks to every request that starts with it: a system prompt, few-shot examples,
// a document asked about many times). Attended one sequence at a time, each reads every shared
// block and each KV head's tile has group rows (3 for SmolLM2), too few for AMX. A cascade item
// takes up to kCascadeMaxMembers such sequences and one KV head, attends the shared keys once for
// all their rows on AMX tiles (each shared block packed once, not once per sequence), then goes on
// sequence by sequence over each one's own blocks on the rows path from that state (AttendTile's
// `from`). Only decode rows (one new token, which sits past the shared blocks: every shared key
// is visible to every row) and no sliding window. Without AMX (another CPU, or a float32 or int8
// cache), or with too few rows for a tile, the shared phase runs on the rows path: each shared
// block is still read (and converted to floats) once for all the members' rows.
constexpr int64_t kCascadeMinKeys = 64;  // shared keys worth it: one AMX step
constexpr int64_t kCascadeMinMembers = 2;
constexpr int64_t kCascadeMaxMembers = 16;  // sequences per cascade item: rows = members x group
std::atomic<bool> g_cascade{true};  // JaxcbSetCascade: off only to compare against
std::atomic<int64_t> g_cascade_items[2] = {0, 0};  // cascade items run, shared phase on rows / on AMX (tests)

// Groups the decoding sequences whose block tables start with the same block ids; each group of
// at least `min_members`, sharing at least kCascadeMinKeys keys before every member's new token,
// is a cascade (groups past kCascadeMaxMembers are split).
std::vector<Cascade> FindCascades(const Shapes& s, const int32_t* kv_lens, const int32_t* block_tables,
                                  const int32_t* qsl, int32_t num_seqs, int64_t min_members) {
  const int64_t BS = s.block_size, min_blocks = (kCascadeMinKeys + BS - 1) / BS;
  std::vector<std::pair<int32_t, int32_t>> firsts;  // (first block, sequence) of each candidate
  for (int32_t r = 0; r < num_seqs; ++r)
    if (qsl[r + 1] - qsl[r] == 1 && (kv_lens[r] - 1) / BS >= min_blocks)
      firsts.emplace_back(block_tables[r * s.width], r);
  std::sort(firsts.begin(), firsts.end());
  std::vector<Cascade> cascades;
  for (size_t i = 0; i < firsts.size();) {
    size_t end = i;
    while (end < firsts.size() && firsts[end].first == firsts[i].first &&
           end - i < static_cast<size_t>(kCascadeMaxMembers))
      ++end;
    if (static_cast<int64_t>(end - i) >= min_members) {
      Cascade c{{}, std::numeric_limits<int64_t>::max()};
      const int32_t* lead = block_tables + firsts[i].second * s.width;
      for (size_t j = i; j < end; ++j) {
        const int32_t r = firsts[j].second;
        const int32_t* table = block_tables + r * s.width;
        int64_t common = 0;  // full blocks before the sequence's new token that the lead holds too
        const int64_t full = (kv_lens[r] - 1) / BS;
        while (common < std::min(full, c.blocks) && table[common] == lead[common]) ++common;
        c.blocks = common;
        c.members.push_back(r);
      }
      if (c.blocks >= min_blocks) cascades.push_back(std::move(c));
    }
    i = end;
  }
  return cascades;
}

// A cascade's shared blocks for all the members' rows of KV head kv_head, row by row: each block
// read (converted to floats) once; each row's state into m, l and acc.
template <typename Q, typename C>
void AttendSharedRows(const Shapes& s, const Q* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                      const int32_t* qsl, int32_t layer, const Cascade& c, int64_t kv_head, float sm_scale,
                      const SoftCap& cap, float* m, float* l, float* acc) {
  const int64_t D = s.head_dim, BS = s.block_size, group = s.num_q_heads / s.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(c.members.size()) * group;
  thread_local std::vector<float> qf, kbuf, vbuf;
  qf.resize(rows * D);
  if (!std::is_same_v<C, float>) {
    kbuf.resize(BS * D);
    vbuf.resize(BS * D);
  }
  for (int64_t row = 0; row < rows; ++row) {
    LoadRow<Q>(q + c.QueryOffset(s, qsl, kv_head, row), &qf[row * D], D);
    for (int64_t d = 0; d < D; ++d) qf[row * D + d] *= sm_scale;
  }
  std::fill(m, m + rows, -1e30f);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * D, 0.0f);
  alignas(32) float sc[kMaxBlockSize];
  const int32_t* table = block_tables + c.members[0] * s.width;
  const int64_t head_base = (static_cast<int64_t>(layer) * s.num_kv_heads + kv_head) * s.num_blocks;
  for (int64_t b = 0; b < c.blocks; ++b) {
    if (b + 1 < c.blocks) {  // the next shared block, fetched while this one is attended by every row
      const int64_t next = (head_base + table[b + 1]) * BS * D;
      PrefetchBlock(k_cache + next, BS * D * static_cast<int64_t>(sizeof(C)));
      PrefetchBlock(v_cache + next, BS * D * static_cast<int64_t>(sizeof(C)));
    }
    const int64_t offset = (head_base + table[b]) * BS * D;
    const float* kb = BlockAsFloat(k_cache + offset, kbuf.data(), BS * D);
    const float* vb = BlockAsFloat(v_cache + offset, vbuf.data(), BS * D);
    for (int64_t row = 0; row < rows; ++row)
      AttendRow(&qf[row * D], kb, vb, BS, 0, BS, D, cap, m[row], l[row], &acc[row * D], sc);
  }
}

// One cascade item: the shared blocks for all the members' rows of KV head kv_head (on AMX where
// the build, the cache and the row count allow), then each member's own blocks row by row
// (AttendTile from that state), its output normalised there.
template <typename Q, typename C>
void AttendCascade(const Shapes& s, const Q* q, const C* k_cache, const C* v_cache, const int32_t* kv_lens,
                   const int32_t* block_tables, const int32_t* qsl, int32_t layer, const Cascade& c, int64_t kv_head,
                   float sm_scale, const SoftCap& cap, bool amx, Q* out) {
  const int64_t D = s.head_dim, group = s.num_q_heads / s.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(c.members.size()) * group;
  thread_local std::vector<float> m, l, acc;
  m.resize(rows);
  l.resize(rows);
  acc.resize(rows * D);
  bool on_amx = false;
#if defined(JAXCB_AMX)
  if constexpr (std::is_same_v<C, uint16_t>) {
    if (amx && rows >= kAmxMinRows) {
      const jaxcb::AmxScope scope(true);
      AttendSharedAmx<Q>(s, q, k_cache, v_cache, block_tables, qsl, layer, c, kv_head, sm_scale, cap, m.data(),
                         l.data(), acc.data());
      on_amx = true;
    }
  }
#endif
  (void)amx;
  if (!on_amx)
    AttendSharedRows<Q, C>(s, q, k_cache, v_cache, block_tables, qsl, layer, c, kv_head, sm_scale, cap, m.data(),
                           l.data(), acc.data());
  g_cascade_items[on_amx ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
  for (size_t j = 0; j < c.members.size(); ++j) {
    const int32_t r = c.members[j];
    const RowsState from{&m[j * group], &l[j * group], &acc[j * group * D], c.blocks};
    AttendTile<Q, C>(s, q, k_cache, v_cache, block_tables + r * s.width, kv_lens[r], qsl[r], 1, layer, kNoWindow,
                     WorkItem{r, static_cast<int32_t>(kv_head), 0, 1}, sm_scale, cap, out,
                     [] { return BlockFetch{}; }, &from);
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
  [[maybe_unused]] const int64_t group = s.num_q_heads / s.num_kv_heads;
  [[maybe_unused]] bool amx = false;
  int32_t tokens_per_tile = kTokensPerTile;
#if defined(JAXCB_AMX)
  // Prefill tiles of a bf16 cache on AMX, once selected (and D a multiple of a tile's 32 bf16).
  amx = std::is_same_v<C, uint16_t> && g_attention_amx.load(std::memory_order_relaxed) && s.head_dim % 32 == 0;
  if (amx) {
    jaxcb::g_amx_call.fetch_add(1, std::memory_order_relaxed);
    tokens_per_tile = kAmxTokensPerTile;
  }
#endif
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
    for (int32_t first = 0; first < q_len; first += tokens_per_tile)
      for (int32_t h = 0; h < s.num_kv_heads; ++h)
        items.push_back(WorkItem{r, h, first, std::min<int32_t>(tokens_per_tile, q_len - first)});
  }
  // Cascade items first (the largest), then the others.
  std::vector<Cascade> cascades;
  if (window == kNoWindow && g_cascade.load(std::memory_order_relaxed)) {
    cascades = FindCascades(s, kv_lens, block_tables, qsl, num_seqs, kCascadeMinMembers);
    if (!cascades.empty()) {
      std::vector<char> member(num_seqs, 0);
      for (const Cascade& c : cascades)
        for (int32_t r : c.members) member[r] = 1;
      items.erase(std::remove_if(items.begin(), items.end(),
                                 [&](const WorkItem& item) { return member[item.seq] != 0; }),
                  items.end());
    }
  }
  const int64_t nc = static_cast<int64_t>(cascades.size()) * s.num_kv_heads;
  const int64_t n = nc + static_cast<int64_t>(items.size());
  jaxcb::ParallelFor(pool, n, [&](int64_t i, jaxcb::NextItem& next) {
    if (i < nc)
      return AttendCascade<Q, C>(s, q, k_cache, v_cache, kv_lens, block_tables, qsl, layer,
                                 cascades[i / s.num_kv_heads], i % s.num_kv_heads, sm_scale, cap, amx, out);
    const WorkItem& item = items[i - nc];
    auto first_block_of_next = [&]() -> BlockFetch {
      const int64_t j = next.Claim();
      if (j >= n || j < nc) return {};
      const WorkItem& other = items[j - nc];
      const int32_t q_len = qsl[other.seq + 1] - qsl[other.seq];
      const int64_t first = FirstKeySeen(kv_lens[other.seq], q_len, other.first_token, window) / s.block_size;
      const int64_t keys = std::min<int64_t>(
          s.block_size, KeysSeen(kv_lens[other.seq], q_len, other) - first * s.block_size);
      const int64_t at = ((static_cast<int64_t>(layer) * s.num_kv_heads + other.kv_head) * s.num_blocks +
                          block_tables[other.seq * s.width + first]) * s.block_size * s.head_dim;
      return {reinterpret_cast<const char*>(k_cache + at), reinterpret_cast<const char*>(v_cache + at),
              keys * s.head_dim * static_cast<int64_t>(sizeof(C))};
    };
#if defined(JAXCB_AMX)
    if constexpr (std::is_same_v<C, uint16_t>) {
      const int32_t q_len = qsl[item.seq + 1] - qsl[item.seq];
      if (amx && item.tokens * group >= kAmxMinRows) {
        const jaxcb::AmxScope scope(true);
        return AttendTileAmx<Q>(s, q, k_cache, v_cache, block_tables + item.seq * s.width, kv_lens[item.seq],
                                qsl[item.seq], q_len, layer, window, item, sm_scale, cap, out);
      }
    }
#endif
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

// The attention paths for a bf16 cache, for the Python side (ctypes): 0, rows (every tile row by
// row, in fp32); 1, AMX (prefill tiles on AMX tiles, decode tiles row by row).
extern "C" int JaxcbAttentionPaths() {  // a bit mask of 1 << path: what this build has
#if defined(JAXCB_AMX)
  return 0b11;
#else
  return 0b01;
#endif
}

// 1 when the AMX path computes a prefill tile as the rows path does (to bf16 rounding), 0 when
// not, -1 when this build lacks it or the kernel refuses AMX. An instruction the CPU cannot run
// kills the process: call it in a child process first.
extern "C" int JaxcbProbeAttentionAmx() {
#if defined(JAXCB_AMX)
  if (!jaxcb::RequestAmx()) return -1;
  // One sequence of 40 keys, its last 20 new: 3 query heads over one KV head of 64, blocks of 16.
  constexpr int64_t D = 64, BS = 16, group = 3, kv_len = 40, q_len = 20, blocks = 3;
  const Shapes s{q_len, group, D, 1, 1, blocks, BS, 1, blocks};
  auto value = [](int64_t i) { return static_cast<float>(static_cast<int>((i * 37) % 17) - 8) / 8.0f; };
  std::vector<uint16_t> q(q_len * group * D), k(blocks * BS * D), v(blocks * BS * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = jaxcb::FloatToBf16(value(i));
  for (size_t i = 0; i < k.size(); ++i) k[i] = jaxcb::FloatToBf16(value(3 * i + 1)), v[i] = jaxcb::FloatToBf16(value(5 * i + 2));
  const int32_t table[blocks] = {2, 0, 1};
  std::vector<uint16_t> rows(q.size(), 0), tiles(q.size(), 0);
  const WorkItem item{0, 0, 0, kTokensPerTile};
  {
    const jaxcb::AmxScope scope(true);
    jaxcb::g_amx_call.fetch_add(1);
    AttendTileAmx<uint16_t>(s, q.data(), k.data(), v.data(), table, kv_len, 0, q_len, 0, kNoWindow, item, 0.125f,
                            SoftCap{}, tiles.data());
  }
  AttendTile<uint16_t, uint16_t>(s, q.data(), k.data(), v.data(), table, kv_len, 0, q_len, 0, kNoWindow, item, 0.125f,
                                 SoftCap{}, rows.data(), [] { return BlockFetch{}; });
  for (int64_t i = 0; i < kTokensPerTile * group * D; ++i)
    if (!(std::fabs(jaxcb::Bf16ToFloat(tiles[i]) - jaxcb::Bf16ToFloat(rows[i])) <= 0.03f)) return 0;
  return 1;
#else
  return -1;
#endif
}

// Cascade items (decoding sequences' shared blocks attended for all of them at once; see
// FindCascades): on (1) or off (0), for A/B comparisons and tests; returns the previous setting.
extern "C" int JaxcbSetCascade(int on) { return g_cascade.exchange(on != 0) ? 1 : 0; }

// How many cascade items ran: with their shared phase on AMX tiles (amx 1) or row by row (0).
extern "C" int64_t JaxcbCascadeItems(int amx) { return g_cascade_items[amx ? 1 : 0].load(); }

// Selects the path every later call takes for a bf16 cache (one this build has, and for AMX one
// the kernel allows); returns the path in use.
extern "C" int JaxcbSelectAttention(int path) {
#if defined(JAXCB_AMX)
  if (path == 0 || (path == 1 && jaxcb::RequestAmx())) g_attention_amx.store(path == 1);
  return g_attention_amx.load() ? 1 : 0;
#else
  (void)path;
  return 0;
#endif
}
