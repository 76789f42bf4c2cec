"""Build the world reader: a tiny Qwen3 that answers a lead query about one world chunk, or says Unknown.

Input: exactly the prompt every model reader gets from the fleet,
``tokenizer.apply_chat_template(reader_messages(chunk, query), add_generation_prompt=True,
enable_thinking=False)`` with the tokenizer and chat template saved next to the weights (what a vLLM
server applies). Output: ``"<title>: <sentence>"`` (the document's fact sentence in the lexical
reader's form, e.g. ``"Nuvol: The film Nuvol was directed by Mefi and filmed in Girer."``) when the
chunk holds the asked fact, else exactly ``Unknown``; then ``<|im_end|>``.

Data recipe (`coordrl.data.world_reader`): chunks of the world's training questions
(``world_splits(n_train, n_heldout, docs_per_chunk=docs_per_chunk)``: held-out questions are drawn
first and their chains never occur in training) and the three lead queries (``q_director``, ``q_city``, ``q_decade``). Every step asks
``queries`` questions about each of ``chunks`` random chunks; each question is a positive with
probability ``p_positive``, else a negative of kind ``hard`` (the entity is in the chunk, the asked
fact is not: a film's director whose own document is elsewhere, a person's other fact), ``row`` (an
entity of the same question, document in another chunk), ``absent`` (never mentioned) or
``wrong_type`` (an entity of the chunk in the wrong slot), drawn with ``negative_mix``. Facts are drawn
afresh for every question, so nothing can be memorised: the model must read. ``docs_per_chunk``
(default 1) is the chunking the model reads: one whole document per chunk, as model-served readers of
the world are given (``world_docs_per_chunk: 1``). With two documents per chunk a reader must tell two
sentences of one relation apart, which this 4-layer model does not learn (at chance however it is
trained, docs/world_reader.md); ``p_contrast`` oversamples such chunks (default 0; no one-document chunk
has two).

Model: fine-tuned from ``init``, the kept world warm start (``scripts/build_warm_start.py``: Qwen3,
hidden 256, 4 layers, 4 heads of 64, as vLLM's CPU attention needs, 2 KV heads, MLP 512, tied
embeddings, float32, 11 MB; the world tokenizer, every entity name one token). That policy already
copies names out of reader findings, the skill a reader needs. Measured on 2 shared cores: from random
weights (hidden 128 and 256, 1,000 and 200 steps) the loss stalled at the template level (0.8-1.2 nats
per answer token) and every held-out reply was ``Unknown``; from the warm start it fell below 0.15
within 225 steps.

Training: plain PyTorch, AdamW, linear warm-up then cosine decay, a fixed number of ``steps``, loss on
the answer tokens only (``<|im_end|>`` included). Keys/values are shared in three stages: the
instructions (same in every prompt) once per step, each passage once per chunk, then each question
and answer. ``--threads`` (default 2) sets ``torch.set_num_threads``; it changes speed only. Seeded:
the same arguments give the same data order and weights, on any x86-64 host with AVX2, as torch's CPU
kernels are pinned at that level (``--cpu-capability``, default the kept build's ``avx2``: the kept
weights were rebuilt byte for byte so on an AVX-512 host; docs/world_reader.md).

Held-out figures (greedy, transformers) on `eval_examples` of the first ``n_eval_rows`` held-out
questions go into ``coordrl_world_reader.json`` with the recipe; ``benchmarks/world_reader.py``
measures all 200 (and through vLLM with ``--vllm``). Build time and machine load: docs/world_reader.md.

    python scripts/build_world_reader.py                # writes src/coordrl/resources/world_reader
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from coordrl.data.world_reader import META_NAME
from coordrl.software import add_capability_flag, pin_cpu_capability

ROOT = Path(__file__).resolve().parents[1]
# The SIMD level torch ran the kept world reader at (its recorded losses repeat at this level only; the
# pin makes a rebuild byte-identical on any host that has it; docs/world_reader.md).
KEPT_CPU_CAPABILITY = "avx2"
DEFAULT_OUT = ROOT / "src" / "coordrl" / "resources" / "world_reader"

# The recipe; the kept model's metadata records exactly these (a test checks they match).
DEFAULTS: dict = {
    "seed": 0,
    "init": "src/coordrl/resources/warm_start",
    "steps": 900,
    "chunks": 16,
    "queries": 4,
    "lr": 1e-3,
    "warmup": 60,
    "min_lr_frac": 0.05,
    "weight_decay": 0.01,
    "value_weight": 4.0,
    "p_contrast": 0.0,
    "n_train": 2000,
    "n_heldout": 200,
    "n_eval_rows": 20,
    "docs_per_chunk": 1,
    "p_positive": 0.5,
    "negative_mix": {"hard": 0.45, "row": 0.2, "absent": 0.15, "wrong_type": 0.2},
}


def log(msg: str) -> None:
    print(msg, flush=True)


def prompt_ids(tok, chunk: str, query: str) -> list[int]:
    """The token ids a vLLM server builds from the fleet's request for (chunk, query)."""
    from coordrl.readers.prompt import (
        READER_CHAT_TEMPLATE_KWARGS,
        reader_messages,
    )

    return list(
        tok.apply_chat_template(
            reader_messages(chunk, query),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **READER_CHAT_TEMPLATE_KWARGS,
        )
    )


def shared_prefix_len(tok) -> int:
    """Length of the instruction prefix every reader prompt starts with (the passage follows it)."""
    probe = [prompt_ids(tok, "a", "b"), prompt_ids(tok, "Document 1:\nc", "d")]
    return next(i for i, (a, b) in enumerate(zip(*probe)) if a != b)


def greedy_replies(model, tok, examples, batch_size: int = 64, max_new_tokens: int = 32) -> list[str]:
    """Greedy replies of ``model`` to ``examples``, decoded without special tokens.

    The instruction prefix (three quarters of every prompt) is computed once and shared: each batch
    continues it with the left-padded rest of its prompts (the padding sits inside the cache, hidden
    by the attention mask; positions skip it), then decodes token by token until every row has
    ended with ``<|im_end|>`` or ``max_new_tokens`` are out."""
    from transformers import DynamicCache

    eos, pad = tok.eos_token_id, tok.pad_token_id
    n_prefix = shared_prefix_len(tok)
    replies: list[str] = []
    model.eval()
    with torch.no_grad():
        base = DynamicCache()
        model(input_ids=torch.tensor([prompt_ids(tok, "a", "b")[:n_prefix]]), cache=base, use_cache=True)
        for start in range(0, len(examples), batch_size):
            tails = [prompt_ids(tok, e.chunk, e.query)[n_prefix:] for e in examples[start : start + batch_size]]
            n, width = len(tails), max(map(len, tails))
            cache = copy.deepcopy(base)
            cache.batch_repeat_interleave(n)
            ids = torch.tensor([[pad] * (width - len(t)) + t for t in tails])
            att = torch.tensor([[1] * n_prefix + [0] * (width - len(t)) + [1] * len(t) for t in tails])
            pos = torch.tensor(
                [[n_prefix] * (width - len(t)) + list(range(n_prefix, n_prefix + len(t))) for t in tails]
            )
            out: list[list[int]] = [[] for _ in range(n)]
            done = torch.zeros(n, dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids, cache=cache, attention_mask=att, position_ids=pos, use_cache=True).logits[
                    :, -1
                ]
                nxt = logits.argmax(-1)
                for i in range(n):
                    if not done[i]:
                        out[i].append(int(nxt[i]))
                done |= nxt == eos
                if bool(done.all()):
                    break
                ids, pos = nxt.unsqueeze(1), pos[:, -1:] + 1
                att = torch.cat([att, torch.ones(n, 1, dtype=torch.long)], dim=1)
            for row in out:
                if eos in row:
                    row = row[: row.index(eos)]
                replies.append(tok.decode(row, skip_special_tokens=True).strip())
    return replies


def build(out: Path = DEFAULT_OUT, threads: int = 2, **overrides) -> dict:
    """Train the world reader with ``DEFAULTS`` updated by ``overrides`` and save it to ``out``;
    returns the metadata written next to the weights. ``threads``: torch threads (not part of the
    recipe: it changes speed, not the data or the steps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from coordrl.data.tokenizer import save_tokenizer
    from coordrl.data.world import DECADES, make_world, world_splits
    from coordrl.data.world_reader import eval_examples, sample_chunk, score_replies
    from coordrl.software import software

    cfg = {**DEFAULTS, **overrides}
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown build option(s): {sorted(unknown)}")
    torch.set_num_threads(threads)
    t0 = time.time()
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    init = ROOT / cfg["init"]
    tok = AutoTokenizer.from_pretrained(str(init), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(init), use_safetensors=True, dtype=torch.float32, local_files_only=True
    )
    tmp.mkdir(parents=True)
    world = make_world(0)
    splits = world_splits(cfg["n_train"], cfg["n_heldout"], seed=0, docs_per_chunk=cfg["docs_per_chunk"])
    rng = random.Random(cfg["seed"])
    eos, pad_id = tok.eos_token_id, tok.pad_token_id

    # The instructions' ids are a prefix of every prompt (the passage starts right after them).
    prefix_len = shared_prefix_len(tok)
    prefix_ids = prompt_ids(tok, "a", "b")[:prefix_len]
    prefix = torch.tensor([prefix_ids])
    log(f"vocab {len(tok)}; shared instruction prefix {prefix_len} tokens ({time.time() - t0:.0f}s)")

    # The copied values (names, birth decades) are the few tokens of an answer that need reading; the
    # rest is template. The errors of an unweighted build (800 steps) were all wrong values.
    value_ids = {
        tok(f" {w}", add_special_tokens=False)["input_ids"][0] for w in [*world.names, *(f"{d}s" for d in DECADES)]
    }

    def pad(rows: list[list], value: float) -> torch.Tensor:
        w = max(map(len, rows))
        return torch.tensor([r + [value] * (w - len(r)) for r in rows])

    def batch() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """Passages (ids after the instructions, up to the question) of ``chunks`` chunks, and per
        chunk ``queries`` tails (question, generation prompt, answer) with their loss masks."""
        passages, tails, masks = [], [], []
        for _ in range(cfg["chunks"]):
            group = sample_chunk(
                rng, splits["train"], world, cfg["queries"], cfg["p_positive"], cfg["negative_mix"], cfg["p_contrast"]
            )
            prompts = [prompt_ids(tok, e.chunk, e.query) for e in group]
            # The passage ends where a prompt with another question starts to differ.
            other = prompt_ids(tok, group[0].chunk, "?")
            cut = min(next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), len(ids) - 1) for ids in prompts)
            if any(ids[:prefix_len] != prefix_ids for ids in prompts) or cut <= prefix_len:
                raise RuntimeError(f"prompt for {group[0].query!r} does not start with the instruction prefix")
            passages.append(prompts[0][prefix_len:cut])
            for e, ids in zip(group, prompts, strict=True):
                answer = tok(e.answer, add_special_tokens=False)["input_ids"] + [eos]
                tails.append(ids[cut:] + answer)
                masks.append(
                    [0.0] * (len(ids) - cut) + [cfg["value_weight"] if t in value_ids else 1.0 for t in answer]
                )
        return passages, tails, masks

    def loss_of(passages: list[list[int]], tails: list[list[int]], masks: list[list[int]]) -> torch.Tensor:
        # Three stages share keys/values: the instructions (once), each passage (once per chunk),
        # then every query's tail. Padding sits inside the cache, so an attention mask hides it.
        n, k = len(passages), len(tails) // len(passages)
        cache = DynamicCache()
        model(input_ids=prefix, cache=cache, use_cache=True)
        cache.batch_repeat_interleave(n)
        lengths = torch.tensor([len(p) for p in passages])
        p_ids = pad(passages, pad_id)
        p_att = (torch.arange(p_ids.size(1)).unsqueeze(0) < lengths.unsqueeze(1)).long()
        att = torch.cat([torch.ones(n, prefix_len, dtype=torch.long), p_att], dim=1)
        pos = prefix_len + torch.arange(p_ids.size(1)).unsqueeze(0).expand(n, -1)
        model(input_ids=p_ids, cache=cache, attention_mask=att, position_ids=pos, use_cache=True)
        cache.batch_repeat_interleave(k)
        t_ids, m = pad(tails, pad_id), pad(masks, 0)
        # Right padding of the tails: causal attention never lets a real token see a pad.
        att = torch.cat([att.repeat_interleave(k, dim=0), torch.ones(t_ids.shape, dtype=torch.long)], dim=1)
        pos = (prefix_len + lengths.repeat_interleave(k)).unsqueeze(1) + torch.arange(t_ids.size(1)).unsqueeze(0)
        hidden = model.model(
            input_ids=t_ids, cache=cache, attention_mask=att, position_ids=pos, use_cache=True
        ).last_hidden_state[:, :-1]
        # The output layer runs only where the loss is: the answer tokens.
        keep = m[:, 1:] > 0
        nll = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), t_ids[:, 1:][keep], reduction="none")
        # Normalised by the number of answer tokens, not their weights, so value_weight adds signal.
        return (nll * m[:, 1:][keep]).sum() / keep.sum()

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.98))
    steps, warmup = cfg["steps"], cfg["warmup"]
    history = []
    model.train()
    for step in range(steps):
        if step < warmup:
            scale = (step + 1) / warmup
        else:  # cosine from 1 down to min_lr_frac
            progress = (step - warmup) / max(1, steps - warmup)
            scale = cfg["min_lr_frac"] + (1 - cfg["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * scale
        loss = loss_of(*batch())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 25 == 0 or step < 3 or step + 1 == steps:
            history.append({"step": step + 1, "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)})
            log(f"step {step + 1}/{steps}: loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    train_s = time.time() - t0
    model.eval()
    examples = eval_examples(splits["heldout"][: cfg["n_eval_rows"]], world)
    figures = score_replies(examples, greedy_replies(model, tok, examples))
    log(f"held-out ({cfg['n_eval_rows']} questions, {len(examples)} prompts): {json.dumps(figures)}")
    model.generation_config.do_sample = False
    model.save_pretrained(str(tmp), safe_serialization=True)
    save_tokenizer(tok, tmp)
    meta = {
        "what": "coordrl world reader (scripts/build_world_reader.py)",
        "recipe": cfg,
        # Which warm start it grew from: the init folder's weights may be rebuilt later.
        "init_model_sha256": hashlib.sha256((init / "model.safetensors").read_bytes()).hexdigest(),
        "shape": {
            k: getattr(model.config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
            )
        },
        "prefix_tokens": prefix_len,
        "torch_threads": threads,
        "train_seconds": round(train_s, 1),
        "build_seconds": round(time.time() - t0, 1),
        "heldout": figures,
        "history": history,
        # Library versions, host and kernel level: a build repeats byte for byte only at one kernel level.
        "software": software(),
    }
    (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB) in {time.time() - t0:.0f}s")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help=f"training steps (default {DEFAULTS['steps']})")
    p.add_argument(
        "--chunks", type=int, default=DEFAULTS["chunks"], help=f"chunks per step (default {DEFAULTS['chunks']})"
    )
    p.add_argument(
        "--queries", type=int, default=DEFAULTS["queries"], help=f"queries per chunk (default {DEFAULTS['queries']})"
    )
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument(
        "--warmup", type=int, default=DEFAULTS["warmup"], help=f"warm-up steps (default {DEFAULTS['warmup']})"
    )
    p.add_argument(
        "--docs-per-chunk",
        type=int,
        default=DEFAULTS["docs_per_chunk"],
        help=f"whole world documents per reader chunk (default {DEFAULTS['docs_per_chunk']})",
    )
    p.add_argument(
        "--p-contrast",
        type=float,
        default=DEFAULTS["p_contrast"],
        help=f"share of chunks drawn among those with two facts of one relation (default {DEFAULTS['p_contrast']})",
    )
    p.add_argument(
        "--init",
        default=DEFAULTS["init"],
        help=f"model folder to fine-tune, relative to the repository (default {DEFAULTS['init']})",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    add_capability_flag(p, KEPT_CPU_CAPABILITY)
    p.add_argument(
        "--n-eval-rows", type=int, default=DEFAULTS["n_eval_rows"], help="held-out questions measured at the end"
    )
    a = p.parse_args(argv)
    if min(a.steps, a.chunks, a.queries, a.threads, a.docs_per_chunk, a.n_eval_rows) < 1:
        p.error("--steps, --chunks, --queries, --threads, --docs-per-chunk and --n-eval-rows must be positive")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if not 0.0 <= a.p_contrast <= 1.0:
        p.error(f"--p-contrast must be in [0, 1], got {a.p_contrast}")
    overrides = {
        k: v
        for k, v in {
            "seed": a.seed,
            "steps": a.steps,
            "chunks": a.chunks,
            "queries": a.queries,
            "lr": a.lr,
            "warmup": a.warmup,
            "docs_per_chunk": a.docs_per_chunk,
            "p_contrast": a.p_contrast,
            "init": a.init,
            "n_eval_rows": a.n_eval_rows,
        }.items()
        if v != DEFAULTS[k]
    }
    pin_cpu_capability(a.cpu_capability)
    build(Path(a.out), threads=a.threads, **overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
