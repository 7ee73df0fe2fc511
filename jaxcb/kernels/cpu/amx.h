// AMX (tile) helpers shared by the CPU kernels that multiply bf16 on tiles: packed_matmul.cc's
// matmul and ragged_paged_attention.cc's prefill tiles.
//
// JAXCB_AMX is defined where the build targets a CPU with AMX-TILE, AMX-BF16 and AVX-512F
// (-march=native on one). That the CPU and the OS let this process use the tiles is another
// matter: RequestAmx() asks Linux for the permission, and the Python side runs each AMX path
// once in a child process (an instruction that faults kills the child, not the engine) before
// it selects it. Until then every kernel takes its path without AMX.
//
// Each kernel has its own tile configuration. A thread loads one before its first tile of a
// call (EnsureAmxConfig), again when another kernel's configuration or another call came in
// between (XLA's own AMX kernels share the thread pool and may leave theirs), and hands the
// tile state back at the end of each work item (AmxScope): a pool thread carries no live tile
// data between calls, into context switches, signal frames or other code.

#pragma once

#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define JAXCB_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace jaxcb {

#if defined(JAXCB_AMX)
// A tile configuration (palette 1): tile t holds rows[t] rows of bytes_per_row[t] bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Bumped by every call that multiplies on AMX: a thread reloads its configuration on its first
// tile of each call.
inline std::atomic<int64_t> g_amx_call{0};
inline thread_local int64_t t_amx_loaded = -1;  // the call whose configuration this thread holds; -1: none
inline thread_local const AmxConfig* t_amx_config = nullptr;  // and which configuration it is

inline void EnsureAmxConfig(const AmxConfig& config) {
  const int64_t call = g_amx_call.load(std::memory_order_relaxed);
  if (t_amx_loaded != call || t_amx_config != &config) {
    _tile_loadconfig(&config);
    t_amx_loaded = call;
    t_amx_config = &config;
  }
}

// AMX's tile data needs the kernel's permission, once per process (Linux 5.16+).
inline bool RequestAmx() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#endif

// Hands a thread's AMX state back (tilerelease) at the end of a work item that used it.
// Reloading the configuration costs ~0.07 us an item.
struct AmxScope {
  bool used;
  explicit AmxScope(bool used_) : used(used_) {}
  ~AmxScope() {
#if defined(JAXCB_AMX)
    if (used && t_amx_loaded != -1) {
      _tile_release();
      t_amx_loaded = -1;
      t_amx_config = nullptr;
    }
#endif
  }
};

}  // namespace jaxcb
