"""The package's import structure: one-way layers, no cycles (STYLE.md "Imports flow one way").

Parses every module of `streamrl_jax` (no import is executed), resolves each
`import` / `from ... import` (function-level ones too) to the package's
modules, and checks:

* every import goes to the importer's own layer or a lower one (`LAYERS`, the
  order written once here and in README.md);
* no cycle between packages (a package is a top-level module or subpackage),
  and none between modules;
* `algorithms/` never imports `model/` (RL maths work on arrays);
* the repository's top-level packages import one way (`TOP_LEVEL`): `streamrl_jax`,
  then the pod planner `streamrl_podplan` (it plans with the package's programs, the
  package runs without it), then `streamrl_bench` (the benches' shared code);
* `learner/` (what is trained and what the loss reads) never imports `pipeline/`, and
  the pipeline reaches a target only through the learner's registry and protocol;
* inside `pipeline/`, the seams hold (`seam_violations`): the core imports a rollout
  kind only through the registry or the protocol, a kind imports the protocol and
  below, and the Rollout protocol reaches neither the endpoint nor the environments;
* no file of `tests/` (sub-folders too) imports a test module (`*_test`): shared test
  code lives in a support module (`tests/support.py`, `tests/child_env.py`,
  `tests/podplan/sim_schedules.py`)
  or a `conftest.py` fixture (STYLE.md "Tests mirror modules");
* and, run once: the entry point and the pipeline start without the endpoint's web
  server (its import is 2 s of each process's start-up).
"""

from __future__ import annotations

import ast
import collections
import os
import re

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(os.path.dirname(TESTS), "streamrl_jax")

# Lowest first. A package may import its own layer and the ones before it.
LAYERS = (
    ("errors", "lazy_names", "platforms", "config", "mailbox", "mesh", "sharding"),
    ("model", "algorithms"),
    ("generation", "trainer", "weight_sync"),
    (
        "stream",
        "scheduling",
        "rewards",
        "environments",
        "endpoint",
        "data",
        "checkpoint",
        "metrics",
        "console",
        "distributed",
    ),
    ("learner",),
    ("pipeline",),
    ("launch", "serve"),
)
FORBIDDEN = {("algorithms", "model")}  # (importer, imported) within a layer
# pipeline/'s own modules a rollout kind may import: what lies below the seams.
PIPELINE_BELOW_SEAMS = {
    "streamrl_jax.pipeline.micro_batches",
    "streamrl_jax.pipeline.prompts",
    "streamrl_jax.pipeline.schedules",
    "streamrl_jax.pipeline.shards",
    "streamrl_jax.pipeline.rollouts.protocol",
    # An episode played by a scaffold through the endpoint is an episode: `agents`
    # builds on the episodes wrapper (its held-out episodes, counts and metrics).
    "streamrl_jax.pipeline.rollouts.episodes",
}
ROLLOUTS = "streamrl_jax.pipeline.rollouts"
PROTOCOL = f"{ROLLOUTS}.protocol"
# What the registry hands the kinds that need it (`rollouts.Kits`): the Rollout protocol
# never reaches these, directly or through what it imports.
KITS = ("streamrl_jax.endpoint", "streamrl_jax.environments")
LEARNER = "streamrl_jax.learner"
# What the pipeline may import of learner/: the registry and the protocol, never a target.
# (and the environments' demonstrations, which the supervised warm-up trains on too).
LEARNER_SEAM = {LEARNER, f"{LEARNER}.protocol", f"{LEARNER}.learner", f"{LEARNER}.demonstrations"}
PROCESSES = "streamrl_jax.pipeline.processes"


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")]
                out[rel.replace(os.sep, ".").removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module `name` refers to (a module, or the module defining a name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("streamrl_jax"):
                target = _resolve(name)
                # A package's own __init__ is not an edge for its modules: Python runs it
                # first whatever they import, and it re-exports them.
                if target is not None and not (module + ".").startswith(target + "."):
                    found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "streamrl_jax"


def _layer(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"streamrl_jax/{unit} is in no layer of tests/layering_test.py")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_graph() -> dict[str, set[str]]:
    graph = collections.defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            if _unit(target) != _unit(module) and _unit(module) != "streamrl_jax":
                graph[_unit(module)].add(_unit(target))
    return graph


def test_the_parser_sees_the_imports():
    # A guard on the test itself: known edges are found, so an empty graph cannot pass.
    assert "streamrl_jax.config" in GRAPH["streamrl_jax.pipeline.lifecycle"]
    assert "streamrl_jax.pipeline.processes" in GRAPH["streamrl_jax.launch"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_every_package_is_in_a_layer():
    for module in MODULES:
        if _unit(module) != "streamrl_jax":
            _layer(_unit(module))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    unit = _unit(module)
    if unit == "streamrl_jax":
        return
    bad = []
    for target in sorted(GRAPH[module]):
        other = _unit(target)
        if other in (unit, "streamrl_jax"):
            continue
        if _layer(other) > _layer(unit):
            bad.append(f"{target} (layer {_layer(other)} above {unit}'s {_layer(unit)})")
        elif (unit, other) in FORBIDDEN:
            bad.append(f"{target} ({unit} must not import {other})")
    assert not bad, f"{module} imports upward or across a rule: {bad}"


def test_no_cycle_between_packages():
    assert _cycles(_package_graph()) == []


def test_no_cycle_between_modules():
    assert _cycles(GRAPH) == []


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reachable(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def seam_violations(graph: dict[str, set[str]]) -> list[str]:
    """The imports that break the pipeline's seam rules (module docstring)."""
    reached = _reachable(graph, PROTOCOL)
    bad = [
        f"{PROTOCOL} reaches {kit}: the registry hands the kinds their kits (rollouts.Kits)"
        for kit in KITS
        if any(_within(m, kit) for m in reached)
    ]
    for module, targets in sorted(graph.items()):
        if _within(module, LEARNER):
            bad += [
                f"{module} imports {target}: the learner never imports the pipeline"
                for target in sorted(targets)
                if _within(target, "streamrl_jax.pipeline")
            ]
        if not _within(module, "streamrl_jax.pipeline"):
            continue
        for target in sorted(targets):
            if _within(target, LEARNER) and target not in LEARNER_SEAM:
                bad.append(f"{module} imports the target {target}: use the learner registry")
            if not _within(module, PROCESSES) and _within(target, PROCESSES):
                bad.append(f"{module} imports {target}: the core never imports the processes")
            kind = _within(target, ROLLOUTS) and target not in (ROLLOUTS, f"{ROLLOUTS}.protocol")
            outside = not _within(module, ROLLOUTS) and not _within(module, PROCESSES)
            if kind and outside:
                bad.append(f"{module} imports the kind {target}: use the registry or protocol")
            in_kind = _within(module, ROLLOUTS) and module not in (ROLLOUTS, f"{ROLLOUTS}.protocol")
            pipeline = _within(target, "streamrl_jax.pipeline")
            if in_kind and pipeline and target not in PIPELINE_BELOW_SEAMS:
                bad.append(f"{module} imports {target}: a kind imports the protocol and below")
    return bad


def test_the_pipelines_seams_hold():
    assert seam_violations(GRAPH) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("streamrl_jax.pipeline.lifecycle", "streamrl_jax.pipeline.processes.training"),
        ("streamrl_jax.pipeline.trainer_loop", "streamrl_jax.pipeline.rollouts.partial"),
        ("streamrl_jax.pipeline.rollouts.curriculum", "streamrl_jax.pipeline.trainer_loop"),
        ("streamrl_jax.pipeline.rollouts.curriculum", "streamrl_jax.pipeline.rollouts.full"),
        ("streamrl_jax.pipeline.rollouts.protocol", "streamrl_jax.environments"),
        ("streamrl_jax.pipeline.rollouts.protocol", "streamrl_jax.endpoint.book"),
        # through a module it imports
        ("streamrl_jax.pipeline.micro_batches", "streamrl_jax.environments.render"),
        ("streamrl_jax.learner.critic", "streamrl_jax.pipeline.shards"),
        ("streamrl_jax.learner", "streamrl_jax.pipeline.components"),
        ("streamrl_jax.pipeline.trainer_loop", "streamrl_jax.learner.critic"),
    ],
)
def test_the_seam_rules_fail_on_an_injected_violation(importer, imported):
    injected = {m: set(t) for m, t in GRAPH.items()}
    injected[importer].add(imported)
    assert len(seam_violations(injected)) == 1


def _test_modules_imported(source: str, filename: str) -> set[str]:
    """The `*_test` modules `source` imports (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return {name for name in found if name.split(".")[0].endswith("_test")}


def test_no_test_file_imports_another_test_file():
    # A guard on the parser: both import forms are seen, inside functions too.
    probe = "from a_test import x\nimport os\ndef f():\n    import b_test\n"
    assert _test_modules_imported(probe, "probe") == {"a_test", "b_test"}
    bad = []
    for folder, _, files in os.walk(TESTS):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                imported = _test_modules_imported(f.read(), name)
            rel = os.path.relpath(path, os.path.dirname(TESTS))
            bad += [f"{rel} imports {m}" for m in sorted(imported)]
    assert not bad, f"shared test code belongs in a support module or conftest.py: {bad}"


# ---------------------------------------------------------------- top-level packages
# Top-level packages of the repository, lowest first: one may import those before it.
TOP_LEVEL = ("streamrl_jax", "streamrl_podplan", "streamrl_bench")


def _absolute_imports(path: str) -> set[str]:
    """The absolute module names a file imports (function-level imports too)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _files(top: str) -> dict[str, str]:
    """Path relative to the repository -> file, for every module of a top-level package."""
    root = os.path.join(os.path.dirname(TESTS), top)
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[os.path.relpath(path, os.path.dirname(TESTS))] = path
    return out


TOP_IMPORTS = {
    rel: _absolute_imports(path) for top in TOP_LEVEL for rel, path in _files(top).items()
}


def top_level_violations(imports: dict[str, set[str]]) -> list[str]:
    """The imports of a top-level package that go up `TOP_LEVEL`'s order."""
    bad = []
    for rel, names in sorted(imports.items()):
        mine = TOP_LEVEL.index(rel.split(os.sep)[0])
        for name in sorted(names):
            top = name.split(".")[0]
            if top in TOP_LEVEL and TOP_LEVEL.index(top) > mine:
                bad.append(f"{rel} imports {name}: {TOP_LEVEL[mine]} never imports {top}")
    return bad


def test_top_level_packages_import_one_way():
    # A guard on the walk: every package is read and a known downward edge is seen in each
    # above the first.
    for top in TOP_LEVEL[1:]:
        mine = {rel: names for rel, names in TOP_IMPORTS.items() if rel.startswith(top + os.sep)}
        assert mine, top
        assert any(n.startswith("streamrl_jax") for names in mine.values() for n in names)
    assert top_level_violations(TOP_IMPORTS) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        (os.path.join("streamrl_jax", "pipeline", "evaluation.py"), "streamrl_bench.curves"),
        (os.path.join("streamrl_jax", "checkpoint", "policy.py"), "streamrl_bench"),
        (os.path.join("streamrl_jax", "scheduling", "balance.py"), "streamrl_podplan.simulation"),
        (os.path.join("streamrl_jax", "trainer", "step.py"), "streamrl_podplan.programs.x"),
        (os.path.join("streamrl_podplan", "plan.py"), "streamrl_bench.curves"),
    ],
)
def test_the_top_level_rule_fails_on_an_injected_violation(importer, imported):
    injected = {rel: set(names) for rel, names in TOP_IMPORTS.items()}
    injected[importer].add(imported)
    assert len(top_level_violations(injected)) == 1


# Conditions that name an optional feature (issue 52's count): the core holds few, and
# the trainer loop, resume, the builders and the run's parts none on what is trained or
# what the loss reads (`learner/`), nor on an environment.
FEATURE = re.compile(
    r"lora|critic|teacher|route|environment|env\b|reference|\bref_|\btis\b|distill|episode"
    r"|adapter|endpoint|kl_coef|value",
    re.I,
)
FEATURE_BRANCH_BUDGET = 16  # in the top-level pipeline/*.py modules
NO_TARGET_BRANCH = ("trainer_loop.py", "resume.py", "components.py", "parts.py")
NO_TARGET_WORDS = re.compile(r"critic|teacher|lora|route|environment|reference|distill", re.I)


def feature_conditions(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, condition) of every `if`/`while`/conditional expression/comprehension
    filter in `source` whose condition names an optional feature (`FEATURE`)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        else:
            continue
        for test in tests:
            text = ast.get_source_segment(source, test) or ""
            if FEATURE.search(text):
                out.append((test.lineno, text))
    return out


def test_the_core_branches_on_few_optional_features():
    # A guard on the counter: each condition form is seen, a plain one is not.
    probe = (
        "if c.critic is not None:\n    pass\nx = 1 if lora else 2\n"
        "y = [a for a in b if a.teacher]\nwhile not routes:\n    pass\nif n > 0:\n    pass\n"
    )
    assert sorted(line for line, _ in feature_conditions(probe, "probe")) == [1, 3, 4, 5]
    pipeline = os.path.join(ROOT, "pipeline")
    found = {}
    for name in sorted(os.listdir(pipeline)):
        if name.endswith(".py"):
            with open(os.path.join(pipeline, name), encoding="utf-8") as f:
                found[name] = feature_conditions(f.read(), name)
    total = sum(len(c) for c in found.values())
    listing = [f"pipeline/{n}:{line}: {text}" for n, c in found.items() for line, text in c]
    assert total <= FEATURE_BRANCH_BUDGET, f"{total} optional-feature branches: {listing}"
    targeted = [
        f"pipeline/{n}:{line}: {text}"
        for n in NO_TARGET_BRANCH
        for line, text in found[n]
        if NO_TARGET_WORDS.search(text)
    ]
    assert not targeted, f"branches on what is trained or read, outside learner/: {targeted}"


def test_a_run_without_agents_does_not_import_the_web_server():
    # The entry point and the pipeline import the endpoint's server (fastapi, starlette,
    # pydantic, httpx: 2 s of each process's start-up, measured 7.0 -> 5.1 s) only where a
    # run builds an agent kit or serves: every process of a run without agents starts
    # without them.
    import subprocess
    import sys

    heavy = ("fastapi", "starlette", "uvicorn", "streamrl_jax.endpoint.server")
    code = (
        "import sys, streamrl_jax.launch, streamrl_jax.pipeline\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
