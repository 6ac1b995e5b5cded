"""Tests for actor.py: every vector under vectors/ as its own case, plus unit tests.

Sections mirror actor.py's banners. Run: `pytest -q` (benchmarks: `pytest -m bench -s`).
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actor  # noqa: E402

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared"


# =====================================================================================
# The vector suite (foundation)
# =====================================================================================
VECTOR_DIR = HERE / "vectors"
VECTOR_FILES = actor.collect_vector_files([VECTOR_DIR])


def _vector_id(path):
    return path.stem


@pytest.mark.parametrize("path", VECTOR_FILES, ids=_vector_id)
def test_vector(path):
    vector = actor.read_vector(path)
    errors, _ = actor.lint_vector(vector, path.stem)
    assert not errors, errors
    failures = actor.judge_vector(vector, actor.observe_vector(vector))
    assert not failures, "\n".join(
        f"step {s} ({a}) {f}: expect {e!r} got {g!r}" for s, a, f, e, g in failures)


def _spec_headings():
    text = (SHARED / "spec" / "actor-configuration-standard.md").read_text(encoding="utf-8")
    import re
    return set(re.findall(r"^(\d+(?:\.\d+)*)\.? ", text, flags=re.M))


def test_vector_suite_lint():
    """Names unique and equal to stems; descriptions present tense, short, no 'should'; real
    sections; every step asserts something; no unknown keys."""
    headings = _spec_headings() if (SHARED / "spec").exists() else None
    names = {}
    problems = []
    for path in VECTOR_FILES:
        vector = actor.read_vector(path)
        errors, warnings = actor.lint_vector(vector, path.stem)
        problems += [f"{path}: {e}" for e in errors + warnings]
        name = vector.get("name")
        if name in names:
            problems.append(f"{path}: name '{name}' also used by {names[name]}")
        names[name] = path
        desc = vector.get("description") or ""
        if len(desc) >= 150 or "should" in desc.lower():
            problems.append(f"{path}: description must be under 150 chars without 'should'")
        for section in vector.get("spec") or []:
            if headings is not None and str(section) not in headings:
                problems.append(f"{path}: spec section {section} is not a heading of the standard")
        for i, step in enumerate(vector.get("steps") or []):
            if not any(k in step for k in actor.STEP_CHECKS):
                problems.append(f"{path}: steps[{i}] asserts nothing")
    assert not problems, "\n".join(problems)


def test_impl_protocol_agrees_with_in_process(tmp_path):
    """--impl "python actor.py --run-vector" passes exactly what --vectors passes (sampled)."""
    import io
    sample = [p for p in VECTOR_FILES if p.parent.name in ("03-document", "14-env")][:12]
    assert sample
    out_a, out_b = io.StringIO(), io.StringIO()
    a = actor.run_vectors(sample, out=out_a)
    b = actor.run_vectors(sample, impl=f'"{sys.executable}" "{HERE / "actor.py"}" --run-vector',
                          out=out_b)
    assert a == b, out_a.getvalue() + out_b.getvalue()


def test_judge_deep_subset_rules():
    assert actor.subset({"a": 1}, {"a": 1.0, "b": 2})
    assert not actor.subset({"a": "1"}, {"a": 1})
    assert not actor.subset({"a": True}, {"a": "true"})
    assert not actor.subset({"a": True}, {"a": 1})
    assert not actor.subset([1, 2], [1, 2, 3])
    assert actor.subset([{"x": 1}], [{"x": 1, "y": 2}])
    assert actor.same([], [])
    assert not actor.same([], ["x"])


def test_harness_reports_failures_and_summary(tmp_path):
    import io
    bad = tmp_path / "bad-expectation.yaml"
    bad.write_text((VECTOR_DIR / "03-document" / "minimal-valid-actor.yaml").read_text()
                   .replace("name: minimal-valid-actor", "name: bad-expectation")
                   .replace("ChainAgent processed: hi->tagged", "something else"))
    out = io.StringIO()
    assert actor.run_vectors([bad], out=out) == (0, 1)
    text = out.getvalue()
    assert "FAIL" in text and "step 1 (send)" in text and text.rstrip().endswith("0 passed, 1 failed")


# =====================================================================================
# §3 DOCUMENT STRUCTURE, §11, §14, §15, §16 (foundation)
# =====================================================================================
def test_map_matches_banners():
    """The module docstring's Map lists every top-level banner, in file order."""
    import re
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    banners = re.findall(r"^# (§\d+ [A-Z][A-Z ,/&-]+|HOST -- [^\n]+|PRELUDE[^\n]*)$", src, flags=re.M)
    doc_map = actor.__doc__.split("Map", 1)[1]
    listed = [line.strip() for line in doc_map.splitlines() if line.startswith("    ") and line.strip()]
    tops = [b for b in banners if b.startswith("§")]
    assert [l for l in listed if l.startswith("§")] == [t.strip() for t in tops]


def test_every_cited_section_exists():
    import re
    if not (SHARED / "spec").exists():
        pytest.skip("the standard is not beside the project")
    headings = _spec_headings()
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    cited = set(re.findall(r"§(\d+(?:\.\d+)*)", src))
    missing = sorted(c for c in cited if c not in headings and c.split(".")[0] not in ("0",))
    assert not missing, missing


def test_yaml_pure_and_c_loaders_agree():
    text = "a: yes\nb: 010\nc: [1.5, .inf, ~, 0x10, 0o7, '010', \"yes\"]\nd: {e: TRUE, f: Null}\n"
    fast = actor.parse_yaml(text, "x.yaml")

    class Pure(yaml_module().SafeLoader):
        yaml_implicit_resolvers = actor.Yaml12Loader.yaml_implicit_resolvers

    saved = actor.Yaml12Loader
    try:
        actor.Yaml12Loader = Pure
        slow = actor.parse_yaml(text, "x.yaml")
    finally:
        actor.Yaml12Loader = saved
    assert fast[0] == slow[0] == {"a": "yes", "b": 10, "c": [1.5, float("inf"), None, 16, 7, "010",
                                                             "yes"], "d": {"e": True, "f": None}}


def yaml_module():
    import yaml
    return yaml


def test_errors_are_located_with_file_line_and_section(tmp_path):
    cfg = tmp_path / "team.yaml"
    cfg.write_text("agents:\n  tag:\n    type: chain\nroutes:\n  main:\n    type: stream\n"
                   "    publications: [__output__, nowhere]\n")
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(cfg)
    err = info.value
    assert (err.file, err.line, err.col) == (str(cfg), 7, 32)
    assert err.path == "routes.main.publications[1]" and "11.3" in err.section
    assert str(err).startswith(f"{cfg}:7:32: ConfigurationError: routes.main.publications[1]: ")


def test_missing_env_variable_error_names_it():
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text="agents: {a: {type: chain, config: {steps: ['${NOPE_X}']}}}\n"
                        "routes: {m: {type: stream}}\n", env={})
    assert "NOPE_X" in str(info.value) and info.value.line == 1


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("ACTOR_TEST_STEP", "fromenv")
    a = actor.load(text="agents: {a: {type: chain, config: {steps: ['${ACTOR_TEST_STEP}']}}}\n"
                        "routes: {m: {type: stream, operators: [{type: map, params: {agent: a}}],"
                        " publications: [__output__]}}\nmerges: [{sources: [__input__], target: m}]\n")
    assert [m.content for m in a.send("x").outputs] == ["ChainAgent processed: x->fromenv"]


def test_unknown_top_level_section_warns(caplog):
    a = actor.load(text="agents: {a: {type: chain}}\nroutes: {m: {type: stream}}\nodd: 1\n")
    assert any("unknown top-level section 'odd'" in w and "§3.2" in w for w in a.rt.warnings)


def test_lifecycle_validates_before_creating_agents(monkeypatch):
    """§1.3(2), §12.1: a validation error is reported before any agent is constructed."""
    created = []
    monkeypatch.setitem(actor.AGENT_TYPES, "chain", lambda *a: created.append(a))
    with pytest.raises(actor.ConfigurationError):
        actor.load(text="agents: {a: {type: chain}}\nroutes: {m: {type: stream, "
                        "publications: [ghost]}}\n")
    assert created == []


def test_deep_merge_marks_point_at_the_later_file(tmp_path):
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text("agents: {a: {type: chain}}\nroutes: {m: {type: stream}}\n"
                   "merges: [{sources: [__input__], target: m}]\n")
    two.write_text("merges:\n  - sources: [ghost]\n    target: m\n")
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(one, two)
    assert info.value.file == str(two) and info.value.path == "merges[1].sources[0]"


def run_cli(*args, stdin=""):
    import subprocess
    return subprocess.run([sys.executable, str(HERE / "actor.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_cli_check_ok_and_config_error(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("agents: {a: {type: chain}}\nroutes: {m: {type: stream}}\n")
    r = run_cli("--check", str(good))
    assert (r.returncode, r.stdout.strip()) == (0, "ok")
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: {a: {type: chain}}\n")
    r = run_cli("--check", str(bad))
    assert r.returncode == 2 and "ConfigurationError" in r.stderr and "Traceback" not in r.stderr


def test_cli_messages_and_stdin_lines(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("agents: {a: {type: chain, config: {steps: [s]}}}\nroutes: {m: {type: stream, "
                   "operators: [{type: map, params: {agent: a}}], publications: [__output__]}}\n"
                   "merges: [{sources: [__input__], target: m}]\n")
    r = run_cli(str(cfg), "-m", "one", "-m", "two")
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "ChainAgent processed: one->s", "ChainAgent processed: two->s"]
    r = run_cli(str(cfg), "--json", stdin="x\ny\n")
    import json
    lines = [json.loads(l) for l in r.stdout.splitlines()]
    assert [l["content"] for l in lines] == ["ChainAgent processed: x->s", "ChainAgent processed: y->s"]


def test_cli_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and actor.SPEC_VERSION in r.stdout
    assert run_cli("--help").returncode == 0


# =====================================================================================
# §4.4 LLM agents and HOST providers (llm)
# =====================================================================================
# [llm]


# =====================================================================================
# §4.5 Tool agents, §13.3, §13.5 (tools)
# =====================================================================================
# [tools]


# =====================================================================================
# §5, §7, §12.2 Streams (streams)
# =====================================================================================
# [streams]


# =====================================================================================
# §6 Graph routes (graphs)
# =====================================================================================
# [graphs] Unit tests build a Runtime by hand with small fake agents (no loader needed); the
# vectors under vectors/06-graph and vectors/18-examples run through the shared harness.
import json  # noqa: E402
import re  # noqa: E402

class FakeAgent:
    """An agent whose reply is fn(content, ctx); records every call."""

    def __init__(self, name, fn):
        self.name, self.type, self.fn = name, "tool", fn
        self.capabilities, self.metadata, self.calls = [], {"name": name}, []

    def invoke(self, content, ctx):
        self.calls.append((content, dict(ctx)))
        return self.fn(content, ctx)


def make_graph(cfg, agents=None, *, context=None, workdir=None, routes=None, name="main"):
    """(rt, GraphRoute) for one graph route `cfg` with fake agents {name: fn}."""
    agents = agents or {}
    data = {"agents": {a: {"type": "tool"} for a in agents}, "routes": {name: cfg, **(routes or {})}}
    rt = actor.Runtime(actor.Doc(data), env={}, workdir=workdir)
    rt.agents = {a: FakeAgent(a, fn) for a, fn in agents.items()}
    rt.context.update(context or {})
    graph = actor.GraphRoute(name, cfg, rt, ("routes", name))
    rt.graphs[name] = graph
    return rt, graph


def linear(*names, **node_extra):
    """A start -> n1 -> ... -> end graph of agent nodes named after their agents."""
    nodes = {n: {"type": "agent", "agent": n, **node_extra.get(n, {})} for n in names}
    chain = ["start", *names, "end"]
    edges = [{"source": a, "target": b} for a, b in zip(chain, chain[1:])]
    return {"type": "graph", "nodes": nodes, "edges": edges}


def echo(tag):
    return lambda content, ctx: f"{tag}({content})"


def check_fails(cfg, agents=("a",), routes=None):
    data = {"agents": {a: {"type": "tool"} for a in agents}, "routes": {"main": cfg, **(routes or {})}}
    doc = actor.Doc(data)
    with pytest.raises(actor.ConfigurationError) as info:
        actor.check_graph(doc, "main", cfg, ("routes", "main"), set(agents))
    return info.value


# §6.1 Graph route structure ----------------------------------------------------------------
def test_graph_linear_run_passes_each_output_on():
    rt, g = make_graph(linear("a", "b"), {"a": echo("a"), "b": echo("b")})
    run = g.run("x")
    assert run.output == "b(a(x))"
    assert run.history == ["a", "b"]
    assert [m["role"] for m in run.state["messages"]] == ["user", "assistant", "assistant"]
    assert run.state["execution_count"] == 2


def test_graph_entry_point_may_be_a_declared_node():
    cfg = linear("a", "b")
    cfg["entry_point"] = "b"
    rt, g = make_graph(cfg, {"a": echo("a"), "b": echo("b")})
    assert g.run("x").output == "b(x)"


def test_graph_unknown_keys_warn():
    cfg = linear("a")
    cfg["colour"] = "red"
    rt, g = make_graph(cfg, {"a": echo("a")})
    assert any("colour" in w for w in rt.warnings)


# §6.2 Nodes ----------------------------------------------------------------------------------
def test_graph_node_types_are_case_insensitive():
    cfg = linear("a")
    cfg["nodes"]["a"]["type"] = "AGENT"
    rt, g = make_graph(cfg, {"a": echo("a")})
    assert g.run("x").output == "a(x)"


def test_graph_check_rejects_dangling_edge_target_with_location():
    cfg = linear("a")
    cfg["edges"][1]["target"] = "fnial"
    err = check_fails(cfg)
    assert err.path == "routes.main.edges[1].target"
    assert "fnial" in err.message and "6.4" in err.section


@pytest.mark.parametrize("mutate, where", [
    (lambda c: c["nodes"]["a"].update(agent="ghost"), "routes.main.nodes.a.agent"),
    (lambda c: c["nodes"]["a"].update(type="dynamic_router"), "routes.main.nodes.a.type"),
    (lambda c: c["nodes"]["a"].update(type="teleport"), "routes.main.nodes.a.type"),
    (lambda c: c.update(nodes={}), "routes.main.nodes"),
    (lambda c: c.update(entry_point="nowhere"), "routes.main.entry_point"),
    (lambda c: c.update(checkpointing=True), "routes.main.checkpoint_dir"),
    (lambda c: c["edges"][0].update(source="ghost"), "routes.main.edges[0].source"),
    (lambda c: c["nodes"].update(start={"type": "agent", "agent": "a"}), "routes.main.nodes.start"),
    (lambda c: c["nodes"].update(r={"type": "message_router", "rules": [
        {"match_type": "regex", "pattern": "(", "target": "a"}]}),
     "routes.main.nodes.r.rules[0].pattern"),
    (lambda c: c["nodes"].update(r={"type": "message_router", "rules": [
        {"match_type": "glob", "pattern": "x", "target": "a"}]}),
     "routes.main.nodes.r.rules[0].match_type"),
    (lambda c: c["nodes"].update(r={"type": "message_router", "rules": [
        {"match_type": "exact", "pattern": "x", "target": "nope"}]}),
     "routes.main.nodes.r.rules[0].target"),
    (lambda c: c["nodes"].update(s={"type": "subgraph", "graph": "missing"}),
     "routes.main.nodes.s.graph"),
    (lambda c: c["nodes"]["a"].update(retry_policy={"max_retries": -1}),
     "routes.main.nodes.a.retry_policy.max_retries"),
])
def test_graph_check_rejects(mutate, where):
    cfg = linear("a")
    mutate(cfg)
    assert check_fails(cfg).path == where


def test_graph_start_end_normalisation_and_declared_start():
    cfg = linear("a")
    cfg["edges"] = [{"source": "START", "target": "a"}, {"source": "a", "target": "END"}]
    cfg["nodes"]["START"] = {"type": "start"}
    rt, g = make_graph(cfg, {"a": echo("a")})
    assert g.run("x").output == "a(x)"
    assert list(g.nodes) == ["start", "a", "end"]


# §6.2.2 Agent nodes ----------------------------------------------------------------------
def test_graph_agent_node_context_is_built_per_6_2_2():
    cfg = linear("a", a={"metadata": {"max_history_messages": 2}})
    seen = {}

    def agent(content, ctx):
        seen.update(ctx)
        ctx["mood"] = "good"                 # propagated
        ctx["full_context"] = "tampered"     # reserved: not propagated
        return "ok"

    rt, g = make_graph(cfg, {"a": agent}, context={"user": "ada"})
    g.state["metadata"]["topic"] = "t"
    g.state["messages"].extend({"role": "user", "content": str(i)} for i in range(3))
    g.run("hello")
    assert seen["full_context"] is True
    assert seen["user"] == "ada" and seen["topic"] == "t"          # nested flattened + top level
    assert [m["content"] for m in seen["conversation_history"]] == ["1", "2"]   # input excluded
    assert seen["graph_state"]["messages"] == seen["conversation_history"]
    assert seen["_history_truncated"] is True and seen["_history_original_length"] == 3
    meta = g.state["metadata"]
    assert meta["mood"] == "good" and meta["last_agent_node"] == "a"
    assert "full_context" not in meta and "graph_state" not in meta
    assert rt.context["mood"] == "good"                            # §6.9 write-back


def test_graph_history_trimmed_by_chars():
    cfg = linear("a", a={"metadata": {"max_history_chars": 5}})
    seen = {}
    rt, g = make_graph(cfg, {"a": lambda c, ctx: seen.update(ctx) or "ok"})
    g.state["messages"].extend([{"role": "user", "content": "abcd"}, {"role": "user", "content": "ef"}])
    g.run("xyz")
    assert [m["content"] for m in seen["conversation_history"]] == ["ef"]
    assert seen["_history_original_length"] == 2


def test_graph_agent_retry_policy_retries_raised_errors():
    attempts = []

    def flaky(content, ctx):
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("boom")
        return "fine"

    rt, g = make_graph(linear("a", a={"retry_policy": {"max_retries": 2, "delay": 0}}),
                       {"a": flaky})
    assert g.run("x").output == "fine" and len(attempts) == 3


def test_graph_agent_failure_after_retries_sets_state_error():
    rt, g = make_graph(linear("a", a={"retry_policy": {"max_retries": 1, "delay": 0}}),
                       {"a": lambda c, ctx: 1 / 0})
    with pytest.raises(actor.ExecutionError):
        g.run("x")
    assert "division" in g.state["error"]


def test_graph_agent_timeout_is_per_attempt():
    import time as _time
    rt, g = make_graph(linear("a", a={"timeout": 0.05}),
                       {"a": lambda c, ctx: _time.sleep(0.3) or "late"})
    started = _time.monotonic()
    with pytest.raises(actor.ExecutionError, match="timed out"):
        g.run("x")
    assert _time.monotonic() - started < 0.25


# §6.2.3 Function and tool nodes; §6.2.4; §6.2.5 ----------------------------------------------
def test_graph_function_tool_conditional_subgraph_nodes():
    cfg = {"type": "graph", "nodes": {
        "s": {"type": "function", "function": "summarize"},
        "r": {"type": "function", "function": "route"},
        "v": {"type": "function", "function": "validate"},
        "u": {"type": "function", "function": "no_such_function"},
        "t": {"type": "tool", "tools": ["search", "calc"]},
        "c": {"type": "conditional", "condition": {"type": "message_count", "value": 1,
                                                   "operator": "eq"}},
        "g": {"type": "subgraph", "graph": "other"}},
        "edges": [{"source": a, "target": b} for a, b in zip(
            ["start", "s", "r", "v", "u", "t", "c", "g"], ["s", "r", "v", "u", "t", "c", "g", "end"])]}
    other = linear("a")
    rt, g = make_graph(cfg, {"a": echo("a")}, routes={"other": other})
    run = g.run("is it?")
    meta = run.state["metadata"]
    assert run.output == "is it?"
    assert meta["summary"] == "Summary of 1 messages"
    assert meta["route"] == "question" and meta["valid"] is True
    assert meta["tool_results"] == [{"tool": "search", "result": "Executed search"},
                                    {"tool": "calc", "result": "Executed calc"}]
    assert meta["condition_result"] is True
    assert meta["subgraph"] == "other" and meta["subgraph_pending"] is True
    assert run.state["execution_count"] == 7


# §6.2.6 Message router nodes ----------------------------------------------------------------
@pytest.mark.parametrize("rule, text, target, extracted", [
    ({"match_type": "prefix", "pattern": "CODE"}, "CODE:fix it", "x", "fix it"),
    ({"match_type": "prefix", "pattern": "CODE"}, "CODEfix", "x", "fix"),
    ({"match_type": "prefix", "pattern": "CODE", "extract_message": False}, "CODE:a", "x", "CODE:a"),
    ({"match_type": "suffix", "pattern": "!!"}, "hey!!", "x", "hey"),
    ({"match_type": "suffix", "pattern": ""}, "hey", "x", "hey"),
    ({"match_type": "contains", "pattern": "TO"}, "say TO:bob", "x", "bob"),
    ({"match_type": "contains", "pattern": "TO", "separator": "="}, "a TO b", "x", "a TO b"),
    ({"match_type": "regex", "pattern": r"id=(\d+)"}, "user id=42 now", "x", "42"),
    ({"match_type": "regex", "pattern": r"id=\d+"}, "user id=42 now", "x", "user id=42 now"),
    ({"match_type": "exact", "pattern": "stop"}, "stop", "x", ""),
    ({"match_type": "exact", "pattern": "stop"}, "stop now", "y", "stop now"),
])
def test_graph_router_match_types(rule, text, target, extracted):
    cfg = {"type": "graph", "nodes": {
        "r": {"type": "message_router", "rules": [{**rule, "target": "x"}]},
        "x": {"type": "agent", "agent": "x"}, "y": {"type": "agent", "agent": "y"}},
        "edges": [{"source": "start", "target": "r"},
                  {"source": "r", "target": "x",
                   "condition": {"type": "context_value", "key": "next_node", "value": "x"}},
                  {"source": "r", "target": "y"},
                  {"source": "x", "target": "end"}, {"source": "y", "target": "end"}]}
    rt, g = make_graph(cfg, {"x": echo("x"), "y": echo("y")})
    run = g.run(text)
    if target == "x":
        assert rt.agents["x"].calls[0][0] == extracted
        assert run.history == ["r", "x", "y"]        # the unconditional edge is taken too
        assert run.state["metadata"]["next_node"] == "x"
    else:
        assert run.output == f"y({text})" and run.history == ["r", "y"]
        assert "next_node" not in run.state["metadata"]


def test_graph_router_first_match_wins_and_sets_state():
    cfg = {"type": "graph", "nodes": {
        "r": {"type": "message_router", "rules": [
            {"match_type": "contains", "pattern": "a", "target": "one", "set_state": {"k": {"x": 1}}},
            {"match_type": "contains", "pattern": "a", "target": "two", "set_state": {"j": 2}}]},
        "one": {"type": "agent", "agent": "one"}, "two": {"type": "agent", "agent": "two"}},
        "edges": [{"source": "start", "target": "r"},
                  {"source": "r", "target": "one",
                   "condition": {"type": "context_value", "key": "next_node", "value": "one"}},
                  {"source": "r", "target": "two",
                   "condition": {"type": "context_value", "key": "next_node", "value": "two"}},
                  {"source": "one", "target": "end"}, {"source": "two", "target": "end"}]}
    rt, g = make_graph(cfg, {"one": echo("1"), "two": echo("2")})
    run = g.run("banana")
    assert run.history == ["r", "one"]
    assert run.state["metadata"]["k"] == {"x": 1} and "j" not in run.state["metadata"]
    assert run.state["messages"][0]["content"] == "banana"    # extraction edits the last message
    assert g.state["metadata"]["next_node"] == "one"


# §6.3 Graph state ----------------------------------------------------------------------------
def test_graph_state_messages_capped_at_50():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    for i in range(30):
        g.run(str(i))
    assert len(g.state["messages"]) == 50
    assert g.state["messages"][-1]["content"] == "a(29)"


@pytest.mark.parametrize("mode, update, field, expected", [
    ("merge", {"metadata": {"d": {"y": 2}, "l": [2]}}, "metadata", {"d": {"x": 1, "y": 2}, "l": [1, 2]}),
    ("replace", {"metadata": {"d": {"y": 2}}}, "metadata", {"d": {"y": 2}}),
    ("append", {"messages": {"role": "user", "content": "m"}}, "messages",
     [{"role": "user", "content": "m"}]),
    ("merge", {"colour": "red"}, "metadata", {"d": {"x": 1}, "l": [1], "colour": "red"}),
])
def test_graph_state_update_modes(mode, update, field, expected):
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    g.state["metadata"].update({"d": {"x": 1}, "l": [1]})
    g.update_state(update, mode)
    assert g.state[field] == expected
    assert g.state["execution_count"] == 1


def test_graph_state_update_caps_messages_under_replace():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    g.update_state({"messages": [{"role": "user", "content": i} for i in range(60)]}, "replace")
    assert len(g.state["messages"]) == 50 and g.state["messages"][0]["content"] == 10


def test_graph_state_update_from_text():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    g.update_state('{"metadata": {"k": 1}}')
    g.update_state("plain words")
    assert g.state["metadata"]["k"] == 1
    assert g.state["messages"][-1] == {"role": "user", "content": "plain words"}


def test_graph_unknown_state_class_falls_back_with_warning():
    cfg = linear("a")
    cfg["state_class"] = "my.Schema"
    rt, g = make_graph(cfg, {"a": echo("a")})
    assert set(g.state) == {"messages", "metadata", "current_node", "execution_count", "error"}
    assert any("my.Schema" in w for w in rt.warnings)


# §6.5 Edge conditions -------------------------------------------------------------------------
def test_graph_fan_out_runs_every_satisfied_edge_before_end():
    cfg = {"type": "graph", "nodes": {n: {"type": "agent", "agent": n} for n in "abc"},
           "edges": [{"source": "start", "target": "a"}, {"source": "a", "target": "end"},
                     {"source": "a", "target": "b"}, {"source": "a", "target": "c"},
                     {"source": "b", "target": "end"}, {"source": "c", "target": "end"}]}
    rt, g = make_graph(cfg, {n: echo(n) for n in "abc"})
    run = g.run("x")
    assert run.history == ["a", "b", "c"] and run.output == "c(a(x))"


def test_graph_context_value_reads_nested_context_with_deep_equality():
    cfg = linear("a", "b")
    cfg["edges"][1]["condition"] = {"type": "context_value", "key": "tags", "value": ["x", {"y": 1}]}
    rt, g = make_graph(cfg, {"a": echo("a"), "b": echo("b")}, context={"tags": ["x", {"y": 1}]})
    assert g.run("m").history == ["a", "b"]
    rt.context["tags"] = ["x"]
    assert g.run("n").history == ["a"]


# §6.6 Checkpointing and time travel ----------------------------------------------------------
def test_graph_checkpoint_every_ten_updates_and_restore(tmp_path):
    cfg = linear(*[f"n{i}" for i in range(4)])
    cfg.update(checkpointing=True, checkpoint_dir="ck/main")
    rt, g = make_graph(cfg, {f"n{i}": echo(str(i)) for i in range(4)}, workdir=tmp_path)
    assert (tmp_path / "ck/main").is_dir()
    g.run("a"), g.run("b")                       # 8 updates: none yet
    assert g.checkpoints() == []
    g.run("c")                                   # updates 9..12: one checkpoint at 10
    files = g.checkpoints()
    assert len(files) == 1 and re.fullmatch(r"checkpoint_\d{8}T\d{6}\.\d{6}Z-\d{6}\.json",
                                            files[0].name)
    assert json.loads(files[0].read_text())["execution_count"] == 10
    g.run("d"), g.run("e")                       # 20
    assert len(g.checkpoints()) == 2 and g.checkpoints()[-1].name > files[0].name
    assert not list((tmp_path / "ck/main").glob(".*"))          # no temp file left behind
    g.restore(files[0])
    assert g.state["execution_count"] == 10
    g.restore()
    assert g.state["execution_count"] == 20
    assert g.checkpoint().name > g.checkpoints()[-2].name


def test_graph_time_travel_rewinds_and_evicts_fifo():
    cfg = linear("a")
    cfg["enable_time_travel"] = True
    rt, g = make_graph(cfg, {"a": echo("a")})
    for i in range(120):
        g.run(str(i))
    assert len(g.snapshots) == 100 and g.snapshots[0]["execution_count"] == 21
    g.rewind(3)
    assert g.state["execution_count"] == 117
    assert g.state["messages"][-1]["content"] == "a(116)"
    with pytest.raises(actor.ApplicationError):
        g.rewind(500)


def test_graph_rewind_needs_time_travel():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    with pytest.raises(actor.ApplicationError):
        g.rewind(1)


KILL_SCRIPT = r'''
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import actor
class Agent:
    def __init__(self, name): self.name, self.type, self.capabilities, self.metadata = name, "tool", [], {}
    def invoke(self, content, ctx):
        if self.name == "n14" and sys.argv[3] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return content + "+" + self.name
names = [f"n{i}" for i in range(20)]
chain = ["start", *names, "end"]
cfg = {"type": "graph", "checkpointing": True, "checkpoint_dir": "ck",
       "nodes": {n: {"type": "agent", "agent": n} for n in names},
       "edges": [{"source": a, "target": b} for a, b in zip(chain, chain[1:])]}
rt = actor.Runtime(actor.Doc({"agents": {n: {"type": "tool"} for n in names}, "routes": {"g": cfg}}),
                   env={}, workdir=sys.argv[2])
rt.agents = {n: Agent(n) for n in names}
graph = actor.GraphRoute("g", cfg, rt)
if sys.argv[3] == "kill":
    graph.run("go")
else:
    path = graph.restore()
    print(path.name, graph.state["execution_count"], graph.state["current_node"])
    run = graph.resume()
    print(run.output)
    print(",".join(run.history))
'''


def test_graph_kill_and_restore_resumes_from_last_checkpoint(tmp_path):
    import subprocess
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    killed = subprocess.run([sys.executable, str(script), str(HERE), str(tmp_path), "kill"],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode != 0                       # died mid-run at node n14
    assert len(list((tmp_path / "ck").glob("checkpoint_*.json"))) == 1
    resumed = subprocess.run([sys.executable, str(script), str(HERE), str(tmp_path), "resume"],
                             capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    first, output, history = resumed.stdout.splitlines()
    assert first.endswith(" 10 n9")
    assert output == "go" + "".join(f"+n{i}" for i in range(20))
    assert history == ",".join(f"n{i}" for i in range(10, 20))


# §6.7 Parallel execution -----------------------------------------------------------------------
def _fan_out(parallel_execution, parallel=True):
    import time as _time
    cfg = {"type": "graph", "parallel_execution": parallel_execution,
           "nodes": {n: {"type": "agent", "agent": n, "parallel": parallel} for n in ("p", "q")},
           "edges": [{"source": "start", "target": "p"}, {"source": "start", "target": "q"},
                     {"source": "p", "target": "end"}, {"source": "q", "target": "end"}]}
    slow = lambda tag: (lambda c, ctx: _time.sleep(0.2) or f"{tag}:{c}")
    rt, g = make_graph(cfg, {"p": slow("p"), "q": slow("q")})
    started = _time.monotonic()
    run = g.run("x")
    return _time.monotonic() - started, run


def test_graph_parallel_nodes_run_concurrently_and_join_in_order():
    elapsed, run = _fan_out(True)
    assert elapsed < 0.35
    assert run.history == ["p", "q"] and run.output == "q:x"
    assert [m["content"] for m in run.state["messages"][-2:]] == ["p:x", "q:x"]


def test_graph_parallel_execution_false_is_sequential():
    elapsed, run = _fan_out(False)
    assert elapsed >= 0.38 and run.history == ["p", "q"]


def test_graph_nodes_without_parallel_flag_are_sequential():
    elapsed, run = _fan_out(True, parallel=False)
    assert elapsed >= 0.38


# §6.8 Loop and cycle detection ------------------------------------------------------------------
def _loop(agent_fn, context=None, extra_nodes=0):
    cfg = {"type": "graph", "nodes": {"a": {"type": "agent", "agent": "a"}},
           "edges": [{"source": "start", "target": "a"}, {"source": "a", "target": "a"}]}
    return make_graph(cfg, {"a": agent_fn}, context=context)


def test_graph_guard_revisit_stops_on_same_fingerprint():
    rt, g = _loop(lambda c, ctx: "same")
    run = g.run("x")
    assert run.stopped == "revisit" and run.history == ["a", "a"] and run.output == "same"


def test_graph_guard_fingerprint_is_first_200_chars():
    counter = iter(range(10 ** 6))
    rt, g = _loop(lambda c, ctx: "p" * 200 + str(next(counter)))
    run = g.run("x")
    assert run.stopped == "revisit" and len(run.history) == 2 and run.output.endswith("p1")


def test_graph_guard_recursion_bound_warns_and_returns_latest_output():
    counter = iter(range(10 ** 6))
    rt, g = _loop(lambda c, ctx: str(next(counter)))
    run = g.run("x")
    assert run.stopped == "recursion" and len(run.history) == 2000 and run.output == "1999"
    assert any("recursion" in w for w in rt.warnings)


def test_graph_guard_auto_finish_active_relaxes_revisit():
    rt, g = _loop(lambda c, ctx: "same", context={"auto_finish_active": True})
    run = g.run("x")
    assert run.stopped == "recursion" and len(run.history) == 2000


def _ping_pong(reply, context=None):
    cfg = {"type": "graph", "nodes": {
        "r": {"type": "message_router", "rules": [
            {"match_type": "prefix", "pattern": "GOTO_A", "target": "a"}]},
        "a": {"type": "agent", "agent": "a"}},
        "edges": [{"source": "start", "target": "r"},
                  {"source": "r", "target": "a",
                   "condition": {"type": "context_value", "key": "next_node", "value": "a"}},
                  {"source": "a", "target": "r"}]}
    return make_graph(cfg, {"a": reply}, context=context)


def test_graph_guard_router_ping_pong_stops():
    counter = iter(range(100))
    rt, g = _ping_pong(lambda c, ctx: f"GOTO_A:{next(counter)}")
    run = g.run("GOTO_A:start")
    assert run.stopped == "ping-pong" and run.history == ["r", "a", "r", "a"]
    assert run.output == "GOTO_A:1"


def test_graph_guard_agent_return_without_routing():
    rt, g = _ping_pong(lambda c, ctx: "plain answer")
    run = g.run("GOTO_A:hi")
    assert run.stopped == "return-without-routing" and run.output == "plain answer"
    assert run.history == ["r", "a"]


# §6.9 Pure graph mode ---------------------------------------------------------------------------
def test_graph_pure_mode_replaces_active_context():
    def agent(content, ctx):
        ctx["stage"] = "two"
        return "done"

    rt, g = make_graph(linear("a"), {"a": agent}, context={"stage": "one", "keep": 1})
    live = rt.context
    g.run("x", rt.context, pure=True)
    assert rt.context is live
    assert rt.context["stage"] == "two" and rt.context["keep"] == 1     # top level wins (Q33)
    assert rt.context["last_output"] == "done" and "context" not in rt.context
    g.state["metadata"]["next_node"] = "stale"
    g.run("y", rt.context, pure=True)
    assert "next_node" not in rt.context                               # per-run signal


# §6.10 Graph-internal streams -------------------------------------------------------------------
def test_graph_internal_stream_names_and_node_events():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    assert g.internal_stream_names() == ["__main_node_start__", "__main_node_a__",
                                         "__main_node_end__", "__main_control__", "__main_state__"]
    events = []
    g.observers.append(lambda stream, msg: events.append((stream, msg.content, msg.metadata["node"])))
    g.run("x")
    assert events == [("__main_node_a__", "a(x)", "a")]


# §6.11 Graph analysis -----------------------------------------------------------------------
def test_graph_analysis_cycles_levels_unreachable():
    cfg = {"type": "graph", "nodes": {n: {"type": "agent", "agent": "a"} for n in "bcdz"},
           "edges": [{"source": "start", "target": "b"}, {"source": "b", "target": "c"},
                     {"source": "c", "target": "b"}, {"source": "c", "target": "d"},
                     {"source": "d", "target": "end"}]}
    rt, g = make_graph(cfg, {"a": echo("a")})
    an = g.analysis
    assert an.has_cycles and [(e.source, e.target) for e in an.back_edges] == [("c", "b")]
    assert an.levels == [["start", "z"], ["b"], ["c"], ["d"], ["end"]]
    assert an.unreachable == ["z"] and any("z" in w and "6.11" in w for w in rt.warnings)
    assert [e.source for e in an.reverse["b"]] == ["start", "c"]


def test_graph_mermaid_pins_18_3():
    cfg = {"type": "graph", "entry_point": "start", "nodes": {
        "router": {"type": "message_router", "rules": [
            {"match_type": "prefix", "pattern": "CODE", "target": "code"},
            {"match_type": "prefix", "pattern": "RESEARCH", "target": "research"},
            {"match_type": "suffix", "pattern": "", "target": "default", "extract_message": False}]},
        "code": {"type": "agent", "agent": "code_agent"},
        "research": {"type": "agent", "agent": "research_agent"},
        "default": {"type": "agent", "agent": "default_agent"}},
        "edges": [{"source": "start", "target": "router"}]
        + [{"source": "router", "target": t,
            "condition": {"type": "context_value", "key": "next_node", "value": t}}
           for t in ("code", "research", "default")]
        + [{"source": t, "target": "end"} for t in ("code", "research", "default")]}
    rt, g = make_graph(cfg, {a: echo(a) for a in ("code_agent", "research_agent", "default_agent")})
    assert g.mermaid() == [
        'subgraph graph__main["graph main"]',
        '  main__start(["start"])',
        '  main__router{"router: message_router"}',
        '  main__code["code: agent code_agent"]',
        '  main__research["research: agent research_agent"]',
        '  main__default["default: agent default_agent"]',
        '  main__end(["end"])',
        '  main____entry((entry)) --> main__start',
        '  main__start --> main__router',
        '  main__router -->|"next_node = code"| main__code',
        '  main__router -->|"next_node = research"| main__research',
        '  main__router -->|"next_node = default"| main__default',
        '  main__code --> main__end',
        '  main__research --> main__end',
        '  main__default --> main__end',
        'end']


# Benchmark ----------------------------------------------------------------------------------------
@pytest.mark.bench
def test_graph_bench_linear_ten_nodes():
    import time as _time
    names = [f"n{i}" for i in range(10)]
    cfg = linear(*names)
    tool_agent = getattr(actor, "ToolAgent", None)
    if tool_agent is not None:
        data = {"agents": {n: {"type": "tool", "config": {"tools": ["echo"]}} for n in names},
                "routes": {"main": cfg}}
        rt = actor.Runtime(actor.Doc(data), env={})
        rt.agents = {n: tool_agent(n, data["agents"][n], rt, ("agents", n)) for n in names}
        message, kind = "echo hi", "ToolAgent(echo)"
    else:
        rt = actor.Runtime(actor.Doc({"agents": {}, "routes": {"main": cfg}}), env={})
        rt.agents = {n: FakeAgent(n, lambda c, ctx: c) for n in names}
        message, kind = "hi", "fake agent (ToolAgent not merged yet)"
    graph = actor.GraphRoute("main", cfg, rt)
    agents = [rt.agents[n] for n in names]
    rounds = 2000

    def floor_loop():
        for _ in range(rounds):
            ctx, content = rt.context, message
            for agent in agents:                 # each agent gets the previous reply, as in the graph
                content = agent.invoke(content, ctx)

    def graph_loop():
        for _ in range(rounds):
            graph.run(message, rt.context, pure=True)

    best = {}
    for label, fn in (("floor", floor_loop), ("graph", graph_loop)):
        fn()
        times = []
        for _ in range(3):
            started = _time.perf_counter()
            fn()
            times.append(_time.perf_counter() - started)
        best[label] = min(times) / (rounds * 10) * 1e6
    overhead = best["graph"] - best["floor"]
    print(f"\n[graphs bench] {kind}: floor {best['floor']:.2f} us/node, graph "
          f"{best['graph']:.2f} us/node, overhead {overhead:.2f} us/node, "
          f"ratio {best['graph'] / best['floor']:.1f}x (LangGraph StateGraph: ~150 us/node)")
    assert best["graph"] < 5 * best["floor"]


# =====================================================================================
# §8, §9.2 Templating (templating)
# =====================================================================================
# [templating]


# =====================================================================================
# §13.2 Sandboxes (sandbox)
# =====================================================================================
# [sandbox]
