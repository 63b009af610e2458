"""OpenAI tool calling through the endpoint (model/function_calls.py, docs/endpoint.md
"Tool calling"), with the official `openai` client and the OpenAI Agents SDK.

The policy here is scripted (`scripted_policy.Scripted`: each turn "samples" the tokens of a given
text, with made-up log-probs), so that a test decides what the policy writes: a call,
parallel calls, a malformed call. What is tested is the endpoint's side: the tools in
the prompt, the calls parsed from the sampled text, the `tool` messages rendered into
the next turn, and the record holding exactly the sampled tokens. The real engine's
side of a turn is endpoint_test.py's.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import openai
import pytest
from scripted_policy import TOKEN, Scripted

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.client import EndpointClient
from streamrl_jax.endpoint.server import Endpoint, EndpointServer
from streamrl_jax.endpoint.turns import Context, Turns
from streamrl_jax.model import function_calls
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "The sum of two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
MUL = {"type": "function", "function": {**ADD["function"], "name": "mul"}}


@pytest.fixture(scope="module")
def served():
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    backend = Scripted(tok)
    endpoint = Endpoint(Turns(Context(tok, 1024, 2048)), backend, TOKEN)
    server = EndpointServer(endpoint)
    client = EndpointClient(server.start(), TOKEN)
    yield endpoint, backend, client
    server.stop()


def _chat(oc, messages, **kw):
    return oc.chat.completions.create(model="policy", messages=messages, **kw)


def _call(name: str, **args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_a_tool_call_round_trip_is_recorded_token_for_token(served):
    # tools -> tool_calls -> a `tool` message -> the answer: the tools' schemas are in the
    # first prompt (SmolLM2's template renders no tools: the Hermes system text), the
    # call comes back parsed (id, JSON arguments, finish_reason "tool_calls"), the
    # result is rendered as the template renders a `tool` message, and the record holds
    # exactly the two turns' sampled tokens, the rest with policy mask False.
    endpoint, backend, client = served
    tok = endpoint.turns.ctx.tokenizer
    backend.script = [_call("add", a=2, b=3), "The answer is 5."]
    with client.episode() as (oc, eid):
        r1 = _chat(oc, USER, tools=[ADD], logprobs=True)
        (call,) = r1.choices[0].message.tool_calls
        assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert r1.choices[0].message.content is None and call.id.startswith("call_")
        prompt = tok.decode(backend.requests[-1].prompt, skip_special_tokens=False)
        assert '"name": "add"' in prompt and "<tools>" in prompt
        history = [*USER, r1.choices[0].message, {"role": "tool", "tool_call_id": call.id,
                                                  "content": "5"}]  # fmt: skip
        r2 = _chat(oc, history, tools=[ADD], logprobs=True)
        assert r2.choices[0].message.content == "The answer is 5."
        assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
        s = endpoint.book._open[eid].sample
    ids = [np.asarray(r.choices[0].model_extra["token_ids"]) for r in (r1, r2)]
    np.testing.assert_array_equal(s.policy_token_ids(), np.r_[ids[0], ids[1]])
    lps = [np.float32([e.logprob for e in r.choices[0].logprobs.content]) for r in (r1, r2)]
    np.testing.assert_array_equal(s.logprobs[s.policy_mask], np.r_[lps[0], lps[1]])
    assert tok.decode(ids[0]) == _call("add", a=2, b=3)  # the call is a view of the tokens
    env = tok.decode(s.response[~s.policy_mask], skip_special_tokens=False)
    assert env == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_parallel_calls_are_each_answered_by_id(served):
    endpoint, backend, client = served
    backend.script = [_call("add", a=1, b=2) + "\n" + _call("mul", a=3, b=4), "3 and 12."]
    with client.episode() as (oc, eid):
        r1 = _chat(oc, USER, tools=[ADD, MUL])
        calls = r1.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["add", "mul"]
        assert len({c.id for c in calls}) == 2
        results = [{"role": "tool", "tool_call_id": c.id, "content": v}
                   for c, v in zip(calls, ("3", "12"), strict=True)]  # fmt: skip
        r2 = _chat(oc, [*USER, r1.choices[0].message, *results], tools=[ADD, MUL])
        assert r2.choices[0].message.content == "3 and 12."
        with pytest.raises(openai.BadRequestError, match="not a call of the assistant message"):
            again = [*USER, r1.choices[0].message, results[0], results[0]]
            _chat(client.openai(client.open()), again, tools=[ADD, MUL])
        env = endpoint.turns.ctx.tokenizer.decode(
            endpoint.book._open[eid].sample.response, skip_special_tokens=False
        )
    assert "<|im_start|>tool\n3<|im_end|>\n<|im_start|>tool\n12<|im_end|>" in env


@pytest.mark.parametrize(
    "choice, opening, written, called",
    [
        ("required", '<tool_call>\n{"name": "',
         'add", "arguments": {"a": 1, "b": 1}}\n</tool_call>', "add"),
        ({"type": "function", "function": {"name": "mul"}},
         '<tool_call>\n{"name": "mul", "arguments": ', '{"a": 2, "b": 2}}\n</tool_call>', "mul"),
        ("none", "", _call("add", a=1, b=1), None),
        ("auto", "", "No tool needed: 2.", None),
    ],
)  # fmt: skip
def test_tool_choice_opens_the_turn_with_the_call_it_requires(
    served, choice, opening, written, called
):
    # `required` and a named function start the policy's turn with the call's opening
    # (prompt tokens, policy mask False): the policy samples the rest, which is all the
    # record trains. `none` reads no call from the text.
    endpoint, backend, client = served
    tok = endpoint.turns.ctx.tokenizer
    backend.script = [written]
    with client.episode() as (oc, eid):
        r = _chat(oc, USER, tools=[ADD, MUL], tool_choice=choice)
        s = endpoint.book._open[eid].sample
    prompt = tok.decode(backend.requests[-1].prompt, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n" + opening)
    assert tok.decode(s.policy_token_ids()) == written
    message = r.choices[0].message
    if called is None:
        assert message.tool_calls is None and message.content == written
        assert r.choices[0].finish_reason == "stop"
    else:
        assert [c.function.name for c in message.tool_calls] == [called]


def test_a_malformed_call_is_returned_as_text_and_counted(served):
    endpoint, backend, client = served
    bad = ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>',  # bad JSON
           _call("rm", path="/"),  # a function not offered
           '<tool_call>\n{"name": "add", "arguments": "[1, 2]"}\n</tool_call>',  # not an object
           "<tool_call>\n" + '{"name": "add"' * 3]  # never closed  # fmt: skip
    for text in bad:
        before = endpoint.counts["malformed_calls"]
        backend.script = [text]
        with client.episode() as (oc, _):
            r = _chat(oc, USER, tools=[ADD])
        assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        assert endpoint.counts["malformed_calls"] == before + 1


def test_a_streamed_tool_call_accumulates_as_openais_clients_expect(served):
    endpoint, backend, client = served
    backend.script = [_call("add", a=4, b=5)]
    with client.episode() as (oc, _):
        chunks = list(_chat(oc, USER, tools=[ADD], stream=True))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or () if ch.choices else ():
            c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
    assert [c["name"] for c in calls.values()] == ["add"]
    assert json.loads(calls[0]["arguments"]) == {"a": 4, "b": 5}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _streamed(oc, script, backend, **kw):
    """A streamed chat turn whose policy writes `script`: its chunks, and the content
    deltas each chunk carried."""
    backend.script = [script]
    chunks = [c for c in _chat(oc, USER, stream=True, **kw) if c.choices]
    return chunks, [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]


def test_a_streamed_turn_shows_no_text_that_may_start_a_call(served):
    # (The scripted turn's tokens all come before its stream starts: one text chunk; the
    # text shown as tokens come is streaming_test.py's.) The text before a call is shown,
    # the call markup never as text: the calls come whole at the end, and the tokens
    # streamed are the turn's. Without tools, or with a `<` that opens no call, the text
    # is all shown.
    endpoint, backend, client = served
    tok = endpoint.turns.ctx.tokenizer
    with client.episode() as (oc, _):
        chunks, shown = _streamed(oc, "Let me add them. " + _call("add", a=4, b=5), backend,
                                  tools=[ADD])  # fmt: skip
    assert "".join(shown) == "Let me add them."
    assert not any("<" in piece for piece in shown)
    (call,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert call.function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    ids = [i for c in chunks for i in c.choices[0].model_extra.get("token_ids", [])]
    assert tok.decode(ids) == "Let me add them. " + _call("add", a=4, b=5)
    for tools in ([ADD], []):
        with client.episode() as (oc, _):
            chunks, shown = _streamed(oc, "If a < b, then b > a.", backend, tools=tools or None)
        assert "".join(shown) == "If a < b, then b > a."
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streamed_required_call_is_held_whole(served):
    # tool_choice required: the turn continues a call's opening, so nothing is shown as
    # text; a call read is sent whole, a malformed one as the message's text at the end.
    endpoint, backend, client = served
    with client.episode() as (oc, _):
        body = 'add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        chunks, shown = _streamed(oc, body, backend, tools=[ADD], tool_choice="required")
    assert shown == [] and chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.episode() as (oc, _):
        chunks, shown = _streamed(oc, "no call", backend, tools=[ADD], tool_choice="required")
    assert shown == ['<tool_call>\n{"name": "no call']
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streamed_reply_as_openais_client_accumulates_it_goes_on_the_episode(served):
    # The client's stream helper gives back the calls with their stream `index` (what
    # verifiers' chat loop sends back): the next request repeats them so and is answered.
    endpoint, backend, client = served
    backend.script = [_call("add", a=4, b=5), "9."]
    with client.episode() as (oc, _):
        with oc.chat.completions.stream(model="policy", messages=USER, tools=[ADD]) as stream:
            reply = stream.get_final_completion().choices[0].message.model_dump(exclude_none=True)
        assert reply["tool_calls"][0]["index"] == 0
        answer = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "9"}
        r = _chat(oc, [*USER, reply, answer], tools=[ADD])
    assert r.choices[0].message.content == "9."


def test_a_request_without_an_episode_id_is_an_episode_of_its_own(served):
    # (and OpenAI's fields that change nothing here are accepted)
    endpoint, backend, client = served
    backend.script = ["Five."]
    oc = openai.OpenAI(base_url=client.url + "/v1", api_key=TOKEN, max_retries=0)
    before = endpoint.counts["single_requests"], endpoint.book.num_open
    ignored = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
               "parallel_tool_calls": True, "frequency_penalty": 0,
               "presence_penalty": 0.0}  # fmt: skip
    r = _chat(oc, USER, tools=[ADD], **ignored)
    assert r.choices[0].message.content == "Five."
    assert endpoint.counts["single_requests"] == before[0] + 1
    assert endpoint.book.num_open == before[1]  # closed after its request
    assert backend.released[-1] == backend.requests[-1].request_id  # its kept slot given up
    oc.close()


def test_n_choices_without_an_episode_id_leave_nothing_open(served):
    endpoint, backend, client = served
    backend.script = ["One.", "Two.", "Three."]
    oc = openai.OpenAI(base_url=client.url + "/v1", api_key=TOKEN, max_retries=0)
    open_before = endpoint.book.num_open
    endpoint.limits = dataclasses.replace(endpoint.limits, max_n=3)
    try:
        r = _chat(oc, USER, n=3, seed=7)
        assert sorted(c.message.content for c in r.choices) == ["One.", "Three.", "Two."]
        assert endpoint.book.num_open == open_before  # each an episode of one request
        assert sorted(q.seed for q in backend.requests[-3:]) == [7, 8, 9]  # seed + i
        with client.episode() as (ec, eid):
            backend.script = ["A."]
            _chat(ec, USER)
            with pytest.raises(openai.BadRequestError, match="is not a new episode"):
                _chat(ec, [*USER, {"role": "assistant", "content": "A."},
                           {"role": "user", "content": "More."}], n=2)  # fmt: skip
    finally:
        endpoint.limits = dataclasses.replace(endpoint.limits, max_n=1)
        oc.close()


def test_a_history_of_calls_is_rendered_in_a_first_request(served):
    # A client that keeps its own conversation (no episode id) sends earlier calls and
    # results: they are rendered as the convention writes them.
    endpoint, backend, client = served
    backend.script = ["Done."]
    oc = openai.OpenAI(base_url=client.url + "/v1", api_key=TOKEN, max_retries=0)
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
        ],
    }
    _chat(oc, [*USER, called, {"role": "tool", "tool_call_id": "c1", "content": "2"}],
          tools=[ADD])  # fmt: skip
    prompt = endpoint.turns.ctx.tokenizer.decode(
        backend.requests[-1].prompt, skip_special_tokens=False
    )
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    oc.close()


# ---------------------------------------------------------------------- conventions
@pytest.mark.parametrize("name", sorted(function_calls.CONVENTIONS))
def test_each_convention_reads_what_it_writes(name):
    conv = function_calls.CONVENTIONS[name]
    calls = [function_calls.Call("c0", "add", '{"a": 1, "b": [2, "x"]}'),
             function_calls.Call("c1", "mul", '{"a": 3.5}')]  # fmt: skip
    read = conv.read(conv.write(calls))
    assert not read.malformed and read.content is None
    assert read.calls == [("add", {"a": 1, "b": [2, "x"]}), ("mul", {"a": 3.5})]
    assert conv.read("Just an answer: 7.").calls == []


@pytest.mark.parametrize(
    "name, text",
    [
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some text'),
        ("llama3_json", '{"name": "add", "parameters": [1]}'),
        ("llama3_json", '{"name": "add", "parameters": {"a": ' + "[" * 5000),
        ("gemma_tool_code", "```tool_code\nadd(1, 2)\n```"),  # positional: no names
        ("gemma_tool_code", "```tool_code\n__import__('os').system('x')\n```"),
        ("gemma_tool_code", "```tool_code\nadd(a=open('f'))\n```"),  # not a literal
        ("gemma_tool_code", "```tool_code\nadd(a=" + "(" * 400 + ")" * 400 + ")\n```"),
        ("gemma_tool_code", "```tool_code\nadd(a=1)\n"),  # never closed
        ("hermes", "<tool_call>\n" + "[" * 10000 + "\n</tool_call>"),
    ],
)
def test_a_convention_never_runs_or_half_reads_model_output(name, text):
    read = function_calls.CONVENTIONS[name].read(text)
    assert read.malformed and read.calls == []


def test_the_llama_and_gemma_conventions_render_results_in_their_roles():
    results = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    llama = function_calls.CONVENTIONS["llama3_json"].results(results)
    assert [m["role"] for m in llama] == ["ipython", "ipython"]
    (gemma,) = function_calls.CONVENTIONS["gemma_tool_code"].results(results)
    assert gemma == {"role": "user", "content": "```tool_output\n3\n```\n```tool_output\n4\n```"}


def test_a_template_that_renders_tools_is_given_them(tmp_path):
    # A checkpoint whose own template renders `tools` (as Qwen3's and Llama 3.1's do) is
    # given the schemas; the endpoint adds no system text of its own.
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
        "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    own = Tokenizer(tok.backend, eos_ids=tok.eos_ids, chat_template=template)
    assert own.renders_tools and not tok.renders_tools
    turns = Turns(Context(own, 1024, 2048))
    from streamrl_jax.endpoint.book import EpisodeBook

    book = EpisodeBook()
    rec = book.take(book.open())
    chat, s = api.check_chat(
        api.decode(json.dumps({"model": "p", "messages": USER, "tools": [ADD, MUL]}).encode(),
                   api.ChatRequest), api.Limits(), "p")  # fmt: skip
    request = turns.chat(rec, chat, s, turns.sampling(s), 0)
    text = own.decode(request.prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nTOOLS: add mul<|im_end|>") and "<tools>" not in text


# ---------------------------------------------------------------------- agent frameworks
def test_an_openai_agents_sdk_agent_calls_its_function_tool_through_the_endpoint(served):
    # The OpenAI Agents SDK (unchanged), its chat-completions model over the endpoint:
    # the agent's function tool is offered as an OpenAI tool, the policy's call runs the
    # tool, its result goes back as a `tool` message, and the policy's answer is the
    # agent's final output; the episode's record holds both turns as sampled.
    import agents

    endpoint, backend, client = served
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """The sum of two numbers."""
        ran.append((a, b))
        return a + b

    backend.script = [_call("add", a=2, b=3), "2 + 3 = 5."]
    eid = client.open()
    model = agents.OpenAIChatCompletionsModel("policy", openai_client=client.async_openai(eid))
    agent = agents.Agent(name="adder", instructions="Add with the tool.", tools=[add], model=model)
    result = agents.Runner.run_sync(agent, "What is 2 + 3?", max_turns=4)
    assert result.final_output == "2 + 3 = 5." and ran == [(2, 3)]
    rec = client.close(eid)
    assert rec["turns"] == 2
    tok = endpoint.turns.ctx.tokenizer
    first = tok.decode(backend.requests[-2].prompt, skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nAdd with the tool.\n\n# Tools")
    assert '"name": "add"' in first
