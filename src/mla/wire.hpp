// bf16 on the wire (issue 27; docs/accounting.md, "bf16 on the wire"): under
// --dtype bf16 (ops::in_bf16<T>()) every activation collective -- the
// forms' all-to-alls, all-gathers, reduce-scatters and ring passes, forward
// and backward, and the MoE's dispatch and combine -- moves its fp32
// tensors' values as bf16, 2 bytes an element, as a bf16 trainer's do. The
// gradient all-reduce and the scalar reductions (loss, votes, expert loads)
// stay fp32. A value the op layer has already rounded (every fresh product,
// so every forward activation) crosses unchanged; a sum (a gradient on its
// way home, a reduce-scatter's contribution) is rounded once when it leaves
// and, where the collective adds, the fp32 sum of the bf16 contributions
// once more where it lands (comm/communicator.hpp, DType).
//
// The tensors stay fp32 (the emulated storage of docs/performance.md,
// "bf16 mixed precision"), so a collective's bf16 blocks are converted on
// the way out and in. Where the fp32 destination is already there, its
// first half holds the arriving bf16 values, widened in place at the end
// (widen below): the wire costs no memory beyond fp32's there.
#pragma once

#include <cstdint>

#include <string>

#include "comm/communicator.hpp"
#include "core/bf16.hpp"

namespace laga::wire {

// to_bf16(x[i]) into the n bf16 values at dst, for i < n. dst may be x's own
// storage, at or below x's first byte (a block narrowed into the front of
// itself): the values go a chunk at a time through a local buffer, first to
// last, so no value is overwritten before it is read. Otherwise x and dst
// must not overlap. Counts its traffic (ops::count_elementwise); with either
// pointer null (count-only) converts nothing.
void narrow(const float* x, void* dst, std::int64_t n);
// The n bf16 values at src, widened (exactly) into y[0..n). y may be src's
// own storage, at or above src's first byte (the fp32 buffer whose front
// half received them): last chunk first, through a local buffer. Otherwise
// they must not overlap. Counts its traffic; null skips the work.
void widen(const void* src, float* y, std::int64_t n);

// Communicator::all_to_all_v of float blocks with bf16 on the wire: every
// block (the own one too, so a row is rounded alike wherever its owner is)
// narrowed into a dense bf16 staging, moved, and widened into recv's
// blocks. The stagings (sum of the counts, 2 bytes each) are comm_buffers
// while the call runs.
void all_to_all_v(Communicator& comm, const float* send, const std::int64_t* send_counts,
                  const std::int64_t* send_displs, float* recv, const std::int64_t* recv_counts,
                  const std::int64_t* recv_displs, const std::string& label);

// Communicator::all_gather_v of float blocks with bf16 on the wire, the
// blocks landing rank-major in recv (recv_displs dense: block j right after
// block j - 1): the own block narrowed into its place in recv's front half
// (send may be recv's own block), the bf16 blocks gathered there, and the
// whole widened in place (no memory beyond fp32's). gather_seq's route
// where its blocks land in place (mla/exchange.hpp) and the DSA forms'
// gathers (mla/dsa_rows.hpp).
void all_gather_v(Communicator& comm, const float* send, std::int64_t send_count, float* recv,
                  const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                  const std::string& label);

// Communicator::reduce_scatter_v of float blocks with bf16 on the wire:
// send's P blocks (counts, displs dense) narrowed into a bf16 staging
// (comm_buffers while the call runs), reduced in place into the own block
// there (the fp32 sum of the bf16 contributions, rounded once) and widened
// into recv. reduce_scatter_seq's route where its blocks are in place and
// the DSA forms' reduce-scatters.
void reduce_scatter_v(Communicator& comm, const float* send, const std::int64_t* counts,
                      const std::int64_t* displs, float* recv, const std::string& label);

// The gradient all-reduce ("grad_allreduce") of n flattened gradients, in
// place: in T, or under --grad-reduce bf16 (core/precision.hpp) as bf16,
// narrowed into the buffer's front half and widened back in place (no
// memory beyond fp32's).
template <class T>
void all_reduce_gradients(Communicator& comm, T* flat, std::int64_t n);

}  // namespace laga::wire
