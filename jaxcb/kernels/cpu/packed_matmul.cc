// y[M, N] = x[M, K] @ w for float32, with w pre-packed into 16-column panels, as an XLA FFI
// custom call. The linear layers of the model on CPU (`model.linear_impl=cpu`).
//
// Why C++: XLA:CPU's dot streams the weights at a few GB/s when M is a decode step's handful
// of tokens (it re-packs the weight operand on every call), several times under what the
// memory allows. Here the weights are packed once, at load, into panels [P, K, 16]: panel p
// holds columns [16p, 16p + 16) row after row, so a register tile reads its B rows as
// contiguous streams. The tile is 12 rows x 2 panels where the CPU has AVX-512 (twice the
// FMA width of AVX2: an AVX2-only kernel ran at half of XLA's dot there) and 6 rows x 1 panel
// with AVX2; the packed layout is the same for both. Per call only x is packed (chunks of the
// tile's rows, k-major; bf16 weights on AMX: chunks of 16 rows, row-major, multiplied two
// chunks at a time), which is cheap next to the weights. Work items are (block of rows,
// group of panel strips), spread over XLA's intra-op thread pool. Within an item each strip
// is read from memory once and then from L2 by every row chunk; each tile runs over all of K,
// so its outputs stay in registers and are stored once, and the next strip is prefetched a
// few lines per tile, spread over the row chunks; an item's last strip prefetches the first
// strip of the item its thread claims next.
//
// Four calls: the matmul (JaxcbPackedMatmul) and the SwiGLU MLP (JaxcbPackedMlp), which can
// both RMS-normalise x while packing it and add a residual to their outputs, so that a decoder
// layer's norms and residual adds need no XLA ops of their own; the q/k/v projection
// (JaxcbPackedQkv), which also ropes q and k and writes the new K/V rows into the paged cache;
// and the matmul with its row argmax (JaxcbPackedMatmulArgmax), the LM head, which writes its
// product only when asked.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "parallel_for.h"
#include "vec16.h"
#include "vector_exp.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// A float as the element type T it is stored in: itself, or bfloat16 (in a uint16_t).
template <typename T>
inline T Store(float x);
template <>
inline float Store<float>(float x) { return x; }
template <>
inline uint16_t Store<uint16_t>(float x) { return jaxcb::FloatToBf16(x); }

constexpr int64_t kPanel = 16;     // columns per packed panel (one AVX-512 / two AVX2 registers)
// The register tile: kTileRows rows of x by kTilePanels panels of w, its accumulators plus the
// panels' k-th rows and one broadcast of x held in registers (24 + 2 + 1 of AVX-512's 32;
// 12 + 2 + 1 of AVX2's 16).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 12, kTilePanels = 2;
#else
constexpr int64_t kTileRows = 6, kTilePanels = 1;
#endif
// Rows of x per chunk on AMX (bf16 weights): an AMX tile's 16.
constexpr int64_t kAmxRows = 16;
// Rows of x per work item: their packed x (96 rows x 768 f32: 288 KiB) stays in L2.
constexpr int64_t kItemRows = 96;
// On AMX, bf16 x is half the bytes and a strip's weights (read from L3 or memory once per item)
// are the multiply's bound: 384 rows (24 chunks) an item share each strip among 12 pairs of
// chunks, where 96 rows shared it among 3. 1.06-1.15x at 256 rows, 1.01-1.03x at 2,048 (small's
// bf16 chain); their packed x (384 x 1,536 bf16: 1.2 MiB at the widest K) still fits L2.
constexpr int64_t kAmxItemRows = 384;
inline int64_t ItemRows(int64_t slot) { return slot == kAmxRows ? kAmxItemRows : kItemRows; }
// From this many row chunks on (4 pairs a strip), x's A tiles are loaded with the streaming hint
// (AmxTiles' kStreamA). A decode step's few chunks are read again for every strip and stay cached.
constexpr int64_t kStreamAChunks = 8;
#if defined(__AVX2__) && defined(__FMA__)
// The next strip's weights are fetched into L2, not L1: a strip (2 panels x K rows) is larger
// than L1, so its tiles read it from L2 either way, and an L1 prefetch holds one of the core's
// few line-fill buffers for a whole trip to memory. 1.08-1.13x for 1-4 token steps (a pure
// weight stream), 1.02x at 64 (bench_kernels --against).
constexpr auto kWeightHint = _MM_HINT_T1;
#endif

// c[r][:nv] = sum_k a[k * kTileRows + r] * b[k * kPanel + :] for r < R, k < K, over NP panels
// of w side by side (panel j at b + j * K * kPanel; nv counts the tile's valid columns).
// a: one packed chunk of x; b: the first panel; c: the output tile (row stride ldc).
// prefetch[0, lines): 64-byte lines of the panels a later tile reads, fetched (into L2, see
// kWeightHint) evenly over this tile's k loop. Spread over all the row chunks of a strip of panels, they overlap
// the next strip's weight reads with this one's multiplies without a burst of misses in any one tile.
#if defined(__AVX2__) && defined(__FMA__)
// body(k) for k in [0, K), with prefetch[0, lines) fetched evenly along the way: line l goes out
// in the turn of four k that reaches l * K / lines. Four k a turn with one compare for the
// fetches lets the compiler unroll the body whole; a loop cut into segments of K / lines
// (3 k for a 768-deep tile) cost ~7% in loop overhead with the weights in L2.
template <typename Body>
inline __attribute__((always_inline)) void ForEachK(int64_t K, const char* prefetch, int64_t lines, Body&& body) {
  int64_t fetched = 0, k = 0;
  for (; k + 4 <= K; k += 4) {
    while (fetched < lines && fetched * K < (k + 4) * lines) _mm_prefetch(prefetch + 64 * fetched++, kWeightHint);
    body(k);
    body(k + 1);
    body(k + 2);
    body(k + 3);
  }
  for (; k < K; ++k) body(k);
  while (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, kWeightHint);
}
#endif

#if defined(__AVX512F__)
// An AVX-512 tile's accumulators: set to zero, and stored (nv valid columns of NP panels, row stride ldc).
template <int R, int NP>
inline void ZeroTile(__m512 (&acc)[R][NP]) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
}

template <int R, int NP>
inline void StoreTile(const __m512 (&acc)[R][NP], float* c, int64_t ldc, int64_t nv) {
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j) {
    const int64_t cols = std::clamp<int64_t>(nv - j * kPanel, 0, kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(c + r * ldc + j * kPanel, mask, acc[r][j]);
  }
}

template <int R, int NP>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char* prefetch,
          int64_t lines) {
  __m512 acc[R][NP];
  ZeroTile(acc);
  ForEachK(K, prefetch, lines, [&](int64_t k) {
    __m512 bk[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) bk[j] = _mm512_loadu_ps(b + j * K * kPanel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[k * kTileRows + r]);
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(av, bk[j], acc[r][j]);
    }
  });
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j) {
    const int64_t cols = std::clamp<int64_t>(nv - j * kPanel, 0, kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      if (cols == kPanel) _mm512_storeu_ps(c + r * ldc + j * kPanel, acc[r][j]);
      else _mm512_mask_storeu_ps(c + r * ldc + j * kPanel, mask, acc[r][j]);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256i FirstLanes(int64_t n) {  // mask of lanes [0, n), n in [0, 8]
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int R, int NP>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char* prefetch,
          int64_t lines) {
  static_assert(NP == 1, "AVX2 tiles are one panel wide");
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  ForEachK(K, prefetch, lines, [&](int64_t k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kPanel), b1 = _mm256_loadu_ps(b + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * kTileRows + r);
      lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
    }
  });
  if (nv == kPanel) {  // every panel but a matrix's last: plain stores
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(c + r * ldc, lo[r]);
      _mm256_storeu_ps(c + r * ldc + 8, hi[r]);
    }
  } else {
    const __m256i mlo = FirstLanes(std::min<int64_t>(nv, 8)), mhi = FirstLanes(std::max<int64_t>(nv - 8, 0));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_maskstore_ps(c + r * ldc, mlo, lo[r]);
      _mm256_maskstore_ps(c + r * ldc + 8, mhi, hi[r]);
    }
  }
}
#else  // portable: the compiler vectorises what this CPU has
template <int R, int NP>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char*, int64_t) {
  float acc[R][NP * kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < NP * kPanel; ++j) acc[r][j] += a[k * kTileRows + r] * b[(j / kPanel) * K * kPanel + k * kPanel + j % kPanel];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nv; ++j) c[r * ldc + j] = acc[r][j];
}
#endif

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, const char*, int64_t);

using TileTable = std::array<std::array<TileFn, kTileRows + 1>, kTilePanels + 1>;

// table[panels][rows]: the tile Make<rows, panels>::fn for a chunk of that many rows by that many panels.
template <template <int, int> class Make, int NP, int... R>
constexpr std::array<TileFn, kTileRows + 1> TileRow(std::integer_sequence<int, R...>) {
  return {nullptr, Make<R + 1, NP>::fn...};
}
template <template <int, int> class Make, int... NP>
constexpr TileTable MakeTable(std::integer_sequence<int, NP...>) {
  return {std::array<TileFn, kTileRows + 1>{}, TileRow<Make, NP + 1>(std::make_integer_sequence<int, kTileRows>())...};
}
template <template <int, int> class Make>
constexpr TileTable MakeTable() {
  return MakeTable<Make>(std::make_integer_sequence<int, kTilePanels>());
}
template <int R, int NP>
struct F32Tile {
  static constexpr TileFn fn = Tile<R, NP>;
};
constexpr TileTable kTiles = MakeTable<F32Tile>();

// bfloat16 weights. A bf16 matrix is packed as pairs: panel p holds, for each pair of rows
// (2i, 2i + 1) of w, its 16 columns as 32-bit words (row 2i's bf16 in the low half, 2i + 1's in
// the high half: [P, ceil(K / 2), 16] uint32), and x's chunks are packed the same way, rounded to
// bf16 ([ceil(K / 2)][kTileRows] uint32). A pair-row of a panel is 64 bytes, as a float panel's
// row is, so the splitting, prefetching and epilogues are the float kernel's, with K counting
// pairs; only the tile differs. Each product accumulates in float32:
// - kBf16Dot: AVX512-BF16's dot product of pairs (vdpbf16ps), two multiply-adds per lane;
// - kBf16Widen: any other CPU: the pairs are widened to floats (a bf16 is the top half of its
//   float) and multiplied with float FMAs. Half the weight bytes of float32 either way.
// - kBf16Amx: AMX's tile multiply (tdpbf16ps), where the CPU and the kernel allow it. Its A tile
//   reads x's rows as they are, so x's chunks are packed row-major instead, kAmxRows rows of
//   them ([kAmxRows][2 depth] bf16; `RowMajor`); a B tile is 16 pair-rows of one panel, 1 KiB in a row. A bf16 matrix's K
//   is padded to a multiple of 32 (16 pairs, a B tile's rows) for every path, so all paths read
//   the same weights. On a CPU with AMX, vdpbf16ps ran no faster than float FMAs (both ~190
//   GFLOP/s a core on a 12 x 32 tile), so only AMX makes a compute-bound bf16 product faster.
// Which one runs is chosen at run time (JaxcbSelectBf16Matmul): the Python side probes, in a
// child process, that the dot path runs and computes right before it selects it.
enum Bf16Matmul : int { kBf16Widen = 1, kBf16Dot = 2, kBf16Amx = 3 };

#if defined(__AVX512F__)
template <int R, int NP>
void TileBf16Widen(const float* a_, const float* b_, int64_t K, float* c, int64_t ldc, int64_t nv,
                   const char* prefetch, int64_t lines) {
  const auto* a = reinterpret_cast<const uint32_t*>(a_);
  const auto* b = reinterpret_cast<const uint32_t*>(b_);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 acc[R][NP];
  ZeroTile(acc);
  ForEachK(K, prefetch, lines, [&](int64_t k) {
    __m512 even[NP], odd[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      const __m512i v = _mm512_loadu_si512(b + j * K * kPanel + k * kPanel);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(a[k * kTileRows + r]));
      const __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(av, 16)), ao = _mm512_castsi512_ps(_mm512_and_si512(av, high));
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(ao, odd[j], _mm512_fmadd_ps(ae, even[j], acc[r][j]));
    }
  });
  StoreTile(acc, c, ldc, nv);
}
#if defined(__AVX512BF16__)
#define JAXCB_BF16_DOT 1
template <int R, int NP>
void TileBf16Dot(const float* a_, const float* b_, int64_t K, float* c, int64_t ldc, int64_t nv,
                 const char* prefetch, int64_t lines) {
  const auto* a = reinterpret_cast<const uint32_t*>(a_);
  const auto* b = reinterpret_cast<const uint32_t*>(b_);
  __m512 acc[R][NP];
  ZeroTile(acc);
  ForEachK(K, prefetch, lines, [&](int64_t k) {
    __m512bh bk[NP];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) bk[j] = (__m512bh)_mm512_loadu_si512(b + j * K * kPanel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[k * kTileRows + r]));
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bk[j]);
    }
  });
  StoreTile(acc, c, ldc, nv);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, int NP>
void TileBf16Widen(const float* a_, const float* b_, int64_t K, float* c, int64_t ldc, int64_t nv,
                   const char* prefetch, int64_t lines) {
  static_assert(NP == 1, "AVX2 tiles are one panel wide");
  const auto* a = reinterpret_cast<const uint32_t*>(a_);
  const auto* b = reinterpret_cast<const uint32_t*>(b_);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  ForEachK(K, prefetch, lines, [&](int64_t k) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kPanel));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kPanel + 8));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256i av = _mm256_set1_epi32(static_cast<int>(a[k * kTileRows + r]));
      const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(av, 16)), ao = _mm256_castsi256_ps(_mm256_and_si256(av, high));
      lo[r] = _mm256_fmadd_ps(ao, o0, _mm256_fmadd_ps(ae, e0, lo[r]));
      hi[r] = _mm256_fmadd_ps(ao, o1, _mm256_fmadd_ps(ae, e1, hi[r]));
    }
  });
  const __m256i mlo = FirstLanes(std::min<int64_t>(nv, 8)), mhi = FirstLanes(std::max<int64_t>(nv - 8, 0));
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(c + r * ldc, mlo, lo[r]);
    _mm256_maskstore_ps(c + r * ldc + 8, mhi, hi[r]);
  }
}
#else
template <int R, int NP>
void TileBf16Widen(const float* a_, const float* b_, int64_t K, float* c, int64_t ldc, int64_t nv, const char*,
                   int64_t) {
  const auto* a = reinterpret_cast<const uint32_t*>(a_);
  const auto* b = reinterpret_cast<const uint32_t*>(b_);
  float acc[R][NP * kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const uint32_t ap = a[k * kTileRows + r];
      const float ae = jaxcb::Bf16ToFloat(static_cast<uint16_t>(ap)), ao = jaxcb::Bf16ToFloat(static_cast<uint16_t>(ap >> 16));
      for (int64_t j = 0; j < NP * kPanel; ++j) {
        const uint32_t bp = b[(j / kPanel) * K * kPanel + k * kPanel + j % kPanel];
        acc[r][j] += ae * jaxcb::Bf16ToFloat(static_cast<uint16_t>(bp)) + ao * jaxcb::Bf16ToFloat(static_cast<uint16_t>(bp >> 16));
      }
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nv; ++j) c[r * ldc + j] = acc[r][j];
}
#endif

template <int R, int NP>
struct WidenTile {
  static constexpr TileFn fn = TileBf16Widen<R, NP>;
};
constexpr TileTable kTilesBf16Widen = MakeTable<WidenTile>();

using jaxcb::AmxScope;
#if defined(JAXCB_AMX)
#define JAXCB_BF16_AMX 1
using jaxcb::EnsureAmxConfig;
using jaxcb::g_amx_call;
using jaxcb::RequestAmx;
// The tile configuration of a call whose chunks have `rows` rows (at most kAmxRows; a chunk of
// fewer loads and multiplies all of them, the rows past it dropped): C tiles 0-3 (rows of 16
// floats: chunk 0's two panels, then chunk 1's), A tiles 4 and 5 (rows of 32 bf16: chunk 0's,
// chunk 1's) and B tiles 6 and 7 (16 pair-rows of one panel's 16 columns). A tile multiply
// costs about its rows (tdpbf16ps of 8, 12 and 16 rows: 5.3, 6.8 and 10.4 ns in a loop with every
// operand in L1), so a call's tiles are as tall as its tallest chunk: one configuration for all of a
// call's tiles, none reloaded between them.
const std::array<jaxcb::AmxConfig, kAmxRows + 1> kAmxConfigs = [] {
  std::array<jaxcb::AmxConfig, kAmxRows + 1> configs;
  for (int rows = 1; rows <= kAmxRows; ++rows) {
    for (int t : {0, 1, 2, 3, 4, 5}) configs[rows].bytes_per_row[t] = 64, configs[rows].rows[t] = rows;
    for (int t : {6, 7}) configs[rows].bytes_per_row[t] = 64, configs[rows].rows[t] = 16;
  }
  return configs;
}();
#endif
#if defined(JAXCB_BF16_AMX)

// One or two row chunks (a0, and a1 when kPair; rows of 4 * depth bytes, `tile_rows` of them
// read) by NP panels of w (b: depth pair-rows of 64 bytes each) into c0 (and c1): rows0 (rows1)
// rows of nv valid columns, row stride ldc. Two chunks at once is the 2 x 2 blocking the eight
// tiles allow: each B tile loaded serves two multiplies, each A tile two, where one chunk at a
// time loads an A and two Bs for every two. 1.3x the rows per ns of one 12-row chunk at a time
// with the weights in L2 (16-row chunks, a standalone loop). kStreamA loads the A tiles with the
// streaming hint (tileloaddt1), for calls whose strip serves many pairs of chunks in turn (a
// prefill's): x's rows, each read once a strip, then pass through L1 without pushing the strip out
// of it, so that the strip's later pairs read it from L1, not L2.
template <bool kPair, int NP, bool kStreamA = false>
void AmxTiles(const char* a0, const char* a1, int64_t rows0, int64_t rows1, int64_t tile_rows, const char* b,
              int64_t depth, float* c0, float* c1, int64_t ldc, int64_t nv, const char* prefetch, int64_t lines,
              const float* init0 = nullptr, const float* init1 = nullptr) {
  EnsureAmxConfig(kAmxConfigs[tile_rows]);
  const int64_t a_stride = 4 * depth, panel = 64 * depth;
  if (init0 != nullptr) {  // whole tiles only (the caller's check): C starts from init's rows, stride ldc
    const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
    _tile_loadd(0, init0, stride);
    if (NP == 2) _tile_loadd(1, init0 + kPanel, stride);
    if (kPair) _tile_loadd(2, init1, stride);
    if (kPair && NP == 2) _tile_loadd(3, init1 + kPanel, stride);
  } else {
    _tile_zero(0);
    if (NP == 2) _tile_zero(1);
    if (kPair) _tile_zero(2);
    if (kPair && NP == 2) _tile_zero(3);
  }
  const int64_t steps = depth / 16;
  int64_t fetched = 0;
  for (int64_t s = 0; s < steps; ++s) {
    while (fetched < lines && fetched * steps < (s + 1) * lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T1);
    if (kStreamA)
      _tile_stream_loadd(4, a0 + 64 * s, a_stride);
    else
      _tile_loadd(4, a0 + 64 * s, a_stride);
    _tile_loadd(6, b + 1024 * s, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NP == 2) {
      _tile_loadd(7, b + panel + 1024 * s, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (kPair) {
      if (kStreamA)
        _tile_stream_loadd(5, a1 + 64 * s, a_stride);
      else
        _tile_loadd(5, a1 + 64 * s, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  while (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T1);
  if (rows0 == tile_rows && (!kPair || rows1 == tile_rows) && nv == NP * kPanel) {
    // Whole tiles (every chunk of a 2,048-row prefill, of a 32- or 64-row decode): stored straight
    // into c, not copied through a buffer (the copy held ~7-9% of a prefill profile's tile loop).
    const int64_t stride = ldc * static_cast<int64_t>(sizeof(float));
    _tile_stored(0, c0, stride);
    if (NP == 2) _tile_stored(1, c0 + kPanel, stride);
    if (kPair) _tile_stored(2, c1, stride);
    if (kPair && NP == 2) _tile_stored(3, c1 + kPanel, stride);
    return;
  }
  alignas(64) float out[2][NP][kAmxRows][kPanel];
  _tile_stored(0, out[0][0], 64);
  if (NP == 2) _tile_stored(1, out[0][NP - 1], 64);
  if (kPair) _tile_stored(2, out[1][0], 64);
  if (kPair && NP == 2) _tile_stored(3, out[1][NP - 1], 64);
  for (int g = 0; g < (kPair ? 2 : 1); ++g) {
    float* c = g ? c1 : c0;
    const int64_t rows = g ? rows1 : rows0;
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) {
      const int64_t cols = std::clamp<int64_t>(nv - j * kPanel, 0, kPanel);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(c + r * ldc + j * kPanel, mask, _mm512_load_ps(out[g][j][r]));
    }
  }
}

// Multi-LoRA's gate/up update of one chunk whose rows with an adapter all have the same slot (most
// of a prefill's chunks), on the tiles of the call's configuration: both (tile_rows rows of gate's 16
// columns, then up's 16: a row 32 floats) += each row's u @ that slot's B blocks of the pair (bf16,
// rank rows in pairs). ua holds each row's u in bf16, gate's then up's, W = max(R, 32) each; at rank
// 16 gate's is [u, 0] and up's [0, u], so that one B tile (16 pair-rows: the gate block, then the up
// block after it) serves both. A base row's are zeros: it gets +0. Against 4-row runs of float32
// FMAs, one tile multiply per gate and up panel.
inline void AmxLoraPair(float* both, const uint16_t* ua, int64_t W, int64_t R, const uint16_t* b_gate,
                        int64_t tile_rows) {
  EnsureAmxConfig(kAmxConfigs[tile_rows]);
  const int64_t ua_stride = 2 * W * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t kBothStride = 2 * kPanel * sizeof(float);
  _tile_loadd(0, both, kBothStride);
  _tile_loadd(1, both + kPanel, kBothStride);
  if (R == 16) {
    _tile_loadd(6, b_gate, 64);
    _tile_loadd(4, ua, ua_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, ua + W, ua_stride);
    _tile_dpbf16ps(1, 5, 6);
  } else {  // R a multiple of 32: each 32 rank rows one tile of gate's block, one of up's
    const uint16_t* b_up = b_gate + R * kPanel;
    for (int64_t j = 0; j < R / 32; ++j) {
      _tile_loadd(6, b_gate + 32 * kPanel * j, 64);
      _tile_loadd(4, ua + 32 * j, ua_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b_up + 32 * kPanel * j, 64);
      _tile_loadd(5, ua + W + 32 * j, ua_stride);
      _tile_dpbf16ps(1, 5, 7);
    }
  }
  _tile_stored(0, both, kBothStride);
  _tile_stored(1, both + kPanel, kBothStride);
}

// One chunk of R rows as a register tile is called (the probe and the timing at start-up).
template <int R, int NP>
void TileBf16Amx(const float* a, const float* b, int64_t depth, float* c, int64_t ldc, int64_t nv,
                 const char* prefetch, int64_t lines) {
  AmxTiles<false, NP>(reinterpret_cast<const char*>(a), nullptr, R, 0, R, reinterpret_cast<const char*>(b), depth, c,
                      nullptr, ldc, nv, prefetch, lines);
}
template <int R, int NP>
struct AmxTile {
  static constexpr TileFn fn = TileBf16Amx<R, NP>;
};
constexpr TileTable kTilesBf16Amx = MakeTable<AmxTile>();

#endif
#if defined(JAXCB_BF16_DOT)
template <int R, int NP>
struct DotTile {
  static constexpr TileFn fn = TileBf16Dot<R, NP>;
};
constexpr TileTable kTilesBf16Dot = MakeTable<DotTile>();
#endif
// Widening until the Python side has probed and chosen (JaxcbSelectBf16Matmul): it runs anywhere.
std::atomic<int> g_bf16_matmul{kBf16Widen};

// The selected bf16 path, read once per call: a call's chunk slots, layout and tiles all follow
// the same read, even if a test switches paths while it runs.
inline int Bf16MatmulPath() { return g_bf16_matmul.load(std::memory_order_relaxed); }

// The tiles for float32 weights, or for bf16 pairs on the given path.
inline const TileTable& TilesFor(bool pairs, int path) {
#if defined(JAXCB_BF16_AMX)
  if (pairs && path == kBf16Amx) return kTilesBf16Amx;
#endif
#if defined(JAXCB_BF16_DOT)
  if (pairs && path == kBf16Dot) return kTilesBf16Dot;
#endif
  (void)path;
  return pairs ? kTilesBf16Widen : kTiles;
}

// Whether x's chunks are packed row-major (the AMX tiles) rather than k-major.
inline bool RowMajor(bool pairs, int path) {
#if defined(JAXCB_BF16_AMX)
  return pairs && path == kBf16Amx;
#else
  (void)pairs;
  (void)path;
  return false;
#endif
}

#if defined(__AVX512F__)
// Rows t[0, 16) of 16 floats -> t[j] holds column j (lane r: row r's j-th float): a 16 x 16
// transpose in four rounds of shuffles. The packed layouts are k-major ([k][row]), so rows
// read 16 k at a time leave here as 16 k-rows: kTileRows-lane stores instead of one store
// per element.
inline void Transpose16x16(__m512 t[16]) {
  __m512 u[16], v[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // u[2i], u[2i + 1]: rows 2i and 2i + 1 interleaved, per 128-bit lane
    u[2 * i] = _mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // v[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c
    v[4 * i] = _mm512_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 1] = _mm512_shuffle_ps(u[4 * i], u[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    v[4 * i + 2] = _mm512_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 3] = _mm512_shuffle_ps(u[4 * i + 1], u[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // then the 128-bit lanes: columns c, 4 + c, 8 + c and 12 + c
    const __m512 w0 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x88), w1 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xDD);
    const __m512 w2 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x88);
    const __m512 w3 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xDD);
    t[c] = _mm512_shuffle_f32x4(w0, w2, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(w0, w2, 0xDD);
    t[4 + c] = _mm512_shuffle_f32x4(w1, w3, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(w1, w3, 0xDD);
  }
}

constexpr __mmask16 kTileRowLanes = static_cast<__mmask16>((1u << kTileRows) - 1);
#endif

// Rows [m0, m0 + rows) of x [M, K] (rows <= kTileRows) -> one chunk, k-major ([k][row]);
// the tiles never read the rows past `rows` (left as they are, or zeros). With
// AVX-512, 16 k of every row go through one transpose; elsewhere K is walked in blocks, all
// rows per block: row by row over the whole of K, the strided stores (kTileRows floats apart)
// ran ~3x slower at K = 2048. With `norm` ([K], or null) each row is RMS-normalised on the
// way, as the model's rms_norm does: norm[k] * (x[k] * (1 / sqrt(mean(x * x) + eps))), in f32.
void PackChunk(const float* x, int64_t K, int64_t rows, float* dst, const float* norm, float eps) {
  constexpr int64_t kBlock = 64;
  float scale[kTileRows];
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    if (norm)
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * x[r * K + k];
    scale[r] = norm ? 1.0f / std::sqrt(sum / static_cast<float>(K) + eps) : 1.0f;
  }
  int64_t k0 = 0;
#if defined(__AVX512F__)
  // 2.6x the element-wise stores' speed at 64 x 768, on one thread.
  for (; k0 + 16 <= K; k0 += 16) {
    __m512 t[16];
    const __m512 nv = norm ? _mm512_loadu_ps(norm + k0) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r >= rows) {
        t[r] = _mm512_setzero_ps();
        continue;
      }
      const __m512 v = _mm512_loadu_ps(x + r * K + k0);
      t[r] = norm ? _mm512_mul_ps(nv, _mm512_mul_ps(v, _mm512_set1_ps(scale[r]))) : v;
    }
    Transpose16x16(t);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(dst + (k0 + j) * kTileRows, kTileRowLanes, t[j]);
  }
#endif
  for (; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    for (int64_t r = 0; r < rows; ++r) {
      if (norm)
        for (int64_t k = k0; k < k1; ++k) dst[k * kTileRows + r] = norm[k] * (x[r * K + k] * scale[r]);
      else
        for (int64_t k = k0; k < k1; ++k) dst[k * kTileRows + r] = x[r * K + k];
    }
  }
}

// x's M rows in chunks of at most `slot` rows (kTileRows, or kAmxRows), as even as they go: 64
// rows are chunks of 11, 11, 11, 11, 10 and 10, not five of 12 and one of 4. A short chunk's
// tile loads as many weights as a full one and has too few accumulators to hide the FMA latency:
// the 4-row tail cost as much as 6 full rows (64 rows took longer than 66). Chunk i is packed at
// i * slot * depth whatever its rows, so the packed layout is the same.
struct RowChunks {
  int64_t slot, count, base, extra;  // `extra` chunks of base + 1 rows, then chunks of base rows
  RowChunks(int64_t M, int64_t slot_)
      : slot(slot_), count((M + slot - 1) / slot), base(count ? M / count : 0), extra(count ? M % count : 0) {}
  int64_t first_row(int64_t i) const { return i * base + std::min(i, extra); }
  int64_t rows(int64_t i) const { return base + (i < extra ? 1 : 0); }
  int64_t most_rows() const { return base + (extra ? 1 : 0); }  // the tallest chunk's rows
  int64_t offset(int64_t i, int64_t depth) const { return i * slot * depth; }  // chunk i in packed x, in floats
};

// Weights to fetch ahead: `lines` 64-byte lines from `at` (none when lines is 0).
struct Ahead {
  const char* at = nullptr;
  int64_t lines = 0;
};

// The first strip of panels [p, P) of w [P, K, 16]: what an item starting at panel p reads first.
inline Ahead FirstStrip(const float* w, int64_t K, int64_t P, int64_t p) {
  if (p >= P) return {};
  return {reinterpret_cast<const char*>(w + p * K * kPanel), std::min(kTilePanels, P - p) * K};
}

// How a multiply is split into work items: (block of row chunks, group of strips), about four
// items per thread so that the claim-as-you-go loop evens out uneven finishes. With one block of
// rows (a decode step's few tokens) the groups shrink towards the end, to 1 strip at the last:
// the threads then finish within about a strip of each other, where groups of equal size left
// one thread waiting for up to a whole group at the call's end (and at the MLP's barrier before
// down). The full-batch decode step: 1.04-1.11x, the most when the machine is busy and one
// thread falls behind.
struct Split {
  int64_t chunks, per_item, strips, group, groups, items;  // per_item: row chunks per item (ItemRows rows)
  std::vector<int64_t> starts;  // one block of rows: group g is strips [starts[g], starts[g + 1])
  Split(const RowChunks& rows, int64_t strips_, int64_t threads)
      : chunks(rows.count), per_item(ItemRows(rows.slot) / rows.slot), strips(strips_) {
    const int64_t row_blocks = (chunks + per_item - 1) / per_item;
    group = std::clamp<int64_t>(strips * row_blocks / (4 * threads), 1, 16 / kTilePanels);
    groups = (strips + group - 1) / group;
    if (row_blocks == 1) {
      // Each group takes an even share of what is left, at most `group` strips.
      starts.push_back(0);
      for (int64_t s = 0; s < strips;) {
        s += std::clamp<int64_t>((strips - s + threads - 1) / threads, 1, group);
        starts.push_back(s);
      }
      groups = static_cast<int64_t>(starts.size()) - 1;
    }
    items = row_blocks * groups;
  }
  int64_t first_chunk(int64_t item) const { return (item / groups) * per_item; }
  int64_t end_chunk(int64_t item) const { return std::min(chunks, first_chunk(item) + per_item); }
  int64_t first_strip(int64_t item) const { return starts.empty() ? (item % groups) * group : starts[item % groups]; }
  int64_t end_strip(int64_t item) const {
    return starts.empty() ? std::min(strips, first_strip(item) + group) : starts[item % groups + 1];
  }
  // The weights item reads first (none for item -1), of w [P, K, 16] split into strips of kTilePanels.
  Ahead FirstWeights(const float* w, int64_t K, int64_t P, int64_t item) const {
    return item < 0 ? Ahead{} : FirstStrip(w, K, P, first_strip(item) * kTilePanels);
  }
};

// Calls tile(i, n, l0, lines) for the row chunks [c0, c1) in groups of `group`, chunks [i, i + n)
// (the last group may have fewer): the `next_lines` lines of the strip after this one are
// prefetched a share [l0, l0 + lines) per group.
template <typename TileCall>
inline void ForEachRowChunk(int64_t c0, int64_t c1, int64_t group, int64_t next_lines, TileCall&& tile) {
  const int64_t groups = (c1 - c0 + group - 1) / group;
  const int64_t lines_per_group = (next_lines + groups - 1) / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i = c0 + g * group, l0 = std::min(next_lines, g * lines_per_group);
    tile(i, std::min(group, c1 - i), l0, std::min(next_lines, l0 + lines_per_group) - l0);
  }
}

// The tiles a multiply runs on: the register tiles of `table`, one row chunk at a time, or (amx)
// AMX's, two at a time.
struct TilePath {
  const TileTable* table;
  bool amx;
  int64_t group() const { return amx ? 2 : 1; }
  // Whether chunks [i, i + n) by `panels` panels (nv valid columns) fill their AMX tiles: then Run
  // stores the tiles straight into c, and `init`, when given, is where they start from.
  bool WholeAmxTiles(const RowChunks& chunks, int64_t i, int64_t n, int64_t panels, int64_t nv) const {
    if (!amx || nv != panels * kPanel) return false;
    for (int64_t g = 0; g < n; ++g)
      if (chunks.rows(i + g) != chunks.most_rows()) return false;
    return true;
  }
  // Chunks [i, i + n) of x (packed at a, `depth` deep) by `panels` panels of w at b: chunk i + g
  // into c[g] (row stride ldc, nv valid columns), prefetch[0, lines) fetched on the way. `init`
  // (AMX, whole tiles only): per chunk, the rows (stride ldc) the products are added to, in the
  // tiles, instead of starting from zero.
  void Run(const RowChunks& chunks, const float* a, int64_t i, int64_t n, const float* b, int64_t depth,
           int64_t panels, float* const* c, int64_t ldc, int64_t nv, const char* prefetch, int64_t lines,
           const float* const* init = nullptr) const {
    (void)n;  // 1 but on AMX
#if defined(JAXCB_BF16_AMX)
    if (amx) {
      const auto* a0 = reinterpret_cast<const char*>(a + chunks.offset(i, depth));
      const auto* bb = reinterpret_cast<const char*>(b);
      if (n == 2) {
        const auto* a1 = reinterpret_cast<const char*>(a + chunks.offset(i + 1, depth));
        const bool stream_a = chunks.count >= kStreamAChunks;
        const auto tiles = panels == 2 ? (stream_a ? AmxTiles<true, 2, true> : AmxTiles<true, 2>)
                                       : (stream_a ? AmxTiles<true, 1, true> : AmxTiles<true, 1>);
        tiles(a0, a1, chunks.rows(i), chunks.rows(i + 1), chunks.most_rows(), bb, depth, c[0], c[1], ldc, nv, prefetch,
              lines, init ? init[0] : nullptr, init ? init[1] : nullptr);
      } else {
        (panels == 2 ? AmxTiles<false, 2> : AmxTiles<false, 1>)(a0, nullptr, chunks.rows(i), 0, chunks.most_rows(), bb,
                                                                depth, c[0], nullptr, ldc, nv, prefetch, lines,
                                                                init ? init[0] : nullptr, nullptr);
      }
      return;
    }
#endif
    (*table)[panels][chunks.rows(i)](a + chunks.offset(i, depth), b, depth, c[0], ldc, nv, prefetch, lines);
  }
};

// One work item of c[M, N] = x @ w: row chunks [c0, c1) x strips [s0, s1) of w's P panels, x
// packed in a. With `residual` ([M, N], or null) the item adds it to its outputs, tile by tile
// while they are in L1.
// A row's argmax so far, over the columns of one strip group in increasing order: the largest
// value, its first column, and the first column holding a NaN (-1: none).
struct RowBest {
  float value;
  int32_t index, nan_index;
};

// The running argmax of one output row, lane by lane: lane l keeps the largest value among the
// row's columns = l (mod 16) seen so far and its first such column. A tile row updates it with
// compares and blends, no reduction; `Result` reduces the lanes once, at the item's end.
struct alignas(64) RowArgmaxLanes {
  float value[16];
  int32_t index[16];
  int32_t nan_index;

  void Reset() {
    std::fill(value, value + 16, -INFINITY);
    std::fill(index, index + 16, INT32_MAX);  // no value above -inf seen in this lane
    nan_index = -1;
  }

  // Columns [col, col + n) of the row, in v.
  void Fold(const float* v, int64_t n, int64_t col) {
    if (nan_index >= 0) return;
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, n - c0);
#if defined(__AVX512F__)
      const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1);
      const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, v + c0);
      if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) return FirstNan(v + c0, cnt, col + c0);
      const __m512 best = _mm512_load_ps(value);
      const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(col + c0)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_store_ps(value, _mm512_mask_mov_ps(best, gt, x));
      _mm512_store_si512(index, _mm512_mask_mov_epi32(_mm512_load_si512(index), gt, at));
#else
      for (int64_t j = 0; j < cnt; ++j) {
        const float x = v[c0 + j];
        if (std::isnan(x)) return FirstNan(v + c0, cnt, col + c0);
        const int64_t lane = (col + c0 + j) % 16;
        if (x > value[lane]) {
          value[lane] = x;
          index[lane] = static_cast<int32_t>(col + c0 + j);
        }
      }
#endif
    }
  }

  // The group's result; `first_column` is its first column, the answer when every value is -inf.
  RowBest Result(int32_t first_column) const {
    RowBest best{-INFINITY, INT32_MAX, nan_index};
    for (int l = 0; l < 16; ++l)
      if (value[l] > best.value || (value[l] == best.value && index[l] < best.index)) {
        best.value = value[l];
        best.index = index[l];
      }
    if (best.index == INT32_MAX) best.index = first_column;
    return best;
  }

 private:
  void FirstNan(const float* v, int64_t n, int64_t col) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(v[j])) {
        nan_index = static_cast<int32_t>(col + j);
        return;
      }
  }
};

// Where a multiply item's tiles go and what runs on each: the output (c, row stride N) or, for
// a row argmax that needs no output, a scratch tile; an optional residual add; and optionally
// the row argmax, folded into argmax[row - first row of the item].
struct TileSink {
  float* c;
  const float* residual = nullptr;
  RowArgmaxLanes* argmax = nullptr;
  bool write_output = true;
};

// `after_last()` says what the item's last strip fetches ahead: the weights its thread reads next
// (the first strip of its next item, claimed then). Within the item each strip fetches the next,
// which lies right after it. A strip group ends where another thread's begins, so without this
// the first strip of every item came cold from memory: a third of the strips for o and down.
template <typename AfterLast>
void MultiplyItem(const TilePath& path, const float* a, const float* b, int64_t K, int64_t P, int64_t N,
                  const RowChunks& chunks,
                  int64_t c0, int64_t c1, int64_t s0, int64_t s1, const TileSink& sink, AfterLast&& after_last) {
  alignas(64) float scratch[2][kAmxRows * kTilePanels * kPanel];
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t p = s * kTilePanels, panels = std::min(kTilePanels, P - p);
    const float* bp = b + p * K * kPanel;
    const Ahead next = s + 1 < s1 ? FirstStrip(b, K, P, p + panels) : after_last();
    const int64_t nv = std::min(panels * kPanel, N - p * kPanel);
    const int64_t ld = sink.write_output ? N : kTilePanels * kPanel;
    ForEachRowChunk(c0, c1, path.group(), next.lines, [&](int64_t i, int64_t n, int64_t l0, int64_t lines) {
      float* tiles[2];
      for (int64_t g = 0; g < n; ++g)
        tiles[g] = sink.write_output ? sink.c + chunks.first_row(i + g) * N + p * kPanel : scratch[g];
      // On whole AMX tiles the residual is where the tiles' sums start: read once, and no pass over
      // the stored output after it, waiting on the tile stores (SmolLM2's steps 1.02-1.07x).
      const bool residual_in_tiles = sink.residual && sink.write_output && path.WholeAmxTiles(chunks, i, n, panels, nv);
      const float* init[2];
      for (int64_t g = 0; residual_in_tiles && g < n; ++g)
        init[g] = sink.residual + chunks.first_row(i + g) * N + p * kPanel;
      path.Run(chunks, a, i, n, bp, K, panels, tiles, ld, nv, next.at + 64 * l0, lines,
               residual_in_tiles ? init : nullptr);
      for (int64_t g = 0; g < n; ++g) {
        const int64_t m = chunks.first_row(i + g), rows = chunks.rows(i + g);
        float* tile = tiles[g];
        if (sink.residual && !residual_in_tiles)
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < nv; ++j) tile[r * ld + j] += sink.residual[(m + r) * N + p * kPanel + j];
        if (sink.argmax)
          for (int64_t r = 0; r < rows; ++r)
            sink.argmax[m + r - chunks.first_row(c0)].Fold(tile + r * ld, nv, p * kPanel);
      }
    });
  }
}

// silu(g[j]) * u[j] for j < n <= kPanel. The sigmoid goes through exp(-|g|) <= 1, the domain
// of the vector exp: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below.
#if defined(__AVX512F__)
// In one register, lanes past n 0: the MLP transposes 16 rows of them into h's packed layout.
inline __m512 SiluTimes16(const float* g, const float* u, int64_t n) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  const __m512 gv = _mm512_maskz_loadu_ps(mask, g), uv = _mm512_maskz_loadu_ps(mask, u);
  const __m512 e = jaxcb::Exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
  const __m512 sig = _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ), inv, e);
  return _mm512_mul_ps(_mm512_mul_ps(gv, uv), sig);
}
#else
// Into out[0, n).
inline void SiluTimes(const float* g, const float* u, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const __m256i mask = FirstLanes(std::min<int64_t>(n - j0, 8));
    const __m256 gv = _mm256_maskload_ps(g + j0, mask), uv = _mm256_maskload_ps(u + j0, mask);
    const __m256 e = jaxcb::Exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), gv)));
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(inv, e), _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ));
    _mm256_maskstore_ps(out + j0, mask, _mm256_mul_ps(_mm256_mul_ps(gv, uv), sig));
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(-std::fabs(g[j])), inv = 1.0f / (1.0f + e);
    out[j] = g[j] * u[j] * (g[j] < 0.0f ? e * inv : inv);
  }
#endif
}
#endif

#if defined(__AVX512F__)
// Each lane's float rounded to bf16 (to nearest even, NaN kept a NaN, as FloatToBf16), in the lane's top 16 bits.
inline __m512i Bf16High(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// Two k-rows of a chunk (lane r: row r) as bf16 pairs: even's in the low halves, odd's in the high.
inline __m512i Bf16Pairs(__m512 even, __m512 odd) {
  return _mm512_or_si512(_mm512_srli_epi32(Bf16High(even), 16), Bf16High(odd));
}
#endif

// A packed float chunk [K][kTileRows] -> bf16 pairs [depth][kTileRows], the layout the bf16
// tiles read (k past K: zeros).
void PairChunk(const float* src, int64_t K, int64_t depth, uint32_t* dst) {
  for (int64_t k = 0; k < 2 * depth; k += 2) {
    const float* even = src + k * kTileRows;
    if (k >= K) {
      std::fill(dst + (k / 2) * kTileRows, dst + (k / 2 + 1) * kTileRows, 0u);
      continue;
    }
    const bool has_odd = k + 1 < K;
#if defined(__AVX512F__)
    const __m512 e = _mm512_maskz_loadu_ps(kTileRowLanes, even);
    const __m512 o = has_odd ? _mm512_maskz_loadu_ps(kTileRowLanes, even + kTileRows) : _mm512_setzero_ps();
    _mm512_mask_storeu_epi32(dst + (k / 2) * kTileRows, kTileRowLanes, Bf16Pairs(e, o));
#else
    for (int64_t r = 0; r < kTileRows; ++r)
      dst[(k / 2) * kTileRows + r] = jaxcb::FloatToBf16(even[r]) |
                                     (has_odd ? static_cast<uint32_t>(jaxcb::FloatToBf16(even[kTileRows + r])) << 16 : 0u);
#endif
  }
}

// `size` floats of `buffer` (grown as needed, never shrunk) from a 64-byte boundary. A tile row
// that straddles two cache lines loads at about a third of the speed (AMX: 1.17 against 0.42 us
// for a 12 x 32 x 576 tile).
inline float* Aligned(std::vector<float>& buffer, size_t size) {
  if (buffer.size() < size + 16) buffer.resize(size + 16);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

#if defined(JAXCB_BF16_AMX)
// n floats -> bf16 at dst (rounded as FloatToBf16), n <= 16.
inline void StoreBf16(uint16_t* dst, __m512 v, int64_t n) {
  const __m512i bits = _mm512_srli_epi32(Bf16High(v), 16);
  _mm512_mask_cvtepi32_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1), bits);
}
#endif

// Rows [0, rows) of x [., K] -> bf16 rows of width 2 * depth (k past K: zeros) at dst, row
// stride 2 * depth: the chunk layout of the AMX tiles. `norm` as in PackChunk.
void PackChunkRowMajor(const float* x, int64_t K, int64_t rows, int64_t depth, uint16_t* dst, const float* norm,
                       float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * K;
    uint16_t* out = dst + r * 2 * depth;
    float scale = 1.0f;
    if (norm) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += row[k] * row[k];
      scale = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
    }
    int64_t k = 0;
#if defined(JAXCB_BF16_AMX)
    for (; k < K; k += 16) {
      const int64_t n = std::min<int64_t>(16, K - k);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512 v = _mm512_maskz_loadu_ps(mask, row + k);
      if (norm) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, norm + k), _mm512_mul_ps(v, _mm512_set1_ps(scale)));
      StoreBf16(out + k, v, n);
    }
#endif
    for (; k < K; ++k) out[k] = jaxcb::FloatToBf16(norm ? norm[k] * (row[k] * scale) : row[k]);
    std::fill(out + K, out + 2 * depth, uint16_t{0});
  }
}

// The rows of packed x (and of the packed weights it meets): K for float32 weights; for bf16,
// pairs of K padded to a multiple of 32 (zeros).
inline int64_t PackedDepth(int64_t K, bool pairs) { return pairs ? (K + 31) / 32 * 16 : K; }

// x [M, K] -> its chunks, packed into a by items [0, chunks) of a ParallelFor: floats for float32
// weights, bf16 pairs (rounded) for bf16 weights.
struct PackedRows {
  const float* x;
  int64_t K;
  RowChunks chunks;
  float* a;
  const float* norm;  // RMS-normalise the rows with this weight on the way (null: as they are)
  float eps;
  bool pairs;
  int64_t depth;  // rows of a packed chunk: PackedDepth(K, pairs)
  bool row_major;  // the AMX tiles' layout (RowMajor)
  const TileTable* table;
  // `path`: the selected bf16 path, read once for the whole call (the default argument).
  PackedRows(const float* x_, int64_t M_, int64_t K_, std::vector<float>& buffer, const float* norm_, float eps_,
             bool pairs_ = false, int path = Bf16MatmulPath())
      : x(x_), K(K_), chunks(M_, RowMajor(pairs_, path) ? kAmxRows : kTileRows), norm(norm_), eps(eps_),
        pairs(pairs_), depth(PackedDepth(K_, pairs_)), row_major(RowMajor(pairs_, path)),
        table(&TilesFor(pairs_, path)) {
#if defined(JAXCB_BF16_AMX)
    if (row_major) g_amx_call.fetch_add(1, std::memory_order_relaxed);
#endif
    // One buffer per calling thread, grown once: no page faults from a fresh allocation per call.
    const size_t size = chunks.count * chunks.slot * depth;
    a = Aligned(buffer, size);
  }
  void Pack(int64_t i) const {
    float* dst = a + chunks.offset(i, depth);
    if (!pairs) return PackChunk(x + chunks.first_row(i) * K, K, chunks.rows(i), dst, norm, eps);
    if (row_major)
      return PackChunkRowMajor(x + chunks.first_row(i) * K, K, chunks.rows(i), depth, reinterpret_cast<uint16_t*>(dst),
                               norm, eps);
    thread_local std::vector<float> chunk;  // the float chunk, then paired into dst
    if (chunk.size() < static_cast<size_t>(kTileRows * K)) chunk.resize(kTileRows * K);
    PackChunk(x + chunks.first_row(i) * K, K, chunks.rows(i), chunk.data(), norm, eps);
    PairChunk(chunk.data(), K, depth, reinterpret_cast<uint32_t*>(dst));
  }
  TilePath path() const { return {table, row_major}; }
};

// The optional inputs: an rms-norm weight [K] and a residual [M, N], each empty when not used.
ffi::Error OptionalInputs(const ffi::Buffer<ffi::F32>& norm, const ffi::Buffer<ffi::F32>& residual, int64_t M,
                          int64_t K, int64_t N, const float** norm_data, const float** residual_data) {
  const auto nd = norm.dimensions(), rd = residual.dimensions();
  const bool has_norm = norm.element_count() > 0, has_residual = residual.element_count() > 0;
  if (has_norm && (nd.size() != 1 || nd[0] != K))
    return ffi::Error::InvalidArgument("the rms-norm weight must be [K=" + std::to_string(K) + "] or empty");
  if (has_residual && (rd.size() != 2 || rd[0] != M || rd[1] != N))
    return ffi::Error::InvalidArgument("the residual must be [M=" + std::to_string(M) + ", N=" + std::to_string(N) +
                                       "] or empty");
  *norm_data = has_norm ? norm.typed_data() : nullptr;
  *residual_data = has_residual ? residual.typed_data() : nullptr;
  return ffi::Error::Success();
}

// Whether a packed weight holds bf16 pairs (uint32) rather than floats; anything else is an error.
ffi::Error PairsOf(const ffi::AnyBuffer& w, const char* name, bool* pairs) {
  *pairs = w.element_type() == ffi::U32;
  if (!*pairs && w.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument(std::string(name) + " must be packed float32, or bf16 pairs as uint32");
  return ffi::Error::Success();
}

inline const float* WeightData(const ffi::AnyBuffer& w) { return static_cast<const float*>(w.untyped_data()); }

// y = residual + x @ w with x all 0 (K = 0, or M rows of nothing).
void ResidualOnly(const float* residual, int64_t M, int64_t N, float* c) {
  if (residual) std::memcpy(c, residual, M * N * sizeof(float));
  else std::memset(c, 0, M * N * sizeof(float));
}

// The rows a call computes: the first `real_rows` (a scalar, clamped to [0, M]) when the operand is
// there, else all M. The engine pads a step's tokens to its bucket's size; the rows past the real
// ones are neither read nor multiplied, and their results are zeros, so that a step costs its
// tokens rather than its bucket.
using RealRowsArg = std::optional<ffi::Buffer<ffi::S32>>;
int64_t RealRows(const RealRowsArg& real_rows, int64_t M) {
  if (!real_rows || real_rows->element_count() == 0) return M;
  return std::clamp<int64_t>(real_rows->typed_data()[0], 0, M);
}

// Rows [m0, m1) of a row-major [*, N] result set to zero.
void ZeroRows(float* c, int64_t m0, int64_t m1, int64_t N) {
  if (m1 > m0) std::memset(c + m0 * N, 0, (m1 - m0) * N * sizeof(float));
}

inline void WaitFor(const std::atomic<int64_t>& count, int64_t target) {
  while (count.load(std::memory_order_acquire) < target) std::this_thread::yield();
}

// One ParallelFor of x's packing, then `multiply(i)` for i in [0, multiply_items), then
// `after(i)` for i in [0, after_items): items [0, chunks) pack x, one chunk each; the multiply
// items after them wait until every chunk is packed, and the `after` items until every
// multiply item is done. Items are claimed in order, so each item one waits for is already
// being run by a running thread: the rounds are shared by the threads, with no second round of
// pool wake-ups.
template <typename Multiply, typename After>
void PackThenMultiply(ffi::ThreadPool& pool, const PackedRows& rows, int64_t multiply_items, Multiply&& multiply,
                      int64_t after_items, After&& after) {
  std::atomic<int64_t> packed{0}, multiplied{0};
  const int64_t chunks = rows.chunks.count;
  jaxcb::ParallelFor(pool, chunks + multiply_items + after_items, [&](int64_t item, jaxcb::NextItem& next) {
    if (item < chunks) {
      rows.Pack(item);
      packed.fetch_add(1, std::memory_order_release);
      return;
    }
    if (item < chunks + multiply_items) {
      const AmxScope amx(rows.row_major);
      WaitFor(packed, chunks);
      // The multiply item this thread runs next, once claimed (-1: none).
      auto next_multiply = [&]() -> int64_t {
        const int64_t j = next.Claim() - chunks;
        return j >= 0 && j < multiply_items ? j : -1;
      };
      multiply(item - chunks, next_multiply);
      multiplied.fetch_add(1, std::memory_order_release);
      return;
    }
    WaitFor(multiplied, multiply_items);
    after(item - chunks - multiply_items);
  });
}

template <typename Multiply>
void PackThenMultiply(ffi::ThreadPool& pool, const PackedRows& rows, int64_t multiply_items, Multiply&& multiply) {
  PackThenMultiply(pool, rows, multiply_items, std::forward<Multiply>(multiply), 0, [](int64_t) {});
}

// y [M, N] = residual + rms_norm(x) @ w, the norm and the residual each optional (empty).
ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> norm_weight, ffi::Buffer<ffi::F32> residual,
                            RealRowsArg real_rows, float eps, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed matmul expects x [M, K], packed w [P, K, 16] and y [M, N]");
  int64_t M = xd[0];
  const int64_t K = xd[1], P = wd[0], N = yd[1];
  bool pairs;
  if (auto error = PairsOf(w, "the matmul's weight", &pairs); error.failure()) return error;
  if (wd[1] != PackedDepth(K, pairs) || wd[2] != kPanel || yd[0] != M || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("packed matmul: x [" + std::to_string(M) + ", " + std::to_string(K) +
                                       "], w [" + std::to_string(P) + ", " + std::to_string(wd[1]) + ", " +
                                       std::to_string(wd[2]) + "] and N=" + std::to_string(N) + " do not agree");
  const float *norm = nullptr, *res = nullptr;
  if (auto error = OptionalInputs(norm_weight, residual, M, K, N, &norm, &res); error.failure()) return error;
  float* c = y->typed_data();
  const int64_t all_rows = M;
  M = RealRows(real_rows, M);
  ZeroRows(c, M, all_rows, N);
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    ResidualOnly(res, M, N, c);
    return ffi::Error::Success();
  }
  thread_local std::vector<float> buffer;
  const PackedRows rows(x.typed_data(), M, K, buffer, norm, eps, pairs);
  const Split split(rows.chunks, (P + kTilePanels - 1) / kTilePanels, std::max<int64_t>(pool.num_threads(), 1));
  const float* wp = WeightData(w);
  const int64_t depth = rows.depth;
  PackThenMultiply(pool, rows, split.items, [&](int64_t item, auto&& next_item) {
    MultiplyItem(rows.path(), rows.a, wp, depth, P, N, rows.chunks, split.first_chunk(item), split.end_chunk(item),
                 split.first_strip(item), split.end_strip(item), TileSink{c, res},
                 [&] { return split.FirstWeights(wp, depth, P, next_item()); });
  });
  return ffi::Error::Success();
}

// Rotary embedding of one head (HF layout: the two halves of the head are the pairs), from
// src to dst: dst[d] = a cos - b sin, dst[d + D/2] = b cos + a sin, a = src[d], b = src[d + D/2].
// Written as the model's x * cos + rotate_half(x) * sin, so that the roundings agree.
template <typename T>
inline void RopeHead(const float* src, const float* cos, const float* sin, int64_t half, T* dst) {
  for (int64_t d = 0; d < half; ++d) {
    const float a = src[d], b = src[d + half];
    dst[d] = Store<T>(a * cos[d] + (-b) * sin[d]);
    dst[d + half] = Store<T>(b * cos[d] + a * sin[d]);
  }
}

// The caches [L, Hkv, NB, BS, D] of one layer, in their element type (float, or uint16_t holding bf16).
template <typename C>
struct LayerCache {
  C* k;
  C* v;
  int64_t num_kv_heads, num_slots, head_dim;  // num_slots = NB * BS
  C* at(C* cache, int64_t h, int64_t slot) const { return cache + (h * num_slots + slot) * head_dim; }
};

// Rows [m0, m1) of the q/k/v product y [M, (Hq + 2 Hkv) D]: q's heads roped into q_out, k's
// roped and v's copied into the caches at their rows' slots (a slot outside the cache is
// padding: dropped, as kv_cache.write_kv drops it). Real tokens never share a slot; the
// engine's padding rows all aim at the null block, where rows of two chunks may land at once:
// which one's values stay there does not matter, since attention never reads the null block.
template <typename C>
void RopeAndWriteRows(const float* y, int64_t m0, int64_t m1, int64_t num_q_heads, const float* cos,
                      const float* sin, const int32_t* slots, const LayerCache<C>& cache, float* q_out) {
  const int64_t D = cache.head_dim, half = D / 2, H = cache.num_kv_heads, N = (num_q_heads + 2 * H) * D;
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = y + m * N;
    const float *c = cos + m * half, *s = sin + m * half;
    for (int64_t h = 0; h < num_q_heads; ++h) RopeHead(row + h * D, c, s, half, q_out + (m * num_q_heads + h) * D);
    if (slots[m] < 0 || slots[m] >= cache.num_slots) continue;
    for (int64_t h = 0; h < H; ++h) {
      RopeHead(row + (num_q_heads + h) * D, c, s, half, cache.at(cache.k, h, slots[m]));
      const float* v = row + (num_q_heads + H + h) * D;
      C* dst = cache.at(cache.v, h, slots[m]);
      for (int64_t d = 0; d < D; ++d) dst[d] = Store<C>(v[d]);
    }
  }
}

// q [M, Hq, D] and one layer's new K/V rows in the paged caches, from the residual stream x
// [M, K]: y = rms_norm(x) @ w (w packed q, k and v side by side: [P, K, 16] for (Hq + 2 Hkv) D
// columns), then rope over q's and k's heads (cos, sin [M, D / 2]), and k's and v's rows
// written to the caches [L, Hkv, NB, BS, D] (f32 or bf16, converted as XLA converts) at
// `slots` [M] of layer `layer`. The caches are aliased to the last two outputs. One call
// where the model had a matmul, two rotary fusions and a cache write: the attention call
// that follows comes right after this one, and finds the pool thread awake.
//
// Multi-LoRA's optional addend (empty when not used): `addend` [M, (Hq + 2 Hkv) D] is added to the
// projection before rope and the cache write, on the rows whose `addend_rows` entry is >= 0 (the
// rows with an adapter; the others' addend rows are never read, so need not be written).
ffi::Error PackedQkvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::F32> norm_weight, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                         ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> addend_buffer,
                         ffi::Buffer<ffi::S32> addend_rows_buffer, RealRowsArg real_rows, float eps,
                         ffi::ResultBuffer<ffi::F32> q, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> v_out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), qd = q->dimensions(), cd = k_cache.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || qd.size() != 3 || cd.size() != 5)
    return ffi::Error::InvalidArgument(
        "packed qkv expects x [M, K], packed w [P, K, 16], q [M, Hq, D] and caches [L, Hkv, NB, BS, D]");
  int64_t M = xd[0];
  const int64_t K = xd[1], P = wd[0], Hq = qd[1], D = qd[2];
  const int64_t L = cd[0], H = cd[1], num_slots = cd[2] * cd[3], N = (Hq + 2 * H) * D;
  bool pairs;
  if (auto error = PairsOf(w, "the q/k/v weight", &pairs); error.failure()) return error;
  if (wd[1] != PackedDepth(K, pairs) || wd[2] != kPanel || qd[0] != M || cd[4] != D || D % 2 || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("packed qkv: x [" + std::to_string(M) + ", " + std::to_string(K) + "], w [" +
                                       std::to_string(P) + ", " + std::to_string(wd[1]) + ", " +
                                       std::to_string(wd[2]) + "], q [" + std::to_string(qd[0]) + ", " +
                                       std::to_string(Hq) + ", " + std::to_string(D) + "] and " +
                                       std::to_string(H) + " KV heads of " + std::to_string(cd[4]) +
                                       " do not agree (w must hold (Hq + 2 Hkv) D columns, D even)");
  const auto vd = v_cache.dimensions(), cosd = cos.dimensions(), sind = sin.dimensions();
  if (vd.size() != 5 || !std::equal(vd.begin(), vd.end(), cd.begin()) ||
      v_cache.element_type() != k_cache.element_type())
    return ffi::Error::InvalidArgument("packed qkv: the k and v caches must have the same shape and dtype");
  if (cosd.size() != 2 || cosd[0] != M || cosd[1] != D / 2 || sind.size() != 2 || sind[0] != M || sind[1] != D / 2)
    return ffi::Error::InvalidArgument("packed qkv: cos and sin must be [M, D / 2] each");
  if (slots.element_count() != M || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("packed qkv: slots must be [M] and layer a scalar");
  const bool f32_cache = k_cache.element_type() == ffi::F32;
  if (!f32_cache && k_cache.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("packed qkv writes a float32 or bfloat16 cache");
  const int64_t lyr = layer.typed_data()[0];
  if (lyr < 0 || lyr >= L)
    return ffi::Error::InvalidArgument("layer=" + std::to_string(lyr) + " is outside [0, " + std::to_string(L) + ")");
  const float* norm = nullptr;
  if (norm_weight.element_count() > 0) {
    const auto nd = norm_weight.dimensions();
    if (nd.size() != 1 || nd[0] != K)
      return ffi::Error::InvalidArgument("the rms-norm weight must be [K=" + std::to_string(K) + "] or empty");
    norm = norm_weight.typed_data();
  }
  const float* addend = addend_buffer.element_count() > 0 ? addend_buffer.typed_data() : nullptr;
  const int32_t* addend_rows = addend_rows_buffer.typed_data();
  if (addend && (addend_buffer.dimensions().size() != 2 || addend_buffer.dimensions()[0] != M ||
                 addend_buffer.dimensions()[1] != N || addend_rows_buffer.element_count() != M))
    return ffi::Error::InvalidArgument("packed qkv: the addend must be [M, " + std::to_string(N) +
                                       "] with addend rows [M], or empty");
  const int64_t all_rows = M;
  M = RealRows(real_rows, M);  // the padding rows' q: zeros; their K/V: not written
  ZeroRows(q->typed_data(), M, all_rows, Hq * D);
  if (M == 0 || N == 0) return ffi::Error::Success();
  thread_local std::vector<float> buffer, y_buffer;
  if (y_buffer.size() < static_cast<size_t>(M * N)) y_buffer.resize(M * N);
  float* y = y_buffer.data();  // items reach the caller's buffer through this local
  // (K = 0 needs no case of its own: the tiles run over no k and store zeros.)
  const PackedRows rows(x.typed_data(), M, K, buffer, norm, eps, pairs);
  const Split split(rows.chunks, (P + kTilePanels - 1) / kTilePanels, std::max<int64_t>(pool.num_threads(), 1));
  const float* wp = WeightData(w);
  const int64_t depth = rows.depth;
  const int64_t layer_offset = lyr * H * num_slots * D;  // the layer's first row, in elements
  // Once every column is there: rope and write one chunk of rows per item.
  auto rope_and_write = [&](int64_t i, auto* cache_type) {
    using C = std::remove_pointer_t<decltype(cache_type)>;
    const LayerCache<C> layer_cache{static_cast<C*>(k_out->untyped_data()) + layer_offset,
                                    static_cast<C*>(v_out->untyped_data()) + layer_offset, H, num_slots, D};
    const int64_t m0 = rows.chunks.first_row(i);
    if (addend)
      for (int64_t m = m0; m < m0 + rows.chunks.rows(i); ++m)
        if (addend_rows[m] >= 0)
          for (int64_t j = 0; j < N; ++j) y[m * N + j] += addend[m * N + j];
    RopeAndWriteRows(y, m0, m0 + rows.chunks.rows(i), Hq, cos.typed_data(), sin.typed_data(), slots.typed_data(),
                     layer_cache, q->typed_data());
  };
  PackThenMultiply(
      pool, rows, split.items,
      [&](int64_t item, auto&& next_item) {
        MultiplyItem(rows.path(), rows.a, wp, depth, P, N, rows.chunks, split.first_chunk(item),
                     split.end_chunk(item), split.first_strip(item), split.end_strip(item), TileSink{y},
                     [&] { return split.FirstWeights(wp, depth, P, next_item()); });
      },
      rows.chunks.count,
      [&](int64_t i) {
        if (f32_cache) rope_and_write(i, static_cast<float*>(nullptr));
        else rope_and_write(i, static_cast<uint16_t*>(nullptr));
      });
  return ffi::Error::Success();
}

// Multi-LoRA inside the MLP (the `cpu` backend's gate/up and down updates; batched_lora.cc has
// the other projections'). A row with slot s gets its gate/up update in its tile, before the
// activation: the gate columns of pair q add u[:R] @ b[s, 2q], the up columns u[R:2R] @ b[s, 2q + 1]
// (u: the row's shrink, from batched_lora.cc's kShrink; b [S, 2Q, R, 16]: each panel's block). Its
// activation's columns go into down's shrink there and then, d += act[16q : 16q + 16] @ a[s, 16q:]
// (a [S, Fd, Cd]), each strip group's sum in its own partial, added up once every pair is done.
// Neither the [M, 2F] update nor the [M, F] activation is written out: in a 512-token step those
// two were most of the MLP's cost under LoRA (written once, read back once, row by row).
struct MlpLora {
  const int32_t* slots;  // [M]: each row's slot, -1 none
  const float* u;  // [M, Cu]: the gate/up shrink
  int64_t Cu, R, num_panels;  // num_panels = 2Q
  const void* b;  // [S, 2Q, R, 16]
  const void* down_a;  // [S, Fd, Cd]
  int64_t Fd, Cd;
  bool bf16;  // b and down_a in bf16 (b's rank rows in pairs: `pair_rows`), else float32
};

// The rows [0, r) of a chunk that have a slot, in runs of one slot of at most kLoraRows: fn(slot,
// rows, n). A run's rows share each B (or down's A) vector loaded and widened, where row by row
// each row of a slot loaded its own (a decode step's 2 rows a slot, a prefill chunk's 16).
constexpr int kLoraRows = 4;
template <typename Fn>
inline void ForEachSlotRun(const int32_t* slots, int64_t r, Fn&& fn) {
  uint32_t left = 0;  // r <= 16
  for (int64_t row = 0; row < r; ++row)
    if (slots[row] >= 0) left |= 1u << row;
  while (left) {
    const int first = __builtin_ctz(left);
    const int32_t s = slots[first];
    int run[kLoraRows], n = 0;
    for (int64_t row = first; row < r && n < kLoraRows; ++row)
      if ((left >> row & 1u) && slots[row] == s) {
        run[n++] = static_cast<int>(row);
        left &= ~(1u << row);
      }
    fn(s, run, n);
  }
}

// f(std::integral_constant<int, n>) for n in [1, kLoraRows]: a run's length as a template argument.
template <typename F>
inline void WithRunLength(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// For N rows of one slot: both[i][:16] += u[i][:R] @ gate, both[i][16:32] += u[i][R:2R] @ up.
// Float32 blocks [R, 16]; bf16 ones with their rows in pairs (`pair_rows`), widened.
template <int N>
void AddPairUpdates(const float* const* u, int64_t R, const float* gate, const float* up, float* const* both) {
  using jaxcb::vec16::F16;
  using jaxcb::vec16::Load;
  F16 g[N], v[N];
  for (int i = 0; i < N; ++i) g[i] = Load(both[i]), v[i] = Load(both[i] + kPanel);
  for (int64_t r = 0; r < R; ++r) {
    const F16 gw = Load(gate + r * kPanel), uw = Load(up + r * kPanel);
    for (int i = 0; i < N; ++i) {
      g[i] += u[i][r] * gw;
      v[i] += u[i][R + r] * uw;
    }
  }
  for (int i = 0; i < N; ++i) jaxcb::vec16::Store(both[i], g[i]), jaxcb::vec16::Store(both[i] + kPanel, v[i]);
}

template <int N>
void AddPairUpdates(const float* const* u, int64_t R, const uint16_t* gate, const uint16_t* up, float* const* both) {
  using jaxcb::vec16::F16;
  using jaxcb::vec16::Load;
  using jaxcb::vec16::LoadPair;
  F16 g[N], v[N];
  for (int i = 0; i < N; ++i) g[i] = Load(both[i]), v[i] = Load(both[i] + kPanel);
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    F16 ge, go, ue, uo;
    LoadPair(gate + r * kPanel, ge, go);
    LoadPair(up + r * kPanel, ue, uo);
    for (int i = 0; i < N; ++i) {
      g[i] += u[i][r] * ge + u[i][r + 1] * go;
      v[i] += u[i][R + r] * ue + u[i][R + r + 1] * uo;
    }
  }
  if (r < R) {  // an odd rank's last row, as it is
    const F16 gw = Load(gate + r * kPanel), uw = Load(up + r * kPanel);
    for (int i = 0; i < N; ++i) g[i] += u[i][r] * gw, v[i] += u[i][R + r] * uw;
  }
  for (int i = 0; i < N; ++i) jaxcb::vec16::Store(both[i], g[i]), jaxcb::vec16::Store(both[i] + kPanel, v[i]);
}

// For N rows of one slot: d[i][:Cd] += act[i][:cols] @ a[:cols, :Cd] (a's rows Cd wide).
template <int N, typename W>
void AddDownShrinks(const float* const* act, int64_t cols, const W* a, int64_t Cd, float* const* d) {
  using jaxcb::vec16::F16;
  using jaxcb::vec16::Load;
  for (int64_t c = 0; c < Cd; c += kPanel) {
    F16 sum[N];
    for (int i = 0; i < N; ++i) sum[i] = Load(d[i] + c);
    for (int64_t j = 0; j < cols; ++j) {
      const F16 w = Load(a + j * Cd + c);
      for (int i = 0; i < N; ++i) sum[i] += act[i][j] * w;
    }
    for (int i = 0; i < N; ++i) jaxcb::vec16::Store(d[i] + c, sum[i]);
  }
}

// y [M, N] = (silu(x @ gate) * (x @ up)) @ down in one call: the SwiGLU MLP. gate_up holds
// gate's and up's panels in pairs [2Q, K, 16] (gate's panel q at 2q, up's at 2q + 1), down
// is packed [P, F, 16]. Three rounds of items in one ParallelFor, each waiting for the one
// before: x's chunks are packed; each pair of panels is multiplied and its 16 columns of
// silu(gate) * up are written straight into the packed layout of down's input h; then h @ down.
// Against two matmuls and XLA's SwiGLU in between, this saves packing h (K = F, the largest
// x of the layer), writing and reading the [M, 2F] gate/up product, and one pool wake-up.
// With the optional rms-norm weight and residual of PackedMatmulImpl: y = residual + mlp(rms_norm(x)).
// Multi-LoRA's gate/up and down updates: with `lora_slots` and the rest (MlpLora, above), down_u [M, Cd]
// holds down's shrink of each row with a slot (zeros for a row without); every LoRA operand and result
// empty otherwise.
ffi::Error PackedMlpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                         ffi::Buffer<ffi::F32> norm_weight, ffi::Buffer<ffi::F32> residual,
                         ffi::Buffer<ffi::S32> lora_slots, ffi::Buffer<ffi::F32> gate_up_u, ffi::AnyBuffer gate_up_b,
                         ffi::AnyBuffer down_a, RealRowsArg real_rows, float eps, ffi::ResultBuffer<ffi::F32> y,
                         ffi::ResultBuffer<ffi::F32> down_u) {
  const auto xd = x.dimensions(), gd = gate_up.dimensions(), dd = down.dimensions(), yd = y->dimensions(),
             ud = gate_up_u.dimensions(), bd = gate_up_b.dimensions(), ad = down_a.dimensions(),
             dud = down_u->dimensions();
  if (xd.size() != 2 || gd.size() != 3 || dd.size() != 3 || yd.size() != 2 || ud.size() != 2 || bd.size() != 4 ||
      ad.size() != 3 || dud.size() != 2)
    return ffi::Error::InvalidArgument(
        "packed mlp expects x [M, K], packed gate/up pairs [2Q, K, 16], packed down [P, F, 16], y [M, N], and for "
        "LoRA (else empty) slots [M], u [M, Cu], b [S, 2Q, R, 16], down's a [S, Fd, Cd] and down's u [M, Cd]");
  bool bf16, down_bf16;
  if (auto error = PairsOf(gate_up, "the gate/up weight", &bf16); error.failure()) return error;
  if (auto error = PairsOf(down, "the down weight", &down_bf16); error.failure()) return error;
  if (bf16 != down_bf16) return ffi::Error::InvalidArgument("packed mlp: gate/up and down must be packed alike");
  // down's packed depth is F (floats) or PackedDepth(F) pairs. bf16 gate/up come padded to a
  // multiple of 32 columns (pack_gate_up), zeros, which down's padding rows meet: silu(0) * 0 adds
  // nothing, and every panel is whole.
  int64_t M = xd[0];
  const int64_t K = xd[1], Q = gd[0] / 2, P = dd[0], N = yd[1];
  const int64_t F = bf16 ? kPanel * Q : dd[1], h_depth = dd[1];
  if (gd[0] % 2 || gd[1] != PackedDepth(K, bf16) || gd[2] != kPanel || (F + kPanel - 1) / kPanel != Q ||
      h_depth != PackedDepth(F, bf16) || dd[2] != kPanel ||
      yd[0] != M || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("packed mlp: x [" + std::to_string(M) + ", " + std::to_string(K) +
                                       "], gate/up [" + std::to_string(gd[0]) + ", " + std::to_string(gd[1]) +
                                       ", " + std::to_string(gd[2]) + "], down [" + std::to_string(P) + ", " +
                                       std::to_string(F) + ", " + std::to_string(dd[2]) + "] and N=" +
                                       std::to_string(N) + " do not agree");
  const float *norm = nullptr, *res = nullptr;
  if (auto error = OptionalInputs(norm_weight, residual, M, K, N, &norm, &res); error.failure()) return error;
  std::optional<MlpLora> lora;
  if (dud[1] > 0) {  // down's u has columns: LoRA (without, every LoRA operand and result is empty)
    const int64_t S = bd[0], R = bd[2], Cu = ud[1], Fd = ad[1], Cd = ad[2];
    const auto type = gate_up_b.element_type();
    if (type != down_a.element_type() || (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
      return ffi::Error::InvalidArgument("packed mlp: LoRA's b and down's a must both be float32 or both bfloat16");
    if (lora_slots.element_count() != M || ud[0] != M || Cu < 2 * R || bd[1] != 2 * Q || bd[3] != kPanel ||
        ad[0] != S || Fd > F || Cd % kPanel != 0 || dud[0] != M || dud[1] != Cd)
      return ffi::Error::InvalidArgument(
          "packed mlp: LoRA's slots [" + std::to_string(lora_slots.element_count()) + "], u [" +
          std::to_string(ud[0]) + ", " + std::to_string(Cu) + "], b [" + std::to_string(S) + ", " +
          std::to_string(bd[1]) + ", " + std::to_string(R) + ", " + std::to_string(bd[3]) + "], down's a [" +
          std::to_string(ad[0]) + ", " + std::to_string(Fd) + ", " + std::to_string(Cd) + "] and down's u [" +
          std::to_string(dud[0]) + ", " + std::to_string(dud[1]) + "] do not fit M=" + std::to_string(M) +
          ", 2Q=" + std::to_string(2 * Q) + " and F=" + std::to_string(F));
    const int32_t* slot = lora_slots.typed_data();
    for (int64_t m = 0; m < M; ++m)
      if (slot[m] >= S)
        return ffi::Error::InvalidArgument("packed mlp: row " + std::to_string(m) + " names LoRA slot " +
                                           std::to_string(slot[m]) + " of " + std::to_string(S));
    lora = MlpLora{slot, gate_up_u.typed_data(), Cu, R, 2 * Q, gate_up_b.untyped_data(), down_a.untyped_data(), Fd, Cd,
                   type == ffi::DataType::BF16};
  } else if (lora_slots.element_count() + gate_up_u.element_count() + gate_up_b.element_count() +
                 down_a.element_count() != 0) {
    return ffi::Error::InvalidArgument("packed mlp: LoRA's operands come with down's u [M, Cd], Cd > 0");
  }
  float* c = y->typed_data();
  float* d_out = lora ? down_u->typed_data() : nullptr;
  const int64_t all_rows = M;
  M = RealRows(real_rows, M);
  ZeroRows(c, M, all_rows, N);
  if (d_out) ZeroRows(d_out, M, all_rows, lora->Cd);
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0 || F == 0) {  // silu(0) * 0 = 0
    ResidualOnly(res, M, N, c);
    if (d_out) std::memset(d_out, 0, M * lora->Cd * sizeof(float));
    return ffi::Error::Success();
  }
  thread_local std::vector<float> x_buffer, h_buffer;
  const PackedRows rows(x.typed_data(), M, K, x_buffer, norm, eps, bf16);
  const int64_t depth = rows.depth;
  // down's input, packed as x is: floats, or bf16 pairs (k-major), or bf16 rows (AMX)
  float* h = Aligned(h_buffer, rows.chunks.count * rows.chunks.slot * h_depth);
  const TilePath path = rows.path();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // LoRA's gate/up update on AMX tiles for chunks of one slot (AmxLoraPair): each row's u in bf16,
  // and each chunk's slot (-1: no row with an adapter, -2: rows of two or more).
  thread_local std::vector<uint16_t> ua_buffer;
  std::vector<int32_t> chunk_slot;
  int64_t ua_width = 0;
#if defined(JAXCB_BF16_AMX)
  if (lora && lora->bf16 && rows.row_major && (lora->R == 16 || lora->R % 32 == 0)) {
    const int64_t R = lora->R, W = std::max<int64_t>(R, 32);
    ua_width = W;
    ua_buffer.assign((M + kAmxRows) * 2 * W, 0);  // rows past M: a last chunk's tile reads them
    for (int64_t m = 0; m < M; ++m) {
      if (lora->slots[m] < 0) continue;
      const float* u = lora->u + m * lora->Cu;
      uint16_t* gate = ua_buffer.data() + m * 2 * W;
      uint16_t* up = gate + W + (R == 16 ? 16 : 0);
      for (int64_t j = 0; j < R; ++j) gate[j] = jaxcb::FloatToBf16(u[j]), up[j] = jaxcb::FloatToBf16(u[R + j]);
    }
    chunk_slot.assign(rows.chunks.count, -1);
    for (int64_t i = 0; i < rows.chunks.count; ++i)
      for (int64_t m = rows.chunks.first_row(i), end = m + rows.chunks.rows(i); m < end; ++m)
        if (const int32_t s = lora->slots[m]; s >= 0)
          chunk_slot[i] = chunk_slot[i] == -1 || chunk_slot[i] == s ? s : -2;
  }
#endif
  const uint16_t* ua = ua_buffer.data();  // the pool's threads see this thread's buffer through it
  // A gate/up strip is one pair of panels, whatever the tile's width.
  const Split pairs(rows.chunks, Q, threads), out(rows.chunks, (P + kTilePanels - 1) / kTilePanels, threads);
  const int64_t items = rows.chunks.count + pairs.items + out.items;
  std::atomic<int64_t> packed{0}, paired{0};
  // Down's LoRA shrink: each strip group of gate/up pairs sums its columns' share into its own partial.
  thread_local std::vector<float> partial_buffer;
  float* partial = lora ? Aligned(partial_buffer, pairs.groups * M * lora->Cd) : nullptr;
  const float* gu = WeightData(gate_up);
  const float* dw = WeightData(down);
  // Gate's and up's panels of pair q, side by side.
  auto pair_weights = [&](int64_t q) -> Ahead {
    return {reinterpret_cast<const char*>(gu + 2 * q * depth * kPanel), 2 * depth};
  };
  // What item j (of all three rounds) reads first: a pair of gate/up panels, or a strip of down.
  auto first_weights = [&](int64_t j) -> Ahead {
    j -= rows.chunks.count;
    if (j < 0) return {};
    if (j < pairs.items) return pair_weights(pairs.first_strip(j));
    j -= pairs.items;
    return j < out.items ? out.FirstWeights(dw, h_depth, P, j) : Ahead{};
  };
  jaxcb::ParallelFor(pool, items, [&](int64_t item, jaxcb::NextItem& next_item) {
    const AmxScope amx(rows.row_major && item >= rows.chunks.count);
    if (item < rows.chunks.count) {
      rows.Pack(item);
      packed.fetch_add(1, std::memory_order_release);
      return;
    }
    item -= rows.chunks.count;
    if (item < pairs.items) {
      WaitFor(packed, rows.chunks.count);
      const int64_t group = item % pairs.groups;  // this item's partial of down's LoRA shrink
      if (lora) {
        const int64_t m0 = rows.chunks.first_row(pairs.first_chunk(item));
        const int64_t m1 = pairs.end_chunk(item) < rows.chunks.count ? rows.chunks.first_row(pairs.end_chunk(item)) : M;
        std::memset(partial + (group * M + m0) * lora->Cd, 0, (m1 - m0) * lora->Cd * sizeof(float));
      }
      // The slots of the item's rows: their LoRA blocks of the next pair (gate/up's B, down's A) are
      // fetched while this pair is multiplied, as the base weights are. A decode step's 8 slots are
      // 16 streams of 1 KiB and 512 bytes a pair, which the hardware prefetcher did not keep ahead of:
      // its decode steps 1.05x faster (SmolLM2, 8 adapters mixed).
      std::vector<int32_t> item_slots;
      if (lora) {
        const int64_t m0 = rows.chunks.first_row(pairs.first_chunk(item));
        const int64_t m1 = pairs.end_chunk(item) < rows.chunks.count ? rows.chunks.first_row(pairs.end_chunk(item)) : M;
        for (int64_t m = m0; m < m1; ++m)
          if (const int32_t s = lora->slots[m]; s >= 0 && std::find(item_slots.begin(), item_slots.end(), s) ==
                                                               item_slots.end())
            item_slots.push_back(s);
      }
      auto fetch_lora_blocks = [&](int64_t q) {  // pair q's
        const int64_t elem = lora->bf16 ? 2 : 4, b_bytes = 2 * lora->R * kPanel * elem;
        const int64_t a_bytes = std::clamp<int64_t>(lora->Fd - q * kPanel, 0, kPanel) * lora->Cd * elem;
        for (const int32_t s : item_slots) {
          const char* b = static_cast<const char*>(lora->b) + (s * lora->num_panels + 2 * q) * lora->R * kPanel * elem;
          const char* a = static_cast<const char*>(lora->down_a) + (s * lora->Fd + q * kPanel) * lora->Cd * elem;
          for (int64_t off = 0; off < b_bytes; off += 64) __builtin_prefetch(b + off, 0, 2);
          for (int64_t off = 0; off < a_bytes; off += 64) __builtin_prefetch(a + off, 0, 2);
        }
      };
      for (int64_t q = pairs.first_strip(item); q < pairs.end_strip(item); ++q) {
        if (lora && q + 1 < pairs.end_strip(item)) fetch_lora_blocks(q + 1);
        const float* bq = gu + 2 * q * depth * kPanel;
        const int64_t cols = std::min(kPanel, F - q * kPanel);
        // The next pair, right after this one, or the first weights of this thread's next item.
        const Ahead ahead = q + 1 < pairs.end_strip(item) ? pair_weights(q + 1) : first_weights(next_item.Claim());
        ForEachRowChunk(pairs.first_chunk(item), pairs.end_chunk(item), path.group(), ahead.lines,
                        [&](int64_t i0, int64_t n, int64_t l0, int64_t lines) {
          alignas(64) float both[2][kAmxRows][2 * kPanel];  // a chunk's gate columns, then its up columns
          for (int64_t j = 0; j < 2; j += kTilePanels) {  // the pair in one tile, or two
            float* outs[2] = {&both[0][0][j * kPanel], &both[1][0][j * kPanel]};
            path.Run(rows.chunks, rows.a, i0, n, bq + j * depth * kPanel, depth, kTilePanels, outs, 2 * kPanel,
                     kTilePanels * kPanel, ahead.at + 64 * l0, j == 0 ? lines : 0);
          }
          for (int64_t g = 0; g < n; ++g) {
            const int64_t i = i0 + g, r = rows.chunks.rows(i), m0 = rows.chunks.first_row(i);
#if defined(JAXCB_BF16_AMX)
            if (ua_width && chunk_slot[i] >= 0) {
              AmxLoraPair(&both[g][0][0], ua + m0 * 2 * ua_width, ua_width, lora->R,
                          static_cast<const uint16_t*>(lora->b) + (chunk_slot[i] * lora->num_panels + 2 * q) *
                                                                      lora->R * kPanel,
                          rows.chunks.most_rows());
            } else
#endif
            if (lora)
              ForEachSlotRun(lora->slots + m0, r, [&](int32_t s, const int* run, int nr) {
                const float* u[kLoraRows];
                float* out[kLoraRows];
                for (int k = 0; k < nr; ++k) u[k] = lora->u + (m0 + run[k]) * lora->Cu, out[k] = both[g][run[k]];
                const int64_t at = (s * lora->num_panels + 2 * q) * lora->R * kPanel;
                WithRunLength(nr, [&](auto N) {
                  if (lora->bf16) {
                    const auto* b = static_cast<const uint16_t*>(lora->b) + at;
                    AddPairUpdates<N.value>(u, lora->R, b, b + lora->R * kPanel, out);
                  } else {
                    const auto* b = static_cast<const float*>(lora->b) + at;
                    AddPairUpdates<N.value>(u, lora->R, b, b + lora->R * kPanel, out);
                  }
                });
              });
            const float(*act_in)[2 * kPanel] = both[g];
            // The activation's columns [16q, 16q + 16) of the chunk's rows (stored in acts as each
            // branch computes them) into down's LoRA shrink (its first Fd columns).
            const int64_t down_cols = lora ? std::clamp<int64_t>(lora->Fd - q * kPanel, 0, kPanel) : 0;
            alignas(64) float acts[kAmxRows][kPanel];
            auto down_shrink = [&] {
              if (down_cols == 0) return;
              ForEachSlotRun(lora->slots + m0, r, [&](int32_t s, const int* run, int nr) {
                const float* act[kLoraRows];
                float* d[kLoraRows];
                for (int k = 0; k < nr; ++k)
                  act[k] = acts[run[k]], d[k] = partial + (group * M + m0 + run[k]) * lora->Cd;
                const int64_t at = (s * lora->Fd + q * kPanel) * lora->Cd;
                WithRunLength(nr, [&](auto N) {
                  if (lora->bf16)
                    AddDownShrinks<N.value>(act, down_cols, static_cast<const uint16_t*>(lora->down_a) + at,
                                            lora->Cd, d);
                  else
                    AddDownShrinks<N.value>(act, down_cols, static_cast<const float*>(lora->down_a) + at, lora->Cd,
                                            d);
                });
              });
            };
            // Chunk i of h, k-major: columns [16q, 16q + cols) of the activation are its k-rows
            // there (or its pair-rows [8q, 8q + ceil(cols / 2)), an odd last one's high half 0).
#if defined(JAXCB_BF16_AMX)
            if (rows.row_major) {  // row by row, bf16: columns [16q, 16q + 16) of each
              auto* h_rows = reinterpret_cast<uint16_t*>(h + rows.chunks.offset(i, h_depth)) + q * kPanel;
              for (int64_t row = 0; row < r; ++row) {
                const __m512 act = SiluTimes16(act_in[row], act_in[row] + kPanel, cols);
                if (down_cols > 0) _mm512_store_ps(acts[row], act);
                StoreBf16(h_rows + row * 2 * h_depth, act, kPanel);
              }
              down_shrink();
              continue;
            }
#endif
            float* hc = h + rows.chunks.offset(i, h_depth) + q * kPanel * kTileRows / (bf16 ? 2 : 1);
            auto* hp = reinterpret_cast<uint32_t*>(hc);
#if defined(__AVX512F__)
            __m512 act[16];
            for (int64_t row = 0; row < 16; ++row)
              act[row] = row < r ? SiluTimes16(act_in[row], act_in[row] + kPanel, cols) : _mm512_setzero_ps();
            if (down_cols > 0)
              for (int64_t row = 0; row < r; ++row) _mm512_store_ps(acts[row], act[row]);
            down_shrink();
            Transpose16x16(act);  // act[j] past cols: 0
            if (bf16)
              for (int64_t j = 0; j < cols; j += 2)
                _mm512_mask_storeu_epi32(hp + (j / 2) * kTileRows, kTileRowLanes, Bf16Pairs(act[j], act[j + 1]));
            else
              for (int64_t j = 0; j < cols; ++j) _mm512_mask_storeu_ps(hc + j * kTileRows, kTileRowLanes, act[j]);
#else
            for (int64_t row = 0; row < r; ++row) {
              alignas(64) float act[kPanel + 1] = {};
              SiluTimes(act_in[row], act_in[row] + kPanel, cols, act);
              std::memcpy(acts[row], act, sizeof(acts[row]));
              if (bf16)
                for (int64_t j = 0; j < cols; j += 2)
                  hp[(j / 2) * kTileRows + row] = jaxcb::FloatToBf16(act[j]) |
                                                  static_cast<uint32_t>(jaxcb::FloatToBf16(act[j + 1])) << 16;
              else
                for (int64_t j = 0; j < cols; ++j) hc[j * kTileRows + row] = act[j];
            }
            down_shrink();
#endif
          }
        });
      }
      paired.fetch_add(1, std::memory_order_release);
      return;
    }
    WaitFor(paired, pairs.items);
    item -= pairs.items;
    if (lora && item % out.groups == 0) {  // down's LoRA shrink of this block of rows: its partials added up
      const int64_t m0 = rows.chunks.first_row(out.first_chunk(item));
      const int64_t m1 = out.end_chunk(item) < rows.chunks.count ? rows.chunks.first_row(out.end_chunk(item)) : M;
      for (int64_t m = m0; m < m1; ++m) {
        float* d = d_out + m * lora->Cd;
        if (lora->slots[m] < 0) {  // no adapter: zeros, so that no reader meets undefined values
          std::memset(d, 0, lora->Cd * sizeof(float));
          continue;
        }
        std::memcpy(d, partial + m * lora->Cd, lora->Cd * sizeof(float));
        for (int64_t p = 1; p < pairs.groups; ++p)
          for (int64_t j = 0; j < lora->Cd; ++j) d[j] += partial[(p * M + m) * lora->Cd + j];
      }
    }
    MultiplyItem(path, h, dw, h_depth, P, N, rows.chunks, out.first_chunk(item), out.end_chunk(item),
                 out.first_strip(item), out.end_strip(item), TileSink{c, res},
                 [&] { return first_weights(next_item.Claim()); });
  });
  return ffi::Error::Success();
}

// y [M, N] = x @ w and argmax [M], each row's jnp.argmax over y (the first index of the
// largest value, or of the first NaN), taken from the tiles while they are in registers' reach:
// the LM head of a step whose every row is greedy needs only the argmax. With want_y == 0, y is
// not written at all (its contents are undefined): no 8 MB of logits (64 rows of a 32,000-word
// vocabulary) written out, and no second pass to read them back.
ffi::Error PackedMatmulArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                                  ffi::Buffer<ffi::S32> want_y, RealRowsArg real_rows, ffi::ResultBuffer<ffi::F32> y,
                                  ffi::ResultBuffer<ffi::S32> argmax) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions(), ad = argmax->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || ad.size() != 1)
    return ffi::Error::InvalidArgument(
        "packed matmul argmax expects x [M, K], packed w [P, K, 16], y [M, N] and argmax [M]");
  int64_t M = xd[0];
  const int64_t K = xd[1], P = wd[0], N = yd[1];
  bool pairs;
  if (auto error = PairsOf(w, "the LM head's weight", &pairs); error.failure()) return error;
  if (wd[1] != PackedDepth(K, pairs) || wd[2] != kPanel || yd[0] != M || ad[0] != M || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("packed matmul argmax: x [" + std::to_string(M) + ", " + std::to_string(K) +
                                       "], w [" + std::to_string(P) + ", " + std::to_string(wd[1]) + ", " +
                                       std::to_string(wd[2]) + "] and N=" + std::to_string(N) + " do not agree");
  if (N == 0 && M > 0) return ffi::Error::InvalidArgument("packed matmul argmax of rows with no columns");
  const bool write_y = want_y.typed_data()[0] != 0;
  float* c = y->typed_data();
  int32_t* result = argmax->typed_data();
  // The sequence bucket's padding rows (past the step's sampling rows): argmax 0, logits zeros.
  const int64_t all_rows = M;
  M = RealRows(real_rows, M);
  std::fill(result + M, result + all_rows, 0);
  if (write_y) ZeroRows(c, M, all_rows, N);
  if (M == 0) return ffi::Error::Success();
  if (K == 0) {  // every column is 0: the first wins
    if (write_y) std::memset(c, 0, M * N * sizeof(float));
    std::fill(result, result + M, 0);
    return ffi::Error::Success();
  }
  thread_local std::vector<float> buffer;
  const PackedRows rows(x.typed_data(), M, K, buffer, nullptr, 0.0f, pairs);
  const Split split(rows.chunks, (P + kTilePanels - 1) / kTilePanels, std::max<int64_t>(pool.num_threads(), 1));
  // One RowBest per (strip group, row): each is written by the one item of that group and row
  // block, then the groups are folded in column order.
  std::vector<RowBest> best(split.groups * M);
  const float* wp = WeightData(w);
  const int64_t depth = rows.depth;
  PackThenMultiply(pool, rows, split.items, [&](int64_t item, auto&& next_item) {
    const int64_t c0 = split.first_chunk(item), c1 = split.end_chunk(item);
    const int64_t m0 = rows.chunks.first_row(c0), m1 = rows.chunks.first_row(c1 - 1) + rows.chunks.rows(c1 - 1);
    thread_local std::vector<RowArgmaxLanes> lanes(std::max(kItemRows, kAmxItemRows));  // an item's rows
    for (int64_t r = m0; r < m1; ++r) lanes[r - m0].Reset();
    TileSink sink{c};
    sink.argmax = lanes.data();
    sink.write_output = write_y;
    MultiplyItem(rows.path(), rows.a, wp, depth, P, N, rows.chunks, c0, c1, split.first_strip(item),
                 split.end_strip(item), sink, [&] { return split.FirstWeights(wp, depth, P, next_item()); });
    const int64_t g = item % split.groups;
    const auto first_column = static_cast<int32_t>(split.first_strip(item) * kTilePanels * kPanel);
    for (int64_t r = m0; r < m1; ++r) best[g * M + r] = lanes[r - m0].Result(first_column);
  });
  for (int64_t r = 0; r < M; ++r) {
    RowBest row = best[r];
    for (int64_t g = 1; g < split.groups && row.nan_index < 0; ++g) {
      const RowBest& next = best[g * M + r];
      if (next.nan_index >= 0) row.nan_index = next.nan_index;
      else if (next.value > row.value) row = next;
    }
    result[r] = row.nan_index >= 0 ? row.nan_index : row.index;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPackedMatmulArgmax, PackedMatmulArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // real rows (RealRows)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // real rows (RealRows)
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPackedQkv, PackedQkvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // real rows (RealRows)
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPackedMlp, PackedMlpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .OptionalArg<ffi::Buffer<ffi::S32>>()  // real rows (RealRows)
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The bf16 matmul paths, for the Python side (ctypes): which ones this build has (a bit mask of
// 1 << path), a check that one runs and computes right here, and the choice of the one to use.
extern "C" int JaxcbBf16MatmulPaths() {
  int paths = 1 << kBf16Widen;
#if defined(JAXCB_BF16_DOT)
  paths |= 1 << kBf16Dot;
#endif
#if defined(JAXCB_BF16_AMX)
  paths |= 1 << kBf16Amx;
#endif
  return paths;
}

namespace {
// The tiles of `path`, or null when this build lacks it or (AMX) the kernel refuses it.
const TileTable* TablePath(int path) {
  if (!(JaxcbBf16MatmulPaths() & (1 << path))) return nullptr;
#if defined(JAXCB_BF16_AMX)
  if (path == kBf16Amx) return RequestAmx() ? &kTilesBf16Amx : nullptr;
#endif
#if defined(JAXCB_BF16_DOT)
  if (path == kBf16Dot) return &kTilesBf16Dot;
#endif
  return &kTilesBf16Widen;
}
}  // namespace

// 1 when `path` multiplies a small bf16 matrix as a float32 reference does (to float32 rounding
// of the sums), 0 when it does not, -1 when this build lacks it (or the kernel refuses AMX). An
// instruction the CPU cannot run kills the process: call it in a child process first.
extern "C" int JaxcbProbeBf16Matmul(int path) {
  const TileTable* table = TablePath(path);
  if (!table) return -1;
  const AmxScope amx(path == kBf16Amx);
  constexpr int64_t K = 40, depth = 32, N = kTilePanels * kPanel;  // depth: PackedDepth(40, true)
  std::vector<uint32_t> a(depth * kTileRows, 0u), b(kTilePanels * depth * kPanel, 0u);
  auto value = [](int64_t i) { return static_cast<float>(static_cast<int>((i * 37) % 17) - 8) / 8.0f; };  // exact in bf16
  auto* a16 = reinterpret_cast<uint16_t*>(a.data());
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t v = jaxcb::FloatToBf16(value(r * K + k));
      if (path == kBf16Amx) a16[r * 2 * depth + k] = v;             // row-major rows of 2 depth
      else a16[2 * ((k / 2) * kTileRows + r) + k % 2] = v;          // pairs, k-major
    }
  auto* b16 = reinterpret_cast<uint16_t*>(b.data());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      b16[2 * ((n / kPanel) * depth * kPanel + (k / 2) * kPanel + n % kPanel) + k % 2] =
          jaxcb::FloatToBf16(value(7 + k * N + n));
#if defined(JAXCB_BF16_AMX)
  g_amx_call.fetch_add(1);
#endif
  std::vector<float> c(kTileRows * N);
  (*table)[kTilePanels][kTileRows](reinterpret_cast<const float*>(a.data()), reinterpret_cast<const float*>(b.data()),
                                   depth, c.data(), N, N, nullptr, 0);
  std::vector<float> c1 = c;  // a pair's second chunk, on a path that multiplies chunks in pairs
#if defined(JAXCB_BF16_AMX)
  if (path == kBf16Amx) {  // two chunks at once (the same x twice), as the multiplies run them
    std::vector<float> c0(kTileRows * N);
    const auto* ab = reinterpret_cast<const char*>(a.data());
    AmxTiles<true, kTilePanels>(ab, ab, kTileRows, kTileRows, kTileRows, reinterpret_cast<const char*>(b.data()), depth,
                                c0.data(), c1.data(), N, N, nullptr, 0);
    if (c0 != c) return 0;
  }
#endif
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t n = 0; n < N; ++n) {
      float want = 0.0f;  // small multiples of 1/64: exact in float32 whatever the order
      for (int64_t k = 0; k < K; ++k) want += value(r * K + k) * value(7 + k * N + n);
      if (c[r * N + n] != want || c1[r * N + n] != want) return 0;
    }
  return 1;
}

// Nanoseconds per tile of `path` (12 rows x 2 panels x 1024 deep, weights in L2: a decode step's
// tile; path 0: the float32 tile), the best of a few rounds; -1 when this build lacks the path. Paths that run are
// compared by this at start-up: which is faster differs by CPU (on one with AMX, AVX512-BF16's
// dot products ran slower than widening to float FMAs past 4 rows).
extern "C" double JaxcbTimeBf16Matmul(int path) {
  const TileTable* table = path == 0 ? &kTiles : TablePath(path);
  if (!table) return -1.0;
  const AmxScope amx(path == kBf16Amx);
  const int64_t depth = path == 0 ? 1024 : 512;
  std::vector<float> a_buffer, b_buffer, c(kTileRows * kTilePanels * kPanel);
  float* a = Aligned(a_buffer, depth * kTileRows);
  float* b = Aligned(b_buffer, kTilePanels * depth * kPanel);
  std::fill(a, a + depth * kTileRows, 0.5f);  // any finite pattern: the bits of 0.5f are two bf16s
  std::fill(b, b + kTilePanels * depth * kPanel, 0.25f);
#if defined(JAXCB_BF16_AMX)
  g_amx_call.fetch_add(1);
#endif
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) (*table)[kTilePanels][kTileRows](a, b, depth, c.data(), kTilePanels * kPanel,
                                                                   kTilePanels * kPanel, nullptr, 0);
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / 200);
  }
  return best;
}

// Selects the bf16 path every later call takes (one this build has, and for AMX one the kernel
// allows); returns the path in use.
extern "C" int JaxcbSelectBf16Matmul(int path) {
  if (TablePath(path)) g_bf16_matmul.store(path);
  return g_bf16_matmul.load();
}
