// Writes one layer's new K/V rows into the paged cache in place, as an XLA FFI custom call.
//
// Same result as kv_cache.write_kv's scatter: cache[layer, h, slot[t]] = rows[t, h] for every
// token t and KV head h, slots outside [0, num_blocks * block_size) dropped. The caches are
// aliased to the outputs, so nothing but the new rows is touched.
//
// Why C++: XLA:CPU scatters into a bfloat16 array by converting the whole array to f32 and
// back. For the cache that is hundreds of MB, twice per layer: with `cache.dtype=bfloat16` a
// step ran ~14x slower than with an f32 cache. Here rows are copied as bytes, whatever the
// dtype (the caller converts them to the cache's dtype first).

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvCacheWriteImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k_rows,
                            ffi::AnyBuffer v_rows, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto cd = k_cache.dimensions(), rd = k_rows.dimensions();
  if (cd.size() != 5 || rd.size() != 3)
    return ffi::Error::InvalidArgument("kv cache write expects caches [L, Hkv, NB, BS, D] and rows [T, Hkv, D]");
  const int64_t L = cd[0], H = cd[1], NB = cd[2], BS = cd[3], D = cd[4], T = rd[0];
  const auto vd = v_cache.dimensions(), vr = v_rows.dimensions();
  if (vd.size() != 5 || vd[0] != L || vd[1] != H || vd[2] != NB || vd[3] != BS || vd[4] != D)
    return ffi::Error::InvalidArgument("kv cache write: the k and v caches must have the same shape");
  if (vr.size() != 3 || vr[0] != T || vr[1] != rd[1] || vr[2] != rd[2] || rd[1] != H ||
      rd[2] != D || slots.element_count() != T || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("kv cache write: rows [T, Hkv, D] and slots [T] must match the cache");
  const ffi::DataType dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype || k_rows.element_type() != dtype || v_rows.element_type() != dtype)
    return ffi::Error::InvalidArgument("kv cache write: the rows must have the caches' dtype");
  const int64_t lyr = layer.typed_data()[0];
  if (lyr < 0 || lyr >= L)
    return ffi::Error::InvalidArgument("layer=" + std::to_string(lyr) + " is outside [0, " + std::to_string(L) + ")");
  const int64_t row_bytes = D * static_cast<int64_t>(ffi::ByteWidth(dtype)), num_slots = NB * BS;
  const int32_t* slot = slots.typed_data();
  struct Pair {
    const char* rows;
    char* cache;
  };
  // The outputs alias the caches; they are written through the outputs' pointers.
  const Pair pairs[2] = {{static_cast<const char*>(k_rows.untyped_data()), static_cast<char*>(k_out->untyped_data())},
                         {static_cast<const char*>(v_rows.untyped_data()), static_cast<char*>(v_out->untyped_data())}};
  for (const Pair& p : pairs) {
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0 || slot[t] >= num_slots) continue;  // padding aimed past the end: dropped
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(p.cache + ((lyr * H + h) * num_slots + slot[t]) * row_bytes, p.rows + (t * H + h) * row_bytes,
                    row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbKvCacheWrite, KvCacheWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// A zero-filled buffer without writing it: XLA allocates the result, and the kernel hands its whole
// pages back to the OS (madvise MADV_DONTNEED on private anonymous memory, which the allocator's
// heap and large mmaps are), so they read as zeros and are faulted in only when first touched. A
// KV cache of gigabytes is then ready at once and costs memory only for the blocks in use. The
// partial pages at either end, and any range madvise refuses, are written with memset.

#include <sys/mman.h>
#include <unistd.h>

namespace {

ffi::Error LazyZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  char* begin = static_cast<char*>(out->untyped_data());
  const int64_t size = static_cast<int64_t>(out->size_bytes());
  const int64_t page = sysconf(_SC_PAGESIZE);
  char* first = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page);
  char* last = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin + size)) / page * page);
  if (last <= first || madvise(first, last - first, MADV_DONTNEED) != 0) {
    std::memset(begin, 0, size);
    return ffi::Error::Success();
  }
  std::memset(begin, 0, first - begin);
  std::memset(last, 0, begin + size - last);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcbLazyZeros, LazyZerosImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
