"""Registration that scales (issue 23 item 4): with 10,000 registered variants (hard-linked copies of one
small artifact under different names) ``deltazip serve`` starts in at most twice the time it takes with
4, holds at most 10 KB of host memory per variant not yet used, and answers the first request to a
variant never used before with that variant's text. Real ``deltazip serve`` processes
(``tests/_many_variants.py``, which also prints the figures: ``python tests/_many_variants.py``)."""

from __future__ import annotations

import pytest
from _many_variants import link_copies, measure
from _serving import served_set, single_thread


@pytest.mark.slow
def test_ten_thousand_variants_start_within_twice_four_and_10_kb_each(tmp_path_factory):
    with single_thread():
        s = served_set(tmp_path_factory.getbasetemp() / "serving")
    work = tmp_path_factory.mktemp("many")
    small = link_copies(s.variant_dir("alpha"), work / "small", 4)
    large = link_copies(s.variant_dir("alpha"), work / "large", 10_000)
    res = measure(small, large, s.base_dir, repeats=2)
    med = res["median"]
    assert (med["small"]["models"], med["large"]["models"]) == (5, 10_001)  # base + variants, all listed
    assert res["startup_ratio"] <= 2.0, res
    assert res["bytes_per_extra_variant"] <= 10_000, res
    # variants never used before answer their first request (read, checked and loaded then)
    assert res["cold"]["statuses"] == [200] and len(res["cold"]["variants"]) == 8
    assert res["cold"]["texts"] == [s.expected("alpha", "zip model tune", 4)]
