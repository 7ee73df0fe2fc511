// Multi-LoRA for the `cpu` backend: y = residual + each row's own adapter's low-rank update, with
// the rows grouped by their adapter's slot (Punica's BGMV, as S-LoRA and vLLM batch adapters), as
// an XLA FFI custom call (JaxcbBatchedLora).
//
// A group of G projections that read the same input (q/k/v: 3; gate/up: 2; o, down: 1) is one
// call. Per slot s its A sides sit side by side, a[s] = [A_1 | ... | A_G] ([K, C], C = G R padded
// to 16 columns), so a row's shrink is one pass over K: u = x @ a[s] ([C]). Its B sides are kept
// as 16-column panels of the output the call adds to, the layout the base projection writes
// (q, k and v side by side; gate and up in pairs of panels): entry e = (panel p, group g) holds
// B_g's R x 16 block for output columns [16p, 16p + 16), zero where a column is not g's. The
// expand adds u[g R : g R + R] @ b[s, e] to those columns; a panel that straddles two groups has
// two entries. With no residual (empty) the call writes the updates alone: the rows with a slot get
// theirs (zeros where no entry reaches), and base rows are left unwritten, for a kernel that adds
// the rows with a slot and never reads the others (packed_matmul.cc's q/k/v addend).
//
// Two halves alone (`mode`), for a fused kernel that does the rest inside its own tiles
// (packed_matmul.cc's MLP: gate/up's expand before the activation, down's shrink after it):
// kShrink writes u = x @ a[s] ([T, C]) on the rows with a slot; kExpand reads such a u as its x
// and adds u @ b[s] into the residual.
//
// Why not the packed matmul over every slot, masked: a row meets only its own slot's A and B here,
// so a step's work is each row's R columns, not all S R of every slot; and one call replaces the
// matmul's 2 to 4 per group (shrink, then each B) and XLA's masks between them. A base row (slot
// -1) costs nothing: the output aliases the residual.
//
// Arithmetic: float32 x (RMS-normalised on the way in where `norm` is given, as the packed matmul
// does), bf16 weights widened to float32, float32 sums, in vec16.h's 16-float vectors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxcb::vec16::F16;
using jaxcb::vec16::Load;
using jaxcb::vec16::Store;

constexpr int64_t kPanel = 16;  // output columns per B panel
constexpr int64_t kItemRows = 32;  // rows of one slot per work item (a decode step's few, read as bf16)
constexpr int64_t kWideItemRows = 128;  // the same, where the rows widen their slot's weights first
// Shrink tiles: up to 8 rows x 48 columns (24 accumulators of AVX-512's 32).
constexpr int kShrinkRows = 8, kShrinkVectors = 3;
constexpr int kExpandRows = 8;  // expand tile: 8 rows x one panel
constexpr int64_t kAhead = 8192;  // bytes of a weight stream fetched ahead of its reads (into L2)
// An item of this many rows or more widens its slot's bf16 A and B to float32 once, into L2, and
// multiplies from there; fewer rows (a decode step's) read each weight about once, as bf16.
constexpr int64_t kWidenRows = 4;

enum Mode : int32_t { kShrinkExpand = 0, kShrink = 1, kExpand = 2 };

// dst[:n] = src[:n] as float32 (n a multiple of 16).
void Widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += kPanel) Store(dst + i, Load(src + i));
}

// u[r][c0 + :16 NV] = sum_k xs[r][k] * a[k][c0 + :16 NV] for RB rows of xs (row stride K); a has C
// columns; u's row stride is C.
template <int RB, int NV, typename W>
void ShrinkTile(const float* xs, int64_t K, const W* a, int64_t C, float* u) {
  F16 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = F16{};
  for (int64_t k = 0; k < K; ++k) {
    // A's rows stream from memory (a decode step reads each slot's once): fetched into L2 kAhead bytes
    // early, so that more of the stream is in flight than the hardware prefetcher keeps, across 4 KiB
    // pages. A decode call's items ran 1.2x faster than with no prefetch, 1.1x than 1 KiB ahead
    // into L1 (SmolLM2, 8 adapters mixed, 16 rows).
    __builtin_prefetch(reinterpret_cast<const char*>(a + k * C) + kAhead, 0, 2);
    F16 w[NV];
    for (int j = 0; j < NV; ++j) w[j] = Load(a + k * C + kPanel * j);
    for (int r = 0; r < RB; ++r) {
      const float xv = xs[r * K + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) Store(u + r * C + kPanel * j, acc[r][j]);
}

template <typename W, int RB>
void ShrinkRows(const float* xs, int64_t K, const W* a, int64_t C, float* u) {
  for (int64_t c = 0; c < C; c += kPanel * kShrinkVectors) {
    switch (std::min<int64_t>(kShrinkVectors, (C - c) / kPanel)) {
      case 1: ShrinkTile<RB, 1>(xs, K, a + c, C, u + c); break;
      case 2: ShrinkTile<RB, 2>(xs, K, a + c, C, u + c); break;
      default: ShrinkTile<RB, 3>(xs, K, a + c, C, u + c); break;
    }
  }
}

// u [m, C] = xs [m, K] @ a [K, C].
template <typename W>
void Shrink(const float* xs, int64_t m, int64_t K, const W* a, int64_t C, float* u) {
  int64_t r = 0;
  for (; r + kShrinkRows <= m; r += kShrinkRows) ShrinkRows<W, kShrinkRows>(xs + r * K, K, a, C, u + r * C);
  const float* x = xs + r * K;
  float* ur = u + r * C;
  switch (m - r) {
    case 1: ShrinkRows<W, 1>(x, K, a, C, ur); break;
    case 2: ShrinkRows<W, 2>(x, K, a, C, ur); break;
    case 3: ShrinkRows<W, 3>(x, K, a, C, ur); break;
    case 4: ShrinkRows<W, 4>(x, K, a, C, ur); break;
    case 5: ShrinkRows<W, 5>(x, K, a, C, ur); break;
    case 6: ShrinkRows<W, 6>(x, K, a, C, ur); break;
    case 7: ShrinkRows<W, 7>(x, K, a, C, ur); break;
    default: break;
  }
}

// For RB rows: y[row i][panel columns] += sum over the panel's entries of u[i][g R : g R + R] @ b[e].
// u: [RB, C] (row stride C); b: one slot's [E, R, 16]; entries: [E, 2] (panel, group), by panel;
// y[i]: row i of the output (N columns; a last panel may be partial).
template <int RB, typename W>
void ExpandRows(const float* u, int64_t C, int64_t R, const W* b, const int32_t* entries, int64_t E,
                float* const* y, int64_t N, bool set) {
  F16 acc[RB];
  auto flush = [&](int64_t panel) {  // added to y's panel, or (set) stored over it
    const int64_t col = panel * kPanel, cols = std::min<int64_t>(kPanel, N - col);
    for (int i = 0; i < RB; ++i) {
      if (cols == kPanel) {
        Store(y[i] + col, set ? acc[i] : Load(y[i] + col) + acc[i]);
      } else {
        float part[kPanel];
        Store(part, acc[i]);
        for (int64_t c = 0; c < cols; ++c) y[i][col + c] = set ? part[c] : y[i][col + c] + part[c];
      }
    }
  };
  int64_t panel = -1;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t p = entries[2 * e], g = entries[2 * e + 1];
    if (p != panel) {
      if (panel >= 0) flush(panel);
      for (int i = 0; i < RB; ++i) acc[i] = F16{};
      panel = p;
    }
    const W* be = b + e * R * kPanel;
    const float* ug = u + g * R;
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(be + r * kPanel) + kAhead, 0, 2);
      const F16 w = Load(be + r * kPanel);
      for (int i = 0; i < RB; ++i) acc[i] += ug[i * C + r] * w;
    }
  }
  if (panel >= 0) flush(panel);
}

template <typename W>
void Expand(const float* u, int64_t m, int64_t C, int64_t R, const W* b, const int32_t* entries, int64_t E,
            float* const* y, int64_t N, bool set) {
  int64_t i = 0;
  for (; i + kExpandRows <= m; i += kExpandRows)
    ExpandRows<kExpandRows>(u + i * C, C, R, b, entries, E, y + i, N, set);
  const float* ui = u + i * C;
  float* const* yi = y + i;
  switch (m - i) {
    case 1: ExpandRows<1>(ui, C, R, b, entries, E, yi, N, set); break;
    case 2: ExpandRows<2>(ui, C, R, b, entries, E, yi, N, set); break;
    case 3: ExpandRows<3>(ui, C, R, b, entries, E, yi, N, set); break;
    case 4: ExpandRows<4>(ui, C, R, b, entries, E, yi, N, set); break;
    case 5: ExpandRows<5>(ui, C, R, b, entries, E, yi, N, set); break;
    case 6: ExpandRows<6>(ui, C, R, b, entries, E, yi, N, set); break;
    case 7: ExpandRows<7>(ui, C, R, b, entries, E, yi, N, set); break;
    default: break;
  }
}

// Row x, RMS-normalised by `norm` where given (norm[k] * (x[k] * (1 / sqrt(mean(x * x) + eps)))),
// into dst.
void NormRow(const float* x, int64_t K, const float* norm, float eps, float* dst) {
  if (!norm) {
    std::memcpy(dst, x, K * sizeof(float));
    return;
  }
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) sum += x[k] * x[k];
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) dst[k] = norm[k] * (x[k] * scale);
}

template <typename W>
void Run(ffi::ThreadPool& pool, Mode mode, const float* x, int64_t T, int64_t K, const float* norm, float eps,
         const float* residual, const int32_t* slots, int64_t S, const W* a, int64_t C, const W* b, int64_t E,
         int64_t R, const int32_t* entries, float* y, int64_t N) {
  // The rows of each slot, in order (a counting sort); base and padding rows (slot < 0) take no part.
  std::vector<int64_t> start(S + 1, 0), order;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) ++start[slots[t] + 1];
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  order.resize(start[S]);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  }
  struct Item {
    int64_t slot, first, rows;
  };
  const bool shrink = mode != kExpand, expand = mode != kShrink;
  // Without a residual each panel an entry reaches is stored whole by the expand; the others (a
  // group's columns that no projection writes) are zeroed.
  const bool fresh = expand && !residual;
  std::vector<int64_t> unreached;
  if (fresh) {
    std::vector<char> reached((N + kPanel - 1) / kPanel, 0);
    for (int64_t e = 0; e < E; ++e) reached[entries[2 * e]] = 1;
    for (int64_t p = 0; p < static_cast<int64_t>(reached.size()); ++p)
      if (!reached[p]) unreached.push_back(p);
  }
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = start[s], n = start[s + 1] - i >= kWidenRows ? kWideItemRows : kItemRows; i < start[s + 1]; i += n)
      items.push_back({s, i, std::min<int64_t>(n, start[s + 1] - i)});
  if (items.empty()) return;
  jaxcb::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t n) {
    const Item& item = items[n];
    thread_local std::vector<float> xs, u;
    float* rows[kWideItemRows];
    u.resize(item.rows * C);
    if (shrink) xs.resize(item.rows * K);
    for (int64_t i = 0; i < item.rows; ++i) {
      const int64_t t = order[item.first + i];
      if (shrink) NormRow(x + t * K, K, norm, eps, xs.data() + i * K);
      else std::memcpy(u.data() + i * C, x + t * C, C * sizeof(float));  // x is u
      rows[i] = y + t * N;
      for (int64_t p : unreached)
        std::memset(rows[i] + p * kPanel, 0, std::min<int64_t>(kPanel, N - p * kPanel) * sizeof(float));
    }
    const W* as = a + item.slot * K * C;
    const W* bs = b + item.slot * E * R * kPanel;
    auto run = [&](const auto* a_slot, const auto* b_slot) {
      if (shrink) Shrink(xs.data(), item.rows, K, a_slot, C, u.data());
      if (expand) Expand(u.data(), item.rows, C, R, b_slot, entries, E, rows, N, fresh);
      else
        for (int64_t i = 0; i < item.rows; ++i) std::memcpy(rows[i], u.data() + i * C, C * sizeof(float));
    };
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (item.rows >= kWidenRows) {  // the half this mode reads, widened once
        thread_local std::vector<float> aw, bw;
        aw.resize(shrink ? K * C : 0);
        bw.resize(expand ? E * R * kPanel : 0);
        Widen(as, static_cast<int64_t>(aw.size()), aw.data());
        Widen(bs, static_cast<int64_t>(bw.size()), bw.data());
        run(aw.data(), bw.data());
        return;
      }
    }
    run(as, bs);
  });
}

ffi::Error BatchedLoraImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                           ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer a,
                           ffi::AnyBuffer b, ffi::Buffer<ffi::S32> entries, float eps, int32_t mode_attr,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), yd = y->dimensions(), ad = a.dimensions(), bd = b.dimensions(),
             ed = entries.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || ad.size() != 3 || bd.size() != 4 || ed.size() != 2)
    return ffi::Error::InvalidArgument(
        "batched LoRA expects x [T, K], y [T, N], a [S, K, C], b [S, E, R, 16] and entries [E, 2]");
  if (mode_attr < kShrinkExpand || mode_attr > kExpand)
    return ffi::Error::InvalidArgument("batched LoRA: mode " + std::to_string(mode_attr) + " is not 0, 1 or 2");
  const Mode mode = static_cast<Mode>(mode_attr);
  const int64_t T = xd[0], K = xd[1], N = yd[1], S = ad[0], C = ad[2], E = bd[1], R = bd[2];
  const bool has_residual = residual.element_count() > 0 || T * N == 0;
  const auto rd = residual.dimensions();
  const bool residual_fits = !has_residual || (rd.size() == 2 && rd[0] == T && rd[1] == N);
  // kShrink writes u [T, C]; kExpand reads u [T, C] as its x (a's K is then not read).
  const bool shapes_fit = mode == kShrink ? N == C && ad[1] == K && !(has_residual && T * N > 0)
                                          : mode == kExpand ? K == C : ad[1] == K;
  if (!shapes_fit || !residual_fits || yd[0] != T || slots.element_count() != T || bd[0] != S || bd[3] != kPanel ||
      ed[0] != E || ed[1] != 2 || C % kPanel != 0 ||
      (norm_weight.element_count() != 0 && (norm_weight.element_count() != K || mode == kExpand)))
    return ffi::Error::InvalidArgument("batched LoRA: x [" + std::to_string(T) + ", " + std::to_string(K) +
                                       "], residual, slots, a, b, entries and norm do not match (mode " +
                                       std::to_string(mode_attr) + ")");
  if (a.element_type() != b.element_type() ||
      (a.element_type() != ffi::DataType::F32 && a.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("batched LoRA: a and b must both be float32 or both bfloat16");
  const int32_t* ent = entries.typed_data();
  for (int64_t e = 0; e < E && mode != kShrink; ++e) {
    const int64_t p = ent[2 * e], g = ent[2 * e + 1];
    if (p < 0 || p * kPanel >= N || (e > 0 && p < ent[2 * e - 2]) || g < 0 || (g + 1) * R > C)
      return ffi::Error::InvalidArgument("batched LoRA: entry " + std::to_string(e) + " (panel " + std::to_string(p) +
                                         ", group " + std::to_string(g) + ") is out of range or out of order");
  }
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (slot[t] >= S)
      return ffi::Error::InvalidArgument("batched LoRA: row " + std::to_string(t) + " names slot " +
                                         std::to_string(slot[t]) + " of " + std::to_string(S));
  float* out = y->typed_data();
  // The output aliases the residual (base rows are then left as they are); copied where XLA did not.
  const float* res = has_residual && T * N > 0 ? residual.typed_data() : nullptr;
  if (res && out != res) std::memcpy(out, res, T * N * sizeof(float));
  const float* norm = norm_weight.element_count() ? norm_weight.typed_data() : nullptr;
  if (a.element_type() == ffi::DataType::F32)
    Run(pool, mode, x.typed_data(), T, K, norm, eps, res, slot, S, static_cast<const float*>(a.untyped_data()), C,
        static_cast<const float*>(b.untyped_data()), E, R, ent, out, N);
  else
    Run(pool, mode, x.typed_data(), T, K, norm, eps, res, slot, S, static_cast<const uint16_t*>(a.untyped_data()), C,
        static_cast<const uint16_t*>(b.untyped_data()), E, R, ent, out, N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbBatchedLora, BatchedLoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("mode")
                                  .Ret<ffi::Buffer<ffi::F32>>());
