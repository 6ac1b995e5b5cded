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
# One restricted-exec sandbox, parameterised by the §13.2.1 (inline code) or the §13.2.2 (expression)
# built-in table. A restricted __builtins__ dict alone is escapable in many published ways, so four
# layers hold it, and the first two run once, at load time:
#   1. AST check (the §13.2.3 tables): no dunder names, no `_private` attributes, no attribute that leads
#      to frames, code or tracebacks, no str.format, no imports but json, no class/global/nonlocal/yield/
#      async/with/decorators, no use of a prohibited facility's name -> ConfigurationError.
#   2. AST rewrite: + * ** << % and the string methods that pad or repeat go through size guards; a bare
#      `except:` catches only Exception, so the sandbox's own aborts (BaseException) pass through.
#   3. Built-ins: exactly the spec's table; type, locals, print, range, sum, isinstance are wrapped.
#   4. Run-time budget: the rewrite's ticks check the wall-clock deadline at every loop step and
#      function entry and cap the call depth; on POSIX an address-space limit backstops memory.
# Limits hold in unsafe mode too: unsafe mode enables inline code, it does not hand the code the host.
# The hot path (run_code, ExprUnit.__call__) never parses or compiles.
import ast         # noqa: E402  (TODO foundation: hoist to the stdlib imports at the top)
import functools   # noqa: E402
import operator    # noqa: E402

SANDBOX_MAX_ITEMS = 10_000_000     # elements or characters one guarded operation may produce
SANDBOX_MAX_INT_BITS = 1_000_000   # bits of an int one guarded operation may produce (~300k digits)
SANDBOX_MAX_DEPTH = 200            # nested calls of sandboxed functions
SANDBOX_MEMORY_HEADROOM = 1 << 28  # bytes of address space one run may add (POSIX backstop)
CODE_FILENAME = "<inline code>"
EXPRESSION_FILENAME = "<inline expression>"
SANDBOX_FILENAMES = (CODE_FILENAME, EXPRESSION_FILENAME)


class SandboxAbort(BaseException):
    """A limit or a run-time refusal inside the sandbox. BaseException, and bare `except:` is
    rewritten to `except Exception:`, so sandboxed code can never catch it."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class _Rejected(Exception):
    """A construct refused by the AST check: (line inside the code body, what)."""

    def __init__(self, line, what):
        super().__init__(what)
        self.line, self.what = line, what


def _bound_names(tree):
    """Every name the code binds itself (assignment, def, parameter, import alias, except, match)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return bound


def _is_dunder(name):
    return name.startswith("__")


def _attribute_refusal(attr):
    """Why an attribute name is refused (None when it is fine). Names arrive NFKC-normalised."""
    if attr.startswith("_"):
        return f"access to the private or special attribute '{attr}'"
    if attr in SANDBOX_FORBIDDEN_ATTRIBUTES or attr.startswith(SANDBOX_FORBIDDEN_ATTRIBUTE_PREFIXES):
        return f"access to the attribute '{attr}'"
    return None


def _construct_refusal(node, kind, prohibited):
    """§13.2.3: why one AST node is refused in a sandbox of `kind` ("code" or "expression")."""
    match node:
        case ast.Import(names=names):
            bad = [a.name for a in names if a.name != "json"]
            return f"import of '{bad[0]}' (only json may be imported)" if bad else None
        case ast.ImportFrom(module=module, level=level, names=names):
            if module != "json" or level:
                return f"import from '{'.' * level}{module or ''}' (only json may be imported)"
            bad = [a.name for a in names if a.name not in ("loads", "dumps", "JSONDecodeError")]
            return f"import of 'json.{bad[0]}'" if bad else None
        case ast.ClassDef():
            return "a class definition (class creation hooks lead out of the sandbox)"
        case ast.Global() | ast.Nonlocal():
            return "a global or nonlocal statement"
        case ast.Yield() | ast.YieldFrom():
            return "a generator function (yield)"
        case ast.AsyncFunctionDef() | ast.Await() | ast.AsyncFor() | ast.AsyncWith():
            return "asynchronous code"
        case ast.With():
            return "a with statement"
        case ast.FunctionDef(decorator_list=decorators) if decorators:
            return "a decorator"
        case ast.FunctionDef(name=name) if _is_dunder(name):
            return f"the special name '{name}'"
        case ast.Name(id=name) if _is_dunder(name):
            return f"the special name '{name}'"
        case ast.Name(id=name, ctx=ast.Load()) if name in prohibited:
            return f"the prohibited facility '{name}' ({prohibited[name]})"
        case ast.Attribute(attr=attr):
            return _attribute_refusal(attr)
        case ast.arg(arg=name) | ast.ExceptHandler(name=name) | ast.alias(asname=name) \
                | ast.MatchAs(name=name) | ast.MatchStar(name=name) if name and _is_dunder(name):
            return f"the special name '{name}'"
        case ast.MatchClass(kwd_attrs=attrs):
            return next(filter(None, map(_attribute_refusal, attrs)), None)
        case ast.MatchMapping(rest=rest) if rest and _is_dunder(rest):
            return f"the special name '{rest}'"
        case ast.keyword(arg=name) if name and _is_dunder(name):
            return f"the special keyword '{name}'"
    return None


def _check_tree(tree, kind, table):
    """Layer 1: refuse the first forbidden construct, with its line inside the code body."""
    prohibited = {name: capability for capability, names in SANDBOX_PROHIBITED_CAPABILITIES.items()
                  for name in names if name not in table}
    for name in prohibited.keys() & _bound_names(tree):
        del prohibited[name]   # a variable the code binds itself (`id = 3`) is not the facility
    for node in ast.walk(tree):
        reason = _construct_refusal(node, kind, prohibited)
        if reason:
            raise _Rejected(getattr(node, "lineno", 1), reason)


def _guard_call(name, node, *args):
    return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), list(args), []), node)


def _tick(name, node):
    return ast.copy_location(ast.Expr(_guard_call(name, node)), node)


class _SandboxRewriter(ast.NodeTransformer):
    """Layer 2: deadline ticks in loops and calls; size-sensitive operations through the guards."""

    def visit_While(self, node):
        self.generic_visit(node)
        node.body.insert(0, _tick("__sb_loop__", node))
        return node

    visit_For = visit_While

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs.insert(0, _guard_call("__sb_loop__", node.iter))
        return node

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.body.insert(0, _tick("__sb_enter__", node))
        return node

    def visit_Lambda(self, node):
        self.generic_visit(node)
        node.body = ast.copy_location(
            ast.BoolOp(ast.And(), [_guard_call("__sb_enter__", node.body), node.body]), node.body)
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        symbol = _GUARDED_OPERATORS.get(type(node.op))
        if symbol is None:
            return node
        return _guard_call("__sb_binop__", node, ast.Constant(symbol), node.left, node.right)

    def visit_AugAssign(self, node):
        self.generic_visit(node)
        symbol = _GUARDED_OPERATORS.get(type(node.op))
        if symbol is None:
            return node
        target = node.target
        if isinstance(target, ast.Name):
            value = _guard_call("__sb_inplace__", node, ast.Constant(symbol),
                                ast.Name(target.id, ast.Load()), node.value)
            return ast.copy_location(ast.Assign([target], value), node)
        if isinstance(target, ast.Subscript):
            key = target.slice
            if isinstance(key, ast.Slice):
                key = _guard_call("__sb_slice__", key, *(part or ast.Constant(None) for part in
                                                         (key.lower, key.upper, key.step)))
            call = _guard_call("__sb_aug_item__", node, target.value, key, ast.Constant(symbol),
                               node.value)
        else:
            call = _guard_call("__sb_aug_attr__", node, target.value, ast.Constant(target.attr),
                               ast.Constant(symbol), node.value)
        return ast.copy_location(ast.Expr(call), node)

    def __init__(self, bound):
        self.bound = bound   # names the code binds itself: `str` rebound is not the built-in

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Name) and func.id == "str" and "str" not in self.bound:
            func.id = "__sb_str__"
        if isinstance(func, ast.Attribute) and func.attr in _GUARDED_METHODS:
            call = _guard_call("__sb_method__", node, func.value, ast.Constant(func.attr), *node.args)
            call.keywords = node.keywords
            return call
        return node

    def visit_FormattedValue(self, node):
        self.generic_visit(node)
        node.value = _guard_call("__sb_format__", node, node.value, ast.Constant(node.conversion),
                                 node.format_spec or ast.Constant(""))
        node.conversion, node.format_spec = -1, None
        return node

    def visit_ExceptHandler(self, node):
        self.generic_visit(node)
        if node.type is None:
            node.type = ast.copy_location(ast.Name("__sb_Exception__", ast.Load()), node)
        return node

    def visit_Import(self, node):
        # `import json [as j]` binds the §4.5.2 facility (Q70 (a)); no import machinery is exposed.
        return [ast.copy_location(ast.Assign([ast.Name(a.asname or a.name, ast.Store())],
                                             ast.Name("__sb_json__", ast.Load())), node)
                for a in node.names]

    def visit_ImportFrom(self, node):
        return [ast.copy_location(ast.Assign(
            [ast.Name(a.asname or a.name, ast.Store())],
            ast.Attribute(ast.Name("__sb_json__", ast.Load()), a.name, ast.Load())), node)
            for a in node.names]


def _sandbox_compile(source, mode, kind, table, filename):
    """Parse, check (layer 1), rewrite (layer 2) and compile; raises SyntaxError or _Rejected."""
    if not isinstance(source, str):
        raise _Rejected(1, f"code of type {type(source).__name__} (a string is required)")
    tree = ast.parse(source, filename=filename, mode=mode)
    _check_tree(tree, kind, table)
    tree = ast.fix_missing_locations(_SandboxRewriter(_bound_names(tree)).visit(tree))
    return tree, compile(tree, filename, mode, dont_inherit=True)


def _configuration_refusal(exc, rt, path, section, what):
    """A located ConfigurationError for a SyntaxError or _Rejected; `.code_line` is the body line."""
    if isinstance(exc, SyntaxError):
        line, text = exc.lineno or 1, f"syntax error: {exc.msg}"
    else:
        line, text = exc.line, f"{exc.what} is not allowed in the sandbox"
    message = f"{what}, line {line}: {text}"
    if rt is not None and path is not None:
        err = rt.error(ConfigurationError, path, message, section)
    else:
        err = ConfigurationError(message, path=path_str(path) if path else None, section=section)
    err.code_line = line
    return err


# Layer 4: the run-time budget ---------------------------------------------------------------
# INTERPRETATION §13.2 (issue 4): limits are ticks, not a trace function. CPython 3.11 sends no
# `line` event for `while True: pass`, and an exception raised from a trace function switches
# tracing off while `finally` blocks still run; so the rewrite (layer 2) puts a deadline check at the
# top of every loop body, comprehension step and function body, and the function-entry check also
# caps the depth of nested sandboxed calls.
class _Budget:
    """Wall-clock deadline of one sandboxed call."""

    __slots__ = ("timeout", "deadline")

    def __init__(self, timeout):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout


# Which budget the running sandboxed call has, per thread (scratch for one call, not Actor state).
_SANDBOX_LOCAL = threading.local()
# The address-space cap is process-wide, so sandboxed runs take turns (a process resource).
_SANDBOX_TURN = threading.RLock()


def guard_loop():
    """Inserted at every loop step: refuse to go on past the deadline. Returns True (comprehension if)."""
    budget = getattr(_SANDBOX_LOCAL, "budget", None)
    if budget is None:   # a sandbox-made function called by the host outside any sandboxed run
        raise ExecutionError("sandboxed code called outside its sandbox", section="13.2")
    if time.monotonic() > budget.deadline:
        raise SandboxAbort(f"time limit of {budget.timeout:g} s exceeded")
    return True


def guard_enter():
    """Inserted at every function and lambda entry: the deadline, then the depth of sandboxed calls."""
    guard_loop()
    frame, depth = sys._getframe(1), 0
    while frame is not None and depth <= SANDBOX_MAX_DEPTH:
        if frame.f_code.co_filename in SANDBOX_FILENAMES:
            depth += 1
        frame = frame.f_back
    if depth > SANDBOX_MAX_DEPTH:
        raise SandboxAbort(f"call depth exceeds {SANDBOX_MAX_DEPTH}")
    return True


def _address_space():
    """Current virtual size of this process in bytes, or None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _MemoryCap:
    """POSIX backstop: RLIMIT_AS = current size + headroom while sandboxed code runs."""

    def __enter__(self):
        self.saved = None
        try:
            import resource
        except ImportError:
            return self
        current = _address_space()
        if current is None:
            return self
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = current + SANDBOX_MEMORY_HEADROOM
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft != resource.RLIM_INFINITY and soft <= limit:
            return self   # already capped (nested run, or a stricter host limit)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        except (ValueError, OSError):
            return self
        self.saved = (resource, soft, hard)
        return self

    def __exit__(self, *exc):
        if self.saved:
            resource, soft, hard = self.saved
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        return False


def _sandbox_line(tb, filename):
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _run_sandboxed(thunk, timeout, label, filename):
    """Run `thunk` under a fresh budget; every failure becomes one ExecutionError (§12.2.3)."""
    with _SANDBOX_TURN, _MemoryCap():
        previous = getattr(_SANDBOX_LOCAL, "budget", None)
        _SANDBOX_LOCAL.budget = _Budget(timeout)
        try:
            return thunk()
        except SandboxAbort as abort:
            failure, section = abort.reason, "13.2.3"
        except MemoryError:
            failure, section = "memory limit exceeded", "13.2.3"
        except RecursionError:
            failure, section = "recursion limit exceeded", "13.2.3"
        except Exception as exc:   # the code's own error: reported, never fatal to the Actor
            line = _sandbox_line(exc.__traceback__, filename)
            where = f"line {line}: " if line else ""
            failure, section = f"{where}{type(exc).__name__}: {str(exc)[:500]}", "13.2"
        finally:
            _SANDBOX_LOCAL.budget = previous
    raise ExecutionError(f"{label}: {failure}", section=section)


# §13.2 entry points ------------------------------------------------------------------------
class CodeUnit:
    """An inline-code body checked and compiled once at load (§4.5.2, §13.2.1)."""

    __slots__ = ("source", "code", "label", "builtins")

    def __init__(self, source, code, label):
        self.source, self.code, self.label = source, code, label
        self.builtins = {**INLINE_CODE_BUILTINS, **_SANDBOX_GUARDS}


class ExprUnit:
    """An inline lambda expression checked and compiled once at load (§13.2.2); call it."""

    __slots__ = ("source", "fn", "label", "nparams")

    def __init__(self, source, fn, label, nparams):
        self.source, self.fn, self.label, self.nparams = source, fn, label, nparams

    def __call__(self, *args, timeout=1.0):
        return _run_sandboxed(lambda: self.fn(*args), timeout, self.label, EXPRESSION_FILENAME)


def compile_code(source, *, rt=None, path=None):
    """§13.2, §13.2.1: check and compile an inline-code body once; returns a CodeUnit.

    A refused construct or a syntax error is a located ConfigurationError naming the line inside
    the body (also kept as `err.code_line`).
    """
    label = f"inline code {path_str(path)}" if path else "inline code"
    try:
        _, code = _sandbox_compile(source, "exec", "code", INLINE_CODE_BUILTINS, CODE_FILENAME)
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, rt, path, "13.2.1", label) from None
    return CodeUnit(source, code, label)


def run_code(unit, variables, *, timeout=1.0):
    """§4.5.2, §13.2.1: run a CodeUnit with `variables` as its namespace; returns the final namespace.

    `variables` usually holds input_data, message, context (by reference) and result=None. Any
    violation, error, timeout or resource limit raises ExecutionError; the next run is unaffected.
    """
    namespace = dict(variables)
    namespace["__builtins__"] = unit.builtins
    _run_sandboxed(lambda: exec(unit.code, namespace), timeout, unit.label, CODE_FILENAME)
    del namespace["__builtins__"]
    return namespace


def _lambda_accepts(node, nparams):
    args = node.args
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    return required <= nparams and (nparams <= positional or args.vararg is not None) \
        and all(default is not None for default in args.kw_defaults)


def compile_expression(source, *, nparams=1, rt=None, path=None):
    """§13.2.2: check and compile `lambda ...: expr` once; returns an ExprUnit, called as unit(*args).

    The lambda must accept `nparams` positional arguments (transform fn: 1, custom_predicate: 2).
    """
    label = f"inline expression {path_str(path)}" if path else "inline expression"
    try:
        tree, code = _sandbox_compile(source.strip() if isinstance(source, str) else source,
                                      "eval", "expression", EXPRESSION_BUILTINS, EXPRESSION_FILENAME)
        if not isinstance(tree.body, ast.Lambda) or not _lambda_accepts(tree.body, nparams):
            raise _Rejected(1, f"anything but a lambda of {nparams} parameter(s)")
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, rt, path, "13.2.2", label) from None
    namespace = {"__builtins__": {**EXPRESSION_BUILTINS, **_SANDBOX_GUARDS}}
    fn = _run_sandboxed(lambda: eval(code, namespace), 1.0, label, EXPRESSION_FILENAME)
    return ExprUnit(source, fn, label, nparams)


@functools.lru_cache(maxsize=512)   # a pure cache of compiled text; no Actor state lives here
def _compile_expression_text(source):
    return _sandbox_compile(source.strip(), "eval", "expression", EXPRESSION_BUILTINS,
                            EXPRESSION_FILENAME)[1]


def eval_expression_text(source, names, timeout=1.0):
    """§9.2 SIMPLE pre-pass: evaluate a bare expression in the §13.2.2 sandbox with `names` as variables.

    Refused constructs raise ConfigurationError, run-time failures ExecutionError.
    """
    try:
        code = _compile_expression_text(source)
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, None, None, "13.2.2", "inline expression") from None
    namespace = {key: value for key, value in names.items() if not _is_dunder(str(key))}
    namespace["__builtins__"] = {**EXPRESSION_BUILTINS, **_SANDBOX_GUARDS}
    return _run_sandboxed(lambda: eval(code, namespace), timeout, "inline expression",
                          EXPRESSION_FILENAME)

# §13.2.1 Restricted built-ins for inline code -------------------------------------------
class SandboxType:
    """What the sandbox's type() returns for a class outside SANDBOX_INERT_TYPES: it compares and
    prints like the class, and works in isinstance(), but cannot be called or walked."""

    __slots__ = ("_cls",)

    def __init__(self, cls):
        self._cls = cls

    def __eq__(self, other):
        return isinstance(other, SandboxType) and other._cls is self._cls

    def __hash__(self):
        return hash(self._cls)

    def __repr__(self):
        return f"<class '{self._cls.__name__}'>"


def _unwrap_classinfo(spec):
    if isinstance(spec, SandboxType):
        return spec._cls
    if isinstance(spec, tuple):
        return tuple(_unwrap_classinfo(item) for item in spec)
    return spec


def builtin_type(*args):
    """§13.2.1 type: the one-argument form only; three arguments would create a class."""
    if len(args) != 1:
        raise SandboxAbort("type() with three arguments (class creation) is refused")
    cls = type(args[0])
    return cls if cls in SANDBOX_INERT_TYPES else SandboxType(cls)


def builtin_isinstance(obj, classinfo):
    """§13.2.1 isinstance, accepting what the sandbox's type() returns."""
    return isinstance(obj, _unwrap_classinfo(classinfo))


def builtin_locals():
    """§13.2.1 locals: a copy of the caller's variables, without __builtins__ or guard names."""
    frame = sys._getframe(1)
    if frame.f_code.co_filename not in SANDBOX_FILENAMES:
        return {}
    return {key: value for key, value in frame.f_locals.items() if not _is_dunder(key)}


def builtin_print(*values, sep=" ", end="\n", **_ignored):
    """§13.2.1 print: diagnostic output goes to stderr, never to stdout or the Actor's output."""
    sep = sep if isinstance(sep, str) else " "
    end = end if isinstance(end, str) else "\n"
    for value in values:
        check_rendering(value)
    sys.stderr.write(sep.join(str(value) for value in values) + end)


def builtin_range(*args):
    """§13.2.1 range, refusing more than SANDBOX_MAX_ITEMS steps: C-level consumers such as
    sum(range(10**12)) never reach the line budget."""
    span = range(*args)
    try:
        size = len(span)
    except OverflowError:
        size = SANDBOX_MAX_ITEMS + 1
    if size > SANDBOX_MAX_ITEMS:
        raise SandboxAbort(f"range of more than {SANDBOX_MAX_ITEMS} items")
    return span


def builtin_sum(iterable, /, start=0):
    """§13.2.1/§13.2.2 sum; sequence concatenation goes through the size guard."""
    if isinstance(start, (str, bytes, list, tuple)):
        total = start
        for item in iterable:
            total = guard_binop("+", total, item)
        return total
    return sum(iterable, start)


class JsonFacility:
    """§4.5.2 item 2: the `json` name -- loads, dumps and JSONDecodeError, nothing else.

    Not the json module, whose attributes (decoder, scanner, codecs...) lead elsewhere.
    """

    __slots__ = ()
    JSONDecodeError = json.JSONDecodeError

    @staticmethod
    def loads(text):
        return json.loads(text)

    @staticmethod
    def dumps(value, *, indent=None, sort_keys=False, ensure_ascii=True, separators=None):
        if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
            raise SandboxAbort("json.dumps indent larger than 64")
        check_rendering(value)
        return json.dumps(value, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                          separators=separators)

    def __repr__(self):
        return "<json facility: loads, dumps, JSONDecodeError>"


SANDBOX_JSON = JsonFacility()

# §13.2.1 table: the built-ins of inline code -- these and no others. Rows in the spec's order.
INLINE_CODE_BUILTINS = {
    # Type constructors
    "bool": bool, "dict": dict, "float": float, "int": int, "list": list, "set": set, "str": str,
    "tuple": tuple,
    # Iteration / aggregation
    "abs": abs, "all": all, "any": any, "enumerate": enumerate, "len": len, "max": max, "min": min,
    "range": builtin_range, "reversed": reversed, "round": round, "sorted": sorted, "sum": builtin_sum,
    "zip": zip,
    # Type inspection
    "isinstance": builtin_isinstance, "type": builtin_type,
    # Local-frame access
    "locals": builtin_locals,
    # Diagnostic output
    "print": builtin_print,
    # Error categories
    "ValueError": ValueError, "IndexError": IndexError, "KeyError": KeyError, "TypeError": TypeError,
    # Module access
    "json": SANDBOX_JSON,
}

# §13.2.2 Restricted built-ins for expression evaluation ---------------------------------
# §13.2.2 table: the built-ins of inline expressions -- these and no others. Rows in the spec's order.
EXPRESSION_BUILTINS = {
    # Type constructors
    "bool": bool, "dict": dict, "float": float, "int": int, "list": list, "set": set, "str": str,
    "tuple": tuple,
    # Numeric / iteration utilities
    "abs": abs, "all": all, "any": any, "len": len, "max": max, "min": min, "round": round,
    "sum": builtin_sum,
}

# §13.2.3 Prohibited capabilities ---------------------------------------------------------
# INTERPRETATION §13.2.3 (Q71): refused in both places -- what the AST shows is refused at load
# (ConfigurationError with the body line); limits and type() with three arguments at invocation
# (ExecutionError, which reaches __error__).
# §13.2.3 table: prohibited capability -> the names that would reach it. A name here is refused at
# load unless the sandbox's own table lists it (print, type, locals in inline code) or the code binds
# that name itself (`id = 3`).
SANDBOX_PROHIBITED_CAPABILITIES = {
    "arbitrary I/O": ("open", "input", "print", "breakpoint", "help", "exit", "quit", "memoryview"),
    "dynamic evaluation or compilation": ("eval", "exec", "compile"),
    "introspection": ("globals", "locals", "vars", "dir", "type", "getattr", "setattr", "delattr",
                      "hasattr", "id", "object", "super", "classmethod", "staticmethod", "property"),
    "dynamic import": ("importlib",),
    "subprocess spawning or signaling": ("os", "sys", "subprocess", "signal"),
}

# Attributes that lead to frames, code objects, tracebacks, class hierarchies or format-string
# attribute walks ("{0.__class__}".format(x)). Any `_x` attribute is refused as well.
# INTERPRETATION §13.2.3: str.format and format_map are refused outright (f-strings remain, and
# their fields are checked like any other expression), because a format string is data and can walk
# attributes the AST never shows.
SANDBOX_FORBIDDEN_ATTRIBUTES = frozenset({
    "format", "format_map", "mro", "with_traceback", "gi_frame", "gi_code", "cr_frame", "ag_frame",
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame", "tb_next", "co_code",
    "func_globals", "func_code",
})
SANDBOX_FORBIDDEN_ATTRIBUTE_PREFIXES = ("gi_", "cr_", "ag_", "f_", "tb_", "co_", "func_", "im_")

# Classes the sandbox's type() hands out as themselves; any other class comes back as SandboxType,
# so type(type(0)) cannot create classes and type(range(1)) cannot dodge the range limit.
SANDBOX_INERT_TYPES = frozenset({
    bool, int, float, complex, str, list, tuple, dict, set, frozenset, type(None),
    ValueError, IndexError, KeyError, TypeError, json.JSONDecodeError,
})

_GUARDED_OPERATORS = {ast.Add: "+", ast.Mult: "*", ast.Pow: "**", ast.LShift: "<<", ast.Mod: "%"}
_BINARY = {"+": operator.add, "*": operator.mul, "**": operator.pow, "<<": operator.lshift,
           "%": operator.mod}
_INPLACE = {"+": operator.iadd, "*": operator.imul, "**": operator.ipow, "<<": operator.ilshift,
            "%": operator.imod}
_SIZED = (str, bytes, list, tuple)
_WIDTH_RE = re.compile(r"\d+")


def _refuse_size(what):
    raise SandboxAbort(f"{what} exceeds the sandbox size limit")


def _check_operands(symbol, left, right):
    """Refuse + * ** << % whose result would pass SANDBOX_MAX_ITEMS / SANDBOX_MAX_INT_BITS."""
    ints = isinstance(left, int) and isinstance(right, int)
    if symbol == "+":
        if isinstance(left, _SIZED) and isinstance(right, _SIZED) \
                and len(left) + len(right) > SANDBOX_MAX_ITEMS:
            _refuse_size("concatenation")
    elif symbol == "*":
        if ints:
            if left.bit_length() + right.bit_length() > SANDBOX_MAX_INT_BITS:
                _refuse_size("integer product")
        else:
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, _SIZED) and isinstance(count, int) \
                    and len(seq) * max(count, 0) > SANDBOX_MAX_ITEMS:
                _refuse_size("repetition")
    elif symbol == "**":
        if ints and right > 0 and abs(left) > 1 \
                and (left.bit_length() - 1) * right > SANDBOX_MAX_INT_BITS:
            _refuse_size("power")
    elif symbol == "<<":
        if ints and left and right > 0 and left.bit_length() + right > SANDBOX_MAX_INT_BITS:
            _refuse_size("shift")
    elif symbol == "%" and isinstance(left, str):
        _check_printf(left, right)
        check_rendering(right)


def _check_printf(fmt, args):
    """'%*d' % (10**10, 1) and '%9999999999d' % 1 pad without bound."""
    widths = [int(digits) for digits in _WIDTH_RE.findall(fmt)]
    if "*" in fmt:
        values = args if isinstance(args, tuple) else (args,)
        widths += [value for value in values if isinstance(value, int)]
    if any(width > SANDBOX_MAX_ITEMS for width in widths):
        _refuse_size("%-format width")


def guard_binop(symbol, left, right):
    _check_operands(symbol, left, right)
    return _BINARY[symbol](left, right)


def guard_inplace(symbol, left, right):
    _check_operands(symbol, left, right)
    return _INPLACE[symbol](left, right)


def guard_aug_item(container, key, symbol, value):
    container[key] = guard_inplace(symbol, container[key], value)


def guard_aug_attr(obj, name, symbol, value):
    # `name` passed the layer-1 attribute check at load.
    setattr(obj, name, guard_inplace(symbol, getattr(obj, name), value))


_CONTAINERS = (str, bytes, list, tuple, dict, set, frozenset)


def _text_weight(value, memo):
    """Roughly how many characters str(value) has: a container counts its items plus the weight of
    each child, shared children computed once (memo by id), cycles counted once."""
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, (str, bytes)):
        return len(value)
    memo[key] = 1
    weight = len(value) + 1
    children = itertools.chain(value.keys(), value.values()) if isinstance(value, dict) else value
    for child in children:
        if isinstance(child, _CONTAINERS):
            weight += _text_weight(child, memo)
            if weight > SANDBOX_MAX_ITEMS:
                break
    memo[key] = weight
    return weight


def check_rendering(value):
    """Refuse to turn into text a structure whose text would pass the limit. Aliasing makes tiny
    structures print huge: x = [0] * 10**6; str([x] * 10**6) is 10**12 characters."""
    if isinstance(value, _CONTAINERS[2:]) and _text_weight(value, {}) > SANDBOX_MAX_ITEMS:
        _refuse_size("text of a structure")


def guard_str(*args, **kwargs):
    """str(x) as written in the code: the rendering check first."""
    if args:
        check_rendering(args[0])
    return str(*args, **kwargs)


def guard_format(value, conversion, spec):
    """f"{x!r:>{n}}": refuse pad widths and structures past the limit, then format as Python would."""
    check_rendering(value)
    if conversion == ord("r"):
        value = repr(value)
    elif conversion == ord("s"):
        value = str(value)
    elif conversion == ord("a"):
        value = ascii(value)
    if any(int(digits) > SANDBOX_MAX_ITEMS for digits in _WIDTH_RE.findall(spec)):
        _refuse_size("format width")
    return format(value, spec)


def _method_growth(obj, name, args, kwargs):
    """Size estimate of what a padding/repeating method would build, or 0 when not applicable."""
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return width if isinstance(width, int) else 0
    if name == "expandtabs" and isinstance(obj, (str, bytes)):
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(obj) + obj.count("\t" if isinstance(obj, str) else b"\t") * size \
            if isinstance(size, int) else 0
    if name == "replace" and isinstance(obj, (str, bytes)) and len(args) >= 2 \
            and isinstance(args[0], type(obj)) and isinstance(args[1], type(obj)):
        hits = obj.count(args[0]) if args[0] else len(obj) + 1
        return len(obj) + hits * max(len(args[1]) - len(args[0]), 0)
    if name == "join" and isinstance(obj, (str, bytes)) and args and isinstance(args[0], list):
        items = args[0]
        return len(obj) * max(len(items) - 1, 0) + sum(len(x) for x in items if isinstance(x, _SIZED))
    if name == "extend" and isinstance(obj, list) and args and isinstance(args[0], _SIZED):
        return len(obj) + len(args[0])
    if name == "to_bytes" and isinstance(obj, int):
        length = args[0] if args else kwargs.get("length", 1)
        return length if isinstance(length, int) else 0
    if name == "translate" and isinstance(obj, str) and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return len(obj) * longest
    return 0


def guard_method(obj, name, *args, **kwargs):
    """obj.name(*args): the methods in _GUARDED_METHODS, with their output size checked first."""
    if name == "join" and args and not isinstance(args[0], (list, tuple, str)):
        args = (list(args[0]),) + args[1:]   # materialise a generator once, under the line budget
    if _method_growth(obj, name, args, kwargs) > SANDBOX_MAX_ITEMS:
        _refuse_size(f"{name}() result")
    return getattr(obj, name)(*args, **kwargs)   # `name` passed the layer-1 attribute check


_GUARDED_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "replace", "join",
                              "extend", "to_bytes", "translate"})

# Names the rewritten code calls; dunder names, so sandboxed source can never spell them.
_SANDBOX_GUARDS = {
    "__sb_loop__": guard_loop, "__sb_enter__": guard_enter, "__sb_binop__": guard_binop, "__sb_inplace__": guard_inplace, "__sb_aug_item__": guard_aug_item,
    "__sb_aug_attr__": guard_aug_attr, "__sb_method__": guard_method, "__sb_format__": guard_format,
    "__sb_str__": guard_str,
    "__sb_slice__": slice, "__sb_Exception__": Exception, "__sb_json__": SANDBOX_JSON,
}

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
