"""The heavy-hitter sketch behind the admin API's top limited clients: memory
fixed under a flood of distinct keys, the true heavy hitters found, counts
bounded by their errors, and old windows forgotten. Pure: no I/O, times passed in."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import pytest

from gateway.limiter.top_limited import SpaceSaving, TopLimited


def test_memory_stays_fixed_under_a_flood_of_100k_distinct_keys():
    sketch = TopLimited(capacity=100, window=60.0)
    tracemalloc.start()
    try:
        held = []
        for n in range(100_000):
            sketch.add(f"flood-{n}", now=1.0)
            if n % 10_000 == 9_999:
                assert len(sketch) == 100
                held.append(tracemalloc.get_traced_memory()[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(sketch._current._heap) == 100  # one heap entry per counter, never more
    # 100k keys of ~60 bytes each would be ~6 MB. The sketch holds ~40 KB throughout
    # (a little more once counts outgrow CPython's cached small ints), and no more
    # after 100k keys than after 50k.
    assert max(held) < 50_000
    assert held[-1] - held[len(held) // 2] < 1_000
    assert peak < 100_000


def test_the_true_heavy_hitters_are_found_among_100k_distinct_keys():
    rng = random.Random(42)
    heavy = {f"heavy-{i}": 2_000 - 150 * i for i in range(10)}  # 2000, 1850, ... 650 denials
    stream = [key for key, count in heavy.items() for _ in range(count)]
    stream += [f"noise-{n}" for n in range(100_000)]  # each denied once or twice
    stream += [f"noise-{rng.randrange(100_000)}" for _ in range(50_000)]
    rng.shuffle(stream)
    truth = Counter(stream)

    sketch = TopLimited(capacity=200, window=60.0)
    for key in stream:
        sketch.add(key, now=5.0)
    top = sketch.top(10, now=5.0)

    assert [hit.key for hit in top] == list(heavy)  # all ten, in order
    for hit in top:
        assert hit.count - hit.error <= truth[hit.key] <= hit.count
        # total / capacity bounds every error: ~166k / 200
        assert hit.error <= len(stream) / 200


def test_space_saving_counts_exactly_while_it_has_room():
    sketch = SpaceSaving(capacity=3)
    for key in "aababc":
        sketch.add(key)
    assert {(h.key, h.count, h.error) for h in sketch.items()} == {("a", 3, 0), ("b", 2, 0), ("c", 1, 0)}
    sketch.add("d")  # evicts the smallest, c, and inherits its count
    assert {(h.key, h.count, h.error) for h in sketch.items()} == {("a", 3, 0), ("b", 2, 0), ("d", 2, 1)}
    assert sketch.total == 7


def test_an_evicted_key_is_the_one_with_the_smallest_true_count_though_the_heap_lags():
    sketch = SpaceSaving(capacity=2)
    sketch.add("a")
    sketch.add("b")
    for _ in range(5):
        sketch.add("a")  # a's heap entry still says 1
    sketch.add("c")  # must evict b (1), not a (6)
    assert {h.key for h in sketch.items()} == {"a", "c"}


def test_denials_older_than_two_windows_are_forgotten():
    sketch = TopLimited(capacity=10, window=10.0, now=0.0)
    for _ in range(5):
        sketch.add("early", now=1.0)
    sketch.add("later", now=12.0)  # next epoch: early is still recent
    assert [(h.key, h.count) for h in sketch.top(5, now=12.0)] == [("early", 5), ("later", 1)]
    assert [(h.key, h.count) for h in sketch.top(5, now=21.0)] == [("later", 1)]
    assert sketch.top(5, now=45.0) == []  # a quiet spell longer than a window


def test_counts_of_one_key_in_both_epochs_add_up():
    sketch = TopLimited(capacity=10, window=10.0, now=0.0)
    sketch.add("k", now=1.0)
    sketch.add("k", now=11.0)
    sketch.add("k", now=12.0)
    assert [(h.key, h.count, h.error) for h in sketch.top(1, now=12.0)] == [("k", 3, 0)]


@pytest.mark.parametrize("capacity, window", [(0, 1.0), (1, 0.0)])
def test_a_sketch_without_room_or_window_is_refused(capacity, window):
    with pytest.raises(ValueError):
        TopLimited(capacity=capacity, window=window)
