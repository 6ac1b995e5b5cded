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
# Phase A is always the Jinja2 dialect, whatever template_engine says:
# INTERPRETATION §9.2 vs §8.1 (Q61): Phase A uses JINJA2 for every engine; template_engine
# governs Phases B and C, because every Phase A construct §8.1 defines (for, if, set, raw,
# filters, {# #}) is Jinja syntax with no Mustache or format-string counterpart.
import functools   # memo of the compiled JINJA2/MUSTACHE templates (§9.2)
import string      # string.Formatter, the SIMPLE engine's second pass (§9.2)

TEMPLATE_MARKERS = ("{{", "{%", "{#")


def has_template_syntax(text):
    """§8.2 step 1: does the raw text contain {{, {% or {# at all?"""
    return isinstance(text, str) and any(mark in text for mark in TEMPLATE_MARKERS)


def scan_tags(text, pos=0):
    """Yield (start, end, kind) for every {{ }}, {% %} and {# #} tag from `pos`, in order.

    Quoted strings and bracket nesting inside a tag are skipped, so `{{ {'a': {'b': 1}} }}` is
    one tag. An unclosed tag ends the scan (the renderer reports it).
    """
    n = len(text)
    while True:
        start = text.find("{", pos)
        while start >= 0 and text[start + 1:start + 2] not in ("{", "%", "#"):
            start = text.find("{", start + 1)
        if start < 0 or start + 1 >= n:
            return
        kind = text[start:start + 2]
        if kind == "{#":
            end = text.find("#}", start + 2)
            if end < 0:
                return
            pos = end + 2
            yield start, pos, kind
            continue
        close = "}}" if kind == "{{" else "%}"
        i, depth, quote = start + 2, 0, None
        while i < n:
            ch = text[i]
            if quote:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif depth == 0 and text.startswith(close, i):
                break
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(0, depth - 1)
            i += 1
        if i >= n:
            return
        pos = i + 2
        yield start, pos, kind

# §8.2 Document-level rendering lifecycle -----------------------------------------------
def check_sentinels(text, file=None):
    """§15.5: the four sentinels are the loader's own and MUST NOT appear in a source document."""
    for sentinel in SENTINELS.values():
        if sentinel in text:
            line = text.count("\n", 0, text.index(sentinel)) + 1
            raise ConfigurationError(f"reserved sentinel {sentinel} in the source document",
                                     section="15.5", file=file, line=line)


def render_document(text, render_context=None, engine="JINJA2", *, file=None):
    """§8.2 steps 1-2: the raw text of one document -> the text to parse as YAML (Phase A).

    Call it on every raw document: it checks the §15.5 sentinels, returns text without template
    syntax unchanged (step 1), protects runtime fields and template bodies (§8.4), then renders
    the rest with the JINJA2 dialect (Q61) against the §8.3 built-ins plus `render_context`
    (Q50 (d)/(e)). Comments are dropped and {% raw %} honoured by the dialect itself. A render
    failure is a ConfigurationError located at the template line (§8.12). After parsing, call
    restore_sentinels() on the data (§8.2 step 4). `engine` is accepted for symmetry only.
    """
    check_sentinels(text, file)
    if not has_template_syntax(text):
        return text
    text = protect_runtime_fields(text, render_context, file=file)
    if not has_template_syntax(text):
        return text
    try:
        return render_jinja2(text, dict(render_context or {}))
    except TemplateError as exc:
        raise ConfigurationError(f"Phase A rendering failed: {exc.message}", section="8.12",
                                 file=file, line=exc.line) from exc

# §8.3 Template variables, filters and built-ins ------------------------------------------
# §8.3 table 1: built-in callables in every rendering namespace (Phases A, B and C).
BUILTINS = {
    "range": range, "len": len, "enumerate": enumerate, "zip": zip, "min": min, "max": max,
    "sum": sum, "abs": abs, "round": round,
    "int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict,
}


def _undefined(value):
    return jinja2 is not None and isinstance(value, jinja2.Undefined)


def filter_tojson(value, indent=None):
    """§8.3 tojson: one line of plain JSON (Q58 (c): no HTML escaping), a valid YAML flow scalar."""
    if _undefined(value):
        str(value)  # raises the undefined-name error
    try:
        return json.dumps(value, ensure_ascii=False, indent=indent)
    except (TypeError, ValueError) as exc:
        raise TemplateError(f"tojson: {exc}", section="8.3") from exc


def filter_indent(value, width=4, first=False, blank=False):
    """§8.3 indent(n): Q57 (b) as Jinja2 does -- every line but the first (first=True adds it),
    blank lines untouched unless blank=True -- the form that fits a YAML block scalar."""
    pad = " " * width if isinstance(width, int) else str(width)
    lines = str(value).split("\n")
    out = []
    for i, line in enumerate(lines):
        if (i > 0 or first) and (line or blank):
            line = pad + line
        out.append(line)
    return "\n".join(out)


def _item_attr(item, attr):
    """Jinja-style attribute lookup on a list item: mapping key, then a dotted path."""
    for part in str(attr).split("."):
        if isinstance(item, dict):
            item = item.get(part)
        elif isinstance(item, (list, tuple)) and part.isdigit():
            item = item[int(part)] if int(part) < len(item) else None
        else:
            item = None
    return item


def filter_sum(items, attribute=None, start=0):
    """§8.3 sum(attribute): sum of a numeric list, or of one attribute over a list of mappings."""
    values = items if attribute is None else (_item_attr(it, attribute) for it in items)
    return sum(values, start)


SELECT_OPERATORS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b, "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b,
}


def filter_selectattr(items, attr, op=None, value=None):
    """§8.3 selectattr(attr, op, value): keep items whose attribute satisfies op (==, !=, >, <,
    >=, <=; Jinja's names eq, ne, gt, lt, ge, le too); with no op, a truthy attribute."""
    op = {"eq": "==", "equalto": "==", "ne": "!=", "gt": ">", "greaterthan": ">", "lt": "<",
          "lessthan": "<", "ge": ">=", "le": "<="}.get(op, op)
    if op is not None and op not in SELECT_OPERATORS:
        raise TemplateError(f"selectattr: unknown operator {op!r}", section="8.3")
    out = []
    for item in items:
        got = _item_attr(item, attr)
        if op is None:
            keep = bool(got)
        else:
            try:
                keep = SELECT_OPERATORS[op](got, value)
            except TypeError:
                keep = False   # None > 3 and the like: no match rather than a crash
        if keep:
            out.append(item)
    return out


def filter_default(value, default_value="", boolean=False):
    """§8.3 default(d): d when the value is undefined or None (Q56 (a)); boolean=True: also falsy."""
    if _undefined(value) or value is None or (boolean and not value):
        return default_value
    return value


def filter_length(value):
    """§8.3 length: len(x); an undefined value fails like any other read of it (Q50)."""
    if _undefined(value):
        str(value)
    return len(value)


def filter_split(value, sep=None, maxsplit=-1):
    """§8.3 split (Q58 (a)): Python's str.split."""
    return str(value).split(sep, maxsplit)


# §8.3 table 2: the filters that MUST exist (the rest of Jinja2's standard filters come with it).
FILTERS = {
    "tojson": filter_tojson,
    "yaml": filter_tojson,          # "equivalent to tojson": JSON is flow-style YAML
    "indent": filter_indent,
    "sum": filter_sum,
    "selectattr": filter_selectattr,
    "default": filter_default,
    "d": filter_default,
    "length": filter_length,
    "count": filter_length,
    "split": filter_split,
}

# §8.4 Deferred rendering and field protection -------------------------------------------
# Which fields are runtime-bearing: rendered per invocation (Phase C), so protected at Phase A.
# INTERPRETATION §8.4 (Q48): system_prompt, prompts.<name>.content and the chain agent's `prompt`
# (§4.7 renders it with the per-message `message`, which cannot exist at load).
RUNTIME_FIELDS = {
    "system_prompt": "4.4.6",     # any mapping key of that name
    "prompt": "4.7",              # chain agents
    "content": "10.4",            # only directly under prompts.<name>
}
# INTERPRETATION §8.4 vs §8.9 (Q49): Phase A leaves whole template bodies untouched; they are
# rendered at instantiation (Phase B) with their parameters.
DEFERRED_SECTIONS = ("templates", "template_strings")
# Names that only exist at Phase C: never treated as bound at Phase A or B (Q46, Q47).
RUNTIME_NAMES = frozenset({"context", "message"})
# Block statements that take an {% end... %} partner.
BLOCK_PAIRS = ("for", "if", "with", "macro", "block", "filter", "call", "autoescape", "set")

KEY_LINE = re.compile(r"( *)(?:- +)*(\"[^\"]*\"|'[^']*'|[^\s#'\"\-][^:#]*?|-[^\s:#][^:#]*?) *:(?= |\n|$)")
BLOCK_SCALAR = re.compile(r" *[|>][-+0-9]* *(#.*)?\n?$")


def is_runtime_field(keys):
    """keys: the mapping keys from the document root down to a scalar."""
    last = keys[-1] if keys else None
    if last == "content":
        return len(keys) == 3 and keys[0] == "prompts"
    return last in ("system_prompt", "prompt")


def protect_markers(text):
    """§8.4 step 1: {{ }} {% %} -> the §15.5 sentinels."""
    for marker, sentinel in SENTINELS.items():
        text = text.replace(marker, sentinel)
    return text


def restore_markers(text):
    """§8.4 step 4: the §15.5 sentinels -> {{ }} {% %}."""
    for marker, sentinel in SENTINELS.items():
        text = text.replace(sentinel, marker)
    return text


def restore_sentinels(data):
    """§8.2 step 4 / §8.4 step 4: put the protected template syntax back, keys and values alike."""
    if isinstance(data, str):
        return restore_markers(data) if "<<<" in data else data
    if isinstance(data, list):
        data[:] = [restore_sentinels(item) for item in data]
        return data
    if isinstance(data, dict):
        items = [(restore_sentinels(k), restore_sentinels(v)) for k, v in data.items()]
        data.clear()
        data.update(items)
        return data
    return data


@functools.lru_cache(maxsize=4096)
def tag_free_names(kind, inner, word):
    """Names a tag reads that it does not bind itself (None when it does not parse)."""
    if kind == "{{":
        source = "{{ " + inner + " }}"
    elif word in BLOCK_PAIRS and not (word == "set" and "=" in inner):
        source = "{% " + inner + " %}{% end" + word + " %}"
    else:
        source = "{% " + inner + " %}"
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja_environment().parse(source)))
    except Exception:  # a syntax error: leave the tag to the phase that renders it
        return None


def tag_binds(word, inner):
    """Names a Phase A/B statement binds for what follows it (for targets, set/with targets)."""
    rest = inner.split(None, 1)[1] if " " in inner.strip() else ""
    if word == "for":
        targets = rest.split(" in ", 1)[0]
        return {t.strip(" ()") for t in targets.split(",") if t.strip(" ()")} | {"loop"}
    if word in ("set", "with"):
        names = set()
        targets = rest.split("=", 1)[0] if word == "set" else rest
        for part in targets.split(","):
            name = part.split("=", 1)[0].strip()
            if name.isidentifier():
                names.add(name)
        return names
    if word == "macro":
        head, _, args = rest.partition("(")
        names = {head.strip()}
        for arg in args.rstrip(") ").split(","):
            name = arg.split("=", 1)[0].strip()
            if name.isidentifier():
                names.add(name)
        return names | {"varargs", "kwargs", "caller"}
    return set()


class TagScope:
    """The names bound at some point of a template: base names plus open for/with/macro blocks."""

    def __init__(self, names=()):
        self.names = set(names)
        self.stack = []          # (word, protected, names added by the opener)


def walk_tags(text, scope, defer):
    """Track bound names through `text`; with defer=True also replace by the §15.5 sentinels
    every tag whose free names are not all bound (Q47 (b)), so a later phase renders it.

    {% raw %}...{% endraw %} is left for the phase that meets it first, comments likewise.
    An {% elif %}/{% else %}/{% end... %} follows its opener's fate.
    """
    out, pos = [], 0
    tags = scan_tags(text)
    for start, end, kind in tags:
        if start < pos:          # inside a raw block already copied
            continue
        out.append(text[pos:start])
        tag = text[start:end]
        pos = end
        if kind == "{#":
            out.append(tag)
            continue
        inner = tag[2:-2].strip("-+ \t\r\n")
        word = inner.split(None, 1)[0] if inner else ""
        protected = False
        if kind == "{%" and word == "raw":
            close = text.find("endraw", end)
            close = text.find("%}", close) + 2 if close >= 0 else len(text)
            out.append(text[start:close])
            pos = close
            continue
        if kind == "{{":
            free = tag_free_names(kind, inner, "")
            protected = defer and (free is None or not free <= scope.names)
        elif word in ("elif", "else"):
            protected = scope.stack[-1][1] if scope.stack else defer
        elif word.startswith("end"):
            if scope.stack:
                _, protected, added = scope.stack.pop()
                scope.names -= added
            else:
                protected = defer
        else:
            free = tag_free_names(kind, inner, word)
            protected = defer and (free is None or not free <= scope.names)
            binds = set() if protected else tag_binds(word, inner)
            if word in BLOCK_PAIRS and not (word == "set" and "=" in inner):
                if word in ("set", "macro"):      # the name outlives the block
                    scope.names |= binds
                    binds = set()
                added = binds - scope.names
                scope.stack.append((word, protected, added))
                scope.names |= added
            else:
                scope.names |= binds
        out.append(protect_markers(tag) if protected else tag)
    out.append(text[pos:])
    return "".join(out)


def document_regions(text, file=None):
    """Char spans (start, end, kind) of the text Phase A must not render as is:
    'field' = the value of a runtime field, 'section' = a top-level templates/template_strings.

    A line scan by indentation (plain, quoted and | > block scalars alike): a value region is
    the rest of the key's line plus every following blank or more-indented line.
    """
    regions, keys, offset = [], [], 0
    region = None            # [start, key_col, kind, block_col]
    lines = text.splitlines(keepends=True)
    for lineno, line in enumerate(lines, 1):
        body = line.rstrip("\r\n")
        indent = len(body) - len(body.lstrip(" "))
        blank = body.strip() == ""
        if region is not None:
            if blank or indent > region[1]:
                if region[2] == "templates":
                    region[3] = templates_line(line, indent, blank, region[3], lineno, file)
                offset += len(line)
                continue
            regions.append((region[0], offset, "section" if region[2] != "field" else "field"))
            region = None
        match = None if body.lstrip().startswith(("{%", "{#")) else KEY_LINE.match(body)
        if match:
            key_col = match.start(2)
            key = match.group(2).strip("\"'")
            while keys and keys[-1][0] >= key_col:
                keys.pop()
            keys.append((key_col, key))
            path = [k for _, k in keys]
            if key_col == 0 and key in DEFERRED_SECTIONS:
                region = [offset + len(line), 0, key, None]
            elif is_runtime_field(path):
                region = [offset + match.end(), key_col, "field", None]
        offset += len(line)
    if region is not None:
        regions.append((region[0], offset, "section" if region[2] != "field" else "field"))
    return regions


def templates_line(line, indent, blank, block_col, lineno, file):
    """One line inside `templates:`; returns the open block scalar's key column (or None).

    INTERPRETATION §16.2 vs §8.9 (Q3): a `templates` body may hold value expressions and
    {% if %} inside string values, but a statement line that would emit YAML structure (a
    {% for %} or {% if %} between keys or items) is rejected: it belongs in template_strings.
    """
    if blank:
        return block_col
    if block_col is not None and indent > block_col:
        return block_col
    stripped = line.strip()
    if stripped.startswith("{%"):
        raise ConfigurationError(
            "a statement that generates YAML structure inside `templates`; declare this "
            "template under template_strings", section="16.2, 8.9", file=file, line=lineno)
    match = KEY_LINE.match(line.rstrip("\r\n"))
    if match and BLOCK_SCALAR.match(line[match.end():]):
        return match.start(2)
    return None


def protect_runtime_fields(text, render_context=None, *, file=None):
    """§8.4 step 1: replace {{ }} {% %} by the §15.5 sentinels where Phase A must not render.

    Template bodies (templates, template_strings) are protected whole (Q49 (a)). In runtime
    fields an expression is protected unless every name it reads is bound at Phase A -- by an
    enclosing {% for %}, a {% set %}, or the supplied render context (never `context` or
    `message`):
    INTERPRETATION §8.4 vs §18.6/§18.8 (Q47 (b), Q46 (b)): so `{{ loop.index }}` in a generated
    worker's prompt is rendered at load, `{{ context.topic }}` waits for Phase C.
    """
    check_sentinels(text, file)
    bound = set(BUILTINS) | set(jinja_environment().globals)
    bound |= set(render_context or ()) - RUNTIME_NAMES
    scope = TagScope(bound)
    out, pos = [], 0
    for start, end, kind in document_regions(text, file):
        out.append(walk_tags(text[pos:start], scope, defer=False))
        region = text[start:end]
        if kind == "section":
            out.append(protect_markers(region))
        else:
            out.append(walk_tags(region, TagScope(scope.names), defer=True))
        pos = end
    out.append(walk_tags(text[pos:], scope, defer=False))
    return "".join(out)

# §8.5 Document-level template storage ----------------------------------------------------
# §8.5: tags a host may put on a stored, still-unrendered document; users MUST NOT use them.
RESERVED_TEMPLATE_KEYS = ("_raw_template", "_is_template", "_needs_preprocessing",
                          "__jinja_template__", "__is_template__")


def check_reserved_template_keys(doc):
    """§8.5: reject a mapping key anywhere in the document that is one of the reserved tags."""
    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in RESERVED_TEMPLATE_KEYS:
                    raise doc.error(ConfigurationError, path + (key,), f"{key!r} is reserved for "
                                    "the template-loading host and must not be used", "8.5")
                walk(value, path + (key,))
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, path + (i,))
    walk(doc.data, ())

# §8.6 The templates section (Phase B) ---------------------------------------------------
def param_string(value):
    """string: the canonical text of the value (YAML spelling for booleans, null and collections)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def param_int(value):
    """int: the integer the value represents ("42", 42, 42.0); anything else is an error."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            number = float(text)
            if number.is_integer():
                return int(number)
    raise ValueError(f"{value!r} is not an integer")


def param_float(value):
    """float: the floating-point number the value represents."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise ValueError(f"{value!r} is not a number")


# INTERPRETATION §8.6.2 vs §8.8 (Q51 (b)): "false", "no", "0", "off" (any case) are false as
# well, matching step 6's coercion of a rendered "false"; other values go by truthiness.
BOOLEAN_WORDS = {"true": True, "yes": True, "1": True, "on": True,
                 "false": False, "no": False, "0": False, "off": False}


def param_boolean(value):
    """boolean: the listed words by name (any case), anything else by its truthiness."""
    if isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.strip().lower()]
    return bool(value)


def param_enum(value, decl):
    """enum: MUST be one of `values`."""
    if value not in decl.get("values", ()):
        raise ValueError(f"{value!r} is not one of {decl.get('values')}")
    return value


def param_list(value):
    """list: a single value is wrapped into a one-element list."""
    if isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    return [] if value is None else [value]


def param_pass(value):
    """dict, agent_ref, component_ref: passed through (references are resolved in §8.8 step 8)."""
    return value


# §8.6.2 table: parameter type -> coercion. Rows in the spec's order.
PARAMETER_TYPES = {
    "string": param_string,
    "int": param_int,
    "float": param_float,
    "boolean": param_boolean,
    "enum": param_enum,
    "list": param_list,
    "dict": param_pass,
    "agent_ref": param_pass,
    "component_ref": param_pass,
}
PARAMETER_KEYS = ("type", "default", "required", "values", "description")


def parameter_declarations(doc, decls, path, rt=None):
    """§8.6.1: the parameters block must be a mapping of name -> declaration mapping.

    A missing block means no parameters; the sequence form is forbidden (§16.2).
    """
    if decls is None:
        return {}
    if isinstance(decls, list):
        raise doc.error(ConfigurationError, path, "template parameters declared as a sequence; "
                        "use the mapping form (name: {type: ...})", "8.6.1, 16.2")
    if not isinstance(decls, dict):
        raise doc.error(ConfigurationError, path, "template parameters must be a mapping", "8.6.1")
    for name, decl in decls.items():
        at = path + (name,)
        if not isinstance(decl, dict):
            raise doc.error(ConfigurationError, at, "a parameter declaration must be a mapping",
                            "8.6.1")
        ptype = decl.get("type", "string")
        if ptype not in PARAMETER_TYPES:
            raise doc.error(ConfigurationError, at + ("type",), f"unknown parameter type "
                            f"{ptype!r}; use one of {', '.join(PARAMETER_TYPES)}", "8.6.2")
        if ptype == "enum" and not isinstance(decl.get("values"), list):
            raise doc.error(ConfigurationError, at, "an enum parameter needs a `values` list",
                            "8.6.1")
        for key in decl:
            if key not in PARAMETER_KEYS:
                warn(rt, f"unknown key {key!r} in a parameter declaration", section="8.6.1",
                     path=at + (key,))
    return decls


def coerce_parameter(doc, name, decl, value, at):
    """One value through its §8.6.2 type; a mismatch is a ConfigurationError at the instance."""
    ptype = decl.get("type", "string")
    try:
        if ptype == "enum":
            return param_enum(value, decl)
        return PARAMETER_TYPES[ptype](value)
    except (ValueError, TypeError) as exc:
        raise doc.error(ConfigurationError, at, f"parameter {name!r} ({ptype}): {exc}",
                        "8.6.2") from exc


def bind_parameters(doc, decls, params, inst_path, rt=None):
    """§8.8 steps 1-2: required present, types coerced (§8.6.2), then defaults filled."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise doc.error(ConfigurationError, inst_path + ("params",), "params must be a mapping",
                        "8.7")
    values = {}
    for name, decl in decls.items():
        ptype = decl.get("type", "string")
        if name in params:
            given, at = params[name], inst_path + ("params", name)
        elif "default" in decl:
            continue
        elif decl.get("required"):
            raise doc.error(ConfigurationError, inst_path + ("params",),
                            f"required parameter {name!r} is missing", "8.6.2")
        else:
            continue
        values[name] = coerce_parameter(doc, name, decl, given, at)
    for name, decl in decls.items():        # step 2, after validation
        if name not in values and "default" in decl:
            values[name] = coerce_parameter(doc, name, decl, copy.deepcopy(decl["default"]),
                                            inst_path + ("params",))
    for name in params:
        if name not in decls:
            warn(rt, f"parameter {name!r} is not declared by the template; passed through",
                 section="8.6.1", path=inst_path + ("params", name))
            values[name] = params[name]
    return values

# §8.7 Template instances ------------------------------------------------------------------
TEMPLATE_KINDS = ("agents", "graphs", "streams")
ROUTE_KIND = {"graph": "graphs", "stream": "streams"}
TEMPLATE_ROUTE_KEYS = ("template_config", "type", "description")


def data_engine(data):
    """The template_engine a document names for itself (§9.2 example: cleveragents.template_engine)."""
    block = data.get("cleveragents")
    if isinstance(block, dict) and block.get("template_engine"):
        return block["template_engine"]
    return data.get("template_engine")


def expand_templates(doc, rt=None, *, engine=None):
    """Phase B (§8.2 step 5, §8.6-§8.10): rewrite doc.data in place, every template instance
    replaced by its concrete definition, before validation.

    Agents with `template:` (also inside composite components, §8.10), routes with
    `template_config:` (§8.7), and the deprecated `instances:` section (Q55).
    """
    data = doc.data
    if not isinstance(data, dict):
        return
    ex = Expansion(doc, rt, data, engine)
    instances = data.get("instances")
    if instances is not None:
        ex.move_instances(instances)
    agents = data.get("agents")
    if isinstance(agents, dict):
        for name in list(agents):
            agents[name] = ex.agent(agents[name], ("agents", name), ())
    routes = data.get("routes")
    if isinstance(routes, dict):
        for name in list(routes):
            routes[name] = ex.route(routes[name], ("routes", name))


class Expansion:
    """One Phase B pass over a document: the template registries and the instantiation steps."""

    def __init__(self, doc, rt, data, engine=None):
        self.doc, self.rt, self.data = doc, rt, data
        self.engine = engine_name(engine or getattr(rt, "engine", None) or data_engine(data))
        self.templates = self.registry("templates", dict)
        self.strings = self.registry("template_strings", str)

    def registry(self, section, body_type):
        """templates / template_strings: {agents|graphs|streams: {name: body}}."""
        table = self.data.get(section) or {}
        if not isinstance(table, dict):
            raise self.doc.error(ConfigurationError, (section,), f"{section} must be a mapping",
                                 "8.6")
        for kind, entries in table.items():
            if kind not in TEMPLATE_KINDS:
                raise self.doc.error(ConfigurationError, (section, kind), f"unknown template "
                                     f"kind {kind!r}; use agents, graphs or streams", "8.6")
            if not isinstance(entries, dict):
                raise self.doc.error(ConfigurationError, (section, kind), "must be a mapping of "
                                     "template name to definition", "8.6")
            for name, body in entries.items():
                if not isinstance(body, body_type):
                    what = "a mapping" if body_type is dict else "a string (the raw body)"
                    raise self.doc.error(ConfigurationError, (section, kind, name),
                                         f"a {section} entry must be {what}", "8.6, 8.9")
        return table

    def move_instances(self, instances):
        """INTERPRETATION §3.2 vs §8.7 (Q55 (b)): the deprecated `instances:` section is read as
        {name: {template, params}} and moved into `agents`, with a deprecation warning."""
        warn(self.rt, "the `instances` section is deprecated; declare instances inline under "
             "agents (template: ..., params: ...)", section="8.7", path=("instances",))
        if not isinstance(instances, dict):
            raise self.doc.error(ConfigurationError, ("instances",), "instances must be a mapping",
                                 "8.7")
        agents = self.data.setdefault("agents", {})
        for name, inst in instances.items():
            if not isinstance(inst, dict) or "template" not in inst:
                raise self.doc.error(ConfigurationError, ("instances", name),
                                     "an instance needs `template` (and `params`)", "8.7")
            if isinstance(agents, dict) and name in agents:
                raise self.doc.error(ConfigurationError, ("instances", name),
                                     f"instance {name!r} clashes with agent {name!r}", "8.7")
            agents[name] = inst

    def agent(self, cfg, path, scope):
        """An agent definition after Phase B; `scope` = names of the enclosing composite's
        components (§8.7.1 scope 1), empty at the top level."""
        for _ in range(32):                       # a template may yield another instance
            if not isinstance(cfg, dict):
                return cfg
            if "agent_template" in cfg:
                if "template" in cfg:
                    raise self.doc.error(ConfigurationError, path, "`agent_template` and "
                                         "`template` on the same agent", "16.3")
                # INTERPRETATION §4.1/§4.8 vs §16.2 (Q2 (b)): rejected, as §16.2 says MUST.
                raise self.doc.error(ConfigurationError, path + ("agent_template",),
                                     "`agent_template` is a forbidden form; use `template`",
                                     "16.2")
            if "template" not in cfg:
                break
            if "type" in cfg and cfg["type"] != "template_instance":
                raise self.doc.error(ConfigurationError, path, "`template` and `type` on the "
                                     "same agent (one form excludes the other)", "16.3")
            for key in cfg:
                if key not in ("template", "params", "type"):
                    warn(self.rt, f"key {key!r} beside `template` is ignored", section="8.7",
                         path=path + (key,))
            cfg = self.instantiate("agents", cfg["template"], cfg.get("params"), path, scope)
        else:
            raise self.doc.error(ConfigurationError, path, "templates instantiate each other "
                                 "more than 32 levels deep", "8.7")
        return self.composite(cfg, path)

    def route(self, cfg, path):
        """§8.7 routes via template_config: {template, params}."""
        if not isinstance(cfg, dict) or "template_config" not in cfg:
            return cfg
        extra = [key for key in cfg if key not in TEMPLATE_ROUTE_KEYS]
        if extra:
            raise self.doc.error(ConfigurationError, path + (extra[0],), "a route with "
                                 "template_config takes its structure from the template; "
                                 f"remove {', '.join(extra)}", "16.3")
        tc = cfg["template_config"]
        if not isinstance(tc, dict) or not isinstance(tc.get("template"), str):
            raise self.doc.error(ConfigurationError, path + ("template_config",),
                                 "template_config needs `template` (and `params`)", "8.7")
        name = tc["template"]
        # INTERPRETATION §5.1/§11.3 vs §8.7 (Q54 (b)+(c)): `type` may be omitted and then comes
        # from the template's kind; when given it picks the kind and must match.
        declared = str(cfg["type"]).lower() if "type" in cfg else None
        if declared is not None and declared not in ROUTE_KIND:
            raise self.doc.error(ConfigurationError, path + ("type",), "only graph and stream "
                                 "routes can come from a template", "8.7")
        kinds = [ROUTE_KIND[declared]] if declared else [
            k for k in ("graphs", "streams") if self.find(k, name) is not None]
        if len(kinds) > 1:
            raise self.doc.error(ConfigurationError, path + ("template_config", "template"),
                                 f"template {name!r} exists as a graph and as a stream "
                                 "template; add `type` to the route", "8.7")
        kind = kinds[0] if kinds else "graphs"
        body = self.instantiate(kind, name, tc.get("params"), path + ("template_config",), ())
        rtype = "graph" if kind == "graphs" else "stream"
        if str(body.get("type", rtype)).lower() != rtype:
            raise self.doc.error(ConfigurationError, path, f"template {name!r} yields a "
                                 f"{body.get('type')} route, not a {rtype} route", "8.7")
        body.setdefault("type", rtype)
        return body

    def instantiate(self, kind, name, params, path, scope):
        return instantiate(self, kind, name, params, path, scope)

    def composite(self, cfg, path):
        return expand_composite(self, cfg, path)

    def find(self, kind, name):
        """(body, is_raw_string) of a registered template, or None."""
        if name in (self.templates.get(kind) or {}):
            return self.templates[kind][name], False
        if name in (self.strings.get(kind) or {}):
            return self.strings[kind][name], True
        return None

# §8.8 Template rendering semantics (Phase B) ---------------------------------------------
WHOLE_IF_BLOCK = re.compile(r"\s*\{%-?\s*if\b.*\{%-?\s*endif\s*-?%\}\s*", re.DOTALL)
INT_FORM = re.compile(r"[-+]?\d+")
FLOAT_FORM = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+)")


def coerce_rendered(text):
    """§8.8 step 6: a rendered string that looks like a boolean, integer, float or JSON list /
    mapping becomes that value; anything else stays a string."""
    s = text.strip()
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    if INT_FORM.fullmatch(s):
        return int(s)
    if FLOAT_FORM.fullmatch(s):
        return float(s)
    if (s.startswith("[") and s.endswith("]")) or (s.startswith("{") and s.endswith("}")):
        try:
            return json.loads(s)
        except ValueError:
            return text
    return text


def instantiate(ex, kind, name, params, path, scope):
    """§8.8: the nine steps, in order, for one instance of template `name` of `kind`."""
    found = ex.find(kind, name) if isinstance(name, str) else None
    if found is None:
        raise ex.doc.error(ConfigurationError, path + ("template",),
                           f"unknown {kind[:-1]} template {name!r}", "8.7")
    body, raw = found
    section = "template_strings" if raw else "templates"
    tpath = (section, kind, name)
    decls = (template_string_parameters(ex.doc, body, tpath) if raw
             else body.get("parameters"))
    decls = parameter_declarations(ex.doc, decls, tpath + ("parameters",), ex.rt)
    values = bind_parameters(ex.doc, decls, params, path, ex.rt)          # steps 1-2
    variables = dict(BUILTINS)
    variables.update(values)
    if raw:                                                                 # §8.9
        result = instantiate_string(ex, body, variables, path, tpath)
    else:
        result = copy.deepcopy(body)                                       # step 3
        result.pop("parameters", None)                                     # step 4
        result = render_tree(ex, result, variables, path, ())              # steps 5-7
    resolve_references(ex, decls, values, path, scope)                     # step 8
    return result                                                          # step 9


def render_phase_b(ex, text, variables, path, runtime_field):
    """Step 5 for one string. Phase B failures are ConfigurationErrors (§8.12).

    INTERPRETATION §8.8 vs §8.11 (Q49 (d)): in a runtime field (system_prompt, prompt) an
    expression whose names are not all parameters or built-ins survives to Phase C (JINJA2).
    """
    if runtime_field and ex.engine == "JINJA2":
        text = walk_tags(text, TagScope(set(variables) - RUNTIME_NAMES), defer=True)
    try:
        if ex.engine == "SIMPLE":   # Q60 (b): the format pass belongs to Phase C only
            rendered = render_simple(text, variables, format_pass=False)
        else:
            rendered = render(text, variables, ex.engine)
    except TemplateError as exc:
        raise ex.doc.error(ConfigurationError, path, f"Phase B rendering failed: {exc.message}",
                           "8.12") from exc
    return restore_markers(rendered) if runtime_field else rendered


def render_tree(ex, node, variables, path, keys):
    """Steps 5-7 over a definition: render every string (keys too), coerce rendered scalars,
    and drop the entries whose whole value was an {% if %} block that rendered empty."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            new_key = key
            if has_template_syntax(key):
                new_key = render_phase_b(ex, key, variables, path, False)
            if dropped_if_block(value, ex, variables, path):
                continue
            out[new_key] = render_tree(ex, value, variables, path + (key,), keys + (key,))
        return out
    if isinstance(node, list):
        return [render_tree(ex, item, variables, path + (i,), keys)
                for i, item in enumerate(node)
                if not dropped_if_block(item, ex, variables, path + (i,))]
    if isinstance(node, str) and has_template_syntax(node):
        runtime = bool(keys) and keys[-1] in ("system_prompt", "prompt")
        rendered = render_phase_b(ex, node, variables, path, runtime)
        return rendered if runtime else coerce_rendered(rendered)              # step 6
    return node


def dropped_if_block(value, ex, variables, path):
    """Step 7. INTERPRETATION §8.8 (Q52 (b)): a list item or mapping entry whose whole value is
    one {% if %}...{% endif %} block that renders to nothing is removed from the structure."""
    if not (isinstance(value, str) and WHOLE_IF_BLOCK.fullmatch(value)):
        return False
    return render_phase_b(ex, value, variables, path, False).strip() == ""


def resolve_references(ex, decls, values, path, scope):
    """Step 8, §8.7.1: agent_ref / component_ref name a component of the enclosing composite
    (scope 1) or a top-level agent -- or, for component_ref, a route (scope 2)."""
    agents = ex.data.get("agents") if isinstance(ex.data.get("agents"), dict) else {}
    routes = ex.data.get("routes") if isinstance(ex.data.get("routes"), dict) else {}
    for name, decl in decls.items():
        ptype = decl.get("type")
        if ptype not in ("agent_ref", "component_ref") or name not in values:
            continue
        ref = values[name]
        known = ref in scope or ref in agents or (ptype == "component_ref" and ref in routes)
        if not isinstance(ref, str) or not known:
            raise ex.doc.error(ConfigurationError, path + ("params", name), f"{ptype} "
                               f"{ref!r} names no agent{' or route' if ptype == 'component_ref' else ''}"
                               " in the composite or the actor", "8.7.1")

# §8.9 The template_strings section -------------------------------------------------------
def template_string_parameters(doc, body, tpath):
    """INTERPRETATION §8.9 (Q53 (a)): a template_strings body declares its parameters in a
    leading top-level `parameters:` block, read as YAML before the first template tag."""
    lines = body.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == "parameters:"), None)
    if start is None:
        return None
    block = [lines[start]]
    for line in lines[start + 1:]:
        stripped = line.strip()
        if stripped and not line.startswith((" ", "\t")):
            break
        block.append(line)
    text = "".join(block)
    if has_template_syntax(text):
        raise doc.error(ConfigurationError, tpath, "the parameters block of a template_strings "
                        "body must not contain template syntax", "8.9")
    try:
        return (yaml.safe_load(text) or {}).get("parameters")
    except yaml.YAMLError as exc:
        raise doc.error(ConfigurationError, tpath, f"parameters block: {exc}", "8.9") from exc


def instantiate_string(ex, body, variables, path, tpath):
    """§8.9: render the raw body with the parameters, then parse it as YAML.

    INTERPRETATION §8.9/§18.11 (Q53 (e)): a body that yields one definition (it has `type` or
    `template`) is the instance; a body that yields several definitions becomes a composite
    named after the instance, those definitions its components (input: the first, output:
    the last), so §18.11's `agent: legal_team` names something real.
    """
    try:
        text = render_simple(body, variables, format_pass=False) if ex.engine == "SIMPLE" else \
            render(body, variables, ex.engine)
    except TemplateError as exc:
        raise ex.doc.error(ConfigurationError, path, f"Phase B rendering of {path_str(tpath)} "
                           f"failed: {exc.message}", "8.12") from exc
    try:
        result = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ex.doc.error(ConfigurationError, path, f"{path_str(tpath)} does not render to "
                           f"YAML: {exc}", "8.9") from exc
    if not isinstance(result, dict):
        raise ex.doc.error(ConfigurationError, path, f"{path_str(tpath)} must render to a "
                           "mapping", "8.9")
    result.pop("parameters", None)
    if "type" in result or "template" in result or tpath[1] != "agents":
        return result
    if not result:
        raise ex.doc.error(ConfigurationError, path, f"{path_str(tpath)} rendered no "
                           "definitions", "8.9")
    names = list(result)
    return {"type": "composite", "config": {
        "components": {"agents": result},
        "routing": {"input": {"type": "agent", "name": names[0]},
                    "output": {"type": "agent", "name": names[-1]}}}}

# §8.10 Composite templates ----------------------------------------------------------------
def expand_composite(ex, cfg, path):
    """§8.10 / §8.7.1: template instances among a composite's components resolve references
    in the composite's own scope first, then the actor's."""
    if not (isinstance(cfg, dict) and cfg.get("type") == "composite"):
        return cfg
    config = cfg.get("config")
    comps = config.get("components") if isinstance(config, dict) else None
    agents = comps.get("agents") if isinstance(comps, dict) else None
    if not isinstance(agents, dict):
        return cfg
    scope = tuple(agents)
    at = path + ("config", "components", "agents")
    for name in list(agents):
        agents[name] = ex.agent(agents[name], at + (name,), scope)
    return cfg

# §8.11 Runtime template rendering (Phase C) ----------------------------------------------
def runtime_variables(ctx, message):
    """§8.11 table: the §8.3 built-ins, the context's top-level keys flattened, `context` and
    `message` (the text of the message being processed)."""
    if isinstance(message, Message):
        message = message.content
    variables = dict(BUILTINS)
    if isinstance(ctx, dict):
        variables.update(ctx)
    variables["context"] = ctx if ctx is not None else {}
    variables["message"] = message
    return variables


def render_runtime(rt, text, ctx, message, path=None):
    """§8.11 Phase C: render a system prompt or prompt template for one invocation, in
    rt.engine; on failure warn and use the literal text (§8.12, §4.4.6).

    Registered prompts (§10.4, rt.prompts) serve as MUSTACHE partials.
    """
    if not isinstance(text, str):
        return text
    engine = engine_name(getattr(rt, "engine", None))
    if engine != "SIMPLE" and not has_template_syntax(text):
        return text       # same result, no parse: plain prompts cost nothing (Q59 (a))
    try:
        return render(text, runtime_variables(ctx, message), engine,
                      partials=getattr(rt, "prompts", None))
    except TemplateError as exc:
        warn(rt, f"Phase C rendering failed ({exc.message}); the literal text is used",
             section="8.12", path=path)
        return text

# §8.12 Render-failure policy -------------------------------------------------------------
# §8.12 table: what a render failure does at each phase.
RENDER_FAILURE = {
    "A": "ConfigurationError: the configuration fails to load (render_document)",
    "B": "ConfigurationError: the instantiation fails (render_phase_b, instantiate_string)",
    "C": "warning, then the literal unrendered text (render_runtime)",
}


# =====================================================================================
# §9 ACTOR PARAMETERS
# =====================================================================================

# §9.2 template_engine ---------------------------------------------------------------------
# The three dialects share one entry point, render(); Phases A, B and C all go through it.
try:  # the one place jinja2 is imported; without it only configs that need JINJA2 fail
    import jinja2
    import jinja2.meta
    import jinja2.sandbox
except ImportError:  # pragma: no cover - exercised only on hosts without jinja2
    jinja2 = None

JINJA2_MISSING = "the JINJA2 template engine needs the jinja2 package: python3 -m pip install jinja2"


def _require_jinja2():
    if jinja2 is None:
        raise TemplateError(JINJA2_MISSING, section="9.2")


if jinja2 is not None:
    class RuntimeUndefined(jinja2.Undefined):
        """Q50 (c): an undefined name fails when printed, iterated for output or dereferenced,
        but is simply false in conditions, `default` and comparisons (§8.11's `{% if context.x %}`)."""

        __slots__ = ()
        __str__ = jinja2.Undefined._fail_with_undefined_error
        __len__ = jinja2.Undefined._fail_with_undefined_error

        def __lt__(self, other):
            return False

        __le__ = __gt__ = __ge__ = __lt__

        def __iter__(self):
            return iter(())


@functools.lru_cache(maxsize=None)
def jinja_environment():
    """§9.2 JINJA2: one sandboxed environment per process (a pure memo, never mutated after build).

    Templates come from configuration files, hence the sandbox; keep_trailing_newline by Q59 (a).
    """
    _require_jinja2()
    env = jinja2.sandbox.SandboxedEnvironment(
        undefined=RuntimeUndefined, keep_trailing_newline=True, autoescape=False)
    env.globals.update(BUILTINS)
    env.filters.update(FILTERS)
    return env


@functools.lru_cache(maxsize=4096)
def jinja_template(text):
    """Compiled template by source text: the hot path (Phase C, once per message) never re-parses."""
    return jinja_environment().from_string(text)


def jinja_error_line(exc):
    """The template line an error happened on (syntax errors carry it; runtime errors are
    located through the traceback frame jinja2 rewrites to `<template>`)."""
    if getattr(exc, "lineno", None):
        return exc.lineno
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_jinja2(text, variables, partials=None):
    """§9.2 JINJA2: full Jinja2 dialect in the sandbox, with the §8.3 built-ins and filters."""
    try:
        return jinja_template(text).render(variables)
    except TemplateError:
        raise
    except Exception as exc:  # jinja2 syntax, undefined, sandbox and filter errors alike
        err = TemplateError(f"JINJA2: {type(exc).__name__}: {exc}", section="9.2")
        err.line = jinja_error_line(exc)
        raise err from exc


# MUSTACHE: a hand-written tokenizer + tree renderer -----------------------------------------
MUSTACHE_STANDALONE = "#^/!>="        # tag sigils that may stand alone on a line
MUSTACHE_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}


def mustache_parse(text, open_delim="{{", close_delim="}}"):
    """Tokenize and nest a Mustache template into a node list.

    Nodes: ('text', s) ('var', name, escaped) ('section', name, inverted, nodes) ('partial', name,
    indent). Standalone tags (alone on their line apart from whitespace) take the whole line away.
    """
    root, stack, pos = [], [], 0
    nodes = root
    n = len(text)
    while pos < n:
        start = text.find(open_delim, pos)
        if start < 0:
            nodes.append(("text", text[pos:]))
            break
        inner = start + len(open_delim)
        if text.startswith("{", inner):          # triple mustache {{{name}}}
            close = "}" + close_delim
            inner += 1
            sigil = "{"
        else:
            close = close_delim
            sigil = text[inner] if inner < n else ""
        end = text.find(close, inner)
        if end < 0:
            raise TemplateError(f"MUSTACHE: unclosed tag at offset {start}", section="9.2")
        body = text[inner:end]
        after = end + len(close)
        if sigil in "#^/!>=&":
            body = body[1:]
        if sigil == "=":
            body = body.rstrip()
            if not body.endswith("="):
                raise TemplateError("MUSTACHE: malformed set-delimiter tag", section="9.2")
            parts = body[:-1].split()
            if len(parts) != 2:
                raise TemplateError("MUSTACHE: set-delimiter needs two delimiters", section="9.2")
        name = body.strip()
        before = text[pos:start]
        indent = ""
        if sigil and sigil in MUSTACHE_STANDALONE:
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", after)
            line_end = n if line_end < 0 else line_end
            lead, trail = text[line_start:start], text[after:line_end]
            if line_start >= pos and lead.strip(" \t") == "" and trail.strip(" \t\r") == "":
                before = before[:len(before) - len(lead)]
                indent = lead
                after = min(n, line_end + 1)
        if before:
            nodes.append(("text", before))
        pos = after
        if sigil == "!":
            continue
        if sigil == "=":
            open_delim, close_delim = parts
            continue
        if sigil in "#^":
            section = ("section", name, sigil == "^", [])
            nodes.append(section)
            stack.append((name, nodes))
            nodes = section[3]
        elif sigil == "/":
            if not stack or stack[-1][0] != name:
                raise TemplateError(f"MUSTACHE: unexpected closing tag {name!r}", section="9.2")
            nodes = stack.pop()[1]
        elif sigil == ">":
            nodes.append(("partial", name, indent))
        else:
            nodes.append(("var", name, sigil not in "&{"))
    if stack:
        raise TemplateError(f"MUSTACHE: unclosed section {stack[-1][0]!r}", section="9.2")
    return root


def mustache_lookup(stack, name):
    """Mustache name resolution: '.' is the top; 'a.b.c' finds 'a' up the stack, then digs."""
    if name == ".":
        return stack[-1]
    first, *rest = name.split(".")
    for frame in reversed(stack):
        if isinstance(frame, dict) and first in frame:
            value = frame[first]
            break
    else:
        return None
    for part in rest:
        if isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def mustache_text(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def mustache_render_nodes(nodes, stack, partials, out, depth=0):
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "var":
            text = mustache_text(mustache_lookup(stack, node[1]))
            if node[2]:
                text = "".join(MUSTACHE_ESCAPES.get(ch, ch) for ch in text)
            out.append(text)
        elif kind == "section":
            value = mustache_lookup(stack, node[1])
            falsy = value is None or value is False or value == "" or (
                isinstance(value, (list, tuple)) and not value)
            if node[2]:
                if falsy:
                    mustache_render_nodes(node[3], stack, partials, out, depth)
            elif falsy:
                continue
            elif isinstance(value, (list, tuple)):
                for item in value:
                    mustache_render_nodes(node[3], stack + [item], partials, out, depth)
            else:
                mustache_render_nodes(node[3], stack + [value], partials, out, depth)
        else:  # partial
            if depth > 100:
                raise TemplateError("MUSTACHE: partials nest deeper than 100", section="9.2")
            source = (partials or {}).get(node[1])
            if source is None:
                continue
            if node[2]:  # a standalone partial indents every line it produces
                source = node[2] + re.sub(r"\n(?!$)", "\n" + node[2], source)
            mustache_render_nodes(mustache_parse(source), stack, partials, out, depth + 1)


@functools.lru_cache(maxsize=4096)
def mustache_compiled(text):
    return mustache_parse(text)


def render_mustache(text, variables, partials=None):
    """§9.2 MUSTACHE: logic-less dialect; `variables` may be any value (the root context)."""
    out = []
    mustache_render_nodes(mustache_compiled(text), [variables], partials, out)
    return "".join(out)


# SIMPLE: `{{ expr }}` through the §13.2.2 sandbox, then str.format-style substitution ---------
def simple_expressions(text, variables):
    """Pass 1: each {{ expr }} is evaluated in the expression sandbox and replaced by str(value)."""
    out, pos = [], 0
    while True:
        start = text.find("{{", pos)
        if start < 0:
            out.append(text[pos:])
            return "".join(out)
        end = text.find("}}", start + 2)
        if end < 0:
            raise TemplateError("SIMPLE: '{{' without a closing '}}'", section="9.2")
        out.append(text[pos:start])
        source = text[start + 2:end].strip()
        try:
            value = eval_expression_text(source, dict(variables))
        except ActorError as exc:
            raise TemplateError(f"SIMPLE: {{{{ {source} }}}}: {exc.message}", section="9.2") from exc
        out.append("" if value is None else str(value))
        pos = end + 2


def simple_field(variables, field):
    """Resolve a format field `name`, `name.key` or `name[key]` through mappings and lists only:
    attribute access would reach Python internals, so it is not offered."""
    parts, token, i = [], "", 0
    while i < len(field):
        ch = field[i]
        if ch == ".":
            parts.append(token)
            token = ""
        elif ch == "[":
            close = field.find("]", i)
            if close < 0:
                raise TemplateError(f"SIMPLE: bad field {{{field}}}", section="9.2")
            parts.append(token)
            token = field[i + 1:close]
            i = close
        else:
            token += ch
        i += 1
    parts.append(token)
    parts = [p for p in parts if p != ""] or [""]
    value = variables
    for part in parts:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(f"SIMPLE: unknown name {{{field}}} in format substitution",
                                section="9.2")
    return value


def simple_format(text, variables):
    """Pass 2: `{name}` fields replaced from the variables; `{{`/`}}` stand for literal braces."""
    out = []
    try:
        pieces = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TemplateError(f"SIMPLE: format substitution: {exc}", section="9.2") from exc
    for literal, field, spec, conversion in pieces:
        out.append(literal)
        if field is None:
            continue
        value = simple_field(variables, field)
        if conversion == "r":
            value = repr(value)
        elif conversion in ("s", "a"):
            value = str(value) if conversion == "s" else ascii(value)
        try:
            out.append(format(value, simple_format(spec, variables) if spec else ""))
        except (ValueError, TypeError) as exc:
            raise TemplateError(f"SIMPLE: {{{field}}}: {exc}", section="9.2") from exc
    return "".join(out)


def render_simple(text, variables, partials=None, *, format_pass=True):
    """§9.2 SIMPLE: pass 1 evaluates {{ expr }}; pass 2 (Phase C only, Q60 (b)) formats {name}."""
    text = simple_expressions(text, variables)
    return simple_format(text, variables) if format_pass else text


ENGINES = {"JINJA2": render_jinja2, "MUSTACHE": render_mustache, "SIMPLE": render_simple}


def engine_name(engine):
    """§9.2: case-insensitive; canonical upper case; unknown -> TemplateError."""
    name = str(engine or "JINJA2").upper()
    if name not in ENGINES:
        raise TemplateError(f"unknown template_engine {engine!r}: use one of {', '.join(ENGINES)}",
                            section="9.2")
    return name


def render(text, variables, engine="JINJA2", partials=None):
    """Render `text` with `variables` in one of the §9.2 dialects (public API).

    MUSTACHE accepts any value as the root context and `partials` ({name: source}); JINJA2 and
    SIMPLE take a mapping. Every failure is a TemplateError.
    """
    handler = ENGINES[engine_name(engine)]
    if handler is not render_mustache and not isinstance(variables, dict):
        raise TemplateError("variables must be a mapping for JINJA2 and SIMPLE", section="9.2")
    return handler(text, variables, partials)

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
