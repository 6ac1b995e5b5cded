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


def trim_history(messages, max_messages, max_chars):
    """§6.2.2.1: the newest `max_messages` messages whose contents total at most `max_chars`."""
    history = messages[-max_messages:] if max_messages > 0 else []
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


def agent_node_context(node, state):
    """§6.2.2 item 2: the context mapping an agent node hands to its agent."""
    metadata = state["metadata"]
    nested = metadata.get("context")
    # INTERPRETATION §6.2.2 (Q33): a top-level metadata key wins over a nested context key.
    ctx = dict(nested) if isinstance(nested, dict) else {}
    ctx.update(metadata)
    messages = state["messages"]
    history = trim_history(messages, node.max_history_messages, node.max_history_chars)
    ctx["graph_state"] = {"messages": history, "metadata": metadata,
                          "current_node": state["current_node"],
                          "execution_count": state["execution_count"], "error": state["error"]}
    ctx["conversation_history"] = history
    ctx["full_context"] = True
    if len(history) < len(messages):
        ctx["_history_truncated"] = True
        ctx["_history_original_length"] = len(messages)
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
    # INTERPRETATION §6.2.2 (Q44): raised errors are retried; `timeout` bounds each attempt; a
    # failed attempt's context changes are dropped; after the last one the run fails (state.error).
    attempt = 0
    while True:
        ctx = agent_node_context(node, state)
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

# Schemas "known to the host" (§6.3.3): this host knows only its own default state.
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
    any other content is appended to messages as a user message (Q34)."""
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
        if node_type not in NODE_TYPES:
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
# [streams] §12.2.2 ordering, §12.2.3 error handling, §12.2.4 timeouts

# §12.4 Tool command processing in outputs --------------------------------------------------
# [llm]

# §12.5 Routing prefix conventions -------------------------------------------------------
# [streams]

# §12.6 Loop detection in stream routes ----------------------------------------------------
# [streams]


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
