// Kimi K3's MLA output gate (kernels/output_gate.hpp) against its reference
// (written with another derivative formula) and central finite differences
// in double, including large |g| where sigmoid saturates; and through the
// op layer (ops::output_gate, its op-table row) in double and float.
#include "kernels/output_gate.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "common/check.hpp"
#include "mla/op_table.hpp"
#include "mla/ops_model.hpp"

namespace laga {
namespace {

using test::all_close;
using test::random_vector;

TEST(OutputGate, MatchesReference) {
  const std::int64_t n = 1000;
  auto o = random_vector<double>(n, 1), g = random_vector<double>(n, 2, -40, 40),
       dy = random_vector<double>(n, 3);
  std::vector<double> y(n), yr(n), d_o(n), dg(n), d_or(n), dgr(n);
  output_gate_forward(y.data(), o.data(), g.data(), n);
  output_gate_forward_reference(yr.data(), o.data(), g.data(), n);
  EXPECT_TRUE(all_close("y", y, yr, 1e-15, 1e-13));
  output_gate_backward(d_o.data(), dg.data(), dy.data(), o.data(), g.data(), n);
  output_gate_backward_reference(d_or.data(), dgr.data(), dy.data(), o.data(), g.data(), n);
  EXPECT_TRUE(all_close("do", d_o, d_or, 1e-15, 1e-13));
  EXPECT_TRUE(all_close("dg", dg, dgr, 1e-15, 1e-12));
  auto of = test::convert<float>(o), gf = test::convert<float>(g), dyf = test::convert<float>(dy);
  std::vector<float> yf(n), d_of(n), dgf(n);
  output_gate_forward(yf.data(), of.data(), gf.data(), n);
  output_gate_backward(d_of.data(), dgf.data(), dyf.data(), of.data(), gf.data(), n);
  EXPECT_TRUE(all_close("y f32", yf, yr, 1e-6, 1e-5));
  EXPECT_TRUE(all_close("dg f32", dgf, dgr, 1e-6, 1e-5));
}

TEST(OutputGate, FiniteDifferencesDouble) {
  const std::int64_t n = 40;
  auto o = random_vector<double>(n, 4), g = random_vector<double>(n, 5, -6, 6),
       G = random_vector<double>(n, 6);
  std::vector<double> d_o(n), dg(n);
  output_gate_backward(d_o.data(), dg.data(), G.data(), o.data(), g.data(), n);
  auto loss = [&] {
    std::vector<double> y(n);
    output_gate_forward(y.data(), o.data(), g.data(), n);
    return test::dot(y.data(), G.data(), n);
  };
  test::GradientCheck gc;
  gc.add("o", o.data(), d_o.data(), n).add("g", g.data(), dg.data(), n);
  EXPECT_TRUE(gc.run(loss));
}

// The op layer's call (the table's row) is the kernel: the same bits.
TEST(OutputGate, OpLayerRunsTheTableRow) {
  for (ops::Op op : {ops::Op::output_gate_forward, ops::Op::output_gate_backward})
    for (RunDtype d : {RunDtype::fp64, RunDtype::fp32, RunDtype::bf16}) {
      ops::OpShape s;
      s.rows = 12;
      const ops::KernelChoice k = ops::supports(ops::Device::cpu, op, d, s);
      EXPECT_TRUE(k) << to_string(op) << ": " << k.why_not;
    }
  const std::int64_t rows = 3, cols = 7, n = rows * cols;
  TensorD o({rows, cols}), g({rows, cols}), dy({rows, cols}), y({rows, cols}), d_o({rows, cols}),
      dg({rows, cols});
  test::fill_random(o.data(), n, 7), test::fill_random(g.data(), n, 8, -5, 5);
  test::fill_random(dy.data(), n, 9);
  ops::output_gate(ops::mat(y), ops::mat(std::as_const(o)), ops::mat(std::as_const(g)));
  ops::output_gate_backward(ops::mat(d_o), ops::mat(dg), ops::mat(std::as_const(dy)),
                            ops::mat(std::as_const(o)), ops::mat(std::as_const(g)));
  std::vector<double> yr(n), d_or(n), dgr(n);
  output_gate_forward_reference(yr.data(), o.data(), g.data(), n);
  output_gate_backward_reference(d_or.data(), dgr.data(), dy.data(), o.data(), g.data(), n);
  EXPECT_TRUE(all_close("op y", y.data(), yr.data(), n, 1e-15, 1e-13));
  EXPECT_TRUE(all_close("op do", d_o.data(), d_or.data(), n, 1e-15, 1e-13));
  EXPECT_TRUE(all_close("op dg", dg.data(), dgr.data(), n, 1e-15, 1e-12));
}

}  // namespace
}  // namespace laga
