#!/usr/bin/env python3
"""One rule per kind of input, on every command (issue 54, P, S, T and F):

    test_cli_input_rules.py LAGA_BINARY SCRATCH_DIR CASE

Cases:
  reals      every real-valued option reads decimal numbers only: hex floats
             (--lr 0x10 trained at 16), inf, nan, spaces, 1e999 and 1e-999
             are refused naming the option; decimal spellings run
  lists      every comma list refuses an empty item anywhere (--sp 2, ran
             while --sp 1,,2 was refused) and an item given twice
  integers   every integer option's refusal names its whole range: a seed of
             2^64-1 runs, 2^64 is refused as beyond [0, 2^64-1] (it was "not a
             whole number"), and a value past an int option's type is refused
             naming the range, never CLI11's "Could not convert"
  parse      CLI11's own messages (a flag given a value, a value missing, an
             option twice, an unknown option or argument) are said in laga's
             words
  config     a config value of absurd magnitude is refused at load naming
             its key (route_scale 1e300 trained until the gate's input was
             blamed)
  ignored    an option that would change nothing in its combination is
             refused saying why (--log-expert-load on a dense model, forward
             --seq beside --input, plan --layers past the model's)
  tiny_rows  forward on an input of magnitude 1e-30 (the latent's rows below
             5e-23 came out of RMSNorm exactly 0): fp32 and bf16 agree with
             float64, and the output is not 0
Only the standard library, so any python3 runs it.
"""
import json
import os
import struct
import subprocess
import sys

from test_cli_options import safetensors, write  # the same files, written one way

PREFIX = "laga: error: "
# CLI11's words, which must never reach the user.
CLI11_WORDS = ("Could not convert", "required but received", "was not expected",
               " required FLOAT", " required INT", " required TEXT", "Should be true/false")
failures = []


def run(laga, args, timeout=120):
    return subprocess.run([laga] + args, capture_output=True, text=True, timeout=timeout)


def expect_error(laga, args, *needles):
    """Exit 2, one laga error line holding every needle, no CLI11 words."""
    try:
        p = run(laga, args)
    except subprocess.TimeoutExpired:
        failures.append(f"laga {' '.join(args)}: still running after 120 s")
        return
    err = p.stderr.strip()
    lines = [l for l in err.splitlines() if l.startswith(PREFIX)]
    line = lines[0] if lines else ""
    ok = (p.returncode == 2 and len(lines) == 1 and all(n in line for n in needles)
          and not any(w in err for w in CLI11_WORDS))
    print(("ok:   " if ok else "FAIL: ") + f"laga {' '.join(args)} -> {p.returncode}: {line[:160]}")
    if not ok:
        failures.append(f"laga {' '.join(args)}: exit {p.returncode}, wanted 2 and {needles!r} "
                        f"in one line:\n{err[:800]}")


def expect_ok(laga, args, timeout=300):
    p = run(laga, args, timeout=timeout)
    ok = p.returncode == 0
    print(("ok:   " if ok else "FAIL: ") + f"laga {' '.join(args)} -> {p.returncode}")
    if not ok:
        failures.append(f"laga {' '.join(args)}: exit {p.returncode}:\n{p.stderr[-800:]}")
    return p


TRAIN = ["train", "--d-model", "32", "--heads", "2", "--layers", "1", "--vocab", "64",
         "--seq", "16", "--steps", "1", "--quiet"]
PLAN = ["plan", "--preset", "tiny", "--profile", "h100", "--quiet"]
FORWARD = ["forward", "--preset", "tiny", "--seq", "8"]
VERIFY_BASE = ["verify", "--preset", "tiny", "--seq", "8"]
VERIFY = VERIFY_BASE + ["--forms", "explicit,laga"]
COMPARE_BASE = ["compare", "--preset", "tiny", "--seq", "8", "--sp", "2", "--steps", "1",
                "--warmup", "0", "--quiet"]
COMPARE = COMPARE_BASE + ["--forms", "explicit"]

REAL_OPTIONS = [(TRAIN, o) for o in ("--lr", "--beta1", "--beta2", "--eps", "--weight-decay",
                                     "--clip", "--min-lr")] + [(VERIFY, "--tol")]
NOT_DECIMAL = ["0x10", "0X1p-4", "0x.8", "inf", "-inf", "Infinity", "nan", "NAN", " 0.1", "0.1 ",
               "1e999", "1e-999", "1e", ".", "-", "0.1f", "1_0", "1,5", "+0.5", "0.5.1", ""]


def case_reals(laga, scratch):
    for fixed, option in REAL_OPTIONS:
        for value in NOT_DECIMAL:
            expect_error(laga, fixed + [option, value], f"{option}: '{value}' is not a finite "
                         "number in", "decimal only")
    # --link reads its two numbers by the same rule.
    for value in ("0x10", "inf", "25,0x5", "25,nan", "1e999", "25,"):
        expect_error(laga, COMPARE + ["--link", value], "--link", "is not a finite number")
        expect_error(laga, PLAN + ["--link", value], "--link", "is not a finite number")
    # Decimal spellings run (--lr .5e-3 trains at 5e-4).
    for value in (".5e-3", "5.E-4", "0.0005", "5e-4"):
        log = os.path.join(scratch, "lr.jsonl")
        p = expect_ok(laga, TRAIN + ["--lr", value, "--log", log])
        if p.returncode == 0:
            lr = json.loads(open(log).readline())["lr"]
            if abs(lr - 5e-4) > 1e-12:
                failures.append(f"--lr {value}: the log's lr is {lr}, not 5e-4")
    expect_ok(laga, VERIFY + ["--tol", "1E-4"])


def case_lists(laga, scratch):
    lists = [(PLAN, "--sp", "1,2"), (PLAN, "--seq", "512,1024"), (PLAN, "--forms", "laga,explicit"),
             (VERIFY, "--sp", "1,2"), (VERIFY_BASE, "--forms", "explicit,laga"),
             (["plan", "--model", "deepseek-v3", "--profile", "h200", "--sp", "8", "--quiet"],
              "--dp", "1,2")]
    for fixed, option, good in lists:
        a, b = good.split(",")
        for bad, where in ((f"{a},", "after the last comma"), (f",{a}", "before the first comma"),
                           (f"{a},,{b}", "between two commas"), (",", "before the first comma")):
            expect_error(laga, fixed + [option, bad], f"{option}: '{bad}' has an empty item",
                         where)
        expect_error(laga, fixed + [option, f"{a},{b},{a}"], option, "appears twice")
    expect_error(laga, COMPARE_BASE + ["--forms", "explicit,"],
                 "--forms: 'explicit,' has an empty item")
    expect_error(laga, TRAIN + ["--allow-change", "lr,"], "--allow-change: 'lr,' has an empty item")
    expect_error(laga, TRAIN + ["--allow-change", ""], "an empty --allow-change allows nothing")
    expect_ok(laga, PLAN + ["--sp", "1,2", "--seq", "512,1024", "--forms", "laga,explicit"])


# (command, option, its type's largest value)
INT_OPTIONS = [
    (TRAIN, "--seed", 2**64 - 1), (TRAIN, "--sp", 2**31 - 1), (TRAIN, "--comm-timeout", 2**31 - 1),
    (TRAIN, "--head-groups", 2**31 - 1), (TRAIN, "--ep", 2**31 - 1), (TRAIN, "--steps", 2**63 - 1),
    (TRAIN, "--perturb-reductions", 2**64 - 1), (TRAIN, "--pack-eos", 2**63 - 1),
    (FORWARD, "--layer", 2**31 - 1), (FORWARD, "--sp", 2**31 - 1), (FORWARD, "--seed", 2**64 - 1),
    (FORWARD, "--head-groups", 2**31 - 1), (FORWARD, "--batch", 2**63 - 1),
    (VERIFY, "--batch", 2**63 - 1), (VERIFY, "--seq", 2**63 - 1), (VERIFY, "--seed", 2**64 - 1),
    (COMPARE, "--sp", 2**31 - 1), (COMPARE, "--steps", 2**31 - 1), (COMPARE, "--warmup", 2**31 - 1),
    (COMPARE, "--rank-only", 2**31 - 1), (COMPARE, "--seed", 2**64 - 1),
    (PLAN, "--nodes", 2**31 - 1), (PLAN, "--batch", 2**63 - 1), (PLAN, "--layers", 2**63 - 1),
    (PLAN, "--micro-batches", 2**63 - 1),
]


def case_integers(laga, scratch):
    for fixed, option, most in INT_OPTIONS:
        for value in (str(most + 1), str(10**30), "-" + str(10**30)):
            expect_error(laga, fixed + [option, value],
                         f"{option}: '{value}' is not a whole number >=", f"and <= {most}")
    # The largest seed is a seed.
    expect_ok(laga, FORWARD + ["--seed", str(2**64 - 1)])
    expect_ok(laga, TRAIN + ["--seed", str(2**64 - 1)])
    # --doc-lens' lengths name theirs (at most --seq).
    expect_error(laga, FORWARD + ["--doc-lens", "3," + str(10**20)],
                 f"--doc-lens: '{10**20}' is not a whole number >= 1 and <= 8")
    # Plan's lists name their range too.
    expect_error(laga, PLAN + ["--sp", "4294967296"], "'4294967296' is not a whole number >= 1",
                 "and <= 2147483647")


def case_parse(laga, scratch):
    expect_error(laga, FORWARD + ["--backward=maybe"], "--backward is a flag and takes no value",
                 "'maybe'")
    expect_error(laga, TRAIN + ["--quiet=loud"], "--quiet is a flag and takes no value")
    for fixed, option in ((TRAIN, "--lr"), (TRAIN, "--schedule"), (PLAN, "--profile"),
                          (FORWARD, "--dtype"), (COMPARE, "--seed")):
        expect_error(laga, fixed + [option], f"{option} needs a value after it")
    expect_error(laga, TRAIN + ["--warmup", "1", "--warmup", "2"], "--warmup is given 2 times",
                 "give it once")
    expect_error(laga, TRAIN + ["--bogus"], "'--bogus' is not an option of laga train")
    expect_error(laga, TRAIN + ["extra"], "unexpected argument 'extra'")
    expect_error(laga, PLAN + ["-x"], "'-x' is not an option of laga plan")
    expect_error(laga, TRAIN + ["---lr", "1"], "'---lr' is not an option of laga train")
    for fixed, option, value, choices in ((TRAIN, "--schedule", "linear", "constant, cosine"),
                                          (COMPARE, "--attention", "fast", "eager, flash"),
                                          (PLAN, "--overlap", "x", "off, on, both")):
        expect_error(laga, fixed + [option, value], f"{option}: '{value}' is not one of {choices}")


def case_config(laga, scratch):
    moe = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "assets",
                                      "moe_tiny.json")))
    moe_args = ["train", "--seq", "16", "--steps", "1", "--quiet"]
    # (key, value, words of the refusal)
    hostile = [("routed_scaling_factor", 1e300, "routed_scaling_factor (route_scale) 1e+300"),
               ("routed_scaling_factor", 1e-300, "routed_scaling_factor (route_scale) 1e-300"),
               ("routed_scaling_factor", 1e4, "must be in [0.001, 1000]"),
               ("bias_update_speed", 1e300, "bias_update_speed 1e+300 is beyond 1"),
               ("rms_norm_eps", 1e300, "'rms_norm_eps' 1e+300 must be in [1e-30, 1)"),
               ("rms_norm_eps", 1e-300, "'rms_norm_eps' 1e-300 must be in [1e-30, 1)"),
               ("rope_theta", 1e300, "rope_theta 1e+300 is beyond 1e+12")]
    for key, value, words in hostile:
        cfg = dict(moe)
        cfg[key] = value
        path = os.path.join(scratch, f"moe_{key}_{value}.json")
        write(path, json.dumps(cfg))
        expect_error(laga, moe_args + ["--config", path], words)
    # ModelArgs spells the scale route_scale.
    args = {"dim": 64, "n_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 0, "n_layers": 2,
            "vocab_size": 256, "inter_dim": 128, "n_routed_experts": 4, "n_activated_experts": 2,
            "moe_inter_dim": 32, "score_func": "sigmoid", "route_scale": 1e300}
    path = os.path.join(scratch, "modelargs_route_scale.json")
    write(path, json.dumps(args))
    expect_error(laga, moe_args + ["--config", path], "route_scale", "1e+300")
    # The attention block's keys, through forward.
    mla = {"dim": 48, "n_heads": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 4, "v_head_dim": 6, "q_lora_rank": 0}
    for key, value, words in (("rope_theta", 1e300, "rope_theta 1e+300"),
                              ("norm_eps", 1e-300, "norm_eps 1e-300 must be in [1e-30, 1)"),
                              ("mscale", 1e300, "mscale 1e+300 is beyond 100"),
                              ("beta_fast", 1e300, "beta_fast 1e+300 is beyond 1e+06")):
        cfg = dict(mla, **{key: value})
        if key in ("mscale", "beta_fast"):  # YaRN on: max_seq_len past original_seq_len
            cfg.update({"original_seq_len": 64, "max_seq_len": 256, "rope_factor": 4})
        path = os.path.join(scratch, f"mla_{key}.json")
        write(path, json.dumps(cfg))
        expect_error(laga, ["forward", "--config", path, "--seq", "8"], words)


def read_safetensors(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    info = header[name]
    a, b = info["data_offsets"]
    fmt = {"F32": "f", "F64": "d"}[info["dtype"]]
    size = struct.calcsize(fmt)
    return list(struct.unpack(f"<{(b - a) // size}{fmt}", blob[a:b]))


def case_ignored(laga, scratch):
    moe = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "assets", "moe_tiny.json")
    log = os.path.join(scratch, "log.jsonl")
    expect_error(laga, TRAIN + ["--log-expert-load"], "--log-expert-load", "give --log FILE")
    expect_error(laga, TRAIN + ["--log-expert-load", "--log", log], "--log-expert-load",
                 "the model is dense")
    cfg = json.load(open(moe))
    cfg["bias_update_speed"] = 0
    no_balance = os.path.join(scratch, "moe_no_balance.json")
    write(no_balance, json.dumps(cfg))
    expect_error(laga, ["train", "--config", no_balance, "--seq", "16", "--steps", "1", "--quiet",
                        "--log", log, "--log-expert-load"], "bias_update_speed is 0")
    expect_ok(laga, ["train", "--config", moe, "--seq", "16", "--steps", "1", "--quiet", "--log",
                     log, "--log-expert-load"])
    expect_error(laga, TRAIN + ["--min-lr", "0.0001"], "--min-lr", "--schedule is constant")
    expect_ok(laga, TRAIN + ["--min-lr", "0.0001", "--schedule", "cosine"])
    expect_error(laga, TRAIN + ["--data-dtype", "u16"], "--data-dtype", "there is none")
    expect_error(laga, TRAIN + ["--val-batches", "2"], "--val-batches", "no --val-data")
    expect_error(laga, TRAIN + ["--perturb-reductions", "5", "--sp", "2"], "--perturb-reductions",
                 "at --sp 2 every order gives the same bits")
    ck = os.path.join(scratch, "ck")
    expect_error(laga, TRAIN + ["--save-every", "2", "--checkpoint", ck],
                 "--save-every 2 never comes within --steps 1")
    if os.path.exists(ck) and os.listdir(ck):
        failures.append(f"--save-every past --steps: '{ck}' was written")
    val = os.path.join(scratch, "val.u16")
    write(val, struct.pack("<512H", *[i % 64 for i in range(512)]), "wb")  # ids below --vocab
    expect_error(laga, TRAIN + ["--val-data", val, "--val-every", "3"],
                 "--val-every 3 never comes within --steps 1")
    x = os.path.join(scratch, "x.safetensors")
    safetensors(x, {"x": ([1, 8, 48], [0.25] * (8 * 48))})
    for option, value in (("--seq", "16"), ("--batch", "2")):
        expect_error(laga, ["forward", "--preset", "tiny", "--input", x, option, value], option,
                     "sizes the random input", f"drop {option}")
    expect_ok(laga, ["forward", "--preset", "tiny", "--input", x, "--seed", "3"])
    w = os.path.join(scratch, "w.safetensors")  # the tiny preset's weights, constant
    shapes = {"wq.weight": [4 * 12, 48], "wkv_a.weight": [24 + 4, 48], "kv_norm.weight": [24],
              "wkv_b.weight": [4 * (8 + 6), 24], "wo.weight": [48, 4 * 6]}
    tensors = {}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        tensors[name] = (shape, [1.0 if name.endswith("norm.weight") else 0.01] * n)
    safetensors(w, tensors)
    expect_ok(laga, ["forward", "--preset", "tiny", "--weights", w, "--seq", "8"])
    expect_error(laga, ["forward", "--preset", "tiny", "--weights", w, "--input", x, "--seed", "3"],
                 "--seed draws the random weights and input")
    expect_error(laga, FORWARD + ["--layer", "2"], "--layer", "no --weights")
    expect_error(laga, ["plan", "--model", "deepseek-v3", "--profile", "h200", "--sp", "8",
                        "--layers", "1000", "--quiet"], "--layers 1000 is more than the 61 layers")
    expect_ok(laga, ["plan", "--model", "deepseek-v3", "--profile", "h200", "--sp", "8",
                     "--layers", "3", "--seq", "1024", "--quiet"])
    dense = {k: v for k, v in json.load(open(moe)).items()
             if k not in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                          "scoring_func", "topk_method", "norm_topk_prob",
                          "first_k_dense_replace", "moe_layer_freq", "bias_update_speed")}
    dense_path = os.path.join(scratch, "dense.json")
    write(dense_path, json.dumps(dense))
    expect_error(laga, ["plan", "--model", dense_path, "--profile", "h100", "--sp", "2", "--seq",
                        "512", "--ep", "2", "--quiet"], "--ep", "is dense")
    for option, value in (("--steps", "3"), ("--warmup", "1"), ("--seed", "4")):
        expect_error(laga, ["compare", "--preset", "tiny", "--seq", "8", "--sp", "2",
                            "--count-only", option, value], option, "--count-only runs no kernel")


def case_tiny_rows(laga, scratch):
    # x of magnitude 1e-30: the latent's rows are ~1e-31, where the old
    # RMSNorm's eps / m^2 overflowed and c_hat came out exactly 0.
    import random
    rng = random.Random(54)
    B, S, D = 1, 8, 48
    for scale in (1e-30, 1e-25):
        x = os.path.join(scratch, f"x_{scale}.safetensors")
        safetensors(x, {"x": ([B, S, D], [rng.uniform(-1, 1) * scale for _ in range(B * S * D)])})
        outs = {}
        for dtype in ("float64", "float32", "bf16"):
            out = os.path.join(scratch, f"out_{scale}_{dtype}.safetensors")
            p = expect_ok(laga, ["forward", "--preset", "tiny", "--input", x, "--dtype", dtype,
                                 "--output", out, "--backward"])
            if p.returncode == 0:
                outs[dtype] = {n: read_safetensors(out, n) for n in ("out", "dx")}
        if "float64" not in outs:
            continue
        for dtype, bound in (("float32", 1e-4), ("bf16", 5e-2)):
            if dtype not in outs:
                continue
            for name in ("out", "dx"):
                ref, got = outs["float64"][name], outs[dtype][name]
                big = max(abs(v) for v in ref)
                err = max(abs(a - b) for a, b in zip(got, ref))
                ok = big > 0 and err <= bound * big
                print(("ok:   " if ok else "FAIL: ") +
                      f"x ~ {scale}: {dtype} {name} max|ref| {big:.3e}, max err {err:.3e}")
                if not ok:
                    failures.append(f"x ~ {scale}: {dtype} '{name}' differs from float64 by "
                                    f"{err:.3e} of max {big:.3e} (bound {bound})")


def main():
    laga, scratch, case = sys.argv[1], sys.argv[2], sys.argv[3]
    scratch = os.path.join(scratch, "cli_input_rules_" + case)
    os.makedirs(scratch, exist_ok=True)
    {"reals": case_reals, "lists": case_lists, "integers": case_integers, "parse": case_parse,
     "config": case_config, "ignored": case_ignored, "tiny_rows": case_tiny_rows}[case](laga,
                                                                                      scratch)
    if failures:
        sys.exit(f"{len(failures)} failed:\n" + "\n".join(failures))
    print("all ok")


if __name__ == "__main__":
    main()
