"""How noisy are mini-batch gradients at a checkpoint? (what the norm test reasons about)

    python -m gradient_analysis.gradient_analysis --config gradient_analysis/config_analyze_gradient.yaml \\
        [key=value ...]

For N chosen training samples it computes the exact full gradient g = (1/N) sum_i grad l_i (each
sample's loss is its mean token NLL, so g is exact however the samples are cut into chunks), then for
every batch size B the gradient g_B of disjoint random mini-batches and
  ||g_B - g||, ||g_B - g|| / ||g||,
  the per-sample variance sigma^2 = B * mean ||g_B - g||^2 * (N - 1) / (N - B)   (finite-population
  correction: mini-batches are drawn without replacement from the N samples; B = N gives 0),
  and the batch the norm test would request: sigma^2 / (eta^2 ||g||^2).
Gradients are streamed: only the full gradient and one mini-batch gradient are held at a time (two
fp32 vectors of the parameter count), never all of them.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from tqdm import tqdm

from utils.config import documented, load_config
from utils.errors import UserError, exit_code_of

log = logging.getLogger("gradient_analysis")


@dataclass
class AnalysisConfig:
    train_config: str = documented("", "Training config giving dataset, model and tokenizer keys; empty = the "
                                   "config.yaml of the run the checkpoint belongs to, else ./config.yaml.")
    train_overrides: list[str] = documented([], "key=value overrides of the training config (e.g. dataset=c4).")
    checkpoint_path: str = documented("", "trainer_<id>.safetensors of a run, a Hugging Face model directory "
                              "(e.g. model_weights/final/final_model), or empty for the preset at initialisation.")
    num_samples: int = documented(64, "Training samples (sequences) over which the full gradient is taken.", min=2)
    batch_sizes: list[int] = documented([1, 2, 4, 8], "Mini-batch sizes to analyse.")
    repeats: int = documented(1, "Independent shuffles per batch size (more mini-batches for large B).", min=1)
    chunk_size: int = documented(8, "Largest number of samples in one forward/backward pass.", min=1)
    eta: float = documented(0.0, "eta of the norm test for the requested-batch column; 0 = the run's own ETA (the "
                            "train config's).", min=0.0)
    device: str = documented("cpu", "cpu, cuda or cuda:N (cuda falls back to cpu when unavailable).")
    output_dir: str = documented("", "Where PNGs, JSON and CSV go; empty = beside the checkpoint's run "
                                 "(RUN/gradient_analysis/<checkpoint>), or, for a checkpoint outside a run or the "
                                 "preset at initialisation, the training config's log_dir/gradient_analysis/<name>.")
    seed: int = documented(42, "Seed of the sample choice and the mini-batch shuffles.", min=0)
    clearml_mode: str = documented("off", "Report to ClearML: off, offline, online, auto.",
                           choices=("off", "offline", "online", "auto"))

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 or b > self.num_samples for b in self.batch_sizes):
            from utils.errors import ConfigError

            raise ConfigError("batch_sizes", f"each must be in [1, num_samples={self.num_samples}]")


@dataclass
class BatchSizeResult:
    batch_size: int
    deviations: list[float] = field(default_factory=list)  # ||g_B - g|| per mini-batch
    grad_norm: float = 0.0
    num_samples: int = 0

    def summary(self, eta: float) -> dict[str, float]:
        d = np.asarray(self.deviations, dtype=np.float64)
        b, n = self.batch_size, self.num_samples
        mean_sq = float((d**2).mean())
        fpc = (n - 1) / (n - b) if b < n else 0.0
        variance = b * mean_sq * fpc
        centred = d - d.mean()
        kurtosis = float((centred**4).mean() / (centred**2).mean() ** 2 - 3) if len(d) > 1 and d.std() > 0 else 0.0
        return {"batch_size": b, "num_batches": len(d), "mean_deviation": float(d.mean()),
                "median_deviation": float(np.median(d)), "std_deviation": float(d.std()),
                "mean_relative_deviation": float(d.mean()) / self.grad_norm if self.grad_norm else float("nan"),
                "mean_squared_deviation": mean_sq, "per_sample_variance": variance,
                "norm_test_batch": variance / (eta**2 * self.grad_norm**2) if self.grad_norm else float("nan"),
                "excess_kurtosis": kurtosis}


def per_sample_loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Loss of each sample: mean token NLL (language model) or cross-entropy (classifier)."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    if labels is not None:
        return F.cross_entropy(logits, labels, reduction="none")
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none", ignore_index=-100)
    return nll.sum(1) / (targets != -100).sum(1).clamp(min=1)


class GradientProbe:
    """Exact gradients of mean per-sample losses over index sets, streamed in chunks."""

    def __init__(self, model, data, device: str, chunk_size: int) -> None:
        self.model, self.data, self.device, self.chunk = model, data, device, chunk_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        model.train()

    def gradient(self, indices: torch.Tensor, bar: tqdm | None = None) -> torch.Tensor:
        """(1/|I|) sum_{i in I} grad l_i as one flat fp32 vector on the device (bar: advanced per chunk)."""
        for p in self.params:
            p.grad = None
        for chunk in indices.split(self.chunk):
            ids = self.data.input_ids[chunk].to(self.device)
            mask = self.data.attention_mask[chunk].to(self.device)
            labels = None if self.data.labels is None else self.data.labels[chunk].to(self.device)
            # weight |chunk| / |I|: the sum over chunks is exactly the mean over I
            (per_sample_loss(self.model, ids, mask, labels).sum() / len(indices)).backward()
            if bar is not None:
                bar.update(len(chunk))
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])


def analyse(probe: GradientProbe, sample: torch.Tensor, batch_sizes: list[int], repeats: int, seed: int,
            progress: bool = True) -> tuple[torch.Tensor, dict[int, BatchSizeResult]]:
    with tqdm(total=len(sample), desc="full gradient", unit="sample", disable=not progress) as full_bar:
        full = probe.gradient(sample, full_bar).clone()
    norm = float(full.norm())
    results = {}
    gen = torch.Generator().manual_seed(seed)
    total = sum(repeats * (len(sample) // b) for b in batch_sizes)
    bar = tqdm(total=total, desc="mini-batch gradients", disable=not progress)
    for b in batch_sizes:
        res = BatchSizeResult(b, grad_norm=norm, num_samples=len(sample))
        for _ in range(repeats):
            order = sample[torch.randperm(len(sample), generator=gen)]
            for k in range(len(sample) // b):  # disjoint mini-batches of one shuffle
                g = probe.gradient(order[k * b : (k + 1) * b])
                res.deviations.append(float((g - full).norm()))
                bar.update()
        results[b] = res
    bar.close()
    return full, results


# ----------------------------------------------------------------------------------------------


def load_model(cfg: AnalysisConfig, train_cfg, tokenizer):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from fabrics.models import build_model
    from utils.checkpoint import load_trainer_weights
    from utils.model_state import load_float_state

    path = Path(cfg.checkpoint_path).expanduser() if cfg.checkpoint_path else None
    if path is not None and path.is_dir():
        auto = AutoModelForSequenceClassification if train_cfg.model_type == "bert" else AutoModelForCausalLM
        check_checkpoint(path)
        try:
            return auto.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        except Exception as exc:  # transformers raises OSError, ValueError, SafetensorError, ...
            detail = str(exc).splitlines()[0][:160] if str(exc) else ""
            raise UserError(f"checkpoint_path: cannot load the model in {path} ({type(exc).__name__}: "
                            f"{detail})") from None
    model = build_model(train_cfg, len(tokenizer), tokenizer.pad_token_id)
    if path is not None:
        state = load_trainer_weights(path)
        missing = set(k for k in model.state_dict() if torch.is_floating_point(model.state_dict()[k])) - set(state)
        if missing or any(state[k].shape != model.state_dict()[k].shape for k in state if k in model.state_dict()):
            raise UserError(f"checkpoint_path: {path} does not fit the model of the training config "
                            f"({train_cfg.model_config.name}); set train_config to the run's config.yaml")
        load_float_state(model, state)
    return model


def check_checkpoint(path: Path) -> None:
    """A trainer_<t>.safetensors file, or a Hugging Face directory with config.json and intact weights; inside a
    run's checkpoint, every file used is checked against the manifest (size, sha256), as --resume does."""
    from utils.checkpoint import load_trainer_weights, verify_part

    if not path.exists():  # say what is there instead (e.g. trainer 0 did not survive, final_model did)
        parent = next((p for p in path.parents if p.is_dir()), None)
        there = sorted(x.name + ("/" if x.is_dir() else "") for x in parent.iterdir()) if parent else []
        listing = ", ".join(there[:12]) + (f" and {len(there) - 12} more" if len(there) > 12 else "")
        raise UserError(f"checkpoint_path: {path} does not exist; {parent} holds: {listing or 'nothing'}")
    verify_part(path)  # a flipped bit would otherwise give plausible, wrong numbers
    if not path.is_dir():
        load_trainer_weights(path)
        return
    if not (path / "config.json").is_file():
        raise UserError(f"checkpoint_path: {path} has no config.json, so it is not a Hugging Face model "
                        "directory; give model_weights/<label>/final_model or a trainer_<t>.safetensors file")
    for weights in sorted(path.glob("*.safetensors")):  # a damaged file gets its own message
        load_trainer_weights(weights)


def find_train_config(cfg: AnalysisConfig) -> Path:
    if cfg.train_config:
        return Path(cfg.train_config)
    run_dir = run_dir_of(Path(cfg.checkpoint_path)) if cfg.checkpoint_path else None
    if run_dir is not None:
        return run_dir / "config.yaml"  # the run directory the checkpoint belongs to
    return Path(__file__).resolve().parents[1] / "config.yaml"


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint belongs to (it holds config.yaml and model_weights/), if any."""
    for parent in checkpoint.expanduser().resolve().parents:
        if (parent / "config.yaml").is_file() and (parent / "model_weights").is_dir():
            return parent
    return None


def output_dir_of(cfg: AnalysisConfig, log_dir: str) -> Path:
    """output_dir, or where the analysis of this checkpoint belongs: beside its run (never the repository root)."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser()
    if not cfg.checkpoint_path:
        return Path(log_dir).expanduser() / "gradient_analysis" / "initialisation"
    checkpoint = Path(cfg.checkpoint_path).expanduser().resolve()
    run_dir = run_dir_of(checkpoint)
    if run_dir is None:
        return Path(log_dir).expanduser() / "gradient_analysis" / checkpoint.stem
    inside = checkpoint.relative_to(run_dir / "model_weights") if checkpoint.is_relative_to(run_dir / "model_weights") \
        else checkpoint.relative_to(run_dir)
    return run_dir / "gradient_analysis" / "_".join(p.removesuffix(".safetensors") for p in inside.parts)


def plot_histograms(results: dict[int, BatchSizeResult], summaries: dict[int, dict], info: dict, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for b, res in results.items():
        s = summaries[b]
        # info and legend in a panel of their own beside the histogram: over it they would hide the tallest
        # bars; placed outside the axes by hand, they left the figure half blank and the title clipped
        fig, (ax, side) = plt.subplots(1, 2, figsize=(9.5, 5), gridspec_kw={"width_ratios": [3, 1]})
        ax.hist(res.deviations, bins=min(50, max(5, len(res.deviations) // 2)), density=True, color="tab:blue",
                edgecolor="black", alpha=0.8)
        ax.axvline(s["mean_deviation"], color="red", ls="--", label=f"mean {s['mean_deviation']:.4g}")
        ax.axvline(s["median_deviation"], color="green", ls=":", label=f"median {s['median_deviation']:.4g}")
        ax.set(xlabel=r"$\|\nabla F_B(x) - \nabla F(x)\|$", ylabel="probability density")
        fig.suptitle(f"Mini-batch gradient deviation from the full gradient (B = {b})")
        lines = [f"model: {info['model']}", f"checkpoint: {info['checkpoint']}", f"dataset: {info['dataset']}",
                 f"samples: {info['num_samples']}", f"batch size: {b}", f"mini-batches: {s['num_batches']}",
                 f"excess kurtosis: {s['excess_kurtosis']:.3g}"]
        # long paths and names wrapped to the panel's width (else tight_layout shrinks the histogram for them)
        text = "\n".join(textwrap.fill(line, 30, subsequent_indent="  ") for line in lines)
        side.axis("off")
        side.text(0.0, 1.0, text, transform=side.transAxes, ha="left", va="top", fontsize=8,
                  bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})
        side.legend(*ax.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(0.0, 0.35), fontsize=8)
        fig.tight_layout()
        path = out / f"gradient_deviation_hist_B{b}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    sizes = sorted(summaries)
    means = [summaries[b]["mean_deviation"] for b in sizes]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.loglog(sizes, means, "o-", label="mean deviation")
    ref = [means[0] * math.sqrt(sizes[0] / b) for b in sizes]
    ax.loglog(sizes, ref, "k--", label=r"$\propto 1/\sqrt{B}$")
    ax.set(title="Mean deviation against batch size", xlabel="batch size B", ylabel=r"mean $\|g_B - g\|$")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path = out / "deviation_vs_batch_size.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [*paths, path]


def run(cfg: AnalysisConfig) -> dict:
    from fabrics.corpus import load_corpus
    from fabrics.models import count_parameters

    train_cfg_path = find_train_config(cfg)
    train_cfg = load_config(train_cfg_path, cfg.train_overrides)
    out = output_dir_of(cfg, train_cfg.log_dir)
    device = cfg.device if (not cfg.device.startswith("cuda") or torch.cuda.is_available()) else "cpu"
    checkpoint = Path(cfg.checkpoint_path).expanduser() if cfg.checkpoint_path else None
    if checkpoint is not None:
        check_checkpoint(checkpoint)  # a missing or damaged checkpoint fails before any data work
    log.info("gradient analysis of %s: outputs go to %s", cfg.checkpoint_path or "the preset at initialisation", out)
    data = load_corpus(train_cfg)
    if cfg.num_samples > len(data.train):
        raise UserError(f"num_samples: {cfg.num_samples} requested, the data has {len(data.train)} sequences")
    model = load_model(cfg, train_cfg, data.tokenizer).to(device)
    n_params = count_parameters(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    sample = torch.randperm(len(data.train), generator=gen)[: cfg.num_samples]
    probe = GradientProbe(model, data.train, device, cfg.chunk_size)
    full, results = analyse(probe, sample, sorted(set(cfg.batch_sizes)), cfg.repeats, cfg.seed)
    eta = cfg.eta or train_cfg.ETA  # the test the run itself took, unless asked for another
    summaries = {b: r.summary(eta) for b, r in results.items()}
    out.mkdir(parents=True, exist_ok=True)
    info = {"model": train_cfg.model_config.name, "checkpoint": cfg.checkpoint_path or "initialisation",
            "dataset": train_cfg.dataset, "num_samples": cfg.num_samples, "parameters": n_params,
            "eta": eta, "eta_from": "eta" if cfg.eta else f"the run's ETA ({train_cfg_path})",
            "full_gradient_norm": float(full.norm()), "train_config": str(train_cfg_path), "device": device,
            "gradient_memory_mib": 2 * n_params * 4 / 2**20,
            "process_peak_rss_mib": psutil.Process().memory_info().rss / 2**20}
    report = {"info": info, "summary": [summaries[b] for b in sorted(summaries)],
              "deviations": {str(b): r.deviations for b, r in results.items()}}
    (out / "gradient_analysis.json").write_text(json.dumps(report, indent=2))
    with (out / "gradient_deviations.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch_size", "batch_index", "deviation", "relative_deviation"])
        for b, r in results.items():
            for k, d in enumerate(r.deviations):
                w.writerow([b, k, f"{d:.8g}", f"{d / r.grad_norm:.8g}" if r.grad_norm else ""])
    with (out / "gradient_summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(report["summary"][0]))
        w.writeheader()
        w.writerows(report["summary"])
    plots = plot_histograms(results, summaries, info, out)
    if cfg.clearml_mode != "off":
        from training_logs.clearml_tracker import ClearMLTracker

        tracker = ClearMLTracker(train_cfg.project_name, "gradient analysis",
                                 {**info, "batch_sizes": cfg.batch_sizes}, cfg.clearml_mode, 5.0)
        for s in report["summary"]:
            tracker.log({f"gradient/{k}": float(v) for k, v in s.items() if k != "batch_size"}, s["batch_size"])
        for p in plots:
            tracker.log_image(p.stem, p, 0)
        tracker.log_artifact("gradient_analysis", report["info"])
        tracker.close()
    log.info("full gradient norm %.4g over %d samples; model %s (%d parameters, gradient vectors held: %.1f MiB)",
             info["full_gradient_norm"], cfg.num_samples, info["model"], n_params, info["gradient_memory_mib"])
    for s in report["summary"]:
        log.info("B=%-4d mean ||g_B-g|| %.4g (relative %.3f), per-sample variance %.4g, norm test asks for %.1f",
                 s["batch_size"], s["mean_deviation"], s["mean_relative_deviation"], s["per_sample_variance"],
                 s["norm_test_batch"])
    log.info("outputs in %s", out)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).with_name("config_analyze_gradient.yaml")))
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return exit_code_of(lambda: run(load_config(args.config, args.overrides, AnalysisConfig, "script_settings")))


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
