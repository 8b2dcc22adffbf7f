"""Find every `dlrl` command line in the deploy/ manifests and scripts, and run it through the
real CLI with `--check-config` (tests/test_deploy_*.py).

    for cmd in shell_commands(Path("deploy/local/run.sh").read_text(), env, "run.sh"):
        code, out, err = run_check(cmd.argv)           # 0 and one JSON line, or 2 naming the key

A command is whatever follows `dlrl` (the console script) or `-m dlrl.cli` / `--module dlrl.cli`
(torchrun, python, the DeepSpeed launcher) in: shell text (lines joined at `\\`, split at `;`, `&`,
`|`, redirections dropped; `bash -c` bodies searched too), Kubernetes container `command` + `args`
(`$(VAR)` expanded from the container's env, `sh -c` scripts parsed as shell) and compose
`command` lists. Variables are replaced by sample values; one without a sample is an error naming
it, and so are `$((...))` / `$(...)` inside a line that runs dlrl (a sample cannot stand for them).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field

SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash", "/usr/bin/env bash")
_VAR = re.compile(r"\$\{(\w+)(?::?[-=]([^}]*))?\}|\$(\w+|@)")
_ARRAY = re.compile(r'"?\$(?:@|\{(\w+)\[@\]\})"?')
_REDIRECT = re.compile(r"""\s\d*(?:>>|>&|&>|>|<)\s*(?:"[^"]*"|'[^']*'|[^\s;&|'"]+)""")
_K8S_VAR = re.compile(r"\$\((\w+)\)")
_OPERATORS = {";", "&", "&&", "|", "||", ";;", "(", ")"}
_PREFIX = {"exec", "env", "nohup", "time", "command", "then", "do", "else"}
_ASSIGN = re.compile(r"^\w+=")


@dataclass
class DlrlCommand:
    source: str                 # where it was found, for error messages
    argv: list[str]             # what `dlrl` receives: ["serve", "--config", ...]
    launcher: list[str] = field(default_factory=list)  # what runs it: [..., "torchrun", ..., "-m", "dlrl.cli"]

    def __str__(self) -> str:
        return f"{self.source}: {shlex.join(self.launcher + self.argv)}"


def find_dlrl(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(launcher, argv) of a command that runs dlrl, else None. `dlrl` counts in command position
    (after assignments / `exec`-like words), `-m dlrl.cli` anywhere (a launcher's module)."""
    for i, w in enumerate(words):
        if (w == "dlrl" or w.endswith("/bin/dlrl")) and all(p in _PREFIX or _ASSIGN.match(p) for p in words[:i]):
            return words[:i + 1], words[i + 1:]
        if w in ("-m", "--module") and words[i + 1:i + 2] == ["dlrl.cli"]:
            return words[:i + 2], words[i + 2:]
        if w == "--module=dlrl.cli":
            return words[:i + 1], words[i + 1:]
    return None


def logical_lines(text: str) -> list[str]:
    """Shell text as logical lines: `\\`-continued lines joined, comment-only lines dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    return out + ([buf] if buf else [])


def expand(line: str, env: dict, source: str) -> str:
    """Replace shell variables by sample values (`env`; "@" = the script's arguments, a list)."""
    if "$((" in line or re.search(r"\$\((?!\()", line):
        raise ValueError(f"{source}: arithmetic or command substitution in a dlrl line: {line.strip()}")

    def array(m: re.Match) -> str:
        name = m.group(1) or "@"
        if name not in env:
            raise ValueError(f"{source}: no sample value for ${name} in: {line.strip()}")
        return " ".join(shlex.quote(v) for v in env[name])

    def var(m: re.Match) -> str:
        name, default = m.group(1) or m.group(3), m.group(2)
        if name in env:
            return str(env[name])
        if default is not None and "$" not in default:
            return default
        raise ValueError(f"{source}: no sample value for ${name} in: {line.strip()}")

    return _VAR.sub(var, _ARRAY.sub(array, line))


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of one logical shell line (redirections dropped)."""
    lex = shlex.shlex(_REDIRECT.sub(" ", " " + line), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, words = [], []
    for tok in lex:
        if tok in _OPERATORS:
            commands.append(words)
            words = []
        else:
            words.append(tok)
    return [c for c in commands + [words] if c]


def shell_commands(text: str, env: dict, source: str) -> list[DlrlCommand]:
    """Every dlrl command in a shell script (or an `sh -c` body), with `env` as sample values."""
    found = []
    for line in logical_lines(text):
        if not re.search(r"(^|[\s/\"'])dlrl([\s\"']|$)|dlrl\.cli", line):
            continue
        raw = simple_commands(line)  # expand only lines that run dlrl (or a shell that may)
        if not any(find_dlrl(w) or any(s in w for s in SHELLS) for w in raw):
            continue
        for words in simple_commands(expand(line, env, source)):
            for i, w in enumerate(words[:-2]):  # bash -c '<script>': search the script too
                if w in SHELLS and words[i + 1] == "-c":
                    found += shell_commands(words[i + 2], env, source)
            hit = find_dlrl(words)
            if hit:
                found.append(DlrlCommand(source, hit[1], hit[0]))
    return found


def literal_assignments(text: str) -> dict[str, str]:
    """`NAME=value` and `NAME=${NAME:-value}` lines of a script whose value holds no `$`: its defaults."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)=(?:\$\{\1:-([^}$]*)\}|\"([^\"$]*)\"|'([^']*)'|([^\s$\"'`;()]*))\s*(#.*)?$", line)
        if m:
            out[m.group(1)] = next(g for g in m.groups()[1:5] if g is not None)
    return out


def container_commands(container: dict, source: str, samples: dict) -> list[DlrlCommand]:
    """The dlrl commands of a Kubernetes container: `command` + `args`, `$(VAR)` from its env
    (values; `samples` for fieldRef / injected ones such as JOB_COMPLETION_INDEX)."""
    env = {**samples, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    words = list(container.get("command", [])) + list(container.get("args", []))
    if len(words) >= 3 and words[0] in SHELLS and words[1] == "-c":
        return shell_commands(words[2], env, source)

    def k8s_var(m: re.Match) -> str:
        if m.group(1) not in env:
            raise ValueError(f"{source}: no value for $({m.group(1)})")
        return str(env[m.group(1)])

    words = [_K8S_VAR.sub(k8s_var, w) for w in words]
    hit = find_dlrl(words)
    return [DlrlCommand(source, hit[1], hit[0])] if hit else []


def replace_paths(cmd: DlrlCommand, paths: dict[str, str]) -> DlrlCommand:
    """Point container paths (a mounted ConfigMap / compose config) at the local files holding them."""
    argv = []
    for a in cmd.argv:
        key, eq, value = a.partition("=")
        if a in paths:
            a = paths[a]
        elif eq and value in paths:
            a = f"{key}={paths[value]}"
        argv.append(a)
    return DlrlCommand(cmd.source, argv, cmd.launcher)


def run_check(argv: list[str]) -> tuple[int, str, str]:
    """`dlrl <argv> --check` through the real CLI entry point (in process: one import of torch).
    Returns (exit code, stdout, stderr)."""
    from dlrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*argv, "--check-config", "--json"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()
