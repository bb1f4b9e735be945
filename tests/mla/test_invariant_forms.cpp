// The invariant mode on the forms whose registry rows offer it
// (FormTraits::invariant; docs/invariance.md): out, dx and every parameter
// gradient bit-identical at P 1 .. 8, with uneven sequence and head shards,
// packed documents, fp32 and bf16; the mutation (the canonical sums combined
// in rank order) caught; and the other forms refused, naming the form.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/block_inputs.hpp"
#include "core/error.hpp"
#include "core/precision.hpp"
#include "mla/canonical_sum.hpp"
#include "mla/form_registry.hpp"
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

void expect_same_bits_at_every_p(Precision precision, bool packed, bool uneven_shards,
                                 std::int64_t rq = 0, bool gated = false) {
  const MlaConfig cfg = config(rq, gated);
  const std::int64_t B = 2, S = 71;
  const test::BlockInputs<float> in = test::make_inputs(cfg, B, S);
  const Documents docs = Documents::parse_lengths("20,3,30,18", B, S);
  const UsePrecision prec(precision);
  for (Form f : all_forms()) {
    if (!form_spec(f).traits.invariant) continue;
    const BlockRun<float> one =
        run(f, SpLayout::even(B, S, cfg.n_heads, 1), in, packed ? &docs : nullptr, rq, gated);
    for (int P = 2; P <= 8; ++P) {
      const SpLayout lay =
          uneven_shards ? uneven(B, S, cfg.n_heads, P) : SpLayout::even(B, S, cfg.n_heads, P);
      EXPECT_EQ(first_difference(run(f, lay, in, packed ? &docs : nullptr, rq, gated), one), "")
          << form_spec(f).name << " at " << lay.describe()
          << (precision == Precision::bf16 ? " bf16" : " fp32") << (packed ? " packed" : "");
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
