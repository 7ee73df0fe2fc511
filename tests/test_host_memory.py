from pathlib import Path

from jaxcb.host_memory import available_host_bytes

GIB = 1 << 30


def write_meminfo(tmp_path: Path, *, total_kb: int, free_kb: int, available_kb: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total_kb} kB\nMemFree:        {free_kb} kB\n"
                    f"MemAvailable:   {available_kb} kB\nBuffers:           100 kB\nHugePages_Total:       0\n")
    return path


def test_page_cache_counts_as_available_not_only_free_pages(tmp_path):
    # A machine that has read gigabytes of files: little is free, almost all of it can be reclaimed.
    meminfo = write_meminfo(tmp_path, total_kb=24 << 20, free_kb=100 << 10, available_kb=20 << 20)
    assert available_host_bytes(meminfo, cgroup_root=tmp_path / "no-cgroup") == 20 * GIB


def test_a_cgroup_v2_limit_caps_the_host_s_available_memory(tmp_path):
    meminfo = write_meminfo(tmp_path, total_kb=24 << 20, free_kb=1 << 20, available_kb=20 << 20)
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "memory.current").write_text(f"{6 * GIB}\n")
    (root / "memory.stat").write_text(f"anon 1\nfile 1\ninactive_file {1 * GIB}\n")
    assert available_host_bytes(meminfo, cgroup_root=root) == 3 * GIB  # 8 - 6 + the reclaimable 1
    (root / "memory.max").write_text("max\n")
    assert available_host_bytes(meminfo, cgroup_root=root) == 20 * GIB


def test_a_cgroup_v1_no_limit_reads_as_no_limit(tmp_path):
    meminfo = write_meminfo(tmp_path, total_kb=24 << 20, free_kb=1 << 20, available_kb=20 << 20)
    memory = tmp_path / "cgroup" / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (memory / "memory.usage_in_bytes").write_text(f"{5 * GIB}\n")
    assert available_host_bytes(meminfo, cgroup_root=tmp_path / "cgroup") == 20 * GIB
    (memory / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (memory / "memory.stat").write_text(f"inactive_file 7\ntotal_inactive_file {GIB // 2}\n")
    assert available_host_bytes(meminfo, cgroup_root=tmp_path / "cgroup") == GIB + GIB // 2


def test_this_machine_reads_a_positive_size_no_larger_than_its_memory():
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert 0 < available_host_bytes() <= total
