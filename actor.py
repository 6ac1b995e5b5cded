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
