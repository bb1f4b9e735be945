// The upfront memory check's figure (tools/memory_check.hpp), against sums
// worked out term by term: a block job in one process holds, per rank it
// runs, the rank's predicted working peak, its gradients (4 bytes per
// parameter), its x, dout, out and dx shards (4 x B L_r D floats), what the
// job keeps per rank and what the rank's block cache may keep; plus, once,
// what the job shares. Ranks as threads (--comm local) run all P here, an
// MPI process one (the largest rank), --rank-only that rank. A train job:
// every rank's peak with --comm local, the largest under MPI. The refusal
// tests (tools_memory_check, tools_cli_memory) see only words ~14x over the
// limit; this sees the number.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "mla/comm_model.hpp"
#include "mla/memory_model.hpp"
#include "model/train.hpp"
#include "plan/model_plan.hpp"
#include "plan/time_model.hpp"
#include "tools/memory_check.hpp"

namespace laga::tools {
namespace {

std::int64_t parameter_bytes(const MlaConfig& cfg) {
  std::int64_t n = 0;
  for (const auto& [name, shape] : mla_param_shapes(cfg)) n += numel(shape);
  return 4 * n;
}

// One rank's part, term by term, for the staging of `backend`.
std::int64_t rank_bytes(const MlaConfig& cfg, const SpLayout& lay, FormVariant f, int r,
                        Backend backend, std::int64_t held_per_rank) {
  MemoryModelOptions o;
  o.staging = staging_of(backend);
  const MemoryPrediction p = predict_memory(cfg, lay, f, AttentionKind::flash, r, 4, o);
  EXPECT_EQ(p.gradients, parameter_bytes(cfg));
  EXPECT_GE(p.cache_allowance, 0);
  const std::int64_t shards = 4 * (4 * lay.batch * lay.seq_count[size_t(r)] * cfg.dim);
  return p.peak_working + parameter_bytes(cfg) + shards + held_per_rank + p.cache_allowance;
}

TEST(MemoryCheck, ABlockJobIsEveryRankItRunsPlusWhatItHolds) {
  MlaConfig cfg = MlaConfig::preset("tiny");
  // Uneven: seq 13 + 12 + 12 and heads 2 + 1 + 1, so the sum is not P x the largest.
  const SpLayout lay = SpLayout::even(2, 37, cfg.n_heads, 3);
  const std::int64_t shared = 1'000'003, per_rank = 7'919;
  for (FormVariant f : {FormVariant(Form::explicit_form), FormVariant(Form::laga)}) {
    std::vector<std::int64_t> local, mpi;
    for (int r = 0; r < lay.ranks; ++r) {
      local.push_back(rank_bytes(cfg, lay, f, r, Backend::local, per_rank));
      mpi.push_back(rank_bytes(cfg, lay, f, r, Backend::mpi, per_rank));
    }
    ASSERT_NE(local[0], local[1]) << "the layout must make ranks differ";
    const std::string name = to_string(f);

    const JobMemory all = predict_job_memory(cfg, lay, {f}, AttentionKind::flash, Backend::local,
                                             -1, shared, per_rank);
    EXPECT_EQ(all.bytes, local[0] + local[1] + local[2] + shared) << name;
    EXPECT_NE(all.detail.find("3 rank(s)"), std::string::npos) << all.detail;

    const JobMemory one =
        predict_job_memory(cfg, lay, {f}, AttentionKind::flash, Backend::mpi, -1, shared, per_rank);
    EXPECT_EQ(one.bytes, *std::max_element(mpi.begin(), mpi.end()) + shared) << name;
    EXPECT_NE(one.detail.find("1 rank(s)"), std::string::npos) << one.detail;

    for (int r = 0; r < lay.ranks; ++r)
      for (Backend b : {Backend::local, Backend::mpi}) {
        const JobMemory only =
            predict_job_memory(cfg, lay, {f}, AttentionKind::flash, b, r, shared, per_rank);
        EXPECT_EQ(only.bytes, (b == Backend::local ? local : mpi)[size_t(r)] + shared)
            << name << " --rank-only " << r;
      }
  }
  // Several forms run one after another: the largest of them.
  const JobMemory both = predict_job_memory(cfg, lay, {Form::explicit_form, Form::laga},
                                            AttentionKind::flash, Backend::local, -1, 0, 0);
  std::int64_t want = 0;
  for (Form f : {Form::explicit_form, Form::laga}) {
    std::int64_t sum = 0;
    for (int r = 0; r < lay.ranks; ++r) sum += rank_bytes(cfg, lay, f, r, Backend::local, 0);
    want = std::max(want, sum);
  }
  EXPECT_EQ(both.bytes, want);
}

TEST(MemoryCheck, ATrainJobIsEveryRankLocallyAndTheLargestUnderMpi) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 2, 64, 34);
  o.variant.form = Form::laga;
  o.sp = 3;
  o.batch = 2;
  o.seq = 34;  // 12 + 11 + 11 tokens, heads 2 + 1 + 1
  o.steps = 1;
  const std::vector<TrainMemory> local = predict_train_memory(o, StagingRule::in_process),
                                 mpi = predict_train_memory(o, StagingRule::mpi);
  ASSERT_EQ(local.size(), 3u);
  std::int64_t sum = 0, local_worst = 0, worst = 0;
  for (const TrainMemory& m : local) sum += m.peak, local_worst = std::max(local_worst, m.peak);
  for (const TrainMemory& m : mpi) worst = std::max(worst, m.peak);
  ASSERT_LT(sum, 3 * local_worst) << "the layout must make the ranks' peaks differ";
  EXPECT_EQ(predict_train_job_memory(o, Backend::local).bytes, sum);
  EXPECT_EQ(predict_train_job_memory(o, Backend::mpi).bytes, worst);
}

// The train check's closed-form floor (issue 54 item O), checked before the
// count-only prediction, whose bookkeeping grows with the model's tensors:
// 12 bytes (fp32 parameters, AdamW m and v) per parameter a rank holds,
// every rank with --comm local, one under MPI; with --expert-parallel the
// most routed experts any rank owns. Never above the prediction (it is a
// floor), and an MoE model's figure names its routed experts.
TEST(MemoryCheck, ATrainJobsFloorIsItsParametersAndMomentsAndNamesTheExperts) {
  const char* src = std::getenv("LAGA_SOURCE_DIR");
  TrainOptions o;
  o.model = LmConfig::from_json_file(std::string(src ? src : ".") + "/docs/assets/moe_tiny.json");
  o.sp = 2, o.seq = 32, o.batch = 1, o.steps = 1;
  const ModelParamCounts n = model_param_counts(o.model);
  ASSERT_GT(n.routed_experts, 0);
  const JobMemory every = train_state_lower_bound(o, Backend::local);
  EXPECT_EQ(every.bytes, 2 * 12 * n.total());
  EXPECT_EQ(train_state_lower_bound(o, Backend::mpi).bytes, 12 * n.total());
  EXPECT_LE(every.bytes, predict_train_job_memory(o, Backend::local).bytes);
  EXPECT_NE(every.detail.find("n_routed_experts 8"), std::string::npos) << every.detail;
  EXPECT_NE(every.lower_with.find("n_routed_experts"), std::string::npos) << every.lower_with;
  o.experts = ExpertPlacement::folded;  // EP 2: 4 of the 8 experts each
  const JobMemory folded = train_state_lower_bound(o, Backend::local);
  EXPECT_EQ(folded.bytes, 2 * 12 * (n.replicated() + n.routed_experts / 2));
  EXPECT_LE(folded.bytes, predict_train_job_memory(o, Backend::local).bytes);
}

// --count-only: no tensor storage, so the figure is one record per class of
// identical ranks (all P here) or one (an MPI process), plus per rank its
// record index per form, its measured-rank entry and the layout's four
// entries; nothing else grows with P. Before issue 26 item 14 count-only was
// never checked (and ran P threads: 3.3 GB at P 512).
TEST(MemoryCheck, ACountOnlyJobIsOneRecordPerRankClassPlusPerRankBookkeeping) {
  const MlaConfig cfg = MlaConfig::preset("tiny");
  const std::vector<FormVariant> forms{FormVariant(Form::explicit_form), FormVariant(Form::laga)};
  const auto record = [](std::size_t keys) { return std::int64_t(1'009 + 17 * keys); };
  for (int P : {3, 4096}) {
    const SpLayout lay = SpLayout::even(2, P == 3 ? 37 : 5000, cfg.n_heads, P);
    std::int64_t all_records = 0, one_record = 0;
    for (FormVariant f : forms) {
      const std::int64_t r = record(predict_comm(cfg, lay, f, 0, 4, true, true).size());
      all_records += std::int64_t(rank_classes(cfg, lay, f).representatives.size()) * r;
      one_record += r;
    }
    // Per rank: 3 ints; seq_count, head_count, head_offset; seq_ranges'
    // vector header (3 pointers) and two ranges of two int64 each.
    const std::int64_t per_rank = P * (3 * std::int64_t(sizeof(int)) + 3 * 8 + 3 * 8 + 2 * 16);
    EXPECT_EQ(predict_count_only_job_memory(cfg, lay, forms, P, record).bytes,
              all_records + per_rank)
        << "P " << P;
    EXPECT_EQ(predict_count_only_job_memory(cfg, lay, forms, 1, record).bytes,
              one_record + per_rank)
        << "P " << P;
    // A handful of classes, not P records: two shard sizes, two all-reduce
    // chunk sizes, ranks with a head or none.
    EXPECT_LE(all_records, 8 * one_record) << "P " << P;
  }
}

}  // namespace
}  // namespace laga::tools
