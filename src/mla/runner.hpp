// Running one MLA block over an SP group and collecting what each rank saw.
//
// run_rank is the per-rank body every backend shares: it slices the rank's
// shard out of the global input, runs forward (+ backward + gradient
// all-reduce), and reports the ledger and the pool's peaks. run_local drives
// P in-process ranks and assembles the global output, dx and (rank 0's,
// synced) gradients, so any form at any P can be compared with single-rank
// explicit element by element.
#pragma once

#include <chrono>
#include <vector>

#include "comm/communicator.hpp"
#include "mla/block.hpp"

namespace laga {

struct RunSpec {
  FormVariant variant = Form::laga;
  AttentionKind attention = AttentionKind::eager;
  bool backward = true;
  bool grad_sync = true;                 // with backward: the gradient all-reduce
  const Documents* documents = nullptr;  // packed sequences; null: one document per row
  std::chrono::milliseconds timeout{0};  // 0: the communicator's default
  // The invariant mode (docs/invariance.md): the same bits at every P, for a
  // form whose row offers it (FormTraits::invariant); refused otherwise.
  bool invariant = false;
  // Tests only, run_local: the ranks' started collectives deliver at their
  // wait and check their buffers there (LocalRunOptions, comm/communicator.hpp
  // "Overlap"), so an overlapped path that reads a result early or frees a
  // buffer early fails.
  bool deferred_delivery_for_testing = false;
  // Where the block runs (core/device.hpp; docs/architecture.md, "Device
  // storage and the emulated device"). Not cpu: each rank's shard,
  // parameters and gradient accumulators are uploaded into a pool of that
  // device (its accounting the host pool's), the form runs there on the
  // device's kernel rows, ranks in one process exchange device buffers
  // (the device-local transport), and out, dx and the gradients are
  // downloaded; RankMemory is the device pool's.
  Device device = Device::cpu;
};

// Memory of one rank during one forward(+backward), in bytes above what was
// live when forward started (the input shard, parameters). Peaks are over the
// whole run; forward+backward and the gradient all-reduce are also reported
// apart (the all-reduce's flat buffer is gradient traffic, not activations).
struct RankMemory {
  std::int64_t peak_activations = 0;  // MemCategory::activations
  std::int64_t peak_comm_buffers = 0;
  std::int64_t peak_working = 0;           // activations + comm buffers together
  std::int64_t peak_forward_backward = 0;  // working, forward + backward only
  std::int64_t peak_grad_sync = 0;         // working, during the gradient all-reduce
  std::int64_t after_forward = 0;          // activations live when forward returns: saved + out
  std::int64_t gradients = 0;              // parameter gradients held by the rank
  std::int64_t parameters = 0;
  // What is live at those two peaks, by name: filled when the rank's pool
  // tracks live tensors (MemoryPool::set_live_tracking), as the memory
  // prediction's does.
  MemoryPool::PeakSnapshot forward_backward_live, grad_sync_live;
};

struct RankReport {
  int rank = 0;
  Ledger ledger;
  RankMemory memory;
  double forward_ms = 0, backward_ms = 0, sync_ms = 0;
  // Of forward + backward + sync: wall ms inside collectives and their waits
  // (Communicator::seconds_in_collectives), the transfers and the waiting for
  // peers; what a started collective hides under compute is not in it.
  double comm_ms = 0;
};

// A rank's report as doubles, so the reporting rank can receive every rank's
// over any backend (one all-gather or all-reduce of slots). Every field of
// RankReport travels, the ledger entries in the order of `keys` (each rank's
// ledger has the same keys: collectives are collective); the live lists of
// RankMemory do not. Byte counts travel split into two exact doubles, so they
// stay exact at any size.
using LedgerKey = std::pair<Phase, std::string>;
std::size_t packed_report_size(std::size_t keys);
void pack_report(const RankReport& report, const std::vector<LedgerKey>& keys, double* out);
RankReport unpack_report(const double* in, const std::vector<LedgerKey>& keys);

template <class T>
struct RankResult {
  Tensor<T> out, dx;  // (B, L_r, D)
  MlaParams<T> grads;
  RankReport report;
};

// x and dout are GLOBAL (B, S, D); dout is ignored when !spec.backward.
template <class T>
RankResult<T> run_rank(Communicator& comm, const MlaConfig& cfg, const SpLayout& layout,
                       const RopeTable& rope, const MlaParams<T>& w, const Tensor<T>& x,
                       const Tensor<T>& dout, const RunSpec& spec);

template <class T>
struct BlockRun {
  Tensor<T> out, dx;  // global (B, S, D)
  MlaParams<T> grads;
  std::vector<RankReport> ranks;
};

template <class T>
BlockRun<T> run_local(const MlaConfig& cfg, const SpLayout& layout, const MlaParams<T>& w,
                      const Tensor<T>& x, const Tensor<T>& dout, const RunSpec& spec);

// The reference of a packed run: each document of each row run alone
// (B = 1, S = its length, no documents) through run_local on one rank with
// `spec`'s form and attention; out and dx land at the document's tokens, and
// the gradients are summed over documents (the packed loss is the sum of the
// documents' losses). spec.documents is ignored; `docs` gives them.
template <class T>
BlockRun<T> run_documents_alone(const MlaConfig& cfg, const MlaParams<T>& w, const Tensor<T>& x,
                                const Tensor<T>& dout, const Documents& docs, RunSpec spec);

// How far a result is from its reference: max |a - b| and max |b| (the
// reference's scale). The one agreement measure of every tool: a NaN or Inf
// anywhere in either tensor is disagreement (max_abs = +inf), never dropped
// by a max that ignores NaN.
struct Deviation {
  double max_abs = 0, ref_max = 0;
  double relative() const { return ref_max > 0 ? max_abs / ref_max : max_abs; }
};
template <class T>
Deviation deviation(const Tensor<T>& a, const Tensor<T>& ref);

// Rank r's seq shard of every batch row of a (B, S, W) tensor, (B, L_r, W),
// its ranges' rows one after the other (SpLayout::seq_ranges); and the
// inverse (writes the shard into the global tensor).
template <class T>
Tensor<T> shard_of(const Tensor<T>& global, const SpLayout& layout, int r);
template <class T>
void place_shard(Tensor<T>& global, const Tensor<T>& shard, const SpLayout& layout, int r);

}  // namespace laga
