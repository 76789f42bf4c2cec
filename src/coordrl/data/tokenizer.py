"""A small Qwen3-style tokenizer, built fully offline (the tiny model on top of it: `coordrl.rollout.tiny_qwen3`).

Why this exists
---------------
coordrl trains a tool-calling coordinator policy with TRL's ``GRPOTrainer``. Tests, CI and the demo must run
without a model hub, so this module provides:

* :func:`train_tokenizer` -- a byte-level BPE tokenizer trained with the ``tokenizers`` library that behaves like
  Qwen3's tokenizer where it matters to TRL: the same pre-tokenisation regex (each word keeps its leading
  space), the Qwen3 special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and the atomic
  tool/thinking markers (``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``,
  ``<think>``, ``</think>``), ``eos_token = <|im_end|>``, ``pad_token = <|endoftext|>``, and TRL's Qwen3 chat
  template, string-identical, so that ``trl.chat_template_utils.add_response_schema`` and
  ``get_training_chat_template`` recognise it (TRL identifies templates by exact string equality).
  Unlike the real Qwen3 tokenizer it has no NFC normaliser, so ``decode(encode(text)) == text`` holds exactly
  for every string (rewards compare decoded completions with the text the policy produced).
* :func:`build_tiny_qwen3` -- a random-init ``Qwen3ForCausalLM`` (default 4 layers, hidden size 256,
  head_dim 64 because vLLM's CPU attention backend rejects very small head sizes) saved as safetensors together
  with the tokenizer and a generation config, byte-identical for the same seed.
* :func:`load_shipped_tokenizer` -- the tokenizer shipped in ``coordrl/resources/tokenizer/``.

The shipped tokenizer
---------------------
``coordrl/resources/tokenizer/`` was produced once by :func:`build_shipped_tokenizer` (vocabulary 8192 = 8183
BPE tokens + 9 added tokens, ``min_frequency=2``) and is committed to the repository. Its training text is
:func:`shipped_training_texts`: every title, paragraph, question and answer of the gzipped multi-hop QA samples in
``coordrl/resources/data/`` (HotpotQA and 2WikiMultiHopQA JSON ``context`` paragraphs, ``paragraph_pool.jsonl.gz``
paragraphs) plus synthetic Qwen3 tool-calling text (tool schemas, ``<tool_call>`` JSON, ``<tool_response>``
blocks) so that tool calls tokenize compactly. The texts are deduplicated and sorted before training and all
trainer parameters are fixed, so rerunning :func:`build_shipped_tokenizer` reproduces the same ``tokenizer.json``
byte for byte.

coordrl uses this tokenizer as its default offline tokenizer (for token counts when the user gives no tokenizer)
and the tiny test/demo model is built on top of it.
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.resources.abc
import json
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = [
    "ADDED_TOKENS",
    "SPECIAL_TOKENS",
    "build_shipped_tokenizer",
    "load_shipped_tokenizer",
    "save_tokenizer",
    "shipped_training_texts",
    "train_tokenizer",
]

# Qwen2/Qwen3's pre-tokenisation split. The `[^\r\n\p{L}\p{N}]?\p{L}+` branch glues the preceding space (or
# punctuation) onto a word, and digits are split one by one, as in the real Qwen tokenizer.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Special in Qwen3 (skipped by `decode(..., skip_special_tokens=True)`).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Atomic but *not* special in Qwen3: TRL's fallback decode (`skip_special_tokens=True`) must keep them visible.
ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

SHIPPED_VOCAB_SIZE = 8192
# Fixed so that the shipped tokenizer can be reproduced exactly.
_MIN_FREQUENCY = 2
_MODEL_MAX_LENGTH = 32768

_LOADER_ONLY_CONFIG_KEYS = ("is_local", "local_files_only", "cache_dir", "_commit_hash", "name_or_path")

_RESOURCE_PACKAGE = "coordrl"
_TOKENIZER_RESOURCE = ("resources", "tokenizer")
_DATA_RESOURCE = ("resources", "data")

_ADDED_TOKEN_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS) + ")")


def _qwen3_chat_template() -> str:
    # Imported lazily: TRL is heavy and only the tokenizer-building paths need the template string.
    from trl.chat_template_utils import qwen3_chat_template

    return qwen3_chat_template


def _fragments_without_added_tokens(texts: Iterable[str]) -> Iterator[str]:
    """Yield the pieces of each text between added tokens.

    At encode time added tokens are cut out before the BPE model sees the text; training on the same pieces
    keeps merges such as ``<tool`` + ``_call`` from wasting vocabulary on strings that never reach the model.
    """
    for text in texts:
        for piece in _ADDED_TOKEN_SPLIT.split(text):
            if piece and piece not in SPECIAL_TOKENS and piece not in ADDED_TOKENS:
                yield piece


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = SHIPPED_VOCAB_SIZE,
    *,
    split_pattern: str = QWEN_SPLIT_PATTERN,
    min_frequency: int = _MIN_FREQUENCY,
) -> PreTrainedTokenizerFast:
    """Train a Qwen3-style byte-level BPE tokenizer on ``texts``.

    The result round-trips any text exactly (no normaliser; the full 256-byte alphabet is always present),
    carries the Qwen3 special and added tokens as single ids placed after the BPE vocabulary (as in Qwen3),
    uses ``<|im_end|>`` as EOS and ``<|endoftext|>`` as padding, and has TRL's Qwen3 chat template.

    Training is deterministic: the same texts (in any order, with any duplicates) and ``vocab_size`` give an
    identical ``tokenizer.json``.

    Args:
        texts: training text. Order and duplicates do not matter: texts are deduplicated and sorted first.
        vocab_size: total vocabulary size including the 9 added tokens. A small corpus may yield fewer BPE
            tokens, in which case the vocabulary is smaller; ``len(tokenizer)`` is always the true size.
        split_pattern: pre-tokenizer regex (default Qwen's; the synthetic world uses its own).
        min_frequency: BPE merge threshold (default 2).

    Returns:
        A ``PreTrainedTokenizerFast`` ready to use or to save with :func:`save_tokenizer`.
    """
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    # 256 byte symbols must fit, otherwise some bytes could not be encoded at all.
    if vocab_size < 256 + n_added:
        raise ValueError(f"vocab_size must be at least {256 + n_added}, got {vocab_size}")

    # Word counts do not depend on order, but a canonical order makes determinism independent of the caller.
    corpus = sorted(set(_fragments_without_added_tokens(texts)))

    backend = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            # The regex already split the text; ByteLevel here only maps bytes to printable symbols.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    # normalized=False as in Qwen3: the markers must match the raw text, never a transformed form of it.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=_qwen3_chat_template(),
        # The default clean-up would rewrite " ," into "," on decode and break exact round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=_MODEL_MAX_LENGTH,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> list[Path]:
    """Save ``tokenizer`` to ``out_dir`` so that any transformers version with fast tokenizers can load it.

    transformers 5 records its internal class name (``TokenizersBackend``) in ``tokenizer_config.json``; other
    loaders, such as a vLLM server in its own virtualenv, may only know ``PreTrainedTokenizerFast``, which is the
    same class under its long-standing public name.

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    written = [Path(p) for p in tokenizer.save_pretrained(out)]
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # from_pretrained's loading options leak into init kwargs; they describe one load, not the tokenizer.
    for key in _LOADER_ONLY_CONFIG_KEYS:
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return sorted(set(written))


def _resource_dir(*parts: str) -> importlib.resources.abc.Traversable:
    node = importlib.resources.files(_RESOURCE_PACKAGE)
    for part in parts:
        node = node / part
    return node


def load_shipped_tokenizer() -> PreTrainedTokenizerFast:
    """Load the tokenizer shipped in ``coordrl/resources/tokenizer/`` (vocabulary 8192, Qwen3 chat template).

    Works from a source checkout, an installed wheel or a zipped install; never touches the network.
    """
    resource = _resource_dir(*_TOKENIZER_RESOURCE)
    if isinstance(resource, Path):
        return AutoTokenizer.from_pretrained(str(resource), local_files_only=True)
    # Not a plain directory (e.g. a zip import): from_pretrained needs real files, so copy them out first.
    with tempfile.TemporaryDirectory(prefix="coordrl-tokenizer-") as tmp:
        for entry in resource.iterdir():
            if entry.is_file():
                (Path(tmp) / entry.name).write_bytes(entry.read_bytes())
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


# ---------------------------------------------------------------------------------------------------------------
# Training text for the shipped tokenizer
# ---------------------------------------------------------------------------------------------------------------


def _paragraph_text(sentences: list[str] | None, fallback: str | None = None) -> str | None:
    if sentences:
        # HotpotQA sentences carry their own leading spaces; 2Wiki sentences do not, so join on a space there.
        if any(s[:1].isspace() for s in sentences[1:]):
            return "".join(sentences)
        return " ".join(sentences)
    return fallback


def _qa_record_texts(record: dict) -> Iterator[str]:
    for key in ("question", "answer"):
        value = record.get(key)
        if isinstance(value, str) and value:
            yield value
    for title, sentences in record.get("context") or []:
        yield title
        paragraph = _paragraph_text(sentences)
        if paragraph:
            yield paragraph


def _synthetic_tool_texts(questions: list[str], titles: list[str]) -> Iterator[str]:
    """Qwen3 tool-calling text, so that JSON tool calls cost few tokens.

    The shapes follow TRL's Qwen3 chat template: a tools system block with one JSON schema per line, assistant
    turns with ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` and tool turns wrapped in
    ``<tool_response>``. Strings are drawn from the shipped questions and titles, so each text is distinct.
    """
    tool_schemas = [
        {
            "type": "function",
            "function": {
                "name": "query_agents",
                "description": "Send one question to each reader agent and return their answers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "queries": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "One question per agent.",
                        }
                    },
                    "required": ["queries"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "answer",
                "description": "Give the final answer to the user question.",
                "parameters": {
                    "type": "object",
                    "properties": {"answer": {"type": "string", "description": "The final answer."}},
                    "required": ["answer"],
                },
            },
        },
    ]
    header = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        + "".join("\n" + json.dumps(schema) for schema in tool_schemas)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
    )
    yield header
    for i, question in enumerate(questions):
        # Pair each question with a couple of titles so that list-valued arguments are well represented.
        picked = [titles[(i * 7 + k) % len(titles)] for k in range(1 + i % 3)] if titles else []
        queries = [question] + [f"What is known about {title}?" for title in picked]
        call = {"name": "query_agents", "arguments": {"queries": queries}}
        responses = [{"agent": k, "answer": title} for k, title in enumerate(picked)]
        yield (
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{json.dumps(responses)}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>\n"
            f"{json.dumps({'name': 'answer', 'arguments': {'answer': picked[0] if picked else question}})}"
            f"\n</tool_call><|im_end|>\n"
        )


def shipped_training_texts() -> list[str]:
    """The training text of the shipped tokenizer, deduplicated and sorted.

    Reads every ``*.json.gz`` (HotpotQA / 2WikiMultiHopQA lists of records with ``question``, ``answer`` and
    ``context`` = ``[[title, [sentences]], ...]``) and ``*.jsonl.gz`` (paragraph pool lines with ``title``,
    ``sentences`` and ``text``) file in ``coordrl/resources/data/``, in file-name order, then adds synthetic
    tool-calling text built from the questions and titles.
    """
    data_dir = _resource_dir(*_DATA_RESOURCE)
    texts: set[str] = set()
    questions: set[str] = set()
    titles: set[str] = set()
    for entry in sorted(data_dir.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json.gz"):
            records = json.loads(gzip.decompress(entry.read_bytes()).decode("utf-8"))
            for record in records:
                texts.update(_qa_record_texts(record))
                if isinstance(record.get("question"), str):
                    questions.add(record["question"])
                titles.update(title for title, _ in record.get("context") or [])
        elif entry.name.endswith(".jsonl.gz"):
            for line in gzip.decompress(entry.read_bytes()).decode("utf-8").splitlines():
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("title"):
                    texts.add(row["title"])
                    titles.add(row["title"])
                paragraph = row.get("text") or _paragraph_text(row.get("sentences"))
                if paragraph:
                    texts.add(paragraph)
    texts.update(_synthetic_tool_texts(sorted(questions), sorted(titles)))
    return sorted(texts)


def build_shipped_tokenizer(out_dir: str | Path | None = None, vocab_size: int = SHIPPED_VOCAB_SIZE) -> Path:
    """Retrain the shipped tokenizer from :func:`shipped_training_texts` and save it.

    Args:
        out_dir: where to write; defaults to ``coordrl/resources/tokenizer/`` next to this source file (only
            meaningful in a source checkout).
        vocab_size: total vocabulary size; the shipped tokenizer uses 8192.

    Returns:
        The output directory.
    """
    if out_dir is None:
        out = Path(__file__).resolve().parent.parent.joinpath(*_TOKENIZER_RESOURCE)
    else:
        out = Path(out_dir)
    tokenizer = train_tokenizer(shipped_training_texts(), vocab_size=vocab_size)
    if out.exists():
        # Leave no stale files from an older transformers layout behind.
        for stale in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            (out / stale).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Tiny model
# ---------------------------------------------------------------------------------------------------------------
