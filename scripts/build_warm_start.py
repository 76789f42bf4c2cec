"""Build the world warm start: a tiny Qwen3 taught the tool protocol by supervised fine-tuning.

Documented loop (not SFTTrainer, so the rendering is provably TRL's): every demonstration is a
scripted episode driven through `coordrl.envs.step.StepEnv`, i.e. prompt ids rendered with TRL's
prefix-preserving training template and the world's system prompt, assistant turns as ids (loss on),
tool-response suffixes built by TRL's ``_get_tool_suffix_ids`` (loss off). Demonstrations are
deliberately imperfect: a fraction ``--p-good-*`` (default 0.45 bridge, 0.35 comparison) solve the question, the rest stop after
the first hop and answer a decoy (bridge: the filming city; comparison: a birth decade), so the warm
start can do every step of the task but usually takes the wrong branch.

Skills that plain SFT does not pick up in minutes get drills, mixed into every step (``--drills``):
* copying: random names then the same names again, and key-value recall ("k1 v1 k2 v2 . k2 v2",
  keys being the world's own words, so "the film F ... the film ?" is covered);
* comparing (``--compare-frac``): two birth-decade facts, the comparison question, the earlier-born name;
  from step ``--adjacent-from`` on, ``--adjacent-frac`` of them between neighbouring decades. Measured
  (100 held-out comparisons, teacher-forced good trajectory): uniform pairs left P(correct answer) at
  0.65 on neighbouring decades against 0.93-0.98 at gaps of 3 or more, and GRPO barely moved it (0.65-0.70);
  with the late stress the overall P(correct) went 0.87 -> 0.90 (gap 2: 0.79 -> 0.84; neighbours stayed at
  0.65) and its bias towards the first-named person disappeared (first 0.93 / second 0.81 -> 0.90 / 0.90);
  stressed from step 0, the comparison never emerged (0.50). ``--episode-frac`` lays that share of the
  comparison drills out as in an episode (`episode_layout`), from step ``--adjacent-from`` on (default 0.5:
  in the drills' own layout the warm start put P = 0.95 on the right name for neighbouring decades, in the
  episode's order 0.69; with these drills 0.78). The episode-layout drills end on the answer tag after
  findings, which pulled bridge towards answering after one hop; a bridge solve rate of 0.45 restores it.
Entity names in demonstrations weigh ``--name-weight`` in the loss (default 4): they are a few tokens
among dozens of fixed JSON ones. Measured effect (2 cores): without recall drills the first query
never copied the film name (0% of held-out bridge questions); without comparison drills the
comparison answer stayed at chance.

    python scripts/build_warm_start.py --out src/coordrl/resources/warm_start

``--env FIELD=VALUE ...`` plays the demonstrations in another environment (e.g. routed readers, whose
tool description differs) and ``--docs-per-chunk 1`` on one-document reader chunks (as model-served
readers read the world: 7 readers per question instead of 4), so a policy is taught the prompt and
findings it meets at GRPO time. Both are recorded in ``coordrl_warm_start.json`` when set.

Reproducible: the work is fixed (``--steps`` SFT steps, default 400) and runs on a fixed number of
torch threads (``--threads``, default 2) with torch's deterministic algorithms and CPU kernels pinned
at one SIMD level (``--cpu-capability``, default the kept build's ``avx512``), so the same seed gives the
same weights on any machine that has that level, however fast it is (tests/test_world.py builds a short
warm start twice and compares the bytes). The wall time is reported against the 10-minute
target, never used to stop the work; ``--minutes`` adds an explicit cap for those who want one.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from coordrl.software import add_capability_flag, pin_cpu_capability

# The SIMD level torch ran the kept world warm start at (its recorded losses repeat at this level only; the
# pin makes a rebuild byte-identical on any host that has it; docs/world_reader.md).
KEPT_CPU_CAPABILITY = "avx512"


def log(msg: str) -> None:
    print(msg, flush=True)


# Share of solving demonstrations per question type: low enough that the warm start usually takes the
# wrong branch (near 0% greedy, 25-45% sampled held-out exact match), high enough that it has seen
# every step of the task.
DEFAULT_P_GOOD = {"bridge": 0.45, "comparison": 0.35}


def episode_layout(p1: str, p2: str, facts: list[str], rng: random.Random, readers: int = 4) -> str:
    """A comparison drill laid out as in an episode: the question first, the two findings (``facts[i]``
    belongs to ``p{i+1}``) as the environment renders them, in random order and from random chunks of
    ``readers`` (default 4, a world question's chunks at two documents each), then the answer tag.
    Drilled only with the facts before the question, the kept warm start puts P = 0.95 on the
    earlier-born name for neighbouring decades in that layout, but 0.69 with the question first, as in
    every episode."""
    found = [(p1, facts[0]), (p2, facts[1])]
    if rng.random() < 0.5:
        found.reverse()
    lines = [f"Question: Who was born earlier, {p1} or {p2}?", f"2 finding(s) from {readers} readers for 2 query(ies)."]
    for k, (who, fact) in enumerate(found, start=1):
        lines += [f'Query {k}: "In which decade was {who} born?"', f"- chunk {rng.randrange(readers)}: {who}: {fact}"]
    return "\n".join(lines) + "\n<answer>"


def copy_accuracy(model, tok, rows: list[dict], codec, factory, name_set: set[int]) -> dict[str, float]:
    """Share of entity names a policy gets right (argmax, teacher-forced) in the solving demonstration
    of each row, per question type and for the first query's name: copying, apart from branching."""
    from coordrl.rollout.world import demo_ids

    hits: dict[str, list[int]] = {}
    with torch.no_grad():
        for row in rows:
            ids, mask = demo_ids(row, True, codec, factory)
            pred = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
            first = True
            for i in range(1, len(ids)):
                if mask[i] and ids[i] in name_set:
                    ok = int(pred[i - 1] == ids[i])
                    hits.setdefault(row["type"], []).append(ok)
                    if first:
                        hits.setdefault(f"{row['type']}_first_query", []).append(ok)
                        first = False
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}


def _build(
    out: Path,
    *,
    seed: int = 0,
    minutes: float | None = None,
    steps: int | None = 400,
    p_good: float | dict[str, float] | None = None,
    n_train: int = 3000,
    n_eval: int = 100,
    lr: float = 1.5e-3,
    batch: int = 16,
    drills: int = 96,
    drill_weight: float = 1.0,
    threads: int | None = 2,
    init: Path | None = None,
    max_drill: int = 10,
    warmup: int = 100,
    name_weight: float = 4.0,
    recall_frac: float = 0.6,
    compare_frac: float = 0.5,
    adjacent_frac: float = 0.5,
    adjacent_from: int = 250,
    episode_frac: float = 0.5,
    env: dict | None = None,
    docs_per_chunk: int = 2,
) -> dict:
    from transformers import AutoModelForCausalLM

    from coordrl.data.tokenizer import save_tokenizer
    from coordrl.data.world import DECADES, decade_sentence, make_world, world_splits
    from coordrl.envs.chat import ChatCodec
    from coordrl.rollout.tiny_qwen3 import build_tiny_qwen3
    from coordrl.rollout.world import (
        build_world_tokenizer,
        demo_ids,
        evaluate_world,
        make_env_factory,
        publish_warm_start,
    )

    if threads:
        torch.set_num_threads(threads)
    # Same seed, same threads: same weights. warn_only: an op without a deterministic kernel warns
    # (naming it) instead of stopping the build.
    torch.use_deterministic_algorithms(True, warn_only=True)
    if steps is None and minutes is None:
        raise ValueError("build() needs steps or minutes")
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    tok = build_world_tokenizer(seed=0)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_qwen3(tmp, tokenizer=tok, seed=seed)
    # ``init``: continue from an earlier warm start (same tokenizer) instead of random weights.
    model = AutoModelForCausalLM.from_pretrained(str(init or tmp), use_safetensors=True, dtype=torch.float32)
    codec = ChatCodec(tok)
    # ``env``: environment settings the demonstrations are played in (e.g. ``activation: routed``, whose
    # tool description differs: a policy meets at GRPO time the prompt it was taught with).
    factory = make_env_factory(tok, **(env or {}))
    # ``docs_per_chunk``: the chunking the policy's readers will read (1 for model-served readers), so the
    # findings' chunk numbers and reader counts are those it meets at GRPO time.
    splits = world_splits(n_train, n_eval, seed=0, docs_per_chunk=docs_per_chunk)
    readers = len(splits["train"][0]["chunks"])
    rng = random.Random(seed)
    demos = []
    p_good = DEFAULT_P_GOOD if p_good is None else p_good
    rates = [(p_good.get(row["type"], 0.0) if isinstance(p_good, dict) else p_good) for row in splits["train"]]
    # Both trajectories of every question; each draw picks one at random, so no question's branch can be
    # memorised and the branch probability the model learns is the demonstration rate itself.
    for row in splits["train"]:
        demos.append(
            (
                demo_ids(row, True, codec, factory, max_completion_tokens=1024),
                demo_ids(row, False, codec, factory, max_completion_tokens=1024),
            )
        )
    flat = [d for pair in demos for d in pair]
    log(
        f"{len(flat)} demonstrations built ({time.time() - t0:.0f}s); vocab {len(tok)}; mean length {sum(len(d[0]) for d in flat) / len(flat):.0f}"
    )
    names = [tok(f" {n}", add_special_tokens=False)["input_ids"][0] for n in make_world(0).names]
    dot = tok(" .", add_special_tokens=False)["input_ids"]
    pad = tok.pad_token_id
    name_set = set(names)

    # Keys for recall drills: the world's own words, so "the film F ... the film ?" is a drill the model has seen.
    key_words = sorted({t for text in (flat[0][0], flat[2][0]) for t in text} - name_set - set(tok.all_special_ids))

    world = make_world(0)

    def compare_drill() -> tuple[list[int], list[int], bool]:
        # The comparison question's decision in isolation: two birth-decade facts, the question, the
        # earlier-born name (loss on that name only).
        p1, p2 = rng.sample(world.people, 2)
        if step >= adjacent_from and rng.random() < adjacent_frac:
            # Neighbouring decades are the hard pairs: with uniform pairs the warm start gave them P = 0.65.
            # Only once the comparison is learned: stressed from the start, it never emerged (chance).
            i = rng.randrange(len(DECADES) - 1)
            y1, y2 = rng.sample(DECADES[i : i + 2], 2)
        else:
            y1, y2 = rng.sample(DECADES, 2)
        facts = [decade_sentence(p1, y1), decade_sentence(p2, y2)]
        # No draw when off, so a build with episode_frac 0 is the earlier recipe's, byte for byte.
        episode = episode_frac > 0 and step >= adjacent_from and rng.random() < episode_frac
        if episode:
            text = episode_layout(p1, p2, facts, rng, readers)
        else:
            rng.shuffle(facts)
            text = f"{facts[0]} {facts[1]} Who was born earlier, {p1} or {p2}?"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(f" {p1 if y1 < y2 else p2}", add_special_tokens=False)["input_ids"]
        return ids + answer, [0] * len(ids) + [1] * len(answer), episode

    def drill_batch(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Episode-layout comparisons (about 60 tokens) form their own padded group, so they do not widen
        # the batch of short drills (at most 41 tokens): padded into one batch they made each step 1.5x slower.
        seqs, masks, long_seqs, long_masks = [], [], [], []
        for _ in range(n):
            k = rng.randint(3, max_drill)
            if rng.random() < compare_frac:
                seq, mask, episode = compare_drill()
                (long_seqs if episode else seqs).append(seq)
                (long_masks if episode else masks).append(mask)
                continue
            if rng.random() < recall_frac:
                # Associative recall: "k1 v1 k2 v2 ... . kj vj ..." (keys distinct, asked in shuffled order).
                keys = rng.sample(key_words, k)
                vals = [rng.choice(names) for _ in range(k)]
                order = rng.sample(range(k), k)
                seq = [t for kv in zip(keys, vals, strict=True) for t in kv] + dot
                mask = [0] * len(seq)
                for j in order:
                    seq += [keys[j], vals[j]]
                    mask += [0, 1]
                seqs.append(seq)
                masks.append(mask)
                continue
            picked = [rng.choice(names) for _ in range(k)]
            seqs.append(picked + dot + picked)
            masks.append([0] * (k + len(dot)) + [1] * k)
        return [padded(ss, ms) for ss, ms in ((seqs, masks), (long_seqs, long_masks)) if ss]

    def padded(seqs: list[list[int]], masks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        w = max(map(len, seqs))
        return (
            torch.tensor([s + [pad] * (w - len(s)) for s in seqs]),
            torch.tensor([m + [0] * (w - len(m)) for m in masks]),
        )

    # Every demonstration starts with the same system prompt + tool schema (~470 tokens, no loss on it):
    # it runs once per step at batch size 1 and its key/value cache (with gradients) is shared by the batch.
    first = flat[0][0]
    prefix_len = min(
        next((i for i, (a, b) in enumerate(zip(first, ids)) if a != b), min(len(first), len(ids))) for ids, _ in flat
    )
    prefix_len = min(prefix_len, min(len(ids) for ids, _ in flat) - 1)
    prefix = torch.tensor([first[:prefix_len]])
    log(f"shared prompt prefix: {prefix_len} tokens")

    def weighted(ids: list[int], mask: list[int]) -> list[float]:
        # Entity names are the hard tokens (one per query among dozens of fixed JSON tokens): weigh them up.
        return [float(m) * (name_weight if t in name_set else 1.0) for t, m in zip(ids, mask, strict=True)]

    def demo_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        picked = []
        for _ in range(n):
            i = rng.randrange(len(demos))
            picked.append(demos[i][0] if rng.random() < rates[i] else demos[i][1])
        w = max(len(ids) for ids, _ in picked)
        return (
            torch.tensor([ids[prefix_len:] + [pad] * (w - len(ids)) for ids, _ in picked]),
            torch.tensor([weighted(ids, m)[prefix_len:] + [0.0] * (w - len(m)) for ids, m in picked]),
        )

    def demo_loss(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        cache = DynamicCache()
        model(input_ids=prefix, cache=cache, use_cache=True)
        cache.batch_repeat_interleave(ids.size(0))
        pos = torch.arange(prefix_len, prefix_len + ids.size(1)).unsqueeze(0).expand(ids.size(0), -1)
        logits = model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True).logits[:, :-1]
        return masked_nll(logits, ids, mask)

    def drill_loss(groups: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # One mean over all groups' loss positions, as if they were one batch.
        total, count = None, None
        for ids, mask in groups:
            logits = model(input_ids=ids).logits[:, :-1]  # right padding: causal attention never sees it
            s, c = nll_sum(logits, ids, mask)
            total, count = (s, c) if total is None else (total + s, count + c)
        return total / count.clamp(min=1)

    def masked_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s, c = nll_sum(logits, ids, mask)
        return s / c.clamp(min=1)

    def nll_sum(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target, m = ids[:, 1:], mask[:, 1:].float()
        # Normalised by the number of loss positions (not their weights), so name_weight adds signal.
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none"
        ).view_as(m)
        return (nll * m).sum(), (m > 0).sum()

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    deadline = t0 + minutes * 60 if minutes is not None else float("inf")
    step = 0
    model.train()
    history = []
    while True:
        if steps is not None and step >= steps:
            break
        if time.time() > deadline - 60:  # keep a minute for the final evaluation
            if steps is not None:
                log(f"WARNING: the {minutes:g}-minute cap stopped SFT at step {step} of {steps}")
            break
        scale = min(1.0, (step + 1) / warmup)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        ids, mask = demo_batch(batch)
        loss = demo_loss(ids, mask)
        if drills:
            dloss = drill_loss(drill_batch(drills))
        else:
            dloss = torch.tensor(0.0)
        total = loss + drill_weight * dloss
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step <= 5:
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "drill_loss": round(dloss.item(), 4),
                    "s": round(time.time() - t0, 1),
                }
            )
            log(f"step {step}: demo loss {loss.item():.3f}  drill loss {dloss.item():.3f}  ({time.time() - t0:.0f}s)")
    model.eval()
    sft_s = time.time() - t0
    copy = copy_accuracy(model, tok, splits["heldout"], codec, factory, name_set)
    log(f"held-out name copying (teacher-forced argmax on solving demonstrations): {json.dumps(copy)}")
    ev_s = evaluate_world(model, tok, splits["heldout"], sample=True, seed=seed, env_overrides=env)
    ev_g = evaluate_world(model, tok, splits["heldout"], sample=False, seed=seed, env_overrides=env)
    log(f"held-out EM ({n_eval} questions): sampled {json.dumps(ev_s)}; greedy {json.dumps(ev_g)}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    save_tokenizer(tok, tmp)
    meta = {
        "what": "coordrl world warm start (scripts/build_warm_start.py)",
        "seed": seed,
        "steps": step,
        "sft_seconds": round(sft_s, 1),
        "total_seconds": round(time.time() - t0, 1),
        "p_good": p_good,
        "n_train": n_train,
        "lr": lr,
        "batch": batch,
        "drills": drills,
        "drill_weight": drill_weight,
        "max_drill": max_drill,
        "name_weight": name_weight,
        "recall_frac": recall_frac,
        "warmup": warmup,
        "compare_frac": compare_frac,
        "adjacent_frac": adjacent_frac,
        "adjacent_from": adjacent_from,
        "episode_frac": episode_frac,
        "init": str(init) if init else None,
        "init_meta": json.loads((Path(init) / "coordrl_warm_start.json").read_text())
        if init and (Path(init) / "coordrl_warm_start.json").exists()
        else None,
        "heldout_copy": copy,
        "heldout_sampled": ev_s,
        "heldout_greedy": ev_g,
        "history": history,
        "torch_threads": torch.get_num_threads(),
    }
    if env:  # only then, so a default build's record stays as it was
        meta["env"] = env
    if docs_per_chunk != 2:
        meta["docs_per_chunk"] = docs_per_chunk
    publish_warm_start(tmp, out, meta, t0, log)
    return meta


def build(*args, **kwargs) -> dict:
    """Build the warm start (arguments as ``_build``) with torch's deterministic algorithms on, and
    put the caller's setting back afterwards: the learning check trains GRPO in the same process and
    must run as it would after loading a kept warm start (global state must not leak into it)."""
    was_on, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        return _build(*args, **kwargs)
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


build.__wrapped__ = _build  # inspect.signature(build) shows _build's: tests and callers read its defaults


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="src/coordrl/resources/warm_start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="optional wall-clock cap including the final evaluation (stops early, with a warning; makes the weights depend on machine speed)",
    )
    p.add_argument("--steps", type=int, default=400, help="SFT steps (default 400); 0: as many as --minutes allows")
    p.add_argument(
        "--p-good-bridge",
        type=float,
        default=DEFAULT_P_GOOD["bridge"],
        help="fraction of bridge demonstrations that solve the question",
    )
    p.add_argument(
        "--p-good-comparison",
        type=float,
        default=DEFAULT_P_GOOD["comparison"],
        help="the same for comparison questions",
    )
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--batch", type=int, default=16, help="demonstrations per step")
    p.add_argument("--no-drills", action="store_true", help="ablation: no copy drills")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (default 2; fixed, so the weights do not depend on the core count)",
    )
    p.add_argument("--init", default=None, help="continue SFT from this warm-start folder")
    p.add_argument("--drills", type=int, default=96, help="drills per step")
    p.add_argument("--drill-weight", type=float, default=1.0)
    p.add_argument("--max-drill", type=int, default=10, help="longest copy drill (names)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--name-weight", type=float, default=4.0, help="loss weight of entity-name tokens in demonstrations")
    p.add_argument(
        "--recall-frac",
        type=float,
        default=0.6,
        help="fraction of the copy drills that are key-value recall instead of plain repeats",
    )
    p.add_argument(
        "--compare-frac", type=float, default=0.5, help="fraction of drills that are birth-decade comparisons"
    )
    p.add_argument(
        "--adjacent-frac",
        type=float,
        default=0.5,
        help="fraction of comparison drills between neighbouring decades, from step --adjacent-from on",
    )
    p.add_argument("--adjacent-from", type=int, default=250, help="SFT step from which --adjacent-frac applies")
    p.add_argument(
        "--episode-frac",
        type=float,
        default=0.5,
        help="fraction of comparison drills laid out as in an episode (question, findings, answer tag), from step --adjacent-from on (0: the earlier recipe, byte for byte)",
    )
    p.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="environment settings the demonstrations are played in, as coordrl train's overrides "
        "(e.g. activation=routed route_bm25_top_k=1 route_summary_top_k=1)",
    )
    p.add_argument(
        "--docs-per-chunk",
        type=int,
        default=2,
        help="world documents per reader chunk in the demonstrations (default 2; 1: as model-served readers read)",
    )
    add_capability_flag(p, KEPT_CPU_CAPABILITY)
    a = p.parse_args(argv)
    if a.docs_per_chunk < 1:
        p.error(f"--docs-per-chunk: must be >= 1, got {a.docs_per_chunk}")
    pin_cpu_capability(a.cpu_capability)
    p_good = {"bridge": a.p_good_bridge, "comparison": a.p_good_comparison}
    env = env_settings(dict(kv.split("=", 1) for kv in a.env)) if a.env else None
    build(
        Path(a.out),
        seed=a.seed,
        minutes=a.minutes,
        steps=a.steps or None,
        p_good=p_good,
        lr=a.lr,
        batch=a.batch,
        drills=0 if a.no_drills else a.drills,
        drill_weight=a.drill_weight,
        threads=a.threads,
        init=Path(a.init) if a.init else None,
        max_drill=a.max_drill,
        warmup=a.warmup,
        name_weight=a.name_weight,
        recall_frac=a.recall_frac,
        compare_frac=a.compare_frac,
        adjacent_frac=a.adjacent_frac,
        adjacent_from=a.adjacent_from,
        episode_frac=a.episode_frac,
        env=env,
        docs_per_chunk=a.docs_per_chunk,
    )
    return 0


def env_settings(overrides: dict[str, str]) -> dict:
    """``--env`` typed as training reads it (configs/world_cpu.yaml plus the overrides); a field that is
    not an environment setting is an error naming it."""
    from dataclasses import fields

    from coordrl.envs.parser import ParserEnvConfig
    from coordrl.train.config import load_config

    names = {f.name for f in fields(ParserEnvConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise SystemExit(f"--env: not an environment setting: {', '.join(unknown)}")
    coord = load_config(Path(__file__).resolve().parents[1] / "configs" / "world_cpu.yaml", overrides).coord
    return {k: getattr(coord, k) for k in overrides}


if __name__ == "__main__":
    sys.exit(main())
