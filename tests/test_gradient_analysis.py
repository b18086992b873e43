"""gradient_analysis on a tiny model: exact full gradient, zero deviation at B = N, 1/B scaling, outputs."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fabrics.corpus import load_corpus
from fabrics.models import build_model
from gradient_analysis.gradient_analysis import GradientProbe, analyse, per_sample_loss
from tests.conftest import ROOT, TINY


@pytest.fixture(scope="module")
def probe_setup(tmp_path_factory, cache_dir):
    from utils.config import load_config

    cfg = load_config(ROOT / "config.yaml", [*TINY, f"cache_dir={cache_dir}"])
    data = load_corpus(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id).double()
    return model, data


def test_full_gradient_equals_one_pass_gradient_of_the_mean_loss(probe_setup):
    model, data = probe_setup
    sample = torch.arange(12)
    streamed = GradientProbe(model, data.train, "cpu", chunk_size=5).gradient(sample)  # chunks of 5, 5, 2
    for p in model.parameters():
        p.grad = None
    per_sample_loss(model, data.train.input_ids[sample], data.train.attention_mask[sample], None).mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(streamed.double(), direct, rtol=1e-5, atol=1e-7)


def test_one_batch_of_all_samples_has_zero_deviation(probe_setup):
    model, data = probe_setup
    probe = GradientProbe(model, data.train, "cpu", chunk_size=4)
    full, results = analyse(probe, torch.arange(16), [16], repeats=1, seed=0, progress=False)
    assert results[16].deviations[0] <= 1e-6 * float(full.norm())
    assert results[16].summary(0.8)["per_sample_variance"] == 0.0


def test_mean_squared_deviation_scales_like_one_over_b(probe_setup):
    model, data = probe_setup
    probe = GradientProbe(model, data.train, "cpu", chunk_size=8)
    n = 48
    _, results = analyse(probe, torch.arange(n), [1, 2, 4, 8], repeats=3, seed=1, progress=False)
    variances = [results[b].summary(0.8)["per_sample_variance"] for b in (1, 2, 4, 8)]
    # B * E||g_B - g||^2 * (N-1)/(N-B) estimates the same per-sample variance for every B
    assert max(variances) / min(variances) < 1.6, variances
    msd = [results[b].summary(0.8)["mean_squared_deviation"] for b in (1, 2, 4, 8)]
    assert msd[0] > msd[1] > msd[2] > msd[3]
    assert msd[0] / msd[3] == pytest.approx(8 * (n - 1) / (n - 8), rel=0.6)  # sigma^2 (N-B) / (B (N-1))


def tiny_train_config(tmp_path, cache_dir):
    """A training config file, as a run directory holds one."""
    from utils.config import load_config

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(load_config(ROOT / "config.yaml", [*TINY, f"cache_dir={cache_dir}"]).to_dict()))
    return path


def test_command_line_tool_writes_every_number(tmp_path, cache_dir):
    out = tmp_path / "plots"
    overrides = ["num_samples=16", "batch_sizes=[2, 4, 16]", "repeats=1", f"output_dir={out}",
                 f"train_config={tiny_train_config(tmp_path, cache_dir)}", "train_overrides=[val_size=4, ETA=0.7]"]
    proc = subprocess.run([sys.executable, "-m", "gradient_analysis.gradient_analysis", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gradient_analysis.json").read_text())
    assert [s["batch_size"] for s in report["summary"]] == [2, 4, 16]
    assert [s["num_batches"] for s in report["summary"]] == [8, 4, 1]
    assert report["summary"][2]["mean_deviation"] < 1e-6 * report["info"]["full_gradient_norm"]
    assert report["info"]["parameters"] > 0 and report["info"]["gradient_memory_mib"] > 0
    # the requested-batch column takes the run's own ETA (0.7 here) unless eta is given
    assert report["info"]["eta"] == 0.7 and report["info"]["eta_from"].startswith("the run's ETA")
    row, norm = report["summary"][0], report["info"]["full_gradient_norm"]
    assert row["norm_test_batch"] == pytest.approx(row["per_sample_variance"] / (0.7**2 * norm**2), rel=1e-6)
    with (out / "gradient_deviations.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 8 + 4 + 1
    for b in (2, 4, 16):
        assert (out / f"gradient_deviation_hist_B{b}.png").stat().st_size > 5000
    assert (out / "deviation_vs_batch_size.png").is_file()


def test_bad_checkpoint_is_a_one_line_error(tmp_path, cache_dir):
    bad = tmp_path / "trainer_0.safetensors"
    bad.write_bytes(b"junk")
    proc = subprocess.run([sys.executable, "-m", "gradient_analysis.gradient_analysis", f"checkpoint_path={bad}",
                           f"train_config={tiny_train_config(tmp_path, cache_dir)}", f"output_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: checkpoint: {bad} is not a readable safetensors file "
                                                "(Error while deserializing header: header too small)"]


def test_a_bit_flipped_checkpoint_is_refused_by_its_manifest(tmp_path, tiny_config):
    """A flipped bit in the weights still loads and gives plausible numbers: the manifest catches it."""
    from run import train

    run_dir, _ = train(tiny_config("run_name=flip", "num_outer_steps=1"))
    final = run_dir / "model_weights" / "final"
    trainer = final / f"trainer_{json.loads((run_dir / 'summary.json').read_text())['final_trainer']}.safetensors"
    for target, damaged in ((trainer, trainer), (final / "final_model", final / "final_model" / "model.safetensors")):
        data = bytearray(damaged.read_bytes())
        data[-7] ^= 0x01  # one bit of one weight
        damaged.write_bytes(bytes(data))
        proc = subprocess.run([sys.executable, "-m", "gradient_analysis.gradient_analysis", f"checkpoint_path={target}",
                               "num_samples=8", "batch_sizes=[2]", "repeats=1", f"output_dir={tmp_path / 'out'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [f"error: checkpoint: {damaged} does not match its sha256 in the "
                                                    "manifest (corrupted)"]
        assert not (tmp_path / "out" / "gradient_analysis.json").exists()
        data[-7] ^= 0x01
        damaged.write_bytes(bytes(data))  # repaired: the next target is damaged alone


def test_histogram_figures_use_their_width_and_clip_nothing(tmp_path):
    """The histogram fills most of the figure, its info and legend sit in a panel beside it, and nothing
    (title, info box, labels) falls outside the figure, even with a long checkpoint path."""
    import matplotlib.figure

    from gradient_analysis.gradient_analysis import BatchSizeResult, plot_histograms

    results = {4: BatchSizeResult(4, deviations=[2.56, 2.57, 2.59, 2.59, 2.58, 2.60], num_samples=24)}
    summaries = {4: results[4].summary(0.7)}
    info = {"model": "microllama-tiny", "dataset": "c4", "num_samples": 24,
            "checkpoint": "/home/someone/experiments/logs/microllama-tiny_c4_2026_11_23_16_33_25/model_weights/"
                          "step_00000010/trainer_0.safetensors"}
    measured = {}
    original = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):  # measure the figure as it is written, in pixels
        renderer = fig.canvas.get_renderer()
        measured[Path(path).name] = {"figure": fig.bbox.bounds, "axes": fig.axes[0].get_position().bounds,
                                     "drawn": fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans).extents,
                                     "title": fig._suptitle.get_window_extent(renderer).extents if fig._suptitle
                                     else fig.axes[0].title.get_window_extent(renderer).extents}
        return original(fig, path, *args, **kwargs)

    matplotlib.figure.Figure.savefig = record
    try:
        paths = plot_histograms(results, summaries, info, tmp_path)
    finally:
        matplotlib.figure.Figure.savefig = original
    assert [p.name for p in paths] == ["gradient_deviation_hist_B4.png", "deviation_vs_batch_size.png"]
    m = measured["gradient_deviation_hist_B4.png"]
    width, height = m["figure"][2:]
    x0, y0, x1, y1 = m["drawn"]
    assert x0 >= -1 and y0 >= -1 and x1 <= width + 1 and y1 <= height + 1, f"drawn outside the figure: {m}"
    assert x1 > 0.9 * width, f"the right {1 - x1 / width:.0%} of the figure is blank"
    assert m["axes"][2] > 0.55, f"the histogram takes only {m['axes'][2]:.0%} of the width"
    assert 0 <= m["title"][0] and m["title"][2] <= width, f"title clipped: {m['title']}"


def test_by_default_the_analysis_goes_beside_the_checkpoints_run_and_says_so_first(tmp_path, tiny_config):
    from run import train

    run_dir, summary = train(tiny_config("run_name=beside", "num_outer_steps=1"))
    trainer = run_dir / "model_weights" / "final" / f"trainer_{summary['final_trainer']}.safetensors"
    proc = subprocess.run([sys.executable, "-m", "gradient_analysis.gradient_analysis", f"checkpoint_path={trainer}",
                           "num_samples=8", "batch_sizes=[2]", "repeats=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = run_dir / "gradient_analysis" / f"final_trainer_{summary['final_trainer']}"
    assert proc.stderr.splitlines()[0] == f"gradient analysis of {trainer}: outputs go to {out}"
    assert (out / "gradient_analysis.json").is_file() and (out / "gradient_summary.csv").is_file()
    assert not (ROOT / "gradient_plots").exists()
