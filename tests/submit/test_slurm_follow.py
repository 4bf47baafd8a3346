"""wait=true follows a job without asking sacct every second: the back-off schedule."""

from itertools import islice

from axonn_launch.scheduler.slurm_jobs import Pacer, check_delays


class VirtualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_delays_double_from_one_second_to_a_minute():
    assert list(islice(check_delays(), 9)) == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def checks_over(seconds: int, restart_at: int | None = None) -> list[float]:
    """When follow() would call sacct, streaming the log every second for ``seconds``."""
    clock = VirtualClock()
    pacer, checks = Pacer(clock), []
    for tick in range(seconds):
        clock.now = float(tick)
        if tick == restart_at:
            pacer.restart()
        if pacer.due():
            checks.append(clock.now)
            pacer.checked()
    return checks


def test_ten_minutes_of_following_ask_sacct_fifteen_times_not_six_hundred():
    checks = checks_over(600)
    assert checks[:8] == [0, 1, 3, 7, 15, 31, 63, 123]
    assert all(b - a == 60 for a, b in zip(checks[6:], checks[7:], strict=False))
    assert len(checks) == 15


def test_results_written_start_the_schedule_over():
    # the tasks wrote their results at t=100: ask at once, then 1, 2, 4 ... s later
    checks = checks_over(120, restart_at=100)
    assert checks == [0, 1, 3, 7, 15, 31, 63, 100, 101, 103, 107, 115]
