"""Exporting a trained coordinator and answering questions with it.

- `coordrl.inference.export`: ``coordrl export`` (checkpoint -> servable Hugging Face folder with
  ``coordrl_policy.json`` and a model card) and `resolve_policy`, which reads any policy spec
  (checkpoint, export, model folder, hub id, ``scripted``) for evaluation and inference.
- `coordrl.inference.coordinator`: `Coordinator` (``.answer(document, question)``) and
  ``coordrl answer``.

Imports are lazy so that ``import coordrl.inference`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Answer", "Coordinator", "PolicyError", "export_policy", "resolve_policy"]


def __getattr__(name: str) -> Any:
    if name in ("Answer", "Coordinator"):
        from coordrl.inference import coordinator

        return getattr(coordinator, name)
    if name in ("PolicyError", "export_policy", "resolve_policy"):
        from coordrl.inference import export

        return getattr(export, name)
    raise AttributeError(name)
