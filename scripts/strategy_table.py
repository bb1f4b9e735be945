#!/usr/bin/env python3
"""Every context-parallel strategy side by side, as a markdown table.

Runs `laga plan` with the arguments given and prints, per (S, P), every
planned form's forward and backward bytes sent per rank, peak activation
memory, predicted step time and tokens/s, and marks the winner (the
fastest form that fits). Bytes and peaks are exact (the closed forms and
the count-only run); times are the plan's prediction on its profile
(docs/planning.md). docs/paper-comparison.md, section 9, is its output.

  python3 scripts/strategy_table.py build/laga --preset deepseek-v3 \\
      --seq 32768,131072 --sp 8,64 --profile h100 --overlap both
"""
import json
import os
import subprocess
import sys
import tempfile


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    laga, args = argv[1], argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        r = subprocess.run([laga, "plan", "--quiet", "--json", out] + args, capture_output=True,
                           text=True)
        if r.returncode != 0:
            sys.exit(f"laga plan exited {r.returncode}: {r.stderr.strip()}")
        with open(out) as f:
            plan = json.load(f)
    print(f"`laga plan {' '.join(args)}` ({plan['profile']}, {plan['dtype']} with "
          f"{plan['grad_reduce']} gradients, "
          f"{plan['attention']} attention, batch {plan['batch']}); GB = 10^9 bytes\n")
    print("| S | P | form | fwd GB/rank | bwd GB/rank | peak act GB | step ms | tokens/s | |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = {}
    for p in plan["plans"]:
        cases.setdefault((p["seq"], p["sp"]), []).append(p)
    for (seq, sp), plans in cases.items():
        fitting = [p for p in plans if p["fits"]]
        best = max(fitting, key=lambda p: p["predicted_tokens_per_s"]) if fitting else None
        for p in plans:
            mark = "**winner**" if p is best else ("does not fit" if not p["fits"] else "")
            print(f"| {seq // 1024}k | {sp} | {p['form']} | {p['bytes_sent_forward'] / 1e9:.3f} | "
                  f"{p['bytes_sent_backward'] / 1e9:.3f} | {p['peak_activation_bytes'] / 1e9:.3f} | "
                  f"{p['predicted_step_s'] * 1e3:.2f} | {p['predicted_tokens_per_s']:.4g} | {mark} |")


if __name__ == "__main__":
    main(sys.argv)
