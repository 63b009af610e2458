"""pipeline/episode_evaluation.py: a served checkpoint's held-out episodes played by an
OpenAI Agents SDK agent through `python -m streamrl_jax.serve`, against the same
checkpoint's episodes in-process (docs/endpoint.md "Evaluating a served checkpoint")."""

import pytest
from child_env import served_url, start_serve, stop_serve
from support import config_file, write_policy_checkpoint

from streamrl_jax.pipeline.episode_evaluation import HeldOutEpisodes, policy_engine

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)

TOKEN = "eval-test-token-" + "5" * 20
SLOTS = 4
PROBLEMS = 4
# One decode shape (`pipeline.deterministic`): greedy tokens depend on nothing but the
# weights and what each episode read, whatever else the engine runs beside it.
OVERRIDES = dict(pipeline__deterministic=True, eval__num_problems=PROBLEMS)


def test_an_agent_evaluates_a_served_checkpoint_as_the_run_evaluates_it_in_process(tmp_path):
    # The chained calculator's held-out problems on a checkpoint of the tiny model (its
    # weights x4: at the initial scale greedy decoding repeats the last prompt token,
    # whatever the prompt), played greedily by an OpenAI Agents SDK agent through the
    # served checkpoint and by the run's in-process evaluation: per problem the same
    # outcome, and every turn the same count of tokens read and the same tokens sampled
    # (so the served path rendered the instructions, the tools and the question as the
    # run does: the greedy tokens of this model follow its whole prompt).
    cfg = config_file("configs/agent.py", "chained_tiny", **OVERRIDES)
    root = tmp_path / "checkpoints"
    write_policy_checkpoint(root, cfg, lambda x: 4.0 * x)
    flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in OVERRIDES.items()]
    proc, ready, log = start_serve(
        tmp_path, "serve", TOKEN, ["--config=configs/agent.py:chained_tiny", *flags,
                                   f"--checkpoint={root}", f"--slots={SLOTS}"],
    )  # fmt: skip
    try:
        engine, tokenizer = policy_engine(cfg, checkpoint=str(root), slots=SLOTS)
        held = HeldOutEpisodes(cfg, tokenizer)
        try:
            local = held.in_process(engine)
            served = held.served(served_url(proc, ready), TOKEN, concurrency=SLOTS, timeout_s=120)
        finally:
            held.close()
    finally:
        code = stop_serve(proc, log)
    assert code == 0, (tmp_path / "serve.log").read_text()[-2000:]
    assert len(local.episodes) == PROBLEMS
    assert served.episodes == local.episodes
    assert local.agreement(served) == {"outcomes": PROBLEMS, "tokens": PROBLEMS}
    assert served.accuracy == local.accuracy
    assert engine.metrics()["reprefilled"] == 0
    # what was compared is not one sequence: each problem's prompt led elsewhere
    assert len({e.tokens for e in local.episodes}) == PROBLEMS
    assert all(e.read[0] > 200 for e in local.episodes)  # instructions, tools, question
