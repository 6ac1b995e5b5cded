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
# [foundation]


# =====================================================================================
# HOST -- the vector harness
# =====================================================================================
# [foundation]


# =====================================================================================
# HOST -- command line
# =====================================================================================
# [foundation]
