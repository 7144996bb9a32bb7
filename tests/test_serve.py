"""`edgellm serve` end to end: a live server subprocess on 127.0.0.1 (cpu backend, default model),
driven by the official openai client and raw HTTP. The server starts once for the module."""

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package is built on (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
PARALLEL = 8
CTX = 512
PROMPTS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello.",
           "What do bees make?", "Name a planet.", "What color is the sky?", "What is ice made of?"]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("EDGELLM_API_KEY", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [sys.executable, "-m", "edgellm", "serve", "--backend", "cpu", "--port", str(port),
           "--parallel", str(PARALLEL), "--ctx", str(CTX), "--max-body", "65536", "--max-queue", "16"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"the server exited: {proc.stdout.read()}"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up in 180 s"
        time.sleep(0.5)
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from edgellm.gguf_file import open_gguf
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.from_metadata(open_gguf(str(default_model_path)).metadata)


def _health(base):
    return httpx.get(base + "/health", timeout=10).json()


def _chat(client, model_id, prompt, **kw):
    return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


def test_models_and_health(server, client, model_id, default_model_path):
    assert model_id == default_model_path.name.removesuffix(".gguf")
    h = _health(server[1])
    assert h["status"] == "ok" and h["slots"] == PARALLEL and h["busy"] == 0 and h["free"] == PARALLEL


def test_greedy_chat_matches_edgellm_run(client, model_id, tokenizer):
    prompt = PROMPTS[0]
    run = subprocess.run([sys.executable, "-m", "edgellm", "run", "--backend", "cpu", "--temperature", "0",
                          "-n", "24", "-q", prompt], env=_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    r = _chat(client, model_id, prompt, max_tokens=24)
    assert r.choices[0].message.content == run.stdout.removesuffix("\n")
    assert r.choices[0].message.role == "assistant"
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                       add_bos=False)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_frequency_and_presence_penalties_reach_the_sampler(client, model_id, default_model):
    """OpenAI's frequency_penalty and presence_penalty change the answer as the engine's own
    sampler with the same penalties does (greedy, so the tokens are comparable)."""
    from edgellm.sampling import SamplingParams

    prompt = PROMPTS[0]
    kw = dict(frequency_penalty=1.5, presence_penalty=0.8)
    r = _chat(client, model_id, prompt, max_tokens=20, **kw)
    ids = default_model.chat_tokens([{"role": "user", "content": prompt}])
    want = default_model.tokenizer.decode(list(default_model.generate_tokens(
        ids, 20, SamplingParams(temperature=0, **kw))))
    plain = default_model.tokenizer.decode(list(default_model.generate_tokens(ids, 20, SamplingParams(temperature=0))))
    assert r.choices[0].message.content == want and want != plain


def test_streamed_chat_equals_the_whole_answer(client, model_id):
    whole = _chat(client, model_id, PROMPTS[1], max_tokens=16)
    chunks = list(_chat(client, model_id, PROMPTS[1], max_tokens=16, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the second identical request reused the first one's prefix from a slot's cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stop_strings(client, model_id, tokenizer):
    prompt = "The three largest cities of France are"
    full = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=20)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    want = text[: text.index(stop)]
    cut = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=20, stop=[stop, "@@@"])
    assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=model_id, prompt=prompt, temperature=0, max_tokens=20, stop=stop,
                                         stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == want
    assert pieces[-1].choices[0].finish_reason == "stop" and pieces[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_logprobs_are_the_models_distribution(client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", temperature=0, max_tokens=3,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 3
    for chosen, lp_chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # greedy: the chosen token is the most likely one; probabilities of the top 3 sum below 1
        assert lp_chosen == pytest.approx(max(top.values())) and top[chosen] == pytest.approx(lp_chosen)
        assert sum(pow(2.718281828459045, v) for v in top.values()) <= 1 + 1e-9


def test_errors_have_status_and_openai_body(server, client, model_id):
    base = server[1]
    r = httpx.post(base + "/v1/chat/completions", content=b'{"model": "x", "messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt=[1] * (CTX + 10), max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and str(CTX) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="hi", max_tokens=CTX + 1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="hi", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.body["param"] == "temperature"
    r = httpx.post(base + "/v1/completions", json={"prompt": "x" * 70000}, timeout=30)
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
    assert _health(base)["busy"] == 0


def test_client_disconnect_frees_its_slot(server):
    base = server[1]
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert '"error"' not in line, line
                    got += 1
                    if got == 3:
                        assert _health(base)["busy"] == 1  # generating, far from its 400 tokens
                        break
    deadline = time.monotonic() + 20
    while _health(base)["busy"] != 0:
        assert time.monotonic() < deadline, "the slot of a client that went away is still busy"
        time.sleep(0.1)


def _scrape(base):
    from edgellm.serve.metrics import parse

    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    return parse(r.text)


def test_metrics_count_what_the_answers_report(server, client, model_id):
    """GET /metrics (Prometheus text, read back with prometheus_client's parser): the counters move
    by what the answers' usage says, and the model thread's iteration intervals and the event
    loop's lag are observed."""
    before = _scrape(server[1])
    chat = _chat(client, model_id, PROMPTS[2], max_tokens=8)
    text = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = _scrape(server[1])

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("edgellm_generated_tokens_total") == chat.usage.completion_tokens + text.usage.completion_tokens
    assert text.usage.completion_tokens == 5 and text.choices[0].finish_reason == "length"
    reasons = {"stop": 0, "length": 0}
    for r in (chat, text):
        reasons[r.choices[0].finish_reason] += 1
    for reason, n in reasons.items():
        assert moved(f'edgellm_requests_total{{reason="{reason}"}}') == n, reason
    cached = sum((r.usage.prompt_tokens_details.cached_tokens or 0) for r in (chat, text))
    assert moved("edgellm_prompt_tokens_total") == chat.usage.prompt_tokens + text.usage.prompt_tokens - cached
    # every generated token after the first of each request came from a decode step
    steps, rows = moved("edgellm_decode_steps_total"), moved("edgellm_decode_rows_total")
    assert 1 <= steps <= rows and rows >= moved("edgellm_generated_tokens_total") - 2
    # one interval between each two iterations of a request's run (these two ran one after the other)
    assert moved("edgellm_scheduler_interval_seconds_count") >= steps - 2
    assert moved("edgellm_event_loop_lag_seconds_count") >= 1
    assert after["edgellm_slots_busy"] == 0 and after["edgellm_requests_waiting"] == 0
    assert moved("edgellm_one_time_seconds_total") == 0  # the cpu backend compiles nothing per shape


def test_concurrent_clients_each_get_their_own_answer(server, client, model_id):
    alone = [_chat(client, model_id, p, max_tokens=12).choices[0].message.content for p in PROMPTS]
    assert len(set(alone)) > 1
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _chat(client, model_id, p, max_tokens=12).choices[0].message.content,
                                 PROMPTS))
    assert together == alone
    assert _health(server[1])["busy"] == 0


def test_sigterm_shuts_down_cleanly(server):
    proc, base = server
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "stopped" in out and "Traceback" not in out
    with pytest.raises(httpx.HTTPError):
        httpx.get(base + "/health", timeout=2)
