#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
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
    python actor.py --diagram CONFIG         python actor.py --schema
    python actor.py CONFIG --trace -m TEXT   (every stream message, graph step and LLM call)
    python actor.py --check --strict CONFIG  (warnings are errors)
    python actor.py --vectors DIR [--impl "CMD" [-j N]]   (the vector suite, vectors/README.md)
    Exit status: 0 ok, 1 something reached __error__ (or a vector failed), 2 bad usage or a
    configuration refused at load, 70 a bug in actor.py; `python actor.py --help` lists the rest.

Glossary: msg Message, ctx context (§10), state graph state (§6.3), cfg the raw YAML mapping in
hand, path a config path tuple (('routes', 'main', 'edges', 2)), now virtual seconds, rt Runtime.

How actor.py is organised: load() runs six passes, in §12.1's order (start_actor, §12.1):
    read    the files (read_sources, HOST; §12.1);
    render  Phase A in the document's engine (load_document -> parse_source -> render_document,
            §8.2, with runtime fields protected, §8.4);
    parse   YAML 1.2 core schema with marks for located errors (parse_yaml, §3.1), merged
            (§3.1) and interpolated (interpolate_env, §14);
    check   Phase B instantiation (expand_templates, §8.6-§8.10), then every §11/§15/§16 rule
            (validate_document, §11) -- errors are located ConfigurationErrors, before any agent;
    build   agents (make_agent, §4), graph routes (GraphRoute, §6), the stream network with
            merges, splits and pipelines (StreamNetwork, §5.5, §7), from checked configuration:
            constructors neither reject nor warn (an unavailable provider, which fails agent
            creation, is found by check_providers right after the rules);
    run     Actor.send/advance/complete (HOST) drive messages; configuration code, expressions
            and templates run in the §13.2 sandbox (in-process or in worker processes).
Each rule lives under the banner of the section that states it; the threat model the sandbox
answers is in README "Security". Field tables (agents, operators, nodes, edges, routes, merges,
splits, pipeline stages, template parameters, top-level sections) are rows of Field(name,
constraint, default, §) read by one checker, check_fields (PRELUDE). Every error is made by one
constructor, error() (PRELUDE §20): `raise doc.error(category, path, message, section)` where a
document path locates it, else `raise error(category, message, section)`.

Map (every banner, in file order; test_actor.py keeps this list and the banners in sync):
    PRELUDE -- shared by several sections, so it comes first: 20 12.2.1
    §3 DOCUMENT STRUCTURE: 3.1 3.2 3.3 3.4
    §4 AGENTS: 4.1 4.2 4.4 4.4.1 4.4.2 4.4.3 4.4.4 4.4.5 4.4.6 4.5 4.5.1 4.5.2 4.5.3 4.5.4 4.5.5
            4.5.6 4.5.7 4.6 4.6.1 4.6.2 4.6.3 4.7 4.8 4.9 4.11 4.3
    §5 ROUTES -- COMMON CONCEPTS: 5.1 5.2 5.3 5.3.1 5.3.2 5.3.3 5.3.4 5.3.5 5.3.6 5.4 5.4.1 5.5 5.6
    §6 GRAPH ROUTES: 6.1 6.2 6.2.1 6.2.2 6.2.3 6.2.4 6.2.5 6.2.6 6.2.6.1 6.2.6.2 6.2.6.3 6.2.6.4 6.3
            6.4 6.5 6.6 6.7 6.8 6.9 6.10 6.11
    §7 INTER-ROUTE COMPOSITION: 7.1 7.2 7.3
    §8 TEMPLATES AND INSTANCES: 8.1 8.2 8.3 8.4 8.5 8.6 8.7 8.7.1 8.8 8.9 8.10 8.11 8.12
    §9 ACTOR PARAMETERS: 9.2 9.3 9.4
    §10 CONTEXT: 10.1 10.3 10.4
    §11 VALIDATION RULES: 11.1 11.2 11.3 11.4 11.5 11.6
    §12 RUNTIME BEHAVIOR: 12.1 12.2 12.2.3 12.2.4 12.3 12.4 12.5 12.6
    §13 SECURITY MODEL: 13.1 13.2 13.2.1 13.2.2 13.2.3 13.3 13.5
    §14 ENVIRONMENT VARIABLE INTERPOLATION: 14.1 14.3
    §15 RESERVED NAMES: 15.1 15.2 15.4 15.5 15.6
    §16 FORBIDDEN PATTERNS: 16.1 16.2 16.3
    === APPENDICES ===
    APPENDIX A -- speed: A.1 A.2 A.3 A.4
    APPENDIX B -- containment: B.1 B.2 B.3
    APPENDIX C -- host: C.0 C.1 C.2 C.3 C.4 C.5
"""
from __future__ import annotations

import argparse
import ast
import bisect
import codecs
import encodings
import encodings.aliases
import collections.abc
import contextlib
import contextvars
import copy
import datetime
import errno
import fnmatch
import functools
import heapq
import itertools
import json
import logging
import marshal
import math
import operator
import os
import random
import re
import signal
import stat
try:                                       # the regex parser, to spot nested repeats (§6.2.6.2)
    import re._parser as _regex_parser
    import re._constants as _regex_constants
except ImportError:                        # Python 3.10
    import sre_parse as _regex_parser
    import sre_constants as _regex_constants
import string
import sys
import threading
import time
import urllib.parse
import weakref
from collections import ChainMap
from pathlib import Path

try:
    import resource         # POSIX only: the sandbox's memory backstop (§13.2)
except ImportError:         # Windows
    resource = None

import yaml

__version__ = "0.1.0"
SPEC_VERSION = "1.0.0"

__all__ = [
    "load", "render", "Actor", "Result", "Message", "trace_line",
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


# INTERPRETATION I-009 §11, §16, §20 (Q82): ConfigurationError wherever no category is named;
# this one is a kind of it.
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


def error(cls, message, section=None, *, path=None, file=None, line=None, col=None):
    """The one constructor of errors; callers `raise error(ExecutionError, message, "6.3")`, or
    `raise doc.error(...)` where a document path locates it (Doc.error finds the line, then calls
    this). `path` may be a config path tuple. A class outside §20 -- a built-in one that sandboxed
    code must see as Python raises it (TypeError, ...), or an internal signal -- gets the message
    alone."""
    if not issubclass(cls, ActorError):
        return cls(message)
    if isinstance(path, tuple):
        path = path_str(path)
    return cls(message, path=path, section=section, file=file, line=line, col=col)


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


def walk_document(node, visit, path=()):
    """The one walk over a parsed document: depth first, in document order, each mapping and
    sequence rebuilt from its walked children, then `visit(value, path)` called on every value
    (scalars, and containers after their children); what visit returns takes the value's place.
    Depth is bounded by YAML_MAX_DEPTH (§3.1), so the walk may recurse."""
    if isinstance(node, dict):
        node = {key: walk_document(value, visit, path + (key,)) for key, value in node.items()}
    elif isinstance(node, list):
        node = [walk_document(item, visit, path + (i,)) for i, item in enumerate(node)]
    return visit(node, path)


def visit_document(node, visit, path=()):
    """walk_document's read-only companion, for a walk that only looks: the same values in the
    same order (children before their container), nothing rebuilt, what visit returns unused."""
    if isinstance(node, dict):
        for key, value in node.items():
            visit_document(value, visit, path + (key,))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            visit_document(item, visit, path + (i,))
    visit(node, path)


class Doc:
    """A loaded document: the merged data plus a path -> (file, line, col) map of YAML marks."""

    def __init__(self, data, marks=None, files=(), rendered=None):
        self.data = data
        self.marks = marks if marks is not None else {}
        self.files = tuple(files)
        # file -> RenderedLines for the files that went through Phase A (§8.2): their marks
        # count lines of the rendered text, and locate() reports the source line instead.
        self.rendered = rendered or {}

    def locate(self, path):
        """The mark of the longest known prefix of `path` (file, line, col) or (file, None,
        None)."""
        path = tuple(path or ())
        while path and path not in self.marks:
            path = path[:-1]
        mark = self.marks.get(path) if path else self.marks.get(
            (), (self.files[-1] if self.files else None, None, None))
        lines = self.rendered.get(mark[0])
        if lines is not None and mark[1] is not None:
            return (mark[0], *lines.origin(mark[1], mark[2]))
        return mark

    def error(self, cls, path, message, section=None):
        """Build a located §20 error; callers `raise doc.error(...)`.

        A field that is absent but has a near-spelling beside it (`confg:` where `config` is
        missing) is most likely misspelt: the error then stands at that key and says so first,
        since the missing field's own message would send the author elsewhere."""
        misspelt = self.misspelling(path)
        if misspelt is not None:
            path, wanted = misspelt
            message = f"unknown key '{path[-1]}' (did you mean '{wanted}'?); without it: {message}"
        file, line, col = self.locate(path)
        return error(cls, message, section, path=path_str(path), file=file, line=line, col=col)

    def misspelling(self, path):
        """(path of a key near `path`'s first key the source did not write, that key), or
        None. A key the source did not write is absent, or a default filled in (config: {})."""
        node, path = self.data, tuple(path or ())
        for i, key in enumerate(path):
            if isinstance(node, list) and type(key) is int and 0 <= key < len(node):
                node = node[key]
                continue
            if not isinstance(node, dict):
                return None
            if key not in node or self.marks and path[:i + 1] not in self.marks:
                if not isinstance(key, str):
                    return None
                import difflib      # error paths only
                written = [k for k in node if isinstance(k, str) and k != key
                           and (not self.marks or path[:i] + (k,) in self.marks)
                           and k not in known_field_names()]
                near = difflib.get_close_matches(key, written, n=1, cutoff=0.8)
                return (path[:i] + (near[0],), key) if near else None
            node = node[key]
        return None


@functools.lru_cache(maxsize=1)
def known_field_names():
    """Every name some field table of this module defines (a key spelt like one is no typo)."""
    names = set()
    for table in list(globals().values()):
        if isinstance(table, dict) and table and all(isinstance(v, Field) for v in table.values()):
            names.update(table)
    return frozenset(names)


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
        keep_last(rt_or_none.warnings, text)
    log.warning(text)
    return text


LOG_LIMIT = 1_000       # entries kept by rt.warnings and rt.llm_log (a long run's memory stays flat)


def keep_last(entries, entry):
    """Append `entry`; past twice LOG_LIMIT entries, forget the oldest down to LOG_LIMIT (amortised
    O(1), and a reader that counted entries a moment ago still finds the newest at the end)."""
    entries.append(entry)
    if len(entries) > 2 * LOG_LIMIT:
        del entries[:-LOG_LIMIT]


class ComponentDoc(Doc):
    """The document a composite's components are checked and built from: `agents` and `routes`
    (graphs and streams) as the top-level sections would hold them, while every error and warning
    is located at the component's real place under agents.<name>.config.components."""

    def __init__(self, data, outer, path):
        super().__init__(data, outer.marks, outer.files)
        self.outer = outer
        self.base = tuple(path)
        components = path + ("components",)
        self.prefixes = {("agents",): components + ("agents",)}
        for kind in ("graphs", "streams"):
            for local in (outer_get(outer.data, components) or {}).get(kind) or {}:
                self.prefixes[("routes", local)] = components + (kind, local)

    def outer_path(self, path):
        """An absolute path (under this composite) as it is; a relative one (agents.<local>...,
        routes.<local>...) moved under the composite's components."""
        path = tuple(path or ())
        if path[:len(self.base)] == self.base:
            return path
        for size in (2, 1):
            head = self.prefixes.get(path[:size])
            if head is not None and len(path) >= size:
                return head + path[size:]
        return path

    def locate(self, path):
        return self.outer.locate(self.outer_path(path))

    def error(self, cls, path, message, section=None):
        return self.outer.error(cls, self.outer_path(path), message, section)


def outer_get(data, path):
    """The value at `path` inside nested mappings, or None."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


# Field vocabulary: the one way a table says what a field accepts -------------------------------
# A Constraint is a test on a value and the words that finish "<field> must be ...". A table row
# is Field(name, constraint, default, section): the default REQUIRED means the field must be
# given; a null value stands for "absent" only where the default is None (nothing to use instead).
# check_fields reads rows and raises the located ConfigurationError; check_unknown warns about
# (or hands back, to refuse) the keys no row names. Every section's fields are such a table, also
# where another check reads the value in its own words (read_elsewhere); --schema, the hints and
# Doc.misspelling read the same tables. The constraints several sections share are defined here.
REQUIRED = object()


class Constraint:
    __slots__ = ("test", "wording", "types")

    def __init__(self, test, wording, types=()):
        self.test, self.wording = test, wording
        self.types = types          # the Python types it admits, for --schema (HOST)


class Field:
    __slots__ = ("name", "constraint", "default", "section")

    def __init__(self, name, constraint, default, section):
        self.name, self.constraint, self.default, self.section = name, constraint, default, section


def fields_by_name(*rows):
    """A field table: rows in the spec's order, looked up by name."""
    return {row.name: row for row in rows}


def read_elsewhere(section, *names):
    """Rows for fields whose value another check reads, in its own words: anything is accepted
    here and nothing is filled in (the rows still name the fields, for check_unknown)."""
    return [Field(name, ANY, None, section) for name in names]


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    """A finite number from a document (never a bool): NaN and infinities are refused like
    out-of-range values (§1.3 item 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        isinstance(value, int) or math.isfinite(value))


def is_seconds(value, positive=False):
    """A duration or interval from a document: a finite number, at least 0 (more than 0 when
    `positive`)."""
    return is_number(value) and (value > 0 if positive else value >= 0)


ANY = Constraint(lambda value: True, "anything")
BOOLEAN = Constraint(lambda value: isinstance(value, bool), "a boolean", (bool,))
STRING = Constraint(lambda value: isinstance(value, str), "a string", (str,))
MAPPING = Constraint(lambda value: isinstance(value, dict), "a mapping", (dict,))
SEQUENCE = Constraint(lambda value: isinstance(value, list), "a sequence", (list,))
NON_NEGATIVE_INT = Constraint(lambda value: _whole(value) and value >= 0, "a non-negative integer",
                              (int,))
POSITIVE_INT = Constraint(lambda value: _whole(value) and value >= 1, "a positive integer", (int,))
SECONDS = Constraint(is_seconds, "a finite, non-negative number of seconds", (int, float))
POSITIVE_SECONDS = Constraint(lambda value: is_seconds(value, positive=True),
                              "a finite, positive number of seconds", (int, float))


# INTERPRETATION I-172 §4.4, §5.3.2, §6.1: null takes the default in agent configs and
# operator params (null_is_default); elsewhere it stands for "not given" only where there is no
# default, and a field with a default must hold a value of its type.
def check_fields(doc, cfg, table, path, null_is_default=False):
    """Every row of `table` ({name: Field}) against the mapping `cfg` at `path`; raises the
    located ConfigurationError for a missing required field or a value its constraint refuses.
    null_is_default: a null value takes the default whatever it is (the §4 agent tables)."""
    for field in table.values():
        if field.name not in cfg or cfg[field.name] is None and (
                null_is_default or field.default is None):
            if field.default is REQUIRED:
                raise doc.error(ConfigurationError, path + (field.name,),
                                f"{field.name} is required ({field.constraint.wording})",
                                field.section)
            continue
        if not field.constraint.test(cfg[field.name]):
            raise doc.error(ConfigurationError, path + (field.name,),
                            f"{field.name} must be {field.constraint.wording}", field.section)


def check_unknown(rt, cfg, known, path, section, note="unknown field '{key}' is ignored",
                  refuse=False, **names):
    """The one check for keys no row names: every key of the mapping `cfg` that is in none of the
    tables `known` (one table, or a tuple of them) is warned about through rt (None: logged only),
    located at the key, never dropped silently. `note` is the warning, `{key}` standing for the key
    (and `{name}` for each of `names`). Returns those keys; `refuse`: warns of none (the caller
    raises for them)."""
    extra = [key for key in cfg if key not in known] if not isinstance(known, tuple) else [
        key for key in cfg if not any(key in table for table in known)]
    for key in extra if not refuse else ():
        text = note.format(key=key, **names)
        if rt is None:
            warn(None, text, section=section, path=path + (key,))
        else:
            rt.warn(text, section=section, path=path + (key,))
    return extra


# §12.2.1 Message ------------------------------------------------------------------------
_IMMUTABLE = frozenset((str, int, float, bool, type(None), tuple, frozenset, bytes))
_SAME = object()        # Message.copy: "keep this field"


class Message:
    """A unit of data flowing through routes (§2, §12.2.1)."""

    __slots__ = ("content", "metadata", "source_stream", "timestamp")

    def __init__(self, content, metadata=None, source_stream="__input__", timestamp=0.0):
        self.content = content
        self.metadata = metadata if metadata is not None else {}
        self.source_stream = source_stream
        self.timestamp = timestamp

    def copy(self, *, content=_SAME, metadata=_SAME, source_stream=_SAME, timestamp=_SAME):
        """§12.2.1: metadata.context by reference, every other entry copied one level deep.

        Keyword arguments replace fields of the copy (a given `metadata` is used as is).
        """
        if metadata is _SAME:
            metadata = copy_metadata(self.metadata)
        return Message(self.content if content is _SAME else content, metadata,
                       self.source_stream if source_stream is _SAME else source_stream,
                       self.timestamp if timestamp is _SAME else timestamp)

    def __repr__(self):
        return f"Message({self.content!r}, source_stream={self.source_stream!r})"


def copy_metadata(metadata):
    """A message's metadata for its copy (§12.2.1): `context` by reference, every other value
    copied one level deep."""
    metadata = metadata.copy()
    if len(metadata) > 1 or "context" not in metadata:
        for key, value in metadata.items():     # replacing values keeps the dict's size
            if type(value) not in _IMMUTABLE and key != "context":
                metadata[key] = copy.copy(value)
    return metadata


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


# The CLI's wall clock (RealClock) is in HOST -- real clock, describe text and diagram.


class ComponentClock:
    """The Actor's clock as a composite's components see it (§4.6): the same time and timer
    queue, plus a note of the timers they set that have neither fired nor been cancelled, so
    that the composite knows whether its output component may still emit (§4.6.2 item 4)."""

    def __init__(self, clock):
        self.clock = clock
        self.real = clock.real
        self._live = set()

    def now(self):
        return self.clock.now()

    def call_at(self, when, fn):
        def fire():
            self._live.discard(timer)
            fn()
        timer = self.clock.call_at(when, fire)
        self._live.add(timer)
        return timer

    def call_later(self, delay, fn):
        return self.call_at(self.now() + max(0.0, delay), fn)

    def next_due(self):
        return self.clock.next_due()

    def advance(self, seconds):
        self.clock.advance(seconds)

    def set_time(self, at):
        self.clock.set_time(at)

    def waiting(self):
        """True while a timer set by the components is still due to fire."""
        self._live = {timer for timer in self._live if not timer.cancelled}
        return bool(self._live)


class PendingReply:
    """An agent's answer that comes later (§4.6.2: a composite whose output stream emits after
    the call returned). The caller registers then(on_value, on_error); exactly one of
    resolve(value) / fail(error) happens, once, and reaches it."""

    __slots__ = ("done", "value", "error", "callbacks")

    def __init__(self):
        self.done, self.value, self.error, self.callbacks = False, None, None, None

    def then(self, on_value, on_error):
        self.callbacks = (on_value, on_error)
        if self.done:
            self._notify()

    def resolve(self, value):
        self._settle(value, None)

    def fail(self, error):
        self._settle(None, error)

    def _settle(self, value, error):
        if self.done:
            return
        self.done, self.value, self.error = True, value, error
        self._notify()

    def _notify(self):
        if self.callbacks is None:
            return
        on_value, on_error = self.callbacks
        self.callbacks = None
        if self.error is None:
            on_value(self.value)
        else:
            on_error(self.error)


# Runtime: what agents, routes and operators may reach (one per Actor) ---------------------
class Runtime:
    """Registries and host settings shared by one Actor's parts (§12.1)."""

    def __init__(self, doc, *, unsafe=False, env=None, engine="JINJA2", workdir=None,
                 clock=None, provider=None, llm_transport=None, reference=False):
        self.doc = doc                      # Doc: data + marks, for located errors and warnings
        # The body's own code at every speed and containment seam (APPENDICES; ACTOR_REFERENCE)
        self.reference = bool(reference)
        self.unsafe = bool(unsafe)          # host mode (§13.1)
        self.env = dict(os.environ) if env is None else dict(env)   # §14 and §4.4.1 read only this
        self.engine = engine                # §9.2, canonical upper case
        # §4.5.4's "current working directory"
        self.workdir = Path(workdir or os.getcwd()).resolve()
        self.clock = clock or VirtualClock()
        self.provider = provider            # host override of every llm agent's provider ("fake")
        self.llm_transport = llm_transport  # vectors: a fake transport (see HOST, providers)
        self.llm_log = []                   # the last requests sent to providers (keep_last)
        self.context = {}                   # §10 the live global context
        self.agents = {}                    # name -> agent (§4)
        self.graphs = {}                    # name -> GraphRoute (§6)
        self.prompts = {}                   # name -> template text (§10.4)
        self.warnings = []                  # the warning texts, in order (keep_last)
        self.sandbox = InProcessSandbox()   # §13.2: where configuration code runs (isolation)
        self.default_router = None          # §3.4/§9.3: the route messages enter by default
        self.routing_prefixes = ()          # §12.5: host extensions of the strippable prefixes
        self.single_shot = False            # §12.2.4: a run over a known set of messages
        self.functions = {}                 # §5.3.3: transformers the host registers by name
        self.progress = None                # §4.5.6: the facility, made on first use
        self.file_write_lock = threading.Lock()   # §4.5.5: file writes take turns (§6.7)
        self.checkpoint_series = {}         # §6.6 a checkpoint directory -> its series (I-107)
        self.outer = None                   # a composite's runtime: the enclosing one, which
                                            # holds the progress bar and takes its warnings (§4.6)
        self.llm_observer = None            # HOST: called after each LLM call (--trace, -v)
        self.warned_conditions = set()      # §5.4.1: condition sites already warned about
        self.phase_a_reads = set()          # §8.2: names the documents' Phase A reads

    def warn(self, message, *, section=None, path=None):
        if self.outer is not None:      # a composite's components: located at their full path
            return self.outer.warn(message, section=section,
                                   path=None if path is None else self.doc.outer_path(path))
        return warn(self, message, section=section, path=path)


# =====================================================================================
# §3 DOCUMENT STRUCTURE
# =====================================================================================

# §3.1 File format -------------------------------------------------------------------------
# A YAML 1.2 document under the core schema: only its implicit types and tags, no merge keys
# (I-001), no duplicate keys, bounded nesting and alias expansion, UTF-8 text with no lone
# surrogate, and every refusal located. The values are built here from a parser's events; the
# parser is pyyaml's, made to read YAML 1.2 by appendix C.0 (parse_yaml -> yaml12_events).

# YAML 1.2 (6.9.1): what the non-specific tag `!` makes of each kind of node.
_NON_SPECIFIC_TAGS = {yaml.ScalarNode: "tag:yaml.org,2002:str",
                      yaml.SequenceNode: "tag:yaml.org,2002:seq",
                      yaml.MappingNode: "tag:yaml.org,2002:map"}
# INTERPRETATION I-164 §3.1: every YAML text (the document, Phase A's output,
# template bodies) goes through this one loader, with these two bounds.
# INTERPRETATION I-224 §3.1: the budget counts the nodes aliases add, not the
# document's own: 100,000 plain nodes load, a billion laughs does not.
YAML_ALIAS_BUDGET = 100_000         # nodes added by alias re-expansion, per document
# The one nesting bound: every later pass (§14 interpolation, Phase B, validation, copies) walks
# the document recursively, so a document deeper than this is refused here, located, instead of
# each walker guarding its own recursion. No configuration the standard describes comes near it.
YAML_MAX_DEPTH = 100

# The YAML 1.2 core schema: its tags, each with the form a scalar of it has (None: any text).
# INTERPRETATION I-001 §3.1: no merge-key type, so `<<` is an ordinary key (YAML 1.2 has no
# merge keys).
_CORE_SCHEMA = {
    "tag:yaml.org,2002:null": re.compile(r"~|null|Null|NULL|"),
    "tag:yaml.org,2002:bool": re.compile(r"true|True|TRUE|false|False|FALSE"),
    "tag:yaml.org,2002:int": re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+"),
    "tag:yaml.org,2002:float": re.compile(
        r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"),
    "tag:yaml.org,2002:str": None, "tag:yaml.org,2002:seq": None, "tag:yaml.org,2002:map": None,
}


def _scalar_value(tag, text):
    """A scalar's value by its resolved tag, whose core form (_CORE_SCHEMA) the text has."""
    if tag == "tag:yaml.org,2002:null":
        return None
    if tag == "tag:yaml.org,2002:bool":
        return text.lower() == "true"
    if tag == "tag:yaml.org,2002:int":      # 0o17, 0x1F: Python's int reads them in base 8, 16
        return int(text, {"0o": 8, "0x": 16}.get(text[:2], 10))
    if tag == "tag:yaml.org,2002:float":    # .inf, -.Inf, .NaN: Python's float says inf, nan
        return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))
    return text


def _yaml_key_identity(key):
    """A mapping key as YAML compares it: a value of its type, so `1`, `1.0` and
    `true` differ, and every `.nan` is the same key."""
    # INTERPRETATION I-225 §3.1: keys are equal when their YAML types and values are.
    if isinstance(key, float) and key != key:
        return (float, "nan")
    return (type(key), key)


def refuse_lone_surrogate(text, file=None):
    """INTERPRETATION I-167 §3.1: a lone surrogate is no text (UTF-8 cannot encode it): a located
    ConfigurationError, wherever a YAML text comes from (a file, Phase A's or Phase B's output)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        line = text.count("\n", 0, exc.start) + 1
        col = exc.start - (text.rfind("\n", 0, exc.start) + 1) + 1
        raise error(ConfigurationError, "document is not Unicode text: a lone surrogate "
                    f"U+{ord(text[exc.start]):04X}", "3.1", file=file, line=line, col=col) from None


def parse_yaml(text, file=None):
    """Text -> (data, marks). marks maps a config path tuple to (file, line, col) (1-based).
    The events come from pyyaml made to read YAML 1.2 (appendix C.0's yaml12_events)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(ConfigurationError, f"document is not UTF-8: {exc}", "3.1", file=file)
    refuse_lone_surrogate(text, file)
    try:
        return yaml12_events(text, file)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line, col = (where.line + 1, where.column + 1) if where is not None else (None, None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(ConfigurationError, f"document does not parse as YAML: {problem}", "3.1",
                    file=file, line=line, col=col) from None


def _parse_events(loader_class, text, file):
    """parse_yaml with one parser; its yaml.YAMLError goes to the caller."""
    # Values are built straight from the parser's events in one pass, with no node tree: the
    # parser keeps its own stack, and nothing else recurses with the document's nesting but
    # build(), which stops at YAML_MAX_DEPTH. (pyyaml's composer recursed in C without a bound:
    # 25,000 brackets crashed the process.) An alias builds a fresh copy of its anchor's value,
    # whose nodes count against YAML_ALIAS_BUDGET.
    loader = loader_class(text)
    next_event, resolve = loader.get_event, loader.resolve
    marks, order = {}, []       # order: the paths marked, in order (an anchor's are a stretch)
    anchors = {}                # anchor -> (value, [(relative path, mark)], nodes, depth)
    budget = YAML_ALIAS_BUDGET  # nodes aliases may still add
    built = 0                   # nodes constructed so far, aliases' copies included

    def at(event):
        return (file, event.start_mark.line + 1, event.start_mark.column + 1)

    # This parse's front of error() (a name it hides here): the §3.1 error at `event`'s mark.
    def error(message, event=None, path=None, deep=False):
        where = None if path is None else path_str(path[:3]) + " ..." if deep else path_str(path)
        _, line, col = at(event) if event else (file, None, None)
        return ConfigurationError(message, path=where, section="3.1", file=file, line=line, col=col)

    def mark(path, event):
        marks[path] = at(event)
        order.append(path)

    def core_tag(event, kind, value, implicit, path):
        tag = event.tag
        if tag == "!":      # YAML 1.2 (6.9.1): the non-specific tag: a string, sequence, mapping
            tag = _NON_SPECIFIC_TAGS[kind]
        elif tag is None:
            tag = resolve(kind, value, implicit)
        if tag not in _CORE_SCHEMA:
            raise error(f"tag '{tag}' is not part of the YAML 1.2 core schema", event, path)
        return tag

    def build(event, path):
        """The value that begins with `event`; the marks below `path` are recorded."""
        nonlocal built, budget
        if len(path) > YAML_MAX_DEPTH:
            raise error(f"document nests deeper than {YAML_MAX_DEPTH} levels", event, path, True)
        kind = type(event)
        if kind is yaml.AliasEvent:
            if event.anchor not in anchors:
                raise error(f"document does not parse as YAML: found undefined alias "
                            f"'{event.anchor}'", event)
            anchored = anchors[event.anchor]
            if anchored is None:
                raise error(f"alias '*{event.anchor}' stands inside its own anchor (a structure "
                            f"that contains itself)", event, path)
            value, below, nodes, depth = anchored
            built += nodes
            budget -= nodes
            if budget < 0:
                raise error(f"aliases expand the document by more than {YAML_ALIAS_BUDGET} nodes "
                            f"(alias bomb?)", event)
            if len(path) + depth > YAML_MAX_DEPTH:
                raise error(f"document nests deeper than {YAML_MAX_DEPTH} levels", event, path,
                            True)
            for relative, where in below:
                marks[path + relative] = where
                order.append(path + relative)
            return copy.deepcopy(value) if type(value) in (list, dict) else value
        built += 1
        anchor = event.anchor
        if anchor is not None:
            if anchor in anchors:
                raise error(f"document does not parse as YAML: found duplicate anchor "
                            f"'{anchor}'", event)
            anchors[anchor] = None          # being built: an alias to it inside is refused
            first_mark, first_built = len(order), built
        if kind is yaml.ScalarEvent:
            tag = core_tag(event, yaml.ScalarNode, event.value, event.implicit, path)
            form = _CORE_SCHEMA.get(tag)
            if form is not None and not form.fullmatch(event.value):    # `!!int 0x_`
                raise error(f"'{event.value}' is not a YAML 1.2 core-schema "
                            f"{tag.rsplit(':', 1)[-1]}", event, path)
            value = _scalar_value(tag, event.value)
        elif kind is yaml.SequenceStartEvent:
            core_tag(event, yaml.SequenceNode, None, event.implicit, path)
            value = []
            item = next_event()
            while type(item) is not yaml.SequenceEndEvent:
                index = path + (len(value),)
                mark(index, item)
                value.append(build(item, index))
                item = next_event()
        else:                               # a MappingStartEvent
            core_tag(event, yaml.MappingNode, None, event.implicit, path)
            value, seen = {}, set()
            item = next_event()
            while type(item) is not yaml.MappingEndEvent:
                if type(item) in (yaml.SequenceStartEvent, yaml.MappingStartEvent) or \
                        isinstance(key := build(item, path), (dict, list)):  # or an alias to one
                    raise error("mapping keys must be scalars", item, path)
                same = _yaml_key_identity(key)
                if same in seen:
                    raise error(f"duplicate mapping key '{key}'", item, path + (key,))
                if key in value:        # 1, 1.0 and true: distinct in YAML, one key in Python
                    raise error(f"mapping keys {next(k for k in value if k == key)!r} and "
                                f"{key!r} are distinct YAML values that this implementation "
                                f"cannot hold apart as keys", item, path + (key,))
                seen.add(same)
                mark(path + (key,), item)
                value[key] = build(next_event(), path + (key,))
                item = next_event()
        if anchor is not None:
            below = [(p[len(path):], marks[p]) for p in order[first_mark:]]
            anchors[anchor] = (value, below, built - first_built + 1,
                               max((len(p) for p, _ in below), default=0))
        return value

    try:
        next_event()                                    # the stream's start
        if loader.check_event(yaml.StreamEndEvent):
            return None, marks                          # no document at all
        next_event()                                    # the document's start
        root = next_event()
        mark((), root)
        data = build(root, ())
        next_event()                                    # the document's end
        if not loader.check_event(yaml.StreamEndEvent):
            raise error("document does not parse as YAML: but found another document",
                        loader.peek_event())
        return data, marks
    except RecursionError:
        raise error("document nests too deeply") from None
    finally:
        loader.dispose()


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
# The §3.2 sections as field rows. Each section's own content is checked under its banner; here
# only the shape of name, agents and routes (§11.1 items 1-2).
NON_EMPTY_MAPPING = Constraint(lambda value: isinstance(value, dict) and bool(value),
                               "a non-empty mapping", (dict,))
TOP_LEVEL_FIELDS = fields_by_name(
    Field("agents",           NON_EMPTY_MAPPING, REQUIRED, "11.1, §3.3"),
    Field("routes",           NON_EMPTY_MAPPING, REQUIRED, "11.1"),
    Field("merges",           ANY,               None,     "7.1"),
    Field("splits",           ANY,               None,     "7.2"),
    Field("templates",        ANY,               None,     "8.6"),
    Field("instances",        ANY,               None,     "8.7"),
    Field("context",          ANY,               None,     "10.1"),
    Field("prompts",          ANY,               None,     "10.4"),
    Field("pipelines",        ANY,               None,     "7.3"),
    Field("template_strings", ANY,               None,     "8.9"),
    Field("name",             STRING,            None,     "3.2"),
)
TOP_LEVEL_SECTIONS = {name: row.default is REQUIRED for name, row in TOP_LEVEL_FIELDS.items()}
# The §9 parameters a document may also give at the top level (each read by host_parameter).
HOST_PARAMETER_FIELDS = fields_by_name(
    *read_elsewhere("9.1", "cleveragents"), *read_elsewhere("9.6", "version"),
    *read_elsewhere("9.3", "default_router"), *read_elsewhere("9.2", "template_engine"))
# What a `cleveragents:` block may carry: the §9 parameters read from it (I-003), and the §9.5
# advisory fields, accepted and not acted on.
CLEVERAGENTS_FIELDS = fields_by_name(
    *read_elsewhere("9.3", "default_router"), *read_elsewhere("9.2", "template_engine"),
    *read_elsewhere("9.6", "version"), *read_elsewhere("9.5", "verbose", "logging"))


def host_parameter(doc, key, host_value):
    """A §9 parameter: the host's value, else a top-level key, else the cleveragents block.

    INTERPRETATION I-003 §9.1 (Q88): the host (API, command line) wins; a document may also carry
    `default_router` / `template_engine` at the top level or under `cleveragents:` (§9.2, §18.9).
    Returns (value, path of the value in the document).
    """
    if host_value is not None:
        return host_value, ()
    if key in doc.data:
        return doc.data[key], (key,)
    block = doc.data.get("cleveragents")
    if isinstance(block, dict) and key in block:
        return block[key], ("cleveragents", key)
    return None, ()


def check_top_level(doc, rt):
    """§3.1, §11.1 (item 1), §3.2, §16.1: the document is a mapping; known, forbidden and unknown
    sections."""
    if not isinstance(doc.data, dict):
        kind = "empty" if doc.data is None else type(doc.data).__name__
        raise doc.error(ConfigurationError, (), f"top-level value must be a mapping, not {kind}",
                        "3.1, §11.1")
    for key in doc.data:
        if key in FORBIDDEN_TOP_LEVEL:
            raise doc.error(ConfigurationError, (key,), f"top-level '{key}:' is forbidden; "
                            f"{FORBIDDEN_TOP_LEVEL[key]}", "16.1")
    # INTERPRETATION I-020 §3.2, §1.3 (Q87): unknown keys are ignored with a located warning.
    check_unknown(rt, doc.data, (TOP_LEVEL_FIELDS, HOST_PARAMETER_FIELDS), (), "3.2",
                  "unknown top-level section '{key}' is ignored")
    if isinstance(doc.data.get("routes"), list):
        raise doc.error(ConfigurationError, ("routes",), "list-form routes (from/to shorthand) are "
                        "forbidden; write routes as a mapping of name to route", "16.2, §5.1")
    check_fields(doc, doc.data, TOP_LEVEL_FIELDS, ())
    check_cleveragents_block(doc, rt)     # INTERPRETATION I-003 §9.1: the block's own keys


def check_cleveragents_block(doc, rt):
    """The §9 parameter block (I-003): a mapping; a key it does not carry is warned about, never
    dropped silently -- `unsafe` above all, which only context.global declares (§9.4)."""
    block = doc.data.get("cleveragents")
    if block is None:
        return
    if not isinstance(block, dict):
        raise doc.error(ConfigurationError, ("cleveragents",), "the cleveragents block must be a "
                        "mapping of §9 parameters", "9.1")
    if "unsafe" in block:
        rt.warn("`unsafe` is not read here: an Actor declares that it needs unsafe mode in "
                "context.global (§9.4); ignored", section="9.4", path=("cleveragents", "unsafe"))
    check_unknown(rt, block, (CLEVERAGENTS_FIELDS, {"unsafe": "warned above"}),
                  ("cleveragents",), "9.1",
                  "unknown parameter '{key}' in the cleveragents block is ignored")


# §3.3 Minimum valid document ------------------------------------------------------------
# The agents/routes minimum is check_top_level's (TOP_LEVEL_FIELDS). The rest of §3.3 is about
# observable output, not validity: a document whose links never reach __output__ loads, warned.
def warn_without_output(rt, known, default):
    """§3.3: some route, merge or split must publish to __output__ for anything to be observed (a
    graph route fed from the stream side emits its run's output on its own, I-086)."""
    data = rt.doc.data
    if any(target == "__output__" for _, target, _ in stream_edges(data, known, default)):
        return
    if any(route_type(cfg) == "graph" for cfg in data["routes"].values()):
        return
    rt.warn("no route, merge or split publishes to __output__; the Actor has no observable output",
            section="3.3", path=("routes",))


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
    """§3.4, §9.3, §11.1 (item 6): the designated route, or None when __input__ merges/splits feed
    routes.

    INTERPRETATION I-002 §3.4 (Q7): a merge or split from __input__ also satisfies the requirement
    (the §3.3 minimum Actor and every §18 example rely on it); with neither, a warning. A designated
    name that is not a route is an error.
    """
    name, path = host_parameter(doc, "default_router", host_value)
    if name is not None:
        if not isinstance(name, str) or name not in doc.data["routes"]:
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
def check_agent(rt, name, cfg, path):
    """§4.1, §4.2, §11.1 (items 3-4), §11.2, §15.4: one agent definition (after Phase B expansion),
    then its type's own checks (AGENT_CHECKS, §4.3)."""
    doc = rt.doc
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
    if kind == "template_instance":
        # §4.8: the tag marks an instance; Phase B replaces it, so one left here had no template.
        raise doc.error(ConfigurationError, path + ("type",),
                        "an agent of type template_instance needs `template` (or "
                        "`agent_template`) naming an entry of templates.agents", "4.8")
    if not isinstance(kind, str) or kind not in AGENT_TYPES:
        known = ", ".join(sorted(AGENT_TYPES))
        raise doc.error(ConfigurationError, path + ("type",),
                        f"unknown agent type '{kind}' (known: {known})", "11.2, §4.3")
    if kind == "composite" and "strategy" in cfg:
        raise doc.error(ConfigurationError, path + ("strategy",),
                        "composite agents must not declare strategy; use components and routing",
                        "4.6.3, §16.1")
    if cfg.get("config") is None:
        cfg["config"] = {}
    if not isinstance(cfg["config"], dict):
        raise doc.error(ConfigurationError, path + ("config",), "config must be a mapping",
                        "11.1")
    own = cfg["config"].get("context")
    for key in own if isinstance(own, dict) else ():
        if str(key).startswith("__"):           # §10.3: in every user context, not only global
            raise doc.error(ConfigurationError, path + ("config", "context", key),
                            f"context key '{key}' is reserved (keys starting with __)", "10.3")
        # INTERPRETATION I-026 §4.4.5, §10.3 (Q84): the host-only keys are refused in an agent's own
        # context as in context.global: an Actor never declares them.
        if key in HOST_ONLY_CONTEXT_KEYS:
            raise doc.error(ConfigurationError, path + ("config", "context", key),
                            f"'{key}' is set by the host, never by the Actor configuration",
                            HOST_ONLY_CONTEXT_KEYS[key])
    check = AGENT_CHECKS.get(kind)
    if check is not None:
        check(rt, name, cfg["config"], path + ("config",))


def agent_definitions(agents, path):
    """(name, cfg, path) of every checked agent definition under `agents`, a composite's local
    agents right after it (`ref` components are aliases, not definitions)."""
    for name, cfg in agents.items():
        yield name, cfg, path + (name,)
        if cfg["type"] == "composite":
            local = cfg["config"]["components"].get("agents") or {}
            yield from agent_definitions({n: c for n, c in local.items() if not is_agent_ref(c)},
                                         path + (name, "config", "components", "agents"))


# §4.2 Agent names ---------------------------------------------------------------------
AGENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_agent_name_style(rt, name, path):
    if isinstance(name, str) and not AGENT_NAME.fullmatch(name):
        rt.warn(f"agent name '{name}' is outside [A-Za-z_][A-Za-z0-9_]*", section="4.2", path=path)

# §4.4 LLM agents ----------------------------------------------------------------------
# The §4.4 field table (Field rows, read by check_config_fields). `model` defaults per provider
# (§4.4.2), `api_key` from the environment (§4.4.1).
LLM_TEMPERATURE_RANGE = (0.0, 2.0)
# INTERPRETATION I-025 §4.4 (Q77): a temperature outside [0.0, 2.0] is rejected at load.
TEMPERATURE = Constraint(lambda value: is_number(value) and (
    LLM_TEMPERATURE_RANGE[0] <= value <= LLM_TEMPERATURE_RANGE[1]), "a number from 0.0 to 2.0",
    (int, float))
MODEL_NAME = Constraint(lambda value: isinstance(value, str) and value.strip() != "",
                        "a non-empty string", (str,))
LLM_FIELDS = fields_by_name(
    Field("provider",        STRING,           "openai",                       "4.4"),
    Field("model",           MODEL_NAME,       None,                           "4.4.2"),
    Field("temperature",     TEMPERATURE,      0.7,                            "4.4"),
    Field("max_tokens",      POSITIVE_INT,     1000,                           "4.4"),
    Field("system_prompt",   STRING,           "You are a helpful assistant.", "4.4"),
    Field("memory_enabled",  BOOLEAN,          False,                          "4.4"),
    Field("max_history",     NON_NEGATIVE_INT, 10,                             "4.4.4"),
    Field("api_key",         STRING,           None,                           "4.4"),
    Field("template",        STRING,           None,                           "4.4"),
    Field("template_vars",   MAPPING,          {},                             "4.4"),
    Field("response_format", MAPPING,          None,                           "4.4"),
)

# Fields outside the §4.4 table that an llm agent also accepts: §4.9's per-agent context, and this
# implementation's extensions (§1.3 MAY): `base_url` (OpenAI-compatible servers) and the
# opt-in §12.4 tool-block processing (`tool_execute` + `tools`).
LLM_EXTRA_FIELDS = fields_by_name(
    Field("context",      MAPPING,  None,  "4.4"),
    Field("base_url",     STRING,   None,  "4.4"),
    Field("tool_execute", BOOLEAN,  False, "4.4"),
    Field("tools",        SEQUENCE, None,  "4.4"),
)

LLM_AGENT_FIELDS = {**LLM_FIELDS, **LLM_EXTRA_FIELDS}

# Capabilities (§4.11) every llm agent publishes; "structured-output" and "tool-execution" are
# added when the provider / configuration offers them.
LLM_CAPABILITIES = ["text-generation", "conversation", "reasoning", "analysis", "creative-writing"]


class ContextChain(ChainMap):
    """A context read through several mappings, the first that has a key winning (§4.9, Q79), with
    no copy made; it prints as the dict it stands for."""

    def __repr__(self):
        return repr(dict(self))


def message_text(content):
    """A message content as text (for a model, a tool request, §12.4 results): strings as they
    are, mappings and lists as JSON (non-ASCII kept), None as "", the rest via str()."""
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
    reads_context = True            # prompts render with it; history may come from it (§4.4.4)
    writes_context = False          # it only reads: the §6.2.2 node context needs no copies

    def __init__(self, name, cfg, rt, path):
        """Build from a configuration check_llm has passed (§12.1: validate, then create)."""
        self.name = name
        self.rt = rt
        self.path = tuple(path)
        values = field_values(cfg["config"], LLM_AGENT_FIELDS)
        self.temperature = float(values["temperature"])
        self.max_tokens = values["max_tokens"]
        self.system_prompt = values["system_prompt"]
        self.memory_enabled = values["memory_enabled"]
        self.max_history = values["max_history"]
        self.template = values["template"]
        self.template_vars = dict(values["template_vars"])
        self.response_format = copy.deepcopy(values["response_format"])    # logged as it is
        self.context = values["context"] if values["context"] is not None else {}
        self.tool_execute = values["tool_execute"]          # §12.4 (Q81): opt-in
        self.tools = list(values["tools"] or [])
        self.configured_provider, self.provider = resolve_provider(rt, values["provider"])
        self.model = values["model"] or DEFAULT_MODELS.get(self.configured_provider, self.provider)
        self._api_key = resolve_api_key(rt, self.provider, values["api_key"])
        self.base_url = values["base_url"]
        self.sleep = time.sleep             # retry back-off; tests inject a recorder
        self.jitter = random.random         # back-off jitter in [0, 1); tests pin it
        self.memory = ConversationMemory(self.max_history)
        self.last_usage = None              # token counts of the latest call, when reported
        adapter = PROVIDERS[self.provider]
        self.capabilities = list(LLM_CAPABILITIES)
        if adapter.structured:
            self.capabilities.append("structured-output")
        if self.tool_execute:
            self.capabilities.append("tool-execution")
        self.metadata = agent_metadata(
            self, provider=self.provider, model=self.model, temperature=self.temperature,
            max_tokens=self.max_tokens, memory_enabled=self.memory_enabled,
            supports_structured_output=bool(adapter.structured))

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
        message = message_text(content)
        # INTERPRETATION I-034 §4.4.6, §4.9 (Q79): the agent's context under the invocation context.
        # A view that reads through both, not a merged copy: a message costs the same whatever the
        # size of a context its prompts do not read.
        view = ContextChain(ctx, self.context) if self.context else ctx
        system = render_system_prompt(self, view, message)
        user = message
        if self.template is not None:
            user = message_text(render_runtime(
                rt, _llm_prompt_text(rt, self.template),
                ContextChain(self.template_vars, view) if self.template_vars else view, message,
                self.path + ("config", "template")))
        temperature = effective_temperature(self, ctx)
        if self.response_format is not None:
            check_structured_support(self, self.response_format)
        if self.memory_enabled:
            history = self.memory.snapshot()
        else:
            history = history_from_context(ctx)
            # INTERPRETATION I-030 §4.4.4: a graph's history already ends with the message in hand
            # (§6.2.2); it is sent once, not twice.
            if history and history[-1] == {"role": "user", "content": message}:
                history.pop()
        request = {
            "agent": self.name, "provider": self.provider, "model": self.model,
            "temperature": temperature, "max_tokens": self.max_tokens, "system": system,
            "messages": history + [{"role": "user", "content": user}],
            "response_format": self.response_format,
        }
        # The log entry: a dict of its own (the provider adds usage and retries to it) with a list
        # of its own. The entries are not copied: memory.snapshot() and history_from_context make
        # fresh ones for each request, holding text (or a reply memory keeps a copy of), and nothing
        # changes them later; the system prompt is text, response_format the agent's own copy.
        call = {**request, "messages": list(request["messages"])}
        keep_last(rt.llm_log, call)
        started = time.monotonic()
        try:
            if rt.llm_transport is not None:
                reply = rt.llm_transport.complete(request)
            else:
                reply = PROVIDERS[self.provider].complete(
                    request, key=self._api_key, base_url=self._base_url(), sleep=self.sleep,
                    jitter=self.jitter, record=call)
        except ExecutionError as exc:
            note_llm_call(rt, call, started, scrub_key(exc.message, self._api_key))
            reason = scrub_key(exc.message, self._api_key)
            raise error(ExecutionError, f"agent '{self.name}' (llm): {reason}",
                        exc.section or "4.4") from None
        note_llm_call(rt, call, started)
        self.last_usage = call.get("usage")     # the vendor's token counts, for the reply's map
        # A reply that comes after the caller timed out changes nothing: no memory, no §12.4
        # tools (§4.4.4 item 4 records successful invocations only).
        check_not_abandoned(f"agent '{self.name}' (llm)")
        output = reply
        if self.tool_execute:
            output = process_tool_blocks(rt, reply, self.tools, ctx)
        if self.memory_enabled:
            # INTERPRETATION I-028, I-029 §4.4.4 (Q78): the formatted message as sent, and the
            # response with its §12.4 blocks already replaced.
            self.memory.record(user, output)
        return output

    def _base_url(self):
        """Agent `base_url` > the provider's *_BASE_URL variables in rt.env > the vendor default."""
        # INTERPRETATION I-035 §4.4.1: `base_url` and the *_BASE_URL variables are extensions
        # (§1.3).
        if self.base_url:
            return self.base_url
        adapter = PROVIDERS[self.provider]
        for var in adapter.base_envs:
            if self.rt.env.get(var):
                return self.rt.env[var]
        return adapter.default_base


def check_llm(rt, name, config, cpath):
    """§4.4 (with §4.4.1-§4.4.3, §12.4): an llm agent's config, before any agent exists."""
    values = check_config_fields(rt, config, LLM_AGENT_FIELDS, cpath, "4.4", "llm agent")
    warn_unparsable_template(rt, values["system_prompt"], cpath + ("system_prompt",))
    if values["template"] is not None:
        _llm_check_template(rt, values["template"], cpath + ("template",))
    if values["response_format"] is not None:
        check_response_format(rt, values["response_format"], cpath + ("response_format",))
    check_tool_execute(rt, values["tools"], values["tool_execute"], cpath)
    # An unavailable provider fails agent creation, after every validation rule (check_providers);
    # such a provider needs no key and has no json_schema rule, so the checks below pass it.
    configured, provider = resolve_provider(rt, values["provider"])
    if values["response_format"] is not None:      # the vendor the document names (a host
        check_response_format_for(rt, configured,    # override does not make it conform)
                                  values["response_format"], cpath + ("response_format",))
    check_api_key(rt, provider, values["api_key"], cpath)
    if values["base_url"] is not None and not re.match(r"https?://", values["base_url"]):
        raise rt.doc.error(ConfigurationError, cpath + ("base_url",),
                           "base_url must be an http:// or https:// URL", "4.4")


def field_values(config, fields):
    """A checked config's values by its field table: absent or null fields take the default (a
    copy of a list or mapping, so no agent changes another's)."""
    return {name: (row.default if type(row.default) not in (list, dict)
                   else copy.deepcopy(row.default)) if config.get(name) is None else config[name]
            for name, row in fields.items()}


def check_config_fields(rt, config, fields, cpath, section, kind):
    """An agent config against its field table (check_fields, a null taking the default); unknown
    fields are ignored with a warning. Returns field -> value, defaults in."""
    check_fields(rt.doc, config, fields, cpath, null_is_default=True)
    check_unknown(rt, config, fields, cpath, section, "unknown {kind} field '{key}' is ignored",
                  kind=kind)
    return field_values(config, fields)


def _llm_prompt_text(rt, name):
    """§10.4: the content of prompt `name` (rt.prompts, else the document's long-form entry)."""
    if name in rt.prompts:
        return rt.prompts[name]
    prompts = rt.doc.data.get("prompts") if isinstance(rt.doc.data, dict) else None
    return prompt_content(prompts.get(name) if isinstance(prompts, dict) else None)


def _llm_check_template(rt, name, path):
    # INTERPRETATION I-033 §4.4 (Q85): a `template` naming no registered prompt is rejected at load.
    if _llm_prompt_text(rt, name) is None:
        raise rt.doc.error(ConfigurationError, path,
                           f"template '{name}' names no prompt in the prompts section", "4.4, 10.4")

# §4.4.1 Providers -----------------------------------------------------------------------
# The §4.4.1 table: provider -> environment variables consulted in order (first non-empty wins).
# The adapters that speak to each vendor are in HOST -- providers (PROVIDERS).
PROVIDER_KEY_VARS = {
    "openai":    ("OPENAI_API_KEY",),
    "anthropic": ("ANTHROPIC_API_KEY",),
    "google":    ("GOOGLE_API_KEY", "GOOGLEAI_API_KEY"),
}


def resolve_provider(rt, configured):
    """§4.4.1: (configured provider, provider used). Names compare case-insensitively; the host
    override (rt.provider, e.g. `fake` from `--provider fake`) replaces every llm agent's."""
    configured = configured.strip().lower()
    return configured, str(rt.provider).strip().lower() if rt.provider else configured


def check_providers(rt, agents):
    """§4.4.1 with §12.1: an llm agent (a composite's too) whose provider, configured or the
    host's override, is not available fails agent creation: an AgentCreationError, reported
    after every validation rule has passed, as creating the agent would."""
    # INTERPRETATION I-024 §4.4.1 (Q76): availability is checked before the key (a provider that
    # is not available has no key variables, so check_api_key passed it).
    for name, cfg, path in agent_definitions(agents, ("agents",)):
        if cfg["type"] != "llm":
            continue
        configured, used = resolve_provider(
            rt, field_values(cfg["config"], LLM_AGENT_FIELDS)["provider"])
        if configured not in PROVIDERS:
            raise rt.doc.error(AgentCreationError, path + ("config", "provider"),
                               f"provider '{configured}' is not available in this host "
                               f"(available: {', '.join(sorted(PROVIDERS))})", "4.4.1")
        if used not in PROVIDERS:
            raise error(AgentCreationError, f"host provider override '{used}' is not available "
                        f"(available: {', '.join(sorted(PROVIDERS))})", "4.4.1")


def resolve_api_key(rt, provider, explicit):
    """§4.4.1: the `api_key` field, else the provider's variables in rt.env, in order (None when
    neither gives one; `fake` needs none)."""
    if explicit:
        return explicit
    return next((rt.env[var] for var in PROVIDER_KEY_VARS.get(provider, ()) if rt.env.get(var)),
                None)


def check_api_key(rt, provider, explicit, cpath):
    """§4.4.1 at load: a provider that needs a key and finds none is a ConfigurationError naming
    the variables."""
    variables = PROVIDER_KEY_VARS.get(provider, ())
    if variables and resolve_api_key(rt, provider, explicit) is None:
        # INTERPRETATION I-023 §4.4.1 (Q75): reported at load, before any message.
        raise rt.doc.error(ConfigurationError, cpath,
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
        raise rt.doc.error(ConfigurationError, path + ("type",),
                           "response_format needs a string 'type'", "4.4.3")
    if kind != "json_schema":
        return
    block = rf.get("json_schema")
    if not isinstance(block, dict):
        raise rt.doc.error(ConfigurationError, path + ("json_schema",),
                           "response_format of type json_schema needs a 'json_schema' mapping",
                           "4.4.3")
    if not isinstance(block.get("schema"), dict):
        raise rt.doc.error(ConfigurationError, path + ("json_schema", "schema"),
                           "json_schema needs a 'schema' mapping (a JSON Schema)", "4.4.3")
    if "name" in block and not isinstance(block["name"], str):
        raise rt.doc.error(ConfigurationError, path + ("json_schema", "name"),
                           "json_schema.name must be a string", "4.4.3")
    if "strict" in block and not isinstance(block["strict"], bool):
        raise rt.doc.error(ConfigurationError, path + ("json_schema", "strict"),
                           "json_schema.strict must be a boolean", "4.4.3")


# Provider rules a §4.4.3 block must meet to be "conformant to the provider's mechanism".
OPENAI_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_response_format_for(rt, provider, rf, path):
    """§4.4.3 at load: OpenAI's json_schema requires a `name` of 1-64 letters, digits, _ or -."""
    # INTERPRETATION I-032 §4.4.3: "conformant to the provider's mechanism" is checked at load where
    # a vendor states a hard rule: OpenAI requires json_schema.name; the others have no slot for it.
    if provider != "openai" or rf.get("type") != "json_schema":
        return
    name = rf["json_schema"].get("name")
    if not isinstance(name, str) or not OPENAI_SCHEMA_NAME.fullmatch(name):
        raise rt.doc.error(ConfigurationError, path + ("json_schema", "name"),
                           "openai needs json_schema.name of 1-64 characters from A-Z a-z 0-9 _ -",
                           "4.4.3")


def check_structured_support(agent, rf):
    """§4.4.3: a provider without a structured-output mechanism for this `type` is an execution
    error, signalled per invocation (the adapters' `structured` sets say what each can do)."""
    # INTERPRETATION I-031 §4.4.3: "does not support" is judged per provider and response_format
    # type.
    adapter = PROVIDERS[agent.provider]
    if rf.get("type") not in adapter.structured:
        can = ", ".join(sorted(adapter.structured)) or "none"
        raise error(ExecutionError, f"agent '{agent.name}' (llm): provider '{agent.provider}' "
                    f"has no structured output of type '{rf.get('type')}' (supported: {can})",
                    "4.4.3")


# §4.4.4 Memory and history -------------------------------------------------------------
class ConversationMemory:
    """§4.4.4: the remembered {role, content} entries, at most `max_history` of them.

    Thread-safe: graph nodes may invoke one agent concurrently.
    """

    # INTERPRETATION I-022 §4.4.4 (Q6): max_history counts entries (a user/assistant pair is two).

    def __init__(self, max_history):
        self.max_history = max_history
        self.entries = []
        self._lock = threading.Lock()

    def snapshot(self):
        with self._lock:
            return [dict(entry) for entry in self.entries]

    def record(self, user, assistant):
        """Append one exchange (only after a successful call), then keep the newest entries."""
        if not isinstance(assistant, str):      # a structured reply: memory keeps its own copy
            assistant = copy.deepcopy(assistant)
        with self._lock:
            self.entries.append({"role": "user", "content": user})
            self.entries.append({"role": "assistant", "content": assistant})
            if len(self.entries) > self.max_history:
                del self.entries[:len(self.entries) - self.max_history]


def history_from_context(ctx):
    """§4.4.4: with memory off, `conversation_history` from the invoking context, for this call
    only.

    Entries are mappings with `role` and `content`.
    """
    # INTERPRETATION I-030 §4.4.4: role `assistant` stays, `system` entries are left out (the
    # agent's own system prompt fills that slot), any other role (graph node names, `human`) is sent
    # as `user`.
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
                        "content": message_text(item["content"])})
    return entries


# §4.4.5 Temperature override -----------------------------------------------------------
def effective_temperature(agent, ctx):
    """§4.4.5: `_temperature_override` in the invocation context replaces the configured value."""
    override = ctx.get("_temperature_override")
    if override is None:
        return agent.temperature
    # INTERPRETATION I-027 §4.4.5: an override that is no number in [0, 2] fails this call only.
    low, high = LLM_TEMPERATURE_RANGE
    if isinstance(override, bool) or not isinstance(override, (int, float)) \
            or not low <= override <= high:
        raise error(ExecutionError, f"agent '{agent.name}' (llm): _temperature_override "
                    f"{override!r} is not a number in [{low}, {high}]", "4.4.5")
    return float(override)


# §4.4.6 System prompt rendering -------------------------------------------------------
def render_system_prompt(agent, view, message):
    """§4.4.6: the system prompt rendered with `context` and `message` (Phase C, §8.11); on a
    render failure render_runtime warns and hands back the literal prompt."""
    return message_text(render_runtime(agent.rt, agent.system_prompt, view, message,
                                    agent.path + ("config", "system_prompt")))


# §4.5 Tool agents -----------------------------------------------------------------------
# The tool agent: §4.5 fields and defaults, §4.11 capabilities and metadata for tools. Its parts
# follow: the built-ins (§4.5.1), inline tools (§4.5.2), the request protocol (§4.5.3), the
# path rules (§4.5.4, §13.3), file_write (§4.5.5), the progress bar (§4.5.6), output (§4.5.7),
# and the shell extension (§13.5).

# The §4.5 field table (Field rows, read by check_config_fields).
TOOL_AGENT_FIELDS = fields_by_name(
    Field("tools",       SEQUENCE,         [],    "4.5"),
    Field("safe_mode",   BOOLEAN,          True,  "4.5"),
    Field("allow_shell", BOOLEAN,          False, "4.5"),
    Field("timeout",     POSITIVE_SECONDS, 1,     "4.5"),
    Field("context",     MAPPING,          {},    "4.5"),
)

# The §4.11 capability identifiers a tool agent publishes, by the tool that brings them.
TOOL_CAPABILITIES = {
    "math": "math-evaluation",
    "http_request": "http-requests",
    "file_read": "file-operations",
    "file_write": "file-operations",
    "shell": "command-execution",
}


class ToolLimits:
    """The fixed side of a tool call, settled once per agent (§4.5): safe_mode, allow_shell,
    timeout, the agent's persistent `context` (or None for a caller without one), and the name
    a tool failure carries."""

    __slots__ = ("safe_mode", "allow_shell", "timeout", "context", "who")

    def __init__(self, *, safe_mode=True, allow_shell=False, timeout=1, context=None, who="tool"):
        self.safe_mode = safe_mode
        self.allow_shell = allow_shell
        self.timeout = timeout
        self.context = context
        self.who = who


class ToolEnv:
    """What one tool call may reach: the runtime, the invocation context and the agent's limits."""

    __slots__ = ("rt", "ctx", "limits", "_view")

    def __init__(self, rt, ctx, limits):
        self.rt = rt
        self.ctx = ctx if isinstance(ctx, dict) else {}     # the invocation context (host keys)
        self.limits = limits
        self._view = None

    safe_mode = property(lambda self: self.limits.safe_mode)
    allow_shell = property(lambda self: self.limits.allow_shell)
    timeout = property(lambda self: self.limits.timeout)
    who = property(lambda self: self.limits.who)

    @property
    def view(self):
        """The agent context overlaid by the invocation context (invocation wins, Q79).

        Merged when a tool first reads it (most built-ins never do); a tool reads it before
        changing anything, so it is the mapping a merge at the start of the call would give."""
        if self._view is None:
            base = self.limits.context
            self._view = self.ctx if base is None else {**base, **self.ctx}
        return self._view

    def error(self, message, section="4.5"):
        """A tool failure: an ExecutionError naming the agent (it reaches __error__, §12.2.3)."""
        # INTERPRETATION I-043 §4.5.1 (Q65): every tool failure, rejection or operational, is an
        # ExecutionError, so that it reaches __error__ with a category instead of passing as output.
        return error(ExecutionError, message, section, path=self.limits.who)

    @property
    def unsafe_invocation(self):
        """`_unsafe_mode: true` in the invocation context (§4.5.4, §10.3); set by the host."""
        return self.ctx.get("_unsafe_mode") is True

    @property
    def unsafe_host(self):
        """§13.3 unsafe mode: an unsafe host AND `_unsafe_mode: true` in the invocation."""
        return self.rt.unsafe and self.unsafe_invocation


class ToolAgent:
    """§4.5 `type: tool`: deterministic tools (built-in or inline code), no language model.

    {type: tool, config: {tools: [echo, {name: n, code: ...}], safe_mode: true, allow_shell: false,
    timeout: 1, context: {}}}

    `timeout` bounds inline code (the sandbox's budget), http_request and shell; the other
    built-ins do work bounded by their input (math refuses results beyond MATH_MAX_BITS).
    """

    type = "tool"

    def __init__(self, name, cfg, rt, path):
        """Build from a configuration check_tool_agent has passed (§12.1)."""
        self.name = name
        self.rt = rt
        self.path = tuple(path)
        values = field_values(cfg["config"], TOOL_AGENT_FIELDS)
        self.safe_mode = values["safe_mode"]
        self.allow_shell = values["allow_shell"]
        self.timeout = values["timeout"]
        self.context = values["context"]          # §4.5 per-agent persistent context
        self.tools = {}                           # tool name -> InlineTool, or None for a built-in
        for index, entry in enumerate(values["tools"]):
            tool, code = tool_entry(entry)
            self.tools[tool] = None if code is None else InlineTool(
                self, tool, code, self.path + ("config", "tools", index))
        self.capabilities = ["tool-execution"]
        for tool in self.tools:
            capability = TOOL_CAPABILITIES.get(tool)
            if capability and capability not in self.capabilities:
                self.capabilities.append(capability)
        if self.allow_shell and "command-execution" not in self.capabilities:
            self.capabilities.append("command-execution")
        self.metadata = agent_metadata(self, tools=list(self.tools), allow_shell=self.allow_shell,
                                       safe_mode=self.safe_mode, timeout=self.timeout)
        # Settled once here, read by every request (§4.5.3): the only tool when there is exactly
        # one, whether that one is inline code, and the name tool failures carry.
        self.sole_tool = next(iter(self.tools)) if len(self.tools) == 1 else None
        self.sole_inline = self.sole_tool is not None and self.tools[self.sole_tool] is not None
        self.who = f"agent '{name}' (tool)"
        self.reads_context = self.allow_shell or any(
            tool.reads_context if tool is not None else tool_name not in CONTEXT_FREE_TOOLS
            for tool_name, tool in self.tools.items())
        # Built-ins only read the context; inline code that can reach it may also write it.
        self.writes_context = any(tool is not None and tool.reads_context
                                  for tool in self.tools.values())
        self.limits = ToolLimits(safe_mode=self.safe_mode, allow_shell=self.allow_shell,
                                 timeout=self.timeout, context=self.context, who=self.who)
        # The CONTEXT_FREE_TOOLS never read env.ctx or env.view: one environment serves all
        # their calls.
        self.free_env = ToolEnv(rt, None, self.limits)

    def invoke(self, content, ctx):
        """§4.5.3: decode the request, run the named tool, return its §4.5.7 string."""
        if self.sole_inline:        # step 1: the whole message is the one inline tool's input
            text = content if content.__class__ is str else message_text(content)
            return tool_output(self.tools[self.sole_tool].call(text, self.rt, ctx, self.limits))
        name, args, input_data = tool_request(self, content)
        return self.run_tool(name, args, ctx, input_data)

    def run_tool(self, name, args, ctx, input_data=None):
        """Run one allowed tool by name with normalised `args` (also used by §12.4)."""
        inline = self.tools.get(name)
        env = self.free_env if inline is None and name in CONTEXT_FREE_TOOLS \
            else ToolEnv(self.rt, ctx, self.limits)
        if inline is None and name not in self.tools:
            if name == "shell" and self.allow_shell:
                pass                              # §13.5: allow_shell makes `shell` available
            else:
                raise env.error(f"tool '{name}' is not in the agent's tools list", "4.5.3")
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
    env = ToolEnv(rt, ctx, ToolLimits(who=who))
    handler = BUILTIN_TOOLS.get(name)
    if handler is None:
        raise env.error(f"unknown tool '{name}'", "12.4")
    return tool_output(handler(env, tool_args(args)))

# §4.5.1 Built-in tools ------------------------------------------------------------------
# A handler is `tool_<name>(env, args) -> value`; `args` is a mapping of named arguments whose
# key "args" (when present) holds the positional list (§4.5.3 JSON `args` list, command form).

def tool_args(raw):
    """Normalise a request's `args`: a mapping stays, a list becomes {"args": list}."""
    if isinstance(raw, (list, tuple)):
        return {"args": list(raw)}
    if isinstance(raw, dict):
        return dict(raw)
    return {} if raw is None else {"args": [raw]}


def tool_argument(args, name, index=0):
    """The named argument, else the positional one at `index`, else None (`x OR args[i]`)."""
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
        if len(positional) == 1 and type(positional[0]) is str:
            return positional[0]                 # one plain string: the join would give it back
        return " ".join(map(str, positional))
    return None


def tool_echo(env, args):
    """§4.5.1 echo: the input verbatim.

    {tool: echo, args: {text: <s>}} | {tool: echo, args: [<s>, ...]} | `echo <words>`
    """
    # INTERPRETATION I-044 §4.5.1 (Q64): several positional arguments are joined with single spaces,
    # the same for the JSON `args` list and the space-separated command form.
    text = tool_rest(args, "text")
    return "" if text is None else text


def tool_math(env, args):
    """§4.5.1 math: evaluate an arithmetic expression; only abs round min max sum pow int float.

    {tool: math, args: {expression: "2 + 2 * 3"}} | `math 2+2*3`   -> "8"
    """
    # INTERPRETATION I-045 §4.5.1: positional arguments are joined by spaces, so that the command
    # form `math 2 + 2` (split on spaces by §4.5.3) gives the expression "2 + 2".
    expression = tool_rest(args, "expression")
    if not isinstance(expression, str) or not expression.strip():
        raise env.error("math needs an `expression` string", "4.5.1")
    return math_evaluate(expression, env)


# The restricted arithmetic environment of §4.5.1 `math`: these names and nothing else.
MATH_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sum": sum, "pow": pow,
                  "int": int, "float": float}
MATH_OPERATORS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: pow,
}
# INTERPRETATION I-046, I-163 §4.5.1: an AST walk over numbers only; integers and the work of
# one expression are bounded, so one message costs milliseconds.
MATH_MAX_BITS = 4096          # no integer, given or computed, beyond 4096 bits (about 1233 digits)
MATH_MAX_WORK = 1 << 32       # bit operations one expression may cost (milliseconds, not more)


class MathWork:
    """T1 (README Security): the math tool answers any message in bounded time. Every operation
    is priced in bit operations before it runs, on its inputs (schoolbook cost), and an
    expression may spend at most MATH_MAX_WORK; no integer exceeds MATH_MAX_BITS."""

    __slots__ = ("env", "spent")

    def __init__(self, env):
        self.env, self.spent = env, 0

    def error(self, what):
        return self.env.error(f"math: {what}", "4.5.1")

    def number(self, value):
        if isinstance(value, int) and value.bit_length() > MATH_MAX_BITS:
            raise self.error(f"an integer beyond {MATH_MAX_BITS} bits")
        return value

    def spend(self, *operands, cost=None):
        bits = [x.bit_length() if isinstance(x, int) else 64 for x in operands]
        self.spent += cost if cost is not None else max(1, bits[0]) * max(1, bits[-1])
        if self.spent > MATH_MAX_WORK:
            raise self.error("the expression costs more work than the tool allows")


def math_evaluate(expression, env):
    """Walk the AST of `expression`; the raw string is never given to eval()."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise env.error(f"math: invalid expression ({exc.msg})", "4.5.1") from None
    except (RecursionError, MemoryError, ValueError):
        raise env.error("math: expression nested too deeply or too long", "4.5.1") from None
    try:
        value = _math_node(tree.body, MathWork(env))
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise env.error(f"math: {type(exc).__name__}: {exc}", "4.5.1") from None
    except RecursionError:
        raise env.error("math: expression nested too deeply", "4.5.1") from None
    return str(value)


def _math_power(work, base, exponent, modulus=None):
    """pow and **, priced on their inputs: the result's size, or exponent x modulus^2 bits."""
    if modulus is not None:
        work.spend(cost=max(1, abs(exponent).bit_length()) * max(1, modulus.bit_length()) ** 2
                   if isinstance(modulus, int) and isinstance(exponent, int) else 1)
        return work.number(pow(base, exponent, modulus))
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        result_bits = exponent * (abs(base).bit_length() - 1)
        if result_bits > MATH_MAX_BITS:
            raise work.error(f"an integer beyond {MATH_MAX_BITS} bits")
        work.spend(cost=result_bits * result_bits)
    return work.number(pow(base, exponent))


def _math_round(work, number, ndigits=None):
    """round, with ndigits bounded: round(n, -k) on an int builds 10**k first."""
    if isinstance(ndigits, int) and abs(ndigits) > MATH_MAX_BITS:
        raise work.error(f"round() digits beyond {MATH_MAX_BITS}")
    work.spend(number, cost=abs(ndigits or 0) ** 2 + 1)
    return work.number(round(number) if ndigits is None else round(number, ndigits))


def _math_node(node, work):
    match node:
        case ast.Constant(value=value) if type(value) in (int, float):
            return work.number(value)
        case ast.UnaryOp(op=ast.USub() | ast.UAdd() as op, operand=operand):
            value = _math_node(operand, work)
            if type(value) not in (int, float):
                raise work.error("operators apply to numbers only")
            return -value if isinstance(op, ast.USub) else value
        case ast.BinOp(left=left, op=op, right=right) if type(op) in MATH_OPERATORS:
            a, b = _math_node(left, work), _math_node(right, work)
            if not all(type(x) in (int, float) for x in (a, b)):
                # lists exist only as function arguments: `[1] * 10**9` must never allocate
                raise work.error("operators apply to numbers only")
            if isinstance(op, ast.Pow):
                return _math_power(work, a, b)
            if isinstance(op, ast.Mult) and isinstance(a, int) and isinstance(b, int) \
                    and a.bit_length() + b.bit_length() > MATH_MAX_BITS + 1:
                raise work.error(f"an integer beyond {MATH_MAX_BITS} bits")
            work.spend(a, b)
            return work.number(MATH_OPERATORS[type(op)](a, b))
        case ast.List(elts=items) | ast.Tuple(elts=items):
            return [_math_node(item, work) for item in items]
        case ast.Call(func=ast.Name(id=name), args=call_args, keywords=[]) \
                if name in MATH_FUNCTIONS:
            values = [_math_node(arg, work) for arg in call_args]
            if name == "pow" and 2 <= len(values) <= 3:
                return _math_power(work, *values)
            if name == "round" and 1 <= len(values) <= 2:
                return _math_round(work, *values)
            work.spend(cost=sum(len(v) if isinstance(v, list) else 1 for v in values) * 64)
            return work.number(MATH_FUNCTIONS[name](*values))
        case ast.Name(id=name) | ast.Call(func=ast.Name(id=name)):
            raise work.error(f"name '{name}' is not available")
    raise work.error(f"{type(node).__name__} is not allowed in an arithmetic expression")


def tool_json_parse(env, args):
    """§4.5.1 json_parse: parse JSON text and re-serialise it with two-space indentation.

    {tool: json_parse, args: {json: '{"a":1}'}} | `json_parse {"a":1}`
    """
    text = tool_rest(args, "json")
    if text is None:
        raise env.error("json_parse needs a `json` string", "4.5.1")
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise env.error(f"json_parse: invalid JSON ({exc.msg} at line {exc.lineno} "
                           f"column {exc.colno})", "4.5.1") from None
        except RecursionError:
            raise env.error("json_parse: JSON nested too deeply", "4.5.1") from None
    else:
        value = text                              # already-decoded JSON given as the argument
    # INTERPRETATION I-047 §4.5.1: non-ASCII characters are written as themselves (ensure_ascii
    # off).
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except RecursionError:
        raise env.error("json_parse: JSON nested too deeply", "4.5.1") from None


def tool_http_request(env, args):
    """§4.5.1 http_request over urllib; returns "Status: <code>\\n\\n<body>".

    {tool: http_request, args: {url: <u>, method: GET, headers: {..}, data: {..}}}
    """
    import urllib.error, urllib.request   # on first use: start-up pays for none
    url = tool_argument(args, "url", 0)
    method = tool_argument(args, "method", 1) or "GET"
    headers = args.get("headers") or {}
    if not isinstance(url, str) or not url:
        raise env.error("http_request needs a `url` string", "4.5.1")
    # INTERPRETATION I-048 §4.5.1, §13.4: http and https only; proxies from rt.env.
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        # file:, ftp: and data: URLs would step around the §13.3 file rules
        raise env.error("http_request accepts only http and https URLs", "13.4")
    if not isinstance(headers, dict):
        raise env.error("http_request `headers` must be a mapping", "4.5.1")
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
            status, payload, answer_headers = response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:          # 4xx/5xx still answer: report them as such
        status, payload, answer_headers = exc.code, exc.read(), exc.headers
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise env.error(f"http_request to {url} failed: {reason}", "4.5.1") from None
    charset = (answer_headers.get_content_charset() if answer_headers else None) or "utf-8"
    try:
        body = payload.decode(charset, errors="replace")
    except LookupError:                            # a charset name Python does not know
        body = payload.decode("utf-8", errors="replace")
    return f"Status: {status}\n\n{body}"


def http_proxies(rt, url):
    """Proxies from the Actor's environment (rt.env, never os.environ), honouring no_proxy."""
    import urllib.error, urllib.request   # on first use: start-up pays for none
    env = rt.env
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
        raise env.error(f"file_read: no such file: {given}", "4.5.1") from None
    except UnicodeDecodeError:
        raise env.error(f"file_read: {given} is not UTF-8 text", "4.5.1") from None
    except OSError as exc:
        raise env.error(f"file_read: cannot read {given}: {exc.strerror}", "4.5.1") from None
    # INTERPRETATION I-049 §4.5.1 (Q67): <path> is the path as given; Lines counts splitlines() (an
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
    if not is_known(mode, FILE_WRITE_MODES):
        raise env.error(f"file_write: unknown mode '{mode}' (w, a or insert)", "4.5.5")
    target = tool_path(env, given, "file_write")
    with file_write_lock(env.rt):
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
# The built-ins that never read the invocation context (env.ctx, env.view, _unsafe_mode): a tool
# agent using only these cannot tell which context it was handed, so an agent node does not build
# one for it (ToolAgent.reads_context, §6.2.2).
CONTEXT_FREE_TOOLS = frozenset({"echo", "math", "json_parse", "http_request"})

# §4.5.2 Inline tools ------------------------------------------------------------------
# INTERPRETATION I-051 §4.5.2, §4.5.6: item 5's facility is a `progress_bar` function.
# The §4.5.2 names: what an inline body sees besides the §13.2.1 built-ins, and where
# `result` falls back to. INLINE_PROGRESS names the §4.5.6 item 5 entry point:
# `progress_bar(current=3, total=10, stage="draft", message="intro")` returns the rendered line.
INLINE_RESULT_FALLBACKS = ("output", "response", "answer")
INLINE_PROGRESS = "progress_bar"


def inline_input(args):
    """input_data for an inline tool named in a JSON request: `args`, JSON-encoded if not text."""
    # INTERPRETATION I-054 §4.5.3 (Q63): an inline tool called by name gets the request's `args`
    # (JSON-encoded when not a string; space-joined in the command form), not the whole message.
    if args is None:
        return ""
    return args if isinstance(args, str) else json.dumps(args)


def check_tool_agent(rt, name, config, cpath):
    """§4.5-§4.5.2: a tool agent's config, checked before any agent exists."""
    # INTERPRETATION I-041 §4.5 (Q86): `tools` is required; a tool agent without it is rejected at
    # load, because the table says "Required: Yes" and such an agent could only ever fail.
    if "tools" not in config:
        raise rt.doc.error(ConfigurationError, cpath, f"tool agent '{name}' needs a `tools` list",
                           "4.5")
    if config["tools"] is None:
        raise rt.doc.error(ConfigurationError, cpath + ("tools",),
                           "'tools' must be a list of tools", "4.5")
    values = check_config_fields(rt, config, TOOL_AGENT_FIELDS, cpath, "4.5", "tool agent")
    if not values["tools"]:
        rt.warn(f"tool agent '{name}' lists no tools; every request will fail",
                section="4.5", path=cpath + ("tools",))
    seen = set()
    for index, entry in enumerate(values["tools"]):
        path = cpath + ("tools", index)
        tool = check_tool_entry(rt, entry, path)
        if tool in seen:
            raise rt.doc.error(ConfigurationError, path,
                               f"tool '{tool}' is listed twice; tool names are unique per agent",
                               "4.5.2")
        seen.add(tool)


# The fields of a §4.5.2 inline tool (their shapes are checked below, with the tool's name).
INLINE_TOOL_FIELDS = fields_by_name(Field("name", STRING, REQUIRED, "4.5.2"),
                                    Field("code", STRING, None,     "4.5.2"))


def check_tool_entry(rt, entry, path):
    """One element of `tools`: a built-in name, or a mapping {name, code} (§4.5.1, §4.5.2);
    returns the tool's name."""
    if isinstance(entry, str):
        # INTERPRETATION I-042 §4.5.1: an unknown name is refused at load; names are case-sensitive.
        if entry not in BUILTIN_TOOLS and entry not in EXTENSION_TOOLS:
            raise rt.doc.error(ConfigurationError, path, f"unknown built-in tool '{entry}' "
                               f"(known: {', '.join([*BUILTIN_TOOLS, *EXTENSION_TOOLS])})", "4.5.1")
        return entry
    if not isinstance(entry, dict):
        raise rt.doc.error(ConfigurationError, path,
                           "a tool is a built-in name or a mapping {name, code}", "4.5")
    name, code = entry.get("name"), entry.get("code")
    if not isinstance(name, str) or not name:
        raise rt.doc.error(ConfigurationError, path + ("name",),
                           "an inline tool needs a non-empty string `name`", "4.5.2")
    if code is None and (name in BUILTIN_TOOLS or name in EXTENSION_TOOLS):
        return name                       # {name: math} is the mapping form of `math`
    if not isinstance(code, str):
        raise rt.doc.error(ConfigurationError, path + ("code",),
                           f"inline tool '{name}' needs a string `code` body", "4.5.2")
    check_unknown(rt, entry, INLINE_TOOL_FIELDS, path, "4.5.2",
                  "unknown inline tool field '{key}' is ignored")
    if name in BUILTIN_TOOLS or name in EXTENSION_TOOLS:
        # INTERPRETATION I-063 §16.3 (Q5): accepted; the inline tool shadows the built-in,
        # with a warning, because the rule's own parenthesis says the inline tool wins.
        rt.warn(f"inline tool '{name}' shadows the built-in tool of the same name",
                section="16.3", path=path + ("name",))
    # INTERPRETATION I-050 §4.5.2 (Q72): an inline tool on a safe host is refused at load with
    # UnsafeConfigurationError, because §1.3(2) wants configuration faults before any message
    # and §20 describes exactly this category.
    if not rt.unsafe:
        raise rt.doc.error(UnsafeConfigurationError, path + ("code",),
                           f"inline tool '{name}' runs code, which needs the host in unsafe mode",
                           "4.5.2, 13.1")
    compile_code(code, rt=rt, path=path + ("code",))        # the §13.2.1 allowlist
    return name


def tool_entry(entry):
    """A checked `tools` element as (name, inline code body or None for a built-in)."""
    if isinstance(entry, str):
        return entry, None
    return entry["name"], entry.get("code")


class InlineTool:
    """§4.5.2 an inline-code tool: compiled once at load in the §13.2.1 sandbox, run per call.

    {name: <tool_name>, code: <python body that sets `result`>}
    """

    def __init__(self, agent, name, code, path):
        rt = agent.rt                 # check_tool_entry has refused it on a safe host
        self.name = name
        self.unit = compile_code(code, rt=rt, path=path + ("code",))
        # Code that never names `context`, `locals` or `progress_bar` cannot read the context,
        # so a graph node need not build one for it (§6.2.2, I-117).
        self.reads_context = not isinstance(self.unit, CodeUnit) or self.unit.reaches_context
        fast = None if rt.reference else straight_line_call(self, rt)   # appendix A.4
        if fast is not None:
            self.call = fast

    def run(self, input_data, env):
        """Run the body with input_data, message, context (by reference) and result=None."""
        # INTERPRETATION I-052, I-158 §4.5 vs §4.5.2 (Q79): the body sees the agent context overlaid
        # by the invocation context (invocation wins); keys it sets or deletes land in the
        # invocation context (the global one in streams) as they are written, so later steps see
        # them (§4.5.7) -- unless the call was abandoned by its timeout (§5.3.4).
        progress = progress_function(env)
        base = env.limits.context
        variables = {"input_data": input_data, "message": input_data, "result": None,
                     "context": env.ctx if base is None else ContextView(env.ctx, base),
                     INLINE_PROGRESS: progress}
        return env.rt.sandbox.run_code(self.unit, variables, env.timeout, progress)

    def call(self, input_data, rt, ctx, limits):
        """run() for a caller that holds no ToolEnv (a tool agent's sole tool)."""
        return self.run(input_data, ToolEnv(rt, ctx, limits))


def inline_result(namespace):
    """§4.5.2 item 4: `result`, else the first of output, response, answer set, else ""."""
    result = namespace.get("result")
    if result is None:
        result = next((namespace[name] for name in INLINE_RESULT_FALLBACKS
                       if namespace.get(name) is not None), "")
    return result

# §4.5.3 Tool invocation protocol -------------------------------------------------------
INVALID_JSON_IN_TOOL_REQUEST = "Invalid JSON in tool request"     # §4.5.3 step 3, verbatim


def tool_request(agent, content):
    """§4.5.3 steps 1-4: decode a message into (tool name, args, input_data or None).

    Step 5 (the name must be an allowed tool) is checked when the tool is run.
    """
    tools = agent.tools
    if content.__class__ is str:        # the usual message: text, not a mapping
        text, parsed = content, None
    else:
        text = content if isinstance(content, str) else message_text(content)
        parsed = content if isinstance(content, dict) else None
    # INTERPRETATION I-053 §4.5.3 step 1 (Q62): "exactly one inline-code tool" means the agent's
    # only tool is inline; with built-ins beside it, every tool is reached by name (else the listed
    # built-ins could never run).
    if agent.sole_inline:
        return agent.sole_tool, None, text
    # Only text whose first non-blank character is "{" can decode to a mapping with a `tool` key;
    # anything else reaches the command form without paying for a failed json.loads.
    if parsed is None and text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):     # RecursionError: absurdly deep nesting
            stripped = text.strip()
            if stripped.startswith("{") and stripped.endswith("}"):
                raise error(ExecutionError, INVALID_JSON_IN_TOOL_REQUEST,
                            path=agent.who, section="4.5.3") from None
    if parsed is not None and isinstance(parsed, dict) and "tool" in parsed:
        name = parsed["tool"]
        if not isinstance(name, str):
            raise error(ExecutionError, "the `tool` key of a tool request must be a tool name",
                        path=agent.who, section="4.5.3")
        return name, parsed.get("args"), None
    # INTERPRETATION I-054 §4.5.3 (Q63): valid JSON without a `tool` key falls through to the
    # command form, as written.
    head = text.split(None, 1)          # the first word; the rest is split only when needed
    name = head[0] if head else ""
    if agent.sole_tool is not None and name not in tools and name not in BUILTIN_TOOLS \
            and name not in EXTENSION_TOOLS:
        # INTERPRETATION I-055 §3.3 vs §4.5.3 (Q8): when the first word names no tool at all and the
        # agent has a single (built-in) tool, that tool gets the whole message, so that the §3.3
        # echo Actor "accepts any message"; a word naming another tool still fails (step 5).
        return agent.sole_tool, [text], text
    rest = head[1].split() if len(head) > 1 else []
    # input_data serves an inline tool only (I-054): no join for a built-in
    return name, rest, " ".join(rest) if tools.get(name) is not None else None

# §4.5.4 Safe-mode restrictions ------------------------------------------------------------
# The agent layer of the path rules (`safe_mode`); the host layer is §13.3, and tool_path()
# there applies both (Q69). The shell blocklist is enforced in §13.5 in every mode.
SHELL_BLOCKLIST = ("rm", "del", "format", "shutdown", "reboot", "kill")   # case-insensitive


def path_facts(given):
    """(absolute?, contains `..`?, starts with `~`?) for a path string, / or \\ separated."""
    absolute = Path(given).is_absolute() or given.startswith(("/", "\\")) \
        or bool(re.match(r"^[A-Za-z]:", given))
    return absolute, ".." in given, given.startswith("~")


def safe_mode_refusal(env, given, op):
    """§4.5.4: why the agent's `safe_mode` rules refuse `given` for `op`, or None."""
    absolute, traversal, tilde = path_facts(given)
    if op == "file_write" and not env.unsafe_invocation:
        return "file_write requires `_unsafe_mode: true` in the invocation context"
    if not env.safe_mode:
        return None
    # INTERPRETATION I-056 §4.5.4: "paths containing .." as written: the two characters anywhere in
    # the path, so `v1..2.txt` is refused too, not only a `..` component.
    if traversal:
        return f"{op} rejects `..` in paths"
    if op == "file_read" and absolute and not env.unsafe_invocation:
        return ("file_read rejects absolute paths unless the invocation context has "
                "`_unsafe_mode: true`")
    if op == "file_write" and tilde:
        return "file_write rejects paths beginning with ~"
    return None

# §4.5.5 file_write modes ---------------------------------------------------------------
# The §4.5.5 success messages, verbatim apart from the placeholders.
FILE_WRITE_WROTE = "Successfully wrote {n} characters to {path}"
FILE_WRITE_APPENDED = "Successfully appended {n} characters to {path}"
FILE_WRITE_INSERTED = "Successfully inserted {n} characters at line {line} in {path}"

# INTERPRETATION I-059 §4.5.5 (Q66): <n> counts the content as given; <path> is the path as given;
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
        raise env.error(f"file_write: cannot read {given}: {exc}", "4.5.5") from None


def file_store(env, target, given, text, mode="w"):
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, mode, encoding="utf-8", newline="") as handle:
            handle.write(text)
    except OSError as exc:
        raise env.error(f"file_write: cannot write {given}: {exc.strerror or exc}", "4.5.5") \
            from None


def file_write_w(env, target, given, content, position):
    """Mode w (default): overwrite the file with the content."""
    file_store(env, target, given, content)
    return FILE_WRITE_WROTE.format(n=len(content), path=given)


def file_write_a(env, target, given, content, position):
    """Mode a: append; content starting with `#` (a Markdown section) gets a blank line first."""
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
        raise env.error(f"file_write: position must be \"start\", \"end\" or a line number, "
                       f"not {position!r}", "4.5.5")
    return min(max(position, 1), count + 1)


def file_write_lock(rt):
    """The Actor's one file_write lock (a composite's components share it through `outer`):
    append and insert read the file, then write it back, so writes from parallel graph branches
    (§6.7) take turns, and none loses another's text."""
    while rt.outer is not None:
        rt = rt.outer
    return rt.file_write_lock


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

# INTERPRETATION I-061 §4.5.6: argument names, then context hooks, then the snapshot.
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
        # INTERPRETATION I-060 §4.5.6 (Q80): the bar goes to the host's standard output (None:
        # sys.stdout, looked up at each write) unless the host chooses another channel, `stream`
        # (the command line does with --json, whose stdout carries JSON only). The tool returns
        # the rendered line.
        self.stream = stream
        self.lock = threading.Lock()
        self.stage, self.current, self.total, self.message = None, 0, 1, None
        self.last = None
        self.open_line = False      # the last bar ended without a newline (below 100%)

    def channel(self):
        return self.stream if self.stream is not None else sys.stdout

    def close_line(self, stream):
        """End a bar left open on `stream` before the host prints a line there itself."""
        with self.lock:
            if self.open_line and self.channel() is stream:
                stream.write("\n")
                self.open_line = False

    def update(self, args, view, env=None):
        """Merge `args` (§4.5.1 names), context hooks and snapshot; emit; return the line."""
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
            stream = self.channel()
            stream.write("\r" + line + ("\n" if current >= total else ""))    # item 4
            stream.flush()
            self.open_line = current < total
        return line


def progress_number(value, env=None):
    """A count from an argument: numbers as they are, numeric strings parsed, lists counted."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return len(value)
    if is_number(value):                  # finite: a NaN or infinite count renders no bar
        return value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and number == number and abs(number) != float("inf"):
            return int(number) if number.is_integer() else number
    message = f"progress_bar: {value!r} is not a number"
    raise env.error(message, "4.5.6") if env is not None else error(ExecutionError, message,
                                                                    "4.5.6")


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
    """The Actor's one facility, created on first use (hosts may set rt.progress beforehand).

    A composite's components reach the same one through their runtime's `outer` link."""
    while rt.outer is not None:
        rt = rt.outer
    if rt.progress is None:
        rt.progress = ProgressFacility()
    return rt.progress


def progress_function(env):
    """§4.5.6 item 5: the entry point inline code calls, bound to this invocation's context."""
    facility = progress_facility(env.rt)

    def progress_bar(current=None, total=None, stage=None, message=None, **more):
        named = dict(more, current=current, total=total, stage=stage, message=message)
        return facility.update({k: v for k, v in named.items() if v is not None}, env.view, env)

    return progress_bar

# §4.5.7 Tool output conventions -------------------------------------------------------
# INTERPRETATION I-062 §4.5.7: the canonical string is str(); None gives "".
def tool_output(value):
    """§4.5.7: a tool's value as a string: None -> "", strings as they are, the rest via str()."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)

# §4.6 Composite agents ----------------------------------------------------------------
COMPONENT_KINDS = {"agent": "agents", "graph": "graphs", "stream": "streams"}
# Per §4.11: the capability a graph or stream component publishes (agents publish their own list).
COMPONENT_CAPABILITIES = {"graphs": "stateful-workflow", "streams": "reactive-processing"}


# The §4.6 config fields.
# INTERPRETATION I-016 §4.6: expose_params is a mapping, published in metadata; overriding happens
# only through template parameters (§8.10).
COMPOSITE_FIELDS = fields_by_name(
    Field("components",    MAPPING, REQUIRED, "4.6, §4.6.1"),
    Field("routing",       MAPPING, REQUIRED, "4.6.2"),
    Field("expose_params", MAPPING, None,     "4.6"),
    Field("context",       MAPPING, None,     "4.9"),
)
# routing's own fields (§4.6.2); `strategy` is named so that its own warning (I-169) stands alone.
COMPOSITE_ROUTING_FIELDS = fields_by_name(*read_elsewhere("4.6.2", "input", "output", "strategy"))


def check_composite(rt, name, config, path):
    """§4.6.1-§4.6.3, §16.1-§16.2: components, explicit routing, no strategy."""
    doc = rt.doc
    check_composite_restrictions(doc, config, path)
    check_config_fields(rt, config, COMPOSITE_FIELDS, path, "4.6", "composite agent")
    components = config["components"]
    for key, value in components.items():
        if key not in COMPONENT_KINDS.values():
            raise doc.error(ConfigurationError, path + ("components", key),
                            f"unknown component kind '{key}' (agents, graphs, streams)", "4.6.1")
        if value is not None and not isinstance(value, dict):
            raise doc.error(ConfigurationError, path + ("components", key), "must be a mapping",
                            "4.6.1")
    local_agents = components.get("agents") or {}
    for local, sub in local_agents.items():
        lpath = path + ("components", "agents", local)
        if is_agent_ref(sub):
            check_agent_ref(doc, local, sub, lpath, composite_scope(doc, path), local_agents)
        else:
            check_agent(rt, local, sub, lpath)
    routing = config["routing"]
    for end in ("input", "output"):
        spec = routing.get(end)
        if not isinstance(spec, dict) or "type" not in spec or "name" not in spec:
            raise doc.error(ConfigurationError, path + ("routing", end),
                            f"routing.{end} must be the explicit form {{type, name}} "
                            "(the shorthand form is forbidden)", "4.6.2, §16.2")
        kind = COMPONENT_KINDS[spec["type"]] if is_known(spec["type"], COMPONENT_KINDS) else None
        if kind is None:
            raise doc.error(ConfigurationError, path + ("routing", end, "type"),
                            f"routing type must be agent, graph or stream, not '{spec['type']}'",
                            "4.6.2")
        if not isinstance(spec["name"], str) or spec["name"] not in (components.get(kind) or {}):
            raise doc.error(ConfigurationError, path + ("routing", end, "name"),
                            f"'{spec['name']}' is not a component in components.{kind}", "4.6.2")
    if "strategy" in routing:       # INTERPRETATION I-169 §4.6.3: warned, not refused, here
        rt.warn("routing.strategy has no meaning (the routing is input and output); it is "
                "ignored", section="4.6.3, §16.1", path=path + ("routing", "strategy"))
    check_unknown(rt, routing, COMPOSITE_ROUTING_FIELDS, path + ("routing",), "4.6.2",
                  "unknown routing field '{key}' is ignored")
    check_component_routes(rt, config, path)


def component_runtime(rt, components, routes, doc, path, clock):
    """The Runtime a composite's components (at `path`, its config in `doc`) are checked and built
    in: the outer one's settings, logs, context, prompts and sandbox; errors and warnings about
    routes.<local> name the component's full path (ComponentDoc)."""
    sub_doc = ComponentDoc({"agents": dict(components.get("agents") or {}), "routes": routes},
                           doc, path)
    inner = Runtime(sub_doc, unsafe=rt.unsafe, env=rt.env, engine=rt.engine, workdir=rt.workdir,
                    clock=clock, provider=rt.provider, llm_transport=rt.llm_transport,
                    reference=rt.reference)
    inner.llm_log, inner.warnings, inner.context, inner.prompts = (
        rt.llm_log, rt.warnings, rt.context, rt.prompts)
    inner.sandbox, inner.checkpoint_series = rt.sandbox, rt.checkpoint_series
    inner.outer = rt        # Actor-wide facilities (the §4.5.6 progress bar) live out there
    inner.default_router = None
    inner.routing_prefixes = rt.routing_prefixes
    return inner


class CompositeComponents:
    """§4.6: a composite's nested agents, graphs and streams, behind the one agent interface that
    CompositeAgent (§4.6.2) gives them.

    {type: composite, config: {components: {agents, graphs, streams}, routing: {input, output},
    expose_params: {...}}}
    """
    # The components live in a Runtime of their own whose agents are the local ones over the outer
    # ones (§8.7.1 scope order, looked up live, so an outer agent defined after the composite is
    # found); it shares the outer clock, context, prompts and settings. Local agents are created
    # with the composite (a `{ref: name}` component is an AgentRef to an agent in scope); its
    # graphs and streams are wired on first use, once every outer agent exists (their static checks
    # ran at validation).

    type = "composite"
    reads_context = True            # its components get the context

    def __init__(self, name, cfg, rt, path):
        self.name, self.rt = name, rt
        # Agents and graphs inside get their absolute paths; the stream checks speak of
        # routes.<local>, which ComponentDoc maps back under this agent's path.
        outer_doc = rt.doc.outer if isinstance(rt.doc, ComponentDoc) else rt.doc
        self.path = rt.doc.outer_path(path) if isinstance(rt.doc, ComponentDoc) else tuple(path)
        config = cfg["config"]
        components = config["components"]
        self.routes = component_routes(components)
        self.clock = ComponentClock(rt.clock)      # notes the timers the components set
        self.inner = inner = component_runtime(rt, components, self.routes, outer_doc,
                                               self.path + ("config",), self.clock)
        local = {}
        inner.agents = ChainMap(local, rt.agents)
        for lname, sub in (components.get("agents") or {}).items():
            if is_agent_ref(sub):
                local[lname] = AgentRef(lname, sub["ref"], inner.agents)
            else:
                local[lname] = make_agent(inner, lname, sub,
                                          self.path + ("config", "components", "agents", lname))
        self.local_agents = local
        self.routing = config["routing"]
        self.expose_params = dict(config.get("expose_params") or {})
        self._lock = threading.RLock()
        self.network, self._emitted, self._errors = None, {}, []
        self._built = not self.routes
        self._components = {kind: sorted(components.get(kind) or {})
                            for kind in ("agents", "graphs", "streams")}

    @property
    def capabilities(self):
        """§4.11, computed when asked, since a `ref` component may be declared after us."""
        # INTERPRETATION I-017 §4.11: "composite", then the union of the local agents' capabilities,
        # then stateful-workflow per graph and reactive-processing per stream (no repeats).
        caps = ["composite"]
        for cap in [cap for agent in self.local_agents.values() for cap in agent.capabilities] + \
                [COMPONENT_CAPABILITIES[COMPONENT_KINDS[r["type"]]] for r in self.routes.values()]:
            if cap not in caps:
                caps.append(cap)
        return caps

    @property
    def metadata(self):
        return agent_metadata(self, components=copy.deepcopy(self._components),
                              expose_params=dict(self.expose_params))

    def _build(self):
        """Wire the graphs and streams (§12.1 steps 4-6 inside the composite), once."""
        with self._lock:
            if self._built:
                return
            inner = self.inner
            for local, route in self.routes.items():
                if route["type"] == "graph":
                    gpath = self.path + ("config", "components", "graphs", local)
                    inner.graphs[local] = GraphRoute(local, route, inner, gpath)
            self._emitted = {local: [] for local, route in self.routes.items()
                             if route["type"] == "stream"}
            self._errors = []
            if self._emitted:
                self.network = StreamNetwork(inner)
                for local, seen in self._emitted.items():
                    self.network.subscribe(local, seen.append)
                self.network.on_error(self._errors.append)
                last = self.routing["output"]
                if last["type"] == "stream":
                    self.network.subscribe(last["name"], self._on_output)
            self._built = True

    def close(self):
        """§12.1 step 8 inside the composite: its wiring, graph workers and nested composites."""
        # Not under self._lock: a timed-out request may still hold it for as long as its call
        # lasts (§5.3.4), and closing must not wait for that; the Actor's own lock already keeps
        # close() apart from live requests.
        if self.network is not None:
            self.network.close()
        for graph in list(self.inner.graphs.values()):
            graph.close()
        for agent in self.local_agents.values():
            if isinstance(agent, CompositeAgent):
                agent.close()

# §4.6.1 Components -----------------------------------------------------------------------


def component_routes(components):
    """§4.6.1: a composite's graphs and streams as `routes` entries, `type` filled in."""
    routes = {}
    for kind in ("graphs", "streams"):
        for local, route in (components.get(kind) or {}).items():
            if isinstance(route, dict) and (route.get("type") is None
                                            or route_type(route) == kind[:-1]):
                route = dict(route, type=kind[:-1])        # §11.3(2): case-insensitive
            routes[local] = route
    return routes


def check_component_routes(rt, config, path):
    """§4.6.1: a composite's graphs and streams get the checks of the top-level sections, in its
    scope (§8.7.1: local agents, then the Actor's)."""
    doc = rt.doc
    components = config["components"]
    both = set(components.get("graphs") or {}) & set(components.get("streams") or {})
    if both:
        raise doc.error(ConfigurationError, path + ("components", "streams", sorted(both)[0]),
                        f"'{sorted(both)[0]}' is both a graph and a stream component", "4.6.1")
    routes = component_routes(components)
    for local, route in routes.items():
        kind = "graphs" if local in (components.get("graphs") or {}) else "streams"
        if str(local).startswith("__"):      # as top-level route names (§5.1, §15.4)
            raise doc.error(ConfigurationError, path + ("components", kind, local),
                            f"component name '{local}' is reserved (names starting with __)",
                            "15.4, §4.6.1")
        if not isinstance(route, dict):
            raise doc.error(ConfigurationError, path + ("components", kind, local),
                            "must be a mapping", "4.6.1")
        if route_type(route) != kind[:-1]:
            raise doc.error(ConfigurationError, path + ("components", kind, local, "type"),
                            f"a component under {kind} is a {kind[:-1]}, not "
                            f"'{route.get('type')}'", "4.6.1")
    if not routes:
        return
    agent_names = composite_scope(doc, path)
    inner = component_runtime(rt, components, routes, doc, path, rt.clock)
    sub_doc = inner.doc
    graphs = [local for local, route in routes.items() if route["type"] == "graph"]
    known = set(routes) | set(RESERVED_STREAM_NAMES)
    for local, route in routes.items():         # §5.5 inside the composite, as check_routes
        for field in ("subscriptions", "publications"):
            value = route.get(field)
            if value is not None and not isinstance(value, list):
                raise sub_doc.error(ConfigurationError, ("routes", local, field),
                                    "must be a sequence", "5.5")
            for i, target in enumerate(value or []):
                if not is_known(target, known):
                    raise sub_doc.error(ConfigurationError, ("routes", local, field, i),
                                        f"'{target}' is not a component of the composite or a "
                                        "built-in stream", "4.6.1, §5.5")
    for local in graphs:
        check_graph(inner, local, routes[local], ("routes", local), agent_names)
    check_streams(inner, agent_names, graphs)

# §4.6.2 Routing --------------------------------------------------------------------------
COMPOSITE_REQUEST = "composite_request"   # metadata mark of a composite's request, inside it


# INTERPRETATION I-012 §4.6.2 (Q73): when input and output differ, the input component's result is
# handed to the output component -- unless the output component is a stream that the input's
# flow already reached, whose emission is then the response.
# INTERPRETATION I-013 §4.6.2: a stream component's response is the last message it emits for
# the request; one that emits nothing and holds nothing (a filter said no) answers the empty
# string (§4.5.7's rule); one that may still emit (a timer or a reduce) answers when it does
# (invoke_later, the late-output methods below).
class CompositeAgent(CompositeComponents):
    """§4.6.2: the processing logic: dispatch to the input component, let the flow run, collect the
    output component's response. One request at a time goes through the wiring."""

    def __init__(self, name, cfg, rt, path):
        super().__init__(name, cfg, rt, path)
        # Item 4: calls whose output stream emits later ([request id, PendingReply, timeout
        # timer], oldest first), the request in synchronous dispatch, and whether a stream
        # component holds messages until completion (reduce) rather than a timer.
        self._pending, self._seq, self._current = [], itertools.count(1), None
        self._holds = any(isinstance(op, dict) and op.get("type") == "reduce"
                          for route in self.routes.values() if route.get("type") == "stream"
                          for op in as_list(route.get("operators")))

    def _dispatch(self, spec, content, ctx):
        kind, name = spec["type"], spec["name"]
        if kind == "agent":
            return self.inner.agents[name].invoke(content, ctx)
        if kind == "graph":
            return self.inner.graphs[name].run(content, ctx).output
        ctx = self.rt.context if ctx is None else ctx
        self.network.send(content, target=name,
                          metadata={"context": ctx, COMPOSITE_REQUEST: (id(self), self._current)})
        return None      # stream results are read from self._emitted

    def invoke(self, content, ctx):
        """§4.6.2: dispatch to the input component, collect the output component's response.

        A caller that cannot take a PendingReply gets the later output by waiting for it on the
        real clock (bounded by the §5.3.4 hard timeout); the virtual clock cannot pass inside a
        call, so there only what is due now (a zero delay) still answers, else the empty string
        (what a silent stream answers)."""
        reply = self.invoke_later(content, ctx)
        if not isinstance(reply, PendingReply):
            return reply
        clock = self.rt.clock
        if clock.real:
            deadline = clock.now() + AGENT_HARD_TIMEOUT
            while not reply.done and (due := clock.next_due()) is not None and due <= deadline:
                clock.advance(max(0.0, due - clock.now()))
        else:
            clock.advance(0)            # what is due now (a zero delay) still answers this call
        if not reply.done:
            self._settle_request(reply, "")
        if reply.error is not None:
            raise error(ExecutionError, f"agent '{self.name}' (composite): {PROCESSING_TIMED_OUT}",
                        "4.6.2, §5.3.4")
        return reply.value

    def invoke_later(self, content, ctx):
        """invoke(), except that an output stream which emits after the call returned (a delay,
        debounce, sample, timed buffer or reduce inside) gives a PendingReply, settled with
        what it emits, or failed by the §5.3.4 hard timeout (the stream map takes these)."""
        # Entered again by a parallel branch of its own request: an error, not a deadlock (§6.7).
        held = hold_in_chain(self, f"agent '{self.name}' (composite)")
        try:
            return self._invoke(content, ctx)
        finally:
            release_in_chain(held)

    def _invoke(self, content, ctx):
        self._build()
        first, last = self.routing["input"], self.routing["output"]
        with self._lock:                          # one request at a time through the wiring
            outer, self._current = self._current, next(self._seq)
            try:
                marks = {local: len(seen) for local, seen in self._emitted.items()}
                errors = len(self._errors)
                result = self._dispatch(first, content, ctx)
                if first["type"] == "stream":
                    result = self._stream_reply(first["name"], marks)
                if (last["type"], last["name"]) != (first["type"], first["name"]):
                    reached = last["type"] == "stream" and \
                        len(self._emitted[last["name"]]) > marks[last["name"]]
                    if not reached:
                        marks = {local: len(seen) for local, seen in self._emitted.items()}
                        result = self._dispatch(last, result, ctx)
                    if last["type"] == "stream":
                        result = self._stream_reply(last["name"], marks)
                failed = self._errors[errors:]
                if (not failed and last["type"] == "stream"
                        and len(self._emitted[last["name"]]) == marks[last["name"]]
                        and (self.clock.waiting() or self._holds)):
                    result = self._wait_for_output(self._current)
            finally:
                self._current = outer
        # §12.2.3: a failure inside the wiring reaches the caller (then the outer __error__).
        if failed:
            raise error(ExecutionError, f"agent '{self.name}' (composite): {failed[0].content}",
                        "4.6.2")
        return result

    # -- output that comes later (§4.6.2 item 4) ------------------------------------------
    # INTERPRETATION I-013 §4.6.2 (new): when the output stream emitted nothing for a request but
    # still may (a timer of the components is pending, or a reduce holds messages), the call
    # completes when it does: the emission carrying the request's mark answers it, and calls
    # waiting from before it, which the stream passed over (a debounce dropped them), answer
    # "". An unmarked emission (a reduce's total at completion) answers the oldest waiting
    # call. Unanswered after the §5.3.4 hard timeout: "Processing timed out". When the Actor
    # completes, the components complete first, so buffered output still reaches its call.
    def _wait_for_output(self, request):
        reply = PendingReply()
        entry = [request, reply, None]
        entry[2] = self.rt.clock.call_later(AGENT_HARD_TIMEOUT,
                                            lambda: self._expire(entry))
        self._pending.append(entry)
        return reply

    def _on_output(self, msg):
        """A message on the output stream: answer the waiting call it belongs to."""
        with self._lock:
            mark = msg.metadata.get(COMPOSITE_REQUEST)
            mine = isinstance(mark, tuple) and len(mark) == 2 and mark[0] == id(self)
            if mine and mark[1] == self._current:
                return                          # the call in progress reads it itself
            if not mine and self._current is not None:
                return
            ids = [entry[0] for entry in self._pending]
            if mine and mark[1] in ids:
                cut = ids.index(mark[1])
            elif not mine and ids:
                cut = 0
            else:
                self.rt.warn(f"composite '{self.name}': its output stream emitted after the "
                             "call it answers had completed; the message has no caller",
                             section="4.6.2")
                return
            passed, entry = self._pending[:cut], self._pending[cut]
            for older in passed:
                self._settle_request(older[1], "")
            self._settle_request(entry[1], msg.content)

    def _settle_request(self, reply, value, error=None):
        for entry in self._pending:
            if entry[1] is reply:
                self._pending.remove(entry)
                entry[2].cancel()
                break
        if error is not None:
            reply.fail(error)
        else:
            reply.resolve(value)

    def _expire(self, entry):
        with self._lock:
            if entry in self._pending:
                self._settle_request(entry[1], None, _AgentTimedOut())

    def finish_pending(self):
        """The Actor's input completed (§5.5): complete the components, so that a reduce or a
        buffer hands its output to the calls waiting for it; calls still waiting answer ""."""
        with self._lock:
            if not self._pending:
                return
            if self.network is not None:
                self.network.complete()
            for entry in list(self._pending):
                self._settle_request(entry[1], "")

    def _stream_reply(self, name, marks):
        emitted = self._emitted[name][marks[name]:]
        return emitted[-1].content if emitted else ""

# §4.6.3 Restrictions ---------------------------------------------------------------------
def check_composite_restrictions(doc, config, path):
    """§4.6.3, §16.1: a composite's config declares no strategy (check_composite warns about a
    routing.strategy, I-169)."""
    if "strategy" in config:
        raise doc.error(ConfigurationError, path + ("strategy",),
                        "composite agents must not declare strategy; use components and routing",
                        "4.6.3, §16.1")

# §4.7 Chain agents -----------------------------------------------------------------------
CHAIN_PREFIX = "ChainAgent processed: "
# INTERPRETATION I-018 §4.7 (Q74): the bare token, no spaces, also before step 1
CHAIN_SEPARATOR = "->"


# The §4.7 config fields (prompts render at Phase C; prompt_reference names a prompts entry).
STEP_LABELS = Constraint(lambda value: isinstance(value, list) and all(
    isinstance(step, str) for step in value), "a sequence of strings", (list,))
CHAIN_FIELDS = fields_by_name(
    Field("steps",            STEP_LABELS, [],   "4.7"),
    Field("prompt",           STRING,      None, "4.7"),
    Field("prompt_reference", STRING,      None, "4.7, §10.4"),
    Field("context",          MAPPING,     None, "4.9"),
)


def check_chain(rt, name, config, path):
    doc = rt.doc
    # A null field is an absent one in agent configs (I-172), so only two values clash.
    if config.get("prompt") is not None and config.get("prompt_reference") is not None:
        raise doc.error(ConfigurationError, path, "chain agents take prompt or prompt_reference, "
                        "not both", "4.7, §16.3")
    check_config_fields(rt, config, CHAIN_FIELDS, path, "4.7", "chain agent")
    ref, prompts = config.get("prompt_reference"), doc.data.get("prompts")
    if ref is not None and prompt_content((prompts if isinstance(prompts, dict) else {}).get(
            ref if isinstance(ref, str) else None)) is None:
        raise doc.error(ConfigurationError, path + ("prompt_reference",),
                        f"prompt_reference '{ref}' names no entry of prompts", "4.7, §10.4")
    warn_unparsable_template(rt, config.get("prompt"), path + ("prompt",))


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
        self.context = config.get("context") or {}       # §4.9 the per-agent persistent context
        self.prompt = config.get("prompt")
        if config.get("prompt_reference") is not None:
            self.prompt = rt.prompts[config["prompt_reference"]]
        self.reads_context = self.prompt is not None          # only a prompt renders with it
        self.capabilities = ["chain-processing"]
        self.metadata = agent_metadata(self, steps=list(self.steps))

    def invoke(self, content, ctx):
        text = content if isinstance(content, str) else str(content)
        if self.prompt is not None:     # the agent's context under the invocation's, as I-034
            view = {**self.context, **(ctx if ctx is not None else {})}
            text = render_runtime(self.rt, self.prompt, view, text,
                                  self.path + ("config", "prompt"))
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
# Each type's load-time checks, run by check_agent before any agent exists (§12.1).
AGENT_CHECKS = {
    "llm": check_llm,
    "tool": check_tool_agent,
    "composite": check_composite,
    "chain": check_chain,
}


def make_agent(rt, name, cfg, path):
    """§12.1 step 3: create one agent; any failure aborts start-up (AgentCreationError)."""
    inherit_context(rt, cfg["config"])
    try:
        return AGENT_TYPES[cfg["type"]](name, cfg, rt, path)
    except ActorError:
        raise
    except Exception as exc:  # boundary: a broken agent definition must not escape as a traceback
        raise rt.doc.error(AgentCreationError, path, f"agent '{name}' could not be created: {exc}",
                           "12.1") from exc


# =====================================================================================
# §5 ROUTES -- COMMON CONCEPTS
# =====================================================================================

# §5.1 The routes section ---------------------------------------------------------------
def route_type(cfg):
    """The canonical (lower-case, §11.3(2)) type of a route mapping, or None."""
    kind = cfg.get("type") if isinstance(cfg, dict) else None
    return kind.lower() if isinstance(kind, str) else None


# §5.2 Built-in streams --------------------------------------------------------------------
INPUT, OUTPUT, ERROR = "__input__", "__output__", "__error__"

# The §5.2 table: name -> direction. All three are cold streams that exist implicitly.
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
        super().__init__(net, name, net.flow.stream(name, kind, seed, cfg.get("buffer_size") or 1))
        self.ops = cfg.get("operators") or []
        self.head = build_chain(net, name, self.ops, path + ("operators",),
                                net.flow.stage(Stage(self.emit, self.out.complete, self.out)))
        self.push = self.head.next      # a message pushed in goes straight to the first operator
        self.ended = False

    def emit(self, msg):
        # INTERPRETATION I-081 §12.2.1 (Q23): source_stream is re-stamped with the emitting stream
        # at every hop, so `source_is` can name any route.
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


class Stage:
    """One operator instance: next(msg) takes a message, complete() ends the flow.

    Handlers build a Stage around the downstream Stage `down`, so a route is a chain of stages,
    each handing its messages to the next; the network's Flow decides how each hand-over runs
    (a step of its loop, Flow.stage).
    """

    __slots__ = ("next", "complete", "stamped")

    def __init__(self, next, complete, stamped=None):
        self.next = next
        self.complete = complete
        # A route's last Stage only stamps messages with the route's name (StreamRoute.emit); it
        # offers the route's stream here, so an operator whose messages already carry that name
        # (map with an agent) hands them straight to the stream.
        self.stamped = stamped


class _Ensure:
    """A Flow step that runs even when an earlier step fails (a `finally` for the loop)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        self.fn()


# INTERPRETATION I-200 §12.6, §12.2.2: a bounded flow has no length limit (a take-bounded cycle of
# thousands of laps, a route of a thousand operators): hand-overs are the steps of one loop.
class Flow:
    """§5.5, §12.2.2: how one stream network delivers -- every hand-over (an operator's next or
    complete, a stream's observers, a sink's hooks) is a step of one loop.

    The steps run depth first, in the order nested calls would take them: the steps a step asks
    for run, each with everything it leads to, before the steps asked for earlier. So a message
    costs the same per hop however many hops it takes (a long route, a fan-out, a take-bounded
    cycle, §12.6), and no flow is bounded by the Python stack.
    """

    def __init__(self):
        self.stack = None       # the steps still to take, the next one last; None: no loop runs

    def call(self, fn, *args):
        """fn(*args) as a step: after the running one, else as a loop of its own now."""
        stack = self.stack
        if stack is None:
            self.run(fn, *args)
        else:
            stack.append((fn, args))

    def ensure(self, fn):
        """fn() as a step that runs even when a step before it fails."""
        self.call(_Ensure(fn))

    def run(self, fn, *args):
        """Run fn(*args) and every step it leads to, then return (a loop of its own, also when
        a host call comes from inside a step)."""
        outer, self.stack = self.stack, [(fn, args)]
        stack = self.stack
        try:
            while stack:
                fn, args = stack.pop()
                mark = len(stack)
                fn(*args)
                if len(stack) > mark + 1:       # the steps it asked for, the first one next
                    stack[mark:] = stack[:mark - 1 if mark else None:-1]
        except BaseException:
            for fn, _args in stack:
                if type(fn) is _Ensure:
                    fn()
            raise
        finally:
            self.stack = outer

    def outside(self, fn, *args):
        """fn(*args) outside any loop: each step it starts (a timer's emission) runs to its end
        before fn goes on."""
        outer, self.stack = self.stack, None
        try:
            return fn(*args)
        finally:
            self.stack = outer

    def stage(self, stage, index=0):
        """`stage` with its next and complete taken as steps (`index`: its place counted from
        the end of its chain, 0 for a route's last Stage)."""
        flow, next, complete = self, stage.next, stage.complete

        def next_step(msg):
            stack = flow.stack
            if stack is None:
                flow.run(next, msg)
            else:
                stack.append((next, (msg,)))
        return Stage(next_step, lambda: flow.call(complete), stage.stamped)

    def stream(self, name, *args):
        """A Stream (§5.3.1) of this network: Stream(name, stream_type, initial_value,
        buffer_size)."""
        return Stream(name, *args, flow=self)

    def sink(self, net, name, adjust):
        return _Sink(net, name, adjust)

    def output_sink(self, net):
        return _OutputSink(net)

    def agent_step(self, on_next, parts):
        """The agent mapper's per-message step (§5.3.4): the body's own, on_next."""
        return on_next


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
        for key, row in spec.items():
            if params.get(key) is None and row.default is not REQUIRED:
                params[key] = row.default
        stage = net.flow.stage(handler(_OpSite(net, route, path + (index, "params"), ops, index),
                                       params, stage), len(ops) - index)
    return stage

# §5.3.1 Stream types ------------------------------------------------------------------
# The §5.3.1 table: stream type -> how many past messages a late subscriber receives
# (None: the route's buffer_size). Every subscriber wired at setup sees every message.
# INTERPRETATION I-080 §5.3.1 (Q22): operators run once per message and every target shares the
# result; hot/replay memory (and a hot stream's initial_value) reaches late subscribers only,
# i.e. hooks added with StreamNetwork.subscribe() after creation.
STREAM_TYPES = {
    "cold": 0,
    "hot": 1,
    "replay": None,
}

# The §5.3 fields of a stream route. type, the name lists and template_config are check_routes'
# (§11.3, §5.5, §8.7); operators are the operator checker's (§5.3.2); a bridge is check_bridge's.
STREAM_TYPE = Constraint(lambda value: is_known(value, STREAM_TYPES),
                         "one of " + ", ".join(STREAM_TYPES), (str,))
STREAM_ROUTE_FIELDS = fields_by_name(
    Field("type",            ANY,          None,   "5.3"),
    Field("stream_type",     STREAM_TYPE,  "cold", "5.3.1"),
    Field("operators",       ANY,          None,   "5.3.2"),
    Field("subscriptions",   ANY,          None,   "5.5"),
    Field("publications",    ANY,          None,   "5.5"),
    Field("agents",          ANY,          None,   "5.3"),
    Field("initial_value",   ANY,          None,   "5.3.1"),
    Field("buffer_size",     POSITIVE_INT, 1,      "5.3.1"),
    Field("bridge",          MAPPING,      None,   "5.3"),
    Field("metadata",        MAPPING,      None,   "5.3"),
    Field("template_config", ANY,          None,   "8.7"),
)

_NO_VALUE = object()


class Stream:
    """The reactive core: a named subject with next/complete and ordered subscribers.

    next() hands a message to every observer in subscription order (§12.2.2, Q97), each as a
    step of the network's Flow; complete() ends the stream once. Per-message failures never
    become stream errors: they are messages on __error__ (§12.2.3), so the stream keeps flowing.
    """

    __slots__ = ("name", "stream_type", "observers", "finishers", "memory", "keep", "done",
                 "flow")

    def __init__(self, name, stream_type="cold", initial_value=_NO_VALUE, buffer_size=1,
                 flow=None):
        self.name, self.stream_type = name, stream_type
        self.observers, self.finishers = [], []
        keep = STREAM_TYPES[stream_type]
        keep = buffer_size if keep is None else keep
        self.keep = keep
        self.memory = [] if keep else None
        if initial_value is not _NO_VALUE and stream_type == "hot":
            self.memory.append(Message(initial_value, source_stream=name))
        self.done = False
        self.flow = Flow() if flow is None else flow

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

    def watch(self, on_next):
        """Add an observer ahead of every other (host tracing: it sees a message first)."""
        self.observers.insert(0, on_next)

    def dispose(self):
        """§12.1 step 8: drop every observer."""
        self.observers.clear()
        self.finishers.clear()

    def next(self, msg):
        if self.memory is not None:
            self.memory.append(msg)
            if len(self.memory) > self.keep:
                del self.memory[0]
        call = self.flow.call
        for on_next in self.observers:
            call(on_next, msg)

    def complete(self):
        if not self.done:
            self.done = True
            call = self.flow.call
            for on_complete in self.finishers:
                call(on_complete)

# §5.3.2 Operators -------------------------------------------------------------------------
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
    net, route, sandbox = site.net, site.route, site.rt.sandbox

    def on_next(msg):
        try:
            content = sandbox.call(unit, (msg.content,))
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
    duration, net, clock = params["duration"], site.net, site.rt.clock
    pending = [None, None]      # message, timer

    def fire():
        msg, pending[0], pending[1] = pending[0], None, None
        down.next(msg)

    def on_next(msg):
        if pending[1] is not None:
            pending[1].cancel()
        pending[0] = msg
        wait = min(duration, DEBOUNCE_SINGLE_SHOT_CAP) if net.single_shot else duration
        pending[1] = clock.call_later(wait, fire)

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
    # INTERPRETATION I-074 §5.3.2 throttle (Q16): leading-edge throttle; dropped messages are gone.
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
    # INTERPRETATION I-075 §5.3.2 buffer (Q17): a window (time, else timeout) starts at the first
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
    # INTERPRETATION I-070 §5.3.2 switch (Q12): a case whose target is unknown counts as no-match
    # and evaluation goes on with the next case; a forwarded message leaves this route; a matching
    # case with neither operators nor target passes the message on unchanged.
    net, rt, path, route = site.net, site.rt, site.path, site.route
    inline = Stage(down.next, _no_completion)
    cases = []
    for i, case in enumerate(params.get("cases") or []):
        ops = case.get("operators") or []
        here = path + ("cases", i)
        chain = build_chain(net, route, ops, here + ("operators",), inline) if ops else None
        cases.append((case.get("condition"), case.get("target"), chain, here + ("condition",)))
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
    # INTERPRETATION I-066 §5.3.2 conditional_route (Q10): the route "engages a graph bridge" when
    # the operator's params carry a `routes` mapping; each message goes to the first route (in
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
    # INTERPRETATION I-079 §5.3.2 catch vs §12.2.3 (Q21, Q93): every failure already put exactly one
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
    # INTERPRETATION I-078 §5.3.2 retry (Q20): a map turns agent failures into messages, so retry
    # means: the closest preceding agent map in the same route re-invokes its agent up to
    # `count` extra times before it reports the failure.
    return Stage(down.next, down.complete)     # warned without a map before it (_Checker)


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
    # INTERPRETATION I-076 §5.3.2 sample (Q18): a tick emits only a message that arrived since the
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


# Per §12.2.1, metadata.source on messages the bridge operators emit: "the graph subsystem".
BRIDGE_SOURCE = "graph"


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
        metadata = state.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("context"), dict):
            # the state leaves as data, its context a copy: the live one, reached through a
            # later run's current_message, would come to hold itself
            state = {**state, "metadata": {**metadata, "context": dict(metadata["context"])}}
        # §6.1 (Q34): this run's last assistant reply; a run that added none (only function
        # nodes, a router) forwards its final state, never an earlier run's reply.
        replies = run.replies
        out = msg.copy(content=replies[-1].get("content") if replies else state,
                       source_stream=route)
        out.metadata.update(graph=name, execution_history=list(run.history), final_state=state,
                            source=BRIDGE_SOURCE)
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
        out.metadata["source"] = BRIDGE_SOURCE
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
        out.metadata.update(graph=name, node=node, source=BRIDGE_SOURCE)
        down.next(out)
    return Stage(on_next, down.complete)


def _check_map(checker, params, path):
    # INTERPRETATION I-071 §5.3.2 map (Q13): none or several of agent/function/transform is a
    # ConfigurationError at load time.
    given = [k for k in ("agent", "function", "transform") if params.get(k) is not None]
    if len(given) != 1:
        raise checker.doc.error(ConfigurationError, path,
                                "map needs exactly one of agent, function, transform"
                                + (f" (got {', '.join(given)})" if given else ""), "5.3.2")
    if params.get("agent") is not None:
        checker.agent(params["agent"], path + ("agent",))
    elif params.get("function") is not None:
        checker.function(params["function"], path + ("function",))
    else:
        check_transform_params(checker, params["transform"], path + ("transform",))


def _check_filter(checker, params, path):
    if params.get("condition") is not None:
        checker.condition(params["condition"], path + ("condition",))


def _check_switch(checker, params, path):
    """switch and conditional_route: cases, nested operator lists, and (the bridge router)
    route conditions."""
    checker.cases(params.get("cases") or [], path + ("cases",))
    checker.operators(params.get("default_operators"), path + ("default_operators",))
    for name, cond in (params.get("routes") or {}).items():
        checker.condition(cond, path + ("routes", name))
    if params.get("routes") is not None:        # I-066: `routes` selects the bridge router
        for key in ("cases", "default_operators"):
            if params.get(key) is not None:
                checker.note(path + (key,), f"`{key}` has no effect beside `routes` (the bridge "
                             "router uses routes and default only)")


def _check_graph(checker, params, path):
    checker.graph(params["graph"], path + ("graph",))


def _check_transform(checker, params, path):
    if params.get("fn") is None and params.get("type") is None:
        raise checker.doc.error(StreamRoutingError, path, "transform needs `fn` or `type`", "5.3.2")
    if params.get("fn") is not None and params.get("type") is not None:
        raise checker.doc.error(ConfigurationError, path,
                                "transform takes `fn` or `type`, not both", "5.3.2")
    if params.get("fn") is not None:
        _compile_located(checker.doc, params["fn"], 1, checker.rt, path + ("fn",))
    else:
        check_transform_params(checker, params, path)


def _check_graph_node(checker, params, path):
    _check_graph(checker, params, path)
    graph = checker.routes.get(params.get("graph"))
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if isinstance(nodes, dict) and params.get("node") not in nodes:
        raise checker.doc.error(ConfigurationError, path + ("node",),
                                f"graph {params.get('graph')!r} has no node "
                                f"{params.get('node')!r}", "5.3.2")


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


# What an operator parameter may be (§5.3.2-§5.3.6), beyond the shared constraints; what a
# name refers to and what a nested condition or operator list holds is OPERATOR_CHECKS' part.
CONDITION = Constraint(lambda value: isinstance(value, dict),
                       "a condition: a mapping with a `type` key", (dict,))
TRANSFORM_SPEC = Constraint(lambda value: isinstance(value, dict), "a mapping with a `type` key",
                            (dict,))
ACCUMULATOR = Constraint(lambda value: isinstance(value, dict) and is_known(value.get("type"),
                                                                            ACCUMULATORS),
                         "a mapping whose `type` names an accumulator", (dict,))
# INTERPRETATION I-072 §5.3.3 vs §16.2 (Q14): a function reference is a (dotted) identifier;
# anything else is an inline expression, which §16.2 forbids.
FUNCTION_REF = Constraint(lambda value: isinstance(value, str) and bool(FUNCTION_NAME.fullmatch(
    value)), "the name of a transformer; inline expressions are forbidden here (use the "
    "transform operator with fn)", (str,))
STREAM_NAME = Constraint(lambda value: isinstance(value, str), "a stream name", (str,))
CASES = Constraint(lambda value: isinstance(value, list), "a sequence of cases", (list,))
OPERATOR_LIST = Constraint(lambda value: isinstance(value, list), "a sequence of operators",
                           (list,))
ROUTE_CONDITIONS = Constraint(lambda value: isinstance(value, dict),
                              "a mapping of route names to conditions", (dict,))


def _params(*rows):
    """An operator's params table (fields_by_name, named short so OPERATORS' rows line up)."""
    return fields_by_name(*rows)


# The §5.3.2 table: operator -> (handler, its params as Field rows). Rows in the spec's order.
OPERATORS = {
    "map":               (op_map,               _params(Field("agent", STRING, None, "5.3.4"),
                                                        Field("function", FUNCTION_REF, None,
                                                              "16.2"),
                                                        Field("transform", TRANSFORM_SPEC, None,
                                                              "5.3.5"))),
    "filter":            (op_filter,            _params(Field("condition", CONDITION, None,
                                                              "5.4"))),
    "transform":         (op_transform,         _params(Field("fn", STRING, None, "5.3.2"),
                                                        Field("type", STRING, None, "5.3.2"))),
    "debounce":          (op_debounce,          _params(Field("duration", SECONDS, REQUIRED,
                                                              "5.3.2"))),
    "throttle":          (op_throttle,          _params(Field("duration", SECONDS, REQUIRED,
                                                              "5.3.2"))),
    "delay":             (op_delay,             _params(Field("duration", SECONDS, REQUIRED,
                                                              "5.3.2"))),
    "buffer":            (op_buffer,            _params(Field("count", POSITIVE_INT, None,
                                                              "5.3.2"),
                                                        Field("timeout", SECONDS, 0.1, "5.3.2"),
                                                        Field("time", SECONDS, None, "5.3.2"))),
    "scan":              (op_scan,              _params(Field("accumulator", ACCUMULATOR, REQUIRED,
                                                              "5.3.6"))),
    "reduce":            (op_reduce,            _params(Field("accumulator", ACCUMULATOR, REQUIRED,
                                                              "5.3.6"))),
    "switch":            (op_switch,            _params(Field("cases", CASES, None, "5.3.2"),
                                                        Field("default", STREAM_NAME, None,
                                                              "5.3.2"),
                                                        Field("default_operators", OPERATOR_LIST,
                                                              None, "5.3.2"))),
    "conditional_route": (op_conditional_route, _params(Field("cases", CASES, None, "5.3.2"),
                                                        Field("default", STREAM_NAME, None,
                                                              "5.3.2"),
                                                        Field("default_operators", OPERATOR_LIST,
                                                              None, "5.3.2"),
                                                        Field("routes", ROUTE_CONDITIONS, None,
                                                              "5.3.2"))),
    "catch":             (op_catch,             _params()),
    "retry":             (op_retry,             _params(Field("count", NON_NEGATIVE_INT, 3,
                                                              "5.3.2"))),
    "distinct":          (op_distinct,          _params()),
    "take":              (op_take,              _params(Field("count", NON_NEGATIVE_INT, 1,
                                                              "5.3.2"))),
    "skip":              (op_skip,              _params(Field("count", NON_NEGATIVE_INT, 1,
                                                              "5.3.2"))),
    "sample":            (op_sample,            _params(Field("interval", POSITIVE_SECONDS, 1.0,
                                                              "5.3.2"))),
    "graph_execute":     (op_graph_execute,     _params(Field("graph", STRING, REQUIRED, "5.3.2"))),
    "state_update":      (op_state_update,      _params(Field("graph", STRING, REQUIRED, "5.3.2"))),
    "state_checkpoint":  (op_state_checkpoint,  _params(Field("graph", STRING, REQUIRED, "5.3.2"))),
    "graph_node":        (op_graph_node,        _params(Field("graph", STRING, REQUIRED, "5.3.2"),
                                                        Field("node", STRING, REQUIRED, "5.3.2"))),
}

# Operators whose params also carry keys of their own (transform-specific keys, §5.3.5).
OPEN_PARAMS = {"transform"}

# Checks beyond the rows: what names refer to, nested conditions and operator lists, and
# rules that span several params of one operator.
OPERATOR_CHECKS = {
    "map": _check_map,
    "filter": _check_filter,
    "transform": _check_transform,
    "switch": _check_switch,
    "conditional_route": _check_switch,
    "graph_execute": _check_graph,
    "state_update": _check_graph,
    "state_checkpoint": _check_graph,
    "graph_node": _check_graph_node,
}

# The fields of one §5.3.2 operator mapping, and of one switch case (what they name or nest is
# checked by the methods below).
OPERATOR_FIELDS = fields_by_name(Field("type",   STRING,  REQUIRED, "5.3.2"),
                                 Field("params", MAPPING, None,     "5.3.2"))
SWITCH_CASE_FIELDS = fields_by_name(*read_elsewhere("5.3.2", "condition", "target", "operators"))


class _Checker:
    """Walks stream routes and operators: their fields through check_fields (STREAM_ROUTE_FIELDS,
    the OPERATORS rows), then what parameters name or nest (OPERATOR_CHECKS, methods below)."""

    def __init__(self, doc, agents, graphs, known, routes, rt):
        self.doc, self.agents, self.graphs = doc, agents, graphs
        self.known, self.routes = known, routes
        self.rt = rt

    def note(self, path, message, section="5.3.2"):
        self.rt.warn(message, section=section, path=path)

    def stream_route(self, cfg, path):
        check_fields(self.doc, cfg, STREAM_ROUTE_FIELDS, path)
        kind = str(cfg.get("stream_type") or "cold").lower()
        for field, owner in (("initial_value", "hot"), ("buffer_size", "replay")):
            if cfg.get(field) is not None and kind != owner:      # §5.3.1: no effect here
                self.note(path + (field,), f"{field} applies to {owner} streams only; this "
                          f"{kind} stream ignores it", section="5.3.1")
        if isinstance(cfg.get("bridge"), dict):
            check_bridge(self.doc, cfg["bridge"], path + ("bridge",), self.rt)
        self.operators(cfg.get("operators", []), path + ("operators",))

    def operators(self, ops, path):
        if ops is None:
            return
        if not isinstance(ops, list):
            raise self.doc.error(ConfigurationError, path,
                                 "operators must be a sequence of operator mappings", "5.3.2")
        for i, op in enumerate(ops):
            self.operator(op, path + (i,))
            if op["type"] == "retry" and _retried_map(ops, i) is None:
                self.note(path + (i, "params"),
                          "retry has no agent map before it in this route; it does nothing")

    def operator(self, op, path):
        if not isinstance(op, dict) or not isinstance(op.get("type"), str):
            raise self.doc.error(ConfigurationError, path,
                                 "an operator is a mapping with a string `type`", "5.3.2")
        kind = op["type"]
        if kind not in OPERATORS:
            raise self.doc.error(StreamRoutingError, path + ("type",),
                                 f"unknown operator {kind!r}", "5.3.2")
        check_unknown(self.rt, op, OPERATOR_FIELDS, path, "5.3.2",
                      "unknown operator key {key!r} ignored")
        params = op.get("params") or {}
        if not isinstance(params, dict):
            raise self.doc.error(ConfigurationError, path + ("params",),
                                 "params must be a mapping", "5.3.2")
        path = path + ("params",)
        _handler, spec = OPERATORS[kind]
        for key, row in spec.items():
            if params.get(key) is None and row.default is REQUIRED:
                raise self.doc.error(ConfigurationError, path,
                                     f"operator {kind!r} needs params.{key}", "5.3.2")
        check_fields(self.doc, params, spec, path, null_is_default=True)
        if kind not in OPEN_PARAMS:
            check_unknown(self.rt, params, spec, path, "5.3.2",
                          "unknown param {key!r} of operator {kind!r} ignored", kind=kind)
        extra = OPERATOR_CHECKS.get(kind)
        if extra:
            extra(self, params, path)

    # What parameters name or nest, once their rows have passed (OPERATOR_CHECKS) ----------
    def condition(self, value, path):
        if not CONDITION.test(value):
            raise self.doc.error(ConfigurationError, path, f"must be {CONDITION.wording}", "5.4")
        wrong = condition_shape_error(value)
        if wrong is not None:
            raise self.doc.error(ConfigurationError, path + (wrong[0],), wrong[1], "5.4")

    def agent(self, value, path):
        if not is_known(value, self.agents):
            raise self.doc.error(ConfigurationError, path, f"unknown agent {value!r}", "5.3.4")

    def graph(self, value, path):
        if not is_known(value, self.graphs):
            raise self.doc.error(ConfigurationError, path,
                                 f"unknown graph route {value!r}", "5.3.2")

    def function(self, value, path):
        if value not in STANDARD_FUNCTIONS and value not in self.rt.functions:
            self.note(path, f"no transformer named {value!r} is registered; map acts as identity",
                      "5.3.3")

    def cases(self, value, path):
        for i, case in enumerate(value):
            if not isinstance(case, dict):
                raise self.doc.error(ConfigurationError, path + (i,),
                                     "a case is a mapping with `condition`", "5.3.2")
            check_unknown(self.rt, case, SWITCH_CASE_FIELDS, path + (i,), "5.3.2",
                          "unknown case field '{key}' is ignored")
            if "condition" in case:
                self.condition(case["condition"], path + (i, "condition"))
            if case.get("target") is not None and not STREAM_NAME.test(case["target"]):
                raise self.doc.error(ConfigurationError, path + (i, "target"),
                                     f"target must be {STREAM_NAME.wording}", "5.3.2")
            self.operators(case.get("operators"), path + (i, "operators"))


# §5.3.3 Function references ---------------------------------------------------------
# INTERPRETATION I-072 §5.3.3 (Q14): the standard defines no built-in transformers, so this table is
# empty; a host registers its own as rt.functions = {name: fn(content) -> content}. A name
# found in neither is the identity transformation (with a warning at load).
STANDARD_FUNCTIONS = {}

FUNCTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def function_mapper(site, name, down):
    """§5.3.3 map with `function`: a registered transformer, else the identity."""
    registry = {**STANDARD_FUNCTIONS, **site.rt.functions}
    fn = registry.get(name)
    if fn is None:                      # warned by the check pass (_Checker.function)
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
ERROR_PREFIX = "Error: "                            # §5.3.4(4): "Error: <reason>"
AGENT_HARD_TIMEOUT = 120.0                          # §5.3.4(3), seconds per agent invocation


class _AgentTimedOut(Exception):
    """Internal: an agent call outlived its bound (never escapes the map stage). Its text is the
    content the map emits: §5.3.4's, or §12.2.4's for the soft timeout of a single-shot run."""

    def __init__(self, text=PROCESSING_TIMED_OUT):
        super().__init__(text)
        self.text = text


class BoundedCall:
    """One agent call on a worker thread that its caller may stop waiting for (§5.3.4 item 3,
    §12.2.4, a graph node's `timeout`). A call started inside another one -- on the same worker,
    on a graph's parallel workers, on a nested bounded worker -- belongs to it (`parent`)."""

    __slots__ = ("parent", "abandoned")

    def __init__(self, parent):
        self.parent, self.abandoned = parent, False


# The bounded call the running code belongs to. Worker threads start in a copy of their
# starter's context (run_bounded, the §6.7 pool), so the chain follows the logical call.
_BOUNDED_CALL = contextvars.ContextVar("actor_bounded_call", default=None)


# INTERPRETATION I-120 §5.3.4, §6.2.2: a call given up on after its timeout (and all it started) is
# abandoned; it runs on, since a thread cannot be stopped, but makes no later effect.
def call_abandoned():
    """True when the running code belongs to a call whose caller stopped waiting (a timeout).

    Such a "zombie" keeps running (Python cannot stop a thread), so every effect that would
    outlive the call -- memory, context write-back, §12.4 tools, further graph steps, the final
    context replacement -- asks this first and is skipped.
    """
    call = _BOUNDED_CALL.get()
    while call is not None:
        if call.abandoned:
            return True
        call = call.parent
    return False


def check_not_abandoned(who, section="5.3.4"):
    """Raise ExecutionError when the running call was abandoned (its result goes nowhere)."""
    if call_abandoned():
        raise error(ExecutionError, f"{who}: the call timed out earlier; its late result is "
                    "dropped", section)


# What the running call chain holds: (object, thread ident) for every composite entered up the
# chain (§4.6 takes one request at a time, under a lock).
_CHAIN_HOLDS = contextvars.ContextVar("actor_chain_holds", default=())


def hold_in_chain(obj, who):
    """Note that this call chain enters `obj` (one request at a time); returns a token for
    release_in_chain.

    Refuses with an ExecutionError when an earlier link of the same chain holds `obj` on another
    thread (a graph's parallel branch, §6.7, or a bounded worker): that link waits for this one,
    so waiting for it would deadlock. Re-entry on the same thread stays allowed.
    """
    # INTERPRETATION I-171 §4.6, §6.7: the re-entered composite fails with an ExecutionError.
    me = threading.get_ident()
    held = _CHAIN_HOLDS.get()
    for other, ident in held:
        if other is obj and ident != me:
            raise error(ExecutionError, f"{who} is entered again from a parallel branch or bounded "
                        "call of its own request, which it waits for (a deadlock)",
                        "6.7")
    return _CHAIN_HOLDS.set(held + ((obj, me),))


def release_in_chain(token):
    _CHAIN_HOLDS.reset(token)


def in_copied_context(fn):
    """`fn` wrapped to run in a copy of the caller's context (for another thread: a context may
    be entered by one thread at a time)."""
    return functools.partial(contextvars.copy_context().run, fn)


def run_bounded(fn, timeout, name):
    """Run fn() on a daemon worker thread, waiting at most `timeout` real seconds.

    Returns (True, value); re-raises fn's error; returns (False, None) when the wait ran out,
    after marking the call abandoned (see call_abandoned).
    """
    call = BoundedCall(_BOUNDED_CALL.get())
    box = {}

    def work():
        _BOUNDED_CALL.set(call)
        try:
            box["value"] = fn()
        except BaseException as exc:    # carried back to the waiting thread and handled there
            box["error"] = exc
    worker = threading.Thread(target=in_copied_context(work), name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        call.abandoned = True
        return False, None
    failure = box.get("error")
    if failure is not None:
        raise failure
    return True, box["value"]


def resolve_context(msg, rt):
    """§5.3.4(1): the message's metadata.context, else the global context, else {}.

    Returns the dict itself (a reference, §10.2), never a copy.
    """
    ctx = msg.metadata.get("context")
    if isinstance(ctx, dict):
        return ctx
    return rt.context if isinstance(rt.context, dict) else {}


def invoke_agent(rt, agent, content, ctx, *, single_shot=False, method=None):
    """Call agent.invoke, bounded by the §5.3.4 hard timeout when time is real.

    Under the virtual clock no wall time may pass, so the call is direct (the fast path). Under
    the real clock the call runs on a daemon worker thread that we stop waiting for after
    AGENT_HARD_TIMEOUT seconds, or after the shorter §12.2.4 SOFT_TIMEOUT in a single-shot run;
    the abandoned call then makes no further effect (call_abandoned).
    """
    method = agent.invoke if method is None else method
    if not rt.clock.real:
        return method(content, ctx)
    soft = single_shot and SOFT_TIMEOUT < AGENT_HARD_TIMEOUT
    finished, reply = run_bounded(lambda: method(content, ctx),
                                  SOFT_TIMEOUT if soft else AGENT_HARD_TIMEOUT,
                                  f"agent-{agent.name}")
    if not finished:
        raise error(_AgentTimedOut, SOFT_TIMEOUT_TEXT if soft else PROCESSING_TIMED_OUT)
    return reply


def agent_mapper(site, name, down):
    """§5.3.4 map with `agent`: invoke the agent once per message; errors become messages.

    Success: content = reply, metadata.processed_by = agent, metadata.context = the context
    reference. Timeout: "Processing timed out" with timeout/error metadata. Failure:
    "Error: <reason>" with error/processed_by metadata. Both failures also put one message on
    __error__ (§12.2.3), and the route keeps processing other messages.
    """
    net, rt, route = site.net, site.rt, site.route
    down = down.stamped or down         # every message below carries source_stream = route
    agent = rt.agents[name]
    # A composite may answer later (§4.6.2 item 4): its invoke_later gives a PendingReply.
    method = getattr(agent, "invoke_later", None) or agent.invoke
    call = method if not rt.clock.real else (     # virtual time: a direct call
        lambda content, ctx: invoke_agent(rt, agent, content, ctx, single_shot=net.single_shot,
                                          method=method))
    retries = retry_count(site)
    # Only an agent that reports token counts has the attribute (asked once, not per message)
    reports_usage = hasattr(agent, "last_usage")

    def with_retries(content, ctx):
        """§5.3.2 retry: up to `retries` more calls after a failure (never after a timeout)."""
        for _ in range(retries):
            try:
                return call(content, ctx)
            except _AgentTimedOut:
                raise
            except Exception:           # tried again below; the last failure is the one reported
                continue
        return call(content, ctx)
    attempt = with_retries if retries else call

    def succeed(msg, ctx, reply):
        out = msg.copy(content=reply, source_stream=route)
        out.metadata["processed_by"] = name
        out.metadata["context"] = ctx
        if reports_usage and agent.last_usage:      # HOST: the vendor's token counts
            out.metadata["usage"] = agent.last_usage
        down.next(out)

    def failed(msg, exc):
        if isinstance(exc, _AgentTimedOut):
            # §12.2.4: in a single-shot run the soft bound comes first and is an execution error
            out = msg.copy(content=exc.text, source_stream=route)
            out.metadata.update(timeout=True, error=True, error_type="ExecutionError",
                                processed_by=name)
        else:                           # §12.2.3 boundary: agent invocation
            out = msg.copy(content=ERROR_PREFIX + error_reason(exc), source_stream=route)
            out.metadata.update(error=True, error_type=error_category(exc), processed_by=name)
        # INTERPRETATION I-087 §5.3.4 vs §12.2.3 (Q92): the failed map's message goes on downstream
        # (§5.3.4 "emit"), and one copy of it is the failure's single __error__ message.
        net.report(out)
        down.next(out)

    def on_next(msg):
        ctx = resolve_context(msg, rt)
        try:
            reply = attempt(msg.content, ctx)
        except Exception as exc:        # _AgentTimedOut, or the §12.2.3 agent boundary
            failed(msg, exc)
            return
        if type(reply) is PendingReply:     # the composite answers later (§4.6.2)
            reply.then(lambda value: succeed(msg, ctx, value), lambda exc: failed(msg, exc))
            return
        succeed(msg, ctx, reply)
    on_next = net.flow.agent_step(on_next, (name, route, agent, attempt, succeed, failed, down,
                                            reports_usage, rt))

    finish = getattr(agent, "finish_pending", None)

    def on_complete():
        if finish is not None:          # waiting composite calls answer before completion
            finish()
        down.complete()
    return Stage(on_next, on_complete)

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


# The §5.3.5 table: transform type -> handler(content, params) -> new content.
# INTERPRETATION I-073 §5.3.5 (Q15): extract of a missing field or non-mapping leaves content
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
    if not is_known(kind, TRANSFORMS):
        raise checker.doc.error(ConfigurationError, path, f"unknown transform type {kind!r} "
                                f"(one of {', '.join(TRANSFORMS)})", "5.3.5")


def check_transform_params(checker, params, path):
    """§5.3.5 parameter shapes: wrapper a mapping; field, template, old, new scalars."""
    check_transform_type(checker, params.get("type") or "identity", path + ("type",))
    if params.get("wrapper") is not None and not isinstance(params["wrapper"], dict):
        raise checker.doc.error(ConfigurationError, path + ("wrapper",),
                                "wrapper must be a mapping", "5.3.5")
    for key in ("field", "template", "old", "new"):
        if isinstance(params.get(key), (dict, list)):
            raise checker.doc.error(ConfigurationError, path + (key,),
                                    f"{key} must be a scalar", "5.3.5")


def transform_stage(site, params, down):
    """§5.3.5 a built-in transform applied to every message's content."""
    handler = TRANSFORMS[params.get("type") or "identity"]
    net, route = site.net, site.route

    def on_next(msg):
        try:
            content = handler(msg.content, params)
        except Exception as exc:    # §12.2.3 boundary (e.g. a content that cannot be str()'d)
            net.fail(route, msg, exc)
            return
        down.next(msg.copy(content=content, source_stream=route))
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


# The §5.3.6 table: accumulator -> (seed, step(total, content) -> total).
# INTERPRETATION I-077 §5.3.6 (Q19): sum counts int/float content only (not numeric strings, not
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


def cond_always(cond, subject, rt):
    return True


def cond_never(cond, subject, rt):
    return False


def cond_content_contains(cond, subject, rt):
    return str(cond.get("text", "")) in _content_text(subject)


# INTERPRETATION I-068, I-069 §5.4 (Q11): the definition holds for empty text too (always false),
# in §18.12 and in the §5.3 examples alike.
def cond_content_not_contains(cond, subject, rt):
    return str(cond.get("text", "")) not in _content_text(subject)


def cond_content_starts_with(cond, subject, rt):
    return _content_text(subject).startswith(str(cond.get("text", "")))


def cond_content_type(cond, subject, rt):
    content = subject.content if isinstance(subject, Message) else subject.get("_condition_content")
    return type(content).__name__ == cond.get("value")


def cond_metadata_has(cond, subject, rt):
    meta = subject.metadata if isinstance(subject, Message) else _state_metadata(subject)
    return cond.get("key") in meta


def cond_metadata_check(cond, subject, rt):
    return _state_metadata(subject).get(cond.get("key")) == cond.get("value")


def cond_source_is(cond, subject, rt):
    return isinstance(subject, Message) and subject.source_stream == cond.get("source")


def cond_has_messages(cond, subject, rt):
    return bool(subject.get("messages")) if isinstance(subject, dict) else False


def cond_message_count(cond, subject, rt):
    """`operator` (gt, lt, eq) compares the state's message count with `value` (both checked
    at load, condition_shape_error)."""
    count = len(subject.get("messages", [])) if isinstance(subject, dict) else 0
    compare, value = MESSAGE_COUNT_OPERATORS.get(cond.get("operator")), cond.get("value")
    return compare is not None and _whole(value) and compare(count, value)


# The §5.4 message_count operators.
MESSAGE_COUNT_OPERATORS = {"gt": operator.gt, "lt": operator.lt, "eq": operator.eq}


_MISSING = object()


def cond_context_value(cond, subject, rt):
    """§6.5.1: state.metadata[key], then state.metadata['context'][key]; deep equality."""
    meta = _state_metadata(subject)
    key = cond.get("key")
    found = meta.get(key, _MISSING)
    if found is _MISSING and isinstance(meta.get("context"), dict):
        found = meta["context"].get(key, _MISSING)
    return found is not _MISSING and data_equal(found, cond.get("value"))


def data_equal(a, b):
    """Equality of YAML/JSON data (§5.4 context_value): what Python's == says, except that a
    boolean equals only a boolean, nested in lists and mappings too."""
    # INTERPRETATION I-175 §5.4, §6.5.1: `value: 1` does not match `true` (Python's True == 1);
    # numbers compare by value (1 matches 1.0), sequences item by item, mappings key by key.
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(data_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(data_equal, a, b))
    return a == b


def cond_output_pattern(cond, subject, rt):
    return str(_state_metadata(subject).get("last_output", "")).startswith(
        str(cond.get("pattern", "")))


def cond_message_pattern(cond, subject, rt):
    messages = subject.get("messages") if isinstance(subject, dict) else None
    last = messages[-1].get("content", "") if messages else ""
    return str(cond.get("pattern", "")) in str(last)


def cond_custom(cond, subject, rt):
    """`function` is a callable bound by the host, or the name of one it registered."""
    # INTERPRETATION I-067 §5.4 custom: a document can only name the callable, so a string is looked
    # up in the host's registry of functions (rt.functions, as for §5.3.3); a name the host did
    # not register makes the condition false.
    function = cond.get("function")
    if isinstance(function, str):
        function = rt.functions.get(function) if rt is not None else None
    return bool(function(subject)) if callable(function) else False


# The §5.4 table: type -> (evaluator, subsystems that honour it). Rows in the spec's order.
# INTERPRETATION I-019 §5.4 `never` (Q9): false wherever honoured; the "(returns True)" note is read
# as a slip.
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

# The fields a condition mapping may hold (§5.4 table): its type and the parameters beside it.
# Names are strings, texts scalars; the rows checked in this order (condition_shape_error).
SCALAR_TEXT = Constraint(lambda value: isinstance(value, (str, int, float, bool)),
                         "a string or a number", (str, int, float, bool))
CONDITION_FIELDS = fields_by_name(
    Field("type",     STRING,      None, "5.4"),
    Field("key",      STRING,      None, "5.4"),
    Field("source",   STRING,      None, "5.4"),
    Field("operator", STRING,      None, "5.4"),
    Field("text",     SCALAR_TEXT, None, "5.4"),
    Field("pattern",  SCALAR_TEXT, None, "5.4"),
    Field("value",    ANY,         None, "5.4"),
    Field("function", ANY,         None, "5.4"),
)


# Parameters a §5.4 row cannot do without: the key a metadata or context condition compares.
CONDITION_REQUIRED = {"metadata_has": "key", "metadata_check": "key", "context_value": "key"}


def condition_shape_error(cond):
    """None, or (field, message) for the first field of `cond` with the wrong shape (§1.3)."""
    for field, row in CONDITION_FIELDS.items():
        value = cond.get(field)
        if value is not None and not row.constraint.test(value):
            return field, (f"condition {field} must be {row.constraint.wording}, not "
                           f"{type(value).__name__}")
    kind = cond.get("type")
    needed = CONDITION_REQUIRED.get(kind)
    if needed is not None and cond.get(needed) is None:
        return needed, f"a {kind} condition needs `{needed}`"
    if kind == "message_count":     # §5.4: operator <gt|lt|eq>, value <integer>, both given
        for needed in ("operator", "value"):
            if cond.get(needed) is None:
                return needed, (f"a message_count condition needs `{needed}` (§5.4 gives "
                                 f"no default)")
        if cond["operator"] not in MESSAGE_COUNT_OPERATORS:
            return "operator", (f"message_count operator must be one of "
                                f"{', '.join(MESSAGE_COUNT_OPERATORS)}, not {cond['operator']!r}")
        if not _whole(cond["value"]):
            return "value", f"message_count value must be an integer, not {cond['value']!r}"
    return None

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
            warn_condition_type(rt, kind, subsystem, path)
        return unknown
    return row[0](cond, subject, rt)


def warn_condition_type(rt, kind, subsystem, path):
    """§5.4.1 SHOULD warn of an unknown or unhonoured type: once per site, at load when the site
    is known there (warn_conditions_at_load), else at its first evaluation."""
    if (subsystem, kind) in rt.warned_conditions or (subsystem, kind, path) in rt.warned_conditions:
        return
    rt.warned_conditions.add((subsystem, kind, path))
    rt.warn(f"condition type '{kind}' is not honoured by the {subsystem} subsystem; using its "
            f"default ({CONDITION_DEFAULTS[subsystem][0]})", section="5.4.2", path=path)


def warn_conditions_at_load(rt):
    """Issue 16: the condition types no subsystem honours are warned at load, where the author
    reads them: filters, switch cases, bridge routes, splits, graph edges, conditional nodes."""
    sites = []

    def operators(ops, path):
        for i, op in enumerate(ops if isinstance(ops, list) else ()):
            params = op.get("params") if isinstance(op, dict) else None
            if not isinstance(params, dict):
                continue
            at = path + (i, "params")
            if op.get("type") == "filter":
                sites.append((params.get("condition"), "stream", at + ("condition",)))
            if op.get("type") == "conditional_route" and isinstance(params.get("routes"), dict):
                sites.extend((c, "bridge", at + ("routes", n)) for n, c in params["routes"].items())
            for j, case in enumerate(params.get("cases") or ()):
                if isinstance(case, dict):
                    sites.append((case.get("condition"), "stream", at + ("cases", j, "condition")))
                    operators(case.get("operators"), at + ("cases", j, "operators"))
            operators(params.get("default_operators"), at + ("default_operators",))
    data = rt.doc.data
    for name, route in (data.get("routes") or {}).items():
        if not isinstance(route, dict):
            continue
        operators(route.get("operators"), ("routes", name, "operators"))
        for i, edge in enumerate(route.get("edges") or ()):
            if isinstance(edge, dict):
                sites.append((edge.get("condition"), "edge",
                              ("routes", name, "edges", i, "condition")))
        nodes = route.get("nodes") if isinstance(route.get("nodes"), dict) else {}
        for node, cfg in nodes.items():
            if isinstance(cfg, dict) and str(cfg.get("type", "")).lower() == "conditional":
                sites.append((cfg.get("condition"), "node",
                              ("routes", name, "nodes", node, "condition")))
    for i, split in enumerate(data.get("splits") or ()):
        for target, cond in (split.get("targets") or {}).items() if isinstance(split, dict) else ():
            sites.append((cond, "stream", ("splits", i, "targets", target)))
    for cond, subsystem, path in sites:
        if isinstance(cond, dict):      # never dropped silently: `params: {text: x}`
            check_unknown(rt, cond, CONDITION_FIELDS, path, "5.4", "unknown condition key {key!r} "
                          "is ignored (a condition's parameters are written beside its type)")
        if isinstance(cond, dict) and cond.get("type") is not None:
            row = CONDITIONS.get(str(cond["type"]))
            if (row is None or subsystem not in row[1]) and CONDITION_DEFAULTS[subsystem][2]:
                warn_condition_type(rt, str(cond["type"]), subsystem, path)
                rt.warned_conditions.add((subsystem, str(cond["type"])))


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
        self._single_shot = single_shot
        extra_prefixes = rt.routing_prefixes
        self.strip = routing_prefix_pattern(extra_prefixes)         # §12.5, for __output__
        self.strip_heads = tuple(ROUTING_PREFIXES) + tuple(extra_prefixes or ())
        routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
        # §6.9: a document whose every route is a graph runs in pure graph mode.
        self.pure = bool(routes) and all(route_type(c) == "graph" for c in routes.values())
        # How every hop runs (Flow, §5.5): the body's loop, or, where the network is shallow
        # enough that nested calls do the same, what APPENDIX A.3 stands in for it with.
        self.flow = Flow() if rt.reference else stream_flow(self, data)
        flow = self.flow
        self.input = _Node(self, INPUT, flow.stream(INPUT))
        self.nodes = {INPUT: self.input,
                      OUTPUT: flow.output_sink(self),
                      ERROR: flow.sink(self, ERROR, self._to_error)}
        for name, cfg in routes.items():            # §12.1 step 4: routes
            path = ("routes", name)
            if route_type(cfg) == "stream":
                self.nodes[name] = StreamRoute(self, name, cfg, path)
            elif route_type(cfg) == "graph" and name in rt.graphs:
                self.nodes[name] = GraphParticipant(self, name, rt.graphs[name])
            # bridge routes carry no messages (§5.6)
        self.internal_streams = set()
        if not self.pure:                           # §6.10: graph-internal streams (mixed mode)
            for graph in rt.graphs.values():
                for stream in graph.internal_stream_names():
                    self.nodes[stream] = _Node(self, stream, flow.stream(stream))
                    self.internal_streams.add(stream)
                graph.observers.append(self._graph_event)
        links = publication_links(routes)           # §5.5
        links += pipeline_links(self, data)         # §12.1 step 6 (first, so merges find them)
        links += merge_links(self, data)            # §12.1 step 5: merges and splits
        links += split_links(self, data)
        default = default_router(rt)
        if default is not None:                     # §3.4, §9.3: the default router
            links.append((INPUT, default, None, ("default_router",)))
        self.edges = self._wire(links)
        self._implicit_graph_output()
        self.order = self._completion_order()

    def _graph_event(self, stream, msg):
        """§6.10: a graph's node event (or run state) on its reserved internal stream."""
        node = self.nodes.get(stream)
        if node is not None:
            node.out.next(msg)

    @property
    def single_shot(self):
        """Whether this run is single-shot (§5.3.2 debounce cap, §12.2.4)."""
        # INTERPRETATION I-089 §5.3.2 debounce, §12.2.4 (Q95): a run is single-shot when the host
        # says so: StreamNetwork(single_shot=True), or rt.single_shot set at any time (e.g. by the
        # CLI with -m messages); vectors and the API are not single-shot.
        if self._single_shot is not None:
            return bool(self._single_shot)
        return self.rt.single_shot

    # Wiring ------------------------------------------------------------------------------
    def _wire(self, links):
        """Subscribe every target to its sources; one edge per (source, target) pair."""
        # INTERPRETATION I-082 §5.5 (Q24, Q7 f): a source -> target pair declared more than once
        # (publication + merge, split, default router) is one edge: a message crosses it at most
        # once, when any of the declarations lets it through. A diamond A->B->C, A->C still
        # delivers twice at C: those are different pairs.
        edges = {}
        for source, target, cond, path in links:
            if source not in self.nodes or target not in self.nodes:
                continue            # a bridge route carries nothing (warned by check_streams)
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
        # INTERPRETATION I-086 §6.1, §3.3 (Q28): a graph route (or last graph stage of a pipeline)
        # that no merge, split or next stage reads from sends each run's output (GraphRun.output) to
        # __output__, however it was fed (merge, split, default router, send(target=...)).
        read = {s for (s, _t) in self.edges}
        for name, node in list(self.nodes.items()):
            if isinstance(node, GraphParticipant) and name not in read:
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
        for root in [INPUT] + [n for n in self.nodes if n not in (INPUT, OUTPUT, ERROR)]:
            if root in seen:
                continue
            seen.add(root)
            stack = [(root, iter(after[root]))]     # post-order without recursion
            while stack:
                name, targets = stack[-1]
                for target in targets:
                    if target not in seen:
                        seen.add(target)
                        stack.append((target, iter(after[target])))
                        break
                else:
                    order.append(name)
                    stack.pop()
        order.reverse()
        return [n for n in order if n not in (OUTPUT, ERROR)] + [OUTPUT, ERROR]

    # The host side ------------------------------------------------------------------------
    def send(self, content, target=None, metadata=None):
        """Submit a message to __input__, or straight to the route named `target`."""
        stream = self.input.out
        if target is None:
            push = stream.next                          # __input__ is a plain stream
        elif target in self.nodes and target not in (OUTPUT, ERROR):
            push = self.nodes[target].push
        else:
            raise error(RoutingError, f"no route or input stream named {target!r}", "5.1")
        if stream.done:
            raise error(StreamRoutingError, "__input__ has completed; no more messages", "5.5")
        meta = {"context": self.rt.context}            # §10.2(2): a reference, not a copy
        if metadata:
            meta.update(metadata)
        self.deliver(push, Message(content, meta, INPUT, self.rt.clock.now()))

    def deliver(self, fn, *args):
        """Run one delivery to its end, then the timers it set for the current virtual time."""
        # §5.3.2: a zero-duration delay or debounce (or any timer set for "now") emits within
        # the step that caused it, on the virtual clock as settle() does on the real one. Only
        # the Actor's own network moves the clock: a composite's components (ComponentClock)
        # leave it to the outer step, so no outer timer fires in the middle of a call.
        clock = self.rt.clock
        self.flow.outside(fn, *args)
        if not clock.real and not isinstance(clock, ComponentClock) and clock._queue:
            self.flow.outside(clock.advance, 0)     # (no timer pending, the usual case: none)

    def complete(self):
        """End the input (Q27): completion flows through every link, so reduce/buffer flush."""
        # INTERPRETATION I-084 §5.5 (Q27): __input__ completes when the host ends input; each node
        # then completes once all its sources have, and nodes only reachable by send(target=...) or
        # a switch complete in topological order after their upstream.
        for name in self.order:
            self.deliver(self.nodes[name].finish)

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

    def close(self):
        """§12.1 step 8: dispose of every subscription and host hook."""
        for node in self.nodes.values():
            node.out.dispose()
            if isinstance(node, _Sink):
                node.hooks.clear()

    def subscribe(self, name, fn):
        """A late subscriber to a stream: hot and replay streams replay their memory (§5.3.1).
        Host-side only, so it may watch the §6.10 graph-internal streams (in mixed mode)."""
        node = self.nodes.get(name)
        if node is None:
            raise error(RoutingError, f"no stream named {name!r} to subscribe to (streams: "
                        f"{', '.join(sorted(self.nodes))})", "5.1")
        node.out.subscribe(fn)

    def watch(self, fn):
        """Host-side tracing: fn(stream, msg) for every message a stream carries, before the
        stream's targets see it, and for every graph node and run event (§6.10), in pure graph
        mode too. Adds no stream and changes no delivery."""
        for name, node in self.nodes.items():
            if name in self.internal_streams:       # those come straight from the graphs below
                continue
            node.out.watch(lambda msg, name=name: fn(name, msg))
        for graph in self.rt.graphs.values():
            graph.observers.append(fn)

    # Forwarding and errors (used by operators) ---------------------------------------------
    def forward(self, source, target, msg):
        """switch/bridge forwarding; False when `target` names no stream (= no-match, §5.3.2)."""
        node = self.nodes.get(target)
        if node is None or target == INPUT:
            return False
        if msg.source_stream != source:
            msg = msg.copy(source_stream=source)
        self.flow.call(node.push, msg)
        return True

    def fail(self, origin, msg, exc):
        """§12.2.3: an operator failed on `msg`: one "Error: <reason>" message on __error__."""
        out = msg.copy(content=ERROR_PREFIX + error_reason(exc), source_stream=origin,
                       timestamp=self.rt.clock.now())
        out.metadata.update(error=True, error_type=error_category(exc))
        self.flow.call(self.nodes[ERROR].push, out)

    def report(self, msg):
        """Put a copy of `msg` on __error__ (the original may also travel downstream)."""
        self.flow.call(self.nodes[ERROR].push, msg.copy())

    def _to_error(self, msg):
        """§12.2.3: string content, metadata.error and error_type -- on a copy, since other
        targets of the same emission hold the original."""
        meta = msg.metadata
        if isinstance(msg.content, str) and "error" in meta and "error_type" in meta:
            return msg
        msg = msg.copy(content=msg.content if isinstance(msg.content, str) else str(msg.content))
        msg.metadata.setdefault("error", True)
        msg.metadata.setdefault("error_type", "ExecutionError")
        return msg

    # §18 --diagram ------------------------------------------------------------------------
    def mermaid(self):
        """Mermaid flowchart lines (no header) for routes with operators, links and conditions."""
        ids = {name: mermaid_stream_id(name) for name in self.nodes}
        lines = []
        for name, node in self.nodes.items():
            if name in self.internal_streams:      # §6.10 plumbing: drawn by the graph itself
                continue
            label = mermaid_text(node.describe())
            shape = f'(("{label}"))' if name in BUILTIN_STREAMS else f'["{label}"]'
            lines.append(f"{ids[name]}{shape}")
        for (source, target), conds in self.edges.items():
            if any(cond is None for cond, _path in conds):
                lines.append(f"{ids[source]} --> {ids[target]}")
            else:
                label = mermaid_text(" or ".join(describe_condition(c) or "always"
                                                 for c, _p in conds))
                lines.append(f'{ids[source]} -->|"{label}"| {ids[target]}')
        for name, node in self.nodes.items():
            for target, _path in _switch_targets(getattr(node, "ops", None), ()):
                if target in ids:
                    lines.append(f"{ids[name]} -. switch .-> {ids[target]}")
        return lines


class _Sink(_Node):
    """__error__ (and, through _OutputSink, __output__): a cold stream plus host hooks, after a
    per-message adjustment."""

    def __init__(self, net, name, adjust):
        super().__init__(net, name, net.flow.stream(name))
        self.adjust, self.hooks, self.delivering = adjust, [], False

    def push(self, msg):
        self.hand_on(self.adjust(msg))

    def hand_on(self, msg):
        """To the routes this stream feeds, then to the host hooks, in that order."""
        if self.out.observers:          # routes fed from this stream (a merge from __error__)
            self.feed(msg)
        call = self.net.flow.call
        for hook in self.hooks:
            call(hook, msg)

    def feed(self, msg):
        """Hand `msg` to the routes this stream feeds, cutting a feedback loop (§12.6)."""
        if self.delivering:
            # §12.6: a message emitted here while this stream is still delivering another (e.g.
            # an error handler fed from __error__ that fails) goes to the host only.
            self.net.rt.warn(f"{self.name} feedback loop cut for one message", section="12.6")
            return
        self.delivering = True
        self.out.next(msg)
        self.net.flow.ensure(self._fed)     # once the routes it feeds have taken it

    def _fed(self):
        self.delivering = False


class _OutputSink(_Sink):
    """__output__: what reaches it leaves without its §12.5 routing prefix (a copy, since other
    targets of the same emission hold the original)."""

    def __init__(self, net):
        super().__init__(net, OUTPUT, None)
        self.heads, self.strip = net.strip_heads, net.strip

    def push(self, msg):
        # Every token the pattern matches begins with one of the literal heads, so content
        # starting with none of them (nearly all) needs no regex match
        content = msg.content
        if isinstance(content, str) and content.startswith(self.heads):
            match = self.strip.match(content)
            if match:
                msg = msg.copy(content=content[match.end():])
        self.hand_on(msg)


class GraphParticipant(_Node):
    """A graph route fed by a merge, split, pipeline or the default router (§6, §7).

    Each message runs the graph once (pure=True in pure graph mode, §6.9); the run's output
    (GraphRun.output, §6 Q28) continues as this stream's message.
    """

    def __init__(self, net, name, graph):
        super().__init__(net, name, net.flow.stream(name))
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
        if not self.net.pure:       # §6.10: the run's final state on __<graph>_state__
            self.net._graph_event(f"__{self.name}_state__", Message(
                run.state, {"graph": self.name}, f"__{self.name}_state__", rt.clock.now()))
        self.out.next(out)

    def describe(self):
        return f"{self.name}: graph"


def default_router(rt):
    """The §9.3 default_router of the network being built: host_parameter's one precedence (the
    Runtime's setting, then the document's top-level key, then its cleveragents block)."""
    name = host_parameter(rt.doc, "default_router", rt.default_router)[0]
    return name if isinstance(name, str) else None


def publication_links(routes):
    """§5.5: each publication target receives every emission of its route (a graph route's
    emissions are its runs' outputs)."""
    # INTERPRETATION I-085 §5.5, §6.1: a graph route may declare publications too (the issue's
    # "graph routes ... emit to their publications"); §6.1's table lists none, §5.5 speaks of
    # streams.
    links = []
    for name, cfg in routes.items():
        if route_type(cfg) in ("stream", "graph"):
            for i, target in enumerate(cfg.get("publications") or []):
                links.append((name, target, None, ("routes", name, "publications", i)))
    # Subscriptions are validated by check_streams and never wired (§5.5).
    return links

def stream_edges(data, known, default=None):
    """Every static source -> target link of the stream side, with the config path declaring it.

    Publications (§5.5), merges (§7.1), splits (§7.2), the default router (§3.4), switch and
    bridge-router targets (§5.3.2) and pipelines (§7.3). Used for §12.6 and for diagrams.
    """
    edges = []
    routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
    for name, cfg in routes.items():
        kind = route_type(cfg)
        if kind in ("stream", "graph"):
            for i, target in enumerate(as_list(cfg.get("publications"))):
                edges.append((name, target, ("routes", name, "publications", i)))
        if kind == "stream":
            for target, path in _switch_targets(cfg.get("operators"),
                                                ("routes", name, "operators")):
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
    pipelines = data.get("pipelines") if isinstance(data.get("pipelines"), dict) else {}
    for name, cfg in pipelines.items():
        stages = cfg.get("stages") if isinstance(cfg, dict) else None
        for i, stage in enumerate(stages if isinstance(stages, list) else []):
            if isinstance(stage, dict) and _stage_type(stage) == "stream":
                for j, target in enumerate(as_list(stage.get("publications"))):
                    if is_known(target, known):
                        edges.append((name, target, ("pipelines", name, "stages", i,
                                                     "publications", j)))
    if isinstance(default, str):            # where the document names it, if it does (I-003)
        where = ("default_router",) if "default_router" in data else \
            ("cleveragents", "default_router") if "default_router" in (
                data.get("cleveragents") if isinstance(data.get("cleveragents"), dict) else {}) \
            else ()
        edges.append(("__input__", default, where))
    return edges


def _switch_targets(ops, path):
    """(target, path) of every switch/conditional_route target and default, nested cases too."""
    for i, op in enumerate(ops if isinstance(ops, list) else []):
        params = op.get("params") if isinstance(op, dict) else None
        if not isinstance(params, dict) or op.get("type") not in ("switch", "conditional_route"):
            continue
        here = path + (i, "params")
        for j, case in enumerate(as_list(params.get("cases"))):
            if isinstance(case, dict):
                if isinstance(case.get("target"), str):
                    yield case["target"], here + ("cases", j, "target")
                yield from _switch_targets(case.get("operators"), here + ("cases", j, "operators"))
        for name in (params.get("routes") or {}) if isinstance(params.get("routes"), dict) else ():
            yield name, here + ("routes", name)
        if isinstance(params.get("default"), str):
            yield params["default"], here + ("default",)
        yield from _switch_targets(params.get("default_operators"), here + ("default_operators",))


# §5.6 Bridge routes -----------------------------------------------------------------------
# The §5.6 tables: expression fields -> parameters the expression takes (§13.2.2).
BRIDGE_EXPRESSIONS = {
    "state_extractor": 1,
    "state_flattener": 1,
}
BRIDGE_CONDITION_EXPRESSIONS = {
    "custom_predicate": 2,      # (message, route configuration)
}
# The §5.6 fields whose shape is checked (the expressions above compile in the sandbox).
BRIDGE_FIELDS = fields_by_name(
    Field("upgrade_conditions",     MAPPING, None, "5.6"),
    Field("downgrade_conditions",   MAPPING, None, "5.6"),
    Field("preserve_subscriptions", BOOLEAN, None, "5.6"),
    Field("preserve_checkpointing", BOOLEAN, None, "5.6"),
    Field("metadata",               MAPPING, None, "5.6"),
)
FINITE_NUMBER = Constraint(is_number, "a finite number", (int, float))
# The §5.6 table of bridge condition keys, in its order, with the type each row gives (the
# expression row compiles as BRIDGE_CONDITION_EXPRESSIONS says). Advisory, yet typed: a valid
# declaration is never refused, a value of the wrong type is.
BRIDGE_CONDITIONS = fields_by_name(
    Field("needs_state",          BOOLEAN,          None, "5.6"),
    Field("message_count",        NON_NEGATIVE_INT, None, "5.6"),
    Field("custom_predicate",     STRING,           None, "5.6"),
    Field("idle_time",            SECONDS,          None, "5.6"),
    Field("state_size",           NON_NEGATIVE_INT, None, "5.6"),
    Field("no_conditionals_used", BOOLEAN,          None, "5.6"),
    Field("complexity_threshold", FINITE_NUMBER,    None, "5.6"),
)


def check_bridge(doc, cfg, path, rt=None):
    """§5.6: bridges are advisory (never acted on here), but their expressions must compile.

    {type: bridge, upgrade_conditions: {custom_predicate: "lambda m, cfg: ..."},
     state_extractor: "lambda s: ...", state_flattener: "lambda s: ..."}
    """
    check_fields(doc, cfg, BRIDGE_FIELDS, path)
    for key, nparams in BRIDGE_EXPRESSIONS.items():
        if cfg.get(key) is not None:
            _compile_located(doc, cfg[key], nparams, rt, path + (key,))
    for group in ("upgrade_conditions", "downgrade_conditions"):
        conds = cfg.get(group) or {}
        check_fields(doc, conds, BRIDGE_CONDITIONS, path + (group,))
        check_unknown(rt, conds, BRIDGE_CONDITIONS, path + (group,), "5.6",
                      "unknown bridge condition key {key!r} is ignored")
        for key, nparams in BRIDGE_CONDITION_EXPRESSIONS.items():
            if conds.get(key) is not None:
                _compile_located(doc, conds[key], nparams, rt, path + (group, key))


# =====================================================================================
# §6 GRAPH ROUTES
# =====================================================================================

# §6.1 Graph route structure -------------------------------------------------------------
# A graph route is run by one small executor (GraphRoute.run): it walks the graph step by step,
# one "next-node set" at a time (§6.7), applies each node's result to the one state of the route
# (§6.3), then follows every edge whose condition holds (§6.5). The handlers, the state rules,
# the checkpoint files, the guards and the setup analysis live under their own banners below.

# The §6.1 table. type, nodes and edges are checked for shape by check_graph itself (an edges
# of null is an empty sequence), the entry point by check_entry_point (§6.11).
GRAPH_FIELDS = fields_by_name(
    Field("type",               STRING,   REQUIRED, "6.1"),
    Field("nodes",              MAPPING,  REQUIRED, "6.1"),
    Field("edges",              SEQUENCE, REQUIRED, "6.1"),
    Field("entry_point",        ANY,      "start",  "6.11"),
    Field("checkpointing",      BOOLEAN,  False,    "6.1"),
    Field("checkpoint_dir",     STRING,   None,     "6.1"),
    Field("enable_time_travel", BOOLEAN,  False,    "6.1"),
    Field("parallel_execution", BOOLEAN,  True,     "6.1"),
    Field("state_class",        STRING,   None,     "6.3.3"),
    Field("bridge",             MAPPING,  None,     "6.1"),
    Field("metadata",           MAPPING,  None,     "6.1"),
    Field("template_config",    ANY,      None,     "8.7"),
)
GRAPH_OPTIONAL_FIELDS = {name: row for name, row in GRAPH_FIELDS.items()
                         if row.default is not REQUIRED}


def check_graph(rt, name, cfg, path, agent_names):
    """§6.1 with §6.2-§6.6, §6.11, §11.3, §16.2: one graph route, before any agent exists.

    Raises a located ConfigurationError; warns through rt. Each part is checked under the banner
    of the section that states its rules: nodes (check_nodes, §6.2), edges (check_edges, §6.4),
    the entry point and reachability (§6.11), state_class (§6.3.3), checkpoint_dir (§6.6).
    """
    doc, path = rt.doc, tuple(path)
    if not isinstance(cfg, dict):
        raise doc.error(ConfigurationError, path, f"graph route '{name}' must be a mapping", "6.1")
    nodes = cfg.get("nodes")
    if nodes is None and cfg.get("template_config") is not None:
        return                                              # §11.3: instantiated from a template
    if not isinstance(nodes, dict) or not nodes:
        raise doc.error(ConfigurationError, path + ("nodes",),
                        f"graph route '{name}' needs a non-empty nodes mapping", "6.1, 11.3")
    if "edges" not in cfg:
        raise doc.error(ConfigurationError, path + ("edges",),
                        f"graph route '{name}' needs an edges sequence", "6.1")
    if cfg["edges"] is not None and not isinstance(cfg["edges"], list):
        raise doc.error(ConfigurationError, path + ("edges",), "edges must be a sequence", "6.4")
    check_fields(doc, cfg, GRAPH_OPTIONAL_FIELDS, path)
    if cfg.get("checkpointing") and not cfg.get("checkpoint_dir"):
        # INTERPRETATION I-107 §6.1 (Q42): checkpointing without checkpoint_dir is rejected at load.
        raise doc.error(ConfigurationError, path + ("checkpoint_dir",),
                        "checkpointing: true needs a checkpoint_dir", "6.1, 6.6")
    known = check_nodes(rt, name, nodes, path, agent_names)
    check_edges(rt, name, cfg["edges"] or [], known, path)
    check_entry_point(doc, name, cfg, known, path)
    warn_unreachable(rt, name, cfg, path)
    warn_state_class(rt, cfg, path)
    if cfg.get("checkpointing"):
        check_checkpoint_dir(rt, cfg["checkpoint_dir"], path + ("checkpoint_dir",))


# INTERPRETATION I-092 §6.1 (Q28): a run's consumer-facing result is its latest output
# (last_output).
class GraphRun:
    """What one execution of a graph route gives back.

    `output` is the consumer-facing result (the run's latest output, §6.8/Q28), `state` a snapshot
    of the graph state at the end (messages list and metadata copied one level deep), `history`
    the executed node names in order, `stopped` the §6.8 guard that ended the run (or None),
    `replies` the assistant messages this run added to the state (never an earlier run's, Q34).
    """

    __slots__ = ("output", "state", "history", "stopped", "_held", "_replies")

    def __init__(self, output, state, history, stopped=None, held=()):
        self.output, self.state, self.history, self.stopped = output, state, history, stopped
        self._held = held           # the state messages from before the run (see replies)
        self._replies = None

    @property
    def replies(self):
        """The assistant messages of the final state that this run added (§6.3.1, Q34).

        Worked out on first read (only graph_execute reads it): a message is this run's when it
        is not one of the objects the state held before the run; holding those keeps their ids
        theirs even once the 50-message cap dropped them. Working it out for every run would
        cost each run the walk over its messages, whether or not anyone reads them."""
        if self._replies is None:
            earlier = set(map(id, self._held))
            self._replies = [m for m in self.state["messages"] if id(m) not in earlier
                             and isinstance(m, dict) and m.get("role") == "assistant"]
            self._held = ()
        return self._replies

    def __repr__(self):
        return (f"GraphRun(output={self.output!r}, history={self.history!r}, "
                f"stopped={self.stopped!r})")


class _RunTrace:
    """Per-run bookkeeping for the §6.8 guards: path, fingerprints, depth, latest output."""

    __slots__ = ("history", "seen", "depth", "output", "stopped", "held")

    def __init__(self, output, messages=()):
        self.history = []
        self.seen = set()
        self.depth = 0
        self.output = output
        self.stopped = None
        self.held = list(messages)  # the state messages from before this run (GraphRun.replies)


class GraphRoute:
    """§6: one graph route -- its analysed structure, its one persistent state, and its executor.

    `{type: graph, nodes: {...}, edges: [...], entry_point: start, checkpointing: false, ...}`
    """

    def __init__(self, name, cfg, rt, path=None):
        self.name = name
        self.cfg = cfg
        self.rt = rt
        self.path = tuple(path or ("routes", name))
        self.entry = normalize_node_name(cfg.get("entry_point",
                                                 GRAPH_FIELDS["entry_point"].default))
        self.nodes = build_nodes(self)                      # name -> GraphNode, start/end included
        self.edges = build_edges(self)                      # [GraphEdge] in declaration order
        self.analysis = analyse_graph(self.entry, self.nodes, self.edges, implicit_names(cfg))
        wire_nodes(self.nodes, self.analysis)               # §6.11 adjacency, for stepping
        self.parallel_execution = bool(cfg.get("parallel_execution", True))
        self.max_depth = max(2000, 50 * len(self.nodes))     # §6.8 item 1
        self.state = new_graph_state(state_schema(cfg))
        self.time_travel = bool(cfg.get("enable_time_travel", False))
        self.snapshots = snapshot_history(self)              # §6.6 time travel, oldest first
        self.checkpoint_dir = None
        if cfg.get("checkpointing"):
            self.checkpoint_dir = checkpoint_target(rt, cfg["checkpoint_dir"])
            try:
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)   # §6.6 item 1
            except (OSError, ValueError) as exc:
                # check_checkpoint_dir found it creatable; only a change on disk since lands here.
                raise rt.doc.error(ConfigurationError, self.path + ("checkpoint_dir",),
                                   f"cannot create checkpoint_dir: {exc}", "6.6") from None
        self._checkpoint_last = None            # its directory's series (checkpoint_name)
        # §6.6 where checkpoints are written (CheckpointFiles, or A.1's writer process)
        self.store = checkpoint_store(self) if self.checkpoint_dir is not None else None
        self.walk = graph_walker(self)                       # §6.5 stepping, or A.2's
        self.observers = []                                  # §6.10 node-event listeners
        self._pool = None                                    # §6.7 worker threads, made on demand
        self._lock = threading.RLock()                       # one run or update at a time
        self.write_back, self.run_result = run_ending(self)  # §6.9 item 3, §6.1, or A.2's

    # -- executing -------------------------------------------------------------------------
    # A step's results are (GraphNode, output) pairs; the edges out of a node are node.out
    # (§6.11 forward adjacency) and each edge knows its target GraphNode, so stepping looks
    # nothing up by name.
    def run(self, content, ctx=None, *, pure=False):
        """Execute the graph once for `content` (§6.2.1 start receives it) and return a GraphRun.

        `ctx` is the invocation context (the message's metadata.context, §10.2); it becomes
        state.metadata.context by reference and, after the run, is replaced in place by the final
        metadata (§6.9 item 3). pure=True: the active context rt.context is the one replaced.
        """
        target_ctx = self.rt.context if (pure or ctx is None) else ctx
        with self._lock:
            trace = _RunTrace(content, self.state["messages"])
            begin_run(self.state, content, target_ctx)
            if self.observers:
                notify_control(self, {"event": "started", "input": content})
            entry = self.nodes[self.entry]
            if entry.type == START_NODE:        # start hands the message on and changes nothing
                return self._continue([(entry, content)], trace, target_ctx)
            if entry.type == END_NODE:
                return self._continue([], trace, target_ctx)
            return self._continue(None, trace, target_ctx, first=[(entry, content)])

    def resume(self, ctx=None, *, pure=False):
        """Continue an interrupted run from a restored state: follow the edges out of
        state.current_node with metadata.last_output as the message (§6.6 recovery)."""
        target_ctx = self.rt.context if (pure or ctx is None) else ctx
        with self._lock:
            metadata = self.state["metadata"]
            metadata["context"] = target_ctx
            name, output = self.state.get("current_node"), metadata.get("last_output", "")
            node = self.nodes.get(name) if isinstance(name, str) else None
            done = node is None or node.type == END_NODE
            if self.observers:
                notify_control(self, {"event": "resumed", "node": name, "input": output})
            return self._continue([] if done else [(node, output)],
                                  _RunTrace(output, self.state["messages"]), target_ctx)

    def _continue(self, results, trace, target_ctx, first=None):
        """Step from `results` (node, output) -- or from running the node set `first` -- until
        no branch is left or a guard stops the run."""
        # A run inside a timed-out call stops before each step instead of stepping on (§5.3.4).
        # Outside any bounded call (no timeout up the chain) nothing can have been abandoned.
        bounded = _BOUNDED_CALL.get() is not None
        try:
            if first is not None:
                results = self._step(first, trace)
            self.walk(self, results, trace, bounded)
            if bounded:
                check_not_abandoned(f"graph '{self.name}'", "6.7")
        except Exception as exc:
            if self.observers:
                notify_control(self, {"event": "failed", "error": error_reason(exc),
                                      "error_type": error_category(exc),
                                      "history": list(trace.history)})
            raise
        self.write_back(self.state, target_ctx)
        if self.observers:
            notify_control(self, {"event": "stopped" if trace.stopped else "finished",
                                  "guard": trace.stopped, "output": trace.output,
                                  "history": list(trace.history)})
        return self.run_result(self, trace)

    def _walk(self, results, trace, bounded):
        """§6.5 step after step: the next-node set is every edge whose condition holds (from
        each node of the last step), run as one step (§6.7), until no branch is left or a
        guard stops the run."""
        while results and trace.stopped is None:
            frontier = self._next_nodes(results)
            if not frontier:
                break
            if bounded:
                check_not_abandoned(f"graph '{self.name}'", "6.7")
            results = self._step(frontier, trace)

    def run_node(self, node_name, content, ctx=None):
        """Execute one node on `content` and apply its result (the graph_node operator, §5.3.2)."""
        name = normalize_node_name(node_name)
        node = self.nodes.get(name)
        if node is None:
            raise self.rt.doc.error(ExecutionError, self.path, f"graph '{self.name}' has no node "
                                    f"'{node_name}'", "5.3.2")
        if node.type in (START_NODE, END_NODE):
            return content                          # they pass the message on, updating nothing
        with self._lock:
            self.state["metadata"]["context"] = self.rt.context if ctx is None else ctx
            result = node.handler(self, node, content, self.state)
            output, _ = self._finish(node, content, result, _RunTrace(content), True)
            return output

    def _step(self, frontier, trace):
        """Run one next-node set; return [(node, output)] in frontier order (§6.7). A guard
        that stops the run before a node sets trace.stopped; nothing more of the set runs."""
        state = self.state
        relaxed = guards_relaxed(state)
        admitted = []
        for node, message in frontier:
            if guard_before_node(self, node, message, trace, relaxed):
                break
            admitted.append((node, message))
        results = [None] * len(admitted)

        def settle(i, result, error):
            """Apply node i's outcome at once; True when a guard stopped the run."""
            if error is not None:
                self._fail(error)
            node, message = admitted[i]
            output, stopped = self._finish(node, message, result, trace, relaxed)
            results[i] = (node, output)
            return stopped

        run_next_node_set(self, admitted, state, settle)
        return [done for done in results if done is not None]

    def _fail(self, error):
        """A node failed: the run stops with state.error set (§6.3.1) and the §20 error raised."""
        self.state["error"] = str(error)
        raise error

    def _finish(self, node, message, result, trace, relaxed):
        """Apply one node's result as one state update (§6.3, Q42/Q43) and run the after-node
        guards; return (output, whether a guard stopped the run)."""
        # §6.2.6.4: a router that matched nothing (result None) leaves state and message as they
        # were
        if result is None:
            if node.type != START_NODE:
                trace.history.append(node.name)
                node.executions += 1
                if self.observers:
                    notify_node_event(self, node, message)
            return message, False
        output = result.output
        if node.type != START_NODE:             # an edge may lead back to start
            trace.history.append(node.name)
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
            metadata["last_output"] = output
            messages = state["messages"]
            if result.last_content is not None and messages:
                messages[-1] = {**messages[-1], "content": result.last_content}
            if result.messages:
                messages.extend(result.messages)
                if len(messages) > MAX_STATE_MESSAGES:
                    del messages[:len(messages) - MAX_STATE_MESSAGES]
            state["current_node"] = node.name
            count_update(self, node, result)    # §6.6: snapshots and checkpoints count updates
            node.executions += 1                # §12.2.1 execution_count, every execution
            if self.observers:                  # mixed mode: tell its §6.10 internal stream
                notify_node_event(self, node, output)
        trace.output = output
        return output, node.guarded_after and guard_after_node(self, node, output, trace, relaxed)

    def _next_nodes(self, results):
        """§6.5: every edge whose condition holds, in declaration order; end closes a branch."""
        # INTERPRETATION I-105 §6.5 (Q40): level by level; reaching end closes one branch, and the
        # run ends when no branch is left.
        frontier, taken = [], set()
        state = self.state
        for node, output in results:
            view = None
            for edge in node.out:
                # INTERPRETATION I-106 §6.7 (Q41): a node reached twice in one step runs once
                if edge.target in taken:
                    continue
                if edge.condition is not None:
                    if view is None:
                        view = condition_view(state, output)
                    if not evaluate_condition(edge.condition, "edge", view, self.rt, edge.path):
                        continue
                taken.add(edge.target)
                if edge.target != END_NODE:
                    frontier.append((edge.node, output))
        return frontier

    # -- state, checkpoints, time travel (§6.3, §6.6) ------------------------------------
    def update_state(self, content, mode="merge"):
        """Apply `content` as one state update (the state_update operator, §5.3.2, §6.3.2)."""
        update = state_update_from_content(content)
        # T2 (README Security): what lands in metadata may not set a host-only key (§10.3).
        refuse_host_keys({key: value for key, value in update.items() if key != "messages"},
                         "a state_update message")
        with self._lock:
            apply_state_update(self.state, update, mode)
            count_update(self)

    def checkpoint(self):
        """Write the full state to checkpoint_<timestamp>.json now; return its path (§6.6)."""
        if self.checkpoint_dir is None:
            raise self.rt.doc.error(ExecutionError, self.path, f"graph '{self.name}' has no "
                                    "checkpoint_dir (checkpointing is off)", "6.6")
        with self._lock:
            return write_checkpoint(self, self.state)

    def checkpoints(self):
        """Checkpoint files of this graph, oldest first; the last is the latest (§6.6 item 3)."""
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return []
        self.flush_checkpoints()
        return sorted(self.checkpoint_dir.glob(CHECKPOINT_GLOB))

    def wait_for_checkpoints(self):
        """Wait until every checkpoint given to the store is on disk (§6.6)."""
        if self.store is not None:
            self.store.wait()

    def flush_checkpoints(self):
        """wait_for_checkpoints, then report a write that failed meanwhile (ExecutionError)."""
        if self.store is not None:
            try:
                self.store.flush()
            except (OSError, ValueError) as exc:
                raise self.rt.doc.error(ExecutionError, self.path, f"graph '{self.name}' cannot "
                                        f"write a checkpoint: {exc}", "6.6") from None

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

    def close(self):
        """Finish the checkpoints given to the store; stop the worker threads (§12.1 cleanup).
        A checkpoint whose write failed is warned here, since no later one will report it."""
        if self.store is not None:
            failure = self.store.close()
            if failure is not None:
                self.rt.warn(f"graph '{self.name}': a checkpoint could not be written: "
                             f"{failure}", section="6.6", path=self.path)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

# §6.2 Nodes -------------------------------------------------------------------------------
class GraphNode:
    """One node, prepared at setup: type, handler, and the fields its handler reads."""

    __slots__ = ("name", "type", "cfg", "handler", "parallel", "is_router", "agent", "retries",
                 "retry_delay", "timeout", "max_history_messages", "max_history_chars",
                 "rules", "function", "tools", "condition", "graph", "routes_only_to_router",
                 "out", "plain_next", "guarded_after", "executions", "path")

    def __init__(self, name, node_type, cfg, path):
        self.name, self.type, self.cfg, self.path = name, node_type, cfg, path
        self.handler = NODE_TYPES[node_type][0]
        self.parallel = bool(cfg.get("parallel", False))
        self.is_router = node_type == "message_router"
        self.agent = cfg.get("agent")
        policy = cfg.get("retry_policy")      # defaults from the §6.2.2 tables (AGENT_NODE_FIELDS)
        policy = field_values(policy, RETRY_POLICY_FIELDS) if policy is not None else None
        self.retries = int(policy["max_retries"]) if policy is not None else 0
        self.retry_delay = float(policy["delay"]) if policy is not None else 0.0
        self.timeout = cfg.get("timeout")
        history = field_values(cfg.get("metadata") or {}, NODE_HISTORY_FIELDS)     # §6.2.2.1
        self.max_history_messages = int(history["max_history_messages"])
        self.max_history_chars = int(history["max_history_chars"])
        self.rules = compile_router_rules(cfg, path) if self.is_router else ()
        self.function = cfg.get("function")
        tools = cfg.get("tools", [])
        self.tools = [tools] if isinstance(tools, str) else list(tools or [])
        self.condition = cfg.get("condition")
        self.graph = cfg.get("graph")
        self.routes_only_to_router = False          # set by the §6.11 analysis
        self.out = []                               # the edges leaving this node (§6.11)
        self.plain_next = None                      # the target of a lone unconditional edge
        self.guarded_after = False                  # whether a §6.8 item 3/4 guard applies here
        self.executions = 0                         # how often it ran (§12.2.1 execution_count)


class NodeResult:
    """What a node handler returns; GraphRoute._apply turns it into one state update.

    output: the text passed on along the edges; metadata: keys written to state.metadata (the
    node's value wins); messages: appended to state.messages; removed: keys taken out of
    state.metadata; set_state: merged into state.metadata (§6.2.6.3); last_content: new content
    for the last state message (§6.2.6.4).
    """

    __slots__ = ("output", "metadata", "messages", "removed", "set_state", "last_content")

    def __init__(self, output, metadata=None, messages=None, removed=None, set_state=None,
                 last_content=None):
        self.output = output
        self.metadata = metadata
        self.messages = messages
        self.removed = removed
        self.set_state = set_state
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

# Fields every node type accepts (§6.2; `parallel` is §6.7's). type is check_nodes' own.
NODE_COMMON_FIELDS = fields_by_name(
    Field("type",        STRING,  REQUIRED, "6.2"),
    Field("metadata",    MAPPING, None,     "6.2"),
    Field("parallel",    BOOLEAN, False,    "6.7"),
    Field("description", ANY,     None,     "6.2"),
)


def check_nodes(rt, graph_name, nodes, path, agent_names):
    """§6.2, §15.1-§15.2, §16.2: every node's name and type, then its type's NODE_TYPES fields and
    NODE_CHECKS; unknown node keys draw a warning. Returns the node names edges may use."""
    doc = rt.doc
    declared = {}
    for node_name, node_cfg in nodes.items():
        where = path + ("nodes", node_name)
        if not isinstance(node_name, str) or not node_name:
            raise doc.error(ConfigurationError, where, "node names must be non-empty strings",
                            "6.2")
        if not isinstance(node_cfg, dict) or "type" not in node_cfg:
            raise doc.error(ConfigurationError, where,
                            f"node '{node_name}' must be a mapping with a type", "6.2")
        node_type = str(node_cfg["type"]).lower()
        if node_type == "dynamic_router":
            raise doc.error(ConfigurationError, where + ("type",),
                            "node type 'dynamic_router' is forbidden; use message_router", "16.2")
        if node_type not in NODE_TYPES:     # INTERPRETATION I-112 §6.2: no extension node types
            raise doc.error(ConfigurationError, where + ("type",),
                            f"unknown node type '{node_cfg['type']}'", "6.2")
        if node_name in RESERVED_STREAM_NAMES:
            raise doc.error(ConfigurationError, where,
                            f"node name '{node_name}' is a reserved stream name", "15.1")
        canonical = normalize_node_name(node_name)
        # INTERPRETATION I-111 §6.2 (Q83): start/end (START/END) may be declared only as nodes of
        # their own type; any other node under these names is rejected.
        if canonical in (START_NODE, END_NODE) and node_type != canonical:
            raise doc.error(ConfigurationError, where, f"node name '{node_name}' is reserved for "
                            f"the {canonical} node", "6.2, 15.2")
        if canonical not in (START_NODE, END_NODE) and node_type in (START_NODE, END_NODE):
            raise doc.error(ConfigurationError, where + ("type",),
                            f"only the node named {node_type} may have type {node_type}", "6.2.1")
        if canonical in declared:
            raise doc.error(ConfigurationError, where, f"node '{node_name}' is declared twice "
                            "(START/END name one node)", "6.4")
        declared[canonical] = node_type
    known = set(declared) | {START_NODE, END_NODE}
    for node_name, node_cfg in nodes.items():
        where = path + ("nodes", node_name)
        node_type = declared[normalize_node_name(node_name)]
        fields = NODE_TYPES[node_type][1]
        check_fields(doc, node_cfg, NODE_COMMON_FIELDS, where)
        check_fields(doc, node_cfg.get("metadata") or {}, NODE_HISTORY_FIELDS,
                     where + ("metadata",))
        check_fields(doc, node_cfg, fields, where)
        extra = NODE_CHECKS.get(node_type)
        if extra is not None:
            extra(rt, graph_name, node_name, node_cfg, where, agent_names, known)
        check_unknown(rt, node_cfg, (fields, NODE_COMMON_FIELDS), where, "6.2",
                      "unknown key '{key}' on node '{node}' ignored", node=node_name)
    return known

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


_message_content = operator.itemgetter("content")
_dict_update = dict.update             # fills a NodeContext without noting the keys as written


def trim_history(messages, max_messages, max_chars, end=None):
    """§6.2.2.1: the newest `max_messages` of messages[:end] whose contents total at most
    `max_chars` characters."""
    end = len(messages) if end is None else end
    if max_messages <= 0:
        return []
    history = messages[end - max_messages if end > max_messages else 0:end]
    try:                                     # the common case: string contents within budget
        if len("".join(map(_message_content, history))) <= max_chars:
            return history
    except (KeyError, TypeError):
        pass
    total = 0
    for index in range(len(history) - 1, -1, -1):
        entry = history[index]
        total += len(str(entry.get("content", "") if isinstance(entry, dict) else entry))
        if total > max_chars:
            return history[index + 1:]
    return history


class NodeContext(dict):
    """The context mapping an agent node hands its agent: a plain dict to every reader, which also
    notes each key the agent writes or removes, so that §6.2.2 item 3 copies back exactly those
    keys without comparing the whole mapping before and after the call."""

    touched = frozenset()           # the keys written or removed; most agents never write

    def _note(self, *keys):
        self.touched = self.touched.union(keys)

    def __setitem__(self, key, value):
        self._note(key)
        super().__setitem__(key, value)

    def __delitem__(self, key):
        super().__delitem__(key)
        self._note(key)

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs):
        written = dict(*args, **kwargs)
        self._note(*written)
        super().update(written)

    def setdefault(self, key, default=None):
        if key not in self:
            self._note(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        if key in self:
            self._note(key)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self._note(key)
        return key, value

    def clear(self):
        self._note(*self)
        super().clear()

    def changes(self):
        """(key -> value for every key written, the set of keys removed); reserved keys left out."""
        if not self.touched:
            return {}, ()
        touched = self.touched - AGENT_NODE_RESERVED_KEYS
        written = {key: self[key] for key in touched if key in self}
        return written, touched - written.keys()


def agent_node_context(node, state, message, writes=True):
    """§6.2.2 item 2: the context mapping an agent node hands to its agent: a NodeContext, or a
    plain dict for an agent that cannot write it (`writes` false: nothing to note or copy back)."""
    metadata = state["metadata"]
    messages = state["messages"]
    # INTERPRETATION I-095 §6.2.2 (Q30): the history is the conversation before the message the node
    # receives; when the newest state message is that message, it is the input, not history.
    end = len(messages)
    if end and messages[-1].get("content") == message:
        end -= 1
    history = trim_history(messages, node.max_history_messages, node.max_history_chars, end)
    # INTERPRETATION I-098 §6.2.2 (Q33): a top-level metadata key wins over a nested context key;
    # the keys the node adds win over both. The mapping is filled through dict's own methods, so
    # that only the agent's writes are noted.
    nested = metadata.get("context")
    # INTERPRETATION I-116 §6.2.2 items 2-3: the reserved keys are key-level; the history list is
    # new per call, its entries the state's own records (by reference, §10.2).
    # graph_state is a picture of the state (§6.2.2 item 2): its own metadata dict, so that an
    # agent writing into it cannot reach the live state, nor a parallel sibling's view (§6.7).
    # (Kept for readers too: a SIMPLE prompt expression may call a dict's methods, §13.2.2.)
    reserved = {
        "graph_state": {"messages": history, "metadata": dict(metadata),
                        "current_node": state["current_node"],
                        "execution_count": state["execution_count"], "error": state["error"]},
        "conversation_history": history,
        "full_context": True}
    if len(history) < end:
        reserved["_history_truncated"] = True
        reserved["_history_original_length"] = end
    if not writes:
        # One dict display instead of a NodeContext filled in three updates (1.66 -> 1.47 us a
        # context, measured): an agent that cannot write has no writes to note.
        return {**nested, **metadata, **reserved} if isinstance(nested, dict) \
            else {**metadata, **reserved}
    ctx = NodeContext(nested) if isinstance(nested, dict) else NodeContext()
    _dict_update(ctx, metadata)
    _dict_update(ctx, reserved)
    return ctx                          # from here on, the agent's writes are noted


def invoke_with_timeout(agent, content, ctx, timeout):
    """Call agent.invoke, giving up after `timeout` real seconds (the call runs on a thread; once
    given up, it makes no further effect: see call_abandoned, §5.3.4)."""
    if timeout is None:
        return agent.invoke(content, ctx)
    finished, reply = run_bounded(lambda: agent.invoke(content, ctx), float(timeout),
                                  f"node-agent-{agent.name}")
    if not finished:
        raise error(ExecutionError, f"agent '{agent.name}' timed out after {timeout} s", "6.2.2")
    return reply


def node_agent(graph, node, message, state):
    """§6.2.2 run the named agent on the current message with the graph-built context.

    `{type: agent, agent: <name>, retry_policy: {max_retries: 3, delay: 1.0}, timeout: <s>,
    parallel: false, metadata: {max_history_messages: 20, max_history_chars: 12000}}`
    """
    agent = graph.rt.agents[node.agent]
    # INTERPRETATION I-117 §6.2.2 item 2: built only for an agent that can read it.
    # Building the context is work only an agent that reads it can tell happened: one that
    # cannot (reads_context false, e.g. a tool agent with only CONTEXT_FREE_TOOLS) gets an
    # empty mapping; what it returns, and items 3-4 below, are the same either way.
    builds = getattr(agent, "reads_context", True)
    # An agent that reads but cannot write (an LLM agent, built-in tools) gets a plain dict: no
    # writes to note, no failed attempt's keys to drop, nothing but item 4 to copy back.
    writes = builds and getattr(agent, "writes_context", True)
    # INTERPRETATION I-110 §6.2.2 (Q45): the agent renders Phase C with this node-built context.
    # INTERPRETATION I-109 §6.2.2 (Q44): raised errors are retried; `timeout` bounds each attempt; a
    # failed attempt's written or removed keys are dropped (objects changed in place stay
    # changed: they are shared by reference); after the last one the run fails (state.error).
    attempt = 0
    while True:
        # An agent that cannot read its context cannot write it either: a plain empty dict.
        ctx = agent_node_context(node, state, message, writes) if builds else {}
        try:
            if node.timeout is None:
                reply = agent.invoke(message, ctx)
            else:
                reply = invoke_with_timeout(agent, message, ctx, node.timeout)
            break
        except Exception as exc:
            if attempt >= node.retries or call_abandoned():     # a zombie never tries again
                if isinstance(exc, ActorError):
                    raise
                raise error(ExecutionError, f"graph '{graph.name}' node '{node.name}': agent "
                            f"'{node.agent}' failed: {exc}", "6.2.2") from exc
            attempt += 1
            if graph.rt.clock.real and node.retry_delay > 0:
                time.sleep(node.retry_delay)        # a real wait between attempts
    if reply.__class__ is not str:
        reply = str(reply)
    if writes and ctx.touched:                                  # most agents write nothing
        changes, removed = ctx.changes()
        changes["last_agent_node"] = node.name                 # §6.2.2 item 4
    else:
        changes, removed = {"last_agent_node": node.name}, None
    # INTERPRETATION I-094 §6.3.1 (Q29): the reply joins state.messages as an assistant message.
    return NodeResult(reply, changes, [{"role": "assistant", "content": reply}], removed or None)

# The §6.2.2 fields, the retry_policy mapping, and the history bounds every node's metadata may
# set (§6.2.2.1).
AGENT_NODE_FIELDS = fields_by_name(
    Field("agent",        STRING,           REQUIRED, "6.2.2"),
    Field("retry_policy", MAPPING,          None,     "6.2.2"),
    Field("timeout",      POSITIVE_SECONDS, None,     "6.2.2"),
)
RETRY_POLICY_FIELDS = fields_by_name(
    Field("max_retries", NON_NEGATIVE_INT, 3,   "6.2.2"),
    Field("delay",       SECONDS,          1.0, "6.2.2"),
)
NODE_HISTORY_FIELDS = fields_by_name(
    Field("max_history_messages", NON_NEGATIVE_INT, 20,    "6.2.2.1"),
    Field("max_history_chars",    NON_NEGATIVE_INT, 12000, "6.2.2.1"),
)


def check_agent_node(rt, graph_name, node_name, cfg, where, agent_names, known):
    """§6.2.2, §11.3: the agent is defined; the retry policy's own fields."""
    if cfg["agent"] not in agent_names:
        raise rt.doc.error(ConfigurationError, where + ("agent",),
                           f"agent '{cfg['agent']}' is not defined in agents", "6.2.2, 11.3")
    if cfg.get("retry_policy") is not None:
        check_fields(rt.doc, cfg["retry_policy"], RETRY_POLICY_FIELDS, where + ("retry_policy",))
        check_unknown(rt, cfg["retry_policy"], RETRY_POLICY_FIELDS, where + ("retry_policy",),
                      "6.2.2", "unknown retry_policy key {key!r} ignored")

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
    # INTERPRETATION I-103 §6.2.3 (Q38): valid iff the latest state message has non-blank content.
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
    # INTERPRETATION I-102 §6.2.3 (Q37): the names come from `tools`; nothing runs, the entries are
    # the fixed records the section prescribes.
    results = [{"tool": name, "result": f"Executed {name}"} for name in node.tools]
    return NodeResult(message, metadata={"tool_results": results})

# The §6.2.3 fields: a function name (an unknown one adds nothing), tool names (one or a list).
FUNCTION_NODE_FIELDS = fields_by_name(Field("function", STRING, REQUIRED, "6.2.3"))
TOOL_NAMES = Constraint(lambda value: isinstance(value, str) or isinstance(value, list) and all(
    isinstance(name, str) for name in value), "a list of tool names")
TOOL_NODE_FIELDS = fields_by_name(Field("tools", TOOL_NAMES, [], "6.2.3"))

# §6.2.4 Conditional nodes -------------------------------------------------------------
def node_conditional(graph, node, message, state):
    """§6.2.4 evaluate the condition on the state into metadata.condition_result.

    `{type: conditional, condition: {type: has_messages}}`
    """
    result = evaluate_condition(node.condition, "node", condition_view(state, message), graph.rt,
                                node.path + ("condition",))
    return NodeResult(message, metadata={"condition_result": bool(result)})

CONDITIONAL_NODE_FIELDS = fields_by_name(Field("condition", MAPPING, REQUIRED, "6.2.4"))


def check_conditional_node(rt, graph_name, node_name, cfg, where, agent_names, known):
    """§6.2.4, §5.4: the condition has the shape of a §5.4 condition."""
    wrong = condition_shape_error(cfg["condition"])
    if wrong is not None:
        raise rt.doc.error(ConfigurationError, where + ("condition", wrong[0]), wrong[1],
                           "6.2.4, §5.4")

# §6.2.5 Subgraph nodes ------------------------------------------------------------------
def node_subgraph(graph, node, message, state):
    """§6.2.5 mark a nested graph: metadata.subgraph = <graph>, subgraph_pending = true.

    `{type: subgraph, graph: <graph_route_name>}`
    """
    # INTERPRETATION I-101 §6.2.5 (Q36): the route is named by `graph`; it is recorded, never run.
    return NodeResult(message, metadata={"subgraph": node.graph, "subgraph_pending": True})

SUBGRAPH_NODE_FIELDS = fields_by_name(
    Field("graph",  STRING, REQUIRED, "6.2.5"),
    Field("params", ANY,    None,     "6.2.5"),
)


def check_subgraph_node(rt, graph_name, node_name, cfg, where, agent_names, known):
    """§6.2.5: `graph` names a graph route of the document."""
    routes = rt.doc.data.get("routes") if isinstance(rt.doc.data, dict) else None
    target = routes.get(cfg["graph"]) if isinstance(routes, dict) else None
    if not isinstance(target, dict) or str(target.get("type", "")).lower() != "graph":
        raise rt.doc.error(ConfigurationError, where + ("graph",), f"subgraph node '{node_name}' "
                           "must name a graph route in `graph`", "6.2.5")

# §6.2.6 Message router nodes -----------------------------------------------------------
RULES = Constraint(lambda value: isinstance(value, list) and bool(value),
                   "a non-empty list of rules")
ROUTER_NODE_FIELDS = fields_by_name(Field("rules", RULES, REQUIRED, "6.2.6"))


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
        # INTERPRETATION I-100 §6.2.6.3 (Q35): set_state is written into state.metadata.
        return NodeResult(extracted, metadata={"next_node": rule.target},
                          set_state=rule.set_state, last_content=extracted)
    return None                                                  # §6.2.6.4: state unchanged

# §6.2.6.1 Rule evaluation order ----------------------------------------------------------
# Pointer banner: node_message_router (above) tries node.rules in declaration order and the
# first rule that matches decides; later rules are not evaluated.

# §6.2.6.2 Match types --------------------------------------------------------------------
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
    # INTERPRETATION I-114 §6.2.6.2: whitespace after the stripped part is kept ("CODE fix" -> "
    # fix").
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


# INTERPRETATION I-113, I-165 §6.2.6.2 (deviation): a router regex outside the safe subset below
# is refused at load, located. Python's engine backtracks in C, where no deadline stops it.
def regex_may_backtrack(pattern):
    """None when `pattern` lies in the safe subset, else the reason it does not (T1, README
    Security). The subset: (1) an unbounded repeat (`*`, `+`, `{n,}`) holds no other quantifier
    but an exact `{n}` -- no `(a+)+`, `(a*)*b`, `(\\w+\\s?)*`, `(a?a?)*` -- and (2) no
    alternation other than one of single characters -- no `(a|ab)*`, `(foo|bar)+`, `^(a|a)*$`;
    (3) no two unbounded repeats stand side by side (`\\w+\\w*`, `.*.*`). What is left backtracks
    at most polynomially, its degree bounded by the unbounded repeats in one sequence."""
    try:
        parsed = _regex_parser.parse(pattern)
    except Exception:           # checked and reported by check_node
        return None
    c = _regex_constants
    repeats = (c.MAX_REPEAT, c.MIN_REPEAT) + ((c.POSSESSIVE_REPEAT,)
                                              if hasattr(c, "POSSESSIVE_REPEAT") else ())

    def unbounded(item):
        return item[0] in repeats and item[1][1] == c.MAXREPEAT

    def parts(value):           # the sub-patterns inside one parsed item's argument
        if isinstance(value, _regex_parser.SubPattern):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from parts(item)

    def shaped(item):           # a group holding one item stands for that item
        while item[0] is c.SUBPATTERN and len(item[1][-1]) == 1:
            item = item[1][-1][0]
        return item

    def risky(sub, under_repeat):
        items = list(sub)
        for before, after in zip(items, items[1:]):
            if unbounded(shaped(before)) and unbounded(shaped(after)):
                return "two unbounded repeats side by side"
        for op, arg in items:
            if op is c.BRANCH and under_repeat:
                # (the parser folds single-character branches into one set, so a branch left
                # here has longer or empty alternatives: `a|a` is `a` then (empty | empty))
                return "an alternation under an unbounded repeat"
            if op in repeats:
                if under_repeat and arg[0] != arg[1]:
                    return "a quantifier inside an unbounded repeat"
                inner = under_repeat or arg[1] == c.MAXREPEAT
                found = next(filter(None, (risky(x, inner) for x in parts(arg[2]))), None)
            else:
                found = next(filter(None, (risky(x, under_repeat) for x in parts(arg))), None)
            if found:
                return found
        return None
    return risky(parsed, False)


MATCH_TYPE = Constraint(lambda value: isinstance(value, str) and value.lower() in MATCH_TYPES,
                        "one of " + ", ".join(MATCH_TYPES))
ROUTER_RULE_FIELDS = fields_by_name(
    Field("match_type",      MATCH_TYPE, REQUIRED, "6.2.6.2"),
    Field("pattern",         STRING,     REQUIRED, "6.2.6"),
    Field("target",          STRING,     REQUIRED, "6.2.6"),
    Field("extract_message", BOOLEAN,    True,     "6.2.6"),
    Field("separator",       STRING,     ":",      "6.2.6"),
    Field("set_state",       MAPPING,    None,     "6.2.6.3"),
)


def check_message_router_node(rt, graph_name, node_name, cfg, where, agent_names, known):
    """§6.2.6: each rule's fields, a regex that compiles and lies in the safe subset, set_state
    keys an Actor may write, and a target that is a node of the graph."""
    doc = rt.doc
    for index, rule in enumerate(cfg["rules"]):
        at = where + ("rules", index)
        if not isinstance(rule, dict):
            raise doc.error(ConfigurationError, at, "a rule must be a mapping", "6.2.6")
        check_fields(doc, rule, ROUTER_RULE_FIELDS, at)
        check_unknown(rt, rule, ROUTER_RULE_FIELDS, at, "6.2.6",
                      "unknown router rule key {key!r} ignored")
        if rule["match_type"].lower() == "regex":
            try:
                re.compile(rule["pattern"])
            except re.error as exc:
                raise doc.error(ConfigurationError, at + ("pattern",),
                                f"invalid regular expression: {exc}", "6.2.6.2") from None
            unsafe = regex_may_backtrack(rule["pattern"])
            if unsafe:
                raise doc.error(ConfigurationError, at + ("pattern",),
                                f"regex {rule['pattern']!r} is outside the safe subset "
                                f"({unsafe}): a crafted message could make matching backtrack "
                                f"for hours (README Security, T1)", "6.2.6.2")
        try:     # T2 (README Security): the host-only keys are the host's (§10.3)
            refuse_host_keys(rule.get("set_state"), "set_state")
        except ExecutionError as exc:
            raise doc.error(ConfigurationError, at + ("set_state",), exc.message,
                            exc.section) from None
        for key in rule.get("set_state") or ():
            if isinstance(key, str) and key.startswith("__"):
                raise doc.error(ConfigurationError, at + ("set_state", key),
                                f"'{key}': keys starting with __ are reserved", "10.3, §15.4")
        if normalize_node_name(rule["target"]) not in known:
            raise doc.error(ConfigurationError, at + ("target",), f"target '{rule['target']}' is "
                            f"not a node of graph '{graph_name}'", "6.2.6")

# §6.2.6.3 State updates ------------------------------------------------------------------
# Pointer banner: a matching rule's set_state travels in its NodeResult and is written into
# state.metadata by the §6.3 update (I-100); check_message_router_node (above) refuses keys an
# Actor may not write.

# §6.2.6.4 Routing effect -----------------------------------------------------------------
# Pointer banner: the match puts next_node in the node's metadata (cleared when a run starts,
# I-098 in §6.3), which the edges leaving the router may read through context_value conditions
# (§6.5); node_message_router returns None when no rule matches, so the state stays as it was.

# The §6.2 table: node type (matched case-insensitively) -> (handler, the type's own fields).
# Rows in the spec's order.
NODE_TYPES = {
    "start":          (node_start,          {}),
    "end":            (node_end,            {}),
    "agent":          (node_agent,          AGENT_NODE_FIELDS),
    "function":       (node_function,       FUNCTION_NODE_FIELDS),
    "tool":           (node_tool,           TOOL_NODE_FIELDS),
    "conditional":    (node_conditional,    CONDITIONAL_NODE_FIELDS),
    "subgraph":       (node_subgraph,       SUBGRAPH_NODE_FIELDS),
    "message_router": (node_message_router, ROUTER_NODE_FIELDS),
}
# Checks beyond a node's fields: references to agents, graphs and nodes, condition shapes.
NODE_CHECKS = {
    "agent": check_agent_node,
    "conditional": check_conditional_node,
    "subgraph": check_subgraph_node,
    "message_router": check_message_router_node,
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
# INTERPRETATION I-119 §6.3.3: this host knows only its own default state, as actor.GraphState.
STATE_SCHEMAS = {"actor.GraphState": GRAPH_STATE_FIELDS}


def new_graph_state(fields=GRAPH_STATE_FIELDS):
    return {name: make() for name, make in fields.items()}


def state_schema(cfg):
    """§6.3.3 the fields of a graph's state: its known state_class, else the default."""
    return STATE_SCHEMAS.get(cfg.get("state_class"), GRAPH_STATE_FIELDS)


def warn_state_class(rt, cfg, path):
    """§6.3.3: a state_class this host does not know runs with the default state, warned."""
    name = cfg.get("state_class")
    if name is not None and name not in STATE_SCHEMAS:
        rt.warn(f"state_class '{name}' is not known to this host; using the default graph "
                f"state", section="6.3.3", path=path + ("state_class",))


def begin_run(state, content, ctx):
    """A run starts: the global context joins the state, the input joins the messages."""
    metadata = state["metadata"]
    # INTERPRETATION I-097 §6.3.1 (Q32): state.metadata.context is the invocation context, by
    # reference.
    metadata["context"] = ctx
    # INTERPRETATION I-098 §6.2.6.4 (Q33): next_node is a per-run routing signal, cleared at the
    # start.
    metadata.pop("next_node", None)
    if isinstance(ctx, dict):
        ctx.pop("next_node", None)
    metadata["current_message"] = content
    # INTERPRETATION I-095 §6.2.1 (Q30): the start node's message joins state.messages as a user
    # entry.
    messages = state["messages"]
    messages.append({"role": "user", "content": content})
    if len(messages) > MAX_STATE_MESSAGES:
        del messages[:len(messages) - MAX_STATE_MESSAGES]


# The §6.3.2 merge (mappings merged recursively, lists extended, scalars replaced) is the rule
# of the §3.1 merge of files: the same walk.
merge_values = deep_merge


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


def _is_message_list(value):
    return type(value) is list and all(isinstance(entry, dict) for entry in value)


# The §6.3.1 table's Type column: field -> (test, what it must be). An update (or a restored
# checkpoint) that gives a field another type would break every later run, so it is refused whole.
STATE_FIELD_TYPES = {
    "messages": (_is_message_list, "a list of mappings"),
    "metadata": (lambda value: isinstance(value, dict), "a mapping"),
    "current_node": (lambda value: value is None or isinstance(value, str), "a string or null"),
    "execution_count": (lambda value: type(value) is int and value >= 0,
                        "a non-negative integer"),
    "error": (lambda value: value is None or isinstance(value, str), "a string or null"),
}


def state_field_refusal(field, value, mode="replace"):
    """§6.3.1: why `value` cannot be the state's `field` (None when it can); in append mode a
    single message mapping is one entry of the list."""
    test, what = STATE_FIELD_TYPES.get(field, (None, None))
    if test is None or test(value) or mode == "append" and field == "messages" \
            and isinstance(value, dict):
        return None
    return f"state field '{field}' must be {what}, not {type(value).__name__}"


def apply_state_update(state, update, mode="merge"):
    """Apply a mapping to the state in one of the §6.3.2 modes; cap messages at 50 (§6.3.1)."""
    # INTERPRETATION I-108 §6.3.2 (Q43): keys that are not §6.3.1 fields update state.metadata, and
    # the 50-message cap holds after every mode, replace included.
    if mode not in UPDATE_MODES:
        raise error(ExecutionError, f"unknown state update mode '{mode}'", "6.3.2")
    for key, value in update.items():
        reason = key in state and state_field_refusal(key, value, mode)
        if reason:
            raise error(ExecutionError, f"{reason}; the state is unchanged", "6.3.1")
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
    # INTERPRETATION I-099 §6.3 (Q34): one state per graph route lives as long as the Actor, so an
    # update changes the state the next run starts from.
    if isinstance(content, str):
        try:
            parsed = json.loads(content)
        except (ValueError, RecursionError):    # not JSON, or nested past the parser's depth
            parsed = None
        if isinstance(parsed, dict):
            content = parsed
    if isinstance(content, dict):
        return content
    return {"messages": [{"role": "user", "content": content}]}


def copy_state(state, metadata):
    """A new state dict: `state`'s fields with its own messages list and the given metadata."""
    return {"messages": list(state["messages"]), "metadata": metadata,
            "current_node": state["current_node"], "execution_count": state["execution_count"],
            "error": state["error"]}


def snapshot_state(state):
    """The state at the end of a run, copied one level deep (messages are never edited in place)."""
    return copy_state(state, dict(state["metadata"]))

# §6.4 Edges -------------------------------------------------------------------------------
EDGE_FIELDS = fields_by_name(
    Field("source",      STRING,  REQUIRED, "6.4"),
    Field("target",      STRING,  REQUIRED, "6.4"),
    Field("condition",   MAPPING, None,     "6.5"),
    Field("metadata",    MAPPING, None,     "6.4"),
    Field("description", ANY,     None,     "6.4"),
)


def check_edges(rt, graph_name, edges, known, path):
    """§6.4, §6.5, §11.3: each edge's fields; source and target name nodes of the graph (START
    and END included); a condition has the §5.4 shape. Unknown edge keys draw a warning."""
    doc = rt.doc
    for index, edge in enumerate(edges):
        where = path + ("edges", index)
        if not isinstance(edge, dict):
            raise doc.error(ConfigurationError, where,
                            "an edge must be a mapping with source and target", "6.4")
        check_fields(doc, edge, EDGE_FIELDS, where)
        for end in ("source", "target"):
            if normalize_node_name(edge[end]) not in known:
                raise doc.error(ConfigurationError, where + (end,), f"{end} '{edge[end]}' is not "
                                f"a node of graph '{graph_name}'", "6.4, 11.3")
        wrong = condition_shape_error(edge["condition"]) if edge.get("condition") is not None \
            else None
        if wrong is not None:
            raise doc.error(ConfigurationError, where + ("condition", wrong[0]), wrong[1],
                            "6.5, §5.4")
        check_unknown(rt, edge, EDGE_FIELDS, where, "6.4", "unknown edge key '{key}' ignored")


class GraphEdge:
    """One edge: source and target names (START/END normalised), the target GraphNode itself."""

    __slots__ = ("source", "target", "node", "condition", "path", "cfg")

    def __init__(self, source, target, node, condition, path, cfg):
        self.source, self.target, self.node, self.condition, self.path, self.cfg = \
            source, target, node, condition, path, cfg


def build_edges(graph):
    edges = []
    for index, cfg in enumerate(graph.cfg.get("edges") or []):
        target = normalize_node_name(cfg["target"])
        edges.append(GraphEdge(normalize_node_name(cfg["source"]), target, graph.nodes[target],
                               cfg.get("condition"), graph.path + ("edges", index, "condition"),
                               cfg))
    return edges

# §6.5 Edge conditions -------------------------------------------------------------------
# Edge conditions go through the one §5.4 evaluator with the "edge" subsystem; the state view
# it sees is {messages, metadata, _condition_content: the source node's output} (GraphRoute.
# _next_nodes), so content_* conditions read the latest output and context_value reads
# state.metadata, then state.metadata.context (§6.5.1, cond_context_value).
# INTERPRETATION I-096 §6.5 (Q31): every node receives its predecessor's output.


def graph_walker(graph):
    """§6.5 how one graph steps from node to node, chosen at load: GraphRoute._walk, the general
    step, on the reference path (Runtime.reference), else appendix A.2's fast_walk."""
    return GraphRoute._walk if graph.rt.reference else fast_walk


def condition_view(state, content):
    """What a §5.4 condition sees of a graph state: messages, metadata, and `content` (the
    output of the node the edge leaves, or the message a conditional node received)."""
    return {"messages": state["messages"], "metadata": state["metadata"],
            "_condition_content": content}


# §6.6 Checkpointing and time travel -----------------------------------------------------
CHECKPOINT_EVERY = 10
# INTERPRETATION I-174 §6.6: the 100 historical snapshots are states before the current one, so
# a rewind reaches 100 updates back; the current state's snapshot is kept beside them.
MAX_SNAPSHOTS = 100
CHECKPOINT_GLOB = "checkpoint_*.json"


def count_update(graph, node=None, result=None):
    """§6.6 one state update counted (§6.3.1 execution_count): a snapshot kept (time travel), and
    the full state persisted at every tenth (checkpointing)."""
    # `result`: the NodeResult of `node` that made the update (None: any key may have changed).
    state = graph.state
    state["execution_count"] += 1
    if graph.time_travel:
        graph.snapshots.keep(state, node, result)
    if graph.store is not None and state["execution_count"] % CHECKPOINT_EVERY == 0:
        write_checkpoint(graph, state, wait=False)


class History(list):
    """§6.6 time travel: the current state and up to MAX_SNAPSHOTS before it, oldest first, each
    a copy (the live context left out), so that no later change reaches it."""

    def keep(self, state, node=None, result=None):
        """Snapshot `state` after one update (of `node`, giving `result`)."""
        self.append(copy_state(state, {key: copy.deepcopy(value) for key, value
                                       in state["metadata"].items() if key != "context"}))
        if len(self) > MAX_SNAPSHOTS + 1:       # the current state and 100 before it
            del self[0]                         # §6.6: first in, first out

    def rewind(self, steps):
        """Drop the newest `steps` snapshots; return a copy of the state the newest left holds."""
        del self[len(self) - steps:]
        return copy_state(self[-1], copy.deepcopy(self[-1]["metadata"]))

    def changed_whole(self):
        """The state was replaced whole (a restore): nothing to note, every snapshot is whole."""


def snapshot_history(graph):
    """§6.6 where one graph keeps its time-travel snapshots, chosen at load: History on the
    reference path (Runtime.reference), else appendix A.2's Snapshots (each costs what changed)."""
    return History() if graph.rt.reference else Snapshots()


# INTERPRETATION I-166 §6.6: "every ten state updates ... MUST be persisted" -- on the reference
# path the tenth update writes the file itself (CheckpointFiles) and a write that fails fails that
# update's run at once; on the default path it hands the state to a writer process (appendix A.1),
# which reports a failure with a later checkpoint, a wait, or close.
def write_checkpoint(graph, state, wait=True):
    """Persist the full state as checkpoint_<timestamp>.json through the graph's store (B.3 names
    it); wait=False lets a store write it later. Returns the path (a Path when waited for)."""
    try:
        final = os.path.join(graph.checkpoint_dir, checkpoint_name(graph))
        graph.store.put(final, state)
        if not wait:
            return final
        graph.store.flush()
        return Path(final)
    except (OSError, ValueError, ExecutionError) as exc:    # gone, unwritable, not JSON
        raise error(ExecutionError, f"graph '{graph.name}' cannot write a checkpoint: "
                    f"{getattr(exc, 'message', exc)}", "6.6", path=graph.path) from None


# INTERPRETATION I-227 §6.6: a value JSON has no form for is written as its text; a set's items
# in sorted order, so that its file reads the same from run to run (a set's own order follows
# the process's string hashes). The writer process (A.1) runs the same source.
CHECKPOINT_TEXT_SOURCE = """
def checkpoint_text(value):
    if isinstance(value, (set, frozenset)):
        items = ", ".join(sorted(map(repr, value)))
        return "{" + items + "}" if items else type(value).__name__ + "()"
    return str(value)
"""
exec(CHECKPOINT_TEXT_SOURCE)


class CheckpointFiles:
    """§6.6 the checkpoint files, written on the calling thread: the state's JSON goes to a
    temporary file beside its name, is fsynced, and is renamed into place, so that a file is
    whole or absent. The checkpoint directory is made again if it went away (§6.6 item 1)."""

    failure = None                      # a write that fails raises at once: none is kept

    def put(self, path, state):
        try:
            data = json.dumps(state, default=checkpoint_text, ensure_ascii=False).encode(
                "utf-8", "surrogatepass")
        except (TypeError, ValueError, RecursionError) as exc:   # a cycle, a key JSON refuses
            raise error(ExecutionError, f"the state cannot be written as JSON: {exc}") from None
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        temp = os.path.join(folder, "." + os.path.basename(path) + ".tmp")
        with open(temp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        prune_checkpoints(folder, CHECKPOINT_KEEP)      # B.3 (I-181)

    def wait(self):
        """Every checkpoint is on disk once put returns."""

    flush = wait

    def close(self):
        return None                     # the failure nothing has reported yet: never one here


def checkpoint_store(graph):
    """§6.6 where one graph's checkpoints are written, chosen at load: CheckpointFiles on the
    reference path (Runtime.reference), else the writer process of appendix A.1."""
    return CheckpointFiles() if graph.rt.reference else CheckpointWriter()


def restore_checkpoint(graph, path=None):
    """§6.6 item 4: load a checkpoint file (default: the latest, item 3) into the graph's state,
    or refuse it whole (ApplicationError, the state unchanged) when it holds no graph state. B.3
    reads it without trusting the disk and refuses the keys only the host may set (I-180)."""
    where = path_str(graph.path)
    if path is None:
        found = graph.checkpoints()
        if not found:
            raise error(ApplicationError, f"graph '{graph.name}' has no checkpoint to restore",
                        "6.6", path=where)
        path = found[-1]
    path, data = read_checkpoint(graph, path)
    if not isinstance(data, dict):
        raise error(ApplicationError, f"{path} does not hold a graph state", "6.6", path=where)
    state = new_graph_state()
    for key in state:
        if key in data:
            reason = state_field_refusal(key, data[key])
            if reason:
                raise error(ApplicationError, f"{path} does not hold a graph state: {reason}",
                            "6.6", path=where)
            state[key] = data[key]
    refuse_checkpoint_keys(graph, path, state["metadata"])
    context = graph.state["metadata"].get("context")
    if context is not None:                         # the live context stays attached (Q32)
        state["metadata"]["context"] = context
    graph.state = state
    graph.snapshots.changed_whole()
    return path


def rewind_state(graph, steps):
    """§6.6 time travel: restore the state as it was `steps` updates ago."""
    if not graph.time_travel:
        raise error(ApplicationError, f"graph '{graph.name}' has enable_time_travel off", "6.6",
                    path=graph.path)
    if type(steps) is not int:
        raise error(ApplicationError, f"graph '{graph.name}': the number of steps to rewind must "
                    f"be an integer, not {steps!r}", "6.6", path=graph.path)
    if steps < 1 or steps >= len(graph.snapshots):
        held = len(graph.snapshots) - 1
        reach = f"1..{held} steps" if held > 1 else "1 step" if held == 1 else \
            "no step yet (no update is older than the current state)"
        raise error(ApplicationError, f"graph '{graph.name}' can rewind {reach}, not {steps}",
                    "6.6", path=graph.path)
    context = graph.state["metadata"].get("context")
    state = graph.snapshots.rewind(steps)
    if context is not None:
        state["metadata"]["context"] = context
    graph.state = state

# §6.7 Parallel execution ----------------------------------------------------------------
def run_next_node_set(graph, admitted, state, settle):
    """§6.7: the parallel:true nodes of the set run together on threads, reading the state as it
    was before the set, and are joined; their outcomes are settled in the set's order. The others
    then run one after another, each settled before the next starts, so a sequential node sees
    every write made before it (§12.3 item 4). settle(i, NodeResult|None, error|None) applies
    outcome i and returns True when a guard stopped the run; nothing more runs after that."""
    # INTERPRETATION I-106 §6.7, §12.3 (Q41): a next-node set is one step. Items 3-4 in their order:
    # the parallel subset first, joined, so that no node without parallel: true ever overlaps
    # another; only the truly concurrent nodes share the state from before the set. A node
    # reached by several edges of the same step runs once (GraphRoute._next_nodes).
    parallel = []
    if graph.parallel_execution and len(admitted) > 1:
        parallel = [i for i, (node, _) in enumerate(admitted) if node.parallel]
    if len(parallel) < 2:
        parallel = []
    outcomes = {}
    if parallel:
        pool = graph._pool
        if pool is None:
            # INTERPRETATION I-120 §6.7: one worker per parallel:true node, so that a whole subset
            # really runs at once (item 3), however few processors the host has.
            size = sum(1 for node in graph.nodes.values() if node.parallel)
            # imported on first use, so that loading pays nothing for graphs that never fan out
            from concurrent.futures import ThreadPoolExecutor
            pool = graph._pool = ThreadPoolExecutor(max_workers=max(2, size),
                                                    thread_name_prefix=f"graph-{graph.name}")
        futures = []
        try:
            for i in parallel:
                # Each worker runs in a copy of this thread's context, so a timed-out caller's
                # abandonment and the composites busy up the call chain follow the branch.
                futures.append((i, pool.submit(in_copied_context(call_node), graph,
                                               *admitted[i], state)))
        except RuntimeError:
            # No thread to be had (the pool was closed, or the sandbox's address-space cap,
            # §13.2, left no room for a stack): the rest of the subset runs here, one after
            # another, still reading the state from before the set, so the outcome is the
            # one threads give. Every branch already submitted is still joined.
            pass
        submitted = {i for i, _ in futures}
        for i in parallel:
            if i not in submitted:
                outcomes[i] = call_node(graph, *admitted[i], state)
        for i, future in futures:
            outcomes[i] = future.result()
        for i in parallel:
            if settle(i, *outcomes[i]):
                return
    for i, (node, message) in enumerate(admitted):
        if i not in outcomes and settle(i, *call_node(graph, node, message, state)):
            return


def call_node(graph, node, message, state):
    """Run one node's handler: (NodeResult|None, None), or (None, the §20 error it raised)."""
    try:
        return node.handler(graph, node, message, state), None
    except Exception as exc:
        return None, node_failure(graph, node, exc)


def node_failure(graph, node, exc):
    """The §20 error for an exception out of a node: an ActorError as it is, anything else (the
    agent/node boundary, §12.2.3) as an ExecutionError naming the graph and node."""
    if isinstance(exc, ActorError):
        return exc
    return error(ExecutionError, f"graph '{graph.name}' node '{node.name}': {exc}", "6.2")


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
    # INTERPRETATION I-104 §6.8 (Q39): the guards count per run; depth is the number of node
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
    # INTERPRETATION I-098 §6.9 (Q33): top-level metadata keys win over nested context keys; graph
    # keys (last_output, last_agent_node, ...) are kept for inspection; this happens after
    # every run, pure or mixed, so both modes look the same.
    if not isinstance(ctx, dict):
        return
    metadata = state["metadata"]
    nested = metadata.get("context")
    nested = nested if isinstance(nested, dict) else {}
    kept = nested.get("context", _NO_VALUE)     # a "context" key of the context itself
    # T2 (README Security): whatever the run left in metadata, the host-only keys (§10.3) keep
    # the values the host gave the context.
    host = {key: ctx[key] for key in HOST_ONLY_CONTEXT_KEYS if key in ctx}
    if nested is not ctx:               # usually it is: the run's context, by reference (Q32)
        ctx.clear()
        ctx.update(nested)
    ctx.update(metadata)                # every metadata key, in place: "context" put right below
    if kept is _NO_VALUE:
        ctx.pop("context", None)
    else:
        ctx["context"] = kept
    for key in HOST_ONLY_CONTEXT_KEYS:
        ctx.pop(key, None)
        if key in host:
            ctx[key] = host[key]
    metadata["context"] = ctx


def run_ending(graph):
    """§6.9 item 3's write-back and §6.1's GraphRun for `graph`, chosen at load: the body's on the
    reference path (Runtime.reference), else appendix A.2's WriteBack and DeferredRuns."""
    if not graph.rt.reference:
        write_back = WriteBack(graph)
        return write_back, DeferredRuns(graph, write_back)
    return replace_active_context, lambda graph, trace: GraphRun(
        trace.output, snapshot_state(graph.state), trace.history, trace.stopped, trace.held)

# §6.10 Graph-internal streams ---------------------------------------------------------
def internal_stream_names(graph_name, node_names):
    """The reserved per-node, control and state stream names of one graph (§6.10, §15.6)."""
    names = [f"__{graph_name}_node_{node}__" for node in node_names]
    return names + [f"__{graph_name}_control__", f"__{graph_name}_state__"]


def notify_node_event(graph, node, output):
    """Hand a node's output to the listeners of __<graph>_node_<node>__ (mixed mode).

    The event carries the §12.2.1 keys of a node-level message: graph, node, execution_count
    (this node's executions so far, counting this one) and context (the run's invocation
    context, by reference)."""
    # INTERPRETATION I-115 §6.10/§12.2.1: a node event is emitted for every execution (a router that
    # matched nothing included); execution_count is the per-node counter of §12.2.1, kept for
    # the Actor's lifetime, not the state's update count.
    stream = f"__{graph.name}_node_{node.name}__"
    msg = Message(output, {"graph": graph.name, "node": node.name,
                           "execution_count": node.executions,
                           "context": graph.state["metadata"].get("context")},
                  source_stream=stream, timestamp=graph.rt.clock.now())
    for listener in list(graph.observers):
        listener(stream, msg)

def notify_control(graph, event):
    """Hand a run event to the listeners of __<graph>_control__ (mixed mode).

    `event` is a mapping whose "event" is started or resumed (before the first step), then one of
    finished, stopped (a §6.8 guard ended the run: "guard" names it) or failed ("error",
    "error_type"); the last three carry the executed node names as "history"."""
    # INTERPRETATION I-118 §6.10: the control stream carries the run's lifecycle, the one kind of
    # event a graph has besides its node events and its state; the metadata is that of a node
    # event without the node (graph, context).
    stream = f"__{graph.name}_control__"
    msg = Message(event, {"graph": graph.name, "context": graph.state["metadata"].get("context")},
                  source_stream=stream, timestamp=graph.rt.clock.now())
    for listener in list(graph.observers):
        listener(stream, msg)

# §6.11 Graph analysis -------------------------------------------------------------------
class GraphAnalysis:
    """§6.11 results: adjacency both ways, cycles, topological levels, unreachable nodes."""

    __slots__ = ("forward", "reverse", "has_cycles", "back_edges", "levels", "unreachable")


def analyse_graph(entry, nodes, edges, implicit=()):
    """§6.11 items 1-4 over `nodes` (name -> node) and `edges` (objects with source and target
    names); `implicit` names (start/end the document did not declare) are never unreachable."""
    result = GraphAnalysis()
    result.forward = {name: [] for name in nodes}                     # item 1
    result.reverse = {name: [] for name in nodes}
    for edge in edges:
        result.forward[edge.source].append(edge)
        result.reverse[edge.target].append(edge)
    result.back_edges = find_back_edges(entry, nodes, result.forward)         # item 2
    result.has_cycles = bool(result.back_edges)
    result.levels = topological_levels(nodes, edges, result.back_edges)       # item 3
    reached = reachable_from(entry, result.forward)                           # item 4
    result.unreachable = [name for name in nodes if name not in reached and name not in implicit]
    return result


def implicit_names(cfg):
    declared = {normalize_node_name(name) for name in cfg["nodes"]}
    return {START_NODE, END_NODE} - declared


def reachable_from(entry, forward):
    seen, todo = {entry}, [entry]
    while todo:
        for edge in forward.get(todo.pop(), ()):
            if edge.target not in seen:
                seen.add(edge.target)
                todo.append(edge.target)
    return seen


def check_entry_point(doc, name, cfg, known, path):
    """§6.11, §11.3: the entry point is a node of the graph."""
    entry = normalize_node_name(cfg.get("entry_point", GRAPH_FIELDS["entry_point"].default))
    if not is_known(entry, known):
        raise doc.error(ConfigurationError, path + ("entry_point",), f"entry_point "
                        f"'{cfg.get('entry_point')}' is not a node of graph '{name}'", "6.11, 11.3")


def warn_unreachable(rt, name, cfg, path):
    """§6.11 item 4 at load: nodes the entry point never reaches are warned about."""
    entry = normalize_node_name(cfg.get("entry_point", GRAPH_FIELDS["entry_point"].default))
    nodes = dict.fromkeys([START_NODE, *map(normalize_node_name, cfg["nodes"]), END_NODE])
    edges = [GraphEdge(normalize_node_name(e["source"]), normalize_node_name(e["target"]),
                       None, None, None, e) for e in cfg.get("edges") or []]
    unreachable = analyse_graph(entry, nodes, edges, implicit_names(cfg)).unreachable
    if unreachable:
        rt.warn(f"graph '{name}': nodes unreachable from '{entry}': " + ", ".join(unreachable),
                section="6.11", path=path)


def wire_nodes(nodes, analysis):
    """Hand each GraphNode its outgoing edges and the facts stepping reads (§6.8 items 3-4)."""
    for name, node in nodes.items():
        node.out = out = analysis.forward[name]
        node.plain_next = out[0].node if len(out) == 1 and out[0].condition is None else None
        node.routes_only_to_router = len(out) == 1 and out[0].node.is_router  # for §6.8 item 4
    # §6.8 items 3-4 watch agent nodes only: ping-pong needs router nodes in the graph, and
    # return-without-routing a node whose one edge leads to a router.
    has_routers = any(node.is_router for node in nodes.values())
    for node in nodes.values():
        node.guarded_after = node.type == "agent" and (has_routers or node.routes_only_to_router)


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


# =====================================================================================
# §7 INTER-ROUTE COMPOSITION
# =====================================================================================

# §7.1 The merges section ---------------------------------------------------------------
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
        net.nodes[name] = _Node(net, name, net.flow.stream(name, "cold"))

# §7.2 The splits section ---------------------------------------------------------------
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
# INTERPRETATION I-065 §7.3 vs §16.2 (Q1): pipelines are accepted and wired stage to stage: a
# message sent to the pipeline's name (send(target=...), a merge or split target, the default
# router) enters stage 1, and the output of stage N feeds stage N+1. Stage-local link names
# (publications naming non-routes, input_from, output_to, subscriptions) are advisory;
# publications naming a route or built-in stream are honoured.
def check_pipeline_stages(doc, pipelines, routes, checker):
    """§7.3: a pipeline's name must not hide a route; stream stages' operators as in §5.3.2.

    The rest of §7.3/§11.5 (stage shapes, the §11.5 warnings) is the validator's check_pipelines.
    """
    for name, cfg in pipelines.items():
        path = ("pipelines", name)
        if name in routes or name in BUILTIN_STREAMS:
            raise doc.error(ConfigurationError, path, f"pipeline name {name!r} is already a route "
                            "or built-in stream", "7.3")
        stages = cfg.get("stages") if isinstance(cfg, dict) else None
        for i, stage in enumerate(stages if isinstance(stages, list) else []):
            here = path + ("stages", i)
            if isinstance(stage, dict) and _stage_type(stage) == "stream":
                checker.operators(stage.get("operators"), here + ("operators",))
            elif isinstance(stage, dict) and isinstance(stage.get("config"), dict):
                check_graph(checker.rt, f"{name}.{i}", _stage_graph(stage), here + ("config",),
                            checker.agents)


def _stage_type(stage):
    return str(stage.get("type", "")).lower()


def _stage_graph(stage):
    """An inline graph stage's config as a graph route (its `name` key is only a label)."""
    cfg = {"type": "graph", **stage["config"]}
    cfg.pop("name", None)
    return cfg


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
            publications = stage.get("publications") if _stage_type(stage) == "stream" else None
            for j, target in enumerate(as_list(publications)):
                if is_known(target, net.nodes) and target not in stages:
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
    if _stage_type(stage) == "stream":
        return StreamRoute(net, node_name, stage, path)
    if isinstance(stage.get("config"), dict):
        cfg = _stage_graph(stage)
        return GraphParticipant(net, node_name, GraphRoute(node_name, cfg, rt, path + ("config",)))
    graph = rt.graphs.get(stage.get("graph", stage.get("name")))
    if graph is None:
        return _Node(net, node_name, net.flow.stream(node_name))   # §11.5: warned, passes on
    return GraphParticipant(net, node_name, graph)


class _PipelineEntry(_Node):
    """A pipeline's name as a stream: pushing enters stage 1; `out` is the last stage's stream."""

    def __init__(self, net, name, first):
        super().__init__(net, name, net.flow.stream(name))
        self.first = first
        self.feeds = [first.name] if first is not None else []

    def push(self, msg):
        if self.first is not None:
            self.first.push(msg)

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
# INTERPRETATION I-137 §9.2 vs §8.1 (Q61, decided): template_engine governs Phase A too
# ("all three template phases"): under MUSTACHE the document renders as Mustache (sections,
# inverted sections, comments, substitution), under SIMPLE only the {{ }} expression pass runs (a
# format pass over YAML would break on every brace); runtime fields are protected as always.
# The engine is the host's, else the one the document itself declares (phase_a_engine).

TEMPLATE_MARKERS = ("{{", "{%", "{#")


def phase_a_engine(raw, host_engine):
    """Q61: the engine of a document's Phase A: the host's, else the one the document declares
    at its top level (`template_engine: X`, or inside a `cleveragents:` block), read from the
    raw lines since the text is not YAML yet, else JINJA2."""
    if host_engine is not None or not has_template_syntax(raw):
        return engine_key(host_engine or "JINJA2")     # the host's was checked on entry
    block = re.search(r"^cleveragents:[ \t]*(\{[^}\n]*\}|(?:\n[ \t]+.*)*)", raw, re.M)
    found = re.search(r"^template_engine:[ \t]*[\"']?(\w+)", raw, re.M) or (block and re.search(
        r"template_engine:[ \t]*[\"']?(\w+)", block.group(1)))
    return (found and engine_key(found.group(1))) or "JINJA2"


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


# The §8.1 statement forms as §8.4's protection reads them: which take an {% end... %} partner,
# which names a tag reads and which it binds for what follows.
BLOCK_PAIRS = ("for", "if", "with", "macro", "block", "filter", "call", "autoescape", "set")


@functools.lru_cache(maxsize=4096)
def tag_free_names(kind, inner, word):
    """Names a tag reads that it does not bind itself (None when it does not parse)."""
    if kind == "{{":
        source = "{{ " + inner + " }}"
    elif is_block_opener(word, inner):
        source = "{% " + inner + " %}{% end" + word + " %}"
    else:
        source = "{% " + inner + " %}"
    try:
        return frozenset(jinja2_module().meta.find_undeclared_variables(
            jinja_environment().parse(source)))
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


def is_block_opener(word, inner):
    """Does this statement take an {% end... %} partner? (`set x = ...` does not)."""
    return word in BLOCK_PAIRS and not (word == "set" and "=" in inner)


def block_body_end(text, pos):
    """Offset of the {% end... %} tag closing the block whose body starts at `pos`."""
    depth = 0
    for start, _, kind in scan_tags(text, pos):
        if kind != "{%":
            continue
        inner = text[start + 2:text.find("%}", start)].strip("-+ \t\r\n")
        word = inner.split(None, 1)[0] if inner else ""
        if word.startswith("end") and word != "endraw":
            if depth == 0:
                return start
            depth -= 1
        elif is_block_opener(word, inner):
            depth += 1
    return len(text)

# §8.2 Document-level rendering lifecycle -----------------------------------------------
def render_document(text, render_context=None, engine="JINJA2", *, file=None, sandbox=None):
    """§8.2 steps 1-2: the raw text of one document -> the text to parse as YAML (Phase A).

    The caller first rejects §15.5 sentinels in the raw text (check_sentinels, §15.5). This
    returns text without template syntax unchanged (step 1), protects runtime fields and
    template bodies (§8.4; text already protected is first restored, so the render context
    is taken into account whoever protected it), then renders
    the rest in `engine`'s dialect (Q61) against the §8.3 built-ins plus `render_context`
    (Q50 (d)/(e)). Comments are dropped by the dialect itself. A render failure is a
    ConfigurationError located at the template line (§8.12). After parsing, call
    restore_sentinels() on the data (§8.2 step 4).
    """
    text = restore_markers(text)     # text protected by an earlier call: start from the raw form
    if not has_template_syntax(text):
        return text
    text = protect_runtime_fields(text, render_context, file=file, engine=engine)
    if not has_template_syntax(text):
        return text
    try:
        return (sandbox or InProcessSandbox()).render(text, dict(render_context or {}), engine,
                                                      phase="A")
    except TemplateError as exc:
        raise error(ConfigurationError, f"Phase A rendering failed: {exc.message}", "8.12",
                    file=file, line=exc.line) from exc

# INTERPRETATION I-021 §3.2, §8.1, §8.12: errors after Phase A name the raw line (a heuristic).
class RenderedLines:
    """Where the lines of a Phase A output came from in the raw document, so that errors found
    after rendering name the line the author wrote (§8.2, §8.12).

    A raw line is turned into a pattern: its text, with every {{ }}, {% %} and {# #} span
    standing for any text; a line of tags alone produces no line of its own and gets none. Each
    rendered line takes the matching raw line with the most literal text, then the nearest one
    at or after the previous match, else the nearest before it (a loop body starting again).
    The column is kept only when rendering left the line as it was. Worked out on first use.
    """

    _TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}")
    _LINE_BREAK = re.compile(r"\r\n|\r|\n")
    HEAD = 16           # literal characters a pattern is filed under

    def __init__(self, raw, rendered):
        self.raw, self.rendered, self._origins = raw, rendered, None

    def origin(self, line, col):
        """(raw line, raw column or None) for a 1-based rendered line; (None, None) if unknown."""
        if self._origins is None:
            self._origins = self._align()
        if not 1 <= line <= len(self._origins) or self._origins[line - 1] is None:
            return None, None
        raw_line, same = self._origins[line - 1]
        return raw_line, col if same else None

    @staticmethod
    def _fits(parts, text):
        """Whether `text` is parts[0] + any + parts[1] + ... + any + parts[-1]: each literal part
        found leftmost in turn, which decides a pattern of literals and wildcards in linear time
        (a regular expression with many .*? could backtrack for minutes)."""
        first, last = parts[0], parts[-1]
        if len(first) + len(last) > len(text) or not text.startswith(first) \
                or not text.endswith(last):
            return False
        at, end = len(first), len(text) - len(last)
        for part in parts[1:-1]:
            found = text.find(part, at, end)
            if found < 0:
                return False
            at = found + len(part)
        return True

    def _align(self):
        # Raw lines without tags are looked up by their text; the others become patterns (their
        # literal parts), one per distinct pattern, filed under the first HEAD characters.
        exact, patterns = {}, {}
        for index, text in enumerate(self._LINE_BREAK.split(self.raw)):     # as Jinja2 splits lines
            spans = list(self._TAG.finditer(text))
            rest = self._TAG.sub("", text)
            if not spans:
                if "{{" in text or "{%" in text or "{#" in text:
                    continue                        # a tag spread over several lines
                exact.setdefault(text, []).append(index)
            elif rest.strip() and not any(mark in rest for mark in ("{{", "{%", "{#")):
                parts, last = [], 0
                for span in spans:
                    parts.append(text[last:span.start()])
                    last = span.end()
                parts.append(text[last:])
                patterns.setdefault(tuple(parts), []).append(index)
        buckets = {}
        for parts, indices in patterns.items():
            buckets.setdefault(parts[0][:self.HEAD], []).append(
                (parts, sum(map(len, parts)), indices))
        origins, previous = [], 0
        for text in self.rendered.split("\n"):
            groups = [(len(text) + 1, exact[text], True)] if text in exact else []
            for size in range(min(len(text), self.HEAD) + 1):
                for parts, weight, indices in buckets.get(text[:size], ()):
                    if self._fits(parts, text):
                        groups.append((weight, indices, False))
            if not groups:
                origins.append(None)
                continue
            best = max(weight for weight, _, _ in groups)
            after, before = [], []            # each group's indices are in ascending order
            for weight, indices, same in groups:
                if weight == best:
                    at = bisect.bisect_left(indices, previous)
                    if at < len(indices):
                        after.append((indices[at], same))
                    if at:
                        before.append((indices[at - 1], same))
            index, same = min(after) if after else max(before)
            origins.append((index + 1, same))
            previous = index + 1
        return origins

# §8.3 Template variables, filters and built-ins ------------------------------------------
MAX_RANGE = 100_000   # a template may not build a longer sequence (memory; jinja2's own cap)


def template_range(*args):
    """§8.3 range(stop) / range(start, stop[, step]), refused beyond MAX_RANGE items."""
    seq = range(*args)
    if len(seq) > MAX_RANGE:
        raise error(TemplateError, f"range of {len(seq)} items exceeds {MAX_RANGE}", "8.3")
    return seq


# Table of §8.3 (1): built-in callables in every rendering namespace (Phases A, B and C).
BUILTINS = {
    "range": template_range, "len": len, "enumerate": enumerate, "zip": zip, "min": min,
    "max": max, "sum": sum, "abs": abs, "round": round,
    "int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict,
}


def _undefined(value):
    jinja2 = sys.modules.get("jinja2")       # not imported: no value can be one of its Undefined
    return jinja2 is not None and isinstance(value, jinja2.Undefined)


# INTERPRETATION I-133 §8.3 (Q58 (a), (c)): split and yaml exist; tojson is plain one-line JSON.
def filter_tojson(value, indent=None):
    """§8.3 tojson: one line of plain JSON (Q58 (c): no HTML escaping), a valid YAML flow scalar."""
    if _undefined(value):
        str(value)  # raises the undefined-name error
    try:
        return json.dumps(value, ensure_ascii=False, indent=indent, default=_json_mapping)
    except (TypeError, ValueError) as exc:
        raise error(TemplateError, f"tojson: {exc}", "8.3") from exc


def _json_mapping(value):
    """A read-through context view (ChainMap, §8.11) encodes as the mapping it stands for."""
    if isinstance(value, ChainMap):
        return dict(value)
    raise error(TemplateError, f"tojson: Object of type {type(value).__name__} is not JSON "
                "serializable", "8.3")


# INTERPRETATION I-132 §8.3 (Q57, decided): indent(n) indents every line of the value, the first and
# blank ones included, as §8.3 says; Jinja2's own arguments (first=false, blank=false) still opt
# out. The empty tail after a final newline is no line and stays empty.
def filter_indent(value, width=4, first=True, blank=True):
    """§8.3 indent(n): every line of the value gets n spaces (a string width is used as the pad).
    `{{ x | indent(2) }}` with x = "a\nb" gives "  a\n  b"."""
    pad = " " * width if isinstance(width, int) else str(width)
    lines = str(value).split("\n")
    out = []
    for i, line in enumerate(lines):
        tail = i == len(lines) - 1 and not line       # after the final newline, or empty value
        if not tail and (i > 0 or first) and (line or blank):
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
        raise error(TemplateError, f"selectattr: unknown operator {op!r}", "8.3")
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


# INTERPRETATION I-131 §8.3 (Q56 (a)): default(d) replaces None as well as undefined.
def filter_default(value, default_value="", boolean=False):
    """§8.3 default(d): d when the value is undefined or None (Q56 (a)); boolean=True: also
    falsy."""
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


# Table of §8.3 (2): the filters that MUST exist (the rest of Jinja2's standard filters come with
# it).
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
# INTERPRETATION I-123 §8.4 (Q48): system_prompt, prompts.<name>.content and the chain agent's
# `prompt` (§4.7 renders it with the per-message `message`, which cannot exist at load).
RUNTIME_FIELDS = {   # (where, field) -> §: the fields that render at Phase C (§8.4)
    ("agents", "system_prompt"): "4.4.6",     # agents.<name>.config.system_prompt
    ("agents", "prompt"): "4.7",              # a chain agent's config.prompt
    ("prompts", "content"): "10.4",           # prompts.<name>.content
}
# INTERPRETATION I-124 §8.4 vs §8.9 (Q49): Phase A leaves whole template bodies untouched; they are
# rendered at instantiation (Phase B) with their parameters.
DEFERRED_SECTIONS = ("templates", "template_strings")
# Names that only exist at Phase C: never treated as bound at Phase A or B (Q46, Q47).
RUNTIME_NAMES = frozenset({"context", "message"})

KEY_LINE = re.compile(r"( *)(?:- +)*"                          # indent, sequence dashes
                      r"(\"[^\"]*\"|'[^']*'|[^\s#'\"\-][^:#]*?|-[^\s:#][^:#]*?)"   # the key
                      r" *:(?= |\n|$)")


def is_runtime_field(keys):
    """keys: the mapping keys from the document root down to a scalar. True only for the §8.4
    fields: an agent's config.system_prompt / config.prompt (agents.<name>.config.<field>, also
    a composite's components.agents.<name>.config.<field>) and prompts.<name>.content."""
    # INTERPRETATION I-123 §8.4 (defect 11): a key named prompt or system_prompt elsewhere (a
    # context value, a template instance's params) is ordinary data and renders at Phase A.
    if len(keys) == 3 and keys[0] == "prompts":
        return ("prompts", keys[2]) in RUNTIME_FIELDS
    return (len(keys) >= 4 and ("agents", keys[-1]) in RUNTIME_FIELDS
            and keys[-2] == "config" and keys[-4] == "agents")


def protect_markers(text):
    """§8.4 step 1: {{ }} {% %} -> the §15.5 sentinels."""
    for marker, sentinel in SENTINELS.items():
        text = text.replace(marker, sentinel)
    return text


def replace_tags(text, replace):
    """`text` with each of its tags (scan_tags) replaced by replace(tag text, kind)."""
    out, pos = [], 0
    for start, end, kind in scan_tags(text):
        out += (text[pos:start], replace(text[start:end], kind))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def protect_tags(text):
    """protect_markers applied to every {{ }} / {% %} tag of `text` and nothing else (a flow or
    JSON mapping's own closing braces stay braces)."""
    return replace_tags(text, lambda tag, kind: tag if kind == "{#" else protect_markers(tag))


def restore_markers(text):
    """§8.4 step 4: the §15.5 sentinels -> {{ }} {% %}."""
    for marker, sentinel in SENTINELS.items():
        text = text.replace(sentinel, marker)
    return text


def restore_sentinels(data):
    """§8.2 step 4 / §8.4 step 4: put the protected template syntax back, keys and values alike."""
    def restore(value, _path):
        if isinstance(value, str):
            return restore_markers(value) if "<<<" in value else value
        if isinstance(value, dict) and any(isinstance(k, str) and "<<<" in k for k in value):
            return {restore(k, None): item for k, item in value.items()}
        return value
    return walk_document(data, restore)


class TagScope:
    """The names bound at some point of a template: base names plus open for/with/macro blocks."""

    def __init__(self, names=()):
        self.names = set(names)
        self.stack = []          # OpenBlock per block statement not yet closed
        self.deferred_reads = set()   # names read by the tags protected so far


# A block statement walk_tags has entered: its word, whether it was deferred, and the names it
# bound (added) or hid from Phase A (shadowed) until its {% end... %}.
OpenBlock = collections.namedtuple("OpenBlock", "word protected added shadowed")


def walk_tags(text, scope, defer, need_names=False):
    """Track bound names through `text`; with defer=True also replace by the §15.5 sentinels
    every tag whose free names are not all bound (Q47 (b)), so a later phase renders it.

    {% raw %}...{% endraw %} is left for the phase that meets it first, comments likewise.
    An {% elif %}/{% else %}/{% end... %} follows its opener's fate. need_names=True also
    defers a tag that reads no name at all (under MUSTACHE/SIMPLE such a tag is the engine's).
    """
    out, pos = [], 0
    for start, end, kind in scan_tags(text):
        if start < pos:          # inside a raw block already copied
            continue
        out.append(text[pos:start])
        tag = text[start:end]
        pos = end
        if kind == "{#":
            out.append(tag)
            continue
        inner = tag[2:-2].strip("-+ \t\r\n")
        word = inner.split(None, 1)[0] if inner and kind == "{%" else ""    # "" for {{ }}
        if word == "raw":
            close = text.find("endraw", end)
            close = text.find("%}", close) if close >= 0 else -1
            close = close + 2 if close >= 0 else len(text)
            out.append(text[start:close])
            pos = close
            continue
        if word in ("elif", "else"):
            protected = scope.stack[-1].protected if scope.stack else defer
        elif word.startswith("end"):
            if scope.stack:
                _, protected, added, shadowed = scope.stack.pop()
                scope.names = (scope.names - added) | shadowed
            else:
                protected = defer
        else:           # an expression, or a statement that may bind names
            free = tag_free_names(kind, inner, word)
            protected = defer and (free is None or not free <= scope.names
                                   or (need_names and not free))
            binds = set() if protected else tag_binds(word, inner)
            if defer and binds and free is not None and free <= phase_c_names() \
                    and binds_for_runtime(text, end, word, inner, scope, binds, need_names):
                protected, binds = True, set()
            if protected and free:
                scope.deferred_reads |= free
            # a statement left for Phase C binds its names there: Phase A must not see the
            # outer meaning of a name it rebinds (`loop` inside a deferred inner loop)
            shadowed = tag_binds(word, inner) & scope.names if protected else set()
            if is_block_opener(word, inner):
                if word in ("set", "macro"):      # the name outlives the block
                    scope.names = (scope.names | binds) - shadowed
                    binds, shadowed = set(), set()
                added = binds - scope.names
                scope.stack.append(OpenBlock(word, protected, added, shadowed))
                scope.names = (scope.names | added) - shadowed
            else:
                scope.names = (scope.names | binds) - shadowed
        out.append(protect_markers(tag) if protected else tag)
    out.append(text[pos:])
    return "".join(out)


@functools.lru_cache(maxsize=None)
def phase_c_names():
    """Names every Phase C rendering has whatever the context: built-ins, `context`, `message`."""
    return frozenset(BUILTINS) | frozenset(jinja_environment().globals) | RUNTIME_NAMES


def binds_for_runtime(text, end, word, inner, scope, binds, need_names):
    """Would a statement that Phase A could run bind a name that a deferred tag after it reads?
    Then the statement waits for Phase C as well -- `{% for op in ['<', '>'] %}` around
    `{{ context.n ~ op }}` -- or that tag would meet an undefined `op` at Phase C. Only a
    statement that itself reads nothing but Phase C names is moved (the caller checks): one
    reading a load-time name (`{% for x in ms %}`) could not run at Phase C either. Its reach
    is the block body, or the rest of the text for `set x = ...` and macros, which outlive it."""
    if is_block_opener(word, inner) and word not in ("set", "macro"):
        reach = text[end:block_body_end(text, end)]
    else:
        reach = text[end:]
    trial = TagScope(scope.names | binds)
    walk_tags(reach, trial, defer=True, need_names=need_names)
    return bool(trial.deferred_reads & binds)


def mask_tags(text):
    """`text` with every tag blanked to the same length, so YAML can compose a template document:
    a {{ }} tag becomes x's (a plain scalar, or part of one), a {% %} or {# #} tag spaces.
    Newlines stay, so character offsets and line numbers are those of `text`."""
    return replace_tags(text, lambda tag, kind: re.sub(r"[^\n]", "x" if kind == "{{" else " ", tag))


# A span of a template document that Phase A leaves alone (document_regions' result): 'field' =
# the value of a runtime field, 'section' = a top-level templates/template_strings body.
Region = collections.namedtuple("Region", "start end kind")
# The same span as the YAML marks give it, with the key and its column (to trim it further).
MarkedRegion = collections.namedtuple("MarkedRegion", "start end kind key key_col")
# A region the line scan has opened and not yet closed; block_col tracks a block scalar's key
# column inside `templates:` (templates_line).
OpenRegion = collections.namedtuple("OpenRegion", "start key_col kind block_col")


def node_regions(node, keys, offset, regions, seen=None):
    """The runtime-field and template-section spans under one composed YAML node (see
    document_regions); `offset` is where the composed text starts inside the document.
    An aliased node is walked once, where it is defined: an alias bomb composes to a small
    graph whose every path would take exponential time (YAML_ALIAS_BUDGET's reason)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            path = keys + [key]
            start, end = offset + value.start_mark.index, offset + value.end_mark.index
            if not keys and key in DEFERRED_SECTIONS:
                regions.append(MarkedRegion(start, end, "section", key, key_node.start_mark.column))
            elif isinstance(value, yaml.ScalarNode) and is_runtime_field(path):
                regions.append(MarkedRegion(start, end, "field", key, key_node.start_mark.column))
            else:
                node_regions(value, path, offset, regions, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            node_regions(item, keys, offset, regions, seen)


# INTERPRETATION I-140 §8.4 (new: where runtime fields sit in a template document): wherever YAML
# would put them once the tags are blanked -- block or flow mappings, list items, beside
# {% for %}/{% if %} lines; a key that is itself written by an expression is not known
# before Phase A, so its value renders at Phase A like any other.
def document_regions(text, file=None):
    """The Regions (character spans) of the text Phase A must not render as is.

    The spans come from the YAML node marks of the text with its tags blanked (mask_tags), so
    runtime fields are found in block and flow collections alike, around {% for %} and
    {% if %} lines too. When even the masked text does not compose (a statement inside a
    line that shifts indentation, a tag that emits structure), a line scan by indentation
    finds them (document_regions_by_lines).
    """
    masked = mask_tags(text)
    try:
        root = yaml.compose(masked, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return document_regions_by_lines(text, masked, file)
    regions = []
    if root is not None:
        node_regions(root, [], 0, regions)
    out = []
    for found in regions:
        end = statement_line_before(text, masked, found.start, found.end, found.key_col)
        line_start = text.rfind("\n", 0, found.start) + 1
        if found.key == "templates" and not text[line_start:found.start].strip():  # block mapping
            check_templates_body(text, line_start, file)
        out.append(Region(found.start, end, found.kind))
    return sorted(out)


def statement_line_before(text, masked, start, end, key_col):
    """Where a region taken from YAML marks really ends: before the first line that holds
    only tags (blank once masked) at or left of the key's column -- the {% endfor %} after a
    block scalar belongs to the document, not to the scalar -- as the line scan decides."""
    pos = text.find("\n", start, end)
    while 0 <= pos < end:
        line_at = pos + 1
        line_end = text.find("\n", line_at)
        line_end = len(text) if line_end < 0 else line_end
        raw = text[line_at:line_end]
        if raw.strip() and not masked[line_at:line_end].strip() \
                and len(raw) - len(raw.lstrip(" ")) <= key_col:
            return line_at
        pos = line_end if line_end < end else -1
    return end


FLOW_ITEM = re.compile(r" *(?:- +)+(?=[\[{])")


def flow_end(masked, start):
    """The offset just past the flow collection opening at masked[start] (quotes skipped);
    None when it never closes."""
    depth, i, quote, n = 0, start, None, len(masked)
    while i < n:
        ch = masked[i]
        if quote:
            if ch == quote == "'" and masked.startswith("''", i):
                i += 1
            elif ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"" and masked[i - 1] in " \t\n,[{:":
            quote = ch
        elif ch == "#" and masked[i - 1] in " \t\n":
            newline = masked.find("\n", i)
            i = n if newline < 0 else newline
            continue
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def flow_regions(masked, start, keys):
    """Regions inside the flow collection at masked[start], composed on its own; (regions, end)."""
    end = flow_end(masked, start)
    if end is None:
        return [], start
    try:
        node = yaml.compose(masked[start:end], Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return [], start
    regions = []
    node_regions(node, keys, start, regions)
    return [Region(*region[:3]) for region in regions], end   # brackets bound it: no trimming


def document_regions_by_lines(text, masked=None, file=None):
    """document_regions for text that does not compose as YAML even with its tags masked.

    A value region is the rest of the key's line plus every following blank or more-indented
    line (plain, quoted and | > block scalars alike). A flow collection that opens a value or
    a list item (`w: {system_prompt: ...}`, `- {...}`) is composed on its own (flow_regions).
    """
    masked = mask_tags(text) if masked is None else masked
    regions, keys, offset, skip_to = [], [], 0, 0
    region = None            # the OpenRegion being read

    def close(end):
        regions.append(Region(region.start, end, "field" if region.kind == "field" else "section"))

    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        line_at, offset = offset, offset + len(line)
        if line_at < skip_to:     # inside a multi-line flow collection already read
            continue
        body = line.rstrip("\r\n")
        indent = len(body) - len(body.lstrip(" "))
        blank = body.strip() == ""
        if region is not None:
            if blank or indent > region.key_col:
                if region.kind == "templates":
                    region = region._replace(block_col=templates_line(
                        line, indent, blank, region.block_col, lineno, file))
                continue
            close(line_at)
            region = None
        shown = masked[line_at:offset].rstrip("\r\n")    # the line with its tags blanked
        item = FLOW_ITEM.match(shown)
        match = None if item else KEY_LINE.match(shown)
        flow_at, path = None, [k for _, k in keys]
        if match:
            key_col = match.start(2)
            if body.lstrip(" ").startswith("{%"):   # `{% if x %}b: ...`: the key sits where
                key_col = indent                     # the statement starts, structurally
            key = match.group(2).strip("\"'")
            while keys and keys[-1][0] >= key_col:
                keys.pop()
            keys.append((key_col, key))
            path = [k for _, k in keys]
            if key_col == 0 and key in DEFERRED_SECTIONS:
                region = OpenRegion(offset, 0, key, None)
                continue
            value_at = line_at + match.end()
            value_at += len(masked[value_at:offset]) - len(masked[value_at:offset].lstrip(" "))
            if masked[value_at:value_at + 1] in ("{", "["):
                flow_at = value_at
            elif is_runtime_field(path):
                region = OpenRegion(line_at + match.end(), key_col, "field", None)
        elif item:
            flow_at = line_at + item.end()
            dash_col = len(shown) - len(shown.lstrip(" "))
            while keys and keys[-1][0] > dash_col:
                keys.pop()
            path = [k for _, k in keys]
        if flow_at is not None:
            found, skip_to = flow_regions(masked, flow_at, path)
            regions.extend(found)
    if region is not None:
        close(offset)
    return sorted(regions)


def protect_runtime_fields(text, render_context=None, *, file=None, engine="JINJA2"):
    """§8.4 step 1: replace {{ }} {% %} by the §15.5 sentinels where Phase A must not render.

    Template bodies (templates, template_strings) are protected whole (Q49 (a)). In runtime
    fields an expression is protected unless every name it reads is bound at Phase A -- by an
    enclosing {% for %}, a {% set %}, or the supplied render context (never `context` or
    `message`):
    INTERPRETATION I-121, I-122 §8.4 vs §18.6/§18.8 (Q47 (b), Q46 (b)): so `{{ loop.index }}` in a
    generated worker's prompt is rendered at load, `{{ context.topic }}` waits for Phase C.
    Under MUSTACHE or SIMPLE a runtime field is written in that dialect, so only tags that
    read Phase A names (not built-ins) and nothing else are rendered at load.
    """
    builtin_names = set(BUILTINS) | set(jinja_environment().globals)
    other_dialect = engine_name(engine) != "JINJA2"
    scope = TagScope(builtin_names | (set(render_context or ()) - RUNTIME_NAMES))
    out, pos = [], 0
    for start, end, kind in document_regions(text, file):
        out.append(walk_tags(text[pos:start], scope, defer=False))
        region = text[start:end]
        if kind == "section":
            out.append(protect_tags(region))
        elif other_dialect:
            out.append(walk_tags(region, TagScope(scope.names - builtin_names), defer=True,
                                 need_names=True))
        else:
            out.append(walk_tags(region, TagScope(scope.names), defer=True))
        pos = end
    out.append(walk_tags(text[pos:], scope, defer=False))
    return "".join(out)

# §8.5 Document-level template storage ----------------------------------------------------
# Reserved by §8.5: tags a host may put on a stored, still-unrendered document; users MUST NOT use
# them.
RESERVED_TEMPLATE_KEYS = ("_raw_template", "_is_template", "_needs_preprocessing",
                          "__jinja_template__", "__is_template__")


# INTERPRETATION I-141 §8.5 (Q83): "MUST NOT use" names no action; a tag key anywhere is a
# ConfigurationError at load.
def check_reserved_template_keys(doc):
    """§8.5: reject a mapping key anywhere in the document that is one of the reserved tags."""
    def refuse(value, path):
        for key in value if isinstance(value, dict) else ():
            if key in RESERVED_TEMPLATE_KEYS:
                raise doc.error(ConfigurationError, path + (key,), f"{key!r} is reserved for "
                                "the template-loading host and must not be used", "8.5")
    visit_document(doc.data, refuse)

# §8.6 The templates section (Phase B) ---------------------------------------------------
def param_string(value):
    """string: the canonical text of the value (YAML spelling for booleans, null and
    collections)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


# A coercion refuses with an unlocated ConfigurationError (or Python's own ValueError from int() or
# float()); coerce_parameter locates it at the instance.
def param_int(value):
    """int: the integer the value represents ("42", 42, 42.0); anything else is an error."""
    if isinstance(value, bool):
        raise error(ConfigurationError, "a boolean is not an integer")
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
    raise error(ConfigurationError, f"{value!r} is not an integer")


def param_float(value):
    """float: the floating-point number the value represents."""
    if isinstance(value, bool):
        raise error(ConfigurationError, "a boolean is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise error(ConfigurationError, f"{value!r} is not a number")


# INTERPRETATION I-126 §8.6.2 vs §8.8 (Q51, decided; a deviation from §8.6.2's literal text, which
# makes every non-empty string true): "false", "no", "0", "off" (any case) are false as well,
# matching step 6's coercion of a rendered "false"; other values go by truthiness.
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
        raise error(ConfigurationError, f"{value!r} is not one of {decl.get('values')}")
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


# Table of §8.6.2: parameter type -> coercion. Rows in the spec's order.
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
# The §8.6.1 declaration fields (`values` is what an enum needs, checked beside the rows).
PARAMETER_TYPE = Constraint(lambda value: is_known(value, PARAMETER_TYPES),
                            "one of " + ", ".join(PARAMETER_TYPES), (str,))
PARAMETER_FIELDS = fields_by_name(
    Field("type",        PARAMETER_TYPE, "string", "8.6.2"),
    Field("default",     ANY,            None,     "8.6.1"),
    Field("required",    ANY,            None,     "8.6.1"),
    Field("values",      ANY,            None,     "8.6.1"),
    Field("description", ANY,            None,     "8.6.1"),
)


def check_parameter_block(doc, decls, path):
    """§8.6.1, §16.2: the block's shape, checked when the template is registered (§12.1 step 2),
    so a template never instantiated is held to it too."""
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
        check_fields(doc, decl, PARAMETER_FIELDS, at)
        if decl.get("type") == "enum" and not isinstance(decl.get("values"), list):
            raise doc.error(ConfigurationError, at, "an enum parameter needs a `values` list",
                            "8.6.1")


def parameter_declarations(doc, decls, path, rt=None):
    """§8.6.1: the parameters block must be a mapping of name -> declaration mapping.

    A templates entry without the block was refused at registration (Q83); a template_strings
    body may omit it (None: no parameters). INTERPRETATION I-145 §8.6.1 (new): an undeclared
    instance parameter is passed through with a warning (bind_parameters). The sequence form is
    forbidden (§16.2).
    """
    if decls is None:
        return {}
    check_parameter_block(doc, decls, path)
    for name, decl in decls.items():
        at = path + (name,)
        check_unknown(rt, decl, PARAMETER_FIELDS, at, "8.6.1",
                      "unknown key {key!r} in a parameter declaration")
    return decls


def coerce_parameter(doc, name, decl, value, at):
    """One value through its §8.6.2 type; a mismatch is a ConfigurationError at the instance."""
    ptype = decl.get("type", "string")
    try:
        if ptype == "enum":
            return param_enum(value, decl)
        return PARAMETER_TYPES[ptype](value)
    except (ValueError, TypeError, ConfigurationError) as exc:
        raise doc.error(ConfigurationError, at, f"parameter {name!r} ({ptype}): "
                        f"{getattr(exc, 'message', exc)}", "8.6.2") from exc


def bind_parameters(doc, decls, params, inst_path, rt=None):
    """§8.8 steps 1-2: required present, types coerced (§8.6.2), then defaults filled."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise doc.error(ConfigurationError, inst_path + ("params",), "params must be a mapping",
                        "8.7")
    values = {}
    for name, decl in decls.items():
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
# The fields of a §8.7 agent instance, and of a route instance (which takes the rest of its
# structure from the template, §16.3).
AGENT_INSTANCE_FIELDS = fields_by_name(Field("template", STRING, REQUIRED, "8.7"),
                                       *read_elsewhere("8.7", "params", "type"))
ROUTE_INSTANCE_FIELDS = fields_by_name(Field("template_config", MAPPING, REQUIRED, "8.7"),
                                       *read_elsewhere("8.7", "type", "description"))


def expand_templates(doc, rt=None, *, engine=None):
    """Phase B (§8.2 step 5, §8.6-§8.10): rewrite doc.data in place, every template instance
    replaced by its concrete definition, before validation.

    Agents with `template:` (also inside composite components, §8.10), routes with
    `template_config:` (§8.7), and the deprecated `instances:` section (Q55).
    """
    data = doc.data
    if not isinstance(data, dict):
        return
    expansion = Expansion(doc, rt, data, engine)
    instances = data.get("instances")
    if instances is not None:
        expansion.move_instances(instances)
    agents = data.get("agents")
    if isinstance(agents, dict):
        for name in list(agents):
            agents[name] = expansion.agent(agents[name], ("agents", name), ())
    routes = data.get("routes")
    if isinstance(routes, dict):
        for name in list(routes):
            routes[name] = expansion.route(routes[name], ("routes", name))


class Expansion:
    """One Phase B pass over a document: the template registries and the instantiation steps."""

    def __init__(self, doc, rt, data, engine=None):
        self.doc, self.rt, self.data = doc, rt, data
        self.sandbox = rt.sandbox if rt is not None else InProcessSandbox()
        self.engine = engine_name(engine or (rt.engine if rt is not None else None)
                                  or host_parameter(doc, "template_engine", None)[0])
        self.templates = self.registry("templates", dict)
        self.strings = self.registry("template_strings", str)
        # INTERPRETATION I-173 §8.6, §8.9 (new): one name, one template per kind -- a name declared
        # in both templates and template_strings is a ConfigurationError, used or not.
        for kind, entries in self.strings.items():
            for name in entries:
                if name in (self.templates.get(kind) or {}):
                    raise doc.error(ConfigurationError, ("template_strings", kind, name),
                                    f"{kind[:-1]} template {name!r} is declared in both templates "
                                    "and template_strings", "8.6, 8.9")

    def registry(self, section, body_type):
        """templates / template_strings: {agents|graphs|streams: {name: body}}."""
        table = self.data.get(section)
        if table is None:                    # absent or null: no templates (§3.2)
            table = {}
        if not isinstance(table, dict):      # [] or false is not "none" but the wrong type
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
                # INTERPRETATION I-145 §8.6.1 (Q83, decided): "MUST declare" -- a templates entry
                # without a parameters block is refused, instantiated or not (`parameters: {}`
                # declares none). template_strings bodies (§8.9) keep theirs optional.
                if body_type is dict and "parameters" not in body:
                    raise self.doc.error(ConfigurationError, (section, kind, name),
                                         f"template {name!r} declares no parameters block "
                                         "(write `parameters: {}` for none)", "8.6.1")
                if body_type is dict and body["parameters"] is not None:
                    check_parameter_block(self.doc, body["parameters"],
                                          (section, kind, name, "parameters"))
        return table

    def move_instances(self, instances):
        """INTERPRETATION I-130 §3.2 vs §8.7 (Q55 (b)): the deprecated `instances:` section is read
        as {name: {template, params}} and moved into `agents`, with a deprecation warning."""
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
                # INTERPRETATION I-093, I-139 §4.1/§4.8 vs §16.2 (Q2 (b)): rejected, as §16.2 says
                # MUST.
                raise self.doc.error(ConfigurationError, path + ("agent_template",),
                                     "`agent_template` is a forbidden form; use `template`",
                                     "16.2")
            if "template" not in cfg:
                break
            # INTERPRETATION I-144 §4.8 vs §16.3 (new): `type: template_instance` is the internal
            # tag, not a competing form, so it may stand beside `template`.
            if "type" in cfg and cfg["type"] != "template_instance":
                raise self.doc.error(ConfigurationError, path, "`template` and `type` on the "
                                     "same agent (one form excludes the other)", "16.3")
            check_unknown(self.rt, cfg, AGENT_INSTANCE_FIELDS, path, "8.7",
                          "key {key!r} beside `template` is ignored")
            cfg = self.instantiate("agents", cfg["template"], cfg.get("params"), path, scope)
        else:
            raise self.doc.error(ConfigurationError, path, "templates instantiate each other "
                                 "more than 32 levels deep", "8.7")
        return self.composite(cfg, path)

    def route(self, cfg, path):
        """§8.7 routes via template_config: {template, params}."""
        if not isinstance(cfg, dict) or "template_config" not in cfg:
            return cfg
        extra = check_unknown(self.rt, cfg, ROUTE_INSTANCE_FIELDS, path, "16.3", refuse=True)
        if extra:
            raise self.doc.error(ConfigurationError, path + (extra[0],), "a route with "
                                 "template_config takes its structure from the template; "
                                 f"remove {', '.join(extra)}", "16.3")
        tc = cfg["template_config"]
        if not isinstance(tc, dict) or not isinstance(tc.get("template"), str):
            raise self.doc.error(ConfigurationError, path + ("template_config",),
                                 "template_config needs `template` (and `params`)", "8.7")
        name = tc["template"]
        # INTERPRETATION I-129 §5.1/§11.3 vs §8.7 (Q54 (b)+(c)): `type` may be omitted and then
        # comes from the template's kind; when given it picks the kind and must match.
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

# §8.7.1 Reference parameter resolution -------------------------------------------------
def composite_scope(doc, path):
    """The agent names a composite at `path` (its config) can reach: the Actor's, every enclosing
    composite's, and its own."""
    # INTERPRETATION I-014 §4.6.1, §8.7.1: a component may name the Actor's agents, every enclosing
    # composite's, and this one's (local first), in any document order.
    names = set(doc.data.get("agents") or {})
    for end in range(1, len(path) + 1):
        if path[end - 1] == "config":
            names |= set(outer_get(doc.data, path[:end] + ("components", "agents")) or {})
    return names


def is_agent_ref(cfg):
    """A component written `{ref: <agent name>}` (§8.7.1's example): the named agent itself."""
    return isinstance(cfg, dict) and "ref" in cfg and "type" not in cfg


def check_agent_ref(doc, local, cfg, path, scope, siblings):
    """§8.7.1: a `ref` component names an agent of the composite's scope, other than itself."""
    # INTERPRETATION I-015 §4.6.1, §8.7.1: `{ref: name}` makes the local name an alias of an agent
    # in scope (this composite's others first, then outward); an unknown name is a
    # ConfigurationError.
    target = cfg["ref"]
    extra = sorted(set(cfg) - {"ref"})
    if extra:
        raise doc.error(ConfigurationError, path + (extra[0],),
                        f"a ref component takes only `ref`, not '{extra[0]}'", "8.7.1")
    if not isinstance(target, str) or target == local or target not in scope:
        raise doc.error(ConfigurationError, path + ("ref",),
                        f"ref {target!r} names no other agent in the composite's scope", "8.7.1")
    if is_agent_ref(siblings.get(target)):
        raise doc.error(ConfigurationError, path + ("ref",),
                        f"ref {target!r} names another ref component; name the agent itself",
                        "8.7.1")


def check_composite_self_reference(doc):
    """§4.6, §8.7.1: a `{ref: name}` component (also one an `agent_ref` parameter filled in) must
    not stand for the composite it sits in, an enclosing one, or -- through other composites'
    refs -- lead back to it: invoking it would never end. Refused at load, located at the ref."""
    # INTERPRETATION I-015 §4.6.1, §8.7.1 (new): only refs are followed; a graph or stream component
    # that maps the composite again may be bounded by its own conditions, so it is left alone.
    top = doc.data["agents"]
    edges = {}                     # top-level agent -> [(top-level agent it refs, path of the ref)]

    def walk(owner, cfg, path, chain):
        """chain: [(scope mapping, name of the composite on our path in that scope)], outermost
        first (the Actor's agents, then each enclosing composite's locals)."""
        if not isinstance(cfg, dict) or cfg.get("type") != "composite":
            return
        components = (cfg.get("config") or {}).get("components")
        local = components.get("agents") if isinstance(components, dict) else None
        if not isinstance(local, dict):
            return
        for lname, sub in local.items():
            lpath = path + ("config", "components", "agents", lname)
            if not is_agent_ref(sub):
                walk(owner, sub, lpath, chain + [(local, lname)])
                continue
            target = sub["ref"]
            scopes = [(local, None)] + list(reversed(chain))
            for depth, (scope, on_path) in enumerate(scopes):
                if isinstance(target, str) and target in scope:
                    if target == on_path:
                        raise doc.error(ConfigurationError, lpath + ("ref",),
                                        f"ref '{target}' names a composite that contains it, "
                                        "so invoking it would never end", "4.6, §8.7.1")
                    if depth == len(scopes) - 1:            # an agent of the Actor
                        edges.setdefault(owner, []).append((target, lpath + ("ref",)))
                    break

    for name, cfg in top.items():
        walk(name, cfg, ("agents", name), [(top, name)])
    # INTERPRETATION I-168 §4.6, §8.7.1: a ref that leads back to its composite fails the load.
    for start in edges:                     # a ref cycle through several composites
        seen, todo = {start}, [start]
        while todo:
            for target, where in edges.get(todo.pop(), []):
                if target == start:
                    raise doc.error(ConfigurationError, where, f"ref '{target}' leads back to "
                                    f"composite '{start}' through other composites' refs, so "
                                    "invoking it would never end", "4.6, §8.7.1")
                if target not in seen:
                    seen.add(target)
                    todo.append(target)


class AgentRef:
    """A composite's `{ref: name}` component: stands for the agent `name` of the enclosing scope,
    looked up when used (it may be declared after the composite)."""

    type = "ref"

    @property
    def reads_context(self):
        return getattr(self.agent, "reads_context", True)

    @property
    def writes_context(self):
        return getattr(self.agent, "writes_context", True)

    def __init__(self, name, target, scope):
        self.name, self.target, self.scope = name, target, scope

    @property
    def agent(self):
        agent = self.scope[self.target]
        return agent.agent if isinstance(agent, AgentRef) else agent

    @property
    def capabilities(self):
        return self.agent.capabilities if self.target in self.scope else []

    def invoke(self, content, ctx):
        return self.agent.invoke(content, ctx)


# §8.8 Template rendering semantics (Phase B) ---------------------------------------------
WHOLE_IF_BLOCK = re.compile(r"\s*\{%-?\s*if\b.*\{%-?\s*endif\s*-?%\}\s*", re.DOTALL)
INT_FORM = re.compile(r"[-+]?\d+")
FLOAT_FORM = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+)")


# INTERPRETATION I-142 §8.8 step 6 (new): only strings that held template syntax are coerced, and
# never a runtime field (render_tree), so quoted literals and prompts stay strings.
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
        except (ValueError, RecursionError):    # not JSON, or nested past the parser's depth
            return text
    return text


def instantiate(expansion, kind, name, params, path, scope):
    """§8.8: the nine steps, in order, for one instance of template `name` of `kind`."""
    found = expansion.find(kind, name) if isinstance(name, str) else None
    if found is None:
        raise expansion.doc.error(ConfigurationError, path + ("template",),
                           f"unknown {kind[:-1]} template {name!r}", "8.7")
    body, raw = found
    section = "template_strings" if raw else "templates"
    tpath = (section, kind, name)
    decls = (template_string_parameters(expansion.doc, body, tpath) if raw
             else body.get("parameters"))
    decls = parameter_declarations(expansion.doc, decls, tpath + ("parameters",), expansion.rt)
    values = bind_parameters(expansion.doc, decls, params, path, expansion.rt)          # steps 1-2
    variables = dict(BUILTINS)
    variables.update(values)
    if raw:                                                                 # §8.9
        result = instantiate_string(expansion, body, variables, path, tpath)
    else:
        result = copy.deepcopy(body)                                       # step 3
        result.pop("parameters", None)                                     # step 4
        result = render_tree(expansion, result, variables, path, ())              # steps 5-7
    resolve_references(expansion, decls, values, path, scope)                     # step 8
    return result                                                          # step 9


def render_at_instantiation(expansion, text, variables):
    """Phase B's render(), in the Actor's sandbox (§13.2 isolation): under SIMPLE only the {{ }}
    pass runs (Q60 (b): the format pass belongs to Phase C)."""
    return expansion.sandbox.render(text, variables, expansion.engine, phase="B")


def render_phase_b(expansion, text, variables, path, runtime_field):
    """Step 5 for one string. Phase B failures are ConfigurationErrors (§8.12).

    INTERPRETATION I-124 §8.8 vs §8.11 (Q49 (d)): in a runtime field (system_prompt, prompt) an
    expression whose names are not all parameters or built-ins survives to Phase C. A parameter
    named `message` or `context` is a parameter like any other (§8.8 step 5): `variables` holds
    those names only when the instance binds them, and then they render here.
    """
    names = set(variables)
    if runtime_field and expansion.engine == "JINJA2":
        text = walk_tags(text, TagScope(names), defer=True)
    elif runtime_field:
        text = defer_foreign_tags(text, names, expansion.engine)
    try:
        rendered = render_at_instantiation(expansion, text, variables)
    except TemplateError as exc:
        raise expansion.doc.error(ConfigurationError, path,
                                  f"Phase B rendering failed: {exc.message}", "8.12") from exc
    return restore_markers(rendered) if runtime_field else rendered


def foreign_tag_reads(inner, engine):
    """The names a MUSTACHE or SIMPLE tag reads (None: leave the tag to Phase C)."""
    if engine == "MUSTACHE":
        body = inner.strip().strip("{}").strip()
        if not body or body[0] in "!>=":
            return None                      # comments, partials, delimiters: Phase C's
        name = body.lstrip("#^/&").strip()
        return {name.split(".")[0]} if name != "." else set()
    try:
        tree = ast.parse(inner.strip(), mode="eval")
    except SyntaxError:
        return None
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def defer_foreign_tags(text, names, engine):
    """walk_tags for the MUSTACHE and SIMPLE dialects: a {{ }} tag reading a name that is not a
    parameter or built-in is protected (§15.5 sentinels) so that Phase C renders it."""
    out, pos = [], 0
    while True:
        start = text.find("{{", pos)
        end = text.find("}}", start + 2) if start >= 0 else -1
        if end < 0:
            break
        end += 3 if engine == "MUSTACHE" and text.startswith("}", end + 2) else 2
        tag = text[start:end]
        reads = foreign_tag_reads(tag[2:-2], engine)
        out.append(text[pos:start])
        out.append(tag if reads is not None and reads <= names else protect_markers(tag))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def render_tree(expansion, node, variables, path, keys):
    """Steps 5-7 over a definition: render every string (keys too), coerce rendered scalars,
    and drop the entries whose whole value was an {% if %} block that rendered empty."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            new_key = key
            if has_template_syntax(key):
                new_key = render_phase_b(expansion, key, variables, path, False)
            prompt = key in ("system_prompt", "prompt")
            if dropped_if_block(value, expansion, variables, path, prompt):
                continue
            out[new_key] = render_tree(expansion, value, variables, path + (key,), keys + (key,))
        return out
    if isinstance(node, list):
        return [render_tree(expansion, item, variables, path + (i,), keys)
                for i, item in enumerate(node)
                if not dropped_if_block(item, expansion, variables, path + (i,), False)]
    if isinstance(node, str) and has_template_syntax(node):
        runtime = bool(keys) and keys[-1] in ("system_prompt", "prompt")
        rendered = render_phase_b(expansion, node, variables, path, runtime)
        return rendered if runtime else coerce_rendered(rendered)              # step 6
    return node


def dropped_if_block(value, expansion, variables, path, runtime_field):
    """Step 7. INTERPRETATION I-127 §8.8 (Q52 (b)): a list item or mapping entry whose whole value
    is one {% if %}...{% endif %} block that renders to nothing is removed from the structure."""
    if not (isinstance(value, str) and WHOLE_IF_BLOCK.fullmatch(value)):
        return False
    return render_phase_b(expansion, value, variables, path, runtime_field).strip() == ""


def resolve_references(expansion, decls, values, path, scope):
    """Step 8, §8.7.1: agent_ref / component_ref name a component of the enclosing composite
    (scope 1) or a top-level agent -- or, for component_ref, a route (scope 2)."""
    agents = expansion.data.get("agents") if isinstance(expansion.data.get("agents"), dict) else {}
    routes = expansion.data.get("routes") if isinstance(expansion.data.get("routes"), dict) else {}
    for name, decl in decls.items():
        ptype = decl.get("type")
        if ptype not in ("agent_ref", "component_ref") or name not in values:
            continue
        ref = values[name]
        known = isinstance(ref, str) and (
            ref in scope or ref in agents or (ptype == "component_ref" and ref in routes))
        if not known:
            kinds = "agent or route" if ptype == "component_ref" else "agent"
            raise expansion.doc.error(ConfigurationError, path + ("params", name),
                                      f"{ptype} {ref!r} names no {kinds} in the composite or the "
                                      "actor", "8.7.1")

# §8.9 The template_strings section -------------------------------------------------------
def template_string_parameters(doc, body, tpath):
    """INTERPRETATION I-128 §8.9 (Q53 (a)): a template_strings body declares its parameters in a
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
    try:        # parse_yaml: the loader's alias budget and nesting bound hold here too
        parsed = parse_yaml(text)[0]
    except ConfigurationError as exc:
        raise doc.error(ConfigurationError, tpath, f"parameters block: {exc.message}",
                        "8.9") from exc
    return parsed.get("parameters") if isinstance(parsed, dict) else None


def instantiate_string(expansion, body, variables, path, tpath):
    """§8.9: render the raw body with the parameters, then parse it as YAML.

    INTERPRETATION I-128 §8.9/§18.11 (Q53 (e)): a body that yields one definition (it has `type` or
    `template`) is the instance; a body that yields several definitions becomes a composite
    named after the instance, those definitions its components (input: the first, output:
    the last), so §18.11's `agent: legal_team` names something real.
    """
    try:
        text = render_at_instantiation(expansion, body, variables)
    except TemplateError as exc:
        raise expansion.doc.error(ConfigurationError, path,
                                  f"Phase B rendering of {path_str(tpath)} failed: {exc.message}",
                                  "8.12") from exc
    try:        # parse_yaml: the loader's alias budget and nesting bound hold here too
        result = parse_yaml(text)[0]
    except ConfigurationError as exc:
        raise expansion.doc.error(ConfigurationError, path, f"{path_str(tpath)} does not render to "
                           f"YAML: {exc.message}", "8.9") from exc
    if not isinstance(result, dict):
        raise expansion.doc.error(ConfigurationError, path, f"{path_str(tpath)} must render to a "
                           "mapping", "8.9")
    result.pop("parameters", None)
    if "type" in result or "template" in result or tpath[1] != "agents":
        return result
    if not result:
        raise expansion.doc.error(ConfigurationError, path, f"{path_str(tpath)} rendered no "
                           "definitions", "8.9")
    names = list(result)
    return {"type": "composite", "config": {
        "components": {"agents": result},
        "routing": {"input": {"type": "agent", "name": names[0]},
                    "output": {"type": "agent", "name": names[-1]}}}}


BLOCK_SCALAR = re.compile(r" *[|>][-+0-9]* *(#.*)?\n?$")


def check_templates_body(text, pos, file):
    """Run templates_line over the lines of a block `templates:` body that starts at `pos`, up
    to the next line at column 0 (Q3: no statement lines that generate structure)."""
    lineno, block_col = text.count("\n", 0, pos) + 1, None
    for line in text[pos:].splitlines(keepends=True):
        body = line.rstrip("\r\n")
        indent = len(body) - len(body.lstrip(" "))
        blank = body.strip() == ""
        if not blank and indent == 0:
            return
        block_col = templates_line(line, indent, blank, block_col, lineno, file)
        lineno += 1


def templates_line(line, indent, blank, block_col, lineno, file):
    """One line inside `templates:`; returns the open block scalar's key column (or None).

    INTERPRETATION I-138 §16.2 vs §8.9 (Q3): a `templates` body may hold value expressions and
    {% if %} inside string values, but a statement line that would emit YAML structure (a
    {% for %} or {% if %} between keys or items) is rejected: it belongs in template_strings.
    """
    if blank:
        return block_col
    if block_col is not None and indent > block_col:
        return block_col
    stripped = line.strip()
    if stripped.startswith("{%"):
        raise error(ConfigurationError,
            "a statement that generates YAML structure inside `templates`; declare this "
            "template under template_strings", "16.2, 8.9", file=file, line=lineno)
    match = KEY_LINE.match(line.rstrip("\r\n"))
    if match and BLOCK_SCALAR.match(line[match.end():]):
        return match.start(2)
    return None

# §8.10 Composite templates ----------------------------------------------------------------
def expand_composite(expansion, cfg, path):
    """§8.10 / §8.7.1: template instances among a composite's components resolve references
    in the composite's own scope first, then the actor's."""
    if not (isinstance(cfg, dict) and cfg.get("type") == "composite"):
        return cfg
    config = cfg.get("config")
    comps = config.get("components") if isinstance(config, dict) else None
    if not isinstance(comps, dict):
        return cfg
    # §4.6.1: graph and stream components follow the routes schema, template_config included.
    for kind in ("graphs", "streams"):
        if isinstance(comps.get(kind), dict):
            for name in list(comps[kind]):
                comps[kind][name] = expansion.route(
                    comps[kind][name], path + ("config", "components", kind, name))
    agents = comps.get("agents")
    if not isinstance(agents, dict):
        return cfg
    scope = tuple(agents)
    at = path + ("config", "components", "agents")
    for name in list(agents):
        agents[name] = expansion.agent(agents[name], at + (name,), scope)
    return cfg

# §8.11 Runtime template rendering (Phase C) ----------------------------------------------
def runtime_variables(ctx, message, chained=False):
    """§8.11 table: the §8.3 built-ins, the context's top-level keys flattened, `context` and
    `message` (the text of the message being processed).

    chained: a view reading through `context`, `message`, the context and the built-ins in that
    order (JINJA2 reads through it), at a cost independent of the context's size; else a dict."""
    if isinstance(message, Message):
        message = message.content
    data = ctx if isinstance(ctx, (dict, ChainMap)) else {}
    if chained:
        return ChainMap({"context": ctx if ctx is not None else {}, "message": message}, data,
                        BUILTINS)
    variables = dict(BUILTINS)
    variables.update(data)
    variables["context"] = dict(ctx) if isinstance(ctx, ChainMap) else \
        ctx if ctx is not None else {}
    variables["message"] = message
    return variables


def warn_unparsable_template(rt, text, path):
    """Issue 16: a runtime template (system_prompt, prompt, prompts content) that does not even
    parse in the engine is warned once at load, located; at Phase C it then renders as its
    literal text (§8.12), as it would have anyway."""
    if not isinstance(text, str) or rt.engine != "SIMPLE" and not has_template_syntax(text):
        return
    try:
        if rt.engine == "JINJA2":
            jinja_template(text)                     # syntax, unknown filters and tests
        elif rt.engine == "MUSTACHE":
            mustache_compiled(text)
        else:
            for is_expression, part in simple_parts(text):
                if is_expression:
                    _compile_expression_text(part)
    except (TemplateError, SyntaxError, _Rejected) as exc:
        reason = exc.message if isinstance(exc, ActorError) else exc
        rt.warn(f"this {rt.engine} template does not parse ({reason}); it will be used as its "
                f"literal text", section="8.12", path=path)
    except Exception as exc:    # jinja2's own syntax and assertion errors
        rt.warn(f"this {rt.engine} template does not parse ({type(exc).__name__}: {exc}); it "
                f"will be used as its literal text", section="8.12", path=path)


def render_runtime(rt, text, ctx, message, path=None):
    """§8.11 Phase C: render a system prompt or prompt template for one invocation, in
    rt.engine; on failure warn and use the literal text (§8.12, §4.4.6).

    Registered prompts (§10.4, rt.prompts) serve as MUSTACHE partials.
    """
    if not isinstance(text, str):
        return text
    engine = engine_name(rt.engine)
    if engine != "SIMPLE" and not has_template_syntax(text):
        return text       # same result, no parse: plain prompts cost nothing (Q59 (a))
    try:
        # JINJA2 in this process reads through a view; a worker process gets a plain copy
        chained = engine == "JINJA2" and isinstance(rt.sandbox, InProcessSandbox)
        return rt.sandbox.render(text, runtime_variables(ctx, message, chained), engine,
                                 partials=rt.prompts)
    except TemplateError as exc:
        warn(rt, f"Phase C rendering failed ({exc.message}); the literal text is used",
             section="8.12", path=path)
        return text

# §8.12 Render-failure policy -------------------------------------------------------------
# Pointer banner: each phase handles its own failure where it renders -- Phase A fails the load
# (render_document), Phase B the instantiation (render_phase_b, instantiate_string), both as
# ConfigurationError; Phase C warns and uses the literal text (render_runtime).


# =====================================================================================
# §9 ACTOR PARAMETERS
# =====================================================================================

# §9.2 template_engine ---------------------------------------------------------------------
# The three dialects share one entry point, render(); Phases A, B and C all go through it.
JINJA2_MISSING = ("the JINJA2 template engine needs the jinja2 package: "
                  "python3 -m pip install jinja2")


def jinja2_module():
    """The one place jinja2 is imported, the first time a document or prompt needs JINJA2 (a
    start-up pays only for what the document needs); without it only those fail."""
    try:
        import jinja2
        import jinja2.meta
        import jinja2.sandbox
    except ImportError:
        raise error(TemplateError, JINJA2_MISSING, "9.2") from None
    return jinja2


def _jinja_classes(jinja2):
    """The two classes the JINJA2 environment is built from (they subclass jinja2's own)."""

    # INTERPRETATION I-125 §8.12 vs §8.11 (Q50 (c)): undefined names fail when printed or
    # dereferenced and are false in conditions; the seed context is the §8.3 built-ins plus any
    # render context.
    class RuntimeUndefined(jinja2.Undefined):
        """Q50 (c): an undefined name fails when printed, iterated for output or dereferenced,
        but is simply false in conditions, `default` and comparisons (§8.11's `{% if context.x
        %}`)."""

        __slots__ = ()
        __str__ = jinja2.Undefined._fail_with_undefined_error
        __len__ = jinja2.Undefined._fail_with_undefined_error

        def __lt__(self, other):
            return False

        __le__ = __gt__ = __ge__ = __lt__

        def __iter__(self):
            return iter(())

    # Objects of the engine itself: a template that got hold of one (a frame's locals once
    # leaked the Context, see builtin_locals) could reach jinja2.Template, which renders outside
    # any sandbox.
    jinja_internals = (jinja2.Environment, jinja2.Template, jinja2.runtime.Context)

    class ActorSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """Jinja2's immutable sandbox, with these changes:
        - on a mapping, `a.b` reads the key `b` before any attribute, so `context.items` is the
          configured list, not dict.items (INTERPRETATION I-143 §8.11 (new: key vs attribute):
          `context.<key>` always means the key);
        - T2 (README Security): unbound methods of classes (reached through the §8.3 `str`,
          `dict`... built-ins) are refused: jinja2 checks the bound forms only, so
          str.format('{0.__init__.__globals__}', cycler) walked attributes and
          dict.update(context, {...}) changed the context;
        - T3: the §13.2 budget: every call and every loop step ticks the render's deadline, and
          + * ** go through the size check of the sandbox's operators.
        INTERPRETATION I-160 §8.11 (new: templates are read-only): the immutable sandbox, because
        the rendering context holds the live context by reference, and a prompt that could call
        context.update() could set host-only keys such as _unsafe_mode (§10.3).
        """

        intercepted_binops = frozenset({"+", "*", "**"})   # guard_op's operators

        def getattr(self, obj, attribute):
            if isinstance(obj, (dict, ChainMap)) and attribute in obj:     # (a context view)
                return obj[attribute]
            return super().getattr(obj, attribute)

        def is_safe_attribute(self, obj, attr, value):
            if isinstance(obj, type) and isinstance(value, _UNBOUND_METHODS):
                return False
            if isinstance(obj, jinja_internals):    # the engine's own objects, never data
                return False
            return super().is_safe_attribute(obj, attr, value)

        def is_safe_callable(self, obj):
            if isinstance(obj, type) and issubclass(obj, jinja_internals):
                return False        # a new Template or Environment would not be sandboxed
            return super().is_safe_callable(obj)

        def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja2's signature)
            tick()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            return guard_op(operator, left, right)

        def _parse(self, source, name, filename):
            """Every `{% for %}` iterates through the `sb_loop` filter, which ticks the budget."""
            tree = super()._parse(source, name, filename)
            for node in tree.find_all(jinja2.nodes.For):
                node.iter = jinja2.nodes.Filter(node.iter, "sb_loop", [], [], None, None,
                                                lineno=node.lineno)
            return tree

    return RuntimeUndefined, ActorSandbox


_UNBOUND_METHODS = (type(str.upper), type(template_range))   # method descriptor, function


LIPSUM_MAX_WORDS = 100_000   # jinja2's lipsum(n, html, min, max) writes up to n * max words


def template_lipsum(n=5, html=True, min=20, max=100):
    """jinja2's `lipsum` global within the render budget (T3): its word loop never ticks, so
    the words it may write are bounded up front."""
    if not all(type(value) is int for value in (n, min, max)) or n * max > LIPSUM_MAX_WORDS:
        raise error(TemplateError, f"lipsum: at most {LIPSUM_MAX_WORDS} words (n * max, integers)",
                    "13.2")
    return jinja2_module().utils.generate_lorem_ipsum(n, html, min, max)


def template_loop(iterable):
    """The `sb_loop` filter: each step of a template loop ticks the budget."""
    for item in iterable:
        tick()
        yield item


# INTERPRETATION I-134 §4.4.6 (Q59 (a)): keep_trailing_newline -- text outside expressions is kept
# as is.
@functools.lru_cache(maxsize=None)
def jinja_environment():
    """§9.2 JINJA2: one sandboxed environment per process (a pure memo, never mutated after build).

    Templates come from configuration files, hence the sandbox; keep_trailing_newline by Q59 (a).
    """
    undefined, sandbox = _jinja_classes(jinja2_module())
    env = sandbox(undefined=undefined, keep_trailing_newline=True, autoescape=False)
    env.globals.update(BUILTINS)
    env.globals["lipsum"] = template_lipsum
    env.filters.update(FILTERS)
    env.filters["sb_loop"] = template_loop
    return env


@functools.lru_cache(maxsize=4096)
def jinja_template(text):
    """Compiled template by source text: the hot path (Phase C, once per message) never
    re-parses."""
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


# Every engine renders under the §13.2 budget (T3): the deadline below, the sandbox's size check.
TEMPLATE_TIME_LIMIT = 2.0   # seconds one render may take


def render_jinja2(text, variables, partials=None):
    """§9.2 JINJA2: full Jinja2 dialect in the sandbox, with the §8.3 built-ins and filters."""
    try:
        return run_limited(_jinja_render, (jinja_template(text), variables), TEMPLATE_TIME_LIMIT,
                           "JINJA2", TemplateError, code=False)
    except TemplateError:
        raise
    except Exception as exc:  # jinja2 syntax, undefined, sandbox and filter errors alike
        err = error(TemplateError, f"JINJA2: {type(exc).__name__}: {exc}", "9.2")
        err.line = jinja_error_line(exc)
        raise err from exc


def _jinja_render(template, variables):
    """template.render(variables) without the two copies of `variables` Jinja2 makes: its context
    reads through them, then the template's globals (Phase C: no cost per context key)."""
    context = template.new_context(ChainMap(variables, template.globals), shared=True)
    try:
        return template.environment.concat(template.root_render_func(context))
    except Exception:
        template.environment.handle_exception()


# MUSTACHE: a hand-written tokenizer + tree renderer -----------------------------------------
MUSTACHE_STANDALONE = "#^/!>="        # tag sigils that may stand alone on a line
MUSTACHE_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}
# The parsed template: a list of these four node kinds (a section holds a list of its own).
MText = collections.namedtuple("MText", "text")
MVar = collections.namedtuple("MVar", "name escaped")                 # {{x}} / {{{x}}} {{&x}}
MSection = collections.namedtuple("MSection", "name inverted nodes")  # {{#x}}...{{/x}} / {{^x}}
MPartial = collections.namedtuple("MPartial", "name indent")          # {{>x}}, standalone indent


def mustache_parse(text, open_delim="{{", close_delim="}}"):
    """Tokenize and nest a Mustache template into a node list.

    Nodes are MText, MVar, MSection and MPartial. Standalone tags (alone on their line apart from
    whitespace) take the whole line away.
    """
    root, stack, pos = [], [], 0
    nodes = root
    n = len(text)
    while pos < n:
        start = text.find(open_delim, pos)
        if start < 0:
            nodes.append(MText(text[pos:]))
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
            raise error(TemplateError, f"MUSTACHE: unclosed tag at offset {start}", "9.2")
        body = text[inner:end]
        after = end + len(close)
        if sigil in "#^/!>=&":
            body = body[1:]
        if sigil == "=":
            body = body.rstrip()
            if not body.endswith("="):
                raise error(TemplateError, "MUSTACHE: malformed set-delimiter tag", "9.2")
            parts = body[:-1].split()
            if len(parts) != 2:
                raise error(TemplateError, "MUSTACHE: set-delimiter needs two delimiters", "9.2")
        name = body.strip()
        before = text[pos:start]
        indent = ""
        if sigil and sigil in MUSTACHE_STANDALONE:
            # Standalone: only blanks between the line's start and the tag, and between the tag
            # and the line's end. Scanning the blanks alone keeps parsing linear (T1).
            line_start = start
            while line_start > pos and text[line_start - 1] in " \t":
                line_start -= 1
            line_end = after
            while line_end < n and text[line_end] in " \t\r":
                line_end += 1
            at_line_start = line_start == 0 or text[line_start - 1] == "\n"
            if at_line_start and (line_end == n or text[line_end] == "\n"):
                indent = text[line_start:start]
                before = before[:len(before) - len(indent)]
                after = min(n, line_end + 1)
        if before:
            nodes.append(MText(before))
        pos = after
        if sigil == "!":
            continue
        if sigil == "=":
            open_delim, close_delim = parts
            continue
        if sigil in "#^":
            section = MSection(name, sigil == "^", [])
            nodes.append(section)
            stack.append((name, nodes))
            nodes = section.nodes
        elif sigil == "/":
            if not stack or stack[-1][0] != name:
                raise error(TemplateError, f"MUSTACHE: unexpected closing tag {name!r}", "9.2")
            nodes = stack.pop()[1]
        elif sigil == ">":
            nodes.append(MPartial(name, indent))
        else:
            nodes.append(MVar(name, sigil not in "&{"))
    if stack:
        raise error(TemplateError, f"MUSTACHE: unclosed section {stack[-1][0]!r}", "9.2")
    return root


def mustache_lookup(stack, name):
    """Mustache name resolution: '.' is the top; 'a.b.c' finds 'a' up the stack, then digs."""
    if name == ".":
        top = stack[-1]
        # INTERPRETATION I-226 §9.2, §8.3: '.' at the root is the render's data, without the
        # §8.3 built-in functions (whose text is an address: it would differ from run to run)
        if len(stack) == 1 and isinstance(top, dict):
            return {key: value for key, value in top.items()
                    if not (key in BUILTINS and value is BUILTINS[key])}
        return top
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
        kind = type(node)
        if kind is MText:
            out.append(node.text)
        elif kind is MVar:
            text = mustache_text(mustache_lookup(stack, node.name))
            if node.escaped:
                text = "".join(MUSTACHE_ESCAPES.get(ch, ch) for ch in text)
            out.append(text)
        elif kind is MSection:
            value = mustache_lookup(stack, node.name)
            # INTERPRETATION I-222 §9.2: the Mustache spec leaves falsiness to the host
            # language; Python's is this dialect's: 0, 0.0, {}, [], "", None and False are false.
            falsy = not value
            if node.inverted:
                if falsy:
                    mustache_render_nodes(node.nodes, stack, partials, out, depth)
            elif falsy:
                continue
            elif isinstance(value, (list, tuple)):
                for item in value:
                    tick()
                    mustache_render_nodes(node.nodes, stack + [item], partials, out, depth)
            else:
                mustache_render_nodes(node.nodes, stack + [value], partials, out, depth)
        else:  # MPartial
            tick()   # partials recursing twice per level would take 2**100 steps
            if depth > 100:
                raise error(TemplateError, "MUSTACHE: partials nest deeper than 100", "9.2")
            source = (partials or {}).get(node.name)
            if source is None:
                continue
            if node.indent:  # a standalone partial indents every line it produces
                source = node.indent + re.sub(r"\n(?!$)", "\n" + node.indent, source)
            mustache_render_nodes(mustache_parse(source), stack, partials, out, depth + 1)


@functools.lru_cache(maxsize=4096)
def mustache_compiled(text):
    return mustache_parse(text)


def render_mustache(text, variables, partials=None):
    """§9.2 MUSTACHE: logic-less dialect; `variables` may be any value (the root context)."""
    out = []
    run_limited(mustache_render_nodes, (mustache_compiled(text), [variables], partials, out),
                TEMPLATE_TIME_LIMIT, "MUSTACHE", TemplateError, code=False)
    return "".join(out)


# SIMPLE: `{{ expr }}` through the §13.2.2 sandbox, then str.format-style substitution ---------
# INTERPRETATION I-161 §9.2 (T1, README Security): the two steps run in order, and what
# a {{ }} produced (a message, a context value) is data: its braces are escaped before the format
# pass, and a format field may not reach across it, so a message "what is {api_token}?" prints as
# written. The format pass substitutes only names of the render's variables.
@functools.lru_cache(maxsize=4096)
def simple_parts(text):
    """The template split once into (is_expression, text) parts: literal text and {{ }} bodies."""
    parts, pos = [], 0
    while True:
        start = text.find("{{", pos)
        if start < 0:
            parts.append((False, text[pos:]))
            return tuple(parts)
        end = text.find("}}", start + 2)
        if end < 0:
            raise error(TemplateError, "SIMPLE: '{{' without a closing '}}'", "9.2")
        parts += [(False, text[pos:start]), (True, text[start + 2:end].strip())]
        pos = end + 2


def simple_names(variables):
    """The expressions' variables: the context's data, seen through a ContextView (T2: no
    host-only key is written); the §8.3 callables are left out.

    INTERPRETATION I-136 §9.2 vs §8.11 (new): the expression sees the rendering context's data, but
    its built-ins are the §13.2.2 set alone."""
    return {key: read_only_value(value) for key, value in variables.items()
            if not (key in BUILTINS and value is BUILTINS[key])}


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
                raise error(TemplateError, f"SIMPLE: bad field {{{field}}}", "9.2")
            parts.append(token)
            token = field[i + 1:close]
            i = close
        else:
            token += ch
        i += 1
    parts.append(token)
    if "" in parts:     # a standard format field has no empty name, key or attribute (§9.2)
        raise error(TemplateError, f"SIMPLE: bad field {{{field}}}", "9.2")
    value = variables
    for part in parts:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise error(TemplateError, f"SIMPLE: unknown name {{{field}}} in format substitution",
                        "9.2")
    return value


def simple_format(text, variables):
    """Pass 2: `{name}` fields replaced from the variables; `{{`/`}}` stand for literal braces."""
    out = []
    try:
        pieces = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise error(TemplateError, f"SIMPLE: format substitution: {exc}", "9.2") from exc
    for literal, field, spec, conversion in pieces:
        out.append(literal)
        if field is None:
            continue
        value = simple_field(variables, field)
        spec = simple_format(spec, variables) if spec else ""   # {x:>{width}} nests a field
        if conversion == "r":
            value = repr(value)
        elif conversion in ("s", "a"):
            value = str(value) if conversion == "s" else ascii(value)
        try:
            out.append(format(value, spec))
        except (ValueError, TypeError) as exc:
            raise error(TemplateError, f"SIMPLE: {{{field}}}: {exc}", "9.2") from exc
    return "".join(out)


# INTERPRETATION I-135 §9.2 (Q60 (b), (d); deviation): the {{ }} pass at every phase, the format
# pass at Phase C only, with the Phase C rendering context as the named parameters. At Phases A
# and B a format pass would read every YAML flow mapping (`{a: 1}`) as a field, and §9.2's
# doubling escape (`{{`) is the expression marker itself.
def render_simple(text, variables, partials=None, *, format_pass=True):
    """§9.2 SIMPLE: step 1 evaluates {{ expr }}; step 2 (Phase C only) formats {name} fields over
    step 1's text."""
    return run_limited(_render_simple, (text, variables, format_pass), TEMPLATE_TIME_LIMIT,
                       "SIMPLE", TemplateError, code=False)


def _simple_field_open(literal, inside):
    """Whether a format field is still open at the end of `literal` (str.format's brace grammar,
    from the state `inside`: the open field's brace depth, 0 outside). A lone `}` at the end is
    reported as open too: it would pair with what follows."""
    i, n = 0, len(literal)
    while i < n:
        ch = literal[i]
        if inside:
            inside += 1 if ch == "{" else -1 if ch == "}" else 0
        elif ch in "{}":
            if literal.startswith(ch * 2, i):
                i += 1                  # `{{` / `}}`: an escaped brace
            elif ch == "{":
                inside = 1
            elif i == n - 1:
                return -1               # a lone `}` that a result would complete
        i += 1
    return inside


def _render_simple(text, variables, format_pass):
    out, names, inside = [], None, 0
    for is_expression, part in simple_parts(text):
        if not is_expression:
            out.append(part)
            if format_pass:
                inside = _simple_field_open(part, inside)
            continue
        if inside:
            raise error(TemplateError, "SIMPLE: a format field may not hold a {{ }} result (it is "
                        "data, never template source)", "9.2")
        names = names if names is not None else simple_names(variables)
        try:
            value = eval_expression_text(part, names)
        except ActorError as exc:
            raise error(TemplateError, f"SIMPLE: {{{{ {part} }}}}: {exc.message}", "9.2") from exc
        value = "" if value is None else str(value)
        out.append(value.replace("{", "{{").replace("}", "}}") if format_pass else value)
    text = "".join(out)
    return simple_format(text, variables) if format_pass else text


ENGINES = {"JINJA2": render_jinja2, "MUSTACHE": render_mustache, "SIMPLE": render_simple}


def engine_key(value):
    """§9.2's one name rule: matched case-insensitively; the canonical (upper-case) name, or None
    for a name that is not one of the three. Callers choose the error a bad name gets."""
    name = str(value).upper()
    return name if name in ENGINES else None


def engine_name(engine):
    """§9.2 for render(): default JINJA2; unknown -> TemplateError."""
    name = engine_key(engine or "JINJA2")
    if name is None:
        raise error(TemplateError, f"unknown template_engine {engine!r}: use one of "
                    f"{', '.join(ENGINES)}", "9.2")
    return name


def render(text, variables, engine="JINJA2", partials=None):
    """Render `text` with `variables` in one of the §9.2 dialects (public API).

    MUSTACHE accepts any value as the root context and `partials` ({name: source}); JINJA2 and
    SIMPLE take a mapping. Every failure is a TemplateError.
    """
    handler = ENGINES[engine_name(engine)]
    if handler is render_jinja2 and isinstance(variables, ChainMap):
        return handler(text, variables, partials)       # a view (runtime_variables): read through
    if handler is not render_mustache and not isinstance(variables, dict):
        raise error(TemplateError, "variables must be a mapping for JINJA2 and SIMPLE", "9.2")
    return handler(text, variables, partials)

# §9.3 default_router ----------------------------------------------------------------------
# See §3.4 above (resolve_default_router): the host parameter wins over cleveragents.default_router.

# §9.4 unsafe --------------------------------------------------------------------------------
# INTERPRETATION I-004 §9.4 (Q91, decided): a declaration fails closed. Only an explicit false --
# false, 0, null, an empty value, or the words false/no/off/0 in any case -- leaves unsafe
# undeclared; any other value (`unsafe: enabled`, `unsafe: [x]`) says the Actor needs unsafe mode.
UNSAFE_FALSE_WORDS = ("false", "no", "off", "0", "")


def declares_unsafe(value):
    if isinstance(value, str):
        return value.strip().lower() not in UNSAFE_FALSE_WORDS
    if isinstance(value, (bool, int, float)):
        return bool(value)
    return value is not None and not (isinstance(value, (list, dict)) and not value)


def check_unsafe(doc, host_unsafe):
    """§9.4, §13.1: an Actor that declares unsafe is refused on a safe host."""
    glob = (doc.data.get("context") or {}).get("global") or {}
    if declares_unsafe(glob.get("unsafe")) and not host_unsafe:
        raise doc.error(UnsafeConfigurationError, ("context", "global", "unsafe"),
                        "this Actor requires unsafe mode and the host is in safe mode "
                        "(run with --unsafe / load(unsafe=True))", "9.4, §13.1")


# =====================================================================================
# §10 CONTEXT
# =====================================================================================

# §10.1 The context section --------------------------------------------------------------
CONTEXT_FIELDS = fields_by_name(Field("global", MAPPING, None, "10.1"))


def check_context(doc, rt=None):
    """§10.1, §10.3, §4.4.5, §15.3: context.global is a mapping of user keys."""
    section = doc.data.get("context")
    if section is None:
        return
    if not isinstance(section, dict):
        raise doc.error(ConfigurationError, ("context",), "context must be a mapping", "10.1")
    if rt is not None:      # §10.1 defines context.global only
        check_unknown(rt, section, CONTEXT_FIELDS, ("context",), "10.1", "unknown context "
                      "section '{key}' is ignored (context keys go under context.global)")
    glob = section.get("global")
    if glob is None:
        return
    if not isinstance(glob, dict):
        raise doc.error(ConfigurationError, ("context", "global"),
                        "context.global must be a mapping", "10.1")
    for key in glob:
        path = ("context", "global", key)
        if str(key).startswith("__"):
            raise doc.error(ConfigurationError, path,
                            f"context key '{key}' is reserved (keys starting with __)", "10.3")
        if key in HOST_ONLY_CONTEXT_KEYS:
            raise doc.error(ConfigurationError, path, f"'{key}' is set by the host, never by the "
                            "Actor configuration", HOST_ONLY_CONTEXT_KEYS[key])
        if rt is not None and str(key).startswith("_") and key not in RESERVED_CONTEXT_KEYS:
            rt.warn(f"context key '{key}' starts with _, which is reserved for system keys",
                    section="15.3", path=path)


def build_global_context(doc, host_context, host_unsafe):
    """§10.2 item 1: the live global context, plus the host's invocation-context keys (§10.3)."""
    glob = (doc.data.get("context") or {}).get("global") or {}
    ctx = copy.deepcopy(glob)
    if host_unsafe:
        ctx["_unsafe_mode"] = True
    ctx.update(host_context or {})
    return ctx


# §10.3 Reserved context keys -------------------------------------------------------------
# Keys only the host may set. INTERPRETATION I-005 §10.3 (Q84): declaring them in context.global is
# an error.
HOST_ONLY_CONTEXT_KEYS = {"_temperature_override": "4.4.5, §10.3", "_unsafe_mode": "10.3, §13.3"}
RESERVED_CONTEXT_KEYS = (
    "_temperature_override", "_unsafe_mode", "auto_finish_active", "auto_finish_state",
    "auto_finish_final_stage", "auto_finish_last_output", "graph_state", "conversation_history",
    "full_context", "_history_truncated", "_history_original_length", "next_node", "last_output",
    "last_agent_node", "current_message", "current_node", "current_section_path",
    "current_section_index", "section_paths", "writing_stage", "current_latex_index",
)


# The host-only keys stay the host's, wherever a write comes from (T2, README Security).
# INTERPRETATION I-157 §10.3 vs §4.5.2: the body gets `context` by reference, but the keys the §10.3
# table says the host sets (HOST_ONLY_CONTEXT_KEYS) stay the host's: a write, update or delete of
# one fails when it happens, so no later call can find _unsafe_mode lifted (§4.5.4, §13.3).
# INTERPRETATION I-192 §4.5.2 vs §10.2: one rule at the boundary, in one place: what
# code writes is stored as a copy of data (context_data: the body keeps no alias of what it
# stored), and what it reads is a view (a mapping, ContextView; a list, ContextList) whose writes
# follow the same rule, or else a copy (tuples, sets); a set read from the context is a copy, so
# changing it changes the context only when it is written back.
class ContextView(collections.abc.MutableMapping):
    """A context seen from sandboxed code: reads fall back to `base` (an agent's own context,
    Q79), writes land in `data` (the invocation context) as they happen, host-only keys refused,
    and no write once the call was abandoned (§5.3.4). Cost: independent of the context's size."""

    __slots__ = ("data", "base", "read_only")

    def __init__(self, data, base=None, read_only=False):
        self.data, self.base, self.read_only = data, base, read_only

    def __getitem__(self, key):
        value = self.data[key] if key in self.data or not self.base else self.base[key]
        return read_only_value(value) if self.read_only else context_value(value)

    def __setitem__(self, key, value):
        _check_write(self, key)
        self.data[key] = context_data({key: value}, "configuration code")[key]

    def __delitem__(self, key):
        _check_write(self, key)
        del self.data[key]

    def __iter__(self):
        yield from self.data
        yield from (key for key in self.base or () if key not in self.data)

    def __len__(self):
        return len(self.data) + sum(key not in self.data for key in self.base or ())

    def __contains__(self, key):
        return key in self.data or bool(self.base) and key in self.base

    def __eq__(self, other):
        return plain(self) == plain(other)

    def __repr__(self):
        return repr(plain(self))

    def copy(self):
        return {key: self[key] for key in self}

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


class ContextList(collections.abc.MutableSequence):
    """A list in the context seen from sandboxed code: items read as views, items written stored
    as copies of data (context_data), no write once the call was abandoned (§5.3.4)."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data

    def __getitem__(self, index):
        if type(index) is slice:
            return context_data(self.data[index], "a slice")
        return context_value(self.data[index])

    def __setitem__(self, index, value):
        check_not_abandoned("inline code")
        value = list(value) if type(index) is slice else value
        self.data[index] = context_data(value, "configuration code")

    def __delitem__(self, index):
        check_not_abandoned("inline code")
        del self.data[index]

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        return map(context_value, self.data)

    def __contains__(self, value):
        return plain(value) in self.data

    def __eq__(self, other):
        return self.data == plain(other)

    def __repr__(self):
        return repr(self.data)

    def __add__(self, other):
        return list(self) + other

    def __radd__(self, other):
        return other + list(self)

    def insert(self, index, value):
        check_not_abandoned("inline code")
        self.data.insert(index, context_data(value, "configuration code"))

    def sort(self, *, key=None, reverse=False):
        check_not_abandoned("inline code")
        self.data.sort(key=key and (lambda item: key(context_value(item))), reverse=reverse)

    def reverse(self):
        check_not_abandoned("inline code")
        self.data.reverse()

    def copy(self):
        return list(self)


def context_value(value):
    """What sandboxed code reads from the context (I-192): a view of a mapping or list, a copy
    of a tuple or set, any other value as it is."""
    kind = type(value)
    if kind is dict:
        return ContextView(value)
    if kind is list:
        return ContextList(value)
    return context_data(value, "a context value") if kind in (tuple, set, frozenset) else value


def context_data(value, where, memo=None):
    """What a write stores (T2, I-192): a copy of `value` made of CONTEXT_DATA_TYPES only, views
    unwrapped, aliases and cycles kept, host-only keys refused (refuse_host_keys' rule), in one
    walk; anything else is an ExecutionError naming `where`."""
    kind = type(value)
    if kind is ContextView or kind is ContextList:
        value = plain(value)
        kind = type(value)
    if kind not in CONTEXT_DATA_TYPES:
        raise error(ExecutionError, f"{where} may store only data in the context, not a "
                    f"{kind.__name__}", "10.2, §13.2")
    if kind not in (dict, list, tuple, set, frozenset):
        return value
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if kind is dict:
        bad = [key for key in HOST_ONLY_CONTEXT_KEYS if key in value]
        if bad:
            raise error(ExecutionError, f"{where} may not set '{bad[0]}': the host sets it",
                        HOST_ONLY_CONTEXT_KEYS[bad[0]])
        memo[id(value)] = copied = {}
        for key, item in value.items():
            copied[context_data(key, where, memo)] = context_data(item, where, memo)
        return copied
    if kind is list:
        memo[id(value)] = copied = []
        copied.extend(context_data(item, where, memo) for item in value)
        return copied
    memo[id(value)] = copied = kind(context_data(item, where, memo) for item in value)
    return copied


def read_only_value(value):
    """What a template reads (I-160): a mapping through a read-only view, any other container as
    a copy, so no method of it (list.append, a listed dict's update) reaches the context."""
    if type(value) is dict:
        return ContextView(value, None, True)
    if type(value) in (list, set, tuple):
        try:
            return copy.deepcopy(value)
        except (TypeError, RecursionError):    # a generator inside, or nesting past the stack
            return tuple(value)
    return value


def _check_write(view, key):
    if view.read_only:       # INTERPRETATION I-160 §8.11 (new: templates are read-only)
        raise error(ExecutionError, "a template may not change the context", "8.11")
    if isinstance(key, str) and key.startswith("__"):     # as in the document (§10.3, §15.4)
        raise error(ExecutionError, f"context key '{key}' is reserved (keys starting with __)",
                    "10.3, §15.4")
    refuse_host_keys({key: None}, "configuration code")          # a delete as well
    check_not_abandoned("inline code")


# What sandboxed code may store in the context: data, nested in data (T2, README Security). A
# function, generator, built-in or module would outlive the call that made it: the host would
# meet it later (copying state for time travel, a template calling it) outside any budget.
CONTEXT_DATA_TYPES = frozenset((type(None), bool, int, float, str, list, tuple, dict, set,
                                frozenset))


def plain(value, memo=None):
    """`value` with every ContextView replaced by a plain dict (the host never sees a view)."""
    if type(value) is ContextView:
        if not value.base:
            return value.data
        return {**value.base, **value.data}
    if type(value) is ContextList:
        return value.data
    if type(value) not in (list, tuple, dict):
        return value
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value
    if type(value) is dict:
        items = [(key, plain(item, memo)) for key, item in value.items()]
        if any(item is not value[key] for key, item in items):
            memo[id(value)] = value = dict(items)
        return value
    items = [plain(item, memo) for item in value]
    if any(new is not old for new, old in zip(items, value)):
        memo[id(value)] = value = type(value)(items)
    return value


def refuse_host_keys(mapping, where):
    """The same rule for every other writer of context or graph metadata (set_state,
    state_update, §6.9's write-back): the host-only keys are the host's (T2). Sandboxed code's
    writes follow context_data, which applies this rule in its copying walk."""
    stack, seen = [mapping], set()
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind not in (dict, list, tuple, set, frozenset) or id(value) in seen:
            continue
        seen.add(id(value))
        if kind is dict:
            bad = [key for key in HOST_ONLY_CONTEXT_KEYS if key in value]
            if bad:
                raise error(ExecutionError, f"{where} may not set '{bad[0]}': the host sets it",
                            HOST_ONLY_CONTEXT_KEYS[bad[0]])
            stack.extend(value.values())
        else:
            stack.extend(value)


# §10.4 The prompts section ---------------------------------------------------------------
def collect_prompts(doc):
    """§10.4: name -> template text, long form only.

    INTERPRETATION I-006 §10.4 vs §16.2 (Q4): a plain string (the short form) is rejected; any other
    value without a `content` key is skipped silently.
    """
    prompts = {}
    section = doc.data.get("prompts")
    if section is None:
        return prompts
    if not isinstance(section, dict):
        raise doc.error(ConfigurationError, ("prompts",), "prompts must be a mapping", "10.4")
    for name, value in section.items():
        if isinstance(value, str):
            raise doc.error(ConfigurationError, ("prompts", name),
                            "short-form prompt templates are forbidden; write {content: ...}",
                            "16.2, §10.4")
        text = prompt_content(value)
        if text is not None:
            prompts[name] = text
    return prompts


def prompt_content(value):
    """§10.4: the template text of one prompts entry, or None when the entry does not conform (it
    is then skipped): a mapping whose `content` is text. A number or boolean there is written as
    text; null, a list or a mapping is no template at all."""
    if not isinstance(value, dict):
        return None
    content = value.get("content")
    if content is None or isinstance(content, (dict, list)):
        return None
    return content if isinstance(content, str) else str(content)


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
    check_context(doc, rt)
    check_unsafe(doc, rt.unsafe)        # the host's mode decides before any part is looked at
    for name, cfg in doc.data["agents"].items():
        check_agent(rt, name, cfg, ("agents", name))
        check_agent_name_style(rt, name, ("agents", name))
        check_unknown(rt, cfg, AGENT_FIELDS, ("agents", name), "4.1")
    check_composite_self_reference(doc)
    collect_prompts(doc)
    check_reserved_template_keys(doc)
    check_reserved_stream_references(doc)
    known = check_routes(doc, rt, agent_names)
    check_merges_and_splits(doc, rt, known)
    check_pipelines(doc, rt)
    graph_names = {n for n, r in doc.data["routes"].items() if r["type"] == "graph"}
    check_streams(rt, agent_names, graph_names,
                  default=host_parameter(doc, "default_router", host_default_router)[0])
    router = resolve_default_router(doc, rt, host_default_router)
    warn_without_output(rt, known, router)
    warn_conditions_at_load(rt)
    check_providers(rt, doc.data["agents"])     # §12.1: creation failures come after the rules
    return router


# §11.2 Agent validation -----------------------------------------------------------------
# check_agent (§4.1) rejects unregistered types and reserved names; the AGENT_TYPES table (§4.3)
# is the registry. Phase B has already replaced template/agent_template instances.

# §11.3 Route validation -----------------------------------------------------------------
ROUTE_TYPES = ("stream", "graph", "bridge")
# Fields each route type defines (§5.3, §6.1, §5.6): anything else is warned about, never dropped
# silently.
# The graph route: §6.1's table, and publications (I-085); the bridge route: §5.6's, with the
# type and the two expressions.
GRAPH_ROUTE_FIELDS = fields_by_name(*GRAPH_FIELDS.values(), *read_elsewhere("5.5", "publications"))
BRIDGE_ROUTE_FIELDS = fields_by_name(
    *read_elsewhere("5.6", "type", "state_extractor", "state_flattener"), *BRIDGE_FIELDS.values())
ROUTE_FIELDS = {"stream": STREAM_ROUTE_FIELDS, "graph": GRAPH_ROUTE_FIELDS,
                "bridge": BRIDGE_ROUTE_FIELDS}
ROUTE_SECTIONS = {"stream": "5.3", "graph": "6.1", "bridge": "5.6"}
# The §4.1 fields of an agent (check_agent reads them; Phase B has replaced the template forms).
AGENT_FIELDS = fields_by_name(*read_elsewhere("4.1", "type", "config"),
                              *read_elsewhere("4.8", "template", "agent_template", "params"))
# The fields of §7.1 and §7.2. A merge or split without them is refused at the merge or split
# itself (§11.4), before the rows are read; names and conditions are then checked against the
# document.
MERGE_FIELDS = fields_by_name(
    Field("sources", SEQUENCE, REQUIRED, "7.1"),
    Field("target",  STRING,   REQUIRED, "7.1"),
)
SPLIT_FIELDS = fields_by_name(
    Field("source",  ANY,     REQUIRED, "11.4, §7.2"),
    Field("targets", MAPPING, None,     "7.2"),
)


def stream_names(doc):
    """Names a subscription, publication, merge or split may use.

    INTERPRETATION I-007 §5.5 vs §11.4 (Q26): every merge and split target counts as known, since
    merges and splits create their missing targets.
    """
    names = set(doc.data["routes"]) | set(RESERVED_STREAM_NAMES)
    for merge in as_list(doc.data.get("merges")):
        if isinstance(merge, dict) and isinstance(merge.get("target"), str):
            names.add(merge["target"])
    for split in as_list(doc.data.get("splits")):
        if isinstance(split, dict) and isinstance(split.get("targets"), dict):
            names.update(split["targets"])
    return names


def as_list(value):
    """A sequence section as a list, [] for anything else (its own check reports the type)."""
    return value if isinstance(value, list) else []


def is_known(name, known):
    """Membership for names taken from a document: only strings can name anything."""
    return isinstance(name, str) and name in known


def check_routes(doc, rt, agent_names):
    """§5.1, §11.3, §15.4: every route typed, its references known. Normalises `type` to lower
    case."""
    routes = doc.data["routes"]
    known = stream_names(doc)
    for name, route in routes.items():
        path = ("routes", name)
        if str(name).startswith("__"):
            raise doc.error(ConfigurationError, path,
                            f"route name '{name}' is reserved (names starting with __)",
                            "15.4, §5.1")
        if not isinstance(route, dict):
            raise doc.error(ConfigurationError, path, "a route must be a mapping", "5.1")
        if "type" not in route:
            raise doc.error(ConfigurationError, path, "route has no type", "11.3, §5.1")
        kind = str(route["type"]).lower()
        if kind not in ROUTE_TYPES:
            raise doc.error(ConfigurationError, path + ("type",), f"route type '{route['type']}' "
                            "is not one of stream, graph, bridge", "11.3")
        route["type"] = kind
        check_unknown(rt, route, ROUTE_FIELDS[kind], path, ROUTE_SECTIONS[kind])
        # Stream routes name other streams in subscriptions and publications, graph routes in
        # publications (§5.5); stream routes also list agents.
        linked = {"stream": ("subscriptions", "publications"), "graph": ("publications",)}.get(
            kind, ())
        for field in linked + (("agents",) if kind == "stream" else ()):
            value = route.get(field)
            if value is not None and not isinstance(value, list):
                raise doc.error(ConfigurationError, path + (field,), "must be a sequence",
                                "5.3" if kind == "stream" else "5.5")
        for field in linked:
            for i, target in enumerate(route.get(field) or []):
                if not is_known(target, known):
                    raise doc.error(ConfigurationError, path + (field, i),
                                    f"'{target}' is not a known route or built-in stream",
                                    "11.3, §5.5")
        if kind == "stream":
            for i, agent in enumerate(route.get("agents") or []):
                if not is_known(agent, agent_names):
                    raise doc.error(ConfigurationError, path + ("agents", i),
                                    f"agent '{agent}' is not defined in agents", "11.3")
        elif kind == "graph":
            check_graph(rt, name, route, path, agent_names)
    return known


def check_streams(rt, agent_names, graph_names, default=None):
    """§5, §7, §12.6 static checks of the stream side of rt.doc, before any agent exists (§1.3(2)).

    Raises a located StreamRoutingError for operator errors (an unknown operator type, a
    transform with neither fn nor type, a stream cycle) and a located ConfigurationError for
    every other malformed field; warns through rt (unknown operator keys). The structure of
    routes, merges and splits (§11.3, §11.4) is checked by the validator first. `default`: the
    default router messages enter by (§3.4), whose feed the cycle check follows.
    """
    doc = rt.doc
    data = doc.data
    routes = data["routes"]
    pipelines = data.get("pipelines") if isinstance(data.get("pipelines"), dict) else {}
    known = stream_names(doc) | set(pipelines)
    checker = _Checker(doc, set(agent_names), set(graph_names), known, routes, rt)
    for name, cfg in routes.items():
        path = ("routes", name)
        kind = route_type(cfg)
        if kind == "stream":
            checker.stream_route(cfg, path)
        elif kind == "bridge":
            check_bridge(doc, cfg, path, rt)
        elif kind == "graph" and isinstance(cfg.get("bridge"), dict):
            check_bridge(doc, cfg["bridge"], path + ("bridge",), rt)     # §5.6: embedded in place
    check_pipeline_stages(doc, pipelines, routes, checker)
    bridges = {name for name, cfg in routes.items() if route_type(cfg) == "bridge"}
    for source, target, path in stream_edges(data, known, default):
        if "operators" not in path and (source in bridges or target in bridges):
            rt.warn(f"{source if source in bridges else target!r} carries no messages here "
                    "(a bridge route); link ignored", section="5.5", path=path)
    edges = [edge for edge in stream_edges(data, known, default)
             if isinstance(edge[0], str) and isinstance(edge[1], str)
             and not bounded_by_take(routes, edge[0], edge[2])]
    cycle = find_stream_cycle(edges)
    if cycle:
        raise doc.error(StreamRoutingError, cycle[1],
                        "stream cycle " + " -> ".join(cycle[0]) + " loops without bound", "12.6")


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
        check_unknown(rt, merge, MERGE_FIELDS, path, "7.1")
        if merge.get("target") is None:
            raise doc.error(ConfigurationError, path, "merge has no target", "11.4, §7.1")
        if merge.get("sources") is None:
            raise doc.error(ConfigurationError, path, "merge has no sources (a sequence of "
                            "stream names; an empty one is ignored)", "7.1")
        check_fields(doc, merge, MERGE_FIELDS, path)
        for j, source in enumerate(merge["sources"]):
            if not is_known(source, known):
                raise doc.error(ConfigurationError, path + ("sources", j),
                                f"merge source '{source}' is not a known route or stream", "11.4")
    for i, split in enumerate(doc.data.get("splits") or []):
        path = ("splits", i)
        if not isinstance(split, dict):
            raise doc.error(ConfigurationError, path, "a split must be a mapping", "7.2")
        check_unknown(rt, split, SPLIT_FIELDS, path, "7.2")
        if split.get("source") is None:
            raise doc.error(ConfigurationError, path, "split has no source", "11.4, §7.2")
        check_fields(doc, split, SPLIT_FIELDS, path)
        if not is_known(split["source"], known):
            raise doc.error(ConfigurationError, path + ("source",),
                            f"split source '{split['source']}' is not a known route or stream",
                            "11.4")
        for target, cond in (split.get("targets") or {}).items():
            if cond is not None and not isinstance(cond, dict):
                raise doc.error(ConfigurationError, path + ("targets", target),
                                "a split target's condition must be a mapping with a `type` "
                                "(or empty)", "7.2, §5.4")
            wrong = condition_shape_error(cond) if cond is not None else None
            if wrong is not None:
                raise doc.error(ConfigurationError, path + ("targets", target, wrong[0]),
                                wrong[1], "7.2, §5.4")


# §11.5 Pipeline validation --------------------------------------------------------------
# The names a §7.3 stage may give (its type is checked first; an inline graph's `config` is a
# graph route, checked by check_graph; a stream stage's operators by the operator checker).
PIPELINE_STAGE_FIELDS = fields_by_name(
    Field("name",  STRING, None, "7.3"),
    Field("graph", STRING, None, "7.3"),
)
# The fields a §7.3 pipeline and its stages may carry (a stream stage is a stream route, §5.3; a
# graph stage names or holds a graph and its links); any other key is warned, never dropped
# silently.
PIPELINE_FIELDS = fields_by_name(Field("stages", SEQUENCE, REQUIRED, "7.3"),
                                 *read_elsewhere("7.3", "metadata", "description"))
PIPELINE_GRAPH_STAGE_FIELDS = fields_by_name(
    *read_elsewhere("7.3", "config", "input_from", "output_to", "description"))
PIPELINE_STAGE_KNOWN = (PIPELINE_STAGE_FIELDS, STREAM_ROUTE_FIELDS, PIPELINE_GRAPH_STAGE_FIELDS)

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
        check_unknown(rt, pipeline, PIPELINE_FIELDS, ("pipelines", pname), "7.3",
                      "unknown pipeline key {key!r} ignored")
        for i, stage in enumerate(stages):
            path = ("pipelines", pname, "stages", i)
            if not isinstance(stage, dict) or str(stage.get("type", "")).lower() not in (
                    "stream", "graph"):
                raise doc.error(ConfigurationError, path,
                                "a stage is a mapping with type stream or graph", "7.3")
            kind, name = str(stage["type"]).lower(), stage.get("name")
            check_fields(doc, stage, PIPELINE_STAGE_FIELDS, path)
            check_unknown(rt, stage, PIPELINE_STAGE_KNOWN, path, "7.3",
                          "unknown pipeline stage key {key!r} ignored")
            if kind == "graph" and "config" not in stage:
                ref = stage.get("graph", name)
                if not is_known(ref, routes) or (routes[ref] or {}).get("type") != "graph":
                    rt.warn(f"graph stage refers to '{ref}', which is not a graph route",
                            section="11.5", path=path)
            if kind == "stream" and is_known(name, routes):
                rt.warn(f"stream stage '{name}' has the name of an existing route",
                        section="11.5", path=path)


# §11.6 Environment variable validation ------------------------------------------------
# A required ${VAR} that is unset fails in interpolate_env (§14.2) with a ConfigurationError.


# =====================================================================================
# §12 RUNTIME BEHAVIOR
# =====================================================================================

# §12.1 Lifecycle --------------------------------------------------------------------------
# Reading the files is the host's: read_sources, in HOST -- load / Actor / render.


def parse_source(raw, file, render_context, engine, sandbox=None):
    """§3.1 and §8.2: one document's text -> (data, marks, RenderedLines or None), through
    Phase A when it is templated."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(ConfigurationError, f"document is not UTF-8: {exc}", "3.1",
                        file=file) from None
    if not isinstance(raw, str):
        raise error(ConfigurationError, f"document text must be a string, not {type(raw).__name__}",
                    "3.1", file=file)
    refuse_lone_surrogate(raw, file)        # before Phase A, which could drop it unseen
    check_sentinels(raw, file)
    if not has_template_syntax(raw):
        return (*parse_yaml(raw, file), None)
    try:
        rendered = render_document(raw, render_context, engine, file=file, sandbox=sandbox)
    except RecursionError:      # Phase A reads the YAML shape of the text to protect fields
        raise error(ConfigurationError, "document nests too deeply", "3.1", file=file) from None
    lines = RenderedLines(raw, rendered) if rendered != raw else None
    try:
        data, marks = parse_yaml(rendered, file)
    except ConfigurationError as exc:       # located in the rendered text: name the raw line
        if lines is not None and exc.line is not None:
            exc.line, exc.col = lines.origin(exc.line, exc.col)
        raise
    return restore_sentinels(data), marks, lines


def note_phase_a_reads(rt, raw, file, render_context, engine):
    """Issue 16: the names a JINJA2 Phase A reads go to rt.phase_a_reads (the CLI warns of a
    --set key none reads), and a loop over a name the render context does not define (an empty
    loop, Q50 (c)) is warned. Runtime fields are left out, as Phase A leaves them alone."""
    try:
        raw = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if engine != "JINJA2" or not isinstance(raw, str) or not has_template_syntax(raw):
            return
        text = protect_runtime_fields(restore_markers(raw), render_context, file=file,
                                      engine=engine)
        jinja = jinja2_module()
        tree = jinja_environment().parse(text)
        # (code generation checks filter and test names: `{{ x | nosuch }}` fails here)
        unread = jinja.meta.find_undeclared_variables(tree) - set(jinja_environment().globals)
    except Exception:           # parse_source reports what does not parse or render, located
        return
    rt.phase_a_reads.update(unread)
    for loop in tree.find_all(jinja.nodes.For):
        root = loop.iter
        while isinstance(root, (jinja.nodes.Getattr, jinja.nodes.Getitem, jinja.nodes.Filter)):
            root = root.node                 # (the budget's sb_loop filter wraps every loop)
        if isinstance(root, jinja.nodes.Name) and root.name in unread \
                and root.name not in (render_context or {}):
            rt.warn(f"{file}:{loop.lineno}: Phase A loops over '{root.name}', which the render "
                    f"context does not define: the loop renders nothing", section="8.2, §8.12")


def load_document(sources, render_context, engine, env, rt):
    """§12.1 step 1: parse all files, deep-merge in order (§3.1), interpolate (§14)."""
    data, marks, files, rendered = None, {}, [], {}
    for file, raw in sources:
        note_phase_a_reads(rt, raw, file, render_context, phase_a_engine(raw, engine))
        part, part_marks, lines = parse_source(raw, file, render_context,
                                               phase_a_engine(raw, engine), rt.sandbox)
        files.append(file)
        if lines is not None:
            rendered[file] = lines
        if not isinstance(part, dict):
            kind = "empty" if part is None else type(part).__name__
            where = Doc(part, part_marks, [file], rendered)
            raise where.error(ConfigurationError, (), f"top-level value must be a mapping, not "
                              f"{kind}", "3.1, §11.1")
        if data is None:
            data, marks = part, dict(part_marks)
        else:
            before = copy.deepcopy(data)
            deep_merge(data, part)
            merge_marks(marks, part_marks, before, part)
    doc = Doc(data, marks, files, rendered)
    rt.doc = doc
    doc.data = interpolate_env(doc.data, env, doc, rt)
    return doc


def resolve_engine(doc, host_engine):
    """§9.2: host parameter, else cleveragents.template_engine, else JINJA2 (case-insensitive)."""
    value, path = host_parameter(doc, "template_engine", host_engine)
    value = "JINJA2" if value is None else value
    engine = engine_key(value)
    if engine is None:
        raise doc.error(ConfigurationError, path, f"unknown template_engine '{value}' "
                        f"(JINJA2, MUSTACHE or SIMPLE)", "9.2")
    return engine


def check_host_parameters(render_context, template_engine, context):
    """What the host hands load() is checked before anything is read: the §8.2 rendering context
    and the §10.3 invocation context are mappings, and a host template_engine is one of §9.2's
    three (the document's own choice is checked by resolve_engine)."""
    for value, what, section in ((render_context, "render_context", "8.2"),
                                 (context, "context", "10.3")):
        if value is not None and not isinstance(value, dict):
            raise error(ConfigurationError, f"the host's {what} must be a mapping, not "
                        f"{type(value).__name__}", section)
    if template_engine is not None and engine_key(template_engine) is None:
        raise error(ConfigurationError, f"unknown template_engine '{template_engine}' given by "
                    f"the host (JINJA2, MUSTACHE or SIMPLE)", "9.2")


def start_actor(sources, *, render_context=None, unsafe=False, env=None, template_engine=None,
                default_router=None, provider=None, workdir=None, clock=None, llm_transport=None,
                context=None, routing_prefixes=None, isolation="none", reference=False,
                revise=None):
    """§12.1 steps 1-6 in order; returns a running Actor (step 7). `revise(doc)`, when given,
    may change the parsed document before the checks (the CLI's --check sets aside an entry it
    has already reported, to find the next fault)."""
    rt = Runtime(Doc(None), unsafe=unsafe, env=env, workdir=workdir, clock=clock,
                 provider=provider, llm_transport=llm_transport, reference=reference)
    if isolation not in ISOLATION:
        raise error(ConfigurationError, f"unknown isolation {isolation!r}: use one of "
                    f"{', '.join(map(repr, ISOLATION))}", "13.2")
    rt.sandbox = ISOLATION[isolation]()
    rt.routing_prefixes = tuple(routing_prefixes or ())     # §12.5: host extensions
    check_host_parameters(render_context, template_engine, context)
    doc = load_document(sources, render_context, template_engine, rt.env, rt)
    if revise is not None:
        revise(doc)
    check_top_level(doc, rt)
    rt.engine = resolve_engine(doc, template_engine)
    # Step 2: register templates (Phase B instantiates every template instance, §8.6-§8.10).
    expand_templates(doc, rt)
    router = validate_document(doc, rt, default_router)
    # Steps 3-6: agents, routes, merges/splits, pipelines.
    rt.context = build_global_context(doc, context, rt.unsafe)
    rt.prompts = collect_prompts(doc)
    for name, text in rt.prompts.items():
        warn_unparsable_template(rt, text, ("prompts", name, "content"))
    rt.default_router = router
    for name, cfg in doc.data["agents"].items():
        rt.agents[name] = make_agent(rt, name, cfg, ("agents", name))
    for name, route in doc.data["routes"].items():
        if route["type"] == "graph":
            rt.graphs[name] = GraphRoute(name, route, rt, ("routes", name))
    network = StreamNetwork(rt)
    return Actor(rt, network, router)

# §12.2 Message flow -----------------------------------------------------------------------
# Per §12.2.2: order within a stream holds because every stage is a synchronous call made in
# arrival order, and timers fire in (time, sequence) order. Across fan-out each message reaches
# its targets one at a time, in declaration order of the links.
# INTERPRETATION I-091 §12.2.2 (Q97): fan-out delivers each message to every target, in link
# declaration order, before the next message.

# §12.2.3 Error handling -------------------------------------------------------------------
# Where a failing message goes: the stage that caught the error publishes it on __error__ with
# error_reason / error_category (the _Sink of §5.5 keeps the flow going for the other messages).


def error_reason(exc):
    """The <reason> of "Error: <reason>": the error's own message, never a traceback."""
    if isinstance(exc, ActorError):
        return exc.message
    return str(exc) or type(exc).__name__


def error_category(exc):
    """§12.2.3 metadata.error_type: the §20 category an error carries, else ExecutionError."""
    # INTERPRETATION I-088 §12.2.3, §20 (Q94): agent, tool and expression failures are
    # ExecutionErrors (an §20 error raised by the agent keeps its own category); routing
    # failures are StreamRoutingErrors.
    return exc.category if isinstance(exc, ActorError) else "ExecutionError"


# §12.2.4 Timeouts -------------------------------------------------------------------------
# The 120 s hard timeout of a map's agent call is §5.3.4's (AGENT_HARD_TIMEOUT, BoundedCall); the
# soft per-message bound of single-shot runs is set here and applied by StreamNetwork.settle (§5.5)
# and the agent mappers (§5.3.4).
SOFT_TIMEOUT = 30.0         # seconds
SOFT_TIMEOUT_TEXT = "Per-message completion exceeded the soft timeout"
DEBOUNCE_SINGLE_SHOT_CAP = 0.05     # §5.3.2 debounce in a single-shot run: seconds

# §12.3 Concurrency ------------------------------------------------------------------------
# Pointer banner. Item 1: stream operators run as synchronous calls (§12.2.2 above), which the
# MAY allows. Item 2: parallel graph nodes are §6.7's (GraphRoute's thread pool). Item 3: a bridge
# converts in arrival order (§5.6). Item 4: context writes land as they happen (ContextView, §10.3),
# and sequential siblings see earlier writes (§6.2.2).

# §12.4 Tool command processing in outputs --------------------------------------------------
# INTERPRETATION I-037 §12.4 (Q81): opt-in. Only an llm agent with `tool_execute: true` processes
# blocks, and only for the built-in tools it lists in `tools`; the tools run under the §13 rules of
# the invocation (run_builtin_tool checks host mode and `_unsafe_mode`). `shell` is never offered
# here, since §13.5 ties it to a tool agent's `allow_shell`.
TOOL_EXECUTE_OPEN, TOOL_EXECUTE_CLOSE = "[TOOL_EXECUTE:", "[/TOOL_EXECUTE]"
# INTERPRETATION I-040 §12.4 item 3: one readable text replaces any block that cannot run.
TOOL_EXECUTE_ERROR = "Error executing tool '{name}': {reason}"
TOOL_EXECUTE_EXCLUDED = frozenset({"shell"})

# Characters escaped inside JSON string values by the §12.4 item 2 sanitiser.
_TOOL_PAYLOAD_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
                         "\f": "\\f"}


_NON_BLANK = re.compile(r"\S")    # the sanitiser's look-ahead: str.lstrip()'s blanks, skipped


def check_tool_execute(rt, tools, enabled, cpath):
    """Load-time check of the §12.4 opt-in: `tools` lists built-in tool names; returns the list."""
    if tools is None:
        if enabled:
            raise rt.doc.error(ConfigurationError, cpath + ("tool_execute",),
                               "tool_execute needs a 'tools' list of built-in tool names", "12.4")
        return []
    if not enabled:
        rt.warn("'tools' has no effect without tool_execute: true", section="12.4",
                path=cpath + ("tools",))
    for i, name in enumerate(tools):
        if not isinstance(name, str) or name not in BUILTIN_TOOLS or name in TOOL_EXECUTE_EXCLUDED:
            raise rt.doc.error(ConfigurationError, cpath + ("tools", i),
                               f"{name!r} is not a built-in tool that tool_execute may call",
                               "12.4")
    return list(tools)


def sanitize_tool_payload(text):
    """§12.4 item 2: inside JSON string values, double every backslash and escape raw control
    characters and inner double quotes, so that model-written payloads parse.

    A quote ends a string only when the next non-blank character is `,` `}` `]` `:` or the end.
    One pass, linear in the payload (T1, README Security: the payload is model text, and looking
    at the rest of the text after every inner quote was quadratic): the look-ahead after a quote
    skips only the blanks that follow it, and those runs never overlap.
    """
    # INTERPRETATION I-038 §12.4 item 2: "literal backslashes" are all backslashes inside string
    # values, so `\section` and `\n` (two characters) reach the tool as written, never as escapes.
    out = []
    in_string = False
    for i, ch in enumerate(text):
        if not in_string:
            out.append(ch)
            in_string = ch == '"'
        elif ch == '"':
            after = _NON_BLANK.search(text, i + 1)
            if after is None or after.group() in ",}]:":
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
    blocks = tool_blocks(text)
    results = [_tool_block_result(rt, name, payload, allowed, ctx)       # item 4: last first
               for _, _, name, payload in reversed(blocks)][::-1]
    out, pos = [], 0
    for (start, end, _, _), result in zip(blocks, results):              # item 5, in one pass
        out += [text[pos:start], result]
        pos = end
    return "".join(out) + text[pos:]


# INTERPRETATION I-039 §12.4 item 1: one left-to-right pass; an opening with no
# closing marker after it ends the search.
def tool_blocks(text):
    """§12.4 item 1: (start, end, name, payload) of each block, left to right, in linear time
    (T1, README Security: an LLM reply carries user text, and a regular expression with a lazy
    `.*?` rescanned the rest of the text for every unclosed opening). A block is the opening
    marker, a name without blanks, `]`, blanks, a JSON payload starting with `{`, and the
    first closing marker after it; the payload's trailing blanks are not part of it."""
    blocks, pos = [], 0
    while True:
        start = text.find(TOOL_EXECUTE_OPEN, pos)
        if start < 0:
            return blocks
        name_start = start + len(TOOL_EXECUTE_OPEN)
        name_end = text.find("]", name_start)
        name = text[name_start:name_end] if name_end >= 0 else ""
        brace = name_end + 1
        while brace < len(text) and text[brace].isspace():
            brace += 1
        if not name or any(ch.isspace() for ch in name) or not text.startswith("{", brace):
            pos = start + 1
            continue
        close = text.find(TOOL_EXECUTE_CLOSE, brace)
        if close < 0:
            return blocks                # no later opening can find a closing marker either
        blocks.append((start, close + len(TOOL_EXECUTE_CLOSE), name, text[brace:close].rstrip()))
        pos = close + len(TOOL_EXECUTE_CLOSE)


def _tool_block_result(rt, name, payload, allowed, ctx):
    if name not in allowed:
        return TOOL_EXECUTE_ERROR.format(name=name, reason="the tool is not allowed for this agent")
    # INTERPRETATION I-038 §12.4 items 2-3: a payload that is already valid JSON is run
    # with its parsed parameters ("caf\u00e9" is café); the item 2 repair applies only otherwise.
    # A payload (or a json_parse argument) nested past the parser's depth is an item 3 failure
    # for its own block, never for the whole reply (T1: the reply carries message text).
    try:
        try:
            args = json.loads(payload)
        except json.JSONDecodeError:
            try:
                args = json.loads(sanitize_tool_payload(payload))
            except json.JSONDecodeError as exc:
                return TOOL_EXECUTE_ERROR.format(name=name,
                                                 reason=f"invalid JSON payload ({exc.msg})")
        if not isinstance(args, dict):
            return TOOL_EXECUTE_ERROR.format(name=name, reason="the payload is not a JSON object")
        return run_builtin_tool(rt, name, args, ctx)    # the §4.5.7 string
    except ActorError as exc:
        return TOOL_EXECUTE_ERROR.format(name=name, reason=exc.message)
    except RecursionError:
        return TOOL_EXECUTE_ERROR.format(name=name, reason="JSON nested too deeply")


# §12.5 Routing prefix conventions -------------------------------------------------------
# The §12.5 table: the routing prefixes stripped from content leaving through __output__. An entry
# ending in "_" is a family (GOTO_<TARGET>:); the others are fixed tokens.
# INTERPRETATION I-090 §12.5 (Q96): on __output__ only, one leading listed token is stripped up to
# and including its first colon, with the blanks after it. A host extends the list by setting
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
# INTERPRETATION I-083 §12.6 (Q25, decided): a cycle of static links (publications, merges, splits,
# the default router, switch/bridge-router targets) is rejected at load with a StreamRoutingError
# unless a `take` bounds it: some link of the cycle leaves a stream route after a top-level take
# of that route (bounded_by_take). Such a cycle loads, and a message goes round at most `count`
# times, since the take passes `count` messages in all. Other operators (filters, switches) are
# not proof of a bound. Feedback through __error__ (an error handler that fails) is cut at run
# time by the __error__ sink (see _Sink.push).

def bounded_by_take(routes, source, path):
    """True when every message leaving stream route `source` by the link declared at `path` has
    passed a top-level `take` of that route first (§5.3.2): a publication, merge or split (they
    all read the route's output) after a take anywhere in the operators, a switch or
    bridge-router target after a take that precedes it."""
    cfg = routes.get(source) if isinstance(source, str) else None
    if route_type(cfg) != "stream" or not isinstance(cfg.get("operators"), list):
        return False
    ops = cfg["operators"]
    if path[:3] == ("routes", source, "operators") and len(path) > 3:
        ops = ops[:path[3]]
    elif path[:3] != ("routes", source, "publications") and path[0] not in ("merges", "splits"):
        return False
    return any(isinstance(op, dict) and op.get("type") == "take" for op in ops)


def find_stream_cycle(edges):
    """First cycle among (source, target, path) links: ([names...], path of the closing link)."""
    after = {}
    for source, target, path in edges:
        after.setdefault(source, []).append((target, path))
    state = {}      # name -> 1 while on the DFS stack, 2 when done
    for root in list(after):
        if root in state:
            continue
        # An explicit stack (a document may chain thousands of routes): frames of
        # (name, iterator over its links); `trail` holds the names on the stack, in order.
        state[root] = 1
        stack, trail = [(root, iter(after.get(root, ())))], [root]
        while stack:
            name, links = stack[-1]
            for target, path in links:
                if state.get(target) == 1:
                    return trail[trail.index(target):] + [target], path
                if target not in state:
                    state[target] = 1
                    stack.append((target, iter(after.get(target, ()))))
                    trail.append(target)
                    break
            else:
                state[name] = 2
                stack.pop()
                trail.pop()
    return None


# =====================================================================================
# §13 SECURITY MODEL
# =====================================================================================

# §13.1 Safe and unsafe modes -----------------------------------------------------------
# The host sets the mode (Runtime.unsafe, from load(unsafe=...) or --unsafe); an Actor may only
# declare that it needs unsafe mode (check_unsafe, §9.4). In unsafe mode the invocation context also
# carries _unsafe_mode: true (build_global_context, §10.3) unless the host context says otherwise.

# §13.2 Sandboxed code execution ---------------------------------------------------------
# One sandbox, parameterised by the §13.2.1 (inline code) or the §13.2.2 (expression) table. Each
# guard below answers one line of the threat model written out in README "Security":
#   T1 message senders: content is data -- never code or template source (no guard needed here:
#      nothing in this region parses a message).
#   T2 configuration authors on a safe host: no capability beyond the spec's tables. Answered by
#      the ALLOWLIST, checked once at load: listed syntax nodes only (SANDBOX_SYNTAX), names from
#      the built-in table, the caller's variables or the code's own bindings, attributes only from
#      SANDBOX_METHODS (no type object can be walked, no class pattern can call one), and the
#      host-only context keys refused as they are written (ContextView).
#   T3 resource exhaustion: §4.5's `timeout` bounds a call. The body reaches the BUDGET that
#      enforces it (appendix B.1) through two names: instrument() at compile, run_limited() at
#      call. A single C-level operation on an attacker-built structure (hashing, comparing,
#      printing, long division) cannot be pre-empted in-process -- only isolation="process" (the
#      worker processes of appendix B.2, chosen through ISOLATION) bounds it.
# INTERPRETATION I-153 §13.2: C-level work is not bounded in-process; only
# isolation="process" bounds it.
# The hot path (run_code, ExprUnit.__call__) never parses or compiles, and never scans the context.

SANDBOX_MAX_ITEMS = 10_000_000     # items, characters or bits one operator or range may produce
CODE_FILENAME = "<inline code>"
EXPRESSION_FILENAME = "<inline expression>"


class _Rejected(ConfigurationError):
    """A construct outside the allowlist, before it is located: .message what, .line the line
    inside the code body (None: the first)."""


def _bound_names(tree):
    """Every name the code binds itself (assignment, def, parameter, import, except, match)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.arg)):
            bound.add(node.name if isinstance(node, ast.FunctionDef) else node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return bound


def _check_tree(tree, names):
    """The allowlist (T2): the first construct it does not list, with its line in the body."""
    for node in ast.walk(tree):
        reason = None if isinstance(node, SANDBOX_SYNTAX) \
            else f"the construct '{type(node).__name__}'"
        reason = reason or _shape_refusal(node, names)
        if reason:
            raise error(_Rejected, reason, line=getattr(node, "lineno", 1))


def _sandbox_compile(source, mode, names, filename):
    """Parse, check against the allowlist and add the budget's hooks; SyntaxError or _Rejected.
    `names`: the names code may read (None: any name without a double underscore)."""
    if not isinstance(source, str):
        raise error(_Rejected, f"code of type {type(source).__name__} (a string is required)")
    tree = ast.parse(source, filename=filename, mode=mode)
    bound = _bound_names(tree)
    if "str" in bound:
        raise error(_Rejected, "binding the name 'str' (the sandbox checks what str decodes)")
    if names is not None:
        names = names | bound
    _check_tree(tree, names)
    tree, ticks = instrument(ast.fix_missing_locations(_Imports().visit(tree)))
    return tree, compile(tree, filename, mode, dont_inherit=True), ticks


# The seam to the budget (appendix B.1), which stays active on the reference path as well.
# INTERPRETATION I-190 §13.2 vs §4.5: the reference path (ACTOR_REFERENCE) keeps the
# budget: §4.5's `timeout` is a MUST, and a loop past it must fail on every path.
def instrument(tree):
    """§13.2: the checked tree with the budget's hooks (B.1), and whether it ticks (has a loop,
    comprehension, lambda or function of its own; straight-line code needs no deadline)."""
    tree = ast.fix_missing_locations(_Ticks().visit(tree))
    return tree, _ticks(tree)


def run_limited(fn, args, timeout, label, cls=ExecutionError, code=True):
    """§13.2, §4.5: fn(*args) under one budget of `timeout` seconds (None: no deadline); every
    failure is one located error naming `label` (B.1's run_budgeted)."""
    return run_budgeted(fn, args, timeout, label, cls, code)


class InProcessSandbox:
    """The default: everything in this process, bounded by the budget alone (T3 says what that
    leaves open)."""

    in_process = True

    def run_code(self, unit, variables, timeout, on_progress=None):
        return inline_result(run_code(unit, variables, timeout=timeout))

    def call(self, unit, args, timeout=1.0):
        return unit(*args, timeout=timeout)

    def render(self, text, variables, engine, partials=None, phase="C"):
        if phase in ("A", "B") and engine_name(engine) == "SIMPLE":   # Q60 (b), Q61
            return render_simple(text, variables, format_pass=False)
        return render(text, variables, engine, partials)

    def close(self):
        pass


# INTERPRETATION I-191 §13.2: isolation is the host's choice, made here at load, and
# holds on the reference path too; B.2 adds "process".
ISOLATION = {"none": InProcessSandbox}

# §13.2.1 Restricted built-ins for inline code -------------------------------------------
# The wrapped ones: type and isinstance see a ContextView as the dict it stands for; type() hands
# out only the classes the tables already expose (T2: no type object can be reached otherwise).
SANDBOX_TYPES = {cls: cls for cls in (bool, int, float, str, list, tuple, dict, set, type(None),
                                      ValueError, IndexError, KeyError, TypeError,
                                      json.JSONDecodeError)}


def builtin_type(*args):
    """§13.2.1 type: the one-argument form, for the classes in SANDBOX_TYPES."""
    # INTERPRETATION I-150 §13.2.1: type() inspects; it never creates (three arguments) and never
    # hands out a class the tables do not already expose.
    if len(args) != 1:
        raise error(TypeError, "type() takes exactly one argument in the sandbox")
    cls = type(args[0])
    cls = {ContextView: dict, ContextList: list}.get(cls, cls)
    if cls not in SANDBOX_TYPES:
        raise error(TypeError, f"type() of a {cls.__name__} is not available in the sandbox")
    return SANDBOX_TYPES[cls]


def builtin_isinstance(obj, classinfo):
    """§13.2.1 isinstance; a context view is a dict, a ContextList a list."""
    return isinstance(obj.data if type(obj) in (ContextView, ContextList) else obj, classinfo)


def builtin_locals():
    """§13.2.1 locals: a copy of the caller's variables, without the sandbox's own names. Only
    configuration code is answered: called from a host frame (a JINJA2 prompt's `{{ l() }}`),
    it would hand that frame's objects, an unsandboxed environment among them, out (T2)."""
    frame = sys._getframe(1)
    if frame.f_code.co_filename not in (CODE_FILENAME, EXPRESSION_FILENAME):
        raise error(TypeError, "locals() answers only the inline code that calls it")
    return {key: value for key, value in frame.f_locals.items() if not key.startswith("__")}


def builtin_print(*values, sep=" ", end="\n", **_ignored):
    """§13.2.1 print: diagnostic output to the host's stderr (file= is ignored); a worker
    forwards it to its parent."""
    # INTERPRETATION I-151 §13.2.1: "diagnostic output" is stderr, never the Actor's output.
    sep = sep if isinstance(sep, str) else " "
    end = end if isinstance(end, str) else "\n"
    (getattr(_BUDGET, "printed", None) or sys.stderr).write(sep.join(map(str, values)) + end)


def builtin_range(*args):
    """§13.2.1 range, at most SANDBOX_MAX_ITEMS steps: C-level consumers (sum, list) of a long
    range would never reach a tick (T3)."""
    span = range(*args)
    try:
        spend(len(span), "range")
    except OverflowError:
        spend(sys.maxsize, "range")
    return span


SANDBOX_TYPES[range] = builtin_range


class _StrType(type):
    """§13.2.1 str as the sandbox sees it: str itself to isinstance, attributes and one-argument
    calls; str(bytes, encoding) runs only SANDBOX_CODECS."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, str)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, str)

    def __call__(cls, *args, **kwargs):
        if len(args) > 1 or kwargs:
            sandbox_codec(args[1:], kwargs)
        return str(*args, **kwargs)

    def __getattr__(cls, name):
        return getattr(str, name)


class builtin_str(metaclass=_StrType):
    """§13.2.1 str (see _StrType); type() of a string answers this class."""


SANDBOX_TYPES[str] = builtin_str


def builtin_round(number, ndigits=None):
    """§13.2.1, §13.2.2 round, priced (T3): an integer rounded to -n digits computes 10**n."""
    if type(number) is int and type(ndigits) is int and ndigits < 0:
        spend(-ndigits * 10 // 3, "round()")
    return round(number, ndigits)


def builtin_sum(iterable, /, start=0):
    """§13.2.1, §13.2.2 sum, priced (T3): a list or tuple start sums sequences in linear time,
    at most SANDBOX_MAX_ITEMS items (sum(rows, []) would copy the total at every row)."""
    if type(start) not in (list, tuple):
        return sum(iterable, start)
    items = [item.data if type(item) is ContextList else item for item in iterable]
    spend(len(start) + sum(len(item) for item in items if type(item) is type(start)), "sum()")
    total = list(start)
    for item in items:
        if type(item) is not type(start):
            raise error(TypeError, f'can only concatenate {type(start).__name__} (not '
                        f'"{type(item).__name__}") to {type(start).__name__}')
        total.extend(item)
    return type(start)(total)


class JsonFacility:
    """§4.5.2 item 2: the `json` name -- loads, dumps and JSONDecodeError, nothing else."""

    __slots__ = ()
    JSONDecodeError = json.JSONDecodeError

    @staticmethod
    def loads(text):
        return json.loads(text)

    @staticmethod
    def dumps(value, *, indent=None, sort_keys=False, ensure_ascii=True, separators=None):
        if not (indent is None or isinstance(indent, int) and indent <= 64):
            raise error(ValueError, "json.dumps indent must be a number up to 64 in the sandbox")
        if not (separators is None or isinstance(separators, (list, tuple))
                and all(isinstance(s, str) and len(s) <= 8 for s in separators)):
            raise error(ValueError, "json.dumps separators must be two short strings in the "
                        "sandbox")
        encoder = json.JSONEncoder(indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                                   separators=separators)
        if indent is None:                  # the C encoder, one operation (T3)
            return encoder.encode(plain(value))
        chunks, size = [], 0                # json's Python encoder: priced chunk by chunk (T3)
        for chunk in encoder.iterencode(plain(value)):
            size += len(chunk)
            spend(size, "json.dumps()")
            chunks.append(chunk)
        return "".join(chunks)

    def __repr__(self):
        return "<json facility: loads, dumps, JSONDecodeError>"


SANDBOX_JSON = JsonFacility()


class _Imports(ast.NodeTransformer):
    # INTERPRETATION I-146 §4.5.2 vs §13.2.1 (Q70): `import json [as j]` and `from json import
    # ...` bind the §4.5.2 facility; no import machinery is exposed. `str` is the checked class
    # (I-195) wherever it is read, except a direct call of one argument, which decodes nothing.
    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "str" and not node.keywords \
                and len(node.args) <= 1 and not any(isinstance(a, ast.Starred) for a in node.args):
            node.args = [self.visit(arg) for arg in node.args]
            return node
        return self.generic_visit(node)

    def visit_Name(self, node):
        return ast.copy_location(ast.Name("__sb_str__", ast.Load()), node) \
            if node.id == "str" and isinstance(node.ctx, ast.Load) else node

    def visit_Import(self, node):
        return [ast.copy_location(ast.Assign([ast.Name(a.asname or a.name, ast.Store())],
                                             ast.Name("__sb_json__", ast.Load())), node)
                for a in node.names]

    def visit_ImportFrom(self, node):
        return [ast.copy_location(ast.Assign(
            [ast.Name(a.asname or a.name, ast.Store())],
            ast.Attribute(ast.Name("__sb_json__", ast.Load()), a.name, ast.Load())), node)
            for a in node.names]


SANDBOX_CODECS = ("utf_8", "ascii", "latin_1")      # utf-8, ascii, latin-1 under any alias


# INTERPRETATION I-195 §13.2.3: three codecs, any other fails at the call.
def sandbox_codec(args, kwargs):
    """The codec of encode/decode/str(bytes, enc): one of SANDBOX_CODECS, or a LookupError at
    the call (§13.2.3 lets a capability fail at invocation)."""
    name = (list(args) or [kwargs.get("encoding", "utf-8")])[0]
    if isinstance(name, str):       # as codecs.lookup finds it, importing nothing
        key, aliases = encodings.normalize_encoding(name.lower()), encodings.aliases.aliases
        name = aliases.get(key) or aliases.get(key.replace(".", "_")) or key
    if name not in SANDBOX_CODECS:
        raise error(LookupError, f"the codec {name!r} is not available in the sandbox (utf-8, "
                    f"ascii, latin-1)")
    return True


# The §13.2.1 table: the built-ins of inline code -- these and no others, in the spec's order.
INLINE_CODE_BUILTINS = {
    # Type constructors
    "bool": bool, "dict": dict, "float": float, "int": int, "list": list, "set": set, "str": str,
    "tuple": tuple,
    # Iteration / aggregation
    "abs": abs, "all": all, "any": any, "enumerate": enumerate, "len": len, "max": max,
    "min": min, "range": builtin_range, "reversed": reversed, "round": builtin_round,
    "sorted": sorted, "sum": builtin_sum, "zip": zip,
    # Type inspection
    "isinstance": builtin_isinstance, "type": builtin_type,
    # Local-frame access
    "locals": builtin_locals,
    # Diagnostic output
    "print": builtin_print,
    # Error categories
    "ValueError": ValueError, "IndexError": IndexError, "KeyError": KeyError,
    "TypeError": TypeError,
    # Module access
    "json": SANDBOX_JSON,
}

# §13.2.2 Restricted built-ins for expression evaluation ---------------------------------
# The §13.2.2 table: the built-ins of inline expressions -- these and no others, in the spec's
# order.
EXPRESSION_BUILTINS = {
    # Type constructors
    "bool": bool, "dict": dict, "float": float, "int": int, "list": list, "set": set, "str": str,
    "tuple": tuple,
    # Numeric / iteration utilities
    "abs": abs, "all": all, "any": any, "len": len, "max": max, "min": min,
    "round": builtin_round, "sum": builtin_sum,
}
# The namespace's built-ins: the table's and the json facility an import binds (as for code).
_EXPRESSION_BUILTINS = {**EXPRESSION_BUILTINS, "__sb_json__": SANDBOX_JSON,
                        "__sb_str__": builtin_str}


class ExprUnit:
    """An inline lambda expression checked and compiled once at load (§13.2.2); call it."""

    __slots__ = ("source", "fn", "label", "nparams")

    def __init__(self, source, fn, label, nparams):
        self.source, self.fn, self.label, self.nparams = source, fn, label, nparams

    def __call__(self, *args, timeout=1.0):
        return run_limited(self.fn, args, timeout, self.label)


# INTERPRETATION I-156 §13.2.2: an inline expression is a lambda taking the caller's number of
# positional arguments (transform fn 1, custom_predicate 2), as §5.3.2 describes "a single-argument
# anonymous function", with no default values (they would run at load, outside any worker).
def _lambda_refusal(tree, nparams):
    node = tree.body
    if not isinstance(node, ast.Lambda):
        return f"anything but a lambda of {nparams} parameter(s)"
    args = node.args
    if args.defaults or args.kw_defaults or args.kwonlyargs or args.kwarg \
            or len(args.posonlyargs) + len(args.args) != nparams and args.vararg is None:
        return f"a lambda that is not of exactly {nparams} plain parameter(s)"
    return None


def compile_expression(source, *, nparams=1, rt=None, path=None):
    """§13.2.2: check and compile `lambda ...: expr` once; an ExprUnit, called as unit(*args)."""
    label = f"inline expression {path_str(path)}" if path else "inline expression"
    try:
        text = source.strip() if isinstance(source, str) else source
        tree, code, _ = _sandbox_compile(text, "eval", set(EXPRESSION_BUILTINS),
                                         EXPRESSION_FILENAME)
        reason = _lambda_refusal(tree, nparams)
        if reason:
            raise error(_Rejected, reason)
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, rt, path, "13.2.2", label) from None
    fn = eval(code, {"__builtins__": _EXPRESSION_BUILTINS})   # makes the lambda only
    return ExprUnit(source, fn, label, nparams)


@functools.lru_cache(maxsize=512)   # a pure cache of compiled text; no Actor state lives here
def _compile_expression_text(source):
    return _sandbox_compile(source.strip(), "eval", None, EXPRESSION_FILENAME)[1]


def eval_expression_text(source, names, timeout=1.0):
    """§9.2 SIMPLE pre-pass: a bare expression in the §13.2.2 sandbox, `names` as its variables.

    Refused constructs raise ConfigurationError, run-time failures ExecutionError."""
    try:
        code = _compile_expression_text(source)
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, None, None, "13.2.2", "inline expression") from None
    namespace = {key: value for key, value in names.items() if not str(key).startswith("__")}
    namespace["__builtins__"] = _EXPRESSION_BUILTINS
    return run_limited(eval, (code, namespace), timeout, "inline expression")



# §13.2.3 Prohibited capabilities ---------------------------------------------------------
# No table of prohibitions: I/O, evaluation, introspection, imports and subprocesses are out of
# reach because nothing in the allowlists below (syntax, attributes) or in the tables of the
# two sandboxes leads to them; what they do not list is refused at load (_check_tree).
# INTERPRETATION I-148 §13.2.3 (Q71): what the allowlist does not list is refused at load
# (ConfigurationError with the body line); the budget and type() refuse at invocation
# (ExecutionError, which reaches __error__).

# The allowlist of syntax (T2): what is not here is refused at load. No class, global, nonlocal,
# yield, await, with, except*; see _shape_refusal for the shapes refused within (class patterns
# only of a listed type, with allowlisted attributes).
# INTERPRETATION I-147 §13.2.3: an allowlist checked at load, never a list of dangers.
SANDBOX_SYNTAX = (
    ast.Module, ast.Expression, ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.If,
    ast.For, ast.While, ast.Break, ast.Continue, ast.Pass, ast.Try, ast.ExceptHandler, ast.Raise,
    ast.Assert, ast.FunctionDef, ast.Return, ast.Delete, ast.Import, ast.ImportFrom, ast.alias,
    ast.Match, ast.match_case, ast.MatchValue, ast.MatchSingleton, ast.MatchSequence,
    ast.MatchMapping, ast.MatchStar, ast.MatchAs, ast.MatchOr, ast.MatchClass,
    ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Lambda, ast.IfExp, ast.Dict, ast.Set, ast.ListComp,
    ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Compare, ast.Call, ast.FormattedValue,
    ast.JoinedStr, ast.Constant, ast.Attribute, ast.Subscript, ast.Starred, ast.Name, ast.List,
    ast.Tuple, ast.Slice, ast.NamedExpr, ast.keyword, ast.arguments, ast.arg, ast.comprehension,
    ast.expr_context, ast.operator, ast.boolop, ast.unaryop, ast.cmpop,
)

# The allowlist of attributes (T2): every method of the built-in value types that performs no
# I/O, evaluation, import or introspection, and the json facility's names, read (never assigned).
# No str.format/format_map (a format string walks attributes the AST never shows); encode and
# decode run the three codecs of SANDBOX_CODECS only; nothing yields a type, frame, code or module.
SANDBOX_VALUE_TYPES = (str, bytes, int, float, list, dict, set, tuple)
SANDBOX_METHODS = {
    **{cls.__name__: " ".join(name for name in dir(cls) if not name.startswith("_")
                              and name not in ("format", "format_map"))
       for cls in SANDBOX_VALUE_TYPES},
    "json facility (§4.5.2)": "loads dumps JSONDecodeError",
    "exceptions": "args",
}
SANDBOX_ATTRIBUTES = frozenset(" ".join(SANDBOX_METHODS.values()).split())
SANDBOX_PATTERN_TYPES = ("bool", "dict", "float", "int", "list", "set", "str", "tuple")
JSON_NAMES = ("loads", "dumps", "JSONDecodeError")


def _shape_refusal(node, names):
    """Why an allowed node is refused for its shape or its name (None when it is fine)."""
    match node:
        case ast.Name(id=name) | ast.FunctionDef(name=name) | ast.arg(arg=name) \
                | ast.alias(asname=name) | ast.ExceptHandler(name=name) | ast.MatchAs(name=name) \
                | ast.MatchStar(name=name) | ast.keyword(arg=name) if name and name.startswith("__"):
            return f"the name '{name}' (double-underscore names belong to the sandbox)"
        # INTERPRETATION I-149 §13.2.1: a built-in outside the table is an unknown name, refused at
        # load.
        case ast.Name(id=name, ctx=ast.Load()) if names is not None and name not in names:
            return f"the name '{name}' (not a built-in of this sandbox, an input or a variable " \
                   f"the code sets)"
        # INTERPRETATION I-159 §13.2.3: attribute assignment and deletion are refused at load.
        case ast.Attribute(ctx=ast.Store() | ast.Del()):
            return "assigning or deleting an attribute"
        case ast.Attribute(attr=attr) if attr not in SANDBOX_ATTRIBUTES:
            return f"the attribute '{attr}' (not a method of the built-in value types)"
        # INTERPRETATION I-194 §13.2.3: a class pattern names a type constructor of the
        # table and reads allowlisted, unpriced attributes (`case dict(get=g)`).
        case ast.MatchClass(cls=cls, kwd_attrs=attrs, patterns=patterns) if not (
                isinstance(cls, ast.Name) and cls.id in SANDBOX_PATTERN_TYPES
                and all(a in SANDBOX_ATTRIBUTES and a not in SANDBOX_SIZES for a in attrs)
                and not (cls.id == "str" and patterns)):
            return "a class pattern of anything but a listed type with allowlisted attributes"
        case ast.Import(names=aliases) if any(a.name != "json" for a in aliases):
            return "an import of anything but json"
        case ast.ImportFrom(module=module, level=level, names=aliases) \
                if module != "json" or level or any(a.name not in JSON_NAMES for a in aliases):
            return "an import of anything but json's loads, dumps and JSONDecodeError"
    return None


def _configuration_refusal(exc, rt, path, section, what):
    """A located ConfigurationError for a SyntaxError or _Rejected; `.code_line`: the body line."""
    if isinstance(exc, SyntaxError):
        line, text = exc.lineno or 1, f"syntax error: {exc.msg}"
    else:
        line, text = exc.line or 1, f"{exc.message} is not allowed in the sandbox"
    message = f"{what}, line {line}: {text}"
    if rt is not None and path is not None:
        err = rt.doc.error(ConfigurationError, path, message, section)
    else:
        err = error(ConfigurationError, message, section, path=path or None)
    err.code_line = line
    return err


# The namespace's built-ins: the §13.2.1 table's and the json facility an import binds; B.1 adds
# the budget's hooks (double-underscore names, so sandboxed source never spells them).
_CODE_BUILTINS = {**INLINE_CODE_BUILTINS, "__sb_json__": SANDBOX_JSON, "__sb_str__": builtin_str}


# The entry points of inline code (§4.5.2, §13.2.1); those of expressions are under §13.2.2.
class CodeUnit:
    """An inline-code body checked and compiled once at load (§4.5.2, §13.2.1)."""

    __slots__ = ("source", "code", "label", "ticks", "reaches_context")

    def __init__(self, source, code, label, ticks=True, reaches_context=True):
        self.source, self.code, self.label = source, code, label
        self.ticks, self.reaches_context = ticks, reaches_context


# The variables §4.5.2 item 3 hands to a body, and the names its result falls back to.
CODE_INPUTS = frozenset({"input_data", "message", "context", "result", INLINE_PROGRESS,
                         *INLINE_RESULT_FALLBACKS})


def compile_code(source, *, rt=None, path=None):
    """§13.2, §13.2.1: check and compile an inline-code body once, a CodeUnit. A construct the
    allowlist refuses, or a syntax error, is a located ConfigurationError naming the body's line
    (`err.code_line`)."""
    label = f"inline code {path_str(path)}" if path else "inline code"
    try:
        tree, code, ticks = _sandbox_compile(source, "exec",
                                             INLINE_CODE_BUILTINS.keys() | CODE_INPUTS,
                                             CODE_FILENAME)
    except (SyntaxError, _Rejected) as exc:
        raise _configuration_refusal(exc, rt, path, "13.2.1", label) from None
    loaded = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return CodeUnit(source, code, label, ticks,
                    bool(loaded & {"context", "locals", INLINE_PROGRESS}))


def run_code(unit, variables, *, timeout=1.0):
    """§4.5.2, §13.2.1: run a CodeUnit with `variables` as its namespace; return the final one.

    `variables` usually holds input_data, message, context (by reference: a dict is seen through
    a ContextView) and result=None. Any error or exhaustion raises ExecutionError."""
    namespace = {"__builtins__": _CODE_BUILTINS, **variables}
    if unit.reaches_context and isinstance(namespace.get("context"), dict):
        namespace["context"] = ContextView(namespace["context"])
    run_limited(exec, (unit.code, namespace), timeout if unit.ticks else None, unit.label)
    return namespace


# §13.3 Filesystem boundaries -----------------------------------------------------------
def host_refusal(env, given, op):
    """§13.3: why the host's mode refuses `given` for `op`, or None (the agent layer is §4.5.4)."""
    absolute, traversal, tilde = path_facts(given)
    # INTERPRETATION I-058 §13.3: `~` is refused by both file tools in every mode; home expansion
    # would read the process environment, which the Actor never sees (rt.env is its only
    # environment).
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

    INTERPRETATION I-057 §4.5.4 vs §13.3 (Q69): both layers apply; a path passes only when the
    agent's `safe_mode` rules and the host's mode both allow it.
    """
    if not isinstance(given, str) or not given.strip():
        raise env.error(f"{op} needs a `file` path string", "4.5.1")
    if "\x00" in given:                   # no file system takes one; os calls would raise
        raise env.error(f"{op}: a path may not contain a NUL character: {given!r}", "4.5.1")
    reason = safe_mode_refusal(env, given, op)
    section = "4.5.4"
    if reason is None:
        reason, section = host_refusal(env, given, op), "13.3"
    if reason is not None:
        raise env.error(f"{reason}: {given}", section)
    base = Path(env.rt.workdir).resolve()
    target = Path(given) if path_facts(given)[0] else base / given
    resolved = target.resolve()
    # INTERPRETATION I-058 §4.5.4, §13.3: in safe mode file_read must also stay inside the working
    # directory once symlinks are followed (else a link would undo the `..`/absolute rules).
    # file_write's own outside-the-directory rule is waived by `_unsafe_mode: true`, which
    # file_write always requires, so it never refuses there.
    if op == "file_read" and not env.unsafe_host and not resolved.is_relative_to(base):
        raise env.error(f"file_read rejects paths resolving outside the working directory: "
                       f"{given}", "13.3")
    return resolved

def checkpoint_target(rt, given):
    """The directory a checked checkpoint_dir names, resolved against the working directory."""
    return (Path(given) if path_facts(given)[0] else Path(rt.workdir).resolve() / given).resolve()


def check_checkpoint_dir(rt, given, path):
    """§6.6 checkpoints are files the host writes for the configuration, so §13.3's boundaries
    hold for them as for file_write (T2, README Security): no `~` or `..`, and on a safe host
    no absolute path and nothing that resolves outside the working directory. The directory
    must also be creatable: its nearest existing ancestor is a directory."""
    # INTERPRETATION I-162 §6.6 vs §13.3: checkpoint_dir follows file_write's boundaries,
    # with the host's mode alone deciding (a checkpoint has no invocation context).
    if isinstance(given, str) and "\x00" in given:     # os calls would raise on it
        raise rt.doc.error(ConfigurationError, path, "checkpoint_dir may not contain a NUL "
                           "character", "6.6")
    absolute, traversal, tilde = path_facts(given)
    base = Path(rt.workdir).resolve()
    target = checkpoint_target(rt, given)
    reason = ("`~` (no home-directory expansion)" if tilde else "`..` traversal" if traversal
              else "an absolute path on a safe host" if absolute and not rt.unsafe
              else "a path resolving outside the working directory on a safe host"
              if not rt.unsafe and not target.is_relative_to(base) else None)
    if reason is not None:
        raise rt.doc.error(ConfigurationError, path, f"checkpoint_dir may not be {reason}: {given}",
                           "6.6, §13.3")
    # INTERPRETATION I-170 §6.6: one that cannot be created is refused at load, located.
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise rt.doc.error(ConfigurationError, path, f"cannot create checkpoint_dir: {existing} is "
                           "not a directory", "6.6")

# §13.5 Shell execution --------------------------------------------------------------------
def tool_shell(env, args):
    """§13.5 extension tool `shell`: run a command line in rt.workdir; returns its standard output.

    {tool: shell, args: {command: "ls -1"}} | `shell ls -1`   (needs allow_shell and an unsafe host)
    """
    # INTERPRETATION I-064 §4.5.1, §13.5 (Q68): a `shell` tool exists as an extension (§1.3 MAY),
    # available when `allow_shell: true` and refused unless the host is unsafe; the blocklist
    # is enforced in every mode and for every `safe_mode`, because §13.5 says "always".
    command = tool_rest(args, "command")
    if not isinstance(command, str) or not command.strip():
        raise env.error("shell needs a `command` string", "13.5")
    blocked = [word for word in SHELL_BLOCKLIST if word in command.lower()]
    if blocked:
        raise env.error(f"shell refuses commands containing {', '.join(blocked)}", "4.5.4, 13.5")
    if not env.allow_shell:
        raise env.error("shell execution needs `allow_shell: true` on the tool agent", "13.5")
    if not env.rt.unsafe:
        raise env.error("shell execution needs the host in unsafe mode", "13.5")
    import subprocess           # on first use: start-up pays for none
    try:
        done = subprocess.run(command, shell=True, cwd=str(env.rt.workdir), env=dict(env.rt.env),
                              capture_output=True, text=True, timeout=env.timeout)
    except subprocess.TimeoutExpired:
        raise env.error(f"shell command timed out after {env.timeout} s", "4.5") from None
    except OSError as exc:
        raise env.error(f"shell could not start: {exc}", "13.5") from None
    if done.returncode != 0:
        raise env.error(f"shell command exited with status {done.returncode}: "
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
# INTERPRETATION I-010 §14.1 (Q89, decided): a `${...}` whose name breaks [A-Za-z0-9_]+ is left as
# literal text; mapping keys are not interpolated; `${X:-3}` defaults to "-3". There is no escape:
# `$${NAME}` is a `$` followed by the reference `${NAME}` (§14 defines none).
_ENV_REF = re.compile(r"\$\{([A-Za-z0-9_]+)(?::([^}]*))?\}")


def interpolate_env(data, env, doc, rt):
    """§14.2, §14.4: substitute ${NAME} / ${NAME:default} in every string, exactly once each."""
    return walk_document(data, lambda value, path: interpolate_string(value, env, doc, rt, path))


def interpolate_string(data, env, doc, rt, path):
    """One value of the walk: a string holding ${...} substituted (and coerced, §14.3)."""
    if not isinstance(data, str) or "${" not in data:
        return data
    refs = []

    def substitute(match):
        name, default = match.group(1), match.group(2)
        refs.append(name)
        if default is not None and "${" in default:
            # INTERPRETATION I-221 §14.1, §14.4: a default is literal text up to the first `}`,
            # never a nested reference (each string is interpolated exactly once), so
            # `${A:${B}}` with A unset gives the text `${B}`. Warned, as that is rarely meant.
            rt.warn(f"the default of '${{{name}:...}}' holds '${{': a default is literal text "
                    f"up to the first '}}', so '{match.group(0)}' reads no other variable",
                    section="14.1, §14.4", path=path)
        if name in env:
            return str(env[name])
        if default is not None:
            return default
        raise doc.error(ConfigurationError, path,
                        f"required environment variable '{name}' is not set", "14.2, §11.6")

    result = _ENV_REF.sub(substitute, data)
    if _ENV_REF.fullmatch(data):
        return coerce_env_value(result)
    return result


# §14.3 Type coercion ----------------------------------------------------------------------
# INTERPRETATION I-011 §14.3 (Q90): only a string that was one single reference is coerced.
# INTERPRETATION I-220 §14.3: `\d` is an ASCII digit, as in YAML 1.2's core schema; a fullwidth
# `１２` or an Arabic-Indic digit stays a string (Python's `\d` would take any Unicode digit).
_ENV_INT = re.compile(r"-?[0-9]+")
_ENV_FLOAT = re.compile(r"-?[0-9]+\.[0-9]+")


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
# INTERPRETATION I-008 §15 (Q83): every "MUST NOT be used" of §15 is a ConfigurationError at load.

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
            raise error(ConfigurationError, f"the reserved sentinel {sentinel} appears in the "
                        "document", "15.5", file=file, line=line, col=col)

# §15.6 Internal stream name patterns -----------------------------------------------------
# A user document may name, as a stream, a route, a merge or split target, or one of the
# three streams of §15.1; every other name starting with __ (§15.4) -- the §6.10 per-graph
# streams above all -- is refused wherever a stream is written: subscriptions, publications,
# merge sources and targets, split sources and targets, switch and bridge-router targets, and
# the stream fields of pipeline stages (§7.3).
def check_reserved_stream_references(doc):
    """§15.4, §15.6: no user reference to a reserved (`__`) stream other than §15.1's."""
    data = doc.data

    def check(name, path):
        if isinstance(name, str) and name.startswith("__") and name not in RESERVED_STREAM_NAMES:
            raise doc.error(ConfigurationError, path, f"'{name}' is a reserved internal stream "
                            "name; user configuration must not reference it", "15.6, §15.4")

    for name, route in data["routes"].items():
        if not isinstance(route, dict):
            continue
        for field in ("subscriptions", "publications"):
            for i, target in enumerate(as_list(route.get(field))):
                check(target, ("routes", name, field, i))
        for target, path in _switch_targets(route.get("operators"), ("routes", name, "operators")):
            check(target, path)
    for i, merge in enumerate(as_list(data.get("merges"))):
        if isinstance(merge, dict):
            check(merge.get("target"), ("merges", i, "target"))
            for j, source in enumerate(as_list(merge.get("sources"))):
                check(source, ("merges", i, "sources", j))
    for i, split in enumerate(as_list(data.get("splits"))):
        if isinstance(split, dict):
            check(split.get("source"), ("splits", i, "source"))
            targets = split.get("targets")
            for target in targets if isinstance(targets, dict) else ():
                check(target, ("splits", i, "targets", target))
    pipelines = data.get("pipelines")
    for name, pipeline in pipelines.items() if isinstance(pipelines, dict) else ():
        stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
        for i, stage in enumerate(stages if isinstance(stages, list) else ()):
            if not isinstance(stage, dict):
                continue
            here = ("pipelines", name, "stages", i)
            for field in ("subscriptions", "publications"):
                for j, target in enumerate(as_list(stage.get(field))):
                    check(target, here + (field, j))
            for field in ("input_from", "output_to"):
                check(stage.get(field), here + (field,))


# =====================================================================================
# §16 FORBIDDEN PATTERNS
# =====================================================================================
# Each §16 row: forbidden form -> (its §16 list, the check that enforces it, the vector that pins
# it). Every rule is enforced where its own section's fields are checked; these tables only say
# where, and test_forbidden_forms_table_is_true keeps them true (the check exists, the vector
# exists and is a load_error vector, or a loading one for the two accepted forms).

# §16.1 Forbidden top-level constructs ----------------------------------------------------
FORBIDDEN_TOP_LEVEL = {          # read by check_top_level: section -> what to use instead
    "streams": "use routes with type: stream",
    "graphs": "use routes with type: graph",
}
FORBIDDEN_TOP_LEVEL_ROWS = {
    "top-level streams:": ("16.1", "check_top_level", "03-document/reject-top-level-streams"),
    "top-level graphs:": ("16.1", "check_top_level", "03-document/reject-top-level-graphs"),
    "composite with strategy:": ("16.1", "check_composite",
                                 "04-agents/reject-composite-with-strategy"),
}

# §16.2 Forbidden forms -------------------------------------------------------------------
FORBIDDEN_FORM_ROWS = {
    "dynamic_router node": ("16.2", "check_nodes", "06-graph/reject-dynamic-router-node"),
    "list-form routes": ("16.2", "check_top_level", "03-document/reject-list-form-routes"),
    # INTERPRETATION I-065 §7.3 vs §16.2 (Q1): accepted, so its vector loads.
    "top-level pipelines:": ("16.2", "check_pipelines",
                             "07-composition/pipeline-stages-wired-in-order"),
    "inline expression in map function": ("16.2", "check_streams",
                                          "05-streams/reject-function-inline-expression"),
    "agent_template instances": ("16.2", "expand_templates",
                                 "08-templating/reject-agent-template-key"),
    "sequence-form template parameters": ("16.2", "expand_templates",
                                          "08-templating/reject-parameters-sequence-form"),
    "short-form prompts": ("16.2", "collect_prompts", "10-context/reject-short-form-prompt"),
    "composite routing shorthand": ("16.2", "check_composite",
                                    "04-agents/reject-composite-shorthand-routing"),
    "templates with structural expressions": ("16.2", "expand_templates",
                                              "08-templating/reject-structural-loop-in-templates"),
}

# §16.3 Forbidden field combinations ------------------------------------------------------
FORBIDDEN_COMBINATION_ROWS = {
    "prompt and prompt_reference": ("16.3", "check_chain",
                                    "04-agents/reject-chain-prompt-and-reference"),
    "template and type": ("16.3", "expand_templates", "08-templating/reject-template-and-type"),
    "agent_template and template": ("16.3", "expand_templates",
                                    "08-templating/reject-agent-template-and-template"),
    # INTERPRETATION I-063 §16.3: the inline tool wins (the row's own words), so its vector loads.
    "inline tool named like a built-in": ("16.3", "check_tool_entry",
                                          "04-tools/inline-tool-named-like-builtin-shadows-it"),
    "template_config with route fields": ("16.3", "expand_templates",
                                          "08-templating/reject-route-template-with-operators"),
}
FORBIDDEN_FORMS = {**FORBIDDEN_TOP_LEVEL_ROWS, **FORBIDDEN_FORM_ROWS, **FORBIDDEN_COMBINATION_ROWS}


# === APPENDICES: beyond the standard ===
# Everything above this line is the body: §3-§16 in the standard's order, the reference path --
# the plainest code that does what each section says. Everything below adds what a real host
# needs and the standard leaves open: speed, containment, and the host's own side (providers,
# the load/Actor API, the clock, describe, diagram, the command line). An appendix never changes
# what a configuration means: the body reaches each one through one named seam per concern,
# chosen once at load, and with ACTOR_REFERENCE=1 in the environment (or load(reference=True))
# the speed and containment seams keep the body's own code. The suite runs the vectors both ways
# and requires the same verdicts (test_vectors_reference_path_agrees).
# Each appendix opens with what it adds, which body function it stands in for (`Stands in for:`)
# and the seam it serves (`Seam:`); test_actor.py checks that every seam it names is in the body.

# =====================================================================================
# APPENDIX A -- speed
# =====================================================================================
# Adds: code that is faster than the body's and observably the same (§1.3 MAY 3). Each part
# below names the body function it stands in for and the seam through which the body reaches it;
# with Runtime.reference set, the body never takes the seam.
# Stands in for: the body functions named by A.1-A.4
# Seam: Runtime.reference

# A.1 Checkpoint writer process -----------------------------------------------------------
# Adds: a writer process per graph that encodes and writes the checkpoint files while the graph
# runs on (LangGraph calls this trade "async durability").
# Stands in for: CheckpointFiles
# Seam: checkpoint_store
# The state is captured at the tenth update, on the calling thread, and handed to the writer,
# whose work overlaps the next ten updates. Each file is whole or absent (a temporary file
# renamed); a file is fsynced at most once a second. A crash of the Actor's process loses nothing
# handed over (the writer finishes it and stops at end of input); a crash of the writer loses the
# one checkpoint it was writing; an OS crash may lose the files of the last second. A failed write
# is reported by the next checkpoint; listing, restoring, an explicit checkpoint and close wait
# for the writer. (Measured on the 2-core test VM: the file I/O on the graph's own thread cost
# 0.3 ms a file, milliseconds with an fsync each.)
CHECKPOINT_FSYNC_EVERY = 1.0    # seconds between two fsyncs of checkpoint files
CHECKPOINT_IN_FLIGHT = 8        # checkpoints handed over and not yet answered, at most


# The writer process's whole program (it imports nothing of ours; CHECKPOINT_TEXT_SOURCE goes
# before it). In: frames "<kind> <path bytes> <data bytes> <keep>\n" + path + data, kind "m" for
# a marshalled state, "t" for JSON text. Out:
# one line per frame, "ok" or "error <reason>". It writes the JSON to a temporary file beside the
# path, renames it into place, and deletes the oldest checkpoint files beyond the newest <keep>
# (CHECKPOINT_KEEP, I-181); at end of input it stops.
CHECKPOINT_WRITER_PROGRAM = r"""
import fnmatch, json, marshal, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is for the Actor; end of input stops us
source, answers, durable_at = sys.stdin.buffer, sys.stdout.buffer, 0.0
while True:
    header = source.readline()
    if not header:
        break
    kind, size, length, keep = header.split()
    path, data = os.fsdecode(source.read(int(size))), source.read(int(length))
    folder, temp = os.path.dirname(path), os.path.join(os.path.dirname(path),
                                                       "." + os.path.basename(path) + ".tmp")
    try:
        if kind == b"m":
            data = json.dumps(marshal.loads(data), default=checkpoint_text, ensure_ascii=False)
            data = data.encode("utf-8", "surrogatepass")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if time.monotonic() >= durable_at:
                os.fsync(fd)
                durable_at = time.monotonic() + %r
        finally:
            os.close(fd)
        os.replace(temp, path)
        names = sorted(n for n in os.listdir(folder) if fnmatch.fnmatch(n, "checkpoint_*.json"))
        for name in names[:-int(keep)]:         # the newest `keep` stay (prune_checkpoints)
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass
        answers.write(b"ok\n")
    except Exception as exc:    # one frame fails (a key JSON cannot take, the disk); go on
        answers.write(("error " + str(exc).replace("\n", " ") + "\n").encode())
    answers.flush()
""" % CHECKPOINT_FSYNC_EVERY


class CheckpointWriter:
    """One graph's checkpoint writer: a small child process that writes (path, state) pairs as
    JSON files, whole, in order, one at a time. put() hands over the next at once while fewer
    than CHECKPOINT_IN_FLIGHT are unanswered, else after the oldest is answered: a writer that
    falls behind for a moment (a busy machine takes its core away) does not stop the graph, and
    one that stays behind holds the graph to its pace with at most that many states in the pipe.

    A process, not a thread: a writer thread needs the interpreter lock back after each of its
    system calls and gets it only when the busy graph thread lets go (up to 5 ms later), so its
    writes ran in series with the graph (measured: 2-3.5x the graph without checkpointing). The
    state crosses marshalled (3 us for 50 messages, where the JSON encoder takes 25 us on the
    graph's thread); a state marshal cannot carry is sent as JSON text. The process starts with
    the first checkpoint (start), so that loading a graph starts none."""

    def __init__(self):
        self.proc = None                            # the writer process, from the first put
        self.waiting, self.failure = 0, None       # answers still to read; the first failure
        self._partial = b""                         # the start of an answer not read whole

    def start(self):
        """Start the writer process (once); return it."""
        if self.proc is None:
            import select, subprocess       # on first use: loading pays for neither
            # select() tells whether an answer waits, on POSIX pipes; elsewhere answers are read
            # when one must be (CHECKPOINT_IN_FLIGHT reached, or a wait)
            self._select = select.select if os.name == "posix" else None
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c",
                                          CHECKPOINT_TEXT_SOURCE + CHECKPOINT_WRITER_PROGRAM],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            # A writer never closed (its graph dropped without close()) stops at end of input.
            weakref.finalize(self, CheckpointWriter.stop, self.proc)
        return self.proc

    def put(self, path, state):
        """Hand over the `state` mapping for `path`; the caller may change the state as soon as
        this returns. A write that failed meanwhile is reported here (or by flush)."""
        self.start()
        self._answers(block=False)         # those already given; a failure among them
        while self.waiting >= CHECKPOINT_IN_FLIGHT:
            self._answers(block=True)
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        try:
            kind, data = b"m", marshal.dumps(state)
        except ValueError:      # a type marshal does not know (or a cycle): encode here
            try:
                text = json.dumps(state, default=checkpoint_text, ensure_ascii=False)
            except (TypeError, ValueError) as exc:     # a cycle, a key JSON cannot take
                raise error(ExecutionError, f"the state cannot be written as JSON: {exc}") \
                    from None
            kind, data = b"t", text.encode("utf-8", "surrogatepass")
        name = os.fsencode(path)
        try:
            self.proc.stdin.write(b"%s %d %d %d\n" % (kind, len(name), len(data),
                                                      CHECKPOINT_KEEP) + name + data)
            self.proc.stdin.flush()
        except (OSError, ValueError):       # the writer process is gone
            raise error(OSError, "the checkpoint writer process has stopped") from None
        self.waiting += 1

    def _answers(self, block):
        """Read the answers the writer has given (block: wait for at least one); keep the first
        failure for flush. Read from the pipe's descriptor, so that "is one there?" is a
        select() that no buffered reader hides anything from."""
        fd, ready = self.proc.stdout.fileno(), self._select
        while self.waiting and (block or ready is not None and ready([fd], [], [], 0)[0]):
            block = False
            chunk = os.read(fd, 4096)
            if not chunk:       # the writer is gone: no further answer will come
                self._failed(b"")
                self.waiting = 0
                return
            self._partial += chunk
            *lines, self._partial = self._partial.split(b"\n")
            for line in lines:
                self.waiting -= 1
                if line != b"ok":
                    self._failed(line)

    def _failed(self, answer):
        if self.failure is None:
            self.failure = OSError(answer[len("error "):].decode(errors="replace").strip()
                                   or "the checkpoint writer process has stopped")

    def wait(self):
        """Wait until every write handed over is on disk (a failure is kept for flush)."""
        while self.waiting:
            self._answers(block=True)

    def flush(self):
        self.wait()
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def close(self):
        """Wait for every write, stop the process (a later put starts another); return the
        failure no put or flush has reported yet (or None)."""
        self.wait()
        if self.proc is not None:
            CheckpointWriter.stop(self.proc)
            self.proc = None
        failure, self.failure = self.failure, None
        return failure

    @staticmethod
    def stop(proc):
        """End of input: the writer finishes what it holds and exits."""
        import subprocess       # (imported by start already)
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
            proc.stdout.close()
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()


# A.2 Graph fast path ---------------------------------------------------------------------
# Adds: a stretch of lone unconditional edges walked node after node, with no frontier or result
# lists, and a step of one node that reads auto_finish_active inline and skips the §6.7
# scheduler (measured on the test VM: about 0.2 us a node for the stretch, 0.1-0.2 us for the
# inline read).
# Stands in for: GraphRoute._walk, GraphRoute._step
# Seam: graph_walker
# And time-travel snapshots that cost what changed instead of a deep copy of the metadata each
# (the curve: test_graph_bench_time_travel_snapshot_cost_against_state_size).
# Stands in for: History
# Seam: snapshot_history
# And a §6.9 write-back of the keys a run changed instead of every metadata key, and a run's
# GraphRun whose metadata copy is made only when it is read or the run is still held when the
# state next changes (the curve: test_graph_bench_write_back_cost_against_untouched_keys).
# Stands in for: replace_active_context, snapshot_state
# Seam: run_ending


# Keys every node update may set (GraphRoute._finish) or every run's start changes (begin_run).
RUN_KEYS = ("current_node", "current_message", "last_output", "next_node")
# Nodes whose code or host callables get the metadata's values by reference and so may change a
# nested value in place (an agent's §6.2.2 context; a conditional node's custom condition).
EXPOSING_NODE_TYPES = frozenset({"agent", "conditional"})
_GONE = object()                        # in a snapshot's changes: the key was removed


def frozen(value):
    """A value a snapshot may keep: text, numbers, booleans and None as they are (nothing can
    change them), anything else deep-copied, so that no later in-place change reaches it."""
    return value if value is None or type(value) in (str, int, float, bool) else \
        copy.deepcopy(value)


class Snapshots(list):
    """History, faster: the current state and up to MAX_SNAPSHOTS before it, oldest first. A
    snapshot costs what changed: the oldest holds its whole metadata, each later one only the
    keys that changed since the one before (frozen copies; the live context is left out). The
    keys a node update may have changed are its result's, RUN_KEYS, and -- after a node that saw
    the metadata's values by reference (EXPOSING_NODE_TYPES) or ran beside one (parallel), and
    at the first update after the graph's lock is taken from outside (a stream or the host may
    have changed a container in place) -- every key whose value is a container. Writes to
    graph.state from outside the graph's own API are not seen."""

    # Each entry: {messages, current_node, execution_count, error, changes}, the oldest also
    # {metadata}.
    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self):
        """Forget every snapshot (the state was replaced whole)."""
        super().clear()
        self.keys = set()       # the metadata keys of the newest snapshot
        self.containers = set()     # those of them whose value is no text, number or None
        self.everything = True  # the next snapshot compares every key (first one, a restore)
        self.outside = False    # the next snapshot compares the containers too

    def between_calls(self):
        """The graph's lock was taken from outside (RunLock): since the last update, a stream or
        the host may have changed a container the metadata shares in place."""
        self.outside = True

    def changed_whole(self):
        """The state was replaced whole (a restore): the next snapshot compares every key."""
        self.everything = True

    def keep(self, state, node=None, result=None):
        """Snapshot `state` after one update (of `node`, giving `result`; None: anything)."""
        metadata = state["metadata"]
        if self.everything or result is None:
            keys = self.keys | metadata.keys()
        else:
            keys = set(RUN_KEYS)
            keys.update(result.metadata or ())
            keys.update(result.removed or ())
            keys.update(result.set_state or ())
            if self.outside or node is not None and (node.parallel
                                                     or node.type in EXPOSING_NODE_TYPES):
                keys |= self.containers     # a parallel sibling may have changed one in place
        keys.discard("context")
        if self.everything or result is None:
            tail = [key for key in metadata if key != "context"]    # every key, in its place
        else:
            # the keys this update (re)inserted sit at the metadata's end, in order: read back
            # from there while they are keys it may have changed (the live context aside)
            tail = []
            for key in reversed(metadata):
                if key in keys:
                    tail.append(key)
                elif key != "context":
                    break
            tail.reverse()
        changes = {}
        for key in keys:
            if key in metadata:
                value = changes[key] = frozen(metadata[key])
                self.keys.add(key)
                if value is metadata[key] or value is None:
                    self.containers.discard(key)
                else:
                    self.containers.add(key)
            elif key in self.keys:
                changes[key] = _GONE
                self.keys.discard(key)
                self.containers.discard(key)
        record = {"messages": list(state["messages"]), "current_node": state["current_node"],
                  "execution_count": state["execution_count"], "error": state["error"],
                  "changes": changes, "tail": tail}
        if not self:
            record["metadata"] = apply_changes({}, record)
        self.append(record)
        self.everything = self.outside = False
        if len(self) > MAX_SNAPSHOTS + 1:   # the current state and 100 before it
            oldest = self.pop(0)            # §6.6: first in, first out
            self[0]["metadata"] = apply_changes(oldest["metadata"], self[0])

    def rewind(self, steps):
        """Drop the newest `steps` snapshots; return the state the newest left holds, its own
        copy (nothing shared with a snapshot)."""
        del self[len(self) - steps:]
        metadata = dict(self[0]["metadata"])
        for record in self[1:]:
            apply_changes(metadata, record)
        metadata = {key: frozen(value) for key, value in metadata.items()}
        self.keys = set(metadata)
        self.containers = {key for key, value in metadata.items()
                           if value is not None and type(value) not in (str, int, float, bool)}
        return copy_state(self[-1], metadata)


def apply_changes(metadata, record):
    """`metadata` (a snapshot's) made the next one's by its record: changed keys set, removed ones
    dropped, and the keys its update (re)inserted moved to the end in their order, as the live
    metadata holds them. Returns `metadata`."""
    tail = record["tail"]
    moved = set(tail)
    for key, value in record["changes"].items():
        if value is _GONE:
            metadata.pop(key, None)
        elif key not in moved:
            metadata[key] = value
    for key in tail:
        metadata.pop(key, None)
        metadata[key] = record["changes"][key]
    return metadata


def dict_version_reader():
    """A function giving a dict's version tag, or None where this interpreter has no tag a probe
    can trust. CPython gives every dict one (PEP 509) and sets it anew whenever the dict's
    contents change -- a key added, removed, or given another value -- however the change is
    made (d[k] = v from sandboxed code, dict.update from C, a host's write to a dict it holds);
    reading it never changes it. It lies right after the object header and the size, which the
    probe checks before trusting it: the size read there is len(d), and a write of each kind
    changes the tag while a read does not. Only CPython's id() is an address."""
    if sys.implementation.name != "cpython":
        return None
    import ctypes
    size_at = object.__basicsize__                  # after the header: ma_used, then the tag
    tag_at = size_at + ctypes.sizeof(ctypes.c_ssize_t)
    read = ctypes.c_uint64.from_address

    def version(d):
        return read(id(d) + tag_at).value
    probe = {"a": 1, "b": [2]}
    if ctypes.c_ssize_t.from_address(id(probe) + size_at).value != len(probe):
        return None
    for change in (lambda d: d.__setitem__("a", 3), lambda d: dict.update(d, a=4),
                   lambda d: d.pop("b"), lambda d: d.setdefault("c", 5)):
        before = version(probe)
        probe.get("a"), len(probe), list(probe.items())
        if version(probe) != before:
            return None
        change(probe)
        if version(probe) == before:
            return None
    return version


_DICT_VERSION = []      # dict_version()'s answer, probed once, at the first graph's load


def dict_version():
    """dict_version_reader()'s function; where there is none, one whose answers never compare
    equal, so that WriteBack never trusts the context and every write-back is whole."""
    if not _DICT_VERSION:
        _DICT_VERSION.append(dict_version_reader() or (lambda d: object()))
    return _DICT_VERSION[0]


class WriteBack:
    """replace_active_context, faster: when the run ends with the context the previous run's
    write-back filled (the same dict, as the state's metadata.context) and every state update
    since then was a node's that fast_step_one saw, only the keys those updates set (their
    result's metadata and set_state, and RUN_KEYS) are written into it: every other metadata key
    holds there the value the last write-back gave it, the same object. That the context was not
    changed in between, by anyone (the host, a stream, another graph, code holding it), is read
    off its version tag (dict_version_reader): compared when the graph's lock is next taken from
    outside a run (RunLock), and from the walk's start to the run's end; begin_run's removal of
    next_node between the two is the body's own. More than one key new to the context (their
    order there is the metadata's), a "context" key set (a merge into the context itself), a
    graph with §6.10 listeners (they get that context by reference), an interpreter without the
    tag (dict_version), and any other case take the body's whole write-back. Like Snapshots, it
    does not see a write to graph.state made from outside the graph's own API."""

    LOG_MAX = 1000                      # updates noted between two write-backs, at most

    def __init__(self, graph):
        self.graph = graph
        self.version = dict_version()
        self.log = []                   # the NodeResults of the updates since the last one
        self.ctx = self.metadata = None     # the context written, the metadata it came from
        self.count = -1                 # execution_count then
        self.written = self.started = None  # the context's version then; at the walk's start

    def forget(self):
        """The next write-back is whole (too many updates noted, e.g. run after failed run)."""
        self.log.clear()
        self.ctx = None

    def between_runs(self):
        """The graph's lock is taken from outside any run: a context changed since the last
        write-back makes the next one whole."""
        if self.ctx is not None and self.version(self.ctx) != self.written:
            self.ctx = None

    def walk_starts(self, state):
        """The run's walk begins: note the context's version, against a change during the run."""
        ctx = state["metadata"].get("context")
        self.started = self.version(ctx) if self.ctx is not None and ctx is self.ctx else None

    def __call__(self, state, ctx):
        metadata = state["metadata"]
        log, writes = self.log, None
        if ctx is self.ctx and metadata is self.metadata and metadata.get("context") is ctx \
                and not self.graph.observers \
                and state["execution_count"] - self.count == len(log) \
                and self.started is not None and self.version(ctx) == self.started:
            writes = [key for result in log for part in (result.metadata, result.set_state)
                      if part for key in part]
            writes += RUN_KEYS
            writes = [key for key in writes
                      if key in metadata and key not in HOST_ONLY_CONTEXT_KEYS]
            if "context" in writes or len({key for key in writes if key not in ctx}) > 1:
                writes = None
        if writes is None:
            replace_active_context(state, ctx)
        else:
            grows = False
            for key in writes:
                grows = grows or key not in ctx
                ctx[key] = metadata[key]
            if grows:                   # a key new to the context: the host-only ones stay last
                for key in HOST_ONLY_CONTEXT_KEYS:
                    if key in ctx:
                        ctx[key] = ctx.pop(key)
        log.clear()
        self.started = None
        if isinstance(ctx, dict):
            self.ctx, self.metadata, self.count = ctx, metadata, state["execution_count"]
            self.written = self.version(ctx)
        else:
            self.ctx = None


class DeferredRuns:
    """run_ending's GraphRun, faster: the run's state is copied at its end but for the metadata,
    whose one-level copy (O(keys)) is made when GraphRun.state is first read or, should the run
    still be held by then, before the graph's state next changes -- every change of it through the
    graph's API takes graph._lock, which becomes a RunLock. A run nobody reads costs no copy.
    Like Snapshots, it does not see a write to graph.state made from outside that API."""

    def __init__(self, graph, write_back=None):
        snapshots = graph.snapshots if isinstance(graph.snapshots, Snapshots) else None
        graph._lock = RunLock(write_back, snapshots)

    def __call__(self, graph, trace):
        state, lock = graph.state, graph._lock
        run = DeferredGraphRun(trace.output, copy_state(state, None), trace.history,
                               trace.stopped, trace.held)
        if lock.depth == 1:             # the outermost run: nothing changes the state until
            run._metadata, run._lock = state["metadata"], lock      # the lock is taken again
            lock.owed = weakref.ref(run)
        else:                           # a run inside a run: the outer one changes it on
            run._state["metadata"] = dict(state["metadata"])
        return run


class RunLock:
    """GraphRoute._lock (re-entrant) that, when taken, first makes the metadata copy the last
    GraphRun owes (DeferredRuns)."""

    __slots__ = ("lock", "depth", "owed", "write_back", "snapshots")

    def __init__(self, write_back=None, snapshots=None):
        self.lock = threading.RLock()
        self.depth = 0                  # how many times the holder holds it
        self.owed = None                # weakref to the GraphRun owed its copy, or None
        self.write_back = write_back    # the graph's WriteBack, told when a run may begin
        self.snapshots = snapshots      # and its Snapshots

    def __enter__(self):
        self.lock.acquire()
        self.depth += 1
        if self.depth == 1:
            if self.write_back is not None:
                self.write_back.between_runs()
            if self.snapshots is not None:
                self.snapshots.between_calls()
        owed = self.owed
        if owed is not None:
            self.owed = None
            run = owed()
            if run is not None:
                run._settle()
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        self.lock.release()


class DeferredGraphRun(GraphRun):
    """A GraphRun whose state's metadata is copied on first read, or when its RunLock is taken."""

    __slots__ = ("_state", "_metadata", "_lock", "__weakref__")

    def __init__(self, output, state, history, stopped=None, held=()):
        self.output, self._state, self.history, self.stopped = output, state, history, stopped
        self._held, self._replies = held, None
        self._metadata = self._lock = None

    def _settle(self):
        if self._metadata is not None:
            self._state["metadata"] = dict(self._metadata)
            self._metadata = self._lock = None

    @property
    def state(self):
        if self._metadata is not None:
            with self._lock:            # settles this run when it is still owed
                self._settle()
        return self._state


def fast_walk(graph, results, trace, bounded):
    """GraphRoute._walk, faster: the same nodes run in the same order with the same guards."""
    write_back = graph.write_back
    if isinstance(write_back, WriteBack):
        if len(write_back.log) > WriteBack.LOG_MAX:
            write_back.forget()
        write_back.walk_starts(graph.state)
    while results and trace.stopped is None:
        if len(results) == 1 and results[0][0].plain_next is not None:
            node, output = results[0]
            after = node.plain_next
            while after is not None and after.name != END_NODE and trace.stopped is None:
                if bounded:
                    check_not_abandoned(f"graph '{graph.name}'", "6.7")
                node, output = after, fast_step_one(graph, after, output, trace)
                after = node.plain_next
            if after is not None:           # end reached, or a guard stopped the run
                break
            results = [(node, output)]      # conditional edges follow
            continue
        frontier = graph._next_nodes(results)
        if not frontier:
            break
        if bounded:
            check_not_abandoned(f"graph '{graph.name}'", "6.7")
        if len(frontier) == 1:
            node, message = frontier[0]
            results = [(node, fast_step_one(graph, node, message, trace))]
        else:
            results = graph._step(frontier, trace)


def fast_step_one(graph, node, message, trace):
    """GraphRoute._step for a next-node set of one node (nothing to schedule); return its output.
    A guard that stops the run sets trace.stopped (before the node: its message is returned)."""
    state = graph.state
    metadata = state["metadata"]
    nested = metadata.get("context")
    if "auto_finish_active" in metadata or type(nested) is not dict:
        relaxed = guards_relaxed(state)
    else:       # guards_relaxed(state), inlined for the usual case
        relaxed = bool(nested.get("auto_finish_active"))
    if guard_before_node(graph, node, message, trace, relaxed):
        return message
    try:
        result = node.handler(graph, node, message, state)
    except Exception as exc:
        graph._fail(node_failure(graph, node, exc))
    count = state["execution_count"]
    output = graph._finish(node, message, result, trace, relaxed)[0]
    if state["execution_count"] != count:           # an update: WriteBack notes its keys
        graph.write_back.log.append(result)
    return output


# A.3 Stream fast paths -------------------------------------------------------------------
# Adds: a stream network's hand-overs as plain nested calls where that does what Flow's loop does:
# the network has no cycle and no path longer than FAST_FLOW_HOPS hops, so the Python stack holds
# any flow (DirectFlow). A stream with one observer and no memory then hands a message straight to
# it, operators call the next one directly, StreamNetwork.send and Actor.send run in one piece,
# and an agent map builds its reply in one dict literal (together 0.5 us of a 3.4 us send(),
# measured in issue 15). Any other network keeps the loop, with the operators of a route handing
# over directly between two of its steps, FLOW_CHUNK apart (ChunkedFlow).
# Stands in for: Flow, Stream.next, _Sink.hand_on, StreamNetwork.send, Actor.send, agent_mapper's
# per-message step
# Seam: StreamNetwork.flow
FAST_FLOW_HOPS = 32     # operators and streams on the longest path nested calls may serve


def stream_flow(net, data):
    """StreamNetwork.flow for a network that is not on the reference path: DirectFlow where
    stream_hops bounds every flow, else ChunkedFlow (a cycle, a long route or chain)."""
    if stream_hops(net.rt, data) is None:
        return ChunkedFlow()
    net.send = direct_network_send.__get__(net)
    return DirectFlow()


def _operator_hops(ops):
    """Operators of a list, those of switch cases and default_operators within them counted."""
    hops = 0
    for op in ops if isinstance(ops, list) else ():
        hops += 1
        params = op.get("params") if isinstance(op, dict) else None
        if isinstance(params, dict):
            for case in as_list(params.get("cases")):
                if isinstance(case, dict):
                    hops += _operator_hops(case.get("operators"))
            hops += _operator_hops(params.get("default_operators"))
    return hops


def stream_hops(rt, data, limit=FAST_FLOW_HOPS):
    """The most hops (streams and operators) a message can take through the network of `data`,
    or None when no bound holds for nested calls: a cycle (a take-bounded one, §12.6), routes fed
    from __error__ (every failure is one more hop), or more than `limit` hops on a path."""
    routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
    pipelines = data.get("pipelines") if isinstance(data.get("pipelines"), dict) else {}
    weight = {name: 1 + (_operator_hops(cfg.get("operators")) if route_type(cfg) == "stream"
                         else 0) for name, cfg in routes.items()}
    for name, cfg in pipelines.items():
        stages = cfg.get("stages") if isinstance(cfg, dict) else None
        weight[name] = 1 + sum(1 + _operator_hops(stage.get("operators"))
                               for stage in (stages if isinstance(stages, list) else ())
                               if isinstance(stage, dict))
    pairs = [(source, target) for source, target, _path
             in stream_edges(data, _AnyName(), default_router(rt))
             if isinstance(source, str) and isinstance(target, str)]
    for name, graph in rt.graphs.items():          # §6.10: a graph run emits node events
        pairs += [(name, stream) for stream in graph.internal_stream_names()]
    if any(source == ERROR for source, _target in pairs):
        return None
    after = {}
    for source, target in pairs:
        after.setdefault(source, []).append(target)
    hops, open_ = {}, set()
    for root in after:
        if root in hops:
            continue
        open_.add(root)
        stack = [(root, iter(after[root]))]        # post-order without recursion
        while stack:
            name, targets = stack[-1]
            for target in targets:
                if target in open_:
                    return None                     # a cycle
                if target not in hops:
                    open_.add(target)
                    stack.append((target, iter(after.get(target, ()))))
                    break
            else:
                stack.pop()
                open_.discard(name)
                hops[name] = weight.get(name, 1) + max(
                    (hops[target] for target in after.get(name, ())), default=0)
                if hops[name] > limit:
                    return None
    return max(hops.values(), default=0)


class _AnyName:
    """A `known` for stream_edges that knows every name (unknown ones simply carry nothing)."""

    def __contains__(self, name):
        return True


FLOW_CHUNK = 16     # operators of a route that hand over by direct calls between two loop steps


class ChunkedFlow(Flow):
    """The body's loop, where an operator hands over to the next one of its route by a direct
    call, but for every FLOW_CHUNK-th: the stack holds at most that many operators, and the
    order is the loop's, since every hand-over to a stream, a sink or another route, and each
    operator's next and complete at one place alike, stay steps."""

    def stage(self, stage, index=0):
        return super().stage(stage) if index % FLOW_CHUNK == 0 else stage


class DirectFlow(Flow):
    """Flow's steps as direct nested calls, for a network stream_hops bounds."""

    def call(self, fn, *args):
        fn(*args)

    def run(self, fn, *args):
        fn(*args)

    def ensure(self, fn):
        fn()

    def outside(self, fn, *args):
        return fn(*args)

    def stage(self, stage, index=0):
        return stage

    def stream(self, name, *args):
        return DirectStream(name, *args, flow=self)

    def sink(self, net, name, adjust):
        return DirectSink(net, name, adjust)

    def output_sink(self, net):
        return DirectOutputSink(net)

    def agent_step(self, on_next, parts):
        return direct_agent_step(*parts)


class DirectStream(Stream):
    """A Stream whose `next` is an attribute: with no memory and exactly one observer it is that
    observer itself, which spares every message one call per hop; else the loop below."""

    __slots__ = ("next", "enter")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rewire()

    def _rewire(self):
        # `enter`: the sole observer's own, where it takes a message's parts (an agent step's;
        # Actor.send then builds no message for it), else None
        if self.memory is None and len(self.observers) == 1:
            self.next = self.observers[0]
            self.enter = getattr(self.next, "enter", None)
        else:
            self.next = self._deliver
            self.enter = None

    def subscribe(self, on_next, on_complete=None):
        super().subscribe(on_next, on_complete)
        self._rewire()

    def watch(self, on_next):
        super().watch(on_next)
        self._rewire()

    def dispose(self):
        super().dispose()
        self._rewire()

    def _deliver(self, msg):
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


class DirectSink(_Sink):
    """_Sink handing on by direct calls; the feedback-loop flag is reset on the way back."""

    def hand_on(self, msg):
        if self.out.observers:
            self.feed(msg)
        for hook in self.hooks:
            hook(msg)

    def feed(self, msg):
        if self.delivering:
            self.net.rt.warn(f"{self.name} feedback loop cut for one message", section="12.6")
            return
        self.delivering = True
        try:
            self.out.next(msg)
        finally:
            self.delivering = False


class EveryText:
    """A set that holds every string."""

    def __contains__(self, item):
        return True


EVERY_TEXT = EveryText()


class DirectOutputSink(_OutputSink):
    """_OutputSink.push with the hand-on in the same call."""

    feed = DirectSink.feed

    def __init__(self, net):
        super().__init__(net)
        # A cheaper first test: the heads' first characters (an empty head admits every text)
        self.firsts = EVERY_TEXT if "" in self.heads else frozenset(h[:1] for h in self.heads)

    def push(self, msg):
        content = msg.content
        if (content.__class__ is str or isinstance(content, str)) \
                and content[:1] in self.firsts and content.startswith(self.heads):
            match = self.strip.match(content)
            if match:
                msg = msg.copy(content=content[match.end():])
        if self.out.observers:
            self.feed(msg)
        for hook in self.hooks:
            hook(msg)


def direct_network_send(self, content, target=None, metadata=None):
    """StreamNetwork.send with deliver(push, message) in the same call."""
    stream = self.input.out
    if target is None:
        push = stream.next
    elif target in self.nodes and target not in (OUTPUT, ERROR):
        push = self.nodes[target].push
    else:
        raise error(RoutingError, f"no route or input stream named {target!r}", "5.1")
    if stream.done:
        raise error(StreamRoutingError, "__input__ has completed; no more messages", "5.5")
    clock = self.rt.clock
    meta = {"context": self.rt.context}
    if metadata:
        meta.update(metadata)
    push(Message(content, meta, INPUT, clock.now()))
    if not clock.real and not isinstance(clock, ComponentClock) and clock._queue:
        clock.advance(0)


def actor_sender(actor):
    """Actor.send for `actor`, with _begin() and _end() in the same call, the lock taken without
    `with` and, for the default target, direct_network_send in it too (issue 15: 0.14 us of a 3.4
    us send() for the two calls, 0.08 us for the `with`). What it reads at every call and that
    load fixed (the network, its clock, the __input__ stream, the lists) are its closure's."""
    outputs, errors, net, rt = actor._outputs, actor._errors, actor.network, actor.rt
    acquire, release = actor._turn.acquire, actor._turn.release
    clock, stream = rt.clock, net.input.out
    now, real, virtual = clock.now, clock.real, type(clock) is VirtualClock
    drains = not real and not isinstance(clock, ComponentClock)     # due timers fire at once
    new_result = Result.__new__

    def send(content, *, at=None, target=None):
        acquire()
        try:
            if outputs:                 # emissions between calls belong to no call
                outputs.clear()
            if errors:
                errors.clear()
            if at is not None:
                net.deliver(clock.set_time, at)
            if target is None:          # direct_network_send(net, content)
                if stream.done:
                    raise error(StreamRoutingError, "__input__ has completed; no more messages",
                                "5.5")
                ctx, enter = rt.context, stream.enter
                if enter is not None and ctx.__class__ is dict:
                    enter(content, ctx, None, clock._now if virtual else now())   # now()
                else:
                    stream.next(Message(content, {"context": ctx}, INPUT, now()))
                if drains and clock._queue:
                    clock.advance(0)
            else:
                net.send(content, target)
            if real and not clock.driven:
                net.settle()
            result = new_result(Result)     # Result(outputs[:], []) without its __init__
            result.outputs = outputs[:]
            outputs.clear()
            if errors:
                result.errors = errors[:]
                errors.clear()
            else:
                result.errors = []
            return result
        finally:
            release()
    return send


def direct_agent_step(name, route, agent, attempt, succeed, failed, down, reports_usage, rt):
    """agent_mapper's per-message step with succeed() in it: for the usual metadata, the shared
    context alone, the reply's metadata is one dict literal (issue 15: 0.25 us of a 3.4 us send).
    A tool agent whose sole tool has A.4's straight-line call runs its body in this step."""
    if not reports_usage and straight_line_unit(agent, attempt) is not None:
        return straight_line_agent_step(name, route, agent, failed, down, rt)

    def on_next(msg):
        metadata = msg.metadata
        ctx = metadata.get("context")
        if not isinstance(ctx, dict):       # resolve_context, which a context dict needs not
            ctx = resolve_context(msg, rt)
        try:
            reply = attempt(msg.content, ctx)
        except Exception as exc:        # _AgentTimedOut, or the §12.2.3 agent boundary
            failed(msg, exc)
            return
        if type(reply) is PendingReply:
            reply.then(lambda value: succeed(msg, ctx, value), lambda exc: failed(msg, exc))
            return
        if len(metadata) == 1 and "context" in metadata:
            meta = {"context": ctx, "processed_by": name}
        else:
            meta = copy_metadata(metadata)
            meta["processed_by"] = name
            meta["context"] = ctx
        if reports_usage and agent.last_usage:      # HOST: the vendor's token counts
            meta["usage"] = agent.last_usage
        down.next(Message(reply, meta, route, msg.timestamp))
    return on_next


# A.4 Inline code fast path ---------------------------------------------------------------
# Adds: a tool agent's sole inline tool whose body is straight-line (no loop, comprehension,
# lambda or function: CodeUnit.ticks) and cannot reach the context or the progress facility
# (CodeUnit.reaches_context) runs in one frame: the same checked and instrumented tree under the
# same allowlist and error rule, without the ToolEnv, the merged view, the progress function and
# the sandbox's call layers (0.5 us a call instead of 1.7). Where the body's names cannot tell a
# function's local variables from exec's namespace (function_form), that tree is compiled once
# as the body of a function, so a call makes no namespace dict and no exec (0.2 us instead of
# 0.5). In-process only.
# Stands in for: InlineTool.call (via InlineTool.run, InProcessSandbox.run_code, run_code)
# Seam: InlineTool.call
def straight_line_call(tool, rt):
    """The one-frame call() for `tool`, or None where the body's general path must run."""
    unit = tool.unit
    if tool.reads_context or unit.ticks or not rt.sandbox.in_process:
        return None
    run, label = straight_line_runner(unit), unit.label

    def call(input_data, rt, ctx, limits):
        try:
            return run(input_data, ctx if isinstance(ctx, dict) else {})
        except (Exception, Exhausted) as exc:
            raise_sandbox_failure(exc, label)
    call.unit = unit
    return call


def straight_line_runner(unit):
    """run(input_data, context) -> the §4.5.2 item 4 result of `unit`'s body: its function form
    where there is one, else exec of its code in a new namespace (either raises what the code
    raises)."""
    fn, code = function_form(unit), unit.code
    if fn is not None:
        return fn

    def run(input_data, context):
        namespace = {"__builtins__": _CODE_BUILTINS, "input_data": input_data,
                     "message": input_data, "result": None, "context": context}
        exec(code, namespace)
        result = namespace["result"]
        return inline_result(namespace) if result is None else result
    return run


# Nodes whose names a function scope would treat otherwise than exec's namespace: a binding that
# is not a plain assignment (del, global, except ... as, match captures, :=, annotations, class
# bodies, whose names a function would close over).
_FUNCTION_FORM_BARRED = (ast.Delete, ast.Global, ast.Nonlocal, ast.ExceptHandler, ast.Match,
                         ast.NamedExpr, ast.AnnAssign, ast.ClassDef)


def function_form(unit):
    """`unit`'s straight-line body as a function f(input_data, context) returning its §4.5.2 item
    4 result (message is input_data; result starts as None), or None where it could behave
    otherwise than exec: in a function a name the body binds is local, so reading it before a binding raises
    UnboundLocalError where exec would read the built-in or raise NameError. Hence every name the
    body both binds and reads must be bound by a top-level assignment before the first statement
    that reads it (the four §4.5.2 inputs are bound from the start; item 4's fallbacks, which the
    function sets to None and exec leaves unset, count as names the body binds)."""
    tree, _code, ticks = _sandbox_compile(unit.source, "exec",
                                          INLINE_CODE_BUILTINS.keys() | CODE_INPUTS,
                                          CODE_FILENAME)
    nodes = list(ast.walk(tree))
    if ticks or any(isinstance(node, _FUNCTION_FORM_BARRED) for node in nodes):
        return None
    bound = {node.id for node in nodes      # the shell binds item 4's fallbacks (to None)
             if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    bound.update(INLINE_RESULT_FALLBACKS)
    ready = {"input_data", "message", "context", "result"}
    for statement in tree.body:
        reads = set()
        for node in ast.walk(statement):    # x += 1 reads x, in a branch too
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                reads.add(node.id)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                reads.add(node.target.id)
        if (reads & bound) - ready:
            return None
        if isinstance(statement, (ast.Assign, ast.AugAssign)):
            ready |= {node.id for node in ast.walk(statement)
                      if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    fallback = "".join(f"{name} if {name} is not None else "      # inline_result's rule
                       for name in INLINE_RESULT_FALLBACKS) + '""'
    shell = ast.parse("def inline_code(input_data, context):\n"
                      "    message, result = input_data, None\n"
                      f"    {' = '.join(INLINE_RESULT_FALLBACKS)} = None\n"
                      f"    return ({fallback}) if result is None else result\n", CODE_FILENAME)
    function = shell.body[0]
    function.body[2:2] = tree.body      # the body's statements keep their own line numbers
    namespace = {"__builtins__": _CODE_BUILTINS}
    exec(compile(shell, CODE_FILENAME, "exec", dont_inherit=True), namespace)
    return namespace["inline_code"]


def straight_line_unit(agent, attempt):
    """The CodeUnit of `agent`'s sole tool where it has the straight-line call and `attempt` (the
    map's call of the agent) is its bare ToolAgent.invoke; else None."""
    if getattr(attempt, "__func__", None) is not ToolAgent.invoke \
            or getattr(attempt, "__self__", None) is not agent or not agent.sole_inline:
        return None
    return getattr(agent.tools[agent.sole_tool].call, "unit", None)


def straight_line_agent_step(name, route, agent, failed, down, rt):
    """direct_agent_step's on_next with ToolAgent.invoke and the straight-line call in it (the
    same body, error rule and §4.5.7 reply): two calls fewer a message. Its `enter` takes a
    message's parts instead (DirectStream.enter): Actor.send hands a new message to it without
    building it, since this step alone would read it; it is built where the step fails."""
    unit = straight_line_unit(agent, agent.invoke)
    run, label = straight_line_runner(unit), unit.label

    def step(content, ctx, msg, timestamp):
        try:
            text = content if content.__class__ is str else message_text(content)
            try:
                reply = run(text, ctx)
            except (Exception, Exhausted) as exc:
                raise_sandbox_failure(exc, label)
            if reply.__class__ is not str:
                reply = tool_output(reply)
        except Exception as exc:        # the §12.2.3 agent boundary
            failed(Message(content, {"context": ctx}, INPUT, timestamp) if msg is None else msg,
                   exc)
            return
        if msg is None or (len(msg.metadata) == 1 and "context" in msg.metadata):   # the usual
            meta = {"context": ctx, "processed_by": name}
        else:
            meta = copy_metadata(msg.metadata)
            meta["processed_by"] = name
            meta["context"] = ctx
        down.next(Message(reply, meta, route, timestamp))

    def on_next(msg):
        ctx = msg.metadata.get("context")
        if not isinstance(ctx, dict):       # resolve_context, which a context dict needs not
            ctx = resolve_context(msg, rt)
        step(msg.content, ctx, msg, msg.timestamp)

    on_next.enter = step    # step(content, ctx, None, timestamp): a message from __input__
    return on_next


# =====================================================================================
# APPENDIX B -- containment
# =====================================================================================
# Adds: bounds on what configuration code may cost and reach beyond the allowlist (README
# Security, T3).
# Stands in for: the body functions named by B.1-B.3
# Seam: Runtime.sandbox

# B.1 The budget ---------------------------------------------------------------------------
# Adds: the budget of §4.5's `timeout` -- a deadline ticked at every loop step, comprehension
# step, lambda and function call of sandboxed code, and a size price for what one operator may
# produce -- with exhaustion as the one error "resource exhausted" (T3). Active on every path.
# Stands in for: nothing the body runs without it (the body compiles and runs through its seams)
# Seam: instrument, run_limited
# tick() and guard_op() are also what the §9.2 engines call inside a run_limited() render.
# INTERPRETATION I-155 §13.2: a bare `except:` catches Exception only; exhaustion is not one.
class Exhausted(BaseException):
    """The budget ran out (T3). A BaseException, and a bare `except:` is rewritten to catch
    Exception only, so sandboxed code can never catch it."""


def _call(name, node, *args):
    return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), list(args), []), node)


# INTERPRETATION I-193 §13.2.3: one result-size rule, priced before the call.
# One result-size rule (T3) for every allowlisted callable whose result can outgrow its inputs:
# what it would produce (items, characters or bytes), priced before the call and refused past
# SANDBOX_MAX_ITEMS as "resource exhausted". Methods by name, called as price(self, args,
# kwargs) (join may turn its iterable into a list first); the budget below applies it to every
# read of these attributes, to operators (+ * ** << %), f-string widths and round and sum.
def _join_size(sep, args, kwargs):
    args[0] = items = list(args[0])
    return len(sep) * max(len(items) - 1, 0) + sum(len(item) for item in items
                                                   if isinstance(item, (str, bytes)))


SANDBOX_SIZES = {
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), lambda s, args, kwargs: args[0]),
    "expandtabs": lambda s, args, kwargs: len(s) * max(1, (args or [kwargs.get("tabsize", 8)])[0]),
    "replace": lambda s, args, kwargs: len(s) + (len(s) + 1) * max(0, len(args[1]) - len(args[0])),
    "join": _join_size,
    "translate": lambda s, args, kwargs: len(s) * max(
        [len(v) for v in args[0].values() if isinstance(v, str)] or [1]) if
        isinstance(args[0], dict) else len(s),
    "to_bytes": lambda i, args, kwargs: (args or [kwargs.get("length", 1)])[0],
    "encode": lambda s, args, kwargs: 4 * len(s) if sandbox_codec(args, kwargs) else 0,
    "decode": lambda s, args, kwargs: len(s) if sandbox_codec(args, kwargs) else 0,
}


_SIZED_OPERATORS = {ast.Add: "+", ast.Mult: "*", ast.Pow: "**", ast.LShift: "<<", ast.Mod: "%"}


class _Ticks(ast.NodeTransformer):
    """The budget's hooks (T3): a tick at each loop step, comprehension step and call; the
    size-multiplying operators through guard_op; a bare `except:` catches Exception only."""

    def _tick_first(self, node):
        self.generic_visit(node)
        node.body.insert(0, ast.copy_location(ast.Expr(_call("__sb_tick__", node)), node))
        return node

    visit_For = visit_While = visit_FunctionDef = _tick_first

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs.insert(0, _call("__sb_tick__", node.iter))
        return node

    def visit_Lambda(self, node):
        self.generic_visit(node)
        node.body = ast.copy_location(ast.BoolOp(ast.And(), [_call("__sb_tick__", node.body),
                                                             node.body]), node.body)
        return node

    def visit_BinOp(self, node):
        # A constant operand grows a value additively (bounded by the time ticks); two variables
        # can double it on each step, and * ** << multiply it, even two literals (9 ** 10**9).
        self.generic_visit(node)
        symbol = _SIZED_OPERATORS.get(type(node.op))
        constants = isinstance(node.left, ast.Constant) + isinstance(node.right, ast.Constant)
        if symbol is None or symbol == "+" and constants:
            return node
        return _call("__sb_op__", node, ast.Constant(symbol), node.left, node.right)

    def visit_Attribute(self, node):
        # One of SANDBOX_SIZES read (called or not): the method comes back priced.
        self.generic_visit(node)
        if node.attr not in SANDBOX_SIZES or not isinstance(node.ctx, ast.Load):
            return node
        return _call("__sb_method__", node, node.value, ast.Constant(node.attr))

    def visit_FormattedValue(self, node):
        # f"{x:>{w}}": the width and precision of a format spec are priced before formatting.
        self.generic_visit(node)
        if node.format_spec is None:
            return node
        value = _call("__sb_format__", node, node.value, ast.Constant(node.conversion),
                      node.format_spec)
        return ast.copy_location(ast.FormattedValue(value, -1, None), node)

    def visit_AugAssign(self, node):
        self.generic_visit(node)
        symbol = _SIZED_OPERATORS.get(type(node.op))
        if symbol is None or symbol == "+" and isinstance(node.value, ast.Constant):
            return node
        if isinstance(node.target, ast.Name):       # x += y keeps in-place semantics (iadd)
            value = _call("__sb_iop__", node, ast.Constant(symbol),
                          ast.Name(node.target.id, ast.Load()), node.value)
            return ast.copy_location(ast.Assign([node.target], value), node)
        target = node.target                        # d[k] += y
        return ast.copy_location(ast.Expr(_call("__sb_iop_item__", node, target.value,
                                                target.slice, ast.Constant(symbol),
                                                node.value)), node)

    def visit_ExceptHandler(self, node):
        self.generic_visit(node)
        if node.type is None:
            node.type = ast.copy_location(ast.Name("__sb_Exception__", ast.Load()), node)
        return node


def _ticks(tree):
    """Whether the rewritten code can loop or call code of its own (else it needs no deadline)."""
    return any(isinstance(node, ast.Name) and node.id == "__sb_tick__" for node in ast.walk(tree))


# The budget (T3) ------------------------------------------------------------------------------
# INTERPRETATION I-152 §13.2 (issue 4): the limits hold in unsafe mode as well: unsafe mode enables
# inline code, it does not hand the code the host. Ticks, not a trace function: CPython sends no
# `line` event for `while True: pass`.
class Budget:
    """The one budget of a sandboxed call or render: a deadline and a size limit. Nested runs
    (a SIMPLE {{ }} inside a render) keep the nearer deadline."""

    __slots__ = ("timeout", "deadline")

    def __init__(self, timeout, outer=None):
        self.timeout = 1.0 if timeout is None else float(timeout)
        self.deadline = time.monotonic() + self.timeout
        if outer is not None and outer.deadline < self.deadline:
            self.timeout, self.deadline = outer.timeout, outer.deadline


# Which budget the running call has, per thread (scratch for one call, not Actor state).
_BUDGET = threading.local()


def tick():
    """At every loop step, comprehension step and sandboxed call: stop past the deadline."""
    budget = getattr(_BUDGET, "budget", None)
    if budget is None:   # a sandbox-made function called by the host outside any run
        raise error(Exhausted, "sandboxed code called outside its run")
    if time.monotonic() > budget.deadline:
        raise error(Exhausted, f"time limit of {budget.timeout:g} s")
    return True


def spend(size, what):
    """Stop before an operator or range produces more than SANDBOX_MAX_ITEMS."""
    if size > SANDBOX_MAX_ITEMS:
        raise error(Exhausted, f"{what} larger than {SANDBOX_MAX_ITEMS} items")


def _result_size(symbol, left, right):
    """Items, characters or bits that `left symbol right` would produce (0: not a growth case)."""
    ints = type(left) in (int, bool) and type(right) in (int, bool)
    if symbol == "+":
        return len(left) + len(right) if isinstance(left, _SIZED) and isinstance(right, _SIZED) \
            else 0
    if symbol == "*":
        if ints:
            return left.bit_length() + right.bit_length()
        seq, count = (left, right) if isinstance(right, int) else (right, left)
        return len(seq) * count if isinstance(seq, _SIZED) and isinstance(count, int) else 0
    if symbol == "**":
        return max(abs(left).bit_length() - 1, 0) * right if ints and right > 0 else 0
    if symbol == "%":
        return _percent_size(left, right) if isinstance(left, (str, bytes)) else 0
    return left.bit_length() + right if ints and left and right > 0 else 0      # <<


_SIZED = (str, list, tuple, bytes, bytearray)
_OPERATORS = {"+": operator.add, "*": operator.mul, "**": operator.pow, "<<": operator.lshift,
              "%": operator.mod}
_IN_PLACE = {"+": operator.iadd, "*": operator.imul, "**": operator.ipow, "<<": operator.ilshift,
             "%": operator.imod}
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?[a-zA-Z%]?")


def _percent_size(template, args):
    """`template % args`: its length, every width and precision it spells, and (when one is `*`)
    every integer argument, which may be one."""
    text = template if isinstance(template, str) else template.decode("latin-1")
    specs = _PERCENT_SPEC.findall(text)
    size = len(text) + sum(int(n) for spec in specs for n in spec if n.isdigit())
    if any("*" in spec for spec in specs):
        size += sum(abs(a) for a in (args if isinstance(args, tuple) else (args,))
                    if type(a) is int)
    return size


def guard_format(value, conversion, spec):
    """f"{value!c:spec}" with a computed spec: its width and precision priced first."""
    value = {115: str, 114: repr, 97: ascii}.get(conversion, lambda v: v)(value)
    match = _FORMAT_SPEC.fullmatch(spec) if isinstance(spec, str) else None
    spend(sum(int(n) for n in match.groups() if n) if match else 0, "a format width")
    return format(value, spec)


def guard_method(obj, name):
    """obj.name for a method of SANDBOX_SIZES: a callable that prices each call first (the
    unbound form, str.ljust(s, n), too)."""
    method, price = getattr(obj, name), SANDBOX_SIZES[name]

    def priced(*args, **kwargs):
        args = list(args)
        unbound = isinstance(obj, type)
        try:
            if unbound:
                rest = args[1:]
                size = price(args[0], rest, kwargs)
                args[1:] = rest
            else:
                size = price(obj, args, kwargs)
        except (TypeError, ValueError, IndexError, AttributeError):
            size = 0            # arguments the method itself refuses
        spend(size if isinstance(size, int) else 0, f"the result of {name}()")
        return method(*args, **kwargs)
    return priced


def guard_op(symbol, left, right):
    spend(_result_size(symbol, left, right), f"the result of {symbol}")
    return _OPERATORS[symbol](left, right)


def guard_iop(symbol, left, right):
    spend(_result_size(symbol, left, right), f"the result of {symbol}=")
    return _IN_PLACE[symbol](left, right)


def guard_iop_item(container, key, symbol, value):
    container[key] = guard_iop(symbol, container[key], value)


def run_budgeted(fn, args, timeout, label, cls=ExecutionError, code=False):
    """fn(*args) under a fresh budget (timeout None: straight-line code, which has no tick to
    read one). Exhaustion is one error kind, "<label>: resource exhausted: <what>", like the
    WebAssembly reference interpreter's single Exhaustion; with code=True the code's own
    exception becomes an ExecutionError naming its line (§12.2.3: never fatal to the Actor)."""
    if timeout is not None:
        previous = getattr(_BUDGET, "budget", None)
        _BUDGET.budget = Budget(timeout, previous)
    try:
        return fn(*args)
    except (Exception, Exhausted) as exc:
        raise_sandbox_failure(exc, label, cls, code)
    finally:
        if timeout is not None:
            _BUDGET.budget = previous


def raise_sandbox_failure(exc, label, cls=ExecutionError, code=True):
    """Raise what sandbox_failure makes of `exc`, caught by the caller: exc itself where it goes
    on as it is, else its one located error."""
    failure = sandbox_failure(exc, label, cls, code)
    if failure is exc:
        raise exc
    raise failure from None


def sandbox_failure(exc, label, cls=ExecutionError, code=True):
    """The error a sandboxed run's exception `exc` becomes (run_budgeted's rule, also used by
    callers that run straight-line code without a budget): exhaustion is one kind; an ActorError
    and, unless code=True, any other exception go on as they are."""
    if isinstance(exc, Exhausted):
        failure = f"resource exhausted: {exc}"
    elif isinstance(exc, (MemoryError, RecursionError)):
        failure = f"resource exhausted: {type(exc).__name__}"
    elif isinstance(exc, ActorError) or not code:
        return exc
    else:
        line = _sandbox_line(exc.__traceback__)
        failure = f"{f'line {line}: ' if line else ''}{type(exc).__name__}: {_exception_text(exc)}"
    return error(cls, f"{label}: {failure}", "13.2")


def _exception_text(exc):
    """The code's exception as text: only its text and number arguments are printed (the host's
    str() of an attacker-built structure would run in C past the deadline, T3)."""
    if all(type(arg) in (str, int, float, bool) for arg in exc.args):
        return str(exc)[:500]
    return "(an exception whose arguments are not text)"


def _sandbox_line(tb):
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in (CODE_FILENAME, EXPRESSION_FILENAME):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# The names the rewritten code calls, added to the body's two namespaces; double-underscore
# names, so sandboxed source never spells them.
_HOOKS = {"__sb_tick__": tick, "__sb_op__": guard_op, "__sb_iop__": guard_iop,
          "__sb_iop_item__": guard_iop_item, "__sb_Exception__": Exception,
          "__sb_method__": guard_method, "__sb_format__": guard_format, "__sb_str__": builtin_str,
          "__sb_json__": SANDBOX_JSON}
_CODE_BUILTINS.update(_HOOKS)
_EXPRESSION_BUILTINS.update(_HOOKS)


# B.2 Worker processes and their wire format -----------------------------------------------
# Adds: isolation="process" -- configuration code, expressions and templates in worker
# processes under OS limits, killed past their deadline (T3: what the budget cannot pre-empt).
# Stands in for: InProcessSandbox (the body's in-process runner)
# Seam: Runtime.sandbox, ISOLATION
# load(..., isolation="process"): configuration code, expressions and templates run in a worker
# process under OS limits (address space, CPU time, no file writes, only its two pipes). The
# parent enforces each deadline by killing the worker, which works whatever the worker's GIL is
# doing; a crashed or killed worker becomes an ExecutionError and the next call gets a fresh one.
# Values cross as JSON with tuples, sets and non-text keys tagged; the reply is decoded into plain
# data only. INTERPRETATION I-154 §13.2 (new: isolation): print output and progress_bar calls made
# by the code are forwarded to the parent as they happen.
WORKER_MEMORY = 1 << 30           # bytes of address space a worker may add to its start-up size
WORKER_GRACE = 0.5                # seconds past a call's own deadline before the parent kills
WORKER_START = 60.0               # seconds a new worker may take to start (a busy machine)


def wire(value):
    """A value as JSON-ready data, tuples, sets and non-text keys tagged (both directions). A tag
    is a one-key mapping whose key starts with NUL; a mapping of the data whose keys are not all
    text, or any of which starts with NUL, is sent as a list of pairs, so data never reads as a
    tag ({"\\x00set": [1]} comes back a mapping)."""
    value = plain(value)
    if isinstance(value, dict):
        if all(type(key) is str and not key.startswith("\0") for key in value):
            return {key: wire(item) for key, item in value.items()}
        return {"\0map": [[wire(key), wire(item)] for key, item in value.items()]}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [wire(item) for item in value]
        return items if type(value) is list else {"\0" + type(value).__name__[:3]: items}
    if value is None or type(value) in (str, int, float, bool):
        return value
    raise error(TypeError, f"a value of type {type(value).__name__} cannot cross the process "
                "boundary")


WIRE_TAGS = {"\0tup": tuple, "\0set": set, "\0fro": frozenset}


def unwire(data):
    """Inverse of wire; builds only dict, list, tuple, set, str, int, float, bool and None. A
    malformed tag is a ValueError (the caller's one failure), never a crash."""
    if isinstance(data, list):
        return [unwire(item) for item in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1 and next(iter(data)).startswith("\0"):
        tag, items = next(iter(data.items()))
        if not isinstance(items, list) or tag != "\0map" and tag not in WIRE_TAGS:
            raise error(ValueError, f"a malformed wire tag {tag!r}")
        if tag == "\0map":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
                raise error(ValueError, "a malformed wire mapping")
            return {unwire(key): unwire(item) for key, item in items}
        return WIRE_TAGS[tag](map(unwire, items))
    return {key: unwire(item) for key, item in data.items()}


class Worker:
    """One worker process and its pipes (POSIX)."""

    warned = False          # the "no seccomp filter" warning is given once per process

    def __init__(self):
        boot = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
                f"import {__name__.replace('__main__', 'actor')} as m; m.worker_main()")
        here = os.path.dirname(os.path.abspath(__file__))
        import select, subprocess       # on first use: start-up pays for none (issue 15)
        self._select = select.select
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-X", "utf8", "-c", boot, json.dumps([here, *sys.path])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True, env={}, cwd="/", start_new_session=True)
        self.pending = b""
        ready = self.line(time.monotonic() + WORKER_START, "start-up")
        if ready not in (b"ready", b"ready uncontained"):
            raise error(OSError, "the worker process did not start")
        if ready != b"ready" and not Worker.warned:
            Worker.warned = True
            log.warning("isolation='process': the worker could not install its seccomp filter "
                        "(Linux x86-64 only); it runs with its rlimits alone (README Security)")

    def line(self, deadline, what):
        """The worker's next line; past the deadline the worker is killed (Exhausted)."""
        import select                        # POSIX only, as is isolation="process"
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise error(Exhausted, f"{what} (worker process killed)")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise error(Exhausted, f"the worker process died (status {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def ask(self, request, timeout, on_event):
        """Send one request, answer its events (print, progress_bar), return the reply."""
        self.send(request)
        deadline = time.monotonic() + timeout + WORKER_GRACE
        while True:
            reply = json.loads(self.line(deadline, f"time limit of {timeout:g} s"))
            if "event" not in reply:
                return reply
            self.send({"answer": on_event(reply)})

    def kill(self):
        """The worker's whole process group (its own, start_new_session): nothing it started
        outlives it."""
        import signal
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:         # gone already
            self.proc.kill()
        self.proc.wait()


class ProcessSandbox:
    """isolation="process": a pool of workers, one per concurrent call."""

    in_process = False

    def __init__(self):
        if os.name != "posix":
            raise error(ConfigurationError, "isolation='process' needs a POSIX host", "13.2")
        self.idle, self.lock = [], threading.Lock()

    def ask(self, request, timeout, label, on_event=None, cls=ExecutionError):
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        try:
            worker = worker or Worker()
            reply = worker.ask(request, timeout, on_event or (lambda event: None))
            value = unwire(reply["value"]) if "value" in reply else None
        except Exhausted as exc:
            raise error(cls, f"{label}: resource exhausted: {exc}", "13.2") from None
        except Exception as exc:   # a broken pipe, a value that cannot cross, a malformed reply
            if worker is not None:
                worker.kill()
            raise error(cls, f"{label}: the worker process failed: {type(exc).__name__}: "
                        f"{exc}", "13.2") from None
        with self.lock:
            self.idle.append(worker)
        if "error" in reply:
            kind = TemplateError if reply.get("kind") == "TemplateError" else ExecutionError
            where = reply.get("where")
            if not (isinstance(where, list) and len(where) == 4
                    and all(part is None or type(part) in (str, int) for part in where)):
                where = (None,) * 4             # a reply is data: its shape is checked
            path, file, line, col = where
            raise error(kind, str(reply["error"]), reply.get("section"), path=path, file=file,
                        line=line, col=col)
        return value

    def run_code(self, unit, variables, timeout, on_progress):
        """The worker runs the body; context changes come back and land in the parent's view."""
        view = variables["context"]
        view = ContextView(view) if type(view) is dict else view
        request = {"op": "code", "source": unit.source, "label": unit.label, "timeout": timeout,
                   "input": variables["input_data"], "context": wire(view)}

        def on_event(event):
            if event["event"] == "print":
                sys.stderr.write(event["text"])
                return None
            return on_progress(**unwire(event["kwargs"]))
        value = self.ask(request, timeout, unit.label, on_event)
        new = value["context"]
        for key in [key for key in view if key not in new]:   # §4.5.2: changes propagate back
            _check_write(view, key)
            view.data.pop(key, None)
        for key, item in new.items():
            if key not in view or plain(view[key]) != item:
                view[key] = item                               # host-only keys refused here too
        return value["result"]

    def call(self, unit, args, timeout=1.0):
        return self.ask({"op": "expr", "source": unit.source, "nparams": unit.nparams,
                         "label": unit.label, "args": wire(list(args)), "timeout": timeout},
                        timeout, unit.label)

    def render(self, text, variables, engine, partials=None, phase="C"):
        data = {key: value for key, value in variables.items()
                if not (key in BUILTINS and value is BUILTINS[key])}
        return self.ask({"op": "render", "text": text, "variables": wire(data), "engine": engine,
                         "partials": partials, "phase": phase}, TEMPLATE_TIME_LIMIT,
                        engine_name(engine), cls=TemplateError)

    def close(self):
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.kill()


def worker_main():
    """The worker's loop: limits first, then one request per line until stdin closes."""
    import resource
    size = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") \
        if os.path.exists("/proc/self/statm") else 0
    for limit, value in ((resource.RLIMIT_AS, size + WORKER_MEMORY if size else None),
                         (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NOFILE, 16)):
        if value is not None:
            value = clamp_limit(resource, limit, value)
            resource.setrlimit(limit, (value, value))
    units, stdin, stdout = {}, sys.stdin.buffer, sys.stdout.buffer
    with contextlib.suppress(ActorError):       # imports first: no file can be opened after
        render("{{ x|upper }}{% for i in [1] %}{{ i }}{% endfor %}", {"x": "a"}, "JINJA2")
    for module in WORKER_PRELOADS:
        with contextlib.suppress(ImportError):
            __import__(module)
    contained = contain_worker()
    stdout.write(b"ready\n" if contained else b"ready uncontained\n")
    stdout.flush()

    def send(obj):
        stdout.write(json.dumps(obj).encode() + b"\n")
        stdout.flush()

    def event(name, **fields):
        send({"event": name, **fields})
        return json.loads(stdin.readline())["answer"]

    class Printed:
        def write(self, text):
            event("print", text=text)
    _BUDGET.printed = Printed()
    for line in stdin:
        request = json.loads(line)
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        cpu = int(used + request.get("timeout", 2)) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (clamp_limit(resource, resource.RLIMIT_CPU, cpu),
                                                 resource.getrlimit(resource.RLIMIT_CPU)[1]))
        try:
            send({"value": wire(_worker_answer(request, units, event))})
        except ActorError as exc:       # its place too (a template's line), as in-process
            send({"error": exc.message, "kind": type(exc).__name__, "section": exc.section,
                  "where": [exc.path, exc.file, exc.line, exc.col]})
        except Exception as exc:   # a value that cannot cross, for one
            send({"error": f"{type(exc).__name__}: {exc}", "kind": "ExecutionError",
                  "section": "13.2"})


# What a worker's code or template may import on first use, loaded before the filter: the
# sandbox's codecs (SANDBOX_CODECS) and what jinja2 loads lazily -- string literals
# (unicode_escape), a failing render (its traceback rewriter), striptags and pprint.
WORKER_PRELOADS = ("encodings.utf_8", "encodings.ascii", "encodings.latin_1",
                   "encodings.unicode_escape", "jinja2.debug", "html.entities", "pprint")

# The system calls a computing worker makes (Linux x86-64): memory, futex, clocks, signals'
# return, its limits and exit; read and write only on its two pipes (fds 0 and 1). Any other
# call fails with EPERM: no open, socket, fork, kill or exec.
WORKER_SYSCALLS = {
    "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13,
    "rt_sigprocmask": 14, "rt_sigreturn": 15, "mremap": 25, "madvise": 28, "sigaltstack": 131,
    "futex": 202, "clock_gettime": 228, "clock_getres": 229, "clock_nanosleep": 230,
    "gettimeofday": 96, "getrusage": 98, "getrlimit": 97, "setrlimit": 160, "prlimit64": 302,
    "fstat": 5, "lseek": 8, "newfstatat": 262, "getpid": 39, "gettid": 186, "sched_yield": 24,
    "getrandom": 318, "exit": 60, "exit_group": 231,
}
WORKER_PIPE_CALLS = (0, 1)             # read, write: on fds 0 and 1 only


def contain_worker():
    """PR_SET_NO_NEW_PRIVS, then a seccomp-bpf filter allowing WORKER_SYSCALLS (T3, issue 22);
    False where it cannot be installed (not Linux x86-64, no seccomp)."""
    import ctypes, platform, struct
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    allow, deny = 0x7FFF0000, 0x00050000 | 1                      # RET_ALLOW, RET_ERRNO(EPERM)
    load, jeq, ret = 0x20, 0x15, 0x06                             # BPF_LD|W|ABS, JMP|JEQ|K, RET|K
    prog = [(load, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, deny),  # arch is x86-64
            (load, 0, 0, 0)]                                      # the call's number
    for number in WORKER_SYSCALLS.values():
        prog += [(jeq, 0, 1, number), (ret, 0, 0, allow)]
    prog += [(jeq, 1, 0, 0), (jeq, 0, 4, 1),                      # read or write: check the fd
             (load, 0, 0, 16), (jeq, 1, 0, 0), (jeq, 0, 1, 1), (ret, 0, 0, allow),
             (ret, 0, 0, deny)]
    code = b"".join(struct.pack("HBBI", *op) for op in prog)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:                           # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0   # PR_SET_SECCOMP, FILTER


def clamp_limit(resource, limit, value):
    """`value` for an rlimit, never above the host's hard limit (`ulimit -t`, systemd LimitCPU,
    a batch scheduler's): a worker may only lower its limits."""
    hard = resource.getrlimit(limit)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _worker_answer(request, units, event):
    """One request, answered in the worker by the in-process sandbox under its own budget."""
    local, op, source = InProcessSandbox(), request["op"], request.get("source")
    if op == "render":
        return local.render(request["text"], {**BUILTINS, **unwire(request["variables"])},
                            request["engine"], request["partials"], request["phase"])
    key = (op, source, request.get("nparams"), request.get("label"))
    if key not in units:
        units[key] = compile_code(source) if op == "code" \
            else compile_expression(source, nparams=request["nparams"])
        if request.get("label"):        # its errors name the body's place, as in-process
            units[key].label = request["label"]
    if op == "expr":
        return local.call(units[key], unwire(request["args"]), request["timeout"])
    context = unwire(request["context"])
    result = local.run_code(units[key], {
        "input_data": request["input"], "message": request["input"], "context": context,
        "result": None, INLINE_PROGRESS: lambda **kwargs: event("progress", kwargs=wire(kwargs))},
        request["timeout"])
    return {"result": tool_output(result), "context": context}


ISOLATION["process"] = ProcessSandbox


# B.3 The checkpoint directory ------------------------------------------------------------
# Adds: what §6.6's files need on a real disk, on every path: names that stay unique and sortable
# whatever the clock does and whatever files are there (I-107), a bound on the files kept
# (I-181), and a restore that trusts nothing it reads -- no link, FIFO or oversize file, no key
# only the host may set (I-180).
# Stands in for: nothing the body runs without it (the vectors pin it on both paths)
# Seam: write_checkpoint, CheckpointFiles, restore_checkpoint

def checkpoint_timestamp(rt):
    """A sortable UTC date-time: the wall clock under a real clock, else 1970 + virtual seconds."""
    if rt.clock.real:
        return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return virtual_timestamp(rt.clock.now())


# A pure cache: virtual time often stands still between checkpoints
@functools.lru_cache(maxsize=16)
def virtual_timestamp(seconds):
    moment = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc) + \
        datetime.timedelta(seconds=seconds)
    return moment.strftime("%Y%m%dT%H%M%S.%fZ")


def checkpoint_sequence(path):
    match = re.search(r"-(\d+)\.json$", path.name)
    return int(match.group(1)) if match else 0


def checkpoint_name(graph):
    """The next checkpoint file name: the sequence continues past the newest file (read once),
    and the timestamp never sorts before the previous one (the clock may go back)."""
    # INTERPRETATION I-107 §6.6 (Q42): names are checkpoint_<UTC timestamp>-<6-digit sequence>.json;
    # the sequence continues past the newest file already there, so names stay unique and sortable.
    # An Actor's graphs writing to one directory continue one series (rt.checkpoint_series):
    # each reading the files alone would reuse a name another graph gave a file not written yet
    # (A.1's writer) or given in the same virtual second.
    with CHECKPOINT_SERIES_LOCK:
        if graph._checkpoint_last is None:
            folder = os.path.realpath(graph.checkpoint_dir)
            all_series = graph.rt.checkpoint_series
            series = all_series.get(folder)
            if series is None:
                existing = sorted(graph.checkpoint_dir.glob(CHECKPOINT_GLOB))
                series = all_series[folder] = [
                    existing[-1].name if existing else "",
                    checkpoint_sequence(existing[-1]) if existing else 0]
            graph._checkpoint_last = series
        series = graph._checkpoint_last         # [newest name, its sequence]
        series[1] += 1
        name = f"checkpoint_{checkpoint_timestamp(graph.rt)}-{series[1]:06d}.json"
        if name <= series[0]:
            stamp = series[0][len("checkpoint_"):-len("-000000.json")]
            name = f"checkpoint_{stamp}-{series[1]:06d}.json"
        series[0] = name
        return name


CHECKPOINT_SERIES_LOCK = threading.Lock()      # rt.checkpoint_series: [newest name, sequence]


# INTERPRETATION I-181 §6.6: a checkpoint directory keeps the newest CHECKPOINT_KEEP files; each
# write deletes the oldest beyond them (files are named in time order, I-107).
CHECKPOINT_KEEP = 100


def prune_checkpoints(folder, keep):
    """Delete the oldest checkpoint files of `folder` beyond the newest `keep` (>= 1)."""
    names = sorted(name for name in os.listdir(folder) if fnmatch.fnmatch(name, CHECKPOINT_GLOB))
    for name in names[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))


CHECKPOINT_MAX_BYTES = 64 * 2**20      # the largest checkpoint file restore reads


def read_checkpoint(graph, path):
    """restore_checkpoint's reading: (the file's Path, the JSON it holds), or an ApplicationError
    naming what is wrong with the file (read_checkpoint_file)."""
    where = path_str(graph.path)
    if not isinstance(path, (str, os.PathLike)):
        raise error(ApplicationError, f"graph '{graph.name}': a checkpoint is named by a file "
                    f"path, not {type(path).__name__}", "6.6", path=where)
    path = Path(graph.rt.workdir) / path            # (an absolute path stays what it is)
    try:
        return path, json.loads(read_checkpoint_file(path))
    except (OSError, ValueError, RecursionError) as exc:
        raise error(ApplicationError, f"cannot restore graph '{graph.name}' from {path}: {exc}",
                    "6.6", path=where) from None


def read_checkpoint_file(path):
    """A checkpoint file's text, read without following a symbolic link in its place and
    without blocking on a FIFO; no more than CHECKPOINT_MAX_BYTES (else an OSError: why)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    if os.path.islink(path):            # (where O_NOFOLLOW is unknown, this check alone)
        raise error(OSError, "it is a symbolic link")
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:    # a link put there after the check above
            raise error(OSError, "it is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as file:
        facts = os.fstat(file.fileno())
        if not stat.S_ISREG(facts.st_mode):
            raise error(OSError, "it is not a regular file")
        data = file.read(CHECKPOINT_MAX_BYTES + 1) if facts.st_size <= CHECKPOINT_MAX_BYTES \
            else b""
    if facts.st_size > CHECKPOINT_MAX_BYTES or len(data) > CHECKPOINT_MAX_BYTES:
        raise error(OSError, f"it is larger than {CHECKPOINT_MAX_BYTES} bytes")
    return data.decode("utf-8")


def refuse_checkpoint_keys(graph, path, metadata):
    """restore_checkpoint's last check: the metadata a checkpoint file holds, refused (an
    ApplicationError) where it sets a reserved key or one only the host may set (§10.3)."""
    # INTERPRETATION I-180 §6.6, §10.3: what a checkpoint file holds is refused as every other
    # state write refuses it; the stored copy of the invocation context is not restored (the
    # live context stays attached, as a rewind keeps it, and every run attaches it again, Q32).
    metadata.pop("context", None)
    try:
        for key in metadata:
            if isinstance(key, str) and key.startswith("__"):
                raise error(ExecutionError, f"a checkpoint may not set '{key}' (keys starting "
                            "with __ are reserved)", "10.3")
        refuse_host_keys(metadata, "a checkpoint")
    except ExecutionError as exc:
        raise error(ApplicationError, f"cannot restore graph '{graph.name}' from {path}: "
                    f"{error_reason(exc)}", "6.6, §10.3", path=graph.path) from None


# =====================================================================================
# APPENDIX C -- host
# =====================================================================================
# Adds: what the standard leaves to the host (§1.2 "does NOT define" 1-3): the providers' wire
# formats, the load/Actor API, the loader of the vector harness (vectors/run.py), the wall clock,
# describe and diagram, the command line.
# Stands in for: nothing in the body -- the body calls the host only through these seams.
# Seam: Runtime.llm_transport, Runtime.clock

# C.0 YAML 1.2 over pyyaml ----------------------------------------------------------------
# Adds: the parser under §3.1's rules -- pyyaml (a YAML 1.1 library, with or without libyaml)
# made to read YAML 1.2: its scanner with 1.2's tab rules, loaders that resolve only the core
# schema's implicit types (no merge key), and the choice between libyaml and the pure parser.
# Stands in for: nothing in the body -- §3.1's walk (_parse_events) builds the values and keeps
# the rules; this part only hands it the events.
# Seam: parse_yaml

# INTERPRETATION I-223 §3.1: one answer whether or not libyaml is installed. libyaml parses the
# text when present; where it refuses a text, or the text holds a construct on which the two
# parsers part (a directive line, a tag, a comment glued to a block scalar indicator), the pure
# parser's answer stands. With the tab fixes below, the pure parser takes YAML 1.2's side on the
# yaml-test-suite cases where the two disagreed (test_yaml_parsers_give_one_answer).
import yaml.composer as _yaml_composer      # noqa: E402  (pyyaml's parts, for the pure loader)
import yaml.parser as _yaml_parser          # noqa: E402
import yaml.reader as _yaml_reader          # noqa: E402
import yaml.resolver as _yaml_resolver      # noqa: E402
import yaml.scanner as _yaml_scanner        # noqa: E402

_YAML_BREAKS = "\r\n\x85\u2028\u2029"


class _Yaml12Scanner(_yaml_scanner.Scanner):
    """pyyaml's scanner with YAML 1.2's whitespace: a tab separates tokens where no block
    indentation is being read (as libyaml has it), in a directive line, in a plain scalar's line
    whitespace and on its folded empty lines; `?` may stand inside a plain scalar in a flow
    collection."""

    def scan_to_next_token(self):
        if self.index == 0 and self.peek() == "\uFEFF":
            self.forward()
        while True:
            while self.peek() == " " or (self.peek() == "\t" and (
                    self.flow_level or not self.allow_simple_key)):
                self.forward()
            if self.peek() == "#":
                while self.peek() not in "\0" + _YAML_BREAKS:
                    self.forward()
            if not self.scan_line_break():
                return
            if not self.flow_level:
                self.allow_simple_key = True

    def scan_yaml_directive_value(self, start_mark):
        while self.peek() in " \t":
            self.forward()
        major = self.scan_yaml_directive_number(start_mark)
        if self.peek() != ".":
            raise _yaml_scanner.ScannerError("while scanning a directive", start_mark,
                                             f"expected a digit or '.', but found "
                                             f"{self.peek()!r}", self.get_mark())
        self.forward()
        minor = self.scan_yaml_directive_number(start_mark)
        if self.peek() not in "\0 \t" + _YAML_BREAKS:
            raise _yaml_scanner.ScannerError("while scanning a directive", start_mark,
                                             f"expected a digit or ' ', but found "
                                             f"{self.peek()!r}", self.get_mark())
        return (major, minor)

    def scan_directive_ignored_line(self, start_mark):
        while self.peek() in " \t":
            self.forward()
        super().scan_directive_ignored_line(start_mark)

    def scan_plain_spaces(self, indent, start_mark):
        length = 0
        while self.peek(length) in " \t":
            length += 1
        whitespaces = self.prefix(length)
        self.forward(length)
        if self.peek() not in _YAML_BREAKS:
            return [whitespaces] if whitespaces else []
        line_break = self.scan_line_break()
        self.allow_simple_key = True
        if self.prefix(3) in ("---", "...") and self.peek(3) in "\0 \t" + _YAML_BREAKS:
            return None
        breaks = []
        while self.peek() in " \t" + _YAML_BREAKS:
            if self.peek() in " \t":
                self.forward()
            else:
                breaks.append(self.scan_line_break())
                if self.prefix(3) in ("---", "...") and self.peek(3) in "\0 \t" + _YAML_BREAKS:
                    return None
        chunks = [line_break] if line_break != "\n" else [] if breaks else [" "]
        return chunks + breaks

    def scan_plain(self):
        chunks, start_mark = [], self.get_mark()
        end_mark, indent, spaces = start_mark, self.indent + 1, []
        ends = "\0 \t" + _YAML_BREAKS
        while self.peek() != "#":
            length = 0
            while True:
                ch = self.peek(length)
                if ch in ends or (ch == ":" and self.peek(length + 1) in ends + (
                        ",[]{}" if self.flow_level else "")) or (
                        self.flow_level and ch in ",[]{}"):
                    break
                length += 1
            if length == 0:
                break
            self.allow_simple_key = False
            chunks.extend(spaces)
            chunks.append(self.prefix(length))
            self.forward(length)
            end_mark = self.get_mark()
            spaces = self.scan_plain_spaces(indent, start_mark)
            if not spaces or self.peek() == "#" or (
                    not self.flow_level and self.column < indent):
                break
        return _yaml_scanner.ScalarToken("".join(chunks), True, start_mark, end_mark)


class Yaml12PureLoader(_yaml_reader.Reader, _Yaml12Scanner, _yaml_parser.Parser,
                       _yaml_composer.Composer, _yaml_resolver.BaseResolver):
    """The pure-Python parser with the YAML 1.2 scanner and the core-schema resolver."""

    yaml_implicit_resolvers = {}

    def __init__(self, stream):
        _yaml_reader.Reader.__init__(self, stream)
        _Yaml12Scanner.__init__(self)
        _yaml_parser.Parser.__init__(self)
        _yaml_composer.Composer.__init__(self)
        _yaml_resolver.BaseResolver.__init__(self)


# Texts libyaml is not asked about: a directive line, a tag, a comment right after a block scalar
# indicator (its answers there differ from YAML 1.2's and the pure parser's).
_YAML_PURE_ONLY = re.compile(r"^%|(?:^|[\s\[{,])!|[|>][-+0-9]*#", re.M)
_LIBYAML = hasattr(yaml, "CSafeLoader")


def yaml12_events(text, file):
    """parse_yaml's walk (_parse_events) over one answer with or without libyaml (I-223):
    libyaml's events where it accepts a text without the constructs _YAML_PURE_ONLY names, else
    the pure parser's; a yaml.YAMLError goes to parse_yaml, which locates it."""
    if _LIBYAML and not _YAML_PURE_ONLY.search(text):
        try:
            return _parse_events(Yaml12Loader, text, file)
        except yaml.YAMLError:
            pass                    # libyaml refuses: the pure parser's answer stands
    return _parse_events(Yaml12PureLoader, text, file)


class Yaml12Loader(getattr(yaml, "CSafeLoader", Yaml12PureLoader)):
    """libyaml's parser (the pure one when libyaml is absent) with the YAML 1.2 core-schema
    resolver (yes/no/on/off stay strings, 010 == 10)."""

    yaml_implicit_resolvers = {}


# The core schema's implicit types (§3.1's _CORE_SCHEMA), each by the characters it may begin
# with, in the order they are tried; no merge key among them (I-001).
for _tag, _first in (("tag:yaml.org,2002:bool", "tTfF"), ("tag:yaml.org,2002:int", "-+0123456789"),
                     ("tag:yaml.org,2002:float", "-+0123456789."),
                     ("tag:yaml.org,2002:null", ["~", "n", "N", ""])):
    for _loader in (Yaml12Loader, Yaml12PureLoader):
        _loader.add_implicit_resolver(_tag, re.compile(rf"^(?:{_CORE_SCHEMA[_tag].pattern})$"),
                                      list(_first))


# C.1 Providers ---------------------------------------------------------------------------
# PROVIDERS: openai, anthropic, google over urllib; the offline `fake` provider.
# Each request is the neutral dict LLMAgent builds:
# {agent, provider, model, temperature, max_tokens, system, messages, response_format}.


LLM_REQUEST_TIMEOUT = 120.0     # seconds for each connect / read of one HTTP request
LLM_MAX_RETRIES = 2             # retries after the first try (the vendors' SDK default)
LLM_RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
LLM_RETRY_AFTER_CAP = 60.0      # a longer Retry-After falls back to exponential back-off
LLM_NO_RETRY_CODES = frozenset({"insufficient_quota", "enforced_spend_limit_reached"})
ANTHROPIC_VERSION = "2023-06-01"


def scrub_key(text, key):
    """Replace every occurrence of the API key in `text` with ***."""
    return text.replace(key, "***") if key and isinstance(text, str) else text


def _retry_delay(headers, data, attempt, jitter=random.random):
    """Seconds to wait before retry number `attempt` (0-based): the server's word when it gives
    one of at most LLM_RETRY_AFTER_CAP, else min(0.5 * 2**attempt, 8) less a random quarter."""
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
            import email.utils      # here, not at the top: start-up pays ~7 ms for it (issue 15)
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
    # Exponential back-off with the SDKs' jitter (up to 25 % shorter), so that clients that
    # failed together do not retry together.
    return min(0.5 * 2 ** attempt, 8.0) * (1.0 - 0.25 * jitter())


def _http_post(url, headers, body, timeout):
    """One POST; returns (status, lower-cased headers, raw body). Network failures raise OSError."""
    import urllib.error, urllib.request   # on first use: start-up pays for none (issue 15)
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

    def complete(self, request, *, key, base_url, sleep=time.sleep, timeout=None,
                 jitter=random.random, record=None):
        """Send `request`; retry 408/409/429/5xx/529, timeouts and connection errors at most
        LLM_MAX_RETRIES times; return the reply text or raise ExecutionError (key scrubbed).
        `record` (a dict) receives `retries` and the vendor's token `usage`."""
        import urllib.error                  # on first use: start-up pays for none (issue 15)
        timeout = LLM_REQUEST_TIMEOUT if timeout is None else timeout
        if not re.match(r"https?://", base_url or ""):
            raise error(ExecutionError, f"{self.name}: base URL {base_url!r} is not an http(s) URL",
                        "4.4")
        url = self.endpoint(base_url.rstrip("/"), request["model"])
        body = self.body(request)
        headers = self.headers(key)
        used_fallbacks = set()
        attempt = 0
        while True:
            retry, data, resp_headers = True, None, {}
            try:
                status, resp_headers, raw = _http_post(
                    url, headers, json.dumps(body, default=str).encode("utf-8"), timeout)
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                    failure = f"request timed out after {timeout:g} s"
                else:
                    failure = f"connection error: {reason}"
            else:
                if 200 <= status < 300:
                    return self._parse_reply(raw, key, record)
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
                raise error(ExecutionError, scrub_key(f"{self.name}: {failure}", key), "4.4")
            sleep(_retry_delay(resp_headers, data, attempt, jitter))
            attempt += 1
            if record is not None:
                record["retries"] = attempt

    def usage(self, data):
        """The vendor's token counts as {input_tokens, output_tokens}, or None."""
        return None

    def _parse_reply(self, raw, key, record=None):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise error(ExecutionError, scrub_key(f"{self.name}: malformed JSON in the reply: "
                                  f"{raw[:200].decode('utf-8', 'replace')!r}", key),
                        "4.4") from None
        try:
            text = self.reply(data)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise error(ExecutionError, scrub_key(f"{self.name}: unexpected reply: {exc}", key),
                        "4.4") from None
        if record is not None:
            try:
                usage = self.usage(data)
            except (KeyError, TypeError, AttributeError):
                usage = None
            if usage:
                record["usage"] = usage
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
            raise error(ValueError, f"the model refused: {message['refusal']}")
        if not isinstance(content, str):
            raise error(ValueError, "choices[0].message.content is not text")
        return content

    def vendor_error(self, data):
        err = data.get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return "", "", True
        code = err.get("code") or err.get("type") or ""
        return str(code), str(err.get("message", "")), code not in LLM_NO_RETRY_CODES

    def usage(self, data):
        u = data.get("usage")
        return {"input_tokens": u.get("prompt_tokens"),
                "output_tokens": u.get("completion_tokens")} if isinstance(u, dict) else None

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
    STRUCTURED_TOOL = "structured_output"

    def endpoint(self, base, model):
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def headers(self, key):
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}

    def body(self, request):
        messages = []
        entries = list(request["messages"])
        # The Messages API wants the first turn from the user; an odd max_history (§4.4.4) can
        # leave an assistant entry first, whose question was truncated away: it is not sent.
        while entries and entries[0]["role"] == "assistant":
            entries.pop(0)
        for entry in entries:                   # consecutive same-role turns become one
            if messages and messages[-1]["role"] == entry["role"]:
                messages[-1] = {"role": entry["role"],
                                "content": messages[-1]["content"] + "\n\n" + entry["content"]}
            else:
                messages.append(dict(entry))
        # INTERPRETATION I-036 §4.4: Anthropic takes temperatures in [0, 1]; larger values are sent
        # as 1.
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
            raise error(ValueError, "the model refused (stop_reason: refusal)")
        blocks = [block for block in data["content"] if isinstance(block, dict)]
        parts = [block["text"] for block in blocks if block.get("type") == "text"]
        if parts:
            return "".join(parts)
        for block in blocks:        # the forced-tool form of structured output (see fallback)
            if block.get("type") == "tool_use" and block.get("name") == self.STRUCTURED_TOOL:
                return json.dumps(block.get("input"), ensure_ascii=False)
        raise error(ValueError, "the reply has no text content")

    def usage(self, data):
        u = data.get("usage")
        return {"input_tokens": u.get("input_tokens"),
                "output_tokens": u.get("output_tokens")} if isinstance(u, dict) else None

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
        if "output_config" in body and "output_config" in message and "structured" not in used:
            # Models or servers without output_config: force a tool whose input is the schema.
            used.add("structured")
            fixed = {k: v for k, v in body.items() if k != "output_config"}
            fixed["tools"] = [{"name": self.STRUCTURED_TOOL,
                               "description": "Give the answer as this tool's input.",
                               "input_schema": body["output_config"]["format"]["schema"]}]
            fixed["tool_choice"] = {"type": "tool", "name": self.STRUCTURED_TOOL}
            return fixed
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
            raise error(ValueError, f"the prompt was blocked ({reason})")
        first = candidates[0]
        if first.get("finishReason") in self.BLOCKED:
            raise error(ValueError, "the answer was blocked (finishReason: "
                        f"{first['finishReason']})")
        parts = [part["text"] for part in (first.get("content") or {}).get("parts") or []
                 if isinstance(part, dict) and "text" in part and not part.get("thought")]
        if not parts:
            raise error(ValueError, "the reply has no text parts")
        return "".join(parts)

    def usage(self, data):
        u = data.get("usageMetadata")
        return {"input_tokens": u.get("promptTokenCount"),
                "output_tokens": u.get("candidatesTokenCount")} if isinstance(u, dict) else None

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

    def complete(self, request, *, key, base_url, sleep=time.sleep, timeout=None,
                 jitter=random.random, record=None):
        return request["messages"][-1]["content"]


def note_llm_call(rt, call, started, error=None):
    """After one LLM call: the log entry gets no timing (vectors compare it), the host's
    `rt.llm_observer` (--trace) gets the entry plus latency and outcome."""
    observer = rt.llm_observer
    if observer is not None:
        observer({**call, "latency": time.monotonic() - started, "error": error})


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
            raise error(ExecutionError, f"{request['provider']}: {reply['error']}", "4.4")
        return message_text(reply)


# name -> adapter. Rows: the §4.4.1 providers, then this host's extra `fake`.
PROVIDERS = {
    "openai":    OpenAIAdapter(),
    "anthropic": AnthropicAdapter(),
    "google":    GoogleAdapter(),
    "fake":      FakeAdapter(),
}


# C.2 Load, Actor and render -----------------------------------------------------------

def read_sources(paths, text):
    """The raw documents, in order: files first, then `text` (as '<text>')."""
    sources = []
    for p in paths:
        try:
            sources.append((str(p), Path(p).read_bytes()))
        except OSError as exc:
            raise error(ConfigurationError, f"cannot read configuration file: {exc.strerror}",
                        "3.1", file=str(p)) from None
        except (ValueError, TypeError) as exc:     # a NUL byte in the path, or not a path
            raise error(ConfigurationError, f"cannot read configuration file: {exc}", "3.1",
                        file=repr(p)) from None
    if text is not None:
        sources.append(("<text>", text))
    if not sources:
        raise error(ConfigurationError, "no configuration given (a path or text=...)", "3.1")
    return sources


class Result:
    """What one call observed: the messages emitted on __output__ and on __error__, in order."""

    __slots__ = ("outputs", "errors")

    def __init__(self, outputs=None, errors=None):
        self.outputs = [] if outputs is None else outputs
        self.errors = [] if errors is None else errors

    def __repr__(self):
        return f"Result(outputs={[m.content for m in self.outputs]!r}, " \
               f"errors={[m.content for m in self.errors]!r})"


class Actor:
    """A running Actor (§12.1 step 7): send messages, move the clock, inspect context and graphs."""

    def __init__(self, rt, network, default_router):
        self.rt = rt
        self.network = network
        self.default_router = default_router
        # What the current call has seen; each call starts the lists afresh. Emissions happen
        # on the calling thread (graph branches hand their results back, §6.7); the hooks are
        # bare list.append, which is atomic, should a host hook emit from elsewhere.
        self._outputs, self._errors = [], []
        network.on_output(self._outputs.append)
        network.on_error(self._errors.append)
        # One host call at a time: the stream network, its operators' state and the lists above
        # are driven by one thread; calls from several host threads take turns (README
        # Concurrency). Re-entrant, so a hook may call back in.
        self._turn = threading.RLock()
        if isinstance(network.flow, DirectFlow):        # APPENDIX A.3: send() in one piece
            self.send = actor_sender(self)

    # -- one call: _begin(), act, then _end() returns what it emitted
    def _begin(self):
        del self._outputs[:], self._errors[:]       # emissions between calls belong to no call

    def _end(self):
        if self.rt.clock.real and not self.rt.clock.driven:
            self.network.settle()
        outputs, errors = self._outputs, self._errors
        result = Result(outputs[:], errors[:])
        del outputs[:], errors[:]
        return result

    # -- the public API
    @property
    def context(self):
        """The live global context dict (§10)."""
        return self.rt.context

    def send(self, content, *, at=None, target=None):
        """Submit one message (to `target`, else the default router / __input__, §3.4) and run it
        to quiescence."""
        with self._turn:
            self._begin()
            if at is not None:              # timers falling due on the way belong to this call
                self.network.deliver(self.rt.clock.set_time, at)
            self.network.send(content, target)
            return self._end()

    def advance(self, seconds):
        """Move the clock on by `seconds`, firing due timers (debounce, delay, buffer, sample)."""
        if type(seconds) not in (int, float) or not math.isfinite(seconds):
            raise error(ApplicationError, "advance() takes a finite number of seconds, not "
                        f"{seconds!r}")
        with self._turn:
            self._begin()
            self.network.deliver(self.rt.clock.advance, seconds)   # timers fire deliveries
            return self._end()

    def complete(self):
        """Complete __input__: buffers flush and reduce emits (§5.3.2)."""
        with self._turn:
            self._begin()
            self.network.complete()
            return self._end()

    def subscribe(self, stream, fn):
        """Call fn(message) for every message on `stream` from now on (hot and replay streams first
        replay their memory, §5.3.1). Any stream may be watched from the host, the §6.10
        graph-internal ones (mixed mode) included; unknown names are a RoutingError."""
        with self._turn:
            self.network.subscribe(stream, fn)

    def watch(self, fn):
        """Trace the Actor: fn(stream, message) for every message any stream carries and every
        graph node and run event (the §6.10 streams' messages, in pure graph mode too), each
        seen before it moves on. `python actor.py --trace` prints them (trace_line)."""
        with self._turn:
            self.network.watch(fn)

    def close(self):
        """§12.1 step 8: dispose of subscriptions, agents and streams (after the call in
        progress, if any; a timed-out agent call still running is not waited for)."""
        with self._turn:
            self.network.close()
            self.rt.sandbox.close()
            for graph in self.rt.graphs.values():
                graph.close()
            for agent in self.rt.agents.values():
                close = getattr(agent, "close", None)     # composites own workers and wiring
                if close is not None:
                    close()
            self.rt.agents.clear()
            self.rt.graphs.clear()
            self.send = self._send_after_close

    def _send_after_close(self, content, *, at=None, target=None):
        raise error(ApplicationError, "the Actor is closed (§12.1 step 8): load it again to send "
                    "more messages", "12.1")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- graphs (§6.6)
    def _graph(self, route):
        if route not in self.rt.graphs:
            raise error(RoutingError, f"'{route}' is not a graph route", "6.6")
        return self.rt.graphs[route]

    def checkpoints(self, route):
        return self._graph(route).checkpoints()

    def restore(self, route, path=None):
        return self._graph(route).restore(path)

    def rewind(self, route, steps):
        return self._graph(route).rewind(steps)

    def resume(self, route):
        """Continue a graph run interrupted after its last checkpoint (restore() first)."""
        with self._turn:
            self._begin()
            self._graph(route).resume(self.rt.context)
            return self._end()

    # -- inspection (§4.11)
    def describe(self):
        """Agents with type, capabilities and metadata; routes with their type (§4.11); each
        graph route's §6.11 analysis, as the runtime holds it (cycles, topological levels,
        unreachable nodes)."""
        agents = {name: {"type": a.type, "capabilities": list(a.capabilities),
                         "metadata": jsonable(a.metadata)} for name, a in self.rt.agents.items()}
        routes = {name: route["type"] for name, route in self.rt.doc.data["routes"].items()}
        graphs = {name: {"has_cycles": g.analysis.has_cycles, "levels": g.analysis.levels,
                         "unreachable": list(g.analysis.unreachable)}
                  for name, g in self.rt.graphs.items()}
        return {"name": self.rt.doc.data.get("name"), "agents": agents, "routes": routes,
                "graphs": graphs, "default_router": self.default_router,
                "template_engine": self.rt.engine}

    def diagram(self):
        """A Mermaid flowchart of the whole Actor: stream side, then each graph."""
        lines = ["flowchart LR"]
        lines += ["  " + line for line in self.network.mermaid()]
        for graph in self.rt.graphs.values():
            lines += ["  " + line for line in graph.mermaid()]
        for name in self.rt.graphs:         # each graph route's node runs the graph's body
            if name in self.network.nodes:
                lines.append(f"  {mermaid_stream_id(name)} -. runs .-> {mermaid_entry_id(name)}")
        return "\n".join(lines) + "\n"


def load(*paths, text=None, render_context=None, unsafe=False, env=None, template_engine=None,
         default_router=None, provider=None, workdir=None, clock=None, llm=None, context=None,
         routing_prefixes=None, isolation="none", reference=None):
    """Load, validate and start an Actor from files and/or `text` (merged in order, §3.1).

    env: the environment for ${VAR} and API keys (default os.environ). llm: {agent: [replies]} fakes
    the LLM transport. context: host invocation-context keys (§10.3). clock: a VirtualClock by
    default. routing_prefixes: extra §12.5 prefixes stripped from __output__ (e.g. ["NOTE:"], or
    "X_" for a family X_<NAME>:). isolation: "none" (default) or "process" -- configuration code,
    expressions and templates then run in worker processes under OS limits (§13.2, README Security).
    reference: True runs the body's own code at every speed and containment seam (APPENDICES);
    None (default) reads ACTOR_REFERENCE from the process environment (1: on).
    """
    if reference is None:
        reference = reference_path_requested()
    return start_actor(
        read_sources(paths, text), render_context=render_context, unsafe=unsafe, env=env,
        template_engine=template_engine, default_router=default_router, provider=provider,
        workdir=workdir, clock=clock or VirtualClock(),
        llm_transport=FakeTransport(llm) if llm is not None else None, context=context,
        routing_prefixes=routing_prefixes, isolation=isolation, reference=bool(reference))


def reference_path_requested(environ=None):
    """ACTOR_REFERENCE=1 (any value but empty or 0) asks for the reference path (APPENDICES)."""
    value = (os.environ if environ is None else environ).get("ACTOR_REFERENCE", "")
    return value.strip() not in ("", "0")


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


# C.3 The vector harness ---------------------------------------------------------------
# Adds: the vector harness, which lives in vectors/run.py beside this file (the format, the --impl
# protocol and the report: vectors/README.md); this part finds it and binds it to this module.
# Stands in for: nothing in the body -- the harness loads each vector through start_actor.
# Seam: start_actor
VECTOR_HARNESS = ("vectors", "run.py")      # beside actor.py
WARNING_SECTION = re.compile(r"\(§([^()]*)\)\s*$")     # the `(§x.y)` that ends a warning's text
_harnesses = {}


def vector_harness(module=None):
    """vectors/run.py, loaded and bound to `module` (default: this module as it runs, which under
    `python actor.py` is __main__: the harness never imports a second copy of actor's classes);
    None when the file is absent (actor.py vendored alone). Loaded once per module."""
    module = module or sys.modules[__name__]
    if id(module) not in _harnesses:
        import importlib.util   # the harness only: start-up imports none of this
        path = Path(__file__).resolve().parent.joinpath(*VECTOR_HARNESS)
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(f"actor_vector_harness_{id(module)}", path)
        harness = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harness)
        harness.bind(module)
        _harnesses[id(module)] = harness
    return _harnesses[id(module)]


# C.4 Real clock, describe text and diagram --------------------------------------------
# Host mechanisms the standard does not define: the CLI's wall clock (vectors and tests run on the
# VirtualClock), the one-line route summaries of --describe, and the Mermaid text of --diagram.

class RealClock(VirtualClock):
    """Wall-clock seconds since creation; advance() really waits. start(turn) fires timers on a
    background thread as real time passes (the CLI's one running Actor); stop() ends that."""

    real = True

    def __init__(self):
        super().__init__()
        self._t0 = time.monotonic()
        self._wake = threading.Condition(self._lock)
        self._driver = None
        self._stopping = False

    def now(self):
        return time.monotonic() - self._t0

    @property
    def driven(self):
        """True while the background thread fires timers (callers then never wait them out)."""
        return self._driver is not None

    def call_at(self, when, fn):
        timer = super().call_at(when, fn)
        with self._lock:
            self._wake.notify_all()
        return timer

    def start(self, turn):
        """Fire each timer when it falls due, on a daemon thread, inside `turn` (the Actor's lock,
        so that a timer never runs in the middle of a host call)."""
        def drive():
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    due = self.next_due()
                    wait = None if due is None else due - self.now()
                    if wait is None or wait > 0:
                        self._wake.wait(wait)
                        continue
                with turn:
                    timer = self._pop_due(self.now())
                    if timer is not None:
                        try:
                            timer.fn()
                        except Exception as exc:  # boundary: logged, and the clock runs on
                            log.error("actor: a timer failed: %s: %s", type(exc).__name__, exc)
        self._stopping = False
        self._driver = threading.Thread(target=drive, name="actor-clock", daemon=True)
        self._driver.start()

    def stop(self):
        """End the background thread (timers still pending stay queued for advance())."""
        driver = self._driver
        if driver is None:
            return
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        driver.join()
        self._driver = None

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


def _describe_op(op):
    params = op.get("params") or {} if isinstance(op, dict) else {}
    kind = op.get("type", "?") if isinstance(op, dict) else "?"
    detail = params.get("agent") or params.get("graph") or params.get("function") or ""
    if not detail and isinstance(params.get("condition"), dict):
        detail = params["condition"].get("type", "")
    return f"{kind}({detail})" if detail else kind


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


def mermaid_name(name):
    """A name as Mermaid id characters, one to one: letters and digits stay, '_' is '__', any
    other character is '_<lower-case hex code point>_' (so x-y and x_y stay apart)."""
    return "".join(c if c.isascii() and c.isalnum() else "__" if c == "_" else f"_{ord(c):x}_"
                   for c in str(name))


def mermaid_id(graph_name, node_name):
    """A graph node's id: g_<graph>_S_<node>. The prefixes keep every id clear of Mermaid's
    keywords (end, graph, style, class, click, subgraph ...), and '_S' / '_E' never occur
    inside mermaid_name, so no two (graph, node) pairs share an id."""
    return f"g_{mermaid_name(graph_name)}_S_{mermaid_name(node_name)}"


def mermaid_entry_id(graph_name):
    return f"g_{mermaid_name(graph_name)}_E"


def mermaid_subgraph_id(graph_name):
    return f"G_{mermaid_name(graph_name)}"


def mermaid_stream_id(name):
    return f"s_{mermaid_name(name)}"


MERMAID_ENTITIES = {"#": "#35;", '"': "#quot;", "&": "#amp;", "<": "#lt;", ">": "#gt;",
                    "`": "#96;"}


def mermaid_text(text):
    """Text for a quoted Mermaid label: '#' and the characters a quoted string or its HTML would
    read are entity codes; line breaks become spaces."""
    return "".join(MERMAID_ENTITIES.get(c, " " if c in "\r\n" else c) for c in str(text))


# Node shapes in the diagram, by node type.
MERMAID_SHAPES = {
    "start": '(["{}"])', "end": '(["{}"])', "agent": '["{}"]', "function": '[["{}"]]',
    "tool": '[["{}"]]', "conditional": '{{"{}"}}', "subgraph": '[["{}"]]',
    "message_router": '{{"{}"}}',
}


def mermaid_graph(graph):
    """The graph as a Mermaid `subgraph` block (nodes in declaration order, then the edges)."""
    gid = mermaid_subgraph_id(graph.name)
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
    entry = mermaid_entry_id(graph.name)
    lines.append(f"  {entry}((entry)) --> {mermaid_id(graph.name, graph.entry)}")
    for edge in graph.edges:
        arrow = "-->"
        if edge.condition is not None:
            arrow = f'-->|"{mermaid_text(describe_condition(edge.condition))}"|'
        lines.append(f"  {mermaid_id(graph.name, edge.source)} {arrow} "
                     f"{mermaid_id(graph.name, edge.target)}")
    lines.append("end")
    return lines


# C.5 Command line ---------------------------------------------------------------------
# One clock model: the CLI runs one Actor on a RealClock whose timers fire on a background thread
# as real time passes; -m messages and stdin lines flow into it as they come, and the end of input
# completes __input__ (buffers flush, reduce emits) before exit -- the API's outputs for the same
# timed input. Outputs print as they are emitted, wherever they come from (a send, a timer).
EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG = 0, 1, 2     # EXIT_CONFIG also answers bad usage
EXIT_INTERNAL = 70                                 # a bug in actor.py (sysexits' EX_SOFTWARE)
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141      # the shells' 128 + SIGINT / SIGPIPE
# Stream deliveries are steps of one loop (§5.3 Flow, I-200) and need no deep stack; what still
# nests calls is configuration nesting a run follows (a composite inside a composite, a graph
# run from a graph_execute inside a composite). The CLI raises the limit after loading (so that
# loading refuses what the API refuses, e.g. a document nested 3,000 deep) and runs on a thread
# whose stack holds that many frames.
CLI_STACK_BYTES = 256 * 1024 * 1024
CLI_RECURSION_LIMIT = 20_000
MISSING_KEY_PLACEHOLDER = "(no key: --check only)"


def _parse_set(items, option):
    """--set a.b=3 -> {"a": {"b": 3}} (each value read as YAML 1.2: 3, true, [1, 2], text)."""
    result = {}
    for item in items or []:
        key, equals, raw = item.partition("=")
        parts = key.split(".")
        if not equals or not all(part.strip() for part in parts):
            raise error(ConfigurationError, f"{option} expects KEY=VALUE (KEY: names joined by "
                        f"dots), got '{item}'")
        try:
            value, _ = parse_yaml(raw) if raw.strip() else ("", None)
        except ConfigurationError as exc:      # located in the value, not in a file
            problem = exc.message.removeprefix("document does not parse as YAML: ")
            shown = item if len(item) <= 60 else item[:57] + "..."
            raise error(ConfigurationError, f"{option} {shown}: the value does not parse as YAML: "
                        f"{problem}") from None
        node = result
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):   # --set a=1 --set a.b=2: a is not a mapping
                raise error(ConfigurationError, f"{option} {item}: '{'.'.join(parts[:depth + 1])}' "
                            f"was set to a value, not a mapping")
        node[parts[-1]] = value
    return result


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (exit status 2), not the whole usage text."""

    def error(self, message):
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(kind):
    """An argparse type: a finite number above zero of `kind` (int or float)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise error(argparse.ArgumentTypeError, f"expects a number above zero, got '{text}'")
        return value
    return parse


CLI_USAGE = """actor CONFIG... [-m TEXT]... [options]
       actor --check|--describe|--diagram [options] CONFIG...
       actor --vectors PATH... [harness options: actor --vectors --help]
       actor --report OUT.html RESULT.json...
       actor --schema | --run-vector | --version"""


def _arg_parser():
    p = _ArgumentParser(
        prog="actor", usage=CLI_USAGE, description="Run, check or inspect Actor configurations "
        "(Actor Configuration Standard 1.0.0).", epilog="Exit status: 0 ok; 1 a message reached "
        "__error__, a run failed, or a vector failed; 2 bad usage, or a configuration refused at "
        "load (any §20 category), or a warning under --strict; 70 an internal error of actor.py; "
        "130 interrupted (Ctrl-C); 141 output pipe closed. --vectors PATH..., --run-vector and "
        "--report hand the command line to the vector harness, vectors/run.py (its options: "
        "actor --vectors --help).")
    p.add_argument("configs", nargs="*", metavar="CONFIG",
                   help="configuration files, merged in order")
    p.add_argument("-m", "--message", action="append", metavar="TEXT",
                   help="a message to send (repeatable); default: one message per stdin line")
    p.add_argument("--unsafe", action="store_true", help="run the host in unsafe mode (§13.1)")
    p.add_argument("--isolate", action="store_true", help="run configuration code, expressions and "
                   "templates in worker processes (§13.2, README Security)")
    p.add_argument("--provider", metavar="NAME", help="use this provider for every llm agent "
                   "(e.g. fake: offline, no key)")
    p.add_argument("--reply", action="append", metavar="TEXT",
                   help="with --provider fake: the model's next reply (repeatable, used in order; "
                   "then it echoes)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a value of the Phase A rendering context (§8.2); KEY may be dotted "
                   "(a.b=1), VALUE is read as YAML (repeatable)")
    p.add_argument("--context", action="append", metavar="KEY=VALUE",
                   help="a host invocation-context key (§10.3), e.g. _temperature_override=0.2 "
                   "(repeatable)")
    p.add_argument("--engine", metavar="NAME",
                   help="the host's template engine (§9.2): JINJA2, MUSTACHE or SIMPLE")
    p.add_argument("--default-router", metavar="ROUTE", help="the default router (§9.3)")
    p.add_argument("--json", action="store_true", help="print JSON lines with content and metadata "
                   "(errors too, on stdout); with --describe: the description as JSON, with "
                   "the graph analysis (§6.11)")
    p.add_argument("--trace", action="store_true", help="print every stream message, graph step "
                   "and LLM call to stderr as it happens")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log details: what was loaded, each LLM call (DEBUG level)")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only (no warnings)")
    p.add_argument("--check", action="store_true",
                   help="load and validate only (several CONFIGs: their merged document)")
    p.add_argument("--strict", action="store_true", help="warnings are errors (exit status 2)")
    p.add_argument("--describe", action="store_true", help="print agents and routes (§4.11)")
    p.add_argument("--diagram", action="store_true", help="print a Mermaid flowchart")
    p.add_argument("--schema", action="store_true",
                   help="print a JSON Schema (draft 2020-12) of the configuration format")
    p.add_argument("--version", action="version",
                   version=f"actor.py {__version__} (Actor Configuration Standard {SPEC_VERSION})")
    return p


# What each way of running reads. An option the chosen way would ignore is a usage error (exit
# status 2), never silently dropped: `--check -m hi` does not pretend to send anything.
CLI_MODES = ("check", "describe", "diagram", "schema")
_CLI_LOAD_OPTIONS = ("configs", "unsafe", "isolate", "provider", "set", "context", "engine",
                     "default_router", "strict")
CLI_MODE_OPTIONS = {
    "run": _CLI_LOAD_OPTIONS + ("message", "reply", "json", "trace"),
    "check": _CLI_LOAD_OPTIONS,
    "describe": _CLI_LOAD_OPTIONS + ("json",),
    "diagram": _CLI_LOAD_OPTIONS,
    "schema": (),
}


def usage_problem(args, parser):
    """The one-line complaint about a command line whose options do not go together, or None."""
    flag = {a.dest: (a.option_strings[0] if a.option_strings else "CONFIG")
            for a in parser._actions}
    given = [dest for dest in flag if dest not in ("help", "version")
             and getattr(args, dest, None) not in (None, False, [])]
    if args.verbose and args.quiet:
        return "-v and -q exclude each other"
    modes = [dest for dest in CLI_MODES if dest in given]
    if len(modes) > 1:
        return f"{flag[modes[0]]} and {flag[modes[1]]} exclude each other: choose one"
    mode = modes[0] if modes else "run"
    for dest in given:
        if dest in CLI_MODES or dest in ("verbose", "quiet") or dest in CLI_MODE_OPTIONS[mode]:
            continue
        if dest == "configs":
            return f"{flag[mode]} takes no CONFIG (got {' '.join(args.configs)})"
        if mode == "run":
            homes = [flag[m] for m in CLI_MODES if dest in CLI_MODE_OPTIONS[m]]
            return f"{flag[dest]} works only with {' or '.join(homes)}"
        return f"{flag[dest]} does nothing with {flag[mode]}"
    if mode in ("run", "check", "describe", "diagram") and not args.configs:
        return "give at least one CONFIG (or --vectors, --schema)"
    if args.provider == "":
        return "--provider needs a name (e.g. fake)"
    if args.reply and args.provider != "fake":
        return "--reply scripts the fake model: add --provider fake"
    return None


# "Did you mean" ---------------------------------------------------------------------------
SUGGEST_LIST_MAX = 8        # name every valid choice when there are at most this many


def did_you_mean(name, candidates):
    """' (did you mean 'x'?)' for the closest candidate, and the valid names when few; or ''."""
    names = sorted({str(c) for c in candidates if str(c) != str(name)})
    if not names:
        return ""
    import difflib              # error paths only: not imported at start-up (issue 15)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    parts = [f"did you mean '{close[0]}'?"] if close else []
    if len(names) <= SUGGEST_LIST_MAX:
        parts.append("valid: " + ", ".join(names))
    return f" ({' '.join(parts)})" if parts else ""


def _names_in(data):
    """Agents, routes, graph nodes and stream names declared by a (merged) document."""
    data = data if isinstance(data, dict) else {}
    agents = list(data["agents"]) if isinstance(data.get("agents"), dict) else []
    routes = data.get("routes") if isinstance(data.get("routes"), dict) else {}
    nodes = {name: ["start", "end"] + list(route.get("nodes") or {})
             for name, route in routes.items()
             if isinstance(route, dict) and isinstance(route.get("nodes"), dict)}
    streams = list(routes) + list(BUILTIN_STREAMS)
    links = [link for key in ("merges", "splits") if isinstance(data.get(key), list)
             for link in data[key]]
    for link in links:
        if isinstance(link, dict) and isinstance(link.get("target"), str):
            streams.append(link["target"])
        if isinstance(link, dict) and isinstance(link.get("targets"), dict):
            streams.extend(str(t) for t in link["targets"])
    return agents, list(routes), nodes, streams


def _field_names(path_text):
    """The field table a `path: unknown ... field` warning refers to, by the start of its path."""
    head = path_text.split(".")[0].split("[")[0]
    return {"merges": MERGE_FIELDS, "splits": SPLIT_FIELDS, "agents": AGENT_FIELDS}.get(head, ())


# (pattern over an error or warning text, candidates(data, match)) -- our own wording, so the
# hints follow it; a message no pattern knows gets no hint.
NAME_HINTS = (
    (r"unknown agent '([^']*)'", lambda d, m: _names_in(d)[0]),
    (r"default_router '([^']*)' is not a route", lambda d, m: _names_in(d)[1]),
    (r"unknown agent type '([^']*)'", lambda d, m: AGENT_TYPES),
    (r"unknown operator '([^']*)'", lambda d, m: OPERATORS),
    (r"unknown param '([^']*)' of operator '([^']*)'",
     lambda d, m: OPERATORS[m.group(2)][1] if m.group(2) in OPERATORS else ()),
    (r"unknown node type '([^']*)'", lambda d, m: NODE_TYPES),
    (r"'([^']*)' is not a node of graph '([^']*)'",
     lambda d, m: _names_in(d)[2].get(m.group(2), ())),
    (r"'([^']*)' is not a known route or (?:built-in )?stream", lambda d, m: _names_in(d)[3]),
    (r"'([^']*)' is a reserved internal stream name", lambda d, m: BUILTIN_STREAMS),
    (r"unknown built-in tool '([^']*)'", lambda d, m: BUILTIN_TOOLS),
    (r"unknown match_type '([^']*)'", lambda d, m: MATCH_TYPES),
    (r"condition type '([^']*)' is not honoured", lambda d, m: CONDITIONS),
    (r"unknown top-level section '([^']*)'",
     lambda d, m: list(TOP_LEVEL_SECTIONS) + list(HOST_PARAMETER_FIELDS)),
    (r"unknown llm agent field '([^']*)'", lambda d, m: LLM_AGENT_FIELDS),
    (r"unknown tool agent field '([^']*)'", lambda d, m: TOOL_AGENT_FIELDS),
    (r"(\S+): unknown field '([^']*)'", lambda d, m: _field_names(m.group(1))),
)


def name_hint(text, data=None):
    """The "did you mean" hint for an error or warning text about an unknown name, or ''."""
    for pattern, candidates in NAME_HINTS:
        found = re.search(pattern, text)
        if found:
            name = found.group(2) if pattern.startswith(r"(\S+)") else found.group(1)
            try:
                return did_you_mean(name, candidates(data, found))
            except (TypeError, KeyError, AttributeError):     # a document of the wrong shape
                return ""
    return ""


def with_hint(text, data=None):
    """`text` with its hint inserted before the closing `(§x.y)`, or appended."""
    hint = name_hint(text, data)
    if not hint:
        return text
    found = WARNING_SECTION.search(text)
    return text[:found.start()] + hint.strip() + " " + text[found.start():] if found \
        else text + hint


class _HintFilter(logging.Filter):
    """Adds "did you mean" to the warnings the Actor logs (the texts in rt.warnings stay as
    they are)."""

    def __init__(self):
        super().__init__()
        self.data = None

    def filter(self, record):
        if record.levelno == logging.WARNING and isinstance(record.msg, str) and not record.args:
            record.msg = with_hint(record.msg, self.data)
        return True


def _document_data(args):
    """The merged document for hints after a failed load, or None when even that fails."""
    try:
        rt = Runtime(Doc(None), env={})
        return load_document(read_sources(args.configs, None),
                             _parse_set(args.set, "--set") or None,
                             args.engine, {}, rt).data
    except ActorError:
        return None


def unconsumed_target_warnings(actor):
    """A merge or split target that is no route, that nothing reads, and whose name is close to
    a known stream: most likely a typo (the messages go nowhere)."""
    data = actor.rt.doc.data
    routes = list(data.get("routes") or {})
    known = routes + list(BUILTIN_STREAMS)
    read = {s for m in data.get("merges") or [] if isinstance(m, dict)
            for s in (m.get("sources") or []) if isinstance(s, str)}
    read |= {s.get("source") for s in data.get("splits") or [] if isinstance(s, dict)}
    texts = []
    places = [(("merges", i, "target"), m.get("target")) for i, m in
              enumerate(data.get("merges") or []) if isinstance(m, dict)]
    places += [(("splits", i, "targets", t), t) for i, s in enumerate(data.get("splits") or [])
               if isinstance(s, dict) and isinstance(s.get("targets"), dict) for t in s["targets"]]
    for path, target in places:
        if not isinstance(target, str) or target in known or target in read:
            continue
        import difflib          # error paths only: not imported at start-up (issue 15)
        if difflib.get_close_matches(target, known, n=1, cutoff=0.75):
            texts.append(actor.rt.warn(f"'{target}' is no route and nothing reads it; its "
                                       f"messages go nowhere{did_you_mean(target, known)}",
                                       section="7.1" if path[0] == "merges" else "7.2",
                                       path=path))
    return texts


# JSON Schema (--schema) -----------------------------------------------------------------------
# Generated from the tables the validator reads (TOP_LEVEL_SECTIONS, AGENT_TYPES, LLM_FIELDS,
# TOOL_AGENT_FIELDS, ROUTE_FIELDS, GRAPH_FIELDS, OPERATORS, NODE_TYPES, CONDITIONS, ...), for
# editors: completion, and the structural rejections (a field of the wrong type, a required field
# missing). Where the loader warns about an unknown key (top level, agents, llm and tool configs,
# routes, operators and their params, nodes, edges, router rules, merges, splits, conditions), the
# schema says `unevaluatedProperties: false`, so an editor flags the same misspelt key; every
# `pattern` stands beside `type: string`. A scalar may also be a ${VAR} reference (§14), which
# becomes its value at load.
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_ENV_REFERENCE = {"type": "string", "pattern": r"\$\{"}
_JSON_TYPES = ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"))


def _schema_for_types(types):
    """A Python type tuple from a field table as a schema fragment."""
    names = [name for kind, name in _JSON_TYPES if kind in types]
    if float in types:
        names.append("number")
    elif int in types:
        names.append("integer")
    fragment = {"type": names[0] if len(names) == 1 else names}
    return fragment if names == ["string"] else {"anyOf": [fragment, _ENV_REFERENCE]}


def _schema_fields(table, null_is_default=False):
    """A field table ({name: Field}) -> JSON Schema properties, with the JSON defaults; a null is
    accepted where check_fields reads it as "not given" (I-172)."""
    properties = {}
    for field, row in table.items():
        default = row.default
        fragment = dict(_schema_for_types(row.constraint.types))
        if null_is_default or default is None:
            fragment = {"anyOf": [fragment, {"type": "null"}]}
        if default is not None and default is not REQUIRED \
                and not isinstance(default, (dict, list)):
            fragment["default"] = default
        properties[field] = fragment
    return properties


def _any_case(words):
    """A pattern matching any of `words` in any letter case (route and node types)."""
    return "^(?:" + "|".join("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c)
                                     for c in word) for word in words) + ")$"


# One schema per constraint an OPERATORS parameter row uses.
_CONSTRAINT_SCHEMAS = {
    SECONDS: {"anyOf": [{"type": "number", "minimum": 0}, _ENV_REFERENCE]},
    POSITIVE_SECONDS: {"anyOf": [{"type": "number", "minimum": 0}, _ENV_REFERENCE]},
    NON_NEGATIVE_INT: {"anyOf": [{"type": "integer", "minimum": 0}, _ENV_REFERENCE]},
    POSITIVE_INT: {"anyOf": [{"type": "integer", "minimum": 1}, _ENV_REFERENCE]},
    STRING: {"type": "string"}, FUNCTION_REF: {"type": "string"},
    STREAM_NAME: {"type": "string"},
    CONDITION: {"$ref": "#/$defs/condition"}, TRANSFORM_SPEC: {"type": "object",
                                                               "required": ["type"]},
    ACCUMULATOR: {"type": "object", "properties": {"type": {"enum": list(ACCUMULATORS)}},
                  "required": ["type"]},
    CASES: {"type": "array", "items": {"type": "object"}},
    OPERATOR_LIST: {"type": "array", "items": {"$ref": "#/$defs/operator"}},
    ROUTE_CONDITIONS: {"type": "object", "additionalProperties": {"$ref": "#/$defs/condition"}},
}


def _closed(schema):
    """Unknown keys are flagged, as the loader warns about them (see the comment above)."""
    return {**schema, "unevaluatedProperties": False}


def _type_is(words):
    """An if-condition: the mapping's `type` names one of `words`, in any letter case."""
    return {"required": ["type"], "properties": {"type": {"type": "string",
                                                          "pattern": _any_case(words)}}}


def config_schema():
    """The configuration format as a JSON Schema (draft 2020-12) object."""
    names = {"type": "array", "items": {"type": "string"}}
    condition = _closed({"type": "object", "properties": {
        "type": {"anyOf": [{"enum": list(CONDITIONS)}, {"type": "string"}]},
        **{key: {} for key in sorted(set(CONDITION_FIELDS) - {"type"})}}})
    operators = []
    for kind, (_handler, spec) in OPERATORS.items():
        params = {key: _CONSTRAINT_SCHEMAS.get(row.constraint, {}) for key, row in spec.items()}
        required = [key for key, row in spec.items() if row.default is REQUIRED]
        params_schema = {"type": "object", "properties": params}
        if kind not in OPEN_PARAMS:
            params_schema = _closed(params_schema)
        if required:
            params_schema["required"] = required
        operators.append({"if": {"required": ["type"], "properties": {"type": {"const": kind}}},
                          "then": {"properties": {"params": params_schema},
                                   **({"required": ["params"]} if required else {})}})
    operator = _closed({"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": list(OPERATORS)},
                                       "params": {"type": "object"}},
                        "allOf": operators})
    rule = _closed({"type": "object", "properties": {
        **{key: {} for key in ROUTER_RULE_FIELDS},
        "match_type": {"enum": list(MATCH_TYPES)}, "pattern": {"type": "string"},
        "target": {"type": "string"}}})
    node_fields = {"metadata": {"type": "object"}, "parallel": {"type": "boolean"},
                   "description": {}, "agent": {"type": "string"},
                   "function": {"type": "string"}, "tools": {"type": ["array", "string"]},
                   "condition": {"$ref": "#/$defs/condition"}, "graph": {"type": "string"},
                   "rules": {"type": "array", "items": rule}}
    # Every key some node type has is listed at the node itself: a then-branch whose own check
    # fails drops its annotations, and would report a good key as unknown beside the real fault.
    node_keys = {key for _handler, fields in NODE_TYPES.values() for key in fields}
    node = _closed({"type": "object", "required": ["type"], "properties": {
        **{key: {} for key in sorted(node_keys)},
        **{key: node_fields.get(key, {}) for key in NODE_COMMON_FIELDS},
        "type": {"type": "string", "pattern": _any_case(list(NODE_TYPES))}},
        "allOf": [{"if": _type_is([kind]),
                   "then": {"properties": {key: node_fields.get(key, {}) for key in fields},
                            **({"required": list(fields)[:1]}
                               if kind in ("agent", "subgraph") else {})}}
                  for kind, (_handler, fields) in NODE_TYPES.items()]})
    edge = _closed({"type": "object", "required": ["source", "target"], "properties": {
        **{key: {} for key in EDGE_FIELDS},
        "source": {"type": "string"}, "target": {"type": "string"},
        "condition": {"anyOf": [{"$ref": "#/$defs/condition"}, {"type": "null"}]},
        "metadata": {"type": "object"}}})
    graph_props = {key: {} for key in ROUTE_FIELDS["graph"]}
    graph_props.update({
        "nodes": {"type": "object", "minProperties": 1, "additionalProperties": node},
        "edges": {"type": "array", "items": edge}, "entry_point": {"type": "string"},
        "checkpoint_dir": {"type": "string"}, "state_class": {"type": "string"},
        "metadata": {"type": "object"}, "publications": names})
    for flag in ("checkpointing", "enable_time_travel", "parallel_execution"):
        graph_props[flag] = {"anyOf": [{"type": "boolean"}, _ENV_REFERENCE],
                             "default": GRAPH_FIELDS[flag].default}
    stream_props = {key: {} for key in ROUTE_FIELDS["stream"]}
    stream_props.update({"operators": {"type": "array", "items": operator},
                         "publications": names, "subscriptions": names,
                         "metadata": {"type": "object"}})
    route_kinds = {"stream": stream_props, "graph": graph_props,
                   "bridge": {key: {} for key in ROUTE_FIELDS["bridge"]}}
    route = _closed({"type": "object",      # a route from a §8.7 template names it alone
                     "anyOf": [{"required": ["type"]}, {"required": ["template_config"]}],
                     "properties": {**{key: {} for kind in ROUTE_FIELDS
                                       for key in ROUTE_FIELDS[kind]},   # as for nodes, above
                                    **{key: {} for key in ROUTE_INSTANCE_FIELDS},
                                    "type": {"type": "string",
                                             "pattern": _any_case(ROUTE_FIELDS)},
                                    "template_config": {"type": "object"}},
                     "allOf": [{"if": _type_is([kind]),
                                "then": {"properties": props,
                                         **({"required": [f for f, v in GRAPH_FIELDS.items()
                                                          if v.default is REQUIRED]}
                                            if kind == "graph" else {})}}
                               for kind, props in route_kinds.items()]})
    agent_types = list(AGENT_TYPES) + ["template_instance"]
    configs = {"llm": _schema_fields(LLM_AGENT_FIELDS, null_is_default=True),
               "tool": _schema_fields(TOOL_AGENT_FIELDS, null_is_default=True)}
    agent = _closed({"type": "object",      # a §4.8 template instance may name its template alone
                     "anyOf": [{"required": ["type"]}, {"required": ["template"]},
                               {"required": ["agent_template"]}],
                     "properties": {**{key: {} for key in AGENT_FIELDS},       # §4.1's rows
                                    "type": {"enum": agent_types}, "config": {"type": "object"},
                                    "template": {"type": "string"},
                                    "agent_template": {"type": "string"},
                                    "params": {"type": "object"}},
                     "allOf": [{"if": {"required": ["type"],
                                       "properties": {"type": {"const": kind}}},
                                "then": {"properties": {"config": _closed(
                                    {"type": "object", "properties": props})}}}
                               for kind, props in configs.items()]})
    merge = _closed({"type": "object", "required": list(MERGE_FIELDS),
                     "properties": {"sources": names, "target": {"type": "string"}}})
    split = _closed({"type": "object", "required": list(SPLIT_FIELDS),
                     "properties": {"source": {"type": "string"}, "targets": {
                         "type": "object", "additionalProperties": {
                             "anyOf": [{"$ref": "#/$defs/condition"}, {"type": "null"}]}}}})
    sections = {
        "name": {"type": "string"}, "agents": {"type": "object", "minProperties": 1,
                                               "additionalProperties": agent},
        "routes": {"type": "object", "minProperties": 1, "additionalProperties": route},
        "merges": {"type": "array", "items": merge}, "splits": {"type": "array", "items": split},
        "context": {"type": "object"}, "prompts": {"type": "object"},
        "templates": {"type": "object"}, "instances": {"type": "object"},
        "pipelines": {"type": ["object", "array"]}, "template_strings": {"type": "object"},
        "template_engine": {"type": "string"}, "default_router": {"type": "string"},
        "cleveragents": {"type": "object"}, "version": {"type": ["string", "number"]}}
    for key in FORBIDDEN_TOP_LEVEL:
        sections[key] = False           # §16.1
    assert set(sections) >= set(TOP_LEVEL_SECTIONS) | set(HOST_PARAMETER_FIELDS)
    return {"$schema": SCHEMA_DIALECT,
            "title": f"Actor Configuration Standard {SPEC_VERSION} configuration",
            "type": "object", "properties": sections, "unevaluatedProperties": False,
            "required": [key for key, required in TOP_LEVEL_SECTIONS.items() if required],
            "$defs": {"condition": condition, "operator": operator}}


# Printing -----------------------------------------------------------------------------------
class Console:
    """Prints what the Actor emits, as it is emitted: plain text, or JSON lines with --json.

    Plain: __output__ answers on stdout; an __output__ message whose metadata says error: true
    (the §5.3.4 "Error: ..." reply) and __error__ messages on stderr, each text once.
    --json: everything on stdout, one object per message with its stream and metadata.
    """

    def __init__(self, as_json, out=None, err=None, progress=None):
        self.as_json = as_json
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.progress = progress            # §4.5.6 bars share stdout: end one before a line
        self.failed = False                 # anything reached __error__ (exit status 1)
        self._lock = threading.Lock()
        self._recent = []                   # (stream, text) shown on stderr, awaiting a twin

    def output(self, msg):
        self._show(OUTPUT, msg)

    def error(self, msg):
        self.failed = True
        self._show(ERROR, msg)

    def _show(self, stream, msg):
        with self._lock:
            if self.as_json:
                meta = {k: v for k, v in msg.metadata.items() if k != "context"}
                print(json.dumps({"stream": stream, "content": jsonable(msg.content),
                                  "metadata": jsonable(meta), "source_stream": msg.source_stream}),
                      file=self.out, flush=True)
                return
            text = msg.content if isinstance(msg.content, str) else \
                json.dumps(jsonable(msg.content))
            if stream == OUTPUT and msg.metadata.get("error") is not True:
                if self.progress is not None:
                    self.progress.close_line(self.out)
                print(text, file=self.out, flush=True)
                return
            twin = (ERROR if stream == OUTPUT else OUTPUT, text)
            if twin in self._recent:        # the same failure on both streams: shown once
                self._recent.remove(twin)
                return
            self._recent = self._recent[-63:] + [(stream, text)]
            print(text, file=self.err, flush=True)


TRACE_PREVIEW = 120           # characters of content a trace line shows


def trace_line(stream, msg):
    """One line of `--trace` output for a message seen by Actor.watch."""
    content = msg.content
    if stream.endswith("_control__") and isinstance(content, dict) and "event" in content:
        graph, event = msg.metadata.get("graph"), content["event"]
        if event in ("started", "resumed"):
            detail = repr(content.get("input"))
        elif event == "failed":
            detail = f"{content.get('error_type')}: {content.get('error')}"
        else:
            detail = " -> ".join(content.get("history") or []) or "(no node)"
            if content.get("guard"):
                detail += f" (stopped by the {content['guard']} guard, §6.8)"
        text = f"graph {graph} {event}: {detail}"
    elif "node" in msg.metadata and "graph" in msg.metadata:
        text = (f"graph {msg.metadata['graph']} node {msg.metadata['node']} "
                f"#{msg.metadata.get('execution_count')}: {content!r}")
    else:
        text = f"{stream}: {content!r}"
    if len(text) > TRACE_PREVIEW + 40:
        text = text[:TRACE_PREVIEW + 40] + "..."
    return "trace: " + text


def trace_llm_line(call):
    """One line of `--trace` output for an LLM call (see note_llm_call)."""
    usage = call.get("usage") or {}
    tokens = (f", tokens {usage.get('input_tokens')} in / {usage.get('output_tokens')} out"
              if usage else "")
    retries = f", {call['retries']} retries" if call.get("retries") else ""
    outcome = f"failed: {call['error']}" if call.get("error") else "ok"
    head = (f"trace: llm {call.get('agent')} -> {call.get('provider')}/{call.get('model')}: "
            f"{outcome} in {call.get('latency', 0.0):.3f} s{retries}{tokens}")
    return head + "".join(f"\ntrace:     {role}: {_trace_text(text)}" for role, text in
                          _llm_messages(call))


TRACE_TEXT_CHARS = 400      # characters of one prompt message --trace shows


def _llm_messages(call):
    """(role, text) of what the call sent: the system prompt, then the messages in order."""
    if call.get("system"):
        yield "system", call["system"]
    for entry in call.get("messages") or ():
        if isinstance(entry, dict):
            yield entry.get("role", "?"), entry.get("content", "")


def _trace_text(text):
    text = json.dumps(text if isinstance(text, str) else str(text), ensure_ascii=False)
    if len(text) > TRACE_TEXT_CHARS:
        return f"{text[:TRACE_TEXT_CHARS]}... ({len(text)} characters)"
    return text


# Running -----------------------------------------------------------------------------------
CHECK_MAX_ERRORS = 20       # faults one --check reports before it stops looking


def _load_for_cli(args, check_only):
    """Load the CONFIGs as the command line asks. When nothing will be sent (check_only), a
    missing API key is a warning (a run would stop there, §4.4.1), what needs unsafe mode is
    checked as on an unsafe host, and with --check every fault is reported: each error's entry
    (an agent, a route, a merge or split) is set aside for a stand-in and the load repeated, and
    each missing ${VAR} is filled in, up to CHECK_MAX_ERRORS. Returns (actor, host warning
    texts); raises the first error, or CheckFailures when --check found several."""
    sources = read_sources(args.configs, None)
    env = dict(os.environ)
    replies = args.reply or []
    host_warnings, errors, set_aside = [], [], {}
    unsafe = args.unsafe
    collect = bool(getattr(args, "check", False))

    def revise(doc):
        for path, stand_in in set_aside.items():
            outer_set(doc.data, path, stand_in)

    while True:
        try:
            actor = start_actor(
                sources, render_context=_parse_set(args.set, "--set") or None,
                unsafe=unsafe, env=env, template_engine=args.engine,
                default_router=args.default_router, provider=args.provider, clock=RealClock(),
                context=_parse_set(args.context, "--context") or None,
                llm_transport=ScriptedReplies(replies) if replies else None,
                isolation="process" if args.isolate else "none",
                reference=reference_path_requested(), revise=revise)
            if errors:
                actor.close()
                break
            for key in _parse_set(args.set, "--set"):
                if key not in actor.rt.phase_a_reads:       # issue 16: most likely a typo
                    text = (f"warning: --set {key}: no Phase A template reads '{key}'"
                            f"{did_you_mean(key, sorted(actor.rt.phase_a_reads))} (§8.2)")
                    log.warning(text)
                    host_warnings.append(text)
            return actor, host_warnings
        except UnsafeConfigurationError as exc:
            # --check, --describe and --diagram run nothing: what needs unsafe mode to run is
            # checked as on an unsafe host, and said once (a note: running it needs --unsafe)
            if not check_only or unsafe:
                raise
            unsafe = True
            where = ":".join(str(x) for x in (exc.file, exc.line) if x is not None)
            log.warning(f"{where}: note: {exc.path}: {exc.message}; checked as on an unsafe host "
                        f"(nothing runs here), a run needs --unsafe (§13.1)")
        except (ConfigurationError, StreamRoutingError) as exc:
            missing = re.match(r"no API key for provider '(\w+)'", exc.message or "")
            unset = re.match(r"required environment variable '(\w+)' is not set", exc.message
                             or "")
            if check_only and missing and PROVIDER_KEY_VARS.get(missing.group(1)) \
                    and PROVIDER_KEY_VARS[missing.group(1)][0] not in env:
                env[PROVIDER_KEY_VARS[missing.group(1)][0]] = MISSING_KEY_PLACEHOLDER
                where = ":".join(str(x) for x in (exc.file, exc.line) if x is not None)
                text = (f"{where}: warning: {exc.path}: {exc.message}; a run stops here "
                        f"(use --provider fake to run offline) (§4.4.1)")
                log.warning(text)
                host_warnings.append(text)
                continue
            if not collect or len(errors) + 1 >= CHECK_MAX_ERRORS:
                if errors:
                    raise CheckFailures(errors + [exc], stopped=True) from None
                raise
            if unset and unset.group(1) not in env:       # §14.2: the next one, at once
                env[unset.group(1)] = "${" + unset.group(1) + "}"   # stays text (§14.4: once)
                errors.append(exc)
                continue
            consequence = exc.path in {error.path for error in errors}   # of one reported
            entry = check_entry(exc)
            if entry is None or entry[0] in set_aside:
                if consequence:
                    break
                errors.append(exc)
                break
            if not consequence:
                errors.append(exc)
            set_aside[entry[0]] = entry[1]
    raise CheckFailures(errors) if len(errors) > 1 else errors[0]

# What an entry that has been reported stands in for, while --check looks for the next fault:
# the smallest valid entry of its kind, under the same name, so references to it still resolve.
CHECK_STAND_INS = {
    "agents": {"type": "chain"},
    "stream": {"type": "stream"},
    "graph": {"type": "graph", "nodes": {"n": {"type": "function", "function": "summarize"}},
              "edges": [{"source": "start", "target": "n"}, {"source": "n", "target": "end"}]},
    "merges": {"sources": [], "target": "__output__"},      # §7.1: an empty merge is ignored
    "splits": {"source": "__input__", "targets": {}},       # §7.2: so is an empty split
}


class CheckFailures(ConfigurationError):
    """--check: several configuration errors, each located; str() lists them one a line."""

    def __init__(self, errors, stopped=False):
        self.errors = list(errors)
        tail = f"{len(self.errors)} errors" + (f" (stopped at {CHECK_MAX_ERRORS})" if stopped
                                               else "")
        self.tail = tail
        super().__init__("\n".join(map(str, self.errors)) + "\n" + tail,
                         section=self.errors[0].section)

    def __str__(self):
        return self.message


def check_entry(exc):
    """(path of the top-level entry an error stands in, its stand-in), or None."""
    parts = re.match(r"(agents|routes)\.(\w+)|(merges|splits)\[(\d+)\]", exc.path or "")
    if parts is None:
        return None
    if parts.group(1) == "agents":
        return ("agents", parts.group(2)), CHECK_STAND_INS["agents"]
    if parts.group(1) == "routes":
        return ("routes", parts.group(2)), CHECK_STAND_INS["stream"]
    return (parts.group(3), int(parts.group(4))), CHECK_STAND_INS[parts.group(3)]


def outer_set(data, path, value):
    """Set the value at `path` inside nested mappings and lists (the --check stand-ins); a
    route keeps its kind (a graph stays a graph, so graph_execute still finds one)."""
    *head, last = path
    for key in head:
        data = data[key]
    if isinstance(data, (dict, list)) and (last in data if isinstance(data, dict)
                                           else 0 <= last < len(data)):
        kind = data[last].get("type") if isinstance(data[last], dict) else None
        if head == ["routes"] and isinstance(kind, str) and kind.lower() == "graph":
            value = CHECK_STAND_INS["graph"]
        data[last] = copy.deepcopy(value)


def check_runtime_template_names(actor):
    """--check: warn about the names a JINJA2 runtime template (§8.11: a system_prompt, a chain
    prompt, a prompts entry) reads that nothing provides at load -- not `context`, `message`, a
    §8.3 built-in, a key of context.global or the agent's template_vars. Such a name renders as
    undefined unless the context gets that key at run time, so this is --check's hint only, never
    a load-time warning. Returns how many it warned about."""
    rt = actor.rt
    if rt.engine != "JINJA2":
        return 0
    texts = [(("prompts", name, "content"), text, ()) for name, text in rt.prompts.items()]
    for name, agent in rt.agents.items():
        for field in ("system_prompt", "prompt"):
            text = getattr(agent, field, None)
            if isinstance(text, str) and rt.doc.locate(("agents", name, "config", field))[1]:
                texts.append((("agents", name, "config", field), text,
                              getattr(agent, "template_vars", None) or ()))
    if not texts:           # nothing to read: jinja2 stays unimported (a --check's start-up)
        return 0
    try:
        meta = __import__("jinja2.meta").meta
        env = jinja_environment()
    except (ImportError, TemplateError):
        return 0
    known = set(runtime_variables(rt.context, "")) | set(env.globals)
    warned = 0
    for path, text, extra in texts:
        try:
            names = meta.find_undeclared_variables(env.parse(text))
        except Exception:       # jinja2's syntax errors: warn_unparsable_template said so
            continue
        for unknown in sorted(names - known - set(extra)):
            rt.warn(f"the runtime template reads '{unknown}', which is not context, message, a "
                    f"built-in or a key of context.global: it renders as undefined unless the "
                    f"context has that key when the message arrives"
                    f"{did_you_mean(unknown, sorted(known | set(extra)))}", section="8.11",
                    path=path)
            warned += 1
    return warned


class ScriptedReplies:
    """`--provider fake --reply TEXT...`: the replies in order, whichever agent asks; then the
    user message is echoed, as the fake provider does."""

    def __init__(self, replies):
        self.replies = list(replies)
        self._lock = threading.Lock()

    def complete(self, request):
        with self._lock:
            if self.replies:
                return self.replies.pop(0)
        return request["messages"][-1]["content"]


def _describe(actor, as_json):
    info = actor.describe()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    for name, agent in info["agents"].items():
        print(f"agent {name} ({agent['type']}): {', '.join(agent['capabilities'])}")
        for key, value in agent["metadata"].items():
            if key not in ("name", "type", "capabilities"):
                print(f"    {key}: {json.dumps(value)}")
    for name, kind in info["routes"].items():
        mark = "  [default router]" if name == info["default_router"] else ""
        print(f"route {name} ({kind}){mark}")
        graph = actor.rt.graphs.get(name)
        if graph is not None:       # the nodes, in document order, with what each one runs
            for node in graph.nodes.values():
                if node.type not in (START_NODE, END_NODE):
                    runs = node.cfg.get("agent") or node.cfg.get("function") \
                        if isinstance(node.cfg, dict) else None
                    print(f"    node {node.name} ({node.type}{': ' + str(runs) if runs else ''})")
            levels = info["graphs"][name]["levels"]
            print(f"    levels: {' | '.join(', '.join(level) for level in levels)}"
                  f"{'  (has cycles)' if info['graphs'][name]['has_cycles'] else ''}")


def reset_actor(actor):
    """Interactive /reset: forget every agent's conversation memory (§4.4.4) and every graph's
    state and history (§6.3, §6.6); the global context stays."""
    with actor._turn:
        for agent in actor.rt.agents.values():
            memory = getattr(agent, "memory", None)
            if isinstance(memory, ConversationMemory):
                with memory._lock:
                    memory.entries.clear()
        for graph in actor.rt.graphs.values():
            graph.state = new_graph_state(state_schema(graph.cfg))
            graph.snapshots.clear()


INTERACTIVE_HELP = """commands:
  /help     this list
  /reset    forget every agent's memory and every graph's state (the context stays)
  /quit     end the session (also /exit, Ctrl-D, or Ctrl-C twice on an empty line)
  Ctrl-C    cancel the line being typed
any other line is sent to the Actor as one message"""


class Prompter:
    """Interactive input, read on the main thread (the only one a Ctrl-C reaches) for the CLI's
    worker thread: the worker asks for a line, the main thread reads it with input().

    Ctrl-C cancels the line being typed; a second Ctrl-C on an empty line ends the session, as
    Ctrl-D does. A Ctrl-C while the Actor works on a message (no prompt shown) stops the CLI
    (exit 130), since a message cannot be taken back half-way."""

    def __init__(self):
        import queue                # interactive sessions only
        self.asked, self.lines = queue.Queue(), queue.Queue()

    def read(self, prompt):
        """On the worker: the next line, or None at the end of the session."""
        self.asked.put(prompt)
        return self.lines.get()

    def serve(self, worker):
        """On the main thread, until the worker ends: answer each request for a line."""
        import queue
        while worker.is_alive():
            try:
                prompt = self.asked.get(timeout=0.2)
            except queue.Empty:
                continue
            self.lines.put(self._line(prompt))

    @staticmethod
    def _line(prompt):
        cancelled = False
        while True:
            try:
                return input(prompt)
            except EOFError:
                print(file=sys.stderr)
                return None
            except KeyboardInterrupt:
                typed = _typed_line()
                print(file=sys.stderr)
                if cancelled and not typed:
                    return None
                cancelled = not typed
                if cancelled:
                    print("(Ctrl-C again on an empty line, or Ctrl-D, ends the session)",
                          file=sys.stderr)


def _typed_line():
    """What was on the line when Ctrl-C came ('' where readline is not there to tell)."""
    try:
        import readline
        return readline.get_line_buffer()
    except (ImportError, AttributeError):
        return ""


def _lines(interactive, prompt, prompter=None):
    """The messages typed or piped in, one per line; interactive: readline editing and history,
    blank lines skipped, /quit ends, /help lists the commands, /reset is passed through."""
    if not interactive:
        for line in sys.stdin:      # a line ends at \n or \r\n (a file saved on Windows)
            yield line[:-2] if line.endswith("\r\n") else line.removesuffix("\n")
        return
    try:
        import readline  # noqa: F401 -- line editing and history for input()
    except ImportError:
        pass
    while True:
        line = prompter.read(prompt) if prompter is not None else Prompter._line(prompt)
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/help":
            print(INTERACTIVE_HELP, file=sys.stderr)
            continue
        yield line


def run_cli_actor(actor, args, console):
    """Feed the messages into the running Actor, then complete __input__ and wait out what is
    still pending (bounded by the §12.2.4 soft timeout)."""
    clock = actor.rt.clock
    interactive = not args.message and sys.stdin.isatty()
    name = actor.rt.doc.data.get("name") or Path(args.configs[-1]).stem
    if interactive:
        print(f"{name}: one message per line; /help lists the commands, /quit ends (or "
              "Ctrl-D)", file=sys.stderr)
    clock.start(actor._turn)
    try:
        messages = args.message if args.message else _lines(interactive, f"{name}> ",
                                                            getattr(args, "prompter", None))
        for text in messages:
            if interactive and text.strip() == "/reset":
                reset_actor(actor)
                print("(memory and graph state cleared)", file=sys.stderr)
                continue
            actor.send(text)
            if not args.message:
                actor.rt.llm_log.clear()        # a long session keeps no request history
    finally:
        clock.stop()
    actor.complete()


def _cli(args):
    """Everything main() does, on a thread with a deep stack; returns the exit status."""
    problem = usage_problem(args, _arg_parser())
    if problem:
        print(f"actor: error: {problem} (see actor --help)", file=sys.stderr)
        return EXIT_CONFIG
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    logging.basicConfig(format="%(message)s", level=level, stream=sys.stderr)
    log.setLevel(level)
    if args.schema:
        print(json.dumps(config_schema(), indent=1))
        return EXIT_OK
    hints = _HintFilter()
    log.addFilter(hints)
    try:
        try:
            # nothing is sent with --check, --describe or --diagram: no key is needed
            actor, host_warnings = _load_for_cli(args, args.check or args.describe or
                                                 args.diagram)
        except ActorError as exc:
            data = _document_data(args) \
                if isinstance(exc, (ConfigurationError, StreamRoutingError)) else None
            text = "\n".join([*(with_hint(str(e), data) for e in exc.errors), exc.tail]) \
                if isinstance(exc, CheckFailures) else with_hint(str(exc), data)
            if re.search(r"no API key for provider '\w+'", exc.message or ""):
                text += "\n(to try it offline, without a key: --provider fake)"
            print(text, file=sys.stderr)
            return EXIT_CONFIG
        hints.data = actor.rt.doc.data
        sys.setrecursionlimit(max(sys.getrecursionlimit(), CLI_RECURSION_LIMIT))
        # INTERPRETATION I-089 §12.2.4 (Q95): a run that reads a known set of messages (-m, or piped
        # input) is single-shot; an interactive prompt is not.
        actor.rt.single_shot = bool(args.message) or not sys.stdin.isatty()
        log.info("actor: loaded %s: %d agents, %d routes, default router %s, engine %s%s",
                 " + ".join(args.configs), len(actor.rt.agents), len(actor.describe()["routes"]),
                 actor.default_router, actor.rt.engine,
                 ", single-shot" if actor.rt.single_shot else "")
        if log.isEnabledFor(logging.INFO) and not args.trace:
            actor.rt.llm_observer = lambda call: log.info(trace_llm_line(call).split("\n")[0][len("trace: "):])
        with actor:
            unconsumed_target_warnings(actor)
            if args.check:
                check_runtime_template_names(actor)
            warned = len(actor.rt.warnings) + len(host_warnings)
            if args.strict and warned:
                print(f"actor: error: {warned} warning(s), and --strict makes them errors",
                      file=sys.stderr)
                return EXIT_CONFIG
            if args.check:
                merged = "" if len(args.configs) == 1 else \
                    f" ({len(args.configs)} files checked as one merged document, §3.1)"
                counted = "" if not warned else \
                    f", {warned} warning{'s' if warned != 1 else ''} (--strict fails on them)"
                print("ok" + counted + merged)
                return EXIT_OK
            if args.describe:
                _describe(actor, args.json)
                return EXIT_OK
            if args.diagram:
                sys.stdout.write(actor.diagram())
                return EXIT_OK
            # §4.5.6: bars on standard output, except beside --json (stdout is JSON only there)
            actor.rt.progress = ProgressFacility(stream=sys.stderr if args.json else None)
            console = Console(args.json, progress=actor.rt.progress)
            actor.subscribe(OUTPUT, console.output)
            actor.subscribe(ERROR, console.error)
            if args.trace:
                actor.watch(lambda stream, msg: print(trace_line(stream, msg), file=sys.stderr))
                actor.rt.llm_observer = lambda call: print(trace_llm_line(call), file=sys.stderr)
            try:
                run_cli_actor(actor, args, console)
            except ActorError as exc:
                print(str(exc), file=sys.stderr)
                return EXIT_RUNTIME
            if args.strict and len(actor.rt.warnings) > warned - len(host_warnings):
                print("actor: error: warnings during the run, and --strict makes them errors",
                      file=sys.stderr)
                return EXIT_CONFIG
            return EXIT_RUNTIME if console.failed else EXIT_OK
    finally:
        log.removeFilter(hints)


HARNESS_OPTIONS = ("--vectors", "--run-vector", "--report")   # a command line for vectors/run.py


def harness_command(argv):
    """The option that makes `argv` a command line of the vector harness, or None."""
    for token in argv:
        if token == "--":
            return None
        if token.split("=", 1)[0] in HARNESS_OPTIONS:
            return token.split("=", 1)[0]
    return None


def run_harness(argv):
    """--vectors, --run-vector, --report: the whole command line goes to vectors/run.py (C.3),
    bound to this module; without that file, one line and exit status 2."""
    harness = vector_harness()
    if harness is None:
        print(f"actor: error: {harness_command(argv)} needs the vector harness "
              f"{'/'.join(VECTOR_HARNESS)} beside actor.py, which is absent (it comes with the "
              f"project's vectors/ folder)", file=sys.stderr)
        return EXIT_CONFIG
    return harness.main(argv, prog="actor")


def main(argv=None):
    """The CLI: exit 0 ok, 1 something reached __error__ (or a vector failed), 2 bad usage or a
    configuration refused; 130 after Ctrl-C and 141 on a closed pipe, quietly; 70 and one line on
    stderr for a bug in actor.py (-v adds the traceback). The work runs on a thread with a deep
    stack (see CLI_RECURSION_LIMIT). --vectors and --run-vector go to the vector harness."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None if harness_command(argv) else _arg_parser().parse_args(argv)
    status = EXIT_RUNTIME
    # a terminal session reads its lines here, on the thread Ctrl-C reaches (Prompter)
    prompter = Prompter() if args is not None and not args.message and sys.stdin.isatty() \
        else None
    if args is not None:
        args.prompter = prompter

    def work():
        nonlocal status
        if hasattr(signal, "pthread_sigmask"):
            # Ctrl-C goes to the main thread (and the threads this one starts inherit the mask):
            # delivered here, it would not interrupt the main thread's wait for a typed line
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            status = run_harness(argv) if args is None else _cli(args)
        except BrokenPipeError:
            status = EXIT_BROKEN_PIPE
        except KeyboardInterrupt:
            status = EXIT_INTERRUPTED
        except Exception as exc:        # the CLI's boundary (STYLE 4): our bug, not the user's
            status = EXIT_INTERNAL
            if args is not None and args.verbose:
                import traceback        # error paths only (issue 15)
                traceback.print_exc()
            print(f"actor: internal error: {type(exc).__name__}: {exc} (a bug in actor.py; "
                  f"-v shows the traceback)", file=sys.stderr)

    previous_limit = sys.getrecursionlimit()
    interrupted = False
    try:        # Ctrl-C may come before the main thread reaches the join loop (a busy machine)
        previous_stack = threading.stack_size(CLI_STACK_BYTES)
        try:
            worker = threading.Thread(target=work, name="actor-cli", daemon=True)
            worker.start()
        finally:
            threading.stack_size(previous_stack)
        if prompter is not None:
            prompter.serve(worker)
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        # the worker runs on and may still set `status` (input ends when the caller closes it
        # after its Ctrl-C): the interruption decides the exit status, whatever it sets later
        interrupted = True
    finally:
        sys.setrecursionlimit(previous_limit)
    # read once, into a name the worker does not share
    result = EXIT_INTERRUPTED if interrupted else status
    if result == EXIT_BROKEN_PIPE or result == EXIT_INTERRUPTED:
        _quiet_exit_streams()
    return result


def _quiet_exit_streams():
    """After a closed pipe or Ctrl-C: point stdout at /dev/null so that the interpreter's last
    flush cannot fail with a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
