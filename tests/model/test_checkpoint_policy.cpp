// Checkpoint directory policy and resume checks (issue 10 items 1 and 9):
// pruning never deletes the checkpoint latest.json names nor a later one; a
// fresh run into a directory holding checkpoints is refused; a resume from an
// earlier step moves the later checkpoints aside; a resume refuses changed
// settings (naming option: old -> new) unless allowed, a --steps at or below
// the checkpoint's step, and a hand-edited manifest.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error_of.hpp"
#include "common/scratch.hpp"
#include "core/error.hpp"
#include "model/checkpoint.hpp"
#include "model/train.hpp"

namespace laga {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  return test::scratch_dir("model_ckpt_policy_", name);
}

TrainOptions small(std::int64_t steps) {
  TrainOptions o;
  o.model = LmConfig::derive(32, 4, 1, 64, 16);
  o.variant.form = Form::laga;
  o.sp = 1;
  o.batch = 1;
  o.seq = 16;
  o.steps = steps;
  o.seed = 5;
  o.adam.lr = 3e-3;
  return o;
}

using test::error_of;

void expect_has(const std::string& text, const std::vector<std::string>& parts) {
  EXPECT_FALSE(text.empty()) << "expected an error";
  for (const auto& p : parts) EXPECT_NE(text.find(p), std::string::npos) << p << "\n in: " << text;
}

nlohmann::json read_json(const fs::path& p) {
  return nlohmann::json::parse(std::ifstream(p));
}

// latest.json names a checkpoint whose files exist.
void expect_latest_complete(const fs::path& dir, std::int64_t step) {
  const auto j = read_json(dir / "latest.json");
  EXPECT_EQ(j.at("step").get<std::int64_t>(), step);
  EXPECT_TRUE(fs::exists(dir / j.at("file").get<std::string>())) << j.at("file");
}

// The issue's three commands. Today's main: the second run exits 0 after
// pruning away its own step 6, which latest.json names; the third fails on
// the missing step 6.
TEST(CheckpointPolicy, IssueScenarioFreshRunIntoUsedDirectoryIsRefused) {
  const fs::path dir = scratch("issue");
  TrainOptions a = small(12);
  a.save_every = 4;
  a.checkpoint_dir = dir.string();
  train_local(a);
  expect_latest_complete(dir, 12);

  TrainOptions b = small(6);
  b.save_every = 2;
  b.checkpoint_dir = dir.string();
  expect_has(error_of([&] { train_local(b); }),
             {"already holds checkpoints", "step-00000008.json", "step-00000012.json",
              "--resume " + dir.string(), "another --checkpoint directory"});
  expect_latest_complete(dir, 12);
  EXPECT_FALSE(fs::exists(dir / "step-00000006.json"));

  TrainOptions c = small(8);
  c.resume = dir.string();
  expect_has(error_of([&] { train_local(c); }),
             {"--steps 8 is at or below step 12", "pass a number above 12"});
  c.steps = 14;
  EXPECT_EQ(train_local(c).size(), 2u);
}

// Pruning directly: a directory that already holds a later checkpoint keeps
// it, and keeps the one just written (which latest.json names).
TEST(CheckpointPolicy, PruningKeepsLatestAndLaterCheckpoints) {
  const fs::path dir = scratch("prune");
  const LmConfig cfg = small(1).model;
  TrainState<float> st;
  st.params = LmParams<float>::zeros(cfg, MemCategory::parameters);
  st.m = LmParams<float>::zeros(cfg, MemCategory::parameters);
  st.v = LmParams<float>::zeros(cfg, MemCategory::parameters);
  for (std::int64_t step : {10, 12, 2, 4, 6}) {
    st.step = step;
    save_checkpoint(dir.string(), cfg, st, {});
  }
  // After 6: its own, the newest older one (4), and the later 10 and 12.
  for (const char* n : {"step-00000004", "step-00000006", "step-00000010", "step-00000012"}) {
    EXPECT_TRUE(fs::exists(dir / (std::string(n) + ".json"))) << n;
    EXPECT_TRUE(fs::exists(dir / (std::string(n) + ".safetensors"))) << n;
  }
  EXPECT_FALSE(fs::exists(dir / "step-00000002.json"));
  expect_latest_complete(dir, 6);
}

TEST(CheckpointPolicy, ResumeFromEarlierStepMovesLaterCheckpointsAside) {
  const fs::path dir = scratch("earlier");
  TrainOptions a = small(12);
  a.save_every = 4;
  a.checkpoint_dir = dir.string();
  const auto straight = train_local(a);
  const std::string old12 = [&] {
    std::ifstream in(dir / "step-00000012.safetensors", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();

  TrainOptions b = small(12);
  b.save_every = 2;
  b.checkpoint_dir = dir.string();
  b.resume = (dir / "step-00000008.json").string();
  const std::vector<std::string> notes = prepare_run(b);
  ASSERT_EQ(notes.size(), 1u);
  expect_has(notes[0], {"after step 8", "step-00000012.json", "moved, not deleted",
                        "superseded-after-step-00000008"});
  const fs::path aside = dir / "superseded-after-step-00000008";
  EXPECT_TRUE(fs::exists(aside / "step-00000012.json"));
  EXPECT_TRUE(fs::exists(aside / "step-00000012.safetensors"));
  EXPECT_TRUE(fs::exists(aside / "latest.json"));  // it named step 12
  expect_latest_complete(dir, 8);                  // now names the resumed step

  const auto resumed = train_local(b);
  ASSERT_EQ(resumed.size(), 4u);
  EXPECT_EQ(resumed.back().loss, straight.back().loss);  // same settings: bit for bit
  expect_latest_complete(dir, 12);
  EXPECT_TRUE(fs::exists(dir / "step-00000010.json"));
  // The replaced history is still there, byte for byte.
  std::ifstream in(aside / "step-00000012.safetensors", std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), old12);
  // The set-aside run can be resumed only into its own folder or a new one.
  b.resume = (aside / "step-00000012.json").string();
  EXPECT_NE(error_of([&] { validate_train_options(b); }), "");  // another directory's run
}

TEST(CheckpointPolicy, ResumeIntoAnotherUsedDirectoryIsRefused) {
  const fs::path one = scratch("one"), two = scratch("two");
  TrainOptions a = small(2);
  a.checkpoint_dir = one.string();
  train_local(a);
  a.checkpoint_dir = two.string();
  train_local(a);
  TrainOptions b = small(4);
  b.resume = one.string();
  b.checkpoint_dir = two.string();
  expect_has(error_of([&] { validate_train_options(b); }),
             {"--checkpoint '" + two.string() + "' already holds checkpoints",
              "not those of the run resumed from"});
}

// Every recorded option that shapes the trajectory, changed on resume.
TEST(CheckpointPolicy, ChangedSettingsAreRefusedNamingOldAndNew) {
  const fs::path dir = scratch("changed");
  {
    std::ofstream f(dir / "tokens.bin", std::ios::binary);
    for (int i = 0; i < 500; ++i) f.put(char(i % 64)).put(0);
  }
  TrainOptions a = small(2);
  a.checkpoint_dir = (dir / "ck").string();
  train_local(a);
  struct Case {
    std::string expect;
    std::function<void(TrainOptions&)> change;
  };
  const std::vector<Case> cases = {
      {"seq: 16 -> 32", [](TrainOptions& o) { o.seq = 32; }},
      {"batch: 1 -> 2", [](TrainOptions& o) { o.batch = 2; }},
      {"data: random -> file of 1000 bytes",
       [&](TrainOptions& o) { o.data = (dir / "tokens.bin").string(); }},
      {"lr: 0.0030000000000000001 -> 0.01", [](TrainOptions& o) { o.adam.lr = 0.01; }},
      {"schedule: constant -> cosine", [](TrainOptions& o) { o.cosine = true; }},
      {"warmup: 0 -> 3", [](TrainOptions& o) { o.warmup = 3; }},
      {"beta1: 0.90000000000000002 -> 0.80000000000000004",
       [](TrainOptions& o) { o.adam.beta1 = 0.8; }},
      {"beta2: 0.999 -> 0.98999999999999999", [](TrainOptions& o) { o.adam.beta2 = 0.99; }},
      {"eps: 1e-08 -> 9.9999999999999995e-07", [](TrainOptions& o) { o.adam.eps = 1e-6; }},
      {"weight-decay: 0 -> 0.10000000000000001",
       [](TrainOptions& o) { o.adam.weight_decay = 0.1; }},
      {"clip: 0 -> 1", [](TrainOptions& o) { o.clip = 1.0; }},
      {"seed: 5 -> 6", [](TrainOptions& o) { o.seed = 6; }},
      {"model n_layers: 1 -> 2", [](TrainOptions& o) { o.model.layers = 2; }},
  };
  for (const Case& c : cases) {
    TrainOptions r = small(4);
    r.resume = (dir / "ck").string();
    c.change(r);
    expect_has(error_of([&] { validate_train_options(r); }),
               {"settings differ", c.expect, "--allow-change"});
  }
  // Two at once are both named.
  TrainOptions r = small(4);
  r.resume = (dir / "ck").string();
  r.seq = 32;
  r.adam.lr = 0.01;
  expect_has(error_of([&] { validate_train_options(r); }), {"seq: 16 -> 32", "lr: "});
}

TEST(CheckpointPolicy, AllowChangeAndFreeOptions) {
  const fs::path dir = scratch("allow");
  TrainOptions a = small(2);
  a.checkpoint_dir = dir.string();
  train_local(a);
  TrainOptions r = small(4);
  r.resume = dir.string();
  r.adam.lr = 0.01;
  r.allow_change = {"lr"};
  r.variant.form = Form::explicit_form;  // free: the same math
  const auto notes = prepare_run(r);
  ASSERT_EQ(notes.size(), 2u);
  expect_has(notes[0] + notes[1], {"form: laga -> explicit", "allowed by --allow-change"});
  EXPECT_EQ(train_local(r).size(), 2u);
  r.allow_change = {"lr", "learning-rate"};
  expect_has(error_of([&] { validate_train_options(r); }),
             {"--allow-change: 'learning-rate' is not an option", "lr"});
  TrainOptions fresh = small(2);
  fresh.allow_change = {"lr"};
  expect_has(error_of([&] { validate_train_options(fresh); }), {"only to a run that continues"});
}

TEST(CheckpointPolicy, StepsAtOrBelowTheCheckpointAreAnError) {
  const fs::path dir = scratch("steps");
  TrainOptions a = small(3);
  a.checkpoint_dir = dir.string();
  train_local(a);
  for (std::int64_t steps : {1, 3}) {
    TrainOptions r = small(steps);
    r.resume = dir.string();
    expect_has(error_of([&] { train_local(r); }),
               {"--steps " + std::to_string(steps) + " is at or below step 3"});
  }
}

// The manifest hash covers the manifest: step, data cursor, options.
TEST(CheckpointPolicy, HandEditedManifestIsRefused) {
  const fs::path dir = scratch("edited");
  TrainOptions a = small(4);
  a.save_every = 2;
  a.checkpoint_dir = dir.string();
  train_local(a);
  const nlohmann::json good = read_json(dir / "step-00000004.json");
  const std::vector<std::function<void(nlohmann::json&)>> edits = {
      [](nlohmann::json& j) { j["step"] = 2; },
      [](nlohmann::json& j) { j["data_cursor"] = 0; },
      [](nlohmann::json& j) { j["options"]["lr"] = "0.01"; },
      [](nlohmann::json& j) { j.erase("manifest_fnv1a64"); },
  };
  for (const auto& edit : edits) {
    nlohmann::json j = good;
    edit(j);
    std::ofstream(dir / "latest.json") << j.dump(2);
    TrainOptions r = small(6);
    r.resume = dir.string();
    const std::string e = error_of([&] { train_local(r); });
    EXPECT_TRUE(e.find("was changed after it was written") != std::string::npos ||
                e.find("lacks a field") != std::string::npos)
        << e;
    EXPECT_NE(e.find("--resume " + (dir / "step-00000004.json").string()), std::string::npos) << e;
  }
  // The untouched manifest still resumes.
  TrainOptions r = small(6);
  r.resume = (dir / "step-00000004.json").string();
  EXPECT_EQ(train_local(r).size(), 2u);
}

TEST(CheckpointPolicy, StaleTemporariesOfLagaAreRemovedOthersKept) {
  const fs::path dir = scratch("temps");
  // A pid that no longer runs: this process's own counts as stale too (it
  // writes checkpoints from one thread), so use that.
  const std::string me = std::to_string(::getpid());
  const std::vector<std::string> stale = {"step-00000007.safetensors.tmp." + me + ".3",
                                          "latest.json.tmp." + me + ".0",
                                          "step-00000007.json.tmp." + me + ".12"};
  const std::vector<std::string> foreign = {"notes.tmp." + me + ".0",
                                            "step-7.json.tmp." + me + ".0", "latest.json.tmp.x.0",
                                            "my-latest.json.tmp." + me + ".0"};
  for (const auto& n : stale) std::ofstream(dir / n) << "x";
  for (const auto& n : foreign) std::ofstream(dir / n) << "x";
  TrainOptions a = small(1);
  a.checkpoint_dir = dir.string();
  train_local(a);
  for (const auto& n : stale) EXPECT_FALSE(fs::exists(dir / n)) << n;
  for (const auto& n : foreign) EXPECT_TRUE(fs::exists(dir / n)) << n;
}

// Issue 26 item 8. Today's main: the fresh run is accepted (only .json files
// counted) and overwrites the orphan at its step 2; the resume also writes
// over the orphan of a later step.
TEST(CheckpointPolicy, AnOrphanTensorsFileIsNeverWrittenOver) {
  const fs::path dir = scratch("orphan");
  std::ofstream(dir / "step-00000002.safetensors") << "not laga's";
  TrainOptions a = small(3);
  a.save_every = 1;
  a.checkpoint_dir = dir.string();
  expect_has(error_of([&] { train_local(a); }),
             {"already holds checkpoints", "step-00000002.safetensors"});
  std::ifstream kept(dir / "step-00000002.safetensors");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "not laga's");

  // A run to step 2, then a tensors file of step 4 without its manifest (a
  // save killed between the two): the resume sets it aside before step 4.
  const fs::path dir2 = scratch("orphan_resume");
  TrainOptions b = small(2);
  b.checkpoint_dir = dir2.string();
  train_local(b);
  std::ofstream(dir2 / "step-00000004.safetensors") << "the killed save's";
  TrainOptions c = small(5);
  c.save_every = 1;
  c.checkpoint_dir = dir2.string();
  c.resume = dir2.string();
  const std::vector<std::string> notes = prepare_run(c);
  ASSERT_EQ(notes.size(), 1u);
  expect_has(notes[0], {"step-00000004.safetensors", "moved, not deleted"});
  EXPECT_EQ(train_local(c).size(), 3u);
  std::ifstream aside(dir2 / "superseded-after-step-00000002" / "step-00000004.safetensors");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(aside), {}), "the killed save's");
  expect_latest_complete(dir2, 5);
}

// Issue 26 item 7: one writer per directory. Today's main has no lock, so
// the second writer's construction (there: its run) succeeds.
TEST(CheckpointPolicy, OneWriterPerDirectory) {
  const fs::path dir = scratch("lock");
  {
    const CheckpointDirectoryLock held(dir.string());
    expect_has(error_of([&] { CheckpointDirectoryLock second(dir.string()); }),
               {"is in use", "laga.lock", "pid " + std::to_string(::getpid()), "this process",
                "another --checkpoint directory"});
    TrainOptions a = small(1);
    a.checkpoint_dir = dir.string();
    expect_has(error_of([&] { train_local(a); }), {"is in use"});
    EXPECT_FALSE(fs::exists(dir / "latest.json"));  // refused before any step
  }
  EXPECT_FALSE(fs::exists(dir / "laga.lock"));  // released

  // A lock left by a process that no longer runs (kill -9) is taken over.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ::waitpid(child, &status, 0);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::ofstream(dir / "laga.lock") << "pid " << child << " host " << host << "\n";
  TrainOptions a = small(1);
  a.checkpoint_dir = dir.string();
  EXPECT_EQ(train_local(a).size(), 1u);
  EXPECT_FALSE(fs::exists(dir / "laga.lock"));

  // Another host's lock (a shared filesystem) cannot be judged stale here.
  const fs::path dir2 = scratch("lock_host");
  std::ofstream(dir2 / "laga.lock") << "pid 1 host some-other-node\n";
  expect_has(error_of([&] { CheckpointDirectoryLock l(dir2.string()); }),
             {"is in use", "pid 1 on host some-other-node", "remove the lock file"});
  // A damaged lock is not taken over silently either.
  std::ofstream(dir2 / "laga.lock") << "garbage";
  expect_has(error_of([&] { CheckpointDirectoryLock l(dir2.string()); }), {"no valid holder"});
}

// Issue 26 item 11: a --checkpoint that cannot be written is refused before
// the first step (today's main trains every step, then fails the save): a
// path through a file (for every user), and a read-only directory (not for
// root, who may write into one).
TEST(CheckpointPolicy, AnUnwritableDirectoryIsRefusedBeforeTheFirstStep) {
  const fs::path dir = scratch("readonly");
  std::ofstream(dir / "a-file") << "x";
  int steps = 0;
  TrainOptions a = small(2);
  a.after_backward = [&](std::int64_t, const LmParams<float>&, LmParams<float>&) { ++steps; };
  a.checkpoint_dir = (dir / "a-file" / "ck").string();
  expect_has(error_of([&] { train_local(a); }), {"cannot create the directory", "writable"});
  EXPECT_EQ(steps, 0);
  if (::geteuid() == 0) return;
  fs::create_directory(dir / "ro");
  fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  a.checkpoint_dir = (dir / "ro").string();
  expect_has(error_of([&] { train_local(a); }), {"cannot create files in it", "writable"});
  EXPECT_EQ(steps, 0);
  fs::permissions(dir / "ro", fs::perms::owner_all);
}

// Issue 54 V: under MPI the ranks that do not write (checkpoint_writer
// false) never judge the lock, which rank 0 may already hold; the writer
// still refuses a live holder's.
TEST(CheckpointPolicy, OnlyTheWriterJudgesTheLock) {
  const fs::path dir = scratch("lock_judge");
  const CheckpointDirectoryLock held(dir.string());  // as rank 0 takes it
  TrainOptions a = small(1);
  a.checkpoint_dir = dir.string();
  EXPECT_EQ(error_of([&] { validate_train_options(a, /*checkpoint_writer=*/false); }), "");
  expect_has(error_of([&] { validate_train_options(a); }), {"is in use", "this process"});
}

// Issue 54 G: the names a checkpoint directory owns, and a file of a run in
// one of them refused under every spelling, naming both.
TEST(CheckpointPolicy, NoFileOfARunTakesANameTheDirectoryOwns) {
  for (const char* n : {"laga.lock", "latest.json", "step-00000002.json", "step-2.safetensors",
                        "step-7", "step-00000004.json.tmp.12.0", "latest.json.tmp.1.2",
                        "laga.lock.tmp.3.4", "superseded-after-step-00000002", ".laga-probe.99"})
    EXPECT_TRUE(is_checkpoint_directory_name(n)) << n;
  for (const char* n : {"train.jsonl", "step-notes.txt", "steps.json", "latest.jsonl", "lock",
                        "my-step-00000002.json", "x.tmp.1.2"})
    EXPECT_FALSE(is_checkpoint_directory_name(n)) << n;

  const fs::path root = scratch("owned_names");
  const fs::path ck = root / "ck";
  fs::create_directories(root / "sub");
  fs::create_directory_symlink("ck", root / "cklink");  // dangling until ck exists
  const auto refused = [&](const fs::path& path, const fs::path& dir, bool output) {
    return error_of([&] {
      refuse_checkpoint_directory_file(path.string(), output ? "--log" : "--data", dir.string(),
                                       "--checkpoint", output);
    });
  };
  for (const fs::path& p : {ck / "laga.lock", root / "sub" / ".." / "ck" / "." / "latest.json",
                            root / "cklink" / "step-00000002.json",
                            ck / "superseded-after-step-00000002" / "x.jsonl"}) {
    expect_has(refused(p, ck, true),
               {"--log '" + p.string() + "'", "--checkpoint directory '" + ck.string() + "' owns",
                "give --log a path outside those names"});
    expect_has(refused(p, root / "cklink", false), {"--data", "this run could replace"});
  }
  EXPECT_EQ(refused(ck / "train.jsonl", ck, true), "");
  EXPECT_EQ(refused(root / "latest.json", ck, true), "");  // another directory
  EXPECT_FALSE(fs::exists(ck));                            // nothing made
  // Existing files: a symlink and a hard link to an owned file.
  fs::create_directory(ck);
  std::ofstream(ck / "latest.json") << "{}";
  fs::create_symlink(ck / "latest.json", root / "link.json");
  fs::create_hard_link(ck / "latest.json", root / "hard.json");
  expect_has(refused(root / "link.json", ck, true), {"is '" + (ck / "latest.json").string()});
  expect_has(refused(root / "hard.json", ck, true),
             {"the same file (a hard link) as '" + (ck / "latest.json").string() + "'"});
  expect_has(refused(root / "hard.json", ck, false), {"--data", "hard link"});
}

}  // namespace
}  // namespace laga
