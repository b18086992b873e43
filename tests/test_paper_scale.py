"""benchmarks.paper_scale: the paper's experiment as one command, its card and GPU-hours printed before it starts."""

import pytest

from algorithms.clock import ThroughputCurve
from benchmarks import paper_scale
from benchmarks.compare.variants import catalogue
from tests.conftest import ROOT
from utils.config import load_config


def test_the_hours_by_hand_on_a_flat_curve():
    cfg = load_config(ROOT / paper_scale.CONFIG, [])  # 4 nodes, H 200, 512 tokens, evaluations every 10 steps
    tokens = 20 * 200 * 4 * 512
    rows = {r["variant"]: r for r in paper_scale.estimate(cfg, ThroughputCurve.flat(1000.0), 512, tokens, 4)}
    # DiLoCo b1: every token at 1000 tokens/s; 20 rounds x 20 evaluations of 200 x 512 tokens at 3x the rate
    assert rows["diloco_b1"]["train_s"] == (tokens / 1000, tokens / 1000)
    assert rows["diloco_b1"]["eval_s"][1] == pytest.approx(20 * 20 * 200 * 512 / 3000)
    assert rows["diloco_b4"]["eval_s"][1] == pytest.approx(5 * 20 * 200 * 512 / 3000)  # 5 rounds
    # AdLoCo: 4 trainers, at most the 20 rounds its starting batch 1 takes
    assert rows["adloco_paper"]["eval_s"][1] == pytest.approx(4 * 20 * 20 * 200 * 512 / 3000)


def test_the_command_names_only_variants_the_harness_knows_and_the_card_fits(capsys):
    cfg = load_config(ROOT / paper_scale.CONFIG, [])
    known = catalogue(cfg, list(paper_scale.BATCHES), 0.3)
    line = paper_scale.command(3, 8192000)
    assert set(line[line.index("--variants") + 1].split(",")) <= set(known)
    assert paper_scale.main([]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "GPU-hours on one such card" in out and "Command: python -m benchmarks.compare" in out
    assert paper_scale.main(["--capacity_gb", "10"]) == 1  # a 10 GiB card: refused before anything runs
    assert "does NOT fit" in capsys.readouterr().out
