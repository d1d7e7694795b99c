"""Structured outputs and token controls through the whole engine (bundled SmolLM2, fp32):
outputs match their JSON schema / regex / choice; logit_bias, bad_words and
allowed_token_ids equal HF transformers' own processors (sequence_bias, bad_words_ids,
prefix_allowed_tokens_fn) token for token."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

# loads HF transformers' SmolLM2 from the GGUF (about 12 s) as the reference
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 16

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "population": {"type": "number", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                                    "last": {"type": "string", "maxLength": 12}},
                   "required": ["first", "last"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
     "required": ["title", "author", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]},
                                      "sizes": {"type": "array", "minItems": 1, "maxItems": 3,
                                                "items": {"enum": ["S", "M", "L"]}}},
     "required": ["colour", "sizes"], "additionalProperties": False},
]
SCHEMA_PROMPTS = ["Describe a person as JSON:", "A city, in JSON:", "Some digits in a JSON list:",
                  "A book as JSON:", "Was it good? Answer in JSON:", "A T-shirt as JSON:"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
               check_invariants=True)


def constrained(max_tokens: int = 120, temperature: float = 0.0, n: int = 1, seed: int | None = None,
                **constraint) -> SamplingParams:
    return SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    params = [constrained(json=s) for s in SCHEMAS]
    params += [constrained(json=s, temperature=1.0, n=2, seed=i) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(SCHEMA_PROMPTS * 2, params, use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS * 2):
        for c in out.outputs:
            if c.finish_reason == "length":  # (only a complete output must match)
                continue
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)
    complete = sum(c.finish_reason == "stop" for out in outs for c in out.outputs)
    assert complete >= len(SCHEMAS) * 3 - 2, "nearly every output must complete in 120 tokens"


def test_json_object_regex_and_choice(llm):
    choices = ["yes", "no way", 'maybe "so"', "a\\b"]
    params = [constrained(json_object=True),
              constrained(regex=r"[0-9]{3}-[a-z]{2,4}( [A-Z]{1,5})?", temperature=1.0, n=3, seed=7),
              constrained(choice=choices, temperature=1.0, n=4, seed=3),
              constrained(choice=choices)]
    outs = llm.generate(["An object:", "A code:", "Well?", "Well?"], params, use_tqdm=False)
    assert isinstance(json.loads(outs[0].outputs[0].text), dict)
    for c in outs[1].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( [A-Z]{1,5})?", c.text), c.text
        assert c.finish_reason == "stop"
    for out in outs[2:]:
        for c in out.outputs:
            assert c.text in choices and c.finish_reason == "stop"


def test_constrained_rows_leave_the_others_alone(llm):
    """Unconstrained rows in a batch with constrained ones equal the same requests alone."""
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    alone = [o.token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    mixed = llm.generate(PROMPTS + ["JSON:", "Yes or no?"],
                         [plain, plain, constrained(json=SCHEMAS[0]),
                          constrained(choice=["yes", "no"])], use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS[0])


def test_logprobs_under_a_grammar_never_name_a_masked_token(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("Digits:", SamplingParams(
        temperature=0, max_tokens=8, logprobs=5,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{6}")), use_tqdm=False)[0]
    c = out.outputs[0]
    assert re.fullmatch("[0-9]{6}", c.text)
    for lp in c.logprobs:
        assert lp.logprob > float("-inf")
        for token_id, value in lp.top:
            if value > float("-inf"):
                assert tok.decode([token_id]).strip().isdigit() or token_id in tok.eos_token_ids


def test_bad_constraints_are_refused_naming_the_problem(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        llm.generate("x", constrained(regex="[a-"), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json does not compile"):
        llm.generate("x", constrained(json={"type": "frobnicate"}), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(use_beam_search=True, temperature=0, logit_bias={1: 1.0})
    with pytest.raises(ValueError, match="logit_bias: token id 99999 is outside"):
        llm.generate("x", SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias values must be in"):
        SamplingParams(logit_bias={"5": 101})
    # the engine still serves after the refusals
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def _hf_greedy(hf, ids: list[int], **processors) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, pad_token_id=2, **processors)
    return out[0, len(ids):].tolist()


def test_logit_bias_bad_words_allowed_tokens_equal_hf(llm, hf_smollm):
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    base = [o.token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    # push down each prompt's first greedy token, pull up a token it never chose
    bias = {base[0][0]: -100.0, base[1][0]: -3.5, tok.encode(" Lyon", add_special_tokens=False)[0]: 4.0}
    words = ["Paris", tok.decode(base[1][2:4])]  # one word, and two tokens prompt 1 produces
    allowed = sorted(set(base[0][:3]) | set(tok.encode(" a b c d e.", add_special_tokens=False)))
    kinds = [dict(logit_bias=bias), dict(bad_words=words), dict(allowed_token_ids=allowed)]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, **k)
              for k in kinds for _ in PROMPTS]
    outs = llm.generate(PROMPTS * len(kinds), params, use_tqdm=False)
    bad_ids = [tok.encode(w.lstrip(), add_special_tokens=False) for w in words]
    bad_ids += [tok.encode(" " + w.lstrip(), add_special_tokens=False) for w in words]
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        expected = [
            _hf_greedy(hf_smollm, ids, sequence_bias={(t,): b for t, b in bias.items()}),
            _hf_greedy(hf_smollm, ids, bad_words_ids=bad_ids),
            _hf_greedy(hf_smollm, ids, prefix_allowed_tokens_fn=lambda batch, seq: allowed),
        ]
        for k, want in enumerate(expected):
            assert outs[k * len(PROMPTS) + i].token_ids == want, kinds[k]
            assert want != base[i], f"{kinds[k]} must change prompt {i}'s output"
