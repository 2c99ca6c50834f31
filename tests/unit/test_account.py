"""The job's account of its batches decides its exit status (persia_nats.services.nn_worker.account.verdict)."""

from __future__ import annotations

from persia_nats.services.nn_worker.account import _reason_kind, verdict


def account(**kw):
    base = {"published": 100, "trained_once": 95, "trained_more_than_once": 2, "dead_lettered": 3,
            "dead_lettered_by_reason": {"not the job's schema": 3}, "left": 0, "lost": 0}
    return {**base, **kw}


def test_a_job_that_trained_what_it_was_given_passes():
    assert verdict(account(), 0.5) is None
    assert verdict({"trained_once": 3, "trained_more_than_once": 0}, 1.0) is None  # no stream: nothing to judge


def test_a_lost_batch_fails_the_job_with_one_line_naming_the_counts():
    line = verdict(account(trained_once=94, lost=1), 0.0)
    assert line is not None and "\n" not in line
    assert line.startswith("1 of 100 published batch(es) lost") and "96 trained, 3 dead-lettered, 0 left" in line


def test_too_small_a_trained_share_fails_the_job():
    line = verdict(account(trained_once=8, trained_more_than_once=0, dead_lettered=92,
                           dead_lettered_by_reason={"not the job's schema": 92}), 0.5)
    assert line is not None and line.startswith("trained 8 of 100 published batch(es) (8.0%), under")
    assert "min_trained_share 50%" in line and "not the job's schema" in line


def test_dead_letter_reasons_are_grouped_by_their_first_clause():
    assert _reason_kind("training step failed 2 time(s): forward raised ValueError: x") == \
        "training step failed N time(s)"
    assert _reason_kind("not the job's schema: features: unknown slot 'a'") == "not the job's schema"
    assert _reason_kind("") == "unknown"
