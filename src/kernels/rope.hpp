// Rotary position embedding, interleaved pairs, with YaRN — exactly the math
// of DeepSeek-V3 `inference/model.py` (`precompute_freqs_cis`,
// `apply_rotary_emb`): the pair (x[2i], x[2i+1]) of a head's rope part is the
// complex number x[2i] + i x[2i+1], multiplied by exp(i * pos * freq_i).
//
//   freq_i = base^(-2i/d), i < d/2
//   YaRN (when max_seq_len > original_seq_len):
//     low, high = correction range of (beta_fast, beta_slow) over
//                 original_seq_len, clamped to [0, d-1]
//     smooth_i  = 1 - clamp((i - low) / (high - low), 0, 1)
//     freq_i    = freq_i / factor * (1 - smooth_i) + freq_i * smooth_i
//
// Angles are computed in double (DeepSeek's reference uses fp32 there; the
// difference is below fp32 rounding of the rotated values for positions
// < 2^20). Positions are GLOBAL token indices: a rank holding tokens
// [s0, s0 + L) rotates them at s0..s0+L-1, so every SP layout rotates the same.
// With packed documents a token's position is its index within its document
// (rope_apply_at takes one per token).
#pragma once

#include <cstdint>
#include <vector>

namespace laga {

struct RopeParams {
  std::int64_t dim = 64;  // qk_rope_head_dim, even; 0: no rotation (NoPE)
  double theta = 10000.0;
  bool yarn = false;
  double factor = 40.0;
  std::int64_t original_seq_len = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// The dim/2 frequencies of precompute_freqs_cis.
std::vector<double> rope_frequencies(const RopeParams& p);

// cos/sin of pos * freq_i for pos in [0, positions), i in [0, dim/2).
class RopeTable {
 public:
  RopeTable(const RopeParams& p, std::int64_t positions);
  // Its extents without the cos/sin tables: for count-only runs, where no
  // kernel reads it and a table of every position would cost memory in
  // proportion to the sequence (rope_apply must not be given one).
  static RopeTable unbacked(const RopeParams& p, std::int64_t positions);
  bool backed() const { return !cos_.empty() || positions_ == 0 || dim_ == 0; }
  std::int64_t dim() const { return dim_; }
  std::int64_t positions() const { return positions_; }
  double cos(std::int64_t pos, std::int64_t i) const { return cos_[idx(pos, i)]; }
  double sin(std::int64_t pos, std::int64_t i) const { return sin_[idx(pos, i)]; }

 private:
  RopeTable(std::int64_t dim, std::int64_t positions) : dim_(dim), positions_(positions) {}
  std::size_t idx(std::int64_t pos, std::int64_t i) const {
    return static_cast<std::size_t>(pos * (dim_ / 2) + i);
  }
  std::int64_t dim_, positions_;
  std::vector<double> cos_, sin_;
};

// Rotates, in place, the rope part of x for B batches of L tokens at global
// positions pos0 .. pos0+L-1 and H heads. Element i of (b, l, h) is at
//   x + (b * L + l) * ld_token + h * ld_head + i.
// inverse = true rotates by -angle: the backward of the forward rotation
// (a rotation's Jacobian is its transpose), applied to the gradient.
template <class T>
void rope_apply(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                std::int64_t ld_head, std::int64_t pos0, const RopeTable& table, bool inverse);

// The same rotation with a position per token: token (b, l) is rotated at
// positions[b * L + l], positions (B, L). For packed documents, where
// positions restart at 0 at every document's start (position = token index -
// its document's first token, AttnShape::doc_start). Every position must lie in
// [0, table.positions()); laga::Error names the first that does not, before
// anything is rotated.
template <class T>
void rope_apply_at(T* x, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t ld_token,
                   std::int64_t ld_head, const std::int64_t* positions, const RopeTable& table,
                   bool inverse);

}  // namespace laga
