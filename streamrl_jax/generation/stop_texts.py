"""Stop strings: the first token whose text completes one.

The engine stops on token ids on the device; a request's `SamplingParams.stop_texts` end
it on text, which only the host can read (the engine is given a detokenizer by whoever
builds it: `Engine(detokenize=...)`). After every round trip the engine asks, for each
running request with stop strings, whether the text of the tokens it sampled (after its
continuation's: an episode's turn) now contains one, and if so which token completed it
(`first_stop`); the response is cut after that token.

The answer is the text of the whole turn, as a caller decoding the turn at once reads it
(the endpoint cuts its text there): the smallest j with a stop string in
`detokenize(tokens[:j + 1])`. Decoding the whole turn after every round trip would cost
its length each time, so a window is decoded first: the tokens since the last check and
enough before them to hold the longest stop string (a token is at least one byte of
UTF-8, so 4 per character, and more when the text before them is shorter than that, as
when special tokens decode to nothing). Only when the window holds a stop string are
whole prefixes decoded, to find the token exactly: once per stopped turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]
_SLACK = 8  # tokens of lookback beyond 4 per character (a split character, a merge)


def first_stop(
    detokenize: Detokenize, tokens: Sequence[int], checked: int, texts: Sequence[str]
) -> int | None:
    """The index of the token that completes a stop string: the smallest j >= `checked`
    whose text `detokenize(tokens[:j + 1])` contains one of `texts`; None if no such j
    below len(tokens).

    Args:
      detokenize: token ids -> text (the tokenizer's decode).
      tokens: the request's own sampled tokens so far.
      checked: how many of them are known to complete none (an earlier call's length).
      texts: the stop strings (non-empty).
    """
    if checked >= len(tokens) or not texts:
        return None
    longest = max(map(len, texts))
    start = max(0, checked - 4 * longest - _SLACK)
    if start and len(detokenize(tokens[start:checked])) < longest + _SLACK:
        start = 0  # the text before the new tokens is short: read it all
    window = detokenize(tokens[start:])
    if not any(t in window for t in texts):
        return None
    for j in range(checked, len(tokens)):
        text = detokenize(tokens[: j + 1])
        if any(t in text for t in texts):
            return j
    return None  # the window's start read differently from the whole text: none
