"""`coordrl train`: build TRL's trainer from a config and run it (or print the plan).

The same environment (the protocol's factory), prompts (`coordrl.envs.protocols`) and reward as
evaluation and inference. Checkpoints land in ``<output_dir>/checkpoint-<step>/`` and record the
config, protocol, prompts and reader settings (``coordrl_train.json``); a ``COMPLETE`` marker is
written last, and ``--resume`` continues from the newest complete checkpoint.

The output folder is owned by one run at a time (`coordrl.rundir.RunLock` on rank 0). A fresh run
into a folder that holds another run's checkpoints, final model or traces is refused unless it
resumes (``--resume``) or replaces them (``--overwrite`` deletes them first, so nothing stale is ever
resumed). Resuming from ``checkpoint-N`` drops the trace rows of steps >= N (and a torn last line):
the resumed run writes those steps again, so a trace file holds each step once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordrl import __version__
from coordrl.data.build import BuildConfig, build_dataset
from coordrl.data.hmars_world import HMARS_WORLD_ENV, build_hmars_world_dataset
from coordrl.data.resources import shipped_path
from coordrl.data.show import load_built
from coordrl.data.world import build_world_dataset
from coordrl.data.world_reader import built_docs_per_chunk
from coordrl.envs.protocols import get_protocol
from coordrl.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN
from coordrl.rollout.models import (
    CHECKPOINT_META,
    COMPLETE_MARKER,
    latest_complete_checkpoint,
    resolve_model,
)
from coordrl.rundir import RunLock, rewrite_jsonl
from coordrl.software import software
from coordrl.train.config import ConfigError, CoordConfig, TrainConfig
from coordrl.train.plan import check_batch
from coordrl.train.reward import EpisodeReward
from coordrl.train.trainer import CoordGRPOTrainer

DEFAULT_OUTPUT_DIR = "runs/coordrl"


def _load_policy(model_path: str, spec: str):
    """The policy's tokenizer and model; a hub id that cannot be loaded is a `ConfigError` naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True, dtype="auto")
    except (OSError, ValueError) as e:
        if Path(model_path).is_dir():
            raise ConfigError(f"model: cannot load {model_path}: {str(e).splitlines()[0]}") from None
        offline = (
            " (offline: HF_HUB_OFFLINE is set, so only the local cache is searched)"
            if os.environ.get("HF_HUB_OFFLINE")
            else ""
        )
        raise ConfigError(
            f"model: {spec!r} is not a local folder and could not be loaded from the hub{offline}; give a model folder"
        ) from None
    return tokenizer, model


BUILD_STAMP = "coordrl_build.json"


def _cached_build(folder: Path, marker: str, settings: dict[str, Any], build) -> None:
    """Run ``build`` (which fills ``folder``) unless ``folder`` holds a complete build (``marker``)
    made with the same ``settings``, which ``BUILD_STAMP`` records. The data a run builds under its
    output folder is a cache of a deterministic build, so a build made with other settings (say, an
    earlier run's ``world_train_size``) is rebuilt, with a note, instead of being trained on."""
    stamp = folder / BUILD_STAMP
    if (folder / marker).exists():
        try:
            recorded = json.loads(stamp.read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded == settings:
            return
        if recorded is not None:
            changed = ", ".join(
                f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in settings.items() if recorded.get(k) != v
            )
            print(f"rebuilding {folder}: it was built with other settings ({changed})", file=sys.stderr)
        shutil.rmtree(folder)
    build()
    stamp.write_text(json.dumps(settings, indent=2) + "\n")


def _dataset(
    spec: str | None, coord: CoordConfig, output_dir: Path, split: str, limit: int | None = None, tokenizer=None
):
    """Load a built dataset folder, or build one (shipped sample, world, HMARS world); add the ``prompt``
    column. ``tokenizer``: the policy's, which HMARS world pages are laid out with."""
    if spec is None:
        return None
    if spec == "sample":
        folder = output_dir / "data" / split
        # Training on the dev sample, evaluating on the disjoint train sample (held-out questions).
        source = "sample" if split == "train" else str(_shipped_train_sample())
        config = BuildConfig(
            source=source,
            num_paragraphs=coord.sample_num_paragraphs,
            seed=coord.seed_data + (split != "train"),
            overwrite=True,
        )
        _cached_build(
            folder,
            "state.json",
            {"sample_num_paragraphs": config.num_paragraphs, "seed": config.seed},
            lambda: build_dataset(config, folder),
        )
        spec = str(folder)
    elif spec == "world":
        # The synthetic multi-hop world (coordrl.data.world): training chains, or the held-out ones.
        root = output_dir / "data" / f"world-seed{coord.seed_data}"
        settings = {
            "world_train_size": coord.world_train_size,
            "world_heldout_size": coord.world_heldout_size,
            "world_docs_per_chunk": coord.world_docs_per_chunk,
        }
        if coord.world_train_docs is not None:  # earlier stamps, which lack the key, stay valid
            settings["world_train_docs"] = coord.world_train_docs
        _cached_build(
            root,
            "world.json",
            settings,
            lambda: build_world_dataset(
                root,
                n_train=coord.world_train_size,
                n_heldout=coord.world_heldout_size,
                seed=coord.seed_data,
                docs_per_chunk=coord.world_docs_per_chunk,
                train_docs=coord.world_train_docs,
            ),
        )
        spec = str(root / ("train" if split == "train" else "heldout"))
    elif spec == "hmars_world":
        # The HMARS world (coordrl.data.hmars_world): laid out with the policy's tokenizer, so the
        # folder is keyed by it as well as by the seed.
        root = output_dir / "data" / f"hmars-world-seed{coord.seed_data}-{_vocab_tag(tokenizer)}"
        _cached_build(
            root,
            "hmars_world.json",
            {"world_train_size": coord.world_train_size, "world_heldout_size": coord.world_heldout_size},
            lambda: build_hmars_world_dataset(
                root,
                n_train=coord.world_train_size,
                n_heldout=coord.world_heldout_size,
                seed=coord.seed_data,
                tokenizer=tokenizer,
            ),
        )
        spec = str(root / ("train" if split == "train" else "heldout"))
    ds = load_built(spec)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    keep = {
        "id",
        "question",
        "answers",
        "context",
        "doc_offsets",
        "gold_documents",
        "num_tokens",
        "chunks",
        "chunk_documents",
    }
    ds = ds.remove_columns([c for c in ds.column_names if c not in keep])
    protocol, system = get_protocol(coord.protocol), system_prompt_of(coord)
    return ds.map(lambda row: {"prompt": protocol.prompt(row["question"], system)}, desc=f"prompts ({split})")


def _datasets(coord: CoordConfig, output_dir: Path, tokenizer=None) -> tuple[Any, Any]:
    """The training and evaluation datasets (`_dataset`), after one check of the served world
    readers' chunking (once per run, not once per split)."""
    if "world" in (coord.train_data, coord.eval_data):
        _check_world_reader_chunking(coord)
    train_ds = _dataset(coord.train_data, coord, output_dir, "train", tokenizer=tokenizer)
    eval_ds = _dataset(coord.eval_data, coord, output_dir, "eval", coord.eval_samples, tokenizer=tokenizer)
    return train_ds, eval_ds


def _check_world_reader_chunking(coord: CoordConfig) -> None:
    """Warn when served world readers get chunks cut otherwise than the reader model was built to read
    (the kept world reader reads one document per chunk and misreads two-document chunks)."""
    if coord.readers.strip() == "lexical" or not coord.reader_model:
        return
    built = built_docs_per_chunk(coord.reader_model)
    if built is not None and built != coord.world_docs_per_chunk:
        print(
            f"warning: reader_model {coord.reader_model} was built to read {built} world document(s) per chunk, "
            f"but world_docs_per_chunk is {coord.world_docs_per_chunk}; set world_docs_per_chunk: {built}",
            file=sys.stderr,
        )


def _vocab_tag(tokenizer) -> str:
    """A short fingerprint of a tokenizer's vocabulary (names a folder of rows laid out with it)."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:10]


def _check_world_layout(cfg: TrainConfig) -> None:
    """HMARS world rows are laid out for `HMARS_WORLD_ENV`'s regions and pages; other sizes would
    split the evidence differently than the world promises, so they are refused, naming the field."""
    if "hmars_world" not in (cfg.coord.train_data, cfg.coord.eval_data):
        return
    if cfg.coord.protocol != "hmars":
        raise ConfigError("train_data / eval_data: hmars_world is HMARS data; set protocol: hmars")
    env = cfg.env_config()
    for key in ("c_sub", "page_tokens", "group_size"):
        if getattr(env, key) != HMARS_WORLD_ENV[key]:
            raise ConfigError(
                f"hmars.{key}: hmars_world rows are laid out for {key}={HMARS_WORLD_ENV[key]}, got {getattr(env, key)}"
            )


def system_prompt_of(coord: CoordConfig) -> str:
    """The run's system prompt: the config's, else coordrl's for the protocol."""
    return coord.system_prompt or get_protocol(coord.protocol).system_prompt


def _shipped_train_sample() -> Path:
    return shipped_path("hotpotqa-train")


def checkpoint_metadata(cfg: TrainConfig, model_path: str) -> dict[str, Any]:
    system_prompt = system_prompt_of(cfg.coord)
    tools, env = [get_protocol(cfg.coord.protocol).tool], asdict(cfg.env_config(model_path))
    return {
        "coordrl_version": __version__,
        "protocol": cfg.coord.protocol,
        "base_model": cfg.coord.model,
        "system_prompt": system_prompt,
        "answer_format": f"{ANSWER_OPEN}...{ANSWER_CLOSE}",
        "tools": tools,
        "env": env,
        "config": cfg.to_dict(),
        "software": software(),
    }


def _callbacks(cfg: TrainConfig, model_path: str):
    import time

    from transformers import TrainerCallback

    meta = checkpoint_metadata(cfg, model_path)
    limit = cfg.coord.max_train_minutes

    class TimeLimit(TrainerCallback):
        """Stops training (after the current step, then saves) once ``max_train_minutes`` have passed."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            if time.monotonic() - self.t0 > limit * 60:
                control.should_training_stop = True
                control.should_save = True
            return control

    class CheckpointRecorder(TrainerCallback):
        """Writes the training metadata into each checkpoint, then the COMPLETE marker, last."""

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if folder.exists():
                    (folder / CHECKPOINT_META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
                    (folder / COMPLETE_MARKER).write_text(f"step {state.global_step}\n")
            return control

    return [CheckpointRecorder()] + ([TimeLimit()] if limit else [])


def _secret_safe_env() -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"  # works without an account; `wandb sync` uploads later


def build_trainer(cfg: TrainConfig, *, trainer_cls: type | None = None, fleet=None):
    """The configured `CoordGRPOTrainer` (not yet training); its ``env_factory`` is the environment
    factory, which the caller closes when done (`train` does).

    Args:
        trainer_cls: a `CoordGRPOTrainer` subclass to use instead (tests, benchmarks).
        fleet: a reader fleet to use instead of the one the config describes.
    """
    from trl import GRPOConfig

    _secret_safe_env()
    grpo_kwargs = dict(cfg.grpo)
    grpo_kwargs.setdefault("output_dir", DEFAULT_OUTPUT_DIR)
    output_dir = Path(grpo_kwargs["output_dir"])
    if "report_to" in grpo_kwargs and "wandb" in str(grpo_kwargs["report_to"]):
        os.environ.setdefault("WANDB_DIR", str(output_dir))
        os.environ.setdefault("WANDB_PROJECT", "coordrl")
    # The plan's batch arithmetic names the fields to change; TRL's own check (in GRPOConfig) only
    # says what is not divisible.
    check_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    _check_world_layout(cfg)
    model_path = resolve_model(cfg.coord.model)
    args = GRPOConfig(**grpo_kwargs)
    tokenizer, model = _load_policy(model_path, cfg.coord.model)
    from accelerate import PartialState

    # Rank 0 builds an on-the-fly dataset; the other ranks wait and then read it.
    with PartialState().main_process_first():
        train_ds, eval_ds = _datasets(cfg.coord, output_dir, tokenizer)
    rank = int(os.environ.get("RANK", "0"))
    trace_dir = output_dir / "traces" if cfg.coord.traces else None
    protocol = get_protocol(cfg.coord.protocol)
    factory = protocol.factory(cfg.env_config(model_path), tokenizer=tokenizer, fleet=fleet)
    if protocol.env_owns_reward:
        # HMARS: the frozen answer model's exact match is the reward; the environment owns it
        # (`get_reward`, which TRL adds as a reward column) and EpisodeReward only logs.
        reward = EpisodeReward(trace_dir, rank=rank, score=False)
    else:
        reward = EpisodeReward(trace_dir, rank=rank, eos_token_id=tokenizer.eos_token_id)
    trainer = (trainer_cls or CoordGRPOTrainer)(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        environment_factory=factory,
        callbacks=_callbacks(cfg, model_path),
        tool_concurrency=cfg.coord.tool_concurrency,
        mask_observations=cfg.coord.mask_observations,
        lockstep=cfg.coord.lockstep,
        share_prompt_prefix=cfg.coord.share_prompt_prefix,
        share_generation_prefix=cfg.coord.share_generation_prefix,
    )
    # The factory owns the frozen roles' connection pools and caches: `train` closes it when the run
    # ends (TRL keeps no handle on it).
    trainer.env_factory = factory
    (output_dir).mkdir(parents=True, exist_ok=True)
    (output_dir / "coordrl_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str) + "\n")
    return trainer


def _is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def previous_run(output_dir: Path) -> list[str]:
    """What another run left in ``output_dir``: checkpoint folders, ``final``, non-empty trace files."""
    if not output_dir.is_dir():
        return []
    found = sorted(
        (
            p.name
            for p in output_dir.iterdir()
            if p.is_dir() and (re.fullmatch(r"checkpoint-\d+", p.name) or p.name == "final")
        ),
        key=lambda n: (n == "final", int(n.split("-")[1]) if n != "final" else 0),
    )
    traces = output_dir / "traces"
    if traces.is_dir() and any(p.stat().st_size for p in traces.glob("*.jsonl")):
        found.append("traces/")
    return found


def _clear_previous_run(output_dir: Path) -> None:
    """``--overwrite``: delete the old run's checkpoints, final model, traces and config (built data stays)."""
    for p in list(output_dir.iterdir()):
        if p.is_dir() and (re.fullmatch(r"checkpoint-\d+", p.name) or p.name in ("final", "traces")):
            shutil.rmtree(p)
    (output_dir / "coordrl_config.json").unlink(missing_ok=True)


def _trim_traces(output_dir: Path, step: int) -> int:
    """Drop this rank's trace rows of steps >= ``step`` (the resumed run writes them again); returns the count."""
    path = output_dir / "traces" / f"rank{int(os.environ.get('RANK', '0'))}.jsonl"
    return rewrite_jsonl(path, lambda row: not isinstance(row.get("step"), int) or row["step"] < step)


def train(
    cfg: TrainConfig, resume: bool = False, *, overwrite: bool = False, break_lock: bool = False, **build_kwargs: Any
) -> Path:
    """Train; returns the output folder.

    Args:
        resume: continue from the newest complete checkpoint (its later trace rows are dropped).
        overwrite: delete another run's checkpoints, final model and traces in ``output_dir`` first
            (default False: such a folder is refused with a `ConfigError`).
        break_lock: take over a lock another host left on ``output_dir`` (see `coordrl.rundir`).
        build_kwargs: passed to `build_trainer`.

    Raises:
        ConfigError: ``resume`` and ``overwrite`` together, nothing to resume, or a folder holding
            another run. `coordrl.rundir.RunDirError`: the folder is in use or cannot be written.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run in output_dir, or replace it")
    output_dir = Path(cfg.grpo.get("output_dir", DEFAULT_OUTPUT_DIR))
    # Rank 0 owns the folder for the whole run; the other ranks write only their own trace files.
    lock = RunLock(output_dir, what="output_dir", break_lock=break_lock) if _is_main_rank() else nullcontext()
    with lock:
        checkpoint = None
        if resume:
            checkpoint = latest_complete_checkpoint(output_dir)
            if checkpoint is None:
                raise ConfigError(f"--resume: no complete checkpoint in {output_dir}; start afresh with --overwrite")
            step = int(checkpoint.name.split("-")[1])
            dropped = _trim_traces(output_dir, step)
            note = f"; dropped {dropped} trace row(s) of steps >= {step}" if dropped else ""
            print(f"resuming from {checkpoint}{note}", file=sys.stderr)
        else:
            found = previous_run(output_dir)
            if found and overwrite:
                if _is_main_rank():
                    _clear_previous_run(output_dir)
                print(f"--overwrite: deleted {', '.join(found)} of the previous run in {output_dir}", file=sys.stderr)
            elif found:
                raise ConfigError(
                    f"output_dir {output_dir} holds another run ({', '.join(found)}); pass --resume to continue it "
                    "or --overwrite to delete its checkpoints, final model and traces first"
                )
        trainer = build_trainer(cfg, **build_kwargs)
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        finally:
            # Reader / frozen-role connection pools, also when training fails; a fleet the caller
            # passed in stays the caller's to close.
            if build_kwargs.get("fleet") is None:
                trainer.env_factory.close()
        trainer.save_model(str(output_dir / "final"))
        meta = checkpoint_metadata(cfg, str(output_dir / "final"))
        (output_dir / "final" / CHECKPOINT_META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        (output_dir / "final" / COMPLETE_MARKER).write_text("final\n")
    return output_dir
