// ParallelFor over XLA's intra-op thread pool, shared by the CPU kernels.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxcb {

// The item a ParallelFor thread runs after the current one, claimed from the loop's counter on
// the first Claim() (>= n: there is none).
class NextItem {
 public:
  explicit NextItem(std::atomic<int64_t>& counter) : counter_(counter) {}
  int64_t Claim() {
    if (claimed_ < 0) claimed_ = counter_.fetch_add(1);
    return claimed_;
  }

 private:
  std::atomic<int64_t>& counter_;
  int64_t claimed_ = -1;
};

// Runs items [0, n) on the calling thread and on up to `extra_threads` pool threads. Items are
// claimed from a shared counter, so a pool task that starts late (or never) costs nothing:
// the caller only waits for items someone has claimed.
//
// `body(i)`, or `body(i, next)` with a NextItem: an item may call next.Claim() to learn, before
// it ends, which item its thread runs next, so that it can fetch that item's data while it
// finishes its own. Claiming late in an item keeps the load balance of claim-as-you-go.
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
    for (int64_t i = state->next.fetch_add(1); i < n; ++mine) {
      NextItem next(state->next);
      if constexpr (std::is_invocable_v<F&, int64_t, NextItem&>) body(i, next);
      else body(i);
      i = next.Claim();
    }
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
