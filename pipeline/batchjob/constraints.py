"""A structured-output regex or grammar, checked where vLLM would refuse it, without vLLM.

vLLM (its default structured-output backend, "auto") takes a regex or a grammar when
xgrammar takes it, else when guidance (llguidance) does, and refuses the request (400)
when both refuse it. Neither library is this job's: xgrammar needs torch, and the two
differ in dialect, so no one parser here could say what vLLM takes. What is refused here
is what both refuse, whatever their dialects, so that nothing vLLM takes is refused:

- a regex: what Python's regular-expression parser finds broken in every dialect (a group
  never closed or never opened, a character class never closed, a repetition of nothing,
  a repetition count or a class range whose start is past its end, a reference to a group
  that does not exist), and what both backends refuse although Python takes it
  (look-around, a backreference, a word boundary, an atomic group or a conditional). A regex
  Python refuses for its own dialect (`\\p{L}`, `(?<name>...)`, `a**`) goes to the engine;
- a grammar, GBNF when a rule line holds `::=`, else Lark (as vLLM tells them apart): a
  string, character class or regex never closed, a parenthesis or bracket never closed
  or never opened; for GBNF also no `root` rule, or a rule used and never defined.

Each is refused in vLLM's words, naming the constraint. The checks are linear in the
constraint, which its envelope holds to MAX_STRUCTURED_OUTPUT_BYTES; Python's parser
recurses per nested group, and a regex nested past its recursion is left to the engine.
tests/batchjob/test_constraints.py checks, where vLLM is installed, that vLLM refuses
every case refused here and takes the others it lists.
"""

from __future__ import annotations

import re
import warnings
from re import _constants as sre  # noqa: PLC2701 - the parser's opcodes: no public name
from re import _parser as sre_parse  # noqa: PLC2701 - a pattern parsed, not compiled nor cached

# Python's parse errors that are errors in every dialect, in the words of vLLM's reason.
_BROKEN_EVERYWHERE = {
    "missing ), unterminated subpattern": "unclosed group",
    "unbalanced parenthesis": "unopened group",
    "nothing to repeat": "repetition operator missing expression",
    "min repeat greater than max repeat": "invalid repetition count range, the start must be <= the end",
    "invalid group reference": "backreferences are not supported",
}
_UNCLOSED_CLASS = "unterminated character set"
_BAD_RANGE = re.compile(r"bad character range (.)-(.)$")
# What both of vLLM's backends refuse, found in the parsed pattern.
_REFUSED_OPCODES = {
    sre.ASSERT: "look-around, including look-ahead and look-behind, is not supported",
    sre.ASSERT_NOT: "look-around, including look-ahead and look-behind, is not supported",
    sre.GROUPREF: "backreferences are not supported",
    sre.GROUPREF_EXISTS: "conditionals are not supported",
    sre.ATOMIC_GROUP: "atomic groups are not supported",
}
_WORD_BOUNDARIES = frozenset({sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY, sre.AT_UNI_BOUNDARY, sre.AT_UNI_NON_BOUNDARY,
                              sre.AT_LOC_BOUNDARY, sre.AT_LOC_NON_BOUNDARY})
# A constraint is shown in a message up to this many characters.
SHOWN_CHARS = 60


def regex_problem(pattern: str) -> str | None:
    """vLLM's reason to refuse `pattern` as a structured-output regex, where it is one of
    the module's doc; None for a pattern left to the engine."""
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: the dialect's, not ours
            warnings.simplefilter("ignore")
            parsed = sre_parse.parse(pattern)
    except re.error as exc:
        reason = _parse_error(pattern, exc)
        at = f" at character {exc.pos + 1}" if exc.pos is not None else ""
        return None if reason is None else _regex_message(pattern, f"regex parse error{at}: {reason}")
    except RecursionError:
        return None
    reason = _refused_construct(parsed)
    return None if reason is None else _regex_message(pattern, f"regex parse error: {reason}")


def _parse_error(pattern: str, exc: re.error) -> str | None:
    for start, reason in _BROKEN_EVERYWHERE.items():
        if exc.msg.startswith(start):
            return reason
    if exc.msg == _UNCLOSED_CLASS and "]" not in pattern[(exc.pos or 0) + 1:]:
        return "unclosed character class"  # no "]" after it at all, however a dialect reads "[]" or "[^]"
    bad = _BAD_RANGE.match(exc.msg)  # two single characters, start past end (not a class like \d)
    if bad and bad.group(1) > bad.group(2):
        return "invalid character class range, the start must be <= the end"
    return None


def _refused_construct(parsed: sre_parse.SubPattern) -> str | None:
    """The first construct of `parsed` both backends refuse, in vLLM's words."""
    stack: list[object] = [parsed]
    while stack:
        node = stack.pop()
        if isinstance(node, sre_parse.SubPattern):
            for op, argument in node.data:
                if op in _REFUSED_OPCODES:
                    return _REFUSED_OPCODES[op]
                if op is sre.AT and argument in _WORD_BOUNDARIES:
                    return "word boundaries (\\b, \\B) are not supported"
                stack.append(argument)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return None


def _regex_message(pattern: str, reason: str) -> str:
    return f'Grammar error: invalid regex "{_shown(pattern)}": {reason}'


def grammar_problem(grammar: str) -> str | None:
    """vLLM's reason to refuse `grammar` as a structured-output grammar, where it is one of
    the module's doc; None for a grammar left to the engine."""
    lark = _is_lark(grammar)
    lexed = _Lexed.of(grammar, lark)
    if lexed.problem:
        return (f"Grammar error: {lexed.problem}" if lark else
                f"Invalid grammar specification: {lexed.problem}")
    if lark:
        return None
    if "root" not in lexed.defined:
        return "Invalid grammar specification: No 'root' rule found"
    missing = sorted(set(lexed.used) - lexed.defined)
    return f"Invalid grammar specification: Rule '{missing[0]}' not found" if missing else None


def _is_lark(grammar: str) -> bool:
    """vLLM's test (`grammar_is_likely_lark`): no line holds `::=` outside a comment."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


class _Lexed:
    """One pass over a grammar: the first problem of the module's doc, the rules it defines
    and the names it uses (GBNF)."""

    __slots__ = ("problem", "defined", "used")

    def __init__(self) -> None:
        self.problem = ""
        self.defined: set[str] = set()
        self.used: list[str] = []

    @classmethod
    def of(cls, text: str, lark: bool) -> _Lexed:
        found = cls()
        closers = {"(": ")", "[": "]"} if lark else {"(": ")"}
        open_at: list[tuple[str, int]] = []  # (what closes it, its line)
        quotes = ('"', "/") if lark else ('"', "[")
        k, line, size = 0, 1, len(text)
        while k < size and not found.problem:
            c = text[k]
            if c == "\n":
                line += 1
            elif c == "#" or (lark and text.startswith("//", k)):
                k = _line_end(text, k)
                continue
            elif c in quotes:
                start, k = k, _literal_end(text, k, "]" if c == "[" else c)
                if k < 0:
                    kind = {'"': "string", "/": "regex", "[": "character class"}[c]
                    found.problem = f"unexpected end of input at line {line}: a {kind} never closed"
                    break
                line += text.count("\n", start, k)
                continue
            elif c in closers:
                open_at.append((closers[c], line))
            elif c in closers.values():
                if not open_at or open_at.pop()[0] != c:
                    found.problem = f"unexpected '{c}' at line {line}: nothing open that it closes"
            elif c == "{" and not lark:
                k = max(text.find("}", k), k) + 1
                continue
            elif not lark and (c.isalnum() or c in "_-"):
                k = found._name(text, k)
                continue
            k += 1
        if not found.problem and open_at:
            found.problem = f"expected '{open_at[-1][0]}' at line {open_at[-1][1]}, found the end of the grammar"
        return found

    def _name(self, text: str, k: int) -> int:
        """A GBNF name at `k`: a rule's definition when `::=` follows it, else a use."""
        end = k
        while end < len(text) and (text[end].isalnum() or text[end] in "_-."):
            end += 1
        after = text[end:end + 64].lstrip(" \t")
        if after.startswith("::="):
            self.defined.add(text[k:end])
        elif not after.startswith("("):  # a call of a backend's own (xgrammar's TagDispatch(...))
            self.used.append(text[k:end])
        return end


def _line_end(text: str, k: int) -> int:
    end = text.find("\n", k)
    return len(text) if end < 0 else end


def _literal_end(text: str, k: int, close: str) -> int:
    """Past the literal opened at `k` and closed by `close` (a backslash escapes the next
    character); -1 if it is never closed."""
    k += 1
    while k < len(text):
        if text[k] == "\\":
            k += 2
            continue
        if text[k] == close:
            return k + 1
        k += 1
    return -1


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."
