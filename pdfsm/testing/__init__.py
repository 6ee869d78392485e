"""Property-based race testing: a simulated world whose interleavings Hypothesis chooses.

    from hypothesis import given, strategies as st
    from pdfsm.testing import Scenario, drive

    @given(st.data())
    def test_no_interleaving_breaks_an_invariant(data):
        drive(data, Scenario(requests=2, producer_tp=2))

See docs/race-testing.md.
"""

from pdfsm.testing.explore import Found, drive, exhaust, hunt
from pdfsm.testing.world import EXTRA_FAULTS, FAULTS, QUIRKS, Choice, InvariantViolation, Scenario, Variant, World

__all__ = ["EXTRA_FAULTS", "FAULTS", "QUIRKS", "Choice", "Found", "InvariantViolation", "Scenario", "Variant", "World",
           "drive", "exhaust", "hunt"]
