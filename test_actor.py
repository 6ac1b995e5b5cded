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
import http.server  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402

LLM_KEY = "sk-test-SECRET-4242"


@pytest.fixture
def llm_render(monkeypatch):
    """Until [templating] lands on this branch, prompts without template syntax pass through."""
    if not hasattr(actor, "render_runtime"):
        monkeypatch.setattr(actor, "render_runtime",
                            lambda rt, text, ctx, message, path=None: text, raising=False)


def _llm_rt(env=None, doc=None, **kwargs):
    env = {"OPENAI_API_KEY": LLM_KEY} if env is None else env
    return actor.Runtime(actor.Doc(doc or {}), env=env, **kwargs)


def _llm_agent(config, rt=None, name="a"):
    rt = rt or _llm_rt()
    return actor.LLMAgent(name, {"type": "llm", "config": config}, rt, ("agents", name))


class _LLMServer:
    """A scripted HTTP server on 127.0.0.1: records each request, answers from `replies`."""

    def __init__(self):
        self.requests = []
        self.replies = []           # (status, headers, body: dict | bytes | str)
        self.delay = 0.0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                        "body": json.loads(raw)})
                if server.delay:
                    threading.Event().wait(server.delay)
                status, headers, body = server.replies.pop(0) if server.replies else (
                    500, {}, {"error": {"message": "no scripted reply"}})
                if isinstance(body, (dict, list)):
                    body = json.dumps(body)
                if isinstance(body, str):
                    body = body.encode("utf-8")
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def llm_server():
    server = _LLMServer()
    yield server
    server.close()


def _openai_ok(text):
    return (200, {}, {"id": "c1", "object": "chat.completion", "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": text}}]})


def _sleeps(agent):
    waits = []
    agent.sleep = waits.append
    return waits


# §4.4 LLM agents: fields, defaults, metadata ------------------------------------------------
def test_llm_defaults_and_metadata(llm_render):
    agent = _llm_agent({})
    assert (agent.provider, agent.model) == ("openai", "gpt-3.5-turbo")
    assert (agent.temperature, agent.max_tokens) == (0.7, 1000)
    assert agent.system_prompt == "You are a helpful assistant."
    assert (agent.memory_enabled, agent.max_history) == (False, 10)
    meta = agent.metadata
    assert meta["name"] == "a" and meta["type"] == "llm" and meta["reactive"] is True
    for key in ("provider", "model", "temperature", "max_tokens", "memory_enabled",
                "supports_structured_output", "capabilities"):
        assert key in meta
    assert "text-generation" in agent.capabilities and "structured-output" in agent.capabilities
    assert LLM_KEY not in repr(agent) and LLM_KEY not in json.dumps(meta)


@pytest.mark.parametrize("provider, env, model", [
    ("OpenAI", {"OPENAI_API_KEY": "k"}, "gpt-3.5-turbo"),
    ("ANTHROPIC", {"ANTHROPIC_API_KEY": "k"}, "claude-3-5-sonnet-20241022"),
    ("google", {"GOOGLEAI_API_KEY": "k"}, "gemini-1.5-flash"),
])
def test_llm_provider_case_insensitive_default_models(provider, env, model):
    agent = _llm_agent({"provider": provider}, _llm_rt(env))
    assert agent.provider == provider.lower() and agent.model == model


def test_llm_missing_key_names_variables():
    with pytest.raises(actor.ConfigurationError) as info:
        _llm_agent({"provider": "google"}, _llm_rt({"OPENAI_API_KEY": "k", "GOOGLE_API_KEY": ""}))
    assert "GOOGLE_API_KEY" in info.value.message and "GOOGLEAI_API_KEY" in info.value.message
    assert info.value.path == "agents.a.config"


def test_llm_key_order_and_explicit_key(llm_render):
    rt = _llm_rt({"GOOGLE_API_KEY": "first", "GOOGLEAI_API_KEY": "second"})
    assert _llm_agent({"provider": "google"}, rt)._api_key == "first"
    assert _llm_agent({"provider": "google", "api_key": "mine"}, rt)._api_key == "mine"


def test_llm_unknown_provider_before_missing_key():
    with pytest.raises(actor.AgentCreationError) as info:
        _llm_agent({"provider": "mistral"}, _llm_rt({}))
    assert "mistral" in info.value.message


@pytest.mark.parametrize("field, value", [
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", True), ("temperature", "hot"),
    ("max_tokens", "many"), ("max_tokens", 0), ("memory_enabled", "yes"), ("max_history", -1),
    ("response_format", "json"), ("template_vars", [1]), ("system_prompt", 3),
])
def test_llm_rejects_bad_field_values(field, value):
    with pytest.raises(actor.ConfigurationError) as info:
        _llm_agent({field: value})
    assert info.value.path.startswith(f"agents.a.config.{field}")


def test_llm_unknown_field_warns():
    rt = _llm_rt()
    _llm_agent({"temprature": 0.1}, rt)
    assert any("temprature" in text for text in rt.warnings)


def test_llm_host_fake_provider_needs_no_key(llm_render):
    agent = _llm_agent({"provider": "anthropic"}, _llm_rt({}, provider="fake"))
    assert agent.provider == "fake" and agent.model == "claude-3-5-sonnet-20241022"
    assert agent.invoke("hello", {}) == "hello"


# §4.4.3 Structured output --------------------------------------------------------------------
SCHEMA_RF = {"type": "json_schema",
             "json_schema": {"name": "t", "strict": True,
                             "schema": {"type": "object", "properties": {"x": {"type": "string"}},
                                        "required": ["x"], "additionalProperties": False}}}


def test_llm_response_format_shape_checked_at_load():
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({"response_format": {"type": "json_schema"}})
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({"response_format": {"json_schema": {}}})


def test_llm_structured_output_unsupported_type_is_execution_error(llm_render):
    rt = _llm_rt({"ANTHROPIC_API_KEY": "k"}, llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"provider": "anthropic", "response_format": {"type": "json_object"}}, rt)
    with pytest.raises(actor.ExecutionError):
        agent.invoke("x", {})
    assert rt.llm_log == []


# §4.4.4 Memory and history -------------------------------------------------------------------
def test_llm_memory_order_and_truncation_in_entries(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({"a": ["r1", "r2", "r3"]}))
    agent = _llm_agent({"memory_enabled": True, "max_history": 3}, rt)
    assert [agent.invoke(m, {}) for m in ("m1", "m2", "m3")] == ["r1", "r2", "r3"]
    assert rt.llm_log[1]["messages"] == [
        {"role": "user", "content": "m1"}, {"role": "assistant", "content": "r1"},
        {"role": "user", "content": "m2"}]
    assert rt.llm_log[2]["messages"] == [
        {"role": "assistant", "content": "r1"}, {"role": "user", "content": "m2"},
        {"role": "assistant", "content": "r2"}, {"role": "user", "content": "m3"}]
    assert agent.history == [{"role": "assistant", "content": "r2"},
                             {"role": "user", "content": "m3"}, {"role": "assistant", "content": "r3"}]


def test_llm_memory_not_appended_after_failure(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({"a": [{"error": "boom"}, "ok"]}))
    agent = _llm_agent({"memory_enabled": True}, rt)
    with pytest.raises(actor.ExecutionError):
        agent.invoke("first", {})
    assert agent.history == []
    assert agent.invoke("second", {}) == "ok"
    assert agent.history == [{"role": "user", "content": "second"},
                             {"role": "assistant", "content": "ok"}]


def test_llm_memory_off_uses_context_history_without_keeping_it(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({}, rt)
    ctx = {"conversation_history": [{"role": "user", "content": "u0"},
                                    {"role": "assistant", "content": "a0"},
                                    {"role": "system", "content": "s"}]}
    agent.invoke("q1", ctx)
    agent.invoke("q2", {})
    assert rt.llm_log[0]["messages"] == [{"role": "user", "content": "u0"},
                                         {"role": "assistant", "content": "a0"},
                                         {"role": "user", "content": "q1"}]
    assert rt.llm_log[1]["messages"] == [{"role": "user", "content": "q2"}]
    assert len(ctx["conversation_history"]) == 3 and agent.history == []


def test_llm_context_history_ending_with_the_message_sends_it_once(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    ctx = {"conversation_history": [{"role": "user", "content": "hi"}]}
    _llm_agent({}, rt).invoke("hi", ctx)
    assert rt.llm_log[0]["messages"] == [{"role": "user", "content": "hi"}]


def test_llm_memory_is_thread_safe(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"memory_enabled": True, "max_history": 1000}, rt)
    threads = [threading.Thread(target=agent.invoke, args=(f"m{i}", {})) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = agent.history
    assert len(history) == 80
    for user, assistant in zip(history[::2], history[1::2]):   # pairs stay together
        assert user["role"] == "user" and assistant == {"role": "assistant",
                                                        "content": user["content"]}


# §4.4.5 Temperature override -----------------------------------------------------------------
def test_llm_temperature_override(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"temperature": 0.3}, rt)
    agent.invoke("x", {"_temperature_override": 1.5})
    agent.invoke("y", {})
    assert [r["temperature"] for r in rt.llm_log] == [1.5, 0.3]
    with pytest.raises(actor.ExecutionError):
        agent.invoke("z", {"_temperature_override": "hot"})


# §4.4.6 System prompt rendering (needs [templating]'s render_runtime) --------------------------
def test_llm_system_prompt_rendered_and_fallback():
    if not hasattr(actor, "render_runtime"):
        pytest.skip("render_runtime arrives with [templating]")
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    _llm_agent({"system_prompt": "Topic {{ context.topic }}; msg {{ message }}"}, rt).invoke(
        "hi", {"topic": "owls"})
    assert rt.llm_log[-1]["system"] == "Topic owls; msg hi"
    broken = "Bad {{ 1 | no_such_filter_x }}"
    _llm_agent({"system_prompt": broken}, rt, name="b").invoke("hi", {})
    assert rt.llm_log[-1]["system"] == broken and rt.warnings


def test_llm_template_formats_user_message(llm_render):
    doc = {"prompts": {"greet": {"content": "Say hello"}}}
    rt = _llm_rt(doc=doc, llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"template": "greet", "template_vars": {"who": "Bob"}}, rt)
    assert agent.invoke("ignored", {}) == "Say hello"
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({"template": "nope"}, rt, name="b")


# HOST -- providers: OpenAI Chat Completions over a local server -------------------------------
def test_openai_wire_format(llm_server, llm_render):
    llm_server.replies.append(_openai_ok("pong"))
    rt = _llm_rt()
    agent = _llm_agent({"base_url": llm_server.url + "/v1/", "model": "gpt-4o",
                        "system_prompt": "Be brief.", "memory_enabled": True,
                        "response_format": SCHEMA_RF, "max_tokens": 50, "temperature": 0.2}, rt)
    agent.memory.record("u0", "a0")
    assert agent.invoke("ping", {}) == "pong"
    req = llm_server.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["authorization"] == f"Bearer {LLM_KEY}"
    assert req["headers"]["content-type"] == "application/json"
    assert req["body"] == {"model": "gpt-4o", "max_tokens": 50, "temperature": 0.2,
                           "response_format": SCHEMA_RF,
                           "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "u0"},
                                        {"role": "assistant", "content": "a0"},
                                        {"role": "user", "content": "ping"}]}
    assert LLM_KEY not in json.dumps(rt.llm_log)


def test_openai_base_url_from_env_alone(llm_server, llm_render):
    llm_server.replies.append(_openai_ok("local"))
    agent = _llm_agent({"model": "llama3"}, _llm_rt({"OPENAI_API_KEY": "ollama",
                                                     "OPENAI_BASE_URL": llm_server.url + "/v1"}))
    assert agent.invoke("hi", {}) == "local"
    assert llm_server.requests[0]["path"] == "/v1/chat/completions"


def test_base_url_precedence_and_scheme(llm_render):
    env = {"GOOGLE_API_KEY": "k", "GOOGLE_BASE_URL": "http://b", "GOOGLE_GEMINI_BASE_URL": "http://g"}
    assert _llm_agent({"provider": "google"}, _llm_rt(env))._base_url() == "http://g"
    assert _llm_agent({"provider": "google", "base_url": "https://f"}, _llm_rt(env))._base_url() \
        == "https://f"
    assert _llm_agent({"provider": "anthropic"}, _llm_rt({"ANTHROPIC_API_KEY": "k"}))._base_url() \
        == "https://api.anthropic.com"
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({"base_url": "localhost:11434/v1"})
    agent = _llm_agent({}, _llm_rt({"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "localhost:1"}))
    with pytest.raises(actor.ExecutionError, match="not an http"):
        agent.invoke("x", {})


def test_llm_actor_reaches_openai_compatible_server_by_base_url(llm_server):
    """An Actor loaded through the public API talks to a local server named only by env."""
    llm_server.replies += [_openai_ok("from local 1"), _openai_ok("from local 2")]
    text = ("agents:\n  bot: {type: llm, config: {model: llama3, memory_enabled: true}}\n"
            "routes:\n  main:\n    type: stream\n"
            "    operators: [{type: map, params: {agent: bot}}]\n"
            "    publications: [__output__]\n")
    env = {"OPENAI_API_KEY": "ollama", "OPENAI_BASE_URL": llm_server.url + "/v1"}
    team = actor.load(text=text, env=env, default_router="main")
    try:
        assert [m.content for m in team.send("hi").outputs] == ["from local 1"]
        assert [m.content for m in team.send("again").outputs] == ["from local 2"]
    finally:
        team.close()
    assert [r["path"] for r in llm_server.requests] == ["/v1/chat/completions"] * 2
    assert llm_server.requests[1]["body"]["messages"][1:] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "from local 1"},
        {"role": "user", "content": "again"}]


def test_openai_reasoning_models_use_max_completion_tokens(llm_server, llm_render):
    llm_server.replies.append(_openai_ok("ok"))
    _llm_agent({"base_url": llm_server.url, "model": "o3-mini"}).invoke("x", {})
    body = llm_server.requests[0]["body"]
    assert body["max_completion_tokens"] == 1000
    assert "max_tokens" not in body and "temperature" not in body


def test_openai_unsupported_parameter_retried_once_with_other(llm_server, llm_render):
    llm_server.replies += [(400, {}, {"error": {
        "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
                   "Use 'max_completion_tokens' instead.", "type": "invalid_request_error",
        "param": "max_tokens", "code": "unsupported_parameter"}}), _openai_ok("ok")]
    assert _llm_agent({"base_url": llm_server.url, "model": "new-model"}).invoke("x", {}) == "ok"
    bodies = [r["body"] for r in llm_server.requests]
    assert "max_tokens" in bodies[0] and bodies[1]["max_completion_tokens"] == 1000
    assert "max_tokens" not in bodies[1]


def test_openai_refusal_is_error(llm_server, llm_render):
    llm_server.replies.append((200, {}, {"choices": [{"message": {
        "role": "assistant", "content": None, "refusal": "I can't help with that."}}]}))
    with pytest.raises(actor.ExecutionError, match="refused"):
        _llm_agent({"base_url": llm_server.url}).invoke("x", {})


# HOST -- providers: Anthropic Messages -------------------------------------------------------
def test_anthropic_wire_format(llm_server, llm_render):
    llm_server.replies.append((200, {}, {
        "id": "m1", "type": "message", "role": "assistant", "model": "claude-x",
        "stop_reason": "end_turn", "content": [{"type": "thinking", "thinking": "hm"},
                                               {"type": "text", "text": "Hel"},
                                               {"type": "text", "text": "lo"}]}))
    rt = _llm_rt({"ANTHROPIC_API_KEY": LLM_KEY, "ANTHROPIC_BASE_URL": llm_server.url + "/v1"})
    agent = _llm_agent({"provider": "anthropic", "model": "claude-x", "temperature": 1.5,
                        "system_prompt": "Sys", "response_format": SCHEMA_RF}, rt)
    assert agent.invoke("hi", {}) == "Hello"
    req = llm_server.requests[0]
    assert req["path"] == "/v1/messages"
    assert req["headers"]["x-api-key"] == LLM_KEY
    assert req["headers"]["anthropic-version"] == actor.ANTHROPIC_VERSION
    assert req["body"] == {"model": "claude-x", "max_tokens": 1000, "temperature": 1.0,
                           "system": "Sys", "messages": [{"role": "user", "content": "hi"}],
                           "output_config": {"format": {
                               "type": "json_schema",
                               "schema": SCHEMA_RF["json_schema"]["schema"]}}}


def test_anthropic_deprecated_temperature_dropped_once(llm_server, llm_render):
    llm_server.replies += [
        (400, {}, {"type": "error", "error": {"type": "invalid_request_error",
                                              "message": "`temperature` is deprecated for this model."}}),
        (200, {}, {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"})]
    rt = _llm_rt({"ANTHROPIC_API_KEY": "k"})
    assert _llm_agent({"provider": "anthropic", "base_url": llm_server.url}, rt).invoke("x", {}) == "ok"
    assert "temperature" in llm_server.requests[0]["body"]
    assert "temperature" not in llm_server.requests[1]["body"]


def test_anthropic_structured_output_falls_back_to_forced_tool(llm_server, llm_render):
    llm_server.replies += [
        (400, {}, {"type": "error", "error": {"type": "invalid_request_error",
                                              "message": "output_config: Extra inputs are not "
                                                         "permitted"}}),
        (200, {}, {"content": [{"type": "tool_use", "id": "t1", "name": "structured_output",
                                "input": {"x": "y"}}], "stop_reason": "tool_use"})]
    agent = _llm_agent({"provider": "anthropic", "base_url": llm_server.url,
                        "response_format": SCHEMA_RF}, _llm_rt({"ANTHROPIC_API_KEY": "k"}))
    assert json.loads(agent.invoke("x", {})) == {"x": "y"}
    second = llm_server.requests[1]["body"]
    assert "output_config" not in second
    assert second["tools"][0]["input_schema"] == SCHEMA_RF["json_schema"]["schema"]
    assert second["tool_choice"] == {"type": "tool", "name": "structured_output"}


def test_anthropic_529_overloaded_is_retried(llm_server, llm_render):
    overloaded = (529, {}, {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}})
    llm_server.replies += [overloaded, overloaded,
                           (200, {}, {"content": [{"type": "text", "text": "ok"}]})]
    agent = _llm_agent({"provider": "anthropic", "base_url": llm_server.url},
                       _llm_rt({"ANTHROPIC_API_KEY": "k"}))
    waits = _sleeps(agent)
    assert agent.invoke("x", {}) == "ok"
    assert waits == [0.5, 1.0] and len(llm_server.requests) == 3


def test_anthropic_spend_limit_not_retried(llm_server, llm_render):
    llm_server.replies.append((429, {"retry-after": "1"}, {"type": "error", "error": {
        "type": "rate_limit_error", "message": "spend limit",
        "details": {"error_code": "enforced_spend_limit_reached"}}}))
    agent = _llm_agent({"provider": "anthropic", "base_url": llm_server.url},
                       _llm_rt({"ANTHROPIC_API_KEY": "k"}))
    waits = _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="enforced_spend_limit_reached"):
        agent.invoke("x", {})
    assert waits == [] and len(llm_server.requests) == 1


# HOST -- providers: Gemini generateContent ---------------------------------------------------
def test_google_wire_format(llm_server, llm_render):
    llm_server.replies.append((200, {}, {"candidates": [{"index": 0, "finishReason": "STOP",
                                                         "content": {"role": "model", "parts": [
                                                             {"text": "thinking", "thought": True},
                                                             {"text": "{\"x\": \"y\"}"}]}}]}))
    rt = _llm_rt({"GOOGLE_API_KEY": LLM_KEY, "GOOGLE_BASE_URL": llm_server.url})
    agent = _llm_agent({"provider": "google", "model": "gemini-2.0-flash", "system_prompt": "S",
                        "memory_enabled": True, "response_format": SCHEMA_RF}, rt)
    agent.memory.record("u0", "a0")
    assert agent.invoke("hi", {}) == '{"x": "y"}'
    req = llm_server.requests[0]
    assert req["path"] == "/v1beta/models/gemini-2.0-flash:generateContent"
    assert req["headers"]["x-goog-api-key"] == LLM_KEY and LLM_KEY not in req["path"]
    assert req["body"] == {
        "contents": [{"role": "user", "parts": [{"text": "u0"}]},
                     {"role": "model", "parts": [{"text": "a0"}]},
                     {"role": "user", "parts": [{"text": "hi"}]}],
        "systemInstruction": {"parts": [{"text": "S"}]},
        "generationConfig": {"temperature": 0.7, "maxOutputTokens": 1000,
                             "responseMimeType": "application/json",
                             "responseJsonSchema": SCHEMA_RF["json_schema"]["schema"]}}


def test_google_bad_key_error_not_retried_and_scrubbed(llm_server, llm_render):
    llm_server.replies.append((400, {}, {"error": {
        "code": 400, "message": f"API key not valid: {LLM_KEY}", "status": "INVALID_ARGUMENT",
        "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                     "reason": "API_KEY_INVALID"}]}}))
    agent = _llm_agent({"provider": "google", "base_url": llm_server.url},
                       _llm_rt({"GOOGLE_API_KEY": LLM_KEY}))
    with pytest.raises(actor.ExecutionError) as info:
        agent.invoke("x", {})
    text = str(info.value)
    assert "google: HTTP 400 INVALID_ARGUMENT/API_KEY_INVALID" in text
    assert LLM_KEY not in text and "***" in text and len(llm_server.requests) == 1


def test_google_retry_info_delay(llm_server, llm_render):
    llm_server.replies += [(429, {}, {"error": {
        "code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED",
        "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}]}}),
        (200, {}, {"candidates": [{"content": {"parts": [{"text": "ok"}]}}]})]
    agent = _llm_agent({"provider": "google", "base_url": llm_server.url},
                       _llm_rt({"GOOGLE_API_KEY": "k"}))
    waits = _sleeps(agent)
    assert agent.invoke("x", {}) == "ok" and waits == [7.0]


def test_google_blocked_prompt_is_error(llm_server, llm_render):
    llm_server.replies.append((200, {}, {"promptFeedback": {"blockReason": "SAFETY"}}))
    agent = _llm_agent({"provider": "google", "base_url": llm_server.url},
                       _llm_rt({"GOOGLE_API_KEY": "k"}))
    with pytest.raises(actor.ExecutionError, match="SAFETY"):
        agent.invoke("x", {})


# HOST -- providers: retries, errors, key hygiene ---------------------------------------------
def test_retry_after_headers_honoured(llm_server, llm_render):
    llm_server.replies += [(429, {"retry-after": "3"}, {"error": {"code": "rate_limit_exceeded",
                                                                   "message": "slow"}}),
                           (503, {"retry-after-ms": "250"}, {"error": {"message": "busy"}}),
                           _openai_ok("ok")]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    assert agent.invoke("x", {}) == "ok"
    assert waits == [3.0, 0.25]


def test_retries_are_bounded_and_report_last_error(llm_server, llm_render):
    llm_server.replies += [(500, {}, {"error": {"message": f"fail {i}"}}) for i in range(5)]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="openai: HTTP 500: fail 2"):
        agent.invoke("x", {})
    assert len(llm_server.requests) == 3 and waits == [0.5, 1.0]


def test_x_should_retry_false_and_insufficient_quota_not_retried(llm_server, llm_render):
    llm_server.replies += [(503, {"x-should-retry": "false"}, {"error": {"message": "no"}}),
                           (429, {}, {"error": {"code": "insufficient_quota", "message": "pay"}})]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    for _ in range(2):
        with pytest.raises(actor.ExecutionError):
            agent.invoke("x", {})
    assert waits == [] and len(llm_server.requests) == 2


def test_vendor_error_text_and_key_scrubbed(llm_server, llm_render, caplog):
    llm_server.replies.append((401, {}, {"error": {
        "message": f"Incorrect API key provided: {LLM_KEY}.", "type": "invalid_request_error",
        "code": "invalid_api_key"}}))
    agent = _llm_agent({"base_url": llm_server.url})
    with caplog.at_level("DEBUG"):
        with pytest.raises(actor.ExecutionError) as info:
            agent.invoke("x", {})
    text = str(info.value)
    assert "agent 'a' (llm): openai: HTTP 401 invalid_api_key: Incorrect API key provided" in text
    assert LLM_KEY not in text and LLM_KEY not in caplog.text and LLM_KEY not in repr(info.value)


def test_malformed_json_reply_is_execution_error(llm_server, llm_render):
    llm_server.replies.append((200, {}, b"{not json"))
    with pytest.raises(actor.ExecutionError, match="malformed JSON"):
        _llm_agent({"base_url": llm_server.url}).invoke("x", {})
    llm_server.replies.append((200, {}, {"unexpected": True}))
    with pytest.raises(actor.ExecutionError, match="unexpected reply"):
        _llm_agent({"base_url": llm_server.url}).invoke("x", {})


def test_connection_error_retried_then_reported(llm_render):
    server = _LLMServer()
    url = server.url
    server.close()                      # nothing listens there now
    agent = _llm_agent({"base_url": url})
    waits = _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="connection error"):
        agent.invoke("x", {})
    assert waits == [0.5, 1.0]


def test_request_timeout(llm_server, llm_render, monkeypatch):
    monkeypatch.setattr(actor, "LLM_REQUEST_TIMEOUT", 0.05)
    monkeypatch.setattr(actor, "LLM_MAX_RETRIES", 0)
    llm_server.delay = 0.25
    llm_server.replies.append(_openai_ok("late"))
    with pytest.raises(actor.ExecutionError, match="timed out"):
        _llm_agent({"base_url": llm_server.url}).invoke("x", {})


def test_fake_transport_scripted_then_echo():
    transport = actor.FakeTransport({"a": ["one", 2]})
    request = {"agent": "a", "provider": "openai", "messages": [{"role": "user", "content": "hi"}]}
    assert [transport.complete(request) for _ in range(3)] == ["one", "2", "hi"]
    assert transport.complete(dict(request, agent="other")) == "hi"


# §12.4 Tool command processing in outputs ----------------------------------------------------
@pytest.fixture
def fake_tools(monkeypatch):
    calls = []

    def run(rt, name, args, ctx, agent=None):
        calls.append((name, args))
        if name == "json_parse":
            raise actor.ExecutionError("tool failed")
        return f"<{name}:{args.get('text', '')}>"

    monkeypatch.setattr(actor, "run_builtin_tool", run, raising=False)
    monkeypatch.setattr(actor, "BUILTIN_TOOLS", {"echo": run, "math": run, "json_parse": run,
                                                 "shell": run}, raising=False)
    return calls


def test_tool_blocks_reverse_order_and_multiline(fake_tools):
    text = ('A [TOOL_EXECUTE:echo] {"text": "one"} [/TOOL_EXECUTE] B '
            '[TOOL_EXECUTE:math]\n{\n  "text": "two"\n}\n[/TOOL_EXECUTE] C')
    out = actor.process_tool_blocks(_llm_rt(), text, ["echo", "math"], {})
    assert out == "A <echo:one> B <math:two> C"
    assert [name for name, _ in fake_tools] == ["math", "echo"]


def test_tool_block_sanitising(fake_tools):
    text = '[TOOL_EXECUTE:echo] {"text": "line1\nline2\t\\section "quoted" end"} [/TOOL_EXECUTE]'
    out = actor.process_tool_blocks(_llm_rt(), text, ["echo"], {})
    assert out == '<echo:line1\nline2\t\\section "quoted" end>'
    assert actor.sanitize_tool_payload('{"a": "x\\ny"}') == '{"a": "x\\\\ny"}'


def test_tool_block_errors_substituted(fake_tools):
    rt = _llm_rt()
    out = actor.process_tool_blocks(rt, "[TOOL_EXECUTE:echo] {broken [/TOOL_EXECUTE]", ["echo"], {})
    assert out.startswith("Error executing tool 'echo': invalid JSON")
    out = actor.process_tool_blocks(rt, '[TOOL_EXECUTE:math] {"text": "1"} [/TOOL_EXECUTE]',
                                    ["echo"], {})
    assert out == "Error executing tool 'math': the tool is not allowed for this agent"
    out = actor.process_tool_blocks(rt, '[TOOL_EXECUTE:json_parse] {} [/TOOL_EXECUTE]!',
                                    ["json_parse"], {})
    assert out == "Error executing tool 'json_parse': tool failed!"
    assert actor.process_tool_blocks(rt, '[TOOL_EXECUTE:echo] [1] [/TOOL_EXECUTE]', ["echo"], {}) \
        == '[TOOL_EXECUTE:echo] [1] [/TOOL_EXECUTE]'


def test_tool_execute_is_opt_in_and_checked(fake_tools, llm_render):
    reply = '[TOOL_EXECUTE:echo] {"text": "x"} [/TOOL_EXECUTE]'
    rt = _llm_rt(llm_transport=actor.FakeTransport({"a": [reply], "b": [reply]}))
    assert _llm_agent({}, rt).invoke("q", {}) == reply
    agent = _llm_agent({"tool_execute": True, "tools": ["echo"]}, rt, name="b")
    assert agent.invoke("q", {}) == "<echo:x>" and "tool-execution" in agent.capabilities
    for config in ({"tool_execute": True}, {"tool_execute": True, "tools": ["nope"]},
                   {"tool_execute": True, "tools": ["shell"]}):
        with pytest.raises(actor.ConfigurationError):
            _llm_agent(config, rt, name="c")


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
# [graphs]


# =====================================================================================
# §8, §9.2 Templating (templating)
# =====================================================================================
# [templating]


# =====================================================================================
# §13.2 Sandboxes (sandbox)
# =====================================================================================
# [sandbox]
