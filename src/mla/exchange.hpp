// The four data movements of sequence-parallel MLA, on (B, S, H, d) tensors,
// built on Communicator and recorded under the given label.
//
//   seq_to_head   (B, L_r, H, d)  -> (B, S, H_r, d)   all-to-all
//   head_to_seq   (B, S, H_r, d)  -> (B, L_r, H, d)   all-to-all (inverse)
//   gather_seq    (B, L_r, W)     -> (B, S, W)        all-gather
//   reduce_scatter_seq (B, S, W)  -> (B, L_r, W)      reduce-scatter (sum)
//
// Each is the backward of its partner: seq_to_head <-> head_to_seq, and
// gather_seq <-> reduce_scatter_seq. Staging buffers are counted as
// comm_buffers; at P 1 the all-to-alls have none (src is already in dst's
// layout: the collective copies it over once). Under a count-only pool (no storage) nothing is
// packed or copied, but the collective is still issued so the ledger is exact.
#pragma once

#include <string>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"
#include "mla/layout.hpp"

namespace laga {

template <class T>
void seq_to_head(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label);
template <class T>
void head_to_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t d,
                 const std::string& label);
template <class T>
void gather_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst, std::int64_t W,
                const std::string& label);
template <class T>
void reduce_scatter_seq(Communicator& comm, const SpLayout& lay, const T* src, T* dst,
                        std::int64_t W, const std::string& label);

}  // namespace laga
