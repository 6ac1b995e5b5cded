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
# §4.5 Tool agents ----------------------------------------------------------------------
import io as _io
import json
import threading as _threading


def _tool_rt(tmp_path, unsafe=False):
    rt = actor.Runtime(actor.Doc({}), workdir=tmp_path, unsafe=unsafe)
    rt.progress = actor.ProgressFacility(stream=_io.StringIO())
    return rt


def _tool_agent(rt, config, name="t"):
    return actor.ToolAgent(name, {"type": "tool", "config": config}, rt, ("agents", name))


ALL_BUILTINS = ["echo", "math", "json_parse", "http_request", "file_read", "file_write",
                "progress_bar"]


def test_builtin_tools_table_follows_spec_order():
    assert list(actor.BUILTIN_TOOLS) == ALL_BUILTINS
    assert all(fn.__name__ == "tool_" + name for name, fn in actor.BUILTIN_TOOLS.items())


def test_tool_agent_defaults_capabilities_and_metadata(tmp_path):
    agent = _tool_agent(_tool_rt(tmp_path), {"tools": ["math", "file_read", "http_request"]})
    assert (agent.safe_mode, agent.allow_shell, agent.timeout, agent.context) == (True, False, 1, {})
    assert agent.capabilities == ["tool-execution", "math-evaluation", "file-operations",
                                  "http-requests"]
    assert agent.metadata == {
        "name": "t", "type": "tool", "capabilities": agent.capabilities, "reactive": True,
        "tools": ["math", "file_read", "http_request"], "allow_shell": False,
        "safe_mode": True, "timeout": 1}
    shell = _tool_agent(_tool_rt(tmp_path), {"tools": ["echo"], "allow_shell": True})
    assert "command-execution" in shell.capabilities


@pytest.mark.parametrize("config, where", [
    ({}, "agents.t.config"),
    ({"tools": "echo"}, "agents.t.config.tools"),
    ({"tools": ["ecko"]}, "agents.t.config.tools[0]"),
    ({"tools": ["echo", "echo"]}, "agents.t.config.tools[1]"),
    ({"tools": [{"code": "result = 1"}]}, "agents.t.config.tools[0].name"),
    ({"tools": [{"name": "x"}]}, "agents.t.config.tools[0].code"),
    ({"tools": [3]}, "agents.t.config.tools[0]"),
    ({"tools": ["echo"], "timeout": 0}, "agents.t.config.timeout"),
    ({"tools": ["echo"], "timeout": "5"}, "agents.t.config.timeout"),
    ({"tools": ["echo"], "safe_mode": "no"}, "agents.t.config.safe_mode"),
    ({"tools": ["echo"], "allow_shell": 1}, "agents.t.config.allow_shell"),
    ({"tools": ["echo"], "context": []}, "agents.t.config.context"),
])
def test_tool_agent_rejects_bad_config_with_location(tmp_path, config, where):
    with pytest.raises(actor.ConfigurationError) as info:
        _tool_agent(_tool_rt(tmp_path), config)
    assert info.value.path == where


def test_tool_agent_warns_on_unknown_field_and_empty_tools(tmp_path):
    rt = _tool_rt(tmp_path)
    _tool_agent(rt, {"tools": [], "retries": 3})
    assert any("retries" in w for w in rt.warnings)
    assert any("no tools" in w for w in rt.warnings)


def test_inline_tool_on_safe_host_is_refused_at_load(tmp_path):
    with pytest.raises(actor.UnsafeConfigurationError) as info:
        _tool_agent(_tool_rt(tmp_path), {"tools": [{"name": "x", "code": "result = 1"}]})
    assert info.value.path == "agents.t.config.tools[0].code"


# §4.5.1 Built-in tools ------------------------------------------------------------------
def _call(agent, message, ctx=None):
    return agent.invoke(message, {} if ctx is None else ctx)


def _fails(agent, message, ctx=None):
    with pytest.raises(actor.ExecutionError) as info:
        agent.invoke(message, {} if ctx is None else ctx)
    return info.value


@pytest.fixture
def utilities(tmp_path):
    return _tool_agent(_tool_rt(tmp_path), {"tools": list(ALL_BUILTINS)})


@pytest.mark.parametrize("message, expected", [
    ('{"tool": "echo", "args": {"text": "a  b"}}', "a  b"),
    ('{"tool": "echo", "args": ["a", "b"]}', "a b"),
    ('{"tool": "echo", "args": "solo"}', "solo"),
    ('{"tool": "echo"}', ""),
    ("echo   hello    world", "hello world"),
])
def test_echo(utilities, message, expected):
    assert _call(utilities, message) == expected


@pytest.mark.parametrize("expression, expected", [
    ("2 + 2 * 3", "8"), ("(2 + 2) * 3", "12"), ("10 / 4", "2.5"), ("7 // 2", "3"), ("7 % 4", "3"),
    ("2 ** 10", "1024"), ("-3 + +1", "-2"), ("abs(-2.5)", "2.5"), ("round(2.567, 2)", "2.57"),
    ("min(3, 1, 2)", "1"), ("max([1, 5, 3])", "5"), ("sum([1, 2, 3])", "6"), ("pow(2, 8)", "256"),
    ("pow(3, 200, 7)", "2"), ("int(7.9)", "7"), ("float(2)", "2.0"), ("1.5e3", "1500.0"),
])
def test_math_evaluates_restricted_arithmetic(utilities, expression, expected):
    request = json.dumps({"tool": "math", "args": {"expression": expression}})
    assert _call(utilities, request) == expected
    assert _call(utilities, json.dumps({"tool": "math", "args": [expression]})) == expected


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('x')", "x + 1", "(1).__class__", "'a' * 3",
    "True + 1", "[x for x in range(3)]", "lambda: 1", "eval('1')", "2 ** 100000", "9 ** 9 ** 9",
    "pow(10, 5000)", "(2 ** 4000) * (2 ** 4000)", "1 / 0", "10.0 ** 400", "1 if 1 else 2",
    "abs(x=1)", "round()", "(" * 300 + "1" + ")" * 300, "1 +", "", "a.b", "{1: 2}", "1 < 2",
    "[1] * 10 ** 9", "sum([[1]] * 10 ** 9, [])", "-[1]", "[1, 2] + [3]", "max([])",
])
def test_math_refuses_everything_else(utilities, expression):
    _fails(utilities, json.dumps({"tool": "math", "args": {"expression": expression}}))


def test_math_never_evaluates_side_effects(utilities, tmp_path):
    _fails(utilities, json.dumps({"tool": "math", "args": {
        "expression": "__import__('pathlib').Path('pwned').touch()"}}))
    assert not (tmp_path / "pwned").exists()


def test_json_parse_reindents_with_two_spaces(utilities):
    out = _call(utilities, json.dumps({"tool": "json_parse", "args": {"json": '{"a":[1,{"b":"é"}]}'}}))
    assert out == '{\n  "a": [\n    1,\n    {\n      "b": "é"\n    }\n  ]\n}'
    assert _call(utilities, 'json_parse [1,2]') == "[\n  1,\n  2\n]"
    _fails(utilities, json.dumps({"tool": "json_parse", "args": ["{oops"]}))
    _fails(utilities, '{"tool": "json_parse"}')


# §4.5.1 http_request against a local server ----------------------------------------------
@pytest.fixture
def http_server():
    import http.server

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            seen.append({"method": self.command, "path": self.path, "body": body,
                         "content_type": self.headers.get("Content-Type"),
                         "x_token": self.headers.get("X-Token")})
            status = 404 if self.path == "/missing" else 200
            payload = ("not here" if status == 404 else f"{self.command} {self.path}").encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = _threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_http_request_get_post_and_error_status(utilities, http_server):
    base, seen = http_server
    assert _call(utilities, json.dumps({"tool": "http_request", "args": {"url": base + "/a"}})) \
        == "Status: 200\n\nGET /a"
    out = _call(utilities, json.dumps({"tool": "http_request", "args": {
        "url": base + "/p", "method": "post", "headers": {"X-Token": "k"}, "data": {"n": 1}}}))
    assert out == "Status: 200\n\nPOST /p"
    assert seen[-1] == {"method": "POST", "path": "/p", "body": '{"n": 1}',
                        "content_type": "application/json", "x_token": "k"}
    assert _call(utilities, f"http_request {base}/missing") == "Status: 404\n\nnot here"


def test_http_request_failures_are_execution_errors(utilities, tmp_path):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _fails(utilities, f"http_request http://127.0.0.1:{port}/")
    (tmp_path / "secret.txt").write_text("s")
    _fails(utilities, f"http_request file://{tmp_path}/secret.txt")
    _fails(utilities, '{"tool": "http_request", "args": {}}')


# §4.5.1 file_read -----------------------------------------------------------------------
def test_file_read_header_format(tmp_path, utilities):
    (tmp_path / "notes.md").write_text("# Title\nbody\n", encoding="utf-8")
    assert _call(utilities, "file_read notes.md") == (
        "[FILE_READ_SUCCESS]📄 File: notes.md | Lines: 2 | Size: 13 chars\n"
        "[FILE_CONTENT_START]\n# Title\nbody\n\n[FILE_CONTENT_END]")
    (tmp_path / "empty.txt").write_text("")
    assert _call(utilities, '{"tool": "file_read", "args": {"file": "empty.txt"}}') == (
        "[FILE_READ_SUCCESS]📄 File: empty.txt | Lines: 0 | Size: 0 chars\n"
        "[FILE_CONTENT_START]\n\n[FILE_CONTENT_END]")


def test_file_read_is_relative_to_the_actor_workdir_not_the_process_cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("inside")
    (tmp_path / "a.txt").write_text("cwd")
    monkeypatch.chdir(tmp_path)
    agent = _tool_agent(_tool_rt(work), {"tools": ["file_read", "echo"]})
    assert "inside" in _call(agent, "file_read a.txt")


def test_file_read_failures(tmp_path, utilities):
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "dir").mkdir()
    for message in ("file_read nope.txt", "file_read bin.dat", "file_read dir", "file_read"):
        _fails(utilities, message)


def _safety_agent(tmp_path, unsafe, safe_mode=True, allow_shell=False):
    return _tool_agent(_tool_rt(tmp_path, unsafe=unsafe),
                       {"tools": ["file_read", "file_write", "echo"], "safe_mode": safe_mode,
                        "allow_shell": allow_shell})


# §4.5.4 Safe-mode restrictions and §13.3 Filesystem boundaries ---------------------------
@pytest.fixture
def tree(tmp_path):
    """tmp/work (the actor's directory) with sub/a.txt, and tmp/outside.txt beside it."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "a.txt").write_text("A")
    (work / "top.txt").write_text("T")
    (tmp_path / "outside.txt").write_text("O")
    return work


# (host unsafe, ctx _unsafe_mode, safe_mode, path, allowed?)
FILE_READ_CASES = [
    (False, False, True, "sub/a.txt", True),
    (False, False, True, "sub/../top.txt", False),
    (False, False, True, "../outside.txt", False),
    (False, False, True, "ABS", False),
    (False, True, True, "ABS", False),          # Q69: the host layer still refuses
    (True, False, True, "ABS", False),
    (True, True, True, "ABS", True),            # §13.3 unsafe mode permits absolute paths
    (True, True, True, "../outside.txt", False),  # safe_mode still refuses traversal
    (True, True, False, "../outside.txt", True),  # both layers relaxed
    (False, False, False, "../outside.txt", False),  # safe_mode false cannot relax the host
    (False, False, False, "ABS", False),
    (False, False, True, "~/x.txt", False),
    (True, True, False, "~/x.txt", False),
    (False, False, True, "a..b.txt", True),     # `..` inside a name is not traversal
]


@pytest.mark.parametrize("unsafe, flag, safe_mode, given, allowed", FILE_READ_CASES)
def test_file_read_path_rules(tree, unsafe, flag, safe_mode, given, allowed):
    (tree / "a..b.txt").write_text("dots")
    if given == "ABS":
        given = str(tree.parent / "outside.txt")
    agent = _safety_agent(tree, unsafe, safe_mode)
    ctx = {"_unsafe_mode": True} if flag else {}
    message = json.dumps({"tool": "file_read", "args": {"file": given}})
    if allowed:
        assert _call(agent, message, ctx).startswith("[FILE_READ_SUCCESS]")
    else:
        _fails(agent, message, ctx)


def test_file_read_refuses_symlinks_leaving_the_workdir_in_safe_mode(tree):
    (tree / "link.txt").symlink_to(tree.parent / "outside.txt")
    (tree / "inner").symlink_to(tree / "sub")
    agent = _safety_agent(tree, unsafe=False)
    error = _fails(agent, "file_read link.txt")
    assert error.section == "13.3"
    assert "A" in _call(agent, "file_read inner/a.txt")
    unsafe = _safety_agent(tree, unsafe=True)
    assert "O" in _call(unsafe, "file_read link.txt", {"_unsafe_mode": True})


# (host unsafe, ctx _unsafe_mode, safe_mode, path, allowed?)
FILE_WRITE_CASES = [
    (True, True, True, "new.txt", True),
    (True, True, True, "sub/deeper/new.txt", True),
    (True, False, True, "new.txt", False),      # §4.5.4: needs _unsafe_mode in the context
    (True, False, False, "new.txt", False),     # ... whatever safe_mode says
    (False, True, True, "new.txt", False),      # Q69: and the host in unsafe mode (§13.3)
    (False, True, False, "new.txt", False),
    (True, True, True, "../escape.txt", False),
    (True, True, False, "../escape.txt", False),  # §13.3: `..` refused even in unsafe mode
    (True, True, True, "sub/../new.txt", False),
    (True, True, True, "~/new.txt", False),
    (True, True, False, "~/new.txt", False),
    (True, True, True, "ABS", True),            # outside the directory: waived by _unsafe_mode
]


@pytest.mark.parametrize("unsafe, flag, safe_mode, given, allowed", FILE_WRITE_CASES)
def test_file_write_path_rules(tree, unsafe, flag, safe_mode, given, allowed):
    if given == "ABS":
        given = str(tree.parent / "abs.txt")
    agent = _safety_agent(tree, unsafe, safe_mode)
    ctx = {"_unsafe_mode": True} if flag else {}
    message = json.dumps({"tool": "file_write", "args": {"file": given, "content": "x"}})
    before = sorted(p for p in tree.parent.rglob("*"))
    if allowed:
        assert _call(agent, message, ctx) == f"Successfully wrote 1 characters to {given}"
        target = Path(given) if Path(given).is_absolute() else tree / given
        assert target.read_text() == "x"
    else:
        _fails(agent, message, ctx)
        assert sorted(p for p in tree.parent.rglob("*")) == before


# §4.5.5 file_write modes ---------------------------------------------------------------
UNSAFE_CTX = {"_unsafe_mode": True}


def _write(agent, **args):
    return _call(agent, json.dumps({"tool": "file_write", "args": args}), dict(UNSAFE_CTX))


@pytest.fixture
def writer(tmp_path):
    return _tool_agent(_tool_rt(tmp_path, unsafe=True), {"tools": ["file_write", "echo"]})


def test_file_write_mode_w_overwrites(writer, tmp_path):
    (tmp_path / "f.txt").write_text("old\n")
    assert _write(writer, file="f.txt", content="new") == "Successfully wrote 3 characters to f.txt"
    assert (tmp_path / "f.txt").read_text() == "new"
    assert _call(writer, "file_write g.txt two words", dict(UNSAFE_CTX)) == \
        "Successfully wrote 9 characters to g.txt"
    assert (tmp_path / "g.txt").read_text() == "two words"


@pytest.mark.parametrize("existing, content, expected", [
    ("abc", "def", "abcdef"),
    ("intro\n", "# Two\n", "intro\n\n# Two\n"),
    ("intro", "# Two\n", "intro\n\n# Two\n"),
    ("intro\n\n", "# Two\n", "intro\n\n# Two\n"),
    (None, "# One\n", "# One\n"),
    ("", "# One\n", "# One\n"),
])
def test_file_write_mode_a_appends_with_markdown_separator(writer, tmp_path, existing, content,
                                                            expected):
    if existing is not None:
        (tmp_path / "f.md").write_text(existing)
    assert _write(writer, file="f.md", content=content, mode="a") == \
        f"Successfully appended {len(content)} characters to f.md"
    assert (tmp_path / "f.md").read_text() == expected


@pytest.mark.parametrize("position, line, expected", [
    ("start", 1, "X\n1\n2\n3\n"),
    ("end", 4, "1\n2\n3\nX\n"),
    (None, 4, "1\n2\n3\nX\n"),
    (2, 2, "1\nX\n2\n3\n"),
    ("3", 3, "1\n2\nX\n3\n"),
    (0, 1, "X\n1\n2\n3\n"),
    (-5, 1, "X\n1\n2\n3\n"),
    (99, 4, "1\n2\n3\nX\n"),
])
def test_file_write_insert_positions(writer, tmp_path, position, line, expected):
    (tmp_path / "f.txt").write_text("1\n2\n3\n")
    args = {"file": "f.txt", "content": "X", "mode": "insert"}
    if position is not None:
        args["position"] = position
    assert _write(writer, **args) == f"Successfully inserted 1 characters at line {line} in f.txt"
    assert (tmp_path / "f.txt").read_text() == expected


def test_file_write_insert_edges(writer, tmp_path):
    (tmp_path / "f.txt").write_text("1\n2")
    _write(writer, file="f.txt", content="X\n", mode="insert")
    assert (tmp_path / "f.txt").read_text() == "1\n2\nX\n"
    assert _write(writer, file="n.txt", content="a", mode="insert", position=7) == \
        "Successfully inserted 1 characters at line 1 in n.txt"
    assert (tmp_path / "n.txt").read_text() == "a\n"
    _fails(writer, json.dumps({"tool": "file_write", "args": {
        "file": "f.txt", "content": "x", "mode": "insert", "position": "middle"}}), UNSAFE_CTX)
    _fails(writer, json.dumps({"tool": "file_write", "args": {
        "file": "f.txt", "content": "x", "mode": "x"}}), UNSAFE_CTX)


# §4.5.6 The progress-bar facility -------------------------------------------------------
def _bar(agent, ctx=None, **args):
    return _call(agent, json.dumps({"tool": "progress_bar", "args": args}), ctx)


@pytest.fixture
def progress(tmp_path):
    return _tool_agent(_tool_rt(tmp_path), {"tools": ["progress_bar", "echo"]})


def test_progress_bar_rendering(progress):
    line = _bar(progress, current=1, total=3, stage="drafting", message="intro")
    assert line == "█" * 8 + "░" * 16 + " 33.3% (1/3) drafting • intro"
    assert progress.rt.progress.stream.getvalue() == "\r" + line
    assert _bar(progress, current=3, total=3, stage="", message="") == "█" * 24 + " 100.0% (3/3)"
    assert progress.rt.progress.stream.getvalue().endswith("(3/3)\n")
    assert _bar(progress, current=2, total=7, stage="s", message="") == \
        "██████" + "░" * 18 + " 28.6% (2/7) s"


def test_progress_bar_defaults_and_clamping(progress):
    assert _bar(progress) == "░" * 24 + " 0.0% (0/1)"
    assert _bar(progress, current=5) == "█" * 24 + " 100.0% (1/1)"
    assert _bar(progress, current=-2, total=4) == "░" * 24 + " 0.0% (0/4)"
    assert _bar(progress, current=9) == "█" * 24 + " 100.0% (4/4)"
    assert _bar(progress, total=8, remaining=2) == "█" * 18 + "░" * 6 + " 75.0% (6/8)"


def test_progress_bar_argument_synonyms(progress):
    assert _bar(progress, phase="p", done=1, steps=2, label="l").endswith(" 50.0% (1/2) p • l")
    # the snapshot keeps the message "l" until a call gives another one
    assert _bar(progress, sections_completed=1, sections_total=4, stage="s").endswith("(1/4) s • l")
    assert _bar(progress, completed_sections=["a", "b"], message="m").endswith("(2/4) s • m")
    assert _call(progress, "progress_bar 3 6").startswith("█" * 12 + "░" * 12 + " 50.0% (3/6)")
    _fails(progress, "progress_bar lots")


def test_progress_bar_infers_from_context_hooks(progress):
    ctx = {"writing_stage": "writing", "section_paths": ["a", "b", "c", "d"],
           "current_section_index": 1}
    assert _bar(progress, ctx) == "██████" + "░" * 18 + " 25.0% (1/4) writing"
    ctx = {"section_paths": ["a", "b"], "current_latex_index": 2}
    assert _bar(progress, ctx).startswith("█" * 24 + " 100.0% (2/2)")
    assert _bar(progress, ctx, stage="explicit", current=1).endswith("(1/2) explicit")


def test_progress_bar_is_one_thread_safe_facility_per_runtime(tmp_path):
    rt = _tool_rt(tmp_path)
    agents = [_tool_agent(rt, {"tools": ["progress_bar", "echo"]}, name=f"p{i}") for i in range(2)]
    other = _tool_agent(_tool_rt(tmp_path), {"tools": ["progress_bar", "echo"]})
    _bar(agents[0], current=1, total=10)
    assert _bar(agents[1], stage="x").endswith("(1/10) x")      # same snapshot
    assert _bar(other).endswith("(0/1)")                       # another Actor's own snapshot
    errors = []

    def worker(n):
        try:
            for i in range(50):
                _bar(agents[n % 2], current=i % 11, total=10, message=f"w{n}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [_threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    written = rt.progress.stream.getvalue()
    renders = [chunk.rstrip("\n") for chunk in written.split("\r") if chunk]
    assert len(renders) == 2 + 8 * 50
    assert all(len(r.split(" ")[0]) == 24 for r in renders)   # no interleaved writes


def test_progress_bar_default_channel_is_stderr(tmp_path, capsys):
    rt = actor.Runtime(actor.Doc({}), workdir=tmp_path)
    agent = _tool_agent(rt, {"tools": ["progress_bar", "echo"]})
    line = _bar(agent, current=1, total=1)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "\r" + line + "\n"


# §4.5.3 Tool invocation protocol -------------------------------------------------------
def test_protocol_invalid_json_is_the_spec_error(utilities):
    error = _fails(utilities, '  {"tool": "echo", }  ')
    assert error.message == "Invalid JSON in tool request"
    assert actor.INVALID_JSON_IN_TOOL_REQUEST == "Invalid JSON in tool request"


def test_protocol_unknown_or_unlisted_tool_fails(tmp_path):
    agent = _tool_agent(_tool_rt(tmp_path), {"tools": ["echo", "math"]})
    for message in ("json_parse {}", '{"tool": "file_read", "args": ["x"]}', "hello there", "",
                    '{"tool": 3}', '{"no_tool": 1}', "[1, 2]"):
        _fails(agent, message)


def test_protocol_single_builtin_takes_any_message(tmp_path):
    echo = _tool_agent(_tool_rt(tmp_path), {"tools": ["echo"]})
    assert _call(echo, "hello   world") == "hello   world"
    assert _call(echo, '{"a": 1}') == '{"a": 1}'
    assert _call(echo, "echo  hi") == "hi"
    _fails(echo, "math 1 + 1")              # names another tool: step 5 still applies
    calc = _tool_agent(_tool_rt(tmp_path), {"tools": ["math"]})
    assert _call(calc, "2 + 3") == "5"


def test_protocol_accepts_structured_content_and_coerces_output(utilities):
    assert _call(utilities, {"tool": "math", "args": {"expression": "6*7"}}) == "42"
    assert actor.tool_output(None) == ""
    assert actor.tool_output(3) == "3"
    assert actor.tool_output({"a": 1}) == "{'a': 1}"
    assert actor.tool_output("s") == "s"


def test_run_builtin_tool_for_tool_execute_blocks(tmp_path):
    rt = _tool_rt(tmp_path)
    assert actor.run_builtin_tool(rt, "math", {"expression": "1+1"}, {}) == "2"
    with pytest.raises(actor.ExecutionError):
        actor.run_builtin_tool(rt, "shell", {"command": "true"}, {})
    with pytest.raises(actor.ExecutionError):
        actor.run_builtin_tool(rt, "file_write", {"file": "x", "content": "y"}, {})
    agent = _tool_agent(rt, {"tools": ["echo"]})
    assert actor.run_builtin_tool(rt, "echo", {"text": "hi"}, {}, agent=agent) == "hi"
    with pytest.raises(actor.ExecutionError):
        actor.run_builtin_tool(rt, "math", {"expression": "1"}, {}, agent=agent)


# §4.5.2 Inline tools (the tool side, with a stand-in for the §13.2 sandbox) ----------------
@pytest.fixture
def plain_exec(monkeypatch):
    """Replace the sandbox by plain exec so this region tests only the tool agent's part."""
    calls = []

    def compile_code(source, *, rt=None, path=None):
        return compile(source, "<inline>", "exec")

    def run_code(unit, variables, *, timeout=1.0):
        calls.append(timeout)
        namespace = dict(variables)
        exec(unit, {"json": json}, namespace)
        return namespace

    monkeypatch.setattr(actor, "compile_code", compile_code, raising=False)
    monkeypatch.setattr(actor, "run_code", run_code, raising=False)
    return calls


def _inline(tmp_path, *tools, **config):
    rt = _tool_rt(tmp_path, unsafe=True)
    return _tool_agent(rt, dict(config, tools=list(tools)))


def test_inline_single_tool_gets_whole_message(tmp_path, plain_exec):
    agent = _inline(tmp_path, {"name": "shout", "code": 'result = str(input_data).upper() + "!"'},
                    timeout=5)
    assert _call(agent, "hello world") == "HELLO WORLD!"
    assert _call(agent, '{"tool": "other"}') == '{"TOOL": "OTHER"}!'
    assert plain_exec == [5, 5]


@pytest.mark.parametrize("code, expected", [
    ("result = 42", "42"), ("output = 'o'", "o"), ("response = 'r'", "r"), ("answer = 'a'", "a"),
    ("output = 'o'\nanswer = 'a'", "o"), ("response = None\nanswer = 'a'", "a"), ("x = 1", ""),
    ("result = message == input_data", "True"), ("result = {'k': [1]}", "{'k': [1]}"),
    ("result = ''\noutput = 'o'", ""),
])
def test_inline_result_fallbacks_and_coercion(tmp_path, plain_exec, code, expected):
    agent = _inline(tmp_path, {"name": "t", "code": code})
    assert _call(agent, "m") == expected


def test_inline_context_is_by_reference_and_invocation_wins(tmp_path, plain_exec):
    code = ("result = f\"{context['who']}/{context['own']}\"\n"
            "context['topic'] = input_data\ncontext['log'].append(1)\ndel context['gone']")
    agent = _inline(tmp_path, {"name": "t", "code": code},
                    context={"who": "agent", "own": "mine", "log": []})
    ctx = {"who": "invocation", "gone": 1, "log": []}
    assert _call(agent, "ai", ctx) == "invocation/mine"
    assert ctx == {"who": "invocation", "topic": "ai", "log": [1]}
    assert agent.context == {"who": "agent", "own": "mine", "log": []}


def test_inline_tool_among_builtins_is_called_by_name(tmp_path, plain_exec):
    agent = _inline(tmp_path, "echo", {"name": "rev", "code": "result = input_data[::-1]"})
    assert _call(agent, "rev abc  def") == "fed cba"
    assert _call(agent, '{"tool": "rev", "args": "xyz"}') == "zyx"
    assert _call(agent, '{"tool": "rev", "args": {"a": 1}}') == '}1 :"a"{'
    assert _call(agent, "echo hi") == "hi"


def test_inline_tool_shadowing_a_builtin_wins_with_a_warning(tmp_path, plain_exec):
    agent = _inline(tmp_path, "echo", {"name": "math", "code": "result = 'inline'"})
    assert _call(agent, "math 1 + 1") == "inline"
    assert any("§16.3" in w and "math" in w for w in agent.rt.warnings)


def test_inline_code_drives_the_progress_facility(tmp_path, plain_exec):
    code = ("progress_bar(current=1, total=2, stage='s')\n"
            "result = progress_bar(current=2)")
    agent = _inline(tmp_path, {"name": "t", "code": code})
    assert _call(agent, "x") == "█" * 24 + " 100.0% (2/2) s"
    assert agent.rt.progress.stream.getvalue().count("\r") == 2


def test_inline_errors_propagate_as_execution_errors(tmp_path, monkeypatch):
    def compile_code(source, *, rt=None, path=None):
        return source

    def run_code(unit, variables, *, timeout=1.0):
        raise actor.ExecutionError("boom")

    monkeypatch.setattr(actor, "compile_code", compile_code, raising=False)
    monkeypatch.setattr(actor, "run_code", run_code, raising=False)
    agent = _inline(tmp_path, {"name": "t", "code": "x"})
    _fails(agent, "anything")


needs_sandbox = pytest.mark.skipif(not hasattr(actor, "run_code"),
                                   reason="the [sandbox] area (compile_code/run_code) is not merged")


@needs_sandbox
def test_inline_spec_examples_run_in_the_real_sandbox(tmp_path):
    route = ('text = (input_data or "").strip()\nif text.startswith("!"):\n'
             '    result = f"GOTO_COMMAND_HANDLER:{text}"\nelse:\n'
             '    stage = context.get("current_stage") or "default"\n'
             '    result = f"GOTO_{stage.upper()}:{text}"\n')
    agent = _inline(tmp_path, {"name": "route_by_prefix", "code": route})
    assert _call(agent, "!help") == "GOTO_COMMAND_HANDLER:!help"
    assert _call(agent, "hi", {"current_stage": "intro"}) == "GOTO_INTRO:hi"
    save = ("import json\ntry:\n    payload = json.loads(input_data)\n"
            "    topic = payload.get('topic', '')\nexcept json.JSONDecodeError:\n"
            "    topic = input_data\ncontext['current_topic'] = topic\n"
            "result = f'Topic set to: {topic}'\n")
    agent = _inline(tmp_path, {"name": "save_topic", "code": save})
    ctx = {}
    assert _call(agent, '{"topic": "ai"}', ctx) == "Topic set to: ai"
    assert ctx == {"current_topic": "ai"}


@needs_sandbox
def test_inline_runaway_code_times_out_and_the_agent_keeps_serving(tmp_path):
    import time as _time
    agent = _inline(tmp_path, "echo", {"name": "spin", "code": "while True:\n    pass\n"},
                    timeout=0.2)
    started = _time.monotonic()
    _fails(agent, "spin")
    assert _time.monotonic() - started < 2
    assert _call(agent, "echo next") == "next"


@needs_sandbox
def test_inline_forbidden_construct_is_refused_at_load(tmp_path):
    with pytest.raises(actor.ConfigurationError):
        _inline(tmp_path, {"name": "t", "code": "import os\nresult = os.getcwd()\n"})


# §13.5 Shell execution --------------------------------------------------------------------
@pytest.mark.parametrize("unsafe, allow_shell, safe_mode, command, ok", [
    (True, True, True, "echo hi", True),
    (True, True, False, "echo hi", True),
    (False, True, True, "echo hi", False),       # host safe
    (True, False, True, "echo hi", False),       # allow_shell false
    (True, True, False, "rm -f x", False),       # blocklist in every mode
    (True, True, False, "echo RM", False),
    (True, True, False, "echo formatted", False),
    (True, True, False, "kill -0 1", False),
    (True, True, False, "exit 3", False),        # a failing command is an error
])
def test_shell_gates_and_blocklist(tmp_path, unsafe, allow_shell, safe_mode, command, ok):
    (tmp_path / "x").write_text("keep")
    rt = _tool_rt(tmp_path, unsafe=unsafe)
    agent = _tool_agent(rt, {"tools": ["echo", "shell"], "allow_shell": allow_shell,
                             "safe_mode": safe_mode})
    message = json.dumps({"tool": "shell", "args": {"command": command}})
    if ok:
        assert _call(agent, message) == "hi\n"
    else:
        _fails(agent, message)
    assert (tmp_path / "x").read_text() == "keep"


def test_shell_runs_in_workdir_with_actor_env_and_timeout(tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    rt = actor.Runtime(actor.Doc({}), workdir=tmp_path, unsafe=True, env={"GREETING": "hey"})
    agent = _tool_agent(rt, {"tools": ["echo"], "allow_shell": True, "timeout": 0.2})
    assert _call(agent, "shell pwd").strip() == str(tmp_path.resolve())
    assert _call(agent, 'shell echo "$GREETING"') == "hey\n"
    import time as _time
    started = _time.monotonic()
    _fails(agent, "shell sleep 3")
    assert _time.monotonic() - started < 2


# =====================================================================================
# §5, §7, §12.2 Streams (streams)
# =====================================================================================
# [streams]


# =====================================================================================
# §6 Graph routes (graphs)
# =====================================================================================
# [graphs]


# =====================================================================================
# §8, §9.2 Templating (templating)
# =====================================================================================
# [templating]


# =====================================================================================
# §13.2 Sandboxes (sandbox)
# =====================================================================================
# [sandbox]
