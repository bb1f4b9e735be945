#!/usr/bin/env python3
"""DSA's sequence-parallel forms side by side, as markdown (docs/planning.md, "DSA").

Runs `laga plan` with the arguments given (a DSA preset or config) and
prints, per (S, P), every DSA form's forward + backward bytes sent per rank
(the gradient all-reduce apart: the same for every form), of those the
indexer's (index keys, weights, top-k indices, KL target), its peak
activation memory, the slowest rank's indexer TFLOPs, the predicted step
and tokens/s, marking the winner (the fastest form that fits); then, per P,
which form wins at each S. Every number is computed by `laga plan` from the
closed forms of mla/dsa_model.hpp; the times are its prediction on the
profile.

  python3 scripts/dsa_table.py build/laga --preset deepseek-v3.2 \\
      --seq 32768,65536,131072 --sp 8,16,32,64 --profile h100 --seq-layout zigzag
"""
import json
import subprocess
import sys


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    laga, args = argv[1], argv[2:]
    r = subprocess.run([laga, "plan", "--quiet", "--json", "-"] + args, capture_output=True,
                       text=True)
    if r.returncode != 0:
        sys.exit(f"laga plan exited {r.returncode}: {r.stderr.strip()}")
    plan = json.loads(r.stdout)
    if "dsa" not in plan:
        sys.exit("not a DSA plan: give a preset or config with index_n_heads, index_head_dim "
                 "and index_topk (--preset deepseek-v3.2, --preset glm-5-like)")
    d = plan["dsa"]
    print(f"`laga plan {' '.join(args)}` ({plan['profile']}, {plan['dtype']} with "
          f"{plan['grad_reduce']} gradients, {plan['seq_layout']} shards, batch {plan['batch']}; "
          f"indexer {d['index_n_heads']} heads x {d['index_head_dim']}, top-{d['index_topk']}); "
          "GB = 10^9 bytes\n")
    print("| S | P | form | fwd+bwd GB/rank | of it index GB | peak act GB | indexer TFLOP "
          "| step ms | tokens/s | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = {}
    for p in plan["plans"]:
        cases.setdefault((p["seq"], p["sp"]), []).append(p)
    winners = {(c["seq"], c["sp"]): c["winner"] for c in plan["cases"]}
    for (S, P), forms in cases.items():
        for p in forms:
            mark = "**winner**" if p["form"] == winners[(S, P)] else ("" if p["fits"] else "does not fit")
            print(f"| {S} | {P} | {p['form']} | "
                  f"{(p['bytes_sent_forward'] + p['bytes_sent_backward']) / 1e9:.3f} | "
                  f"{p['index_bytes_sent'] / 1e9:.3f} | {p['peak_activation_bytes'] / 1e9:.3f} | "
                  f"{p['indexer_flops'] / 1e12:.2f} | {p['predicted_step_s'] * 1e3:.2f} | "
                  f"{p['predicted_tokens_per_s']:.4g} | {mark} |")
    seqs = sorted({S for S, _ in cases})
    sps = sorted({P for _, P in cases})
    print("\nThe winner at each (S, P):\n")
    print("| P \\ S | " + " | ".join(str(S) for S in seqs) + " |")
    print("|---|" + "---|" * len(seqs))
    for P in sps:
        print(f"| {P} | " + " | ".join(str(winners.get((S, P))) for S in seqs) + " |")


if __name__ == "__main__":
    main(sys.argv)
