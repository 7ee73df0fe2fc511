"""The prepared weights on 2 MiB pages (`engine.huge_pages`, jaxcb/huge_pages.py)."""

import errno
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np

from engine_factory import shared_engine
from jaxcb.huge_pages import HUGE_PAGE, MADV_COLLAPSE, collapse_onto_huge_pages, huge_page_regions


def test_regions_are_the_whole_2_mib_regions_within_the_buffers_side_by_side():
    H, mib = HUGE_PAGE, 1 << 20
    overlapping = [(3 * H + 5, mib), (3 * H + mib, 2 * H)]  # [3H + 5, 5H + 1 MiB): only 4H is whole
    exact = [(10 * H, H)]
    abutting = [(20 * H, H - 100), (21 * H - 36, H + 36)]  # 64 bytes apart: one run [20H, 22H)
    apart = [(30 * H, H // 2), (30 * H + H // 2 + 8192, H)]  # 8 KiB apart: neither holds a whole region
    assert huge_page_regions(overlapping + exact + abutting + apart) == [4 * H, 10 * H, 20 * H, 21 * H]


def test_each_region_is_collapsed_alone_and_the_first_failure_is_named(caplog):
    weights = [jnp.ones((3 * HUGE_PAGE // 4,), jnp.float32), jnp.ones((1000,), jnp.float32)]
    calls = []

    def madvise(address, size, advice):
        calls.append((address, size, advice))
        return errno.ENOMEM if len(calls) == 2 else 0

    with caplog.at_level(logging.INFO, logger="jaxcb.huge_pages"):
        result = collapse_onto_huge_pages(weights, "auto", madvise)
    assert all(size == HUGE_PAGE and advice == MADV_COLLAPSE and address % HUGE_PAGE == 0
               for address, size, advice in calls)
    assert result.regions == len(calls) >= 2 and result.collapsed == result.regions - 1
    assert result.weight_bytes == 3 * HUGE_PAGE + 4000 and result.failure.startswith("ENOMEM")
    assert re.search(rf"{result.regions - 1} of {result.regions} 2 MiB regions on huge pages in [0-9.]+ s \(the "
                     rf"others: ENOMEM", caplog.text)


def test_the_move_stops_when_its_seconds_run_out_and_says_how_many_regions_stay(caplog):
    """engine.huge_pages_seconds bounds the start-up time spent: a host where each collapse is slow (a
    fake clock: 1 s a region) gets as many regions as the budget allows, the rest left as they are."""
    weights = [jnp.ones((5 * HUGE_PAGE // 4,), jnp.float32)]  # 10 MiB: 4 or 5 whole regions
    now = [0.0]
    calls = []

    def madvise(address, size, advice):
        calls.append(address)
        now[0] += 1.0
        return 0

    with caplog.at_level(logging.INFO, logger="jaxcb.huge_pages"):
        result = collapse_onto_huge_pages(weights, "auto", madvise, seconds=1.5, clock=lambda: now[0])
    assert len(calls) == 2 and result.collapsed == 2 and result.regions >= 4 and result.failure is None
    assert re.search(rf"2 of {result.regions} 2 MiB regions on huge pages in 2.00 s: engine.huge_pages_seconds=1.5 "
                     rf"ran out, the other {result.regions - 2} stay on 4 KiB pages", caplog.text)
    now[0], calls[:] = 0.0, []
    assert collapse_onto_huge_pages(weights, "auto", madvise, clock=lambda: now[0]).collapsed == result.regions


def test_a_kernel_that_refuses_leaves_the_pages_and_says_how_to_skip_the_attempt(caplog):
    with caplog.at_level(logging.INFO, logger="jaxcb.huge_pages"):
        result = collapse_onto_huge_pages([jnp.ones((3 * HUGE_PAGE // 4,))], "auto", lambda *args: errno.EINVAL)
    assert result.collapsed == 0 and result.failure.startswith("EINVAL")
    assert "stay on 4 KiB pages" in caplog.text and "engine.huge_pages=off" in caplog.text


def test_off_never_touches_the_pages():
    def madvise(*args):
        raise AssertionError("madvise called under engine.huge_pages=off")

    assert collapse_onto_huge_pages([jnp.ones((10,))], "off", madvise) is None


def anon_huge_kib_around(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weights_move_onto_huge_pages_where_linux_allows_and_keep_their_values():
    w = jnp.arange(3 * HUGE_PAGE // 4, dtype=jnp.float32)  # 3 regions' bytes: at least 2 whole ones inside
    before = np.asarray(w).copy()
    result = collapse_onto_huge_pages([w], "auto")
    np.testing.assert_array_equal(np.asarray(w), before)
    if result.collapsed:  # Linux 6.1+: the buffer's mapping now holds huge pages
        assert anon_huge_kib_around(w.unsafe_buffer_pointer() + HUGE_PAGE) >= HUGE_PAGE // 1024
    else:  # an older kernel: nothing moved, and the reason is kept
        assert result.failure is not None


def test_a_buffer_too_small_for_a_whole_region_is_left_alone(caplog):
    def madvise(*args):
        raise AssertionError("madvise called on a region that is not all weights")

    with caplog.at_level(logging.INFO, logger="jaxcb.huge_pages"):
        result = collapse_onto_huge_pages([jnp.ones((1000,))], "auto", madvise)
    assert (result.regions, result.collapsed, result.failure) == (0, 0, None)
    assert "in no whole 2 MiB region: left on 4 KiB pages" in caplog.text


def test_a_cpu_engine_offers_its_prepared_weights_at_start_up():
    e = shared_engine("engine.huge_pages=auto")  # the tiny model's: whole regions or not, all are looked at
    assert e.huge_pages is not None
    assert e.huge_pages.weight_bytes >= sum(a.nbytes for a in jax.tree.leaves(e.runner.weights.layers))
    assert e.huge_pages.collapsed == e.huge_pages.regions or e.huge_pages.failure is not None
