"""A request body's sampling and output parameters, checked as vLLM's OpenAI server checks them.

    params = sampling_params(body, KIND_CHAT)      # GenerationParams, or Refused(message, param)

Every parameter vLLM's server takes for /v1/chat/completions and /v1/completions that changes
what is generated is carried (`CARRIED`), by vLLM's name and range: the request's values go
into the item's envelope (`pipeline/wire/generation.py`) as given; what the request does not
give is filled in at the producer (`sampling.py`: vLLM's defaults, the model's generation
config, the rest of the context). A value vLLM refuses is refused here with vLLM's reason
(or OpenAI's where vLLM says nothing), naming the parameter; a parameter the job would drop
is refused too, never dropped: guided_json and its siblings (which the vLLM it follows
ignores with a warning: `structured_outputs` replaced them), beam search, prompt logprobs.

Structured outputs. `response_format` ({"type": "json_object"}, or "json_schema" with its
schema) and vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object: one
of them}) become one constraint (kind, spec) in the envelope, as vLLM merges them
(response_format over structured_outputs; two constraints at once refused). A JSON schema
is checked with jsonschema's meta-schema check (what draft its $schema names, else the
latest), its nesting against vLLM's limit, its size against MAX_STRUCTURED_OUTPUT_BYTES; a
regex or a grammar, once its size is checked, against what vLLM refuses whichever of its
backends reads it (`constraints.py`: without vLLM, what all of them refuse).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pipeline.batchjob.constraints import grammar_problem, regex_problem
from pipeline.batchjob.scan import invalid_type, invalid_value, show
from pipeline.wire.errors import GenerationParamsError
from pipeline.wire.generation import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_OUTPUT_BYTES,
    GenerationParams,
)

KIND_CHAT = "chat"
KIND_COMPLETION = "completion"
# vLLM's default max_tokens of a completion (absent or null), as OpenAI's legacy endpoint
# has it; a chat's default is the rest of the context (`sampling.py`).
COMPLETION_DEFAULT_MAX_TOKENS = 16
# OpenAI's and vLLM's range of temperature.
MAX_TEMPERATURE = 2.0
# vLLM's limit of a JSON schema's nesting (MAX_STRUCTURED_OUTPUT_JSON_NESTING): objects and
# arrays deeper than this are refused before any backend walks the schema.
MAX_SCHEMA_NESTING = 64
# Parameters carried to the engine, by kind (besides those `tools.py` reads for chat).
CARRIED_COMMON = ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
                  "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "logprobs", "response_format",
                  "structured_outputs", "echo")
CARRIED = {KIND_CHAT: CARRIED_COMMON + ("max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                        "parallel_tool_calls", "chat_template_kwargs"),
           KIND_COMPLETION: CARRIED_COMMON}
# vLLM's guided-decoding fields, removed in favour of `structured_outputs`: vLLM ignores them
# (the output is not constrained), so they are refused with the replacement named.
REMOVED_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_decoding_backend": None, "guided_whitespace_pattern": None}
# The response_format types carried (structural_tag, vLLM's fourth, is not).
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# Keys of `structured_outputs`: one constraint, vLLM's options of it that are carried, and
# those that are not (refused at any value but their default).
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_additional_properties")
STRUCTURED_OPTIONS = {"whitespace_pattern": None}
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTEGERS = ("seed", "n", "top_k", "min_tokens")


class Refused(Exception):
    """A request this job cannot serve: the message and the parameter it names (OpenAI's
    error `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def sampling_params(given: dict[str, Any], kind: str) -> GenerationParams:
    """The request's generation parameters (`given`: its body without nulls), as given;
    Refused for a value vLLM refuses."""
    values: dict[str, Any] = {"max_tokens": _max_tokens(given, kind), "stop": _stop(given.get("stop"))}
    for name in _BOOLS:
        if name in given:
            values[name] = _bool(given, name)
    for name in _NUMBERS:
        if name in given:
            values[name] = _number(given, name)
    for name in _INTEGERS:
        if name in given:
            values[name] = _integer(given, name)
    if values.get("temperature", 0) > MAX_TEMPERATURE:
        raise Refused(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {values['temperature']}.", "temperature")
    values["logprobs"] = _logprobs(given, kind)
    if "stop_token_ids" in given:
        values["stop_token_ids"] = _token_ids(given["stop_token_ids"])
    if "logit_bias" in given:
        values["logit_bias"] = _logit_bias(given["logit_bias"])
    values["structured"] = structured_output(given)
    options = given.get("structured_outputs")
    for name in STRUCTURED_FLAGS if isinstance(options, dict) else ():
        if options.get(name) is not None:
            values[name] = _bool(options, name)
    if kind == KIND_COMPLETION and given.get("echo") is True and values["logprobs"] is not None:
        raise Refused("echo with logprobs returns the prompt's log probabilities, which this job does not compute: "
                      "ask for one of them", "echo")
    if "echo" in given:
        _bool(given, "echo")
    return _checked(values)


def _checked(values: dict[str, Any]) -> GenerationParams:
    """GenerationParams of `values`, the first value it refuses named."""
    try:
        return GenerationParams(**values)
    except GenerationParamsError:
        pass
    for name, value in values.items():  # which one: checked alone, so the error names it
        try:
            GenerationParams(**{name: value})
        except GenerationParamsError as exc:
            raise Refused(f"invalid {name}: {exc}", "response_format" if name == "structured" else name) from None
    min_tokens, max_tokens = values.get("min_tokens"), values.get("max_tokens")
    raise Refused(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                  "min_tokens")


def _max_tokens(given: dict[str, Any], kind: str) -> int | None:
    """max_completion_tokens over max_tokens for chat (vLLM's order); a completion's default."""
    name = "max_completion_tokens" if kind == KIND_CHAT and "max_completion_tokens" in given else "max_tokens"
    if name not in given:
        return COMPLETION_DEFAULT_MAX_TOKENS if kind == KIND_COMPLETION else None
    value = whole_number(given[name])
    if value is None:
        raise Refused(not_an_integer(name, given[name]), name)
    if value < 1:
        raise Refused(f"{name} must be at least 1, got {value}.", name)
    return value


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise Refused(f"stop must be a string or an array of strings, got {show(stop)}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise Refused(f"stop: {len(stop)} stop strings, at most {MAX_STOP_STRINGS} (vLLM's VLLM_MAX_STOP_STRINGS "
                      f"and OpenAI's limit)", "stop")
    if not all(stop):
        raise Refused("stop cannot contain an empty string.", "stop")
    return tuple(stop)


def _bool(given: dict[str, Any], name: str) -> bool:
    value = given[name]
    if not isinstance(value, bool):
        raise Refused(f"{name} must be true or false, got {show(value)}", name)
    return value


def _number(given: dict[str, Any], name: str) -> float | int:
    value = given[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise Refused(f"{name} must be a finite number, got {show(value)}", name)
    return value


def _integer(given: dict[str, Any], name: str) -> int:
    value = whole_number(given[name])
    if value is None:
        raise Refused(f"{name} must be an integer, got {show(given[name])}", name)
    return value


def whole_number(value: object) -> int | None:
    """An integer parameter as vLLM's pydantic models read one (lax mode): an integer, or a
    finite number with no fractional part (8.0 is 8); None for anything else (8.5, null).
    NOTE: pydantic's lax mode also takes "8" and true as integers; a string or a boolean is
    refused here, as every other parameter of the wrong JSON type is."""
    if _is_int(value):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def not_an_integer(name: str, value: object) -> str:
    """OpenAI's message for an integer parameter given anything else (`whole_number` None),
    a number with a fractional part said to be one."""
    if isinstance(value, float) and math.isfinite(value):
        return (f"Invalid type for '{name}': expected an integer, but got a number with a fractional part "
                f"({json_snippet(value)}) instead.")
    return invalid_type(name, "an integer", value)


def _logprobs(given: dict[str, Any], kind: str) -> int | None:
    """How many top log probabilities each token asks for (None: no logprobs). Chat: logprobs
    true with top_logprobs (0 by default); completions: logprobs, the count."""
    if kind == KIND_COMPLETION:
        if "logprobs" not in given:
            return None
        name = "logprobs"
        count = whole_number(given[name])
        if count is None:
            raise Refused(f"`logprobs` must be an integer, got {show(given[name])}", name)
    else:
        wanted = _bool(given, "logprobs") if "logprobs" in given else False
        name = "top_logprobs"
        count = whole_number(given.get(name, 0))
        if count is None:
            raise Refused(f"`top_logprobs` must be an integer, got {show(given[name])}", name)
        if count != 0 and not wanted:
            raise Refused("when using `top_logprobs`, `logprobs` must be set to true.", name)
        if not wanted:
            return None
    if count < 0 and count != -1:
        raise Refused(f"`{name}` must be a positive value or -1.", name)
    if count == -1 or count > MAX_LOGPROBS:
        raise Refused(f"Requested sample logprobs of {'the whole vocabulary' if count == -1 else count}, which is "
                      f"greater than max allowed: {MAX_LOGPROBS}", name)
    return count


def _token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise Refused(f"stop_token_ids must contain only integers, got {show(ids)}", "stop_token_ids")
    ids = list(dict.fromkeys(ids))  # vLLM drops repeats
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise Refused(f"stop_token_ids: {len(ids)} token ids, at most {MAX_STOP_TOKEN_IDS}", "stop_token_ids")
    bad = [t for t in ids if t < 0]
    if bad:
        raise Refused(f"token_id(s) {bad[:10]} in stop_token_ids contain out-of-vocab token ids", "stop_token_ids")
    return tuple(ids)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as (id, bias) pairs; ids are checked against the vocabulary where
    the model is known (the producer)."""
    if not isinstance(bias, dict):
        raise Refused(f"logit_bias must be an object of token ids to biases, got {show(bias)}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise Refused(f"logit_bias: {len(bias):,} tokens, at most {MAX_LOGIT_BIAS_ENTRIES:,} (the envelope's "
                      f"limit)", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise Refused(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {key!r}",
                          "logit_bias") from None
        if token < 0:
            raise Refused(f"token_id(s) [{token}] in logit_bias contain out-of-vocab token ids", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise Refused(f"logit_bias[{key!r}] is {show(value)}: a bias is a number from -{MAX_LOGIT_BIAS:g} to "
                          f"{MAX_LOGIT_BIAS:g} (OpenAI's range)", "logit_bias")
        out[token] = float(value)
    return tuple(out.items())


def structured_output(given: dict[str, Any]) -> tuple[str, str] | None:
    """The request's structured-output constraint, (kind, spec), from response_format and
    structured_outputs as vLLM merges them; None for none."""
    from_format = _response_format(given.get("response_format"))
    from_outputs = _structured_outputs(given.get("structured_outputs"))
    if from_format is not None and from_outputs is not None:
        raise Refused("You can only use one kind of structured outputs constraint but multiple are specified: "
                      "response_format and structured_outputs", "structured_outputs")
    found = from_format or from_outputs
    if found is not None and len(found[1].encode("utf-8", "surrogatepass")) > MAX_STRUCTURED_OUTPUT_BYTES:
        raise Refused(f"the structured-output constraint is {len(found[1].encode('utf-8', 'surrogatepass')):,} "
                      f"bytes of JSON, more than the {MAX_STRUCTURED_OUTPUT_BYTES:,} this job carries per request",
                      "response_format" if from_format is not None else "structured_outputs")
    if found is not None and found[0] in ("regex", "grammar"):  # its syntax, once its size is known to be bounded
        problem = (regex_problem if found[0] == "regex" else grammar_problem)(found[1])
        if problem is not None:
            raise Refused(problem, f"structured_outputs.{found[0]}")
    return found


def _response_format(form: object) -> tuple[str, str] | None:
    if form is None:
        return None
    if not isinstance(form, dict):
        raise Refused(invalid_type("response_format", "an object", form), "response_format")
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = form.get("json_schema")
        if spec is None:
            raise Refused("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                          "response_format")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise Refused(f"response_format.json_schema must be an object with a name and a schema, got "
                          f"{show(spec)}", "response_format")
        if spec.get("schema") is None:
            raise Refused("You must use one kind of structured outputs constraint but none are specified: "
                          "response_format.json_schema has no schema", "response_format")
        return "json", check_schema(spec["schema"], "response_format")
    if not isinstance(kind, str):
        raise Refused(invalid_type("response_format.type", "a string", kind), "response_format")
    raise Refused(f"{invalid_value(kind, RESPONSE_FORMAT_TYPES)} This job does not carry structural_tag.",
                  "response_format")


def _structured_outputs(raw: object) -> tuple[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise Refused(f"structured_outputs must be an object, got {show(raw)}", "structured_outputs")
    unknown = sorted(set(raw) - set(STRUCTURED_KEYS) - set(STRUCTURED_FLAGS) - set(STRUCTURED_OPTIONS)
                     - {"structural_tag"})
    changed = sorted(k for k, default in STRUCTURED_OPTIONS.items() if raw.get(k, default) not in (default, None))
    if unknown or changed or raw.get("structural_tag") is not None:
        named = (unknown + changed + (["structural_tag"] if raw.get("structural_tag") is not None else [])
                 )[0]
        raise Refused(f"structured_outputs.{named} is not carried by this job (it takes one of "
                      f"{', '.join(STRUCTURED_KEYS)})", f"structured_outputs.{named}")
    given = [k for k in STRUCTURED_KEYS if raw.get(k) is not None]
    if len(given) != 1:
        raise Refused(f"You can only use one kind of structured outputs constraint but "
                      f"{'multiple are' if given else 'none are'} specified: {', '.join(given) or 'none'}",
                      "structured_outputs")
    kind, value = given[0], raw[given[0]]
    where = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise Refused(f"{where} is not JSON text", where) from None
        return "json", check_schema(value, where)
    if kind == "json_object":
        if value is not True:
            raise Refused("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                          "structured outputs", where)
        return "json_object", ""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise Refused(f"Choice '{json_snippet(value)}' must be a non-empty list of strings", where)
        return "choice", json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or (kind == "grammar" and not value.strip()):
        raise Refused(f"{where} must be a non-empty string, got {show(value)}", where)
    if kind == "regex" and "\x00" in value:
        raise Refused("structured_outputs.regex must not contain a NUL character ('\\x00')", where)
    return kind, value


def check_schema(schema: object, param: str) -> str:
    """A JSON schema checked (its meta-schema, vLLM's nesting limit), as compact JSON text."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise Refused(f"{param}: a JSON schema is an object, got {show(schema)}", param)
    if _nesting_exceeds(schema, MAX_SCHEMA_NESTING):
        raise Refused(f"The JSON schema is nested too deeply: objects and arrays may nest at most "
                      f"{MAX_SCHEMA_NESTING} levels", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(the root)"
        raise Refused(f"{param}: not a valid JSON schema: at {where}: {_cut(exc.message)}", param) from None
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _nesting_exceeds(spec: object, limit: int) -> bool:
    level = [spec]
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: float | int) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        return False


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


def json_snippet(value: object) -> str:
    """A value as JSON for a message, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."
