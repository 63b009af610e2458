"""`python -m streamrl_jax.serve`: a run's checkpoint (or the model a config starts from)
behind the OpenAI-compatible endpoint, as its own process (docs/endpoint.md "Serving a
checkpoint")."""

import json
import signal
import subprocess
import sys

import numpy as np
import openai
import pytest
from child_env import launched_env, served_url, start_serve, stop_serve
from launched_runs import REPO

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)

TOKEN = "serve-test-token-" + "7" * 20
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


def _start(tmp_path, name, *flags, **env):
    return start_serve(
        tmp_path, name, TOKEN, ["--config=configs/quickstart.py:tiny", "--slots=4", *flags], **env
    )


def _greedy(url: str):
    oc = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120)
    r = oc.chat.completions.create(
        model="policy", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True
    )
    oc.close()
    c = r.choices[0]
    return c.model_extra["token_ids"], np.float32([e.logprob for e in c.logprobs.content])


def test_a_served_checkpoint_serves_its_weights_and_stops_on_sigterm(tmp_path):
    # A checkpoint of the tiny config's policy (written as a run writes one, its weights
    # moved), served: its greedy log-probs are not the start's (the checkpoint was
    # read), the same on a second request (a request without an episode id leaves
    # nothing behind), and the server stops cleanly on SIGTERM. The token from
    # $STREAMRL_ENDPOINT_TOKEN. Both share a compile cache from the environment, with an
    # entry another process wrote without JAX's access time: they take JAX's lock and
    # size bound as launch does, so every entry has one after (distributed/compile_cache).
    root, cache = tmp_path / "checkpoints", tmp_path / "cache"
    _write_checkpoint(root)
    cache.mkdir()
    (cache / "jit_f-0-cache").write_bytes(b"written without a size bound")
    shared = {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    servers = {
        "trained": _start(tmp_path, "trained", f"--checkpoint={root}", **shared),
        "start": _start(tmp_path, "start", **shared),
    }
    try:
        got = {name: _greedy(served_url(proc, ready)) for name, (proc, ready, _) in servers.items()}
        got["again"] = _greedy(served_url(*servers["trained"][:2]))
        with pytest.raises(openai.AuthenticationError):
            url = json.loads(servers["start"][1].read_text())["url"]
            openai.OpenAI(base_url=url, api_key="x" * 20, max_retries=0).models.list()
    finally:
        for proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc, _, _ in servers.values()]
        for _, _, log in servers.values():
            log.close()
    logs = [(tmp_path / f"{n}.log").read_text() for n in servers]
    assert codes == [0, 0], [log[-2000:] for log in logs]
    entries = sorted(p.name.removesuffix("-cache") for p in cache.glob("*-cache"))
    assert len(entries) > 1 and (cache / ".lockfile").exists(), entries
    assert sorted(p.name.removesuffix("-atime") for p in cache.glob("*-atime")) == entries
    assert sum("1 entries of" in log for log in logs) == 1, [log[-2000:] for log in logs]
    np.testing.assert_array_equal(got["trained"][1], got["again"][1])
    assert got["trained"][0] == got["again"][0]
    assert not np.array_equal(got["trained"][1], got["start"][1])


def _write_checkpoint(root) -> None:
    """A checkpoint of `configs/quickstart.py:tiny`'s policy, every weight moved by 0.01."""
    from support import config_file, write_policy_checkpoint

    write_policy_checkpoint(root, config_file("configs/quickstart.py", "tiny"), lambda x: x + 0.01)


def test_a_server_refuses_a_public_address_without_allow_remote():
    cmd = [sys.executable, "-m", "streamrl_jax.serve", "--config=configs/quickstart.py:tiny",
           "--host=0.0.0.0"]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=launched_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--host=0.0.0.0 is not loopback" in r.stderr


def test_an_environment_config_is_served_with_its_runs_episode_budget(tmp_path):
    # configs/agent.py:tiny (the calculator; environment.max_episode_tokens=96, 16 tokens
    # a turn): a served episode is held to the run's budget after its first prompt, as
    # the run's episodes are (docs/endpoint.md "The episode budget"): the turn after
    # text that leaves fewer than 16 tokens of it samples what is left, and the request
    # that leaves none is refused with OpenAI's context_length_exceeded.
    from streamrl_jax.endpoint.client import EndpointClient

    proc, ready, log = start_serve(
        tmp_path, "agent", TOKEN, ["--config=configs/agent.py:tiny", "--slots=2"]
    )
    try:
        client = EndpointClient(served_url(proc, ready).removesuffix("/v1"), TOKEN)
        with client.episode() as (oc, _):
            forced = {"ignore_eos": True}  # each turn exactly its cap
            r1 = oc.completions.create(model="policy", prompt="Count:", extra_body=forced)
            text = "Count:" + r1.choices[0].text + " one two three four five six" * 12
            r2 = oc.completions.create(model="policy", prompt=text, extra_body=forced)
            used = r2.usage.prompt_tokens - r1.usage.prompt_tokens  # after the first prompt
            assert r1.usage.completion_tokens == 16 and 80 < used < 96
            assert len(r2.choices[0].model_extra["token_ids"]) == 96 - used
            assert r2.choices[0].finish_reason == "length"
            with pytest.raises(openai.BadRequestError, match="of its 96 tokens") as e:
                oc.completions.create(model="policy", prompt=text + r2.choices[0].text + " 7")
            assert e.value.code == "context_length_exceeded"
        client.close_client()
    finally:
        code = stop_serve(proc, log)
    assert code == 0, (tmp_path / "agent.log").read_text()[-2000:]
