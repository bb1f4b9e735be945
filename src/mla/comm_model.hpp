// Closed-form communication of one MLA block: the bytes rank r sends and
// receives, per (phase, label), computed from the config and the layout
// alone. Written apart from the ledger code on purpose: tests require the two
// to agree byte for byte (docs/accounting.md derives every term).
//
// With e the element size, L_j / H_j rank j's tokens / heads, W = C + dr:
//   forward   q_a2a      sum_{j!=r} B L_r H_j dqk e       (seq -> head)
//             k_a2a      sum_{j!=r} B L_r H_j dqk e       explicit
//             v_a2a      sum_{j!=r} B L_r H_j dv e        explicit
//             latent_ag  (P-1) B L_r W e                  laga, absorbed
//             out_a2a    sum_{j!=r} B L_j H_r dv e        (head -> seq)
//   backward  the same labels, each collective's adjoint: an all-to-all's is
//             the inverse all-to-all (send and receive swap), the
//             all-gather's a reduce-scatter, sum_{j!=r} B L_j W e
//   grad_sync grad_allreduce ((n - c_r) + (P-1) c_r) e, n = parameter count
//             (from DeepSeek's shapes, written out in comm_model.cpp),
//             c_r = all_reduce_chunk(n, P, r) (reduce-scatter + all-gather)
// Each (phase, label) is one collective call per block step (calls = 1).
#pragma once

#include <map>
#include <string>

#include "comm/communicator.hpp"
#include "mla/block.hpp"

namespace laga {

struct PredictedBytes {
  std::int64_t sent = 0, received = 0;
  std::int64_t calls = 0;  // collective calls under the label, one per add() below
};
using CommPrediction = std::map<std::pair<Phase, std::string>, PredictedBytes>;

CommPrediction predict_comm(const MlaConfig& cfg, const SpLayout& layout, Form form, int rank,
                            std::int64_t elem_bytes, bool backward, bool grad_sync);

// Sum over labels of one phase (Phase::count: all phases).
std::int64_t predicted_sent(const CommPrediction& p, Phase phase = Phase::count);

}  // namespace laga
