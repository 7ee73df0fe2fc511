// ParallelFor over XLA's intra-op thread pool, shared by the CPU kernels.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxcb {

// Runs items [0, n) on the calling thread and on up to `extra_threads` pool threads. Items are
// claimed from a shared counter, so a pool task that starts late (or never) costs nothing:
// the caller only waits for items someone has claimed.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t extra_threads, F&& body) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  // A pool task that starts after every item is claimed touches only `state` (which it keeps
  // alive), never `body`, so it may safely outlive this call.
  // Each thread counts its items as done once, at its end: a shared counter bumped per item
  // moves its cache line between the cores on every item (thousands a step in attention).
  auto worker = [state, n, &body]() {
    int64_t mine = 0;
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1), ++mine) body(i);
    if (mine > 0) state->done.fetch_add(mine, std::memory_order_release);
  };
  for (int64_t h = 0; h < extra_threads; ++h) pool.Schedule(decltype(worker)(worker));
  worker();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// ParallelFor with as many pool threads as help: one fewer than the pool has (the caller is
// the other) and than there are items, never fewer than none.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F&& body) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  ParallelFor(pool, n, std::clamp<int64_t>(n - 1, 0, threads - 1), std::forward<F>(body));
}

}  // namespace jaxcb
