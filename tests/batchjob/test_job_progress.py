"""pipeline.batchjob.progress: the job's progress in its requests, across runs: counts as the
answer log has them, rates over the latest window, an ETA, the line the user reads, and the
stage that paced a run."""

from __future__ import annotations

import random

import pytest

from pipeline.batchjob.progress import (
    RATE_WINDOW_S,
    WINDOW_LIMIT_SAMPLES,
    JobCounts,
    JobTracker,
    format_duration,
    format_job_line,
    paced_by,
)


def test_before_two_observations_there_is_no_rate() -> None:
    tracker = JobTracker(100)
    view = tracker.view()
    assert (view.done, view.to_do, view.requests_per_s, view.eta_s, view.elapsed_s) == (0, 100, None, None, 0.0)
    tracker.observe(JobCounts(done=40, failed=2), 5.0)
    tracker.check_invariants()
    view = tracker.view()
    assert (view.done, view.failed, view.to_do, view.requests_per_s) == (40, 2, 60, None)
    assert format_job_line(view) == ("run-batch: 40 of 100 requests answered (40.0%), 2 failed, 60 to do; starting")


def test_a_job_of_one_request_says_one_request() -> None:
    assert format_job_line(JobTracker(1).view()) == "run-batch: 0 of 1 request answered (0.0%), 0 failed, 1 to do; starting"


def test_a_steady_pace_gives_its_rates_and_eta() -> None:
    tracker = JobTracker(1000)
    for second in range(6):
        tracker.observe(JobCounts(done=200 + 10 * second, completion_tokens=160 * second), 100.0 + second)
        tracker.check_invariants()
    view = tracker.view()
    assert view.requests_per_s == pytest.approx(10.0) and view.tokens_per_s == pytest.approx(160.0)
    assert view.eta_s == pytest.approx(750 / 10.0) and view.elapsed_s == 5.0
    assert format_job_line(view) == ("run-batch: 250 of 1,000 requests answered (25.0%), 0 failed, 750 to do; "
                                     "10 requests/s, 160 tokens/s, ETA 1m15s")


def test_the_rate_follows_a_change_of_pace_within_the_window() -> None:
    tracker = JobTracker(10_000)
    done = 0
    for second in range(30):
        done += 100
        tracker.observe(JobCounts(done=done), float(second))
    for second in range(30, 30 + int(RATE_WINDOW_S) + 2):
        tracker.observe(JobCounts(done=done), float(second))
        tracker.check_invariants()
    view = tracker.view()
    assert view.requests_per_s == 0.0 and view.eta_s is None
    assert "0 requests/s" in format_job_line(view) and "ETA" not in format_job_line(view)


def test_the_window_holds_at_most_its_limit_of_samples() -> None:
    tracker = JobTracker(10 * WINDOW_LIMIT_SAMPLES)
    for k in range(3 * WINDOW_LIMIT_SAMPLES):
        tracker.observe(JobCounts(done=k), 1.0 + k * 1e-6)
        tracker.check_invariants()
    assert tracker.view().requests_per_s == pytest.approx(1e6, rel=1e-3)


def test_observations_at_one_instant_give_no_rate() -> None:
    tracker = JobTracker(10)
    tracker.observe(JobCounts(done=1), 3.0)
    tracker.observe(JobCounts(done=2), 3.0)
    assert tracker.view().requests_per_s is None


def test_a_finished_job_shows_no_eta() -> None:
    tracker = JobTracker(50)
    tracker.observe(JobCounts(done=0), 0.0)
    tracker.observe(JobCounts(done=50, failed=5, by_status={200: 45, 400: 5}), 10.0)
    view = tracker.view()
    assert (view.to_do, view.eta_s) == (0, 0.0)
    assert format_job_line(view) == ("run-batch: 50 of 50 requests answered (100.0%), 5 failed, 0 to do; "
                                     "5 requests/s, 0 tokens/s")
    assert view.as_json()["by_status"] == {"200": 45, "400": 5}


def test_more_answers_than_requests_is_our_bug() -> None:
    with pytest.raises(AssertionError):
        JobTracker(3).observe(JobCounts(done=4), 0.0)


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0, "0s"), (59.4, "59s"), (59.6, "1m00s"), (61, "1m01s"),
                                               (3599, "59m59s"), (3600, "1h00m00s"), (90061, "25h01m01s")])
def test_durations_read_as_hours_minutes_seconds(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_a_random_run_keeps_the_invariants_after_every_observation() -> None:
    rng = random.Random(20240601)
    requests = 5000
    tracker = JobTracker(requests)
    counts = JobCounts()
    now, first = 1000.0, None
    samples: list[tuple[float, int, int]] = []
    while counts.done < requests:
        answered = min(requests - counts.done, rng.choice((0, 0, 1, 3, 40)))
        failed = rng.randint(0, answered)
        counts = JobCounts(done=counts.done + answered, failed=counts.failed + failed,
                           prompt_tokens=counts.prompt_tokens + 20 * answered,
                           completion_tokens=counts.completion_tokens + 16 * (answered - failed),
                           by_status={200: counts.done + answered - counts.failed - failed,
                                      400: counts.failed + failed})
        now += rng.choice((0.0, 0.001, 0.25, 1.0, 3.0, RATE_WINDOW_S + 1))
        tracker.observe(counts, now)
        tracker.check_invariants()
        first = now if first is None else first
        samples.append((now, counts.done, counts.completion_tokens))
        view = tracker.view()
        assert (view.done, view.failed, view.to_do) == (counts.done, counts.failed, requests - counts.done)
        assert view.elapsed_s == now - first and view.by_status == counts.by_status
        if view.requests_per_s is not None:  # an average since a sample of the window (or the one before)
            starts = [s for s in samples[:-1] if now - s[0] <= RATE_WINDOW_S or s is samples[-2]]
            assert any(s[0] < now and view.requests_per_s == pytest.approx((counts.done - s[1]) / (now - s[0]))
                       and view.tokens_per_s == pytest.approx((counts.completion_tokens - s[2]) / (now - s[0]))
                       for s in starts)
            if view.eta_s is not None:
                assert view.eta_s == pytest.approx(view.to_do / view.requests_per_s)
        else:
            assert len(samples) < 2 or samples[-2][0] == now  # no time passed over the window
        format_job_line(view)
    assert tracker.view().to_do == 0


def test_the_jobs_metrics_count_answers_by_status_and_latencies_in_buckets():
    from prometheus_client import CollectorRegistry, generate_latest

    from pipeline.batchjob.telemetry import LATENCY_BUCKETS_S, JobTelemetry

    class Log:
        requests = 10
        by_status = {200: 6, 400: 1}

    telemetry = JobTelemetry(Log())
    telemetry.observe([0.01, 0.3, 0.3, 7.0, LATENCY_BUCKETS_S[-1] * 2])
    telemetry.observe([])
    registry = CollectorRegistry()
    registry.register(telemetry)
    text = generate_latest(registry).decode()
    assert 'shape_broker_job_requests_answered_total{status="200"} 6.0' in text
    assert 'shape_broker_job_requests_answered_total{status="400"} 1.0' in text
    assert "shape_broker_job_requests_to_do 3.0" in text
    assert 'shape_broker_job_request_latency_seconds_bucket{le="0.05"} 1.0' in text
    assert 'shape_broker_job_request_latency_seconds_bucket{le="0.5"} 3.0' in text
    assert 'shape_broker_job_request_latency_seconds_bucket{le="10"} 4.0' in text
    assert 'shape_broker_job_request_latency_seconds_bucket{le="+Inf"} 5.0' in text
    assert "shape_broker_job_request_latency_seconds_count 5.0" in text


@pytest.mark.parametrize("producers, consumers, starts", [
    (0.8, 0.5, "making prompts (the producers were busy 80%"),  # at the bar
    (0.79, 0.5, "no stage was busy most of the run (producers busy 79%, consumers busy 50%)"),  # one below
    (0.9, None, "making prompts"),
    (0.85, 0.95, "the engines (the consumers were busy 95%"),  # both busy: the busier
    (None, 0.8, "the engines"),
    (None, None, "no stage was busy most of the run ()"),
])
def test_the_stage_that_paced_a_run(producers, consumers, starts) -> None:
    assert paced_by(producers, consumers).startswith(starts)
