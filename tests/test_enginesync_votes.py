"""pdfsm.enginesync over a real 3-rank gloo world (tests/enginesync_votes_rank.py).

Three OS processes form one gloo world over loopback; each scenario has its own group with a
short timeout (SHORT_S), and a world barrier separates scenarios. The promises checked come from
docs/engine-id-sync.md ("The protocol, and why nothing can hang") and the docstring of
``sync_engine_id``: on bad input (an id, ``src``, a ``device`` that rank cannot use, differing
``fingerprint`` values) *every* rank raises ``InvalidInput``, in milliseconds, none adopting an id;
and a rank lost between the vote and the broadcast fails every survivor (the last scenario).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from enginesync_votes_rank import ODD_ID
from helpers import child_env

ROOT = Path(__file__).resolve().parent.parent
SIZE = 3
SHORT_S = 3
Outcomes = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Outcomes]:
    work = tmp_path_factory.mktemp("review_enginesync_more")
    env = child_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for r in range(SIZE):
        with (work / f"{r}.err").open("wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "enginesync_votes_rank.py"), str(work / "store"), str(r),
                 str(SIZE), str(work / f"{r}.json"), str(SHORT_S)],
                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT))
    deadline = time.monotonic() + 60  # hard bound: every rank is killed past it
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = []
    for r in range(SIZE):
        f = work / f"{r}.json"
        got: Outcomes = json.loads(f.read_text()) if f.exists() else {}
        got["_stderr"] = {"tail": (work / f"{r}.err").read_text()[-1500:]}
        out.append(got)
    return out


def outcome(ranks: list[Outcomes], r: int, scenario: str) -> dict[str, Any]:
    assert scenario in ranks[r], f"rank {r} never reported {scenario}: {ranks[r]['_stderr']['tail']}"
    return ranks[r][scenario]


def adopted(ranks: list[Outcomes], scenario: str) -> list[Any]:
    got = []
    for r in range(SIZE):
        o = outcome(ranks, r, scenario)
        assert not o["error"], (r, o)
        got.append(o["id"])
    return got


def assert_refused_everywhere(ranks: list[Outcomes], scenario: str, field: str) -> None:
    """Docs: "If any of these holds, **every** rank raises `InvalidInput` (field `device`,
    `engine_id`, `src` or `fingerprint`), and none reaches step 2" -- in milliseconds, not at the
    group's timeout."""
    seen = {r: {k: outcome(ranks, r, scenario).get(k) for k in ("error", "field", "id", "seconds", "message")}
            for r in range(SIZE)}
    for r, o in seen.items():
        assert o["error"] == "InvalidInput" and o["field"] == field and not o["id"], seen
        assert o["seconds"] is not None and o["seconds"] < SHORT_S - 1, f"rank {r} waited out the timeout: {seen}"


# --- passing coverage: odd ids, a surrogate, engine_config with src=1 ------------------------------


@pytest.mark.slow
def test_a_256_char_id_with_nuls_and_two_byte_chars_crosses_intact_from_src_2(ranks: list[Outcomes]) -> None:
    """Docs: the broadcast is length-prefixed, so NULs (inside and trailing) and multi-byte UTF-8 survive."""
    assert adopted(ranks, "odd_bytes_src2") == [ODD_ID] * SIZE


@pytest.mark.slow
def test_a_lone_surrogate_on_a_non_source_rank_is_refused_on_every_rank(ranks: list[Outcomes]) -> None:
    """Docs: an id that "cannot be encoded as UTF-8 (lone surrogates)" is refused, even on a non-source rank."""
    assert_refused_everywhere(ranks, "surrogate_on_rank1", "engine_id")
    assert "refused on group rank 1" in outcome(ranks, 0, "surrogate_on_rank1")["message"]


@pytest.mark.slow
def test_engine_config_with_src_1_gives_every_rank_rank_1s_id(ranks: list[Outcomes]) -> None:
    got = adopted(ranks, "engine_config_src1")
    assert [g[0] for g in got] == ["review-engine-rank1"] * SIZE
    assert [g[1:] for g in got] == [[r, SIZE, 32] for r in range(SIZE)]


# --- fingerprints: "when the ranks pass different fingerprint values" -> every rank raises ---------


@pytest.mark.slow
def test_fingerprints_differing_by_2_pow_62_are_refused(ranks: list[Outcomes]) -> None:
    """sync_engine_id docstring: InvalidInput on every rank "when the ranks pass different
    ``fingerprint`` values". 0 and 2**62 are different values (both fit an int64)."""
    assert_refused_everywhere(ranks, "fp_mod_2_62", "fingerprint")


@pytest.mark.slow
def test_different_numpy_integer_fingerprints_are_refused(ranks: list[Outcomes]) -> None:
    """Same promise, with the fingerprint a numpy integer (7 on rank 0, 8 on ranks 1, 2)."""
    assert_refused_everywhere(ranks, "fp_numpy", "fingerprint")


# --- a device that one rank cannot use: every rank raises InvalidInput(device), promptly -------------


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["hpu_on_rank2", "meta_on_rank1"])
def test_a_device_one_rank_cannot_use_is_refused_on_every_rank(ranks: list[Outcomes], scenario: str) -> None:
    """Docs: every rank raises InvalidInput (field device) when "any rank's ``device`` cannot be used
    there", voting from its default device (the CPU for gloo); none waits out the group timeout."""
    assert_refused_everywhere(ranks, scenario, "device")


# --- integers of any size, numpy src, a layout that cannot be digested ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fp_huge_on_rank1", "layout_huge_on_rank1"])
def test_an_integer_over_4300_digits_on_one_rank_is_refused_on_every_rank(ranks: list[Outcomes],
                                                                          scenario: str) -> None:
    """Scenario: rank 1 passes 10**5000 as the fingerprint, or as engine_config's block_size; the
    others 0 / 16. Expected: every rank raises InvalidInput(fingerprint) at once (the values differ).
    Before: str() of the integer raised a bare ValueError on rank 1 before the vote, and ranks 0
    and 2 raised EngineSyncError from a vote rank 1 never joined, at the group's timeout."""
    assert_refused_everywhere(ranks, scenario, "fingerprint")
    assert "differ" in outcome(ranks, 1, scenario)["message"]


@pytest.mark.slow
def test_the_same_integer_over_4300_digits_everywhere_is_accepted(ranks: list[Outcomes]) -> None:
    """Scenario: every rank passes fingerprint=10**5000. Expected: every rank adopts rank 0's id
    (the docs promise any integer). Before: every rank raised a bare ValueError."""
    assert adopted(ranks, "fp_huge_everywhere") == ["review-engine-rank0"] * SIZE


@pytest.mark.slow
def test_a_layout_field_that_cannot_be_digested_is_refused_on_every_rank(ranks: list[Outcomes]) -> None:
    """Scenario: engine_config with a compat_hash whose repr() raises, on rank 2 only. Expected:
    every rank raises InvalidInput(fingerprint) at once, rank 2 naming the field, the others rank 2.
    Before: rank 2 raised the repr's RuntimeError before the vote; the others waited out the
    group's timeout."""
    assert_refused_everywhere(ranks, "layout_bad_repr_on_rank2", "fingerprint")
    assert "compat_hash cannot be compared" in outcome(ranks, 2, "layout_bad_repr_on_rank2")["message"]
    assert "refused on group rank 2" in outcome(ranks, 0, "layout_bad_repr_on_rank2")["message"]


@pytest.mark.slow
def test_a_numpy_integer_src_is_a_rank(ranks: list[Outcomes]) -> None:
    """Scenario: every rank passes src=np.int64(1). Expected: every rank adopts rank 1's id.
    Before: every rank raised InvalidInput "must be a rank of the group, 0 to 2: got np.int64(1)"."""
    assert adopted(ranks, "numpy_src1") == ["review-engine-rank1"] * SIZE


@pytest.mark.slow
def test_the_world_still_syncs_after_every_scenario(ranks: list[Outcomes]) -> None:
    assert adopted(ranks, "after") == ["review-engine-rank1"] * SIZE


@pytest.mark.slow
def test_a_rank_dying_between_the_vote_and_the_broadcast_fails_every_survivor(ranks: list[Outcomes]) -> None:
    """Scenario: rank 2 (not the source) exits after the vote, before the broadcast. Expected:
    ranks 0 and 1 both raise EngineSyncError, neither adopting an id: the acknowledgement after
    the broadcast cannot complete without rank 2. Before: the outcomes split, rank 0 (the source)
    raising while rank 1 returned rank 0's id."""
    for r in (0, 1):
        o = outcome(ranks, r, "die_before_broadcast")
        assert o["error"] == "EngineSyncError" and not o["id"], (r, o)
        assert o["seconds"] < SHORT_S + 2, (r, o)  # the backend notices the death, or the group's timeout
    assert "die_before_broadcast" not in ranks[2]
