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
// tile's rows, k-major), which is cheap next to the weights. Work items are (block of rows,
// group of panel strips), spread over XLA's intra-op thread pool. Within an item each strip
// is read from memory once and then from L2 by every row chunk; each tile runs over all of K,
// so its outputs stay in registers and are stored once, and the next strip is prefetched a
// few lines per tile, spread over the row chunks.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;     // columns per packed panel (one AVX-512 / two AVX2 registers)
// The register tile: kTileRows rows of x by kTilePanels panels of w, its accumulators plus the
// panels' k-th rows and one broadcast of x held in registers (24 + 2 + 1 of AVX-512's 32;
// 12 + 2 + 1 of AVX2's 16).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 12, kTilePanels = 2;
#else
constexpr int64_t kTileRows = 6, kTilePanels = 1;
#endif
constexpr int64_t kRowBlock = 96;  // rows per work item: their packed x (96 x 768 f32: 288 KiB) stays in L2

// c[r][:nv] = sum_k a[k * kTileRows + r] * b[k * kPanel + :] for r < R, k < K, over NP panels
// of w side by side (panel j at b + j * K * kPanel; nv counts the tile's valid columns).
// a: one packed chunk of x; b: the first panel; c: the output tile (row stride ldc).
// prefetch[0, lines): 64-byte lines of the panels a later tile reads, fetched into L1 evenly
// over this tile's k loop. Spread over all the row chunks of a strip of panels, they overlap
// the next strip's weight reads with this one's multiplies without a burst of misses in any one tile.
#if defined(__AVX2__) && defined(__FMA__)
// body(k) for k in [0, K), with prefetch[0, lines) fetched into L1 evenly along the way: k runs
// in segments, one prefetch per segment, so the inner loop has no division.
template <typename Body>
inline __attribute__((always_inline)) void ForEachK(int64_t K, const char* prefetch, int64_t lines, Body&& body) {
  const int64_t step = lines > 0 ? std::max<int64_t>(K / lines, 1) : K;
  int64_t fetched = 0;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    if (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T0);
    const int64_t k1 = std::min(K, k0 + step);
    for (int64_t k = k0; k < k1; ++k) body(k);
  }
  while (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
template <int R, int NP>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char* prefetch,
          int64_t lines) {
  __m512 acc[R][NP];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
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

template <int NP, int... R>
constexpr std::array<TileFn, kTileRows + 1> TilesOfWidth(std::integer_sequence<int, R...>) {
  return {nullptr, Tile<R + 1, NP>...};
}
template <int... NP>
constexpr std::array<std::array<TileFn, kTileRows + 1>, kTilePanels + 1> AllTiles(std::integer_sequence<int, NP...>) {
  return {std::array<TileFn, kTileRows + 1>{}, TilesOfWidth<NP + 1>(std::make_integer_sequence<int, kTileRows>())...};
}
// kTiles[panels][rows]: the tile for a chunk of that many rows by that many panels.
constexpr auto kTiles = AllTiles(std::make_integer_sequence<int, kTilePanels>());

// Rows [m0, m0 + rows) of x [M, K] (rows <= kTileRows) -> one chunk, k-major ([k][row]);
// rows past `rows` stay unread. K is walked in blocks, all rows per block: row by row over
// the whole of K, the strided stores (kTileRows floats apart) ran ~3x slower at K = 2048.
void PackChunk(const float* x, int64_t K, int64_t rows, float* dst) {
  constexpr int64_t kBlock = 64;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = k0; k < k1; ++k) dst[k * kTileRows + r] = x[r * K + k];
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed matmul expects x [M, K], packed w [P, K, 16] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  if (wd[1] != K || wd[2] != kPanel || yd[0] != M || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("packed matmul: x [" + std::to_string(M) + ", " + std::to_string(K) +
                                       "], w [" + std::to_string(P) + ", " + std::to_string(wd[1]) + ", " +
                                       std::to_string(wd[2]) + "] and N=" + std::to_string(N) + " do not agree");
  float* c = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(c, 0, M * N * sizeof(float));
    return ffi::Error::Success();
  }
  // One buffer per calling thread, grown once: no page faults from a fresh allocation per call.
  thread_local std::vector<float> packed_x;
  const int64_t chunks = (M + kTileRows - 1) / kTileRows;
  if (packed_x.size() < static_cast<size_t>(chunks * kTileRows * K)) packed_x.resize(chunks * kTileRows * K);
  float* a = packed_x.data();
  const float* xs = x.typed_data();
  const float* b = w.typed_data();

  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t strips = (P + kTilePanels - 1) / kTilePanels;  // of kTilePanels panels, the last maybe fewer
  // About four items per thread, so that the claim-as-you-go loop evens out uneven finishes.
  const int64_t group = std::clamp<int64_t>(strips * row_blocks / (4 * threads), 1, 16 / kTilePanels);
  const int64_t groups = (strips + group - 1) / group;
  // Items [0, chunks) pack x, one chunk each; the multiply items after them wait until every
  // chunk is packed. Items are claimed in order, so each chunk a multiply waits for is already
  // being packed by a running thread: the packing is shared by the threads, with no second
  // round of pool wake-ups.
  const int64_t items = chunks + row_blocks * groups;
  std::atomic<int64_t> packed{0};
  jaxcb::ParallelFor(pool, items, std::clamp<int64_t>(items - 1, 0, threads - 1), [&](int64_t item) {
    if (item < chunks) {
      PackChunk(xs + item * kTileRows * K, K, std::min(kTileRows, M - item * kTileRows), a + item * kTileRows * K);
      packed.fetch_add(1, std::memory_order_release);
      return;
    }
    while (packed.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
    item -= chunks;
    const int64_t m0 = (item / groups) * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t s0 = (item % groups) * group, s1 = std::min(strips, s0 + group);
    const int64_t row_chunks = (m1 - m0 + kTileRows - 1) / kTileRows;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t p = s * kTilePanels, panels = std::min(kTilePanels, P - p);
      const float* bp = b + p * K * kPanel;
      // The next strip is contiguous with this one: one 64-byte line per k per panel.
      const int64_t next_lines = std::min(kTilePanels, std::max<int64_t>(P - p - panels, 0)) * K;
      const char* next = reinterpret_cast<const char*>(bp + panels * K * kPanel);
      const int64_t lines_per_chunk = (next_lines + row_chunks - 1) / row_chunks;
      const int64_t nv = std::min(panels * kPanel, N - p * kPanel);
      for (int64_t m = m0, i = 0; m < m1; m += kTileRows, ++i) {
        const int64_t l0 = std::min(next_lines, i * lines_per_chunk), l1 = std::min(next_lines, l0 + lines_per_chunk);
        kTiles[panels][std::min(kTileRows, m1 - m)](a + m * K, bp, K, c + m * N + p * kPanel, N, nv,
                                                    next + 64 * l0, l1 - l0);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
