"""The coordination protocols coordrl trains, one object each, registered by name.

A `Protocol` holds everything that differs between PARSER's lead agent and HMARS's mid-agent: the
environment's config class and factory, the system prompt and first user turn, the one tool the
policy calls, the names of its frozen roles' timeout settings, how evaluation caps tool rounds,
the metrics evaluation averages and tabulates, and the sentences export writes into the model
card. Training, evaluation, export and inference look the protocol up with `get_protocol` and ask
it, so adding a protocol is one registration here, not a branch in every layer above.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordrl.envs.hmars import ROLE_ERROR_KEYS, HmarsEnvConfig, HmarsEnvFactory, MidAgentEnv
from coordrl.envs.hmars_episode import observation_token_bound
from coordrl.envs.hmars_prompts import MID_AGENT_SYSTEM_PROMPT, hmars_prompt
from coordrl.envs.parser import ParserEnvConfig, ParserEnvFactory, lead_env_class
from coordrl.envs.prompts import LEAD_SYSTEM_PROMPT, lead_prompt

__all__ = ["EVAL_CHUNK_TOKENS", "EVAL_MAX_TURNS", "PROTOCOLS", "Protocol", "get_protocol", "register_protocol"]

# PARSER evaluates with larger reader chunks and more rounds than it trains with.
EVAL_MAX_TURNS = 12
EVAL_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class Protocol:
    """One coordination protocol.

    Args:
        name: registry key, the ``protocol`` value of configs and exported policies.
        title: what the policy is, for humans (model card heading, tables).
        tool: the one tool the policy calls.
        config_cls: the environment's settings dataclass.
        make_factory: ``(config, tokenizer, fleet) -> environment factory`` (TRL's ``environment_factory``).
        system_prompt: coordrl's system prompt for the protocol.
        make_prompt: ``(question, system_prompt) -> [system, user]``, the conversation an episode starts from.
        user_message_format: the first user turn, as the exported policy documents it.
        limit_fields: names of the ``(timeout, retries)`` settings of the protocol's frozen roles.
        env_owns_reward: True when the environment's ``get_reward`` is the reward (HMARS: the frozen
            answer model's exact match), False (default) when the policy's own ``<answer>`` is scored.
        answers_by_region: True when inference runs one policy episode per region and answers once
            from the merged evidence (HMARS), False (default) for one episode per question (PARSER).
        eval_turns_from_training: True when evaluation keeps training's tool-round cap (HMARS
            broadcasts once; more rounds only allow retries training never allowed); False (default)
            for PARSER's larger evaluation cap (`EVAL_MAX_TURNS`).
        eval_metrics: per-episode ``info`` keys evaluation averages beyond the common ones.
        role_error_metrics: per-episode ``info`` keys evaluation totals (frozen-role failures).
        table_columns: ``(metric key, header)`` of the per-length evaluation table, in order.
        summary_key: key of the exported policy's settings summary (``readers`` or ``hmars``).
        summary_fields: environment settings copied into that summary.
        card_about: the model card's description; ``{trained}`` and ``{answer_format}`` are filled in.
        card_settings: what the exported policy file records beyond the tools (model card).
        answer_flags: extra ``coordrl answer`` flags the model card's example needs.
        probe_arguments: tool arguments of the probe conversation export renders.
        probe_result: tool result of that probe conversation.
        answer_summary: the one-line ``coordrl answer`` summary; formatted with the answer's info.
        make_probe_env: ``config -> unbound environment`` (see `probe_env`).
        eval_settings: ``(readers, reader_model, max_turns, chunk_tokens, chunk_overlap_tokens, activation) ->
            config overrides`` for evaluation and inference; ValueError when one of them does not apply to the protocol.
        answer_kwargs: extra ``Coordinator.from_pretrained`` arguments the model card's example needs.
        card_section: ``(policy meta, policy file name) -> lines`` of the model card's protocol section.
        policy_extras: ``env -> entries`` the exported policy file records beyond the common ones.
        report_setup: ``(env, eval settings, failed-sample rule) -> (setup line, legend line)`` of
            ``results.md``.
        compare_metrics: metrics ``coordrl eval --compare`` adds to its process table.
        settings_block: True when the protocol's settings are a block named after it in the train
            config (``hmars:``) and ``--hmars key=value`` flags; False when they are top-level fields.
        observation_bound: ``config -> tokens``, the longest tool result the
            environment returns under ``config`` (the training plan budgets every tool round with it).
        observation_rule: where that bound comes from, in the plan's words.
    """

    name: str
    title: str
    tool: str
    config_cls: type
    make_factory: Callable[..., Any]
    system_prompt: str
    make_prompt: Callable[[str, str], list[dict[str, str]]]
    user_message_format: str
    limit_fields: tuple[str, str]
    env_owns_reward: bool = False
    answers_by_region: bool = False
    eval_turns_from_training: bool = False
    eval_metrics: tuple[str, ...] = ()
    role_error_metrics: tuple[str, ...] = ()
    table_columns: tuple[tuple[str, str], ...] = ()
    summary_key: str = ""
    summary_fields: tuple[str, ...] = ()
    card_about: str = ""
    card_settings: str = ""
    answer_flags: str = ""
    probe_arguments: Mapping[str, Any] = field(default_factory=dict)
    probe_result: str = ""
    answer_summary: str = ""
    make_probe_env: Callable[[Any], Any] | None = None
    eval_settings: Callable[..., dict[str, Any]] | None = None
    settings_block: bool = False
    answer_kwargs: str = ""
    card_section: Callable[[dict[str, Any], str], list[str]] = lambda meta, policy_file: []
    policy_extras: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda env: {}
    report_setup: Callable[[Mapping[str, Any], Mapping[str, Any], str], tuple[str, str]] | None = None
    compare_metrics: tuple[str, ...] = ()
    observation_bound: Callable[[Any], int] = lambda config: config.observation_max_tokens
    observation_rule: str = "observation_max_tokens"

    @property
    def uses_readers(self) -> bool:
        """True when the environment has chunk readers (``readers`` / ``reader_model`` settings)."""
        return any(f.name == "readers" for f in dataclasses.fields(self.config_cls))

    def prompt(self, question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
        """The ``[system, user]`` conversation an episode of ``question`` starts from."""
        return self.make_prompt(question, system_prompt or self.system_prompt)

    def config(self, settings: Mapping[str, Any] | None = None, **overrides: Any) -> Any:
        """The environment config from ``settings`` (unknown keys dropped: recorded metadata may
        hold fields of another coordrl version) with ``overrides`` applied (unknown ones refused)."""
        known = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown {self.name.upper()} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        values = {k: v for k, v in (settings or {}).items() if k in known}
        return self.config_cls(**{**values, **overrides})

    def factory(self, config: Any, *, tokenizer: Any = None, fleet: Any = None) -> Any:
        """The environment factory TRL, evaluation and inference create episodes from."""
        return self.make_factory(config, tokenizer, fleet)

    def probe_env(self, config: Any = None) -> Any:
        """An unbound environment of ``config`` (default: the default settings): enough to read its
        tool's name, signature and docstring, which can depend on the settings (PARSER's activation)."""
        assert self.make_probe_env is not None
        return self.make_probe_env(config if config is not None else self.config())

    def eval_max_turns(self, requested: int | None, train_max_turns: int | None) -> int:
        """Tool rounds for evaluation and inference: ``requested`` when given, else the protocol's rule."""
        if requested:
            return int(requested)
        if self.eval_turns_from_training:
            return int(train_max_turns or 1)
        return EVAL_MAX_TURNS


def _parser_eval_settings(
    readers: str | None,
    reader_model: str | None,
    max_turns: int | None,
    chunk_tokens: int | None,
    chunk_overlap_tokens: int | None = None,
    activation: str | None = None,
) -> dict[str, Any]:
    """PARSER evaluates with its own round cap and reader chunks (not training's); given readers
    replace the training ones. Chunks overlap, and queries wake readers, as in training unless
    ``chunk_overlap_tokens`` / ``activation`` is given."""
    out: dict[str, Any] = {"max_turns": max_turns or EVAL_MAX_TURNS, "chunk_tokens": chunk_tokens or EVAL_CHUNK_TOKENS}
    if chunk_overlap_tokens is not None:
        out["chunk_overlap_tokens"] = chunk_overlap_tokens
    if activation is not None:
        out["activation"] = activation
    if readers is not None:
        out.update(readers=readers, reader_model=reader_model)
    elif reader_model is not None:
        out["reader_model"] = reader_model
    return out


def _hmars_eval_settings(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """HMARS keeps its recorded regions, pages and frozen roles: of `_parser_eval_settings`'s
    arguments (taken in its order) only ``max_turns`` applies, and the PARSER settings given are
    refused by name, so that a flag such as ``--activation`` is never silently ignored."""
    given = inspect.signature(_parser_eval_settings).bind(*args, **kwargs).arguments
    wrong = [
        f"--{name.replace('_', '-')} ({name}={value!r})"
        for name, value in given.items()
        if name != "max_turns" and value is not None and not (name == "readers" and value == "lexical")
    ]
    if wrong:
        raise ValueError(
            f"{', '.join(wrong)}: PARSER reader setting(s), which an hmars policy does not use; set the frozen "
            "roles and regions through the HMARS settings instead (--hmars KEY=VALUE, e.g. selector=URL, c_sub=N)"
        )
    return {}


def _parser_card_section(meta: dict[str, Any], policy_file: str) -> list[str]:
    """The model card's protocol section of an exported PARSER policy (``meta``: its policy file)."""
    env = meta.get("env") or {}
    overlap = env.get("chunk_overlap_tokens") or 0
    return [
        ("Without `policy_url` the model runs in-process with transformers. Readers: `lexical` (model-free) or "
        "comma-separated URLs of OpenAI-compatible reader servers (`coordrl serve-readers`) with `reader_model`."),
        "",
        "## Protocol",
        "",
        (f"- tool: `query_agents(queries: list[str])`, at most {meta.get('max_queries')} queries per call; "
        f"observations truncated at {meta.get('observation_max_tokens')} tokens with a visible marker"),
        f"- user message: `{meta.get('user_message_format')}`; final answer: `{meta.get('answer_format')}`",
        f"- turn caps: {meta['turn_caps']['train_max_turns']} tool rounds in training, {meta['turn_caps']['eval_max_turns']} for evaluation",
        f"- reader chunks: {meta['chunk_tokens']['train']} tokens in training, {meta['chunk_tokens']['eval']} for evaluation",
        f"- chunk overlap: `chunk_overlap_tokens: {overlap}`; "
        + (f"consecutive chunks share {overlap} tokens" if overlap else "chunks tile the document"),
        f"- reader activation: `activation: {env.get('activation') or 'all'}`; {_activation(env)}",
        ("- `coordrl eval` and `coordrl answer` keep training's chunk overlap and activation unless "
        "`--chunk-overlap-tokens` / `--activation` replace them"),
        f"- training readers: `{env.get('readers')}`" + (f" (`{env.get('reader_model')}`)" if env.get("reader_model") else ""),
    ]  # fmt: skip


def _hmars_card_section(meta: dict[str, Any], policy_file: str) -> list[str]:
    """The model card's protocol section of an exported HMARS policy (``meta``: its policy file)."""
    h = meta.get("hmars") or {}

    def role(name: str) -> str:
        return f"`{h.get(name)}`" + (f" (`{h.get(name + '_model')}`)" if h.get(name + "_model") else "")

    return [
        ("Without `policy_url` the model runs in-process with transformers. The frozen roles (card writer, page "
        f"selector, answer model) and the region sizes come from `{policy_file}`; `Coordinator.from_pretrained(..., "
        "hmars={...})` (or `--hmars KEY=VALUE`) overrides them, e.g. `selector=http://host:8001/v1`."),
        "",
        "## Protocol",
        "",
        "- tool: `broadcast(interpretation: str, hints: dict[str, str])`, once per region",
        f"- user message: `{meta.get('user_message_format')}`",
        (f"- regions: sub-agents of {h.get('c_sub')} tokens, pages of {h.get('page_tokens')} tokens, {h.get('group_size')} "
        "sub-agents per mid-agent; a document of K mid-agent regions runs the policy K times concurrently and is answered once"),
        f"- mode: `{h.get('mode')}`; at most {h.get('pages_per_subagent')} pages per sub-agent",
        ("- observation: the region's memory ("
        + ("summary, sub-agent map, cross-references)" if h.get("memory_map", True) else "header only, `memory_map: false`)")
        + (", with each sub-agent's card summary (`memory_card_summaries: true`)" if h.get("memory_card_summaries") else "")
        + (", with each Document title's sub-agent (`memory_title_index: true`)" if h.get("memory_title_index") else "")
        + (", then the question again (`question_after_memory: true`)" if h.get("question_after_memory") else "")),
        *(["- lexical selector: each sentence of the question, interpretation and hint scored alone "
        "(`lexical_query_sentences: true`)"] if h.get("lexical_query_sentences") else []),
        f"- training roles: writer {role('writer')}, selector {role('selector')}, answerer {role('answerer')}",
        f"- turn cap: {meta['turn_caps']['train_max_turns']} tool round(s) per region",
    ]  # fmt: skip


def _sampling(s: Mapping[str, Any]) -> str:
    """The policy's generation settings of an evaluation, as ``results.md`` prints them."""
    return f"{s['max_new_tokens']} tokens per policy turn, temperature {s['temperature']}, seed {s['seed']}" + (
        f", at most {s['limit']} samples per subset" if s.get("limit") else ""
    )


def _activation(env: Mapping[str, Any]) -> str:
    """Which readers a PARSER query wakes under the settings ``env``, in words."""
    if env.get("activation") == "routed":
        ks = [
            f"{p} top-{env.get(f'route_{p}_top_k')}"
            for p in ("bm25", "summary", "dense")
            if env.get(f"route_{p}_top_k")
        ]
        return f"routed activation ({', '.join(ks)})"
    return "every query to every reader"


def _parser_report_setup(env: Mapping[str, Any], s: Mapping[str, Any], failed_rule: str) -> tuple[str, str]:
    activation = _activation(env)
    overlap = env.get("chunk_overlap_tokens") or 0
    chunks = f"reader chunks {s['chunk_tokens']} tokens" + (f" overlapping by {overlap}" if overlap else "")
    setup = f"- max turns {s['max_turns']}, {chunks}, {activation}, {_sampling(s)}"
    legend = (
        f"- failed requests: {failed_rule}; accuracy in %, sub_em is the reference's (leaky) metric, guarded sub_em scores "
        "empty answers 0; lead prompt tokens = prompt tokens the policy read over all its turns; latency per sample; "
        "activated/query = readers one query woke; normalised cost = lead tokens (read and written, every turn) + "
        f"{env.get('reader_cost_weight', 0.1)} x reader prompt tokens; gold activation recall = share of chunks holding "
        "a gold Document that some query woke"
    )
    return setup, legend


def _hmars_report_setup(env: Mapping[str, Any], s: Mapping[str, Any], failed_rule: str) -> tuple[str, str]:
    setup = (
        f"- HMARS mid-agent: sub-agents of {env.get('c_sub')} tokens, pages of {env.get('page_tokens')} tokens, "
        f"{env.get('group_size')} sub-agents per mid-agent, mode {env.get('mode')}"
        + ("" if env.get("memory_map", True) else ", no sub-agent map in the memory")
        + (", card summaries in the memory" if env.get("memory_card_summaries") else "")
        + (", title index in the memory" if env.get("memory_title_index") else "")
        + (", the question after the memory" if env.get("question_after_memory") else "")
        + f"; selector `{env.get('selector')}`"
        + (" (query sentences scored alone)" if env.get("lexical_query_sentences") else "")
        + ", "
        f"answerer `{env.get('answerer')}`; at most {s['max_turns']} tool round(s) per region, {_sampling(s)}"
    )
    legend = (
        f"- failed requests: {failed_rule}; accuracy in % of the answer model's answer from the merged evidence; "
        "evidence recall = share of gold Documents covered by the selected pages; model calls = frozen selector and "
        "answer calls per question; policy prompt tokens = prompt tokens the mid-agent policy read over all regions"
    )
    return setup, legend


def _parser_policy_extras(env: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "chunk_tokens": {"train": env.get("chunk_tokens"), "eval": EVAL_CHUNK_TOKENS},
        "observation_max_tokens": env.get("observation_max_tokens"),
        "max_queries": env.get("max_queries"),
    }


# (metric key, header) of the per-length evaluation table: both protocols open with the sample
# count and the answer scores; HMARS then shows its evidence metrics and frozen-role failures
# instead of PARSER's reader columns.
_SCORE_COLUMNS = (
    ("samples", "n"),
    ("sub_em", "sub_em"),
    ("guarded_sub_em", "guarded sub_em"),
    ("em", "EM"),
    ("f1", "F1"),
    ("answered", "answered"),
)
_PARSER_COLUMNS = (
    *_SCORE_COLUMNS,
    ("turns", "turns"),
    ("queries_per_turn", "queries/turn"),
    ("reader_calls", "reader calls"),
    ("activated_chunks_per_query", "activated/query"),
    ("lead_prompt_tokens", "lead prompt tokens"),
    ("reader_prompt_tokens", "reader prompt tokens"),
    ("normalised_cost", "normalised cost"),
    ("latency_p50_s", "latency p50 (s)"),
    ("latency_p95_s", "latency p95 (s)"),
    ("gold_coverage", "gold coverage"),
    ("gold_activation_recall", "gold activation recall"),
    ("reader_errors", "reader errors"),
    ("failed", "failed"),
)
_PARSER_SUMMARY = (
    "readers", "reader_model", "reader_max_tokens", "lexical_threshold", "reader_timeout_s", "reader_retries",
)  # fmt: skip
_HMARS_COLUMNS = (
    *_SCORE_COLUMNS,
    ("recall", "evidence recall"),
    ("pages_selected", "pages selected"),
    ("answer_prompt_tokens", "answer prompt tokens"),
    ("model_calls", "model calls"),
    ("regions", "regions"),
    ("lead_prompt_tokens", "policy prompt tokens"),
    ("latency_p50_s", "latency p50 (s)"),
    ("latency_p95_s", "latency p95 (s)"),
    ("selector_errors", "selector errors"),
    ("selector_parse_failures", "selector unparsed"),
    ("answerer_errors", "answerer errors"),
    ("answerer_parse_failures", "answerer unparsed"),
    ("failed", "failed"),
)
_HMARS_SUMMARY = (
    "c_sub", "page_tokens", "group_size", "mode", "pages_per_subagent", "memory_map", "memory_card_summaries", "memory_title_index",
    "lexical_query_sentences", "question_after_memory", "writer", "writer_model", "selector", "selector_model", "answerer", "answerer_model", "recall_weight",
    "evidence_budget_tokens", "budget_weight",
)  # fmt: skip

PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(protocol: Protocol) -> Protocol:
    """Add ``protocol`` to the registry (its name must be new)."""
    if protocol.name in PROTOCOLS:
        raise ValueError(f"protocol {protocol.name!r} is already registered")
    PROTOCOLS[protocol.name] = protocol
    return protocol


def get_protocol(name: Any) -> Protocol:
    """The registered protocol ``name``; ValueError listing the known ones otherwise."""
    try:
        return PROTOCOLS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown protocol {name!r}; coordrl knows {', '.join(PROTOCOLS)}") from None


register_protocol(
    Protocol(
        name="parser",
        title="PARSER lead-agent",
        tool="query_agents",
        config_cls=ParserEnvConfig,
        make_factory=lambda config, tokenizer, fleet: ParserEnvFactory(config, fleet=fleet, tokenizer=tokenizer),
        system_prompt=LEAD_SYSTEM_PROMPT,
        make_prompt=lead_prompt,
        user_message_format="Question: {question}",
        limit_fields=("reader_timeout_s", "reader_retries"),
        eval_metrics=(
            "activated_chunks_per_query",
            "reader_prompt_tokens",
            "normalised_cost",
            "gold_activation_recall",
        ),
        table_columns=_PARSER_COLUMNS,
        summary_key="readers",
        summary_fields=_PARSER_SUMMARY,
        card_about=(
            "{trained}. It never reads the document: it calls the `query_agents` tool, which sends its questions to "
            "frozen reader models (one per document chunk; the reader activation below says which of them a question "
            "wakes), gathers their findings over several rounds, and answers in `{answer_format}`."
        ),
        card_settings="reader settings",
        answer_flags=" --readers lexical",
        probe_arguments={"queries": ["Who wrote it?"]},
        probe_result="1 finding(s) from 2 readers for 1 query(ies).",
        answer_summary=(
            "[{turns} round(s), {reader_calls} reader calls, {findings} finding(s), {chunks} chunks, {seconds:.1f} s]"
        ),
        make_probe_env=lambda config: lead_env_class(config)(config, fleet=None, tokenizer=None),  # type: ignore[arg-type]
        eval_settings=_parser_eval_settings,
        answer_kwargs='readers="lexical", ',
        card_section=_parser_card_section,
        policy_extras=_parser_policy_extras,
        report_setup=_parser_report_setup,
    )
)

register_protocol(
    Protocol(
        name="hmars",
        title="HMARS mid-agent",
        tool="broadcast",
        config_cls=HmarsEnvConfig,
        make_factory=lambda config, tokenizer, fleet: HmarsEnvFactory(config, tokenizer=tokenizer),
        system_prompt=MID_AGENT_SYSTEM_PROMPT,
        make_prompt=hmars_prompt,
        # reset() returns the regional memory, which is appended to the user message.
        user_message_format="Question: {question}\n\n{regional memory}",
        limit_fields=("backend_timeout_s", "backend_retries"),
        observation_bound=observation_token_bound,
        observation_rule="group_size x pages_per_subagent page lines + answerer_max_tokens",
        env_owns_reward=True,
        answers_by_region=True,
        eval_turns_from_training=True,
        eval_metrics=("recall", "pages_selected", "evidence_tokens", "answer_prompt_tokens", "model_calls", "regions"),
        role_error_metrics=ROLE_ERROR_KEYS,
        table_columns=_HMARS_COLUMNS,
        summary_key="hmars",
        summary_fields=_HMARS_SUMMARY,
        card_about=(
            "{trained}. It is an HMARS mid-agent: it never reads the document. For each mid-agent region it sees the "
            "question and the region's memory (summary, sub-agent map, cross-references) and calls `broadcast` once with "
            "an interpretation and a hint per sub-agent; frozen selectors pick evidence pages and a frozen answer model "
            "answers from the merged pages of all regions."
        ),
        card_settings="HMARS region, page and frozen-role settings",
        answer_flags="",
        probe_arguments={"interpretation": "The novel's author.", "hints": {"s0": "author of the novel"}},
        probe_result="1 of 1 sub-agents selected pages (mode full).\n- s0: page 0 (Documents 1)",
        answer_summary=(
            "[{regions} region(s), {pages_selected} page(s) selected, {answer_prompt_tokens} answer-prompt tokens, "
            "{model_calls} model calls, {seconds:.1f} s]"
        ),
        make_probe_env=lambda config: MidAgentEnv(config, backends=None, tokenizer=None, index_cache=None),  # type: ignore[arg-type]
        eval_settings=_hmars_eval_settings,
        card_section=_hmars_card_section,
        report_setup=_hmars_report_setup,
        compare_metrics=("recall", "pages_selected", "answer_prompt_tokens", "model_calls"),
        settings_block=True,
    )
)
