"""The demo's closing summary (the demo itself is the README's main job, run by hand and in the docs)."""

from pathlib import Path

from coordrl.demo import _print_summary
from coordrl.software import software


def test_demo_summary_names_the_host_its_world_figures_came_from(tmp_path, capsys):
    em = {"bridge": 1.0, "comparison": 0.5, "all": 0.75}
    world = {
        "before": {"sampled": {**em, "all": 0.25}, "greedy": {**em, "all": 0.0}},
        "after": {"sampled": em, "greedy": {**em, "all": 1.0}},
        "by_length": {"after GRPO": {8: 1.0, 1024: 0.5}},
        "host": software(),
    }
    _print_summary(Path(tmp_path), {"world": world, "world_steps": 120, "world_grpo_s": 240.0, "total_s": 300.0})
    out = capsys.readouterr().out
    assert "sampled 25% -> 75%, greedy 0% -> 100% after 120 GRPO steps (4.0 min)" in out
    assert "after GRPO: greedy EM 100% at 8 docs, 50% at 1024 docs" in out
    host = world["host"]
    assert f"host: {host['cpu']}, torch CPU kernels at {host['torch_cpu_capability']}" in out
