// The training loop: determinism, form agreement, exact resume, damaged
// checkpoints and bad data files. Small configs, a few steps each.
#include "model/train.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "common/error_of.hpp"
#include "common/lm_batch.hpp"
#include "common/scratch.hpp"
#include "core/error.hpp"
#include "model/checkpoint.hpp"
#include "model/data.hpp"

namespace laga {
namespace {

using test::losses;

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  return test::scratch_dir("model_train_", name);
}

TrainOptions small(Form form, int sp, std::int64_t steps = 8) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 2, 64, 32);
  o.variant.form = form;
  o.sp = sp;
  o.batch = 2;
  o.seq = 32;
  o.steps = steps;
  o.seed = 3;
  o.adam.lr = 3e-3;
  return o;
}

using test::error_of;

TEST(Train, LossFallsAndRunsAreBitIdentical) {
  const auto a = train_local(small(Form::laga, 2, 12)), b = train_local(small(Form::laga, 2, 12));
  ASSERT_EQ(a.size(), 12u);
  EXPECT_EQ(losses(a), losses(b));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].grad_norm, b[i].grad_norm);
  EXPECT_NEAR(a[0].loss, std::log(64.0), 1.0);  // ~ln V at init
  EXPECT_LT(a.back().loss, a[0].loss - 1.0);    // memorising the fixed batch
}

TEST(Train, LagaEqualsExplicitBitForBitAtP1) {
  EXPECT_EQ(losses(train_local(small(Form::laga, 1))),
            losses(train_local(small(Form::explicit_form, 1))));
}

TEST(Train, FormsFollowExplicitAtP2) {
  const auto ex = losses(train_local(small(Form::explicit_form, 2)));
  // laga2d with one head group (4 heads at P 2 would otherwise be laga's
  // split): two context groups, each rank all heads of its mirrored chunks;
  // and overlapped.
  std::vector<TrainOptions> runs{small(Form::laga, 2), small(Form::absorbed, 2),
                                 small(Form::laga2d, 2)};
  runs.back().variant.head_groups = 1;
  runs.push_back(runs.back());
  runs.back().variant.overlap = Overlap::on;
  for (const TrainOptions& o : runs) {
    const auto got = losses(train_local(o));
    ASSERT_EQ(got.size(), ex.size());
    // fp32 rounding of differently ordered sums, amplified a little by 8
    // steps of Adam: ~1e-6 seen; 1e-4 is far below any real difference.
    for (size_t i = 0; i < ex.size(); ++i)
      EXPECT_NEAR(got[i], ex[i], 1e-4 * std::abs(ex[i]))
          << to_string(o.variant) << " step " << i + 1;
  }
  // And the P = 2 run follows the P = 1 run the same way.
  const auto one = losses(train_local(small(Form::explicit_form, 1)));
  for (size_t i = 0; i < ex.size(); ++i) EXPECT_NEAR(one[i], ex[i], 1e-4 * std::abs(ex[i]));
}

TEST(Train, ResumeIsBitIdentical) {
  const fs::path dir = scratch("resume");
  const auto straight = train_local(small(Form::laga, 2, 20));
  TrainOptions first = small(Form::laga, 2, 10);
  first.save_every = 5;
  first.checkpoint_dir = dir.string();
  const auto a = train_local(first);
  TrainOptions second = small(Form::laga, 2, 20);
  second.resume = dir.string();
  const auto b = train_local(second);
  ASSERT_EQ(b.size(), 10u);
  EXPECT_EQ(b[0].step, 11);
  std::vector<double> joined = losses(a), tail = losses(b);
  joined.insert(joined.end(), tail.begin(), tail.end());
  EXPECT_EQ(joined, losses(straight));
}

TEST(Train, DamagedCheckpointIsRefusedAndThePreviousStillLoads) {
  const fs::path dir = scratch("damaged");
  TrainOptions o = small(Form::laga, 1, 4);
  o.save_every = 2;
  o.checkpoint_dir = dir.string();
  train_local(o);
  const fs::path newest = dir / "step-00000004.safetensors";
  ASSERT_TRUE(fs::exists(newest));
  ASSERT_TRUE(fs::exists(dir / "step-00000002.json"));
  const auto size = fs::file_size(newest);

  TrainOptions r = small(Form::laga, 1, 6);
  r.resume = dir.string();
  // Corrupt one byte in the data section: the header still parses.
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(size - 5));
    char c;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(std::streamoff(size - 5));
    f.write(&c, 1);
  }
  std::string e = error_of([&] { train_local(r); });
  EXPECT_NE(e.find("corrupted"), std::string::npos) << e;
  EXPECT_NE(e.find("step-00000002.json"), std::string::npos) << e;
  // Truncated.
  fs::resize_file(newest, size / 2);
  e = error_of([&] { train_local(r); });
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find("--resume"), std::string::npos) << e;
  // The previous checkpoint still loads and continues exactly.
  r.resume = (dir / "step-00000002.json").string();
  const auto resumed = train_local(r);
  ASSERT_EQ(resumed.size(), 4u);
  const auto straight = train_local(small(Form::laga, 1, 6));
  EXPECT_EQ(resumed.back().loss, straight.back().loss);
  // A mangled manifest is refused too.
  { std::ofstream(dir / "latest.json") << "{ not json"; }
  r.resume = dir.string();
  e = error_of([&] { train_local(r); });
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

// Bitwise equality of two parameter sets, tensor by tensor.
bool same_params(const LmParams<float>& a, const LmParams<float>& b) {
  std::vector<const Tensor<float>*> ta, tb;
  a.for_each([&](const std::string&, const Tensor<float>& t) { ta.push_back(&t); });
  b.for_each([&](const std::string&, const Tensor<float>& t) { tb.push_back(&t); });
  if (ta.size() != tb.size()) return false;
  for (size_t k = 0; k < ta.size(); ++k)
    if (ta[k]->numel() != tb[k]->numel() ||
        std::memcmp(ta[k]->data(), tb[k]->data(), size_t(ta[k]->bytes())) != 0)
      return false;
  return true;
}

LmParams<float> copy_of(const LmParams<float>& p, const LmConfig& cfg) {
  LmParams<float> c = LmParams<float>::zeros(cfg, MemCategory::parameters);
  std::vector<const Tensor<float>*> from;
  p.for_each([&](const std::string&, const Tensor<float>& t) { from.push_back(&t); });
  size_t k = 0;
  c.for_each([&](const std::string&, Tensor<float>& t) {
    std::memcpy(t.data(), from[k++]->data(), size_t(t.bytes()));
  });
  return c;
}

// A NaN in one gradient (a finite loss: what an overflowing backward gives)
// stops the step before AdamW: the message names the step, the tensor and
// the count; no checkpoint of that step exists, and the last one holds the
// weights the step started from, all finite. With --allow-nonfinite the
// step is applied and the run goes on, with a warning.
TEST(Train, NonFiniteGradientStopsTheStepBeforeTheUpdate) {
  const fs::path dir = scratch("nonfinite_grad");
  for (int sp : {1, 2}) {
    fs::remove_all(dir);
    TrainOptions o = small(Form::laga, sp, 4);
    o.checkpoint_dir = dir.string();
    o.save_every = 1;
    MemoryPool test_pool;  // outlives the rank threads, whose own pools end with them
    LmParams<float> before_step_3;
    std::mutex hook_mutex;
    o.after_backward = [&](std::int64_t step, const LmParams<float>& params,
                           LmParams<float>& grads) {
      if (step != 3) return;
      grads.layers[1].w3[7] = std::numeric_limits<float>::quiet_NaN();
      std::lock_guard<std::mutex> lock(hook_mutex);  // every rank calls it
      PoolScope scope(test_pool);
      if (before_step_3.layers.empty()) before_step_3 = copy_of(params, o.model);
    };
    const std::string e = error_of([&] { train_local(o); });
    EXPECT_NE(e.find("the gradient at step 3 is not finite"), std::string::npos) << e;
    EXPECT_NE(e.find("the gradient of 'layers.1.ffn.w3.weight' holds 1 non-finite value"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("the step was not applied (the weights are those after step 2)"),
              std::string::npos)
        << e;
    EXPECT_FALSE(fs::exists(dir / "step-00000003.json")) << "P=" << sp;
    EXPECT_FALSE(fs::exists(dir / "step-00000003.safetensors")) << "P=" << sp;
    TrainState<float> saved;
    saved.params = LmParams<float>::zeros(o.model, MemCategory::parameters);
    saved.m = LmParams<float>::zeros(o.model, MemCategory::optimizer);
    saved.v = LmParams<float>::zeros(o.model, MemCategory::optimizer);
    EXPECT_EQ(load_checkpoint(dir.string(), o.model, saved).step, 2);  // finite, or it refuses
    ASSERT_FALSE(before_step_3.layers.empty());
    EXPECT_TRUE(same_params(saved.params, before_step_3)) << "P=" << sp;

    // Allowed: the step is applied (its NaN spreads) and the run ends.
    fs::remove_all(dir);
    o.allow_nonfinite = true;
    std::vector<std::string> warnings;
    o.warn = [&](const std::string& w) { warnings.push_back(w); };
    const auto records = train_local(o);
    ASSERT_EQ(records.size(), 4u);
    EXPECT_TRUE(std::isnan(records[2].grad_norm));
    ASSERT_FALSE(warnings.empty());
    EXPECT_NE(warnings[0].find("the gradient at step 3 is not finite"), std::string::npos)
        << warnings[0];
  }
}

void write_u16(const fs::path& p, const std::vector<std::uint16_t>& ids) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
}

TEST(Train, DataFileErrorsNameTheFileAndTheFix) {
  const fs::path dir = scratch("data");
  TrainOptions o = small(Form::laga, 1, 2);
  o.data = (dir / "missing.bin").string();
  std::string e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("missing.bin': no such file"), std::string::npos) << e;

  o.data = (dir / "empty.bin").string();
  { std::ofstream(o.data); }
  e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("empty.bin' is empty"), std::string::npos) << e;

  o.data = (dir / "short.bin").string();
  write_u16(o.data, std::vector<std::uint16_t>(20, 1));
  e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("holds 20 token ids but one window needs --seq + 1 = 33"), std::string::npos)
      << e;

  o.data = (dir / "big_ids.bin").string();
  std::vector<std::uint16_t> ids(100, 2);
  ids[57] = 64;  // == vocab
  write_u16(o.data, ids);
  e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("token id 64 at position 57 is >= --vocab 64; pass --vocab 65"),
            std::string::npos)
      << e;

  o.data = (dir / "odd.bin").string();
  { std::ofstream(o.data) << "abc"; }
  e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("not a whole number of u16 ids"), std::string::npos) << e;
}

TEST(Train, DataFileTrainsDeterministically) {
  const fs::path dir = scratch("datafile");
  std::vector<std::uint16_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = std::uint16_t((i * 7 + i / 3) % 64);
  write_u16(dir / "tokens.bin", ids);
  TrainOptions o = small(Form::laga, 2, 4);
  o.data = (dir / "tokens.bin").string();
  const auto a = train_local(o), b = train_local(o);
  EXPECT_EQ(losses(a), losses(b));
  // Each step draws fresh windows, so the batch (and loss) changes step to step.
  EXPECT_NE(a[0].loss, a[1].loss);
}

// Issue 28 item 5: validation. The logged val_loss of step N is the mean
// forward loss of the fixed validation batches (cursors 0 .. K*B - 1 of the
// file's seeded windows) under the weights after step N: recomputed here
// from step N's checkpoint with lm_loss, bit for bit at P 1; every form at
// P 2 follows it within 1e-5.
TEST(Train, ValidationIsTheMeanForwardLossOfFixedHeldOutBatches) {
  const fs::path dir = scratch("validation");
  std::vector<std::uint16_t> train_ids(1500), val_ids(400);
  for (size_t i = 0; i < train_ids.size(); ++i) train_ids[i] = std::uint16_t((i * 7 + i / 3) % 64);
  for (size_t i = 0; i < val_ids.size(); ++i) val_ids[i] = std::uint16_t((i * 11 + i / 5) % 64);
  write_u16(dir / "train.bin", train_ids);
  write_u16(dir / "val.bin", val_ids);
  TrainOptions o = small(Form::explicit_form, 1, 4);
  o.data = (dir / "train.bin").string();
  o.val_data = (dir / "val.bin").string();
  o.val_every = 3;
  o.val_batches = 3;
  o.checkpoint_dir = (dir / "ck").string();
  o.save_every = 3;
  const std::vector<StepRecord> run = train_local(o);
  ASSERT_EQ(run.size(), 4u);
  EXPECT_FALSE(run[0].val_loss || run[1].val_loss);
  ASSERT_TRUE(run[2].val_loss && run[3].val_loss);  // every 3 steps, and after the last
  EXPECT_NE(*run[2].val_loss, *run[3].val_loss);

  TrainState<float> st;
  st.params = LmParams<float>::zeros(o.model, MemCategory::parameters);
  st.m = LmParams<float>::zeros(o.model, MemCategory::parameters);
  st.v = LmParams<float>::zeros(o.model, MemCategory::parameters);
  load_checkpoint((dir / "ck" / "step-00000003.json").string(), o.model, st);
  const TokenSource val = TokenSource::file(o.val_data, "u16", o.model.vocab, o.seq, o.seed);
  auto comm = make_self_communicator();
  const SpLayout layout = SpLayout::even(o.batch, o.seq, o.model.mla.n_heads, 1);
  const RopeTable rope(o.model.mla.rope(), o.seq);
  const LmContext ctx{o.model, layout, *comm, rope, o.variant, o.attention};
  double sum = 0;
  std::vector<std::int32_t> window(size_t(o.batch * (o.seq + 1))), tok, tgt;
  for (std::int64_t k = 0; k < o.val_batches; ++k) {
    val.batch(k * o.batch, o.batch, o.seq, window.data());
    tok.clear(), tgt.clear();
    for (std::int64_t b = 0; b < o.batch; ++b)
      for (std::int64_t i = 0; i < o.seq; ++i) {
        tok.push_back(window[size_t(b * (o.seq + 1) + i)]);
        tgt.push_back(window[size_t(b * (o.seq + 1) + i + 1)]);
      }
    sum += lm_loss(ctx, st.params, tok.data(), tgt.data());
  }
  EXPECT_EQ(*run[2].val_loss, sum / double(o.val_batches));

  for (Form f : all_forms()) {
    TrainOptions p = o;
    p.variant.form = f;
    p.sp = 2;
    p.checkpoint_dir.clear();
    p.save_every = 0;
    const std::vector<StepRecord> r = train_local(p);
    for (size_t i : {size_t(2), size_t(3)})
      EXPECT_NEAR(*r[i].val_loss, *run[i].val_loss, 1e-5 * *run[i].val_loss) << to_string(f);
  }
  // Its options need each other and a valid file, named as --val-data.
  TrainOptions bad = o;
  bad.val_every = 0;
  EXPECT_NE(error_of([&] { validate_train_options(bad); }).find("--val-data needs --val-every"),
            std::string::npos);
  bad = o;
  bad.val_data = (dir / "missing.bin").string();
  EXPECT_NE(error_of([&] { validate_train_options(bad); }).find("--val-data '"), std::string::npos);
}

// A token file of documents: lengths 1 to 12 (some shorter than a rank's
// shard, some crossing shard and window boundaries), each ending with EOS.
constexpr std::int32_t kEos = 0;
fs::path packed_file(const fs::path& dir) {
  std::vector<std::uint16_t> ids;
  for (std::uint32_t d = 0; ids.size() < 2000; ++d) {
    const std::uint32_t len = 1 + (d * 5 + d / 4) % 12;
    for (std::uint32_t i = 0; i + 1 < len; ++i) ids.push_back(std::uint16_t(1 + (d + i * 3) % 63));
    ids.push_back(std::uint16_t(kEos));
  }
  write_u16(dir / "docs.bin", ids);
  return dir / "docs.bin";
}

TEST(Train, PackedDataTrainsResumesExactlyAndFollowsAcrossForms) {
  const fs::path dir = scratch("packed");
  TrainOptions o = small(Form::laga, 2, 8);
  o.data = packed_file(dir).string();
  o.pack_eos = kEos;
  const auto straight = train_local(o);
  ASSERT_EQ(straight.size(), 8u);
  // Fewer targets than B*S count: those after an EOS input are ignored.
  for (const StepRecord& r : straight) {
    EXPECT_LT(r.targets, o.batch * o.seq);
    EXPECT_GT(r.targets, o.batch * o.seq / 2);
  }
  // The same data unpacked is another run.
  TrainOptions unpacked = o;
  unpacked.pack_eos.reset();
  EXPECT_NE(losses(train_local(unpacked))[0], straight[0].loss);

  // 4 steps, a checkpoint, 4 more: the same losses bit for bit.
  TrainOptions first = o;
  first.steps = 4;
  first.checkpoint_dir = (dir / "ck").string();
  const auto a = train_local(first);
  TrainOptions second = o;
  second.resume = first.checkpoint_dir;
  const auto b = train_local(second);
  std::vector<double> joined = losses(a), tail = losses(b);
  joined.insert(joined.end(), tail.begin(), tail.end());
  EXPECT_EQ(joined, losses(straight));

  // The checkpoint records the packing: resuming without it is refused.
  TrainOptions dropped = second;
  dropped.pack_eos.reset();
  const std::string e = error_of([&] { validate_train_options(dropped); });
  EXPECT_NE(e.find("pack-eos: 0 -> (not used)"), std::string::npos) << e;

  // Every form and P follow single-rank explicit within fp32 rounding.
  TrainOptions ex = o;
  ex.variant.form = Form::explicit_form;
  ex.sp = 1;
  const auto ref = losses(train_local(ex));
  for (Form f : all_forms())
    for (int sp : {2, 3}) {
      TrainOptions g = o;
      g.variant.form = f;
      g.sp = sp;
      const auto got = losses(train_local(g));
      for (size_t i = 0; i < ref.size(); ++i)
        EXPECT_NEAR(got[i], ref[i], 1e-4 * std::abs(ref[i]))
            << to_string(f) << " sp " << sp << " step " << i + 1;
    }
}

TEST(Train, PackEosErrorsNameTheIdAndTheFix) {
  const fs::path dir = scratch("packed_errors");
  TrainOptions o = small(Form::laga, 1, 2);
  o.data = packed_file(dir).string();
  o.pack_eos = 64;  // == vocab
  std::string e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("--pack-eos 64 is not a token id of the vocabulary [0, 64)"), std::string::npos)
      << e;
  o.pack_eos = 63;  // a valid id the file never holds (ids are 0..63, 63 never written)
  std::vector<std::uint16_t> ids(100, 5);
  ids[10] = 0;
  write_u16(dir / "no63.bin", ids);
  o.data = (dir / "no63.bin").string();
  e = error_of([&] { validate_train_options(o); });
  EXPECT_NE(e.find("--pack-eos 63: the id never occurs in --data"), std::string::npos) << e;
  // A batch of nothing but EOS has no target to learn from.
  write_u16(dir / "all_eos.bin", std::vector<std::uint16_t>(100, 0));
  o.data = (dir / "all_eos.bin").string();
  o.pack_eos = 0;
  e = error_of([&] { train_local(o); });
  EXPECT_NE(e.find("step 1: every input token of the batch is the end-of-document id 0"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace laga
