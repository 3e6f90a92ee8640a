// CUDA kernel of specdec::ngram_match: batched context n-gram matching, one thread block per row.
//
// Per row (tokens tok[0, L)), in four block-wide phases:
//   1. best = the longest backward match of the suffix ending at any e <= L - 2, capped at
//      n_hi = min(n_max, L - 1): all n at once, the longest size n in [n_min, n_hi] with a match.
//   2. the hits of that n (starts p with p + n < L), compacted most recent first by a block scan.
//   3. grouping by continuation content (w tokens, -1 past the end of the row): a hit is its
//      group's representative iff no more recent hit has the same window, and the representative
//      counts the equal windows after it. Windows are compared by a 64-bit hash first and by
//      content only when the hashes agree, so the result is exact; the work is quadratic in the
//      number of hits (fine for the tens to hundreds a context suffix has).
//   4. k rounds of a block max over the representatives' keys count * (L + 1) + latest start
//      (unique per group: count descending, then recency), each writing one draft.
// Outputs match specdec.kernels.reference.ngram_match exactly.
//
// Headers: only ATen/c10 headers that a CUDA build of torch ships, plus CUB from the toolkit.
// ATen/cuda/CUDAContext.h is avoided on purpose: it pulls in cuBLAS/cuSPARSE headers, which a
// bare CUDA toolkit may lack, and the current stream comes from c10/cuda/CUDAStream.h anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <limits>
#include <tuple>

#include "ngram_match_checks.h"

namespace specdec {
namespace {

constexpr int kThreads = 256;

struct MaxOp {  // cub::Max is gone from recent CCCL releases
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

struct Row {
  const int64_t* tok;
  int64_t len;
  __device__ int64_t at(int64_t pos) const { return pos < len ? tok[pos] : -1; }  // -1 past the end

  __device__ bool same_window(int64_t a, int64_t b, int w) const {
    for (int j = 0; j < w; ++j)
      if (at(a + j) != at(b + j)) return false;
    return true;
  }
};

__global__ void __launch_bounds__(kThreads) ngram_match_kernel(
    const int64_t* __restrict__ tokens, int64_t row_stride, const int64_t* __restrict__ lengths, int64_t max_len,
    int n_min, int n_max, int k, int w, int32_t* __restrict__ hit_start, uint64_t* __restrict__ hit_hash,
    int64_t* __restrict__ hit_key, int64_t* __restrict__ drafts, int32_t* __restrict__ draft_lens,
    int32_t* __restrict__ counts, int32_t* __restrict__ match_n) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int64_t shared_value;
  __shared__ int num_hits;

  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  int64_t len = lengths[b];
  len = len < 0 ? 0 : (len > max_len ? max_len : len);  // clamped: no host sync to validate
  const Row row{tokens + b * row_stride, len};
  const int64_t n_hi = n_max < len - 1 ? n_max : len - 1;
  if (n_hi < n_min) return;  // outputs were pre-filled as "no match"
  const int64_t* suffix_end = row.tok + len - 1;

  // 1. Longest backward match over all end positions e <= L - 2.
  int64_t local_best = 0;
  for (int64_t e = tid; e <= len - 2; e += kThreads) {
    const int64_t cap = n_hi < e + 1 ? n_hi : e + 1;
    int64_t j = 0;
    while (j < cap && row.tok[e - j] == suffix_end[-j]) ++j;
    local_best = j > local_best ? j : local_best;
  }
  const int64_t best = Reduce(temp.reduce).Reduce(local_best, MaxOp());
  if (tid == 0) shared_value = best;
  __syncthreads();
  const int64_t n = shared_value;
  if (n < n_min) return;

  // 2. Hits of the suffix n-gram, most recent (largest start) first.
  int32_t* starts = hit_start + b * max_len;
  if (tid == 0) num_hits = 0;
  __syncthreads();
  for (int64_t chunk = 0; chunk < len - 1; chunk += kThreads) {
    const int64_t e = len - 2 - (chunk + tid);  // end of the candidate occurrence
    int flag = 0;
    if (e >= n - 1) {
      flag = 1;
      for (int64_t j = 0; j < n; ++j)
        if (row.tok[e - j] != suffix_end[-j]) {
          flag = 0;
          break;
        }
    }
    int pos, added;
    Scan(temp.scan).ExclusiveSum(flag, pos, added);
    if (flag) starts[num_hits + pos] = static_cast<int32_t>(e - n + 1);
    __syncthreads();
    if (tid == 0) num_hits += added;
    __syncthreads();
  }
  const int h = num_hits;

  // 3. Group equal continuations: hash, then representatives and their counts.
  uint64_t* hashes = hit_hash + b * max_len;
  int64_t* keys = hit_key + b * max_len;
  for (int i = tid; i < h; i += kThreads) {
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over the window's tokens
    for (int j = 0; j < w; ++j) hash = (hash ^ static_cast<uint64_t>(row.at(starts[i] + n + j))) * 1099511628211ull;
    hashes[i] = hash;
  }
  __syncthreads();
  for (int i = tid; i < h; i += kThreads) {
    const int64_t ci = starts[i] + n;
    bool representative = true;
    for (int j = 0; j < i && representative; ++j)
      representative = !(hashes[j] == hashes[i] && row.same_window(starts[j] + n, ci, w));
    int64_t count = 0;
    if (representative) {
      count = 1;
      for (int j = i + 1; j < h; ++j) count += hashes[j] == hashes[i] && row.same_window(starts[j] + n, ci, w);
    }
    keys[i] = representative ? count * (len + 1) + starts[i] : -1;
  }
  __syncthreads();

  // 4. The k best groups, one block max per slot (keys are unique: no ties).
  int64_t bound = std::numeric_limits<int64_t>::max();
  for (int slot = 0; slot < k; ++slot) {
    int64_t local = -1;
    for (int i = tid; i < h; i += kThreads)
      if (keys[i] < bound && keys[i] > local) local = keys[i];
    const int64_t top = Reduce(temp.reduce).Reduce(local, MaxOp());
    if (tid == 0) shared_value = top;
    __syncthreads();
    bound = shared_value;
    __syncthreads();  // shared_value and temp are reused by the next round
    if (bound < 0) break;
    const int64_t cont = bound % (len + 1) + n;
    int64_t* out = drafts + (b * k + slot) * w;
    for (int j = tid; j < w; j += kThreads) out[j] = row.at(cont + j);
    if (tid == 0) {
      int32_t valid = 0;
      for (int j = 0; j < w; ++j) valid += row.at(cont + j) >= 0;
      draft_lens[b * k + slot] = valid;
      counts[b * k + slot] = static_cast<int32_t>(bound / (len + 1));
    }
  }
  if (tid == 0) match_n[b] = static_cast<int32_t>(n);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ngram_match_cuda(const at::Tensor& tokens,
                                                                            const at::Tensor& lengths, int64_t n_min,
                                                                            int64_t n_max, int64_t k, int64_t w) {
  check_ngram_match_args(tokens, lengths, n_min, n_max, k, w);
  TORCH_CHECK(tokens.is_cuda() && lengths.device() == tokens.device(),
              "ngram_match: tokens and lengths must be on one CUDA device");
  TORCH_CHECK(k <= INT32_MAX && w <= INT32_MAX && tokens.size(1) < INT32_MAX, "ngram_match: sizes must fit in int32");
  c10::cuda::CUDAGuard guard(tokens.device());
  const int64_t B = tokens.size(0), max_len = tokens.size(1);
  const auto tok = tokens.stride(1) == 1 ? tokens : tokens.contiguous();
  const auto len = lengths.to(at::kLong).contiguous();

  auto drafts = at::full({B, k, w}, -1, tok.options());
  auto dlens = at::zeros({B, k}, tok.options().dtype(at::kInt));
  auto counts = at::zeros({B, k}, tok.options().dtype(at::kInt));
  auto match_n = at::zeros({B}, tok.options().dtype(at::kInt));
  if (B == 0 || max_len == 0) return {drafts, dlens, counts, match_n};
  const int32_t n_max_clamped = static_cast<int32_t>(n_max < max_len ? n_max : max_len);
  if (n_min > n_max_clamped) return {drafts, dlens, counts, match_n};
  auto starts = at::empty({B, max_len}, tok.options().dtype(at::kInt));
  auto hashes = at::empty({B, max_len}, tok.options());  // uint64 bits in int64 storage
  auto keys = at::empty({B, max_len}, tok.options());
  ngram_match_kernel<<<static_cast<unsigned>(B), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      tok.const_data_ptr<int64_t>(), tok.stride(0), len.const_data_ptr<int64_t>(), max_len,
      static_cast<int>(n_min), n_max_clamped, static_cast<int>(k), static_cast<int>(w),
      starts.mutable_data_ptr<int32_t>(), reinterpret_cast<uint64_t*>(hashes.mutable_data_ptr<int64_t>()),
      keys.mutable_data_ptr<int64_t>(), drafts.mutable_data_ptr<int64_t>(), dlens.mutable_data_ptr<int32_t>(),
      counts.mutable_data_ptr<int32_t>(), match_n.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {drafts, dlens, counts, match_n};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) {
  m.impl("ngram_match", &ngram_match_cuda);
}

}  // namespace specdec
