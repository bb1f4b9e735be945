#!/usr/bin/env python3
"""`laga train --comm mpi --checkpoint` under mpirun: the lock and signals
(issue 54 V and M).

    mpi_train_checkpoint.py LAGA MPIEXEC SCRATCH CASE

Cases:
  lock_race    every rank but 0 starts its checks late (LAGA_TEST_STAGGER_MS,
               as on a loaded machine), so rank 0 holds the directory's lock
               when they look: the job trains and saves at np 2, 3 and 4
               (today's main: the late ranks found rank 0's fresh lock and
               refused their own job's directory as "in use"); three starts
               at np 4 without the hook too; a resume from an earlier step
               (rank 0 sets the later checkpoint aside); and a lock naming a live
               process of another run is still refused, by every rank
               within seconds
  save_signal  SIGTERM to a rank that does not write (np 2 and 3), while rank 0 writes a
               periodic save (frozen with SIGSTOP while the save's temporary
               exists): every rank stops with that save; latest.json and the
               log end at its step (today's main: one more step and save)
Only the standard library.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

TINY = ["--d-model", "32", "--heads", "4", "--layers", "1", "--vocab", "64", "--seq", "16",
        "--quiet"]
# A checkpoint of some 40 MB: its save takes long enough to be caught.
MID = ["--d-model", "256", "--heads", "8", "--layers", "4", "--vocab", "512", "--seq", "32",
       "--quiet"]


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def mpirun(mpiexec, np, laga, args, env=None, timeout=120):
    cmd = [mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(np), laga, "train",
           "--comm", "mpi", "--sp", str(np)] + args
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    except subprocess.TimeoutExpired:
        sys.exit(f"FAILED: {' '.join(cmd)} did not end within {timeout} s")


def latest_step(ck):
    with open(os.path.join(ck, "latest.json")) as f:
        return json.load(f)["step"]


def log_steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def case_lock_race(laga, mpiexec, scratch):
    runs = [(np, {"LAGA_TEST_STAGGER_MS": "1500"}) for np in (2, 3, 4)] + [(4, {})] * 3
    for k, (np, env) in enumerate(runs):
        ck = os.path.join(scratch, f"ck{k}")
        p = mpirun(mpiexec, np, laga, TINY + ["--steps", "2", "--checkpoint", ck], env)
        check(p.returncode == 0, f"np {np} {env}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        check(latest_step(ck) == 2, f"np {np}: latest.json")
        check(not os.path.exists(os.path.join(ck, "laga.lock")), f"np {np}: the lock outlived it")
    # A resume from an earlier step: rank 0 takes the lock and moves the
    # later checkpoint aside while the others start late.
    ck = os.path.join(scratch, "resumed")
    p = mpirun(mpiexec, 3, laga, TINY + ["--steps", "3", "--save-every", "1", "--checkpoint", ck],
               {"LAGA_TEST_STAGGER_MS": "1500"})
    check(p.returncode == 0 and latest_step(ck) == 3, f"np 3, three steps\n{p.stderr}")
    p = mpirun(mpiexec, 3, laga, TINY + ["--steps", "4", "--checkpoint", ck, "--resume",
                                         os.path.join(ck, "step-00000002.json")],
               {"LAGA_TEST_STAGGER_MS": "1500"})
    check(p.returncode == 0 and latest_step(ck) == 4, f"np 3, resumed from step 2\n{p.stderr}")
    check(os.path.exists(os.path.join(ck, "superseded-after-step-00000002", "step-00000003.json")),
          "step 3 set aside")
    # The lock of another run (a live process on this host) is still refused.
    ck = os.path.join(scratch, "held")
    os.makedirs(ck)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        with open(os.path.join(ck, "laga.lock"), "w") as f:
            f.write(f"pid {holder.pid} host {socket.gethostname()}\n")
        start = time.time()
        p = mpirun(mpiexec, 3, laga, TINY + ["--steps", "2", "--checkpoint", ck],
                   {"LAGA_TEST_STAGGER_MS": "500"}, timeout=60)
        out = p.stdout + p.stderr
        check(p.returncode != 0 and out.count(f"names pid {holder.pid}") >= 3,
              f"a lock of another run, every rank: exit {p.returncode}\n{out}")
        check(time.time() - start < 30, f"refused within seconds, not {time.time() - start:.0f} s")
        check(not os.path.exists(os.path.join(ck, "latest.json")), "nothing written")
    finally:
        holder.kill()


def saving_temporaries(ck):
    """(step, writer pid) of each save's temporary in ck (write_file_atomic's
    `<name>.tmp.<pid>.<n>`)."""
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if n.startswith("step-") and ".tmp." in n and n[5:13].isdigit():
            out.append((int(n[5:13]), int(n.split(".tmp.")[1].split(".")[0])))
    return out


def frozen(pid, timeout=10):
    """Waits until every thread of pid has stopped (SIGSTOP is asynchronous)."""
    end = time.time() + timeout
    while time.time() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.001)
    sys.exit(f"FAILED: rank (pid {pid}) did not stop within {timeout} s of SIGSTOP")


def ranks_of(laga, ck):
    """The pids of the laga processes writing ck (the ranks, not mpirun)."""
    exe = os.path.realpath(laga)
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.path.realpath(f"/proc/{pid}/exe") != exe:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if ck.encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            pass
    return out


def case_save_signal(laga, mpiexec, scratch):
    # np 2: the signal to rank 1; np 3: to one of the two ranks that do not write.
    for np in (2, 3):
        save_signal_at(laga, mpiexec, os.path.join(scratch, f"np{np}"), np)


def save_signal_at(laga, mpiexec, scratch, np):
    os.makedirs(scratch)
    ck, log = os.path.join(scratch, "ck"), os.path.join(scratch, "log.jsonl")
    err_path = os.path.join(scratch, "mpirun.err")
    cmd = [mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(np), laga, "train",
           "--comm", "mpi", "--sp", str(np)] + MID + ["--steps", "1000000", "--save-every", "2",
                                                       "--checkpoint", ck, "--log", log]
    with open(err_path, "w") as err_file:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        end, saving = time.time() + 240, None
        while saving is None:
            check(time.time() < end and p.poll() is None, "no save was caught in progress")
            found = saving_temporaries(ck)
            if not found:
                time.sleep(0.001)
                continue
            step, writer = found[0]
            try:
                os.kill(writer, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            frozen(writer)
            if (step, writer) not in saving_temporaries(ck):
                os.kill(writer, signal.SIGCONT)  # the save ended meanwhile
                continue
            others = sorted(r for r in ranks_of(laga, ck) if r != writer)
            check(len(others) == np - 1, f"the other ranks of {np}: {others}, writer {writer}")
            os.kill(others[-1], signal.SIGTERM)
            # Its handler has run once it says so (on mpirun's stderr).
            wait = time.time() + 30
            while "signal received" not in open(err_path).read():
                check(time.time() < wait, "the signalled rank did not acknowledge SIGTERM")
                time.sleep(0.01)
            saving = step
            os.kill(writer, signal.SIGCONT)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    err = open(err_path).read()
    check(rc != 0, f"mpirun exited 0 after a SIGTERM\n{err}")
    check(latest_step(ck) == saving and f"stopped by SIGTERM after step {saving} " in err,
          f"np {np}: SIGTERM to a rank that does not write, during the save of step {saving}: "
          f"latest.json names step {latest_step(ck)}\n{err[-3000:]}")
    check(log_steps(log) == list(range(1, saving + 1)), f"log: {log_steps(log)}, saved {saving}")


def main():
    laga, mpiexec, scratch, case = sys.argv[1:5]
    scratch = os.path.join(os.path.abspath(scratch), "mpi_train_" + case)
    subprocess.run(["rm", "-rf", scratch], check=True)
    os.makedirs(scratch)
    {"lock_race": case_lock_race, "save_signal": case_save_signal}[case](laga, mpiexec, scratch)
    print(f"mpi_train_checkpoint {case}: OK")


if __name__ == "__main__":
    main()
