// CPU kernel of specdec::ngram_match: batched context n-gram matching, all n at once, one pass per row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

#include "ngram_match_checks.h"

namespace specdec {
namespace {

struct Group {
  int64_t first;   // index into the hit list of its first member
  int64_t count;   // occurrences
  int64_t latest;  // largest start p
};

// One row: tok[0, L) valid. Writes k drafts of width w and returns the matched n (0: none).
int32_t ngram_row(const int64_t* tok, int64_t L, int64_t n_min, int64_t n_max, int64_t k, int64_t w,
                  int64_t* drafts, int32_t* dlens, int32_t* counts) {
  const int64_t n_hi = std::min(n_max, L - 1);
  if (n_hi < n_min) return 0;
  const int64_t* suffix_end = tok + L - 1;
  // m[e]: length of the common backward match of tok[.., e] with tok[.., L-1], capped at
  // min(n_hi, e + 1); an occurrence of the length-n suffix starts at p = e - n + 1 iff m[e] >= n,
  // and p + n < L iff e <= L - 2.
  std::vector<int32_t> m(static_cast<size_t>(L - 1));
  int64_t best = 0;
  for (int64_t e = 0; e <= L - 2; ++e) {
    const int64_t cap = std::min(n_hi, e + 1);
    int64_t j = 0;
    while (j < cap && tok[e - j] == suffix_end[-j]) ++j;
    m[e] = static_cast<int32_t>(j);
    best = std::max(best, j);
  }
  if (best < n_min) return 0;
  const int64_t n = best;

  // Continuation windows (-1 past the end of the row), most recent occurrence first.
  std::vector<int64_t> starts;  // p of each hit, descending
  for (int64_t e = L - 2; e >= 0; --e)
    if (m[e] >= n) starts.push_back(e - n + 1);
  const int64_t h = static_cast<int64_t>(starts.size());
  std::vector<int64_t> win(static_cast<size_t>(h * w));
  for (int64_t i = 0; i < h; ++i) {
    const int64_t c = starts[i] + n;
    for (int64_t j = 0; j < w; ++j) win[i * w + j] = c + j < L ? tok[c + j] : -1;
  }
  // Group equal windows: sort hit indices by content (stable, so each group keeps recency order).
  std::vector<int64_t> order(static_cast<size_t>(h));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(win.begin() + a * w, win.begin() + (a + 1) * w, win.begin() + b * w,
                                        win.begin() + (b + 1) * w);
  });
  std::vector<Group> groups;
  for (int64_t i = 0; i < h; ++i) {
    const int64_t a = order[i];
    if (i > 0 && std::equal(win.begin() + a * w, win.begin() + (a + 1) * w, win.begin() + groups.back().first * w)) {
      groups.back().count += 1;
      groups.back().latest = std::max(groups.back().latest, starts[a]);
    } else {
      groups.push_back({a, 1, starts[a]});
    }
  }
  // Count descending, then recency (every start belongs to exactly one group: a total order).
  const int64_t top = std::min<int64_t>(k, static_cast<int64_t>(groups.size()));
  std::partial_sort(groups.begin(), groups.begin() + top, groups.end(), [](const Group& a, const Group& b) {
    return a.count != b.count ? a.count > b.count : a.latest > b.latest;
  });
  for (int64_t g = 0; g < top; ++g) {
    const int64_t* src = win.data() + groups[g].first * w;
    int32_t len = 0;
    for (int64_t j = 0; j < w; ++j) {
      drafts[g * w + j] = src[j];
      len += src[j] >= 0;
    }
    dlens[g] = len;
    counts[g] = static_cast<int32_t>(groups[g].count);
  }
  return static_cast<int32_t>(n);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ngram_match_cpu(const at::Tensor& tokens,
                                                                           const at::Tensor& lengths, int64_t n_min,
                                                                           int64_t n_max, int64_t k, int64_t w) {
  check_ngram_match_args(tokens, lengths, n_min, n_max, k, w);
  TORCH_CHECK(tokens.device().is_cpu() && lengths.device().is_cpu(), "ngram_match: tensors must be on the CPU");
  const int64_t B = tokens.size(0), Lmax = tokens.size(1);
  const auto tok_c = tokens.contiguous();
  const auto len_c = lengths.to(at::kLong).contiguous();
  const int64_t* tok_p = tok_c.const_data_ptr<int64_t>();
  const int64_t* len_p = len_c.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len_p[b] >= 0 && len_p[b] <= Lmax, "ngram_match: lengths[", b, "] = ", len_p[b],
                " is outside [0, L = ", Lmax, "]");

  auto drafts = at::full({B, k, w}, -1, tokens.options());
  auto dlens = at::zeros({B, k}, tokens.options().dtype(at::kInt));
  auto counts = at::zeros({B, k}, tokens.options().dtype(at::kInt));
  auto match_n = at::zeros({B}, tokens.options().dtype(at::kInt));
  int64_t* d_p = drafts.mutable_data_ptr<int64_t>();
  int32_t* dl_p = dlens.mutable_data_ptr<int32_t>();
  int32_t* c_p = counts.mutable_data_ptr<int32_t>();
  int32_t* n_p = match_n.mutable_data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      n_p[b] = ngram_row(tok_p + b * Lmax, len_p[b], n_min, n_max, k, w, d_p + b * k * w, dl_p + b * k, c_p + b * k);
  });
  return {drafts, dlens, counts, match_n};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("ngram_match", &ngram_match_cpu);
}

}  // namespace specdec
