// y[M, N] = x[M, K] @ w for float32, with w pre-packed into 16-column panels, as an XLA FFI
// custom call. The linear layers of the model on CPU (`model.linear_impl=cpu`).
//
// Why C++: XLA:CPU's dot streams the weights at a few GB/s when M is a decode step's handful
// of tokens (it re-packs the weight operand on every call), several times under what the
// memory allows. Here the weights are packed once, at load, into panels [P, K, 16]: panel p
// holds columns [16p, 16p + 16) row after row, so a 6x16 register tile reads its B rows as one
// contiguous stream. Per call only x is packed (6-row chunks, k-major), which is cheap next to
// the weights. Work items are (block of rows, group of panels), spread over XLA's intra-op
// thread pool. Within an item each panel is read from memory once and then from L2 by every
// row chunk; each tile runs over all of K, so its outputs stay in registers and are stored
// once, and the next panel is prefetched a few lines per tile, spread over the row chunks.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;     // columns per packed panel (two AVX2 registers)
constexpr int64_t kTileRows = 6;   // rows of the register tile: 12 accumulators + 2 B + 1 A
constexpr int64_t kRowBlock = 96;  // rows per work item: their packed x (96 x 768 f32: 288 KiB) stays in L2

// c[r][:nv] = sum_k a[k * kTileRows + r] * b[k * kPanel + :] for r < R, k < K.
// a: one packed chunk of x; b: one panel (K rows of 16); c: the output tile (row stride ldc).
// prefetch[0, lines): 64-byte lines of the panel a later tile reads, fetched into L1 evenly
// over this tile's k loop. Spread over all the row chunks of a panel, they overlap the next
// panel's weight reads with this one's multiplies without a burst of misses in any one tile.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256i FirstLanes(int64_t n) {  // mask of lanes [0, n), n in [0, 8]
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int R>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char* prefetch,
          int64_t lines) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  // k runs in segments of `step`, one prefetch per segment: no division in the inner loop.
  const int64_t step = lines > 0 ? std::max<int64_t>(K / lines, 1) : K;
  int64_t fetched = 0;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    if (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T0);
    const int64_t k1 = std::min(K, k0 + step);
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * kPanel), b1 = _mm256_loadu_ps(b + k * kPanel + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + k * kTileRows + r);
        lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
      }
    }
  }
  while (fetched < lines) _mm_prefetch(prefetch + 64 * fetched++, _MM_HINT_T0);
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
template <int R>
void Tile(const float* a, const float* b, int64_t K, float* c, int64_t ldc, int64_t nv, const char*, int64_t) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += a[k * kTileRows + r] * b[k * kPanel + j];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nv; ++j) c[r * ldc + j] = acc[r][j];
}
#endif

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, const char*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>, Tile<5>, Tile<6>};

// x [M, K] -> chunks of kTileRows rows, each k-major ([k][row]); rows past M stay unread.
void PackRows(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t chunk = 0; chunk * kTileRows < M; ++chunk) {
    const int64_t rows = std::min(kTileRows, M - chunk * kTileRows);
    float* dst = out + chunk * kTileRows * K;
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = x + (chunk * kTileRows + r) * K;
      for (int64_t k = 0; k < K; ++k) dst[k * kTileRows + r] = src[k];
    }
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
  PackRows(x.typed_data(), M, K, packed_x.data());
  const float* a = packed_x.data();
  const float* b = w.typed_data();

  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  // About four items per thread, so that the claim-as-you-go loop evens out uneven finishes.
  const int64_t group = std::clamp<int64_t>(P * row_blocks / (4 * threads), 1, 16);
  const int64_t groups = (P + group - 1) / group;
  const int64_t items = row_blocks * groups;
  jaxcb::ParallelFor(pool, items, std::clamp<int64_t>(items - 1, 0, threads - 1), [&](int64_t item) {
    const int64_t m0 = (item / groups) * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    const int64_t p0 = (item % groups) * group, p1 = std::min(P, p0 + group);
    const int64_t row_chunks = (m1 - m0 + kTileRows - 1) / kTileRows;
    const int64_t lines_per_chunk = (K + row_chunks - 1) / row_chunks;  // of the next panel: one line per k
    for (int64_t p = p0; p < p1; ++p) {
      const float* bp = b + p * K * kPanel;
      const char* next = p + 1 < P ? reinterpret_cast<const char*>(bp + K * kPanel) : nullptr;
      const int64_t nv = std::min(kPanel, N - p * kPanel);
      for (int64_t m = m0, i = 0; m < m1; m += kTileRows, ++i) {
        const int64_t l0 = std::min(K, i * lines_per_chunk), l1 = std::min(K, l0 + lines_per_chunk);
        kTiles[std::min(kTileRows, m1 - m)](a + m * K, bp, K, c + m * N + p * kPanel, N, nv,
                                            next ? next + 64 * l0 : nullptr, next ? l1 - l0 : 0);
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
