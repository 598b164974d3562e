"""GrammarCompiler: checked grammars, a cache keyed by the constraint, and 400s naming the problem."""

from __future__ import annotations

import pytest

from tokenmill.core.structured_params import StructuredOutputsParams as S
from tokenmill.errors import InvalidRequestError
from tokenmill.model.demo import demo_model_path
from tokenmill.structured.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    text = (demo_model_path() / "tokenizer.json").read_text()
    return GrammarCompiler(text, vocab_size=2048, eos_token_ids=[1, 3], max_spec_bytes=64 * 1024)


def test_schema_cache_is_keyed_by_the_canonical_schema(compiler: GrammarCompiler) -> None:
    first = compiler.compile(S(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    built = compiler.num_compiled
    again = compiler.compile(S(json={"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert again is first and compiler.num_compiled == built
    matcher = first.new_matcher()
    assert not matcher.is_error() and not matcher.is_accepting()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (S(json='{"type": "object",'), "invalid JSON schema"),
        (S(json={"type": "nope"}), "Invalid type"),
        (S(json={"type": "object", "not": {}}), "Unimplemented keys"),
        (S(json={"type": "string", "format": "bogus"}), "Unknown format"),
        (S(json={"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
        (S(json={"$ref": "#/defs/missing"}), "does not exist"),
        (S(regex="[^\\s\\S]"), "no output can satisfy it"),
        (S(grammar="start: missing_rule"), "unknown name"),
        (S(json={"type": "object", "description": "x" * 70_000}), "at most 65536"),
    ],
)
def test_bad_constraints_are_invalid_requests_naming_the_problem(
    compiler: GrammarCompiler, params: S, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        compiler.compile(params)
    assert info.value.param == "structured_outputs"


def test_catastrophic_backtracking_regexes_compile_without_backtracking(
    compiler: GrammarCompiler,
) -> None:
    for regex in ["(a+)+$", "(a|a)*(a|a)*(a|a)*b", "(x+x+)+y"]:
        compiled = compiler.compile(S(regex=regex))
        matcher = compiled.new_matcher()
        tokens = compiler.tokenizer.tokenize_str("a" * 40 if "a" in regex else "x" * 40)
        assert matcher.consume_tokens(tokens)


@pytest.mark.parametrize(
    "bad",
    [
        {"regex": "a", "choice": ["b"]},
        {},
        {"choice": []},
        {"choice": [""]},
        {"regex": ""},
        {"json": 5},
    ],
)
def test_structured_outputs_params_take_exactly_one_valid_constraint(bad: dict) -> None:
    with pytest.raises(InvalidRequestError):
        S(**bad)


def test_choice_spec_is_canonical() -> None:
    assert S(choice=["a", "b"]).cache_key == S(choice=("a", "b")).cache_key
    assert S(json={"b": 1, "a": 2}).spec == S(json={"a": 2, "b": 1}).spec
    assert S(json={"type": "object", "description": "x" * 2**20}).num_spec_bytes > 2**20
