"""The comparison harness on a tiny budget: every variant runs with its component switched off."""

import csv

from benchmarks.compare import main as compare_main
from tests.conftest import ROOT, TINY


def test_harness_runs_every_variant_with_its_component_off(tmp_path, cache_dir):
    out = tmp_path / "compare"
    overrides = [o for o in TINY if not o.startswith(("num_outer_steps", "merge_frequency"))]
    rc = compare_main(["--config", str(ROOT / "config.yaml"), "--seeds", "1", "--max_tokens", "3000",
                       "--max_outer_steps", "40", "--out", str(out), *overrides, f"cache_dir={cache_dir}",
                       "merge_frequency=1", "initial_batch_size=3", "max_batch_size=1", "ETA=0.3",
                       "max_requested_batch=6"])
    assert rc == 0
    with (out / "comparison.csv").open() as f:
        table = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(table) == {"adloco", "diloco", "localsgd", "adloco_no_adaptive", "adloco_no_merge",
                          "adloco_no_switch"}
    for column in ("final_ppl_mean", "final_ppl_std", "syncs", "bytes_mb", "tokens", "wall_s", "syncs_to_target",
                   "tokens_to_target", "wall_s_to_target", "theorem2_bound"):
        assert column in table["adloco"]
    assert float(table["adloco"]["merges"]) >= 1
    assert float(table["adloco_no_merge"]["merges"]) == 0 and float(table["diloco"]["merges"]) == 0
    assert table["adloco_no_adaptive"]["max_requested_batch"] == "3"  # constant batch
    assert int(table["adloco"]["max_requested_batch"]) > 3
    assert table["adloco_no_switch"]["max_accumulation"] == "1" and int(table["adloco"]["max_accumulation"]) > 1
    for row in table.values():  # same token budget: every run stops just past 3000 tokens
        assert 3000 <= float(row["tokens"]) < 3000 + 2 * 3 * 6 * 32  # + at most one outer step of tokens
    # with one seed the target (DiLoCo's final perplexity) is reached by DiLoCo at its last step
    assert table["diloco"]["syncs_to_target"] == table["diloco"]["syncs"]
    assert "target perplexity" in (out / "comparison.md").read_text()
    for name in ("perplexity_vs_comms.png", "perplexity_vs_tokens.png", "perplexity_vs_wall.png"):
        assert (out / name).is_file()
    runs = list((out / "runs").glob("*/summary.json"))
    assert len(runs) == 6
