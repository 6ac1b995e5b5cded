#!/usr/bin/env python3
"""actor.py -- the reference interpreter for the Actor Configuration Standard 1.0.0.

Clarity over speed: one module that pins down what the standard means, laid out in the
standard's own section order so that a reader can put the spec beside the code.

Usage (Python)::

    import actor
    a = actor.load("team.yaml", provider="fake")
    print(a.send("hello").outputs[0].content)
    actor.render("Hi {{ name }}", {"name": "Ada"}, engine="MUSTACHE")

Usage (command line)::

    python actor.py CONFIG... [-m TEXT]... [--unsafe] [--provider NAME] [--set K=V]... [--json]
    python actor.py --check CONFIG...        python actor.py --describe CONFIG
    python actor.py --diagram CONFIG         python actor.py --vectors DIR [--impl "CMD"]

Glossary: msg Message, ctx context (§10), state graph state (§6.3), cfg the raw YAML mapping in
hand, path a config path tuple (('routes', 'main', 'edges', 2)), now virtual seconds, rt Runtime.

Map (every banner, in file order; test_actor.py keeps this list and the banners in sync):
    PRELUDE: §20 errors, §15 names and sentinels, §12.2.1 Message, clocks, Runtime
    §3 DOCUMENT STRUCTURE
    §4 AGENTS
    §5 ROUTES -- COMMON CONCEPTS
    §6 GRAPH ROUTES
    §7 INTER-ROUTE COMPOSITION
    §8 TEMPLATES AND INSTANCES
    §9 ACTOR PARAMETERS
    §10 CONTEXT
    §11 VALIDATION RULES
    §12 RUNTIME BEHAVIOR
    §13 SECURITY MODEL
    §14 ENVIRONMENT VARIABLE INTERPOLATION
    §15 RESERVED NAMES
    §16 FORBIDDEN PATTERNS
    HOST: providers, load / Actor / render, the vector harness, the CLI
"""
from __future__ import annotations

import copy
import heapq
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

import yaml

__version__ = "0.1.0"
SPEC_VERSION = "1.0.0"

__all__ = [
    "load", "render", "Actor", "Result", "Message",
    "ActorError", "ConfigurationError", "UnsafeConfigurationError", "AgentCreationError",
    "RoutingError", "TemplateError", "ExecutionError", "ApplicationError", "StreamRoutingError",
]

log = logging.getLogger("actor")


# =====================================================================================
# PRELUDE -- shared by several sections, so it comes first
# =====================================================================================

# §20 Error taxonomy --------------------------------------------------------------------
class ActorError(Exception):
    """Base of the §20 categories. Fields stay attributes so tests assert on them, not on wording.

    str() reads `file:line:col: Category: path: message (§x.y)`.
    """

    def __init__(self, message, *, path=None, section=None, file=None, line=None, col=None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.section = section
        self.file = file
        self.line = line
        self.col = col

    @property
    def category(self):
        return type(self).__name__

    def __str__(self):
        where = ":".join(str(x) for x in (self.file, self.line, self.col) if x is not None)
        text = f"{where}: " if where else ""
        text += f"{self.category}: "
        if self.path:
            text += f"{self.path}: "
        text += self.message
        if self.section:
            text += " (" + ", ".join("§" + s.strip().lstrip("§")
                                     for s in str(self.section).split(",")) + ")"
        return text


class ConfigurationError(ActorError):
    """Generic configuration-validation error (§20, §11)."""


class UnsafeConfigurationError(ConfigurationError):
    """The configuration requires unsafe mode; the host is in safe mode (§9.4, §13.1)."""


class AgentCreationError(ActorError):
    """An agent could not be instantiated (§4.4.1, §12.1)."""


class RoutingError(ActorError):
    """Generic routing error (§20)."""


class TemplateError(ActorError):
    """Template rendering error (§8.12, §9.2)."""


class ExecutionError(ActorError):
    """Runtime error within an agent or operator (§12.2.3)."""


class ApplicationError(ActorError):
    """Application-level error not covered above (§20)."""


class StreamRoutingError(ActorError):
    """Stream-routing or operator error (§5.3.2)."""


ERROR_CATEGORIES = {cls.__name__: cls for cls in (
    ActorError, ConfigurationError, UnsafeConfigurationError, AgentCreationError, RoutingError,
    TemplateError, ExecutionError, ApplicationError, StreamRoutingError)}


# Config paths and source locations ----------------------------------------------------
def path_str(path):
    """('routes', 'main', 'edges', 2, 'target') -> 'routes.main.edges[2].target'."""
    text = ""
    for part in path or ():
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


class Doc:
    """A loaded document: the merged data plus a path -> (file, line, col) map of YAML marks."""

    def __init__(self, data, marks=None, files=()):
        self.data = data
        self.marks = marks if marks is not None else {}
        self.files = tuple(files)

    def locate(self, path):
        """The mark of the longest known prefix of `path` (file, line, col) or (file, None, None)."""
        path = tuple(path or ())
        while path:
            if path in self.marks:
                return self.marks[path]
            path = path[:-1]
        return self.marks.get((), (self.files[-1] if self.files else None, None, None))

    def error(self, cls, path, message, section=None):
        """Build a located §20 error; callers `raise doc.error(...)`."""
        file, line, col = self.locate(path)
        return cls(message, path=path_str(path), section=section, file=file, line=line, col=col)


def warn(rt_or_none, message, *, section=None, path=None):
    """The one SHOULD-warn channel: `file:line: warning: ... (§x.y)` through logging."""
    where = ""
    doc = getattr(rt_or_none, "doc", None)
    if doc is not None and path is not None:
        file, line, _ = doc.locate(path)
        where = ":".join(str(x) for x in (file, line) if x is not None)
    text = (f"{where}: " if where else "") + "warning: "
    if path:
        text += path_str(path) + ": "
    text += message + (f" (§{section})" if section else "")
    if rt_or_none is not None and hasattr(rt_or_none, "warnings"):
        rt_or_none.warnings.append(text)
    log.warning(text)
    return text


# §12.2.1 Message ------------------------------------------------------------------------
class Message:
    """A unit of data flowing through routes (§2, §12.2.1)."""

    __slots__ = ("content", "metadata", "source_stream", "timestamp")

    def __init__(self, content, metadata=None, source_stream="__input__", timestamp=0.0):
        self.content = content
        self.metadata = metadata if metadata is not None else {}
        self.source_stream = source_stream
        self.timestamp = timestamp

    def copy(self, **changes):
        """§12.2.1: metadata.context by reference, every other entry copied one level deep."""
        meta = {k: (v if k == "context" else copy.copy(v)) for k, v in self.metadata.items()}
        new = Message(self.content, meta, self.source_stream, self.timestamp)
        for key, value in changes.items():
            setattr(new, key, value)
        return new

    def __repr__(self):
        return f"Message({self.content!r}, source_stream={self.source_stream!r})"


# Clocks: virtual in vectors and tests, real in the CLI (one interface) --------------------
class Timer:
    __slots__ = ("when", "seq", "fn", "cancelled")

    def __init__(self, when, seq, fn):
        self.when, self.seq, self.fn, self.cancelled = when, seq, fn, False

    def cancel(self):
        self.cancelled = True

    def __lt__(self, other):
        return (self.when, self.seq) < (other.when, other.seq)


class VirtualClock:
    """Time that moves only when told: advance(s) fires due timers in (time, sequence) order."""

    real = False

    def __init__(self):
        self._now = 0.0
        self._queue = []
        self._seq = itertools.count()
        self._lock = threading.RLock()

    def now(self):
        return self._now

    def call_at(self, when, fn):
        with self._lock:
            timer = Timer(when, next(self._seq), fn)
            heapq.heappush(self._queue, timer)
            return timer

    def call_later(self, delay, fn):
        return self.call_at(self.now() + max(0.0, delay), fn)

    def next_due(self):
        """Time of the earliest live timer, or None."""
        with self._lock:
            while self._queue and self._queue[0].cancelled:
                heapq.heappop(self._queue)
            return self._queue[0].when if self._queue else None

    def _pop_due(self, until):
        with self._lock:
            due = self.next_due()
            if due is None or due > until:
                return None
            return heapq.heappop(self._queue)

    def advance(self, seconds):
        """Move time on by `seconds`, firing every timer that falls due on the way."""
        target = self._now + max(0.0, seconds)
        while True:
            timer = self._pop_due(target)
            if timer is None:
                break
            self._now = max(self._now, timer.when)
            timer.fn()
        self._now = target

    def set_time(self, at):
        """Vectors' `at:` -- jump forward to an absolute virtual time (never backwards)."""
        if at > self._now:
            self.advance(at - self._now)


class RealClock(VirtualClock):
    """Wall-clock seconds since creation; advance() really waits."""

    real = True

    def __init__(self):
        super().__init__()
        self._t0 = time.monotonic()

    def now(self):
        return time.monotonic() - self._t0

    def advance(self, seconds):
        target = self.now() + max(0.0, seconds)
        while True:
            due = self.next_due()
            if due is not None and due <= target:
                wait = due - self.now()
                if wait > 0:
                    time.sleep(wait)
                timer = self._pop_due(self.now())
                if timer is not None:
                    timer.fn()
                continue
            rest = target - self.now()
            if rest > 0:
                time.sleep(rest)
            break

    def set_time(self, at):
        pass


# Runtime: what agents, routes and operators may reach (one per Actor) ---------------------
class Runtime:
    """Registries and host settings shared by one Actor's parts (§12.1)."""

    def __init__(self, doc, *, unsafe=False, env=None, engine="JINJA2", workdir=None,
                 clock=None, provider=None, llm_transport=None):
        self.doc = doc                      # Doc: data + marks, for located errors and warnings
        self.unsafe = bool(unsafe)          # host mode (§13.1)
        self.env = dict(os.environ) if env is None else dict(env)   # §14 and §4.4.1 read only this
        self.engine = engine                # §9.2, canonical upper case
        self.workdir = Path(workdir or os.getcwd()).resolve()      # §4.5.4 "current working directory"
        self.clock = clock or VirtualClock()
        self.provider = provider            # host override of every llm agent's provider ("fake")
        self.llm_transport = llm_transport  # vectors: a fake transport (see HOST, providers)
        self.llm_log = []                   # requests sent to providers, for vectors' llm_requests
        self.context = {}                   # §10 the live global context
        self.agents = {}                    # name -> agent (§4)
        self.graphs = {}                    # name -> GraphRoute (§6)
        self.prompts = {}                   # name -> template text (§10.4)
        self.warnings = []                  # every warning text, in order

    def error(self, cls, path, message, section=None):
        return self.doc.error(cls, path, message, section)

    def warn(self, message, *, section=None, path=None):
        return warn(self, message, section=section, path=path)


# =====================================================================================
# §3 DOCUMENT STRUCTURE
# =====================================================================================

# §3.1 File format -------------------------------------------------------------------------
# YAML 1.2 core schema on top of pyyaml (which speaks 1.1): only the 1.2 implicit types, no tags
# beyond the core ones, no duplicate keys, bounded alias expansion. The C parser is used when present;
# the resolver and the construction below are ours in both cases, so the results are identical.

_YamlLoaderBase = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader
YAML_ALIAS_BUDGET = 100_000         # constructed nodes per document, counting alias re-expansion

_CORE_TAGS = {
    "tag:yaml.org,2002:null", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float", "tag:yaml.org,2002:str", "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}
_Y12_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_Y12_FLOAT = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_Y12_BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")
_Y12_NULL = re.compile(r"~|null|Null|NULL|")


class Yaml12Loader(_YamlLoaderBase):
    """pyyaml's parser with the YAML 1.2 core-schema resolver (yes/no/on/off stay strings, 010 == 10)."""

    yaml_implicit_resolvers = {}


for _tag, _regex, _first in (
        ("tag:yaml.org,2002:bool", _Y12_BOOL, "tTfF"),
        ("tag:yaml.org,2002:int", _Y12_INT, "-+0123456789"),
        ("tag:yaml.org,2002:float", _Y12_FLOAT, "-+0123456789."),
        ("tag:yaml.org,2002:null", _Y12_NULL, ["~", "n", "N", ""])):
    Yaml12Loader.add_implicit_resolver(_tag, re.compile(rf"^(?:{_regex.pattern})$"), list(_first))


def _scalar_value(node):
    tag, text = node.tag, node.value
    if tag == "tag:yaml.org,2002:null":
        return None
    if tag == "tag:yaml.org,2002:bool":
        return text.lower() == "true"
    if tag == "tag:yaml.org,2002:int":
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text, 10)
    if tag == "tag:yaml.org,2002:float":
        low = text.lower().lstrip("+")
        if low in (".inf", "-.inf"):
            return float("-inf") if low.startswith("-") else float("inf")
        if low == ".nan":
            return float("nan")
        return float(text)
    return text


def parse_yaml(text, file=None):
    """Text -> (data, marks). marks maps a config path tuple to (file, line, col) (1-based)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"document is not UTF-8: {exc}", section="3.1", file=file)
    loader = Yaml12Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigurationError(f"document does not parse as YAML: {problem}", section="3.1",
                                 file=file, line=line, col=col) from None
    finally:
        loader.dispose()
    marks = {}
    budget = [YAML_ALIAS_BUDGET]

    def at(n):
        return (file, n.start_mark.line + 1, n.start_mark.column + 1)

    def build(n, path):
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigurationError(
                f"document expands to more than {YAML_ALIAS_BUDGET} nodes (alias bomb?)",
                section="3.1", file=file, line=at(n)[1], col=at(n)[2])
        if n.tag not in _CORE_TAGS:
            raise ConfigurationError(f"tag '{n.tag}' is not part of the YAML 1.2 core schema",
                                     path=path_str(path), section="3.1", file=file,
                                     line=at(n)[1], col=at(n)[2])
        if isinstance(n, yaml.ScalarNode):
            return _scalar_value(n)
        if isinstance(n, yaml.SequenceNode):
            items = []
            for i, item in enumerate(n.value):
                marks[path + (i,)] = at(item)
                items.append(build(item, path + (i,)))
            return items
        mapping = {}
        for key_node, value_node in n.value:
            key = build(key_node, path)
            if isinstance(key, (dict, list)):
                raise ConfigurationError("mapping keys must be scalars", path=path_str(path),
                                         section="3.1", file=file, line=at(key_node)[1],
                                         col=at(key_node)[2])
            if key in mapping:
                raise ConfigurationError(f"duplicate mapping key '{key}'",
                                         path=path_str(path + (key,)), section="3.1", file=file,
                                         line=at(key_node)[1], col=at(key_node)[2])
            marks[path + (key,)] = at(key_node)
            mapping[key] = build(value_node, path + (key,))
        return mapping

    if node is None:
        return None, marks
    marks[()] = at(node)
    return build(node, ()), marks


def deep_merge(base, extra):
    """§3.1 merge of a later file into the result so far (mappings recurse, sequences append)."""
    for key, value in extra.items():
        if key not in base:
            base[key] = value
        elif isinstance(base[key], dict) and isinstance(value, dict):
            deep_merge(base[key], value)
        elif isinstance(base[key], list) and isinstance(value, list):
            base[key] = base[key] + value
        else:
            base[key] = value
    return base


def merge_marks(marks, extra, data_before, extra_data):
    """Keep marks of the file a value came from: later files win, appended list items shift."""
    # Sequence appends move the later file's items; re-key those paths by the merged offsets.
    shifts = {}

    def walk(before, after, path):
        if isinstance(before, dict) and isinstance(after, dict):
            for key in after:
                if key in before:
                    walk(before[key], after[key], path + (key,))
        elif isinstance(before, list) and isinstance(after, list):
            shifts[path] = len(before)

    walk(data_before, extra_data, ())
    for path, mark in extra.items():
        new = list(path)
        for i in range(len(path)):
            prefix = tuple(path[:i])
            if prefix in shifts and isinstance(path[i], int):
                new[i] = path[i] + shifts[prefix]
        marks[tuple(new)] = mark

# §3.2 Top-level sections ---------------------------------------------------------------
# section -> required? Rows in the spec's order. `cleveragents` and `version` are read too: the
# former carries the §9 parameters in the spec's own examples (§9.2, §18.9), the latter is §9.6.
TOP_LEVEL_SECTIONS = {
    "agents": True, "routes": True, "merges": False, "splits": False, "templates": False,
    "instances": False, "context": False, "prompts": False, "pipelines": False,
    "template_strings": False, "name": False,
}
HOST_PARAMETER_SECTIONS = {"cleveragents", "version"}   # INTERPRETATION §9.1 (Q88)


def check_top_level(doc, rt):
    """§3.1, §11.1.1, §3.2, §16.1: the document is a mapping; known, forbidden and unknown sections."""
    if not isinstance(doc.data, dict):
        kind = "empty" if doc.data is None else type(doc.data).__name__
        raise doc.error(ConfigurationError, (), f"top-level value must be a mapping, not {kind}",
                        "3.1, §11.1")
    for key in doc.data:
        if key in FORBIDDEN_TOP_LEVEL:
            raise doc.error(ConfigurationError, (key,), f"top-level '{key}:' is forbidden; "
                            f"{FORBIDDEN_TOP_LEVEL[key]}", "16.1")
        if key not in TOP_LEVEL_SECTIONS and key not in HOST_PARAMETER_SECTIONS:
            rt.warn(f"unknown top-level section '{key}' is ignored", section="3.2", path=(key,))
    if "agents" not in doc.data:
        raise doc.error(ConfigurationError, (), "the agents section is required", "11.1")
    if not isinstance(doc.data["agents"], dict) or not doc.data["agents"]:
        raise doc.error(ConfigurationError, ("agents",),
                        "agents must be a non-empty mapping of agent definitions", "11.1, §3.3")
    routes = doc.data.get("routes")
    if routes is None:
        raise doc.error(ConfigurationError, (), "the routes section is required", "11.1")
    if isinstance(routes, list):
        raise doc.error(ConfigurationError, ("routes",), "list-form routes (from/to shorthand) are "
                        "forbidden; write routes as a mapping of name to route", "16.2, §5.1")
    if not isinstance(routes, dict) or not routes:
        raise doc.error(ConfigurationError, ("routes",), "routes must be a non-empty mapping",
                        "11.1")


# §3.4 The default router requirement ------------------------------------------------
def inputs_feed(data):
    """Routes that receive __input__ through a merge or a split (the deprecated §3.4 form)."""
    fed = []
    for merge in data.get("merges") or []:
        if isinstance(merge, dict) and "__input__" in (merge.get("sources") or []):
            fed.append(merge.get("target"))
    for split in data.get("splits") or []:
        if isinstance(split, dict) and split.get("source") == "__input__":
            fed.extend((split.get("targets") or {}).keys())
    return fed


def resolve_default_router(doc, rt, host_value):
    """§3.4, §9.3, §11.1.6: the designated route, or None when __input__ merges/splits feed routes.

    INTERPRETATION §3.4 (Q7): a merge or split from __input__ also satisfies the requirement (the
    §3.3 minimum Actor and every §18 example rely on it); with neither, a warning. A designated name
    that is not a route is an error.
    """
    params = doc.data.get("cleveragents") if isinstance(doc.data.get("cleveragents"), dict) else {}
    name = host_value if host_value is not None else params.get("default_router")
    path = ("cleveragents", "default_router") if host_value is None else ()
    if name is not None:
        if name not in doc.data["routes"]:
            raise doc.error(ConfigurationError, path,
                            f"default_router '{name}' is not a route in routes", "9.3, §3.4")
        return name
    if not inputs_feed(doc.data):
        rt.warn("no default_router is designated and no merge or split reads __input__; "
                "messages sent to the Actor reach no route", section="3.4", path=("routes",))
    return None


# =====================================================================================
# §4 AGENTS
# =====================================================================================

# §4.1 The agents section ---------------------------------------------------------------
def check_agent(doc, name, cfg, path, agent_types):
    """§4.1, §4.2, §11.1.3-4, §11.2, §15.4: one agent definition (after Phase B expansion)."""
    if not isinstance(name, str) or not name:
        raise doc.error(ConfigurationError, path, "agent names must be non-empty strings", "4.1")
    if name.startswith("__"):
        raise doc.error(ConfigurationError, path,
                        f"agent name '{name}' is reserved (names starting with __)", "4.2, §11.2")
    if not isinstance(cfg, dict):
        raise doc.error(ConfigurationError, path, "an agent definition must be a mapping",
                        "4.1, §11.1")
    if "type" not in cfg:
        raise doc.error(ConfigurationError, path, "agent has no type", "11.1")
    kind = cfg["type"]
    if kind not in agent_types:
        known = ", ".join(sorted(agent_types))
        raise doc.error(ConfigurationError, path + ("type",),
                        f"unknown agent type '{kind}' (known: {known})", "11.2, §4.3")
    if cfg.get("config") is None:
        cfg["config"] = {}
    if not isinstance(cfg["config"], dict):
        raise doc.error(ConfigurationError, path + ("config",), "config must be a mapping",
                        "11.1")
    check = AGENT_CHECKS.get(kind)
    if check is not None:
        check(doc, name, cfg["config"], path + ("config",), agent_types)


# §4.2 Agent names ---------------------------------------------------------------------
AGENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_agent_name_style(rt, name, path):
    if isinstance(name, str) and not AGENT_NAME.fullmatch(name):
        rt.warn(f"agent name '{name}' is outside [A-Za-z_][A-Za-z0-9_]*", section="4.2", path=path)

# §4.4 LLM agents ----------------------------------------------------------------------
# The §4.4 field table: field -> (accepted Python types, default). `model` defaults per provider
# (§4.4.2), `api_key` from the environment (§4.4.1).
LLM_FIELDS = {
    "provider":        ((str,),              "openai"),
    "model":           ((str,),              None),
    "temperature":     ((int, float),        0.7),
    "max_tokens":      ((int,),              1000),
    "system_prompt":   ((str,),              "You are a helpful assistant."),
    "memory_enabled":  ((bool,),             False),
    "max_history":     ((int,),              10),
    "api_key":         ((str,),              None),
    "template":        ((str,),              None),
    "template_vars":   ((dict,),             {}),
    "response_format": ((dict,),             None),
}

# Fields outside the §4.4 table that an llm agent also accepts: §4.9's per-agent context, and this
# implementation's extensions (§1.3 MAY): `base_url` (OpenAI-compatible servers) and the
# opt-in §12.4 tool-block processing (`tool_execute` + `tools`).
LLM_EXTRA_FIELDS = {
    "context":      ((dict,),  None),
    "base_url":     ((str,),   None),
    "tool_execute": ((bool,),  False),
    "tools":        ((list,),  None),
}

LLM_TEMPERATURE_RANGE = (0.0, 2.0)

# Capabilities (§4.11) every llm agent publishes; "structured-output" and "tool-execution" are
# added when the provider / configuration offers them.
LLM_CAPABILITIES = ["text-generation", "conversation", "reasoning", "analysis", "creative-writing"]


def _llm_text(content):
    """A message content as the text sent to a model: strings as they are, mappings/lists as JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, (dict, list)):
        return json.dumps(content, ensure_ascii=False)
    return "" if content is None else str(content)


class LLMAgent:
    """§4.4: an agent that answers each message by calling a language model.

    `{type: llm, config: {provider, model, temperature, max_tokens, system_prompt, memory_enabled,
    max_history, api_key, template, template_vars, response_format}}`; every field is optional.
    """

    type = "llm"

    def __init__(self, name, cfg, rt, path):
        self.name = name
        self.rt = rt
        self.path = tuple(path)
        config = cfg.get("config", {}) if isinstance(cfg, dict) else None
        config = {} if config is None else config
        cpath = self.path + ("config",)
        if not isinstance(config, dict):
            raise rt.error(ConfigurationError, cpath, "an llm agent's config must be a mapping", "4.4")
        values = _llm_check_fields(rt, config, cpath)
        self.temperature = float(values["temperature"])
        self.max_tokens = values["max_tokens"]
        self.system_prompt = values["system_prompt"]
        self.memory_enabled = values["memory_enabled"]
        self.max_history = values["max_history"]
        self.template = values["template"]
        self.template_vars = dict(values["template_vars"])
        self.response_format = values["response_format"]
        self.context = values["context"] if values["context"] is not None else {}
        if self.template is not None:
            _llm_check_template(rt, self.template, cpath + ("template",))
        if self.response_format is not None:
            check_response_format(rt, self.response_format, cpath + ("response_format",))
        # §12.4 (Q81): opt-in, limited to the declared built-in tools.
        self.tool_execute = values["tool_execute"]
        self.tools = check_tool_execute(rt, values["tools"], self.tool_execute, cpath)
        # §4.4.1: availability first, then the key (Q76).
        self.configured_provider, self.provider = resolve_provider(rt, values["provider"],
                                                                   cpath + ("provider",))
        self.model = values["model"] or DEFAULT_MODELS.get(self.configured_provider, self.provider)
        self._api_key = resolve_api_key(rt, self.provider, values["api_key"], cpath)
        self.base_url = values["base_url"]
        self.sleep = time.sleep             # retry back-off; tests inject a recorder
        self.memory = ConversationMemory(self.max_history)
        adapter = PROVIDERS[self.provider]
        self.capabilities = list(LLM_CAPABILITIES)
        if adapter.structured:
            self.capabilities.append("structured-output")
        if self.tool_execute:
            self.capabilities.append("tool-execution")
        self.metadata = {
            "name": name, "type": self.type, "capabilities": self.capabilities, "reactive": True,
            "provider": self.provider, "model": self.model, "temperature": self.temperature,
            "max_tokens": self.max_tokens, "memory_enabled": self.memory_enabled,
            "supports_structured_output": bool(adapter.structured),
        }

    def __repr__(self):  # never the key
        return f"LLMAgent({self.name!r}, provider={self.provider!r}, model={self.model!r})"

    @property
    def history(self):
        """A copy of the remembered conversation entries (§4.4.4)."""
        return self.memory.snapshot()

    def invoke(self, content, ctx):
        """§4.4: render the prompts, call the provider, remember the exchange, run §12.4 blocks."""
        rt = self.rt
        ctx = ctx if ctx is not None else {}
        message = _llm_text(content)
        view = {**self.context, **ctx}      # agent context (§4.9) under the invocation context
        system = render_system_prompt(self, view, message)
        user = message
        if self.template is not None:
            user = _llm_text(render_runtime(rt, _llm_prompt_text(rt, self.template),
                                            {**view, **self.template_vars}, message,
                                            self.path + ("config", "template")))
        temperature = effective_temperature(self, ctx)
        if self.response_format is not None:
            check_structured_support(self, self.response_format)
        history = self.memory.snapshot() if self.memory_enabled else history_from_context(ctx)
        request = {
            "agent": self.name, "provider": self.provider, "model": self.model,
            "temperature": temperature, "max_tokens": self.max_tokens, "system": system,
            "messages": history + [{"role": "user", "content": user}],
            "response_format": self.response_format,
        }
        rt.llm_log.append(copy.deepcopy(request))
        try:
            if rt.llm_transport is not None:
                reply = rt.llm_transport.complete(request)
            else:
                reply = PROVIDERS[self.provider].complete(
                    request, key=self._api_key, base_url=self._base_url(), sleep=self.sleep)
        except ExecutionError as exc:
            raise ExecutionError(f"agent '{self.name}' (llm): {scrub_key(exc.message, self._api_key)}",
                                 section=exc.section or "4.4") from None
        output = reply
        if self.tool_execute:
            output = process_tool_blocks(rt, reply, self.tools, ctx)
        if self.memory_enabled:
            self.memory.record(user, output)
        return output

    def _base_url(self):
        """Agent `base_url` > the provider's *_BASE_URL variables in rt.env > the vendor default."""
        if self.base_url:
            return self.base_url
        adapter = PROVIDERS[self.provider]
        for var in adapter.base_envs:
            if self.rt.env.get(var):
                return self.rt.env[var]
        return adapter.default_base


def _llm_check_fields(rt, config, cpath):
    """Type-check every known field, warn about unknown ones; returns field -> value (defaults in)."""
    known = {**LLM_FIELDS, **LLM_EXTRA_FIELDS}
    values = {}
    for field, (types, default) in known.items():
        if field not in config or config[field] is None:
            values[field] = copy.deepcopy(default)
            continue
        value = config[field]
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            kind = " or ".join(t.__name__ for t in types).replace("dict", "mapping")
            raise rt.error(ConfigurationError, cpath + (field,),
                           f"'{field}' must be a {kind}, not {type(value).__name__}", "4.4")
        values[field] = value
    low, high = LLM_TEMPERATURE_RANGE
    # INTERPRETATION §4.4 (Q77): a temperature outside [0.0, 2.0] is rejected at load.
    if not low <= values["temperature"] <= high:
        raise rt.error(ConfigurationError, cpath + ("temperature",),
                       f"temperature {values['temperature']} is outside [{low}, {high}]", "4.4")
    if values["max_tokens"] < 1:
        raise rt.error(ConfigurationError, cpath + ("max_tokens",), "max_tokens must be at least 1",
                       "4.4")
    if values["max_history"] < 0:
        raise rt.error(ConfigurationError, cpath + ("max_history",),
                       "max_history must not be negative", "4.4.4")
    if values["model"] is not None and not values["model"].strip():
        raise rt.error(ConfigurationError, cpath + ("model",), "model must not be empty", "4.4.2")
    for field in config:
        if field not in known:
            rt.warn(f"unknown llm agent field '{field}' is ignored", section="4.4",
                    path=cpath + (field,))
    return values


def _llm_prompt_text(rt, name):
    """§10.4: the content of prompt `name` (rt.prompts, else the document's long-form entry)."""
    if name in rt.prompts:
        return rt.prompts[name]
    entry = (rt.doc.data.get("prompts") or {}).get(name) if isinstance(rt.doc.data, dict) else None
    if isinstance(entry, dict) and "content" in entry:
        return str(entry["content"])
    return None


def _llm_check_template(rt, name, path):
    # INTERPRETATION §4.4 (Q85): a `template` naming no registered prompt is rejected at load.
    if _llm_prompt_text(rt, name) is None:
        raise rt.error(ConfigurationError, path,
                       f"template '{name}' names no prompt in the prompts section", "4.4, 10.4")

# §4.4.1 Providers -----------------------------------------------------------------------
# The §4.4.1 table: provider -> environment variables consulted in order (first non-empty wins).
# The adapters that speak to each vendor are in HOST -- providers (PROVIDERS).
PROVIDER_KEY_VARS = {
    "openai":    ("OPENAI_API_KEY",),
    "anthropic": ("ANTHROPIC_API_KEY",),
    "google":    ("GOOGLE_API_KEY", "GOOGLEAI_API_KEY"),
}


def resolve_provider(rt, configured, path):
    """§4.4.1: (configured provider, provider used). Names compare case-insensitively.

    An unavailable provider is an AgentCreationError. The host override (rt.provider, e.g. `fake`
    from `--provider fake`) replaces the provider every llm agent uses.
    """
    configured = configured.strip().lower()
    if configured not in PROVIDERS:
        raise rt.error(AgentCreationError, path,
                       f"provider '{configured}' is not available in this host "
                       f"(available: {', '.join(sorted(PROVIDERS))})", "4.4.1")
    used = configured
    if rt.provider:
        used = str(rt.provider).strip().lower()
        if used not in PROVIDERS:
            raise AgentCreationError(f"host provider override '{used}' is not available "
                                     f"(available: {', '.join(sorted(PROVIDERS))})",
                                     section="4.4.1")
    return configured, used


def resolve_api_key(rt, provider, explicit, cpath):
    """§4.4.1: the `api_key` field, else the provider's variables in rt.env, in order.

    A missing key is a ConfigurationError naming the variables; `fake` needs none.
    """
    if explicit:
        return explicit
    variables = PROVIDER_KEY_VARS.get(provider, ())
    if not variables:
        return None
    for var in variables:
        if rt.env.get(var):
            return rt.env[var]
    # INTERPRETATION §4.4.1 (Q75): reported when the agent is created at load, before any message.
    raise rt.error(ConfigurationError, cpath,
                   f"no API key for provider '{provider}': set the api_key field or the "
                   f"environment variable {' or '.join(variables)}", "4.4.1")


# §4.4.2 Default models ----------------------------------------------------------------
DEFAULT_MODELS = {
    "openai":    "gpt-3.5-turbo",
    "anthropic": "claude-3-5-sonnet-20241022",
    "google":    "gemini-1.5-flash",
}


# §4.4.3 Structured output ---------------------------------------------------------------
def check_response_format(rt, rf, path):
    """Load-time shape of `response_format` (a mapping with a string `type`; for `json_schema`,
    `json_schema: {name?, strict?, schema}` as §4.4.3 shows)."""
    kind = rf.get("type")
    if not isinstance(kind, str) or not kind:
        raise rt.error(ConfigurationError, path + ("type",),
                       "response_format needs a string 'type'", "4.4.3")
    if kind != "json_schema":
        return
    block = rf.get("json_schema")
    if not isinstance(block, dict):
        raise rt.error(ConfigurationError, path + ("json_schema",),
                       "response_format of type json_schema needs a 'json_schema' mapping", "4.4.3")
    if not isinstance(block.get("schema"), dict):
        raise rt.error(ConfigurationError, path + ("json_schema", "schema"),
                       "json_schema needs a 'schema' mapping (a JSON Schema)", "4.4.3")
    if "name" in block and not isinstance(block["name"], str):
        raise rt.error(ConfigurationError, path + ("json_schema", "name"),
                       "json_schema.name must be a string", "4.4.3")
    if "strict" in block and not isinstance(block["strict"], bool):
        raise rt.error(ConfigurationError, path + ("json_schema", "strict"),
                       "json_schema.strict must be a boolean", "4.4.3")


def check_structured_support(agent, rf):
    """§4.4.3: a provider without a structured-output mechanism for this `type` is an execution
    error, signalled per invocation (the adapters' `structured` sets say what each can do)."""
    adapter = PROVIDERS[agent.provider]
    if rf.get("type") not in adapter.structured:
        can = ", ".join(sorted(adapter.structured)) or "none"
        raise ExecutionError(f"agent '{agent.name}' (llm): provider '{agent.provider}' has no "
                             f"structured output of type '{rf.get('type')}' (supported: {can})",
                             section="4.4.3")


# §4.4.4 Memory and history -------------------------------------------------------------
class ConversationMemory:
    """§4.4.4: the remembered {role, content} entries, at most `max_history` of them.

    Thread-safe: graph nodes may invoke one agent concurrently.
    """

    # INTERPRETATION §4.4.4 (Q6): max_history counts entries (a user/assistant pair is two).

    def __init__(self, max_history):
        self.max_history = max_history
        self.entries = []
        self._lock = threading.Lock()

    def snapshot(self):
        with self._lock:
            return [dict(entry) for entry in self.entries]

    def record(self, user, assistant):
        """Append one exchange (only after a successful call), then keep the newest entries."""
        with self._lock:
            self.entries.append({"role": "user", "content": user})
            self.entries.append({"role": "assistant", "content": assistant})
            if len(self.entries) > self.max_history:
                del self.entries[:len(self.entries) - self.max_history]


def history_from_context(ctx):
    """§4.4.4: with memory off, `conversation_history` from the invoking context, for this call only.

    Entries are mappings with `role` and `content`.
    """
    # INTERPRETATION §4.4.4: role `assistant` stays, `system` entries are left out (the agent's own
    # system prompt fills that slot), any other role (graph node names, `human`) is sent as `user`.
    history = ctx.get("conversation_history")
    if not isinstance(history, list):
        return []
    entries = []
    for item in history:
        if not isinstance(item, dict) or "content" not in item:
            continue
        role = item.get("role")
        if role == "system":
            continue
        entries.append({"role": "assistant" if role == "assistant" else "user",
                        "content": _llm_text(item["content"])})
    return entries


# §4.4.5 Temperature override -----------------------------------------------------------
def effective_temperature(agent, ctx):
    """§4.4.5: `_temperature_override` in the invocation context replaces the configured value."""
    override = ctx.get("_temperature_override")
    if override is None:
        return agent.temperature
    low, high = LLM_TEMPERATURE_RANGE
    if isinstance(override, bool) or not isinstance(override, (int, float)) \
            or not low <= override <= high:
        raise ExecutionError(f"agent '{agent.name}' (llm): _temperature_override {override!r} is "
                             f"not a number in [{low}, {high}]", section="4.4.5")
    return float(override)


# §4.4.6 System prompt rendering -------------------------------------------------------
def render_system_prompt(agent, view, message):
    """§4.4.6: the system prompt rendered with `context` and `message` (Phase C, §8.11); on a
    render failure render_runtime warns and hands back the literal prompt."""
    return _llm_text(render_runtime(agent.rt, agent.system_prompt, view, message,
                                    agent.path + ("config", "system_prompt")))


# §4.5 Tool agents -----------------------------------------------------------------------
# The tool agent: §4.5 fields and defaults, §4.11 capabilities and metadata for tools. Its parts
# follow: the built-ins (§4.5.1), inline tools (§4.5.2), the request protocol (§4.5.3), the
# path rules (§4.5.4, §13.3), file_write (§4.5.5), the progress bar (§4.5.6), output (§4.5.7),
# and the shell extension (§13.5).
# [tools] stdlib modules used only by the tool agent (the integrator may hoist them to the top).
import ast
import subprocess
import urllib.error
import urllib.parse
import urllib.request

# The §4.5 field table: field -> (accepted Python types, default).
TOOL_AGENT_FIELDS = {
    "tools":       ((list,),        []),
    "safe_mode":   ((bool,),        True),
    "allow_shell": ((bool,),        False),
    "timeout":     ((int, float),   1),
    "context":     ((dict,),        {}),
}

# The §4.11 capability identifiers a tool agent publishes, by the tool that brings them.
TOOL_CAPABILITIES = {
    "math": "math-evaluation",
    "http_request": "http-requests",
    "file_read": "file-operations",
    "file_write": "file-operations",
    "shell": "command-execution",
}


class ToolEnv:
    """What one tool call may reach: the runtime, the invocation context and the agent's limits."""

    __slots__ = ("rt", "ctx", "view", "safe_mode", "allow_shell", "timeout", "who")

    def __init__(self, rt, ctx, *, view=None, safe_mode=True, allow_shell=False, timeout=1,
                 who="tool"):
        self.rt = rt
        self.ctx = ctx if isinstance(ctx, dict) else {}     # the invocation context (host keys)
        self.view = self.ctx if view is None else view      # agent context + invocation context
        self.safe_mode = safe_mode
        self.allow_shell = allow_shell
        self.timeout = timeout
        self.who = who

    def fail(self, message, section="4.5"):
        """A tool failure: an ExecutionError naming the agent (it reaches __error__, §12.2.3)."""
        # INTERPRETATION §4.5.1 (Q65): every tool failure, rejection or operational, is an
        # ExecutionError, so that it reaches __error__ with a category instead of passing as output.
        return ExecutionError(message, path=self.who, section=section)

    @property
    def unsafe_invocation(self):
        """`_unsafe_mode: true` in the invocation context (§4.5.4, §10.3); set by the host."""
        return self.ctx.get("_unsafe_mode") is True

    @property
    def unsafe_host(self):
        """§13.3 unsafe mode: the host is unsafe AND the invocation carries `_unsafe_mode: true`."""
        return bool(getattr(self.rt, "unsafe", False)) and self.unsafe_invocation


class ToolAgent:
    """§4.5 `type: tool`: deterministic tools (built-in or inline code), no language model.

    {type: tool, config: {tools: [echo, {name: n, code: ...}], safe_mode: true, allow_shell: false,
    timeout: 1, context: {}}}
    """

    type = "tool"

    def __init__(self, name, cfg, rt, path):
        self.name = name
        self.rt = rt
        self.path = tuple(path)
        config_path = self.path + ("config",)
        config = cfg.get("config") if isinstance(cfg, dict) else None
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise rt.error(ConfigurationError, config_path, "tool agent config must be a mapping",
                           "4.5")
        # INTERPRETATION §4.5 (Q86): `tools` is required; a tool agent without it is rejected at
        # load, because the table says "Required: Yes" and such an agent could only ever fail.
        if "tools" not in config:
            raise rt.error(ConfigurationError, config_path,
                           f"tool agent '{name}' needs a `tools` list", "4.5")
        values = {}
        for field, (types, default) in TOOL_AGENT_FIELDS.items():
            value = config.get(field, copy.deepcopy(default))
            if value is None and field == "context":
                value = {}
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                kinds = " or ".join(t.__name__ for t in types)
                raise rt.error(ConfigurationError, config_path + (field,),
                               f"`{field}` must be a {kinds}", "4.5")
            values[field] = value
        if values["timeout"] <= 0:
            raise rt.error(ConfigurationError, config_path + ("timeout",),
                           "`timeout` must be a positive number of seconds", "4.5")
        for key in config:
            if key not in TOOL_AGENT_FIELDS:
                rt.warn(f"unknown tool agent field '{key}' is ignored", section="4.5",
                        path=config_path + (key,))
        self.safe_mode = values["safe_mode"]
        self.allow_shell = values["allow_shell"]
        self.timeout = values["timeout"]
        self.context = values["context"]          # §4.5 per-agent persistent context
        if not values["tools"]:
            rt.warn(f"tool agent '{name}' lists no tools; every request will fail",
                    section="4.5", path=config_path + ("tools",))
        self.tools = {}                           # tool name -> InlineTool, or None for a built-in
        for index, entry in enumerate(values["tools"]):
            self._add_tool(entry, config_path + ("tools", index))
        self.capabilities = ["tool-execution"]
        for tool in self.tools:
            capability = TOOL_CAPABILITIES.get(tool)
            if capability and capability not in self.capabilities:
                self.capabilities.append(capability)
        if self.allow_shell and "command-execution" not in self.capabilities:
            self.capabilities.append("command-execution")
        self.metadata = {
            "name": name, "type": "tool", "capabilities": list(self.capabilities),
            "reactive": True, "tools": list(self.tools), "allow_shell": self.allow_shell,
            "safe_mode": self.safe_mode, "timeout": self.timeout,
        }

    def _add_tool(self, entry, path):
        """One element of `tools`: a built-in name, or a mapping {name, code} (§4.5.1, §4.5.2)."""
        rt = self.rt
        if isinstance(entry, str):
            if entry not in BUILTIN_TOOLS and entry not in EXTENSION_TOOLS:
                raise rt.error(ConfigurationError, path, f"unknown built-in tool '{entry}' "
                               f"(known: {', '.join([*BUILTIN_TOOLS, *EXTENSION_TOOLS])})", "4.5.1")
            name, tool = entry, None
        elif isinstance(entry, dict):
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise rt.error(ConfigurationError, path + ("name",),
                               "an inline tool needs a non-empty string `name`", "4.5.2")
            code = entry.get("code")
            if code is None and (name in BUILTIN_TOOLS or name in EXTENSION_TOOLS):
                tool = None                       # {name: math} is the mapping form of `math`
            elif not isinstance(code, str):
                raise rt.error(ConfigurationError, path + ("code",),
                               f"inline tool '{name}' needs a string `code` body", "4.5.2")
            else:
                for key in entry:
                    if key not in ("name", "code"):
                        rt.warn(f"unknown inline tool field '{key}' is ignored", section="4.5.2",
                                path=path + (key,))
                if name in BUILTIN_TOOLS or name in EXTENSION_TOOLS:
                    # INTERPRETATION §16.3 (Q5): accepted; the inline tool shadows the built-in,
                    # with a warning, because the rule's own parenthesis says the inline tool wins.
                    rt.warn(f"inline tool '{name}' shadows the built-in tool of the same name",
                            section="16.3", path=path + ("name",))
                tool = InlineTool(self, name, code, path)
        else:
            raise rt.error(ConfigurationError, path,
                           "a tool is a built-in name or a mapping {name, code}", "4.5")
        if name in self.tools:
            raise rt.error(ConfigurationError, path,
                           f"tool '{name}' is listed twice; tool names are unique per agent",
                           "4.5.2")
        self.tools[name] = tool

    def env(self, ctx):
        """The ToolEnv of one invocation: the agent's limits plus the merged context view."""
        ctx = ctx if isinstance(ctx, dict) else {}
        view = dict(self.context)
        view.update(ctx)
        return ToolEnv(self.rt, ctx, view=view, safe_mode=self.safe_mode,
                       allow_shell=self.allow_shell, timeout=self.timeout,
                       who=f"agent '{self.name}' (tool)")

    def invoke(self, content, ctx):
        """§4.5.3: decode the request, run the named tool, return its §4.5.7 string."""
        name, args, input_data = tool_request(self, content)
        return self.run_tool(name, args, ctx, input_data=input_data)

    def run_tool(self, name, args, ctx, *, input_data=None):
        """Run one allowed tool by name with normalised `args` (also used by §12.4)."""
        env = self.env(ctx)
        if name not in self.tools:
            if name == "shell" and self.allow_shell:
                pass                              # §13.5: allow_shell makes `shell` available
            else:
                raise env.fail(f"tool '{name}' is not in the agent's tools list", "4.5.3")
        inline = self.tools.get(name)
        if inline is not None:
            if input_data is None:
                input_data = inline_input(args)
            return tool_output(inline.run(input_data, env))
        handler = BUILTIN_TOOLS.get(name) or EXTENSION_TOOLS[name]
        return tool_output(handler(env, tool_args(args)))


def run_builtin_tool(rt, name, args, ctx, agent=None):
    """§12.4: run one tool for a [TOOL_EXECUTE:name] block; returns the §4.5.7 string.

    A ToolAgent runs it under its own tools list and limits; any other caller gets the
    built-ins with the default limits (safe_mode true, no shell, timeout 1 s).
    """
    if isinstance(agent, ToolAgent):
        return agent.run_tool(name, args, ctx)
    who = f"agent '{agent.name}'" if getattr(agent, "name", None) else "tool"
    env = ToolEnv(rt, ctx, who=who)
    handler = BUILTIN_TOOLS.get(name)
    if handler is None:
        raise env.fail(f"unknown tool '{name}'", "12.4")
    return tool_output(handler(env, tool_args(args)))

# §4.5.1 Built-in tools ------------------------------------------------------------------
# A handler is `tool_<name>(env, args) -> value`; `args` is a mapping of named arguments whose
# key "args" (when present) holds the positional list (§4.5.3 JSON `args` list, command form).

def tool_args(raw):
    """Normalise a request's `args`: a mapping stays, a list becomes {"args": list}."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    if isinstance(raw, (list, tuple)):
        return {"args": list(raw)}
    return {"args": [raw]}


def tool_argument(args, name, index=0):
    """The named argument, else the positional one at `index`, else None (§4.5.1 `x OR args[i]`)."""
    if args.get(name) is not None:
        return args[name]
    positional = args.get("args")
    if isinstance(positional, list) and len(positional) > index:
        return positional[index]
    return None


def tool_rest(args, name):
    """The named argument, else every positional argument joined by single spaces."""
    if args.get(name) is not None:
        return args[name]
    positional = args.get("args")
    if isinstance(positional, list) and positional:
        return " ".join(str(item) for item in positional)
    return None


def tool_echo(env, args):
    """§4.5.1 echo: the input verbatim.

    {tool: echo, args: {text: <s>}} | {tool: echo, args: [<s>, ...]} | `echo <words>`
    """
    # INTERPRETATION §4.5.1 (Q64): several positional arguments are joined with single spaces,
    # the same for the JSON `args` list and the space-separated command form.
    text = tool_rest(args, "text")
    return "" if text is None else text


def tool_math(env, args):
    """§4.5.1 math: evaluate an arithmetic expression; only abs round min max sum pow int float.

    {tool: math, args: {expression: "2 + 2 * 3"}} | `math 2+2*3`   -> "8"
    """
    # INTERPRETATION §4.5.1: positional arguments are joined by spaces, so that the command
    # form `math 2 + 2` (split on spaces by §4.5.3) gives the expression "2 + 2".
    expression = tool_rest(args, "expression")
    if not isinstance(expression, str) or not expression.strip():
        raise env.fail("math needs an `expression` string", "4.5.1")
    return math_evaluate(expression, env)


# The restricted arithmetic environment of §4.5.1 `math`: these names and nothing else.
MATH_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sum": sum, "pow": pow,
                  "int": int, "float": float}
MATH_OPERATORS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: pow,
}
MATH_MAX_BITS = 4096          # guard: no integer beyond 4096 bits (about 1233 digits)


def math_evaluate(expression, env):
    """Walk the AST of `expression`; the raw string is never given to eval()."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise env.fail(f"math: invalid expression ({exc.msg})", "4.5.1") from None
    except (RecursionError, MemoryError):
        raise env.fail("math: expression nested too deeply", "4.5.1") from None
    try:
        value = _math_node(tree.body, env)
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise env.fail(f"math: {type(exc).__name__}: {exc}", "4.5.1") from None
    except RecursionError:
        raise env.fail("math: expression nested too deeply", "4.5.1") from None
    return str(value)


def _math_guard(value, env):
    if isinstance(value, int) and value.bit_length() > MATH_MAX_BITS:
        raise env.fail(f"math: result exceeds {MATH_MAX_BITS} bits", "4.5.1")
    return value


def _math_power(base, exponent, modulus=None, *, env):
    """pow and ** with the size guard checked before the work is done."""
    if modulus is None and isinstance(base, int) and isinstance(exponent, int) \
            and abs(base) > 1 and exponent > 0 \
            and exponent * (abs(base).bit_length() - 1) > MATH_MAX_BITS:
        raise env.fail(f"math: result exceeds {MATH_MAX_BITS} bits", "4.5.1")
    return pow(base, exponent) if modulus is None else pow(base, exponent, modulus)


def _math_node(node, env):
    match node:
        case ast.Constant(value=value) if type(value) in (int, float):
            return value
        case ast.UnaryOp(op=ast.USub(), operand=operand):
            return -_math_node(operand, env)
        case ast.UnaryOp(op=ast.UAdd(), operand=operand):
            return +_math_node(operand, env)
        case ast.BinOp(left=left, op=op, right=right) if type(op) in MATH_OPERATORS:
            a, b = _math_node(left, env), _math_node(right, env)
            if isinstance(op, ast.Pow):
                return _math_guard(_math_power(a, b, env=env), env)
            if isinstance(op, ast.Mult) and isinstance(a, int) and isinstance(b, int) \
                    and a.bit_length() + b.bit_length() > MATH_MAX_BITS + 1:
                raise env.fail(f"math: result exceeds {MATH_MAX_BITS} bits", "4.5.1")
            return _math_guard(MATH_OPERATORS[type(op)](a, b), env)
        case ast.List(elts=items) | ast.Tuple(elts=items):
            return [_math_node(item, env) for item in items]
        case ast.Call(func=ast.Name(id=name), args=call_args, keywords=[]) \
                if name in MATH_FUNCTIONS:
            values = [_math_node(arg, env) for arg in call_args]
            if name == "pow" and 2 <= len(values) <= 3:
                return _math_guard(_math_power(*values, env=env), env)
            return _math_guard(MATH_FUNCTIONS[name](*values), env)
        case ast.Name(id=name):
            raise env.fail(f"math: name '{name}' is not available", "4.5.1")
    raise env.fail(f"math: {type(node).__name__} is not allowed in an arithmetic expression",
                   "4.5.1")


def tool_json_parse(env, args):
    """§4.5.1 json_parse: parse JSON text and re-serialise it with two-space indentation.

    {tool: json_parse, args: {json: '{"a":1}'}} | `json_parse {"a":1}`
    """
    text = tool_rest(args, "json")
    if text is None:
        raise env.fail("json_parse needs a `json` string", "4.5.1")
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise env.fail(f"json_parse: invalid JSON ({exc.msg} at line {exc.lineno} "
                           f"column {exc.colno})", "4.5.1") from None
    else:
        value = text                              # already-decoded JSON given as the argument
    # INTERPRETATION §4.5.1: non-ASCII characters are written as themselves (ensure_ascii off).
    return json.dumps(value, indent=2, ensure_ascii=False)


def tool_http_request(env, args):
    """§4.5.1 http_request over urllib; returns "Status: <code>\\n\\n<body>".

    {tool: http_request, args: {url: <u>, method: GET, headers: {..}, data: {..}}}
    """
    url = tool_argument(args, "url", 0)
    method = tool_argument(args, "method", 1) or "GET"
    headers = args.get("headers") or {}
    if not isinstance(url, str) or not url:
        raise env.fail("http_request needs a `url` string", "4.5.1")
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        # file:, ftp: and data: URLs would step around the §13.3 file rules
        raise env.fail("http_request accepts only http and https URLs", "13.4")
    if not isinstance(headers, dict):
        raise env.fail("http_request `headers` must be a mapping", "4.5.1")
    headers = {str(k): str(v) for k, v in headers.items()}
    body = None
    if args.get("data") is not None:
        body = json.dumps(args["data"]).encode("utf-8")
        if not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=body, headers=headers, method=str(method).upper())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(http_proxies(env.rt, url)))
    try:
        with opener.open(request, timeout=env.timeout) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:          # 4xx/5xx still answer: report them as such
        status, payload = exc.code, exc.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise env.fail(f"http_request to {url} failed: {reason}", "4.5.1") from None
    return f"Status: {status}\n\n{payload.decode('utf-8', errors='replace')}"


def http_proxies(rt, url):
    """Proxies from the Actor's environment (rt.env, never os.environ), honouring no_proxy."""
    env = getattr(rt, "env", None) or {}
    proxies = {key[:-6].lower(): value for key, value in env.items()
               if key.lower().endswith("_proxy") and value}
    host = urllib.parse.urlsplit(url).hostname or ""
    if proxies.get("no") and urllib.request.proxy_bypass_environment(host, proxies):
        return {}
    proxies.pop("no", None)
    return proxies


FILE_READ_SUCCESS = "[FILE_READ_SUCCESS]"           # §4.5.1 file_read markers
FILE_CONTENT_START = "[FILE_CONTENT_START]"
FILE_CONTENT_END = "[FILE_CONTENT_END]"


def tool_file_read(env, args):
    """§4.5.1 file_read: a UTF-8 file under the §4.5.4/§13.3 path rules, with the fixed header.

    {tool: file_read, args: {file: <path>}} | `file_read notes.md`
    """
    given = tool_argument(args, "file", 0)
    target = tool_path(env, given, "file_read")
    try:
        content = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise env.fail(f"file_read: no such file: {given}", "4.5.1") from None
    except UnicodeDecodeError:
        raise env.fail(f"file_read: {given} is not UTF-8 text", "4.5.1") from None
    except OSError as exc:
        raise env.fail(f"file_read: cannot read {given}: {exc.strerror}", "4.5.1") from None
    # INTERPRETATION §4.5.1 (Q67): <path> is the path as given; Lines counts splitlines() (an
    # empty file has 0 lines, a final newline opens no extra line); Size counts characters.
    return (f"{FILE_READ_SUCCESS}📄 File: {given} | Lines: {len(content.splitlines())} | "
            f"Size: {len(content)} chars\n{FILE_CONTENT_START}\n{content}\n{FILE_CONTENT_END}")


def tool_file_write(env, args):
    """§4.5.1 file_write: write, append or insert under the §4.5.4/§13.3 rules (modes: §4.5.5).

    {tool: file_write, args: {file: <path>, content: <s>, mode: w|a|insert, position: ...}}
    | `file_write notes.md some words` (mode w)
    """
    given = tool_argument(args, "file", 0)
    content = args.get("content")
    if content is None:
        positional = args.get("args")
        content = " ".join(str(x) for x in positional[1:]) if isinstance(positional, list) else ""
    if not isinstance(content, str):
        content = tool_output(content)
    mode = args.get("mode") or "w"
    if mode not in FILE_WRITE_MODES:
        raise env.fail(f"file_write: unknown mode '{mode}' (w, a or insert)", "4.5.5")
    target = tool_path(env, given, "file_write")
    return FILE_WRITE_MODES[mode](env, target, given, content, args.get("position"))


def tool_progress_bar(env, args):
    """§4.5.1 progress_bar: update the Actor's progress facility (§4.5.6); returns the bar line.

    {tool: progress_bar, args: {stage, current, total, message, ...}} | `progress_bar 3 10`
    """
    return progress_facility(env.rt).update(args, env.view, env)


# The §4.5.1 table: built-in tool name -> handler. Rows in the spec's order.
BUILTIN_TOOLS = {
    "echo":         tool_echo,
    "math":         tool_math,
    "json_parse":   tool_json_parse,
    "http_request": tool_http_request,
    "file_read":    tool_file_read,
    "file_write":   tool_file_write,
    "progress_bar": tool_progress_bar,
}

# §4.5.2 Inline tools ------------------------------------------------------------------
# The §4.5.2 names: what an inline body sees besides the §13.2.1 built-ins, and where `result` falls
# back to. INLINE_PROGRESS is this implementation's name for the §4.5.6 item 5 entry point:
# `progress_bar(current=3, total=10, stage="draft", message="intro")` returns the rendered line.
INLINE_RESULT_FALLBACKS = ("output", "response", "answer")
INLINE_PROGRESS = "progress_bar"


def inline_input(args):
    """input_data for an inline tool named in a JSON request: `args` itself, JSON-encoded if not text."""
    # INTERPRETATION §4.5.3 (Q63): an inline tool called by name gets the request's `args`
    # (JSON-encoded when not a string; space-joined in the command form), not the whole message.
    if args is None:
        return ""
    return args if isinstance(args, str) else json.dumps(args)


class InlineTool:
    """§4.5.2 an inline-code tool: compiled once at load in the §13.2.1 sandbox, run per call.

    {name: <tool_name>, code: <python body that sets `result`>}
    """

    def __init__(self, agent, name, code, path):
        rt = agent.rt
        # INTERPRETATION §4.5.2 (Q72): an inline tool on a safe host is refused at load with
        # UnsafeConfigurationError, because §1.3(2) wants configuration faults before any message
        # and §20 describes exactly this category.
        if not rt.unsafe:
            raise rt.error(UnsafeConfigurationError, path + ("code",),
                           f"inline tool '{name}' runs code, which needs the host in unsafe mode",
                           "4.5.2, 13.1")
        self.name = name
        self.unit = compile_code(code, rt=rt, path=path + ("code",))

    def run(self, input_data, env):
        """Run the body with input_data, message, context (by reference) and result=None."""
        view = env.view
        before = dict(view)
        variables = {"input_data": input_data, "message": input_data, "context": view,
                     "result": None, INLINE_PROGRESS: progress_function(env)}
        namespace = run_code(self.unit, variables, timeout=env.timeout)
        returned = namespace.get("context")
        if isinstance(returned, dict) and returned is not view:   # a sandbox that copies back
            view.clear()
            view.update(returned)
        context_write_back(before, view, env.ctx)
        result = namespace.get("result")
        if result is None:
            result = next((namespace[name] for name in INLINE_RESULT_FALLBACKS
                           if namespace.get(name) is not None), "")
        return result


def context_write_back(before, view, ctx):
    """Carry the body's context changes from the merged view into the invocation context."""
    # INTERPRETATION §4.5 vs §4.5.2 (Q79): the body sees the agent context overlaid by the
    # invocation context (invocation wins); keys it sets or deletes land in the invocation
    # context (the global one in streams), so later steps see them (§4.5.7).
    for key, value in view.items():
        if key not in before or before[key] is not value:
            ctx[key] = value
    for key in before:
        if key not in view:
            ctx.pop(key, None)

# §4.5.3 Tool invocation protocol -------------------------------------------------------
INVALID_JSON_IN_TOOL_REQUEST = "Invalid JSON in tool request"     # §4.5.3 step 3, verbatim


def request_text(content):
    """The message as text: strings as they are, mappings and lists as JSON, the rest via str()."""
    if isinstance(content, str):
        return content
    if isinstance(content, (dict, list)):
        return json.dumps(content)
    return tool_output(content)


def tool_request(agent, content):
    """§4.5.3 steps 1-4: decode a message into (tool name, args, input_data or None).

    Step 5 (the name must be an allowed tool) is checked when the tool is run.
    """
    tools = agent.tools
    text = request_text(content)
    # INTERPRETATION §4.5.3 step 1 (Q62): "exactly one inline-code tool" means the agent's only
    # tool is inline; with built-ins beside it, every tool is reached by name (else the listed
    # built-ins could never run).
    if len(tools) == 1 and next(iter(tools.values())) is not None:
        return next(iter(tools)), None, text
    parsed = content if isinstance(content, dict) else None
    if parsed is None:
        try:
            parsed = json.loads(text)
        except ValueError:
            stripped = text.strip()
            if stripped.startswith("{") and stripped.endswith("}"):
                raise ExecutionError(INVALID_JSON_IN_TOOL_REQUEST,
                                     path=f"agent '{agent.name}' (tool)", section="4.5.3") from None
    if isinstance(parsed, dict) and "tool" in parsed:
        name = parsed["tool"]
        if not isinstance(name, str):
            raise ExecutionError("the `tool` key of a tool request must be a tool name",
                                 path=f"agent '{agent.name}' (tool)", section="4.5.3")
        return name, parsed.get("args"), None
    # INTERPRETATION §4.5.3 (Q63): valid JSON without a `tool` key falls through to the command
    # form, as written.
    words = text.split()
    name = words[0] if words else ""
    if name not in tools and name not in BUILTIN_TOOLS and name not in EXTENSION_TOOLS \
            and len(tools) == 1:
        # INTERPRETATION §3.3 vs §4.5.3 (Q8): when the first word names no tool at all and the
        # agent has a single (built-in) tool, that tool gets the whole message, so that the §3.3
        # echo Actor "accepts any message"; a word naming another tool still fails (step 5).
        return next(iter(tools)), [text], text
    return name, words[1:], " ".join(words[1:])

# §4.5.4 Safe-mode restrictions ------------------------------------------------------------
# The agent layer of the path rules (`safe_mode`); the host layer is §13.3, and tool_path()
# there applies both (Q69). The shell blocklist is enforced in §13.5 in every mode.
SHELL_BLOCKLIST = ("rm", "del", "format", "shutdown", "reboot", "kill")   # case-insensitive


def path_facts(given):
    """(absolute?, has a `..` component?, starts with `~`?) for a path string, / or \\ separated."""
    parts = re.split(r"[\\/]", given)
    absolute = Path(given).is_absolute() or given.startswith(("/", "\\")) \
        or bool(re.match(r"^[A-Za-z]:", given))
    return absolute, ".." in parts, given.startswith("~")


def safe_mode_refusal(env, given, op):
    """§4.5.4: why the agent's `safe_mode` rules refuse `given` for `op`, or None."""
    absolute, traversal, tilde = path_facts(given)
    if op == "file_write" and not env.unsafe_invocation:
        return "file_write requires `_unsafe_mode: true` in the invocation context"
    if not env.safe_mode:
        return None
    # INTERPRETATION §4.5.4: "paths containing .." means a `..` path component (traversal),
    # not the two characters anywhere (a file may be named `v1..2.txt`).
    if traversal:
        return f"{op} rejects `..` in paths"
    if op == "file_read" and absolute and not env.unsafe_invocation:
        return "file_read rejects absolute paths unless the invocation context has `_unsafe_mode: true`"
    if op == "file_write" and tilde:
        return "file_write rejects paths beginning with ~"
    return None

# §4.5.5 file_write modes ---------------------------------------------------------------
# The §4.5.5 success messages, verbatim apart from the placeholders.
FILE_WRITE_WROTE = "Successfully wrote {n} characters to {path}"
FILE_WRITE_APPENDED = "Successfully appended {n} characters to {path}"
FILE_WRITE_INSERTED = "Successfully inserted {n} characters at line {line} in {path}"

# INTERPRETATION §4.5.5 (Q66): <n> counts the content as given; <path> is the path as given;
# mode a puts exactly one blank line between existing text and content starting with `#` (none
# added when the file already ends in one, none for an empty file); insert ends the content with
# a newline when it lacks one, so it occupies whole lines; a clamped position reports the line
# actually used; `position: end` is an insert and reports its line.


def file_existing(env, target, given):
    """The current text of the target, or "" when it does not exist yet."""
    try:
        return target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise env.fail(f"file_write: cannot read {given}: {exc}", "4.5.5") from None


def file_store(env, target, given, text, mode="w"):
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, mode, encoding="utf-8", newline="") as handle:
            handle.write(text)
    except OSError as exc:
        raise env.fail(f"file_write: cannot write {given}: {exc.strerror or exc}", "4.5.5") \
            from None


def file_write_w(env, target, given, content, position):
    """Mode w (default): overwrite the file with the content."""
    file_store(env, target, given, content)
    return FILE_WRITE_WROTE.format(n=len(content), path=given)


def file_write_a(env, target, given, content, position):
    """Mode a: append; content starting with `#` (a Markdown section) gets a blank line before it."""
    existing = file_existing(env, target, given)
    separator = ""
    if content.startswith("#") and existing and not existing.endswith("\n\n"):
        separator = "\n" if existing.endswith("\n") else "\n\n"
    file_store(env, target, given, separator + content, "a")
    return FILE_WRITE_APPENDED.format(n=len(content), path=given)


def file_write_insert(env, target, given, content, position):
    """Mode insert: put the content before line N (positions per the second §4.5.5 table)."""
    existing = file_existing(env, target, given)
    lines = existing.splitlines(keepends=True)
    line = insert_line(env, position, len(lines))
    if lines and not lines[-1].endswith(("\n", "\r")) and line == len(lines) + 1:
        lines[-1] += "\n"                  # the old last line must end before the new one starts
    block = content if not content or content.endswith("\n") else content + "\n"
    lines.insert(line - 1, block)
    file_store(env, target, given, "".join(lines))
    return FILE_WRITE_INSERTED.format(n=len(content), line=line, path=given)


def insert_line(env, position, count):
    """§4.5.5 positions: "start" -> 1, "end" or null -> count+1, N -> N clamped to [1, count+1]."""
    if position is None or position == "end":
        return count + 1
    if position == "start":
        return 1
    if isinstance(position, float) and position.is_integer():
        position = int(position)
    if isinstance(position, str) and re.fullmatch(r"\s*[+-]?\d+\s*", position):
        position = int(position)
    if not isinstance(position, int) or isinstance(position, bool):
        raise env.fail(f"file_write: position must be \"start\", \"end\" or a line number, "
                       f"not {position!r}", "4.5.5")
    return min(max(position, 1), count + 1)


# The §4.5.5 mode table: mode -> writer. Rows in the spec's order.
FILE_WRITE_MODES = {
    "w":      file_write_w,
    "a":      file_write_a,
    "insert": file_write_insert,
}

# §4.5.6 The progress-bar facility -------------------------------------------------------
PROGRESS_WIDTH = 24                    # §4.5.6 item 1: fixed width in cells
PROGRESS_FILLED = "█"
PROGRESS_EMPTY = "░"
PROGRESS_LABEL_JOIN = " • "            # item 4: stage and message joined by •

# The §4.5.1 progress_bar arguments, by the snapshot field they set (first present wins).
# `remaining` sets current to total - remaining; a list given as a count counts its items.
PROGRESS_ARGUMENTS = {
    "stage":   ("stage", "phase"),
    "current": ("current", "done", "count", "sections_completed", "completed_sections"),
    "total":   ("total", "steps", "sections_total"),
    "message": ("message", "label"),
}


class ProgressFacility:
    """§4.5.6: one (stage, current, total, message) snapshot per Actor, safe across threads.

    Each update writes "\\r<line>" to `stream`, plus a newline at 100%, and returns <line>.
    """

    def __init__(self, stream=None):
        # INTERPRETATION §4.5.6 (Q80): the bar goes to a channel the host chooses, `stream`;
        # None means the process's standard error, because a command-line host prints the
        # Actor's results (and --json) on standard output. The tool returns the rendered line.
        self.stream = stream
        self.lock = threading.Lock()
        self.stage, self.current, self.total, self.message = None, 0, 1, None
        self.last = None

    def update(self, args, view, env=None):
        """Merge `args` (§4.5.1 names), the context hooks and the snapshot; emit; return the line."""
        args = tool_args(args)
        given = {field: next((args[name] for name in names if args.get(name) is not None), None)
                 for field, names in PROGRESS_ARGUMENTS.items()}
        positional = args.get("args") if isinstance(args.get("args"), list) else []
        for field, value in zip(("current", "total"), positional):
            if given[field] is None:
                given[field] = value
        view = view if isinstance(view, dict) else {}
        with self.lock:
            stage = given["stage"] if given["stage"] is not None \
                else view.get("writing_stage") or self.stage
            total = progress_number(given["total"], env)
            if total is None and isinstance(view.get("section_paths"), (list, tuple)) \
                    and view["section_paths"]:
                total = len(view["section_paths"])
            if total is None:
                total = self.total
            if total <= 0:
                total = 1                  # no meaningful upstream total: the item 3 default
            current = progress_number(given["current"], env)
            if current is None and args.get("remaining") is not None:
                current = total - progress_number(args["remaining"], env)
            for hook in ("current_section_index", "current_latex_index"):
                if current is None and isinstance(view.get(hook), int) \
                        and not isinstance(view.get(hook), bool):
                    current = view[hook]
            if current is None:
                current = self.current
            current = min(max(current, 0), total)              # item 2: clamp to [0, total]
            message = given["message"] if given["message"] is not None else self.message
            self.stage, self.current, self.total, self.message = stage, current, total, message
            line = progress_render(stage, current, total, message)
            self.last = line
            stream = self.stream if self.stream is not None else sys.stderr
            stream.write("\r" + line + ("\n" if current >= total else ""))    # item 4
            stream.flush()
        return line


def progress_number(value, env=None):
    """A count from an argument: numbers as they are, numeric strings parsed, lists counted."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and number == number and abs(number) != float("inf"):
            return int(number) if number.is_integer() else number
    message = f"progress_bar: {value!r} is not a number"
    raise env.fail(message, "4.5.6") if env is not None else ExecutionError(message,
                                                                          section="4.5.6")


def progress_render(stage, current, total, message):
    """`████████░░░░░░░░░░░░░░░░ 33.3% (1/3) drafting • intro` (items 1-4 of §4.5.6)."""
    filled = int(PROGRESS_WIDTH * current / total)
    bar = PROGRESS_FILLED * filled + PROGRESS_EMPTY * (PROGRESS_WIDTH - filled)

    def show(number):
        return int(number) if isinstance(number, float) and number.is_integer() else number

    line = f"{bar} {100.0 * current / total:.1f}% ({show(current)}/{show(total)})"
    label = PROGRESS_LABEL_JOIN.join(str(part) for part in (stage, message) if part)
    return f"{line} {label}" if label else line


def progress_facility(rt):
    """The Actor's one facility, created on first use (hosts may set rt.progress beforehand)."""
    facility = getattr(rt, "progress", None)
    if facility is None:
        facility = vars(rt).setdefault("progress", ProgressFacility())
    return facility


def progress_function(env):
    """§4.5.6 item 5: the entry point inline code calls, bound to this invocation's context."""
    facility = progress_facility(env.rt)

    def progress_bar(current=None, total=None, stage=None, message=None, **more):
        named = dict(more, current=current, total=total, stage=stage, message=message)
        return facility.update({k: v for k, v in named.items() if v is not None}, env.view, env)

    return progress_bar

# §4.5.7 Tool output conventions -------------------------------------------------------
def tool_output(value):
    """§4.5.7: a tool's value as a string: None -> "", strings as they are, the rest via str()."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)

# §4.6 Composite agents ----------------------------------------------------------------
COMPONENT_KINDS = {"agent": "agents", "graph": "graphs", "stream": "streams"}


def check_composite(doc, name, config, path, agent_types):
    """§4.6.1-§4.6.3, §16.1-§16.2: components, explicit routing, no strategy."""
    if "strategy" in config:
        raise doc.error(ConfigurationError, path + ("strategy",),
                        "composite agents must not declare strategy; use components and routing",
                        "4.6.3, §16.1")
    components = config.get("components")
    if not isinstance(components, dict):
        raise doc.error(ConfigurationError, path + ("components",),
                        "composite agents need a components mapping (agents, graphs, streams)",
                        "4.6, §4.6.1")
    for key, value in components.items():
        if key not in COMPONENT_KINDS.values():
            raise doc.error(ConfigurationError, path + ("components", key),
                            f"unknown component kind '{key}' (agents, graphs, streams)", "4.6.1")
        if not isinstance(value, dict):
            raise doc.error(ConfigurationError, path + ("components", key), "must be a mapping",
                            "4.6.1")
    for local, sub in (components.get("agents") or {}).items():
        check_agent(doc, local, sub, path + ("components", "agents", local), agent_types)
    routing = config.get("routing")
    if not isinstance(routing, dict):
        raise doc.error(ConfigurationError, path + ("routing",),
                        "composite agents need routing with input and output", "4.6.2")
    for end in ("input", "output"):
        spec = routing.get(end)
        if not isinstance(spec, dict) or "type" not in spec or "name" not in spec:
            raise doc.error(ConfigurationError, path + ("routing", end),
                            f"routing.{end} must be the explicit form {{type, name}} "
                            "(the shorthand form is forbidden)", "4.6.2, §16.2")
        kind = COMPONENT_KINDS.get(spec["type"])
        if kind is None:
            raise doc.error(ConfigurationError, path + ("routing", end, "type"),
                            f"routing type must be agent, graph or stream, not '{spec['type']}'",
                            "4.6.2")
        if spec["name"] not in (components.get(kind) or {}):
            raise doc.error(ConfigurationError, path + ("routing", end, "name"),
                            f"'{spec['name']}' is not a component in components.{kind}", "4.6.2")


class CompositeAgent:
    """§4.6: nested agents, graphs and streams behind one agent interface.

    {type: composite, config: {components: {agents, graphs, streams}, routing: {input, output}}}
    The components live in a Runtime of their own whose agents are the outer ones overlaid by the
    local ones (§8.7.1 scope order); it shares the outer clock, context and settings.
    INTERPRETATION §4.6.2 (Q73): when input and output differ, the input component's result is handed
    to the output component.
    """

    type = "composite"

    def __init__(self, name, cfg, rt, path):
        self.name, self.rt, self.path = name, rt, path
        config = cfg["config"]
        components = config["components"]
        routes = {}
        for kind in ("graphs", "streams"):
            for local, route in (components.get(kind) or {}).items():
                route = dict(route)
                route.setdefault("type", kind[:-1])
                routes[local] = route
        sub_doc = Doc({"agents": dict(components.get("agents") or {}), "routes": routes},
                      rt.doc.marks, rt.doc.files)
        self.inner = Runtime(sub_doc, unsafe=rt.unsafe, env=rt.env, engine=rt.engine,
                             workdir=rt.workdir, clock=rt.clock, provider=rt.provider,
                             llm_transport=rt.llm_transport)
        inner = self.inner
        inner.llm_log, inner.warnings, inner.context, inner.prompts = (
            rt.llm_log, rt.warnings, rt.context, rt.prompts)
        inner.agents = dict(rt.agents)
        for local, sub in (components.get("agents") or {}).items():
            inner.agents[local] = make_agent(inner, local, sub, path + ("components", "agents", local))
        agent_names = set(inner.agents)
        for local, route in routes.items():
            rpath = path + ("components", route["type"] + "s", local)
            if route["type"] == "graph":
                check_graph(sub_doc, local, route, rpath, agent_names)
                inner.graphs[local] = GraphRoute(local, route, inner, rpath)
        self.network = None
        if routes:
            check_streams(sub_doc, agent_names, set(inner.graphs))
            self.network = StreamNetwork(inner)
            self._collected = []
            self.network.on_output(self._collected.append)
        self.routing = config["routing"]
        self.capabilities = ["composite"]
        for agent in (inner.agents[n] for n in (components.get("agents") or {})):
            for cap in agent.capabilities:
                if cap not in self.capabilities:
                    self.capabilities.append(cap)
        for local in routes:
            cap = "stateful-workflow" if routes[local]["type"] == "graph" else "reactive-processing"
            if cap not in self.capabilities:
                self.capabilities.append(cap)
        self.metadata = agent_metadata(self, components={
            kind: sorted(components.get(kind) or {}) for kind in ("agents", "graphs", "streams")})

    def _dispatch(self, spec, content, ctx):
        kind, name = spec["type"], spec["name"]
        if kind == "agent":
            return self.inner.agents[name].invoke(content, ctx)
        if kind == "graph":
            return self.inner.graphs[name].run(content, ctx).output
        start = len(self._collected)
        self.network.send(content, target=name)
        emitted = self._collected[start:]
        return emitted[-1].content if emitted else content

    def invoke(self, content, ctx):
        first, last = self.routing["input"], self.routing["output"]
        result = self._dispatch(first, content, ctx)
        if (last["type"], last["name"]) != (first["type"], first["name"]):
            result = self._dispatch(last, result, ctx)
        return result


# §4.7 Chain agents -----------------------------------------------------------------------
CHAIN_PREFIX = "ChainAgent processed: "
CHAIN_SEPARATOR = "->"   # INTERPRETATION §4.7 (Q74): the bare token, no spaces, also before step 1


def check_chain(doc, name, config, path, agent_types):
    if "prompt" in config and "prompt_reference" in config:
        raise doc.error(ConfigurationError, path, "chain agents take prompt or prompt_reference, "
                        "not both", "4.7, §16.3")
    steps = config.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
        raise doc.error(ConfigurationError, path + ("steps",),
                        "steps must be a sequence of strings", "4.7")
    ref = config.get("prompt_reference")
    if ref is not None and ref not in (doc.data.get("prompts") or {}):
        raise doc.error(ConfigurationError, path + ("prompt_reference",),
                        f"prompt_reference '{ref}' names no entry of prompts", "4.7, §10.4")


class ChainAgent:
    """§4.7: render the prompt (if any) with message=<input>, then append each step label.

    {type: chain, config: {steps: [a, b], prompt: "...", prompt_reference: name}}
    Makes no external call.
    """

    type = "chain"

    def __init__(self, name, cfg, rt, path):
        config = cfg["config"]
        self.name, self.rt, self.path = name, rt, path
        self.steps = list(config.get("steps") or [])
        self.prompt = config.get("prompt")
        if config.get("prompt_reference") is not None:
            self.prompt = rt.prompts[config["prompt_reference"]]
        self.capabilities = ["chain-processing"]
        self.metadata = agent_metadata(self, steps=list(self.steps))

    def invoke(self, content, ctx):
        text = content if isinstance(content, str) else str(content)
        if self.prompt is not None:
            text = render_runtime(self.rt, self.prompt, ctx, text, self.path + ("config", "prompt"))
        for step in self.steps:
            text += CHAIN_SEPARATOR + step
        return CHAIN_PREFIX + text


# §4.8 Template instance agents ---------------------------------------------------------
# Agents declared with `template` / `agent_template` are replaced by their concrete definition in
# Phase B (expand_templates, §8.7-§8.8) before validation; the type tag `template_instance` is
# accepted there and never reaches agent creation.

# §4.9 Agent context inheritance ------------------------------------------------------
def inherit_context(rt, config):
    """§4.9: an agent without a config.context of its own gets the global context (by reference)."""
    if "context" not in config:
        config["context"] = rt.context
    return config


# §4.11 Capabilities and metadata -------------------------------------------------------
def agent_metadata(agent, **extra):
    """§4.11: name, type, capabilities and reactive: true, plus the type's own keys."""
    meta = {"name": agent.name, "type": agent.type, "capabilities": list(agent.capabilities),
            "reactive": True}
    meta.update(extra)
    return meta


# §4.3 Defined agent types (the table, once every class above exists) ----------------------
AGENT_TYPES = {
    "llm": LLMAgent,
    "tool": ToolAgent,
    "composite": CompositeAgent,
    "chain": ChainAgent,
}
AGENT_CHECKS = {"composite": check_composite, "chain": check_chain}


def make_agent(rt, name, cfg, path):
    """§12.1 step 3: create one agent; any failure aborts start-up (AgentCreationError)."""
    inherit_context(rt, cfg["config"])
    try:
        return AGENT_TYPES[cfg["type"]](name, cfg, rt, path)
    except ActorError:
        raise
    except Exception as exc:  # boundary: a broken agent definition must not escape as a traceback
        raise rt.error(AgentCreationError, path, f"agent '{name}' could not be created: {exc}",
                       "12.1") from exc


# =====================================================================================
# §5 ROUTES -- COMMON CONCEPTS
# =====================================================================================

# §5.1 The routes section ---------------------------------------------------------------
# [streams]

# §5.2 Built-in streams --------------------------------------------------------------------
# [streams]

# §5.3 Stream routes ---------------------------------------------------------------------
# [streams]

# §5.3.1 Stream types ------------------------------------------------------------------
# [streams]

# §5.3.2 Operators -------------------------------------------------------------------------
# [streams]

# §5.3.3 Function references ---------------------------------------------------------
# [streams]

# §5.3.4 Agent mappers -----------------------------------------------------------------
# [streams]

# §5.3.5 Transform types ---------------------------------------------------------------
# [streams]

# §5.3.6 Accumulators -------------------------------------------------------------------
# [streams]

# §5.4 Conditions --------------------------------------------------------------------------
# One evaluator per condition type; the subsystem differences come from the two tables below.
# Subsystems: "stream" (filter, switch, splits), "bridge" (bridge conditional_route),
# "edge" (graph edges), "node" (conditional graph nodes).

def _content_text(subject):
    """Message content (stringified) for streams, the latest output for graph states."""
    if isinstance(subject, Message):
        content = subject.content
    else:  # graph state: the message the condition is about is the latest one
        content = subject.get("_condition_content", "")
    return content if isinstance(content, str) else str(content)


def _state_metadata(subject):
    return subject.get("metadata", {}) if isinstance(subject, dict) else {}


def cond_always(cond, subject):
    return True


def cond_never(cond, subject):
    return False


def cond_content_contains(cond, subject):
    return str(cond.get("text", "")) in _content_text(subject)


def cond_content_not_contains(cond, subject):
    return str(cond.get("text", "")) not in _content_text(subject)


def cond_content_starts_with(cond, subject):
    return _content_text(subject).startswith(str(cond.get("text", "")))


def cond_content_type(cond, subject):
    content = subject.content if isinstance(subject, Message) else subject.get("_condition_content")
    return type(content).__name__ == cond.get("value")


def cond_metadata_has(cond, subject):
    meta = subject.metadata if isinstance(subject, Message) else _state_metadata(subject)
    return cond.get("key") in meta


def cond_metadata_check(cond, subject):
    return _state_metadata(subject).get(cond.get("key")) == cond.get("value")


def cond_source_is(cond, subject):
    return isinstance(subject, Message) and subject.source_stream == cond.get("source")


def cond_has_messages(cond, subject):
    return bool(subject.get("messages")) if isinstance(subject, dict) else False


def cond_message_count(cond, subject):
    count = len(subject.get("messages", [])) if isinstance(subject, dict) else 0
    value, op = cond.get("value", 0), cond.get("operator", "eq")
    try:
        return {"gt": count > value, "lt": count < value, "eq": count == value}[op]
    except (KeyError, TypeError):
        return False


_MISSING = object()


def cond_context_value(cond, subject):
    """§6.5.1: state.metadata[key], then state.metadata['context'][key]; deep equality."""
    meta = _state_metadata(subject)
    key = cond.get("key")
    found = meta.get(key, _MISSING)
    if found is _MISSING and isinstance(meta.get("context"), dict):
        found = meta["context"].get(key, _MISSING)
    return found is not _MISSING and found == cond.get("value")


def cond_output_pattern(cond, subject):
    return str(_state_metadata(subject).get("last_output", "")).startswith(
        str(cond.get("pattern", "")))


def cond_message_pattern(cond, subject):
    messages = subject.get("messages") if isinstance(subject, dict) else None
    last = messages[-1].get("content", "") if messages else ""
    return str(cond.get("pattern", "")) in str(last)


def cond_custom(cond, subject):
    function = cond.get("function")
    return bool(function(subject)) if callable(function) else False


# The §5.4 table: type -> (evaluator, subsystems that honour it). Rows in the spec's order.
# INTERPRETATION §5.4 `never` (Q9): false wherever honoured; the "(returns True)" note is read as a slip.
CONDITIONS = {
    "always":               (cond_always,               {"stream", "bridge", "edge", "node"}),
    "never":                (cond_never,                {"node", "stream"}),
    "content_contains":     (cond_content_contains,     {"stream", "bridge", "edge", "node"}),
    "content_not_contains": (cond_content_not_contains, {"stream", "node", "bridge"}),
    "content_starts_with":  (cond_content_starts_with,  {"node"}),
    "content_type":         (cond_content_type,         {"bridge"}),
    "metadata_has":         (cond_metadata_has,         {"stream", "bridge"}),
    "metadata_check":       (cond_metadata_check,       {"node"}),
    "source_is":            (cond_source_is,            {"stream"}),
    "has_messages":         (cond_has_messages,         {"node"}),
    "message_count":        (cond_message_count,        {"node"}),
    "context_value":        (cond_context_value,        {"edge"}),
    "output_pattern":       (cond_output_pattern,       {"edge"}),
    "message_pattern":      (cond_message_pattern,      {"edge"}),
    "custom":               (cond_custom,               {"node"}),
}

# §5.4.1 Subsystem-specific behavior ---------------------------------------------------
# subsystem -> (result for an unknown or unhonoured type, result when `type` is absent, warn?)
CONDITION_DEFAULTS = {
    "stream": (True, True, True),
    "bridge": (False, True, True),
    "edge":   (True, True, True),
    "node":   (True, True, True),
}


def evaluate_condition(cond, subsystem, subject, rt=None, path=None):
    """§5.4, §5.4.1, §5.4.2: evaluate `cond` for `subsystem` against a Message or a graph state.

    Graph states carry the text that content conditions read under `_condition_content`.
    """
    unknown, absent, should_warn = CONDITION_DEFAULTS[subsystem]
    if not isinstance(cond, dict) or cond.get("type") is None:
        return absent
    kind = str(cond["type"])
    row = CONDITIONS.get(kind)
    if row is None or subsystem not in row[1]:
        if should_warn and rt is not None:
            rt.warn(f"condition type '{kind}' is not honoured by the {subsystem} subsystem; "
                    f"using its default ({unknown})", section="5.4.2", path=path)
        return unknown
    return row[0](cond, subject)


# §5.5 Subscriptions and publications -----------------------------------------------------
# [streams]

# §5.6 Bridge routes -----------------------------------------------------------------------
# [streams]


# =====================================================================================
# §6 GRAPH ROUTES
# =====================================================================================

# §6.1 Graph route structure -------------------------------------------------------------
# A graph route is run by one small executor (GraphRoute.run): it walks the graph step by step,
# one "next-node set" at a time (§6.7), applies each node's result to the one state of the route
# (§6.3), then follows every edge whose condition holds (§6.5). The handlers, the state rules,
# the checkpoint files, the guards and the setup analysis live under their own banners below.

# The §6.1 table: field -> default ("required" marks the two fields without one).
GRAPH_FIELDS = {
    "type": "required",
    "nodes": "required",
    "edges": "required",
    "entry_point": "start",
    "checkpointing": False,
    "checkpoint_dir": None,
    "enable_time_travel": False,
    "parallel_execution": True,
    "state_class": None,
    "bridge": None,
    "metadata": {},
    "template_config": None,
}


# INTERPRETATION §6.1 (Q28): a run's consumer-facing result is its latest output (last_output).
class GraphRun:
    """What one execution of a graph route gives back.

    `output` is the consumer-facing result (the run's latest output, §6.8/Q28), `state` a snapshot
    of the graph state at the end (messages list and metadata copied one level deep), `history`
    the executed node names in order, `stopped` the §6.8 guard that ended the run (or None).
    """

    __slots__ = ("output", "state", "history", "stopped")

    def __init__(self, output, state, history, stopped=None):
        self.output, self.state, self.history, self.stopped = output, state, history, stopped

    def __repr__(self):
        return f"GraphRun(output={self.output!r}, history={self.history!r}, stopped={self.stopped!r})"


class _RunTrace:
    """Per-run bookkeeping for the §6.8 guards: path, revisit fingerprints, depth, latest output."""

    __slots__ = ("history", "seen", "depth", "output", "stopped")

    def __init__(self, output):
        self.history = []
        self.seen = set()
        self.depth = 0
        self.output = output
        self.stopped = None


class GraphRoute:
    """§6: one graph route -- its analysed structure, its one persistent state, and its executor.

    `{type: graph, nodes: {...}, edges: [...], entry_point: start, checkpointing: false, ...}`
    """

    def __init__(self, name, cfg, rt, path=None):
        self.name = name
        self.cfg = cfg
        self.rt = rt
        self.path = tuple(path or ("routes", name))
        check_graph(rt.doc, name, cfg, self.path, set(rt.agents))
        self._warn_unknown_keys()
        self.entry = normalize_node_name(cfg.get("entry_point", GRAPH_FIELDS["entry_point"]))
        self.nodes = build_nodes(self)                      # name -> GraphNode, start/end included
        self.edges = build_edges(self)                      # [GraphEdge] in declaration order
        self.analysis = analyse_graph(self)                 # §6.11
        self.forward = self.analysis.forward
        self.parallel_execution = bool(cfg.get("parallel_execution", True))
        self.max_depth = max(2000, 50 * len(self.nodes))     # §6.8 item 1
        self.state = new_graph_state(resolve_state_class(self))
        self.time_travel = bool(cfg.get("enable_time_travel", False))
        self.snapshots = []                                  # §6.6 time travel, oldest first
        self.checkpoint_dir = None
        if cfg.get("checkpointing"):
            self.checkpoint_dir = Path(rt.workdir) / str(cfg["checkpoint_dir"])
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)   # §6.6 item 1
        self._checkpoint_seq = 0
        self.observers = []                                  # §6.10 node-event listeners
        self._pool = None                                    # §6.7 worker threads, made on demand
        self._lock = threading.RLock()                       # one run or update at a time

    # -- executing -------------------------------------------------------------------------
    def run(self, content, ctx=None, *, pure=False):
        """Execute the graph once for `content` (§6.2.1 start receives it) and return a GraphRun.

        `ctx` is the invocation context (the message's metadata.context, §10.2); it becomes
        state.metadata.context by reference and, after the run, is replaced in place by the final
        metadata (§6.9 item 3). pure=True: the active context rt.context is the one replaced.
        """
        target_ctx = self.rt.context if (pure or ctx is None) else ctx
        with self._lock:
            state = self.state
            begin_run(state, content, target_ctx)
            trace = _RunTrace(content)
            if self.entry == END_NODE:
                results = []
            else:
                results = self._step([(self.entry, content)], trace)
            while results and trace.stopped is None:
                frontier = self._next_nodes(results, trace)
                if not frontier:
                    break
                results = self._step(frontier, trace)
            replace_active_context(state, target_ctx)
            return GraphRun(trace.output, snapshot_state(state), trace.history, trace.stopped)

    def resume(self, ctx=None, *, pure=False):
        """Continue an interrupted run from a restored state: follow the edges out of
        state.current_node with metadata.last_output as the message (§6.6 recovery)."""
        target_ctx = self.rt.context if (pure or ctx is None) else ctx
        with self._lock:
            state = self.state
            state["metadata"]["context"] = target_ctx
            node = state.get("current_node")
            output = state["metadata"].get("last_output", "")
            trace = _RunTrace(output)
            results = [] if node in (None, END_NODE) or node not in self.nodes else [(node, output)]
            while results and trace.stopped is None:
                frontier = self._next_nodes(results, trace)
                if not frontier:
                    break
                results = self._step(frontier, trace)
            replace_active_context(state, target_ctx)
            return GraphRun(trace.output, snapshot_state(state), trace.history, trace.stopped)

    def run_node(self, node_name, content, ctx=None):
        """Execute one node on `content` and apply its result (the graph_node operator, §5.3.2)."""
        name = normalize_node_name(node_name)
        node = self.nodes.get(name)
        if node is None:
            raise ExecutionError(f"graph '{self.name}' has no node '{node_name}'",
                                 path=path_str(self.path), section="5.3.2")
        with self._lock:
            self.state["metadata"]["context"] = self.rt.context if ctx is None else ctx
            result = node.handler(self, node, content, self.state)
            if result is not None:
                self._apply(node, content, result)
            return content if result is None else result.output

    def _step(self, frontier, trace):
        """Run one next-node set; return [(node_name, output)] in frontier order (§6.7)."""
        state = self.state
        relaxed = guards_relaxed(state)
        admitted = []
        for name, message in frontier:
            node = self.nodes[name]
            stop = guard_before_node(self, node, message, trace, relaxed)
            if stop:
                break
            admitted.append((node, message))
        if len(admitted) == 1:                  # the common case: no set to schedule
            node, message = admitted[0]
            try:
                outcomes = [(node.handler(self, node, message, state), None)]
            except ActorError as exc:
                outcomes = [(None, exc)]
            except Exception as exc:  # agent boundary (§12.2.3): becomes an ExecutionError
                outcomes = [(None, ExecutionError(
                    f"graph '{self.name}' node '{node.name}': {exc}", section="6.2"))]
        else:
            outcomes = run_next_node_set(self, admitted, state)
        results = []
        for (node, message), (result, error) in zip(admitted, outcomes):
            if error is not None:
                state["error"] = str(error)
                raise error
            if node.type != "start":
                trace.history.append(node.name)
            if result is None:                      # §6.2.6.4 no rule matched: state unchanged
                results.append((node.name, message))
                continue
            if node.type != "start":
                self._apply(node, message, result)
            trace.output = result.output
            results.append((node.name, result.output))
            if guard_after_node(self, node, result.output, trace, relaxed):
                break
        return results

    def _next_nodes(self, results, trace):
        """§6.5: every edge whose condition holds, in declaration order; end closes a branch."""
        # INTERPRETATION §6.5 (Q40): level by level; reaching end closes one branch, and the run
        # ends when no branch is left.
        frontier, taken = [], set()
        state = self.state
        for name, output in results:
            view = None
            for edge in self.forward[name]:
                if edge.target in taken:            # INTERPRETATION §6.7 (Q41): joined in one step
                    continue
                if edge.condition is not None:
                    if view is None:
                        view = {"messages": state["messages"], "metadata": state["metadata"],
                                "_condition_content": output}
                    if not evaluate_condition(edge.condition, "edge", view, self.rt, edge.path):
                        continue
                taken.add(edge.target)
                if edge.target != END_NODE:
                    frontier.append((edge.target, output))
        return frontier

    def _apply(self, node, message, result):
        """Apply one node result to the state: one state update (§6.3, Q42/Q43)."""
        state = self.state
        metadata = state["metadata"]
        if result.metadata:
            metadata.update(result.metadata)
        if result.removed:
            for key in result.removed:
                metadata.pop(key, None)
        if result.set_state:
            merge_values(metadata, result.set_state)
        metadata["current_node"] = node.name
        metadata["current_message"] = message
        metadata["last_output"] = result.output
        messages = state["messages"]
        if result.last_content is not None and messages:
            messages[-1] = {**messages[-1], "content": result.last_content}
        if result.messages:
            messages.extend(result.messages)
            if len(messages) > MAX_STATE_MESSAGES:
                del messages[:len(messages) - MAX_STATE_MESSAGES]
        state["current_node"] = node.name
        self._updated()
        if self.observers:
            notify_node_event(self, node, result.output)

    def _updated(self):
        """Count one state update; keep a time-travel snapshot; checkpoint every ten (§6.6)."""
        state = self.state
        state["execution_count"] += 1
        if self.time_travel:
            self.snapshots.append(copy_state_for_history(state))
            if len(self.snapshots) > MAX_SNAPSHOTS:
                del self.snapshots[0]                 # §6.6: first in, first out
        if self.checkpoint_dir is not None and state["execution_count"] % CHECKPOINT_EVERY == 0:
            self.checkpoint()

    # -- state, checkpoints, time travel (§6.3, §6.6) ------------------------------------
    def update_state(self, content, mode="merge"):
        """Apply `content` as one state update (the state_update operator, §5.3.2, §6.3.2)."""
        with self._lock:
            apply_state_update(self.state, state_update_from_content(content), mode)
            self._updated()

    def checkpoint(self):
        """Write the full state to checkpoint_<timestamp>.json now; return its path (§6.6)."""
        if self.checkpoint_dir is None:
            raise ExecutionError(f"graph '{self.name}' has no checkpoint_dir (checkpointing is off)",
                                 path=path_str(self.path), section="6.6")
        with self._lock:
            return write_checkpoint(self, self.state)

    def checkpoints(self):
        """Checkpoint files of this graph, oldest first; the last one is the latest (§6.6 item 3)."""
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return []
        return sorted(self.checkpoint_dir.glob(CHECKPOINT_GLOB))

    def restore(self, path=None):
        """Replace the state by a checkpoint file's (default: the latest); return the path used."""
        with self._lock:
            return restore_checkpoint(self, path)

    def rewind(self, steps=1):
        """§6.6 time travel: go back `steps` state updates; later snapshots are dropped."""
        with self._lock:
            rewind_state(self, steps)

    # -- seeing it ---------------------------------------------------------------------------
    def mermaid(self):
        """Lines of a Mermaid flowchart `subgraph` for this graph (nodes, edges, entry, end)."""
        return mermaid_graph(self)

    def internal_stream_names(self):
        """§6.10 reserved names of this graph's internal streams."""
        return internal_stream_names(self.name, self.nodes)

    def _warn_unknown_keys(self):
        for key in self.cfg:
            if key not in GRAPH_FIELDS:
                self.rt.warn(f"unknown graph route key '{key}' ignored", section="6.1",
                             path=self.path + (key,))
        for node_name, node_cfg in (self.cfg.get("nodes") or {}).items():
            known = NODE_FIELDS.get(str(node_cfg.get("type", "")).lower(), ())
            for key in node_cfg:
                if key not in known and key not in NODE_COMMON_FIELDS:
                    self.rt.warn(f"unknown key '{key}' on node '{node_name}' ignored",
                                 section="6.2", path=self.path + ("nodes", node_name, key))
        for index, edge_cfg in enumerate(self.cfg.get("edges") or []):
            for key in edge_cfg:
                if key not in EDGE_FIELDS:
                    self.rt.warn(f"unknown edge key '{key}' ignored", section="6.4",
                                 path=self.path + ("edges", index, key))

    def close(self):
        """Stop the worker threads (§12.1 cleanup)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

# §6.2 Nodes -------------------------------------------------------------------------------
class GraphNode:
    """One node, prepared at setup: type, handler, and the fields its handler reads."""

    __slots__ = ("name", "type", "cfg", "handler", "parallel", "is_router", "agent", "retries",
                 "retry_delay", "timeout", "max_history_messages", "max_history_chars",
                 "rules", "function", "tools", "condition", "graph", "routes_only_to_router",
                 "path")

    def __init__(self, name, node_type, cfg, path):
        self.name, self.type, self.cfg, self.path = name, node_type, cfg, path
        self.handler = NODE_TYPES[node_type]
        self.parallel = bool(cfg.get("parallel", False))
        self.is_router = node_type == "message_router"
        self.agent = cfg.get("agent")
        policy = cfg.get("retry_policy")
        self.retries = int(policy.get("max_retries", 3)) if isinstance(policy, dict) else 0
        self.retry_delay = float(policy.get("delay", 1.0)) if isinstance(policy, dict) else 0.0
        self.timeout = cfg.get("timeout")
        meta = cfg.get("metadata") or {}
        self.max_history_messages = int(meta.get("max_history_messages", 20))   # §6.2.2.1
        self.max_history_chars = int(meta.get("max_history_chars", 12000))
        self.rules = compile_router_rules(cfg, path) if self.is_router else ()
        self.function = cfg.get("function")
        tools = cfg.get("tools", [])
        self.tools = [tools] if isinstance(tools, str) else list(tools or [])
        self.condition = cfg.get("condition")
        self.graph = cfg.get("graph")
        self.routes_only_to_router = False          # set by the §6.11 analysis


class NodeResult:
    """What a node handler returns; GraphRoute._apply turns it into one state update.

    output: the text passed on along the edges; metadata: keys written to state.metadata (the
    node's value wins); set_state: merged into state.metadata (§6.2.6.3); messages: appended to
    state.messages; last_content: new content for the last state message (§6.2.6.4).
    """

    __slots__ = ("output", "metadata", "set_state", "messages", "last_content", "removed")

    def __init__(self, output, metadata=None, set_state=None, messages=None, last_content=None,
                 removed=None):
        self.output = output
        self.removed = removed
        self.metadata = metadata
        self.set_state = set_state
        self.messages = messages
        self.last_content = last_content


START_NODE = "start"
END_NODE = "end"
# START/start and END/end name the same two nodes (§6.4).
NODE_NAME_ALIASES = {"START": START_NODE, "start": START_NODE, "END": END_NODE, "end": END_NODE}


def normalize_node_name(name):
    """§6.4 START/END normalisation; every other name is kept as written."""
    return NODE_NAME_ALIASES.get(name, name) if isinstance(name, str) else name


def build_nodes(graph):
    """Prepared GraphNode objects; start and end added when absent (§6.2.1)."""
    declared = {}
    for name, node_cfg in graph.cfg["nodes"].items():
        declared[normalize_node_name(name)] = GraphNode(
            normalize_node_name(name), str(node_cfg["type"]).lower(), node_cfg,
            graph.path + ("nodes", name))
    nodes = {}
    for name in (START_NODE, *declared, END_NODE):        # start first, end last
        nodes[name] = declared.get(name) or GraphNode(name, name, {"type": name},
                                                      graph.path + ("nodes", name))
    return nodes

# §6.2.1 start and end nodes -----------------------------------------------------------
def node_start(graph, node, message, state):
    """§6.2.1 start: receives the initial message and hands it on. `{type: start}`"""
    return NodeResult(message)


def node_end(graph, node, message, state):
    """§6.2.1 end: reached through an edge it closes its branch (the executor never runs it)."""
    return NodeResult(message)

# §6.2.2 Agent nodes -------------------------------------------------------------------
# The keys the agent node adds to the agent's context and never copies back (§6.2.2 item 3).
AGENT_NODE_RESERVED_KEYS = frozenset({
    "graph_state", "conversation_history", "full_context",
    "_history_truncated", "_history_original_length"})


def trim_history(messages, max_messages, max_chars, end=None):
    """§6.2.2.1: the newest `max_messages` of messages[:end] whose contents total at most
    `max_chars` characters."""
    end = len(messages) if end is None else end
    history = messages[max(0, end - max_messages):end] if max_messages > 0 else []
    try:                                     # the common case: string contents within budget
        if sum(map(len, map(dict.get, history, itertools.repeat("content")))) <= max_chars:
            return history
    except TypeError:
        pass
    total = 0
    for index in range(len(history) - 1, -1, -1):
        total += len(str(history[index].get("content", "")))
        if total > max_chars:
            history = history[index + 1:]
            break
    return history


def agent_node_context(node, state, message):
    """§6.2.2 item 2: the context mapping an agent node hands to its agent."""
    metadata = state["metadata"]
    nested = metadata.get("context")
    # INTERPRETATION §6.2.2 (Q33): a top-level metadata key wins over a nested context key.
    ctx = dict(nested) if isinstance(nested, dict) else {}
    ctx.update(metadata)
    messages = state["messages"]
    # INTERPRETATION §6.2.2 (Q30): the history is the conversation before the message the node
    # receives; when the newest state message is that message, it is the input, not history.
    end = len(messages)
    if end and messages[-1].get("content") == message:
        end -= 1
    history = trim_history(messages, node.max_history_messages, node.max_history_chars, end)
    ctx["graph_state"] = {"messages": history, "metadata": metadata,
                          "current_node": state["current_node"],
                          "execution_count": state["execution_count"], "error": state["error"]}
    ctx["conversation_history"] = history
    ctx["full_context"] = True
    if len(history) < end:
        ctx["_history_truncated"] = True
        ctx["_history_original_length"] = end
    return ctx


def context_changes(before, after):
    """§6.2.2 item 3: the keys the agent set, replaced or removed (reserved keys left out)."""
    get = before.get
    changes = {key: value for key, value in after.items() if get(key, _MISSING) is not value}
    if changes:
        for key in AGENT_NODE_RESERVED_KEYS.intersection(changes):
            del changes[key]
    removed = before.keys() - after.keys()
    return changes, (removed - AGENT_NODE_RESERVED_KEYS if removed else removed)


def invoke_with_timeout(agent, content, ctx, timeout):
    """Call agent.invoke, giving up after `timeout` real seconds (the call runs on a thread)."""
    if timeout is None:
        return agent.invoke(content, ctx)
    box = {}

    def call():
        try:
            box["value"] = agent.invoke(content, ctx)
        except BaseException as exc:  # handed back to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(float(timeout))
    if worker.is_alive():
        raise ExecutionError(f"agent '{agent.name}' timed out after {timeout} s", section="6.2.2")
    if "error" in box:
        raise box["error"]
    return box["value"]


def node_agent(graph, node, message, state):
    """§6.2.2 run the named agent on the current message with the graph-built context.

    `{type: agent, agent: <name>, retry_policy: {max_retries: 3, delay: 1.0}, timeout: <s>,
    parallel: false, metadata: {max_history_messages: 20, max_history_chars: 12000}}`
    """
    agent = graph.rt.agents[node.agent]
    # INTERPRETATION §6.2.2 (Q45): the agent renders Phase C with this node-built context.
    # INTERPRETATION §6.2.2 (Q44): raised errors are retried; `timeout` bounds each attempt; a
    # failed attempt's context changes are dropped; after the last one the run fails (state.error).
    attempt = 0
    while True:
        ctx = agent_node_context(node, state, message)
        before = dict(ctx)
        try:
            reply = invoke_with_timeout(agent, message, ctx, node.timeout)
            break
        except Exception as exc:
            if attempt >= node.retries:
                if isinstance(exc, ActorError):
                    raise
                raise ExecutionError(f"graph '{graph.name}' node '{node.name}': agent "
                                     f"'{node.agent}' failed: {exc}", section="6.2.2") from exc
            attempt += 1
            if graph.rt.clock.real and node.retry_delay > 0:
                time.sleep(node.retry_delay)        # a real wait between attempts
    reply = reply if isinstance(reply, str) else str(reply)
    changes, removed = context_changes(before, ctx)
    changes["last_agent_node"] = node.name                     # §6.2.2 item 4
    # INTERPRETATION §6.3.1 (Q29): the reply joins state.messages as an assistant message.
    return NodeResult(reply, metadata=changes, messages=[{"role": "assistant", "content": reply}],
                      removed=removed or None)

# §6.2.3 Function and tool nodes -------------------------------------------------------
def function_summarize(state):
    """summarize: metadata.summary = "Summary of N messages"."""
    return {"summary": f"Summary of {len(state['messages'])} messages"}


def function_route(state):
    """route: metadata.route = "question" when the last message holds '?', else "statement"."""
    messages = state["messages"]
    last = str(messages[-1].get("content", "")) if messages else ""
    return {"route": "question" if "?" in last else "statement"}


def function_validate(state):
    """validate: metadata.valid = whether the last message has non-blank content."""
    # INTERPRETATION §6.2.3 (Q38): valid iff the latest state message has non-blank content.
    messages = state["messages"]
    return {"valid": bool(messages) and bool(str(messages[-1].get("content", "")).strip())}


# The §6.2.3 table: the built-in functions every implementation supports.
FUNCTIONS = {
    "summarize": function_summarize,
    "route": function_route,
    "validate": function_validate,
}


def node_function(graph, node, message, state):
    """§6.2.3 run a built-in function over the state; unknown names add nothing.

    `{type: function, function: summarize|route|validate}`
    """
    function = FUNCTIONS.get(node.function)
    return NodeResult(message, metadata=function(state) if function else {})


def node_tool(graph, node, message, state):
    """§6.2.3 record one `Executed <name>` entry per named tool in metadata.tool_results.

    `{type: tool, tools: [<name>, ...]}`
    """
    # INTERPRETATION §6.2.3 (Q37): the names come from `tools`; nothing runs, the entries are
    # the fixed records the section prescribes.
    results = [{"tool": name, "result": f"Executed {name}"} for name in node.tools]
    return NodeResult(message, metadata={"tool_results": results})

# §6.2.4 Conditional nodes -------------------------------------------------------------
def node_conditional(graph, node, message, state):
    """§6.2.4 evaluate the condition on the state into metadata.condition_result.

    `{type: conditional, condition: {type: has_messages}}`
    """
    view = {"messages": state["messages"], "metadata": state["metadata"],
            "_condition_content": message}
    result = evaluate_condition(node.condition, "node", view, graph.rt, node.path + ("condition",))
    return NodeResult(message, metadata={"condition_result": bool(result)})

# §6.2.5 Subgraph nodes ------------------------------------------------------------------
def node_subgraph(graph, node, message, state):
    """§6.2.5 mark a nested graph: metadata.subgraph = <graph>, subgraph_pending = true.

    `{type: subgraph, graph: <graph_route_name>}`
    """
    # INTERPRETATION §6.2.5 (Q36): the route is named by `graph`; it is recorded, never run.
    return NodeResult(message, metadata={"subgraph": node.graph, "subgraph_pending": True})

# §6.2.6 Message router nodes -----------------------------------------------------------
def match_prefix(text, pattern, regex):
    return text.startswith(pattern)


def match_suffix(text, pattern, regex):
    return text.endswith(pattern)


def match_contains(text, pattern, regex):
    return pattern in text


def match_regex(text, pattern, regex):
    return regex.search(text)


def match_exact(text, pattern, regex):
    return text == pattern


def extract_prefix(text, pattern, separator, found):
    """Strip `pattern + separator` (or `pattern` alone when the separator is absent)."""
    # INTERPRETATION §6.2.6.2: whitespace after the stripped part is kept ("CODE fix" -> " fix").
    if separator and text.startswith(pattern + separator):
        return text[len(pattern) + len(separator):]
    return text[len(pattern):]


def extract_suffix(text, pattern, separator, found):
    return text[:len(text) - len(pattern)]


def extract_contains(text, pattern, separator, found):
    """The text after the first `pattern + separator`; the whole text when that is absent."""
    marker = pattern + separator
    at = text.find(marker)
    return text[at + len(marker):] if at >= 0 else text


def extract_regex(text, pattern, separator, found):
    """The first capture group when the pattern has one, else the whole message."""
    if found.re.groups:
        return found.group(1) or ""
    return text


def extract_exact(text, pattern, separator, found):
    return ""


# The §6.2.6.2 table: match_type -> (matcher, default extraction). Rows in the spec's order.
MATCH_TYPES = {
    "prefix":   (match_prefix,   extract_prefix),
    "suffix":   (match_suffix,   extract_suffix),
    "contains": (match_contains, extract_contains),
    "regex":    (match_regex,    extract_regex),
    "exact":    (match_exact,    extract_exact),
}


class RouterRule:
    """A message_router rule with its regex compiled at setup."""

    __slots__ = ("match", "extract", "pattern", "regex", "target", "extract_message",
                 "separator", "set_state")

    def __init__(self, rule):
        self.match, self.extract = MATCH_TYPES[str(rule["match_type"]).lower()]
        self.pattern = str(rule["pattern"])
        self.regex = re.compile(self.pattern) if self.match is match_regex else None
        self.target = normalize_node_name(rule["target"])
        self.extract_message = bool(rule.get("extract_message", True))
        self.separator = str(rule.get("separator", ":"))
        self.set_state = rule.get("set_state")


def compile_router_rules(cfg, path):
    return tuple(RouterRule(rule) for rule in cfg.get("rules") or ())


def node_message_router(graph, node, message, state):
    """§6.2.6 first matching rule sets next_node, rewrites the message, applies set_state.

    `{type: message_router, rules: [{match_type: prefix, pattern: CODE, target: code,
    extract_message: true, separator: ":", set_state: {...}}]}`
    """
    text = message if isinstance(message, str) else str(message)
    for rule in node.rules:                                     # §6.2.6.1 declaration order
        found = rule.match(text, rule.pattern, rule.regex)
        if not found:
            continue
        extracted = rule.extract(text, rule.pattern, rule.separator, found) \
            if rule.extract_message else text
        # INTERPRETATION §6.2.6.3 (Q35): set_state is written into state.metadata.
        return NodeResult(extracted, metadata={"next_node": rule.target},
                          set_state=rule.set_state, last_content=extracted)
    return None                                                  # §6.2.6.4: state unchanged


# The §6.2 table: node type (matched case-insensitively) -> handler. Rows in the spec's order.
NODE_TYPES = {
    "start":          node_start,
    "end":            node_end,
    "agent":          node_agent,
    "function":       node_function,
    "tool":           node_tool,
    "conditional":    node_conditional,
    "subgraph":       node_subgraph,
    "message_router": node_message_router,
}

# Keys each node type reads (anything else on a node draws a warning).
NODE_COMMON_FIELDS = ("type", "metadata", "parallel", "description")
NODE_FIELDS = {
    "start": (),
    "end": (),
    "agent": ("agent", "retry_policy", "timeout"),
    "function": ("function",),
    "tool": ("tools",),
    "conditional": ("condition",),
    "subgraph": ("graph", "params"),
    "message_router": ("rules",),
}

# §6.3 Graph state -------------------------------------------------------------------------
# The §6.3.1 table: field -> default (a fresh copy per state).
GRAPH_STATE_FIELDS = {
    "messages": list,
    "metadata": dict,
    "current_node": lambda: None,
    "execution_count": lambda: 0,
    "error": lambda: None,
}
MAX_STATE_MESSAGES = 50

# Schemas "known to the host" (§6.3.3).
# INTERPRETATION §6.3.3: this host knows only its own default state, as actor.GraphState.
STATE_SCHEMAS = {"actor.GraphState": GRAPH_STATE_FIELDS}


def new_graph_state(fields=GRAPH_STATE_FIELDS):
    return {name: make() for name, make in fields.items()}


def resolve_state_class(graph):
    """§6.3.3 the state_class schema, or the default one with a warning when unknown."""
    name = graph.cfg.get("state_class")
    if name is None:
        return GRAPH_STATE_FIELDS
    if name in STATE_SCHEMAS:
        return STATE_SCHEMAS[name]
    graph.rt.warn(f"state_class '{name}' is not known to this host; using the default graph "
                  f"state", section="6.3.3", path=graph.path + ("state_class",))
    return GRAPH_STATE_FIELDS


def begin_run(state, content, ctx):
    """A run starts: the global context joins the state, the input joins the messages."""
    metadata = state["metadata"]
    # INTERPRETATION §6.3.1 (Q32): state.metadata.context is the invocation context, by reference.
    metadata["context"] = ctx
    # INTERPRETATION §6.2.6.4 (Q33): next_node is a per-run routing signal, cleared at the start.
    metadata.pop("next_node", None)
    if isinstance(ctx, dict):
        ctx.pop("next_node", None)
    metadata["current_message"] = content
    # INTERPRETATION §6.2.1 (Q30): the start node's message joins state.messages as a user entry.
    messages = state["messages"]
    messages.append({"role": "user", "content": content})
    if len(messages) > MAX_STATE_MESSAGES:
        del messages[:len(messages) - MAX_STATE_MESSAGES]


def merge_values(target, update):
    """§6.3.2 merge: mappings merged recursively, lists extended, scalars replaced."""
    for key, value in update.items():
        old = target.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merge_values(old, value)
        elif isinstance(value, list) and isinstance(old, list):
            target[key] = old + value
        else:
            target[key] = value


def update_replace(state, field, value):
    state[field] = value


def update_merge(state, field, value):
    merge_values(state, {field: value})


def update_append(state, field, value):
    old = state.get(field)
    if isinstance(old, list):
        state[field] = old + (value if isinstance(value, list) else [value])
    else:
        update_merge(state, field, value)


# The §6.3.2 table: mode -> how one field of an update is applied.
UPDATE_MODES = {
    "replace": update_replace,
    "merge":   update_merge,
    "append":  update_append,
}


def apply_state_update(state, update, mode="merge"):
    """Apply a mapping to the state in one of the §6.3.2 modes; cap messages at 50 (§6.3.1)."""
    # INTERPRETATION §6.3.2 (Q43): keys that are not §6.3.1 fields update state.metadata, and
    # the 50-message cap holds after every mode, replace included.
    if mode not in UPDATE_MODES:
        raise ExecutionError(f"unknown state update mode '{mode}'", section="6.3.2")
    apply = UPDATE_MODES[mode]
    extra = {key: value for key, value in update.items() if key not in state}
    for key, value in update.items():
        if key in state:
            apply(state, key, value)
    if extra:
        apply(state, "metadata", extra)
    if not isinstance(state.get("messages"), list):
        state["messages"] = []
    if len(state["messages"]) > MAX_STATE_MESSAGES:
        state["messages"] = state["messages"][-MAX_STATE_MESSAGES:]


def state_update_from_content(content):
    """What a state_update message means: a mapping (or JSON object text) is the update itself;
    any other content is appended to messages as a user message."""
    # INTERPRETATION §6.3 (Q34): one state per graph route lives as long as the Actor, so an
    # update changes the state the next run starts from.
    if isinstance(content, str):
        try:
            parsed = json.loads(content)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            content = parsed
    if isinstance(content, dict):
        return content
    return {"messages": [{"role": "user", "content": content}]}


def snapshot_state(state):
    """The state at the end of a run, copied one level deep (messages are never edited in place)."""
    return {"messages": list(state["messages"]), "metadata": dict(state["metadata"]),
            "current_node": state["current_node"], "execution_count": state["execution_count"],
            "error": state["error"]}

# §6.4 Edges -------------------------------------------------------------------------------
EDGE_FIELDS = ("source", "target", "condition", "metadata", "description")


class GraphEdge:
    __slots__ = ("source", "target", "condition", "path", "cfg")

    def __init__(self, source, target, condition, path, cfg):
        self.source, self.target, self.condition, self.path, self.cfg = \
            source, target, condition, path, cfg


def build_edges(graph):
    return [GraphEdge(normalize_node_name(e["source"]), normalize_node_name(e["target"]),
                      e.get("condition"), graph.path + ("edges", i, "condition"), e)
            for i, e in enumerate(graph.cfg.get("edges") or [])]

# §6.5 Edge conditions -------------------------------------------------------------------
# Edge conditions go through the one §5.4 evaluator with the "edge" subsystem; the state view
# it sees is {messages, metadata, _condition_content: the source node's output} (GraphRoute.
# _next_nodes), so content_* conditions read the latest output and context_value reads
# state.metadata, then state.metadata.context (§6.5.1, cond_context_value).
# INTERPRETATION §6.5 (Q31): every node receives its predecessor's output.


def describe_condition(cond):
    """A short label for a condition, used on diagram edges."""
    if not isinstance(cond, dict):
        return ""
    kind = str(cond.get("type", "always"))
    if kind == "context_value":
        return f"{cond.get('key')} = {cond.get('value')}"
    for field in ("text", "pattern", "value", "key", "source"):
        if field in cond:
            return f"{kind} {cond[field]!r}" if isinstance(cond[field], str) \
                else f"{kind} {cond[field]}"
    return kind

# §6.6 Checkpointing and time travel -----------------------------------------------------
CHECKPOINT_EVERY = 10
MAX_SNAPSHOTS = 100
CHECKPOINT_GLOB = "checkpoint_*.json"


def checkpoint_timestamp(rt):
    """A sortable UTC date-time: the wall clock under a real clock, else 1970 + virtual seconds."""
    import datetime
    if rt.clock.real:
        moment = datetime.datetime.now(datetime.timezone.utc)
    else:
        moment = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc) + \
            datetime.timedelta(seconds=rt.clock.now())
    return moment.strftime("%Y%m%dT%H%M%S.%fZ")


def checkpoint_sequence(path):
    match = re.search(r"-(\d+)\.json$", path.name)
    return int(match.group(1)) if match else 0


def write_checkpoint(graph, state):
    """Persist the full state atomically (temp file + rename) as checkpoint_<ts>-<seq>.json."""
    # INTERPRETATION §6.6 (Q42): names are checkpoint_<UTC timestamp>-<6-digit sequence>.json; the
    # sequence continues past the newest file already there, so names stay unique and sortable.
    directory = graph.checkpoint_dir
    directory.mkdir(parents=True, exist_ok=True)
    existing = graph.checkpoints()
    if existing:
        graph._checkpoint_seq = max(graph._checkpoint_seq, checkpoint_sequence(existing[-1]))
    graph._checkpoint_seq += 1
    stamp = checkpoint_timestamp(graph.rt)
    name = f"checkpoint_{stamp}-{graph._checkpoint_seq:06d}.json"
    if existing and name <= existing[-1].name:         # the clock went back: keep the order
        stamp = existing[-1].name[len("checkpoint_"):-len("-000000.json")]
        name = f"checkpoint_{stamp}-{graph._checkpoint_seq:06d}.json"
    final = directory / name
    text = json.dumps(state, default=str, ensure_ascii=False, indent=1)
    temp = directory / f".{final.name}.tmp"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, final)
    return final


def restore_checkpoint(graph, path=None):
    """§6.6 item 4: load a checkpoint file (default: the latest) into the graph's state."""
    if path is None:
        found = graph.checkpoints()
        if not found:
            raise ApplicationError(f"graph '{graph.name}' has no checkpoint to restore",
                                   path=path_str(graph.path), section="6.6")
        path = found[-1]
    path = Path(path)
    if not path.is_absolute():
        path = Path(graph.rt.workdir) / path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ApplicationError(f"cannot restore graph '{graph.name}' from {path}: {exc}",
                               path=path_str(graph.path), section="6.6") from exc
    if not isinstance(data, dict):
        raise ApplicationError(f"{path} does not hold a graph state", section="6.6")
    state = new_graph_state()
    for key in state:
        if key in data:
            state[key] = data[key]
    # INTERPRETATION §6.6 (Q42): the stored context copy is kept until the next run re-attaches
    # the live context (Q32).
    graph.state = state
    return path


def copy_state_for_history(state):
    """A time-travel snapshot: messages and metadata copied, the live context left out."""
    metadata = {k: copy.deepcopy(v) for k, v in state["metadata"].items() if k != "context"}
    return {"messages": list(state["messages"]), "metadata": metadata,
            "current_node": state["current_node"], "execution_count": state["execution_count"],
            "error": state["error"]}


def rewind_state(graph, steps):
    """§6.6 time travel: restore the state as it was `steps` updates ago."""
    if not graph.time_travel:
        raise ApplicationError(f"graph '{graph.name}' has enable_time_travel off",
                               path=path_str(graph.path), section="6.6")
    steps = int(steps)
    if steps < 1 or steps >= len(graph.snapshots):
        raise ApplicationError(f"graph '{graph.name}' can rewind 1..{len(graph.snapshots) - 1} "
                               f"steps, not {steps}", path=path_str(graph.path), section="6.6")
    del graph.snapshots[len(graph.snapshots) - steps:]
    chosen = graph.snapshots[-1]
    context = graph.state["metadata"].get("context")
    state = {"messages": list(chosen["messages"]), "metadata": copy.deepcopy(chosen["metadata"]),
             "current_node": chosen["current_node"], "execution_count": chosen["execution_count"],
             "error": chosen["error"]}
    if context is not None:
        state["metadata"]["context"] = context
    graph.state = state

# §6.7 Parallel execution ----------------------------------------------------------------
def run_next_node_set(graph, admitted, state):
    """§6.7: the parallel:true nodes of the set run together on threads, the others one after
    another; every node reads the state as it was before the set, and the outcomes come back in
    the set's order as (NodeResult|None, error|None)."""
    # INTERPRETATION §6.7 (Q41): a next-node set is one step; its results are applied in
    # declaration (edge) order after all of them finished, and a node reached by several
    # edges of the same step runs once.
    parallel = []
    if graph.parallel_execution and len(admitted) > 1:
        parallel = [i for i, (node, _) in enumerate(admitted) if node.parallel]
    if len(parallel) < 2:
        parallel = []
    outcomes = [None] * len(admitted)
    futures = {}
    if parallel:
        if graph._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            graph._pool = ThreadPoolExecutor(thread_name_prefix=f"graph-{graph.name}")
        for i in parallel:
            node, message = admitted[i]
            futures[i] = graph._pool.submit(node.handler, graph, node, message, state)
    for i, (node, message) in enumerate(admitted):
        if i in futures:
            continue
        try:
            outcomes[i] = (node.handler(graph, node, message, state), None)
        except Exception as exc:  # agent boundary: reported after the set is joined
            outcomes[i] = (None, exc)
    for i, future in futures.items():
        try:
            outcomes[i] = (future.result(), None)
        except Exception as exc:
            outcomes[i] = (None, exc)
    for i, (result, error) in enumerate(outcomes):
        if error is not None and not isinstance(error, ActorError):
            node = admitted[i][0]
            outcomes[i] = (None, ExecutionError(
                f"graph '{graph.name}' node '{node.name}': {error}", section="6.2"))
    return outcomes

# §6.8 Loop and cycle detection ----------------------------------------------------------
# Output fragments that show an agent asked for more routing (§6.8 item 4).
ROUTING_TOKENS = ("GOTO_", "ROUTE_", "SET_", "CMD_", "DISCOVERY_RESPONSE",
                  "AUTO_SECTIONS_COMPLETE", "COMMAND_OUTPUT")
FINGERPRINT_CHARS = 200


def guards_relaxed(state):
    """auto_finish_active, read from state.metadata, then its nested context (Q39)."""
    metadata = state["metadata"]
    if "auto_finish_active" in metadata:
        return bool(metadata["auto_finish_active"])
    nested = metadata.get("context")
    return bool(nested.get("auto_finish_active")) if isinstance(nested, dict) else False


def guard_before_node(graph, node, message, trace, relaxed):
    """Items 1 and 2, checked before a node runs; True (and trace.stopped set) stops the run."""
    # INTERPRETATION §6.8 (Q39): the guards count per run; depth is the number of node
    # executions; a revisit is caught before the repeated node runs and fingerprints the
    # message the node is about to receive; "router" means a message_router node.
    if node.type == "start":
        return False
    trace.depth += 1
    if trace.depth > graph.max_depth:
        graph.rt.warn(f"graph '{graph.name}' exceeded its recursion bound of {graph.max_depth} "
                      f"node executions; returning the latest output", section="6.8",
                      path=graph.path)
        trace.stopped = "recursion"
        return True
    if not node.is_router and not relaxed:
        text = message if isinstance(message, str) else str(message)
        key = (node.name, text[:FINGERPRINT_CHARS])
        if key in trace.seen:
            trace.stopped = "revisit"
            return True
        trace.seen.add(key)
    return False


def guard_after_node(graph, node, output, trace, relaxed):
    """Items 3 and 4, checked after a node ran; True (and trace.stopped set) stops the run."""
    if node.type != "agent":
        return False
    history = trace.history
    if not relaxed and len(history) >= 4 and history[-1] == history[-3] == node.name:
        if graph.nodes[history[-2]].is_router and graph.nodes[history[-4]].is_router:
            trace.stopped = "ping-pong"
            return True
    if node.routes_only_to_router:
        text = output if isinstance(output, str) else str(output)
        if not any(token in text for token in ROUTING_TOKENS):
            trace.output = output
            trace.stopped = "return-without-routing"
            return True
    return False

# §6.9 Pure graph mode -------------------------------------------------------------------
def replace_active_context(state, ctx):
    """§6.9 item 3: the final metadata replaces the context in place, nested keys merged up."""
    # INTERPRETATION §6.9 (Q33): top-level metadata keys win over nested context keys; graph
    # keys (last_output, last_agent_node, ...) are kept for inspection; this happens after
    # every run, pure or mixed, so both modes look the same.
    if not isinstance(ctx, dict):
        return
    metadata = state["metadata"]
    nested = metadata.get("context")
    merged = dict(nested) if isinstance(nested, dict) else {}
    for key, value in metadata.items():
        if key != "context":
            merged[key] = value
    ctx.clear()
    ctx.update(merged)
    metadata["context"] = ctx

# §6.10 Graph-internal streams ---------------------------------------------------------
def internal_stream_names(graph_name, node_names):
    """The reserved per-node, control and state stream names of one graph (§6.10, §15.6)."""
    names = [f"__{graph_name}_node_{node}__" for node in node_names]
    return names + [f"__{graph_name}_control__", f"__{graph_name}_state__"]


def notify_node_event(graph, node, output):
    """Hand a node's output to the listeners of __<graph>_node_<node>__ (mixed mode)."""
    stream = f"__{graph.name}_node_{node.name}__"
    msg = Message(output, {"graph": graph.name, "node": node.name,
                           "execution_count": graph.state["execution_count"]},
                  source_stream=stream, timestamp=graph.rt.clock.now())
    for listener in list(graph.observers):
        listener(stream, msg)

# §6.11 Graph analysis -------------------------------------------------------------------
class GraphAnalysis:
    """§6.11 results: adjacency both ways, cycles, topological levels, unreachable nodes."""

    __slots__ = ("forward", "reverse", "has_cycles", "back_edges", "levels", "unreachable")


def analyse_graph(graph):
    nodes, edges = graph.nodes, graph.edges
    result = GraphAnalysis()
    result.forward = {name: [] for name in nodes}                     # item 1
    result.reverse = {name: [] for name in nodes}
    for edge in edges:
        result.forward[edge.source].append(edge)
        result.reverse[edge.target].append(edge)
    result.back_edges = find_back_edges(graph.entry, nodes, result.forward)   # item 2
    result.has_cycles = bool(result.back_edges)
    result.levels = topological_levels(nodes, edges, result.back_edges)       # item 3
    reached = reachable_from(graph.entry, result.forward)                     # item 4
    result.unreachable = [name for name in nodes
                          if name not in reached and name not in implicit_names(graph)]
    if result.unreachable:
        graph.rt.warn(f"graph '{graph.name}': nodes unreachable from '{graph.entry}': "
                      + ", ".join(result.unreachable), section="6.11", path=graph.path)
    for name, node in nodes.items():                                         # for §6.8 item 4
        out = result.forward[name]
        node.routes_only_to_router = len(out) == 1 and nodes[out[0].target].is_router
    return result


def implicit_names(graph):
    declared = {normalize_node_name(name) for name in graph.cfg["nodes"]}
    return {START_NODE, END_NODE} - declared


def reachable_from(entry, forward):
    seen, todo = {entry}, [entry]
    while todo:
        for edge in forward.get(todo.pop(), ()):
            if edge.target not in seen:
                seen.add(edge.target)
                todo.append(edge.target)
    return seen


def find_back_edges(entry, nodes, forward):
    """Edges that close a cycle, by depth-first search from the entry, then from the rest."""
    colour = {name: 0 for name in nodes}         # 0 new, 1 on the current path, 2 done
    back = []
    for root in [entry] + list(nodes):
        if colour.get(root) != 0:
            continue
        colour[root] = 1
        stack = [(root, iter(forward[root]))]
        while stack:
            name, edges = stack[-1]
            edge = next(edges, None)
            if edge is None:
                colour[name] = 2
                stack.pop()
            elif colour[edge.target] == 1:
                back.append(edge)
            elif colour[edge.target] == 0:
                colour[edge.target] = 1
                stack.append((edge.target, iter(forward[edge.target])))
    return back


def topological_levels(nodes, edges, back_edges):
    """Nodes grouped by longest distance from a source once cycle-closing edges are set aside."""
    skip = set(map(id, back_edges))
    indegree = {name: 0 for name in nodes}
    succ = {name: [] for name in nodes}
    for edge in edges:
        if id(edge) not in skip:
            indegree[edge.target] += 1
            succ[edge.source].append(edge.target)
    level = {name: 0 for name in nodes if indegree[name] == 0}
    ready = [name for name in nodes if indegree[name] == 0]
    while ready:
        name = ready.pop(0)
        for target in succ[name]:
            level[target] = max(level.get(target, 0), level[name] + 1)
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
    levels = []
    for name in nodes:
        depth = level.get(name, 0)
        while len(levels) <= depth:
            levels.append([])
        levels[depth].append(name)
    return levels


def check_graph(doc, name, cfg, path, agent_names):
    """§11.3, §6.4, §6.11 items 5-6, §16.2: static checks of one graph route before any agent
    exists; raises a located ConfigurationError."""
    path = tuple(path)

    def fail(where, message, section):
        raise doc.error(ConfigurationError, path + tuple(where), message, section)

    if not isinstance(cfg, dict):
        fail((), f"graph route '{name}' must be a mapping", "6.1")
    nodes = cfg.get("nodes")
    if nodes is None and cfg.get("template_config") is not None:
        return                                              # §11.3: instantiated from a template
    if not isinstance(nodes, dict) or not nodes:
        fail(("nodes",), f"graph route '{name}' needs a non-empty nodes mapping", "6.1, 11.3")
    edges = cfg.get("edges", [])
    if edges is None:
        edges = []
    if not isinstance(edges, list):
        fail(("edges",), "edges must be a sequence", "6.4")
    for flag in ("checkpointing", "enable_time_travel", "parallel_execution"):
        if flag in cfg and not isinstance(cfg[flag], bool):
            fail((flag,), f"{flag} must be a boolean", "6.1")
    if cfg.get("checkpointing") and not cfg.get("checkpoint_dir"):
        # INTERPRETATION §6.1 (Q42): checkpointing without checkpoint_dir is rejected at load.
        fail(("checkpoint_dir",), "checkpointing: true needs a checkpoint_dir", "6.1, 6.6")
    if "state_class" in cfg and not isinstance(cfg["state_class"], str):
        fail(("state_class",), "state_class must be a string", "6.3.3")
    declared = set()
    for node_name, node_cfg in nodes.items():
        where = ("nodes", node_name)
        if not isinstance(node_name, str) or not node_name:
            fail(where, "node names must be non-empty strings", "6.2")
        if not isinstance(node_cfg, dict) or "type" not in node_cfg:
            fail(where, f"node '{node_name}' must be a mapping with a type", "6.2")
        node_type = str(node_cfg["type"]).lower()
        if node_type == "dynamic_router":
            fail(where + ("type",), "node type 'dynamic_router' is forbidden; use message_router",
                 "16.2")
        if node_type not in NODE_TYPES:     # INTERPRETATION §6.2: no extension node types
            fail(where + ("type",), f"unknown node type '{node_cfg['type']}'", "6.2")
        canonical = normalize_node_name(node_name)
        # INTERPRETATION §6.2 (Q83): start/end (START/END) may be declared only as nodes of
        # their own type; any other node under these names is rejected.
        if canonical in (START_NODE, END_NODE) and node_type != canonical:
            fail(where, f"node name '{node_name}' is reserved for the {canonical} node", "6.2, 15.2")
        if canonical not in (START_NODE, END_NODE) and node_type in (START_NODE, END_NODE):
            fail(where + ("type",), f"only the node named {node_type} may have type {node_type}",
                 "6.2.1")
        if canonical in declared:
            fail(where, f"node '{node_name}' is declared twice (START/END name one node)", "6.4")
        declared.add(canonical)
        check_node(fail, where, node_name, node_type, node_cfg, agent_names, doc)
    known = declared | {START_NODE, END_NODE}
    for index, edge in enumerate(edges):
        where = ("edges", index)
        if not isinstance(edge, dict):
            fail(where, "an edge must be a mapping with source and target", "6.4")
        for end in ("source", "target"):
            value = edge.get(end)
            if not isinstance(value, str):
                fail(where + (end,), f"edge {end} is required", "6.4")
            if normalize_node_name(value) not in known:
                fail(where + (end,), f"{end} '{value}' is not a node of graph '{name}'",
                     "6.4, 11.3")
        if "condition" in edge and not isinstance(edge["condition"], dict):
            fail(where + ("condition",), "an edge condition must be a mapping", "6.5")
    entry = normalize_node_name(cfg.get("entry_point", "start"))
    if entry not in known:
        fail(("entry_point",), f"entry_point '{cfg.get('entry_point')}' is not a node of graph "
             f"'{name}'", "6.11, 11.3")
    for node_name, node_cfg in nodes.items():
        if str(node_cfg["type"]).lower() == "message_router":
            for index, rule in enumerate(node_cfg["rules"]):
                if normalize_node_name(rule["target"]) not in known:
                    fail(("nodes", node_name, "rules", index, "target"),
                         f"target '{rule['target']}' is not a node of graph '{name}'", "6.2.6")


def check_node(fail, where, node_name, node_type, node_cfg, agent_names, doc):
    """The per-type field checks of one node (§6.2.2-§6.2.6)."""
    if "parallel" in node_cfg and not isinstance(node_cfg["parallel"], bool):
        fail(where + ("parallel",), "parallel must be a boolean", "6.7")
    meta = node_cfg.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        fail(where + ("metadata",), "node metadata must be a mapping", "6.2")
    for key in ("max_history_messages", "max_history_chars"):
        if isinstance(meta, dict) and key in meta and (
                isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 0):
            fail(where + ("metadata", key), f"{key} must be a non-negative integer", "6.2.2.1")
    if node_type == "agent":
        agent = node_cfg.get("agent")
        if not isinstance(agent, str):
            fail(where + ("agent",), f"agent node '{node_name}' needs an agent", "6.2.2")
        if agent not in agent_names:
            fail(where + ("agent",), f"agent '{agent}' is not defined in agents", "6.2.2, 11.3")
        policy = node_cfg.get("retry_policy")
        if policy is not None:
            if not isinstance(policy, dict):
                fail(where + ("retry_policy",), "retry_policy must be a mapping", "6.2.2")
            retries, delay = policy.get("max_retries", 3), policy.get("delay", 1.0)
            if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
                fail(where + ("retry_policy", "max_retries"),
                     "max_retries must be a non-negative integer", "6.2.2")
            if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
                fail(where + ("retry_policy", "delay"), "delay must be a non-negative number",
                     "6.2.2")
        timeout = node_cfg.get("timeout")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout <= 0):
            fail(where + ("timeout",), "timeout must be a positive number of seconds", "6.2.2")
    elif node_type == "function":
        if not isinstance(node_cfg.get("function"), str):
            fail(where + ("function",), f"function node '{node_name}' needs a function name",
                 "6.2.3")
    elif node_type == "tool":
        tools = node_cfg.get("tools", [])
        if isinstance(tools, str):
            tools = [tools]
        if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            fail(where + ("tools",), "tools must be a list of tool names", "6.2.3")
    elif node_type == "conditional":
        if not isinstance(node_cfg.get("condition"), dict):
            fail(where + ("condition",), f"conditional node '{node_name}' needs a condition "
                 "mapping", "6.2.4")
    elif node_type == "subgraph":
        graph = node_cfg.get("graph")
        routes = doc.data.get("routes") if isinstance(doc.data, dict) else None
        target = routes.get(graph) if isinstance(routes, dict) and isinstance(graph, str) else None
        if not isinstance(target, dict) or str(target.get("type", "")).lower() != "graph":
            fail(where + ("graph",), f"subgraph node '{node_name}' must name a graph route in "
                 "`graph`", "6.2.5")
    elif node_type == "message_router":
        rules = node_cfg.get("rules")
        if not isinstance(rules, list) or not rules:
            fail(where + ("rules",), f"message_router '{node_name}' needs a list of rules",
                 "6.2.6")
        for index, rule in enumerate(rules):
            at = where + ("rules", index)
            if not isinstance(rule, dict):
                fail(at, "a rule must be a mapping", "6.2.6")
            kind = rule.get("match_type")
            if not isinstance(kind, str) or kind.lower() not in MATCH_TYPES:
                fail(at + ("match_type",), f"unknown match_type {kind!r}", "6.2.6.2")
            if not isinstance(rule.get("pattern"), str):
                fail(at + ("pattern",), "pattern is required (a string)", "6.2.6")
            if not isinstance(rule.get("target"), str):
                fail(at + ("target",), "target is required (a node name)", "6.2.6")
            if kind.lower() == "regex":
                try:
                    re.compile(rule["pattern"])
                except re.error as exc:
                    fail(at + ("pattern",), f"invalid regular expression: {exc}", "6.2.6.2")
            if "extract_message" in rule and not isinstance(rule["extract_message"], bool):
                fail(at + ("extract_message",), "extract_message must be a boolean", "6.2.6")
            if "separator" in rule and not isinstance(rule["separator"], str):
                fail(at + ("separator",), "separator must be a string", "6.2.6")
            if "set_state" in rule and not isinstance(rule["set_state"], dict):
                fail(at + ("set_state",), "set_state must be a mapping", "6.2.6.3")


def mermaid_id(graph_name, node_name):
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{graph_name}__{node_name}")


def mermaid_text(text):
    return str(text).replace('"', "#quot;")


# Node shapes in the diagram, by node type.
MERMAID_SHAPES = {
    "start": '(["{}"])', "end": '(["{}"])', "agent": '["{}"]', "function": '[["{}"]]',
    "tool": '[["{}"]]', "conditional": '{{"{}"}}', "subgraph": '[["{}"]]',
    "message_router": '{{"{}"}}',
}


def mermaid_graph(graph):
    """The graph as a Mermaid `subgraph` block (nodes in declaration order, then the edges)."""
    gid = mermaid_id("graph", graph.name)
    lines = [f'subgraph {gid}["graph {mermaid_text(graph.name)}"]']
    for name, node in graph.nodes.items():
        label = name
        if node.type == "agent":
            label = f"{name}: agent {node.agent}"
        elif node.type == "function":
            label = f"{name}: function {node.function}"
        elif node.type in ("tool", "subgraph", "conditional", "message_router"):
            label = f"{name}: {node.type}"
        shape = MERMAID_SHAPES[node.type].format(mermaid_text(label))
        lines.append(f"  {mermaid_id(graph.name, name)}{shape}")
    entry = mermaid_id(graph.name, "__entry")
    lines.append(f"  {entry}((entry)) --> {mermaid_id(graph.name, graph.entry)}")
    for edge in graph.edges:
        arrow = "-->"
        if edge.condition is not None:
            arrow = f'-->|"{mermaid_text(describe_condition(edge.condition))}"|'
        lines.append(f"  {mermaid_id(graph.name, edge.source)} {arrow} "
                     f"{mermaid_id(graph.name, edge.target)}")
    lines.append("end")
    return lines


# =====================================================================================
# §7 INTER-ROUTE COMPOSITION
# =====================================================================================

# §7.1 The merges section ---------------------------------------------------------------
# [streams]

# §7.2 The splits section ---------------------------------------------------------------
# [streams]

# §7.3 The pipelines section -------------------------------------------------------------
# [streams]


# =====================================================================================
# §8 TEMPLATES AND INSTANCES
# =====================================================================================

# §8.1 Document-level templating (Phase A) ------------------------------------------------
# [templating]

# §8.2 Document-level rendering lifecycle -----------------------------------------------
# [templating]

# §8.3 Template variables, filters and built-ins ------------------------------------------
# [templating]

# §8.4 Deferred rendering and field protection -------------------------------------------
# [templating]

# §8.5 Document-level template storage ----------------------------------------------------
# [templating]

# §8.6 The templates section (Phase B) ---------------------------------------------------
# [templating]

# §8.7 Template instances ------------------------------------------------------------------
# [templating]

# §8.8 Template rendering semantics (Phase B) ---------------------------------------------
# [templating]

# §8.9 The template_strings section -------------------------------------------------------
# [templating]

# §8.10 Composite templates ----------------------------------------------------------------
# [templating]

# §8.11 Runtime template rendering (Phase C) ----------------------------------------------
# [templating]

# §8.12 Render-failure policy -------------------------------------------------------------
# [templating]


# =====================================================================================
# §9 ACTOR PARAMETERS
# =====================================================================================

# §9.2 template_engine ---------------------------------------------------------------------
# [templating] the JINJA2, MUSTACHE and SIMPLE engines; render(text, variables, engine, partials)

# §9.3 default_router ----------------------------------------------------------------------
# See §3.4 above (resolve_default_router): the host parameter wins over cleveragents.default_router.

# §9.4 unsafe --------------------------------------------------------------------------------
# INTERPRETATION §9.4 (Q91): a declaration counts when it is true, a non-zero number, or one of the
# strings true/yes/on/1 (any case) -- the §8.6.2 boolean words; "false" and "no" do not count.
TRUTHY_WORDS = {"true", "yes", "on", "1"}


def is_declared_true(value):
    if isinstance(value, str):
        return value.strip().lower() in TRUTHY_WORDS
    return bool(value) and isinstance(value, (bool, int, float))


def check_unsafe(doc, host_unsafe):
    """§9.4, §13.1: an Actor that declares unsafe is refused on a safe host."""
    glob = (doc.data.get("context") or {}).get("global") or {}
    if is_declared_true(glob.get("unsafe")) and not host_unsafe:
        raise doc.error(UnsafeConfigurationError, ("context", "global", "unsafe"),
                        "this Actor requires unsafe mode and the host is in safe mode "
                        "(run with --unsafe / load(unsafe=True))", "9.4, §13.1")


# =====================================================================================
# §10 CONTEXT
# =====================================================================================

# §10.1 The context section --------------------------------------------------------------
def check_context(doc):
    """§10.1, §10.3, §4.4.5: context.global is a mapping of user keys."""
    section = doc.data.get("context")
    if section is None:
        return
    if not isinstance(section, dict):
        raise doc.error(ConfigurationError, ("context",), "context must be a mapping", "10.1")
    glob = section.get("global")
    if glob is None:
        return
    if not isinstance(glob, dict):
        raise doc.error(ConfigurationError, ("context", "global"), "context.global must be a mapping",
                        "10.1")
    for key in glob:
        path = ("context", "global", key)
        if str(key).startswith("__"):
            raise doc.error(ConfigurationError, path,
                            f"context key '{key}' is reserved (keys starting with __)", "10.3")
        if key in HOST_ONLY_CONTEXT_KEYS:
            raise doc.error(ConfigurationError, path, f"'{key}' is set by the host, never by the "
                            "Actor configuration", HOST_ONLY_CONTEXT_KEYS[key])


def build_global_context(doc, host_context, host_unsafe):
    """§10.2 item 1: the live global context, plus the host's invocation-context keys (§10.3)."""
    glob = (doc.data.get("context") or {}).get("global") or {}
    ctx = copy.deepcopy(glob)
    if host_unsafe:
        ctx["_unsafe_mode"] = True
    ctx.update(host_context or {})
    return ctx


# §10.3 Reserved context keys -------------------------------------------------------------
# Keys only the host may set. INTERPRETATION §10.3 (Q84): declaring them in context.global is an error.
HOST_ONLY_CONTEXT_KEYS = {"_temperature_override": "4.4.5, §10.3", "_unsafe_mode": "10.3, §13.3"}
RESERVED_CONTEXT_KEYS = (
    "_temperature_override", "_unsafe_mode", "auto_finish_active", "auto_finish_state",
    "auto_finish_final_stage", "auto_finish_last_output", "graph_state", "conversation_history",
    "full_context", "_history_truncated", "_history_original_length", "next_node", "last_output",
    "last_agent_node", "current_message", "current_node", "current_section_path",
    "current_section_index", "section_paths", "writing_stage", "current_latex_index",
)


# §10.4 The prompts section ---------------------------------------------------------------
def collect_prompts(doc):
    """§10.4: name -> template text, long form only.

    INTERPRETATION §10.4 vs §16.2 (Q4): a plain string (the short form) is rejected; any other value
    without a `content` key is skipped silently.
    """
    prompts = {}
    section = doc.data.get("prompts")
    if section is None:
        return prompts
    if not isinstance(section, dict):
        raise doc.error(ConfigurationError, ("prompts",), "prompts must be a mapping", "10.4")
    for name, value in section.items():
        if isinstance(value, str):
            raise doc.error(ConfigurationError, ("prompts", name), "short-form prompt templates are "
                            "forbidden; write {content: ...}", "16.2, §10.4")
        if isinstance(value, dict) and "content" in value:
            prompts[name] = value["content"] if isinstance(value["content"], str) else str(
                value["content"])
    return prompts


# =====================================================================================
# §11 VALIDATION RULES
# =====================================================================================

# §11.1 Structural validation -------------------------------------------------------------
# Items 1-5 and 7 are checked by check_top_level (§3.2), item 6 by resolve_default_router (§3.4),
# items 3-4 per agent by check_agent (§4.1).

def validate_document(doc, rt, host_default_router=None):
    """§11 (with §9.4, §10, §15, §16): every rule, before any agent is created. Returns the default
    router (or None)."""
    agent_names = set(doc.data["agents"])
    for name, cfg in doc.data["agents"].items():
        check_agent(doc, name, cfg, ("agents", name), AGENT_TYPES)
        check_agent_name_style(rt, name, ("agents", name))
        warn_unknown_fields(rt, cfg, AGENT_FIELDS, ("agents", name), "4.1")
    check_context(doc)
    collect_prompts(doc)
    check_reserved_template_keys(doc)
    known = check_routes(doc, rt, agent_names)
    check_merges_and_splits(doc, rt, known)
    check_pipelines(doc, rt)
    graph_names = {n for n, r in doc.data["routes"].items() if r["type"] == "graph"}
    check_streams(doc, agent_names, graph_names)
    check_unsafe(doc, rt.unsafe)
    return resolve_default_router(doc, rt, host_default_router)


# §11.2 Agent validation -----------------------------------------------------------------
# check_agent (§4.1) rejects unregistered types and reserved names; the AGENT_TYPES table (§4.3)
# is the registry. Phase B has already replaced template/agent_template instances.

# §11.3 Route validation -----------------------------------------------------------------
ROUTE_TYPES = ("stream", "graph", "bridge")
# Fields each route type defines (§5.3, §6.1, §5.6): anything else is warned about, never dropped
# silently.
ROUTE_FIELDS = {
    "stream": ("type", "stream_type", "operators", "subscriptions", "publications", "agents",
               "initial_value", "buffer_size", "bridge", "metadata", "template_config"),
    "graph": ("type", "nodes", "edges", "entry_point", "checkpointing", "checkpoint_dir",
              "enable_time_travel", "parallel_execution", "state_class", "bridge", "metadata",
              "template_config"),
    "bridge": ("type", "upgrade_conditions", "downgrade_conditions", "state_extractor",
               "state_flattener", "preserve_subscriptions", "preserve_checkpointing", "metadata"),
}
AGENT_FIELDS = ("type", "config", "template", "agent_template", "params")   # §4.1
MERGE_FIELDS = ("sources", "target")                                        # §7.1
SPLIT_FIELDS = ("source", "targets")                                        # §7.2


def warn_unknown_fields(rt, mapping, known, path, section):
    for key in mapping:
        if key not in known:
            rt.warn(f"unknown field '{key}' is ignored", section=section, path=path + (key,))


def stream_names(doc):
    """Names a subscription, publication, merge or split may use.

    INTERPRETATION §5.5 vs §11.4 (Q26): every merge and split target counts as known, since merges and
    splits create their missing targets.
    """
    names = set(doc.data["routes"]) | set(RESERVED_STREAM_NAMES)
    for merge in doc.data.get("merges") or []:
        if isinstance(merge, dict) and isinstance(merge.get("target"), str):
            names.add(merge["target"])
    for split in doc.data.get("splits") or []:
        if isinstance(split, dict) and isinstance(split.get("targets"), dict):
            names.update(split["targets"])
    return names


def check_routes(doc, rt, agent_names):
    """§5.1, §11.3, §15.4: every route typed, its references known. Normalises `type` to lower case."""
    routes = doc.data["routes"]
    known = stream_names(doc)
    for name, route in routes.items():
        path = ("routes", name)
        if str(name).startswith("__"):
            raise doc.error(ConfigurationError, path,
                            f"route name '{name}' is reserved (names starting with __)", "15.4, §5.1")
        if not isinstance(route, dict):
            raise doc.error(ConfigurationError, path, "a route must be a mapping", "5.1")
        if "type" not in route:
            raise doc.error(ConfigurationError, path, "route has no type", "11.3, §5.1")
        kind = str(route["type"]).lower()
        if kind not in ROUTE_TYPES:
            raise doc.error(ConfigurationError, path + ("type",), f"route type '{route['type']}' "
                            "is not one of stream, graph, bridge", "11.3")
        route["type"] = kind
        warn_unknown_fields(rt, route, ROUTE_FIELDS[kind], path, {"stream": "5.3", "graph": "6.1",
                                                                   "bridge": "5.6"}[kind])
        if kind == "stream":
            for field in ("subscriptions", "publications", "agents"):
                value = route.get(field)
                if value is not None and not isinstance(value, list):
                    raise doc.error(ConfigurationError, path + (field,), "must be a sequence",
                                    "5.3")
            for field in ("subscriptions", "publications"):
                for i, target in enumerate(route.get(field) or []):
                    if target not in known:
                        raise doc.error(ConfigurationError, path + (field, i),
                                        f"'{target}' is not a known route or built-in stream",
                                        "11.3, §5.5")
            for i, agent in enumerate(route.get("agents") or []):
                if agent not in agent_names:
                    raise doc.error(ConfigurationError, path + ("agents", i),
                                    f"agent '{agent}' is not defined in agents", "11.3")
        elif kind == "graph":
            check_graph(doc, name, route, path, agent_names)
    return known


# §11.4 Merge/split validation -----------------------------------------------------------
def check_merges_and_splits(doc, rt, known):
    """§11.4, §7.1, §7.2."""
    for section in ("merges", "splits"):
        value = doc.data.get(section)
        if value is not None and not isinstance(value, list):
            raise doc.error(ConfigurationError, (section,), f"{section} must be a sequence",
                            "7.1" if section == "merges" else "7.2")
    for i, merge in enumerate(doc.data.get("merges") or []):
        path = ("merges", i)
        if not isinstance(merge, dict):
            raise doc.error(ConfigurationError, path, "a merge must be a mapping", "7.1")
        warn_unknown_fields(rt, merge, MERGE_FIELDS, path, "7.1")
        if merge.get("target") is None:
            raise doc.error(ConfigurationError, path, "merge has no target", "11.4, §7.1")
        sources = merge.get("sources") or []
        if not isinstance(sources, list):
            raise doc.error(ConfigurationError, path + ("sources",), "sources must be a sequence",
                            "7.1")
        for j, source in enumerate(sources):
            if source not in known:
                raise doc.error(ConfigurationError, path + ("sources", j),
                                f"merge source '{source}' is not a known route or stream", "11.4")
    for i, split in enumerate(doc.data.get("splits") or []):
        path = ("splits", i)
        if not isinstance(split, dict):
            raise doc.error(ConfigurationError, path, "a split must be a mapping", "7.2")
        warn_unknown_fields(rt, split, SPLIT_FIELDS, path, "7.2")
        if split.get("source") is None:
            raise doc.error(ConfigurationError, path, "split has no source", "11.4, §7.2")
        if split["source"] not in known:
            raise doc.error(ConfigurationError, path + ("source",),
                            f"split source '{split['source']}' is not a known route or stream",
                            "11.4")
        targets = split.get("targets")
        if targets is not None and not isinstance(targets, dict):
            raise doc.error(ConfigurationError, path + ("targets",),
                            "targets must be a mapping of target name to condition", "7.2")


# §11.5 Pipeline validation --------------------------------------------------------------
def check_pipelines(doc, rt):
    """§11.5: warnings only -- a graph stage naming no graph, a stream stage named like a route."""
    pipelines = doc.data.get("pipelines")
    if pipelines is None:
        return
    if not isinstance(pipelines, dict):
        raise doc.error(ConfigurationError, ("pipelines",), "pipelines must be a mapping", "7.3")
    routes = doc.data["routes"]
    for pname, pipeline in pipelines.items():
        stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
        if not isinstance(stages, list):
            raise doc.error(ConfigurationError, ("pipelines", pname),
                            "a pipeline needs a stages sequence", "7.3")
        for i, stage in enumerate(stages):
            path = ("pipelines", pname, "stages", i)
            if not isinstance(stage, dict) or str(stage.get("type", "")).lower() not in (
                    "stream", "graph"):
                raise doc.error(ConfigurationError, path,
                                "a stage is a mapping with type stream or graph", "7.3")
            kind, name = str(stage["type"]).lower(), stage.get("name")
            if kind == "graph" and "config" not in stage:
                ref = stage.get("graph", name)
                if (routes.get(ref) or {}).get("type") != "graph":
                    rt.warn(f"graph stage refers to '{ref}', which is not a graph route",
                            section="11.5", path=path)
            if kind == "stream" and name in routes:
                rt.warn(f"stream stage '{name}' has the name of an existing route",
                        section="11.5", path=path)


# §11.6 Environment variable validation ------------------------------------------------
# A required ${VAR} that is unset fails in interpolate_env (§14.2) with a ConfigurationError.


# =====================================================================================
# §12 RUNTIME BEHAVIOR
# =====================================================================================

# §12.1 Lifecycle --------------------------------------------------------------------------
def read_sources(paths, text):
    """The raw documents, in order: files first, then `text` (as '<text>')."""
    sources = []
    for p in paths:
        try:
            sources.append((str(p), Path(p).read_bytes()))
        except OSError as exc:
            raise ConfigurationError(f"cannot read configuration file: {exc.strerror}",
                                     section="3.1", file=str(p)) from None
    if text is not None:
        sources.append(("<text>", text))
    if not sources:
        raise ConfigurationError("no configuration given (a path or text=...)", section="3.1")
    return sources


def parse_source(raw, file, render_context, engine):
    """§3.1 and §8.2: one document's text -> (data, marks), through Phase A when it is templated."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"document is not UTF-8: {exc}", section="3.1",
                                     file=file) from None
    check_sentinels(raw, file)
    if not has_template_syntax(raw):
        return parse_yaml(raw, file)
    try:
        rendered = render_document(protect_runtime_fields(raw), render_context, engine)
    except ActorError as exc:
        exc.file = exc.file or file
        raise
    data, marks = parse_yaml(rendered, file)
    return restore_sentinels(data), marks


def load_document(sources, render_context, engine, env, rt):
    """§12.1 step 1: parse all files, deep-merge in order (§3.1), interpolate (§14)."""
    data, marks, files = None, {}, []
    for file, raw in sources:
        part, part_marks = parse_source(raw, file, render_context, engine)
        files.append(file)
        if not isinstance(part, dict):
            kind = "empty" if part is None else type(part).__name__
            raise ConfigurationError(f"top-level value must be a mapping, not {kind}",
                                     section="3.1, §11.1", file=file,
                                     line=part_marks.get((), (None, None, None))[1])
        if data is None:
            data, marks = part, dict(part_marks)
        else:
            before = copy.deepcopy(data)
            deep_merge(data, part)
            merge_marks(marks, part_marks, before, part)
    doc = Doc(data, marks, files)
    rt.doc = doc
    doc.data = interpolate_env(doc.data, env, doc)
    return doc


def resolve_engine(doc, host_engine):
    """§9.2: host parameter, else cleveragents.template_engine, else JINJA2 (case-insensitive)."""
    params = doc.data.get("cleveragents") if isinstance(doc.data.get("cleveragents"), dict) else {}
    value = host_engine if host_engine is not None else params.get("template_engine", "JINJA2")
    engine = str(value).upper()
    if engine not in ("JINJA2", "MUSTACHE", "SIMPLE"):
        path = () if host_engine is not None else ("cleveragents", "template_engine")
        raise doc.error(ConfigurationError, path, f"unknown template_engine '{value}' "
                        f"(JINJA2, MUSTACHE or SIMPLE)", "9.2")
    return engine


def start_actor(sources, *, render_context=None, unsafe=False, env=None, template_engine=None,
                default_router=None, provider=None, workdir=None, clock=None, llm_transport=None,
                context=None):
    """§12.1 steps 1-6 in order; returns a running Actor (step 7)."""
    rt = Runtime(Doc(None), unsafe=unsafe, env=env, workdir=workdir, clock=clock,
                 provider=provider, llm_transport=llm_transport)
    phase_a_engine = str(template_engine or "JINJA2").upper()
    doc = load_document(sources, render_context, phase_a_engine, rt.env, rt)
    check_top_level(doc, rt)
    rt.engine = resolve_engine(doc, template_engine)
    # Step 2: register templates (Phase B instantiates every template instance, §8.6-§8.10).
    expand_templates(doc, rt)
    router = validate_document(doc, rt, default_router)
    # Steps 3-6: agents, routes, merges/splits, pipelines.
    rt.context = build_global_context(doc, context, rt.unsafe)
    rt.prompts = collect_prompts(doc)
    rt.default_router = router
    for name, cfg in doc.data["agents"].items():
        rt.agents[name] = make_agent(rt, name, cfg, ("agents", name))
    for name, route in doc.data["routes"].items():
        if route["type"] == "graph":
            rt.graphs[name] = GraphRoute(name, route, rt, ("routes", name))
    network = StreamNetwork(rt)
    return Actor(rt, network, router)

# §12.2 Message flow -----------------------------------------------------------------------
# [streams] §12.2.2 ordering, §12.2.3 error handling, §12.2.4 timeouts

# §12.4 Tool command processing in outputs --------------------------------------------------
# INTERPRETATION §12.4 (Q81): opt-in. Only an llm agent with `tool_execute: true` processes blocks,
# and only for the built-in tools it lists in `tools`; the tools run under the §13 rules of the
# invocation (run_builtin_tool checks host mode and `_unsafe_mode`). `shell` is never offered
# here, since §13.5 ties it to a tool agent's `allow_shell`.
TOOL_EXECUTE_PATTERN = re.compile(
    r"\[TOOL_EXECUTE:([^\]\s]+)\]\s*(\{.*?)\s*\[/TOOL_EXECUTE\]", re.DOTALL)
TOOL_EXECUTE_ERROR = "Error executing tool '{name}': {reason}"
TOOL_EXECUTE_EXCLUDED = frozenset({"shell"})

# Characters escaped inside JSON string values by the §12.4 item 2 sanitiser.
_TOOL_PAYLOAD_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
                         "\f": "\\f"}


def check_tool_execute(rt, tools, enabled, cpath):
    """Load-time check of the §12.4 opt-in: `tools` lists built-in tool names; returns the list."""
    if tools is None:
        if enabled:
            raise rt.error(ConfigurationError, cpath + ("tool_execute",),
                           "tool_execute needs a 'tools' list of built-in tool names", "12.4")
        return []
    if not enabled:
        rt.warn("'tools' has no effect without tool_execute: true", section="12.4",
                path=cpath + ("tools",))
    for i, name in enumerate(tools):
        if not isinstance(name, str) or name not in BUILTIN_TOOLS or name in TOOL_EXECUTE_EXCLUDED:
            raise rt.error(ConfigurationError, cpath + ("tools", i),
                           f"{name!r} is not a built-in tool that tool_execute may call", "12.4")
    return list(tools)


def sanitize_tool_payload(text):
    """§12.4 item 2: inside JSON string values, double every backslash and escape raw control
    characters and inner double quotes, so that model-written payloads parse.

    A quote ends a string only when the next non-blank character is `,` `}` `]` `:` or the end.
    """
    # INTERPRETATION §12.4 item 2: "literal backslashes" are all backslashes inside string values,
    # so `\section` and `\n` (two characters) reach the tool as written, never as escapes.
    out = []
    in_string = False
    for i, ch in enumerate(text):
        if not in_string:
            out.append(ch)
            in_string = ch == '"'
        elif ch == '"':
            rest = text[i + 1:].lstrip()
            if not rest or rest[0] in ",}]:":
                out.append(ch)
                in_string = False
            else:
                out.append('\\"')
        elif ch in _TOOL_PAYLOAD_ESCAPES:
            out.append(_TOOL_PAYLOAD_ESCAPES[ch])
        elif ch < " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def process_tool_blocks(rt, text, allowed, ctx):
    """§12.4: run each `[TOOL_EXECUTE:name] {json} [/TOOL_EXECUTE]` block of an llm output and put
    its result (or a readable error) in its place, last block first."""
    if not isinstance(text, str):
        return text
    for match in reversed(list(TOOL_EXECUTE_PATTERN.finditer(text))):
        name, payload = match.group(1), match.group(2)
        result = _tool_block_result(rt, name, payload, allowed, ctx)
        text = text[:match.start()] + result + text[match.end():]
    return text


def _tool_block_result(rt, name, payload, allowed, ctx):
    if name not in allowed:
        return TOOL_EXECUTE_ERROR.format(name=name, reason="the tool is not allowed for this agent")
    try:
        args = json.loads(sanitize_tool_payload(payload))
    except json.JSONDecodeError as exc:
        return TOOL_EXECUTE_ERROR.format(name=name, reason=f"invalid JSON payload ({exc.msg})")
    if not isinstance(args, dict):
        return TOOL_EXECUTE_ERROR.format(name=name, reason="the payload is not a JSON object")
    try:
        result = run_builtin_tool(rt, name, args, ctx)
    except ActorError as exc:
        return TOOL_EXECUTE_ERROR.format(name=name, reason=exc.message)
    return result if isinstance(result, str) else _llm_text(result)


# §12.5 Routing prefix conventions -------------------------------------------------------
# [streams]

# §12.6 Loop detection in stream routes ----------------------------------------------------
# [streams]


# =====================================================================================
# §13 SECURITY MODEL
# =====================================================================================

# §13.1 Safe and unsafe modes -----------------------------------------------------------
# The host sets the mode (Runtime.unsafe, from load(unsafe=...) or --unsafe); an Actor may only
# declare that it needs unsafe mode (check_unsafe, §9.4). In unsafe mode the invocation context also
# carries _unsafe_mode: true (build_global_context, §10.3) unless the host context says otherwise.

# §13.2 Sandboxed code execution ---------------------------------------------------------
# [sandbox] compile_code / run_code / compile_expression

# §13.2.1 Restricted built-ins for inline code -------------------------------------------
# [sandbox]

# §13.2.2 Restricted built-ins for expression evaluation ---------------------------------
# [sandbox]

# §13.2.3 Prohibited capabilities ---------------------------------------------------------
# [sandbox]

# §13.3 Filesystem boundaries -----------------------------------------------------------
def host_refusal(env, given, op):
    """§13.3: why the host's mode refuses `given` for `op`, or None (the agent layer is §4.5.4)."""
    absolute, traversal, tilde = path_facts(given)
    # INTERPRETATION §13.3: `~` is refused by both file tools in every mode; home expansion would
    # read the process environment, which the Actor never sees (rt.env is its only environment).
    if tilde:
        return f"{op} rejects paths beginning with ~ (no home-directory expansion)"
    if env.unsafe_host:
        if op == "file_write" and traversal:
            return "file_write rejects `..` traversal even in unsafe mode"
        return None
    if op == "file_write":
        return "file_write is disabled unless the host is in unsafe mode"
    if traversal:
        return "file_read rejects `..` in safe mode"
    if absolute:
        return "file_read rejects absolute paths in safe mode"
    return None


def tool_path(env, given, op):
    """Check `given` against both layers and resolve it against rt.workdir (never the process cwd).

    INTERPRETATION §4.5.4 vs §13.3 (Q69): both layers apply; a path passes only when the agent's
    `safe_mode` rules and the host's mode both allow it.
    """
    if not isinstance(given, str) or not given.strip():
        raise env.fail(f"{op} needs a `file` path string", "4.5.1")
    reason = safe_mode_refusal(env, given, op)
    section = "4.5.4"
    if reason is None:
        reason, section = host_refusal(env, given, op), "13.3"
    if reason is not None:
        raise env.fail(f"{reason}: {given}", section)
    base = Path(env.rt.workdir).resolve()
    target = Path(given) if path_facts(given)[0] else base / given
    resolved = target.resolve()
    # INTERPRETATION §4.5.4, §13.3: in safe mode file_read must also stay inside the working
    # directory once symlinks are followed (else a link would undo the `..`/absolute rules).
    # file_write's own outside-the-directory rule is waived by `_unsafe_mode: true`, which
    # file_write always requires, so it never refuses there.
    if op == "file_read" and not env.unsafe_host and not resolved.is_relative_to(base):
        raise env.fail(f"file_read rejects paths resolving outside the working directory: "
                       f"{given}", "13.3")
    return resolved

# §13.5 Shell execution --------------------------------------------------------------------
def tool_shell(env, args):
    """§13.5 extension tool `shell`: run a command line in rt.workdir; returns its standard output.

    {tool: shell, args: {command: "ls -1"}} | `shell ls -1`   (needs allow_shell and an unsafe host)
    """
    # INTERPRETATION §4.5.1, §13.5 (Q68): a `shell` tool exists as an extension (§1.3 MAY),
    # available when `allow_shell: true` and refused unless the host is unsafe; the blocklist
    # is enforced in every mode and for every `safe_mode`, because §13.5 says "always".
    command = tool_rest(args, "command")
    if not isinstance(command, str) or not command.strip():
        raise env.fail("shell needs a `command` string", "13.5")
    blocked = [word for word in SHELL_BLOCKLIST if word in command.lower()]
    if blocked:
        raise env.fail(f"shell refuses commands containing {', '.join(blocked)}", "4.5.4, 13.5")
    if not env.allow_shell:
        raise env.fail("shell execution needs `allow_shell: true` on the tool agent", "13.5")
    if not env.rt.unsafe:
        raise env.fail("shell execution needs the host in unsafe mode", "13.5")
    try:
        done = subprocess.run(command, shell=True, cwd=str(env.rt.workdir), env=dict(env.rt.env),
                              capture_output=True, text=True, timeout=env.timeout)
    except subprocess.TimeoutExpired:
        raise env.fail(f"shell command timed out after {env.timeout} s", "4.5") from None
    except OSError as exc:
        raise env.fail(f"shell could not start: {exc}", "13.5") from None
    if done.returncode != 0:
        raise env.fail(f"shell command exited with status {done.returncode}: "
                       f"{done.stderr.strip()}", "13.5")
    return done.stdout


# Tools beyond the §4.5.1 table (§1.3 MAY): name -> handler.
EXTENSION_TOOLS = {
    "shell": tool_shell,
}


# =====================================================================================
# §14 ENVIRONMENT VARIABLE INTERPOLATION
# =====================================================================================

# §14.1 Syntax -------------------------------------------------------------------------------
# INTERPRETATION §14.1 (Q89): a `${...}` whose name breaks [A-Za-z0-9_]+ is left as literal text;
# mapping keys are not interpolated; `${X:-3}` defaults to "-3"; `$${` writes a literal `${`.
_ENV_REF = re.compile(r"\$\$\{|\$\{([A-Za-z0-9_]+)(?::([^}]*))?\}")


def interpolate_env(data, env, doc, path=()):
    """§14.2, §14.4: substitute ${NAME} / ${NAME:default} in every string, exactly once each."""
    if isinstance(data, dict):
        return {k: interpolate_env(v, env, doc, path + (k,)) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate_env(v, env, doc, path + (i,)) for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data
    refs = []

    def substitute(match):
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        refs.append(name)
        if name in env:
            return str(env[name])
        if default is not None:
            return default
        raise doc.error(ConfigurationError, path,
                        f"required environment variable '{name}' is not set", "14.2, §11.6")

    result = _ENV_REF.sub(substitute, data)
    whole = _ENV_REF.fullmatch(data)
    if whole and whole.group(0) != "$${":
        return coerce_env_value(result)
    return result


# §14.3 Type coercion ----------------------------------------------------------------------
# INTERPRETATION §14.3 (Q90): only a string that was one single reference is coerced.
_ENV_INT = re.compile(r"-?\d+")
_ENV_FLOAT = re.compile(r"-?\d+\.\d+")


def coerce_env_value(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _ENV_INT.fullmatch(text):
        return int(text)
    if _ENV_FLOAT.fullmatch(text):
        return float(text)
    return text


# =====================================================================================
# §15 RESERVED NAMES
# =====================================================================================

# §15.1 Stream names ---------------------------------------------------------------------
RESERVED_STREAM_NAMES = ("__input__", "__output__", "__error__")

# §15.2 Node names -------------------------------------------------------------------------
# start/START and end/END are normalised and checked by the graph layer (§6.4).

# §15.4 Agent and route names ------------------------------------------------------------
# `__` prefixes are rejected by check_context (§10.1), check_agent (§4.1) and check_routes (§11.3).
# INTERPRETATION §15 (Q83): every "MUST NOT be used" of §15 is a ConfigurationError at load.

# §15.5 Sentinel strings -------------------------------------------------------------------
TEMPLATE_START = "<<<TEMPLATE_START>>>"
TEMPLATE_END = "<<<TEMPLATE_END>>>"
BLOCK_START = "<<<BLOCK_START>>>"
BLOCK_END = "<<<BLOCK_END>>>"
SENTINELS = {"{{": TEMPLATE_START, "}}": TEMPLATE_END, "{%": BLOCK_START, "%}": BLOCK_END}


def check_sentinels(text, file):
    """§15.5: the sentinels must not appear in a source document (restoring would rewrite them)."""
    for sentinel in SENTINELS.values():
        index = text.find(sentinel)
        if index >= 0:
            line = text.count("\n", 0, index) + 1
            col = index - (text.rfind("\n", 0, index) + 1) + 1
            raise ConfigurationError(f"the reserved sentinel {sentinel} appears in the document",
                                     section="15.5", file=file, line=line, col=col)

# §15.6 Internal stream name patterns -----------------------------------------------------
# Names starting with __ are never known streams (§11.3), so references to them fail at load.


# =====================================================================================
# §16 FORBIDDEN PATTERNS
# =====================================================================================
# Where each §16 rule is enforced (one row per rule, in the spec's order).
FORBIDDEN_TOP_LEVEL = {
    "streams": "use routes with type: stream",
    "graphs": "use routes with type: graph",
}
FORBIDDEN_FORMS = {
    # §16.1
    "top-level streams:": "check_top_level (§3.2)",
    "top-level graphs:": "check_top_level (§3.2)",
    "composite with strategy:": "check_composite (§4.6)",
    # §16.2
    "dynamic_router node": "check_graph (§6)",
    "list-form routes": "check_top_level (§3.2)",
    "top-level pipelines:": "accepted: see README Interpretations (Q1)",
    "inline expression in map function": "check_streams (§5.3.3)",
    "agent_template instances": "expand_templates (§8.7)",
    "sequence-form template parameters": "expand_templates (§8.6.1)",
    "short-form prompts": "collect_prompts (§10.4)",
    "composite routing shorthand": "check_composite (§4.6)",
    "templates with structural expressions": "expand_templates (§8.9)",
    # §16.3
    "prompt and prompt_reference": "check_chain (§4.7)",
    "template and type": "expand_templates (§8.7)",
    "agent_template and template": "expand_templates (§8.7)",
    "inline tool named like a built-in": "ToolAgent (§4.5.2)",
    "template_config with route fields": "expand_templates (§8.7)",
}


# =====================================================================================
# HOST -- providers
# =====================================================================================
# [llm] PROVIDERS: openai, anthropic, google over urllib; the offline `fake` provider.
# Wire formats: shared/providers.md. Each request is the neutral dict LLMAgent builds:
# {agent, provider, model, temperature, max_tokens, system, messages, response_format}.
import email.utils  # noqa: E402  (host-only imports, kept beside their one user)
import urllib.error  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402

LLM_REQUEST_TIMEOUT = 120.0     # seconds for each connect / read of one HTTP request
LLM_MAX_RETRIES = 2             # retries after the first try (the vendors' SDK default)
LLM_RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
LLM_RETRY_AFTER_CAP = 60.0      # a longer Retry-After falls back to exponential back-off
LLM_NO_RETRY_CODES = frozenset({"insufficient_quota", "enforced_spend_limit_reached"})
ANTHROPIC_VERSION = "2023-06-01"


def scrub_key(text, key):
    """Replace every occurrence of the API key in `text` with ***."""
    return text.replace(key, "***") if key and isinstance(text, str) else text


def _retry_delay(headers, data, attempt):
    """Seconds to wait before retry number `attempt` (0-based): the server's word when it gives
    one of at most LLM_RETRY_AFTER_CAP, else min(0.5 * 2**attempt, 8)."""
    wait = None
    if headers.get("retry-after-ms"):
        try:
            wait = float(headers["retry-after-ms"]) / 1000.0
        except ValueError:
            wait = None
    if wait is None and headers.get("retry-after"):
        value = headers["retry-after"].strip()
        try:
            wait = float(value)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
                wait = when.timestamp() - time.time()
            except (TypeError, ValueError):
                wait = None
    if wait is None and isinstance(data, dict):     # Gemini: google.rpc.RetryInfo in details
        for detail in (data.get("error") or {}).get("details") or []:
            delay = detail.get("retryDelay") if isinstance(detail, dict) else None
            if isinstance(delay, str) and delay.endswith("s"):
                try:
                    wait = float(delay[:-1])
                except ValueError:
                    pass
    if wait is not None and 0 <= wait <= LLM_RETRY_AFTER_CAP:
        return wait
    return min(0.5 * 2 ** attempt, 8.0)


def _http_post(url, headers, body, timeout):
    """One POST; returns (status, lower-cased headers, raw body). Network failures raise OSError."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read() if exc.fp is not None else b""
        exc.close()
        return exc.code, {k.lower(): v for k, v in (exc.headers or {}).items()}, raw


class ProviderAdapter:
    """The HTTP exchange shared by the vendors; each subclass gives the wire shapes:

    endpoint(base, model) -> url; headers(key) -> dict; body(request) -> dict; reply(data) -> text
    (ValueError when the body has none); vendor_error(data or None) -> (code, message, may_retry).
    """

    name = ""
    default_base = ""
    base_envs = ()
    structured = frozenset()        # response_format types this vendor can honour (§4.4.3)

    def fallback(self, body, code, message, used):
        """A fixed-up body to send once after a 400 the vendor explains, or None."""
        return None

    def complete(self, request, *, key, base_url, sleep=time.sleep, timeout=None):
        """Send `request`; retry 408/409/429/5xx/529, timeouts and connection errors at most
        LLM_MAX_RETRIES times; return the reply text or raise ExecutionError (key scrubbed)."""
        timeout = LLM_REQUEST_TIMEOUT if timeout is None else timeout
        url = self.endpoint(base_url.rstrip("/"), request["model"])
        body = self.body(request)
        headers = self.headers(key)
        used_fallbacks = set()
        attempt = 0
        while True:
            retry, data, resp_headers = True, None, {}
            try:
                status, resp_headers, raw = _http_post(url, headers,
                                                       json.dumps(body).encode("utf-8"), timeout)
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                    failure = f"request timed out after {timeout:g} s"
                else:
                    failure = f"connection error: {reason}"
            else:
                if 200 <= status < 300:
                    return self._parse_reply(raw, key)
                try:
                    data = json.loads(raw.decode("utf-8", "replace"))
                except ValueError:
                    data = None
                code, message, retry_allowed = self.vendor_error(data)
                if data is None:
                    message = raw.decode("utf-8", "replace").strip()[:300] or "(empty body)"
                failure = f"HTTP {status}" + (f" {code}" if code else "") + f": {message}"
                if status == 400:
                    fixed = self.fallback(body, code or "", message or "", used_fallbacks)
                    if fixed is not None:
                        body = fixed
                        continue
                should = resp_headers.get("x-should-retry", "").lower()
                retry = retry_allowed and (should == "true" or
                                           (should != "false" and status in LLM_RETRY_STATUSES))
            if not retry or attempt >= LLM_MAX_RETRIES:
                raise ExecutionError(scrub_key(f"{self.name}: {failure}", key), section="4.4")
            sleep(_retry_delay(resp_headers, data, attempt))
            attempt += 1

    def _parse_reply(self, raw, key):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ExecutionError(scrub_key(f"{self.name}: malformed JSON in the reply: "
                                           f"{raw[:200].decode('utf-8', 'replace')!r}", key),
                                 section="4.4") from None
        try:
            text = self.reply(data)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ExecutionError(scrub_key(f"{self.name}: unexpected reply: {exc}", key),
                                 section="4.4") from None
        return text


class OpenAIAdapter(ProviderAdapter):
    """OpenAI Chat Completions, also spoken by Ollama, vLLM, llama.cpp and gateways."""

    name = "openai"
    default_base = "https://api.openai.com/v1"
    base_envs = ("OPENAI_BASE_URL",)
    structured = frozenset({"json_schema", "json_object", "text"})
    # o-series and GPT-5-and-later: max_completion_tokens, and no non-default temperature.
    REASONING_MODEL = re.compile(r"(o\d|gpt-(?:[5-9]|\d{2,}))")

    def endpoint(self, base, model):
        return base + "/chat/completions"

    def headers(self, key):
        return {"Authorization": f"Bearer {key}"}

    def body(self, request):
        messages = [{"role": "system", "content": request["system"]}] if request["system"] else []
        body = {"model": request["model"], "messages": messages + request["messages"]}
        if self.REASONING_MODEL.match(request["model"]):
            body["max_completion_tokens"] = request["max_tokens"]
        else:
            body["max_tokens"] = request["max_tokens"]
            body["temperature"] = request["temperature"]
        if request.get("response_format") is not None:
            body["response_format"] = request["response_format"]   # §4.4.3's block, verbatim
        return body

    def reply(self, data):
        message = data["choices"][0]["message"]
        content = message.get("content")
        if content is None and message.get("refusal"):
            raise ValueError(f"the model refused: {message['refusal']}")
        if not isinstance(content, str):
            raise ValueError("choices[0].message.content is not text")
        return content

    def vendor_error(self, data):
        err = data.get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return "", "", True
        code = err.get("code") or err.get("type") or ""
        return str(code), str(err.get("message", "")), code not in LLM_NO_RETRY_CODES

    def fallback(self, body, code, message, used):
        swap = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}
        for old, new in swap.items():
            if old in body and f"'{old}'" in message and "tokens" not in used:
                used.add("tokens")
                fixed = {k: v for k, v in body.items() if k != old}
                fixed[new] = body[old]
                return fixed
        if "temperature" in body and "temperature" in message and "temperature" not in used:
            used.add("temperature")
            return {k: v for k, v in body.items() if k != "temperature"}
        return None


class AnthropicAdapter(ProviderAdapter):
    """Anthropic Messages, version pinned in ANTHROPIC_VERSION."""

    name = "anthropic"
    default_base = "https://api.anthropic.com"
    base_envs = ("ANTHROPIC_BASE_URL",)
    structured = frozenset({"json_schema"})

    def endpoint(self, base, model):
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def headers(self, key):
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}

    def body(self, request):
        messages = []
        for entry in request["messages"]:       # consecutive same-role turns become one
            if messages and messages[-1]["role"] == entry["role"]:
                messages[-1] = {"role": entry["role"],
                                "content": messages[-1]["content"] + "\n\n" + entry["content"]}
            else:
                messages.append(dict(entry))
        # INTERPRETATION §4.4: Anthropic takes temperatures in [0, 1]; larger values are sent as 1.
        body = {"model": request["model"], "max_tokens": request["max_tokens"],
                "messages": messages, "temperature": min(max(request["temperature"], 0.0), 1.0)}
        if request["system"]:
            body["system"] = request["system"]
        rf = request.get("response_format")
        if rf is not None:          # name / strict have no slot here
            body["output_config"] = {"format": {"type": "json_schema",
                                                "schema": rf["json_schema"]["schema"]}}
        return body

    def reply(self, data):
        if data.get("stop_reason") == "refusal":
            raise ValueError("the model refused (stop_reason: refusal)")
        parts = [block["text"] for block in data["content"]
                 if isinstance(block, dict) and block.get("type") == "text"]
        if not parts:
            raise ValueError("the reply has no text content")
        return "".join(parts)

    def vendor_error(self, data):
        err = data.get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return "", "", True
        detail = (err.get("details") or {}).get("error_code") if isinstance(
            err.get("details"), dict) else None
        code = str(err.get("type") or "")
        if detail:
            code = f"{code}/{detail}" if code else str(detail)
        return code, str(err.get("message", "")), detail not in LLM_NO_RETRY_CODES

    def fallback(self, body, code, message, used):
        if "temperature" in body and "temperature" in message and "temperature" not in used:
            used.add("temperature")     # "`temperature` is deprecated for this model"
            return {k: v for k, v in body.items() if k != "temperature"}
        return None


class GoogleAdapter(ProviderAdapter):
    """Google Gemini generateContent (v1beta)."""

    name = "google"
    default_base = "https://generativelanguage.googleapis.com"
    base_envs = ("GOOGLE_GEMINI_BASE_URL", "GOOGLE_BASE_URL")
    structured = frozenset({"json_schema", "json_object"})
    BLOCKED = frozenset({"SAFETY", "RECITATION", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII"})

    def endpoint(self, base, model):
        if base.endswith("/v1beta"):
            base = base[:-len("/v1beta")]
        model = model[len("models/"):] if model.startswith("models/") else model
        return f"{base}/v1beta/models/{urllib.parse.quote(model, safe='-._')}:generateContent"

    def headers(self, key):
        return {"x-goog-api-key": key}

    def body(self, request):
        contents = [{"role": "model" if entry["role"] == "assistant" else "user",
                     "parts": [{"text": entry["content"]}]} for entry in request["messages"]]
        config = {"temperature": request["temperature"], "maxOutputTokens": request["max_tokens"]}
        rf = request.get("response_format")
        if rf is not None:
            config["responseMimeType"] = "application/json"
            if rf.get("type") == "json_schema":
                config["responseJsonSchema"] = rf["json_schema"]["schema"]
        body = {"contents": contents, "generationConfig": config}
        if request["system"]:
            body["systemInstruction"] = {"parts": [{"text": request["system"]}]}
        return body

    def reply(self, data):
        candidates = data.get("candidates") or []
        if not candidates:
            reason = (data.get("promptFeedback") or {}).get("blockReason", "no candidates")
            raise ValueError(f"the prompt was blocked ({reason})")
        first = candidates[0]
        if first.get("finishReason") in self.BLOCKED:
            raise ValueError(f"the answer was blocked (finishReason: {first['finishReason']})")
        parts = [part["text"] for part in (first.get("content") or {}).get("parts") or []
                 if isinstance(part, dict) and "text" in part and not part.get("thought")]
        if not parts:
            raise ValueError("the reply has no text parts")
        return "".join(parts)

    def vendor_error(self, data):
        err = data.get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return "", "", True
        code = str(err.get("status") or err.get("code") or "")
        retry = True
        for detail in err.get("details") or []:
            if not isinstance(detail, dict):
                continue
            if detail.get("reason"):
                code += "/" + str(detail["reason"])
            for violation in detail.get("violations") or []:     # google.rpc.QuotaFailure
                if "PerDay" in str(violation.get("quotaId", "")):
                    retry = False                                  # the daily quota is spent
        return code, str(err.get("message", "")), retry


class FakeAdapter(ProviderAdapter):
    """The offline `fake` provider: no key, no network; echoes the user message."""

    name = "fake"
    structured = frozenset({"json_schema", "json_object", "text"})

    def complete(self, request, *, key, base_url, sleep=time.sleep, timeout=None):
        return request["messages"][-1]["content"]


class FakeTransport:
    """Scripted replies that replace every provider's HTTP call (vectors, tests, `llm=` in load).

    `responses` maps agent name -> replies, consumed in order; then the user message is echoed.
    A reply given as `{error: text}` makes that call fail with an ExecutionError.
    """

    def __init__(self, responses=None):
        self.responses = {name: list(replies if isinstance(replies, list) else [replies])
                          for name, replies in (responses or {}).items()}
        self._lock = threading.Lock()

    def complete(self, request):
        with self._lock:
            queue = self.responses.get(request["agent"])
            reply = queue.pop(0) if queue else None
        if reply is None:
            return request["messages"][-1]["content"]
        if isinstance(reply, dict) and "error" in reply:
            raise ExecutionError(f"{request['provider']}: {reply['error']}", section="4.4")
        return _llm_text(reply)


# name -> adapter. Rows: the §4.4.1 providers, then this host's extra `fake`.
PROVIDERS = {
    "openai":    OpenAIAdapter(),
    "anthropic": AnthropicAdapter(),
    "google":    GoogleAdapter(),
    "fake":      FakeAdapter(),
}


# =====================================================================================
# HOST -- load / Actor / render
# =====================================================================================

class Result:
    """What one call observed: the messages emitted on __output__ and on __error__, in order."""

    def __init__(self):
        self.outputs = []
        self.errors = []

    def __repr__(self):
        return f"Result(outputs={[m.content for m in self.outputs]!r}, " \
               f"errors={[m.content for m in self.errors]!r})"


class Actor:
    """A running Actor (§12.1 step 7): send messages, move the clock, inspect context and graphs."""

    def __init__(self, rt, network, default_router):
        self.rt = rt
        self.network = network
        self.default_router = default_router
        self._result = None
        self._lock = threading.Lock()
        network.on_output(self._collect_output)
        network.on_error(self._collect_error)

    # -- collecting what a call emits (graph branches may emit from worker threads)
    def _collect_output(self, msg):
        with self._lock:
            if self._result is not None:
                self._result.outputs.append(msg)

    def _collect_error(self, msg):
        with self._lock:
            if self._result is not None:
                self._result.errors.append(msg)

    def _call(self, action):
        with self._lock:
            self._result = result = Result()
        try:
            action()
            if self.rt.clock.real:
                self.network.settle()
        finally:
            with self._lock:
                self._result = None
        return result

    # -- the public API
    @property
    def context(self):
        """The live global context dict (§10)."""
        return self.rt.context

    def send(self, content, *, at=None, target=None):
        """Submit one message (to `target`, else the default router / __input__, §3.4) and run it
        to quiescence."""
        def action():
            if at is not None:
                self.rt.clock.set_time(at)
            self.network.send(content, target=target)
        return self._call(action)

    def advance(self, seconds):
        """Move the clock on by `seconds`, firing due timers (debounce, delay, buffer, sample)."""
        return self._call(lambda: self.rt.clock.advance(seconds))

    def complete(self):
        """Complete __input__: buffers flush and reduce emits (§5.3.2)."""
        return self._call(self.network.complete)

    def close(self):
        """§12.1 step 8: dispose of subscriptions, agents and streams."""
        close = getattr(self.network, "close", None)
        if close is not None:
            close()
        self.rt.agents.clear()
        self.rt.graphs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- graphs (§6.6)
    def _graph(self, route):
        if route not in self.rt.graphs:
            raise RoutingError(f"'{route}' is not a graph route", section="6.6")
        return self.rt.graphs[route]

    def checkpoints(self, route):
        return self._graph(route).checkpoints()

    def restore(self, route, path=None):
        return self._graph(route).restore(path)

    def rewind(self, route, steps):
        return self._graph(route).rewind(steps)

    # -- inspection (§4.11)
    def describe(self):
        """Agents with type, capabilities and metadata; routes with their type (§4.11)."""
        agents = {name: {"type": a.type, "capabilities": list(a.capabilities),
                         "metadata": jsonable(a.metadata)} for name, a in self.rt.agents.items()}
        routes = {name: route["type"] for name, route in self.rt.doc.data["routes"].items()}
        return {"name": self.rt.doc.data.get("name"), "agents": agents, "routes": routes,
                "default_router": self.default_router, "template_engine": self.rt.engine}

    def diagram(self):
        """A Mermaid flowchart of the whole Actor: stream side, then each graph."""
        lines = ["flowchart LR"]
        lines += ["  " + line for line in self.network.mermaid()]
        for graph in self.rt.graphs.values():
            lines += ["  " + line for line in graph.mermaid()]
        return "\n".join(lines) + "\n"


def load(*paths, text=None, render_context=None, unsafe=False, env=None, template_engine=None,
         default_router=None, provider=None, workdir=None, clock=None, llm=None, context=None):
    """Load, validate and start an Actor from files and/or `text` (merged in order, §3.1).

    env: the environment for ${VAR} and API keys (default os.environ). llm: {agent: [replies]} fakes
    the LLM transport. context: host invocation-context keys (§10.3). clock: a VirtualClock by default.
    """
    return start_actor(
        read_sources(paths, text), render_context=render_context, unsafe=unsafe, env=env,
        template_engine=template_engine, default_router=default_router, provider=provider,
        workdir=workdir, clock=clock or VirtualClock(),
        llm_transport=FakeTransport(llm) if llm is not None else None, context=context)


def jsonable(value):
    """A JSON-safe copy of `value` (tuples -> lists, other objects -> str), cycles cut."""
    seen = set()

    def conv(v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
        if isinstance(v, (dict, list, tuple, set)):
            if id(v) in seen:
                return "<cycle>"
            seen.add(id(v))
            try:
                if isinstance(v, dict):
                    return {str(k): conv(x) for k, x in v.items()}
                items = sorted(v, key=repr) if isinstance(v, set) else v
                return [conv(x) for x in items]
            finally:
                seen.discard(id(v))
        return str(v)

    return conv(value)


# =====================================================================================
# HOST -- the vector harness
# =====================================================================================
# The vector format and the --impl protocol are specified in vectors/README.md. observe_vector is
# actor.py's side of the protocol (it only reports); judge_vector compares; run_vectors prints.

VECTOR_KEYS = ("name", "spec", "description", "host", "config", "config_text", "configs",
               "load_error", "steps")
HOST_KEYS = ("unsafe", "env", "render_context", "template_engine", "default_router", "context",
             "files", "llm", "provider")
STEP_ACTIONS = ("send", "advance", "complete")
STEP_CHECKS = ("outputs", "outputs_unordered", "errors", "context", "metadata", "llm_requests",
               "files")
STEP_KEYS = STEP_ACTIONS + STEP_CHECKS + ("at",)
VECTOR_TIMEOUT = 60.0     # seconds per vector under --impl (--timeout raises it)


def vector_sources(vector):
    """The vector's document(s) as (name, text) sources; JSON is valid YAML 1.2."""
    if "config_text" in vector:
        return [("config.yaml", vector["config_text"])]
    if "configs" in vector:
        return [(f"config{i + 1}.yaml", json.dumps(c)) for i, c in enumerate(vector["configs"])]
    return [("config.yaml", json.dumps(vector.get("config")))]


def read_tree(root):
    """{relative posix path: text} for every file below root (what a vector's `files` checks)."""
    files = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and path.stat().st_size <= 1_000_000:
            try:
                files[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                files[path.relative_to(root).as_posix()] = None
    return files


def observe_vector(vector):
    """Run one vector and report what happened: {load_error, steps: [{outputs, metadata, errors,
    context, llm_requests, files}]}. Reports only; judging is judge_vector's job."""
    import tempfile
    host = vector.get("host") or {}
    with tempfile.TemporaryDirectory(prefix="actor-vector-") as tmp:
        for rel, content in (host.get("files") or {}).items():
            target = Path(tmp, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        llm = (host.get("llm") or {}).get("responses") or {}
        try:
            actor = start_actor(
                vector_sources(vector), render_context=host.get("render_context"),
                unsafe=bool(host.get("unsafe", False)), env=host.get("env") or {},
                template_engine=host.get("template_engine"),
                default_router=host.get("default_router"), provider=host.get("provider"),
                workdir=tmp, clock=VirtualClock(), llm_transport=FakeTransport(llm),
                context=host.get("context"))
        except ActorError as exc:
            return {"load_error": {"category": exc.category, "message": str(exc)}, "steps": []}
        observed = []
        try:
            for step in vector.get("steps") or []:
                logged = len(actor.rt.llm_log)
                if "send" in step:
                    result = actor.send(step["send"], at=step.get("at"))
                elif "advance" in step:
                    if step.get("at") is not None:
                        actor.rt.clock.set_time(step["at"])
                    result = actor.advance(step["advance"])
                else:
                    result = actor.complete()
                observed.append({
                    "outputs": [jsonable(m.content) for m in result.outputs],
                    "metadata": [jsonable(m.metadata) for m in result.outputs],
                    "errors": [{"content": jsonable(m.content),
                                "error_type": m.metadata.get("error_type"),
                                "metadata": jsonable(m.metadata)} for m in result.errors],
                    "context": jsonable(actor.context),
                    "llm_requests": jsonable(actor.rt.llm_log[logged:]),
                    "files": read_tree(tmp),
                })
        finally:
            actor.close()
        return {"load_error": None, "steps": observed, "warnings": list(actor.rt.warnings)}


def same(expect, got):
    """Exact equality for vectors: 1 == 1.0, but a string is never a number and a bool never an int."""
    if isinstance(expect, bool) or isinstance(got, bool):
        return type(expect) is type(got) and expect == got
    if isinstance(expect, (int, float)) and isinstance(got, (int, float)):
        return expect == got
    if isinstance(expect, dict) and isinstance(got, dict):
        return expect.keys() == got.keys() and all(same(expect[k], got[k]) for k in expect)
    if isinstance(expect, list) and isinstance(got, list):
        return len(expect) == len(got) and all(same(e, g) for e, g in zip(expect, got))
    return type(expect) is type(got) and expect == got


def subset(expect, got):
    """Deep subset: mappings may carry extra keys; lists match element by element, same length."""
    if isinstance(expect, dict):
        return isinstance(got, dict) and all(k in got and subset(v, got[k])
                                              for k, v in expect.items())
    if isinstance(expect, list):
        return isinstance(got, list) and len(expect) == len(got) and all(
            subset(e, g) for e, g in zip(expect, got))
    return same(expect, got)


def _error_matches(expect, got):
    if not isinstance(expect, dict):
        return same(expect, got.get("content"))
    content = got.get("content")
    if "contains" in expect and (not isinstance(content, str) or expect["contains"] not in content):
        return False
    if "content" in expect and not same(expect["content"], content):
        return False
    if "error_type" in expect and not same(expect["error_type"], got.get("error_type")):
        return False
    return "metadata" not in expect or subset(expect["metadata"], got.get("metadata"))


def judge_step(step, seen):
    """[(field, expect, got)] for every check of `step` that `seen` fails."""
    failures = []
    if "outputs" in step and not same(step["outputs"], seen["outputs"]):
        failures.append(("outputs", step["outputs"], seen["outputs"]))
    if "outputs_unordered" in step:
        rest, ok = list(seen["outputs"]), True
        for item in step["outputs_unordered"]:
            match = next((i for i, g in enumerate(rest) if same(item, g)), None)
            if match is None:
                ok = False
                break
            rest.pop(match)
        if not ok or rest:
            failures.append(("outputs_unordered", step["outputs_unordered"], seen["outputs"]))
    if "errors" in step:
        errs = step["errors"]
        if len(errs) != len(seen["errors"]) or not all(
                _error_matches(e, g) for e, g in zip(errs, seen["errors"])):
            failures.append(("errors", errs, [{"content": g["content"], "error_type":
                                               g["error_type"]} for g in seen["errors"]]))
    for field in ("context", "metadata", "llm_requests"):
        if field in step and not subset(step[field], seen[field]):
            failures.append((field, step[field], seen[field]))
    if "files" in step:
        for rel, content in step["files"].items():
            got = seen["files"].get(rel)
            if not same(content, got):
                failures.append((f"files[{rel}]", content, got))
    return failures


def judge_vector(vector, observed):
    """A list of failure records (step index or None, action, field, expect, got); empty = pass."""
    failures = []
    load_error = observed.get("load_error")
    if "load_error" in vector:
        got = load_error["category"] if load_error else None
        if got != vector["load_error"]:
            failures.append((None, "load", "load_error", vector["load_error"],
                             load_error["message"] if load_error else "loaded without error"))
        return failures
    if load_error:
        return [(None, "load", "load_error", None, load_error["message"])]
    steps, seen = vector.get("steps") or [], observed.get("steps") or []
    if len(seen) != len(steps):
        return [(None, "steps", "steps", f"{len(steps)} steps", f"{len(seen)} observed")]
    for i, (step, got) in enumerate(zip(steps, seen)):
        action = next((a for a in STEP_ACTIONS if a in step), "?")
        for field, expect, value in judge_step(step, got):
            failures.append((i + 1, action, field, expect, value))
    return failures


def lint_vector(vector, stem=None):
    """Problems that make a vector unusable (errors) or suspicious (unknown keys: warnings)."""
    errors, warnings_ = [], []
    if not isinstance(vector, dict):
        return ["vector is not a mapping"], []
    for key in ("name", "spec", "description"):
        if key not in vector:
            errors.append(f"missing '{key}'")
    if sum(k in vector for k in ("config", "config_text", "configs")) != 1:
        errors.append("needs exactly one of config, config_text, configs")
    if "load_error" in vector:
        if vector["load_error"] not in ERROR_CATEGORIES:
            errors.append(f"load_error '{vector['load_error']}' is not a §20 category")
        if vector.get("steps"):
            errors.append("a load_error vector has no steps")
    elif not vector.get("steps"):
        errors.append("no steps and no load_error")
    for key in vector:
        if key not in VECTOR_KEYS:
            warnings_.append(f"unknown key '{key}'")
    for key in vector.get("host") or {}:
        if key not in HOST_KEYS:
            warnings_.append(f"unknown host key '{key}'")
    for i, step in enumerate(vector.get("steps") or []):
        if not isinstance(step, dict):
            errors.append(f"steps[{i}] is not a mapping")
            continue
        if sum(a in step for a in STEP_ACTIONS) != 1:
            errors.append(f"steps[{i}] has not exactly one of send/advance/complete")
        for key in step:
            if key not in STEP_KEYS:
                warnings_.append(f"steps[{i}]: unknown key '{key}'")
    if stem is not None and vector.get("name") != stem:
        warnings_.append(f"name '{vector.get('name')}' differs from the file name '{stem}'")
    return errors, warnings_


def collect_vector_files(paths):
    files = []
    for p in paths:
        p = Path(p)
        files.extend(sorted(p.rglob("*.yaml")) if p.is_dir() else [p])
    return [f for f in files if f.name != "README.md"]


def read_vector(path):
    data, _ = parse_yaml(Path(path).read_bytes(), str(path))
    return data


def observe_with(impl, vector, timeout):
    """Run another implementation on one vector (the --impl protocol) and parse its JSON report."""
    import subprocess
    proc = subprocess.run(impl, shell=True, input=json.dumps(vector), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0 and not proc.stdout.strip():
        raise RuntimeError(f"implementation exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def _show(value):
    text = repr(value)
    return text if len(text) <= 400 else text[:400] + "..."


def run_vectors(paths, impl=None, timeout=VECTOR_TIMEOUT, out=None):
    """Run vector files/folders; print PASS/FAIL/ERROR lines and `N passed, N failed`."""
    out = out or sys.stdout
    passed = failed = 0
    for path in collect_vector_files(paths):
        try:
            vector = read_vector(path)
            errors, warnings_ = lint_vector(vector, path.stem)
            for w in warnings_:
                print(f"warning: {path}: {w}", file=sys.stderr)
            if errors:
                raise ValueError("; ".join(errors))
            observed = observe_with(impl, vector, timeout) if impl else observe_vector(vector)
            failures = judge_vector(vector, observed)
        except Exception as exc:  # boundary: one vector's crash is reported, the run goes on
            failed += 1
            kind = "timeout" if type(exc).__name__ == "TimeoutExpired" else "vector"
            hint = f" (raise the limit with --timeout, now {timeout} s)" if kind == "timeout" else ""
            print(f"ERROR {path}  {kind}: {type(exc).__name__}: {exc}{hint}", file=out)
            continue
        if not failures:
            passed += 1
            print(f"PASS  {path}", file=out)
            continue
        failed += 1
        sections = ", ".join("§" + str(s) for s in vector.get("spec") or [])
        first = failures[0]
        where = "load" if first[0] is None else f"step {first[0]} ({first[1]})"
        print(f"FAIL  {path}  [{sections}]  {where}", file=out)
        for step, action, field, expect, got in failures:
            label = f"{field}" if step is None or step == first[0] else f"step {step} {field}"
            print(f"      {label}  expect: {_show(expect)}", file=out)
            print(f"      {' ' * len(label)}  got:    {_show(got)}", file=out)
    print(f"{passed} passed, {failed} failed", file=out)
    return passed, failed


# =====================================================================================
# HOST -- command line
# =====================================================================================
EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG = 0, 1, 2


def _parse_set(items, option):
    """--set a.b=3 -> {'a': {'b': 3}} (values read as YAML 1.2 scalars)."""
    result = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigurationError(f"{option} expects KEY=VALUE, got '{item}'")
        key, _, raw = item.partition("=")
        value, _ = parse_yaml(raw) if raw.strip() else ("", None)
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return result


def _arg_parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="actor", description="Run, check or inspect Actor configurations (Actor Configuration "
        "Standard 1.0.0).")
    p.add_argument("configs", nargs="*", metavar="CONFIG", help="configuration files, merged in order")
    p.add_argument("-m", "--message", action="append", metavar="TEXT",
                   help="a message to send (repeatable); default: one message per stdin line")
    p.add_argument("--unsafe", action="store_true", help="run the host in unsafe mode (§13.1)")
    p.add_argument("--provider", metavar="NAME", help="use this provider for every llm agent "
                   "(e.g. fake: offline, no key)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="Phase A rendering context")
    p.add_argument("--context", action="append", metavar="KEY=VALUE",
                   help="host invocation-context keys (§10.3), e.g. _temperature_override=0.2")
    p.add_argument("--engine", metavar="NAME", help="template engine: JINJA2, MUSTACHE or SIMPLE")
    p.add_argument("--default-router", metavar="ROUTE", help="the default router (§9.3)")
    p.add_argument("--json", action="store_true", help="print JSON lines with content and metadata")
    p.add_argument("--check", action="store_true", help="load and validate only")
    p.add_argument("--describe", action="store_true", help="print agents and routes (§4.11)")
    p.add_argument("--diagram", action="store_true", help="print a Mermaid flowchart")
    p.add_argument("--vectors", nargs="+", metavar="PATH", help="run vector files or folders")
    p.add_argument("--impl", metavar="CMD", help="with --vectors: judge another implementation")
    p.add_argument("--timeout", type=float, default=VECTOR_TIMEOUT,
                   help="with --impl: seconds per vector")
    p.add_argument("--run-vector", action="store_true",
                   help="read one vector as JSON on stdin, print observations as JSON")
    p.add_argument("--version", action="version",
                   version=f"actor.py {__version__} (Actor Configuration Standard {SPEC_VERSION})")
    return p


def _print_message(msg, as_json, stream):
    if as_json:
        meta = {k: v for k, v in msg.metadata.items() if k != "context"}
        print(json.dumps({"content": jsonable(msg.content), "metadata": jsonable(meta),
                          "source_stream": msg.source_stream}), file=stream, flush=True)
    else:
        content = msg.content if isinstance(msg.content, str) else json.dumps(jsonable(msg.content))
        print(content, file=stream, flush=True)


def _print_result(result, as_json):
    for msg in result.outputs:
        _print_message(msg, as_json, sys.stdout)
    for msg in result.errors:
        _print_message(msg, as_json, sys.stderr)
    return bool(result.errors)


def main(argv=None):
    """The CLI: exit 0 ok, 2 configuration error, 1 runtime error."""
    args = _arg_parser().parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.WARNING, stream=sys.stderr)
    if args.run_vector:
        print(json.dumps(observe_vector(json.loads(sys.stdin.read()))))
        return EXIT_OK
    if args.vectors:
        _, failed = run_vectors(args.vectors, impl=args.impl, timeout=args.timeout)
        return EXIT_RUNTIME if failed else EXIT_OK
    if not args.configs:
        _arg_parser().print_usage(sys.stderr)
        print("actor: error: give at least one CONFIG (or --vectors)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        actor = load(*args.configs, render_context=_parse_set(args.set, "--set") or None,
                     unsafe=args.unsafe, template_engine=args.engine,
                     default_router=args.default_router, provider=args.provider,
                     clock=RealClock(), context=_parse_set(args.context, "--context") or None)
    except ActorError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    with actor:
        if args.check:
            print("ok")
            return EXIT_OK
        if args.describe:
            info = actor.describe()
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                for name, agent in info["agents"].items():
                    print(f"agent {name} ({agent['type']}): {', '.join(agent['capabilities'])}")
                for name, kind in info["routes"].items():
                    mark = "  [default router]" if name == info["default_router"] else ""
                    print(f"route {name} ({kind}){mark}")
            return EXIT_OK
        if args.diagram:
            sys.stdout.write(actor.diagram())
            return EXIT_OK
        failed = False
        try:
            if args.message:
                for text in args.message:
                    failed |= _print_result(actor.send(text), args.json)
            else:
                interactive = sys.stdin.isatty()
                while True:
                    if interactive:
                        print("> ", end="", file=sys.stderr, flush=True)
                    line = sys.stdin.readline()
                    if not line:
                        break
                    failed |= _print_result(actor.send(line.rstrip("\n")), args.json)
            failed |= _print_result(actor.complete(), args.json)
        except KeyboardInterrupt:
            return EXIT_RUNTIME
        except ActorError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_RUNTIME
        return EXIT_RUNTIME if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
