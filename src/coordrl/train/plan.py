"""Resolve a `coordrl train` config into a GPU plan without touching a GPU.

``make_plan(cfg)`` answers, from the config alone, the questions a multi-GPU GRPO launch otherwise
answers by crashing twenty minutes in:

* **layout** -- which GPUs serve the frozen readers (``reader_gpus``, one vLLM server per GPU), which
  serve the policy in vLLM server mode (``policy_server_gpus``), and which run training processes
  (the rest, one process per GPU, each with a colocated vLLM when ``use_vllm`` + ``vllm_mode: colocate``);
* **batch** -- TRL 1.16's own arithmetic (``GRPOConfig.__post_init__``):
  ``generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation``
  (``steps_per_generation`` defaults to ``gradient_accumulation_steps``) must be divisible by
  ``num_generations`` (>= 2), and how many prompts that is per generation and per optimizer step;
* **token budget** -- ``max_completion_length`` is TRL's budget for *all* assistant turns *and* tool
  results of one rollout; see `Budget`;
* **memory** -- an estimate per training GPU; see `Memory` and `estimate_memory`;
* **reader round** -- the worst-case wall time of one tool round when readers hang or fail:
  ``reader_timeout_s x (reader_retries + 1) + backoff``; see `ReaderRound`.

Budget decision (documented, tested): the plan **refuses** a ``max_completion_length`` smaller than a
rollout that uses all ``max_turns`` rounds at the per-turn cap needs. TRL would not crash: it silently
drops the tool result that overflows and the rollout ends without an answer, reward 0. That penalises
exactly the deep multi-round search PARSER trains for, so it must be a choice: set
``allow_truncated_rollouts: true`` to turn the refusal into a warning (tiny CPU configs do).

Units: "GB" in this module is GiB (2**30 bytes), the unit ``nvidia-smi`` and PyTorch report.

The command is ``python -m coordrl.cli.plan CONFIG [--gpus-per-node 8] [--num-nodes 1]
[--gpu-memory-gb 80] [--num-processes N] [--field VALUE ...]`` prints the plan; exit status 2 when the
plan cannot work (the reason on stderr, the plan on stdout).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from coordrl.envs.prompts import LEAD_SYSTEM_PROMPT
from coordrl.envs.protocols import get_protocol
from coordrl.readers.openai_fleet import OpenAIReaderFleet
from coordrl.readers.retry import RetryPolicy
from coordrl.rollout.models import KEPT_MODELS, cache_dir, resolve_model
from coordrl.train.config import ConfigError, TrainConfig

__all__ = [
    "Batch",
    "Budget",
    "Layout",
    "Memory",
    "ModelShape",
    "Plan",
    "PlanError",
    "ReaderRound",
    "check_batch",
    "estimate_memory",
    "format_plan",
    "make_plan",
    "model_shape",
]

GIB = float(2**30)

# Tokens TRL's Qwen3 template adds around one round of tool results: "<|im_end|>\n<|im_start|>user\n
# <tool_response>\n" ... "\n</tool_response><|im_end|>\n<|im_start|>assistant\n" plus an empty think block
# that the training template may insert. Counted generously; the observation itself is capped by the env.
TOOL_WRAP_TOKENS = 24
# Prompt = system prompt + tool schema + question + template tokens. The system prompt is measured
# (characters / 3.5, a conservative rate for English BPE); the rest is a fixed allowance.
PROMPT_CHARS_PER_TOKEN = 3.5
PROMPT_FIXED_TOKENS = 256  # query_agents JSON schema (~150), question (~64), chat-template tokens (~40)
# Per training GPU, outside the model: CUDA context, NCCL communicators and buffers, cuBLAS workspace,
# allocator slack. A flat allowance; measured values on H100 are 1.5-3 GB.
FRAMEWORK_OVERHEAD_GB = 3.0
CPU_OVERHEAD_GB = 0.5
# Colocated vLLM: memory inside its share that is neither weights nor KV cache (activations for
# max_num_batched_tokens=4096, sampler, CUDA graphs).
VLLM_NON_KV_GB = 1.5
# vLLM in sleep mode (level 2) keeps only this much while the trainer runs the backward pass.
VLLM_SLEEP_RESIDUAL_GB = 1.0
# TRL's fused LM head (trl.kernels.chunked_logprob): tiles of TOKEN_CHUNK x VOCAB_CHUNK logits.
LOGPROB_TOKEN_CHUNK = 4096
LOGPROB_VOCAB_CHUNK = 32768

# Qwen3 dense shapes by size class, used when the model folder is not local (hub id + model_params).
# (upper bound on params, hidden, layers, intermediate, kv_heads, head_dim, tied embeddings, max positions)
_SIZE_CLASSES: tuple[tuple[float, int, int, int, int, int, bool, int], ...] = (
    (0.8e9, 1024, 28, 3072, 8, 128, True, 40960),  # Qwen3-0.6B
    (2.5e9, 2048, 28, 6144, 8, 128, True, 40960),  # Qwen3-1.7B
    (6.0e9, 2560, 36, 9728, 8, 128, True, 40960),  # Qwen3-4B
    (11.0e9, 4096, 36, 12288, 8, 128, False, 40960),  # Qwen3-8B (and 9B-class)
    (20.0e9, 5120, 40, 17408, 8, 128, False, 40960),  # Qwen3-14B
    (40.0e9, 5120, 64, 25600, 8, 128, False, 40960),  # Qwen3-32B
)
_DEFAULT_VOCAB = 151936  # Qwen2/Qwen3 tokenizer
TINY_MODEL = "coordrl:tiny-qwen3"  # `coordrl train`'s built-on-demand tiny model (see coordrl.train.run)


class PlanError(ValueError):
    """The plan cannot work; the message says why. ``plan`` holds the (partial) plan when there is one."""

    def __init__(self, message: str, plan: Plan | None = None) -> None:
        super().__init__(message)
        self.plan = plan


# ---------------------------------------------------------------------------------------------------------
# Model shape
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from the policy model.

    Attributes:
        params: total parameters (tied embeddings counted once).
        hidden, layers, intermediate, vocab: transformer shape.
        kv_heads, head_dim: attention shape, for vLLM's KV cache (bytes/token = 2 * layers * kv_heads *
            head_dim * 2).
        tied: input and output embeddings share one matrix.
        max_positions: ``max_position_embeddings`` (vLLM's default ``max_model_len``).
        source: where the numbers came from (``config.json`` path, or the size class used).
    """

    params: float
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    tied: bool
    max_positions: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for every layer: 2 * layers * kv_heads * head_dim * 2 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def params_per_layer(self) -> float:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return max(self.params - embed, 0.0) / max(self.layers, 1)


def _safetensors_params(folder: Path) -> int | None:
    """Exact parameter count from the safetensors files' headers; None when the folder has none.

    ``get_slice(...).get_shape()`` reads only the header, so no tensor data is loaded, whatever the model size.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())  # noqa: SIM118 (no __iter__)
    return total


def _shape_from_config(cfg: dict[str, Any], folder: Path, source: str) -> ModelShape:
    text = cfg.get("text_config") or cfg  # multimodal configs nest the language model
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads", max(hidden // 128, 1)))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    intermediate = int(text.get("intermediate_size") or 4 * hidden)
    vocab = int(text.get("vocab_size") or cfg.get("vocab_size") or _DEFAULT_VOCAB)
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    max_pos = int(text.get("max_position_embeddings") or 32768)
    params = _safetensors_params(folder)
    if params is None:
        # Llama/Qwen-style decoder without biases: attention q,k,v,o + SwiGLU MLP + norms per layer.
        per_layer = (
            hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * intermediate + 2 * hidden
        )
        params = vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
    return ModelShape(float(params), hidden, layers, intermediate, vocab, kv_heads, head_dim, tied, max_pos, source)


def _size_class(params: float, source: str) -> ModelShape:
    for bound, hidden, layers, inter, kv, hd, tied, max_pos in _SIZE_CLASSES:
        if params <= bound:
            return ModelShape(float(params), hidden, layers, inter, _DEFAULT_VOCAB, kv, hd, tied, max_pos, source)
    raise PlanError(
        f"model_params={params:.3g} is above the built-in size classes (<= 40e9); point model at a local "
        "folder with its config.json"
    )


def _hub_cached_config(model_id: str) -> Path | None:
    """config.json of a hub model already in the local Hugging Face cache (offline look-up only)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "config.json")
    except Exception:
        return None
    return Path(hit) if isinstance(hit, str) else None


def model_shape(model: str, model_params: float | None = None) -> ModelShape:
    """The policy's shape: a local folder's config.json (and safetensors headers; the kept warm starts'
    folders included), the local hub cache, else the Qwen3 size class of ``model_params``. Raises `PlanError` when none is available."""
    if model == TINY_MODEL:
        folder = cache_dir() / "models" / "tiny-qwen3-seed0"
        if (folder / "config.json").exists():
            model = str(folder)
        else:  # build_tiny_qwen3's defaults with the shipped 8192-token tokenizer
            cfg = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 64, "intermediate_size": 512, "vocab_size": 8192, "tie_word_embeddings": True,
                   "max_position_embeddings": 32768}  # fmt: skip
            return _shape_from_config(cfg, Path("/nonexistent"), f"{TINY_MODEL} (build_tiny_qwen3 defaults)")
    if model in KEPT_MODELS:  # the kept warm starts ship with the package
        model = resolve_model(model)
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        return _shape_from_config(cfg, folder, str(folder / "config.json"))
    cached = _hub_cached_config(model)
    if cached is not None:
        return _shape_from_config(json.loads(cached.read_text()), cached.parent, f"{cached} (hub cache)")
    if model_params is None:
        raise PlanError(
            f"model size unknown: {model!r} is not a local folder with config.json and model_params is not set "
            "(set model_params: 4.0e+9 for a 4B model)"
        )
    if model_params <= 0:
        raise PlanError(f"model_params must be positive, got {model_params}")
    cls = _size_class(model_params, "")
    return ModelShape(**{**cls.__dict__, "source": f"model_params={model_params:.3g}, Qwen3 size class "
                         f"(hidden {cls.hidden}, {cls.layers} layers, vocab {cls.vocab})"})  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Plan parts
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Who runs where (per node; every node is laid out the same way).

    Attributes:
        device: ``cuda`` or ``cpu`` (``use_cpu: true``).
        gpus_per_node, num_nodes: the hardware.
        reader_gpu_ids: GPUs (per node) for the reader servers, ``0..reader_gpus-1``.
        policy_server_gpu_ids: GPUs for TRL's vLLM policy server (server mode), after the readers.
        training_gpu_ids: GPUs (per node) running one training process each: the rest.
        num_processes: training processes over all nodes (the ZeRO / data-parallel world size).
        generation: ``vllm-colocate``, ``vllm-server`` or ``transformers``.
        vllm_tp: colocated vLLM tensor-parallel size.
        deepspeed_stage, offload: ZeRO stage (0 = plain DDP) and ZeRO offload.
    """

    device: str
    gpus_per_node: int
    num_nodes: int
    reader_gpu_ids: list[int]
    policy_server_gpu_ids: list[int]
    training_gpu_ids: list[int]
    num_processes: int
    generation: str
    vllm_tp: int
    deepspeed_stage: int
    offload: bool


@dataclass
class Batch:
    """TRL 1.16's batch arithmetic (shapes in completions = one rollout each).

    ``generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation``, one
    generation per ``steps_per_generation * num_iterations`` micro-steps; ``gradient_accumulation_steps``
    micro-steps make one optimizer step.
    """

    per_device_train_batch_size: int
    num_processes: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    generation_batch_size: int
    num_generations: int
    num_iterations: int
    prompts_per_generation: int
    completions_per_optimizer_step: int
    prompts_per_optimizer_step: float
    optimizer_steps_per_generation: float
    vllm_max_num_seqs: int | None
    eval_completions_per_batch: int | None
    max_steps: int


@dataclass
class Budget:
    """Tokens of one rollout.

    ``needed = (max_turns + 1) * per_turn + max_turns * (observation_tokens + TOOL_WRAP_TOKENS)``:
    ``max_turns`` tool rounds each cost one assistant turn and one tool result (at most
    ``observation_tokens``, the protocol's bound: PARSER's ``observation_max_tokens``, HMARS's broadcast
    result from its group size, pages per sub-agent and answer cap), and the answer needs one
    more assistant turn after the last result (TRL regenerates after every tool round). The training
    sequence is ``seq_len = prompt_tokens + max_completion_length`` (TRL pads to the longest in a micro-batch).
    """

    prompt_tokens: int
    per_turn_tokens: int
    per_turn_key: str | None
    max_turns: int
    observation_tokens: int
    tool_wrap_tokens: int
    needed: int
    max_completion_length: int
    seq_len: int
    full_rounds: int  # how many full rounds (with the answer turn) fit in max_completion_length
    max_model_len: int | None
    observation_rule: str = "observation_max_tokens"


@dataclass
class Memory:
    """Estimated peak memory per training GPU, in bytes, with the formula of every term.

    ``total = overhead + persistent + max(train_phase, generation_phase)`` where ``persistent`` is
    weights + gradients + optimizer state (+ reference model), ``train_phase`` is activations + LM head
    + ZeRO-3 gather buffers + what vLLM keeps during training, ``generation_phase`` is vLLM's share
    (colocate) or the HF-generate KV cache (no vLLM).
    """

    persistent: list[tuple[str, float, str]]
    train_phase: list[tuple[str, float, str]]
    generation_phase: list[tuple[str, float, str]]
    overhead: float
    total: float
    gpu_memory: float
    cpu_offload_per_process: float
    vllm_kv_tokens: int | None = None
    vllm_full_sequences: float | None = None

    @property
    def total_gb(self) -> float:
        return self.total / GIB

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory


@dataclass
class Plan:
    """A resolved plan. ``errors`` is empty for a plan `make_plan` returns with ``check=True``."""

    source: str
    model_name: str
    model: ModelShape
    layout: Layout
    batch: Batch
    budget: Budget
    memory: Memory
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reader_round: ReaderRound | None = None

    @property
    def fits(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class ReaderRound:
    """The worst case of one tool round's reader requests (all in flight together).

    A request that never answers costs ``timeout_s`` per attempt, ``retries + 1`` attempts, with
    `OpenAIReaderFleet`'s backoff before each retry (``backoff_s``, doubled each time):
    ``worst_case_s = timeout_s * (retries + 1) + backoff_s * (2**retries - 1)``. Requests past
    ``concurrency`` wait for a free slot, so a round with more requests than that can take a multiple.

    Attributes:
        kind: ``lexical`` (in-process, no network wait), ``http`` (reader servers) or ``hmars``
            (the HMARS selector/answerer backends, ``backend_timeout_s`` / ``backend_retries``).
    """

    kind: str
    timeout_s: float
    retries: int
    backoff_s: float
    concurrency: int
    names: tuple[str, str] = ("reader_timeout_s", "reader_retries")  # the settings that set timeout_s / retries

    @property
    def worst_case_s(self) -> float:
        if self.kind == "lexical":
            return 0.0
        # The clients' own arithmetic, so the plan cannot drift from what they do.
        return RetryPolicy(self.retries, self.backoff_s).worst_case_s(self.timeout_s)


def _fleet_backoff_s() -> float:
    """`OpenAIReaderFleet`'s default backoff (read from its signature, so the plan cannot drift from it)."""
    import inspect

    return float(inspect.signature(OpenAIReaderFleet).parameters["backoff_s"].default)


def reader_round(cfg: TrainConfig) -> ReaderRound:
    """The run's `ReaderRound` from ``reader_timeout_s`` / ``reader_retries`` (HMARS: its backend settings)."""
    c = cfg.coord
    protocol = get_protocol(c.protocol)
    env = cfg.env_config()
    timeout_s, retries = (getattr(env, name) for name in protocol.limit_fields)
    if protocol.uses_readers:
        kind, concurrency = ("lexical" if c.readers.strip() == "lexical" else "http"), c.reader_concurrency
    else:  # the frozen roles' endpoints
        kind, concurrency = protocol.name, int(getattr(env, "backend_concurrency", 64))
    return ReaderRound(kind, float(timeout_s), int(retries), _fleet_backoff_s(), concurrency, protocol.limit_fields)


# ---------------------------------------------------------------------------------------------------------
# Pieces of make_plan
# ---------------------------------------------------------------------------------------------------------


def _g(grpo: dict[str, Any], key: str) -> Any:
    """A GRPOConfig field: the config's value, else TRL's dataclass default."""
    if key in grpo:
        return grpo[key]
    return _grpo_defaults()[key]


_DEFAULTS_CACHE: dict[str, Any] = {}


def _grpo_defaults() -> dict[str, Any]:
    if not _DEFAULTS_CACHE:
        import dataclasses

        from trl import GRPOConfig

        for f in dataclasses.fields(GRPOConfig):
            if f.init and f.default is not dataclasses.MISSING:
                _DEFAULTS_CACHE[f.name] = f.default
            elif f.init and f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                _DEFAULTS_CACHE[f.name] = f.default_factory()  # type: ignore[misc]
    return _DEFAULTS_CACHE


def _layout(cfg: TrainConfig, num_processes: int | None, gpus_per_node: int, num_nodes: int,
            errors: list[str], warnings: list[str]) -> Layout:  # fmt: skip
    c, g = cfg.coord, cfg.grpo
    use_vllm = bool(_g(g, "use_vllm"))
    mode = str(_g(g, "vllm_mode"))
    generation = f"vllm-{mode}" if use_vllm else "transformers"
    tp = int(_g(g, "vllm_tensor_parallel_size")) if generation == "vllm-colocate" else 1
    stage = c.deepspeed_stage
    if stage not in (0, 2, 3):
        errors.append(f"deepspeed_stage must be 0, 2 or 3, got {stage}")
    if c.deepspeed_offload and stage == 0:
        errors.append("deepspeed_offload needs deepspeed_stage 2 or 3")
    if use_vllm and mode not in ("colocate", "server"):
        errors.append(f"vllm_mode must be 'colocate' or 'server', got {mode!r}")
    if bool(_g(g, "use_cpu")):
        if c.reader_gpus or c.policy_server_gpus:
            errors.append("use_cpu: true with reader_gpus/policy_server_gpus > 0")
        n = num_processes or 1
        return Layout("cpu", 0, num_nodes, [], [], [], n, generation, tp, stage, c.deepspeed_offload)
    if gpus_per_node < 1 or num_nodes < 1:
        raise PlanError(f"need gpus_per_node >= 1 and num_nodes >= 1, got {gpus_per_node} x {num_nodes}")
    readers = list(range(c.reader_gpus))
    server = list(range(c.reader_gpus, c.reader_gpus + c.policy_server_gpus)) if generation == "vllm-server" else []
    if generation == "vllm-server":
        if c.policy_server_gpus < 1:
            errors.append("vllm_mode: server needs policy_server_gpus >= 1 (GPUs for TRL's vLLM policy server)")
        if num_nodes > 1:
            errors.append("vllm_mode: server is planned for one node only; use vllm_mode: colocate across nodes")
    elif c.policy_server_gpus:
        warnings.append(f"policy_server_gpus={c.policy_server_gpus} is ignored: generation is {generation}")
    if c.reader_gpus < 0 or c.policy_server_gpus < 0:
        errors.append("reader_gpus and policy_server_gpus must be >= 0")
    free = list(range(len(readers) + len(server), gpus_per_node))
    if not free:
        raise PlanError(
            f"no training GPUs left: {gpus_per_node} GPUs per node, {len(readers)} for readers, "
            f"{len(server)} for the policy server"
        )
    available = len(free) * num_nodes
    if num_processes is None:
        num_processes = available
    if num_processes < 1 or num_processes > available:
        raise PlanError(f"num_processes={num_processes} but {available} training GPUs are free ({len(free)} per node)")
    if num_processes % num_nodes:
        raise PlanError(f"num_processes={num_processes} does not split evenly over {num_nodes} nodes")
    training = free[: num_processes // num_nodes]
    if generation == "vllm-colocate":
        if tp < 1 or num_processes % tp:
            errors.append(
                f"vllm_tensor_parallel_size ({tp}) must divide the number of training processes ({num_processes})"
            )
        elif len(training) % tp:
            errors.append(f"vllm_tensor_parallel_size ({tp}) must divide the training GPUs per node ({len(training)})")
    # In TRL, these modes run collectives inside every tool round, so ranks whose rollouts
    # need different numbers of rounds hang unless coordrl keeps them in lockstep.
    needs_lockstep = generation == "vllm-server" or tp > 1 or (stage == 3 and generation == "transformers")
    if needs_lockstep and not c.lockstep and num_processes > 1:
        warnings.append(f"lockstep: false with {generation} (tp={tp}, ZeRO-{stage}): ranks can hang in the tool loop")
    if c.reader_gpus and c.readers == "lexical":
        warnings.append("reader_gpus > 0 but readers: lexical (launch_grpo.sh passes the served URLs instead)")
    if c.reader_gpus and not c.reader_model:
        errors.append("reader_gpus > 0 needs reader_model (the model the reader servers load)")
    return Layout("cuda", gpus_per_node, num_nodes, readers, server, training, num_processes, generation, tp, stage,
                  c.deepspeed_offload)  # fmt: skip


def _batch(cfg: TrainConfig, layout: Layout, errors: list[str]) -> Batch:
    """Mirror of GRPOConfig.__post_init__ (TRL 1.16) with world_size = num_processes."""
    g = cfg.grpo
    b = int(_g(g, "per_device_train_batch_size"))
    n = layout.num_processes
    ga = int(_g(g, "gradient_accumulation_steps"))
    k = int(_g(g, "num_generations"))
    iters = int(_g(g, "num_iterations"))
    gbs, spg = _g(g, "generation_batch_size"), _g(g, "steps_per_generation")
    if gbs is None and spg is None:
        spg = ga
        gbs = b * n * spg
    elif gbs is not None and spg is None:
        if gbs % (b * n):
            errors.append(
                f"generation_batch_size ({gbs}) must be divisible by the global batch size ({b} * {n} = {b * n})"
            )
        spg = max(gbs // (b * n), 1)
    elif gbs is None:
        gbs = b * n * spg
    else:
        errors.append("generation_batch_size and steps_per_generation can not both be set")
        gbs = b * n * spg
    gbs, spg = int(gbs), int(spg)
    if k < 2:
        errors.append(f"num_generations must be >= 2 (GRPO's group advantage), got {k}")
    elif gbs % k:
        errors.append(
            f"generation_batch_size ({gbs} = per_device_train_batch_size {b} x {n} processes x steps_per_generation "
            f"{spg}) must be divisible by num_generations ({k}); e.g. make {b} x {spg} a multiple of "
            f"{k // math.gcd(k, n)}"
        )
    eval_per_batch = None
    if str(_g(g, "eval_strategy")) != "no":
        ke = _g(g, "num_generations_eval") or k
        eval_per_batch = int(_g(g, "per_device_eval_batch_size")) * n
        if eval_per_batch % ke:
            errors.append(
                f"the global eval batch size ({_g(g, 'per_device_eval_batch_size')} x {n} = {eval_per_batch}) must be "
                f"divisible by the generations used for evaluation ({ke})"
            )
    per_step = b * n * ga
    max_num_seqs = b * layout.vllm_tp * spg if layout.generation == "vllm-colocate" else None
    return Batch(
        per_device_train_batch_size=b, num_processes=n, gradient_accumulation_steps=ga, steps_per_generation=spg,
        generation_batch_size=gbs, num_generations=k, num_iterations=iters,
        prompts_per_generation=gbs // max(k, 1), completions_per_optimizer_step=per_step,
        prompts_per_optimizer_step=per_step / max(k, 1),
        optimizer_steps_per_generation=spg * iters / ga, vllm_max_num_seqs=max_num_seqs,
        eval_completions_per_batch=eval_per_batch, max_steps=int(_g(g, "max_steps")),
    )  # fmt: skip


def check_batch(cfg: TrainConfig, num_processes: int = 1) -> Batch:
    """TRL's batch arithmetic for ``num_processes`` training processes, checked before TRL checks it.

    Raises `coordrl.train.config.ConfigError` naming the fields to change (TRL's own error only says
    which numbers do not divide).
    """
    g = cfg.grpo
    use_vllm, mode = bool(_g(g, "use_vllm")), str(_g(g, "vllm_mode"))
    generation = f"vllm-{mode}" if use_vllm else "transformers"
    tp = int(_g(g, "vllm_tensor_parallel_size")) if generation == "vllm-colocate" else 1
    layout = Layout("cpu" if bool(_g(g, "use_cpu")) else "cuda", 0, 1, [], [], [], max(num_processes, 1), generation, tp,
                    cfg.coord.deepspeed_stage, cfg.coord.deepspeed_offload)  # fmt: skip
    errors: list[str] = []
    batch = _batch(cfg, layout, errors)
    if errors:
        raise ConfigError("; ".join(errors))
    return batch


def prompt_tokens_estimate(protocol: str = "parser", system_prompt: str | None = None) -> int:
    """Tokens of the rollout prompt: the system prompt (chars / 3.5; default coordrl's) + `PROMPT_FIXED_TOKENS`."""
    return math.ceil(len(system_prompt or LEAD_SYSTEM_PROMPT) / PROMPT_CHARS_PER_TOKEN) + PROMPT_FIXED_TOKENS


def _budget(cfg: TrainConfig, layout: Layout, shape: ModelShape, errors: list[str], warnings: list[str]) -> Budget:
    c, g = cfg.coord, cfg.grpo
    mcl = int(_g(g, "max_completion_length") or 0)
    if mcl < 1:
        errors.append("max_completion_length must be set (it is the budget for all turns and tool results)")
        mcl = 1
    gen_kwargs = dict(_g(g, "generation_kwargs") or {})
    # vLLM's SamplingParams calls the per-turn cap max_tokens; transformers' generate calls it max_new_tokens.
    # TRL passes generation_kwargs through unchanged, so the other backend's key is either rejected
    # (vLLM: unexpected keyword) or silently ignored (transformers): both are config errors.
    right, wrong = (
        ("max_tokens", "max_new_tokens") if layout.generation.startswith("vllm") else ("max_new_tokens", "max_tokens")
    )
    if wrong in gen_kwargs:
        errors.append(
            f"generation_kwargs.{wrong} does not apply to {layout.generation} generation; the per-turn cap is "
            f"generation_kwargs.{right}"
        )
    per_turn_key = right if right in gen_kwargs else None
    per_turn = int(gen_kwargs[right]) if per_turn_key else mcl  # TRL's own cap per turn is the whole budget
    prompt = prompt_tokens_estimate(c.protocol, c.system_prompt)
    protocol = get_protocol(c.protocol)
    obs = protocol.observation_bound(cfg.env_config())
    needed = (c.max_turns + 1) * per_turn + c.max_turns * (obs + TOOL_WRAP_TOKENS)
    round_cost = per_turn + obs + TOOL_WRAP_TOKENS
    full_rounds = max(min((mcl - per_turn) // round_cost, c.max_turns), 0) if mcl >= per_turn else 0
    if per_turn_key is None:
        msg = (f"no per-turn cap: set generation_kwargs.{right} (one long turn can use the whole "
               f"max_completion_length and keep the batch generating)")  # fmt: skip
        (warnings if c.allow_truncated_rollouts else errors).append(msg)
    elif mcl < needed:
        msg = (
            f"max_completion_length ({mcl}) is smaller than {c.max_turns} rounds need at the per-turn cap: "
            f"({c.max_turns}+1) x {per_turn} + {c.max_turns} x ({obs}+{TOOL_WRAP_TOKENS}) = {needed}; only "
            f"{full_rounds} full round(s) fit (raise it, lower the caps, or set allow_truncated_rollouts: true)"
        )
        (warnings if c.allow_truncated_rollouts else errors).append(msg)
    seq_len = prompt + mcl
    vllm_len = _g(g, "vllm_max_model_length") if layout.generation == "vllm-colocate" else None
    max_model_len = int(vllm_len) if vllm_len else shape.max_positions
    if seq_len > max_model_len:
        what = "vllm_max_model_length" if vllm_len else f"the model's max_position_embeddings ({shape.source})"
        msg = (f"prompt (~{prompt}) + max_completion_length ({mcl}) = {seq_len} exceeds {what} = {max_model_len}: "
               "the tool loop drops tool results at that length")  # fmt: skip
        (errors if vllm_len or shape.source.endswith("config.json") else warnings).append(msg)
    return Budget(prompt, per_turn, per_turn_key, c.max_turns, obs, TOOL_WRAP_TOKENS, needed, mcl, seq_len,
                  full_rounds, max_model_len, protocol.observation_rule)  # fmt: skip


def estimate_memory(cfg: TrainConfig, shape: ModelShape, layout: Layout, batch: Batch, budget: Budget,
                    gpu_memory_gb: float) -> Memory:  # fmt: skip
    """Peak bytes per training GPU. P = params, N = training processes, B = per_device_train_batch_size,
    S = budget.seq_len, C = max_completion_length, H/L/I/V = hidden/layers/intermediate/vocab.

    * weights ``w*P`` (w = 2 in bf16/fp16, else 4), gradients ``w*P``, AdamW ``12*P`` in half precision (fp32
      master + 2 moments) or ``8*P`` in fp32. ZeRO-2 divides gradients and optimizer by N, ZeRO-3 all three.
      Offload moves optimizer and gradient partitions to CPU (stage 2, 3) and weights too (stage 3).
    * reference model (only when ``beta != 0``): ``w*P``, divided by N under ZeRO-3.
    * ZeRO-3 gather buffers: ``w * (2 * P/L + V*H)`` -- the layer being computed plus the prefetched one,
      and the whole LM head, which TRL's fused log-prob head gathers at once.
    * activations, per layer ``A = 2*B*S*(8*H + 4*I)`` bytes (bf16 copies of ~8 hidden-sized tensors --
      norm inputs, q/k/v, attention output, residuals -- and 4 intermediate-sized SwiGLU tensors; flash/SDPA
      attention keeps no S x S matrix). With gradient checkpointing ``2*B*S*H*L`` (each layer's input)
      ``+ 2*A`` (the layer being recomputed and its gradients); without, ``L*A``.
    * LM head: TRL 1.16 never materialises ``B x S x V`` logits (``trl.kernels.chunked_logprob``): a
      ``4096 x 32768`` bf16 tile, the completion hidden states (``2*B*C*H``) and their fp32 gradient
      (``4*B*C*H``), and the fp32 LM-head gradient accumulator (``4*V*H``).
    * generation: colocated vLLM reserves ``vllm_gpu_memory_utilization * gpu_memory`` (kept during training
      unless ``vllm_enable_sleep_mode``); without vLLM, transformers' KV cache for ``B*steps_per_generation``
      sequences (plus the full gathered weights under ZeRO-3, ``ds3_gather_for_generation``).
    * overhead: `FRAMEWORK_OVERHEAD_GB` flat.
    """
    g = cfg.grpo
    P, N = shape.params, layout.num_processes
    H, L, I, V = shape.hidden, shape.layers, shape.intermediate, shape.vocab  # noqa: E741 (the docstring's symbols)
    B, S, C = batch.per_device_train_batch_size, budget.seq_len, budget.max_completion_length
    half = _g(g, "bf16") is not False or bool(_g(g, "fp16"))
    if layout.device == "cpu":
        half = bool(_g(g, "bf16")) or bool(_g(g, "fp16"))  # None resolves to False on CPU
    w = 2 if half else 4
    opt = 12 if half else 8
    stage, off = layout.deepspeed_stage, layout.offload
    per = lambda x, on: x / N if on else x  # noqa: E731 - partition x over N processes when `on`

    persistent: list[tuple[str, float, str]] = []
    cpu = 0.0
    wb = w * P
    if stage == 3 and off:
        persistent.append(("weights", 0.0, f"{w} B/param on CPU (ZeRO-3 offload)"))
        cpu += wb / N
    else:
        persistent.append(
            ("weights", per(wb, stage == 3), f"{w} B/param x P" + (" / N (ZeRO-3)" if stage == 3 else ""))
        )
    gb = w * P
    if stage >= 2 and off:
        persistent.append(("gradients", 0.0, "partition on CPU (offload)"))
        cpu += 4 * P / N  # DeepSpeed keeps the offloaded gradient partition in fp32
    else:
        persistent.append(
            ("gradients", per(gb, stage >= 2), f"{w} B/param x P" + (" / N (ZeRO-2/3)" if stage >= 2 else ""))
        )
    ob = opt * P
    if stage >= 2 and off:
        persistent.append(("optimizer (AdamW)", 0.0, f"{opt} B/param on CPU (offload)"))
        cpu += ob / N
    else:
        persistent.append(("optimizer (AdamW)", per(ob, stage >= 2),
                           f"{opt} B/param x P" + (" / N (ZeRO-2/3)" if stage >= 2 else "")))  # fmt: skip
    if float(_g(g, "beta")) != 0.0:
        ref = 0.0 if (stage == 3 and off) else per(wb, stage == 3)
        persistent.append(("reference model", ref, f"beta != 0: {w} B/param" + (" / N" if stage == 3 else "")))

    train: list[tuple[str, float, str]] = []
    layer_act = 2.0 * B * S * (8 * H + 4 * I)
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; the new name wins when set.
    ckpt = _g(g, "activation_checkpointing")
    if bool(_g(g, "gradient_checkpointing") if ckpt is None else ckpt):
        train.append(("activations (checkpointed)", 2.0 * B * S * H * L + 2 * layer_act,
                      f"2*B*S*H*L + 2*[2*B*S*(8H+4I)], B={B}, S={S}"))  # fmt: skip
    else:
        train.append(("activations (no checkpointing)", L * layer_act, f"L*2*B*S*(8H+4I), B={B}, S={S}"))
    tile = 2.0 * min(B * C, LOGPROB_TOKEN_CHUNK) * min(V, LOGPROB_VOCAB_CHUNK)
    train.append(("LM head (fused log-probs)", tile + 6.0 * B * C * H + 4.0 * V * H,
                  "2*4096*32768 tile + 6*B*C*H + 4*V*H (fp32 head grad)"))  # fmt: skip
    if stage == 3:
        train.append(("ZeRO-3 gather buffers", w * (2 * shape.params_per_layer + V * H), f"{w}*(2*P/L + V*H)"))

    gen: list[tuple[str, float, str]] = []
    gpu = gpu_memory_gb * GIB
    kv_tokens = full_seqs = None
    if layout.generation == "vllm-colocate":
        share = float(_g(g, "vllm_gpu_memory_utilization")) * gpu
        sleep = bool(_g(g, "vllm_enable_sleep_mode"))
        gen.append(("vLLM share (colocate)", share, f"vllm_gpu_memory_utilization x {gpu_memory_gb:g} GB"))
        if sleep:
            train.append(("vLLM asleep", VLLM_SLEEP_RESIDUAL_GB * GIB, "sleep mode level 2 residual"))
        else:
            train.append(("vLLM share (held)", share, "colocated vLLM keeps its share (no sleep mode)"))
        kv_bytes = share - 2.0 * P / layout.vllm_tp - VLLM_NON_KV_GB * GIB
        per_tok = shape.kv_bytes_per_token / layout.vllm_tp
        kv_tokens = int(max(kv_bytes, 0) // per_tok)
        full_seqs = kv_tokens / S
    elif layout.generation == "transformers":
        kv = float(shape.kv_bytes_per_token) * B * batch.steps_per_generation * S
        gen.append(
            (
                "KV cache (transformers generate)",
                kv,
                f"kv/token x B*steps_per_generation*S = {B * batch.steps_per_generation} seqs",
            )
        )
        if stage == 3 and bool(_g(g, "ds3_gather_for_generation")):
            gen.append(("gathered weights (ZeRO-3 generate)", wb - wb / N, f"{w}*P*(1-1/N)"))

    # On CPU there is no CUDA context or NCCL; keep a small allowance for the Python/torch runtime.
    overhead = (FRAMEWORK_OVERHEAD_GB if layout.device == "cuda" else CPU_OVERHEAD_GB) * GIB
    total = overhead + sum(x for _, x, _ in persistent) + max(sum(x for _, x, _ in train), sum(x for _, x, _ in gen))
    return Memory(persistent, train, gen, overhead, total, gpu, cpu, kv_tokens, full_seqs)


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------


def make_plan(
    cfg: TrainConfig,
    *,
    num_processes: int | None = None,
    gpus_per_node: int = 8,
    num_nodes: int = 1,
    gpu_memory_gb: float = 80.0,
    check: bool = True,
) -> Plan:
    """Resolve ``cfg`` into a `Plan` (no GPU needed).

    Args:
        cfg: a loaded config (`coordrl.train.config.load_config`).
        num_processes: training processes over all nodes (default: every GPU not given to readers or the
            policy server, on every node).
        gpus_per_node: GPUs per node (default 8); ``reader_gpus`` and ``policy_server_gpus`` are taken on
            every node, from GPU 0 up.
        num_nodes: nodes (default 1).
        gpu_memory_gb: memory per GPU in GiB (default 80).
        check: raise `PlanError` when the plan cannot work (default). With ``check=False`` the plan is
            returned with its reasons in ``plan.errors`` (layout errors that leave nothing to plan still raise).

    Raises:
        PlanError: indivisible batch, no training GPUs left, memory above ``gpu_memory_gb``, a completion
            budget too small for ``max_turns`` rounds, an unknown model size; ``err.plan`` holds the plan.
    """
    errors: list[str] = []
    warnings: list[str] = []
    c = cfg.coord
    shape = model_shape(c.model, c.model_params)
    layout = _layout(cfg, num_processes, gpus_per_node, num_nodes, errors, warnings)
    batch = _batch(cfg, layout, errors)
    budget = _budget(cfg, layout, shape, errors, warnings)
    memory = estimate_memory(cfg, shape, layout, batch, budget, gpu_memory_gb)
    if layout.device == "cuda":
        if not memory.fits:
            errors.append(
                f"memory: estimated {memory.total_gb:.1f} GB per training GPU > {gpu_memory_gb:g} GB (lower "
                "per_device_train_batch_size or max_completion_length, raise deepspeed_stage, set "
                "deepspeed_offload, or lower vllm_gpu_memory_utilization)"
            )
        if layout.generation == "vllm-colocate" and memory.vllm_full_sequences is not None:
            if memory.vllm_full_sequences < 1:
                errors.append(
                    f"memory: the colocated vLLM share ({float(_g(cfg.grpo, 'vllm_gpu_memory_utilization')):g} x "
                    f"{gpu_memory_gb:g} GB) cannot hold the policy weights ({2 * shape.params / layout.vllm_tp / GIB:.1f} GB) "
                    f"plus one full {budget.seq_len}-token sequence; raise vllm_gpu_memory_utilization"
                )
            elif batch.vllm_max_num_seqs and memory.vllm_full_sequences < batch.vllm_max_num_seqs:
                warnings.append(
                    f"vLLM KV cache holds {memory.vllm_full_sequences:.1f} full-length sequences per GPU, fewer than "
                    f"the {batch.vllm_max_num_seqs} it may run at once; vLLM queues the rest (rollouts rarely reach "
                    "the full budget)"
                )
    plan = Plan(cfg.source, c.model, shape, layout, batch, budget, memory, warnings, errors, reader_round(cfg))
    if check and errors:
        raise PlanError("; ".join(errors), plan)
    return plan


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gb(x: float) -> str:
    return f"{x / GIB:6.1f} GB"


def format_plan(plan: Plan) -> str:
    """A readable multi-section plan ending in ``fits: yes (xx.x GB of 80 GB per training GPU)``."""
    lay, b, bud, mem, m = plan.layout, plan.batch, plan.budget, plan.memory, plan.model
    out: list[str] = [f"coordrl training plan: {plan.source or '(no file)'}", ""]
    out += [
        "[model]",
        f"  policy        {plan.model_name}",
        f"  parameters    {_count(m.params)}  (hidden {m.hidden}, {m.layers} layers, intermediate {m.intermediate}, "
        f"vocab {m.vocab}, {'tied' if m.tied else 'untied'} embeddings)",
        f"  from          {m.source}",
        "",
        "[layout]",
    ]
    ids = lambda xs: ",".join(map(str, xs)) or "-"  # noqa: E731
    if lay.device == "cpu":
        out.append(f"  device        CPU, {lay.num_processes} process(es)")
    else:
        out += [
            f"  nodes         {lay.num_nodes} x {lay.gpus_per_node} GPUs",
            f"  readers       GPUs {ids(lay.reader_gpu_ids)} (one reader vLLM server per GPU, per node)",
        ]
        if lay.generation == "vllm-server":
            out.append(f"  policy server GPUs {ids(lay.policy_server_gpu_ids)} (TRL vLLM server)")
        out.append(f"  training      GPUs {ids(lay.training_gpu_ids)} per node -> {lay.num_processes} processes "
                   f"(CUDA_VISIBLE_DEVICES={ids(lay.training_gpu_ids)})")  # fmt: skip
    gen = {"vllm-colocate": f"vLLM colocated in every training process, tensor parallel {lay.vllm_tp}",
           "vllm-server": "TRL vLLM server (weights pushed over NCCL)",
           "transformers": "transformers generate inside the training processes"}[lay.generation]  # fmt: skip
    out += [
        f"  generation    {gen}",
        "  sharding      "
        + (f"DeepSpeed ZeRO-{lay.deepspeed_stage}" if lay.deepspeed_stage else "none (DDP)")
        + (" with CPU offload" if lay.offload else ""),
        "",
        "[batch]  (TRL 1.16 GRPOConfig arithmetic)",
        f"  generation_batch_size = per_device_train_batch_size x processes x steps_per_generation"
        f" = {b.per_device_train_batch_size} x {b.num_processes} x {b.steps_per_generation} = {b.generation_batch_size}",
        f"  num_generations       {b.num_generations}  -> {b.generation_batch_size} / {b.num_generations} = "
        f"{b.prompts_per_generation} prompts per generation"
        + (
            ""
            if b.num_generations and b.generation_batch_size % max(b.num_generations, 1) == 0
            else "  (NOT DIVISIBLE)"
        ),
        f"  optimizer step        {b.per_device_train_batch_size} x {b.num_processes} x {b.gradient_accumulation_steps} "
        f"(grad accumulation) = {b.completions_per_optimizer_step} completions = {b.prompts_per_optimizer_step:g} prompts",
        f"  per generation        {b.optimizer_steps_per_generation:g} optimizer step(s) (num_iterations {b.num_iterations})",
    ]
    if b.vllm_max_num_seqs:
        out.append(f"  vLLM max_num_seqs     {b.vllm_max_num_seqs} per GPU")
    if b.eval_completions_per_batch:
        out.append(f"  eval batch            {b.eval_completions_per_batch} completions")
    if b.max_steps > 0:
        out.append(f"  max_steps {b.max_steps} -> {b.max_steps * b.prompts_per_optimizer_step:,.0f} prompts")
    cap = f"generation_kwargs.{bud.per_turn_key}" if bud.per_turn_key else "no per-turn cap (= max_completion_length)"
    out += [
        "",
        "[token budget]  (per rollout; max_completion_length covers every turn and tool result)",
        f"  prompt (estimate)     ~{bud.prompt_tokens} tokens (system prompt, tool schema, question)",
        f"  per assistant turn    {bud.per_turn_tokens}  ({cap})",
        f"  per observation       {bud.observation_tokens} + {bud.tool_wrap_tokens} template  ({bud.observation_rule})",
        f"  needed for {bud.max_turns} rounds   ({bud.max_turns}+1) x {bud.per_turn_tokens} + {bud.max_turns} x "
        f"({bud.observation_tokens}+{bud.tool_wrap_tokens}) = {bud.needed}",
        f"  max_completion_length {bud.max_completion_length}  -> {bud.full_rounds} full round(s) fit"
        + ("" if bud.max_completion_length >= bud.needed else "  (TRUNCATES)"),
        f"  training sequence     {bud.seq_len} tokens (prompt + max_completion_length; max model len {bud.max_model_len})",
        "",
        "[memory per training GPU]" + ("  (host memory per process; GPU not checked)" if lay.device == "cpu" else ""),
    ]
    for title, rows in (("persistent", mem.persistent), ("training step", mem.train_phase),
                        ("generation", mem.generation_phase)):  # fmt: skip
        if not rows:
            continue
        out.append(f"  {title}: {_gb(sum(x for _, x, _ in rows)).strip()}")
        out += [f"    {name:<34} {_gb(x)}   {formula}" for name, x, formula in rows]
    what = "CUDA context, NCCL, allocator slack" if lay.device == "cuda" else "Python/torch runtime"
    out.append(f"  overhead                             {_gb(mem.overhead)}   {what}")
    out.append(f"  total = overhead + persistent + max(training step, generation) = {mem.total_gb:.1f} GB")
    if mem.vllm_kv_tokens is not None:
        out.append(f"  vLLM KV cache         {mem.vllm_kv_tokens:,} tokens = {mem.vllm_full_sequences:.1f} full-length "
                   "sequences per GPU")  # fmt: skip
    if mem.cpu_offload_per_process:
        out.append(f"  CPU offload           {mem.cpu_offload_per_process / GIB:.1f} GB host memory per process")
    rr = plan.reader_round
    if rr is not None:
        out += ["", "[reader round]  (worst case of one tool round when readers hang or fail)"]
        if rr.kind == "lexical":
            out.append("  readers       lexical (in process): no network timeouts")
        else:
            names = rr.names
            out += [
                f"  {names[0]:<17} {rr.timeout_s:g} s per attempt;  {names[1]} {rr.retries};  backoff {rr.backoff_s:g} s doubling",
                (
                    f"  worst case    {rr.timeout_s:g} x ({rr.retries}+1) + {rr.backoff_s:g} x (2^{rr.retries} - 1) = "
                    f"{rr.worst_case_s:.1f} s per round (up to {rr.concurrency} requests in flight)"
                ),
            ]
    if plan.warnings:
        out += ["", "[warnings]"] + [f"  - {w}" for w in plan.warnings]
    if plan.errors:
        out += ["", "[errors]"] + [f"  - {e}" for e in plan.errors]
    out.append("")
    if lay.device == "cpu":
        status = "yes" if plan.fits else "NO"
        out.append(f"fits: {status} (CPU run: {mem.total_gb:.1f} GB estimated per process; GPU memory not checked)")
    else:
        status = "yes" if plan.fits else "NO"
        out.append(f"fits: {status} ({mem.total_gb:.1f} GB of {mem.gpu_memory / GIB:g} GB per training GPU)")
    return "\n".join(out)
