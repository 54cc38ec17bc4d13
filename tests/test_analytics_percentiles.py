"""Exact nearest-rank percentiles of the time to deliver from partial buckets (mtaq/analytics/partials.py). No Spark.

Random delivered outcomes (delays: whole microseconds spread over days, clusters of nearly equal values in one
bucket, exact repeats, zero and negative ones; a few domains, a null domain) are split into 1-4 groups as the
data source's tasks split them; each group's ``partials`` are encoded and merged, ``locate_percentiles`` names
what the buckets tell, and ``rank_value`` counts off the ranks inside a bucket from that bucket's values (what
the job's one Spark query reads back). The result must equal :func:`mtaq.analytics.plain.nearest_rank` over
the plain list of delays, for all recipients and for each domain, value for value.
"""

from __future__ import annotations

import math

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mtaq.analytics.facts import FACT_SCHEMA  # noqa: E402
from mtaq.analytics.partials import DELAY_KEY_BITS, delay_key, encode, locate_percentiles, merge, partials, rank_value  # noqa: E402
from mtaq.analytics.plain import nearest_rank  # noqa: E402

PS = (0.5, 0.9, 0.99)
T0 = 1_740_787_200_000_000  # 2025-03-01T00:00:00Z in microseconds
TS = pa.timestamp("us", tz="UTC")

delays_us = st.one_of(
    st.integers(0, 5 * 86_400_000_000),  # anything up to five days
    st.integers(200_000, 200_999),  # a cluster inside one bucket (0.2 s, microseconds apart)
    st.sampled_from([0, 1, 200_000, 1_800_200_000]),  # exact repeats
    st.integers(-5_000_000, -1),  # a clock that went back
)
rows = st.lists(st.tuples(st.sampled_from(["a.example", "b.example", None]), delays_us, st.integers(0, 3)),
                min_size=0, max_size=400)


def outcome_table(part: list[tuple[str | None, int, int]]) -> pa.Table:
    """OUTCOME fact rows, delivered, with these (domain, delay in microseconds) and nothing else of interest."""
    n = len(part)
    cols = {
        "record_type": pa.array(["OUTCOME"] * n),
        "queue_id": pa.array([f"Q{i}" for i in range(n)]),
        "rcpt_index": pa.array([0] * n, pa.int32()),
        "status": pa.array(["delivered"] * n),
        "rcpt_domain": pa.array([d for d, _, _ in part], pa.string()),
        "arrival_ts": pa.array([T0] * n, pa.int64()).cast(TS),
        "ts": pa.array([T0 + us for _, us, _ in part], pa.int64()).cast(TS),
        "delay_s": pa.array([us / 1e6 for _, us, _ in part], pa.float64()),
        "size": pa.array([100] * n, pa.int64()),
    }
    return pa.Table.from_arrays([cols.get(f.name, pa.nulls(n, f.type)).cast(f.type) for f in FACT_SCHEMA],
                                schema=FACT_SCHEMA)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows)
def test_bucketed_percentiles_equal_the_plain_nearest_rank(got_rows):
    groups = [[r for r in got_rows if r[2] == g] for g in range(4)]
    merged = merge(p for g in groups for p in encode(partials(outcome_table(g), None, None, None)))
    found, todo = locate_percentiles(merged["p_bucket"], PS)
    delays = [(d if d is not None else "?", us / 1e6) for d, us, _ in got_rows]
    for t in todo:  # what the job's Spark query reads back: the bucket's values of the group, with counts
        counts: dict[float, int] = {}
        for d, v in delays:
            if (t.domain is None or d == t.domain) and t.lo <= v <= t.hi:
                counts[v] = counts.get(v, 0) + 1
        found[t.domain][t.p] = rank_value(t, counts.items())
    want: dict[str | None, list[float | None]] = {}
    if delays:
        want[None] = [nearest_rank(sorted(v for _, v in delays), p) for p in PS]
    for dom in {d for d, _ in delays}:
        want[dom] = [nearest_rank(sorted(v for d, v in delays if d == dom), p) for p in PS]
    assert found == want


def test_the_bucket_key_orders_like_the_delays_and_stays_narrow():
    import numpy as np

    values = np.array([-3600.0, -1.0, -1e-6, -0.0, 0.0, 1e-6, 0.2, 0.2001, 0.3, 1.0, 1800.2, 5400.2, 432000.0])
    keys = delay_key(values)
    assert list(keys) == sorted(keys)  # never out of order
    assert keys[3] == keys[4] == 0  # -0.0 and 0.0 together
    assert len(set(delay_key(np.array([0.2, 0.21, 0.22, 0.25, 0.3])))) == 5  # buckets narrower than 3.2 %
    assert DELAY_KEY_BITS >= 5
    # values in one bucket are within 2**-DELAY_KEY_BITS of each other (relative)
    dense = np.linspace(0.1, 10.0, 100_001)
    k = delay_key(dense)
    for key in np.unique(k)[:50]:
        inside = dense[k == key]
        assert inside.max() / inside.min() - 1 < 2 ** -DELAY_KEY_BITS + 1e-12


def test_a_read_back_that_disagrees_with_the_count_is_an_error():
    merged = merge(encode(partials(outcome_table([("a.example", 200_000 + i, 0) for i in range(10)]), None, None, None)))
    _, todo = locate_percentiles(merged["p_bucket"], PS)
    assert todo, "ten values in one bucket: the ranks inside it need a read-back"
    with pytest.raises(ValueError, match="values read back"):
        rank_value(todo[0], [(0.2, 3)])
    assert math.isclose(rank_value(todo[0], [(0.2 + i / 1e6, 1) for i in range(10)]), 0.200004)
