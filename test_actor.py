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
# [graphs]


# =====================================================================================
# §8, §9.2 Templating (templating)
# =====================================================================================
import copy  # noqa: E402  (Phase B tests copy fixtures)
import json  # noqa: E402


def _mustache_spec_dir():
    for base in (HERE, *HERE.parents):
        folder = base / "shared" / "conformance" / "mustache-spec"
        if folder.is_dir():
            return folder
    return None


MUSTACHE_SPEC = _mustache_spec_dir()
MUSTACHE_REQUIRED = ("comments", "interpolation", "sections", "inverted")
MUSTACHE_SHOULD = ("delimiters", "partials")


def _mustache_cases():
    import json
    cases = []
    if MUSTACHE_SPEC is None:
        return cases
    for module in MUSTACHE_REQUIRED + MUSTACHE_SHOULD:
        path = MUSTACHE_SPEC / f"{module}.json"
        if path.exists():
            for test in json.loads(path.read_text(encoding="utf-8"))["tests"]:
                cases.append(pytest.param(test, id=f"{module}: {test['name']}"))
    return cases


@pytest.mark.conformance
@pytest.mark.skipif(MUSTACHE_SPEC is None, reason="shared/conformance/mustache-spec not present")
@pytest.mark.parametrize("case", _mustache_cases())
def test_mustache_conformance(case):
    """The official Mustache spec data, read in place. The optional `~` modules (lambdas,
    dynamic names, inheritance) are not read: §9.2 MUSTACHE promises none of them."""
    got = actor.render(case["template"], case["data"], "MUSTACHE", case.get("partials"))
    assert got == case["expected"], case["desc"]


def test_mustache_optional_modules_are_skipped_by_name():
    if MUSTACHE_SPEC is None:
        pytest.skip("shared/conformance/mustache-spec not present")
    optional = sorted(p.name for p in MUSTACHE_SPEC.glob("~*.json"))
    read = {f"{m}.json" for m in MUSTACHE_REQUIRED + MUSTACHE_SHOULD}
    assert optional and not read & set(optional)


# §9.2 JINJA2 ---------------------------------------------------------------------------------
def test_jinja2_keeps_trailing_newline_q59():
    assert actor.render("Hi {{ n }}\n", {"n": "A"}) == "Hi A\n"
    assert actor.render("plain\n\n", {}) == "plain\n\n"


def test_jinja2_undefined_fails_when_printed_but_is_false_in_conditions_q50():
    with pytest.raises(actor.TemplateError):
        actor.render("{{ missing }}", {})
    with pytest.raises(actor.TemplateError):
        actor.render("{{ missing.attr }}", {})
    assert actor.render("{% if missing %}x{% else %}y{% endif %}", {}) == "y"
    assert actor.render("{% if ctx.n > 5 %}x{% endif %}ok", {"ctx": {}}) == "ok"
    assert actor.render("{{ missing | default('d') }}", {}) == "d"


def test_jinja2_sandbox_blocks_python_internals():
    with pytest.raises(actor.TemplateError):
        actor.render("{{ ''.__class__.__mro__[1].__subclasses__() }}", {})


def test_jinja2_compiles_each_text_once():
    actor.jinja_template.cache_clear()
    for _ in range(3):
        actor.render("{{ a }}-{{ b }}", {"a": 1, "b": 2})
    info = actor.jinja_template.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_builtins_of_8_3_table():
    text = ("{{ range(3) | list }} {{ len('abc') }} {{ enumerate('ab') | list }} "
            "{{ zip([1, 2], 'ab') | list }} {{ min(3, 1) }} {{ max([3, 9]) }} {{ sum([1, 2]) }} "
            "{{ abs(-2) }} {{ round(2.6) }} {{ int('7') }} {{ float('1.5') }} {{ str(3) }} "
            "{{ bool(0) }} {{ list('ab') }} {{ dict(a=1) }}")
    assert actor.render(text, {}) == ("[0, 1, 2] 3 [(0, 'a'), (1, 'b')] [(1, 'a'), (2, 'b')] 1 9 3 "
                                     "2 3 7 1.5 3 False ['a', 'b'] {'a': 1}")


def test_filter_tojson_is_single_line_plain_json_q58():
    out = actor.render("{{ v | tojson }}", {"v": {"a": "<b> & 'c'", "n": [1, None]}})
    assert out == '{"a": "<b> & \'c\'", "n": [1, null]}'
    assert actor.render("{{ v | yaml }}", {"v": "x"}) == '"x"'
    assert actor.render("{{ v | tojson }}", {"v": None}) == "null"


def test_filter_indent_leaves_first_line_q57():
    assert actor.render("{{ t | indent(2) }}", {"t": "a\nb\n\nc"}) == "a\n  b\n\n  c"
    assert actor.render("{{ t | indent(2, true) }}", {"t": "a\nb"}) == "  a\n  b"


def test_filter_sum_attribute_and_selectattr_operators():
    items = [{"n": "a", "v": 1}, {"n": "b", "v": 2}, {"n": "c", "v": 3}]
    assert actor.render("{{ items | sum('v') }}", {"items": items}) == "6"
    assert actor.render("{{ items | sum(attribute='v') }}", {"items": items}) == "6"
    expected = {"==": "b", "!=": "ac", ">": "c", "<": "a", ">=": "bc", "<=": "ab"}
    for op, names in expected.items():
        text = "{% for i in items | selectattr('v', '" + op + "', 2) %}{{ i.n }}{% endfor %}"
        assert actor.render(text, {"items": items}) == names, op
    with pytest.raises(actor.TemplateError):
        actor.render("{{ items | selectattr('v', '~', 2) | list }}", {"items": items})


def test_filter_default_treats_none_as_missing_q56():
    assert actor.render("{{ v | default('x') }}", {"v": None}) == "x"
    assert actor.render("{{ v | default('x') }}", {"v": ""}) == ""
    assert actor.render("{{ v | default('x', true) }}", {"v": ""}) == "x"


def test_filter_length_split_and_standard_filters():
    assert actor.render("{{ 'a,b' | split(',') | length }}", {}) == "2"
    assert actor.render("{{ 'a b' | split }}", {}) == "['a', 'b']"
    assert actor.render("{{ ' Hi ' | trim | upper }} {{ ['a', 'b'] | join('+') }}", {}) == "HI a+b"


def test_render_rejects_unknown_engine_and_non_mapping_variables():
    with pytest.raises(actor.TemplateError):
        actor.render("x", {}, engine="ERB")
    with pytest.raises(actor.TemplateError):
        actor.render("x", ["a"], engine="JINJA2")
    assert actor.render("{{ n }}", {"n": 1}, engine="jinja2") == "1"


# §9.2 MUSTACHE -------------------------------------------------------------------------------
def test_mustache_core_forms():
    data = {"name": "<b>", "a": {"b": {"c": "deep"}}, "items": [1, 2], "no": False,
            "person": {"first": "Ada"}}
    text = ("{{name}}|{{{name}}}|{{& name}}|{{a.b.c}}|{{#items}}[{{.}}]{{/items}}|"
            "{{^no}}none{{/no}}|{{#person}}{{first}}{{/person}}|{{! comment }}end")
    assert actor.render(text, data, "MUSTACHE") == (
        "&lt;b&gt;|<b>|<b>|deep|[1][2]|none|Ada|end")


def test_mustache_root_may_be_any_value():
    assert actor.render("{{#.}}<{{.}}>{{/.}}", ["x", "y"], "MUSTACHE") == "<x><y>"
    assert actor.render("{{.}}!", "hi", "MUSTACHE") == "hi!"


def test_mustache_standalone_lines_delimiters_and_partials():
    text = "begin\n  {{#show}}\n  line\n  {{/show}}\n{{=<% %>=}}\n<% x %>\n  <%> part %>\nend"
    out = actor.render(text, {"show": True, "x": 1, "y": 2}, "MUSTACHE",
                       partials={"part": "p{{y}}\nq\n"})
    assert out == "begin\n  line\n1\n  p2\n  q\nend"


def test_mustache_errors_are_template_errors():
    for text in ("{{#a}}open", "{{/a}}", "{{name", "{{=<% =}}"):
        with pytest.raises(actor.TemplateError):
            actor.render(text, {"a": 1}, "MUSTACHE")


# §9.2 SIMPLE ---------------------------------------------------------------------------------
def test_simple_format_pass_and_unknown_names():
    variables = {"name": "Ada", "team": {"city": "Rome", "zip": [1, 2]}}
    assert actor.render("Hi {name} of {team[city]}, {team.zip[1]}", variables, "SIMPLE") == \
        "Hi Ada of Rome, 2"
    with pytest.raises(actor.TemplateError, match="unknown name"):
        actor.render("Hi {nobody}", {}, "SIMPLE")
    with pytest.raises(actor.TemplateError):
        actor.render("{name.__class__}", {"name": "x"}, "SIMPLE")


@pytest.mark.skipif(not hasattr(actor, "eval_expression_text"),
                    reason="needs the sandbox's eval_expression_text (§13.2.2)")
def test_simple_expression_pass_uses_the_expression_sandbox():
    assert actor.render("{{ n * 2 }} and {n}", {"n": 21}, "SIMPLE") == "42 and 21"
    with pytest.raises(actor.TemplateError):
        actor.render("{{ __import__('os') }}", {}, "SIMPLE")


# §8.1-§8.5 Phase A ---------------------------------------------------------------------------
def test_has_template_syntax():
    assert actor.has_template_syntax("a {{ b }}") and actor.has_template_syntax("{% if %}")
    assert actor.has_template_syntax("{# c #}") and not actor.has_template_syntax("{a: {b: 1}}")


def test_protection_covers_plain_quoted_and_block_scalars():
    text = ("agents:\n  a:\n    config:\n      system_prompt: Hi {{ context.x }}\n"
            "      model: \"{{ m }}\"\n  b:\n    config:\n      system_prompt: \"{{ message }}\"\n"
            "  c:\n    config:\n      system_prompt: |\n        {% if context.y %}\n"
            "        y\n        {% endif %}\n      prompt: >\n        {{ message }}\n"
            "prompts:\n  p:\n    content: '{{ context.z }}'\n")
    out = actor.protect_runtime_fields(text)
    assert "{{ m }}" in out                   # not a runtime field: Phase A renders it
    assert out.count(actor.TEMPLATE_START) == 4 and out.count(actor.BLOCK_START) == 2
    assert actor.restore_markers(out) == text


def test_protection_leaves_names_bound_at_phase_a_q47():
    text = ("{% set ms = ['x', 'y'] %}\nagents:\n{% for m in ms %}\n  w{{ loop.index }}:\n"
            "    config:\n      system_prompt: |\n        I am {{ m }} #{{ loop.index }} of "
            "{{ ms | length }} for {{ context.user }} and {{ who }}\n{% endfor %}\n")
    out = actor.protect_runtime_fields(text)
    assert "{{ m }}" in out and "{{ loop.index }} of" in out and "{{ ms | length }}" in out
    assert "{{ context.user }}" not in out and "{{ who }}" not in out
    out = actor.protect_runtime_fields(text, {"who": "W", "context": {}})
    assert "{{ who }}" in out and "{{ context.user }}" not in out


def test_protection_keeps_template_bodies_whole_q49():
    text = ("templates:\n  agents:\n    t:\n      parameters: {m: {type: string}}\n"
            "      type: llm\n      config:\n        model: \"{{ m }}\"\n"
            "template_strings:\n  agents:\n    s: |\n      {% for i in range(2) %}\n"
            "      w{{ i }}: {type: llm}\n      {% endfor %}\nagents: {}\n")
    out = actor.protect_runtime_fields(text)
    assert "{{" not in out and "{%" not in out


def test_structural_statement_in_templates_is_rejected_q3():
    text = ("templates:\n  agents:\n    t:\n      type: llm\n      config:\n"
            "        {% if x %}\n        model: a\n        {% endif %}\n"
            "        system_prompt: |\n          {% if y %}ok{% endif %}\n")
    with pytest.raises(actor.ConfigurationError) as info:
        actor.render_document(text, None, "JINJA2")
    assert info.value.line == 6
    actor.render_document(text.replace("        {% if x %}\n", "").replace(
        "        {% endif %}\n", ""), None, "JINJA2")


def test_render_document_strips_comments_honours_raw_and_locates_failures():
    text = "{# gone #}\na: {{ 1 + 1 }}\nb: '{% raw %}{{ keep }}{% endraw %}'\n"
    assert actor.render_document(text, None, "JINJA2") == "\na: 2\nb: '{{ keep }}'\n"
    assert actor.render_document("a: 1\n", None, "JINJA2") == "a: 1\n"
    with pytest.raises(actor.ConfigurationError) as info:
        actor.render_document("a: 1\nb: {{ nope }}\n", None, "JINJA2")
    assert info.value.line == 2 and info.value.section == "8.12"
    assert actor.render_document("n: {{ n }}\n", {"n": 3}, "JINJA2") == "n: 3\n"


def test_restore_sentinels_in_keys_and_values():
    s, e = actor.TEMPLATE_START, actor.TEMPLATE_END
    data = {f"k{s}x{e}": [f"{actor.BLOCK_START} if a {actor.BLOCK_END}", 3]}
    assert actor.restore_sentinels(data) == {"k{{x}}": ["{% if a %}", 3]}


def test_reserved_template_keys_rejected_anywhere():
    for key in actor.RESERVED_TEMPLATE_KEYS:
        doc = actor.Doc({"agents": {"a": {"type": "llm", "config": {key: True}}}})
        with pytest.raises(actor.ConfigurationError) as info:
            actor.check_reserved_template_keys(doc)
        assert info.value.path == f"agents.a.config.{key}"


def test_without_jinja2_only_configs_that_need_it_fail(monkeypatch):
    actor.jinja_environment.cache_clear()
    actor.jinja_template.cache_clear()
    monkeypatch.setattr(actor, "jinja2", None)
    try:
        with pytest.raises(actor.TemplateError, match="pip install jinja2"):
            actor.render("{{ a }}", {"a": 1})
        assert actor.render("{{a}}", {"a": 1}, "MUSTACHE") == "1"
        assert actor.render_document("a: 1\n", None, "JINJA2") == "a: 1\n"
    finally:
        actor.jinja_environment.cache_clear()
        actor.jinja_template.cache_clear()


def test_protection_in_flow_and_json_documents():
    import json as _json
    doc = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
                                          "type": "chain", "config": {"steps": ["{{ d }}"]}}}},
           "agents": {"a": {"type": "llm", "config": {"system_prompt": "{{ context.x }}",
                                                      "model": "{{ 'gpt' }}"}}}}
    out = actor.render_document(_json.dumps(doc), None, "JINJA2")
    data = actor.restore_sentinels(_json.loads(out))
    assert data["templates"] == doc["templates"]
    assert data["agents"]["a"]["config"] == {"system_prompt": "{{ context.x }}", "model": "gpt"}


def test_phase_a_under_mustache_protects_runtime_fields():
    text = ("{% set who = 'Ada' %}\nagents:\n  a:\n    config:\n"
            "      system_prompt: \"{{ who }} {{#context.x}}{{message}}{{/context.x}} {{ 1 + 1 }}\"\n")
    out = actor.render_document(text, None, "MUSTACHE")
    assert "Ada {{#context.x}}{{message}}{{/context.x}} {{ 1 + 1 }}" in actor.restore_markers(out)
    out = actor.render_document(text, None, "JINJA2")
    assert "{{ 1 + 1 }}" not in actor.restore_markers(out)


# §8.6-§8.10 Phase B --------------------------------------------------------------------------
def _expand(data, engine="JINJA2"):
    doc = actor.Doc(data)
    actor.expand_templates(doc, None, engine=engine)
    return doc.data


def _one_param(ptype, value, **decl):
    data = {"templates": {"agents": {"t": {
        "parameters": {"p": {"type": ptype, **decl}}, "type": "llm",
        "config": {"v": "{{ p | tojson }}"}}}},
        "agents": {"a": {"template": "t", "params": {"p": value}}}}
    rendered = _expand(data)["agents"]["a"]["config"]["v"]
    return json.loads(rendered) if isinstance(rendered, str) else rendered


@pytest.mark.parametrize("ptype, value, expected", [
    ("string", 42, "42"), ("string", True, "true"),
    ("int", "42", 42), ("int", 7.0, 7), ("float", "3.5", 3.5), ("float", 2, 2.0),
    ("boolean", "YES", True), ("boolean", "on", True), ("boolean", "1", True),
    ("boolean", "off", False), ("boolean", "False", False), ("boolean", "0", False),
    ("boolean", "maybe", True), ("boolean", 0, False), ("boolean", [], False),
    ("list", "x", ["x"]), ("list", [1, 2], [1, 2]), ("dict", {"a": 1}, {"a": 1}),
])
def test_parameter_type_coercions_8_6_2(ptype, value, expected):
    assert _one_param(ptype, value) == expected


def test_parameter_mismatches_are_configuration_errors():
    for ptype, value, extra in (("int", "x", {}), ("float", "x", {}), ("int", True, {}),
                                ("int", "2.5", {}),
                                ("enum", "z", {"values": ["a", "b"]})):
        with pytest.raises(actor.ConfigurationError) as info:
            _one_param(ptype, value, **extra)
        assert info.value.path == "agents.a.params.p"
    assert _one_param("enum", "b", values=["a", "b"]) == "b"
    with pytest.raises(actor.ConfigurationError):
        _one_param("colour", "x")
    with pytest.raises(actor.ConfigurationError):
        _one_param("enum", "a")          # enum without values


def test_required_missing_default_filled_and_sequence_form_rejected():
    base = {"templates": {"agents": {"t": {
        "parameters": {"need": {"type": "string", "required": True},
                       "opt": {"type": "int", "default": "5"}},
        "type": "llm", "config": {"a": "{{ need }}", "b": "{{ opt }}"}}}}}
    with pytest.raises(actor.ConfigurationError) as info:
        _expand({**base, "agents": {"x": {"template": "t"}}})
    assert info.value.path == "agents.x.params"
    out = _expand({**copy.deepcopy(base), "agents": {"x": {"template": "t", "params": {"need": "n"}}}})
    assert out["agents"]["x"] == {"type": "llm", "config": {"a": "n", "b": 5}}
    bad = copy.deepcopy(base)
    bad["templates"]["agents"]["t"]["parameters"] = [{"name": "need"}]
    with pytest.raises(actor.ConfigurationError) as info:
        _expand({**bad, "agents": {"x": {"template": "t"}}})
    assert "16.2" in info.value.section


def test_instantiation_does_not_mutate_the_template_and_drops_parameters():
    data = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
                                            "type": "llm", "config": {"s": "{{ d }}"}}}},
            "agents": {"a": {"template": "t", "params": {"d": "one"}},
                       "b": {"template": "t", "params": {"d": "two"}}}}
    out = _expand(data)
    assert out["agents"]["a"]["config"]["s"] == "one" and out["agents"]["b"]["config"]["s"] == "two"
    assert "parameters" not in out["agents"]["a"]
    assert out["templates"]["agents"]["t"]["config"]["s"] == "{{ d }}"


def test_rendered_scalars_are_coerced_step_6():
    data = {"templates": {"agents": {"t": {"parameters": {}, "type": "llm", "config": {
        "b": "{{ 'TRUE' }}", "i": "{{ 40 + 2 }}", "f": "{{ 3.25 }}", "l": "{{ [1, 2] | tojson }}",
        "m": '{{ {"k": 1} | tojson }}', "s": "{{ 'plain' }}", "literal": "42"}}}},
        "agents": {"a": {"template": "t"}}}
    cfg = _expand(data)["agents"]["a"]["config"]
    assert cfg == {"b": True, "i": 42, "f": 3.25, "l": [1, 2], "m": {"k": 1}, "s": "plain",
                   "literal": "42"}


def test_empty_if_blocks_are_removed_step_7_q52():
    data = {"templates": {"agents": {"t": {"parameters": {"mem": {"type": "boolean"}},
        "type": "llm", "config": {
            "memory_enabled": "{% if mem %}true{% endif %}",
            "tools": ["a", "{% if mem %}b{% endif %}"]}}}},
        "agents": {"on": {"template": "t", "params": {"mem": "yes"}},
                   "off": {"template": "t", "params": {"mem": "no"}}}}
    out = _expand(data)["agents"]
    assert out["on"]["config"] == {"memory_enabled": True, "tools": ["a", "b"]}
    assert out["off"]["config"] == {"tools": ["a"]}


def test_runtime_expressions_survive_phase_b_q49():
    data = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
        "type": "llm", "config": {"system_prompt":
            "{{ d }} {% if context.x %}{{ context.x }}{% endif %} {{ message }}"}}}},
        "agents": {"a": {"template": "t", "params": {"d": "law"}}}}
    prompt = _expand(data)["agents"]["a"]["config"]["system_prompt"]
    assert prompt == "law {% if context.x %}{{ context.x }}{% endif %} {{ message }}"


def test_phase_b_render_failure_is_configuration_error():
    data = {"templates": {"agents": {"t": {"parameters": {}, "type": "llm",
                                            "config": {"model": "{{ nope }}"}}}},
            "agents": {"a": {"template": "t"}}}
    with pytest.raises(actor.ConfigurationError) as info:
        _expand(data)
    assert info.value.section == "8.12"


def test_forbidden_instance_forms():
    tpl = {"agents": {"t": {"parameters": {}, "type": "llm", "config": {}}}}
    for agent, section in (({"agent_template": "t"}, "16.2"),
                           ({"agent_template": "t", "template": "t"}, "16.3"),
                           ({"template": "t", "type": "llm"}, "16.3"),
                           ({"template": "unknown"}, "8.7")):
        with pytest.raises(actor.ConfigurationError) as info:
            _expand({"templates": copy.deepcopy(tpl), "agents": {"a": agent}})
        assert info.value.section == section, agent
    out = _expand({"templates": copy.deepcopy(tpl),
                   "agents": {"a": {"template": "t", "type": "template_instance"}}})
    assert out["agents"]["a"]["type"] == "llm"


def test_route_templates_via_template_config_q54():
    graph = {"parameters": {"who": {"type": "agent_ref", "required": True}},
             "entry_point": "start", "nodes": {"n": {"type": "agent", "agent": "{{ who }}"}},
             "edges": [{"source": "start", "target": "n"}, {"source": "n", "target": "end"}]}
    base = {"templates": {"graphs": {"g": graph}}, "agents": {"x": {"type": "llm"}}}
    out = _expand({**copy.deepcopy(base), "routes": {"main": {
        "template_config": {"template": "g", "params": {"who": "x"}}}}})
    assert out["routes"]["main"]["type"] == "graph"
    assert out["routes"]["main"]["nodes"]["n"]["agent"] == "x"
    with pytest.raises(actor.ConfigurationError) as info:
        _expand({**copy.deepcopy(base), "routes": {"main": {"type": "graph", "nodes": {},
                 "template_config": {"template": "g", "params": {"who": "x"}}}}})
    assert info.value.section == "16.3"
    with pytest.raises(actor.ConfigurationError):
        _expand({**copy.deepcopy(base), "routes": {"main": {"type": "stream",
                 "template_config": {"template": "g", "params": {"who": "x"}}}}})
    with pytest.raises(actor.ConfigurationError) as info:
        _expand({**copy.deepcopy(base), "routes": {"main": {
            "template_config": {"template": "g", "params": {"who": "ghost"}}}}})
    assert info.value.section == "8.7.1"


def test_composite_scope_resolves_before_the_actor_8_7_1():
    data = {"templates": {"agents": {"wrap": {
        "parameters": {"inner": {"type": "agent_ref", "required": True}},
        "type": "chain", "config": {"steps": ["{{ inner }}"]}}}},
        "agents": {"box": {"type": "composite", "config": {
            "components": {"agents": {"local": {"type": "llm"},
                                      "w": {"template": "wrap", "params": {"inner": "local"}}}},
            "routing": {"input": {"type": "agent", "name": "w"},
                        "output": {"type": "agent", "name": "w"}}}}}}
    out = _expand(data)
    assert out["agents"]["box"]["config"]["components"]["agents"]["w"]["config"]["steps"] == ["local"]
    data["agents"]["top"] = {"template": "wrap", "params": {"inner": "local"}}
    with pytest.raises(actor.ConfigurationError):
        _expand(data)      # `local` exists only inside the composite


def test_template_strings_single_and_several_definitions_q53():
    body = ("parameters:\n  n:\n    type: int\n    default: 2\n"
            "{% for i in range(n) %}\nw{{ i }}:\n  type: llm\n{% endfor %}\n")
    single = "parameters:\n  m:\n    type: string\ntype: llm\nconfig:\n  model: {{ m }}\n"
    out = _expand({"template_strings": {"agents": {"team": body, "one": single}},
                   "agents": {"t": {"template": "team", "params": {"n": "3"}},
                              "o": {"template": "one", "params": {"m": "gpt"}}}})
    team = out["agents"]["t"]
    assert team["type"] == "composite"
    assert list(team["config"]["components"]["agents"]) == ["w0", "w1", "w2"]
    assert team["config"]["routing"]["input"]["name"] == "w0"
    assert out["agents"]["o"] == {"type": "llm", "config": {"model": "gpt"}}


def test_deprecated_instances_section_moves_into_agents_q55(caplog):
    data = {"templates": {"agents": {"t": {"parameters": {}, "type": "llm"}}},
            "instances": {"x": {"template": "t"}}, "agents": {}}
    assert _expand(data)["agents"]["x"] == {"type": "llm"}
    assert "deprecated" in caplog.text


def test_phase_b_in_mustache():
    data = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
                                            "type": "llm", "config": {"s": "In {{d}}"}}}},
            "agents": {"a": {"template": "t", "params": {"d": "law"}}}}
    assert _expand(data, "MUSTACHE")["agents"]["a"]["config"]["s"] == "In law"


# §8.11-§8.12 Phase C -------------------------------------------------------------------------
def _rt(engine="JINJA2"):
    rt = actor.Runtime(actor.Doc({}))
    rt.engine = engine
    return rt


def test_render_runtime_variables_8_11():
    rt = _rt()
    text = "{{ context.topic }}={{ topic }} {{ message }} {{ len(message) }}"
    assert actor.render_runtime(rt, text, {"topic": "T"}, "hey") == "T=T hey 3"
    assert actor.render_runtime(rt, "{{ message }}", {}, actor.Message("m")) == "m"


def test_render_runtime_failure_warns_and_returns_literal_8_12():
    rt = _rt()
    text = "Hi {{ context.who.name }}"
    assert actor.render_runtime(rt, text, {}, "x", ("agents", "a")) == text
    assert rt.warnings and "8.12" in rt.warnings[0]


def test_render_runtime_in_mustache_and_simple():
    assert actor.render_runtime(_rt("MUSTACHE"), "Hi {{context.u}} {{u}}", {"u": "Ada"}, "m") == \
        "Hi Ada Ada"
    assert actor.render_runtime(_rt("SIMPLE"), "Hi {u}: {message}", {"u": "Ada"}, "m") == "Hi Ada: m"
    rt = _rt("SIMPLE")
    assert actor.render_runtime(rt, "Hi {nobody}", {}, "m") == "Hi {nobody}" and rt.warnings


# =====================================================================================
# §13.2 Sandboxes (sandbox)
# =====================================================================================
# [sandbox]
