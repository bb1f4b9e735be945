// The invariant mode on the forms whose registry rows offer it
// (FormTraits::invariant; docs/invariance.md): out, dx and every parameter
// gradient bit-identical at P 1 .. 8, with uneven sequence and head shards,
// packed documents, fp32 and bf16; on every rank of those runs the ledger is
// the closed form (predict_comm in the mode: the canonical sums' terms,
// mla/comm_model.hpp) byte for byte and the pool is the memory model (the
// count-only run in the mode), as at DeepSeek-V3 dims on count-only ranks;
// the mutation (the canonical sums combined in rank order) caught; and the
// other forms refused, naming the form.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/dry_run_comm.hpp"
#include "common/block_inputs.hpp"
#include "core/error.hpp"
#include "core/memory_pool.hpp"
#include "core/precision.hpp"
#include "mla/canonical_sum.hpp"
#include "mla/comm_model.hpp"
#include "mla/form_registry.hpp"
#include "mla/memory_model.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

// rq 0 (wq) or 7 (wq_a, q_norm, wq_b: more gradients summed over tokens);
// gated: Kimi's NoPE with the output gate (wg's gradient summed over tokens too).
MlaConfig config(std::int64_t rq = 0, bool gated = false) {
  MlaConfig c;  // H 6: uneven over 4, 5, 7 and 8 ranks (two of them without a head at 7 and 8)
  c.dim = 32, c.n_heads = 6, c.q_lora_rank = rq, c.kv_lora_rank = 16, c.qk_nope_head_dim = 8,
  c.qk_rope_head_dim = 4, c.v_head_dim = 6;
  c.rope_theta = 500, c.original_seq_len = 8, c.max_seq_len = 128, c.rope_factor = 4;
  if (gated) c.mla_use_nope = true, c.mla_use_output_gate = true, c.rope_factor = 1;
  c.validate();
  return c;
}

// Uneven shards: rank r holds about (r + 1) parts of S and of H.
SpLayout uneven(std::int64_t B, std::int64_t S, std::int64_t H, int P) {
  std::vector<std::int64_t> seq, heads;
  const std::int64_t parts = P * (P + 1) / 2;
  std::int64_t s_used = 0, h_used = 0;
  for (int r = 0; r < P; ++r) {
    const std::int64_t s = r + 1 == P ? S - s_used : S * (r + 1) / parts;
    const std::int64_t h = r + 1 == P ? H - h_used : H * (r + 1) / parts;
    seq.push_back(s), heads.push_back(h), s_used += s, h_used += h;
  }
  return SpLayout::custom(B, seq, heads);
}

std::vector<std::pair<std::string, const TensorF*>> tensors(const BlockRun<float>& r) {
  std::vector<std::pair<std::string, const TensorF*>> v{{"out", &r.out}, {"dx", &r.dx}};
  r.grads.for_each([&](const std::string& n, const TensorF& t) { v.push_back({"grad." + n, &t}); });
  return v;
}

// The first tensor whose bytes differ, or "".
std::string first_difference(const BlockRun<float>& a, const BlockRun<float>& b) {
  const auto ta = tensors(a), tb = tensors(b);
  for (std::size_t i = 0; i < ta.size(); ++i)
    if (ta[i].second->numel() != tb[i].second->numel() ||
        std::memcmp(ta[i].second->data(), tb[i].second->data(),
                    sizeof(float) * std::size_t(ta[i].second->numel())) != 0)
      return ta[i].first;
  return "";
}

BlockRun<float> run(Form f, const SpLayout& lay, const test::BlockInputs<float>& in,
                    const Documents* docs, std::int64_t rq = 0, bool gated = false) {
  RunSpec spec;
  spec.variant = f;
  spec.attention = AttentionKind::flash;
  spec.documents = docs;
  spec.invariant = true;
  return run_local(config(rq, gated), lay, in.w, in.x, in.dout, spec);
}

// A ledger against the closed form in the mode, label for label, both
// directions and the calls; every label of the one in the other.
void expect_ledger_is_the_closed_form(const Ledger& ledger, const CommPrediction& pred,
                                      const std::string& tag) {
  EXPECT_EQ(ledger.entries().size(), pred.size()) << tag << ": labels";
  for (const auto& [key, entry] : ledger.entries()) {
    const std::string where = tag + " " + to_string(key.first) + "/" + key.second;
    const auto it = pred.find(key);
    ASSERT_NE(it, pred.end()) << where << " is in the ledger but not in the closed form";
    EXPECT_EQ(entry.bytes_sent, it->second.sent) << where;
    EXPECT_EQ(entry.bytes_received, it->second.received) << where;
    EXPECT_EQ(entry.calls, it->second.calls) << where << ": collective calls";
  }
}

// Every rank of an invariant run: its ledger the closed form, its pool the
// memory model's count-only run in the mode (and after forward, in fp32,
// the independent closed form of what the form saves).
void expect_closed_forms(const MlaConfig& cfg, const SpLayout& lay, Form f,
                         const BlockRun<float>& run, Precision precision) {
  for (const RankReport& rep : run.ranks) {
    const std::string tag = std::string(form_spec(f).name) + " " + lay.describe() +
                            (precision == Precision::bf16 ? " bf16" : " fp32") + " rank " +
                            std::to_string(rep.rank);
    expect_ledger_is_the_closed_form(
        rep.ledger,
        predict_comm(cfg, lay, f, rep.rank, wire_element_bytes(precision, GradReduce::fp32, 4),
                     true, true, true),
        tag);
    MemoryModelOptions opt;
    opt.invariant = true;
    const MemoryPrediction p = predict_memory(cfg, lay, f, AttentionKind::flash, rep.rank, 4, opt);
    EXPECT_EQ(rep.memory.peak_activations, p.peak_activations) << tag;
    EXPECT_EQ(rep.memory.peak_comm_buffers, p.peak_comm_buffers) << tag;
    EXPECT_EQ(rep.memory.peak_working, p.peak_working) << tag;
    EXPECT_EQ(rep.memory.after_forward, p.after_forward) << tag;
    if (precision == Precision::fp32) {
      EXPECT_EQ(rep.memory.after_forward,
                4 * saved_for_backward_elements(cfg, lay, f, AttentionKind::flash, rep.rank))
          << tag << " saved for backward";
    }
  }
}

void expect_same_bits_at_every_p(Precision precision, bool packed, bool uneven_shards,
                                 std::int64_t rq = 0, bool gated = false) {
  const MlaConfig cfg = config(rq, gated);
  const std::int64_t B = 2, S = 71;
  const test::BlockInputs<float> in = test::make_inputs(cfg, B, S);
  const Documents docs = Documents::parse_lengths("20,3,30,18", B, S);
  const UsePrecision prec(precision);
  for (Form f : all_forms()) {
    if (!form_spec(f).traits.invariant) continue;
    const SpLayout single = SpLayout::even(B, S, cfg.n_heads, 1);
    const BlockRun<float> one = run(f, single, in, packed ? &docs : nullptr, rq, gated);
    expect_closed_forms(cfg, single, f, one, precision);
    for (int P = 2; P <= 8; ++P) {
      const SpLayout lay =
          uneven_shards ? uneven(B, S, cfg.n_heads, P) : SpLayout::even(B, S, cfg.n_heads, P);
      const BlockRun<float> at_p = run(f, lay, in, packed ? &docs : nullptr, rq, gated);
      EXPECT_EQ(first_difference(at_p, one), "")
          << form_spec(f).name << " at " << lay.describe()
          << (precision == Precision::bf16 ? " bf16" : " fp32") << (packed ? " packed" : "");
      expect_closed_forms(cfg, lay, f, at_p, precision);
    }
  }
}

TEST(InvariantForms, SameBitsAtEveryPFp32) {
  expect_same_bits_at_every_p(Precision::fp32, false, false);
}
TEST(InvariantForms, SameBitsAtEveryPFp32UnevenPacked) {
  expect_same_bits_at_every_p(Precision::fp32, true, true);
}
TEST(InvariantForms, SameBitsAtEveryPBf16UnevenPacked) {
  expect_same_bits_at_every_p(Precision::bf16, true, true);
}
TEST(InvariantForms, SameBitsAtEveryPWithAQueryLatentFp32) {
  expect_same_bits_at_every_p(Precision::fp32, true, true, 7);
}
TEST(InvariantForms, SameBitsAtEveryPWithAQueryLatentBf16) {
  expect_same_bits_at_every_p(Precision::bf16, false, true, 7);
}
TEST(InvariantForms, SameBitsAtEveryPGatedNopeFp32) {
  expect_same_bits_at_every_p(Precision::fp32, true, true, 7, true);
}

// A count-only rank of `lay` on a dry-run communicator in the mode, in T:
// its ledger the closed form at sizeof(T) an element and its pool the
// memory model's.
template <class T>
void expect_count_only_closed_forms(const MlaConfig& cfg, const SpLayout& lay, Form f, int r) {
  MemoryPool pool;
  pool.set_count_only(true);
  PoolScope scope(pool);
  const RopeTable rope = RopeTable::unbacked(cfg.rope(), lay.seq);
  const MlaParams<T> w = MlaParams<T>::zeros(cfg, MemCategory::parameters);
  const Tensor<T> x({lay.batch, lay.seq, cfg.dim}), dout({lay.batch, lay.seq, cfg.dim});
  DryRunCommunicator comm(r, lay.ranks);
  RunSpec spec;
  spec.variant = f;
  spec.attention = AttentionKind::flash;
  spec.invariant = true;
  const RankResult<T> res = run_rank(comm, cfg, lay, rope, w, x, dout, spec);
  const std::int64_t e = sizeof(T);
  const std::string tag = std::string(form_spec(f).name) + " " + lay.describe() + " rank " +
                          std::to_string(r) + " " + std::to_string(e) + "-byte elements";
  EXPECT_GT(res.report.ledger.entries().at({Phase::backward, "wo_grad"}).bytes_sent, std::int64_t(1)
                                                                                         << 30)
      << tag << ": wo's pieces, 7168 x 16384 elements to 7 peers";
  expect_ledger_is_the_closed_form(res.report.ledger,
                                   predict_comm(cfg, lay, f, r, e, true, true, true), tag);
  MemoryModelOptions opt;
  opt.invariant = true;
  const MemoryPrediction p = predict_memory(cfg, lay, f, AttentionKind::flash, r, e, opt);
  EXPECT_EQ(res.report.memory.peak_working, p.peak_working) << tag;
  EXPECT_EQ(res.report.memory.after_forward, p.after_forward) << tag;
}

// At DeepSeek-V3's dims (and its query latent, rq 1536), S 4096 and 4099
// (uneven: ranks of equal shards at different offsets cut different
// pieces), P 8, ranks 0, 3 and 7, fp32, and one rank in double.
TEST(InvariantForms, CountOnlyLedgerAndPoolAreTheClosedFormsAtDeepSeekV3Dims) {
  const MlaConfig v3 = MlaConfig::preset("deepseek-v3");
  for (Form f : all_forms()) {
    if (!form_spec(f).traits.invariant) continue;
    for (std::int64_t S : {4096, 4099})
      for (int r : {0, 3, 7})
        expect_count_only_closed_forms<float>(v3, SpLayout::even(1, S, v3.n_heads, 8), f, r);
    expect_count_only_closed_forms<double>(v3, SpLayout::even(1, 4099, v3.n_heads, 8), f, 3);
  }
}

// The mutation: the canonical sums combined in rank order (as an all-reduce
// of partial sums does) is caught by the comparison above.
TEST(InvariantForms, ARankOrderedReductionIsCaught) {
  struct Restore {
    ~Restore() { ops::canonical_sum_rank_order = false; }
  } restore;
  const MlaConfig cfg = config();
  const test::BlockInputs<float> in = test::make_inputs(cfg, 2, 71);
  const BlockRun<float> one = run(Form::laga, SpLayout::even(2, 71, cfg.n_heads, 1), in, nullptr);
  ops::canonical_sum_rank_order = true;
  int caught = 0;
  for (int P : {3, 5, 8})
    caught +=
        !first_difference(run(Form::laga, uneven(2, 71, cfg.n_heads, P), in, nullptr), one).empty();
  EXPECT_GT(caught, 0) << "a rank-ordered reduction gave P 1's bits at P 3, 5 and 8";
}

// The same mutation in absorbed's and laga_fused's sum of the latent's
// gradient over the heads (ops::canonical_parts_reduce_scatter): dx is the
// first tensor to differ (dx reads that sum and none over tokens; out reads
// neither).
TEST(InvariantForms, ARankOrderedHeadSumIsCaughtInDx) {
  struct Restore {
    ~Restore() { ops::canonical_sum_rank_order = false; }
  } restore;
  const MlaConfig cfg = config();
  const test::BlockInputs<float> in = test::make_inputs(cfg, 2, 71);
  for (Form f : {Form::absorbed, Form::laga_fused}) {
    ops::canonical_sum_rank_order = false;
    const BlockRun<float> one = run(f, SpLayout::even(2, 71, cfg.n_heads, 1), in, nullptr);
    ops::canonical_sum_rank_order = true;
    int caught = 0;
    for (int P : {3, 5, 8})
      caught += first_difference(run(f, uneven(2, 71, cfg.n_heads, P), in, nullptr), one) == "dx";
    EXPECT_GT(caught, 0) << form_spec(f).name
                         << ": a rank-ordered head sum gave P 1's dx at P 3, 5 and 8";
  }
}

// The same mutation in allgather_kv's sum of its keys' gradients over the
// query chunks (ops::canonical_parts_reduce_scatter over
// ops::query_chunk_shards): at S 200, four 64-token chunks, which at P 4 and
// 5 lie on four ranks, so that the rank-ordered sum ((c0 + c1) + c2) + c3 is
// not the tree's (c0 + c1) + (c2 + c3); dx reads that sum and none over
// tokens, out neither.
TEST(InvariantForms, ARankOrderedQueryChunkSumIsCaughtInDx) {
  struct Restore {
    ~Restore() { ops::canonical_sum_rank_order = false; }
  } restore;
  const MlaConfig cfg = config();
  const std::int64_t B = 1, S = 200;
  const test::BlockInputs<float> in = test::make_inputs(cfg, B, S);
  const BlockRun<float> one =
      run(Form::allgather_kv, SpLayout::even(B, S, cfg.n_heads, 1), in, nullptr);
  ops::canonical_sum_rank_order = true;
  int caught = 0;
  for (int P : {3, 4, 5})
    caught += first_difference(run(Form::allgather_kv, uneven(B, S, cfg.n_heads, P), in, nullptr),
                               one) == "dx";
  EXPECT_GT(caught, 0)
      << "allgather_kv: a rank-ordered query chunk sum gave P 1's dx at P 3, 4 and 5";
}

// A form whose row does not offer the mode is refused, naming it and the
// forms that do.
TEST(InvariantForms, OtherFormsAreRefusedByName) {
  const MlaConfig cfg = config();
  const test::BlockInputs<float> in = test::make_inputs(cfg, 1, 16);
  std::string offering;  // the registry's forms with the trait, in its order
  for (Form f : all_forms())
    if (form_spec(f).traits.invariant)
      offering += (offering.empty() ? "" : ", ") + std::string(form_spec(f).name);
  for (Form f : all_forms()) {
    if (form_spec(f).traits.invariant) continue;
    try {
      run(f, SpLayout::even(1, 16, cfg.n_heads, 2), in, nullptr);
      ADD_FAILURE() << form_spec(f).name << " ran with --invariant";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::string("form ") + form_spec(f).name + " does not offer"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("use --form " + offering + ","), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace laga
