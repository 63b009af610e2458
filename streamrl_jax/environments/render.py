"""An episode's environment turn as tokens: the chat template's own rendering, appended.

The policy's tokens are kept exactly as sampled; only what the environment adds is
tokenised. For a turn the policy ended (its end-of-turn token sampled), the
environment's tokens are the chat template's text *after* an assistant message up to
the next assistant header: the rest of the assistant's closing, the observation
messages, the generation prompt. They are found by rendering a fixed conversation
twice with the checkpoint's template (without and with the observation, a sentinel as
the assistant's content) and taking what follows the sentinel, minus the end-of-turn
text the policy already sampled. So the template decides every role's framing (a
`tool` message in ChatML; Qwen's template puts it in `<tool_response>` tags), and
earlier turns are never re-tokenised (template boundaries: docs/episodes.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl_jax.environments.protocol import Message
from streamrl_jax.model import function_calls
from streamrl_jax.model.tokenizer import Tokenizer

_SENTINEL = "<<<EPISODE-ASSISTANT-CONTENT>>>"
_PREFIX = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class TurnRenderer:
    """Observation messages -> the tokens appended after a policy turn; with a
    function-calling `convention` (an environment of OpenAI functions), `tool` results
    in its form first, as the endpoint gives them to the template."""

    def __init__(self, tokenizer: Tokenizer, convention: function_calls.Convention | None = None):
        self.tokenizer, self.convention = tokenizer, convention
        self.stop_ids = set(tokenizer.stop_ids)

    def observation(self, messages: Sequence[Message], ended: int | None) -> list[int]:
        """The tokens that follow a policy turn whose last token is `ended` (an end-of-turn
        id the policy sampled) or None (the turn was cut: the template's own closing is
        appended too), then `messages`, then the assistant header.

        Raises:
          ValueError: the template does not render the conversation as a prefix-stable
            sequence (naming the sentinel's absence).
        """
        if self.convention is not None:
            messages = function_calls.template_messages(self.convention, messages)
        convo = [*_PREFIX, {"role": "assistant", "content": _SENTINEL}, *messages]
        text = self.tokenizer.apply_chat_template(convo, add_generation_prompt=True)
        at = text.find(_SENTINEL)
        if at < 0:
            raise ValueError(
                "chat template dropped the assistant turn's content: cannot render an "
                "episode's environment turn"
            )
        tail = text[at + len(_SENTINEL) :]
        if ended is not None and ended in self.stop_ids:
            closing = self.tokenizer.decode([ended], skip_special_tokens=False)
            if tail.startswith(closing):
                tail = tail[len(closing) :]
        return self.tokenizer.encode(tail)
