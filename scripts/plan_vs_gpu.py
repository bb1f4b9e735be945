#!/usr/bin/env python3
"""The planner's first check against a GPU: laga_cuda_forms' measured step
times beside `laga plan`'s prediction for the same block on the profile of
the GPU that ran them (issue 52; docs/planning.md, "Timing a plan's shapes on
a GPU"; scripts/gpu_check.sh's cuda mode runs it after laga_cuda_forms).

    python3 scripts/plan_vs_gpu.py --forms cuda_forms.json --gpu-name NAME \
        --laga ./laga --json plan_vs_gpu.json --table plan_vs_gpu.md

--gpu-name: the device as nvidia-smi names it (`nvidia-smi
--query-gpu=name --format=csv,noheader`). The profile is the shipped one
whose device that name is (PROFILE_OF_GPU below: exact names only, since an
H100 PCIe or NVL has another peak and bandwidth than the SXM5 the h100
profile describes); any other name, or none, gets no prediction column, and
the table and JSON say why.

Each timing row of cuda_forms.json (form, S, P, dtype; a P > 1 row is one
rank run alone on a dry-run communicator, so its time is that rank's
compute: no link time) is joined with `laga plan --preset deepseek-v3 --seq
S --sp P --forms FORM --dtype DTYPE --profile PROFILE`'s plan for it. The
prediction compared is the rank's compute, forward + backward: the plan's
phases' gemm_s + attention_s + elementwise_s (docs/planning.md, "The time
model"), not predicted_step_s, which adds the links and the gradient
all-reduce the measured rank does not run. The plan's phases are its
critical rank's (critical_rank): where that is not the rank timed, the row
gets the prediction but no ratio, and says so. Rows laga_cuda_forms skipped
(a note, no time) are carried with their note.

The device peak beside it: the memory model's peak (exact for the rank's
device pool) plus the cuBLASLt workspace (predicted: a size laga chooses),
against the pool's measured peak plus the cuBLASLt workspace the thread
held; cuDNN's SDPA workspace per graph is only measured (src/cuda/
device_peak.hpp says which part is which).

A forms JSON carrying "synthetic" (a test's made-up input) is labelled so in
both outputs, so that nothing made from it reads as measured.
"""
import argparse
import json
import subprocess
import sys

# nvidia-smi's name of the device each shipped profile describes (profiles/
# *.json's "description"): the SXM parts, whose peaks the profiles give.
PROFILE_OF_GPU = {
    "NVIDIA H100 80GB HBM3": "h100",  # H100 SXM5 80GB
    "NVIDIA H200": "h200",  # H200 SXM 141GB
    "NVIDIA H800": "h800",  # H800 SXM5 80GB
    "NVIDIA A100-SXM4-80GB": "a100",  # A100 SXM4 80GB
}
PRESET = "deepseek-v3"  # laga_cuda_forms' timing dims (src/cuda/check_forms.cpp)


def choose_profile(gpu_name):
    """(profile, None) for a device a shipped profile describes, else (None, why)."""
    name = (gpu_name or "").strip()
    if not name:
        return None, ("no GPU name was given (nvidia-smi found no device): no profile is chosen, "
                      "so there is no prediction to compare")
    if name in PROFILE_OF_GPU:
        return PROFILE_OF_GPU[name], None
    known = ", ".join(f"'{n}' ({p})" for n, p in PROFILE_OF_GPU.items())
    return None, (f"no shipped profile describes the device '{name}' (profiles for {known}): no "
                  f"prediction; write a profile for it (docs/planning.md, \"Profiles\") and add "
                  f"its nvidia-smi name to PROFILE_OF_GPU in scripts/plan_vs_gpu.py")


def plan_compute(laga, profile, form, seq, sp, dtype):
    """`laga plan`'s plan of one (form, S, P, dtype): (compute seconds, critical rank)."""
    cmd = [laga, "plan", "--preset", PRESET, "--seq", str(seq), "--sp", str(sp), "--forms", form,
           "--dtype", dtype, "--profile", profile, "--json", "-", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
    plans = [p for p in json.loads(r.stdout)["plans"] if p["form"] == form]
    if len(plans) != 1:
        raise RuntimeError(f"{' '.join(cmd)}: {len(plans)} plans of form {form}, expected 1")
    p = plans[0]
    compute = sum(p["phases"][ph][k] for ph in ("forward", "backward")
                  for k in ("gemm_s", "attention_s", "elementwise_s"))
    return compute, p["critical_rank"], " ".join(cmd[1:])


def join(forms, gpu_name, laga):
    profile, why = choose_profile(gpu_name)
    out = {"gpu_name": gpu_name or None, "profile": profile, "no_prediction": why,
           "preset": PRESET,
           "predicted": "the timed rank's compute, forward + backward (the plan's phases: gemm_s + "
                        "attention_s + elementwise_s), on the profile; no links, no gradient "
                        "all-reduce",
           "rows": []}
    if "synthetic" in forms:
        out["synthetic"] = forms["synthetic"]
    if not forms.get("ran"):
        out["no_rows"] = "laga_cuda_forms did not run (a dry run): it timed nothing"
        return out
    for t in forms.get("timings", []):
        row = {k: t.get(k) for k in ("form", "dtype", "S", "P", "rank", "step_ms", "note")}
        row["rank"] = row["rank"] if row["rank"] is not None else 0
        row["predicted_ms"] = row["ratio"] = None
        dev = t.get("device_peak")
        model = t.get("model_peak")
        ws = t.get("cublaslt_workspace_predicted")
        row["device_peak_predicted"] = model + ws if model is not None and ws is not None else None
        held = t.get("kept", {}).get("cublaslt_workspace")
        row["device_peak_measured"] = dev + held if dev is not None and held is not None else None
        row["cudnn_workspace_measured"] = t.get("kept", {}).get("cudnn_workspace")
        if profile:
            compute_s, critical, cmd = plan_compute(laga, profile, t["form"], t["S"], t["P"],
                                                    t["dtype"])
            row["predicted_ms"] = 1e3 * compute_s
            row["plan"] = cmd
            row["plan_critical_rank"] = critical
            if critical != row["rank"]:
                row["no_ratio"] = (f"the plan's phases are rank {critical}'s (its critical rank); "
                                   f"rank {row['rank']} was timed")
            elif t.get("step_ms"):
                row["ratio"] = t["step_ms"] / row["predicted_ms"]
        out["rows"].append(row)
    return out


def fmt(v, spec):
    return "" if v is None else format(v, spec)


def table(j, forms):
    lines = []
    if "synthetic" in j:
        lines.append(f"**SYNTHETIC input, not measured: {j['synthetic']}**\n")
    dev = forms.get("device", {})
    lines.append(f"device: {j['gpu_name'] or 'none named'}"
                 + (f" (sm_{dev['sm']}, driver {dev['driver']}, CUDA runtime {dev['runtime']})"
                    if dev else "")
                 + (f"; profile {j['profile']}" if j["profile"] else "") + "\n")
    if j["no_prediction"]:
        lines.append(f"No prediction column: {j['no_prediction']}.\n")
    if "no_rows" in j:
        lines.append(f"No rows: {j['no_rows']}.\n")
        return "\n".join(lines)
    lines.append(f"Predicted: {j['predicted']}. Device peak: the memory model + the cuBLASLt "
                 "workspace (predicted) against the rank's device pool + the workspace held "
                 "(measured); cuDNN's SDPA workspace measured only.\n")
    pred = j["profile"] is not None
    head = ["form", "dtype", "S", "P (rank)", "measured ms"]
    if pred:
        head += ["predicted ms", "measured / predicted"]
    head += ["device peak GB predicted", "measured", "cuDNN workspace MB", "note"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in j["rows"]:
        cells = [r["form"], r["dtype"], str(r["S"]), f"{r['P']} ({r['rank']})",
                 fmt(r["step_ms"] or None, ".2f")]
        if pred:
            cells += [fmt(r["predicted_ms"], ".2f"), fmt(r["ratio"], ".3f")]
        cws = r["cudnn_workspace_measured"]
        cells += [fmt(r["device_peak_predicted"] and r["device_peak_predicted"] / 1e9, ".3f"),
                  fmt(r["device_peak_measured"] and r["device_peak_measured"] / 1e9, ".3f"),
                  fmt(cws / 2**20 if cws is not None else None, ".1f"),
                  "; ".join(x for x in (r.get("note"), r.get("no_ratio")) if x)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", required=True, help="laga_cuda_forms' JSON")
    ap.add_argument("--gpu-name", default="", help="nvidia-smi's name of the device")
    ap.add_argument("--laga", required=True, help="the laga executable (its `plan`)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--table", required=True)
    a = ap.parse_args()
    try:
        with open(a.forms) as f:
            forms = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plan_vs_gpu: cannot read laga_cuda_forms' JSON {a.forms}: {e}")
    try:
        j = join(forms, a.gpu_name, a.laga)
    except (RuntimeError, KeyError, subprocess.TimeoutExpired) as e:
        sys.exit(f"plan_vs_gpu: {e}")
    with open(a.json, "w") as f:
        json.dump(j, f, indent=2)
        f.write("\n")
    t = table(j, forms)
    with open(a.table, "w") as f:
        f.write(t)
    print(t, end="")


if __name__ == "__main__":
    main()
