"""Texts that end sampling (generation_config.json's `stop_strings`: "<|im_end|>", "\\n\\nUser:"), matched on the
decoded text as transformers' StopStringCriteria matches them: sampling ends at the token that completes one, even
where it spans several tokens or begins in the prompt, and that token stays in the result, the stop string with it
(and any text of that token past it), as transformers' generate returns it.

    stops = StopStrings(["\\n\\nUser:"], tok.decode)
    if stops.ends(prompt_ids + new_ids): ...            # the last token completed a stop string
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from os.path import commonprefix


class StopStrings:
    """Stop strings of a model (each non-empty text once), over the tokenizer's `decode` (ids -> text)."""

    def __init__(self, texts: Iterable[str], decode: Callable[[list[int]], str]):
        self.texts = list(dict.fromkeys(t for t in texts if isinstance(t, str) and t))
        self.decode = decode
        # tokens enough to hold the longest: a character can take up to 4 byte tokens, and one more for the overhang
        self.window = 4 * max((len(t) for t in self.texts), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.texts)

    def ends(self, tokens: list[int]) -> bool:
        """Whether the last of `tokens` (the prompt and the tokens sampled so far) completes a stop string: one
        appears in the decoded text and reaches into that token's text (an earlier one has already ended sampling,
        or sits in the prompt, which does not end it)."""
        if not self.texts or not tokens:
            return False
        tail = list(tokens[-self.window:])
        text = self.decode(tail)
        # where the last token's text begins: after what the text before it shares with the whole (a character
        # whose bytes the last token completes decodes differently without it)
        start = len(commonprefix([self.decode(tail[:-1]), text]))
        return any(text.rfind(t) + len(t) > start for t in self.texts if t in text)
