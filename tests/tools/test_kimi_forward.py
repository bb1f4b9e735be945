#!/usr/bin/python3
"""`laga forward` on Kimi K3's gated NoPE MLA, end to end (docs/forms.md,
"Gated NoPE MLA"; docs/configs.md).

Usage: test_kimi_forward.py LAGA KIMI_REF_DIR WORKDIR

KIMI_REF_DIR holds python/kimi_reference.py's cases (float64 PyTorch
implementation of Kimi's attention; fixture mla_kimi_reference_data). For
each case: its config (Kimi's config.json keys) to a file, then `laga
forward --dtype fp64 --backward` with the case as --weights (Kimi's
Hugging Face names, g_proj among them) and --input, for several forms at P
1 and 3; out, dx and every gradient must equal the reference within 1e-12 of
its largest value. Then the refusals, exit 2 and one "laga: error:" line
each: gated weights without g_proj; g_proj for a config with the gate off;
a non-boolean mla_use_nope.
"""

import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import safetensors_io  # noqa: E402

PREFIX = "model.layers.0.self_attn."
HF = {"wq.weight": "q_proj.weight", "wq_a.weight": "q_a_proj.weight",
      "q_norm.weight": "q_a_layernorm.weight", "wq_b.weight": "q_b_proj.weight",
      "wkv_a.weight": "kv_a_proj_with_mqa.weight", "kv_norm.weight": "kv_a_layernorm.weight",
      "wkv_b.weight": "kv_b_proj.weight", "wo.weight": "o_proj.weight",
      "wg.weight": "g_proj.weight"}


def laga(exe, args):
    return subprocess.run([exe] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120)


def refused(p, needle, what):
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("laga: error:")]
    if p.returncode != 2 or len(lines) != 1 or needle not in lines[0]:
        sys.exit(f"FAIL: {what}: want exit 2 and one 'laga: error:' line with '{needle}', got "
                 f"{p.returncode}: {p.stderr.strip()}")


def main():
    exe, ref_dir, work = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    worst, runs = 0.0, 0
    for case in ("k3_like", "rope0_rq0", "nogate"):
        path = os.path.join(ref_dir, f"case_{case}.safetensors")
        tensors, meta = safetensors_io.load_file(path)
        cfg = json.loads(meta["config"])
        cfg_path = os.path.join(work, f"kimi_{case}.json")
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
        for form, sp in (("explicit", "1"), ("laga", "3"), ("absorbed", "3"),
                         ("laga_fused", "3"), ("ring_latent", "3"), ("allgather_kv", "3")):
            out = os.path.join(work, f"out_{case}_{form}.safetensors")
            p = laga(exe, ["forward", "--config", cfg_path, "--weights", path, "--input", path,
                           "--output", out, "--backward", "--dtype", "fp64", "--form", form,
                           "--sp", sp])
            if p.returncode != 0:
                sys.exit(f"FAIL: {case} {form}: laga forward exited {p.returncode}: {p.stderr}")
            got, _ = safetensors_io.load_file(out)
            pairs = [("out", "out"), ("dx", "dx")]
            pairs += [("grad." + n, "grad." + PREFIX + hf) for n, hf in HF.items()
                      if "grad." + PREFIX + hf in tensors]
            if not cfg.get("mla_use_output_gate") == ("grad.wg.weight" in got):
                sys.exit(f"FAIL: {case} {form}: grad.wg.weight present = {'grad.wg.weight' in got}")
            for mine, theirs in pairs:
                a, b = np.asarray(got[mine], np.float64), np.asarray(tensors[theirs], np.float64)
                scale = float(np.max(np.abs(b)))
                err = float(np.max(np.abs(a.reshape(b.shape) - b))) / scale
                worst = max(worst, err)
                if not err <= 1e-12:
                    sys.exit(f"FAIL: {case} {form} P {sp}: {mine} differs from Kimi's by "
                             f"{err:.3e} of its largest value (> 1e-12)")
            runs += 1

    # Refusals. The gated case's weights without g_proj:
    tensors, meta = safetensors_io.load_file(os.path.join(ref_dir, "case_k3_like.safetensors"))
    cfg = json.loads(meta["config"])
    cfg_path = os.path.join(work, "kimi_refusal.json")
    no_gate_w = os.path.join(work, "no_g_proj.safetensors")
    safetensors_io.save_file({k: v for k, v in tensors.items() if "g_proj" not in k}, no_gate_w)
    common = ["--input", os.path.join(ref_dir, "case_k3_like.safetensors"), "--dtype", "fp64"]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    refused(laga(exe, ["forward", "--config", cfg_path, "--weights", no_gate_w] + common),
            "g_proj.weight", "gated config, weights without g_proj")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(dict(cfg, mla_use_output_gate=False), f)
    refused(laga(exe, ["forward", "--config", cfg_path, "--weights",
                       os.path.join(ref_dir, "case_k3_like.safetensors")] + common),
            "mla_use_output_gate is false", "g_proj for a config without the gate")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(dict(cfg, mla_use_nope="yes"), f)
    refused(laga(exe, ["forward", "--config", cfg_path, "--weights", no_gate_w] + common),
            "'mla_use_nope' must be true or false", "a non-boolean mla_use_nope")
    # `laga plan` at Kimi K3's attention dims (its config.json keys, under
    # text_config as Kimi ships them), dr 64 unrotated and dr 0: every form
    # planned, the latent forms sending less than explicit.
    k3 = {"model_type": "kimi_k3", "hidden_size": 7168, "num_attention_heads": 96,
          "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
          "mla_use_output_gate": True, "rope_scaling": None,
          "max_position_embeddings": 1048576}
    plans = 0
    for name, text in (("k3", {"text_config": k3}), ("k3 dr 0", dict(k3, qk_rope_head_dim=0))):
        cfg_path = os.path.join(work, "plan.json")
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(text, f)
        out = os.path.join(work, "plan-out.json")
        p = laga(exe, ["plan", "--config", cfg_path, "--seq", "32768", "--sp", "8",
                       "--profile", "h100", "--json", out])
        if p.returncode != 0:
            sys.exit(f"FAIL: laga plan on {name}: exited {p.returncode}: {p.stderr}")
        rows = {r["form"]: r for r in json.load(open(out, encoding="utf-8"))["plans"]}
        if len(rows) < 9 or not all(r["predicted_step_s"] > 0 for r in rows.values()):
            sys.exit(f"FAIL: laga plan on {name}: forms {sorted(rows)}")
        for latent in ("laga", "laga_fused", "ring_latent"):
            if not rows[latent]["bytes_sent_per_rank"] < rows["explicit"]["bytes_sent_per_rank"]:
                sys.exit(f"FAIL: laga plan on {name}: {latent} sends no less than explicit")
        plans += 1
    print(f"ok: {runs} laga forward runs equal Kimi's attention (worst {worst:.2e} of the "
          f"largest value); 3 refusals; {plans} plans at Kimi K3 dims")
    return 0


if __name__ == "__main__":
    sys.exit(main())
