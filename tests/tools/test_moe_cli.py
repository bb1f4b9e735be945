#!/usr/bin/python3
"""`laga moe` (issue 55 item 3) against DeepSeek's MoE in PyTorch autograd.

    test_moe_cli.py LAGA REFERENCE_DIR SCRATCH [MPIEXEC]

REFERENCE_DIR holds python/torch_reference_moe.py's cases (the fixture
model_torch_moe_data writes them): DeepSeek-V3's Gate (sigmoid, a bias, the
top-2 group sum) and DeepSeek-V2's (softmax, no bias, greedy or groups scored
by their maximum), each with x, dout, out, dx, every gradient and the experts
chosen, float64. For each case `laga moe --dtype float64 --backward` must
choose the same experts and give out, dx and every gradient within 1e-12
relative (1e-13 absolute), with its experts on 1 to 4 ranks; float32 and bf16
within their bounds; with MPIEXEC, 3 MPI processes write the same bytes as 3
in-process ranks. Then the refusals, each a message naming what is wrong.
"""
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import safetensors_io  # noqa: E402

CASES = ["grouped", "ungrouped_unnormalised", "v2_grouped", "v2_greedy", "v2_greedy_normalised"]


def fail(what):
    sys.exit("FAILED: " + what)


def run(laga, args, expect_ok=True, timeout=120, launcher=None):
    cmd = (launcher or []) + [laga, "moe"] + args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(cmd)} did not end within {timeout} s")
    if expect_ok and p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
    if not expect_ok and p.returncode == 0:
        fail(f"{' '.join(cmd)} was accepted")
    return p


def close(name, got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        fail(f"{name}: shape {got.shape}, want {want.shape}")
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    if bad.any():
        i = int(np.argmax(err - atol - rtol * np.abs(want)))
        fail(f"{name}: {int(bad.sum())} of {got.size} elements off (worst at {i}: "
             f"{got.flat[i]!r} vs {want.flat[i]!r})")


def prepare(ref_dir, scratch, case):
    tensors, meta = safetensors_io.load_file(os.path.join(ref_dir, f"moe_{case}.safetensors"))
    cfg = json.loads(meta["config"])
    cfg["hidden_size"] = int(meta["dim"])
    config = os.path.join(scratch, f"{case}.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    inp = os.path.join(scratch, f"{case}_in.safetensors")
    safetensors_io.save_file({"x": tensors["x"], "dout": tensors["dout"]}, inp)
    return tensors, config, inp


def check_case(laga, ref_dir, scratch, case):
    ref, config, inp = prepare(ref_dir, scratch, case)
    weights = os.path.join(ref_dir, f"moe_{case}.safetensors")
    grads = sorted(n for n in ref if n.startswith("grad."))
    for ep in (1, 2, 3, 4):
        out = os.path.join(scratch, f"{case}_ep{ep}.safetensors")
        run(laga, ["--config", config, "--weights", weights, "--input", inp, "--backward",
                   "--dtype", "float64", "--ep", str(ep), "--output", out])
        got, meta = safetensors_io.load_file(out)
        what = f"{case} --ep {ep}"
        if not np.array_equal(got["expert_ids"], ref["indices"].astype(np.int64)):
            fail(f"{what}: experts chosen differ from DeepSeek's gate")
        for n in ["out", "dx"] + grads:
            close(f"{what} {n}", got[n], ref[n], 1e-12, 1e-13)
        if sorted(n for n in got if n.startswith("grad.")) != grads:
            fail(f"{what}: gradients {sorted(got)} are not the reference's {grads}")
        if meta.get("dtype") != "float64" or meta.get("ep") != str(ep):
            fail(f"{what}: metadata {meta}")
    for dtype, rtol, atol in (("float32", 1e-4, 1e-5), ("bf16", 6e-2, 2e-2)):
        out = os.path.join(scratch, f"{case}_{dtype}.safetensors")
        run(laga, ["--config", config, "--weights", weights, "--input", inp, "--backward",
                   "--dtype", dtype, "--ep", "2", "--output", out])
        got, _ = safetensors_io.load_file(out)
        # Rounded gate logits may flip a choice between two near-equal
        # experts (a different, equally valid routing: not an error), so the
        # bound holds on the tokens routed as the reference routes them, and
        # those must be nearly all of them.
        same = (got["expert_ids"] == ref["indices"].astype(np.int64)).all(axis=1)
        if same.mean() < 0.9:
            fail(f"{case} {dtype}: {int((~same).sum())} of {same.size} tokens routed otherwise")
        close(f"{case} {dtype} out (tokens routed as the reference)", got["out"][same],
              ref["out"][same], rtol, atol)
    return config, inp, weights


def check_mpi(laga, mpiexec, scratch, config, inp, weights):
    local = os.path.join(scratch, "local3.safetensors")
    mpi = os.path.join(scratch, "mpi3.safetensors")
    common = ["--config", config, "--weights", weights, "--input", inp, "--backward", "--dtype",
              "float64", "--ep", "3"]
    run(laga, common + ["--output", local])
    run(laga, common + ["--comm", "mpi", "--output", mpi],
        launcher=[mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "3"])
    a, _ = safetensors_io.load_file(local)
    b, _ = safetensors_io.load_file(mpi)
    for n in a:
        if not np.array_equal(a[n], b[n]):
            fail(f"--comm mpi at 3 processes: '{n}' differs from 3 in-process ranks")


def refuses(laga, args, words):
    p = run(laga, args, expect_ok=False)
    if words not in p.stderr:
        fail(f"laga moe {' '.join(args)}: expected a message with {words!r}, got:\n{p.stderr}")
    if "Traceback" in p.stderr or "terminate called" in p.stderr:
        fail(f"laga moe {' '.join(args)} crashed:\n{p.stderr}")


def check_refusals(laga, ref_dir, scratch):
    ref, config, _ = prepare(ref_dir, scratch, "v2_grouped")
    weights = os.path.join(ref_dir, "moe_v2_grouped.safetensors")
    x_only = os.path.join(scratch, "x_only.safetensors")
    safetensors_io.save_file({"x": ref["x"]}, x_only)
    # A dense config.
    with open(config) as f:
        cfg = json.load(f)
    dense = os.path.join(scratch, "dense.json")
    with open(dense, "w") as f:
        json.dump(dict(cfg, n_routed_experts=0), f)
    refuses(laga, ["--config", dense, "--weights", weights, "--input", x_only],
            "has no routed experts")
    # A bias on V2's gate, which has none.
    biased = dict(ref)
    biased["gate.bias"] = np.full_like(ref["gate.bias"], 0.5)
    wb = os.path.join(scratch, "biased.safetensors")
    safetensors_io.save_file(biased, wb)
    refuses(laga, ["--config", config, "--weights", wb, "--input", x_only],
            "'gate.bias' gives expert 0 the bias 0.5, but the config's gate (topk_method "
            "'group_limited_greedy', DeepSeek-V2's) has no bias")
    # --backward without dout.
    refuses(laga, ["--config", config, "--weights", weights, "--input", x_only, "--backward"],
            "--backward needs 'dout'")
    # x of the wrong width.
    narrow = os.path.join(scratch, "narrow.safetensors")
    safetensors_io.save_file({"x": ref["x"][:, :5].copy()}, narrow)
    refuses(laga, ["--config", config, "--weights", weights, "--input", narrow],
            "its last dimension the config's width")
    # Whole-model names without --layer; then with it, both namings read.
    hf = {f"model.layers.3.mlp.{n.replace('.w1.', '.gate_proj.').replace('.w2.', '.down_proj.').replace('.w3.', '.up_proj.')}": t
          for n, t in ref.items() if n.endswith(".weight") and not n.startswith("grad.")}
    ds = {f"layers.3.ffn.{n}": t for n, t in ref.items()
          if n.endswith(".weight") and not n.startswith("grad.")}
    for name, tensors in (("hf", hf), ("deepseek", ds)):
        path = os.path.join(scratch, f"{name}_names.safetensors")
        safetensors_io.save_file(tensors, path)
        refuses(laga, ["--config", config, "--weights", path, "--input", x_only],
                "give --layer L")
        out = os.path.join(scratch, f"{name}_out.safetensors")
        run(laga, ["--config", config, "--weights", path, "--input", x_only, "--layer", "3",
                   "--dtype", "float64", "--output", out])
        got, _ = safetensors_io.load_file(out)
        close(f"{name} names out", got["out"], ref["out"], 1e-12, 1e-13)
    # More ranks than tokens.
    refuses(laga, ["--config", config, "--weights", weights, "--input", x_only, "--ep", "100"],
            "fewer than --ep 100")


def main():
    laga, ref_dir, scratch = sys.argv[1:4]
    mpiexec = sys.argv[4] if len(sys.argv) > 4 else None
    os.makedirs(scratch, exist_ok=True)
    for case in CASES:
        if not os.path.exists(os.path.join(ref_dir, f"moe_{case}.safetensors")):
            fail(f"{ref_dir}/moe_{case}.safetensors is missing: ctest runs model_torch_moe_data "
                 "first (python/torch_reference_moe.py)")
    for case in CASES:
        config, inp, weights = check_case(laga, ref_dir, scratch, case)
    check_refusals(laga, ref_dir, scratch)
    # `laga forward` on an MoE config says the MoE is not run, never passes
    # over its keys in silence.
    moe_tiny = os.path.join(HERE, "..", "..", "docs", "assets", "moe_tiny.json")
    p = subprocess.run([laga, "forward", "--config", moe_tiny, "--seq", "8"], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0 or "the config's MoE (E=8" not in p.stderr or "laga moe" not in p.stderr:
        fail(f"laga forward on an MoE config:\n{p.stderr}")
    if mpiexec:
        check_mpi(laga, mpiexec, scratch, config, inp, weights)
    print(f"test_moe_cli.py: {len(CASES)} cases at --ep 1-4 (float64, float32, bf16), refusals"
          + (", MPI at 3 processes" if mpiexec else "") + ": ok")


if __name__ == "__main__":
    main()
