"""Training: the recipe runs on real images, checkpoints resume exactly, EMA export loads."""
import pytest
import torch

from mar_probe import load_model
from mar_probe.models.checkpoints import CheckpointError, history_file, history_rows, pack_history, read_history
from mar_probe.train import TrainConfig, average_exports, export_ema, lr_at, train


def _cfg(tmp_path, iters):
    return TrainConfig(preset="mar_tiny", dataset="digits", out_dir=str(tmp_path), iters=iters, batch_size=8,
                       warmup_iters=2, ckpt_every=2, amp="none", threads=1)


def test_resume_is_identical_to_uninterrupted(tmp_path, monkeypatch):
    from mar_probe.models.mar import MAR
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(a, 4))
    calls, forward = [], MAR.forward

    def interrupted(self, *args, **kwargs):  # Ctrl-C in the middle of the third iteration
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(MAR, "forward", interrupted)
    from mar_probe.train import TrainingInterrupted
    with pytest.raises(TrainingInterrupted, match=r"interrupted after iteration 2 of 4; .* is saved: rerun"):
        train(_cfg(b, 4))
    state = torch.load(b / "checkpoint-last.pth", weights_only=False)
    assert state["epoch"] == 2
    monkeypatch.setattr(MAR, "forward", forward)
    train(_cfg(b, 4))  # resumes from iteration 2 with the RNG state saved after iteration 2
    sa = torch.load(a / "checkpoint-last.pth", weights_only=False)
    sb = torch.load(b / "checkpoint-last.pth", weights_only=False)
    assert [h[1] for h in sa["loss_history"]] == [h[1] for h in sb["loss_history"]]
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k


def test_export_loads_as_model(tmp_path):
    ckpt = train(_cfg(tmp_path, 2))
    slim = export_ema(ckpt, tmp_path / "slim.pth")
    model = load_model(slim)
    assert model.config.name == "mar_tiny" and not model.training
    assert slim.stat().st_size < ckpt.stat().st_size


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(iters=100, warmup_iters=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(cfg, 0) == 1e-4 and lr_at(cfg, 9) == 1e-3
    assert lr_at(cfg, 55) < 1e-3 and abs(lr_at(cfg, 100) - 1e-4) < 1e-12


def test_bad_train_config():
    with pytest.raises(ValueError, match="dataset must be 'fashion' or 'digits', got 'cifar'"):
        TrainConfig(dataset="cifar")
    with pytest.raises(ValueError, match="iters must be >= 1, got 0"):
        TrainConfig(iters=0)


def test_warm_start_copies_weights_and_rejects_other_presets(tmp_path):
    import dataclasses
    from mar_probe import create_model
    from mar_probe.models.checkpoints import CheckpointError
    src = train(_cfg(tmp_path / "src", 2))
    cfg = dataclasses.replace(_cfg(tmp_path / "warm", 1), init=str(src), lr=1e-12, min_lr=1e-12)
    warm = torch.load(train(cfg), weights_only=False)
    ema = torch.load(src, weights_only=False)["model_ema"]
    key = "z_proj.weight"
    assert torch.allclose(warm["model"][key], ema[key], atol=1e-6)  # lr ~ 0: weights stay where they started
    torch.save({"model_ema": create_model("mar_tiny_latent").state_dict()}, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match="mar_tiny_latent"):
        train(dataclasses.replace(_cfg(tmp_path / "bad", 1), init=str(tmp_path / "other.pth")))


def test_training_attention_kernel_gives_the_fused_kernels_loss_and_gradients():
    """The explicit kernel (training's default, faster under bf16 on a CPU) computes the same attention."""
    import numpy as np
    from mar_probe import create_model
    from mar_probe.models.blocks import set_attention_kernel
    x, labels = torch.randn(4, 4, 8, 8).clamp(-1, 1), torch.tensor([0, 1, 2, 3])  # tokens [B, C*s*s, h, w]
    losses, grads = [], []
    for kernel in ("sdpa", "explicit"):
        torch.manual_seed(0)
        model = create_model("mar_tiny").train()
        for p in model.diffloss.net.final_layer.parameters():  # zero at init: no gradient would reach attention
            torch.nn.init.normal_(p, std=0.02)
        set_attention_kernel(model, kernel)
        loss = model(x, labels, generator=torch.Generator().manual_seed(1), np_rng=np.random.default_rng(1))
        loss.backward()
        losses.append(loss.item())
        grads.append(model.encoder_blocks[0].attn.qkv.weight.grad.clone())
    assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[0]) and losses[0] > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert grads[0].abs().sum() > 0


def test_bad_kernel_and_time_budget_are_refused():
    from mar_probe import create_model
    from mar_probe.models.blocks import set_attention_kernel
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash'; expected one of \('sdpa', 'explicit'\)"):
        set_attention_kernel(create_model("mar_tiny"), "flash")
    with pytest.raises(ValueError, match=r"TrainConfig.attention must be one of .*got 'flash'"):
        TrainConfig(attention="flash")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_minutes must be a finite number >= 0"):
            TrainConfig(max_minutes=bad)


def test_time_budget_stops_then_a_rerun_resumes_to_the_end(tmp_path, capsys):
    import dataclasses
    budget = dataclasses.replace(_cfg(tmp_path, 4), max_minutes=1e-9)  # over budget after the first iteration
    state = torch.load(train(budget), weights_only=False)
    assert state["epoch"] == 1 and len(state["loss_history"]) == 1
    assert "stopping after iteration 1: --max-minutes 1e-09 reached" in capsys.readouterr().out
    state = torch.load(train(_cfg(tmp_path, 4)), weights_only=False)
    assert state["epoch"] == 4 and [h[0] for h in state["loss_history"]] == [0, 1, 2, 3]
    times = [h[2] for h in state["loss_history"]]
    assert times == sorted(times) and times[0] > 0  # wall time is cumulative over the resumed run


def test_cli_train_ctrl_c_exits_130_and_bad_values_leave_no_folder(tmp_path, monkeypatch, capsys):
    from mar_probe.cli import main
    from mar_probe.models.mar import MAR

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(MAR, "forward", interrupted)
    out = tmp_path / "run"
    args = ["train", "--preset", "mar_tiny", "--dataset", "digits", "--out", str(out), "--iters", "3", "--threads", "1"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "mar-probe train: interrupted after iteration 0 of 3;" in err and "Traceback" not in err
    assert (out / "checkpoint-last.pth").is_file()
    monkeypatch.undo()
    assert main(["train", "--preset", "nosuch", "--out", str(tmp_path / "bad")]) == 2
    assert "unknown preset 'nosuch'" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    bad_data = ["train", "--preset", "mar_tiny", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "b2")]
    assert main(bad_data) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "b2").exists()


def test_export_of_a_warm_start_carries_the_earlier_phases(tmp_path):
    """The export holds every phase's config and length; the loss history of all phases lies beside it in float32
    (issue 14: inside, it would outgrow the 25 MB cap), and a history of other weights, or none, is refused."""
    import dataclasses
    import shutil
    first = export_ema(train(_cfg(tmp_path / "p1", 3)), tmp_path / "p1.pth")
    second_cfg = dataclasses.replace(_cfg(tmp_path / "p2", 2), init=str(first), seed=1)
    second_path = export_ema(train(second_cfg), tmp_path / "p2.pth")
    second = torch.load(second_path, weights_only=False)
    assert second["phase_iterations"] == [3, 2] and len(second["train_phases"]) == 2
    assert second["train_phases"][1]["init"] == str(first) and second["train_phases"][0]["init"] is None
    assert "sampling_defaults" not in second  # the first phase's export recommended none
    assert "loss_history" not in second and history_file(second_path) == tmp_path / "p2.history.pth"
    packed = torch.load(tmp_path / "p2.history.pth", weights_only=True)
    assert packed["loss"].dtype == packed["step_seconds"].dtype == torch.float32
    history = read_history(second_path, second)
    assert [h[0] for h in history] == [0, 1, 2, 3, 4]
    times = [h[2] for h in history]
    assert times == sorted(times)
    p1 = torch.load(first, weights_only=False)
    assert [h[1] for h in history[:3]] == [h[1] for h in read_history(first, p1)]
    run = torch.load(tmp_path / "p2" / "checkpoint-last.pth", weights_only=False)["loss_history"]
    assert [h[1] for h in history[3:]] == [torch.tensor(h[1]).float().item() for h in run]
    shutil.copyfile(tmp_path / "p1.history.pth", tmp_path / "p2.history.pth")
    with pytest.raises(CheckpointError, match=r"'.*p2.history.pth' has 3 rows, but .*'.*p2.pth' was trained 5 "):
        read_history(second_path, second)
    (tmp_path / "p2.history.pth").unlink()
    with pytest.raises(CheckpointError, match=r"beside it, but '.*p2.history.pth' was not found"):
        read_history(second_path, second)


def test_the_next_phase_of_a_shipped_file_keeps_its_recommended_sampling_settings(tmp_path):
    """A phase warm-started from the embedded default (which recommends its sampling settings) exports a drop-in
    replacement: the same ``sampling_defaults``, read back by the loader."""
    import dataclasses
    from mar_probe.models.checkpoints import load_model, write_sampling_defaults
    first = export_ema(train(_cfg(tmp_path / "p1", 2)), tmp_path / "p1.pth")
    write_sampling_defaults(first, num_iter=8, cfg=5.0, temperature=0.8)
    second = export_ema(train(dataclasses.replace(_cfg(tmp_path / "p2", 1), init=str(first), seed=1)),
                        tmp_path / "p2.pth")
    assert load_model(second).sampling_defaults == {"num_iter": 8, "cfg": 5.0, "temperature": 0.8}


def test_a_warm_start_from_an_export_with_its_history_inside_carries_it_beside(tmp_path):
    """Exports of issue 14's phases 11-19 hold a float16 history inside; the next phase's export moves it beside."""
    import dataclasses
    first = export_ema(train(_cfg(tmp_path / "p1", 3)), tmp_path / "p1.pth")
    state = torch.load(first, weights_only=False)
    rows = read_history(first, state)
    old = tmp_path / "old.pth"
    torch.save(dict(state, loss_history=pack_history(rows)), old)                # as phase 19's file
    second = export_ema(train(dataclasses.replace(_cfg(tmp_path / "p2", 2), init=str(old), seed=1)),
                        tmp_path / "p2.pth")
    history = read_history(second, torch.load(second, weights_only=False))
    assert len(history) == 5 and not history_file(old).exists()
    assert [h[1] for h in history[:3]] == [torch.tensor(r[1]).half().item() for r in rows]


def test_packed_history_round_trips_and_refuses_gaps():
    """Exports pack the loss history (4 bytes a row instead of ~27 pickled or 8 as float32 pairs: issue 14's 25 MB);
    reading it back gives the loss to float16 precision and cumulative seconds within float16's rounding of each step;
    the float32 [N, 2] exports of phases 11-13 and lists still read; a gap or another layout is refused."""
    import io
    rows = [[i, 1.0 / (i + 1), 6.01 * i + 0.123456 + (40.0 if i >= 500 else 0.0)] for i in range(10_000)]
    packed = pack_history(rows)
    back = history_rows(packed)
    assert [r[0] for r in back] == list(range(10_000))
    assert all(abs(a[1] - b[1]) <= 2 ** -11 * a[1] for a, b in zip(rows, back))  # float16: round to nearest
    assert max(abs(a[1] - b[1]) / a[1] for a, b in zip(rows, back)) > 1e-5  # not float32's digits
    seconds_err = max(abs(a[2] - b[2]) for a, b in zip(rows, back))
    # 6.01 s is 6.0117 in float16: rounded alike, 10,000 steps would drift by 17 s; carried over, each stays within
    # half a rounding of the 46 s step (float16's spacing there: 1/32 s)
    assert 1e-4 < seconds_err <= 1 / 64
    assert history_rows(rows) == rows and history_rows([]) == [] and pack_history([])["loss"].shape == (0,)
    legacy = torch.tensor([[r[1], r[2]] for r in rows[:3]], dtype=torch.float32)      # [N, 2] (loss, seconds)
    assert [r[0] for r in history_rows(legacy)] == [0, 1, 2] and history_rows(legacy)[2][2] == pytest.approx(12.143456)
    sizes = []
    for value in (rows, legacy.new_zeros(10_000, 2), packed):
        buf = io.BytesIO()
        torch.save({"loss_history": value}, buf)
        sizes.append(buf.tell())
    assert sizes[2] < 62_500 < 80_000 < sizes[1] < sizes[0]              # 60,000 bytes of data + the zip's
    wide = history_rows(pack_history(rows, dtype=torch.float32))  # beside an export (read_history)
    assert max(abs(a[1] - b[1]) / a[1] for a, b in zip(rows, wide)) <= 2 ** -24
    assert max(abs(a[2] - b[2]) for a, b in zip(rows, wide)) < 1e-4 < seconds_err
    with pytest.raises(ValueError, match=r"float16 or float32, got dtype torch.float64"):
        pack_history(rows, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"iterations 0, 1, ..., 1, got \[0, 2\]"):
        pack_history([[0, 1.0, 1.0], [2, 1.0, 2.0]])
    with pytest.raises(ValueError, match=r"\[N, 2\] tensor of \(loss, seconds\), got shape \(4, 3\)"):
        history_rows(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"'step_seconds': \[N\]\}, got \{'loss': \(3,\), 'step_seconds': \(2,\)\}"):
        history_rows({"loss": torch.zeros(3), "step_seconds": torch.zeros(2)})


def test_a_failing_loss_plot_warns_and_the_export_still_follows(tmp_path, monkeypatch):
    """The loss curve is drawn after the final checkpoint; when drawing fails, training warns and returns, so the
    CLI's --export still runs (issue 14's phase 11 lost its export to a plot error)."""
    import mar_probe.plot.training as PT

    def broken(*args, **kwargs):
        raise ImportError("no plotting here")
    monkeypatch.setattr(PT, "plot_loss_curve", broken)
    with pytest.warns(RuntimeWarning, match=r"loss curve not written to .*loss_curve.png.*no plotting here"):
        ckpt = train(_cfg(tmp_path, 2))
    assert not (tmp_path / "loss_curve.png").exists()
    assert load_model(export_ema(ckpt, tmp_path / "slim.pth")).config.name == "mar_tiny"


def test_the_average_of_two_phases_exports_is_their_mean_loads_and_names_its_sources(tmp_path):
    """Issue 14: averaging consecutive phases' exports is a longer EMA; the file says it is an average."""
    import dataclasses
    import hashlib
    first = export_ema(train(_cfg(tmp_path / "p1", 2)), tmp_path / "p1.pth")
    second = export_ema(train(dataclasses.replace(_cfg(tmp_path / "p2", 2), init=str(first), seed=1)),
                        tmp_path / "p2.pth")
    out = average_exports([first, second], tmp_path / "avg" / "m.pth")
    a, b, avg = (torch.load(p, weights_only=False) for p in (first, second, out))
    changed = [k for k in a["model_ema"] if not torch.equal(a["model_ema"][k], b["model_ema"][k])]
    assert changed  # the second phase moved the weights, so the mean differs from either
    for k in a["model_ema"]:
        want = ((a["model_ema"][k].double() + b["model_ema"][k].double()) / 2).to(a["model_ema"][k].dtype)
        assert torch.equal(avg["model_ema"][k], want), k
    assert avg["averaged_from"] == [{"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                                    for p in (first, second)]
    assert avg["phase_iterations"] == b["phase_iterations"] == [2, 2]
    assert read_history(out, avg) == read_history(second, b)
    assert load_model(out).config.name == "mar_tiny"


def test_averaging_refuses_one_export_and_exports_of_another_model(tmp_path):
    tiny = export_ema(train(_cfg(tmp_path / "t", 1)), tmp_path / "t.pth")
    with pytest.raises(ValueError, match=r"at least two exports, got \['.*t.pth'\]"):
        average_exports([tiny], tmp_path / "x.pth")
    state = torch.load(tiny, weights_only=False)
    config = state["mar_probe_config"]
    torch.save({**state, "mar_probe_config": {**config, "decoder_depth": config["decoder_depth"] + 1}},
               tmp_path / "w.pth")
    with pytest.raises(ValueError, match=r"'.*w.pth' is another model than '.*t.pth'"):
        average_exports([tiny, tmp_path / "w.pth"], tmp_path / "x.pth")
    name = next(iter(state["model_ema"]))
    torch.save({**state, "model_ema": {**state["model_ema"], name: torch.zeros(3, 1)}}, tmp_path / "s.pth")
    with pytest.raises(ValueError, match=r"'.*s.pth' and '.*t.pth' hold different weights"):
        average_exports([tiny, tmp_path / "s.pth"], tmp_path / "x.pth")
    assert not (tmp_path / "x.pth").exists()
