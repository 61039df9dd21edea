"""pipeline.batchjob.constraints: a structured-output regex or grammar vLLM refuses whichever
of its backends reads it is refused in its words; nothing vLLM takes is refused. Where vLLM
is installed, the same cases are put to vLLM's own checks."""

from __future__ import annotations

import pytest

from pipeline.batchjob.constraints import SHOWN_CHARS, grammar_problem, regex_problem
from pipeline.batchjob.params import Refused, structured_output
from pipeline.wire.generation import MAX_STRUCTURED_OUTPUT_BYTES

# (regex, the reason refused) for regexes every backend of vLLM refuses.
REFUSED_REGEXES = [
    ("(a+)+$(", "unclosed group"), ("(?:", "unclosed group"), ("a)", "unopened group"),
    ("[a-", "unclosed character class"), ("*a", "repetition operator missing expression"),
    ("a|*", "repetition operator missing expression"), ("^*", "repetition operator missing expression"),
    ("a{3,1}", "the start must be <= the end"), ("a{2,1}?", "the start must be <= the end"),
    ("[z-a]", "the start must be <= the end"), ("(a)\\2", "backreferences"), ("\\8", "backreferences"),
    ("(a)\\1", "backreferences"), ("(?P<n>a)(?P=n)", "backreferences"), ("a(?=b)", "look-around"),
    ("a(?!b)", "look-around"), ("(?<=a)b", "look-around"), ("(?<!a)b", "look-around"), ("a\\b", "word boundaries"),
    ("\\B", "word boundaries"), ("(?>a)b", "atomic groups"), ("(a)?(?(1)b|c)", "conditionals"),
]
# Regexes vLLM takes (one backend or the other), some that Python's own parser refuses.
TAKEN_REGEXES = ["[0-9]+", "a**", "a{2}{3}", "a*+", "\\p{L}+", "a(?i)b", "[[:alpha:]]+", "\\z", "[]a]", "[^]",
                 "[\\d-z]", "(?<n>a)", "\\x{41}", "", "a|", "\\w+@\\w+\\.com", "[^\\]]", "\\Aabc\\z"]
# (grammar, words of the reason) for grammars vLLM refuses; GBNF then Lark.
REFUSED_GRAMMARS = [
    ("root ::= (", "expected ')' at line 1"), ('root ::= ( "a" ', "expected ')' at line 1"),
    ('root ::= "a" )', "unexpected ')' at line 1"), ("root ::= [a-", "a character class never closed"),
    ('root ::= "a', "a string never closed"), ('root ::= "a"\nrest ::= (\n', "expected ')' at line 2"),
    ("root ::= x", "Rule 'x' not found"), ('foo ::= "a"', "No 'root' rule found"),
    ("start: (", "expected ')' at line 1"), ('start: ["a"', "expected ']' at line 1"),
    ('start: "a" ]', "unexpected ']' at line 1"), ("start: /(a+", "a regex never closed"),
]
TAKEN_GRAMMARS = ['root ::= "a"', 'root ::= [(]', 'root ::= "("', 'root ::= "a" # (comment',
                  'root ::= ("a"\n  | "b")', 'root ::= x\nx ::= "a"\n', 'root-a ::= "a"\nroot ::= root-a',
                  'root ::= [^\\]]', 'root ::= [a-z]{2,3}', 'root ::= "a" (= "b")', 'start: "a"', 'start: "("',
                  'start: /[(]/', 'start: /\\(/', 'start: ["a"]', '%import common.WS\nstart: "a"',
                  'start: "a" // c (', 'start: "a" # c (', 'start: A\nA: "a"', 'root ::= "\\""']


@pytest.mark.parametrize("regex, why", REFUSED_REGEXES)
def test_a_regex_every_backend_refuses_is_refused_in_vllms_words(regex: str, why: str) -> None:
    said = regex_problem(regex)
    assert said is not None and said.startswith(f'Grammar error: invalid regex "{regex}": regex parse error')
    assert why in said


@pytest.mark.parametrize("regex", TAKEN_REGEXES)
def test_a_regex_vllm_takes_is_not_refused(regex: str) -> None:
    assert regex_problem(regex) is None


@pytest.mark.parametrize("grammar, why", REFUSED_GRAMMARS)
def test_a_grammar_vllm_refuses_is_refused_naming_where(grammar: str, why: str) -> None:
    said = grammar_problem(grammar)
    assert said is not None and why in said
    assert said.startswith("Grammar error: " if "::=" not in grammar else "Invalid grammar specification: ")


@pytest.mark.parametrize("grammar", TAKEN_GRAMMARS)
def test_a_grammar_vllm_takes_is_not_refused(grammar: str) -> None:
    assert grammar_problem(grammar) is None


def test_a_regex_nested_past_pythons_recursion_is_left_to_the_engine() -> None:
    assert regex_problem("(" * 5000 + "a" + ")" * 5000) is None


def test_a_regex_is_shown_cut_at_its_limit() -> None:
    at, past = "(" + "a" * (SHOWN_CHARS - 1), "(" + "a" * SHOWN_CHARS
    assert f'"{at}"' in regex_problem(at)
    assert f'"{past[:SHOWN_CHARS - 3]}..."' in regex_problem(past)


@pytest.mark.parametrize("kind, valid, broken", [("regex", "a", "("), ("grammar", 'root ::= "a"', "root ::= (")])
def test_a_constraint_at_the_size_limit_is_checked_and_one_past_it_refused_for_its_size(kind, valid, broken) -> None:
    pad = MAX_STRUCTURED_OUTPUT_BYTES - len(valid)
    at = valid + ("a" * pad if kind == "regex" else " " * pad)
    assert structured_output({"structured_outputs": {kind: at}}) == (kind, at)
    broken_at = broken + " " * (MAX_STRUCTURED_OUTPUT_BYTES - len(broken)) if kind == "grammar" else \
        broken + "a" * (MAX_STRUCTURED_OUTPUT_BYTES - len(broken))
    with pytest.raises(Refused, match="never closed|unclosed group|expected '\\)'"):
        structured_output({"structured_outputs": {kind: broken_at}})
    with pytest.raises(Refused, match=f"more than the {MAX_STRUCTURED_OUTPUT_BYTES:,}"):
        structured_output({"structured_outputs": {kind: at + "a"}})


def _vllm_refuses(kind: str, spec: str) -> bool:
    """vLLM's own check of a request's constraint, as its default backend ("auto") makes it:
    xgrammar's, then guidance's; True when both refuse."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    for validate in (validate_xgrammar_grammar, validate_guidance_grammar):
        try:
            validate(SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: spec})))
            return False
        except (ValueError, VLLMValidationError):
            continue
    return True


@pytest.mark.vllm
def test_vllm_refuses_what_is_refused_here_and_takes_the_rest() -> None:
    wrong = [(kind, spec) for kind, refused in (("regex", REFUSED_REGEXES), ("grammar", REFUSED_GRAMMARS))
             for spec, _why in refused if not _vllm_refuses(kind, spec)]
    wrong += [(kind, spec) for kind, taken in (("regex", TAKEN_REGEXES), ("grammar", TAKEN_GRAMMARS))
              for spec in taken if _vllm_refuses(kind, spec)]
    assert not wrong, f"vLLM disagrees on: {wrong}"
