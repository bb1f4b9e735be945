#!/usr/bin/env python3
"""Two `laga plan --json` files of the same plans on two profiles, side by
side: per (S, P) and form, the critical rank's GEMM and attention seconds
(with the FLOP/s they imply), the share of its FLOPs costed at measured
shapes on the second profile, the predicted step, and each profile's winner.
It computes nothing but sums and ratios of what the two JSON files hold.

    laga plan --profile h200 --preset deepseek-v3 --seq 32768 --sp 8 --json a.json
    laga plan --profile docs/assets/h200_measured_v3.json ... --json b.json
    python3 scripts/compare_plan_profiles.py a.json b.json   # markdown on stdout

docs/planning.md, "The h200 profile against one H200", is its output.
"""
import argparse
import json
import sys


def load(path):
    with open(path) as f:
        j = json.load(f)
    return j, {(p["seq"], p["sp"], p["form"]): p for p in j["plans"]}


def totals(plan):
    ph = plan["phases"].values()
    return {k: sum(x[k] for x in ph) for k in
            ("gemm_s", "attention_s", "gemm_flops", "attention_flops", "unmeasured_flops")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", help="plan JSON on the first profile (e.g. the datasheet one)")
    ap.add_argument("second", help="the same plans on the second (e.g. with measured shapes)")
    a = ap.parse_args()
    ja, A = load(a.first)
    jb, B = load(a.second)
    if set(A) != set(B):
        sys.exit("compare_plan_profiles.py: the two files plan different (S, P, form)s")
    print(f"first: {ja['profile_source']}; second: {jb['profile_source']}; {ja['dtype']}, "
          f"{ja['attention']} attention, {ja['seq_layout']} shards")
    for S, P in sorted({k[:2] for k in A}):
        forms = [k[2] for k in A if k[:2] == (S, P)]
        print(f"\n**S {S}, P {P}**\n")
        print("| form | GEMM ms (TFLOP/s): first → second | attention ms (TFLOP/s): first → "
              "second | second's FLOPs at measured shapes | step ms: first → second |")
        print("|---|---|---|---|---|")
        for f in forms:
            x, y = totals(A[(S, P, f)]), totals(B[(S, P, f)])
            flops = y["gemm_flops"] + y["attention_flops"]

            def rate(fl, s):
                return f"{fl / s / 1e12:.0f}" if s > 0 else "-"
            print(f"| {f} | {x['gemm_s'] * 1e3:.2f} ({rate(x['gemm_flops'], x['gemm_s'])}) → "
                  f"{y['gemm_s'] * 1e3:.2f} ({rate(y['gemm_flops'], y['gemm_s'])}) | "
                  f"{x['attention_s'] * 1e3:.2f} ({rate(x['attention_flops'], x['attention_s'])})"
                  f" → {y['attention_s'] * 1e3:.2f} "
                  f"({rate(y['attention_flops'], y['attention_s'])}) | "
                  f"{100 * (1 - y['unmeasured_flops'] / flops):.0f}% | "
                  f"{A[(S, P, f)]['predicted_step_s'] * 1e3:.2f} → "
                  f"{B[(S, P, f)]['predicted_step_s'] * 1e3:.2f} |")
        win = [next(c["winner"] for c in j["cases"] if (c["seq"], c["sp"]) == (S, P))
               for j in (ja, jb)]
        print(f"\nwinner (the plan's): {win[0]} on the first, {win[1]} on the second")


if __name__ == "__main__":
    main()
