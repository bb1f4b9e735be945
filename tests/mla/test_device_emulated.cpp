// The forms on a device, in CI: the emulated device (core/device.hpp;
// docs/architecture.md, "Device storage and the emulated device") runs the
// device code path -- a pool per device with the host's accounting, the
// kernel table's rows of a non-CPU device, uploads and downloads at the
// block's boundary, the device-local transport between ranks -- on the CPU,
// with the CPU's kernels behind a check that every operand is device memory.
//  - every form variant (overlapped too, query-latent exchange too) at P 1-4,
//    uneven shards, unpacked and packed, eager and flash, fp32 and bf16 mixed
//    precision: out, dx and every gradient bit for bit the CPU's (the same
//    kernels), every rank's ledger and RankMemory the CPU's;
//  - the device pool's peaks are the memory model's prediction (its
//    count-only run), byte for byte;
//  - the checks can fail: a host buffer handed to a device kernel, a host
//    pointer in a device copy or a device-local collective is refused.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <optional>

#include "comm/collective_util.hpp"
#include "comm/local_comm.hpp"
#include "common/block_inputs.hpp"
#include "common/error_of.hpp"
#include "common/variants.hpp"
#include "core/device.hpp"
#include "mla/device_peak_prediction.hpp"
#include "mla/memory_model.hpp"
#include "mla/op_table.hpp"
#include "mla/ops.hpp"
#include "mla/runner.hpp"

namespace laga {
namespace {

bool same_bits(const TensorF& a, const TensorF& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.bytes())) == 0;
}

void expect_same_run(const BlockRun<float>& dev, const BlockRun<float>& cpu,
                     const std::string& tag) {
  EXPECT_TRUE(same_bits(dev.out, cpu.out)) << tag << " out";
  EXPECT_TRUE(same_bits(dev.dx, cpu.dx)) << tag << " dx";
  std::vector<const TensorF*> a, b;
  std::vector<std::string> names;
  dev.grads.for_each([&](const std::string& n, const TensorF& t) {
    a.push_back(&t);
    names.push_back(n);
  });
  cpu.grads.for_each([&](const std::string&, const TensorF& t) { b.push_back(&t); });
  ASSERT_EQ(a.size(), b.size()) << tag;
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(same_bits(*a[i], *b[i])) << tag << " grad." << names[i];
  ASSERT_EQ(dev.ranks.size(), cpu.ranks.size()) << tag;
  for (std::size_t r = 0; r < dev.ranks.size(); ++r) {
    const std::string rt = tag + " rank " + std::to_string(r);
    const auto& le = dev.ranks[r].ledger.entries();
    const auto& lc = cpu.ranks[r].ledger.entries();
    ASSERT_EQ(le.size(), lc.size()) << rt << " ledger keys";
    for (auto it = le.begin(), jt = lc.begin(); it != le.end(); ++it, ++jt) {
      EXPECT_EQ(it->first, jt->first) << rt;
      EXPECT_EQ(it->second.calls, jt->second.calls) << rt << " " << it->first.second;
      EXPECT_EQ(it->second.bytes_sent, jt->second.bytes_sent) << rt << " " << it->first.second;
      EXPECT_EQ(it->second.measured_received, jt->second.measured_received)
          << rt << " " << it->first.second;
    }
    const RankMemory &md = dev.ranks[r].memory, &mc = cpu.ranks[r].memory;
    EXPECT_EQ(md.peak_activations, mc.peak_activations) << rt;
    EXPECT_EQ(md.peak_comm_buffers, mc.peak_comm_buffers) << rt;
    EXPECT_EQ(md.peak_working, mc.peak_working) << rt;
    EXPECT_EQ(md.after_forward, mc.after_forward) << rt;
    EXPECT_EQ(md.gradients, mc.gradients) << rt;
  }
}

// Every variant at P 1-4 on (B 2, S 13, H 5): uneven shards, P 4 with a
// rank of one head; packed documents at P 2 and 3.
TEST(EmulatedDevice, EveryFormAtP1To4IsTheCpuBitForBit) {
  const MlaConfig cfg = test::block_config(7);
  const test::BlockInputs<float> in = test::make_inputs(cfg, 2, 13);
  const Documents docs = Documents::parse_lengths("3,1,6,3", 2, 13);
  int runs = 0;
  for (int P : {1, 2, 3, 4})
    for (AttentionKind a : {AttentionKind::eager, AttentionKind::flash})
      for (const Documents* d : {static_cast<const Documents*>(nullptr), &docs}) {
        if (d && (P == 1 || P == 4 || a == AttentionKind::eager)) continue;
        for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
          const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, P);
          RunSpec spec;
          spec.variant = v, spec.attention = a, spec.documents = d;
          const BlockRun<float> cpu = run_local(cfg, lay, in.w, in.x, in.dout, spec);
          spec.device = Device::emulated;
          const std::int64_t on_cpu = ops::kernel_calls(Device::cpu),
                             on_dev = ops::kernel_calls(Device::emulated);
          const DeviceMemory::Copied before = emulated_memory().copied();
          const BlockRun<float> dev = run_local(cfg, lay, in.w, in.x, in.dout, spec);
          const DeviceMemory::Copied after = emulated_memory().copied();
          // Every kernel of the device run ran on the device's rows.
          EXPECT_EQ(ops::kernel_calls(Device::cpu), on_cpu);
          EXPECT_GT(ops::kernel_calls(Device::emulated), on_dev);
          // The boundary moved each rank's parameters and its x and dout
          // shards up, its out and dx shards and gradients down; ranks
          // exchanged device buffers (the device-local transport).
          const std::int64_t params = in.w.numel() * 4, act = in.x.bytes();
          EXPECT_EQ(after.to_device - before.to_device, P * params + 2 * act);
          EXPECT_EQ(after.to_host - before.to_host, P * params + 2 * act);
          if (P > 1) {
            EXPECT_GT(after.on_device, before.on_device);
          }
          expect_same_run(dev, cpu,
                          cat(to_string(v), " ", to_string(a), " P ", P, d ? " packed" : ""));
          ++runs;
        }
      }
  EXPECT_GT(runs, 100);
}

TEST(EmulatedDevice, Bf16MixedPrecisionIsTheCpuBitForBit) {
  const MlaConfig cfg = test::block_config(7);
  const test::BlockInputs<float> in = test::make_inputs(cfg, 2, 13);
  const UsePrecision bf16(Precision::bf16);
  for (int P : {1, 3})
    for (FormVariant v : test::form_variants(cfg, test::WithOverlap::no)) {
      const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, P);
      RunSpec spec;
      spec.variant = v, spec.attention = AttentionKind::flash;
      const BlockRun<float> cpu = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      spec.device = Device::emulated;
      const BlockRun<float> dev = run_local(cfg, lay, in.w, in.x, in.dout, spec);
      expect_same_run(dev, cpu, cat(to_string(v), " bf16 P ", P));
    }
}

// The device pool's peaks are the memory model's (the count-only run, on
// the host pool): one allocation path, so count-only predicts the device
// peak as it does the host's. fp32 and bf16 (held narrowed) both.
TEST(EmulatedDevice, DevicePoolPeakIsTheMemoryModel) {
  const MlaConfig cfg = test::block_config(7);
  const test::BlockInputs<float> in = test::make_inputs(cfg, 2, 13);
  for (Precision prec : {Precision::fp32, Precision::bf16}) {
    const UsePrecision at(prec);
    for (int P : {2, 4})
      for (FormVariant v : test::form_variants(cfg, test::WithOverlap::yes)) {
        const SpLayout lay = SpLayout::even(2, 13, cfg.n_heads, P);
        RunSpec spec;
        spec.variant = v, spec.attention = AttentionKind::flash, spec.device = Device::emulated;
        const BlockRun<float> dev = run_local(cfg, lay, in.w, in.x, in.dout, spec);
        for (const RankReport& rep : dev.ranks) {
          const MemoryPrediction p =
              predict_memory(cfg, lay, v, AttentionKind::flash, rep.rank, sizeof(float));
          const std::string tag =
              cat(to_string(v), " ", to_string(prec), " P ", P, " rank ", rep.rank);
          EXPECT_GT(rep.memory.peak_working, 0) << tag;
          EXPECT_EQ(rep.memory.peak_working, p.peak_working) << tag;
          EXPECT_EQ(rep.memory.peak_activations, p.peak_activations) << tag;
          EXPECT_EQ(rep.memory.peak_comm_buffers, p.peak_comm_buffers) << tag;
          EXPECT_EQ(rep.memory.gradients, p.gradients) << tag;
        }
      }
  }
}

// The device peak a count-only run predicts (mla/device_peak_prediction.hpp,
// which laga compare and laga_cuda_forms read): on cuda the pool's working
// peak plus one cuBLASLt workspace, 32 MiB, per rank thread (the size
// cuda::GemmContext allocates: cuda_test_gemm_lt); elsewhere the pool's.
TEST(DevicePeak, CudaAddsOneCublasLtWorkspaceToThePool) {
  EXPECT_EQ(device_peak_prediction(Device::cuda, 1000).predicted(), 1000 + 33554432);
  EXPECT_EQ(device_peak_prediction(Device::cuda, 1000).cublaslt_workspace, 33554432);
  for (Device d : {Device::cpu, Device::emulated}) {
    EXPECT_EQ(device_peak_prediction(d, 1000).predicted(), 1000) << to_string(d);
    EXPECT_EQ(device_peak_prediction(d, 1000).cublaslt_workspace, 0) << to_string(d);
  }
}

TEST(EmulatedDevice, PoolTagsItsTensorsAndCountOnlyAllocatesNothing) {
  MemoryPool dev;
  dev.set_device_memory(&emulated_memory());
  EXPECT_EQ(dev.device(), Device::emulated);
  TensorF host({4, 4});
  EXPECT_EQ(host.device(), Device::cpu);
  EXPECT_FALSE(emulated_memory().holds(host.data(), 4));
  {
    const PoolScope on(dev);
    TensorF t({8, 16}, "t");
    EXPECT_EQ(t.device(), Device::emulated);
    EXPECT_TRUE(emulated_memory().holds(t.data(), t.bytes()));
    EXPECT_EQ(dev.current(MemCategory::activations), 8 * 16 * 4);
  }
  EXPECT_EQ(dev.current_total(), 0);
  EXPECT_EQ(dev.peak_total(), 8 * 16 * 4);
  MemoryPool counted;
  counted.set_device_memory(&emulated_memory());
  counted.set_count_only(true);
  const PoolScope on(counted);
  TensorF t({1000, 1000}, "counted");
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_EQ(counted.current(MemCategory::activations), 4'000'000);
}

// The checks fail where they must: a host buffer as a device kernel's
// operand, copies with a pointer on the wrong side, and a device-local
// collective over host buffers.
TEST(EmulatedDevice, HostMemoryWhereDeviceMemoryIsDueIsRefused) {
  MemoryPool dev;
  dev.set_device_memory(&emulated_memory());
  TensorF host({4, 4}), host_c({4, 4});
  host.fill(1), host_c.fill(0);
  {
    const PoolScope on(dev);
    TensorF a({4, 4}), c({4, 4});
    a.fill(1), c.fill(0);
    ops::OpCall call;
    call.op = ops::Op::gemm, call.dtype = RunDtype::fp32;
    call.shape.m = call.shape.n = call.shape.k = 4;
    call.shape.lda = call.shape.ldb = call.shape.ldc = 4;
    call.in[0] = a.data(), call.in[1] = host.data(), call.out[0] = c.data();
    const ops::KernelRow& row =
        ops::pick(Device::emulated, ops::Op::gemm, RunDtype::fp32, call.shape);
    EXPECT_NE(test::error_of([&] { ops::run_row(row, call); }).find("operand in[1]"),
              std::string::npos);
    call.in[1] = a.data();
    ops::run_row(row, call);  // every operand on the device: it runs
    EXPECT_EQ(c[0], 4.0f);
    EXPECT_NE(test::error_of([&] {
                emulated_memory().to_device(host_c.data(), a.data(), a.bytes());
              }).find("not device memory"),
              std::string::npos);
    EXPECT_NE(test::error_of([&] {
                emulated_memory().to_host(a.data(), c.data(), c.bytes());
              }).find("host memory is due"),
              std::string::npos);
  }
  // Two ranks sharing the emulated device all-gather host buffers: refused.
  const std::string e = test::error_of([&] {
    LocalRunOptions opt;
    opt.device = &emulated_memory();
    run_local_ranks(
        2,
        [&](Communicator& comm) {
          std::vector<float> send(3, float(comm.rank())), recv(6);
          const std::int64_t counts[2] = {3, 3}, displs[2] = {0, 3};
          comm.all_gather_v(send.data(), 3, recv.data(), counts, displs, "host_buffers");
        },
        opt);
  });
  EXPECT_NE(e.find("not device memory"), std::string::npos) << e;
}

// The device-local transport sums with the device's registered reduction
// (register_device_reduction; CUDA's kernel on a GPU), here a counting one
// on the emulated device, giving the host's bits; under the reduction-order
// debugging switch the host sums (only it permutes). The forms' data
// movement is a device op: a host buffer handed to ops::copy is refused
// naming copy_rows.
std::atomic<int> emulated_reductions{0};
void counting_sum(void* dst, const void* const* srcs, int P, std::int64_t n, DType dtype) {
  ++emulated_reductions;
  comm_detail::sum_in_rank_order(dst, srcs, P, n, dtype);
}

TEST(EmulatedDevice, DeviceLocalReductionsRunTheDevicesReduction) {
  const int P = 3;
  const std::int64_t n = 10;
  auto all_reduce_on_device = [&] {
    std::vector<std::vector<float>> out(P);
    LocalRunOptions opt;
    opt.device = &emulated_memory();
    run_local_ranks(
        P,
        [&](Communicator& comm) {
          MemoryPool dev;
          dev.set_device_memory(&emulated_memory());
          const PoolScope on(dev);
          TensorF buf({n}, "buf");
          std::vector<float> host(static_cast<std::size_t>(n));
          for (std::int64_t i = 0; i < n; ++i)
            host[std::size_t(i)] = 0.1f * float(i + 1) * float(comm.rank() + 1) + 1e-3f;
          emulated_memory().to_device(buf.data(), host.data(), buf.bytes());
          comm.all_reduce(buf.data(), n, "sum");
          emulated_memory().to_host(host.data(), buf.data(), buf.bytes());
          out[std::size_t(comm.rank())] = host;
        },
        opt);
    return out;
  };
  const std::vector<std::vector<float>> host_sums = all_reduce_on_device();
  register_device_reduction(Device::emulated, &counting_sum);
  emulated_reductions = 0;
  const std::vector<std::vector<float>> device_sums = all_reduce_on_device();
  EXPECT_GE(emulated_reductions.load(), P);  // each rank's chunk at least
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(0, std::memcmp(device_sums[std::size_t(r)].data(), host_sums[std::size_t(r)].data(),
                             sizeof(float) * std::size_t(n)))
        << "rank " << r;
  emulated_reductions = 0;
  set_reduction_order_seed(7);
  all_reduce_on_device();
  set_reduction_order_seed(std::nullopt);
  EXPECT_EQ(emulated_reductions.load(), 0);
  register_device_reduction(Device::emulated, nullptr);

  MemoryPool dev;
  dev.set_device_memory(&emulated_memory());
  TensorF host({4, 4});
  host.fill(1);
  const PoolScope on(dev);
  TensorF a({4, 4});
  const ops::UseDevice emulated(Device::emulated);
  const std::string e = test::error_of([&] { ops::copy(ops::mat(a), ops::mat(host)); });
  EXPECT_NE(e.find("copy_rows on emulated"), std::string::npos) << e;
  EXPECT_NE(e.find("operand in[0]"), std::string::npos) << e;
  ops::fill(ops::mat(a), 2.0f);
  EXPECT_EQ(a[15], 2.0f);
}

}  // namespace
}  // namespace laga
