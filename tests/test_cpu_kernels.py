"""The C++ CPU kernels: built once per machine and source, chosen by attention.impl=auto on CPU,
and a clear fallback or error where they cannot be built."""

import logging

import pytest

import cpu_kernels
import jaxcb.attention as attention
from jaxcb.attention import get_attention_backend, resolve_attention_impl
from jaxcb.config import AttentionConfig, ConfigError


def test_auto_picks_the_cpu_kernel_on_cpu_and_pallas_on_gpu():
    assert resolve_attention_impl("auto", "cpu") == "cpu"
    assert resolve_attention_impl("auto", "gpu") == "pallas"
    assert get_attention_backend(AttentionConfig(impl="auto")).name == "cpu"


def test_auto_falls_back_to_xla_with_a_warning_when_the_kernel_cannot_be_built(monkeypatch, caplog):
    def no_compiler():
        raise cpu_kernels.CpuKernelUnavailable("no C++ compiler found")

    monkeypatch.setattr(attention, "load_cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger="jaxcb.attention"):
        assert get_attention_backend(AttentionConfig(impl="auto")).name == "xla"
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ConfigError, match=r"(?s)attention.impl=cpu: no C\+\+ compiler found.*use attention.impl=xla"):
        get_attention_backend(AttentionConfig(impl="cpu"))


def test_a_missing_compiler_is_named_in_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_kernels.CpuKernelUnavailable, match="no-such-compiler"):
        cpu_kernels.build_library()


def test_a_failed_build_says_why_and_leaves_no_library_behind(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (cpu_kernels.SOURCES[0], bad))
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_kernels.CpuKernelUnavailable, match="building the CPU kernels failed"):
        cpu_kernels.build_library()
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_library_is_built_once_and_rebuilt_when_the_source_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build_library()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build_library() == first and first.stat().st_mtime_ns == mtime
    for i, source in enumerate(cpu_kernels.SOURCES):  # each source is part of the key
        changed = tmp_path / f"changed{i}.cc"
        changed.write_text(source.read_text() + "\n// changed\n")
        sources = list(cpu_kernels.SOURCES)
        sources[i] = changed
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "SOURCES", tuple(sources))
            assert cpu_kernels.build_library() != first


def test_sources_from_another_directory_build_their_own_library(monkeypatch, tmp_path):
    """`build_library(source_dir)` builds another revision's kernels (the A/B of
    `scripts/bench_kernels.py --against`): keyed by their content, like this package's."""
    monkeypatch.setenv("JAXCB_KERNEL_CACHE", str(tmp_path / "cache"))
    here = cpu_kernels.build_library()
    for name, suffix in (("same", ""), ("changed", "\n// changed\n")):
        (tmp_path / name).mkdir()
        for f in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
            (tmp_path / name / f.name).write_text(f.read_text() + (suffix if f.suffix == ".cc" else ""))
    assert cpu_kernels.build_library(tmp_path / "same") == here
    assert cpu_kernels.build_library(tmp_path / "changed") != here
