"""DeltaScheme: validated once on construction, serialized with a version, read from v1/v2 entries."""

import pytest

from deltazip.kernels.scheme import DeltaScheme, SchemeError


@pytest.mark.parametrize("fields,field,reason", [
    (dict(bits=5), "bits", "is not supported; use one of 2, 3, 4, 8"),
    (dict(sparsity="2:8"), "sparsity", "is not supported; use 2:4 or none"),
    (dict(group_size=0), "group_size", "must be positive, or -1 for one group per row"),
    (dict(group_size=6), "group_size", "must be divisible by 4 with 2:4 sparsity"),
    (dict(kind="codebook"), "kind", "is unknown"),
])
def test_a_scheme_out_of_range_names_its_field(fields, field, reason):
    with pytest.raises(SchemeError) as e:
        DeltaScheme(**fields)
    assert e.value.field == field and reason in e.value.reason


def test_a_scheme_is_immutable_and_derives_its_shapes():
    s = DeltaScheme(bits=4, group_size=-1, sparsity="2:4", sym=False)
    with pytest.raises(AttributeError):
        s.bits = 2
    assert (s.effective_group(64), s.num_groups(64), s.kept_per_row(64)) == (64, 1, 32)
    assert DeltaScheme(group_size=16, sparsity="none").num_groups(64) == 4
    assert DeltaScheme(group_size=16).shape_problem(40) == "in_features 40 not divisible by group size 16"
    assert DeltaScheme(group_size=-1).shape_problem(42) == "2:4 needs in_features (42) and group size divisible by 4"
    assert s.replace(sym=True) == DeltaScheme(bits=4, group_size=-1, sparsity="2:4", sym=True)


def test_the_manifest_form_round_trips_and_v2_loose_fields_map_to_version_1():
    s = DeltaScheme(bits=3, group_size=32, sparsity="none", sym=False)
    assert s.to_json() == {"version": 1, "bits": 3, "group_size": 32, "sparsity": "none", "sym": False,
                           "kind": "packed"}
    assert DeltaScheme.from_json({"kind": "packed", "scheme": s.to_json()}) == s
    v2 = {"kind": "packed", "bits": 3, "group_size": 32, "sym": False, "sparsity": "none", "additive": True}
    assert DeltaScheme.from_json(v2) == s
    with pytest.raises(SchemeError, match="upgrade deltazip"):
        DeltaScheme.from_json({"kind": "packed", "scheme": {**s.to_json(), "version": 2}})
