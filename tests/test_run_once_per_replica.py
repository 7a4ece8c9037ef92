"""`model.parallel.run_once_per_replica` at TP=2 (and PP=2) on 2 CPU processes: whatever fails on the computing rank (an
exception, a result pickle refuses, a UserError) stops every rank of the group with the same one-paragraph UserError,
within seconds, instead of leaving the other rank waiting in the broadcast (STYLE rule 16).

The worker (tests/distributed/run_once_per_replica_worker.py) runs every case in the shared launch (conftest's `shared_launch`);
its groups time out after 30 s, so a rank left waiting fails its case rather than hang the launch.
"""

import json

import pytest

from tests.conftest import worker_output

WORKER = "run_once_per_replica_worker"  # shared_launch.py imports a worker by its file name
pytestmark = pytest.mark.distributed  # every test reads the shared 2-process launch
QUICK_SECONDS = 10  # each case takes milliseconds; a rank left waiting takes the worker's 30-s group timeout


def shared_worker(out) -> list[str]:
    """Every case in one worker, in the shared launch (conftest's `shared_launch`)."""
    return ["tests/distributed/run_once_per_replica_worker.py", f"--out={out}"]


@pytest.fixture(scope="module")
def ranks(shared_launch) -> list[dict]:
    """Each rank's outcomes, by case name (rank 0 computes, rank 1 receives)."""
    out = worker_output(shared_launch[__name__])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize(("case", "expected"), [
    ("raises_runtime_error", [f"{WORKER}.raises_runtime_error raised on global rank 0",
                              "RuntimeError: the chat template failed. second line.",
                              "traceback is logged on that rank (logger 'model.replica')"]),
    ("returns_a_lock", [f"Pickling the result of {WORKER}.returns_a_lock (a lock)", "global rank 0",
                        "TypeError: cannot pickle '_thread.lock' object", "Return plain data"]),
    ("returns_a_lambda", [f"Pickling the result of {WORKER}.returns_a_lambda (a function)", "global rank 0",
                          "<lambda>", "Return plain data"]),
])
def test_any_exception_stops_every_rank_with_one_paragraph(ranks, case, expected):
    computing, receiving = ranks[0][case], ranks[1][case]
    assert computing["error"] == receiving["error"] == "UserError"
    assert computing["message"] == receiving["message"]
    assert "\n" not in computing["message"]
    for part in expected:
        assert part in computing["message"]
    # The traceback is logged once, where it happened.
    assert (computing["tracebacks_logged"], receiving["tracebacks_logged"]) == (1, 0)
    assert max(computing["seconds"], receiving["seconds"]) < QUICK_SECONDS


def test_a_user_error_reaches_every_rank_as_it_is(ranks):
    message = "tools.calculator.timeout is 0; set it to a positive number of seconds."
    for rank in ranks:
        assert rank["raises_user_error"]["error"] == "UserError"
        assert rank["raises_user_error"]["message"] == message
        assert rank["raises_user_error"]["tracebacks_logged"] == 0
        assert rank["raises_user_error"]["seconds"] < QUICK_SECONDS


def test_after_the_failures_every_rank_gets_the_computed_value(ranks):
    assert [rank["returns_the_rank"]["value"] for rank in ranks] == [{"computed_on": 0}] * 2


def test_pipeline_stages_of_one_replica_share_one_computation(shared_launch):
    """At PP=2 the two ranks are one model replica's two stages: the user's code runs on the first stage only, and a
    failure there stops both stages with the same paragraph."""
    out = worker_output(shared_launch[__name__])
    stages = [json.loads((out / f"pp2-rank{rank}.json").read_text()) for rank in range(2)]
    assert [stage["returns_the_rank"]["value"] for stage in stages] == [{"computed_on": 0}] * 2
    failed = [stage["raises_runtime_error"] for stage in stages]
    assert failed[0]["error"] == failed[1]["error"] == "UserError" and failed[0]["message"] == failed[1]["message"]
    assert "the tensor- and pipeline-parallel ranks of one model replica" in failed[0]["message"]
    assert (failed[0]["tracebacks_logged"], failed[1]["tracebacks_logged"]) == (1, 0)
    assert max(stage["seconds"] for stage in failed) < QUICK_SECONDS
