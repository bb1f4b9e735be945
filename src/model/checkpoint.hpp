// Training checkpoints: crash-safe, verified, and exact.
//
// A checkpoint of step N in DIR is two files plus a pointer:
//   DIR/step-0000N.safetensors  param.<name>, adam_m.<name>, adam_v.<name>
//                               (F32/F64 as trained) and metadata
//   DIR/step-0000N.json         manifest: step, data cursor, seed, model
//                               config, the run's options, the safetensors
//                               file's size and FNV-1a 64 hash, and an FNV-1a
//                               64 of the manifest itself (so a hand edit of
//                               step, cursor or options is refused)
//   DIR/latest.json             a copy of the newest manifest
// Each is written by write_file_atomic (temp file, fsync, rename, fsync dir)
// in that order, so a crash at any point leaves latest.json naming a complete
// checkpoint. The previous checkpoint is kept (older ones are removed only
// after the new one is complete), so when the newest is damaged the previous
// one still loads: --resume DIR/step-0000M.json.
//
// Pruning only ever removes checkpoints of steps below the one just written
// (never the one latest.json names, never a later one), and a save first
// removes stale temporaries of laga's own naming left by a killed save.
// docs/reliability.md ("Checkpoints") has the whole policy.
//
// Loading checks the manifest's own hash, then the file's size and hash
// against the manifest before reading a byte of it, so a truncated, corrupted
// or edited checkpoint is refused with an error naming it and the previous
// checkpoint to use instead.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "model/checkpoint_manifest.hpp"
#include "model/model.hpp"

namespace laga {

template <class T>
struct TrainState {
  LmParams<T> params, m, v;  // m, v: AdamW moments
  std::int64_t step = 0;     // steps completed
  std::int64_t data_cursor = 0;
  std::uint64_t seed = 0;
};

// `where` is a checkpoint directory (its latest.json) or a manifest
// step-*.json. Refuses a missing, unparsable, foreign or edited manifest
// (parse_checkpoint_manifest), naming the previous checkpoint to resume.
CheckpointManifest read_checkpoint_manifest(const std::string& where);

// The model settings that differ between the checkpoint and cfg, one
// "name: old -> new" each (empty: the same model).
std::vector<std::string> model_changes(const CheckpointManifest& m, const LmConfig& cfg);

// Writes the checkpoint of st.step into dir (created if missing), recording
// `options`, then prunes checkpoints of lower steps down to the newest
// `keep` - 1 of them (keep >= 2 counts the new one). Returns the manifest's
// path.
template <class T>
std::string save_checkpoint(const std::string& dir, const LmConfig& cfg, const TrainState<T>& st,
                            const CheckpointOptions& options, int keep = 2);

// Reads the checkpoint read_checkpoint_manifest(where) names into st. st's
// tensors must already have cfg's shapes; they are overwritten, as are step,
// data_cursor and seed. Returns the manifest. Every tensor read (parameters
// and AdamW moments) is checked for non-finite values: one holding NaN or inf
// is refused, naming the file, the tensor, the count and the previous
// checkpoint to resume instead, unless allow_nonfinite; then each such
// tensor's description is appended to *nonfinite (when given) and loading
// goes on.
template <class T>
CheckpointManifest load_checkpoint(const std::string& where, const LmConfig& cfg, TrainState<T>& st,
                                   bool allow_nonfinite = false,
                                   std::vector<std::string>* nonfinite = nullptr);

// The checkpoints in dir (their step-*.json names), by step.
std::vector<std::string> checkpoint_manifests(const std::string& dir);

// Moves the checkpoints of steps above `step` (manifest and tensors, a tensors
// file without its manifest too, and latest.json when it names one of them)
// into a new folder DIR/superseded-after-step-<step>[-k] and
// points latest.json at step's manifest. Used when a run resumes from an
// earlier step into the directory: those checkpoints belong to a history this
// run replaces, and are kept, never deleted. Returns the names moved and the
// folder (empty when there was nothing to move).
std::vector<std::string> set_aside_checkpoints_after(const std::string& dir, std::int64_t step,
                                                     std::string* folder);

// The files of laga's checkpoint naming in dir (latest.json, step-<N>.json,
// step-<N>.safetensors, N of at least 8 digits), sorted by name. A fresh run
// refuses a directory holding any of them: a tensors file without its
// manifest (a save killed between the two) is a checkpoint's too.
std::vector<std::string> checkpoint_files(const std::string& dir);

// One writer per checkpoint directory. While alive, holds DIR/laga.lock (made
// with O_EXCL; it holds "pid <pid> host <host>"), creating DIR if needed, so
// the directory's writability is checked before the first step rather than
// at the first save. A lock whose pid no longer runs on this host is stale
// (a run killed by SIGKILL leaves one) and is taken over, the rule the
// checkpoint temporaries follow; a live one, or one from another host, is
// refused naming its holder. Two runs in one directory would prune each
// other's checkpoints (docs/reliability.md, "Checkpoints").
class CheckpointDirectoryLock {
 public:
  explicit CheckpointDirectoryLock(const std::string& dir);
  ~CheckpointDirectoryLock();
  CheckpointDirectoryLock(const CheckpointDirectoryLock&) = delete;
  CheckpointDirectoryLock& operator=(const CheckpointDirectoryLock&) = delete;

 private:
  std::string path_, holder_;  // the lock file and what this process wrote in it
};

// Refuses, as CheckpointDirectoryLock would, a directory whose lock names a
// live holder; validation calls it first, so a second run into a directory
// in use is told that rather than that the directory holds checkpoints.
void refuse_checkpoint_directory_in_use(const std::string& dir);

// The names a checkpoint directory owns, which no other file of a run may take
// (issue 54 G): its lock laga.lock, latest.json, every step-<N>.<anything>
// (manifests, tensors, whatever the digits), a temporary of any of them
// (`<name>.tmp.<...>`), the folders superseded-after-* (and what they hold)
// and the writability probe `.laga-probe.*`.
bool is_checkpoint_directory_name(std::string_view name);

// Refuses `path`, a file of this run named by `option` ("--log", "--data",
// ...), when it is, under any spelling (relative, `..`, symlinks; an existing
// file also by device and inode, so a hard link), a file of a name the
// directory `dir` (named by `dir_option`: "--checkpoint", "--resume") owns
// (is_checkpoint_directory_name). `output`: the run writes `path` (the message
// says what it would destroy); otherwise it reads it (the run writes, moves
// and prunes such files). Checked before anything is written.
void refuse_checkpoint_directory_file(const std::string& path, const std::string& option,
                                      const std::string& dir, const std::string& dir_option,
                                      bool output);

// Removes temporaries of laga's own naming (`latest.json.tmp.<pid>.<n>`,
// `step-<N>.json|safetensors.tmp.<pid>.<n>`) left in dir by a process that no
// longer runs (or by this one); any other file is left alone. Returns the
// number removed. save_checkpoint calls it.
int remove_stale_checkpoint_temporaries(const std::string& dir);

}  // namespace laga
