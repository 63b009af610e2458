"""Solver and verifier: two agents in one episode (`environment.name="solve_verify"`).

A multi-agent environment (`protocol.MultiAgentEnvironment`, docs/multi_agent.md): the
**solver** answers the task's question (the run's task, e.g. the quickstart's
arithmetic) in `<answer>` tags; the **verifier** reads the question and that answer in
a conversation of its own and replies Yes (the answer is right) or No, then what is
wrong; on a No the solver reads the verifier's words as a user turn in its
conversation and gives a final answer. Each agent is rewarded by the ground truth (the
task's scorer):

* the solver: the task's score of its final answer (its first one when accepted);
* the verifier: 1 when its decision is right, else 0: Yes to a correct answer, or No to
  a wrong one *with the correct answer* in its own `<answer>` tags (scored by the same
  task scorer). Its decision is the first Yes or No it writes; a reply with neither is
  a wrong decision and ends the episode (the solver's first answer stands).

A No must carry the right answer because plain accuracy pays a verifier that rejects
everything when most answers are wrong: with that reward, a 10-step SmolLM2 run's
verifier went to answering No nearly always (its return 0.25 -> 0.81-0.94), every
solver revised, and the solver's held-out accuracy fell 0.328 -> 0.109
(docs/multi_agent.md). To reject, the verifier must now work the answer out, and the
solver reads it in the critique.

So both must learn: the solver to answer and to use a critique, the verifier to tell
right from wrong. The held-out evaluation scores the solver (`evaluated`): its final
answer, after the verifier's check.

Yes and No, not ACCEPT and REJECT: asked for the latter, SmolLM2-135M-Instruct worked
the arithmetic instead in every greedy reply tried, and in a 10-step run's first 4 steps
no verifier reply held a decision (so no reward varied and nothing could be learned);
asked to start with Yes or No it does ("No, the proposed answer is incorrect. ..."), as
the judge's default rubric found of the same two words.
"""

from __future__ import annotations

import re
from typing import Any

from streamrl_jax.config import EnvironmentSection
from streamrl_jax.environments.protocol import (
    Message,
    Services,
    Start,
    State,
    Turn,
    TurnInfo,
    answered,
)
from streamrl_jax.rewards.tasks import chat_messages

SOLVER = "Solve it. End with <answer>N</answer>."
VERIFIER = "You check answers to arithmetic questions."
CHECK = (
    "Question: {question}\nProposed answer: {answer}\nIs the proposed answer correct? "
    "Start your reply with Yes or No. If it is not, give the correct answer in "
    "<answer></answer> tags."
)
REVISE = "A checker says your answer is wrong: {critique}\nGive your final answer in <answer> tags."
_DECISION = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
MAX_QUOTED = 2000  # characters of one agent's message quoted to the other


def decision(message: str) -> str | None:
    """ "yes" or "no": the first of the two words in `message` (any case); None."""
    found = _DECISION.search(message)
    return found.group(1).lower() if found else None


def _quoted(text: str) -> str:
    """An agent's message as the other reads it, its head cut past `MAX_QUOTED`."""
    text = text.strip()
    return text if len(text) <= MAX_QUOTED else "..." + text[-MAX_QUOTED:]


class SolveVerify:
    """Solver and verifier (module docstring)."""

    name = "solve_verify"
    roles = ("solver", "verifier")
    evaluated = "solver"

    def __init__(self, services: Services):
        self.services = services

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        del metadata
        return Start(chat_messages(question, SOLVER), {"question": question, "phase": "answer"})

    def step(self, state: State, role: str, message: str, metadata: dict[str, Any]) -> Turn:
        phase = state["phase"]
        if role == "solver" and phase == "answer":
            r = self.services.score(message, metadata)
            state = {**state, "phase": "check", "answer": message, "correct": r.correct,
                     "score": r.score}  # fmt: skip
            ask = CHECK.format(question=state["question"], answer=_quoted(message))
            first = [{"role": "system", "content": VERIFIER}, {"role": "user", "content": ask}]
            return Turn("verifier", first, {}, state, answered(r))
        if role == "verifier" and phase == "check":
            said = decision(message)
            if said == "no":  # a rejection is right with the right answer
                right = not state["correct"] and self.services.score(message, metadata).correct
            else:
                right = said == "yes" and state["correct"]
            rewards = {"verifier": float(right)}
            info = TurnInfo(answered=said is not None, correct=right, answer=said)
            if said != "no":  # accepted, or no decision: the first answer stands
                rewards["solver"] = state["score"]
                return Turn(None, [], rewards, {**state, "phase": "done"}, info)
            critique = _quoted(message)
            revise = [{"role": "user", "content": REVISE.format(critique=critique)}]
            return Turn("solver", revise, rewards, {**state, "phase": "revise"}, info)
        if role == "solver" and phase == "revise":
            r = self.services.score(message, metadata)
            return Turn(None, [], {"solver": r.score}, {**state, "phase": "done"}, answered(r))
        raise ValueError(f"solve_verify: {role!r} cannot act in phase {phase!r}")

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        del question, metadata
        return None  # a two-agent episode has no single-conversation demonstration

    def end(self, state: State) -> None:
        del state  # pure JSON: nothing to release


def make(section: EnvironmentSection, fmt: Any, services: Services) -> SolveVerify:
    """The registry's entry (`environments/__init__.py`)."""
    del section, fmt  # no tools: each agent writes text
    return SolveVerify(services)
