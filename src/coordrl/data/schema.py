"""The sample schema shared by `data build`, `data sweep` and every consumer of their output."""

from __future__ import annotations

from datasets import Features, List, Value

SAMPLE_FIELDS = {
    "id": "unique sample id: the source id, plus '#k' when a question is reused",
    "source_id": "id of the source question",
    "dataset": "hotpotqa | 2wikimultihopqa | musique",
    "type": "question type from the source (bridge, comparison, ...)",
    "question": "the question (never part of the context)",
    "answers": "gold answers, every one accepted (MuSiQue: the answer, then its aliases)",
    "context": "'Document i:\\n<title>\\n<text>' blocks joined by blank lines",
    "doc_offsets": "character offset of each 'Document i:' header (index i-1)",
    "gold_titles": "titles of the gold paragraphs, in supporting-fact order (MuSiQue: hop order)",
    "gold_documents": "Document numbers (1-based) of the gold paragraphs, aligned with gold_titles",
    "supporting_facts": "(title, sentence index, Document number) of each supporting fact (none for MuSiQue, "
    "which marks whole paragraphs: see gold_documents)",
    "num_paragraphs": "paragraphs in the context",
    "num_tokens": "context tokens with the build's tokenizer (no special tokens)",
    "seed": "the build seed; with sample_index and the variant it determines the sample",
    "sample_index": "index of the sample within its build or sweep subset",
    "variant": "'' for training builds; 'length=N' or a control such as 'position=start' in sweeps",
}

FEATURES = Features(
    {
        "id": Value("string"),
        "source_id": Value("string"),
        "dataset": Value("string"),
        "type": Value("string"),
        "question": Value("string"),
        "answers": List(Value("string")),
        "context": Value("large_string"),
        "doc_offsets": List(Value("int64")),
        "gold_titles": List(Value("string")),
        "gold_documents": List(Value("int32")),
        "supporting_facts": List({"title": Value("string"), "sent_id": Value("int32"), "document": Value("int32")}),
        "num_paragraphs": Value("int32"),
        "num_tokens": Value("int64"),
        "seed": Value("int64"),
        "sample_index": Value("int64"),
        "variant": Value("string"),
    }
)
