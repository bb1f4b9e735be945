// Training checkpoints: crash-safe, verified, and exact.
//
// A checkpoint of step N in DIR is two files plus a pointer:
//   DIR/step-0000N.safetensors  param.<name>, adam_m.<name>, adam_v.<name>
//                               (F32/F64 as trained) and metadata
//   DIR/step-0000N.json         manifest: step, data cursor, seed, model
//                               config, the safetensors file's size and
//                               FNV-1a 64 hash
//   DIR/latest.json             a copy of the newest manifest
// Each is written by write_file_atomic (temp file, fsync, rename, fsync dir)
// in that order, so a crash at any point leaves latest.json naming a complete
// checkpoint. The previous checkpoint is kept (older ones are removed only
// after the new one is complete), so when the newest is damaged the previous
// one still loads: --resume DIR/step-0000M.json.
//
// Loading checks the file's size and hash against the manifest before reading
// a byte of it, so a truncated or corrupted file is refused with an error
// naming it and the previous checkpoint to use instead.
#pragma once

#include <cstdint>
#include <string>

#include "model/model.hpp"

namespace laga {

template <class T>
struct TrainState {
  LmParams<T> params, m, v;  // m, v: AdamW moments
  std::int64_t step = 0;     // steps completed
  std::int64_t data_cursor = 0;
  std::uint64_t seed = 0;
};

// Writes the checkpoint of st.step into dir (created if missing) and prunes
// all but the newest `keep` (>= 2) checkpoints. Returns the manifest's path.
template <class T>
std::string save_checkpoint(const std::string& dir, const LmConfig& cfg, const TrainState<T>& st,
                            int keep = 2);

// `where` is a checkpoint directory (its latest.json) or a manifest
// step-*.json. st's tensors must already have cfg's shapes; they are
// overwritten, as are step, data_cursor and seed.
template <class T>
void load_checkpoint(const std::string& where, const LmConfig& cfg, TrainState<T>& st);

// FNV-1a 64 of a file's bytes (the manifest's integrity hash).
std::uint64_t file_fnv1a64(const std::string& path);

}  // namespace laga
