"""Property tests: random small problems, implementation="cpu" in float32 against the float64
reference (out, lse, dq, dk, dv, dbias), with random broadcast patterns, causality and softcap."""

from __future__ import annotations

from conftest import BROADCAST_PATTERNS, Case, check_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HEAD_GROUPS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2)]
PATTERNS = st.one_of(st.none(), st.sampled_from(BROADCAST_PATTERNS))


@st.composite
def cases(draw):
    heads, kv_heads = draw(st.sampled_from(HEAD_GROUPS))
    mask = draw(PATTERNS)
    full_mask = mask is not None and mask[2:] == ("Lq", "Lk")
    return Case(
        B=draw(st.integers(1, 3)),
        Lq=draw(st.integers(1, 64)),
        Lk=draw(st.integers(1, 64)),
        H=heads,
        Hk=kv_heads,
        D=draw(st.sampled_from([8, 16, 32])),
        mask=mask,
        mask_kind=draw(st.sampled_from(["random", "rows"])) if full_mask else "random",
        bias=draw(PATTERNS),
        causal=draw(st.booleans()),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 50.0]))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    )


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_cpu_matches_reference(case):
    check_case(case, "cpu")
