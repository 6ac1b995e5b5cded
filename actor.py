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
        case ast.Name(id=name) | ast.Call(func=ast.Name(id=name)):
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
