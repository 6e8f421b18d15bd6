"""Custom tools' input grammars (Responses `custom` tools with a Lark or regex `format`) inside
the tool-call grammars.

A custom tool reaches the model as a function with one string argument, `input`; its call is the
format's usual markup, the input a string value in it. The input's grammar holds that string:

- In the formats whose string values are JSON string literals (hermes, llama3_json, mistral, and
  pythonic, which writes strings as JSON does), the grammar must hold the *decoded* value while
  the model writes the escaped one. llguidance has no Lark construct for "this rule, JSON-quoted"
  (its JSON quoting applies to one lexeme, a regex), so:
  * A regex goes into a JSON schema `pattern`, anchored (OpenAI's regex format: the whole input
    matches), which llguidance JSON-quotes itself.
  * A Lark grammar whose rules do not recurse (Codex's apply_patch) is a regular language: its
    rules and terminals are inlined into one regex (`lark_to_regex`), which then goes the same
    way. Exact, and the whole input is one lexeme. In both, \\d and \\w take ASCII characters only
    (llguidance's pattern dialect, as every regex tallow enforces): a subset, never a superset.
  * A recursive Lark grammar is rewritten into the grammar of its strings' JSON escapes
    (`json_escaped_lark`: JSON's escaping is one fixed string per character, so escaping every
    terminal gives the escaped language; rules untouched), embedded as a nested `%lark { ... }`
    between the quotes (its `%ignore` stays inside the string). llguidance's lexer ends a lexeme
    on one byte of lookahead, and every escape begins with a backslash: a regex terminal that
    could take an escaped character would be cut wrong at its end. So this path holds exactly
    when no regex terminal (nor an `%ignore`d or imported one) matches a quote, backslash or
    control character (string literals may hold them: a literal is one fixed lexeme); any other
    recursive grammar is refused.
  What neither path can hold is UnenforceableInput (a 400 naming the tool's `format`), never
  passed through unenforced: special tokens, `%json` / `%regex` / `%lark` / `%declare` /
  `%override` / `%if`, `%import` of anything but the common.lark terminals in COMMON, and in the
  escaped path regex syntax it does not read (\\p classes, nested or set-operation classes, the x
  flag, word-boundary assertions).
- qwen3_coder writes a string parameter as raw text up to "\\n</parameter>": the grammar goes in
  as it is (a regex as a Lark terminal). Limit: a grammar whose language holds "\\n</parameter>"
  can end the value early for the parser.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from tallow.output.tool_parsers.grammar import GrammarTool, LarkGrammar, call_object_schema, json_rule, lit


@dataclass(frozen=True)
class InputGrammar:
    """A custom tool's input grammar: syntax "lark" or "regex", its definition, and where the
    request gave it (for a 400: "tools[3]")."""

    syntax: str
    definition: str
    param: str = ""


class UnenforceableInput(ValueError):
    """An input grammar this tool-call format cannot hold the input to (a 400 naming `format`)."""

    def __init__(self, tool: str, message: str, param: str = ""):
        super().__init__(f"tool {tool!r}: {message}")
        self.tool = tool
        self.param = param


class _Unsupported(ValueError):
    pass


def check_definition(syntax: str, definition: str) -> str | None:
    """llguidance's reason why the definition does not compile, or None (no tokenizer: special
    tokens are checked with the whole tool-call grammar)."""
    import llguidance as llg

    try:
        grammar = llg.grammar_from("regex" if syntax == "regex" else "lark", definition)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as e:
        return str(e) or type(e).__name__
    if is_error:
        text = messages[0] if messages else "invalid grammar"
        for cut in ("\n<state>", "<state>", "\n<grammar>"):
            if cut in text:
                text = text[:text.index(cut)]
        return text.strip()[:2000]
    return None


def string_value(g: LarkGrammar, tool: str, grammar: InputGrammar, quoting: str) -> str:
    """A Lark expression (defined in g) of a string value that follows `grammar`, written as the
    format writes strings: quoting "json" (a JSON string literal, quotes included) or "raw" (the
    text itself). Raises UnenforceableInput."""
    if quoting == "raw":
        if grammar.syntax == "regex":
            return g.add(f"%lark {{\nstart: /{_slashes(grammar.definition)}/\n}}")
        return g.add(f"%lark {{\n{grammar.definition}\n}}")
    if grammar.syntax == "regex":
        return g.add(_string_pattern(grammar.definition))
    try:
        return g.add(_string_pattern(lark_to_regex(grammar.definition)))
    except (_Recursive, _Unsupported) as e:
        as_regex = f"as one regex: {e}; " if isinstance(e, _Unsupported) else ""
    try:
        inner = json_escaped_lark(grammar.definition)
    except _Unsupported as e:
        raise UnenforceableInput(tool, f"the Lark grammar cannot be enforced inside the call's JSON string "
                                 f"({as_regex}{e})", grammar.param) from None
    return g.add(f'"\\"" %lark {{\n{inner}\n}} "\\""')


def _string_pattern(regex: str) -> str:
    """%json of a JSON string whose value matches regex, whole (llguidance JSON-quotes it)."""
    return "%json " + json.dumps({"type": "string", "pattern": f"^(?:{regex})$"}, ensure_ascii=False)


def _slashes(pattern: str) -> str:
    return re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern)


# ---- JSON escapes ----------------------------------------------------------------------------

_SHORT = {'"': '"', "\\": "\\", "\n": "n", "\r": "r", "\t": "t", "\b": "b", "\f": "f"}
SPECIALS = ['"', "\\"] + [chr(c) for c in range(0x20)]  # the characters JSON strings escape
_SAFE_CLASS = r'[^"\\\x00-\x1F]'


def json_escape(char: str) -> str:
    """char as json.dumps writes it inside a string (ensure_ascii off)."""
    if char in _SHORT:
        return "\\" + _SHORT[char]
    if ord(char) < 0x20:
        return f"\\u{ord(char):04x}"
    return char


def _escape_rx(char: str) -> str:
    """A regex that matches exactly char's JSON escape."""
    return "".join("\\" + c if c in "\\\"" else c for c in json_escape(char))


def _escapes_rx(chars: list[str], case_insensitive: bool) -> str:
    """A regex of the JSON escapes of chars (specials): \\["\\bfnrt] and \\u00XX."""
    short = "".join(_SHORT[c] for c in chars if c in _SHORT)
    long = [f"{ord(c):02x}" for c in chars if c not in _SHORT]
    parts = []
    if short:
        parts.append(_escape_rx(next(c for c in chars if c in _SHORT)) if len(short) == 1
                     else "\\\\[" + short.replace("\\", "\\\\") + "]")
    if long:
        parts.append("\\\\u00" + (long[0] if len(long) == 1 else f"(?:{'|'.join(long)})"))
    body = "|".join(parts)
    return f"(?-i:{body})" if case_insensitive else body


# ---- regexes (Rust's syntax) -----------------------------------------------------------------

_PERL = {"d": lambda c: False, "w": lambda c: False, "s": lambda c: c in "\t\n\x0b\x0c\r"}
_ASCII_CLASSES = {  # [:name:] -> its special characters
    "alnum": "", "alpha": "", "digit": "", "lower": "", "upper": "", "xdigit": "", "word": "",
    "blank": "\t", "space": "\t\n\x0b\x0c\r", "cntrl": "".join(chr(c) for c in range(0x20)),
    "punct": '"\\', "graph": '"\\', "print": '"\\', "ascii": "".join(SPECIALS),
}
_ESCAPED_CHARS = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\x0b", "a": "\x07"}
_QUANTIFIER = re.compile(r"\{\d*(,\d*)?\}")


def _code_point(pattern: str, i: int) -> tuple[str, int]:
    """The character of the escape at pattern[i] ("\\" at i) and the index after it."""
    kind = pattern[i + 1]
    if kind in _ESCAPED_CHARS:
        return _ESCAPED_CHARS[kind], i + 2
    if kind in "xuU":
        if i + 2 < len(pattern) and pattern[i + 2] == "{":
            end = pattern.find("}", i + 3)
            if end == -1:
                raise _Unsupported("an unclosed \\x{...} escape")
            digits, after = pattern[i + 3:end], end + 1
        else:
            width = {"x": 2, "u": 4, "U": 8}[kind]
            digits, after = pattern[i + 2:i + 2 + width], i + 2 + width
        try:
            return chr(int(digits, 16)), after
        except ValueError:
            raise _Unsupported(f"the escape {pattern[i:after]!r}") from None
    if kind.isalnum():
        raise _Unsupported(f"the regex escape \\{kind}")
    return kind, i + 2


def _class_specials(pattern: str, i: int) -> tuple[list[str], int]:
    """The special characters the class at pattern[i] ("[") matches, and the index after it."""
    j = i + 1
    negated = j < len(pattern) and pattern[j] == "^"
    if negated:
        j += 1
    members: set[str] = set()
    first = True
    prev: str | None = None  # the last single character, for a range
    while True:
        if j >= len(pattern):
            raise _Unsupported("an unclosed character class")
        c = pattern[j]
        if c == "]" and not first:
            j += 1
            break
        first = False
        if c == "[":
            m = re.match(r"\[:(\^?)([a-z]+):\]", pattern[j:])
            if m is None or m.group(2) not in _ASCII_CLASSES:
                raise _Unsupported("a nested character class")
            chars = set(_ASCII_CLASSES[m.group(2)])
            members |= (set(SPECIALS) - chars) if m.group(1) else chars
            j += m.end()
            prev = None
            continue
        if pattern.startswith(("&&", "--", "~~"), j):
            raise _Unsupported("a character class set operation")
        if c == "-" and prev is not None and j + 1 < len(pattern) and pattern[j + 1] != "]":
            if pattern[j + 1] == "\\":
                high, j = _code_point(pattern, j + 1)
            else:
                high, j = pattern[j + 1], j + 2
            members |= {s for s in SPECIALS if prev <= s <= high}
            prev = None
            continue
        if c == "\\":
            kind = pattern[j + 1] if j + 1 < len(pattern) else ""
            if kind.lower() in _PERL:
                test = _PERL[kind.lower()]
                members |= {s for s in SPECIALS if test(s) != kind.isupper()}
                j += 2
                prev = None
                continue
            if kind in "pP":
                raise _Unsupported("a Unicode property class (\\p, \\P)")
            prev, j = _code_point(pattern, j)
        else:
            prev, j = c, j + 1
        if prev in SPECIALS:
            members.add(prev)
    chars = [s for s in SPECIALS if (s in members) != negated]
    return chars, j


def json_escaped_regex(pattern: str, flags: str = "") -> str:
    """The regex of the JSON escapes (json_escape, character by character) of pattern's strings."""
    if "x" in flags:
        raise _Unsupported("the x flag")
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # the (s, i) flags outside each open group
    dot_all, case_insensitive = "s" in flags, "i" in flags
    i, n = 0, len(pattern)

    def atom(safe: str, specials: list[str]) -> None:
        if not specials:
            out.append(safe)
        elif safe:
            out.append(f"(?:{safe}|{_escapes_rx(specials, case_insensitive)})")
        else:
            out.append(f"(?:{_escapes_rx(specials, case_insensitive)})")

    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                raise _Unsupported("a trailing backslash")
            kind = pattern[i + 1]
            if kind.lower() in _PERL:
                test = _PERL[kind.lower()]
                specials = [s for s in SPECIALS if test(s) != kind.isupper()]
                atom(f"[\\{kind}&&{_SAFE_CLASS}]" if specials else "\\" + kind, specials)
                i += 2
                continue
            if kind in "pP":
                raise _Unsupported("a Unicode property class (\\p, \\P)")
            if kind in "bBAz<>":
                raise _Unsupported(f"the assertion \\{kind}")
            char, after = _code_point(pattern, i)
            if char in SPECIALS:
                atom("", [char])
            else:
                atom(pattern[i:after], [])
            i = after
        elif c == "[":
            specials, after = _class_specials(pattern, i)
            text = pattern[i:after]
            atom(f"[{text}&&{_SAFE_CLASS}]" if specials else text, specials)
            i = after
        elif c == ".":
            atom(_SAFE_CLASS, [s for s in SPECIALS if dot_all or s != "\n"])
            i += 1
        elif c == "(":
            stack.append((dot_all, case_insensitive))
            m = re.match(r"\(\?([a-zA-Z-]*)([:)])", pattern[i:])
            if m is not None:
                on, _, off = m.group(1).partition("-")
                if "x" in on:
                    raise _Unsupported("the x flag")
                dot_all = (dot_all or "s" in on) and "s" not in off
                case_insensitive = (case_insensitive or "i" in on) and "i" not in off
                if m.group(2) == ")":  # (?flags): for the rest of the enclosing group
                    stack.pop()
                out.append(m.group(0))
                i += m.end()
                continue
            m = re.match(r"\(\?P?<[A-Za-z_][A-Za-z0-9_]*>", pattern[i:])
            if m is not None:
                out.append(m.group(0))
                i += m.end()
                continue
            if pattern.startswith("(?", i):
                raise _Unsupported(f"the group syntax {pattern[i:i + 4]!r}")
            out.append("(")
            i += 1
        elif c == ")":
            if stack:
                dot_all, case_insensitive = stack.pop()
            out.append(")")
            i += 1
        elif c == "{" and _QUANTIFIER.match(pattern, i):
            m = _QUANTIFIER.match(pattern, i)
            out.append(m.group(0))
            i = m.end()
        elif c in SPECIALS:  # a literal quote or control character
            atom("", [c])
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


# ---- Lark ------------------------------------------------------------------------------------

# Lark's common.lark terminals (%import common.NAME), as regexes.
COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[a-zA-Z]", "WORD": r"[a-zA-Z]+",
    "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*", "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n",
    "NEWLINE": r"(\r?\n)+", "ESCAPED_STRING": r'"([^"\\\n]|\\[^\n])*"',
}

_LARK_TOKEN = re.compile(r"""
    (?P<ws>[ \t\f\r\n]+)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
  | (?P<directive>%[a-zA-Z_]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_?!]?[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\.-?[0-9]+)?)
  | (?P<number>[0-9]+)
  | (?P<other>[:|()\[\]{}*+?~,=&\-])
""", re.X)


def _lark_tokens(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos] == "<":
            raise _Unsupported("special tokens (<...>) cannot be part of a string")
        m = _LARK_TOKEN.match(text, pos)
        if m is None:
            raise _Unsupported(f"the syntax at {text[pos:pos + 20]!r}")
        tokens.append((m.lastgroup, m.group()))
        pos = m.end()
    return tokens


def _string_value(token: str) -> str:
    body = token[:-1] if token.endswith("i") else token
    try:
        return json.loads(body)
    except ValueError:
        try:
            return ast.literal_eval(body)
        except (ValueError, SyntaxError):
            raise _Unsupported(f"the string literal {token}") from None


def _escaped_string(token: str) -> str:
    value = _string_value(token)
    if not any(c in SPECIALS for c in value):
        return token
    if token.endswith("i"):
        raise _Unsupported("a case-insensitive string literal with quotes, backslashes or control characters")
    return lit("".join(json_escape(c) for c in value))


def _escaped_regex(token: str, exact: bool = False) -> str:
    body, _, flags = token[1:].rpartition("/")
    escaped = json_escaped_regex(body.replace("\\/", "/"), flags)
    if exact and escaped != body.replace("\\/", "/"):
        # Its escaped form may go on with a backslash where the next terminal's begins: llguidance's
        # lexer decides where a lexeme ends on one byte, and would cut it wrong.
        raise _Unsupported(f"in a recursive grammar, the terminal {token} can match a quote, backslash or "
                           "control character")
    return "/" + _slashes(escaped) + "/" + flags.replace("s", "")


def json_escaped_lark(definition: str, exact: bool = True) -> str:
    """The Lark grammar of the JSON escapes (json_escape, character by character) of the strings
    `definition` (llguidance's Lark) generates. Raises _Unsupported."""
    tokens = _lark_tokens(definition)
    out: list[str] = []
    literals: set[str] = set()  # the string literals, escaped
    k = 0
    while k < len(tokens):
        kind, text = tokens[k]
        if kind == "directive":
            if text in ("%ignore", "%llguidance"):
                out.append(text)
            elif text == "%import":
                k = _import_common(tokens, k + 1, out, exact)
                continue
            else:
                raise _Unsupported(f"{text}")
        elif kind == "arrow":  # an alias (-> name) only names the tree's node
            k += 1
            while k < len(tokens) and tokens[k][0] == "ws" and "\n" not in tokens[k][1]:
                k += 1
            if k < len(tokens) and tokens[k][0] == "name":
                k += 1
            continue
        elif kind == "string":
            nxt = [t for t in tokens[k + 1:k + 5] if t[0] != "ws"]
            if len(nxt) >= 2 and nxt[0][0] == "range" and nxt[1][0] == "string":  # "a".."z"
                low, high = _string_value(text), _string_value(nxt[1][1])
                if len(low) != 1 or len(high) != 1:
                    raise _Unsupported("a range of strings longer than one character")
                out.append(_escaped_regex(f"/[\\x{{{ord(low):x}}}-\\x{{{ord(high):x}}}]/", exact))
                while tokens[k] is not nxt[1]:
                    k += 1
            else:
                out.append(_escaped_string(text))
                literals.add("".join(json_escape(c) for c in _string_value(text)))
        elif kind == "regex":
            out.append(_escaped_regex(text, exact))
        elif kind == "comment":
            pass
        else:
            out.append(text)
        k += 1
    if exact:
        for short in literals:
            for long in literals:
                if long.startswith(short) and long[len(short):].startswith("\\"):
                    # Where both may come, the lexer cannot end the short one on its next byte.
                    raise _Unsupported(f"in a recursive grammar, the literals {lit(short)} and {lit(long)} "
                                       "differ only after an escaped character")
    return "".join(out)


def _import_common(tokens: list[tuple[str, str]], k: int, out: list[str], exact: bool) -> int:
    """%import common.NAME [-> ALIAS] or %import common (A, B): the definitions, escaped."""
    line: list[tuple[str, str]] = []
    while k < len(tokens) and not (tokens[k][0] == "ws" and "\n" in tokens[k][1]):
        if tokens[k][0] not in ("ws", "comment"):
            line.append(tokens[k])
        k += 1
    texts = [t for _, t in line]
    pairs: list[tuple[str, str]] = []
    if len(texts) >= 1 and texts[0].startswith("common.") and texts[0].count(".") == 1:
        name = texts[0].split(".", 1)[1]
        alias = texts[2] if len(texts) == 3 and texts[1] == "->" else name
        if len(texts) not in (1, 3):
            raise _Unsupported(f"the import {' '.join(texts)}")
        pairs.append((name, alias))
    elif texts[:2] == ["common", "("] and texts[-1] == ")":
        pairs += [(t, t) for t in texts[2:-1] if t != ","]
    else:
        raise _Unsupported(f"the import {' '.join(texts)} (only common terminals can be imported)")
    for name, alias in pairs:
        if name not in COMMON:
            raise _Unsupported(f"the import common.{name}")
        out.append(f"\n{alias}: {_escaped_regex('/' + COMMON[name] + '/', exact)}\n")
    return k


# ---- a grammar without recursion as one regex ------------------------------------------------

class _Recursive(ValueError):
    pass


MAX_REGEX_CHARS = 200_000  # a non-recursive grammar's rules inlined into one regex, at most


def _rx_literal(text: str) -> str:
    return "".join(f"\\x{{{ord(c):x}}}" if ord(c) < 0x20 or c == "\x7f" else "\\" + c if c in r"\.+*?()|[]{}^$#&-~"
                   else c for c in text)


def lark_to_regex(definition: str) -> str:
    """The regex of a Lark grammar (its `start`) whose rules do not recurse, every rule and
    terminal inlined: the whole input is then one lexeme, JSON-quoted by llguidance. Raises
    _Recursive for a grammar that recurses or uses what a regex cannot say (%ignore: the
    escaped-CFG path), _Unsupported for what neither path reads."""
    tokens = [t for t in _lark_tokens(definition) if t[0] != "comment"]
    # Statements: a definition ("name:" first on its line) or a directive, up to the next one.
    rules: dict[str, list[tuple[str, str]]] = {}
    imports: dict[str, str] = {}
    k, line_start = 0, True
    current: list[tuple[str, str]] | None = None
    while k < len(tokens):
        kind, text = tokens[k]
        if kind == "ws":
            line_start = line_start or "\n" in text
            k += 1
            continue
        nxt = next((t for t in tokens[k + 1:] if t[0] != "ws"), None)
        if line_start and kind == "name" and nxt == ("other", ":"):
            current = rules.setdefault(re.sub(r"\.-?[0-9]+$", "", text.lstrip("?!")), [])
            if current:
                raise _Unsupported(f"{text} is defined twice")
            k = tokens.index(nxt, k + 1) + 1
        elif line_start and kind == "directive":
            if text == "%import":
                line: list[tuple[str, str]] = []
                k += 1
                while k < len(tokens) and not (tokens[k][0] == "ws" and "\n" in tokens[k][1]):
                    if tokens[k][0] != "ws":
                        line.append(tokens[k])
                    k += 1
                texts = [t for _, t in line]
                if len(texts) == 1 and texts[0].startswith("common."):
                    imports[texts[0][7:]] = texts[0][7:]
                elif len(texts) == 3 and texts[0].startswith("common.") and texts[1] == "->":
                    imports[texts[2]] = texts[0][7:]
                elif texts[:2] == ["common", "("] and texts[-1] == ")":
                    imports.update((t, t) for t in texts[2:-1] if t != ",")
                else:
                    raise _Unsupported(f"the import {' '.join(texts)} (only common terminals can be imported)")
                current = None
                continue
            raise _Recursive(text)
        elif current is None:
            raise _Unsupported(f"the syntax at {text!r}")
        else:
            current.append((kind, text))
        line_start = False
        k += 1
    for alias, name in imports.items():
        if name not in COMMON:
            raise _Unsupported(f"the import common.{name}")
    if "start" not in rules:
        raise _Unsupported("no start rule")
    done: dict[str, str] = {}

    def inline(name: str, active: tuple[str, ...]) -> str:
        if name in active:
            raise _Recursive(name)
        if name in done:
            return done[name]
        if name in imports and name not in rules:
            rx = f"(?:{COMMON[imports[name]]})"
        elif name in rules:
            rx = _Expr(rules[name], lambda n: inline(n, active + (name,))).parse()
        else:
            raise _Unsupported(f"{name} is not defined")
        done[name] = rx
        return rx

    rx = inline("start", ())
    if len(rx) > MAX_REGEX_CHARS:
        raise _Unsupported(f"the grammar inlined into one regex is over {MAX_REGEX_CHARS} characters")
    return rx


class _Expr:
    """A rule's body (tokens) as a regex; names through `ref`."""

    def __init__(self, tokens: list[tuple[str, str]], ref):
        self.tokens = [t for t in tokens if t[0] != "ws"]
        self.pos = 0
        self.ref = ref

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def parse(self) -> str:
        rx = self.alternatives()
        if self.peek() is not None:
            raise _Unsupported(f"the syntax at {self.peek()[1]!r}")
        return rx

    def alternatives(self) -> str:
        options = [self.sequence()]
        while self.peek() == ("other", "|"):
            self.take()
            options.append(self.sequence())
        return f"(?:{'|'.join(options)})"

    def sequence(self) -> str:
        parts = []
        while True:
            token = self.peek()
            if token is None or token in (("other", "|"), ("other", ")"), ("other", "]")):
                return "".join(parts)
            if token[0] == "arrow":  # an alias: names the tree's node only
                self.take()
                if self.peek() is not None and self.peek()[0] == "name":
                    self.take()
                continue
            parts.append(self.repeated(self.atom()))

    def atom(self) -> str:
        kind, text = self.take()
        if (kind, text) == ("other", "("):
            rx = self.alternatives()
            self.expect(")")
            return rx
        if (kind, text) == ("other", "["):
            rx = self.alternatives()
            self.expect("]")
            return f"(?:{rx})?"
        if kind == "string":
            low = _string_value(text)
            if self.peek() is not None and self.peek()[0] == "range":
                self.take()
                kind2, high = self.take()
                high = _string_value(high) if kind2 == "string" else ""
                if len(low) != 1 or len(high) != 1:
                    raise _Unsupported("a range of strings longer than one character")
                return f"[{_rx_literal(low)}-{_rx_literal(high)}]"
            rx = _rx_literal(low)
            return f"(?i:{rx})" if text.endswith("i") else f"(?:{rx})"
        if kind == "regex":
            body, _, flags = text[1:].rpartition("/")
            body = body.replace("\\/", "/")
            if re.search(r"(?<!\\)(?:\\\\)*[\^$]", re.sub(r"\[(?:[^\]\\]|\\.)*\]", "", body)):
                raise _Unsupported(f"the anchor in {text}")
            return f"(?{flags}:{body})" if flags else f"(?:{body})"
        if kind == "name":
            return self.ref(text)
        raise _Unsupported(f"the syntax at {text!r}")

    def expect(self, text: str) -> None:
        if self.peek() != ("other", text):
            raise _Unsupported(f"a missing {text!r}")
        self.take()

    def repeated(self, rx: str) -> str:
        token = self.peek()
        if token is None:
            return rx
        if token[0] == "other" and token[1] in "?*+" and token[1]:
            self.take()
            return rx + token[1]
        if token == ("other", "~"):
            self.take()
            low = self.take()[1]
            high = low
            if self.peek() is not None and self.peek()[0] == "range":
                self.take()
                high = self.take()[1]
            if not (low.isdigit() and high.isdigit()):
                raise _Unsupported("a repetition count that is not a number")
            return f"{rx}{{{low},{high}}}"
        if token == ("other", "{"):
            self.take()
            text = ""
            while self.peek() is not None and self.peek() != ("other", "}"):
                text += self.take()[1]
            self.expect("}")
            if not re.fullmatch(r"\d+(,\d*)?|,\d+", text):
                raise _Unsupported(f"the repetition {{{text}}}")
            return f"{rx}{{{'0' + text if text.startswith(',') else text}}}"
        return rx


# ---- the call objects of the JSON formats ----------------------------------------------------

def arguments_object(g: LarkGrammar, tool: GrammarTool) -> str:
    """A Lark expression of one tool's arguments object, as json.dumps writes it."""
    if tool.input_grammar is None:
        return json_rule(tool.schema)
    return f'"{{\\"input\\": " {string_value(g, tool.name, tool.input_grammar, "json")} "}}"'


def call_object(g: LarkGrammar, tools: list[GrammarTool], *, name_key: str = "name",
                args_key: str = "arguments") -> str:
    """A Lark expression of one call object {name_key: <name>, args_key: {...}} of any of tools:
    one %json for them all; with custom tools' input grammars among them, one alternative per tool,
    the object's head written literally (llguidance cannot choose between a %json and another
    alternative that begin at the same place; after distinct literal heads it can)."""
    if all(tool.input_grammar is None for tool in tools):
        return json_rule(call_object_schema(tools, name_key=name_key, args_key=args_key))
    options = []
    for tool in tools:
        head = "{" + json.dumps(name_key) + ": " + json.dumps(tool.name, ensure_ascii=False) + ", " \
            + json.dumps(args_key) + ": "
        options.append(f"{lit(head)} {arguments_object(g, tool)} \"}}\"")
    return g.add(" | ".join(options))
