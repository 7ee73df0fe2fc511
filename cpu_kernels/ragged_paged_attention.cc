// Ragged paged attention for CPU, as an XLA FFI custom call.
//
// Same contract as pallas_kernels/ragged_paged_attention_reference.py: q [T, Hq, D], the
// stacked caches [L, Hkv, NB, BS, D], kv_lens [R], block_tables [R, W],
// query_start_loc [R + 1], num_seqs [], layer []; out [T, Hq, D] with padding tokens 0.
//
// Why C++: on CPU the XLA path spends most of its time gathering K/V blocks into fresh
// buffers and in many small ops. Here each (sequence, KV head, tile of query tokens) reads
// its blocks in place from the cache, one block at a time, with an online softmax, and never
// touches a key past its sequence's kv_len (stale slots, even NaN, cannot reach the output).
// Work items are spread over XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokensPerTile = 16;  // query tokens of one sequence per work item
constexpr int64_t kMaxBlockSize = 64;
constexpr int64_t kMaxHeadDim = 256;

inline float Bf16ToFloat(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline void LoadRow(const T* src, float* dst, int64_t n);

template <>
inline void LoadRow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void LoadRow<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

// A cache block's rows as floats: f32 blocks are read in place, bf16 ones converted into `buf`.
inline const float* BlockAsFloat(const float* src, float*, int64_t) { return src; }

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

// One (sequence, KV head, query tile): rows are (token, head-in-group) pairs.
template <typename T>
void AttendTile(const Shapes& s, const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                int32_t kv_len, int32_t q_begin, int32_t q_len, int32_t layer, const WorkItem& item, float sm_scale,
                T* out) {
  const int64_t D = s.head_dim, BS = s.block_size, group = s.num_q_heads / s.num_kv_heads;
  const int64_t tile_tokens = std::min<int64_t>(kTokensPerTile, q_len - item.first_token);
  const int64_t rows = tile_tokens * group;
  // Token i of the q_len new tokens sits at position kv_len - q_len + i.
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + item.first_token;
  const int64_t last_pos = pos0 + tile_tokens - 1;

  std::vector<float> qf(rows * D), acc(rows * D, 0.0f), m(rows, -1e30f), l(rows, 0.0f);
  std::vector<float> kbuf(std::is_same_v<T, float> ? 0 : BS * D), vbuf(kbuf.size());  // bf16 only
  float sc[kMaxBlockSize];
  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const T* src = q + ((q_begin + item.first_token + t) * s.num_q_heads + item.kv_head * group + g) * D;
      LoadRow<T>(src, &qf[row * D], D);
      for (int64_t d = 0; d < D; ++d) qf[row * D + d] *= sm_scale;
    }
  }

  const int64_t head_base = (static_cast<int64_t>(layer) * s.num_kv_heads + item.kv_head) * s.num_blocks;
  const int64_t num_blocks_seen = last_pos / BS + 1;  // causal: the tile's last token sees up to last_pos
  for (int64_t b = 0; b < num_blocks_seen; ++b) {
    const int64_t block_start = b * BS;
    const int64_t keys = std::min<int64_t>(BS, last_pos + 1 - block_start);  // <= kv_len - block_start
    const int64_t offset = (head_base + block_table[b]) * BS * D;
    const float* kb = BlockAsFloat(k_cache + offset, kbuf.data(), keys * D);
    const float* vb = BlockAsFloat(v_cache + offset, vbuf.data(), keys * D);
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t visible = std::min<int64_t>(keys, pos0 + row / group + 1 - block_start);
      if (visible <= 0) continue;
      const float* qr = &qf[row * D];
      float block_max = -1e30f;
      for (int64_t j = 0; j < visible; ++j) {
        const float* kr = &kb[j * D];
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
        sc[j] = dot;
        block_max = std::max(block_max, dot);
      }
      const float m_new = std::max(m[row], block_max);
      const float correction = std::exp(m[row] - m_new);
      float* ar = &acc[row * D];
      float sum = l[row] * correction;
      for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
      for (int64_t j = 0; j < visible; ++j) {
        const float p = std::exp(sc[j] - m_new);
        sum += p;
        const float* vr = &vb[j * D];
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
      }
      l[row] = sum;
      m[row] = m_new;
    }
  }

  float normed[kMaxHeadDim];
  for (int64_t t = 0; t < tile_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
      for (int64_t d = 0; d < D; ++d) normed[d] = acc[row * D + d] * inv;
      T* dst = out + ((q_begin + item.first_token + t) * s.num_q_heads + item.kv_head * group + g) * D;
      StoreRow<T>(normed, dst, D);
    }
  }
}

template <typename T>
ffi::Error Attend(ffi::ThreadPool pool, const Shapes& s, const T* q, const T* k_cache, const T* v_cache,
                  const int32_t* kv_lens, const int32_t* block_tables, const int32_t* qsl, int32_t num_seqs,
                  int32_t layer, float sm_scale, T* out) {
  std::memset(out, 0, s.num_tokens * s.num_q_heads * s.head_dim * sizeof(T));
  if (num_seqs < 0 || num_seqs > s.num_seqs_max)
    return ffi::Error::InvalidArgument("num_seqs=" + std::to_string(num_seqs) + " is outside [0, " +
                                       std::to_string(s.num_seqs_max) + "]");
  if (layer < 0 || layer >= s.num_layers)
    return ffi::Error::InvalidArgument("layer=" + std::to_string(layer) + " is outside [0, " +
                                       std::to_string(s.num_layers) + ")");
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
  const int64_t extra_threads = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  jaxcb::ParallelFor(pool, n, std::max<int64_t>(extra_threads, 0), [&](int64_t i) {
    const WorkItem& item = items[i];
    AttendTile<T>(s, q, k_cache, v_cache, block_tables + item.seq * s.width, kv_lens[item.seq], qsl[item.seq],
                  qsl[item.seq + 1] - qsl[item.seq], layer, item, sm_scale, out);
  });
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                    ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> query_start_loc,
                                    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer, float sm_scale,
                                    ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T, Hq, D], caches [L, Hkv, NB, BS, D], tables [R, W]");
  Shapes s{qd[0], qd[1], qd[2], cd[0], cd[1], cd[2], cd[3], td[0], td[1]};
  if (s.block_size > kMaxBlockSize || s.head_dim > kMaxHeadDim || s.num_q_heads % s.num_kv_heads)
    return ffi::Error::InvalidArgument("block_size <= 64, head_dim <= 256 and num_q_heads % num_kv_heads == 0");
  const int32_t n = num_seqs.typed_data()[0], lyr = layer.typed_data()[0];
  switch (q.element_type()) {
    case ffi::F32:
      return Attend<float>(pool, s, q.typed_data<float>(), k_cache.typed_data<float>(), v_cache.typed_data<float>(),
                           kv_lens.typed_data(), block_tables.typed_data(), query_start_loc.typed_data(), n, lyr,
                           sm_scale, out->typed_data<float>());
    case ffi::BF16:
      return Attend<uint16_t>(pool, s, reinterpret_cast<const uint16_t*>(q.untyped_data()),
                              reinterpret_cast<const uint16_t*>(k_cache.untyped_data()),
                              reinterpret_cast<const uint16_t*>(v_cache.untyped_data()), kv_lens.typed_data(),
                              block_tables.typed_data(), query_start_loc.typed_data(), n, lyr, sm_scale,
                              reinterpret_cast<uint16_t*>(out->untyped_data()));
    default:
      return ffi::Error::InvalidArgument("ragged paged attention on CPU takes float32 or bfloat16");
  }
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
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());
