"""Whether a constraint admits a finite output, decided before it compiles.

The grammar engine accepts a grammar whose every output is infinite (a
Lark rule that only refers to itself, `start: "a" start`; a JSON schema
whose required property refers back to the schema through $ref) and then
runs the request to its token limit. These checks find such constraints
from their text, so that they are refused up front naming the field:

- a JSON schema: the least fixed point of "this subschema has a finite
  instance" over local $refs. Only what forces structure is followed (the
  required properties of an object-only schema, an array's first minItems
  items, allOf, every branch of anyOf / oneOf); a schema that also allows
  another type, or that this reading does not follow, counts as finite.
- a Lark grammar: the rules that derive a finite string (terminals and
  literals do; a rule does when one of its alternatives is made only of
  such), for the subset of Lark written here (rules, terminals, literals,
  regexes, groups, optionals, repetitions, `~ n`). Any other construct
  (directives, templates, llguidance's extensions) leaves the grammar to
  the engine.

Each answer is None (nothing found, or not decided) or why no finite
output exists.
"""

from __future__ import annotations

import re
from typing import Any

# JSON nodes visited at most: a larger schema is left to the grammar engine
MAX_VISITS = 200_000


class _Undecided(Exception):
    pass


def json_schema_error(schema: Any) -> str | None:
    """Why no finite JSON value satisfies `schema` (a parsed schema), or None."""
    checker = _Schema(schema)
    try:
        if checker.finite(schema, frozenset()):
            return None
    except (_Undecided, RecursionError):
        return None
    where = checker.blocked or "#"
    return f"no output satisfies it: {where} refers back to itself through what every output must hold"


class _Schema:
    def __init__(self, root: Any):
        self.root, self.visits, self.blocked = root, 0, ""
        self.known: set[str] = set()

    def resolve(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise _Undecided
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _Undecided
        return node

    def finite(self, node: Any, visiting: frozenset[str]) -> bool:
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise _Undecided
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ok = True
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in visiting:
                self.blocked = self.blocked or ref
                return False
            if ref not in self.known:
                if not self.finite(self.resolve(ref), visiting | {ref}):
                    return False
                self.known.add(ref)  # finite under any assumption: kept
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                ok = ok and any(self.finite(b, visiting) for b in branches)
        branches = node.get("allOf")
        if isinstance(branches, list):
            ok = ok and all(self.finite(b, visiting) for b in branches)
        kinds = node.get("type")
        if kinds == "object":
            props = node.get("properties")
            props = props if isinstance(props, dict) else {}
            required = node.get("required")
            required = required if isinstance(required, list) else []
            ok = ok and all(self.finite(props.get(name, True), visiting) for name in required if isinstance(name, str))
        elif kinds == "array" and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
            prefix = node.get("prefixItems")
            items = list(prefix[:node["minItems"]]) if isinstance(prefix, list) else []
            if len(items) < node["minItems"] and isinstance(node.get("items"), dict):
                items.append(node["items"])
            ok = ok and all(self.finite(item, visiting) for item in items)
        return ok


_LARK_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+) | (?P<newline>\n) | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?!/)(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*)
  | (?P<number>\d+) | (?P<range>\.\.)
  | (?P<punct>[:|()\[\]?*+~])
""", re.VERBOSE)


def lark_error(text: str) -> str | None:
    """Why the Lark grammar `text` derives no finite string from `start`,
    or None (it does, or the grammar uses what this reading leaves to the
    engine)."""
    try:
        rules, terminals = _lark_rules(text)
    except _Undecided:
        return None
    if "start" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _derives(body, productive, rules, terminals):
                productive.add(name)
                changed = True
    if "start" in productive:
        return None
    return "no output satisfies it: rule start derives no finite string (every alternative refers back)"


def _lark_rules(text: str) -> tuple[dict[str, list], set[str]]:
    """{rule: its alternatives, each a list of items}, and the terminals' names."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _LARK_TOKEN.match(text, pos)
        if m is None:
            raise _Undecided  # a construct this reading does not know (%import, templates, {...})
        kind = m.lastgroup or ""
        if kind not in ("space", "comment"):
            tokens.append((kind, m.group()))
        pos = m.end()
    # definitions: a name and a colon at a line's start
    starts = [i for i, (kind, value) in enumerate(tokens)
              if kind == "name" and (i == 0 or tokens[i - 1][0] == "newline") and i + 1 < len(tokens)
              and tokens[i + 1] == ("punct", ":")]
    if not starts or any(kind != "newline" for kind, _ in tokens[:starts[0]]):
        raise _Undecided
    rules: dict[str, list] = {}
    terminals: set[str] = set()
    for n, at in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(tokens)
        name = tokens[at][1].lstrip("?!")
        body = [t for t in tokens[at + 2:end] if t[0] != "newline"]
        if name.isupper():
            terminals.add(name)
            continue
        items, rest = _alternatives(body)
        if rest:
            raise _Undecided
        if name in rules:
            raise _Undecided
        rules[name] = items
    return rules, terminals


def _alternatives(tokens: list) -> tuple[list, list]:
    alts: list[list] = []
    seq: list = []
    while tokens and tokens[0] not in (("punct", ")"), ("punct", "]")):
        if tokens[0] == ("punct", "|"):
            alts.append(seq)
            seq, tokens = [], tokens[1:]
            continue
        item, tokens = _item(tokens)
        seq.append(item)
    alts.append(seq)
    return alts, tokens


def _item(tokens: list) -> tuple[Any, list]:
    kind, value = tokens[0]
    if kind in ("string", "regex"):
        atom: Any = ("leaf",)
        tokens = tokens[1:]
    elif kind == "name":
        atom, tokens = ("ref", value.lstrip("?!")), tokens[1:]
    elif (kind, value) in (("punct", "("), ("punct", "[")):
        inner, rest = _alternatives(tokens[1:])
        close = ")" if value == "(" else "]"
        if not rest or rest[0] != ("punct", close):
            raise _Undecided
        atom, tokens = (("group", inner) if value == "(" else ("maybe", inner)), rest[1:]
    else:
        raise _Undecided
    while tokens:
        kind, value = tokens[0]
        if (kind, value) in (("punct", "?"), ("punct", "*")):
            atom, tokens = ("maybe", [[atom]]), tokens[1:]
        elif (kind, value) == ("punct", "+"):
            tokens = tokens[1:]
        elif (kind, value) == ("punct", "~"):
            if len(tokens) < 2 or tokens[1][0] != "number":
                raise _Undecided
            low, tokens = int(tokens[1][1]), tokens[2:]
            if tokens and tokens[0][0] == "range":
                if len(tokens) < 2 or tokens[1][0] != "number":
                    raise _Undecided
                tokens = tokens[2:]
            if low == 0:
                atom = ("maybe", [[atom]])
        else:
            break
    return atom, tokens


def _derives(alternatives: list, productive: set[str], rules: dict, terminals: set[str]) -> bool:
    return any(all(_finite_item(item, productive, rules, terminals) for item in seq) for seq in alternatives)


def _finite_item(item: Any, productive: set[str], rules: dict, terminals: set[str]) -> bool:
    kind = item[0]
    if kind in ("leaf", "maybe"):
        return True
    if kind == "group":
        return _derives(item[1], productive, rules, terminals)
    name = item[1]
    return name in productive or name not in rules  # a terminal, or an undefined name the engine names
