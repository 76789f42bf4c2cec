"""Exporting a trained coordinator and answering questions with it.

- `coordrl.inference.export`: ``coordrl export`` (checkpoint -> servable Hugging Face folder with
  ``coordrl_policy.json`` and a model card).
- `coordrl.inference.coordinator`: `Coordinator` (``.answer(document, question)``) and
  ``coordrl answer``.

`resolve_policy` (any policy spec: checkpoint, export, model folder, hub id, ``scripted``) and
`PolicyError` come from `coordrl.rollout.policy_source`, which evaluation shares.

Imports are lazy so that ``import coordrl.inference`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Answer", "Coordinator", "PolicyError", "export_policy", "resolve_policy"]


def __getattr__(name: str) -> Any:
    if name in ("Answer", "Coordinator"):
        from coordrl.inference import coordinator

        return getattr(coordinator, name)
    if name == "export_policy":
        from coordrl.inference import export

        return export.export_policy
    if name in ("PolicyError", "resolve_policy"):
        from coordrl.rollout import policy_source

        return getattr(policy_source, name)
    raise AttributeError(name)
