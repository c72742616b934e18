"""The IGNN scaling bench at toy size (in-process; the real run is `deqzoo bench ignn`)."""

from benchmarks.ignn import _with_ratios, measure


def test_measure_toy_graph():
    row = measure(500, steps=5)
    assert row["edges"] == 500 and row["nodes"] == 50 and row["nfe"] == 5
    assert row["seconds_forward"] > 0 and row["spectral_radius"] > 0
    rows = _with_ratios(
        [
            dict(row),
            {
                **row,
                "edges": 1000,
                "seconds_forward": row["seconds_forward"] * 2,
                "seconds_graph": row["seconds_graph"] * 2,
                "peak_mem_mb": row["peak_mem_mb"] * 2,
            },
        ]
    )
    assert rows[1]["forward_time_per_edge_ratio"] == 1.0
