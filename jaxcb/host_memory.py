"""How much host memory a new allocation can take: the kernel's estimate, within this cgroup's limit.

`os.sysconf("SC_AVPHYS_PAGES")` is MemFree: it leaves out the page cache, which the kernel gives
back on demand, so a machine that has read a few gigabytes of files (a pip install, a checkpoint)
reads as nearly full. MemAvailable counts what can be reclaimed. In a container the host's
MemAvailable says nothing of the container's own limit, so a cgroup limit (v2 `memory.max`, v1
`memory.limit_in_bytes`) caps it, less what the cgroup uses beyond its reclaimable file pages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def _read_meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit) reads as None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_available(root: Path, total: int) -> Optional[int]:
    """What this cgroup may still take, or None where no limit below the machine's memory is set."""
    for limit_file, usage_file, stat_key in (
        ("memory.max", "memory.current", "inactive_file"),  # v2, unified hierarchy
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),  # v1
    ):
        limit = _read_int(root / limit_file)
        usage = _read_int(root / usage_file)
        if limit is None or usage is None or limit >= total:  # v1 reports "no limit" as a huge number
            continue
        stat = (root / limit_file).parent / "memory.stat"
        return max(0, limit - usage + _stat_value(stat, stat_key))
    return None


def available_host_bytes(meminfo: Path = MEMINFO, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Bytes of host memory a new allocation can take without pushing anything to swap or the OOM killer."""
    try:
        info = _read_meminfo(meminfo)
    except OSError:
        info = {}
    available = info.get("MemAvailable")
    if available is None:  # not Linux, or a kernel before 3.14
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 4 << 30
    cgroup = _cgroup_available(cgroup_root, info.get("MemTotal", available))
    return available if cgroup is None else min(available, cgroup)


def physical_host_bytes() -> Optional[int]:
    """The machine's physical memory (None where the OS does not say): no host buffer larger than this
    can ever be held, whatever is free now."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
