"""The byte allocator of --target-ratio: the budget is kept (within 1%), never more error than a uniform
setting of the same size, optimal on small problems, and a clear error when the budget is too small."""

import itertools
import random

import pytest

from deltazip.compress.allocation import (
    LINEAR_SETTINGS,
    ROW_SETTINGS,
    AllocationError,
    Curve,
    Setting,
    allocate,
    uniform_choice,
)

# Bits per weight of each linear setting (codes, 2:4 positions, scales of 64-column groups) and a
# typical error multiplier: an error ~ 4**-bits, 2:4 pruning adds a floor.
_BPW = {"drop": 0.0, **{f"{b}-bit 2:4": b / 2 + 1 + 0.25 for b in (2, 3, 4, 8)},
        **{f"{b}-bit dense": b + 0.25 for b in (2, 3, 4, 8)}}


def _curve(name: str, rng: random.Random, weights: int, rows: bool = False) -> Curve:
    """A curve shaped like the probe's: bytes from bits per weight, error falling with bits, with the
    tensor's own sensitivity (spanning three orders of magnitude) and some noise."""
    settings = list(ROW_SETTINGS if rows else LINEAR_SETTINGS)
    sens = 10 ** rng.uniform(-2, 1)
    err, nbytes = [], []
    for s in settings:
        if s.dropped:
            err.append(sens)
            nbytes.append(120)
            continue
        floor = 0.0 if s.sparsity != "2:4" else 0.05 * rng.uniform(0.5, 2)
        err.append(sens * (4.0 ** -s.bits + floor) * rng.uniform(0.8, 1.25))
        bpw = s.bits + 0.25 if rows else _BPW[s.label]
        nbytes.append(int(weights * bpw / 8) + 900)
    return Curve(name, "rows" if rows else "linear", settings, nbytes, err, weights)


def _model(seed: int, n: int = 120) -> list[Curve]:
    rng = random.Random(seed)
    curves = [_curve(f"layers.{i // 7}.m{i % 7}.weight", rng, rng.choice([4096, 16384, 65536])) for i in range(n)]
    return curves + [_curve("embed.weight", rng, 200_000, rows=True)]


def _totals(curves, choice):
    return sum(c.bytes[choice[c.name]] for c in curves), sum(c.err[choice[c.name]] for c in curves)


@pytest.mark.parametrize("seed", range(4))
def test_budget_is_used_and_never_exceeded(seed):
    curves = _model(seed)
    lo = sum(min(c.bytes) for c in curves)
    hi = sum(max(c.bytes) for c in curves)
    for frac in (0.05, 0.2, 0.4, 0.7, 0.95):
        budget = int(lo + frac * (hi - lo))
        a = allocate(curves, budget)
        used, err = _totals(curves, a.choice)
        assert used == a.bytes and err == pytest.approx(a.err)
        assert 0.99 * budget <= used <= budget, (frac, used / budget)


@pytest.mark.parametrize("seed", range(4))
def test_never_more_error_than_uniform_k_bit_at_its_size(seed):
    curves = _model(seed)
    for s in LINEAR_SETTINGS:
        u = uniform_choice(curves, s)
        ub, ue = _totals(curves, u)
        a = allocate(curves, ub)
        assert a.bytes <= ub
        assert a.err <= ue * (1 + 1e-12), (s.label, a.err, ue)
    # and the measured gain is real at the usual points (2- and 4-bit 2:4): well below uniform
    for label in ("2-bit 2:4", "4-bit 2:4"):
        ub, ue = _totals(curves, uniform_choice(curves, Setting.parse(label)))
        assert allocate(curves, ub).err < 0.5 * ue, label


def test_near_optimal_on_small_problems_by_brute_force():
    rng = random.Random(7)
    for trial in range(6):
        curves = [_curve(f"t{i}", rng, rng.choice([512, 2048, 8192])) for i in range(3)]
        choices = list(itertools.product(*(range(len(c.bytes)) for c in curves)))
        for budget in sorted(rng.sample(range(sum(min(c.bytes) for c in curves), sum(max(c.bytes) for c in curves)), 5)):
            # the rounding of the dynamic program costs at most 0.5% of the budget
            best = min(sum(c.err[i] for c, i in zip(curves, ch)) for ch in choices
                        if sum(c.bytes[i] for c, i in zip(curves, ch)) <= 0.995 * budget)
            got = allocate(curves, budget)
            assert got.bytes <= budget and got.err <= best * 1.0000001, (trial, budget, got.err, best)


def test_a_budget_below_the_smallest_settings_is_refused():
    curves = _model(0, n=10)
    lo = sum(min(c.bytes) for c in curves)
    assert allocate(curves, lo).bytes == lo
    with pytest.raises(AllocationError, match="smallest settings take"):
        allocate(curves, lo - 1)


def test_setting_labels_round_trip():
    for s in (*LINEAR_SETTINGS, *ROW_SETTINGS):
        assert Setting.parse(s.label) == (s if not s.dropped else Setting(0, "none"))
    assert [s.label for s in LINEAR_SETTINGS[:3]] == ["drop", "2-bit 2:4", "2-bit dense"]
    assert ROW_SETTINGS[1].label == "2-bit rows"
