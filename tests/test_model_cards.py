"""The model cards' reader of training checkpoints (benchmarks/render_docs.py): phases split by
``phase_iterations`` (or each phase's ``iters``), wall seconds that survive a clock restart, and loud errors."""
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import render_docs as R  # noqa: E402


def _save(folder: Path, history, phases, lengths=None, name: str = "m.pth") -> None:
    state = {"model_ema": {"w": torch.zeros(3, 4), "b": torch.zeros(5)}, "loss_history": history,
             "train_phases": phases, "mar_probe_config": {"name": "x"}}
    if lengths is not None:
        state["phase_iterations"] = lengths
    torch.save(state, folder / name)


def test_phases_split_by_iters_and_a_restarted_clock_counts_from_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "DATA", tmp_path)
    # phase 0: 3 iterations of 2 s; phase 1 restarted its clock: 4 s, then 1 s each
    history = [[0, 2.0, 2.0], [1, 1.0, 4.0], [2, 0.5, 6.0], [3, 0.4, 4.0], [4, 0.3, 5.0], [5, 0.2, 6.0]]
    _save(tmp_path, history, [{"iters": 3}, {"iters": 3, "max_minutes": 1}])
    ck = R.TrainingCheckpoint("m.pth")
    assert ck.params == 17 and ck.resets == 1 and ck.iterations == 6 and ck.rel == "data/m.pth"
    p0, p1 = ck.phases
    assert (p0.iterations, p0.wall_seconds, p0.seconds_per_iteration(), p0.outcome) == (3, 6.0, 2.0, "completed")
    assert (p1.start, p1.end, p1.wall_seconds, p1.seconds_per_iteration()) == (3, 6, 6.0, 1.0)
    assert p1.loss_last100 == pytest.approx(0.3) and ck.wall_seconds == 12.0 and ck.first_loss == 2.0


def test_phase_iterations_win_and_a_phase_stopped_by_the_clock_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "DATA", tmp_path)
    history = [[i, 1.0, 30.0 * (i + 1)] for i in range(4)]
    _save(tmp_path, history, [{"iters": 100, "max_minutes": 1}, {"iters": 50, "max_minutes": 5}], lengths=[2, 2])
    p0, p1 = R.TrainingCheckpoint("m.pth").phases
    assert (p0.iterations, p0.outcome) == (2, "stopped by the clock")
    assert (p1.iterations, p1.outcome) == (2, "stopped early")


def test_the_loss_after_the_warm_up_and_the_last_100_iterations_standard_error(tmp_path, monkeypatch):
    """The phase table's restart column (issue 14): the mean of the n iterations after the phase's warm-up, beside
    the previous phase's last-100 mean and its standard error."""
    monkeypatch.setattr(R, "DATA", tmp_path)
    # phase 0: 4 iterations, warm-up 1; phase 1: 5 iterations, warm-up 2, losses 9 9 | 3 4 5
    losses = [2.0, 1.0, 0.5, 0.3] + [9.0, 9.0, 3.0, 4.0, 5.0]
    history = [[i, v, float(i + 1)] for i, v in enumerate(losses)]
    _save(tmp_path, history, [{"iters": 4, "warmup_iters": 1}, {"iters": 5, "warmup_iters": 2}])
    p0, p1 = R.TrainingCheckpoint("m.pth").phases
    assert p0.loss_after_warmup(2) == pytest.approx(0.75) and p1.loss_after_warmup(2) == pytest.approx(3.5)
    assert p1.loss_after_warmup() == pytest.approx(4.0)             # fewer than n after the warm-up: all of them
    assert p1.loss_last100_sem == pytest.approx(statistics.stdev(losses[4:]) / 5 ** 0.5)
    _save(tmp_path, [[0, 1.0, 1.0]], [{"iters": 1, "warmup_iters": 5}])
    (only,) = R.TrainingCheckpoint("m.pth").phases
    assert only.loss_after_warmup() == 1.0 and math.isnan(only.loss_last100_sem)   # still warming up: its tail


def test_iteration_counts_that_do_not_add_up_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "DATA", tmp_path)
    _save(tmp_path, [[0, 1.0, 1.0], [1, 1.0, 2.0]], [{"iters": 5}])
    with pytest.raises(ValueError, match=r"adding up to the 2 rows of its loss history, got \[5\]"):
        R.TrainingCheckpoint("m.pth")
    with pytest.raises(FileNotFoundError, match="expected a committed file under data/"):
        R.TrainingCheckpoint("missing.pth")


def test_the_training_line_lists_the_phases_beyond_the_shipped_file_and_refuses_another_run(tmp_path, monkeypatch):
    """Issue 14: phases trained after shipping lie in data/training/ until they score better; the card appends them
    only when that file continues the shipped one's training."""
    monkeypatch.setattr(R, "DATA", tmp_path)
    (tmp_path / "training").mkdir()
    history = [[i, 1.0 / (i + 1), float(i + 1)] for i in range(5)]
    _save(tmp_path, history[:3], [{"iters": 2}, {"iters": 1}])
    _save(tmp_path / "training", history, [{"iters": 2}, {"iters": 1}, {"iters": 4}], lengths=[2, 1, 2])
    shipped, line = R.TrainingCheckpoint("m.pth"), R.training_line("training/m.pth")
    (ahead,) = line.phases_after(shipped)
    assert (ahead.index, ahead.start, ahead.iterations, ahead.outcome) == (2, 3, 2, "stopped early")
    assert line.phases_after(line) == [] and R.training_line("training/none.pth") is None
    other = [[i, 2.0, float(i + 1)] for i in range(5)]            # the same phase lengths, other losses
    _save(tmp_path / "training", other, [{"iters": 2}, {"iters": 1}, {"iters": 2}])
    with pytest.raises(ValueError, match=r"'data/training/m.pth' does not continue 'data/m.pth'.*iterations \[2, 1\]"):
        R.training_line("training/m.pth").phases_after(shipped)
    with pytest.raises(ValueError, match="does not continue"):
        shipped.phases_after(line)                                # fewer phases than the file it should continue


def test_duration_sci_and_target_misses():
    assert R.duration(4752.84) == "79 min 13 s" and R.sci(0.0006) == "6e-4" and R.sci(2.4287e-9) == "2.4e-9"
    row = {"class_accuracy": 0.878, "frechet_ratio": 13.79, "per_class_accuracy": {"Bag": 1.0, "Pullover": 0.36}}
    assert R.target_misses(row) == ["class accuracy 0.878 < 0.90", "Pullover 0.36 < 0.60", "Fréchet ratio 13.8x > 5x"]
    assert R.per_class_text(row) == "Bag 1.00, **Pullover 0.36**"


def test_apart_compares_two_intervals_or_an_interval_with_a_number():
    chance, attention = 0.205, {"mean": 0.156, "lo": 0.144, "hi": 0.168}
    assert R.apart(chance, attention) == -1 and R.apart(attention, chance) == 1   # below chance, seen from either side
    assert R.apart(chance, {"lo": 0.19, "hi": 0.22}) == 0                      # the interval holds the number
    assert R.apart({"lo": 0.1, "hi": 0.2}, {"lo": 0.2, "hi": 0.3}) == 0        # touching ends are not apart
    assert R.apart({"lo": 0.1, "hi": 0.2}, {"lo": 0.21, "hi": 0.3}) == 1
    assert R.apart({"lo": None, "hi": None}, 0.5) == 0                         # no interval: nothing told apart


def test_classifier_card_floor_text_and_counts():
    assert [R.Floor(1, m, s).text for m, s in [(25.268, 4.593), (4.9195, 1.0893), (0.37749, 0.04175)]] == [
        "25.27 ± 4.59", "4.920 ± 1.089", "0.377 ± 0.042"]
    assert [R.count_text(n) for n in (100, 1000, 10000, 2500)] == ["100", "1k", "10k", "2500"]


def test_classifier_card_refuses_statistics_of_another_classifier(tmp_path, monkeypatch):
    import shutil

    import numpy as np
    shutil.copy(R.DATA / "fashion_classifier.pt", tmp_path / "c.pt")
    with np.load(R.DATA / "fashion_test_stats.npz") as z:
        np.savez(tmp_path / "s.npz", **{**{k: z[k] for k in z.files}, "classifier_fingerprint": np.asarray("f" * 64)})
    monkeypatch.setattr(R, "DATA", tmp_path)
    with pytest.raises(ValueError, match=r"'data/s.npz' belongs to classifier 'f{64}', expected that of 'data/c.pt'"):
        R.ClassifierFiles("c.pt", "s.npz")


def test_a_row_scored_from_the_same_path_is_not_the_current_weights_unless_its_iterations_match(tmp_path, monkeypatch):
    """The committed file is replaced by every phase: a row whose source is that path but whose iterations are an
    earlier phase's did not score the current weights (the card then says 'not scored yet')."""
    import json
    from types import SimpleNamespace
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    rows = [{"preset": "p5", "source": "data/training/m.pth", "params": 10, "iterations": 300},
            {"preset": "p6-run", "source": "runs/p6/m.pth", "params": 10, "iterations": 400}]
    (tmp_path / "progress.json").write_text(json.dumps({"rows": rows, "protocol": "x", "command": "y"}))
    prog = R.ProgressResults("progress.json")
    ckpt = SimpleNamespace(rel="data/training/m.pth", params=10, iterations=400)
    assert prog.scored(ckpt)["preset"] == "p6-run"
    assert prog.scored(SimpleNamespace(rel="data/training/m.pth", params=10, iterations=500)) is None
    assert prog.scored(SimpleNamespace(rel="data/training/m.pth", params=10, iterations=300))["preset"] == "p5"


def test_a_packed_history_reads_as_its_rows(tmp_path, monkeypatch):
    """Exports of phases 11-19 pack their loss history inside (mar_probe.models.checkpoints.pack_history), later
    ones keep it beside them (write_history); the card reads the same phases, seconds and losses from either as
    from the rows."""
    from mar_probe.models.checkpoints import pack_history, write_history
    monkeypatch.setattr(R, "DATA", tmp_path)
    history = [[i, 1.0 / (i + 1), 30.0 * (i + 1)] for i in range(4)]
    phases = [{"iters": 2, "max_minutes": 5}, {"iters": 2, "max_minutes": 5}]
    _save(tmp_path, history, phases, lengths=[2, 2])
    rows = R.TrainingCheckpoint("m.pth")
    _save(tmp_path, pack_history(history), phases, lengths=[2, 2])
    packed = R.TrainingCheckpoint("m.pth")
    for a, b in zip(rows.phases, packed.phases):
        assert (a.start, a.iterations, a.seconds) == (b.start, b.iterations, b.seconds)
        assert a.losses == pytest.approx(b.losses, rel=2 ** -11)  # float16's rounding
    state = torch.load(tmp_path / "m.pth", weights_only=False)
    del state["loss_history"]                                     # exports since phase 20: the history beside
    torch.save(state, tmp_path / "m.pth")
    write_history(tmp_path / "m.pth", history)
    beside = R.TrainingCheckpoint("m.pth")
    for a, b in zip(rows.phases, beside.phases):
        assert (a.start, a.iterations, a.seconds) == (b.start, b.iterations, b.seconds)
        assert a.losses == pytest.approx(b.losses, rel=2 ** -24)  # float32's rounding


def _screen(folder: Path, name: str, iterations: int, fd: float, protocol=None) -> None:
    row = {"temperature": 0.6, "cfg": 3.0, "frechet_distance": fd, "class_accuracy": 0.9}
    other = dict(row, temperature=1.0, frechet_distance=99.0)  # another setting: not in the series
    (folder / name).write_text(R.json.dumps({"iterations": iterations, "command": "c", "rows": [row, other],
                                             "protocol": protocol or {"per_class": 100, "seed": 1}}))


def test_screen_series_paces_per_iteration_across_machines_and_refuses_mixed_protocols(tmp_path, monkeypatch):
    """The 1,000-image table: a score per phase end, the fall between scores per hour and per 1,000 iterations (the
    pace that compares a CPU phase with an accelerator's), the phases' rates and machines between two scores."""
    monkeypatch.setattr(R, "DATA", tmp_path)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    history = [[i, 1.0, 3600.0 * (i + 1)] for i in range(4)] + [[4 + i, 1.0, 14400.0 + 36 * (i + 1)]
                                                                 for i in range(4)]
    phases = [{"iters": 2, "lr": 3e-4}, {"iters": 2, "lr": 1.5e-4, "device": "cpu"},
              {"iters": 4, "lr": 3e-4, "device": "cuda:0"}]
    _save(tmp_path, history, phases, lengths=[2, 2, 4])
    ck = R.TrainingCheckpoint("m.pth")
    _screen(tmp_path, "s_p0.json", 2, 40.0)
    _screen(tmp_path, "s_p2.json", 8, 34.0)
    series = R.screen_series(ck, "s_p*.json", temperature=0.6, cfg=3.0)
    assert [(pt.phase.index, pt.hours, pt.row["frechet_distance"]) for pt in series] == [(0, 2.0, 40.0),
                                                                                      (2, 4.04, 34.0)]
    (step,) = R.screen_steps(ck, series)
    assert step.rates == (1.5e-4, 3e-4) and step.devices == ("cpu", "cuda")
    assert step.fall_per_k_iterations == pytest.approx(1000 * 6 / 6)
    assert step.fall_per_hour == pytest.approx(6 / 2.04)
    running = {"iterations": 99, "command": "c", "rows": [], "protocol": {"per_class": 20, "seed": 1}}
    (tmp_path / "s_p9.json").write_text(R.json.dumps(running))  # a screen still running, of weights not yet committed
    assert R.screen_series(ck, "s_p*.json", temperature=0.6, cfg=3.0) == series
    (tmp_path / "s_p9.json").unlink()
    _screen(tmp_path, "s_p1.json", 4, 37.0, protocol={"per_class": 20, "seed": 1})
    with pytest.raises(ValueError, match="used different protocols"):
        R.screen_series(ck, "s_p*.json", temperature=0.6, cfg=3.0)
    _screen(tmp_path, "s_p1.json", 3, 37.0)
    with pytest.raises(ValueError, match=r"'s_p1.json' scored weights after 3 iterations; no phase .* \[2, 4, 8\]"):
        R.screen_series(ck, "s_p*.json", temperature=0.6, cfg=3.0)


def test_screen_settings_takes_the_last_phase_scored_at_several_settings(tmp_path, monkeypatch):
    """The card's table of settings: found by the files' names, one row per setting (the first file's), best
    first; the phase scored at one setting only is not taken by default; a phase never scored is refused."""
    monkeypatch.setattr(R, "DATA", tmp_path)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _save(tmp_path, [[i, 1.0, 60.0 * (i + 1)] for i in range(6)], [{"iters": 2}, {"iters": 2}, {"iters": 2}],
          lengths=[2, 2, 2])
    ck = R.TrainingCheckpoint("m.pth")
    _screen(tmp_path, "s_p0.json", 2, 40.0)  # phase 0: T 0.6 (40.0) and T 1.0 (99.0)
    _screen(tmp_path, "s_p1.json", 4, 30.0)  # phase 1: the same two settings
    row = {"temperature": 0.8, "cfg": 3.0, "frechet_distance": 25.0, "class_accuracy": 0.9}
    (tmp_path / "s_p1_t08.json").write_text(R.json.dumps({"iterations": 4, "command": "c", "rows": [row],
                                                          "protocol": {"per_class": 100, "seed": 1}}))
    (tmp_path / "s_p1_z.json").write_text(R.json.dumps({"iterations": 4, "command": "c", "rows": [
        dict(row, frechet_distance=1.0)], "protocol": {"per_class": 100, "seed": 1}}))  # T 0.8 again: not taken
    (tmp_path / "s_p2.json").write_text(R.json.dumps({"iterations": 6, "command": "c", "rows": [row],
                                                      "protocol": {"per_class": 100, "seed": 1}}))
    got = R.screen_settings(ck, "s_p*.json")
    assert [(pt.phase.index, pt.rel, pt.row["temperature"], pt.row["frechet_distance"]) for pt in got] == [
        (1, "s_p1_t08.json", 0.8, 25.0), (1, "s_p1.json", 0.6, 30.0), (1, "s_p1.json", 1.0, 99.0)]
    assert [pt.row["frechet_distance"] for pt in R.screen_settings(ck, "s_p*.json", phase=0)] == [40.0, 99.0]
    with pytest.raises(ValueError, match=r"phase 5 of .* was not scored .*; phases scored: \[0, 1, 2\]"):
        R.screen_settings(ck, "s_p*.json", phase=5)
    with pytest.raises(ValueError, match=r"no phase .* more than one setting .* \(phases scored: \[2\]\)"):
        R.screen_settings(ck, "s_p2.json")


def test_screen_seeds_pairs_a_second_seed_with_the_first_at_the_same_phase_and_setting(tmp_path, monkeypatch):
    """Issue 14: how far one sampling seed's score is from another's, for the same weights and setting; a second
    seed's score that the first did not make is refused, naming what the first scored."""
    monkeypatch.setattr(R, "DATA", tmp_path)
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _save(tmp_path, [[i, 1.0, 60.0 * (i + 1)] for i in range(4)], [{"iters": 2}, {"iters": 2}], lengths=[2, 2])
    ck = R.TrainingCheckpoint("m.pth")
    _screen(tmp_path, "s_p0.json", 2, 40.0)
    _screen(tmp_path, "s_p1.json", 4, 30.0)
    row = {"temperature": 0.6, "cfg": 3.0, "frechet_distance": 31.5, "class_accuracy": 0.9}
    (tmp_path / "seed2_p1.json").write_text(R.json.dumps({"iterations": 4, "command": "c", "rows": [row],
                                                          "protocol": {"per_class": 100, "seed": 2}}))
    first = R.screen_series(ck, "s_p*.json", temperature=0.6, cfg=3.0)
    (pair,) = R.screen_seeds(ck, first, "seed2_p*.json")
    assert (pair.first.rel, pair.second.rel, pair.first.phase.index) == ("s_p1.json", "seed2_p1.json", 1)
    assert pair.difference == pytest.approx(1.5)
    _screen(tmp_path, "seed2_p1.json", 4, 31.5, protocol={"per_class": 100, "seed": 2})  # adds a T 1.0 row
    with pytest.raises(ValueError, match=r"'seed2_p1.json' scored phase 1 at T 1.0, CFG 3.0, which the first seed "
                                         r"did not score; it did: \[\(0, 0.6, 3.0\), \(1, 0.6, 3.0\)\]"):
        R.screen_seeds(ck, first, "seed2_p*.json")
