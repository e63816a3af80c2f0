"""WikiText detokenization for zero-shot evaluation (Megatron-LM paper, appendix E).

WikiText is stored word-level tokenized ("the European lobster , H. americanus", "1 @,@ 000", "( 24 in )"). A BPE
model never saw text spaced like that, so before scoring the spacing is undone with the rules of Megatron-LM's
`tasks/zeroshot_gpt/detokenizer.py` (`wikitext_detokenizer`), applied in the same order, so that perplexities are
comparable with the paper's. Each rule is a literal replacement or a regular expression, run over the whole text.
"""

from __future__ import annotations

import re

# (pattern, replacement, is_regex), in Megatron's order: later rules see the output of earlier ones.
_WIKITEXT_RULES: tuple[tuple[str, str, bool], ...] = (
    # Contractions: the possessive of a plural ("players ' union" -> "players' union").
    ("s '", "s'", False),
    # Megatron writes this pattern with literal slashes, so it only ever matches the text "/' 7/"; kept as is so
    # that the output (and the token count T) matches the reference implementation exactly.
    (r"/' [0-9]/", r"/'[0-9]/", True),
    # Number separators: "1 @,@ 000" -> "1,000", "3 @.@ 5" -> "3.5", "well @-@ known" -> "well-known".
    (" @-@ ", "-", False),
    (" @,@ ", ",", False),
    (" @.@ ", ".", False),
    # Punctuation: no space before it.
    (" : ", ": ", False),
    (" ; ", "; ", False),
    (" . ", ". ", False),
    (" ! ", "! ", False),
    (" ? ", "? ", False),
    (" , ", ", ", False),
    # Brackets and quotes: no space just inside them ("( 24 in )" -> "(24 in)", '" lobster red "' -> '"lobster red"').
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    # Section headings "= = Life = =" -> "== Life ==" (longest first, so "= = = =" is not read as two "= =").
    ("= = = =", "====", False),
    ("= = =", "===", False),
    ("= =", "==", False),
    # Degrees, line edges, numbers masked as N, and the possessive 's.
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}", False),
    (" \n", "\n", False),
    ("\n ", "\n", False),
    (" N ", " 1 ", False),
    (" 's", "'s", False),
)


def wikitext_detokenize(text: str) -> str:
    """WikiText's word-level tokenized text -> ordinary English spacing (Megatron's rules, in Megatron's order)."""
    for pattern, replacement, is_regex in _WIKITEXT_RULES:
        text = re.sub(pattern, replacement, text) if is_regex else text.replace(pattern, replacement)
    return text


def count_original_tokens(text: str) -> int:
    """T_o, the word-level token count that WikiText perplexity is normalized by: the text split on single spaces,
    as Megatron counts it, before detokenization (245,566 for WikiText-103's test set)."""
    return len(text.strip().split(" "))
