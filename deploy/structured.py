"""The grammar a request asks for, from OpenAI's `response_format` or vLLM's and SGLang's
fields, checked at the edge: a bad schema, regex or grammar is a 400 that names the field and
the problem, before anything is queued."""

from __future__ import annotations

import asyncio
import json

from raydix.workers.grammar import check_grammar
from raydix.workers.step import GrammarSpec

from .errors import bad_request
from .openai_schema import _GrammarFields

_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "regex", "ebnf")


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string literals are EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def requested_grammar(body: _GrammarFields) -> tuple[GrammarSpec, str] | None:
    """(the grammar, the field that asked for it), or None for free text."""
    asked = [name for name in _FIELDS if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise bad_request(f"only one way to constrain the output can be used at once; got "
                          f"{', '.join(asked)}", asked[1])
    if not asked:
        return None
    field = asked[0]
    if field == "response_format":
        fmt = body.response_format
        assert fmt is not None
        if fmt.type == "json_object":
            return GrammarSpec("json_object"), field
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema",
                              "response_format.json_schema")
        return GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_)), field
    value = getattr(body, field)
    if field == "guided_json":
        return GrammarSpec("json_schema", value if isinstance(value, str)
                           else json.dumps(value)), field
    if field in ("guided_regex", "regex"):
        return GrammarSpec("regex", value), field
    if field == "guided_choice":
        if not value:
            raise bad_request("guided_choice must list at least one string", field)
        return GrammarSpec("ebnf", choice_grammar(value)), field
    return GrammarSpec("ebnf", value), field


async def checked_grammar(spec: GrammarSpec, field: str) -> GrammarSpec:
    """`spec`, once xgrammar builds its grammar (off the event loop); else a 400."""
    try:
        await asyncio.to_thread(check_grammar, spec)
    except ValueError as e:
        raise bad_request(f"invalid {field}: {e}", field, code="invalid_grammar") from None
    return spec
