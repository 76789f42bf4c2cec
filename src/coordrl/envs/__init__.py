"""Coordinator environments: the PARSER lead agent (`parser`) and the HMARS mid-agent (`hmars`).

Each environment is one rollout in the shape TRL's ``environment_factory`` expects (``reset(**row)``
plus public tool methods); `step.StepEnv` drives the same classes turn by turn outside TRL.
"""

from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory, ParserLeadEnv
from coordrl.envs.step import StepEnv

__all__ = ["ParserEnvConfig", "ParserEnvFactory", "ParserLeadEnv", "StepEnv"]
