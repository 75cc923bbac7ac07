"""A verl launch script's overrides: `dagrl train --from-verl run.sh` reads the key=value
arguments of its `python -m verl.trainer.main_ppo ...` line, with the shell's variables and
arithmetic expanded as bash would, and hands them to config/verl.py's `translate`.
"""

from __future__ import annotations

import re
import shlex

from dagrl.config.loader import ConfigError

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ARITH = re.compile(r"\$\(\(([^()]*)\)\)")
_ENTRY_POINTS = ("verl.trainer.main_ppo", "recipe.dapo.main_dapo", "recipe.dapo.src.main_dapo",
                 "verl.trainer.main_generation")


def overrides_from_script(text: str, env: dict[str, str] | None = None) -> list[str]:
    """The key=value arguments of a verl launch script's `python -m verl.trainer.main_ppo ...`
    line (line continuations joined; `NAME=value` assignments above it, `${NAME:-default}`,
    `$NAME` and `$((a * b))` expanded; `$@` dropped). Hydra's --config-path/--config-name are
    refused: that file is verl's, not a list of overrides."""
    variables = dict(env or {})
    joined = re.sub(r"\\\n", " ", text)

    def expand(s: str) -> str:
        for _ in range(8):   # nested ${A:-${B}} and arithmetic over expanded names
            new = _VAR.sub(lambda m: variables.get(m.group(1) or m.group(3),
                                                   m.group(2) if m.group(2) is not None else ""),
                           s)
            new = _ARITH.sub(lambda m: str(_arith(m.group(1), variables)), new)
            if new == s:
                return s
            s = new
        return s

    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ASSIGN.match(line)
        if match and " -m " not in line:
            value = shlex.split(expand(match.group(2)), comments=True)
            variables[match.group(1)] = value[0] if value else ""
            continue
        words = shlex.split(expand(line), comments=True)
        if "-m" in words and words[words.index("-m") + 1:][:1] and \
                words[words.index("-m") + 1] in _ENTRY_POINTS:
            args = words[words.index("-m") + 2:]
            hydra = [a for a in args if a.startswith(("--config-path", "--config-name"))]
            if hydra:
                raise ConfigError(f"{hydra[0]}: a Hydra config file of verl's is not read; "
                                  "pass its settings as overrides")
            return [a for a in args if a not in ("$@", '"$@"') and "=" in a]
    raise ConfigError("no `python -m verl.trainer.main_ppo ...` line found in the script")


def _arith(expr: str, variables: dict[str, str]) -> int:
    """bash's $(( )) over integers; names inside it are variables, as in bash."""
    expr = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: variables.get(m.group(0), "0"), expr)
    if not re.fullmatch(r"[0-9+\-*/ ()]+", expr):
        raise ConfigError(f"$(( {expr} )): only integer arithmetic is expanded")
    return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # noqa: S307 (digits only)
