"""Plain text -> documents -> sentences, for BERT's sentence-pair samples (Megatron's `--split-sentences`).

Megatron splits sentences with NLTK's punkt model; mtx needs no download, so a sentence ends at `.`, `!` or `?`
(with any closing quotes or brackets) followed by whitespace and an upper-case letter, a digit or an opening quote.
Abbreviations such as "Mr. Smith" are split too: good enough for sentence-order prediction, which only needs
consecutive spans in their order. Documents are separated by blank lines; newlines inside one are spaces.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"""[.!?]+["'”’)\]]*(?=\s+["'“‘(\[]?[A-Z0-9])""")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


def split_sentences(text: str) -> list[str]:
    """The sentences of one document, in order, whitespace-normalized; empty ones dropped."""
    text = " ".join(text.split())
    sentences, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        sentences.append(text[start:end.end()].strip())
        start = end.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


def split_documents(text: str) -> list[str]:
    """Documents of a plain-text file: its blank-line-separated paragraphs, empty ones dropped."""
    return [doc for doc in (part.strip() for part in _BLANK_LINE.split(text)) if doc]
