// CUDA kernel of specdec::kv_compact: in-place compaction of accepted KV entries, all caches in one launch.
//
// The caches are separate tensors of possibly different H, D and dtype, so their base addresses,
// byte strides and shapes travel by value in the kernel's parameter block (no host-to-device copy,
// nothing to allocate). CUDA >= 12.1 allows 32 KB of parameters, enough for 256 caches per launch;
// older toolkits get 64 per launch (4 KB), and longer lists are split over several launches.
//
// Block (b * H_max + h, c) moves head h of row b of cache c: the flattened (j, column) elements
// of its counts[b] moves are processed in tiles that are entirely loaded into registers, then
// (after a barrier) stored. That is safe in place because sources ascend and never precede their
// destination (src[j] >= dst_start + j): a store to dst_start + j' can only clobber the source of
// an earlier j < j', whose load the barrier orders before it.
//
// The contract is not validated on the host (that would need a device sync); moves whose source
// or destination is outside [0, S) are skipped.
//
// Headers: ATen/cuda/CUDAContext.h is avoided on purpose (it pulls in cuBLAS/cuSPARSE headers);
// the current stream comes from c10/cuda/CUDAStream.h.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace specdec {
namespace {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxCaches = 256;
#else
constexpr int kMaxCaches = 64;
#endif
constexpr int kThreads = 256;
constexpr int kPerThread = 4;  // elements each thread holds per tile

struct CacheTable {
  char* base[kMaxCaches];
  int64_t stride[kMaxCaches][4];  // bytes: b, h, s, d
  int32_t heads[kMaxCaches];
  int32_t dim[kMaxCaches];
  int8_t elem[kMaxCaches];  // element size in bytes: 1, 2, 4 or 8
};

template <typename Word>
__device__ void move_head(char* base, const int64_t* stride, int64_t dim, const int64_t* src, int64_t d0,
                          int64_t count, int64_t S) {
  const int64_t total = count * dim;
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kPerThread;
  for (int64_t tile = 0; tile < total; tile += kTile) {
    Word held[kPerThread];
    char* to[kPerThread];
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      to[r] = nullptr;
      const int64_t e = tile + static_cast<int64_t>(r) * kThreads + threadIdx.x;
      if (e >= total) continue;
      const int64_t j = e / dim, col = e % dim, s = src[j], d = d0 + j;
      if (s == d || s < 0 || s >= S || d < 0 || d >= S) continue;
      held[r] = *reinterpret_cast<const Word*>(base + s * stride[2] + col * stride[3]);
      to[r] = base + d * stride[2] + col * stride[3];
    }
    __syncthreads();  // every load of the tile before any store of it
#pragma unroll
    for (int r = 0; r < kPerThread; ++r)
      if (to[r] != nullptr) *reinterpret_cast<Word*>(to[r]) = held[r];
  }
}

__global__ void __launch_bounds__(kThreads) kv_compact_kernel(CacheTable table, int32_t heads_max,
                                                               const int64_t* __restrict__ src, int64_t n,
                                                               const int64_t* __restrict__ dst_start,
                                                               const int64_t* __restrict__ counts, int64_t S) {
  const int c = blockIdx.y;
  const int64_t b = blockIdx.x / heads_max, h = blockIdx.x % heads_max;
  if (h >= table.heads[c]) return;  // uniform per block: no barrier is skipped by half a block
  int64_t count = counts[b];
  count = count < 0 ? 0 : (count > n ? n : count);
  const int64_t* stride = table.stride[c];
  char* base = table.base[c] + b * stride[0] + h * stride[1];
  const int64_t* row_src = src + b * n;
  switch (table.elem[c]) {
    case 1: move_head<uint8_t>(base, stride, table.dim[c], row_src, dst_start[b], count, S); break;
    case 2: move_head<uint16_t>(base, stride, table.dim[c], row_src, dst_start[b], count, S); break;
    case 4: move_head<uint32_t>(base, stride, table.dim[c], row_src, dst_start[b], count, S); break;
    default: move_head<uint64_t>(base, stride, table.dim[c], row_src, dst_start[b], count, S); break;
  }
}

void kv_compact_cuda(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst_start,
                     const at::Tensor& counts) {
  TORCH_CHECK(src.dim() == 2, "kv_compact: src must be [B, n], got shape ", src.sizes());
  const int64_t B = src.size(0), n = src.size(1);
  TORCH_CHECK(dst_start.dim() == 1 && counts.dim() == 1 && dst_start.size(0) == B && counts.size(0) == B,
              "kv_compact: dst_start and counts must be [B] with B = ", B, ", got ", dst_start.sizes(), " and ",
              counts.sizes());
  for (const auto* t : {&src, &dst_start, &counts})
    TORCH_CHECK(at::isIntegralType(t->scalar_type(), /*includeBool=*/false) && t->is_cuda(),
                "kv_compact: src, dst_start and counts must be CUDA integer tensors");
  if (caches.empty() || B == 0 || n == 0) return;
  const int64_t S = caches[0].size(2);
  for (size_t t = 0; t < caches.size(); ++t) {
    const at::Tensor& c = caches[t];
    TORCH_CHECK(c.dim() == 4 && c.size(0) == B && c.size(2) == S, "kv_compact: caches[", t, "] has shape ",
                c.sizes(), ", expected [B = ", B, ", H, S = ", S, ", D]");
    TORCH_CHECK(c.device() == src.device(), "kv_compact: caches[", t, "] is on ", c.device(), ", src on ",
                src.device());
    const auto es = c.element_size();
    TORCH_CHECK(es == 1 || es == 2 || es == 4 || es == 8, "kv_compact: unsupported element size ", es);
    TORCH_CHECK(c.size(1) <= INT32_MAX && c.size(3) <= INT32_MAX, "kv_compact: H and D must fit in int32");
  }
  c10::cuda::CUDAGuard guard(src.device());
  const auto src_l = src.to(at::kLong).contiguous();
  const auto dst_l = dst_start.to(at::kLong).contiguous();
  const auto cnt_l = counts.to(at::kLong).contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  for (size_t first = 0; first < caches.size(); first += kMaxCaches) {
    const size_t num = std::min<size_t>(kMaxCaches, caches.size() - first);
    CacheTable table{};
    int64_t heads_max = 1;
    for (size_t i = 0; i < num; ++i) {
      const at::Tensor& c = caches[first + i];
      const int64_t es = c.element_size();
      table.base[i] = static_cast<char*>(c.mutable_data_ptr());
      for (int d = 0; d < 4; ++d) table.stride[i][d] = c.stride(d) * es;
      table.heads[i] = static_cast<int32_t>(c.size(1));
      table.dim[i] = static_cast<int32_t>(c.size(3));
      table.elem[i] = static_cast<int8_t>(es);
      heads_max = std::max(heads_max, c.size(1));
    }
    TORCH_CHECK(B * heads_max <= INT32_MAX, "kv_compact: B * H is too large for one grid");
    const dim3 grid(static_cast<unsigned>(B * heads_max), static_cast<unsigned>(num));
    kv_compact_kernel<<<grid, kThreads, 0, stream>>>(table, static_cast<int32_t>(heads_max),
                                                     src_l.const_data_ptr<int64_t>(), n,
                                                     dst_l.const_data_ptr<int64_t>(),
                                                     cnt_l.const_data_ptr<int64_t>(), S);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("kv_compact", &kv_compact_cuda);
}

}  // namespace specdec
