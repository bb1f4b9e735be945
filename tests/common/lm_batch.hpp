// Token batches for the language model's tests (tests/model): a seeded
// (B, S) batch of inputs and targets, one rank's rows of it, a run's losses,
// and one forward+backward's loss and gradients on P local ranks.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/local_comm.hpp"
#include "common/check.hpp"
#include "model/model.hpp"
#include "model/train.hpp"

namespace laga::test {

struct Batch {
  std::int64_t B = 2, S = 7;
  std::vector<std::int32_t> tok, tgt;  // (B, S)
};
inline Batch batch(const LmConfig& c) {
  Batch b;
  TestRng rng(11);
  for (std::int64_t i = 0; i < b.B * b.S; ++i) {
    b.tok.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
    b.tgt.push_back(std::int32_t(rng.next_u64() % std::uint64_t(c.vocab)));
  }
  return b;
}

// Rows [off, off + L) of every sequence.
inline std::vector<std::int32_t> shard(const std::vector<std::int32_t>& v, std::int64_t B,
                                       std::int64_t S, std::int64_t off, std::int64_t L) {
  std::vector<std::int32_t> out;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i) out.push_back(v[size_t(b * S + off + i)]);
  return out;
}

// (loss, every gradient by name, as rank 0 holds them) of one forward+backward
// of the parameters make_params() builds on P local ranks, each its even
// shard of bt; configure(ctx) sets the context's further fields (documents,
// experts) on every rank.
using LossAndGrads = std::pair<double, std::map<std::string, std::vector<double>>>;
template <class MakeParams, class Configure>
LossAndGrads loss_and_grads(const LmConfig& cfg, Form form, AttentionKind attention, int P,
                            const Batch& bt, const MakeParams& make_params,
                            const Configure& configure) {
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;
  run_local_ranks(P, [&](Communicator& comm) {
    const SpLayout layout = SpLayout::even(bt.B, bt.S, cfg.mla.n_heads, P);
    const RopeTable rope(cfg.mla.rope(), bt.S);
    LmContext ctx{cfg, layout, comm, rope, form, attention};
    configure(ctx);
    const LmParams<double> w = make_params(cfg);
    LmParams<double> g = LmParams<double>::zeros(cfg, MemCategory::gradients);
    const int r = comm.rank();
    const auto off = layout.shard_begin(r), L = layout.seq_count[size_t(r)];
    auto tok = shard(bt.tok, bt.B, bt.S, off, L), tgt = shard(bt.tgt, bt.B, bt.S, off, L);
    const double l = lm_forward_backward(ctx, w, tok.data(), tgt.data(), g);
    if (r != 0) return;
    loss = l;
    g.for_each([&](const std::string& n, const Tensor<double>& t) {
      grads[n].assign(t.data(), t.data() + t.numel());
    });
  });
  return {loss, grads};
}

inline std::vector<double> losses(const std::vector<StepRecord>& r) {
  std::vector<double> v;
  for (const auto& s : r) v.push_back(s.loss);
  return v;
}

}  // namespace laga::test
