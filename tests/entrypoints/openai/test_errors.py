"""Every error status the server promises, with an OpenAI-style body; the server keeps serving."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

KEY = "test-key-123"


def post(url: str, body: dict | bytes | str, path: str = "/v1/completions", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, timeout=120,
                          headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)
    return httpx.post(url + path, json=body, timeout=120, **kw)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status
    for word in words:
        assert word in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("extra, status, words, param", [
    ({"tools": [{"type": "function"}]}, 400, ["unsupported field", "tools"], "tools"),
    ({"logit_bias": {"1": 500}}, 400, ["logit_bias", "[-100, 100]"], "logit_bias"),
    ({"response_format": {"type": "xml"}}, 400, ["response_format"], "response_format.type"),
    ({"temperature": -1}, 400, ["temperature"], "temperature"),
    ({"top_p": 0}, 400, ["top_p"], "top_p"),
    ({"max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ({"n": 2, "best_of": 3}, 400, ["best_of", "use_beam_search"], "best_of"),
    ({"n": 3, "best_of": 2, "use_beam_search": True}, 400, ["best_of", ">= n"], "best_of"),
    ({"use_beam_search": True, "temperature": 0.7}, 400, ["beam search"], "temperature"),
    ({"use_beam_search": True, "logprobs": 2}, 400, ["beam search"], "logprobs"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, 400, ["early_stopping"],
     "early_stopping"),
    ({"stop": [""]}, 400, ["stop"], None),
    ({"model": "gpt-4"}, 404, ["gpt-4", "does not exist"], "model"),
])
def test_bad_completion_fields_name_the_problem(server, model, extra, status, words, param):
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, **extra}
    assert_error(post(server.url, body), status, *words, param=param)


def test_openai_client_sees_the_errors(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="modalities"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       modalities=["audio"])


def test_prompt_too_long_says_the_limit(server, model):
    r = post(server.url, {"model": model, "prompt": "hello " * 600, "max_tokens": 4})
    assert_error(r, 400, "max_model_len", "512", param="prompt")


def test_malformed_requests(server, model):
    assert_error(post(server.url, "{not json"), 400, "JSON")
    assert_error(post(server.url, {"model": model}), 400, "prompt", param="prompt")
    chat = {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(post(server.url, chat, "/v1/chat/completions"), 400, param="messages.0.role")
    assert_error(post(server.url, {"model": model, "messages": []}, "/v1/chat/completions"), 400,
                 param="messages")
    r = httpx.get(server.url + "/result/job-does-not-exist", timeout=30)
    assert_error(r, 404, "job-does-not-exist")


def test_server_still_answers_after_errors(server, model):
    r = post(server.url, {"model": model, "prompt": "The capital of France is", "max_tokens": 3,
                          "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")


# ---- limits: a second server with an API key, a small body limit and a tiny queue ----------------


@pytest.fixture(scope="module")
def guarded(start_server):
    proc = start_server("guarded", ["--api-key", KEY, "--max-num-seqs", "1",
                                    "--max-waiting-requests", "1", "--max-body-bytes", "4096"])
    yield proc
    proc.stop_and_check()


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.slow
def test_api_key_is_required_except_for_health(guarded):
    body = {"prompt": "Hi", "max_tokens": 2}
    assert_error(post(guarded.url, body), 401, "API key")
    assert_error(post(guarded.url, body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(guarded.url + "/v1/models", timeout=30), 401)
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200
    assert post(guarded.url, body, headers=AUTH).status_code == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.slow
def test_oversized_body_is_413_before_parsing(guarded):
    big = '{"prompt": "' + "x" * 8000 + '"}'
    assert_error(post(guarded.url, big, headers=AUTH), 413, "4096")


@pytest.mark.slow
def test_full_waiting_queue_is_503_with_retry_after(guarded):
    """max_num_seqs=1, max_waiting_requests=1: one request runs, one waits, the third is refused."""
    long = {"prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = [threading.Event(), threading.Event()]
    stop = threading.Event()

    def stream(i: int) -> None:
        with httpx.stream("POST", guarded.url + "/v1/completions", json=long, headers=AUTH,
                          timeout=300) as r:
            for _ in r.iter_lines():
                started[i].set()
                if stop.is_set():
                    return

    def wait_state(running: int, waiting: int) -> None:
        for _ in range(600):
            s = httpx.get(guarded.url + "/kv_cache", headers=AUTH, timeout=30).json()["stats"]
            if s["num_running"] == running and s["num_waiting"] == waiting:
                return
            threading.Event().wait(0.1)
        raise AssertionError(f"never reached running={running} waiting={waiting}: {s}")

    threads = [threading.Thread(target=stream, args=(0,), daemon=True)]
    threads[0].start()
    wait_state(1, 0)
    threads.append(threading.Thread(target=stream, args=(1,), daemon=True))
    threads[1].start()
    wait_state(1, 1)
    try:
        r = post(guarded.url, {"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
        err = assert_error(r, 503, "waiting", "limit 1")
        assert r.headers["retry-after"].isdigit(), err
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    wait_state(0, 0)
    assert post(guarded.url, {"prompt": "Hi", "max_tokens": 2}, headers=AUTH).status_code == 200
