"""The machine a check measured on, and what else it ran meanwhile: the CPU's
model name, the load average and the CPU seconds every process ran
(scripts/check_plan.py, check_model_plan.py).
On a shared machine measured times mean little when others ran a sizeable
share of the cores; a virtual machine's host can slow it too without any of
this showing (hence those scripts' --rounds)."""

import os
import subprocess
import time


def cpu_model():
    """lscpu's "Model name", or "?" where it has none."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")]
    return names[0] if names else "?"


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def busy_seconds():
    """CPU seconds every process of the machine has run (user, nice, system,
    irq, softirq and steal from /proc/stat), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


class Others:
    """Started at construction; report() says how many CPU-s the rest of the
    machine ran since: every process's CPU time less this script's and its
    children's (the laga runs it waited for)."""

    def __init__(self):
        self.busy0, self.mine0, self.wall0 = busy_seconds(), os.times(), time.time()

    def report(self, what="this check"):
        busy1, mine1, wall1 = busy_seconds(), os.times(), time.time()
        if self.busy0 is None:
            return f"other processes: unknown (no /proc/stat) during the {wall1 - self.wall0:.1f} s"
        m0, m1 = self.mine0, mine1
        mine = (m1.user + m1.system + m1.children_user + m1.children_system) - \
            (m0.user + m0.system + m0.children_user + m0.children_system)
        others = busy1 - self.busy0 - mine
        return (f"other processes ran {others:.1f} CPU-s during the {wall1 - self.wall0:.1f} s of "
                f"{what} ({100 * others / ((wall1 - self.wall0) * os.cpu_count()):.0f}% of the "
                f"{os.cpu_count()} cores)")
