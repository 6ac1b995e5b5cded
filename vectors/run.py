#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""vectors/run.py -- the vector harness of actor.py: run the vectors, judge, report.

The vector format, the --impl protocol and the report are specified in vectors/README.md.
observe_vector is actor.py's side of the protocol (it only reports); judge_vector compares;
run_vectors prints. The same harness runs three ways:

    python3 vectors/run.py vectors [--impl "CMD" [-j N]] ...   this file on its own
    python3 actor.py --vectors vectors [--impl "CMD" [-j N]] ...  actor.py hands its argv here
    python3 -m actor --vectors vectors ...                        the same

`actor` below is the actor module under test, set by bind(): actor.py's vector_harness() loads this
file and binds the module that is running (under `python actor.py` that is __main__, so no second
copy of actor's classes exists); run on its own, this file imports actor.py from the folder above.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

actor = None        # the actor module under test (bind)


def bind(module):
    """Judge `module` (an imported actor.py): every vector runs on its start_actor."""
    global actor
    actor = module


VECTOR_KEYS = ("name", "spec", "description", "interpretation", "profile", "host", "config",
               "config_text", "configs", "load_error", "warnings", "steps")
# `interpretation` (optional, documentation only): the id, or list of ids, of the entries of
# vectors/INTERPRETATIONS.md that the vector pins. Nothing is judged by it.
READING_ID = re.compile(r"I-[0-9]{3}")
HOST_KEYS = ("unsafe", "isolation", "env", "render_context", "template_engine", "default_router",
             "context", "files", "llm", "provider", "single_shot")
STEP_ACTIONS = ("send", "advance", "complete", "rewind", "restore")
STEP_CHECKS = ("outputs", "outputs_unordered", "errors", "context", "metadata", "llm_requests",
               "files", "files_matching", "warnings", "describe", "raises")
STEP_KEYS = STEP_ACTIONS + STEP_CHECKS + ("at", "target")
# Format extensions an implementation may leave out: it lists the ones it supports under
# `extensions` in its report, and a vector using any other one is reported SKIP, not FAIL.
VECTOR_EXTENSIONS = ("warnings", "describe", "target", "raises", "files_matching", "rewind",
                     "restore", "single_shot", "isolation")
VECTOR_TIMEOUT = 60.0     # seconds per vector under --impl (--timeout raises it)


def vector_sources(vector):
    """The vector's document(s) as (name, text) sources; JSON is valid YAML 1.2."""
    if "config_text" in vector:
        return [("config.yaml", vector["config_text"])]
    if "configs" in vector:
        return [(f"config{i + 1}.yaml", json.dumps(c)) for i, c in enumerate(vector["configs"])]
    return [("config.yaml", json.dumps(vector.get("config")))]


def vector_extensions(vector):
    """The format extensions `vector` uses, in VECTOR_EXTENSIONS order."""
    used = set()
    if "warnings" in vector:
        used.add("warnings")
    for key in ("single_shot", "isolation"):
        if key in (vector.get("host") or {}):
            used.add(key)
    for step in vector.get("steps") or []:
        if isinstance(step, dict):
            used.update(key for key in VECTOR_EXTENSIONS if key in step)
    return [name for name in VECTOR_EXTENSIONS if name in used]


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


def warning_record(text):
    """A warning as the protocol reports it: {message, section} (section: '5.4', '6.1, 6.6' or
    None), read from the `(§x.y)` that ends the text warn() wrote."""
    found = actor.WARNING_SECTION.search(text)
    section = found.group(1).replace("§", "").strip() if found else None
    return {"message": text, "section": section}


def _vector_step(running, step):
    """Perform one step's action; the Result of everything it emitted."""
    if "send" in step:
        return running.send(step["send"], at=step.get("at"), target=step.get("target"))
    results = []
    if step.get("at") is not None:      # move the clock first; what falls due belongs here
        results.append(running.advance(max(0.0, step["at"] - running.rt.clock.now())))
    if "advance" in step:
        results.append(running.advance(step["advance"]))
    elif "complete" in step:
        results.append(running.complete())
    elif "rewind" in step:
        running.rewind(step["rewind"]["graph"], step["rewind"].get("steps", 1))
    elif "restore" in step:
        running.restore(step["restore"]["graph"])
    return actor.Result([m for r in results for m in r.outputs],
                        [m for r in results for m in r.errors])


def observe_vector(vector):
    """Run one vector and report what happened: {load_error, warnings, extensions, stderr, steps:
    [{outputs, metadata, errors, context, llm_requests, files, warnings, raised, describe?}]}.
    Reports only; judging is judge_vector's job. What inline code prints goes to `stderr`."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        report = _observe(vector)
    report["stderr"] = printed.getvalue()
    return report


def _observe(vector):
    host = vector.get("host") or {}
    with tempfile.TemporaryDirectory(prefix="actor-vector-") as tmp:
        for rel, content in (host.get("files") or {}).items():
            target = Path(tmp, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        llm = (host.get("llm") or {}).get("responses") or {}
        report = {"load_error": None, "warnings": [], "extensions": list(VECTOR_EXTENSIONS),
                  "steps": []}
        try:
            running = actor.start_actor(
                vector_sources(vector), render_context=host.get("render_context"),
                unsafe=bool(host.get("unsafe", False)), env=host.get("env") or {},
                template_engine=host.get("template_engine"),
                default_router=host.get("default_router"), provider=host.get("provider"),
                workdir=tmp, clock=actor.VirtualClock(), llm_transport=actor.FakeTransport(llm),
                context=host.get("context"), isolation=host.get("isolation", "none"),
                reference=actor.reference_path_requested())
        except actor.ActorError as exc:
            report["load_error"] = {"category": exc.category, "message": str(exc)}
            return report
        running.rt.progress = actor.ProgressFacility(stream=io.StringIO())   # §4.5.6: not reported
        running.rt.single_shot = bool(host.get("single_shot", False))
        warned = len(running.rt.warnings)
        report["warnings"] = [warning_record(w) for w in running.rt.warnings]
        try:
            for step in vector.get("steps") or []:
                logged = len(running.rt.llm_log)
                raised = None
                try:
                    result = _vector_step(running, step)
                except actor.ActorError as exc:
                    raised, result = {"category": exc.category, "message": str(exc)}, actor.Result()
                for graph in running.rt.graphs.values():     # §6.6: queued checkpoints on disk
                    graph.wait_for_checkpoints()
                seen = {
                    "outputs": [actor.jsonable(m.content) for m in result.outputs],
                    "metadata": [actor.jsonable(m.metadata) for m in result.outputs],
                    "errors": [{"content": actor.jsonable(m.content),
                                "error_type": m.metadata.get("error_type"),
                                "metadata": actor.jsonable(m.metadata)} for m in result.errors],
                    "context": actor.jsonable(running.context),
                    "llm_requests": actor.jsonable(running.rt.llm_log[logged:]),
                    "files": read_tree(tmp),
                    "warnings": [warning_record(w) for w in running.rt.warnings[warned:]],
                    "raised": raised,
                }
                if "describe" in step:
                    seen["describe"] = actor.jsonable(running.describe())
                warned = len(running.rt.warnings)
                report["steps"].append(seen)
        finally:
            running.close()
        return report


def same(expect, got):
    """Exact equality for vectors: 1 == 1.0, but a string is never a number and a bool never an
    int -- the data equality §5.4's context_value uses (data_equal, I-175), on JSON values."""
    return actor.data_equal(expect, got)


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


def _warning_matches(expect, got):
    message = got.get("message") if isinstance(got, dict) else got
    if not isinstance(message, str):
        return False
    if "contains" in expect and str(expect["contains"]) not in message:
        return False
    if "section" in expect:
        cited = got.get("section") if isinstance(got, dict) else None
        if str(expect["section"]) not in [s.strip() for s in str(cited or "").split(",")]:
            return False
    return True


def warnings_match(expect, got):
    """Each expected {contains, section} matches a different reported warning, in any order, and
    others may be present; an empty list means no warning at all."""
    if not isinstance(got, list):
        return False
    if not expect:
        return not got
    rest = list(got)
    for item in expect:
        match = next((i for i, g in enumerate(rest) if _warning_matches(item, g)), None)
        if match is None:
            return False
        rest.pop(match)
    return True


def describe_matches(expect, got):
    """Deep subset of the §4.11 description, where `capabilities` lists compare as sets."""
    if isinstance(expect, dict) and isinstance(got, dict):
        for key, value in expect.items():
            if key not in got:
                return False
            if key == "capabilities" and isinstance(value, list) and isinstance(got[key], list):
                if sorted(map(str, value)) != sorted(map(str, got[key])):
                    return False
            elif not describe_matches(value, got[key]):
                return False
        return True
    return subset(expect, got)


def files_matching(files, pattern):
    """How many reported files match a glob (fnmatch on relative POSIX paths; * crosses /)."""
    return sum(1 for rel in files if fnmatch.fnmatchcase(rel, pattern))


def judge_step(step, seen):
    """[(field, expect, got)] for every check of `step` that `seen` fails."""
    failures = []
    raised = seen.get("raised")
    if "raises" in step:
        got = raised["category"] if raised else "no error"
        if got != step["raises"]:
            failures.append(("raises", step["raises"], raised["message"] if raised else got))
    elif raised:
        failures.append(("raised", None, raised["message"]))
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
    for pattern, count in (step.get("files_matching") or {}).items():
        got = files_matching(seen.get("files") or {}, pattern)
        if not same(count, got):
            failures.append((f"files_matching[{pattern}]", count, got))
    if "warnings" in step and not warnings_match(step["warnings"], seen.get("warnings")):
        failures.append(("warnings", step["warnings"], seen.get("warnings")))
    if "describe" in step and not describe_matches(step["describe"], seen.get("describe")):
        failures.append(("describe", step["describe"], seen.get("describe")))
    return failures


def unsupported_extensions(vector, observed):
    """The extensions `vector` uses that the report does not list as supported."""
    supported = observed.get("extensions") if isinstance(observed, dict) else None
    supported = supported if isinstance(supported, list) else []
    return [name for name in vector_extensions(vector) if name not in supported]


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
    if "warnings" in vector and not warnings_match(vector["warnings"], observed.get("warnings")):
        failures.append((None, "load", "warnings", vector["warnings"], observed.get("warnings")))
    steps, seen = vector.get("steps") or [], observed.get("steps") or []
    if len(seen) != len(steps):
        return failures + [(None, "steps", "steps", f"{len(steps)} steps",
                            f"{len(seen)} observed")]
    for i, (step, got) in enumerate(zip(steps, seen)):
        action = next((a for a in STEP_ACTIONS if a in step), "?")
        for field, expect, value in judge_step(step, got):
            failures.append((i + 1, action, field, expect, value))
    return failures


def _lint_step(i, step, errors):
    if sum(a in step for a in STEP_ACTIONS) != 1:
        errors.append(f"steps[{i}] has not exactly one of {', '.join(STEP_ACTIONS)}")
    if "target" in step and ("send" not in step or not isinstance(step["target"], str)):
        errors.append(f"steps[{i}]: target is a route name on a send step")
    rewind = step.get("rewind", {"graph": "", "steps": 1})
    if not (isinstance(rewind, dict) and isinstance(rewind.get("graph"), str)
            and type(rewind.get("steps", 1)) is int):
        errors.append(f"steps[{i}]: rewind is {{graph: NAME, steps: N}}")
    restore = step.get("restore", {"graph": ""})
    if not (isinstance(restore, dict) and isinstance(restore.get("graph"), str)):
        errors.append(f"steps[{i}]: restore is {{graph: NAME}}")
    if "raises" in step and step["raises"] not in actor.ERROR_CATEGORIES:
        errors.append(f"steps[{i}]: raises '{step['raises']}' is not a §20 category")
    matching = step.get("files_matching", {})
    if not (isinstance(matching, dict) and all(type(n) is int for n in matching.values())):
        errors.append(f"steps[{i}]: files_matching maps a glob to a count")
    _lint_warnings(f"steps[{i}].warnings", step.get("warnings", []), errors)


def _lint_warnings(where, entries, errors):
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and set(e) <= {"contains", "section"} for e in entries):
        errors.append(f"{where} is a list of {{contains, section}}")
        return
    if any("section" in e and not isinstance(e["section"], str) for e in entries):
        errors.append(f"{where}: a section is a string ('5.4', quoted in YAML)")


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
        if vector["load_error"] not in actor.ERROR_CATEGORIES:
            errors.append(f"load_error '{vector['load_error']}' is not a §20 category")
        if vector.get("steps"):
            errors.append("a load_error vector has no steps")
        if "warnings" in vector:
            errors.append("a load_error vector has no warnings check")
    elif not vector.get("steps"):
        errors.append("no steps and no load_error")
    if "warnings" in vector:
        _lint_warnings("warnings", vector["warnings"], errors)
    if "interpretation" in vector:
        ids = vector["interpretation"]
        ids = [ids] if isinstance(ids, str) else ids
        if not (isinstance(ids, list) and ids and all(
                isinstance(i, str) and READING_ID.fullmatch(i) for i in ids)):
            errors.append("interpretation is an id such as I-042, or a list of them")
    for key in vector:
        if key not in VECTOR_KEYS:
            warnings_.append(f"unknown key '{key}'")
    host = vector.get("host") or {}
    for key in host if isinstance(host, dict) else ():
        if key not in HOST_KEYS:
            warnings_.append(f"unknown host key '{key}'")
    if isinstance(host, dict) and not isinstance(host.get("single_shot", False), bool):
        errors.append("host.single_shot is true or false")
    steps = vector.get("steps") or []
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict):
            errors.append(f"steps[{i}] is not a mapping")
            continue
        _lint_step(i, step, errors)
        for key in step:
            if key not in STEP_KEYS:
                warnings_.append(f"steps[{i}]: unknown key '{key}'")
    if "profile" in vector and vector["profile"] != "core":
        errors.append(f"profile is 'core' or absent (the full suite), not {vector['profile']!r}")
    if stem is not None and vector.get("name") != stem:
        warnings_.append(f"name '{vector.get('name')}' differs from the file name '{stem}'")
    return errors, warnings_


# The core profile: what a new implementation builds first -- tool agents with built-in tools
# (echo, math, json_parse, ...), stream routes with their operators, merges, splits and the global
# context. A vector in it carries `profile: core`; core_profile() is the rule the marking follows
# (test_actor.py recomputes it for every vector), so that --profile core selects by the key alone.
PROFILES = ("core", "full")
CORE_SECTIONS = ("name", "agents", "routes", "merges", "splits", "context", "cleveragents")
CORE_HOST_KEYS = ("unsafe", "env", "context", "files", "default_router", "single_shot")
CODE_KEYS = ("code", "fn", "function", "state_extractor", "state_flattener", "custom_predicate")
PHASE_A_MARKS = ("{{", "{%", "{#")


def _holds_key(value, keys):
    if isinstance(value, dict):
        return any(k in keys or _holds_key(v, keys) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_key(v, keys) for v in value)
    return False


def _core_document(doc):
    if not isinstance(doc, dict) or not set(doc) <= set(CORE_SECTIONS):
        return False
    if _holds_key(doc, CODE_KEYS) or "template_engine" in (doc.get("cleveragents") or {}):
        return False
    agents, routes = doc.get("agents") or {}, doc.get("routes") or {}
    if not isinstance(agents, dict) or not isinstance(routes, dict):
        return False
    for agent in agents.values():
        config = agent.get("config") if isinstance(agent, dict) else None
        tools = (config or {}).get("tools", []) if isinstance(config or {}, dict) else None
        if not (isinstance(agent, dict) and agent.get("type") == "tool" and isinstance(tools, list)
                and all(isinstance(t, str) for t in tools)):
            return False
    return all(isinstance(r, dict) and r.get("type") == "stream" for r in routes.values())


def core_profile(vector):
    """True when every document of `vector` uses only the core profile's parts (above) and the
    host sets nothing beyond them: no LLM, no graph, no inline code or expression, no template,
    no Phase A rendering, no isolation."""
    host = vector.get("host") or {}
    if not isinstance(host, dict) or not set(host) <= set(CORE_HOST_KEYS):
        return False
    if "config_text" in vector:
        text = vector["config_text"]
        if not isinstance(text, str) or any(mark in text for mark in PHASE_A_MARKS):
            return False
        try:
            docs = [actor.parse_yaml(text)[0]]
        except actor.ActorError:
            return False
    else:
        docs = vector["configs"] if "configs" in vector else [vector.get("config")]
    return isinstance(docs, list) and all(_core_document(doc) for doc in docs)


def vector_profile(vector):
    """'core' for a vector marked `profile: core`, else 'full'."""
    return "core" if isinstance(vector, dict) and vector.get("profile") == "core" else "full"


def collect_vector_files(paths):
    """The vector files under `paths` (files, or folders searched for *.yaml), sorted per path.
    A path that holds no vector is a ValueError (the CLI's exit 2)."""
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.yaml") if f.is_file())
        elif p.is_file():
            found = [p]
        else:
            raise ValueError(f"{p}: no such file or folder")
        if not found:
            raise ValueError(f"{p}: holds no vector (*.yaml)")
        files.extend(found)
    return files


def select_vectors(files, only=(), skip=()):
    """Filter by glob patterns: one without '/' matches the vector's name (the file stem), one
    with '/' the end of its path (`06-graph/*`); --only keeps matches, --skip drops them."""
    def hit(path, pattern):
        posix = path.as_posix()
        if "/" not in pattern:
            return fnmatch.fnmatchcase(path.stem, pattern)
        return any(fnmatch.fnmatchcase(text, pattern) or fnmatch.fnmatchcase(text, "*/" + pattern)
                   for text in (posix, posix[:-len(path.suffix)] if path.suffix else posix))
    return [f for f in files if (not only or any(hit(f, p) for p in only))
            and not any(hit(f, p) for p in skip)]


def read_vector(path):
    data, _ = actor.parse_yaml(Path(path).read_bytes(), str(path))
    return data


class ImplementationFailed(Exception):
    """The implementation under test gave no usable report (it crashed, exited without a report,
    or printed something that is no JSON object): an ERROR that is not the vector's fault."""

    def __init__(self, message, stderr="", returncode=None):
        super().__init__(message)
        self.stderr, self.returncode = stderr, returncode


STDERR_TAIL = 2000      # characters of an implementation's stderr shown under its vector


def stderr_tail(text, limit=STDERR_TAIL):
    """The last whole lines of `text` within `limit` characters (the last line always, whole)."""
    kept, size = [], 0
    for line in reversed((text or "").rstrip().splitlines()):
        if kept and size + len(line) + 1 > limit:
            break
        kept.insert(0, line)
        size += len(line) + 1
    return "\n".join(kept)


def observe_with(impl, vector, timeout):
    """Run another implementation on one vector (the --impl protocol) and parse its JSON report.
    Its stderr lands in the report's `stderr`; a run past `timeout` is killed with its children."""
    proc = subprocess.Popen(impl, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(vector), timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0 and not out.strip():
        last = stderr_tail(err, 0)
        raise ImplementationFailed(f"exited {proc.returncode} without a report"
                                   + (f": {last}" if last else ", nothing on stderr"),
                                   err, proc.returncode)
    try:
        report = json.loads(out)
    except ValueError as exc:
        raise ImplementationFailed(f"its report is no JSON ({exc})", err) from None
    if not isinstance(report, dict):
        raise ImplementationFailed("its report is not a JSON object", err)
    own = report.get("stderr")
    report["stderr"] = (own if isinstance(own, str) else "") + err
    return report


def _show(value):
    text = repr(value)
    return text if len(text) <= 400 else text[:400] + "..."


def run_one_vector(path, impl=None, timeout=VECTOR_TIMEOUT, known=frozenset()):
    """Read, lint, run and judge one vector file: a record {path, name, sections, profile,
    verdict, failures, message, expected, observed, stderr, lint warnings}. The verdict is pass,
    fail, skip (an extension the implementation does not list), error (a broken vector, or an
    implementation that crashed or timed out), or for a name in `known` (--known-failures) xfail
    where it would fail or err and xpass where it passes."""
    record = {"path": str(path), "name": Path(path).stem, "sections": [], "profile": "full",
              "verdict": "error", "failures": [], "message": None, "expected": None,
              "observed": None, "stderr": None, "lint": []}
    try:
        vector = read_vector(path)
    except actor.ActorError as exc:
        record["message"] = f"vector: {exc}"
        return _known(record, known)
    errors, record["lint"] = lint_vector(vector, Path(path).stem)
    if isinstance(vector, dict):
        record["name"] = vector.get("name", record["name"])
        record["sections"] = [str(s) for s in vector.get("spec") or []]
        record["profile"] = vector_profile(vector)
        record["expected"] = {k: vector[k] for k in ("load_error", "warnings", "steps")
                              if k in vector}
    if errors:
        record["message"] = "vector: " + "; ".join(errors)
        return _known(record, known)
    try:
        observed = observe_with(impl, vector, timeout) if impl else observe_vector(vector)
    except subprocess.TimeoutExpired:
        record["message"] = (f"timeout: the implementation ran past {timeout:g} s on this vector "
                             f"(raise the limit with --timeout S)")
        return _known(record, known)
    except ImplementationFailed as exc:
        record["message"], record["stderr"] = f"implementation: {exc}", stderr_tail(exc.stderr)
        return _known(record, known)
    except Exception as exc:  # boundary: an in-process crash is the implementation's ERROR
        record["message"] = f"implementation: crashed: {type(exc).__name__}: {exc}"
        return _known(record, known)
    record["observed"] = observed
    printed = observed.get("stderr")
    record["stderr"] = stderr_tail(printed) if isinstance(printed, str) and printed else None
    missing = unsupported_extensions(vector, observed)
    if missing:
        record["verdict"] = "skip"
        record["message"] = "extensions not supported: " + ", ".join(missing)
        return record
    try:
        failures = judge_vector(vector, observed)
    except Exception as exc:  # boundary: a report of the wrong shape is the implementation's
        record["message"] = (f"implementation: its report does not follow the protocol "
                             f"({type(exc).__name__}: {exc})")
        return _known(record, known)
    record["failures"] = [{"step": s, "action": a, "field": f, "expect": e, "got": g}
                          for s, a, f, e, g in failures]
    record["verdict"] = "fail" if failures else "pass"
    return _known(record, known)


def _known(record, known):
    """A known failure's verdict: xfail where it fails or errs, xpass where it passes."""
    if record["name"] in known:
        record["verdict"] = {"fail": "xfail", "error": "xfail", "pass": "xpass"}.get(
            record["verdict"], record["verdict"])
    return record


VERDICT_LABELS = {"pass": "PASS ", "fail": "FAIL ", "skip": "SKIP ", "error": "ERROR",
                  "xfail": "XFAIL", "xpass": "XPASS"}


def print_vector_record(record, out):
    """The text report's lines for one vector (STYLE §10)."""
    path, verdict = record["path"], record["verdict"]
    label = VERDICT_LABELS[verdict]
    if verdict == "pass":
        print(f"{label} {path}", file=out)
    elif verdict == "xpass":
        print(f"{label} {path}  listed as a known failure, and it passes", file=out)
    elif not record["failures"]:
        print(f"{label} {path}  {record['message']}", file=out)
    else:
        sections = ", ".join("§" + s for s in record["sections"])
        first = record["failures"][0]
        where = "load" if first["step"] is None else f"step {first['step']} ({first['action']})"
        print(f"{label} {path}  [{sections}]  {where}", file=out)
        for failure in record["failures"]:
            step, field = failure["step"], failure["field"]
            name = field if step is None or step == first["step"] else f"step {step} {field}"
            print(f"      {name}  expect: {_show(failure['expect'])}", file=out)
            print(f"      {' ' * len(name)}  got:    {_show(failure['got'])}", file=out)
    printed = record.get("stderr")
    if verdict in ("fail", "error", "xfail") and printed and not (
            "\n" not in printed and printed in (record["message"] or "")):   # said once is enough
        lines = printed.splitlines()
        print(f"      stderr: {lines[0]}", file=out)
        for line in lines[1:]:
            print(f"              {line}", file=out)


TOTALS = (("pass", "passed"), ("fail", "failed"), ("skip", "skipped"), ("xfail", "xfailed"),
          ("xpass", "xpassed"), ("error", "errors"))


def totals_line(counts):
    """`N passed, N failed`, then `, N skipped`, `, N xfailed`, `, N xpassed`, `, N error(s)` for
    the ones that occurred."""
    parts = [f"{counts['pass']} passed", f"{counts['fail']} failed"]
    for verdict, word in TOTALS[2:]:
        if counts[verdict]:
            word = "error" if word == "errors" and counts[verdict] == 1 else word
            parts.append(f"{counts[verdict]} {word}")
    return ", ".join(parts)


def _section_key(section):
    return [int(part) if part.isdigit() else 0 for part in str(section).split(".")]


def section_summary(records):
    """[{section, passed, failed, skipped, xfailed, xpassed, errors}] over the sections the
    vectors cite (a vector citing two sections counts in both), in the standard's order."""
    rows = {}
    for record in records:
        for section in record.get("sections") or ["(none)"]:
            row = rows.setdefault(section, {"section": section, **{w: 0 for _, w in TOTALS}})
            row[dict(TOTALS)[record["verdict"]]] += 1
    return [rows[s] for s in sorted(rows, key=_section_key)]


def print_summary(rows, out):
    """--summary: one line per cited section with its counts."""
    words = [w for _, w in TOTALS if w in ("passed", "failed", "skipped", "errors")
             or any(row[w] for row in rows)]
    width = max([len("section")] + [len(r["section"]) + 1 for r in rows])
    print(f"{'section':<{width}}  " + "  ".join(f"{w:>7}" for w in words), file=out)
    for row in rows:
        print(f"{'§' + row['section']:<{width}}  " + "  ".join(f"{row[w]:>7}" for w in words),
              file=out)


def read_known_failures(path):
    """--known-failures FILE: vector names, one a line; `#` starts a comment."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--known-failures {path}: cannot read it ({exc})") from None
    return {line.split("#", 1)[0].strip() for line in text.splitlines()} - {""}


def select_profile(files, profile):
    """The files whose vector belongs to `profile` ('core': marked `profile: core`; 'full' or
    None: every one). An unreadable vector stays, so that it is reported as an ERROR."""
    if profile in (None, "full"):
        return files
    kept = []
    for path in files:
        try:
            if vector_profile(read_vector(path)) == profile:
                kept.append(path)
        except actor.ActorError:
            kept.append(path)
    return kept


def implementation_label(impl):
    """How a report names the implementation it judged."""
    return impl or f"actor.py {actor.__version__} (in-process)"


def run_vectors(paths, impl=None, timeout=VECTOR_TIMEOUT, out=None, *, jobs=1, only=(),
                skip=(), as_json=False, profile=None, known=frozenset(), summary=False,
                results=None):
    """Run vector files/folders; print a PASS/FAIL/SKIP/ERROR/XFAIL/XPASS line per vector, with
    --summary the per-section table, and the totals line (totals_line); or with as_json one JSON
    report. `results`, a list, receives the JSON report. Returns (passed, not passed): the
    second counts what makes the run fail -- failures, errors and known failures that passed.

    With `impl`, up to `jobs` implementation processes run at once; the report keeps file order.
    """
    out = out or sys.stdout
    files = select_profile(select_vectors(collect_vector_files(paths), only, skip), profile)
    counts = {verdict: 0 for verdict, _ in TOTALS}
    records = []
    names = set()

    def report(record):
        for w in record["lint"]:
            print(f"warning: {record['path']}: {w}", file=sys.stderr)
        counts[record["verdict"]] += 1
        records.append(record)
        names.add(record["name"])
        if not as_json:
            print_vector_record(record, out)

    if impl and jobs > 1 and len(files) > 1:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="vector") as pool:
            for future in [pool.submit(run_one_vector, f, impl, timeout, known) for f in files]:
                report(future.result())
    else:
        for f in files:
            report(run_one_vector(f, impl, timeout, known))
    for name in sorted(known - names):
        print(f"warning: --known-failures: '{name}' names no vector of this run", file=sys.stderr)
    rows = section_summary(records)
    document = {"implementation": implementation_label(impl),
                **{word: counts[verdict] for verdict, word in TOTALS},
                "sections": rows,
                "vectors": [{k: actor.jsonable(v) for k, v in r.items() if k != "lint"}
                            for r in records]}
    if results is not None:
        results.append(document)
    if as_json:
        json.dump(document, out, indent=1)
        out.write("\n")
    else:
        if summary:
            print_summary(rows, out)
        print(totals_line(counts), file=out)
    return counts["pass"], counts["fail"] + counts["error"] + counts["xpass"]


def list_vectors(paths, out=None, *, only=(), skip=(), profile=None, as_json=False):
    """--list: one line per selected vector, its path and the sections it cites; with as_json
    {"vectors": [{name, path, sections, extensions, profile}]} (and `error` for an unreadable
    one)."""
    out = out or sys.stdout
    entries = []
    for path in select_profile(select_vectors(collect_vector_files(paths), only, skip), profile):
        entry = {"name": path.stem, "path": str(path), "sections": [], "extensions": [],
                 "profile": None}
        try:
            vector = read_vector(path)
            entry.update(name=vector.get("name", path.stem),
                         sections=[str(s) for s in vector.get("spec") or []],
                         extensions=vector_extensions(vector), profile=vector_profile(vector))
        except (actor.ActorError, AttributeError) as exc:
            entry["error"] = f"unreadable: {exc}"
        entries.append(entry)
        if not as_json:
            shown = ", ".join("§" + s for s in entry["sections"]) or f"({entry.get('error')})"
            print(f"{path}  [{shown}]", file=out)
    if as_json:
        json.dump({"vectors": entries}, out, indent=1)
        out.write("\n")


def read_run_vector(text):
    """--run-vector's input: one vector as a JSON object. Raises ValueError saying what is wrong
    (the harness shows it under the vector's ERROR line)."""
    try:
        vector = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--run-vector reads one vector as JSON on stdin: {exc}") from None
    problems = [problem for problem in lint_vector(vector)[0]     # what running it needs
                if not re.fullmatch(r"missing '(name|spec|description)'", problem)]
    if isinstance(vector, dict):
        for key, kind in (("host", dict), ("steps", list), ("configs", list),
                          ("config_text", str)):
            if vector.get(key) is not None and not isinstance(vector[key], kind):
                problems.append(f"'{key}' is not a JSON {kind.__name__.replace('dict', 'object')}")
    if problems:
        raise ValueError("--run-vector: not a usable vector: " + "; ".join(problems))
    return vector


def impl_problem(impl, files, timeout):
    """One line when the --impl command cannot be started at all (the shell's exit status 126 or
    127: not executable, not found), found on the first vector before the run, so that the same
    ERROR is not printed for every vector; else None (any other failure is that vector's ERROR)."""
    if not files:
        return None
    try:
        observe_with(impl, read_vector(files[0]), timeout)
    except ImplementationFailed as exc:
        if exc.returncode in (126, 127):
            reason = stderr_tail(exc.stderr, 0) or f"exit status {exc.returncode}"
            return f"--impl command cannot be run: {reason}"
    except (actor.ActorError, ValueError, OSError, subprocess.SubprocessError):
        pass                    # the run reports it as that vector's ERROR
    return None


# The conformance page (--report) --------------------------------------------------------------
REPORT_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; background: #fff; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } p.note { color: #555; margin: 0 0 1.2em; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: 3px 8px; }
th { background: #eee; text-align: center; } td.section { font-family: monospace; }
tr.top td.section { font-weight: bold; } td.n { text-align: right; font-family: monospace; }
td.ok { background: #cdeccd; } td.bad { background: #f6c6c6; } td.skip { background: #e4e4e4; }
td.none { background: #fafafa; color: #aaa; }
tr.total td { font-weight: bold; border-top: 2px solid #888; }
details { margin: .6em 0; } summary { cursor: pointer; } li { font-family: monospace; }
"""


def read_result(path):
    """A RESULT.json written by --json: (label, report). ValueError says what is wrong."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"--report: {path} cannot be read as JSON ({exc})") from None
    if not (isinstance(document, dict) and isinstance(document.get("vectors"), list) and all(
            isinstance(v, dict) and isinstance(v.get("verdict"), str)
            for v in document["vectors"])):
        raise ValueError(f"--report: {path} is not a report of --vectors --json")
    return document


def _cell(counts):
    """The page's cell for one section of one implementation: its class and its text."""
    bad = counts["failed"] + counts["errors"] + counts["xpassed"]
    ran = sum(counts.values())
    kind = "none" if not ran else "bad" if bad else "ok" if counts["passed"] + counts[
        "xfailed"] else "skip"
    return kind, [counts["passed"], bad, counts["skipped"] + counts["xfailed"]]


def report_page(reports):
    """The static conformance page: one row per cited section (grouped under its top-level §),
    for each implementation its PASS / FAIL / SKIP counts (FAIL: failed, erred or passed though
    listed as a known failure; SKIP: skipped or a known failure), then each implementation's
    vectors that did not pass. No script, no external asset: it reads the same offline."""
    import html
    esc = html.escape
    labels, seen = [], {}
    for report in reports:
        label = str(report.get("implementation") or "implementation")
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    sections = sorted({str(s) for report in reports for v in report["vectors"]
                       for s in v.get("sections") or ["(none)"]}, key=_section_key)
    tops = sorted({s.split(".")[0] for s in sections}, key=_section_key)
    empty = {w: 0 for _, w in TOTALS}

    def counts_of(k, wanted):      # each vector once, if it cites a wanted section
        total = dict(empty)
        for vector in reports[k]["vectors"]:
            if any(wanted(str(s)) for s in vector.get("sections") or ["(none)"]):
                total[dict(TOTALS).get(vector["verdict"], "errors")] += 1
        return total

    def row_html(name, css, k_counts):
        cells = []
        for counts in k_counts:
            kind, numbers = _cell(counts)
            cells += [f'<td class="n {kind}">{n}</td>' for n in numbers]
        return f'<tr class="{css}"><td class="section">{esc(name)}</td>{"".join(cells)}</tr>'

    rows = []
    for top in tops:
        rows.append(row_html(f"§{top}", "top", [counts_of(k, lambda s, t=top: s.split(".")[0] == t)
                                                for k in range(len(reports))]))
        for section in sections:
            if section.split(".")[0] == top and section != top:
                rows.append(row_html(f"§{section}", "sub", [
                    counts_of(k, lambda s, x=section: s == x) for k in range(len(reports))]))
    rows.append(row_html("all vectors", "total", [counts_of(k, lambda s: True)
                                                  for k in range(len(reports))]))
    head = "".join(f'<th colspan="3">{esc(label)}</th>' for label in labels)
    sub = "<th>PASS</th><th>FAIL</th><th>SKIP</th>" * len(reports)
    details = []
    for label, report in zip(labels, reports):
        missed = [v for v in report["vectors"] if v["verdict"] not in ("pass", "skip", "xfail")]
        items = "".join(f"<li>{esc(v['verdict'].upper())} {esc(str(v.get('path')))}"
                        f"{' -- ' + esc(str(v['message'])) if v.get('message') else ''}</li>"
                        for v in missed)
        details.append(f"<details><summary>{esc(label)}: {len(missed)} vectors did not pass"
                       f"</summary><ul>{items}</ul></details>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>Conformance: Actor Configuration Standard</title>"
            f"<style>{REPORT_STYLE}</style></head><body>"
            "<h1>Conformance to the Actor Configuration Standard 1.0.0</h1>"
            "<p class=\"note\">Vectors per section of the standard (a vector citing two sections "
            "counts in both). FAIL counts failures, errors and known failures that passed; SKIP "
            "counts skipped vectors and known failures.</p>"
            f"<table><thead><tr><th rowspan=\"2\">section</th>{head}</tr><tr>{sub}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>{''.join(details)}</body></html>\n")


def write_report(out_path, reports):
    """Write the conformance page of `reports` to `out_path`."""
    try:
        Path(out_path).write_text(report_page(reports), encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--report {out_path}: cannot write it ({exc})") from None


# Command line ------------------------------------------------------------------------------
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line (exit status 2), not the whole usage text."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --vectors --help)\n"
                  if self.prog == "actor" else f"{self.prog}: error: {message} (see --help)\n")


def arg_parser(prog):
    lead = f"{prog} --vectors PATH..." if prog == "actor" else f"{prog} PATH..."
    p = _ArgumentParser(
        prog=prog, allow_abbrev=False,
        usage=f"{lead} [--impl CMD [-j N] [--timeout S]] [--only P] [--skip P] "
        f"[--profile core] [--known-failures FILE] [--summary] [--json] [--report OUT.html]\n"
        f"       {lead} --list [--json] [--only P] [--skip P] [--profile core]\n"
        f"       {prog} --report OUT.html RESULT.json...\n"
        f"       {prog} --run-vector",
        description="Run the Actor Configuration Standard's vectors (vectors/README.md) on "
        "actor.py, or on another implementation through the --impl protocol, and judge them.",
        epilog="Exit status: 0 every vector passed, was skipped or is a known failure; 1 a vector "
        "failed or erred, or a known failure passed; 2 bad usage, a path that holds no vector, "
        "or an --impl command that cannot be run.")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="vector files or folders (with --report alone: RESULT.json files)")
    p.add_argument("--vectors", nargs="*", metavar="PATH",
                   help="the same PATHs, as actor.py's command line writes them")
    p.add_argument("--impl", metavar="CMD", help="judge another implementation: CMD reads one "
                   "vector as JSON on stdin and prints what happened as JSON")
    p.add_argument("--timeout", type=actor._positive(float), metavar="S",
                   help=f"with --impl: seconds each vector's process may take "
                   f"(default {VECTOR_TIMEOUT:g})")
    p.add_argument("-j", "--jobs", type=actor._positive(int), metavar="N",
                   help="with --impl: vectors run at once (default: the number of cores)")
    p.add_argument("--only", action="append", metavar="PATTERN",
                   help="run only vectors whose name (or, with '/', path) matches this glob "
                   "(repeatable)")
    p.add_argument("--skip", action="append", metavar="PATTERN",
                   help="leave out vectors matching this glob (repeatable)")
    p.add_argument("--profile", choices=PROFILES,
                   help="core: only the vectors marked `profile: core` (tool agents, stream "
                   "routes); full: all (the default)")
    p.add_argument("--known-failures", metavar="FILE",
                   help="vector names, one a line (# comments): they are XFAIL, not failures, "
                   "and one that passes is XPASS, which fails the run")
    p.add_argument("--summary", action="store_true",
                   help="print pass/fail/skip/error counts per cited section")
    p.add_argument("--list", action="store_true",
                   help="list the selected vectors and their sections, run none (with --json: "
                   "name, path, sections, extensions, profile)")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    p.add_argument("--report", metavar="OUT.html",
                   help="write a static conformance page (sections x PASS/FAIL/SKIP) of this "
                   "run, or of the RESULT.json files of --json runs given as PATHs")
    p.add_argument("--run-vector", action="store_true",
                   help="actor.py's side of the --impl protocol: read one vector as JSON on "
                   "stdin, print what happened as JSON")
    return p


def usage_problem(args):
    """The one-line complaint about options that do not go together, or None."""
    if args.vectors is not None and args.paths:
        return f"--vectors takes the vector paths; {' '.join(args.paths)} would be ignored"
    paths = (args.vectors or []) + args.paths
    given = [flag for flag, value in (
        ("--impl", args.impl), ("--timeout", args.timeout), ("-j", args.jobs),
        ("--only", args.only), ("--skip", args.skip), ("--list", args.list),
        ("--json", args.json), ("--profile", args.profile),
        ("--known-failures", args.known_failures), ("--summary", args.summary),
        ("--report", args.report)) if value]
    if args.run_vector:
        if paths or given:
            return (f"--run-vector reads one vector on stdin: {(given or paths)[0]} does "
                    f"nothing with it")
        return None
    if args.report and paths and args.vectors is None and all(
            p.endswith(".json") for p in paths):
        others = [flag for flag in given if flag != "--report"]
        return f"{others[0]} does nothing with --report RESULT.json..." if others else None
    if not paths:
        return ("--report needs RESULT.json files, or vectors to run" if args.report else
                "give the vector files or folders to run (e.g. vectors)")
    if any(p.endswith(".json") for p in paths):
        return "RESULT.json files go with --report alone (it runs nothing then)"
    for flag, value in (("--timeout", args.timeout), ("-j", args.jobs)):
        if value and not args.impl:
            return f"{flag} works only with --impl (it bounds the implementation's processes)"
    for flag, value in (("--impl", args.impl), ("--timeout", args.timeout), ("-j", args.jobs),
                        ("--known-failures", args.known_failures), ("--summary", args.summary),
                        ("--report", args.report)):
        if value and args.list:
            return f"{flag} does nothing with --list (it runs no vector)"
    return None


def main(argv=None, prog="run.py"):
    """The harness's command line; returns the exit status (0, 1 or 2, as the epilog says)."""
    parser = arg_parser(prog)
    try:            # argparse exits (--help, a usage error): here that is a status to return
        args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        if extra:
            what = "does nothing with the vector harness" if prog == "actor" else "is no option"
            parser.error(f"{extra[0]} {what}")
    except SystemExit as exc:
        return exc.code
    problem = usage_problem(args)
    if not problem and prog == "actor" and args.vectors is None and args.paths and not (
            args.report and all(p.endswith(".json") for p in args.paths)):
        problem = f"{args.paths[0]}: vectors to run go after --vectors"
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(format="%(message)s", level=logging.ERROR, stream=sys.stderr)
    actor.log.setLevel(logging.ERROR)   # an Actor's warnings are in the report, not the terminal
    if args.run_vector:
        try:
            vector = read_run_vector(sys.stdin.read())
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(json.dumps(observe_vector(vector)))
        return EXIT_OK
    paths = (args.vectors or []) + args.paths
    only, skip = args.only or [], args.skip or []
    timeout = args.timeout or VECTOR_TIMEOUT
    try:
        if args.report and args.vectors is None and all(p.endswith(".json") for p in paths):
            reports = [read_result(p) for p in paths]
            write_report(args.report, reports)
            print(f"wrote {args.report}: {len(reports)} implementation(s)")
            return EXIT_OK
        if args.list:
            list_vectors(paths, only=only, skip=skip, profile=args.profile, as_json=args.json)
            return EXIT_OK
        known = read_known_failures(args.known_failures) if args.known_failures else frozenset()
        problem = args.impl and impl_problem(args.impl, select_profile(select_vectors(
            collect_vector_files(paths), only, skip), args.profile), timeout)
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
        results = []
        _, not_passed = run_vectors(paths, impl=args.impl, timeout=timeout,
                                    jobs=args.jobs or os.cpu_count() or 1, only=only, skip=skip,
                                    as_json=args.json, profile=args.profile, known=known,
                                    summary=args.summary, results=results)
        if args.report:
            write_report(args.report, results)
    except ValueError as exc:       # a path that holds no vector, a file that cannot be read
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_FAILED if not_passed else EXIT_OK


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the actor.py beside vectors/
    import actor as _actor
    bind(_actor)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
