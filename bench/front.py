"""The HTTP front door's processes on this host: their PIDs, memory and CPU time.

The front is the ingress replicas (each a Ray actor process) and Serve's proxy actors,
whose HAProxy runs as a child process; both are found in Ray's actor table, and a role's
memory and CPU count every descendant of its processes. bench.overload reads the memory
before and after its steps; bench.load --http reads the CPU over a round, which with the
generator processes' own CPU says what each streamed token costs the host (the HTTP
path's floor, as replica_cpu is the Python client path's).
"""

from __future__ import annotations

import os

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def front_pids() -> dict[str, list[int]]:
    """The PIDs of the HTTP ingress replicas and of Serve's proxy actors (Ray's actor table
    of the connected cluster); empty when not connected."""
    import ray

    if not ray.is_initialized():
        return {}
    from ray._private.state import actors  # the GCS table: no dashboard needed

    pids: dict[str, list[int]] = {"ingress": [], "proxy": []}
    for actor in actors(actor_state_name="ALIVE").values():
        name = actor["ActorClassName"]
        if name.startswith("ServeReplica:") and name.endswith(":Ingress"):
            pids["ingress"].append(actor["Pid"])
        elif name == "ProxyActor":
            pids["proxy"].append(actor["Pid"])
    return pids


def _stat_fields(pid: int) -> list[str]:
    """/proc/pid/stat after the command name (which may hold spaces): field 3 (state) first."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """pid and its live descendants (Serve's HAProxy runs as the proxy actor's child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def rss_mb(pid: int) -> float:
    """Resident memory of pid and its descendants, in MB; 0 for a process that is gone."""
    total_kb = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total_kb += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total_kb / 1024


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) that pid and its live descendants have
    used so far; 0 for a process that is gone."""
    total_ticks = 0
    for p in process_tree(pid):
        try:
            fields = _stat_fields(p)
        except OSError:
            continue
        total_ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total_ticks / CLOCK_TICKS_PER_S


def front_rss_mb(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: round(sum(rss_mb(p) for p in ps), 1) for role, ps in pids.items()}


def front_cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far, per role, by its processes and their descendants."""
    return {role: sum(cpu_s(p) for p in ps) for role, ps in pids.items()}
