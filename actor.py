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
# [foundation] YAML 1.2 loader with marks, deep merge.

# §3.2 Top-level sections ---------------------------------------------------------------
# [foundation]

# §3.4 The default router requirement ------------------------------------------------
# [foundation]


# =====================================================================================
# §4 AGENTS
# =====================================================================================

# §4.1 The agents section ---------------------------------------------------------------
# [foundation]

# §4.2 Agent names ---------------------------------------------------------------------
# [foundation]

# §4.4 LLM agents ----------------------------------------------------------------------
# [llm] class LLMAgent; §4.4.1-§4.4.6 below.

# §4.4.1 Providers -----------------------------------------------------------------------
# [llm]

# §4.4.2 Default models ----------------------------------------------------------------
# [llm]

# §4.4.3 Structured output ---------------------------------------------------------------
# [llm]

# §4.4.4 Memory and history -------------------------------------------------------------
# [llm]

# §4.4.5 Temperature override -----------------------------------------------------------
# [llm]

# §4.4.6 System prompt rendering -------------------------------------------------------
# [llm]

# §4.5 Tool agents -----------------------------------------------------------------------
# [tools] class ToolAgent; §4.5.1-§4.5.7 below.

# §4.5.1 Built-in tools ------------------------------------------------------------------
# [tools]

# §4.5.2 Inline tools ------------------------------------------------------------------
# [tools]

# §4.5.3 Tool invocation protocol -------------------------------------------------------
# [tools]

# §4.5.4 Safe-mode restrictions ------------------------------------------------------------
# [tools]

# §4.5.5 file_write modes ---------------------------------------------------------------
# [tools]

# §4.5.6 The progress-bar facility -------------------------------------------------------
# [tools]

# §4.5.7 Tool output conventions -------------------------------------------------------
# [tools]

# §4.6 Composite agents ----------------------------------------------------------------
# [foundation]

# §4.7 Chain agents -----------------------------------------------------------------------
# [foundation]

# §4.8 Template instance agents ---------------------------------------------------------
# [foundation]

# §4.9 Agent context inheritance ------------------------------------------------------
# [foundation]

# §4.11 Capabilities and metadata -------------------------------------------------------
# [foundation]

# §4.3 Defined agent types (the table, once every class above exists) ----------------------
# [foundation] AGENT_TYPES


# =====================================================================================
# §5 ROUTES -- COMMON CONCEPTS
# =====================================================================================

# §5.1 The routes section ---------------------------------------------------------------
# Route types (§5.1 table). Graph routes are built by [graphs]; the network below only wires them.
ROUTE_TYPES = {
    "stream": "§5.3",
    "graph": "§6",
    "bridge": "§5.6",
}


def route_type(cfg):
    """The canonical (lower-case, §11.3(2)) type of a route mapping, or None."""
    kind = cfg.get("type") if isinstance(cfg, dict) else None
    return kind.lower() if isinstance(kind, str) else None


def check_streams(doc, agent_names, graph_names, rt=None):
    """§5, §7, §12.6 static checks of the stream side, before any agent exists (§1.3(2)).

    Raises a located StreamRoutingError for operator errors (an unknown operator type, a
    transform with neither fn nor type, a stream cycle) and a located ConfigurationError for
    every other malformed field. With `rt` (the network re-checks at build time), SHOULD-warnings
    (unknown keys, §11.5) go to rt.warn; the validator's early call passes no rt.
    """
    data = doc.data if isinstance(doc.data, dict) else {}
    routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
    pipelines = data.get("pipelines") if isinstance(data.get("pipelines"), dict) else {}
    known = set(BUILTIN_STREAMS) | set(routes) | set(_created_streams(data)) | set(pipelines)
    checker = _Checker(doc, set(agent_names), set(graph_names), known, routes, rt)
    for name, cfg in routes.items():
        path = ("routes", name)
        kind = route_type(cfg)
        if kind == "stream":
            checker.stream_route(cfg, path)
        elif kind == "bridge":
            check_bridge(doc, cfg, path, rt)
    check_merges(doc, data, known)
    check_splits(doc, data, known)
    check_pipelines(doc, data, routes, set(graph_names), rt, checker)
    cycle = find_stream_cycle(stream_edges(data, known))
    if cycle:
        raise doc.error(StreamRoutingError, cycle[1],
                        "stream cycle " + " -> ".join(cycle[0]) + " loops without bound", "12.6")


class _Checker:
    """Walks stream routes and operators; one method per config shape, errors located."""

    def __init__(self, doc, agents, graphs, known, routes, rt=None):
        self.doc, self.agents, self.graphs, self.known, self.routes = doc, agents, graphs, known, routes
        self.rt = rt

    def note(self, path, message, section="5.3.2"):
        if self.rt is not None:
            self.rt.warn(message, section=section, path=path)

    def fail(self, path, message, section="5.3.2", cls=ConfigurationError):
        raise self.doc.error(cls, path, message, section)

    def stream_route(self, cfg, path):
        kind = cfg.get("stream_type", "cold")
        if kind not in STREAM_TYPES:
            self.fail(path + ("stream_type",), f"unknown stream_type {kind!r} "
                      f"(one of {', '.join(STREAM_TYPES)})", "5.3.1")
        size = cfg.get("buffer_size", 1)
        if not _is_count(size) or size < 1:
            self.fail(path + ("buffer_size",), "buffer_size must be a positive integer", "5.3.1")
        for key in ("subscriptions", "publications", "agents"):
            names = cfg.get(key, [])
            if names is None:
                continue
            if not isinstance(names, list):
                self.fail(path + (key,), f"{key} must be a sequence of names", "5.3")
            for i, item in enumerate(names):
                pool = self.agents if key == "agents" else self.known
                if item not in pool:
                    what = "agent" if key == "agents" else "route or built-in stream"
                    self.fail(path + (key, i), f"unknown {what} {item!r}", "11.3")
        if isinstance(cfg.get("bridge"), dict):
            check_bridge(self.doc, cfg["bridge"], path + ("bridge",), self.rt)
        self.operators(cfg.get("operators", []), path + ("operators",))

    def operators(self, ops, path):
        if ops is None:
            return
        if not isinstance(ops, list):
            self.fail(path, "operators must be a sequence of operator mappings")
        for i, op in enumerate(ops):
            self.operator(op, path + (i,))

    def operator(self, op, path):
        if not isinstance(op, dict) or not isinstance(op.get("type"), str):
            self.fail(path, "an operator is a mapping with a string `type`")
        kind = op["type"]
        if kind not in OPERATORS:
            self.fail(path + ("type",), f"unknown operator {kind!r}", cls=StreamRoutingError)
        for key in op:
            if key not in ("type", "params"):
                self.note(path + (key,), f"unknown operator key {key!r} ignored")
        params = op.get("params") or {}
        if not isinstance(params, dict):
            self.fail(path + ("params",), "params must be a mapping")
        path = path + ("params",)
        _handler, spec = OPERATORS[kind]
        for key, (check, default) in spec.items():
            value = params.get(key, default)
            if value is REQUIRED:
                self.fail(path, f"operator {kind!r} needs params.{key}")
            if value is not None and value is not default:
                check(self, value, path + (key,))
        if kind not in OPEN_PARAMS:
            for key in params:
                if key not in spec:
                    self.note(path + (key,), f"unknown param {key!r} of operator {kind!r} ignored")
        extra = OPERATOR_CHECKS.get(kind)
        if extra:
            extra(self, params, path)

    # One check per parameter kind (the second element of each OPERATORS spec row) -----
    def seconds(self, value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            self.fail(path, "must be a non-negative number of seconds")

    def count(self, value, path):
        if not _is_count(value):
            self.fail(path, "must be a non-negative integer")

    def text(self, value, path):
        if not isinstance(value, str):
            self.fail(path, "must be a string")

    def condition(self, value, path):
        if not isinstance(value, dict):
            self.fail(path, "a condition is a mapping with a `type` key", "5.4")

    def mapping(self, value, path):
        if not isinstance(value, dict):
            self.fail(path, "must be a mapping")

    def agent(self, value, path):
        if value not in self.agents:
            self.fail(path, f"unknown agent {value!r}", "5.3.4")

    def graph(self, value, path):
        if value not in self.graphs:
            self.fail(path, f"unknown graph route {value!r}")

    def function(self, value, path):
        # INTERPRETATION §5.3.3 vs §16.2 (Q14): a function reference is a (dotted) identifier;
        # anything else is an inline expression, which §16.2 forbids.
        if not isinstance(value, str) or not FUNCTION_NAME.fullmatch(value):
            self.fail(path, "function must name a transformer; inline expressions are forbidden "
                      "here (use the transform operator with fn)", "16.2")

    def transform(self, value, path):
        if not isinstance(value, dict):
            self.fail(path, "transform must be a mapping with a `type` key", "5.3.5")
        check_transform_type(self, value.get("type", "identity"), path + ("type",))

    def accumulator(self, value, path):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in ACCUMULATORS:
            self.fail(path, f"accumulator type must be one of {', '.join(ACCUMULATORS)}", "5.3.6")

    def target(self, value, path):
        if not isinstance(value, str):
            self.fail(path, "a switch target names a stream")
        # §5.3.2: an unknown target is no-match at run time, not a load error.

    def cases(self, value, path):
        if not isinstance(value, list):
            self.fail(path, "cases must be a sequence")
        for i, case in enumerate(value):
            if not isinstance(case, dict):
                self.fail(path + (i,), "a case is a mapping with `condition`")
            if "condition" in case:
                self.condition(case["condition"], path + (i, "condition"))
            if case.get("target") is not None:
                self.target(case["target"], path + (i, "target"))
            self.operators(case.get("operators"), path + (i, "operators"))

    def operator_list(self, value, path):
        self.operators(value, path)

    def route_conditions(self, value, path):
        if not isinstance(value, dict):
            self.fail(path, "routes must map route names to conditions", "5.3.2")
        for name, cond in value.items():
            self.condition(cond, path + (name,))


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def stream_edges(data, known):
    """Every static source -> target link of the stream side, with the config path declaring it.

    Publications (§5.5), merges (§7.1), splits (§7.2), the default router (§3.4), switch and
    bridge-router targets (§5.3.2) and pipelines (§7.3). Used for §12.6 and for diagrams.
    """
    edges = []
    routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
    for name, cfg in routes.items():
        if route_type(cfg) != "stream":
            continue
        for i, target in enumerate(cfg.get("publications") or []):
            edges.append((name, target, ("routes", name, "publications", i)))
        for target, path in _switch_targets(cfg.get("operators"), ("routes", name, "operators")):
            if target in known:
                edges.append((name, target, path))
    for i, merge in enumerate(data.get("merges") or []):
        if isinstance(merge, dict) and merge.get("target") is not None:
            for j, source in enumerate(merge.get("sources") or []):
                edges.append((source, merge["target"], ("merges", i, "sources", j)))
    for i, split in enumerate(data.get("splits") or []):
        if isinstance(split, dict) and isinstance(split.get("targets"), dict):
            for target in split["targets"]:
                edges.append((split.get("source"), target, ("splits", i, "targets", target)))
    default = data.get("default_router")
    if isinstance(default, str):
        edges.append(("__input__", default, ("default_router",)))
    return edges


def _switch_targets(ops, path):
    """(target, path) of every switch/conditional_route target and default, nested cases too."""
    for i, op in enumerate(ops if isinstance(ops, list) else []):
        params = op.get("params") if isinstance(op, dict) else None
        if not isinstance(params, dict) or op.get("type") not in ("switch", "conditional_route"):
            continue
        here = path + (i, "params")
        for j, case in enumerate(params.get("cases") or []):
            if isinstance(case, dict):
                if isinstance(case.get("target"), str):
                    yield case["target"], here + ("cases", j, "target")
                yield from _switch_targets(case.get("operators"), here + ("cases", j, "operators"))
        for name in (params.get("routes") or {}) if isinstance(params.get("routes"), dict) else ():
            yield name, here + ("routes", name)
        if isinstance(params.get("default"), str):
            yield params["default"], here + ("default",)
        yield from _switch_targets(params.get("default_operators"), here + ("default_operators",))


def _created_streams(data):
    """Merge and split targets: created as cold streams when missing (§5.5, §7.1, §7.2)."""
    # INTERPRETATION §11.4 vs §7.1 (Q26): every merge/split target in the document counts as a
    # known stream, so another merge, split or publication may name a stream a merge creates.
    names = []
    for merge in data.get("merges") or []:
        if isinstance(merge, dict) and isinstance(merge.get("target"), str):
            names.append(merge["target"])
    for split in data.get("splits") or []:
        if isinstance(split, dict) and isinstance(split.get("targets"), dict):
            names.extend(t for t in split["targets"] if isinstance(t, str))
    return names

# §5.2 Built-in streams --------------------------------------------------------------------
INPUT, OUTPUT, ERROR = "__input__", "__output__", "__error__"

# §5.2 table: name -> direction. All three are cold streams that exist implicitly.
BUILTIN_STREAMS = {
    INPUT: "producer",
    OUTPUT: "consumer",
    ERROR: "consumer",
}

# §5.3 Stream routes ---------------------------------------------------------------------
class _Node:
    """A participant of the stream network: push() takes a message in, `out` carries results.

    A node completes when every wired source has completed (§5.5: completion flows through
    publications, merges and splits); the network's complete() sweeps the rest in order.
    """

    def __init__(self, net, name, out):
        self.net, self.name, self.out = net, name, out
        self.sources = 0            # wired upstream streams that have not completed yet

    def push(self, msg):
        self.out.next(msg)

    def source_done(self):
        self.sources -= 1
        if self.sources <= 0:
            self.finish()

    def finish(self):
        self.out.complete()

    def describe(self):
        return self.name


class StreamRoute(_Node):
    """§5.3 A stream route: its operators in order, then its stream (§5.3.1) that publications read.

    {type: stream, stream_type: cold, operators: [...], publications: [...], initial_value: x,
     buffer_size: n}. Operators run once per message whatever the number of targets (Q22).
    """

    def __init__(self, net, name, cfg, path):
        kind = cfg.get("stream_type") or "cold"
        seed = cfg["initial_value"] if cfg.get("initial_value") is not None else _NO_VALUE
        super().__init__(net, name, Stream(name, kind, seed, cfg.get("buffer_size") or 1))
        self.ops = cfg.get("operators") or []
        self.head = build_chain(net, name, self.ops, path + ("operators",),
                                Stage(self.emit, self.out.complete))
        self.ended = False

    def push(self, msg):
        self.head.next(msg)

    def emit(self, msg):
        # INTERPRETATION §12.2.1 (Q23): source_stream is re-stamped with the emitting stream at
        # every hop, so `source_is` can name any route.
        if msg.source_stream != self.name:
            msg = msg.copy(source_stream=self.name)
        self.out.next(msg)

    def finish(self):
        if not self.ended:
            self.ended = True
            self.head.complete()     # operators flush (buffer, reduce, debounce) then complete

    def describe(self):
        ops = [_describe_op(op) for op in self.ops]
        return self.name + (": " + " → ".join(ops) if ops else "")


def _describe_op(op):
    params = op.get("params") or {} if isinstance(op, dict) else {}
    kind = op.get("type", "?") if isinstance(op, dict) else "?"
    detail = params.get("agent") or params.get("graph") or params.get("function") or ""
    if not detail and isinstance(params.get("condition"), dict):
        detail = params["condition"].get("type", "")
    return f"{kind}({detail})" if detail else kind


class Stage:
    """One operator instance: next(msg) takes a message, complete() ends the flow.

    Handlers build a Stage around the downstream Stage `down`, so a route is a chain of plain
    calls: no scheduler, no queue, one Python call per operator per message.
    """

    __slots__ = ("next", "complete")

    def __init__(self, next, complete):
        self.next = next
        self.complete = complete


class _OpSite:
    """Where an operator lives: the network, its route, its config path, and its neighbours."""

    __slots__ = ("net", "rt", "route", "path", "ops", "index")

    def __init__(self, net, route, path, ops, index):
        self.net, self.rt, self.route = net, net.rt, route
        self.path, self.ops, self.index = path, ops, index


def build_chain(net, route, ops, path, down):
    """Build the operators `ops` (§5.3.2) in front of `down`; return the first Stage."""
    stage = down
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        handler, spec = OPERATORS[op["type"]]
        params = dict(op.get("params") or {})
        for key, (_check, default) in spec.items():
            if params.get(key) is None and default is not REQUIRED:
                params[key] = default
        stage = handler(_OpSite(net, route, path + (index, "params"), ops, index), params, stage)
    return stage

# §5.3.1 Stream types ------------------------------------------------------------------
# §5.3.1 table: stream type -> how many past messages a late subscriber receives
# (None: the route's buffer_size). Every subscriber wired at setup sees every message.
# INTERPRETATION §5.3.1 (Q22): operators run once per message and every target shares the
# result; hot/replay memory (and a hot stream's initial_value) reaches late subscribers only,
# i.e. hooks added with StreamNetwork.subscribe() after creation.
STREAM_TYPES = {
    "cold": 0,
    "hot": 1,
    "replay": None,
}

_NO_VALUE = object()


class Stream:
    """The reactive core: a named subject with next/complete and ordered subscribers.

    next() hands a message to every observer in subscription order (§12.2.2, Q97); complete()
    ends the stream once. Per-message failures never become stream errors: they are messages on
    __error__ (§12.2.3), so the stream keeps flowing.
    """

    __slots__ = ("name", "stream_type", "observers", "finishers", "memory", "keep", "done")

    def __init__(self, name, stream_type="cold", initial_value=_NO_VALUE, buffer_size=1):
        self.name, self.stream_type = name, stream_type
        self.observers, self.finishers = [], []
        keep = STREAM_TYPES[stream_type]
        keep = buffer_size if keep is None else keep
        self.keep = keep
        self.memory = [] if keep else None
        if initial_value is not _NO_VALUE and stream_type == "hot":
            self.memory.append(Message(initial_value, source_stream=name))
        self.done = False

    def subscribe(self, on_next, on_complete=None):
        """Add an observer; hot and replay streams first replay their memory to it."""
        for msg in list(self.memory or ()):
            on_next(msg)
        self.observers.append(on_next)
        if on_complete is not None:
            if self.done:
                on_complete()
            else:
                self.finishers.append(on_complete)

    def next(self, msg):
        if self.memory is not None:
            self.memory.append(msg)
            if len(self.memory) > self.keep:
                del self.memory[0]
        for on_next in self.observers:
            on_next(msg)

    def complete(self):
        if not self.done:
            self.done = True
            for on_complete in self.finishers:
                on_complete()

# §5.3.2 Operators -------------------------------------------------------------------------
REQUIRED = object()     # an OPERATORS spec default: the parameter must be given


def op_map(site, params, down):
    """§5.3.2 map: replace each message's content through an agent, a function or a transform.

    {type: map, params: {agent: <name>} | {function: <name>} | {transform: {type: <t>, ...}}}
    """
    if params.get("agent") is not None:
        return agent_mapper(site, params["agent"], down)
    if params.get("function") is not None:
        return function_mapper(site, params["function"], down)
    return transform_stage(site, params.get("transform") or {}, down)


def op_filter(site, params, down):
    """§5.3.2 filter: pass the messages whose condition holds (stream-router rules, §5.4.1).

    {type: filter, params: {condition: {type: content_contains, text: x}}}
    """
    cond, rt, path = params.get("condition"), site.rt, site.path + ("condition",)

    def on_next(msg):
        if evaluate_condition(cond, "stream", msg, rt, path):
            down.next(msg)
    return Stage(on_next, down.complete)


def op_transform(site, params, down):
    """§5.3.2 transform: `fn` (a one-parameter expression on the content, §13.2.2) or `type`.

    {type: transform, params: {fn: "lambda x: x.upper()"}} | {type: transform, params: {type:
    format, template: "[{content}]"}} -- the second behaves as map with that transform.
    """
    if params.get("fn") is None:
        return transform_stage(site, params, down)
    unit = compile_expression(params["fn"], nparams=1, rt=site.rt, path=site.path + ("fn",))
    net, route = site.net, site.route

    def on_next(msg):
        try:
            content = unit(msg.content)
        except Exception as exc:     # §12.2.3 boundary: the failure becomes an __error__ message
            net.fail(route, msg, exc)
            return
        down.next(msg.copy(content=content, source_stream=route))
    return Stage(on_next, down.complete)


def op_debounce(site, params, down):
    """§5.3.2 debounce: emit a message only after `duration` seconds without a newer one.

    {type: debounce, params: {duration: <s>}}   (capped at 50 ms in single-shot runs)
        input:    a-b-----c----|
        debounce(2 ticks)
        output:   ----b-----c--|     (completion emits a still-pending message at once)
    """
    duration = params["duration"]
    if site.net.single_shot:
        duration = min(duration, DEBOUNCE_SINGLE_SHOT_CAP)
    clock = site.rt.clock
    pending = [None, None]      # message, timer

    def fire():
        msg, pending[0], pending[1] = pending[0], None, None
        down.next(msg)

    def on_next(msg):
        if pending[1] is not None:
            pending[1].cancel()
        pending[0] = msg
        pending[1] = clock.call_later(duration, fire)

    def on_complete():
        if pending[1] is not None:
            pending[1].cancel()
            fire()
        down.complete()
    return Stage(on_next, on_complete)


def op_throttle(site, params, down):
    """§5.3.2 throttle: emit a message, then drop every message for `duration` seconds.

    {type: throttle, params: {duration: <s>}}
        input:    a-b-c---d-e--
        throttle(3 ticks)
        output:   a-------d----
    """
    # INTERPRETATION §5.3.2 throttle (Q16): leading-edge throttle; dropped messages are gone.
    duration, clock = params["duration"], site.rt.clock
    last = [None]

    def on_next(msg):
        now = clock.now()
        if last[0] is None or now - last[0] >= duration:
            last[0] = now
            down.next(msg)
    return Stage(on_next, down.complete)


def op_delay(site, params, down):
    """§5.3.2 delay: emit each message `duration` seconds after it arrived, in order.

    {type: delay, params: {duration: <s>}}
        input:    a-b------|
        delay(2 ticks)
        output:   --a-b----|   (completion emits messages still waiting, in order)
    """
    duration, clock = params["duration"], site.rt.clock
    waiting = []                # [timer, message] in arrival order

    def fire():
        _timer, msg = waiting.pop(0)
        down.next(msg)

    def on_next(msg):
        waiting.append([clock.call_later(duration, fire), msg])

    def on_complete():
        while waiting:
            waiting[0][0].cancel()
            fire()
        down.complete()
    return Stage(on_next, on_complete)


def op_buffer(site, params, down):
    """§5.3.2 buffer: hold messages, then release the batch as individual messages again.

    {type: buffer, params: {count: <n>, timeout: <s, default 0.1>}} | {params: {time: <s>}}
        input:    a-b-c-d-e---|
        buffer(count 2)
        output:   --(ab)-(cd)-(e)|   (each batch flattened; completion flushes)
    """
    # INTERPRETATION §5.3.2 buffer (Q17): a window (time, else timeout) starts at the first
    # buffered message; a batch leaves when count is reached or its window ends, whichever is
    # first; completion flushes a partial batch.
    count, clock = params.get("count"), site.rt.clock
    window = params["time"] if params.get("time") is not None else params["timeout"]
    batch, timer = [], [None]

    def flush():
        if timer[0] is not None:
            timer[0].cancel()
            timer[0] = None
        items = batch[:]
        batch.clear()
        for msg in items:       # §5.3.2: flattened back into individual emissions
            down.next(msg)

    def on_next(msg):
        batch.append(msg)
        if count and len(batch) >= count:
            flush()
        elif timer[0] is None:
            timer[0] = clock.call_later(window, flush)

    def on_complete():
        flush()
        down.complete()
    return Stage(on_next, on_complete)


def op_scan(site, params, down):
    """§5.3.2 scan: fold each message into a running total and emit the total every time.

    {type: scan, params: {accumulator: {type: collect|concat|sum}}}
    """
    seed, step = ACCUMULATORS[params["accumulator"]["type"]]
    total = [seed()]
    route = site.route

    def on_next(msg):
        total[0] = step(total[0], msg.content)
        down.next(msg.copy(content=total[0], source_stream=route))
    return Stage(on_next, down.complete)


def op_reduce(site, params, down):
    """§5.3.2 reduce: fold every message, emit the total once when the route completes.

    {type: reduce, params: {accumulator: {type: collect|concat|sum}}}
        input:    1-2-3-|
        reduce(sum)
        output:   ------6|   (nothing arrived: nothing emitted)
    """
    seed, step = ACCUMULATORS[params["accumulator"]["type"]]
    total, last = [seed()], [None]
    route = site.route

    def on_next(msg):
        total[0] = step(total[0], msg.content)
        last[0] = msg

    def on_complete():
        if last[0] is not None:
            down.next(last[0].copy(content=total[0], source_stream=route))
        down.complete()
    return Stage(on_next, on_complete)


def op_switch(site, params, down):
    """§5.3.2 switch: the first case whose condition holds decides where a message goes.

    {type: switch, params: {cases: [{condition: c, target: <stream>, operators: [...]}],
     default: <stream>, default_operators: [...]}}
    """
    # INTERPRETATION §5.3.2 switch (Q12): a case whose target is unknown counts as no-match and
    # evaluation goes on with the next case; a forwarded message leaves this route; a matching
    # case with neither operators nor target passes the message on unchanged.
    net, rt, path, route = site.net, site.rt, site.path, site.route
    inline = Stage(down.next, _no_completion)
    cases = []
    for i, case in enumerate(params.get("cases") or []):
        ops = case.get("operators") or []
        chain = build_chain(net, route, ops, path + ("cases", i, "operators"), inline) if ops else None
        cases.append((case.get("condition"), case.get("target"), chain, path + ("cases", i, "condition")))
    default_ops = params.get("default_operators") or []
    default_chain = (build_chain(net, route, default_ops, path + ("default_operators",), inline)
                     if default_ops else None)
    default = params.get("default")

    def on_next(msg):
        for cond, target, chain, cond_path in cases:
            if not evaluate_condition(cond, "stream", msg, rt, cond_path):
                continue
            if chain is not None:
                chain.next(msg)
                return
            if target is None:
                down.next(msg)
                return
            if net.forward(route, target, msg):
                return
        if default_chain is not None:
            default_chain.next(msg)
        elif default is None or not net.forward(route, default, msg):
            down.next(msg)

    def on_complete():
        for chain in [c[2] for c in cases] + [default_chain]:
            if chain is not None:
                chain.complete()
        down.complete()
    return Stage(on_next, on_complete)


def _no_completion():
    """Inline switch chains share the route's downstream, which completes once, on its own."""


def op_conditional_route(site, params, down):
    """§5.3.2 conditional_route: the bridge router when params has `routes`, else switch.

    {type: conditional_route, params: {routes: {<route>: <condition>, ...}, default: <route>}}
    """
    # INTERPRETATION §5.3.2 conditional_route (Q10): the route "engages a graph bridge" when the
    # operator's params carry a `routes` mapping; each message goes to the first route (in
    # declaration order) whose condition holds under the bridge rules of §5.4.1 (unknown type:
    # no-match), else to `default`, else on down this route.
    if not isinstance(params.get("routes"), dict):
        return op_switch(site, params, down)
    net, rt, route = site.net, site.rt, site.route
    routes = [(name, cond, site.path + ("routes", name)) for name, cond in params["routes"].items()]
    default = params.get("default")

    def on_next(msg):
        for name, cond, path in routes:
            if evaluate_condition(cond, "bridge", msg, rt, path) and net.forward(route, name, msg):
                return
        if default is None or not net.forward(route, default, msg):
            down.next(msg)
    return Stage(on_next, down.complete)


def op_catch(site, params, down):
    """§5.3.2 catch: keep error messages out of the rest of the route (they are on __error__).

    {type: catch, params: {}}
    """
    # INTERPRETATION §5.3.2 catch vs §12.2.3 (Q21, Q93): every failure already put exactly one
    # message on __error__ where it happened; catch removes messages flagged error: true from
    # the downstream flow, so they do not reach this route's publications a second time.
    def on_next(msg):
        if not msg.metadata.get("error"):
            down.next(msg)
    return Stage(on_next, down.complete)


def op_retry(site, params, down):
    """§5.3.2 retry: re-invoke the nearest agent map before it up to `count` more times.

    {type: retry, params: {count: 3}} -- the map reads the count at build time (retry_count),
    so this stage itself passes messages through.
    """
    # INTERPRETATION §5.3.2 retry (Q20): a map turns agent failures into messages, so retry
    # means: the closest preceding agent map in the same route re-invokes its agent up to
    # `count` extra times before it reports the failure.
    if _retried_map(site.ops, site.index) is None:
        site.rt.warn("retry has no agent map before it in this route; it does nothing",
                     section="5.3.2", path=site.path)
    return Stage(down.next, down.complete)


def _retried_map(ops, index):
    """Index of the agent map a retry at `index` applies to, or None."""
    for i in range(index - 1, -1, -1):
        op = ops[i]
        if op.get("type") == "map" and (op.get("params") or {}).get("agent") is not None:
            return i
    return None


def retry_count(site):
    """Extra attempts an agent map at site.index gets from the first retry after it."""
    for i in range(site.index + 1, len(site.ops)):
        op = site.ops[i]
        if op.get("type") == "retry" and _retried_map(site.ops, i) == site.index:
            count = (op.get("params") or {}).get("count")
            return 3 if count is None else count
    return 0


def op_distinct(site, params, down):
    """§5.3.2 distinct: drop a message whose content equals the previous message's content.

    {type: distinct, params: {}}
        input:    a-a-b-a-a-|
        output:   a---b-a---|
    """
    last = [_NO_VALUE]

    def on_next(msg):
        if last[0] is _NO_VALUE or msg.content != last[0]:
            last[0] = msg.content
            down.next(msg)
    return Stage(on_next, down.complete)


def op_take(site, params, down):
    """§5.3.2 take: pass the first `count` messages (default 1), drop the rest.

    {type: take, params: {count: 1}}
    """
    left = [params["count"]]

    def on_next(msg):
        if left[0] > 0:
            left[0] -= 1
            down.next(msg)
    return Stage(on_next, down.complete)


def op_skip(site, params, down):
    """§5.3.2 skip: drop the first `count` messages (default 1), pass the rest.

    {type: skip, params: {count: 1}}
    """
    left = [params["count"]]

    def on_next(msg):
        if left[0] > 0:
            left[0] -= 1
        else:
            down.next(msg)
    return Stage(on_next, down.complete)


def op_sample(site, params, down):
    """§5.3.2 sample: every `interval` seconds, emit the latest message if a new one arrived.

    {type: sample, params: {interval: 1.0}}
        input:    a-b---------c---|
        sample(4 ticks, ticks counted from the first message)
        output:   ----b-------c---|
    """
    # INTERPRETATION §5.3.2 sample (Q18): a tick emits only a message that arrived since the
    # previous tick; ticks fall on a grid that starts at the first message, and are scheduled
    # only while a message waits (no endless timer); completion emits a waiting message.
    interval, clock = params["interval"], site.rt.clock
    state = {"latest": None, "t0": None, "timer": None}

    def tick():
        state["timer"] = None
        msg, state["latest"] = state["latest"], None
        if msg is not None:
            down.next(msg)

    def on_next(msg):
        state["latest"] = msg
        if state["timer"] is None:
            now = clock.now()
            if state["t0"] is None:
                state["t0"] = now
            ticks = int((now - state["t0"]) / interval) + 1
            state["timer"] = clock.call_at(state["t0"] + ticks * interval, tick)

    def on_complete():
        if state["timer"] is not None:
            state["timer"].cancel()
            tick()
        down.complete()
    return Stage(on_next, on_complete)


def op_graph_execute(site, params, down):
    """§5.3.2 graph_execute: run a graph route per message and forward its result.

    {type: graph_execute, params: {graph: <graph route>}} -- content: the final state's last
    assistant message, else the whole state; metadata: graph, execution_history, final_state.
    """
    net, rt, route, name = site.net, site.rt, site.route, params["graph"]

    def on_next(msg):
        try:
            run = rt.graphs[name].run(msg.content, resolve_context(msg, rt))
        except Exception as exc:    # §12.2.3 boundary
            net.fail(route, msg, exc)
            return
        state = run.state if isinstance(run.state, dict) else {}
        replies = [m for m in state.get("messages") or []
                   if isinstance(m, dict) and m.get("role") == "assistant"]
        out = msg.copy(content=replies[-1].get("content") if replies else state,
                       source_stream=route)
        out.metadata.update(graph=name, execution_history=list(run.history), final_state=state)
        down.next(out)
    return Stage(on_next, down.complete)


def op_state_update(site, params, down):
    """§5.3.2 state_update: apply the content as an update to a graph's state; mark the message.

    {type: state_update, params: {graph: <graph route>}}
    """
    return _graph_side_effect(site, params, down, "state_updated",
                              lambda graph, msg: graph.update_state(msg.content))


def op_state_checkpoint(site, params, down):
    """§5.3.2 state_checkpoint: save a checkpoint of a graph's state (§6.6); mark the message.

    {type: state_checkpoint, params: {graph: <graph route>}}
    """
    return _graph_side_effect(site, params, down, "checkpointed",
                              lambda graph, msg: graph.checkpoint())


def _graph_side_effect(site, params, down, flag, action):
    net, rt, route, name = site.net, site.rt, site.route, params["graph"]

    def on_next(msg):
        try:
            action(rt.graphs[name], msg)
        except Exception as exc:    # §12.2.3 boundary
            net.fail(route, msg, exc)
            return
        out = msg.copy(source_stream=route)
        out.metadata[flag] = True
        out.metadata["graph"] = name
        down.next(out)
    return Stage(on_next, down.complete)


def op_graph_node(site, params, down):
    """§5.3.2 graph_node: run one node of a graph route on the content; forward its output.

    {type: graph_node, params: {graph: <graph route>, node: <node name>}}
    """
    net, rt, route = site.net, site.rt, site.route
    name, node = params["graph"], params["node"]

    def on_next(msg):
        try:
            content = rt.graphs[name].run_node(node, msg.content, resolve_context(msg, rt))
        except Exception as exc:    # §12.2.3 boundary
            net.fail(route, msg, exc)
            return
        out = msg.copy(content=content, source_stream=route)
        out.metadata.update(graph=name, node=node)
        down.next(out)
    return Stage(on_next, down.complete)


def _check_map(checker, params, path):
    # INTERPRETATION §5.3.2 map (Q13): none or several of agent/function/transform is a
    # ConfigurationError at load time.
    given = [k for k in ("agent", "function", "transform") if params.get(k) is not None]
    if len(given) != 1:
        checker.fail(path, "map needs exactly one of agent, function, transform"
                     + (f" (got {', '.join(given)})" if given else ""))


def _check_transform(checker, params, path):
    if params.get("fn") is None and params.get("type") is None:
        checker.fail(path, "transform needs `fn` or `type`", cls=StreamRoutingError)
    if params.get("fn") is not None and params.get("type") is not None:
        checker.fail(path, "transform takes `fn` or `type`, not both")
    if params.get("fn") is not None:
        _compile_located(checker.doc, params["fn"], 1, checker.rt, path + ("fn",))
    else:
        check_transform_type(checker, params["type"], path + ("type",))


def _check_sample(checker, params, path):
    if params.get("interval") is not None and params["interval"] <= 0:
        checker.fail(path + ("interval",), "interval must be positive")


def _check_graph_node(checker, params, path):
    graph = checker.routes.get(params.get("graph"))
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if isinstance(nodes, dict) and params.get("node") not in nodes:
        checker.fail(path + ("node",), f"graph {params.get('graph')!r} has no node "
                     f"{params.get('node')!r}")


def _compile_located(doc, source, nparams, rt, path):
    """compile_expression with the error located in the document even before a Runtime exists."""
    if not isinstance(source, str):
        raise doc.error(ConfigurationError, path, "an expression must be a string", "13.2.2")
    try:
        return compile_expression(source, nparams=nparams, rt=rt, path=path)
    except ActorError as exc:
        if exc.file is None and exc.line is None:
            raise doc.error(type(exc), path, exc.message, exc.section or "13.2.2") from exc
        raise


# §5.3.2 table: operator -> (handler, {param: (check, default)}). Rows in the spec's order.
OPERATORS = {
    "map":               (op_map,               {"agent": (_Checker.agent, None),
                                                 "function": (_Checker.function, None),
                                                 "transform": (_Checker.transform, None)}),
    "filter":            (op_filter,            {"condition": (_Checker.condition, None)}),
    "transform":         (op_transform,         {"fn": (_Checker.text, None),
                                                 "type": (_Checker.text, None)}),
    "debounce":          (op_debounce,          {"duration": (_Checker.seconds, REQUIRED)}),
    "throttle":          (op_throttle,          {"duration": (_Checker.seconds, REQUIRED)}),
    "delay":             (op_delay,             {"duration": (_Checker.seconds, REQUIRED)}),
    "buffer":            (op_buffer,            {"count": (_Checker.count, None),
                                                 "timeout": (_Checker.seconds, 0.1),
                                                 "time": (_Checker.seconds, None)}),
    "scan":              (op_scan,              {"accumulator": (_Checker.accumulator, REQUIRED)}),
    "reduce":            (op_reduce,            {"accumulator": (_Checker.accumulator, REQUIRED)}),
    "switch":            (op_switch,            {"cases": (_Checker.cases, None),
                                                 "default": (_Checker.target, None),
                                                 "default_operators": (_Checker.operator_list, None)}),
    "conditional_route": (op_conditional_route, {"cases": (_Checker.cases, None),
                                                 "default": (_Checker.target, None),
                                                 "default_operators": (_Checker.operator_list, None),
                                                 "routes": (_Checker.route_conditions, None)}),
    "catch":             (op_catch,             {}),
    "retry":             (op_retry,             {"count": (_Checker.count, 3)}),
    "distinct":          (op_distinct,          {}),
    "take":              (op_take,              {"count": (_Checker.count, 1)}),
    "skip":              (op_skip,              {"count": (_Checker.count, 1)}),
    "sample":            (op_sample,            {"interval": (_Checker.seconds, 1.0)}),
    "graph_execute":     (op_graph_execute,     {"graph": (_Checker.graph, REQUIRED)}),
    "state_update":      (op_state_update,      {"graph": (_Checker.graph, REQUIRED)}),
    "state_checkpoint":  (op_state_checkpoint,  {"graph": (_Checker.graph, REQUIRED)}),
    "graph_node":        (op_graph_node,        {"graph": (_Checker.graph, REQUIRED),
                                                 "node": (_Checker.text, REQUIRED)}),
}

# Operators whose params also carry keys of their own (transform-specific keys, §5.3.5).
OPEN_PARAMS = {"transform"}

# Checks that span several params of one operator.
OPERATOR_CHECKS = {
    "map": _check_map,
    "transform": _check_transform,
    "sample": _check_sample,
    "graph_node": _check_graph_node,
}

# §5.3.3 Function references ---------------------------------------------------------
# INTERPRETATION §5.3.3 (Q14): the standard defines no built-in transformers, so this table is
# empty; a host registers its own as rt.functions = {name: fn(content) -> content}. A name
# found in neither is the identity transformation (with a warning at build time).
STANDARD_FUNCTIONS = {}

FUNCTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def function_mapper(site, name, down):
    """§5.3.3 map with `function`: a registered transformer, else the identity."""
    registry = {**STANDARD_FUNCTIONS, **(getattr(site.rt, "functions", None) or {})}
    fn = registry.get(name)
    if fn is None:
        site.rt.warn(f"no transformer named {name!r} is registered; map acts as identity",
                     section="5.3.3", path=site.path + ("function",))
        return Stage(down.next, down.complete)
    net, route = site.net, site.route

    def on_next(msg):
        try:
            content = fn(msg.content)
        except Exception as exc:    # §12.2.3 boundary
            net.fail(route, msg, exc)
            return
        down.next(msg.copy(content=content, source_stream=route))
    return Stage(on_next, down.complete)

# §5.3.4 Agent mappers -----------------------------------------------------------------
PROCESSING_TIMED_OUT = "Processing timed out"      # §5.3.4(3), word for word
AGENT_HARD_TIMEOUT = 120.0                          # §5.3.4(3), seconds per agent invocation


class _AgentTimedOut(Exception):
    """Internal: an agent call outlived AGENT_HARD_TIMEOUT (never escapes the map stage)."""


def resolve_context(msg, rt):
    """§5.3.4(1): the message's metadata.context, else the global context, else {}.

    Returns the dict itself (a reference, §10.2), never a copy.
    """
    ctx = msg.metadata.get("context") if isinstance(msg, Message) else None
    if isinstance(ctx, dict):
        return ctx
    ctx = getattr(rt, "context", None)
    return ctx if isinstance(ctx, dict) else {}


def invoke_agent(rt, agent, content, ctx):
    """Call agent.invoke, bounded by the §5.3.4 hard timeout when time is real.

    Under the virtual clock no wall time may pass, so the call is direct (the fast path). Under
    the real clock the call runs on a daemon worker thread that we stop waiting for after
    AGENT_HARD_TIMEOUT seconds.
    """
    if not rt.clock.real:
        return agent.invoke(content, ctx)
    box = {}

    def work():
        try:
            box["reply"] = agent.invoke(content, ctx)
        except BaseException as exc:    # carried back to the stream thread and handled there
            box["error"] = exc
    worker = threading.Thread(target=work, name=f"agent-{agent.name}", daemon=True)
    worker.start()
    worker.join(AGENT_HARD_TIMEOUT)
    if worker.is_alive():
        raise _AgentTimedOut()
    if "error" in box:
        raise box["error"]
    return box["reply"]


def agent_mapper(site, name, down):
    """§5.3.4 map with `agent`: invoke the agent once per message; errors become messages.

    Success: content = reply, metadata.processed_by = agent, metadata.context = the context
    reference. Timeout: "Processing timed out" with timeout/error metadata. Failure:
    "Error: <reason>" with error/processed_by metadata. Both failures also put one message on
    __error__ (§12.2.3), and the route keeps processing other messages.
    """
    net, rt, route = site.net, site.rt, site.route
    agent = rt.agents[name]
    attempts = 1 + retry_count(site)

    def on_next(msg):
        ctx = resolve_context(msg, rt)
        failure = None
        for _ in range(attempts):
            try:
                reply = invoke_agent(rt, agent, msg.content, ctx)
            except _AgentTimedOut:
                out = msg.copy(content=PROCESSING_TIMED_OUT, source_stream=route)
                out.metadata.update(timeout=True, error=True, error_type="ExecutionError",
                                    processed_by=name)
                break
            except Exception as exc:    # §12.2.3 boundary: agent invocation
                failure = exc
                continue
            out = msg.copy(content=reply, source_stream=route)
            out.metadata["processed_by"] = name
            out.metadata["context"] = ctx
            down.next(out)
            return
        else:
            out = msg.copy(content="Error: " + error_reason(failure), source_stream=route)
            out.metadata.update(error=True, error_type=error_category(failure), processed_by=name)
        # INTERPRETATION §5.3.4 vs §12.2.3 (Q92): the failed map's message goes on downstream
        # (§5.3.4 "emit"), and one copy of it is the failure's single __error__ message.
        net.report(out)
        down.next(out)
    return Stage(on_next, down.complete)

# §5.3.5 Transform types ---------------------------------------------------------------
def tf_extract(content, params):
    """content[field] when content is a mapping holding field; otherwise unchanged (Q15)."""
    field = params.get("field")
    return content[field] if isinstance(content, dict) and field in content else content


def tf_wrap(content, params):
    return {**(params.get("wrapper") or {}), "data": content}


def tf_format(content, params):
    """Only {content} is a placeholder, filled with str(content); other braces stay (Q15)."""
    return str(params.get("template", "{content}")).replace("{content}", str(content))


def tf_replace(content, params):
    """Every occurrence, on string content only; an empty `old` changes nothing (Q15)."""
    old, new = str(params.get("old", "")), str(params.get("new", ""))
    return content.replace(old, new) if isinstance(content, str) and old else content


def tf_identity(content, params):
    return content


# §5.3.5 table: transform type -> handler(content, params) -> new content.
# INTERPRETATION §5.3.5 (Q15): extract of a missing field or non-mapping leaves content
# unchanged; format uses str(); replace replaces all occurrences; an absent type is identity
# and an unknown type is a ConfigurationError at load.
TRANSFORMS = {
    "extract": tf_extract,
    "wrap": tf_wrap,
    "format": tf_format,
    "replace": tf_replace,
    "identity": tf_identity,
}


def check_transform_type(checker, kind, path):
    if kind not in TRANSFORMS:
        checker.fail(path, f"unknown transform type {kind!r} (one of {', '.join(TRANSFORMS)})",
                     "5.3.5")


def transform_stage(site, params, down):
    """§5.3.5 a built-in transform applied to every message's content."""
    handler = TRANSFORMS[params.get("type") or "identity"]
    route = site.route

    def on_next(msg):
        down.next(msg.copy(content=handler(msg.content, params), source_stream=route))
    return Stage(on_next, down.complete)

# §5.3.6 Accumulators -------------------------------------------------------------------
def acc_collect(total, content):
    return total + [content]        # a new list each time: emitted totals never change later


def acc_concat(total, content):
    return total + (content if isinstance(content, str) else str(content))


def acc_sum(total, content):
    if isinstance(content, (int, float)) and not isinstance(content, bool):
        return total + content
    return total


# §5.3.6 table: accumulator -> (seed, step(total, content) -> total).
# INTERPRETATION §5.3.6 (Q19): sum counts int/float content only (not numeric strings, not
# bools), an ignored item still makes scan emit the unchanged total, the total stays an int
# while every input is one; concat joins with no separator.
ACCUMULATORS = {
    "collect": (list, acc_collect),
    "concat": (str, acc_concat),
    "sum": (int, acc_sum),
}

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


# §5.4 table: type -> (evaluator, subsystems that honour it). Rows in the spec's order.
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
class StreamNetwork:
    """Every stream participant of one Actor, wired once at creation (§5.5, §7, §12.1 steps 4-6).

    Built from rt.doc.data after rt.agents and rt.graphs exist. send() feeds __input__ (or a
    named route), complete() ends the input and lets completion flow, settle() waits for pending
    timers under the real clock; on_output/on_error register host hooks; mermaid() draws it.
    """

    def __init__(self, rt, *, single_shot=None):
        self.rt = rt
        data = rt.doc.data if isinstance(rt.doc.data, dict) else {}
        check_streams(rt.doc, rt.agents, rt.graphs, rt=rt)
        # INTERPRETATION §5.3.2 debounce, §12.2.4 (Q95): a run is single-shot when the host says
        # so (rt.single_shot, e.g. the CLI with -m messages); vectors and the API are not.
        self.single_shot = bool(getattr(rt, "single_shot", False) if single_shot is None
                                else single_shot)
        self.strip = routing_prefix_pattern(getattr(rt, "routing_prefixes", None))
        self.error_depth = 0
        routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
        # §6.9: a document whose every route is a graph runs in pure graph mode.
        self.pure = bool(routes) and all(route_type(c) == "graph" for c in routes.values())
        self.nodes = {INPUT: _Node(self, INPUT, Stream(INPUT)),
                      OUTPUT: _Sink(self, OUTPUT, self._to_output),
                      ERROR: _Sink(self, ERROR, self._to_error)}
        for name, cfg in routes.items():            # §12.1 step 4: routes
            path = ("routes", name)
            if route_type(cfg) == "stream":
                self.nodes[name] = StreamRoute(self, name, cfg, path)
            elif route_type(cfg) == "graph" and name in rt.graphs:
                self.nodes[name] = GraphParticipant(self, name, rt.graphs[name])
            # bridge routes carry no messages (§5.6)
        links = publication_links(routes)           # §5.5
        links += merge_links(self, data)            # §12.1 step 5: merges and splits
        links += split_links(self, data)
        links += pipeline_links(self, data)         # §12.1 step 6: pipelines
        default = default_router(rt)
        if default is not None:                     # §3.4, §9.3: the default router
            links.append((INPUT, default, None, ("default_router",)))
        self.edges = self._wire(links)
        self._implicit_graph_output()
        self.order = self._completion_order()

    # Wiring ------------------------------------------------------------------------------
    def _wire(self, links):
        """Subscribe every target to its sources; one edge per (source, target) pair."""
        # INTERPRETATION §5.5 (Q24, Q7 f): a source -> target pair declared more than once
        # (publication + merge, split, default router) is one edge: a message crosses it at most
        # once, when any of the declarations lets it through. A diamond A->B->C, A->C still
        # delivers twice at C: those are different pairs.
        edges = {}
        for source, target, cond, path in links:
            if source not in self.nodes or target not in self.nodes:
                missing = source if source not in self.nodes else target
                self.rt.warn(f"{missing!r} carries no messages here (a bridge, or a graph "
                             "route without a runtime graph); link ignored", section="5.5",
                             path=path)
                continue
            conds = edges.setdefault((source, target), [])
            conds.append((cond, path))
        for (source, target), conds in edges.items():
            node = self.nodes[target]
            node.sources += 1
            self.nodes[source].out.subscribe(self._edge(node, conds), node.source_done)
        return edges

    def _edge(self, node, conds):
        if any(cond is None for cond, _path in conds):
            return node.push
        rt = self.rt

        def push_if(msg):
            if any(evaluate_condition(cond, "stream", msg, rt, path) for cond, path in conds):
                node.push(msg)
        return push_if

    def _implicit_graph_output(self):
        # INTERPRETATION §6.1, §3.3 (Q28): a graph route that receives messages and that no merge
        # or split reads from sends each run's output (GraphRun.output) to __output__.
        fed = {t for (_s, t) in self.edges}
        read = {s for (s, _t) in self.edges}
        for name, node in list(self.nodes.items()):
            if isinstance(node, GraphParticipant) and name in fed and name not in read:
                self.edges[(name, OUTPUT)] = [(None, ("routes", name))]
                self.nodes[OUTPUT].sources += 1
                node.out.subscribe(self.nodes[OUTPUT].push, self.nodes[OUTPUT].source_done)

    def _completion_order(self):
        """Nodes in topological order of every link (switch targets too), __input__ first."""
        after = {name: [] for name in self.nodes}
        for source, target in self.edges:
            after[source].append(target)
        for name, node in self.nodes.items():
            for target, _path in _switch_targets(getattr(node, "ops", None), ()):
                if target in self.nodes:
                    after[name].append(target)
            after[name].extend(getattr(node, "feeds", ()))
        order, seen = [], set()

        def visit(name):
            if name not in seen:
                seen.add(name)
                for target in after[name]:
                    visit(target)
                order.append(name)
        for name in [INPUT] + [n for n in self.nodes if n not in (INPUT, OUTPUT, ERROR)]:
            visit(name)
        order.reverse()
        return [n for n in order if n not in (OUTPUT, ERROR)] + [OUTPUT, ERROR]

    # The host side ------------------------------------------------------------------------
    def send(self, content, *, target=None, metadata=None):
        """Submit a message to __input__, or straight to the route named `target`."""
        name = INPUT if target is None else target
        node = self.nodes.get(name)
        if node is None or name in (OUTPUT, ERROR):
            raise RoutingError(f"no route or input stream named {name!r}", section="5.1")
        if self.nodes[INPUT].out.done:
            raise StreamRoutingError("__input__ has completed; no more messages", section="5.5")
        meta = dict(metadata or {})
        meta.setdefault("context", self.rt.context)     # §10.2(2): a reference, not a copy
        meta.setdefault("_unsafe_mode", self.rt.unsafe)
        node.push(Message(content, meta, INPUT, self.rt.clock.now()))

    def complete(self):
        """End the input (Q27): completion flows through every link, so reduce/buffer flush."""
        # INTERPRETATION §5.5 (Q27): __input__ completes when the host ends input; each node then
        # completes once all its sources have, and nodes only reachable by send(target=...) or
        # a switch complete in topological order after their upstream.
        for name in self.order:
            self.nodes[name].finish()

    def settle(self, timeout=None):
        """Real clock: wait for pending timers, bounded by the §12.2.4 soft timeout."""
        clock = self.rt.clock
        if not clock.real:
            return
        deadline = clock.now() + (SOFT_TIMEOUT if timeout is None else timeout)
        while (due := clock.next_due()) is not None:
            if due > deadline:
                self.report(Message(SOFT_TIMEOUT_TEXT, {"error": True, "timeout": True,
                                                        "error_type": "ExecutionError"}, INPUT,
                                    clock.now()))
                return
            clock.advance(max(0.0, due - clock.now()))

    def on_output(self, fn):
        self.nodes[OUTPUT].hooks.append(fn)

    def on_error(self, fn):
        self.nodes[ERROR].hooks.append(fn)

    def subscribe(self, name, fn):
        """A late subscriber to a stream: hot and replay streams replay their memory (§5.3.1)."""
        self.nodes[name].out.subscribe(fn)

    # Forwarding and errors (used by operators) ---------------------------------------------
    def forward(self, source, target, msg):
        """switch/bridge forwarding; False when `target` names no stream (= no-match, §5.3.2)."""
        node = self.nodes.get(target)
        if node is None or target == INPUT:
            return False
        if msg.source_stream != source:
            msg = msg.copy(source_stream=source)
        node.push(msg)
        return True

    def fail(self, origin, msg, exc):
        """§12.2.3: an operator failed on `msg`: one "Error: <reason>" message on __error__."""
        out = Message("Error: " + error_reason(exc), dict(msg.metadata), origin,
                      self.rt.clock.now())
        out.metadata.update(error=True, error_type=error_category(exc))
        self.report(out)

    def report(self, msg):
        """Put a copy of `msg` on __error__ (the original may also travel downstream)."""
        self.nodes[ERROR].push(msg.copy())

    def _to_output(self, msg):
        if isinstance(msg.content, str):
            match = self.strip.match(msg.content)
            if match:
                msg = msg.copy(content=msg.content[match.end():])
        return msg

    def _to_error(self, msg):
        msg.metadata.setdefault("error", True)
        msg.metadata.setdefault("error_type", "ExecutionError")
        if not isinstance(msg.content, str):
            msg = msg.copy(content=str(msg.content))
        return msg

    # §18 --diagram ------------------------------------------------------------------------
    def mermaid(self):
        """Mermaid flowchart lines (no header) for routes with operators, links and conditions."""
        ids = {name: re.sub(r"\W", "_", name) for name in self.nodes}
        lines = []
        for name, node in self.nodes.items():
            label = node.describe().replace('"', "'")
            shape = f'(("{label}"))' if name in BUILTIN_STREAMS else f'["{label}"]'
            lines.append(f"    {ids[name]}{shape}")
        for (source, target), conds in self.edges.items():
            if any(cond is None for cond, _path in conds):
                lines.append(f"    {ids[source]} --> {ids[target]}")
            else:
                label = " or ".join(_describe_condition(c) for c, _p in conds).replace('"', "'")
                lines.append(f'    {ids[source]} -- "{label}" --> {ids[target]}')
        for name, node in self.nodes.items():
            for target, _path in _switch_targets(getattr(node, "ops", None), ()):
                if target in ids:
                    lines.append(f"    {ids[name]} -. switch .-> {ids[target]}")
        return lines


def _describe_condition(cond):
    if not isinstance(cond, dict):
        return "always"
    detail = cond.get("text", cond.get("key", cond.get("source", "")))
    return f"{cond.get('type', 'always')} {detail!r}" if detail != "" else str(cond.get("type"))


class _Sink(_Node):
    """__output__ / __error__: a cold stream plus host hooks, after a per-message adjustment."""

    def __init__(self, net, name, adjust):
        super().__init__(net, name, Stream(name))
        self.adjust, self.hooks, self.depth = adjust, [], 0

    def push(self, msg):
        msg = self.adjust(msg)
        self.depth += 1
        try:
            if self.depth == 1:
                self.out.next(msg)
            else:
                # §12.6: a message emitted here while this stream is still delivering another
                # (e.g. an error handler fed from __error__ that fails) goes to the host only.
                self.net.rt.warn(f"{self.name} feedback loop cut for one message", section="12.6")
            for hook in self.hooks:
                hook(msg)
        finally:
            self.depth -= 1


class GraphParticipant(_Node):
    """A graph route fed by a merge, split, pipeline or the default router (§6, §7).

    Each message runs the graph once (pure=True in pure graph mode, §6.9); the run's output
    (GraphRun.output, chosen by [graphs]) continues as this stream's message.
    """

    def __init__(self, net, name, graph):
        super().__init__(net, name, Stream(name))
        self.graph = graph

    def push(self, msg):
        rt = self.net.rt
        try:
            run = self.graph.run(msg.content, resolve_context(msg, rt), pure=self.net.pure)
        except Exception as exc:        # §12.2.3 boundary
            self.net.fail(self.name, msg, exc)
            return
        out = msg.copy(content=run.output, source_stream=self.name)
        out.metadata["graph"] = self.name
        self.out.next(out)

    def describe(self):
        return f"{self.name}: graph"


def default_router(rt):
    """The §9.3 default_router: a host/Runtime setting first, else the document's key."""
    name = getattr(rt, "default_router", None)
    if name is None and isinstance(rt.doc.data, dict):
        name = rt.doc.data.get("default_router")
    return name if isinstance(name, str) else None


def publication_links(routes):
    """§5.5: each publication target receives every emission of its route."""
    links = []
    for name, cfg in routes.items():
        if route_type(cfg) == "stream":
            for i, target in enumerate(cfg.get("publications") or []):
                links.append((name, target, None, ("routes", name, "publications", i)))
    # Subscriptions are validated by check_streams and never wired (§5.5).
    return links

# §5.6 Bridge routes -----------------------------------------------------------------------
# §5.6 tables: expression fields -> parameters the expression takes (§13.2.2).
BRIDGE_EXPRESSIONS = {
    "state_extractor": 1,
    "state_flattener": 1,
}
BRIDGE_CONDITION_EXPRESSIONS = {
    "custom_predicate": 2,      # (message, route configuration)
}


def check_bridge(doc, cfg, path, rt=None):
    """§5.6: bridges are advisory (never acted on here), but their expressions must compile.

    {type: bridge, upgrade_conditions: {custom_predicate: "lambda m, cfg: ..."},
     state_extractor: "lambda s: ...", state_flattener: "lambda s: ..."}
    """
    for key, nparams in BRIDGE_EXPRESSIONS.items():
        if cfg.get(key) is not None:
            _compile_located(doc, cfg[key], nparams, rt, path + (key,))
    for group in ("upgrade_conditions", "downgrade_conditions"):
        conds = cfg.get(group)
        if conds is None:
            continue
        if not isinstance(conds, dict):
            raise doc.error(ConfigurationError, path + (group,), f"{group} must be a mapping",
                            "5.6")
        for key, nparams in BRIDGE_CONDITION_EXPRESSIONS.items():
            if conds.get(key) is not None:
                _compile_located(doc, conds[key], nparams, rt, path + (group, key))


# =====================================================================================
# §6 GRAPH ROUTES
# =====================================================================================

# §6.1 Graph route structure -------------------------------------------------------------
# [graphs] class GraphRoute; §6.2-§6.11 below.

# §6.2 Nodes -------------------------------------------------------------------------------
# [graphs]

# §6.2.1 start and end nodes -----------------------------------------------------------
# [graphs]

# §6.2.2 Agent nodes -------------------------------------------------------------------
# [graphs]

# §6.2.3 Function and tool nodes -------------------------------------------------------
# [graphs]

# §6.2.4 Conditional nodes -------------------------------------------------------------
# [graphs]

# §6.2.5 Subgraph nodes ------------------------------------------------------------------
# [graphs]

# §6.2.6 Message router nodes -----------------------------------------------------------
# [graphs]

# §6.3 Graph state -------------------------------------------------------------------------
# [graphs]

# §6.4 Edges -------------------------------------------------------------------------------
# [graphs]

# §6.5 Edge conditions -------------------------------------------------------------------
# [graphs]

# §6.6 Checkpointing and time travel -----------------------------------------------------
# [graphs]

# §6.7 Parallel execution ----------------------------------------------------------------
# [graphs]

# §6.8 Loop and cycle detection ----------------------------------------------------------
# [graphs]

# §6.9 Pure graph mode -------------------------------------------------------------------
# [graphs]

# §6.10 Graph-internal streams ---------------------------------------------------------
# [graphs]

# §6.11 Graph analysis -------------------------------------------------------------------
# [graphs]


# =====================================================================================
# §7 INTER-ROUTE COMPOSITION
# =====================================================================================

# §7.1 The merges section ---------------------------------------------------------------
def check_merges(doc, data, known):
    """§7.1, §11.4: a list of {sources: [...], target: name}; sources must be known names."""
    merges = data.get("merges")
    if merges is None:
        return
    if not isinstance(merges, list):
        raise doc.error(ConfigurationError, ("merges",), "merges must be a sequence", "7.1")
    for i, merge in enumerate(merges):
        path = ("merges", i)
        if not isinstance(merge, dict):
            raise doc.error(ConfigurationError, path, "a merge is a mapping with sources and target",
                            "7.1")
        if merge.get("target") is None:
            raise doc.error(ConfigurationError, path, "merge has no target", "11.4")
        if not isinstance(merge["target"], str):
            raise doc.error(ConfigurationError, path + ("target",), "target must be a name", "7.1")
        sources = merge.get("sources") or []
        if not isinstance(sources, list):
            raise doc.error(ConfigurationError, path + ("sources",), "sources must be a sequence",
                            "7.1")
        for j, source in enumerate(sources):
            if source not in known:
                raise doc.error(ConfigurationError, path + ("sources", j),
                                f"unknown route or stream {source!r}", "11.4")


def merge_links(net, data):
    """§7.1: each source feeds the target; a missing target is created as a cold stream."""
    links = []
    for i, merge in enumerate(data.get("merges") or []):
        sources = merge.get("sources") or []
        if not sources:
            continue        # §7.1: an empty merge is silently ignored
        _ensure_stream(net, merge["target"])
        for j, source in enumerate(sources):
            links.append((source, merge["target"], None, ("merges", i, "sources", j)))
    return links


def _ensure_stream(net, name):
    if name not in net.nodes:
        net.nodes[name] = _Node(net, name, Stream(name, "cold"))

# §7.2 The splits section ---------------------------------------------------------------
def check_splits(doc, data, known):
    """§7.2, §11.4: a list of {source: name, targets: {name: condition}}; source must be known."""
    splits = data.get("splits")
    if splits is None:
        return
    if not isinstance(splits, list):
        raise doc.error(ConfigurationError, ("splits",), "splits must be a sequence", "7.2")
    for i, split in enumerate(splits):
        path = ("splits", i)
        if not isinstance(split, dict):
            raise doc.error(ConfigurationError, path, "a split is a mapping with source and targets",
                            "7.2")
        if split.get("source") is None:
            raise doc.error(ConfigurationError, path, "split has no source", "11.4")
        if split["source"] not in known:
            raise doc.error(ConfigurationError, path + ("source",),
                            f"unknown route or stream {split['source']!r}", "11.4")
        targets = split.get("targets") or {}
        if not isinstance(targets, dict):
            raise doc.error(ConfigurationError, path + ("targets",),
                            "targets must map stream names to conditions", "7.2")
        for name, cond in targets.items():
            if cond is not None and not isinstance(cond, dict):
                raise doc.error(ConfigurationError, path + ("targets", name),
                                "a condition is a mapping with a `type` key", "5.4")


def split_links(net, data):
    """§7.2: each target (created if missing) gets the source's messages its condition passes."""
    links = []
    for i, split in enumerate(data.get("splits") or []):
        for name, cond in (split.get("targets") or {}).items():
            _ensure_stream(net, name)
            # A target's condition is never None-as-unconditional: an absent condition is
            # evaluated (stream default: true, §5.4.1) like any other.
            links.append((split["source"], name, cond if cond is not None else {},
                          ("splits", i, "targets", name)))
    return links

# §7.3 The pipelines section -------------------------------------------------------------
# INTERPRETATION §7.3 vs §16.2 (Q1): pipelines are accepted and wired stage to stage: a message
# sent to the pipeline's name (send(target=...), a merge or split target, the default router)
# enters stage 1, and the output of stage N feeds stage N+1. Stage-local link names
# (publications naming non-routes, input_from, output_to, subscriptions) are advisory;
# publications naming a route or built-in stream are honoured.
PIPELINE_STAGE_TYPES = ("stream", "graph")


def check_pipelines(doc, data, routes, graph_names, rt=None, checker=None):
    """§7.3, §11.5: stages are stream or graph configurations; §11.5 cases only warn."""
    pipelines = data.get("pipelines")
    if pipelines is None:
        return
    if not isinstance(pipelines, dict):
        raise doc.error(ConfigurationError, ("pipelines",), "pipelines must be a mapping", "7.3")
    for name, cfg in pipelines.items():
        path = ("pipelines", name)
        if name in routes or name in BUILTIN_STREAMS:
            raise doc.error(ConfigurationError, path, f"pipeline name {name!r} is already a route "
                            "or built-in stream", "7.3")
        stages = cfg.get("stages") if isinstance(cfg, dict) else None
        if not isinstance(stages, list):
            raise doc.error(ConfigurationError, path, "a pipeline needs a `stages` sequence", "7.3")
        for i, stage in enumerate(stages):
            here = path + ("stages", i)
            kind = stage.get("type") if isinstance(stage, dict) else None
            if kind not in PIPELINE_STAGE_TYPES:
                raise doc.error(ConfigurationError, here, "a stage is a mapping with type stream "
                                "or graph", "7.3")
            if kind == "stream":
                if checker is not None:
                    checker.operators(stage.get("operators"), here + ("operators",))
                if stage.get("name") in routes and rt is not None:
                    rt.warn(f"pipeline stage name {stage['name']!r} collides with a route",
                            section="11.5", path=here + ("name",))
            elif not isinstance(stage.get("config"), dict):
                graph = stage.get("graph", stage.get("name"))
                if graph not in graph_names and rt is not None:
                    rt.warn(f"pipeline graph stage names no graph route ({graph!r}); it passes "
                            "messages through", section="11.5", path=here)


def pipeline_links(net, data):
    """§7.3: build each pipeline's stages as nodes named <pipeline>.<stage> and chain them."""
    links = []
    for name, cfg in (data.get("pipelines") or {}).items():
        stages = []
        for i, stage in enumerate(cfg.get("stages") or []):
            here = ("pipelines", name, "stages", i)
            node_name = f"{name}.{stage.get('name', i)}"
            node = _pipeline_stage(net, node_name, stage, here)
            net.nodes[node_name] = node
            stages.append(node_name)
            for j, target in enumerate(stage.get("publications") or [] if stage.get("type") ==
                                       "stream" else []):
                if target in net.nodes and target not in stages:
                    links.append((node_name, target, None, here + ("publications", j)))
        for a, b in zip(stages, stages[1:]):
            links.append((a, b, None, ("pipelines", name, "stages")))
        entry = _PipelineEntry(net, name, net.nodes[stages[0]] if stages else None)
        net.nodes[name] = entry
        if stages:
            entry.out = net.nodes[stages[-1]].out
    return links


def _pipeline_stage(net, node_name, stage, path):
    rt = net.rt
    if stage.get("type") == "stream":
        return StreamRoute(net, node_name, stage, path)
    if isinstance(stage.get("config"), dict):
        try:
            graph = GraphRoute(node_name, {"type": "graph", **stage["config"]}, rt, path + ("config",))
        except ActorError:
            raise
        except Exception as exc:
            raise rt.error(ConfigurationError, path + ("config",),
                           f"pipeline graph stage could not be built: {exc}", "7.3") from exc
        return GraphParticipant(net, node_name, graph)
    graph = rt.graphs.get(stage.get("graph", stage.get("name")))
    if graph is None:
        return _Node(net, node_name, Stream(node_name))     # §11.5: warned, passes through
    return GraphParticipant(net, node_name, graph)


class _PipelineEntry(_Node):
    """A pipeline's name as a stream: pushing enters stage 1; `out` is the last stage's stream."""

    def __init__(self, net, name, first):
        super().__init__(net, name, Stream(name))
        self.first = first
        self.feeds = [first.name] if first is not None else []

    def push(self, msg):
        if self.first is not None:
            self.first.push(msg)

    def source_done(self):
        self.sources -= 1
        if self.sources <= 0:
            self.finish()

    def finish(self):
        if self.first is not None:
            self.first.finish()
        else:
            self.out.complete()

    def describe(self):
        return f"{self.name}: pipeline"


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
# [foundation]

# §9.4 unsafe --------------------------------------------------------------------------------
# [foundation]


# =====================================================================================
# §10 CONTEXT
# =====================================================================================

# §10.1 The context section --------------------------------------------------------------
# [foundation]

# §10.3 Reserved context keys -------------------------------------------------------------
# [foundation]

# §10.4 The prompts section ---------------------------------------------------------------
# [foundation]


# =====================================================================================
# §11 VALIDATION RULES
# =====================================================================================

# §11.1 Structural validation -------------------------------------------------------------
# [foundation]

# §11.2 Agent validation -----------------------------------------------------------------
# [foundation]

# §11.3 Route validation -----------------------------------------------------------------
# [foundation]

# §11.4 Merge/split validation -----------------------------------------------------------
# [foundation]

# §11.5 Pipeline validation --------------------------------------------------------------
# [foundation]

# §11.6 Environment variable validation ------------------------------------------------
# [foundation]


# =====================================================================================
# §12 RUNTIME BEHAVIOR
# =====================================================================================

# §12.1 Lifecycle --------------------------------------------------------------------------
# [foundation]

# §12.2 Message flow -----------------------------------------------------------------------
# §12.2.2: order within a stream holds because every stage is a synchronous call made in
# arrival order, and timers fire in (time, sequence) order. Across fan-out each message reaches
# its targets one at a time, in declaration order of the links.
# INTERPRETATION §12.2.2 (Q97): fan-out delivers each message to every target, in link
# declaration order, before the next message.

SOFT_TIMEOUT = 30.0         # §12.2.4: per-message completion bound in single-shot runs, seconds
SOFT_TIMEOUT_TEXT = "Per-message completion exceeded the soft timeout"
DEBOUNCE_SINGLE_SHOT_CAP = 0.05     # §5.3.2 debounce: seconds


def error_reason(exc):
    """The <reason> of "Error: <reason>": the error's own message, never a traceback."""
    if isinstance(exc, ActorError):
        return exc.message
    return str(exc) or type(exc).__name__


def error_category(exc):
    """§12.2.3 metadata.error_type: the §20 category an error carries, else ExecutionError."""
    # INTERPRETATION §12.2.3, §20 (Q94): agent, tool and expression failures are
    # ExecutionErrors (an §20 error raised by the agent keeps its own category); routing
    # failures are StreamRoutingErrors.
    return exc.category if isinstance(exc, ActorError) else "ExecutionError"

# §12.4 Tool command processing in outputs --------------------------------------------------
# [llm]

# §12.5 Routing prefix conventions -------------------------------------------------------
# §12.5 table: the routing prefixes stripped from content leaving through __output__. An entry
# ending in "_" is a family (GOTO_<TARGET>:); the others are fixed tokens.
# INTERPRETATION §12.5 (Q96): on __output__ only, one leading listed token is stripped up to and
# including its first colon, with the blanks after it. A host extends the list by setting
# rt.routing_prefixes (same syntax) before the network is built.
ROUTING_PREFIXES = (
    "GOTO_",
    "ROUTE_",
    "SET_",
    "CMD_",
    "COMMAND_OUTPUT:",
    "DISCOVERY_RESPONSE:",
    "AUTO_SECTIONS_COMPLETE:",
)


def routing_prefix_pattern(extra=None):
    """One compiled regex matching a leading routing token (and the blanks after it)."""
    parts = []
    for prefix in tuple(ROUTING_PREFIXES) + tuple(extra or ()):
        if prefix.endswith("_"):
            parts.append(re.escape(prefix) + r"[^\s:]+:")
        else:
            parts.append(re.escape(prefix))
    return re.compile(r"(?:" + "|".join(parts) + r")[ \t]*")


def strip_routing_prefix(text, extra=None):
    """`text` without one leading §12.5 routing token (a convenience for hosts and tests)."""
    match = routing_prefix_pattern(extra).match(text)
    return text[match.end():] if match else text

# §12.6 Loop detection in stream routes ----------------------------------------------------
# INTERPRETATION §12.6 (Q25): every cycle of static links (publications, merges, splits, the
# default router, switch/bridge-router targets) is rejected at load with a StreamRoutingError,
# limiting operators or not: each message is pushed synchronously, so a cycle is unbounded
# recursion unless an operator happens to stop it. Feedback through __error__ (an error handler
# that fails) is cut at run time by the __error__ sink (see _Sink.push).

def find_stream_cycle(edges):
    """First cycle among (source, target, path) links: ([names...], path of the closing link)."""
    after = {}
    for source, target, path in edges:
        after.setdefault(source, []).append((target, path))
    state = {}      # name -> 1 while on the DFS stack, 2 when done

    def visit(name, trail):
        state[name] = 1
        for target, path in after.get(name, ()):
            if state.get(target) == 1:
                names = [n for n, _p in trail] + [name]
                return names[names.index(target):] + [target], path
            if target not in state:
                found = visit(target, trail + [(name, path)])
                if found:
                    return found
        state[name] = 2
        return None

    for name in list(after):
        if name not in state:
            found = visit(name, [])
            if found:
                return found
    return None


# =====================================================================================
# §13 SECURITY MODEL
# =====================================================================================

# §13.1 Safe and unsafe modes -----------------------------------------------------------
# [foundation]

# §13.2 Sandboxed code execution ---------------------------------------------------------
# [sandbox] compile_code / run_code / compile_expression

# §13.2.1 Restricted built-ins for inline code -------------------------------------------
# [sandbox]

# §13.2.2 Restricted built-ins for expression evaluation ---------------------------------
# [sandbox]

# §13.2.3 Prohibited capabilities ---------------------------------------------------------
# [sandbox]

# §13.3 Filesystem boundaries -----------------------------------------------------------
# [tools]

# §13.5 Shell execution --------------------------------------------------------------------
# [tools]


# =====================================================================================
# §14 ENVIRONMENT VARIABLE INTERPOLATION
# =====================================================================================

# §14.1 Syntax -------------------------------------------------------------------------------
# [foundation]

# §14.3 Type coercion ----------------------------------------------------------------------
# [foundation]


# =====================================================================================
# §15 RESERVED NAMES
# =====================================================================================

# §15.5 Sentinel strings -------------------------------------------------------------------
TEMPLATE_START = "<<<TEMPLATE_START>>>"
TEMPLATE_END = "<<<TEMPLATE_END>>>"
BLOCK_START = "<<<BLOCK_START>>>"
BLOCK_END = "<<<BLOCK_END>>>"
SENTINELS = {"{{": TEMPLATE_START, "}}": TEMPLATE_END, "{%": BLOCK_START, "%}": BLOCK_END}

# [foundation] the rest of §15


# =====================================================================================
# §16 FORBIDDEN PATTERNS
# =====================================================================================
# [foundation]


# =====================================================================================
# HOST -- providers
# =====================================================================================
# [llm] PROVIDERS: openai, anthropic, google over urllib; the offline `fake` provider.


# =====================================================================================
# HOST -- load / Actor / render
# =====================================================================================
# [foundation]


# =====================================================================================
# HOST -- the vector harness
# =====================================================================================
# [foundation]


# =====================================================================================
# HOST -- command line
# =====================================================================================
# [foundation]
