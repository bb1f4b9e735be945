// Pieces the comm backends share: rank-ordered summation (the reason the
// in-process and MPI backends agree bit for bit), staging buffers that the
// memory pool sees, and the wording of errors.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/tensor.hpp"

namespace laga::comm_detail {

// dst[i] = ((srcs[0][i] + srcs[1][i]) + srcs[2][i]) + ... + srcs[P-1][i], in T.
// Every backend reduces through this one function, so the result depends only
// on the inputs and P, never on the backend or on message arrival order.
// dst may equal one of the sources (a reduce_scatter into the own block): each
// element is fully summed before it is written. Under set_reduction_order_seed
// each 1024-element block adds the sources in a seed-permuted order instead
// (communicator.hpp).
void sum_in_rank_order(void* dst, const void* const* srcs, int P, std::int64_t n, DType dtype);

// Scratch for one collective, registered under MemCategory::comm_buffers with
// the calling thread's pool; unbacked (data() == nullptr) when that pool is
// count-only.
class Staging {
 public:
  Staging(DType dtype, std::int64_t n);
  void* data();

 private:
  TensorF f32_;
  TensorD f64_;
  Tensor<bf16> bf16_;
};

// Count-only buffer: no storage behind a non-zero count.
inline bool unbacked(const void* p, std::int64_t count) {
  return p == nullptr && count > 0;
}

inline const std::byte* at(const void* base, std::int64_t elems, DType t) {
  return static_cast<const std::byte*>(base) + elems * dtype_bytes(t);
}
inline std::byte* at(void* base, std::int64_t elems, DType t) {
  return static_cast<std::byte*>(base) + elems * dtype_bytes(t);
}
// The bytes of every peer together: a call's derived or measured total.
WireBytes sum_of(const std::vector<WireBytes>& per_peer);

// memmove of n elements that skips null (count-only) ends and self-copies.
void copy_elems(void* dst, const void* src, std::int64_t n, DType t);

const char* to_string(DType t);
// "1, 3"
std::string rank_list(const std::vector<int>& ranks);
// "all_gather 'latent_ag'"
std::string call_name(CollectiveKind kind, const std::string& label);
// The timeout error every backend throws (wording in communicator.hpp's contract).
std::string timeout_message(CollectiveKind kind, const std::string& label, int rank, int P,
                            std::chrono::milliseconds timeout, const std::vector<int>& missing);

// The error for a peer whose count disagrees with this rank's (a check that
// needs the peers, so the transport's): "<collective> '<label>' on rank R of
// P: rank i expects E elements from rank j but rank j sends it <sent>; ...".
// Both backends word it so; `sent` is a number or "more than E".
std::string peer_count_message(CollectiveKind kind, const std::string& label, int rank, int P,
                               int receiver, int sender, std::int64_t expected,
                               const std::string& sent);

}  // namespace laga::comm_detail
