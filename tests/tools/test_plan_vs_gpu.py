#!/usr/bin/env python3
"""scripts/plan_vs_gpu.py on a SYNTHETIC laga_cuda_forms JSON made up here
(no GPU ran it; its step times are round placeholders, and the tool labels
everything made from it as synthetic): the join with `laga plan`, the
profile chosen by nvidia-smi's name, and the refusal when none matches.

    test_plan_vs_gpu.py LAGA TMPDIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOOL = os.path.join(ROOT, "scripts", "plan_vs_gpu.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import plan_vs_gpu  # noqa: E402

LABEL = "made up by tests/tools/test_plan_vs_gpu.py: not measured"
MB = 1 << 20


def timing(form, dtype, S, P, step_ms, rank=0, note=""):
    """One row as laga_cuda_forms writes it; the figures are placeholders."""
    return {"form": form, "dtype": dtype, "S": S, "P": P, "rank": rank, "step_ms": step_ms,
            "device_peak": 1000 * MB, "model_peak": 1000 * MB,
            "cublaslt_workspace_predicted": 32 * MB,
            "kept": {"cublaslt_workspace": 32 * MB, "cudnn_workspace": 8 * MB,
                     "cudnn_graphs": [{"shape": "placeholder", "forward": 8 * MB,
                                       "backward": 4 * MB}],
                     "total": 41 * MB},
            "note": note}


SYNTHETIC = {
    "synthetic": LABEL,
    "ran": True,
    "device": {"name": "placeholder", "sm": 90, "memory_bytes": 80 * 10**9, "driver": 0,
               "runtime": 0},
    "timings": [
        timing("explicit", "bf16", 4096, 1, 100.0),
        timing("laga_fused", "fp32", 4096, 1, 100.0),
        timing("laga", "bf16", 4096, 8, 10.0),
        timing("laga", "bf16", 4096, 8, 10.0, rank=3),
        timing("explicit", "bf16", 32768, 8, 0.0, note="skipped: over the time budget"),
    ],
}


def plan(laga, form, S, P, dtype, profile):
    r = subprocess.run([laga, "plan", "--preset", "deepseek-v3", "--seq", str(S), "--sp", str(P),
                        "--forms", form, "--dtype", dtype, "--profile", profile, "--json", "-",
                        "--quiet"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["plans"][0]


def run_tool(laga, tmp, name, gpu_name, forms):
    src = os.path.join(tmp, f"{name}_forms.json")
    with open(src, "w") as f:
        json.dump(forms, f)
    out_json, out_md = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.md")
    r = subprocess.run([sys.executable, TOOL, "--forms", src, "--gpu-name", gpu_name, "--laga",
                        laga, "--json", out_json, "--table", out_md],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"FAILED: plan_vs_gpu.py exited {r.returncode}: {r.stderr}")
    with open(out_json) as f, open(out_md) as g:
        return json.load(f), g.read()


def main():
    laga, tmp = sys.argv[1], sys.argv[2]
    os.makedirs(tmp, exist_ok=True)
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    # The profile choice: exact nvidia-smi names of the parts the profiles describe.
    check(plan_vs_gpu.choose_profile("NVIDIA H100 80GB HBM3") == ("h100", None), "H100 SXM -> h100")
    check(plan_vs_gpu.choose_profile("NVIDIA H200") == ("h200", None), "H200 SXM -> h200")
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB"):
        p, why = plan_vs_gpu.choose_profile(other)
        check(p is None and f"'{other}'" in why and "no shipped profile" in why,
              f"{other} is refused naming it: {p}, {why}")
    p, why = plan_vs_gpu.choose_profile("")
    check(p is None and "no GPU name" in why, f"no name is refused: {why}")
    for name, profile in plan_vs_gpu.PROFILE_OF_GPU.items():
        check(os.path.exists(os.path.join(ROOT, "profiles", profile + ".json")),
              f"{name}'s profile {profile} is shipped")

    # The join, on the H100's name.
    j, md = run_tool(laga, tmp, "h100", "NVIDIA H100 80GB HBM3", SYNTHETIC)
    check(j["profile"] == "h100" and j["no_prediction"] is None, f"profile: {j['profile']}")
    check(j.get("synthetic") == LABEL and md.startswith("**SYNTHETIC input, not measured"),
          "the synthetic label is carried into the JSON and the table")
    rows = j["rows"]
    check(len(rows) == len(SYNTHETIC["timings"]), f"{len(rows)} rows")
    # P 1: no links and no all-reduce, so the rank's compute is the plan's step.
    for r in rows[:2]:
        step = plan(laga, r["form"], r["S"], r["P"], r["dtype"], "h100")["predicted_step_s"]
        check(abs(r["predicted_ms"] - 1e3 * step) <= 1e-9 * 1e3 * step,
              f"{r['form']} {r['dtype']} P 1: predicted {r['predicted_ms']} ms, plan's step "
              f"{1e3 * step} ms")
        check(r["ratio"] is not None and abs(r["ratio"] - r["step_ms"] / r["predicted_ms"]) < 1e-12,
              f"{r['form']} P 1: ratio {r['ratio']}")
    check(rows[1]["predicted_ms"] > 5 * rows[0]["predicted_ms"],
          "laga_fused's fp32 row is planned in fp32 (67 TFLOP/s, not bf16's 989)")
    # P 8: the rank's compute, under the plan's step (which adds the links).
    p8 = plan(laga, "laga", 4096, 8, "bf16", "h100")
    check(rows[2]["plan_critical_rank"] == p8["critical_rank"] == 0, "P 8's critical rank is 0")
    check(0 < rows[2]["predicted_ms"] < 1e3 * p8["predicted_step_s"],
          f"P 8: compute {rows[2]['predicted_ms']} ms under the step {p8['predicted_step_s']} s")
    check(rows[2]["ratio"] is not None, "P 8 rank 0: a ratio")
    check(rows[3]["ratio"] is None and "rank 3 was timed" in rows[3]["no_ratio"],
          f"a rank other than the plan's critical one gets no ratio: {rows[3].get('no_ratio')}")
    check(rows[4]["ratio"] is None and rows[4]["note"] == "skipped: over the time budget",
          "a skipped row keeps its note and gets no ratio")
    check(rows[0]["device_peak_predicted"] == 1032 * MB and
          rows[0]["device_peak_measured"] == 1032 * MB and
          rows[0]["cudnn_workspace_measured"] == 8 * MB, "device peak: model + cuBLASLt workspace")
    check("| predicted ms |" in md and "skipped: over the time budget" in md, "the table")

    # The refusal: a device no profile describes gets no prediction column.
    j, md = run_tool(laga, tmp, "pcie", "NVIDIA H100 PCIe", SYNTHETIC)
    check(j["profile"] is None and "'NVIDIA H100 PCIe'" in j["no_prediction"],
          f"refusal: {j['no_prediction']}")
    check(all(r["predicted_ms"] is None and r["ratio"] is None for r in j["rows"]),
          "no predictions without a profile")
    check("predicted ms" not in md and "No prediction column: no shipped profile" in md,
          "the table has no prediction column and says why")

    # A dry run timed nothing: no rows, said so.
    j, md = run_tool(laga, tmp, "dry", "", {"ran": False, "synthetic": LABEL})
    check(j["rows"] == [] and "dry run" in j["no_rows"] and "No rows" in md, "dry run: no rows")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("plan_vs_gpu: join, profile choice and refusal pass (synthetic input)")


if __name__ == "__main__":
    main()
