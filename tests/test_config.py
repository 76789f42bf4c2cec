"""`coordrl train` config typing: annotations resolved by `typing.get_type_hints`, values coerced by them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordrl.train.config import ConfigError, CoordConfig, _field_types, load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"


@dataclass
class _Local:
    # Postponed annotations naming this module's imports (Path), which only the defining module can resolve.
    out: Path | None = None
    tags: list[str] = field(default_factory=list)
    flag: bool = False


def test_field_types_resolve_postponed_annotations_in_their_own_module():
    assert _field_types(_Local) == {"out": Path | None, "tags": list[str], "flag": bool}
    types = _field_types(CoordConfig)
    assert types["eval_samples"] == int | None and types["lockstep"] is bool and types["hmars"] == dict | None
    assert types["reader_model"] == str | None  # inherited from ParserEnvConfig (another module)


def test_overrides_are_coerced_by_the_resolved_field_types():
    c = load_config(
        TINY,
        {
            "eval_samples": "7",
            "lockstep": "no",
            "model_params": "1e9",
            "hmars": "{c_sub: 2}",
            "reward_weights": "[1, 2.5]",
            "max_steps": "3",
            "bf16": "false",
        },
    )
    assert c.coord.eval_samples == 7 and c.coord.lockstep is False and c.coord.model_params == 1e9
    assert c.coord.hmars == {"c_sub": 2}
    assert c.grpo["reward_weights"] == [1, 2.5] and c.grpo["max_steps"] == 3 and c.grpo["bf16"] is False
    c = load_config(TINY, {"eval_samples": "null", "reward_weights": "1.5", "max_completion_length": "~"})
    assert c.coord.eval_samples is None and c.grpo["reward_weights"] == [1.5]
    assert c.grpo["max_completion_length"] is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"eval_samples": "x"}, "eval_samples: cannot use 'x' (invalid literal for int() with base 10: 'x')"),
        ({"lockstep": "maybe"}, "lockstep: cannot use 'maybe' (not a boolean)"),
        ({"traces": 1}, "traces: cannot use 1 (not a boolean)"),
        ({"max_steps": True}, "max_steps: cannot use True (boolean given)"),
        ({"hmars": "3"}, "hmars: cannot use '3' (expected a mapping)"),
        ({"seed": "null"}, "seed: may not be null"),
        ({"world_docs_per_chunk": "0"}, "world_docs_per_chunk: must be >= 1, got 0"),
        (
            {"world_train_docs": "[8, 0]"},
            "world_train_docs: must be a non-empty list of document counts >= 1, got [8, 0]",
        ),
        ({"world_train_docs": "[]"}, "world_train_docs: must be a non-empty list of document counts >= 1, got []"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, override)
    assert str(err.value) == message


def test_bf16_auto_is_bf16_exactly_where_the_cpu_computes_it_natively(monkeypatch):
    import torch

    from coordrl.train import config as config_mod

    for native in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda n=native: n)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert config_mod.native_bf16(use_cpu=True) is native
        c = load_config(TINY, {"bf16": "auto", "use_cpu": "true"})
        assert c.grpo["bf16"] is native  # a plain bool by the time TRL sees it
    # An explicit true on a CPU that emulates bf16 is kept, and the user is told what it costs.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.warns(UserWarning, match="emulates bf16"):
        c = load_config(TINY, {"bf16": "true", "use_cpu": "true"})
    assert c.grpo["bf16"] is True
    # The world config (the learning check, the demo) asks for auto.
    world = Path(__file__).resolve().parents[1] / "configs" / "world_cpu.yaml"
    assert "\nbf16: auto\n" in world.read_text()


@pytest.mark.parametrize("name", sorted(p.name for p in TINY.parent.glob("*.yaml") if not p.name.startswith("zero")))
def test_shipped_configs_use_current_field_names(name, tmp_path):
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing and warns on the old
    # name on every run; the shipped configs use the new one.
    import warnings

    from trl import GRPOConfig

    cfg = load_config(TINY.parent / name, {"output_dir": str(tmp_path), "bf16": "false"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = GRPOConfig(**cfg.grpo)
    assert args.activation_checkpointing is (cfg.grpo.get("activation_checkpointing") is True)
