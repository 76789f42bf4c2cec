"""The protocol registry: each protocol object is consistent with its environment and the report."""

from __future__ import annotations

import pytest

from coordrl.envs.chat import env_tools
from coordrl.envs.protocols import PROTOCOLS, get_protocol
from coordrl.eval.report import columns_for


def test_registry_knows_parser_and_hmars_and_names_them_on_a_miss():
    assert {"parser", "hmars"} <= set(PROTOCOLS)
    with pytest.raises(ValueError, match=r"unknown protocol 'mars'.*parser, hmars"):
        get_protocol("mars")


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_tool_is_the_environment_s_one_tool(name):
    protocol = get_protocol(name)
    tools = env_tools(protocol.probe_env())
    assert [t.__name__ for t in tools] == [protocol.tool]


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_prompt_uses_its_system_prompt_unless_given_one(name):
    protocol = get_protocol(name)
    system, user = protocol.prompt("Who wrote it?")
    assert system == {"role": "system", "content": protocol.system_prompt}
    assert "Who wrote it?" in user["content"]
    assert protocol.prompt("Who wrote it?", "Be brief.")[0]["content"] == "Be brief."


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_config_refuses_unknown_settings_by_name(name):
    protocol = get_protocol(name)
    assert isinstance(protocol.config({"not_a_field": 1}), protocol.config_cls)  # recorded extras are dropped
    with pytest.raises(ValueError, match="not_a_field"):
        protocol.config(not_a_field=1)


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_protocol_limit_fields_and_columns_exist(name):
    protocol = get_protocol(name)
    config = protocol.config()
    for setting in protocol.limit_fields:
        assert hasattr(config, setting)
    columns = columns_for({"protocol": name})
    assert [(k, h) for k, h, _ in columns] == list(protocol.table_columns)
    assert all(fmt(0.5) != "–" for _, _, fmt in columns)


def test_eval_turn_caps_follow_the_protocol():
    assert get_protocol("parser").eval_max_turns(None, 4) == 12  # PARSER evaluates with more rounds
    assert get_protocol("hmars").eval_max_turns(None, 2) == 2  # HMARS keeps training's cap
    assert get_protocol("hmars").eval_max_turns(5, 2) == 5
