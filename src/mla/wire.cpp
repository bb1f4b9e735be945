#include "mla/wire.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/bf16_convert.hpp"
#include "mla/ops.hpp"

namespace laga::wire {

namespace {
// Values per chunk: both local buffers stay in L1.
constexpr std::int64_t kChunk = 1024;
// Every bf16 value the wire holds inside fp32 storage is read and written
// through memcpy and the local buffers, never through a bf16* into that
// storage, so the two views of one buffer never meet as typed accesses.
}  // namespace

void narrow(const float* x, void* dst, std::int64_t n) {
  ops::count_elementwise<float>(n, 1);  // read
  ops::count_elementwise<bf16>(n, 1);   // written
  if (n == 0 || x == nullptr || dst == nullptr) return;
  auto* out = static_cast<unsigned char*>(dst);
  float in[kChunk];
  bf16 b[kChunk];
  for (std::int64_t i = 0; i < n; i += kChunk) {
    const std::int64_t m = std::min(kChunk, n - i);
    std::memcpy(in, x + i, sizeof(float) * size_t(m));
    convert_to_bf16(in, b, m);
    std::memcpy(out + i * std::int64_t(sizeof(bf16)), b, sizeof(bf16) * size_t(m));
  }
}

void widen(const void* src, float* y, std::int64_t n) {
  ops::count_elementwise<bf16>(n, 1);
  ops::count_elementwise<float>(n, 1);
  if (n == 0 || src == nullptr || y == nullptr) return;
  const auto* in = static_cast<const unsigned char*>(src);
  bf16 b[kChunk];
  float out[kChunk];
  for (std::int64_t end = n; end > 0; end -= kChunk) {
    const std::int64_t i = std::max<std::int64_t>(0, end - kChunk), m = end - i;
    std::memcpy(b, in + i * std::int64_t(sizeof(bf16)), sizeof(bf16) * size_t(m));
    convert_to_float(b, out, m);
    std::memcpy(y + i, out, sizeof(float) * size_t(m));
  }
}

void all_to_all_v(Communicator& comm, const float* send, const std::int64_t* send_counts,
                  const std::int64_t* send_displs, float* recv, const std::int64_t* recv_counts,
                  const std::int64_t* recv_displs, const std::string& label) {
  const size_t P = static_cast<size_t>(comm.size());
  std::vector<std::int64_t> sd(P, 0), rd(P, 0);  // the dense stagings' displacements
  for (size_t j = 1; j < P; ++j) {
    sd[j] = sd[j - 1] + send_counts[j - 1];
    rd[j] = rd[j - 1] + recv_counts[j - 1];
  }
  Tensor<bf16> out({sd[P - 1] + send_counts[P - 1]}, MemCategory::comm_buffers),
      in({rd[P - 1] + recv_counts[P - 1]}, MemCategory::comm_buffers);
  const auto at = [](auto* p, std::int64_t i) { return p ? p + i : nullptr; };
  for (size_t j = 0; j < P; ++j)
    narrow(at(send, send_displs[j]), at(out.data(), sd[j]), send_counts[j]);
  comm.all_to_all_v(out.data(), send_counts, sd.data(), in.data(), recv_counts, rd.data(), label);
  out.reset();
  for (size_t j = 0; j < P; ++j)
    widen(at(in.data(), rd[j]), at(recv, recv_displs[j]), recv_counts[j]);
}

namespace {
// The number of elements of P rank-major blocks, checked dense.
std::int64_t dense_total(const Communicator& comm, const std::int64_t* counts,
                         const std::int64_t* displs, const std::string& label) {
  std::int64_t n = 0;
  for (int j = 0; j < comm.size(); ++j) {
    LAGA_CHECK(displs[j] == n, "internal: '", label, "' with bf16 on the wire: block ", j, " at ",
               displs[j], ", not right after the blocks before it (", n, ")");
    n += counts[j];
  }
  return n;
}
// bf16 value i inside the fp32 storage at base (null stays null: count-only).
void* bf16_at(float* base, std::int64_t i) {
  return base ? reinterpret_cast<unsigned char*>(base) + i * std::int64_t(sizeof(bf16)) : nullptr;
}
}  // namespace

void all_gather_v(Communicator& comm, const float* send, std::int64_t send_count, float* recv,
                  const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                  const std::string& label) {
  const std::int64_t n = dense_total(comm, recv_counts, recv_displs, label);
  void* mine = bf16_at(recv, recv_displs[comm.rank()]);
  narrow(send, mine, send_count);
  comm.all_gather_v(mine, send_count, recv, recv_counts, recv_displs, DType::bf16, label);
  widen(recv, recv, n);
}

void reduce_scatter_v(Communicator& comm, const float* send, const std::int64_t* counts,
                      const std::int64_t* displs, float* recv, const std::string& label) {
  const std::int64_t n = dense_total(comm, counts, displs, label), r = comm.rank();
  Tensor<bf16> staging({n}, MemCategory::comm_buffers);
  bf16* mine = staging.data() ? staging.data() + displs[r] : nullptr;
  narrow(send, staging.data(), n);
  comm.reduce_scatter_v(staging.data(), counts, displs, mine, label);
  widen(mine, recv, counts[r]);
}

template <class T>
void all_reduce_gradients(Communicator& comm, T* flat, std::int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (op_grad_reduce == GradReduce::bf16 && ops::in_bf16<T>()) {
      narrow(flat, flat, n);
      comm.all_reduce(flat, n, DType::bf16, "grad_allreduce");
      widen(flat, flat, n);
      return;
    }
  }
  comm.all_reduce(flat, n, "grad_allreduce");
}
template void all_reduce_gradients<float>(Communicator&, float*, std::int64_t);
template void all_reduce_gradients<double>(Communicator&, double*, std::int64_t);

}  // namespace laga::wire
