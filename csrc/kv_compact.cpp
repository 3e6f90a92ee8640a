// CPU kernel of specdec::kv_compact: in-place compaction of accepted KV entries, all layers in one call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace specdec {
namespace {

// Below this many bytes per thread, waking the thread pool costs more than the copy.
constexpr int64_t kMinBytesPerTask = 64 * 1024;

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "kv_compact: ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kLong, "kv_compact: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "kv_compact: ", name, " must be a CPU tensor, got ", t.device());
}

// Moves cache[b, h, src[b, j]] to cache[b, h, dst_start[b] + j] for j < counts[b], for every
// cache [B, H, S, D] (H, D and dtype may differ between caches; B and S may not).
void kv_compact_cpu(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst_start,
                    const at::Tensor& counts) {
  check_index(src, "src", 2);
  check_index(dst_start, "dst_start", 1);
  check_index(counts, "counts", 1);
  const int64_t B = src.size(0), n = src.size(1);
  TORCH_CHECK(dst_start.size(0) == B && counts.size(0) == B, "kv_compact: dst_start and counts must be [B] with B = ",
              B, " (src is ", src.sizes(), "), got ", dst_start.sizes(), " and ", counts.sizes());
  if (caches.empty()) return;

  int64_t S = 0;
  for (size_t t = 0; t < caches.size(); ++t) {
    const at::Tensor& c = caches[t];
    TORCH_CHECK(c.dim() == 4, "kv_compact: caches[", t, "] must be [B, H, S, D], got shape ", c.sizes());
    TORCH_CHECK(c.device().is_cpu(), "kv_compact: caches[", t, "] must be a CPU tensor, got ", c.device());
    if (t == 0) S = c.size(2);
    TORCH_CHECK(c.size(0) == B && c.size(2) == S, "kv_compact: caches[", t, "] has shape ", c.sizes(),
                ", expected B = ", B, " and S = ", S);
  }

  const auto src_c = src.contiguous(), dst_c = dst_start.contiguous(), cnt_c = counts.contiguous();
  const int64_t* src_p = src_c.const_data_ptr<int64_t>();
  const int64_t* dst_p = dst_c.const_data_ptr<int64_t>();
  const int64_t* cnt_p = cnt_c.const_data_ptr<int64_t>();
  int64_t moved = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cnt = cnt_p[b], d0 = dst_p[b];
    TORCH_CHECK(cnt >= 0 && cnt <= n, "kv_compact: counts[", b, "] = ", cnt, " is outside [0, n = ", n, "]");
    TORCH_CHECK(d0 >= 0 && d0 + cnt <= S, "kv_compact: dst_start[", b, "] + counts[", b, "] = ", d0, " + ", cnt,
                " is outside [0, S = ", S, "]");
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t s = src_p[b * n + j];
      TORCH_CHECK(s < S, "kv_compact: src[", b, ", ", j, "] = ", s, " is out of bounds for S = ", S);
      // This is what makes the in-place forward copy below read only not-yet-overwritten rows.
      TORCH_CHECK(s >= d0 + j, "kv_compact: src[", b, ", ", j, "] = ", s, " precedes its destination dst_start[", b,
                  "] + ", j, " = ", d0 + j);
    }
    moved += cnt;
  }

  // One work item per (cache, b, h); first_item[t] is the first item of caches[t].
  std::vector<int64_t> first_item(caches.size() + 1, 0);
  int64_t bytes = 0;
  for (size_t t = 0; t < caches.size(); ++t) {
    first_item[t + 1] = first_item[t] + B * caches[t].size(1);
    bytes += moved * caches[t].size(1) * caches[t].size(3) * caches[t].element_size();
  }
  const int64_t items = first_item.back();
  if (bytes == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask * items / bytes);

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const size_t t = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const at::Tensor& c = caches[t];
      const int64_t H = c.size(1), D = c.size(3), esize = c.element_size();
      const int64_t b = (item - first_item[t]) / H, h = (item - first_item[t]) % H;
      char* base = static_cast<char*>(c.mutable_data_ptr()) + (b * c.stride(0) + h * c.stride(1)) * esize;
      const int64_t row_stride = c.stride(2) * esize, col_stride = c.stride(3) * esize;
      for (int64_t j = 0; j < cnt_p[b]; ++j) {
        const int64_t s = src_p[b * n + j], d = dst_p[b] + j;
        if (s == d) continue;
        char* to = base + d * row_stride;
        const char* from = base + s * row_stride;
        if (c.stride(3) == 1) {
          std::memmove(to, from, D * esize);
        } else {
          for (int64_t k = 0; k < D; ++k) std::memcpy(to + k * col_stride, from + k * col_stride, esize);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("kv_compact", &kv_compact_cpu);
}

}  // namespace specdec
