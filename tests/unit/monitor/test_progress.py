"""Progress lines for a log file: the time left, and the memory shown."""

from kiln.monitor.progress import ProgressLines, duration, memory


def test_duration_reads_at_a_glance():
    assert [duration(s) for s in (0, 45.4, 725, 3 * 3600 + 125, 2 * 86400 + 4 * 3600)] == [
        "0s", "45s", "12m05s", "3h02m", "2d04h"]


def test_time_left_is_measured_from_the_first_line_at_the_pace_since():
    now = [100.0]
    written = []
    lines = ProgressLines(written.append, total=100, clock=lambda: now[0])
    lines.begin(0)
    now[0] = 160.0  # start-up and compilation: a slow first interval, left out after the first line
    lines(10, {"loss": 3.0, "lr": 1e-3})
    now[0] = 170.0  # then 1 s a step
    lines(20, {"loss": 2.0, "lr": 1e-3})
    assert "eta 9m00s" in written[0]  # 6 s a step from the start: the only measure there is yet
    assert "eta 1m20s" in written[1]  # 1 s a step since the first line, 80 steps left
    assert "tok/s" not in written[0] and "mem" not in written[0]


def test_memory_prefers_the_gpu_peak_then_the_host_peak():
    assert memory({"peak_mem_gib": 3.5, "sys/rss_gib": 1.0}) == "GPU 3.50 GiB"
    assert memory({"sys/peak_rss_gib": 1.25, "sys/rss_gib": 1.0}) == "host 1.25 GiB"
    assert memory({"loss": 1.0}) is None
