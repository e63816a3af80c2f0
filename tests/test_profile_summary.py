"""benchmarks/profile_summary.py on small hand-written traces: kernel classes, busy time, a pipelined step's ticks
lined up over devices, a layer's calls by their place."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import profile_summary  # noqa: E402


def _write_trace(path: Path, events):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": meta + events}, fh)


def test_profile_summary_classes_and_busy_time(tmp_path):
    x = lambda name, ts, dur, pid=1, tid=1: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    _write_trace(tmp_path / "t" / "plugins", [
        x("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 600), x("nvjet_hsh_128x256", 600, 200),
        x("cudnn_generated_fort_native_sdpa_sm90", 800, 300), x("loop_add_fusion", 1100, 100),
        x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 900, 400, tid=2),  # overlaps on another stream
        x("PjitFunction(step)", 0, 5000, pid=2),  # host event: not device time
    ])
    s = profile_summary.summarize(tmp_path / "t", steps=2)
    assert s["by_class_ms"] == pytest.approx({"matmul": 0.4, "collective": 0.2, "attention": 0.15, "fusion": 0.05})
    assert s["busy_ms"] == pytest.approx(1.3 / 2)  # union of [0, 1200] and [900, 1300] us, per step
    assert s["top_kernels"][0]["class"] == "matmul" and s["events"] == 5
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        profile_summary.summarize(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"--device 3: the trace holds devices \[0\]; pass one of them"):
        profile_summary.summarize(tmp_path / "t", device=3)  # (it summed every device's events, once)


def test_profile_ticks_line_up_the_devices_shifts(tmp_path):
    x = lambda name, ts, dur, pid, tid=1: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    shift = "ncclDevKernel_SendRecv"
    # Device 0 computes 100 then 300 us a tick, device 1 200 then 100: each shift lasts until the slower is done.
    _write_trace(tmp_path / "t", [
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        x("gemm", 0, 100, 1), x(shift, 100, 100, 1, tid=2), x(shift, 200, 10, 1, tid=2),  # one shift, two kernels
        x("fusion", 210, 300, 1), x("ncclDevKernel_AllReduce", 510, 20, 1, tid=2), x(shift, 530, 50, 1, tid=2),
        x("gemm", 0, 200, 3), x(shift, 200, 10, 3, tid=2),
        x("fusion", 210, 100, 3), x(shift, 310, 270, 3, tid=2), x("gemm", 580, 50, 3),  # after the last shift
    ])
    s = profile_summary.tick_summary(tmp_path / "t", (0, 1))
    assert s["ticks"] == {0: 2, 1: 2} and s["lined_up"] == 2
    assert s["per_device_ms"][0] == pytest.approx({"compute": 0.4, "collective": 0.02, "shift": 0.16, "skew": 0.1})
    assert s["per_device_ms"][1] == pytest.approx({"compute": 0.3, "collective": 0.0, "shift": 0.28, "skew": 0.2})
    assert [w["tick"] for w in s["widest"]] == [1, 0] and s["widest"][0]["compute_ms"] == pytest.approx([0.3, 0.1])
    assert "skew 0.2" in profile_summary.format_ticks(s)


def test_profile_ticks_cut_at_the_tick_loops_shifts_only(tmp_path):
    """The head's sends (another op, at some ticks only) are shift time of their tick, not a cut: the devices' pieces
    still line up one a tick."""
    x = lambda op, ts, dur, pid, tid=1: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                                         "args": {"hlo_op": op},
                                         "name": "ncclDevKernel_SendRecv" if "permute" in op else "gemm"}
    _write_trace(tmp_path / "t", [
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        x("dot.1", 0, 100, 1), x("ppermute.7", 100, 20, 1, tid=2), x("dot.1", 120, 50, 1),  # a head send in tick 0
        x("ppermute.3", 170, 10, 1, tid=2), x("dot.1", 180, 100, 1), x("ppermute.3", 280, 10, 1, tid=2),
        x("dot.1", 0, 150, 3), x("ppermute.3", 170, 10, 3, tid=2), x("dot.1", 180, 80, 3),
        x("ppermute.3", 280, 10, 3, tid=2),
    ])
    s = profile_summary.tick_summary(tmp_path / "t", (0, 1))
    assert s["ticks"] == {0: 2, 1: 2} and s["lined_up"] == 2
    assert s["per_device_ms"][0] == pytest.approx({"compute": 0.25, "collective": 0.0, "shift": 0.04, "skew": 0.0})
    assert s["per_device_ms"][1] == pytest.approx({"compute": 0.23, "collective": 0.0, "shift": 0.02, "skew": 0.02})


def test_profile_calls_by_their_place_in_a_layer(tmp_path, capsys):
    """--calls: the matching kernels of one step (of two traced) in launch order, forward and backward runs, each
    cut into a layer's cycle of calls: the time each of a layer's kernels takes."""
    x = lambda name, ts, dur: {"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur}
    durations = [10, 20, 11, 21, 30, 40, 31, 41] * 2  # two steps of 2 layers: forward places 10/20, backward 30/40
    events = [x("body_mosaic_gpu_kernel", 100 * i, d) for i, d in enumerate(durations)]
    _write_trace(tmp_path / "t", events + [x("gemm", 5, 1)])
    rows = profile_summary.calls(tmp_path / "t", "mosaic", cycle=2, segments=2, steps=2)
    assert [(r["segment"], r["place"], r["calls"], r["min_us"], r["max_us"]) for r in rows] == [
        (0, 0, 2, 10, 11), (0, 1, 2, 20, 21), (1, 0, 2, 30, 31), (1, 1, 2, 40, 41)]
    assert rows[3]["ms_per_step"] == pytest.approx(0.081)
    assert profile_summary.main([str(tmp_path / "t"), "--calls", "mosaic", "--cycle", "2", "--segments", "2",
                                 "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "segment 1 place 1: 2 calls, median 40.5 us (least 40.0, most 41.0), 0.08 ms a step" in out
    for bad, said in ((["--calls", "nothing"], "no kernel of the trace matches"), (["--calls", "("], "no regular")):
        assert profile_summary.main([str(tmp_path / "t"), *bad]) == 2 and said in capsys.readouterr().err
    with pytest.raises(ValueError, match="each must be at least 1"):  # the function's own check, for callers
        profile_summary.calls(tmp_path / "t", "mosaic", cycle=0)


@pytest.mark.parametrize("argv, fix", [
    (["/nonexistent"], "error: /nonexistent is not a directory; pass the directory a trace was written into"),
    (["EMPTY"], "error: no perfetto_trace.json.gz under"),  # FileNotFoundError tracebacks, once
    (["BAD"], "perfetto_trace.json.gz is not a readable trace"),
    (["EMPTY", "--steps", "0"], "argument --steps: must be in [1, 10000], got 0"),  # once a ZeroDivisionError
    (["EMPTY", "--top", "0"], "argument --top: must be >= 1, got 0"),
    (["EMPTY", "--device", "-1"], "argument --device: must be >= 0, got -1"),  # once every device's events
    (["EMPTY", "--ticks", "--devices", "0", "-1"], "argument --devices: must be >= 0, got -1"),
    (["EMPTY", "--calls", "mosaic", "--cycle", "0"], "argument --cycle: must be >= 1, got 0"),
    (["EMPTY", "--calls", "mosaic", "--segments", "0"], "argument --segments: must be >= 1, got 0"),
])
def test_profile_summary_bad_requests_are_one_line(tmp_path, capsys, argv, fix):
    """A missing directory, one without a trace or with a broken one, and every bad number: one error line naming
    it, exit status 2."""
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "BAD").mkdir()
    (tmp_path / "BAD" / "perfetto_trace.json.gz").write_bytes(gzip.compress(b"{cut short"))
    argv = [str(tmp_path / a) if a in ("EMPTY", "BAD") else a for a in argv]
    try:
        status = profile_summary.main(argv)
    except SystemExit as e:  # argparse's refusal
        status = e.code
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 1 and fix in errors[0], errors
