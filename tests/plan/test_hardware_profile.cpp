// Hardware profiles: every shipped one parses, a profile round-trips through
// profile_json (its measured shapes too), and each kind of bad field is
// refused naming the source and the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/error_of.hpp"
#include "mla/block.hpp"
#include "plan/hardware_profile.hpp"

namespace laga {
namespace {

using nlohmann::json;
using test::error_of;

const char* kGood = R"({
  "name": "x", "description": "a test device",
  "device": {"peak_flops": {"fp32": 1e12, "bf16": 4e12},
             "efficiency": {"gemm": 0.5, "attention": 0.25},
             "memory_bytes": 16e9, "memory_bytes_per_s": 1e12},
  "devices_per_node": 4,
  "intra_node": {"bytes_per_s": 100e9, "latency_us": 2, "topology": "full-mesh"},
  "inter_node": {"bytes_per_s": 10e9, "latency_us": 7.5, "topology": "switch"}
})";

TEST(HardwareProfile, ParsesEveryField) {
  const HardwareProfile p = parse_profile(kGood, "test");
  EXPECT_EQ(p.name, "x");
  EXPECT_EQ(p.peak_flops(PlanDType::fp32), 1e12);
  EXPECT_EQ(p.peak_flops(PlanDType::bf16), 4e12);
  EXPECT_EQ(p.device.gemm_efficiency, 0.5);
  EXPECT_EQ(p.device.attention_efficiency, 0.25);
  EXPECT_EQ(p.device.memory_bytes, 16e9);
  EXPECT_EQ(p.device.elementwise_bytes_per_s, 1e12);  // defaults to the memory bandwidth
  EXPECT_EQ(p.device.exp_per_s, 0);                   // absent: exponentials not priced
  EXPECT_EQ(p.devices_per_node, 4);
  EXPECT_EQ(p.intra_node.bytes_per_s, 100e9);
  EXPECT_DOUBLE_EQ(p.intra_node.latency_s, 2e-6);
  EXPECT_EQ(p.intra_node.topology, Topology::full_mesh);
  EXPECT_DOUBLE_EQ(p.inter_node.latency_s, 7.5e-6);
  EXPECT_EQ(p.inter_node.topology, Topology::switched);
}

TEST(HardwareProfile, RoundTripsThroughItsJson) {
  json good = json::parse(kGood);
  good["device"]["exp_per_s"] = 2.5e8;
  const HardwareProfile a = parse_profile(good.dump(), "test");
  EXPECT_EQ(a.device.exp_per_s, 2.5e8);
  const HardwareProfile b = parse_profile(profile_json(a), "again");
  EXPECT_EQ(a.device.exp_per_s, b.device.exp_per_s);
  // A profile without it writes none (reading it back gives 0, not priced).
  EXPECT_EQ(profile_json(parse_profile(kGood, "t")).find("exp_per_s"), std::string::npos);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.description, b.description);
  EXPECT_EQ(a.device.peak_flops_fp32, b.device.peak_flops_fp32);
  EXPECT_EQ(a.device.peak_flops_bf16, b.device.peak_flops_bf16);
  EXPECT_EQ(a.device.gemm_efficiency, b.device.gemm_efficiency);
  EXPECT_EQ(a.device.attention_efficiency, b.device.attention_efficiency);
  EXPECT_EQ(a.device.elementwise_bytes_per_s, b.device.elementwise_bytes_per_s);
  EXPECT_EQ(a.device.memory_bytes, b.device.memory_bytes);
  EXPECT_EQ(a.device.memory_bytes_per_s, b.device.memory_bytes_per_s);
  EXPECT_EQ(a.devices_per_node, b.devices_per_node);
  for (auto [x, y] : {std::pair{a.intra_node, b.intra_node}, {a.inter_node, b.inter_node}}) {
    EXPECT_EQ(x.bytes_per_s, y.bytes_per_s);
    EXPECT_DOUBLE_EQ(x.latency_s, y.latency_s);  // microseconds in the file: one rounding
    EXPECT_EQ(x.topology, y.topology);
  }
}

// One change to the good profile, and the start of the error it must give.
struct Bad {
  std::function<void(json&)> change;
  std::string error;
};

// kGood with one measured GEMM and one measured attention shape.
json with_shapes() {
  json j = json::parse(kGood);
  j["measured_shapes"] = {{"gemm",
                           {{{"trans_a", false},
                             {"trans_b", true},
                             {"m", 64},
                             {"n", 32},
                             {"k", 16},
                             {"lda", 16},
                             {"ldb", 48},
                             {"ldc", 32},
                             {"accumulate", true},
                             {"seconds", 2.5e-6}}}},
                          {"attention",
                           {{{"kernel", "eager"},
                             {"pass", "backward"},
                             {"B", 2},
                             {"Sq", 128},
                             {"Sk", 256},
                             {"Hq", 4},
                             {"Hk", 1},
                             {"dqk", 40},
                             {"dv", 32},
                             {"causal", true},
                             {"seconds", 1.5e-3}}}}};
  return j;
}

TEST(HardwareProfile, MeasuredShapesParseAndRoundTrip) {
  EXPECT_TRUE(parse_profile(kGood, "test").measured_shapes.gemm.empty());
  const HardwareProfile a = parse_profile(with_shapes().dump(), "test");
  const ops::GemmCall g{false, true, 64, 32, 16, 16, 48, 32, true};
  ops::AttentionCall at;
  at.B = 2, at.Sq = 128, at.Sk = 256, at.Hq = 4, at.Hk = 1, at.dqk = 40, at.dv = 32;
  at.kernel = AttentionKind::eager, at.pass = ops::AttentionPass::backward;
  ASSERT_EQ(a.measured_shapes.gemm.size(), 1u);
  ASSERT_EQ(a.measured_shapes.attention.size(), 1u);
  EXPECT_EQ(a.measured_shapes.gemm.at(g), 2.5e-6);
  EXPECT_EQ(a.measured_shapes.attention.at(at), 1.5e-3);
  const HardwareProfile b = parse_profile(profile_json(a), "again");
  EXPECT_EQ(a.measured_shapes.gemm, b.measured_shapes.gemm);
  EXPECT_EQ(a.measured_shapes.attention, b.measured_shapes.attention);
  // Without "dtype" the timings are fp32 (laga plan --measure's); a GPU's
  // bf16 timings say so, and the dtype round-trips.
  EXPECT_EQ(a.measured_shapes.dtype, PlanDType::fp32);
  json j = with_shapes();
  j["measured_shapes"]["dtype"] = "bf16";
  const HardwareProfile c = parse_profile(j.dump(), "bf16");
  EXPECT_EQ(c.measured_shapes.dtype, PlanDType::bf16);
  EXPECT_EQ(parse_profile(profile_json(c), "again").measured_shapes.dtype, PlanDType::bf16);
}

TEST(HardwareProfile, ShapeListNamesEachCallWithItsCallsAndFlops) {
  ops::OpCounts c;
  const ops::GemmCall g{false, true, 64, 32, 16, 16, 48, 32, true};
  c.add_gemm(g, 3);
  ops::AttentionCall at;
  at.B = 2, at.Sq = 128, at.Sk = 256, at.Hq = 4, at.Hk = 1, at.dqk = 40, at.dv = 32;
  at.kernel = AttentionKind::flash;
  c.attention_calls[at] = {2, 1e9};
  ops::AttentionCall docs = at, empty = at;  // neither is listed
  docs.documents = true, empty.Hq = 0;
  c.attention_calls[docs] = {1, 5e8};
  c.attention_calls[empty] = {1, 0};
  const json j = json::parse(shape_list_json(c));
  ASSERT_EQ(j.at("gemm").size(), 1u);
  ASSERT_EQ(j.at("attention").size(), 1u);
  const json& jg = j["gemm"][0];
  EXPECT_EQ(jg.at("m"), 64);
  EXPECT_EQ(jg.at("ldb"), 48);
  EXPECT_EQ(jg.at("accumulate"), true);
  EXPECT_EQ(jg.at("calls"), 3);
  EXPECT_EQ(jg.at("flops"), 2.0 * 64 * 32 * 16 * 3);
  const json& ja = j["attention"][0];
  EXPECT_EQ(ja.at("kernel"), "flash");
  EXPECT_EQ(ja.at("Sk"), 256);
  EXPECT_EQ(ja.at("calls"), 2);
  // A shape listed and then timed is a measured shape the profile reads back.
  json timed = json::parse(kGood);
  json g1 = jg, a1 = ja;
  for (json* s : {&g1, &a1}) s->erase("calls"), s->erase("flops"), (*s)["seconds"] = 1e-4;
  timed["measured_shapes"] = {{"dtype", "bf16"}, {"gemm", {g1}}, {"attention", {a1}}};
  const HardwareProfile p = parse_profile(timed.dump(), "timed");
  EXPECT_EQ(p.measured_shapes.gemm.at(g), 1e-4);
  EXPECT_EQ(p.measured_shapes.attention.at(at), 1e-4);
}

TEST(HardwareProfile, BadMeasuredShapesAreNamed) {
  const std::vector<Bad> cases{
      {[](json& j) { j["measured_shapes"]["gemm"][0]["seconds"] = 0; },
       "profile t: measured_shapes.gemm[0].seconds = 0 must be positive and finite"},
      {[](json& j) { j["measured_shapes"]["gemm"][0]["m"] = 1.5; },
       "profile t: measured_shapes.gemm[0].m = 1.5 must be a whole number >= 1"},
      {[](json& j) { j["measured_shapes"]["gemm"][0]["trans_a"] = 0; },
       "profile t: measured_shapes.gemm[0].trans_a must be true or false, got 0"},
      {[](json& j) { j["measured_shapes"]["attention"][0].erase("dv"); },
       "profile t: missing field measured_shapes.attention[0].dv"},
      {[](json& j) { j["measured_shapes"]["attention"][0]["kernel"] = "fused"; },
       "profile t: measured_shapes.attention[0].kernel = 'fused' must be flash or eager"},
      {[](json& j) { j["measured_shapes"]["attention"][0]["pass"] = "both"; },
       "profile t: measured_shapes.attention[0].pass = 'both' must be forward or backward"},
      {[](json& j) { j["measured_shapes"]["attention"][0]["documents"] = true; },
       "profile t: unknown field measured_shapes.attention[0].documents"},
      {[](json& j) { j["measured_shapes"]["gemm"] = 3; },
       "profile t: measured_shapes.gemm must be a JSON array"},
      {[](json& j) {
         json& g = j["measured_shapes"]["gemm"];
         g.push_back(g[0]), g[1]["seconds"] = 1e-6;
       },
       "profile t: measured_shapes.gemm[1].seconds: this GEMM shape is given twice"},
      {[](json& j) {
         json& a = j["measured_shapes"]["attention"];
         a.push_back(a[0]);
       },
       "profile t: measured_shapes.attention[1].seconds: this attention shape is given twice"},
      {[](json& j) { j["measured_shapes"]["dtype"] = "fp16"; },
       "profile t: measured_shapes.dtype = 'fp16' must be fp32 or bf16"},
  };
  for (const Bad& b : cases) {
    json j = with_shapes();
    b.change(j);
    const std::string e = error_of([&] { parse_profile(j.dump(), "t"); });
    EXPECT_EQ(e.rfind(b.error, 0), 0u) << "got: " << e << "\nwant: " << b.error;
  }
}

TEST(HardwareProfile, EveryShippedProfileParses) {
  const std::vector<std::string> names = builtin_profile_names();
  for (const char* want : {"a100", "h100", "h200", "910b"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (const std::string& n : names) {
    const HardwareProfile p = load_profile(n);
    EXPECT_EQ(p.name, n) << "the file name and the profile's name agree";
    EXPECT_GT(p.peak_flops(PlanDType::bf16), 0) << n;
  }
}

TEST(HardwareProfile, AnUnpublishedPeakIsRefusedWhenAskedFor) {
  json j = json::parse(kGood);
  j["device"]["peak_flops"]["fp32"] = nullptr;
  const HardwareProfile p = parse_profile(j.dump(), "test");
  EXPECT_NE(error_of([&] {
              p.peak_flops(PlanDType::fp32);
            }).find("profile test: device.peak_flops.fp32 is null (not published"),
            std::string::npos);
}

TEST(HardwareProfile, BadFieldsAreNamed) {
  const std::vector<Bad> cases{
      {[](json& j) { j.erase("devices_per_node"); }, "profile t: missing field devices_per_node"},
      {[](json& j) { j["device"]["efficiency"].erase("gemm"); },
       "profile t: missing field device.efficiency.gemm"},
      {[](json& j) { j["intra_node"]["bytes_per_s"] = 0; },
       "profile t: intra_node.bytes_per_s = 0 must be positive and finite"},
      {[](json& j) { j["inter_node"]["bytes_per_s"] = -5e9; },
       "profile t: inter_node.bytes_per_s = -5000000000.0 must be positive and finite"},
      {[](json& j) { j["inter_node"]["latency_us"] = -1; },
       "profile t: inter_node.latency_us = -1 must be >= 0 and finite"},
      {[](json& j) { j["device"]["memory_bytes"] = "80GB"; },
       "profile t: device.memory_bytes must be a number, got \"80GB\""},
      {[](json& j) { j["device"]["efficiency"]["attention"] = 1.5; },
       "profile t: device.efficiency.attention = 1.5 is an achieved fraction"},
      {[](json& j) { j["intra_node"]["topology"] = "torus"; },
       "intra_node.topology: unknown topology 'torus'"},
      {[](json& j) { j["devices_per_node"] = 2.5; },
       "profile t: devices_per_node = 2.5 must be a whole number"},
      {[](json& j) {
         j["device"]["peak_flops"] = {{"fp32", nullptr}, {"bf16", nullptr}};
       },
       "profile t: device.peak_flops has neither fp32 nor bf16"},
      {[](json& j) { j["device"]["memory_bandwidth"] = 1; },
       "profile t: unknown field device.memory_bandwidth"},
      {[](json& j) { j = json::array(); }, "profile t:  must be a JSON object"},
      // Positive but no device's (issue 26 item 16: inf/NaN step times and a
      // named winner).
      {[](json& j) { j["device"]["peak_flops"]["fp32"] = 1e-300; },
       "profile t: device.peak_flops.fp32 = 1e-300 FLOP/s is below any device's"},
      {[](json& j) { j["device"]["memory_bytes"] = 80; },
       "profile t: device.memory_bytes = 80 bytes is below any device's"},
      {[](json& j) { j["device"]["memory_bytes_per_s"] = 3.35; },
       "profile t: device.memory_bytes_per_s = 3.35 bytes/s is below any device's"},
      {[](json& j) { j["device"]["exp_per_s"] = 1; },
       "profile t: device.exp_per_s = 1 exponentials/s is below any device's"},
      {[](json& j) { j["device"]["exp_per_s"] = "fast"; },
       "profile t: device.exp_per_s must be a number"},
      {[](json& j) { j["intra_node"]["bytes_per_s"] = 1e-9; },
       "profile t: intra_node.bytes_per_s = 1e-09 bytes/s is below any link's"},
      {[](json& j) { j["inter_node"]["latency_us"] = 1e300; },
       "profile t: inter_node.latency_us = 1e+300 us is beyond any link's"},
      // Past any device's: the plan's times vanished and it still named a
      // winner (1e308 FLOP/s planned 5e-303 s steps, issue 54). Every
      // figure has its upper bound, each named with its field.
      {[](json& j) { j["device"]["peak_flops"]["bf16"] = 1e308; },
       "profile t: device.peak_flops.bf16 = 1e+308 FLOP/s is beyond any device's (at most "
       "1e+17 FLOP/s)"},
      {[](json& j) { j["device"]["peak_flops"]["fp32"] = 2e17; },
       "profile t: device.peak_flops.fp32 = 2e+17 FLOP/s is beyond any device's"},
      {[](json& j) { j["device"]["memory_bytes"] = 1e300; },
       "profile t: device.memory_bytes = 1e+300 bytes is beyond any device's (at most 1e+14"},
      {[](json& j) { j["device"]["memory_bytes_per_s"] = 1e200; },
       "profile t: device.memory_bytes_per_s = 1e+200 bytes/s is beyond any device's"},
      {[](json& j) { j["device"]["elementwise_bytes_per_s"] = 1e15; },
       "profile t: device.elementwise_bytes_per_s = 1e+15 bytes/s is beyond any device's"},
      {[](json& j) { j["device"]["exp_per_s"] = 1e300; },
       "profile t: device.exp_per_s = 1e+300 exponentials/s is beyond any device's"},
      {[](json& j) { j["device"]["efficiency"]["gemm"] = 1e-300; },
       "profile t: device.efficiency.gemm = 1e-300 is below any device's (at least 0.001)"},
      {[](json& j) { j["intra_node"]["bytes_per_s"] = 1e300; },
       "profile t: intra_node.bytes_per_s = 1e+300 bytes/s is beyond any link's (at most 1e+15"},
      {[](json& j) { j["inter_node"]["bytes_per_s"] = 2e15; },
       "profile t: inter_node.bytes_per_s = 2e+15 bytes/s is beyond any link's"},
      {[](json& j) {
         j["measured_shapes"] = {{"gemm", json::array()},
                                 {"attention",
                                  {{{"kernel", "flash"},
                                    {"pass", "forward"},
                                    {"B", 1},
                                    {"Sq", 8},
                                    {"Sk", 8},
                                    {"Hq", 1},
                                    {"Hk", 1},
                                    {"dqk", 8},
                                    {"dv", 8},
                                    {"causal", true},
                                    {"seconds", 1e-300}}}}};
       },
       "profile t: measured_shapes.attention[0].seconds = 1e-300 s is below any call's"},
      {[](json& j) {
         j["measured_shapes"] = {{"attention", json::array()},
                                 {"gemm",
                                  {{{"trans_a", false},
                                    {"trans_b", false},
                                    {"m", 8},
                                    {"n", 8},
                                    {"k", 8},
                                    {"lda", 8},
                                    {"ldb", 8},
                                    {"ldc", 8},
                                    {"accumulate", false},
                                    {"seconds", 1e300}}}}};
       },
       "profile t: measured_shapes.gemm[0].seconds = 1e+300 s is beyond any call's"},
  };
  for (const Bad& b : cases) {
    json j = json::parse(kGood);
    b.change(j);
    const std::string e = error_of([&] { parse_profile(j.dump(), "t"); });
    EXPECT_EQ(e.rfind(b.error, 0), 0u) << "got: " << e << "\nwant: " << b.error;
  }
  EXPECT_EQ(error_of([] { parse_profile("{", "t"); }).rfind("profile t is not valid JSON", 0), 0u);
  // A key given twice is refused, as configs and safetensors headers refuse it.
  std::string twice = json::parse(kGood).dump();
  twice.insert(twice.rfind('}'), ",\"devices_per_node\": 4");
  EXPECT_NE(error_of([&] {
              parse_profile(twice, "t");
            }).find("profile t: key 'devices_per_node' appears twice in one object"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_profile("no-such-profile"); })
                .find("--profile 'no-such-profile' is neither a built-in profile (910b, a100, "
                      "h100, h200, h800, or 'this' to measure this machine) nor a readable file"),
            std::string::npos);
}

}  // namespace
}  // namespace laga
