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
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, override)
    assert str(err.value) == message
