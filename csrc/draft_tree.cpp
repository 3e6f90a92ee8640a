// CPU kernel of specdec::draft_tree: k draft chains per row merged into one verification tree with the
// packed ancestor mask, each node's reach estimate, and optionally each row cut to its likeliest nodes.
//
// The torch reference (specdec/kernels/reference.py, draft_tree) is vectorised for batches on a GPU;
// at batch 1 on a CPU its ~60 small ops cost about 1 ms per decoding step, against tens of
// microseconds for this sequential walk (k * w <= a few hundred nodes per row).
//
// Per row: the chains are inserted in order into a trie (merge) or as separate branches, so node
// indices are chain-major and the first chain through a node owns it. With `accept`, a node's reach
// is its owner's (chain, depth) cell capped by its parent's. With `keep`, the row keeps its keep[b]
// nodes of highest reach (ties: shallower first, then index), in their node order. How many to keep
// is the planner's decision (specdec/policies/planner.py), made on the reach this kernel returns:
// the kernel holds the mechanics, not a copy of the rule. Float operations follow the reference's
// order and precision so both pick the same nodes; the file is built without FMA contraction.
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

namespace specdec {
namespace {

struct RowTree {
  std::vector<int64_t> tok, par, chain, slot, depth;

  void add(int64_t t, int64_t p, int64_t c, int64_t s) {
    tok.push_back(t);
    par.push_back(p);
    chain.push_back(c);
    slot.push_back(s);
    depth.push_back(p < 0 ? 0 : depth[p] + 1);
  }
  int64_t size() const { return static_cast<int64_t>(tok.size()); }
};

RowTree build_row(int64_t root, const int64_t* drafts, int64_t k, int64_t w, bool merge) {
  RowTree r;
  r.add(root, -1, -1, -1);
  for (int64_t i = 0; i < k; ++i) {
    int64_t node = 0;
    for (int64_t d = 0; d < w; ++d) {
      const int64_t t = drafts[i * w + d];
      if (t < 0) break;  // a chain ends at its first padding
      int64_t next = -1;
      if (merge)
        for (int64_t j = 1; j < r.size(); ++j)
          if (r.par[j] == node && r.tok[j] == t) {
            next = j;
            break;
          }
      if (next < 0) {
        r.add(t, node, i, i * w + d);
        next = r.size() - 1;
      }
      node = next;
    }
  }
  return r;
}

// Each node's reach: its owner's cell capped by its parent's; 1 at the root.
std::vector<float> row_reach(const RowTree& r, const float* accept) {
  std::vector<float> p(r.size());
  p[0] = 1.0f;
  for (int64_t j = 1; j < r.size(); ++j) p[j] = std::min(accept[r.slot[j]], p[r.par[j]]);
  return p;
}

// Keep flags of one row: the root and the `count` draft nodes of highest reach.
std::vector<char> keep_row(const RowTree& r, const std::vector<float>& p, int64_t count) {
  const int64_t n = r.size();
  std::vector<float> key(n);
  key[0] = 2.0f;  // the root first
  for (int64_t j = 1; j < n; ++j) key[j] = p[j] - static_cast<float>(r.depth[j]) * 1e-6f;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] > key[b]; });
  std::vector<char> keep(n, 0);
  for (int64_t i = 0; i <= std::min(count, n - 1); ++i) keep[order[i]] = 1;
  return keep;
}

RowTree subtree(const RowTree& r, const std::vector<char>& keep) {
  RowTree s;
  std::vector<int64_t> index(r.size(), -1);
  for (int64_t j = 0; j < r.size(); ++j) {
    if (!keep[j]) continue;
    index[j] = s.size();
    s.add(r.tok[j], j == 0 ? -1 : index[r.par[j]], r.chain[j], r.slot[j]);
  }
  return s;
}

using Trees = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Trees draft_tree_cpu(const at::Tensor& root, const at::Tensor& drafts, bool merge,
                     const std::optional<at::Tensor>& accept, const std::optional<at::Tensor>& keep) {
  const char* op = "draft_tree: ";
  TORCH_CHECK(drafts.dim() == 3 && drafts.scalar_type() == at::kLong, op, "drafts must be [B, k, w] int64, got ",
              drafts.scalar_type(), " of shape ", drafts.sizes());
  const int64_t B = drafts.size(0), k = drafts.size(1), w = drafts.size(2);
  TORCH_CHECK(root.dim() == 1 && root.size(0) == B && root.scalar_type() == at::kLong, op,
              "root must be [B] int64, got ", root.scalar_type(), " of shape ", root.sizes());
  TORCH_CHECK(accept.has_value() || !keep.has_value(), op, "keep needs accept (nodes are kept by their reach)");
  at::Tensor acc_t, keep_t;
  if (accept.has_value()) {
    acc_t = accept->contiguous();
    TORCH_CHECK(acc_t.scalar_type() == at::kFloat && acc_t.sizes() == drafts.sizes(), op,
                "accept must be [B, k, w] fp32 like drafts, got ", acc_t.scalar_type(), " of shape ", acc_t.sizes());
  }
  if (keep.has_value()) {
    keep_t = keep->contiguous();
    TORCH_CHECK(keep_t.scalar_type() == at::kLong && keep_t.dim() == 1 && keep_t.size(0) == B, op,
                "keep must be [B] int64 node counts, got ", keep_t.scalar_type(), " of shape ", keep_t.sizes());
    const int64_t* kp = keep_t.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(kp[b] >= 0, op, "keep must be >= 0, got ", kp[b], " in row ", b);
  }
  const auto dr = drafts.contiguous(), rt = root.contiguous();
  const int64_t* dp = dr.const_data_ptr<int64_t>();
  const int64_t* rp = rt.const_data_ptr<int64_t>();

  std::vector<RowTree> rows;
  rows.reserve(B);
  int64_t t = 1;
  for (int64_t b = 0; b < B; ++b) {
    rows.push_back(build_row(rp[b], dp + b * k * w, k, w, merge));
    t = std::max(t, rows.back().size());
  }
  std::vector<std::vector<float>> reach(B);
  if (accept.has_value()) {
    const float* ap = acc_t.const_data_ptr<float>();
    const int64_t* kp = keep.has_value() ? keep_t.const_data_ptr<int64_t>() : nullptr;
    int64_t t_new = 1;
    for (int64_t b = 0; b < B; ++b) {
      reach[b] = row_reach(rows[b], ap + b * k * w);
      if (kp != nullptr) {
        const auto kept = keep_row(rows[b], reach[b], kp[b]);
        std::vector<float> r;
        for (int64_t j = 0; j < rows[b].size(); ++j)
          if (kept[j]) r.push_back(reach[b][j]);
        rows[b] = subtree(rows[b], kept);
        reach[b] = std::move(r);
      }
      t_new = std::max(t_new, rows[b].size());
    }
    t = t_new;
  }

  const auto i64 = drafts.options();
  auto tokens = at::zeros({B, t}, i64), parents = at::zeros({B, t}, i64), depth = at::ones({B, t}, i64);
  auto chain = at::full({B, t}, -1, i64), slot = at::full({B, t}, -1, i64);
  auto valid = at::zeros({B, t}, i64.dtype(at::kBool));
  auto reach_t = at::zeros({B, t}, i64.dtype(at::kFloat));
  float* re = reach_t.data_ptr<float>();
  const int64_t words = (t + 31) / 32;
  auto mask = at::zeros({B, t, words}, i64.dtype(at::kInt));
  int64_t *tk = tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>(), *de = depth.data_ptr<int64_t>();
  int64_t *ch = chain.data_ptr<int64_t>(), *sl = slot.data_ptr<int64_t>();
  bool* va = valid.data_ptr<bool>();
  auto* mk = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  for (int64_t b = 0; b < B; ++b) {
    const RowTree& r = rows[b];
    for (int64_t j = 0; j < r.size(); ++j) {
      const int64_t o = b * t + j;
      tk[o] = r.tok[j];
      pa[o] = r.par[j];
      de[o] = r.depth[j];
      ch[o] = r.chain[j];
      sl[o] = r.slot[j];
      va[o] = true;
      if (!reach[b].empty()) re[o] = reach[b][j];
    }
    // Ancestor-or-self bits: a node sees what its parent sees, and itself. Padding hangs off the root.
    for (int64_t j = 0; j < t; ++j) {
      uint32_t* row = mk + (b * t + j) * words;
      if (j > 0) {
        const uint32_t* up = mk + (b * t + pa[b * t + j]) * words;
        std::copy(up, up + words, row);
      }
      row[j / 32] |= 1u << (j % 32);
    }
  }
  return {tokens, parents, valid, depth, mask, chain, slot, reach_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("draft_tree", &draft_tree_cpu);
}

}  // namespace specdec
