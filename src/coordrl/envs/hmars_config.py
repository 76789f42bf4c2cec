"""Settings of the HMARS mid-agent environment: regions, pages, frozen roles, limits, reward terms."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from coordrl.data.errors import DataError
from coordrl.envs.hmars_index import IndexSettings
from coordrl.readers.chat_client import DEFAULT_API_KEY_ENV, DEFAULT_CONCURRENCY
from coordrl.readers.retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S

__all__ = ["MODES", "ROLE_ERROR_KEYS", "HmarsEnvConfig"]

MODES = ("full", "dispatch", "no_mid")
# Failures of the frozen model roles, counted per role: the endpoint failed after its retries
# (HTTP error, timeout, empty or non-JSON body), or its reply could not be parsed.
ROLE_ERROR_KEYS = ("selector_errors", "selector_parse_failures", "answerer_errors", "answerer_parse_failures")
# The boolean settings; a YAML or --hmars string "false" must not turn one on.
SWITCHES = (
    "memory_map",
    "memory_card_summaries",
    "memory_title_index",
    "lexical_query_sentences",
    "question_after_memory",
    "answer_chain",
)
_SUB_ID = re.compile(r"^\s*(?:s|sub[-_ ]?agent[-_ ]?)?(\d{1,6})\s*$", re.IGNORECASE)


@dataclass
class HmarsEnvConfig:
    """Settings of the HMARS mid-agent environment (recorded in checkpoints and exports).

    Attributes:
        c_sub: tokens per sub-agent region (paper: 16,384; default 16,384).
        page_tokens: tokens per page (default 1,024).
        group_size: sub-agents per mid-agent, G (default 10).
        writer / selector / answerer: ``lexical`` (model-free, deterministic) or comma-separated
            OpenAI-compatible URLs, one backend per role; the answerer may also be ``rule``, the HMARS
            world's model-free reader of the selected pages (`coordrl.envs.hmars_roles.RuleAnswerer`).
        writer_model / selector_model / answerer_model: model names served at those URLs.
        answer_chain: the answerer URLs serve a chunk reader (the world reader model,
            ``coordrl/resources/world_reader``), not an answer model: the answer role asks it each hop
            of a world question about each whole document of the selected pages, one document per
            request in the reader prompt it was trained on, and follows the chain through its replies
            (`coordrl.envs.hmars_roles.ReaderChainAnswerer`; default False).
        writer_api_key_env / selector_api_key_env / answerer_api_key_env: environment variables read
            for each role's API key (default OPENAI_API_KEY; unset sends none).
        writer_max_tokens / selector_max_tokens / answerer_max_tokens: generation budgets
            (defaults 512, 256, 128).
        writer_input_chars: region characters shown to a card writer (default 48,000).
        selector_page_chars: characters of each page shown to a model selector (default 6,000: a
            whole 1,024-token page).
        backend_concurrency / backend_timeout_s / backend_retries: per-role request limits
            (defaults 64, 60 s, 3 retries).
        max_interpretation_chars: longest accepted interpretation (default 1,000).
        max_hint_chars: longest accepted hint (default 500).
        pages_per_subagent: pages one sub-agent may select (default 2).
        lexical_select_threshold: lexical page score needed to be selected (default 0.4).
        memory_map: show the mid-agent the regional memory's summary line, sub-agent map (each
            sub-agent's topics and entities) and cross-references (default True). Off, with
            ``memory_card_summaries`` on (required), the observation is the header and the card
            summaries, which name each sub-agent's Documents and state their facts: half the tokens
            on the HMARS world (747 -> 361 with the world tokenizer), so half the prompt to forward
            at every training and generation step.
        memory_card_summaries: also show the mid-agent each sub-agent's card summary, one line per
            sub-agent under the regional memory's sub-agent map (default False: the observation is
            the regional memory alone, as before the setting existed; turning it on lengthens every
            mid-agent prompt by up to 600 characters (about 200 tokens) per sub-agent,
            `coordrl.envs.hmars_index.MEMORY_SUMMARY_CHARS`).
        memory_title_index: also show the mid-agent a last line listing each Document title of its
            region with the sub-agent holding that Document (``Document titles by sub-agent: Lavar
            s0; Runi s0; ...``; default False). Entity lists name a person wherever he is mentioned;
            this line says which sub-agent holds his own Document, the one a hint about him must go
            to. About five tokens per Document.
        lexical_query_sentences: the lexical selector scores each sentence of the question, the
            interpretation and the hint as its own query part (default False: each part whole). An
            interpretation that asks two questions then selects each question's page, as a retriever
            that runs one query per sub-question would; whole, two questions dilute each other.
        question_after_memory: end the mid-agent's observation with the question again
            (``Question: <question>`` after the memory; default False). The question opens the user
            message, hundreds of tokens before the broadcast the policy writes; a small policy copies
            names more reliably from text right before it (on the HMARS world, comparison questions
            where both compared names must reach the hints: 14% -> 44% sampled exact match after the
            same SFT). About as many tokens as the question.
        mode: ``full`` (every sub-agent selects, default), ``dispatch`` (only hinted sub-agents
            select) or ``no_mid`` (every sub-agent selects from the question alone).
        recall_weight: weight of supporting-page recall in the reward (default 0).
        evidence_budget_tokens / budget_weight: evidence tokens above the budget cost
            ``budget_weight * excess / budget`` (default 0: off).
        tokenizer: tokenizer for pages and token counts (None: coordrl's shipped one; use the policy's).
        index_cache: folder of cached indexes (``coordrl index`` writes it); None: memory only.
    """

    # What the index depends on (`index_settings`) defaults as `IndexSettings` does: declared there once.
    c_sub: int = IndexSettings.c_sub
    page_tokens: int = IndexSettings.page_tokens
    group_size: int = IndexSettings.group_size
    writer: str = IndexSettings.writer
    writer_model: str | None = IndexSettings.writer_model
    writer_api_key_env: str | None = IndexSettings.writer_api_key_env
    writer_max_tokens: int = IndexSettings.writer_max_tokens
    writer_input_chars: int = IndexSettings.writer_input_chars
    selector: str = "lexical"
    selector_model: str | None = None
    selector_api_key_env: str | None = DEFAULT_API_KEY_ENV
    selector_max_tokens: int = 256
    selector_page_chars: int = 6000
    answerer: str = "lexical"
    answerer_model: str | None = None
    answerer_api_key_env: str | None = DEFAULT_API_KEY_ENV
    answerer_max_tokens: int = 128
    answer_chain: bool = False
    backend_concurrency: int = DEFAULT_CONCURRENCY
    backend_timeout_s: float = DEFAULT_TIMEOUT_S
    backend_retries: int = DEFAULT_RETRIES
    max_interpretation_chars: int = 1000
    max_hint_chars: int = 500
    pages_per_subagent: int = 2
    lexical_select_threshold: float = 0.4
    memory_map: bool = True
    memory_card_summaries: bool = False
    memory_title_index: bool = False
    lexical_query_sentences: bool = False
    question_after_memory: bool = False
    mode: str = "full"
    recall_weight: float = 0.0
    evidence_budget_tokens: int = 0
    budget_weight: float = 0.0
    tokenizer: str | None = IndexSettings.tokenizer
    index_cache: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DataError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.pages_per_subagent < 1:
            raise DataError(f"pages_per_subagent must be positive, got {self.pages_per_subagent}")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise DataError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.memory_map and not self.memory_card_summaries:
            raise DataError("memory_map false needs memory_card_summaries true: the mid-agent would see no memory")
        if self.answer_chain and self.answerer.strip() in ("lexical", "rule"):
            raise DataError(
                f"answer_chain needs the answerer to be the URL of a served chunk reader, got answerer {self.answerer!r}"
            )

    def index_settings(self) -> IndexSettings:
        """The index part of these settings: every `IndexSettings` field this config also has (the
        rest, e.g. lexical card sizes, keep their defaults)."""
        return IndexSettings.of(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
