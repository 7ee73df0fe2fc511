"""A local Ray cluster for the tests of jaxcb.distributed: 2 CPUs, no dashboard, shut down after the module.

Without Ray installed these tests are skipped, except where JAXCB_REQUIRE_RAY=1 (CI installs
jaxcb[dist] and sets it), so that a broken install cannot pass as a skip.
"""

from __future__ import annotations

import os

import pytest


def require_ray():
    if os.environ.get("JAXCB_REQUIRE_RAY") == "1":
        import ray
    else:
        ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jaxcb[dist]'")
    return ray


def start_local_cluster():
    ray = require_ray()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    return ray


def descendant_pids(root: int) -> list[int]:
    """Process ids under `root` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def actor_pids(class_name: str, root: int | None = None) -> list[int]:
    """Processes of Ray actors of `class_name` started under `root` (default: this process)."""
    pids = []
    for pid in descendant_pids(root or os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if cmdline.startswith(f"ray::{class_name}".encode()):
            pids.append(pid)
    return pids
